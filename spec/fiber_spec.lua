-- #integration: round trips in the event loop's own thread (pool:here,
-- csrc/driver/fiber.h).  A scheduler's coroutine runs its op on a fiber in
-- the loop's thread: while the server has not answered, the loop waits on
-- the connection's own socket, and no worker thread is woken.  What cannot
-- run so (an op of a session, a closed pool) answers false and goes to a
-- worker thread; an op that did not apply (a step-down) goes there too,
-- whose server selection waits through the election off the loop
-- (sched_spec.lua: "round trips go on through an election").  luv is not
-- loaded here: busted unloads a file's modules after it, and luv loaded a
-- second time in one process (sched_spec) finds its loop closed.
local helpers = require "helpers"
local core = require "mongolock.core"

-- the descriptor's kind in this process: "socket", "anon_inode:[eventfd]"...
local function fd_kind(fd)
  local p = io.popen(string.format("readlink /proc/%d/fd/%d", core.getpid(), fd))
  local link = p:read("l") or ""
  p:close()
  return link
end

-- pool:here(op) once the fibers' monitor knows a server that takes writes
-- again (asked to look at most every half second after a connection failed)
local function here_soon(pool, op)
  local deadline = core.monotonic() + 10
  while true do
    local h = pool:here(op)
    if h then return h end
    assert(core.monotonic() < deadline, "pool:here never ran an op")
    core.sleep(0.01)
  end
end

local function fail_point(client, mode, data)
  return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
end

describe("#integration round trips in the loop's own thread", function()
  local client, app, pool, coll, op

  setup(function()
    app = helpers.unique("fiber")
    client = helpers.connect({ appname = app })
    coll = helpers.unique("locks")
    pool = assert(core.pool(client._core, 1))
    op = core.op_status{ db = helpers.database, coll = coll, name = "x" }
    -- the fibers' connections come from a pool of their own, whose monitor
    -- finds the server in a moment: until then here answers false
    local h = here_soon(pool, op)
    while h:step() == false do core.sleep(0.001) end
  end)

  teardown(function()
    fail_point(client, "off")
    pool:close()
    client:close()
  end)

  local function pack(...) return { n = select("#", ...), ... } end

  -- steps h until it answers; the descriptors it waited on
  local function finish(h)
    local fds = {}
    while true do
      local r = pack(h:step())
      if r[1] ~= false then return r, fds end
      assert.is_number(r[2], "an op that did not apply, in this test")
      fds[#fds + 1] = r[2]
      core.sleep(0.005)
    end
  end

  it("runs an op while the loop waits on the connection's own socket, and answers what a worker thread's "
     .. "job answers", function()
    fail_point(client, "alwaysOn", { failCommands = { "find", "aggregate" }, blockConnection = true,
      blockTimeMS = 200, appName = app })
    local h = pool:here(op)
    assert.is_userdata(h)
    local r, fds = finish(h)
    fail_point(client, "off")
    assert.is_string(r[1], tostring(r[2]))
    assert.truthy(#fds > 0, "it never waited for the delayed reply")
    assert.truthy(fd_kind(fds[1]):find("^socket:"), fd_kind(fds[1]))
    local job = assert(pool:submit(op))
    local jr
    repeat jr = pack(job:take()); core.sleep(0.005) until jr[1] ~= false
    assert.same(core.bson_decode(jr[1]).cursor.firstBatch, core.bson_decode(r[1]).cursor.firstBatch)
    assert.same({ nil, "taken" }, { h:step() })
  end)

  it("an op let go of while it waits (closed, or collected) ends at once, and its connection serves "
     .. "the next op", function()
    fail_point(client, "alwaysOn", { failCommands = { "find", "aggregate" }, blockConnection = true,
      blockTimeMS = 1000, appName = app })
    local h = assert(pool:here(op))
    assert.is_false((h:step()))
    local t0 = core.monotonic()
    assert.is_true(h:close())
    assert.truthy(core.monotonic() - t0 < 0.5, "close waited for the server")
    assert.same({ nil, "taken" }, { h:step() })
    -- the cancelled read closed its connection: the next op waits for the
    -- monitor's next look, then has a new one
    local h2 = here_soon(pool, op)
    assert.is_false((h2:step()))
    h2 = nil                        -- luacheck: ignore 311
    collectgarbage()
    collectgarbage()
    fail_point(client, "off")
    local r = finish(here_soon(pool, op))
    assert.is_string(r[1], tostring(r[2]))
  end)

  it("in a forked child, an op the parent left waiting is abandoned, and the pool answers false", function()
    local testing = require "mongolock.testing"
    fail_point(client, "alwaysOn", { failCommands = { "find", "aggregate" }, blockConnection = true,
      blockTimeMS = 500, appName = app })
    local h = here_soon(pool, op)
    assert.is_false((h:step()))
    local child = assert(testing.fork())
    if child == 0 then
      local ok = pcall(function()
        assert(pool:here(op) == false)
        assert(h:close())
        h = nil                       -- luacheck: ignore 311
        collectgarbage()
      end)
      testing.exit(ok and 0 or 1)
    end
    assert.equal(0, testing.waitpid(child, 10))
    -- the parent's op goes on as if nothing happened
    local r = finish(h)
    fail_point(client, "off")
    assert.is_string(r[1], tostring(r[2]))
  end)

  it("answers false where it cannot run: an op of a session, a closed pool; a wrong op raises", function()
    local watch = core.op_watch{ db = helpers.database, coll = coll, field = "owner", t = 1, i = 1,
      tag = string.rep("a", 16), session = string.rep("ab", 16) }
    assert.is_false(pool:here(watch))
    assert.has_error(function() pool:here("x") end)
    assert.has_error(function() pool:here(42) end)
    local p2 = assert(core.pool(client._core, 1))
    p2:close()
    assert.is_false(p2:here(op))
  end)
end)
