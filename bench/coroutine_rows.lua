-- The rows of bench/frameworks.lua and bench/skynet/cycles.lua: one loop's
-- coroutines (cqueues, Copas or a skynet service), each locking and
-- unlocking a document of its own, through a client connected with the
-- loop's scheduler against the same calls made blocking; a 10 ms ticker
-- coroutine of the same loop; and, with the scheduler, the hand-off within
-- the process (a coroutine releases a named lock another coroutine of the
-- same client waits for: from the release's start to the waiter's return).
--
--   rows(L, uri, seconds, counts) -> Markdown table lines
--
-- L: { name, scheduler, spawn(fn), sleep(s), run() }: run returns once
-- every coroutine spawn started has ended.
local mongolock = require "mongolock"
local core = require "mongolock.core"

local monotonic = core.monotonic
local _M = {}

local HANDOFFS = 40

-- n coroutines cycling for `seconds`; cycles, elapsed, worst tick, failures
local function cycles_round(L, client, n, seconds, tag)
  local docs = client:documents("mongolock_bench", "players_" .. tag .. "_" .. core.getpid())
  local cycles, failed, worst, running = 0, 0, 0, n
  local stop = math.huge
  L.spawn(function()
    local last = monotonic()
    while running > 0 do
      L.sleep(0.01)
      local now = monotonic()
      if now - last > worst then worst = now - last end
      last = now
    end
  end)
  local ready = 0
  for i = 1, n do
    L.spawn(function()
      local _, h = docs:lock(i, { insert = { score = 0 } })   -- creates it (not counted)
      if h then h:release() end
      ready = ready + 1
      if ready == n then stop = monotonic() + seconds end
      while monotonic() < stop do
        local doc, hh = docs:lock(i)
        if doc and hh:release() then cycles = cycles + 1 else failed = failed + 1 end
        L.sleep(0)            -- a turn for the loop's others after each cycle
      end
      running = running - 1
    end)
  end
  L.run()
  return cycles, seconds, worst, failed
end

-- HANDOFFS hand-offs between two coroutines of one client; sorted seconds
local function handoffs(L, client)
  local locks = client:locks({ database = "mongolock_bench", collection = "handoff_" .. core.getpid() })
  local t = {}
  for i = 1, HANDOFFS do
    local name = "h" .. i
    local h = assert(locks:acquire(name, { ttl = 10 }))
    local t0, got
    L.spawn(function()
      local g = assert(locks:acquire(name, { timeout = 10, step = 2, max_step = 2 }))
      got = monotonic()
      g:release()
    end)
    L.spawn(function()
      L.sleep(0.02)
      t0 = monotonic()
      h:release()
    end)
    L.run()
    t[i] = got - t0
  end
  table.sort(t)
  return t
end

local function pct(t, p) return t[math.max(1, math.ceil(#t * p))] end

function _M.header()
  return { "| loop | N coroutines | client | cycles/s | longest gap between 10 ms ticks "
    .. "| hand-off p50 | hand-off p99 | failed |", "|---|---:|---|---:|---:|---:|---:|---:|" }
end

function _M.rows(L, uri, seconds, counts)
  local lines = {}
  for _, n in ipairs(counts) do
    for _, mode in ipairs({ "scheduler", "blocking" }) do
      local opts = { appname = "bench-frameworks" }
      if mode == "scheduler" then opts.scheduler = L.scheduler end
      local client = assert(mongolock.connect(uri, opts))
      local c, elapsed, worst, failed = cycles_round(L, client, n, seconds, mode)
      local p50, p99 = "-", "-"
      if mode == "scheduler" then
        local t = handoffs(L, client)
        p50, p99 = string.format("%.1f ms", pct(t, 0.5) * 1000), string.format("%.1f ms", pct(t, 0.99) * 1000)
      end
      client:close()
      lines[#lines + 1] = string.format("| %s | %d | %s | %.0f | %.1f ms | %s | %s | %d |", L.name, n,
        mode == "scheduler" and ('scheduler = "' .. L.scheduler .. '"') or "blocking calls", c / elapsed,
        worst * 1000, p50, p99, failed)
    end
  end
  return lines
end

return _M
