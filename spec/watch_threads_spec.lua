-- #integration: the change-stream thread and the waiters share watch_mu
-- (csrc/binding/watch.c); nothing that can run the collector or wait for the
-- server happens under it.
--
-- The failed-stream case runs against a private stand-in that reports a
-- standalone server (no change streams), started by the spec itself, also
-- when MONGODB_URI names a real server.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local format = string.format

-- A waiter of a failed stream is answered while clients whose streams
-- exist become garbage: the answer's strings are pushed (which may run
-- their finalizers, whose close stops those streams under watch_mu) only
-- after watch_mu is released.  The collector runs a step at almost every
-- allocation.
local FAILED = [[
local core = require "mongolock.core"
local uri = ...
local a = assert(core.connect(uri))
if rawget(_G, "jit") then collectgarbage("setpause", 0); collectgarbage("setstepmul", 100)
else collectgarbage("incremental", 0, 100, 1) end
local n = 0
for k = 1, 300 do
  local b = assert(core.connect(uri))
  core.watch_wait(b, "mongolock_spec", "g", "owner", "x", 1, 1, 0)
  b = nil                                             -- garbage, its stream open
  for _ = 1, 10 do
    n = n + 1
    local r = core.watch_wait(a, "mongolock_spec", "c" .. n, "owner", "x", 1, 1, 2)
    assert(r == nil, "a standalone server's stream did not fail")
  end
end
print("done")
]]

-- close while the renewal thread is in a command (its update held up by
-- the server) and the stream's thread in a getMore: the stream is
-- detached and takes the pool, which its thread destroys when the getMore
-- returns; the renewal's connection and the client's own must be back in
-- the pool by then (they were not: the renewal thread read freed memory)
local CLOSE_RACE = [[
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local base, app, db, coll = ...
local c = assert(core.connect(base .. (base:find("?", 1, true) and "&" or "?")
  .. "socketTimeoutMS=1000&appname=" .. app))
local c2 = assert(core.connect(base))
assert(c2:command(db, { ping = 1 }))
assert(testing.failpoint(c2, { times = 1, commands = { "update" }, block_ms = 800, app_name = app }))
local h = assert(c:acquire(db, coll, "A", 900, nil, true))   -- renewed every 0.3 s
local t0 = core.monotonic()
local r = assert(c:command(db, { ping = 1 }))
core.watch_wait(c, db, coll, "owner", "B", r.operationTime.t, r.operationTime.i, 0.1)
while core.monotonic() - t0 < 0.4 do core.sleep(0.01) end
c:close()
core.sleep(1.5)                     -- the detached getMore returns meanwhile
testing.failpoint(c2, { mode = "off" })
c2:close()
print("alive " .. tostring(h ~= nil))
]]

-- a client collected while its stream's thread is in a getMore, with a
-- held lease that the stream watches for takeovers: the stream is detached
-- and its thread, when the getMore returns, must not look at the client's
-- leases again (it did: the holders' count of its previous batch was kept,
-- and it walked the freed client).  The getMores are held up 1.5 s by the
-- server so that the client's memory is freed and reused meanwhile; events
-- (another client's releases) end them
local COLLECTED = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local uri, app, db, coll = ...
local o = assert(mongolock.connect(uri))
local ol = o:locks({ database = db, collection = coll })
local function event(name)
  local h = assert(ol:try(name))
  assert(h:release())
end
assert(testing.failpoint(o._core, { mode = "alwaysOn", commands = { "getMore" }, block_ms = 1500, app_name = app }))
do
  local c = assert(mongolock.connect(uri, { appname = app }))
  local h = assert(c:locks({ database = db, collection = coll }):try("held", { ttl = 30, renew = true }))
  core.sleep(0.8)     -- the stream opens: the lease is watched 0.25 s after its acquire
  event("a")          -- its first getMore returns with it: the holders are counted
  core.sleep(2)
  assert(h:held())
end
-- the second getMore in flight: the client and its handle collected, their
-- memory reused
collectgarbage()
collectgarbage()
collectgarbage()
local junk = {}
for i = 1, 20000 do junk[i] = string.rep("\255", 32 + i % 1024) end
event("b")
core.sleep(2.5)
testing.failpoint(o._core, { mode = "off" })
o:close()
print("alive " .. #junk)
]]

