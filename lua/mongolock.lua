-- mongolock: distributed locks on MongoDB.
--
--   local mongolock = require "mongolock"
--   local client = assert(mongolock.connect(uri, opts))
--   local locks  = client:locks(opts)
--
-- The C core (mongolock.core) makes every round trip; this module checks
-- arguments, writes every default down once, and hands out the objects.
-- It gives each client its runners where the caller can yield (inside
-- nginx mongolock.ngx.runner, with a scheduler mongolock.sched): the
-- shared code below finds them on the client (mongolock.runners).

--- Distributed locks on MongoDB: `connect`, and the client it returns.
-- @module mongolock

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"
local stats = require "mongolock.stats"

local type = type
local error = error
local tostring = tostring
local tonumber = tonumber
local setmetatable = setmetatable
local math_ceil = math.ceil

local argerror = args.argerror
local check_type = args.check_type
local seconds = args.seconds

local _M = { _VERSION = "0.1.0", core = core }

local client_mt = {}

-- the client connect made around each core client (a handle's writes
-- through h:fenced go through it, so that they yield where it can).  Weak
-- both ways: the client holds its core (_core), and LuaJIT's weak-keyed
-- tables are no ephemerons, so a value that holds its key would never go
local clients_of = setmetatable({}, { __mode = "kv" })

--- Fenced writes from a held handle (mongolock.fenced).
-- f = h:fenced(collection [, {database = h.database, field = "fence"}]): writes
-- to collection that apply only while no newer holder of the lock wrote the
-- document
core.lock_methods.fenced = function(h, coll, opts)
  local c = core.handle_client(h)
  return require("mongolock.fenced").new(h, coll, opts, clients_of[c] or c)
end

--- Writes that commit only while the lock is held (mongolock.transaction).
-- r1, ... = h:transaction(fn [, {timeout = seconds}]): fn(tx)'s results once its
-- writes (tx:collection(name):update/insert/delete/find_and_modify/find) committed
-- in one transaction that also checks the lock document | nil, "lost" | nil, err, code
core.lock_methods.transaction = function(h, fn, opts)
  local c = core.handle_client(h)
  return require("mongolock.transaction").run(h, fn, opts, clients_of[c] or c)
end

