-- Background renewal and lost-lease detection (csrc/binding/renew.c).
--
-- Leases here are short (ttl 1 s) so that renewal has to happen for the
-- lock to survive; the assertions are about what the server and the
-- handle say, never about how long something took.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

describe("#integration background renewal", function()
  local client

  -- a second contender (ol) finds name held by h's acquisition (token)
  local function assert_held(ol, name, h, token)
    local h2, err, info = ol:try(name)
    assert.is_nil(h2)
    assert.equal("busy", err)
    assert.equal(h.owner, info.owner)
    assert.equal(token, info.token)
    assert.is_false(h:lost())
  end

  setup(function()
    client = helpers.connect({ appname = "renew-spec" })
  end)
  teardown(function() client:close() end)

  it("keeps a lock alive for 5 x ttl", function()
    local locks = helpers.locks(client, { ttl = 1 })
    local other = helpers.connect({ appname = "renew-other" })
    local ol = other:locks({ database = locks.database, collection = locks.collection })
    local h = assert(locks:acquire("long", { renew = true }))
    assert.is_true(h.renew)
    local token = h.token
    for _ = 1, 5 do
      core.sleep(1)
      assert_held(ol, "long", h, token)
      assert.is_true(h:check())
    end
    local st = testing.renew_stats(client._core)
    assert.is_true(st.running)
    assert.is_true(st.renewals >= 5)
    assert.is_true(h:release())
    -- released: the thread lets it go
    assert.same({ nil, "not held" }, { h:check() })
    other:close()
  end)

  it("renews a short lease taken while the thread sleeps for a long one", function()
    -- the thread sleeps until the long lease's renewal (10 s away); the
    -- short one, due much sooner, must wake it
    local long = helpers.locks(client, { ttl = 30 })
    local short = client:locks({ database = long.database, collection = long.collection, ttl = 1 })
    local other = helpers.connect({ appname = "renew-other" })
    local ol = other:locks({ database = long.database, collection = long.collection })
    local hl = assert(long:acquire("long-lease", { renew = true }))
    core.sleep(0.2)
    local hs = assert(short:acquire("short-lease", { renew = true }))
    for _ = 1, 3 do
      core.sleep(1)
      assert_held(ol, "short-lease", hs, hs.token)
    end
    assert.is_true(hs:release())
    assert.is_true(hl:release())
    other:close()
  end)

  it("without renew the same lease ends", function()
    local locks = helpers.locks(client, { ttl = 1 })
    local other = helpers.connect()
    local ol = other:locks({ database = locks.database, collection = locks.collection })
    local h = assert(locks:acquire("short"))
    assert.is_false(h.renew)
    -- its lease ends on the server's clock: another client gets it
    local h2 = helpers.eventually(function() return (ol:try("short")) end, 10)
    assert.is_truthy(h2)
    assert.is_true(h2.token > h.token)
    assert.same({ nil, "lost" }, { h:check() })
    assert.is_true(h:lost())
    assert.same({ nil, "lost" }, { h:release() })
    assert.is_true(h2:release())
    other:close()
  end)

  it("marks the handle lost when a renewal finds the lock gone", function()
    local locks = helpers.locks(client, { ttl = 3 })
    local h = assert(locks:acquire("gone", { renew = true }))
    local before = testing.renew_stats(client._core).lost
    -- someone deletes the lock document (by hand, or force_release)
    assert.equal(1, testing.delete(client._core, locks.database, locks.collection, "gone"))
    -- the next renewal (a third of the ttl later) matches nothing
    assert.is_truthy(helpers.eventually(function() return h:lost() end, 10))
    assert.same({ nil, "lost" }, { h:check() })
    assert.same({ nil, "lost" }, { h:extend() })
    -- (counted by the renewal thread as it drops the lease, right after)
    assert.is_truthy(helpers.eventually(function()
      return testing.renew_stats(client._core).lost >= before + 1
    end, 5))
    assert.same({ nil, "lost" }, { h:remaining() })
    h:close()
  end)

  it("marks the handle lost when renewals fail, before the lease ends", function()
    local app = helpers.unique("renew-fail"):sub(1, 60)
    local c2 = helpers.connect({ appname = app })
    local locks = helpers.locks(c2, { ttl = 1 })
    local other = helpers.connect()
    local ol = other:locks({ database = locks.database, collection = locks.collection })
    local h = assert(locks:acquire("failing", { renew = true }))
    -- every update of this client fails from now on: renewals included
    assert(testing.failpoint(c2._core, { mode = "alwaysOn", commands = { "update" },
      error_code = 2, app_name = app }))
    local ok, err = pcall(function()
      assert.is_truthy(helpers.eventually(function() return h:lost() end, 10))
      -- the server's lease began no earlier than our local clock says, so
      -- the lock is flagged lost no later than it can be taken
      assert.same({ nil, "lost" }, { h:check() })
      -- the renewal thread counts the loss too, whether it saw the local
      -- deadline pass first or this thread did (it wakes at the deadline)
      local st = helpers.eventually(function()
        local s = testing.renew_stats(c2._core)
        return s.lost >= 1 and s
      end, 5)
      assert.is_truthy(st)
      assert.is_true(st.failures >= 1)
    end)
    assert(testing.failpoint(c2._core, { mode = "off" }))
    assert(ok, err)
    -- and once it has ended on the server, another client takes it
    local h2 = helpers.eventually(function() return (ol:try("failing")) end, 10)
    assert.is_truthy(h2)
    assert.is_true(h2:release())
    c2:close()
    other:close()
  end)

  it("counts a loss the caller saw first, while the renewal was still under way", function()
    local app = helpers.unique("renew-slow"):sub(1, 60)
    local c2 = helpers.connect({ appname = app })
    local locks = helpers.locks(c2, { ttl = 1 })
    local h = assert(locks:acquire("slow", { renew = true }))
    -- the renewal (due a third of the ttl in) waits 2.5 s for its reply,
    -- so the lease's local deadline passes while it is under way
    assert(testing.failpoint(c2._core, { mode = "alwaysOn", commands = { "update" },
      block_ms = 2500, app_name = app }))
    local ok, err = pcall(function()
      assert.is_truthy(helpers.eventually(function() return h:lost() end, 5))
      assert.equal(0, testing.renew_stats(c2._core).lost)
      local st = helpers.eventually(function()
        local s = testing.renew_stats(c2._core)
        return s.lost >= 1 and s
      end, 10)
      assert.is_truthy(st)
      assert.equal(1, st.lost)
    end)
    assert(testing.failpoint(c2._core, { mode = "off" }))
    assert(ok, err)
    h:close()
    c2:close()
  end)

  it("releases a handle collected while held, from the thread", function()
    local locks = helpers.locks(client, { ttl = 30 })
    local function make(name, renew)
      local h, err = locks:acquire(name, { renew = renew })
      if not h then error(err) end
    end
    make("gc-renewed", true)
    make("gc-plain", false)
    collectgarbage()
    collectgarbage()
    assert.is_true(testing.renew_flush(client._core))
    assert.is_false(assert(locks:status("gc-renewed")).held)
    assert.is_false(assert(locks:status("gc-plain")).held)
    assert.is_true(testing.renew_stats(client._core).released >= 2)
  end)

  it("locks:with renews by default", function()
    local locks = helpers.locks(client, { ttl = 1 })
    local seen
    local r = locks:with("w", function(h)
      seen = h.renew
      return "done"
    end)
    assert.equal("done", r)
    assert.is_true(seen)
    locks:with("w2", { renew = false }, function(h) seen = h.renew end)
    assert.is_false(seen)
  end)

  it("stops with the client: pending releases and what its handles hold are released first", function()
    local c2 = helpers.connect({ appname = "renew-close" })
    local locks = helpers.locks(c2, { ttl = 30 })
    local h = assert(locks:acquire("a", { renew = true }))
    assert.is_true(testing.renew_stats(c2._core).running)
    local function make()
      local x, err = locks:acquire("b")
      if not x then error(err) end
    end
    make()
    collectgarbage()
    collectgarbage()
    c2:close()
    assert.same({ nil, "closed" }, { h:release() })
    local l = client:locks({ database = locks.database, collection = locks.collection })
    assert.is_false(assert(l:status("b")).held)
    -- "a" (its handle lives) is released by close too
    assert.is_false(assert(l:status("a")).held)
  end)

  it("is fork-safe: the child never renews or releases the parent's locks", function()
    local locks = helpers.locks(client, { ttl = 1 })
    local h = assert(locks:acquire("parent", { renew = true }))
    local pid = assert(testing.fork())
    if pid == 0 then
      -- the child: its own thread, pool and locks; the parent's handle is
      -- not its to use
      local status = 0
      local ok = pcall(function()
        local function check(c, code) if not c then status = code; error("check " .. code) end end
        local r, err = h:check()
        check(r == nil and err == "not held", 10)
        check(h:release() == nil, 11)
        h:close()
        local mine = locks:acquire("child", { renew = true, timeout = 5 })
        check(mine, 12)
        core.sleep(2)   -- two of its ttls: renewed by the child's own thread
        check(mine:check() == true, 13)
        check(testing.renew_stats(client._core).renewals >= 1, 14)
        check(mine:release() == true, 15)
      end)
      helpers.child_exit(client, ok, ok and 0 or (status ~= 0 and status or 1))
    end
    assert.equal(0, helpers.wait_child(pid, 60, pending, function() h:release() end))
    -- the parent's lease was renewed throughout, and is still ours
    assert.is_true(h:check())
    local s = assert(locks:status("parent"))
    assert.is_true(s.held)
    assert.equal(h.owner, s.owner)
    assert.is_true(h:release())
    assert.is_false(assert(locks:status("child")).held)
  end)

  it("answers h:lost() and h:check() on released and closed handles", function()
    local locks = helpers.locks(client)
    local h = assert(locks:acquire("x"))
    assert.is_true(h:check())
    assert.is_false(h:lost())
    assert.is_true(h:release())
    assert.same({ nil, "not held" }, { h:check() })
    assert.is_false(h:lost())
    h:close()
    assert.same({ nil, "closed" }, { h:check() })
    assert.is_false(h:lost())
  end)
end)
