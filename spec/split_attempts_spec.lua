-- Each attempt method of the core client split at its round trip, as an
-- attempt object (client:acquire_attempt, campaign_attempt,
-- share_acquire_attempt, doc_acquire_attempt -> a mongolock.Attempt): a:op(),
-- the op it would send, and a:take(...), the same C tail on an outcome run
-- elsewhere (inside nginx: a worker thread).  Here the op runs through
-- client:run, as a worker thread runs it.
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

  it("an acquire attempt's take makes the handle acquire makes, and answers busy as it does", function()
    local a = cc:acquire_attempt(db, coll, "a", 5000)
    local owner = a:owner()
    assert.matches("^%x+$", owner)
    assert.equal(32, #owner)
    assert.equal("mongolock.Attempt (acquire, prepared)", tostring(a))
    local op = a:op()
    assert.equal("mongolock.Attempt (acquire, sent)", tostring(a))
    local h = assert(a:take(run(op)))
    assert.equal("mongolock.Attempt (acquire, taken)", tostring(a))
    assert.equal("mongolock.Lock (a, held)", tostring(h))
    assert.equal(owner, h.owner)
    assert.equal("named", h.kind)
    assert.is_true(h:remaining() > 4 and h:remaining() <= 5)
    local a2 = cc:acquire_attempt(db, coll, "a", 5000)
    local none, err, info = a2:take(run(a2:op()))
    assert.is_nil(none)
    assert.equal("busy", err)
    assert.equal(owner, info.owner)
    assert.equal(h.token, info.token)
    assert.is_true(h:release())
  end)

  it("a campaign attempt's take makes the handle campaign makes; its waiter is queued as polling", function()
    local a = cc:campaign_attempt(db, coll, "c", 5000, nil, nil, nil, nil, "v1")
    local h = assert(a:take(run(a:op())))
    assert.equal("named", h.kind)
    local function lock_doc()
      return assert(client:command(db, { find = coll }, { filter = { _id = "c" } })).cursor.firstBatch[1]
    end
    local doc = lock_doc()
    assert.equal("v1", doc.value)
    assert.equal(h.token, doc.valueToken)
    local w = assert(core.waiter_id())
    local a2 = cc:campaign_attempt(db, coll, "c", 5000, nil, nil, w, 3000, "v2")
    assert.equal(w, a2:owner())
    local none, err = a2:take(run(a2:op()))
    assert.is_nil(none)
    assert.equal("busy", err)
    doc = lock_doc()
    assert.equal("v1", doc.value)
    assert.is_true(doc.queue[1].p)
    assert.is_true(h:release())
    assert.has_error(function() cc:campaign_attempt(db, coll, "c", 5000, nil, nil, nil, nil, 5) end)
  end)

  it("a waiter's attempt writes its id as the owner", function()
    local w = assert(core.waiter_id())
    local a = cc:acquire_attempt(db, coll, "w", 5000, nil, nil, w, 3000, false)
    assert.equal(w, a:owner())
    local h = assert(a:take(run(a:op())))
    assert.equal(w, h.owner)
    assert.is_true(h:release())
    assert.has_error(function()
      cc:acquire_attempt(db, coll, "w", 5000, nil, nil, w, 3000, false, string.rep("a", 32))
    end)
  end)

  it("share and document attempts make their kinds' handles", function()
    local a = cc:share_acquire_attempt(db, coll, "s", "permit", 2, 5000)
    assert.equal("mongolock.Attempt (share_acquire, prepared)", tostring(a))
    local p = assert(a:take(run(a:op())))
    assert.equal("permit", p.kind)
    assert.equal(a:owner(), p.owner)
    assert.is_true(p:release())
    local dcoll = helpers.unique("splitdocs")
    local args = { db, dcoll, 7, 5000, "lockId", "lockExpires", "expires", "hex", { n = 1 } }
    local da = cc:doc_acquire_attempt(unpack(args, 1, 9))
    local dop = da:op()
    collectgarbage()                          -- the attempt keeps its arguments
    local h, doc = da:take(run(dop))
    assert.equal("document", h.kind)
    assert.equal(da:owner(), h.owner)
    assert.equal(1, doc.n)
    assert.is_true(h:release({ n = 2 }))
  end)

  it("an outcome without a reply (the op applied) has what it took released in the background", function()
    local a = cc:acquire_attempt(db, coll, "lost", 30000)
    assert(cc:run(a:op()))                    -- applied; its reply never arrives
    local h, err = a:take(nil, "connection closed", nil, nil, nil)
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
    local a = cc:acquire_attempt(db, coll, "kept", 30000, nil, nil, nil, nil, nil, held.owner)
    assert.equal(held.owner, a:owner())
    a:op()
    local h, err, code = a:take(nil, "some server error", 2, core.bson_encode({ ok = 0, code = 2 }), nil)
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

  it("checks take's own arguments at the caller, and takes an attempt once, after its op", function()
    local a = cc:acquire_attempt(db, coll, "args", 5000)
    assert.has_error(function() a:take(nil, "no op yet") end, "the attempt was not sent (a:op() first)")
    local reply = cc:run(a:op())
    assert.has_error(function() a:op() end, "the attempt is sent already: one op per attempt")
    assert.has_error(function() a:take("not bson") end)
    assert.has_error(function() a:take(nil, {}) end)
    local h = assert(a:take(reply))
    assert.has_error(function() a:take(reply) end, "the attempt was taken already")
    assert.is_true(h:release())
  end)

  it("an attempt is collected whatever its state; take raises on a closed client", function()
    local other = helpers.connect()
    local occ = other._core
    local weak = setmetatable({}, { __mode = "v" })
    weak[1] = occ:doc_acquire_attempt(db, helpers.unique("splitdocs"), { k = 1 }, 5000, "o", "t", "expires",
      "hex", { n = 1 })
    local b = occ:acquire_attempt(db, coll, "closing", 5000)
    local reply = assert(occ:run(b:op()))
    other:close()
    assert.has_error(function() b:take(reply) end, "attempt to use a closed mongolock client")
    weak[2], b = b, nil
    collectgarbage()
    collectgarbage()
    assert.is_nil(weak[1])
    assert.is_nil(weak[2])
  end)
end)
