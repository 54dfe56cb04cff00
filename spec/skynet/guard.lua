-- A skynet service of spec/skynet_spec.lua with a mongolock client of its
-- own (scheduler = "skynet"):
--   "run", coll, players, n, each  n coroutines (skynet.fork), each guarding
--       `each` increments of the players' documents (document locks) while a
--       10 ms ticker coroutine of this service measures its worst gap
--       -> done, failures ("; "-joined), the ticker's worst gap (s)
--   "waiter", coll, name  acquires name, polling every 2 s at most (so only a
--       wake-up by the release is fast) -> the monotonic time it got it, err
--   "hold", coll, name, ttl, exit  acquires name and keeps it; with exit,
--       ends the service (skynet.exit) right after answering
--   "slow_prepare", coll, app  a client of appname app (the caller then
--       delays that app's commands 300 ms); "slow_run" -> for each call
--       (acquire, try, extend, release, close, __gc, <close>, client:close)
--       "name seconds worst_gap" lines: how long the call took, and the
--       worst gap of a 10 ms ticker coroutine of this service meanwhile
local skynet = require "skynet"
local mongolock = require "mongolock"
local core = require "mongolock.core"

local URI, DB = os.getenv("MONGODB_URI"), os.getenv("MLSPEC_DB")
local client
local kept = {}

local cmd = {}

function cmd.run(coll, players, n, each)
  local docs = client:documents(DB, coll, { ttl = 10 })
  local me = coroutine.running()
  local done, failures, worst = 0, {}, 0
  local last = core.monotonic()
  skynet.fork(function()
    repeat
      skynet.sleep(1)
      local now = core.monotonic()
      if now - last > worst then worst = now - last end
      last = now
    until done >= n
  end)
  for i = 1, n do
    skynet.fork(function()
      for k = 1, each do
        local id = players[(i + k) % #players + 1]
        local doc, h = docs:lock(id, { timeout = 60 })
        if not doc then
          failures[#failures + 1] = tostring(h)
        else
          mongolock.sleep(0.001)        -- holding it, the coroutine yields
          local ok, err = h:release({ count = doc.count + 1 })
          if not ok then failures[#failures + 1] = tostring(err) end
        end
      end
      done = done + 1
      if done == n then skynet.wakeup(me) end
    end)
  end
  skynet.wait(me)
  skynet.retpack(done, table.concat(failures, "; "), worst)
end

function cmd.waiter(coll, name)
  local locks = client:locks({ database = DB, collection = coll })
  local h, err = locks:acquire(name, { timeout = 10, step = 2, max_step = 2 })
  local t = core.monotonic()
  if h then h:release() end
  skynet.retpack(h and t, err and tostring(err))
end

function cmd.hold(coll, name, ttl, exit)
  local locks = client:locks({ database = DB, collection = coll })
  local h, err = locks:acquire(name, { ttl = ttl, timeout = 5 })
  kept[#kept + 1] = h
  skynet.retpack(h and h:token_string(), err and tostring(err))
  if exit then skynet.exit() end
end

local slow
function cmd.slow_prepare(coll, app)
  local c = assert(mongolock.connect(URI, { scheduler = "skynet", appname = app }))
  local locks = c:locks({ database = DB, collection = coll })
  assert(locks:try("warm")):release()   -- the pool and the TTL index, before the delay
  slow = { client = c, locks = locks }
  skynet.retpack(true)
end

function cmd.slow_run()
  local locks, c = slow.locks, slow.client
  local worst, last, finished = 0, core.monotonic(), false
  skynet.fork(function()
    repeat
      skynet.sleep(1)
      local now = core.monotonic()
      if now - last > worst then worst = now - last end
      last = now
    until finished
  end)
  local lines = {}
  local function step(name, fn)
    worst, last = 0, core.monotonic()
    local t0 = core.monotonic()
    local ok, err = pcall(fn)
    worst = math.max(worst, core.monotonic() - last)  -- a ticker that never ran meanwhile
    lines[#lines + 1] = string.format("%s %.3f %.3f%s", name, core.monotonic() - t0, worst,
      ok and "" or (" " .. tostring(err)))
  end
  local h1, h2
  step("acquire", function() h1 = assert(locks:acquire("s1", { ttl = 10 })) end)
  step("try", function() h2 = assert(locks:try("s2")) end)
  step("extend", function() assert(h1:extend(10)) end)
  step("release", function() assert(h1:release()) end)
  step("close", function() assert(h2:close()) end)
  local kept3 = setmetatable({ assert(locks:try("s3")) }, { __mode = "v" })
  step("__gc", function()
    collectgarbage()
    collectgarbage()
    assert(kept3[1] == nil, "not collected")
  end)
  local t
  do
    local h4 <close> = assert(locks:try("s4"))
    worst, last, t = 0, core.monotonic(), core.monotonic()
    local _ = h4
  end
  worst = math.max(worst, core.monotonic() - last)
  lines[#lines + 1] = string.format("<close> %.3f %.3f", core.monotonic() - t, worst)
  step("client:close", function() c:close() end)
  finished = true
  skynet.sleep(2)
  skynet.retpack(table.concat(lines, "\n"))
end

skynet.start(function()
  client = assert(mongolock.connect(URI, { scheduler = "skynet" }))
  skynet.dispatch("lua", function(_, _, name, ...)
    cmd[name](...)
  end)
end)
