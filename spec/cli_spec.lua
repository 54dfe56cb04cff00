-- The mongolock command (bin/mongolock, lua/mongolock/cli.lua), run as a
-- separate OS process with the interpreter running the specs.
--   #unit         usage, --help, errors that need no server
--   #integration  exec, status, list, release, wait against helpers.uri()
local helpers = require "helpers"
local cjson = require "cjson"
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local proc = require "mongolock.proc"

local format = string.format
local max = math.max
local q = helpers.shell_quote
local root = helpers.root
local DEAD = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=300&connectTimeoutMS=300"

local function read(path)
  return helpers.read_file(path) or ""
end

local cli_words, mongolock = helpers.cli_words, helpers.mongolock

-- starts the command in the background; :pid() is mongolock's own pid
local Bg = {}
Bg.__index = Bg

local function background(args, env)
  local self = setmetatable({ out = os.tmpname(), err = os.tmpname(), rc = os.tmpname(),
    pidf = os.tmpname() }, Bg)
  os.remove(self.rc); os.remove(self.pidf)
  -- the inner sh writes its pid and becomes the interpreter (exec)
  local inner = format("echo $$ >%s; exec %s %s", q(self.pidf), env or "", cli_words(args))
  os.execute(format("( sh -c %s >%s 2>%s </dev/null; echo $? >%s ) >/dev/null 2>&1 &",
    q(inner), q(self.out), q(self.err), q(self.rc)))
  return self
end

local function poll(fn, timeout, what)
  local deadline = core.monotonic() + (timeout or 20)
  while core.monotonic() < deadline do
    local v = fn()
    if v then return v end
    core.sleep(0.02)
  end
  error("timed out waiting for " .. what, 2)
end

function Bg:pid()
  return poll(function() return tonumber(read(self.pidf):match("%d+")) end, 10, "the pid")
end

function Bg:wait_output(pattern, timeout)
  return poll(function()
    local m = read(self.out):match(pattern)
    if m then return m end
    if read(self.rc) ~= "" and not read(self.out):match(pattern) then
      error(format("exited (%s) without printing %q; stderr: %s", read(self.rc), pattern, read(self.err)))
    end
  end, timeout, pattern)
end

-- exit status, stdout, stderr once it has ended
function Bg:wait(timeout)
  local rc = poll(function() return tonumber(read(self.rc):match("%d+")) end, timeout or 30, "exit")
  return rc, read(self.out), read(self.err)
end

