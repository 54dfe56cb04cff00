-- Waits that outlast the database's normal life: an outage (every command
-- of the waiter's client answered by a closed connection, or stalled past
-- its socket timeout) and an election (the primary steps down and is
-- elected again: replSetStepDown with force, which a single-node replica
-- set of mongod runs as the stand-in does).  A waiter retries through them
-- until its own timeout, keeps its place in the queue across an election
-- and across an attempt whose reply was lost,
-- and gets the lock when the holder releases it.  Each case checks that its
-- fault happened (the fail point's count, the holder's view of the
-- election).  Against a real MongoDB: a single-node replica set started
-- with --setParameter enableTestCommands=1.
local helpers = require "spec.helpers"
local core = require "mongolock.core"

local format = string.format
local q = helpers.shell_quote

-- the holder, in a process of its own: takes the lock, says "held", waits
-- until `waiting` waiters are queued, then runs the faults (an outage of
-- outage_s seconds for the client named app: closed connections; then an
-- election of election_s seconds), waits for a writable primary, releases
local HOLDER = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local uri, db, coll, name, app = arg[1], arg[2], arg[3], arg[4], arg[5]
local waiting, outage_s, election_s = tonumber(arg[6]), tonumber(arg[7]), tonumber(arg[8])
local lead = tonumber(arg[9])
local c = assert(mongolock.connect(uri, { server_timeout = 30 }))
local locks = c:locks({ database = db, collection = coll, ttl = 120 })
local h = assert(locks:acquire(name))
print("held " .. core.getpid()); io.stdout:flush()
while (locks:status(name) or {}).waiting ~= waiting do core.sleep(0.05) end
-- lead: the election starts `lead` seconds after the first waiter renewed
-- its place (it comes back every queue_ttl / 2)
local function first_until()
  local r = assert(c:command(db, { find = coll }, { filter = { _id = name } }))
  local q = r.cursor.firstBatch[1].queue
  return q and q[1] and q[1]["until"].ms
end
if lead then
  local u = first_until()
  while first_until() == u do core.sleep(0.02) end
  core.sleep(lead)
end
local function fp(mode, data)
  return assert(c:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
end
if outage_s > 0 then
  fp("alwaysOn", { failCommands = mongolock.array({ "findAndModify", "update", "aggregate", "getMore" }),
                   closeConnection = true, appName = app })
  core.sleep(outage_s)
  print("outage fired " .. tostring(fp("off").count)); io.stdout:flush()
end
if election_s > 0 then
  assert(c:command("admin", { replSetStepDown = election_s }, { force = true }))
  local hello = assert(c:command("admin", { hello = 1 }))
  print("stepped down, writable " .. tostring(hello.isWritablePrimary)); io.stdout:flush()
  local deadline = core.monotonic() + election_s + 30
  repeat
    core.sleep(0.1)
    hello = c:command("admin", { hello = 1 })
  until (hello and hello.isWritablePrimary) or core.monotonic() > deadline
  print("elected " .. tostring(hello and hello.isWritablePrimary)); io.stdout:flush()
end
core.sleep(0.5)
assert(h:release())
print("released " .. string.format("%.3f", core.monotonic())); io.stdout:flush()
c:close()
]]

-- a second waiter: once one waiter is queued, acquires, says when, releases
local WAITER = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local uri, db, coll, name = arg[1], arg[2], arg[3], arg[4]
local c = assert(mongolock.connect(uri))
local locks = c:locks({ database = db, collection = coll })
-- it starts after the first waiter is queued
while ((locks:status(name) or {}).waiting or 0) < 1 do core.sleep(0.02) end
print("waiting"); io.stdout:flush()
local h, err = locks:acquire(name, { timeout = 60, queue_ttl = 20 })
print("acquired " .. tostring(h ~= nil) .. " " .. tostring(err) .. " " .. string.format("%.3f", core.monotonic()))
io.stdout:flush()
if h then h:release() end
c:close()
]]

