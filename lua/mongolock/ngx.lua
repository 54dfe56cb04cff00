-- Internal to mongolock, except configure{}, which init_by_lua may call (README,
-- OpenResty); the rest may change without notice.
--
-- mongolock.ngx: MongoDB round trips that never block the nginx event loop.
--
-- A libmongoc call made by a handler would stop every request its worker
-- serves until the server answers.  Each round trip is a job instead:
--
--   local reply, err, code = jobs.run(spec, op, deadline, on_orphan, arg, pool)
--
-- (where jobs.active()).  op is a BSON string built in C (core.op_*) or a
-- prepared mongolock.Attempt (pool:here builds its op), spec
-- the plain description of a client (jobs.spec), the reply a BSON string.
-- A runner runs the job on the event loop itself where it can (pool, a
-- bridged core.pool: mongolock.bridge, its bytes moved by cosockets), else
-- in a thread of nginx's thread pool (ngx.run_worker_thread), which
-- nginx.conf must have: `thread_pool mongolock threads=8;`
--
-- Invariants:
-- - A job is one bounded operation; waiting happens on the event loop.
-- - At most max_running runners (timers) per worker; the rest queue here,
--   in order.  max_running stays below lua_worker_thread_vm_pool_size, so
--   ngx.run_worker_thread never answers "no available Lua vm" to us, and
--   nginx's own queue never overflows (its failure paths are unsafe in
--   lua-nginx-module before 0.10.32).
-- - The runners are timers, not the requests: a request that stops waiting (its deadline passed,
--   it was aborted) never loses a job's result.  Its job is "abandoned": never run if not started,
--   else on_orphan(arg, <outcome>) runs when it ends.  A caller gone without saying so is found by
--   the janitor: a result not taken within `grace` seconds.  A job taken by its caller leaves
--   the janitor's list at once.
-- - Clients live in the thread VMs (mongolock.ngx.thread), one per VM and
--   spec, made after nginx forked; state of one process is never used by
--   another.
-- - A worker that is shutting down keeps its runners and janitor while a
--   job or a result is pending.

--- Inside nginx: where the round trips run. Only `configure` is public.
-- @module mongolock.ngx

local core = require "mongolock.core"
local runners = require "mongolock.runners"
local args = require "mongolock.args"
local bridge = require "mongolock.bridge"

local type, pairs, tostring, error, pcall = type, pairs, tostring, error, pcall
local rawget = rawget
local monotonic = core.monotonic
local getpid = core.getpid
local math_max, math_min = math.max, math.min
local unpack = table.unpack or rawget(_G, "unpack")

local _M = { _VERSION = "0.1.0", LINGER = 5 }  -- LINGER: s a worker shuts down before we say what keeps it

-- mongolock.ngx.thread's answer when its VM needs the spec (kept here: the
-- event loop does not load the thread's module)
local NEED_SPEC = "mongolock.ngx.thread: spec needed"

local config = {
  thread_pool = "mongolock", -- the thread_pool directive's name
  max_running = 8,           -- jobs in flight per worker
  idle = 10,                 -- seconds an idle runner waits for work before it ends
  grace = 1,                 -- seconds a result waits for its caller before it is abandoned
  enabled = true,            -- false: round trips stay on the event loop (blocking)
  cosockets = true,          -- false: every round trip is a worker thread's job
}

-- phases of ngx_lua in which a request can yield (ngx.sleep,
-- ngx.semaphore): the library's one table of them (mongolock.runners)
local yieldable = runners.yieldable

local semaphore
local function ngx_api()
  local ngx = rawget(_G, "ngx")
  if not ngx or not ngx.run_worker_thread or not ngx.get_phase then return nil end
  if semaphore == nil then
    local ok, s = pcall(require, "ngx.semaphore")
    semaphore = ok and s or false
  end
  if not semaphore then return nil end
  return ngx
end

local CONFIG_KEYS = {}
for k in pairs(config) do CONFIG_KEYS[k] = true end

