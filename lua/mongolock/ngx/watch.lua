-- mongolock.ngx.watch: change-stream wake-ups for the waiters of one nginx
-- worker, each getMore one job of mongolock.ngx (a worker thread), the
-- waiting on the event loop (one ngx.semaphore per waiter).
--
--   waited = watch.wake(ctx, name, waiter, info, seconds)
--
-- called by mongolock.ngx.locks between a waiter's attempts: true when it
-- waited (woken by the release handed to this waiter, by a release nobody
-- was queued for, or after seconds), nil when there is no stream to wait
-- on (no replica set, or the stream failed lately): the caller polls then.
--
-- Invariants (the same as csrc/watch.c's, per worker instead of per
-- process):
-- - One stream per worker, client spec and collection, opened at the
--   operation time of the first waiter's failed attempt, with the core's
--   filter for this process's tag (core.op_watch): only releases handed to
--   a waiter of this process, or handed to nobody, arrive.  Its aggregate,
--   getMores and killCursors run in one session (the op's session key),
--   whichever thread runs them.
-- - A waiter whose attempt is older than the stream's start is told to
--   attempt again at once (its next attempt is newer); events are kept in
--   a ring, so an event that arrived between the attempt and the wait is
--   never missed; a waiter older than the oldest event dropped from the
--   ring attempts again at once.
-- - A release handed to a waiter (next = tag .. waiter) wakes that waiter
--   alone; one handed to nobody, a delete, or an event without a document
--   wakes every waiter of the document (or all).
-- - getMore jobs run only while waiters wait; a stream without waiters for
--   IDLE seconds is closed (killCursors).  A stream that fails is reopened
--   from its resume token a few times, then given up for FAILED_FOR seconds
--   (its waiters poll meanwhile).

local core = require "mongolock.core"
local transport = require "mongolock.ngx"

local rawget, pairs, ipairs, tostring, next, pcall = rawget, pairs, ipairs, tostring, next, pcall
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
                 retries = 0 }
  end
  return counters
end

-- this worker's counters: opened (streams), failed, events, waits ended by
-- a release handed to the waiter (handoffs) or to nobody (woken), waits
-- that timed out (timeouts), waiters told to attempt again (retries)
function _M.stats()
  local t = {}
  for k, v in pairs(stats()) do t[k] = v end
  t.pid = nil
  return t
end

local function before(t1, i1, t2, i2)
  return t1 < t2 or (t1 == t2 and i1 < i2)
end

local function wake_all(s, name)
  for n, list in pairs(s.waiters) do
    if name == nil or n == name then
      for rec in pairs(list) do
        rec.woken = "all"
        rec.sema:post(1)
      end
    end
  end
end

-- one batch of events: into the ring, and to the waiters they are for
local function deliver(s, batch)
  for _, ev in ipairs(batch.events or {}) do
    stats().events = stats().events + 1
    local ring = s.ring
    ring[#ring + 1] = ev
    if #ring > _M.RING then
      local old = table.remove(ring, 1)
      s.drop_t, s.drop_i = old.t, old.i
    end
    if ev.id == nil then
      wake_all(s, nil)
    elseif ev.next == "" then
      wake_all(s, ev.id)
    else
      local list = s.waiters[ev.id]
      if list then
        for rec in pairs(list) do
          if s.tag .. rec.waiter == ev.next then
            rec.woken = "handoff"
            rec.sema:post(1)
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
  for name, list in pairs(s.waiters) do
    for rec in pairs(list) do
      if now > rec["until"] then list[rec] = nil end
    end
    if next(list) == nil then s.waiters[name] = nil end
  end
  return next(s.waiters) ~= nil
end

local function fail(s, err)
  local ngx = rawget(_G, "ngx")
  s.state = "failed"
  stats().failed = stats().failed + 1
  s.failed_at = monotonic()
  s.err = err
  ngx.log(ngx.WARN, "mongolock: change stream on ", s.db, ".", s.coll, " failed, waiters poll: ", tostring(err))
  wake_all(s, nil)
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
  local reply, err = transport.run(s.spec, core.op_watch{ db = s.db, coll = s.coll, tag = s.tag,
    t = s.start_t, i = s.start_i, resume_token = s.resume_token, session = s.session })
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
  if premature then s.state = "done"; return end
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
  kill(s)
  s.state = "done"
  wake_all(s, nil)
end

local function stream_for(ctx, ot)
  local pid = getpid()
  if streams.pid ~= pid then streams = { pid = pid } end
  local key = ctx.spec.key .. "\0" .. ctx.db .. "\0" .. ctx.coll
  local s = streams[key]
  if s and s.state == "failed" and monotonic() - s.failed_at < _M.FAILED_FOR then return nil end
  if s and (s.state == "starting" or s.state == "running") then return s end
  local ngx = rawget(_G, "ngx")
  s = {
    spec = ctx.spec, db = ctx.db, coll = ctx.coll, tag = process_tag(),
    start_t = ot.t, start_i = ot.i, drop_t = ot.t, drop_i = ot.i,
    ring = {}, waiters = {}, state = "starting", more = sema_new(),
  }
  local ok, err = ngx.timer.at(0, loop, s)
  if not ok then
    ngx.log(ngx.WARN, "mongolock: no timer for the change stream: ", err)
    return nil
  end
  streams[key] = s
  return s
end

-- see the top of the file
function _M.wake(ctx, name, waiter, info, seconds)
  if not transport.active() then return nil end
  local ot = info and info.operation_time
  if not ot then return nil end
  local s = stream_for(ctx, ot)
  if not s then return nil end
  -- the stream started after the attempt, or dropped events after it:
  -- attempt again (once: the next attempt is newer)
  if before(ot.t, ot.i, s.start_t, s.start_i) or before(ot.t, ot.i, s.drop_t, s.drop_i) then
    stats().retries = stats().retries + 1
    return true
  end
  local mine = s.tag .. waiter
  for _, ev in ipairs(s.ring) do
    if (ev.id == nil or ev.id == name) and (ev.next == "" or ev.next == mine)
        and before(ot.t, ot.i, ev.t, ev.i) then
      stats().retries = stats().retries + 1
      return true
    end
  end
  -- until: a waiter whose request is gone (its coroutine killed while it
  -- waits) is dropped by the stream after that
  local rec = { sema = sema_new(), waiter = waiter, ["until"] = monotonic() + seconds + 1 }
  local list = s.waiters[name]
  if not list then
    list = {}
    s.waiters[name] = list
  end
  list[rec] = true
  s.more:post(1)
  rec.sema:wait(seconds)
  list[rec] = nil
  if next(list) == nil and s.waiters[name] == list then s.waiters[name] = nil end
  local c = stats()
  if rec.woken == "handoff" then c.handoffs = c.handoffs + 1
  elseif rec.woken then c.woken = c.woken + 1
  else c.timeouts = c.timeouts + 1 end
  if s.state == "failed" and not rec.woken then return nil end
  return true
end

return _M
