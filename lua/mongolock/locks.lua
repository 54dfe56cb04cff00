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
-- owns policy: defaults, the wait loop and its pluggable wait step.

local mongolock = require "mongolock"
local core = require "mongolock.core"
local backoff = require "mongolock.backoff"

local type = type
local pcall = pcall
local pairs = pairs
local error = error
local tostring = tostring
local setmetatable = setmetatable
local string_format = string.format
local math_ceil = math.ceil
local monotonic = core.monotonic
local getpid = core.getpid

local argerror = mongolock._argerror
local check_type = mongolock._check_type
local check_seconds = mongolock._check_seconds

-- The wait step: mongolock.wait (change-stream wake-ups) when installed,
-- else backoff polling.  A broken mongolock.wait is an error, not a
-- silent fallback.
local wait
do
  local ok, mod = pcall(require, "mongolock.wait")
  if ok and type(mod) == "table" and mod.sleep_until_retry then
    wait = mod
  elseif not ok and not tostring(mod):find("module 'mongolock.wait' not found", 1, true) then
    error(mod, 0)
  else
    wait = backoff
  end
end

local _M = {
  _VERSION = "0.1.0",
  defaults = {
    database = nil,        -- the URI's database, else "mongolock"
    collection = "locks",
    ttl = 30,              -- seconds a lease lasts unless extended
    timeout = 10,          -- seconds acquire waits
    step = 0.001,          -- first backoff step (s)
    ratio = 2,             -- step growth per attempt
    max_step = 0.5,        -- largest step (s)
    expire_after = 86400,  -- TTL index: idle lock documents removed after (s)
    renew = false,         -- background renewal (mongolock.wait / renew)
    wait = "auto",         -- "auto" | "watch" | "poll" (mongolock.wait)
    queue_ttl = 3,         -- seconds a waiter's place in the queue is kept
                           -- after its latest attempt (it comes back at
                           -- half of it while it waits)
  },
}
local defaults = _M.defaults

local mt = { __index = _M }

-- the wait module in use (tests and issue-specific waiters swap it)
function _M.set_wait(w)
  if w == nil then w = backoff end
  check_type(w, "table", 1, "set_wait")
  wait = w
end
function _M.get_wait() return wait end

-- the wait strategy option, checked by the wait module when it has modes
local function check_wait(mode, argn, fname, level)
  if wait.check_mode then return wait.check_mode(mode, argn, fname, (level or 2) + 1) end
  if type(mode) ~= "string" then
    argerror(argn, fname, "wait must be a string", (level or 2) + 1)
  end
  return mode
end

local MAX_NAME = 1024

-- raises at the caller of fname unless name is a valid lock name
local function check_name(name, fname, level)
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
_M.check_name = check_name

-- opts: database, collection, ttl, timeout, step, ratio, max_step,
-- expire_after, renew.  Bad options raise here, not at first use.
function _M.new(client, opts)
  check_type(opts, "table", 1, "locks", true, 2)
  opts = opts or {}
  local self = {
    client = client,
    core = client._core,
    database = check_type(opts.database, "string", 1, "locks", true, 2)
      or client:default_database(),
    collection = check_type(opts.collection, "string", 1, "locks", true, 2) or defaults.collection,
    ttl = opts.ttl ~= nil and check_seconds(opts.ttl, 1, "locks", "ttl", 2) or defaults.ttl,
    timeout = opts.timeout ~= nil and check_seconds(opts.timeout, 1, "locks", "timeout", 2)
      or defaults.timeout,
    step = opts.step ~= nil and check_seconds(opts.step, 1, "locks", "step", 2) or defaults.step,
    ratio = opts.ratio ~= nil and check_seconds(opts.ratio, 1, "locks", "ratio", 2) or defaults.ratio,
    max_step = opts.max_step ~= nil and check_seconds(opts.max_step, 1, "locks", "max_step", 2)
      or defaults.max_step,
    expire_after = opts.expire_after ~= nil
      and check_seconds(opts.expire_after, 1, "locks", "expire_after", 2) or defaults.expire_after,
    renew = opts.renew ~= nil and opts.renew or defaults.renew,
    queue_ttl = opts.queue_ttl ~= nil and check_seconds(opts.queue_ttl, 1, "locks", "queue_ttl", 2)
      or defaults.queue_ttl,
    wait = wait.check_mode and wait.check_mode(opts.wait, 1, "locks", 2) or defaults.wait,
    app = client.appname,
  }
  if self.ratio < 1 then argerror(1, "locks", "ratio must be >= 1", 2) end
  if self.wait ~= nil then check_wait(self.wait, 1, "locks", 2) end
  if #self.database == 0 or #self.collection == 0 then
    argerror(1, "locks", "database and collection must not be empty", 2)
  end
  self.key = (client.uri or "") .. "\0" .. self.database .. "\0" .. self.collection
  return setmetatable(self, mt)
