-- #integration: named locks against the server (the stand-in, or MONGODB_URI).
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

describe("#integration named locks", function()
  local client, locks
  setup(function()
    client = helpers.connect({ appname = "locks-basic" })
    locks = helpers.locks(client)
  end)
  teardown(function() client:close() end)

  it("acquires, reports the handle's fields, and releases", function()
    local name = helpers.unique("basic")
    local h = assert(locks:acquire(name))
    assert.equal(name, h.name)
    assert.is_truthy(h.owner:match("^%x+$"))
    assert.equal(32, #h.owner)
    assert.is_number(h.token)
    assert.is_true(h.token > 0)
    assert.equal(30, h.ttl)
    assert.is_true(h:held())
    local left = assert(h:remaining())
    assert.is_true(left > 25 and left <= 30, tostring(left))
    assert.is_true(h:release())
    assert.is_false(h:held())
  end)

  it("tells a second contender 'busy' with who holds it", function()
    local name = helpers.unique("busy")
    local h = assert(locks:acquire(name, { ttl = 20 }))
    local h2, err, info = locks:try(name)
    assert.is_nil(h2)
    assert.equal("busy", err)
    assert.equal(h.owner, info.owner)
    assert.equal(h.token, info.token)
    assert.is_true(info.remaining > 15 and info.remaining <= 20)
    assert.equal(core.getpid(), info.holder.pid)
    assert.equal("locks-basic", info.holder.app)
    assert.is_true(h:release())
    local h3 = assert(locks:try(name))
    assert.is_true(h3:release())
  end)

  -- another client holds (its own client's acquire answers "deadlock": a
  -- blocking acquire of what its own client holds, below)
  local function other_locks()
    local c2 = helpers.connect({ appname = "locks-basic-other" })
    return c2:locks({ database = locks.database, collection = locks.collection }), c2
  end

  it("acquire times out with nil, 'timeout' while the lock stays held", function()
    local name = helpers.unique("timeout")
    local theirs, c2 = other_locks()
    local h = assert(theirs:acquire(name))
    local h2, err, info = locks:acquire(name, { timeout = 0.05 })
    assert.is_nil(h2)
    assert.equal("timeout", err)
    assert.equal(h.owner, info.owner)
    assert.is_true(h:release())
    c2:close()
  end)

  it("a waiter gets the lock once the holder releases", function()
    -- the holder's lease is short, so the waiter's backoff is capped by
    -- the holder's remaining time and it wins when the lease ends
    local name = helpers.unique("wait")
    local h = assert(locks:acquire(name, { ttl = 0.3 }))
    local h2 = assert(locks:acquire(name, { timeout = 5 }))
    assert.is_true(h2.token > h.token)
    assert.same({ nil, "lost" }, { h:release() })
    assert.is_true(h2:release())
  end)

  it("answers release and extend on a released handle with 'not held'", function()
    local h = assert(locks:acquire(helpers.unique("twice")))
    assert.is_true(h:release())
    assert.same({ nil, "not held" }, { h:release() })
    assert.same({ nil, "not held" }, { h:extend(5) })
    assert.same({ nil, "not held" }, { h:remaining() })
    local token = h.token
    assert.is_true(h:close())
    assert.is_string(h.name)            -- the data stays readable
    assert.equal(token, h.token)
    assert.equal(32, #h.owner)
    assert.same({ nil, "closed" }, { h:release() })
    assert.same({ nil, "closed" }, { h:extend() })
    assert.same({ nil, "closed" }, { h:remaining() })
    assert.is_true(h:close())
  end)

  it("extends the lease; extend checks its argument", function()
    local name = helpers.unique("extend")
    local h = assert(locks:acquire(name, { ttl = 2 }))
    assert.is_true(h:extend(60))
    assert.equal(60, h.ttl)
    assert.is_true(h:remaining() > 55)
    local st = assert(locks:status(name))
    assert.is_true(st.remaining > 55)
    -- the local deadline is a lower bound of the server's (whose dates
    -- have millisecond resolution: the lease end is truncated to the ms)
    assert.is_true(h:remaining() <= st.remaining + 0.001)
    assert.is_true(h:extend())          -- the lease's own ttl again
    for _, bad in ipairs({ 0, -1, 0 / 0, math.huge, "x", {} }) do
      assert.has_error(function() h:extend(bad) end)
    end
    assert.is_true(h:release())
  end)

  it("fencing tokens strictly increase across release and takeover", function()
    local name = helpers.unique("tokens")
    local last = 0
    for i = 1, 20 do
      local h = assert(locks:acquire(name, { ttl = 0.05 }))
      assert.is_true(h.token > last, ("token %d: %s <= %s"):format(i, h.token, last))
      last = h.token
      if i % 2 == 0 then assert.is_true(h:release()) end   -- else: expires, taken over
    end
  end)

  it("status reports a held, a released and an unknown lock", function()
    local name = helpers.unique("status")
    assert.is_nil(locks:status(name))
    local h = assert(locks:acquire(name, { ttl = 10 }))
    local st = assert(locks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    assert.equal(h.token, st.token)
    assert.is_number(st.acquired_at)
    assert.is_true(st.expires_at - st.acquired_at > 9.9)
    assert.is_true(st.remaining > 0 and st.remaining <= 10)
    assert.equal(core.getpid(), st.holder.pid)
    assert.equal(core.hostname(), st.holder.host)
    assert.is_true(h:release())
    st = assert(locks:status(name))
    assert.is_false(st.held)
    assert.is_nil(st.owner)
    assert.equal(h.token, st.token)          -- the token survives release
  end)

  it("names the holder's app from the URI when connect has no appname", function()
    local c = helpers.connect(nil, helpers.uri_with({ appName = "from-uri" }))
    local l = helpers.locks(c)
    local h = assert(l:acquire("app"))
    assert.equal("from-uri", assert(l:status("app")).holder.app)
    assert.is_true(h:release())
    c:close()
  end)

  it("list shows every lock of the collection, sorted", function()
    local l = helpers.locks(client)
    local a = assert(l:acquire("a-lock"))
    local b = assert(l:acquire("b-lock"))
    assert.is_true(b:release())
    local all = assert(l:list())
    assert.equal(2, #all)
    assert.equal("a-lock", all[1].name)
    assert.is_true(all[1].held)
    assert.equal("b-lock", all[2].name)
    assert.is_false(all[2].held)
    assert.is_true(a:release())
  end)

  it("force_release frees someone else's lock; the holder learns it", function()
    local name = helpers.unique("force")
    local h = assert(locks:acquire(name))
    assert.is_true(locks:force_release(name))
    assert.same({ nil, "not held" }, { locks:force_release(name) })
    local h2 = assert(locks:try(name))
    assert.is_true(h2.token > h.token)
    assert.same({ nil, "lost" }, { h:extend() })
    assert.same({ nil, "lost" }, { h:remaining() })
    assert.same({ nil, "lost" }, { h:release() })
    assert.is_true(h2:release())
  end)

  it("only the holder can release or extend", function()
    local name = helpers.unique("owner")
    local h = assert(locks:acquire(name, { ttl = 0.1 }))
    core.sleep(0.15)          -- the lease ends by the server's clock ...
    local h2 = assert(locks:acquire(name, { timeout = 5 }))   -- ... and is taken
    assert.same({ nil, "lost" }, { h:extend(10) })
    assert.same({ nil, "lost" }, { h:release() })
    local h1 = assert(locks:acquire(helpers.unique("owner2"), { ttl = 0.1 }))
    core.sleep(0.15)
    local h1b = assert(locks:acquire(h1.name, { timeout = 5 }))
    assert.same({ nil, "lost" }, { h1:release() })   -- release first: same answer
    assert.is_true(h1b:release())
    local st = assert(locks:status(name))
    assert.is_true(st.held)
    assert.equal(h2.owner, st.owner)
    assert.is_true(h2:release())
  end)

  it("an expired lease is lost, whether or not anyone took it", function()
    local name = helpers.unique("expired-own")
    local h = assert(locks:acquire(name, { ttl = 0.05 }))
    core.sleep(0.1)
    assert.same({ nil, "lost" }, { h:remaining() })
    assert.same({ nil, "lost" }, { h:release() })
    assert.is_false(assert(locks:status(name)).held)
  end)

  it("with runs the function holding the lock and always releases", function()
    local name = helpers.unique("with")
    local seen
    local a, b = locks:with(name, { ttl = 5 }, function(h, x, y)
      seen = assert(locks:status(name)).held and h.name
      return x + y, "done"
    end, 1, 2)
    assert.equal(3, a)
    assert.equal("done", b)
    assert.equal(name, seen)
    assert.is_false(assert(locks:status(name)).held)

    local ok, err = pcall(locks.with, locks, name, nil, function() error("boom", 0) end)
    assert.is_false(ok)
    assert.equal("boom", err)
    assert.is_false(assert(locks:status(name)).held)

    local e = setmetatable({}, { __tostring = function() return "custom" end })
    ok, err = pcall(locks.with, locks, name, function() error(e) end)
    assert.is_false(ok)
    assert.equal(e, err)                 -- re-raised as it was
    assert.is_false(assert(locks:status(name)).held)
  end)

  it("with returns nil, 'timeout' without calling fn when the lock is held", function()
    local name = helpers.unique("with-busy")
    local theirs, c2 = other_locks()
    local h = assert(theirs:acquire(name))
    local called = false
    local r, err = locks:with(name, { timeout = 0.05 }, function() called = true end)
    assert.is_nil(r)
    assert.equal("timeout", err)
    assert.is_false(called)
    assert.is_true(h:release())
    c2:close()
  end)

  it("a collected handle releases its lock without raising", function()
    local name = helpers.unique("gc")
    -- made in a call that returned: no register of this function keeps it
    -- (and not luassert's assert, which keeps its arguments)
    local function make()
      local h, err = locks:acquire(name)
      if not h then error(err) end
    end
    make()
    collectgarbage()
    collectgarbage()
    -- released synchronously, or by the background thread it was handed to
    local st = helpers.eventually(function()
      local s = assert(locks:status(name))
      return not s.held and s
    end)
    assert.is_truthy(st)
  end)

  it("closing the client makes its handles answer 'closed'", function()
    local c = helpers.connect()
    local l = helpers.locks(c)
    local name = "closing"
    local h = assert(l:acquire(name, { ttl = 0.5 }))
    c:close()
    assert.same({ nil, "closed" }, { h:release() })
    assert.same({ nil, "closed" }, { h:extend() })
    assert.is_true(h:close())
    collectgarbage()
  end)

  if _VERSION == "Lua 5.4" then
    it("releases on scope exit with <close>, error or not", function()
      local name = helpers.unique("close")
      local chunk = assert(load([[
        local locks, name, fail = ...
        local h <close> = assert(locks:acquire(name))
        if fail then error("inside", 0) end
        return h.token
      ]]))
      assert.is_number(chunk(locks, name, false))
      assert.is_false(assert(locks:status(name)).held)
      local ok, err = pcall(chunk, locks, name, true)
      assert.is_false(ok)
      assert.equal("inside", err)
      assert.is_false(assert(locks:status(name)).held)
    end)
  end

  it("keeps the token above every earlier one after the document is deleted", function()
    local name = helpers.unique("deleted")
    local h = assert(locks:acquire(name))
    local t1 = h.token
    assert.is_true(h:release())
    -- the time part of the token (server ms x 1024) carries it over the
    -- deletion once the server's millisecond has moved on
    core.sleep(0.005)
    assert.equal(1, testing.delete(client._core, locks.database, locks.collection, name))
    assert.is_nil(locks:status(name))
    local h2 = assert(locks:acquire(name))
    assert.is_true(h2.token > t1, ("%s <= %s"):format(h2.token, t1))
    -- deleted while held: the holder's release finds nothing, and the next
    -- acquisition still gets a larger token
    core.sleep(0.005)
    assert.equal(1, testing.delete(client._core, locks.database, locks.collection, name))
    assert.same({ nil, "lost" }, { h2:release() })
    core.sleep(0.005)
    local h3 = assert(locks:acquire(name))
    assert.is_true(h3.token > h2.token)
    assert.is_true(h3:release())
  end)

  it("stores names of every shape, up to 1024 bytes", function()
    for _, name in ipairs({ ("n"):rep(1024), "ünïcödé ✓", "with space", "$dollar", "a.b.c" }) do
      local h = assert(locks:acquire(name))
      assert.equal(name, h.name)
      assert.is_true(assert(locks:status(name)).held)
      assert.is_true(h:release())
    end
  end)

  it("writes nothing for bad input", function()
    local l = helpers.locks(client)
    for _, bad in ipairs({ "", "a\0b", "\255", ("x"):rep(1025) }) do
      assert.has_error(function() l:acquire(bad) end)
      assert.has_error(function() l:try(bad) end)
    end
    assert.has_error(function() l:acquire("ok", { ttl = 0 }) end)
    assert.has_error(function() l:acquire("ok", { timeout = 0 / 0 }) end)
    assert.same({}, assert(l:list()))
  end)
end)

describe("#integration a blocking acquire of what its own client holds", function()
  local client, other, locks
  setup(function()
    client = helpers.connect({ appname = "locks-own" })
    other = helpers.connect({ appname = "locks-own-other" })
    locks = helpers.locks(client)
  end)
  teardown(function() client:close(); other:close() end)

  -- (bounds, not speeds: the default timeout is 10 s)
  local function timed(f, ...)
    local t0 = core.monotonic()
    local r = table.pack(f(...))
    return core.monotonic() - t0, table.unpack(r, 1, r.n)
  end

  it("returns nil, \"deadlock\", info at once, with or without renewal; the name stays held", function()
    for _, renew in ipairs({ false, true }) do
      local name = helpers.unique("own")
      local h = assert(locks:acquire(name, { renew = renew }))
      local took, h2, err, info = timed(locks.acquire, locks, name)
      assert.is_nil(h2)
      assert.equal("deadlock", err)
      assert.equal(h.owner, info.owner)
      assert.is_true(took < 5, took)
      took, h2, err = timed(locks.with, locks, name, { timeout = 8 }, function() return "ran" end)
      assert.is_nil(h2)
      assert.equal("deadlock", err)
      assert.is_true(took < 5, took)
      assert.is_true(h:held())
      -- one attempt still answers as before
      local a, e = locks:try(name)
      assert.is_nil(a)
      assert.equal("busy", e)
      a, e = locks:acquire(name, { timeout = 0 })
      assert.is_nil(a)
      assert.equal("timeout", e)
      assert(h:release())
      h2 = assert(locks:acquire(name, { timeout = 1 }))
      assert(h2:release())
    end
  end)

  it("waits when the holder is another client's, or when its own lease ends before the timeout", function()
    local name = helpers.unique("other")
    local h = assert(helpers.locks(other):acquire(name, { ttl = 1 }))
    local h2, err = locks:acquire(name, { timeout = 8 })
    assert.is_not_nil(h2, err)
    assert.is_not.equal(h.owner, h2.owner)
    assert(h2:release())
    -- its own, unrenewed, ending in 1 s: the wait takes it then
    name = helpers.unique("expiring")
    h = assert(locks:acquire(name, { ttl = 1 }))
    h2, err = locks:acquire(name, { timeout = 8 })
    assert.is_not_nil(h2, err)
    assert.is_not.equal(h.owner, h2.owner)
    assert(h2:release())
  end)

  it("a released or lost handle of its own is no obstacle", function()
    local name = helpers.unique("gone")
    local h = assert(locks:acquire(name))
    assert(locks:force_release(name))
    local h2 = assert(other:locks({ database = locks.database, collection = locks.collection })
      :acquire(name, { ttl = 1 }))
    local h3, err = locks:acquire(name, { timeout = 8 })
    assert.is_not_nil(h3, err)
    assert.is_nil(h:release())
    assert.is_not.equal(h2.owner, h3.owner)
    assert(h3:release())
  end)
end)