-- A client's URI (its credentials included) is kept out of the client's
-- own fields, so that a dump of the client (a logger's inspect, a test
-- failure's message) never shows a password; client.uri still reads it.
local uris = setmetatable({}, { __mode = "k" })
client_mt.__index = function(self, k)
  if k == "uri" then return uris[self] end
  return client_mt[k]
end

-- ---- connect ------------------------------------------------------------

local connect_defaults = {
  appname = nil,                  -- shown in server logs and holder.app
  write_concern = "majority",     -- "majority" or a number of nodes
  wtimeout = nil,                 -- seconds to wait for the write concern
  pool_size = nil,                -- maximum connections (libmongoc: 100)
  -- seconds a round trip waits for an unreachable or silent server: server
  -- selection, connect and socket timeouts (the URI's own
  -- serverSelectionTimeoutMS, connectTimeoutMS, socketTimeoutMS win)
  server_timeout = args.SERVER_TIMEOUT,
  server_selection_timeout = nil, -- seconds; server selection alone
  -- seconds a single attempt (try, timeout = 0) waits for a writable
  -- server and for its reply, a frozen server's too; at most server_timeout
  attempt_timeout = args.ATTEMPT_TIMEOUT,
  scheduler = nil,                -- "cqueues", "luv", "skynet", "copas" or a table (mongolock.sched): in
                                  -- its coroutines every wait yields to it
  threads = 8,                    -- with a scheduler: worker threads that run
                                  -- its round trips (per client and process)
}
_M.connect_defaults = connect_defaults
local CONNECT_OPTS = args.set({ "appname", "write_concern", "wtimeout", "pool_size",
  "server_timeout", "server_selection_timeout", "attempt_timeout", "scheduler", "threads" })

-- the URI's serverSelectionTimeoutMS in seconds, or nil
local function uri_selection_timeout(uri)
  local ms = uri:lower():match("[?&;]serverselectiontimeoutms=(%d+)")
  return ms and tonumber(ms) / 1000 or nil
end

-- does the URI set a write concern (w=...)?
local function uri_has_w(uri)
  local q = uri:match("%?(.*)$")
  return q ~= nil and (";&" .. q):lower():find("[;&]w=") ~= nil
end

--- Connects to MongoDB (a libmongoc pool; no round trip until the first call).
-- client, err = mongolock.connect(uri, opts)
function _M.connect(uri, opts)
  check_type(uri, "string", 1, "connect")
  check_type(opts, "table", 2, "connect", true)
  opts = opts or {}
  args.check_keys(opts, CONNECT_OPTS, 2, "connect")
  local appname = check_type(opts.appname, "string", 2, "connect", true)
  -- the option, else the URI's own w, else the default
  local w = opts.write_concern
  if w == nil and not uri_has_w(uri) then w = connect_defaults.write_concern end
  if w ~= nil and w ~= "majority" and (type(w) ~= "number" or w ~= w or w < 0 or w % 1 ~= 0) then
    argerror(2, "connect", "write_concern must be \"majority\" or a non-negative integer")
  end
  -- w = 0: the server does not answer writes, and an acquire could not
  -- tell whether it took the lock (nor a release whether it freed it)
  if w == 0 then
    argerror(2, "connect", "write_concern 0 asks for unacknowledged writes: a lock needs the "
      .. "server's answer; use \"majority\" or a number of nodes >= 1")
  end
  local wtimeout, pool, sst
  if opts.wtimeout ~= nil then
    wtimeout = math_ceil(seconds(opts.wtimeout, 2, "connect", "wtimeout") * 1000)
  end
  if opts.pool_size ~= nil then
    pool = opts.pool_size
    if type(pool) ~= "number" or pool ~= pool or pool < 1 or pool % 1 ~= 0 or pool > 100000 then
      argerror(2, "connect", "pool_size must be an integer from 1 to 100000 (got "
        .. args.shown(pool) .. ")")
    end
  end
  if opts.server_selection_timeout ~= nil then
    sst = math_ceil(seconds(opts.server_selection_timeout, 2, "connect",
      "server_selection_timeout") * 1000)
  end
  local bound = connect_defaults.server_timeout
  if opts.server_timeout ~= nil then
    bound = seconds(opts.server_timeout, 2, "connect", "server_timeout")
    if bound > 86400 then
      argerror(2, "connect", "server_timeout must be at most a day (86400 seconds) (got "
        .. args.shown(bound) .. ")")
    end
  end
  local attempt = connect_defaults.attempt_timeout
  if opts.attempt_timeout ~= nil then
    attempt = seconds(opts.attempt_timeout, 2, "connect", "attempt_timeout")
  end
  attempt = math.min(attempt, bound)
  local scheduler, threads, sched
  if opts.scheduler ~= nil then
    sched = require "mongolock.sched"
    scheduler = sched.check(opts.scheduler, 2, "connect")
  end
  if opts.threads ~= nil then
    threads = opts.threads
    if type(threads) ~= "number" or threads ~= threads or threads < 1 or threads % 1 ~= 0
       or threads > 256 then
      argerror(2, "connect", "threads must be an integer from 1 to 256 (got "
        .. args.shown(threads) .. ")")
    end
  end
  local c, err = core.connect(uri, appname, w, wtimeout, pool, sst, math_ceil(bound * 1000),
    math_ceil(attempt * 1000))
  if not c then return nil, err end
  -- the arguments, as plain values: inside nginx a worker thread makes its
  -- own client from them (mongolock.ngx)
  local connect_opts = {}
  for _, k in ipairs({ "appname", "write_concern", "wtimeout", "pool_size", "server_selection_timeout",
                       "server_timeout", "attempt_timeout" }) do
    connect_opts[k] = opts[k]
  end
  -- how long one server selection may block: the acquire loop waits for a
  -- server itself when less than this is left before its deadline
  local selection = uri_selection_timeout(uri) or (sst and sst / 1000) or bound
  -- read once: a closed client still names it (client:locks() on a closed
  -- client makes an object whose calls answer "closed")
  local client = setmetatable({ _core = c, appname = appname, connect_opts = connect_opts,
                                _database = c:default_database(),
                                -- a try's wait for a server and each of its
                                -- round trips (loop.single) are bounded by it
                                server_bound = selection, attempt_bound = attempt, _scheduler = scheduler,
                                _threads = threads, _series = { by = {} } }, client_mt)
  uris[client] = uri
  clients_of[c] = client
  stats.clients[client] = true
  -- the runners where the caller can yield: inside nginx its worker
  -- threads (in a phase that can yield), with a scheduler its thread pool
  -- (in the scheduler's coroutines)
  local ngx = rawget(_G, "ngx")
  if ngx and ngx.run_worker_thread and ngx.get_phase then require("mongolock.ngx.runner").attach(client) end
  if sched then sched.attach(client) end
  return client
end

-- ---- the client ---------------------------------------------------------

--- A client: what `connect` returns.
-- @type client

--- Named locks in one collection (default "locks").
-- locks = client:locks(opts): named locks in one collection
function client_mt:locks(opts)
  return require("mongolock.locks").new(self, opts)
end

--- Reader-writer locks on the named locks' documents.
-- rw = client:rwlocks(opts), sem = client:semaphores(opts): reader-writer
-- locks and counting semaphores (mongolock.shared)
function client_mt:rwlocks(opts)
  return require("mongolock.shared").rwlocks(self, opts)
end
--- Counting semaphores (opts.permits) on the named locks' documents.
function client_mt:semaphores(opts)
  return require("mongolock.shared").semaphores(self, opts)
end
--- Leader election on the named locks.
-- el = client:elections(opts): leader election on the named locks
-- (mongolock.elections)
function client_mt:elections(opts)
  return require("mongolock.elections").new(self, opts)
end

--- Takes several locks of any kinds, all or none.
-- set = client:acquire_all(entries, opts): several locks, all or none
function client_mt.acquire_all(_, entries, opts)
  return require("mongolock.shared").acquire_all(entries, opts)
end

--- Locks on the application's own documents of db.coll.
-- documents = client:documents(db, coll, opts): locks on the
-- application's own documents (mongolock.documents)
function client_mt:documents(...)
  return require("mongolock.documents").new(self, ...)
end

--- Optimistic concurrency on the documents of db.coll (a version field).
-- vc = client:versioned(db, coll, opts): optimistic concurrency
-- (mongolock.versioned)
function client_mt:versioned(...)
  return require("mongolock.versioned").new(self, ...)
end

--- Runs any command on database db.
-- reply = client:command(db, cmd [, opts]): any command; cmd holds only
-- the command name, the other fields go in opts (csrc/binding/command.c).
-- nil, message, code, reply on failure; nil, "closed" on a closed client.
-- (session: a 32-hex-digit key, the explicit session of mongolock.transaction)
function client_mt:command(db, cmd, opts, session)
  check_type(db, "string", 1, "command")
  check_type(cmd, "table", 2, "command")
  check_type(opts, "table", 3, "command", true)
  local c = self._core
  if c:closed() then return nil, "closed" end
  -- where the caller can yield (inside nginx, in a scheduler's
  -- coroutine): in a worker thread, the reply decoded here
  local nc = runners.yielding_core(self)
  if nc then
    local ok, op = pcall(core.op_command, db, cmd, opts, session)
    if not ok then
      if type(op) == "string" then
        op = op:gsub("^[^\n]-:%d+: ", "", 1):gsub("'op_command'", "'command'", 1)
      end
      error(op, 2)
    end
    local reply, err, code, ereply = nc:run(op)
    if not reply then return nil, err, code, ereply and core.bson_decode(ereply) end
    return core.bson_decode(reply)
  end
  -- the core checks the rest (the database name, one command name, values
  -- that BSON can hold); its complaint is raised again at our caller
  local ok, r, err, code, reply = pcall(function() return c:command(db, cmd, opts, session) end)
  if not ok then
    if type(r) == "string" then
      r = r:gsub("^[^\n]-:%d+: ", "", 1)
      -- LuaJIT names no method called from here ('?') and counts self:
      -- the same words as Lua 5.4's, about the caller's argument
      local n, rest = r:match("^bad argument #(%d+) to '%?'(.*)$")
      if n then r = string.format("bad argument #%d to 'command'%s", tonumber(n) - 1, rest) end
    end
    error(r, 2)
  end
  return r, err, code, reply
end

-- ---- what the client did ------------------------------------------------

local KINDS = { "named", "document", "shared", "permit" }

-- a histogram of mongolock.stats.WAIT_BUCKETS from counts per bucket: cumulative
-- counts, as Prometheus' _bucket series (counts[#buckets + 1] is +Inf)
local function histogram(counts, sum)
  local b, acc, cum = stats.WAIT_BUCKETS, 0, {}
  for i = 1, #b + 1 do
    acc = acc + counts[i]
    cum[i] = acc
  end
  return { buckets = b, counts = cum, sum = sum, count = acc }
end

--- What this client did since connect, counted without a round trip.
-- stats = client:stats(): what this client did since connect, in this
-- process.  No round trip, no lock: the acquire loop's counters are Lua
-- tables of the client, the lease engine's and the change streams' C
-- counters (csrc/binding/stats.c).  {acquisitions, waits, timeouts, busy, lost,
-- releases, renewals, renewal_failures, commands, stream_reopens,
-- wait_seconds = {buckets, counts (cumulative; one more for +Inf), sum,
-- count}, by_kind = {<kind> = {acquisitions, waits, timeouts, busy, lost,
-- releases}}, series = {{kind, collection, acquisitions, waits, timeouts,
-- busy, wait_seconds}, ...}}; kinds: "named", "document", "shared" (a
-- reader's share), "permit".  Inside nginx: this worker's
-- (mongolock.metrics sums the workers).
function client_mt:stats()
  local cn = self._core:counters()
  local out = {
    acquisitions = 0, waits = 0, timeouts = 0, busy = 0, lost = 0, releases = 0,
    renewals = cn.renewals, renewal_failures = cn.renewal_failures,
    -- the jobs run in nginx's worker threads or a scheduler's pool too
    commands = cn.commands + stats.jobs(self),
    stream_reopens = cn.stream_reopens, by_kind = {}, series = {},
  }
  local all_counts, all_sum = {}, 0
  for i = 1, #stats.WAIT_BUCKETS + 1 do all_counts[i] = 0 end
  for _, k in ipairs(KINDS) do
    local lost, rel = cn.lost and cn.lost[k] or 0, cn.releases and cn.releases[k] or 0
    out.by_kind[k] = { acquisitions = 0, waits = 0, timeouts = 0, busy = 0, lost = lost, releases = rel }
    out.lost, out.releases = out.lost + lost, out.releases + rel
  end
  for i, s in ipairs(self._series) do
    local bk = out.by_kind[s.kind]
    out.series[i] = { kind = s.kind, collection = s.collection, acquisitions = s.acquisitions,
      waits = s.waits, timeouts = s.timeouts, busy = s.busy,
      wait_seconds = histogram(s.wait_counts, s.wait_sum) }
    for _, f in ipairs({ "acquisitions", "waits", "timeouts", "busy" }) do
      out[f] = out[f] + s[f]
      bk[f] = bk[f] + s[f]
    end
    for j, n in ipairs(s.wait_counts) do all_counts[j] = all_counts[j] + n end
    all_sum = all_sum + s.wait_sum
  end
  out.wait_seconds = histogram(all_counts, all_sum)
  return out
end

--- Sets (or with nil removes) the callback for lost leases and failed renewals.
-- client:on_lost(fn): fn(event) is called once for every lease of this
-- client found lost (its renewal matched nothing, its local deadline
-- passed, a release or extend found it taken), and for every renewal that
-- failed (the lease is still held, the engine retries): event = {reason =
-- "lost" | "renewal failed", kind, database, collection, name, token,
-- owner}.  The engine decides in its own thread, which never runs Lua: fn
-- runs at the next call into the library (an acquire) or client:poll(),
-- and inside nginx from the lease engine's timer.  nil removes it.
function client_mt:on_lost(fn)
  check_type(fn, "function", 1, "on_lost", true)
  stats.listeners[self._core] = fn
  self._core:want_events(fn ~= nil)
end

--- Calls the on_lost callback for each event queued since.
-- n = client:poll(): calls the on_lost callback for every event queued
-- since; returns how many (and the callback's errors, a list, if any)
function client_mt:poll()
  return stats.deliver(self._core)
end

--- The URI's database, or "mongolock".
-- the URI's database, or "mongolock"
function client_mt:default_database()
  return self._database
end

--- Closes the client; idempotent.
-- true; idempotent.  Handles made by this client answer "closed" afterwards.
function client_mt:close()
  if rawget(self, "_scheduler") then require("mongolock.sched").close(self) end
  return self._core:close()
end

--- Whether the client is closed.
function client_mt:closed()
  return self._core:closed()
end

client_mt.__tostring = function(self)
  return tostring(self._core)
end

_M.client_mt = client_mt

--- Utilities.
-- @section utilities

--- Sleeps s seconds (ngx.sleep where it can yield).
-- @function sleep
-- @param s seconds
-- mongolock.sleep(s): ngx.sleep where it yields, else the core's blocking
-- sleep; mongolock.monotonic(): seconds of CLOCK_MONOTONIC
_M.sleep = function(s)
  if type(s) ~= "number" or s ~= s or s < 0 or s == math.huge then
    argerror(1, "sleep", "a finite number of seconds >= 0 expected, got " .. args.shown(s), 2)
  end
  return runners.sleep(s)
end
--- Seconds of a monotonic clock.
-- @function monotonic
_M.monotonic = core.monotonic

-- BSON values Lua has no type for (csrc/binding/bson.c): mongolock.null,
-- mongolock.array(t) (an array, even when empty), ObjectId, Date, Binary,
-- Timestamp, Decimal128, Int64, Regex, MinKey, MaxKey, and Document (BSON
-- bytes written as is)
for _, k in ipairs({ "null", "array", "is_array", "ObjectId", "Date", "Binary", "Timestamp",
                     "Decimal128", "Int64", "Regex", "MinKey", "MaxKey", "Document" }) do
  _M[k] = core[k]
end

return _M
