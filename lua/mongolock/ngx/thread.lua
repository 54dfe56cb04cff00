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
-- the reply as a BSON string: reply | nil, message, code, reply.  It names
-- the client by its spec's key alone; a VM that has no client for it yet
-- answers NEED_SPEC, and the caller calls again with the spec (once per VM
-- and spec: the spec's tables are not copied into the VM at every call).

local mongolock = require "mongolock"

local _M = {}

local clients = {}

-- the answer of a call whose VM needs the spec to make its client
_M.NEED_SPEC = "mongolock.ngx.thread: spec needed"

local function client_for(key, spec)
  local c = clients[key]
  if c and not c:closed() then return c end
  if not spec then return nil, _M.NEED_SPEC end
  local err
  c, err = mongolock.connect(spec.uri, spec.opts)
  if c then clients[key] = c end
  return c, err
end

-- run(key, op [, spec]): spec when the VM may lack the client (NEED_SPEC)
function _M.run(key, op, spec)
  local c, err = client_for(key, spec)
  if not c then return nil, err end
  return c._core:run(op)
end

return _M
