-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- Waiting between attempts: exponential backoff with jitter, in the spirit
-- of lua-resty-lock (step 1 ms, ratio 2, max_step 0.5 s), that never sleeps
-- past the holder's known expiry or the caller's deadline.
--
-- The acquire loop (mongolock.locks) calls wait.sleep_until_retry(state)
-- after every failed attempt through mongolock.wait, which falls back to
-- this module when no change stream serves.  state:
--   state.locks        the locks object
--   state.name         the lock name
--   state.attempt      attempts made so far (>= 1)
--   state.step         the current backoff step in seconds (this module
--                      advances it; others may ignore it)
--   state.deadline     monotonic time (core.monotonic()) the caller gives up
--   state.info         the failed attempt's reply: owner, token,
--                      remaining (holder's seconds left by the server's
--                      clock), operation_time {t=, i=}
--   state.refresh_at   monotonic time a queued waiter must attempt again
--                      by, to keep its place
--   state.polling      set here: the next attempt is a polling waiter's
--   state.opts         the acquire options (step, ratio, max_step)
-- sleep_until_retry returns (nothing) when the next attempt should be made;
-- it never sleeps past state.deadline.  A wait step that cannot wait returns
-- nil, message[, code], and acquire returns those.

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"

local math_min = math.min
local math_max = math.max
local random = core.random

local _M = {
  _VERSION = "0.1.0",
  defaults = args.backoff,   -- step 0.001 s, ratio 2, max_step 0.5 s
}

-- sleep(s): ngx.sleep inside a yieldable OpenResty phase (the worker keeps
-- serving), else the C core's blocking sleep.
_M.sleep = runners.sleep

-- The delay before the next attempt, and the step after it.
--   step      current step (s), ratio, max_step: the backoff parameters
--   remaining the holder's seconds left (nil when unknown)
--   left      seconds until the caller's deadline
--   r         a random number in [0, 1) (jitter)
-- delay = step * (0.5 + r/2) ("equal jitter"), capped by remaining and by
-- left; the next step is min(step * ratio, max_step).
function _M.delay(step, ratio, max_step, remaining, left, r)
  local d = step * (0.5 + 0.5 * r)
  if remaining and remaining >= 0 then d = math_min(d, remaining) end
  d = math_max(0, math_min(d, left))
  return d, math_min(step * ratio, max_step)
end

function _M.sleep_until_retry(state)
  local opts = state.opts or {}
  local defaults = _M.defaults
  local info = state.info
  -- a waiter that polls says so in its queue entry (mongolock.locks): it
  -- cannot be woken, and holds no watching waiter up
  state.polling = true
  local step = state.step or opts.step or defaults.step
  local now = core.monotonic()
  local left = state.deadline - now
  -- a queued waiter comes back before its place lapses
  if state.refresh_at then left = math_min(left, state.refresh_at - now) end
  -- never past the holder's lease end; a lock that is free already but
  -- went to a waiter ahead (remaining 0) is no reason to hurry
  local remaining = info and (info.delay or info.remaining)
  if not (type(remaining) == "number" and remaining > 0) then remaining = nil end
  local d, nxt = _M.delay(step, opts.ratio or defaults.ratio, opts.max_step or defaults.max_step,
    remaining, left, random())
  state.step = nxt
  _M.sleep(d)
end

return _M
