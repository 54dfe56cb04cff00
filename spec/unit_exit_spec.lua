-- #unit: process exit while a client is open.  Background threads may be
-- inside libmongoc or OpenSSL when the process exits, so with a pool open
-- the exit skips the teardown registered before the first pool (it would
-- free what those threads use); with every client closed, exit is normal.
local helpers = require "helpers"

local function exit_with(mode)
  local mark = os.tmpname()
  os.remove(mark)
  local out, _, status = helpers.run(helpers.root .. "/spec/exit_child.lua", { mode, mark })
  local f = io.open(mark)
  if f then f:close() end
  os.remove(mark)
  return out, status, f ~= nil
end

describe("#unit process exit", function()
  for _, case in ipairs({
    { "open", false, "with a client open keeps the status and stdout and skips the earlier exit handlers" },
    { "closed", true, "with every client closed runs the exit handlers as usual" },
    { "none", true, "without a client runs the exit handlers as usual" },
  }) do
    local mode, handlers_ran, title = case[1], case[2], case[3]
    it(title, function()
      local out, status, marked = exit_with(mode)
      assert.equal(7, status)
      assert.equal("bye", out)
      assert.equal(handlers_ran, marked)
    end)
  end

  it("a child that dies of a signal prints its C backtrace (testing.crash_trace, every spawned child)", function()
    local script = helpers.script([[
      local core = require "mongolock.core"
      io.stdout:write("before\n")
      io.stdout:flush()
      os.execute("kill -SEGV " .. core.getpid())
      io.stdout:write("after\n")
    ]])
    local out, _, status = helpers.run(script, {})
    os.remove(script)
    assert.equal(128 + 11, status, out)
    assert.matches("before", out)
    assert.not_matches("after", out)
    assert.matches("mongolock.testing: signal 11 in pid %d+, thread %d+; backtrace:", out)
  end)

  it("a forked child past testing.waitpid's deadline says where it is stuck before it is killed", function()
    local script = helpers.script([[
      local core = require "mongolock.core"
      local testing = require "mongolock.testing"
      testing.crash_trace()
      local pid = assert(testing.fork())
      if pid == 0 then
        core.sleep(30)
        testing.exit(0)
      end
      local st, err = testing.waitpid(pid, 0.2)
      io.stdout:write("child ", pid, " ", tostring(st), " ", tostring(err), "\n")
    ]])
    local out, _, status = helpers.run(script, {})
    os.remove(script)
    assert.equal(0, status, out)
    local pid = assert(out:match("child (%d+) nil timeout"), out)
    assert.matches("mongolock.testing: child " .. pid .. " past its deadline", out, 1, true)
    assert.matches("mongolock.testing: signal 6 in pid " .. pid .. ", thread %d+; backtrace:", out)
  end)

  it("so does a spec process: loading spec/helpers.lua asks for the crash trace", function()
    -- the interpreter alone, without helpers.command's own request for it
    local script = helpers.script(([[
      package.path = %q .. "/spec/?.lua;" .. package.path
      require "helpers"
      local core = require "mongolock.core"
      os.execute("kill -SEGV " .. core.getpid())
    ]]):format(helpers.root))
    local cpath = os.getenv("LUA_CPATH") or (helpers.root .. "/build/" .. helpers.lua .. "/?.so;;")
    local p = assert(io.popen(("LUA_CPATH='%s' MONGOLOCK_NO_SERVER=1 %s %s 2>&1; echo \"exit:$?\""):format(
      cpath, helpers.lua, script)))
    local out = p:read("*a")
    p:close()
    os.remove(script)
    assert.equal(128 + 11, tonumber(out:match("exit:(%d+)%s*$")), out)
    assert.matches("mongolock.testing: signal 11 in pid %d+, thread %d+; backtrace:", out)
  end)
end)
