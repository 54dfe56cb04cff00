-- Change-stream wake-ups (csrc/binding/watch.c, lua/mongolock/wait.lua).
--
-- Waking is proved by counting: how many times the acquire loop had to
-- wait (a poller wakes again and again; a watcher once per release) and
-- how many commands the server saw (serverStatus opcounters), never by
-- timing.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local locks_mod = require "mongolock.locks"
local wait = require "mongolock.wait"

-- A holder in its own OS process: acquires NAME in DB.COLL, prints
-- "held <token>", waits until the file TRIGGER exists, sleeps DELAY
-- seconds, releases and prints "released".
local HOLDER = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local name, db, coll, trigger, delay = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "watch-holder" }))
local locks = c:locks({ database = db, collection = coll, ttl = 60 })
local h = assert(locks:acquire(name))
io.stdout:write("held ", tostring(h.token), "\n"); io.stdout:flush()
local deadline = core.monotonic() + 30
while core.monotonic() < deadline do
  local f = io.open(trigger, "rb")
  if f then f:close() break end
  core.sleep(0.005)
end
core.sleep(tonumber(delay))
io.stdout:write("released ", tostring(h:release()), "\n"); io.stdout:flush()
c:close()
]]

describe("#integration change-stream waits", function()
  local client, holder_path

  -- A wait step that counts how often acquire waited and, on the first
  -- wait (the lock was found busy), creates the trigger file.
  local function counting_wait(trigger)
    local real = locks_mod.get_wait()
    local w = { calls = 0 }
    function w.sleep_until_retry(state)
      w.calls = w.calls + 1
      if w.calls == 1 and trigger then
        local f = assert(io.open(trigger, "wb"))
        f:close()
      end
      return real.sleep_until_retry(state)
    end
    w.check_mode = real.check_mode
    locks_mod.set_wait(w)
    return w, function() locks_mod.set_wait(real) end
  end

  local function with_wait(trigger, fn)
    local w, restore = counting_wait(trigger)
    local ok, err = pcall(fn, w)
    restore()
    if not ok then error(err, 0) end
    return w
  end

  local function trigger_path()
    local p = os.tmpname()
    os.remove(p)
    return p
  end

  -- a process holding name in locks that releases it hold seconds after
  -- the trigger file appears (with_wait makes it at the first wait)
  local function spawn_holder(locks, name, hold)
    local trigger = trigger_path()
    local p = helpers.spawn(holder_path, { name, locks.database, locks.collection, trigger, hold })
    assert(p:wait_for("held (%d+)"))
    p.trigger = trigger
    return p, trigger
  end

  -- waits for a holder to exit and removes its files: its exit and output
  local function reap(p)
    local ok, out = p:wait()
    p:cleanup()
    os.remove(p.trigger)
    return ok, out
  end

  setup(function()
    client = helpers.connect({ appname = "watch-spec" },
      helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    holder_path = helpers.script(HOLDER)
  end)
  teardown(function()
    client:close()
    os.remove(holder_path)
  end)

  it("a release wakes a watching waiter without polling", function()
    local locks = helpers.locks(client, { ttl = 60 })
    local p, trigger = spawn_holder(locks, "job", "0.3")
    local h, err, before, after
    local w = with_wait(trigger, function()
      before = helpers.opcounters(client)
      h, err = locks:acquire("job", { timeout = 20, wait = "watch" })
      after = helpers.opcounters(client)
    end)
    assert.is_truthy(h, err)
    assert.matches("released true", (select(2, reap(p))))
    -- waited once: the release woke it (a poller needs several steps to
    -- cover 0.3 s: 1 + 2 + 4 + ... ms)
    assert.equal(1, w.calls)
    -- the server saw two findAndModify, the stream's aggregate and one or
    -- two getMore (each waits up to a second), and around them the
    -- holder's release and end of session, the stream connection's
    -- handshake and serverStatus: a dozen at most, however long the hold
    local getmores = after.getmore - before.getmore
    assert.is_true(getmores >= 1 and getmores <= 3, "getMore: " .. getmores)
    -- the server's counts are every client's: a stream or a client of an
    -- earlier spec in this process that ends meanwhile (its killCursors
    -- and endSessions; a stream ends 10 s after its last waiter) is not
    -- this wait's
    local n = after.total - before.total - (helpers.ended(after) - helpers.ended(before))
    assert.is_true(n <= 12, "commands: " .. n)
    assert.is_true(h:release())
  end)

  it("the same wait polls with wait = 'poll'", function()
    -- the control for the test above: same holder, same hold time
    local locks = helpers.locks(client, { ttl = 60 })
    local p, trigger = spawn_holder(locks, "job", "0.3")
    local h, err
    local w = with_wait(trigger, function()
      h, err = locks:acquire("job", { timeout = 20, wait = "poll" })
    end)
    assert.is_truthy(h, err)
    assert.is_true(w.calls > 3, "waits: " .. w.calls)
    assert.is_true(h:release())
    reap(p)
  end)

  it("a release between the failed attempt and the wait is not missed", function()
    -- the holder releases as soon as the waiter has failed once, before or
    -- while the stream opens: the stream starts at that attempt's time
    local c2 = helpers.connect({ appname = "watch-race" })
    local locks = helpers.locks(c2, { ttl = 60 })
    local p, trigger = spawn_holder(locks, "race", "0")
    local h, err
    local w = with_wait(trigger, function()
      h, err = locks:acquire("race", { timeout = 20, wait = "watch" })
    end)
    assert.is_truthy(h, err)
    assert.equal(1, w.calls)
    assert.is_true(h:release())
    reap(p)
    c2:close()
  end)

  it("the holder's expiry wakes a waiter (no event marks it)", function()
    local locks = helpers.locks(client)
    local other = helpers.connect({ appname = "watch-expiring" })
    local ol = other:locks({ database = locks.database, collection = locks.collection })
    local h1 = assert(ol:acquire("exp", { ttl = 1 }))
    local h2, err
    local w = with_wait(nil, function()
      h2, err = locks:acquire("exp", { timeout = 10, wait = "watch" })
    end)
    assert.is_truthy(h2, err)
    assert.is_true(h2.token > h1.token)
    -- one wait until the lease's end as the server reported it (a second
    -- only if the server still saw it held at that instant); polling takes
    -- about ten steps to cover a second
    assert.is_true(w.calls <= 2, "waits: " .. w.calls)
    assert.same({ nil, "lost" }, { h1:release() })
    assert.is_true(h2:release())
    other:close()
  end)

  it("one stream per process and collection serves every waiter", function()
    local c2 = helpers.connect({ appname = "watch-one-stream" })
    local locks = helpers.locks(c2, { ttl = 60 })
    for _, name in ipairs({ "a", "b", "c" }) do
      local p, trigger = spawn_holder(locks, name, "0.05")
      local h, err
      local w = with_wait(trigger, function()
        h, err = locks:acquire(name, { timeout = 20, wait = "watch" })
      end)
      assert.is_truthy(h, err)
      assert.equal(1, w.calls)
      assert.is_true(h:release())
      reap(p)
    end
    local st = testing.watch_stats(c2._core)
    assert.equal(1, st.streams)
    -- the holders' releases (and ours, which may still be on their way)
    assert.is_true(st.events >= 3)
    c2:close()
    -- close stops the stream's thread
    local fresh = helpers.connect()
    assert.equal(0, testing.watch_stats(fresh._core).streams)
    fresh:close()
  end)

  it("inside OpenResty looks at the stream between ngx.sleep steps", function()
    -- an ngx stand-in: a content phase whose sleep is recorded
    local slept = 0
    local fake = { get_phase = function() return "content" end,
      sleep = function(s) slept = slept + 1; core.sleep(s) end }
    local locks = helpers.locks(client, { ttl = 60 })
    local p, trigger = spawn_holder(locks, "ngx", "0.2")
    local h, err
    rawset(_G, "ngx", fake)
    local ok, perr = pcall(with_wait, trigger, function(w)
      h, err = locks:acquire("ngx", { timeout = 20, wait = "watch" })
      assert.equal(1, w.calls)
    end)
    rawset(_G, "ngx", nil)
    assert(ok, perr)
    assert.is_truthy(h, err)
    -- it yielded (slept cooperatively) instead of blocking in C; steps
    -- grow to 20 ms, so 0.2 s takes more than one and fewer than 200
    assert.is_true(slept > 1 and slept < 200, "ngx.sleep calls: " .. slept)
    assert.is_true(h:release())
    reap(p)
  end)

  it("close does not wait for the stream's getMore in flight", function()
    -- a non-blocking waiter (OpenResty's) keeps the stream's thread
    -- reading for half a second after its last look: right after the
    -- release's event, its next getMore is in flight, awaiting up to half
    -- the socket timeout (2.5 s with the default server_timeout)
    local c2 = helpers.connect({ appname = "watch-close" })
    local locks = helpers.locks(c2, { ttl = 60 })
    local fake = { get_phase = function() return "content" end,
      sleep = function(s) core.sleep(s) end }
    local p, trigger = spawn_holder(locks, "close", "0.05")
    local h, err
    rawset(_G, "ngx", fake)
    local ok, perr = pcall(with_wait, trigger, function()
      h, err = locks:acquire("close", { timeout = 20, wait = "watch" })
    end)
    rawset(_G, "ngx", nil)
    assert(ok, perr)
    assert.is_truthy(h, err)
    assert.is_true(h:release())
    reap(p)
    core.sleep(0.1)
    assert.equal(1, testing.watch_stats(c2._core).streams)
    local t0 = core.monotonic()
    c2:close()
    local took = core.monotonic() - t0
    -- joining the thread would take the rest of the await (over 2 s)
    assert.is_true(took < 1.5, string.format("close: %.2f s", took))
  end)

  it("after fork the child watches with its own stream, the parent keeps its own", function()
    local c2 = helpers.connect({ appname = "watch-fork" })
    local locks = helpers.locks(c2, { ttl = 60 })
    local function handoff(name)
      local p, trigger = spawn_holder(locks, name, "0.05")
      local h, err
      local w = with_wait(trigger, function()
        h, err = locks:acquire(name, { timeout = 20, wait = "watch" })
      end)
      reap(p)
      return h, err, w.calls
    end
    local h, err, calls = handoff("before")
    assert.is_truthy(h, err)
    assert.equal(1, calls)
    assert.is_true(h:release())
    assert.equal(1, testing.watch_stats(c2._core).streams)
    local pid = assert(testing.fork())
    if pid == 0 then
      local code = 1
      pcall(function()
        -- the parent's stream is not this process's
        if testing.watch_stats(c2._core).streams ~= 0 then code = 10 return end
        local hc, _, n = handoff("child")
        if not hc then code = 11 return end
        if n ~= 1 then code = 12 return end
        if not hc:release() then code = 13 return end
        code = 0
      end)
      helpers.child_exit(c2, true, code)
    end
    assert.equal(0, helpers.wait_child(pid, 60, pending, function() c2:close() end))
    h, err, calls = handoff("after")
    assert.is_truthy(h, err)
    assert.equal(1, calls)
    assert.is_true(h:release())
    c2:close()
  end)

  describe("a stream killed by failCommand closeConnection", function()
    local function failpoint(c, spec)
      local ok, err = testing.failpoint(c._core, spec)
      if not ok then error("configureFailPoint: " .. tostring(err)) end
    end

    it("is resumed: the waiter still wakes on the release", function()
      local c2 = helpers.connect({ appname = "watch-resume" },
        helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
      -- one hand-off on a fresh collection (so a fresh stream); returns the
      -- commands the server counted meanwhile
      local function handoff(fp)
        local locks = helpers.locks(c2, { ttl = 60 })
        local p, trigger = spawn_holder(locks, "r", "0.3")
        local before = helpers.opcounters(c2)
        failpoint(c2, fp)
        local h, err, calls
        local ok, perr = pcall(function()
          calls = with_wait(trigger, function()
            h, err = locks:acquire("r", { timeout = 20, wait = "watch" })
          end).calls
        end)
        failpoint(c2, { mode = "off" })
        local after = helpers.opcounters(c2)
        assert(ok, perr)
        -- wait = "watch" never polls: it woke through the stream
        assert.is_truthy(h, err)
        assert.equal(1, calls)
        assert.is_true(h:release())
        reap(p)
        return after.command - before.command
      end
      -- the same hand-off with a fail point that matches nothing, then with
      -- the stream's first getMore killed: the driver reconnects and
      -- resumes (a handshake and a second aggregate more)
      local plain = handoff({ times = 1, commands = { "getMore" }, close_connection = true,
        app_name = "no-such-app" })
      local killed = handoff({ times = 1, commands = { "getMore" }, close_connection = true,
        app_name = "watch-resume" })
      assert.is_true(killed > plain, ("commands: %d killed, %d plain"):format(killed, plain))
      c2:close()
    end)

    it("that cannot be resumed: auto falls back to polling, watch reports it", function()
      local c2 = helpers.connect({ appname = "watch-dead" })
      local locks = helpers.locks(c2, { ttl = 60 })
      local p, trigger = spawn_holder(locks, "d", "0.3")
      failpoint(c2, { mode = "alwaysOn", commands = { "getMore", "aggregate" },
        close_connection = true, app_name = "watch-dead" })
      local h, err
      local ok, perr = pcall(with_wait, trigger, function()
        h, err = locks:acquire("d", { timeout = 20, wait = "auto" })
      end)
      local st = testing.watch_stats(c2._core)
      local r2, err2, released
      if ok and h then
        -- the stream is known to be broken: watch mode tries again until
        -- its timeout (a closed connection is transient), then says so.
        -- Another client holds "d" then: a blocking wait for what its own
        -- client holds answers "deadlock" at once.
        local c3 = helpers.connect({ appname = "watch-dead-holder" })
        local theirs = c3:locks({ database = locks.database, collection = locks.collection })
        ok, perr = pcall(function()
          released = h:release()
          local h3 = assert(theirs:acquire("d", { timeout = 5 }))
          r2, err2 = locks:acquire("d", { timeout = 1, wait = "watch" })
          h3:release()
        end)
        c3:close()
      end
      failpoint(c2, { mode = "off" })
      assert(ok, perr)
      assert.is_truthy(h, err)
      assert.equal(1, st.failed)
      assert.equal(0, st.streams)
      assert.is_nil(r2)
      assert.matches("change stream", err2)
      assert.is_true(released)
      reap(p)
      c2:close()
    end)
  end)

  it("bad wait options raise at the caller", function()
    assert.has_error(function() client:locks({ wait = "sometimes" }) end,
      [[bad argument #1 to 'locks' (wait must be "auto", "watch" or "poll", got "sometimes")]])
    local locks = helpers.locks(client)
    assert.has_error(function() locks:acquire("x", { wait = 1 }) end,
      [[bad argument #2 to 'acquire' (wait must be "auto", "watch" or "poll", got number)]])
  end)
end)

describe("#unit wait strategy", function()
  local backoff = require "mongolock.backoff"

  local function with_backoff_spy(fn)
    local real = backoff.sleep_until_retry
    local calls = 0
    backoff.sleep_until_retry = function() calls = calls + 1 end
    local ok, err = pcall(fn)
    backoff.sleep_until_retry = real
    if not ok then error(err, 0) end
    return calls
  end

  local function state(mode, info)
    return { name = "x", attempt = 1, deadline = core.monotonic() + 5,
      opts = { wait = mode }, info = info }
  end

  it("polls with wait = 'poll', and with 'auto' when the server sent no operation time", function()
    local n = with_backoff_spy(function()
      assert.is_true(wait.sleep_until_retry(state("poll", { operation_time = { t = 1, i = 1 } })))
      assert.is_true(wait.sleep_until_retry(state("auto", { remaining = 1 })))
      assert.is_true(wait.sleep_until_retry(state(nil, {})))
    end)
    assert.equal(3, n)
  end)

  it("wait = 'watch' without an operation time is an error, not a poll", function()
    local r, err
    local n = with_backoff_spy(function()
      r, err = wait.sleep_until_retry(state("watch", { remaining = 1 }))
    end)
    assert.equal(0, n)
    assert.is_nil(r)
    assert.matches("replica set", err)
  end)

  it("check_mode accepts the three strategies and nil", function()
    assert.equal("auto", wait.check_mode("auto", 1, "f"))
    assert.equal("watch", wait.check_mode("watch", 1, "f"))
    assert.equal("poll", wait.check_mode("poll", 1, "f"))
    assert.is_nil(wait.check_mode(nil, 1, "f"))
    assert.has_error(function() wait.check_mode("fast", 2, "f") end)
    assert.has_error(function() wait.check_mode(true, 2, "f") end)
  end)
end)
