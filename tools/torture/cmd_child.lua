-- The command a --command torture worker's mongolock runs (cmd_worker.lua):
-- it cannot check its lease, so every act it logs claims to be valid; only
-- the command's end of a lease (SIGKILL before the lease's end, doc/command.md)
-- keeps its acts from overlapping the next holder's.
--
--   cmd_child.lua LOG HOLD_MS MAX_HOLD_S   (MONGOLOCK_TOKEN set; TORTURE_MODE x or l)
--
-- Appends M token mode, A token start pid, then S token start end pid 1 per act.

local core = require "mongolock.core"

local logpath, hold_ms, max_hold = arg[1], tonumber(arg[2]), tonumber(arg[3])
local token = assert(os.getenv("MONGOLOCK_TOKEN"), "MONGOLOCK_TOKEN is not set")
local mode = os.getenv("TORTURE_MODE") or "x"
local monotonic, sleep, random = core.monotonic, core.sleep, math.random
local pid = core.getpid()
math.randomseed(pid * 7919 + math.floor(monotonic() * 1000) % 100000)

local log = assert(io.open(logpath, "a"))
log:setvbuf("full", 4096)
local function emit(fmt, ...)
  log:write(string.format(fmt, ...))
  log:flush()
end

local start = monotonic()
emit("M %s %s\n", token, mode)
emit("A %s %.6f %d\n", token, start, pid)
local stop_at = start + random() * max_hold
repeat
  local from = monotonic()
  sleep(random() * hold_ms / 1000)
  emit("S %s %.6f %.6f %d 1\n", token, from, monotonic(), pid)
until monotonic() >= stop_at
