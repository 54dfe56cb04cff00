-- Internal to mongolock: programs reach these methods through
-- client:versioned() and do not require this module, which may change without
-- notice.
--
-- Optimistic concurrency: every document carries a version counter, and a
-- write applies only when the caller's copy has the version the server has.
--
--   local vc = client:versioned("app", "accounts", { field = "version" })
--   assert(vc:insert({ _id = "alice", balance = 10 }))     -- version = 1
--   local ok, err, current = vc:update(doc, { ["$inc"] = { balance = 5 } })
--   --> true | nil, "conflict", current_doc | nil, "not found"
--
-- Each single write is one round trip and decides "written", "conflict" or
-- "not found" atomically on the server: a findAndModify on {_id} alone
-- whose update pipeline
--   1. stashes the whole document in a scratch field when the version does
--      not match (and stashes nothing when it does),
--   2. applies the change (the caller's update operators, translated to
--      pipeline stages, or the replacement document),
--   3. puts the stashed document back when there is one, else bumps the
--      version.
-- A conflicting write therefore leaves the document exactly as it was (the
-- server sees a no-op), and the reply's pre-image tells the three cases
-- apart: no document -> not found; version == ours -> written; else
-- conflict, and the pre-image IS the current document.
--
-- The *_many calls send one update command with all the documents.  A
-- statement that does not match raises a conversion error naming the
-- outcome ("mongolock:conflict" / "mongolock:not found") inside the same
-- pipeline, so the server's per-statement writeErrors tell which documents
-- were written; only conflicting documents are read again, to hand back
-- their current state.

--- Optimistic concurrency: what `client:versioned(db, coll, opts)` returns (a version field in
-- every document; a write applies only at the version the caller read).
-- @classmod vc

local core = require "mongolock.core"
local args = require "mongolock.args"
local runners = require "mongolock.runners"

local type = type
local pairs = pairs
local ipairs = ipairs
local next = next
local error = error
local tostring = tostring
local setmetatable = setmetatable
local string_format = string.format
local string_find = string.find
local string_sub = string.sub
local table_sort = table.sort

local argerror = args.argerror
local check_type = args.check_type
local null = core.null
local array = core.array

local STASH = "__mongolock_stash"

local _M = {
  _VERSION = "0.1.0",
  defaults = {
    field = "version",   -- the version counter's field (top level)
    retries = 10,        -- modify(): attempts after the first one
  },
}
local defaults = _M.defaults

local mt = { __index = _M }
local NEW_OPTS = args.set({ "field", "retries" })
local MODIFY_OPTS = args.set({ "retries" })

local function check_name(v, n, fname, what)
  if type(v) ~= "string" then
    argerror(n, fname, string_format("%s: string expected, got %s", what, type(v)), 3)
  end
  if v == "" or #v > 255 or not core.utf8_valid(v) then
    argerror(n, fname, what .. " must be a non-empty UTF-8 string without NUL bytes", 3)
  end
  return v
end

-- vc = versioned.new(client, db, coll, opts)
function _M.new(client, db, coll, opts)
  -- database and collection names as every other kind checks them
  args.check_db(db, 1, "versioned", "database", 2)
  args.check_coll(coll, db, 2, "versioned", "collection", 2)
  check_type(opts, "table", 3, "versioned", true)
  opts = opts or {}
  args.check_keys(opts, NEW_OPTS, 3, "versioned")
  local field = opts.field
  if field == nil then field = defaults.field end
  check_name(field, 3, "versioned", "field")
  if field == "_id" or string_find(field, "[%.%$]") or field == STASH then
    argerror(3, "versioned", "field must be a top-level name (no '.', no '$', not _id)")
  end
  local retries = opts.retries
  if retries == nil then retries = defaults.retries end
  if type(retries) ~= "number" or retries ~= retries or retries < 0 or retries % 1 ~= 0 then
    argerror(3, "versioned", "retries must be a non-negative integer")
  end
  return setmetatable({
    client = client, core = client._core, db = db, coll = coll,
    field = field, retries = retries,
  }, mt)
