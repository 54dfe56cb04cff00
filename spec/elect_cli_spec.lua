-- The command's elections: `mongolock elect NAME [--value V] CMD...` and
-- `mongolock leader NAME [--watch] [--json]`, run as OS processes.
local helpers = require "helpers"
local cjson = require "cjson"
local core = require "mongolock.core"

local format = string.format
local q = helpers.shell_quote

local function read(path)
  return helpers.read_file(path) or ""
end

local words, mongolock = helpers.cli_words, helpers.mongolock

-- starts it in the background: :wait() -> status, stdout, stderr
local function background(args)
  local self = { out = os.tmpname(), err = os.tmpname(), rc = os.tmpname() }
  os.remove(self.rc)
  os.execute(format("( %s%s </dev/null >%s 2>%s; echo $? >%s ) >/dev/null 2>&1 &", helpers.child_env,
    words(args), q(self.out), q(self.err), q(self.rc)))
  function self.wait(s, timeout)
    local deadline = core.monotonic() + (timeout or 30)
    repeat
      local rc = tonumber(read(s.rc):match("%d+"))
      if rc then
        local o, e = read(s.out), read(s.err)
        for _, f in ipairs({ s.out, s.err, s.rc }) do os.remove(f) end
        return rc, o, e
      end
      core.sleep(0.02)
    until core.monotonic() > deadline
    error("still running: " .. read(s.out) .. read(s.err))
  end
  return self
end

describe("#unit mongolock elect and leader: usage", function()
  it("lists elect and leader in --help", function()
    local code, out = mongolock({ "--help" })
    assert.equal(0, code)
    assert.is_truthy(out:find("elect", 1, true))
    assert.is_truthy(out:find("leader", 1, true))
  end)

  it("refuses elect without a command", function()
    local code, _, err = mongolock({ "--uri", "mongodb://127.0.0.1:9/", "elect", "job" })
    assert.equal(64, code, err)
  end)
end)

describe("#integration mongolock elect and leader", function()
  local coll
  setup(function()
    coll = helpers.unique("elect")
  end)

  local function elect(name, value, script)
    -- mongolock's options before NAME: every word after it is the command's
    local args = { "--database", helpers.database, "--collection", coll, "elect", "--ttl", "3" }
    if value then args[#args + 1] = "--value"; args[#args + 1] = value end
    args[#args + 1] = name
    args[#args + 1] = "sh"
    args[#args + 1] = "-c"
    args[#args + 1] = script
    return args
  end

  local function leader(name, ...)
    local args = { "--database", helpers.database, "--collection", coll, "leader", name, ... }
    return args
  end

  it("runs only one of two commands at once, and hands over when the first exits", function()
    local name = helpers.unique("e")
    local log = os.tmpname()
    local script = format([[echo "B $MONGOLOCK_TOKEN $$" >>%s; sleep 0.8; echo "E $MONGOLOCK_TOKEN $$" >>%s]],
      q(log), q(log))
    local a = background(elect(name, "a", script))
    local b = background(elect(name, "b", script))
    local ca, _, ea = a:wait(30)
    local cb, _, eb = b:wait(30)
    assert.equal(0, ca, ea)
    assert.equal(0, cb, eb)
    local lines = {}
    for l in io.lines(log) do lines[#lines + 1] = l end
    os.remove(log)
    assert.equal(4, #lines, table.concat(lines, "\n"))
    -- B E B E: the second began after the first ended, with a later term
    local t1 = lines[1]:match("^B (%d+)")
    assert.is_truthy(t1)
    assert.equal("E " .. t1, lines[2]:match("^E %d+"))
    local t2 = lines[3]:match("^B (%d+)")
    assert.is_truthy(t2)
    assert.equal("E " .. t2, lines[4]:match("^E %d+"))
    assert.is_true(tonumber(t2) > tonumber(t1))
  end)

  it("leader --json names the leader's value and term; exit 1 and no leader when nobody leads", function()
    local name = helpers.unique("e")
    local code, out = mongolock(leader(name))
    assert.equal(1, code)
    assert.is_truthy(out:find("no leader", 1, true), out)
    local tokfile = os.tmpname()
    local a = background(elect(name, "host-a:8080", format([[echo $MONGOLOCK_TOKEN >%s; sleep 2]], q(tokfile))))
    local j
    assert.is_truthy(helpers.eventually(function()
      local c, o = mongolock(leader(name, "--json"))
      if c ~= 0 then return nil end
      j = cjson.decode(o)
      return read(tokfile):match("%d+")
    end, 10))
    assert.is_true(j.leader)
    assert.equal("host-a:8080", j.value)
    assert.equal(read(tokfile):match("%d+"), j.token)
    assert.is_truthy(j.holder and j.holder.host)
    local c2, o2 = mongolock(leader(name))
    assert.equal(0, c2)
    assert.is_truthy(o2:find("host-a:8080", 1, true), o2)
    assert.equal(0, (a:wait(20)))
    os.remove(tokfile)
  end)

  it("leader --watch -w exits 1 when nobody led before the time was up", function()
    local name = helpers.unique("nobody")
    local code, out, err = mongolock(leader(name, "--watch", "-w", "1"))
    assert.equal(1, code, err)
    assert.matches("no leader of " .. name, out, 1, true)
    code, out, err = mongolock(leader(name, "--watch", "--json", "-w", "1"))
    assert.equal(1, code, err)
    assert.is_false(cjson.decode(out:match("[^\n]+")).leader)
  end)

  it("leader --watch prints the leader, then each change", function()
    local name = helpers.unique("e")
    local w = background(leader(name, "--watch", "--json", "-w", "4"))
    core.sleep(0.5)
    local a = background(elect(name, "first", "sleep 0.5"))
    assert.equal(0, (a:wait(20)))
    local code, out, err = w:wait(20)
    assert.equal(0, code, err)
    local changes = {}
    for l in out:gmatch("[^\n]+") do changes[#changes + 1] = cjson.decode(l) end
    assert.equal(3, #changes, out)
    assert.equal("current", changes[1].change)
    assert.is_false(changes[1].leader)
    assert.equal("leader", changes[2].change)
    assert.equal("first", changes[2].value)
    assert.equal("none", changes[3].change)
  end)
end)
