-- resty.mongolock: lua-resty-lock's API on a mongolock named lock, so that
-- OpenResty handlers on every host of a fleet exclude each other, not only
-- the workers of one host.
--
--   local lock = require("resty.mongolock"):new({ uri = ..., exptime = 30 })
--   local elapsed, err = lock:lock("key")    -- nil, "timeout" | "locked"
--   ... the critical section ...
--   local ok, err = lock:unlock()            -- nil, "unlocked"
--
-- Invariants:
-- - lock() is client:locks()'s acquire (a try when timeout is 0): one
--   round trip when the lock is free, else queued in the lock document
--   (one order for every worker and host) and woken by the change stream;
--   unlock() and expire() are the handle's release and extend.  The handle
--   is the library's (inside nginx too: its round trips are jobs,
--   mongolock.ngx.runner).  Waiting on the gate is on an ngx.semaphore, so
--   the worker keeps serving other requests meanwhile.
-- - The gate: in a worker, the lock objects waiting for one key queue in
--   arrival order and only the gate's owner asks the server, so the server
--   sees at most one waiter per worker and key, and a release hands over to
--   the worker's next waiter at once.  The gate is a hint that never blocks
--   for good: it is free once its owner unlocks, gives up, is collected, or
--   outlives its deadline (the lease end while it holds the lock, the end
--   of its wait while it waits), and every waiter looks again at least
--   every max_step.  Exclusion itself comes only from the server.
-- - Clients are made lazily, once per process: a client made before fork
--   (init_by_lua) is never used by a worker, which makes its own.
-- - A lock object holds at most one lock at a time; a lock object collected
--   while holding releases through the handle's own __gc.

--- lua-resty-lock's API on a mongolock named lock: OpenResty handlers on every host of a fleet exclude
-- each other.
-- @module resty.mongolock

local mongolock = require "mongolock"
local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"
local locks_mod = require "mongolock.locks"
local check_name = args.check_name

local ok_sema, semaphore = pcall(require, "ngx.semaphore")
if not ok_sema then semaphore = nil end

local type, pairs, ipairs, tostring = type, pairs, ipairs, tostring
local setmetatable, rawget = setmetatable, rawget
local math_min, math_max = math.min, math.max
local table_remove = table.remove
local getpid = core.getpid
local monotonic = core.monotonic

local _M = { _VERSION = "0.1.0" }
local mt = { __index = _M }

