-- Uncontended acquire + release cycles through mongolock, the figure to
-- hold against bench/raw.c (the same two commands from C).
--
--   lua5.4|luajit bench/cycles.lua [SECONDS [WARMUP]]     (MONGODB_URI set)
--
-- The cycle takes the lock with locks:try, the same command bench/raw.c
-- sends; CALL=acquire takes it with locks:acquire instead (the command of
-- a waiter's attempt: it carries the waiter id, so it costs a little more
-- to build), and names the line "<impl>-acquire".
--
-- Prints one JSON line, the same fields as bench/raw.c:
--   {"impl":"lua5.4","cycles":N,"seconds":S,"cpu":S,"ops":N,"failed":N}
-- cpu is os.clock(): glibc's clock() is CLOCK_PROCESS_CPUTIME_ID, user +
-- sys of every thread of the process (the driver's monitor included).
-- ops is the serverStatus opcounters delta over the measured cycles, less
-- the closing serverStatus itself.

local mongolock = require "mongolock"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local seconds = tonumber(arg[1]) or 5
local warmup = tonumber(arg[2]) or 200
local call = os.getenv("CALL") or "try"
assert(call == "try" or call == "acquire", "CALL must be try or acquire")
local impl = (rawget(_G, "jit") and "luajit" or "lua5.4") .. (call == "acquire" and "-acquire" or "")

local client = assert(mongolock.connect(uri, { appname = "bench-" .. impl }))
local locks = client:locks { database = "mongolock_bench", collection = "locks" }
local name = "bench-" .. impl .. "-" .. core.getpid()

local failed = 0
local function cycle()
  local h, err = locks[call](locks, name)
  if not h then
    failed = failed + 1
    io.stderr:write("cycles: acquire: ", tostring(err), "\n")
    return
  end
  local ok, rerr = h:release()
  if not ok then
    failed = failed + 1
    io.stderr:write("cycles: release: ", tostring(rerr), "\n")
  end
end

local function ops()
  local oc = assert(testing.opcounters(client._core))
  local t = 0
  for _, k in ipairs { "insert", "query", "update", "delete", "getmore", "command" } do
    t = t + (oc[k] or 0)
  end
  return t
end

for _ = 1, warmup do cycle() end

local monotonic, clock = core.monotonic, os.clock
local o0 = ops()
local c0, t0 = clock(), monotonic()
local n, t1 = 0
repeat
  for _ = 1, 64 do cycle() end
  n = n + 64
  t1 = monotonic()
until t1 - t0 >= seconds
local c1 = clock()
local o1 = ops()

io.write(string.format(
  '{"impl":"%s","cycles":%d,"seconds":%.6f,"cpu":%.6f,"ops":%d,"failed":%d}\n',
  impl, n, t1 - t0, c1 - c0, o1 - o0 - 1, failed))
client:close()
os.exit(failed == 0 and 0 or 1)
