-- A service of bench/skynet/services.lua: a mongolock client of its own
-- (scheduler = "skynet", THREADS worker threads); "touch" takes and
-- releases a lock (so that its pool, renewal and change stream run) and
-- answers the seconds it took.
local skynet = require "skynet"
local mongolock = require "mongolock"
local core = require "mongolock.core"

local client, locks
skynet.start(function()
  client = assert(mongolock.connect(os.getenv("MONGODB_URI"),
    { scheduler = "skynet", threads = tonumber(os.getenv("THREADS")) or 8 }))
  locks = client:locks({ collection = "bench_services" })
  skynet.dispatch("lua", function()
    local t0 = core.monotonic()
    local h = assert(locks:acquire("s" .. skynet.self(), { timeout = 10 }))
    assert(h:release())
    skynet.retpack(core.monotonic() - t0)
  end)
end)
