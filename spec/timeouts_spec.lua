-- #integration: a timeout is a bound.  timeout = 0 is one attempt,
-- math.huge no limit; a call with a timeout returns within it even when the
-- server dies or stops answering, and the calls without one (release,
-- extend, status, list, close) within the client's server_timeout.
--
-- The dead-server cases run against a private stand-in started (and
-- SIGKILLed) by the spec itself, also when MONGODB_URI names a real server.
local helpers = require "helpers"
local core = require "mongolock.core"
local mongolock = require "mongolock"
local testing = require "mongolock.testing"

local monotonic = core.monotonic
local format = string.format

-- ---- a private stand-in ------------------------------------------------------

-- starts tools/mongo-standin on a free port; returns {uri, pid, log}
local function standin()
  local log = os.tmpname()
  local p = assert(io.popen(format("%s --port 0 >%s 2>&1 & echo $!",
    helpers.shell_quote(helpers.root .. "/tools/mongo-standin/run"), helpers.shell_quote(log))))
  local pid = tonumber(p:read("*l"))
  p:close()
  for _ = 1, 400 do
    local addr = (helpers.read_file(log) or ""):match("listening (%S+)")
    if addr then
      return { uri = format("mongodb://%s/?replicaSet=rs0", addr), pid = pid, log = log }
    end
    core.sleep(0.05)
  end
  error("the stand-in did not start: " .. (helpers.read_file(log) or ""))
end

local function kill(s)
  os.execute(format("kill -9 %d 2>/dev/null", s.pid))
  os.remove(s.log)
end

-- kills s after `after` seconds, from a shell in the background
local function kill_later(s, after)
  os.execute(format("(sleep %s; kill -9 %d) >/dev/null 2>&1 </dev/null &", tostring(after), s.pid))
end

-- seconds fn took, and its results
local function timed(fn)
  local t0 = monotonic()
  local r = table.pack and table.pack(fn()) or { fn() }
  return monotonic() - t0, r
end