-- (nothing once it has exited: its pid may be another process's by then)
function Bg:kill(sig)
  if read(self.rc) ~= "" then return end
  os.execute(format("kill -%s %d", sig, self:pid()))
end

function Bg:cleanup()
  for _, f in ipairs({ self.out, self.err, self.rc, self.pidf }) do os.remove(f) end
end

-- A stand-in of the spec's own, to kill mid-run (a server that dies): the
-- stand-in even when MONGODB_URI names a real server.  :kill() SIGKILLs it.
local function private_server()
  local log = os.tmpname()
  local p = assert(io.popen(format("%s --port 0 >%s 2>&1 </dev/null & echo $!",
    q(root .. "/tools/mongo-standin/run"), q(log))))
  local pid = tonumber(p:read("*l"))
  p:close()
  local addr = poll(function() return read(log):match("listening (%S+)") end, 20, "the stand-in")
  return {
    uri = "mongodb://" .. addr .. "/?replicaSet=rs0",
    kill = function() os.execute(format("kill -KILL %d 2>/dev/null", pid)); os.remove(log) end,
  }
end

-- true once pid no longer exists (within timeout seconds, 10 unless
-- given; 0: one look); a zombie counts as gone
local function gone(pid, timeout)
  local deadline = core.monotonic() + (timeout or 10)
  repeat
    local p = io.popen(format("ps -o stat= -p %d 2>/dev/null", pid))
    local st = p:read("*a") or ""
    p:close()
    if not st:match("%a") or st:match("^%s*Z") then return true end
    core.sleep(0.05)
  until core.monotonic() > deadline
  return false
end

-- seconds the call fn() takes, and its results
local function timed(fn)
  local t0 = core.monotonic()
  local a, b, c = fn()
  return core.monotonic() - t0, a, b, c
end

-- one line on stderr, no traceback
local function assert_one_line(err)
  assert.is_truthy(err:match("^mongolock: [^\n]+\n$"), "expected one line, got: " .. err)
  assert.is_falsy(err:find("traceback", 1, true))
end

describe("#unit mongolock.proc (the command's child processes)", function()
  it("is a module of its own: the library's core spawns nothing", function()
    for _, f in ipairs({ "spawn", "wait", "kill", "trap", "untrap", "signals" }) do
      assert.is_function(proc[f])
      assert.is_nil(core["proc_" .. f])
    end
  end)

  it("spawns a command from PATH and reports its exit status", function()
    local pid = assert(proc.spawn({ "sh", "-c", "exit 7" }))
    assert.same({ "exit", 7 }, { proc.wait(pid, 10) })
  end)

  it("sets the variables it is given in the child's environment, keeping the rest", function()
    local home = os.getenv("HOME") or ""
    local pid = assert(proc.spawn({ "sh", "-c", 'test "$X1" = "a b=c" && test "$LOGNAME" = "me" '
      .. '&& test "$HOME" = ' .. q(home) }, { X1 = "a b=c", LOGNAME = "me" }))
    assert.same({ "exit", 0 }, { proc.wait(pid, 10) })
    assert.has_error(function() proc.spawn({ "true" }, { ["A=B"] = "x" }) end)
    assert.has_error(function() proc.spawn({ "true" }, { A = 1 }) end)
  end)

  it("reports death by a signal with its name and number", function()
    local pid = assert(proc.spawn({ "sleep", "30" }))
    assert.is_false(proc.wait(pid, 0))            -- still running
    assert.is_true(proc.kill(pid, "KILL"))
    assert.same({ "signal", "KILL", 9 }, { proc.wait(pid, 10) })
  end)

  it("says why a command cannot start, with errno", function()
    local pid, err, errno = proc.spawn({ "no-such-command-anywhere" })
    assert.is_nil(pid)
    assert.matches("No such file", err, 1, true)
    assert.equal(2, errno)
  end)

  it("returns false after the timeout while the child runs", function()
    local pid = assert(proc.spawn({ "sleep", "30" }))
    local t0 = core.monotonic()
    assert.is_false(proc.wait(pid, 0.1))
    assert.is_true(core.monotonic() - t0 >= 0.1)
    proc.kill(pid, "KILL")
    assert.equal("signal", (proc.wait(pid, 10)))
  end)

  it("catches SIGTERM sent by a process, wakes proc.wait and reports it once", function()
    proc.trap()
    finally(proc.untrap)   -- this process (busted) dies of ^C again
    assert.same({}, proc.signals())
    local pid = assert(proc.spawn({ "sleep", "30" }))
    -- the shell's parent is this process
    os.execute("kill -TERM $PPID")
    assert.is_false(proc.wait(pid, 10))          -- woken by the signal
    assert.same({ { name = "TERM", tty = false } }, proc.signals())
    assert.same({}, proc.signals())
    proc.kill(pid, "KILL")
    assert.equal("signal", (proc.wait(pid, 10)))
  end)

  it("starts the child in a process group of its own, and kill signals the whole group", function()
    local f = os.tmpname()
    -- sh waits for its background sleep: the sleep is the grandchild
    local pid = assert(proc.spawn({ "sh", "-c", "sleep 30 & echo $! >" .. q(f) .. "; wait" }))
    local grandchild = poll(function() return tonumber(read(f):match("%d+")) end, 10, "the grandchild")
    os.remove(f)
    assert.is_true(proc.kill(pid, "TERM"))
    assert.same({ "signal", "TERM", 15 }, { proc.wait(pid, 10) })
    assert.is_true(gone(grandchild), "the grandchild outlived the signal to the group")
  end)

  it("signals what remains of the group once the child has ended, when asked", function()
    local f = os.tmpname()
    -- sh leaves its background sleep behind
    local pid = assert(proc.spawn({ "sh", "-c", "sleep 30 & echo $! >" .. q(f) }))
    local grandchild = poll(function() return tonumber(read(f):match("%d+")) end, 10, "the grandchild")
    os.remove(f)
    assert.same({ "exit", 0 }, { proc.wait(pid, 10, "KILL") })
    assert.is_true(gone(grandchild))
  end)

  it("wait_group tells when the group the child led is empty, its background jobs included", function()
    local pid = assert(proc.spawn({ "sh", "-c", "sleep 1.5 & exit 0" }))
    assert.same({ "exit", 0 }, { proc.wait(pid, 10) })
    assert.is_false(proc.wait_group(pid, 0))        -- the sleep is still in it
    assert.is_true(proc.wait_group(pid, 10))
    assert.has_error(function() proc.wait_group(1, 1) end)
    assert.has_error(function() proc.wait_group(pid, -1) end)
  end)

  it("adopts what the child's processes leave orphaned (a subreaper), so their end is seen at once", function()
    -- (only while asked: this test runner must not stay the parent of the
    -- daemons later specs start, such as nginx's master)
    assert.is_true(proc.subreaper(true))
    finally(function() proc.subreaper(false) end)
    local f = os.tmpname()
    local pid = assert(proc.spawn({ "sh", "-c", "sleep 1 & echo $! >" .. q(f) }))
    assert.same({ "exit", 0 }, { proc.wait(pid, 10) })
    local orphan = poll(function() return tonumber(read(f):match("%d+")) end, 10, "the orphan")
    os.remove(f)
    local stat = read("/proc/" .. orphan .. "/stat")
    -- the fourth field of /proc/PID/stat is the parent's pid
    assert.equal(core.getpid(), tonumber(stat:match("^%d+ %b() %a (%d+)")))
    assert.is_true(proc.wait_group(pid, 10))
  end)

  it("raises on bad arguments", function()
    assert.has_error(function() proc.wait(1, 1, "NOPE") end)
    assert.has_error(function() proc.spawn({}) end)
    assert.has_error(function() proc.spawn({ "sh", 5 }) end)
    assert.has_error(function() proc.spawn("sh") end)
    assert.has_error(function() proc.wait(0, 1) end)
    assert.has_error(function() proc.wait(1, -1) end)
    assert.has_error(function() proc.kill(1, "NOPE") end)
  end)
end)

describe("#unit mongolock command", function()
  it("prints --help for itself and every subcommand, exit 0", function()
    local code, out = mongolock({ "--help" })
    assert.equal(0, code)
    assert.matches("Usage: mongolock", out, 1, true)
    for _, cmd in ipairs({ "exec", "status", "list", "release", "wait", "demo" }) do
      assert.matches("Commands:.-\n   " .. cmd .. " ", out)
      local c, o = mongolock({ cmd, "--help" })
      assert.equal(0, c)
      assert.matches("Usage: mongolock " .. cmd, o, 1, true)
    end
    local _, o = mongolock({ "exec", "--help" })
    for _, flag in ipairs({ "--nonblock", "--timeout", "--ttl", "--conflict-exit-code",
                            "--on-lost", "--kill-after" }) do
      assert.matches(flag, o, 1, true)
    end
  end)

  it("answers bad usage with one line on stderr and status 64", function()
    local cases = {
      {},                                          -- no command
      { "frobnicate" },                            -- unknown command
      { "exec", "job" },                           -- no command to run
      { "exec", "-n", "-w", "3", "job", "--", "true" }, -- -n and -w together
      { "exec", "--ttl=0", "job", "--", "true" },
      { "exec", "--ttl=abc", "job", "--", "true" },
      { "exec", "-w", "-1", "job", "--", "true" },
      { "exec", "-E", "300", "job", "--", "true" },
      { "exec", "--on-lost=explode", "job", "--", "true" },
      { "exec", "--ttl", "40000000", "job", "--", "true" },   -- more than a year
      { "--server-timeout", "0", "status", "job" },
      { "--server-timeout", "100000", "status", "job" },    -- more than a day
      { "exec", "-w", "1", "job" },                -- no command either
      { "exec", "job", "--" },                     -- nothing after --
      { "status" },
      { "release", "job" },                        -- no --force
    }
    for _, args in ipairs(cases) do
      local code, out, err = mongolock(args, { env = "MONGODB_URI=" .. q(DEAD) })
      assert.equal(64, code, table.concat(args, " ") .. ": " .. err)
      assert.equal("", out)
      assert_one_line(err)
    end
  end)

  it("exec: everything after NAME is the command, whatever it looks like; -- still accepted", function()
    local cli = require "mongolock.cli"
    local args = assert(cli.parse({ "exec", "job", "./args.sh", "-n", "-v", "-w", "5", "--ttl", "5", "file" }))
    assert.same({ "./args.sh", "-n", "-v", "-w", "5", "--ttl", "5", "file" }, args.cmd)
    assert.equal("job", args.name)
    assert.is_nil(args.nonblock)
    assert.is_nil(args.verbose)
    assert.is_nil(args.timeout)
    assert.equal(30, args.ttl)
    -- mongolock's own options go before NAME, in any form argparse knows
    args = assert(cli.parse({ "--uri", "mongodb://h/", "exec", "-nv", "--ttl=7", "-E", "3", "job",
      "sh", "-c", "echo \"$@\"", "--uri", "x" }))
    assert.same({ "sh", "-c", "echo \"$@\"", "--uri", "x" }, args.cmd)
    assert.is_true(args.nonblock)
    assert.is_true(args.verbose)
    assert.equal(7, args.ttl)
    assert.equal(3, args.conflict_exit_code)
    assert.equal("mongodb://h/", args.uri)
    -- the old form: -- after NAME
    args = assert(cli.parse({ "exec", "-w", "2", "job", "--", "rsync", "-n", "a", "b" }))
    assert.same({ "rsync", "-n", "a", "b" }, args.cmd)
    assert.equal(2, args.timeout)
    -- a second -- belongs to the command
    args = assert(cli.parse({ "exec", "job", "--", "--", "x" }))
    assert.same({ "--", "x" }, args.cmd)
    args = assert(cli.parse({ "exec", "--", "job", "ls", "-l" }))
    assert.same({ "ls", "-l" }, args.cmd)
    assert.equal("job", args.name)
    -- a command word that is also a subcommand's name
    args = assert(cli.parse({ "exec", "job", "git", "status", "--json" }))
    assert.same({ "git", "status", "--json" }, args.cmd)
  end)

  it("says what was wrong in the command's words: the option, never a file or a Lua function", function()
    local env = { env = "MONGODB_URI=" .. q(DEAD) }
    local code, _, err = mongolock({ "--collection", "bad$", "status", "job" }, env)
    assert.equal(64, code)
    assert_one_line(err)
    assert.matches("^mongolock: %-%-collection: collection must be", err)
    assert.is_nil(err:find("cli.lua", 1, true), err)
    assert.is_nil(err:find("bad argument", 1, true), err)
    code, _, err = mongolock({ "--database", "a.b", "list" }, env)
    assert.equal(64, code)
    assert.matches("^mongolock: %-%-database: database must be", err)
    -- a value that starts with "-" is the option's value, named as such
    code, _, err = mongolock({ "exec", "-w", "-1", "job", "true" }, env)
    assert.equal(64, code)
    assert_one_line(err)
    assert.matches("^mongolock: %-%-timeout: '%-1' is not a number of seconds %(see 'mongolock exec %-%-help'%)", err)
    -- a global option's bad value points at mongolock --help, not the subcommand's
    code, _, err = mongolock({ "--server-timeout", "-1", "status", "job" }, env)
    assert.equal(64, code)
    assert.matches("%-%-server%-timeout: .*%(see 'mongolock %-%-help'%)\n$", err)
    -- a lease shorter than a round trip and its renewal is refused
    code, _, err = mongolock({ "exec", "--ttl", "0.001", "job", "true" }, env)
    assert.equal(64, code)
    assert.matches("^mongolock: %-%-ttl: '0.001' is less than a second", err)
  end)

  it("says what is wrong with a lock or election name in the command's words, exit 64", function()
    local env = { env = "MONGODB_URI=" .. q(DEAD) }
    local cases = {
      { { "status", "\255" }, "^mongolock: the lock name is not valid UTF%-8 %(see 'mongolock status %-%-help'%)\n$" },
      { { "wait", "-w", "1", "\255" }, "^mongolock: the lock name is not valid UTF%-8 " },
      { { "exec", "-n", "\255", "true" }, "^mongolock: the lock name is not valid UTF%-8 " },
      { { "release", "--force", "--yes", "" }, "^mongolock: the lock name is empty " },
      { { "hold", "-n", "\255" }, "^mongolock: the lock name is not valid UTF%-8 " },
      { { "leader", "\255" }, "^mongolock: the election name is not valid UTF%-8 " },
      { { "elect", "-n", "\255", "true" }, "^mongolock: the election name is not valid UTF%-8 " },
      { { "status", ("x"):rep(1025) }, "^mongolock: the lock name is longer than 1024 bytes " },
    }
    for _, case in ipairs(cases) do
      local code, _, err = mongolock(case[1], env)
      assert.equal(64, code, err)
      assert_one_line(err)
      assert.matches(case[2], err)
      assert.is_nil(err:find("bad argument", 1, true), err)
    end
  end)

  it("says where the server should come from when there is none", function()
    local code, _, err = mongolock({ "status", "job" }, { env = "MONGODB_URI=" })
    assert.equal(64, code)
    assert_one_line(err)
    assert.matches("MONGODB_URI", err, 1, true)
  end)

  it("reports a bad URI as bad usage and an unreachable server with status 69", function()
    local code, _, err = mongolock({ "--uri", "http://nope", "status", "job" })
    assert.equal(64, code)
    assert_one_line(err)
    code, _, err = mongolock({ "--uri", DEAD, "status", "job" })
    assert.equal(69, code)
    assert_one_line(err)
    code, _, err = mongolock({ "--uri", DEAD, "exec", "-n", "job", "--", "true" })
    assert.equal(69, code)
    assert_one_line(err)
  end)

  it("gives up on a refusing server within the server timeout (default 2 s), every command", function()
    local refused = "mongodb://127.0.0.1:1/"
    for _, args in ipairs({
      { "exec", "-w", "2", "job", "--", "echo", "ran" },
      { "exec", "-n", "job", "--", "echo", "ran" },
      { "wait", "-w", "2", "job" },
      { "status", "job" },
      { "list" },
    }) do
      table.insert(args, 1, refused)
      table.insert(args, 1, "--uri")
      local took, code, out, err = timed(function() return mongolock(args) end)
      local what = table.concat(args, " ")
      assert.equal(69, code, what .. ": " .. err)
      assert.equal("", out)
      assert_one_line(err)
      assert.is_true(took < 4, what .. " took " .. took .. " s")
    end
  end)

  it("exec -n and -w 0 against a refusing server answer within about a second, not the server timeout", function()
    for _, w in ipairs({ { "-n" }, { "-w", "0" } }) do
      local args = { "--uri", "mongodb://127.0.0.1:1/", "exec" }
      for _, x in ipairs(w) do args[#args + 1] = x end
      args[#args + 1] = "job"
      args[#args + 1] = "true"
      local took, code, _, err = timed(function() return mongolock(args) end)
      assert.equal(69, code, err)
      assert_one_line(err)
      assert.is_true(took < 2, table.concat(w, " ") .. " took " .. took .. " s")
    end
  end)

  -- issue 42: without -w the command waits for ever; an admin reading its
  -- log learns after a few seconds (then every minute) why it waits
  it("exec without -w says on stderr, after a few seconds, that the server is unreachable and why", function()
    local bg = background({ "--uri", "mongodb://127.0.0.1:1/", "--server-timeout", "1", "exec", "job", "--",
      "true" })
    local started = core.monotonic()
    local ok, e = pcall(function()
      local line = poll(function() return read(bg.err):match("[^\n]*unreachable[^\n]*\n") end, 15, "the notice")
      assert.matches("^mongolock: the server is unreachable %(.*connect.*127%.0%.0%.1:1.*%); still waiting for job",
        line)
      assert.is_true(core.monotonic() - started >= 2, "the notice came before a few seconds")
      assert.equal("", read(bg.rc), "it stopped waiting")
      assert.equal(1, select(2, read(bg.err):gsub("\n", "")), "one notice, not one per attempt")
    end)
    bg:kill("TERM")
    bg:wait(10)
    bg:cleanup()
    assert(ok, e)
  end)

  it("takes the server timeout from --server-timeout, else MONGOLOCK_SERVER_TIMEOUT; the URI's own wins", function()
    local refused = "mongodb://127.0.0.1:1/"
    local took, code = timed(function()
      return mongolock({ "--uri", refused, "--server-timeout", "0.3", "status", "job" })
    end)
    assert.equal(69, code)
    assert.is_true(took < 1.5, "--server-timeout 0.3 took " .. took .. " s")
    took, code = timed(function()
      return mongolock({ "--uri", refused, "status", "job" }, { env = "MONGOLOCK_SERVER_TIMEOUT=0.3" })
    end)
    assert.equal(69, code)
    assert.is_true(took < 1.5, "MONGOLOCK_SERVER_TIMEOUT=0.3 took " .. took .. " s")
    took, code = timed(function()
      return mongolock({ "--uri", refused .. "?serverSelectionTimeoutMS=300", "--server-timeout", "20",
        "status", "job" })
    end)
    assert.equal(69, code)
    assert.is_true(took < 1.5, "the URI's serverSelectionTimeoutMS=300 took " .. took .. " s")
    -- wait -w bounds its calls by its own timeout (a second at least)
    took, code = timed(function() return mongolock({ "--uri", refused, "wait", "-w", "0.3", "job" }) end)
    assert.equal(69, code)
    assert.is_true(took < 1.8, "wait -w 0.3 took " .. took .. " s")
    local _, err
    code, _, err = mongolock({ "--uri", refused, "status", "job" }, { env = "MONGOLOCK_SERVER_TIMEOUT=soon" })
    assert.equal(64, code)
    assert_one_line(err)
    assert.matches("MONGOLOCK_SERVER_TIMEOUT", err, 1, true)
  end)

  it("says what -w absent means, and that the command runs in its own process group", function()
    local _, out = mongolock({ "exec", "--help" })
    assert.matches("wait for ever", out, 1, true)
    assert.matches("-w 0 is -n", out, 1, true)
    assert.matches("process group", out, 1, true)
    assert.matches("killed with SIGKILL", out, 1, true)
    _, out = mongolock({ "--help" })
    assert.matches("--server-timeout", out, 1, true)
    _, out = mongolock({ "status", "--help" })
    assert.matches("Exit status 0 when it is held, 1 when it", out, 1, true)
  end)

  it("wait's errors say what it was doing", function()
    -- an unreachable server is looked at again until -w ends
    local code, _, err = mongolock({ "--uri", DEAD, "wait", "-w", "1", "job" })
    assert.equal(69, code)
    assert_one_line(err)
    assert.matches("^mongolock: cannot wait for job: ", err)
  end)

  it("rejects a bad lock name as bad usage", function()
    local code, _, err = mongolock({ "--uri", DEAD, "status", "" })
    assert.equal(64, code)
    assert_one_line(err)
    assert.matches("empty", err, 1, true)
  end)
end)

describe("#integration mongolock command", function()
  local client, locks, base

  setup(function()
    client = helpers.connect()
    locks = helpers.locks(client)
    base = { "--uri", helpers.uri(), "--database", locks.database, "--collection", locks.collection }
  end)

  teardown(function()
    if client then client:close() end
  end)

  -- base options followed by args
  local function a(...)
    local t = {}
    for _, v in ipairs(base) do t[#t + 1] = v end
    for _, v in ipairs({ ... }) do t[#t + 1] = v end
    return t
  end

  describe("exec", function()
    it("runs the command holding the lock and passes its status and output through", function()
      local name = helpers.unique("exec")
      -- inside, the lock is held: a second -n attempt is refused with 1
      local inner = cli_words(a("exec", "-n", name, "--", "true"))
      local code, out, err = mongolock(a("exec", name, "--", "sh", "-c",
        "echo hello; " .. inner .. "; echo inner=$?; exit 3"))
      assert.equal(3, code, err)
      assert.equal("hello\ninner=1\n", out)
      assert.equal("", err)
      -- released afterwards
      local st = locks:status(name)
      assert.is_false(st.held)
      code = mongolock(a("exec", "-n", name, "--", "true"))
      assert.equal(0, code)
    end)

    it("passes the command's own flags to it, not to mongolock (flock's and env's habit)", function()
      local name = helpers.unique("flags")
      local code, out, err = mongolock(a("exec", name, "echo", "-n", "hi"))
      assert.equal(0, code, err)
      assert.equal("hi", out)
      code, out, err = mongolock(a("exec", name, "sh", "-c", 'printf "%s|" "$@"', "sh",
        "-n", "-v", "-w", "5", "--ttl", "5", "--uri", "x", "file"))
      assert.equal(0, code, err)
      assert.equal("-n|-v|-w|5|--ttl|5|--uri|x|file|", out)
      assert.equal("", err)           -- no verbose lines: -v was the command's
      code, out, err = mongolock(a("exec", "-v", name, "--", "echo", "-n", "hi"))
      assert.equal(0, code, err)
      assert.equal("hi", out)
      assert.matches("took " .. name, err, 1, true)
    end)

    it("gives the command MONGOLOCK_NAME and MONGOLOCK_TOKEN, the token exact", function()
      local name = helpers.unique("envtoken")
      local inner = cli_words(a("status", "--json", name))
      local code, out, err = mongolock(a("exec", name, "sh", "-c",
        'echo "$MONGOLOCK_NAME $MONGOLOCK_TOKEN"; ' .. inner))
      assert.equal(0, code, err)
      local env_name, env_token, json = out:match("^(%S+) (%S+)\n(.*)$")
      assert.equal(name, env_name)
      local st = cjson.decode(json)
      assert.equal(st.token, env_token)
      assert.matches("^%d%d%d%d%d%d%d%d%d%d%d%d+$", env_token)   -- tokens have 16 digits
      -- a reader's share has its own token
      code, out, err = mongolock(a("exec", "--shared", name, "sh", "-c", 'echo "$MONGOLOCK_TOKEN"'))
      assert.equal(0, code, err)
      assert.matches("^%d+\n$", out)
      assert.is_true(tonumber(out) > tonumber(env_token))
    end)

    it("holds the lock until the command's process group is empty, as flock's inherited descriptor", function()
      local name = helpers.unique("group")
      local go = os.tmpname(); os.remove(go)
      -- sh exits at once; its background job goes on until go exists
      local bg = background(a("exec", name, "sh", "-c",
        "(i=0; while [ ! -e \"$1\" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; echo job-done) & "
        .. "echo started; exit 3", "sh", go))
      bg:wait_output("started")
      core.sleep(0.5)                    -- sh has exited by now; its job runs on
      assert.equal("", read(bg.rc))
      assert.is_true(locks:status(name).held)
      assert(os.execute("touch " .. q(go)))
      local code, out, err = bg:wait()
      os.remove(go)
      assert.equal(3, code, err)         -- the command's own status
      assert.equal("started\njob-done\n", out)
      assert.is_false(locks:status(name).held)
      bg:cleanup()
    end)

    it("--release-on-exit releases when the command exits, its background jobs going on", function()
      local name = helpers.unique("groupexit")
      local go = os.tmpname(); os.remove(go)
      local code, out, err = mongolock(a("exec", "--release-on-exit", name, "sh", "-c",
        "(i=0; while [ ! -e \"$1\" ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done) >/dev/null 2>&1 & "
        .. "echo started", "sh", go))
      assert.equal(0, code, err)
      assert.equal("started\n", out)
      assert.is_false(locks:status(name).held)
      assert(os.execute("touch " .. q(go)))
      core.sleep(0.2)
      os.remove(go)
    end)

    it("gives the command its stdin, stdout and stderr", function()
      local name = helpers.unique("stdio")
      local code, out, err = mongolock(a("exec", name, "--", "sh", "-c", "tr a-z A-Z; echo oops >&2"),
        { stdin = "piped in\n" })
      assert.equal(0, code, err)
      assert.equal("PIPED IN\n", out)
      assert.equal("oops\n", err)
    end)

    it("-n exits with the conflict code, 1 by default, when the lock is held", function()
      local name = helpers.unique("busy")
      local h = assert(locks:acquire(name))
      local code, out, err = mongolock(a("exec", "-n", name, "--", "echo", "ran"))
      assert.equal(1, code)
      assert.equal("", out)
      assert.equal("", err)
      code, out = mongolock(a("exec", "-n", "-E", "75", name, "--", "echo", "ran"))
      assert.equal(75, code)
      assert.equal("", out)
      assert.is_true(h:release())
    end)

    it("-w gives up with the conflict code after the timeout", function()
      local name = helpers.unique("timeout")
      local h = assert(locks:acquire(name))
      local t0 = core.monotonic()
      local code, out = mongolock(a("exec", "-w", "0.5", "--conflict-exit-code", "9", name, "--", "echo", "ran"))
      assert.equal(9, code)
      assert.equal("", out)
      assert.is_true(core.monotonic() - t0 >= 0.5)
      assert.is_true(h:release())
    end)

    it("-w 0 and --timeout 0 make one attempt, as -n", function()
      local name = helpers.unique("zero")
      local h = assert(locks:acquire(name))
      for _, args in ipairs({ a("exec", "-w", "0", name, "--", "echo", "ran"),
                              a("exec", "--timeout", "0", name, "--", "echo", "ran"),
                              a("exec", "--timeout=0", name, "--", "echo", "ran") }) do
        local took, code, out, err = timed(function() return mongolock(args) end)
        assert.equal(1, code, table.concat(args, " ") .. ": " .. err)
        assert.equal("", out)
        assert.equal("", err)
        assert.is_true(took < 5)
      end
      -- a try never queues: nobody is waiting
      assert.equal(0, locks:status(name).waiting)
      assert.is_true(h:release())
      local code, out = mongolock(a("exec", "-w", "0", name, "--", "echo", "ran"))
      assert.equal(0, code)
      assert.equal("ran\n", out)
    end)

    it("a sub-second -w takes about that long, not a second", function()
      local name = helpers.unique("subsec")
      local h = assert(locks:acquire(name))
      local took, code = timed(function() return mongolock(a("exec", "-w", "0.4", name, "--", "true")) end)
      assert.equal(1, code)
      assert.is_true(took >= 0.4)
      assert.is_true(took < 0.9, "-w 0.4 took " .. took .. " s")
      assert.is_true(h:release())
    end)

    it("serves waiters in the order they came, for as long as they wait", function()
      local name = helpers.unique("fifo")
      local file = os.tmpname()
      local h = assert(locks:acquire(name))
      local bgs = {}
      for i = 1, 4 do
        local started = core.monotonic()
        bgs[i] = background(a("exec", "-w", "30", name, "--", "sh", "-c", "echo w" .. i .. " >>" .. q(file)))
        -- in the queue before the next one comes, and 0.3 s apart at least
        poll(function() return (locks:status(name).waiting or 0) >= i end, 20, "waiter " .. i)
        core.sleep(max(0, started + 0.3 - core.monotonic()))
      end
      -- long enough for a wait made of one-second pieces to lose its place
      core.sleep(2.5)
      assert.equal(4, locks:status(name).waiting)
      assert.is_true(h:release())
      for i = 1, 4 do
        local code, _, err = bgs[i]:wait()
        assert.equal(0, code, err)
        bgs[i]:cleanup()
      end
      local order = read(file):gsub("\n", " ")
      os.remove(file)
      assert.equal("w1 w2 w3 w4 ", order)
    end)

    it("waits for the lock and runs the command once it is released", function()
      local name = helpers.unique("waits")
      local h = assert(locks:acquire(name))
      local bg = background(a("exec", "-w", "20", name, "--", "echo", "ran"))
      -- it is waiting: nothing ran while we hold the lock
      core.sleep(0.3)
      assert.equal("", read(bg.out))
      assert.is_true(h:release())
      local code, out, err = bg:wait()
      assert.equal(0, code, err)
      assert.equal("ran\n", out)
      bg:cleanup()
    end)

    it("exits 127 for a command not found and 126 for one not executable, releasing the lock", function()
      local name = helpers.unique("noexec")
      local code, _, err = mongolock(a("exec", name, "--", "no-such-command-anywhere"))
      assert.equal(127, code)
      assert_one_line(err)
      local path = os.tmpname()   -- a file without the execute bit
      code, _, err = mongolock(a("exec", name, "--", path))
      os.remove(path)
      assert.equal(126, code)
      assert_one_line(err)
      assert.is_false(locks:status(name).held)
    end)

    it("reports death by a signal as 128 + N", function()
      local name = helpers.unique("killed")
      local code = mongolock(a("exec", name, "--", "sh", "-c", "kill -KILL $$"))
      assert.equal(137, code)
      assert.is_false(locks:status(name).held)
    end)

    for _, sig in ipairs({ "TERM", "INT", "HUP" }) do
      it("forwards SIG" .. sig .. " to the command and passes its status through", function()
        local name = helpers.unique("sig")
        local script = format("trap 'echo got %s; exit 42' %s; echo ready; while :; do sleep 0.05; done", sig, sig)
        local bg = background(a("exec", "-v", name, "--", "sh", "-c", script))
        bg:wait_output("ready")
        assert.is_true(locks:status(name).held)
        bg:kill(sig)
        local code, out, err = bg:wait()
        assert.equal(42, code, err)
        assert.equal("ready\ngot " .. sig .. "\n", out)
        assert.matches("forwarding SIG" .. sig, err, 1, true)
        assert.is_false(locks:status(name).held)
        bg:cleanup()
      end)
    end

    it("gives the terminal to the command's process group: ^C reaches it once, not forwarded", function()
      local name = helpers.unique("tty")
      local dir = os.tmpname(); os.remove(dir)
      assert(os.execute("mkdir " .. q(dir) .. " && mkfifo " .. q(dir .. "/in")))
      -- perl's "unsafe" signals run the handler at each delivery: two
      -- SIGINTs a millisecond apart count twice (a shell's trap merges them)
      local child = [[$| = 1; $SIG{INT} = sub { print "got-INT\n" }; print "ready\n";
        until (-e $ARGV[0]) { select(undef, undef, undef, 0.05) } print "done\n";]]
      -- mongolock runs on a pseudo-terminal as its session leader (exec),
      -- with the command in its foreground process group
      local inner = "exec env PERL_SIGNALS=unsafe "
        .. cli_words(a("exec", "-v", name, "--", "perl", "-e", child, dir .. "/go"))
      os.execute(format("( script -qfec %s /dev/null <%s >%s 2>&1; echo $? >%s ) >/dev/null 2>&1 &",
        q(inner), q(dir .. "/in"), q(dir .. "/out"), q(dir .. "/rc")))
      local tty = assert(io.open(dir .. "/in", "w"))
      local function out() return read(dir .. "/out") end
      poll(function() return out():find("ready", 1, true) end, 20, "ready")
      tty:write("\3")            -- ^C typed at the terminal
      tty:flush()
      poll(function() return out():find("got-INT", 1, true) end, 20, "the command's trap")
      -- a forwarded copy would reach the command well within this
      core.sleep(0.5)
      assert(os.execute("touch " .. q(dir .. "/go")))
      local rc = poll(function() return tonumber(read(dir .. "/rc"):match("%d+")) end, 20, "exit")
      tty:close()
      local text = out()
      os.execute("rm -rf " .. q(dir))
      assert.equal(0, rc, text)
      -- the command's process group was given the terminal (-v says so),
      -- so the key reached the command alone and mongolock sent nothing;
      -- the command got it once (a forwarded copy can merge with the first
      -- in the kernel, so the count alone would not tell)
      assert.matches("given the terminal", text, 1, true)
      assert.is_nil(text:find("forwarding", 1, true), text)
      local _, ints = text:gsub("got%-INT", "")
      assert.equal(1, ints, text)
      assert.matches("done", text, 1, true)
    end)

    it("on a terminal, the command reads it, and ^Z stops the job and fg continues it", function()
      local name = helpers.unique("jobctl")
      local dir = os.tmpname(); os.remove(dir)
      assert(os.execute("mkdir " .. q(dir) .. " && mkfifo " .. q(dir .. "/in")))
      -- an interactive shell on a pseudo-terminal runs mongolock as a job
      local p = assert(io.popen(format("script -qfec 'bash --norc --noprofile -i' /dev/null <%s >%s 2>&1 & echo $!",
        q(dir .. "/in"), q(dir .. "/out"))))
      local script_pid = tonumber(p:read("*l"))
      p:close()
      local tty = assert(io.open(dir .. "/in", "w"))
      -- whatever happens: the terminal goes away (SIGHUP to its session)
      finally(function()
        pcall(tty.close, tty)
        os.execute(format("kill -KILL %d 2>/dev/null; rm -rf %s", script_pid, q(dir)))
      end)
      local function out() return read(dir .. "/out"):gsub("\r", "") end
      local function type_(s) tty:write(s); tty:flush() end
      -- the command reads a line from the terminal (from a background
      -- group it would be stopped by SIGTTIN), then waits for a file ('' keeps
      -- the word "finished" out of the terminal's echo of the line)
      type_(cli_words(a("exec", name, "--", "sh", "-c",
        "read l; echo got-$l; while [ ! -e \"$1\" ]; do sleep 0.05; done; echo fin''ished", "sh", dir .. "/go"))
        .. "\n")
      poll(function() return (locks:status(name) or {}).held end, 20, "the lock taken")
      core.sleep(0.3)
      type_("hello\n")
      poll(function() return out():find("got-hello", 1, true) end, 20, "the line read")
      type_("\26")                -- ^Z
      -- (a timeout says what the terminal showed and the processes' states)
      if not pcall(poll, function() return out():find("Stopped", 1, true) end, 20, "the job stopped") then
        local f = assert(io.popen("ps --ppid 2 -p 2 --deselect -o pid,ppid,pgid,tpgid,stat,wchan:16,args --forest"))
        local ps = f:read("*a")
        f:close()
        error("timed out waiting for the job stopped; the terminal:\n" .. out() .. "\nps:\n" .. ps)
      end
      assert(os.execute("touch " .. q(dir .. "/go")))
      core.sleep(0.3)
      assert.is_nil(out():find("finished", 1, true), "the command ran on while stopped")
      type_("fg; echo rc=$?\n")
      poll(function() return out():find("rc=%d") end, 20, "the job's end")
      type_("exit\n")
      local text = out()
      assert.matches("finished\nrc=0", text)
      assert.is_false(locks:status(name).held)
    end)

    it("ends a wait for the lock on SIGTERM with 143, running nothing", function()
      local name = helpers.unique("sigwait")
      local h = assert(locks:acquire(name))
      local bg = background(a("exec", name, "--", "echo", "ran"))
      bg:pid()
      core.sleep(0.3)   -- it is in its wait (nothing to observe but time)
      bg:kill("TERM")
      local code, out = bg:wait()
      assert.equal(143, code)
      assert.equal("", out)
      assert.equal(h.token, locks:status(name).token)
      assert.is_true(h:release())
      bg:cleanup()
    end)

    it("keeps the lease alive for longer than its ttl while the command runs", function()
      local name = helpers.unique("renew")
      local bg = background(a("exec", "--ttl", "1", name, "--", "sh", "-c", "echo ready; sleep 2.5; echo done"))
      bg:wait_output("ready")
      core.sleep(1.6)   -- past one ttl
      local h, err = locks:try(name)
      assert.is_nil(h)
      assert.equal("busy", err)
      local code, out, e = bg:wait()
      assert.equal(0, code, e)
      assert.equal("ready\ndone\n", out)
      assert.equal("", e)
      assert.is_false(locks:status(name).held)
      bg:cleanup()
    end)

    -- the command waits for the file named by its $1 before it goes on
    local WAIT_GO = "echo ready; while [ ! -e \"$1\" ]; do sleep 0.05; done; echo finished; exit 5"

    it("ends the command by default when its lock is lost, saying it was released by another", function()
      local name = helpers.unique("lostdefault")
      local bg = background(a("exec", "--ttl", "1", name, "sh", "-c",
        "trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.05; done"))
      bg:wait_output("ready")
      assert.is_true(locks:force_release(name))
      local code, out, err = bg:wait()
      assert.equal(7, code, err)
      assert.equal("ready\ngot TERM\n", out)
      assert.matches("lost the lock " .. name .. ": it was released by another process", err, 1, true)
      assert.matches("terminating", err, 1, true)
      assert.is_nil(err:find("could not be renewed", 1, true), err)
      bg:cleanup()
    end)

    it("with --on-lost=warn, warns once on a lost lease and lets the command finish", function()
      local name = helpers.unique("lost")
      local go = os.tmpname(); os.remove(go)
      local bg = background(a("exec", "--on-lost=warn", "--ttl", "1", name, "--", "sh", "-c", WAIT_GO, "sh", go))
      bg:wait_output("ready")
      assert.is_true(locks:force_release(name))
      -- the next renewal (every ttl/3) finds the lock gone
      poll(function() return read(bg.err):match("lost the lock") end, 10, "the warning")
      assert.is_true(os.execute("touch " .. q(go)) ~= false)
      local code, out, err = bg:wait()
      os.remove(go)
      assert.equal(5, code, err)
      assert.equal("ready\nfinished\n", out)
      -- the loss at once, then its cause when the server could be asked
      local first, second = err:match("^(mongolock: [^\n]+)\n(mongolock: [^\n]+)\n$")
      assert.is_truthy(first, "expected two lines, got: " .. err)
      assert.matches("keeps running", first, 1, true)
      assert.matches("lost the lock " .. name .. ": it was released by another process", second, 1, true)
      bg:cleanup()
    end)

    it("terminates the command on a lost lease with --on-lost=kill", function()
      local name = helpers.unique("lostkill")
      local bg = background(a("exec", "--ttl", "1", "--on-lost=kill", name, "--", "sh", "-c",
        "trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.05; done"))
      bg:wait_output("ready")
      assert.is_true(locks:force_release(name))
      local code, out, err = bg:wait()
      assert.equal(7, code, err)
      assert.equal("ready\ngot TERM\n", out)
      -- two lines of mongolock's, the loss and the kill at once, then the
      -- cause (the shell may report its sleep, which the signal to the group
      -- ended too)
      local _, lines = err:gsub("mongolock: ", "")
      assert.equal(2, lines, err)
      local said = err:find("terminating", 1, true)
      local cause = err:find("lost the lock " .. name .. ": it was released", 1, true)
      assert.is_true(said and cause and said < cause, err)
      bg:cleanup()
    end)

    it("terminates the command when no renewal succeeds before the lease ends", function()
      local name = helpers.unique("renewfail")
      local app = helpers.unique("cli"):sub(1, 60)
      local bg = background(a("--app", app, "exec", "--ttl", "1", "--on-lost=kill", name, "--", "sh", "-c",
        "trap 'echo got TERM; exit 7' TERM; echo ready; while :; do sleep 0.05; done"))
      bg:wait_output("ready")
      assert.equal(app, locks:status(name).holder.app)
      -- from now on the server refuses every update of that process
      assert(testing.failpoint(client._core, { mode = "alwaysOn", commands = { "update" },
        error_code = 2, app_name = app }))
      finally(function() testing.failpoint(client._core, { mode = "off" }) end)
      local code, out, err = bg:wait()
      assert.equal(7, code, err)
      assert.equal("ready\ngot TERM\n", out)
      assert.matches("lost the lock " .. name .. ": no renewal succeeded", err, 1, true)
      bg:cleanup()
    end)

    it("--on-lost=kill ends the command's whole process group: its grandchild is gone too", function()
      local name = helpers.unique("lostgroup")
      local bg = background(a("exec", "--ttl", "1", "--on-lost=kill", name, "--", "sh", "-c",
        "sleep 30 & echo sleeping $!; wait"))
      local grandchild = tonumber(bg:wait_output("sleeping (%d+)"))
      assert.is_false(gone(grandchild, 0) and true or false)   -- alive now
      assert.is_true(locks:force_release(name))
      local code, _, err = bg:wait()
      assert.equal(143, code, err)
      assert.matches("terminating", err, 1, true)
      assert.is_true(gone(grandchild), "the command's child outlived the lost lease")
      bg:cleanup()
    end)

    it("SIGKILLs what the command left in its group once the lease is lost and it has ended", function()
      local name = helpers.unique("lostleft")
      -- sh ends at SIGTERM; its background sleep ignores SIGTERM
      local bg = background(a("exec", "--ttl", "1", "--on-lost=kill", "--kill-after", "60", name, "--", "sh", "-c",
        "(trap '' TERM; sleep 30) & echo sleeping $!; while :; do sleep 0.05; done"))
      local sub = tonumber(bg:wait_output("sleeping (%d+)"))
      assert.is_true(locks:force_release(name))
      local code, _, err = bg:wait(20)
      assert.equal(143, code, err)
      assert.is_true(gone(sub), "a process of the group outlived the lost lease")
      bg:cleanup()
    end)

    it("says the lock was lost and exits 75 when the command succeeded without it", function()
      local name = helpers.unique("lost75")
      local go = os.tmpname(); os.remove(go)
      local bg = background(a("exec", "-v", "--on-lost=warn", "--ttl", "1", name, "--", "sh", "-c",
        "echo ready; while [ ! -e \"$1\" ]; do sleep 0.05; done", "sh", go))
      bg:wait_output("ready")
      assert.is_true(locks:force_release(name))
      poll(function() return read(bg.err):match("lost the lock") end, 10, "the warning")
      assert(os.execute("touch " .. q(go)))
      local code, _, err = bg:wait()
      os.remove(go)
      assert.equal(75, code, err)
      assert.is_nil(err:find("released " .. name, 1, true), err)
      bg:cleanup()
    end)

    it("a release whose reply and retry are lost, applied: says released (not 'not sent') and exits 0", function()
      local name = helpers.unique("relreply")
      local app = helpers.unique("clirel"):sub(1, 60)
      local go = os.tmpname(); os.remove(go)
      local bg = background(a("--app", app, "exec", "-v", name, "sh", "-c",
        "echo ready; while [ ! -e \"$1\" ]; do sleep 0.05; done", "sh", go))
      bg:wait_output("ready")
      -- the release commits and its reply is lost; libmongoc's retry finds
      -- its connection closed (nothing else writes meanwhile)
      local function fp(name_, mode, data)
        assert(client._core:command("admin", { configureFailPoint = name_ }, { mode = mode, data = data }))
      end
      finally(function()
        fp("onPrimaryTransactionalWrite", "off")
        fp("failCommand", "off")
      end)
      fp("failCommand", { skip = 1 }, { failCommands = { "update" }, closeConnection = true, appName = app })
      fp("onPrimaryTransactionalWrite", { times = 1 })
      assert(os.execute("touch " .. q(go)))
      local code, _, err = bg:wait()
      os.remove(go)
      assert.equal(0, code, err)
      assert.is_nil(err:find("not sent", 1, true), err)
      assert.matches("released " .. name, err, 1, true)
      assert.is_false(locks:status(name).held)
      bg:cleanup()
    end)

    it("a server that dies mid-run: says the release is unconfirmed, exits 69, within the server timeout", function()
      local server = private_server()
      finally(server.kill)
      local name = helpers.unique("dies")
      local go = os.tmpname(); os.remove(go)
      local bg = background({ "--uri", server.uri, "exec", "-v", name, "--", "sh", "-c",
        "echo ready; while [ ! -e \"$1\" ]; do sleep 0.05; done", "sh", go })
      bg:wait_output("ready")
      server.kill()
      assert(os.execute("touch " .. q(go)))
      local t0 = core.monotonic()
      local code, _, err = bg:wait(60)
      local took = core.monotonic() - t0
      os.remove(go)
      assert.equal(69, code, err)
      assert.matches("release of " .. name .. " unconfirmed", err, 1, true)
      assert.matches("the lock frees at the end of its lease", err, 1, true)
      assert.is_nil(err:find("released", 1, true), err)
      assert.is_nil(err:find("lost", 1, true), err)
      -- the release gives up within the server timeout (2 s)
      assert.is_true(took < 4 * 2, "exec ended " .. took .. " s after the command")
      bg:cleanup()
    end)

    it("follows SIGTERM with SIGKILL after --kill-after when the command ignores it", function()
      local name = helpers.unique("lostkill9")
      local bg = background(a("exec", "--ttl", "1", "--on-lost=kill", "--kill-after", "0.3", name, "--",
        "sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.05; done"))
      bg:wait_output("ready")
      assert.is_true(locks:force_release(name))
      local code, out, err = bg:wait()
      assert.equal(137, code, err)
      assert.equal("ready\n", out)
      bg:cleanup()
    end)
  end)

  describe("demo", function()
    it("runs examples/counter.lua with its arguments and passes its status through", function()
      local code, out, err = mongolock({ "--uri", helpers.uri(), "demo", "2", "3" })
      assert.equal(0, code, err)
      assert.matches("with the lock: +6 of 6", out)
    end)
  end)

  it("-v says when the lock is taken and released", function()
    local name = helpers.unique("verbose")
    local code, out, err = mongolock(a("exec", "-v", name, "--", "echo", "hi"))
    assert.equal(0, code, err)
    assert.equal("hi\n", out)
    assert.matches("took " .. name, err, 1, true)
    assert.matches("released " .. name, err, 1, true)
  end)

  describe("status and list", function()
    it("status --json tells a held lock's holder, token and lease", function()
      local name = helpers.unique("status")
      local h = assert(locks:acquire(name, { ttl = 20 }))
      local code, out, err = mongolock(a("status", "--json", name))
      assert.equal(0, code, err)
      local st = cjson.decode(out)
      assert.equal(name, st.name)
      assert.is_true(st.held)
      -- the token as a decimal string: exact (lua-cjson writes 14 digits)
      assert.equal(format("%.0f", h.token), st.token)
      assert.equal(h.owner, st.owner)
      assert.equal(core.getpid(), st.holder.pid)
      assert.is_true(st.remaining > 0 and st.remaining <= 20)
      -- and the text form says the same
      code, out = mongolock(a("status", name))
      assert.equal(0, code)
      assert.matches("state +held", out)
      assert.matches("token +" .. format("%.0f", h.token), out)
      assert.not_matches("waiting", out)
      assert.equal(0, st.waiting)
      -- a queued waiter shows
      local w = core.waiter_id()
      local _, berr = client._core:acquire(locks.database, locks.collection, name, 1000, nil, false,
        w, 30000)
      assert.equal("busy", berr)
      code, out = mongolock(a("status", name))
      assert.equal(0, code)
      assert.matches("waiting +1", out)
      assert.equal("held", st.state)
      -- it leaves (a release would grant it the lock)
      assert(client._core:leave(locks.database, locks.collection, name, w))
      assert.is_true(h:release())
      code, out = mongolock(a("status", "--json", name))
      assert.equal(1, code)     -- free
      st = cjson.decode(out)
      assert.is_false(st.held)
      assert.equal("free", st.state)
      assert.equal(format("%.0f", h.token), st.token)
    end)

    it("status and list show an expired lease as expired, with its last holder; status exits 1", function()
      local fresh = helpers.locks(client)
      local b = { "--uri", helpers.uri(), "--database", fresh.database, "--collection", fresh.collection }
      local name = "crashed"
      local h = assert(fresh:acquire(name, { ttl = 0.3, renew = false }))
      local held_code = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "status", name })
      assert.equal(0, held_code)
      core.sleep(0.6)   -- the holder neither renews nor releases: as if it crashed
      local code, out, err = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "status", "--json", name })
      assert.equal(1, code, err)
      local st = cjson.decode(out)
      assert.equal("expired", st.state)
      assert.is_false(st.held)
      assert.equal(core.getpid(), st.holder.pid)
      assert.equal(format("%.0f", h.token), st.token)
      assert.is_number(st.expires_at)
      code, out = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "status", name })
      assert.equal(1, code)
      assert.matches("state +expired", out)
      assert.matches("holder +%S+ pid " .. core.getpid(), out)
      assert.matches("\nexpired +%d%d%d%d%-%d%d%-%d%dT", out)
      code, out = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "list" })
      assert.equal(0, code)
      assert.matches("\ncrashed +expired +%d+ +%S+ pid " .. core.getpid(), out)
      code, out = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "list", "--json" })
      assert.equal(0, code)
      assert.equal("expired", cjson.decode(out)[1].state)
    end)

    it("list keeps its rows readable for a long name; --json has it whole", function()
      local name = helpers.unique("long") .. ("x"):rep(400)
      local h = assert(locks:acquire(name))
      local code, out, err = mongolock(a("list"))
      assert.equal(0, code, err)
      for line in out:gmatch("[^\n]+") do
        assert.is_true(#line <= 160, #line .. " characters: " .. line:sub(1, 80))
      end
      assert.matches(name:sub(1, 20), out, 1, true)
      code, out = mongolock(a("list", "--json"))
      assert.equal(0, code)
      local found
      for _, rec in ipairs(cjson.decode(out)) do found = found or rec.name == name end
      assert.is_true(found)
      assert.is_true(h:release())
    end)

    it("status of a lock never taken is free", function()
      local name = helpers.unique("never")
      local code, out = mongolock(a("status", "--json", name))
      assert.equal(1, code)
      assert.same({ name = name, held = false, state = "free" }, cjson.decode(out))
      code, out = mongolock(a("status", name))
      assert.equal(1, code)
      assert.matches("state +free", out)
    end)

    it("list --json gives every lock of the collection, held or not", function()
      local fresh = helpers.locks(client)
      local b = { "--uri", helpers.uri(), "--database", fresh.database, "--collection", fresh.collection }
      local code, out = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "list", "--json" })
      assert.equal(0, code)
      assert.equal("[]\n", out)
      local h1 = assert(fresh:acquire("beta"))
      local h2 = assert(fresh:acquire("alpha"))
      assert.is_true(h2:release())
      code, out = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "list", "--json" })
      assert.equal(0, code)
      local all = cjson.decode(out)
      assert.equal(2, #all)
      assert.equal("alpha", all[1].name)
      assert.is_false(all[1].held)
      assert.equal("beta", all[2].name)
      assert.is_true(all[2].held)
      assert.equal(format("%.0f", h1.token), all[2].token)
      code, out = mongolock({ b[1], b[2], b[3], b[4], b[5], b[6], "list" })
      assert.equal(0, code)
      assert.matches("^NAME +STATE +TOKEN +HOLDER +EXPIRES\nalpha +free", out)
      assert.matches("\nbeta +held", out)
      assert.is_true(h1:release())
    end)
  end)

  describe("release --force", function()
    it("asks first and releases only on yes", function()
      local name = helpers.unique("force")
      local h = assert(locks:acquire(name))
      local code, _, err = mongolock(a("release", "--force", name), { stdin = "n\n" })
      assert.equal(1, code)
      assert.matches("? [y/N]", err, 1, true)
      assert.is_true(locks:status(name).held)
      code = mongolock(a("release", "--force", name))   -- no answer at all
      assert.equal(1, code)
      assert.is_true(locks:status(name).held)
      code, _, err = mongolock(a("release", "--force", name), { stdin = "y\n" })
      assert.equal(0, code, err)
      assert.is_false(locks:status(name).held)
      -- the holder learns it
      local ok, herr = h:release()
      assert.is_nil(ok)
      assert.equal("lost", herr)
    end)

    it("releases without asking with --yes, and says when there is nothing to release", function()
      local name = helpers.unique("forceyes")
      assert(locks:acquire(name))
      local code, out, err = mongolock(a("release", "--force", "--yes", name))
      assert.equal(0, code, err)
      assert.equal("", out)
      assert.equal("", err)
      assert.is_false(locks:status(name).held)
      local _
      code, _, err = mongolock(a("release", "--force", "--yes", name))
      assert.equal(1, code)
      assert_one_line(err)
      assert.matches("not held", err, 1, true)
    end)
  end)

  describe("wait", function()
    it("returns 0 at once for a free lock and the conflict code on timeout", function()
      local name = helpers.unique("wait")
      assert.equal(0, (mongolock(a("wait", name))))
      local h = assert(locks:acquire(name))
      assert.equal(1, (mongolock(a("wait", "-w", "0.3", name))))
      assert.equal(4, (mongolock(a("wait", "-w", "0.3", "-E", "4", name))))
      assert.is_true(locks:status(name).held)   -- waiting never takes it
      assert.is_true(h:release())
    end)

    it("returns once the holder releases", function()
      local name = helpers.unique("waitrel")
      local h = assert(locks:acquire(name))
      local bg = background(a("wait", "-w", "20", name))
      bg:pid()
      core.sleep(0.2)
      assert.equal("", read(bg.rc))   -- still waiting
      assert.is_true(h:release())
      local code, _, err = bg:wait()
      assert.equal(0, code, err)
      bg:cleanup()
    end)

    it("returns once the holder's lease expires", function()
      local name = helpers.unique("waitexp")
      assert(locks:acquire(name, { ttl = 0.5 }))
      local code = mongolock(a("wait", "-w", "20", name))
      assert.equal(0, code)
      assert.is_false(locks:status(name).held)
    end)
  end)
end)
