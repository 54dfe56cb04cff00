-- Turns the JSON lines of one bench/run into the Markdown tables it prints
-- and the data files its gnuplot scripts read.
--
--   lua5.4 bench/report.lua RESULTS.jsonl OUTDIR
--
-- Cycle lines ({"impl","cycles","seconds","cpu","ops","failed"}, several
-- rounds per impl) are reduced to the median round by rate; the ratios are
-- against the "raw" line (bench/raw.c).  Memory lines come from
-- bench/mem.lua, the leak line from valgrind (bench/run).

local cjson = require "cjson"

local results, outdir = arg[1], arg[2]
assert(results and outdir, "usage: report.lua RESULTS.jsonl OUTDIR")

local LABEL = {
  raw = "raw libmongoc, C (ceiling)",
  ["lua5.4"] = "mongolock, Lua 5.4",
  ["lua5.4-acquire"] = "mongolock acquire (a waiter's command), Lua 5.4",
  luajit = "mongolock, LuaJIT",
  ["mongo-locks"] = "mongo-locks 3.2.0, Node (mongodb 6)",
  ["mongodb-lock"] = "mongodb-lock 1.0.1, Node (mongodb 3)",
}
local ORDER = { "raw", "lua5.4", "luajit", "lua5.4-acquire", "mongo-locks", "mongodb-lock" }

local cyc, mem, leaks = {}, {}, {}
for line in io.lines(results) do
  local ok, r = pcall(cjson.decode, line)
  if ok and type(r) == "table" then
    if r.kind == "mem" then mem[#mem + 1] = r
    elseif r.kind == "leak" then leaks[#leaks + 1] = r
    elseif r.cycles then
      cyc[r.impl] = cyc[r.impl] or {}
      table.insert(cyc[r.impl], r)
    end
  end
end

-- the median round by rate, the number of rounds, the slowest and fastest rate
local function median_round(rounds)
  -- cycles that acquired and released; a failed cycle is no cycle
  local function rate(x) return math.max(0, x.cycles - (x.failed or 0)) / x.seconds end
  table.sort(rounds, function(a, b) return rate(a) < rate(b) end)
  return rounds[math.floor((#rounds + 1) / 2)], #rounds, rate(rounds[1]), rate(rounds[#rounds])
end

local rows = {}
for _, impl in ipairs(ORDER) do
  if cyc[impl] then
    local r, n, lo, hi = median_round(cyc[impl])
    local failed = 0
    for _, x in ipairs(cyc[impl]) do failed = failed + (x.failed or 0) end
    local cpus = {}
    for _, x in ipairs(cyc[impl]) do cpus[#cpus + 1] = x.cpu / x.cycles * 1e6 end
    table.sort(cpus)
    local total = 0
    for _, x in ipairs(cyc[impl]) do total = total + x.cycles end
    rows[#rows + 1] = { impl = impl, rate = math.max(0, r.cycles - (r.failed or 0)) / r.seconds, total = total,
      cpu_us = cpus[math.floor((#cpus + 1) / 2)], rt = r.ops >= 0 and r.ops / r.cycles or nil, rounds = n,
      failed = failed, lo = lo, hi = hi }
  end
end
local raw
for _, r in ipairs(rows) do if r.impl == "raw" then raw = r end end

local out = io.stdout
out:write("### Uncontended acquire + release (one lock, one client process)\n\n")
out:write("| implementation | cycles/s | rounds' range | × raw | round trips / cycle "
  .. "| client CPU µs / cycle | CPU × raw |\n")
out:write("|---|---:|---:|---:|---:|---:|---:|\n")
for _, r in ipairs(rows) do
  out:write(string.format("| %s | %.0f | %.0f–%.0f | %s | %s | %.0f | %s |\n", LABEL[r.impl] or r.impl, r.rate,
    r.lo, r.hi,
    raw and string.format("%.2f", r.rate / raw.rate) or "-",
    r.rt and string.format("%.2f", r.rt) or "-", r.cpu_us,
    raw and string.format("%.2f", r.cpu_us / raw.cpu_us) or "-"))
end
out:write(string.format("\nMedians of %d rounds (cycles/s counts only cycles that acquired and released; "
  .. "CPU per cycle); round trips of the median round, from serverStatus opcounters deltas; CPU is user + sys "
  .. "of the client process (getrusage).\n", rows[1] and rows[1].rounds or 0))
for _, r in ipairs(rows) do
  if r.failed > 0 then
    out:write(string.format("%s: %d of %d measured cycles failed (did not acquire, or raised).\n",
      LABEL[r.impl] or r.impl, r.failed, r.total))
  end
end

if #mem > 0 then
  out:write("\n### Memory (resident set after N uncontended cycles, after a full GC)\n\n")
  out:write("| implementation | cycles | RSS | cycles | RSS | growth | Lua heap |\n")
  out:write("|---|---:|---:|---:|---:|---:|---:|\n")
  for _, m in ipairs(mem) do
    out:write(string.format("| %s | %d | %d KiB | %d | %d KiB | %+d KiB | %d → %d KiB |\n",
      LABEL[m.impl] or m.impl, m.small, m.rss_small, m.large, m.rss_large, m.rss_large - m.rss_small,
      m.lua_small, m.lua_large))
  end
end
if #leaks > 0 then
  out:write("\n### valgrind --leak-check=full (Lua 5.4, bench/mem.lua)\n\n")
  out:write("| cycles | heap in use at exit | definitely lost | indirectly lost | possibly lost | errors |\n"
    .. "|---:|---:|---:|---:|---:|---:|\n")
  for _, l in ipairs(leaks) do
    out:write(string.format("| %d | %s | %s | %s | %s | %s |\n", l.cycles, l.inuse or "-", l.definite,
      l.indirect, l.possible, l.errors))
  end
end

-- data for gnuplot: one row per implementation
local f = assert(io.open(outdir .. "/cycles.dat", "w"))
f:write("# label\tcycles_per_s\tcpu_us_per_cycle\n")
for _, r in ipairs(rows) do
  f:write(string.format("\"%s\"\t%.1f\t%.1f\n", (LABEL[r.impl] or r.impl):gsub(",.*", ""):gsub(" %d[%d.]*", "")
    .. (r.impl == "lua5.4" and " Lua 5.4" or r.impl == "luajit" and " LuaJIT" or ""), r.rate, r.cpu_us))
end
f:close()