--- Sets the thread pool, the jobs a worker runs at once, and idle and grace times.
-- jobs.configure{thread_pool =, max_running =, idle =, grace =, enabled =, cosockets =}
-- (init_by_lua, or before the first round trip): raises on a bad option
function _M.configure(opts)
  args.check_type(opts, "table", 1, "configure")
  args.check_keys(opts, CONFIG_KEYS, 1, "configure")
  for k, v in pairs(opts) do
    local want = type(config[k])
    if type(v) ~= want or v == "" or (want == "number" and (v ~= v or v <= 0 or v == math.huge
        or (k == "max_running" and v % 1 ~= 0))) then
      args.argerror(1, "configure", k .. ": " .. (k == "thread_pool" and "a thread pool's name"
        or want == "boolean" and "boolean" or k == "max_running" and "a positive integer"
        or "a positive number of seconds") .. " expected")
    end
  end
  for k, v in pairs(opts) do config[k] = v end
end

-- true when round trips made from here go to a worker thread: inside an
-- nginx worker with ngx.run_worker_thread, in a phase that can yield
function _M.active()
  local ngx = config.enabled and ngx_api()
  return ngx and yieldable[ngx.get_phase()] == true or false
end

-- spec = jobs.spec(uri, opts): the plain description of a client
-- (mongolock.connect's arguments) that a thread VM makes its client from;
-- equal arguments give equal keys, so they share a client in each VM
function _M.spec(uri, opts)
  local o, keys = {}, {}
  for k, v in pairs(opts or {}) do
    if type(v) == "string" or type(v) == "number" or type(v) == "boolean" then
      o[k] = v
      keys[#keys + 1] = k
    end
  end
  table.sort(keys)
  local key = { uri }
  for _, k in ipairs(keys) do key[#key + 1] = k .. "=" .. tostring(o[k]) end
  return { key = table.concat(key, "\0"), uri = uri, opts = o }
end

-- ---- per-process state ---------------------------------------------------

local state

local function get_state()
  local pid = getpid()
  if state and state.pid == pid then return state end
  state = {
    pid = pid,
    queue = {}, first = 1, last = 0,  -- jobs not started, in order
    runners = 0,                      -- runners alive
    idle = {},                        -- idle runners' semaphores, most recent last
    unclaimed = {},                   -- job -> true: results posted, not taken yet (jobs with on_orphan)
    semas = {},                       -- semaphores of jobs taken, for the next ones
    janitor = false,
    stats = { jobs = 0, abandoned = 0, orphans = 0, max_queued = 0, max_running = 0, errors = 0,
              vm_refusals = 0, here = 0 },
    kept = {},                        -- bridged connections' sockets in nginx's keepalive pools: id -> true
    addrs = {},                       -- host -> {address, until} (cosockets)
    cap = nil,                        -- below max_running after "no available Lua vm"
  }
  return state
end

local function push(st, job)
  st.last = st.last + 1
  st.queue[st.last] = job
  local queued = st.last - st.first + 1
  if queued > st.stats.max_queued then st.stats.max_queued = queued end
end

local function pop(st)
  while st.first <= st.last do
    local job = st.queue[st.first]
    st.queue[st.first] = nil
    st.first = st.first + 1
    -- a caller that gave up before its job started: nothing was sent
    if job.state ~= "abandoned" then return job end
  end
  return nil
end

local function orphan(st, job)
  st.stats.orphans = st.stats.orphans + 1
  if not job.on_orphan then return end
  local ngx = rawget(_G, "ngx")
  local ok, err = ngx.timer.at(0, function()
    local pok, perr = pcall(job.on_orphan, job.orphan_arg, unpack(job.result, 1, 5))
    if not pok then ngx.log(ngx.ERR, "mongolock: ", tostring(perr)) end
  end)
  if not ok then ngx.log(ngx.ERR, "mongolock: cannot release what an abandoned job acquired: ", err) end
end

-- ---- round trips on the event loop (cosockets) ------------------------------

local POOL = "mongolock.bridged:"  -- + a connection's id: its socket's keepalive pool (size 1)

local function ms(secs) return math_max(1, math.ceil(secs * 1000)) end

-- host's address for a cosocket (nginx resolves no name without its own
-- resolver, and never from /etc/hosts): a worker thread's getaddrinfo,
-- kept a minute
local function address(st, host)
  if host:find(":", 1, true) then return "[" .. host .. "]" end
  if host:find("^[%d.]+$") then return host end
  local a = st.addrs[host]
  if a and a[2] > monotonic() then return a[1] end
  local ok, addr, err = rawget(_G, "ngx").run_worker_thread(config.thread_pool, "mongolock.core", "resolve", host)
  if not ok or not addr then return nil, tostring(ok and err or addr) end
  st.addrs[host] = { addr:find(":", 1, true) and "[" .. addr .. "]" or addr, monotonic() + 60 }
  return st.addrs[host][1]
end

-- the socket nginx keeps for connection id, or nil: found by its pool's
-- name alone, at an address nothing listens on (never a new connection),
-- with cosocket object s (a new one when nil)
local function kept_socket(id, msecs, s)
  s = s or rawget(_G, "ngx").socket.tcp()
  s:settimeout(msecs)
  if s:connect("127.0.0.1", 0, { pool = POOL .. id }) then return s end
end

-- mongolock.bridge's io.  A runner's (mine: a table) connects the object
-- it used for a connection before: nginx reuses what it made for one kept
-- or closed.  An object is its timer's (nginx raises "bad request" in
-- another); ids are never reused, and a runner keeps at most 16 objects
local function sockets(mine)
  local function object(id)
    local s = mine and mine[id]
    if s then return s end
    s = rawget(_G, "ngx").socket.tcp()
    if mine then
      if mine.n == 16 then mine = { n = 0 } end
      mine[id], mine.n = s, mine.n + 1
    end
    return s
  end
  return {
    open = function(id, host, port, used, secs)
      local st = get_state()
      st.kept[id] = nil
      local s = used and kept_socket(id, ms(secs), object(id))
      if used then return s, not s and "the connection was closed while it was idle" or nil end
      local addr, err = address(st, host)
      s = object(id)
      s:settimeout(ms(secs))
      local ok
      if addr then ok, err = s:connect(addr, port, { pool = POOL .. id }) end
      if ok then return s end
      st.addrs[host] = nil
      return nil, err
    end,
    send = function(s, bytes, secs) s:settimeout(ms(secs)); return s:send(bytes) end,
    recv = function(s, max, secs) s:settimeout(ms(secs)); return s:receiveany(max) end,
    keep = function(id, s) if s:setkeepalive(0, 1) then get_state().kept[id] = true end end,
    drop = function(s) s:close() end,
    dead = function(ids)
      local kept = get_state().kept
      for i = 1, #ids do
        local s = kept[ids[i]] and kept_socket(ids[i], 100)
        kept[ids[i]] = nil
        if s then s:close() end
      end
    end,
  }
end

local cosockets = sockets(nil)

-- true, <the op's outcome> | false: op run on the event loop (io: a
-- runner's sockets, else cosockets), or not
local function here(ngx, st, pool, op, io)
  if not config.cosockets or not pool then return false end
  if st.threads == nil then
    -- the thread pool is still needed (change streams, ops that cannot
    -- run here): without it, every round trip fails as the jobs say
    local ok, why = ngx.run_worker_thread(config.thread_pool, "string", "len", "")
    st.threads = ok or not tostring(why):find("not found", 1, true)
  end
  if not st.threads then return false end
  local done, a, b, c, d, e = bridge.run(pool, op, io or cosockets)
  if done then st.stats.here = st.stats.here + 1 end
  return done, a, b, c, d, e
end

-- true, <outcome> | false: op on the caller's cosockets (a timer's: nothing aborts it)
function _M.direct(pool, op) return here(rawget(_G, "ngx"), get_state(), pool, op) end