end

-- ---- helpers --------------------------------------------------------------

-- one command: where the caller can yield (inside nginx, in a scheduler's
-- coroutine), through client:command, which runs its round trip elsewhere
-- (mongolock.runners.yielding_core); else on the core
local function command(self, ...)
  if runners.yielding_core(self.client) then return self.client:command(...) end
  return self.core:command(...)
end

local function is_null(v) return v == nil or v == null end

-- raises at the caller of the caller's caller (level) unless doc can be
-- written as BSON (cycles, functions, mixed keys, bad UTF-8, ...).  A
-- document that is sent is encoded once, as a core.Document, and that
-- is its check (stamp, replace_stages)
local function check_bson(doc, n, fname, level, what)
  local ok, err = core.bson_encode(doc)
  if not ok then
    argerror(n, fname, (what or "document") .. " cannot be written as BSON: " .. tostring(err),
      level + 1)
  end
end

-- the _id and version of doc, or raises at the caller of fname.  Only the
-- _id of doc is sent with its version (replace sends the other fields,
-- encoded there): the rest is not encoded to be checked
local function check_doc(self, doc, n, fname)
  if type(doc) ~= "table" then
    argerror(n, fname, "document expected, got " .. type(doc), 3)
  end
  if doc._id == nil then argerror(n, fname, "document has no _id", 3) end
  local v = doc[self.field]
  if type(v) ~= "number" or v % 1 ~= 0 then
    argerror(n, fname, string_format("document has no integer %s (got %s)", self.field, type(v)), 3)
  end
  check_bson({ _id = doc._id }, n, fname, 3)
  return doc._id, v
end

-- puts back the _id and version doc had before stamp
local function unstamp(self, doc, old)
  doc._id, doc[self.field] = old.id, old.v
end

-- gives doc its _id (a new ObjectId when it has none) and version 1:
-- encoded, old (doc as a core.Document; the _id and version it had) |
-- nil, nil, message (doc cannot be written as BSON; it has them back)
local function stamp(self, doc)
  local old = { id = doc._id, v = doc[self.field] }
  if old.id == nil then doc._id = core.ObjectId() end
  doc[self.field] = 1
  local encoded, err = core.Document(doc)
  if not encoded then
    unstamp(self, doc, old)
    return nil, nil, err
  end
  return encoded, old
end

-- MATCH: the stored version equals v
local function match(self, v)
  return { ["$eq"] = { "$" .. self.field, v } }
end

-- an error raised from inside the pipeline with `what` in its message;
-- it depends on the document so that the server cannot evaluate it early
local function raise_expr(what)
  return { ["$toInt"] = { ["$concat"] = {
    "mongolock:" .. what, { ["$substrBytes"] = { { ["$type"] = "$_id" }, 0, 0 } } } } }
end

-- update operators -> pipeline stages (appended to stages); raises on an
-- operator it cannot express, or one that touches the version field
local function ref(path) return "$" .. path end
local function lit(v) return { ["$literal"] = v } end

local function each_of(v)
  if type(v) == "table" and not core.is_array(v) and v["$each"] ~= nil then
    local e = v["$each"]
    if type(e) ~= "table" then error("$each needs an array", 0) end
    for k in pairs(v) do
      if k ~= "$each" then error("push modifier " .. tostring(k) .. " is not supported", 0) end
    end
    return e
  end
  return { v }
end

