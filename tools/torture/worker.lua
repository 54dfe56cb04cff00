-- One torture worker: loops acquire / log / hold / release on one shared
-- lock until the stop file appears (or it is killed).
--
--   worker.lua LOG NAME TTL HOLD_MS STOPFILE [LONG_PERMILLE]    (MONGODB_URI set)
--
-- Appends to LOG (O_APPEND, one write(2) per line, so lines from many
-- processes never interleave):
--   M token mode                          the kind of what was acquired: x an
--                                         exclusive lock, w a writer, s a
--                                         reader's share, p a permit
--   A token start pid                     acquired (start: CLOCK_MONOTONIC, s)
--   S token start end pid valid           the critical section ended; valid
--                                         is 1 when h:remaining() > 0 after
--                                         `end` (the lease still covered it)
--   R token pid ok|lost|error             the release's answer (a
--                                         leader's resign)
--   P token pid ok|lost|error             a leader's proclaim
-- With TORTURE_KIND=election a worker campaigns, and while it leads acts
-- one to four times (an S line each, after h:check() says it still
-- leads), proclaiming a new value between two acts, then resigns.
--   E pid message                         acquire failed (not a timeout)
--   W token pid ok|fenced|lost|error      TORTURE_FENCED=1 (TORTURE_TXN=1: the
--                                         guarded transaction): the fenced write
--                                         that ends each section (h:fenced:
--                                         the token pushed to the list of
--                                         mongolock_torture.fenced's document
--                                         of the lock) and its answer
-- CLOCK_MONOTONIC is system-wide, so times from every worker compare; run
-- under faketime only with FAKETIME_DONT_FAKE_MONOTONIC=1.
-- Now and then (LONG_PERMILLE per mille, default 10) a section holds past
-- its ttl on purpose: such a section is invalid and may be overlapped.

local mongolock = require "mongolock"
local core = require "mongolock.core"

local logpath, name, ttl, hold_ms, stopfile, long_pm =
  arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4]), arg[5], tonumber(arg[6] or 10)
assert(logpath and name and ttl and hold_ms and stopfile,
  "usage: worker.lua LOG NAME TTL HOLD_MS STOPFILE [LONG_PERMILLE]")
local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local LIE = os.getenv("TORTURE_LIE") == "1"
-- TORTURE_KIND: exclusive (default), semaphore (TORTURE_PERMITS permits),
-- rw (one writer in four) or election
local KIND = os.getenv("TORTURE_KIND") or "exclusive"
local PERMITS = tonumber(os.getenv("TORTURE_PERMITS") or "3")
local FENCED = os.getenv("TORTURE_FENCED") == "1"
-- TORTURE_TXN=1 (exclusive): each section is a guarded transaction
-- (h:transaction) moving one unit between two of the lock's four accounts
-- in mongolock_torture.accounts, its work (the hold) between the two
-- writes, its token pushed to the lock's ledger document
local TXN = os.getenv("TORTURE_TXN") == "1"

local monotonic, sleep, random = core.monotonic, core.sleep, math.random
local pid = core.getpid()
math.randomseed(pid * 7919 + math.floor(monotonic() * 1000) % 100000)

local log = assert(io.open(logpath, "a"))
log:setvbuf("full", 4096)
local function emit(fmt, ...)
  log:write(string.format(fmt, ...))
  log:flush()
end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() end
  return f ~= nil
end

local client = assert(mongolock.connect(uri, { appname = "torture" }))
-- queue_ttl: a waiter whose acquire failed under a fault (and whose leave
-- failed too) holds the line for at most 1.5 x queue_ttl; at ttl / 2 that
-- stays inside the takeover slack the checker allows (--retry)
local locks = client:locks { database = "mongolock_torture", collection = "locks", ttl = ttl,
                             timeout = 10 * ttl, queue_ttl = ttl / 2 }
local kopts = { database = "mongolock_torture", collection = "locks", ttl = ttl,
                timeout = 10 * ttl, queue_ttl = ttl / 2, permits = PERMITS }
local rw = KIND == "rw" and client:rwlocks { database = kopts.database,
  collection = kopts.collection, ttl = ttl, timeout = 10 * ttl, queue_ttl = ttl / 2 }
local sems = KIND == "semaphore" and client:semaphores(kopts)
local el = KIND == "election" and client:elections { database = kopts.database,
  collection = kopts.collection, ttl = ttl, timeout = 10 * ttl, queue_ttl = ttl / 2 }
