-- mongolock.ngx.handle: the handles of mongolock.locks (locks:try,
-- locks:acquire, locks:with) inside nginx, where a request can yield: every
-- round trip one job of mongolock.ngx (a worker thread), the lease plain
-- data on the event loop (mongolock.ngx.locks).  They answer as the C
-- handles do (csrc/lock.c): the same methods, fields and states.
--
-- States: "held"; "lost" (a release or extend found the lease gone, or the
-- local deadline passed: sticky); "not held" (released); "closed" (closed,
-- or its client closed).  Every method answers from the state:
--   h:release() -> true | nil, state | nil, message, code (still held)
--   h:extend([ttl]) -> true | nil, state | nil, message, code
--   h:remaining() -> seconds > 0 | nil, state
--   h:held(), h:lost() -> boolean;  h:check() -> true | nil, state
--   h:token_string(), h:close(), <close>, __gc (released from a timer)
-- Fields: name, id, token, owner, ttl, database, collection, renew, kind.
--
-- locks:status, locks:list and locks:force_release go through the same
-- jobs (one each).
--
-- The handles of document locks (mongolock.ngx.documents) are the same,
-- with lease.kind = "document" and lease.impl = {release(lease, changes),
-- extend(lease, ttl), release_op(lease)}: h:release(changes) writes the
-- caller's changes in the releasing command, as csrc/lock.c does.
--
-- renew: while held, a timer extends the lease every third of its ttl (an
-- extend that finds it gone makes it lost).

local core = require "mongolock.core"
local transport = require "mongolock.ngx"
local nlocks = require "mongolock.ngx.locks"

local type, error, tostring, setmetatable, getmetatable = type, error, tostring, setmetatable, getmetatable
local rawget = rawget
local monotonic = core.monotonic
local string_format = string.format

local _M = { _VERSION = "0.1.0" }

local methods = {}
local mt = { __name = "mongolock.Lock" }

local FIELDS = { name = true, id = true, token = true, owner = true, ttl = true, database = true,
                 collection = true, renew = true, kind = true }

mt.__index = function(h, k)
  local m = methods[k]
  if m then return m end
  if not FIELDS[k] then return nil end
  local lease = rawget(h, "_lease")
  if k == "name" or k == "id" then return lease.name end
  if k == "database" then return lease.ctx.db end
  if k == "collection" then return lease.ctx.coll end
  if k == "renew" then return rawget(h, "_renew") end
  if k == "kind" then return lease.kind or "named" end
  if k == "token" then return lease.token or 0 end
  return lease[k]
end

-- the handle's state; a held lease past its local deadline is lost for good
local function state(h)
  local lease = rawget(h, "_lease")
  if lease.closed or rawget(h, "_locks").core:closed() then return "closed" end
  if lease.state == "held" and monotonic() >= lease.deadline then lease.state = "lost" end
  return lease.state
end

-- how a lease is released and extended: named locks' (mongolock.ngx.locks)
-- unless the lease brings its own (lease.impl)
local named = {
  release = function(lease) return nlocks.release(lease) end,
  extend = function(lease, ttl) return nlocks.extend(lease, ttl) end,
  release_op = function(lease)
    return core.op_release{ db = lease.ctx.db, coll = lease.ctx.coll, name = lease.name, owner = lease.owner }
  end,
}
local function impl(lease) return lease.impl or named end

local function check_self(h, fname)
  if getmetatable(h) ~= mt then
    error("bad argument #1 to '" .. fname .. "' (mongolock.Lock expected, got " .. type(h) .. ")", 3)
  end
end

function methods.release(h, changes)
  check_self(h, "release")
  local lease = rawget(h, "_lease")
  if changes ~= nil then
    if lease.kind ~= "document" then
      error("bad argument #1 to 'release' (a named lock's release takes no changes)", 2)
    end
    if type(changes) ~= "table" then
      error("bad argument #1 to 'release' (table expected, got " .. type(changes) .. ")", 2)
    end
  end
  local st = state(h)
  if st ~= "held" then return nil, st end
  local ok, err, code = impl(lease).release(lease, changes)
  if ok then
    lease.state = "not held"
    return true
  end
  if err == "not held" then
    lease.state = "lost"
    return nil, "lost"
  end
  return nil, err, code
end

function methods.extend(h, ttl)
  check_self(h, "extend")
  if ttl ~= nil and (type(ttl) ~= "number" or ttl ~= ttl or ttl <= 0 or ttl > 365 * 86400) then
    if type(ttl) ~= "number" then
      error("bad argument #1 to 'extend' (number expected, got " .. type(ttl) .. ")", 2)
    end
    error("bad argument #1 to 'extend' (ttl must be a positive, finite number of seconds, at most a year)", 2)
  end
  local st = state(h)
  if st ~= "held" then return nil, st end
  local lease = rawget(h, "_lease")
  local ok, err, code = impl(lease).extend(lease, ttl or lease.ttl)
  if ok then return true end
  if err == "lost" then
    lease.state = "lost"
    return nil, "lost"
  end
  return nil, err, code
end

function methods.remaining(h)
  check_self(h, "remaining")
  local st = state(h)
  if st ~= "held" then return nil, st end
  local left = rawget(h, "_lease").deadline - monotonic()
  return left > 0 and left or 0
end

function methods.held(h)
  check_self(h, "held")
  return state(h) == "held"
end