local translate = {
  ["$set"] = function(k, v) return { ["$set"] = { [k] = lit(v) } } end,
  ["$setOnInsert"] = false,
  ["$unset"] = function(k) return { ["$unset"] = k } end,
  ["$inc"] = function(k, v)
    if type(v) ~= "number" and type(v) ~= "userdata" then error("$inc needs a number", 0) end
    return { ["$set"] = { [k] = { ["$add"] = { { ["$ifNull"] = { ref(k), 0 } }, v } } } }
  end,
  ["$mul"] = function(k, v)
    if type(v) ~= "number" and type(v) ~= "userdata" then error("$mul needs a number", 0) end
    return { ["$set"] = { [k] = { ["$multiply"] = { { ["$ifNull"] = { ref(k), 0 } }, v } } } }
  end,
  ["$min"] = function(k, v)
    return { ["$set"] = { [k] = { ["$min"] = { { ["$ifNull"] = { ref(k), lit(v) } }, lit(v) } } } }
  end,
  ["$max"] = function(k, v)
    return { ["$set"] = { [k] = { ["$max"] = { { ["$ifNull"] = { ref(k), lit(v) } }, lit(v) } } } }
  end,
  ["$currentDate"] = function(k, v)
    local ts = type(v) == "table" and v["$type"] == "timestamp"
    return { ["$set"] = { [k] = ts and "$$CLUSTER_TIME" or "$$NOW" } }
  end,
  ["$push"] = function(k, v)
    local items = each_of(v)
    return { ["$set"] = { [k] = { ["$concatArrays"] = {
      { ["$ifNull"] = { ref(k), array() } }, lit(array(items)) } } } }
  end,
  ["$addToSet"] = function(k, v)
    local items = each_of(v)
    -- appends each item not present yet, in order
    return { ["$set"] = { [k] = { ["$reduce"] = {
      input = lit(array(items)),
      initialValue = { ["$ifNull"] = { ref(k), array() } },
      ["in"] = { ["$cond"] = { { ["$in"] = { "$$this", "$$value" } }, "$$value",
        { ["$concatArrays"] = { "$$value", { "$$this" } } } } },
    } } } }
  end,
  ["$pull"] = function(k, v)
    if type(v) == "table" and not core.is_array(v) and next(v) ~= nil then
      for kk in pairs(v) do
        if type(kk) == "string" and string_sub(kk, 1, 1) == "$" then
          error("$pull with a condition is not supported (only a value)", 0)
        end
      end
    end
    return { ["$set"] = { [k] = { ["$filter"] = {
      input = { ["$ifNull"] = { ref(k), array() } },
      cond = { ["$ne"] = { "$$this", lit(v) } } } } } }
  end,
  ["$rename"] = function(k, v)
    if type(v) ~= "string" then error("$rename needs a string", 0) end
    return { ["$set"] = { [v] = ref(k) } }, { ["$unset"] = k }
  end,
}

