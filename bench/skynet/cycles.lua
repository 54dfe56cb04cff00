-- bench/skynet/cycles.lua: bench/coroutine_rows.lua's rows for the
-- coroutines of one skynet service (skynet.fork), printed as "row ..."
-- lines; then the process ends.  Run by `bench/skynet/run cycles`
-- (SECONDS, COUNTS).
local skynet = require "skynet"
require "skynet.manager"
local rows = require "coroutine_rows"

local uri = os.getenv("MONGODB_URI")
local seconds = tonumber(os.getenv("SECONDS_")) or 3
local counts = {}
for n in (os.getenv("COUNTS") or "1,100"):gmatch("%d+") do counts[#counts + 1] = tonumber(n) end

local pending, waiter = 0, nil
local L = { name = "skynet", scheduler = "skynet" }
function L.spawn(fn)
  pending = pending + 1
  skynet.fork(function()
    local ok, err = pcall(fn)
    if not ok then print("row error " .. tostring(err)) end
    pending = pending - 1
    if pending == 0 and waiter then
      local w = waiter
      waiter = nil
      skynet.wakeup(w)
    end
  end)
end
function L.sleep(s)
  if s > 0 then skynet.sleep(math.ceil(s * 100)) else skynet.yield() end
end
function L.run()
  if pending > 0 then
    waiter = coroutine.running()
    skynet.wait(waiter)
  end
end

skynet.start(function()
  local ok, err = pcall(function()
    for _, line in ipairs(rows.rows(L, uri, seconds, counts)) do print("row " .. line) end
  end)
  if not ok then print("row error " .. tostring(err)) end
  skynet.abort()
end)
