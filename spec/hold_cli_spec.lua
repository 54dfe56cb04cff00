-- mongolock hold NAME: takes the lock, prints its token, holds it (renewed)
-- until a signal or the end of stdin, then releases it; run as an OS process.
local helpers = require "helpers"
local core = require "mongolock.core"

local format = string.format
local q = helpers.shell_quote

local mongolock = helpers.mongolock

local function read(path)
  return helpers.read_file(path) or ""
end

local function alive(pid)
  local r = os.execute("kill -0 " .. pid .. " 2>/dev/null")
  return r == true or r == 0                       -- (Lua 5.1: a number)
end

describe("#unit mongolock hold: usage", function()
  it("is in --help, with its options", function()
    local code, out = mongolock({ "--help" })
    assert.equal(0, code)
    assert.matches("Commands:.-\n   hold ", out)
    local c, o = mongolock({ "hold", "--help" })
    assert.equal(0, c)
    for _, opt in ipairs({ "--timeout", "--nonblock", "--ttl", "--conflict-exit-code", "--shared", "--permits",
      "--verbose" }) do
      assert.matches(opt, o, 1, true)
    end
  end)

  it("needs NAME and takes no command", function()
    local env = { env = "MONGODB_URI=mongodb://127.0.0.1:9/" }
    local code, _, err = mongolock({ "hold" }, env)
    assert.equal(64, code, err)
    code, _, err = mongolock({ "hold", "job", "true" }, env)
    assert.equal(64, code, err)
    code, _, err = mongolock({ "hold", "-n", "-w", "1", "job" }, env)
    assert.equal(64, code, err)
  end)
end)

describe("#integration mongolock hold", function()
  local client, locks, coll

  setup(function()
    client = helpers.connect({ appname = "hold-spec" })
    coll = helpers.unique("hold")
    locks = client:locks({ database = helpers.database, collection = coll })
  end)
  teardown(function() client:close() end)

  local function args(...)
    local t = { "--uri", helpers.uri(), "--database", helpers.database, "--collection", coll, "hold" }
    for _, a in ipairs({ ... }) do t[#t + 1] = a end
    return t
  end

  -- starts `mongolock hold ...` in the background, its stdin `input` (shell
  -- words, e.g. "</dev/null" or "sleep 3 |"); :wait() -> status, stdout, stderr
  local function background(input, list)
    local self = { out = os.tmpname(), err = os.tmpname(), rc = os.tmpname(), pidf = os.tmpname() }
    os.remove(self.rc)
    local pre, redirect = "", input
    if input:match("|%s*$") then pre, redirect = input, "" end
    os.execute(format("( %s%s%s %s >%s 2>%s & echo $! >%s; wait $!; echo $? >%s ) >/dev/null 2>&1 &",
      pre, helpers.child_env, helpers.cli_words(list), redirect, q(self.out), q(self.err), q(self.pidf),
      q(self.rc)))
    function self.pid(s)
      return helpers.eventually(function() return tonumber(read(s.pidf):match("%d+")) end, 10)
    end
    function self.token(s)
      return helpers.eventually(function() return read(s.out):match("^(%d+)\n") end, 15)
    end
    function self.wait(s, timeout)
      local rc = helpers.eventually(function() return tonumber(read(s.rc):match("%d+")) end, timeout or 30)
      assert(rc, "still running: " .. read(s.out) .. read(s.err))
      local o, e = read(s.out), read(s.err)
      for _, f in ipairs({ s.out, s.err, s.rc, s.pidf }) do os.remove(f) end
      return rc, o, e
    end
    return self
  end

  it("prints the token's exact digits, holds and renews the lock until stdin ends, then releases it", function()
    local name = helpers.unique("stdin")
    local t0 = core.monotonic()
    local b = background("sleep 4 |", args("--ttl", "1", "-v", name))
    local token = b:token()
    assert.is_truthy(token, read(b.err))
    local st = assert(locks:status(name))
    assert.is_true(st.held)
    assert.equal(format("%.0f", st.token), token)
    assert.equal("mongolock-cli", st.holder.app)
    -- renewed: still held after more than its ttl of 1 s
    core.sleep(2)
    if core.monotonic() - t0 < 3.5 then
      assert.is_true(assert(locks:status(name)).held)
    end
    local code, out, err = b:wait(30)
    assert.equal(0, code, err)
    assert.equal(token .. "\n", out)
    assert.matches("released " .. name, err, 1, true)
    assert.is_false(assert(locks:status(name)).held)
  end)

  it("holds until SIGTERM when stdin is /dev/null, then releases and exits 0", function()
    local name = helpers.unique("term")
    local b = background("</dev/null", args(name))
    local token = b:token()
    assert.is_truthy(token, read(b.err))
    local pid = b:pid()
    core.sleep(0.5)
    assert.is_true(alive(pid))
    assert.is_true(assert(locks:status(name)).held)
    os.execute("kill -TERM " .. pid)
    local code, _, err = b:wait(15)
    assert.equal(0, code, err)
    assert.is_false(assert(locks:status(name)).held)
  end)

  it("-n and -w give up on a held lock with -E's status, printing nothing", function()
    local name = helpers.unique("busy")
    local h = assert(locks:acquire(name))
    local code, out = mongolock(args("-n", name))
    assert.equal(1, code)
    assert.equal("", out)
    local t0 = core.monotonic()
    code, out = mongolock(args("-w", "0.5", "-E", "3", name))
    assert.equal(3, code)
    assert.equal("", out)
    assert.is_true(core.monotonic() - t0 >= 0.5)
    assert.is_true(h:release())
  end)

  it("takes a permit of a semaphore with --permits", function()
    local name = helpers.unique("permit")
    local sems = client:semaphores({ database = helpers.database, collection = coll, permits = 2 })
    local b = background("</dev/null", args("--permits", "2", name))
    local token = b:token()
    assert.is_truthy(token, read(b.err))
    assert.equal(1, assert(sems:status(name)).in_use)
    os.execute("kill -TERM " .. b:pid())
    assert.equal(0, (b:wait(15)))
    assert.equal(0, assert(sems:status(name)).in_use)
  end)

  it("exits 75 and says so when the lock is lost", function()
    local name = helpers.unique("lost")
    local b = background("</dev/null", args("--ttl", "1", name))
    assert.is_truthy(b:token(), read(b.err))
    assert.is_true(locks:force_release(name))
    local code, _, err = b:wait(15)
    assert.equal(75, code, err)
    assert.matches("lost the lock " .. name, err, 1, true)
  end)
end)
