-- Internal to mongolock: the implementation of bin/mongolock, not an API; it may
-- change without notice.
--
-- The mongolock command: a flock(1) whose lock lives in MongoDB, so that a
-- cron job or a backup runs on one machine of a fleet at a time.
--
--   mongolock [--uri URI] [--server-timeout S] exec [-w S | -n] [--ttl S] [-E N] NAME [--] CMD [ARGS...]
--     (every word after NAME is CMD's; the command gets MONGOLOCK_NAME and
--     MONGOLOCK_TOKEN; a lost lease ends it unless --on-lost=warn)
--   mongolock elect [-w S | -n] [--value V] [--ttl S] NAME [--] CMD [ARGS...]
--     (exec, while this process leads the election NAME)
--   mongolock leader NAME [--watch [-w S]] [--json]
--   mongolock --version
--   mongolock status NAME [--json]      mongolock list [--json]
--   mongolock top [--once] [--json] [--seconds S]
--   mongolock hold [-w S | -n] [--ttl S] NAME  (prints the token; holds
--     until SIGINT, SIGTERM, SIGHUP or the end of stdin)
--   mongolock release --force NAME [--yes]
--   mongolock wait NAME [-w S]          mongolock demo [ARGS...]
--
-- Exit status (flock(1)'s where they overlap):
--   0     success (exec: the command's own status is passed through;
--         status: the lock is held)
--   1     the lock was busy (-n) or the wait timed out; -E/--conflict-exit-code;
--         status: the lock is free or its lease expired
--   64    bad usage                      69  server unreachable or failing
--   70    internal error                 75  exec: lease lost, command exited 0
--   126   command not executable         127 command not found
--   128+N the command died of signal N
--
-- Invariants: every failure leaves through fail() (one line on stderr, an
-- exit code) and every lock this process acquired is released, or left to
-- expire when the lease was lost or the release failed, before main
-- returns.  exec holds its lock until the command's process group is empty
-- (--release-on-exit: until the command exits).  Every server call is bounded by the server timeout
-- (--server-timeout; the library's server_timeout connect option).

local argparse = require "argparse"
local cjson = require "cjson.safe"

local type, tostring, tonumber, pairs, ipairs = type, tostring, tonumber, pairs, ipairs
local format, concat, sort = string.format, table.concat, table.sort
local floor, huge, min, max = math.floor, math.huge, math.min, math.max
local getenv = os.getenv

local _M = { _VERSION = "0.1.0" }

local EXIT = {
  ok = 0, conflict = 1, free = 1, usage = 64, unavailable = 69, software = 70,
  lost = 75, noexec = 126, notfound = 127,
}
_M.EXIT = EXIT

local SIGNO = { HUP = 1, INT = 2, QUIT = 3, KILL = 9, TERM = 15 }

-- ---- failing ---------------------------------------------------------------

local failure_mt = {}

-- leaves main with one line on stderr and the exit code
local function fail(code, fmt, ...)
  error(setmetatable({ code = code, msg = format(fmt, ...) }, failure_mt), 0)
end

-- one write(2) a line (stderr is unbuffered): the command's children
-- write there too, and a line must not be cut by theirs
local function warn(fmt, ...)
  io.stderr:write("mongolock: " .. format(fmt, ...) .. "\n")
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

-- seconds a server call may take (server selection, connecting, a reply)
-- unless --server-timeout, MONGOLOCK_SERVER_TIMEOUT or the URI say otherwise
local SERVER_TIMEOUT = 2
_M.SERVER_TIMEOUT = SERVER_TIMEOUT


-- a value of at most limit seconds (limit_text says it in words)
local function at_most(convert, limit, limit_text)
  return function(s)
    local n, err = convert(s)
    if n and n > limit then return nil, format("'%s' is more than %s (%d seconds)", s, limit_text, limit) end
    return n, err
  end
end
local YEAR, DAY = 365 * 86400, 86400

-- a lease of at least a second: a shorter one ends before a round trip
-- and its renewal can keep it
local function at_least_second(convert)
  return function(s)
    local n, err = convert(s)
    if n and n < 1 then return nil, format("'%s' is less than a second, the shortest lease", s) end
    return n, err
  end
end

local function exit_code(s)
  local n = tonumber(s)
  if not n or n ~= floor(n) or n < 0 or n > 255 then
    return nil, format("'%s' is not an exit code (0-255)", s)
  end
  return n
end

local function permits_value(v)
  local n = tonumber(v)
  if not n or n < 1 or n > 1000000 or n % 1 ~= 0 then
    return nil, "permits must be an integer from 1 to 1000000"
  end
  return n
end

-- "mongolock 0.1.0 (Lua 5.4)": the command's version and the interpreter
function _M.version_text()
  local jit = rawget(_G, "jit")
  return format("mongolock %s (%s)", _M._VERSION, jit and jit.version or _VERSION)
end

-- ---- the command tree ---------------------------------------------------------

local EPILOG = [[
The lock lives in the collection --collection (default "locks") of the
database --database (default: the URI's, else "mongolock").  MONGODB_URI is
used when --uri is not given.  Every call to the server gives up after
--server-timeout seconds (default 2; MONGOLOCK_SERVER_TIMEOUT), unless the
URI sets serverSelectionTimeoutMS, connectTimeoutMS or socketTimeoutMS.

Exit status: 0 success (status: the lock is held; leader: someone leads); 1
busy or timed out (-E), status: free or expired, leader: nobody leads
(--watch -w: nobody led in time); 64 bad usage; 69 server unreachable or
failing; 70 internal error; exec and elect pass the command's status through
(126 not executable, 127 not found, 128+N killed by signal N), except that a
command that exited 0 gives 75 when the lease was lost while it ran and 69
when the release failed or is unconfirmed; hold: 75 lost, 69 the release
failed or is unconfirmed.]]

-- the options that take a value, per command ("" for the global ones):
-- alias -> the option's long name; filled by option() as parser() runs
local VALUED = {}

-- cmd:option(names, ...), recording names (e.g. "-w --timeout") in VALUED
local function option(cmd, key, names, ...)
  local long = names:match("(%-%-%S+)$")
  VALUED[key] = VALUED[key] or {}
  for alias in names:gmatch("%S+") do VALUED[key][alias] = long end
  local o = cmd:option(names, ...)
  -- a bad value's message names the option: "--ttl: '0' is not ..."
  local convert = o.convert
  function o.convert(self, f)
    return convert(self, function(v)
      local r, err = f(v)
      if r == nil and err then return nil, long .. ": " .. err end
      return r
    end)
  end
  return o
end

function _M.parser()
  local p = argparse("mongolock", "Distributed locks on MongoDB, from the shell.")
    :epilog(EPILOG)
    :command_target("command")
    :help_max_width(80)
  p:flag("--version", "Print the version and exit.")
    :action(function()
      io.stdout:write(_M.version_text(), "\n")
      io.stdout:flush()
      os.exit(EXIT.ok)
    end)
  option(p, "", "--uri", "MongoDB connection string (default: $MONGODB_URI).")
  option(p, "", "--database", "Database of the lock collection.")
  option(p, "", "--collection", "Collection of the lock documents.", "locks")
  option(p, "", "--app", "Name shown as the holder's app in status and list.", "mongolock-cli")
  option(p, "", "--server-timeout", "Seconds a call to the server may take before it fails "
    .. "(default: $MONGOLOCK_SERVER_TIMEOUT, else " .. SERVER_TIMEOUT .. "; wait -w S: S if shorter, "
    .. "at least 1).")
    :convert(at_most(seconds, DAY, "a day"))

  local e = p:command("exec", [[
Run a command while holding the lock NAME, renewing the lease while it runs.
Waiters are served in the order they came.  Without -w or -n it waits for the
lock as long as it takes, as flock(1) does; -w 0 is -n.

The command runs in a process group of its own (given the terminal when
mongolock has it, so ^C and ^Z reach it as usual), and every signal mongolock
sends goes to that whole group: SIGINT, SIGTERM and SIGHUP sent to mongolock
are forwarded.  When the lease is lost (no renewal succeeded for a whole
ttl, or the lock was released or taken by another), mongolock says so on
stderr and, unless --on-lost=warn, sends the group SIGTERM, then SIGKILL
after --kill-after seconds (and SIGKILL to what remains of the group once
the command has ended), so nothing it started goes on without the lock.
Cut off from the server, it does not wait for the lease's end: while no
renewal succeeds, SIGTERM comes --kill-after + 0.1 s before the lease's
local deadline and SIGKILL 0.1 s before it, so the group is gone before
another holder can start (--kill-after is cut to ttl/2 - 0.1 s).
Processes that leave the group (setsid, daemons) are not followed.  If mongolock itself is killed with SIGKILL, the
group runs on unsupervised and the lock frees at the end of its lease.

The command runs with MONGOLOCK_NAME (NAME) and MONGOLOCK_TOKEN (the lock's
fencing token, in decimal) in its environment.  Its exit status is passed
through.  The lock is held until the command's process group is empty (its
background jobs too, as flock(1)'s lock is held by every process that
inherited its descriptor), or, with --release-on-exit, until the command
itself exits.  Then mongolock says on stderr, unless the lock was released
("released" with -v; also when only the release's reply was lost and the
lock no longer names this holder): "lost" (exit 75 if the command exited 0),
or that the release failed or is unconfirmed (the server could not be
asked; the lock frees at the end of its lease at the latest): exit 69 if
the command exited 0.]])
    :summary("Run a command while holding a lock.")
  e:argument("name", "Lock name.")
  e:argument("cmd", "The command and its arguments: every word after NAME, whatever it looks like "
    .. "(a -- right after NAME is skipped); mongolock's own options go before NAME.")
    :args("+")
  e:mutex(
    option(e, "exec", "-w --timeout", "Give up after waiting this many seconds (0: one attempt, as -n; "
      .. "without -w or -n: wait for ever)."):convert(seconds_or_zero),
    e:flag("-n --nonblock", "Fail at once when the lock is held (one attempt).")
  )
  option(e, "exec", "--ttl", "Lease length in seconds (1 to a year); renewed every ttl/3.", "30")
    :convert(at_least_second(at_most(seconds, YEAR, "a year")))
  e:mutex(
    e:flag("--shared", "Take a reader's share of NAME as a reader-writer lock (writers: without it)."),
    option(e, "exec", "--permits", "Take one of N permits of NAME as a semaphore (every caller gives the same N).")
      :convert(permits_value)
  )
  option(e, "exec", "-E --conflict-exit-code", "Exit status when busy or timed out.", "1")
    :convert(exit_code)
  option(e, "exec", "--on-lost", "What to do when the lease is lost: kill (end the command's process "
    .. "group, as above) or warn (say so and let it run on).", "kill"):choices({ "warn", "kill" })
  option(e, "exec", "--kill-after", "With --on-lost=kill: seconds from SIGTERM to SIGKILL (at most "
    .. "ttl/2 - 0.1; cut to that).", "10")
    :convert(seconds_or_zero)
  option(e, "exec", "--lock-delay", "Seconds nobody may take NAME after this holder's lease ended without a "
    .. "release (mongolock killed or cut off, or release --force), so that its command is gone first "
    .. "(default: --kill-after + 5; 0: none).")
    :convert(seconds_or_zero)
  e:flag("--release-on-exit", "Release the lock as soon as the command exits, even while processes it "
    .. "started go on in its process group (default: hold it until the group is empty).")
  e:flag("-v --verbose", "Say on stderr when the lock is taken and released, and which signals are forwarded.")

  local hd = p:command("hold", [[
Take the lock NAME, print its fencing token (exact decimal digits) on
stdout, and hold it, renewing its lease, until mongolock gets SIGINT,
SIGTERM or SIGHUP or its stdin ends; then release it and exit 0.  As
`etcdctl lock NAME` without a command, for a shell that holds a lock while
it does several things (`coproc mongolock hold NAME`, then close the
coprocess's stdin or kill it).  Stdin is watched when it is a pipe, a FIFO,
a socket or the terminal (^D ends it; what comes is read and dropped); a
file or /dev/null (a script's background job gets /dev/null) is not, and
then only a signal ends the hold.  It waits for the lock as exec does.
When the lease is lost mongolock says why on stderr and exits 75; when the
release failed or is unconfirmed, 69.]])
    :summary("Take a lock, print its token, hold it until a signal or the end of stdin.")
  hd:argument("name", "Lock name.")
  hd:mutex(
    option(hd, "hold", "-w --timeout", "Give up after waiting this many seconds (0: one attempt, as -n; "
      .. "without -w or -n: wait for ever)."):convert(seconds_or_zero),
    hd:flag("-n --nonblock", "Fail at once when the lock is held (one attempt).")
  )
  option(hd, "hold", "--ttl", "Lease length in seconds (1 to a year); renewed every ttl/3.", "30")
    :convert(at_least_second(at_most(seconds, YEAR, "a year")))
  hd:mutex(
    hd:flag("--shared", "Take a reader's share of NAME as a reader-writer lock (writers: without it)."),
    option(hd, "hold", "--permits", "Take one of N permits of NAME as a semaphore (every caller gives the same N).")
      :convert(permits_value)
  )
  option(hd, "hold", "-E --conflict-exit-code", "Exit status when busy or timed out.", "1")
    :convert(exit_code)
  hd:flag("-v --verbose", "Say on stderr when the lock is taken and released, and what ended the hold.")

  local el = p:command("elect", [[
Run a command while this process leads the election NAME: wait to lead (as
exec waits for its lock), publish --value as the leader's value, run the
command, and resign when it ends, so that the next campaigner leads.  A
leader is the holder of the lock NAME (the same collection as exec's locks;
its fencing token is the term, in MONGOLOCK_TOKEN).  Everything else is
exec's: the lease is renewed while the command runs, signals are forwarded,
and when the lead is lost the command's process group is sent SIGTERM, then
SIGKILL after --kill-after seconds, unless --on-lost=warn.]])
    :summary("Run a command while leading an election.")
  el:argument("name", "Election name.")
  el:argument("cmd", "The command and its arguments: every word after NAME, whatever it looks like "
    .. "(a -- right after NAME is skipped); mongolock's own options go before NAME.")
    :args("+")
  option(el, "elect", "--value", "The value published while this process leads (default: HOST:PID).")
  el:mutex(
    option(el, "elect", "-w --timeout", "Give up after waiting this many seconds to lead (0: one attempt, "
      .. "as -n; without -w or -n: wait for ever)."):convert(seconds_or_zero),
    el:flag("-n --nonblock", "Fail at once when another process leads (one attempt).")
  )
  option(el, "elect", "--ttl", "Lease length in seconds (1 to a year); renewed every ttl/3.", "30")
    :convert(at_least_second(at_most(seconds, YEAR, "a year")))
  option(el, "elect", "-E --conflict-exit-code", "Exit status when another leads (-n) or timed out.", "1")
    :convert(exit_code)
  option(el, "elect", "--on-lost", "What to do when the lead is lost: kill (end the command's process "
    .. "group) or warn (say so and let it run on).", "kill"):choices({ "warn", "kill" })
  option(el, "elect", "--kill-after", "With --on-lost=kill: seconds from SIGTERM to SIGKILL (at most "
    .. "ttl/2 - 0.1; cut to that).", "10")
    :convert(seconds_or_zero)
  option(el, "elect", "--lock-delay", "Seconds nobody may lead NAME after this leader's lease ended without "
    .. "a resignation (mongolock killed or cut off, or release --force), so that its command is gone "
    .. "first (default: --kill-after + 5; 0: none).")
    :convert(seconds_or_zero)
  el:flag("--release-on-exit", "Resign as soon as the command exits, even while processes it started go "
    .. "on in its process group (default: lead until the group is empty).")
  el:flag("-v --verbose", "Say on stderr when the lead is taken and given up, and which signals are forwarded.")

  local ld = p:command("leader", [[
Show the leader of the election NAME: its value, term (token), holder and
the time left on its lease; exit 0 when someone leads, 1 when nobody does.
With --watch, print the leader, then each change (a new leader, a new value,
no leader) as it happens, one line each, for -w seconds (then exit 0 when
someone led meanwhile, 1 when nobody did) or until interrupted.]])
    :summary("Show (or watch) the leader of an election.")
  ld:argument("name", "Election name.")
  ld:flag("--json", "One JSON object per line on stdout.")
  ld:flag("--watch", "Print each change of the leader as it happens.")
  option(ld, "leader", "-w --timeout", "With --watch: stop after this many seconds (default: never).")
    :convert(seconds)

  local s = p:command("status", [[
Show the state of the lock NAME (held, expired or free), its holder (the last
one when expired), token and lease.  Exit status 0 when it is held, 1 when it
is free or its lease expired (as for `flock -n`, scripts can test it).]])
    :summary("Show who holds a lock (exit 0 held, 1 free or expired).")
  s:argument("name", "Lock name.")
  s:flag("--json", "One JSON object on stdout.")

  local l = p:command("list", "List the locks of the collection: held, expired (with the last holder) or free.")
  l:flag("--json", "One JSON array on stdout.")

  local t = p:command("top", [[
A live view of the collection's locks: each lock's state, token, holder, time
left and queue length, with the waiters in its queue.  Refreshed by a change
stream of the collection (any write to a lock shows at once; an expiry, which
writes nothing, when its time runs out); polls every 2 seconds only where the
server has no change streams.  It never writes.  Into a pipe or a file
(stdout not a terminal) it writes plain snapshots, one per change, a blank
line apart, without the terminal's escapes.]])
    :summary("Watch the collection's locks live (--once: one snapshot).")
  t:flag("--once", "One snapshot, then exit.")
  t:flag("--json", "Each snapshot as one line of JSON on stdout.")
  option(t, "top", "--seconds", "Stop after this many seconds (default: until interrupted).")
    :convert(seconds)

  local r = p:command("release", [[
Release the lock NAME whoever holds it, for a person cleaning up after a
holder that cannot release it.  Its holder learns that it lost the lock at its
next renewal.  A lease taken with a lock-delay (exec's and elect's
--lock-delay) ends then without its holder's consent: nobody may take NAME
until the delay has passed, since the old holder's work may still be
running.  Asks for confirmation on stdin unless --yes is given.]])
    :summary("Force the release of a lock held by another process.")
  r:argument("name", "Lock name.")
  r:flag("--force", "Required: this releases a lock this process does not hold.")
  r:flag("-y --yes", "Do not ask for confirmation.")

  local w = p:command("wait", "Wait until the lock NAME is free (without taking it).")
  w:argument("name", "Lock name.")
  option(w, "wait", "-w --timeout", "Give up after this many seconds (0: look once; without -w: wait for ever).")
    :convert(seconds_or_zero)
  option(w, "wait", "-E --conflict-exit-code", "Exit status when timed out.", "1")
    :convert(exit_code)

  local d = p:command("demo", "Run the demo: worker processes incrementing one counter, with and without the lock.")
  d:argument("args", "Arguments for the demo."):args("*")

  return p
end

-- ---- helpers ---------------------------------------------------------------------

local core, mongolock, proc

-- a loader's whole message on one line (its cause follows its first line)
local function one_line(err)
  return (tostring(err):gsub("%s*\n%s*", " "))
end

local function load_core()
  if core then return end
  local ok, m = pcall(require, "mongolock")
  if not ok then fail(EXIT.software, "cannot load the mongolock module: %s", one_line(m)) end
  mongolock = m
  core = require "mongolock.core"
end

-- the command's child processes and signals (csrc/proc/proc.c)
local function load_proc()
  if proc then return proc end
  local ok, m = pcall(require, "mongolock.proc")
  if not ok then fail(EXIT.software, "cannot load the mongolock.proc module: %s", one_line(m)) end
  proc = m
  return proc
end

-- the server timeout in seconds: --server-timeout, else
-- MONGOLOCK_SERVER_TIMEOUT, else SERVER_TIMEOUT
-- SERVER_TIMEOUT; by default, wait -w S bounds its calls by S too (at
-- least a second: one round trip on a slow link), as it holds nothing
local function server_timeout(args)
  if args.server_timeout then return args.server_timeout end
  local env = getenv("MONGOLOCK_SERVER_TIMEOUT")
  if env and env ~= "" then
    local n, err = at_most(seconds, DAY, "a day")(env)
    if not n then fail(EXIT.usage, "MONGOLOCK_SERVER_TIMEOUT: %s", err) end
    return n
  end
  if args.command == "wait" and args.timeout then return min(SERVER_TIMEOUT, max(args.timeout, 1)) end
  return SERVER_TIMEOUT
end

-- the command's words for a library's complaint about an option value:
-- "--collection: collection must be ..." rather than "cli.lua:295: bad
-- argument #1 to 'locks' (collection must be ...)"
local OPTION_OF = { collection = "--collection", database = "--database", appname = "--app",
  app = "--app", server_timeout = "--server-timeout", ttl = "--ttl" }
local function option_error(e)
  local msg = tostring(e):match("^[^\n]*"):gsub("^[^:]*:%d+: ", "")
  msg = msg:match("^bad argument #%d+ to '[^']*' %((.*)%)$") or msg
  local opt = OPTION_OF[msg:match("^([%w_]+)")]
  return opt and (opt .. ": " .. msg) or msg
end

local function open_locks(args, more)
  load_core()
  local uri = args.uri or getenv("MONGODB_URI")
  if not uri or uri == "" then
    fail(EXIT.usage, "no server given: use --uri URI or set MONGODB_URI")
  end
  -- the library bounds every call by server_timeout, unless the URI gives
  -- serverSelectionTimeoutMS, connectTimeoutMS or socketTimeoutMS
  local copts = { appname = args.app, server_timeout = server_timeout(args) }
  for k, v in pairs(more or {}) do copts[k] = v end
  local ok, client, err = pcall(mongolock.connect, uri, copts)
  if not ok then fail(EXIT.usage, "%s", option_error(client)) end
  if not client then
    if tostring(err):match("^invalid URI") then fail(EXIT.usage, "%s", err) end
    fail(EXIT.unavailable, "cannot connect: %s", tostring(err))
  end
  local ok2, locks, err2 = pcall(client.locks, client, {
    database = args.database, collection = args.collection, ttl = args.ttl,
  })
  if not ok2 then fail(EXIT.usage, "%s", option_error(locks)) end
  if not locks then fail(EXIT.unavailable, "%s", tostring(err2)) end
  return client, locks
end

-- the subcommand running (set by main), for the command's words on a
-- usage failure
local running

-- the library's complaint about a name ("name is not valid UTF-8") in the
-- command's words: "the lock name is not valid UTF-8 (see 'mongolock
-- status --help')"
local NAME_SAYS = { ["name must not be empty"] = "is empty", ["name longer than 1024 bytes"] =
  "is longer than 1024 bytes", ["name contains a NUL byte"] = "contains a NUL byte",
  ["name is not valid UTF-8"] = "is not valid UTF-8" }
local function usage_words(msg)
  local what = msg:match("^bad argument #1 to '[^']*' %((.*)%)$")
  local says = what and NAME_SAYS[what]
  local help = running and format(" (see 'mongolock %s --help')", running) or ""
  if says then
    local noun = (running == "elect" or running == "leader") and "election" or "lock"
    return format("the %s name %s%s", noun, says, help)
  end
  return (msg:match("^bad argument #%d+ to '[^']*' %((.*)%)$") or msg) .. help
end

-- calls locks[method](locks, ...) turning a raised argument error (a bad
-- name) into a usage failure; any other error stays internal
local function call(locks, method, ...)
  local ok, a, b, c = pcall(locks[method], locks, ...)
  if not ok then
    local msg = tostring(a):match("^[^\n]*")
    if msg:find("bad argument", 1, true) then
      fail(EXIT.usage, "%s", usage_words((msg:gsub("^[^:]*:%d+: ", ""))))
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

-- v with every number that is not whole rounded to the millisecond (a
-- copy when a table): what the command prints as JSON, "remaining":6 and
-- not 5.9999869659999
local function json_ms(v)
  if type(v) == "number" then
    if v ~= v or v == huge or v == -huge or v == floor(v) then return v end
    return floor(v * 1000 + 0.5) / 1000
  elseif type(v) == "table" and getmetatable(v) == nil then
    local o = {}
    for k, x in pairs(v) do o[k] = json_ms(x) end
    return o
  end
  return v
end

local function json_out(v)
  local s, err = cjson.encode(json_ms(v))
  if not s then fail(EXIT.software, "cannot encode JSON: %s", err) end
  io.stdout:write(s, "\n")
end

-- ---- status, list ----------------------------------------------------------------

-- "held", "delayed" (its lease ended unreleased less than its lock-delay
-- ago: nobody may take it yet), "expired" (its holder neither released it
-- nor renewed it in time) or "free" (never taken, or released): the
-- library's st.state when it gives one, else from held and owner (a
-- released lock has no owner)
local function state_of(st)
  if not st then return "free" end
  if st.state == "held" or st.state == "expired" or st.state == "free" or st.state == "shared"
     or st.state == "permits" or st.state == "delayed" then return st.state end
  if st.held then return "held" end
  if st.owner ~= nil and type(st.expires_at) == "number" then return "expired" end
  return "free"
end

-- the status of name as one plain table (name, state and held always present)
local function status_record(name, st)
  local rec = { name = name, held = false }
  if st then
    for k, v in pairs(plain(st)) do rec[k] = v end
    rec.name = name
    rec.held = st.held and true or false
  end
  rec.state = state_of(st)
  return rec
end

-- the JSON form of a record: the token as a decimal string, as lua-cjson
-- writes at most 14 significant digits and tokens have 16; other numbers
-- to the millisecond
local function json_record(rec)
  local o = {}
  for k, v in pairs(rec) do o[k] = v end
  if type(o.token) == "number" then o.token = token_text(o.token) end
  return json_ms(o)
end

-- "in 12.3 s": the time left on a held lease, by the server's clock
local function until_text(rec)
  if rec.state ~= "held" then return nil end
  local rem = remaining_text(rec)
  return rem and ("in " .. rem) or nil
end

-- the shares and permits of a status of mongolock.shared, nil when it has
-- none (no share or permit held, no semaphore, nobody waiting for one)
local function shares_record(st)
  if not st or (st.in_use == 0 and not st.permits and (st.waiting or 0) == 0 and not st.delayed) then return nil end
  for _, h in ipairs(st.holders) do h.token = token_text(h.token) end
  st.token = token_text(st.token)
  return st
end

local function rwlocks_of(client, locks)
  return client:rwlocks({ database = locks.database, collection = locks.collection })
end

-- a name held by readers or permits only: "shared" or "permits"; kept by a
-- share's or permit's lock-delay only: "delayed" (rec's delay then the
-- shares')
local function shared_state(rec, shares)
  if rec.state == "held" or not shares then return rec.state end
  if shares.in_use == 0 and shares.delayed and not rec.delayed then
    rec.delayed, rec.delay = true, shares.delay
    return "delayed"
  end
  if shares.in_use == 0 then return rec.state end
  return shares.permits and "permits" or "shared"
end

-- "2 of 4 permits: host pid 1, host pid 2; 3 waiting"
local function shares_text(shares)
  local who = {}
  for i, h in ipairs(shares.holders) do who[i] = holder_text(h.holder) end
  local s = shares.permits and format("%d of %d permits", shares.in_use, shares.permits)
    or format("%d reader%s", shares.in_use, shares.in_use == 1 and "" or "s")
  if #who > 0 then s = s .. ": " .. concat(who, ", ") end
  if (shares.waiting or 0) > 0 then s = s .. format("; %d waiting", shares.waiting) end
  return s
end

-- seconds until the soonest live share or permit ends, or nil
local function soonest_end(shares)
  local soonest
  for _, h in ipairs(shares.holders) do
    if h.remaining and (not soonest or h.remaining < soonest) then soonest = h.remaining end
  end
  return soonest
end

-- the soonest end of a live share or permit, as "in 12.3 s"
local function shares_until(shares)
  local soonest = soonest_end(shares)
  return soonest and format("in %.1f s", soonest) or "-"
end

local function cmd_status(args)
  local client, locks = open_locks(args)
  local st, err = call(locks, "status", args.name)
  if st == nil and err ~= nil then fail(EXIT.unavailable, "status of %s: %s", args.name, tostring(err)) end
  local rec = status_record(args.name, st)
  local sst, serr = call(rwlocks_of(client, locks), "status", args.name)
  if sst == nil and serr ~= nil then fail(EXIT.unavailable, "status of %s: %s", args.name, tostring(serr)) end
  local shares = shares_record(sst)
  rec.state = shared_state(rec, shares)
  client:close()
  if args.json then
    local j = json_record(rec)
    j.shares = shares
    json_out(j)
  else
    local out = { format("lock      %s", rec.name), format("state     %s", rec.state) }
    if rec.state == "held" or rec.state == "expired" or rec.state == "delayed" then
      local when = until_text(rec)
      out[#out + 1] = format("holder    %s", holder_text(rec.holder))
      out[#out + 1] = format("owner     %s", tostring(rec.owner or "-"))
      out[#out + 1] = format("%s   %s%s", rec.state == "held" and "expires" or "expired",
        iso(rec.expires_at), when and (" (" .. when .. ")") or "")
    end
    if rec.delayed and rec.delay_until then
      out[#out + 1] = format("delayed   until %s (%.1f s left)", iso(rec.delay_until), rec.delay or 0)
    end
    if rec.token then out[#out + 1] = format("token     %s", token_text(rec.token)) end
    if rec.acquired_at then out[#out + 1] = format("acquired  %s", iso(rec.acquired_at)) end
    if (tonumber(rec.waiting) or 0) > 0 then out[#out + 1] = format("waiting   %d", rec.waiting) end
    if shares then
      out[#out + 1] = shares.permits and format("permits   %d of %d in use", shares.in_use, shares.permits)
        or format("readers   %d", shares.in_use)
      for _, h in ipairs(shares.holders) do
        out[#out + 1] = format("  %-7s %s token %s, %s", h.mode, holder_text(h.holder), h.token,
          h.remaining and format("%.1f s left", h.remaining) or "-")
      end
      if shares.waiting > 0 then
        out[#out + 1] = format("waiting   %d for %s", shares.waiting,
          shares.permits and "permits" or "shares")
      end
    end
    io.stdout:write(concat(out, "\n"), "\n")
  end
  if shares and shares.in_use > 0 then return EXIT.ok end
  return rec.state == "held" and EXIT.ok or EXIT.free
end

-- the widest cell of list's NAME and HOLDER columns, in bytes
local CELL_MAX = { 48, nil, nil, 120 }

local function cmd_list(args)
  local client, locks = open_locks(args)
  if type(locks.list) ~= "function" then fail(EXIT.software, "this version of the library has no locks:list()") end
  local all, err = call(locks, "list")
  if not all then fail(EXIT.unavailable, "list: %s", tostring(err)) end
  local sall, serr = call(rwlocks_of(client, locks), "list")
  if not sall then fail(EXIT.unavailable, "list: %s", tostring(serr)) end
  client:close()
  local recs, byname = {}, {}
  for _, st in ipairs(all) do
    local rec = status_record(st.name or st._id or st.id, st)
    recs[#recs + 1] = rec
    byname[rec.name] = rec
  end
  -- the shares, permits and their waiters of each name that has some
  for _, sst in ipairs(sall) do
    local shares = shares_record(sst)
    if shares then
      local rec = byname[sst.name]
      if not rec then
        rec = status_record(sst.name, nil)
        recs[#recs + 1] = rec
        byname[sst.name] = rec
      end
      rec.shares = shares
      rec.state = shared_state(rec, shares)
    end
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
    -- EXPIRES: time left on a held lease, or when an expired one ended
    local rows = { { "NAME", "STATE", "TOKEN", "HOLDER", "EXPIRES" } }
    for _, r in ipairs(recs) do
      local shown = r.state == "held" or r.state == "expired" or r.state == "delayed"
      local holder = shown and holder_text(r.holder) or "-"
      local expires = shown and (until_text(r) or iso(r.expires_at)) or "-"
      if r.delayed and r.delay then expires = format("delay %.1f s", r.delay) end
      if r.shares then
        holder = shown and (holder .. "; " .. shares_text(r.shares)) or shares_text(r.shares)
        if not shown then expires = shares_until(r.shares) end
      end
      rows[#rows + 1] = {
        tostring(r.name), r.state, r.token and token_text(r.token) or (r.shares and r.shares.token or "-"),
        holder,
        expires,
      }
    end
    -- a cell of a long name or holder is cut (--json has it whole), so
    -- that one row does not make every row hundreds of characters wide
    for _, row in ipairs(rows) do
      for i, c in ipairs(row) do
        local most = CELL_MAX[i]
        if most and #c > most then
          local cut = most - 3
          -- not inside a UTF-8 sequence
          while cut > 0 and (c:byte(cut + 1) or 0) >= 0x80 and c:byte(cut + 1) < 0xC0 do cut = cut - 1 end
          row[i] = c:sub(1, cut) .. "..."
        end
      end
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

-- ---- top ----------------------------------------------------------------------------

-- the waiters of every lock with a queue: name -> {{host, pid, app,
-- polling, remaining}}, live entries only, by the server's clock; one
-- aggregate (it reads, never writes), built and read by the core
local function top_waiters(client, locks)
  local r, err = client._core:run(core.op_queue_view{ db = locks.database, coll = locks.collection })
  if not r then return nil, err end
  return core.parse_queue_view(r)
end

-- one snapshot: {database, collection, locks = {record, ...}} sorted by
-- name; each record as list's, plus waiting (queue length) and waiters
local function top_snapshot(client, locks)
  local all, err = call(locks, "list")
  if not all then return nil, err end
  local waiters, werr = top_waiters(client, locks)
  if not waiters then return nil, werr end
  local recs = {}
  for _, st in ipairs(all) do
    local rec = status_record(st.name or st._id or st.id, st)
    rec.waiting = rec.waiting or 0
    rec.waiters = waiters[tostring(rec.name)] or {}
    if rec.state ~= "held" then rec.remaining = nil end
    -- a name in its lock-delay: LEFT counts the delay down
    if rec.delayed then rec.remaining = rec.delay end
    recs[#recs + 1] = rec
  end
  sort(recs, function(a, b) return tostring(a.name) < tostring(b.name) end)
  return { database = locks.database, collection = locks.collection, locks = recs }
end

-- a snapshot as one line of JSON (lua-cjson writes an empty table as {}:
-- the arrays are joined here)
local function top_json(snap)
  local parts = {}
  for i, rec in ipairs(snap.locks) do
    local o = json_record(rec)
    local ws = {}
    for j, w in ipairs(rec.waiters) do ws[j] = assert(cjson.encode(json_ms(w))) end
    o.waiters = nil
    local s = assert(cjson.encode(o))
    parts[i] = s:sub(1, -2) .. (s == "{}" and "" or ",") .. '"waiters":[' .. concat(ws, ",") .. "]}"
  end
  return format('{"database":%s,"collection":%s,"locks":[%s]}', cjson.encode(snap.database),
    cjson.encode(snap.collection), concat(parts, ","))
end

-- the text view of snap, its times counted down by `elapsed` seconds
local function top_text(snap, elapsed, how)
  local out = {}
  if how then out[1] = format("mongolock top  %s.%s  %s  (%s)\n", snap.database, snap.collection,
    os.date("%H:%M:%S"), how) end
  local rows = { { "NAME", "STATE", "TOKEN", "HOLDER", "LEFT", "QUEUE" } }
  local under = {}
  for _, r in ipairs(snap.locks) do
    local left = r.remaining and format("%.1f s", max(r.remaining - elapsed, 0)) or "-"
    rows[#rows + 1] = { tostring(r.name), r.state, r.token and token_text(r.token) or "-",
      r.state == "held" and holder_text(r.holder) or "-", left, tostring(r.waiting) }
    local lines = {}
    for i, w in ipairs(r.waiters) do
      lines[i] = format("    %d. %s%s", i, holder_text(w), w.polling and " (polling)" or "")
    end
    under[#rows] = lines
  end
  local width = {}
  for _, row in ipairs(rows) do
    for i, c in ipairs(row) do width[i] = max(width[i] or 0, #c) end
  end
  for n, row in ipairs(rows) do
    local cells = {}
    for i, c in ipairs(row) do cells[i] = i < #row and c .. (" "):rep(width[i] - #c) or c end
    out[#out + 1] = concat(cells, "  ") .. "\n"
    for _, l in ipairs(under[n] or {}) do out[#out + 1] = l .. "\n" end
  end
  return concat(out)
end

-- what a plain snapshot shows but its times: the same key, nothing new
local function top_key(snap)
  local parts = {}
  for _, r in ipairs(snap.locks) do
    parts[#parts + 1] = concat({ tostring(r.name), r.state, token_text(r.token), holder_text(r.holder),
      tostring(r.waiting) }, "\0")
    for _, w in ipairs(r.waiters) do parts[#parts + 1] = holder_text(w) .. (w.polling and " p" or "") end
  end
  return concat(parts, "\n")
end

-- seconds until the soonest lease or queue place of snap ends (an expiry
-- writes nothing, so no event tells it), or nil
local function top_next_end(snap)
  local soonest
  for _, r in ipairs(snap.locks) do
    if r.remaining then soonest = min(soonest or huge, r.remaining) end
    for _, w in ipairs(r.waiters) do
      if w.remaining then soonest = min(soonest or huge, w.remaining) end
    end
  end
  return soonest
end

local TOP_POLL = 2          -- seconds between reads without a change stream

local function cmd_top(args)
  local client, locks = open_locks(args)
  local cc = client._core
  local function snapshot()
    local snap, err = top_snapshot(client, locks)
    if not snap then fail(EXIT.unavailable, "top: %s", tostring(err)) end
    return snap, core.monotonic()
  end
  -- on a terminal each snapshot replaces the last, its countdown redrawn
  -- every second; into a pipe or a file the snapshots follow one another,
  -- plain, one per change and a blank line apart
  -- plain, one per change and a blank line apart (a renewal, which only
  -- moves a lease's end, or a poll that finds nothing new shows nothing)
  local live = not args.once and not args.json and load_proc().isatty(1)
  local shown
  local function show(snap, elapsed, how)
    if args.json then
      io.stdout:write(top_json(snap), "\n")
    elseif live then
      io.stdout:write("\27[H\27[2J", top_text(snap, elapsed, how))
    else
      local key = top_key(snap)
      if key == shown then return end
      io.stdout:write(shown and "\n" or "", top_text(snap, elapsed, not args.once and how or nil))
      shown = key
    end
    io.stdout:flush()
  end
  if args.once then
    show(snapshot(), 0)
    client:close()
    return EXIT.ok
  end
  local stop_at = args.seconds and core.monotonic() + args.seconds or huge
  -- the stream opens first, then the first read: no write in between is
  -- missed.  The core's change stream of every change of the collection
  -- (csrc/binding/views.c) says which command it needs; they run here.
  local stream = core.view_stream{ db = locks.database, coll = locks.collection }
  -- runs the stream's next command, a read waiting up to wait seconds:
  -- the number of changes it brought | nil, err
  local function step(wait)
    local op, due = stream:next(wait)
    if not op then
      if due == huge then return nil, select(2, stream:state()) or "the stream ended" end
      core.sleep(min(due, wait))
      return 0
    end
    local events, err = stream:done(cc:run(op))
    if events then return #events end
    -- a failed command: the machine resumes after its last resume token
    -- by itself unless it gave up
    local state, serr = stream:state()
    if state == "starting" or state == "running" then return 0 end
    return nil, serr or err
  end
  local streaming = step(0) ~= nil and stream:state() == "running"
  local how = streaming and "change stream" or format("no change stream: every %d s", TOP_POLL)
  local snap, at = snapshot()
  show(snap, 0, how)
  while core.monotonic() < stop_at do
    local now = core.monotonic()
    local ends = top_next_end(snap)
    local due = min(stop_at, ends and at + ends + 0.05 or huge, streaming and huge or now + TOP_POLL)
    local changed = false
    if streaming then
      -- a read waits for an event up to a second (the text view's
      -- countdown is redrawn in between)
      local wait_ms = floor(max(0, min(1, due - now)) * 1000)
      local n, err = step(max(wait_ms, 1) / 1000)
      if not n then
        warn("top: the change stream failed (%s): polling every %d s", tostring(err), TOP_POLL)
        streaming, how = false, format("no change stream: every %d s", TOP_POLL)
      else
        changed = n > 0
      end
    else
      core.sleep(max(0, min(1, due - now)))
    end
    if changed or core.monotonic() >= due then
      if core.monotonic() >= stop_at then break end
      snap, at = snapshot()
      show(snap, 0, how)
    elseif live then
      show(snap, core.monotonic() - at, how)
    end
  end
  -- the stream's last command ends its cursor (best effort; not after a
  -- failure, when the server may not answer)
  stream:close()
  local op = streaming and stream:next(0)
  if op then stream:done(cc:run(op)) end
  client:close()
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
  -- readers' shares and permits are held too: --force ends them all
  local rw = rwlocks_of(client, locks)
  local sst, serr = call(rw, "status", args.name)
  if sst == nil and serr ~= nil then fail(EXIT.unavailable, "status of %s: %s", args.name, tostring(serr)) end
  local shares = shares_record(sst)
  -- held: by a writer (an exclusive owner); shared: by readers or permits
  local held, shared = st and st.state == "held", shares and shares.in_use > 0
  if not (held or shared) then
    warn("%s is not held", args.name)
    client:close()
    return EXIT.conflict
  end
  if not args.yes then
    local by = held and format("held by %s (token %s)", holder_text(st.holder), token_text(st.token))
      or "held by " .. shares_text(shares)
    io.stderr:write(format("mongolock: release %s, %s? [y/N] ", args.name, by))
    io.stderr:flush()
    local answer = io.stdin:read("*l")
    if not (answer and answer:match("^%s*[yY]")) then
      warn("%s not released", args.name)
      client:close()
      return EXIT.conflict
    end
  end
  local ok, ferr
  if held then ok, ferr = call(locks, "force_release", args.name) end
  if shared and (ok or not held) then ok, ferr = call(rw, "force_release", args.name) end
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

-- ---- the server is unreachable ---------------------------------------------------------------

-- A wait that cannot reach the server says so on stderr, and why (the
-- driver's cause: a refused connection, a TLS handshake, a name, a
-- password): once when it has not reached it for NOTICE_AFTER seconds, then
-- every NOTICE_EVERY while that lasts.  notices(name) -> note(failure):
-- failure is {err, code} after a failed call, nil after an answer.
local NOTICE_AFTER, NOTICE_EVERY = 3, 60

local function unreachable_notices(name)
  local reached, next_at = core.monotonic(), nil
  return function(failure)
    local now = core.monotonic()
    if not failure then
      reached, next_at = now, nil
      return
    end
    if now - reached < NOTICE_AFTER or (next_at and now < next_at) then return end
    next_at = now + NOTICE_EVERY
    warn("the server is unreachable (%s); still waiting for %s", tostring(failure[1]), name)
  end
end

-- ---- wait -------------------------------------------------------------------------------

local function cmd_wait(args)
  local client, locks = open_locks(args)
  local rw = rwlocks_of(client, locks)
  local deadline = args.timeout and core.monotonic() + args.timeout or huge
  local step = 0.01
  local errors = require "mongolock.errors"
  -- a transient failure (an election, a closed socket, no server found:
  -- mongolock.errors.transient) is looked at again while a call (at most
  -- the server timeout) still ends before the deadline
  local bound = server_timeout(args)
  local note = unreachable_notices(args.name)
  local function failed(err, code)
    if errors.transient(code, err) and core.monotonic() + bound < deadline then
      note({ err, code })
      return true
    end
    fail(EXIT.unavailable, "cannot wait for %s: %s", args.name, tostring(err))
  end
  while true do
    local st, err, code = call(locks, "status", args.name)
    local sst, serr, scode
    local retry = st == nil and err ~= nil and failed(err, code)
    -- free: no exclusive holder, and no reader's share or permit either
    if not retry then
      sst, serr, scode = call(rw, "status", args.name)
      retry = sst == nil and serr ~= nil and failed(serr, scode)
    end
    if retry then
      core.sleep(min(step, max(deadline - core.monotonic(), 0)))
      step = min(step * 2, 1)
    else
      note(nil)
      local shares = shares_record(sst)
      local shared = shares and shares.in_use > 0
      if not (st and (st.held or st.delayed)) and not shared and not (shares and shares.delayed) then
        client:close()
        return EXIT.ok
      end
      local now = core.monotonic()
      if now >= deadline then
        client:close()
        return args.conflict_exit_code
      end
      -- back off, but look again when the lease (or the soonest share) is
      -- due to end
      local nap = step
      local rem = st and st.state == "held" and (st.remaining or (st.remaining_ms and st.remaining_ms / 1000))
        or st and st.delayed and st.delay
      local share_end = shared and soonest_end(shares) or shares and shares.delay
      if share_end and (not rem or share_end < rem) then rem = share_end end
      if rem and rem > 0 then nap = min(nap, rem + 0.005) end
      core.sleep(min(nap, deadline - now))
      step = min(step * 2, 0.5)
    end
  end
end

-- ---- exec ---------------------------------------------------------------------------------

-- the exit status of a caught signal, as a shell reports it
local function signal_status(name)
  return 128 + (SIGNO[name] or 0)
end

-- The wait step of the library's acquire, made to end on a caught signal:
-- it looks at the signals before and after each step, and no step sleeps
-- longer than SLICE, so a signal ends the wait within about SLICE seconds.
-- The acquire stays one call with one waiter id, so the command keeps its
-- place in the lock's queue for the whole wait (a slice that ends without
-- an event costs one attempt, which also renews the place).
local SLICE = 0.5
local INTERRUPTED = "interrupted by a signal"

local function interruptible(inner, caught, note)
  local function pending()
    for _, sig in ipairs(proc.signals()) do caught[#caught + 1] = sig end
    return caught[1] ~= nil
  end
  local w = setmetatable({}, { __index = inner })
  function w.sleep_until_retry(state)
    if pending() then return nil, INTERRUPTED end
    -- an outage's pause carries the failure it follows (mongolock.loop);
    -- a wait for a holder follows an answer
    if note then note(state.failure) end
    local deadline = state.deadline
    state.deadline = min(deadline, core.monotonic() + SLICE)
    local ok, err, code = inner.sleep_until_retry(state)
    state.deadline = deadline
    if ok == nil and err ~= nil then return nil, err, code end
    if pending() then return nil, INTERRUPTED end
    return true
  end
  return w
end

-- acquire(name, opts) with the interruptible wait step in place (the
-- library's locks.set_wait): h | nil, err, info; caught gets the signals
-- that ended it
local function acquire_interruptible(locks, name, opts, caught)
  local mod = require "mongolock.locks"
  local inner = mod.get_wait()
  mod.set_wait(interruptible(inner, caught, unreachable_notices(name)))
  local ok, h, err, info = pcall(call, locks, "acquire", name, opts)
  mod.set_wait(inner)
  if not ok then error(h, 0) end
  return h, err, info
end

-- NAME is another kind, or a semaphore of another N, than the options
-- ask for (the library's info.mismatch): a usage conflict, in the command's
-- words
local function mismatch(args, info)
  if args.permits and info.permits then
    fail(EXIT.usage, "semaphore %s has %d permits, not %d: every caller of %s must give --permits %d",
      args.name, info.permits, args.permits, args.name, info.permits)
  elseif info.permits then
    fail(EXIT.usage, "%s is a semaphore of %d permits, not a reader-writer lock: take it with --permits %d, "
      .. "not --shared", args.name, info.permits, info.permits)
  end
  fail(EXIT.usage, "%s is a reader-writer lock, not a semaphore: take a share with --shared, not --permits",
    args.name)
end

-- exec's and elect's lock-delay: --lock-delay, else the kill window plus
-- LOCK_DELAY_MARGIN seconds (doc/command.md); nil for hold (none)
local LOCK_DELAY_MARGIN = 5
local function lock_delay_of(args)
  if args.lock_delay then return args.lock_delay end
  if args.kill_after then return args.kill_after + LOCK_DELAY_MARGIN end
  return nil
end

-- waits for the lock the way flock(1) does: once (-n, -w 0), up to -w
-- seconds, or for ever.  Caught signals end the wait.  Returns the handle
-- (renewed every ttl/3 by the library's background renewal), or nil and an
-- exit status.
local function exec_acquire(args, locks)
  local opts = { ttl = args.ttl, renew = true, lock_delay = lock_delay_of(args) }
  local h, err, info
  local caught = {}
  if args.nonblock or args.timeout == 0 then
    h, err, info = call(locks, "try", args.name, opts)
    if not h and err == "busy" then return nil, args.conflict_exit_code end
  else
    opts.timeout = args.timeout or huge   -- for ever, as flock(1)
    h, err, info = acquire_interruptible(locks, args.name, opts, caught)
    if not h and err == "timeout" then return nil, args.conflict_exit_code end
    if not h and err == INTERRUPTED then return nil, signal_status(caught[1].name) end
  end
  if not h and type(info) == "table" and info.mismatch then mismatch(args, info) end
  if not h then fail(EXIT.unavailable, "cannot take %s: %s", args.name, tostring(err)) end
  -- a signal that came while the lock was being taken: nothing runs
  for _, sig in ipairs(proc.signals()) do caught[#caught + 1] = sig end
  if caught[1] then
    h:release()
    return nil, signal_status(caught[1].name)
  end
  return h
end

-- does the status of a reader-writer lock or semaphore (st) list h's
-- share or permit among the live ones?
local function holds_share(st, h)
  for _, x in ipairs(st and st.holders or {}) do
    if tostring(x.owner) == tostring(h.owner) then return true end
  end
  return false
end

-- why h was lost, in words, from the lock's status now (one call, bounded
-- by the server timeout): taken by another holder, released by someone
-- else (release --force), or not renewed in time (the lock still names
-- this holder, or the server cannot be asked)
local function lost_cause(args, h, locks)
  local not_renewed = format("no renewal succeeded within its ttl (%g s)", args.ttl)
  local ok, st, err = pcall(locks.status, locks, args.name)
  if not ok or (st == nil and err ~= nil) then
    return format("%s (the server: %s)", not_renewed, tostring(ok and err or st):match("^[^\n]*"))
  end
  if args.shared or args.permits then
    -- a share's status lists the live ones only: gone is released or ended
    if holds_share(st, h) then return not_renewed end
    return "it was released by another process (mongolock release --force) or its lease ended"
  end
  if st and st.owner ~= nil and tostring(st.owner) == tostring(h.owner) then return not_renewed end
  if st and st.state == "held" then
    return format("it is now held by %s (token %s)", holder_text(st.holder), token_text(st.token))
  end
  return "it was released by another process (mongolock release --force)"
end

-- ---- the end of a lease under exec and elect -----------------------------------------------
--
-- A holder cut off from the server (a frozen server or proxy, a network
-- that drops its packets) cannot learn that its lease ended: it must end
-- its command before the server's lease end, when another exec can start
-- its own.  h:remaining() counts down to the lease's local deadline, which
-- is never later than the server's lease end (doc/design.md, Local
-- deadline: the local monotonic time taken before the renewal was sent,
-- plus the ttl, less 1e-3 of the ttl and 2 ms for the two clocks' rates).
-- So, under --on-lost=kill, while no renewal has succeeded:
--   remaining <= kill_after + KILL_MARGIN  SIGTERM to the command's group
--   remaining <= KILL_MARGIN               SIGKILL to what remains of it
-- KILL_MARGIN covers this process's wake-up (it looks every LOOK seconds
-- at most, and wakes at the instant the next signal is due) and the time a
-- killed group takes to be gone.  The window (kill_after + KILL_MARGIN) is
-- at most half the ttl (kill_window), so a healthy lease, renewed when a
-- third of its ttl has passed, never reaches it: a longer --kill-after is
-- cut to fit.  doc/command.md gives the rule and its margins.
local KILL_MARGIN = 0.1
-- the longest the loop sleeps between two looks at the lease and signals
local LOOK = 0.05

-- the seconds from SIGTERM to SIGKILL: --kill-after, cut so that the
-- window fits in half the ttl
local function kill_window(args)
  return min(args.kill_after, max(0, args.ttl / 2 - KILL_MARGIN))
end
_M.kill_window = function(ttl, kill_after) return kill_window({ ttl = ttl, kill_after = kill_after }) end
_M.KILL_MARGIN = KILL_MARGIN

-- The cause of a loss is looked up beside the supervision, never before
-- the "lost" line or the kill: on a client of its own connected with a
-- scheduler (mongolock.sched's three functions) whose coroutine is the
-- lookup's, so each of its round trips is a job of that client's thread
-- and the coroutine yields while it runs; the supervising loop resumes it
-- every time around (at most LOOK seconds apart) and drops it after the
-- server timeout and a second.
local lookup_co   -- the lookup's coroutine while it runs
local LOOKUP_SCHEDULER = {
  current = function() return lookup_co ~= nil and coroutine.running() == lookup_co end,
  sleep = function(s) coroutine.yield(core.monotonic() + s) end,
  wait_fd = function(_, s) coroutine.yield(core.monotonic() + min(s, LOOK)) end,
}

-- starts the lookup of why h was lost: kind(args, client, locks) is the
-- object whose status(NAME) lost_cause reads, made on the lookup's client
local function lookup_start(args, h, kind)
  local co = coroutine.create(function()
    local client, locks = open_locks(args, { scheduler = LOOKUP_SCHEDULER, threads = 1 })
    return lost_cause(args, h, kind(args, client, locks))
  end)
  return { co = co, wake = 0, stop = core.monotonic() + server_timeout(args) + 1 }
end

-- one step of the lookup lk: false once it has ended (its answer said as
-- a second line, "lost the lock NAME: CAUSE") or was dropped
local function lookup_step(args, lk)
  local now = core.monotonic()
  if now >= lk.stop then return false end
  if now < lk.wake then return true end
  lookup_co = lk.co
  local ok, r = coroutine.resume(lk.co)
  lookup_co = nil
  if coroutine.status(lk.co) ~= "dead" then
    lk.wake = tonumber(r) or now
    return true
  end
  if ok and type(r) == "string" then warn("lost the lock %s: %s", args.name, r) end
  return false
end

-- runs argv as a child holding h (a handle renewed in the background),
-- until it ends; returns its exit status and whether the lease was lost
-- (and said so) meanwhile.  kind(args, client, locks): the object whose
-- status(NAME) tells why a lease was lost (exec's locks, elect's campaign).
local function supervise(args, h, argv, kind)
  -- the command learns which lock it runs under and its fencing token, to
  -- pass to the resources it writes (exact: a decimal string)
  -- the parent of what CMD's processes leave orphaned (proc.wait_group)
  proc.subreaper(true)
  -- a lock handed over by a release (a grant) comes with a lease of the
  -- waiter's place (queue_ttl), which the library tops up to the ttl
  -- shortly before it ends: the kill window would not fit in it, so it is
  -- extended to the ttl now, before the command starts
  local rem0 = h:remaining()
  if args.on_lost == "kill" and rem0 and rem0 < args.ttl * 2 / 3 then h:extend() end
  local pid, tty, errno = proc.spawn(argv, { MONGOLOCK_NAME = args.name, MONGOLOCK_TOKEN = h:token_string() })
  if not pid then
    warn("failed to execute %s", tty)
    return (errno == 2) and EXIT.notfound or EXIT.noexec, false
  end
  if args.verbose then
    warn("running %s (pid %d, process group %d%s) holding %s", argv[1], pid, pid,
      tty and ", given the terminal" or "", args.name)
  end

  local kill = args.on_lost == "kill"
  local kill_after = kill_window(args)
  if kill and args.verbose and kill_after < args.kill_after then
    warn("--kill-after %g does not fit a lease of %g s: %s gets %g s from SIGTERM to SIGKILL", args.kill_after,
      args.ttl, argv[1], kill_after)
  end
  -- how often h:lost() is looked at (h:lost() is a flag the renewal sets)
  local look = min(LOOK, args.ttl / 6)
  local lost, kill_at, lookup = false, nil, nil
  -- the command's exit status once it has ended (its group may live on)
  local status
  -- h's local deadline as last seen (monotonic), to tell a deadline that
  -- passed from a loss the server told
  local deadline = core.monotonic() + (h:remaining() or 0)

  local function done()
    -- the cause's lookup, if any, has the rest of its time to answer
    while lookup and lookup_step(args, lookup) do core.sleep(min(look, max(0, lookup.stop - core.monotonic()))) end
    return status, lost
  end

  while true do
    local wait = look
    local rem = not lost and h:remaining()
    if rem then
      deadline = core.monotonic() + rem
      if kill then wait = min(wait, max(0, rem - kill_after - KILL_MARGIN)) end
    end
    if kill_at then wait = min(wait, max(0, kill_at - core.monotonic())) end
    if status == nil then
      -- once the lease is lost under --on-lost=kill, what the command
      -- leaves in its group is killed when it ends
      local how, code, signo = proc.wait(pid, wait, (lost and kill) and "KILL" or nil)
      if how == "exit" then status = code end
      if how == "signal" then status = 128 + signo end
      if how == nil then fail(EXIT.software, "%s", tostring(code)) end
      if status ~= nil then
        -- the lock is held until the group is empty, as flock's descriptor
        -- is held by every process that inherited it (unless
        -- --release-on-exit)
        if args.release_on_exit or proc.wait_group(pid, 0) then return done() end
        if args.verbose then
          warn("%s exited; %s is held until the rest of its process group %d ends", argv[1], args.name, pid)
        end
      end
    elseif proc.wait_group(pid, wait) then
      return done()
    end

    for _, sig in ipairs(proc.signals()) do
      -- a terminal's key reached the child's group already when it has the
      -- terminal
      if sig.tty and tty then
        if args.verbose then warn("SIG%s came from the terminal, which sent it to %s too", sig.name, argv[1]) end
      else
        if args.verbose then warn("forwarding SIG%s to %s (process group %d)", sig.name, argv[1], pid) end
        proc.kill(pid, sig.name)       -- (nil, "...ESRCH": the group has just ended)
      end
    end

    -- lost: a renewal (or the server) found the lock gone, or its local
    -- deadline passed; under --on-lost=kill, its end is near and no
    -- renewal has succeeded: the command ends first (the rule above)
    if not lost then
      local now = core.monotonic()
      rem = h:remaining()
      local why
      if rem == nil or h:lost() then
        why = now >= deadline and format("no renewal succeeded within its ttl (%g s)", args.ttl)
          or "the server no longer has this holder's lease"
        kill_at = now + (now >= deadline and 0 or kill_after)
      elseif kill and rem <= kill_after + KILL_MARGIN then
        why = format("no renewal succeeded for %.1f s, and its lease ends in %.1f s", args.ttl - rem, rem)
        kill_at = now + max(0, rem - KILL_MARGIN)
      end
      if why then
        lost = true
        if kill then
          proc.kill(pid, "TERM")
          warn("lost the lock %s: %s; terminating %s (process group %d)", args.name, why, argv[1], pid)
        else
          kill_at = nil
          warn("lost the lock %s: %s; %s keeps running", args.name, why, argv[1])
        end
        lookup = lookup_start(args, h, kind)
      end
    end
    if kill_at and core.monotonic() >= kill_at then
      proc.kill(pid, "KILL")
      kill_at = nil
    end
    if lookup and not lookup_step(args, lookup) then lookup = nil end
  end
end

-- Ends the lease after the command: "released", "lost" or "not sent"
-- (failed, or unconfirmed: the server could not be asked), and
-- the exit status.  Says on stderr what happened unless it was a release
-- (then only with -v) or a loss already reported.
-- After a release that failed without an answer: did it reach the server
-- (its reply, and the retry's, may be what was lost)?  "applied" (the lock
-- no longer names this holder), "not applied" (it still does, held) or nil
-- (the server cannot be asked, or this kind has no status here).
local function release_applied(args, h, locks)
  local ok, st, err = pcall(locks.status, locks, args.name)
  if not ok or (st == nil and err ~= nil) then return nil end
  if args.shared or args.permits then return holds_share(st, h) and "not applied" or "applied" end
  if st and st.state == "held" and tostring(st.owner) == tostring(h.owner) then return "not applied" end
  return "applied"
end

local function finish_exec(args, h, code, lost, locks)
  local ok, err = h:release()
  local what
  local applied = not ok and not lost and err ~= "not held" and err ~= "lost" and not h:lost()
    and release_applied(args, h, locks)
  if ok or applied == "applied" then
    what = "released"
    if args.verbose then
      warn(ok and "released %s" or "released %s (the release's reply was lost; the lock no longer names "
        .. "this holder)", args.name)
    end
  elseif lost or err == "not held" or err == "lost" or h:lost() then
    what = "lost"
    if not lost then
      warn("lost the lock %s before the command ended (%s)", args.name, tostring(err))
    end
  elseif applied == "not applied" then
    what = "not sent"
    warn("release of %s failed (%s); the lock frees at the end of its lease (ttl %g s)",
      args.name, tostring(err), args.ttl)
  else
    what = "not sent"
    warn("release of %s unconfirmed (%s): if it did not reach the server, the lock frees at the end "
      .. "of its lease (ttl %g s)", args.name, tostring(err), args.ttl)
  end
  if code == 0 and what == "lost" then code = EXIT.lost end
  if code == 0 and what == "not sent" then code = EXIT.unavailable end
  return code, what
end

-- Returns the exit status and true: once the handle is released (or was
-- never taken) nothing needs the client closed, and the process exits
-- without waiting for the driver's threads (a change stream's read
-- after a wait awaits up to half the socket timeout, and a dead server's
-- call lasts up to the server timeout).
-- the object exec and hold take NAME from: locks, or with --shared or
-- --permits a reader's share or a permit (the same handles, taken by
-- mongolock.shared)
local function kind_of(args, client, locks)
  if not (args.shared or args.permits) then return locks end
  local o = { database = locks.database, collection = locks.collection }
  if args.permits then
    o.permits = args.permits
    return client:semaphores(o)
  end
  local rw = client:rwlocks(o)
  return { try = function(_, ...) return rw:try_read(...) end,
           acquire = function(_, ...) return rw:read(...) end,
           status = function(_, ...) return rw:status(...) end }
end

local function cmd_exec(args)
  local client, locks = open_locks(args)
  locks = kind_of(args, client, locks)
  load_proc().trap()
  local h, status = exec_acquire(args, locks)
  if not h then return status, true end
  if args.verbose then warn("took %s (token %s)", args.name, h:token_string()) end
  local code, lost = supervise(args, h, args.cmd, kind_of)
  return (finish_exec(args, h, code, lost, locks)), true
end

-- ---- hold ---------------------------------------------------------------------------------

-- takes NAME as exec does, prints its token (exact digits), and holds it
-- (renewed by the library's background renewal) until a trapped signal or
-- the end of stdin (when it is a pipe, a FIFO, a socket or the terminal),
-- then releases it: exit 0, 75 when the lease was lost meanwhile, 69 when
-- the release failed or is unconfirmed
local function cmd_hold(args)
  local client, locks = open_locks(args)
  locks = kind_of(args, client, locks)
  load_proc().trap()
  local h, status = exec_acquire(args, locks)
  if not h then return status, true end
  io.stdout:write(h:token_string(), "\n")
  io.stdout:flush()
  -- how often signals and h:lost() are looked at: a fraction of the
  -- renewal period
  local look = min(0.25, args.ttl / 6)
  local watching = proc.wait_input(0) ~= nil
  if args.verbose then
    warn("took %s (token %s); holding it until SIGINT, SIGTERM or SIGHUP%s", args.name, h:token_string(),
      watching and " or the end of stdin" or "")
  end
  local lost = false
  while true do
    local got = watching and proc.wait_input(look)
    if got == nil then watching = false end
    if not watching then core.sleep(look) end
    local sig = proc.signals()[1]
    if got == "eof" or sig then
      if args.verbose then warn("%s: releasing %s", sig and ("SIG" .. sig.name) or "end of stdin", args.name) end
      break
    end
    if h:lost() then
      lost = true
      warn("lost the lock %s: %s", args.name, lost_cause(args, h, locks))
      break
    end
  end
  return (finish_exec(args, h, 0, lost, locks)), true
end

-- ---- elect, leader --------------------------------------------------------------------------

local function elections_of(client, locks, ttl)
  local ok, el = pcall(client.elections, client, { database = locks.database,
    collection = locks.collection, ttl = ttl })
  if not ok then fail(EXIT.usage, "%s", option_error(el)) end
  return el
end

-- this process's default value: HOST:PID
local function default_value()
  local f = io.open("/proc/sys/kernel/hostname", "r")
  local host = f and f:read("*l") or "localhost"
  if f then f:close() end
  return format("%s:%d", host, core.getpid())
end

-- exec, as the leader of the election args.name: the lock's handle is the
-- leader's, taken by a campaign that publishes args.value
local function cmd_elect(args)
  local client, locks = open_locks(args)
  local el = elections_of(client, locks, args.ttl)
  local value = args.value or default_value()
  local campaign = {
    try = function(_, name, opts)
      local o = { ttl = opts.ttl, renew = opts.renew, timeout = 0, lock_delay = opts.lock_delay }
      local h, err, info = el:campaign(name, value, o)
      if err == "timeout" then err = "busy" end
      return h, err, info
    end,
    acquire = function(_, name, opts) return el:campaign(name, value, opts) end,
    status = function(_, name) return el:status(name) end,
  }
  load_proc().trap()
  local h, status = exec_acquire(args, campaign)
  if not h then return status, true end
  if args.verbose then warn("leading %s (term %s, value %s)", args.name, h:token_string(), value) end
  -- the lookup of a loss's cause: the election's status on the lookup's client
  local function status_of(_, client2, locks2)
    local el2 = elections_of(client2, locks2, args.ttl)
    return { status = function(_, name) return el2:status(name) end }
  end
  local code, lost = supervise(args, h, args.cmd, status_of)
  return (finish_exec(args, h, code, lost, campaign)), true
end

-- a leader's info (el:leader, or a change of el:observe) as one plain table
local function leader_record(name, info)
  local rec = { name = name, leader = info ~= nil and info.leader ~= false }
  if info then
    for k, v in pairs(plain(info)) do rec[k] = v end
    rec.name = name
    rec.leader = info.leader ~= false
  end
  return rec
end

local function leader_text(rec)
  local head = rec.change and (rec.change .. ": ") or ""
  if not rec.leader then return head .. "no leader of " .. rec.name end
  return format("%sleader of %s: %s (term %s, %s%s)", head, rec.name, tostring(rec.value or "-"),
    token_text(rec.token), holder_text(rec.holder),
    type(rec.remaining) == "number" and format(", %.1f s left", rec.remaining) or "")
end

local function print_leader(args, rec)
  if args.json then json_out(json_record(rec))
  else io.stdout:write(leader_text(rec), "\n") end
  io.stdout:flush()
end

local function cmd_leader(args)
  local client, locks = open_locks(args)
  local el = elections_of(client, locks)
  if not args.watch then
    local info, err = call(el, "leader", args.name)
    if info == nil and err ~= nil then fail(EXIT.unavailable, "leader of %s: %s", args.name, tostring(err)) end
    print_leader(args, leader_record(args.name, info))
    client:close()
    return info and EXIT.ok or EXIT.free
  end
  -- --watch: until -w passes or a signal comes (looked at every SLICE)
  load_proc().trap()
  local stop = args.timeout and core.monotonic() + args.timeout or huge
  local it = call(el, "observe", args.name, { timeout = SLICE })
  -- whether anyone led while it watched: with -w, the exit status (1:
  -- nobody led in time)
  local led = false
  while true do
    local sig = proc.signals()[1]
    if sig then
      it:close()
      return signal_status(sig.name), true
    end
    if core.monotonic() >= stop then break end
    local ch, err = it()
    if ch then
      local rec = leader_record(args.name, ch)
      led = led or rec.leader
      print_leader(args, rec)
    elseif err ~= "timeout" then
      fail(EXIT.unavailable, "watching %s: %s", args.name, tostring(err))
    end
  end
  it:close()
  return led and EXIT.ok or EXIT.free, true
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
  -- the demo's processes find this process's modules and server; a
  -- MONGODB_URI of the environment is inherited, never written on a
  -- command line (ps would show its password)
  local argv = { "env", "LUA_PATH=" .. package.path, "LUA_CPATH=" .. package.cpath }
  if args.uri then argv[#argv + 1] = "MONGODB_URI=" .. uri end
  argv[#argv + 1] = interpreter(info.arg)
  argv[#argv + 1] = script
  for _, a in ipairs(args.args) do argv[#argv + 1] = a end
  load_proc().trap()
  local pid, tty, errno = proc.spawn(argv)
  if not pid then
    warn("failed to execute %s", tty)
    return (errno == 2) and EXIT.notfound or EXIT.noexec
  end
  while true do
    local how, code, signo = proc.wait(pid, 3600)
    if how == "exit" then return code end
    if how == "signal" then return 128 + signo end
    if how == nil then fail(EXIT.software, "%s", tostring(code)) end
    for _, sig in ipairs(proc.signals()) do
      if not (sig.tty and tty) then proc.kill(pid, sig.name) end
    end
  end
end

-- ---- main ----------------------------------------------------------------------------------

local commands = {
  exec = cmd_exec, elect = cmd_elect, leader = cmd_leader, status = cmd_status, list = cmd_list,
  top = cmd_top, hold = cmd_hold,
  release = cmd_release, wait = cmd_wait, demo = cmd_demo,
}

-- The words for argparse: each option value joined to its option
-- (--ttl=-1, -w-1), so that a value starting with "-" is read as a value;
-- and for exec, "--" right after NAME, so that everything after NAME is the
-- command (flock(1), env(1), timeout(1) stop at the command the same way).
-- Also returns the command word found (for the help hint) and, when the
-- last word is an option still missing its value, that option.
local function prepare(list)
  local out, where, i = {}, "", 1
  local valued = VALUED[""]
  while i <= #list do
    local w = list[i]
    if w == "--" then                          -- the rest is positional already
      for j = i, #list do out[#out + 1] = list[j] end
      break
    elseif w:sub(1, 2) == "--" then
      if valued[w] and list[i + 1] ~= nil then
        w = w .. "=" .. list[i + 1]
        i = i + 1
      end
      out[#out + 1] = w
    elseif w:sub(1, 1) == "-" and #w > 1 then
      -- short options bundled (-nv, -w5): a valued one takes the rest of
      -- the word, else the next word
      local last = "-" .. w:sub(-1)
      local bundled = false
      for k = 2, #w - 1 do
        if valued["-" .. w:sub(k, k)] then bundled = true; break end
      end
      if not bundled and valued[last] and list[i + 1] ~= nil then
        w = w .. list[i + 1]
        i = i + 1
      end
      out[#out + 1] = w
    elseif where == "" and commands[w] then
      -- the command; the global options are still known after it
      where = w
      valued = {}
      for k, v in pairs(VALUED[""]) do valued[k] = v end
      for k, v in pairs(VALUED[w] or {}) do valued[k] = v end
      out[#out + 1] = w
    elseif where == "exec" or where == "elect" then
      -- NAME: what follows is the command, after one "--"
      out[#out + 1] = w
      if list[i + 1] ~= "--" then out[#out + 1] = "--" end
      for j = i + 1, #list do out[#out + 1] = list[j] end
      break
    else
      out[#out + 1] = w
    end
    i = i + 1
  end
  return out, where
end

-- parse(argv) -> args | nil, message, help: argv parsed as the command
-- line of mongolock (help: the command whose --help to point at)
function _M.parse(argv)
  local list = {}
  for i = 1, #argv do list[i] = argv[i] end
  local parser = _M.parser()
  local words, where = prepare(list)
  local ok, args = parser:pparse(words)
  if ok then return args end
  local msg = args:gsub("\n", "; ")
  -- an option of mongolock's own (not of the command) is explained by
  -- mongolock --help
  local opt = msg:match("^(%-%-[%w-]+): ") or msg:match("option '([^']+)'")
  local help = where ~= "" and ("mongolock " .. where .. " --help") or "mongolock --help"
  if opt and VALUED[""][opt] then help = "mongolock --help" end
  return nil, msg, help
end

-- main(argv, info) -> exit status, quick.  argv: the arguments (arg of the
-- script); info.root: the source tree the launcher runs from, if any.
-- quick: nothing is held, the process may exit without closing the Lua
-- state (else closing it releases what a failure left held, by __gc).
function _M.main(argv, info)
  info = info or {}
  info.arg = info.arg or argv
  local args, msg, help = _M.parse(argv)
  if not args then
    io.stderr:write(format("mongolock: %s (see '%s')\n", msg, help))
    return EXIT.usage
  end
  local command = commands[args.command]
  running = args.command
  local done, code, quick = xpcall(function() return command(args, info) end, function(e)
    if getmetatable(e) == failure_mt then return e end
    if getenv("MONGOLOCK_DEBUG") then io.stderr:write(debug.traceback(tostring(e), 2), "\n") end
    return setmetatable({ code = EXIT.software, msg = "internal error: " .. tostring(e):match("^[^\n]*") }, failure_mt)
  end)   -- (Lua 5.1's xpcall passes no arguments)
  if not done then
    io.stderr:write("mongolock: " .. code.msg .. "\n")
    return code.code
  end
  return code, quick
end

return _M
