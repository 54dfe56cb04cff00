-- The lease engine's renewal in batches (csrc/binding/renew.c): however many
-- leases a client holds in a collection, renewing them costs one command
-- per collection and renewal period, and each lease is still lost exactly
-- when its own renewal could not be made.  Also the writes of a held lease
-- whose answer is ambiguous: an extend that arrives after the lease's end,
-- and a release answered with a write concern error.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

describe("#integration renewal in batches", function()
  local client, observer

  setup(function()
    client = helpers.connect({ appname = "batch-spec" })
    observer = helpers.connect({ appname = "batch-observer" })
  end)
  teardown(function()
    client:close()
    observer:close()
  end)

  it("renews 300 leases of one collection with one command per period", function()
    local locks = helpers.locks(client, { ttl = 1.5 })
    local hs = {}
    for i = 1, 300 do hs[i] = assert(locks:acquire("b" .. i, { renew = true })) end
    local before = helpers.opcounters(observer).update
    core.sleep(3.2)   -- about six renewal periods of ttl / 3
    local updates = helpers.opcounters(observer).update - before
    for i = 1, 300 do assert.is_true(hs[i]:check(), "lease " .. i) end
    -- every lease is still held on the server, by its own acquisition
    local ol = observer:locks({ database = locks.database, collection = locks.collection })
    for _, i in ipairs({ 1, 150, 300 }) do
      local _, err, info = ol:try("b" .. i)
      assert.equal("busy", err)
      assert.equal(hs[i].owner, info.owner)
    end
    -- one per period (3.2 s / 0.5 s), with room for a retry; one update
    -- per lease and period would be about 1,900
    assert.is_true(updates <= 10, "renewal updates: " .. updates)
    assert.is_true(updates >= 4, "renewal updates: " .. updates)
    for i = 1, 300 do hs[i]:release() end
  end)

  it("loses only the lease that was taken, and renews the others", function()
    local locks = helpers.locks(client, { ttl = 1 })
    local hs = {}
    for i = 1, 20 do hs[i] = assert(locks:acquire("l" .. i, { renew = true })) end
    local ol = observer:locks({ database = locks.database, collection = locks.collection })
    -- taken by a write of another program, which names no lease in lost (a
    -- forced release would: its holder is told through the change stream
    -- before a renewal can find it): the batch's check finds it
    assert(observer:command(locks.database, { update = locks.collection },
      { updates = { { q = { _id = "l7" }, u = { ["$set"] = { owner = ("f"):rep(32), keeper = core.null } } } } }))
    core.sleep(1.5)
    for i = 1, 20 do
      if i == 7 then
        assert.is_true(hs[i]:lost())
        assert.same({ nil, "lost" }, { hs[i]:check() })
      else
        assert.is_true(hs[i]:check(), "lease " .. i)
        local _, err, info = ol:try("l" .. i)
        assert.equal("busy", err)
        assert.equal(hs[i].owner, info.owner)
      end
    end
    assert.is_true(testing.renew_stats(client._core).checks >= 1)
    for i = 1, 20 do hs[i]:release() end
  end)

  it("renews shares and permits with the exclusive leases of their collection", function()
    local locks = helpers.locks(client, { ttl = 1.5 })
    local rw = client:rwlocks({ database = locks.database, collection = locks.collection, ttl = 1.5 })
    local sem = client:semaphores({ database = locks.database, collection = locks.collection,
                                    ttl = 1.5, permits = 3 })
    local hs = {}
    for i = 1, 10 do hs[#hs + 1] = assert(locks:acquire("x" .. i, { renew = true })) end
    for i = 1, 10 do hs[#hs + 1] = assert(rw:read("r" .. i, { renew = true })) end
    hs[#hs + 1] = assert(rw:read("r1", { renew = true }))   -- two shares of one document
    for i = 1, 5 do hs[#hs + 1] = assert(sem:acquire("s" .. i, { renew = true })) end
    local before = helpers.opcounters(observer).update
    local checks = testing.renew_stats(client._core).checks
    core.sleep(3.2)
    local updates = helpers.opcounters(observer).update - before
    for i, h in ipairs(hs) do assert.is_true(h:check(), "lease " .. i) end
    assert.is_true(updates <= 10, "renewal updates: " .. updates)
    assert.equal(checks, testing.renew_stats(client._core).checks)
    for _, h in ipairs(hs) do h:release() end
  end)

  it("keeps a lease whose first two renewals fail (ttl 6, retried every ttl/10)", function()
    local locks = helpers.locks(client, { ttl = 6 })
    local h = assert(locks:acquire("flaky", { renew = true }))
    assert(testing.failpoint(observer._core, { times = 2, commands = { "update" }, error_code = 91,
                                                app_name = "batch-spec" }))
    finally(function() testing.failpoint(observer._core, { mode = "off" }) end)
    local failures = testing.renew_stats(client._core).failures
    -- the first renewal at 2 s fails, its retries at 0.6 s intervals: the
    -- third succeeds, well before the lease's end at 6 s
    core.sleep(4.5)
    assert.equal(failures + 2, testing.renew_stats(client._core).failures)
    assert.is_true(h:check())
    assert.is_true(h:remaining() > 3.5)
    assert.is_true(h:release())
  end)
end)

describe("#integration releases in batches", function()
  local observer

  setup(function() observer = helpers.connect({ appname = "release-observer" }) end)
  teardown(function() observer:close() end)

  it("client:close() releases what its handles hold, one command per collection and kind", function()
    local c = helpers.connect({ appname = "release-close" })
    local locks = helpers.locks(c, { ttl = 30 })
    local rw = c:rwlocks({ database = locks.database, collection = locks.collection, ttl = 30 })
    local hs = {}
    for i = 1, 40 do hs[#hs + 1] = assert(locks:acquire("c" .. i, { renew = i % 2 == 0 })) end
    for i = 1, 5 do hs[#hs + 1] = assert(rw:read("cr" .. i)) end
    local before = helpers.opcounters(observer).update
    c:close()
    local updates = helpers.opcounters(observer).update - before
    assert.is_true(updates <= 2, "release updates: " .. updates)
    local ol = observer:locks({ database = locks.database, collection = locks.collection })
    for i = 1, 40 do assert.is_false(assert(ol:status("c" .. i)).held, "c" .. i) end
    local orw = observer:rwlocks({ database = locks.database, collection = locks.collection })
    for i = 1, 5 do assert.equal(0, assert(orw:status("cr" .. i)).in_use, "cr" .. i) end
    for _, h in ipairs(hs) do assert.same({ nil, "closed" }, { h:check() }) end
  end)

  it("collected handles are released together", function()
    local c = helpers.connect({ appname = "release-gc" })
    local locks = helpers.locks(c, { ttl = 30 })
    local function take()
      for i = 1, 60 do assert(locks:acquire("g" .. i)) end
    end
    take()
    local before = helpers.opcounters(observer).update
    collectgarbage()
    collectgarbage()
    assert.is_true(testing.renew_flush(c._core, 10))
    local updates = helpers.opcounters(observer).update - before
    assert.is_true(updates < 60, "release updates: " .. updates)
    local ol = observer:locks({ database = locks.database, collection = locks.collection })
    for i = 1, 60 do assert.is_false(assert(ol:status("g" .. i)).held, "g" .. i) end
    c:close()
  end)
end)

describe("#integration a held lease's ambiguous writes", function()
  local client, observer

  setup(function()
    client = helpers.connect({ appname = "ambiguous-spec" })
    observer = helpers.connect({ appname = "ambiguous-observer" })
  end)
  teardown(function()
    client:close()
    observer:close()
  end)

  it("an extend that arrives after the lease's end does not bring it back", function()
    local locks = helpers.locks(client, { ttl = 0.3 })
    local h = assert(locks:acquire("late", { renew = false }))
    -- the extend a frozen holder would still send: built while its lease
    -- was live (core.lease_step: what h:extend(30) sends), sent after
    local op = assert(core.lease_step(h, "extend", 30))
    core.sleep(0.5)
    assert.is_true(h:lost())
    local reply = assert(client._core:run(op))
    assert.equal(0, core.parse_update(reply))
    local st = assert(locks:status("late"))
    assert.is_false(st.held)
  end)

  it("a release answered with a write concern error leaves a handle that says released", function()
    local locks = helpers.locks(client, { ttl = 30 })
    local h = assert(locks:acquire("wce", { renew = false }))
    assert(testing.failpoint(observer._core, { times = 1, commands = { "update" }, write_concern_error = 64,
                                                app_name = "ambiguous-spec" }))
    finally(function() testing.failpoint(observer._core, { mode = "off" }) end)
    assert.is_true(h:release())
    assert.is_false(h:held())
    assert.same({ nil, "not held" }, { h:check() })
    -- the release was applied: a rival takes the lock at once
    local ol = observer:locks({ database = locks.database, collection = locks.collection })
    local h2 = assert(ol:try("wce"))
    assert.is_false(h:held())
    h2:release()
  end)
end)
