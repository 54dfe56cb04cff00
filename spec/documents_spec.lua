-- #integration: locks on the application's own documents
-- (mongolock.documents): acquire on server time in one findAndModify,
-- insert when missing, write-and-unlock in one update, LockId/LockTime
-- interoperability, skewed clocks, and two processes on one document.
local helpers = require "helpers"
local core = require "mongolock.core"

local null = core.null

describe("#integration documents", function()
  local client, commands, DB

  local function fresh(opts)
    return client:documents(DB, helpers.unique("docs"), opts)
  end

  -- a raw command helper (the application's own writes)
  local function cmd(name, coll, opts)
    return assert(client._core:command(DB, { [name] = coll }, opts))
  end
  local function get(docs, id)
    local r = cmd("find", docs.coll, { filter = { _id = id } })
    return r.cursor.firstBatch[1]
  end

  setup(function()
    client = helpers.connect({ appname = "documents" },
      helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    DB = helpers.database
    -- commands the server counted while fn ran (serverStatus's own removed)
    commands = helpers.command_counter(client)
  end)
  teardown(function() client:close() end)

  it("locks an existing document and hands back its state", function()
    local docs = fresh()
    cmd("insert", docs.coll, { documents = { { _id = "o1", status = "new", n = 1 } } })
    local doc, h = docs:lock("o1")
    assert.is_table(doc)
    assert.equal("new", doc.status)
    assert.equal(h.owner, doc.lockId)
    assert.equal("date", doc.lockExpires.type)
    assert.equal("o1", h.id)
    assert.is_true(h:held())
    local rem = assert(h:remaining())
    assert.is_true(rem > 29 and rem <= 30)
    assert.is_true(h:release())
    local stored = get(docs, "o1")
    assert.equal(null, stored.lockId)
    assert.equal("new", stored.status)
  end)

  it("is one round trip to lock and one to release", function()
    local docs = fresh()
    cmd("insert", docs.coll, { documents = { { _id = 1 } } })
    local n, r = commands(function() return docs:try(1) end)
    assert.equal(1, n)
    local h = r[2]
    n = commands(function() return h:release({ a = 1 }) end)
    assert.equal(1, n)
    n = commands(function() return docs:try(2, { insert = { x = 1 } }) end)
    assert.equal(1, n)
  end)

  it("answers busy with the holder and the server's remaining time", function()
    local docs = fresh({ ttl = 5 })
    cmd("insert", docs.coll, { documents = { { _id = "b" } } })
    local _, h = assert(docs:lock("b"))
    local doc, err, info = docs:try("b")
    assert.is_nil(doc)
    assert.equal("busy", err)
    assert.equal(h.owner, info.owner)
    assert.is_true(info.remaining > 0 and info.remaining <= 5)
    assert.equal("b", info.doc._id)
    -- another client's wait times out (this client's answers "deadlock")
    local c2 = helpers.connect({ appname = "documents-other" })
    local t0 = core.monotonic()
    doc, err = c2:documents(DB, docs.coll, { ttl = 5 }):lock("b", { timeout = 0.2 })
    assert.is_nil(doc)
    assert.equal("timeout", err)
    assert.is_true(core.monotonic() - t0 >= 0.2)
    c2:close()
    assert.is_true(h:release())
    assert.is_table((docs:try("b")))
  end)

  it("says not found without opts.insert, and creates and locks with it", function()
    local docs = fresh()
    assert.same({ nil, "not found" }, { docs:try("new") })
    assert.is_nil(get(docs, "new"))
    local doc, h = assert(docs:lock("new", { insert = { status = "draft", items = core.array() } }))
    assert.equal("draft", doc.status)
    assert.is_true(core.is_array(doc.items))
    assert.equal(h.owner, doc.lockId)
    -- a second contender sees it locked, and insert does not overwrite
    local _, err = docs:try("new", { insert = { status = "other" } })
    assert.equal("busy", err)
    assert.is_true(h:release({ status = "ready" }))
    local again = assert(docs:lock("new", { insert = { status = "ignored" } }))
    assert.equal("ready", again.status)
  end)

  it("release(changes) writes and unlocks in one command; operators too", function()
    local docs = fresh()
    cmd("insert", docs.coll, { documents = { { _id = 1, n = 1, tmp = true } } })
    local doc, h = assert(docs:lock(1))
    assert.is_true(h:release({ n = doc.n + 1, note = "x" }))
    local _
    local s = get(docs, 1)
    assert.equal(2, s.n)
    assert.equal("x", s.note)
    assert.equal(null, s.lockId)
    _, h = assert(docs:lock(1))
    assert.is_true(h:release({ ["$inc"] = { n = 10 }, ["$unset"] = { tmp = "" },
      ["$set"] = { note = "y" } }))
    s = get(docs, 1)
    assert.equal(12, s.n)
    assert.is_nil(s.tmp)
    assert.equal("y", s.note)
    assert.equal(null, s.lockId)
  end)

  it("release(changes) refuses to touch the lock fields or _id, and mixes", function()
    local docs = fresh()
    cmd("insert", docs.coll, { documents = { { _id = 1 } } })
    local _, h = assert(docs:lock(1))
    assert.has_error(function() h:release({ lockId = 1 }) end)
    assert.has_error(function() h:release({ ["lockExpires.x"] = 1 }) end)
    assert.has_error(function() h:release({ _id = 2 }) end)
    assert.has_error(function() h:release({ ["$set"] = { lockId = 1 } }) end)
    assert.has_error(function() h:release({ ["$rename"] = { a = "lockId" } }) end)
    assert.has_error(function() h:release({ ["$set"] = { a = 1 }, b = 2 }) end)
    assert.has_error(function() h:release({ ["$inc"] = 5 }) end)
    assert.has_error(function() h:release({ a = print }) end)
    assert.has_error(function() h:release(5) end)
    -- nothing was written, the lock is still held
    assert.is_true(h:held())
    assert.equal(h.owner, get(docs, 1).lockId)
    assert.is_true(h:release())
  end)

  it("release after the lock was taken over is nil, \"lost\" and writes nothing", function()
    local docs = fresh({ ttl = 0.3 })
    cmd("insert", docs.coll, { documents = { { _id = 1, n = 0 } } })
    local _, h = assert(docs:lock(1))
    -- the server frees it after 0.3 s: wait for another taker to get it
    local h2
    local taken = helpers.eventually(function()
      local d, hh = docs:try(1)
      if d then h2 = hh return true end
    end, 5)
    assert.is_true(taken)
    assert.same({ nil, "lost" }, { h:release({ n = 99 }) })
    assert.equal(0, get(docs, 1).n)
    assert.same({ nil, "lost" }, { h:extend() })
    assert.is_true(h2:release())
    assert.same({ nil, "not held" }, { h2:release() })
  end)

  it("extend renews the lease on the server", function()
    local docs = fresh({ ttl = 1 })
    cmd("insert", docs.coll, { documents = { { _id = 1 } } })
    local _, h = assert(docs:lock(1))
    assert.is_true(h:extend(20))
    local st = assert(docs:status(1))
    assert.is_true(st.held)
    assert.is_true(st.remaining > 15)
    assert.equal(h.owner, st.owner)
    assert.is_true(h:release())
    st = assert(docs:status(1))
    assert.is_false(st.held)
    assert.same({ nil, "not found" }, { docs:status(2) })
  end)

  it("renews a held lock in the background with renew = true", function()
    local docs = fresh({ ttl = 0.5, renew = true })
    local _, h = assert(docs:lock(1, { insert = {} }))
    assert.is_true(h.renew)
    -- the lease is 0.5 s; well past it the server still sees it held
    core.sleep(1.2)
    assert.equal("busy", select(2, docs:try(1)))
    assert.is_true(assert(docs:status(1)).held)
    assert.is_true(h:release({ done = true }))
    assert.is_true(get(docs, 1).done)
  end)

  it("takes any BSON value as _id", function()
    local docs = fresh()
    local oid = core.ObjectId()
    for _, id in ipairs({ oid, 42, 2 ^ 40, "s", { a = 1 } }) do
      local doc, h = assert(docs:lock(id, { insert = { v = 1 } }))
      assert.equal(1, doc.v)
      assert.is_true(h:release())
    end
    assert.equal(oid, get(docs, oid)._id)
    assert.has_error(function() docs:lock(core.array({ 1 })) end)
    assert.has_error(function() docs:lock(nil) end)
    assert.has_error(function() docs:lock(print) end)
  end)

  it("interoperates with LockId/LockTime documents (Guid owner, locked-at time)", function()
    local docs = fresh({ fields = { owner = "LockId", time = "LockTime" }, time = "locked",
      owner_type = "uuid", ttl = 60 })
    -- another service locked "a" just now and "b" two minutes ago
    local guid = core.Binary(string.rep("\17", 16), 4)
    cmd("insert", docs.coll, { documents = { { _id = "a", Value = 1, LockId = guid },
      { _id = "b", Value = 2, LockId = guid }, { _id = "c", Value = 3, LockId = null, LockTime = null } } })
    cmd("update", docs.coll, { updates = {
      { q = { _id = "a" }, u = { { ["$set"] = { LockTime = "$$NOW" } } } },
      { q = { _id = "b" }, u = { { ["$set"] = { LockTime = { ["$subtract"] = { "$$NOW", 120000 } } } } } },
    } })
    local _, err, info = docs:try("a")
    assert.equal("busy", err)
    assert.equal(guid, info.owner)
    assert.is_true(info.remaining > 50 and info.remaining <= 60)
    -- expired by their rule (LockTime + duration < now): ours now
    local doc, h = assert(docs:try("b"))
    assert.equal("binary", doc.LockId.type)
    assert.equal(4, doc.LockId.subtype)
    assert.not_equal(guid, doc.LockId)
    assert.equal("date", doc.LockTime.type)
    -- their acquire filter (LockId null or LockTime older than the
    -- duration) does not match our lock
    local r = cmd("find", docs.coll, { filter = { _id = "b", ["$or"] = {
      { LockId = null }, { LockTime = { ["$lt"] = core.Date(core.Date().ms - 60000) } } } } })
    assert.equal(0, #r.cursor.firstBatch)
    -- their release: Value changed, LockId and LockTime null
    assert.is_true(h:release({ Value = 20 }))
    local s = get(docs, "b")
    assert.equal(20, s.Value)
    assert.equal(null, s.LockId)
    assert.equal(null, s.LockTime)
    local _, hc = assert(docs:try("c"))
    assert.has_error(function() docs:try("c", { ttl = 5 }) end)
    -- the lease is the ttl every party uses: extend takes no other
    assert.has_error(function() hc:extend(5) end,
      "bad argument #1 to 'extend' (ttl is fixed per collection when time = \"locked\")")
    assert.is_true(hc:extend())
    assert.is_true(hc:extend(60))
    assert.is_true(hc:release())
  end)

  if _VERSION == "Lua 5.4" then
    it("releases on scope exit with <close>", function()
      local docs = fresh()
      cmd("insert", docs.coll, { documents = { { _id = 1 } } })
      local chunk = assert(load([[
        local docs, fail = ...
        local doc, h <close> = docs:lock(1)
        if fail then error("inside", 0) end
        return doc.lockId
      ]]))
      assert.is_string(chunk(docs, false))
      assert.is_false(assert(docs:status(1)).held)
      assert.is_false(pcall(chunk, docs, true))
      assert.is_false(assert(docs:status(1)).held)
    end)
  end

  it("with() runs fn holding the lock; fn's changes are written only by its own h:release(changes)", function()
    local docs = fresh()
    local a, b, c = docs:with("w", { insert = { n = 0 } }, function(doc, h)
      assert.is_true(h:held())
      assert.is_true(h:release({ n = doc.n + 1 }))
      return "done", nil, 3
    end)
    assert.same({ "done", nil, 3 }, { a, b, c })
    assert.equal(1, get(docs, "w").n)
    assert.is_false(assert(docs:status("w")).held)
    assert.has_error(function()
      docs:with("w", function() error("boom", 0) end)
    end, "boom")
    assert.is_false(assert(docs:status("w")).held)
  end)

  it("with() returns what fn returns, as locks:with, and never writes a table fn returns", function()
    local docs = fresh()
    local r, x = docs:with("plain", { insert = { n = 0 } }, function(doc)
      return { ok = true, n = doc.n + 7 }, "second"
    end)
    assert.same({ ok = true, n = 7 }, r)
    assert.equal("second", x)
    local doc = get(docs, "plain")
    assert.equal(0, doc.n)
    assert.is_nil(doc.ok)
    assert.is_false(assert(docs:status("plain")).held)
  end)

  it("with() renews the lease while fn runs unless told not to, as every kind's with", function()
    local docs = fresh({ ttl = 1.5 })
    local n = docs:with("renewed", { insert = { n = 0 } }, function(doc, h)
      core.sleep(2.5)              -- longer than the ttl: renewed meanwhile
      assert.is_true(h:held())
      assert.is_true(h:release({ n = doc.n + 1 }))
      return doc.n + 1
    end)
    assert.equal(1, n)
    assert.equal(1, get(docs, "renewed").n)
    local released
    assert.same({ nil, "lost" }, { docs:with("unrenewed", { insert = { n = 0 }, renew = false },
      function(doc, h)
        core.sleep(2.5)
        released = { h:release({ n = doc.n + 1 }) }
        return true
      end) })
    assert.same({ nil, "lost" }, released)
    assert.equal(0, get(docs, "unrenewed").n)
  end)

  it("with() unlocks without fn's changes, then raises, when the release refuses them", function()
    local docs = fresh()
    local ok, err = pcall(docs.with, docs, "r", { insert = { n = 0 } }, function(_, h)
      h:release({ n = 5, lockId = "mine now" })
    end)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("lockId", 1, true), err)
    assert.is_false(assert(docs:status("r")).held)
    assert.equal(0, get(docs, "r").n)
  end)

  it("a handle collected while held releases its document", function()
    local docs = fresh()
    cmd("insert", docs.coll, { documents = { { _id = 1 } } })
    do local _, h = docs:lock(1) assert(h) end
    collectgarbage()
    collectgarbage()
    assert.is_truthy(helpers.eventually(function() return not assert(docs:status(1)).held end, 5))
  end)

  it("answers nil, \"closed\" on a closed client", function()
    local c = helpers.connect()
    local docs = c:documents(DB, helpers.unique("docs"))
    c:close()
    assert.same({ nil, "closed" }, { docs:try(1) })
    assert.same({ nil, "closed" }, { docs:lock(1) })
  end)

  it("checks its arguments", function()
    assert.has_error(function() client:documents(nil, "c") end)
    assert.has_error(function() client:documents(DB, 5) end)
    assert.has_error(function() client:documents(DB, "c", { ttl = 0 }) end)
    assert.has_error(function() client:documents(DB, "c", { ttl = 0 / 0 }) end)
    assert.has_error(function() client:documents(DB, "c", { fields = { owner = "a.b" } }) end)
    assert.has_error(function() client:documents(DB, "c", { fields = { owner = "_id" } }) end)
    assert.has_error(function() client:documents(DB, "c", { fields = { owner = "x", time = "x" } }) end)
    assert.has_error(function() client:documents(DB, "c", { fields = { time = "$t" } }) end)
    assert.has_error(function() client:documents(DB, "c", { time = "soon" }) end)
    assert.has_error(function() client:documents(DB, "c", { owner_type = "int" }) end)
    local docs = fresh()
    assert.has_error(function() docs:lock(1, { timeout = -1 }) end)
    assert.has_error(function() docs:lock(1, { insert = "x" }) end)
    assert.has_error(function() docs:lock(1, { insert = { lockId = 1 } }) end)
    assert.has_error(function() docs:lock(1, { insert = { bad = "\255" } }) end)
    assert.has_error(function() docs:try(1, 5) end)
  end)

  describe("across processes", function()
    local CHILD = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, mode, a, b = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI")))
local docs = c:documents(db, coll, { ttl = 10 })
local function say(...) io.stdout:write(table.concat({ ... }, " "), "\n") io.stdout:flush() end
if mode == "count" then
  say("ready")
  while not io.open(b, "r") do core.sleep(0.005) end
  for _ = 1, tonumber(a) do
    local doc, h = assert(docs:lock("counter", { timeout = 30, insert = { n = 0 } }))
    local n = doc.n
    core.sleep(0.0005)
    assert(h:release({ n = n + 1 }))
  end
  say("done")
elseif mode == "try" then
  local doc, err, info = docs:try(a)
  say(doc and "won" or err, info and string.format("%.3f", info.remaining) or "-")
elseif mode == "hold" then
  -- locks the document whose _id is the integer a, holds it until the
  -- file b exists, then 0.3 s more, and unlocks with a change
  local _, h = assert(docs:lock(math.tointeger and math.tointeger(tonumber(a)) or tonumber(a)))
  say("held")
  while not io.open(b, "r") do core.sleep(0.005) end
  core.sleep(0.3)
  say("released", tostring(h:release({ by = "child" })))
end
]]
    local script
    setup(function() script = helpers.script(CHILD) end)
    teardown(function() os.remove(script) end)

    it("two processes incrementing under the document lock lose no update", function()
      local ROUNDS = 200
      local docs = fresh()
      local start = os.tmpname(); os.remove(start)
      local procs = {}
      for i = 1, 2 do
        procs[i] = helpers.spawn(script, { DB, docs.coll, "count", tostring(ROUNDS), start })
      end
      for _, p in ipairs(procs) do assert(p:wait_for("ready")) end
      local f = assert(io.open(start, "w")); f:close()
      for _, p in ipairs(procs) do
        local st, out = p:wait(120)
        assert.equal(0, st, out)
      end
      os.remove(start)
      local s = get(docs, "counter")
      assert.equal(2 * ROUNDS, s.n)
      assert.equal(null, s.lockId)
      print(string.format("# document lock race: 2 processes x %d increments, counter %d", ROUNDS, s.n))
    end)

    it("a waiter is woken by the holder's unlock, without polling", function()
      -- stored as an int64, asked for as a Lua number: the stream's
      -- documentKey and the waiter's _id are the same number
      local docs = fresh({ ttl = 60 })
      cmd("insert", docs.coll, { documents = { { _id = core.Int64(7), n = 1 } } })
      local trigger = os.tmpname(); os.remove(trigger)
      local p = helpers.spawn(script, { DB, docs.coll, "hold", "7", trigger })
      assert(p:wait_for("held"))
      local wait = require "mongolock.wait"
      local real = wait.sleep_until_retry
      local calls = 0
      wait.sleep_until_retry = function(state)
        calls = calls + 1
        if calls == 1 then assert(io.open(trigger, "w")):close() end
        return real(state)
      end
      local ok, doc, h = pcall(docs.lock, docs, 7, { timeout = 20, wait = "watch" })
      wait.sleep_until_retry = real
      assert.is_true(ok, doc)
      assert.is_truthy(h, doc)
      -- the holder's change is what the waiter reads
      assert.equal("child", doc.by)
      -- one wait: woken by the unlock (a poller needs several steps for 0.3 s)
      assert.equal(1, calls)
      assert.is_true(h:release())
      assert.matches("released true", (select(2, p:wait())))
      p:cleanup()
      os.remove(trigger)
    end)

    it("a client whose clock is an hour off neither steals nor waits an hour", function()
      local docs = fresh({ ttl = 30 })
      cmd("insert", docs.coll, { documents = { { _id = "s" } } })
      local _, h = assert(docs:lock("s"))
      for _, skew in ipairs({ "+1h", "-1h" }) do
        local out = helpers.run(script, { DB, docs.coll, "try", "s" }, ("faketime -f '%s' "):format(skew))
        local what, rem = out:match("(%S+) (%S+)")
        assert.equal("busy", what, out)
        rem = tonumber(rem)
        assert.is_true(rem > 25 and rem <= 30, out)
      end
      assert.is_true(h:release())
      local out = helpers.run(script, { DB, docs.coll, "try", "s" }, "faketime -f '-1h' ")
      assert.equal("won", out:match("%S+"), out)
    end)
  end)
end)

describe("#integration documents: a blocking lock of a document its own client holds", function()
  local client
  setup(function() client = helpers.connect({ appname = "documents-own" }) end)
  teardown(function() client:close() end)

  it("answers nil, \"deadlock\", info at once; try still answers \"busy\"", function()
    local docs = client:documents(helpers.database, helpers.unique("docs_own"))
    local id = helpers.unique("d")
    local _, h = assert(docs:lock(id, { insert = { n = 1 } }))
    local t0 = core.monotonic()
    local doc, err, info = docs:lock(id)
    assert.is_nil(doc)
    assert.equal("deadlock", err)
    assert.equal(h.owner, info.owner)
    assert.is_true(core.monotonic() - t0 < 5)
    doc, err = docs:try(id)
    assert.is_nil(doc)
    assert.equal("busy", err)
    assert(h:release())
    local _, h2 = assert(docs:lock(id, { timeout = 1 }))
    assert(h2:release())
  end)
end)
