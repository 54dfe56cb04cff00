-- Acquire + release cycles of N coroutines of one cqueues loop, each on a
-- document of its own, with the client connected with scheduler =
-- "cqueues" (round trips in the core's worker threads, the loop never
-- blocked) against the same coroutines on a client without a scheduler
-- (every call blocks the loop: the coroutines take turns), and the worst
-- delay of a 10 ms ticker coroutine of the same loop meanwhile.
--
--   lua5.4|luajit bench/coroutines.lua [SECONDS [N,...]]    (MONGODB_URI set)
--
-- Prints a Markdown table on stdout; progress on stderr.

local mongolock = require "mongolock"
local core = require "mongolock.core"
local cqueues = require "cqueues"

local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local seconds = tonumber(arg[1]) or 3
local counts = {}
for n in (arg[2] or "1,100,1000"):gmatch("%d+") do counts[#counts + 1] = tonumber(n) end
local impl = rawget(_G, "jit") and "luajit" or "lua5.4"
local monotonic = core.monotonic

local function say(...) io.stderr:write("coroutines: ", table.concat({ ... }, " "), "\n") end

-- one measured round: n coroutines cycling for `seconds` on their own
-- documents, a ticker beside them; returns cycles, elapsed, worst tick gap,
-- failures
local function round(client, n, tag)
  local docs = client:documents("mongolock_bench", "players_" .. tag .. "_" .. core.getpid())
  local cq = cqueues.new()
  local cycles, failed, worst, running = 0, 0, 0, n
  local stop
  cq:wrap(function()
    local last = monotonic()
    while running > 0 do
      cqueues.sleep(0.01)
      local now = monotonic()
      if now - last > worst then worst = now - last end
      last = now
    end
  end)
  for i = 1, n do
    cq:wrap(function()
      -- the first lock creates the document (not counted)
      local _, h = docs:lock(i, { insert = { score = 0 } })
      if h then h:release() end
      while monotonic() < stop do
        local doc, hh = docs:lock(i)
        if doc then
          local ok = hh:release()
          if ok then cycles = cycles + 1 else failed = failed + 1 end
        else
          failed = failed + 1
        end
        cqueues.sleep(0)      -- a turn for the loop's others after each cycle
      end
      running = running - 1
    end)
  end
  local t0 = monotonic()
  stop = t0 + seconds
  assert(cq:loop())
  return cycles, monotonic() - t0, worst, failed
end

print("| N coroutines | client | cycles/s | longest gap between 10 ms ticks | failed |")
print("|---:|---|---:|---:|---:|")
for _, n in ipairs(counts) do
  for _, mode in ipairs({ "scheduler", "blocking" }) do
    local opts = { appname = "bench-coroutines" }
    if mode == "scheduler" then opts.scheduler = "cqueues" end
    local client = assert(mongolock.connect(uri, opts))
    local cycles, elapsed, worst, failed = round(client, n, mode)
    client:close()
    local line = string.format("| %d | %s | %.0f | %.1f ms | %d |", n,
      mode == "scheduler" and 'scheduler = "cqueues"' or "blocking calls", cycles / elapsed,
      worst * 1000, failed)
    say(impl, line)
    print(line)
  end
end
