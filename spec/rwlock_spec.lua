-- #integration: reader-writer locks (mongolock.shared): shares of their
-- own, a writer alone, writers first, processes contending, a reader
-- killed, clocks an hour off, malformed input, round trips.
local helpers = require "helpers"
local core = require "mongolock.core"
local pack = table.pack or function(...) return { n = select("#", ...), ... } end


describe("#integration reader-writer locks", function()
  local client, coll, rw
  setup(function()
    client = helpers.connect({ appname = "rw-parent" })
    coll = helpers.unique("rw")
    rw = client:rwlocks({ database = helpers.database, collection = coll })
  end)
  teardown(function() client:close() end)

  local function spawn(mode, kind, name, a, b, prefix)
    return helpers.kinds_child(coll, mode, kind, name, a, b, nil, prefix)
  end

  local function doc(name) return helpers.lock_doc(client, coll, name) end

  it("locks:status and try_write's busy info say a name held by readers or permits is held", function()
    local locks = client:locks({ database = helpers.database, collection = coll })
    local name = helpers.unique("status")
    local r1, r2 = assert(rw:try_read(name)), assert(rw:try_read(name))
    local st = assert(locks:status(name))
    assert.is_true(st.held)
    assert.equal("shared", st.state)
    assert.equal(2, st.holders)
    assert.equal(2, st.readers)
    assert.is_nil(st.owner)                 -- no writer
    local w, err, info = rw:try_write(name)
    assert.is_nil(w)
    assert.equal("busy", err)
    assert.equal(2, info.readers)
    assert.equal(2, info.holders)
    assert.is_nil(info.owner)
    -- the list says the same
    local all = assert(locks:list())
    local row
    for _, x in ipairs(all) do if x.name == name then row = x end end
    assert.equal("shared", row.state)
    assert.is_true(row.held)
    assert.is_true(r1:release())
    assert.is_true(r2:release())
    st = assert(locks:status(name))
    assert.is_false(st.held)
    assert.equal("free", st.state)
    assert.equal(0, st.holders)
    -- a permit of a semaphore
    local sem = client:semaphores({ database = helpers.database, collection = coll, permits = 3 })
    local sname = helpers.unique("status")
    local p = assert(sem:try(sname))
    st = assert(locks:status(sname))
    assert.is_true(st.held)
    assert.equal("permits", st.state)
    assert.equal(1, st.holders)
    assert.equal(3, st.permits)
    assert.equal(0, st.readers)
    assert.is_true(p:release())
    -- a writer: held, as before
    w = assert(rw:try_write(name))
    st = assert(locks:status(name))
    assert.equal("held", st.state)
    assert.equal(0, st.holders)
    assert.is_true(w:release())
  end)

  it("readers share, each with its own owner, token and lease; a writer is alone", function()
    local name = helpers.unique("share")
    local r1 = assert(rw:try_read(name))
    local r2 = assert(rw:read(name))
    assert.equal("shared", r1.kind)
    assert.are_not.equal(r1.owner, r2.owner)
    assert.is_true(r2.token > r1.token)
    local w, err = rw:try_write(name)
    assert.is_nil(w)
    assert.equal("busy", err)
    local st = assert(rw:status(name))
    assert.equal(2, st.in_use)
    assert.is_false(st.exclusive)
    assert.equal("shared", st.holders[1].mode)
    -- a share is released by its holder only, once
    assert.is_true(r1:release())
    assert.same({ nil, "not held" }, { r1:release() })
    assert.is_true(r2:extend(5))
    assert.is_nil((rw:try_write(name)))
    assert.is_true(r2:release())
    w = assert(rw:try_write(name))
    assert.is_true(w.token > r2.token)
    local r3, info
    r3, err, info = rw:try_read(name)
    assert.is_nil(r3)
    assert.equal("busy", err)
    assert.is_true(info.exclusive)
    assert.is_true(info.remaining > 0)
    assert.is_true(w:release())
    r3 = assert(rw:try_read(name))
    assert.is_true(r3.token > w.token)
    -- force release ends every share; their holders find them lost
    assert.is_true(rw:force_release(name))
    assert.same({ nil, "not held" }, { rw:force_release(name) })
    assert.same({ nil, "lost" }, { r3:extend() })
    assert.is_true(assert(rw:try_write(name)):release())
  end)

  it("a waiting writer is served before readers that arrive after it", function()
    local name = helpers.unique("writer-first")
    local r1 = assert(rw:try_read(name, { ttl = 60 }))
    -- a writer in another process queues behind r1 (woken by the stream)
    local wp = spawn("wait", "write", name, 10)
    assert.truthy(helpers.eventually(function()
      return (assert(rw:status(name)).writers or 0) == 1
    end, 10))
    -- a reader arriving now waits behind the writer
    local r2, err, info = rw:try_read(name)
    assert.is_nil(r2)
    assert.equal("busy", err)
    assert.equal(1, info.writers)
    assert.is_true(r1:release())
    assert.is_truthy(wp:wait_for("held %d+ %d+", 8), wp:output())
    local st, out = wp:wait(10)
    assert.equal(0, st, out)
    wp:cleanup()
    assert.is_true(assert(rw:read(name, { timeout = 5 })):release())
  end)

  it("a waiting writer killed with SIGKILL holds readers up for at most its queue_ttl", function()
    local name = helpers.unique("dead-writer")
    local r1 = assert(rw:try_read(name, { ttl = 60 }))
    local wp = spawn("wait", "write", name, 30, nil, "QUEUE_TTL=2 ")
    local wpid = tonumber((assert(wp:wait_for("waiting (%d+)"))))
    assert.truthy(helpers.eventually(function()
      return (assert(rw:status(name)).writers or 0) == 1
    end, 10))
    assert.equal("busy", select(2, rw:try_read(name)))
    wp:kill("KILL", wpid)
    wp:wait(10)
    wp:cleanup()
    -- its place lapses 2 s after its latest attempt; then readers share again
    local killed = core.monotonic()
    local r2 = helpers.eventually(function() return (rw:try_read(name)) end, 10)
    assert.is_truthy(r2)
    assert.is_true(core.monotonic() - killed < 4)
    assert.is_true(r2:release())
    assert.is_true(r1:release())
  end)

  it("a writer is not starved while readers keep arriving", function()
    local name = helpers.unique("starve")
    -- readers in another process for up to 20 s, each share taken before
    -- the previous one is released: the lock is never without a reader
    local rp = spawn("readers", "read", name, 20)
    assert.is_truthy(rp:wait_for("reading %d+", 10))
    core.sleep(0.3)
    local started = core.monotonic()
    local w = assert(rw:write(name, { timeout = 8 }))
    assert.is_true(core.monotonic() - started < 8)
    -- the reader stream was refused a new share while the writer waited
    assert.is_truthy(rp:wait_for("stopped %d+", 5))
    assert.is_true(w:release())
    local st, out = rp:wait(10)
    assert.equal(0, st, out)
    rp:cleanup()
  end)

  it("readers and writers in three processes: never a writer with anyone else", function()
    local name = helpers.unique("contend")
    local log = os.tmpname()
    local loops = 20
    local ps = {
      spawn("loop", "read", name, loops, log),
      spawn("loop", "read", name, loops, log),
      spawn("loop", "write", name, loops, log),
    }
    for _, p in ipairs(ps) do
      local st, out = p:wait(90)
      assert.equal(0, st, out)
      p:cleanup()
    end
    local readers, writer, count, seen, most = 0, false, 0, {}, 0
    for l in io.lines(log) do
      local kind, tok = l:match("^B (%a+) %d+ (%d+)$")
      if kind then
        count = count + 1
        assert.is_false(writer, l)
        if kind == "write" then
          assert.equal(0, readers, l)
          writer = true
        else
          readers = readers + 1
          most = math.max(most, readers)
        end
        assert.is_nil(seen[tok], l)
        seen[tok] = true
      else
        kind = l:match("^E (%a+) %d+$")
        assert.is_truthy(kind, l)
        if kind == "write" then writer = false else readers = readers - 1 end
      end
    end
    os.remove(log)
    assert.equal(3 * loops, count)
    assert.is_true(most >= 1)
  end)

  it("a reader killed with SIGKILL frees its share when its lease ends", function()
    local name = helpers.unique("killed")
    local p = spawn("hold", "read", name, 1)
    local pid = tonumber((assert(p:wait_for("held (%d+) %d+"))))
    local st = assert(rw:status(name))
    assert.equal(pid, st.holders[1].holder.pid)
    assert.is_nil((rw:try_write(name)))
    p:kill("KILL", pid)
    assert.is_truthy(p:wait(10))
    p:cleanup()
    local started = core.monotonic()
    local w = assert(rw:write(name, { timeout = 6 }))
    assert.is_true(core.monotonic() - started < 4)
    assert.is_true(w.token > st.holders[1].token)
    assert.is_true(w:release())
  end)

  describe("with clocks an hour off (faketime)", function()
    it("a skewed reader's share lasts its ttl on the server's clock", function()
      for _, skew in ipairs({ "+1h", "-1h" }) do
        local name = helpers.unique("skew")
        local p = spawn("hold", "read", name, 1.5, nil, ("faketime -f '%s' "):format(skew))
        local pid = tonumber((assert(p:wait_for("held (%d+) %d+"))))
        local st = assert(rw:status(name))
        assert.equal(1, st.in_use, skew)
        local left = st.holders[1].remaining
        assert.is_true(left > 0 and left <= 1.5, tostring(left))
        -- a skewed reader shares, and a skewed writer waits
        local r = assert(rw:try_read(name))
        assert.is_true(r:release())
        p:kill("KILL", pid)
        p:wait(10)
        p:cleanup()
        local w = assert(rw:write(name, { timeout = 6 }))
        assert.is_true(w:release())
      end
    end)
  end)

  it("refuses malformed input at the caller, writing nothing", function()
    local name = helpers.unique("bad")
    assert.has_error(function() rw:read(name, { permits = 2 }) end,
      "bad argument #2 to 'read' (unknown option 'permits')")
    assert.has_error(function() rw:try_read(name, { ttl = 0 }) end)
    assert.has_error(function() rw:try_read(name, { ttl = 1e10 }) end)
    assert.has_error(function() rw:try_read(name, "fast") end)
    assert.has_error(function() rw:read(nil) end, "bad argument #1 to 'read' (string expected, got nil)")
    assert.has_error(function() rw:try_read(("x"):rep(1025)) end)
    assert.has_error(function() client:rwlocks("x") end)
    assert.has_error(function() client:rwlocks({ permits = 2 }) end)
    -- the options the exclusive side checks are named as rwlocks's and
    -- semaphores's own
    assert.has_error(function() client:rwlocks({ ttl = -1 }) end,
      "bad argument #1 to 'rwlocks' (ttl must be a positive number of seconds, at most a year "
      .. "(31536000) (got -1))")
    local sok, serr = pcall(function() return client:semaphores({ permits = 2, collection = "a$b" }) end)
    assert.is_false(sok)
    assert.matches("rwlock_spec%.lua:%d+: bad argument #1 to 'semaphores' %(collection must be", serr)
    -- the library's option checks: a slip is named with the nearest option,
    -- and the error points at the caller
    for _, f in ipairs({
      function() local h = rw:read(name, { tll = 1 }); return h end,
      function() local h = rw:try_read(name, { renew = "yes" }); return h end,
      function() local h = rw:write(name, { wait = "sometimes" }); return h end,
      function() local r = client:rwlocks({ colection = "x" }); return r end,
      function() local s = client:acquire_all({ { rw, name, "read" } }, { tmeout = 1 }); return s end,
    }) do
      local ok, msg = pcall(f)
      assert.is_false(ok)
      assert.matches("^[^\n]*rwlock_spec%.lua:%d+: bad argument #%d to '[%w_]+' %(", msg)
    end
    assert.matches("did you mean 'ttl'", select(2, pcall(rw.read, rw, name, { tll = 1 })), 1, true)
    assert.has_error(function()
      client._core:share_acquire(helpers.database, coll, name, "both", nil, 1000)
    end, "bad argument #4 to 'share_acquire' (mode must be \"shared\" or \"permit\")")
    assert.is_nil(doc(name))
  end)

  it("with_read holds a share while fn runs and always gives it back", function()
    local name = helpers.unique("with")
    assert.equal("x", rw:with_read(name, function(h)
      assert.equal("shared", h.kind)
      assert.equal(1, assert(rw:status(name)).in_use)
      return "x"
    end))
    assert.has_error(function() rw:with_read(name, function() error("boom", 0) end) end, "boom")
    assert.equal(0, assert(rw:status(name)).in_use)
    assert.equal(2, rw:with_write(name, function() return 2 end))
  end)

  it("with_read answers nil, \"lost\" when the share ended before fn returned, as locks:with", function()
    local name = helpers.unique("with-lost")
    local r = pack(rw:with_read(name, function()
      assert(rw:force_release(name))
      return "fn's result"
    end))
    assert.same({ n = 2, nil, "lost" }, r)
    assert.equal(0, assert(rw:status(name)).in_use)
  end)

  it("read with timeout = 0 answers \"timeout\" while a writer holds, as locks:acquire", function()
    local name = helpers.unique("t0")
    local w = assert(rw:try_write(name))
    local h, err = rw:read(name, { timeout = 0 })
    assert.is_nil(h)
    assert.equal("timeout", err)
    assert.equal("busy", select(2, rw:try_read(name)))
    assert.is_true(w:release())
  end)
end)

