-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.bridge: an op of a bridged pool (core.pool(client, 0,
-- "bridged"): csrc/driver/fiber_stream.h) run by an event loop that moves
-- its bytes with sockets of its own.  The op runs on a fiber in the loop's
-- thread; where the driver would connect, send or receive, the fiber asks
-- the loop (here:step), and the loop answers when done.  nginx's cosockets
-- are such a loop (mongolock.ngx).
--
--   ok, <outcome> = bridge.run(pool, op, io)      (or false: see below;
--                   op as pool:here takes it: an envelope or an attempt)
--
-- io, the loop's sockets (seconds: the time the driver gives the exchange):
--   io.open(id, host, port, used, seconds) -> sock | nil, why
--                         the socket of connection id: a new one connected
--                         to host:port, or (used) the one the loop kept for
--                         it (nil when it has none: the server closed it)
--   io.send(sock, bytes, seconds) -> true | nil, why ("timeout": timed out)
--   io.recv(sock, max, seconds) -> 1..max bytes | nil, why
--   io.keep(id, sock)     the op ended: sock waits for the next op on id
--   io.drop(sock)         its exchange failed: closed
--   io.dead(ids)          (optional) connections the driver destroyed: the
--                         sockets kept for them are to be closed (pool:dead()
--                         answers nil while there are none: nothing made per op)
--
-- Invariants:
-- - false: the op did not run (pool:here could not run it) or did not
--   apply (nothing of it was sent, or a server refused it as no primary):
--   the caller sends it another way (a worker thread).
-- - An op's sockets are kept (io.keep) in the same step that gave its
--   connections back to the pool, before any other op can take them.

local pairs = pairs

local _M = { _VERSION = "0.1.0" }

local FOREVER = 86400

function _M.run(pool, op, io)
  local h = pool:here(op)
  if not h then return false end
  local socks = {}
  local a, kind, id, host, port, arg, secs, used = h:step()
  while a == false and kind do
    secs = secs or FOREVER
    local s, err, res = socks[id], nil, nil
    if not s then
      s, err = io.open(id, host, port, used and kind ~= "connect", secs)
      socks[id] = s
    end
    if s then
      if kind == "connect" then res = true
      elseif kind == "send" then res, err = io.send(s, arg, secs)
      else res, err = io.recv(s, arg, secs) end
      if not res then
        io.drop(s)
        socks[id] = nil
      end
    end
    a, kind, id, host, port, arg, secs, used = h:step(res or false, err)
  end
  for sid, s in pairs(socks) do io.keep(sid, s) end
  local ids = io.dead and pool:dead()
  if ids then io.dead(ids) end
  if a == false then return false end
  return true, a, kind, id, host, port
end

return _M
