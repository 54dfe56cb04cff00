-- Handlers of examples/nginx/nginx.conf: a read-modify-write of a counter
-- document in MongoDB, shared by every worker of every host, guarded by a
-- mongolock lock.  Between the read and the write the handler yields
-- (ngx.sleep), as any handler doing more I/O would: without the lock,
-- requests interleave there and updates are lost.
--
-- The write is fenced: it carries the lock's token and applies only if the
-- document has seen no larger one, so a holder whose lease ran out (a long
-- pause, a lost network) cannot overwrite the work of the holder after it.

-- luacheck: read globals ngx
local mongolock = require "mongolock"
local resty_mongolock = require "resty.mongolock"

local ngx = ngx

local _M = {}

local URI = os.getenv("MONGODB_URI")
local DB, COLL = "mongolock_example", "counters"

-- one options table for every request; the lock's client is made once per
-- worker, on the first request
local lock_opts = {
  uri = URI,
  collection = "nginx_locks",
  exptime = 10,      -- a worker that dies holding the lock frees it in 10 s
  timeout = 60,      -- waits up to a minute for the lock
}

-- the worker's client for the counter documents (made after fork, on the
-- first request); each command blocks the worker for one round trip
local data, data_pid
local function client()
  local pid = ngx.worker.pid()
  if not data or data_pid ~= pid then
    data = assert(mongolock.connect(URI, { appname = "nginx-example" }))
    data_pid = pid
  end
  return data
end

local function read(key)
  local r, err = client():command(DB, { find = COLL },
    { filter = { _id = key }, limit = 1, singleBatch = true })
  if not r then return nil, err end
  local doc = r.cursor.firstBatch[1]
  return doc and doc.n or 0
end

-- writes n as the counter of key: through the fenced object f of the lock
-- held (h:fenced: the write applies only while no holder with a newer token
-- wrote the document, on a new document too), or unguarded (f nil)
local function write(key, n, f)
  if f then
    local ok, err, info = f:update({ _id = key }, { ["$set"] = { n = n } }, { upsert = true })
    if err == "fenced" then
      return nil, "fenced off: a holder with the newer token " .. tostring(info.token) .. " wrote first"
    end
    return ok, err
  end
  local r, err = client():command(DB, { update = COLL },
    { updates = { { q = { _id = key }, u = { ["$set"] = { n = n } }, upsert = true } } })
  if not r then return nil, err end
  return true
end

local function add_one(key, f)
  local n, err = read(key)
  if not n then return nil, err end
  ngx.sleep(0.001)                     -- the window where updates get lost
  local ok, werr = write(key, n + 1, f)
  if not ok then return nil, werr end
  return n + 1
end

-- the guarded read-modify-write of counter document key under the lock
-- lock_name ("counter"): n, seconds waited for the lock | nil, message, HTTP
-- status.  opts: lock options replacing the example's (the specs use a
-- short timeout).
function _M.guarded_add(key, opts, lock_name)
  local o = lock_opts
  if opts then
    o = {}
    for k, v in pairs(lock_opts) do o[k] = v end
    for k, v in pairs(opts) do o[k] = v end
  end
  local lock, err = resty_mongolock:new(o)
  if not lock then return nil, "mongolock: " .. tostring(err), 500 end
  lock_name = lock_name or "counter"
  local elapsed, lerr = lock:lock(lock_name)
  if not elapsed then return nil, "lock " .. lock_name .. ": " .. tostring(lerr), 503 end
  -- the counter's writes carry the lock's fencing token (field "token")
  local f = assert(lock:fenced(COLL, { database = DB, field = "token" }))
  local n, serr = add_one(key, f)
  local ok, uerr = lock:unlock()
  if not n then return nil, "counter: " .. tostring(serr), 500 end
  if not ok then
    -- the lease ended before the release: the fenced write still was ours
    ngx.log(ngx.WARN, "unlock counter: ", uerr)
  end
  return n, elapsed
end

function _M.incr(opts)
  local n, elapsed, status = _M.guarded_add("guarded", opts)
  if not n then
    ngx.log(ngx.ERR, elapsed)
    return ngx.exit(status)
  end
  ngx.say(n, " ", elapsed)
end

function _M.incr_unguarded()
  local n, err = add_one("unguarded")
  if not n then
    ngx.log(ngx.ERR, "counter: ", err)
    return ngx.exit(500)
  end
  ngx.say(n)
end

function _M.count()
  local g, err = read("guarded")
  local u, err2 = read("unguarded")
  if not g or not u then
    ngx.log(ngx.ERR, "count: ", tostring(err or err2))
    return ngx.exit(500)
  end
  ngx.say(g, " ", u)
end

-- both counters back to 0; the token stays (0 on a new document): tokens
-- only grow, and the next holder's is larger
function _M.reset()
  for _, key in ipairs({ "guarded", "unguarded" }) do
    local r, err = client():command(DB, { update = COLL },
      { updates = { { q = { _id = key }, u = { ["$set"] = { n = 0 }, ["$max"] = { token = 0 } },
                      upsert = true } } })
    if not r then
      ngx.log(ngx.ERR, "reset: ", err)
      return ngx.exit(500)
    end
  end
  ngx.say("0 0")
end

return _M
