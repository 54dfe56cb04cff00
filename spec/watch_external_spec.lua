-- The change stream's machine (csrc/binding/watch.c) driven from outside, as
-- inside nginx (mongolock.ngx.runner): a client made external starts no
-- stream thread; client:watch_next() hands out each command of its
-- streams, client:watch_done() takes the outcome, and waiters look with
-- core.watch_wait(..., 0).  Here the specs are the adapter: they run each
-- op with client:run, or answer it with an error of their own.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local sleep = core.sleep

describe("#integration a change stream driven from outside (client:watch_next, watch_done)", function()
  local c, holder, db, coll, t, i

  -- the command an op carries ("aggregate", "getMore", "killCursors")
  -- and the op's command document
  local function command(op)
    local cmd = core.bson_decode(op).cmd
    for _, k in ipairs({ "aggregate", "getMore", "killCursors" }) do
      if cmd[k] ~= nil then return k, cmd end
    end
    error("not a stream's op")
  end

  -- one op of the client's streams, run (by another client of the
  -- process: a cursor's session is the process's, transport.h) or answered
  -- with the error `answer`; its command's name (nil, seconds when none is
  -- due)
  local function step(answer)
    local id, op = c:watch_next()
    if not id then return nil, op end
    local name = command(op)
    if answer then
      assert.is_true(c:watch_done(id, nil, answer, 6))
    else
      local reply, err, code = holder._core:run(op)
      assert.is_true(c:watch_done(id, reply, err, code))
    end
    return name
  end

  -- the next op handed out, within 2 s: id, op
  local function next_op()
    local stop = core.monotonic() + 2
    repeat
      local id, op = c:watch_next()
      if id then return id, op end
      sleep(0.005)
    until core.monotonic() > stop
    error("no op handed out")
  end

  local function look(name, waiter)
    return core.watch_wait(c, db, coll, "owner", name or "x", t, i, 0, waiter)
  end

  before_each(function()
    c = assert(core.connect(helpers.uri()))
    assert(c:set_external(true))
    holder = helpers.connect()
    db, coll = helpers.database, helpers.unique("wx")
    local r = assert(c:command(db, { ping = 1 }))
    t, i = r.operationTime.t, r.operationTime.i
  end)

  after_each(function()
    if c and not c:closed() then c:close() end
    if holder then holder:close() end
  end)

  it("starts no thread: each command is handed out, and a look sees the release its getMore brought", function()
    local hl = holder:locks({ database = db, collection = coll })
    local h = assert(hl:acquire("x", { ttl = 30 }))
    assert.equal("timeout", (look()))
    local st = testing.watch_stats(c)
    assert.equal(1, st.streams)
    assert.equal(0, st.threads)
    assert.equal("aggregate", (step()))
    assert.is_true(h:release())
    assert.equal("timeout", (look()))         -- not read yet
    assert.equal("getMore", (step()))
    assert.equal("event", (look()))
    st = testing.watch_stats(c)
    assert.is_true(st.events >= 1)
    assert.equal(1, st.getmores)
    assert.equal(0, st.threads)
  end)

  it("answers a blocking wait with an error (nobody could read the stream meanwhile), not a timeout",
     function()
    local res, err = core.watch_wait(c, db, coll, "owner", "x", t, i, 1)
    assert.is_nil(res)
    assert.matches("change stream: ", err, 1, true)
    assert.equal(0, testing.watch_stats(c).threads)
  end)

  it("sends no getMore while nobody looked lately", function()
    assert.equal("timeout", (look()))
    assert.equal("aggregate", (step()))
    assert.equal("getMore", (step()))        -- the look above still counts (0.5 s)
    sleep(0.7)
    local none, seconds = step()
    assert.is_nil(none)
    assert.is_true(seconds > 0 and seconds < 11, tostring(seconds))
  end)

  it("after a failed getMore ends the cursor and opens again after the last batch's resume token; "
     .. "fails after four failures in a row", function()
    assert.equal("timeout", (look()))
    assert.equal("aggregate", (step()))
    assert.equal("getMore", (step("injected failure")))
    assert.equal("timeout", (look()))
    assert.equal("killCursors", (step()))
    -- the new opening comes a little later (50 ms after the first failure)
    local none, seconds = c:watch_next()
    assert.is_nil(none)
    assert.is_true(seconds <= 0.05, tostring(seconds))
    local id, op = next_op()
    local kind, cmd = command(op)
    assert.equal("aggregate", kind)
    assert.is_not_nil(cmd.pipeline[1]["$changeStream"].resumeAfter, "no resume token")
    assert.is_true(c:watch_done(id, holder._core:run(op)))
    assert.equal(1, testing.watch_stats(c).reopens)
    -- a getMore, then three openings fail: the fourth failure in a row
    -- fails the stream, and its waiters hear it
    assert.equal("getMore", (step("injected failure")))
    assert.equal("killCursors", (step()))
    for _ = 1, 3 do
      assert.equal("timeout", (look()))
      id, op = next_op()
      assert.equal("aggregate", (command(op)))
      assert.is_true(c:watch_done(id, nil, "injected failure", 6))
    end
    local res, err = look()
    assert.is_nil(res)
    assert.equal("change stream: injected failure", err)
    assert.equal(1, testing.watch_stats(c).failed)
    none, seconds = step()
    assert.is_nil(none)
    assert.equal(math.huge, seconds)
  end)

  it("a first opening that fails fails the stream at once (no change streams there)", function()
    assert.equal("timeout", (look()))
    assert.equal("aggregate", (step("not a replica set")))
    local res, err = look()
    assert.is_nil(res)
    assert.equal("change stream: not a replica set", err)
  end)

  it("watch_stop and close end an open stream with killCursors, and then hand out nothing", function()
    assert.equal("timeout", (look()))
    assert.equal("aggregate", (step()))
    assert.is_true(c:watch_stop())
    assert.equal("retry", (look()))
    assert.equal("killCursors", (step()))
    local none, seconds = step()
    assert.is_nil(none)
    assert.equal(math.huge, seconds)
    -- a client closed while its stream's getMore is out
    assert.equal("timeout", (look("y")))
    assert.equal("aggregate", (step()))
    local id, op = c:watch_next()
    assert.equal("getMore", (command(op)))
    c:close()
    assert.is_true(c:watch_done(id, nil, "closed"))   -- its reply never came
    assert.equal("killCursors", (step()))
    none, seconds = step()
    assert.is_nil(none)
    assert.equal(math.huge, seconds)
  end)
