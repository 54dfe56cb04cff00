-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.loop: the one acquire loop of named locks, shared kinds and
-- document locks (deadlines, waits for a server, retries after transient
-- failures, the counters, a waiter's give-up), and the end of every kind's
-- with.

local core = require "mongolock.core"
local errors = require "mongolock.errors"
local runners = require "mongolock.runners"
local stats = require "mongolock.stats"

local error = error
local pcall = pcall
local select = select
local table_unpack = table.unpack or rawget(_G, "unpack")
local table_pack = table.pack or function(...) return { n = select("#", ...), ... } end
local math_min = math.min
local monotonic = core.monotonic
local core_of = runners.core_of
local transient = errors.transient
local network_error = errors.network_error
local NO_SERVER, NO_SERVER_CODE = errors.NO_SERVER, errors.NO_SERVER_CODE

local _M = {}

-- backoff between attempts that failed transiently: 50 ms, doubling, at
-- most 1 s (an election takes 2 to 12 s)
_M.outage_backoff = { step = 0.05, ratio = 2, max_step = 1 }

-- Waits until the client's monitors know a writable server (true), or until
-- `until_` (monotonic) passes (false).  No round trip here: an attempt
-- started now would block in server selection for up to the client's
-- server_timeout, past a caller's deadline.  The background thread is asked
-- for that selection instead (client:request_scan): after a connection
-- error libmongoc's monitors would otherwise look at the server again only
-- after their heartbeat (10 s), and a live server would stay unknown.
local function await_server(core_client, until_)
  local step = 0.002
  while true do
    if core_client:closed() then return true end      -- the attempt says "closed"
    if core_client:writable() then return true end
    local left = until_ - monotonic()
    if left <= 0 then return false end
    if step == 0.002 then core_client:request_scan() end   -- the first look only
    runners.sleep(math_min(step, left))
    step = math_min(step * 2, 0.05)
  end
end

-- how long a call with timeout = 0 (one attempt: try, -n) waits for a
-- server that takes writes when its client gives no attempt_timeout, at
-- most the client's server bound
_M.ONE_ATTEMPT_WAIT = 1

-- the driver's own cause of no writable server (a refused connection, a
-- certificate that failed, a name that does not resolve, a failed
-- authentication, no answer): one quick selection of its own, up to
-- `seconds`; else, `last` (an {err, code} seen before), else NO_SERVER
local function no_server(core_client, seconds, last)
  local ok, err, code = core_client:probe(seconds)
  if not ok and err ~= nil then return err, code end
  if last then return last[1], last[2] end
  return NO_SERVER, NO_SERVER_CODE
end

-- Before the one attempt of timeout = 0: true when a writable server is
-- known or becomes known within `attempt` (the client's attempt_timeout,
-- ONE_ATTEMPT_WAIT by default; a fresh client's monitors find a live
-- server in milliseconds, and one marked unknown by an error is checked
-- again after libmongoc's minimum heartbeat, 500 ms: a shorter wait would
-- miss it), else nil, the driver's cause (no_server, a quick selection of
-- at most as long), code.  A refused or failed connection so costs about
-- `attempt`, where the attempt's own server selection would wait the
-- whole server bound: never longer than a call with a longer timeout.
function _M.one_attempt_ready(core_client, bound, attempt)
  local wait = math_min(attempt or _M.ONE_ATTEMPT_WAIT, bound)
  if await_server(core_client, monotonic() + wait) then return true end
  return nil, no_server(core_client, wait)
end

