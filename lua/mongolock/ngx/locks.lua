-- mongolock.ngx.locks: named locks inside nginx, each round trip one job of
-- mongolock.ngx (a worker thread), the lock itself plain data on the event
-- loop.  The commands are the core's (core.op_* builders and core.parse_*
-- parsers): the same documents, queue, tokens and server time as the C
-- handles of mongolock.locks.
--
--   local nlocks = require "mongolock.ngx.locks"
--   local ctx = nlocks.context(spec, database, collection, app)
--   local lease, err, info = nlocks.acquire(ctx, name, opts)
--   nlocks.extend(lease, ttl); nlocks.release(lease)
--
-- A lease is { name, owner, token, ttl, deadline (local monotonic time the
-- lease surely ends by), ctx }.
--
-- Invariants:
-- - Every wait is on the event loop (ngx.sleep, ngx.semaphore through
--   mongolock.ngx.watch); a job is one attempt, release, extend or leave.
-- - An attempt whose caller stopped waiting (its timeout passed while the
--   attempt was in flight) never leaves a lock held by nobody: if it won,
--   the lock is released as soon as its reply comes; if it queued the
--   waiter, the waiter leaves the queue.
-- - Where a request cannot yield, the same ops run on this process's own
--   client, blocking (as every round trip did before mongolock.ngx).

local core = require "mongolock.core"
local mongolock = require "mongolock"
local transport = require "mongolock.ngx"
local backoff = require "mongolock.backoff"

local type, tostring = type, tostring
local rawget = rawget
local monotonic = core.monotonic
local getpid = core.getpid
local math_min, math_max, math_ceil = math.min, math.max, math.ceil

local _M = {
  _VERSION = "0.1.0",
  defaults = { queue_ttl = 3, expire_after = 86400, step = 0.001, ratio = 2, max_step = 0.5 },
}

local process_tag = core.process_tag or core._process_tag

-- ---- running an op --------------------------------------------------------

-- per process: spec key -> a client for the phases that cannot yield
local direct = { pid = nil, clients = {} }

local function direct_run(spec, op)
  local pid = getpid()
  if direct.pid ~= pid then direct = { pid = pid, clients = {} } end
  local c = direct.clients[spec.key]
  if not c then
    local err
    c, err = mongolock.connect(spec.uri, spec.opts)
    if not c then return nil, err end
    direct.clients[spec.key] = c
  end
  return c._core:run(op)
end

-- reply | nil, err, code, ereply: through a worker thread where the caller
-- can yield, else here (blocking)
local function run(spec, op, deadline, on_orphan, arg)
  if transport.active() then return transport.run(spec, op, deadline, on_orphan, arg) end
  return direct_run(spec, op)
end
_M.run = run

local function sleep(s)
  if s <= 0 then return end
  local ngx = rawget(_G, "ngx")
  if transport.active() then return ngx.sleep(s) end
  return core.sleep(s)
end

-- ---- the context ------------------------------------------------------------

-- ctx = nlocks.context(spec, database, collection [, app [, expire_after]])
function _M.context(spec, db, coll, app, expire_after)
  return {
    spec = spec, db = db, coll = coll, app = app,
    expire_after = expire_after or _M.defaults.expire_after,
    host = core.hostname(),
  }
end

-- the TTL index, once per process, spec, database and collection
local indexed = {}

local function ensure_index(ctx, deadline)
  local key = ctx.spec.key .. "\0" .. ctx.db .. "\0" .. ctx.coll
  if indexed[key] == getpid() then return true end
  local reply, err, code = run(ctx.spec, core.op_ensure_index{ db = ctx.db, coll = ctx.coll,
    expire_after = math_ceil(ctx.expire_after) }, deadline)
  -- 85/86: an index on expiresAt exists with other options; it serves
  if not reply and code ~= 85 and code ~= 86 then return nil, err, code end
  indexed[key] = getpid()
  return true
end

-- ---- release, extend, leave -------------------------------------------------

local function release_op(ctx, name, owner)
  return core.op_release{ db = ctx.db, coll = ctx.coll, name = name, owner = owner }
end

-- runs op, the release of what an attempt won after its caller gave up
-- (what: how the log names it), and logs the outcome
function _M.give_back(spec, op, what)
  local rel, err = run(spec, op)
  local ngx = rawget(_G, "ngx")
  if not (ngx and ngx.log) then return end
  if rel then
    ngx.log(ngx.WARN, "mongolock: ", what, " was won after its caller gave up: released")
  else
    ngx.log(ngx.ERR, "mongolock: ", what, " was won after its caller gave up; release failed: ", tostring(err))
  end
end

-- an attempt's reply that shows owner holding the lock: release it (true)
local function release_if_won(ctx, name, owner, reply)
  if type(reply) ~= "string" then return false end
  local ok, r = pcall(core.parse_acquire, reply, owner)
  if not (ok and r and r.won) then return false end
  _M.give_back(ctx.spec, release_op(ctx, name, owner), "'" .. name .. "'")
  return true
end

