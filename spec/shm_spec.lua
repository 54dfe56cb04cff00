-- libmongoc's statistics segment, /dev/shm/mongoc-PID: a process that loads
-- mongolock leaves none behind, even when killed, and removes those that
-- dead processes left (a later process given the same pid would find the
-- name taken and print "Falling back to malloc for counters" on stderr).
local helpers = require "helpers"
local core = require "mongolock.core"

local SHM = "/dev/shm/"

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function touch(path)
  local f = assert(io.open(path, "wb"))
  f:close()
end

-- the pid of a process that has exited (a shell started and waited for)
local function dead_pid()
  local p = assert(io.popen("sh -c 'echo $$'", "r"))
  local pid = tonumber(p:read("*l"))
  p:close()
  return pid
end

local LOAD = [[
local core = require "mongolock.core"
io.stdout:write("pid ", core.getpid(), "\n")
io.stdout:flush()
if ... == "kill" then os.execute("kill -9 " .. core.getpid()) end
]]

describe("#integration libmongoc's counters segment", function()
  if not exists(SHM) then
    pending("no /dev/shm on this machine")
    return
  end

  local script
  setup(function() script = helpers.script(LOAD) end)
  teardown(function() os.remove(script) end)

  it("is not left behind by a process killed with SIGKILL", function()
    local out = helpers.run(script, { "kill" })
    local pid = assert(tonumber(out:match("pid (%d+)")), out)
    assert.is_false(exists(SHM .. "mongoc-" .. pid))
  end)

  it("of a dead process is removed when mongolock loads; others are kept", function()
    local dead = SHM .. "mongoc-" .. dead_pid()
    local live = SHM .. "mongoc-" .. core.getpid()   -- this process is alive
    local odd = { SHM .. "mongoc-0" .. dead_pid(), SHM .. "mongoc-x", SHM .. "mongoc-" }
    touch(dead); touch(live)
    for _, f in ipairs(odd) do touch(f) end
    local out, ok = helpers.run(script)
    local dead_gone, live_kept = not exists(dead), exists(live)
    local odd_kept = true
    for _, f in ipairs(odd) do
      odd_kept = odd_kept and exists(f)
      os.remove(f)
    end
    os.remove(dead); os.remove(live)
    assert.is_true(ok, out)
    assert.is_true(dead_gone, "a dead process's name was kept")
    assert.is_true(live_kept, "a live process's name was removed")
    assert.is_true(odd_kept, "a name that is not mongoc-PID was removed")
    -- the child started quietly: its stdout/stderr hold only its pid line
    assert.matches("^pid %d+\n$", out)
  end)
end)
