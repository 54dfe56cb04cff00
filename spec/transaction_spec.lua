-- #integration writes that commit only while the lock is held
-- (h:transaction, mongolock.transaction): one multi-document transaction
-- that also checks and writes the lock's own document, so that the commit
-- fails when the lease ended or the lock changed hands meanwhile.  Needs a
-- replica set (the stand-in, or mongod --replSet with enableTestCommands).
local helpers = require "helpers"
local mongolock = require "mongolock"

local DB = helpers.database

describe("#integration transactions on the lock", function()
  local client, other, locks, coll
  setup(function()
    client = helpers.connect({ appname = "txn-spec" })
    other = helpers.connect({ appname = "txn-spec-other" })
    locks = helpers.locks(client, { ttl = 10 })
    coll = helpers.unique("txn")
  end)
  teardown(function()
    client:close()
    other:close()
  end)

  local function doc(id)
    local r = assert(client:command(DB, { find = coll }, { filter = { _id = id }, limit = 1, singleBatch = true }))
    return r.cursor.firstBatch[1]
  end
  local function fp(mode, data)
    return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
  end

  it("refuses bad arguments at the caller", function()
    local h = assert(locks:acquire(helpers.unique("k")))
    assert.has_error(function() h:transaction(5) end,
      "bad argument #1 to 'transaction' (function expected, got number)")
    assert.has_error(function() h:transaction(function() end, { time = 1 }) end)
    assert.has_error(function() h:transaction(function() end, { timeout = -1 }) end)
    assert.has_error(function() h:transaction(function(tx) tx:collection(5) end) end)
    assert.has_error(function() h:transaction(function(tx) tx:collection(coll):update("x", {}) end) end)
    assert.has_error(function() h:transaction(function(tx) tx:collection(coll):insert({ f = print }) end) end)
    assert.is_true(h:release())
    local docs = client:documents(DB, helpers.unique("dl"))
    local _, dh = docs:lock("x", { insert = {} })
    assert.has_error(function() dh:transaction(function() end) end,
      "transaction: only a named lock's handle runs transactions on its lock document")
    assert.is_true(dh:release())
  end)

  it("commits fn's writes together and returns its results; a released lock answers not held", function()
    local h = assert(locks:acquire(helpers.unique("k")))
    assert(client:command(DB, { insert = coll }, { documents = mongolock.array({ { _id = "a", gold = 10 } }) }))
    local seen
    local r1, r2 = h:transaction(function(tx)
      local p = tx:collection(coll)
      assert.equal(1, p:update({ _id = "a" }, { ["$inc"] = { gold = -3 } }))
      assert.equal(1, p:update({ _id = "b" }, { ["$inc"] = { gold = 3 } }, { upsert = true }))
      assert.is_true(p:insert({ _id = "log1", what = "trade" }))
      assert.equal(0, p:delete({ _id = "none" }))
      local d = p:find_and_modify({ _id = "a" }, { ["$set"] = { seen = true } }, { new = true })
      assert.equal(7, d.gold)
      seen = p:find({ _id = { ["$in"] = mongolock.array({ "a", "b" }) } }, { sort = { _id = 1 } })
      -- nothing is visible outside before the commit
      assert.is_nil(doc("b"))
      return "done", 2
    end)
    assert.same({ "done", 2 }, { r1, r2 })
    assert.same({ 7, 3 }, { seen[1].gold, seen[2].gold })
    assert.same({ 7, 3 }, { doc("a").gold, doc("b").gold })
    assert.equal("trade", doc("log1").what)
    -- fn answering nil, err: aborted, nothing written
    assert.same({ nil, "not enough gold" }, { h:transaction(function(tx)
      tx:collection(coll):update({ _id = "a" }, { ["$inc"] = { gold = -100 } })
      return nil, "not enough gold"
    end) })
    assert.equal(7, doc("a").gold)
    -- fn raising: aborted, the error goes on
    assert.has_error(function() h:transaction(function(tx)
      tx:collection(coll):update({ _id = "a" }, { ["$inc"] = { gold = -100 } })
      error("boom", 0)
    end) end, "boom")
    assert.equal(7, doc("a").gold)
    assert.is_true(h:release())
    assert.same({ nil, "not held" }, { h:transaction(function() return 1 end) })
  end)

  it("meets one write conflict, runs fn again and commits exactly once", function()
    local h = assert(locks:acquire(helpers.unique("k")))
    assert(client:command(DB, { insert = coll }, { documents = mongolock.array({ { _id = "wc", v = 0 } }) }))
    local runs = 0
    local r = h:transaction(function(tx)
      runs = runs + 1
      local p = tx:collection(coll)
      assert.equal(1, p:update({ _id = "count" }, { ["$inc"] = { n = 1 } }, { upsert = true }))
      if runs == 1 then
        -- another client writes the document after this transaction's
        -- snapshot: the transaction's write of it is a write conflict
        assert(other:command(DB, { update = coll }, {
          updates = mongolock.array({ { q = { _id = "wc" }, u = { ["$inc"] = { v = 100 } } } }) }))
      end
      local n, err, code = p:update({ _id = "wc" }, { ["$inc"] = { v = 1 } })
      if runs == 1 then assert.same({ nil, 112 }, { n, code }, err) end
      return runs
    end)
    assert.equal(2, r)
    assert.equal(101, doc("wc").v)
    assert.equal(1, doc("count").n)
    assert.is_true(h:release())
  end)

  it("keeps retrying write conflicts while the lock stays held, past the lease's time left at the start", function()
    local core = require "mongolock.core"
    local short = helpers.locks(client, { ttl = 1.5, renew = true })
    local h = assert(short:acquire(helpers.unique("k")))
    assert(client:command(DB, { insert = coll }, { documents = mongolock.array({ { _id = "blocked", v = 0 } }) }))
    -- another session's open transaction has written the document: until it
    -- ends, every other transaction's write of it is a write conflict
    local key = assert(core.random_owner())
    local number = 1
    local function blocker(cmd, fields)
      if cmd.update then number = number + 1 end
      fields.txnNumber = core.Int64(number)
      fields.autocommit = false
      return other:command(cmd.update and DB or "admin", cmd, fields, key)
    end
    assert(blocker({ update = coll }, { startTransaction = true,
      updates = mongolock.array({ { q = { _id = "blocked" }, u = { ["$inc"] = { v = 10 } } } }) }))
    local started, runs, ended = core.monotonic(), 0, nil
    local r, err = h:transaction(function(tx)
      runs = runs + 1
      -- the other transaction ends after three seconds: twice the lease's
      -- time left when this one started (renewals keep the lease)
      if not ended and core.monotonic() - started > 3 then
        assert(blocker({ abortTransaction = 1 }, {}))
        ended = core.monotonic()
      end
      return tx:collection(coll):update({ _id = "blocked" }, { ["$inc"] = { v = 1 } })
    end)
    assert.equal(1, r, err)
    assert.truthy(ended)
    assert.truthy(runs > 1)
    assert.equal(1, doc("blocked").v)
    assert.is_true(h:check())
    -- with a timeout, the retries stop there and the conflict is answered
    assert(blocker({ update = coll }, { startTransaction = true,
      updates = mongolock.array({ { q = { _id = "blocked" }, u = { ["$inc"] = { v = 10 } } } }) }))
    local t0 = core.monotonic()
    local n, err2, code = h:transaction(function(tx)
      return tx:collection(coll):update({ _id = "blocked" }, { ["$inc"] = { v = 1 } })
    end, { timeout = 0.5 })
    assert.same({ nil, 112 }, { n, code }, err2)
    assert.truthy(core.monotonic() - t0 < 3)
    assert(blocker({ abortTransaction = 1 }, {}))
    assert.equal(1, doc("blocked").v)
    assert.is_true(h:release())
  end)

  it("retries a commit whose outcome is unknown and commits once", function()
    local h = assert(locks:acquire(helpers.unique("k")))
    finally(function() fp("off", {}) end)
    for i, data in ipairs({
      { failCommands = mongolock.array({ "commitTransaction" }), closeConnection = true },
      { failCommands = mongolock.array({ "commitTransaction" }), writeConcernError = { code = 64, errmsg = "wc" } },
    }) do
      fp({ times = 1 }, data)
      local runs = 0
      assert.equal("ok", h:transaction(function(tx)
        runs = runs + 1
        assert.equal(1, tx:collection(coll):update({ _id = "unknown" }, { ["$inc"] = { n = 1 } }, { upsert = true }))
        return "ok"
      end))
      assert.equal(1, runs)
      assert.equal(i, doc("unknown").n)
    end
    assert.is_true(h:release())
  end)

  it("commits nothing and answers lost when the lock was taken over from a holder paused past its ttl", function()
    local name = helpers.unique("k")
    local go = os.tmpname()
    os.remove(go)
    local script = helpers.script(([[
      local mongolock = require "mongolock"
      local core = require "mongolock.core"
      local c = assert(mongolock.connect(os.getenv("MONGODB_URI")))
      local locks = c:locks({ database = %q, collection = %q, ttl = 1 })
      local h = assert(locks:acquire(%q))
      print("held " .. core.getpid())
      io.stdout:flush()
      local r, err = h:transaction(function(tx)
        local p = tx:collection(%q)
        assert(p:update({ _id = "stale" }, { ["$set"] = { by = "stale" } }, { upsert = true }))
        print("written")
        io.stdout:flush()
        while not io.open(%q) do core.sleep(0.01) end
        assert(p:insert({ _id = "stale2" }))
        return "committed"
      end)
      print("result " .. tostring(r) .. " " .. tostring(err))
      io.stdout:flush()
      c:close()
    ]]):format(DB, locks.collection, name, coll, go))
    local p = helpers.spawn(script)
    local pid = tonumber(assert(p:wait_for("held (%d+)")))
    assert(p:wait_for("written"))
    p:kill("STOP", pid)
    local h2 = assert(locks:acquire(name, { timeout = 5 }))
    local f = io.open(go, "w")
    f:close()
    p:kill("CONT", pid)
    local st, out = p:wait(15)
    p:cleanup()
    os.remove(go)
    os.remove(script)
    assert.equal(0, st, out)
    assert.equal("result nil lost", out:match("result [^\n]*"), out)
    assert.is_nil(doc("stale"))
    assert.is_nil(doc("stale2"))
    -- the new holder's transactions commit
    assert.equal(1, h2:transaction(function(tx)
      return tx:collection(coll):update({ _id = "stale" }, { ["$set"] = { by = "next" } }, { upsert = true })
    end))
    assert.equal("next", doc("stale").by)
    assert.is_true(h2:release())
  end)

  it("answers lost when the lock changed hands before the commit (force-released and taken)", function()
    local name = helpers.unique("k")
    local h = assert(locks:acquire(name))
    local others = other:locks({ database = DB, collection = locks.collection, ttl = 10 })
    local h2
    local r, err = h:transaction(function(tx)
      tx:collection(coll):update({ _id = "forced" }, { ["$set"] = { v = 1 } }, { upsert = true })
      if not h2 then
        assert(others:force_release(name))
        h2 = assert(others:acquire(name))
      end
      return "committed"
    end)
    assert.same({ nil, "lost" }, { r, err })
    assert.is_nil(doc("forced"))
    assert.is_true(h2:release())
    h:close()
  end)
end)

