-- mongolock.metrics: what the clients of this process did (client:stats()),
-- in Prometheus' text exposition format; inside nginx, every worker's
-- counters summed through a shared dict.
--
--   -- nginx.conf: lua_shared_dict mongolock_metrics 1m;
--   init_worker_by_lua_block {
--       require("mongolock.metrics").start(ngx.shared.mongolock_metrics)
--   }
--   location = /metrics {
--       content_by_lua_block {
--           require("mongolock.metrics").serve(ngx.shared.mongolock_metrics)
--       }
--   }
--
--   text = metrics.render()        -- this process's clients, no nginx needed
--   text = metrics.render(dict)    -- every worker's, summed (after sync)
--
--   -- or into nginx-lua-prometheus's registry, served by its collect():
--   init_worker_by_lua_block {
--       prometheus = require("prometheus").init("prometheus_metrics")
--       require("mongolock.metrics").register(prometheus)
--   }
--
-- Each worker copies its own totals into the dict (keys by worker pid, one
-- set per second, and at once before it serves /metrics): counting itself
-- never touches the dict, whose lock every worker shares.  A worker that
-- exits leaves its last totals there, so the sums never go back.  The
-- totals are the process's since it began: a client's counts stay in them
-- after it is closed or collected (mongolock.stats.totals, core.totals()).
--
-- Families (names and habits of Prometheus' conventions and
-- nginx-lua-prometheus): mongolock_acquisitions_total, _waits_total,
-- _timeouts_total, _busy_total, the histogram mongolock_wait_seconds,
-- mongolock_releases_total and _lost_total (labels kind, collection);
-- mongolock_renewals_total, _renewal_failures_total,
-- _commands_total, _stream_reopens_total.

--- Prometheus metrics of the clients of this process; inside nginx, of every worker.
-- @module mongolock.metrics

local args = require "mongolock.args"
local core = require "mongolock.core"
local stats = require "mongolock.stats"

local pairs, ipairs, type, tostring, tonumber = pairs, ipairs, type, tostring, tonumber
local string_format = string.format
local table_concat, table_sort = table.concat, table.sort
local math_floor = math.floor

local _M = { _VERSION = "0.1.0", INTERVAL = 1 }

-- family, type, help; labels: the per-series families' (kind, collection)
local SERIES = {
  { "acquisitions", "counter", "Locks acquired (a try or an acquire that won)." },
  { "waits", "counter", "Acquisitions that had to wait for the lock." },
  { "timeouts", "counter", "Acquires that gave up at their timeout." },
  { "busy", "counter", "Tries answered busy." },
}
local KIND = {
  { "releases", "counter", "Releases that freed a held lease." },
  { "lost", "counter", "Leases found lost (taken, force released, past their deadline)." },
}
local CLIENT = {
  { "renewals", "counter", "Leases renewed by the lease engine." },
  { "renewal_failures", "counter", "Renewal commands that failed (retried)." },
  { "commands", "counter", "Commands sent to the server." },
  { "stream_reopens", "counter", "Change streams opened again after an error." },
}

local function escape(v)
  return (tostring(v):gsub("[\\\"\n]", { ["\\"] = "\\\\", ['"'] = '\\"', ["\n"] = "\\n" }))
end

local function num(v)
  if v == math_floor(v) and v < 2 ^ 53 and v > -2 ^ 53 then return string_format("%d", v) end
  return string_format("%.17g", v)
end

local function le(b)
  return b == math_floor(b) and string_format("%d", b) or string_format("%.15g", b)
end

-- the cumulative wait histogram's counts of a series' per-bucket counts
local function cumulative(counts)
  local cum, acc = {}, 0
  for i = 1, #counts do
    acc = acc + counts[i]
    cum[i] = acc
  end
  return cum
end

