-- #integration: several locks at once (client:acquire_all): all or none
-- within one timeout, any mix of kinds, one canonical order so that
-- overlapping sets asked in opposite orders never deadlock.
local helpers = require "helpers"

describe("#integration several locks at once", function()
  local client, other, coll, locks, rw, sems, other_locks
  setup(function()
    client = helpers.connect({ appname = "multi-parent" })
    -- a holder elsewhere (a blocking wait for what its own client holds
    -- answers "deadlock")
    other = helpers.connect({ appname = "multi-other" })
    coll = helpers.unique("multi")
    local o = { database = helpers.database, collection = coll }
    locks = client:locks(o)
    other_locks = other:locks(o)
    rw = client:rwlocks(o)
    sems = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
  end)
  teardown(function() client:close(); other:close() end)

  local function doc(name) return helpers.lock_doc(client, coll, name) end

  it("takes a mix of kinds as one set and releases them all", function()
    local a, b, c = helpers.unique("a"), helpers.unique("b"), helpers.unique("c")
    local set = assert(client:acquire_all({ { locks, a }, { rw, b, "read" }, { sems, c } }))
    assert.is_true(set:check())
    assert.is_true(assert(locks:status(a)).held)
    assert.equal(1, assert(rw:status(b)).in_use)
    assert.equal(1, assert(sems:status(c)).in_use)
    -- a reader can join b, nobody else gets a or c
    assert.is_true(assert(rw:try_read(b)):release())
    assert.is_nil((locks:try(a)))
    assert.is_nil((sems:try(c)))
    assert.is_true(set:release())
    assert.same({ nil, "not held" }, { set:release() })
    assert.is_false(assert(locks:status(a)).held)
    assert.equal(0, assert(rw:status(b)).in_use)
    assert.equal(0, assert(sems:status(c)).in_use)
  end)

  it("takes all or none within one timeout", function()
    local a, b, c = helpers.unique("a"), helpers.unique("b"), helpers.unique("c")
    local hb = assert(other_locks:try(b, { ttl = 30 }))
    local set, err = client:acquire_all({ { locks, c }, { locks, a }, { locks, b } },
      { timeout = 0.5 })
    assert.is_nil(set)
    assert.equal("timeout", err)
    -- what it had taken before b was given back
    assert.is_false(assert(locks:status(a)).held)
    assert.is_nil(locks:status(c))         -- after b in the order: never asked
    assert.is_true(hb:release())
    set = assert(client:acquire_all({ { locks, c }, { locks, a }, { locks, b } }, { timeout = 2 }))
    assert.is_true(set:close())
    assert.is_false(assert(locks:status(b)).held)
  end)

  it("two processes taking overlapping sets in opposite orders never deadlock", function()
    local names = helpers.unique("x") .. "," .. helpers.unique("y")
    local n = 30
    local p1 = helpers.kinds_child(coll, "multi", "set", names, n, "fwd", 1)
    local p2 = helpers.kinds_child(coll, "multi", "set", names, n, "rev", 1)
    for _, p in ipairs({ p1, p2 }) do
      local st, out = p:wait(120)
      assert.equal(0, st, out)
      assert.matches("done", out)
      p:cleanup()
    end
  end)

  it("takes document locks too: a two-player trade is all or none", function()
    local players = client:documents(helpers.database, coll .. "-players", { ttl = 10 })
    local a, b = helpers.unique("pa"), helpers.unique("pb")
    assert(client:command(helpers.database, { insert = coll .. "-players" },
      { documents = { { _id = a, gold = 100 }, { _id = b, gold = 100 } } }))
    -- b is held elsewhere: nothing is taken, a is free again afterwards
    local _, hb = assert(other:documents(helpers.database, coll .. "-players", { ttl = 10 }):try(b))
    local set, err = client:acquire_all({ { players, a }, { players, b }, { locks, a } },
      { timeout = 0.3 })
    assert.is_nil(set)
    assert.equal("timeout", err)
    assert.is_false(assert(players:status(a)).held)
    assert.is_true(hb:release())
    set = assert(client:acquire_all({ { players, b }, { players, a }, { locks, a } }, { timeout = 2 }))
    local ha, da = set:get(2)
    local _, db = set:get(1)
    assert.equal(a, ha.id)
    assert.equal(100, da.gold)
    assert.equal(100, db.gold)
    assert.is_nil(select(2, set:get(3)))          -- a named lock has no document
    assert.has_error(function() set:release({ [3] = { x = 1 } }) end,
      "bad argument #1 to 'release' (changes[3]: not a document lock of the set)")
    assert.is_true(set:release({ [1] = { gold = db.gold + 10 }, [2] = { gold = da.gold - 10 } }))
    local r = assert(client:command(helpers.database, { find = coll .. "-players" },
      { filter = { _id = { ["$in"] = { a, b } } }, sort = { gold = 1 } }))
    assert.same({ 90, 110 }, { r.cursor.firstBatch[1].gold, r.cursor.firstBatch[2].gold })
    assert.is_false(assert(players:status(a)).held)
    assert.is_false(assert(players:status(b)).held)
    -- a document named twice (42 and 42.0 are one _id) is refused
    assert.has_error(function() client:acquire_all({ { players, 42 }, { players, 42.0 } }) end,
      "bad argument #1 to 'acquire_all' (entry 2: its _id is in the set twice)")
  end)

  it("two processes locking two documents in opposite orders, 30 times, never deadlock", function()
    local pcoll = coll .. "-trade"
    local x, y = helpers.unique("x"), helpers.unique("y")
    assert(client:command(helpers.database, { insert = pcoll },
      { documents = { { _id = x, n = 0 }, { _id = y, n = 0 } } }))
    local n = 30
    local p1 = helpers.kinds_child(pcoll, "docset", "set", x .. "," .. y, n, "fwd", 1)
    local p2 = helpers.kinds_child(pcoll, "docset", "set", x .. "," .. y, n, "rev", 1)
    for _, p in ipairs({ p1, p2 }) do
      local st, out = p:wait(120)
      assert.equal(0, st, out)
      assert.matches("done", out)
      p:cleanup()
    end
    -- every transfer landed: 60 units moved from x to y
    local r = assert(client:command(helpers.database, { find = pcoll }, { filter = {}, sort = { n = 1 } }))
    assert.same({ -2 * n, 2 * n }, { r.cursor.firstBatch[1].n, r.cursor.firstBatch[2].n })
  end)

  it("refuses malformed sets at the caller, writing nothing", function()
    local a = helpers.unique("bad")
    assert.has_error(function() client:acquire_all("a") end,
      "bad argument #1 to 'acquire_all' (table expected, got string)")
    assert.has_error(function() client:acquire_all({}) end,
      "bad argument #1 to 'acquire_all' (no entries)")
    assert.has_error(function() client:acquire_all({ { locks, a }, { locks, a } }) end,
      "bad argument #1 to 'acquire_all' (entry 2: \"" .. a .. "\" is in the set twice)")
    -- the same name as two kinds is the same document: refused as well
    assert.has_error(function() client:acquire_all({ { locks, a }, { sems, a } }) end)
    local many = {}
    for i = 1, 65 do many[i] = { locks, a .. i } end
    assert.has_error(function() client:acquire_all(many) end,
      "bad argument #1 to 'acquire_all' (more than 64 entries)")
    assert.has_error(function() client:acquire_all({ { rw, a } }) end)
    assert.has_error(function() client:acquire_all({ { rw, a, "share" } }) end)
    assert.has_error(function() client:acquire_all({ { sems, a, "read" } }) end)
    assert.has_error(function() client:acquire_all({ { {}, a } }) end)
    assert.has_error(function() client:acquire_all({ { locks, 7 } }) end)
    assert.has_error(function() client:acquire_all({ { locks, a } }, { timeout = -1 }) end)
    assert.has_error(function() client:acquire_all({ { locks, a } }, { bogus = true }) end)
    assert.is_nil(doc(a))
    assert.is_nil(doc(a .. "1"))
  end)

  it("gives back the entries it took when a later one raises, and refuses a semaphores object "
     .. "without permits before taking any", function()
    local a, b = helpers.unique("a"), helpers.unique("b")
    local bare = client:semaphores({ database = helpers.database, collection = coll })
    assert.has_error(function() client:acquire_all({ { locks, a }, { bare, b } }) end,
      "bad argument #1 to 'acquire_all' (entry 2: a semaphores object without permits "
      .. "(semaphores{permits = N}))")
    assert.is_nil(doc(a))
    -- an object of the caller's whose acquire raises, taken after a
    local raising = { database = helpers.database, collection = coll,
      acquire = function() error("raised by the entry", 0) end }
    assert.has_error(function() client:acquire_all({ { locks, a }, { raising, b } }) end,
      "raised by the entry")
    local st = locks:status(a)
    assert.is_true(st == nil or st.held == false, "a is still held")
  end)

  if _VERSION == "Lua 5.4" then
    it("<close> releases the whole set", function()
      local a, b = helpers.unique("a"), helpers.unique("b")
      local chunk = assert(load([[
        local client, locks, sems, a, b, fail = ...
        local set <close> = assert(client:acquire_all({ { locks, a }, { sems, b } }))
        if fail then error("inside", 0) end
        return true
      ]]))
      assert.is_true(chunk(client, locks, sems, a, b, false))
      assert.is_false(assert(locks:status(a)).held)
      assert.equal(0, assert(sems:status(b)).in_use)
      assert.is_false(pcall(chunk, client, locks, sems, a, b, true))
      assert.is_false(assert(locks:status(a)).held)
    end)
  end
end)
