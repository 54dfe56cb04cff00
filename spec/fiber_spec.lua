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

-- a build without fibers (AddressSanitizer: fiber.c makes none) runs every
-- op in a worker thread: pool:here answers false, for an op and an
-- attempt, which stays prepared
if not core.fibers then
  describe("#integration round trips in the loop's own thread, in a build without fibers", function()
    it("answers false to every op: it goes to a worker thread", function()
      local client = helpers.connect()
      local pool = assert(core.pool(client._core, 1))
      local bridged = assert(core.pool(client._core, 0, "bridged"))
      local coll = helpers.unique("locks")
      local op = core.op_status{ db = helpers.database, coll = coll, name = "x" }
      local a = client._core:acquire_attempt(helpers.database, coll, "x", 5000)
      for _ = 1, 20 do
        assert.is_false(pool:here(op))
        assert.is_false(bridged:here(op))
        assert.is_false(pool:here(a))
        assert.is_false(a:sent())
        core.sleep(0.05)
      end
      local job = assert(pool:submit(op))
      local r
      repeat r = { job:take() }; core.sleep(0.005) until r[1] ~= false
      assert.is_string(r[1], tostring(r[2]))
      bridged:close()
      pool:close()
      client:close()
    end)
  end)
  return
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

  -- steps h until it answers, or answers false alone (it did not apply);
  -- the answer and the descriptors it waited on
  local function step_out(h)
    local fds = {}
    while true do
      local r = pack(h:step())
      if r[1] ~= false or r[2] == nil then return r, fds end
      assert.is_number(r[2], "a wait on a descriptor")
      fds[#fds + 1] = r[2]
      core.sleep(0.005)
    end
  end

  -- steps h until it answers (an op that did not apply fails the test)
  local function finish(h)
    local r, fds = step_out(h)
    assert.is_true(r[1] ~= false, "an op that did not apply, in this test")
    return r, fds
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
    -- an op may still answer false alone (it did not apply: its selection,
    -- 5 ms in the loop's thread, ran before the monitor had looked again
    -- after the closed connection, and its caller sends it another way):
    -- the next one is tried then
    local deadline = core.monotonic() + 10
    local r
    repeat
      r = step_out(here_soon(pool, op))
      assert(r[1] ~= false or core.monotonic() < deadline, "no op applied")
    until r[1] ~= false
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

  -- pool:here(a) takes a prepared attempt where it takes a:op(): its op is
  -- built into the fiber's memory (no Lua string); one that did not run
  -- or did not apply leaves the attempt prepared, for a:op() and a worker
  -- thread (nginx: mongolock.ngx)
  it("takes an attempt itself; one whose op did not run or apply is prepared again for a:op()", function()
    local cc = client._core
    local a = cc:acquire_attempt(helpers.database, coll, helpers.unique("attempt"), 5000)
    assert.is_false(a:sent())
    local r = finish(here_soon(pool, a))
    assert.is_true(a:sent())
    assert.error_matches(function() a:op() end, "sent already")
    assert.error_matches(function() pool:here(a) end, "sent already")
    local held = assert(a:take(r[1], r[2], r[3], r[4], r[5]))
    assert.is_false(a:sent())
    assert.is_true(held:release())
    -- a closed pool does not run it: still prepared
    local p2 = assert(core.pool(cc, 1))
    p2:close()
    local c = cc:acquire_attempt(helpers.database, coll, helpers.unique("unrun"), 5000)
    assert.is_false(p2:here(c))
    assert.is_false(c:sent())
    assert.is_string(c:op())
    -- refused as by a server that is no primary: it did not apply (twice:
    -- a retryable write is sent again once, when a primary is known by then)
    local b = cc:acquire_attempt(helpers.database, coll, helpers.unique("back"), 5000)
    fail_point(client, { times = 2 }, { failCommands = { "findAndModify" }, errorCode = 10107, appName = app })
    local h = here_soon(pool, b)
    assert.is_true(b:sent())
    local s = step_out(h)
    fail_point(client, "off")
    assert.same({ n = 1, false }, s)
    assert.is_false(b:sent())
    local job = assert(pool:submit(b:op()))
    local jr
    repeat jr = pack(job:take()); core.sleep(0.005) until jr[1] ~= false
    local hb = assert(b:take(jr[1], jr[2], jr[3], jr[4], jr[5]))
    assert.is_true(hb:release())
  end)
end)

