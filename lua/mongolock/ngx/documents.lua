-- mongolock.ngx.documents: document locks (mongolock.documents) inside
-- nginx, where a request can yield: every round trip (an attempt, a
-- release with the caller's changes, an extend, a status) one job of
-- mongolock.ngx (a worker thread), built by the core's op_doc_* builders
-- and read by its parse_doc_* parsers: the same commands as
-- client:doc_acquire and the C handles (csrc/documents.c, csrc/lock.c).
--
-- The lock held is plain data on the event loop, behind the handles of
-- mongolock.ngx.handle (kind "document"): a handle collected while
-- holding is released by a timer job; renewal extends from a timer.
--
-- An attempt whose caller stopped waiting (its deadline passed while the
-- attempt was in flight, or its request went away) never leaves a document
-- locked by nobody: if the attempt won, the lock is released as soon as its
-- reply comes (a timer).
--
-- The waiting between attempts stays mongolock.documents' (the acquire
-- loop of mongolock.private, the waits of mongolock.wait), on the event
-- loop: with wait = "auto" or "watch" the worker's change stream on the
-- document's collection and owner field (mongolock.ngx.watch: each getMore
-- a job, the waiter on its ngx.semaphore), else ngx.sleep steps.

local core = require "mongolock.core"
local transport = require "mongolock.ngx"
local nlocks = require "mongolock.ngx.locks"
local nhandle = require "mongolock.ngx.handle"

local type, pairs, pcall, error, tostring, rawget = type, pairs, pcall, error, tostring, rawget
local monotonic = core.monotonic
local math_ceil = math.ceil

local _M = { _VERSION = "0.1.0" }

-- true where the calls of a documents object go through here
function _M.active(docs)
  return transport.active() and docs.client ~= nil and docs.client.connect_opts ~= nil
end

local function context(docs)
  local ctx = rawget(docs, "_ngx")
  if ctx then return ctx end
  local client = docs.client
  ctx = { spec = transport.spec(client.uri, client.connect_opts), db = docs.db, coll = docs.coll }
  docs._ngx = ctx
  return ctx
end

-- the lock's description, as the op_doc_* builders take it
local function lockref(ctx, docs, id)
  return { db = ctx.db, coll = ctx.coll, id = id, owner_field = docs.owner_field,
           time_field = docs.time_field, time = docs.time,
           owner_type = docs.owner_type == "uuid" and "uuid" or "hex" }
end

local function with(ref, extra)
  local t = {}
  for k, v in pairs(ref) do t[k] = v end
  for k, v in pairs(extra) do t[k] = v end
  return t
end

-- a builder's complaint about one field, raised again with fname's name,
-- at level (the user's call; 0: no position)
local function reraise(e, fname, argn, level)
  local msg = tostring(e):match("%((.*)%)$") or tostring(e)
  error("bad argument #" .. argn .. " to '" .. fname .. "' (" .. msg .. ")", level > 0 and level + 1 or 0)
end

-- ---- the lease's release and extend (mongolock.ngx.handle) -------------------

local impl = {}

function impl.release_op(lease, changes)
  return core.op_doc_release(with(lease.ref, { owner = lease.owner, changes = changes }))
end

-- true | nil, "not held" | nil, err, code; raises at h:release's caller on
-- changes that cannot be written (malformed, or touching the lock fields)
function impl.release(lease, changes)
  local ok, op = pcall(impl.release_op, lease, changes)
  if not ok then reraise((tostring(op):gsub("changes: ", "", 1)), "release", 1, 3) end
  local reply, err, code = nlocks.run(lease.ctx.spec, op)
  if not reply then return nil, err, code end
  lease.released = true
  if core.parse_update(reply) == 1 then return true end
  return nil, "not held"
end

-- true | nil, "lost" | nil, err, code.  A locked-at document's lease keeps
-- its length (every party computes expiry as lockTime + the same ttl)
function impl.extend(lease, ttl)
  local started = monotonic()
  local reply, err, code = nlocks.run(lease.ctx.spec, core.op_doc_extend(with(lease.ref, {
    owner = lease.owner, ttl_ms = math_ceil(ttl * 1000) })))
  if not reply then return nil, err, code end
  if core.parse_update(reply) == 1 then
    if lease.ref.time ~= "locked" then lease.ttl = ttl end
    lease.deadline = started + lease.ttl
    return true
  end
  return nil, "lost"
end

-- ---- attempt and status -------------------------------------------------------

-- the outcome of an attempt nobody waits for any more (in a timer): a lock
-- it won is released (o: a table, not upvalues; see transport.run)
local function orphaned(o, reply, _, _, ereply)
  reply = reply or ereply
  if type(reply) ~= "string" then return end
  local ok, r = pcall(core.parse_doc_acquire, reply, o.owner, o.ref.owner_field, o.ref.owner_type)
  if not (ok and r and r.won) then return end
  nlocks.give_back(o.spec, core.op_doc_release(with(o.ref, { owner = o.owner })), "a document's lock")
end

-- one attempt: doc, h | nil, "busy", info | nil, "not found" | nil, err,
-- code.  deadline (monotonic): the caller stops waiting for the reply then
-- (nil: it waits for it); fname: the user's call, for a bad insert
function _M.attempt(docs, id, o, deadline, fname)
  if docs.core:closed() then return nil, "closed" end
  local ctx = context(docs)
  local ref = lockref(ctx, docs, id)
  local owner = core.random_owner()
  local ok, op = pcall(core.op_doc_acquire, with(ref, { owner = owner, ttl_ms = math_ceil(o.ttl * 1000),
    insert = o.insert }))
  if not ok then reraise(op, fname or "lock", 2, 0) end
  local started = monotonic()
  local reply, err, code, ereply = transport.run(ctx.spec, op, deadline, orphaned,
    { spec = ctx.spec, ref = ref, owner = owner })
  if not reply then
    -- a write concern error comes after the write: a lock it shows as ours
    -- is released again
    if ereply then orphaned({ spec = ctx.spec, ref = ref, owner = owner }, nil, nil, nil, ereply) end
    -- no reply: a lock taken under owner all the same (this attempt's
    -- alone) is released
    nlocks.release_unanswered(ctx.spec, err, code, ereply, core.op_doc_release(with(ref, { owner = owner })))
    return nil, err, code
  end
  local r, perr = core.parse_doc_acquire(reply, owner, ref.owner_field, ref.owner_type)
  if not r then return nil, perr end
  if not r.won then
    r.won = nil
    return nil, "busy", r
  end
  local lease = { name = id, owner = owner, ttl = o.ttl, deadline = started + o.ttl, ctx = ctx,
                  ref = ref, kind = "document", impl = impl }
  return r.doc, nhandle.new(docs, lease, o.renew)
end

-- status(id) -> {held, state, owner, remaining} | nil, "not found" | nil,
-- err, code
function _M.status(docs, id)
  if docs.core:closed() then return nil, "closed" end
  local ctx = context(docs)
  local reply, err, code = transport.run(ctx.spec, core.op_doc_status(with(lockref(ctx, docs, id), {
    ttl_ms = math_ceil(docs.ttl * 1000) })))
  if not reply then return nil, err, code end
  return core.parse_doc_status(reply)
end

return _M
