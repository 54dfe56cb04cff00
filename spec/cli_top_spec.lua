-- mongolock top: a live view of a collection's locks; --once --json gives
-- one snapshot (holder, time left, token, queue length and the waiters),
-- and it writes nothing.
local helpers = require "helpers"
local cjson = require "cjson"
local core = require "mongolock.core"

local format = string.format
local q = helpers.shell_quote
local BIN = helpers.root .. "/bin/mongolock"

local mongolock = helpers.mongolock
local mongolock_array = require("mongolock").array

describe("#integration mongolock top", function()
  local client, locks, base

  setup(function()
    client = helpers.connect({ appname = "top-spec" })
    locks = helpers.locks(client, { ttl = 60 })
    base = { "--uri", helpers.uri(), "--database", locks.database, "--collection", locks.collection }
  end)
  teardown(function()
    client:close()
  end)

  local function args(...)
    local t = {}
    for _, v in ipairs(base) do t[#t + 1] = v end
    for _, v in ipairs({ ... }) do t[#t + 1] = v end
    return t
  end

  it("--once --json lists a held lock with its waiters, and writes nothing", function()
    local h = assert(locks:acquire("job"))
    -- two waiters queued behind the holder (attempts that keep their
    -- place for 60 s)
    local w1, w2 = assert(core.waiter_id()), assert(core.waiter_id())
    for _, w in ipairs({ w1, w2 }) do
      local x, err = client._core:acquire(locks.database, locks.collection, "job", 60000, "top-waiter",
        false, w, 60000, false)
      assert.is_nil(x)
      assert.equal("busy", err)
    end
    assert(locks:try("idle")):release()
    local before = helpers.lock_doc(client, locks.collection, "job")

    local code, out, err = mongolock(args("top", "--once", "--json"))
    assert.equal(0, code, err)
    local snap = cjson.decode(out)
    assert.equal(locks.database, snap.database)
    assert.equal(locks.collection, snap.collection)
    assert.equal(2, #snap.locks)
    local job, idle = snap.locks[2], snap.locks[1]
    assert.equal("idle", idle.name)
    assert.is_false(idle.held)
    assert.equal(0, idle.waiting)
    assert.equal("job", job.name)
    assert.is_true(job.held)
    assert.equal(format("%.0f", h.token), job.token)
    assert.equal(h.owner, job.owner)
    assert.equal("top-spec", job.holder.app)
    assert.is_true(job.remaining > 50 and job.remaining <= 60, tostring(job.remaining))
    assert.equal(2, job.waiting)
    assert.equal(2, #job.waiters)
    for _, w in ipairs(job.waiters) do
      assert.equal("top-waiter", w.app)
      assert.equal(core.getpid(), w.pid)
      assert.is_true(w.remaining > 50, tostring(w.remaining))
    end

    -- nothing written: the document is as it was
    assert.same(before, helpers.lock_doc(client, locks.collection, "job"))
    -- the text view: a header and one row per lock
    code, out = mongolock(args("top", "--once"))
    assert.equal(0, code)
    assert.matches("NAME +STATE +TOKEN +HOLDER +LEFT +QUEUE", out)
    assert.matches("\njob +held +%d+ +[^\n]*top%-spec[^\n]* 2\n", out)
    assert.is_true(h:release())
  end)

  it("prints plain snapshots, without the terminal's escapes, when stdout is not a terminal", function()
    local h = assert(locks:acquire("plain"))
    local out, rc = os.tmpname(), os.tmpname()
    os.remove(rc)
    local words = { helpers.lua, q(BIN) }
    for _, a in ipairs(args("top", "--seconds", "3")) do words[#words + 1] = q(a) end
    os.execute(format("( %s%s </dev/null >%s 2>&1; echo $? >%s ) >/dev/null 2>&1 &", helpers.child_env,
      table.concat(words, " "), q(out), q(rc)))
    local function text() return helpers.read_file(out) or "" end
    assert.is_truthy(helpers.eventually(function() return text():find("\nplain ", 1, true) end, 8), text())
    local n = select(2, text():gsub("NAME +STATE", ""))
    assert.is_true(h:release())
    -- the release shows as a new snapshot, after the first
    assert.is_truthy(helpers.eventually(function()
      return select(2, text():gsub("NAME +STATE", "")) > n and text():find("\nplain +free")
    end, 6), text())
    local code = helpers.eventually(function() return tonumber((helpers.read_file(rc) or ""):match("%d+")) end, 10)
    assert.equal(0, code, "top --seconds 3 still runs")
    local all = text()
    os.remove(out)
    os.remove(rc)
    assert.is_nil(all:find("\27", 1, true), all)
    assert.matches("^mongolock top  " .. locks.database:gsub("%p", "%%%0") .. "%.", all)
    -- no countdown redraws between events: a snapshot per event (at most
    -- the first, the release's and one when the lease shown would end)
    assert.is_true(select(2, all:gsub("NAME +STATE", "")) <= 3, all)
  end)

  local function refreshed_by_release(name, app)
    local h = assert(locks:acquire(name))
    -- top without --once, for a bounded time, printing each refresh as JSON
    local out = os.tmpname()
    local words = { helpers.lua, q(BIN) }
    for _, a in ipairs(args("top", "--json", "--seconds", "8", "--app", app)) do words[#words + 1] = q(a) end
    local p = assert(io.popen(format("%s </dev/null >%s 2>&1 & echo $!", table.concat(words, " "), q(out))))
    local pid = tonumber(p:read("*l"))
    p:close()
    local function snaps()
      local list = {}
      for line in (helpers.read_file(out) or ""):gmatch("[^\n]+") do
        local ok, v = pcall(cjson.decode, line)
        if ok and type(v) == "table" and v.locks then list[#list + 1] = v end
      end
      return list
    end
    local function live_held(s)
      for _, l in ipairs(s.locks) do if l.name == name then return l.held end end
    end
    assert.is_truthy(helpers.eventually(function() return #snaps() >= 1 end, 8), helpers.read_file(out))
    assert.is_true(live_held(snaps()[1]))
    local n = #snaps()
    assert.is_true(h:release())
    local got = helpers.eventually(function()
      local s = snaps()
      return #s > n and live_held(s[#s]) == false
    end, 6)
    -- the lease had 60 s left and top reads the server again only on an
    -- event (or when a lease it shows runs out): the release's event
    local text = helpers.read_file(out)
    assert.is_truthy(got, text)
    os.execute("kill " .. pid .. " 2>/dev/null")
    os.remove(out)
    return text
  end

  it("is refreshed by the change stream: a release shows at once", function()
    refreshed_by_release("live", helpers.unique("top"))
  end)

  it("resumes its change stream when a getMore's connection closes, and still shows a release at once", function()
    local app = helpers.unique("top")
    local function fp(mode, data)
      data.appName = app
      return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    fp({ times = 2 }, { failCommands = mongolock_array({ "getMore" }), closeConnection = true })
    finally(function() fp("off", {}) end)
    local text = refreshed_by_release("resumed", app)
    assert.is_true(fp("off", {}).count >= 1, "a getMore lost its connection")
    assert.is_nil(text:find("change stream failed", 1, true), text)
  end)
end)
