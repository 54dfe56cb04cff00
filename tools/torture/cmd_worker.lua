-- A torture worker of --command: loops `mongolock exec` (or `mongolock
-- elect`, --kind election) on one lock until the stop file appears, through
-- its own TCP proxy (the harness freezes it with SIGSTOP, as a network or
-- server that stops answering), each run's command being cmd_child.lua,
-- which ignores SIGTERM and logs its acts as worker.lua's sections.
--
--   cmd_worker.lua LOG NAME TTL HOLD_MS STOPFILE
--     (TORTURE_URI: the server through the proxy; TORTURE_APP: the holder's
--     app, by which the harness finds the proxy of the holder; TORTURE_KIND;
--     TORTURE_LUA: the interpreter)
-- Logs only what cmd_child.lua logs (M, A, S lines) and E lines: a run of
-- mongolock that exited 69 or 70 (its stderr goes to the harness's).

local core = require "mongolock.core"

local logpath, name, ttl, hold_ms, stopfile = arg[1], arg[2], arg[3], arg[4], arg[5]
assert(logpath and name and ttl and hold_ms and stopfile, "usage: cmd_worker.lua LOG NAME TTL HOLD_MS STOPFILE")
local uri = assert(os.getenv("TORTURE_URI"), "TORTURE_URI is not set")
local app = os.getenv("TORTURE_APP") or "torture-cmd"
local lua = os.getenv("TORTURE_LUA") or "lua5.4"
local elect = os.getenv("TORTURE_KIND") == "election"
local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "."
local root = here .. "/../.."

local function q(s) return "'" .. tostring(s):gsub("'", [['\'']]) .. "'" end
local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() end
  return f ~= nil
end

local pid = core.getpid()
io.stdout:write("ready ", pid, "\n")
io.stdout:flush()

-- the child ignores SIGTERM (the worst child: only SIGKILL ends it), and
-- holds for up to 2 ttl, acting every 0..HOLD_MS ms
local child = string.format("trap '' TERM; TORTURE_MODE=%s exec %s %s %s %s %s", elect and "l" or "x", lua,
  q(here .. "/cmd_child.lua"), q(logpath), hold_ms, tonumber(ttl) * 2)
local cmd = table.concat({ lua, q(root .. "/bin/mongolock"), "--uri", q(uri), "--app", q(app),
  "--database mongolock_torture --collection locks", elect and "elect" or "exec", "--ttl", ttl,
  "-w", tostring(10 * tonumber(ttl)), q(name), "sh -c", q(child), "</dev/null >/dev/null" }, " ")
while not exists(stopfile) do
  local ok, how, code = os.execute(cmd)
  if type(ok) == "number" then code = ok end     -- Lua 5.1, LuaJIT without 5.2 compat
  if how == "exit" and (code == 69 or code == 70) then
    local log = assert(io.open(logpath, "a"))
    log:write(string.format("E %d mongolock exited %d\n", pid, code))
    log:close()
    core.sleep(0.05)
  end
end
