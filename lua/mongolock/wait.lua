-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- Waiting between attempts: change-stream wake-ups, with backoff polling
-- (mongolock.backoff) as the fallback.
--
-- The acquire loop (mongolock.locks) calls wait.sleep_until_retry(state)
-- after every failed attempt; state is described in mongolock.backoff.
-- state.opts.wait picks the strategy:
--
--   "auto"   (default) a change stream when the server has them (a replica
--            set: the failed attempt's reply carries an operationTime),
--            else, or when the stream fails, backoff polling
--   "watch"  a change stream only; when there is none the wait step
--            returns nil, message, code and acquire returns them
--   "poll"   backoff polling only (step, ratio, max_step)
--
-- With a stream the waiter sleeps until its lock is released (an event
-- after the operation time of its failed attempt, so a release between the
-- attempt and the wait is never missed), until the holder's lease ends
-- (the server's remaining time from the same reply: an expiry makes no
-- event), or until the caller's deadline, whichever comes first.  One
-- stream per process and collection serves every waiter (csrc/binding/watch.c).
--
-- Order: acquire queues in the lock document (doc/design.md): waiters
-- take the lock in the order of their first attempt, and a release is
-- handed to the first live waiter alone (its id in the document's next),
-- so it wakes one waiter in one process, not all of them.  A waiter comes
-- back at state.refresh_at, before its place lapses (queue_ttl); one that
-- stops coming back (a crashed process) loses its place after queue_ttl.
-- Only the first in line wakes at the holder's lease end.  A release to a
-- watching waiter grants it the lock in the same write: the wait step then
-- sets state.granted = {token} and the loop makes the handle from it.
--
-- Inside OpenResty (a phase where ngx.sleep yields) with round trips in
-- worker threads (mongolock.ngx) the client's streams are read by the
-- worker (mongolock.ngx.runner: each getMore a job) and the waiter looks at
-- its stream each time a reply came (an ngx.semaphore); where round trips
-- stay on the event loop (configure{enabled = false}) the process's stream
-- (a thread) is looked at without blocking, between cooperative ngx.sleep
-- steps of 1 to 20 ms; so it is in a coroutine of a scheduler other than
-- the client's own (with that scheduler's sleep).  In a coroutine of the
-- client's scheduler (connect{scheduler =}, mongolock.sched) the stream's
-- thread writes the coroutine's descriptor, which the scheduler's wait_fd
-- watches.  Elsewhere the calling thread blocks in C until woken.

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"
local backoff = require "mongolock.backoff"

local type = type
local math_min = math.min
local monotonic = core.monotonic
local watch_wait = core.watch_wait
local cooperative = runners.cooperative

local _M = {
  _VERSION = "0.1.0",
  modes = { auto = true, watch = true, poll = true },
  default = "auto",
  -- after this many "retry" answers in a row (the shared stream started
  -- after the attempt), one backoff step is taken instead
  max_retries = 3,
}

-- raises at the caller's caller unless mode is a wait strategy
function _M.check_mode(mode, argn, fname, level)
  if mode == nil then return nil end
  if type(mode) ~= "string" or not _M.modes[mode] then
    args.argerror(argn, fname, ('wait must be "auto", "watch" or "poll", got %s')
      :format(type(mode) == "string" and ("%q"):format(mode) or type(mode)), (level or 2) + 1)
  end
  return mode
end

-- the stream's answer within `seconds`: "event" | "timeout" | "retry" |
-- nil, message, code
local function watch(state, ot, seconds)
  local locks = state.locks
  local cc, db, coll, field, id = locks.core, locks.database, locks.collection, state.field or "owner",
    state.name
  local waiter = state.waiter
  local ngx = cooperative()
  -- in a coroutine of the client's scheduler: woken through its descriptor
  -- (mongolock.sched)
  local sc = not ngx and runners.sched_core(locks.client)
  if sc and sc.watch then return sc.watch(cc, db, coll, field, id, ot.t, ot.i, seconds, waiter) end
  local S = not ngx and runners.scheduler()
  if not ngx and not S then
    return watch_wait(cc, db, coll, field, id, ot.t, ot.i, seconds, waiter)
  end
  -- the client's stream looked at without blocking, between sleeps: inside
  -- nginx with worker threads, until the worker's adapter took a reply of
  -- the stream (mongolock.ngx.runner); else the loop's own sleeps (nginx's
  -- or a scheduler's)
  local nc = ngx and runners.ngx_core(locks.client)
  if nc and ngx.worker.exiting() then return nil, "change stream: nginx worker exiting" end
  -- (runners.sleep: nginx's or the scheduler's, never an ngx.sleep
  -- shorter than nginx's millisecond)
  local sleep = runners.sleep
  local stop = monotonic() + seconds
  local step = 0.001
  while true do
    local res, err, code = watch_wait(cc, db, coll, field, id, ot.t, ot.i, 0, waiter)
    if res ~= "timeout" then return res, err, code end
    local left = stop - monotonic()
    if left <= 0 then return "timeout" end
    if nc then
      nc.await_event(math_min(left, 0.25))
    else
      sleep(math_min(step, left))
      step = math_min(step * 2, 0.02)
    end
  end
end

-- true when the next attempt should be made; nil, message, code when
-- wait = "watch" and no stream can be had
function _M.sleep_until_retry(state)
  local opts = state.opts or {}
  local mode = opts.wait or _M.default
  if mode == "poll" then
    backoff.sleep_until_retry(state)
    return true
  end
  local info = state.info
  local ot = info and info.operation_time
  local why = "change streams need a replica set (the server sent no operationTime)"
  if not ot then
    if mode == "watch" then return nil, why end
    backoff.sleep_until_retry(state)
    return true
  end
  local now = monotonic()
  local left = state.deadline - now
  -- a queued waiter comes back before its place lapses
  if state.refresh_at then left = math_min(left, state.refresh_at - now) end
  if left <= 0 then return true end
  local remaining = info.remaining
  local position = info.position
  -- a name in its lock-delay is free at the delay's end instead
  if type(info.delay) == "number" then remaining = info.delay end
  if type(remaining) == "number" and remaining >= 0 and (position == nil or position == 1) then
    -- the holder's lease ends then (no event marks it); a millisecond
    -- later the server is sure to see it expired
    left = math_min(left, remaining + 0.001)
  end
  local res, err, code = watch(state, ot, left)
  if res == nil then
    if mode == "watch" then return nil, err, code end
    backoff.sleep_until_retry(state)
    return true
  end
  state.polling = false
  if res == "granted" then
    -- the release granted the lock to this waiter in the same write: its
    -- token came with the event, no attempt is needed
    state.granted = { token = err }
  elseif res == "retry" then
    state.retries = (state.retries or 0) + 1
    if state.retries > _M.max_retries then
      state.retries = 0
      backoff.sleep_until_retry(state)
    end
  else
    state.retries = 0
  end
  return true
end

return _M
