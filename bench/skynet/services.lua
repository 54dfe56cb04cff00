-- bench/skynet/services.lua: what one mongolock client per skynet service
-- costs.  Starts SERVICES services (bench/skynet/client.lua), each with a
-- client that has taken and released a lock, then prints the process's
-- threads, its resident memory and the TCP connections open to the
-- server's port as one "services N threads T rss_mb M connections C
-- touch_ms X" line, and ends the process.  Run by bench/skynet/run.
local skynet = require "skynet"
require "skynet.manager"

local N = tonumber(os.getenv("SERVICES")) or 10
local port = tonumber(os.getenv("MONGODB_URI"):match(":(%d+)/")) or 27017

local function status(field)
  for line in io.lines("/proc/self/status") do
    local v = line:match("^" .. field .. ":%s*(%d+)")
    if v then return tonumber(v) end
  end
end

-- established connections to the server's port (this network namespace)
local function connections()
  local n = 0
  for _, f in ipairs({ "/proc/self/net/tcp", "/proc/self/net/tcp6" }) do
    local fh = io.open(f)
    if fh then
      for line in fh:lines() do
        local rport, st = line:match("^%s*%d+: %x+:%x+ %x+:(%x+) (%x+)")
        if rport and tonumber(rport, 16) == port and st == "01" then n = n + 1 end
      end
      fh:close()
    end
  end
  return n
end

skynet.start(function()
  local base_threads, base_rss, base_conn = status("Threads"), status("VmRSS"), connections()
  local addrs, worst = {}, 0
  for i = 1, N do addrs[i] = skynet.newservice("client") end
  for i = 1, N do worst = math.max(worst, skynet.call(addrs[i], "lua", "touch")) end
  skynet.sleep(100)                        -- the change streams' first getMore
  print(string.format("services %d threads %d rss_mb %.1f connections %d touch_ms %.0f "
    .. "base_threads %d base_rss_mb %.1f base_connections %d", N, status("Threads"), status("VmRSS") / 1024,
    connections(), worst * 1000, base_threads, base_rss / 1024, base_conn))
  skynet.abort()
end)
