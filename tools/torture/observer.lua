-- The torture's observer (--kind election): follows the election with
-- el:observe until the stop file appears, and logs every change it returns:
--
--   observer.lua LOG NAME STOPFILE                         (MONGODB_URI set)
--
--   O token change time value      token 0 and value "-" when nobody leads;
--                                  time: CLOCK_MONOTONIC when it was returned
--   E pid message                  the observer failed (it goes on)

local mongolock = require "mongolock"
local core = require "mongolock.core"

local logpath, name, stopfile = arg[1], arg[2], arg[3]
assert(logpath and name and stopfile, "usage: observer.lua LOG NAME STOPFILE")
local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local pid = core.getpid()

local log = assert(io.open(logpath, "a"))
log:setvbuf("full", 4096)
local function emit(fmt, ...)
  log:write(string.format(fmt, ...))
  log:flush()
end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() end
  return f ~= nil
end

local client = assert(mongolock.connect(uri, { appname = "torture-observer" }))
local el = client:elections { database = "mongolock_torture", collection = "locks" }
local it = el:observe(name, { timeout = 0.5 })
io.stdout:write("ready ", pid, "\n")
io.stdout:flush()
while not exists(stopfile) do
  local ch, err = it()
  if ch then
    emit("O %s %s %.6f %s\n", ch.leader and string.format("%.0f", ch.token) or "0", ch.change,
      core.monotonic(), ch.leader and tostring(ch.value or "-"):gsub("%s", "_") or "-")
  elseif err ~= "timeout" then
    emit("E %d observer: %s\n", pid, tostring(err):gsub("%s+", " "))
    core.sleep(0.1)
  end
end
it:close()
client:close()
