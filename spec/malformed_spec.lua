-- #integration: malformed input, table-driven.  Every public function gets
-- its catalogue of bad values (wrong types, empty and over-long names,
-- invalid UTF-8, NUL bytes, non-positive / NaN / infinite durations,
-- malformed option tables, wrong self) and must, for each of them:
--   * raise "bad argument #n to 'fname' (...)" pointing at the caller (this
--     file), or return nil, message for a failure that is not the caller's
--     type error (an unusable URI);
--   * never crash the process, never return success;
--   * write nothing: the collections the calls aimed at stay empty, and a
--     lock held during the calls is still held, by the same owner.
local helpers = require "helpers"
local mongolock = require "mongolock"

local pack = table.pack or function(...) return { n = select("#", ...), ... } end
local format = string.format

local THIS = "malformed_spec.lua"
local JIT = rawget(_G, "jit") ~= nil

-- ---- catalogues -------------------------------------------------------------

local udata = io.stdout
local thread = coroutine.create(function() end)
local fn = function() end
local cyclic = {}
cyclic.self = cyclic
local deep = {}
do
  local t = deep
  for _ = 1, 150 do t.x = {}; t = t.x end
end
local tostringy = setmetatable({}, { __tostring = function() return "job" end })
local exploding = setmetatable({}, { __index = function() error("touched") end })

-- values that are not strings (none of them is coerced into a name)
local NOT_STRING = {
  { "nil", nil }, { "true", true }, { "false", false }, { "0", 0 }, { "1", 1 }, { "-1", -1 },
  { "1.5", 1.5 }, { "NaN", 0 / 0 }, { "inf", math.huge }, { "-inf", -math.huge },
  { "2^53", 2 ^ 53 }, { "empty table", {} }, { "sequence", { "a" } }, { "function", fn },
  { "coroutine", thread }, { "userdata", udata }, { "cyclic table", cyclic },
  { "table with __tostring", tostringy }, { "table with a raising __index", exploding },
  { "maxinteger", math.maxinteger or 2 ^ 63 }, { "mininteger", math.mininteger or -2 ^ 63 },
  { "-0.0", -0.0 }, { "1e308", 1e308 }, { "denormal", 5e-324 }, { "io library", io },
  { "table named like a lock", { name = "job" } },
}

-- strings that are not valid names: empty, over 1 KiB, NUL, invalid UTF-8
local BAD_STRING = {
  { "empty", "" }, { "NUL", "\0" }, { "NUL inside", "a\0b" }, { "NUL last", "job\0" },
  { "1025 bytes", ("x"):rep(1025) }, { "64 KiB", ("x"):rep(65536) },
  { "1025 bytes of 2-byte UTF-8", ("é"):rep(512) .. "x" }, { "1024 bytes then NUL", ("x"):rep(1024) .. "\0" },
  { "0xff", "\xff" }, { "0xfe 0xff", "\xfe\xff" }, { "lone continuation", "\x80" },
  { "bad continuation", "\xc3\x28" }, { "truncated 2-byte", "\xc3" }, { "truncated 3-byte", "\xe2\x82" },
  { "truncated 4-byte", "\xf0\x9f\x98" }, { "overlong /", "\xc0\xaf" }, { "overlong 3-byte NUL", "\xe0\x80\x80" },
  { "overlong 4-byte", "\xf0\x80\x80\xaf" }, { "UTF-16 surrogate", "\xed\xa0\x80" },
  { "low surrogate", "\xed\xbf\xbf" }, { "above U+10FFFF", "\xf4\x90\x80\x80" },
  { "5-byte form", "\xf8\x88\x80\x80\x80" }, { "6-byte form", "\xfc\x84\x80\x80\x80\x80" },
  { "valid then 0xff", "job\xff" }, { "latin-1 e-acute", "caf\xe9" },
  { "overlong 2-byte", "\xc1\xbf" }, { "lead byte above U+10FFFF", "\xf5\x80\x80\x80" },
  { "truncated at the end", "job\xef\xbf" }, { "NUL first", "\0job" },
}

