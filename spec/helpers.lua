-- Fixtures shared by every spec: the server URI, fresh names, clients and
-- child processes.
--
--   local helpers = require "spec.helpers"   (or require "helpers")
--   helpers.uri()            MONGODB_URI, or a stand-in started for this run
--   helpers.standin          true when the server is the stand-in
--   helpers.connect(opts)    a mongolock client on helpers.uri()
--   helpers.unique(prefix)   a name no other test (or earlier run) uses
--   helpers.lua              the interpreter running the specs ("lua5.4", "luajit")
--   helpers.script(src)      writes a Lua script to a temporary file, returns its path
--   helpers.spawn(path, ...) starts it as a separate OS process in the background
--   helpers.opcounters(c)    serverStatus opcounters as one table of numbers
--   helpers.proxy()          a TCP proxy to the server that can be frozen (spec/proxy.js)
--                            (the specs' hooks are require "mongolock.testing",
--                            csrc/testing/testing.c, built next to the core)
--
-- When MONGODB_URI is unset, the stand-in (tools/mongo-standin/server.js) is
-- started on a free loopback port the first time uri() is called and stopped
-- when the Lua state closes (or by a watchdog when this process dies); with
-- MONGOLOCK_NO_SERVER=1 (make test's run of the #unit specs) uri() raises
-- instead.

local helpers = {}

-- the specs' own process prints its C backtrace if it dies of a signal, as
-- every child does (helpers.command): a crash in busted's process otherwise
-- leaves only "Segmentation fault" in the lane's log
pcall(function() require("mongolock.testing").crash_trace() end)

-- ---- busted: a block's setup and teardown only when one of its tests runs --
--
-- busted runs `setup` and `teardown` of every describe block, even when
-- --tags or --filter selected none of its tests: `busted --tags=unit spec`
-- would then connect to a server in the setup of an #integration block and
-- judge its teardown.  Every spec file that needs a server requires this
-- module at its top, so this module makes `setup` and `teardown` of the file
-- busted's `lazy_setup` and `lazy_teardown` (what `busted --lazy` does):
-- they run before the block's first selected test and after its last, and
-- not at all when no test of the block is selected.  The requiring file's
-- environment is busted's (its _ENV upvalue, or getfenv under Lua 5.1); the
-- files that start after it get the same from a 'file start' subscriber, in
-- case this module stays loaded between files (busted --no-auto-insulate).
local function lazy_fixtures()
  local getfenv = rawget(_G, "getfenv")
  for level = 3, 16 do
    local info = debug.getinfo(level, "f")
    if not info then return false end
    local env
    if getfenv then
      env = getfenv(info.func)
    else
      for i = 1, 255 do
        local name, value = debug.getupvalue(info.func, i)
        if not name then break end
        if name == "_ENV" then env = value; break end
      end
    end
    if type(env) == "table" and env ~= _G and type(env.lazy_setup) == "function" then
      env.setup, env.teardown = env.lazy_setup, env.lazy_teardown
      return true
    end
  end
  return false
end
helpers.lazy_fixtures = lazy_fixtures()

do
  local ok, busted = pcall(require, "busted")
  local registry = debug.getregistry()
  if ok and type(busted) == "table" and type(busted.lazy_setup) == "function"
      and not registry["mongolock.spec.lazy"] then
    registry["mongolock.spec.lazy"] = true
    busted.subscribe({ "file", "start" }, function(file)
      file.env = file.env or {}
      file.env.setup, file.env.teardown = busted.lazy_setup, busted.lazy_teardown
    end)
  end
end

local getenv = os.getenv
local format = string.format

local function root()
  local r = getenv("MONGOLOCK_ROOT")
  if r and r ~= "" then return r end
  -- spec/helpers.lua lives one level below the root
  local src = debug.getinfo(1, "S").source
  local dir = src:match("^@(.*)/spec/[^/]*$")
  if dir and dir ~= "" then return dir end
  return "."
end
helpers.root = root()

-- (and the name of its build tree: build/<lua>/)
helpers.lua = (rawget(_G, "jit") and "luajit") or ("lua" .. _VERSION:match("%d+%.%d+"))

local function shell_quote(s)
  return "'" .. tostring(s):gsub("'", [['\'']]) .. "'"
end
helpers.shell_quote = shell_quote

local function tmpname()
  local n = os.tmpname()
  return n
end

-- ---- the server -----------------------------------------------------------

local uri = getenv("MONGODB_URI")
if uri == "" then uri = nil end
helpers.standin = getenv("MONGOLOCK_STANDIN") == "1"

local function sleep(s)
  os.execute("sleep " .. s)
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end
helpers.read_file = read_file

-- starts a stand-in with extra arguments (a list, quoted here); returns
-- its address "127.0.0.1:PORT" and records its pid for the reaper
local standins, files_to_remove = {}, {}
local function start_standin(args)
  local server = helpers.root .. "/tools/mongo-standin/run"
  local log = tmpname()
  files_to_remove[#files_to_remove + 1] = log
  local extra = {}
  for i, a in ipairs(args or {}) do extra[i] = shell_quote(a) end
  -- In the shell started by popen, $PPID is this Lua process: the watchdog
  -- stops the server when this process goes away without running its __gc.
  local cmd = format([[
%s --port 0 %s >%s 2>&1 &
n=$!
echo $n
L=$PPID
( while kill -0 $L 2>/dev/null && kill -0 $n 2>/dev/null; do sleep 1; done; kill $n 2>/dev/null ) \
  >/dev/null 2>&1 </dev/null &
]], shell_quote(server), table.concat(extra, " "), shell_quote(log))
  local p = assert(io.popen(cmd, "r"))
  local pid = tonumber(p:read("*l"))
  p:close()
  assert(pid, "could not start the stand-in")
  standins[#standins + 1] = pid
  for _ = 1, 400 do
    local out = read_file(log) or ""
    local addr = out:match("listening (%S+)")
    if addr then return addr end
    if not os.execute(format("kill -0 %d 2>/dev/null", pid)) then
      break
    end
    sleep(0.05)
  end
  error("the stand-in did not start: " .. (read_file(log) or "no output"))
end

-- stops the stand-in we started, when the Lua state closes
local reaper = setmetatable({}, { __gc = function()
  for i, pid in ipairs(standins) do
    os.execute(format("kill %d 2>/dev/null", pid))
    standins[i] = nil
  end
  for i, f in ipairs(files_to_remove) do
    os.execute(format("rm -rf %s", shell_quote(f)))
    files_to_remove[i] = nil
  end
end })
helpers._reaper = reaper

function helpers.uri()
  if not uri then
    -- make test's run of the #unit specs: a test that needs a server is
    -- tagged #integration
    if getenv("MONGOLOCK_NO_SERVER") == "1" then
      error("MONGOLOCK_NO_SERVER=1 and no MONGODB_URI: a test without a server asked for one", 2)
    end
    uri = format("mongodb://%s/?replicaSet=rs0", start_standin())
    helpers.standin = true
    -- children spawned by the specs find the same server
    helpers.child_env = "MONGODB_URI=" .. shell_quote(uri) .. " MONGOLOCK_STANDIN=1 "
  end
  return uri
end

helpers.child_env = ""

-- helpers.uri() with extra URI options appended ({heartbeatFrequencyMS=...})
function helpers.uri_with(opts)
  local u = helpers.uri()
  local parts = {}
  for k, v in pairs(opts) do parts[#parts + 1] = k .. "=" .. tostring(v) end
  table.sort(parts)
  local sep = u:find("?", 1, true) and "&" or (u:match("/$") and "?" or "/?")
  return u .. sep .. table.concat(parts, "&")
end

-- ---- a path to the server that can be frozen (spec/proxy.js) ------------
--
-- helpers.proxy() -> p: a TCP proxy to the server's primary, in a process
-- of its own.  p.uri: helpers.uri() through it (the same credentials and
-- options, directConnection=true: a replica set's members are not looked
-- up, so nothing goes around the proxy); p.pid; p:freeze() stops the
-- process (SIGSTOP: every connection through it, open or new, carries
-- nothing, as a server that stopped answering); p:thaw() continues it;
-- p:stop() kills it (also when the Lua state closes).
local Proxy = {}
Proxy.__index = Proxy
local proxies = {}

function Proxy:freeze() os.execute(format("kill -STOP %d 2>/dev/null", self.pid)) end
function Proxy:thaw() os.execute(format("kill -CONT %d 2>/dev/null", self.pid)) end
function Proxy:stop()
  if self.stopped then return end
  self.stopped = true
  os.execute(format("kill -KILL %d 2>/dev/null", self.pid))
  os.remove(self.log)
end

function helpers.proxy()
  local u = helpers.uri()
  local scheme, userinfo, hosts, rest = u:match("^(mongodb://)([^@/]*@?)([^/?]*)(.*)$")
  assert(scheme, "helpers.proxy: a mongodb:// URI expected (not mongodb+srv://)")
  if not userinfo:find("@", 1, true) then hosts, userinfo = userinfo .. hosts, "" end
  -- the primary: the one host, else the server's own answer
  local target = hosts
  if hosts:find(",", 1, true) or rest:find("replicaSet=", 1, true) then
    local c = helpers.connect()
    local r = c._core:command("admin", { hello = 1 })
    target = r and r.primary or hosts:match("^[^,]+")
    c:close()
  end
  local path, query = rest:match("^(/?[^?]*)%??(.*)$")
  local opts = {}
  for kv in query:gmatch("[^&]+") do
    local k = kv:match("^[^=]*"):lower()
    if k ~= "replicaset" and k ~= "directconnection" then opts[#opts + 1] = kv end
  end
  opts[#opts + 1] = "directConnection=true"
  local log = tmpname()
  local p = assert(io.popen(format("node %s %s >%s 2>&1 </dev/null & echo $!",
    shell_quote(helpers.root .. "/spec/proxy.js"), shell_quote(target), shell_quote(log))))
  local pid = tonumber(p:read("*l"))
  p:close()
  local self = setmetatable({ pid = pid, log = log }, Proxy)
  proxies[#proxies + 1] = self
  local addr
  for _ = 1, 400 do
    addr = (read_file(log) or ""):match("listening (%S+)")
    if addr then break end
    sleep(0.05)
  end
  if not addr then
    self:stop()
    error("the proxy did not start: " .. (read_file(log) or "no output"))
  end
  self.uri = format("%s%s%s%s?%s", scheme, userinfo, addr, path ~= "" and path or "/", table.concat(opts, "&"))
  return self
end

helpers._proxy_reaper = setmetatable({}, { __gc = function()
  for _, p in ipairs(proxies) do p:stop() end
end })

-- ---- a server with credentials and TLS (spec/auth_spec.lua) ----------------
--
-- helpers.secure() -> s | nil, why.  s.uri: a URI with the credentials of a
-- user who may read and write helpers.database (and the nginx example's
-- database) and tls=true&tlsCAFile=...; s.ro_uri: the same for a user who
-- may only read helpers.database (nil: not given); s.password: the first
-- user's password (what must never show); s.wrong_password_uri: s.uri with
-- another password; s.untrusted_uri: s.uri with a CA that signed nothing.
--   - MONGODB_AUTH_URI (and MONGODB_AUTH_RO_URI) set: those (a real MongoDB
--     with its users and certificates made by hand);
--   - else, when the specs run against the stand-in (MONGODB_URI unset, or
--     set by tools/with-standin): a second stand-in with --user and TLS, on
--     a certificate authority made now by make-test-certs;
--   - else (a real MongoDB without MONGODB_AUTH_URI): nil, why.

local function pct_encode(s)
  return (s:gsub("[^%w%-%._~]", function(c) return format("%%%02X", c:byte()) end))
end
local function pct_decode(s)
  return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end
helpers.pct_encode = pct_encode

local function random_hex(n)
  local f = assert(io.open("/dev/urandom", "rb"))
  local b = f:read(n)
  f:close()
  return (b:gsub(".", function(c) return format("%02x", c:byte()) end))
end

-- uri with its password replaced by pwd, or its tlsCAFile by ca
local function with_password(u, pwd)
  return (u:gsub("^(mongodb%+?s?r?v?://[^:/@]*:)[^@/]*@", function(head) return head .. pct_encode(pwd) .. "@" end))
end
local function with_ca(u, ca)
  return (u:gsub("([?&][tT][lL][sS][cC][aA][fF][iI][lL][eE]=)[^&]*", "%1" .. pct_encode(ca):gsub("%%", "%%%%")))
end

local secure, secure_why
function helpers.secure()
  if secure ~= nil or secure_why then return secure, secure_why end
  local given = getenv("MONGODB_AUTH_URI")
  local certs = tmpname()
  os.remove(certs)
  files_to_remove[#files_to_remove + 1] = certs
  local function make_certs()
    local ok = os.execute(format("%s/tools/mongo-standin/make-test-certs %s",
      shell_quote(helpers.root), shell_quote(certs)))
    assert(ok == true or ok == 0, "make-test-certs failed")
  end
  if given and given ~= "" then
    make_certs()      -- only other-ca.pem is used
    local pwd = given:match("^mongodb%+?s?r?v?://[^:/@]*:([^@/]*)@")
    assert(pwd, "MONGODB_AUTH_URI has no password")
    local ro = getenv("MONGODB_AUTH_RO_URI")
    secure = { uri = given, ro_uri = ro ~= "" and ro or nil, password = pct_decode(pwd) }
  elseif uri and not helpers.standin then
    secure_why = "a real MongoDB (MONGODB_URI) without MONGODB_AUTH_URI: set MONGODB_AUTH_URI (a user that "
      .. "may read and write " .. helpers.database .. ", with tls=true&tlsCAFile=...) and MONGODB_AUTH_RO_URI"
    return nil, secure_why
  else
    make_certs()
    -- passwords with characters a URI must escape
    local pwd, ro_pwd = "pw:" .. random_hex(8) .. "/@%", "ro:" .. random_hex(8)
    local roles = format("readWrite@%s,readWrite@mongolock_example,readWrite@mongolock", helpers.database)
    -- the users from a file: no password on any command line
    local users = certs .. "/users"
    local f = assert(io.open(users, "w"))
    f:write("locker:", pwd, ":", roles, "\n", "reader:", ro_pwd, ":read@", helpers.database, "\n")
    f:close()
    local addr = start_standin({ "--users-file", users,
      "--tls-cert", certs .. "/server.pem", "--tls-key", certs .. "/server-key.pem" })
    local tls = "&tls=true&tlsCAFile=" .. pct_encode(certs .. "/ca.pem")
    secure = {
      uri = format("mongodb://locker:%s@%s/?replicaSet=rs0%s", pct_encode(pwd), addr, tls),
      ro_uri = format("mongodb://reader:%s@%s/?replicaSet=rs0%s", pct_encode(ro_pwd), addr, tls),
      password = pwd,
    }
  end
  secure.wrong_password_uri = with_password(secure.uri, "wrong-" .. random_hex(4))
  secure.untrusted_uri = with_ca(secure.uri, certs .. "/other-ca.pem")
  assert(secure.wrong_password_uri ~= secure.uri and secure.untrusted_uri ~= secure.uri)
  return secure
end

-- ---- names and clients ----------------------------------------------------

local seq = 0
local seed
function helpers.unique(prefix)
  if not seed then
    local f = io.open("/dev/urandom", "rb")
    local b = f and f:read(6) or tostring(os.time())
    if f then f:close() end
    seed = b:gsub(".", function(c) return format("%02x", c:byte()) end)
  end
  seq = seq + 1
  return format("%s-%s-%d", prefix or "t", seed, seq)
end

local clients = setmetatable({}, { __mode = "k" })

function helpers.connect(opts, at)
  local mongolock = require "mongolock"
  local c = assert(mongolock.connect(at or helpers.uri(), opts))
  clients[c] = true
  return c
end

-- database the specs use: the URI's, else mongolock's default
helpers.database = "mongolock_test"

-- a locks object on a fresh collection, so that tests do not see each other
function helpers.locks(client, opts)
  opts = opts or {}
  local o = { database = helpers.database, collection = helpers.unique("locks") }
  for k, v in pairs(opts) do o[k] = v end
  return client:locks(o)
end

-- ---- forked children ------------------------------------------------------
--
-- A child forked while libmongoc's process-wide lock was held can never use
-- the driver (README, Limitations: Fork): its driver calls raise.  A fork
-- spec's child ends with helpers.child_exit, which tells that case apart
-- (exit status FORK_LOCKED), and its parent waits with helpers.wait_child,
-- which makes the test pending on that status: the limitation, not a
-- failure of what the test looks at (locks_process_spec tests the refusal
-- itself).
helpers.FORK_LOCKED = 75

-- ends a forked child: status 0 when ok and code == 0; else FORK_LOCKED when
-- a driver call of client raises the refusal, else code (or 99)
function helpers.child_exit(client, ok, code)
  local testing = require "mongolock.testing"
  if not (ok and code == 0) then
    local locks = client:locks({ database = helpers.database, collection = "fork_probe" })
    local pok, err = pcall(locks.status, locks, "x")
    if not pok and tostring(err):find("lock was held when this process forked", 1, true) then
      testing.exit(helpers.FORK_LOCKED)
    end
  end
  testing.exit(ok and code or 99)
end

-- a forked child's exit status (testing.waitpid).  A child refused the
-- driver: cleanup() (when given), then the test ends as pending through
-- pending, the spec's busted function (it throws)
function helpers.wait_child(pid, timeout, pending, cleanup)
  local st, err = require("mongolock.testing").waitpid(pid, timeout)
  if st == helpers.FORK_LOCKED then
    if cleanup then cleanup() end
    pending("libmongoc's lock was held at the fork (README, Limitations: Fork)")
  end
  return st, err
end

-- serverStatus opcounters, summed into a total of commands the server saw
function helpers.opcounters(client)
  local testing = require "mongolock.testing"
  local oc = assert(testing.opcounters(client._core or client))
  local total = 0
  for _, k in ipairs({ "insert", "query", "update", "delete", "getmore", "command" }) do
    total = total + (oc[k] or 0)
  end
  oc.total = total
  return oc
end

-- fn's server commands: counter, overhead = helpers.command_counter(client)
-- measures what one serverStatus counts (overhead, 0 or 1); counter(fn) ->
-- the commands fn sent and fn's results packed (for a client with
-- heartbeatFrequencyMS high enough that no check falls inside).  The
-- server's counts are every client's: a client or a stream of an earlier
-- spec that ends meanwhile sends its killCursors and endSessions (a stream
-- ends 10 s after its last waiter, a closed client's getMore returns up to
-- its await later), so those two are left out; no lock operation the
-- counted specs measure sends either
local function ended(oc)
  local c = oc.commands or {}
  return (c.killCursors or 0) + (c.endSessions or 0)
end
-- (helpers.ended(opcounters): those two, for specs that read opcounters
-- themselves)
helpers.ended = ended

function helpers.command_counter(client)
  helpers.opcounters(client)          -- connect, handshake
  local a = helpers.opcounters(client)
  local b = helpers.opcounters(client)
  local overhead = b.total - a.total - (ended(b) - ended(a))
  return function(fn)
    local x = helpers.opcounters(client)
    local r = table.pack and table.pack(fn()) or { fn() }
    local y = helpers.opcounters(client)
    return y.total - x.total - overhead - (ended(y) - ended(x)), r
  end, overhead
end

-- the raw lock document of name in helpers.database.coll (nil: none)
function helpers.lock_doc(client, coll, name)
  local r = assert(client:command(helpers.database, { find = coll }, { filter = { _id = name } }))
  return r.cursor.firstBatch[1]
end

-- polls fn (which asks the server, never a clock) until it returns a true
-- value or timeout seconds pass; returns that value or nil
function helpers.eventually(fn, timeout)
  local core = require "mongolock.core"
  local deadline = core.monotonic() + (timeout or 5)
  repeat
    local v = fn()
    if v then return v end
    core.sleep(0.01)
  until core.monotonic() > deadline
  return nil
end

-- ---- child processes ------------------------------------------------------

-- LUA_PATH / LUA_CPATH for children: the ones this process runs with
local function child_paths()
  local lp = getenv("LUA_PATH") or (helpers.root .. "/lua/?.lua;" .. helpers.root .. "/lua/?/init.lua;;")
  local cp = getenv("LUA_CPATH") or (helpers.root .. "/build/" .. helpers.lua .. "/?.so;;")
  return "LUA_PATH=" .. shell_quote(lp) .. " LUA_CPATH=" .. shell_quote(cp) .. " "
end

-- writes src to a temporary .lua file; returns its path
function helpers.script(src)
  local base = tmpname()
  os.remove(base)                       -- os.tmpname made it; we use base.lua
  local path = base .. ".lua"
  local f = assert(io.open(path, "wb"))
  f:write(src)
  f:close()
  return path
end

-- the shell command line that runs a script with this interpreter
-- (each child first asks mongolock.testing for its crash trace: a child
-- that dies of a signal leaves its C backtrace in its output)
local CRASH_TRACE = shell_quote("pcall(function() require('mongolock.testing').crash_trace() end)")
function helpers.command(path, args, prefix)
  if getenv("MONGOLOCK_NO_SERVER") ~= "1" then helpers.uri() end
  local parts = { child_paths(), helpers.child_env, prefix or "", helpers.lua, "-e", CRASH_TRACE,
    shell_quote(path) }
  for _, a in ipairs(args or {}) do parts[#parts + 1] = shell_quote(a) end
  return table.concat(parts, " ")
end

-- the shell words that run bin/mongolock with args under this interpreter
function helpers.cli_words(args)
  local words = { helpers.lua, shell_quote(helpers.root .. "/bin/mongolock") }
  for _, a in ipairs(args) do words[#words + 1] = shell_quote(a) end
  return table.concat(words, " ")
end

-- runs bin/mongolock to completion: exit status, stdout, stderr.  opts.env:
-- shell assignments before it ('NAME=value ...'), after the specs' own;
-- opts.stdin: its input (else /dev/null)
function helpers.mongolock(args, opts)
  opts = opts or {}
  local out, err = os.tmpname(), os.tmpname()
  local stdin = opts.stdin and ("printf '%s' " .. shell_quote(opts.stdin) .. " | ") or ""
  local redirect_in = opts.stdin and "" or " </dev/null"
  local env = opts.env and (opts.env .. " ") or ""
  local p = assert(io.popen(format("%s%s%s%s%s >%s 2>%s; echo $?", stdin, helpers.child_env, env,
    helpers.cli_words(args), redirect_in, shell_quote(out), shell_quote(err)), "r"))
  local code = tonumber(p:read("*l"))
  p:close()
  local o, e = read_file(out) or "", read_file(err) or ""
  os.remove(out)
  os.remove(err)
  return code, o, e
end

-- runs a script to completion; returns its stdout, whether it exited 0 and
-- its exit status (echoed: LuaJIT's pclose does not report it)
function helpers.run(path, args, prefix)
  local p = assert(io.popen(helpers.command(path, args, prefix) .. " 2>&1; echo \"exit:$?\"", "r"))
  local out = p:read("*a")
  p:close()
  local status = tonumber(out:match("exit:(%d+)%s*$"))
  out = out:gsub("exit:%d+%s*$", "")
  return out, status == 0, status
end

-- starts a script in the background; returns a process object with
-- pid, out (path of its combined stdout/stderr), :wait_for(pattern),
-- :kill(sig), :wait()
local Proc = {}
Proc.__index = Proc

-- The child's own pid (for SIGKILL) is not the subshell's: a child script
-- prints it (require("mongolock.core").getpid()) and the test reads it with
-- wait_for.
function helpers.spawn(path, args, prefix)
  local out = tmpname()
  local done = tmpname()
  os.remove(done)
  local p = assert(io.popen(format(
    -- the status is written to a temporary name and renamed, so that a
    -- reader never sees the file created but still empty
    "( %s >%s 2>&1; echo $? >%s.tmp; mv %s.tmp %s ) </dev/null >/dev/null 2>&1 & echo $!",
    helpers.command(path, args, prefix), shell_quote(out), shell_quote(done),
    shell_quote(done), shell_quote(done)), "r"))
  local spid = tonumber(p:read("*l"))
  p:close()
  return setmetatable({ shell_pid = spid, out = out, done = done }, Proc)
end

-- spec/kinds_child.lua (the shared kinds' child process) in its MODE on
-- helpers.database.coll; arguments after name as kinds_child.lua lists them
function helpers.kinds_child(coll, mode, kind, name, a, b, n, prefix)
  return helpers.spawn(helpers.root .. "/spec/kinds_child.lua", { helpers.database, coll, mode,
    kind, name, tostring(a or ""), tostring(b or ""), tostring(n or "") }, prefix)
end

function Proc:output()
  return read_file(self.out) or ""
end

-- waits until the child printed a line matching pattern (or exited, or
-- timeout seconds passed); returns the first capture or the match
function Proc:wait_for(pattern, timeout)
  local monotonic = require("mongolock.core").monotonic
  local deadline = monotonic() + (timeout or 20)
  repeat
    local s = self:output()
    local m = s:match(pattern)
    if m then return m end
    if read_file(self.done) then
      s = self:output()
      return s:match(pattern), "exited: " .. s
    end
    sleep(0.02)
  until monotonic() > deadline
  return nil, "timed out waiting for " .. pattern .. ": " .. self:output()
end

-- waits for the child to exit; returns its exit status and output
function Proc:wait(timeout)
  local monotonic = require("mongolock.core").monotonic
  local deadline = monotonic() + (timeout or 30)
  repeat
    local st = read_file(self.done)
    if st then
      return tonumber(st), self:output()
    end
    sleep(0.02)
  until monotonic() > deadline
  return nil, self:output()
end

-- (nothing once the child has exited: its pid, or its shell's, may be
-- another process's by then, another spec run's on a shared machine)
function Proc:kill(sig, pid)
  if read_file(self.done) then return end
  os.execute(format("kill -%s %d 2>/dev/null", sig or "TERM", pid or self.shell_pid))
end

function Proc:cleanup()
  os.remove(self.out)
  os.remove(self.done)
end

return helpers
