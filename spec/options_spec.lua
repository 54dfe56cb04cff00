-- Every option table is checked where it is given: unknown keys raise with
-- the key's name and the nearest valid one; ranges raise at connect, locks,
-- documents and new, in seconds and the option's name.  with reports a
-- lease lost while fn ran; resty.mongolock:new takes lua-resty-lock's
-- (dict_name, opts) form.
local helpers = require "helpers"
local mongolock = require "mongolock"

-- a port nothing listens on: checks raise before any round trip
local DEAD = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=200&connectTimeoutMS=200"

-- the error fn raises, without a position
local function raised(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, "did not raise")
  return (tostring(err):gsub("^[^:]*:%d+: ", ""))
end

describe("#unit options", function()
  local client, locks
  setup(function()
    client = assert(mongolock.connect(DEAD))
    locks = client:locks()
  end)
  teardown(function() client:close() end)

  it("an unknown key raises with its name and the nearest valid one", function()
    assert.equal("bad argument #2 to 'connect' (unknown option 'serverSelectionTimeoutMS' "
      .. "(did you mean 'server_selection_timeout'?))",
      raised(function() mongolock.connect(DEAD, { serverSelectionTimeoutMS = 1000 }) end))
    assert.equal("bad argument #1 to 'locks' (unknown option 'tll' (did you mean 'ttl'?))",
      raised(function() client:locks({ tll = 1 }) end))
    assert.equal("bad argument #2 to 'acquire' (unknown option 'timout' (did you mean 'timeout'?))",
      raised(function() locks:acquire("x", { timout = 1 }) end))
    assert.equal("bad argument #2 to 'try' (unknown option 'renwe' (did you mean 'renew'?))",
      raised(function() locks:try("x", { renwe = true }) end))
    assert.equal("bad argument #2 to 'with' (unknown option 'ttL' (did you mean 'ttl'?))",
      raised(function() locks:with("x", { ttL = 1 }, function() end) end))
    assert.equal("bad argument #3 to 'documents' (unknown option 'tim' (did you mean 'time'?))",
      raised(function() client:documents("db", "c", { tim = "locked" }) end))
    assert.equal("bad argument #3 to 'documents' (unknown option 'onwer' (did you mean 'owner'?))",
      raised(function() client:documents("db", "c", { fields = { onwer = "x" } }) end))
    assert.equal("bad argument #2 to 'lock' (unknown option 'inserts' (did you mean 'insert'?))",
      raised(function() client:documents("db", "c"):lock(1, { inserts = {} }) end))
    assert.equal("bad argument #3 to 'versioned' (unknown option 'retrys' (did you mean 'retries'?))",
      raised(function() client:versioned("db", "c", { retrys = 1 }) end))
    -- a key nothing resembles gets no suggestion
    assert.equal("bad argument #1 to 'locks' (unknown option 'zzzzzzzz')",
      raised(function() client:locks({ zzzzzzzz = 1 }) end))
    -- positional values are not options
    assert.equal("bad argument #1 to 'locks' (unknown option [1])",
      raised(function() client:locks({ 1 }) end))
  end)

  it("checks ranges where the options are given, in seconds and the option's name", function()
    local msg = raised(function() client:locks({ ttl = 1e12 }) end)
    assert.is_truthy(msg:find("bad argument #1 to 'locks' (ttl must be a positive number of seconds, "
      .. "at most a year", 1, true), msg)
    assert.is_nil(msg:find("millisecond", 1, true))
    msg = raised(function() client:documents("db", "c", { ttl = 1e12 }) end)
    assert.is_truthy(msg:find("bad argument #3 to 'documents' (ttl must be", 1, true), msg)
    msg = raised(function() client:locks({ queue_ttl = 1e12 }) end)
    assert.is_truthy(msg:find("queue_ttl must be a positive number of seconds", 1, true), msg)
    msg = raised(function() locks:acquire("x", { timeout = -1 }) end)
    assert.is_truthy(msg:find("bad argument #2 to 'acquire' (timeout must be a number of seconds >= 0",
      1, true), msg)
    msg = raised(function() mongolock.connect(DEAD, { server_timeout = 0 }) end)
    assert.is_truthy(msg:find("server_timeout must be a positive, finite number of seconds", 1, true), msg)
    msg = raised(function() client:locks({ renew = "yes" }) end)
    assert.is_truthy(msg:find("renew: boolean expected, got string", 1, true), msg)
    msg = raised(function() client:locks({ collection = "a$b" }) end)
    assert.is_truthy(msg:find("collection must be 1..", 1, true), msg)
  end)

  it("resty.mongolock checks its options at new", function()
    local resty = require "resty.mongolock"
    assert.equal("bad argument #1 to 'new' (unknown option 'exptim' (did you mean 'exptime'?))",
      raised(function() resty:new({ uri = DEAD, exptim = 1 }) end))
    assert.equal("bad argument #2 to 'new' (unknown option 'timeot' (did you mean 'timeout'?))",
      raised(function() resty:new("my_locks", { uri = DEAD, timeot = 1 }) end))
    local msg = raised(function() resty:new({ uri = DEAD, exptime = 1e12 }) end)
    assert.is_truthy(msg:find("exptime must be a positive number of seconds, at most a year", 1, true), msg)
    msg = raised(function() resty:new("a$b", { uri = DEAD }) end)
    assert.is_truthy(msg:find("bad argument #1 to 'new' (dict_name must be", 1, true), msg)
  end)
end)

