-- #integration: mongolock inside a real skynet process (scheduler =
-- "skynet", mongolock.sched.skynet).  skynet 1.8.0 is built from
-- ../shared/vendor into build/skynet by `make frameworks` (make test does
-- it); without that folder this file says so and skips itself.  The process
-- runs spec/skynet/main.lua (the scenario: 2 services of 25 coroutines
-- guarding increments, a 10 ms ticker service, a waiter woken by a release,
-- the held locks of a killed and of an exiting service, bad use) on 2
-- worker threads, so that a service blocking its thread would hold up the
-- ticker; the spec reads its RESULT lines.  skynet embeds Lua 5.4 and loads
-- build/lua5.4's core: the file runs under Lua 5.4 only.
local helpers = require "helpers"

local root = helpers.root
local skynet_dir = root .. "/build/skynet"
local vendor = os.getenv("MONGOLOCK_VENDOR")
if not vendor or vendor == "" then vendor = root .. "/../shared/vendor" end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local why_not
if helpers.lua ~= "lua5.4" then
  why_not = "skynet embeds Lua 5.4: the Lua 5.4 run of this file tests it"
elseif not exists(skynet_dir .. "/skynet") then
  if exists(vendor .. "/skynet-1.8.0.tar.gz") then
    error("skynet is not built: make frameworks (VENDOR=" .. vendor .. ")")
  end
  why_not = "no " .. vendor .. ": skynet is not built, its specs skip"
end

if why_not then
  io.stderr:write("skynet_spec: ", why_not, "\n")
  describe("#integration skynet", function()
    it("skips", function() pending(why_not) end)
  end)
  return
end

