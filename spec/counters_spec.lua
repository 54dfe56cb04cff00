-- The figures client:stats() and mongolock.metrics give are true: counters
-- never go back within a process (a client's close or collection takes
-- nothing from the totals), every command the client sends is counted (as
-- the server counts them on the wire), counts are integers, every metric
-- family has one label set, and the command's JSON has numbers to the
-- millisecond.
local helpers = require "helpers"
local cjson = require "cjson"
local core = require "mongolock.core"
local metrics = require "mongolock.metrics"

-- the value of the sample key ('family{labels}' or 'family') in a text
-- exposition, or nil
local function sample(text, key)
  for line in text:gmatch("[^\n]+") do
    local k, v = line:match("^(%S+) (%S+)$")
    if k == key then return tonumber(v) end
  end
  return nil
end

-- the commands the server saw, by serverStatus's metrics.commands, less
-- those a client's monitors and handshakes send, and serverStatus itself
local NOT_SENT_BY_CALLS = { hello = true, isMaster = true, ismaster = true, serverStatus = true,
                            endSessions = true, buildInfo = true, ping = true }
local function wire_commands(observer)
  local r = assert(observer:command("admin", { serverStatus = 1 }))
  local n = 0
  for name, m in pairs(r.metrics.commands) do
    if not NOT_SENT_BY_CALLS[name] then n = n + tonumber(tostring(m.total)) end
  end
  return n
end

describe("#integration counters", function()
  local observer
  before_each(function()
    observer = helpers.connect()
  end)
  after_each(function()
    observer:close()
  end)

  -- a client that took and released a lock of a fresh collection, renewed
  -- twice by the engine: the client, the collection ("db.coll")
  local function busy_client()
    local client = helpers.connect()
    local locks = helpers.locks(client, { ttl = 0.6 })
    local h = assert(locks:acquire("r", { renew = true }))
    -- (no closure over the client, which a LuaJIT trace may keep)
    local deadline = core.monotonic() + 10
    while client:stats().renewals < 2 and core.monotonic() < deadline do core.sleep(0.01) end
    assert.is_true(client:stats().renewals >= 2)
    assert.is_true(h:release())
    return client, locks.database .. "." .. locks.collection
  end

  local function key(family, coll)
    return "mongolock_" .. family .. '_total{kind="named",collection="' .. coll .. '"}'
  end

  it("never go back: a closed client keeps its counts, the process's totals keep them", function()
    local client, coll = busy_client()
    local before = client:stats()
    local text = metrics.render()
    local renewals, commands = sample(text, "mongolock_renewals_total"), sample(text, "mongolock_commands_total")
    assert.is_true(renewals >= before.renewals)
    assert.equal(1, sample(text, key("acquisitions", coll)))

    client:close()
    local after = client:stats()
    for _, k in ipairs({ "acquisitions", "releases", "renewals", "commands" }) do
      assert.is_true(after[k] >= before[k], k .. ": " .. tostring(before[k]) .. " -> " .. tostring(after[k]))
    end
    assert.equal(before.renewals, after.renewals)
    assert.equal(1, after.releases)
    text = metrics.render()
    assert.is_true(sample(text, "mongolock_renewals_total") >= renewals, text)
    assert.is_true(sample(text, "mongolock_commands_total") >= commands, text)
    assert.equal(1, sample(text, key("acquisitions", coll)))
    assert.equal(1, sample(text, key("releases", coll)))
  end)

  it("never go back: a client collected without close leaves its counts in the process's totals", function()
    -- nothing keeps the client but a weak table
    local gone = setmetatable({}, { __mode = "v" })
    local function run()
      local client, coll = busy_client()
      gone[1] = client
      local text = metrics.render()
      return coll, sample(text, "mongolock_renewals_total"), sample(text, "mongolock_commands_total")
    end
    local coll, renewals, commands = run()
    -- its handle's finalizer keeps it for a cycle; LuaJIT's compiled
    -- traces may hold it as a constant: flushed
    local jit = rawget(_G, "jit")
    if jit then jit.flush() end
    for _ = 1, 10 do
      if gone[1] == nil then break end
      collectgarbage()
    end
    assert.is_nil(gone[1], "the client was collected")
    local text = metrics.render()
    assert.is_true(sample(text, "mongolock_renewals_total") >= renewals, text)
    assert.is_true(sample(text, "mongolock_commands_total") >= commands, text)
    assert.equal(1, sample(text, key("acquisitions", coll)))
    assert.equal(1, sample(text, key("releases", coll)))
  end)

  it("count every command sent, as the server does: a change stream's aggregate, getMores and its idle killCursors",
    function()
    -- a client an earlier spec closed while its stream awaited a getMore
    -- (a waiter's, or a holder's) sends that stream's killCursors when the
    -- getMore returns, at most its await (2.5 s) later: waited out
    core.sleep(3)
    local client = helpers.connect()
    local locks = helpers.locks(client)
    local other = observer:locks({ database = locks.database, collection = locks.collection })
    assert(locks:try("warm")):release()                -- the TTL index is made once
    local wire0, c0 = wire_commands(observer), client:stats().commands
    -- a wait: the client's change stream opens, waits, and after it
    -- idles ends with a killCursors
    -- (held less than ML_HOLD_AFTER, 0.25 s: the observer's own stream,
    -- which would tell a holder of a loss, is never opened for it)
    local held = assert(other:try("w", { ttl = 0.2 }))
    local h = assert(locks:acquire("w", { timeout = 10 }))
    assert.is_true(h:release())
    assert.is_truthy(helpers.eventually(function() return client._core:counters().streams == 0 end, 25),
      "the stream idled out")
    local observer_sent = 1                               -- the try of `other`
    local wire = wire_commands(observer) - wire0 - observer_sent
    local counted = client:stats().commands - c0
    assert.equal(wire, counted)
    held:close()
    client:close()
  end)

  it("count the commands a scheduler's coroutines send (its thread pool's jobs), as the server does", function()
    local client = helpers.connect({ scheduler = "cqueues" })
    local locks = helpers.locks(client)
    assert(locks:try("warm")):release()                -- outside the loop; the TTL index made once
    local wire0, c0 = wire_commands(observer), client:stats().commands
    local cq = require("cqueues").new()
    local done = false
    cq:wrap(function()
      local h = assert(locks:try("s"))                  -- an attempt
      assert(locks:status("s"))                         -- a read
      assert(h:extend())                                -- a lease step
      assert.is_true(h:release())                       -- and another
      done = true
    end)
    assert(cq:loop())
    assert.is_true(done)
    local wire = wire_commands(observer) - wire0
    assert.equal(4, wire)
    assert.equal(wire, client:stats().commands - c0)
    client:close()
  end)

  it("are integers, and each metric family has one label set", function()
    local client = helpers.connect()
    local locks = helpers.locks(client)
    assert(locks:try("i")):release()
    local s = client:stats()
    local function integers(t, path)
      for k, v in pairs(t) do
        if type(v) == "table" and k ~= "wait_seconds" then integers(v, path .. "." .. tostring(k))
        elseif type(v) == "number" and math.type then
          assert.equal("integer", math.type(v), path .. "." .. tostring(k))
        end
      end
    end
    integers(s, "stats")
    assert.equal(1, s.acquisitions)
    -- printed without ".0"
    assert.equal(tostring(math.floor(s.commands)), tostring(s.commands))
    local text = metrics.render()
    local labels = {}
    for line in text:gmatch("[^\n]+") do
      local fam, l = line:match("^(mongolock_[%w_]-)_total{(.*)}")
      if fam then
        local set = l:gsub('="[^"]*"', ""):gsub(",le$", "")
        assert.is_true(labels[fam] == nil or labels[fam] == set, fam .. ": " .. set)
        labels[fam] = set
      end
    end
    for fam, set in pairs(labels) do assert.equal("kind,collection", set, fam) end
    assert.equal("kind,collection", labels.mongolock_releases)
    assert.equal("kind,collection", labels.mongolock_lost)
    client:close()
  end)
end)

