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

-- a client's Lua counters (mongolock.stats.series, of a collection of its
-- own) with waits (seconds) and counts, and its commands as a stand-in's
-- jobs; the C counters (releases, renewals) are the core's, not faked
local seq = 0
local function fake_client(t)
  seq = seq + 1
  local c = { _series = { by = {} }, _sched_core = { count = { n = t.commands or 0 } } }
  function c.closed(self) return self.gone == true end
  local s = stats.series(c, "named", "app", "locks" .. seq)
  s.acquisitions, s.timeouts, s.busy = t.acquisitions, t.timeouts or 0, t.busy or 0
  for _, w in ipairs(t.waits) do stats.observe_wait(s, w) end
  return c, s
end

describe("#unit metrics.register (an nginx-lua-prometheus registry)", function()
  -- a fake closed is folded into the process's totals (they keep it)
  local added = {}
  local function client(t)
    local c, s = fake_client(t)
    added[#added + 1] = c
    return c, s
  end
  after_each(function()
    for _, c in ipairs(added) do c.gone = true end
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
    assert.same({ type = "counter", labels = { "kind", "collection" } }, P.families.mongolock_releases_total)
    assert.same({ type = "counter" }, P.families.mongolock_commands_total)
    assert.equal("histogram", P.families.mongolock_wait_seconds.type)
    assert.same(B, P.families.mongolock_wait_seconds.buckets)
    local c, s = client({ acquisitions = 4, waits = { 0.003, 0.2, 0.2, 12 }, timeouts = 1, commands = 17 })
    assert.is_true(metrics.update())
    same_as_render(P)
    -- more of everything: only what is new is added
    s.acquisitions = 6
    c._sched_core.count.n = 25
    stats.observe_wait(s, 0.24)                                  -- one wait of 0.24 s (bucket 0.25)
    feeder.update()
    same_as_render(P)
    assert.equal(6, P.values['mongolock_acquisitions_total{kind="named",collection="' .. s.collection .. '"}'])
    assert.equal(5, P.values['mongolock_wait_seconds_count{kind="named",collection="' .. s.collection .. '"}'])
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
    c.gone = true                                                -- closed
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
