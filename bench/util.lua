-- What the benchmarks' coordinators and workers share: small files as
-- signals between processes, the server's command count, percentiles.
local core = require "mongolock.core"
local testing = require "mongolock.testing"

local _M = {}

function _M.read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

function _M.write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

function _M.exists(path) return _M.read_file(path) ~= nil end

function _M.sh_quote(s) return "'" .. tostring(s):gsub("'", [['\'']]) .. "'" end

-- waits (at most 120 s) until workers 1..n have written DIR/ready-<i>
function _M.wait_ready(dir, n)
  local deadline = core.monotonic() + 120
  repeat
    local ready = 0
    for i = 1, n do if _M.exists(dir .. "/ready-" .. i) then ready = ready + 1 end end
    if ready == n then return end
    core.sleep(0.01)
  until core.monotonic() > deadline
end

-- every command the server counted (serverStatus opcounters), this one's
-- own serverStatus included; and, second, how many of them were the
-- drivers' server monitoring (hello and isMaster, from metrics.commands),
-- which comes with time (one per connection pool every heartbeat), not
-- with what the lock does: nil when the server keeps no metrics.commands
-- (a server that counts no command at all there)
function _M.opcount(client)
  local oc = assert(testing.opcounters(client._core))
  local t = 0
  for _, k in ipairs({ "insert", "query", "update", "delete", "getmore", "command" }) do
    t = t + (oc[k] or 0)
  end
  if next(oc.commands) == nil then return t, nil end
  local m = 0
  for _, k in ipairs({ "hello", "isMaster", "ismaster" }) do
    m = m + (oc.commands[k] or 0)
  end
  return t, m
end

-- one measured run of call() back to back for secs seconds, after 20
-- calls not measured: {calls per second, client CPU us per call (os.clock:
-- every thread of the process), server commands per call (opcount's
-- delta, the closing serverStatus and the drivers' monitoring taken out)}
function _M.measure(client, secs, call)
  local monotonic = require("mongolock.core").monotonic
  for _ = 1, 20 do call() end
  local ops0, mon0 = _M.opcount(client)
  local n, t0, c0 = 0, monotonic(), os.clock()
  local stop = t0 + secs
  repeat
    call()
    n = n + 1
  until n % 8 == 0 and monotonic() >= stop
  local dt, dc = monotonic() - t0, os.clock() - c0
  local ops1, mon1 = _M.opcount(client)
  local ops = ops1 - ops0 - 1 - ((mon1 or 0) - (mon0 or 0))
  return { n / dt, dc / n * 1e6, ops / n }
end

-- ways ({{label, call}, ...}) measured in rounds interleaved across them,
-- each secs long: one list of measure()'s results per way
function _M.interleaved(client, ways, rounds, secs)
  local got = {}
  for _ = 1, rounds do
    for k, w in ipairs(ways) do
      got[k] = got[k] or {}
      got[k][#got[k] + 1] = _M.measure(client, secs, w[2])
    end
  end
  return got
end

-- the median, min and max of field j of a list of measure()'s results
function _M.stat(list, j)
  local v = {}
  for _, r in ipairs(list) do v[#v + 1] = r[j] end
  table.sort(v)
  return v[math.floor((#v + 1) / 2)], v[1], v[#v]
end

-- the p-th percentile (0..1) of a sorted list; NaN when it is empty
function _M.percentile(sorted, p)
  if #sorted == 0 then return 0 / 0 end
  return sorted[math.max(1, math.ceil(p * #sorted))]
end

return _M
