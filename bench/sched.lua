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
--    blocking waiter took it.  Both processes read CLOCK_MONOTONIC.
-- 2. One coroutine's cycles: docs:lock + h:release back to back, through the
--    scheduler's client against the same calls made blocking from the same
--    loop (the plain path).
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
  local holds, failed, worst, running = {}, 0, 0, COROUTINES
  -- the other process starts with the loop, for the same time
  local plain = io.popen(("%s bench/sched.lua --plain %s %s %s"):format(
    arg[-1] or "lua5.4", coll, seconds, table.concat(names, " ")))
  local stop = monotonic() + seconds
  loop.spawn(function()
    local last = monotonic()
    while running > 0 do
      mongolock.sleep(TICK)
      local now = monotonic()
      if now - last > worst then worst = now - last end
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
      if prev[4] and h[2] >= prev[3] then
        local d = (h[2] - prev[3]) * 1000
        if h[4] then inproc[#inproc + 1] = d else toplain[#toplain + 1] = d end
      end
    end
  end
  local a, b = sorted(inproc), sorted(toplain)
  return {
    p50 = util.percentile(a, 0.5), p99 = util.percentile(a, 0.99), n = #a,
    plain50 = util.percentile(b, 0.5), plain99 = util.percentile(b, 0.99), nplain = #b,
    worst = worst * 1000, failed = failed,
  }
end

-- ---- 2. one coroutine's cycles ----------------------------------------------------

local function cycles_round(sched, blocking)
  local opts = { appname = "bench-sched" }
  if not blocking then opts.scheduler = sched end
  local client = assert(mongolock.connect(uri, opts))
  local docs = client:documents("mongolock_bench", ("cycles_%d_%s"):format(core.getpid(),
    blocking and "b" or "s"))
  local loop = loops[sched]()
  local n, elapsed
  loop.spawn(function()
    local _, h = docs:lock(1, { insert = { score = 0 } })
    if h then h:release() end
    local t0 = monotonic()
    local stop = t0 + seconds
    n = 0
    while monotonic() < stop do
      local doc, hh = docs:lock(1)
      if doc and hh:release() then n = n + 1 end
    end
    elapsed = monotonic() - t0
  end)
  loop.run()
  client:close()
  return n / elapsed
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
      .. "ticker worst %.1f ms, failed %d"):format(r, h.p50, h.p99, h.n, h.plain50, h.nplain, h.worst, h.failed))
    -- alternate which goes first
    local order = r % 2 == 1 and { false, true } or { true, false }
    for _, blocking in ipairs(order) do
      local c = cycles_round(s, blocking)
      local t = C[s][blocking and "blocking" or "sched"]
      t[#t + 1] = c
      say(impl, s, ("round %d one coroutine, %s: %.0f cycles/s"):format(r, blocking and "blocking" or "scheduler", c))
    end
  end
end

local function col(s, k, fmt)
  local t = {}
  for r = 1, rounds do t[r] = H[s][r][k] end
  return (fmt .. " (" .. range(t, fmt) .. ")"):format(median(t))
end

print()
print(("%s, %d rounds of %g s: median (range)."):format(impl, rounds, seconds))
print()
print("| scheduler | in-process hand-off p50 | p99 | to plain p50 | p99 | worst tick gap | failed |")
print("|---|---:|---:|---:|---:|---:|---:|")
for _, s in ipairs(scheds) do
  local failed = 0
  for r = 1, rounds do failed = failed + H[s][r].failed end
  print(("| %s | %s ms | %s ms | %s ms | %s ms | %s ms | %d |"):format(s, col(s, "p50", "%.2f"),
    col(s, "p99", "%.2f"), col(s, "plain50", "%.2f"), col(s, "plain99", "%.2f"), col(s, "worst", "%.1f"), failed))
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
