-- #integration: the lock-delay.  A name whose lease ended without a release
-- (its holder killed, cut off, or force-released) cannot be taken until
-- lock_delay seconds after the lease's end, on the server's clock; a release
-- by the holder ends the delay at once; status and a busy attempt's info say
-- until when.  Named locks, a semaphore's permit, an election, the command.
local helpers = require "helpers"
local cjson = require "cjson"
local core = require "mongolock.core"

local monotonic = core.monotonic
local format = string.format
local unpack = table.unpack or unpack

-- The child: takes KIND (named | permit | elect) of NAME with ttl TTL,
-- lock_delay DELAY and renewal RENEW ("1" or "0"), prints "held PID TOKEN",
-- sleeps until killed.
local CHILD = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, kind, name, ttl, delay, renew = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "delay-child" }))
local o = { ttl = tonumber(ttl), lock_delay = tonumber(delay), renew = renew == "1", timeout = 10 }
local ns = { database = db, collection = coll }
local h
if kind == "named" then
  h = assert(c:locks(ns):acquire(name, o))
elseif kind == "permit" then
  h = assert(c:semaphores({ database = db, collection = coll, permits = 1 }):acquire(name, o))
else
  h = assert(c:elections(ns):campaign(name, "child", o))
end
io.stdout:write("held ", core.getpid(), " ", h:token_string(), "\n")
io.stdout:flush()
core.sleep(120)
]]

-- the server's time (ms) of the write that issued a token: every kind's
-- token is max(previous + 1, server ms * 1024), and a fresh name's first
-- takers in these tests are a second apart
local function token_ms(token)
  return math.floor(tonumber(tostring(token)) / 1024)
end

