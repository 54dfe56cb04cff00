-- The start service of spec/skynet_spec.lua's skynet process (config
-- written by the spec): its scenario against MONGODB_URI, its findings one
-- "RESULT key value" line each on stdout, then the process's end
-- (skynet.abort).  Environment: MONGODB_URI, MLSPEC_DB, MLSPEC_PREFIX
-- (unique names), MLSPEC_ROUNDS (the guarded-increments round's tries).
local skynet = require "skynet"
require "skynet.manager"             -- skynet.kill, skynet.abort
local mongolock = require "mongolock"
local core = require "mongolock.core"
local S = require "mongolock.sched.skynet"   -- what "skynet" names

local URI, DB, PREFIX = os.getenv("MONGODB_URI"), os.getenv("MLSPEC_DB"), os.getenv("MLSPEC_PREFIX")
local ROUNDS = tonumber(os.getenv("MLSPEC_ROUNDS")) or 5
local SERVICES, PER, EACH, TTL = 2, 25, 5, 2

io.stdout:setvbuf("line")
local function result(key, ...)
  local t = { "RESULT", key }
  for i = 1, select("#", ...) do t[#t + 1] = (tostring((select(i, ...))):gsub("\n", " | ")) end
  io.stdout:write(table.concat(t, " "), "\n")
end

local coll = PREFIX .. "-players"
local lcoll = PREFIX .. "-locks"

-- ---- in the service's main coroutine (this chunk): not the scheduler's,
-- the client blocks as outside any scheduler; the same errors
local client, locks, closed_locks, outside

-- what bad use answers: a wrong argument, a closed client's try and acquire
local function bad_use()
  local _, badarg = pcall(locks.acquire, locks, 42)
  local t1, t2 = closed_locks:try(PREFIX .. "-closed")
  local a1, a2 = closed_locks:acquire(PREFIX .. "-closed", { timeout = 1 })
  return { badarg = tostring(badarg), try = tostring(t1) .. "," .. tostring(t2),
           acquire = tostring(a1) .. "," .. tostring(a2) }
end

local chunk_ok, chunk_err = xpcall(function()
  client = assert(mongolock.connect(URI, { scheduler = "skynet" }))
  locks = client:locks({ database = DB, collection = lcoll })
  local closed = assert(mongolock.connect(URI, { scheduler = "skynet" }))
  closed_locks = closed:locks({ database = DB, collection = lcoll })
  closed:close()
  outside = bad_use()
  result("main_current", S.current())
  local h, err = locks:try(PREFIX .. "-main")
  result("main_try", h and "handle" or err)
  if h then result("main_release", h:release()) end
end, debug.traceback)

local function call_all(addrs, ...)
  local me, pending, replies = coroutine.running(), #addrs, {}
  local args = table.pack(...)
  for i, a in ipairs(addrs) do
    skynet.fork(function()
      replies[i] = table.pack(skynet.call(a, "lua", table.unpack(args, 1, args.n)))
      pending = pending - 1
      if pending == 0 then skynet.wakeup(me) end
    end)
  end
  skynet.wait(me)
  return replies
end

local function count_of(id)
  local r = assert(client:command(DB, { find = coll }, { filter = { _id = id } }))
  return r.cursor.firstBatch[1].count
end

local function scenario()
  result("current", S.current())
  local inside = bad_use()
  for _, k in ipairs({ "badarg", "try", "acquire" }) do
    result("badarg_" .. k, outside[k] == inside[k], inside[k])
  end

  -- 50 coroutines in 2 services guard increments of 3 player documents
  local ticker = skynet.newservice("ticker")
  local guards = {}
  for i = 1, SERVICES do guards[i] = skynet.newservice("guard") end
  for r = 1, ROUNDS do
    local players = { PREFIX .. "-p1-" .. r, PREFIX .. "-p2-" .. r, PREFIX .. "-p3-" .. r }
    for _, id in ipairs(players) do
      assert(client:command(DB, { insert = coll }, { documents = { { _id = id, count = 0 } } }))
    end
    skynet.call(ticker, "lua", "start")
    local t0 = core.monotonic()
    local replies = call_all(guards, "run", coll, players, PER, EACH)
    local secs = core.monotonic() - t0
    local worst = skynet.call(ticker, "lua", "stop")
    local done, failures, inner = 0, {}, 0
    for _, rep in ipairs(replies) do
      done = done + rep[1]
      if rep[2] ~= "" then failures[#failures + 1] = rep[2] end
      inner = math.max(inner, rep[3])
    end
    local total = count_of(players[1]) + count_of(players[2]) + count_of(players[3])
    result("round", r, done, total, string.format("%.4f", worst), string.format("%.4f", inner),
      string.format("%.2f", secs), #failures > 0 and table.concat(failures, "; ") or "-")
    if worst < 0.03 and inner < 0.1 then break end
  end

  -- a waiter in another service, woken by the release
  for i = 1, 10 do
    local name = PREFIX .. "-handoff-" .. i
    local h = assert(locks:acquire(name, { ttl = 10 }))
    local me, got, err, done = coroutine.running(), nil, nil, false
    skynet.fork(function()
      local ok, a, b = pcall(skynet.call, guards[1], "lua", "waiter", lcoll, name)
      if ok then got, err = a, b else err = a end
      done = true
      skynet.wakeup(me)
    end)
    skynet.sleep(20)                  -- the waiter is queued by now
    local t0 = core.monotonic()
    assert(h:release())
    -- the waiter may answer before the release's own reply is read: its
    -- wakeup then ends that read's wait early (skynet.wakeup ends any wait
    -- of the coroutine; the library looks again), and no wait is left for it
    while not done do skynet.wait(me) end
    result("handoff", got and string.format("%.4f", got - t0) or ("error " .. tostring(err)))
  end

  -- every call on a held handle against a server that takes 300 ms for
  -- each command of the delayed client (its appname)
  do
    local g, app = guards[2], PREFIX .. "-slow"
    skynet.call(g, "lua", "slow_prepare", lcoll, app)
    assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = "alwaysOn",
      data = { failCommands = { "findAndModify", "update", "delete", "insert", "aggregate" },
               blockConnection = true, blockTimeMS = 300, appName = app } }))
    local lines = skynet.call(g, "lua", "slow_run")
    client:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })
    for line in lines:gmatch("[^\n]+") do result("slow", line) end
  end

  -- a held lock of a killed service (skynet.kill), of one that exits
  -- (skynet.exit): taken over after its ttl at most
  for _, how in ipairs({ "kill", "exit" }) do
    local holder = skynet.newservice("guard")
    local name = PREFIX .. "-" .. how
    local token, err = skynet.call(holder, "lua", "hold", lcoll, name, TTL, how == "exit")
    assert(token, err)
    local t0 = core.monotonic()
    if how == "kill" then skynet.kill(holder) end
    local h, aerr = locks:acquire(name, { timeout = TTL + 8 })
    result("taken_" .. how, h and string.format("%.3f", core.monotonic() - t0) or ("error " .. tostring(aerr)),
      h and h:token_string() or "-", token)
    if h then h:release() end
  end
  client:close()
  result("closed_after", tostring((locks:try(PREFIX .. "-after"))), select(2, locks:try(PREFIX .. "-after")))
end

skynet.start(function()
  local ok, err = chunk_ok, chunk_err
  if ok then ok, err = xpcall(scenario, debug.traceback) end
  if not ok then result("error", err) end
  result("end", ok)
  skynet.abort()
end)