describe("#integration timeout = 0 and math.huge", function()
  local client, commands

  setup(function()
    client = helpers.connect({ appname = "timeouts" }, helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    commands = helpers.command_counter(client)
  end)
  teardown(function() client:close() end)

  it("locks:acquire with timeout = 0 makes exactly one attempt", function()
    local locks = helpers.locks(client)
    local h = assert(locks:acquire("busy"))
    local n, r = commands(function() return locks:acquire("busy", { timeout = 0 }) end)
    assert.is_nil(r[1])
    assert.equal("timeout", r[2])
    assert.equal(h.owner, r[3].owner)
    assert.equal(1, n)
    -- free: the one attempt takes it
    local h2
    n = commands(function() h2 = assert(locks:acquire("free", { timeout = 0 })) end)
    assert.equal(1, n)
    assert.is_true(h2:release())
    assert.is_true(h:release())
  end)

  it("docs:lock with timeout = 0 makes exactly one attempt", function()
    local docs = client:documents(helpers.database, helpers.unique("docs"))
    local _, h = assert(docs:lock("d", { insert = {} }))
    local n, r = commands(function() return docs:lock("d", { timeout = 0 }) end)
    assert.is_nil(r[1])
    assert.equal("timeout", r[2])
    assert.equal(1, n)
    assert.is_true(h:release())
  end)

  it("locks:with and client:locks take timeout = 0 too", function()
    local locks = helpers.locks(client, { timeout = 0 })
    local h = assert(locks:acquire("w"))
    local ok, err = locks:with("w", function() return 1 end)
    assert.is_nil(ok)
    assert.equal("timeout", err)
    assert.is_true(h:release())
    assert.equal(7, locks:with("w", { timeout = 0 }, function() return 7 end))
  end)

  it("math.huge waits for as long as it takes", function()
    local locks = helpers.locks(client)
    assert(locks:acquire("forever", { ttl = 0.5 }))   -- never released: expires
    local took, r = timed(function() return locks:acquire("forever", { timeout = math.huge }) end)
    assert.is_userdata(r[1])
    assert.is_true(took >= 0.3, took)
    assert.is_true(r[1]:release())
    local docs = client:documents(helpers.database, helpers.unique("docs"))
    assert(docs:lock("d", { insert = {}, ttl = 0.5 }))
    local doc, h = docs:lock("d", { timeout = math.huge })
    assert.is_table(doc)
    assert.is_true(h:release())
  end)
end)

describe("#integration a short server_timeout", function()
  -- the stream's getMore waits at most half the socket timeout on the
  -- server, so a socket timeout under a second does not cut every getMore
  it("keeps the change stream reading", function()
    local holder = helpers.connect()
    local waiter = helpers.connect({ server_timeout = 0.5 })
    local hl = helpers.locks(holder)
    local wl = waiter:locks({ database = hl.database, collection = hl.collection })
    local h = assert(hl:acquire("x"))
    local got, err = wl:acquire("x", { timeout = 1.5, wait = "watch" })
    assert.is_nil(got)
    assert.equal("timeout", err)
    local st = testing.watch_stats(waiter._core)
    assert.is_true(st.getmores >= 2, "getMores: " .. tostring(st.getmores))
    assert.equal(0, st.failed)
    assert.is_true(h:release())
    holder:close()
    waiter:close()
  end)
end)

describe("#integration a server that dies or hangs", function()
  -- auto: the change stream's failed getMore tells the driver first, and
  -- no attempt starts once no server is known.  poll: the next attempt finds
  -- the connection dead, and the driver's retry of the write selects a
  -- server again: timeout + one server_timeout at worst (the limit below
  -- is half a server_timeout above that: a second selection, as a resend
  -- after the driver's own retry made, goes past it)
  it("acquire with timeout = 2 returns within it when the server is killed mid-wait", function()
    for _, case in ipairs({ { "auto", nil, 2 * 2 }, { "poll", 4, 2 + 1.5 * 4 } }) do
      local mode, bound, limit = case[1], case[2], case[3]
      local s = standin()
      local holder = assert(mongolock.connect(s.uri))
      local waiter = assert(mongolock.connect(s.uri, { server_timeout = bound }))
      local hl = holder:locks({ collection = "k" })
      local wl = waiter:locks({ collection = "k" })
      assert(hl:acquire("x", { ttl = 30 }))
      kill_later(s, 1)
      local took, r = timed(function() return wl:acquire("x", { timeout = 2, wait = mode }) end)
      assert.is_nil(r[1])
      assert.is_string(r[2])
      assert.is_true(took < limit, format("%s: %.2f s", mode, took))
      local closed = timed(function() waiter:close() end)
      assert.is_true(closed < 2 * 2 * (bound or 5), format("close: %.2f s", closed))
      holder:close()
      kill(s)
    end
  end)

  it("acquire with timeout = 2 returns within it plus server_timeout when the server hangs", function()
    local s = standin()
    local admin = assert(mongolock.connect(s.uri))
    local waiter = assert(mongolock.connect(s.uri, { appname = "hung", server_timeout = 1 }))
    local wl = waiter:locks({ collection = "k" })
    assert(admin:locks({ collection = "k" }):acquire("x", { ttl = 30 }))
    assert(wl:status("x"))                -- connected, index made
    assert(testing.failpoint(admin._core, { mode = "alwaysOn", commands = { "findAndModify" },
      app_name = "hung", block_ms = 20000 }))
    local took, r = timed(function() return wl:acquire("x", { timeout = 2 }) end)
    assert.is_nil(r[1])
    -- timeout + server_timeout, under 2x
    assert.is_true(took < 2 * (2 + 1), format("%.2f s", took))
    admin:close()
    kill(s)
    waiter:close()
  end)

  it("release, extend, status, list and close of a dead server return within server_timeout", function()
    local s = standin()
    local client = assert(mongolock.connect(s.uri, { server_timeout = 1 }))
    local locks = client:locks({ collection = "k" })
    local h = assert(locks:acquire("x", { ttl = 30, renew = true }))
    local h2 = assert(locks:acquire("y", { ttl = 30 }))
    kill(s)
    -- each within server_timeout, twice that for a write the driver retries
    -- after a lost connection; asserted under 2x that
    local bound = 2 * 1
    for what, fn in pairs({
      extend = function() return h:extend() end,
      release = function() return h2:release() end,
      status = function() return locks:status("x") end,
      list = function() return locks:list() end,
      try = function() return locks:try("z") end,
    }) do
      local took, r = timed(fn)
      assert.is_nil(r[1], what)
      assert.is_true(took < 2 * bound, format("%s: %.2f s", what, took))
    end
    local took = timed(function() client:close() end)
    assert.is_true(took < 2 * bound, format("close: %.2f s", took))
  end)

  -- issue 42: a frozen server (SIGSTOP) after one call that succeeded:
  -- the monitors still know it writable, so the attempt is sent and waits
  -- for a reply; each try ends after attempt_timeout (1 s), not after the
  -- server bound twice (the socket timeout, then the driver's retry)
  it("try against a frozen server returns within about attempt_timeout when given, naming the cause", function()
    local s = standin()
    local client = assert(mongolock.connect(s.uri, { attempt_timeout = 1 }))
    local locks = client:locks({ collection = "k" })
    assert.equal(1, client.attempt_bound)
    local h = assert(locks:try("x"))
    assert(h:release())
    os.execute(format("kill -STOP %d", s.pid))
    local ok, e = pcall(function()
      for round = 1, 2 do
        local took, r = timed(function() return locks:try("y" .. round) end)
        assert.is_nil(r[1])
        -- the cause: no reply (a socket timeout), or no server found
        assert.is_truthy(tostring(r[2]):match("socket") or tostring(r[2]):match("No suitable servers"),
          tostring(r[2]))
        assert.is_true(took < 3, format("try %d: %.2f s", round, took))
      end
    end)
    os.execute(format("kill -CONT %d", s.pid))
    client:close()
    kill(s)
    assert(ok, e)
  end)

  -- the same by default (no attempt_timeout given), for every kind's single
  -- attempt; the server thawed, nothing taken in the dark stays held
  it("every kind's try against a frozen server returns within about a second by default, naming the cause", function()
    local s = standin()
    local client = assert(mongolock.connect(s.uri))
    local locks = client:locks({ collection = "k", ttl = 60 })
    local rw = client:rwlocks({ collection = "rw", ttl = 60 })
    local sem = client:semaphores({ collection = "sem", permits = 2, ttl = 60 })
    local docs = client:documents("mongolock", "orders")
    local h = assert(locks:try("x"))
    assert(h:release())
    local calls = {
      { "locks:try", function() return locks:try("y") end },
      { "locks:acquire", function() return locks:acquire("y", { timeout = 0 }) end },
      { "rw:try_write", function() return rw:try_write("y") end },
      { "sem:try", function() return sem:try("y") end },
      { "docs:try", function() return docs:try(1) end },
    }
    os.execute(format("kill -STOP %d", s.pid))
    local ok, e = pcall(function()
      for _, c in ipairs(calls) do
        local took, r = timed(c[2])
        assert.is_nil(r[1], c[1])
        assert.is_truthy(tostring(r[2]):match("not answering") or tostring(r[2]):match("No suitable servers"),
          c[1] .. ": " .. tostring(r[2]))
        assert.is_true(took < 3, format("%s: %.2f s", c[1], took))
      end
    end)
    os.execute(format("kill -CONT %d", s.pid))
    if ok then
      ok, e = pcall(function()
        -- what a cut attempt may have taken is released in the background
        local free
        for _ = 1, 100 do
          -- (nil, nil: no document, nothing held)
          local a, e1 = locks:status("y")
          local b, e2 = rw:status("y")
          local d, e3 = sem:status("y")
          free = not (e1 or e2 or e3) and not (a and a.owner) and not (b and b.writer)
            and #(d and d.holders or {}) == 0
          if free then break end
          core.sleep(0.1)
        end
        assert.is_true(free, "a try cut by the freeze left its lock held")
        local h2 = assert(locks:try("y"))
        assert(h2:release())
      end)
    end
    client:close()
    kill(s)
    assert(ok, e)
  end)

  it("the default server_timeout is far below libmongoc's 30 s", function()
    local s = standin()
    local client = assert(mongolock.connect(s.uri))
    local locks = client:locks({ collection = "k" })
    assert(locks:list())
    kill(s)
    local took, r = timed(function() return locks:status("x") end)
    assert.is_nil(r[1])
    assert.is_true(took < 2 * 2 * mongolock.connect_defaults.server_timeout, format("%.2f s", took))
    client:close()
  end)

  it("timeout = 0 (every kind's try) answers within about a second against a port that refuses", function()
    local client = assert(mongolock.connect("mongodb://127.0.0.1:1/"))
    assert.is_true(client.server_bound >= 2)    -- the default bound is longer than the answer
    local locks = client:locks()
    local rw = client:rwlocks()
    local sem = client:semaphores({ permits = 2 })
    local docs = client:documents("db", "orders")
    local calls = {
      ["locks:try"] = function() return locks:try("x") end,
      ["locks:acquire"] = function() return locks:acquire("x", { timeout = 0 }) end,
      ["locks:with"] = function() return locks:with("x", { timeout = 0 }, function() end) end,
      ["rw:try_read"] = function() return rw:try_read("x") end,
      ["rw:read"] = function() return rw:read("x", { timeout = 0 }) end,
      ["rw:try_write"] = function() return rw:try_write("x") end,
      ["sem:try"] = function() return sem:try("x") end,
      ["docs:try"] = function() return docs:try(1) end,
      ["docs:lock"] = function() return docs:lock(1, { timeout = 0 }) end,
    }
    for what, call in pairs(calls) do
      local took, r = timed(call)
      assert.is_nil(r[1], what)
      assert.is_truthy(tostring(r[2]):match("No suitable servers"), what .. ": " .. tostring(r[2]))
      assert.is_true(took < 2, format("%s: %.2f s", what, took))
    end
    client:close()
  end)

  it("acquire with a timeout returns within it against a port that refuses", function()
    local client = assert(mongolock.connect("mongodb://127.0.0.1:1/"))
    local locks = client:locks()
    local took, r = timed(function() return locks:acquire("x", { timeout = 1 }) end)
    assert.is_nil(r[1])
    assert.is_truthy(r[2]:match("No suitable servers"), r[2])
    assert.is_true(took < 2, format("%.2f s", took))
    took = timed(function() client:close() end)
    assert.is_true(took < 1, format("close: %.2f s", took))
  end)
end)
