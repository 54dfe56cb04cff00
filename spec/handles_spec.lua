-- #integration: one definition of a handle's states (held, lost, released,
-- closed) that every method answers alike, for named and document locks,
-- and one release path that a renewal racing it never mistakes for a loss.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local lua54 = _VERSION == "Lua 5.4" and not rawget(_G, "jit")

describe("#integration handle states", function()
  local client, DB
  setup(function()
    client = helpers.connect({ appname = "handles" })
    DB = helpers.database
  end)
  teardown(function() client:close() end)

  -- takes the document lock away from its holder, as another party whose
  -- lease began after it expired would
  local function steal(docs, id)
    assert(client:command(DB, { update = docs.coll }, { updates = {
      { q = { _id = id }, u = { ["$set"] = { lockId = ("ab"):rep(16) } } } } }))
  end

  it("a lost named lock and a lost document lock answer the same on release", function()
    local locks = helpers.locks(client)
    local name = helpers.unique("lost")
    local h = assert(locks:acquire(name))
    assert(locks:force_release(name))
    local ok1, err1 = h:release()
    local docs = client:documents(DB, helpers.unique("docs"))
    local _, d = assert(docs:lock("x", { insert = {} }))
    steal(docs, "x")
    local ok2, err2 = d:release()
    assert.is_nil(ok1)
    assert.is_nil(ok2)
    assert.equal(err2, err1)
    assert.equal("lost", err1)
    -- and every query agrees afterwards
    for _, x in ipairs({ h, d }) do
      assert.is_false(x:held())
      assert.is_true(x:lost())
      assert.same({ nil, "lost" }, { x:check() })
      assert.same({ nil, "lost" }, { x:remaining() })
      assert.same({ nil, "lost" }, { x:extend() })
    end
  end)

  it("held() is false once the lease is lost to a taker", function()
    local locks = helpers.locks(client)
    local name = helpers.unique("taken")
    local h = assert(locks:acquire(name, { ttl = 0.2 }))
    core.sleep(0.3)
    local c2 = helpers.connect()
    local h2 = assert(helpers.locks(c2, { collection = locks.collection }):try(name))
    assert.is_false(h:held())
    assert.is_true(h:lost())
    assert.same({ nil, "lost" }, { h:check() })
    assert(h2:release())
    c2:close()
  end)

  it("lost() stays true: extending a lease that expired untaken does not revive it", function()
    local locks = helpers.locks(client)
    local h = assert(locks:acquire(helpers.unique("expired"), { ttl = 0.2 }))
    core.sleep(0.3)
    assert.is_true(h:lost())
    assert.same({ nil, "lost" }, { h:extend(5) })
    assert.is_true(h:lost())
    assert.is_false(h:held())
    assert.same({ nil, "lost" }, { h:check() })
  end)

  it("answers closed for every handle of a closed client, and its renewal stops", function()
    local c2 = helpers.connect({ appname = "handles-close" })
    local locks = helpers.locks(c2)
    local h = assert(locks:acquire(helpers.unique("cc"), { renew = true }))
    local docs = c2:documents(DB, helpers.unique("docs"))
    local _, d = assert(docs:lock("y", { insert = {} }))
    assert.is_true(testing.renew_stats(c2._core).running)
    c2:close()
    for _, x in ipairs({ h, d }) do
      assert.is_false(x:held())
      assert.same({ nil, "closed" }, { x:check() })
      assert.same({ nil, "closed" }, { x:remaining() })
      assert.same({ nil, "closed" }, { x:release() })
      assert.same({ nil, "closed" }, { x:extend() })
      assert.is_true(x:close())
    end
  end)

  it("a closed client still makes lock objects, whose calls answer closed", function()
    local c2 = helpers.connect({ appname = "handles-closed-objects" })
    local name = c2:default_database()
    c2:close()
    assert.equal(name, c2:default_database())
    local locks = c2:locks()
    assert.equal(name, locks.database)
    assert.same({ nil, "closed" }, { locks:try("x") })
    assert.same({ nil, "closed" }, { locks:acquire("x", { timeout = 1 }) })
    assert.same({ nil, "closed" }, { locks:status("x") })
    local rw, sems = c2:rwlocks(), c2:semaphores({ permits = 2 })
    assert.same({ nil, "closed" }, { rw:try_read("x") })
    assert.same({ nil, "closed" }, { rw:status("x") })
    assert.same({ nil, "closed" }, { sems:try("x") })
  end)

  it("checks extend's argument: a positive number of seconds, no strings", function()
    local locks = helpers.locks(client)
    local h = assert(locks:acquire(helpers.unique("arg")))
    local ok, err = pcall(h.extend, h, 0)
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'extend' %(", err)
    ok, err = pcall(function() return h:extend(0) end)
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'extend' %(", err)
    ok, err = pcall(h.extend, h, "5")
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'extend' %(number expected, got string%)", err)
    assert.has_error(function() h:extend(-1) end)
    assert.has_error(function() h:extend(0 / 0) end)
    assert.is_true(h:extend(5))
    assert(h:release())
  end)

  it("prints a token exactly with token_string()", function()
    local locks = helpers.locks(client)
    local h = assert(locks:acquire(helpers.unique("tok")))
    local s = h:token_string()
    assert.matches("^%d+$", s)
    assert.is_true(#s >= 16)
    assert.equal(h.token, tonumber(s))
    if math.type then assert.equal(string.format("%d", h.token), s) end
    -- two tokens of one millisecond print apart
    assert(h:release())
    local h2 = assert(locks:acquire(h.name))
    assert.are_not.equal(s, h2:token_string())
    assert(h2:release())
    assert.equal(s, h:token_string())    -- readable after release too
  end)

  it("status tells held, expired (with the last holder) and free apart", function()
    local locks = helpers.locks(client)
    local name = helpers.unique("state")
    local h = assert(locks:acquire(name, { ttl = 0.2 }))
    local st = assert(locks:status(name))
    assert.equal("held", st.state)
    assert.is_true(st.held)
    core.sleep(0.3)
    st = assert(locks:status(name))
    assert.equal("expired", st.state)
    assert.is_false(st.held)
    assert.equal(h.owner, st.owner)
    assert.equal(core.getpid(), st.holder.pid)
    assert.is_number(st.expires_at)
    assert.equal(0, st.remaining)
    local list = assert(locks:list())
    assert.equal("expired", list[1].state)
    assert.is_nil(h:release())
    local h2 = assert(locks:acquire(name))
    assert(h2:release())
    st = assert(locks:status(name))
    assert.equal("free", st.state)
    assert.is_false(st.held)
  end)

  -- A handle's lease is C memory that the collector cannot see, so making
  -- one counts against Lua's collector (Lua 5.2+: as 1 KiB allocated).  Lua
  -- 5.1's and LuaJIT's step API cannot count: it runs collector steps at
  -- once, which ended the collector's pause between cycles (it never
  -- rested) and restarted a stopped one.
  it("making handles leaves a stopped collector stopped", function()
    local locks = helpers.locks(client)
    local name = helpers.unique("gcstop")
    collectgarbage("collect")
    local probe = setmetatable({}, { __mode = "k" })
    for _ = 1, 100 do probe[{}] = true end
    collectgarbage("stop")
    local ok, err = pcall(function()
      for _ = 1, 1000 do
        local h = assert(locks:try(name))
        assert(h:release())
      end
    end)
    local left = 0
    for _ in pairs(probe) do left = left + 1 end
    collectgarbage("restart")
    assert(ok, err)
    assert.equal(100, left)
  end)
end)

describe("#integration one release path", function()
  -- Each path ends a renewed lease just as its renewal is due, many times
  -- over: a renewal that reaches the server after the release matches
  -- nothing, and must not be taken for a loss.
  local client, DB
  setup(function()
    client = helpers.connect({ appname = "release-path" })
    DB = helpers.database
  end)
  teardown(function() client:close() end)

  local TTL = 0.3          -- the renewal is due a third of it after the acquire
  local ROUNDS = 24

  local function race(acquire, finish)
    local before = testing.renew_stats(client._core).lost or 0
    local lost = {}
    for k = 1, ROUNDS do
      local h = acquire()
      -- around the renewal: from 2 ms before it to 1 ms after
      core.sleep(TTL / 3 - 0.002 + (k % 13) * 0.00025)
      local ok, err = finish(h)
      assert(ok ~= nil or err == nil, tostring(err))
      if h:lost() then lost[#lost + 1] = k end
    end
    testing.renew_flush(client._core)
    core.sleep(0.05)
    assert.same({}, lost)
    assert.equal(before, testing.renew_stats(client._core).lost)
  end

  local function named()
    local locks = helpers.locks(client)
    return function() return assert(locks:acquire("r", { ttl = TTL, renew = true })) end
  end

  local function document()
    local docs = client:documents(DB, helpers.unique("docs"), { ttl = TTL, renew = true })
    return function()
      local _, h = assert(docs:lock("r", { insert = {} }))
      return h
    end
  end

  for _, kind in ipairs({ "named", "document" }) do
    local make = kind == "named" and named or document
    it(kind .. ": release", function()
      race(make(), function(h) return h:release() end)
    end)
    it(kind .. ": close", function()
      race(make(), function(h) return h:close() end)
    end)
    if lua54 then
      it(kind .. ": __close", function()
        local scope = assert(load([[
          local h = ...
          local x <close> = h
          return true
        ]]))
        race(make(), function(h) return scope(h) end)
      end)
    end
    it(kind .. ": __gc (the renewal thread releases)", function()
      local acquire = make()
      local before = testing.renew_stats(client._core).lost or 0
      for k = 1, ROUNDS do
        do
          local _ = acquire()
        end
        core.sleep(TTL / 3 - 0.002 + (k % 13) * 0.00025)
        collectgarbage()
        collectgarbage()
      end
      assert.is_true(testing.renew_flush(client._core))
      assert.equal(before, testing.renew_stats(client._core).lost)
    end)
  end
end)
