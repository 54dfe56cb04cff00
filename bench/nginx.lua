-- The nginx table of make bench: the example of examples/nginx (2 workers,
-- resty.mongolock guarding a counter document) under load, with the server
-- answering normally and with every findAndModify, update and find delayed
-- (the failCommand fail point's blockConnection; mongod needs
-- enableTestCommands); and one uncontended lock cycle inside nginx against
-- the same cycle outside it.
--
--   lua5.4 bench/nginx.lua [SECONDS]
--     MONGODB_URI set; LUA_PATH with lua/ and spec/, LUA_CPATH the lua5.4
--     build (bench/run sets them)
--
-- Per row: wrk -t2 -c16 on /incr for SECONDS (throughput of answered
-- requests, errors), while /ping is sent every 50 ms on two keep-alive
-- connections held by each worker (spec/nginx_helpers.lua: a slot that
-- passes while a ping is unanswered counts as answered with it).  Prints
-- Markdown on stdout, progress on stderr.
local helpers = require "helpers"
local nx = require "nginx_helpers"

local format = string.format
local seconds = tonumber(arg[1]) or 5
local CYCLES = tonumber(os.getenv("BENCH_NGINX_CYCLES")) or 2000
local CLIENTS = 16
local SLOW_COMMANDS = { "findAndModify", "update", "find" }

local function say(...) io.stderr:write("bench: ", format(...), "\n") end

-- N uncontended lock/unlock cycles of resty.mongolock: seconds | nil, err
local CYCLES_SRC = [==[
local resty = require "resty.mongolock"
local core = require "mongolock.core"
local function cycles(n, tag)
  local lock = assert(resty:new({ uri = os.getenv("MONGODB_URI"), collection = "nginx_bench" }))
  local key = "cycle-" .. tag .. "-" .. core.getpid()
  local function one()
    local e, err = lock:lock(key)
    if not e then return nil, "lock: " .. tostring(err) end
    local ok, uerr = lock:unlock()
    if not ok then return nil, "unlock: " .. tostring(uerr) end
    return true
  end
  for _ = 1, 50 do assert(one()) end          -- connections, index, JIT
  local t0 = core.monotonic()
  for _ = 1, n do
    local ok, err = one()
    if not ok then return nil, err end
  end
  return core.monotonic() - t0
end
]==]

local LOCATIONS = [[
        location = /bench-cycles {
            content_by_lua_file bench_cycles.lua;
        }
]]
local HANDLER = CYCLES_SRC .. [==[
local t, err = cycles(tonumber(ngx.var.arg_n), "nginx")
if not t then ngx.status = 500; ngx.say(err); return end
ngx.say(t)
]==]

local OUTSIDE = CYCLES_SRC .. [==[
local t = assert(cycles(tonumber(arg[1]), "luajit"))
print(t)
]==]

local observer = helpers.connect()
local testing = require "mongolock.testing"
local function failpoint(spec) assert(testing.failpoint(observer._core, spec)) end
local lock_status = assert(observer:locks({ collection = "nginx_locks" }))

-- until no /incr is left in the workers (wrk's connections end with its
-- run; nginx finishes their handlers): the lock free twice, 0.5 s apart
local function drained()
  local free = 0
  nx.poll(function()
    local st = lock_status:status("counter")
    if st == nil or not st.held then free = free + 1 else free = 0 end
    if free >= 2 then return true end
    os.execute("sleep 0.5")
  end, 120, "the /incr handlers to finish")
end

local function row(nginx, label, delay_ms)
  say("nginx: %s, %d s", label, seconds)
  local pingers = nx.open_pingers(nginx.port, 2, 2)
  if delay_ms then failpoint({ mode = "alwaysOn", commands = SLOW_COMMANDS, block_ms = delay_ms }) end
  local wrk = io.popen(format("wrk -t2 -c%d -d%ds --timeout 120s http://127.0.0.1:%d/incr 2>&1", CLIENTS,
    seconds, nginx.port))
  local _, pings = nx.load(nginx.port, nil, 0, pingers, seconds)
  local out = wrk:read("*a")
  wrk:close()
  if delay_ms then failpoint({ mode = "off" }) end
  drained()
  local n = tonumber(out:match("(%d+) requests in"))
  local took = out:match("requests in ([%d%.]+)s")
  local non2xx = tonumber(out:match("Non%-2xx or 3xx responses: (%d+)")) or 0
  local errs = out:match("Socket errors: ([^\n]+)")
  if not n or not took then error("wrk: " .. out) end
  table.sort(pings)
  say("  %d /incr in %ss (%d non-2xx), /ping %s", n, took, non2xx, nx.summary(pings))
  return format("| %s | %.1f | %d%s | %.1f | %.1f | %.1f |", label, (n - non2xx) / tonumber(took), non2xx,
    errs and (" (" .. errs .. ")") or "", nx.percentile(pings, 0.5) * 1000, nx.percentile(pings, 0.99) * 1000,
    (pings[#pings] or 0) * 1000)
end

local nginx = nx.start({ locations = LOCATIONS, files = { ["bench_cycles.lua"] = HANDLER } })
local ok, err = pcall(function()
  local rows = {}
  assert(nx.get(nginx.port, "/reset") == 200)
  rows[#rows + 1] = row(nginx, "server normal", nil)
  rows[#rows + 1] = row(nginx, "every command delayed 20 ms", 20)
  rows[#rows + 1] = row(nginx, "every command delayed 200 ms", 200)

  say("nginx: %d uncontended lock cycles inside nginx and outside (LuaJIT)", CYCLES)
  local code, body = nx.get(nginx.port, "/bench-cycles?n=" .. CYCLES)
  assert(code == 200, body)
  local inside = assert(tonumber(body:match("[%d%.e%-]+")), body)
  local script = helpers.script(OUTSIDE)
  local p = assert(io.popen(format("LUA_CPATH=%s luajit %s %d 2>&1",
    helpers.shell_quote(nx.root .. "/build/luajit/?.so;;"), helpers.shell_quote(script), CYCLES)))
  local outside_out = p:read("*a")
  p:close()
  os.remove(script)
  local outside = assert(tonumber(outside_out:match("^%s*([%d%.e%-]+)%s*$")), outside_out)

  print(format("### nginx: examples/nginx (2 workers), %d wrk connections on /incr for %d s", CLIENTS, seconds))
  print()
  print("| server | /incr answered per s | /incr errors | /ping p50 ms | /ping p99 ms | /ping max ms |")
  print("|---|---:|---:|---:|---:|---:|")
  for _, r in ipairs(rows) do print(r) end
  print()
  print("/ping: every 50 ms on 2 keep-alive connections per worker, during the load. Delays: the failCommand "
    .. "fail point's blockConnection on findAndModify, update and find.")
  print()
  print(format("| one uncontended resty.mongolock lock + unlock (%d cycles) | us per cycle |", CYCLES))
  print("|---|---:|")
  print(format("| inside nginx (a content handler) | %.0f |", inside / CYCLES * 1e6))
  print(format("| outside nginx (LuaJIT, the same module) | %.0f |", outside / CYCLES * 1e6))
  print(format("| ratio | %.2f |", inside / outside))
end)
nginx:stop()
pcall(failpoint, { mode = "off" })
observer:close()
if not ok then error(err, 0) end
