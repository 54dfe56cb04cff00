-- #integration: a lease taken over, force-released or deleted is known to
-- its holder within about one round trip of that write (issue 46), through
-- the process's change stream, not at its next renewal (ttl/3 later): the
-- handle's lost(), client:on_lost, the command's signal to its child, and an
-- election's check().  Against a server without change streams (a
-- standalone) the renewal's bound holds instead; these run where streams
-- exist (the stand-in's replica set, or MONGODB_URI's).
local helpers = require "helpers"
local core = require "mongolock.core"

local format = string.format
local q = helpers.shell_quote
local CHILD = helpers.root .. "/spec/lost_push_child.lua"

local function read(path)
  return helpers.read_file(path) or ""
end

-- waits up to timeout seconds for fn() to be true; the time it became so
local function poll(fn, timeout, what)
  local deadline = core.monotonic() + timeout
  repeat
    if fn() then return core.monotonic() end
    core.sleep(0.005)
  until core.monotonic() > deadline
  error("timed out waiting for " .. what, 2)
end

local function child(coll, mode, name, ttl)
  return helpers.spawn(CHILD, { helpers.database, coll, mode, name, tostring(ttl) })
end

-- the holder child p printed "lost T" (lost() turned true) and "onlost T"
-- (its on_lost callback ran), each within `bound` seconds of t0
local function saw_loss_within(p, t0, bound)
  local lost = tonumber((assert(p:wait_for("\nlost (%S+)", 15))))
  local onlost = tonumber((assert(p:wait_for("\nonlost (%S+)", 15))))
  assert.is_true(lost - t0 < bound, format("lost() after %.3f s", lost - t0))
  assert.is_true(onlost - t0 < bound, format("on_lost after %.3f s", onlost - t0))
end

local function signal(pid, sig)
  os.execute(format("kill -%s %d", sig, pid))
end

