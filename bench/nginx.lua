-- The nginx table of make bench: the example of examples/nginx (2 workers,
-- resty.mongolock guarding a counter document) under load, with the server
-- answering normally and with every findAndModify, update and find delayed
-- (the failCommand fail point's blockConnection; mongod needs
-- enableTestCommands); one uncontended lock cycle inside nginx against
-- the same cycle outside it; and the hand-off between two holders taking
-- turns on one key: a handler in each worker, against two LuaJIT processes
-- (BENCH_NGINX_HANDOFFS holds of 1 ms).
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
local CYCLES = tonumber(os.getenv("BENCH_NGINX_CYCLES")) or 5000
local HANDOFFS = tonumber(os.getenv("BENCH_NGINX_HANDOFFS")) or 300
local HOLD = 0.001
-- BENCH_NGINX_ONLY=cycles: the cycles' table alone (quick looks)
local ONLY = os.getenv("BENCH_NGINX_ONLY")
-- inside and outside alternate in rounds, so that both sides see the same
-- load of a shared machine (BENCH_NGINX_ROUNDS, 5 unless given)
local ROUNDS = tonumber(os.getenv("BENCH_NGINX_ROUNDS")) or 5
local CLIENTS = 16
local SLOW_COMMANDS = { "findAndModify", "update", "find" }

local function say(...) io.stderr:write("bench: ", format(...), "\n") end

-- the median of a sorted list (of rounds' ratios: one noisy round moves it
-- less than it moves a ratio of sums)
local function median(sorted)
  local n = #sorted
  if n % 2 == 1 then return sorted[(n + 1) / 2] end
  return (sorted[n / 2] + sorted[n / 2 + 1]) / 2
end

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
  for _ = 1, 20 do assert(one()) end          -- connections, index, JIT
  local t0 = core.monotonic()
  for _ = 1, n do
    local ok, err = one()
    if not ok then return nil, err end
  end
  return core.monotonic() - t0
end
]==]

