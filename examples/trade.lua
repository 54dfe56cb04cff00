-- A trade between two players, written in one guarded transaction: the
-- buyer's gold and the seller's item move together, and only while the
-- trading post's lock is ours (h:transaction, doc/transactions.md).
--
--   MONGODB_URI=mongodb://127.0.0.1:27017/?replicaSet=rs0 lua5.4 examples/trade.lua [TRADES]
--
-- (`tools/with-standin lua5.4 examples/trade.lua` runs it on a fresh
-- stand-in.)  Several worker coroutines of a cqueues loop trade a sword back
-- and forth between two players; one trade is refused (not enough gold);
-- one holder loses its lock in the middle of a trade (another client takes
-- it over) and that trade commits nothing.  At the end the gold adds up to
-- what it was, the sword has exactly one owner and every trade made has
-- its record.  Players live in the URI's database (else "mongolock"),
-- collection "trade_players", the records in "trade_log".

local mongolock = require "mongolock"
local cqueues = require "cqueues"

local URI = os.getenv("MONGODB_URI") or "mongodb://127.0.0.1:27017/"
local TRADES = tonumber(arg[1]) or 20
local COLL = "trade_players"
local LOG = "trade_log"
local LOCK = "trading-post"

local client = assert(mongolock.connect(URI, { scheduler = "cqueues", appname = "trade" }))
local db = client:default_database()
local locks = client:locks({ ttl = 10 })

-- a fresh world (outside the loop: these calls block, as without a scheduler)
assert(client:command(db, { delete = COLL }, { deletes = { { q = {}, limit = 0 } } }))
assert(client:command(db, { delete = LOG }, { deletes = { { q = {}, limit = 0 } } }))
assert(client:command(db, { insert = COLL }, { documents = {
  { _id = "ann", gold = 100, items = { "sword" } },
  { _id = "bob", gold = 100, items = mongolock.array({}) },
} }))

-- buyer pays seller price for item, in the transaction of the held lock h:
-- true | nil, "not enough gold" | nil, "lost" | nil, err
local function trade(h, buyer, seller, item, price, meanwhile)
  return h:transaction(function(tx)
    local players = tx:collection(COLL)
    local b = players:find({ _id = buyer })[1]
    local s = players:find({ _id = seller, items = item })[1]
    if not s then return nil, seller .. " has no " .. item end
    if b.gold < price then return nil, "not enough gold" end
    assert(players:update({ _id = buyer }, { ["$inc"] = { gold = -price }, ["$push"] = { items = item } }))
    assert(players:update({ _id = seller }, { ["$inc"] = { gold = price }, ["$pull"] = { items = item } }))
    assert(tx:collection(LOG):insert({ buyer = buyer, seller = seller, item = item, price = price }))
    if meanwhile then meanwhile() end
    return true
  end)
end

local loop = cqueues.new()
local done, refused = 0, 0
for w = 1, 4 do
  loop:wrap(function()
    for i = w, TRADES, 4 do
      local h = assert(locks:acquire(LOCK, { timeout = 30 }))
      -- who has the sword now sells it to the other
      local r = assert(client:command(db, { find = COLL }, { filter = { items = "sword" } }))
      local seller = r.cursor.firstBatch[1]._id
      local buyer = seller == "ann" and "bob" or "ann"
      local ok, err = trade(h, buyer, seller, "sword", i % 7 == 0 and 1000 or 10)
      if ok then done = done + 1
      elseif err == "not enough gold" then refused = refused + 1
      else error("trade: " .. tostring(err)) end
      assert(h:release())
    end
  end)
end
assert(loop:loop())

-- a holder that loses the lock in the middle of a trade: another client
-- force-releases it and takes it before the commit; nothing is written
local other = assert(mongolock.connect(URI, { appname = "trade-other" }))
local h = assert(locks:acquire(LOCK))
local before = assert(client:command(db, { find = COLL }, { sort = { _id = 1 } })).cursor.firstBatch
local owner = before[1].items[1] == "sword" and "ann" or "bob"
local ok, err = trade(h, owner == "ann" and "bob" or "ann", owner, "sword", 10, function()
  local theirs = other:locks({ ttl = 10 })
  assert(theirs:force_release(LOCK))
  assert(theirs:acquire(LOCK)):release()
end)
assert(ok == nil and err == "lost", "a trade under a lost lock answered " .. tostring(ok) .. ", " .. tostring(err))
local after = assert(client:command(db, { find = COLL }, { sort = { _id = 1 } })).cursor.firstBatch
h:close()
other:close()

-- the books balance: no trade was half made
local gold, swords = 0, 0
for k, p in ipairs(after) do
  gold = gold + p.gold
  for _, it in ipairs(p.items) do if it == "sword" then swords = swords + 1 end end
  assert(p.gold == before[k].gold, "the lost trade changed " .. p._id)
end
local logged = assert(client:command(db, { count = LOG }, {})).n
print(("trades: %d made, %d refused (not enough gold), 1 under a lost lock: nothing written"):format(done, refused))
print(("gold: %d (was 200), swords: %d, trade records: %d"):format(gold, swords, logged))
assert(gold == 200 and swords == 1 and logged == done and done + refused == TRADES, "the books do not balance")
client:close()
print("ok")
