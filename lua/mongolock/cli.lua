-- The mongolock command: a flock(1) whose lock lives in MongoDB, so that a
-- cron job or a backup runs on one machine of a fleet at a time.
--
--   mongolock [--uri URI] exec [-w S | -n] [--ttl S] [-E N] NAME -- CMD [ARGS...]
--   mongolock status NAME [--json]      mongolock list [--json]
--   mongolock release --force NAME [--yes]
--   mongolock wait NAME [-w S]          mongolock demo [ARGS...]
--
-- Exit status (flock(1)'s where they overlap):
--   0     success (exec: the command's own status is passed through)
--   1     the lock was busy (-n) or the wait timed out; -E/--conflict-exit-code
--   64    bad usage                      69  server unreachable or failing
--   70    internal error                 126 command not executable
--   127   command not found              128+N  the command died of signal N
--
-- Invariant: every failure leaves through fail() (one line on stderr, an exit
-- code) and every lock this process acquired is released, or left to expire
-- when the lease was lost, before main returns.

local argparse = require "argparse"
local cjson = require "cjson.safe"

local type, tostring, tonumber, pairs, ipairs = type, tostring, tonumber, pairs, ipairs
local format, concat, sort = string.format, table.concat, table.sort
local floor, huge, min, max = math.floor, math.huge, math.min, math.max
local getenv = os.getenv

local _M = { _VERSION = "0.1.0" }

local EXIT = {
  ok = 0, conflict = 1, usage = 64, unavailable = 69, software = 70,
  noexec = 126, notfound = 127,
}
_M.EXIT = EXIT

local SIGNO = { HUP = 1, INT = 2, QUIT = 3, KILL = 9, TERM = 15 }

-- ---- failing ---------------------------------------------------------------

local failure_mt = {}

-- leaves main with one line on stderr and the exit code
local function fail(code, fmt, ...)
  error(setmetatable({ code = code, msg = format(fmt, ...) }, failure_mt), 0)
end

local function warn(fmt, ...)
  io.stderr:write("mongolock: ", format(fmt, ...), "\n")
end

-- ---- option values -----------------------------------------------------------

local function seconds(s)
  local n = tonumber(s)
  if not n or n ~= n or n <= 0 or n == huge then
    return nil, format("'%s' is not a positive number of seconds", s)
  end
  return n
end

local function seconds_or_zero(s)
  local n = tonumber(s)
  if not n or n ~= n or n < 0 or n == huge then
    return nil, format("'%s' is not a number of seconds", s)
  end
  return n
end

local function exit_code(s)
  local n = tonumber(s)
  if not n or n ~= floor(n) or n < 0 or n > 255 then
    return nil, format("'%s' is not an exit code (0-255)", s)
  end
  return n
end

-- ---- the command tree ---------------------------------------------------------

local EPILOG = [[
The lock lives in the collection --collection (default "locks") of the
database --database (default: the URI's, else "mongolock").  MONGODB_URI is
used when --uri is not given.

Exit status: 0 success; 1 busy or timed out (-E); 64 bad usage; 69 server
unreachable or failing; 70 internal error; exec passes the command's status
through (126 not executable, 127 not found, 128+N killed by signal N).]]

function _M.parser()
  local p = argparse("mongolock", "Distributed locks on MongoDB, from the shell.")
    :epilog(EPILOG)
    :command_target("command")
    :help_max_width(80)
  p:option("--uri", "MongoDB connection string (default: $MONGODB_URI).")
  p:option("--database", "Database of the lock collection.")
  p:option("--collection", "Collection of the lock documents.", "locks")
  p:option("--app", "Name shown as the holder's app in status and list.", "mongolock-cli")

  local e = p:command("exec", [[
Run a command while holding the lock NAME, renewing the lease while it runs.
The command's exit status is passed through; SIGINT, SIGTERM and SIGHUP sent
to mongolock are forwarded to it (a terminal's ^C already reaches both).  When
the lease is lost (renewal failed for a whole ttl, or the lock was taken),
mongolock warns on stderr and, with --on-lost=kill, terminates the command
(SIGTERM, then SIGKILL after --kill-after seconds).  Without -w or -n it
waits for the lock as long as it takes, as flock(1) does.]])
    :summary("Run a command while holding a lock.")
  e:argument("name", "Lock name.")
  e:argument("cmd", "The command and its arguments (put them after --).")
    :args("+")
  e:mutex(
    e:option("-w --timeout", "Give up after waiting this many seconds."):convert(seconds),
    e:flag("-n --nonblock", "Fail at once when the lock is held (one attempt).")
  )
  e:option("--ttl", "Lease length in seconds; renewed every ttl/3.", "30"):convert(seconds)
  e:option("-E --conflict-exit-code", "Exit status when busy or timed out.", "1")
    :convert(exit_code)
  e:option("--on-lost", "What to do when the lease is lost.", "warn"):choices({ "warn", "kill" })
  e:option("--kill-after", "With --on-lost=kill: seconds from SIGTERM to SIGKILL.", "10")
    :convert(seconds_or_zero)
  e:flag("-v --verbose", "Say on stderr when the lock is taken and released, and which signals are forwarded.")

  local s = p:command("status", "Show who holds the lock NAME, its token and its lease.")
  s:argument("name", "Lock name.")
  s:flag("--json", "One JSON object on stdout.")

  local l = p:command("list", "List the locks of the collection, held or not.")
  l:flag("--json", "One JSON array on stdout.")

  local r = p:command("release", [[
Release the lock NAME whoever holds it, for a person cleaning up after a
holder that cannot release it.  Its holder learns that it lost the lock at its
next renewal.  Asks for confirmation on stdin unless --yes is given.]])
    :summary("Force the release of a lock held by another process.")
  r:argument("name", "Lock name.")
  r:flag("--force", "Required: this releases a lock this process does not hold.")
  r:flag("-y --yes", "Do not ask for confirmation.")

  local w = p:command("wait", "Wait until the lock NAME is free (without taking it).")
  w:argument("name", "Lock name.")
  w:option("-w --timeout", "Give up after this many seconds."):convert(seconds)
  w:option("-E --conflict-exit-code", "Exit status when timed out.", "1")
    :convert(exit_code)

  local d = p:command("demo", "Run the demo: worker processes incrementing one counter, with and without the lock.")
  d:argument("args", "Arguments for the demo."):args("*")

  return p
end

-- ---- helpers ---------------------------------------------------------------------

local core, mongolock, proc

local function load_core()
  if core then return end
  local ok, m = pcall(require, "mongolock")
  if not ok then fail(EXIT.software, "cannot load the mongolock module: %s", tostring(m):match("^[^\n]*")) end
  mongolock = m
  core = require "mongolock.core"
end

-- the command's child processes and signals (csrc/proc.c)
local function load_proc()
  if proc then return proc end
  local ok, m = pcall(require, "mongolock.proc")
  if not ok then fail(EXIT.software, "cannot load the mongolock.proc module: %s", tostring(m):match("^[^\n]*")) end
  proc = m
  return proc
end

local function open_locks(args)
  load_core()
  local uri = args.uri or getenv("MONGODB_URI")
  if not uri or uri == "" then
    fail(EXIT.usage, "no server given: use --uri URI or set MONGODB_URI")
  end
  local ok, client, err = pcall(mongolock.connect, uri, { appname = args.app })
  if not ok then fail(EXIT.usage, "%s", tostring(client)) end
  if not client then
    if tostring(err):match("^invalid URI") then fail(EXIT.usage, "%s", err) end
    fail(EXIT.unavailable, "cannot connect: %s", tostring(err))
  end
  local ok2, locks, err2 = pcall(client.locks, client, {
    database = args.database, collection = args.collection, ttl = args.ttl,
  })
  if not ok2 then fail(EXIT.usage, "%s", tostring(locks)) end
  if not locks then fail(EXIT.unavailable, "%s", tostring(err2)) end
  return client, locks
end

-- calls locks[method](locks, ...) turning a raised argument error (a bad
-- name) into a usage failure; any other error stays internal
local function call(locks, method, ...)
  local ok, a, b, c = pcall(locks[method], locks, ...)
  if not ok then
    local msg = tostring(a):match("^[^\n]*")
    if msg:find("bad argument", 1, true) then
      fail(EXIT.usage, "%s", (msg:gsub("^[^:]*:%d+: ", "")))
    end
    fail(EXIT.software, "internal error: %s", msg)
  end
  return a, b, c
end

-- a value fit for JSON and for printing: typed BSON values become their
-- string form, integers stay integers
local function plain(v)
  local t = type(v)
  if t == "table" then
    local mt = getmetatable(v)
    if mt and mt.__tostring then return tostring(v) end
    local o = {}
    for k, x in pairs(v) do o[k] = plain(x) end
    return o
  elseif t == "userdata" or t == "cdata" then
    return tostring(v)
  end
  return v
end

-- a time as status returns it (seconds since the epoch) in ISO 8601, UTC
local function iso(t)
  if type(t) ~= "number" then return "-" end
  return os.date("!%Y-%m-%dT%H:%M:%S", floor(t)) .. format(".%03dZ", floor((t % 1) * 1000))
end

local function holder_text(h)
  if type(h) ~= "table" then return "-" end
  local parts = { tostring(h.host or "?") }
  if h.pid then parts[#parts + 1] = "pid " .. tostring(h.pid) end
  if h.app and h.app ~= "" then parts[#parts + 1] = tostring(h.app) end
  return concat(parts, " ")
end

local function remaining_text(st)
  if type(st.remaining) ~= "number" then return nil end
  return format("%.1f s", st.remaining)
end

-- a fencing token in full (tokens reach 16 digits)
local function token_text(t)
  return type(t) == "number" and format("%.0f", t) or "-"
end

local function json_out(v)
  local s, err = cjson.encode(v)
  if not s then fail(EXIT.software, "cannot encode JSON: %s", err) end
  io.stdout:write(s, "\n")
end

-- ---- status, list ----------------------------------------------------------------

-- the status of name as one plain table (name and held always present)
local function status_record(name, st)
  local rec = { name = name, held = false }
  if st then
    for k, v in pairs(plain(st)) do rec[k] = v end
    rec.name = name
    rec.held = st.held and true or false
  end
  return rec
end

-- the JSON form of a record: the token as a decimal string, as lua-cjson
-- writes at most 14 significant digits and tokens have 16
local function json_record(rec)
  local o = {}
  for k, v in pairs(rec) do o[k] = v end
  if type(o.token) == "number" then o.token = token_text(o.token) end
  return o
end

local function cmd_status(args)
  local client, locks = open_locks(args)
  local st, err = call(locks, "status", args.name)
  if st == nil and err ~= nil then fail(EXIT.unavailable, "status of %s: %s", args.name, tostring(err)) end
  local rec = status_record(args.name, st)
  client:close()
  if args.json then
    json_out(json_record(rec))
  else
    local out = { format("lock      %s", rec.name), format("state     %s", rec.held and "held" or "free") }
    if rec.held then
      out[#out + 1] = format("holder    %s", holder_text(rec.holder))
      out[#out + 1] = format("owner     %s", tostring(rec.owner or "-"))
      local rem = remaining_text(rec)
      out[#out + 1] = format("expires   %s%s", iso(rec.expires_at), rem and (" (in " .. rem .. ")") or "")
    end
    if rec.token then out[#out + 1] = format("token     %s", token_text(rec.token)) end
    if rec.acquired_at then out[#out + 1] = format("acquired  %s", iso(rec.acquired_at)) end
    if (tonumber(rec.waiting) or 0) > 0 then out[#out + 1] = format("waiting   %d", rec.waiting) end
    io.stdout:write(concat(out, "\n"), "\n")
  end
  return EXIT.ok
end

local function cmd_list(args)
  local client, locks = open_locks(args)
  if type(locks.list) ~= "function" then fail(EXIT.software, "this version of the library has no locks:list()") end
  local all, err = call(locks, "list")
  if not all then fail(EXIT.unavailable, "list: %s", tostring(err)) end
  client:close()
  local recs = {}
  for _, st in ipairs(all) do
    recs[#recs + 1] = status_record(st.name or st._id or st.id, st)
  end
  sort(recs, function(a, b) return tostring(a.name) < tostring(b.name) end)
  if args.json then
    if #recs == 0 then
      io.stdout:write("[]\n")   -- lua-cjson writes an empty table as {}
    else
      for i, r in ipairs(recs) do recs[i] = json_record(r) end
      json_out(recs)
    end
  else
    local rows = { { "NAME", "STATE", "TOKEN", "HOLDER", "EXPIRES" } }
    for _, r in ipairs(recs) do
      rows[#rows + 1] = {
        tostring(r.name), r.held and "held" or "free",
        token_text(r.token),
        r.held and holder_text(r.holder) or "-",
        r.held and (remaining_text(r) or iso(r.expires_at)) or "-",
      }
    end
    local width = {}
    for _, row in ipairs(rows) do
      for i, c in ipairs(row) do width[i] = max(width[i] or 0, #c) end
    end
    for _, row in ipairs(rows) do
      local cells = {}
      for i, c in ipairs(row) do
        cells[i] = i < #row and c .. (" "):rep(width[i] - #c) or c
      end
      io.stdout:write(concat(cells, "  "), "\n")
    end
  end
  return EXIT.ok
end

-- ---- release --force -----------------------------------------------------------------

local function cmd_release(args)
  if not args.force then
    fail(EXIT.usage, "release needs --force: only a lock's holder releases it normally; "
      .. "--force releases it for whoever holds it")
  end
  local client, locks = open_locks(args)
  if type(locks.force_release) ~= "function" then
    fail(EXIT.software, "this version of the library has no locks:force_release()")
  end
  local st, err = call(locks, "status", args.name)
  if st == nil and err ~= nil then fail(EXIT.unavailable, "status of %s: %s", args.name, tostring(err)) end
  if not (st and st.held) then
    warn("%s is not held", args.name)
    client:close()
    return EXIT.conflict
  end
  if not args.yes then
    io.stderr:write(format("mongolock: release %s, held by %s (token %s)? [y/N] ",
      args.name, holder_text(st.holder), token_text(st.token)))
    io.stderr:flush()
    local answer = io.stdin:read("*l")
    if not (answer and answer:match("^%s*[yY]")) then
      warn("%s not released", args.name)
      client:close()
      return EXIT.conflict
    end
  end
  local ok, ferr = call(locks, "force_release", args.name)
  client:close()
  if not ok then
    if ferr == "not held" then
      warn("%s is not held", args.name)
      return EXIT.conflict
    end
    fail(EXIT.unavailable, "release of %s: %s", args.name, tostring(ferr))
  end
  return EXIT.ok
end

-- ---- wait -------------------------------------------------------------------------------

local function cmd_wait(args)
  local client, locks = open_locks(args)
  local deadline = args.timeout and core.monotonic() + args.timeout or huge
  local step = 0.01
  while true do
    local st, err = call(locks, "status", args.name)
    if st == nil and err ~= nil then fail(EXIT.unavailable, "status of %s: %s", args.name, tostring(err)) end
    if not (st and st.held) then
      client:close()
      return EXIT.ok
    end
    local now = core.monotonic()
    if now >= deadline then
      client:close()
      return args.conflict_exit_code
    end
    -- back off, but look again when the lease is due to end
    local nap = step
    local rem = st.remaining or (st.remaining_ms and st.remaining_ms / 1000)
    if rem and rem > 0 then nap = min(nap, rem + 0.005) end
    core.sleep(min(nap, deadline - now))
    step = min(step * 2, 0.5)
  end
end

-- ---- exec ---------------------------------------------------------------------------------

-- the exit status of a caught signal, as a shell reports it
local function signal_status(name)
  return 128 + (SIGNO[name] or 0)
end

-- waits for the lock the way flock(1) does: once (-n), up to -w seconds, or
-- for ever.  Caught signals end the wait.  Returns the handle (renewed
-- every ttl/3 by the library's background renewal), or an exit status.
local function exec_acquire(args, locks)
  local opts = { ttl = args.ttl, renew = true }
  if args.nonblock then
    local h, err = call(locks, "try", args.name, opts)
    if h then return h end
    if err == "busy" then return nil, args.conflict_exit_code end
    fail(EXIT.unavailable, "cannot take %s: %s", args.name, tostring(err))
  end
  local deadline = args.timeout and core.monotonic() + args.timeout or huge
  while true do
    -- slices of at most a second, so that a signal ends the wait promptly
    local slice = min(1, deadline - core.monotonic())
    if slice <= 0 then return nil, args.conflict_exit_code end
    opts.timeout = slice
    local h, err = call(locks, "acquire", args.name, opts)
    if h then return h end
    if err ~= "timeout" then fail(EXIT.unavailable, "cannot take %s: %s", args.name, tostring(err)) end
    local caught = proc.signals()
    if caught[1] then return nil, signal_status(caught[1].name) end
  end
end

-- runs argv as a child holding h (a handle renewed in the background),
-- until it ends; returns its exit status and whether the lease was lost
-- (and said so) meanwhile
local function supervise(args, h, argv)
  local pid, err, errno = proc.spawn(argv)
  if not pid then
    warn("failed to execute %s", err)
    return (errno == 2) and EXIT.notfound or EXIT.noexec
  end
  if args.verbose then warn("running %s (pid %d) holding %s", argv[1], pid, args.name) end

  -- how often h:lost() is looked at: a fraction of the renewal period
  local look = min(0.25, args.ttl / 6)
  local lost, kill_at = false, nil

  while true do
    local wait = look
    if kill_at then wait = min(wait, max(0, kill_at - core.monotonic())) end
    local how, code, signo = proc.wait(pid, wait)
    if how == "exit" then return code, lost end
    if how == "signal" then return 128 + signo, lost end
    if how == nil then fail(EXIT.software, "%s", tostring(code)) end

    for _, sig in ipairs(proc.signals()) do
      -- a terminal's key already reached the child (same process group)
      if sig.tty then
        if args.verbose then warn("SIG%s came from the terminal, which sent it to %s too", sig.name, argv[1]) end
      else
        if args.verbose then warn("forwarding SIG%s to %s (pid %d)", sig.name, argv[1], pid) end
        proc.kill(pid, sig.name)
      end
    end

    -- lost: a renewal found the lock gone, or none succeeded in time
    if not lost and h:lost() then
      lost = true
      if args.on_lost == "kill" then
        warn("lost the lock %s (its lease could not be renewed); terminating %s (pid %d)",
          args.name, argv[1], pid)
        proc.kill(pid, "TERM")
        kill_at = core.monotonic() + args.kill_after
      else
        warn("lost the lock %s (its lease could not be renewed); %s keeps running", args.name, argv[1])
      end
    end
    if kill_at and core.monotonic() >= kill_at then
      proc.kill(pid, "KILL")
      kill_at = nil
    end
  end
end

local function cmd_exec(args)
  local client, locks = open_locks(args)
  load_core()
  load_proc().trap()
  local h, status = exec_acquire(args, locks)
  if not h then
    client:close()
    return status
  end
  if args.verbose then warn("took %s (token %s)", args.name, token_text(h.token)) end
  local code, lost = supervise(args, h, args.cmd)
  local ok, err = h:release()
  if not ok and not lost then
    warn("the lock %s was lost before the command ended (%s)", args.name, tostring(err))
  elseif args.verbose then
    warn("released %s", args.name)
  end
  client:close()
  return code
end

-- ---- demo -------------------------------------------------------------------------------

-- the interpreter running this script (lowest negative index of arg)
local function interpreter(argv0)
  local i, found = -1, nil
  while argv0 and argv0[i] do found = argv0[i]; i = i - 1 end
  return found or (rawget(_G, "jit") and "luajit" or "lua5.4")
end

local function file_exists(p)
  local f = io.open(p, "r")
  if f then f:close() end
  return f ~= nil
end

local function cmd_demo(args, info)
  load_core()
  local candidates = {}
  local root = getenv("MONGOLOCK_ROOT")
  if root and root ~= "" then candidates[#candidates + 1] = root .. "/examples/counter.lua" end
  if info.root then candidates[#candidates + 1] = info.root .. "/examples/counter.lua" end
  candidates[#candidates + 1] = "examples/counter.lua"
  local script
  for _, c in ipairs(candidates) do
    if file_exists(c) then script = c; break end
  end
  if not script then
    fail(EXIT.usage, "the demo (examples/counter.lua) is not here: run it from a source tree or set MONGOLOCK_ROOT")
  end
  local uri = args.uri or getenv("MONGODB_URI")
  if not uri or uri == "" then fail(EXIT.usage, "no server given: use --uri URI or set MONGODB_URI") end
  -- the demo's processes find this process's modules and server
  local argv = { "env", "LUA_PATH=" .. package.path, "LUA_CPATH=" .. package.cpath, "MONGODB_URI=" .. uri,
    interpreter(info.arg), script }
  for _, a in ipairs(args.args) do argv[#argv + 1] = a end
  load_proc().trap()
  local pid, err, errno = proc.spawn(argv)
  if not pid then
    warn("failed to execute %s", err)
    return (errno == 2) and EXIT.notfound or EXIT.noexec
  end
  while true do
    local how, code, signo = proc.wait(pid, 3600)
    if how == "exit" then return code end
    if how == "signal" then return 128 + signo end
    for _, sig in ipairs(proc.signals()) do
      if not sig.tty then proc.kill(pid, sig.name) end
    end
  end
end

-- ---- main ----------------------------------------------------------------------------------

local commands = {
  exec = cmd_exec, status = cmd_status, list = cmd_list,
  release = cmd_release, wait = cmd_wait, demo = cmd_demo,
}

-- main(argv, info) -> exit status.  argv: the arguments (arg of the script);
-- info.root: the source tree the launcher runs from, if any.
function _M.main(argv, info)
  info = info or {}
  info.arg = info.arg or argv
  local list = {}
  for i = 1, #argv do list[i] = argv[i] end
  local parser = _M.parser()
  local ok, args = parser:pparse(list)
  if not ok then
    local help = "mongolock --help"
    for _, a in ipairs(list) do
      if commands[a] then help = "mongolock " .. a .. " --help"; break end
    end
    io.stderr:write(format("mongolock: %s (see '%s')\n", (args:gsub("\n", "; ")), help))
    return EXIT.usage
  end
  local command = commands[args.command]
  local done, code = xpcall(function() return command(args, info) end, function(e)
    if getmetatable(e) == failure_mt then return e end
    if getenv("MONGOLOCK_DEBUG") then io.stderr:write(debug.traceback(tostring(e), 2), "\n") end
    return setmetatable({ code = EXIT.software, msg = "internal error: " .. tostring(e):match("^[^\n]*") }, failure_mt)
  end)   -- (Lua 5.1's xpcall passes no arguments)
  if not done then
    io.stderr:write("mongolock: ", code.msg, "\n")
    return code.code
  end
  return code
end

return _M