function methods.check(h)
  check_self(h, "check")
  local st = state(h)
  if st ~= "held" then return nil, st end
  return true
end

function methods.lost(h)
  check_self(h, "lost")
  state(h)
  return rawget(h, "_lease").state == "lost"
end

function methods.token_string(h)
  check_self(h, "token_string")
  return string_format("%.0f", rawget(h, "_lease").token or 0)
end

-- releases if held; afterwards every method answers nil, "closed"
function methods.close(h)
  check_self(h, "close")
  local lease = rawget(h, "_lease")
  if state(h) == "held" then pcall(methods.release, h) end
  lease.closed = true
  return true
end

mt.__close = function(h) methods.close(h) end

mt.__tostring = function(h)
  local st = state(h)
  if st == "closed" then return "mongolock.Lock (closed)" end
  return "mongolock.Lock (" .. tostring(rawget(h, "_lease").name) .. ", " .. st .. ")"
end

-- a handle collected while held is released from a timer (nothing may
-- yield in __gc); LuaJIT's tables have no __gc: a proxy carries it
local newproxy = rawget(_G, "newproxy")
local function on_collect(h, lease)
  local function release()
    if lease.state == "held" and not lease.closed then
      lease.state = "not held"
      transport.release_later(lease.ctx.spec, impl(lease).release_op(lease))
    end
  end
  if newproxy then
    local p = newproxy(true)
    getmetatable(p).__gc = release
    rawset(h, "_gc", p)
  else
    rawset(h, "_gc", setmetatable({}, { __gc = release }))
  end
end

-- background renewal: a timer extends every ttl / 3 while the lease is held
local function start_renewal(lease)
  local ngx = rawget(_G, "ngx")
  local function tick(premature)
    if premature or lease.closed or lease.state ~= "held" then return end
    if monotonic() >= lease.deadline then
      lease.state = "lost"
      return
    end
    local ok, err = impl(lease).extend(lease, lease.ttl)
    if not ok and err == "lost" then
      lease.state = "lost"
      return
    end
    local okt = ngx.timer.at(lease.ttl / 3, tick)
    if not okt then return end
  end
  ngx.timer.at(lease.ttl / 3, tick)
end

-- h = handle.new(owner, lease, renew): the handle of a lease won by owner
-- (a locks or documents object: owner.core is its client's core)
local function handle(locks, lease, renew)
  lease.state = "held"
  local h = setmetatable({ _lease = lease, _locks = locks, _renew = renew and true or false }, mt)
  on_collect(h, lease)
  transport.track(lease)
  if renew then start_renewal(lease) end
  return h
end

_M.new = handle

-- the mongolock.ngx.locks context of a locks object
local function context(locks)
  local ctx = rawget(locks, "_ngx")
  if ctx then return ctx end
  local client = locks.client
  ctx = nlocks.context(transport.spec(client.uri, client.connect_opts), locks.database, locks.collection,
    locks.app, locks.expire_after)
  rawset(locks, "_ngx", ctx)
  return ctx
end

-- true where mongolock.locks' calls go through here
function _M.active(locks)
  return transport.active() and locks.client ~= nil and locks.client.connect_opts ~= nil
end

-- locks:try: h | nil, "busy", info | nil, err, code
function _M.try(locks, name, ttl_ms, o)
  if locks.core:closed() then return nil, "closed" end
  local lease, err, info = nlocks.acquire(context(locks), name, { ttl = ttl_ms / 1000, timeout = 0 })
  if not lease then return nil, err, info end
  return handle(locks, lease, o.renew)
end

-- locks:acquire's wait: h | nil, "timeout", info | nil, err, code
function _M.acquire(locks, name, ttl_ms, o)
  if locks.core:closed() then return nil, "closed" end
  local wait = o.wait
  local lease, err, info = nlocks.acquire(context(locks), name, {
    ttl = ttl_ms / 1000, timeout = o.timeout, step = o.step, ratio = o.ratio, max_step = o.max_step,
    queue_ttl = o.queue_ttl, wake = wait ~= "poll" and nlocks.wake or nil, watch_only = wait == "watch" })
  if not lease then
    if err == "busy" then err = "timeout" end
    return nil, err, info
  end
  return handle(locks, lease, o.renew)
end

-- locks:status(name) -> status | nil (never acquired) | nil, err, code
function _M.status(locks, name)
  if locks.core:closed() then return nil, "closed" end
  local ctx = context(locks)
  local reply, err, code = nlocks.run(ctx.spec, core.op_status{ db = ctx.db, coll = ctx.coll, name = name })
  if not reply then return nil, err, code end
  return core.parse_status(reply)[1]
end

-- locks:list() -> { status, ... } | nil, err, code
function _M.list(locks)
  if locks.core:closed() then return nil, "closed" end
  local ctx = context(locks)
  local reply, err, code = nlocks.run(ctx.spec, core.op_status{ db = ctx.db, coll = ctx.coll })
  if not reply then return nil, err, code end
  return core.parse_status(reply)
end

-- locks:force_release(name) -> true | nil, "not held" | nil, err, code
function _M.force_release(locks, name)
  if locks.core:closed() then return nil, "closed" end
  local ctx = context(locks)
  local reply, err, code = nlocks.run(ctx.spec, core.op_force_release{ db = ctx.db, coll = ctx.coll, name = name })
  if not reply then return nil, err, code end
  if core.parse_update(reply) == 1 then return true end
  return nil, "not held"
end

return _M