-- a stream whose thread found no free connection (maxPoolSize=1: the
-- client's own holds it) fails; at the client's close it is freed, and the
-- client's pool destroyed, so the process's exit runs its handlers
-- (testing.exit_mark: skipped while a pool is open, unit_exit_spec).  The
-- thread left its stream marked in a call, never freed, nor the pool
local NO_CONNECTION = [[
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local uri, mark, db, coll = ...
testing.exit_mark(mark)
local c = assert(core.connect(uri .. (uri:find("?", 1, true) and "&" or "?") .. "maxPoolSize=1"))
local r = assert(c:command("admin", { ping = 1 }))
local res, err = core.watch_wait(c, db, coll, "owner", "x", r.operationTime.t, r.operationTime.i, 3)
print(tostring(res) .. " " .. tostring(err))
c:close()
os.exit(0)
]]

-- The core's own threads (a pool's workers, the change-stream thread, the
-- lease engine's) are started with the application's signals blocked (they
-- belong to its threads) but not the faults: a fault with its signal
-- blocked kills the process without running its handler, and a crash in
-- one of them left no trace (testing.crash_trace).  Prints, per thread
-- but the main one, "thread NAME SIGBLK"
local THREADS = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local uri, db, coll = ...
local c = assert(mongolock.connect(uri))
local c2 = assert(mongolock.connect(uri))
local locks = c:locks({ database = db, collection = coll })
local h = assert(locks:try("held", { ttl = 30, renew = true }))
-- a waiter of another client: its change-stream thread
local _, err = c2:locks({ database = db, collection = coll }):acquire("held", { timeout = 0.3 })
assert(err == "timeout", err)
local pool = assert(core.pool(c._core, 2))
local pid = core.getpid()
local ls = assert(io.popen("ls /proc/" .. pid .. "/task"))
for tid in ls:lines() do
  if tonumber(tid) ~= pid then
    local f = assert(io.open("/proc/" .. pid .. "/task/" .. tid .. "/status"))
    local st = f:read("*a")
    f:close()
    print("thread " .. st:match("Name:%s*(%S+)") .. " " .. st:match("SigBlk:%s*(%x+)"))
  end
end
ls:close()
pool:close()
h:release()
c2:close()
c:close()
]]