describe("#integration reader-writer round trips", function()
  local client, rw, commands

  setup(function()
    client = helpers.connect({ appname = "rw-rt" },
      helpers.uri_with({ heartbeatFrequencyMS = 60000 }))
    commands = helpers.command_counter(client)
    rw = client:rwlocks({ database = helpers.database, collection = helpers.unique("rwrt") })
    assert(rw:try_read("warm")):release()
    assert(rw:try_write("warm")):release()
  end)
  teardown(function() client:close() end)

  it("an uncontended shared acquire, a try and each release: one command each", function()
    local r1, r2
    assert.equal(1, commands(function() r1 = assert(rw:read("x")) end))
    assert.equal(1, commands(function() r2 = assert(rw:try_read("x")) end))
    assert.equal(1, commands(function() assert.equal("busy", select(2, rw:try_write("x"))) end))
    assert.equal(1, commands(function() assert(r1:extend(10)) end))
    assert.equal(1, commands(function() assert(r1:release()) end))
    assert.equal(1, commands(function() assert(r2:release()) end))
    local w
    assert.equal(1, commands(function() w = assert(rw:write("x")) end))
    assert.equal(1, commands(function() assert(w:release()) end))
  end)
end)

describe("#integration reader-writer locks: a blocking wait for its own client's shares", function()
  local client, rw
  setup(function()
    client = helpers.connect({ appname = "rw-own" })
    rw = client:rwlocks({ database = helpers.database, collection = helpers.unique("rw_own") })
  end)
  teardown(function() client:close() end)

  it("a second share is taken; a write behind its own share, a read behind its own writer: \"deadlock\" at once",
     function()
    local name = helpers.unique("own")
    local r1 = assert(rw:read(name))
    local r2 = assert(rw:read(name, { timeout = 1 }))
    local t0 = core.monotonic()
    local w, err, info = rw:write(name)
    assert.is_nil(w)
    assert.equal("deadlock", err)
    assert.equal(2, info.holders)
    assert.is_true(core.monotonic() - t0 < 5)
    assert(r1:release())
    assert(r2:release())
    w = assert(rw:write(name, { timeout = 1 }))
    t0 = core.monotonic()
    local r
    r, err = rw:read(name)
    assert.is_nil(r)
    assert.equal("deadlock", err)
    assert.is_true(core.monotonic() - t0 < 5)
    assert(w:release())
    r = assert(rw:read(name, { timeout = 1 }))
    assert(r:release())
  end)
end)
