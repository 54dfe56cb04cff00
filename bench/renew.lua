-- bench/renew.lua [seconds] [N:ttl ...]: renewal of many leases held by one
-- client.  For each case one client acquires N named locks in one
-- collection with renew = true and ttl seconds, holds them for `seconds`
-- (12 by default) while the lease engine renews them, then counts the
-- leases still held (h:check() and the server's status of a sample) and
-- releases them.  Prints a Markdown table: leases held, ttl, renewal
-- commands per second (the server's update count over the hold, read from
-- another client), leases lost while their holder was alive, and the
-- client's CPU (os.clock, every thread of the process) per lease-second.
--
--   lua5.4 bench/renew.lua 12 6000:3 100000:30
local mongolock = require "mongolock"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local seconds = tonumber(arg[1]) or 12
local cases = {}
for i = 2, #arg do
  local n, ttl = arg[i]:match("^(%d+):([%d.]+)$")
  cases[#cases + 1] = { n = tonumber(n), ttl = tonumber(ttl) }
end
if #cases == 0 then cases = { { n = 6000, ttl = 3 }, { n = 100000, ttl = 30 } } end

local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI")
-- the stand-in (one thread) may spend seconds on a batch of 100,000
-- renewals: the observer's serverStatus waits for it, up to a minute
local observer = assert(mongolock.connect(uri, { appname = "bench-renew-observer", server_timeout = 60 }))

local function updates()
  local oc = assert(testing.opcounters(observer._core))
  return oc.update or 0
end

print("| leases held | ttl (s) | renewal commands / s | leases lost | client CPU per lease-second |")
print("|---:|---:|---:|---:|---:|")
for _, case in ipairs(cases) do
  local client = assert(mongolock.connect(uri, { appname = "bench-renew" }))
  local coll = "bench_renew_" .. case.n .. "_" .. core.random_owner():sub(1, 8)
  local locks = client:locks({ collection = coll, ttl = case.ttl })
  local hs = {}
  io.stderr:write(string.format("bench: renew: acquiring %d leases (ttl %g s)\n", case.n, case.ttl))
  -- a wait, not a single try: while the stand-in (one thread) renews a
  -- batch of tens of thousands of leases, a try would meet its
  -- attempt_timeout (1 s) before the reply
  for i = 1, case.n do hs[i] = assert(locks:acquire("l" .. i, { renew = true, timeout = 30 })) end
  local u0, cpu0, t0 = updates(), os.clock(), core.monotonic()
  core.sleep(seconds)
  local u1, cpu1, t1 = updates(), os.clock(), core.monotonic()
  local lost = 0
  for i = 1, case.n do
    if not hs[i]:check() then lost = lost + 1 end
  end
  -- the server's view of a sample: held, by this client's acquisition
  local ol = observer:locks({ collection = coll })
  for _, i in ipairs({ 1, case.n // 2, case.n }) do
    local st = ol:status("l" .. i)
    if not (st and st.held and st.owner == hs[i].owner) and hs[i]:check() then lost = lost + 1 end
  end
  print(string.format("| %d | %g | %.2f | %d | %.2f us |", case.n, case.ttl,
    (u1 - u0) / (t1 - t0), lost, (cpu1 - cpu0) * 1e6 / (case.n * (t1 - t0))))
  io.stdout:flush()
  io.stderr:write("bench: renew: releasing\n")
  hs = nil -- luacheck: ignore
  client:close()
  collectgarbage()
  observer:command(locks.database, { drop = coll })
end
