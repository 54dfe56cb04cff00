-- The child process of spec/lost_push_spec.lua: connects, then follows its
-- mode on NAME in helpers.database.COLL.  Every line it prints starts with
-- a word; times are CLOCK_MONOTONIC (system-wide, so they compare with the
-- parent's).
--   hold NAME TTL   acquire with ttl TTL (renewed), print "held PID T";
--                   then look every 10 ms: "onlost T" when client:on_lost's
--                   callback runs (client:poll()), "lost T" when h:lost()
--                   turns true, and exit once both were printed
--   lead NAME TTL   campaign with ttl TTL, print "leading PID T"; then
--                   leader:check() every 10 ms; at the first false print
--                   "notleader T LAST", LAST the time of the last check
--                   that answered true, and exit
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, mode, name, ttl = ...
ttl = tonumber(ttl)
local client = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "lost-push-child" }))
local pid = core.getpid()
local function say(...)
  io.stdout:write(table.concat({ ... }, " "), "\n")
  io.stdout:flush()
end
local function now() return string.format("%.6f", core.monotonic()) end
local stop = core.monotonic() + 60

if mode == "hold" then
  local locks = client:locks({ database = db, collection = coll })
  local onlost = false
  client:on_lost(function()
    if not onlost then say("onlost", now()) end
    onlost = true
  end)
  local h = assert(locks:acquire(name, { ttl = ttl }))
  say("held", pid, now())
  local lost = false
  while core.monotonic() < stop and not (lost and onlost) do
    client:poll()
    if not lost and h:lost() then
      lost = true
      say("lost", now())
    end
    core.sleep(0.01)
  end
elseif mode == "lead" then
  local el = client:elections({ database = db, collection = coll })
  local leader = assert(el:campaign(name, "child", { ttl = ttl, timeout = 10 }))
  say("leading", pid, now())
  local last = core.monotonic()
  while core.monotonic() < stop do
    if leader:check() then
      last = core.monotonic()
    else
      say("notleader", now(), string.format("%.6f", last))
      break
    end
    core.sleep(0.01)
  end
end
client:close()
