-- The shared kinds: reader shares' throughput against exclusive cycles,
-- and a semaphore's hand-off latency.
--
--   lua5.4|luajit bench/shared.lua [--seconds S] [--readers 1,8,32]
--                                  [--processes 2,8,32] [--handoffs N]
--                                  [--hold MS] [--out DIR]  (MONGODB_URI set)
--
-- Throughput.  R processes loop on one name of a reader-writer lock:
-- rw:read + h:release (an uncontended share, one command each), for S
-- seconds after a common start; the same run measures exclusive cycles
-- (locks:acquire + h:release) by 1 process on one name, and by R processes
-- each on a name of its own (the same load on the server without the
-- sharing).  Figures: cycles per second of all processes together, and
-- server commands per cycle (serverStatus opcounters delta).
--
-- Hand-off.  P processes share one semaphore of 1 permit, then of P/2
-- permits: each loops acquire (wait = "watch"), note the time (the
-- system-wide CLOCK_MONOTONIC), hold --hold ms (50), note the time,
-- release, and asks again at once (it queues behind those already
-- waiting).  A sample is the time from a release's start to the return of
-- an acquire that had waited (one wake-up, one findAndModify): in time
-- order, each acquisition takes the permit freed first (the P free at the
-- start, then those of the releases), and one that had waited and takes a
-- released permit is a sample.
-- Samples, one per line in ms: DIR/shared-handoff-<permits>-<P>.txt.

local mongolock = require "mongolock"
local core = require "mongolock.core"
local locks_mod = require "mongolock.locks"
package.path = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;" .. package.path
local util = require "util"

local monotonic = core.monotonic
local format = string.format

local uri = os.getenv("MONGODB_URI")
if not uri or uri == "" then
  io.stderr:write("shared: MONGODB_URI is not set (run it through tools/with-standin)\n")
  os.exit(2)
end
local DB = "mongolock_bench"

local read_file, write_file, exists = util.read_file, util.write_file, util.exists

-- ---- workers ----------------------------------------------------------------

