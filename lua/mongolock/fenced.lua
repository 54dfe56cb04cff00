-- Internal to mongolock: programs reach these methods through h:fenced()
-- and do not require this module, which may change without notice.
--
-- Fenced writes: the database itself refuses a stale holder's write.
--
--   local f = h:fenced("players")           -- h: a held lock's handle
--   local n, err, info = f:update({ _id = "p1" }, { ["$inc"] = { gold = 5 } })
--   --> 1 | 0 (no such document) | nil, "fenced", { token = newer } | nil, "lost"
--
-- Every document written through f keeps the highest fencing token that
-- wrote it, in a field of its own (`fence` unless opts.field says
-- otherwise).  A write applies only when the stored token is not newer
-- than the handle's (equal: the same holder writes again; no token: a
-- document never fenced, or a new one), and sets the field to the
-- handle's token, in the same command: one round trip, decided on the
-- server.  Tokens never go backwards, so once the next holder has written
-- a document, nothing a paused or cut-off older holder sends changes it.
--
-- An update by operators (no upsert) is one `update` with the fence in its
-- filter: n = 1 is written; n = 0 is a refusal or no match, which one read
-- tells apart (on that path only).  Every other single write (an upsert, a
-- pipeline, a replace, find_and_modify) is one findAndModify on the
-- caller's filter whose update pipeline (as mongolock.versioned's)
--   1. stashes the whole document in a scratch field when the stored token
--      is newer than ours (and stashes nothing otherwise),
--   2. applies the change (the caller's update operators translated to
--      pipeline stages, the caller's pipeline, or the replacement),
--   3. puts the stashed document back when there is one, else sets the
--      fence field to our token.
-- A refused write therefore leaves the document exactly as it was, and the
-- reply (the document's token before the write, projected) tells written,
-- refused and no match apart.  An upsert whose filter matches a fenced
-- document is refused like an update: it never inserts a second document.
-- A delete cannot run a pipeline: it deletes only where the stored token is
-- not newer (the fence in its filter), and when nothing was deleted one
-- read tells a refusal from no match (the failure path only).

--- Fenced writes: what `h:fenced(collection, opts)` returns (a write applies only while no newer
-- holder of the lock has written the document).
-- @classmod fenced

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"

local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring
local setmetatable = setmetatable
local string_format = string.format
local string_sub = string.sub
local string_match = string.match
local next = next
local math_type = math.type

local argerror = args.argerror
local check_type = args.check_type
local null = core.null

local _M = { _VERSION = "0.1.0", defaults = { field = "fence" } }
local mt = { __index = _M }
local NEW_OPTS = args.set({ "database", "field" })
local WRITE_OPTS = args.set({ "upsert" })
local FAM_OPTS = args.set({ "upsert", "new", "sort" })

-- the versioned writes' translation of update operators and replacements
-- into pipeline stages, with their scratch field
local stages = require("mongolock.versioned")._stages
local STASH = stages.STASH

local prepare                -- below

-- f = fenced.new(h, coll, opts, c): h a held lock's handle (anything with
-- h:check(), h:token_string() and h.database), c the client that runs the
-- writes (mongolock.connect's, so that they yield where it can, else the
-- core's); raises on bad arguments
function _M.new(h, coll, opts, c)
  check_type(coll, "string", 1, "fenced")
  check_type(opts, "table", 2, "fenced", true)
  opts = opts or {}
  args.check_keys(opts, NEW_OPTS, 2, "fenced")
  local db = opts.database
  if db == nil then db = h.database end
  args.check_db(db, 2, "fenced", "database", 3)
  args.check_coll(coll, db, 1, "fenced", "collection", 3)
  local field = opts.field
  if field == nil then field = _M.defaults.field end
  if type(field) ~= "string" or field == "" or field:find("[%.%$%z]") or field == "_id" or field == STASH then
    argerror(2, "fenced", "field must be a top-level name (no '.', no '$', not _id)", 3)
  end
  local ts = h:token_string()
  if ts == nil or ts == "0" then
    error("fenced: the handle has no fencing token (a document lock: fence on a version)", 2)
  end
  local self = setmetatable({ h = h, db = db, coll = coll, field = field, token = core.Int64(ts),
                              token_string = ts, c = c, core = type(c) == "table" and c._core or nil,
                              check = h.check }, mt)
  prepare(self)
  return self
end

-- inside nginx or a scheduler's coroutine the client's command (it yields
-- there), else the core's (the same command, without that look)
local function run(self, ...)
  local c = self.c
  if self.core and not runners.yielding_core(c) then return self.core:command(...) end
  return c:command(...)
end

-- the command; its arguments' complaint (a value BSON cannot hold: a
-- function, a cycle) is raised at level (counted from here)
local function command(self, level, ...)
  local ok, r, err, code = pcall(run, self, ...)
  if ok then return r, err, code end
  local msg = tostring(r):gsub("^[^\n]-:%d+: ", "", 1):gsub("^bad argument #%d+ to '[^']*' %((.*)%)$", "%1")
  error(string_format("fenced write: %s", msg), level)
end

local function is_null(v) return v == nil or v == null end

-- the token stored in a document: a number, else nil
local function stored(doc, field)
  if type(doc) ~= "table" then return nil end
  local v = doc[field]
  if is_null(v) then return nil end
  return v
end

-- OK: the stored token is not newer than ours (a document without one, or
-- with null, is not fenced yet)
local function ok_expr(self)
  return { ["$lte"] = { { ["$ifNull"] = { "$" .. self.field, 0 } }, self.token } }
end

-- the parts of every write that depend only on the field and the token,
-- encoded once: the stash stage, the closing stages, the reply's projection
prepare = function(self)
  self.stash = core.Document({ ["$set"] = { [STASH] = { ["$cond"] = { ok_expr(self), "$$REMOVE", "$$ROOT" } } } })
  self.restore = core.Document({ ["$replaceWith"] = { ["$ifNull"] = { "$" .. STASH,
    { ["$mergeObjects"] = { "$$ROOT", { [self.field] = self.token } } } } } })
  self.unstash = core.Document({ ["$unset"] = STASH })
  self.newer = core.Document({ _id = 0, newer = { ["$cond"] = { ok_expr(self), null, "$" .. self.field } } })
  self.ok_match = core.Document({ ["$expr"] = ok_expr(self) })
end

-- the write's pipeline: stash when fenced, change, restore or set the fence
local function pipeline(self, change)
  local p = { self.stash }
  for _, s in ipairs(change) do p[#p + 1] = s end
  p[#p + 1] = self.restore
  p[#p + 1] = self.unstash
  return p
end

-- nil when the handle may write, else nil, err (lost, not held, closed)
local function refuse(self)
  local ok, err = self.check(self.h)
  if ok then return nil end
  return err or "not held"
end

-- (a filter that cannot be written as BSON raises when the command is
-- built: see command)
local function check_filter(filter, n, fname)
  if type(filter) ~= "table" then argerror(n, fname, "filter document expected, got " .. type(filter), 3) end
end

-- t (a stored token) > ours (decimal digits), exactly: a token that is not
-- a number is newer (the server's order puts every string after numbers)
local function decimal(v)
  if math_type and math_type(v) == "integer" then return tostring(v) end
  return string_format("%.0f", v)
end

local function newer_than(t, ours)
  if type(t) ~= "number" then return true end
  if t < 0 then return false end
  local d = decimal(t)
  if #d ~= #ours then return #d > #ours end
  return d > ours
end

-- what a refused write answers: the newer token (a number, and in exact
-- decimal digits), ours, and the field
local function fenced_info(self, newer)
  return { token = newer, token_string = type(newer) == "number" and decimal(newer) or tostring(newer),
           ours = self.token_string, field = self.field }
end

-- one findAndModify of filter with change: n (0 | 1), upserted id |
-- nil, "fenced", info | nil, err, code
local function write_one(self, filter, change, upsert)
  local why = refuse(self)
  if why then return nil, why end
  local r, err, code = command(self, 4, self.db, { findAndModify = self.coll }, {
    query = filter, update = pipeline(self, change), new = false, upsert = upsert or false,
    fields = self.newer,
  })
  if not r then return nil, err, code end
  local pre = r.value
  local le = r.lastErrorObject
  if is_null(pre) then
    if type(le) == "table" and le.upserted ~= nil then return 1, le.upserted end
    return 0
  end
  if is_null(pre.newer) then return 1 end
  return nil, "fenced", fenced_info(self, pre.newer)
end

-- update operators that also set the fence: a copy of update whose $set
-- holds the field; raises at the caller of the caller (n, fname) when one
-- is no operator or touches the field or _id
local function with_fence(self, update, n, fname)
  local out = {}
  local field = self.field
  for op, spec in pairs(update) do
    if type(op) ~= "string" or string_sub(op, 1, 1) ~= "$" then
      argerror(n, fname, "update operator expected, got " .. tostring(op) .. " (use replace for a whole document)", 4)
    end
    if type(spec) ~= "table" then argerror(n, fname, op .. " needs a document", 4) end
    for k, v in pairs(spec) do
      if type(k) ~= "string" then argerror(n, fname, op .. ": field names must be strings", 4) end
      local top = string_match(k, "^[^%.]*")
      if op == "$rename" and type(v) == "string" and top ~= field and top ~= "_id" then
        top = string_match(v, "^[^%.]*")
      end
      if top == field or top == "_id" or top == STASH then
        argerror(n, fname, string_format("update must not change %s", top), 4)
      end
    end
    out[op] = spec
  end
  local set = {}
  local given = out["$set"]
  if given then for k, v in pairs(given) do set[k] = v end end
  set[field] = self.token
  out["$set"] = set
  return out
end

local NO_OPTS = {}

local function write_opts(opts, n, fname, valid)
  if opts == nil then return NO_OPTS end
  check_type(opts, "table", n, fname, true)
  args.check_keys(opts, valid, n, fname)
  if opts.upsert ~= nil and type(opts.upsert) ~= "boolean" then
    argerror(n, fname, "upsert must be a boolean", 3)
  end
  return opts
end

-- the fence as a query: the stored token is not newer than ours
local function ok_query(self, filter)
  return { ["$and"] = { filter, self.ok_match } }
end

-- after a write that matched nothing: nil, "fenced", info when a document
-- of filter holds a newer token, else 0 (one read)
local function why_none(self, filter)
  local r, err, code = command(self, 3, self.db, { find = self.coll }, {
    filter = filter, limit = 1, singleBatch = true,
    projection = { _id = 0, [self.field] = 1 },
  })
  if not r then return nil, err, code end
  local doc = r.cursor and r.cursor.firstBatch and r.cursor.firstBatch[1]
  local newer = stored(doc, self.field)
  if doc and newer ~= nil then return nil, "fenced", fenced_info(self, newer) end
  return 0
end

--- Updates the first document matching filter, unless a newer holder wrote it.
-- n, id = f:update(filter, update [, {upsert = true}]): update is update operators
-- ($set, $inc, $unset, $push, ...) or a pipeline; 1 written (and the new _id of an
-- upsert), 0 no document matched | nil, "fenced", {token = the newer token,
-- token_string = its digits, ours = our token's digits, field}
-- (nothing changed) | nil, "lost" | "not held" | "closed" | nil, err, code
function _M.update(self, filter, update, opts)
  check_filter(filter, 1, "update")
  opts = write_opts(opts, 3, "update", WRITE_OPTS)
  if not opts.upsert and type(update) == "table" and update[1] == nil and not core.is_array(update)
     and next(update) ~= nil then
    -- operators without upsert: one update with the fence in its filter
    -- (a refusal and no match are told apart by one read, on that path)
    local u = with_fence(self, update, 2, "update")
    local why = refuse(self)
    if why then return nil, why end
    local r, err, code = command(self, 3, self.db, { update = self.coll },
      { updates = { { q = ok_query(self, filter), u = u } } })
    if not r then return nil, err, code end
    if (r.n or 0) > 0 then return 1 end
    return why_none(self, filter)
  end
  local change = stages.update(self, update, 2, "update")
  return write_one(self, filter, change, opts.upsert)
end

--- Replaces the first document matching filter (keeping its _id and the fence).
-- n, id = f:replace(filter, doc [, {upsert = true}]): as update
function _M.replace(self, filter, doc, opts)
  check_filter(filter, 1, "replace")
  if type(doc) ~= "table" then argerror(2, "replace", "document expected, got " .. type(doc)) end
  local ok, change = pcall(stages.replace, self, doc, "replacement")
  if not ok then argerror(2, "replace", tostring(change)) end
  opts = write_opts(opts, 3, "replace", WRITE_OPTS)
  return write_one(self, filter, change, opts.upsert)
end

--- Inserts doc with the fence set to the handle's token.
-- true = f:insert(doc) | nil, "lost" | nil, err, code (a duplicate _id: code 11000)
function _M.insert(self, doc)
  if type(doc) ~= "table" then argerror(1, "insert", "document expected, got " .. type(doc)) end
  local copy = {}
  for k, v in pairs(doc) do copy[k] = v end
  copy[self.field] = self.token
  local encoded, eerr = core.Document(copy)
  if not encoded then argerror(1, "insert", "document cannot be written as BSON: " .. tostring(eerr)) end
  local why = refuse(self)
  if why then return nil, why end
  local r, err, code = command(self, 3, self.db, { insert = self.coll }, { documents = core.array({ encoded }) })
  if not r then return nil, err, code end
  return true
end

--- Deletes the first document matching filter, unless a newer holder wrote it.
-- n = f:delete(filter): 1 deleted, 0 no document matched | nil, "fenced", {token}
-- | nil, "lost" | nil, err, code
function _M.delete(self, filter)
  check_filter(filter, 1, "delete")
  local why = refuse(self)
  if why then return nil, why end
  local r, err, code = command(self, 3, self.db, { findAndModify = self.coll }, {
    query = ok_query(self, filter), remove = true, fields = { _id = 1 },
  })
  if not r then return nil, err, code end
  if not is_null(r.value) then return 1 end
  return why_none(self, filter)
end

--- Updates the first document matching filter and returns it.
-- doc = f:find_and_modify(filter, update [, {new = true, upsert = true, sort = {...}}]):
-- the document before the write (after it with new = true), core.null when none
-- matched | nil, "fenced", {token} (nothing changed) | nil, "lost" | nil, err, code
function _M.find_and_modify(self, filter, update, opts)
  check_filter(filter, 1, "find_and_modify")
  local change = stages.update(self, update, 2, "find_and_modify")
  opts = write_opts(opts, 3, "find_and_modify", FAM_OPTS)
  if opts.new ~= nil and type(opts.new) ~= "boolean" then
    argerror(3, "find_and_modify", "new must be a boolean")
  end
  if opts.sort ~= nil and type(opts.sort) ~= "table" then
    argerror(3, "find_and_modify", "sort must be a document")
  end
  local why = refuse(self)
  if why then return nil, why end
  local r, err, code = command(self, 3, self.db, { findAndModify = self.coll }, {
    query = filter, update = pipeline(self, change), new = opts.new == true,
    upsert = opts.upsert == true, sort = opts.sort,
  })
  if not r then return nil, err, code end
  local doc = r.value
  if is_null(doc) then return null end
  -- refused: the document kept a token newer than ours (before and after)
  local t = stored(doc, self.field)
  if t ~= nil and newer_than(t, self.token_string) then
    return nil, "fenced", fenced_info(self, t)
  end
  return doc
end

--- Updates every document matching filter that no newer holder wrote.
-- n = f:update_many(filter, update): update operators or a pipeline; n documents
-- written (one round trip; a matching document holding a newer token is left as it
-- is and not counted) | nil, "lost" | nil, err, code
function _M.update_many(self, filter, update)
  check_filter(filter, 1, "update_many")
  local change = stages.update(self, update, 2, "update_many")
  local why = refuse(self)
  if why then return nil, why end
  local u = {}
  for _, s in ipairs(change) do u[#u + 1] = s end
  u[#u + 1] = { ["$set"] = { [self.field] = self.token } }
  local r, err, code = command(self, 3, self.db, { update = self.coll }, {
    updates = core.array({ { q = ok_query(self, filter), u = core.array(u), multi = true } }),
  })
  if not r then return nil, err, code end
  return r.n or 0
end

--- The field that holds the fence, and the token written.
-- field, token_string = f:fence()
function _M.fence(self)
  return self.field, self.token_string
end

mt.__tostring = function(self)
  return string_format("mongolock.Fenced(%s.%s, %s = %s)", self.db, self.coll, self.field, self.token_string)
end

return _M
