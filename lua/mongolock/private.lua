-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.private: what the library's Lua modules share and users do not
-- call: argument and option checks (one set of messages, in seconds and the
-- option's name), the OpenResty phases where sleeping yields, the backoff
-- defaults, and the one acquire loop of named and document locks.
--
-- Conventions: a check raises "bad argument #n to 'fname' (...)" at the
-- caller of the public function; `level` counts as error()'s does from the
-- function that calls the check (2: the caller of that function).

local core = require "mongolock.core"
local transport = require "mongolock.ngx"

local type = type
local next = next
local pairs = pairs
local error = error
local pcall = pcall
local select = select
local table_unpack = table.unpack or rawget(_G, "unpack")
local table_pack = table.pack or function(...) return { n = select("#", ...), ... } end
local tostring = tostring
local rawget = rawget
local setmetatable = setmetatable
local string_format = string.format
local math_huge = math.huge
local math_min = math.min
local math_max = math.max
local monotonic = core.monotonic

local _M = {}

-- ---- defaults written once ------------------------------------------------

-- backoff between attempts, as lua-resty-lock's (first step, growth, cap)
_M.backoff = { step = 0.001, ratio = 2, max_step = 0.5 }

-- seconds a round trip may wait for an unreachable or silent server (server
-- selection, connect, socket), unless the URI sets libmongoc's own options:
-- a sixth of the default lease, where libmongoc waits 30 s
_M.SERVER_TIMEOUT = 5

-- the longest lease (and queue place) the core takes
_M.TTL_MAX = 365 * 24 * 3600

-- ---- OpenResty -------------------------------------------------------------

-- phases of ngx_lua in which ngx.sleep (and ngx.semaphore) yield
_M.yieldable = transport.yieldable

-- The one place that tells where a client's round trips go (core_of,
-- below).  Inside an nginx worker, in a phase that can yield, with
-- mongolock.ngx enabled: the stand-in of mongolock.ngx.core for client (the
-- C client's methods, each round trip a worker thread's job); else nil.
function _M.ngx_core(client)
  if type(client) ~= "table" or client.connect_opts == nil or not transport.active() then return nil end
  return require("mongolock.ngx.core").of(client)
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
-- (connect{scheduler =}): the stand-in of mongolock.sched for client (the
-- C client's methods, each round trip a job of the core's thread pool
-- while the coroutine yields); else nil.
function _M.sched_core(client)
  local S = type(client) == "table" and rawget(client, "_scheduler")
  if not S or not S.current() then return nil end
  return require("mongolock.sched").of(client)
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
-- blocking sleep
function _M.sleep(s)
  if s <= 0 then return end
  local ngx = _M.cooperative()
  if ngx then return ngx.sleep(s) end
  local S = _M.scheduler()
  if S then return S.sleep(s) end
  return core.sleep(s)
end

-- ---- argument checks ---------------------------------------------------------

-- raises "bad argument #n to 'fname' (msg)" at the caller of fname
local function argerror(n, fname, msg, level)
  error(string_format("bad argument #%d to '%s' (%s)", n, fname, msg), (level or 2) + 1)
end
_M.argerror = argerror

-- v has type t (or is nil when optional); returns v
function _M.check_type(v, t, n, fname, optional, level)
  if v == nil and optional then return nil end
  if type(v) ~= t then
    argerror(n, fname, string_format("%s expected, got %s", t, type(v)), (level or 2) + 1)
  end
  return v
end

local function shown(v)
  if type(v) == "string" then return string_format("%q", v) end
  if v ~= v then return "NaN" end          -- not the C library's "-nan" or "nan"
  if type(v) == "number" then return tostring(v) end
  return type(v)
end
_M.shown = shown

local function number(v, n, fname, what, level)
  if type(v) ~= "number" then
    argerror(n, fname, string_format("%s: number of seconds expected, got %s", what, type(v)),
      level + 1)
  end
  return v
end

