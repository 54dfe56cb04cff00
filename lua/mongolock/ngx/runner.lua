-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.ngx.runner: nginx's runner of the core client, where a
-- request can yield: mongolock.yielding's stand-in (the C client's methods,
-- each round trip a job of mongolock.ngx: on the event loop through
-- cosockets, or in a worker thread); what nobody waits for runs from a
-- timer, and the client's lease engine from one timer per worker and
-- client (the adapter below).  mongolock.connect gives a client made
-- inside nginx this runner (attach).
--
-- Invariants (besides mongolock.yielding's):
-- - An attempt whose caller stopped waiting (its deadline passed while it
--   was in flight, its request went away) has its outcome taken from a
--   timer (jobs.run's on_orphan).
-- - The lease engine's commands run from one timer per worker and client,
--   never from a request.  So do the change streams' (watch.c): a second
--   timer hands each command to a job of its own, and after each reply
--   wakes the worker's waiters, which look without blocking (watch_wait).

local core = require "mongolock.core"
local jobs = require "mongolock.ngx"
local stats = require "mongolock.stats"
local yielding = require "mongolock.yielding"

local type, pairs, pcall, rawget, rawset, setmetatable, tostring, select =
  type, pairs, pcall, rawget, rawset, setmetatable, tostring, select
local unpack = table.unpack or rawget(_G, "unpack")
local monotonic = core.monotonic
local getpid = core.getpid
local math_min, math_max, math_huge = math.min, math.max, math.huge

local _M = { _VERSION = "0.1.0", CAP = 0.25 }

local function pack(...) return { n = select("#", ...), ... } end

-- op's outcome: a job (jobs.run), which runs on the event loop through
-- cosockets where it can (p.pool), else in a worker thread
local function run(p, op, deadline, on_orphan, arg)
  return jobs.run(p.spec, op, deadline, on_orphan, arg, p.pool)
end

local function log(level, ...)
  local ngx = rawget(_G, "ngx")
  if ngx and ngx.log then ngx.log(ngx[level], "mongolock: ", ...) end
end

-- runs fn(...) from a timer (the caller does not wait)
local function later(fn, ...)
  local ngx = rawget(_G, "ngx")
  local args = pack(...)
  local ok, err = ngx.timer.at(0, function(premature)
    local pok, perr = pcall(fn, unpack(args, 1, args.n))
    if not pok then log("ERR", tostring(perr)) end
    return premature
  end)
  if not ok then log("ERR", "no timer: ", err) end
end

-- ---- the lease engine's adapter ------------------------------------------------

-- One timer per worker and client runs what the client's lease engine
-- asks for (cc:engine_next): renewals, grant top-ups, releases of
-- collected handles and of attempts whose reply was lost.  A worker that is
-- shutting down keeps it while the engine has work, and while a handle made
-- here is held, up to its deadline (then the server frees the lock).
-- p.looks: how many times it looked at the engine (specs read it).
local function adapter(premature, p)
  local ngx = rawget(_G, "ngx")
  local cc, exiting_until, deliver = p.cc, nil, stats.deliver
  while not cc:closed() do
    -- lease events (lost, renewal failed) the engine queued: to the
    -- client's on_lost callback, here on the event loop
    local vok, n, errs = pcall(deliver, cc)
    if not vok then log("ERR", "on_lost: ", tostring(n))
    elseif errs then log("ERR", "on_lost: ", table.concat(errs, "; ")) end
    p.looks = p.looks + 1
    local ok, id, op = pcall(cc.engine_next, cc, _M.CAP)
    if not ok then
      log("ERR", "lease engine: ", tostring(id))
      break
    elseif id ~= nil then
      local started = monotonic()
      p.count.n = p.count.n + 1
      local done, reply, err, code, ereply, domain = jobs.direct(p.pool, op)
      if not done then reply, err, code, ereply, domain = run(p, op) end
      local dok, derr = pcall(cc.engine_done, cc, id, started, reply, err, code, ereply, domain)
      if not dok then log("ERR", "lease engine: ", tostring(derr)) end
    else
      local seconds = op or math_huge
      if premature or ngx.worker.exiting() then
        -- the handles made here that are held keep it up to the latest
        -- of their local deadlines at the first look (renewal does not
        -- keep a worker that is shutting down longer)
        local now, held, latest = monotonic(), false, monotonic()
        for h in pairs(p.handles) do
          local left = h:remaining()
          if left then held, latest = true, math_max(latest, now + left) end
        end
        if not exiting_until and latest - now > jobs.LINGER then   -- (said once)
          log("WARN", "this worker is shutting down; locks held here keep it up to ", ("%.1f"):format(latest - now),
            " s")
        end
        exiting_until = exiting_until or latest
        if (seconds == math_huge and not held) or now >= exiting_until then break end
      end
      p.wake:wait(math_max(0.001, math_min(seconds, _M.CAP)))
    end
  end
  p.adapter = nil
end

local function start_adapter(p)
  if p.adapter == getpid() or not p.cc.engine_next then return end
  local ngx = rawget(_G, "ngx")
  local ok, err = ngx.timer.at(0, adapter, p)
  if ok then p.adapter = getpid()
  else log("ERR", "no timer for the lease engine: ", err) end
end

-- ---- the change streams' adapter ---------------------------------------------

local function stream_job(_, p, id, op)
  local reply, err, code, ereply, domain = jobs.run(p.spec, op)
  local ok, derr = pcall(p.cc.watch_done, p.cc, id, reply, err, code, ereply, domain)
  if not ok then log("ERR", "change stream: ", tostring(derr)) end
  local waiting = -p.events:count()
  if waiting > 0 then p.events:post(waiting) end
  p.swake:post(1)
end

local function streams(premature, p)
  local ngx = rawget(_G, "ngx")
  local cc, stopped = p.cc, false
  while true do
    if not stopped and (premature or ngx.worker.exiting()) then
      stopped = pcall(cc.watch_stop, cc)
      local waiting = -p.events:count()
      if waiting > 0 then p.events:post(waiting) end
    end
    local ok, id, op = pcall(cc.watch_next, cc)
    if not ok then
      log("ERR", "change stream: ", tostring(id))
      break
    elseif id ~= nil then
      local tok, terr = ngx.timer.at(0, stream_job, p, id, op)
      if not tok then pcall(cc.watch_done, cc, id, nil, "no timer: " .. tostring(terr)) end
    elseif op == math_huge then
      break
    else
      p.swake:wait(math_max(0.001, math_min(op, _M.CAP)))
    end
  end
  p.streams = nil
end

-- p.await_event(seconds): a waiter of the worker sleeps until a stream's
-- reply was taken (it then looks again), at most seconds; the adapter
-- sends what the waiter needs (a getMore, a stream's opening) meanwhile
local function await_event(p, seconds)
  if p.streams ~= getpid() then
    local ok, err = rawget(_G, "ngx").timer.at(0, streams, p)
    if ok then p.streams = getpid()
    else log("ERR", "no timer for the change streams: ", err) end
  end
  if p.swake:count() < 1 then p.swake:post(1) end
  p.events:wait(seconds)
end

-- a handle made here: the adapter looks at once when it does not run, or
-- when the lease is due before its next look (the engine says so)
local function made(p, h)
  if h ~= nil and type(h) ~= "string" then
    p.handles[h] = true
    if p.adapter ~= getpid() then start_adapter(p)
    elseif p.cc:engine_poked() and p.wake:count() < 1 then p.wake:post(1) end
  end
  return h
end

-- this worker's counters: attempts, granted (mongolock.yielding's, per
-- process)
_M.stats = yielding.stats

-- nginx's runner (mongolock.yielding documents runners) over state: the
-- stand-in's nginx state (its spec and pool, handles made here, the
-- engine's semaphore)
local function runner_of(state)
  return {
    active = jobs.active,
    run = function(op, deadline, on_orphan, arg) return run(state, op, deadline, on_orphan, arg) end,
    later = later,
    log = log,
    made = function(_, h) return made(state, h) end,
    attempts = true,        -- an attempt's op goes to pool:here as the attempt
  }
end

-- true where round trips go to worker threads (mongolock.ngx)
_M.active = jobs.active

-- gives client (made inside nginx by mongolock.connect) this runner
-- (mongolock.runners)
function _M.attach(client)
  rawset(client, "_ngx", _M)
end

-- the stand-in for client (a mongolock client: _core, uri, connect_opts),
-- one per client and process
function _M.of(client)
  local p = rawget(client, "_ngx_core")
  local pid = getpid()
  if p and p.pid == pid then return p end
  local cc = client._core
  local spec = jobs.spec(client.uri, client.connect_opts)
  -- the engine adapter's state (no reference to the client: see
  -- mongolock.yielding)
  -- commands sent as jobs (client:stats().commands), the adapter's too
  local count = { n = 0 }
  local semaphore = require "ngx.semaphore"
  -- round trips on the event loop: a pool of no thread whose ops' bytes
  -- go through cosockets (mongolock.ngx's runners, jobs.direct)
  local pok, pool = pcall(core.pool, cc, 0, "bridged")
  local state = { cc = cc, looks = 0, spec = spec, handles = setmetatable({}, { __mode = "k" }),
                  wake = semaphore.new(0), count = count, events = semaphore.new(0), swake = semaphore.new(0),
                  pool = pok and pool or nil }
  local runner = runner_of(state)
  p = yielding.new(cc, runner, { spec = spec, state = state, count = count,
    await_event = function(seconds) return await_event(state, seconds) end })
  rawset(client, "_ngx_core", p)
  if cc.set_methods and core.lease_step then
    -- (plain data only: the core's table of them is weak on the client)
    cc:set_methods(yielding.lease_methods({ active = jobs.active,
      run = function(op) return run(state, op) end, count = count }))
    cc:set_external(true)
    start_adapter(state)
  end
  return p
end

return _M
