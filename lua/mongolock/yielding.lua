-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.yielding: the core client's stand-in where the caller can
-- yield and its round trips run elsewhere.  The portable modules
-- (mongolock.locks, mongolock.shared, mongolock.documents) call a core
-- client; mongolock.runners.core_of gives them this stand-in instead, with
-- the C client's methods, arguments and answers.  Each round trip is one
-- job of a runner:
--
--   a = client:X_attempt(<X's arguments>)      (an acquire attempt, any kind)
--   op = a:op()                                (or core.op_*: built in C)
--   reply, ... = runner.run(op, deadline, ...) (a job elsewhere)
--   <answer> = a:take(reply, ...)              (or core.parse_*: the C tail)
--
-- so an attempt that won becomes a mongolock.Lock of the caller's client,
-- the same handle as everywhere else: its states, answers, renewal, grant
-- top-up and release on collection are the C core's.  The handles'
-- release, extend and close, where the caller can yield, are the lease's
-- steps (core.lease_step, core.lease_done) around a job.
--
-- Two runners: inside nginx (mongolock.ngx.runner: nginx worker threads,
-- timers) and in a coroutine scheduler (mongolock.sched: the core's
-- worker-thread pool, the scheduler's waits).  A runner is a table:
--
--   runner.active()       true when the caller can yield here (else the
--                         C client's own blocking methods run)
--   runner.run(op [, deadline, on_orphan, arg])
--                         -> reply | nil, err, code, ereply, domain: op run
--                         elsewhere while the caller yields; with a
--                         deadline the caller may stop waiting then (nil,
--                         "timeout" with no code and no reply), and
--                         on_orphan(arg, <outcome>) takes the outcome later
--   runner.send(op)       (optional) op sent, nobody waits for it; else
--   runner.later(fn, ...) runs fn(...) soon; the caller does not wait
--   runner.made(p, h)     (optional) a handle h was made through p
--   runner.attempts       (optional) true: runner.run takes an attempt
--                         itself where it takes a:op() (pool:here builds
--                         its op into C memory, no Lua string); an attempt
--                         that comes back unsent (a:sent() false) ran nowhere
--
-- The runner must not reference the client: the core's table of the
-- handles' methods is weak on the client, and LuaJIT has no ephemerons.
--
-- Invariants:
-- - Nothing here decides about a lease: what to send and what a reply
--   means is the C core's.
-- - An attempt whose caller stopped waiting (its deadline passed while it
--   was in flight) never leaves a lock held by nobody: its outcome is
--   taken by the same C tail later, the handle it won closed at once, and
--   a waiter it queued leaves the queue.
-- - A queue's leave is sent later: the caller, whose time is up, does not
--   wait for it.

local core = require "mongolock.core"
local errors = require "mongolock.errors"

local type, pcall, setmetatable, tostring = type, pcall, setmetatable, tostring
-- this process's id without a system call (core.pid: taken again at fork)
local getpid = core.pid or core.getpid

local _M = { _VERSION = "0.1.0" }

local P = {}
local mt = { __index = P }


local function log(runner, ...)
  if runner.log then runner.log(...) end
end

-- ---- the handles' methods where the caller can yield --------------------------

-- release, extend and close of the client's handles: the lease's step
-- (what to send, or the answer), the job, the lease's answer to the reply
function _M.lease_methods(runner)
  local C = core.lock_methods
  local function method(what)
    local plain = C[what]
    return function(h, arg)
      if not runner.active() then return plain(h, arg) end
      local op, started = core.lease_step(h, what, arg)
      if op == nil or op == true then return op, started end
      if runner.count then runner.count.n = runner.count.n + 1 end
      local reply, err, code, ereply, domain = runner.run(op)
      return core.lease_done(h, what, started, reply, err, code, ereply, domain)
    end
  end
  return { release = method("release"), extend = method("extend"), close = method("close") }
end

-- ---- the stand-in ------------------------------------------------------------

function P.closed(p) return p.cc:closed() end
function P.writable(p) return p.cc:writable() end
function P.request_scan(p) return p.cc:request_scan() end

-- per process: named-lock attempts sent, and locks a release granted made
-- from its change event without a command
local counters = { pid = nil }
local function stats()
  local pid = getpid()
  if counters.pid ~= pid then counters = { pid = pid, attempts = 0, granted = 0 } end
  return counters
end

-- this process's counters: attempts, granted
function _M.stats()
  local c = stats()
  return { attempts = c.attempts, granted = c.granted }
end

local function made(p, h)
  if h ~= nil and type(h) ~= "string" and p.runner.made then p.runner.made(p, h) end
  return h
end

function P.granted(p, ...)
  local h = made(p, p.cc:granted(...))
  local c = stats()
  c.granted = c.granted + 1
  return h
end

-- the outcome of an attempt nobody waits for any more (o: what the
-- attempt was, a table, not upvalues: see mongolock.ngx's run): taken by
-- the same C tail, a handle it won closed at once, a queue it joined left
-- what an orphaned attempt was, in the log: its kind's words (what) and
-- the lock's name
local WHAT = { acquire_attempt = "'%s'", campaign_attempt = "a campaign for '%s'",
               share_acquire_attempt = "a share of '%s'", doc_acquire_attempt = "a document's lock" }

local function orphaned(o, reply, err, code, ereply, domain)
  local p, a = o.p, o.attempt
  if p.cc:closed() then return end
  local ok, h = pcall(a.take, a, reply, err, code, ereply, domain)
  local what = WHAT[o.make]:format(tostring(o.name))
  if ok and h ~= nil and type(h) ~= "string" then
    local cok, cerr = pcall(h.close, h)
    if cok then log(p.runner, "WARN", what, " was won after its caller gave up: released")
    else log(p.runner, "ERR", what, " was won after its caller gave up; release failed: ", tostring(cerr)) end
    return
  end
  if reply == nil and errors.network_error(code, err) then
    log(p.runner, "WARN", what, " got no reply after its caller gave up (", tostring(err), ")")
  end
  if o.leave then pcall(p[o.leave], p, o.db, o.coll, o.name, o.waiter) end
end

-- the C tail's answers, after the handle (their first value) is made
-- known to the runner
local function taken(p, h, ...)
  made(p, h)
  return h, ...
end

-- one attempt of any kind: the attempt the C client's constructor `make`
-- (client:X_attempt) prepares from the method's arguments (...), its op,
-- the job, its C tail on the outcome.  deadline: the caller stops waiting
-- then (nil: it waits for the reply).  A waiter's attempt that is
-- orphaned leaves the queue with p[leave](p, db, coll, name, waiter)
local function run_attempt(p, make, deadline, leave, db, coll, name, waiter, ...)
  local cc = p.cc
  if cc:closed() then return nil, "closed" end
  local a, aerr, acode = cc[make](cc, db, coll, name, ...)
  if not a then return nil, aerr, acode end
  local op = p.runner.attempts and a or a:op()
  local o = { p = p, attempt = a, make = make, leave = waiter and leave, db = db, coll = coll, name = name,
              waiter = waiter }
  p.count.n = p.count.n + 1
  local reply, err, code, ereply, domain = p.runner.run(op, deadline, orphaned, o)
  if not reply and err == "timeout" and code == nil and ereply == nil then
    -- the runner's: not started, or in flight and orphaned() takes it
    return nil, "timeout"
  end
  -- the runner's own failure before the op went anywhere: nothing to take
  if op == a and not a:sent() then return nil, err, code end
  if cc:closed() then return nil, "closed" end
  return taken(p, a:take(reply, err, code, ereply, domain))
end

-- client:acquire's arguments, then the caller's deadline
-- (and the lock-delay, after the attempt's owner, which it leaves new)
function P.acquire(p, db, coll, name, ttl_ms, app, renew, waiter, queue_ms, polling, deadline, delay_ms)
  local c = stats()
  c.attempts = c.attempts + 1
  return run_attempt(p, "acquire_attempt", deadline, "leave", db, coll, name, waiter,
    ttl_ms, app, renew, waiter, queue_ms, polling, nil, delay_ms)
end

-- client:campaign's arguments (an election's attempt), then the deadline
function P.campaign(p, db, coll, name, ttl_ms, app, renew, waiter, queue_ms, value, deadline, delay_ms)
  local c = stats()
  c.attempts = c.attempts + 1
  return run_attempt(p, "campaign_attempt", deadline, "leave", db, coll, name, waiter,
    ttl_ms, app, renew, waiter, queue_ms, value, nil, delay_ms)
end

function P.share_acquire(p, db, coll, name, mode, permits, ttl_ms, app, renew, waiter, queue_ms, polling,
                         deadline, delay_ms)
  return run_attempt(p, "share_acquire_attempt", deadline, "share_leave", db, coll, name, waiter,
    mode, permits, ttl_ms, app, renew, waiter, queue_ms, polling, nil, delay_ms)
end

function P.doc_acquire(p, db, coll, id, ttl_ms, owner_field, time_field, time, owner_type, insert, renew,
                       deadline)
  return run_attempt(p, "doc_acquire_attempt", deadline, nil, db, coll, id, nil,
    ttl_ms, owner_field, time_field, time, owner_type, insert, renew)
end

-- one command and its parser: answer | nil, err, code
local function command(p, op, parse)
  if p.cc:closed() then return nil, "closed" end
  p.count.n = p.count.n + 1
  local reply, err, code = p.runner.run(op)
  if not reply then return nil, err, code end
  return parse(reply)
end

local function updated(reply)
  if (core.parse_update(reply) or 0) > 0 then return true end
  return nil, "not held"
end

function P.ensure_index(p, db, coll, expire_after)
  return command(p, core.op_ensure_index{ db = db, coll = coll, expire_after = expire_after },
    function() return true end)
end

function P.status(p, db, coll, name)
  return command(p, core.op_status{ db = db, coll = coll, name = name },
    function(reply) return core.parse_status(reply)[1] end)
end

function P.list(p, db, coll)
  return command(p, core.op_status{ db = db, coll = coll }, core.parse_status)
end

function P.force_release(p, db, coll, name)
  return command(p, core.op_force_release{ db = db, coll = coll, name = name }, updated)
end

function P.share_force_release(p, db, coll, name)
  return command(p, core.op_share_force_release{ db = db, coll = coll, name = name }, updated)
end

function P.share_status(p, db, coll, name)
  return command(p, core.op_share_status{ db = db, coll = coll, name = name }, function(reply)
    local r = core.bson_decode(reply)
    local batch = type(r) == "table" and r.cursor and r.cursor.firstBatch or {}
    if name == nil then return batch end
    return batch[1]
  end)
end

function P.doc_status(p, db, coll, id, ttl_ms, owner_field, time_field, time, owner_type)
  return command(p, core.op_doc_status{ db = db, coll = coll, id = id, ttl_ms = ttl_ms,
    owner_field = owner_field, time_field = time_field, time = time, owner_type = owner_type },
    core.parse_doc_status)
end

local function leave(p, op)
  local runner = p.runner
  p.count.n = p.count.n + 1
  if runner.send then runner.send(op)
  else runner.later(function() return runner.run(op) end) end
  return true
end

function P.leave(p, db, coll, name, waiter)
  return leave(p, core.op_leave{ db = db, coll = coll, name = name, waiter = waiter, tag = core.process_tag() })
end

-- the release of what a waiter's id may hold, by the lease engine (its
-- adapter sends it: nginx's timer, or the client's own thread)
function P.release_later(p, ...)
  return p.cc:release_later(...)
end

function P.share_leave(p, db, coll, name, waiter)
  return leave(p, core.op_share_leave{ db = db, coll = coll, name = name, waiter = waiter,
    tag = core.process_tag() })
end

-- reply | nil, err, code, ereply: any op of the client's (client:command)
function P.run(p, op)
  p.count.n = p.count.n + 1
  return p.runner.run(op)
end

-- the stand-in for the core client cc whose round trips go to runner;
-- fields of extra are copied into it (a runner's own state)
function _M.new(cc, runner, extra)
  local p = { cc = cc, pid = getpid(), runner = runner }
  for k, v in pairs(extra or {}) do p[k] = v end
  -- commands sent through the runner (client:stats().commands)
  p.count = p.count or { n = 0 }
  return setmetatable(p, mt)
end

return _M