end)

-- client:engine_next() and client:watch_next() hand out an op as a Lua
-- string: made while renew_mu (watch_mu) was held, its allocation could
-- run the collector, whose finalizers take the same mutex (a handle's
-- __gc hands its lease to the engine, a client's stops its streams), and
-- the thread deadlocked on itself.  A child with a collector that steps
-- at every allocation, its handles (clients) garbage as it goes; a hang
-- is the timeout's 124
local HANDED = [[
local core = require "mongolock.core"
local uri, db, coll, which = ...
local c = assert(core.connect(uri))
assert(c:set_external(true))
local runner = assert(core.connect(uri))
if rawget(_G, "jit") then collectgarbage("setpause", 0); collectgarbage("setstepmul", 100)
else collectgarbage("incremental", 0, 100, 1) end
local r = assert(runner:command(db, { ping = 1 }))
local stop, n, ops = core.monotonic() + 3, 0, 0
while core.monotonic() < stop do
  n = n + 1
  if which == "engine" then
    -- renewed by the engine (every 0.1 s), garbage after this turn
    local h = c:acquire(db, coll, "n" .. n, 300, nil, true)
    -- a little garbage of its own, more or less each turn: the collector
    -- meets engine_next's push in every phase of its cycle
    for k = 1, n % 7 do h = { h, k } end
    local id, op = c:engine_next()
    if id then
      ops = ops + 1
      local reply, err, code = runner:run(op)
      c:engine_done(id, core.monotonic(), reply, err, code)
    end
  else
    -- a client with a stream, garbage at once
    local g = assert(core.connect(uri))
    g:set_external(true)
    core.watch_wait(g, db, coll, "owner", "x", r.operationTime.t, r.operationTime.i, 0)
    core.watch_wait(c, db, coll .. (n % 20), "owner", "x", r.operationTime.t, r.operationTime.i, 0)
    local id = c:watch_next()
    if id then
      ops = ops + 1
      c:watch_done(id, nil, "injected", 6)
    end
  end
end
print("handed " .. ops)
]]

describe("#integration the external adapters' ops", function()
  for _, which in ipairs({ "engine", "watch" }) do
    it("are handed out (client:" .. which .. "_next) with no mutex held while the collector runs finalizers",
       function()
      local path = helpers.script(HANDED)
      local out, ok, status = helpers.run(path, { helpers.uri(), helpers.database, helpers.unique("handed"), which },
        "timeout 60")
      os.remove(path)
      assert.is_true(ok, "exit " .. tostring(status) .. " (124: it hung): " .. out)
      local ops = tonumber(out:match("handed (%d+)"))
      assert.is_true(ops ~= nil and ops > 0, out)
    end)
  end
end)

-- a client made external after its lease engine started on its own thread
-- (a client used outside nginx's request phases first, then by a runner):
-- the thread keeps its engine.  A second, external state made for the
-- next renewed lease left the first thread running: it went on renewing
-- after the client's close, with the closed client's pool and write
-- concern (freed: ASan's heap-use-after-free in renew_main), and the lock
-- was never released
local SWITCHED = [[
local core = require "mongolock.core"
local uri, db, coll = ...
local c = assert(core.connect(uri))
local o = assert(core.connect(uri))
local h = assert(c:acquire(db, coll, "x", 600, nil, true))     -- renewed by the client's thread
assert(c:set_external(true))
local h2 = assert(c:acquire(db, coll, "y", 600, nil, true))
core.sleep(1)                                                   -- past the ttl: renewed
print("held " .. tostring(h:held()) .. " " .. tostring(h2:held()))
c:close()
h, h2, c = nil, nil, nil
collectgarbage()
collectgarbage()
local junk = {}
for i = 1, 20000 do junk[i] = string.rep("\255", 32 + i % 1024) end
-- released at the close, and not renewed since
local x = o:acquire(db, coll, "x", 5000)
print("free " .. tostring(x ~= nil))
core.sleep(1)
print("alive " .. #junk)
]]

describe("#integration a client made external after its lease engine started on its own thread", function()
  it("keeps that engine: its leases are renewed, released at the close, and nothing runs after it", function()
    local path = helpers.script(SWITCHED)
    local out, ok, status = helpers.run(path, { helpers.uri(), helpers.database, helpers.unique("switched") })
    os.remove(path)
    assert.is_true(ok, "exit " .. tostring(status) .. ": " .. out)
    assert.matches("held true true", out, 1, true)
    assert.matches("free true", out, 1, true)
    assert.matches("alive 20000", out, 1, true)
  end)
end)