-- the stages of an update: a pipeline (array of stages) as it is, or an
-- operator document translated; fname/n for errors at the caller
local function update_stages(self, update, n, fname)
  if type(update) ~= "table" then
    argerror(n, fname, "update document or pipeline expected, got " .. type(update), 3)
  end
  check_bson({ update = update }, n, fname, 3, "update")
  local out = {}
  if core.is_array(update) or update[1] ~= nil then
    for _, stage in ipairs(update) do out[#out + 1] = stage end
    return out
  end
  if next(update) == nil then argerror(n, fname, "empty update", 3) end
  local ops = {}
  for op in pairs(update) do ops[#ops + 1] = tostring(op) end
  table_sort(ops)
  for _, op in ipairs(ops) do
    local tr = translate[op]
    local spec = update[op]
    if not tr then
      argerror(n, fname, string_format("update operator %s is not supported here%s", op,
        string_sub(op, 1, 1) == "$" and "" or " (use replace for a whole document)"), 3)
    end
    if type(spec) ~= "table" then argerror(n, fname, op .. " needs a document", 3) end
    local keys = {}
    for k in pairs(spec) do
      if type(k) ~= "string" then argerror(n, fname, op .. ": field names must be strings", 3) end
      keys[#keys + 1] = k
    end
    table_sort(keys)
    for _, k in ipairs(keys) do
      local top = k:match("^[^%.]*")
      if top == self.field or top == "_id" or top == STASH then
        argerror(n, fname, string_format("update must not change %s", top), 3)
      end
      local ok, a, b = pcall(tr, k, spec[k])
      if not ok then argerror(n, fname, op .. ": " .. tostring(a), 3) end
      out[#out + 1] = a
      if b then out[#out + 1] = b end
      if op == "$rename" then
        local t = spec[k]:match("^[^%.]*")
        if t == self.field or t == "_id" or t == STASH then
          argerror(n, fname, string_format("update must not change %s", t), 3)
        end
      end
    end
  end
  return out
end

-- the whole pipeline: stash on mismatch, change, then restore or bump.
-- mode "single": a mismatch restores the stash (a no-op write);
-- mode "bulk": a mismatch raises conflict / not found inside the pipeline.
local function pipeline(self, v, change, mode)
  local p = { { ["$set"] = { [STASH] = { ["$cond"] = { match(self, v), "$$REMOVE", "$$ROOT" } } } } }
  for _, s in ipairs(change) do p[#p + 1] = s end
  local bumped = { ["$mergeObjects"] = { "$$ROOT", { [self.field] = v + 1 } } }
  local final
  if mode == "single" then
    final = { ["$ifNull"] = { "$" .. STASH, bumped } }
  else
    final = { ["$cond"] = {
      { ["$eq"] = { { ["$type"] = "$" .. STASH }, "missing" } },
      bumped,
      { ["$cond"] = {
        -- an upserted {_id} (the document does not exist) holds only _id
        { ["$eq"] = { { ["$size"] = { ["$objectToArray"] = "$" .. STASH } }, 1 } },
        raise_expr("not found"), raise_expr("conflict") } } } }
  end
  p[#p + 1] = { ["$replaceWith"] = final }
  p[#p + 1] = { ["$unset"] = STASH }
  return p
end

-- a replacement as a change: every field of doc but _id and the version
-- (which the final stage sets), encoded once here; raises (a message)
-- when those fields cannot be written as BSON
local function replace_stages(self, doc, what)
  local new = {}
  for k, val in pairs(doc) do
    if k ~= self.field and k ~= "_id" then new[k] = val end
  end
  if new[STASH] ~= nil then error("field " .. STASH .. " is reserved", 0) end
  local encoded, err = core.Document(new)
  if not encoded then error(what .. " cannot be written as BSON: " .. tostring(err), 0) end
  return { { ["$replaceWith"] = { ["$mergeObjects"] = {
    { _id = "$_id", [STASH] = "$" .. STASH, [self.field] = "$" .. self.field },
    lit(encoded) } } } }
end

-- one findAndModify: true | nil, "conflict", current | nil, "not found".
-- The document as it was comes back only on a conflict (the same MATCH as
-- the pipeline's decides): a write that wins is answered with {cur = null}
local function write_fields(self, v)
  return { _id = 0, cur = { ["$cond"] = { match(self, v), null, "$$ROOT" } } }
end

function _M._write_one(self, id, v, change)
  local r, err, code = command(self, self.db, { findAndModify = self.coll }, {
    query = { _id = id }, update = pipeline(self, v, change, "single"),
    new = false, upsert = false, fields = write_fields(self, v),
  })
  if not r then return nil, err, code end
  local pre = r.value
  if is_null(pre) then return nil, "not found" end
  if is_null(pre.cur) then return true end
  return nil, "conflict", pre.cur
end

-- ---- single documents ------------------------------------------------------

--- Inserts doc at version 1.
-- ok, err = vc:insert(doc): sets doc[field] = 1 (and doc._id to a new
-- ObjectId when it has none), then inserts it
function _M.insert(self, doc)
  check_type(doc, "table", 1, "insert")
  local encoded, old, berr = stamp(self, doc)
  if not encoded then
    argerror(1, "insert", "document cannot be written as BSON: " .. tostring(berr), 2)
  end
  if self.core:closed() then
    unstamp(self, doc, old)
    return nil, "closed"
  end
  local r, err, code = command(self, self.db, { insert = self.coll },
    { documents = { encoded } })
  if not r then
    doc[self.field] = old.v
    return nil, err, code
  end
  return true
end

--- Replaces the stored document by doc if its version is still doc's.
-- ok, err, current = vc:replace(doc): doc (with _id and version) replaces
-- the stored document if its version is still doc's; doc[field] is bumped
function _M.replace(self, doc)
  local id, v = check_doc(self, doc, 1, "replace")
  if self.core:closed() then return nil, "closed" end
  local ok, change = pcall(replace_stages, self, doc, "document")
  if not ok then argerror(1, "replace", change) end
  local r, err, cur = self:_write_one(id, v, change)
  if r then doc[self.field] = v + 1 end
  return r, err, cur
end

--- Applies an update to the stored document if its version is still doc's.
-- ok, err, current = vc:update(doc, update): applies update (operators:
-- $set $unset $inc $mul $min $max $currentDate $push $addToSet $pull
-- $rename, or a pipeline) if the stored version is still doc's;
-- doc[field] is bumped (the other fields of doc are left as they were)
function _M.update(self, doc, update)
  local id, v = check_doc(self, doc, 1, "update")
  local change = update_stages(self, update, 2, "update")
  if self.core:closed() then return nil, "closed" end
  local r, err, cur = self:_write_one(id, v, change)
  if r then doc[self.field] = v + 1 end
  return r, err, cur
end

--- Deletes the stored document if its version is still doc's.
-- ok, err, current = vc:delete(doc): one findAndModify that removes the
-- document only at doc's version; a version mismatch raises inside the
-- filter, so the three outcomes come from one round trip (the current
-- document of a conflict is read afterwards)
function _M.delete(self, doc)
  local id, v = check_doc(self, doc, 1, "delete")
  if self.core:closed() then return nil, "closed" end
  local r, err, code = command(self, self.db, { findAndModify = self.coll }, {
    query = { _id = id, ["$expr"] = { ["$cond"] = { match(self, v), true, raise_expr("conflict") } } },
    remove = true, fields = { _id = 1 },
  })
  if r then
    if is_null(r.value) then return nil, "not found" end
    return true
  end
  if err and string_find(err, "mongolock:conflict", 1, true) then
    local cur = self:get(id)
    return nil, "conflict", cur
  end
  return nil, err, code
end

--- Reads the document id.
-- doc | nil, "not found" | nil, err, code
function _M.get(self, id)
  if id == nil then argerror(1, "get", "_id expected, got nil") end
  check_bson({ _id = id }, 1, "get", 2, "_id")
  if self.core:closed() then return nil, "closed" end
  local r, err, code = command(self, self.db, { find = self.coll },
    { filter = { _id = id }, limit = 1, singleBatch = true })
  if not r then return nil, err, code end
  local doc = r.cursor and r.cursor.firstBatch and r.cursor.firstBatch[1]
  if doc == nil then return nil, "not found" end
  return doc
end

--- Reads, changes with fn and replaces the document id, retrying fn on a conflict.
-- doc, err = vc:modify(id, fn, opts): reads the document, calls fn(doc)
-- for the new one (fn may change doc in place and return it; returning nil
-- cancels: nil, "cancelled"), writes it with replace, and on a conflict
-- calls fn again with the current document, up to opts.retries more times
-- (then nil, "conflict", current)
function _M.modify(self, id, fn, opts)
  if id == nil then argerror(1, "modify", "_id expected, got nil") end
  check_bson({ _id = id }, 1, "modify", 2, "_id")
  check_type(fn, "function", 2, "modify")
  check_type(opts, "table", 3, "modify", true)
  if opts then args.check_keys(opts, MODIFY_OPTS, 3, "modify") end
  local retries = self.retries
  if opts and opts.retries ~= nil then
    retries = opts.retries
    if type(retries) ~= "number" or retries ~= retries or retries < 0 or retries % 1 ~= 0 then
      argerror(3, "modify", "retries must be a non-negative integer")
    end
  end
  local doc, err, code = self:get(id)
  if not doc then return nil, err, code end
  local attempt = 0
  while true do
    local v = doc[self.field]
    local new = fn(doc)
    if new == nil then return nil, "cancelled" end
    if type(new) ~= "table" then error("modify: fn must return a table or nil", 2) end
    new._id = id
    new[self.field] = v
    local ok, e, cur = self:replace(new)
    if ok then return new end
    if e ~= "conflict" then return nil, e, cur end
    attempt = attempt + 1
    if attempt > retries then return nil, "conflict", cur end
    doc = cur
  end
end

-- ---- many documents --------------------------------------------------------

--- Inserts docs at version 1, in one command.
-- ok, results = vc:insert_many(docs): one insert command (unordered);
-- results[i] = true | error message of docs[i]
function _M.insert_many(self, docs)
  check_type(docs, "table", 1, "insert_many")
  for i, d in ipairs(docs) do
    if type(d) ~= "table" then argerror(1, "insert_many", "document expected at " .. i) end
  end
  -- each document is given an _id and a version and encoded; when one
  -- cannot be, those before it are given back what they had
  local olds, encoded = {}, {}
  for i, d in ipairs(docs) do
    local one, old, berr = stamp(self, d)
    if not one then
      for j = 1, i - 1 do unstamp(self, docs[j], olds[j]) end
      argerror(1, "insert_many", "document " .. i .. " cannot be written as BSON: "
        .. tostring(berr), 2)
    end
    encoded[i], olds[i] = one, old
  end
  if self.core:closed() then
    for i, d in ipairs(docs) do unstamp(self, d, olds[i]) end
    return nil, "closed"
  end
  if #docs == 0 then return true, {} end
  local r, err, code, reply = command(self, self.db, { insert = self.coll },
    { documents = encoded, ordered = false })
  local results = {}
  for i = 1, #docs do results[i] = true end
  reply = r or reply
  if not r and not (reply and reply.writeErrors) then
    for i, d in ipairs(docs) do d[self.field] = olds[i].v end
    return nil, err, code
  end
  local all = true
  if reply.writeErrors then
    for _, we in ipairs(reply.writeErrors) do
      local i = we.index + 1
      results[i] = we.errmsg or "write error"
      docs[i][self.field] = olds[i].v
      all = false
    end
  end
  if all then return true, results end
  return nil, results
end

-- sends one update command with a statement per document; results[i] =
-- true | "conflict" | "not found" | message; conflicting documents'
-- current state in currents[i] (read in one more round trip)
local function write_many(self, docs, changes)
  local n = #docs
  local updates, ids, vs = {}, {}, {}
  for i, d in ipairs(docs) do
    ids[i], vs[i] = d._id, d[self.field]
    updates[i] = { q = { _id = ids[i] }, u = pipeline(self, vs[i], changes[i], "bulk"),
      upsert = true, multi = false }
  end
  local r, err, code, reply = command(self, self.db, { update = self.coll },
    { updates = updates, ordered = false })
  reply = r or reply
  if not r and not (reply and reply.writeErrors) then return nil, err, code end
  local results, currents = {}, {}
  for i = 1, n do results[i] = true end
  local conflicted = {}
  for _, we in ipairs(reply.writeErrors or {}) do
    local i = we.index + 1
    local msg = we.errmsg or ""
    if string_find(msg, "mongolock:conflict", 1, true) then
      results[i] = "conflict"
      conflicted[#conflicted + 1] = ids[i]
    elseif string_find(msg, "mongolock:not found", 1, true) then
      results[i] = "not found"
    else
      results[i] = msg
    end
  end
  for i = 1, n do
    if results[i] == true then docs[i][self.field] = vs[i] + 1 end
  end
  if #conflicted > 0 then
    local fr = command(self, self.db, { find = self.coll },
      { filter = { _id = { ["$in"] = conflicted } } })
    local byid = {}
    if fr and fr.cursor then
      for _, d in ipairs(fr.cursor.firstBatch) do byid[#byid + 1] = d end
    end
    for i = 1, n do
      if results[i] == "conflict" then
        for _, d in ipairs(byid) do
          if core.bson_encode({ v = d._id }) == core.bson_encode({ v = ids[i] }) then
            currents[i] = d
          end
        end
      end
    end
  end
  return results, currents
end

local function check_docs(self, docs, fname)
  check_type(docs, "table", 1, fname, false, 3)
  for i = 1, #docs do
    local d = docs[i]
    if type(d) ~= "table" then argerror(1, fname, "document expected at index " .. i, 3) end
    if d._id == nil then argerror(1, fname, "document " .. i .. " has no _id", 3) end
    local v = d[self.field]
    if type(v) ~= "number" or v % 1 ~= 0 then
      argerror(1, fname, string_format("document %d has no integer %s", i, self.field), 3)
    end
    check_bson({ _id = d._id }, 1, fname, 3, "document " .. i)
  end
end

--- replace for each of docs, in one round trip when nothing conflicts.
-- results, currents = vc:replace_many(docs): results[i] = true |
-- "conflict" | "not found" | message; currents[i] the current document of
-- a conflict.  One round trip when nothing conflicts.
function _M.replace_many(self, docs)
  check_docs(self, docs, "replace_many")
  if self.core:closed() then return nil, "closed" end
  if #docs == 0 then return {}, {} end
  local changes = {}
  for i, d in ipairs(docs) do
    local ok, ch = pcall(replace_stages, self, d, "document " .. i)
    if not ok then argerror(1, "replace_many", ch) end
    changes[i] = ch
  end
  return write_many(self, docs, changes)
end

--- update for each of docs, at each one's version.
-- results, currents = vc:update_many(docs, update): the same update on
-- each document, at each one's version
function _M.update_many(self, docs, update)
  check_docs(self, docs, "update_many")
  local change = update_stages(self, update, 2, "update_many")
  if self.core:closed() then return nil, "closed" end
  if #docs == 0 then return {}, {} end
  local changes = {}
  for i = 1, #docs do changes[i] = change end
  return write_many(self, docs, changes)
end

--- delete for each of docs, at each one's version.
-- results, currents = vc:delete_many(docs): one delete command; a version
-- mismatch raises inside each statement's filter, so conflicts are known
-- per document.  results[i] = true | "conflict" | "not found" | "deleted
-- or not found" (only when some of the batch were deleted and some were
-- missing: the server counts deletions, it does not list them);
-- results.deleted = the count.
function _M.delete_many(self, docs)
  check_docs(self, docs, "delete_many")
  if self.core:closed() then return nil, "closed" end
  local n = #docs
  if n == 0 then return {}, {} end
  local results, currents = {}, {}
  -- one statement per document; every one of them is either deleted
  -- (counted in n), in conflict (a writeError) or not found
  local deletes = {}
  for i, d in ipairs(docs) do
    deletes[i] = { q = { _id = d._id, ["$expr"] = { ["$cond"] = {
      match(self, d[self.field]), true, raise_expr("conflict") } } }, limit = 1 }
  end
  local r, err, code, reply = command(self, self.db, { delete = self.coll },
    { deletes = deletes, ordered = false })
  reply = r or reply
  if not r and not (reply and reply.writeErrors) then return nil, err, code end
  local errs = 0
  for _, we in ipairs(reply.writeErrors or {}) do
    local i = we.index + 1
    local msg = we.errmsg or ""
    results[i] = string_find(msg, "mongolock:conflict", 1, true) and "conflict" or msg
    errs = errs + 1
  end
  local deleted = reply.n or 0
  -- every other statement deleted its document or found none: when the
  -- count says which, the outcome is exact; otherwise (some deleted, some
  -- missing) the server does not say which is which
  local other = deleted == n - errs and true
    or deleted == 0 and "not found"
    or "deleted or not found"
  for i = 1, n do if results[i] == nil then results[i] = other end end
  results.deleted = deleted
  for i = 1, n do
    if results[i] == "conflict" then
      currents[i] = self:get(docs[i]._id)
    end
  end
  return results, currents
end

-- for mongolock.fenced: the same translation into pipeline stages
_M._stages = { update = update_stages, replace = replace_stages, STASH = STASH }

return _M