-- every default, written down once (lua-resty-lock's, but the collection)
local defaults = {
  exptime = 30,        -- lease length (s); lua-resty-lock's exptime
  timeout = 5,         -- how long lock() waits (s): 0 one attempt, math.huge for ever
  step = args.backoff.step,             -- first sleep between attempts (s)
  ratio = args.backoff.ratio,           -- the step grows by this factor
  max_step = args.backoff.max_step,     -- up to this (s)
  collection = "locks",
  lock_delay = 0,      -- s the key stays taken after a lease that ended unreleased
  server_selection_timeout = 1,   -- s an attempt waits for a server unless the URI says (libmongoc: 30)
}
_M.defaults = defaults

local VALID = args.set({ "uri", "client", "database", "collection", "appname", "exptime",
  "timeout", "step", "ratio", "max_step", "server_selection_timeout", "server_timeout", "mode",
  "permits", "lock_delay" })

-- per process: uri -> client, uri|db|collection -> locks, and the gates
-- (locks -> key -> gate)
local cache = { pid = nil, clients = {}, locks = {}, gates = {} }

-- phases where ngx.semaphore and ngx.sleep yield
local yieldable = runners.yieldable

local function locks_for(opts)
  local pid = getpid()
  if cache.pid ~= pid then
    -- a forked worker: the parent's objects stay the parent's
    cache = { pid = pid, clients = {}, locks = {}, gates = {} }
  end
  local client = opts.client
  local key
  if client then
    key = tostring(client)
  else
    local sst = opts.server_selection_timeout
    if sst == nil and not opts.uri:lower():find("serverselectiontimeoutms=", 1, true) then
      sst = defaults.server_selection_timeout
    end
    key = opts.uri .. "|" .. tostring(sst) .. "|" .. tostring(opts.server_timeout)
    client = cache.clients[key]
    if not client then
      local err
      client, err = mongolock.connect(opts.uri, { appname = opts.appname or "resty.mongolock",
                                                  server_selection_timeout = sst,
                                                  server_timeout = opts.server_timeout })
      if not client then return nil, err end
      cache.clients[key] = client
    end
  end
  key = key .. "|" .. tostring(opts.database) .. "|" .. opts.collection
  local locks = cache.locks[key]
  if not locks then
    local err
    locks, err = client:locks({ database = opts.database, collection = opts.collection, ttl = opts.exptime })
    if not locks then return nil, err end
    cache.locks[key] = locks
  end
  return locks
end

--- A lock object (opts: uri or client, exptime, timeout, mode, permits, ...).
-- syntax: obj, err = mongolock:new(opts)
--         obj, err = mongolock:new(dict_name, opts)   (lua-resty-lock's form)
-- opts: uri (else MONGODB_URI) or client, database, collection, exptime,
-- timeout, step, ratio, max_step, appname, server_selection_timeout,
-- server_timeout, mode, permits, lock_delay.  mode = "read" takes a reader's share of
-- the key as a reader-writer lock (readers hold it together; "write", the
-- default, is the exclusive lock writers take); permits = N takes one of
-- N permits of the key as a counting semaphore (every caller gives the same
-- N).  dict_name, lua-resty-lock's shared dictionary, names the
-- collection here (unless opts.collection does): keys of different
-- dictionaries stay apart, as they do in lua-resty-lock.
function _M.new(_, dict_name, opts)
  local n = 1
  if type(dict_name) == "string" then
    n = 2
    args.check_coll(dict_name, nil, 1, "new", "dict_name", 2)
  else
    dict_name, opts = nil, dict_name
  end
  if opts ~= nil and type(opts) ~= "table" then
    args.argerror(n, "new", "table expected, got " .. type(opts), 2)
  end
  opts = opts or {}
  args.check_keys(opts, VALID, n, "new", 2)
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  if o.client ~= nil and (type(o.client) ~= "table" or type(o.client.locks) ~= "function"
                          or o.client._core == nil) then
    args.argerror(n, "new", "client: a mongolock client expected, got " .. args.shown(o.client), 2)
  end
  if o.client == nil then
    if o.uri == nil then o.uri = os.getenv("MONGODB_URI") end
    if type(o.uri) ~= "string" or o.uri == "" then
      args.argerror(n, "new", "uri: a MongoDB URI or a client expected; MONGODB_URI is unset "
        .. "(nginx passes it to workers only with 'env MONGODB_URI;')", 2)
    end
  end
  if o.database ~= nil then args.check_db(o.database, n, "new", "database", 2) end
  if o.collection ~= nil then
    args.check_coll(o.collection, o.database, n, "new", "collection", 2)
  end
  o.collection = o.collection or dict_name or defaults.collection
  o.exptime = o.exptime == nil and defaults.exptime or args.ttl(o.exptime, n, "new", "exptime", 2)
  o.timeout = o.timeout == nil and defaults.timeout
    or args.timeout(o.timeout, n, "new", "timeout", 2)
  o.lock_delay = o.lock_delay == nil and defaults.lock_delay
    or args.delay(o.lock_delay, n, "new", "lock_delay", 2)
  for _, k in ipairs({ "step", "ratio", "max_step" }) do
    o[k] = o[k] == nil and defaults[k] or args.seconds(o[k], n, "new", k, 2)
  end
  if o.ratio < 1 then args.argerror(n, "new", "ratio must be >= 1", 2) end
  for _, k in ipairs({ "server_selection_timeout", "server_timeout" }) do
    if o[k] ~= nil then o[k] = args.seconds(o[k], n, "new", k, 2) end
  end
  -- what connect would refuse, refused here as new's own argument
  if o.server_timeout ~= nil and o.server_timeout > 86400 then
    args.argerror(n, "new", "server_timeout must be at most a day (86400 seconds) (got "
      .. args.shown(o.server_timeout) .. ")", 2)
  end

  if o.mode ~= nil and o.mode ~= "read" and o.mode ~= "write" then
    args.argerror(n, "new", 'mode must be "read" or "write", got ' .. args.shown(o.mode), 2)
  end
  if o.permits ~= nil and o.mode ~= nil then
    args.argerror(n, "new", "mode and permits exclude each other (permits: a semaphore)", 2)
  end

  local locks, err = locks_for(o)
  if not locks then return nil, err end
  -- a reader's share or a permit (mongolock.shared); a bad N raises here
  local shared
  if o.mode == "read" then
    shared = locks.client:rwlocks({ database = locks.database, collection = locks.collection })
  elseif o.permits ~= nil then
    local ok, sem = pcall(locks.client.semaphores, locks.client, { database = locks.database,
      collection = locks.collection, permits = o.permits })
    if not ok then
      args.argerror(n, "new", tostring(sem):match("%((permits[^)]*)%)") or tostring(sem), 2)
    end
    shared = sem
  end
  return setmetatable({
    locks = locks, shared = shared, handle = nil, exptime = o.exptime, timeout = o.timeout,
    lock_delay = o.lock_delay, step = o.step, ratio = o.ratio, max_step = o.max_step,
  }, mt)
end

-- ---- the gate (see the invariants at the top) ------------------------------

-- the gate of locks/key in this worker, or nil outside a yieldable
-- OpenResty phase (plain Lua, init phases): then every waiter polls.
-- gate = { owner = {obj} (weak), deadline = monotonic time, queue = {waiter...} }
-- A gate lives while a lock object or a waiter refers to it (by_key is
-- weak-valued), so keys used once do not accumulate.
local function gate_for(locks, key)
  local ngx = rawget(_G, "ngx")
  if not (semaphore and ngx and ngx.get_phase and yieldable[ngx.get_phase()]) then return nil end
  local by_key = cache.gates[locks]
  if not by_key then
    by_key = setmetatable({}, { __mode = "v" })
    cache.gates[locks] = by_key
  end
  local gate = by_key[key]
  if not gate then
    -- owner is held weakly: a lock object collected frees the gate
    gate = { owner = setmetatable({}, { __mode = "v" }), deadline = 0, queue = {} }
    by_key[key] = gate
  end
  return gate
end

local function gate_free(gate)
  return gate.owner[1] == nil or monotonic() >= gate.deadline
end

local function gate_take(self, gate, deadline)
  gate.owner[1] = self
  gate.deadline = deadline
  self.gate = gate
end

-- drops the waiters at the head of the queue that stopped looking (their
-- request was aborted: its coroutine is gone without leaving the queue);
-- a live waiter looks at least every max_step
local function drop_gone(queue, me)
  local now = monotonic()
  while queue[1] and queue[1] ~= me and now > queue[1].seen + queue[1].every do
    table_remove(queue, 1)
  end
end

local function wake_head(gate)
  drop_gone(gate.queue)
  local head = gate.queue[1]
  if head then head.sema:post(1) end
end

-- the gate's owner leaves: wake the first waiter of this worker
local function gate_leave(self)
  local gate = self.gate
  if not gate then return end
  self.gate = nil
  if gate.owner[1] == self then
    gate.owner[1] = nil
    wake_head(gate)
  end
end

-- waits in the gate's queue until it is this waiter's turn and the gate is
-- free (true), or deadline passes (false).  Each waiter sleeps on its own
-- semaphore: the owner leaving wakes the first; without that wake-up (an
-- owner collected or past its deadline) it looks again at the gate's
-- deadline, or after max_step.  The queue keeps its order through all that;
-- a waiter whose request is gone (it stopped looking) leaves it.
local function gate_enter(self, gate, deadline)
  local queue = gate.queue
  if queue[1] == nil and gate_free(gate) then
    gate_take(self, gate, deadline)
    return true
  end
  local sema, err = semaphore.new(0)
  if not sema then return nil, err end
  -- seen, every: when this waiter last looked, and how often it does
  -- (with room for a busy event loop)
  local me = { sema = sema, seen = monotonic(), every = 2 * self.max_step + 0.1 }
  queue[#queue + 1] = me
  while true do
    local now = monotonic()
    me.seen = now
    drop_gone(queue, me)
    if queue[1] == me and gate_free(gate) then
      table_remove(queue, 1)
      gate_take(self, gate, deadline)
      return true
    end
    local left = deadline - now
    if left <= 0 then
      for i = 1, #queue do
        if queue[i] == me then
          table_remove(queue, i)
          break
        end
      end
      if gate_free(gate) then wake_head(gate) end   -- pass the turn on
      return false
    end
    local nap = self.max_step
    if gate.owner[1] ~= nil and gate.deadline > now then nap = math_min(nap, gate.deadline - now) end
    sema:wait(math_max(0.001, math_min(left, nap)))
  end
end

-- syntax: elapsed, err = obj:lock(key)
-- elapsed: seconds waited before the lock was won (0 at once).
-- err: "timeout" (still held by another after opts.timeout), "locked"
-- (this object already holds a lock), or the library's error.
-- a reader's share or a permit: one try, then the library's wait for the
-- time left (queued in the document, woken by the change stream).  No
-- gate: readers and permit holders of one worker hold the key together.
local function lock_shared(self, key)
  local shared = self.shared
  local permit = shared.kind == "semaphore"
  local start = monotonic()
  local o = { ttl = self.exptime, lock_delay = self.lock_delay }
  local h, err, code
  if permit then h, err, code = shared:try(key, o) else h, err, code = shared:try_read(key, o) end
  local waited = false
  if not h and err == "busy" and self.timeout > 0 then
    waited = true
    o = { ttl = self.exptime, timeout = self.timeout, step = self.step, ratio = self.ratio,
      max_step = self.max_step, lock_delay = self.lock_delay }
    if permit then h, err, code = shared:acquire(key, o) else h, err, code = shared:read(key, o) end
  end
  if not h then
    if err == "busy" or err == "timeout" then return nil, "timeout" end
    -- another kind or another N: the library's message
    return nil, err, code
  end
  self.handle = h
  return waited and (monotonic() - start) or 0
end

--- Takes the lock key, waiting up to timeout; returns the seconds waited.
function _M.lock(self, key)
  -- a bad key raises here, before this object enters the gate
  check_name(key, "lock")
  if self.handle then return nil, "locked" end
  if self.shared then return lock_shared(self, key) end
  local locks, topts = self.locks, { ttl = self.exptime, lock_delay = self.lock_delay }
  local start = monotonic()
  local deadline = start + self.timeout

  local gate = gate_for(locks, key)
  local waited = gate ~= nil and (gate.queue[1] ~= nil or not gate_free(gate))
  if gate then
    local entered, gerr = gate_enter(self, gate, deadline)
    if not entered then return nil, gerr or "timeout" end
  end

  -- timeout 0: one try.  Else the library's acquire for the time left
  -- (its first attempt takes a free lock, and every attempt's reply is
  -- waited for up to the deadline): it queues in the lock document (every
  -- worker and host in one order) and waits for its turn with the change
  -- stream (or by backoff polling: step, ratio, max_step).  While it waits
  -- at the server the gate's owner keeps the gate by looking in at every
  -- attempt (at least every queue_ttl / 2): a request killed meanwhile
  -- (its coroutine gone, nothing run) leaves the gate to this worker's next
  -- waiter within a beat.
  local h, err, code
  local left = deadline - monotonic()
  if self.timeout == 0 then
    h, err, code = locks:try(key, topts)
  elseif left <= 0 then
    err = "timeout"            -- the turn in this worker's queue came too late
  else
    local waits = false
    h, err, code = locks_mod.acquire_stepping(locks, key, { ttl = self.exptime, timeout = left,
      step = self.step, ratio = self.ratio, max_step = self.max_step, lock_delay = self.lock_delay },
      function(waiting)
        waits = waits or waiting
        if gate then gate.deadline = math_min(deadline, monotonic() + locks.queue_ttl / 2 + 2) end
      end)
    waited = waited or waits
  end
  if not h then
    gate_leave(self)
    if err == "busy" or err == "timeout" then return nil, "timeout" end
    return nil, err, code
  end
  self.handle = h
  if gate then gate.deadline = monotonic() + self.exptime end
  return waited and (monotonic() - start) or 0
end

--- Releases the lock held.
-- syntax: ok, err = obj:unlock()
-- ok is 1 as in lua-resty-lock.  err: "unlocked" (this object holds no
-- lock), or "lost" (the lease had expired, or the lock was taken or
-- force-released meanwhile: the critical section was not exclusive to its
-- end).
function _M.unlock(self)
  local h = self.handle
  if not h then return nil, "unlocked" end
  local ok, err, code = h:release()
  -- a release that could not be sent keeps the handle (a second unlock
  -- tries again)
  if ok or err == "lost" or err == "not held" or err == "closed" then
    self.handle = nil
    gate_leave(self)
  end
  if not ok then return nil, err, code end
  return 1
end

--- Renews the lease for timeout seconds (default exptime).
-- syntax: ok, err = obj:expire(timeout)
-- Renews the lease for timeout seconds (default: exptime).  err:
-- "unlocked" (no lock held), "lost" (the lease had ended: the object no
-- longer holds the lock), or the library's error.
function _M.expire(self, timeout)
  if timeout ~= nil then args.ttl(timeout, 1, "expire", "timeout", 2) end
  local t = timeout or self.exptime
  local h = self.handle
  if not h then return nil, "unlocked" end
  local ok, err, code = h:extend(t)
  if not ok then
    if err == "lost" or err == "not held" or err == "closed" then
      self.handle = nil
      gate_leave(self)
    end
    return nil, err, code
  end
  if self.gate then self.gate.deadline = monotonic() + t end
  return true
end

--- The fencing token of the lock held.
-- syntax: token = obj:token()
-- The fencing token of the lock held (nil when none): pass it to the
-- resource the lock guards so that it can refuse a stale holder's writes.
-- A number: LuaJIT prints it with 14 digits, obj:token_string() has them all.
function _M.token(self)
  local h = self.handle
  return h and h.token or nil
end

--- The fencing token in exact decimal digits.
-- syntax: s = obj:token_string()
-- The same token in decimal digits, exact under LuaJIT too (nil when none).
function _M.token_string(self)
  local h = self.handle
  return h and h:token_string() or nil
end

--- Fenced writes under the lock held.
-- syntax: f, err = obj:fenced(collection, opts)
-- The held handle's h:fenced(collection, opts) (doc/fenced.md); nil, "unlocked" when none.
function _M.fenced(self, coll, opts)
  local h = self.handle
  if not h then return nil, "unlocked" end
  return h:fenced(coll, opts)
end

--- Writes that commit only while the lock is held.
-- syntax: r1, ... = obj:transaction(fn, opts)
-- The held handle's h:transaction (mongolock.transaction): fn(tx)'s writes in one
-- transaction that also checks the lock document; nil, "lost" and nothing committed
-- once the lock was lost. nil, "unlocked" when the object holds no lock.
function _M.transaction(self, fn, opts)
  local h = self.handle
  if not h then return nil, "unlocked" end
  return h:transaction(fn, opts)
end

return _M
