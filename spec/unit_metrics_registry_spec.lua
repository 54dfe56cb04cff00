-- #unit: mongolock.metrics feeding an nginx-lua-prometheus registry
-- (metrics.register): a fake of that library's API (prometheus:counter,
-- :histogram, counter:inc, histogram:observe) checked against render()'s
-- own samples, with clients faked in mongolock.stats.
local metrics = require "mongolock.metrics"
local stats = require "mongolock.stats"

local B = stats.WAIT_BUCKETS
local unpack = table.unpack or rawget(_G, "unpack")

-- the registry: every series as render() names it, 'name{k="v",...}'
local function fake_registry()
  local P = { families = {}, values = {}, negative = {} }
  local function key(name, names, values)
    assert.equal(#(names or {}), #(values or {}), name .. ": label values do not match the label names")
    if not names or #names == 0 then return name end
    local parts = {}
    for i, n in ipairs(names) do parts[i] = n .. '="' .. values[i] .. '"' end
    return name .. "{" .. table.concat(parts, ",") .. "}"
  end
  local function add(k, v) P.values[k] = (P.values[k] or 0) + v end
  function P:counter(name, help, label_names)
    assert.is_nil(self.families[name], name .. " registered twice")
    assert.is_string(help)
    self.families[name] = { type = "counter", labels = label_names }
    local c = {}
    function c.inc(_, v, label_values)
      if v < 0 then P.negative[#P.negative + 1] = name end
      add(key(name, label_names, label_values), v)
    end
    return c
  end
  function P.gauge(_, name)
    error("no gauge expected: " .. name)
  end
  function P:histogram(name, help, label_names, buckets)
    assert.is_nil(self.families[name], name .. " registered twice")
    assert.is_string(help)
    self.families[name] = { type = "histogram", labels = label_names, buckets = buckets }
    local h = {}
    function h.observe(_, v, label_values)
      local names = {}
      for i, n in ipairs(label_names) do names[i] = n end
      local base = { unpack(label_values) }
      for _, b in ipairs(buckets) do
        local bn, bv = { unpack(names) }, { unpack(base) }
        bn[#bn + 1], bv[#bv + 1] = "le", (b == math.floor(b) and ("%d"):format(b) or ("%.15g"):format(b))
        add(key(name .. "_bucket", bn, bv), v <= b and 1 or 0)
      end
      local bn, bv = { unpack(names) }, { unpack(base) }
      bn[#bn + 1], bv[#bv + 1] = "le", "+Inf"
      add(key(name .. "_bucket", bn, bv), 1)
      add(key(name .. "_sum", names, base), v)
      add(key(name .. "_count", names, base), 1)
    end
    return h
  end
  return P
end

-- a client's stats() with waits (seconds) and counts
local function fake_client(t)
  local counts, sum = {}, 0
  for i = 1, #B + 1 do counts[i] = 0 end
  for _, w in ipairs(t.waits) do
    sum = sum + w
    for i = 1, #B + 1 do
      if i > #B or w <= B[i] then counts[i] = counts[i] + 1 end
    end
  end
  local by_kind = {}
  for _, k in ipairs({ "named", "document", "shared", "permit" }) do
    by_kind[k] = { releases = t.releases or 0, lost = t.lost or 0 }
  end
  local s = {
    series = { { kind = "named", collection = "app.locks", acquisitions = t.acquisitions, waits = #t.waits,
                 timeouts = t.timeouts or 0, busy = t.busy or 0,
                 wait_seconds = { buckets = B, counts = counts, sum = sum, count = #t.waits } } },
    by_kind = by_kind, renewals = t.renewals or 0, renewal_failures = 0, commands = t.commands or 0,
    stream_reopens = 0,
  }
  return { stats = function() return s end }
end

describe("#unit metrics.register (an nginx-lua-prometheus registry)", function()
  local added = {}
  local function client(t)
    local c = fake_client(t)
    added[#added + 1] = c
    stats.clients[c] = true
    return c
  end
  after_each(function()
    for _, c in ipairs(added) do stats.clients[c] = nil end
    added = {}
  end)

  -- every sample render() would print, the registry holds (the sum to a
  -- microsecond)
  local function same_as_render(P)
    for k, v in pairs(metrics.samples()) do
      local got = P.values[k]
      assert.is_not_nil(got, "the registry has no " .. k)
      if k:find("_sum", 1, true) then
        assert.is_true(math.abs(got - v) < 1e-6, k .. ": " .. got .. " ~= " .. v)
      else
        assert.equal(v, got, k)
      end
    end
  end

  it("defines render()'s families, and feeds them what the clients did, as render() counts it", function()
    local P = fake_registry()
    local feeder = assert(metrics.register(P, { interval = false }))
    assert.same({ type = "counter", labels = { "kind", "collection" } }, P.families.mongolock_acquisitions_total)
    assert.same({ type = "counter", labels = { "kind" } }, P.families.mongolock_releases_total)
    assert.same({ type = "counter" }, P.families.mongolock_commands_total)
    assert.equal("histogram", P.families.mongolock_wait_seconds.type)
    assert.same(B, P.families.mongolock_wait_seconds.buckets)
    local c = client({ acquisitions = 4, waits = { 0.003, 0.2, 0.2, 12 }, timeouts = 1, releases = 2,
                       commands = 17, renewals = 3 })
    assert.is_true(metrics.update())
    same_as_render(P)
    -- more of everything: only what is new is added
    local s = c.stats()
    s.series[1].acquisitions = 6
    s.commands = 25
    local w = s.series[1].wait_seconds
    for i = 6, #B + 1 do w.counts[i] = w.counts[i] + 1 end        -- one wait of 0.24 s (bucket 0.25)
    w.sum, w.count, s.series[1].waits = w.sum + 0.24, w.count + 1, 5
    feeder.update()
    same_as_render(P)
    assert.equal(6, P.values['mongolock_acquisitions_total{kind="named",collection="app.locks"}'])
    assert.same({}, P.negative)
  end)

  it("never feeds a negative increment: a client that goes away leaves the registry's counters as they were",
     function()
    local P = fake_registry()
    local feeder = metrics.register(P, { interval = false })
    local c = client({ acquisitions = 3, waits = { 0.5 }, commands = 9 })
    feeder.update()
    local before = {}
    for k, v in pairs(P.values) do before[k] = v end
    stats.clients[c] = nil
    feeder.update()
    assert.same({}, P.negative)
    assert.same(before, P.values)
  end)

  it("refuses what is no registry, and a bad interval, at the caller", function()
    assert.has_error(function() metrics.register(nil) end,
      "bad argument #1 to 'register' (an nginx-lua-prometheus registry expected (prometheus.init(dict_name)), "
      .. "got nil)")
    assert.has_error(function() metrics.register(fake_registry(), { interval = 0 }) end,
      "bad argument #2 to 'register' (interval must be a positive number or false)")
  end)
end)
