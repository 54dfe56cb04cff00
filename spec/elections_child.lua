-- The child process of spec/elections_spec.lua: connects, then follows its
-- mode on the election NAME of helpers.database.COLL.  Every line it prints
-- starts with a word, then its pid; times are CLOCK_MONOTONIC (system-wide,
-- so they compare with the parent's).
--   lead NAME VALUE TTL HOLD   campaign (waiting up to 30 s), print
--                              "leading PID TOKEN T", lead for HOLD seconds
--                              (printing "lost PID" and stopping if the lead
--                              is lost), print "resigning PID T", resign,
--                              print "resigned PID T"
--   script NAME TTL GAP        a scripted term of office: campaign "v1",
--                              proclaim "v2", resign, campaign "v3", resign,
--                              GAP seconds apart; prints "at PID WHAT T
--                              TOKEN" after each step
--   later NAME AT GAP          at CLOCK_MONOTONIC time AT: campaign "A",
--                              print "leading PID TOKEN T"; GAP seconds
--                              later proclaim "A2", print "proclaimed PID
--                              T"; lead 5 s more, then resign
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, mode, name, a, b, c = ...
local client = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "child" }))
local el = client:elections({ database = db, collection = coll })
local pid = core.getpid()
local function say(...)
  io.stdout:write(table.concat({ ... }, " "), "\n")
  io.stdout:flush()
end
local function now() return string.format("%.6f", core.monotonic()) end

if mode == "lead" then
  local value, ttl, hold = a, tonumber(b), tonumber(c)
  local leader = assert(el:campaign(name, value, { ttl = ttl, timeout = 30 }))
  say("leading", pid, leader:token_string(), now())
  local stop = core.monotonic() + hold
  while core.monotonic() < stop do
    if leader:lost() then
      say("lost", pid, now())
      os.exit(0)
    end
    core.sleep(0.02)
  end
  -- the last moment it acts as the leader, then the resign
  say("resigning", pid, now())
  assert(leader:resign())
  say("resigned", pid, now())
elseif mode == "script" then
  local ttl, gap = tonumber(a), tonumber(b)
  local l1 = assert(el:campaign(name, "v1", { ttl = ttl, timeout = 10 }))
  say("at", pid, "lead-v1", now(), l1:token_string())
  core.sleep(gap)
  assert(l1:proclaim("v2"))
  say("at", pid, "value-v2", now(), l1:token_string())
  core.sleep(gap)
  assert(l1:resign())
  say("at", pid, "none", now(), "0")
  core.sleep(gap)
  local l2 = assert(el:campaign(name, "v3", { ttl = ttl, timeout = 10 }))
  say("at", pid, "lead-v3", now(), l2:token_string())
  core.sleep(gap)
  assert(l2:resign())
  say("at", pid, "none", now(), "0")
elseif mode == "later" then
  local at, gap = tonumber(a), tonumber(b)
  core.sleep(math.max(0, at - core.monotonic()))
  local leader = assert(el:campaign(name, "A", { ttl = 5, timeout = 10 }))
  say("leading", pid, leader:token_string(), now())
  core.sleep(gap)
  assert(leader:proclaim("A2"))
  say("proclaimed", pid, now())
  core.sleep(5)
  assert(leader:resign())
end
client:close()
