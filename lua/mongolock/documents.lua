-- Internal to mongolock: programs reach these methods through
-- client:documents() and do not require this module, which may change without
-- notice.
--
-- Locks on the application's own documents: two fields of the document
-- (owner and time) hold the lock, so no separate lock collection is needed.
--
--   local docs = client:documents("app", "orders", { ttl = 30 })
--   local doc, h = docs:lock(order_id, { insert = { status = "new" } })
--   doc.status = "paid"
--   h:release({ status = doc.status })   -- write and unlock in one command
--
-- Acquire is one findAndModify on {_id} (csrc/binding/documents.c): the lock is
-- taken only when free by the server's clock, and a missing document is
-- created from opts.insert in the same write.  The handle is a
-- mongolock.Lock: h:release([changes]), h:extend([ttl]), h:remaining(),
-- <close> and __gc, as for named locks.
--
-- Documents locked by other services with the LockId/LockTime scheme
-- (a Guid owner, the time it was locked) interoperate with
--   { fields = { owner = "LockId", time = "LockTime" }, time = "locked",
--     owner_type = "uuid", ttl = <their lock duration> }

--- Document locks: what `client:documents(db, coll, opts)` returns (the lock lives in two fields of
-- the application's own document).
-- @classmod docs

local core = require "mongolock.core"
local args = require "mongolock.args"
local loop = require "mongolock.loop"
local locks_mod = require "mongolock.locks"
local runners = require "mongolock.runners"
local stats = require "mongolock.stats"
local wait_mod = require "mongolock.wait"

local type = type
local pairs = pairs
local pcall = pcall
local error = error
local select = select
local tostring = tostring
local setmetatable = setmetatable
local getmetatable = getmetatable
local rawget = rawget
local string_format = string.format
local math_ceil = math.ceil
local table_unpack = table.unpack or rawget(_G, "unpack")
local function pack(...) return { n = select("#", ...), ... } end

local argerror = args.argerror
local check_type = args.check_type

local _M = {
  _VERSION = "0.1.0",
  defaults = {
    ttl = 30,                   -- seconds a lock lasts unless extended
    timeout = 10,               -- seconds lock() waits (0: one attempt,
                                -- math.huge: no limit)
    owner_field = "lockId",     -- fields.owner
    time_field = "lockExpires", -- fields.time
    time = "expires",           -- the time field holds: "expires" (lease
                                -- end) or "locked" (when it was locked)
    owner_type = "string",      -- "string" (32 hex digits) or "uuid"
    step = args.backoff.step,             -- backoff: first step (s), ratio, cap
    ratio = args.backoff.ratio,
    max_step = args.backoff.max_step,
    renew = false,              -- background renewal every ttl/3
    wait = wait_mod.default,    -- "auto" | "watch" | "poll" (mongolock.wait)
  },
}
local defaults = _M.defaults

local mt = { __index = _M }

local CALL_OPTS = { "ttl", "timeout", "renew", "wait", "step", "ratio", "max_step" }
local VALID_NEW = args.set(CALL_OPTS, { "fields", "time", "owner_type" })
local VALID_CALL = args.set(CALL_OPTS, { "insert" })
local VALID_FIELDS = args.set({ "owner", "time" })

local function check_name(v, n, fname, what, level)
  if type(v) ~= "string" then
    argerror(n, fname, string_format("%s: string expected, got %s", what, type(v)), level + 1)
  end
  if v == "" or #v > 255 or not core.utf8_valid(v) then
    argerror(n, fname, what .. " must be 1..255 bytes of UTF-8 without NUL", level + 1)
  end
  return v
end

local function check_field(v, n, fname, what, level)
  check_name(v, n, fname, what, level + 1)
  if v == "_id" or v:find(".", 1, true) or v:sub(1, 1) == "$" then
    argerror(n, fname, what .. " must be a top-level field name (no '.', no leading '$', not _id)",
      level + 1)
  end
  return v
end

-- the options both new and the calls take: name -> check
local checks = {
  ttl = args.ttl,
  timeout = args.timeout,
  step = args.seconds,
  max_step = args.seconds,
  ratio = function(v, n, fname, what, level)
    args.seconds(v, n, fname, what, level + 1)
    if v < 1 then argerror(n, fname, "ratio must be >= 1 (got " .. args.shown(v) .. ")", level + 1) end
    return v
  end,
  renew = function(v, n, fname, what, level)
    if type(v) ~= "boolean" then
      argerror(n, fname, what .. ": boolean expected, got " .. type(v), level + 1)
    end
    return v
  end,
  wait = function(v, n, fname, _, level) return wait_mod.check_mode(v, n, fname, level + 1) end,
}

-- is obj a documents object (client:documents)?
function _M.is(obj)
  return getmetatable(obj) == mt
end

-- docs = documents.new(client, db, coll, opts)
function _M.new(client, db, coll, opts)
  args.check_db(db, 1, "documents", "database", 2)
  args.check_coll(coll, db, 2, "documents", "collection", 2)
  check_type(opts, "table", 3, "documents", true, 2)
  opts = opts or {}
  args.check_keys(opts, VALID_NEW, 3, "documents", 2)
  local fields = check_type(opts.fields, "table", 3, "documents", true, 2) or {}
  args.check_keys(fields, VALID_FIELDS, 3, "documents", 2)
  local self = {
    client = client, core = client._core, db = db, coll = coll,
    bound = client.server_bound or args.SERVER_TIMEOUT,
    owner_field = fields.owner ~= nil and check_field(fields.owner, 3, "documents", "fields.owner", 2)
      or defaults.owner_field,
    time_field = fields.time ~= nil and check_field(fields.time, 3, "documents", "fields.time", 2)
      or defaults.time_field,
    time = opts.time == nil and defaults.time or opts.time,
    owner_type = opts.owner_type == nil and defaults.owner_type or opts.owner_type,
  }
  for _, k in pairs(CALL_OPTS) do
    if opts[k] ~= nil then self[k] = checks[k](opts[k], 3, "documents", k, 2)
    else self[k] = defaults[k] end
  end
  if self.owner_field == self.time_field then
    argerror(3, "documents", "fields.owner and fields.time must differ", 2)
  end
  if self.time ~= "expires" and self.time ~= "locked" then
    argerror(3, "documents", 'time must be "expires" or "locked" (got ' .. args.shown(self.time)
      .. ")", 2)
  end
  if self.owner_type ~= "string" and self.owner_type ~= "uuid" then
    argerror(3, "documents", 'owner_type must be "string" or "uuid" (got '
      .. args.shown(self.owner_type) .. ")", 2)
  end
  self.series = stats.series(client, "document", db, coll)
  return setmetatable(self, mt)
end

-- per-call options over the collection's own
local function call_opts(self, opts, fname)
  check_type(opts, "table", 2, fname, true, 3)
  opts = opts or {}
  args.check_keys(opts, VALID_CALL, 2, fname, 3)
  local o = { insert = check_type(opts.insert, "table", 2, fname, true, 3) }
  for _, k in pairs(CALL_OPTS) do
    if opts[k] ~= nil then o[k] = checks[k](opts[k], 2, fname, k, 3) else o[k] = self[k] end
  end
  if self.time == "locked" and opts.ttl ~= nil and opts.ttl ~= self.ttl then
    -- every party computes expiry as lockTime + the same ttl
    argerror(2, fname, 'ttl is fixed per collection when time = "locked"', 3)
  end
  return o
end

local function check_id(id, fname)
  if id == nil then argerror(1, fname, "_id expected, got nil", 3) end
  local ok, err = core.bson_encode({ _id = id })
  if not ok then argerror(1, fname, "_id cannot be written as BSON: " .. tostring(err), 3) end
  if core.bsontype(id) == "array" then argerror(1, fname, "an array cannot be an _id", 3) end
  return id
end

-- one attempt: doc, h | nil, "busy", info | nil, "not found" | nil, err,
-- code.  deadline (monotonic, nil: none): inside nginx the caller stops
-- waiting for the reply then
local function attempt(self, id, o, deadline)
  if self.core:closed() then return nil, "closed" end
  local h, doc, info = runners.core_of(self):doc_acquire(self.db, self.coll, id,
    math_ceil(o.ttl * 1000), self.owner_field, self.time_field, self.time,
    self.owner_type == "uuid" and "uuid" or "hex", o.insert, o.renew, deadline)
  if h then return doc, locks_mod.note_handle(self.client, h) end
  if doc == "busy" and locks_mod.own_deadlock(self.client, self.db, self.coll, id, info, deadline) then
    return nil, "deadlock", info
  end
  return nil, doc, info
end

--- One attempt to lock the document id.
-- doc, h = docs:try(id, opts): one attempt; nil, "busy", {owner,
-- remaining, doc} when held by another; nil, "not found" when the document
-- does not exist and opts.insert was not given
function _M.try(self, id, opts)
  check_id(id, "try")
  local o = call_opts(self, opts, "try")
  if not runners.ngx_core(self.client) and not self.core:closed() then
    -- one attempt: a dead server answers within a second
    local ready, err, code = loop.one_attempt_ready(self.core, self.bound)
    if not ready then return nil, err, code end
  end
  return stats.count_one(self.series, attempt(self, id, o, nil))
end

-- the wait loop, once the arguments are checked
local function wait_for(self, id, o)
  return loop.acquire({
    owner = self, core = self.core, bound = self.bound, timeout = o.timeout, wait = wait_mod, series = self.series,
    attempt = function(_, _, deadline) return attempt(self, id, o, deadline) end,
    new_state = function(deadline)
      return { locks = { core = self.core, database = self.db, collection = self.coll, client = self.client },
               name = id, field = self.owner_field, step = o.step, deadline = deadline,
               opts = { step = o.step, ratio = o.ratio, max_step = o.max_step, wait = o.wait } }
    end,
  })
end

--- Locks the document id, waiting up to opts.timeout; returns the document and the handle.
-- doc, h = docs:lock(id, opts): waits up to opts.timeout (0: one attempt;
-- math.huge: no limit), as named locks do (mongolock.wait: woken by the
-- document's change stream when the holder unlocks it or its lock expires,
-- else backoff polling); nil, "timeout", info when still held then.
-- Document locks keep no queue: waiters race for a release.
function _M.lock(self, id, opts)
  check_id(id, "lock")
  local o = call_opts(self, opts, "lock")
  return wait_for(self, id, o)
end

--- Runs fn(doc, h, ...) holding the document id's lock; always releases.
-- docs:with(id, opts, fn, ...) -> fn's results | nil, "lost" | nil, err,
-- code, as locks:with: runs fn(doc, h, ...) holding the lock, then
-- releases it; re-raises fn's error after the release.  Nothing fn returns
-- is written: fn writes its changes itself, with the unlock, by
-- h:release(changes) (and sees that call's answer); the release after fn
-- then finds the handle released ("not held") and with returns fn's
-- results.  nil, "lost" when the lease had ended before the release (fn's
-- or with's); nil, err, code when the release could not be sent.
function _M.with(self, id, opts, fn, ...)
  if type(opts) == "function" then return _M.with(self, id, nil, opts, fn, ...) end
  check_id(id, "with")
  local o = call_opts(self, opts, "with")
  check_type(fn, "function", 3, "with")
  -- fn may run longer than a ttl: with renews in the background unless
  -- told otherwise, as every kind's with does
  if opts == nil or opts.renew == nil then o.renew = true end
  local doc, h, info = wait_for(self, id, o)
  if not doc then return nil, h, info end
  local res = pack(pcall(fn, doc, h, ...))
  local sent, ok, err, code = pcall(h.release, h)
  pcall(h.close, h)
  if not res[1] then error(res[2], 0) end
  if not sent then error(ok, 0) end
  -- "not held": fn released it itself (its release said "lost" otherwise)
  if ok or err == "not held" then return table_unpack(res, 2, res.n) end
  if err == "lost" then return nil, "lost" end
  return nil, err, code
end

--- The lock state of the document id.
-- status(id) -> {held, owner, remaining} | nil, "not found" | nil, err, code
-- (one aggregate; remaining by the server's clock)
function _M.status(self, id)
  check_id(id, "status")
  if self.core:closed() then return nil, "closed" end
  return runners.core_of(self):doc_status(self.db, self.coll, id, math_ceil(self.ttl * 1000),
    self.owner_field, self.time_field, self.time, self.owner_type == "uuid" and "uuid" or "hex")
end

return _M
