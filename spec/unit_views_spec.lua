-- #unit: the lock document's fields and the change stream's commands live
-- below the Lua layer.  The command's top and an election's observer show
-- lock documents; the core reads them (csrc/model/protocol_views.c, views.c) and
-- hands up views (holder, waiters, lease left, term, value), and runs
-- their change streams' commands by its machine (csrc/model/stream.c).  So
-- lua/mongolock/cli.lua and lua/mongolock/elections.lua name no field of
-- the lock document and no cursor command.
local helpers = require "helpers"

-- The lock document's fields (csrc/model/protocol.h, protocol_shared.h: the
-- ML_F_* names and the short keys of queue and holders entries), and the
-- names the protocol's reads project (remainingMs, held).
--
-- Fields whose name is the library's own word for the same thing in its
-- answers (st.owner, st.token, h.holder, opts.ttl, st.holders, and Lua's
-- own next) are matched only where only a document has them: as a whole
-- quoted string ("owner", "$owner", "owner.x", "^owner%.") and as a path
-- of an aggregation variable ("$$this.owner").  t is there too: {t, i} is
-- also a cluster time's, which the observer compares.
local API_WORDS = { "owner", "token", "holder", "ttl", "next", "holders", "t" }
-- Fields whose name the library also answers as a value (the states
-- "held", "permits" and "lost", an observer's change "value") are matched only as
-- a field reference ("$value"), a path ("permits.n") and a path of an
-- aggregation variable.
local VALUE_WORDS = { "value", "permits", "held", "lost" }
-- Every other field is also matched as a dotted path (doc.expiresAt, e.h)
-- and as a table constructor's key ({ h = ... }, { x = 1, p = ... }; not
-- a list of names assigned: local ok, m = ..., snap, at = ...).
local DOC_ONLY = { "acquiredAt", "expiresAt", "valueToken", "queue", "squeue", "keeper", "remainingMs", "lockDelay",
                   "until", "w", "p", "h", "o", "m", "tk", "at", "k", "l" }

local FILES = { "lua/mongolock/cli.lua", "lua/mongolock/elections.lua" }

