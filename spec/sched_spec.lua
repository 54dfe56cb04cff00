-- #integration: waiting inside coroutine schedulers (mongolock.connect(uri,
-- { scheduler = S })): inside a coroutine of the loop every wait and every
-- round trip yields to it, so the loop's other coroutines (a ticker here)
-- keep running; outside one the same client blocks as before.  Run once per
-- adapter: cqueues and luv (mongolock.sched.luv), both built in.
local helpers = require "helpers"
local mongolock = require "mongolock"
local core = require "mongolock.core"

-- the failCommand fail point on ping: mode (e.g. {times = 1}, "off"), the
-- server closing the connection of appName app's ping
local function close_ping(observer, mode, app)
  assert(observer._core:command("admin", { configureFailPoint = "failCommand" }, { mode = mode,
    data = { failCommands = { "ping" }, closeConnection = true, appName = app } }))
end

-- the shipped luv adapter (mongolock.sched.luv), its coroutines' errors
-- collected instead of raised
local function luv_loop()
  local S = require "mongolock.sched.luv"
  local errors = {}
  S.on_error = function(message) errors[#errors + 1] = message end
  return { spawn = S.spawn, run = S.run, errors = errors }
end

-- the cqueues loop, with the same spawn/run shape as the luv one
local function cqueues_loop()
  local cqueues = require "cqueues"
  local cq = cqueues.new()
  local S = { errors = {} }
  function S.spawn(fn) cq:wrap(fn) end
  function S.run()
    local ok, err = cq:loop()
    if not ok then S.errors[#S.errors + 1] = tostring(err) end
  end
  return S
end

local adapters = {
  { name = "cqueues", loop = cqueues_loop, scheduler = function() return "cqueues" end },
  { name = "luv", loop = luv_loop, scheduler = function() return "luv" end },
}

for _, a in ipairs(adapters) do
  describe("#integration a " .. a.name .. " scheduler", function()
    local loop, client, docs, coll
    setup(function()
      loop = a.loop()
      client = helpers.connect({ scheduler = a.scheduler(loop) })
      coll = helpers.unique("players")
      docs = client:documents(helpers.database, coll, { ttl = 10 })
    end)
    teardown(function() client:close() end)

    local function count_of(id)
      local r = assert(client:command(helpers.database, { find = coll }, { filter = { _id = id } }))
      return r.cursor.firstBatch[1].count
    end

    it("50 coroutines, 3 player documents, 5 guarded increments each: all 250 land while a 10 ms "
       .. "ticker is never held up 100 ms", function()
      -- one round on fresh player documents: every increment must land in
      -- every round; the ticker's bound must hold in one of three rounds
      -- (this machine is shared: a loop held up by the library's waits or
      -- round trips misses it in every round, a load spike in one)
      local N, EACH = 50, 5
      local function round(r)
        local players = { "p1-" .. r, "p2-" .. r, "p3-" .. r }
        for _, id in ipairs(players) do
          assert(client:command(helpers.database, { insert = coll },
            { documents = { { _id = id, count = 0 } } }))
        end
        local done, failures, worst, ticks = 0, {}, 0, 0
        -- measured from now: a loop may start its coroutines in any order
        local last = core.monotonic()
        loop.spawn(function()
          repeat
            mongolock.sleep(0.01)
            local now = core.monotonic()
            worst = math.max(worst, now - last)
            last = now
            ticks = ticks + 1
          until done >= N
        end)
        for i = 1, N do
          loop.spawn(function()
            for k = 1, EACH do
              local id = players[(i + k) % 3 + 1]
              local doc, h = docs:lock(id, { timeout = 60 })
              if not doc then
                failures[#failures + 1] = tostring(h)
              else
                -- holding the lock, this coroutine yields: the others run
                mongolock.sleep(0.001)
                local ok, err = h:release({ count = doc.count + 1 })
                if not ok then failures[#failures + 1] = tostring(err) end
              end
            end
            done = done + 1
          end)
        end
        loop.run()
        assert.same({}, loop.errors)
        assert.same({}, failures)
        assert.equal(N, done)
        assert.equal(N * EACH, count_of(players[1]) + count_of(players[2]) + count_of(players[3]))
        assert.is_true(ticks > 0)
        return worst
      end
      local worsts = {}
      for r = 1, 3 do
        worsts[r] = round(r)
        if worsts[r] < 0.1 then break end
      end
      assert.is_true(worsts[#worsts] < 0.1, "the ticker was held up (s): " .. table.concat(worsts, ", "))
    end)

    it("yields in every kind's wait: a coroutine waiting for a held named lock lets the loop run",
       function()
      local locks = helpers.locks(client)
      local name = helpers.unique("held")
      local holder = assert(locks:acquire(name, { ttl = 10 }))   -- outside: blocks as before
      local got, ticks, err
      loop.spawn(function()
        local h
        h, err = locks:acquire(name, { timeout = 5 })
        got = h and h:token_string()
        if h then assert(h:release()) end
      end)
      loop.spawn(function()
        -- release after 0.3 s of ticking: the waiter is queued meanwhile
        for _ = 1, 30 do
          mongolock.sleep(0.01)
          ticks = (ticks or 0) + 1
        end
        assert(holder:release())
      end)
      loop.run()
      assert.same({}, loop.errors)
      assert.is_string(got, tostring(err))
      assert.equal(30, ticks)
    end)

    it("an election's campaign and observer yield to the loop: the second campaigner leads after a resign",
       function()
      local el = client:elections({ ttl = 10 })
      local name = helpers.unique("elect")
      local first = assert(el:campaign(name, "a"))     -- outside: blocks as before
      local second, seen, ticks, err = nil, {}, 0, nil
      loop.spawn(function()
        local l
        l, err = el:campaign(name, "b", { timeout = 5 })
        second = l and l.value
        if l then assert(l:resign()) end
      end)
      loop.spawn(function()
        local it = el:observe(name, { timeout = 3 })
        repeat
          local c = it()
          if c then seen[#seen + 1] = tostring(c.value) end
        until not c or seen[#seen] == "b"
        it:close()
      end)
      loop.spawn(function()
        -- resign after 0.3 s of ticking: the campaign and the observer wait meanwhile
        for _ = 1, 30 do
          mongolock.sleep(0.01)
          ticks = ticks + 1
        end
        assert(first:resign())
      end)
      loop.run()
      assert.same({}, loop.errors)
      assert.equal("b", second, tostring(err))
      assert.equal(30, ticks)
      -- the first leader, maybe nobody for a moment, then the second
      assert.equal("a", seen[1])
      assert.equal("b", seen[#seen])
    end)

    it("a fenced write delayed on the way past a takeover is refused, and nothing of it lands", function()
      local app = helpers.unique("fence")
      local slow = helpers.connect({ scheduler = a.scheduler(loop), appname = app })
      local other = helpers.connect()
      local o = { database = helpers.database, collection = helpers.unique("fl") }
      local name, fcoll = helpers.unique("k"), helpers.unique("fdocs")
      local result, token2
      loop.spawn(function()
        local h = assert(slow:locks(o):acquire(name))
        local f = h:fenced(fcoll)
        assert(f:update({ _id = "d" }, { ["$set"] = { by = "first" } }, { upsert = true }))
        -- its next write waits 0.8 s on the server before it runs
        assert(other:command("admin", { configureFailPoint = "failCommand" }, { mode = { times = 1 },
          data = { failCommands = mongolock.array({ "findAndModify", "update" }), blockConnection = true,
                   blockTimeMS = 800, appName = app } }))
        result = { f:update({ _id = "d" }, { ["$set"] = { by = "stale" }, ["$inc"] = { n = 1 } }) }
      end)
      loop.spawn(function()
        mongolock.sleep(0.3)          -- while the first coroutine's write waits on the server
        local ol = other:locks(o)
        assert(ol:force_release(name))
        local h2 = assert(ol:acquire(name))
        assert.equal(1, h2:fenced(fcoll):update({ _id = "d" }, { ["$set"] = { by = "next" } }))
        token2 = h2:token_string()
        assert(h2:release())
      end)
      loop.run()
      other:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })
      assert.same({}, loop.errors)
      assert.is_nil(result[1])
      assert.equal("fenced", result[2])
      assert.equal(token2, result[3].token_string)
      local r = assert(other:command(helpers.database, { find = fcoll }, { filter = { _id = "d" } }))
      local d = r.cursor.firstBatch[1]
      assert.equal("next", d.by)
      assert.is_nil(d.n)
      slow:close()
      other:close()
    end)

    it("every kind's round trips leave the loop running while the server takes 300 ms for each",
       function()
      -- the scheduler's client alone is delayed (its appname): a round trip
      -- made on the loop's thread would stop the ticker for 300 ms
      local app = helpers.unique("delayed")
      local slow = helpers.connect({ scheduler = a.scheduler(loop), appname = app })
      local observer = helpers.connect()
      local o = { database = helpers.database, collection = helpers.unique("kinds") }
      local rw, sem = slow:rwlocks(o), slow:semaphores({ database = o.database,
        collection = o.collection, permits = 2 })
      local lk = slow:locks(o)
      local vc = slow:versioned(helpers.database, helpers.unique("vc"))
      local pdocs = slow:documents(helpers.database, coll, { ttl = 10 })
      -- the TTL index first (its createIndexes is not delayed below)
      assert(lk:try("warm")):release()
      local steps = {
        { "rw:read + release", function() return assert(rw:read("r")):release() end },
        { "sem:acquire + release", function() return assert(sem:acquire("s")):release() end },
        { "locks:with", function() return lk:with("w", function() return true end) end },
        { "locks:status", function() return lk:status("w") ~= nil end },
        { "docs:lock + release", function()
          local doc, h = pdocs:lock("slowdoc", { insert = { count = 0 } })
          return doc and h:release({ count = doc.count + 1 })
        end },
        { "vc:insert", function() return vc:insert({ _id = "v", n = 1 }) end },
        { "client:command", function() return slow:command(helpers.database, { ping = 1 }) end },
      }
      assert(observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "alwaysOn",
        data = { failCommands = { "findAndModify", "update", "insert", "aggregate", "ping" },
                 blockConnection = true, blockTimeMS = 300, appName = app } }))
      local results, worst, finished = {}, 0, false
      local last = core.monotonic()
      loop.spawn(function()
        repeat
          mongolock.sleep(0.01)
          local now = core.monotonic()
          worst = math.max(worst, now - last)
          last = now
        until finished
      end)
      loop.spawn(function()
        for _, step in ipairs(steps) do
          local t0 = core.monotonic()
          local ok, r = pcall(step[2])
          results[#results + 1] = { step[1], ok and r and true or tostring(r), core.monotonic() - t0 }
        end
        finished = true
      end)
      loop.run()
      observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })
      slow:close()
      observer:close()
      assert.same({}, loop.errors)
      for _, r in ipairs(results) do
        assert.is_true(r[2], r[1] .. ": " .. tostring(r[2]))
        -- the delay was there (each step has at least one delayed command)
        assert.is_true(r[3] >= 0.25, r[1] .. " took " .. r[3] .. " s")
      end
      assert.equal(#steps, #results)
      -- below one delayed command: no round trip was made on the loop's
      -- thread (with them there, 3.3 s)
      assert.is_true(worst < 0.25, "the ticker was held up " .. worst .. " s")
    end)

    it("renewal and change-stream wake-ups go on while coroutines wait", function()
      local locks_mod = require "mongolock.locks"
      local locks = helpers.locks(client)
      local name = helpers.unique("renewed")
      -- counts the waits between attempts (a watcher waits once per release)
      local real = locks_mod.get_wait()
      local waits = 0
      locks_mod.set_wait({ check_mode = real.check_mode, sleep_until_retry = function(state)
        waits = waits + 1
        return real.sleep_until_retry(state)
      end })
      local held_after, early, got, elapsed, errs = nil, nil, nil, nil, {}
      loop.spawn(function()
        -- a lease of 1 s, renewed in the background while the loop runs
        local h = assert(locks:acquire(name, { ttl = 1, renew = true }))
        mongolock.sleep(2.5)
        held_after = h:check()
        assert(h:release())
      end)
      loop.spawn(function()
        mongolock.sleep(0.2)
        -- the lease would have ended after 1 s without its renewal
        local h, err = locks:acquire(name, { timeout = 1.5 })
        early = h and "acquired" or err
        if h then h:release() end
        -- then a watching waiter, queued for long (no refresh, no poll
        -- before the holder's release): only the stream brings it in
        local t0 = core.monotonic()
        h, err = locks:acquire(name, { timeout = 20, wait = "watch", queue_ttl = 60, ttl = 5 })
        elapsed = core.monotonic() - t0
        got = h ~= nil
        if not h then errs[#errs + 1] = tostring(err) else assert(h:release()) end
      end)
      local ok, err = pcall(loop.run)
      locks_mod.set_wait(real)
      assert(ok, err)
      assert.same({}, loop.errors)
      assert.same({}, errs)
      assert.is_true(held_after)
      assert.equal("timeout", early)
      assert.is_true(got)
      -- woken by the release (about 0.8 s after it queued), where a poll
      -- or a refresh would come 30 s later
      assert.is_true(elapsed < 10, "waited " .. elapsed .. " s")
      assert.is_true(waits <= 3, waits .. " waits")
    end)

    it("acquire_all of two players' documents, all or none, inside the loop", function()
      local a1, b1 = helpers.unique("pa"), helpers.unique("pb")
      assert(client:command(helpers.database, { insert = coll },
        { documents = { { _id = a1, count = 0 }, { _id = b1, count = 0 } } }))
      local set, err
      loop.spawn(function()
        set, err = client:acquire_all({ { docs, b1 }, { docs, a1 } }, { timeout = 5 })
        if set then assert(set:release()) end
      end)
      loop.run()
      assert.same({}, loop.errors)
      assert.is_table(set, tostring(err))
    end)

    it("a coroutine waits for a name its own client holds (another coroutine releases it); outside the "
       .. "loop the same wait answers \"deadlock\" at once", function()
      local locks = helpers.locks(client)
      local name = helpers.unique("own")
      local h = assert(locks:acquire(name))
      local got, err
      loop.spawn(function()
        got, err = locks:acquire(name, { timeout = 8 })
        if got then assert(got:release()) end
      end)
      loop.spawn(function()
        mongolock.sleep(0.05)
        assert(h:release())
      end)
      loop.run()
      assert.same({}, loop.errors)
      assert.is_not_nil(got, err)
      h = assert(locks:acquire(name))
      local t0 = core.monotonic()
      got, err = locks:acquire(name)
      assert.is_nil(got)
      assert.equal("deadlock", err)
      assert.is_true(core.monotonic() - t0 < 5)
      assert(h:release())
    end)

    it("round trips go on through an election (a step-down of 2 s) without holding up the loop", function()
      -- on fibers in the loop's thread (fiber_spec.lua), an op refused by a
      -- server that is no primary goes to a worker thread, whose server
      -- selection waits for the next primary off the loop
      local locks = helpers.locks(client)
      local worst, ok_n, errs, stepped = 0, 0, {}, nil
      local stop = false
      loop.spawn(function()
        local last = core.monotonic()
        while not stop do
          mongolock.sleep(0.01)
          local now = core.monotonic()
          if now - last > worst then worst = now - last end
          last = now
        end
      end)
      loop.spawn(function()
        local t_end = core.monotonic() + 4
        while core.monotonic() < t_end do
          local h, err = locks:try(helpers.unique("e"))
          if h then
            h:release()
            ok_n = ok_n + 1
          else
            errs[#errs + 1] = tostring(err)
          end
        end
        stop = true
      end)
      -- the election happened: the primary's electionId changed (a hello
      -- right after the step-down may itself wait for the next primary)
      local function election_id()
        local deadline = core.monotonic() + 15
        while true do
          local hello = assert(client:command("admin", { hello = 1 }))
          if hello.isWritablePrimary then return tostring(hello.electionId) end
          assert(core.monotonic() < deadline, "no primary again")
          mongolock.sleep(0.05)
        end
      end
      local before = election_id()
      loop.spawn(function()
        mongolock.sleep(1)
        stepped = assert(client:command("admin", { replSetStepDown = 2 }, { force = true })).ok
      end)
      loop.run()
      assert.same({}, loop.errors)
      assert.equal(1, stepped)
      assert.are_not.equal(before, election_id(), "the electionId stayed: no election happened")
      assert.same({}, errs)
      assert.truthy(ok_n > 0)
      -- a round trip waiting on the loop's thread for the next primary
      -- would hold it up for most of the step-down (2 s); below that, the
      -- gaps are the machine's (0.108 s once in CI, its two lanes busy)
      print(string.format("# %s, through an election: the ticker's worst gap %.3f s", a.name, worst))
      assert.truthy(worst < 0.25, string.format("the ticker was held up %.3f s", worst))
    end)

    it("a connection closed between round trips: the next ones wait on their new sockets, woken by "
       .. "them, also where a socket's number comes back", function()
      -- an adapter that kept something of a closed descriptor (cqueues'
      -- registration, luv's handle) and missed the new socket under the
      -- same number would sleep out each wait: LOOK_AGAIN, 30 s here
      local sched = require "mongolock.sched"
      local S = sched.check(a.scheduler(loop), 1, "spec")
      local wait_fd, wait_socket, look = S.wait_fd, S.wait_socket, sched.LOOK_AGAIN
      local fds = {}
      S.wait_fd = function(fd, s)
        fds[#fds + 1] = fd
        return wait_fd(fd, s)
      end
      if wait_socket then
        S.wait_socket = function(fd, s)
          fds[#fds + 1] = fd
          return wait_socket(fd, s)
        end
      end
      local app = helpers.unique("closed")
      local c2 = helpers.connect({ scheduler = a.scheduler(loop), appname = app })
      local observer = helpers.connect()
      local answers, n, before, elapsed = {}, 0, nil, nil
      sched.LOOK_AGAIN = 30
      loop.spawn(function()
        for _ = 1, 3 do assert(c2:command(helpers.database, { ping = 1 })) end
        before = #fds
        -- the server closes the connection of the next ping
        close_ping(observer, { times = 1 }, app)
        local t0 = core.monotonic()
        answers[1] = { c2:command(helpers.database, { ping = 1 }) }
        -- back on fibers once the pool's monitor finds the server again
        -- (at most half a second; until then in worker threads)
        while core.monotonic() - t0 < 1.5 do
          local r, err = c2:command(helpers.database, { ping = 1 })
          assert(r, err)
          n = n + 1
        end
        elapsed = core.monotonic() - t0
      end)
      local ok, err = pcall(loop.run)
      sched.LOOK_AGAIN, S.wait_fd, S.wait_socket = look, wait_fd, wait_socket
      close_ping(observer, "off")
      observer:close()
      c2:close()
      assert(ok, err)
      assert.same({}, loop.errors)
      assert.is_nil(answers[1][1], "the closed connection's ping failed")
      assert.truthy(#fds > before + 10, "round trips after the close ran on fibers again: "
        .. (#fds - before) .. " waits")
      assert.truthy(elapsed < 10, ("a wait slept out (%.1f s for %d pings)"):format(elapsed, n))
    end)

    -- both adapters keep a socket watched between round trips (cqueues
    -- registered until the coroutine yields without polling it again,
    -- luv's handle started): round trips back to back then cost no
    -- epoll_ctl.  A descriptor closed while cqueues has it registered
    -- breaks the coroutine's next yield ("unable to update event
    -- disposition"), and a new socket under its number is never watched
    -- (a build without fibers, AddressSanitizer's, watches no connection's
    -- socket: every op goes to a worker thread)
    local on_fibers = core.fibers and it or pending
    on_fibers("round trips back to back keep their socket watched; a dead connection's socket is forgotten "
       .. "before it closes, the others at the client's close (also after an op in the same resume)",
       function()
      local sched = require "mongolock.sched"
      local S = sched.check(a.scheduler(loop), 1, "spec")
      assert.is_function(S.wait_socket)
      assert.is_function(S.forget)
      local wait_socket, forget, look = S.wait_socket, S.forget, sched.LOOK_AGAIN
      local waits, forgot = {}, {}
      -- a descriptor still open: /proc names a socket (opening it fails
      -- with ENXIO), a closed one is not there (ENOENT)
      local function open_fd(fd)
        local _, err = io.open("/proc/self/fd/" .. fd)
        return not tostring(err):find("No such file", 1, true)
      end
      S.wait_socket = function(fd, s)
        waits[#waits + 1] = fd
        return wait_socket(fd, s)
      end
      S.forget = function(fd)
        forgot[#forgot + 1] = { fd = fd, open = open_fd(fd) }
        return forget(fd)
      end
      local app = helpers.unique("kept")
      local c2 = helpers.connect({ scheduler = a.scheduler(loop), appname = app })
      local c3 = helpers.connect({ scheduler = a.scheduler(loop) })
      local observer = helpers.connect()
      local steady, at_close, after_close, gc_ok, gc_err
      sched.LOOK_AGAIN = 30
      loop.spawn(function()
        for _ = 1, 20 do assert(c2:command(helpers.database, { ping = 1 })) end
        steady = #forgot
        close_ping(observer, { times = 1 }, app)
        assert.is_nil(c2:command(helpers.database, { ping = 1 }))
        local t0 = core.monotonic()
        while core.monotonic() - t0 < 1 do assert(c2:command(helpers.database, { ping = 1 })) end
        -- the client closed right after a round trip, in the same resume;
        -- then a yield: cqueues updates its registrations there
        at_close = #forgot
        c2:close()
        after_close = #forgot
        S.sleep(0.01)
        -- the same with a client collected instead of closed
        assert(c3:command(helpers.database, { ping = 1 }))
        c3 = nil
        collectgarbage()
        collectgarbage()
        gc_ok, gc_err = pcall(S.sleep, 0.01)
      end)
      local ok, err = pcall(loop.run)
      sched.LOOK_AGAIN, S.wait_socket, S.forget = look, wait_socket, forget
      close_ping(observer, "off")
      observer:close()
      assert(ok, err)
      assert.same({}, loop.errors)
      assert.truthy(#waits >= 20, #waits .. " waits on sockets")
      assert.equal(0, steady, "no socket forgotten while its connection lives")
      assert.truthy(at_close >= 1, "the dead connection's socket was forgotten")
      for _, f in ipairs(forgot) do assert.truthy(f.open, "fd " .. f.fd .. " forgotten after its close") end
      assert.truthy(after_close > at_close, "the client's close forgot its sockets")
      assert(gc_ok, gc_err)
    end)

    -- an attempt runs in the loop's thread as the attempt itself: pool:here
    -- builds its op into the fiber's memory, with no Lua string (the
    -- runner's `attempts`, mongolock.yielding).  One refused there by a
    -- server that is no primary (twice: a retryable write is sent again
    -- once) is prepared again, and a worker thread sends its op
    on_fibers("hands an attempt itself to the loop's thread, with no op string; one that did not apply there "
       .. "goes to a worker thread with its op", function()
      local app = helpers.unique("attempts")
      local c2 = helpers.connect({ scheduler = a.scheduler(loop), appname = app })
      local observer = helpers.connect()
      local locks = helpers.locks(c2)
      local methods = debug.getmetatable(c2._core:acquire_attempt(helpers.database, "x", "x", 1000)).__index
      local op, ops = methods.op, 0
      methods.op = function(...)
        ops = ops + 1
        return op(...)
      end
      local won, steady, refused, after = 0, nil, nil, nil
      loop.spawn(function()
        for _ = 1, 5 do
          local h = assert(locks:try(helpers.unique("here")))
          assert.is_true(h:release())
          won = won + 1
        end
        local h = assert(locks:acquire(helpers.unique("here"), { timeout = 2 }))
        assert.is_true(h:release())
        steady = ops
        assert(observer:command("admin", { configureFailPoint = "failCommand" }, { mode = { times = 2 },
          data = { failCommands = { "findAndModify" }, errorCode = 10107, appName = app } }))
        local h2, err = locks:try(helpers.unique("back"))
        refused = { h2 ~= nil, tostring(err) }
        if h2 then h2:release() end
        after = ops
      end)
      local ok, err = pcall(loop.run)
      methods.op = op
      assert(observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" }))
      observer:close()
      c2:close()
      assert(ok, err)
      assert.same({}, loop.errors)
      assert.equal(5, won)
      assert.equal(0, steady, "op strings made for attempts run in the loop's thread")
      assert.same({ true, "nil" }, refused)
      assert.equal(1, after, "the refused attempt's op went to a worker thread")
    end)
  end)
end

describe("#integration scheduler option", function()
  it("refuses what is no scheduler at the caller", function()
    local names = "\"cqueues\", \"luv\", \"skynet\", \"copas\""
    assert.has_error(function() mongolock.connect(helpers.uri(), { scheduler = 42 }) end,
      "bad argument #2 to 'connect' (scheduler: " .. names .. " or a table expected, got number)")
    assert.has_error(function() mongolock.connect(helpers.uri(), { scheduler = "tokio" }) end,
      "bad argument #2 to 'connect' (scheduler: " .. names .. " or a table expected, got \"tokio\")")
    assert.has_error(function() mongolock.connect(helpers.uri(), { scheduler = { current = print } }) end,
      "bad argument #2 to 'connect' (scheduler: sleep must be a function)")
    assert.has_error(function() mongolock.connect(helpers.uri(), { scheduler = "cqueues", threads = 0 }) end,
      "bad argument #2 to 'connect' (threads must be an integer from 1 to 256 (got 0))")
  end)

  it("takes mongolock.sched.luv as a table (the documented interface) as it takes \"luv\"", function()
    local S = require "mongolock.sched.luv"
    local client = helpers.connect({ scheduler = S })
    local locks = helpers.locks(client)
    local errors, got, ticks = {}, nil, 0
    S.on_error = function(message) errors[#errors + 1] = message end
    local name = helpers.unique("luv-table")
    local h = assert(locks:acquire(name, { timeout = 1 }))
    S.spawn(function()
      got = assert(locks:acquire(name, { timeout = 5 }))
      assert(got:release())
    end)
    S.spawn(function()
      S.sleep(0.05)
      ticks = ticks + 1
      assert(h:release())
    end)
    assert.is_nil(got)       -- waiting in the loop, not blocking
    S.run()
    assert.same({}, errors)
    assert.is_not_nil(got)
    assert.equal(1, ticks)
    assert.is_false(S.current())
    client:close()
  end)

  it("outside a coroutine of the loop the client blocks as before", function()
    local client = helpers.connect({ scheduler = "cqueues" })
    local locks = helpers.locks(client)
    local h = assert(locks:acquire(helpers.unique("plain"), { timeout = 1 }))
    assert.is_true(h:release())
    client:close()
  end)
end)

-- a scheduler of its own on luv (not the shipped adapter: its coroutines
-- are only those it spawns) that records every sleep and every wait on a
-- descriptor, and whether a wait ended on the descriptor's readiness
local function recording_scheduler()
  local uv = require "luv"
  local mine = setmetatable({}, { __mode = "k" })
  local S = { log = {}, errors = {} }
  local function resume(co)
    local ok, err = coroutine.resume(co)
    if not ok then S.errors[#S.errors + 1] = debug.traceback(co, tostring(err)) end
  end
  function S.current()
    local co = coroutine.running()
    return co ~= nil and mine[co] == true
  end
  function S.sleep(s)
    local co = coroutine.running()
    S.log[#S.log + 1] = { co = co, what = "sleep", at = core.monotonic() }
    local t = uv.new_timer()
    t:start(math.max(0, math.floor(s * 1000 + 0.5)), 0, function()
      t:close()
      resume(co)
    end)
    coroutine.yield()
  end
  function S.wait_fd(fd, s)
    local co = coroutine.running()
    local e = { co = co, what = "wait_fd", fd = fd }
    S.log[#S.log + 1] = e
    local p, t = uv.new_poll(fd), uv.new_timer()
    local function wake(how)
      if e.how then return end
      e.how, e.at = how, core.monotonic()
      p:stop()
      p:close()
      t:stop()
      t:close()
      resume(co)
    end
    p:start("r", function() wake("readable") end)
    t:start(math.max(1, math.floor(s * 1000 + 0.5)), 0, function() wake("timeout") end)
    coroutine.yield()
  end
  function S.spawn(fn)
    local co = coroutine.create(fn)
    mine[co] = true
    resume(co)
    return co
  end
  function S.run() uv.run() end
  function S.timer(s, fn)
    local t = uv.new_timer()
    t:start(math.floor(s * 1000), 0, function()
      t:close()
      fn()
    end)
  end
  return S
end

describe("#integration a coroutine waiting for a lock", function()
  it("is woken through wait_fd by the release's event, with no sleep steps while it waits", function()
    local S = recording_scheduler()
    local client = helpers.connect({ scheduler = S })
    local plain = helpers.connect()
    local o = { database = helpers.database, collection = helpers.unique("locks") }
    local locks, held = client:locks(o), plain:locks(o)
    local name = helpers.unique("woken")
    local h = assert(held:acquire(name, { ttl = 10 }))
    local got, err, waiter, released_at, t0, t1
    waiter = S.spawn(function()
      t0 = core.monotonic()
      got, err = locks:acquire(name, { timeout = 10, wait = "watch" })
      t1 = core.monotonic()
      if got then assert(got:release()) end
    end)
    -- the release, from the loop's thread outside any coroutine, 0.4 s on
    S.timer(0.4, function()
      assert(h:release())
      released_at = core.monotonic()
    end)
    S.run()
    plain:close()
    client:close()
    assert.same({}, S.errors)
    assert.is_not_nil(got, tostring(err))
    assert.is_number(released_at)
    local sleeps, woke = 0, nil
    for _, e in ipairs(S.log) do
      if e.co == waiter and e.what == "sleep" and e.at >= t0 and e.at <= t1 then sleeps = sleeps + 1 end
      -- the first wait of the waiter that ended after the release
      if e.co == waiter and e.what == "wait_fd" and not woke and e.at and e.at >= released_at then woke = e end
    end
    assert.equal(0, sleeps)
    assert.is_table(woke, "no wait on a descriptor ended after the release")
    assert.equal("readable", woke.how)
  end)
end)

-- the core's worker-thread pool itself (csrc/binding/pool.c), on a server that
-- does not answer: no round trip reaches anything
describe("#unit the core's worker-thread pool", function()
  local client, pool
  setup(function()
    client = assert(mongolock.connect("mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=200",
      { server_timeout = 0.2 }))
    pool = assert(core.pool(client._core, 2))
  end)
  teardown(function() pool:close() client:close() end)

  local function pack(...) return { n = select("#", ...), ... } end
  local function wait(job)
    local deadline = core.monotonic() + 10
    while core.monotonic() < deadline do
      local r = pack(job:take())
      if r[1] ~= false then return r end
      core.sleep(0.01)
    end
    error("the job never ended")
  end

  it("runs an op in a thread and answers what client:run answers, once", function()
    local op = core.op_status{ db = "d", coll = "c", name = "x" }
    local job = assert(pool:submit(op))
    assert.is_number(job:fd())
    local r = wait(job)
    local plain = pack(client._core:run(op))
    assert.is_nil(r[1])
    assert.is_string(r[2])
    assert.equal(plain[5], r[5])                 -- the same error domain
    assert.is_nil(job:fd())
    assert.same({ nil, "taken" }, { job:take() })
  end)

  it("refuses what is not an op at the caller, and what comes after close", function()
    assert.has_error(function() pool:submit("x") end)
    assert.has_error(function() pool:submit(42) end)
    assert.has_error(function() core.pool(client._core, 0) end)
    assert.has_error(function() core.pool(client._core, 257) end)
    assert.has_error(function() core.pool({}, 1) end)
    local p2 = assert(core.pool(client._core, 1))
    -- a job nobody takes (closed before its end) still runs; the pool
    -- closed with jobs queued ends them
    local j1 = assert(p2:submit(core.op_status{ db = "d", coll = "c", name = "y" }))
    local j2 = assert(p2:submit(core.op_status{ db = "d", coll = "c", name = "z" }))
    j1:close()
    assert.is_true(p2:close())
    assert.is_true(p2:close())
    local r = wait(j2)
    assert.is_nil(r[1])
    assert.is_string(r[2])
    assert.same({ nil, "closed" }, { p2:submit(core.op_status{ db = "d", coll = "c", name = "y" }) })
    assert.equal(0, p2:threads())
  end)

  it("writes a job's end to a signal the caller keeps (core.signal), to none with false", function()
    local sig = assert(core.signal())
    local fd = sig:fd()
    assert.is_number(fd)
    assert.is_false(sig:clear())
    local op = core.op_status{ db = "d", coll = "c", name = "s" }
    for _ = 1, 2 do                             -- the same descriptor for every job
      local job = assert(pool:submit(op, sig))
      assert.equal(fd, job:fd())
      local r = wait(job)
      assert.is_string(r[2])
      assert.is_true(sig:clear())
      assert.is_false(sig:clear())
    end
    local quiet = assert(pool:submit(op, false))
    assert.is_nil(quiet:fd())
    assert.is_string(wait(quiet)[2])
    -- closed while a job holds it: the job ends without writing it
    local job = assert(pool:submit(op, sig))
    assert.is_true(sig:close())
    assert.is_true(sig:close())
    assert.is_nil(sig:fd())
    assert.is_string(wait(job)[2])
    assert.has_error(function() pool:submit(op, sig) end)
    assert.has_error(function() pool:submit(op, 42) end)
  end)

  it("core.pid() is this process's id, as core.getpid() answers it, in a forked child too", function()
    local testing = require "mongolock.testing"
    assert.equal(core.getpid(), core.pid())
    local parent = core.pid()
    local child = assert(testing.fork())
    if child == 0 then testing.exit(core.pid() == core.getpid() and core.pid() ~= parent and 0 or 1) end
    local st = testing.waitpid(child, 10)
    assert.equal(0, st)
    assert.equal(parent, core.pid())
  end)

  it("answers nil, \"closed\" for a closed client", function()
    local c2 = assert(mongolock.connect("mongodb://127.0.0.1:9/"))
    c2:close()
    assert.same({ nil, "closed" }, { core.pool(c2._core, 1) })
  end)
end)
