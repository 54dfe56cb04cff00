-- mongolock.ngx.shared: reader shares and semaphore permits
-- (mongolock.shared) inside nginx, where a request can yield.
--
--   local c = require("mongolock.ngx.shared").core(obj)
--
-- gives mongolock.shared a stand-in for its client's core with the methods
-- it calls (closed, ensure_index, share_acquire, share_leave, share_status,
-- share_force_release), the same arguments and answers, each round trip
-- one job of mongolock.ngx (a worker thread) built by the core's
-- op_share_* builders: the same commands as csrc/shared.c.
--
-- A share or permit held is plain data on the event loop, behind the
-- handles of mongolock.ngx.handle (kind "shared" or "permit"): a handle
-- collected while holding is released by a timer job; renewal extends from
-- a timer.  An attempt whose request went away never leaves a share or
-- permit held by nobody: what it won is released as soon as its reply
-- comes, a queue it joined is left.  The waiting between attempts stays
-- mongolock.shared's (mongolock.wait), on the event loop: the worker's
-- change stream on the collection (mongolock.ngx.watch, the one the named
-- locks of that collection wait on; the release handed to a waiter in
-- squeue wakes that waiter alone), else ngx.sleep steps.

local core = require "mongolock.core"
local transport = require "mongolock.ngx"
local nlocks = require "mongolock.ngx.locks"
local nhandle = require "mongolock.ngx.handle"

local type, pcall, rawget, setmetatable = type, pcall, rawget, setmetatable
local monotonic = core.monotonic
local math_ceil = math.ceil

local process_tag = core.process_tag or core._process_tag

local _M = { _VERSION = "0.1.0" }

-- true where the calls of a mongolock.shared object go through here
function _M.active(obj)
  return transport.active() and obj.client ~= nil and obj.client.connect_opts ~= nil
end

local run = nlocks.run

-- ---- the lease's release and extend (mongolock.ngx.handle) --------------------

local impl = {}

function impl.release_op(lease)
  return core.op_share_release{ db = lease.ctx.db, coll = lease.ctx.coll, name = lease.name, owner = lease.owner }
end

function impl.release(lease)
  local reply, err, code = run(lease.ctx.spec, impl.release_op(lease))
  if not reply then return nil, err, code end
  lease.released = true
  if core.parse_update(reply) == 1 then return true end
  return nil, "not held"
end

function impl.extend(lease, ttl)
  local started = monotonic()
  local reply, err, code = run(lease.ctx.spec, core.op_share_extend{ db = lease.ctx.db, coll = lease.ctx.coll,
    name = lease.name, owner = lease.owner, ttl_ms = math_ceil(ttl * 1000) })
  if not reply then return nil, err, code end
  if core.parse_update(reply) == 1 then
    lease.ttl = ttl
    lease.deadline = started + ttl
    return true
  end
  return nil, "lost"
end

-- ---- the core's stand-in -------------------------------------------------------

-- the outcome of an attempt nobody waits for any more (in a timer): a share
-- or permit it won is released, a queue it joined left (o: a table, not
-- upvalues; see transport.run)
local function orphaned(o, reply, _, _, ereply)
  reply = reply or ereply
  local ok, r = false, nil
  if type(reply) == "string" then ok, r = pcall(core.parse_share_acquire, reply, o.owner, o.mode, o.permits) end
  if ok and r and r.won then
    nlocks.give_back(o.spec, core.op_share_release{ db = o.db, coll = o.coll, name = o.name, owner = o.owner },
      "a share of '" .. o.name .. "'")
  elseif o.waiter then
    pcall(run, o.spec, core.op_share_leave{ db = o.db, coll = o.coll, name = o.name, waiter = o.waiter,
      tag = o.tag })
  end
end

local P = {}
local proxy_mt = { __index = P }

function P.closed(p) return p.real:closed() end

function P.ensure_index(p, db, coll, expire_after)
  local reply, err, code = run(p.spec, core.op_ensure_index{ db = db, coll = coll, expire_after = expire_after })
  if not reply then return nil, err, code end
  return true
end

-- h | nil, "busy" | "mismatch", info | nil, err, code (client:share_acquire)
function P.share_acquire(p, db, coll, name, mode, permits, ttl_ms, app, renew, waiter, queue_ms, polling)
  local owner = waiter or core.random_owner()
  local tag = waiter and process_tag() or nil
  if mode ~= "permit" then permits = nil end
  local op = core.op_share_acquire{ db = db, coll = coll, name = name, mode = mode, permits = permits,
    owner = owner, ttl_ms = ttl_ms, host = core.hostname(), pid = core.getpid(), app = app or p.app,
    waiter = waiter, tag = tag, queue_ms = waiter and queue_ms or nil, polling = waiter and polling or nil }
  local o = { spec = p.spec, db = db, coll = coll, name = name, owner = owner, mode = mode, permits = permits,
              waiter = waiter, tag = tag }
  local started = monotonic()
  local reply, err, code, ereply = transport.run(p.spec, op, nil, orphaned, o)
  if not reply then
    -- a write concern error comes after the write: what it took is given back
    if ereply then orphaned({ spec = p.spec, db = db, coll = coll, name = name, owner = owner, mode = mode,
                              permits = permits }, nil, nil, nil, ereply) end
    -- no reply: a share taken under owner all the same (a try's own, or a
    -- waiter's whose acquire ends with this error) is released; the queue
    -- a waiter may have joined is left by mongolock.shared
    nlocks.release_unanswered(p.spec, err, code, ereply,
      core.op_share_release{ db = db, coll = coll, name = name, owner = owner })
    return nil, err, code
  end
  local r, perr = core.parse_share_acquire(reply, owner, mode, permits)
  if not r then return nil, perr end
  if r.won then
    local ttl = ttl_ms / 1000
    local lease = { name = name, owner = owner, token = r.token, ttl = ttl, deadline = started + ttl,
                    ctx = { spec = p.spec, db = db, coll = coll }, kind = mode == "permit" and "permit" or "shared",
                    impl = impl }
    return nhandle.new(p.obj, lease, renew)
  end
  local v = r.value
  v.operation_time = r.operation_time
  return nil, r.mismatch and "mismatch" or "busy", v
end

function P.share_leave(p, db, coll, name, waiter)
  local reply, err, code = run(p.spec, core.op_share_leave{ db = db, coll = coll, name = name, waiter = waiter,
    tag = process_tag() })
  if not reply then return nil, err, code end
  return true
end

-- the document of name | nil; name nil: every such document
function P.share_status(p, db, coll, name)
  local reply, err, code = run(p.spec, core.op_share_status{ db = db, coll = coll, name = name })
  if not reply then return nil, err, code end
  local r = core.bson_decode(reply)
  local batch = type(r) == "table" and r.cursor and r.cursor.firstBatch or {}
  if name == nil then return batch end
  return batch[1]
end

function P.share_force_release(p, db, coll, name)
  local reply, err, code = run(p.spec, core.op_share_force_release{ db = db, coll = coll, name = name })
  if not reply then return nil, err, code end
  if (core.parse_update(reply) or 0) > 0 then return true end
  return nil, "not held"
end

-- the stand-in for obj.core (obj: a mongolock.shared object)
function _M.core(obj)
  local p = rawget(obj, "_ngx_core")
  if p then return p end
  local client = obj.client
  p = setmetatable({ real = obj.core, obj = obj, app = client.appname,
                     spec = transport.spec(client.uri, client.connect_opts) }, proxy_mt)
  obj._ngx_core = p
  return p
end

return _M