end

-- the TTL index, once per server, collection and process: keyed by URI,
-- database and collection; a forked child makes it once more
local indexed = {}

local function ensure_index(self)
  local key = self.key
  if indexed[key] == getpid() then return true end
  local ok, err, code = self.core:ensure_index(self.database, self.collection,
    math_ceil(self.expire_after))
  -- 85/86: an index on expiresAt exists with other options; it serves
  if not ok and code ~= 85 and code ~= 86 then return nil, err, code end
  indexed[key] = getpid()
  return true
end

-- per-call options over the locks' own: ttl, timeout, renew, step, ratio,
-- max_step.  Returns ttl_ms and the merged wait options.
local function call_opts(self, opts, fname)
  if opts == nil then return math_ceil(self.ttl * 1000), self end
  check_type(opts, "table", 2, fname, false, 3)
  local o = setmetatable({}, { __index = self })
  if opts.ttl ~= nil then o.ttl = check_seconds(opts.ttl, 2, fname, "ttl", 3) end
  if opts.timeout ~= nil then o.timeout = check_seconds(opts.timeout, 2, fname, "timeout", 3) end
  if opts.step ~= nil then o.step = check_seconds(opts.step, 2, fname, "step", 3) end
  if opts.ratio ~= nil then o.ratio = check_seconds(opts.ratio, 2, fname, "ratio", 3) end
  if opts.max_step ~= nil then o.max_step = check_seconds(opts.max_step, 2, fname, "max_step", 3) end
  if opts.renew ~= nil then o.renew = opts.renew and true or false end
  if opts.queue_ttl ~= nil then
    o.queue_ttl = check_seconds(opts.queue_ttl, 2, fname, "queue_ttl", 3)
  end
  if opts.wait ~= nil then o.wait = check_wait(opts.wait, 2, fname, 3) end
  return math_ceil(o.ttl * 1000), o
end

-- one attempt: h | nil, "busy", info | nil, err, code.  waiter: the
-- acquire's id, which queues it (nil: a try)
local function attempt(self, name, ttl_ms, o, waiter, queue_ms, polling)
  if self.core:closed() then return nil, "closed" end
  local ok, err, code = ensure_index(self)
  if not ok then return nil, err, code end
  return self.core:acquire(self.database, self.collection, name, ttl_ms, self.app, o.renew,
    waiter, queue_ms, polling)
end

-- h, err = locks:try(name, opts): one attempt; nil, "busy", info when held
function _M.try(self, name, opts)
  check_name(name, "try")
  local ttl_ms, o = call_opts(self, opts, "try")
  return attempt(self, name, ttl_ms, o)
end

