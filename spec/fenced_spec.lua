-- #integration fenced writes (h:fenced, mongolock.fenced): the database
-- itself refuses a stale holder's write.  A document written through a
-- fenced object keeps the newest token that wrote it; a write with an
-- older token changes nothing and answers "fenced".
local helpers = require "helpers"
local core = require "mongolock.core"
local mongolock = require "mongolock"

local DB = helpers.database

describe("#integration fenced writes", function()
  local client, locks, coll
  setup(function()
    client = helpers.connect({ appname = "fenced-spec" })
    locks = helpers.locks(client, { ttl = 10 })
    coll = helpers.unique("fenced")
  end)
  teardown(function()
    client:close()
  end)

  local function doc(id)
    local r = assert(client:command(DB, { find = coll }, { filter = { _id = id }, limit = 1, singleBatch = true }))
    return r.cursor.firstBatch[1]
  end

  local function digits(v)
    if math.type and math.type(v) == "integer" then return tostring(v) end
    return ("%.0f"):format(v)
  end

  it("refuses bad arguments at the caller", function()
    local h = assert(locks:acquire(helpers.unique("k")))
    assert.has_error(function() h:fenced(5) end, "bad argument #1 to 'fenced' (string expected, got number)")
    assert.has_error(function() h:fenced(coll, { fields = "x" }) end)
    assert.has_error(function() h:fenced(coll, { field = "a.b" }) end)
    assert.has_error(function() h:fenced(coll, { field = "_id" }) end)
    local f = h:fenced(coll)
    assert.has_error(function() f:update("x", { ["$set"] = { a = 1 } }) end)
    assert.has_error(function() f:update({ _id = 1 }, { ["$set"] = { fence = 1 } }) end,
      "bad argument #2 to 'update' (update must not change fence)")
    assert.has_error(function() f:update({ _id = 1 }, { ["$set"] = { a = 1 } }, { upsert = 1 }) end)
    assert.has_error(function() f:replace({ _id = 1 }, 7) end)
    assert.has_error(function() f:insert(7) end)
    assert.has_error(function() f:find_and_modify({ _id = 1 }, { ["$set"] = { a = 1 } }, { new = "yes" }) end)
    assert.is_true(h:release())
  end)

  it("writes with the newest token and refuses an older one, changing nothing", function()
    local name = helpers.unique("k")
    local h1 = assert(locks:acquire(name))
    local f1 = h1:fenced(coll)
    assert.equal(1, f1:update({ _id = "p" }, { ["$inc"] = { n = 1 } }, { upsert = true }))
    assert.equal(h1:token_string(), digits(doc("p").fence))
    -- the same token writes again (equal is not newer)
    assert.equal(1, f1:update({ _id = "p" }, { ["$inc"] = { n = 1 } }))
    -- no such document: 0, nothing inserted
    assert.equal(0, f1:update({ _id = "none" }, { ["$inc"] = { n = 1 } }))
    assert.is_nil(doc("none"))
    -- a document never fenced is written, and fenced from then on
    assert(client:command(DB, { insert = coll }, { documents = mongolock.array({ { _id = "plain", n = 5 } }) }))
    assert.equal(1, f1:update({ _id = "plain" }, { ["$inc"] = { n = 1 } }))
    assert.equal(6, doc("plain").n)
    assert.is_true(h1:release())
    assert.same({ nil, "not held" }, { f1:update({ _id = "p" }, { ["$inc"] = { n = 1 } }) })

    local h2 = assert(locks:acquire(name))
    local f2 = h2:fenced(coll)
    assert.equal(1, f2:update({ _id = "p" }, { ["$set"] = { by = "h2" } }))
    assert.equal(h2:token_string(), digits(doc("p").fence))

    -- the first holder's writes, as if its handle still thought it held the
    -- lock (a write delayed on the way, a paused process): refused
    local stale = h1:fenced(coll)
    stale.check = function() return true end
    local before = doc("p")
    for _, call in ipairs({
      function() return stale:update({ _id = "p" }, { ["$set"] = { by = "old" } }) end,
      function() return stale:update({ _id = "p" }, { ["$set"] = { by = "old" } }, { upsert = true }) end,
      function() return stale:replace({ _id = "p" }, { by = "old" }) end,
      function() return stale:delete({ _id = "p" }) end,
      function() return stale:find_and_modify({ _id = "p" }, { ["$set"] = { by = "old" } }, { new = true }) end,
    }) do
      local ok, err, info = call()
      assert.is_nil(ok)
      assert.equal("fenced", err)
      assert.equal(h2:token_string(), digits(info.token))
      assert.equal(h2:token_string(), info.token_string)
    end
    assert.same(before, doc("p"))
    -- the many form skips the fenced documents
    assert.equal(0, stale:update_many({ _id = "p" }, { ["$set"] = { by = "old" } }))
    assert.same(before, doc("p"))
    assert.is_true(h2:release())
  end)

  it("keeps the fence through replace, find_and_modify, insert and delete", function()
    local h = assert(locks:acquire(helpers.unique("k")))
    local f = h:fenced(coll, { field = "tok" })
    assert.equal("tok", (f:fence()))
    assert.is_true(f:insert({ _id = "i", a = 1 }))
    assert.equal(h:token_string(), digits(doc("i").tok))
    local _, err, code = f:insert({ _id = "i", a = 1 })
    assert.equal(11000, code, err)
    assert.equal(1, f:replace({ _id = "i" }, { b = 2 }))
    local d = doc("i")
    assert.is_nil(d.a)
    assert.equal(2, d.b)
    assert.equal(h:token_string(), digits(d.tok))
    local after = f:find_and_modify({ _id = "i" }, { ["$inc"] = { b = 1 } }, { new = true })
    assert.equal(3, after.b)
    local id
    _, id = f:update({ _id = "u" }, { ["$set"] = { c = 1 } }, { upsert = true })
    assert.equal("u", id)
    assert.equal(1, f:delete({ _id = "u" }))
    assert.equal(0, f:delete({ _id = "u" }))
    assert.is_true(h:release())
  end)

  it("refuses the write of a holder paused past its ttl once the next holder wrote", function()
    local name = helpers.unique("k")
    local app = helpers.unique("stale")
    local go = os.tmpname()
    os.remove(go)
    local script = helpers.script(([[
      local mongolock = require "mongolock"
      local core = require "mongolock.core"
      local c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = %q }))
      local locks = c:locks({ database = %q, collection = %q, ttl = 1 })
      local h = assert(locks:acquire(%q))
      local f = h:fenced(%q)
      assert(f:update({ _id = "d" }, { ["$set"] = { by = "first" } }, { upsert = true }))
      print("held " .. core.getpid() .. " " .. h:token_string())
      io.stdout:flush()
      while not io.open(%q) do core.sleep(0.01) end
      print("sending")
      io.stdout:flush()
      local ok, err, info = f:update({ _id = "d" }, { ["$set"] = { by = "stale" }, ["$inc"] = { n = 1 } })
      print("result " .. tostring(ok) .. " " .. tostring(err) .. " " .. tostring(info and info.token_string))
      io.stdout:flush()
      c:close()
    ]]):format(app, DB, locks.collection, name, coll, go))
    local p = helpers.spawn(script)
    local pid = tonumber(assert(p:wait_for("held (%d+)")))
    -- its next write waits 2.5 s on the server before it runs: a write
    -- delayed on the way; the process is stopped meanwhile, past its ttl
    local function fp(mode, data)
      return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    fp({ times = 1 }, { failCommands = mongolock.array({ "findAndModify", "update" }), blockConnection = true,
                        blockTimeMS = 2500, appName = app })
    finally(function() fp("off", {}) end)
    local f = io.open(go, "w")
    f:close()
    assert(p:wait_for("sending"))
    core.sleep(0.1)
    p:kill("STOP", pid)
    local h2 = assert(locks:acquire(name, { timeout = 5 }))
    local f2 = h2:fenced(coll)
    assert.equal(1, f2:update({ _id = "d" }, { ["$set"] = { by = "next" } }))
    p:kill("CONT", pid)
    local st, out = p:wait(15)
    p:cleanup()
    os.remove(go)
    os.remove(script)
    assert.equal(0, st, out)
    assert.equal("result nil fenced " .. h2:token_string(), out:match("result [^\n]*"), out)
    local d = doc("d")
    assert.equal("next", d.by)
    assert.is_nil(d.n)
    assert.equal(h2:token_string(), digits(d.fence))
    assert.is_true(h2:release())
  end)

  it("is every token holder's: a semaphore's permit; a document lock has no token and raises", function()
    local sem = client:semaphores({ database = DB, collection = helpers.unique("sem"), permits = 2 })
    local h = assert(sem:acquire(helpers.unique("s")))
    assert.equal(1, h:fenced(coll):update({ _id = "sem" }, { ["$set"] = { v = 1 } }, { upsert = true }))
    assert.equal(h:token_string(), digits(doc("sem").fence))
    assert.is_true(h:release())
    local docs = client:documents(DB, helpers.unique("dl"))
    local _, dh = docs:lock("x", { insert = {} })
    assert.has_error(function() dh:fenced(coll) end,
      "fenced: the handle has no fencing token (a document lock: fence on a version)")
    assert.is_true(dh:release())
  end)

  it("is the elections' leader's too, with its term", function()
    local el = client:elections({ database = DB, collection = helpers.unique("el") })
    local leader = assert(el:campaign(helpers.unique("e"), "a"))
    local f = leader:fenced(coll)
    assert.equal(1, f:update({ _id = "led" }, { ["$set"] = { v = 1 } }, { upsert = true }))
    assert.equal(leader:token_string(), digits(doc("led").fence))
    assert.is_true(leader:resign())
  end)
end)