-- --worker DIR INDEX KIND COLL NAME ARG
--   KIND read|excl: ARG seconds; writes "cycles seconds failed"
--   KIND permit:    ARG "permits,handoffs,hold_ms"; writes A/R lines
local function worker(dir, index, kind, coll, name, arg1)
  local client = assert(mongolock.connect(uri, { appname = "shared-bench-" .. index }))
  local rw = client:rwlocks({ database = DB, collection = coll, ttl = 30 })
  local locks = client:locks({ database = DB, collection = coll, ttl = 30 })
  assert(locks:try("warm-" .. index)):release()
  local sem, permits, handoffs, hold
  if kind == "permit" then
    permits, handoffs, hold = arg1:match("^(%d+),(%d+),(%d+)$")
    permits, handoffs, hold = tonumber(permits), tonumber(handoffs), tonumber(hold) / 1000
    sem = client:semaphores({ database = DB, collection = coll, permits = permits, ttl = 30 })
  end
  write_file(dir .. "/ready-" .. index, "")
  while not exists(dir .. "/go") do core.sleep(0.001) end
  if kind ~= "permit" then
    local seconds = tonumber(arg1)
    local n, failed = 0, 0
    local t0 = monotonic()
    local t1 = t0
    while t1 - t0 < seconds do
      local h, err
      if kind == "read" then h, err = rw:read(name) else h, err = locks:acquire(name) end
      if h then
        if not h:release() then failed = failed + 1 end
        n = n + 1
      else
        failed = failed + 1
        io.stderr:write("shared worker ", index, ": ", tostring(err), "\n")
      end
      t1 = monotonic()
    end
    write_file(dir .. "/out-" .. index, format("%d %.6f %d\n", n, t1 - t0, failed))
  else
    local real = locks_mod.get_wait()
    local waits = 0
    locks_mod.set_wait({ check_mode = real.check_mode, sleep_until_retry = function(state)
      waits = waits + 1
      return real.sleep_until_retry(state)
    end })
    local out = {}
    while true do
      waits = 0
      local h, err = sem:acquire(name, { timeout = 600, wait = "watch" })
      local t = monotonic()
      if not h then
        io.stderr:write("shared worker ", index, ": acquire: ", tostring(err), "\n")
        os.exit(1)
      end
      out[#out + 1] = format("A %.9f %d", t, waits)
      core.sleep(hold)
      out[#out + 1] = format("R %.9f", monotonic())
      assert(h:release())
      if #out / 2 >= handoffs then break end
    end
    write_file(dir .. "/out-" .. index, table.concat(out, "\n") .. "\n")
  end
  client:close()
  os.exit(0)
end

if arg[1] == "--worker" then worker(arg[2], arg[3], arg[4], arg[5], arg[6], arg[7]) end

-- ---- the coordinator ----------------------------------------------------------

local opts = { seconds = 5, readers = "1,8,32", processes = "2,8,32", handoffs = 150, hold = 50,
  out = "bench/out" }
do
  local i = 1
  while arg[i] do
    local k, v = arg[i]:match("^%-%-([%w%-]+)$"), arg[i + 1]
    if not k or v == nil or opts[k] == nil then
      io.stderr:write("usage: shared.lua [--seconds S] [--readers 1,8,32] [--processes 2,8,32] ",
        "[--handoffs N] [--hold MS] [--out DIR]\n")
      os.exit(2)
    end
    opts[k] = tonumber(v) or v
    i = i + 2
  end
end

local interp, script = arg[-1] or "lua5.4", arg[0]
local impl = rawget(_G, "jit") and "LuaJIT" or "Lua 5.4"
local q = util.sh_quote

local client = assert(mongolock.connect(uri, { appname = "shared-bench" }))
local function opcount() return util.opcount(client) end
local percentile = util.percentile

local runs = 0

-- starts n workers (names(i) gives worker i's KIND, NAME), all ready before
-- "go"; returns each worker's output and the server commands of the run
local function run(n, kind, names, arg1)
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. q(dir)))
  runs = runs + 1
  local coll = format("shared-%s-%d-%d-%d", kind, n, core.getpid(), runs)
  local cmds = {}
  for i = 1, n do
    cmds[i] = format("%s %s --worker %s %d %s %s %s %s &", q(interp), q(script), q(dir), i, kind,
      q(coll), q(names(i)), q(arg1))
  end
  local p = assert(io.popen("( " .. table.concat(cmds, " ") .. " wait ) 2>&1", "r"))
  util.wait_ready(dir, n)
  local o0 = opcount()
  write_file(dir .. "/go", "")
  local log = p:read("*a")
  p:close()
  local ops = opcount() - o0 - 1
  if log ~= "" then io.stderr:write(log) end
  local outs = {}
  for i = 1, n do
    outs[i] = read_file(dir .. "/out-" .. i) or ""
    os.remove(dir .. "/out-" .. i)
    os.remove(dir .. "/ready-" .. i)
  end
  os.remove(dir .. "/go")
  os.remove(dir)
  return outs, ops
end

local function throughput(label, n, kind, names)
  io.stderr:write(format("shared: %s, %d processes, %ss ...\n", label, n, opts.seconds))
  local outs, ops = run(n, kind, names, opts.seconds)
  local cycles, seconds, failed = 0, 0, 0
  for _, o in ipairs(outs) do
    local c, s, f = o:match("^(%d+) (%S+) (%d+)")
    cycles, failed = cycles + (tonumber(c) or 0), failed + (tonumber(f) or 0)
    seconds = math.max(seconds, tonumber(s) or 0)
  end
  return { label = label, n = n, rate = cycles / math.max(seconds, 1e-9),
    per = ops / math.max(cycles, 1), failed = failed, cycles = cycles }
end

local trows = {}
trows[#trows + 1] = throughput("exclusive, one name", 1, "excl", function() return "x" end)
for r in tostring(opts.readers):gmatch("%d+") do
  r = tonumber(r)
  trows[#trows + 1] = throughput("shared (readers), one name", r, "read", function() return "r" end)
  if r > 1 then
    trows[#trows + 1] = throughput("exclusive, a name each", r, "excl",
      function(i) return "x" .. i end)
  end
end

local hrows = {}
for p in tostring(opts.processes):gmatch("%d+") do
  p = tonumber(p)
  local seen = {}
  for _, permits in ipairs({ 1, math.max(1, math.floor(p / 2)) }) do
    if not seen[permits] then
      seen[permits] = true
      io.stderr:write(format("shared: semaphore of %d permits, %d processes ...\n", permits, p))
      -- every process makes about handoffs / p acquisitions
      local each = math.max(2, math.ceil(opts.handoffs / p))
      local outs, ops = run(p, "permit", function() return "s" end,
        format("%d,%d,%d", permits, each, opts.hold))
      local ev = {}
      for _, o in ipairs(outs) do
        for line in o:gmatch("[^\n]+") do
          local k, t, w = line:match("^(%u) (%S+) ?(%d*)$")
          ev[#ev + 1] = { k = k, t = tonumber(t), w = tonumber(w) or 0 }
        end
      end
      table.sort(ev, function(a, b) return a.t < b.t end)
      -- the free permits in the order they were freed: the P free at the
      -- start (false: no release to measure from), then each release's time
      local pending, head, samples, acqs = {}, 1, {}, 0
      for i = 1, permits do pending[i] = false end
      for _, e in ipairs(ev) do
        if e.k == "R" then
          pending[#pending + 1] = e.t
        else
          acqs = acqs + 1
          -- every acquisition takes the permit freed first; one that had
          -- waited for a release is a hand-off
          local freed = pending[head]
          head = head + 1
          if freed and e.w > 0 then samples[#samples + 1] = (e.t - freed) * 1000 end
        end
      end
      table.sort(samples)
      assert(os.execute("mkdir -p " .. q(opts.out)))
      local raw = {}
      for i, v in ipairs(samples) do raw[i] = format("%.3f", v) end
      write_file(format("%s/shared-handoff-%d-%d.txt", opts.out, permits, p),
        table.concat(raw, "\n") .. "\n")
      hrows[#hrows + 1] = { p = p, permits = permits, samples = #samples,
        median = percentile(samples, 0.5), p90 = percentile(samples, 0.9),
        p99 = percentile(samples, 0.99), per = ops / math.max(acqs, 1) }
    end
  end
end
client:close()

io.write(format("\n### Shared acquire + release against exclusive cycles (%s, %s s)\n\n", impl,
  tostring(opts.seconds)))
io.write("| cycles | processes | cycles/s (all) | server commands / cycle | failed |\n")
io.write("|---|---:|---:|---:|---:|\n")
for _, r in ipairs(trows) do
  io.write(format("| %s | %d | %.0f | %.2f | %d |\n", r.label, r.n, r.rate, r.per, r.failed))
end
io.write(format("\n### Semaphore hand-off latency (%s, release -> a waiting process's acquire, "
  .. "hold %s ms, wait = \"watch\")\n\n", impl, tostring(opts.hold)))
io.write("| processes | permits | hand-offs | median (ms) | p90 (ms) | p99 (ms) | server commands / acquisition |\n")
io.write("|---:|---:|---:|---:|---:|---:|---:|\n")
for _, r in ipairs(hrows) do
  io.write(format("| %d | %d | %d | %.2f | %.2f | %.2f | %.1f |\n", r.p, r.permits, r.samples,
    r.median, r.p90, r.p99, r.per))
end
io.write(format("\nRaw samples (ms, one per line): %s/shared-handoff-<permits>-<processes>.txt\n",
  opts.out))
