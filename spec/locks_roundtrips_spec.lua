-- #integration: every uncontended operation is one command, counted by the
-- server itself (serverStatus opcounters), not by timing.
local helpers = require "helpers"

describe("#integration round trips", function()
  local client, commands

  setup(function()
    -- no heartbeat lands inside a measurement: monitors poll once a minute
    client = helpers.connect({ appname = "roundtrips" },
      helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    -- commands the server counted while fn ran, less serverStatus's own
    local overhead
    commands, overhead = helpers.command_counter(client)
    assert.is_true(overhead == 0 or overhead == 1)
    -- the counts are the server's, of every client: a client an earlier
    -- spec closed while its stream (a waiter's or a holder's) awaited a
    -- getMore sends that stream's killCursors when the getMore returns, at
    -- most its await (2.5 s) later: waited out
    require("mongolock.core").sleep(3)
  end)
  teardown(function() client:close() end)

  it("creates the TTL index once per collection per process", function()
    local locks = helpers.locks(client)
    local n = commands(function() assert(locks:try("a")):release() end)
    assert.equal(3, n)                  -- createIndexes, findAndModify, update
    n = commands(function() assert(locks:try("b")):release() end)
    assert.equal(2, n)
    -- another locks object on the same collection
    local again = client:locks({ database = locks.database, collection = locks.collection })
    n = commands(function() assert(again:try("c")):release() end)
    assert.equal(2, n)
    -- another client of this process, on the same server and collection
    local other = helpers.connect({}, helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    local third = other:locks({ database = locks.database, collection = locks.collection })
    assert(third:status("c"))           -- connected before counting
    n = commands(function() assert(third:try("d")):release() end)
    assert.equal(2, n)
    other:close()
  end)

  it("acquire, try, release, extend, status, list, force_release: one each", function()
    local locks = helpers.locks(client)
    assert(locks:try("warm")):release()
    local h
    assert.equal(1, (commands(function() h = assert(locks:acquire("x")) end)))
    assert.equal(1, (commands(function() assert.equal("busy", select(2, locks:try("x"))) end)))
    assert.equal(1, (commands(function() assert(h:extend(10)) end)))
    assert.equal(1, (commands(function() assert(locks:status("x")) end)))
    assert.equal(1, (commands(function() assert(locks:list()) end)))
    assert.equal(1, (commands(function() assert(h:release()) end)))
    local h2
    assert.equal(1, (commands(function() h2 = assert(locks:try("x")) end)))
    assert.equal(1, (commands(function() assert(locks:force_release("x")) end)))
    -- a released handle answers without a round trip
    assert.equal(0, (commands(function() assert.is_nil(h:release()) end)))
    assert.equal(0, (commands(function() assert.is_nil(h:remaining()) end)))
    -- closed here, not collected later: a handle collected while it still
    -- believes it holds is released by the background thread, whose
    -- commands would land in another test's count
    h2:close()
  end)

  it("a waiter backs off: one command per attempt, a handful per second", function()
    local locks = helpers.locks(client)
    -- another client holds it (its own client's wait answers "deadlock")
    local c2 = helpers.connect({ appname = "roundtrips-holder" })
    local h = assert(c2:locks({ database = locks.database, collection = locks.collection }):acquire("held"))
    -- step 1 ms doubling to 0.5 s with jitter: about a dozen attempts in
    -- 1 s, where a busy loop would make thousands
    local n = commands(function()
      assert.equal("timeout", select(2, locks:acquire("held", { timeout = 1, wait = "poll" })))
    end)
    assert.is_true(n >= 5 and n <= 20, n .. " commands")
    assert.is_true(h:release())
    c2:close()
  end)

  it("a full uncontended cycle is two commands", function()
    local locks = helpers.locks(client)
    assert(locks:try("warm")):release()
    local n = commands(function()
      for _ = 1, 50 do assert(assert(locks:acquire("cycle")):release()) end
    end)
    assert.equal(100, n)
  end)
end)