describe("#integration with and lost leases", function()
  local client, other
  setup(function()
    client = helpers.connect()
    other = helpers.connect()
  end)
  teardown(function()
    client:close()
    other:close()
  end)

  it("locks:with returns nil, 'lost' when the lock was force released and taken during fn, " ..
     "and check() inside fn learns it within the renewal interval", function()
    local locks = helpers.locks(client)
    local olocks = other:locks({ database = locks.database, collection = locks.collection })
    local ttl = 0.9                       -- renewed every ttl/3 = 0.3 s
    local learned
    local r = table.pack and table.pack(locks:with("w", { ttl = ttl }, function(h)
      assert.is_true(h:check())
      assert.is_true(olocks:force_release("w"))
      local taker = assert(olocks:acquire("w", { ttl = 30 }))
      local t0 = require("mongolock.core").monotonic()
      helpers.eventually(function() return h:check() == nil end, 2 * ttl)
      learned = require("mongolock.core").monotonic() - t0
      assert.is_true(taker:release())
      return "done"
    end)) or { locks:with("w", { ttl = ttl }, function() end) }
    assert.is_true(learned < 2 * ttl / 3 + 0.2, ("check learned it after %.2f s"):format(learned))
    assert.is_nil(r[1])
    assert.equal("lost", r[2])
  end)

  it("locks:with returns fn's results when the lease held to the end", function()
    local locks = helpers.locks(client)
    assert.same({ 1, nil, 3 }, { locks:with("ok", function() return 1, nil, 3 end) })
  end)

  it("docs:with returns nil, 'lost' when the lock expired and was taken during fn", function()
    local docs = client:documents(helpers.database, helpers.unique("docs"))
    local odocs = other:documents(docs.db, docs.coll)
    local ok, err = docs:with("d", { insert = {}, ttl = 0.2, renew = false }, function()
      require("mongolock.core").sleep(0.3)
      local _, h = assert(odocs:lock("d", { timeout = 1 }))
      assert.is_true(h:release())
      return { written = true }
    end)
    assert.is_nil(ok)
    assert.equal("lost", err)
    local d = assert(client:versioned(docs.db, docs.coll):get("d"))
    assert.is_nil(d.written)
  end)
end)

describe("#integration resty.mongolock:new(dict_name, opts)", function()
  local resty = require "resty.mongolock"
  local client
  setup(function() client = helpers.connect() end)
  teardown(function() client:close() end)

  it("takes lua-resty-lock's form; dict_name names the collection", function()
    local dict = helpers.unique("dict")
    local a = assert(resty:new(dict, { client = client, database = helpers.database, timeout = 0 }))
    local b = assert(resty:new(dict, { client = client, database = helpers.database, timeout = 0 }))
    local key = helpers.unique("k")
    assert.equal(0, a:lock(key))
    assert.same({ nil, "timeout" }, { b:lock(key) })
    -- the lock is a document of the collection named dict
    local r = assert(client:command(helpers.database, { count = dict }, { query = { _id = key } }))
    assert.equal(1, r.n)
    -- another dictionary is another set of keys
    local c = assert(resty:new(helpers.unique("dict"), { client = client, database = helpers.database,
      timeout = 0 }))
    assert.equal(0, c:lock(key))
    assert.equal(1, c:unlock())
    assert.equal(1, a:unlock())
  end)
end)