-- the patterns that name field f, as {how, pattern}: tier "api"
-- (API_WORDS), "value" (VALUE_WORDS) or "doc" (DOC_ONLY)
local function patterns(f, tier)
  local list = { { "an aggregation path", "%$%$this%." .. f .. "%f[^%w_]" } }
  if tier == "value" then
    list[#list + 1] = { "a field reference", "[\"']%$+" .. f .. "[\"'%.]" }
    list[#list + 1] = { "a path", "[\"']" .. f .. "%." }
  else
    list[#list + 1] = { "a quoted string", "[\"'][%^%$]*" .. f .. "[\"'%.%%]" }
  end
  if tier == "doc" then
    list[#list + 1] = { "a dotted path", "[%w_%]%)]%." .. f .. "%f[^%w_]" }
    list[#list + 1] = { "a table key", "{%s*" .. f .. "%s*=[^=]" }
    list[#list + 1] = { "a table key", ",%s*" .. f .. "%s*=[^=]", list = true }
  end
  return list
end

-- the line of src around position s
local function line_at(src, s)
  local from = s
  while from > 1 and src:sub(from - 1, from - 1) ~= "\n" do from = from - 1 end
  return src:match("^[^\n]*", from)
end

-- a line that assigns a list of names (local ok, m = ...; snap, at = ...)
local function assigns_names(line)
  return line:match("^%s*local%s") or line:match("^%s*[%w_.]+%s*,[%w_.,%s]*=[^=]")
end

-- "file:line: how (text)" for each place of src naming a field
local function field_hits(file, src)
  local out = {}
  local function scan(names, tier)
    for _, f in ipairs(names) do
      for _, p in ipairs(patterns(f, tier)) do
        local at = 1
        while true do
          local s, e = src:find(p[2], at)
          if not s then break end
          if not (p.list and assigns_names(line_at(src, e))) then
            local line = select(2, src:sub(1, s):gsub("\n", "")) + 1
            out[#out + 1] = string.format("%s:%d: %s as %s (%s)", file, line, f, p[1], src:sub(s, e))
          end
          at = e + 1
        end
      end
    end
  end
  scan(API_WORDS, "api")
  scan(VALUE_WORDS, "value")
  scan(DOC_ONLY, "doc")
  return out
end

-- "file:line: word" for each cursor command named (any case: getMore,
-- op_getmore, killCursors, op_killcursors), comments too
local function command_hits(file, src)
  local out, low = {}, src:lower()
  for _, w in ipairs({ "getmore", "killcursors" }) do
    local at = 1
    while true do
      local s, e = low:find(w, at, true)
      if not s then break end
      local line = select(2, src:sub(1, s):gsub("\n", "")) + 1
      out[#out + 1] = string.format("%s:%d: %s", file, line, src:sub(s, e))
      at = e + 1
    end
  end
  return out
end

local function source(file)
  return assert(helpers.read_file(helpers.root .. "/" .. file), file)
end

describe("#unit views", function()
  it("cli.lua and elections.lua name no field of the lock document", function()
    local hits = {}
    for _, file in ipairs(FILES) do
      for _, h in ipairs(field_hits(file, source(file))) do hits[#hits + 1] = h end
    end
    assert.are.same({}, hits)
  end)

  it("cli.lua and elections.lua send no getMore or killCursors of their own", function()
    local hits = {}
    for _, file in ipairs(FILES) do
      for _, h in ipairs(command_hits(file, source(file))) do hits[#hits + 1] = h end
    end
    assert.are.same({}, hits)
  end)

  it("lists every field the protocol's headers define", function()
    local known = {}
    for _, f in ipairs(API_WORDS) do known[f] = true end
    for _, f in ipairs(VALUE_WORDS) do known[f] = true end
    for _, f in ipairs(DOC_ONLY) do known[f] = true end
    local p = assert(io.popen("find '" .. helpers.root .. "/csrc' -name 'protocol*.h'"))
    local headers = {}
    for path in p:lines() do headers[#headers + 1] = path end
    p:close()
    assert.is_true(#headers >= 2, "the protocol's headers are not found")
    local missing, n = {}, 0
    for _, path in ipairs(headers) do
      local src = assert(helpers.read_file(path))
      for line in src:gmatch("[^\n]+") do
        local name = line:match('^#define%s+ML_F_%w+%s+"([%w_]+)"')
        if name then
          n = n + 1
          if not known[name] then missing[#missing + 1] = name end
          -- the short keys of its entries: /* [{w, t, until, p}] ... */
          local keys = line:match("%[{([%w_,%s]+)}%]")
          for k in (keys or ""):gmatch("[%w_]+") do
            if not known[k] then missing[#missing + 1] = name .. "." .. k end
          end
        end
      end
    end
    assert.is_true(n >= 10, "too few ML_F_ fields found")
    assert.are.same({}, missing)
  end)

  it("matches the forms it means and not words in messages", function()
    local src = table.concat({
      'local a = { ["$match"] = { ["queue.0"] = true } }',
      'local b = { h = "$$this.h", left = x }',
      'local c = doc.expiresAt',
      'local d = e.p == true',
      'if k:match("^holder%.(.+)$") then end',
      'local e = { "$owner", "$value", "permits.n" }',
      'local f = { x = 1, until_ = 2,',
      '  p = 3 }',
    }, "\n")
    local hits = field_hits("sample", src)
    assert.is_true(#hits >= 9, table.concat(hits, "\n"))
    local words = table.concat({
      'print(format("owner     %s", st.owner))',
      'warn("queue length %d until the lease ends", n)',
      'local h, w = st.holder, st.token',
      'local t = { ttl = args.ttl, permits = o.permits, holders = st.holders }',
      'local x = ot.t',
      'snap, at = snapshot()',
      'if st.state == "held" or st.state == "permits" then return "value" end',
    }, "\n")
    assert.are.same({}, field_hits("sample", words))
  end)
  it("keeps Lua and libmongoc out of the views' protocol", function()
    local src = source("csrc/model/protocol_views.c") .. source("csrc/model/protocol_views.h")
    for name in src:gmatch('#include%s*[<"]([^>"]+)') do
      assert.is_nil(name:match("^lua") or name:match("^lauxlib") or name:match("^mongoc")
        or name:match("compat%.h") or name:match("mongolock%.h") or name:match("transport%.h"),
        "protocol_views includes " .. name)
    end
  end)
end)

-- the core's views, fed replies made here (no server)
describe("#unit views of the core", function()
  local core = require "mongolock.core"
  local enc, arr = core.bson_encode, core.array
  local function decode(op) return assert(core.bson_decode(op)) end
  local function batch(docs, extra)
    local cursor = { id = core.Int64(7), firstBatch = arr(docs) }
    for k, v in pairs(extra or {}) do cursor[k] = v end
    return enc({ cursor = cursor, ok = 1 })
  end

  it("builds the queue view and reads its rows as waiters", function()
    local op = decode(core.op_queue_view{ db = "d", coll = "c" })
    assert.equal("cursor", op.kind)
    assert.is_true(op.cmd.pipeline[1]["$match"]["queue.0"]["$exists"])
    local w = core.parse_queue_view(batch({
      { _id = "a", w = arr({ { h = { host = "x", pid = 3, app = "y" }, p = false, left = 1500 },
                             { p = true, left = -5 } }) },
      { _id = "b", w = arr({}) },
    }))
    assert.same({ a = { { host = "x", pid = 3, app = "y", polling = false, remaining = 1.5 },
                        { polling = true, remaining = 0 } }, b = {} }, w)
  end)

  it("reads a leader read's reply once into the election's view", function()
    local doc = { owner = "o", token = 12, value = "v", valueToken = 12, holder = { host = "h", pid = 1 },
                  acquiredAt = core.Date(1000), expiresAt = core.Date(4000), ttl = 3000, held = true,
                  remainingMs = 2500 }
    local reply = enc({ cursor = { id = 0, firstBatch = arr({ doc }) }, ok = 1,
                        operationTime = core.Timestamp(5, 2) })
    local v, ot = core.parse_election(reply)
    assert.same({ t = 5, i = 2 }, ot)
    assert.same({ owner = "o", token = 12, value = "v", value_term = 12, holder = { host = "h", pid = 1 },
                  acquired_at = 1, expires_at = 4, lease_ms = 3000, held = true, remaining = 2.5 }, v)
    local none, none_ot = core.parse_election(enc({ cursor = { id = 0, firstBatch = arr({}) }, ok = 1 }))
    assert.is_false(none)
    assert.is_false(none_ot)
    -- null fields are absent
    v = core.parse_election(enc({ cursor = { id = 0, firstBatch = arr({ { owner = core.null,
      held = false, remainingMs = -20 } }) }, ok = 1 }))
    assert.same({ held = false, remaining = 0 }, v)
  end)

  it("runs an observer's stream by stream.c's machine and gives its events as view changes", function()
    local s = core.view_stream{ db = "d", coll = "c", name = "n", t = 5, i = 2 }
    assert.equal("starting", s:state())
    local open = decode(assert(s:next(1)))
    assert.equal("c", open.cmd.aggregate)
    assert.equal(5, open.cmd.pipeline[1]["$changeStream"].startAtOperationTime.t)
    assert.equal("n", open.cmd.pipeline[2]["$match"]["$or"][1]["documentKey._id"])
    assert.matches("^%x+$", open.session)
    assert.equal(32, #open.session)
    assert.has_error(function() s:next(1) end)     -- its command has no outcome yet
    local events = assert(s:done(batch({
      { operationType = "update", clusterTime = core.Timestamp(6, 1),
        updateDescription = { updatedFields = { owner = core.null, ["holder.host"] = "h2",
                                                ["holder.app"] = core.null, expiresAt = core.Date(9000),
                                                value = "x", queue = arr({}) },
                              removedFields = arr({ "ttl", "next" }) } },
      { operationType = "replace", clusterTime = core.Timestamp(6, 2),
        fullDocument = { _id = "n", owner = "o2", token = 4, queue = arr({}) } },
      { operationType = "delete", clusterTime = core.Timestamp(6, 3) },
      { operationType = "invalidate" },
    }, { postBatchResumeToken = { _data = "aa" } })))
    assert.equal("running", s:state())
    assert.equal(4, #events)
    local u = events[1]
    assert.same({ "update", 6, 1 }, { u.kind, u.t, u.i })
    assert.same({ expires_at = 9, value = "x" }, u.fields)
    assert.same({ owner = true, expires_at = true, value = true }, u.touched)
    assert.same({ owner = true, lease_ms = true }, u.cleared)
    assert.same({ host = "h2" }, u.holder_set)
    assert.same({ app = true }, u.holder_unset)
    assert.same({ kind = "replace", t = 6, i = 2, fields = { owner = "o2", token = 4 } }, events[2])
    assert.same({ kind = "delete", t = 6, i = 3 }, events[3])
    assert.same({ kind = "end" }, events[4])
    -- reads while it runs: a getMore of the cursor, awaiting what it is given
    local more = decode(assert(s:next(2)))
    assert.equal(7, tonumber(tostring(more.cmd.getMore)))
    assert.equal(2000, tonumber(tostring(more.cmd.maxTimeMS)))
    assert.equal(open.session, more.session)
    -- a failed read: its error, then the cursor's end and a new opening
    -- after the last batch's resume token
    assert.same({ nil, "boom", 6 }, { s:done(nil, "boom", 6) })
    local kill = decode(assert(s:next(1)))
    assert.is_not_nil(kill.cmd.killCursors)
    assert.same({}, s:done(enc({ ok = 1 })))
    local again, wait
    for _ = 1, 50 do
      again, wait = s:next(1)
      if again then break end
      assert.is_true(wait > 0 and wait < 1)
      core.sleep(wait)
    end
    again = decode(assert(again))
    assert.same({ _data = "aa" }, again.cmd.pipeline[1]["$changeStream"].resumeAfter)
    assert.are_not.equal(open.session, again.session)
    assert.same({}, assert(s:done(batch({}))))
    -- closed: its last command ends the cursor, then nothing
    s:close()
    assert.is_not_nil(decode(assert(s:next(0))).cmd.killCursors)
    s:done(enc({ ok = 1 }))
    assert.same({ nil, math.huge }, { s:next(0) })
  end)

  it("watches every change of a collection from now, and fails when it cannot open", function()
    local s = core.view_stream{ db = "d", coll = "c" }
    local open = decode(assert(s:next(0)))
    assert.same({}, open.cmd.pipeline[1]["$changeStream"])
    assert.is_not_nil(open.cmd.pipeline[2]["$project"])
    assert.same({ nil, "no change streams", 40573 }, { s:done(nil, "no change streams", 40573) })
    local state, err, code = s:state()
    assert.same({ "failed", "change stream: no change streams", 40573 }, { state, err, code })
    assert.same({ nil, math.huge }, { s:next(0) })
    assert.same({}, core.parse_queue_view(enc({ ok = 1 })))     -- a reply without a cursor
  end)
end)
