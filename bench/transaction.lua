-- Guarded sections (h:transaction, mongolock.transaction) of two writes,
-- back to back, against the same two writes unguarded: a transaction under
-- a held named lock that $inc's one field of two documents, and
-- client:command's two updates of the same fields.  No contention: every
-- section commits.
--
--   lua5.4|luajit bench/transaction.lua [SECONDS]      (MONGODB_URI set)
--
-- Prints a Markdown table row per way (rounds interleaved: guarded,
-- unguarded, guarded, ...): sections per second, the client's CPU per
-- section (os.clock: every thread of the process), and server commands per
-- section (serverStatus opcounters delta, the closing serverStatus and the
-- drivers' monitoring taken out; a transaction's own connection's
-- handshake is no command there); medians of ROUNDS rounds (3) of SECONDS /
-- 2 each (5 s by default), with their range.

local mongolock = require "mongolock"
local core = require "mongolock.core"
package.path = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/?.lua;" .. package.path
local util = require "util"

local uri = os.getenv("MONGODB_URI")
if not uri or uri == "" then
  io.stderr:write("transaction: MONGODB_URI is not set (run it through tools/with-standin)\n")
  os.exit(2)
end
local seconds = tonumber(arg[1]) or 5
local rounds = tonumber(os.getenv("BENCH_ROUNDS")) or 3
local impl = rawget(_G, "jit") and "luajit" or "lua5.4"
local format = string.format

local DB, COLL = "mongolock_bench", "txn-" .. core.getpid()
local client = assert(mongolock.connect(uri, { appname = "bench-transaction" }))
local h = assert(client:locks({ database = DB, collection = "txn-locks", ttl = 60 }):acquire("doc"))
for id = 1, 2 do
  assert(client:command(DB, { update = COLL }, { updates = { { q = { _id = id }, u = { ["$set"] = { n = 0 } },
                                                                   upsert = true } } }))
end

local i = 0
local function section(tx)
  local c = tx:collection(COLL, { database = DB })
  assert(c:update({ _id = 1 }, { ["$inc"] = { n = 1 } }) == 1)
  assert(c:update({ _id = 2 }, { ["$inc"] = { n = -1 } }) == 1)
  return true
end
local ways = {
  { "guarded: h:transaction, 2 updates", function()
    i = i + 1
    assert(h:transaction(section))
  end },
  { "unguarded: 2 client:command updates", function()
    i = i + 1
    assert(client:command(DB, { update = COLL }, { updates = { { q = { _id = 1 }, u = { ["$inc"] = { n = 1 } } } } }))
    assert(client:command(DB, { update = COLL }, { updates = { { q = { _id = 2 }, u = { ["$inc"] = { n = -1 } } } } }))
  end },
}
local got = util.interleaved(client, ways, rounds, seconds / 2)

io.write(format("\n### Guarded sections of two writes (%s, h:transaction, no contention)\n\n", impl))
io.write("| way | sections/s (min-max) | client CPU µs / section (min-max) | commands / section |\n")
io.write("|---|---:|---:|---:|\n")
local cpu = {}
for k, w in ipairs(ways) do
  local r, rl, rh = util.stat(got[k], 1)
  local c, cl, ch = util.stat(got[k], 2)
  local o = util.stat(got[k], 3)
  cpu[k] = c
  io.write(format("| %s | %.0f (%.0f-%.0f) | %.0f (%.0f-%.0f) | %.2f |\n", w[1], r, rl, rh, c, cl, ch, o))
end
io.write(format("\nGuarded / unguarded client CPU per section: %.2fx. Medians of %d rounds of %g s per way, "
  .. "interleaved, one client (one process), after 20 sections not measured.\n", cpu[1] / cpu[2], rounds, seconds / 2))
h:release()
client:close()
