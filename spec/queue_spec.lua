-- The waiter queue in the lock document (doc/design.md, "Waiters"):
-- arrival order, a release handed to the first live waiter and routed to
-- it alone, try never jumping the queue, places lapsing after queue_ttl,
-- and a waiter that gives up passing the lock on.
--
-- The raw attempts use the core's acquire with a waiter id, the call
-- mongolock.locks makes on every attempt of an acquire; order across
-- processes is checked with real acquires in child processes.
local helpers = require "helpers"
local core = require "mongolock.core"

local DB = helpers.database

describe("#integration waiter queue", function()
  local client, locks

  before_each(function()
    client = helpers.connect()
    locks = helpers.locks(client)
  end)

  after_each(function()
    client:close()
  end)

  -- one attempt of a queued acquire: h | nil, "busy", info
  local function attempt(name, waiter, queue_ms, ttl_ms, polling)
    return client._core:acquire(DB, locks.collection, name, ttl_ms or 30000, nil, false, waiter,
      queue_ms or 30000, polling)
  end

  local function doc(name)
    local r = assert(client:command(DB, { find = locks.collection }, { filter = { _id = name } }))
    return r.cursor.firstBatch[1]
  end

  local function queue_ids(name)
    local d = doc(name)
    local ids = {}
    for i, e in ipairs(d and d.queue or {}) do ids[i] = e.w end
    return ids
  end

  -- the stream's answer for waiter w (nil: any waiter) about a release of
  -- name after the operation time of the attempt that answered info
  local function watch(name, info, secs, w)
    local ot = info.operation_time
    return core.watch_wait(client._core, DB, locks.collection, "owner", name, ot.t, ot.i, secs, w)
  end

  -- what a release handed to waiter w sets next to: this process's tag
  -- and w
  local function handed(w) return core.process_tag() .. w end

  it("waiter ids are 128 random bits; entries carry this process's tag", function()
    local a, b = core.waiter_id(), core.waiter_id()
    assert.matches("^%x+$", a)
    assert.equal(32, #a)
    assert.not_equal(a, b)
    assert.not_equal(a:sub(1, 16), b:sub(1, 16))
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    attempt(name, a)
    local e = doc(name).queue[1]
    assert.equal(a, e.w)
    assert.equal(core.process_tag(), e.t)
    assert.matches("^%x+$", e.t)
    assert.equal(16, #e.t)
    assert.is_true(h:release())
    assert.equal(handed(a), doc(name).next)
  end)

  it("refuses a bad queue_ttl or waiter id, sending nothing", function()
    local name = helpers.unique("q")
    for _, bad in ipairs({ -1, 0, "3", 0 / 0, math.huge }) do
      assert.has_error(function() client:locks({ queue_ttl = bad }) end)
      assert.has_error(function() locks:acquire(name, { queue_ttl = bad }) end)
    end
    for _, bad in ipairs({ "x", ("A"):rep(32), ("0"):rep(31), ("0"):rep(33), {} }) do
      assert.has_error(function() attempt(name, bad) end)
      assert.has_error(function() client._core:leave(DB, locks.collection, name, bad) end)
    end
    assert.is_nil(locks:status(name))
  end)

  it("queues waiters in arrival order and reports their places", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local w1, w2, w3 = core.waiter_id(), core.waiter_id(), core.waiter_id()
    local _, err, info = attempt(name, w1)
    assert.equal("busy", err)
    assert.equal(1, info.position)
    _, _, info = attempt(name, w2)
    assert.equal(2, info.position)
    _, _, info = attempt(name, w3)
    assert.equal(3, info.position)
    -- a second attempt keeps the waiter's place
    _, _, info = attempt(name, w1)
    assert.equal(1, info.position)
    assert.equal(3, info.queued)
    assert.same({ w1, w2, w3 }, queue_ids(name))
    assert.equal(3, locks:status(name).waiting)
    assert.is_true(h:release())
  end)

  it("a release grants the lock to the first waiter: others and try find it busy", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local w1, w2 = core.waiter_id(), core.waiter_id()
    assert.equal("busy", select(2, attempt(name, w1)))
    assert.equal("busy", select(2, attempt(name, w2)))
    assert.is_true(h:release())
    -- the release itself made w1 the owner, with a new token, and took it
    -- out of the queue
    local d = doc(name)
    assert.equal(handed(w1), d.next)
    assert.equal(w1, d.owner)
    assert.is_true(d.token > h.token)
    assert.same({ w2 }, queue_ids(name))
    local _, err = locks:try(name)
    assert.equal("busy", err)
    assert.is_true(locks:status(name).held)
    local info
    _, err, info = attempt(name, w2)
    assert.equal("busy", err)
    assert.equal(1, info.position)
    -- an attempt of w1 (one that missed the event) finds the grant: won,
    -- with the granted token, and nothing is queued again
    local h1 = assert(attempt(name, w1))
    assert.equal(w1, h1.owner)
    assert.equal(d.token, h1.token)
    assert.same({ w2 }, queue_ids(name))
    assert.is_true(h1:release())
    assert.equal(handed(w2), doc(name).next)
    assert.equal(w2, doc(name).owner)
    local h2 = assert(attempt(name, w2))
    assert.is_true(h2.token > h1.token)
    assert.is_true(h2:release())
    -- an empty queue: the release frees it and the next try takes it
    assert.equal(require("mongolock").null, doc(name).owner)
    local h3 = assert(locks:try(name))
    assert.is_true(h3:release())
  end)

  it("polling waiters keep their place but hold no watching waiter up", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local poller, watcher, late = core.waiter_id(), core.waiter_id(), core.waiter_id()
    attempt(name, poller, nil, nil, true)
    attempt(name, watcher)
    attempt(name, late, nil, nil, true)
    assert.is_true(h:release())
    -- the release is granted to the first watching waiter (a poller cannot
    -- be woken), ahead of the poller that asked before it
    assert.equal(handed(watcher), doc(name).next)
    assert.equal(watcher, doc(name).owner)
    assert.same({ poller, late }, queue_ids(name))
    local _, err, info = attempt(name, late, nil, nil, true)
    assert.equal("busy", err)
    assert.equal(2, info.position)
    assert.equal("busy", select(2, attempt(name, poller, nil, nil, true)))
    local hw = assert(attempt(name, watcher))
    assert.is_true(hw:release())
    -- only pollers are left: nothing is granted, they race, and a try does too
    assert.equal(require("mongolock").null, doc(name).next)
    assert.equal(require("mongolock").null, doc(name).owner)
    local ht = assert(locks:try(name))
    assert.is_true(ht:release())
    assert.truthy(attempt(name, late, nil, nil, true)):release()
  end)

  it("a waiter that gives up passes a lock granted to it on to the next", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local w1, w2 = core.waiter_id(), core.waiter_id()
    attempt(name, w1)
    attempt(name, w2)
    assert.is_true(h:release())
    local t1 = doc(name).token
    assert.equal(handed(w1), doc(name).next)
    assert.equal(w1, doc(name).owner)
    assert.is_true(client._core:leave(DB, locks.collection, name, w1))
    assert.equal(handed(w2), doc(name).next)
    assert.equal(w2, doc(name).owner)
    assert.is_true(doc(name).token > t1)
    assert.same({}, queue_ids(name))
    -- leaving twice changes nothing
    assert.is_true(client._core:leave(DB, locks.collection, name, w1))
    assert.equal(w2, doc(name).owner)
    -- the last one leaves: the lock is free, nothing is handed on
    assert.is_true(client._core:leave(DB, locks.collection, name, w2))
    assert.equal(require("mongolock").null, doc(name).owner)
    assert.equal(require("mongolock").null, doc(name).next)
    assert.truthy(locks:try(name)):release()
  end)

  it("a place lapses when its waiter stops coming back", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local dead, live = core.waiter_id(), core.waiter_id()
    attempt(name, dead, 300)
    attempt(name, live, 300)
    assert.is_true(h:release())
    -- the live waiter comes back in time; the dead one never does
    local took = helpers.eventually(function()
      local h2 = attempt(name, live, 300)
      return h2
    end, 5)
    assert.truthy(took)
    assert.equal(live, took.owner)
    assert.same({}, queue_ids(name))
    took:release()
  end)

  it("acquire's timeout takes its place out of the queue", function()
    local name = helpers.unique("q")
    -- another client holds it (its own client's acquire answers "deadlock")
    local c2 = helpers.connect()
    local h = assert(c2:locks({ database = locks.database, collection = locks.collection }):try(name))
    local _, err = locks:acquire(name, { timeout = 0.05 })
    assert.equal("timeout", err)
    assert.same({}, queue_ids(name))
    assert.is_true(h:release())
    assert.truthy(locks:try(name)):release()
    c2:close()
  end)

  it("an acquire that answers \"deadlock\" (its own client holds the name) leaves no place in the queue", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local _, err = locks:acquire(name, { timeout = 5 })
    assert.equal("deadlock", err)
    assert.same({}, queue_ids(name))
    assert.is_true(h:release())
    assert.truthy(locks:try(name)):release()
  end)

  it("the first waiter takes the lock when the holder's lease ends", function()
    local name = helpers.unique("q")
    local holder = assert(locks:try(name, { ttl = 0.2 }))
    local h = assert(locks:acquire(name, { timeout = 5 }))
    assert.same({ nil, "lost" }, { holder:remaining() })
    assert.is_true(h.token > holder.token)
    h:release()
  end)

  it("a release routed to one waiter wakes that waiter only", function()
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local w1, w2 = core.waiter_id(), core.waiter_id()
    local _, _, i1 = attempt(name, w1)
    local _, _, i2 = attempt(name, w2)
    if not i1.operation_time then
      pending("needs change streams (a replica set)")
      return
    end
    -- start the process's stream (at the older time) before the release
    assert.equal("timeout", watch(name, i1, 0.05, w1))
    assert.is_true(h:release())
    -- the release granted it to w1: the event says so, with the token
    local res, token = watch(name, i1, 5, w1)
    assert.equal("granted", res)
    assert.equal(doc(name).token, token)
    assert.equal("timeout", watch(name, i2, 0.3, w2))
    -- a waiter that does not say who it is hears every release
    assert.equal("event", watch(name, i2, 5))
  end)

  it("a replaced document wakes by its new owner and next, as a release does", function()
    -- mongod may log an update pipeline that rewrites most of a small
    -- document as a whole new one: the stream then sees a replace
    local name = helpers.unique("q")
    local h = assert(locks:try(name))
    local w1, w2 = core.waiter_id(), core.waiter_id()
    local _, _, i1 = attempt(name, w1)
    if not i1.operation_time then
      pending("needs change streams (a replica set)")
      return
    end
    local function wait_for(w, secs) return watch(name, i1, secs, w) end
    local function replace(d)
      d._id = name
      assert(client:command(DB, { update = locks.collection },
        { updates = { { q = { _id = name }, u = d } } }))
    end
    assert.equal("timeout", wait_for(w1, 0.05))     -- the stream is open
    replace({ owner = "someone", token = h.token + 1 })
    assert.equal("timeout", wait_for(w1, 0.3))
    replace({ owner = require("mongolock").null, next = handed(w2), token = h.token + 1 })
    assert.equal("event", wait_for(w2, 5))
    assert.equal("timeout", wait_for(w1, 0.3))
    replace({ token = h.token + 1 })
    assert.equal("event", wait_for(w1, 5))
    h:close()
  end)

  -- children that queue one after another and write their turn to a file
  local CHILD = [[
local mongolock = require "mongolock"
local name, coll, db, out, index, mode = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI")))
local locks = c:locks({ database = db, collection = coll })
io.stdout:write("ready\n"); io.stdout:flush()
local h = assert(locks:acquire(name, { timeout = 30, wait = mode }))
local f = assert(io.open(out, "ab"))
f:write(index, "\n")
f:close()
require("mongolock.core").sleep(0.02)
assert(h:release())
c:close()
]]

  for _, mode in ipairs({ "auto", "watch" }) do
    it("processes take the lock in the order they asked (wait = " .. mode .. ")", function()
      local name = helpers.unique("order")
      local path = helpers.script(CHILD)
      local out = os.tmpname()
      local h = assert(locks:try(name))
      local procs = {}
      for i = 1, 4 do
        procs[i] = helpers.spawn(path, { name, locks.collection, DB, out, tostring(i), mode })
        assert.truthy(procs[i]:wait_for("ready"))
        -- the next child starts only once this one is queued
        assert.truthy(helpers.eventually(function()
          return #queue_ids(name) == i
        end, 20))
      end
      assert.is_true(h:release())
      for i = 1, 4 do
        local st, text = procs[i]:wait(40)
        assert.equal(0, st, text)
        procs[i]:cleanup()
      end
      local f = assert(io.open(out, "rb"))
      local order = f:read("*a")
      f:close()
      os.remove(out)
      os.remove(path)
      assert.equal("1\n2\n3\n4\n", order)
    end)
  end
end)
