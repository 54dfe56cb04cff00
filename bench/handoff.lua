-- Hand-off latency: from a holder's release to the next waiter's acquire,
-- with change-stream wake-ups (wait = "watch") and with backoff polling
-- (wait = "poll"), for 2, 8, 16 and 32 contending processes.
--
--   lua5.4|luajit bench/handoff.lua [--waiters 2,8,16,32] [--modes watch,poll]
--                                   [--handoffs N] [--poll-handoffs N]
--                                   [--hold MS] [--out DIR]  (MONGODB_URI set)
--
-- Prints a Markdown table (median and p99 in milliseconds, server commands
-- per acquisition) and writes the raw samples, one latency in ms per line,
-- to DIR/handoff-<mode>-<waiters>.txt (DIR: bench/out).
--
-- How it measures.  Every process loops: acquire, note the time (the
-- system-wide CLOCK_MONOTONIC, comparable across processes), hold it
-- (--hold, 50 ms: long enough for a poller's backoff to grow as it would
-- behind real work),
-- note the time, release; then it waits, locally and without a server
-- command, until another process has taken the lock, and only then asks
-- again, so that every acquisition after the first is a hand-off to a
-- process that was already waiting.  A sample is the time from the
-- release's start to the next acquire's return (one release, a wake-up,
-- one findAndModify).  Commands per acquisition are the serverStatus
-- opcounters delta over the run divided by the acquisitions: failed
-- attempts, releases, the streams' aggregate and getMore, everything; the
-- steady state counts only between the 20% and the 90% mark of the
-- hand-offs (every process connected and its stream open, none gone).
--
-- Below the table: one uncontended cycle (try + release) after --hold of
-- idle time, against the same cycle back to back.  A hand-off's release
-- comes after the hold, when its process and the server have been idle;
-- the cycles table measures hot cycles only.

local mongolock = require "mongolock"
local core = require "mongolock.core"
local locks_mod = require "mongolock.locks"
package.path = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;" .. package.path
local util = require "util"

local monotonic = core.monotonic
local getenv = os.getenv
local format = string.format

local uri = getenv("MONGODB_URI")
if not uri or uri == "" then
  io.stderr:write("handoff: MONGODB_URI is not set (run it through tools/with-standin)\n")
  os.exit(2)
end

local DB = "mongolock_bench"

local read_file, write_file, exists = util.read_file, util.write_file, util.exists

-- ---- a worker process -----------------------------------------------------

