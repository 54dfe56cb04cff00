-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.sched: waiting inside a coroutine scheduler without blocking
-- its loop.
--
--   local client = mongolock.connect(uri, { scheduler = "cqueues" })
--   local client = mongolock.connect(uri, { scheduler = "luv" })  -- mongolock.sched.luv
--   local client = mongolock.connect(uri, { scheduler = "skynet" })  -- mongolock.sched.skynet
--   local client = mongolock.connect(uri, { scheduler = "copas" })  -- mongolock.sched.copas
--   local client = mongolock.connect(uri, { scheduler = S })  -- any loop
--
-- Inside a coroutine of the scheduler every round trip of the client runs
-- in a thread of the core's pool (core.pool: its own libmongoc pool on the
-- client's URI, write concern and options) while the coroutine waits on
-- its descriptor (core.signal: one eventfd per coroutine, written when its
-- job ends or its stream read something), and every sleep is the
-- scheduler's: the loop's other coroutines keep running.  The calls are mongolock.yielding's
-- stand-in of the core client (the C client's ops and tails), so a won
-- attempt is the same mongolock.Lock as everywhere.  Outside such a
-- coroutine the same client blocks as it always did.
--
-- A scheduler S is a table of three functions (the library's whole need):
--
--   S.current()        true when the running coroutine is one of the loop's
--                      and may yield to it (else the call blocks)
--   S.sleep(seconds)   yields the running coroutine for that long
--   S.wait_fd(fd, seconds)
--                      yields until the descriptor fd is readable or the
--                      seconds have passed, whichever comes first (waking
--                      early is harmless: the library looks again)
--
-- and may say (the built-in cqueues, luv and Copas adapters do)
--
--   S.sockets = true   wait_fd only watches the descriptor, never reads
--                      it: the library may then give it a connection's
--                      socket, and runs a round trip in the loop's own
--                      thread (pool:here, csrc/driver/fiber.h) rather than
--                      in a worker thread
--
-- and, with sockets, may keep a socket watched from one wait to the next
-- (the built-in cqueues and luv adapters do: a round trip then costs the
-- loop no system call to watch and unwatch it):
--
--   S.wait_socket(fd, seconds)
--                      as wait_fd, for a connection's socket, which it may
--                      leave watched when it returns
--   S.forget(fd)       stops watching fd.  The library calls it before it
--                      closes a socket it gave to wait_socket (a dead
--                      connection's socket stays open until then: the
--                      pool's graves, pool:bury), and for every such socket
--                      when the client closes or is collected
--
-- "cqueues" is built in (below), "luv", "skynet" and "copas" are
-- mongolock.sched.luv, .skynet and .copas.  What stays
-- off the loop: the lease engine (renewal in batches, grant top-ups,
-- releases of collected handles) runs in the client's own background
-- thread as outside a scheduler; change-stream wake-ups come from the
-- process's stream (csrc/binding/watch.c, its own thread), which writes
-- the waiting coroutine's descriptor when it read something: the
-- coroutine wakes on the event, and looks again (without blocking).
--
-- Invariants:
-- - One pool per client and process (a forked child makes its own); the
--   client's close closes it, its collection too.
-- - A coroutine waits for the reply of every round trip it started (as a
--   blocking call does): no attempt's outcome is left to nobody while the
--   coroutine runs.  A coroutine abandoned by its scheduler mid-wait (never
--   resumed, collected) lets go of its job: a lock it may have won then
--   ends with its lease (ttl), as a killed process's does.

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"
local yielding = require "mongolock.yielding"

local type, pcall, rawget, rawset, tostring = type, pcall, rawget, rawset, tostring
local setmetatable = setmetatable
local co_running = coroutine.running
local math_min = math.min
-- this process's id without a system call (core.pid: taken again at fork)
local getpid = core.pid
local monotonic = core.monotonic
local watch_wait = core.watch_wait
local new_signal = core.signal

local _M = {
  _VERSION = "0.1.0",
  THREADS = 8,        -- worker threads per client and process (connect's threads)
  THREADS_MAX = 256,
  -- the longest single wait on a job's descriptor: a scheduler that
  -- missed the wake-up looks again then
  LOOK_AGAIN = 1,
}

-- ---- built-in adapters --------------------------------------------------------

local builtin = {}

-- cqueues (Debian's lua-cqueues): a coroutine of a controller's wrap, not
-- nested in another coroutine (cqueues.running's second value)
function builtin.cqueues()
  local ok, cqueues = pcall(require, "cqueues")
  if not ok then
    return nil, 'scheduler "cqueues" needs the cqueues module (Debian: lua-cqueues): ' .. tostring(cqueues)
  end
  local S = { name = "cqueues", sockets = true }
  function S.current()
    local _, inside = cqueues.running()
    return inside == true
  end
  function S.sleep(s) cqueues.sleep(s) end
  function S.wait_fd(fd, s)
    cqueues.poll({ pollfd = fd, events = "r" }, s)
    -- cqueues keeps a descriptor it polled registered; the library closes
    -- a job's descriptor once taken, and a new one may get its number
    cqueues.cancel(fd)
  end
  -- a socket stays registered until the coroutine yields without polling
  -- it again (cqueues drops it then) or forget: round trips back to back
  -- make no epoll_ctl.  One poll table per descriptor
  local polls = {}
  function S.wait_socket(fd, s)
    local p = polls[fd]
    if not p then
      p = { pollfd = fd, events = "r" }
      polls[fd] = p
    end
    cqueues.poll(p, s)
  end
  function S.forget(fd) cqueues.cancel(fd) end
  return S
end

-- luv (Debian's lua-luv): the coroutines of mongolock.sched.luv's spawn
function builtin.luv()
  local ok, S = pcall(require, "mongolock.sched.luv")
  if not ok then return nil, 'scheduler "luv" needs ' .. tostring(S):gsub("^mongolock.sched.luv needs ", "") end
  return S
end

-- skynet (a service's coroutines, mongolock.sched.skynet) and Copas 4
-- (mongolock.sched.copas): each module says what it needs when missing
local function module_adapter(name)
  return function()
    local mod = "mongolock.sched." .. name
    local ok, S = pcall(require, mod)
    if not ok then
      local msg = tostring(S)
      local at = msg:find(mod .. " needs ", 1, true)
      if at then msg = msg:sub(at + #mod + 7) end
      return nil, 'scheduler "' .. name .. '" needs ' .. msg
    end
    return S
  end
end
builtin.skynet = module_adapter("skynet")
builtin.copas = module_adapter("copas")

local made = {}

-- the scheduler connect's option names (raises at connect's caller)
function _M.check(S, n, fname, level)
  level = (level or 2) + 1
  if type(S) == "string" and builtin[S] then
    if not made[S] then
      local adapter, err = builtin[S]()
      if not adapter then args.argerror(n, fname, err, level) end
      made[S] = adapter
    end
    S = made[S]
  elseif type(S) ~= "table" then
    args.argerror(n, fname, 'scheduler: "cqueues", "luv", "skynet", "copas" or a table expected, got '
      .. (type(S) == "string" and args.shown(S) or type(S)), level)
  end
  for _, k in ipairs({ "current", "sleep", "wait_fd" }) do
    if type(S[k]) ~= "function" then
      args.argerror(n, fname, "scheduler: " .. k .. " must be a function", level)
    end
  end
  runners.add_scheduler(S)
  return S
end

-- ---- the runner -----------------------------------------------------------------

-- the running coroutine's signal in signals (core.signal: an eventfd that
-- its jobs and the stream it waits on write), or nil when no eventfd can
-- be had.  signals is the runner's (one per process, as its pool: a forked
-- child's coroutines do not share their parent's eventfds); weak: a
-- collected coroutine's is closed by its own collection
local function signal_of(signals)
  local co = co_running()
  local sig = signals[co]
  if sig then return sig end
  sig = new_signal()
  if sig then signals[co] = sig end
  return sig
end

-- runs op (a string, or with sockets an attempt) in the loop's thread or a
-- thread of pool; the coroutine waits on S (mongolock.yielding documents
-- runners).  The caller's deadline is not used: as a blocking
-- call, the coroutine waits for the reply, which the client's server
-- bound limits.
local function runner_of(S, pool)
  local wait_fd = S.wait_fd
  local signals = setmetatable({}, { __mode = "k" })
  -- the job's end is written to the coroutine's signal; a write left from
  -- before (a stream's) only wakes it early, and it looks again
  local here = S.sockets == true
  -- a loop that keeps sockets watched (S.wait_socket, S.forget): the
  -- sockets it may watch (armed), each forgotten before it is closed
  local keep = here and S.wait_socket and S.forget and true or false
  local wait_socket = keep and S.wait_socket or wait_fd
  local armed = {}
  if keep then
    local forget = S.forget
    pool:keep({
      forget = function(fd)
        armed[fd] = nil
        forget(fd)
      end,
      close = function()
        for fd in pairs(armed) do forget(fd) end
        armed = {}
      end,
    })
  end
  local function run(op)
    -- in the loop's thread when it can be (no TLS, a server known to take
    -- writes, a connection and a stack to spare), else in a worker thread
    local h = here and pool:here(op)
    if h then
      while true do
        local a, b, c, d, e = h:step()
        if a ~= false then
          if keep then pool:bury() end
          return a, b, c, d, e
        end
        if not b then break end       -- it did not apply: a worker thread runs it
        if keep then armed[b] = true end
        wait_socket(b, c and math_min(c, _M.LOOK_AGAIN) or _M.LOOK_AGAIN)
      end
      if keep then pool:bury() end
    end
    -- an attempt (runner.attempts) that did not run here is prepared
    -- again: a worker thread takes its op
    if type(op) ~= "string" then op = op:op() end
    local sig = signal_of(signals)
    local job, err = pool:submit(op, sig)
    if not job then return nil, err end
    local fd = job:fd()
    while true do
      local a, b, c, d, e = job:take()
      if a ~= false then return a, b, c, d, e end
      wait_fd(fd, _M.LOOK_AGAIN)
      if sig then sig:clear() end
    end
  end
  -- change-stream wake-ups (mongolock.wait): core.watch_wait's answer
  -- within `seconds`; the stream writes the coroutine's signal when it
  -- read something, and the coroutine looks again
  local function watch(cc, db, coll, field, id, t, i, seconds, waiter)
    local sig = signal_of(signals)
    if not sig then return nil, "change stream: no descriptor to wait on" end
    local stop = monotonic() + seconds
    sig:clear()
    while true do
      local left = stop - monotonic()
      if left < 0 then left = 0 end
      local res, err, code = watch_wait(cc, db, coll, field, id, t, i, left, waiter, sig)
      if res ~= "timeout" then return res, err, code end
      if left <= 0 then return "timeout" end
      wait_fd(sig:fd(), math_min(left, _M.LOOK_AGAIN))
      sig:clear()
    end
  end
  return {
    active = function() return S.current() and true or false end,
    run = run,
    -- an attempt's op is built into pool:here's memory, not a Lua string
    attempts = here,
    watch = watch,
    -- sent, nobody waits: the op runs, its outcome is dropped
    send = function(op)
      local job = pool:submit(op, false)
      if job then job:close() end
    end,
  }
end

-- the stand-in for client (connected with a scheduler) in this process, or
-- nil when no pool can be had (a closed client: its own methods say so);
-- mongolock.runners.sched_core asks for it in the scheduler's coroutines
function _M.of(client)
  local p = rawget(client, "_sched_core")
  local pid = getpid()
  if p and p.pid == pid then return p end
  local cc = client._core
  if cc:closed() then return nil end
  local ok, pool = pcall(core.pool, cc, client._threads or _M.THREADS)
  if not ok or not pool then return nil end
  local runner = runner_of(client._scheduler, pool)
  p = yielding.new(cc, runner, { pool = pool, watch = runner.watch })
  rawset(client, "_sched_core", p)
  if cc.set_methods and core.lease_step then
    -- the handles' release, extend and close yield too; the lease engine
    -- stays the client's own thread (not external)
    cc:set_methods(yielding.lease_methods({ active = runner.active, run = runner.run, count = p.count }))
  end
  return p
end

-- gives client (connect{scheduler =}) this runner (mongolock.runners)
function _M.attach(client)
  rawset(client, "_sched", _M)
end

-- closes client's pool in this process (the client's close)
function _M.close(client)
  local p = rawget(client, "_sched_core")
  if p and p.pid == getpid() then p.pool:close() end
end

return _M
