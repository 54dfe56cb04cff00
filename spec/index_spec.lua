-- The TTL index only removes long-idle lock documents: no acquisition
-- needs it, so its createIndexes failing (a stepdown, a user without the
-- createIndex privilege) never fails an acquire.  The failure is reported
-- once per collection and process (mongolock.locks.log) and counted
-- (index_failures), and a later acquire tries again (index_retry seconds
-- after the failure).
local helpers = require "spec.helpers"
local locks_mod = require "mongolock.locks"

describe("#integration the TTL index", function()
  it("a stepdown on createIndexes fails no acquire; reported once; made by a later acquire", function()
    local mongolock = require "mongolock"
    local app = helpers.unique("index")
    local client = helpers.connect({ appname = app })
    local observer = helpers.connect()
    local coll = helpers.unique("index")
    local o = { database = helpers.database, collection = coll }
    local locks, rw = client:locks(o), client:rwlocks(o)
    local function fp(mode, data)
      return assert(observer:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    local logged = {}
    local log, retry = locks_mod.log, locks_mod.index_retry
    locks_mod.log = function(msg) logged[#logged + 1] = msg end
    finally(function()
      locks_mod.log, locks_mod.index_retry = log, retry
      fp("off")
      client:close()
      observer:close()
    end)
    local fired = fp("off").count
    local failures = locks_mod.index_failures
    fp("alwaysOn", { failCommands = mongolock.array({ "createIndexes" }), errorCode = 189, appName = app })
    -- the first attempt of each kind, a try and a waiting acquire
    assert(assert(locks:try(helpers.unique("t"))):release())
    assert(assert(locks:acquire(helpers.unique("a"), { timeout = 2 })):release())
    assert(assert(rw:read(helpers.unique("r"), { timeout = 2 })):release())
    assert.truthy(fp("off").count - fired >= 2, "createIndexes was refused")
    assert.truthy(locks_mod.index_failures - failures >= 2)
    -- one line per collection and process: the named locks', the shares'
    assert.equal(2, #logged, table.concat(logged, "\n"))
    assert.truthy(logged[1]:find(coll, 1, true) and logged[1]:find("189", 1, true), logged[1])
    local function indexes()
      local r = assert(observer:command(helpers.database, { listIndexes = coll }))
      local n = 0
      for _, ix in ipairs(r.cursor.firstBatch) do
        if ix.expireAfterSeconds then n = n + 1 end
      end
      return n
    end
    assert.equal(0, indexes())
    -- a later acquire makes it
    locks_mod.index_retry = 0
    assert(assert(locks:acquire(helpers.unique("b"))):release())
    assert.equal(1, indexes())
    assert.equal(2, #logged)
  end)
end)