describe("#integration a lost lease is pushed to its holder", function()
  local holder, other, coll

  before_each(function()
    coll = helpers.unique("lostpush")
    holder = helpers.connect({ appname = "lost-push" })
    other = helpers.connect()
  end)
  after_each(function()
    holder:close()
    other:close()
  end)

  it("a forced release from another client: lost() and on_lost within 0.5 s at ttl 30", function()
    local la = holder:locks({ database = helpers.database, collection = coll })
    local lb = other:locks({ database = helpers.database, collection = coll })
    local name = helpers.unique("forced")
    local fired
    holder:on_lost(function(ev) fired = ev end)
    local h = assert(la:acquire(name, { ttl = 30 }))
    core.sleep(0.2)
    local t0 = core.monotonic()
    assert.is_true(lb:force_release(name))
    local t1 = poll(function() return h:lost() end, 12, "h:lost()")
    assert.is_true(t1 - t0 < 0.5, format("lost() after %.3f s", t1 - t0))
    local t2 = poll(function() holder:poll(); return fired end, 12, "on_lost")
    assert.is_true(t2 - t0 < 0.5, format("on_lost after %.3f s", t2 - t0))
    assert.equal(h.owner, tostring(fired.owner))
    local ok, err = h:check()
    assert.is_nil(ok)
    assert.equal("lost", err)
  end)

  it("a delete of the held lock's document: lost() within 0.5 s at ttl 30", function()
    local la = holder:locks({ database = helpers.database, collection = coll })
    local name = helpers.unique("deleted")
    local h = assert(la:acquire(name, { ttl = 30 }))
    core.sleep(0.2)
    local t0 = core.monotonic()
    assert(other:command(helpers.database, { delete = coll },
      { deletes = { { q = { _id = name }, limit = 1 } } }))
    local t1 = poll(function() return h:lost() end, 12, "h:lost()")
    assert.is_true(t1 - t0 < 0.5, format("lost() after %.3f s", t1 - t0))
  end)

  it("a release by its holder is no loss, and a new lease of the name is not lost", function()
    local la = holder:locks({ database = helpers.database, collection = coll })
    local lb = other:locks({ database = helpers.database, collection = coll })
    local name = helpers.unique("kept")
    local h1 = assert(la:acquire(name, { ttl = 30 }))
    assert.is_true(h1:release())
    local h2 = assert(la:acquire(name, { ttl = 30 }))
    -- another client's try is busy: the lease is untouched
    local none, err = lb:try(name)
    assert.is_nil(none)
    assert.equal("busy", err)
    core.sleep(0.5)
    assert.is_false(h1:lost())
    assert.is_true(h2:held())
    assert.is_true(h2:release())
  end)

  it("a forced release of another process's lock: its lost() and on_lost within 0.5 s", function()
    local name = helpers.unique("forcedproc")
    local p = child(coll, "hold", name, 30)
    assert(p:wait_for("^held"))
    core.sleep(0.2)
    local lb = other:locks({ database = helpers.database, collection = coll })
    local t0 = core.monotonic()
    assert.is_true(lb:force_release(name))
    saw_loss_within(p, t0, 0.5)
    p:wait(10)
    p:cleanup()
  end)

  it("a takeover while the holder was stopped: lost() and on_lost within 0.5 s of SIGCONT", function()
    local name = helpers.unique("takeover")
    local p = child(coll, "hold", name, 2)
    local pid = tonumber((assert(p:wait_for("^held (%d+)"))))
    signal(pid, "STOP")
    core.sleep(2.5)
    local lb = other:locks({ database = helpers.database, collection = coll })
    local h = assert(lb:try(name, { ttl = 30 }))
    local t0 = core.monotonic()
    signal(pid, "CONT")
    saw_loss_within(p, t0, 0.5)
    assert.is_true(h:release())
    p:wait(10)
    p:cleanup()
  end)

  it("a stopped leader taken over answers check() false once it runs again", function()
    local name = helpers.unique("leader")
    local p = child(coll, "lead", name, 2)
    local pid = tonumber((assert(p:wait_for("^leading (%d+)"))))
    signal(pid, "STOP")
    core.sleep(2.5)
    local el = other:elections({ database = helpers.database, collection = coll })
    local leader = assert(el:campaign(name, "parent", { ttl = 30, timeout = 5 }))
    local t0 = core.monotonic()
    signal(pid, "CONT")
    local line = assert(p:wait_for("\n(notleader %S+ %S+)", 15))
    local at, last = line:match("notleader (%S+) (%S+)")
    -- no check() answered true after the leader ran again
    assert.is_true(tonumber(last) < t0, line)
    assert.is_true(tonumber(at) - t0 < 0.5, line)
    assert(leader:resign())
    p:wait(10)
    p:cleanup()
  end)

  it("mongolock exec: the child gets SIGTERM within 0.5 s of release --force at ttl 30", function()
    local name = helpers.unique("execforced")
    local out, err, rc = os.tmpname(), os.tmpname(), os.tmpname()
    os.remove(rc)
    local base = { "--uri", helpers.uri(), "--database", helpers.database, "--collection", coll }
    local args = {}
    for _, v in ipairs(base) do args[#args + 1] = v end
    for _, v in ipairs({ "exec", "--ttl", "30", name, "--", "sh", "-c",
      "trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.05; done" }) do
      args[#args + 1] = v
    end
    os.execute(format("( %s%s >%s 2>%s </dev/null; echo $? >%s ) >/dev/null 2>&1 &",
      helpers.child_env, helpers.cli_words(args), q(out), q(err), q(rc)))
    poll(function() return read(out):match("ready") end, 20, "ready")
    core.sleep(0.2)
    local rargs = {}
    for _, v in ipairs(base) do rargs[#rargs + 1] = v end
    for _, v in ipairs({ "release", "--force", "--yes", name }) do rargs[#rargs + 1] = v end
    local code, _, rerr = helpers.mongolock(rargs)
    local t0 = core.monotonic()
    assert.equal(0, code, rerr)
    local t1 = poll(function() return read(out):match("got TERM") end, 15, "the child's TERM")
    assert.is_true(t1 - t0 < 0.5, format("SIGTERM after %.3f s", t1 - t0))
    poll(function() return read(rc):match("%d") end, 15, "exit")
    for _, f in ipairs({ out, err, rc }) do os.remove(f) end
  end)
end)
