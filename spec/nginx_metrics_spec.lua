-- /metrics of the example nginx.conf (mongolock.metrics): the counters of
-- both workers summed through the shared dict, in Prometheus' text
-- exposition format as promtool (Debian's prometheus package) checks it.
local helpers = require "helpers"
local nx = require "nginx_helpers"

local format = string.format

-- a guarded increment answered with a Content-Length, for keep-alive
-- connections (each served by one worker for its life)
local LOCATIONS = [[
        location = /incr-ka {
            content_by_lua_block {
                local n, err = require("guarded_counter").guarded_add("metrics-spec")
                local body = tostring(n or err)
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }

]]

-- the sum of every sample of family name in a text exposition
local function total(text, name)
  local sum, seen = 0, false
  for line in text:gmatch("[^\n]+") do
    local n, v = line:match("^([%w_]+){[^}]*} (%S+)$")
    if not n then n, v = line:match("^([%w_]+) (%S+)$") end
    if n == name then sum, seen = sum + tonumber(v), true end
  end
  return seen and sum or nil
end

describe("#integration nginx /metrics", function()
  local nginx

  setup(function()
    nginx = nx.start({ locations = LOCATIONS })
  end)
  teardown(function()
    if nginx then nginx:stop() end
  end)

  it("sums both workers and passes promtool check metrics", function()
    local conns = nx.open_pingers(nginx.port, 2, 1)
    assert.equal(2, #conns)
    assert.are_not.equal(conns[1].pid, conns[2].pid)
    for _, c in ipairs(conns) do
      for _ = 1, 3 do
        local code, body = nx.keepalive_get(c.sock, "/incr-ka")
        assert.equal(200, code, body)
        assert.is_truthy(tonumber(body), body)
      end
    end
    -- each worker copies its counters to the dict every second; the
    -- worker that serves /metrics copies its own first
    local text
    local ok = pcall(nx.poll, function()
      local code, body = nx.get(nginx.port, "/metrics")
      assert.equal(200, code, body)
      text = body
      return total(body, "mongolock_acquisitions_total") == 6
    end, 10, "both workers' acquisitions in /metrics")
    assert.is_true(ok, text)
    for _, c in ipairs(conns) do c.sock:close() end

    assert.equal(6, total(text, "mongolock_releases_total"))
    assert.equal(0, total(text, "mongolock_lost_total"))
    assert.is_true(total(text, "mongolock_commands_total") >= 12)
    -- every acquisition's wait, counted or not, is not above +Inf
    assert.equal(total(text, "mongolock_waits_total"), total(text, "mongolock_wait_seconds_count"))
    assert.is_truthy(text:find('mongolock_acquisitions_total{kind="named",collection="[^"]+%.nginx_locks"} 6'),
      text)
    assert.is_truthy(text:find('mongolock_wait_seconds_bucket{kind="named",collection="[^"]+",le="%+Inf"}'),
      text)
    -- one label set per family: releases and losses by kind and collection too
    assert.is_truthy(text:find('mongolock_releases_total{kind="named",collection="[^"]+%.nginx_locks"} 6'), text)
    assert.is_truthy(text:find('mongolock_lost_total{kind="named",collection="[^"]+%.nginx_locks"} 0'), text)
    for line in text:gmatch("[^\n]+") do
      if line:match("^mongolock_[%w_]+_total{") then
        assert.is_truthy(line:match('^[%w_]+{kind="[^"]*",collection="[^"]*"} %d+$'), line)
      end
    end
    -- counts are written as integers
    assert.is_nil(text:find("_total%S* %d+%.0\n"), text)

    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(text)
    f:close()
    local p = assert(io.popen(format("promtool check metrics < %s 2>&1; echo \"exit $?\"",
      helpers.shell_quote(path))))
    local out = p:read("*a")
    p:close()
    os.remove(path)
    assert.is_truthy(out:find("exit 0\n$"), out .. "\n" .. text)
  end)
end)