-- f(...) as a single attempt of owner (.core): each round trip of f on
-- the client's own connection gets no more than the client's
-- attempt_timeout (client:one_attempt: a deadline its connection's reads,
-- writes and new connections keep), so that a server that froze after it
-- was last seen writable costs about that, not the server bound (twice,
-- with the driver's retry).  A runner's core (a scheduler's threads,
-- nginx) is left as it is.
function _M.single(owner, f, ...)
  local cc = core_of(owner)
  if cc ~= owner.core or cc:closed() then
    return f(...)
  end
  local prev = cc:one_attempt(true)
  local r = table_pack(pcall(f, ...))
  cc:one_attempt(prev)
  if not r[1] then error(r[2], 0) end
  return table_unpack(r, 2, r.n)
end

--[[
The one acquire loop of named locks (mongolock.locks), readers and
permits (mongolock.shared) and document locks (mongolock.documents).
run = {
  owner     the kind's object (.client, .core): its round trips go to
            runners.core_of(owner)
  core      the client's core (closed, writable)
  bound     the client's server selection bound (s)
  timeout   seconds: 0 makes one attempt, math.huge waits for ever
  attempt   function(polling, first, deadline) -> first value non-nil on
            success (all are returned) | nil, "busy", info | nil, err, code;
            deadline (nil for a try): the caller stops waiting for the
            reply then
  poll      true: the waiter polls (wait = "poll")
  series    the counters of the kind and collection (mongolock.stats), or nil
  wait      the wait module (sleep_until_retry(state))
  state     the wait state (mongolock.backoff documents it), made on the
            first busy answer by new_state(deadline)
  new_state function(deadline) -> state
  granted   nil, or function(grant, started) -> the handle of a lock a
            release granted to this waiter (state.granted)
  refresh   seconds after an attempt a queued waiter comes back (nil: no queue)
  leave     nil (no queue), or function(c) that takes the waiter's place
            out of the queue (c: core_of(owner))
  release_later
            with leave: function(c) that releases in the background what
            an attempt may have taken under the waiter's id
  on_step   nil, or function(waiting) called before every attempt
            (waiting false) and every wait between attempts (true): the
            caller's sign of life
}
Guarantee: no attempt starts after the deadline, no wait goes past it, and
an attempt that starts with less than the server bound left first waits (up
to the deadline) for a writable server, so an unreachable server costs no
more than the timeout; timeout = 0 waits for one up to ONE_ATTEMPT_WAIT
(one_attempt_ready).  An attempt in flight when the server dies or stops
answering ends within the server bound.
A transient failure (mongolock.errors.transient: an election, a
stepdown, a closed socket, no server found) of an attempt or of a wait
step is retried after a backoff step (outage_backoff, through run.wait in
"poll" mode, so that a wrapped wait step sees it) until the deadline; then
the loop gives up with that failure.  A permanent one returns at once.
A waiter that gives up (a timeout, a failure) takes its place out of the
queue, and passes on a lock an attempt took without its reply arriving
(best effort, and only with a server to tell: the place lapses after the
queue ttl).  After an attempt with no reply, even to the driver's retry
(the attempts after it went on under the same id, and would have found
such a lock theirs), what it may have taken is also released in the
background, whether a server is known now or not.
]]
function _M.acquire(run)
  local timeout = run.timeout
  local start = monotonic()
  local deadline = start + timeout
  local state
  local outage      -- the backoff state while attempts fail transiently
  local broken      -- {err, code} of the latest wait step that failed transiently
  local first = true
  local s = run.series
  -- queued: an attempt answered with this waiter's place; unsure: one
  -- failed without saying what it wrote (a lost reply may hide a place,
  -- or the lock itself, taken under the waiter's id); noreply: one had no
  -- reply, even to the driver's retry (the write may have been applied)
  local queued, unsure, noreply = false, false, false
  -- {err, code} of the latest attempt that failed transiently: the cause
  -- an outage that outlasts the deadline ends with
  local last_failure
  local function give_up(...)
    if not run.leave or run.core:closed() then return nil, ... end
    local cc = core_of(run.owner)
    if noreply then pcall(run.release_later, cc) end
    if (queued or unsure) and run.core:writable() then pcall(run.leave, cc) end
    return nil, ...
  end
  if stats.listeners[run.core] then stats.deliver(run.core) end
  -- the counters of the answer (series s): an acquisition, after a wait or
  -- not, or a timeout
  local function won(a, b, c)
    if s and a ~= nil then
      s.acquisitions = s.acquisitions + 1
      if state then stats.observe_wait(s, monotonic() - start) end
    end
    return a, b, c
  end
  local function lose(err, code)
    if s and err == "timeout" then s.timeouts = s.timeouts + 1 end
    return give_up(err, code)
  end
  -- one backoff step after a transient failure; nil, err, code when the
  -- wait step says to stop (a signal, in the command)
  local function pause()
    if not outage then
      local b = _M.outage_backoff
      outage = { attempt = 0, deadline = deadline,
                 opts = { wait = "poll", step = b.step, ratio = b.ratio, max_step = b.max_step } }
    end
    outage.attempt = outage.attempt + 1
    -- the failure it waits after, for a wait step that reports an outage
    -- (the command's notices)
    outage.failure = last_failure
    return run.wait.sleep_until_retry(outage)
  end
  while true do
    local started = monotonic()
    if timeout == 0 then
      -- (inside nginx the attempt is a worker thread's job, bounded there)
      if not runners.cooperative() then
        local ready, rerr, rcode = _M.one_attempt_ready(run.core, run.bound, run.owner.client.attempt_bound)
        if not ready then return lose(rerr, rcode) end
      end
    elseif deadline - started < run.bound then
      -- the last part of the time left (at most half the attempt bound)
      -- goes to asking the driver why no server is writable, so that the
      -- error names the cause (TLS, DNS, authentication, refused) and the
      -- wait still ends by the deadline
      local ask = math_min((run.owner.client.attempt_bound or _M.ONE_ATTEMPT_WAIT) / 2, (deadline - started) / 4)
      if not await_server(run.core, deadline - ask) then
        if run.core:closed() then return lose("closed") end
        local cause, ccode = no_server(run.core, ask, last_failure)
        -- the rest of the time (a refusal answers at once) still waits
        if not await_server(run.core, deadline) then return lose(cause, ccode) end
      end
    end
    if run.on_step then run.on_step(false) end
    started = monotonic()
    local polling = (run.poll or (state ~= nil and state.polling)) and true or false
    -- the attempt's reply is waited for up to the deadline (a try's, to
    -- its end)
    local a, b, c
    if timeout == 0 and not runners.cooperative() then
      a, b, c = _M.single(run.owner, run.attempt, polling, first, nil)
    else
      a, b, c = run.attempt(polling, first, timeout > 0 and deadline or nil)
    end
    first = false
    if a ~= nil then return won(a, b, c) end
    if run.leave then
      if b == "busy" then queued = queued or c.position ~= nil
      elseif b ~= "closed" then
        unsure = true
        noreply = noreply or network_error(c, b)
      end
    end
    if b ~= "busy" then
      -- timeout = 0 is one attempt; a permanent failure returns at once
      if timeout == 0 or not transient(c, b) or monotonic() >= deadline then
        return lose(b, c)
      end
      last_failure = { b, c }
      local ok, serr, scode = pause()
      if ok == nil and serr ~= nil then return lose(serr, scode) end
    else
      outage = nil
      if monotonic() >= deadline then
        -- wait = "watch" whose stream kept failing: what failed, not "timeout"
        if broken then return lose(broken[1], broken[2]) end
        return lose("timeout", c)
      end
      if not state then state = run.new_state(deadline) end
      state.attempt = (state.attempt or 0) + 1
      state.info = c
      state.refresh_at = (run.refresh and c and c.position) and started + run.refresh or nil
      if run.on_step then run.on_step(true) end
      -- nil, err only when wait = "watch" finds no change stream
      local ok, serr, scode = run.wait.sleep_until_retry(state)
      -- a release granted the lock to this waiter (state.granted, from the
      -- change event): the handle is made from it, measured from just before
      -- the latest attempt, which the release followed
      if state.granted and run.granted then return won(run.granted(state.granted, started)) end
      broken = nil
      if ok == nil and serr ~= nil then
        -- wait = "watch": a stream that fails transiently is tried again
        -- (and its error returned at the deadline)
        if not transient(scode, serr) then return lose(serr, scode) end
        broken = { serr, scode }
        ok, serr, scode = pause()
        if ok == nil and serr ~= nil then return lose(serr, scode) end
      end
    end
  end
end

-- the wait state of acquire's new_state (mongolock.backoff documents
-- it): owner, the locks object the wait step watches (database,
-- collection, core); o, the call's options
function _M.wait_state(owner, name, waiter, o, deadline)
  return { locks = owner, name = name, attempt = 0, step = o.step, deadline = deadline,
           waiter = waiter,
           opts = { step = o.step, ratio = o.ratio, max_step = o.max_step, wait = o.wait } }
end

-- the end of every kind's with: fn(h, ...) run holding h, then h
-- released; fn's results, nil, "lost" when the lease had ended before
-- the release, nil, message, code when the release failed; fn's error
-- re-raised unchanged after the release
local function finish(h, res)
  local ok, err, code = h:release()
  pcall(h.close, h)
  if not res[1] then error(res[2], 0) end
  if ok then return table_unpack(res, 2, res.n) end
  if err == "not held" or err == "lost" then return nil, "lost" end
  return nil, err, code
end

function _M.run_with(h, fn, ...)
  return finish(h, table_pack(pcall(fn, h, ...)))
end

return _M
