-- The flagship demo: several worker processes increment one counter
-- document by read, sleep, write -- first under a mongolock lock, then
-- without one -- and the final counts are compared with the expected one.
--
--   MONGODB_URI=mongodb://127.0.0.1:27017/?replicaSet=rs0 lua5.4 examples/counter.lua [WORKERS [INCREMENTS]]
--
-- (`make run` starts the stand-in and sets MONGODB_URI.)  Workers are
-- separate OS processes running this same script in worker mode.  The
-- counter lives in the URI's database (else "mongolock"), collection
-- "counter_demo"; the lock is "counter-demo" in the same database.

local mongolock = require "mongolock"

local URI = os.getenv("MONGODB_URI") or "mongodb://127.0.0.1:27017/"
local COLL = "counter_demo"
local LOCK = "counter-demo"
local SLEEP = 0.002          -- between the read and the write: the race window

local function die(msg)
  io.stderr:write("counter: ", tostring(msg), "\n")
  os.exit(1)
end

-- the counter n of document id: a number (nil when there is none) | nil, err
local function get(client, db, id)
  local r, err = client:command(db, { find = COLL }, { filter = { _id = id }, limit = 1, singleBatch = true })
  if not r then return nil, err end
  local doc = r.cursor.firstBatch[1]
  return doc and doc.n
end

-- sets the counter n of document id (creating it): true | nil, err
local function set(client, db, id, n)
  local r, err = client:command(db, { update = COLL },
    { updates = { { q = { _id = id }, u = { ["$set"] = { n = n } }, upsert = true } } })
  if not r then return nil, err end
  return true
end

local function connect(app)
  -- give up on an unreachable server after 5 s, unless the URI says otherwise
  local sst = not URI:lower():find("serverselectiontimeoutms", 1, true) and 5 or nil
  local client, err = mongolock.connect(URI, { appname = app, server_selection_timeout = sst })
  if not client then die(err) end
  return client
end

-- ---- worker mode: counter.lua --worker locked|unlocked ID N -------------

local function worker(mode, id, n)
  local client = connect("counter-worker")
  local db = client:default_database()
  local locks = client:locks({ collection = "counter_demo_locks", ttl = 10 })
  for _ = 1, n do
    local h, err
    if mode == "locked" then
      h, err = locks:acquire(LOCK, { timeout = 120 })
      if not h then die("acquire: " .. tostring(err)) end
    end
    local v, rerr = get(client, db, id)
    if v == nil and rerr then die(rerr) end
    mongolock.sleep(SLEEP)
    local ok, werr = set(client, db, id, (v or 0) + 1)
    if not ok then die(werr) end
    if h then
      ok, err = h:release()
      -- a lease that ended before the write would be a lost exclusion
      if not ok then die("release: " .. tostring(err)) end
    end
  end
  client:close()
end

if arg[1] == "--worker" then
  worker(arg[2], arg[3], tonumber(arg[4]))
  return
end

-- ---- the demo -----------------------------------------------------------

local WORKERS = tonumber(arg[1]) or 5
local N = tonumber(arg[2]) or 40
local EXPECTED = WORKERS * N

-- the interpreter running this script, for the workers
local interp = "lua5.4"
do
  local i = -1
  while arg[i - 1] do i = i - 1 end
  if arg[i] then interp = arg[i] end
end
local script = arg[0]

local function q(s) return "'" .. tostring(s):gsub("'", [['\'']]) .. "'" end

-- starts a worker; returns the path of the file its exit status lands in
local function spawn(mode, id)
  local done = os.tmpname()
  os.remove(done)
  local cmd = ("( %s %s --worker %s %s %d; echo $? >%s ) </dev/null >/dev/null 2>%s &"):format(
    q(interp), q(script), mode, q(id), N, q(done), q(done .. ".err"))
  if not os.execute(cmd) then die("cannot start a worker") end
  return done
end

local function read(path)
  local f = io.open(path, "r")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local client = connect("counter-demo")
local db = client:default_database()
-- a live progress line only on a terminal (test -t 1: stdout is one);
-- else one line per change.  os.execute answers true (5.4) or 0 (LuaJIT).
local is_term = os.execute("test -t 1")
local tty = (is_term == true or is_term == 0) and os.getenv("TERM") ~= nil and os.getenv("TERM") ~= "dumb"

local function run(mode, label)
  -- one counter document per run (a table's address tells runs of the same second apart)
  local id = ("%s-%d-%s"):format(mode, os.time(), tostring({}):match("%x+$"))
  local ok, err = set(client, db, id, 0)
  if not ok then die(err) end
  local t0 = mongolock.monotonic()
  local dones = {}
  for i = 1, WORKERS do dones[i] = spawn(mode, id) end
  local last = ""
  while true do
    local finished, failed = 0, 0
    for _, d in ipairs(dones) do
      local st = read(d)
      if st then
        finished = finished + 1
        if tonumber(st) ~= 0 then failed = failed + 1 end
      end
    end
    local v = get(client, db, id) or 0
    local line = ("%-16s counter %4d   workers done %d/%d   %5.1f s"):format(
      label, v, finished, WORKERS, mongolock.monotonic() - t0)
    if tty then
      io.stdout:write("\r", line)
    elseif line:sub(1, 30) ~= last:sub(1, 30) or finished == WORKERS then
      io.stdout:write(line, "\n")
    end
    io.stdout:flush()
    last = line
    if finished == WORKERS then
      if tty then io.stdout:write("\n") end
      for _, d in ipairs(dones) do
        local e = read(d .. ".err")
        if failed > 0 and e and e ~= "" then io.stderr:write(e) end
        os.remove(d)
        os.remove(d .. ".err")
      end
      if failed > 0 then die(("%d %s worker(s) failed"):format(failed, mode)) end
      return v, mongolock.monotonic() - t0
    end
    mongolock.sleep(0.1)
  end
end

print(("%d worker processes, %d increments each (read, sleep %g s, write); expected count %d")
  :format(WORKERS, N, SLEEP, EXPECTED))
-- (the URI without its password)
print(("server: %s   database: %s"):format((URI:gsub("^(%a[%w+.-]*://[^:/@]*):[^/@]*@", "%1:***@")), db))
local locked, tl = run("locked", "with the lock")
local unlocked, tu = run("unlocked", "without a lock")
print()
print(("with the lock:  %4d of %d  (%s)  %.1f s"):format(locked, EXPECTED,
  locked == EXPECTED and "no update lost" or (EXPECTED - locked) .. " updates LOST", tl))
print(("without a lock: %4d of %d  (%s)  %.1f s"):format(unlocked, EXPECTED,
  unlocked == EXPECTED and "no update lost this time: the race is timing-dependent"
  or (EXPECTED - unlocked) .. " updates lost", tu))
client:close()
if locked ~= EXPECTED then os.exit(1) end
