-- Internal to mongolock: programs reach this through h:transaction(fn, opts)
-- and do not require this module, which may change without notice.
--
-- Writes that commit only while the lock is held (etcd's
-- Txn().If(IsOwner()).Then(...) on MongoDB):
--
--   local a, b = h:transaction(function(tx)
--     local players = tx:collection("players")
--     players:update({ _id = "p1" }, { ["$inc"] = { gold = -5 } })
--     players:update({ _id = "p2" }, { ["$inc"] = { gold = 5 } })
--     return "done"
--   end)
--   --> "done" | nil, "lost" | nil, err, code
--
-- One multi-document transaction (its commands carry lsid, txnNumber and
-- autocommit = false, as the drivers' transactions specification says)
-- whose first command reads the lock's own document where {_id = name,
-- owner = ours, expiresAt > $$NOW} (fixing the transaction's snapshot) and
-- whose last command, just before the commit, updates it where the same
-- holds (setting its `txnAt` to the server's time). Either matching nothing
-- means the lock was lost: the transaction is aborted and nothing of fn's
-- writes is committed. Any write of the lock document after the snapshot
-- (a takeover, a release, a renewal) makes that update a write conflict
-- (the function runs again, and its first read then tells whether the lock
-- is still ours); one after the update waits on the server until the
-- commit is done: no other holder's takeover falls between the check and
-- the commit.
--
-- A holder paused inside fn (SIGSTOP, a long GC) keeps the documents it
-- wrote in the transaction until the server aborts it: others' writes to
-- them wait, up to transactionLifetimeLimitSeconds (60 s by default). The
-- lock document itself is not among them, so the lock is taken over at
-- its ttl as always.
--
-- Retries (the specification's convenient API, withTransaction): the whole
-- function again on an error labelled TransientTransactionError (a write
-- conflict, a network error inside the transaction, NoSuchTransaction), the
-- commit alone on UnknownTransactionCommitResult (or a network error on the
-- commit: then with w = "majority", wtimeout 10 s), each retry of the whole
-- after a backoff with jitter (up to 5 ms * 1.5^attempt, at most 500 ms), for
-- as long as the lock stays held (every attempt first asks the handle: a
-- lease its renewals keep goes on; one that ended answers "lost") and
-- until the deadline: opts.timeout seconds, 120 s by default (the spec's).

--- Writes that commit only while the lock is held: what `h:transaction(fn, opts)` runs.
-- @classmod transaction

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"

local type = type
local pairs = pairs
local error = error
local pcall = pcall
local select = select
local tostring = tostring
local setmetatable = setmetatable
local string_format = string.format
local unpack = table.unpack or unpack  -- luacheck: ignore 143
local math_min = math.min
local math_random = math.random

-- the convenient API's bounds (transactions-convenient-api.md): the
-- retries' deadline when opts.timeout is not given, and the backoff
local TIMEOUT = 120
local BACKOFF_INITIAL, BACKOFF_MAX = 0.005, 0.5

local argerror = args.argerror
local check_type = args.check_type
local null = core.null

local _M = { _VERSION = "0.1.0" }
local run                    -- below
local RUN_OPTS = args.set({ "timeout" })
local FIND_OPTS = args.set({ "sort", "limit", "projection", "skip" })
local FAM_OPTS = args.set({ "upsert", "new", "sort", "remove" })
local WRITE_OPTS = args.set({ "upsert" })
local COMMIT_WC = { w = "majority" }
local COMMIT_RETRY_WC = { w = "majority", wtimeout = 10000 }

-- ---- sessions -------------------------------------------------------------
-- Each h:transaction runs in an explicit session of its own (libmongoc's,
-- on a connection of its own: csrc/driver/transport.h), named by a random
-- key; its attempts are its transaction numbers 1, 2, ...; the session
-- ends when h:transaction returns (or raises).

local function end_session(tx)
  pcall(run, tx, "admin", { endSessions = 1 }, { }, tx.key)
end

-- ---- commands -------------------------------------------------------------

-- inside nginx or a scheduler's coroutine the client's command (it yields
-- there), else the core's
run = function(self, ...)
  local c = self.c
  if self.core and not runners.yielding_core(c) then return self.core:command(...) end
  return c:command(...)
end

local function has_label(reply, label)
  local labels = type(reply) == "table" and reply.errorLabels
  if type(labels) ~= "table" then return false end
  for _, l in pairs(labels) do if l == label then return true end end
  return false
end

-- a failure: {err, code, transient, unknown} (unknown: the commit's outcome)
-- A failure without a server reply (none, or libmongoc's own with only
-- errorLabels) is the client's (network, server selection): transient
-- inside the transaction, unknown on the commit, as the specification has
-- drivers label it.
local function failure(err, code, reply)
  local client_side = type(reply) ~= "table" or reply.ok == nil
  return { err = err, code = code,
           transient = client_side or has_label(reply, "TransientTransactionError"),
           unknown = client_side or has_label(reply, "UnknownTransactionCommitResult") }
end

-- one command of the transaction in progress: reply | nil, failure; its
-- arguments' complaint (a value BSON cannot hold) raised at level
local function tx_command(tx, level, db, cmd, fields)
  fields.txnNumber = core.Int64(tx.number)
  fields.autocommit = false
  if tx.first then
    fields.startTransaction = true
    fields.readConcern = { level = "snapshot" }
    tx.first = false
  end
  local ok, r, err, code, reply = pcall(run, tx, db, cmd, fields, tx.key)
  if not ok then
    local msg = tostring(r):gsub("^[^\n]-:%d+: ", "", 1):gsub("^bad argument #%d+ to '[^']*' %((.*)%)$", "%1")
    error(string_format("transaction: %s", msg), level)
  end
  if r then return r end
  return nil, failure(err, code, reply)
end

-- the lock document's check, and the write that ends the transaction:
-- {_id = name, owner = ours, live lease}; reply | nil, failure; held: the
-- reply says it matched
local LIVE = { ["$gt"] = { "$expiresAt", "$$NOW" } }

local function check(tx)
  local h = tx.h
  local r, f = tx_command(tx, 3, h.database, { find = h.collection }, {
    filter = { _id = h.name, owner = h.owner, ["$expr"] = LIVE }, projection = { _id = 1 }, limit = 1,
    singleBatch = true })
  if not r then return nil, f end
  local b = r.cursor and r.cursor.firstBatch
  return type(b) == "table" and b[1] ~= nil
end

local function touch(tx)
  local h = tx.h
  local r, f = tx_command(tx, 3, h.database, { update = h.collection }, {
    updates = core.array({ {
      q = { _id = h.name, owner = h.owner, ["$expr"] = LIVE },
      u = core.array({ { ["$set"] = { txnAt = "$$NOW" } } }),
    } }),
  })
  if not r then return nil, f end
  return (r.n or 0) > 0
end

local function finish(tx, name, wc)
  local fields = { txnNumber = core.Int64(tx.number), autocommit = false, writeConcern = wc }
  local r, err, code, reply = run(tx, "admin", { [name] = 1 }, fields, tx.key)
  if r then return r end
  return nil, failure(err, code, reply)
end

-- ---- what fn's writes go through ----------------------------------------

local Tx = {}
Tx.__index = Tx
local Coll = {}
Coll.__index = Coll

-- an operation of fn: its reply, or nil, err, code (the transaction then
-- fails: the first failure is kept and every later operation answers it)
local function op(c, level, cmd, fields)
  local tx = c.tx
  if tx.failed then return nil, tx.failed.err, tx.failed.code end
  if tx.done then error("transaction: used after its function returned", level) end
  local r, f = tx_command(tx, level + 1, c.db, cmd, fields)
  if r then return r end
  tx.failed = f
  return nil, f.err, f.code
end

local function check_filter(filter, n, fname)
  if type(filter) ~= "table" then argerror(n, fname, "filter document expected, got " .. type(filter), 3) end
end

local function check_opts(opts, n, fname, valid)
  if opts == nil then return {} end
  check_type(opts, "table", n, fname, true)
  args.check_keys(opts, valid, n, fname)
  return opts
end

--- A collection to write in the transaction.
-- c = tx:collection(name [, {database = the lock's database}])
function Tx.collection(tx, name, opts)
  check_type(name, "string", 1, "collection")
  opts = check_opts(opts, 2, "collection", args.set({ "database" }))
  local db = opts.database or tx.h.database
  args.check_db(db, 2, "collection", "database", 3)
  args.check_coll(name, db, 1, "collection", "collection", 3)
  return setmetatable({ tx = tx, db = db, name = name }, Coll)
end

--- Updates the first document matching filter (operators, a pipeline or a replacement).
-- n, id = c:update(filter, update [, {upsert = true}]): 1 | 0 (none matched)
-- and the _id of an upsert | nil, err, code
function Coll.update(c, filter, update, opts)
  check_filter(filter, 1, "update")
  if type(update) ~= "table" then argerror(2, "update", "update document or pipeline expected") end
  opts = check_opts(opts, 3, "update", WRITE_OPTS)
  local r, err, code = op(c, 3, { update = c.name }, {
    updates = core.array({ { q = filter, u = update, upsert = opts.upsert == true } }) })
  if not r then return nil, err, code end
  local up = type(r.upserted) == "table" and r.upserted[1]
  if up then return 1, up._id end
  return (r.n or 0) > 0 and 1 or 0
end

--- Inserts a document.
-- true = c:insert(doc) | nil, err, code (a duplicate _id: 11000)
function Coll.insert(c, doc)
  if type(doc) ~= "table" then argerror(1, "insert", "document expected, got " .. type(doc)) end
  local r, err, code = op(c, 3, { insert = c.name }, { documents = core.array({ doc }) })
  if not r then return nil, err, code end
  return true
end

--- Deletes the first document matching filter.
-- n = c:delete(filter): 1 | 0 | nil, err, code
function Coll.delete(c, filter)
  check_filter(filter, 1, "delete")
  local r, err, code = op(c, 3, { delete = c.name }, { deletes = core.array({ { q = filter, limit = 1 } }) })
  if not r then return nil, err, code end
  return (r.n or 0) > 0 and 1 or 0
end

--- Updates (or removes) the first document matching filter and returns it.
-- doc = c:find_and_modify(filter, update [, {new, upsert, sort, remove}]): the document
-- before the write (after it with new = true), core.null when none matched | nil, err, code
function Coll.find_and_modify(c, filter, update, opts)
  check_filter(filter, 1, "find_and_modify")
  opts = check_opts(opts, 3, "find_and_modify", FAM_OPTS)
  if update ~= nil and type(update) ~= "table" then argerror(2, "find_and_modify", "update expected") end
  if (update == nil) ~= (opts.remove == true) then
    argerror(2, "find_and_modify", "an update, or nil with remove = true")
  end
  local r, err, code = op(c, 3, { findAndModify = c.name }, {
    query = filter, update = update, remove = opts.remove == true or nil, new = opts.new == true,
    upsert = opts.upsert == true, sort = opts.sort })
  if not r then return nil, err, code end
  if r.value == nil then return null end
  return r.value
end

--- Reads from the transaction's snapshot (its own writes included).
-- docs = c:find(filter [, {sort, limit, skip, projection}]): an array of documents
-- (one batch: at most 16 MiB) | nil, err, code
function Coll.find(c, filter, opts)
  check_filter(filter, 1, "find")
  opts = check_opts(opts, 2, "find", FIND_OPTS)
  local r, err, code = op(c, 3, { find = c.name }, {
    filter = filter, sort = opts.sort, limit = opts.limit, skip = opts.skip, projection = opts.projection,
    singleBatch = true })
  if not r then return nil, err, code end
  local docs = r.cursor and r.cursor.firstBatch
  if docs == nil or docs == null then return {} end
  return docs
end

-- ---- the loop -------------------------------------------------------------

local function pack(...) return { n = select("#", ...), ... } end

-- aborts the transaction in progress (its failure does not matter: the
-- server aborts it anyway, at the latest at transactionLifetimeLimitSeconds)
local function abort(tx)
  tx.done = true
  pcall(finish, tx, "abortTransaction", nil)
end

-- the attempts of one h:transaction, in its session (state): fn's
-- results | nil, "lost" | nil, err, code; fn's error raised again
local function attempts(state, fn, deadline)
  local h = state.h
  local number, last = 0, nil  -- luacheck: ignore 311
  while true do
    local ok, err = h:check()
    -- (after an attempt: the lock changed hands meanwhile)
    if not ok then return nil, number > 0 and "lost" or err or "lost" end
    number = number + 1
    local tx = setmetatable({ h = h, c = state.c, core = state.core, key = state.key, number = number,
                              first = true }, Tx)
    local retry = false
    local held, f = check(tx)
    if held == false then abort(tx); return nil, "lost" end
    local res
    if held then
      local okf, out = pcall(function() return pack(fn(tx)) end)
      if not okf then abort(tx); error(out, 0) end
      res = out
      f = tx.failed
      if not f and res[1] == nil and res[2] ~= nil then
        abort(tx)
        return nil, res[2], res[3]
      end
      if not f then
        held, f = touch(tx)
        if held == false then abort(tx); return nil, "lost" end
      end
    end
    tx.done = true
    if not f then
      -- the commit, again while its outcome is unknown
      local wc = COMMIT_WC
      while true do
        local cr, cf = finish(tx, "commitTransaction", wc)
        if cr then return unpack(res, 1, res.n) end
        f = cf
        if not (cf.unknown and core.monotonic() < deadline) then break end
        wc = COMMIT_RETRY_WC
      end
      if f.transient then retry = true end
    else
      abort(tx)
      retry = f.transient
    end
    last = f
    if not retry then break end
    -- the specification's backoff before the whole runs again
    local backoff = math_random() * math_min(BACKOFF_INITIAL * 1.5 ^ number, BACKOFF_MAX)
    if core.monotonic() + backoff >= deadline then break end
    runners.sleep(backoff)
  end
  if last.code == 20 then
    return nil, "transactions need a replica set (" .. tostring(last.err) .. ")", 20
  end
  return nil, last.err, last.code
end

-- h a held named lock's handle, c the client that runs the commands
-- (mongolock.connect's, so that they yield where it can, else the core's)
function _M.run(h, fn, opts, c)
  check_type(fn, "function", 1, "transaction")
  opts = check_opts(opts, 2, "transaction", RUN_OPTS)
  if opts.timeout ~= nil and (type(opts.timeout) ~= "number" or opts.timeout < 0) then
    argerror(2, "transaction", "timeout must be a number of seconds >= 0")
  end
  if h.kind ~= "named" then
    error("transaction: only a named lock's handle runs transactions on its lock document", 2)
  end
  local left, why = h:remaining()
  if not left then return nil, why end
  if left <= 0 then return nil, "lost" end
  local deadline = core.monotonic() + (opts.timeout or TIMEOUT)
  local key = core.random_owner()
  if not key then return nil, "no random session key" end
  local cl = type(c) == "table" and c._core or nil
  local state = { h = h, c = c, core = cl, key = key }
  local out = pack(pcall(attempts, state, fn, deadline))
  end_session(state)
  if not out[1] then error(out[2], 0) end
  return unpack(out, 2, out.n)
end

return _M