local function concat(...)
  local out = {}
  for _, list in ipairs({ ... }) do
    for _, v in ipairs(list) do out[#out + 1] = v end
  end
  return out
end

local BAD_NAME = concat(NOT_STRING, BAD_STRING)

-- durations: non-positive, NaN, infinite, not numbers
local BAD_SECONDS = {
  { "0", 0 }, { "-0.0", -0.0 }, { "-1", -1 }, { "-1e-9", -1e-9 }, { "-inf", -math.huge },
  { "inf", math.huge }, { "NaN", 0 / 0 }, { "-NaN", -(0 / 0) }, { "minint", math.mininteger or -2 ^ 63 },
  { "non-numeric string", "soon" }, { "empty string", "" }, { "table", {} }, { "true", true },
  { "function", fn }, { "userdata", udata },
}
-- timeouts: 0 is one attempt and math.huge no limit, the rest are bad
local BAD_TIMEOUT = {}
for _, c in ipairs(BAD_SECONDS) do
  if not (c[2] == 0 or c[2] == math.huge) then BAD_TIMEOUT[#BAD_TIMEOUT + 1] = c end
end
-- the same for C functions (luaL_checknumber takes "1" as Lua does; the
-- catalogue has no numeric strings)
local BAD_SECONDS_C = BAD_SECONDS

-- option tables: not tables, then one bad field at a time
local function bad_opts(fields)
  local out = {
    { "string", "ttl=1" }, { "number", 1 }, { "true", true }, { "function", fn },
    { "userdata", udata }, { "coroutine", thread },
    { "unknown key", { no_such_option = 1 } }, { "positional value", { 1 } },
  }
  for field, values in pairs(fields) do
    for _, v in ipairs(values) do
      out[#out + 1] = { format("%s = %s", field, v[1]), { [field] = v[2] } }
    end
  end
  table.sort(out, function(a, b) return a[1] < b[1] end)
  return out
end

local NOT_FUNCTION = {
  { "nil", nil }, { "true", true }, { "1", 1 }, { "string", "print" }, { "table", {} },
  { "userdata", udata }, { "coroutine", thread },
}

-- ---- the check --------------------------------------------------------------

-- runs call(value) for every {label, value} of cases; returns the list of
-- labels that misbehaved, with why.  A case passes when the call raises
-- "bad argument #argn to 'fname'" (or "calling 'fname' on bad self"), with
-- no position or this file's, or -- when allow_fail -- returns nil, string.
local function battery(fname, argn, cases, call, allow_fail)
  local bad = {}
  for _, case in ipairs(cases) do
    local label, value = case[1], case[2]
    local r = pack(pcall(call, value))
    if r[1] then
      if not (allow_fail and r[2] == nil and type(r[3]) == "string") then
        bad[#bad + 1] = format("%s: returned %s, %s", label, tostring(r[2]), tostring(r[3]))
      end
      -- a handle handed out for bad input must not stay held
      if type(r[2]) == "userdata" and r[2].release then pcall(r[2].release, r[2]) end
    else
      local msg = tostring(r[2])
      local want1 = format("bad argument #%d to '%s'", argn, fname)
      local want2 = format("calling '%s' on bad self", fname)
      -- LuaJIT names no C function called as a method ('?') and counts self
      local jit_ok = JIT and (msg:find(format("bad argument #%d to '?'", argn), 1, true)
        or msg:find(format("bad argument #%d to '?'", argn + 1), 1, true))
      -- lua-resty-lock's shape names the option: "bad option 'exptime' to 'new'"
      local opt_ok = msg:find(format("bad option '[%%w_]+' to '%s'", fname))
      if not (msg:find(want1, 1, true) or (argn == 1 and msg:find(want2, 1, true)) or jit_ok or opt_ok) then
        bad[#bad + 1] = format("%s: raised %q (wanted %q)", label, msg, want1)
      else
        local where = msg:match("^([^:]*%.lua):%d+:")
        if where and not where:find(THIS, 1, true) then
          bad[#bad + 1] = format("%s: raised at %s, not at the caller: %q", label, where, msg)
        end
      end
    end
  end
  return bad, #cases
end

-- Collects misbehaviours over several batteries; done() fails on any that
-- no entry of `known` (Lua patterns of defects already reported, with the
-- reason) matches, and marks the test pending, listing them, when all are
-- known: the defect stays visible without breaking the suite.
local function tester(known)
  local t = { bad = {}, cases = 0 }
  function t.run(min, ...)
    local bad, n = battery(...)
    assert.is_true(n >= min, format("only %d cases", n))
    for _, b in ipairs(bad) do t.bad[#t.bad + 1] = b end
    t.cases = t.cases + n
    return n
  end
  function t.done()
    local unknown, seen = {}, {}
    for _, b in ipairs(t.bad) do
      local hit
      for pat, why in pairs(known or {}) do
        if b:find(pat) then hit = why end
      end
      if hit then seen[hit] = true else unknown[#unknown + 1] = b end
    end
    assert.same({}, unknown)
    local reasons = {}
    for why in pairs(seen) do reasons[#reasons + 1] = why end
    if #reasons > 0 then
      table.sort(reasons)
      pending(format("known defect (%d of %d cases): %s", #t.bad, t.cases, table.concat(reasons, "; ")))
    end
  end
  return t
end

-- defects found by this spec and not fixed yet: name -> {pattern = why}.
-- A test whose misbehaviours all match is marked pending (listing them)
-- instead of failing; one that matches nothing fails.  Empty: every defect
-- this spec found has been fixed.
local KNOWN = {}

-- documents in db.coll (one count command)
local function count(client, db, coll)
  local r = assert(client:command(db, { count = coll }))
  return r.n
end

-- ---- the specs --------------------------------------------------------------

describe("#integration malformed input", function()
  local client, locks, db
  local total = 0

  setup(function()
    client = helpers.connect()
    locks = helpers.locks(client)
    db = helpers.database
  end)

  teardown(function()
    -- every public function below got at least 50 malformed inputs
    assert.is_true(total >= 50)
    if client then client:close() end
  end)

  -- check(name, body[, known]): a test whose batteries (run) are judged
  -- together at its end
  local t
  local function run(min, ...)
    total = total + t.run(min, ...)
  end
  local function check(name, body, known)
    it(name, function()
      t = tester(known and KNOWN[known])
      body()
      t.done()
    end)
  end

  describe("mongolock.connect", function()
    check("refuses bad URIs without writing", function()
      local cases = concat(NOT_STRING, {
        { "empty", "" }, { "no scheme", "localhost:27017" }, { "http", "http://localhost/" },
        { "scheme only", "mongodb://" }, { "port 99999", "mongodb://127.0.0.1:99999/" },
        { "port -1", "mongodb://127.0.0.1:-1/" }, { "port word", "mongodb://127.0.0.1:port/" },
        { "unclosed IPv6", "mongodb://[::1/" }, { "NUL", "mongodb://127.0.0.1\0:27017/" },
        { "bad escape", "mongodb://%zz@127.0.0.1/" }, { "empty host", "mongodb://,/" },
        { "invalid UTF-8", "mongodb://127.0.0.1/\xff" }, { "srv with port", "mongodb+srv://a.b.c:27017/" },
        { "unknown scheme", "mongo://127.0.0.1/" }, { "64 KiB", "mongodb://" .. ("h"):rep(65536) },
      })
      run(30, "connect", 1, cases, function(v) return mongolock.connect(v) end, true)
    end)

    check("refuses bad options", function()
      local cases = bad_opts {
        appname = { { "number", 1 }, { "table", {} }, { "true", true } },
        write_concern = { { "word", "most" }, { "-1", -1 }, { "1.5", 1.5 }, { "NaN", 0 / 0 },
                          { "table", {} }, { "true", true } },
        pool_size = { { "0", 0 }, { "-1", -1 }, { "1.5", 1.5 }, { "NaN", 0 / 0 }, { "inf", math.huge },
                      { "string", "10" }, { "table", {} } },
        wtimeout = BAD_SECONDS,
        server_selection_timeout = BAD_SECONDS,
        server_timeout = BAD_SECONDS,
      }
      run(50, "connect", 2, cases, function(v) return mongolock.connect(helpers.uri(), v) end)
    end)
  end)

  describe("client:locks", function()
    check("refuses bad options", function()
      local cases = bad_opts {
        database = { { "empty", "" }, { "number", 1 }, { "table", {} } },
        collection = { { "empty", "" }, { "number", 1 }, { "table", {} } },
        ttl = BAD_SECONDS, timeout = BAD_TIMEOUT, step = BAD_SECONDS, max_step = BAD_SECONDS,
        ratio = concat(BAD_SECONDS, { { "0.5", 0.5 } }), expire_after = BAD_SECONDS,
        wait = { { "unknown", "sometimes" }, { "number", 1 }, { "table", {} } },
      }
      run(50, "locks", 1, cases, function(v) return client:locks(v) end)
    end)
  end)

  describe("named locks", function()
    local coll_opts = {
      ttl = BAD_SECONDS, timeout = BAD_TIMEOUT, step = BAD_SECONDS, max_step = BAD_SECONDS,
      ratio = BAD_SECONDS, wait = { { "unknown", "sometimes" }, { "number", 1 }, { "table", {} } },
    }

    for _, fname in ipairs({ "try", "acquire", "status", "force_release" }) do
      check(fname .. " refuses bad names and writes nothing", function()
        run(50, fname, 1, BAD_NAME, function(v) return locks[fname](locks, v) end)
        assert.equal(0, count(client, db, locks.collection))
      end)
    end

    for _, fname in ipairs({ "try", "acquire" }) do
      check(fname .. " refuses bad options and writes nothing", function()
        local name = helpers.unique("malformed")
        run(50, fname, 2, bad_opts(coll_opts), function(v) return locks[fname](locks, name, v) end)
        assert.is_nil((locks:status(name)))
        assert.equal(0, count(client, db, locks.collection))
      end)
    end

    check("with refuses bad names, options and functions, and writes nothing", function()
      local ran = false
      local body = function() ran = true end
      run(50, "with", 1, BAD_NAME, function(v) return locks:with(v, {}, body) end)
      -- (a function in place of opts is with(name, fn, ...), not a mistake)
      local opts = {}
      for _, c in ipairs(bad_opts(coll_opts)) do
        if type(c[2]) ~= "function" then opts[#opts + 1] = c end
      end
      run(50, "with", 2, opts, function(v) return locks:with(helpers.unique("malformed"), v, body) end)
      run(5, "with", 3, NOT_FUNCTION, function(v) return locks:with(helpers.unique("malformed"), {}, v) end)
      assert.is_false(ran)
      assert.equal(0, count(client, db, locks.collection))
    end, "with")

    check("a handle refuses bad ttls and wrong selves, and keeps holding", function()
      local name = helpers.unique("malformed-held")
      local h = assert(locks:acquire(name, { ttl = 30 }))
      local owner = h.owner
      run(15, "extend", 1, BAD_SECONDS_C, function(v) return h:extend(v) end)
      local selves = concat({ { "nil", nil }, { "table", {} }, { "string", "h" }, { "number", 1 },
        { "userdata", udata }, { "coroutine", thread }, { "client", client }, { "locks", locks } })
      run(8, "release", 1, selves, function(v) return h.release(v) end)
      run(8, "extend", 1, selves, function(v) return h.extend(v) end)
      run(8, "remaining", 1, selves, function(v) return h.remaining(v) end)
      run(8, "close", 1, selves, function(v) return h.close(v) end)
      local st = assert(locks:status(name))
      assert.is_true(st.held)
      assert.equal(owner, st.owner)
      assert.is_true(h:remaining() > 25)
      assert.is_true(h:release())
    end)
  end)

  describe("elections", function()
    local el, ecoll
    setup(function()
      ecoll = helpers.unique("malformed_el")
      el = client:elections({ database = db, collection = ecoll })
    end)
    local BAD_VALUE = concat(NOT_STRING, {
      { "NUL", "a\0b" }, { "invalid UTF-8", "\255\254" }, { "16 KiB + 1", ("v"):rep(16385) },
      { "overlong", "\192\128" }, { "surrogate", "\237\160\128" },
    })

    check("client:elections refuses bad options", function()
      local cases = bad_opts {
        database = { { "empty", "" }, { "number", 1 }, { "table", {} } },
        collection = { { "empty", "" }, { "number", 1 }, { "table", {} } },
        ttl = BAD_SECONDS, timeout = BAD_TIMEOUT, step = BAD_SECONDS,
      }
      run(20, "elections", 1, cases, function(v) return client:elections(v) end)
    end)

    check("campaign, leader, observe refuse bad names, values and options, and write nothing", function()
      run(20, "campaign", 1, BAD_NAME, function(v) return el:campaign(v, "x") end)
      run(10, "campaign", 2, BAD_VALUE, function(v) return el:campaign(helpers.unique("malformed"), v) end)
      run(20, "campaign", 3, bad_opts({ ttl = BAD_SECONDS, timeout = BAD_TIMEOUT }),
        function(v) return el:campaign(helpers.unique("malformed"), "x", v) end)
      run(20, "leader", 1, BAD_NAME, function(v) return el:leader(v) end)
      run(20, "observe", 1, BAD_NAME, function(v) return el:observe(v) end)
      run(5, "observe", 2, bad_opts({ timeout = BAD_TIMEOUT }),
        function(v) return el:observe(helpers.unique("malformed"), v) end)
      assert.equal(0, count(client, db, ecoll))
    end)

    check("proclaim refuses bad values and keeps the value", function()
      local name = helpers.unique("malformed")
      local leader = assert(el:campaign(name, "kept"))
      run(10, "proclaim", 1, BAD_VALUE, function(v) return leader:proclaim(v) end)
      assert.equal("kept", assert(el:leader(name)).value)
      assert.is_true(leader:resign())
    end)
  end)

  describe("resty.mongolock", function()
    local resty = require "resty.mongolock"

    check("new, lock and expire refuse bad options, keys and timeouts, and write nothing", function()
      local coll = helpers.unique("resty")
      local base = { uri = helpers.uri(), database = db, collection = coll }
      local function with(field, v)
        local o = {}
        for k, x in pairs(base) do o[k] = x end
        o[field] = v
        return o
      end
      -- (a string is lua-resty-lock's dict_name: new(dict_name, opts))
      local cases = {
        { "dict name with $", "a$b" }, { "empty dict name", "" }, { "dict name with NUL", "a\0b" },
        { "number", 1 }, { "true", true }, { "function", fn }, { "userdata", udata },
        { "unknown option", with("tll", 1) }, { "lua-resty-lock misspelt", with("exptim", 1) },
      }
      for _, f in ipairs({ "exptime", "step", "ratio", "max_step", "server_selection_timeout" }) do
        for _, c in ipairs(BAD_SECONDS) do cases[#cases + 1] = { f .. " = " .. c[1], with(f, c[2]) } end
      end
      for _, c in ipairs(BAD_TIMEOUT) do
        cases[#cases + 1] = { "timeout = " .. c[1], with("timeout", c[2]) }
      end
      for _, c in ipairs({ { "number", 1 }, { "table", {} }, { "true", true } }) do
        cases[#cases + 1] = { "collection = " .. c[1], with("collection", c[2]) }
      end
      cases[#cases + 1] = { "uri = number", with("uri", 27017) }
      run(50, "new", 1, cases, function(v) return resty:new(v) end)
      local obj = assert(resty:new(base))
      run(50, "lock", 1, BAD_NAME, function(v) return obj:lock(v) end)
      run(15, "expire", 1, BAD_SECONDS, function(v) return obj:expire(v) end)
      assert.equal(0, count(client, db, coll))
    end)
  end)

  describe("client:command", function()
    check("refuses bad databases, commands and options", function()
      local dbs = concat(NOT_STRING, {
        { "empty", "" }, { "dot", "a.b" }, { "space", "a b" }, { "dollar", "$x" }, { "slash", "a/b" },
        { "backslash", "a\\b" }, { "quote", 'a"b' }, { "NUL", "a\0b" }, { "64 bytes", ("d"):rep(64) },
      })
      run(25, "command", 1, dbs, function(v) return client:command(v, { ping = 1 }) end)
      local cmds = {
        { "nil", nil }, { "string", "ping" }, { "number", 1 }, { "true", true }, { "function", fn },
        { "userdata", udata }, { "empty", {} }, { "two names", { ping = 1, count = "x" } },
      }
      run(8, "command", 2, cmds, function(v) return client:command(db, v) end)
      local opts = { { "string", "x" }, { "number", 1 }, { "true", true }, { "function", fn } }
      run(4, "command", 3, opts, function(v) return client:command(db, { ping = 1 }, v) end)
    end, "command")
  end)

  describe("document locks", function()
    local docs_coll = helpers.unique("docs")

    check("client:documents refuses bad names and options", function()
      run(40, "documents", 1, BAD_NAME, function(v) return client:documents(v, docs_coll) end)
      run(40, "documents", 2, BAD_NAME, function(v) return client:documents(db, v) end)
      local cases = bad_opts {
        ttl = BAD_SECONDS, timeout = BAD_TIMEOUT,
        fields = { { "string", "lockId" }, { "owner = _id", { owner = "_id" } },
                   { "owner dotted", { owner = "a.b" } }, { "time = $x", { time = "$x" } },
                   { "same fields", { owner = "x", time = "x" } }, { "owner empty", { owner = "" } } },
        time = { { "unknown", "now" }, { "number", 1 } },
        owner_type = { { "unknown", "int" }, { "number", 1 } },
      }
      run(30, "documents", 3, cases, function(v) return client:documents(db, docs_coll, v) end)
    end)

    check("try, lock and status refuse bad ids and options, and write nothing", function()
      local docs = client:documents(db, docs_coll)
      local ids = {
        { "nil", nil }, { "function", fn }, { "coroutine", thread }, { "userdata", udata },
        { "cyclic table", cyclic }, { "150 levels deep", deep }, { "invalid UTF-8", "\xff" },
        { "mixed keys", { 1, a = 2 } }, { "boolean key", { [true] = 1 } },
      }
      for _, fname in ipairs({ "try", "lock", "status" }) do
        run(9, fname, 1, ids, function(v) return docs[fname](docs, v) end, true)
      end
      local opts = bad_opts { ttl = BAD_SECONDS, timeout = BAD_TIMEOUT,
                              insert = { { "string", "doc" }, { "number", 1 }, { "true", true } } }
      for _, fname in ipairs({ "try", "lock" }) do
        run(30, fname, 2, opts, function(v) return docs[fname](docs, "id-1", v) end)
      end
      assert.equal(0, count(client, db, docs_coll))
    end, "documents")
  end)

  describe("optimistic concurrency", function()
    local vc_coll = helpers.unique("versioned")

    check("client:versioned refuses bad names and options", function()
      run(40, "versioned", 1, BAD_NAME, function(v) return client:versioned(v, vc_coll) end)
      run(40, "versioned", 2, BAD_NAME, function(v) return client:versioned(db, v) end)
      local cases = bad_opts {
        field = { { "_id", "_id" }, { "dotted", "a.b" }, { "dollar", "$v" }, { "empty", "" },
                  { "number", 1 }, { "invalid UTF-8", "\xff" } },
        retries = { { "-1", -1 }, { "1.5", 1.5 }, { "NaN", 0 / 0 }, { "string", "3" }, { "table", {} } },
      }
      run(15, "versioned", 3, cases, function(v) return client:versioned(db, vc_coll, v) end)
    end)

    check("writes refuse malformed documents and write nothing", function()
      local vc = client:versioned(db, vc_coll)
      -- (a table whose __index raises is left out: reading the caller's own
      -- fields may raise the caller's own error)
      local not_doc = {}
      for _, c in ipairs(NOT_STRING) do
        if c[2] ~= exploding then not_doc[#not_doc + 1] = c end
      end
      local docs = concat(not_doc, {
        { "no _id", { version = 1 } }, { "no version", { _id = "a" } },
        { "string version", { _id = "a", version = "1" } }, { "float version", { _id = "a", version = 1.5 } },
        { "cyclic", { _id = "a", version = 1, loop = cyclic } }, { "deep", { _id = "a", version = 1, d = deep } },
        { "invalid UTF-8 value", { _id = "a", version = 1, s = "\xff" } },
        { "function value", { _id = "a", version = 1, f = fn } },
        { "mixed keys", { _id = "a", version = 1, m = { 1, x = 2 } } },
        { "boolean key", { _id = "a", version = 1, [true] = 1 } },
        { "NUL in key", { _id = "a", version = 1, ["a\0b"] = 1 } },
      })
      -- insert takes a document without _id or version (the server and the
      -- library add them); replace and delete need both
      local valid_for_insert = { ["empty table"] = true, ["table with __tostring"] = true,
        ["no _id"] = true, ["no version"] = true, ["string version"] = true, ["float version"] = true,
        ["table named like a lock"] = true }
      for _, fname in ipairs({ "insert", "replace", "delete" }) do
        local cases = {}
        for _, c in ipairs(docs) do
          if not (fname == "insert" and valid_for_insert[c[1]]) then cases[#cases + 1] = c end
        end
        run(25, fname, 1, cases, function(v) return vc[fname](vc, v) end, true)
      end
      assert.equal(0, count(client, db, vc_coll))
    end, "versioned")
  end)
end)
