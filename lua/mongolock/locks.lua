-- Internal to mongolock: programs reach these methods through client:locks()
-- and do not require this module, which may change without notice.
--
-- Named locks: one document per name in one collection.
--
--   local locks = client:locks{ ttl = 30 }
--   local h, err = locks:acquire("job", { timeout = 5 })
--   ...
--   h:release()
--
-- acquire/try are one findAndModify each (doc/design.md); the C core owns
-- the lease (h is a mongolock.Lock userdata: h.name, h.token, h.owner,
-- h:release(), h:extend(ttl), h:remaining(), <close>, __gc).  This module
-- owns policy: defaults and options; the wait loop is mongolock.loop's.
-- The TTL index of a lock collection (named locks' and the shared kinds')
-- is made here.

--- Named locks: what `client:locks(opts)` returns (one document per name).
-- A handle h (a lock held) has h.name, h.token, h.owner and h:release(), h:extend(ttl), h:remaining(),
-- h:held(), h:check(), h:close() (README, Handles).
-- @classmod locks

local core = require "mongolock.core"
local args = require "mongolock.args"
local loop = require "mongolock.loop"
local runners = require "mongolock.runners"
local stats = require "mongolock.stats"
local wait_mod = require "mongolock.wait"

local type = type
local pairs = pairs
local rawget = rawget
local rawset = rawset
local tostring = tostring
local setmetatable = setmetatable
local string_format = string.format
local core_of = runners.core_of
local math_ceil = math.ceil
local monotonic = core.monotonic

local argerror = args.argerror
local check_type = args.check_type
local check_name = args.check_name

-- the wait step: change-stream wake-ups with backoff polling as fallback
-- (mongolock.wait); the specs swap it through set_wait
local wait = wait_mod

local _M = {
  _VERSION = "0.1.0",
  defaults = {
    database = nil,        -- the URI's database, else "mongolock"
    collection = "locks",
    ttl = 30,              -- seconds a lease lasts unless extended
    timeout = 10,          -- seconds acquire waits (0: one attempt,
                           -- math.huge: no limit)
    step = args.backoff.step,             -- first backoff step (s)
    ratio = args.backoff.ratio,           -- step growth per attempt
    max_step = args.backoff.max_step,     -- largest step (s)
    expire_after = 86400,  -- TTL index: idle lock documents removed after (s)
    renew = false,         -- background renewal every ttl/3
    wait = wait_mod.default, -- "auto" | "watch" | "poll" (mongolock.wait)
    queue_ttl = 3,         -- seconds a waiter's place in the queue is kept
                           -- after its latest attempt (it comes back at
                           -- half of it while it waits)
    lock_delay = 0,        -- seconds the name stays taken after a lease
                           -- that ended without a release (expired, or
                           -- force-released)
  },
}
local defaults = _M.defaults

local mt = { __index = _M }

-- the wait module in use (tests and issue-specific waiters swap it)
function _M.set_wait(w)
  if w == nil then w = wait_mod end
  check_type(w, "table", 1, "set_wait")
  wait = w
end
function _M.get_wait() return wait end

_M.check_name = check_name

-- the options a call takes, and those client:locks takes besides
local CALL_OPTS = { "ttl", "timeout", "renew", "step", "ratio", "max_step", "queue_ttl", "wait", "lock_delay" }
local VALID_CALL = args.set(CALL_OPTS)
local VALID_NEW = args.set(CALL_OPTS, { "database", "collection", "expire_after" })

-- checks the option o[k] (given in argument n of fname); returns it
local checks = {
  ttl = args.ttl,
  timeout = args.timeout,
  step = args.seconds,
  max_step = args.seconds,
  expire_after = args.seconds,
  queue_ttl = args.ttl,
  lock_delay = args.delay,
  ratio = function(v, n, fname, what, level)
    args.seconds(v, n, fname, what, (level or 2) + 1)
    if v < 1 then
      argerror(n, fname, "ratio must be >= 1 (got " .. args.shown(v) .. ")", (level or 2) + 1)
    end
    return v
  end,
  renew = function(v, n, fname, what, level)
    if type(v) ~= "boolean" then
      argerror(n, fname, what .. ": boolean expected, got " .. type(v), (level or 2) + 1)
    end
    return v
  end,
  wait = function(v, n, fname, _, level)
    wait_mod.check_mode(v, n, fname, (level or 2) + 1)   -- no tail call: it counts this level
    return v
  end,
  database = args.check_db,
  collection = function(v, n, fname, what, level)
    return args.check_coll(v, nil, n, fname, what, (level or 2) + 1)
  end,
}

