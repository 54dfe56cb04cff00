-- Internal to mongolock: not part of its API (the README says what is); it may
-- change without notice.
--
-- mongolock.args: the library's argument and option checks, one set of
-- messages (in seconds and the option's name), with a suggestion for a
-- misspelt option; the names of locks, databases and collections; and the
-- defaults every kind shares, written once.
--
-- Conventions: a check raises "bad argument #n to 'fname' (...)" at the
-- caller of the public function; `level` counts as error()'s does from the
-- function that calls the check (2: the caller of that function).

local core = require "mongolock.core"

local type = type
local pairs = pairs
local error = error
local tostring = tostring
local string_format = string.format
local math_huge = math.huge
local math_min = math.min
local math_max = math.max

local _M = {}

-- ---- defaults written once ------------------------------------------------

-- backoff between attempts, as lua-resty-lock's (first step, growth, cap)
_M.backoff = { step = 0.001, ratio = 2, max_step = 0.5 }

-- seconds a round trip may wait for an unreachable or silent server (server
-- selection, connect, socket), unless the URI sets libmongoc's own options:
-- a sixth of the default lease, where libmongoc waits 30 s
_M.SERVER_TIMEOUT = 5

-- seconds a single attempt (try, a timeout of 0) waits for a frozen or
-- dead server: its own selection, connect and socket timeouts
_M.ATTEMPT_TIMEOUT = 1

-- the longest lease (and queue place) the core takes
_M.TTL_MAX = 365 * 24 * 3600

-- ---- argument checks ---------------------------------------------------------

-- raises "bad argument #n to 'fname' (msg)" at the caller of fname
local function argerror(n, fname, msg, level)
  error(string_format("bad argument #%d to '%s' (%s)", n, fname, msg), (level or 2) + 1)
end
_M.argerror = argerror

-- v has type t (or is nil when optional); returns v
function _M.check_type(v, t, n, fname, optional, level)
  if v == nil and optional then return nil end
  if type(v) ~= t then
    argerror(n, fname, string_format("%s expected, got %s", t, type(v)), (level or 2) + 1)
  end
  return v
end

local function shown(v)
  if type(v) == "string" then return string_format("%q", v) end
  if v ~= v then return "NaN" end          -- not the C library's "-nan" or "nan"
  if type(v) == "number" then return tostring(v) end
  return type(v)
end
_M.shown = shown

local function number(v, n, fname, what, level)
  if type(v) ~= "number" then
    argerror(n, fname, string_format("%s: number of seconds expected, got %s", what, type(v)),
      level + 1)
  end
  return v
end

-- a positive, finite number of seconds (step, expire_after, ...)
function _M.seconds(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v <= 0 or v == math_huge then
    argerror(n, fname, string_format("%s must be a positive, finite number of seconds (got %s)",
      what, shown(v)), level)
  end
  return v
end

-- a lease length: positive seconds, at most a year
function _M.ttl(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v <= 0 or v > _M.TTL_MAX then
    argerror(n, fname, string_format("%s must be a positive number of seconds, at most a year "
      .. "(%d) (got %s)", what, _M.TTL_MAX, shown(v)), level)
  end
  return v
end

-- a lock-delay: seconds >= 0 (0: none), at most a year
function _M.delay(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v < 0 or v > _M.TTL_MAX then
    argerror(n, fname, string_format("%s must be a number of seconds >= 0, at most a year (%d) (got %s)",
      what, _M.TTL_MAX, shown(v)), level)
  end
  return v
end

-- how long to wait: 0 makes one attempt, math.huge waits for ever
function _M.timeout(v, n, fname, what, level)
  level = (level or 2) + 1
  number(v, n, fname, what, level)
  if v ~= v or v < 0 then
    argerror(n, fname, string_format("%s must be a number of seconds >= 0 (0: one attempt, "
      .. "math.huge: no limit) (got %s)", what, shown(v)), level)
  end
  if v == 0 then v = 0 end                    -- -0.0
  return v
end

-- Levenshtein distance with adjacent transpositions (short strings only)
local function distance(a, b)
  local la, lb = #a, #b
  if la > 64 or lb > 64 then return math_huge end
  local d = {}
  for i = 0, la do d[i] = { [0] = i } end
  for j = 0, lb do d[0][j] = j end
  for i = 1, la do
    local ca = a:byte(i)
    for j = 1, lb do
      local cb = b:byte(j)
      local cost = (ca == cb) and 0 or 1
      local v = math_min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and ca == b:byte(j - 1) and a:byte(i - 1) == cb then
        v = math_min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[la][lb]
end

-- the valid key nearest to key, when it is near enough to be a slip
function _M.nearest(key, valid)
  if type(key) ~= "string" then return nil end
  local best, bestd
  -- case and underscores aside: serverSelectionTimeoutMS is near
  -- server_selection_timeout
  local lkey = key:lower():gsub("_", "")
  for k in pairs(valid) do
    local lk = k:lower():gsub("_", "")
    local d = distance(lkey, lk)
    -- a slip: about one edit in three letters of the longer name
    if d <= math_max(1, math_min(3, math.floor(math_max(#lkey, #lk) / 3)))
       and (d < (bestd or math_huge) or (d == bestd and k < best)) then
      best, bestd = k, d
    end
  end
  return best
end

-- raises unless every key of opts is in valid (a set of names): "unknown
-- option 'tll' (did you mean 'ttl'?)"
function _M.check_keys(opts, valid, n, fname, level)
  for k in pairs(opts) do
    if not valid[k] then
      local near = _M.nearest(k, valid)
      local what = type(k) == "string" and string_format("'%s'", k) or string_format("[%s]", shown(k))
      argerror(n, fname, string_format("unknown option %s%s", what,
        near and string_format(" (did you mean '%s'?)", near) or ""), (level or 2) + 1)
    end
  end
  return opts
end

-- a set from a list of names
function _M.set(...)
  local s = {}
  for _, list in pairs({ ... }) do
    for _, k in pairs(list) do s[k] = true end
  end
  return s
end

-- ---- lock names ---------------------------------------------------------------

local MAX_NAME = 1024

-- raises at the caller of fname unless name is a valid lock name
function _M.check_name(name, fname, level)
  level = (level or 2) + 1
  if type(name) ~= "string" then
    argerror(1, fname, string_format("string expected, got %s", type(name)), level)
  end
  if #name == 0 then argerror(1, fname, "name must not be empty", level) end
  if #name > MAX_NAME then argerror(1, fname, "name longer than 1024 bytes", level) end
  if name:find("\0", 1, true) then argerror(1, fname, "name contains a NUL byte", level) end
  if not core.utf8_valid(name) then argerror(1, fname, "name is not valid UTF-8", level) end
  return name
end

-- MongoDB's limits on names, as the core checks them: a database is 1..63
-- bytes of UTF-8 without /\. "$ or NUL; a collection is UTF-8 without '$'
-- or NUL, not system.*, and at most 255 bytes with its database and a dot
local function clip(v)
  return shown(#v > 40 and v:sub(1, 40) .. "..." or v)
end

function _M.check_db(v, n, fname, what, level)
  level = (level or 2) + 1
  if type(v) ~= "string" then
    argerror(n, fname, string_format("%s: string expected, got %s", what, type(v)), level)
  end
  if #v == 0 or #v > 63 or v:find('[%z/\\%. "$]') or not core.utf8_valid(v) then
    argerror(n, fname, string_format('%s must be 1..63 bytes of UTF-8, none of /\\. "$ or NUL '
      .. "(got %s)", what, clip(v)), level)
  end
  return v
end

-- db: the collection's database when known (its length counts)
function _M.check_coll(v, db, n, fname, what, level)
  level = (level or 2) + 1
  if type(v) ~= "string" then
    argerror(n, fname, string_format("%s: string expected, got %s", what, type(v)), level)
  end
  local max = 254 - (db and #db or 1)
  if #v == 0 or #v > max or v:find("[%z$]") or v:sub(1, 7) == "system."
     or not core.utf8_valid(v) then
    argerror(n, fname, string_format("%s must be 1..%d bytes of UTF-8 without '$' or NUL, not "
      .. "system.* (got %s)", what, max, clip(v)), level)
  end
  return v
end

return _M
