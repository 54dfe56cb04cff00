-- The protocol/transport seam seen from Lua (csrc/binding/ops.c): pure builders
-- (no server), client:run, and the parsers, which give what the C methods
-- (locks:acquire, status, ...) give.  An attempt's op and its outcome cross
-- as a mongolock.Attempt (a = client:acquire_attempt(...), a:op(),
-- a:take(...), ...), a handle's release and extend as core.lease_step /
-- core.lease_done.
local core = require "mongolock.core"

local OWNER = ("0123456789abcdef"):rep(2)
local OWNER2 = ("fedcba9876543210"):rep(2)
local TAG = "00112233aabbccdd"
-- no server answers here: the ops below are built, never sent
local DEAD = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=200&connectTimeoutMS=200"

local function decode(op) return assert(core.bson_decode(op)) end

-- the holder an attempt of this process writes (a URI without appname)
-- the holder document an attempt writes: host, pid and the process's tag
-- (t: a write that ends the lease names it in lost)
local function holder() return { host = core.hostname(), pid = core.getpid(), t = core.process_tag() } end

describe("#unit ops (builders, no server)", function()
  local c, h
  setup(function()
    c = assert(core.connect(DEAD))
    -- a handle of a lease on {_id: "n"} in d.c, made without a round trip
    h = assert(c:granted("d", "c", "n", OWNER, 5000, 5000, 1, core.monotonic()))
  end)
  teardown(function() c:close() end)   -- closed first: h sends nothing

  it("builds an acquire as a retried findAndModify in an envelope", function()
    local a = c:acquire_attempt("d", "c", "n", 5000, nil, nil, nil, nil, nil, OWNER)
    local op, owner = a:op(), a:owner()
    assert.is_string(op)
    assert.equal(OWNER, owner)
    local e = decode(op)
    assert.equal("write", e.kind)
    assert.is_true(e.retry)
    assert.equal("d", e.db)
    assert.equal("c", e.coll)
    assert.equal("c", e.cmd.findAndModify)
    assert.equal("n", e.cmd.query._id)
    assert.is_true(e.cmd.upsert)
    -- a try takes nothing from the queue and never queues
    local set = e.cmd.update[4]["$set"]
    assert.same({ "$_mlt", "$_mlq", "$queue" }, set.queue["$cond"])
    assert.equal(OWNER, set.owner["$cond"][2])
    assert.same(holder(), set.holder["$cond"][2]["$literal"])
  end)

  it("writes a waiter's entry with its process tag, 48 hex digits in next", function()
    local w = OWNER2
    local a = c:acquire_attempt("d", "c", "n", 5000, nil, nil, w, 3000, true)
    local op, owner = a:op(), a:owner()
    assert.equal(w, owner)
    local e = decode(op)
    local entry = e.cmd.update[4]["$set"].queue["$cond"][3]["$cond"][3]["$concatArrays"][2][1]
    assert.equal(w, entry.w)
    assert.equal(core.process_tag(), entry.t)
    assert.is_true(entry.p)
    -- the lease it asks for and its holder, which a release granting it
    -- the lock writes
    assert.equal(5000, entry.l)
    assert.same(holder(), entry.h["$literal"])
    local leave = decode(core.op_leave{ db = "d", coll = "c", name = "n", waiter = w, tag = TAG })
    assert.equal("update", leave.kind)
    local cond = leave.cmd.updates[1].u[2]["$set"].next["$cond"][1]["$eq"]
    assert.equal(TAG .. w, cond[2])
    assert.equal(48, #cond[2])
  end)

  it("builds release, extend and force release as updates of one document", function()
    local r = decode((core.lease_step(h, "release")))
    assert.equal("update", r.kind)
    assert.same({ _id = "n", owner = OWNER }, r.cmd.updates[1].q)
    -- a named lock's release grants it to the first live watching waiter
    -- (_mlh), else frees it
    local u = r.cmd.updates[1].u
    assert.equal(3, #u)
    assert.is_table(u[1]["$set"]._mlh)
    local set = u[2]["$set"]
    assert.same({ "$_mlh", "$_mlh.w", core.null }, set.owner["$cond"])
    assert.equal("$$NOW", set.expiresAt["$cond"][3])
    assert.same({ { ["$add"] = { "$$NOW", "$_mlh.l" } }, "$_mlh.until" }, set.expiresAt["$cond"][2]["$min"])
    assert.same({ ["$unset"] = { "_mlh" } }, u[3])
    -- a leave hands a lock already granted to its waiter on the same way,
    -- when _mlr (that grant) holds, else frees nothing
    local lv = decode(core.op_leave{ db = "d", coll = "c", name = "n", waiter = ("b"):rep(32), tag = TAG })
    local lset = lv.cmd.updates[1].u[5]["$set"]
    assert.same({ "$_mlh", "$_mlh.w", { ["$cond"] = { "$_mlr", core.null, "$owner" } } }, lset.owner["$cond"])
    assert.same({ "$_mlr", "$$NOW", "$expiresAt" }, lset.expiresAt["$cond"][3]["$cond"])
    assert.same({ ["$unset"] = { "_mlr", "_mlh" } }, lv.cmd.updates[1].u[6])
    local x = decode((core.lease_step(h, "extend", 1.5)))
    assert.same({ "$$NOW", 1500 }, x.cmd.updates[1].u[1]["$set"].expiresAt["$add"])
    local f = decode(core.op_force_release{ db = "d", coll = "c", name = "n" })
    assert.equal(core.null, f.cmd.updates[1].q.owner["$ne"])
  end)

  it("builds status, list, the TTL index and any command", function()
    local s = decode(core.op_status{ db = "d", coll = "c", name = "n" })
    assert.equal("cursor", s.kind)
    assert.equal("n", s.cmd.pipeline[1]["$match"]._id)
    local l = decode(core.op_status{ db = "d", coll = "c" })
    assert.same({ _id = 1 }, l.cmd.pipeline[2]["$sort"])
    local i = decode(core.op_ensure_index{ db = "d", coll = "c", expire_after = 60 })
    assert.equal(60, i.cmd.indexes[1].expireAfterSeconds)
    local cmd = decode(core.op_command("admin", { ping = 1 }, { comment = "x" }))
    assert.equal("command", cmd.kind)
    assert.same({ ping = 1, comment = "x" }, cmd.cmd)
  end)

  -- a status read sees only what a majority has (a write a failover may
  -- roll back is not reported as held)
  it("reads status and lists with readConcern majority", function()
    for what, op in pairs({
      status = core.op_status{ db = "d", coll = "c", name = "n" },
      list = core.op_status{ db = "d", coll = "c" },
      share_status = core.op_share_status{ db = "d", coll = "c", name = "n" },
      share_list = core.op_share_status{ db = "d", coll = "c" },
      doc_status = core.op_doc_status{ db = "d", coll = "c", id = 7, owner_field = "lockId",
                                       time_field = "lockExpires", ttl_ms = 1000 },
    }) do
      local o = decode(op)
      assert.equal("cursor", o.kind, what)
      assert.same({ level = "majority" }, o.cmd.readConcern, what)
    end
  end)

  it("builds the change stream's aggregate, getMore and killCursors", function()
    local w = decode(core.op_watch{ db = "d", coll = "c", tag = TAG, t = 5, i = 2 })
    assert.equal("c", w.cmd.aggregate)
    local cs = w.cmd.pipeline[1]["$changeStream"].startAtOperationTime
    assert.equal(5, cs.t)
    assert.is_table(w.cmd.pipeline[2]["$match"]["$or"])
    -- the stream keeps of an event what parse_events reads, not the diff
    -- of the whole queue a granting release writes
    local keep = w.cmd.pipeline[3]["$project"]
    assert.equal(1, keep["updateDescription.updatedFields.next"])
    assert.equal(1, keep["fullDocument.owner"])
    assert.equal(1, keep["updateDescription.removedFields"])
    assert.is_nil(keep["updateDescription.updatedFields.queue"])
    -- and lost: a write that ended a lease of this process passes by it
    assert.equal(1, keep["updateDescription.updatedFields.lost"])
    assert.equal(1, keep["fullDocument.lost"])
    local lost = 0
    for _, clause in ipairs(w.cmd.pipeline[2]["$match"]["$or"]) do
      local re = clause["updateDescription.updatedFields.lost"] or clause["fullDocument.lost"]
      if re then
        lost = lost + 1
        assert.equal("^" .. TAG, re.pattern)
      end
    end
    assert.equal(2, lost)
    local n = 0
    for _ in pairs(keep) do n = n + 1 end
    assert.equal(16, n)
    -- an owner field of a document lock is kept too, once
    keep = decode(core.op_watch{ db = "d", coll = "c", tag = TAG, field = "lockedBy" }).cmd.pipeline[3]["$project"]
    assert.equal(1, keep["updateDescription.updatedFields.lockedBy"])
    n = 0
    for _ in pairs(keep) do n = n + 1 end
    assert.equal(18, n)
    local g = decode(core.op_getmore{ db = "d", coll = "c", cursor_id = "9007199254740993" })
    assert.equal("c", g.cmd.collection)
    assert.equal("9007199254740993", tostring(g.cmd.getMore):match("%d+"))
    -- ids use all 64 bits: a string or an integer keeps every digit, a
    -- float that may have lost some is refused, and so is a string past
    -- 64 bits (strtoll would clamp it to another cursor's id)
    local big = "9223372036854775807"
    local function getmore_id(id)
      return tostring(decode(core.op_getmore{ db = "d", coll = "c", cursor_id = id }).cmd.getMore):match("%d+")
    end
    assert.equal(big, getmore_id(big))
    if math.type then
      assert.equal(big, getmore_id(math.tointeger(big + 0) or 9223372036854775807))
    end
    local kc = decode(core.op_killcursors{ db = "d", coll = "c", cursor_id = 4096.0 })
    assert.equal("4096", tostring(kc.cmd.cursors[1]):match("%d+"))
    for _, bad in ipairs({ 2^53 + 2, 1.5, 0/0, "9223372036854775808", "12x", "" }) do
      assert.has_error(function() core.op_getmore{ db = "d", coll = "c", cursor_id = bad } end)
      assert.has_error(function() core.op_killcursors{ db = "d", coll = "c", cursor_id = bad } end)
    end
    local k = decode(core.op_killcursors{ db = "d", coll = "c", cursor_id = "12" })
    assert.is_nil(k.session)
    local key = ("ab"):rep(16)
    assert.equal(key, decode(core.op_watch{ db = "d", coll = "c", tag = TAG, session = key }).session)
    assert.equal(key, decode(core.op_getmore{ db = "d", coll = "c", cursor_id = "1", session = key }).session)
    assert.equal(key, decode(core.op_killcursors{ db = "d", coll = "c", cursor_id = "1", session = key }).session)
    assert.has_error(function() core.op_getmore{ db = "d", coll = "c", cursor_id = "1", session = "x" } end)
    assert.equal("c", k.cmd.killCursors)
  end)

  it("raises on bad arguments and changes nothing", function()
    local ok = { db = "d", coll = "c", name = "n", owner = OWNER, ttl_ms = 1000 }
    local function acquire_op(k, v)
      local t = {}
      for kk, vv in pairs(ok) do t[kk] = vv end
      t[k] = v
      return c:acquire_attempt(t.db, t.coll, t.name, t.ttl_ms, nil, nil, t.waiter, t.waiter and 1000, nil,
        t.owner):op()
    end
    assert.has_error(function() acquire_op("owner", "XYZ") end)
    assert.has_error(function() acquire_op("owner", OWNER:upper()) end)
    assert.has_error(function() acquire_op("ttl_ms", 0) end)
    assert.has_error(function() acquire_op("db", "a.b") end)
    assert.has_error(function() acquire_op("coll", "a$b") end)
    assert.has_error(function() acquire_op("name", "") end)
    assert.has_error(function() acquire_op("waiter", "XYZ") end)
    assert.has_error(function() acquire_op("waiter", OWNER2) end)   -- a waiter's owner is its id
    assert.has_error(function() c:granted("d", "c", "n", nil, 1000, 1000, 1, core.monotonic()) end)
    local a = c:acquire_attempt("d", "c", "n", 1000, nil, nil, nil, nil, nil, OWNER)
    a:op()
    assert.has_error(function() a:take("not bson") end)
    assert.has_error(function() core.parse_update("\5\0\0\0") end)
  end)

  it("parses replies without a server", function()
    local reply = core.bson_encode({ ok = 1, matchedCount = 1 })
    assert.equal(1, core.parse_update(reply))
    assert.equal(2, core.parse_update(core.bson_encode({ ok = 1, n = 2 })))
    assert.same({ nil, "update reply without matchedCount" },
      { core.parse_update(core.bson_encode({ ok = 1 })) })
  end)
end)

describe("#integration ops (client:run)", function()
  local helpers = require "helpers"
  local client, locks, c, DB
  setup(function()
    client = helpers.connect({ appname = "ops" })
    locks = helpers.locks(client)
    c = client._core
    DB = locks.database
  end)
  teardown(function() client:close() end)

  local function run(op)
    local reply, err, code = c:run(op)
    assert(reply, tostring(err) .. " " .. tostring(code))
    return reply
  end

  -- an attempt as a transport runs it: client:acquire_attempt's op run by
  -- client:run, finished by a:take -> h | nil, "busy", info
  local function attempt(name, owner, waiter)
    local a = c:acquire_attempt(DB, locks.collection, name, 20000, "ops", false, waiter, waiter and 5000,
      nil, owner)
    return a:take(run(a:op()))
  end
  -- h:release() or h:extend(ttl) as a transport runs it: the op of
  -- core.lease_step run by client:run, finished by core.lease_done; returns
  -- the documents the op matched and the op (run again: it matches none)
  local function step(h, what, arg)
    local op, started = core.lease_step(h, what, arg)
    local reply = run(op)
    assert.is_true(core.lease_done(h, what, started, reply))
    return core.parse_update(reply), op
  end
  local held = {}   -- the handles of the attempts, kept until the end

  it("acquires, tells busy, extends and releases as the methods do", function()
    local name = helpers.unique("ops")
    local r = assert(attempt(name, OWNER))
    held[#held + 1] = r
    assert.is_number(r.token)
    assert.is_true(r:remaining() > 15 and r:remaining() <= 20)
    -- what locks:try says about it
    local h, err, info = locks:try(name)
    assert.is_nil(h)
    assert.equal("busy", err)
    local none, busy, b = attempt(name, OWNER2)
    assert.is_nil(none)
    assert.equal("busy", busy)
    assert.equal(OWNER, b.owner)
    assert.equal(info.owner, b.owner)
    assert.equal(info.token, b.token)
    assert.same(info.holder, b.holder)
    assert.equal(info.queued, b.queued)
    -- status through the seam equals locks:status
    local st = core.parse_status(run(core.op_status{ db = DB, coll = locks.collection, name = name }))
    local want = assert(locks:status(name))
    assert.equal(1, #st)
    assert.equal(want.owner, st[1].owner)
    assert.equal(want.token, st[1].token)
    assert.is_true(st[1].held)
    assert.same(want.holder, st[1].holder)
    -- extend, release (one document matched each), then nothing to release
    assert.equal(1, (step(r, "extend", 5)))
    local n, release = step(r, "release")
    assert.equal(1, n)
    assert.equal(0, core.parse_update(run(release)))
    assert.is_false(assert(locks:status(name)).held)
    local list = core.parse_status(run(core.op_status{ db = DB, coll = locks.collection }))
    assert.same(locks:list(), list)
  end)

  it("queues a waiter, leaves, and force-releases", function()
    local name = helpers.unique("ops-q")
    local h = assert(locks:acquire(name))
    local w = core.waiter_id()
    local tag = core.process_tag()
    local none, busy, r = attempt(name, w, w)
    assert.is_nil(none)
    assert.equal("busy", busy)
    assert.equal(1, r.position)
    assert.equal(1, assert(locks:status(name)).waiting)
    assert.equal(1, core.parse_update(run(core.op_leave{ db = DB, coll = locks.collection,
      name = name, waiter = w, tag = tag })))
    assert.equal(0, assert(locks:status(name)).waiting)
    assert.equal(1, core.parse_update(run(core.op_force_release{ db = DB, coll = locks.collection,
      name = name })))
    assert.equal("lost", select(2, h:release()))
  end)

  it("runs any command, and the TTL index", function()
    local ping = core.bson_decode(run(core.op_command("admin", { ping = 1 })))
    assert.equal(1, ping.ok)
    run(core.op_ensure_index{ db = DB, coll = locks.collection, expire_after = 86400 })
    local reply, err, code = c:run(core.op_command(DB, { noSuchCommand = 1 }))
    assert.is_nil(reply)
    assert.is_string(err)
    assert.is_number(code)
  end)

  it("refuses what is not an op", function()
    assert.has_error(function() c:run("xyz") end)
    assert.has_error(function() c:run(core.bson_encode({ kind = "write" })) end)
  end)

  -- ops are read at their top level and their command's (where this library
  -- and libmongoc read them); what is nested in the command only the server
  -- reads, and refuses when malformed
  it("raises on an op malformed at its top level; one malformed deeper is the server's error", function()
    local op = core.op_command(DB, { find = "x" }, { filter = { a = { s = "ZZZZ" } } })
    local at = assert(op:find("s\0\5\0\0\0ZZZZ\0", 1, true))
    -- the string's length past its document's end
    local nested = op:sub(1, at + 1) .. "\200\0\0\0" .. op:sub(at + 6)
    assert.equal(#op, #nested)
    local reply, err, code = c:run(nested)
    assert.is_nil(reply)
    assert.is_string(err)
    assert.is_number(code)
    assert.is_string(run(core.op_command("admin", { ping = 1 })))   -- the client goes on
    -- the envelope's db string, and the command's find string, past their ends
    local db = assert(op:find("db\0", 1, true))
    assert.error_matches(function() c:run(op:sub(1, db + 2) .. "\200\0\0\0" .. op:sub(db + 7)) end,
      "malformed BSON")
    local find = assert(op:find("find\0", 1, true))
    assert.error_matches(function() c:run(op:sub(1, find + 4) .. "\200\0\0\0" .. op:sub(find + 9)) end,
      "not an op")
  end)

  it("reads a release from the change stream it built", function()
    local name = helpers.unique("ops-w")
    local tag = core.process_tag()
    local b = assert(attempt(name, OWNER))
    held[#held + 1] = b
    local _, _, busy = attempt(name, OWNER2)
    local ot = busy.operation_time
    if not ot and not helpers.standin then return end   -- a standalone server has none
    assert.is_table(ot)
    local first = core.parse_events(run(core.op_watch{ db = DB, coll = locks.collection, tag = tag,
      t = ot.t, i = ot.i }), tag)
    assert.is_string(first.cursor_id)
    assert.equal(1, (step(b, "release")))
    local seen
    for _ = 1, 5 do
      local batch = core.parse_events(run(core.op_getmore{ db = DB, coll = locks.collection,
        cursor_id = first.cursor_id, await_ms = 500 }), tag)
      for _, e in ipairs(batch.events) do
        if e.id == name then seen = e end
      end
      if seen then break end
    end
    run(core.op_killcursors{ db = DB, coll = locks.collection, cursor_id = first.cursor_id })
    assert.is_table(seen)
    assert.equal("", seen.next)   -- nobody queued: every waiter wakes
  end)
  -- mongod continues a cursor only in the session that created it (50737
  -- without an lsid, 50738 in another session): each client's pool would
  -- give each command its own implicit session, so a cursor's commands name
  -- a session key, and any client of the process runs them in it
  it("runs a cursor's aggregate, getMores and killCursors in one session, from any client", function()
    local name = helpers.unique("ops-s")
    local tag = core.process_tag()
    local key = ("5e55"):rep(8)
    local other = helpers.connect({ appname = "ops-other" })
    local oc = other._core
    local b = assert(attempt(name, OWNER))
    held[#held + 1] = b
    local _, _, busy = attempt(name, OWNER2)
    local ot = busy.operation_time
    if not ot and not helpers.standin then other:close() return end
    local first = core.parse_events(run(core.op_watch{ db = DB, coll = locks.collection, tag = tag,
      t = ot.t, i = ot.i, session = key }), tag)
    assert.equal(1, (step(b, "release")))
    local seen
    for _ = 1, 5 do
      -- on the other client, while this one runs commands of its own
      local reply, err, code = oc:run(core.op_getmore{ db = DB, coll = locks.collection,
        cursor_id = first.cursor_id, await_ms = 500, session = key })
      assert(reply, tostring(err) .. " " .. tostring(code))
      for _, e in ipairs(core.parse_events(reply, tag).events) do
        if e.id == name then seen = e end
      end
      core.parse_status(run(core.op_status{ db = DB, coll = locks.collection, name = name }))
      if seen then break end
    end
    assert.is_table(seen)
    local killed = core.bson_decode(run(core.op_killcursors{ db = DB, coll = locks.collection,
      cursor_id = first.cursor_id, session = key }))
    assert.equal(1, #killed.cursorsKilled)
    -- killCursors ended the session
    local reply, err = oc:run(core.op_getmore{ db = DB, coll = locks.collection,
      cursor_id = first.cursor_id, session = key })
    assert.is_nil(reply)
    assert.matches("session is not open", err)
    other:close()
  end)
end)

describe("#unit ops of document locks (builders, no server)", function()
  local ref = { db = "d", coll = "c", id = 7, owner_field = "lockId", time_field = "lockExpires" }
  local function with(extra)
    local t = {}
    for k, v in pairs(ref) do t[k] = v end
    for k, v in pairs(extra) do t[k] = v end
    return t
  end
  local c
  local handles = {}   -- kept until c closes: they send nothing then
  setup(function() c = assert(core.connect(DEAD)) end)
  teardown(function() c:close() end)

  -- the op of client:doc_acquire_attempt on the lock of ref (t: what differs)
  local function acquire_op(t)
    local a = with({ ttl_ms = 5000, time = "expires", owner_type = "hex", owner = OWNER })
    for k, v in pairs(t) do a[k] = v end
    return c:doc_acquire_attempt(a.db, a.coll, a.id, a.ttl_ms, a.owner_field, a.time_field, a.time,
      a.owner_type, a.insert, nil, a.owner):op()
  end
  -- a handle of OWNER on the lock of ref, from a reply as a transport's
  -- attempt takes it (a:take; no server)
  local function handle(owner_type)
    local value = OWNER
    if owner_type == "uuid" then
      value = core.Binary((OWNER:gsub("..", function(x) return string.char(tonumber(x, 16)) end)), 4)
    end
    local a = c:doc_acquire_attempt("d", "c", 7, 5000, "lockId", "lockExpires", "expires",
      owner_type or "hex", nil, nil, OWNER)
    a:op()
    local h = assert(a:take(
      core.bson_encode({ ok = 1, value = { doc = { _id = 7, lockId = value }, remainingMs = 5000 } })))
    handles[#handles + 1] = h
    return h
  end

  it("builds acquire, release with changes, extend and status on {_id} of the document", function()
    local a = decode((acquire_op{ insert = { status = "new" } }))
    assert.equal("write", a.kind)
    assert.equal("c", a.cmd.findAndModify)
    assert.same({ _id = 7 }, a.cmd.query)
    assert.is_true(a.cmd.upsert)              -- insert given: a missing document is created
    assert.falsy(decode((acquire_op{})).cmd.upsert)
    local h = handle()
    local r = decode((core.lease_step(h, "release", { status = "paid" })))
    assert.equal("update", r.kind)
    assert.same({ _id = 7, lockId = OWNER }, r.cmd.updates[1].q)
    -- the caller's changes and the cleared lock in the same update
    local u = core.bson_encode({ u = r.cmd.updates[1].u })
    assert.truthy(u:find("paid", 1, true))
    local plain = decode((core.lease_step(h, "release")))
    assert.falsy(core.bson_encode({ u = plain.cmd.updates[1].u }):find("paid", 1, true))
    local e = decode((core.lease_step(h, "extend", 3)))
    -- only a live lease: an extend after its end does not bring it back
    assert.same({ _id = 7, lockId = OWNER, ["$expr"] = { ["$gt"] = { "$lockExpires", "$$NOW" } } },
      e.cmd.updates[1].q)
    local s = decode(core.op_doc_status(with{ ttl_ms = 3000 }))
    assert.equal("cursor", s.kind)
    assert.equal("c", s.cmd.aggregate)
    -- the .NET form: the owner as a UUID
    local g = decode((core.lease_step(handle("uuid"), "release")))
    assert.is_not.equal(OWNER, g.cmd.updates[1].q.lockId)
  end)

  it("raises on a bad field, an insert or changes that touch the lock fields", function()
    local function w(k, v)
      return function() acquire_op({ id = 7, [k] = v }) end
    end
    assert.has_error(function()
      c:doc_acquire_attempt("d", "c", nil, 1000, "lockId", "lockExpires", "expires", "hex", nil, nil, OWNER)
    end, "bad argument #3 to 'doc_acquire_attempt' (_id expected, got nil)")
    assert.has_error(function()
      core.op_doc_status{ db = "d", coll = "c", owner_field = "lockId", time_field = "lockExpires", ttl_ms = 1000 }
    end, "bad argument #1 to 'op_doc_status' (id: _id expected, got nil)")
    assert.has_error(w("id", core.array({ 1 })))
    assert.has_error(w("owner_field", "a.b"))
    assert.has_error(w("time_field", "lockId"))
    assert.has_error(w("time", "now"))
    assert.has_error(w("owner_type", "guid"))
    assert.has_error(w("insert", "x"))
    assert.has_error(w("insert", { lockId = "x" }))
    local h = handle()
    assert.has_error(function() core.lease_step(h, "release", { lockExpires = 1 }) end)
    assert.has_error(function() core.lease_step(h, "release", { ["$set"] = { _id = 1 } }) end)
    assert.has_error(function() core.lease_step(h, "release", { a = 1, ["$set"] = { b = 1 } }) end)
    assert.has_error(function() core.lease_step(h, "extend", 0) end)
    local a = c:doc_acquire_attempt("d", "c", 7, 1000, "lockId", "lockExpires", "expires", "hex", nil, nil, OWNER)
    a:op()
    assert.has_error(function() a:take("nope") end)
    assert.has_error(function()
      c:doc_acquire_attempt("d", "c", 7, 1000, "a.b", "lockExpires", "expires", "hex", nil, nil, OWNER)
    end)
  end)
end)

describe("#integration ops of document locks (client:run)", function()
  local helpers = require "helpers"
  local client, c, docs, DB, COLL
  setup(function()
    client = helpers.connect({ appname = "ops-docs" })
    c = client._core
    DB = client:default_database()
    COLL = helpers.unique("opsdocs")
    docs = client:documents(DB, COLL, { ttl = 20 })
  end)
  teardown(function()
    client:command(DB, { drop = COLL })
    client:close()
  end)

  local function run(op)
    local reply, err, code = c:run(op)
    assert(reply, tostring(err) .. " " .. tostring(code))
    return reply
  end
  local function lock(id, extra)
    local t = { db = DB, coll = COLL, id = id, owner_field = "lockId", time_field = "lockExpires" }
    for k, v in pairs(extra or {}) do t[k] = v end
    return t
  end
  -- an attempt as a transport runs it: client:doc_acquire_attempt's op run
  -- by client:run, finished by a:take -> h, doc | nil, ...
  local function attempt(id, owner, insert)
    local a = c:doc_acquire_attempt(DB, COLL, id, 20000, "lockId", "lockExpires", "expires", "hex", insert,
      false, owner)
    return a:take(run(a:op()))
  end

  it("acquires, tells busy, extends, releases with changes as docs:try and h:release do", function()
    local id = helpers.unique("d")
    assert.same({ nil, "not found" }, { attempt(id, OWNER) })
    local won, got = attempt(id, OWNER, { status = "new" })
    assert.is_userdata(won)
    assert.equal("new", got.status)
    assert.equal(OWNER, got.lockId)
    -- what docs:try says about it, and through the seam
    local _, err, info = docs:try(id)
    assert.equal("busy", err)
    local none, busy, b = attempt(id, OWNER2)
    assert.is_nil(none)
    assert.equal("busy", busy)
    assert.equal(OWNER, b.owner)
    assert.equal(info.owner, b.owner)
    assert.equal("new", b.doc.status)
    assert.is_true(b.remaining > 15 and b.remaining <= 20)
    local st = core.parse_doc_status(run(core.op_doc_status(lock(id, { ttl_ms = 20000 }))))
    local want = assert(docs:status(id))
    assert.equal(want.owner, st.owner)
    assert.is_true(st.held)
    assert.equal("held", st.state)
    -- won:extend(5) and won:release(changes) as a transport runs them
    -- (core.lease_step, client:run, core.lease_done)
    local op, started = core.lease_step(won, "extend", 5)
    local reply = run(op)
    assert.equal(1, core.parse_update(reply))
    assert.is_true(core.lease_done(won, "extend", started, reply))
    -- the extend of an owner that does not hold it (a handle that believes
    -- it won, from a reply no server sent) matches nothing
    local a = c:doc_acquire_attempt(DB, COLL, id, 20000, "lockId", "lockExpires", "expires", "hex",
      nil, false, OWNER2)
    a:op()
    local other = assert(a:take(
      core.bson_encode({ ok = 1, value = { doc = { _id = id, lockId = OWNER2 }, remainingMs = 20000 } })))
    assert.equal(0, core.parse_update(run((core.lease_step(other, "extend", 5)))))
    local release
    release, started = core.lease_step(won, "release", { status = "paid" })
    reply = run(release)
    assert.equal(1, core.parse_update(reply))
    assert.is_true(core.lease_done(won, "release", started, reply))
    assert.equal(0, core.parse_update(run(release)))
    local doc, h = assert(docs:try(id))
    assert.equal("paid", doc.status)
    h:release()
    assert.same({ nil, "not found" },
      { core.parse_doc_status(run(core.op_doc_status(lock("none", { ttl_ms = 1000 })))) })
    assert.equal("free", core.parse_doc_status(run(core.op_doc_status(lock(id, { ttl_ms = 1000 })))).state)
  end)
end)

describe("#integration ops of reader shares and permits (client:run)", function()
  local helpers = require "helpers"
  local client, c, sems, DB
  setup(function()
    client = helpers.connect({ appname = "ops-shares" })
    c = client._core
    sems = client:semaphores({ collection = helpers.unique("opssem"), permits = 2 })
    DB = sems.database
  end)
  teardown(function() client:close() end)

  local function run(op)
    local reply, err, code = c:run(op)
    assert(reply, tostring(err) .. " " .. tostring(code))
    return reply
  end

  it("acquires a permit, reads the status and force-releases as the methods do", function()
    local name = helpers.unique("sem")
    local coll = sems.collection
    -- a permit's attempt as a transport runs it: client:share_acquire_attempt's
    -- op run by client:run, finished by a:take
    local a = c:share_acquire_attempt(DB, coll, name, "permit", 2, 20000, nil, false, nil, nil, nil, OWNER)
    local r = a:take(run(a:op()))
    assert.is_userdata(r)
    local h = assert(sems:try(name))
    local st = core.bson_decode(run(core.op_share_status{ db = DB, coll = coll, name = name })).cursor.firstBatch
    assert.equal(1, #st)
    local want = assert(c:share_status(DB, coll, name))
    assert.same(want.permits, st[1].permits)
    assert.equal(2, #st[1].holders)
    assert.equal(#want.holders, #st[1].holders)
    local all = core.bson_decode(run(core.op_share_status{ db = DB, coll = coll })).cursor.firstBatch
    assert.equal(1, #all)
    assert.equal(name, all[1]._id)
    assert.equal(1, core.parse_update(run(core.op_share_force_release{ db = DB, coll = coll, name = name })))
    assert.equal(0, assert(sems:status(name)).in_use)
    assert.same({ nil, "lost" }, { h:release() })
    assert.has_error(function() core.op_share_status{ db = DB, coll = "a$b" } end)
    assert.has_error(function() core.op_share_force_release{ db = DB, coll = coll } end)
  end)
end)

describe("#unit ops of elections (builders, no server)", function()
  local c
  setup(function() c = assert(core.connect(DEAD)) end)
  teardown(function() c:close() end)

  it("a campaign's attempt publishes its value with its term only when it takes the lock", function()
    local e = decode((c:campaign_attempt("d", "c", "n", 5000, nil, nil, nil, nil, "$not-a-path", OWNER):op()))
    local stage = e.cmd.update[5]["$set"]
    assert.same({ "$_mlt", { ["$literal"] = "$not-a-path" }, "$value" }, stage.value["$cond"])
    assert.same({ "$_mlt", "$token", "$valueToken" }, stage.valueToken["$cond"])
    assert.same({ "_mlq", "_mlt", "_mlo" }, e.cmd.update[6]["$unset"])
    -- every other acquire has no such stage
    local plain = decode((c:acquire_attempt("d", "c", "n", 5000, nil, nil, nil, nil, nil, OWNER):op()))
    assert.equal(5, #plain.cmd.update)
    assert.is_nil(plain.cmd.update[5]["$set"])
  end)

  it("builds proclaim, leader and the observer's stream", function()
    local p = decode(core.op_proclaim{ db = "d", coll = "c", name = "n", owner = OWNER, value = "v" })
    assert.equal("update", p.kind)
    assert.equal(OWNER, p.cmd.updates[1].q.owner)
    assert.same({ "$expiresAt", "$$NOW" }, p.cmd.updates[1].q["$expr"]["$gt"])
    assert.same({ ["$literal"] = "v" }, p.cmd.updates[1].u[1]["$set"].value)
    assert.equal("$token", p.cmd.updates[1].u[1]["$set"].valueToken)
    local l = decode(core.op_leader{ db = "d", coll = "c", name = "n" })
    assert.equal("command", l.kind)
    assert.equal("n", l.cmd.pipeline[1]["$match"]._id)
    assert.equal(1, l.cmd.pipeline[2]["$project"].value)
    local key = ("ab"):rep(16)
    local o = decode(core.op_observe{ db = "d", coll = "c", name = "n", t = 5, i = 2, session = key })
    assert.equal(key, o.session)
    assert.equal(5, o.cmd.pipeline[1]["$changeStream"].startAtOperationTime.t)
    assert.equal("n", o.cmd.pipeline[2]["$match"]["$or"][1]["documentKey._id"])
    for _, bad in ipairs({ 5, "a\0b", ("x"):rep(16385), "\255" }) do
      assert.has_error(function() core.op_proclaim{ db = "d", coll = "c", name = "n", owner = OWNER, value = bad } end)
    end
    assert.has_error(function() core.op_leader{ db = "d", coll = "c" } end)
  end)
end)