local function leave(ctx, name, waiter, tag)
  return run(ctx.spec, core.op_leave{ db = ctx.db, coll = ctx.coll, name = name, waiter = waiter, tag = tag })
end

-- runs op without waiting for it (the caller's time is up)
local function run_later(ctx, op)
  local ngx = rawget(_G, "ngx")
  if transport.active() then
    ngx.timer.at(0, function() pcall(run, ctx.spec, op) end)
  else
    pcall(run, ctx.spec, op)
  end
end

-- leave the queue without waiting for it
local function leave_later(ctx, name, waiter, tag)
  run_later(ctx, core.op_leave{ db = ctx.db, coll = ctx.coll, name = name, waiter = waiter, tag = tag })
end

-- an error without the server's reply (none, or libmongoc's own for a
-- connection closed: errorLabels, no ok): the write may have been applied
local function no_reply(ereply)
  if type(ereply) ~= "string" then return true end
  local ok, r = pcall(core.bson_decode, ereply)
  return not (ok and type(r) == "table" and r.ok ~= nil)
end

-- after an attempt that failed with err, code, ereply: when it got no
-- reply, even to the retry (not the transport's own timeout, which leaves
-- the outcome to the orphaned callback), it may have taken what it asked
-- for under an owner nobody uses again: release (the op releasing it) runs
-- from a timer.  True when it was sent.  Every kind's attempt uses it.
function _M.release_unanswered(spec, err, code, ereply, release)
  if (err == "timeout" and code == nil) or not no_reply(ereply) then return false end
  run_later({ spec = spec }, release)
  return true
end

-- the outcome of an attempt nobody waits for any more: the lock it won
-- is released, the queue it joined left
local function orphaned(o, reply, _, _, ereply)
  if not release_if_won(o.ctx, o.name, o.owner, reply or ereply) and o.waiter then
    pcall(leave, o.ctx, o.name, o.waiter, o.tag)
  end
end

-- true | nil, "not held" | nil, err, code
function _M.release(lease)
  local ctx = lease.ctx
  local reply, err, code = run(ctx.spec, release_op(ctx, lease.name, lease.owner))
  if not reply then return nil, err, code end
  lease.released = true
  local n = core.parse_update(reply)
  if n == 1 then return true end
  return nil, "not held"
end

-- true | nil, "lost" | nil, err, code
function _M.extend(lease, ttl)
  local ctx = lease.ctx
  local started = monotonic()
  local reply, err, code = run(ctx.spec, core.op_extend{ db = ctx.db, coll = ctx.coll, name = lease.name,
    owner = lease.owner, ttl_ms = math_ceil(ttl * 1000) })
  if not reply then return nil, err, code end
  if core.parse_update(reply) == 1 then
    lease.deadline = started + ttl
    lease.ttl = ttl
    return true
  end
  lease.lost = true
  return nil, "lost"
end

-- ---- acquire ----------------------------------------------------------------

-- change-stream wake-ups on the event loop (mongolock.ngx.watch)
function _M.wake(...)
  return require("mongolock.ngx.watch").wake(...)
end

-- per process: attempts sent, and acquisitions granted by a release and
-- made from its change event without a command
local counters = { pid = nil }
local function stats(pid)
  pid = pid or getpid()
  if counters.pid ~= pid then counters = { pid = pid, attempts = 0, granted = 0 } end
  return counters
end

-- this worker's counters: attempts, granted (from a release's event alone)
function _M.stats()
  local c = stats()
  return { attempts = c.attempts, granted = c.granted }
end

-- A lease a release granted is bounded by the waiter's place in the queue
-- (seconds left, counted from before the attempt that set it): shorter
-- than two thirds of its ttl, or cut short by a place (queue_ttl) shorter
-- than the ttl, it is extended to the ttl once, shortly before it ends (a
-- second before, or at a quarter of what is left), from a timer where the
-- caller can yield (a lock released by then costs no command), else at
-- once.
local function top_up(lease, queue_ttl)
  local left = lease.deadline - monotonic()
  if left >= lease.ttl * 2 / 3 and queue_ttl >= lease.ttl then return end
  local ngx = rawget(_G, "ngx")
  if not transport.active() then
    _M.extend(lease, lease.ttl)
    return
  end
  local function tick(premature)
    if premature or lease.released or lease.closed or lease.lost
        or (lease.state ~= nil and lease.state ~= "held") then return end
    _M.extend(lease, lease.ttl)
  end
  local ok = ngx.timer.at(math_max(0, left - math_min(1, left / 4)), tick)
  if not ok then _M.extend(lease, lease.ttl) end
end

