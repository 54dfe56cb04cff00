-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.ngx.watch: change-stream wake-ups for the waiters of one nginx
-- worker, each getMore one job of mongolock.ngx (a worker thread), the
-- waiting on the event loop (one ngx.semaphore per waiter).  Every kind
-- waits here inside nginx (through mongolock.wait): named locks, document
-- locks and the shared kinds' readers and permits.
--
--   res, a, b = watch.wait(ctx, field, id, waiter, ot, seconds)
--
-- waits up to seconds for a release of the document id (a named lock's
-- name, or a document's _id of any BSON type) in ctx's collection ({spec,
-- db, coll}) after the operation time ot ({t, i}) of the waiter's failed
-- attempt; field is the owner field the core's filter reads (core.op_watch:
-- "owner" for named locks and the shared kinds, a document lock's owner
-- field), waiter the queued waiter's id (nil: a document lock, which keeps
-- no queue).  Answers as core.watch_wait: "event" | "granted", token (the
-- release granted the lock to waiter in the same write) |
-- "timeout" | "retry" (attempt again at once) | nil, message (no stream:
-- no replica set, or the stream failed lately; the caller polls, or with
-- wait = "watch" gives up).
--
-- Invariants (the same as csrc/watch.c's, per worker instead of per
-- process):
-- - One stream per worker, client spec, collection and owner field, opened
--   at the operation time of the first waiter's failed attempt, with the
--   core's filter for this process's tag (core.op_watch): only releases
--   handed to a waiter of this process, or handed to nobody, arrive.  Its
--   aggregate, getMores and killCursors run in one session (the op's
--   session key), whichever thread runs them.
-- - A waiter whose attempt is older than the stream's start is told to
--   attempt again at once (its next attempt is newer); events are kept in
--   a ring, so an event that arrived between the attempt and the wait is
--   never missed; a waiter older than the oldest event dropped from the
--   ring attempts again at once.
-- - A release handed to a waiter (next = tag .. waiter) wakes that waiter
--   alone (and a document lock's waiters, which have no id); one handed
--   to nobody, a delete, or an event without a document wakes every
--   waiter of the document (or all).  Ids are compared as the core does:
--   equal strings, numbers of equal value whatever their BSON type;
--   documents used as an _id all share one key (too many wake-ups, never
--   too few).
-- - getMore jobs run only while waiters wait; a stream without waiters for
--   IDLE seconds is closed (killCursors).  A stream that fails is reopened
--   from its resume token a few times, then given up for FAILED_FOR seconds
--   (its waiters poll meanwhile).
-- - A worker that is shutting down (ngx.worker.exiting()) ends its streams
--   and wakes their waiters, which get "retry" and then no stream.

local core = require "mongolock.core"
local transport = require "mongolock.ngx"

local type, rawget, rawset, pairs, ipairs, tostring, tonumber, next, pcall =
  type, rawget, rawset, pairs, ipairs, tostring, tonumber, next, pcall
local monotonic = core.monotonic
local getpid = core.getpid

local _M = {
  _VERSION = "0.1.0",
  RING = 256, AWAIT_MS = 1000, IDLE = 10, FAILED_FOR = 30, REOPENS = 3,
}

local process_tag = core.process_tag or core._process_tag

local semaphore
local function sema_new()
  if not semaphore then semaphore = require "ngx.semaphore" end
  return semaphore.new(0)
end

-- per process: key -> stream; counters
local streams = { pid = nil }
local counters = { pid = nil }

local function stats()
  local pid = getpid()
  if counters.pid ~= pid then
    counters = { pid = pid, opened = 0, failed = 0, events = 0, handoffs = 0, woken = 0, timeouts = 0,
                 retries = 0, waits = 0 }
  end
  return counters
end

-- this worker's counters: opened (streams), failed, events, waits (begun),
-- waits ended by a release handed to the waiter (handoffs) or to nobody
-- (woken), waits that timed out (timeouts), waiters told to attempt again
-- (retries: an event already in the ring, or a stream newer than the
-- attempt)
function _M.stats()
  local t = {}
  for k, v in pairs(stats()) do t[k] = v end
  t.pid = nil
  return t
end

local function before(t1, i1, t2, i2)
  return t1 < t2 or (t1 == t2 and i1 < i2)
end

-- the key of a document's _id among the stream's waiters: strings by
-- value, numbers by value whatever their BSON type (42, 42.0 and an int64
-- 42 are one key, as csrc/watch.c compares them), other values by their
-- BSON; every document (or a value that cannot be written) shares one key
local function idkey(v)
  local t = type(v)
  if t == "string" then return "s" .. v end
  if t == "number" then
    if v ~= v then return "nan" end
    return v
  end
  if t == "table" then return "table" end
  local ok, bt = pcall(core.bsontype, v)
  if ok and (bt == "int64" or bt == "int32" or bt == "double") then
    local n = tonumber(tostring(v))
    if n then return n end
  end
  local eok, b = pcall(core.bson_encode, { k = v })
  if eok and type(b) == "string" then return "b" .. b end
  return "table"
end
_M.idkey = idkey

-- wakes every waiter of key (nil: of every document); why: "all" (a
-- release to nobody), "retry" (the stream ended), "failed"
local function wake_all(s, key, why)
  for k, list in pairs(s.waiters) do
    if key == nil or k == key then
      for rec in pairs(list) do
        if not rec.woken then
          rec.woken = why
          rec.sema:post(1)
        end
      end
    end
  end
end

-- one batch of events: into the ring, and to the waiters they are for
local function deliver(s, batch)
  local c = stats()
  for _, ev in ipairs(batch.events or {}) do
    c.events = c.events + 1
    if ev.id ~= nil then ev.key = idkey(ev.id) end
    local ring = s.ring
    ring[#ring + 1] = ev
    if #ring > _M.RING then
      local old = table.remove(ring, 1)
      if before(s.drop_t, s.drop_i, old.t, old.i) then s.drop_t, s.drop_i = old.t, old.i end
    end
    if ev.key == nil then
      wake_all(s, nil, "all")
    elseif ev.next == "" then
      wake_all(s, ev.key, "all")
    else
      local list = s.waiters[ev.key]
      if list then
        for rec in pairs(list) do
          if not rec.woken then
            if rec.waiter == nil then
              -- a document lock's waiter: any release of its document
              rec.woken = "all"
              rec.sema:post(1)
            elseif s.tag .. rec.waiter == ev.next then
              rec.woken = "handoff"
              if ev.owner == rec.waiter then rec.grant = ev end
              rec.sema:post(1)
            end
          end
        end
      end
    end
  end
  if batch.resume_token then s.resume_token = batch.resume_token end
  if batch.cursor_id then s.cursor_id = batch.cursor_id end
end

-- true while a live waiter waits (the records of gone ones are dropped)
local function waiting(s)
  local now = monotonic()
  for key, list in pairs(s.waiters) do
    for rec in pairs(list) do
      if now > rec["until"] then list[rec] = nil end
    end
    if next(list) == nil then s.waiters[key] = nil end
  end
  return next(s.waiters) ~= nil
end

local function fail(s, err)
  local ngx = rawget(_G, "ngx")
  s.state = "failed"
  stats().failed = stats().failed + 1
  s.failed_at = monotonic()
  s.err = "change stream: " .. tostring(err)
  ngx.log(ngx.WARN, "mongolock: change stream on ", s.db, ".", s.coll, " failed, waiters poll: ", tostring(err))
  wake_all(s, nil, "failed")
end

-- killCursors also ends the stream's session (sent for a cursor the server
-- closed, id 0, too)
local function kill(s)
  if s.session then
    pcall(transport.run, s.spec, core.op_killcursors{ db = s.db, coll = s.coll,
      cursor_id = s.cursor_id or "0", session = s.session })
  end
  s.cursor_id, s.session = nil, nil
end

-- each opening of a stream runs in a session of its own (mongod continues
-- a cursor only in the session that created it, and the jobs run on any
-- thread): the process tag and a count make its key
local opened = 0

local function open(s)
  opened = opened + 1
  s.session = ("%s%016x"):format(s.tag, opened)
  local reply, err = transport.run(s.spec, core.op_watch{ db = s.db, coll = s.coll, field = s.field,
    tag = s.tag, t = s.start_t, i = s.start_i, resume_token = s.resume_token, session = s.session })
  if not reply then return nil, err end
  local ok, batch = pcall(core.parse_events, reply, s.tag)
  if not ok then
    kill(s)
    return nil, batch
  end
  deliver(s, batch)
  return true
end

-- the stream's light thread (a timer)
local function loop(premature, s)
  local ngx = rawget(_G, "ngx")
  if premature or ngx.worker.exiting() then
    s.state = "done"
    return wake_all(s, nil, "retry")
  end
  local ok, err = open(s)
  if not ok then return fail(s, err) end
  stats().opened = stats().opened + 1
  s.state = "running"
  local reopens = 0
  local idle_since
  while not ngx.worker.exiting() do
    if not waiting(s) then
      idle_since = idle_since or monotonic()
      if monotonic() - idle_since >= _M.IDLE then break end
      s.more:wait(1)
    else
      idle_since = nil
      local reply, gerr = transport.run(s.spec, core.op_getmore{ db = s.db, coll = s.coll,
        cursor_id = s.cursor_id, await_ms = _M.AWAIT_MS, session = s.session })
      local batch
      if reply then
        ok, batch = pcall(core.parse_events, reply, s.tag)
        if not ok then reply, gerr = nil, batch end
      end
      if reply then
        reopens = 0
        deliver(s, batch)
        if s.cursor_id == "0" then reply, gerr = nil, "the server closed the change stream" end
      end
      if not reply then
        if ngx.worker.exiting() then break end
        -- resume after the last event seen (the driver's own resume has no
        -- cursor object to act on here)
        reopens = reopens + 1
        if reopens > _M.REOPENS then
          kill(s)
          return fail(s, gerr)
        end
        kill(s)
        ok, err = open(s)
        if not ok then return fail(s, err) end
      end
    end
  end
  s.state = "done"
  wake_all(s, nil, "retry")
  kill(s)
end

local function stream_for(ctx, field, ot)
  local pid = getpid()
  if streams.pid ~= pid then streams = { pid = pid } end
  local key = ctx.spec.key .. "\0" .. ctx.db .. "\0" .. ctx.coll .. "\0" .. field
  local s = streams[key]
  if s and s.state == "failed" and monotonic() - s.failed_at < _M.FAILED_FOR then return nil, s.err end
  if s and (s.state == "starting" or s.state == "running") then return s end
  local ngx = rawget(_G, "ngx")
  if ngx.worker.exiting() then return nil, "change stream: nginx worker exiting" end
  s = {
    spec = ctx.spec, db = ctx.db, coll = ctx.coll, field = field, tag = process_tag(),
    start_t = ot.t, start_i = ot.i, drop_t = ot.t, drop_i = ot.i,
    ring = {}, waiters = {}, state = "starting", more = sema_new(),
  }
  local ok, err = ngx.timer.at(0, loop, s)
  if not ok then
    ngx.log(ngx.WARN, "mongolock: no timer for the change stream: ", err)
    return nil, "change stream: no timer: " .. tostring(err)
  end
  streams[key] = s
  return s
end

-- see the top of the file
function _M.wait(ctx, field, id, waiter, ot, seconds)
  if not transport.active() then return nil, "change stream: not in a phase that can yield" end
  local s, serr = stream_for(ctx, field or "owner", ot)
  if not s then return nil, serr end
  local c = stats()
  -- the stream started after the attempt, or dropped events after it:
  -- attempt again (once: the next attempt is newer)
  if before(ot.t, ot.i, s.start_t, s.start_i) or before(ot.t, ot.i, s.drop_t, s.drop_i) then
    c.retries = c.retries + 1
    return "retry"
  end
  local key = idkey(id)
  local mine = waiter and s.tag .. waiter
  for _, ev in ipairs(s.ring) do
    if (ev.key == nil or ev.key == key) and (ev.next == "" or mine == nil or ev.next == mine)
        and before(ot.t, ot.i, ev.t, ev.i) then
      c.retries = c.retries + 1
      if waiter and ev.owner == waiter and ev.key ~= nil then return "granted", ev.token end
      return "event"
    end
  end
  -- until: a waiter whose request is gone (its coroutine killed while it
  -- waits) is dropped by the stream after that
  local rec = { sema = sema_new(), waiter = waiter, ["until"] = monotonic() + seconds + 1 }
  local list = s.waiters[key]
  if not list then
    list = {}
    s.waiters[key] = list
  end
  list[rec] = true
  c.waits = c.waits + 1
  s.more:post(1)
  rec.sema:wait(seconds)
  list[rec] = nil
  if next(list) == nil and s.waiters[key] == list then s.waiters[key] = nil end
  local why = rec.woken
  if why == "handoff" then c.handoffs = c.handoffs + 1
  elseif why == "all" then c.woken = c.woken + 1
  elseif why == nil then c.timeouts = c.timeouts + 1 end
  if why == "failed" then return nil, s.err end
  if why == "retry" then return "retry" end
  if why == nil then return "timeout" end
  local g = rec.grant
  if g then return "granted", g.token end
  return "event"
end

-- the stream's context for a waiter of mongolock.wait whose round trips go
-- through worker threads: locks is the wait state's (a mongolock.shared
-- object, or a documents object's {client, database, collection}); nil
-- elsewhere
function _M.context(locks)
  if type(locks) ~= "table" then return nil end
  -- where the client's round trips go to worker threads (the one place
  -- that tells: mongolock.private)
  local nc = require("mongolock.private").ngx_core(locks.client)
  if not nc then return nil end
  local ctx = rawget(locks, "_ngx_watch")
  if ctx then return ctx end
  ctx = { spec = nc.spec, db = locks.database, coll = locks.collection }
  rawset(locks, "_ngx_watch", ctx)
  return ctx
end

return _M
