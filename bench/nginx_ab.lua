-- Two trees' nginx cycles, side by side: one uncontended resty.mongolock
-- lock + unlock in a handler, in an nginx on tree A and another on tree B
-- (each its own lua/ and build/), both on one server, requests of N cycles
-- alternating between them for ROUNDS rounds.  Per round each worker gives
-- its CPU (os.clock) and wall time per cycle; the table is the median and
-- range of B/A over the rounds.  Alternating in one run is what shows a
-- change of a few percent on a shared machine, where separate runs of
-- bench/nginx.lua differ by more than that (A against A is the control).
-- Not part of make bench: it compares a change with what came before.
--
--   lua5.4 bench/nginx_ab.lua TREE_A TREE_B [ROUNDS [N]]     (MONGODB_URI set;
--     LUA_PATH with lua/ and spec/ of either tree; both trees built)
local nx = require "nginx_helpers"

local format = string.format
local A_ROOT, B_ROOT = arg[1], arg[2]
if not A_ROOT or not B_ROOT then
  io.stderr:write("usage: lua5.4 bench/nginx_ab.lua TREE_A TREE_B [ROUNDS [N]]\n")
  os.exit(2)
end
local ROUNDS, N = tonumber(arg[3]) or 12, tonumber(arg[4]) or 2000

local HANDLER = [==[
local resty = require "resty.mongolock"
local core = require "mongolock.core"
local lock = assert(resty:new({ uri = os.getenv("MONGODB_URI"), collection = "nginx_ab_bench" }))
local key = "ab-" .. core.getpid()
local n = tonumber(ngx.var.arg_n)
for _ = 1, 20 do assert(lock:lock(key)); assert(lock:unlock()) end   -- connections, index, JIT
local c0, t0 = os.clock(), core.monotonic()
for _ = 1, n do assert(lock:lock(key)); assert(lock:unlock()) end
ngx.say(string.format("%.3f %.3f", (os.clock() - c0) / n * 1e6, (core.monotonic() - t0) / n * 1e6))
]==]
local LOCATION = "        location = /ab { content_by_lua_file ab.lua; }\n"

local function say(...) io.stderr:write("bench: ", format(...), "\n") end

local function median(t)
  table.sort(t)
  local k = #t
  return k % 2 == 1 and t[(k + 1) / 2] or (t[k / 2] + t[k / 2 + 1]) / 2
end

local function range(t)
  table.sort(t)
  return format("%.2f-%.2f", t[1], t[#t])
end

-- us of CPU and of wall time per cycle in x's worker
local function cycles(x)
  local code, body = nx.get(x.port, "/ab?n=" .. N)
  assert(code == 200, body)
  local c, w = body:match("^([%d.]+) ([%d.]+)")
  return assert(tonumber(c), body), tonumber(w)
end

local a = nx.start({ root = A_ROOT, locations = LOCATION, files = { ["ab.lua"] = HANDLER } })
local ok, b = pcall(nx.start, { root = B_ROOT, locations = LOCATION, files = { ["ab.lua"] = HANDLER } })
if not ok then
  a:stop()
  error(b, 0)
end
local ok2, err = pcall(function()
  cycles(a)
  cycles(b)
  local cpu, wall, ac, bc, aw, bw = {}, {}, {}, {}, {}, {}
  for r = 1, ROUNDS do
    local ca, wa, cb, wb
    if r % 2 == 1 then
      ca, wa = cycles(a)
      cb, wb = cycles(b)
    else
      cb, wb = cycles(b)
      ca, wa = cycles(a)
    end
    cpu[r], wall[r] = cb / ca, wb / wa
    ac[r], bc[r], aw[r], bw[r] = ca, cb, wa, wb
    say("round %d: A %.0f us CPU, %.0f us wall; B %.0f, %.0f", r, ca, wa, cb, wb)
  end
  print(format("| %d rounds of %d cycles | B/A CPU per cycle | B/A wall per cycle |", ROUNDS, N))
  print("|---|---:|---:|")
  print(format("| median (range) | %.3f (%s) | %.3f (%s) |", median(cpu), range(cpu), median(wall), range(wall)))
  print(format("| A, B medians (us) | %.0f, %.0f | %.0f, %.0f |", median(ac), median(bc), median(aw), median(bw)))
end)
a:stop()
b:stop()
if not ok2 then error(err, 0) end