describe("#integration waits through outages and elections", function()
  local coll

  before_each(function()
    coll = helpers.unique("outage")
  end)

  it("a waiter with timeout 40 outlasts a 12 s outage and a 10 s election and gets the lock after the release",
    function()
    local app = helpers.unique("waiter")
    local name = helpers.unique("x")
    local holder = helpers.spawn(helpers.script(HOLDER),
      { helpers.uri(), helpers.database, coll, name, app, "1", "12", "10" })
    finally(function() holder:kill("KILL"); holder:cleanup() end)
    assert(holder:wait_for("held %d+", 30))
    local client = helpers.connect({ appname = app })
    local locks = client:locks({ database = helpers.database, collection = coll })
    local t0 = core.monotonic()
    local h, err, code = locks:acquire(name, { timeout = 40 })
    local took = core.monotonic() - t0
    local status, out = holder:wait(30)
    assert.equal(0, status, out)
    assert.truthy(h, format("acquire: %s %s after %.1f s; holder: %s", tostring(err), tostring(code), took, out))
    -- the faults happened: the fail point answered the waiter's commands,
    -- the server was no writable primary, then a primary again
    assert.truthy(tonumber(out:match("outage fired (%d+)")) > 0, out)
    assert.truthy(out:find("stepped down, writable false", 1, true), out)
    assert.truthy(out:find("elected true", 1, true), out)
    -- it got the lock after the holder released it, not before
    assert.truthy(tonumber(out:match("released ([%d.]+)")) <= core.monotonic())
    assert.truthy(took >= 20, format("the faults lasted 22 s; the waiter got the lock after %.1f s", took))
    assert.truthy(h:release())
    client:close()
  end)

  it("a waiter keeps its place in the queue across an election shorter than its queue lease", function()
    local name = helpers.unique("x")
    -- two waiters queued with queue_ttl 20 (each comes back every 10 s);
    -- the holder steps down for 10 s from 6 s after the first one came
    -- back, so that its next return falls in the election (longer than
    -- the driver's own retry, which waits up to 5 s for a primary), and
    -- the election ends before its place does (20 s after it came back)
    local holder = helpers.spawn(helpers.script(HOLDER),
      { helpers.uri(), helpers.database, coll, name, "-", "2", "0", "10", "6" })
    finally(function() holder:kill("KILL"); holder:cleanup() end)
    assert(holder:wait_for("held %d+", 30))
    local client = helpers.connect()
    local locks = client:locks({ database = helpers.database, collection = coll })
    local second = helpers.spawn(helpers.script(WAITER), { helpers.uri(), helpers.database, coll, name })
    finally(function() second:kill("KILL"); second:cleanup() end)
    local h, err, code = locks:acquire(name, { timeout = 60, queue_ttl = 20 })
    local status, out = holder:wait(30)
    assert.equal(0, status, out)
    assert.truthy(h, format("acquire: %s %s; holder: %s", tostring(err), tostring(code), out))
    assert.truthy(out:find("stepped down, writable false", 1, true), out)
    -- the first in line got it; the second still waits for it
    local st = assert(locks:status(name))
    assert.equal(h.owner, st.owner)
    assert.equal(1, st.waiting)
    assert.is_nil(second:output():match("acquired"))
    assert.truthy(h:release())
    local s2, out2 = second:wait(30)
    assert.equal(0, s2, out2)
    assert.truthy(out2:find("acquired true", 1, true), out2)
    client:close()
  end)

  it("exec -w 60 outlasts a 6 s stall of every command it sends", function()
    local app = helpers.unique("cli")
    local name = helpers.unique("x")
    local client = helpers.connect()
    local locks = client:locks({ database = helpers.database, collection = coll })
    local h = assert(locks:acquire(name))
    -- the command's calls wait 6 s for answers (its server timeout is 2 s)
    local function fp(mode, data)
      return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    fp("alwaysOn", { failCommands = require("mongolock").array({ "findAndModify", "update", "aggregate", "getMore" }),
                     blockConnection = true, blockTimeMS = 6000, appName = app })
    finally(function() if not client:closed() then fp("off") end end)
    local out = os.tmpname()
    local rc = os.tmpname()
    os.remove(rc)
    os.execute(format("( %s %s --uri %s --app %s --database %s --collection %s exec -w 60 %s -- echo ran "
      .. ">%s 2>&1; echo $? >%s ) </dev/null >/dev/null 2>&1 &",
      helpers.lua, q(helpers.root .. "/bin/mongolock"), q(helpers.uri()), q(app),
      q(helpers.database), q(coll), q(name), q(out), q(rc)))
    core.sleep(6)
    local fired = fp("off").count
    assert.truthy(fired > 0, "the stall fired")
    assert.truthy(h:release())
    -- (the shell creates rc, then writes the status: wait for the digits)
    local done = helpers.eventually(function() return (helpers.read_file(rc) or ""):match("%d+") end, 40)
    local text = helpers.read_file(out) or ""
    os.remove(out); os.remove(rc)
    assert.equal("0", (done or ""):match("%d+"), text)
    assert.truthy(text:find("ran", 1, true), text)
    client:close()
  end)

  it("every waiting call retries an election's errors and returns a permanent one at once", function()
    local mongolock = require "mongolock"
    local client = helpers.connect()
    local o = { database = helpers.database, collection = coll }
    local locks, rw = client:locks(o), client:rwlocks(o)
    local sems = client:semaphores({ database = helpers.database, collection = coll, permits = 2 })
    local docs = client:documents(helpers.database, coll .. "-docs")
    assert(client:command(helpers.database, { insert = coll .. "-docs" }, { documents = { { _id = "d" } } }))
    local function fp(mode, data)
      return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    finally(function() if not client:closed() then fp("off") end end)
    local fired = fp("off").count
    -- three answers of ShutdownInProgress (labelled RetryableWriteError on a
    -- retryable write, so the driver retries once by itself): the first
    -- attempt fails twice, the loop tries again
    local function transient()
      fp({ times = 3 }, { failCommands = mongolock.array({ "findAndModify", "update" }), errorCode = 91 })
    end
    local calls = {
      { "locks:acquire", function() return locks:acquire(helpers.unique("n"), { timeout = 20 }) end },
      { "rw:read", function() return rw:read(helpers.unique("r"), { timeout = 20 }) end },
      { "rw:write", function() return rw:write(helpers.unique("w"), { timeout = 20 }) end },
      { "sem:acquire", function() return sems:acquire(helpers.unique("s"), { timeout = 20 }) end },
      { "docs:lock", function()
        local doc, h = docs:lock("d", { timeout = 20 })
        return h, doc
      end },
      { "acquire_all", function()
        return client:acquire_all({ { locks, helpers.unique("a") }, { sems, helpers.unique("b") } }, { timeout = 20 })
      end },
    }
    for _, c in ipairs(calls) do
      transient()
      local h, err, code = c[2]()
      assert.truthy(h, format("%s: %s %s", c[1], tostring(err), tostring(code)))
      local now = fp("off").count
      assert.equal(3, now - fired, c[1] .. ": the fail point answered three times")
      fired = now
      assert.truthy(h:release())
    end
    -- a permanent error (Unauthorized) is returned at once, not retried
    fp({ times = 1 }, { failCommands = mongolock.array({ "findAndModify" }), errorCode = 13 })
    local t0 = core.monotonic()
    local h, err, code = locks:acquire(helpers.unique("p"), { timeout = 20 })
    assert.is_nil(h)
    assert.equal(13, code, tostring(err))
    assert.truthy(core.monotonic() - t0 < 10)
    client:close()
  end)

  it("mongolock wait looks again after an election's errors", function()
    local mongolock = require "mongolock"
    local client = helpers.connect()
    local function fp(mode, data)
      return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    finally(function() if not client:closed() then fp("off") end end)
    local fired = fp("off").count
    fp({ times = 4 }, { failCommands = mongolock.array({ "aggregate" }), errorCode = 11602 })
    local p = assert(io.popen(format("%s %s --uri %s --database %s --collection %s wait -w 20 %s 2>&1; echo \"rc=$?\"",
      helpers.lua, q(helpers.root .. "/bin/mongolock"), q(helpers.uri()), q(helpers.database), q(coll),
      q(helpers.unique("free"))), "r"))
    local out = p:read("*a")
    p:close()
    assert.truthy(out:find("rc=0", 1, true), out)
    assert.equal(4, fp("off").count - fired)
    client:close()
  end)

  it("a waiter whose attempt got no reply keeps its id and its place in the queue", function()
    local app = helpers.unique("noreply")
    local name = helpers.unique("x")
    -- the holder renews a 1.5 s lease, so the first waiter wakes (and
    -- makes an attempt) at each lease end it saw; once the waiter is
    -- queued, two answers to its findAndModify are closed connections (the
    -- attempt and the driver's retry); the holder releases 5 s later
    local holder = helpers.spawn(helpers.script([[
      local mongolock = require "mongolock"
      local core = require "mongolock.core"
      local uri, db, coll, name, app = arg[1], arg[2], arg[3], arg[4], arg[5]
      local c = assert(mongolock.connect(uri))
      local locks = c:locks({ database = db, collection = coll, ttl = 1.5 })
      local h = assert(locks:acquire(name, { renew = true }))
      print("held"); io.stdout:flush()
      while ((locks:status(name) or {}).waiting or 0) < 2 do core.sleep(0.02) end
      assert(c:command("admin", { configureFailPoint = "failCommand" }, { mode = { times = 2 },
        data = { failCommands = mongolock.array({ "findAndModify" }), closeConnection = true, appName = app } }))
      core.sleep(5)
      assert(h:release())
      print("released " .. string.format("%.3f", core.monotonic())); io.stdout:flush()
      c:close()
    ]]), { helpers.uri(), helpers.database, coll, name, app })
    finally(function() holder:kill("KILL"); holder:cleanup() end)
    assert(holder:wait_for("held", 30))
    local client = helpers.connect({ appname = app })
    local observer = helpers.connect()
    local locks = client:locks({ database = helpers.database, collection = coll })
    local olocks = observer:locks({ database = helpers.database, collection = coll })
    local fired = assert(observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })).count
    -- a second waiter, queued behind the first before the first's reply is lost
    local second = helpers.spawn(helpers.script(WAITER), { helpers.uri(), helpers.database, coll, name })
    finally(function() second:kill("KILL"); second:cleanup() end)
    local h, err, code = locks:acquire(name, { timeout = 30, queue_ttl = 20 })
    local got = core.monotonic()
    local status, out = holder:wait(30)
    assert.equal(0, status, out)
    assert.truthy(h, format("acquire: %s %s; holder: %s", tostring(err), tostring(code), out))
    -- the fault happened: count is mongod's timesEntered, which setting the
    -- fail point again does not reset
    local now = assert(observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })).count
    assert.equal(2, now - fired, "two closed connections")
    -- the release went to this waiter, not to a place left behind
    local released = tonumber(out:match("released ([%d.]+)"))
    assert.truthy(got - released < 3, format("got the lock %.1f s after the release", got - released))
    -- the first in line kept its place: the second waits for it still
    assert.is_nil(second:output():match("acquired"))
    assert.equal(1, assert(olocks:status(name)).waiting)
    assert.truthy(h:release())
    local s2, out2 = second:wait(30)
    assert.equal(0, s2, out2)
    assert.truthy(out2:find("acquired true", 1, true), out2)
    client:close()
    observer:close()
  end)
end)