-- runs the service `start` (spec/skynet/main.lua, or one of `files`: {
-- name = source }, written to a folder of their own) in a skynet process;
-- returns its RESULT lines ({ key = { values... } }, rounds and hand-offs
-- as lists) and its output
local function run_skynet(rounds, start, files)
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir -p " .. helpers.shell_quote(dir)))
  for name, src in pairs(files or {}) do
    local w = assert(io.open(dir .. "/" .. name .. ".lua", "w"))
    w:write(src)
    w:close()
  end
  local q = function(s) return string.format("%q", s) end
  local config = dir .. "/config"
  local f = assert(io.open(config, "w"))
  f:write(table.concat({
    "thread = 2",
    "harbor = 0",
    "start = " .. q(start or "main"),
    "bootstrap = \"snlua bootstrap\"",
    "cpath = " .. q(skynet_dir .. "/cservice/?.so"),
    "lualoader = " .. q(skynet_dir .. "/lualib/loader.lua"),
    "luaservice = " .. q(dir .. "/?.lua;" .. root .. "/spec/skynet/?.lua;" .. skynet_dir .. "/service/?.lua"),
    "lua_path = " .. q(skynet_dir .. "/lualib/?.lua;" .. skynet_dir .. "/lualib/?/init.lua;"
      .. root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua"),
    "lua_cpath = " .. q(skynet_dir .. "/luaclib/?.so;" .. root .. "/build/lua5.4/?.so"),
  }, "\n"), "\n")
  f:close()
  local env = table.concat({
    "MONGODB_URI=" .. helpers.shell_quote(helpers.uri()),
    "MLSPEC_DB=" .. helpers.database,
    "MLSPEC_PREFIX=" .. helpers.unique("sk"),
    "MLSPEC_ROUNDS=" .. rounds,
  }, " ")
  local p = assert(io.popen(string.format("cd %s && %s timeout -s KILL 60 %s %s 2>&1",
    helpers.shell_quote(dir), env, helpers.shell_quote(skynet_dir .. "/skynet"), helpers.shell_quote(config))))
  local out = p:read("a")
  p:close()
  os.execute("rm -rf " .. helpers.shell_quote(dir))
  local r = { rounds = {}, handoffs = {}, slow = {} }
  for line in out:gmatch("[^\n]+") do
    local key, rest = line:match("^RESULT (%S+) ?(.*)$")
    if key then
      local vals = {}
      for v in rest:gmatch("%S+") do vals[#vals + 1] = v end
      if key == "round" then r.rounds[#r.rounds + 1] = vals
      elseif key == "handoff" then r.handoffs[#r.handoffs + 1] = vals[1]
      elseif key == "slow" then r.slow[vals[1]] = { tonumber(vals[2]), tonumber(vals[3]), rest = rest }
      else r[key] = { rest = rest, table.unpack(vals) } end
    end
  end
  return r, out
end

describe("#integration skynet", function()
  local r, out
  setup(function()
    r, out = run_skynet(5)
  end)

  local function check(cond, what)
    assert(cond, what .. "; the skynet process printed:\n" .. out)
  end

  it("runs the scenario to its end in a real skynet process", function()
    check(r["end"] and r["end"][1] == "true", "no clean end")
    check(r.error == nil, "an error")
  end)

  it("2 services of 25 coroutines, 5 guarded increments each: all 250 land, while a 10 ms ticker "
     .. "service (and each service's own) never waits 30 ms", function()
    check(#r.rounds > 0, "no round")
    for _, round in ipairs(r.rounds) do
      check(round[2] == "50" and round[3] == "250" and round[7] == "-",
        "round " .. round[1] .. ": " .. table.concat(round, " "))
    end
    local last = r.rounds[#r.rounds]
    io.stdout:write(string.format("# skynet: worst ticker gaps (ticker service, guard services) per round (s):"))
    for _, round in ipairs(r.rounds) do io.stdout:write(" ", round[4], "/", round[5], " in ", round[6], " s") end
    io.stdout:write("\n")
    -- the bound must hold in one of five rounds (a shared machine's load
    -- spike misses it in one; a worker thread blocked by a call, in all);
    -- a guard service's own ticker shares its service's message queue with
    -- 25 coroutines' wake-ups: 100 ms, as inside the other schedulers
    check(tonumber(last[4]) < 0.03 and tonumber(last[5]) < 0.1, "the ticker was held up 30 ms or more")
  end)

  it("a waiter in another service is woken by the release, not by its 2 s poll", function()
    check(#r.handoffs == 10, "10 hand-offs")
    local t = {}
    for i, h in ipairs(r.handoffs) do
      t[i] = tonumber(h)
      check(t[i], "hand-off " .. i .. ": " .. h)
    end
    table.sort(t)
    io.stdout:write(string.format("# skynet: hand-off from release to the waiter's acquire, p50 %.1f ms, "
      .. "max %.1f ms (10)\n", t[5] * 1000, t[10] * 1000))
    check(t[10] < 1.5, "a hand-off took the poll's 2 s")
  end)

  it("the held lock of a killed service (skynet.kill) and of an exiting one (skynet.exit) is taken "
     .. "over within its ttl (2 s)", function()
    for _, how in ipairs({ "kill", "exit" }) do
      local t = r["taken_" .. how]
      check(t and tonumber(t[1]), how .. ": not taken")
      check(tonumber(t[1]) < 2 + 1.5, how .. ": taken after " .. t[1] .. " s")
      check(t[2] ~= t[3], how .. ": a new token")
      io.stdout:write(string.format("# skynet: a %s service's lock taken over after %s s\n", how, t[1]))
    end
  end)

  it("against a server that takes 300 ms for each command, acquire, try, extend, release, close and the "
     .. "collection of a held handle leave the service's worker thread free", function()
    local shown = {}
    for _, k in ipairs({ "acquire", "try", "extend", "release", "close", "__gc", "<close>", "client:close" }) do
      local s = r.slow[k]
      check(s and s[1] and s[2], k .. ": not measured")
      shown[#shown + 1] = string.format("%s %.0f/%.0f", k, s[1] * 1000, s[2] * 1000)
    end
    io.stdout:write("# skynet, 300 ms a command: call ms/worst ticker gap ms: ", table.concat(shown, ", "), "\n")
    for _, k in ipairs({ "acquire", "try", "extend", "release", "close" }) do
      -- the delay was there, and the service's own ticker ran through it
      check(r.slow[k][1] >= 0.25 and r.slow[k][2] < 0.25, k .. ": " .. r.slow[k].rest)
    end
    -- a collected handle's release goes to the client's own thread
    check(r.slow["__gc"][2] < 0.25, "__gc: " .. r.slow["__gc"].rest)
  end)

  it("the README's skynet service runs as written", function()
    local readme = assert(helpers.read_file(root .. "/README.md"))
    local player = assert(readme:match("\n```lua\n(%-%- not run: player%.lua, a skynet service.-\n)```"))
    local id = helpers.unique("p")
    local rr, rout = run_skynet(1, "readme_main", { player = player, readme_main = string.format([[
      local skynet = require "skynet"
      require "skynet.manager"
      local mongolock = require "mongolock"
      skynet.start(function()
        local ok, err = pcall(function()
          local p = skynet.newservice("player")
          for _ = 1, 3 do assert(skynet.call(p, "lua", %q, 5)) end
          local c = assert(mongolock.connect(os.getenv("MONGODB_URI")))
          local r = assert(c:command("game", { find = "players" }, { filter = { _id = %q } }))
          print("RESULT gold " .. tostring(r.cursor.firstBatch[1].gold))
        end)
        if not ok then print("RESULT error " .. tostring(err)) end
        skynet.abort()
      end)
    ]], id, id) })
    assert(rr.gold and rr.gold[1] == "15", "the README's service; the skynet process printed:\n" .. rout)
  end)

  it("bad use answers as elsewhere: the main coroutine blocks as outside a scheduler, a wrong argument "
     .. "raises the same error, a closed client answers nil, \"closed\"", function()
    check(r.main_current[1] == "false" and r.current[1] == "true", "current()")
    check(r.main_try[1] == "handle" and r.main_release[1] == "true", "a blocking try in the main coroutine")
    check(r.badarg_badarg[1] == "true", "the same argument error")
    check(r.badarg_badarg.rest:find("bad argument #1 to 'acquire'", 1, true), "an argument error")
    check(r.badarg_try[1] == "true" and r.badarg_try[2] == "nil,closed", "a closed client's try")
    check(r.badarg_acquire[1] == "true" and r.badarg_acquire[2] == "nil,closed", "a closed client's acquire")
    check(r.closed_after[1] == "nil" and r.closed_after[2] == "closed", "a client closed inside")
  end)
end)