-- every number in a line of JSON has at most 3 decimals; returns how many
-- had some
local function to_the_ms(out)
  local n = 0
  for frac in out:gmatch("[:,%[]%-?%d+%.(%d+)") do
    n = n + 1
    assert.is_true(#frac <= 3, out)
  end
  return n
end

describe("#integration the command's JSON", function()
  it("prints numbers to the millisecond (leader, leader --watch)", function()
    local client = helpers.connect()
    local coll = helpers.unique("elect")
    local el = client:elections({ database = helpers.database, collection = coll, ttl = 6 })
    local name = helpers.unique("ms")
    local leader = assert(el:campaign(name, "host-a:8080"))
    core.sleep(0.05)
    local base = { "--database", helpers.database, "--collection", coll, "leader", name }
    for _, extra in ipairs({ { "--json" }, { "--watch", "--json", "-w", "0.3" } }) do
      local a = {}
      for _, w in ipairs(base) do a[#a + 1] = w end
      for _, w in ipairs(extra) do a[#a + 1] = w end
      local code, out, err = helpers.mongolock(a)
      assert.equal(0, code, err)
      local j = cjson.decode(out:match("[^\n]+"))
      assert.is_true(j.leader, out)
      assert.is_true(j.remaining > 0 and j.remaining <= 6, out)
      to_the_ms(out)
    end
    assert(leader:resign())
    client:close()
  end)

  it("prints numbers to the millisecond (status, list, top)", function()
    local client = helpers.connect()
    local locks = helpers.locks(client, { ttl = 30 })
    local h = assert(locks:acquire("ms"))
    local base = { "--database", locks.database, "--collection", locks.collection }
    local function run(...)
      local a = {}
      for _, w in ipairs(base) do a[#a + 1] = w end
      for _, w in ipairs({ ... }) do a[#a + 1] = w end
      local code, out, err = helpers.mongolock(a)
      assert.equal(0, code, err)
      return out
    end
    core.sleep(0.05)
    for _, out in ipairs({ run("status", "ms", "--json"), run("list", "--json"), run("top", "--once", "--json") }) do
      assert.is_truthy(cjson.decode(out:match("[^\n]+")), out)
      assert.is_truthy(to_the_ms(out) > 0 or out:find('"remaining":%d'), out)
    end
    h:release()
    client:close()
  end)
end)
