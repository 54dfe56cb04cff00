-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- Leader election on the named locks.
--
--   local el = client:elections{ ttl = 10 }
--   local leader = assert(el:campaign("scheduler", "host-a:8080"))  -- waits
--   ... leader.token is the term; leader:check() before each step ...
--   leader:proclaim("host-a:8081")
--   leader:resign()
--
--   local info = el:leader("scheduler")     -- value, token, holder, remaining
--   for change in el:observe("scheduler") do ... end
--
-- A leader is the holder of the named lock of the election's name: the
-- library's own handle (renewed by the lease engine, lost as any lease is
-- lost), wrapped with proclaim and resign.  Its token is the term: fencing
-- tokens increase across every acquisition of the name, so terms do.  The
-- published value lives in the lock document (doc/design.md, "Elections"):
-- written by the campaign's attempt that takes the lock, and by proclaim,
-- an update that matches only the live lease of its owner, each with the
-- term it was written in (valueToken), so that a value is never shown for
-- a term that did not write it.
--
-- Every round trip goes through mongolock.runners.core_of (inside nginx a
-- worker thread's job): campaigns through the one acquire loop of the
-- named locks (mongolock.locks), proclaim, leader and the observer's
-- change stream through the client's run of the core's ops (core.op_proclaim,
-- op_leader, and the commands of a core.view_stream).  The core reads the
-- lock document: core.parse_election gives the election's view (owner,
-- token, value, value_term, holder, acquired_at, expires_at, lease_ms,
-- held, remaining) and a view stream each change event as changes of that
-- view (csrc/binding/views.c); this file names none of the document's fields.

--- Leader election: what `client:elections(opts)` returns; a campaign's leader; an observer of
-- an election.
-- @classmod el

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"
local locks_mod = require "mongolock.locks"

local type = type
local pairs = pairs
local ipairs = ipairs
local next = next
local tostring = tostring
local setmetatable = setmetatable
local math_min = math.min
local math_max = math.max
local math_huge = math.huge
local monotonic = core.monotonic
local core_of = runners.core_of
local check_type = args.check_type
local check_name = args.check_name
local argerror = args.argerror

local _M = { _VERSION = "0.1.0", VALUE_MAX = 16384 }

local mt = { __index = _M }

-- el = elections.new(client, opts): the named locks' options; leaders
-- renew their lease unless opts.renew is false
function _M.new(client, opts)
  check_type(opts, "table", 1, "elections", true, 3)
  local o = { renew = true }
  for k, v in pairs(opts or {}) do o[k] = v end
  local locks = locks_mod.new(client, o, "elections", 4)
  return setmetatable({ locks = locks, client = client, core = locks.core,
                        database = locks.database, collection = locks.collection,
                        bound = locks.bound }, mt)
end

-- raises at the user's frame unless v is an election's value
local function check_value(v, n, fname, level)
  level = (level or 2) + 1
  if type(v) ~= "string" then
    argerror(n, fname, "string expected, got " .. type(v), level)
  end
  if #v > _M.VALUE_MAX then argerror(n, fname, "value longer than 16384 bytes", level) end
  if v:find("\0", 1, true) then argerror(n, fname, "value contains a NUL byte", level) end
  if not core.utf8_valid(v) then argerror(n, fname, "value is not valid UTF-8", level) end
  return v
end

-- ---- the leader's handle ---------------------------------------------------------

local Leader = {}
local leader_mt = { __index = Leader }

local function leader_of(el, h, value)
  return setmetatable({ _h = h, _el = el, name = h.name, token = h.token, owner = h.owner,
                        value = value }, leader_mt)
end

-- the handle's own methods, on the handle
for _, k in pairs({ "lost", "check", "held", "remaining", "extend", "close", "token_string", "fenced",
                    "transaction" }) do
  Leader[k] = function(self, ...)
    local h = self._h
    return h[k](h, ...)
  end
end

--- Steps down: releases the leader's lock.
-- leader:resign() -> true | nil, "lost" | nil, "not held" | nil, err, code:
-- the lock's release (the next campaigner is woken by its event)
function Leader.resign(self)
  return self._h:release()
end
Leader.release = Leader.resign

