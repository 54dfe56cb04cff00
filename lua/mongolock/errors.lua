-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.errors: which failures are transient (the server or the network
-- will be back) and which are permanent, by MongoDB's and libmongoc's
-- codes; the error of an acquire that found no server.

local type = type
local pairs = pairs

local _M = {}

-- What a replica set answers while it elects a primary or shuts one down
-- (the retryable-writes specification's retryable codes: HostUnreachable,
-- HostNotFound, NetworkTimeout, ShutdownInProgress, PrimarySteppedDown,
-- ExceededTimeLimit, SocketException, NotWritablePrimary,
-- InterruptedAtShutdown, InterruptedDueToReplStateChange,
-- NotPrimaryNoSecondaryOk, NotPrimaryOrSecondary), and libmongoc's
-- server selection failure (MONGOC_ERROR_SERVER_SELECTION_FAILURE: no
-- writable primary known within the server timeout)
local TRANSIENT_CODES = {
  [6] = true, [7] = true, [89] = true, [91] = true, [189] = true, [262] = true, [9001] = true,
  [10107] = true, [11600] = true, [11602] = true, [13435] = true, [13436] = true,
  [13053] = true,
}
_M.TRANSIENT_CODES = TRANSIENT_CODES

-- error labels a server puts on errors that a retry may overcome
local TRANSIENT_LABELS = { RetryableWriteError = true, ResumableChangeStreamError = true }

-- true when (code, message) is libmongoc's network error: no connection,
-- or no reply (MONGOC_ERROR_STREAM: 3 name resolution, 4 socket, 5 connect,
-- 6 not established).  A write whose reply is lost may have been applied.
function _M.network_error(code, message)
  if code ~= 3 and code ~= 4 and code ~= 5 and code ~= 6 then return false end
  if type(message) ~= "string" then return false end
  return (message:find("socket", 1, true) or message:find("connect", 1, true)
    or message:find("stream", 1, true) or message:find("Failed to", 1, true)) ~= nil
end

-- The one place that tells a transient failure (the server or the network
-- will be back: an election, a stepdown, a shutdown, a closed socket, no
-- server found) from a permanent one (a bad name, authorization, a
-- permit mismatch, a duplicate key, ...).  labels: the reply's
-- errorLabels when known (a list of strings), else nil.
function _M.transient(code, message, labels)
  if type(labels) == "table" then
    for _, l in pairs(labels) do
      if TRANSIENT_LABELS[l] then return true end
    end
  end
  if type(code) ~= "number" then return false end
  if TRANSIENT_CODES[code] then return true end
  return _M.network_error(code, message)
end

-- the error of an acquire that found no server before its deadline, as
-- libmongoc words a failed server selection (MONGOC_ERROR_SERVER_SELECTION_FAILURE)
_M.NO_SERVER = "No suitable servers found: no server that takes writes was reachable "
  .. "before the timeout"
_M.NO_SERVER_CODE = 13053

return _M
