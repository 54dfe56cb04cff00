-- client:stats(): counters since connect, moved exactly by the calls made
-- (one acquisition, one wait, one timeout, one busy try, one lost lease, one
-- failed renewal), the wait-time histogram whose count is the waits, and
-- client:on_lost(fn), fired once per lease found lost.
local helpers = require "helpers"
local testing = require "mongolock.testing"
local core = require "mongolock.core"

-- the series of kind in collection coll ("db.coll") of stats s
local function series(s, kind, coll)
  for _, e in ipairs(s.series) do
    if e.kind == kind and e.collection == coll then return e end
  end
  return nil
end

describe("#integration client:stats()", function()
  local client, observer, app

  before_each(function()
    app = helpers.unique("stats"):sub(1, 60)
    client = helpers.connect({ appname = app })
    observer = helpers.connect()
  end)
  after_each(function()
    testing.failpoint(observer._core, { mode = "off" })
    client:close()
    observer:close()
  end)

  it("starts at zero, with the histogram's fixed buckets", function()
    local s = client:stats()
    for _, k in ipairs({ "acquisitions", "waits", "timeouts", "busy", "lost", "releases", "renewals",
                         "renewal_failures", "commands", "stream_reopens" }) do
      assert.equal(0, s[k], k)
    end
    assert.same({}, s.series)
    assert.equal(0, s.wait_seconds.count)
    assert.equal(0, s.wait_seconds.sum)
    assert.is_true(#s.wait_seconds.buckets >= 8)
    for i, b in ipairs(s.wait_seconds.buckets) do
      assert.equal(0, s.wait_seconds.counts[i])
      if i > 1 then assert.is_true(b > s.wait_seconds.buckets[i - 1]) end
    end
  end)

  it("counts one acquisition, one busy try, one wait, one timeout, each once", function()
    local locks = helpers.locks(client, { ttl = 30 })
    local coll = locks.database .. "." .. locks.collection
    local other = observer:locks({ database = locks.database, collection = locks.collection })

    local h = assert(locks:acquire("a"))                       -- one acquisition, no wait
    local s = client:stats()
    assert.equal(1, s.acquisitions)
    assert.equal(0, s.waits)
    assert.is_true(s.commands >= 1)

    local oh = assert(other:try("b"))
    for _ = 1, 2 do
      local x, e1 = locks:try("b")
      assert.is_nil(x)
      assert.equal("busy", e1)
    end
    s = client:stats()
    assert.equal(2, s.busy)                                     -- two tries answered busy

    local _, err = locks:acquire("b", { timeout = 0.2 })        -- one timeout
    assert.equal("timeout", err)
    s = client:stats()
    assert.equal(1, s.timeouts)
    assert.equal(0, s.waits)
    assert.equal(0, s.wait_seconds.count)

    -- one wait: the holder's short lease ends, the waiter takes the lock
    assert.is_true(oh:release())
    local short = assert(other:try("c", { ttl = 0.3 }))
    local w = assert(locks:acquire("c", { timeout = 10 }))
    s = client:stats()
    assert.equal(2, s.acquisitions)
    assert.equal(1, s.waits)
    assert.equal(1, s.wait_seconds.count)
    assert.is_true(s.wait_seconds.sum > 0.1 and s.wait_seconds.sum < 8, tostring(s.wait_seconds.sum))
    -- cumulative: the last bucket holds every observation
    assert.equal(1, s.wait_seconds.counts[#s.wait_seconds.counts])

    assert.is_true(h:release())
    assert.is_true(w:release())
    short:close()
    s = client:stats()
    assert.equal(2, s.releases)
    local e = assert(series(s, "named", coll))
    assert.equal(2, e.acquisitions)
    assert.equal(1, e.waits)
    assert.equal(1, e.timeouts)
    assert.equal(2, e.busy)
    assert.equal(1, e.wait_seconds.count)
    assert.equal(2, s.by_kind.named.releases)
    assert.equal(0, s.lost)
  end)

  it("counts one lost lease and one failed renewal, and on_lost fires once", function()
    local locks = helpers.locks(client, { ttl = 1.5 })
    local other = observer:locks({ database = locks.database, collection = locks.collection })
    local seen = {}
    client:on_lost(function(ev) seen[#seen + 1] = ev end)

    -- one failed renewal: the fail point fails the next update of this client
    local h = assert(locks:acquire("r", { renew = true }))
    assert(testing.failpoint(observer._core, { times = 1, commands = { "update" }, error_code = 2,
      app_name = app }))
    assert.is_truthy(helpers.eventually(function() return client:stats().renewal_failures >= 1 end, 5))
    assert.is_truthy(helpers.eventually(function() return client:stats().renewals >= 1 end, 5))
    assert.equal(1, client:stats().renewal_failures)
    assert.is_true(h:held())
    assert.equal(0, client:stats().lost)
    client:poll()
    assert.equal(1, #seen)
    assert.equal("renewal failed", seen[1].reason)
    assert.equal("r", seen[1].name)
    seen = {}

    -- one lost lease: taken by force; the next renewal finds it gone
    assert.is_true(other:force_release("r"))
    assert.is_truthy(helpers.eventually(function() client:poll(); return #seen > 0 end, 5))
    assert.equal(1, #seen)
    assert.same({ reason = "lost", kind = "named", name = "r", database = locks.database,
                  collection = locks.collection, token = h.token, owner = h.owner }, seen[1])
    assert.same({ nil, "lost" }, { h:release() })
    core.sleep(0.6)
    client:poll()
    assert.equal(1, #seen)                                       -- once
    local s = client:stats()
    assert.equal(1, s.lost)
    assert.equal(1, s.by_kind.named.lost)
    assert.equal(0, s.releases)
  end)

  it("counts the commands sent: a try and its release are two", function()
    local locks = helpers.locks(client)
    -- the commands counted but for those of the change stream, which a
    -- held lock keeps reading (its aggregate and getMores, counted when
    -- answered: read again until none was answered meanwhile)
    local function commands()
      while true do
        local w = testing.watch_stats(client._core)
        local n = client:stats().commands
        local w2 = testing.watch_stats(client._core)
        if w.opens + w.getmores == w2.opens + w2.getmores then return n - w.opens - w.getmores end
      end
    end
    assert(locks:try("warm")):release()          -- the TTL index is made once
    local before = commands()
    local h = assert(locks:try("c"))
    assert.equal(before + 1, commands())
    assert.is_true(h:release())
    assert.equal(before + 2, commands())
    assert(locks:status("c"))
    assert.equal(before + 3, commands())
  end)

  it("mongolock.metrics renders them in Prometheus' text format (promtool check metrics)", function()
    local metrics = require "mongolock.metrics"
    local locks = helpers.locks(client)
    local coll = locks.database .. "." .. locks.collection
    assert(locks:try("m")):release()
    local text = metrics.render()
    assert.matches('\nmongolock_acquisitions_total{kind="named",collection="' .. coll:gsub("%p", "%%%0")
      .. '"} 1\n', text)
    assert.matches('\nmongolock_wait_seconds_bucket{kind="named",collection="' .. coll:gsub("%p", "%%%0")
      .. '",le="%+Inf"} 0\n', text)
    assert.matches("# TYPE mongolock_wait_seconds histogram\n", text, 1, true)
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(text)
    f:close()
    local p = assert(io.popen("promtool check metrics < " .. helpers.shell_quote(path) .. " 2>&1; echo \"exit $?\""))
    local out = p:read("*a")
    p:close()
    os.remove(path)
    assert.matches("exit 0\n$", out)
  end)

  it("poll() without a callback queues nothing; bad arguments raise", function()
    assert.equal(0, client:poll())
    assert.has_error(function() client:on_lost("x") end,
      "bad argument #1 to 'on_lost' (function expected, got string)")
    client:on_lost(nil)                                          -- removes it
  end)
end)