-- mongolock.shared checks the same options the same way
_M.checks = checks

-- copies the checked options of opts (argument n of fname) into into
local function take(into, opts, valid, n, fname, level)
  level = (level or 2) + 1
  args.check_keys(opts, valid, n, fname, level)
  for k, v in pairs(opts) do into[k] = checks[k](v, n, fname, k, level) end
  return into
end

-- locks = locks.new(client, opts): bad options raise here, not at first
-- use, as argument 1 of fname ("locks"), level frames up (2: new's caller)
function _M.new(client, opts, fname, level)
  fname, level = fname or "locks", level or 2
  check_type(opts, "table", 1, fname, true, level)
  local self = {}
  for k, v in pairs(defaults) do self[k] = v end
  take(self, opts or {}, VALID_NEW, 1, fname, level)
  self.client = client
  self.core = client._core
  self.database = self.database or client:default_database()
  args.check_coll(self.collection, self.database, 1, fname, "collection", level)
  self.app = client.appname
  self.bound = client.server_bound or args.SERVER_TIMEOUT
  self.key = (client.uri or "") .. "\0" .. self.database .. "\0" .. self.collection
  self.series = stats.series(client, "named", self.database, self.collection)
  return setmetatable(self, mt)
end

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

-- ---- a blocking wait for what its own client holds --------------------------
--
-- A blocking acquire (not in a scheduler's coroutine, not in an nginx
-- phase that yields) of a name its own client holds would wait its whole
-- timeout: nothing else in the thread runs to release it.  Its attempt
-- answers nil, "deadlock", info instead of "busy" when everything in the
-- way is this client's: the exclusive owner (info.owner) one of its handles
-- and the info.holders shares or permits all its own, none of whose leases
-- ends before the deadline unrenewed (an expiry would free it).  A queue
-- ahead (no owner, no holder) or any other holder: it waits as before.
-- Under a scheduler or in nginx another coroutine may release: it waits.

-- h, a handle an attempt of client won (client._handles, weak keys)
function _M.note_handle(client, h)
  local set = rawget(client, "_handles")
  if not set then
    set = setmetatable({}, { __mode = "k" })
    rawset(client, "_handles", set)
  end
  set[h] = true
  return h
end

-- true when a blocking attempt (deadline: monotonic, nil for one attempt)
-- of name in db.coll that found info ("busy") waits for this client alone
function _M.own_deadlock(client, db, coll, name, info, deadline)
  if not deadline or type(info) ~= "table" then return false end
  local owner, holders = info.owner, type(info.holders) == "number" and info.holders or 0
  if owner == nil and holders <= 0 then return false end
  if runners.cooperative() or runners.scheduler() then return false end
  local set = rawget(client, "_handles")
  if not set then return false end
  local left = deadline - monotonic()
  local owned, shares = owner == nil, 0
  for h in pairs(set) do
    if h:held() and h.database == db and h.collection == coll then
      local mine = owner ~= nil and h.owner == owner
      local share = not mine and (h.kind == "shared" or h.kind == "permit") and h.name == name
      if mine or share then
        -- a lease that ends before the deadline frees the way
        if not h.renew and (h:remaining() or 0) < left then return false end
        if mine then owned = true else shares = shares + 1 end
      end
    end
  end
  return owned and shares >= holders
end

-- the TTL index, once per server, collection and process: keyed by URI,
-- database and collection; a forked child makes it once more.  Made after
-- an attempt the server answered (an unreachable server costs the attempt
-- alone); its failure fails no acquisition (_M.ensure_index).
local function ensure_index(self)
  _M.ensure_index(self.key, self.database .. "." .. self.collection, function()
    return core_of(self):ensure_index(self.database, self.collection, math_ceil(self.expire_after))
  end)
end

-- per-call options over the locks' own (opts: argument n of fname, 2 by
-- default; level: 3, the caller of call_opts's caller); returns ttl_ms and
-- the options
local function call_opts(self, opts, fname, extra, n, level)
  if opts == nil and extra == nil then return math_ceil(self.ttl * 1000), self end
  n, level = n or 2, level or 3
  check_type(opts, "table", n, fname, true, level)
  local o = setmetatable({}, { __index = self })
  if extra then for k, v in pairs(extra) do o[k] = v end end
  if opts then take(o, opts, VALID_CALL, n, fname, level) end
  return math_ceil(o.ttl * 1000), o
end

-- one attempt: h | nil, "busy", info | nil, err, code.  waiter: the
-- acquire's id, which queues it (nil: a try); deadline: inside nginx the
-- caller stops waiting for the reply then
local function attempt(self, name, ttl_ms, o, waiter, queue_ms, polling, deadline)
  if self.core:closed() then return nil, "closed" end
  if not waiter and not runners.ngx_core(self.client) then
    -- one attempt (timeout = 0): a dead server answers within a second
    local ready, err, code = loop.one_attempt_ready(self.core, self.bound, self.client.attempt_bound)
    if not ready then return nil, err, code end
  end
  local delay_ms = math_ceil(o.lock_delay * 1000)
  local function send()
    if o.value ~= nil then
      -- an election's campaign (mongolock.elections): the attempt that takes
      -- the lock publishes the value; its waiter is never granted the lock
      return core_of(self):campaign(self.database, self.collection, name, ttl_ms, self.app, o.renew,
        waiter, queue_ms, o.value, deadline, delay_ms)
    end
    return core_of(self):acquire(self.database, self.collection, name, ttl_ms, self.app,
      o.renew, waiter, queue_ms, polling, deadline, delay_ms)
  end
  local h, err, info
  -- one attempt: bounded by the client's attempt_timeout (loop.single)
  if waiter then h, err, info = send() else h, err, info = loop.single(self, send) end
  if h or err == "busy" then ensure_index(self) end
  if h then return _M.note_handle(self.client, h), err, info end
  if err == "busy" and _M.own_deadlock(self.client, self.database, self.collection, name, info, deadline) then
    return nil, "deadlock", info
  end
  return h, err, info
end

--- One attempt to take the lock name.
-- h, err = locks:try(name, opts): one attempt; nil, "busy", info when held
function _M.try(self, name, opts)
  check_name(name, "try")
  local ttl_ms, o = call_opts(self, opts, "try")
  return stats.count_one(self.series, attempt(self, name, ttl_ms, o))
end

-- the wait loop of acquire and with, once the arguments are checked
local function wait_for(self, name, ttl_ms, o, on_step)
  if o.timeout == 0 then
    -- one attempt, as try makes it: it takes no place in the queue
    local h, err, info = attempt(self, name, ttl_ms, o)
    if err == "busy" then err = "timeout" end
    return stats.count_one(self.series, h, err, info)
  end
  local waiter, werr = core.waiter_id()
  if not waiter then return nil, werr end
  local queue_ms = math_ceil(o.queue_ttl * 1000)
  return loop.acquire({
    owner = self, core = self.core, bound = self.bound, timeout = o.timeout, wait = wait, series = self.series,
    poll = o.wait == "poll", refresh = o.queue_ttl / 2, on_step = on_step,
    -- a waiter that polls (wait = "poll", or no change stream) says so in
    -- its queue entry: it cannot be woken, and does not hold others up
    attempt = function(polling, _, deadline)
      return attempt(self, name, ttl_ms, o, waiter, queue_ms, polling, deadline)
    end,
    -- a lock a release granted to this waiter (no command)
    granted = function(g, started)
      local h, err, info = core_of(self):granted(self.database, self.collection, name, waiter, ttl_ms,
        queue_ms, g.token, started, o.renew)
      if h then _M.note_handle(self.client, h) end
      return h, err, info
    end,
    new_state = function(deadline) return loop.wait_state(self, name, waiter, o, deadline) end,
    -- a waiter that gives up (mongolock.loop): its place, and what an
    -- attempt without a reply may have taken
    leave = function(c) return c:leave(self.database, self.collection, name, waiter) end,
    release_later = function(c)
      return c:release_later("named", self.database, self.collection, name, waiter)
    end,
  })
end

--- Takes the lock name, waiting up to opts.timeout (default 10 s).
-- h, err = locks:acquire(name, opts): waits up to opts.timeout (0: one
-- attempt; math.huge: no limit); nil, "timeout", info when still held then
function _M.acquire(self, name, opts)
  check_name(name, "acquire")
  local ttl_ms, o = call_opts(self, opts, "acquire")
  return wait_for(self, name, ttl_ms, o)
end

-- locks_mod.acquire_stepping(locks, name, opts, on_step): locks:acquire,
-- with on_step(waiting) called before every attempt and every wait
-- (mongolock.loop.acquire; resty.mongolock's gate)
function _M.acquire_stepping(self, name, opts, on_step)
  check_name(name, "acquire")
  local ttl_ms, o = call_opts(self, opts, "acquire")
  return wait_for(self, name, ttl_ms, o, on_step)
end

-- locks_mod.campaign(locks, name, value, opts, fname, level): acquire, as
-- an election's campaign (mongolock.elections): the attempt that takes the
-- lock publishes value (a string the caller checked) in the lock document.
-- opts is argument 3 of fname; level as call_opts's (the user's frame).
function _M.campaign(self, name, value, opts, fname, level)
  local ttl_ms, o = call_opts(self, opts, fname, { value = value }, 3, level + 1)
  return wait_for(self, name, ttl_ms, o)
end

--- Runs fn(h, ...) holding the lock name, renewed meanwhile; always releases.
-- locks:with(name, opts, fn, ...) -> fn's results | nil, "lost" | nil, err:
-- runs fn(h, ...) holding the lock (renewed in the background unless
-- opts.renew = false); always releases; re-raises fn's error.
-- h:check() inside fn answers nil, "lost" within a round trip of a force
-- release, a takeover or a delete where change streams run (once the lock
-- was held 0.25 s), else with renewal within a renewal period (ttl/3) and
-- a round trip: the renewal that matches nothing marks the lease lost.
function _M.with(self, name, opts, fn, ...)
  check_name(name, "with")
  if type(opts) == "function" then
    return _M.with(self, name, nil, opts, fn, ...)
  end
  check_type(opts, "table", 2, "with", true)
  check_type(fn, "function", 3, "with")
  -- fn may run longer than a ttl: with renews in the background
  local ttl_ms, o = call_opts(self, opts, "with", { renew = true })
  local h, err, code = wait_for(self, name, ttl_ms, o)
  if not h then return nil, err, code end
  return loop.run_with(h, fn, ...)
end

--- The state of the lock name: holder, token, lease left, waiters.
-- locks:status(name) -> {held, owner, token, acquired_at, expires_at,
-- remaining, waiting (live queued waiters), holder = {host, pid, app}} |
-- nil (never acquired) |
-- nil, err, code.  One aggregate.
function _M.status(self, name)
  check_name(name, "status")
  if self.core:closed() then return nil, "closed" end
  local st, err, code = core_of(self):status(self.database, self.collection, name)
  if st == nil then return nil, err, code end
  return st
end

--- The status of every lock of the collection, sorted by name.
-- locks:list() -> { status, ... } sorted by name (each with .name)
function _M.list(self)
  if self.core:closed() then return nil, "closed" end
  return core_of(self):list(self.database, self.collection)
end

--- Frees the lock name whoever holds it.
-- locks:force_release(name) -> true | nil, "not held": frees the lock
-- whoever holds it (for people cleaning up; the holder's next release or
-- extend answers "not held" / "lost")
function _M.force_release(self, name)
  check_name(name, "force_release")
  if self.core:closed() then return nil, "closed" end
  return core_of(self):force_release(self.database, self.collection, name)
end

return _M
