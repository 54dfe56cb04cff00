-- #integration: counting semaphores (mongolock.shared): N permits per
-- name, each a lease of its own; processes contending, a holder killed,
-- clocks an hour off, disagreeing N, malformed input, round trips.
local helpers = require "helpers"
local core = require "mongolock.core"
local pack = table.pack or function(...) return { n = select("#", ...), ... } end


describe("#integration semaphores", function()
  local client, coll, sems
  setup(function()
    client = helpers.connect({ appname = "sem-parent" })
    coll = helpers.unique("sem")
    sems = client:semaphores({ database = helpers.database, collection = coll, permits = 3 })
  end)
  teardown(function() client:close() end)

  local function spawn(mode, kind, name, a, b, n, prefix)
    return helpers.kinds_child(coll, mode, kind, name, a, b, n, prefix)
  end

  -- the raw lock document
  local function doc(name) return helpers.lock_doc(client, coll, name) end

  it("gives N permits, each its own owner, token and lease; the N+1st is busy", function()
    local name = helpers.unique("n")
    local hs, owners = {}, {}
    local last = 0
    for i = 1, 3 do
      hs[i] = assert(sems:try(name))
      assert.equal("permit", hs[i].kind)
      assert.is_nil(owners[hs[i].owner])
      owners[hs[i].owner] = true
      assert.is_true(hs[i].token > last)
      last = hs[i].token
    end
    local h, err, info = sems:try(name)
    assert.is_nil(h)
    assert.equal("busy", err)
    assert.equal(3, info.holders)
    assert.equal(3, info.permits)
    -- no writer: no owner (absent, as in the named locks' info, not null)
    assert.is_false(info.exclusive)
    assert.is_nil(info.owner)
    assert.is_nil(info.holder)
    local st = assert(sems:status(name))
    assert.equal(3, st.in_use)
    assert.equal(3, st.permits)
    assert.equal("permit", st.holders[1].mode)
    assert.equal(core.getpid(), st.holders[1].holder.pid)
    assert.equal(name, st.name)
    -- list: every name with permits, sorted, the same tables
    local other = helpers.unique("m")
    assert(sems:try(other)):close()
    local found = {}
    local prev = ""
    for _, e in ipairs(assert(sems:list())) do
      assert.is_true(e.name > prev)
      prev = e.name
      found[e.name] = e
    end
    assert.equal(3, found[name].in_use)
    assert.equal(0, found[other].in_use)
    assert.equal(3, found[other].permits)
    -- only its holder releases a permit; twice is "not held"
    assert.is_true(hs[2]:release())
    assert.same({ nil, "not held" }, { hs[2]:release() })
    assert.is_true(hs[1]:extend(5))
    local h4 = assert(sems:try(name))
    assert.is_true(h4.token > last)
    assert.equal(3, assert(sems:status(name)).in_use)
    -- a permit force-released elsewhere is lost to its holder
    assert.is_true(sems:force_release(name))
    assert.equal(0, assert(sems:status(name)).in_use)
    assert.same({ nil, "lost" }, { hs[1]:extend() })
    assert.is_true(hs[1]:lost())
    assert.same({ nil, "lost" }, { h4:release() })
    hs[3]:close()
  end)

  it("refuses a caller that disagrees about N, writing nothing", function()
    local name = helpers.unique("n-disagree")
    local h = assert(sems:try(name))
    local before = doc(name)
    local other = client:semaphores({ database = helpers.database, collection = coll, permits = 5 })
    local h2, err, info = other:try(name)
    assert.is_nil(h2)
    assert.equal('semaphore "' .. name .. '" has 3 permits, not 5', err)
    assert.is_true(info.mismatch)
    h2, err = other:acquire(name, { timeout = 1 })
    assert.is_nil(h2)
    assert.matches("has 3 permits, not 5", err, 1, true)
    assert.same(before, doc(name))
    -- a reader-writer lock of the same name is refused too
    local rw = client:rwlocks({ database = helpers.database, collection = coll })
    h2, err = rw:try_read(name)
    assert.is_nil(h2)
    assert.matches("is a semaphore of 3 permits", err, 1, true)
    assert.same(before, doc(name))
    assert.is_true(h:release())
    -- N stays fixed after every permit is back
    assert.matches("has 3 permits, not 5", select(2, other:try(name)), 1, true)
  end)

  it("refuses malformed input at the caller, writing nothing", function()
    local name = helpers.unique("bad")
    for _, n in ipairs({ 0, -1, 1.5, 1e7, 0 / 0, "3", true }) do
      assert.has_error(function()
        client:semaphores({ database = helpers.database, collection = coll, permits = n })
      end)
      assert.has_error(function() sems:try(name, { permits = n }) end)
    end
    assert.has_error(function()
      client:semaphores({ database = helpers.database, collection = coll }):try(name)
    end, "bad argument #2 to 'try' (permits expected (semaphores{permits = N} or {permits = N}))")
    assert.has_error(function() sems:try(name, { bogus = 1 }) end,
      "bad argument #2 to 'try' (unknown option 'bogus')")
    assert.has_error(function() sems:acquire(name, { ttl = -1 }) end)
    assert.has_error(function() sems:acquire(name, { wait = "sometimes" }) end)
    assert.has_error(function() sems:try(42) end, "bad argument #1 to 'try' (string expected, got number)")
    assert.has_error(function() sems:try("") end)
    assert.has_error(function() sems:try("a\0b") end)
    assert.has_error(function() sems:with(name, {}, "not a function") end)
    assert.is_nil(doc(name))
  end)

  it("with holds a permit while fn runs and always gives it back", function()
    local name = helpers.unique("with")
    local seen
    assert.equal(7, sems:with(name, function(h, x)
      seen = assert(sems:status(name)).in_use
      assert.is_true(h:held())
      return x
    end, 7))
    assert.equal(1, seen)
    assert.has_error(function() sems:with(name, function() error("boom", 0) end) end, "boom")
    assert.equal(0, assert(sems:status(name)).in_use)
  end)

  it("with answers nil, \"lost\" when the permit ended before fn returned, as locks:with", function()
    local name = helpers.unique("with-lost")
    local r = pack(sems:with(name, function()
      assert(sems:force_release(name))
      return "fn's result"
    end))
    assert.same({ n = 2, nil, "lost" }, r)
    assert.equal(0, assert(sems:status(name)).in_use)
  end)

  it("acquire with timeout = 0 answers \"timeout\" when every permit is held, as locks:acquire", function()
    local name = helpers.unique("t0")
    local hs = {}
    for i = 1, 3 do hs[i] = assert(sems:try(name)) end
    local h, err, info = sems:acquire(name, { timeout = 0 })
    assert.is_nil(h)
    assert.equal("timeout", err)
    assert.equal(3, info.holders)
    assert.equal("busy", select(2, sems:try(name)))
    for i = 1, 3 do assert.is_true(hs[i]:release()) end
  end)

  if _VERSION == "Lua 5.4" then
    it("gives a permit back on scope exit with <close>, error or not", function()
      local name = helpers.unique("close")
      local chunk = assert(load([[
        local sems, name, fail = ...
        local h <close> = assert(sems:try(name))
        if fail then error("inside", 0) end
        return (assert(sems:status(name)).in_use)
      ]]))
      assert.equal(1, chunk(sems, name, false))
      assert.equal(0, assert(sems:status(name)).in_use)
      assert.is_false(pcall(chunk, sems, name, true))
      assert.equal(0, assert(sems:status(name)).in_use)
    end)
  end

  it("a permit handle collected while held is released", function()
    local name = helpers.unique("gc")
    do local _ = assert(sems:try(name)) end
    collectgarbage()
    collectgarbage()
    assert.truthy(helpers.eventually(function()
      return assert(sems:status(name)).in_use == 0
    end, 5))
  end)

  it("three processes never hold more than N permits; tokens increase", function()
    local name = helpers.unique("contend")
    local log = os.tmpname()
    local n, loops = 2, 20
    local ps = {}
    for i = 1, 3 do ps[i] = spawn("loop", "permit", name, loops, log, n) end
    for _, p in ipairs(ps) do
      local st, out = p:wait(90)
      assert.equal(0, st, out)
      p:cleanup()
    end
    -- a logged section lies inside its permit's lease, so the overlap the
    -- log shows is at most the real one; tokens never repeat, and each
    -- process sees its own increase
    local inside, most, count, seen, last = 0, 0, 0, {}, {}
    for l in io.lines(log) do
      local pid, tok = l:match("^B permit (%d+) (%d+)$")
      if tok then
        inside = inside + 1
        count = count + 1
        most = math.max(most, inside)
        tok = tonumber(tok)
        assert.is_nil(seen[tok], l)
        seen[tok] = true
        assert.is_true(tok > (last[pid] or 0), l)
        last[pid] = tok
      else
        assert.is_truthy(l:match("^E permit %d+$"), l)
        inside = inside - 1
      end
    end
    os.remove(log)
    assert.equal(3 * loops, count)
    assert.is_true(most <= n, most .. " permits held at once")
    assert.equal(n, most)             -- they did overlap
  end)

  it("a holder killed with SIGKILL frees its permit when its lease ends", function()
    local name = helpers.unique("killed")
    local p = spawn("hold", "permit", name, 1, nil, 1)
    local pid = tonumber((assert(p:wait_for("held (%d+) %d+"))))
    local one = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    local _, err, info = one:try(name)
    assert.equal("busy", err)
    assert.is_true(info.remaining > 0 and info.remaining <= 1)
    local st = assert(one:status(name))
    assert.equal(pid, st.holders[1].holder.pid)
    p:kill("KILL", pid)
    assert.is_truthy(p:wait(10))
    p:cleanup()
    local started = core.monotonic()
    local h = assert(one:acquire(name, { timeout = 6 }))
    assert.is_true(core.monotonic() - started < 4)
    assert.is_true(h.token > st.holders[1].token)
    assert.is_true(h:release())
  end)

  -- two permits held, two waiters of other processes (queue_ttl 30 and
  -- leases of 60 s, so only an event can give them a permit within their
  -- 8 s); free calls free(two, name, a, b), then both waiters must hold
  local function both_woken(label, free)
    local name = helpers.unique(label)
    local two = client:semaphores({ database = helpers.database, collection = coll, permits = 2 })
    local a = assert(two:try(name, { ttl = 60 }))
    local b = assert(two:try(name, { ttl = 60 }))
    local w1 = spawn("wait", "permit", name, 8, nil, 2)
    local w2 = spawn("wait", "permit", name, 8, nil, 2)
    assert.truthy(helpers.eventually(function()
      return (assert(two:status(name)).waiting or 0) == 2
    end, 10))
    free(two, name, a, b)
    for _, p in ipairs({ w1, w2 }) do
      assert.is_truthy(p:wait_for("held %d+ %d+", 8), p:output())
      local st, out = p:wait(10)
      assert.equal(0, st, out)
      p:cleanup()
    end
  end

  it("a release wakes as many waiters as permits it freed (change stream)", function()
    both_woken("wake", function(_, _, a, b)
      assert.is_true(a:release())
      assert.is_true(b:release())
    end)
  end)

  it("a release of one permit wakes one of four waiters, not all of them", function()
    -- 2 permits held for 60 s, 4 waiters in other processes with places
    -- kept 60 s: nothing but a release's event can end their wait early.
    -- Each child counts its early wake-ups (a wait step ending more than
    -- a second before its 12 s deadline); a release that woke every
    -- waiter would give the ones left waiting one each.
    local name = helpers.unique("one-wake")
    local two = client:semaphores({ database = helpers.database, collection = coll, permits = 2 })
    local a = assert(two:try(name, { ttl = 60 }))
    local b = assert(two:try(name, { ttl = 60 }))
    local ws = {}
    for i = 1, 4 do
      ws[i] = spawn("count", "permit", name, 12, nil, 2)
      assert.truthy(ws[i]:wait_for("waiting %d+", 10))
    end
    assert.truthy(helpers.eventually(function()
      return (assert(two:status(name)).waiting or 0) == 4
    end, 10))
    local function holders()
      local n = {}
      for i, p in ipairs(ws) do
        if p:output():match("held %d+ %d+ %d+") then n[#n + 1] = i end
      end
      return n
    end
    assert.is_true(a:release())
    assert.truthy(helpers.eventually(function() return #holders() >= 1 end, 10))
    local st = assert(two:status(name))
    assert.equal(2, st.in_use)
    assert.equal(3, st.waiting)
    assert.is_true(b:release())
    assert.truthy(helpers.eventually(function() return #holders() >= 2 end, 10))
    -- the two left wait until their timeout, and say how often they woke
    local won, left = 0, 0
    for _, p in ipairs(ws) do
      local out = p:output()
      if out:match("held %d+ %d+ %d+") then
        won = won + 1
        assert.equal("1", out:match("held %d+ %d+ (%d+)"), out)   -- the one event
        p:kill("KILL", tonumber(out:match("waiting (%d+)")))
        p:wait(10)
      else
        local code, o = p:wait(20)
        assert.equal(0, code, o)
        assert.equal("0", o:match("timeout (%d+)"), o)
        left = left + 1
      end
      p:cleanup()
    end
    assert.equal(2, won)
    assert.equal(2, left)
  end)

  it("a waiter killed with SIGKILL holds the queue up for at most its queue_ttl", function()
    local name = helpers.unique("dead-waiter")
    local one = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    local h = assert(one:try(name, { ttl = 60 }))
    -- A queues first, then B; both keep their places for 2 s per attempt
    local a = spawn("wait", "permit", name, 30, nil, 1, "QUEUE_TTL=2 ")
    local apid = tonumber((assert(a:wait_for("waiting (%d+)"))))
    assert.truthy(helpers.eventually(function()
      return (assert(one:status(name)).waiting or 0) == 1
    end, 10))
    local b = spawn("wait", "permit", name, 30, nil, 1, "QUEUE_TTL=2 ")
    assert.truthy(helpers.eventually(function()
      return (assert(one:status(name)).waiting or 0) == 2
    end, 10))
    a:kill("KILL", apid)
    a:wait(10)
    a:cleanup()
    -- the release names A, who is dead: B takes the permit once A's place
    -- lapsed (2 s) at B's next return (every 1 s), not at its timeout
    local released = core.monotonic()
    assert.is_true(h:release())
    assert.is_truthy(b:wait_for("held %d+ %d+", 20), b:output())
    assert.is_true(core.monotonic() - released < 6, "taken after " .. (core.monotonic() - released))
    local st, out = b:wait(10)
    assert.equal(0, st, out)
    b:cleanup()
  end)

  it("force release hands the freed permits to the waiters", function()
    local a, b
    both_woken("wake-force", function(two, name, ha, hb)
      a, b = ha, hb
      assert.is_true(two:force_release(name))
    end)
    assert.same({ nil, "lost" }, { a:release() })
    assert.same({ nil, "lost" }, { b:release() })
  end)

  it("an attempt repeated with the same owner id finds itself holding and queues nothing", function()
    -- what the core's resend after a network error meets when the first
    -- attempt was applied and the server keeps no record of it
    local name = helpers.unique("again")
    local one = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    assert(one:try(name)):release()
    local w = assert(core.waiter_id())
    local c = client._core
    local h1 = assert(c:share_acquire(helpers.database, coll, name, "permit", 1, 5000, nil, false, w, 3000))
    local h2 = assert(c:share_acquire(helpers.database, coll, name, "permit", 1, 5000, nil, false, w, 3000))
    assert.equal(h1.owner, h2.owner)
    assert.equal(h1.token, h2.token)
    local st = assert(one:status(name))
    assert.equal(1, st.in_use)
    assert.equal(0, st.waiting)
    assert.is_true(h2:release())
    assert.same({ nil, "lost" }, { h1:release() })
    assert.equal(0, assert(one:status(name)).in_use)
  end)

  it("a permit acquire, extend and release whose replies are lost", function()
    local observer = helpers.connect()
    local function set(mode)
      local r = assert(observer._core:command("admin",
        { configureFailPoint = "onPrimaryTransactionalWrite" }, { mode = mode }))
      return r.count
    end
    local function lost(fn)
      local before = set({ times = 1 })
      local a, b, c = fn()
      local after = set("off")
      assert.equal(1, after - before, "the fail point fired once")
      return a, b, c
    end
    local name = helpers.unique("lost")
    local one = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    assert(one:try(name)):release()
    local h = lost(function() return one:acquire(name, { timeout = 5 }) end)
    assert.is_truthy(h, "acquired")
    local st = assert(one:status(name))
    assert.equal(1, st.in_use)
    assert.equal(h.owner, st.holders[1].owner)
    assert.equal(h.token, st.holders[1].token)
    assert.is_true(lost(function() return h:extend(10) end))
    assert.is_true(lost(function() return h:release() end))
    assert.equal(0, assert(one:status(name)).in_use)
    observer:close()
  end)

  describe("with clocks an hour off (faketime)", function()
    it("a skewed holder's permit lasts its ttl on the server's clock", function()
      for _, skew in ipairs({ "+1h", "-1h" }) do
        local name = helpers.unique("skew")
        local p = spawn("hold", "permit", name, 1.5, nil, 1, ("faketime -f '%s' "):format(skew))
        local pid = tonumber((assert(p:wait_for("held (%d+) %d+"))))
        local one = client:semaphores({ database = helpers.database, collection = coll,
          permits = 1 })
        local _, err, info = one:try(name)
        assert.equal("busy", err, skew)
        assert.is_true(info.remaining > 0 and info.remaining <= 1.5, tostring(info.remaining))
        p:kill("KILL", pid)
        p:wait(10)
        p:cleanup()
        local started = core.monotonic()
        local h = assert(one:acquire(name, { timeout = 6 }))
        assert.is_true(core.monotonic() - started < 4, skew)
        assert.is_true(h:release())
      end
    end)
  end)

  it("tokens increase across kinds and survive deletion of the document", function()
    local name = helpers.unique("fence")
    local one = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    local locks = client:locks({ database = helpers.database, collection = coll })
    local p = assert(one:try(name))
    local t1 = p.token
    assert.is_true(p:release())
    local x = assert(locks:try(name))
    assert.is_true(x.token > t1)
    assert.is_true(x:release())
    assert(client:command(helpers.database, { delete = coll },
      { deletes = { { q = { _id = name }, limit = 1 } } }))
    assert.is_nil(doc(name))
    core.sleep(0.002)
    local p2 = assert(one:try(name))
    assert.is_true(p2.token > x.token)
    assert.is_true(p2:release())
  end)
end)

describe("#integration the shared kinds' ops (as a transport runs them)", function()
  it("build, run and parse a permit's acquire, extend and release as the handles do", function()
    local client = helpers.connect({})
    local coll = helpers.unique("ops")
    local sems = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    local name = helpers.unique("op")
    local c = client._core
    local owner = assert(core.random_owner())
    -- an attempt: client:share_acquire_attempt's op run by client:run,
    -- finished by a:take
    local function attempt(who, permits)
      local a = c:share_acquire_attempt(helpers.database, coll, name, "permit", permits, 5000, nil, false, nil,
        nil, nil, who)
      return a:take(assert(c:run(a:op())))
    end
    -- h:extend(ttl) or h:release() as a transport runs it (core.lease_step,
    -- client:run, core.lease_done): the documents matched, and the op
    local function step(h, what, arg)
      local op, started = core.lease_step(h, what, arg)
      local reply = assert(c:run(op))
      assert.is_true(core.lease_done(h, what, started, reply))
      return core.parse_update(reply), op
    end
    local h = assert(attempt(owner, 1))
    assert.is_true(h.token > 0)
    local st = assert(sems:status(name))
    assert.equal(owner, st.holders[1].owner)
    assert.equal(core.getpid(), st.holders[1].holder.pid)
    -- another owner is busy; another N is a mismatch
    local other = assert(core.random_owner())
    local none, why, info = attempt(other, 1)
    assert.is_nil(none)
    assert.equal("busy", why)
    assert.equal(1, info.holders)
    none, why = attempt(other, 2)
    assert.is_nil(none)
    assert.equal("mismatch", why)
    assert.equal(1, (step(h, "extend", 9)))
    local n, release = step(h, "release")
    assert.equal(1, n)
    assert.equal(0, core.parse_update(assert(c:run(release))))
    assert.equal(0, assert(sems:status(name)).in_use)
    assert.has_error(function()
      c:share_acquire_attempt(helpers.database, coll, name, "permit", 0, 5000, nil, false, nil, nil, nil, owner)
    end)
    assert.has_error(function()
      c:share_acquire_attempt(helpers.database, coll, name, "x", 1, 5000, nil, false, nil, nil, nil, owner)
    end)
    client:close()
  end)
end)

describe("#integration semaphore round trips", function()
  local client, sems, commands

  setup(function()
    client = helpers.connect({ appname = "sem-rt" },
      helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    commands = helpers.command_counter(client)
    sems = client:semaphores({ database = helpers.database, collection = helpers.unique("semrt"),
      permits = 2 })
    assert(sems:try("warm")):release()
  end)
  teardown(function() client:close() end)

  it("an uncontended permit acquire, a try, each release and extend: one command each", function()
    local h, h2
    assert.equal(1, commands(function() h = assert(sems:acquire("x")) end))
    assert.equal(1, commands(function() h2 = assert(sems:try("x")) end))
    assert.equal(1, commands(function() assert.equal("busy", select(2, sems:try("x"))) end))
    assert.equal(1, commands(function() assert(h:extend(10)) end))
    assert.equal(1, commands(function() assert(sems:status("x")) end))
    assert.equal(1, commands(function() assert(sems:list()) end))
    assert.equal(1, commands(function() assert(h:release()) end))
    assert.equal(1, commands(function() assert(h2:release()) end))
    assert.equal(0, commands(function() assert.is_nil(h:release()) end))
  end)
end)

describe("#integration semaphores: a blocking wait for its own client's permits", function()
  local client, other, coll
  setup(function()
    client = helpers.connect({ appname = "sem-own" })
    other = helpers.connect({ appname = "sem-own-other" })
    coll = helpers.unique("sem_own")
  end)
  teardown(function() client:close(); other:close() end)

  it("takes the free permits, then answers \"deadlock\" at once when it holds them all", function()
    local sems = client:semaphores({ database = helpers.database, collection = coll, permits = 2 })
    local name = helpers.unique("own")
    local p1 = assert(sems:acquire(name))
    local p2 = assert(sems:acquire(name, { timeout = 1 }))
    local t0 = core.monotonic()
    local p3, err, info = sems:acquire(name)
    assert.is_nil(p3)
    assert.equal("deadlock", err)
    assert.equal(2, info.holders)
    assert.is_true(core.monotonic() - t0 < 5)
    assert(p2:release())
    -- one permit is another client's: it may be released, so the wait waits
    local theirs = assert(other:semaphores({ database = helpers.database, collection = coll, permits = 2 })
      :acquire(name, { ttl = 1 }))
    p3, err = sems:acquire(name, { timeout = 8 })
    assert.is_not_nil(p3, err)
    assert(p3:release())
    assert(p1:release())
    local _ = theirs
  end)
end)
