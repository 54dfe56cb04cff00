-- Resident memory of a process doing uncontended acquire + release cycles
-- through mongolock: after 10^3 cycles and again after 10^5 (a leak of a
-- few bytes per cycle shows as hundreds of KiB by then).
--
--   lua5.4|luajit bench/mem.lua [CYCLES_SMALL [CYCLES_LARGE]]   (MONGODB_URI set)
--
-- Prints one JSON line: {"impl":..,"small":N,"large":N,"rss_small":KiB,
-- "rss_large":KiB,"lua_small":KiB,"lua_large":KiB,"failed":N}
-- rss_* is VmRSS from /proc/self/status after a full collection; lua_* is
-- the Lua heap (collectgarbage "count").

local mongolock = require "mongolock"
local core = require "mongolock.core"

local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local small = tonumber(arg[1]) or 1000
local large = tonumber(arg[2]) or 100000
assert(large >= small, "CYCLES_LARGE < CYCLES_SMALL")
local impl = rawget(_G, "jit") and "luajit" or "lua5.4"

local function rss_kib()
  local f = assert(io.open("/proc/self/status", "r"))
  local s = f:read("*a")
  f:close()
  return tonumber(s:match("VmRSS:%s*(%d+)"))
end

local function settle()
  collectgarbage("collect")
  collectgarbage("collect")
  return rss_kib(), math.floor(collectgarbage("count"))
end

local client = assert(mongolock.connect(uri, { appname = "bench-mem-" .. impl }))
local locks = client:locks { database = "mongolock_bench", collection = "locks" }
local name = "bench-mem-" .. impl .. "-" .. core.getpid()

local failed = 0
local function cycles(n)
  for _ = 1, n do
    local h = locks:try(name)
    if h then
      if not h:release() then failed = failed + 1 end
    else
      failed = failed + 1
    end
  end
end

cycles(small)
local rss_small, lua_small = settle()
cycles(large - small)
local rss_large, lua_large = settle()

io.write(string.format(
  '{"impl":"%s","small":%d,"large":%d,"rss_small":%d,"rss_large":%d,"lua_small":%d,"lua_large":%d,"failed":%d}\n',
  impl, small, large, rss_small, rss_large, lua_small, lua_large, failed))
client:close()
os.exit(failed == 0 and 0 or 1)
