-- Fenced writes (h:fenced, mongolock.fenced) of one document, back to back,
-- against the same update unfenced: f:update({_id}, {$set = {n = i}}) under
-- a held named lock, and client:command's update of the same field.  No
-- contention: every write applies.
--
--   lua5.4|luajit bench/fenced.lua [SECONDS]           (MONGODB_URI set)
--
-- Prints a Markdown table row per way (rounds interleaved: fenced,
-- unfenced, fenced, ...): calls per second, the client's CPU per call
-- (os.clock: every thread of the process), and server commands per call
-- (serverStatus opcounters delta, the closing serverStatus and the
-- drivers' monitoring taken out); medians of ROUNDS rounds (3) of SECONDS /
-- 2 each (5 s by default), with their range.

local mongolock = require "mongolock"
local core = require "mongolock.core"
package.path = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;" .. package.path
local util = require "util"

local uri = os.getenv("MONGODB_URI")
if not uri or uri == "" then
  io.stderr:write("fenced: MONGODB_URI is not set (run it through tools/with-standin)\n")
  os.exit(2)
end
local seconds = tonumber(arg[1]) or 5
local rounds = tonumber(os.getenv("BENCH_ROUNDS")) or 3
local impl = rawget(_G, "jit") and "luajit" or "lua5.4"
local format = string.format

local DB, COLL = "mongolock_bench", "fenced-" .. core.getpid()
local client = assert(mongolock.connect(uri, { appname = "bench-fenced" }))
local h = assert(client:locks({ database = DB, collection = "fenced-locks", ttl = 60 }):acquire("doc"))
local f = h:fenced(COLL, { database = DB })
assert(f:update({ _id = 1 }, { ["$set"] = { n = 0 } }, { upsert = true }) == 1)

local i = 0
local ways = {
  { "fenced: f:update", function()
    i = i + 1
    assert(f:update({ _id = 1 }, { ["$set"] = { n = i } }) == 1)
  end },
  { "unfenced: client:command update", function()
    i = i + 1
    assert(client:command(DB, { update = COLL }, { updates = { { q = { _id = 1 }, u = { ["$set"] = { n = i } } } } }))
  end },
}
local got = util.interleaved(client, ways, rounds, seconds / 2)

io.write(format("\n### Fenced writes of one document (%s, h:fenced, no contention)\n\n", impl))
io.write("| way | calls/s (min-max) | client CPU µs / call (min-max) | commands / call |\n")
io.write("|---|---:|---:|---:|\n")
local cpu = {}
for k, w in ipairs(ways) do
  local r, rl, rh = util.stat(got[k], 1)
  local c, cl, ch = util.stat(got[k], 2)
  local o = util.stat(got[k], 3)
  cpu[k] = c
  io.write(format("| %s | %.0f (%.0f-%.0f) | %.0f (%.0f-%.0f) | %.2f |\n", w[1], r, rl, rh, c, cl, ch, o))
end
io.write(format("\nFenced / unfenced client CPU per call: %.2fx. Medians of %d rounds of %g s per way, "
  .. "interleaved, one client (one process), after 20 calls not measured.\n", cpu[1] / cpu[2], rounds, seconds / 2))
h:release()
client:close()
