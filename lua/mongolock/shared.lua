-- Internal to mongolock: programs reach these methods through client:rwlocks(),
-- client:semaphores() and client:acquire_all(), not by requiring this module,
-- which may change without notice.
--
-- Reader-writer locks and counting semaphores on the named locks'
-- documents (doc/design.md, "Shared kinds").
--
--   local rw = client:rwlocks{ ttl = 30 }
--   local r = assert(rw:read("cache"))       -- one of any number of readers
--   local w = assert(rw:write("cache"))      -- alone: an exclusive lock
--
--   local sem = client:semaphores{ permits = 4 }
--   local p = assert(sem:acquire("gpu"))     -- one of 4 permits
--
-- Every share and permit is a mongolock.Lock of its own (h.kind "shared"
-- or "permit"): its own owner id, lease on the server's clock, fencing
-- token (one sequence per name across every kind), renewal, lost signal,
-- release by its holder only, <close> and __gc.  A writer is an ordinary
-- exclusive lock (client:locks on the same collection): it waits until no
-- share or permit is live, and readers that arrive while a writer waits
-- queue behind it (writers first).

--- Reader-writer locks (`client:rwlocks(opts)`), counting semaphores (`client:semaphores(opts)`) and
-- sets of locks (`client:acquire_all(entries, opts)`).
-- @classmod rw

local core = require "mongolock.core"
local args = require "mongolock.args"
local loop = require "mongolock.loop"
local runners = require "mongolock.runners"
local stats = require "mongolock.stats"
local locks_mod = require "mongolock.locks"

local type = type
local pcall = pcall
local pairs = pairs
local ipairs = ipairs
local math_max = math.max
local setmetatable = setmetatable
local getmetatable = getmetatable
local string_format = string.format
local math_ceil = math.ceil
local math_floor = math.floor
local monotonic = core.monotonic
local argerror = args.argerror
local check_name = args.check_name

local _M = { _VERSION = "0.1.0", PERMITS_MAX = 1000000 }

local function check_permits(v, n, fname, level)
  if type(v) ~= "number" or v ~= v or v < 1 or v > _M.PERMITS_MAX or math_floor(v) ~= v then
    argerror(n, fname, "permits must be an integer from 1 to 1000000, got " .. args.shown(v),
      level + 1)
  end
  return v
end

-- the options of a call and their checks: mongolock.locks's, and permits
local CHECKS = setmetatable({
  permits = function(v, n, fname, _, level)
    check_permits(v, n, fname, level + 1)
    return v
  end,
}, { __index = locks_mod.checks })
local CALL_OPTS = { "ttl", "timeout", "renew", "step", "ratio", "max_step", "queue_ttl", "wait", "lock_delay" }
local VALID_CALL = { rw = args.set(CALL_OPTS), semaphore = args.set(CALL_OPTS, { "permits" }) }

local function check_call(self, opts, n, fname, level)
  level = level + 1
  if opts == nil then opts = {} end
  args.check_type(opts, "table", n, fname, false, level)
  args.check_keys(opts, VALID_CALL[self.kind], n, fname, level)
  local o = setmetatable({}, { __index = self.o })
  for k, v in pairs(opts) do o[k] = CHECKS[k](v, n, fname, k, level) end
  if self.kind == "semaphore" and o.permits == nil then
    argerror(n, fname, "permits expected (semaphores{permits = N} or {permits = N})", level)
  end
  return o
end

local mt = { __index = _M }