--- The samples of this process, as a table of series to values.
-- samples (key -> value, key = 'family{labels}') of this process: every
-- client's counts since the process began, those of clients closed or
-- collected since too (mongolock.stats.totals, core.totals()), so that no
-- counter ever goes back
function _M.samples()
  local acc = {}
  local series, jobs = stats.totals()
  for _, e in ipairs(series) do
    local labels = string_format('kind="%s",collection="%s"', escape(e.kind), escape(e.collection))
    for _, f in ipairs(SERIES) do acc["mongolock_" .. f[1] .. "_total{" .. labels .. "}"] = e[f[1]] end
    local counts = cumulative(e.wait_counts)
    for i, b in ipairs(stats.WAIT_BUCKETS) do
      acc["mongolock_wait_seconds_bucket{" .. labels .. ',le="' .. le(b) .. '"}'] = counts[i]
    end
    acc["mongolock_wait_seconds_bucket{" .. labels .. ',le="+Inf"}'] = counts[#counts]
    acc["mongolock_wait_seconds_sum{" .. labels .. "}"] = e.wait_sum
    acc["mongolock_wait_seconds_count{" .. labels .. "}"] = counts[#counts]
  end
  -- releases and losses: every kind and collection that counted one, or
  -- an acquisition (0 then), with the same labels as the others
  local t = core.totals()
  local function place(kind, collection, p)
    local labels = string_format('kind="%s",collection="%s"', escape(kind), escape(collection))
    for _, f in ipairs(KIND) do
      local key = "mongolock_" .. f[1] .. "_total{" .. labels .. "}"
      acc[key] = (acc[key] or 0) + (p and p[f[1]] or 0)
    end
  end
  for _, e in ipairs(series) do place(e.kind, e.collection, nil) end
  for _, p in ipairs(t.places) do place(p.kind, p.collection, p) end
  t.commands = t.commands + jobs
  for _, f in ipairs(CLIENT) do acc["mongolock_" .. f[1] .. "_total"] = t[f[1]] end
  return acc
end

-- the text exposition of samples (key -> value)
local function text(acc)
  local by = {}
  for key, v in pairs(acc) do
    local fam = key:match("^([%w_]-)_bucket{") or key:match("^([%w_]-)_sum{") or key:match("^([%w_]-)_count{")
      or key:match("^([%w_]+)")
    local l = by[fam]
    if not l then l = {}; by[fam] = l end
    l[#l + 1] = { key, v }
  end
  local out = {}
  local function family(name, typ, help)
    out[#out + 1] = string_format("# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
    local l = by[name] or {}
    -- in order of their labels, each bucket by its bound, then sum, count
    local function rank(key)
      local labels = key:match("{(.*)}") or ""
      local bound = labels:match(',le="([^"]+)"$')
      local base = labels:gsub(',le="[^"]+"$', "")
      local order = key:find("_sum{", 1, true) and 2 or key:find("_count{", 1, true) and 3 or 1
      return base, order, bound == "+Inf" and math.huge or tonumber(bound) or 0
    end
    table_sort(l, function(a, b)
      local ba, oa, va = rank(a[1])
      local bb, ob, vb = rank(b[1])
      if ba ~= bb then return ba < bb end
      if oa ~= ob then return oa < ob end
      return va < vb
    end)
    for _, kv in ipairs(l) do out[#out + 1] = kv[1] .. " " .. num(kv[2]) .. "\n" end
  end
  for _, f in ipairs(SERIES) do family("mongolock_" .. f[1] .. "_total", f[2], f[3]) end
  family("mongolock_wait_seconds", "histogram", "Seconds an acquisition waited for its lock.")
  for _, f in ipairs(KIND) do family("mongolock_" .. f[1] .. "_total", f[2], f[3]) end
  for _, f in ipairs(CLIENT) do family("mongolock_" .. f[1] .. "_total", f[2], f[3]) end
  return table_concat(out)
end

-- the key prefix of this worker's samples in the dict
local function prefix()
  local ngx = rawget(_G, "ngx")
  return tostring(ngx and ngx.worker and ngx.worker.pid() or core.getpid()) .. "\t"
end

--- Copies this process's totals into the shared dict.
-- ok, err = metrics.sync(dict): this process's totals into dict (under its
-- pid; replaces what it wrote before)
function _M.sync(dict)
  if type(dict) ~= "table" and type(dict) ~= "userdata" then
    args.argerror(1, "sync", "shared dict expected, got " .. type(dict))
  end
  local p = prefix()
  for key, v in pairs(_M.samples()) do
    local ok, err = dict:set(p .. key, v)
    if not ok then return nil, err end
  end
  return true
end

--- The text exposition of this process's clients, or of every worker's totals in dict.
-- text = metrics.render([dict]): the text exposition of this process's
-- clients, or (dict) of every worker's totals in it, summed
function _M.render(dict)
  if dict == nil then return text(_M.samples()) end
  local acc = {}
  for _, k in ipairs(dict:get_keys(0)) do
    local key = k:match("^%d+\t(.+)$")
    local v = key and dict:get(k)
    if type(v) == "number" then acc[key] = (acc[key] or 0) + v end
  end
  return text(acc)
end

--- Copies this worker's totals into dict every interval seconds (init_worker_by_lua).
-- metrics.start(dict[, interval]): copies this worker's totals into dict
-- every interval seconds (default 1), from init_worker_by_lua
function _M.start(dict, interval)
  local ngx = rawget(_G, "ngx")
  local ok, err = ngx.timer.every(interval or _M.INTERVAL, function(premature)
    if premature then return end
    local sok, serr = pcall(_M.sync, dict)
    if not sok then ngx.log(ngx.ERR, "mongolock.metrics: ", tostring(serr)) end
  end)
  if not ok then return nil, err end
  return true
end

--- A content handler: every worker's totals, summed, as text/plain.
-- metrics.serve(dict): a content handler: this worker's totals copied,
-- then every worker's, summed, as text/plain; version=0.0.4
function _M.serve(dict)
  local ngx = rawget(_G, "ngx")
  local ok, err = _M.sync(dict)
  if not ok then ngx.log(ngx.ERR, "mongolock.metrics: ", tostring(err)) end
  local body = _M.render(dict)
  ngx.header.content_type = "text/plain; version=0.0.4"
  ngx.header.content_length = #body
  ngx.print(body)
end

-- ---- feeding an nginx-lua-prometheus registry --------------------------------

-- this process's totals (those of samples()): counters (family -> label
-- key -> {labels, value}) and the wait histograms (label key -> {labels,
-- counts (per bucket, not cumulative; the last above every bound), sum})
local function totals()
  local t, hist = {}, {}
  local function add(fam, labels, v)
    local f = t[fam]
    if not f then f = {}; t[fam] = f end
    local k = table_concat(labels, "\0")
    local e = f[k]
    if not e then e = { labels = labels, value = 0 }; f[k] = e end
    e.value = e.value + v
  end
  local series, jobs = stats.totals()
  for _, e in ipairs(series) do
    local labels = { e.kind, e.collection }
    for _, f in ipairs(SERIES) do add(f[1], labels, e[f[1]]) end
    for _, f in ipairs(KIND) do add(f[1], labels, 0) end
    local counts = {}
    for i, n in ipairs(e.wait_counts) do counts[i] = n end
    hist[e.kind .. "\0" .. e.collection] = { labels = labels, counts = counts, sum = e.wait_sum }
  end
  local c = core.totals()
  for _, p in ipairs(c.places) do
    for _, f in ipairs(KIND) do add(f[1], { p.kind, p.collection }, p[f[1]]) end
  end
  c.commands = c.commands + jobs
  for _, f in ipairs(CLIENT) do add(f[1], {}, c[f[1]]) end
  return t, hist
end

-- observes n[i] new waits in each bucket i of bounds B (n[#B + 1] above
-- them all) whose seconds add up to sum: the counts and the sum are
-- mongolock's, the single values (not kept) each one inside its bucket
local function observe_waits(h, labels, B, n, sum)
  local nb = #B
  local low, room, above = 0, 0, 0
  for i = 1, nb + 1 do
    local lo = i == 1 and 0 or B[i - 1]
    low = low + n[i] * lo
    if i <= nb then room = room + n[i] * (B[i] - lo) else above = n[i] end
  end
  -- the share of its bucket each value fills; what is left goes above
  local extra = sum - low
  local f = room > 0 and math.max(0, math.min(1, extra / room)) or 0
  local rest = above > 0 and math.max(extra - f * room, 0) / above or 0
  for i = 1, nb + 1 do
    local lo = i == 1 and 0 or B[i - 1]
    local v
    if i <= nb then
      local w = B[i] - lo
      v = lo + math.max(f * w, w * 1e-9)     -- inside (lo, B[i]]
    else
      v = lo + math.max(rest, 1e-9)
    end
    for _ = 1, n[i] do h:observe(v, labels) end
  end
end

local feeders = {}

--- Defines mongolock's families on an nginx-lua-prometheus registry and feeds it this worker's totals.
-- feeder = metrics.register(prometheus[, opts]): from init_worker_by_lua,
-- after prometheus.init(dict_name).  The families of render() as the
-- registry's counters and histogram (same names, labels and help);
-- feeder.update() (and metrics.update(), every registered feeder) adds what
-- the clients did since the last update: every opts.interval seconds
-- (default 1; false: never) from a timer of the worker, and before
-- prometheus:collect() by the caller when it wants the latest.
function _M.register(prometheus, opts)
  if type(prometheus) ~= "table" or type(prometheus.counter) ~= "function"
      or type(prometheus.histogram) ~= "function" then
    args.argerror(1, "register", "an nginx-lua-prometheus registry expected (prometheus.init(dict_name)), got "
      .. type(prometheus))
  end
  if opts ~= nil and type(opts) ~= "table" then args.argerror(2, "register", "table expected, got " .. type(opts)) end
  opts = opts or {}
  local interval = opts.interval
  if interval == nil then interval = _M.INTERVAL end
  if interval ~= false and (type(interval) ~= "number" or interval ~= interval or interval <= 0) then
    args.argerror(2, "register", "interval must be a positive number or false")
  end
  local counters = {}
  for _, l in ipairs({ SERIES, KIND }) do
    for _, f in ipairs(l) do
      counters[f[1]] = prometheus:counter("mongolock_" .. f[1] .. "_total", f[3], { "kind", "collection" })
    end
  end
  for _, f in ipairs(CLIENT) do
    counters[f[1]] = prometheus:counter("mongolock_" .. f[1] .. "_total", f[3])
  end
  local B = stats.WAIT_BUCKETS
  local hist = prometheus:histogram("mongolock_wait_seconds", "Seconds an acquisition waited for its lock.",
    { "kind", "collection" }, B)
  -- what was fed so far (the totals never go down; were one to, it would
  -- be fed no negative increment: the registry's counters only grow)
  local fed, fed_hist = {}, {}
  local feeder = {}
  function feeder.update()
    local t, h = totals()
    for fam, series in pairs(t) do
      local c, was = counters[fam], fed[fam]
      if not was then was = {}; fed[fam] = was end
      for k, e in pairs(series) do
        local d = e.value - (was[k] or 0)
        if d > 0 or was[k] == nil then
          c:inc(math.max(d, 0), e.labels[1] and e.labels or nil)
          was[k] = e.value
        end
      end
    end
    for k, x in pairs(h) do
      local was = fed_hist[k]
      if not was then was = { counts = {}, sum = 0 }; fed_hist[k] = was end
      local n, any = {}, false
      for i = 1, #B + 1 do
        n[i] = math.max(x.counts[i] - (was.counts[i] or 0), 0)
        if n[i] > 0 then any = true end
      end
      if any then
        observe_waits(hist, x.labels, B, n, math.max(x.sum - was.sum, 0))
        was.counts, was.sum = x.counts, x.sum
      end
    end
    return true
  end
  feeders[#feeders + 1] = feeder
  local ngx = rawget(_G, "ngx")
  if interval and ngx and ngx.timer then
    local ok, err = ngx.timer.every(interval, function(premature)
      if premature then return end
      local fok, ferr = pcall(feeder.update)
      if not fok then ngx.log(ngx.ERR, "mongolock.metrics: ", tostring(ferr)) end
    end)
    if not ok then return nil, err end
  end
  return feeder
end

--- Feeds every registered registry now (before prometheus:collect()).
function _M.update()
  for _, f in ipairs(feeders) do f.update() end
  return true
end

return _M
