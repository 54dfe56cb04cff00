-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.stats: what a client did, counted in Lua on the client itself
-- (client:stats(), mongolock.metrics), and its lease events handed to its
-- on_lost callback: the Lua half of csrc/binding/stats.c, whose counters and
-- queued events the lease engine keeps in C.

local type = type
local pcall = pcall
local rawget = rawget
local tostring = tostring
local ipairs = ipairs
local setmetatable = setmetatable
local table_remove = table.remove

local _M = {}

-- The process's totals of the Lua counters, which never go back whatever
-- clients close or are collected (mongolock.metrics; the C counters' are
-- the core's, core.totals()): the series of every client still open, and
-- `retired`, the sums of those of clients closed or collected, folded in
-- by _M.totals.  records: one per client that counts (its _series, held
-- here, and the client, weakly).
local records = {}
_M.retired = { by = {} }

-- the wait-time histogram's upper bounds (s), fixed: Prometheus' default
-- buckets, which most latency dashboards already read
_M.WAIT_BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10 }
local WAIT_BUCKETS = _M.WAIT_BUCKETS
local NBUCKETS = #WAIT_BUCKETS

-- the series of (kind, collection) in all (a client's _series, or the
-- sums), made when missing
local function new_series(all, kind, collection)
  local key = kind .. "\0" .. collection
  local s = all.by[key]
  if not s then
    local counts = {}
    for i = 1, NBUCKETS + 1 do counts[i] = 0 end   -- the last: above every bound
    s = { kind = kind, collection = collection, acquisitions = 0, waits = 0, timeouts = 0, busy = 0,
          wait_sum = 0, wait_counts = counts }
    all.by[key] = s
    all[#all + 1] = s
  end
  return s
end

local sweep

-- The counters of one kind of lock in one collection of a client, kept in
-- Lua on the client itself: counting is a table increment on the caller's
-- thread (no lock, no round trip; inside nginx one set per worker).
-- Returns nil for a client made otherwise (no _series).
function _M.series(client, kind, db, coll)
  local all = type(client) == "table" and rawget(client, "_series")
  if not all then return nil end
  if not all.recorded then
    all.recorded = true
    -- the records of clients closed or collected meanwhile are folded
    -- first, so that they do not pile up in a process without metrics
    sweep()
    records[#records + 1] = { series = all, client = setmetatable({ client }, { __mode = "v" }) }
  end
  return new_series(all, kind, db .. "." .. coll)
end

-- the stand-ins that run a client's commands as jobs: nginx's worker
-- threads (mongolock.ngx) and a scheduler's thread pool (mongolock.sched)
local RUNNERS = { "_ngx_core", "_sched_core" }

-- the commands client sent as jobs (the stand-ins' counts)
function _M.jobs(client)
  local n = 0
  for _, k in ipairs(RUNNERS) do
    local p = rawget(client, k)
    if p and p.count then n = n + p.count.n end
  end
  return n
end

-- the same for a record, whose client may be gone (the stand-ins' count
-- tables are kept by the record)
local function jobs_count(r, client)
  local n = 0
  for _, k in ipairs(RUNNERS) do
    local p = client and rawget(client, k)
    if p and p.count then r[k] = p.count end
    if r[k] then n = n + r[k].n end
  end
  return n
end

-- series, commands = _M.totals(): the process's Lua counters: a list of
-- series (as client._series's, every client's summed by kind and
-- collection) and the commands sent as nginx jobs.  A closed or collected
-- client's are folded into _M.retired on the way, so they stay for ever.
local SUMMED = { "acquisitions", "waits", "timeouts", "busy", "wait_sum" }

-- series s added into the sums `into`
local function add(into, s)
  local t = new_series(into, s.kind, s.collection)
  for _, f in ipairs(SUMMED) do t[f] = t[f] + s[f] end
  for i, n in ipairs(s.wait_counts) do t.wait_counts[i] = t.wait_counts[i] + n end
end

-- folds the records of clients closed or collected into _M.retired; the
-- others' series are added into acc, when given
function sweep(acc)
  local retired = _M.retired
  local i = 1
  while records[i] do
    local r = records[i]
    local client = r.client[1]
    local jobs = jobs_count(r, client)
    if client == nil or client:closed() then
      for _, s in ipairs(r.series) do add(retired, s) end
      retired.commands = (retired.commands or 0) + jobs
      table_remove(records, i)
    else
      if acc then
        for _, s in ipairs(r.series) do add(acc, s) end
        acc.commands = (acc.commands or 0) + jobs
      end
      i = i + 1
    end
  end
end

function _M.totals()
  local retired = _M.retired
  local acc = { by = {} }
  sweep(acc)
  for _, s in ipairs(retired) do add(acc, s) end
  return acc, (acc.commands or 0) + (retired.commands or 0)
end

-- one acquisition that waited `seconds`
function _M.observe_wait(s, seconds)
  s.waits = s.waits + 1
  s.wait_sum = s.wait_sum + seconds
  local i = 1
  while i <= NBUCKETS and seconds > WAIT_BUCKETS[i] do i = i + 1 end
  s.wait_counts[i] = s.wait_counts[i] + 1
end

-- counts the answer of one attempt made alone (a try, or an acquire with
-- timeout = 0): returns the answer unchanged
function _M.count_one(s, a, b, ...)
  if s then
    if a ~= nil then s.acquisitions = s.acquisitions + 1
    elseif b == "busy" then s.busy = s.busy + 1
    elseif b == "timeout" then s.timeouts = s.timeouts + 1 end
  end
  return a, b, ...
end

-- every client of this process made by mongolock.connect (weak: for
-- mongolock.metrics)
_M.clients = setmetatable({}, { __mode = "k" })

-- client:on_lost's callbacks, by core client (weak: a callback never
-- keeps a client alive)
local listeners = setmetatable({}, { __mode = "k" })
_M.listeners = listeners

-- Hands the lease events queued in C (csrc/binding/stats.c: lost, renewal failed)
-- to the core client's callback, each in a pcall (an error in it is
-- returned, never raised into the library's caller); returns how many.
-- Cheap when nothing waits: one look at a count, no lock.
function _M.deliver(cc)
  local fn = listeners[cc]
  if fn == nil or not cc:has_events() then return 0 end
  local evs = cc:take_events()
  local errs
  for i = 1, #evs do
    local ok, err = pcall(fn, evs[i])
    if not ok then errs = errs or {}; errs[#errs + 1] = tostring(err) end
  end
  return #evs, errs
end

return _M
