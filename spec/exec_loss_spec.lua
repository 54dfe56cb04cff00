-- The command's child at the end of a lease (issue 46): a holder cut off
-- from the server (a TCP proxy frozen with SIGSTOP, spec/proxy.js) has
-- ended its command's process group before another exec (or elect) of the
-- same name can start its own, and says "lost" at once.
--   #integration  against helpers.uri(), mongolock run as separate processes
--
-- The children time themselves (date +%s.%N, the wall clock both share):
-- the old child appends a time every 10 ms and ignores SIGTERM (the worst
-- child: only SIGKILL ends it); the new one writes the time it started and
-- whether the old child was still alive then.
local helpers = require "helpers"
local core = require "mongolock.core"

local format = string.format
local q = helpers.shell_quote

local function read(path)
  return helpers.read_file(path) or ""
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

-- a temporary directory for one run's files
local function tmpdir()
  local p = io.popen("mktemp -d")
  local d = p:read("*l")
  p:close()
  return d
end

-- bin/mongolock with args in the background; stdout to dir/NAME.out, each
-- line of stderr to dir/NAME.err after the wall-clock time it came
-- (seconds, as date +%s.%N), the exit status to dir/NAME.rc
local function start(dir, label, args)
  local f = function(ext) return q(dir .. "/" .. label .. "." .. ext) end
  os.execute(format("( { %s </dev/null; echo $? >%s; } 2>&1 >%s | "
    .. "while IFS= read -r l; do printf '%%s %%s\\n' \"$(date +%%s.%%N)\" \"$l\"; done >%s ) "
    .. ">/dev/null 2>&1 &", helpers.cli_words(args), f("rc.tmp"), f("out"), f("err")))
  return {
    wait = function(timeout)
      local rc = poll(function()
        local s = read(dir .. "/" .. label .. ".rc.tmp")
        return s:match("%d+") and read(dir .. "/" .. label .. ".err") ~= nil and tonumber(s:match("%d+"))
      end, timeout or 60, label .. "'s exit")
      core.sleep(0.05)   -- the stderr reader's last lines
      return rc, read(dir .. "/" .. label .. ".out"), read(dir .. "/" .. label .. ".err")
    end,
  }
end

-- the old holder's command: its pid to dir/a.pid (mongolock's to
-- dir/a.ppid), SIGTERM's time to
-- dir/a.term (and it goes on), a time every 10 ms to dir/a.times
local function old_child(dir)
  return { "sh", "-c", format("echo $PPID >%s; echo $$ >%s; trap 'date +%%s.%%N >>%s' TERM; "
    .. "while :; do date +%%s.%%N >>%s; sleep 0.01; done",
    q(dir .. "/a.ppid"), q(dir .. "/a.pid"), q(dir .. "/a.term"), q(dir .. "/a.times")) }
end

-- the new holder's command: "TIME STATE" to dir/b.start, STATE the old
-- child's (ps stat; empty or Z: gone)
local function new_child(dir)
  return { "sh", "-c", format("t=$(date +%%s.%%N); s=$(ps -o stat= -p \"$(cat %s)\" 2>/dev/null); "
    .. "echo \"$t [$s]\" >%s", q(dir .. "/a.pid"), q(dir .. "/b.start")) }
end

local function last_time(path)
  local t
  for line in read(path):gmatch("[^\n]+") do t = tonumber(line) or t end
  return t
end

