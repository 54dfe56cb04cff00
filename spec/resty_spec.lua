-- resty.mongolock outside nginx (its sleep falls back to the core's): the
-- lua-resty-lock contract, against helpers.uri().  spec/nginx_spec.lua runs
-- it inside a real nginx.
local helpers = require "helpers"
local core = require "mongolock.core"

describe("#integration resty.mongolock", function()
  local resty = require "resty.mongolock"
  local client, coll

  setup(function()
    client = helpers.connect()
  end)

  teardown(function()
    if client then client:close() end
  end)

  before_each(function()
    coll = helpers.unique("resty")
  end)

  local function new(opts)
    local o = { client = client, database = helpers.database, collection = coll }
    for k, v in pairs(opts or {}) do o[k] = v end
    return assert(resty:new(o))
  end

  it("an unlock that fails keeps the lock, and a second unlock releases it", function()
    local app = helpers.unique("resty-fail")
    local c2 = helpers.connect({ appname = app })
    local lock = assert(resty:new({ client = c2, database = helpers.database, collection = coll }))
    local key = helpers.unique("k")
    assert.equal(0, lock:lock(key))
    -- the release's update fails once, with an error no driver retries
    assert(require("mongolock.testing").failpoint(client._core, { times = 1, commands = { "update" },
      error_code = 96, app_name = app }))
    local ok, err = lock:unlock()
    assert.is_nil(ok)
    assert.is_string(err)
    assert.equal("locked", select(2, lock:lock(key)))   -- still this object's
    assert.equal(1, lock:unlock())
    assert.equal(0, new({ timeout = 0 }):lock(key))
    c2:close()
  end)

  it("locks at once when free (elapsed 0) and unlocks with 1", function()
    local lock = new()
    local key = helpers.unique("k")
    assert.equal(0, lock:lock(key))
    local other = new({ timeout = 0 })
    local elapsed, err = other:lock(key)
    assert.is_nil(elapsed)
    assert.equal("timeout", err)
    assert.equal(1, lock:unlock())
    assert.equal(0, other:lock(key))
    assert.equal(1, other:unlock())
  end)

  it("answers 'locked' when the object already holds a lock, 'unlocked' when it holds none", function()
    local lock = new()
    local ok, err = lock:unlock()
    assert.is_nil(ok)
    assert.equal("unlocked", err)
    ok, err = lock:expire(10)
    assert.is_nil(ok)
    assert.equal("unlocked", err)
    assert.equal(0, lock:lock(helpers.unique("a")))
    local e
    e, err = lock:lock(helpers.unique("b"))
    assert.is_nil(e)
    assert.equal("locked", err)
    assert.equal(1, lock:unlock())
    ok, err = lock:unlock()
    assert.is_nil(ok)
    assert.equal("unlocked", err)
  end)

  it("waits until the holder's lease ends and returns the time waited", function()
    local key = helpers.unique("k")
    local holder = new({ exptime = 0.3 })
    assert.equal(0, holder:lock(key))
    -- the holder never unlocks: its lease ends after 0.3 s
    local waiter = new({ timeout = 5, step = 0.01, ratio = 2, max_step = 0.05 })
    local t0 = core.monotonic()
    local elapsed, err = waiter:lock(key)
    local took = core.monotonic() - t0
    assert.is_number(elapsed, err)
    assert.is_true(elapsed >= 0.25 and elapsed <= took, tostring(elapsed))
    assert.equal(1, waiter:unlock())
    -- the first holder learns its lease was taken
    local ok, uerr = holder:unlock()
    assert.is_nil(ok)
    assert.equal("lost", uerr)
  end)

  it("times out after timeout seconds of steps", function()
    local key = helpers.unique("k")
    -- another client holds it (a blocking wait for its own client's lock
    -- answers "deadlock")
    local c2 = helpers.connect()
    local holder = new({ client = c2 })
    assert.equal(0, holder:lock(key))
    local waiter = new({ timeout = 0.2, step = 0.05, ratio = 1 })
    local t0 = core.monotonic()
    local elapsed, err = waiter:lock(key)
    assert.is_nil(elapsed)
    assert.equal("timeout", err)
    assert.is_true(core.monotonic() - t0 >= 0.2)
    assert.equal(1, holder:unlock())
    c2:close()
  end)

  it("expire() renews the lease, and says 'lost' once it has ended", function()
    local key = helpers.unique("k")
    local lock = new({ exptime = 0.4 })
    assert.equal(0, lock:lock(key))
    assert.is_true(lock:expire(10))
    core.sleep(0.6)   -- past the first exptime
    local other = new({ timeout = 0 })
    assert.same({ nil, "timeout" }, { other:lock(key) })
    assert.is_true(lock:expire(0.2))
    core.sleep(0.4)
    assert.equal(0, other:lock(key))
    local ok, err = lock:expire()
    assert.is_nil(ok)
    assert.equal("lost", err)
    assert.same({ nil, "unlocked" }, { lock:unlock() })
    assert.equal(1, other:unlock())
  end)

  it("gives the fencing token of the lock held", function()
    local key = helpers.unique("k")
    local lock = new()
    assert.is_nil(lock:token())
    assert.equal(0, lock:lock(key))
    local t1 = lock:token()
    assert.is_number(t1)
    -- its exact decimal digits (a token is above 10^15: LuaJIT's %.14g
    -- would print it as 1.8388586026281e+15)
    assert.equal(lock.handle:token_string(), lock:token_string())
    assert.matches("^%d+$", lock:token_string())
    assert.equal(1, lock:unlock())
    assert.is_nil(lock:token_string())
    assert.equal(0, lock:lock(key))
    assert.is_true(lock:token() > t1)
    assert.equal(1, lock:unlock())
  end)

  it("makes one client per process for a uri", function()
    local a = assert(resty:new({ uri = helpers.uri(), collection = coll }))
    local b = assert(resty:new({ uri = helpers.uri(), collection = coll }))
    assert.equal(a.locks, b.locks)
    local key = helpers.unique("k")
    assert.equal(0, a:lock(key))
    b.timeout = 0
    assert.same({ nil, "timeout" }, { b:lock(key) })
    assert.equal(1, a:unlock())
  end)

  it("answers an unreachable server with an error within its 1 s server selection", function()
    local lock = assert(resty:new({ uri = "mongodb://127.0.0.1:9/", collection = coll }))
    local t0 = core.monotonic()
    local elapsed, err, code = lock:lock("k")
    local took = core.monotonic() - t0
    assert.is_nil(elapsed)
    assert.is_string(err)
    assert.is_not_nil(code)
    -- libmongoc's default would block the worker for 30 s; the bound is
    -- loose on purpose, it tells the 1 s default from that
    assert.is_true(took < 10, "took " .. took .. " s")
  end)

  it("raises on bad arguments, at the caller", function()
    local lock = new()
    assert.has_error(function() lock:lock(nil) end, "bad argument #1 to 'lock' (string expected, got nil)")
    assert.has_error(function() lock:lock("") end, "bad argument #1 to 'lock' (name must not be empty)")
    assert.has_error(function() lock:lock("\255") end, "bad argument #1 to 'lock' (name is not valid UTF-8)")
    assert.has_error(function() lock:expire(-1) end)
    assert.has_error(function() resty:new(5) end, "bad argument #1 to 'new' (table expected, got number)")
    for _, bad in ipairs({ { exptime = 0 }, { timeout = -1 }, { step = "x" }, { max_step = 0 / 0 },
                           { collection = 5 } }) do
      bad.client = client
      assert.has_error(function() resty:new(bad) end)
    end
    assert.has_error(function() resty:new({ client = 5 }) end,
      "bad argument #1 to 'new' (client: a mongolock client expected, got 5)")
    assert.has_error(function() resty:new({ uri = helpers.uri(), server_timeout = 100000 }) end,
      "bad argument #1 to 'new' (server_timeout must be at most a day (86400 seconds) (got 100000))")
    -- no uri and no client, with MONGODB_URI unset, is an error too (not
    -- checked here: the environment of this process is not ours to change)
  end)
  it('mode = "read": readers lock a key together, a writer waits for them', function()
    local key = helpers.unique("rw")
    local r1, r2 = new({ mode = "read" }), new({ mode = "read", timeout = 0 })
    assert.equal(0, r1:lock(key))
    assert.equal(0, r2:lock(key))
    assert.is_true(r2:token() > r1:token())
    local st = assert(client:rwlocks({ database = helpers.database, collection = coll })
      :status(key))
    assert.equal(2, st.in_use)
    local w = new({ timeout = 0 })
    assert.same({ nil, "timeout" }, { w:lock(key) })
    assert.is_true(r1:expire(10))
    assert.equal(1, r1:unlock())
    assert.equal(1, r2:unlock())
    assert.same({ nil, "unlocked" }, { r2:unlock() })
    assert.equal(0, w:lock(key))
    assert.same({ nil, "timeout" }, { r2:lock(key) })
    assert.equal(1, w:unlock())
    -- a reader waits for the writer's release: the time waited comes back
    local w2 = new({ exptime = 0.5 })
    assert.equal(0, w2:lock(key))
    local r3 = new({ mode = "read", timeout = 5 })
    local elapsed = assert(r3:lock(key))
    assert.is_true(elapsed > 0)
    assert.is_true(r3:token() > w2:token())
    assert.equal(1, r3:unlock())
  end)

  it("permits = N: N holders of a key, the next waits, another N is refused", function()
    local key = helpers.unique("sem")
    local a, b = new({ permits = 2 }), new({ permits = 2 })
    local c = new({ permits = 2, timeout = 0 })
    assert.equal(0, a:lock(key))
    assert.equal(0, b:lock(key))
    assert.same({ nil, "timeout" }, { c:lock(key) })
    assert.equal(1, a:unlock())
    assert.equal(0, c:lock(key))
    assert.is_true(c:token() > b:token())
    local other = new({ permits = 3 })
    local ok, err = other:lock(key)
    assert.is_nil(ok)
    assert.matches("has 2 permits, not 3", err, 1, true)
    -- an exclusive lock of the key waits until no permit is held
    local x = new({ timeout = 0 })
    assert.same({ nil, "timeout" }, { x:lock(key) })
    assert.equal(1, b:unlock())
    assert.equal(1, c:unlock())
    assert.equal(0, x:lock(key))
    assert.equal(1, x:unlock())
  end)

  it("raises on a bad mode or permits, at the caller, writing nothing", function()
    for _, bad in ipairs({ { mode = "shared" }, { mode = 1 }, { permits = 0 }, { permits = 1.5 },
                           { permits = "2" }, { mode = "read", permits = 2 },
                           { mode = "write", permits = 2 }, { mdoe = "read" } }) do
      bad.client, bad.database, bad.collection = client, helpers.database, coll
      assert.has_error(function() resty:new(bad) end)
      local ok, msg = pcall(function() local r = resty:new(bad); return r end)
      assert.is_false(ok)
      assert.matches("^[^\n]*resty_spec.lua:%d+: bad argument #1 to 'new'", msg)
    end
    local ok, msg = pcall(resty.new, resty, { client = client, mdoe = "read" })
    assert.is_false(ok)
    assert.matches("did you mean 'mode'", msg, 1, true)
    local r = assert(client:command(helpers.database, { find = coll }, { filter = {} }))
    assert.equal(0, #r.cursor.firstBatch)
  end)
end)