--- Publishes a new value in the same term.
-- leader:proclaim(value) -> true | nil, "lost" | nil, "not held" | nil,
-- err, code: the published value, in the same term (one update that
-- matches this leader's live lease only)
function Leader.proclaim(self, value)
  check_value(value, 1, "proclaim")
  local h, el = self._h, self._el
  local ok, err = h:check()
  if not ok then return nil, err end
  local op = core.op_proclaim{ db = el.database, coll = el.collection, name = self.name,
                               owner = tostring(h.owner), value = value }
  local reply, rerr, code = core_of(el):run(op)
  if not reply then return nil, rerr, code end
  local n = core.parse_update(reply)
  if not n or n < 1 then return nil, "lost" end
  self.value = value
  return true
end

leader_mt.__close = function(self) self._h:release() end
leader_mt.__tostring = function(self)
  return "mongolock.Leader(" .. tostring(self._h) .. ")"
end

-- ---- campaign, leader -------------------------------------------------------------

--- Waits until this caller leads the election name, publishing value.
-- leader, err, info = el:campaign(name, value, opts): waits (as
-- locks:acquire, opts.timeout) until this caller leads the election name
function _M.campaign(self, name, value, opts)
  check_name(name, "campaign")
  check_value(value, 2, "campaign")
  local h, err, info = locks_mod.campaign(self.locks, name, value, opts, "campaign", 3)
  if not h then return nil, err, info end
  return leader_of(self, h, value)
end

-- the server's view of the election (false: no document) and the read's
-- operation time ({t, i}; false on a server without one)
local function read(self, name)
  if self.core:closed() then return nil, "closed" end
  local op = core.op_leader{ db = self.database, coll = self.collection, name = name }
  local reply, err, code = core_of(self):run(op)
  if not reply then return nil, err, code end
  return core.parse_election(reply)
end

-- the leader's value of a view: the value written in the current term only
local function term_value(v)
  local vt = v.value_term
  if vt ~= nil and vt == v.token then return v.value end
  return nil
end

-- the info of a leader from the election's view v (nil when nobody leads)
local function info_of(name, v)
  if not v or v.held ~= true then return nil end
  return {
    name = name,
    value = term_value(v),
    token = v.token,
    owner = v.owner,
    holder = v.holder,
    remaining = v.remaining,
    acquired_at = v.acquired_at,
    expires_at = v.expires_at,
  }
end

--- Who leads the election name, and the value published.
-- info = el:leader(name): {name, value, token, owner, holder, remaining,
-- acquired_at, expires_at} | nil (nobody leads) | nil, err, code
function _M.leader(self, name)
  check_name(name, "leader")
  local v, ot, code = read(self, name)
  if v == nil then return nil, ot, code end
  return info_of(name, v)
end

--- The status of the election name's lock (as locks:status).
-- el:status(name), el:force_release(name): the lock's (mongolock.locks)
function _M.status(self, name)
  check_name(name, "status")
  return self.locks:status(name)
end

--- Ends the term of whoever leads the election name.
function _M.force_release(self, name)
  check_name(name, "force_release")
  return self.locks:force_release(name)
end

-- ---- observe ----------------------------------------------------------------------

--[[
The observer keeps its own copy of the election's fields, read once from the
server and then changed by each change event of the document, in the
stream's order (cluster time).  After each event it compares the leader it
now sees with the last one it returned, and returns every difference: a new
leader (a new term), a new value in the same term, no leader.  A lease that
ends unrenewed makes no event: when the leader's lease, as the events told
it (its ttl from its last renewal), has run out locally, the server is asked
(el:leader's read), and the server's answer is taken when it is not older
than the events already applied.  A leader is never returned after a newer
term (terms only grow), and a read never overrides newer events.
]]

local Observer = {}
local observer_mt = { __index = Observer }

-- a < b for cluster times {t, i}
local function before(a, b)
  return a.t < b.t or (a.t == b.t and a.i < b.i)
end

-- the observer's copy from a read (v: the server's view, or false)
local function from_read(o, v)
  local st = {}
  if v then
    for k, x in pairs(v) do st[k] = x end
    st.held, st.remaining = nil, nil
  end
  o.st = st
  o.held = v and v.held == true or false
  o.live_until = o.held and monotonic() + v.remaining or nil
end

-- the leader o sees: a table, or false.  o.held is what the latest read or
-- event says (events are judged as of their write, not by this process's
-- clock: a take, a renewal and a proclaim only happen on a live lease);
-- o.live_until only says when to ask the server again
local function view(o)
  local st = o.st
  if st.owner == nil or not o.held then return false end
  return { token = st.token, owner = st.owner, holder = st.holder, value = term_value(st),
           remaining = math_max(0, (o.live_until or 0) - monotonic()) }
end

-- queues the leader o sees when it differs from the last one returned
local function compare(o)
  local v = view(o)
  local last = o.last
  local change
  if not v then
    if last == nil or last.leader then change = "none" end
  elseif last == nil or not last.leader or v.token ~= last.token then
    -- a term older than one returned already is stale: never returned
    if not (last and o.term and v.token < o.term) then change = "leader" end
  elseif v.value ~= last.value then
    change = "value"
  end
  if not change then return end
  if last == nil then change = "current" end
  local out = { name = o.name, change = change, leader = v and true or false }
  if v then
    for k, x in pairs(v) do out[k] = x end
    o.term = math_max(o.term or 0, v.token)
  end
  o.last = out
  o.changes[#o.changes + 1] = out
end

-- the seconds a write that set the lease's start a and end e (nil: not
-- set) leaves on it: a renewal's is the lease's length; a take's its end
-- less its start (a grant's may be shorter than the length)
local function lease_of(st, a, e)
  local ms = st.lease_ms
  if a and e and (ms == nil or e - a < ms / 1000) then ms = (e - a) * 1000 end
  return math_max(0, ms or 0) / 1000
end

-- applies one change event (a view stream's) to o's copy
local function apply(o, ev)
  local kind = ev.kind
  local now = monotonic()
  if kind == "update" then
    local st, set = o.st, ev.fields
    for k, v in pairs(set) do st[k] = v end
    for k in pairs(ev.cleared) do st[k] = nil end
    if next(ev.holder_set) ~= nil or next(ev.holder_unset) ~= nil then
      local h = {}
      for hk, hv in pairs(type(st.holder) == "table" and st.holder or {}) do h[hk] = hv end
      for hk, hv in pairs(ev.holder_set) do h[hk] = hv end
      for hk in pairs(ev.holder_unset) do h[hk] = nil end
      st.holder = h
    end
    local touched = ev.touched
    -- a proclaim's new value: written on a live lease only
    if touched.value and st.owner ~= nil then o.held = true end
    if touched.owner or touched.expires_at then
      o.held = st.owner ~= nil
      if st.owner == nil then
        o.live_until = nil
      else
        o.live_until = now + lease_of(st, set.acquired_at, set.expires_at)
      end
    end
  elseif kind == "replace" then
    local st = {}
    for k, v in pairs(ev.fields) do st[k] = v end
    o.st = st
    o.held = st.owner ~= nil
    o.live_until = o.held and now + lease_of(st, st.acquired_at, st.expires_at) or nil
  elseif kind == "delete" then
    o.st = {}
    o.held = false
    o.live_until = nil
  else
    return "reopen"                 -- drop, rename, dropDatabase, invalidate
  end
end

-- runs the next command of o's stream, a read waiting up to seconds: its
-- events | nil, err, code
local function step(o, seconds)
  local s = o.stream
  local op, due = s:next(seconds)
  if not op then
    if due == math_huge then
      local _, err, code = s:state()
      return nil, err or "change stream: ended", code
    end
    runners.sleep(math_min(due, seconds))     -- its next opening is due later
    return {}
  end
  local reply, err, code, ereply, domain = core_of(o.el):run(op)
  local events, derr, dcode = s:done(reply, err, code, ereply, domain)
  if events then return events end
  -- a failed command: the machine resumes the stream after its last
  -- resume token by itself (no event is skipped) unless it gave up
  local state, serr, scode = s:state()
  if state == "starting" or state == "running" then return {} end
  if not reply then return nil, err, code end
  return nil, serr or derr, scode or dcode
end

-- ends o's stream (best effort); true
local function end_stream(o)
  local s = o.stream
  o.stream, o.backlog = nil, nil
  if s then
    s:close()
    if not o.el.core:closed() then
      local op = s:next(0)
      if op then s:done(core_of(o.el):run(op)) end
    end
  end
  return true
end

-- reads the election and opens the stream at the read's operation time:
-- true | nil, err, code.  On a server without change streams (no
-- operation time) o polls instead.
local function open(o)
  end_stream(o)
  local v, ot, code = read(o.el, o.name)
  if v == nil then return nil, ot, code end
  if o.ot and ot and before(ot, o.ot) then ot = o.ot end
  from_read(o, v)
  o.ot = ot or nil
  if not ot then return true end
  local el = o.el
  o.stream = core.view_stream{ db = el.database, coll = el.collection, name = o.name, t = ot.t, i = ot.i }
  local events, err, ecode = step(o, 0)
  if not events then
    end_stream(o)
    return nil, err, ecode
  end
  -- its first batch: what happened since the read, applied by the next
  -- read of the stream, after the read's state is returned
  o.backlog = events
  return true
end

-- the stream's events (the first batch's, else one read of up to seconds),
-- applied in order: true | nil, err, code
local function more(o, seconds)
  local events = o.backlog
  o.backlog = nil
  if not (events and events[1]) then
    local err, code
    events, err, code = step(o, seconds)
    if not events then return nil, err, code end
  end
  for _, ev in ipairs(events) do
    -- the read (or an event) already reflects what happened before o.ot
    if not (ev.t and o.ot and before(ev, o.ot)) then
      if apply(o, ev) == "reopen" then return open(o) end
      if ev.t then o.ot = { t = ev.t, i = ev.i } end
      compare(o)
    end
  end
  return true
end

-- the server's answer once the leader's lease, as the events told it, has
-- run out here
local function confirm(o)
  local v, ot, code = read(o.el, o.name)
  if v == nil then return nil, ot, code end
  if ot and o.ot and before(ot, o.ot) then return true end   -- older than the events
  from_read(o, v)
  if ot then o.ot = ot end
  return true
end

--- The next change of the election, waiting up to the observer's timeout.
-- change | nil, "timeout" | nil, err, code: the next change, waiting up to
-- the observer's timeout
function Observer.next(o)
  if o.closed then return nil, "closed" end
  local changes = o.changes
  local deadline = monotonic() + o.timeout
  local retried = false
  while true do
    if changes[1] then return table.remove(changes, 1) end
    if o.el.core:closed() then return nil, "closed" end
    local ok, err, code
    if o.last == nil then
      ok, err, code = open(o)
      if ok then compare(o) end
    else
      local now = monotonic()
      local left = deadline - now
      if o.live_until and now >= o.live_until and o.last and o.last.leader then
        -- the events already waiting first (a slow caller's: a renewal, a
        -- resign), so that none is skipped; then the server, if still due
        ok, err, code = true, nil, nil
        if o.stream then ok, err, code = more(o, 0.001) end
        if ok and not changes[1] and o.live_until and monotonic() >= o.live_until then
          ok, err, code = confirm(o)
          if ok then compare(o) end
        end
        -- a read that finds the lease still live waits for its events
        if ok and not changes[1] and o.live_until and monotonic() >= o.live_until then
          o.live_until = monotonic() + 0.05
        end
      elseif left <= 0 then
        return nil, "timeout"
      else
        local wait = math_min(left, o.cap)
        if o.live_until and o.last and o.last.leader then
          wait = math_min(wait, math_max(0.001, o.live_until - now))
        end
        if o.stream then
          ok, err, code = more(o, wait)
        else
          -- no change stream (a standalone server): the server is asked again
          runners.sleep(math_min(wait, o.poll))
          ok, err, code = confirm(o)
          if ok then compare(o) end
        end
      end
    end
    if not ok then
      -- one new stream after a failure (a fork, a killed cursor, a failover)
      if retried then return nil, err, code end
      retried = true
      if o.last ~= nil then
        local rok, rerr, rcode = open(o)
        if not rok then return nil, rerr, rcode end
        compare(o)
      end
    end
  end
end

observer_mt.__call = function(o) return o:next() end

--- Ends the observer's change stream.
-- it:close(): ends the observer's change stream; true
function Observer.close(o)
  if o.closed then return true end
  o.closed = true
  return end_stream(o)
end

observer_mt.__close = function(o) o:close() end

local OBSERVE_OPTS = args.set({ "timeout" })

--- An iterator of the changes of the election name (leader, value).
-- it = el:observe(name, opts): an iterator (a callable object) of changes;
-- each call returns the next {name, change = "current" | "leader" |
-- "value" | "none", leader = boolean, token, value, owner, holder,
-- remaining}, the first call the current state; nil, "timeout" when
-- opts.timeout (seconds, default: none) passes without a change; it:close()
-- ends its change stream
function _M.observe(self, name, opts)
  check_name(name, "observe")
  check_type(opts, "table", 2, "observe", true)
  opts = opts or {}
  args.check_keys(opts, OBSERVE_OPTS, 2, "observe")
  local timeout = math_huge
  if opts.timeout ~= nil then timeout = args.timeout(opts.timeout, 2, "observe", "timeout") end
  return setmetatable({ el = self, name = name, timeout = timeout, changes = {},
                        cap = math_max(0.05, math_min(self.bound / 2, 5)), poll = 0.1 }, observer_mt)
end

return _M