-- worker DIR COLL MODE TARGET INDEX HOLD_MS
local function worker(dir, coll, mode, target, index, hold)
  target = tonumber(target)
  hold = tonumber(hold) / 1000
  local client = assert(mongolock.connect(uri, { appname = "handoff-" .. index }))
  local locks = client:locks({ database = DB, collection = coll, ttl = 30 })
  local real = locks_mod.get_wait()
  local waits = 0
  locks_mod.set_wait({
    check_mode = real.check_mode,
    sleep_until_retry = function(state)
      waits = waits + 1
      return real.sleep_until_retry(state)
    end,
  })
  local seqf, gof = dir .. "/seq", dir .. "/go"
  local function seq()
    return tonumber(read_file(seqf) or "") or -1
  end
  -- the connection is made and the collection's index exists before "go"
  assert(locks:try("warm-" .. index)):release()
  write_file(dir .. "/ready-" .. index, "")
  while not exists(gof) do core.sleep(0.001) end

  local out = {}
  while true do
    waits = 0
    local h, err = locks:acquire("the-lock", { timeout = 600, wait = mode })
    local t_acq = monotonic()
    if not h then
      io.stderr:write("handoff worker ", index, ": acquire: ", tostring(err), "\n")
      os.exit(1)
    end
    local s = seq()
    if s >= target then          -- done: let the others see it too
      h:release()
      break
    end
    s = s + 1
    write_file(seqf, tostring(s))
    out[#out + 1] = format("A %d %.9f %d", s, t_acq, waits)
    core.sleep(hold)
    out[#out + 1] = format("R %d %.9f", s, monotonic())
    assert(h:release())
    -- back in line only once another process holds it (or all are done)
    while seq() == s and s < target do core.sleep(0.0002) end
  end
  write_file(dir .. "/samples-" .. index, table.concat(out, "\n") .. "\n")
  client:close()
  os.exit(0)
end

if arg[1] == "--worker" then
  worker(arg[2], arg[3], arg[4], arg[5], arg[6], arg[7])
end

-- ---- the coordinator ------------------------------------------------------

local opts = { waiters = "2,8,16,32", modes = "watch,poll", handoffs = 200, poll_handoffs = 60,
  hold = 50, out = "bench/out" }
do
  local i = 1
  while arg[i] do
    local k, v = arg[i]:match("^%-%-([%w%-]+)$"), arg[i + 1]
    if not k or v == nil then
      io.stderr:write("usage: handoff.lua [--waiters 2,8,16,32] [--modes watch,poll] ",
        "[--handoffs N] [--poll-handoffs N] [--hold MS] [--out DIR]\n")
      os.exit(2)
    end
    opts[k:gsub("%-", "_")] = tonumber(v) or v
    i = i + 2
  end
end

local interp = arg[-1] or "lua5.4"
local script = arg[0]
local impl = rawget(_G, "jit") and "luajit" or "lua5.4"

local sh_quote, opcount, percentile = util.sh_quote, util.opcount, util.percentile

local function run(client, mode, n, handoffs)
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. sh_quote(dir)))
  local coll = format("handoff-%s-%d-%d", mode, n, core.getpid())
  local cmds = {}
  for i = 1, n do
    cmds[#cmds + 1] = format("%s %s --worker %s %s %s %d %d %s &", sh_quote(interp),
      sh_quote(script), sh_quote(dir), sh_quote(coll), mode, handoffs, i, tostring(opts.hold))
  end
  local p = assert(io.popen("( " .. table.concat(cmds, " ") .. " wait ) 2>&1", "r"))
  util.wait_ready(dir, n)   -- everyone connected and ready
  write_file(dir .. "/seq", "0")
  local o0 = opcount(client)
  write_file(dir .. "/go", "")
  -- the steady state: commands between the 20% and the 90% mark of the
  -- hand-offs, when every process has connected and opened its stream and
  -- none has left yet (each snapshot's own serverStatus taken off)
  local warm_at, end_at = math.floor(handoffs * 0.2), math.floor(handoffs * 0.9)
  local ow, mw, sw, steady, steady_lock
  local snaps = 0
  local until_t = monotonic() + 600
  while monotonic() < until_t do
    local sq = tonumber(read_file(dir .. "/seq") or "") or 0
    if not ow and sq >= warm_at then
      ow, mw = opcount(client)
      sw = sq
      snaps = snaps + 1
    elseif ow and sq >= end_at then
      local oe, me = opcount(client)
      snaps = snaps + 1
      if sq > sw then
        steady = (oe - ow - 1) / (sq - sw)
        -- unknown (shown as "-") without the server's command metrics
        steady_lock = me and mw and (oe - ow - 1 - (me - mw)) / (sq - sw)
      end
      break
    end
    core.sleep(0.002)
  end
  local log = p:read("*a")
  p:close()
  local o1 = opcount(client) - 1 - snaps  -- less the closing and snapshot serverStatus
  if log ~= "" then io.stderr:write(log) end

  local acq, rel = {}, {}
  local acquisitions = 0
  for i = 1, n do
    for line in (read_file(dir .. "/samples-" .. i) or ""):gmatch("[^\n]+") do
      local kind, s, t, w = line:match("^(%u) (%d+) (%S+) ?(%d*)$")
      s, t = tonumber(s), tonumber(t)
      if kind == "A" then
        acq[s] = { t = t, waits = tonumber(w) or 0 }
        acquisitions = acquisitions + 1
      elseif kind == "R" then
        rel[s] = t
      end
    end
    os.remove(dir .. "/samples-" .. i)
    os.remove(dir .. "/ready-" .. i)
  end
  os.remove(dir .. "/seq")
  os.remove(dir .. "/go")
  os.remove(dir)

  local samples = {}
  for s, a in pairs(acq) do
    if s > 1 and rel[s - 1] and a.waits > 0 then
      samples[#samples + 1] = (a.t - rel[s - 1]) * 1000
    end
  end
  table.sort(samples)
  assert(os.execute("mkdir -p " .. sh_quote(opts.out)))
  local raw = {}
  for i, v in ipairs(samples) do raw[i] = format("%.3f", v) end
  write_file(format("%s/handoff-%s-%d.txt", opts.out, mode, n), table.concat(raw, "\n") .. "\n")
  -- the workers' final acquire that only sees "done" counts as well
  return {
    mode = mode, n = n, samples = #samples,
    median = percentile(samples, 0.5), p99 = percentile(samples, 0.99),
    per_acq = (o1 - o0) / math.max(1, acquisitions + n),
    steady = steady,
    steady_lock = steady_lock,
  }
end

-- One uncontended cycle (try + release, the cycles table's) right after
-- the hold's idle time, as a hand-off's release comes, and back to back:
-- what the idle time alone costs on this machine (a process and the
-- server woken from idle run their next commands slower than hot ones).
-- Medians in ms: n cycles each after idle, their try alone, and 2n back
-- to back (after as many unmeasured ones).
local function idle_cycles(client, n)
  local locks = client:locks({ database = DB, collection = "handoff-idle" })
  local function cycle()
    local t0 = monotonic()
    local h = assert(locks:try("idle"))
    local t1 = monotonic()
    assert(h:release())
    return (monotonic() - t0) * 1000, (t1 - t0) * 1000
  end
  local idle, hot, try = {}, {}, {}
  for i = 1, 4 * n do
    local ms = cycle()
    if i > 2 * n then hot[#hot + 1] = ms end
  end
  for i = 1, n do
    core.sleep(opts.hold / 1000)
    idle[i], try[i] = cycle()
  end
  table.sort(idle); table.sort(hot); table.sort(try)
  return percentile(idle, 0.5), percentile(hot, 0.5), percentile(try, 0.5)
end

local client = assert(mongolock.connect(uri, { appname = "handoff-coordinator" }))
local idle_ms, hot_ms, idle_try_ms = idle_cycles(client, 60)
local rows = {}
for mode in tostring(opts.modes):gmatch("[^,]+") do
  for n in tostring(opts.waiters):gmatch("[^,]+") do
    n = tonumber(n)
    local handoffs = mode == "poll" and opts.poll_handoffs or opts.handoffs
    io.stderr:write(format("handoff: %s, %d waiters, %d hand-offs ...\n", mode, n, handoffs))
    rows[#rows + 1] = run(client, mode, n, handoffs)
  end
end
client:close()

io.write(format("\n### Hand-off latency (%s, release -> next waiter's acquire, hold %s ms)\n\n",
  impl, tostring(opts.hold)))
io.write("| wait | contending processes | hand-offs | median (ms) | p99 (ms) | server commands / acquisition "
  .. "| steady state | steady state, lock commands |\n")
io.write("|---|---:|---:|---:|---:|---:|---:|---:|\n")
for _, r in ipairs(rows) do
  io.write(format("| %s | %d | %d | %.2f | %.2f | %.1f | %s | %s |\n", r.mode, r.n, r.samples, r.median,
    r.p99, r.per_acq, r.steady and format("%.2f", r.steady) or "-",
    r.steady_lock and format("%.2f", r.steady_lock) or "-"))
end
io.write(format("\nRaw samples (ms, one per line): %s/handoff-<wait>-<processes>.txt\n", opts.out))
io.write(format("\nOne uncontended cycle (try + release) after %s ms idle, as a hand-off's "
  .. "release comes: median %.3f ms (its try alone %.3f ms); the same cycle back to back: %.3f ms "
  .. "(60 cycles after idle, 120 back to back, before the hand-offs).\n",
  tostring(opts.hold), idle_ms, idle_try_ms, hot_ms))

