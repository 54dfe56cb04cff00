-- #integration: optimistic concurrency (mongolock.versioned) and
-- client:command; round trips counted by the server (serverStatus
-- opcounters); a race between two OS processes on one document.
local helpers = require "helpers"

describe("#integration versioned", function()
  local client, commands, overhead, DB

  local function fresh(opts)
    return client:versioned(DB, helpers.unique("vc"), opts)
  end

  -- what the server counted while fn ran (per counter, serverStatus's own
  -- command removed), and how many commands vc sent (each one round trip)
  local function measured(vc, fn)
    local real, sent = vc.core, 0
    vc.core = setmetatable({}, { __index = function(_, k)
      local f = real[k]
      if type(f) ~= "function" then return f end
      return function(_, ...)
        if k == "command" then sent = sent + 1 end
        return f(real, ...)
      end
    end })
    local a = helpers.opcounters(client)
    local r = { fn() }
    local b = helpers.opcounters(client)
    vc.core = real
    local d = {}
    for _, k in ipairs({ "insert", "update", "delete", "query", "command" }) do
      d[k] = (b[k] or 0) - (a[k] or 0)
    end
    -- the server's counts are every client's: a client or a stream of an
    -- earlier spec that ends meanwhile (its endSessions, its killCursors:
    -- a stream ends 10 s after its last waiter) is not fn's.  (CI's LuaJIT
    -- lane once counted one command more here)
    d.command = d.command - overhead - (helpers.ended(b) - helpers.ended(a))
    return sent, d, r
  end

  setup(function()
    client = helpers.connect({ appname = "versioned" },
      helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    DB = helpers.database
    commands, overhead = helpers.command_counter(client)
  end)
  teardown(function() client:close() end)

  describe("client:command", function()
    it("returns the reply as a table", function()
      local r = assert(client._core:command("admin", { ping = 1 }))
      assert.equal(1, r.ok)
    end)

    it("returns nil, message, MongoDB's code, reply on a server error", function()
      local r, err, code, reply = client._core:command(DB, { noSuchCommand = 1 })
      assert.is_nil(r)
      assert.is_string(err)
      assert.equal(59, code)
      assert.equal(0, reply.ok)
    end)

    it("turns writeErrors into nil, errmsg, code", function()
      local coll = helpers.unique("cmd")
      assert(client._core:command(DB, { insert = coll }, { documents = { { _id = 1 } } }))
      local r, err, code, reply = client._core:command(DB, { insert = coll },
        { documents = { { _id = 1 } } })
      assert.is_nil(r)
      assert.equal(11000, code)
      assert.is_truthy(err:find("duplicate key", 1, true))
      assert.equal(1, #reply.writeErrors)
    end)

    it("raises on bad arguments, before sending anything", function()
      local c = client._core
      assert.has_error(function() c:command(nil, { ping = 1 }) end)
      assert.has_error(function() c:command("a.b", { ping = 1 }) end)
      assert.has_error(function() c:command("", { ping = 1 }) end)
      assert.has_error(function() c:command(DB, "ping") end)
      assert.has_error(function() c:command(DB, {}) end)
      assert.has_error(function() c:command(DB, { find = "x", filter = {} }) end,
        "bad argument #2 to 'command' (one key expected (the command name); put the other fields in opts)")
      assert.has_error(function() c:command(DB, { find = "x" }, { filter = { bad = print } }) end)
      assert.has_error(function() c:command(DB, { find = "x" }, 5) end)
    end)
  end)

  describe("single documents", function()
    it("insert sets the version (and an ObjectId _id when missing)", function()
      local vc = fresh()
      local d = { name = "a" }
      assert.is_true(vc:insert(d))
      assert.equal(1, d.version)
      assert.equal("objectid", d._id.type)
      local back = assert(vc:get(d._id))
      assert.equal(1, back.version)
      assert.equal("a", back.name)
      local dup = { _id = d._id, version = 7 }
      local ok, err, code = vc:insert(dup)
      assert.is_nil(ok)
      assert.equal(11000, code)
      assert.is_string(err)
      assert.equal(7, dup.version)
    end)

    it("replace: true and a bumped version; conflict with the current document; not found", function()
      local vc = fresh()
      local d = { _id = "r", n = 1 }
      assert(vc:insert(d))
      local stale = { _id = "r", version = 1, n = 99 }
      d.n = 2
      assert.is_true(vc:replace(d))
      assert.equal(2, d.version)
      local ok, err, cur = vc:replace(stale)
      assert.is_nil(ok)
      assert.equal("conflict", err)
      assert.equal(2, cur.n)
      assert.equal(2, cur.version)
      -- the losing write changed nothing
      local back = assert(vc:get("r"))
      assert.equal(2, back.n)
      assert.equal(2, back.version)
      assert.equal(1, stale.version)
      ok, err, cur = vc:replace({ _id = "nope", version = 1 })
      assert.is_nil(ok)
      assert.equal("not found", err)
      assert.is_nil(cur)
      assert.is_nil(vc:get("nope"))
    end)

    it("replace drops the fields the new document does not have", function()
      local vc = fresh()
      local d = { _id = 1, a = 1, b = 2 }
      assert(vc:insert(d))
      assert(vc:replace({ _id = 1, version = 1, a = 5 }))
      local back = assert(vc:get(1))
      assert.equal(5, back.a)
      assert.is_nil(back.b)
      assert.equal(2, back.version)
    end)

    it("update applies every supported operator at the right version", function()
      local vc = fresh()
      local d = { _id = "u", n = 10, m = 3, lo = 5, hi = 5, gone = 1, list = { 1 }, set = { "a" },
        pull = { 1, 2, 1, 3 }, old = "x", sub = { k = 1 } }
      assert(vc:insert(d))
      assert.is_true(vc:update(d, {
        ["$set"] = { s = "new", ["sub.k"] = 2 },
        ["$unset"] = { gone = "" },
        ["$inc"] = { n = 5, fresh = 1 },
        ["$mul"] = { m = 2 },
        ["$min"] = { lo = 1 },
        ["$max"] = { hi = 9 },
        ["$currentDate"] = { at = true },
        ["$push"] = { list = { ["$each"] = { 2, 3 } } },
        ["$addToSet"] = { set = { ["$each"] = { "a", "b" } } },
        ["$pull"] = { pull = 1 },
        ["$rename"] = { old = "renamed" },
      }))
      assert.equal(2, d.version)
      local b = assert(vc:get("u"))
      assert.equal("new", b.s)
      assert.equal(2, b.sub.k)
      assert.is_nil(b.gone)
      assert.equal(15, b.n)
      assert.equal(1, b.fresh)
      assert.equal(6, b.m)
      assert.equal(1, b.lo)
      assert.equal(9, b.hi)
      assert.equal("date", b.at.type)
      assert.same({ 1, 2, 3 }, { b.list[1], b.list[2], b.list[3] })
      assert.equal(3, #b.list)
      assert.equal(2, #b.set)
      assert.same({ 2, 3 }, { b.pull[1], b.pull[2] })
      assert.equal(2, #b.pull)
      assert.is_nil(b.old)
      assert.equal("x", b.renamed)
      assert.equal(2, b.version)
    end)

    it("update with a stale version is a conflict and changes nothing", function()
      local vc = fresh()
      local d = { _id = "c", n = 1 }
      assert(vc:insert(d))
      local stale = { _id = "c", version = 1 }
      assert(vc:update(d, { ["$inc"] = { n = 1 } }))
      local ok, err, cur = vc:update(stale, { ["$inc"] = { n = 100 }, ["$set"] = { x = 1 } })
      assert.is_nil(ok)
      assert.equal("conflict", err)
      assert.equal(2, cur.n)
      assert.is_nil(cur.x)
      local back = assert(vc:get("c"))
      assert.equal(2, back.n)
      assert.is_nil(back.x)
      assert.equal(2, back.version)
      ok, err = vc:update({ _id = "missing", version = 1 }, { ["$inc"] = { n = 1 } })
      assert.is_nil(ok)
      assert.equal("not found", err)
      assert.is_nil(vc:get("missing"))       -- and nothing was created
    end)

    it("update takes a pipeline", function()
      local vc = fresh()
      local d = { _id = 1, a = 2 }
      assert(vc:insert(d))
      assert(vc:update(d, { { ["$set"] = { b = { ["$multiply"] = { "$a", 10 } } } } }))
      assert.equal(20, assert(vc:get(1)).b)
    end)

    it("update refuses what it cannot apply safely", function()
      local vc = fresh()
      local d = { _id = 1, version = 1 }
      assert.has_error(function() vc:update(d, { ["$inc"] = { version = 1 } }) end)
      assert.has_error(function() vc:update(d, { ["$set"] = { _id = 2 } }) end)
      assert.has_error(function() vc:update(d, { ["$rename"] = { a = "version" } }) end)
      assert.has_error(function() vc:update(d, { ["$bit"] = { a = { ["and"] = 1 } } }) end)
      assert.has_error(function() vc:update(d, { a = 1 }) end)
      assert.has_error(function() vc:update(d, {}) end)
      assert.has_error(function() vc:update(d, "x") end)
      assert.has_error(function() vc:update(d, { ["$inc"] = { a = "x" } }) end)
      assert.has_error(function() vc:update(d, { ["$pull"] = { a = { ["$gt"] = 1 } } }) end)
      assert.has_error(function() vc:update({ _id = 1 }, { ["$inc"] = { a = 1 } }) end)
      assert.has_error(function() vc:update({ version = 1 }, { ["$inc"] = { a = 1 } }) end)
      assert.has_error(function() vc:update(nil, { ["$inc"] = { a = 1 } }) end)
    end)

    it("update and delete send only _id and the version: other fields need not be BSON", function()
      local vc = fresh()
      local obj = { _id = "o", n = 1 }
      assert(vc:insert(obj))
      -- an object with methods: only what is sent must be BSON
      obj.bump = function(self) return self.n + 1 end
      assert.is_true(vc:update(obj, { ["$inc"] = { n = 1 } }))
      assert.equal(2, obj.version)
      local back = assert(vc:get("o"))
      assert.equal(2, back.n)
      assert.equal(2, back.version)
      local results = vc:update_many({ obj }, { ["$inc"] = { n = 1 } })
      assert.same({ true }, results)
      assert.equal(3, obj.version)
      assert.is_true(vc:delete(obj))
      assert.same({ nil, "not found" }, { vc:get("o") })
    end)

    it("delete: true; conflict with the current document; not found", function()
      local vc = fresh()
      local d = { _id = "d", n = 1 }
      assert(vc:insert(d))
      assert(vc:update(d, { ["$set"] = { n = 2 } }))
      local ok, err, cur = vc:delete({ _id = "d", version = 1 })
      assert.is_nil(ok)
      assert.equal("conflict", err)
      assert.equal(2, cur.version)
      assert.is_true(vc:delete(d))
      assert.is_nil(vc:get("d"))
      ok, err = vc:delete(d)
      assert.is_nil(ok)
      assert.equal("not found", err)
    end)

    it("uses the configured field name", function()
      local vc = fresh({ field = "rev" })
      local d = { _id = 1 }
      assert(vc:insert(d))
      assert.equal(1, d.rev)
      assert.is_nil(d.version)
      assert(vc:update(d, { ["$set"] = { a = 1 } }))
      assert.equal(2, assert(vc:get(1)).rev)
      assert.equal("conflict", select(2, vc:replace({ _id = 1, rev = 1 })))
    end)

    it("modify retries with the current document on conflict", function()
      local vc = fresh()
      assert(vc:insert({ _id = "m", n = 0 }))
      local calls = 0
      local out = assert(vc:modify("m", function(doc)
        calls = calls + 1
        if calls == 1 then
          -- someone else writes in between
          local other = assert(vc:get("m"))
          assert(vc:update(other, { ["$inc"] = { n = 10 } }))
        end
        doc.n = doc.n + 1
        return doc
      end))
      assert.equal(2, calls)
      assert.equal(11, out.n)
      assert.equal(3, out.version)
      assert.equal(11, assert(vc:get("m")).n)
    end)

    it("modify: cancelled, not found, retries exhausted", function()
      local vc = fresh()
      assert(vc:insert({ _id = "m", n = 0 }))
      assert.same({ nil, "cancelled" }, { vc:modify("m", function() return nil end) })
      assert.equal("not found", select(2, vc:modify("x", function(d) return d end)))
      local ok, err, cur = vc:modify("m", function(doc)
        local other = assert(vc:get("m"))
        assert(vc:update(other, { ["$inc"] = { n = 1 } }))
        return doc
      end, { retries = 2 })
      assert.is_nil(ok)
      assert.equal("conflict", err)
      assert.equal(3, cur.n)
      assert.has_error(function() vc:modify("m", "f") end)
      assert.has_error(function() vc:modify("m", print, { retries = -1 }) end)
    end)

    it("every single write is one round trip, conflict or not", function()
      local vc = fresh()
      local d = { _id = 1, n = 0 }
      assert.equal(1, (commands(function() return vc:insert(d) end)))
      assert.equal(1, (commands(function() return vc:update(d, { ["$inc"] = { n = 1 } }) end)))
      assert.equal(1, (commands(function() return vc:replace(d) end)))
      local n, r = commands(function() return vc:update({ _id = 1, version = 1 }, { ["$inc"] = { n = 1 } }) end)
      assert.equal(1, n)
      assert.equal("conflict", r[2])
      n, r = commands(function() return vc:replace({ _id = 2, version = 1 }) end)
      assert.equal(1, n)
      assert.equal("not found", r[2])
      n, r = commands(function() return vc:delete({ _id = 2, version = 1 }) end)
      assert.equal(1, n)
      assert.equal("not found", r[2])
      assert.equal(1, (commands(function() return vc:delete(d) end)))
    end)

    it("answers nil, \"closed\" on a closed client", function()
      local c = helpers.connect()
      local vc = c:versioned(DB, helpers.unique("vc"))
      c:close()
      -- a document not inserted is left as it was
      local d, many = { a = 1 }, { { a = 1 }, { _id = 7, version = 3 } }
      assert.same({ nil, "closed" }, { vc:insert(d) })
      assert.same({ a = 1 }, d)
      assert.same({ nil, "closed" }, { vc:insert_many(many) })
      assert.same({ { a = 1 }, { _id = 7, version = 3 } }, many)
      assert.same({ nil, "closed" }, { vc:replace({ _id = 1, version = 1 }) })
      assert.same({ nil, "closed" }, { vc:get(1) })
    end)

    it("checks its options", function()
      assert.has_error(function() client:versioned(nil, "c") end)
      assert.has_error(function() client:versioned(DB, "") end)
      assert.has_error(function() client:versioned(DB, "c", { field = "_id" }) end)
      assert.has_error(function() client:versioned(DB, "c", { field = "a.b" }) end)
      assert.has_error(function() client:versioned(DB, "c", { field = 5 }) end)
      assert.has_error(function() client:versioned(DB, "c", { retries = 1.5 }) end)
      assert.has_error(function() client:versioned(DB, "c", 5) end)
      -- names as every other kind checks them
      assert.has_error(function() client:versioned("a/b", "c") end,
        "bad argument #1 to 'versioned' (database must be 1..63 bytes of UTF-8, none of /\\. \"$ "
        .. "or NUL (got \"a/b\"))")
      assert.has_error(function() client:versioned(DB, "a$b") end)
      assert.has_error(function() client:versioned(DB, "system.x") end)
    end)

    it("raises at the caller, naming the method, on values BSON cannot hold", function()
      local vc = fresh()
      local f = function() end
      local function raises(fn, msg)
        local ok, err = pcall(fn)
        assert.is_false(ok)
        assert.matches(msg, err, 1, true)
        assert.matches("^[^\n]*versioned_spec%.lua:%d+: ", err)
      end
      raises(function() vc:update({ _id = 1, version = 1 }, { ["$set"] = { x = f } }) end,
        "bad argument #2 to 'update' (update cannot be written as BSON")
      raises(function() vc:update_many({ { _id = 1, version = 1 } }, { ["$set"] = { x = f } }) end,
        "bad argument #2 to 'update_many' (update cannot be written as BSON")
      raises(function() vc:get(f) end, "bad argument #1 to 'get' (_id cannot be written as BSON")
      -- what is sent of a document: all of it (insert, replace), its _id
      local obj = { name = "n", fn = f }
      raises(function() vc:insert(obj) end, "bad argument #1 to 'insert' (document cannot be written as BSON")
      assert.same({ name = "n", fn = f }, obj)
      assert(vc:insert({ _id = "r", n = 1 }))
      raises(function() vc:replace({ _id = "r", version = 1, fn = f }) end,
        "bad argument #1 to 'replace' (document cannot be written as BSON")
      raises(function() vc:replace_many({ { _id = "r", version = 1 }, { _id = "s", version = 1, fn = f } }) end,
        "bad argument #1 to 'replace_many' (document 2 cannot be written as BSON")
      raises(function() vc:update({ _id = f, version = 1 }, { ["$set"] = { x = 1 } }) end,
        "bad argument #1 to 'update' (document cannot be written as BSON")
      raises(function() vc:delete({ _id = f, version = 1 }) end,
        "bad argument #1 to 'delete' (document cannot be written as BSON")
      local back = assert(vc:get("r"))
      assert.equal(1, back.version)
      assert.equal(1, back.n)
      raises(function() vc:modify(f, function(d) return d end) end,
        "bad argument #1 to 'modify' (_id cannot be written as BSON")
      raises(function() vc:delete_many({ { _id = f, version = 1 } }) end,
        "bad argument #1 to 'delete_many' (document 1 cannot be written as BSON")
      -- insert_many touches none of the documents before raising
      local good = { a = 1 }
      raises(function() vc:insert_many({ good, { b = f } }) end,
        "bad argument #1 to 'insert_many' (document 2 cannot be written as BSON")
      assert.is_nil(good._id)
      assert.is_nil(good.version)
    end)
  end)

  describe("many documents", function()
    it("insert_many: one round trip, per-document errors", function()
      local vc = fresh()
      local docs = { { _id = 1 }, { _id = 2 }, { _id = 3 } }
      local sent, d, r = measured(vc, function() return vc:insert_many(docs) end)
      assert.equal(1, sent)
      assert.same({ insert = 3, update = 0, delete = 0, query = 0, command = 0 }, d)
      assert.is_true(r[1])
      for _, doc in ipairs(docs) do assert.equal(1, doc.version) end
      local again = { { _id = 4 }, { _id = 2, version = 7 } }
      local ok, results = vc:insert_many(again)
      assert.is_nil(ok)
      assert.is_true(results[1])
      assert.is_truthy(results[2]:find("duplicate", 1, true))
      assert.equal(1, again[1].version)
      -- the one not inserted has its version back
      assert.equal(7, again[2].version)
    end)

    it("replace_many / update_many: one round trip when nothing conflicts", function()
      local vc = fresh()
      local docs = { { _id = 1, n = 1 }, { _id = 2, n = 2 }, { _id = 3, n = 3 } }
      assert(vc:insert_many(docs))
      local sent, d, r = measured(vc, function() return vc:update_many(docs, { ["$inc"] = { n = 10 } }) end)
      assert.equal(1, sent)
      assert.same({ insert = 0, update = 3, delete = 0, query = 0, command = 0 }, d)
      assert.same({ true, true, true }, r[1])
      for i, doc in ipairs(docs) do
        assert.equal(2, doc.version)
        assert.equal(i + 10, assert(vc:get(i)).n)
      end
      for _, doc in ipairs(docs) do doc.n = 0 end
      sent, d, r = measured(vc, function() return vc:replace_many(docs) end)
      assert.equal(1, sent)
      assert.same({ insert = 0, update = 3, delete = 0, query = 0, command = 0 }, d)
      assert.same({ true, true, true }, r[1])
      for i = 1, 3 do
        local b = assert(vc:get(i))
        assert.equal(0, b.n)
        assert.equal(3, b.version)
      end
    end)

    it("replace_many / update_many: conflict and not found per document", function()
      local vc = fresh()
      local docs = { { _id = 1, n = 1 }, { _id = 2, n = 2 } }
      assert(vc:insert_many(docs))
      local stale = { _id = 2, version = 1, n = 0 }
      assert(vc:update(docs[2], { ["$inc"] = { n = 1 } }))
      local batch = { docs[1], stale, { _id = 9, version = 1 } }
      local results, currents = vc:update_many(batch, { ["$inc"] = { n = 100 } })
      assert.same({ true, "conflict", "not found" }, results)
      assert.equal(3, currents[2].n)
      assert.is_nil(currents[1])
      assert.equal(101, assert(vc:get(1)).n)
      assert.equal(3, assert(vc:get(2)).n)      -- the conflicting one is untouched
      assert.is_nil(vc:get(9))                  -- and nothing was created
      results, currents = vc:replace_many({ docs[1], stale })
      assert.same({ true, "conflict" }, results)
      assert.equal(2, currents[2].version)
      assert.equal(3, assert(vc:get(1)).version)
    end)

    it("delete_many: one round trip; conflicts and not found per document", function()
      local vc = fresh()
      local docs = { { _id = 1 }, { _id = 2 }, { _id = 3 } }
      assert(vc:insert_many(docs))
      local sent, d, r = measured(vc, function() return vc:delete_many({ docs[1], docs[2] }) end)
      assert.equal(1, sent)
      assert.same({ insert = 0, update = 0, delete = 2, query = 0, command = 0 }, d)
      assert.same({ true, true, deleted = 2 }, r[1])
      assert(vc:update(docs[3], { ["$set"] = { a = 1 } }))
      local results, currents = vc:delete_many({ { _id = 3, version = 1 }, { _id = 7, version = 1 } })
      assert.same({ "conflict", "not found", deleted = 0 }, results)
      assert.equal(2, currents[1].version)
      assert(vc:insert({ _id = 4 }))
      results = vc:delete_many({ { _id = 4, version = 1 }, { _id = 8, version = 1 } })
      -- one deleted, one missing: the server only counts
      assert.same({ "deleted or not found", "deleted or not found", deleted = 1 }, results)
      assert.is_nil(vc:get(4))
    end)

    it("check their arguments", function()
      local vc = fresh()
      assert.has_error(function() vc:replace_many({ { _id = 1 } }) end)
      assert.has_error(function() vc:update_many({ { version = 1 } }, { ["$set"] = { a = 1 } }) end)
      assert.has_error(function() vc:update_many({ { _id = 1, version = 1 } }, { ["$set"] = { version = 1 } }) end)
      assert.has_error(function() vc:delete_many("x") end)
      assert.has_error(function() vc:insert_many({ 5 }) end)
      assert.same({}, (vc:replace_many({})))
    end)
  end)

  describe("two processes", function()
    local CHILD = [[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, mode, rounds, start, log = ...
rounds = tonumber(rounds)
local c = assert(mongolock.connect(os.getenv("MONGODB_URI")))
local vc = c:versioned(db, coll)
io.stdout:write("ready\n"); io.stdout:flush()
while not io.open(start, "r") do core.sleep(0.005) end
local f = assert(io.open(log, "w"))
local doc = assert(vc:get("counter"))
while doc.version <= rounds do
  local v = doc.version
  local ok, err, cur
  if mode == "replace" then
    doc.n = doc.n + 1
    ok, err, cur = vc:replace(doc)
  else
    ok, err, cur = vc:update(doc, { ["$inc"] = { n = 1 } })
  end
  if ok then
    f:write(string.format("W %d\n", v))
    doc = assert(vc:get("counter"))
  elseif err == "conflict" then
    f:write(string.format("C %d\n", v))
    doc = cur
  else
    error(tostring(err))
  end
end
f:close()
io.stdout:write("done\n"); io.stdout:flush()
]]

    it("exactly one writer wins each of 1000 rounds and no update is lost", function()
      local ROUNDS = 1000
      local vc = fresh()
      assert(vc:insert({ _id = "counter", n = 0 }))
      local script = helpers.script(CHILD)
      local start = os.tmpname(); os.remove(start)
      local logs = { os.tmpname(), os.tmpname() }
      local procs = {
        helpers.spawn(script, { DB, vc.coll, "replace", tostring(ROUNDS), start, logs[1] }),
        helpers.spawn(script, { DB, vc.coll, "update", tostring(ROUNDS), start, logs[2] }),
      }
      for _, p in ipairs(procs) do assert(p:wait_for("ready")) end
      local f = assert(io.open(start, "w")); f:close()
      for _, p in ipairs(procs) do
        local st, out = p:wait(120)
        assert.equal(0, st, out)
      end
      local winner, conflicts, wins = {}, 0, { 0, 0 }
      for i, path in ipairs(logs) do
        for line in io.lines(path) do
          local kind, v = line:match("^(%a) (%d+)$")
          v = tonumber(v)
          if kind == "W" then
            assert.is_nil(winner[v], "round " .. v .. " won twice")
            winner[v] = i
            wins[i] = wins[i] + 1
          else
            conflicts = conflicts + 1
          end
        end
        os.remove(path)
      end
      for v = 1, ROUNDS do assert.is_not_nil(winner[v], "round " .. v .. " has no winner") end
      assert.equal(ROUNDS, wins[1] + wins[2])
      local final = assert(vc:get("counter"))
      assert.equal(ROUNDS, final.n)               -- no update lost
      assert.equal(ROUNDS + 1, final.version)
      assert.is_true(conflicts > 0)               -- they did contend
      print(string.format("# versioned race: %d rounds, wins %d (replace) + %d (update), %d conflicts",
        ROUNDS, wins[1], wins[2], conflicts))
      os.remove(start)
      os.remove(script)
    end)
  end)
end)
