--- mongolock.sched.copas: Copas (LuaSocket's coroutine scheduler, 4.x) as a
-- coroutine scheduler of mongolock (connect's `scheduler = "copas"`,
-- mongolock.sched).
--
--   local copas = require "copas"
--   local mongolock = require "mongolock"
--   local client = assert(mongolock.connect(uri, { scheduler = "copas" }))
--   copas.addthread(function()
--     local h = client:locks():acquire("job")  -- yields to the loop
--     ...
--   end)
--   copas.loop()
--
-- The scheduler's coroutines are Copas' while copas.loop runs
-- (copas.running): its threads (addthread) and its servers' handlers.
-- Outside copas.loop (a loop driven by copas.step alone, the main
-- coroutine) a call blocks, as outside any scheduler.
--
-- sleep is copas.pause.  wait_fd hands copas.receive an object with
-- getfd (LuaSocket's select takes any such object) and a receive timeout
-- of the wait's seconds: Copas' select wakes the coroutine once the
-- descriptor is readable, its timer once the seconds have passed.  select
-- cannot watch descriptors from FD_SETSIZE (1024) up: those are looked at
-- again after a pause of at most 5 ms.
-- @module mongolock.sched.copas

local ok, copas = pcall(require, "copas")
if not ok then
  error("mongolock.sched.copas needs Copas 4 (LuaRocks: copas): " .. tostring(copas), 2)
end

local coroutine, setmetatable = coroutine, setmetatable
local math_min = math.min

local _M = { _VERSION = "0.1.0", name = "copas", sockets = true }

--- descriptors from this one up are polled (LuaSocket's select: FD_SETSIZE)
_M.FD_SETSIZE = 1024
--- the longest pause between two looks at a polled descriptor, in seconds
_M.POLL_STEP = 0.005

--- true in a coroutine of Copas while copas.loop runs.
function _M.current()
  if not copas.running then return false end
  local co, main = coroutine.running()
  return co ~= nil and not main
end

--- Yields the running coroutine for `s` seconds (copas.pause).
function _M.sleep(s)
  copas.pause(s)
end

-- a descriptor as the socket copas.receive waits for: its first receive
-- has nothing yet (Copas then selects it), any later one answers (woken
-- by select or by the timeout: the library looks again either way)
local Waiter = {}
Waiter.__index = Waiter
function Waiter:getfd() return self.fd end
function Waiter:receive()
  if self.looked then return "" end
  self.looked = true
  return nil, "timeout"
end
function Waiter.settimeout() return 1 end

--- Yields until descriptor fd is readable or `s` seconds have passed.
function _M.wait_fd(fd, s)
  if fd >= _M.FD_SETSIZE then return copas.pause(math_min(s, _M.POLL_STEP)) end
  local w = setmetatable({ fd = fd, looked = false }, Waiter)
  copas.settimeout(w, s)
  copas.receive(w, "*a")
end

return _M
