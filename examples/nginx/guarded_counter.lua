-- Handlers of examples/nginx/nginx.conf: a read-modify-write of a counter
-- shared by every worker, guarded by a mongolock lock.  Between the read and
-- the write the handler yields (ngx.sleep), as any handler doing I/O would:
-- without the lock, requests interleave there and updates are lost.

-- luacheck: read globals ngx
local mongolock = require "resty.mongolock"

local ngx = ngx
local shared = ngx.shared.counter

local _M = {}

-- one options table for every request; the client behind it is made once
-- per worker, on the first request
local lock_opts = {
  uri = os.getenv("MONGODB_URI"),
  collection = "nginx_locks",
  exptime = 10,      -- a worker that dies holding the lock frees it in 10 s
  timeout = 60,      -- waits up to a minute for the lock
}

local function add_one(key)
  local n = shared:get(key) or 0
  ngx.sleep(0.001)                     -- the window where updates get lost
  local ok, err = shared:set(key, n + 1)
  if not ok then return nil, err end
  return n + 1
end

function _M.incr()
  local lock, err = mongolock:new(lock_opts)
  if not lock then
    ngx.log(ngx.ERR, "mongolock: ", err)
    return ngx.exit(500)
  end
  local elapsed, lerr = lock:lock("counter")
  if not elapsed then
    ngx.log(ngx.ERR, "lock counter: ", lerr)
    return ngx.exit(503)
  end
  local n, serr = add_one("guarded")
  local ok, uerr = lock:unlock()
  if not n then
    ngx.log(ngx.ERR, "counter: ", serr)
    return ngx.exit(500)
  end
  if not ok then
    -- the lease ended before the write: exclusion is not guaranteed
    ngx.log(ngx.ERR, "unlock counter: ", uerr)
    return ngx.exit(500)
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
  ngx.say((shared:get("guarded") or 0), " ", (shared:get("unguarded") or 0))
end

function _M.reset()
  shared:flush_all()
  ngx.say("0 0")
end

return _M