-- the wait loop of acquire and with, once the arguments are checked
local function wait_for(self, name, ttl_ms, o)
  local deadline = monotonic() + o.timeout
  local waiter, werr = core.waiter_id()
  if not waiter then return nil, werr end
  local queue_ms = math_ceil(o.queue_ttl * 1000)
  local state, queued
  -- a waiter that gives up takes its place out of the queue (best effort:
  -- it lapses after queue_ttl anyway)
  local function give_up(...)
    if queued and not self.core:closed() then
      pcall(self.core.leave, self.core, self.database, self.collection, name, waiter)
    end
    return nil, ...
  end
  while true do
    local started = monotonic()
    -- a waiter that polls (wait = "poll", or no change stream) says so in
    -- its queue entry: it cannot be woken, and does not hold others up
    local polling = o.wait == "poll" or (state ~= nil and state.polling)
    local h, err, info = attempt(self, name, ttl_ms, o, waiter, queue_ms, polling)
    if h then return h end
    if err ~= "busy" then return give_up(err, info) end
    queued = queued or info.position ~= nil
    if monotonic() >= deadline then return give_up("timeout", info) end
    if not state then
      state = { locks = self, name = name, attempt = 0, step = o.step, deadline = deadline,
                waiter = waiter,
                opts = { step = o.step, ratio = o.ratio, max_step = o.max_step, wait = o.wait } }
    end
    state.attempt = state.attempt + 1
    state.info = info
    state.refresh_at = info.position and started + o.queue_ttl / 2 or nil
    -- nil, err only when wait = "watch" finds no change stream
    local ok, serr, scode = wait.sleep_until_retry(state)
    if ok == nil and serr ~= nil then return give_up(serr, scode) end
  end
end

-- h, err = locks:acquire(name, opts): waits up to opts.timeout;
-- nil, "timeout", info when still held then
function _M.acquire(self, name, opts)
  check_name(name, "acquire")
  local ttl_ms, o = call_opts(self, opts, "acquire")
  return wait_for(self, name, ttl_ms, o)
end

local function release_quietly(h)
  local ok = pcall(h.close, h)
  return ok
end

local function finish(h, ok, ...)
  release_quietly(h)
  if not ok then error((...), 0) end
  return ...
end

-- locks:with(name, opts, fn, ...) -> fn's results | nil, err:
-- runs fn(h, ...) holding the lock; always releases; re-raises fn's error
function _M.with(self, name, opts, fn, ...)
  check_name(name, "with")
  if type(opts) == "function" then
    return _M.with(self, name, nil, opts, fn, ...)
  end
  check_type(opts, "table", 2, "with", true)
  check_type(fn, "function", 3, "with")
  if opts == nil or opts.renew == nil then
    -- fn may run longer than a ttl: with renews in the background
    local o = { renew = true }
    if opts then for k, v in pairs(opts) do o[k] = v end end
    opts = o
  end
  local ttl_ms, o = call_opts(self, opts, "with")
  local h, err, code = wait_for(self, name, ttl_ms, o)
  if not h then return nil, err, code end
  return finish(h, pcall(fn, h, ...))
end

-- locks:status(name) -> {held, owner, token, acquired_at, expires_at,
-- remaining, waiting (live queued waiters), holder = {host, pid, app}} |
-- nil (never acquired) |
-- nil, err, code.  One aggregate.
function _M.status(self, name)
  check_name(name, "status")
  if self.core:closed() then return nil, "closed" end
  local st, err, code = self.core:status(self.database, self.collection, name)
  if st == nil then return nil, err, code end
  return st
end

-- locks:list() -> { status, ... } sorted by name (each with .name)
function _M.list(self)
  if self.core:closed() then return nil, "closed" end
  return self.core:list(self.database, self.collection)
end

-- locks:force_release(name) -> true | nil, "not held": frees the lock
-- whoever holds it (for people cleaning up; the holder's next release or
-- extend answers "not held" / "lost")
function _M.force_release(self, name)
  check_name(name, "force_release")
  if self.core:closed() then return nil, "closed" end
  return self.core:force_release(self.database, self.collection, name)
end

return _M
