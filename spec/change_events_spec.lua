-- #integration: the change events of every write the library makes on a
-- lock document, as mongod 5.0+ emits them (doc/design.md, "Change events
-- of the lock writes"), and which of them the library's own change-stream
-- filter passes, in which process, for which waiter.
--
-- Two processes are played in this one: tags TA and TB, each with the
-- library's own stream (core.op_watch: the pipeline csrc/model/protocol.c builds)
-- read by the library's own parser (core.parse_events).  Waiters are made
-- with the library's own commands, as a transport runs them
-- (client:acquire_attempt, a:op / a:take, core.lease_step / lease_done).  A
-- plain $changeStream beside them shows each event as the server sent it.
local helpers = require "helpers"
local core = require "mongolock.core"

local null = core.null

local TA, TB = ("a"):rep(16), ("b"):rep(16)
local WA, WB, WC = ("1a"):rep(16), ("2b"):rep(16), ("3c"):rep(16)

-- the keys of a table, sorted
local function keys(t)
  local out = {}
  for k in pairs(t or {}) do out[#out + 1] = k end
  table.sort(out)
  return out
end

describe("#integration change events of the lock writes", function()
  local client, cc, DB, coll, name
  local raw, sa, sb           -- a plain change stream; the library's, for TA and TB

  local function run(op)
    local reply, err = cc:run(op)
    assert(reply, err)
    return reply
  end

  -- the handles the attempts won, by waiter (kept: a collected one would
  -- send a release of its own)
  local won, kept = {}, {}

  -- a waiter's attempt, as acquire makes it (the waiter id is the owner
  -- id): client:acquire_attempt's op (a:op()), in which the played
  -- process's tag stands for this process's own (the same length: still a
  -- BSON document), run by client:run and finished by a:take -> {won}
  local function attempt(w, tag)
    local a = cc:acquire_attempt(DB, coll, name, 60000, "events", false, w, 60000, false, w)
    local op = a:op():gsub(core.process_tag(), tag)
    local h, err = a:take(run(op))
    if h then
      kept[#kept + 1] = won[w]
      won[w] = h
    end
    assert(h or err == "busy", err)
    return { won = h ~= nil }
  end
  -- h:extend(ttl) or h:release() of w's handle as a transport runs it
  -- (core.lease_step, client:run, core.lease_done): documents matched
  local function step(w, what, arg)
    local op, started = core.lease_step(won[w], what, arg)
    local reply = run(op)
    assert.is_true(core.lease_done(won[w], what, started, reply))
    return core.parse_update(reply)
  end

  local function filtered(tag, t, i)
    local b = core.parse_events(run(core.op_watch({ db = DB, coll = coll, tag = tag, t = t, i = i })), tag)
    assert.equal(0, #b.events)
    return { tag = tag, id = b.cursor_id }
  end
  -- what the library's stream of that process passes next (await: ms to wait)
  local function passed(s, await)
    return core.parse_events(run(core.op_getmore({ db = DB, coll = coll, cursor_id = s.id, await_ms = await })),
      s.tag).events
  end

  -- the next event of the plain stream
  local function event()
    for _ = 1, 10 do
      local id = raw.id
      if type(id) == "number" then id = core.Int64(id) end
      local r = assert(cc:command(DB, { getMore = id }, { collection = coll, maxTimeMS = 1000 }))
      raw.id = r.cursor.id
      local ev = r.cursor.nextBatch[1]
      if ev then
        assert.equal(1, #r.cursor.nextBatch)
        return ev
      end
    end
    error("no change event")
  end

  -- checks that exactly the processes in `who` (tag -> next expected) got
  -- the event through their filter
  local function woken(who)
    for _, s in ipairs({ sa, sb }) do
      local want = who[s.tag]
      local evs = passed(s, want and 5000 or 300)
      if want then
        assert.equal(1, #evs, "passed in " .. s.tag)
        assert.equal(name, evs[1].id)
        assert.equal(want, evs[1].next, "the waiter named in " .. s.tag)
      else
        assert.equal(0, #evs, "nothing passes in " .. s.tag)
      end
    end
  end

  setup(function()
    client = helpers.connect({ appname = "events" })
    cc = client._core
    DB = helpers.database
    coll = helpers.unique("events")
    name = helpers.unique("events-lock")
    assert(cc:command(DB, { create = coll }))
    local r = assert(cc:command(DB, { ping = 1 }))
    local t, i = r.operationTime.t, r.operationTime.i
    local cs = assert(cc:command(DB, { aggregate = coll },
      { pipeline = { { ["$changeStream"] = { startAtOperationTime = r.operationTime } } }, cursor = {} }))
    raw = { id = cs.cursor.id }
    sa, sb = filtered(TA, t, i), filtered(TB, t, i)
  end)
  teardown(function() client:close() end)

  it("acquire of a new lock: an insert, which wakes nobody", function()
    assert.is_true(attempt(WA, TA).won)
    local ev = event()
    assert.equal("insert", ev.operationType)
    assert.equal(WA, ev.fullDocument.owner)
    woken({})
  end)

  it("queueing: the queue alone, as the whole array or the appended element; wakes nobody", function()
    assert.is_false(attempt(WB, TB).won)
    local ev = event()
    assert.equal("update", ev.operationType)
    -- [] to [entry]: the array diff {a, u0} would be larger than the array
    assert.same({ "queue" }, keys(ev.updateDescription.updatedFields))
    assert.equal(WB, ev.updateDescription.updatedFields.queue[1].w)
    assert.is_false(attempt(WC, TA).won)
    ev = event()
    assert.same({ "queue.1" }, keys(ev.updateDescription.updatedFields))
    assert.equal(WC, ev.updateDescription.updatedFields["queue.1"].w)
    assert.equal(0, #ev.updateDescription.removedFields)
    assert.equal(0, #ev.updateDescription.truncatedArrays)
    woken({})
  end)

  it("a waiter's next attempt: its entry's until alone; wakes nobody", function()
    assert.is_false(attempt(WB, TB).won)
    local ev = event()
    assert.same({ "queue.0.until" }, keys(ev.updateDescription.updatedFields))
    woken({})
  end)

  it("extend: expiresAt and the lease's new length; wakes nobody", function()
    assert.equal(1, step(WA, "extend", 120))
    local ev = event()
    assert.same({ "expiresAt", "ttl" }, keys(ev.updateDescription.updatedFields))
    woken({})
  end)

  it("release with waiters: granted to the first (owner, token, lease, queue, next); wakes it alone", function()
    assert.equal(1, step(WA, "release"))
    local ev = event()
    assert.equal("update", ev.operationType)
    local u = ev.updateDescription.updatedFields
    -- the holder document is B's entry's, equal to A's here but for its
    -- process tag: holder.t alone;
    -- [B, C] to [C]: element 0 takes C's differing fields and the array is
    -- cut (smaller than the whole array of these larger entries)
    -- ttl: B's lease length (A's was extended to 120 s)
    assert.same({ "acquiredAt", "expiresAt", "holder.t", "next", "owner", "queue.0.h.t", "queue.0.t",
      "queue.0.until", "queue.0.w", "token", "ttl" }, keys(u))
    assert.equal(TB, u["holder.t"])
    assert.same({ { field = "queue", newSize = 1 } }, ev.updateDescription.truncatedArrays)
    assert.equal(WB, u.owner)
    assert.equal(TB .. WB, u.next)
    assert.equal(WC, u["queue.0.w"])
    -- the lease: B's l from the release's now, bounded by B's until
    assert.is_true(u.expiresAt > u.acquiredAt)
    woken({ [TB] = TB .. WB })
  end)

  it("the library's parser reads the grant from the event alone", function()
    local e = { clusterTime = core.Timestamp(1, 1), documentKey = { _id = name },
      operationType = "update",
      updateDescription = { updatedFields = { owner = WB, next = TB .. WB, token = core.Int64(41),
        acquiredAt = core.Date(1000), expiresAt = core.Date(3500) },
        removedFields = {}, truncatedArrays = {} } }
    local reply = core.bson_encode({ cursor = { id = core.Int64(0), nextBatch = { e } }, ok = 1 })
    local evs = core.parse_events(reply, TB).events
    assert.equal(TB .. WB, evs[1].next)
    assert.equal(WB, evs[1].owner)
    assert.equal(41, evs[1].token)
    assert.equal(2500, evs[1].grant_ms)
    -- in another process, nothing of it
    evs = core.parse_events(reply, TA).events
    assert.equal("", evs[1].next)
    assert.is_nil(evs[1].owner)
  end)

  it("leave of the waiter the lock was granted to: granted on to the next waiter", function()
    assert.equal(1, core.parse_update(run(core.op_leave({ db = DB, coll = coll, name = name, waiter = WB, tag = TB }))))
    local ev = event()
    local u = ev.updateDescription.updatedFields
    -- [C] to []: the whole (empty) array
    assert.same({ "acquiredAt", "expiresAt", "holder.t", "next", "owner", "queue", "token" }, keys(u))
    assert.equal(WC, u.owner)
    assert.equal(TA .. WC, u.next)
    assert.equal(0, #u.queue)
    woken({ [TA] = TA .. WC })
  end)

  it("an attempt of the waiter the lock was granted to: won, nothing written", function()
    local r = attempt(WC, TA)
    assert.is_true(r.won)
    woken({})
  end)

  it("force release with nobody queued: owner null, expiresAt, next null, lost; wakes every waiter", function()
    assert.equal(1, core.parse_update(run(core.op_force_release({ db = DB, coll = coll, name = name }))))
    -- the attempt before wrote nothing: this is the next event
    local ev = event()
    local u = ev.updateDescription.updatedFields
    assert.same({ "expiresAt", "lost", "next", "owner" }, keys(u))
    assert.equal(null, u.owner)
    assert.equal(null, u.next)
    -- the lease it ended: C's, of process TA
    assert.equal(TA .. WC, u.lost)
    local ea, eb = passed(sa, 5000), passed(sb, 5000)
    assert.equal(1, #ea)
    assert.equal(1, #eb)
    assert.equal("", ea[1].next)
    assert.equal("", eb[1].next)
    assert.equal(WC, ea[1].lost)
    assert.is_nil(eb[1].lost)
    assert.is_true(ea[1].wakes)
    assert.is_true(eb[1].wakes)
  end)

  it("a queue cut at its end is reported in truncatedArrays, and wakes nobody", function()
    -- A holds; B then C queue; C leaves: [B, C] to [B]
    assert.is_true(attempt(WA, TA).won)
    event()
    assert.is_false(attempt(WB, TB).won)
    event()
    assert.is_false(attempt(WC, TA).won)
    event()
    woken({})
    assert.equal(1, core.parse_update(run(core.op_leave({ db = DB, coll = coll, name = name, waiter = WC, tag = TA }))))
    local ev = event()
    assert.same({}, keys(ev.updateDescription.updatedFields))
    assert.equal(1, #ev.updateDescription.truncatedArrays)
    assert.equal("queue", ev.updateDescription.truncatedArrays[1].field)
    assert.equal(1, ev.updateDescription.truncatedArrays[1].newSize)
    woken({})
  end)

  it("takeover of an expired lease of another process: lost names it; passes there alone, waking nobody", function()
    -- A holds, B is queued (the row above): A's lease made to end at once
    assert.equal(1, step(WA, "extend", 0.2))
    event()
    core.sleep(0.4)
    assert.is_true(attempt(WB, TB).won)
    local ev = event()
    local u = ev.updateDescription.updatedFields
    assert.equal(WB, u.owner)
    assert.equal(TA .. WA, u.lost)
    assert.equal(TB, u["holder.t"])
    local ea = passed(sa, 5000)
    assert.equal(1, #ea)
    assert.equal(name, ea[1].id)
    assert.equal(WA, ea[1].lost)
    assert.equal("", ea[1].next)
    assert.is_false(ea[1].wakes)
    assert.equal(0, #passed(sb, 300))
  end)

  it("force release granted on to a waiter: lost passes in the old holder's process, next in the grantee's", function()
    -- B holds (process TB); C of process TA queues, then the force release
    -- grants the lock to C
    assert.is_false(attempt(WC, TA).won)
    event()
    woken({})
    assert.equal(1, core.parse_update(run(core.op_force_release({ db = DB, coll = coll, name = name }))))
    local ev = event()
    local u = ev.updateDescription.updatedFields
    assert.equal(WC, u.owner)
    assert.equal(TA .. WC, u.next)
    assert.equal(TB .. WB, u.lost)
    local ea, eb = passed(sa, 5000), passed(sb, 5000)
    assert.equal(1, #ea)
    assert.equal(TA .. WC, ea[1].next)
    assert.is_nil(ea[1].lost)
    assert.is_true(ea[1].wakes)
    assert.equal(1, #eb)
    assert.equal("", eb[1].next)
    assert.equal(WB, eb[1].lost)
    assert.is_false(eb[1].wakes)
  end)

  it("a takeover of its own expired grant by the same waiter names no lease lost", function()
    -- C's granted lease ends; C's next attempt takes the lock again as its
    -- own (the same owner id): nothing of it passes anywhere
    assert.is_true(attempt(WC, TA).won)     -- the grant, nothing written
    assert.equal(1, step(WC, "extend", 0.2))
    event()
    core.sleep(0.4)
    assert.is_true(attempt(WC, TA).won)
    local ev = event()
    assert.is_nil(ev.updateDescription.updatedFields.lost)
    woken({})
  end)

  describe("document locks", function()
    it("write-and-unlock: the caller's fields, the owner field null, the time field; wakes every waiter", function()
      local docs = client:documents(DB, coll, { ttl = 30 })
      local doc, h = docs:lock("d1", { insert = { status = "new" } })
      assert.is_table(doc, h)
      assert.equal("insert", event().operationType)
      -- the library's stream for document locks watches the owner field
      local r = assert(cc:command(DB, { ping = 1 }))
      local b = core.parse_events(run(core.op_watch({ db = DB, coll = coll, tag = TA, field = "lockId",
        t = r.operationTime.t, i = r.operationTime.i })), TA)
      local ds = { tag = TA, id = b.cursor_id }
      assert.is_true(h:release({ status = "done" }))
      local ev = event()
      assert.equal("update", ev.operationType)
      local u = ev.updateDescription.updatedFields
      assert.same({ "lockExpires", "lockId", "status" }, keys(u))
      assert.equal(null, u.lockId)
      assert.equal("done", u.status)
      local evs = passed(ds, 5000)
      assert.equal(1, #evs)
      assert.equal("d1", evs[1].id)
      assert.equal("", evs[1].next)
    end)
  end)
end)
