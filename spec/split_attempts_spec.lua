-- Each attempt method of the core client split at its round trip
-- (client:acquire_op / take_acquire, share_acquire_op / take_share_acquire,
-- doc_acquire_op / take_doc_acquire): the op it would send, and the same C
-- tail on an outcome run elsewhere (inside nginx: a worker thread).  Here
-- the op runs through client:run, as a worker thread runs it.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local unpack = table.unpack or rawget(_G, "unpack")
local function pack(...) return { n = select("#", ...), ... } end

describe("#integration attempts split at their round trip", function()
  local client, cc, db, coll

  setup(function()
    client = helpers.connect()
    cc = client._core
    db = client:default_database()
    coll = helpers.unique("split")
  end)
  teardown(function() client:close() end)

  -- op's outcome as client:run answers it (reply | nil, err, code, ereply, domain)
  local function run(op)
    local r = pack(cc:run(op))
    return r[1], r[2], r[3], r[4], r[5]
  end

  it("take_acquire makes the handle acquire makes, and answers busy as it does", function()
    local op, owner = cc:acquire_op(db, coll, "a", 5000)
    assert.matches("^%x+$", owner)
    assert.equal(32, #owner)
    local started = core.monotonic()
    local h = assert(cc:take_acquire(db, coll, "a", 5000, nil, nil, nil, nil, nil, owner, started, run(op)))
    assert.equal("mongolock.Lock (a, held)", tostring(h))
    assert.equal(owner, h.owner)
    assert.equal("named", h.kind)
    assert.is_true(h:remaining() > 4 and h:remaining() <= 5)
    local op2, owner2 = cc:acquire_op(db, coll, "a", 5000)
    local none, err, info = cc:take_acquire(db, coll, "a", 5000, nil, nil, nil, nil, nil, owner2,
      core.monotonic(), run(op2))
    assert.is_nil(none)
    assert.equal("busy", err)
    assert.equal(owner, info.owner)
    assert.equal(h.token, info.token)
    assert.is_true(h:release())
  end)

  it("take_campaign makes the handle campaign makes; its waiter is queued as polling", function()
    local op, owner = cc:campaign_op(db, coll, "c", 5000, nil, nil, nil, nil, "v1")
    local h = assert(cc:take_campaign(db, coll, "c", 5000, nil, nil, nil, nil, "v1", owner, core.monotonic(),
      run(op)))
    assert.equal("named", h.kind)
    local function lock_doc()
      return assert(client:command(db, { find = coll }, { filter = { _id = "c" } })).cursor.firstBatch[1]
    end
    local doc = lock_doc()
    assert.equal("v1", doc.value)
    assert.equal(h.token, doc.valueToken)
    local w = assert(core.waiter_id())
    local op2 = cc:campaign_op(db, coll, "c", 5000, nil, nil, w, 3000, "v2")
    local none, err = cc:take_campaign(db, coll, "c", 5000, nil, nil, w, 3000, "v2", w, core.monotonic(),
      run(op2))
    assert.is_nil(none)
    assert.equal("busy", err)
    doc = lock_doc()
    assert.equal("v1", doc.value)
    assert.is_true(doc.queue[1].p)
    assert.is_true(h:release())
    assert.has_error(function() cc:campaign_op(db, coll, "c", 5000, nil, nil, nil, nil, 5) end)
  end)

  it("a waiter's attempt writes its id as the owner", function()
    local w = assert(core.waiter_id())
    local op, owner = cc:acquire_op(db, coll, "w", 5000, nil, nil, w, 3000, false)
    assert.equal(w, owner)
    local h = assert(cc:take_acquire(db, coll, "w", 5000, nil, nil, w, 3000, false, w, core.monotonic(),
      run(op)))
    assert.equal(w, h.owner)
    assert.is_true(h:release())
    assert.has_error(function() cc:acquire_op(db, coll, "w", 5000, nil, nil, w, 3000, false, string.rep("a", 32)) end)
  end)

  it("take_share_acquire and take_doc_acquire make their kinds' handles", function()
    local op, owner = cc:share_acquire_op(db, coll, "s", "permit", 2, 5000)
    local p = assert(cc:take_share_acquire(db, coll, "s", "permit", 2, 5000, nil, nil, nil, nil, nil, owner,
      core.monotonic(), run(op)))
    assert.equal("permit", p.kind)
    assert.is_true(p:release())
    local dcoll = helpers.unique("splitdocs")
    local args = { db, dcoll, 7, 5000, "lockId", "lockExpires", "expires", "hex", { n = 1 } }
    local dop, downer = cc:doc_acquire_op(unpack(args, 1, 9))
    args[10], args[11], args[12] = nil, downer, core.monotonic()   -- renew, owner, started
    local r = pack(run(dop))
    for i = 1, 5 do args[12 + i] = r[i] end
    local h, doc = cc:take_doc_acquire(unpack(args, 1, 17))
    assert.equal("document", h.kind)
    assert.equal(1, doc.n)
    assert.is_true(h:release({ n = 2 }))
  end)

  it("an outcome without a reply (the op applied) has what it took released in the background", function()
    local op, owner = cc:acquire_op(db, coll, "lost", 30000)
    assert(cc:run(op))                        -- applied; its reply never arrives
    local h, err = cc:take_acquire(db, coll, "lost", 30000, nil, nil, nil, nil, nil, owner, core.monotonic(),
      nil, "connection closed", nil, nil, nil)
    assert.is_nil(h)
    assert.equal("connection closed", err)
    assert.is_true(testing.renew_flush(cc))
    local st = assert(client:locks({ database = db, collection = coll }):status("lost"))
    assert.is_false(st.held)
  end)

  it("a server's error reply is not one without a reply: nothing is released for it", function()
    local other = helpers.connect()
    local ol = other:locks({ database = db, collection = coll })
    local held = assert(ol:try("kept"))
    -- an outcome that says the server answered (ok: 0) with the holder's owner
    local _, owner = cc:acquire_op(db, coll, "kept", 30000, nil, nil, nil, nil, nil, held.owner)
    local h, err, code = cc:take_acquire(db, coll, "kept", 30000, nil, nil, nil, nil, nil, owner,
      core.monotonic(), nil, "some server error", 2, core.bson_encode({ ok = 0, code = 2 }), nil)
    assert.is_nil(h)
    assert.equal("some server error", err)
    assert.equal(2, code)
    assert.is_true(testing.renew_flush(cc))
    -- had it counted as one without a reply, the holder's lock (same
    -- owner here) would have been released
    assert.is_true(assert(ol:status("kept")).held)
    assert.is_true(held:release())
    other:close()
  end)

  it("checks take's own arguments at the caller", function()
    local op, owner = cc:acquire_op(db, coll, "args", 5000)
    local reply = cc:run(op)
    assert.has_error(function() cc:take_acquire(db, coll, "args", 5000, nil, nil, nil, nil, nil, nil,
      core.monotonic(), reply) end)
    assert.has_error(function() cc:take_acquire(db, coll, "args", 5000, nil, nil, nil, nil, nil, owner,
      core.monotonic() + 10, reply) end)
    assert.has_error(function() cc:take_acquire(db, coll, "args", 5000, nil, nil, nil, nil, nil, owner,
      core.monotonic(), "not bson") end)
    local h = assert(cc:take_acquire(db, coll, "args", 5000, nil, nil, nil, nil, nil, owner, core.monotonic(),
      reply))
    assert.is_true(h:release())
  end)
end)