describe("#integration change-stream thread", function()
  it("the core's threads take none of the application's signals, and leave the faults unblocked", function()
    local path = helpers.script(THREADS)
    local out, ok, status = helpers.run(path, { helpers.uri(), helpers.database, helpers.unique("sig") })
    os.remove(path)
    assert.is_true(ok, format("exit %s: %s", tostring(status), out))
    -- bit n-1 of SigBlk is signal n
    local function blocked(mask, sig)
      local at = #mask - math.floor((sig - 1) / 4)
      local digit = tonumber(mask:sub(at, at), 16)
      return math.floor(digit / 2 ^ ((sig - 1) % 4)) % 2 == 1
    end
    local ours = 0
    for name, mask in out:gmatch("thread (%S+) (%x+)") do
      -- SIGTERM, SIGINT: the application's
      if blocked(mask, 15) and blocked(mask, 2) then ours = ours + 1 end
      -- SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV
      for _, sig in ipairs({ 4, 6, 7, 8, 11 }) do
        assert.is_false(blocked(mask, sig), format("thread %s blocks signal %d (SigBlk %s)\n%s", name, sig, mask,
          out))
      end
    end
    -- two workers, a stream's thread, the lease engine's
    assert.is_true(ours >= 4, out)
  end)

  it("close with a renewal in a command and a stream in a getMore frees nothing still in use",
    function()
      local path = helpers.script(CLOSE_RACE)
      local out, ok, status = helpers.run(path, { helpers.uri(), helpers.unique("close-race"),
        helpers.database, helpers.unique("cr") })
      os.remove(path)
      assert.is_true(ok, format("exit %s: %s", tostring(status), out))
      assert.matches("alive true", out, 1, true)
    end)


  it("a client collected with its stream's thread in a getMore and a watched lease held: the thread does not "
     .. "walk the client's leases when the getMore returns", function()
    local path = helpers.script(COLLECTED)
    local out, ok, status = helpers.run(path, { helpers.uri(), helpers.unique("collected"), helpers.database,
      helpers.unique("cg") })
    os.remove(path)
    assert.is_true(ok, format("exit %s: %s", tostring(status), out))
    assert.matches("alive 20000", out, 1, true)
  end)

  it("frees a stream that found no free connection at its client's close, and the client's pool", function()
    local path = helpers.script(NO_CONNECTION)
    local mark = os.tmpname()
    os.remove(mark)
    local out, ok, status = helpers.run(path, { helpers.uri(), mark, helpers.database, helpers.unique("nc") })
    os.remove(path)
    local f = io.open(mark)
    if f then f:close() end
    os.remove(mark)
    assert.is_true(ok, format("exit %s: %s", tostring(status), out))
    assert.matches("no free connection in the pool", out, 1, true)
    assert.is_truthy(f, "the exit handlers were skipped: a pool was still open")
  end)

  it("answers a failed stream's waiter outside watch_mu, while clients with streams are collected",
    function()
      local log = os.tmpname()
      local p = assert(io.popen(format("%s --port 0 --standalone >%s 2>&1 & echo $!",
        helpers.shell_quote(helpers.root .. "/tools/mongo-standin/run"),
        helpers.shell_quote(log))))
      local pid = tonumber(p:read("*l"))
      p:close()
      local addr
      for _ = 1, 400 do
        addr = (helpers.read_file(log) or ""):match("listening (%S+)")
        if addr then break end
        core.sleep(0.05)
      end
      assert(addr, "the stand-in did not start")
      local path = helpers.script(FAILED)
      local child = helpers.spawn(path, { format("mongodb://%s/?serverSelectionTimeoutMS=2000", addr) })
      -- a deadlock never ends: the child is given a minute (it takes a few
      -- seconds)
      local got, err = child:wait_for("done", 60)
      child:kill("KILL")
      os.execute(format("kill -9 %d 2>/dev/null", pid))
      os.remove(path)
      os.remove(log)
      assert.equal("done", got, err or child:output())
    end)

  it("reopens a stream without holding watch_mu across the old cursor's killCursors", function()
    local app = helpers.unique("watch-killcursors")
    local c = assert(core.connect(helpers.uri() .. (helpers.uri():find("?", 1, true) and "&" or "?")
      .. "appname=" .. app .. "&socketTimeoutMS=4000"))     -- getMore awaits 2 s
    local observer = helpers.connect()
    local db, coll = helpers.database, helpers.unique("wk")
    local r = assert(c:command(db, { ping = 1 }))
    local t, i = r.operationTime.t, r.operationTime.i
    assert.equal("timeout", (core.watch_wait(c, db, coll, "owner", "x", t, i, 0.2)))
    -- every getMore fails (the stream reopens) and every killCursors of
    -- the old cursor takes 2 s
    assert(testing.failpoint(observer._core, { mode = "alwaysOn", commands = { "getMore", "killCursors" },
      error_code = 2, block_ms = 2000, app_name = app }))
    local worst, t0 = 0, core.monotonic()
    local failed
    while core.monotonic() - t0 < 10 do
      local s = core.monotonic()
      local a = core.watch_wait(c, db, coll, "owner", "x", t, i, 0.05)
      worst = math.max(worst, core.monotonic() - s)
      if a == nil then failed = true break end
    end
    assert(testing.failpoint(observer._core, { mode = "off" }))
    -- a wait of 0.05 s is not held up by the server (2 s under watch_mu)
    assert.is_true(worst < 1, format("longest wait: %.2f s", worst))
    assert.is_true(testing.watch_stats(c).reopens >= 1 or failed, "the stream never reopened")
    c:close()
    observer:close()
  end)
end)
