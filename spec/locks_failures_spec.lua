-- #integration: server errors come back as nil, message, code and leave no
-- lock held by nobody.  Faults are injected with the failCommand fail point
-- (the stand-in, or mongod with enableTestCommands=1), scoped to one
-- client's appname so that nothing else is affected.
local helpers = require "helpers"
local core = require "mongolock.core"

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
    core._failpoint(observer._core, { mode = "off" })
    client:close()
    observer:close()
  end)

  local function fail(spec)
    spec.app_name = app
    assert(core._failpoint(observer._core, spec))
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

  it("a failed acquire returns nil, message, code and holds nothing", function()
    local name = helpers.unique("fam-error")
    fail({ times = 1, commands = { "findAndModify" }, error_code = 91 })
    local h, err, code = locks:acquire(name, { timeout = 5 })
    assert.is_nil(h)
    assert.is_string(err)
    assert.equal(91, code)                    -- returned at once, not waited on
    assert.is_nil(olocks:status(name))
    assert(locks:try(name)):release()         -- the fault was one-shot
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
    assert(core._failpoint(observer._core, { mode = "off" }))
    assert.is_nil(olocks:status(name))
    assert(locks:try(name)):release()
  end)

  it("a failed release keeps the handle held, so that release can be retried", function()
    local name = helpers.unique("rel-error")
    local h = assert(locks:acquire(name))
    fail({ times = 1, commands = { "update" }, error_code = 91 })
    local ok, err, code = h:release()
    assert.is_nil(ok)
    assert.is_string(err)
    assert.equal(91, code)
    assert.is_true(h:held())
    assert.is_true(assert(olocks:status(name)).held)
    assert.is_true(h:release())
    assert.is_false(assert(olocks:status(name)).held)
  end)

  it("a failed extend is an error, not 'lost'", function()
    local name = helpers.unique("ext-error")
    local h = assert(locks:acquire(name))
    fail({ times = 1, commands = { "update" }, error_code = 91 })
    local ok, err, code = h:extend(60)
    assert.is_nil(ok)
    assert.not_equal("lost", err)
    assert.equal(91, code)
    assert.is_true(h:held())
    assert.is_true(h:extend(60))
    assert.is_true(h:release())
  end)
end)
