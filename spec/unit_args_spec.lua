-- #unit: argument checking, bad input and the C core's helpers; no server.
-- (The client below points at a closed port: nothing can be written.)
local mongolock = require "mongolock"
local core = require "mongolock.core"

local DEAD = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=200&connectTimeoutMS=200"

describe("#unit mongolock.core", function()
  it("makes 128-bit owner ids as 32 lowercase hex digits, all different", function()
    local seen = {}
    for _ = 1, 1000 do
      local id = assert(core.random_owner())
      assert.is_truthy(id:match("^[0-9a-f]+$"))
      assert.equal(32, #id)
      assert.is_nil(seen[id])
      seen[id] = true
    end
  end)

  it("has a monotonic clock that never goes back", function()
    local last = core.monotonic()
    for _ = 1, 1000 do
      local now = core.monotonic()
      assert.is_true(now >= last)
      last = now
    end
  end)

  it("sleeps for non-positive durations without blocking and refuses NaN", function()
    core.sleep(0)
    core.sleep(-1)
    assert.has_error(function() core.sleep(0 / 0) end)
    assert.has_error(function() core.sleep("x") end)
  end)

  it("checks UTF-8 without NUL bytes", function()
    assert.is_true(core.utf8_valid("héllo ✓"))
    assert.is_false(core.utf8_valid("\255\254"))
    assert.is_false(core.utf8_valid("a\0b"))
    assert.is_false(core.utf8_valid("\195"))       -- truncated sequence
  end)

  it("gives jitter in [0, 1)", function()
    local lo, hi = 1, 0
    for _ = 1, 10000 do
      local r = core.random()
      assert.is_true(r >= 0 and r < 1)
      if r < lo then lo = r end
      if r > hi then hi = r end
    end
    assert.is_true(lo < 0.01 and hi > 0.99)
  end)

  it("gives a forked child jitter of its own, not its parent's next draws", function()
    local testing = require "mongolock.testing"
    core.random()                                   -- the parent's generator is seeded
    local path = os.tmpname()
    local child = assert(testing.fork())
    if child == 0 then
      local f = io.open(path, "w")
      f:write(("%.17g %.17g %.17g"):format(core.random(), core.random(), core.random()))
      f:close()
      testing.exit(0)
    end
    assert.equal(0, testing.waitpid(child, 10))
    local f = assert(io.open(path))
    local theirs = f:read("*a")
    f:close()
    os.remove(path)
    local mine = ("%.17g %.17g %.17g"):format(core.random(), core.random(), core.random())
    assert.not_equal(mine, theirs)
  end)
end)

describe("#unit mongolock.core's argument checks", function()
  -- each raises before (or gives back) what it had built: under make
  -- test-valgrind a leak here is an error
  it("raise without leaking what was built before the failing check", function()
    assert.has_error(function() core.connect(DEAD, nil, nil, nil, "abc") end)
    assert.has_error(function() core.connect(DEAD, nil, nil, "zz") end)
    assert.has_error(function()
      core.op_watch({ db = "d", coll = "c", tag = string.rep("a", 16), session = "bad" })
    end)
    assert.has_error(function()
      core.op_getmore({ db = "d", coll = "c", cursor_id = 1, session = "bad" })
    end)
    assert.has_error(function()
      core.op_killcursors({ db = "d", coll = "c", cursor_id = 1, session = "bad" })
    end)
    -- an extend's bad ttl (what h:extend(-1) sends: core.lease_step)
    local c = assert(core.connect(DEAD))
    local h = assert(c:granted("d", "c", string.rep("x", 600), string.rep("a", 32), 1000, 1000, 1,
      core.monotonic()))
    assert.has_error(function() core.lease_step(h, "extend", -1) end)
    c:close()
  end)
end)

describe("#unit mongolock.connect", function()
  it("raises on wrong argument types", function()
    assert.has_error(function() mongolock.connect() end,
      "bad argument #1 to 'connect' (string expected, got nil)")
    assert.has_error(function() mongolock.connect(42) end,
      "bad argument #1 to 'connect' (string expected, got number)")
    assert.has_error(function() mongolock.connect(DEAD, "x") end,
      "bad argument #2 to 'connect' (table expected, got string)")
    assert.has_error(function() mongolock.connect(DEAD, { appname = 1 }) end)
    assert.has_error(function() mongolock.connect(DEAD, { write_concern = "most" }) end)
    assert.has_error(function() mongolock.connect(DEAD, { write_concern = -1 }) end)
    assert.has_error(function() mongolock.connect(DEAD, { pool_size = 0 }) end)
    assert.has_error(function() mongolock.connect(DEAD, { pool_size = 1.5 }) end)
    assert.has_error(function() mongolock.connect(DEAD, { server_selection_timeout = 0 }) end)
    assert.has_error(function() mongolock.connect(DEAD, { server_selection_timeout = 0 / 0 }) end)
    assert.has_error(function() mongolock.connect(DEAD, { wtimeout = math.huge }) end)
  end)

  it("returns nil, message for bad URIs", function()
    for _, uri in ipairs({ "", "http://x", "mongodb://", "mongodb://a:b:c:d",
                           "mongodb://h/?replicaSet=", "mongodb://h\0x" }) do
      local c, err = mongolock.connect(uri)
      assert.is_nil(c, uri)
      assert.is_string(err)
      assert.is_truthy(err:match("^invalid URI"), err)
    end
  end)

  -- w = 0 sends writes without waiting for an answer: an acquire could not
  -- tell whether it took the lock, and would leave it held by nobody
  it("refuses an unacknowledged write concern, naming the option", function()
    assert.has_error(function() mongolock.connect(DEAD, { write_concern = 0 }) end,
      "bad argument #2 to 'connect' (write_concern 0 asks for unacknowledged writes: a lock needs "
      .. "the server's answer; use \"majority\" or a number of nodes >= 1)")
    assert.has_error(function() core.connect(DEAD, nil, 0) end)
    for _, uri in ipairs({ DEAD .. "&w=0", "mongodb://127.0.0.1:9/?w=0",
                           "mongodb://127.0.0.1:9/?W=0&journal=false" }) do
      local c, err = mongolock.connect(uri)
      assert.is_nil(c, uri)
      assert.equal("invalid URI: w=0 asks for unacknowledged writes: a lock needs the server's answer; "
        .. "use w=majority or w=1 or more (or the write_concern option)", err)
    end
    -- the option wins over the URI's w
    assert(mongolock.connect("mongodb://127.0.0.1:9/?w=0", { write_concern = "majority" })):close()
    assert(mongolock.connect("mongodb://127.0.0.1:9/?w=1")):close()
  end)

  it("accepts good options without touching the network", function()
    local c = assert(mongolock.connect(DEAD, { appname = "unit", write_concern = 1,
      wtimeout = 2, pool_size = 4, server_selection_timeout = 0.2 }))
    assert.equal("mongolock", c:default_database())
    assert.is_true(c:close())
    assert.is_true(c:close())           -- idempotent
    assert.is_true(c:closed())
    local c2 = assert(mongolock.connect("mongodb://127.0.0.1:9/appdb"))
    assert.equal("appdb", c2:default_database())
    c2:close()
  end)
end)

describe("#unit locks arguments", function()
  local client, locks
  setup(function()
    client = assert(mongolock.connect(DEAD))
    locks = client:locks()
  end)
  teardown(function() client:close() end)

  it("has the documented defaults", function()
    assert.equal("mongolock", locks.database)
    assert.equal("locks", locks.collection)
    assert.equal(30, locks.ttl)
    assert.equal(10, locks.timeout)
  end)

  it("raises at the caller for bad names", function()
    local cases = {
      { nil, "string expected, got nil" },
      { 42, "string expected, got number" },
      { {}, "string expected, got table" },
      { "", "name must not be empty" },
      { ("x"):rep(1025), "name longer than 1024 bytes" },
      { "a\0b", "name contains a NUL byte" },
      { "\255", "name is not valid UTF-8" },
      { "\237\160\128", "name is not valid UTF-8" },   -- a surrogate
    }
    for _, m in ipairs({ "acquire", "try", "status", "force_release" }) do
      for _, case in ipairs(cases) do
        assert.has_error(function() locks[m](locks, case[1]) end,
          ("bad argument #1 to '%s' (%s)"):format(m, case[2]))
      end
    end
  end)

  it("accepts a name of exactly 1024 bytes (fails only at the server)", function()
    local h, err = locks:try(("x"):rep(1024))
    assert.is_nil(h)
    assert.is_string(err)
    assert.not_equal("busy", err)
  end)

  it("raises for bad ttl and timeout", function()
    for _, bad in ipairs({ 0, -1, 0 / 0, math.huge, -math.huge, "5", true, 366 * 86400 }) do
      assert.has_error(function() locks:acquire("x", { ttl = bad }) end)
      assert.has_error(function() locks:try("x", { ttl = bad }) end)
      assert.has_error(function() client:locks({ ttl = bad }) end)
    end
    -- a timeout may be 0 (one attempt) or math.huge (no limit)
    for _, bad in ipairs({ -1, -1e-9, 0 / 0, -math.huge, "5", true }) do
      assert.has_error(function() locks:acquire("x", { timeout = bad }) end)
      assert.has_error(function() client:locks({ timeout = bad }) end)
    end
    assert.has_error(function() locks:acquire("x", 5) end,
      "bad argument #2 to 'acquire' (table expected, got number)")
    assert.has_error(function() client:locks("x") end)
    assert.has_error(function() client:locks({ collection = "" }) end)
    assert.has_error(function() client:locks({ database = 1 }) end)
    assert.has_error(function() client:locks({ ratio = 0.5 }) end)
  end)

  it("checks the function given to with", function()
    assert.has_error(function() locks:with("x", nil, nil) end,
      "bad argument #3 to 'with' (function expected, got nil)")
  end)

  it("answers an unreachable server with nil, message, code when its timeout ends", function()
    local t0 = core.monotonic()
    local h, err, code = locks:acquire("x", { timeout = 1 })
    assert.is_nil(h)
    assert.is_truthy(err:match("No suitable servers"), err)
    assert.is_number(code)
    -- no server found is transient (an election): acquire tries again
    -- until its timeout, and not past it by more than a selection timeout
    local took = core.monotonic() - t0
    assert.is_true(took >= 1 and took < 5, took)
    t0 = core.monotonic()
    h, err = locks:try("x")
    assert.is_nil(h)
    assert.is_truthy(err:match("No suitable servers"), err)
    assert.is_true(core.monotonic() - t0 < 5)
    local st, err2 = locks:status("x")
    assert.is_nil(st)
    assert.is_string(err2)
  end)

  it("answers nil, 'closed' once the client is closed", function()
    local c = assert(mongolock.connect(DEAD))
    local l = c:locks()
    c:close()
    assert.same({ nil, "closed" }, { l:try("x") })
    assert.same({ nil, "closed" }, { l:acquire("x") })
    assert.same({ nil, "closed" }, { l:status("x") })
    assert.same({ nil, "closed" }, { l:list() })
    assert.same({ nil, "closed" }, { l:force_release("x") })
  end)
end)

describe("#unit core commands check their arguments too", function()
  it("raises for bad types and values at the C boundary", function()
    local c = assert(core.connect(DEAD))
    assert.has_error(function() c:acquire("db", "coll", 1, 1000) end)
    assert.has_error(function() c:acquire("db", "coll", "", 1000) end)
    assert.has_error(function() c:acquire("db", "coll", "x", 0) end)
    assert.has_error(function() c:acquire("db", "coll", "x", 0 / 0) end)
    assert.has_error(function() c:acquire("", "coll", "x", 1000) end)
    assert.has_error(function() c:acquire("db", "a$b", "x", 1000) end)
    assert.has_error(function() c:acquire("db", "coll\0", "x", 1000) end)
    assert.has_error(function() c:status("db", "coll", ("x"):rep(1025)) end)
    assert.has_error(function() c.acquire({}, "db", "coll", "x", 1000) end)
    c:close()
    assert.has_error(function() c:acquire("db", "coll", "x", 1000) end,
      "attempt to use a closed mongolock client")
  end)
end)

describe("#unit messages the same on every Lua", function()
  it("client:command's complaint about cmd or opts names 'command' and the caller's argument", function()
    local c = assert(mongolock.connect(DEAD))
    local _, err = pcall(c.command, c, "db", { ping = function() end })
    assert.matches("^[^\n]*bad argument #2 to 'command' %(cannot convert a function to BSON", err)
    _, err = pcall(c.command, c, "db", { ping = 1, extra = 1 })
    assert.matches("bad argument #2 to 'command' %(one key expected", err)
    _, err = pcall(c.command, c, "db", { ping = 1 }, { x = print })
    assert.matches("bad argument #3 to 'command' %(cannot convert a function to BSON", err)
    c:close()
  end)

  it("mongolock.sleep and mongolock.monotonic, the demo's clock", function()
    local t0 = mongolock.monotonic()
    mongolock.sleep(0.01)
    mongolock.sleep(0)
    assert.is_true(mongolock.monotonic() - t0 >= 0.01)
    assert.has_error(function() mongolock.sleep(-1) end)
    assert.has_error(function() mongolock.sleep(0 / 0) end)
    assert.has_error(function() mongolock.sleep("1") end)
  end)

  it("shows a NaN as NaN, not the C library's -nan", function()
    local c = assert(mongolock.connect(DEAD))
    local _, err = pcall(c.locks, c, { ttl = 0 / 0 })
    assert.matches("(got NaN)", err, 1, true)
    _, err = pcall(function() return c:locks():acquire("x", { timeout = -(0 / 0) }) end)
    assert.matches("(got NaN)", err, 1, true)
    c:close()
  end)
end)