-- a positive, finite number of seconds (step, expire_after, ...)
function _M.seconds(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v <= 0 or v == math_huge then
    argerror(n, fname, string_format("%s must be a positive, finite number of seconds (got %s)",
      what, shown(v)), level)
  end
  return v
end

-- a lease length: positive seconds, at most a year
function _M.ttl(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v <= 0 or v > _M.TTL_MAX then
    argerror(n, fname, string_format("%s must be a positive number of seconds, at most a year "
      .. "(%d) (got %s)", what, _M.TTL_MAX, shown(v)), level)
  end
  return v
end

-- how long to wait: 0 makes one attempt, math.huge waits for ever
function _M.timeout(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v < 0 then
    argerror(n, fname, string_format("%s must be a number of seconds >= 0 (0: one attempt, "
      .. "math.huge: no limit) (got %s)", what, shown(v)), level)
  end
  if v == 0 then v = 0 end                    -- -0.0
  return v
end

-- Levenshtein distance with adjacent transpositions (short strings only)
local function distance(a, b)
  local la, lb = #a, #b
  if la > 64 or lb > 64 then return math_huge end
  local d = {}
  for i = 0, la do d[i] = { [0] = i } end
  for j = 0, lb do d[0][j] = j end
  for i = 1, la do
    local ca = a:byte(i)
    for j = 1, lb do
      local cb = b:byte(j)
      local cost = (ca == cb) and 0 or 1
      local v = math_min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and ca == b:byte(j - 1) and a:byte(i - 1) == cb then
        v = math_min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[la][lb]
end

-- the valid key nearest to key, when it is near enough to be a slip
function _M.nearest(key, valid)
  if type(key) ~= "string" then return nil end
  local best, bestd
  -- case and underscores aside: serverSelectionTimeoutMS is near
  -- server_selection_timeout
  local lkey = key:lower():gsub("_", "")
  for k in pairs(valid) do
    local lk = k:lower():gsub("_", "")
    local d = distance(lkey, lk)
    -- a slip: about one edit in three letters of the longer name
    if d <= math_max(1, math_min(3, math.floor(math_max(#lkey, #lk) / 3)))
       and (d < (bestd or math_huge) or (d == bestd and k < best)) then
      best, bestd = k, d
    end
  end
  return best
end

-- raises unless every key of opts is in valid (a set of names): "unknown
-- option 'tll' (did you mean 'ttl'?)"
function _M.check_keys(opts, valid, n, fname, level)
  for k in pairs(opts) do
    if not valid[k] then
      local near = _M.nearest(k, valid)
      local what = type(k) == "string" and string_format("'%s'", k) or string_format("[%s]", shown(k))
      argerror(n, fname, string_format("unknown option %s%s", what,
        near and string_format(" (did you mean '%s'?)", near) or ""), (level or 2) + 1)
    end
  end
  return opts
end

-- a set from a list of names
function _M.set(...)
  local s = {}
  for _, list in pairs({ ... }) do
    for _, k in pairs(list) do s[k] = true end
  end
  return s
end

-- ---- lock names ---------------------------------------------------------------

local MAX_NAME = 1024

-- raises at the caller of fname unless name is a valid lock name
function _M.check_name(name, fname, level)
  level = (level or 2) + 1
  if type(name) ~= "string" then
    argerror(1, fname, string_format("string expected, got %s", type(name)), level)
  end
  if #name == 0 then argerror(1, fname, "name must not be empty", level) end
  if #name > MAX_NAME then argerror(1, fname, "name longer than 1024 bytes", level) end
  if name:find("\0", 1, true) then argerror(1, fname, "name contains a NUL byte", level) end
  if not core.utf8_valid(name) then argerror(1, fname, "name is not valid UTF-8", level) end
  return name
end

-- MongoDB's limits on names, as the core checks them: a database is 1..63
-- bytes of UTF-8 without /\. "$ or NUL; a collection is UTF-8 without '$'
-- or NUL, not system.*, and at most 255 bytes with its database and a dot
local function clip(v)
  return shown(#v > 40 and v:sub(1, 40) .. "..." or v)
end

function _M.check_db(v, n, fname, what, level)
  level = (level or 2) + 1
  if type(v) ~= "string" then
    argerror(n, fname, string_format("%s: string expected, got %s", what, type(v)), level)
  end
  if #v == 0 or #v > 63 or v:find('[%z/\\%. "$]') or not core.utf8_valid(v) then
    argerror(n, fname, string_format('%s must be 1..63 bytes of UTF-8, none of /\\. "$ or NUL '
      .. "(got %s)", what, clip(v)), level)
  end
  return v
end

-- db: the collection's database when known (its length counts)
function _M.check_coll(v, db, n, fname, what, level)
  level = (level or 2) + 1
  if type(v) ~= "string" then
    argerror(n, fname, string_format("%s: string expected, got %s", what, type(v)), level)
  end
  local max = 254 - (db and #db or 1)
  if #v == 0 or #v > max or v:find("[%z$]") or v:sub(1, 7) == "system."
     or not core.utf8_valid(v) then
    argerror(n, fname, string_format("%s must be 1..%d bytes of UTF-8 without '$' or NUL, not "
      .. "system.* (got %s)", what, max, clip(v)), level)
  end
  return v
end

-- ---- transient errors ------------------------------------------------------------

-- What a replica set answers while it elects a primary or shuts one down
-- (the retryable-writes specification's retryable codes: HostUnreachable,
-- HostNotFound, NetworkTimeout, ShutdownInProgress, PrimarySteppedDown,
-- ExceededTimeLimit, SocketException, NotWritablePrimary,
-- InterruptedAtShutdown, InterruptedDueToReplStateChange,
-- NotPrimaryNoSecondaryOk, NotPrimaryOrSecondary), and libmongoc's
-- server selection failure (MONGOC_ERROR_SERVER_SELECTION_FAILURE: no
-- writable primary known within the server timeout)
local TRANSIENT_CODES = {
  [6] = true, [7] = true, [89] = true, [91] = true, [189] = true, [262] = true, [9001] = true,
  [10107] = true, [11600] = true, [11602] = true, [13435] = true, [13436] = true,
  [13053] = true,
}
_M.TRANSIENT_CODES = TRANSIENT_CODES

-- error labels a server puts on errors that a retry may overcome
local TRANSIENT_LABELS = { RetryableWriteError = true, ResumableChangeStreamError = true }

-- true when (code, message) is libmongoc's network error: no connection,
-- or no reply (MONGOC_ERROR_STREAM: 3 name resolution, 4 socket, 5 connect,
-- 6 not established).  A write whose reply is lost may have been applied.
function _M.network_error(code, message)
  if code ~= 3 and code ~= 4 and code ~= 5 and code ~= 6 then return false end
  if type(message) ~= "string" then return false end
  return (message:find("socket", 1, true) or message:find("connect", 1, true)
    or message:find("stream", 1, true) or message:find("Failed to", 1, true)) ~= nil
end

-- The one place that tells a transient failure (the server or the network
-- will be back: an election, a stepdown, a shutdown, a closed socket, no
-- server found) from a permanent one (a bad name, authorization, a
-- permit mismatch, a duplicate key, ...).  labels: the reply's
-- errorLabels when known (a list of strings), else nil.
function _M.transient(code, message, labels)
  if type(labels) == "table" then
    for _, l in pairs(labels) do
      if TRANSIENT_LABELS[l] then return true end
    end
  end
  if type(code) ~= "number" then return false end
  if TRANSIENT_CODES[code] then return true end
  return _M.network_error(code, message)
end

-- backoff between attempts that failed transiently: 50 ms, doubling, at
-- most 1 s (an election takes 2 to 12 s)
_M.outage_backoff = { step = 0.05, ratio = 2, max_step = 1 }

-- ---- the TTL index --------------------------------------------------------------

-- One line for a person reading the logs: ngx.log inside nginx, else
-- standard error.  (Replaced by the specs to see what is reported.)
function _M.log(msg)
  local ngx = rawget(_G, "ngx")
  if ngx and ngx.log then
    ngx.log(ngx.WARN, msg)
  else
    io.stderr:write(msg, "\n")
  end
end

-- seconds after a failed createIndexes before an acquire tries again
_M.index_retry = 30
-- createIndexes that failed in this process (every kind, every collection)
_M.index_failures = 0

-- key -> {pid, done, failed_at, reported}: the TTL index of a collection,
-- made once per key (server, database, collection) and process
local indexes = {}

-- The TTL index (expire_after) only removes long-idle lock documents: no
-- acquisition depends on it.  make() -> ok | nil, err, code sends the
-- createIndexes.  A failure (a stepdown, a missing privilege) is reported
-- once per key and process, counted, and tried again by the first
-- acquisition index_retry seconds later; it never fails the acquisition.
-- 85/86 (an index on the field exists with other options) serves.
function _M.ensure_index(key, what, make)
  local pid = core.getpid()
  local s = indexes[key]
  if not s or s.pid ~= pid then
    s = { pid = pid }
    indexes[key] = s
  end
  if s.done or (s.failed_at and monotonic() < s.failed_at + _M.index_retry) then return end
  local ok, err, code = make()
  if ok or code == 85 or code == 86 then
    s.done = true
    return
  end
  _M.index_failures = _M.index_failures + 1
  s.failed_at = monotonic()
  if not s.reported then
    s.reported = true
    _M.log(string_format("mongolock: the TTL index of %s was not created (%s%s); locks work "
      .. "without it, and a later acquisition tries again", what, tostring(err),
      code and (", code " .. tostring(code)) or ""))
  end
end

-- ---- counters and lease events ---------------------------------------------

-- the wait-time histogram's upper bounds (s), fixed: Prometheus' default
-- buckets, which most latency dashboards already read
_M.WAIT_BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10 }
local WAIT_BUCKETS = _M.WAIT_BUCKETS
local NBUCKETS = #WAIT_BUCKETS

-- The counters of one kind of lock in one collection of a client, kept in
-- Lua on the client itself: counting is a table increment on the caller's
-- thread (no lock, no round trip; inside nginx one set per worker).
-- Returns nil for a client made otherwise (no _series).
function _M.series(client, kind, db, coll)
  local all = type(client) == "table" and rawget(client, "_series")
  if not all then return nil end
  local collection = db .. "." .. coll
  local key = kind .. "\0" .. collection
  local s = all.by[key]
  if not s then
    local counts = {}
    for i = 1, NBUCKETS + 1 do counts[i] = 0 end   -- the last: above every bound
    s = { kind = kind, collection = collection, acquisitions = 0, waits = 0, timeouts = 0, busy = 0,
          wait_sum = 0, wait_counts = counts }
    all.by[key] = s
    all[#all + 1] = s
  end
  return s
end

-- one acquisition that waited `seconds`
local function observe_wait(s, seconds)
  s.waits = s.waits + 1
  s.wait_sum = s.wait_sum + seconds
  local i = 1
  while i <= NBUCKETS and seconds > WAIT_BUCKETS[i] do i = i + 1 end
  s.wait_counts[i] = s.wait_counts[i] + 1
end

-- counts the answer of one attempt made alone (a try, or an acquire with
-- timeout = 0): returns the answer unchanged
function _M.count_one(s, a, b, ...)
  if s then
    if a ~= nil then s.acquisitions = s.acquisitions + 1
    elseif b == "busy" then s.busy = s.busy + 1
    elseif b == "timeout" then s.timeouts = s.timeouts + 1 end
  end
  return a, b, ...
end

-- every client of this process made by mongolock.connect (weak: for
-- mongolock.metrics)
_M.clients = setmetatable({}, { __mode = "k" })

-- client:on_lost's callbacks, by core client (weak: a callback never
-- keeps a client alive)
local listeners = setmetatable({}, { __mode = "k" })
_M.listeners = listeners

-- Hands the lease events queued in C (csrc/stats.c: lost, renewal failed)
-- to the core client's callback, each in a pcall (an error in it is
-- returned, never raised into the library's caller); returns how many.
-- Cheap when nothing waits: one look at a count, no lock.
function _M.deliver(cc)
  local fn = listeners[cc]
  if fn == nil or not cc:has_events() then return 0 end
  local evs = cc:take_events()
  local errs
  for i = 1, #evs do
    local ok, err = pcall(fn, evs[i])
    if not ok then errs = errs or {}; errs[#errs + 1] = tostring(err) end
  end
  return #evs, errs
end

-- ---- the acquire loop -----------------------------------------------------------

-- the error of an acquire that found no server before its deadline, as
-- libmongoc words a failed server selection (MONGOC_ERROR_SERVER_SELECTION_FAILURE)
_M.NO_SERVER = "No suitable servers found: no server that takes writes was reachable "
  .. "before the timeout"
_M.NO_SERVER_CODE = 13053

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
    _M.sleep(math_min(step, left))
    step = math_min(step * 2, 0.05)
  end
end

-- how long a call with timeout = 0 (one attempt: try, -n) waits for a
-- server that takes writes, at most the client's server bound
_M.ONE_ATTEMPT_WAIT = 1

-- Before the one attempt of timeout = 0: true when a writable server is
-- known or becomes known within ONE_ATTEMPT_WAIT (a fresh client's monitors
-- find a live server in milliseconds), else nil, NO_SERVER, NO_SERVER_CODE.
-- A dead server so costs about a second, where the attempt's own server
-- selection would wait the whole server bound: never longer than a call
-- with a longer timeout.
function _M.one_attempt_ready(core_client, bound)
  if await_server(core_client, monotonic() + math_min(_M.ONE_ATTEMPT_WAIT, bound)) then return true end
  -- the cause in the driver's words (a refused connection, a certificate
  -- that failed): one quick selection of its own
  local ok, err, code = core_client:probe(math_min(_M.ONE_ATTEMPT_WAIT, bound))
  if ok or err == nil then return nil, _M.NO_SERVER, _M.NO_SERVER_CODE end
  return nil, err, code
end

--[[
The one acquire loop of named locks (mongolock.locks) and document locks
(mongolock.documents).  run = {
  core      the client's core (closed, writable)
  bound     the client's server selection bound (s)
  timeout   seconds: 0 makes one attempt, math.huge waits for ever
  attempt   function(polling, first, deadline) -> first value non-nil on
            success (all are returned) | nil, "busy", info | nil, err, code;
            deadline (nil for a try): the caller stops waiting for the
            reply then
  wait      the wait module (sleep_until_retry(state))
  state     the wait state (mongolock.backoff documents it), made on the
            first busy answer by new_state(deadline)
  new_state function(deadline) -> state
  refresh   seconds after an attempt a queued waiter comes back (nil: no queue)
  give_up   function(...) -> nil, ... (leaves the queue); nil: return nil, ...
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
A transient failure (_M.transient: an election, a stepdown, a closed
socket, no server found) of an attempt or of a wait step is retried after
a backoff step (outage_backoff, through run.wait in "poll" mode, so that a
wrapped wait step sees it) until the deadline; then the loop gives up with
that failure.  A permanent one returns at once.
]]
function _M.acquire_loop(run)
  local timeout = run.timeout
  local start = monotonic()
  local deadline = start + timeout
  local give_up = run.give_up or function(...) return nil, ... end
  local state
  local outage      -- the backoff state while attempts fail transiently
  local broken      -- {err, code} of the latest wait step that failed transiently
  local first = true
  local s = run.series
  if listeners[run.core] then _M.deliver(run.core) end
  -- the counters of the answer (series s): an acquisition, after a wait or
  -- not, or a timeout
  local function won(a, b, c)
    if s and a ~= nil then
      s.acquisitions = s.acquisitions + 1
      if state then observe_wait(s, monotonic() - start) end
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
    return run.wait.sleep_until_retry(outage)
  end
  while true do
    local started = monotonic()
    if timeout == 0 then
      -- (inside nginx the attempt is a worker thread's job, bounded there)
      if not _M.cooperative() then
        local ready, rerr, rcode = _M.one_attempt_ready(run.core, run.bound)
        if not ready then return lose(rerr, rcode) end
      end
    elseif deadline - started < run.bound and not await_server(run.core, deadline) then
      return lose(_M.NO_SERVER, _M.NO_SERVER_CODE)
    end
    if run.on_step then run.on_step(false) end
    started = monotonic()
    local polling = (run.poll or (state ~= nil and state.polling)) and true or false
    -- the attempt's reply is waited for up to the deadline (a try's, to
    -- its end)
    local a, b, c = run.attempt(polling, first, timeout > 0 and deadline or nil)
    first = false
    if a ~= nil then return won(a, b, c) end
    if b ~= "busy" then
      -- timeout = 0 is one attempt; a permanent failure returns at once
      if timeout == 0 or not _M.transient(c, b) or monotonic() >= deadline then
        return lose(b, c)
      end
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
        if not _M.transient(scode, serr) then return lose(serr, scode) end
        broken = { serr, scode }
        ok, serr, scode = pause()
        if ok == nil and serr ~= nil then return lose(serr, scode) end
      end
    end
  end
end

-- the wait state of acquire_loop's new_state (mongolock.backoff documents
-- it): owner, the locks object the wait step watches (database,
-- collection, core); o, the call's options
function _M.wait_state(owner, name, waiter, o, deadline)
  return { locks = owner, name = name, attempt = 0, step = o.step, deadline = deadline,
           waiter = waiter,
           opts = { step = o.step, ratio = o.ratio, max_step = o.max_step, wait = o.wait } }
end

-- is t an empty table (no option given)?
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

function _M.empty(t)
  return next(t) == nil
end

return _M
