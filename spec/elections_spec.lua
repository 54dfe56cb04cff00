-- #integration: leader election (client:elections, mongolock.elections):
-- campaign, proclaim, resign, leader, observe, across OS processes.
local helpers = require "helpers"
local core = require "mongolock.core"

local CHILD = helpers.root .. "/spec/elections_child.lua"

-- wide margins: every bound below is the documented one plus a second
local SLACK = 1

describe("#integration elections", function()
  local client, el, coll
  setup(function()
    client = helpers.connect({ appname = "parent" })
    coll = helpers.unique("elections")
    el = client:elections({ database = helpers.database, collection = coll, ttl = 3 })
  end)
  teardown(function()
    client:close()
  end)

  local function child(mode, name, a, b, c)
    return helpers.spawn(CHILD, { helpers.database, coll, mode, name, tostring(a or ""),
      tostring(b or ""), tostring(c or "") })
  end

  it("refuses bad arguments at the caller", function()
    assert.has_error(function() el:campaign(1, "v") end,
      "bad argument #1 to 'campaign' (string expected, got number)")
    assert.has_error(function() el:campaign("x", 5) end,
      "bad argument #2 to 'campaign' (string expected, got number)")
    assert.has_error(function() el:campaign("x", "a\0b") end)
    assert.has_error(function() el:campaign("x", "v", { tll = 1 }) end,
      "bad argument #3 to 'campaign' (unknown option 'tll' (did you mean 'ttl'?))")
    assert.has_error(function() el:leader(nil) end)
    assert.has_error(function() el:observe("x", { timeout = -1 }) end)
    assert.has_error(function() client:elections({ ttl = 0 }) end)
  end)

  it("a campaign with nobody leading leads at once; leader() names it", function()
    local name = helpers.unique("e")
    assert.is_nil(el:leader(name))
    local leader = assert(el:campaign(name, "host-a:8080"))
    assert.is_true(leader:held())
    assert.equal(name, leader.name)
    assert.equal("host-a:8080", leader.value)
    local info = assert(el:leader(name))
    assert.equal("host-a:8080", info.value)
    assert.equal(leader.token, info.token)
    assert.equal(tostring(leader.owner), tostring(info.owner))
    assert.equal(core.getpid(), info.holder.pid)
    assert.is_true(info.remaining > 0 and info.remaining <= 3)
    assert.is_true(leader:resign())
    assert.is_nil(el:leader(name))
    -- a resigned leader knows it
    assert.same({ nil, "not held" }, { leader:check() })
  end)

  it("proclaim changes the value without a new term; not after resigning", function()
    local name = helpers.unique("e")
    local leader = assert(el:campaign(name, "one"))
    local token = leader.token
    assert.is_true(leader:proclaim("two"))
    assert.equal("two", leader.value)
    local info = assert(el:leader(name))
    assert.equal("two", info.value)
    assert.equal(token, info.token)
    assert.is_true(leader:resign())
    local ok, err = leader:proclaim("three")
    assert.is_nil(ok)
    assert.equal("not held", err)
    assert.has_error(function() leader:proclaim(3) end,
      "bad argument #1 to 'proclaim' (string expected, got number)")
  end)

  it("a second campaigner waits, never leads at once, and leads when the first resigns", function()
    local name = helpers.unique("e")
    local p = child("lead", name, "first", 3, 1.0)
    local token1 = tonumber(assert(p:wait_for("leading %d+ (%d+)")))
    -- while the child leads, a campaign that does not wait is refused
    local none, err, info = el:campaign(name, "second", { timeout = 0 })
    assert.is_nil(none)
    assert.equal("timeout", err)
    assert.equal(token1, info.token)
    local leader = assert(el:campaign(name, "second", { timeout = 10 }))
    local t_lead = core.monotonic()
    local st, out = p:wait(10)
    p:cleanup()
    assert.equal(0, st, out)
    local resigning = tonumber(out:match("resigning %d+ ([%d.]+)"))
    assert.is_truthy(resigning, out)
    assert.is_truthy(out:match("resigned %d+"), out)
    -- the child had stopped leading before this process led
    assert.is_true(resigning <= t_lead, out)
    assert.is_true(leader.token > token1)
    assert.equal("second", assert(el:leader(name)).value)
    assert.is_true(leader:resign())
  end)

  it("the second leads when the first dies (SIGKILL) within the ttl and the slack", function()
    local name = helpers.unique("e")
    local p = child("lead", name, "doomed", 2, 120)
    local pid = tonumber(assert(p:wait_for("leading (%d+)")))
    local token1 = tonumber(assert(p:wait_for("leading %d+ (%d+)")))
    p:kill("KILL", pid)
    local killed = core.monotonic()
    local leader = assert(el:campaign(name, "survivor", { timeout = 15 }))
    local took = core.monotonic() - killed
    p:wait(10)
    p:cleanup()
    assert.is_true(leader.token > token1)
    print(("# elections: led %.3f s after the leader (ttl 2 s) was killed"):format(took))
    -- ttl (2 s) plus the slack: one return of a waiter (queue_ttl / 2)
    assert.is_true(took <= 2 + 1.5 + SLACK, "took " .. took)
    assert.is_true(leader:resign())
  end)

  it("a leader whose lease is lost (force release) learns it, and the next leads", function()
    local name = helpers.unique("e")
    local el2 = client:elections({ database = helpers.database, collection = coll, ttl = 1.5 })
    local leader = assert(el2:campaign(name, "mine"))
    local p = child("lead", name, "next", 3, 0.5)
    -- the child waits in the queue of the lock under the election
    assert.is_truthy(helpers.eventually(function()
      local st = el:status(name)
      return st and st.waiting >= 1
    end, 10))
    assert.is_true(el:force_release(name))
    local token2 = tonumber(assert(p:wait_for("leading %d+ (%d+)", 10)))
    assert.is_true(token2 > leader.token)
    -- the renewal (every ttl / 3) finds the lease gone
    assert.is_truthy(helpers.eventually(function() return leader:lost() end, 1.5 + SLACK))
    assert.same({ nil, "lost" }, { leader:check() })
    local st, out = p:wait(10)
    p:cleanup()
    assert.equal(0, st, out)
  end)

  it("an observer sees every change in order within a second, terms increasing", function()
    local name = helpers.unique("e")
    local it = el:observe(name, { timeout = 10 })
    local first = assert(it())
    assert.equal("current", first.change)
    assert.is_false(first.leader)
    local p = child("script", name, 3, 0.4)
    local seen = {}
    while #seen < 5 do
      local ch, err = it()
      assert.is_truthy(ch, err)
      seen[#seen + 1] = { ch = ch, at = core.monotonic() }
    end
    it:close()
    local st, out = p:wait(10)
    p:cleanup()
    assert.equal(0, st, out)
    local acts = {}
    for what, t, token in out:gmatch("at %d+ (%S+) ([%d.]+) (%d+)") do
      acts[#acts + 1] = { what = what, t = tonumber(t), token = tonumber(token) }
    end
    assert.equal(5, #acts, out)
    local expect = {
      { "leader", "v1" }, { "value", "v2" }, { "none" }, { "leader", "v3" }, { "none" },
    }
    local last_term = 0
    local worst = -math.huge
    for k, e in ipairs(expect) do
      local ch = seen[k].ch
      assert.equal(e[1], ch.change, "change " .. k)
      if e[1] == "none" then
        assert.is_false(ch.leader)
      else
        assert.is_true(ch.leader)
        assert.equal(e[2], ch.value)
        assert.equal(acts[k].token, ch.token)
        assert.is_true(ch.token >= last_term)
        last_term = ch.token
      end
      local late = seen[k].at - acts[k].t
      worst = math.max(worst, late)
      assert.is_true(late < 1, ("change %d seen %.3f s after it was made"):format(k, late))
    end
    print(("# elections: an observer saw each of 5 changes by %.1f ms after its write returned (negative: before)")
      :format(worst * 1000))
    -- a new term for the second campaign, none for the proclaim
    assert.equal(seen[1].ch.token, seen[2].ch.token)
    assert.is_true(seen[4].ch.token > seen[2].ch.token)
  end)

  it("an observer that is not called for longer than the ttl still returns every change in order", function()
    local name = helpers.unique("e")
    local p = child("script", name, 2, 0.4)
    assert(p:wait_for("at %d+ lead%-v1"))
    local it = el:observe(name, { timeout = 5 })
    local first = assert(it())
    assert.equal("current", first.change)
    assert.equal("v1", first.value)
    -- the child proclaims, resigns, leads and resigns meanwhile; the
    -- leader's lease as this observer last saw it runs out
    local st, out = p:wait(10)
    p:cleanup()
    assert.equal(0, st, out)
    core.sleep(2.5)
    local got = {}
    for _ = 1, 4 do
      local ch, err = it()
      assert.is_truthy(ch, err)
      got[#got + 1] = ch.change .. (ch.value and (" " .. ch.value) or "")
    end
    it:close()
    assert.same({ "value v2", "none", "leader v3", "none" }, got)
  end)

  -- an observer on a client of its own (app name APP); fp(mode, data) sets
  -- failCommand for that client only
  local function observer_client()
    local app = helpers.unique("observer")
    local oc = helpers.connect({ appname = app })
    local oel = oc:elections({ database = helpers.database, collection = coll, ttl = 3 })
    local function fp(mode, data)
      data.appName = app
      return assert(client:command("admin", { configureFailPoint = "failCommand" }, { mode = mode, data = data }))
    end
    return oc, oel, fp
  end

  -- the changes an observer returns until done(change, all so far) (or 8 s)
  local function changes_until(it, done)
    local got = {}
    local stop = core.monotonic() + 8
    while core.monotonic() < stop do
      local ch, err = it()
      if ch then
        got[#got + 1] = ch
        if done(ch, got) then break end
      elseif err ~= "timeout" then
        error(err)
      end
    end
    return got
  end

  local function words(got)
    local w = {}
    for _, ch in ipairs(got) do w[#w + 1] = ch.change .. (ch.value and (" " .. ch.value) or "") end
    return table.concat(w, ", ")
  end

  it("an observer whose stream opens late reports the leader elected meanwhile and its proclaim", function()
    local name = helpers.unique("e")
    local oc, oel, fp = observer_client()
    -- the observer's read (an aggregate) waits 1.5 s, then runs (nobody
    -- leads yet); its stream's aggregate waits 1.5 s more: the campaign
    -- and the proclaim happen while the stream opens
    fp({ times = 2 }, { failCommands = require("mongolock").array({ "aggregate" }),
                        blockConnection = true, blockTimeMS = 1500 })
    finally(function() fp("off", {}) end)
    local p = child("later", name, core.monotonic() + 2.1, 0.3)
    local it = oel:observe(name, { timeout = 2 })
    local got = changes_until(it, function(ch) return ch.value == "A2" end)
    it:close()
    local _, out = p:wait(15)
    p:cleanup()
    local token = assert(out:match("leading %d+ (%d+)"), out)
    assert.equal("current", got[1].change, words(got))
    local last = got[#got]
    assert.equal("A2", last.value, words(got))
    assert.is_true(last.leader)
    assert.equal(token, ("%.0f"):format(last.token))
    -- nothing said nobody leads after the campaign
    for k = 2, #got do assert.is_true(got[k].leader, words(got)) end
    oc:close()
  end)

  it("an observer whose getMore's connection closes reopens its stream and misses no change", function()
    local name = helpers.unique("e")
    local oc, oel, fp = observer_client()
    local it = oel:observe(name, { timeout = 5 })
    assert.equal("current", assert(it()).change)
    -- its next two getMores lose their connection
    fp({ times = 2 }, { failCommands = require("mongolock").array({ "getMore" }), closeConnection = true })
    finally(function() fp("off", {}) end)
    local p = child("script", name, 3, 0.4)
    local got = changes_until(it, function(_, all) return #all == 5 end)
    assert.is_true(fp("off", {}).count >= 1, "a getMore lost its connection")
    it:close()
    oc:close()
    local st, out = p:wait(10)
    p:cleanup()
    assert.equal(0, st, out)
    assert.equal("leader v1, value v2, none, leader v3, none", words(got))
  end)

  it("an observer sees a dead leader's lease end, and answers timeout when nothing changes", function()
    local name = helpers.unique("e")
    local p = child("lead", name, "doomed", 1.5, 120)
    local pid = tonumber(assert(p:wait_for("leading (%d+)")))
    local it = el:observe(name, { timeout = 1 })
    local first = assert(it())
    assert.equal("current", first.change)
    assert.is_true(first.leader)
    assert.equal("doomed", first.value)
    -- nothing changes: the renewals are no change
    local t0 = core.monotonic()
    local none, err = it()
    assert.is_nil(none)
    assert.equal("timeout", err)
    assert.is_true(core.monotonic() - t0 >= 0.9)
    p:kill("KILL", pid)
    local killed = core.monotonic()
    local ch
    repeat ch, err = it() until ch or err ~= "timeout" or core.monotonic() - killed > 5
    assert.is_truthy(ch, err)
    assert.equal("none", ch.change)
    print(("# elections: an observer saw the killed leader's lease (ttl 1.5 s) end %.3f s after the kill")
      :format(core.monotonic() - killed))
    assert.is_true(core.monotonic() - killed < 1.5 + SLACK)
    it:close()
    p:wait(10)
    p:cleanup()
  end)
end)