-- kind: "rw" | "semaphore"; opts: those of client:locks, and permits
-- the options of client:locks (its defaults' names), and permits
local VALID_NEW = { rw = { database = true }, semaphore = { database = true, permits = true } }
for k in pairs(locks_mod.defaults) do
  VALID_NEW.rw[k], VALID_NEW.semaphore[k] = true, true
end

function _M.new(client, kind, opts, fname)
  args.check_type(opts, "table", 1, fname, true, 3)
  args.check_keys(opts or {}, VALID_NEW[kind], 1, fname, 3)
  local lopts, permits = {}, nil
  for k, v in pairs(opts or {}) do
    if k == "permits" then
      permits = check_permits(v, 1, fname, 3)
    else
      lopts[k] = v
    end
  end
  -- the exclusive side and every option's check and default
  local locks = locks_mod.new(client, lopts, fname, 4)
  local o = {
    ttl = locks.ttl, timeout = locks.timeout, step = locks.step, ratio = locks.ratio,
    max_step = locks.max_step, queue_ttl = locks.queue_ttl or 3, renew = locks.renew and true,
    wait = locks.wait, permits = permits,
  }
  return setmetatable({
    kind = kind, locks = locks, client = client, core = client._core,
    database = locks.database, collection = locks.collection, bound = locks.bound,
    expire_after = locks.expire_after or 86400, app = client.appname, o = o,
    series = stats.series(client, kind == "rw" and "shared" or "permit", locks.database,
      locks.collection),
  }, mt)
end

-- the core, or inside nginx where the request can yield its stand-in
-- (mongolock.runners.core_of: every round trip in a worker thread)
local core_of = runners.core_of

-- the TTL index, once per collection and process, after an attempt the
-- server answered; its failure fails no acquisition
-- (mongolock.locks.ensure_index)
local function ensure_index(self)
  local key = "shared\0" .. self.database .. "\0" .. self.collection .. "\0" .. tostring(self.core)
  locks_mod.ensure_index(key, self.database .. "." .. self.collection, function()
    return core_of(self):ensure_index(self.database, self.collection, math_ceil(self.expire_after))
  end)
end

-- a field of the server's reply, nil for null (absent, as in the
-- exclusive kind's info)
local function value(v)
  if v == core.null then return nil end
  return v
end

-- the projected document of a failed attempt, as the exclusive kind's info
local function to_info(v)
  local info = {
    token = v.token, permits = v.permits, holders = v.holders, readers = v.readers,
    exclusive = v.exclusive, queued = v.queued, writers = v.writers, owner = value(v.owner),
    holder = value(v.holder), operation_time = v.operation_time,
  }
  if type(v.remainingMs) == "number" then
    info.remaining = v.remainingMs > 0 and v.remainingMs / 1000 or 0
  end
  if type(v.position) == "number" and v.position >= 0 then info.position = v.position + 1 end
  -- in a lock-delay (a share, permit or writer's lease that ended unreleased)
  if type(v.delayMs) == "number" and v.delayMs > 0 then
    info.delayed, info.delay = true, v.delayMs / 1000
  end
  return info
end

local function mismatch(name, mode, o, info)
  local msg
  if mode == "shared" then
    msg = string_format("%q is a semaphore of %s permits, not a reader-writer lock", name,
      tostring(info.permits))
  elseif info.permits then
    msg = string_format("semaphore %q has %d permits, not %d", name, info.permits, o.permits)
  else
    msg = string_format("%q has reader shares: it is a reader-writer lock, not a semaphore",
      name)
  end
  info.mismatch = true
  return nil, msg, info
end

-- one attempt: h | nil, "busy", info | nil, message[, code | info]
local function attempt(self, mode, name, o, waiter, queue_ms, polling, deadline)
  if self.core:closed() then return nil, "closed" end
  if not waiter and not runners.ngx_core(self.client) then
    -- one attempt (timeout = 0): a dead server answers within a second
    local ready, err, code = loop.one_attempt_ready(self.core, self.bound, self.client.attempt_bound)
    if not ready then return nil, err, code end
  end
  local function send()
    return core_of(self):share_acquire(self.database, self.collection, name, mode,
      o.permits, math_ceil(o.ttl * 1000), self.app, o.renew, waiter, queue_ms, polling, deadline,
      math_ceil((o.lock_delay or 0) * 1000))
  end
  -- one attempt: bounded by the client's attempt_timeout (loop.single)
  local h, e, v
  if waiter then h, e, v = send() else h, e, v = loop.single(self, send) end
  if h or e == "busy" or e == "mismatch" then ensure_index(self) end
  if h then return locks_mod.note_handle(self.client, h) end
  if e == "busy" then
    local info = to_info(v)
    if locks_mod.own_deadlock(self.client, self.database, self.collection, name, info, deadline) then
      return nil, "deadlock", info
    end
    return nil, "busy", info
  end
  if e == "mismatch" then return mismatch(name, mode, o, to_info(v)) end
  return nil, e, v
end

-- the wait loop (mongolock.loop's, as named locks'): queued in the
-- document's squeue, woken by the change stream (mongolock.wait) or by
-- backoff polling
local function wait_for(self, mode, name, o)
  if o.timeout == 0 then
    -- one attempt, as try makes it: it takes no place in the queue
    local h, err, info = attempt(self, mode, name, o)
    if err == "busy" then err = "timeout" end
    return stats.count_one(self.series, h, err, info)
  end
  local waiter, werr = core.waiter_id()
  if not waiter then return nil, werr end
  local queue_ms = math_ceil(o.queue_ttl * 1000)
  return loop.acquire({
    owner = self, core = self.core, bound = self.bound, timeout = o.timeout, series = self.series,
    -- the exclusive locks' wait step (mongolock.locks.set_wait swaps it)
    wait = locks_mod.get_wait(), poll = o.wait == "poll", refresh = o.queue_ttl / 2,
    attempt = function(polling, _, deadline)
      return attempt(self, mode, name, o, waiter, queue_ms, polling, deadline)
    end,
    new_state = function(deadline) return loop.wait_state(self, name, waiter, o, deadline) end,
    -- a waiter that gives up (mongolock.loop, as named locks): its place in
    -- the document's squeue, and a share an attempt without a reply may
    -- have taken
    leave = function(c) return c:share_leave(self.database, self.collection, name, waiter) end,
    release_later = function(c)
      return c:release_later("shared", self.database, self.collection, name, waiter)
    end,
  })
end

local function with(self, mode, fname, name, opts, fn, ...)
  check_name(name, fname, 3)
  if type(opts) == "function" then return with(self, mode, fname, name, nil, opts, fn, ...) end
  if type(fn) ~= "function" then argerror(3, fname, "function expected, got " .. type(fn), 3) end
  local o = check_call(self, opts, 2, fname, 3)
  if opts == nil or opts.renew == nil then o.renew = true end
  local h, err, code = wait_for(self, mode, name, o)
  if not h then return nil, err, code end
  return loop.run_with(h, fn, ...)
end

local status_of

--- The state of the name: its holders, permits, waiters.
-- status(name) -> {name, permits, token, exclusive, holders = {{owner, mode,
-- token, remaining, holder}}, in_use, waiting, writers} | nil (no such
-- lock) | nil, err, code.  One aggregate.
function _M.status(self, name)
  check_name(name, "status", 2)
  if self.core:closed() then return nil, "closed" end
  local st, err, code = core_of(self):share_status(self.database, self.collection, name)
  if st == nil then return nil, err, code end
  return status_of(st)
end

--- The status of every name with shares, permits or waiters.
-- list() -> { status, ... } of every name with shares, permits or waiting
-- sharers (each with .name), sorted by name.  One aggregate.
function _M.list(self)
  if self.core:closed() then return nil, "closed" end
  local all, err, code = core_of(self):share_status(self.database, self.collection)
  if all == nil then return nil, err, code end
  local out = {}
  for i, st in ipairs(all) do out[i] = status_of(st) end
  return out
end

function status_of(st)
  local holders = {}
  for i, e in ipairs(st.holders or {}) do
    holders[i] = { owner = e.owner, mode = e.mode == "p" and "permit" or "shared",
      token = e.token, holder = e.holder,
      remaining = type(e.remainingMs) == "number" and math_max(e.remainingMs, 0) / 1000 or nil }
  end
  local delay = type(st.delayMs) == "number" and st.delayMs > 0 and st.delayMs / 1000 or nil
  return { name = st._id, permits = st.permits, token = st.token, exclusive = st.exclusive,
    holders = holders, in_use = #holders, waiting = st.waiting, writers = st.writers,
    delayed = delay and true or nil, delay = delay }
end

--- Ends every share or permit of the name, whoever holds them.
-- force_release(name) -> true | nil, "not held": ends every share or
-- permit of the name, whoever holds them
function _M.force_release(self, name)
  check_name(name, "force_release", 2)
  if self.core:closed() then return nil, "closed" end
  return core_of(self):share_force_release(self.database, self.collection, name)
end

-- ---- reader-writer locks --------------------------------------------------

--- Takes a reader's share of name, waiting up to opts.timeout.
function _M.read(self, name, opts)
  check_name(name, "read", 2)
  return wait_for(self, "shared", name, check_call(self, opts, 2, "read", 2))
end

--- One attempt to take a reader's share of name.
function _M.try_read(self, name, opts)
  check_name(name, "try_read", 2)
  return stats.count_one(self.series, attempt(self, "shared", name, check_call(self, opts, 2, "try_read", 2)))
end

--- Runs fn(h, ...) holding a reader's share of name; always releases.
function _M.with_read(self, name, opts, fn, ...)
  return with(self, "shared", "with_read", name, opts, fn, ...)
end

--- Takes name alone, as a writer, waiting up to opts.timeout.
function _M.write(self, name, opts) return self.locks:acquire(name, opts) end
--- One attempt to take name alone, as a writer.
function _M.try_write(self, name, opts) return self.locks:try(name, opts) end
--- Runs fn(h, ...) holding name alone, as a writer; always releases.
function _M.with_write(self, name, opts, fn, ...) return self.locks:with(name, opts, fn, ...) end

-- ---- semaphores -------------------------------------------------------------

local sem = setmetatable({}, { __index = _M })
local sem_mt = { __index = sem }

--- A semaphore: what `client:semaphores(opts)` returns (status, list and force_release as rw's).
-- @type sem

--- Takes a permit of name (opts.permits of the semaphore), waiting up to opts.timeout.
function sem.acquire(self, name, opts)
  check_name(name, "acquire", 2)
  return wait_for(self, "permit", name, check_call(self, opts, 2, "acquire", 2))
end

--- One attempt to take a permit of name.
function sem.try(self, name, opts)
  check_name(name, "try", 2)
  return stats.count_one(self.series, attempt(self, "permit", name, check_call(self, opts, 2, "try", 2)))
end

--- Runs fn(h, ...) holding a permit of name; always releases.
function sem.with(self, name, opts, fn, ...)
  return with(self, "permit", "with", name, opts, fn, ...)
end

-- ---- several locks at once --------------------------------------------------

_M.SET_MAX = 64
local SET_OPTS = args.set({ "timeout", "ttl", "renew" })

local set_methods = {}
local set_mt = { __index = set_methods, __name = "mongolock.LockSet" }

--- A set: what `client:acquire_all(entries, opts)` returns.
-- @type set

--- Releases every lock of the set.
-- set:release([changes]) -> true | nil, err of the first handle that
-- failed (every handle is released anyway); afterwards nil, "not held".
-- changes: {[i] = changes} for the document locks among the entries (i:
-- the entry's place in the caller's list), written by their release
function set_methods.release(self, changes)
  local hs = self.handles
  if changes ~= nil and type(changes) ~= "table" then
    argerror(1, "release", "table expected, got " .. type(changes), 2)
  end
  if not hs then return nil, "not held" end
  if changes then
    for i, ch in pairs(changes) do
      local e = type(i) == "number" and self.entries[i]
      if not e or not e.doc then
        argerror(1, "release", "changes[" .. tostring(i) .. "]: not a document lock of the set", 2)
      end
      if type(ch) ~= "table" then
        argerror(1, "release", "changes[" .. tostring(i) .. "]: table expected, got " .. type(ch), 2)
      end
    end
  end
  self.handles = nil
  local ok, first = true, nil
  for k = #hs, 1, -1 do
    local ch = changes and changes[self.order[k]]
    local r, err
    if ch then r, err = hs[k]:release(ch) else r, err = hs[k]:release() end
    if not r and ok then ok, first = false, err end
  end
  if ok then return true end
  return nil, first
end

--- The handle of the caller's i-th entry (and a document lock's document).
-- set:get(i) -> h, doc: the handle of the caller's i-th entry and, for a
-- document lock, the document as locked
function set_methods.get(self, i)
  local e = self.entries[i]
  if not e then argerror(1, "get", "no entry " .. tostring(i) .. " in the set", 2) end
  return e.h, e.doc
end

--- Releases what is still held; errors are swallowed.
-- set:close() -> true: releases what is held; errors are swallowed
function set_methods.close(self)
  local hs = self.handles
  self.handles = nil
  if hs then for i = #hs, 1, -1 do pcall(hs[i].close, hs[i]) end end
  return true
end

--- Whether every lock of the set is still held.
-- set:check() -> true | nil, err of the first handle no longer held
function set_methods.check(self)
  if not self.handles then return nil, "not held" end
  for _, h in ipairs(self.handles) do
    local ok, err = h:check()
    if not ok then return nil, err end
  end
  return true
end

set_mt.__close = set_methods.close
set_mt.__gc = set_methods.close

local documents_mod, obj_key, id_key

-- the kind of a set entry's object, and the mode it asks
local function entry_kind(e, i)
  if type(e) ~= "table" then
    argerror(1, "acquire_all", string_format("entry %d: table expected, got %s", i, type(e)), 4)
  end
  local obj, name, mode = e[1], e[2], e[3]
  if documents_mod().is(obj) then
    if name == nil then argerror(1, "acquire_all", string_format("entry %d: _id expected, got nil", i), 4) end
    local ok, err = core.bson_encode({ _id = name })
    if not ok or core.bsontype(name) == "array" then
      argerror(1, "acquire_all", string_format("entry %d: not an _id (%s)", i,
        tostring(err or "an array")), 4)
    end
    if mode ~= nil then
      argerror(1, "acquire_all", string_format("entry %d: no mode for this kind", i), 4)
    end
    return obj, name, "document"
  end
  if type(obj) ~= "table" or type(obj.database) ~= "string" or type(obj.collection) ~= "string" then
    argerror(1, "acquire_all", string_format("entry %d: a locks, rwlocks, semaphores or documents "
      .. "object expected", i), 4)
  end
  check_name(name, "acquire_all", 4)
  local kind = getmetatable(obj) == mt and "rw" or getmetatable(obj) == sem_mt and "semaphore"
    or "locks"
  if kind == "rw" then
    if mode ~= "read" and mode ~= "write" then
      argerror(1, "acquire_all", string_format('entry %d: mode must be "read" or "write"', i), 4)
    end
  elseif mode ~= nil then
    argerror(1, "acquire_all", string_format("entry %d: no mode for this kind", i), 4)
  end
  if kind == "semaphore" and obj.o.permits == nil then
    argerror(1, "acquire_all", string_format("entry %d: a semaphores object without permits "
      .. "(semaphores{permits = N})", i), 4)
  end
  return obj, name, kind, mode
end

-- one entry of a set: h | nil, err, info (a document lock: h, doc)
local function take(e, o)
  if e.kind == "document" then
    local doc, h, info = e.obj:lock(e.name, o)
    if not doc then return nil, h, info end
    return h, doc
  end
  if e.kind == "rw" and e.mode == "read" then return e.obj:read(e.name, o) end
  if e.kind == "rw" then return e.obj:write(e.name, o) end
  return e.obj:acquire(e.name, o)
end

local documents
function documents_mod()
  documents = documents or require("mongolock.documents")
  return documents
end

-- the canonical order's key of an entry's lock document: its database and
-- collection, then its _id (id_key)
function obj_key(obj, kind)
  if kind == "document" then return obj.db .. "\0" .. obj.coll .. "\0" end
  return obj.database .. "\0" .. obj.collection .. "\0"
end

-- a name or _id as one key, the same in every process: a string as it is
-- (a named lock's document has its name as _id), a number by its value
-- (42 and 42.0 are one _id to the server), any other value by its BSON
function id_key(id)
  if type(id) == "string" then return id end
  if type(id) == "number" then return "\255n" .. string_format("%.17g", id) end
  return "\255b" .. core.bson_encode({ _id = id })
end

-- set, err = acquire_all(entries, opts): every entry or none, within one
-- timeout.  entries: { {locks, name}, {rwlocks, name, "read" | "write"},
-- {semaphores, name}, {documents, _id}, ... }, at most SET_MAX, no name twice in one
-- collection.  They are taken one after the other in one canonical order
-- (database, collection, name), so that callers asking for overlapping
-- sets in any order never wait for each other in a cycle; on a failure
-- (timeout, error) those taken are released.  opts: timeout (seconds,
-- default 10), ttl, renew (applied to every entry).
function _M.acquire_all(entries, opts)
  if type(entries) ~= "table" then
    argerror(1, "acquire_all", "table expected, got " .. type(entries), 2)
  end
  if opts ~= nil and type(opts) ~= "table" then
    argerror(2, "acquire_all", "table expected, got " .. type(opts), 2)
  end
  opts = opts or {}
  args.check_keys(opts, SET_OPTS, 2, "acquire_all", 2)
  for k, v in pairs(opts) do CHECKS[k](v, 2, "acquire_all", k, 2) end
  local timeout = opts.timeout == nil and 10 or opts.timeout
  local n = #entries
  if n == 0 then argerror(1, "acquire_all", "no entries", 2) end
  if n > _M.SET_MAX then
    argerror(1, "acquire_all", "more than " .. _M.SET_MAX .. " entries", 2)
  end
  local list, seen = {}, {}
  for i = 1, n do
    local obj, name, kind, mode = entry_kind(entries[i], i)
    local key = obj_key(obj, kind) .. id_key(name)
    if seen[key] then
      argerror(1, "acquire_all", string_format("entry %d: %s is in the set twice", i,
        type(name) == "string" and string_format("%q", name) or "its _id"), 2)
    end
    seen[key] = true
    list[i] = { obj = obj, name = name, kind = kind, mode = mode, key = key, index = i }
  end
  table.sort(list, function(x, y) return x.key < y.key end)
  local deadline = monotonic() + timeout
  local held, order, by_index = {}, {}, {}
  for _, e in ipairs(list) do
    -- at least one attempt each: a timeout must be positive
    local o = { timeout = math.max(deadline - monotonic(), 0.001), ttl = opts.ttl,
      renew = opts.renew }
    -- whatever happens (a failure, or an error raised), those taken are
    -- given back before acquire_all returns
    local ok, h, err, info = pcall(take, e, o)
    if not ok or not h then
      for i = #held, 1, -1 do pcall(held[i].close, held[i]) end
      if not ok then error(h, 0) end
      return nil, err, info
    end
    held[#held + 1] = h
    order[#held] = e.index
    -- err: a document lock's document
    by_index[e.index] = { h = h, doc = e.kind == "document" and err or nil }
  end
  return setmetatable({ handles = held, order = order, entries = by_index }, set_mt)
end

function _M.rwlocks(client, opts)
  local rw = _M.new(client, "rw", opts, "rwlocks")   -- no tail call: errors name the caller
  return rw
end

function _M.semaphores(client, opts)
  return setmetatable(_M.new(client, "semaphore", opts, "semaphores"), sem_mt)
end

return _M