describe("#integration transactions of an elections' leader", function()
  it("commit while it leads, and answer lost once another leads", function()
    local client = helpers.connect({ appname = "txn-leader" })
    local el = client:elections({ database = DB, collection = helpers.unique("el"), ttl = 10 })
    local coll = helpers.unique("txn_led")
    local name = helpers.unique("e")
    local leader = assert(el:campaign(name, "a"))
    assert.equal("led", leader:transaction(function(tx)
      assert.equal(1, tx:collection(coll):update({ _id = 1 }, { ["$set"] = { by = "a" } }, { upsert = true }))
      return "led"
    end))
    local r = assert(client:command(DB, { find = coll }, { filter = { _id = 1 } }))
    assert.equal("a", r.cursor.firstBatch[1].by)
    assert.is_true(leader:resign())
    assert.same({ nil, "not held" }, { leader:transaction(function() return 1 end) })
    client:close()
  end)
end)

describe("#integration transactions on the lock under a cqueues scheduler", function()
  it("run in coroutines, their commands yielding, and commit", function()
    local cqueues = require "cqueues"
    local cq = cqueues.new()
    local client = helpers.connect({ scheduler = "cqueues" })
    local locks = helpers.locks(client, { ttl = 10 })
    local coll = helpers.unique("txn_cq")
    local results, ticks = {}, 0
    for i = 1, 4 do
      cq:wrap(function()
        local h = assert(locks:acquire("cq" .. i))
        results[i] = { h:transaction(function(tx)
          local p = tx:collection(coll)
          assert.equal(1, p:update({ _id = i }, { ["$inc"] = { n = 1 } }, { upsert = true }))
          assert.equal(1, p:update({ _id = "total" .. i }, { ["$inc"] = { n = i } }, { upsert = true }))
          return i
        end) }
        assert.is_true(h:release())
      end)
    end
    cq:wrap(function()
      for _ = 1, 20 do
        ticks = ticks + 1
        cqueues.sleep(0.001)
      end
    end)
    assert(cq:loop())
    for i = 1, 4 do assert.same({ i }, results[i]) end
    assert.equal(20, ticks)
    local r = assert(client:command(DB, { count = coll }, {}))
    assert.equal(8, r.n)
    client:close()
  end)
end)

describe("#integration examples/trade.lua", function()
  it("makes its trades in guarded transactions, commits nothing under a lost lock, and the books balance", function()
    local out, ok = helpers.run(helpers.root .. "/examples/trade.lua", { "12" })
    assert.is_true(ok, out)
    assert.matches("trades: %d+ made, %d+ refused %(not enough gold%), 1 under a lost lock: nothing written", out)
    assert.matches("gold: 200 %(was 200%), swords: 1", out)
    assert.matches("\nok\n", out)
  end)
end)
