-- #integration: server errors come back as nil, message, code and leave no
-- lock held by nobody.  Faults are injected with the failCommand fail point
-- (the stand-in, or mongod with enableTestCommands=1), scoped to one
-- client's appname so that nothing else is affected.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local mongolock = require "mongolock"

describe("#integration server errors", function()
  local client, locks, app, observer, olocks
  setup(function()
    app = helpers.unique("faulty")
    client = helpers.connect({ appname = app })
    locks = helpers.locks(client)
    assert(locks:try("warm")):release()       -- index made, connection open
    observer = helpers.connect()
    olocks = observer:locks({ database = locks.database, collection = locks.collection })
  end)
  teardown(function()
    testing.failpoint(observer._core, { mode = "off" })
    client:close()
    observer:close()
  end)

  local function fail(spec)
    spec.app_name = app
    assert(testing.failpoint(observer._core, spec))
  end

  it("an unsatisfiable write concern is an error with MongoDB's code, nothing held", function()
    local c = helpers.connect({ write_concern = 50 })
    local l = c:locks({ database = locks.database, collection = locks.collection })
    local name = helpers.unique("wc")
    local h, err, code = l:try(name)
    assert.is_nil(h)
    assert.is_string(err)
    assert.equal(100, code)                   -- UnsatisfiableWriteConcern
    local st = olocks:status(name)
    assert.is_true(st == nil or st.held == false)
    c:close()
  end)

  it("the URI's w is the write concern when write_concern is not given; the option wins over it", function()
    local uri = helpers.uri()
    local with_w = uri .. (uri:find("?", 1, true) and "&" or "?") .. "w=50"
    local l = function(c) return c:locks({ database = locks.database, collection = locks.collection }) end
    local c = assert(mongolock.connect(with_w))
    local h, err, code = l(c):try(helpers.unique("uri-w"))
    assert.is_nil(h, "the URI's w=50 was not used")
    assert.is_string(err)
    assert.equal(100, code)                   -- UnsatisfiableWriteConcern
    c:close()
    c = assert(mongolock.connect(with_w, { write_concern = 1 }))
    h, err = l(c):try(helpers.unique("uri-w"))
    assert.is_truthy(h, err)
    assert.is_true(h:release())
    c:close()
  end)

  -- a write concern error comes after the write was applied: whatever the
  -- attempt took is given back before the error is returned
  it("a write concern error after a won attempt is an error, and the lock, share, permit or document is "
     .. "given back",
     function()
    local ns = { database = locks.database, collection = locks.collection }
    local rw, sems = client:rwlocks(ns), client:semaphores(ns)
    local docs_coll = helpers.unique("wce-docs")
    local docs = client:documents(locks.database, docs_coll)
    local name = helpers.unique("wce")
    local attempts = {
      lock = function() return locks:try(name .. "lock") end,
      read = function() return rw:try_read(name .. "read") end,
      permit = function() return sems:try(name .. "permit", { permits = 2 }) end,
      document = function() return docs:try(name, { insert = { n = 1 } }) end,
    }
    for kind, attempt in pairs(attempts) do
      fail({ times = 1, commands = { "findAndModify" }, write_concern_error = 64 })
      local h, err, code = attempt()
      assert.is_nil(h, kind)
      assert.is_string(err)
      assert.equal(64, code, kind)            -- WriteConcernFailed
    end
    local st = olocks:status(name .. "lock")
    assert.is_true(st == nil or st.held == false, "the lock is still held")
    assert.equal(0, assert(observer:rwlocks(ns):status(name .. "read")).in_use)
    assert.equal(0, assert(observer:semaphores(ns):status(name .. "permit", { permits = 2 })).in_use)
    assert.is_false(assert(observer:documents(locks.database, docs_coll):status(name)).held)
  end)

  -- MongoDB labels a retryable write's failover errors (91, 189, 11600...)
  -- RetryableWriteError and the driver retries such a write once: a fault
  -- armed for one command is absorbed, one armed for two reaches the caller
  -- of a try (a waiting acquire tries again: spec/outage_spec.lua).
  it("a failed try returns nil, message, code and holds nothing", function()
    local name = helpers.unique("fam-error")
    fail({ times = 2, commands = { "findAndModify" }, error_code = 91 })
    local h, err, code = locks:try(name)
    assert.is_nil(h)
    assert.is_string(err)
    assert.equal(91, code)
    assert.is_nil(olocks:status(name))
    assert(locks:try(name)):release()         -- the fault is spent
  end)

  it("an error that is not retryable is returned from the first attempt", function()
    local name = helpers.unique("fam-error-once")
    fail({ times = 1, commands = { "findAndModify" }, error_code = 96 })   -- OperationFailed
    local h, err, code = locks:try(name)
    assert.is_nil(h)
    assert.is_string(err)
    assert.equal(96, code)
    assert.is_nil(olocks:status(name))
    assert(locks:try(name)):release()
  end)

  -- a failure that is not "busy" says nothing trustworthy of what the
  -- attempt wrote (a lost reply can hide a place, or the lock taken under
  -- the waiter's id): the waiter leaves, which gives either back
  it("a waiter whose attempt failed leaves the queue before it returns the error", function()
    local name = helpers.unique("fam-error-leave")
    fail({ times = 1, commands = { "findAndModify" }, error_code = 96 })   -- OperationFailed
    local before = helpers.opcounters(observer).update
    local h, err, code = locks:acquire(name, { timeout = 5 })
    assert.is_nil(h)
    assert.is_string(err)
    assert.equal(96, code)
    assert.equal(1, helpers.opcounters(observer).update - before, "the leave")
    assert(locks:try(name)):release()
  end)

  it("a failover error during acquire is retried by the driver, and the lock is held once", function()
    local name = helpers.unique("fam-failover")
    fail({ times = 1, commands = { "findAndModify" }, error_code = 189 })
    local h = assert(locks:try(name))
    local st = assert(olocks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    assert.equal(h.token, st.token)
    assert.is_true(h:release())
  end)

  it("a connection closed during acquire is retried with the same owner id", function()
    local name = helpers.unique("fam-closed")
    fail({ times = 1, commands = { "findAndModify" }, close_connection = true })
    local h = assert(locks:acquire(name, { timeout = 5 }))
    local st = assert(olocks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    assert.is_true(h:release())
  end)

  it("a connection that keeps closing is an error after the one retry, nothing held", function()
    local name = helpers.unique("fam-closed-again")
    fail({ times = 5, commands = { "findAndModify" }, close_connection = true })
    local h, err, code = locks:try(name)
    assert.is_nil(h)
    assert.is_string(err)
    assert.is_number(code)
    assert(testing.failpoint(observer._core, { mode = "off" }))
    assert.is_nil(olocks:status(name))
    assert(locks:try(name)):release()
    -- the lost reply's release is sent again in the background, a second
    -- apart, until two are answered: let it end before the next case arms
    -- its fail point on this client's updates
    core.sleep(2.5)
  end)

  it("an acquire right after a connection error finds the live server within its timeout", function()
    -- the closed connection marks the server unknown, and libmongoc's
    -- monitor looks again only after its heartbeat (10 s), unless a server
    -- selection asks it to: the waiter asks through the background thread
    local name = helpers.unique("after-close")
    fail({ times = 2, commands = { "find" }, close_connection = true })
    local r, err = client._core:command(locks.database, { find = locks.collection }, { filter = { _id = name } })
    assert(testing.failpoint(observer._core, { mode = "off" }))
    assert.is_nil(r)
    assert.is_string(err)
    assert.is_false(client._core:writable(), "the server is marked unknown")
    local h, aerr = locks:acquire(name, { timeout = 3 })
    assert.is_truthy(h, aerr)
    assert.is_true(h:release())
  end)

  it("a failed release keeps the handle held, so that release can be retried", function()
    local name = helpers.unique("rel-error")
    local h = assert(locks:acquire(name))
    fail({ times = 2, commands = { "update" }, error_code = 91 })
    local ok, err, code = h:release()
    assert.is_nil(ok)
    assert.is_string(err)
    assert.equal(91, code)
    assert.is_true(h:held())
    assert.is_true(assert(olocks:status(name)).held)
    assert.is_true(h:release())
    assert.is_false(assert(olocks:status(name)).held)
  end)

  it("a release that meets a failover error is retried by the driver and releases", function()
    local name = helpers.unique("rel-failover")
    local h = assert(locks:acquire(name))
    fail({ times = 1, commands = { "update" }, error_code = 11600 })
    assert.is_true(h:release())
    assert.is_false(h:held())
    assert.is_false(assert(olocks:status(name)).held)
  end)

  it("a release whose connection closes is retried by the driver and releases", function()
    local name = helpers.unique("rel-closed")
    local h = assert(locks:acquire(name))
    fail({ times = 1, commands = { "update" }, close_connection = true })
    assert.is_true(h:release())
    assert.is_false(assert(olocks:status(name)).held)
  end)

  it("a failed extend is an error, not 'lost'", function()
    local name = helpers.unique("ext-error")
    local h = assert(locks:acquire(name))
    fail({ times = 2, commands = { "update" }, error_code = 91 })
    local ok, err, code = h:extend(60)
    assert.is_nil(ok)
    assert.not_equal("lost", err)
    assert.equal(91, code)
    assert.is_true(h:held())
    assert.is_true(h:extend(60))
    assert.is_true(h:release())
  end)

  it("an extend that meets a failover error is retried by the driver", function()
    local name = helpers.unique("ext-failover")
    local h = assert(locks:acquire(name, { ttl = 5 }))
    fail({ times = 1, commands = { "update" }, error_code = 189 })
    assert.is_true(h:extend(60))
    assert.is_true(assert(olocks:status(name)).expires_at > assert(olocks:status(name)).acquired_at + 30)
    assert.is_true(h:release())
  end)
end)
