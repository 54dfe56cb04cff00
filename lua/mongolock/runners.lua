-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.runners: where a client's round trips and the library's sleeps
-- go.  The shared code (the kinds, the acquire loop, the wait step) asks
-- here and never loads an adapter: the adapters give the client its runner
-- when they make or wrap it, as fields of the client (mongolock.connect
-- sets them):
--
--   client._ngx    inside nginx, mongolock.ngx.runner: .active() (a phase
--                  that can yield, mongolock.ngx enabled), .of(client) (the
--                  client's stand-in: each round trip a worker thread's job)
--   client._sched  connect{scheduler =}, mongolock.sched: .of(client) (the
--                  stand-in: each round trip a job of the core's thread pool
--                  while the scheduler's coroutine yields)
--
-- and a scheduler adds itself to the schedulers whose coroutines sleep
-- here (add_scheduler).

local core = require "mongolock.core"

local type = type
local pairs = pairs
local rawget = rawget
local setmetatable = setmetatable

local _M = {}

-- phases of ngx_lua in which a request can yield (ngx.sleep,
-- ngx.semaphore): the library's one table of them
_M.yieldable = {
  rewrite = true, access = true, content = true, timer = true,
  ssl_cert = true, ssl_session_fetch = true, ssl_client_hello = true,
  server_rewrite = true, preread = true,
}

-- Inside an nginx worker, in a phase that can yield, with mongolock.ngx
-- enabled: the stand-in of mongolock.ngx.runner for client; else nil.
function _M.ngx_core(client)
  local a = type(client) == "table" and rawget(client, "_ngx")
  if not a or not a.active() then return nil end
  return a.of(client)
end

-- The schedulers clients were connected with (mongolock.sched): the one
-- whose coroutine is running, if any, sleeps and waits for the library
local schedulers = setmetatable({}, { __mode = "k" })

function _M.add_scheduler(S)
  schedulers[S] = true
end

-- the scheduler whose coroutine is running (its current() is true), or nil
function _M.scheduler()
  for S in pairs(schedulers) do
    if S.current() then return S end
  end
  return nil
end

-- In a coroutine of the scheduler client was connected with
-- (connect{scheduler =}): the stand-in of mongolock.sched for client; else
-- nil.
function _M.sched_core(client)
  local S = type(client) == "table" and rawget(client, "_scheduler")
  local a = S and rawget(client, "_sched")
  if not a or not S.current() then return nil end
  return a.of(client)
end

-- where the caller can yield and round trips run elsewhere: nginx's or a
-- scheduler's stand-in of the core client; else nil
function _M.yielding_core(client)
  return _M.ngx_core(client) or _M.sched_core(client)
end

-- the core client obj's calls go to (obj: a locks, rwlocks, semaphores or
-- documents object: obj.client, obj.core)
function _M.core_of(obj)
  return _M.yielding_core(obj.client) or obj.core
end

-- ngx when running in a phase where ngx.sleep yields, else nil
function _M.cooperative()
  local ngx = rawget(_G, "ngx")
  if ngx and ngx.sleep and ngx.get_phase and _M.yieldable[ngx.get_phase()] then
    return ngx
  end
  return nil
end

-- sleeps s seconds: ngx.sleep where it yields (the worker keeps serving),
-- the scheduler's sleep in one of its coroutines, else the C core's
-- blocking sleep.  ngx.sleep counts whole milliseconds: a shorter sleep
-- is ngx.sleep(0), which an nginx without OpenResty's delayed-events patch
-- (Debian's) logs as a warning each time, so it sleeps 1 ms instead.
function _M.sleep(s)
  if s <= 0 then return end
  local ngx = _M.cooperative()
  if ngx then return ngx.sleep(s < 0.001 and 0.001 or s) end
  local S = _M.scheduler()
  if S then return S.sleep(s) end
  return core.sleep(s)
end

return _M
