-- bench/fork.lua [N]: fork() from a busy process (README, Limitations:
-- Fork).  One process holds 8 clients whose threads are busy (leases of
-- ttl 0.3 s renewed every 100 ms, monitors checking every 500 ms, change
-- streams fed by a second process that takes and releases names in the
-- same collections) and forks N times (1000 by default); each child
-- acquires a name through a change-stream wait and releases it, with the
-- clients it inherited.  Counts the children that did so, those whose
-- driver call raised because libmongoc's process-wide lock was held at
-- the fork (client.c, driver_lock_free), and those that did neither
-- within 15 s (gdb prints their threads, when installed).  Not part of
-- make bench: it measures how often a limitation of libmongoc shows.
--
--   lua5.4 bench/fork.lua 1000        (MONGODB_URI set; LUA_CPATH with
--                                      the build's mongolock.testing)
local mongolock = require "mongolock"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local N = tonumber(arg[1]) or 1000
local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI")
local sep = uri:find("?", 1, true) and "&" or "?"
local pid0 = core.getpid()

local clients, locks, held = {}, {}, {}
for i = 1, 8 do
  clients[i] = assert(mongolock.connect(uri .. sep .. "heartbeatFrequencyMS=500", { appname = "bench-fork" }))
  locks[i] = clients[i]:locks({ database = "mongolock_bench", collection = "fork" .. (i % 2), ttl = 0.3 })
  held[i] = assert(locks[i]:acquire(("held-%d-%d"):format(i, pid0)))
end

-- the second process: takes and releases a name in both collections
local churn = io.popen(([[%s -e '
  local m = require "mongolock"
  local c = assert(m.connect(%q))
  local a = c:locks({ database = "mongolock_bench", collection = "fork0" })
  local b = c:locks({ database = "mongolock_bench", collection = "fork1" })
  while true do
    local h = a:try("churn") if h then h:release() end
    h = b:try("churn") if h then h:release() end
  end' >/dev/null 2>&1 & echo $!]]):format(arg[-1] or "lua5.4", uri))
local churn_pid = churn:read("l")
churn:close()

local function gone(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return true end
  local s = f:read("a")
  f:close()
  return s:match("^%d+ %b() Z") ~= nil
end

local done, refused, hung, other = 0, 0, 0, 0
local t0 = core.monotonic()
for n = 1, N do
  local i = n % 8 + 1
  -- this process's own change stream: a short wait on a held name
  local j = (n + 1) % 8 + 1
  locks[j]:acquire(("held-%d-%d"):format(j, pid0), { timeout = 0.01, wait = "watch" })
  local pid = assert(testing.fork())
  if pid == 0 then
    local code = 1
    local ok, err = pcall(function()
      local h = locks[i]:acquire("child" .. n, { timeout = 5, wait = "watch" })
      code = h and h:release() and 0 or 2
    end)
    if not ok then code = tostring(err):find("forked", 1, true) and 3 or 4 end
    testing.exit(code)
  end
  local started = core.monotonic()
  while not gone(pid) and core.monotonic() - started < 15 do core.sleep(0.005) end
  if not gone(pid) then io.stderr:write(("bench: child %d (fork %d) hung\n"):format(pid, n)) end
  -- a child still there is stuck: waitpid prints its threads, then kills it
  local st = testing.waitpid(pid, gone(pid) and 5 or 0)
  if st == 0 then done = done + 1
  elseif st == 3 then refused = refused + 1
  elseif st == nil then hung = hung + 1
  else other = other + 1 end
  if n % 100 == 0 then
    io.stderr:write(("bench: %d forks: %d done, %d refused, %d hung, %d other\n"):format(n, done, refused,
      hung, other))
  end
end
os.execute("kill " .. churn_pid)
for i = 1, 8 do
  held[i]:release()
  clients[i]:close()
end
print(("| forks | done | refused (lock held at fork) | hung | other | seconds |"))
print("|---:|---:|---:|---:|---:|---:|")
print(("| %d | %d | %d | %d | %d | %.0f |"):format(N, done, refused, hung, other, core.monotonic() - t0))
