-- #integration: a try (one attempt) is bounded by about a second
-- (attempt_timeout, 1 s by default) when the server stops answering after
-- the client last saw it writable: a TCP proxy frozen with SIGSTOP
-- (spec/proxy.js) after one successful try.  The client's connection keeps
-- the attempt's deadline (csrc/driver/bounded.c); what the cut write may
-- take when the server thaws is released in the background.  Before, a
-- client not given attempt_timeout waited ~10 s ("Failed to read 4 bytes").
local helpers = require "helpers"

local clock = require("mongolock.core").monotonic

local function timed(f)
  local t0 = clock()
  local r = table.pack(f())
  return clock() - t0, r
end

describe("#integration a try on a frozen server", function()
  local proxy, client, direct

  local function setup(opts)
    proxy = helpers.proxy()
    client = helpers.connect(opts, proxy.uri)
    direct = helpers.connect()
  end

  after_each(function()
    if not proxy then return end
    proxy:thaw()
    client:close()
    direct:close()
    proxy:stop()
    proxy = nil
  end)

  local function check(opts, make, try)
    setup(opts)
    local obj, direct_obj = make(client), make(direct)
    local name = helpers.unique("frozen")
    local h = assert(try(obj, name))
    assert(h:release())
    proxy:freeze()
    local dt, r = timed(function() return try(obj, name .. "2") end)
    assert.is_nil(r[1])
    assert.equal(4, r[3])
    assert.matches("not answering", r[2], 1, true)
    assert.is_true(dt < 3, "the try took " .. dt .. " s")
    proxy:thaw()
    local h2
    helpers.eventually(function()
      h2 = try(obj, name .. "3")
      return h2 ~= nil
    end, 20)
    assert(h2:release())
    -- nothing left held: the timed-out attempt's name is free (its late
    -- write's release is sent again a second apart in the background)
    local h3
    helpers.eventually(function()
      h3 = try(direct_obj, name .. "2")
      return h3 ~= nil
    end, 10)
    assert(h3:release())
  end

  local function locks(c) return c:locks({ database = helpers.database, collection = "frozen_locks" }) end
  local function sems(c)
    return c:semaphores({ database = helpers.database, collection = "frozen_sems", permits = 2 })
  end
  local function try(o, n) return o:try(n) end

  it("locks:try, attempt_timeout given", function()
    check({ server_timeout = 10, attempt_timeout = 1 }, locks, try)
  end)

  it("a semaphore's try, attempt_timeout given", function()
    check({ server_timeout = 10, attempt_timeout = 1 }, sems, try)
  end)

  it("locks:try, by default (no attempt_timeout)", function()
    check({ server_timeout = 10 }, locks, try)
  end)

  it("a semaphore's try, by default (no attempt_timeout)", function()
    check({ server_timeout = 10 }, sems, try)
  end)
end)

describe("#integration a client closed while its single attempts are on (client:one_attempt)", function()
  -- the thread's round trips keep going through the runner of single
  -- attempts, which looked at the closed client: collected, its memory
  -- reused, that was a read of freed memory (make test-asan reports it)
  it("is not looked at by the thread's next round trip, another client's", function()
    local c = helpers.connect({ attempt_timeout = 1 })
    assert(c:command(helpers.database, { ping = 1 }))
    assert.is_false(c._core:one_attempt(true))
    c:close()
    c = nil -- luacheck: ignore 311
    collectgarbage()
    collectgarbage()
    local junk = {}
    for i = 1, 20000 do junk[i] = ("x"):rep(64) .. i end
    local d = helpers.connect()
    assert(d:command(helpers.database, { ping = 1 }))
    d:close()
    assert.equal(20000, #junk)
  end)
end)
