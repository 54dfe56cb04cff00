-- The handle cases, written once and run wherever a client runs: on the plain
-- client (spec/conformance_spec.lua) and inside nginx, where every round
-- trip is a worker thread's job (spec/nginx_spec.lua, /conformance).
--
--   local cases = require "conformance_cases"
--   for _, name in ipairs(cases.names) do cases.run(name, env) end
--
-- env = {
--   client    a client made with appname = env.app (fail points aim at it)
--   observer  another client (another appname): status, force release
--   app       the client's appname
--   sleep     function(seconds): core.sleep, or ngx.sleep inside nginx
--   unique    function(prefix) -> a name no other run uses
-- }
-- A case raises on a failure (the message says what differed) and returns
-- nothing.  Assertions are about what the handle and the server say; a
-- time in them is a bound with a wide margin, never a speed.
local core = require "mongolock.core"
local runners = require "mongolock.runners"

local format = string.format
local unpack = table.unpack or rawget(_G, "unpack")
local function pack(...) return { n = select("#", ...), ... } end

local _M = { names = {} }
local cases = {}

local function case(name, fn)
  _M.names[#_M.names + 1] = name
  cases[name] = fn
end

local function show(t)
  local out = {}
  for i = 1, t.n or #t do out[i] = tostring(t[i]) end
  return "{" .. table.concat(out, ", ") .. "}"
end

-- raises unless fn's results are exactly the expected ones
local E = pack
local function answers(what, expected, ...)
  local got = pack(...)
  -- trailing nils (an absent code) do not count
  while got.n > expected.n and got[got.n] == nil do got.n = got.n - 1 end
  local ok = got.n == expected.n
  for i = 1, expected.n do ok = ok and got[i] == expected[i] end
  if not ok then error(format("%s answered %s, expected %s", what, show(got), show(expected)), 2) end
end

local function check(v, msg, ...)
  if not v then error(format(msg, ...), 2) end
  return v
end

-- polls fn (every 50 ms) until it returns a true value, up to timeout s
local function eventually(env, fn, timeout)
  local deadline = core.monotonic() + timeout
  repeat
    local v = fn()
    if v then return v end
    env.sleep(0.05)
  until core.monotonic() > deadline
  return nil
end

local function locks_of(env, opts)
  local o = { collection = env.unique("conf") }
  for k, v in pairs(opts or {}) do o[k] = v end
  return env.client:locks(o), o.collection
end

local function observed(env, locks)
  return env.observer:locks({ database = locks.database, collection = locks.collection })
end

local function failpoint(env, mode, data)
  return check(env.observer:command("admin", { configureFailPoint = "failCommand" },
    { mode = mode, data = data }), "the fail point could not be set")
end

-- ---- states --------------------------------------------------------------------

case("states", function(env)
  local locks = locks_of(env, { ttl = 5 })
  local h = check(locks:try("s"))
  answers("held()", E(true), h:held())
  answers("check()", E(true), h:check())
  answers("lost()", E(false), h:lost())
  check(h:remaining() > 4 and h:remaining() <= 5, "remaining() %s", tostring(h:remaining()))
  answers("kind", E("named"), h.kind)
  answers("release()", E(true), h:release())
  answers("held() after release", E(false), h:held())
  answers("check() after release", E(nil, "not held"), h:check())
  answers("remaining() after release", E(nil, "not held"), h:remaining())
  answers("lost() after release", E(false), h:lost())
end)

case("release twice", function(env)
  local locks = locks_of(env)
  local h = check(locks:try("twice"))
  answers("release()", E(true), h:release())
  answers("release() again", E(nil, "not held"), h:release())
  answers("extend() after release", E(nil, "not held"), h:extend())
end)

case("after close", function(env)
  local locks = locks_of(env)
  local h = check(locks:try("closed"))
  answers("close()", E(true), h:close())
  answers("release() after close", E(nil, "closed"), h:release())
  answers("extend() after close", E(nil, "closed"), h:extend())
  answers("check() after close", E(nil, "closed"), h:check())
  answers("held() after close", E(false), h:held())
  -- close released it: another takes it at once
  local h2 = check(observed(env, locks):try("closed"), "close did not release the lock")
  h2:release()
end)

case("after a force release", function(env)
  local locks = locks_of(env, { ttl = 10 })
  local h = check(locks:try("forced"))
  answers("force_release()", E(true), observed(env, locks):force_release("forced"))
  answers("extend() after a force release", E(nil, "lost"), h:extend())
  answers("lost()", E(true), h:lost())
  answers("release() after a force release", E(nil, "lost"), h:release())
  answers("check()", E(nil, "lost"), h:check())
end)

-- ---- renewal -----------------------------------------------------------------------

-- a failed renewal is tried again every ttl/10: with ttl 6 (renewals every
-- 2 s) the first two failing leave the lease held, where renewals retried
-- every ttl/3 would let its local deadline pass
case("renewal across transient failures", function(env)
  local locks = locks_of(env, { ttl = 6 })
  local h = check(locks:acquire("flaky", { renew = true, timeout = 1 }))
  local before = failpoint(env, { times = 2 }, { failCommands = { "update" }, errorCode = 2,
    appName = env.app }).count
  local ok, err = pcall(function()
    -- two renewals fail (from about 2 s on), the third renews; 7.5 s is
    -- past the lease's first end (6 s) with a margin
    env.sleep(7.5)
    answers("held() after two failed renewals", E(true), h:held())
    local st = check(observed(env, locks):status("flaky"))
    check(st.held and st.owner == h.owner, "the server's lock is %s, not the handle's",
      tostring(st.owner))
    check(st.remaining > 1, "the server's lease has %s s left", tostring(st.remaining))
  end)
  local fired = failpoint(env, "off").count - before
  if not ok then error(err, 0) end
  check(fired == 2, "the fail point failed %d updates, not the two renewals", fired)
  answers("release()", E(true), h:release())
end)

case("a renewal that matches nothing", function(env)
  local locks = locks_of(env, { ttl = 1.5 })
  local h = check(locks:acquire("gone", { renew = true, timeout = 1 }))
  answers("force_release()", E(true), observed(env, locks):force_release("gone"))
  -- the next renewal (ttl/3 later) finds it gone
  check(eventually(env, function() return h:lost() end, 5), "the handle was not marked lost")
  answers("check()", E(nil, "lost"), h:check())
  answers("release()", E(nil, "lost"), h:release())
end)

case("on_lost fires once for a lease taken by force", function(env)
  local locks = locks_of(env, { ttl = 1.5 })
  local seen = {}
  env.client:on_lost(function(ev) seen[#seen + 1] = ev end)
  local ok, err = pcall(function()
    local lost0 = env.client:stats().lost
    local h = check(locks:acquire("forced", { renew = true, timeout = 1 }))
    answers("force_release()", E(true), observed(env, locks):force_release("forced"))
    -- outside nginx the library delivers at a call into it (poll);
    -- inside nginx the lease engine's timer delivers by itself
    local inside = runners.ngx_core(env.client) ~= nil
    check(eventually(env, function()
      if not inside then env.client:poll() end
      return #seen > 0
    end, 5), "on_lost was not called")
    answers("release()", E(nil, "lost"), h:release())
    env.sleep(0.6)
    if not inside then env.client:poll() end
    check(#seen == 1, "on_lost was called %d times", #seen)
    local ev = seen[1]
    check(ev.reason == "lost" and ev.kind == "named" and ev.name == "forced" and ev.token == h.token
      and ev.owner == h.owner and ev.collection == locks.collection,
      "the event is {%s, %s, %s, %s}", tostring(ev.reason), tostring(ev.kind), tostring(ev.name),
      tostring(ev.token))
    local lost = env.client:stats().lost - lost0
    check(lost == 1, "stats().lost moved by %d", lost)
  end)
  env.client:on_lost(nil)
  if not ok then error(err, 0) end
end)

-- ---- release without the holder ---------------------------------------------------

case("GC release", function(env)
  local locks = locks_of(env, { ttl = 30 })
  local name = "collected"
  do
    local h = check(locks:try(name))
    check(h:held(), "not held")
  end
  collectgarbage()
  collectgarbage()
  -- released from the background (the lease, 30 s, would free it later)
  local ol = observed(env, locks)
  check(eventually(env, function()
    local st = ol:status(name)
    return st and not st.held
  end, 10), "the collected handle's lock is still held")
end)

-- an attempt whose reply and retry are both lost (the write was applied):
-- its lock is released in the background, never left held by nobody
case("lost reply", function(env)
  local locks = locks_of(env, { ttl = 30 })
  check(locks:try("warm")):release()
  local ofp = { configureFailPoint = "onPrimaryTransactionalWrite" }
  local before = check(env.observer:command("admin", ofp, { mode = { times = 1 } })).count
  failpoint(env, { skip = 1 }, { failCommands = { "findAndModify" }, closeConnection = true, appName = env.app })
  local r = pack(pcall(locks.try, locks, "dropped"))
  local after = env.observer:command("admin", ofp, { mode = "off" })
  failpoint(env, "off")
  check(r[1], "try raised: %s", tostring(r[2]))
  check(after and after.count - before == 1, "the fail point fired %s times, not once",
    tostring(after and after.count - before))
  check(r[2] == nil and type(r[3]) == "string", "try answered %s", show({ unpack(r, 2, r.n) }))
  local ol = observed(env, locks)
  check(eventually(env, function()
    local st = ol:status("dropped")
    return st and not st.held
  end, 10), "the lock taken without its reply is still held")
end)

-- ---- grant top-up ----------------------------------------------------------------

-- a release that grants the lock to a queued waiter bounds its lease by the
-- waiter's place (queue_ttl 1 s here); the handle made from the grant is
-- topped up to its ttl (10 s) before that short lease ends
case("grant top-up", function(env)
  local locks = locks_of(env, { ttl = 10 })
  local ol = observed(env, locks)
  local held = check(ol:try("granted"))
  local c = runners.core_of(locks)
  local waiter = check(core.waiter_id())
  local started = core.monotonic()
  -- the waiter's attempt queues it (watching, so the release grants it)
  local h0, e0 = c:acquire(locks.database, locks.collection, "granted", 10000, nil, false, waiter, 1000, false)
  answers("the waiter's attempt", E(nil, "busy"), h0, e0)
  answers("the holder's release", E(true), held:release())
  local st = check(ol:status("granted"))
  check(st.held and st.owner == waiter, "the release did not grant the lock to the waiter (%s)",
    tostring(st.owner))
  local h = check(c:granted(locks.database, locks.collection, "granted", waiter, 10000, 1000, st.token,
    started))
  check(h:remaining() <= 1, "the grant's lease is %s s, not its place's 1 s", tostring(h:remaining()))
  env.sleep(2)
  answers("held() after the place's end", E(true), h:held())
  check(h:remaining() > 5, "not topped up: %s s left", tostring(h:remaining()))
  local st2 = check(ol:status("granted"))
  check(st2.held and st2.owner == waiter and st2.remaining > 5, "the server's lease was not topped up (%s s)",
    tostring(st2.remaining))
  -- never past the server's view
  check(h:remaining() <= st2.remaining + 0.5, "the handle's lease %s is past the server's %s",
    tostring(h:remaining()), tostring(st2.remaining))
  answers("release()", E(true), h:release())
end)

-- runs the case name with env; raises on a failure
function _M.run(name, env)
  local fn = cases[name]
  if not fn then error("no conformance case '" .. tostring(name) .. "'", 2) end
  return fn(env)
end

return _M
