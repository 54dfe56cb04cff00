-- Coroutine schedulers (connect{scheduler = "cqueues" | "luv"}) against the
-- plain path in the same run:
--
-- 1. Hand-off: 20 coroutines of one loop take turns on 3 named locks (each
--    holds 1 ms, on the loop's sleep), a 10 ms ticker coroutine beside them,
--    while a second process (plain, blocking calls) contends for the same 3
--    locks.  A hand-off is the time from a release to the acquire that
--    returns next on the same lock, counted where the next holder is a
--    waiter: "in-process" when both are coroutines of the loop, "to the
--    plain process" when a coroutine released and the other process's
--    blocking waiter took it.  Both processes read CLOCK_MONOTONIC.  A
--    round runs SECONDS after a first second whose hand-offs are not
--    counted (WARM).  A third process (the control) does nothing but
--    sleep 10 ms at a time meanwhile: its worst gap is what the machine
--    alone does to a sleeper, set beside the loop's ticker.
-- 2. One coroutine's cycles: docs:lock + h:release back to back, through the
--    scheduler's client against the same calls made blocking from the same
--    loop (the plain path), in alternating slices of 100 cycles.
--
--   lua5.4|luajit bench/sched.lua [SECONDS [ROUNDS [SCHEDULERS]]]   (MONGODB_URI set)
--   SCHEDULERS: cqueues,luv (those whose module loads)
--
-- Rounds alternate the modes; each table gives the median and the range
-- (lowest-highest) of the rounds.  Prints Markdown on stdout, progress on
-- stderr.
package.path = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;" .. package.path
local mongolock = require "mongolock"
local core = require "mongolock.core"
local util = require "util"

local unpack = table.unpack or rawget(_G, "unpack")

local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local monotonic = core.monotonic
local impl = rawget(_G, "jit") and "LuaJIT" or "Lua 5.4"
local NAMES, COROUTINES, HOLD, TICK = 3, 20, 0.001, 0.01
-- the hand-offs of a round's first second are not counted: a new client's
-- connections, stream and waiters' queue places, a new collection, and the
-- server warming to the load (measured with the stand-in: about twice the
-- p99 of the seconds after); the ticker's worst gap is given from the
-- start and after that first second
local WARM = 1

local function say(...) io.stderr:write("sched: ", table.concat({ ... }, " "), "\n") end

-- ---- the plain contender (a second process) ---------------------------------

-- bench/sched.lua --plain COLLECTION SECONDS NAME...: acquires and releases
-- the names in turn until SECONDS have passed, then prints "name acquired
-- released" per hold (monotonic seconds)
if arg[1] == "--plain" then
  local coll, seconds = arg[2], tonumber(arg[3])
  local names = { unpack(arg, 4) }
  local client = assert(mongolock.connect(uri, { appname = "bench-sched-plain" }))
  local locks = client:locks({ database = "mongolock_bench", collection = coll })
  local out, k, stop = {}, 0, monotonic() + seconds
  while monotonic() < stop do
    k = k + 1
    local name = names[k % #names + 1]
    local h = locks:acquire(name, { timeout = 10 })
    if h then
      local t = monotonic()
      core.sleep(HOLD)
      local r = monotonic()
      h:release()
      out[#out + 1] = ("%s %.6f %.6f"):format(name, t, r)
    end
  end
  client:close()
  print(table.concat(out, "\n"))
  os.exit(0)
end

-- bench/sched.lua --control SECONDS: sleeps TICK at a time (core.sleep,
-- no client) for WARM + SECONDS, then prints its worst gap between two
-- wake-ups after the first WARM seconds (ms)
if arg[1] == "--control" then
  local warm = monotonic() + WARM
  local stop = warm + tonumber(arg[2])
  local last, worst = monotonic(), 0
  while last < stop do
    core.sleep(TICK)
    local now = monotonic()
    if last >= warm and now - last > worst then worst = now - last end
    last = now
  end
  print(("%.3f"):format(worst * 1000))
  os.exit(0)
end

local seconds = tonumber(arg[1]) or 5
local rounds = tonumber(arg[2]) or 3
local wanted = {}
for s in (arg[3] or "cqueues,luv"):gmatch("[^,]+") do wanted[#wanted + 1] = s end

-- ---- loops: spawn(fn), run() ----------------------------------------------------

local loops = {}
function loops.cqueues()
  local ok, cqueues = pcall(require, "cqueues")
  if not ok then return nil end
  local cq = cqueues.new()
  return { spawn = function(fn) cq:wrap(fn) end, run = function() assert(cq:loop()) end }
end
function loops.luv()
  local ok, S = pcall(require, "mongolock.sched.luv")
  if not ok then return nil end
  return { spawn = S.spawn, run = S.run }
end

local function sorted(t)
  local c = {}
  for i, v in ipairs(t) do c[i] = v end
  table.sort(c)
  return c
end
local function median(t) return util.percentile(sorted(t), 0.5) end
local function range(t, fmt)
  local s = sorted(t)
  return (fmt .. "-" .. fmt):format(s[1], s[#s])
end

-- ---- 1. hand-off ---------------------------------------------------------------

local function handoff_round(sched)
  local client = assert(mongolock.connect(uri, { scheduler = sched, appname = "bench-sched" }))
  local coll = ("handoff_%d_%s"):format(core.getpid(), tostring(monotonic()):gsub("%.", ""))
  local locks = client:locks({ database = "mongolock_bench", collection = coll })
  local names = {}
  for i = 1, NAMES do names[i] = "lock" .. i end
  local loop = loops[sched]()
  local holds, failed, worst, worst_warm, running = {}, 0, 0, 0, COROUTINES
  -- the other process starts with the loop, for the same time
  local plain = io.popen(("%s bench/sched.lua --plain %s %s %s"):format(
    arg[-1] or "lua5.4", coll, seconds + WARM, table.concat(names, " ")))
  local control = io.popen(("%s bench/sched.lua --control %s"):format(arg[-1] or "lua5.4", seconds))
  local warm = monotonic() + WARM
  local stop = warm + seconds
  loop.spawn(function()
    local last = monotonic()
    while running > 0 do
      mongolock.sleep(TICK)
      local now = monotonic()
      if now - last > worst then worst = now - last end
      if last >= warm and now - last > worst_warm then worst_warm = now - last end
      last = now
    end
  end)
  for i = 1, COROUTINES do
    loop.spawn(function()
      local k = i
      while monotonic() < stop do
        k = k + 1
        local name = names[k % NAMES + 1]
        local h = locks:acquire(name, { timeout = 10 })
        if h then
          local t = monotonic()
          mongolock.sleep(HOLD)
          local r = monotonic()
          if h:release() then holds[#holds + 1] = { name, t, r, true } else failed = failed + 1 end
        else
          failed = failed + 1
        end
      end
      running = running - 1
    end)
  end
  loop.run()
  local text = plain:read("*a")
  plain:close()
  local control_worst = tonumber(control:read("*a"):match("[%d.]+"))
  control:close()
  client:close()
  for name, t, r in text:gmatch("(%S+) (%S+) (%S+)") do
    holds[#holds + 1] = { name, tonumber(t), tonumber(r), false }
  end
  -- per lock, by acquisition: a release followed by a hold that began
  -- after it (the next holder waited) is a hand-off
  local inproc, toplain = {}, {}
  for _, name in ipairs(names) do
    local hs = {}
    for _, h in ipairs(holds) do if h[1] == name then hs[#hs + 1] = h end end
    table.sort(hs, function(a, b) return a[2] < b[2] end)
    for j = 2, #hs do
      local prev, h = hs[j - 1], hs[j]
      if prev[4] and h[2] >= prev[3] and prev[3] >= warm then
        local d = (h[2] - prev[3]) * 1000
        if h[4] then inproc[#inproc + 1] = d else toplain[#toplain + 1] = d end
      end
    end
  end
  local a, b = sorted(inproc), sorted(toplain)
  return {
    p50 = util.percentile(a, 0.5), p99 = util.percentile(a, 0.99), n = #a,
    plain50 = util.percentile(b, 0.5), plain99 = util.percentile(b, 0.99), nplain = #b,
    worst = worst * 1000, worst_warm = worst_warm * 1000, control = control_worst or 0 / 0, failed = failed,
  }
end

-- ---- 2. one coroutine's cycles ----------------------------------------------------

-- One coroutine alternates slices of SLICE cycles through the scheduler's
-- client and through a plain client (the same calls blocking), both
-- connected for the whole round, each mode `seconds` in all: the machine's
-- noise falls on both alike.  Answers the two rates (cycles/s).
local SLICE = 100
local function cycles_round(sched)
  local sc = assert(mongolock.connect(uri, { appname = "bench-sched", scheduler = sched }))
  local bc = assert(mongolock.connect(uri, { appname = "bench-sched" }))
  local coll = ("cycles_%d_%s"):format(core.getpid(), sched)
  local docs = { [false] = sc:documents("mongolock_bench", coll .. "_s"),
                 [true] = bc:documents("mongolock_bench", coll .. "_b") }
  local loop = loops[sched]()
  local n, t = { [false] = 0, [true] = 0 }, { [false] = 0, [true] = 0 }
  loop.spawn(function()
    for _, d in pairs(docs) do
      local _, h = d:lock(1, { insert = { score = 0 } })
      if h then h:release() end
    end
    local stop, blocking = monotonic() + 2 * seconds, false
    while monotonic() < stop do
      local d, t0 = docs[blocking], monotonic()
      for _ = 1, SLICE do
        local doc, hh = d:lock(1)
        if doc and hh:release() then n[blocking] = n[blocking] + 1 end
      end
      t[blocking] = t[blocking] + (monotonic() - t0)
      blocking = not blocking
    end
  end)
  loop.run()
  sc:close()
  bc:close()
  return n[false] / t[false], n[true] / t[true]
end

-- ---- report ------------------------------------------------------------------------

local scheds = {}
for _, s in ipairs(wanted) do
  if loops[s] and loops[s]() then scheds[#scheds + 1] = s else say("skipped " .. s) end
end

local H, C = {}, {}
for _, s in ipairs(scheds) do
  H[s] = {}
  C[s] = { sched = {}, blocking = {} }
end
for r = 1, rounds do
  for _, s in ipairs(scheds) do
    local h = handoff_round(s)
    H[s][r] = h
    say(impl, s, ("round %d hand-off in-process p50 %.2f p99 %.2f ms (%d), to plain p50 %.2f ms (%d), "
      .. "ticker worst %.1f ms (after the first second %.1f; control %.1f), failed %d"):format(r, h.p50, h.p99, h.n,
      h.plain50, h.nplain, h.worst, h.worst_warm, h.control, h.failed))
    local cs, cb = cycles_round(s)
    C[s].sched[r], C[s].blocking[r] = cs, cb
    say(impl, s, ("round %d one coroutine: %.0f cycles/s, blocking %.0f (%.2fx)"):format(r, cs, cb, cs / cb))
  end
end

local function col(s, k, fmt)
  local t = {}
  for r = 1, rounds do t[r] = H[s][r][k] end
  return (fmt .. " (" .. range(t, fmt) .. ")"):format(median(t))
end

print()
print(("%s, %d rounds of %g s (hand-offs: after a first second not counted): median (range)."):format(
  impl, rounds, seconds))
print()
print("| scheduler | in-process hand-off p50 | p99 | to plain p50 | p99 | worst tick gap | after the first second "
  .. "| a sleeping process's, after the first second | failed |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for _, s in ipairs(scheds) do
  local failed = 0
  for r = 1, rounds do failed = failed + H[s][r].failed end
  print(("| %s | %s ms | %s ms | %s ms | %s ms | %s ms | %s ms | %s ms | %d |"):format(s, col(s, "p50", "%.2f"),
    col(s, "p99", "%.2f"), col(s, "plain50", "%.2f"), col(s, "plain99", "%.2f"), col(s, "worst", "%.1f"),
    col(s, "worst_warm", "%.1f"), col(s, "control", "%.1f"), failed))
end
print()
print("| scheduler | one coroutine, cycles/s | the same calls blocking | ratio |")
print("|---|---:|---:|---:|")
for _, s in ipairs(scheds) do
  local ratios = {}
  for r = 1, rounds do ratios[r] = C[s].sched[r] / C[s].blocking[r] end
  print(("| %s | %.0f (%s) | %.0f (%s) | %.2fx (%s) |"):format(s, median(C[s].sched), range(C[s].sched, "%.0f"),
    median(C[s].blocking), range(C[s].blocking, "%.0f"), median(ratios), range(ratios, "%.2f")))
end
