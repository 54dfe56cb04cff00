-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.ngx.thread: the side of mongolock.ngx that runs in nginx's
-- worker threads (ngx.run_worker_thread).  Each thread VM keeps its own
-- clients, one per spec (jobs.spec), made on first use: a thread VM
-- exists only in a worker, so a client is never made before nginx forks.
--
-- A call runs one op through the client's libmongoc pool (the client's
-- write concern, retryable writes, everything the URI asks for) and returns
-- the reply as a BSON string: reply | nil, message, code, reply.

local mongolock = require "mongolock"

local _M = {}

local clients = {}

local function client_for(spec)
  local c = clients[spec.key]
  if c and not c:closed() then return c end
  local err
  c, err = mongolock.connect(spec.uri, spec.opts)
  if not c then return nil, err end
  clients[spec.key] = c
  return c
end

function _M.run(spec, op)
  local c, err = client_for(spec)
  if not c then return nil, err end
  return c._core:run(op)
end

return _M
