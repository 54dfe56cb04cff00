-- Optimistic writes (mongolock.versioned) of one document, back to back:
-- vc:update (an operator on one field) and vc:replace (the whole
-- document) of a document of 10, 100 and 1000 fields, each field a small
-- sub-document ({x = i, s = "some text i", t = {1, 2, 3}}: 0.7, 6.6 and
-- 68 KB of BSON).  No contention: every write wins.
--
--   lua5.4|luajit bench/versioned.lua [SECONDS]           (MONGODB_URI set)
--
-- Prints a Markdown table: calls per second, the client's CPU per call
-- (os.clock: user + sys of every thread of the process), and server
-- commands per call (serverStatus opcounters delta, the closing
-- serverStatus and the drivers' monitoring taken out).  Each size runs for
-- SECONDS / 2 per method (5 s by default), after 20 unmeasured calls.

local mongolock = require "mongolock"
local core = require "mongolock.core"
package.path = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;" .. package.path
local util = require "util"

local uri = os.getenv("MONGODB_URI")
if not uri or uri == "" then
  io.stderr:write("versioned: MONGODB_URI is not set (run it through tools/with-standin)\n")
  os.exit(2)
end
local seconds = tonumber(arg[1]) or 5
local impl = rawget(_G, "jit") and "luajit" or "lua5.4"
local format = string.format

local client = assert(mongolock.connect(uri, { appname = "bench-versioned" }))
local vc = client:versioned("mongolock_bench", "versioned-" .. core.getpid())

local function document(id, fields)
  local d = { _id = id }
  for i = 1, fields do d["f" .. i] = { x = i, s = "some text " .. i, t = { 1, 2, 3 } } end
  return d
end

-- calls/s, CPU us per call, commands per call of `call` for `secs`
local function measure(secs, call)
  return (table.unpack or rawget(_G, "unpack"))(util.measure(client, secs, call))
end

io.write(format("\n### Optimistic writes of one document (%s, mongolock.versioned, no contention)\n\n",
  impl))
io.write("| document | vc:update calls/s | client CPU µs / update | commands / update "
  .. "| vc:replace calls/s | client CPU µs / replace | commands / replace |\n")
io.write("|---|---:|---:|---:|---:|---:|---:|\n")
for _, fields in ipairs({ 10, 100, 1000 }) do
  local d = document(fields, fields)
  assert(vc:insert(d))
  local size = #assert(core.bson_encode(d))
  local i = 0
  local ur, uc, uo = measure(seconds / 2, function()
    i = i + 1
    assert(vc:update(d, { ["$set"] = { ["f1.x"] = i } }))
  end)
  local rr, rc, ro = measure(seconds / 2, function()
    i = i + 1
    d.f1.x = i
    assert(vc:replace(d))
  end)
  io.write(format("| %d fields, %.1f KB | %.0f | %.0f | %.2f | %.0f | %.0f | %.2f |\n",
    fields, size / 1000, ur, uc, uo, rr, rc, ro))
end
io.write("\nEach method runs " .. format("%g", seconds / 2) .. " s per size on one client "
  .. "(one process), after 20 calls not measured.\n")
client:close()