-- A bridged pool (core.pool(client, 0, "bridged")): the op's fiber asks the
-- loop to connect, send and receive (nginx's cosockets, mongolock.ngx);
-- here the loop is this spec, with LuaSocket.
describe("#integration round trips whose bytes the loop moves (a bridged pool)", function()
  local socket = require "socket"
  local client, pool, op
  local socks = {}                -- the loop's sockets, by connection id

  setup(function()
    client = helpers.connect()
    pool = assert(core.pool(client._core, 0, "bridged"))
    op = core.op_status{ db = helpers.database, coll = helpers.unique("locks"), name = "x" }
  end)

  teardown(function()
    for _, s in pairs(socks) do s:close() end
    pool:close()
    client:close()
  end)

  local function pack(...) return { n = select("#", ...), ... } end

  -- runs h, doing what it asks with the sockets of socks;
  -- answer(kind, id) may answer a request instead (false, why); the
  -- outcome and the requests seen ({kind, id, used})
  local function drive(h, answer)
    local seen = {}
    local r = pack(h:step())
    while r[1] == false and r[2] do
      local kind, id, host, port, arg, secs, used = r[2], r[3], r[4], r[5], r[6], r[7], r[8]
      seen[#seen + 1] = { kind, id, used }
      assert.is_number(secs)
      local res, why
      if answer then res, why = answer(kind, id) end
      if res == nil then
        if kind == "connect" then
          local s = assert(socket.tcp())
          res, why = s:connect(host, port)
          if res then socks[id] = s end
        elseif kind == "send" then
          res, why = socks[id]:send(arg)
        else
          local s = socks[id]
          s:settimeout(5)
          local data, err, partial = s:receive(1)        -- at least one byte
          if data then
            s:settimeout(0)
            local more, _, part = s:receive(arg - 1)
            res = data .. (more or part or "")
          else
            res, why = (partial ~= "" and partial or false), err
          end
        end
      end
      r = pack(h:step(res or false, why))
    end
    return r, seen
  end

  local function bridged_soon(o)
    local deadline = core.monotonic() + 10
    while true do
      local h = pool:here(o or op)
      if h then return h end
      assert(core.monotonic() < deadline, "pool:here never ran an op")
      core.sleep(0.01)
    end
  end

  it("connects, sends and receives through the loop, answers as a job, and keeps the connection", function()
    local r, seen = drive(bridged_soon())
    assert.is_string(r[1], tostring(r[2]))
    assert.equal("connect", seen[1][1])
    assert.is_false(seen[1][3])
    local kinds = {}
    for _, s in ipairs(seen) do kinds[s[1]] = true end
    assert.is_true(kinds.send and kinds.recv)
    local threads = assert(core.pool(client._core, 1))
    local job = assert(threads:submit(op))
    local jr
    repeat jr = pack(job:take()); core.sleep(0.005) until jr[1] ~= false
    threads:close()
    assert.same(core.bson_decode(jr[1]).cursor.firstBatch, core.bson_decode(r[1]).cursor.firstBatch)
    -- the next op goes over the same connection: no connect, used
    local r2, seen2 = drive(bridged_soon())
    assert.is_string(r2[1], tostring(r2[2]))
    assert.equal("send", seen2[1][1])
    assert.equal(seen[1][2], seen2[1][2])
    assert.is_true(seen2[1][3])
    assert.same(core.bson_decode(r[1]).cursor.firstBatch, core.bson_decode(r2[1]).cursor.firstBatch)
  end)

  it("an op whose connection the loop cannot make did not apply: false alone", function()
    -- a pool whose first op must connect
    local p2 = assert(core.pool(client._core, 0, "bridged"))
    local h
    local deadline = core.monotonic() + 10
    repeat
      h = p2:here(op)
      if not h then core.sleep(0.01) end
    until h or core.monotonic() > deadline
    assert.is_userdata(h)
    local r, seen = drive(h, function(kind) if kind == "connect" then return false, "connection refused" end end)
    assert.same({ false }, { table.unpack(r, 1, r.n) })
    assert.equal("connect", seen[1][1])
    p2:close()
  end)

  it("a reply the loop could not receive is lost (a network error, not false); the connection is dead", function()
    local r0 = drive(bridged_soon())           -- a connection to break
    assert.is_string(r0[1], tostring(r0[2]))
    pool:dead()
    local r, seen = drive(bridged_soon(), function(kind) if kind == "recv" then return false, "timeout" end end)
    assert.is_nil(r[1])
    assert.matches("socket", tostring(r[2]))
    local dead = pool:dead()
    assert.truthy(dead and #dead >= 1, "no connection reported dead")
    local found = false
    for _, id in ipairs(dead) do if id == seen[1][2] then found = true end end
    assert.is_true(found, "the broken connection is not among the dead")
  end)

  it("leaves a change stream's getMore and killCursors to the threads", function()
    local getmore = core.op_getmore{ db = helpers.database, coll = "c", cursor_id = "12345" }
    local kill = core.op_killcursors{ db = helpers.database, coll = "c", cursor_id = "12345" }
    assert.is_false(pool:here(getmore))
    assert.is_false(pool:here(kill))
    local h = bridged_soon()                       -- other ops run here
    assert.is_userdata(h)
    h:close()
  end)

  it("a pool of no thread is a bridged one only; it runs no job", function()
    assert.has_error(function() core.pool(client._core, 0) end)
    assert.has_error(function() core.pool(client._core, 1, "other") end)
    local job, err = pool:submit(op)
    assert.is_nil(job)
    assert.matches("no worker thread", err)
  end)
end)

describe("#integration mongolock.bridge over a loop's own sockets (LuaSocket)", function()
  local socket = require "socket"
  local bridge = require "mongolock.bridge"

  it("runs an op, keeps its connection for the next, and answers false when nothing could be sent", function()
    local client = helpers.connect()
    local pool = assert(core.pool(client._core, 0, "bridged"))
    local op = core.op_status{ db = helpers.database, coll = helpers.unique("locks"), name = "x" }
    local kept, opened = {}, 0
    local io = {
      open = function(id, host, port, used)
        if used then return kept[id] or nil, "not kept" end
        opened = opened + 1
        local s = socket.tcp()
        local ok, err = s:connect(host, port)
        if not ok then return nil, err end
        return s
      end,
      send = function(s, bytes, secs) s:settimeout(secs); return s:send(bytes) end,
      recv = function(s, max, secs)
        s:settimeout(secs)
        local first, err = s:receive(1)
        if not first then return nil, err end
        s:settimeout(0)
        local _, _, more = s:receive(max - 1)
        return first .. (more or "")
      end,
      keep = function(id, s) kept[id] = s end,
      drop = function(s) s:close() end,
    }
    local deadline, r = core.monotonic() + 10
    repeat
      r = { bridge.run(pool, op, io) }
      if r[1] == false then core.sleep(0.01) end
    until r[1] ~= false or core.monotonic() > deadline
    assert.is_true(r[1])
    assert.is_string(r[2], tostring(r[3]))
    local r2 = { bridge.run(pool, op, io) }
    assert.is_true(r2[1])
    assert.equal(1, opened)
    -- every kept socket gone: the next op's sends cannot start, so it did
    -- not apply
    for id, s in pairs(kept) do s:close(); kept[id] = nil end
    assert.is_false((bridge.run(pool, op, io)))
    pool:close()
    client:close()
  end)
end)