-- lease | nil, "busy" | "timeout", info | nil, err, code
-- opts: ttl, timeout (0: one attempt, "busy" when held), step, ratio,
-- max_step, queue_ttl; wake (optional, nlocks.wake): function(ctx, name,
-- waiter, info, seconds) that waits up to seconds for a hand-off on the event loop and
-- returns true when it waited (mongolock.ngx.watch), nil when it cannot
-- (then this polls with backoff, or with watch_only gives up: nil, message)
function _M.acquire(ctx, name, opts)
  local ttl = opts.ttl
  local ttl_ms = math_ceil(ttl * 1000)
  local timeout = opts.timeout or 0
  -- deadline: the caller stops waiting then (for a reply too); a try
  -- (timeout 0) waits for its one attempt's reply
  local deadline = monotonic() + timeout
  local job_deadline = timeout > 0 and deadline or nil
  local ok, err, code = ensure_index(ctx, job_deadline)
  if not ok then return nil, err, code end
  local d = _M.defaults
  local queue_ttl = opts.queue_ttl or d.queue_ttl
  local waiter, tag
  if timeout > 0 then
    waiter, err = core.waiter_id()
    if not waiter then return nil, err end
    tag = process_tag()
  end
  local owner = waiter or core.random_owner()
  local pid = getpid()
  local queued, polling = false, opts.wake == nil
  local step = opts.step or d.step
  local attempt = {
    db = ctx.db, coll = ctx.coll, name = name, owner = owner, ttl_ms = ttl_ms,
    host = ctx.host, pid = pid, app = ctx.app,
    waiter = waiter, tag = tag, queue_ms = waiter and math_ceil(queue_ttl * 1000) or nil,
  }

  local function give_up(...)
    if queued then leave_later(ctx, name, waiter, tag) end
    return nil, ...
  end

  -- what the outcome of an attempt nobody waits for any more needs (a
  -- table, not upvalues: see transport.run)
  local orphan = { ctx = ctx, name = name, owner = owner, waiter = waiter, tag = tag }

  local c = stats(pid)
  local attempts = 0
  while true do
    -- the caller's sign of life, at every attempt
    if opts.on_step then opts.on_step() end
    attempts = attempts + 1
    local started = monotonic()
    attempt.polling = waiter and polling or nil
    local op = core.op_acquire(attempt)
    c.attempts = c.attempts + 1
    local reply, aerr, acode, ereply = run(ctx.spec, op, job_deadline, orphaned, orphan)
    if not reply then
      if aerr == "timeout" and acode == nil then
        -- the transport's: the attempt never started, or is still in
        -- flight and orphaned() deals with its outcome
        return give_up("timeout")
      end
      -- a write concern error comes after the write: a reply showing us as
      -- the owner is released again
      release_if_won(ctx, name, owner, ereply)
      -- no reply: the attempt may have queued the waiter, or taken the
      -- lock, under owner all the same (a lost reply); a waiter's leave
      -- (give_up) passes on a lock taken under its id
      if waiter then queued = queued or no_reply(ereply)
      else _M.release_unanswered(ctx.spec, aerr, acode, ereply, release_op(ctx, name, owner)) end
      return give_up(aerr, acode)
    end
    local info, perr = core.parse_acquire(reply, owner)
    if not info then return give_up(perr) end
    if info.won then
      local lease = { name = name, owner = owner, token = info.token, ttl = ttl, deadline = started + ttl,
                      ctx = ctx, waited = attempts > 1 }
      local remaining = info.remaining
      if type(remaining) == "number" and remaining < ttl then
        -- a lock a release granted to this waiter: its lease is bounded by
        -- the waiter's place in the queue
        lease.deadline = started + remaining
        top_up(lease, queue_ttl)
      end
      return lease
    end
    if not waiter then return nil, "busy", info end
    queued = queued or info.position ~= nil
    local now = monotonic()
    if now >= deadline then return give_up("timeout", info) end
    -- until the next attempt: the caller's deadline, the refresh of our
    -- place in the queue, the holder's lease end (first in line only)
    local left = deadline - now
    if info.position ~= nil then left = math_min(left, started + queue_ttl / 2 - now) end
    local remaining = info.remaining
    if type(remaining) == "number" and remaining >= 0 and (info.position == nil or info.position == 1) then
      left = math_min(left, remaining + 0.001)
    end
    local waited = false
    if opts.wake and left > 0 then
      local res, gtoken
      waited, res, gtoken = opts.wake(ctx, name, waiter, info, left)
      polling = not waited
      if res == "granted" then
        -- the release granted the lock to this waiter in the same write
        -- (its event says so): no command.  The grant's lease ends at
        -- min(release + ttl, the place's until), and the place was set by
        -- the attempt that began at started: started + min(ttl, queue_ttl)
        -- is never later than the server's end (as client:granted).
        local lease = { name = name, owner = owner, token = gtoken, ttl = ttl,
                        deadline = started + math_min(ttl, queue_ttl),
                        ctx = ctx, waited = true }
        c.granted = c.granted + 1
        top_up(lease, queue_ttl)
        return lease
      end
      if not waited and opts.watch_only then
        -- wait = "watch": never a silent fall back to polling
        return give_up(info and info.operation_time
          and "wait = \"watch\": the worker's change stream failed lately"
          or "wait = \"watch\": change streams need a replica set (the server sent no operationTime)")
      end
    end
    if not waited then
      local delay
      delay, step = backoff.delay(step, opts.ratio or d.ratio, opts.max_step or d.max_step,
        (type(remaining) == "number" and remaining > 0) and remaining or nil, math_max(0, left), core.random())
      sleep(delay)
    end
  end
end

return _M
