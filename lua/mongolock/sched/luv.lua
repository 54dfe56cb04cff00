--- mongolock.sched.luv: a luv event loop (Debian's lua-luv) as a coroutine
-- scheduler of mongolock (connect's `scheduler` option, mongolock.sched).
--
--   local mongolock = require "mongolock"
--   local sched = require "mongolock.sched.luv"
--   local client = mongolock.connect(uri, { scheduler = "luv" })  -- or = sched
--   sched.spawn(function()
--     local h = client:locks():acquire("job")  -- yields to the loop
--     ...
--   end)
--   sched.run()                                  -- uv.run()
--
-- luv has no coroutines of its own: the loop's coroutines are the ones
-- started by spawn (and only they: a coroutine one of them creates blocks
-- as outside the loop).  Their waits are luv timers and polls on the
-- library's job descriptors and connections' sockets, so the loop's other
-- handles keep running.  One loop per process (luv's default loop).
--
-- A coroutine that raises goes to sched.on_error(message, co), whose
-- default raises the message (with the coroutine's traceback) again: from
-- spawn in the caller, from a callback in uv.run (luv's own handling).
-- @module mongolock.sched.luv

local ok, uv = pcall(require, "luv")
if not ok then
  error("mongolock.sched.luv needs the luv module (Debian: lua-luv): " .. tostring(uv), 2)
end

local coroutine, setmetatable, tostring, error = coroutine, setmetatable, tostring, error
local traceback = debug.traceback
local math_floor, math_max = math.floor, math.max

local _M = { _VERSION = "0.1.0", name = "luv", sockets = true }

-- the coroutines spawn started (weak: a finished one is collected)
local mine = setmetatable({}, { __mode = "k" })

--- What happens to a coroutine's error: raised again, with its traceback.
-- Replace it to log or collect instead.
-- @tparam string message the error and the coroutine's traceback
-- @param co the coroutine
function _M.on_error(message, co)
  local _ = co
  error(message, 0)
end

local function resume(co, ...)
  local done, err = coroutine.resume(co, ...)
  if not done then _M.on_error(traceback(co, tostring(err)), co) end
end

--- Runs fn(...) in a new coroutine of the loop, until its first wait.
-- @treturn thread the coroutine
function _M.spawn(fn, ...)
  local co = coroutine.create(fn)
  mine[co] = true
  resume(co, ...)
  return co
end

--- Runs the loop (uv.run) until nothing is left to wait for.
function _M.run(mode)
  return uv.run(mode)
end

--- true inside a coroutine started by spawn.
function _M.current()
  local co = coroutine.running()
  return co ~= nil and mine[co] == true
end

local function ms(s, least)
  return math_max(least, math_floor(s * 1000 + 0.5))
end

--- Yields the running coroutine for `s` seconds (a luv timer).
function _M.sleep(s)
  local co = coroutine.running()
  local t = uv.new_timer()
  t:start(ms(s, 0), 0, function()
    t:close()
    resume(co)
  end)
  coroutine.yield()
end

-- a poll handle per descriptor, stopped between waits and kept: a new
-- one costs libuv two system calls to check the descriptor and one to drop
-- it, at every round trip.  libuv lets a descriptor close under a stopped
-- handle, and its number polled again is a new descriptor to the kernel
local polls = {}

--- Yields until descriptor fd is readable or `s` seconds have passed.
function _M.wait_fd(fd, s)
  local co = coroutine.running()
  local p, kept = polls[fd], true
  if not p then
    p = uv.new_poll(fd)
    polls[fd] = p
  elseif p:is_active() then         -- another coroutine waits on it: a handle of its own
    p, kept = uv.new_poll(fd), false
  end
  local t = uv.new_timer()
  local woken = false
  local function wake()
    if woken then return end
    woken = true
    p:stop()
    if not kept then p:close() end
    t:stop()
    t:close()
    resume(co)
  end
  p:start("r", wake)
  t:start(ms(s, 1), 0, wake)
  coroutine.yield()
end

-- a connection's socket (wait_socket): its poll handle and timer, kept
-- from one wait to the next, the handle started, so that round trips back
-- to back cost libuv no system call to watch and unwatch it.  Between
-- waits the handle holds no reference on the loop (uv.run returns when
-- nothing else is left), and readable while nobody waits it stops until
-- the next wait.  forget stops it and keeps it for the descriptor's
-- number, as wait_fd keeps its handles
local sockets = {}

--- As wait_fd, for a connection's socket, which stays watched after it
-- returns, until forget(fd): the library calls forget before it closes
-- the socket (mongolock.sched).
function _M.wait_socket(fd, s)
  local w = sockets[fd]
  if not w then
    w = { poll = uv.new_poll(fd), timer = uv.new_timer(), started = false }
    function w.wake()
      local co = w.co
      if not co then
        w.poll:stop()
        w.started = false
        return
      end
      w.co = nil
      w.timer:stop()
      w.poll:unref()
      resume(co)
    end
    sockets[fd] = w
  elseif w.co then                  -- another coroutine waits on it
    return _M.wait_fd(fd, s)
  end
  w.co = coroutine.running()
  w.poll:ref()
  if not w.started then
    w.poll:start("r", w.wake)
    w.started = true
  end
  w.timer:start(ms(s, 1), 0, w.wake)
  coroutine.yield()
end

--- Stops watching a socket wait_socket watched (before it is closed).
function _M.forget(fd)
  local w = sockets[fd]
  if not w then return end
  -- a coroutine still waiting on it (its op is being let go of) wakes at
  -- its timer
  if w.started then
    w.poll:stop()
    w.started = false
  end
end

return _M
