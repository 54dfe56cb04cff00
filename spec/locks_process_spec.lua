-- #integration: locks across OS processes: contention, a holder killed with
-- SIGKILL, clients whose clocks are an hour off (faketime), and fork().
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

-- The child: connects, then follows its mode.
--   hold NAME TTL      acquire, print "held PID TOKEN", sleep until killed
--   loop NAME N FILE   N times: acquire, append "B pid token" / "E pid" to
--                      FILE around a short critical section, release
--   wait NAME TIMEOUT  try once (print "busy" or "free"), then acquire
--                      waiting up to TIMEOUT, print "held PID TOKEN"
local CHILD = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, mode, name, a, b = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "child" }))
local locks = c:locks({ database = db, collection = coll })
local function say(...)
  io.stdout:write(table.concat({ ... }, " "), "\n")
  io.stdout:flush()
end
if mode == "hold" then
  local h = assert(locks:acquire(name, { ttl = tonumber(a), timeout = 10 }))
  say("held", core.getpid(), string.format("%.0f", h.token))
  core.sleep(120)
elseif mode == "loop" then
  local f = assert(io.open(b, "a"))
  f:setvbuf("no")
  say("ready", core.getpid())
  for _ = 1, tonumber(a) do
    local h = assert(locks:acquire(name, { ttl = 10, timeout = 30 }))
    f:write(string.format("B %d %.0f\n", core.getpid(), h.token))
    core.sleep(0.002)
    f:write(string.format("E %d\n", core.getpid()))
    assert(h:release())
  end
  f:close()
  say("done")
elseif mode == "wait" then
  local h, err = locks:try(name)
  say(h and "free" or err)
  if not h then h = assert(locks:acquire(name, { timeout = tonumber(a) })) end
  say("held", core.getpid(), string.format("%.0f", h.token))
  assert(h:release())
end
]]

