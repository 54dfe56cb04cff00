-- The child process of spec/semaphore_spec.lua and spec/rwlock_spec.lua:
-- connects, then follows its mode on a reader-writer lock or a semaphore.
--   hold KIND NAME TTL N        take (read | write | permit of N), print
--                               "held PID TOKEN", sleep until killed
--   loop KIND NAME COUNT FILE N COUNT times: take, append "B kind pid token"
--                               and "E kind pid" to FILE around a short
--                               section, release
--   wait KIND NAME TIMEOUT N    print "waiting PID", take waiting up to
--                               TIMEOUT (woken by the change stream;
--                               queue_ttl $QUEUE_TTL, else 30), print "held
--                               PID TOKEN" and release after a moment
--   count KIND NAME TIMEOUT N   as wait, but counts its early wake-ups (a
--                               wait step that ends more than a second
--                               before its deadline) and keeps what it
--                               takes: prints "held PID TOKEN WAKES" and
--                               sleeps until killed, or "timeout WAKES"
--   multi set X,Y COUNT ORDER   COUNT times: the exclusive lock X and a
--                               permit of Y as one set (acquire_all), listed
--                               in ORDER ("fwd" or "rev")
--   docset set X,Y COUNT ORDER  COUNT times: the documents X and Y (with a
--                               number n) as one set in ORDER, one unit of n
--                               moved from X to Y by the set's release
--   readers read NAME SECONDS   overlapping readers for SECONDS: a new share
--                               is taken before the previous one is released;
--                               stops at the first share refused
local mongolock = require "mongolock"
local core = require "mongolock.core"
local db, coll, mode, kind, name, a, b, n = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "child" }))
local rw = c:rwlocks({ database = db, collection = coll })
local sem = c:semaphores({ database = db, collection = coll, permits = tonumber(n) or 1 })
local function say(...)
  io.stdout:write(table.concat({ ... }, " "), "\n")
  io.stdout:flush()
end
local function take(opts)
  if kind == "read" then return rw:read(name, opts) end
  if kind == "write" then return rw:write(name, opts) end
  return sem:acquire(name, opts)
end
if mode == "hold" then
  local h = assert(take({ ttl = tonumber(a), timeout = 10 }))
  say("held", core.getpid(), h:token_string())
  core.sleep(120)
elseif mode == "loop" then
  local f = assert(io.open(b, "a"))
  f:setvbuf("no")
  say("ready", core.getpid())
  for _ = 1, tonumber(a) do
    local h = assert(take({ ttl = 10, timeout = 60 }))
    f:write(string.format("B %s %d %s\n", kind, core.getpid(), h:token_string()))
    core.sleep(0.003)
    f:write(string.format("E %s %d\n", kind, core.getpid()))
    assert(h:release())
  end
  f:close()
  say("done")
elseif mode == "wait" then
  say("waiting", core.getpid())
  local h = assert(take({ timeout = tonumber(a), queue_ttl = tonumber(os.getenv("QUEUE_TTL")) or 30,
    wait = "watch" }))
  say("held", core.getpid(), h:token_string())
  core.sleep(0.2)
  assert(h:release())
elseif mode == "count" then
  local locks_mod = require "mongolock.locks"
  local real = locks_mod.get_wait()
  local wakes = 0
  locks_mod.set_wait({ sleep_until_retry = function(state)
    local r1, r2, r3 = real.sleep_until_retry(state)
    if core.monotonic() < state.deadline - 1 then wakes = wakes + 1 end
    return r1, r2, r3
  end })
  say("waiting", core.getpid())
  local h, err = take({ timeout = tonumber(a), queue_ttl = 60, wait = "watch" })
  if not h then
    say(tostring(err), wakes)
  else
    say("held", core.getpid(), h:token_string(), wakes)
    core.sleep(120)
  end
elseif mode == "multi" then
  -- multi set NAMES COUNT ORDER: COUNT times take the exclusive lock of the
  -- first name and a permit (N = 1) of the second, listed in ORDER ("fwd"
  -- or "rev"), as one set
  local locks = c:locks({ database = db, collection = coll })
  local x, y = name:match("^([^,]+),([^,]+)$")
  for _ = 1, tonumber(a) do
    local entries = { { locks, x }, { sem, y } }
    if b == "rev" then entries = { entries[2], entries[1] } end
    local set = assert(c:acquire_all(entries, { timeout = 20 }))
    core.sleep(0.005)
    assert(set:release())
  end
  say("done")
elseif mode == "docset" then
  -- docset set X,Y COUNT ORDER: COUNT times lock the documents X and Y of
  -- the collection (created when missing) as one set, listed in ORDER, and
  -- move one unit from one to the other with the release
  local docs = c:documents(db, coll)
  local x, y = name:match("^([^,]+),([^,]+)$")
  for _ = 1, tonumber(a) do
    local entries = { { docs, x }, { docs, y } }
    if b == "rev" then entries = { entries[2], entries[1] } end
    local set = assert(c:acquire_all(entries, { timeout = 20 }))
    local _, dx = set:get(b == "rev" and 2 or 1)
    local _, dy = set:get(b == "rev" and 1 or 2)
    core.sleep(0.005)
    local changes = {}
    changes[b == "rev" and 2 or 1] = { n = dx.n - 1 }
    changes[b == "rev" and 1 or 2] = { n = dy.n + 1 }
    assert(set:release(changes))
  end
  say("done")
elseif mode == "readers" then
  local stop = core.monotonic() + tonumber(a)
  local prev = assert(rw:read(name, { ttl = 5, timeout = 5 }))
  say("reading", core.getpid())
  local count = 1
  while core.monotonic() < stop do
    core.sleep(0.05)
    local h = rw:try_read(name, { ttl = 5 })
    if not h then break end
    count = count + 1
    assert(prev:release())
    prev = h
  end
  say("stopped", count)
  assert(prev:release())
end