-- every other worker has its leases renewed by the lease engine (one
-- batched update per renewal period): its long sections stay valid, and
-- the harness's kills and update faults hit its renewals
local RENEW = pid % 2 == 0
local function take()
  if sems then return "p", sems:acquire(name, { renew = RENEW }) end
  if el then return "l", el:campaign(name, tostring(pid), { renew = RENEW }) end
  if rw then
    if random(4) == 1 then return "w", rw:write(name, { renew = RENEW }) end
    return "s", rw:read(name, { renew = RENEW })
  end
  return "x", locks:acquire(name, { renew = RENEW })
end
if RENEW then emit("N %d\n", pid) end
io.stdout:write("ready ", pid, "\n")
io.stdout:flush()

while not exists(stopfile) do
  local mode, h, err = take()
  if h then
    local token = h.token
    local start = monotonic()
    emit("M %d %s\n", token, mode)
    emit("A %d %.6f %d\n", token, start, pid)
    -- one critical section (a leader's act): logged with its validity
    -- a guarded transaction that holds for `hold` between its two writes:
    -- ok | lost | error
    local function transfer(hold)
      local a = random(4)
      local b = a % 4 + random(3)
      if b > 4 then b = b - 4 end
      local ok, terr = h:transaction(function(tx)
        local acc = tx:collection("accounts", { database = "mongolock_torture" })
        local r, e, c = acc:update({ _id = name .. ":" .. a }, { ["$inc"] = { units = -1 } })
        if not r then return nil, e, c end
        sleep(hold)
        r, e, c = acc:update({ _id = name .. ":" .. b }, { ["$inc"] = { units = 1 } })
        if not r then return nil, e, c end
        r, e, c = acc:update({ _id = name .. ":ledger" }, { ["$push"] = { h = token } }, { upsert = true })
        if not r then return nil, e, c end
        return true
      end)
      if ok then return "ok" end
      if terr == "lost" or terr == "not held" then return "lost" end
      emit("E %d transaction: %s\n", pid, tostring(terr):gsub("%s+", " "))
      return "error"
    end
    local function section(from)
      local hold = random() * hold_ms / 1000
      if random(1000) <= long_pm then hold = ttl + 0.2 + random() * 0.3 end
      local moved
      if TXN then moved = transfer(hold) else sleep(hold) end
      local stop = monotonic()
      local rem = h:remaining()
      -- LIE: the harness's --lie, a negative control: every section claims a
      -- valid lease, so sections held past their ttl must show as overlaps
      local valid = LIE or (rem and rem > 0)
      emit("S %d %.6f %.6f %d %d\n", token, from, stop, pid, valid and 1 or 0)
      if moved then emit("W %d %d %s\n", token, pid, moved) end
      -- the section's write, fenced: a frozen holder's lands only while no
      -- newer token wrote the document
      if FENCED then
        local f = h:fenced("fenced", { database = "mongolock_torture" })
        -- odd pids write blind (their fenced object skips the handle's own
        -- check, as a write already on its way when the holder froze): the
        -- server's fence alone must refuse what comes too late
        if pid % 2 == 1 then f.check = function() return true end end
        local n, ferr = f:update({ _id = name }, { ["$push"] = { h = token } }, { upsert = true })
        emit("W %d %d %s\n", token, pid, n == 1 and "ok"
          or ((ferr == "fenced" or ferr == "lost" or ferr == "not held") and ferr:gsub(" ", "-") or "error"))
      end
    end
    if mode == "l" then
      -- a leader acts only while it knows it leads (LIE: whatever it knows)
      for k = 1, random(4) do
        if not LIE and not h:check() then break end
        if k > 1 then
          local pok, perr = h:proclaim(pid .. "-" .. k)
          emit("P %d %d %s\n", token, pid, pok and "ok"
            or ((perr == "lost" or perr == "not held") and "lost" or "error"))
        end
        section(monotonic())
      end
    else
      section(start)
    end
    local ok, rerr = h:release()
    emit("R %d %d %s\n", token, pid, ok and "ok" or (rerr == "not held" and "lost" or "error"))
  elseif err ~= "timeout" then
    emit("E %d %s\n", pid, tostring(err):gsub("%s+", " "))
    sleep(0.01)
  end
end
client:close()