-- one job, in a runner: on the event loop (here) when it can be, else in
-- a worker thread
local function execute(st, job, io)
  local ngx = rawget(_G, "ngx")
  job.state = "running"
  local running = st.runners - #st.idle
  if running > st.stats.max_running then st.stats.max_running = running end
  local spec = job.spec
  local ok, reply, err, code, ereply, domain = here(ngx, st, job.pool, job.op, io)
  if not ok then   -- a worker thread runs it
    st.stats.jobs = st.stats.jobs + 1
    -- an attempt (mongolock.yielding's runner.attempts) crosses as its op
    if type(job.op) ~= "string" then job.op = job.op:op() end
    ok, reply, err, code, ereply, domain = ngx.run_worker_thread(config.thread_pool, "mongolock.ngx.thread", "run",
      spec.key, job.op)
    if ok and reply == nil and err == NEED_SPEC then
      -- this thread VM has no client for the spec yet: nothing was sent
      ok, reply, err, code, ereply, domain = ngx.run_worker_thread(config.thread_pool, "mongolock.ngx.thread", "run",
        spec.key, job.op, spec)
    end
    if not ok and reply == "no available Lua vm" then
      -- other code holds VMs too, or lua_worker_thread_vm_pool_size is below
      -- max_running: nothing was sent; the job goes back to the head of the
      -- queue and this worker runs one job fewer at once from now on
      st.stats.vm_refusals = st.stats.vm_refusals + 1
      st.stats.jobs = st.stats.jobs - 1
      job.state = "queued"
      st.first = st.first - 1
      st.queue[st.first] = job
      st.cap = math_max(1, math_min(st.cap or config.max_running, running - 1))
      return "refused"
    end
    if not ok then
      st.stats.errors = st.stats.errors + 1
      local why = tostring(reply)
      if why:find("not found", 1, true) then
        why = why .. " (nginx.conf needs 'thread_pool " .. config.thread_pool .. " threads=N;')"
      end
      reply, err, code, ereply, domain = nil, "worker thread: " .. why, nil, nil, nil
    end
  end
  job.result = { reply, err, code, ereply, domain }
  if job.state == "abandoned" then
    st.stats.abandoned = st.stats.abandoned + 1
    return orphan(st, job)
  end
  job.state = "done"
  job.sema:post(1)
  if job.on_orphan then
    job.delivered_at = monotonic()
    st.unclaimed[job] = true
  end
end

local function runner(premature, st)
  local ngx = rawget(_G, "ngx")
  local me
  local io = sockets({ n = 0 })
  while true do
    local job = pop(st)
    if job then
      local ok, err = pcall(execute, st, job, io)
      if ok and err == "refused" then
        if st.runners > (st.cap or config.max_running) then break end
        -- every VM busy although this worker is at its cap: other code's
        -- calls hold them; look again soon (in a worker that is shutting
        -- down too: its sleeps keep their length, and a runner that left
        -- the job here would leave its caller waiting for its deadline)
        ngx.sleep(0.001)
      elseif not ok then
        ngx.log(ngx.ERR, "mongolock: ", tostring(err))
        if job.state == "running" then
          job.result = { nil, tostring(err) }
          job.state = "done"
          job.sema:post(1)
        end
      end
    else
      if premature or ngx.worker.exiting() then break end
      me = me or semaphore.new(0)
      st.idle[#st.idle + 1] = me
      -- in steps of a second at most: a worker that is shutting down waits
      -- for its running timers, this one included
      local woken
      local idle_until = monotonic() + config.idle
      repeat
        woken = me:wait(math_min(1, math_max(0.001, idle_until - monotonic())))
      until woken or ngx.worker.exiting() or monotonic() >= idle_until
      if not woken then
        -- still listed: nobody chose this runner; it ends
        local listed = false
        for i = #st.idle, 1, -1 do
          if st.idle[i] == me then
            table.remove(st.idle, i)
            listed = true
            break
          end
        end
        if listed and st.first > st.last then break end
      end
    end
  end
  st.runners = st.runners - 1
end

-- the janitor: results nobody took
local function sweep(st, all)
  local now = monotonic()
  for job in pairs(st.unclaimed) do
    if all or now - job.delivered_at > config.grace then
      st.unclaimed[job] = nil
      job.state = "abandoned"
      st.stats.abandoned = st.stats.abandoned + 1
      orphan(st, job)
    end
  end
end

-- is there anything the janitor may still have to do: a result waiting, a
-- job queued or running
local function busy(st)
  return next(st.unclaimed) ~= nil or st.first <= st.last or st.runners > #st.idle
end

-- a worker that is shutting down ends its timer.every timers (their
-- callback runs once more, premature): the janitor goes on in a light
-- thread while it is busy, so that a result is still taken
local function drain(_, st)
  local ngx = rawget(_G, "ngx")
  local tell_at = monotonic() + _M.LINGER   -- then it says once what keeps the worker
  repeat
    ngx.sleep(0.5)
    sweep(st, false)
    if tell_at and monotonic() >= tell_at then
      tell_at = nil
      ngx.log(ngx.WARN, "mongolock: this worker is shutting down and still has jobs after ", _M.LINGER,
        " s: ", st.runners - #st.idle, " running, ", st.last - st.first + 1, " queued")
    end
  until not busy(st)
end

local function janitor(premature, st)
  if not premature then return sweep(st, false) end
  local ngx = rawget(_G, "ngx")
  if ngx.timer.at(0, drain, st) then return sweep(st, false) end
  sweep(st, true)
end

local function start_janitor(st)
  if st.janitor then return end
  local ngx = rawget(_G, "ngx")
  local ok, err = ngx.timer.every(0.5, janitor, st)
  if ok then st.janitor = true
  else ngx.log(ngx.ERR, "mongolock: no janitor timer: ", err) end
end

local function dispatch(st)
  local n = #st.idle
  if n > 0 then
    local sema = st.idle[n]
    st.idle[n] = nil
    sema:post(1)
    return true
  end
  if st.runners < (st.cap or config.max_running) then
    local ngx = rawget(_G, "ngx")
    local ok, err = ngx.timer.at(0, runner, st)
    if ok then
      st.runners = st.runners + 1
    elseif st.runners == 0 then
      return nil, "cannot start a runner: " .. tostring(err)
    end
  end
  return true
end

local FOREVER = 3600

-- reply, err, code, ereply = jobs.run(spec, op [, deadline [, on_orphan, arg]])
-- Runs op in a worker thread; the calling request waits on the event
-- loop.  deadline (core.monotonic() time): the caller stops waiting then and
-- gets nil, "timeout"; the job still runs if it had started, and
-- on_orphan(arg, reply, err, code, ereply) is called with its outcome (in a
-- timer).  on_orphan must not be a closure over the caller's locals: when
-- lua-nginx-module kills a request's coroutine it reuses its stack, and the
-- upvalues of functions still running there read nil afterwards.  Must be
-- called where jobs.active() is true.
function _M.run(spec, op, deadline, on_orphan, arg, pool)
  local ngx = ngx_api()
  if not ngx then error("mongolock.ngx: not inside an nginx worker with ngx.run_worker_thread", 2) end
  local st = get_state()
  start_janitor(st)
  -- a semaphore of a job taken before (woken by its post: its count is 0)
  local free = st.semas
  local sema = free[#free]
  if sema then free[#free] = nil else sema = semaphore.new(0) end
  local job = { spec = spec, op = op, sema = sema, state = "queued", on_orphan = on_orphan, orphan_arg = arg,
                pool = pool }
  push(st, job)
  local ok, err = dispatch(st)
  if not ok then
    job.state = "abandoned"
    return nil, err
  end
  local exiting_since
  while true do
    local wait = FOREVER
    if deadline then wait = math_max(0, math_min(FOREVER, deadline - monotonic())) end
    local woken = sema:wait(wait)
    if woken then
      if #free < 16 then free[#free + 1] = sema end
      break
    end
    if job.state == "done" then break end
    if deadline and monotonic() >= deadline then
      job.state = "abandoned"
      return nil, "timeout"
    end
    -- a worker that is shutting down (its waits keep their length in
    -- lua-nginx-module 0.10.23; this is for a wait that ended without the
    -- job's result, at its deadline within a millisecond): a job not
    -- started by then is given up, one running is waited for up to
    -- `grace` seconds, then handed to on_orphan like an abandoned one
    if ngx.worker.exiting() then
      exiting_since = exiting_since or monotonic()
      if job.state == "queued" or monotonic() - exiting_since > config.grace then
        job.state = "abandoned"
        return nil, "nginx worker exiting"
      end
    end
  end
  if job.state ~= "done" then return nil, "timeout" end   -- the janitor gave it up
  job.state = "taken"
  st.unclaimed[job] = nil
  return unpack(job.result, 1, 5)
end

-- counters of this worker: jobs, abandoned, orphans, errors, max_queued,
-- max_running, vm_refusals, here (ops run through cosockets); and now:
-- runners, idle, queued, cap, outcomes (held for callers, not taken yet)
function _M.stats()
  local st = get_state()
  local t = {}
  for k, v in pairs(st.stats) do t[k] = v end
  t.runners, t.idle, t.queued = st.runners, #st.idle, st.last - st.first + 1
  t.cap, t.outcomes = st.cap or config.max_running, 0
  for _ in pairs(st.unclaimed) do t.outcomes = t.outcomes + 1 end
  return t
end

return _M
