--- mongolock.sched.skynet: a skynet service's coroutines as a coroutine
-- scheduler of mongolock (connect's `scheduler = "skynet"`, mongolock.sched).
--
--   local skynet = require "skynet"
--   local mongolock = require "mongolock"
--   skynet.start(function()
--     local client = assert(mongolock.connect(uri, { scheduler = "skynet" }))
--     skynet.fork(function()
--       local h = client:locks():acquire("job")  -- yields to the service
--       ...
--     end)
--   end)
--
-- The scheduler's coroutines are skynet's own: every coroutine of the
-- service but its main one (the service's chunk, before skynet.start's
-- function runs), that is skynet.start's function, message handlers and
-- skynet.fork's.  A coroutine made with coroutine.create is not skynet's:
-- use skynet.fork (or skynet.coroutine).  In the main coroutine a call
-- blocks its worker thread, as outside any scheduler.
--
-- sleep is skynet.sleep (in skynet's centiseconds, rounded up).  wait_fd
-- binds the descriptor to skynet's socket thread (socket.bind) and reads:
-- the thread reads the descriptor when it turns readable and wakes the
-- coroutine.  When the wait runs past its seconds, a skynet.timeout shuts
-- the bound id down.  Either way the wait returns only after the socket
-- thread has removed the descriptor from its epoll (its close message):
-- skynet never close()s a bound descriptor, which stays the library's.
-- A descriptor skynet cannot bind (epoll has it already: another
-- coroutine waits on it) is looked at again after a 10 ms sleep.
--
-- skynet.wakeup(co) ends whatever wait co is in, a library call's wait
-- among them (as it ends skynet.sleep): the call then looks again and goes
-- on waiting, and the wakeup is spent.  A coroutine that waits for a wakeup
-- after a library call checks a flag first (`while not done do
-- skynet.wait(co) end`).
--
-- skynet embeds Lua 5.4 and links with -Wl,-E, so the core built for Lua
-- 5.4 (build/lua5.4, or luarocks --lua-version=5.4) loads in its services.
-- @module mongolock.sched.skynet

local ok, skynet = pcall(require, "skynet")
local socket
if ok then ok, socket = pcall(require, "skynet.socket") end
if not ok then
  error("mongolock.sched.skynet needs skynet's lualib (it runs inside a skynet service): "
    .. tostring(socket or skynet), 2)
end

local coroutine = coroutine
local math_ceil, math_max, math_min = math.ceil, math.max, math.min

local _M = { _VERSION = "0.1.0", name = "skynet" }

--- the longest wait on a descriptor skynet could not bind, in seconds
_M.UNBOUND_STEP = 0.01

-- seconds as skynet's ticks (centiseconds), rounded up, at least `least`
local function ticks(s, least)
  return math_max(least, math_ceil(s * 100 - 1e-9))
end

--- true in a coroutine of the service other than its main one.
function _M.current()
  local co, main = coroutine.running()
  return co ~= nil and not main
end

--- Yields the running coroutine for `s` seconds (skynet.sleep).
function _M.sleep(s)
  if s > 0 then skynet.sleep(ticks(s, 1)) else skynet.yield() end
end

--- Yields until descriptor fd is readable or `s` seconds have passed.
function _M.wait_fd(fd, s)
  local id = socket.bind(fd)
  if not id then return _M.sleep(math_min(s, _M.UNBOUND_STEP)) end
  local w = { done = false }
  skynet.timeout(ticks(s, 1), function()
    -- shutdown, not close: close waits for the reader, shutdown only asks
    -- the socket thread, whose close message then wakes it
    if not w.done then socket.shutdown(id) end
  end)
  socket.read(id)
  w.done = true
  -- returns once the socket thread has let go of fd (its close message,
  -- here or from the shutdown above)
  socket.close(id)
end

return _M
