-- #integration: a lock write that commits and whose reply is lost.
--
-- mongod's onPrimaryTransactionalWrite fail point (the one MongoDB's own
-- retryable-writes tests use; the stand-in has it, mongod needs
-- --setParameter enableTestCommands=1) closes the connection once a
-- retryable write has committed, instead of replying.  libmongoc retries the
-- write with the same txnNumber and the server answers the retry from its
-- record of the first execution.  Every lock write must then come back as if
-- the first reply had arrived: the acquire wins with the token it was given,
-- a release or an extend reports success, a document lock's release writes
-- the caller's changes once, and no lock is left held by nobody.
--
-- The fail point is not scoped to a client: while it is armed nothing else
-- may write (the observer only reads).
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local null = core.null
local unpack = table.unpack or rawget(_G, "unpack")
local function pack(...) return { n = select("#", ...), ... } end

describe("#integration lost replies", function()
  local client, locks, observer, olocks
  local APP = helpers.unique("lost")

  setup(function()
    client = helpers.connect({ appname = APP })
    locks = helpers.locks(client)
    assert(locks:try("warm")):release()       -- index made, connection open
    observer = helpers.connect()
    olocks = observer:locks({ database = locks.database, collection = locks.collection })
  end)
  teardown(function()
    observer._core:command("admin", { configureFailPoint = "onPrimaryTransactionalWrite" }, { mode = "off" })
    observer._core:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })
    client:close()
    observer:close()
  end)

  -- how many times the fail point has fired so far (mongod's timesEntered)
  local function set(mode)
    local r = assert(observer._core:command("admin", { configureFailPoint = "onPrimaryTransactionalWrite" },
      { mode = mode }))
    return r.count
  end
  -- runs fn with the next committed retryable write's reply lost; checks
  -- that the fail point fired exactly once (the write committed once, the
  -- retry was answered without writing again)
  local function lost(fn)
    local before = set({ times = 1 })
    local r = pack(fn())
    local after = set("off")
    assert.equal(1, after - before, "the fail point fired once")
    return unpack(r, 1, r.n)
  end

  -- runs fn with the next committed write's reply lost and libmongoc's
  -- retry of it lost too: failCommand lets the first findAndModify of this
  -- client through and closes the connection of the next, before it runs
  local function lost_twice(fn)
    local fp = { configureFailPoint = "failCommand" }
    assert(observer._core:command("admin", fp, { mode = { skip = 1 },
      data = { failCommands = { "findAndModify" }, closeConnection = true, appName = APP } }))
    local r = pack(lost(fn))                  -- the write committed once
    assert(observer._core:command("admin", fp, { mode = "off" }))
    -- the client finds its server again (after two closed connections
    -- libmongoc marked it unknown) before the next test arms a fail point
    assert(client._core:command("admin", { ping = 1 }))
    return unpack(r, 1, r.n)
  end

  -- a try's owner is its own, and a waiter's is its own once its acquire
  -- has failed: when neither the reply nor the retry's arrives, the lock
  -- it took is given back in the background
  for _, kind in ipairs({ "locks", "rwlocks", "semaphores" }) do
    for _, call in ipairs({ "try", "acquire" }) do
      it("a" .. (call == "try" and " try" or "n acquire") .. " whose reply and retry are both lost leaves no "
          .. kind .. " entry held by nobody", function()
        local name = helpers.unique("twice")
        local obj = kind == "locks" and locks
          or client[kind](client, { database = locks.database, collection = helpers.unique(kind),
            permits = kind == "semaphores" and 2 or nil })
        local method = kind == "rwlocks" and (call == "try" and "try_read" or "read") or call
        local opts = call == "acquire" and { timeout = 5 } or nil
        local h, err = lost_twice(function() return obj[method](obj, name, opts) end)
        assert.is_nil(h)
        assert.is_string(err)
        assert.is_true(testing.renew_flush(client._core))
        local st = assert(obj:status(name), "the write was applied")
        if kind == "locks" then assert.is_false(st.held, "still held")
        else assert.equal(0, st.in_use, "still held") end
      end)
    end
  end

  it("an acquire whose reply is lost wins with the token it was given", function()
    local name = helpers.unique("acq")
    local h = lost(function() return locks:acquire(name, { timeout = 5 }) end)
    assert.is_truthy(h, "acquired")
    local st = assert(olocks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    assert.equal(h.token, st.token)
    assert.is_true(h:held())
    assert.is_true(h:release())
    assert.is_false(assert(olocks:status(name)).held)
  end)

  it("a try over a released lock whose reply is lost takes it once, with the next token", function()
    local name = helpers.unique("try")
    local first = assert(locks:try(name))
    local t1 = first.token
    assert.is_true(first:release())
    local h = lost(function() return locks:try(name) end)
    assert.is_truthy(h, "taken")
    local st = assert(olocks:status(name))
    assert.equal(h.owner, st.owner)
    assert.equal(h.token, st.token)
    assert.is_true(h.token > t1)
    assert.is_true(h:release())
  end)

  it("a release whose reply is lost reports released, and the lock is free", function()
    local name = helpers.unique("rel")
    local h = assert(locks:acquire(name))
    local ok, err = lost(function() return h:release() end)
    assert.is_true(ok, err)
    assert.is_false(h:held())
    local st = assert(olocks:status(name))
    assert.is_false(st.held)
    assert.equal(h.token, st.token)
    assert(locks:try(name)):release()         -- anybody can take it
  end)

  it("an extend whose reply is lost reports extended, and the lease is the new one", function()
    local name = helpers.unique("ext")
    local h = assert(locks:acquire(name, { ttl = 5 }))
    local ok, err = lost(function() return h:extend(60) end)
    assert.is_true(ok, err)
    assert.is_true(h:held())
    local st = assert(olocks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    assert.is_true(st.remaining > 30)
    assert.is_true(h:release())
    assert.is_false(assert(olocks:status(name)).held)
  end)

  describe("document locks", function()
    local docs, DB
    local function get(id)
      local r = assert(observer._core:command(DB, { find = docs.coll }, { filter = { _id = id } }))
      return r.cursor.firstBatch[1]
    end
    setup(function()
      DB = helpers.database
      docs = client:documents(DB, helpers.unique("lostdocs"))
      assert(client._core:command(DB, { insert = docs.coll },
        { documents = { { _id = "o1", n = 0 }, { _id = "o2", n = 0 } } }))
    end)

    it("a lock whose reply and retry are both lost leaves the document unlocked", function()
      local d, err = lost_twice(function() return docs:try("o2") end)
      assert.is_nil(d)
      assert.is_string(err)
      assert.is_true(testing.renew_flush(client._core))
      assert.equal(null, get("o2").lockId)
      local d2, h2 = docs:try("o2")
      assert.is_table(d2, h2)
      assert.is_true(h2:release())
    end)

    it("a lock and a write-and-unlock whose replies are lost: locked once, written once, unlocked", function()
      local doc, h = lost(function() return docs:lock("o1", { timeout = 5 }) end)
      assert.is_table(doc, h)
      assert.equal(0, doc.n)
      assert.equal(h.owner, get("o1").lockId)
      local ok, err = lost(function() return h:release({ ["$inc"] = { n = 1 } }) end)
      assert.is_true(ok, err)
      local stored = get("o1")
      assert.equal(1, stored.n)               -- the caller's change, applied once
      assert.equal(null, stored.lockId)
      local d2, h2 = docs:try("o1")
      assert.is_table(d2, h2)
      assert.is_true(h2:release())
    end)
  end)
end)
