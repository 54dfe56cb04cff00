-- A game server's shape: thousands of players, each a coroutine of one
-- cqueues loop, one document per player, locked while the player's state
-- changes; trades lock two players' documents all or none.  A 10 ms game
-- tick runs beside them: no lock's wait and no round trip holds the loop,
-- and how late the tick ran is printed (with thousands of coroutines, the
-- loop's own work and the machine's load).
--
--   MONGODB_URI=mongodb://127.0.0.1:27017/?replicaSet=rs0 lua5.4 examples/game_server.lua [PLAYERS [ROUNDS]]
--
-- (Debian: lua-cqueues.)  The players live in the URI's database (else
-- "mongolock"), collection "game_players".  At the end the gold of every
-- player adds up to what it was: no trade was half made.

local mongolock = require "mongolock"
local cqueues = require "cqueues"

local URI = os.getenv("MONGODB_URI") or "mongodb://127.0.0.1:27017/"
local PLAYERS = tonumber(arg[1]) or 2000
local ROUNDS = tonumber(arg[2]) or 3
local COLL = "game_players"
local unpack = table.unpack or rawget(_G, "unpack")

-- every wait of this client inside a coroutine of the loop yields to it
local client = assert(mongolock.connect(URI, { scheduler = "cqueues", appname = "game-server" }))
local db = client:default_database()
local players = client:documents(db, COLL, { ttl = 10 })

-- a fresh world (outside the loop: these calls block, as without a scheduler)
client:command(db, { delete = COLL }, { deletes = { { q = {}, limit = 0 } } })
local docs = {}
for id = 1, PLAYERS do docs[id] = { _id = id, gold = 100, xp = 0 } end
for i = 1, PLAYERS, 1000 do
  assert(client:command(db, { insert = COLL }, { documents = { unpack(docs, i, math.min(i + 999, PLAYERS)) } }))
end

local loop = cqueues.new()
local running, trades, failed, worst_tick = PLAYERS, 0, 0, 0

-- the game tick
loop:wrap(function()
  local last = mongolock.monotonic()
  while running > 0 do
    mongolock.sleep(0.01)         -- the scheduler's sleep inside the loop
    local now = mongolock.monotonic()
    worst_tick = math.max(worst_tick, now - last)
    last = now
  end
end)

for id = 1, PLAYERS do
  loop:wrap(function()
    for _ = 1, ROUNDS do
      -- a quest: the player's own document, locked, changed and unlocked
      -- in one update
      local doc, h = players:lock(id, { timeout = 30 })
      if doc then
        mongolock.sleep(0.001)    -- the quest takes a moment; others play on
        assert(h:release({ xp = doc.xp + 10 }))
      else
        failed = failed + 1
      end
      -- a trade with another player: both documents or neither
      local other = (id * 7919) % PLAYERS + 1
      if other ~= id then
        local set, err = client:acquire_all({ { players, id }, { players, other } }, { timeout = 30 })
        if set then
          local _, mine = set:get(1)
          local _, theirs = set:get(2)
          local amount = math.min(5, mine.gold)
          assert(set:release({ [1] = { gold = mine.gold - amount }, [2] = { gold = theirs.gold + amount } }))
          trades = trades + 1
        else
          io.stderr:write("trade ", id, " -> ", other, ": ", tostring(err), "\n")
          failed = failed + 1
        end
      end
    end
    running = running - 1
  end)
end

local started = mongolock.monotonic()
assert(loop:loop())
local elapsed = mongolock.monotonic() - started

local r = assert(client:command(db, { aggregate = COLL },
  { pipeline = { { ["$group"] = { _id = mongolock.null, gold = { ["$sum"] = "$gold" },
                                  xp = { ["$sum"] = "$xp" } } } }, cursor = {} }))
local total = r.cursor.firstBatch[1]
print(string.format("%d players, %d rounds: %d trades, %d failures in %.1f s; gold %d (was %d), xp %d; "
  .. "the 10 ms tick was late by at most %.0f ms", PLAYERS, ROUNDS, trades, failed, elapsed, total.gold,
  100 * PLAYERS, total.xp, worst_tick * 1000 - 10))
client:close()
os.exit(total.gold == 100 * PLAYERS and failed == 0 and 0 or 1)