describe("#integration a holder cut off from the server", function()
  local base

  setup(function()
    local client = helpers.connect()
    local locks = helpers.locks(client)
    base = { "--database", locks.database, "--collection", locks.collection }
    client:close()
  end)

  local function args(uri, ...)
    local t = { "--uri", uri }
    for _, v in ipairs(base) do t[#t + 1] = v end
    for _, v in ipairs({ ... }) do t[#t + 1] = v end
    return t
  end

  local function cat(t, ...)
    local r = {}
    for _, v in ipairs(t) do r[#r + 1] = v end
    for _, u in ipairs({ ... }) do for _, v in ipairs(u) do r[#r + 1] = v end end
    return r
  end

  -- One race: the holder A runs old_child through a proxy that is then
  -- frozen; B (straight to the server) waits for NAME and runs new_child.
  -- Returns what to judge: the old child's last time, the new child's
  -- start and the old child's state then, A's and B's outcomes.
  local function race(cmd, a_opts, b_opts, b_wait)
    local dir = tmpdir()
    local proxy = helpers.proxy()
    finally(function()
      proxy:stop()
      os.execute("rm -rf " .. q(dir))
    end)
    local name = helpers.unique("cutoff")
    local a = start(dir, "a", cat(args(proxy.uri, cmd), a_opts, { name }, old_child(dir)))
    poll(function() return last_time(dir .. "/a.times") end, 20, "the old child's first time")
    proxy:freeze()
    local b = start(dir, "b", cat(args(helpers.uri(), cmd, "-w", tostring(b_wait)), b_opts, { name },
      new_child(dir)))
    local b_rc, _, b_err = b.wait(b_wait + 30)
    proxy:stop()    -- (A's release, if it still tries one, fails at once)
    local a_rc, _, a_err = a.wait(60)
    local t, state = read(dir .. "/b.start"):match("^(%S+) %[(.-)%]")
    return { old_last = last_time(dir .. "/a.times"), new_start = tonumber(t), old_state = state,
      a_rc = a_rc, a_err = a_err, b_rc = b_rc, b_err = b_err, term = last_time(dir .. "/a.term") }
  end

  local function judge(r, label)
    if os.getenv("EXEC_LOSS_FIGURES") then
      io.stderr:write(format("# %s: the new child started %.1f ms after the old one's last time\n", label,
        ((r.new_start or 0) - (r.old_last or 0)) * 1000))
    end
    assert.equal(0, r.b_rc, label .. ": B: " .. r.b_err)
    assert.is_number(r.new_start, label .. ": the new child did not run")
    assert.is_number(r.old_last, label)
    -- the old child ignores SIGTERM: SIGKILL ended it (sh killed by 9)
    assert.equal(137, r.a_rc, label .. ": A: " .. r.a_err)
    assert.matches("lost the lock", r.a_err, 1, true)
    assert.is_true(r.old_state == "" or r.old_state:match("^Z") ~= nil,
      format("%s: the old child was alive (%s) when the new one started", label, r.old_state))
    assert.is_true(r.old_last < r.new_start, format("%s: the old child wrote at %.6f, the new one started at %.6f "
      .. "(%.1f ms later)", label, r.old_last, r.new_start, (r.old_last - r.new_start) * 1000))
  end

  it("exec: the old child is dead before the new one starts, 10 runs of 10 (--ttl 2 --kill-after 0.9)", function()
    for i = 1, 10 do
      judge(race("exec", { "--ttl", "2", "--kill-after", "0.9" }, {}, 10), "run " .. i)
    end
  end)

  it("elect: the old leader's child is dead before the new leader's starts (--ttl 2 --kill-after 0.9)", function()
    for i = 1, 2 do
      judge(race("elect", { "--ttl", "2", "--kill-after", "0.9" }, {}, 10), "run " .. i)
    end
  end)

  it("exec with the command's defaults (ttl 30 s, --kill-after 10): the old child is dead first", function()
    judge(race("exec", {}, {}, 60), "defaults")
  end)

  it("a lock taken over: says 'lost' with the signal, then who holds it now in a second line", function()
    local dir = tmpdir()
    local client = helpers.connect()
    local locks = helpers.locks(client, { collection = base[4] })
    finally(function()
      client:close()
      os.execute("rm -rf " .. q(dir))
    end)
    local name = helpers.unique("takeover")
    -- (no lock-delay: a forced release would keep the name for it)
    local a = start(dir, "a", cat(args(helpers.uri(), "exec", "--ttl", "3", "--lock-delay", "0", name),
      old_child(dir)))
    poll(function() return last_time(dir .. "/a.times") end, 20, "the child's first time")
    assert.is_true(locks:force_release(name))
    local h = assert(locks:acquire(name, { ttl = 30, timeout = 5 }))
    local rc, _, err = a.wait(30)
    assert.equal(137, rc, err)       -- (its child ignores SIGTERM)
    local first, second = err:match("(mongolock: lost the lock [^\n]*)\n.-(mongolock: lost the lock [^\n]*)")
    assert.is_truthy(first, err)
    assert.matches(name .. ": the server no longer has this holder's lease; terminating sh", first, 1, true)
    assert.matches(name .. ": it is now held by ", second, 1, true)
    assert.matches("(token " .. h:token_string() .. ")", second, 1, true)
    assert.is_true(h:release())
  end)

  it("mongolock itself stopped past its lease's end: at SIGCONT it kills its command at once", function()
    local dir = tmpdir()
    finally(function() os.execute("rm -rf " .. q(dir)) end)
    local name = helpers.unique("stopped")
    local a = start(dir, "a", cat(args(helpers.uri(), "exec", "--ttl", "2", "--kill-after", "5", name),
      old_child(dir)))
    poll(function() return last_time(dir .. "/a.times") end, 20, "the child's first time")
    local ml = tonumber(read(dir .. "/a.ppid"))
    os.execute(format("kill -STOP %d", ml))
    core.sleep(2.5)           -- past the lease's end: its command runs on meanwhile
    local p = io.popen(format("kill -CONT %d; date +%%s.%%N", ml))
    local cont = tonumber(p:read("*l"))
    p:close()
    local rc, _, err = a.wait(30)
    assert.equal(137, rc, err)
    assert.matches("lost the lock " .. name .. ": no renewal succeeded within its ttl (2 s); terminating", err, 1,
      true)
    -- no grace: SIGKILL came with SIGTERM (a generous bound for a loaded host)
    local last = last_time(dir .. "/a.times")
    assert.is_true(last - cont < 0.5, format("the command ran %.3f s after SIGCONT", last - cont))
  end)

  it("says 'lost' within 0.1 s of SIGTERM while the server does not answer (--server-timeout 5)", function()
    local dir = tmpdir()
    local proxy = helpers.proxy()
    finally(function()
      proxy:stop()
      os.execute("rm -rf " .. q(dir))
    end)
    local name = helpers.unique("saylost")
    local a = start(dir, "a", cat(args(proxy.uri, "--server-timeout", "5", "exec", "--ttl", "3", "--kill-after",
      "1", name), old_child(dir)))
    poll(function() return last_time(dir .. "/a.times") end, 20, "the child's first time")
    proxy:freeze()
    local term = poll(function() return last_time(dir .. "/a.term") end, 20, "SIGTERM")
    local said = poll(function()
      return tonumber(read(dir .. "/a.err"):match("(%S+) mongolock: lost the lock"))
    end, 20, "the 'lost' line")
    assert.is_true(said - term < 0.1, format("'lost' came %.3f s after SIGTERM", said - term))
    local rc, _, err = a.wait(60)
    assert.equal(137, rc, err)
    -- its first line is the loss and the kill, the lookup's (if any) after
    local first = err:match("(mongolock: [^\n]*)")
    assert.matches("lost the lock " .. name, first, 1, true)
    assert.matches("terminating sh", first, 1, true)
  end)
end)

describe("#unit the kill window of exec and elect", function()
  local cli = require "mongolock.cli"
  it("keeps --kill-after when it and the margin fit in half the ttl, else cuts it to fit", function()
    assert.equal(0.1, cli.KILL_MARGIN)
    assert.equal(10, cli.kill_window(30, 10))
    assert.equal(0.9, cli.kill_window(2, 0.9))
    assert.near(0.9, cli.kill_window(2, 1), 1e-9)
    assert.near(0.4, cli.kill_window(1, 10), 1e-9)
    assert.equal(0, cli.kill_window(1, 0))
    assert.near(14.9, cli.kill_window(30, 60), 1e-9)
  end)
end)