describe("#integration lock_delay", function()
  local client, locks, script

  setup(function()
    client = helpers.connect({ appname = "delay-parent" })
    locks = helpers.locks(client)
    script = helpers.script(CHILD)
  end)
  teardown(function()
    client:close()
    os.remove(script)
  end)

  -- starts a holder child; returns the process, its pid and its token
  local function holder(kind, name, ttl, delay, renew)
    local p = helpers.spawn(script, { locks.database, locks.collection, kind, name, tostring(ttl),
      tostring(delay), renew and "1" or "0" })
    local out = assert(p:wait_for("(held %d+ %d+)"))
    local pid, token = out:match("held (%d+) (%d+)")
    return p, tonumber(pid), token
  end

  local function kill(p, pid)
    p:kill("KILL", pid)
    assert.is_truthy(p:wait(10))
    p:cleanup()
  end

  it("a killed holder's name is taken no sooner than ttl + lock_delay after its last renewal", function()
    local name = helpers.unique("delay-kill")
    local ttl, delay = 2, 3
    local p, pid = holder("named", name, ttl, delay, true)
    core.sleep(1)                     -- a renewal or more (every ttl/3)
    kill(p, pid)
    local killed = monotonic()
    -- the lease's end on the server's clock: the last renewal plus ttl
    local st = assert(locks:status(name))
    assert.equal(pid, st.holder.pid)
    local last = st.expires_at - ttl
    -- in the delay: status says so and until when
    core.sleep(math.max(0, st.expires_at - last - (monotonic() - killed)) + 0.3)
    st = assert(locks:status(name))
    assert.equal("delayed", st.state)
    assert.is_false(st.held)
    assert.is_true(st.delayed, "not in its delay")
    assert.near(last + ttl + delay, st.delay_until, 0.002)
    assert.is_true(st.delay > 0 and st.delay <= delay, tostring(st.delay))
    local _, err, info = locks:try(name)
    assert.equal("busy", err)
    assert.is_true(info.delay > 0 and info.delay <= delay, tostring(info.delay))
    assert.near(st.delay_until, info.delay_until, 0.002)
    -- the command says so too
    local args = { "--uri", helpers.uri(), "--database", locks.database, "--collection", locks.collection }
    local function cli(...)
      local a = { unpack(args) }
      for _, v in ipairs({ ... }) do a[#a + 1] = v end
      return helpers.mongolock(a)
    end
    local code, out, cerr = cli("status", "--json", name)
    assert.equal(1, code, cerr)
    local js = cjson.decode(out)
    assert.equal("delayed", js.state)
    assert.is_true(js.delayed)
    assert.is_true(js.delay > 0 and js.delay <= delay)
    _, out = cli("status", name)
    assert.matches("delayed +until %d%d%d%d%-%d%d%-%d%dT[^\n]*%d+%.%d s left", out)
    code, out = cli("list")
    assert.equal(0, code)
    assert.matches(name:gsub("%-", "%%-") .. " +delayed +%d+ ", out)
    code, out = cli("top", "--once", "--json")
    assert.equal(0, code, out)
    local top = cjson.decode(out).locks[1]
    assert.equal("delayed", top.state)
    assert.is_true(top.delay > 0 and top.delay <= delay)
    _, out = cli("top", "--once")
    assert.matches(name:gsub("%-", "%%-") .. " +delayed +%d+ +%- +%d+%.%d s", out)
    -- a waiter: woken at the delay's end, not before
    local h = assert(locks:acquire(name, { timeout = 10 }))
    local took = monotonic()
    local mine = assert(locks:status(name))
    local after = mine.acquired_at - last
    assert.is_true(after >= ttl + delay - 0.0005, format("taken %.3f s after the last renewal", after))
    assert.is_true(after <= 6, format("taken %.3f s after the last renewal", after))
    assert.is_true(took - killed <= 6, format("taken %.3f s after the kill", took - killed))
    assert.is_nil(mine.delayed)
    assert.is_true(h:release())
  end)

  it("a release ends the delay at once; a lease that ran out delays the next", function()
    local name = helpers.unique("delay-release")
    local h = assert(locks:acquire(name, { ttl = 5, lock_delay = 3 }))
    assert.is_true(h:release())
    local st = assert(locks:status(name))
    assert.is_nil(st.delayed)
    local h2 = assert(locks:try(name))      -- at once
    assert.is_true(h2:release())
    -- per collection object; a lease that ends unreleased (no renewal)
    local dl = helpers.locks(client, { collection = locks.collection, lock_delay = 1 })
    local h3 = assert(dl:acquire(name, { ttl = 0.3 }))
    core.sleep(0.5)
    local _, err, info = locks:try(name)
    assert.equal("busy", err)
    assert.is_true(info.delay > 0 and info.delay <= 0.8, tostring(info.delay))
    -- a holder whose lease ran out has lost it: its release is not sent
    assert.same({ nil, "lost" }, { h3:release() })
    assert.is_true(assert(locks:status(name)).delayed)
    local h5 = assert(locks:acquire(name, { timeout = 3 }))
    assert.is_nil(assert(locks:status(name)).delayed)
    assert.is_true(h5:release())
    -- no delay: free at the lease's end, as before
    local h4 = assert(locks:acquire(name, { ttl = 0.3, lock_delay = 0 }))
    assert.is_truthy(h4)
    core.sleep(0.4)
    assert(assert(locks:try(name)):release())
  end)

  it("a release that grants the lock to a waiter gives it the waiter's delay", function()
    local name = helpers.unique("delay-grant")
    local h = assert(locks:acquire(name, { ttl = 5 }))
    -- a watching waiter with ttl 0.3 s and lock_delay 1 s queues
    local w = core.waiter_id()
    local _, err = client._core:acquire(locks.database, locks.collection, name, 300, nil, false, w, 30000,
      false, nil, 1000)
    assert.equal("busy", err)
    assert.is_true(h:release())                     -- granted to w in the same write
    local doc = helpers.lock_doc(client, locks.collection, name)
    assert.equal(w, doc.owner)
    assert.equal(1000, doc.lockDelay)
    core.sleep(0.45)                                -- w never comes: its lease runs out
    local st = assert(locks:status(name))
    assert.equal("delayed", st.state)
    assert.is_true(st.delay > 0 and st.delay <= 1)
  end)

  it("a forced release ends the lease at once and the delay runs from then", function()
    local name = helpers.unique("delay-force")
    local h = assert(locks:acquire(name, { ttl = 30, lock_delay = 2 }))
    assert.is_true(locks:force_release(name))
    local st = assert(locks:status(name))
    assert.is_false(st.held)
    assert.is_true(st.delayed)
    assert.is_true(st.delay > 1.5 and st.delay <= 2, tostring(st.delay))
    local _, err, info = locks:try(name)
    assert.equal("busy", err)
    assert.is_true(info.delay > 1.5 and info.delay <= 2, tostring(info.delay))
    -- the old holder has lost it; its release does not end the delay
    assert.same({ nil, "lost" }, { h:extend() })
    h:release()
    assert.is_true(assert(locks:status(name)).delayed)
    local t0 = monotonic()
    local h2 = assert(locks:acquire(name, { timeout = 5 }))
    local waited = monotonic() - t0
    local mine = assert(locks:status(name))
    assert.is_true(mine.acquired_at >= st.delay_until - 0.0005,
      format("taken %.3f s before the delay's end", st.delay_until - mine.acquired_at))
    assert.is_true(waited < 2.8, format("waited %.3f s", waited))
    -- a forced release after the delay has run out frees it at once
    assert.is_true(h2:release())
    local h3 = assert(locks:acquire(name, { ttl = 0.2, lock_delay = 0.2 }))
    assert.is_truthy(h3)
    core.sleep(0.5)
    locks:force_release(name)
    assert(assert(locks:try(name)):release())
  end)

  it("a killed permit holder's permit is given again no sooner than ttl + lock_delay", function()
    local name = helpers.unique("delay-permit")
    local ttl, delay = 1, 1.5
    local sem = client:semaphores({ database = locks.database, collection = locks.collection, permits = 1 })
    local p, pid, token = holder("permit", name, ttl, delay, false)
    kill(p, pid)
    core.sleep(ttl + 0.2)
    local _, err, info = sem:try(name)
    assert.equal("busy", err)
    assert.is_true(info.delay > 0 and info.delay <= delay, tostring(info.delay))
    local st = assert(sem:status(name))
    assert.is_true(st.delayed)
    assert.is_true(st.delay > 0 and st.delay <= delay)
    assert.equal(0, st.in_use)
    local code, out = helpers.mongolock({ "--uri", helpers.uri(), "--database", locks.database,
      "--collection", locks.collection, "status", name })
    assert.equal(1, code, out)
    assert.matches("state +delayed", out)
    local h = assert(sem:acquire(name, { timeout = 10 }))
    local after = token_ms(h:token_string()) - token_ms(token)
    assert.is_true(after >= (ttl + delay) * 1000, "taken " .. after .. " ms after the child took it")
    assert.is_true(after <= (ttl + delay + 1) * 1000, "taken " .. after .. " ms after the child took it")
    assert.is_true(h:release())
    -- a release ends it at once
    local h2 = assert(sem:acquire(name, { lock_delay = 5 }))
    assert.is_true(h2:release())
    assert(assert(sem:try(name)):release())
  end)

  it("a killed leader's election is won again no sooner than ttl + lock_delay", function()
    local name = helpers.unique("delay-elect")
    local ttl, delay = 1, 1.5
    local el = client:elections({ database = locks.database, collection = locks.collection })
    local p, pid, token = holder("elect", name, ttl, delay, false)
    kill(p, pid)
    local leader = assert(el:campaign(name, "parent", { timeout = 10 }))
    local after = token_ms(leader.token) - token_ms(token)
    assert.is_true(after >= (ttl + delay) * 1000, "led " .. after .. " ms after the child's term")
    assert.is_true(after <= (ttl + delay + 1) * 1000, "led " .. after .. " ms after the child's term")
    assert.is_true(leader:resign())
    -- per elections object
    local el2 = client:elections({ database = locks.database, collection = locks.collection, lock_delay = 0.5 })
    local l2 = assert(el2:campaign(name, "again", { ttl = 0.2, renew = false }))
    assert.is_truthy(l2)
    core.sleep(0.3)
    local _, err, info = el:campaign(name, "third", { timeout = 0 })
    assert.equal("timeout", err)
    assert.is_true(info.delay > 0 and info.delay <= 0.5, tostring(info.delay))
  end)

  it("the command's exec and elect pass --lock-delay", function()
    local name = helpers.unique("delay-cli")
    local args = { "--uri", helpers.uri(), "--database", locks.database, "--collection", locks.collection }
    -- the command's child kills mongolock (its parent): nobody releases
    local a = { unpack(args) }
    for _, v in ipairs({ "exec", "--ttl", "1", "--lock-delay", "2", name, "--", "sh", "-c",
                         "kill -KILL $PPID" }) do a[#a + 1] = v end
    helpers.mongolock(a)
    core.sleep(1.2)
    local st = assert(locks:status(name))
    assert.is_true(st.delayed, "exec --lock-delay 2 left no delay")
    assert.is_true(st.delay > 0.3 and st.delay <= 2, tostring(st.delay))
    local e = { unpack(args) }
    local ename = helpers.unique("delay-clie")
    for _, v in ipairs({ "elect", "--ttl", "1", "--lock-delay", "2", ename, "--", "sh", "-c",
                         "kill -KILL $PPID" }) do e[#e + 1] = v end
    helpers.mongolock(e)
    core.sleep(1.2)
    st = assert(locks:status(ename))
    assert.is_true(st.delayed, "elect --lock-delay 2 left no delay")
  end)

  it("resty.mongolock's lock_delay option keeps a key whose lease ran out", function()
    local resty = require "resty.mongolock"
    local o = { client = client, database = locks.database, collection = locks.collection, exptime = 0.3,
                timeout = 0, lock_delay = 1 }
    local key = helpers.unique("delay-resty")
    local lock = assert(resty:new(o))
    assert.equal(0, lock:lock(key))
    core.sleep(0.5)                                  -- no unlock: the lease runs out
    local st = assert(locks:status(key))
    assert.is_true(st.delayed)
    assert.same({ nil, "timeout" }, { assert(resty:new(o)):lock(key) })
    o.lock_delay = "1"
    assert.has_error(function() resty:new(o) end)
  end)

  it("a scheduler's coroutine passes lock_delay too (cqueues)", function()
    local cqueues = require "cqueues"
    local cq = cqueues.new()
    local sc = helpers.connect({ scheduler = "cqueues" })
    local sl = sc:locks({ database = locks.database, collection = locks.collection })
    local sem = sc:semaphores({ database = locks.database, collection = locks.collection, permits = 1 })
    local name, pname = helpers.unique("delay-cq"), helpers.unique("delay-cqp")
    local done
    cq:wrap(function()
      assert(sl:try(name, { ttl = 0.2, lock_delay = 1 }))
      assert(sem:try(pname, { ttl = 0.2, lock_delay = 1 }))
      done = true
    end)
    assert(cq:loop())
    assert.is_true(done)
    core.sleep(0.4)
    assert.is_true(assert(locks:status(name)).delayed)
    local sst = assert(client:semaphores({ database = locks.database, collection = locks.collection,
      permits = 1 }):status(pname))
    assert.is_true(sst.delayed)
    sc:close()
  end)

  it("checks lock_delay like the other options: a wrong type or a negative number raises", function()
    local name = helpers.unique("delay-args")
    assert.has_error(function() locks:try(name, { lock_delay = "3" }) end)
    assert.has_error(function() locks:try(name, { lock_delay = -1 }) end)
    assert.has_error(function() locks:try(name, { lock_delay = 0 / 0 }) end)
    assert.has_error(function() client:locks({ lock_delay = true }) end)
    assert.has_error(function() client:semaphores({ permits = 1, lock_delay = {} }) end)
    assert.has_error(function() client:elections({ lock_delay = "x" }) end)
    local el = client:elections({ database = locks.database, collection = locks.collection })
    assert.has_error(function() el:campaign(name, "v", { lock_delay = "x" }) end)
    local code, _, err = helpers.mongolock({ "--uri", helpers.uri(), "exec", "--lock-delay", "x", name, "true" })
    assert.equal(64, code, err)
    local h = assert(locks:try(name, { lock_delay = 0 }))
    assert.is_true(h:release())
  end)
end)

-- The builders (no server): a zero delay writes what it wrote before (the
-- field removed, which leaves a document without it as it was), a delay
-- its milliseconds; a waiter's entry carries it for a grant.
describe("#unit lock_delay builders", function()
  local DEAD = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=200&connectTimeoutMS=200"
  local OWNER = ("0123456789abcdef"):rep(2)
  local c
  setup(function() c = assert(core.connect(DEAD)) end)
  teardown(function() c:close() end)

  local function set_of(a) return assert(core.bson_decode(a:op())).cmd.update[4]["$set"] end

  it("writes lockDelay only when > 0, and a waiter's entry carries d", function()
    local zero = set_of(c:acquire_attempt("d", "c", "n", 5000, nil, nil, nil, nil, nil, OWNER))
    assert.same({ "$_mlt", "$$REMOVE", "$lockDelay" }, zero.lockDelay["$cond"])
    local three = set_of(c:acquire_attempt("d", "c", "n", 5000, nil, nil, nil, nil, nil, OWNER, 3000))
    assert.same({ "$_mlt", 3000, "$lockDelay" }, three.lockDelay["$cond"])
    local w = c:acquire_attempt("d", "c", "n", 5000, nil, nil, OWNER, 3000, false, nil, 2500)
    local entry = set_of(w).queue["$cond"][3]["$cond"][3]["$concatArrays"][2][1]
    assert.equal(2500, entry.d)
    assert.has_error(function() c:acquire_attempt("d", "c", "n", 5000, nil, nil, nil, nil, nil, OWNER, -1) end)
    assert.has_error(function() c:acquire_attempt("d", "c", "n", 5000, nil, nil, nil, nil, nil, OWNER, "x") end)
  end)
end)