-- the hand-off between two holders of one key: each takes it, holds it
-- hold seconds (sleep(hold)), releases it, and again, n times from
-- monotonic time start_at; the two wait for each other (the release is
-- handed to the waiter).  Returns one line per hold: "<taken> <released>"
-- (core.monotonic, shared by the processes of a host; released is read
-- just before the release is sent)
local HANDOFF_SRC = [==[
local resty = require "resty.mongolock"
local core = require "mongolock.core"
local function handoffs(n, hold, key, start_at, sleep)
  local lock = assert(resty:new({ uri = os.getenv("MONGODB_URI"), collection = "nginx_bench", timeout = 30 }))
  local warm = "warm-" .. key .. "-" .. core.getpid()
  for _ = 1, 20 do assert(lock:lock(warm)); assert(lock:unlock()) end
  sleep(math.max(0, start_at - core.monotonic()))
  local out = {}
  for _ = 1, n do
    local e, err = lock:lock(key)
    if not e then return nil, "lock: " .. tostring(err) end
    local taken = core.monotonic()
    sleep(hold)
    local released = core.monotonic()
    local ok, uerr = lock:unlock()
    if not ok then return nil, "unlock: " .. tostring(uerr) end
    out[#out + 1] = string.format("%.6f %.6f", taken, released)
  end
  return table.concat(out, "\n")
end
]==]

local LOCATIONS = [[
        location = /bench-cycles {
            content_by_lua_file bench_cycles.lua;
        }
        location = /bench-handoff {
            content_by_lua_file bench_handoff.lua;
        }
]]
local HANDLER = CYCLES_SRC .. [==[
-- ?threads=1: every round trip a worker thread's job (no cosockets)
local jobs = require "mongolock.ngx"
if ngx.var.arg_threads then jobs.configure({ cosockets = false }) end
local t, err = cycles(tonumber(ngx.var.arg_n), ngx.var.arg_threads and "threads" or "nginx")
jobs.configure({ cosockets = true })
if not t then ngx.status = 500; ngx.say(err); return end
ngx.say(t)
]==]

local HANDOFF_HANDLER = HANDOFF_SRC .. [==[
local a = ngx.req.get_uri_args()
local out, err = handoffs(tonumber(a.n), tonumber(a.hold), a.key, tonumber(a.start_at), ngx.sleep)
if not out then out, ngx.status = tostring(err), 500 end
ngx.header["Content-Length"] = #out   -- read on a keep-alive connection
ngx.print(out)
]==]

local HANDOFF_OUTSIDE = HANDOFF_SRC .. [==[
local out = assert(handoffs(tonumber(arg[1]), tonumber(arg[2]), arg[3], tonumber(arg[4]), core.sleep))
io.write(out)
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

-- the hand-offs of two holders' lines ("<taken> <released>"): from one's
-- release to the other's lock() returning, when the holder changed; the
-- first WARM of a round dropped (the change streams open meanwhile)
local WARM = 40
local function handoff_latencies(a, b)
  local ev = {}
  for who, lines in ipairs({ a, b }) do
    for t, r in lines:gmatch("([%d%.]+) ([%d%.]+)") do ev[#ev + 1] = { tonumber(t), tonumber(r), who } end
  end
  table.sort(ev, function(x, y) return x[1] < y[1] end)
  local lat = {}
  for i = WARM + 1, #ev do
    if ev[i][3] ~= ev[i - 1][3] then lat[#lat + 1] = ev[i][1] - ev[i - 1][2] end
  end
  table.sort(lat)
  return lat
end

-- two nginx workers' handlers (one keep-alive connection to each)
local function handoff_inside(port, n)
  local conns = nx.open_pingers(port, 2, 1)
  local key = "handoff-nginx-" .. os.time() .. "-" .. math.random(1e9)
  local start_at = require("mongolock.core").monotonic() + 1
  for _, c in ipairs(conns) do
    local path = format("/bench-handoff?n=%d&hold=%g&key=%s&start_at=%.6f", n, HOLD, key, start_at)
    assert(c.sock:send("GET " .. path .. " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
  end
  local bodies = {}
  for i, c in ipairs(conns) do
    c.sock:settimeout(120)
    local code, body = nx.keepalive_read(c.sock)
    assert(code == 200, body)
    bodies[i] = body
    c.sock:close()
  end
  return handoff_latencies(bodies[1], bodies[2])
end

-- two LuaJIT processes, the same module outside nginx
local function handoff_outside(n)
  local script = helpers.script(HANDOFF_OUTSIDE)
  local key = "handoff-luajit-" .. os.time() .. "-" .. math.random(1e9)
  local start_at = require("mongolock.core").monotonic() + 1
  local outs, ps = {}, {}
  for i = 1, 2 do
    outs[i] = os.tmpname()
    ps[i] = format("LUA_CPATH=%s luajit %s %d %g %s %.6f >%s 2>&1",
      helpers.shell_quote(nx.root .. "/build/luajit/?.so;;"), helpers.shell_quote(script), n, HOLD, key,
      start_at, outs[i])
  end
  assert(os.execute("(" .. ps[1] .. ") & (" .. ps[2] .. ") & wait"))
  local bodies = {}
  for i = 1, 2 do
    bodies[i] = assert(helpers.read_file(outs[i]))
    os.remove(outs[i])
    assert(bodies[i]:match("^[%d%. \n]+$"), bodies[i])
  end
  os.remove(script)
  return handoff_latencies(bodies[1], bodies[2])
end

local nginx = nx.start({ locations = LOCATIONS, files = { ["bench_cycles.lua"] = HANDLER,
                                                          ["bench_handoff.lua"] = HANDOFF_HANDLER } })
local ok, err = pcall(function()
  local rows = {}
  assert(nx.get(nginx.port, "/reset") == 200)
  if ONLY ~= "cycles" then
    rows[#rows + 1] = row(nginx, "server normal", nil)
    rows[#rows + 1] = row(nginx, "every command delayed 20 ms", 20)
    rows[#rows + 1] = row(nginx, "every command delayed 200 ms", 200)
  end

  say("nginx: %d uncontended lock cycles inside nginx and outside (LuaJIT), in %d rounds", CYCLES, ROUNDS)
  local per = math.ceil(CYCLES / ROUNDS)
  local inside, outside, cycle_ratios = 0, 0, {}
  local threads, thread_ratios = 0, {}
  local script = helpers.script(OUTSIDE)
  for _ = 1, ROUNDS do
    local code, body = nx.get(nginx.port, "/bench-cycles?n=" .. per)
    assert(code == 200, body)
    local tin = assert(tonumber(body:match("[%d%.e%-]+")), body)
    local tcode, tbody = nx.get(nginx.port, "/bench-cycles?threads=1&n=" .. per)
    assert(tcode == 200, tbody)
    local tth = assert(tonumber(tbody:match("[%d%.e%-]+")), tbody)
    local p = assert(io.popen(format("LUA_CPATH=%s luajit %s %d 2>&1",
      helpers.shell_quote(nx.root .. "/build/luajit/?.so;;"), helpers.shell_quote(script), per)))
    local outside_out = p:read("*a")
    p:close()
    local tout = assert(tonumber(outside_out:match("^%s*([%d%.e%-]+)%s*$")), outside_out)
    inside, outside, threads = inside + tin, outside + tout, threads + tth
    cycle_ratios[#cycle_ratios + 1] = tin / tout
    thread_ratios[#thread_ratios + 1] = tth / tout
    say("  inside %.0f us (worker threads %.0f us), outside %.0f us per cycle", tin / per * 1e6, tth / per * 1e6,
      tout / per * 1e6)
  end
  os.remove(script)
  table.sort(cycle_ratios)
  table.sort(thread_ratios)

  if ONLY == "cycles" then
    print(format("| inside nginx / outside, %d cycles, median of the rounds | %.2f (%.2f–%.2f); worker threads "
      .. "%.2f (%.2f–%.2f) |", per * ROUNDS, median(cycle_ratios), cycle_ratios[1], cycle_ratios[#cycle_ratios],
      median(thread_ratios), thread_ratios[1], thread_ratios[#thread_ratios]))
    return
  end
  local hper = math.ceil(HANDOFFS / ROUNDS)
  say("nginx: the hand-off between two holders, %d holds of %g ms, inside nginx and outside, in %d rounds",
    hper * ROUNDS, HOLD * 1000, ROUNDS)
  local hin, hout, handoff_ratios = {}, {}, {}
  for _ = 1, ROUNDS do
    local a, b = handoff_inside(nginx.port, hper), handoff_outside(hper)
    for _, x in ipairs(a) do hin[#hin + 1] = x end
    for _, x in ipairs(b) do hout[#hout + 1] = x end
    handoff_ratios[#handoff_ratios + 1] = nx.percentile(a, 0.5) / nx.percentile(b, 0.5)
    say("  inside %s, outside %s", nx.summary(a), nx.summary(b))
  end
  table.sort(hin)
  table.sort(hout)
  table.sort(handoff_ratios)

  print(format("### nginx: examples/nginx (2 workers), %d wrk connections on /incr for %d s", CLIENTS, seconds))
  print()
  print("| server | /incr answered per s | /incr errors | /ping p50 ms | /ping p99 ms | /ping max ms |")
  print("|---|---:|---:|---:|---:|---:|")
  for _, r in ipairs(rows) do print(r) end
  print()
  print("/ping: every 50 ms on 2 keep-alive connections per worker, during the load. Delays: the failCommand "
    .. "fail point's blockConnection on findAndModify, update and find.")
  print()
  print(format("| one uncontended resty.mongolock lock + unlock (%d cycles) | us per cycle |", per * ROUNDS))
  print("|---|---:|")
  print(format("| inside nginx (a content handler) | %.0f |", inside / (per * ROUNDS) * 1e6))
  print(format("| inside nginx, every round trip a worker thread's job (configure{cosockets = false}) | %.0f |",
    threads / (per * ROUNDS) * 1e6))
  print(format("| outside nginx (LuaJIT, the same module) | %.0f |", outside / (per * ROUNDS) * 1e6))
  print(format("| ratio, worker threads / outside (median of the rounds; range) | %.2f (%.2f–%.2f) |",
    median(thread_ratios), thread_ratios[1], thread_ratios[#thread_ratios]))
  print(format("| ratio, cosockets / outside (median of the rounds; range) | %.2f (%.2f–%.2f) |",
    median(cycle_ratios), cycle_ratios[1], cycle_ratios[#cycle_ratios]))

  print()
  local pct = nx.percentile
  print(format("| the hand-off between two holders of one key (%d holds of %g ms each) | p50 ms | p90 ms "
    .. "| p99 ms |", hper * ROUNDS, HOLD * 1000))
  print("|---|---:|---:|---:|")
  for _, r in ipairs({ { "two nginx workers' handlers", hin },
                       { "two LuaJIT processes (outside nginx, the same module)", hout } }) do
    local l = r[2]
    print(format("| %s | %.2f | %.2f | %.2f |", r[1], pct(l, 0.5) * 1000, pct(l, 0.9) * 1000, pct(l, 0.99) * 1000))
  end
  print(format("| ratio (p50; median of the rounds; range) | %.2f (%.2f–%.2f) | | |", median(handoff_ratios),
    handoff_ratios[1], handoff_ratios[#handoff_ratios]))
  print()
  print(format("Inside and outside alternate in %d rounds; a ratio is the median of the rounds' own (the range: "
    .. "theirs). A hand-off: from just "
    .. "before the holder's unlock() to the other's lock() returning; the first %d holds of a round dropped.",
    ROUNDS, WARM))
end)
nginx:stop()
pcall(failpoint, { mode = "off" })
observer:close()
if not ok then error(err, 0) end