describe("#integration locks across processes", function()
  local client, locks, script
  setup(function()
    client = helpers.connect({ appname = "parent" })
    locks = helpers.locks(client)
    script = helpers.script(CHILD)
  end)
  teardown(function()
    client:close()
    os.remove(script)
  end)

  local function spawn(mode, name, a, b, prefix)
    return helpers.spawn(script, { locks.database, locks.collection, mode, name,
      tostring(a or ""), tostring(b or "") }, prefix)
  end

  it("two processes never hold the lock at the same time", function()
    local name = helpers.unique("contend")
    local log = os.tmpname()
    local n = 25
    local p1 = spawn("loop", name, n, log)
    local p2 = spawn("loop", name, n, log)
    for _, p in ipairs({ p1, p2 }) do
      local st, out = p:wait(60)
      assert.equal(0, st, out)
      p:cleanup()
    end
    local lines = {}
    for l in io.lines(log) do lines[#lines + 1] = l end
    os.remove(log)
    assert.equal(4 * n, #lines)
    local pids, last = {}, 0
    for i = 1, #lines, 2 do
      local bpid, token = lines[i]:match("^B (%d+) (%d+)$")
      local epid = lines[i + 1]:match("^E (%d+)$")
      assert.is_truthy(bpid, lines[i])
      assert.equal(bpid, epid)          -- nobody entered between B and E
      token = tonumber(token)
      assert.is_true(token > last)      -- tokens increase in the order of entry
      last = token
      pids[bpid] = (pids[bpid] or 0) + 1
    end
    local count = 0
    for _, k in pairs(pids) do
      assert.equal(n, k)
      count = count + 1
    end
    assert.equal(2, count)
  end)

  it("a holder killed with SIGKILL frees the lock when its lease ends", function()
    local name = helpers.unique("killed")
    local ttl = 1
    local p = spawn("hold", name, ttl)
    local pid = tonumber((assert(p:wait_for("held (%d+) %d+"))))
    local _, err, info = locks:try(name)
    assert.equal("busy", err)
    assert.equal(pid, info.holder.pid)
    local token = info.token
    p:kill("KILL", pid)
    assert.is_truthy(p:wait(10))
    p:cleanup()
    -- nobody releases it: the server's clock ends the lease after ttl, and
    -- the waiter's backoff never sleeps past the holder's known expiry
    local h = assert(locks:acquire(name, { timeout = ttl + 5 }))
    assert.is_true(h.token > token)
    local st = assert(locks:status(name))
    assert.equal(core.getpid(), st.holder.pid)
    -- on the server's clock: taken no earlier than the dead holder's lease
    -- end, and well before the TTL monitor's minute (the waiter's sleeps
    -- are capped by the holder's remaining time)
    local gap = st.acquired_at - info.expires_at
    assert.is_true(gap >= 0, "taken before the lease ended: " .. gap)
    assert.is_true(gap < 2, "taken " .. gap .. " s after the lease ended")
    assert.is_true(h:release())
  end)

  describe("with clocks an hour off (faketime)", function()
    local function have_faketime()
      local probe = helpers.script("print(os.time())")
      local out = helpers.run(probe, {}, "faketime -f '+1h' ")
      os.remove(probe)
      local t = tonumber(out:match("%d+"))
      return t and t - os.time() > 3500
    end

    it("a skewed holder still excludes others and loses the lease on time", function()
      assert.is_true(have_faketime(), "faketime does not shift the child's clock")
      for _, skew in ipairs({ "+1h", "-1h" }) do
        local name = helpers.unique("skew-holder")
        local p = spawn("hold", name, 1.5, nil, ("faketime -f '%s' "):format(skew))
        local pid = tonumber((assert(p:wait_for("held (%d+) %d+"))))
        local _, err, info = locks:try(name)
        assert.equal("busy", err, skew)
        assert.equal(pid, info.holder.pid)
        -- the lease is 1.5 s by the server's clock, not an hour more or less
        assert.is_true(info.remaining > 0 and info.remaining <= 1.5, tostring(info.remaining))
        p:kill("KILL", pid)
        p:wait(10)
        p:cleanup()
        local h = assert(locks:acquire(name, { timeout = 6 }))
        local gap = assert(locks:status(name)).acquired_at - info.expires_at
        assert.is_true(gap >= 0 and gap < 2, skew .. ": taken " .. gap .. " s after the lease ended")
        assert.is_true(h:release())
      end
    end)

    it("a skewed waiter neither steals a held lock nor waits an hour", function()
      for _, skew in ipairs({ "+1h", "-1h" }) do
        local name = helpers.unique("skew-waiter")
        local h = assert(locks:acquire(name, { ttl = 1 }))
        local p = spawn("wait", name, 10, nil, ("faketime -f '%s' "):format(skew))
        assert.equal("busy", (p:wait_for("^(%a+)\n")))
        -- it gets the lock once our lease ends (we never release it)
        assert.is_truthy(p:wait_for("held %d+ %d+"))
        local st, out = p:wait(10)
        assert.equal(0, st, out)
        p:cleanup()
        assert.same({ nil, "lost" }, { h:release() })
      end
    end)
  end)

  it("the fork specs' waitpid kills and reports a child that outlives its timeout", function()
    local pid = assert(testing.fork())
    if pid == 0 then
      core.sleep(30)
      testing.exit(0)
    end
    local started = core.monotonic()
    assert.same({ nil, "timeout" }, { testing.waitpid(pid, 0.2) })
    assert.is_true(core.monotonic() - started < 10)
    local alive = os.execute("kill -0 " .. pid .. " 2>/dev/null")
    assert.is_false(alive == true or alive == 0)   -- Lua 5.4 answers true, LuaJIT 0
  end)

  -- libmongoc (1.20+) takes one process-wide lock for a moment in every
  -- command and server check; a fork() in that moment leaves it held in
  -- the child by a thread the child does not have (README, Limitations).
  -- The child's first driver call then raises at once instead of waiting
  -- for it for ever.  testing.driver_lock holds it across the fork
  it("a child forked while libmongoc's lock was held (fork) gets an error, not a hang", function()
    local ok, why = testing.driver_lock(true)
    if not ok then
      pending(why)
      return
    end
    local pid = assert(testing.fork())
    if pid == 0 then
      local code = 1
      pcall(function()
        local pok, err = pcall(locks.status, locks, "x")
        if pok then code = 10 return end
        if not tostring(err):find("libmongoc's lock was held when this process forked", 1, true) then
          io.stderr:write(tostring(err), "\n")
          code = 11
          return
        end
        -- and again: every call says so, none waits
        pok, err = pcall(locks.try, locks, "x")
        if pok or not tostring(err):find("forked", 1, true) then code = 12 return end
        -- a new client, and a pool of worker threads, answer nil and why
        local c3, cerr = require("mongolock").connect(helpers.uri())
        if c3 or not tostring(cerr):find("forked", 1, true) then code = 13 return end
        local p3, perr = require("mongolock.core").pool(client._core, 1)
        if p3 or not tostring(perr):find("forked", 1, true) then code = 14 return end
        code = 0
      end)
      testing.exit(code)
    end
    assert(testing.driver_lock(false))
    assert.equal(0, testing.waitpid(pid, 30))
    -- the parent goes on
    local _, err = locks:status("x")
    assert.is_nil(err)
  end)

  -- each lease has a mutex that the client's threads (renewal, the change
  -- stream) take for a moment; a fork() in that moment leaves the child's
  -- copy held by a thread the child does not have.  The child's copy of the
  -- handle answers, and is collected, without waiting for it
  it("a child forked while its parent's thread held a lease's mutex (fork) uses and drops the handle", function()
    local name = helpers.unique("fork-mu")
    local holder = { h = assert(locks:acquire(name, { ttl = 30 })) }
    assert(testing.lease_lock(holder.h, true))
    local pid = assert(testing.fork())
    if pid == 0 then
      local ok, code = pcall(function()
        if holder.h:held() then return 10 end
        if holder.h:lost() then return 11 end
        if select(2, holder.h:remaining()) ~= "not held" then return 12 end
        if select(2, holder.h:release()) ~= "not held" then return 13 end
        if holder.h.name ~= name or holder.h.ttl ~= 30 then return 14 end
        if not holder.h:close() then return 15 end
        holder.h = nil
        collectgarbage()
        collectgarbage()
        return 0
      end)
      helpers.child_exit(client, ok, code)
    end
    assert(testing.lease_lock(holder.h, false))
    local st, err = helpers.wait_child(pid, 20, pending, function() holder.h:release() end)
    assert.equal(0, st, err)
    assert.is_true(holder.h:held())
    assert.is_true(holder.h:release())
  end)

  -- the core's global locks that its threads take for a moment (the
  -- process tag's, the kept fiber stacks', the bridged connections' and
  -- the cursor sessions' lists) are made anew in a forked child: each path
  -- that takes one works there though the parent held them all at the fork
  it("a child forked while its parent held the core's global locks (fork) takes each of them", function()
    local parent_tag = core.process_tag()
    local name = helpers.unique("fork-globals")
    assert(testing.globals_lock(true))
    local pid = assert(testing.fork())
    if pid == 0 then
      local ok, code = pcall(function()
        -- the process tag's: drawn again in the child
        local tag = core.process_tag()
        if type(tag) ~= "string" or tag == parent_tag then return 10 end
        -- (and a lock cycle, whose attempt carries the tag and host name)
        local h = locks:try(name)
        if not h or not h:release() then return 11 end
        -- the kept fiber stacks': an op run here, in the loop's thread
        -- (a build without fibers, AddressSanitizer's, runs none; the
        -- fibers' own pool answers false until its monitor found the server)
        local pool = core.pool(client._core, 1)
        local op = core.op_status{ db = helpers.database, coll = "fork_globals", name = "x" }
        local here, until_t = false, core.monotonic() + 10
        while core.fibers and not here do
          here = pool:here(op)
          if not here and core.monotonic() > until_t then return 12 end
          if not here then core.sleep(0.01) end
        end
        if here then
          local reply, fd
          repeat
            reply, fd = here:step()
            if reply == false and fd then core.sleep(0.001) end
          until reply ~= false or not fd
          if type(reply) ~= "string" then return 13 end
        end
        pool:close()
        -- the bridged connections' list
        local bridged = core.pool(client._core, 0, "bridged")
        if bridged:dead() ~= nil then return 14 end
        bridged:close()
        -- the cursor sessions' list: a session's end, answered in C
        local r = client._core:command("admin", { endSessions = {} }, nil, ("a"):rep(32))
        if not r then return 15 end
        return 0
      end)
      helpers.child_exit(client, ok, code)
    end
    assert(testing.globals_lock(false))
    local st, err = helpers.wait_child(pid, 20, pending)
    assert.equal(0, st, err)
  end)

  -- a client's counters and lease events have a mutex that its threads
  -- take for a moment (a release counted, a loss queued): a child made
  -- while one held it counts, reads and queues there all the same; the
  -- events queued before the fork were the parent's, and stay with it
  it("a child forked while its parent's thread held a client's counters (fork) counts and reads them", function()
    local cc = client._core
    cc:want_events(true)
    local name = helpers.unique("fork-counters")
    local h = assert(locks:acquire(name, { ttl = 30 }))
    assert(locks:force_release(name))
    local _, lerr = h:extend()
    assert.equal("lost", lerr)
    assert.is_true(cc:has_events())            -- the parent's loss, queued
    assert(testing.counters_lock(client._core, true))
    local pid = assert(testing.fork())
    if pid == 0 then
      local ok, code = pcall(function()
        if cc:has_events() then return 10 end
        if type(cc:counters()) ~= "table" then return 11 end
        -- a release of a new collection: its place is linked (the
        -- client's and the process's)
        local other = client:locks({ database = helpers.database, collection = helpers.unique("fork_counters") })
        local h2 = other:try(name)
        if not h2 or not h2:release() then return 12 end
        -- a loss of the child's own, queued and taken
        local h3 = other:try(name)
        if not h3 or not other:force_release(name) then return 13 end
        if select(2, h3:extend()) ~= "lost" then return 14 end
        local events = cc:take_events()
        if #events ~= 1 or events[1].name ~= name then return 15 end
        return 0
      end)
      helpers.child_exit(client, ok, code)
    end
    assert(testing.counters_lock(client._core, false))
    local st, err = helpers.wait_child(pid, 20, pending)
    assert.equal(0, st, err)
    assert.equal(1, #cc:take_events())
    cc:want_events(false)
  end)

  it("a client made before fork() works in the child, which never releases the parent's lock", function()
    local name = helpers.unique("fork")
    local h = assert(locks:acquire(name, { ttl = 30 }))
    assert(locks:status(name))          -- the pool is in use before fork
    local holder = { h = h }
    local pid = assert(testing.fork())
    if pid == 0 then
      -- the child: report by exit status only, never through busted
      local ok, code = pcall(function()
        local r, err = holder.h:release()
        if r ~= nil or err ~= "not held" then return 10 end
        if holder.h:held() then return 11 end
        if select(2, holder.h:extend()) ~= "not held" then return 12 end
        local h2 = locks:try(helpers.unique("fork-child"))
        if not h2 then return 13 end
        if not h2:release() then return 14 end
        local st = locks:status(name)
        if not (st and st.held and st.owner == holder.h.owner) then return 15 end
        -- the child's copy of the handle is collected: nothing is released
        holder.h = nil
        collectgarbage()
        collectgarbage()
        if not locks:status(name).held then return 16 end
        return 0
      end)
      helpers.child_exit(client, ok, code)
    end
    assert.equal(0, helpers.wait_child(pid, 60, pending, function() holder.h:release() end))
    local st = assert(locks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    assert.is_true(h:release())
  end)
end)
