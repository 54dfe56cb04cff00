-- #unit: the Lua <-> BSON mapping (csrc/binding/bson.c); no server.
local core = require "mongolock.core"

local jit = rawget(_G, "jit")
local HAS_INT = math.type ~= nil and math.type(1) == "integer"

local enc, dec = core.bson_encode, core.bson_decode

local function roundtrip(t)
  local b = assert(enc(t))
  return assert(dec(b)), b
end

-- BSON type of the value written for key "v" of {v = x}
local function written_type(x)
  local b = assert(enc({ v = x }))
  local json = core.bson_tojson({ v = x })
  return b, json
end

-- deep equality that sees typed values (==), the array marker and NaN
local function same(a, b)
  if a ~= a and b ~= b then return true end
  if type(a) ~= type(b) then return false end
  if type(a) ~= "table" then return a == b end
  if core.is_array(a) ~= core.is_array(b) then
    -- tables written as arrays come back marked: compare as arrays
    if not (core.bsontype(a) == "array" and core.bsontype(b) == "array") then return false end
  end
  for k, v in pairs(a) do if not same(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

describe("#unit BSON mapping", function()
  describe("round trip", function()
    local oid = core.ObjectId("5f1d7b3e9c2a4b0012345678")
    local cases = {
      { "empty document", {} },
      { "string", { s = "hello" } },
      { "empty string", { s = "" } },
      { "string with NUL", { s = "a\0b" } },
      { "UTF-8 string", { s = "h\195\169llo \226\130\172 \240\159\152\128" } },
      { "true/false", { t = true, f = false } },
      { "small integer", { n = 42 } },
      { "negative integer", { n = -7 } },
      { "int32 max", { n = 2147483647 } },
      { "int32 min", { n = -2147483648 } },
      { "int32 max + 1", { n = 2147483648 } },
      { "int32 min - 1", { n = -2147483649 } },
      { "2^53", { n = 9007199254740992 } },
      { "float", { n = 1.5 } },
      { "tiny float", { n = 5e-324 } },
      { "huge float", { n = 1.7976931348623157e308 } },
      { "infinity", { n = math.huge, m = -math.huge } },
      { "NaN value", { n = 0 / 0 } },
      { "nested document", { a = { b = { c = "d" } } } },
      { "array", { a = { 1, "two", 3.5, true } } },
      { "array of documents", { a = { { x = 1 }, { y = 2 } } } },
      { "nested arrays", { a = { { 1, 2 }, { 3, { 4 } } } } },
      { "empty array", { a = core.array() } },
      { "empty array inside array", { a = { core.array(), {} } } },
      { "empty document value", { a = {} } },
      { "null", { a = core.null } },
      { "null in array", { a = { core.null, 1 } } },
      { "ObjectId", { _id = oid } },
      { "Date", { d = core.Date(1700000000123) } },
      { "Date before 1970", { d = core.Date(-1) } },
      { "Binary", { b = core.Binary("\0\1\2\255", 0) } },
      { "Binary UUID", { b = core.Binary(string.rep("\171", 16), 4) } },
      { "empty Binary", { b = core.Binary("") } },
      { "Timestamp", { ts = core.Timestamp(4294967295, 1) } },
      { "Decimal128", { d = core.Decimal128("1234.5678") } },
      { "Decimal128 NaN", { d = core.Decimal128("NaN") } },
      { "Decimal128 -Infinity", { d = core.Decimal128("-Infinity") } },
      -- int64 beyond 2^53: a Lua integer under 5.4, an Int64 value under LuaJIT
      { "Int64 max", { n = core.Int64("9223372036854775807") },
        HAS_INT and { n = math.maxinteger } or nil },
      { "Int64 min", { n = core.Int64("-9223372036854775808") },
        HAS_INT and { n = math.mininteger } or nil },
      { "Regex", { r = core.Regex("^a.*b$", "im") } },
      { "MinKey/MaxKey", { lo = core.MinKey, hi = core.MaxKey } },
      { "keys with dots and dollars", { ["a.b"] = 1, ["$set"] = { x = 1 } } },
      { "empty key", { [""] = 1 } },
      { "long array", (function() local a = {} for i = 1, 1000 do a[i] = i end return { a = a } end)() },
      { "100 levels", (function()
          local d = {} local cur = d
          for _ = 1, 99 do cur.a = {} cur = cur.a end
          return d
        end)() },
    }
    for _, c in ipairs(cases) do
      it(c[1], function()
        local back = roundtrip(c[2])
        assert.is_true(same(c[3] or c[2], back), c[1])
        -- and again: BSON -> Lua -> BSON keeps every value and BSON type
        local again = roundtrip(back)
        assert.is_true(same(back, again))
        for k, v in pairs(back) do
          assert.equal(core.bson_tojson({ v = v }), core.bson_tojson({ v = again[k] }))
        end
      end)
    end

    it("keeps [] and {} apart", function()
      local back = roundtrip({ a = core.array(), d = {} })
      assert.is_true(core.is_array(back.a))
      assert.is_false(core.is_array(back.d))
      assert.equal("array", core.bsontype(back.a))
      assert.equal("document", core.bsontype(back.d))
      assert.is_truthy(core.bson_tojson({ a = core.array(), d = {} }):find('"a" : %['))
    end)

    it("marks every decoded array, and only arrays", function()
      local back = roundtrip({ a = { 1, 2 }, d = { x = 1 } })
      assert.is_true(core.is_array(back.a))
      assert.is_false(core.is_array(back.d))
      assert.is_false(core.is_array(back))
    end)
  end)

  describe("numbers", function()
    local function btype(x)
      local _, json = written_type(x)
      if json:find("numberInt") then return "int32" end
      if json:find("numberLong") then return "int64" end
      if json:find("numberDouble") then return "double" end
      return json
    end

    it("writes int32 when it fits, else int64", function()
      assert.equal("int32", btype(0))
      assert.equal("int32", btype(2147483647))
      assert.equal("int32", btype(-2147483648))
      assert.equal("int64", btype(2147483648))
      assert.equal("int64", btype(-2147483649))
      assert.equal("int64", btype(9007199254740992))
      assert.equal("double", btype(0.5))
      assert.equal("double", btype(1 / -math.huge))   -- -0.0 (Lua 5.1 folds the literal into 0)
      assert.equal("int32", core.bsontype(7))
      assert.equal("int64", core.bsontype(2147483648))
      assert.equal("double", core.bsontype(0.25))
    end)

    if HAS_INT then
      it("Lua 5.4: integers are int32/int64, floats are doubles (even integral ones)", function()
        assert.equal("double", btype(2.0))
        assert.equal("int64", btype(math.maxinteger))
        assert.equal("int64", btype(math.mininteger))
        local back = roundtrip({ a = math.maxinteger, b = math.mininteger, c = 2.0, d = 3 })
        assert.equal(math.maxinteger, back.a)
        assert.equal(math.mininteger, back.b)
        assert.equal("float", math.type(back.c))
        assert.equal("integer", math.type(back.d))
        -- an int64 read from BSON is a Lua integer, exact
        local b = assert(dec(assert(enc({ n = core.Int64("9223372036854775807") }))))
        assert.equal(math.maxinteger, b.n)
      end)
    end

    if jit then
      it("LuaJIT: integral numbers within 2^53 are int32/int64, others doubles", function()
        assert.equal("int32", btype(2.0))
        assert.equal("int64", btype(2 ^ 53))
        assert.equal("int64", btype(-2 ^ 53))
        assert.equal("double", btype(2 ^ 53 + 2))
        assert.equal("double", btype(2 ^ 63))
      end)

      it("LuaJIT: int64 beyond 2^53 comes back as an exact Int64 value", function()
        local b = assert(dec(assert(enc({ n = core.Int64("9007199254740993"), m = core.Int64(5) }))))
        assert.equal("userdata", type(b.n))
        assert.equal("int64", b.n.type)
        assert.equal("9007199254740993", tostring(b.n))
        assert.equal(5, b.m)
        assert.equal(core.Int64("9007199254740993"), b.n)
      end)
    end
  end)

  describe("typed values", function()
    it("ObjectId: hex, tostring, equality, fresh ids differ", function()
      local a = core.ObjectId("5f1d7b3e9c2a4b0012345678")
      assert.equal("5f1d7b3e9c2a4b0012345678", tostring(a))
      assert.equal("5f1d7b3e9c2a4b0012345678", a.hex)
      assert.equal("objectid", a.type)
      assert.equal(a, core.ObjectId("5F1D7B3E9C2A4B0012345678"))
      assert.not_equal(core.ObjectId(), core.ObjectId())
      assert.equal(0x5f1d7b3e, a.time)
    end)

    it("Date: ms, ISO 8601 tostring, ordering", function()
      local d = core.Date(1700000000123)
      assert.equal(1700000000123, d.ms)
      assert.equal("2023-11-14T22:13:20.123Z", tostring(d))
      assert.equal("1969-12-31T23:59:59.999Z", tostring(core.Date(-1)))
      assert.is_true(core.Date(1) < core.Date(2))
      assert.equal(core.Date(5), core.Date(5))
      assert.is_true(core.Date().ms > 1600000000000)
    end)

    it("Binary: data, subtype, tostring", function()
      local b = core.Binary("\1\2", 4)
      assert.equal("\1\2", b.data)
      assert.equal(4, b.subtype)
      assert.equal('Binary(4, "0102")', tostring(b))
      assert.not_equal(core.Binary("\1\2", 0), b)
    end)

    it("Document: a table or BSON bytes, written as that document, unchanged", function()
      local t = { a = 1, s = "x", list = { 1, 2 }, sub = { d = core.Date(5) } }
      local bytes = assert(enc(t))
      for _, d in ipairs({ core.Document(bytes), core.Document(t) }) do
        assert.equal("document", d.type)
        assert.equal("document", core.bsontype(d))
        assert.equal(bytes, d.data)
        -- inside a table, in a document or an array: the same bytes as the table
        assert.equal(assert(enc({ v = t, w = { t } })), assert(enc({ v = d, w = { d } })))
        assert.is_true(same(t, assert(dec(assert(enc({ v = d })))).v))
        assert.equal(core.Document(bytes), d)
        assert.not_equal(core.Document({ a = 2 }), d)
        assert.equal(assert(core.bson_tojson(t)), tostring(d))
      end
      assert.equal("{ }", tostring(core.Document({})))
      -- a table BSON cannot hold, and bytes that are not one well-formed
      -- document: nil, message, as bson_encode and bson_decode answer
      assert.same({ enc({ f = print }) }, { core.Document({ f = print }) })
      assert.same({ nil, "malformed BSON: bad length" }, { core.Document("") })
      assert.is_nil(core.Document(bytes .. "x"))
      assert.is_nil(core.Document(bytes:sub(1, -2)))
      assert.same({ nil, "malformed BSON: a string is not UTF-8" },
        { core.Document((bytes:gsub("x", "\255"))) })
      assert.has_error(function() core.Document(5) end,
        "bad argument #1 to 'Document' (table or BSON bytes expected, got number)")
      assert.has_error(function() core.Document() end)
    end)

    it("Timestamp, Decimal128, Int64, Regex, null, MinKey", function()
      local t = core.Timestamp(10, 3)
      assert.equal(10, t.t)
      assert.equal(3, t.i)
      assert.equal("Timestamp(10, 3)", tostring(t))
      assert.equal("1.10", tostring(core.Decimal128("1.10")))
      assert.equal("-42", tostring(core.Int64(-42)))
      assert.equal(-42, core.Int64(-42).value)
      assert.equal("/a+/i", tostring(core.Regex("a+", "i")))
      assert.equal("null", tostring(core.null))
      assert.equal("null", core.null.type)
      assert.equal(core.null, assert(dec(assert(enc({ v = core.null })))).v)
      assert.equal(core.MinKey, assert(dec(assert(enc({ v = core.MinKey })))).v)
      assert.is_true(core.Int64(1) < core.Int64(2))
      assert.not_equal(core.Int64(1), core.Date(1))
    end)

    it("constructors refuse bad arguments", function()
      assert.has_error(function() core.ObjectId("xyz") end)
      assert.has_error(function() core.ObjectId(string.rep("g", 24)) end)
      assert.has_error(function() core.ObjectId({}) end)
      assert.has_error(function() core.Date("soon") end)
      assert.has_error(function() core.Date(1.5) end)
      assert.has_error(function() core.Binary(nil) end)
      assert.has_error(function() core.Binary("x", 256) end)
      assert.has_error(function() core.Timestamp(-1, 0) end)
      assert.has_error(function() core.Timestamp(0, 2 ^ 32) end)
      assert.has_error(function() core.Decimal128("1.2.3") end)
      assert.has_error(function() core.Decimal128("abc") end)
      assert.has_error(function() core.Int64("12x") end)
      assert.has_error(function() core.Int64("9223372036854775808") end)
      assert.has_error(function() core.Int64("") end)
      assert.has_error(function() core.Int64(0.5) end)
      assert.has_error(function() core.Regex("a", "q") end)
      assert.has_error(function() core.array(5) end)
    end)
  end)

  describe("malformed Lua input is refused with a clear message", function()
    local cyc = {}; cyc.self = cyc
    local cyc2 = { a = { b = {} } }; cyc2.a.b.c = cyc2.a
    local cyc3 = { list = {} }; cyc3.list[1] = cyc3.list
    local deep = {}
    do local cur = deep for _ = 1, 100 do cur.a = {} cur = cur.a end end
    local deep_arr = {}
    do local cur = deep_arr for _ = 1, 150 do cur[1] = {} cur = cur[1] end end
    local bad = {
      { "cycle", cyc, "cycle" },
      { "cycle through a child", cyc2, "cycle" },
      { "cycle in an array", cyc3, "cycle" },
      { "depth 101", { d = deep }, "deeper than 100" },
      { "depth 151 of arrays", { d = deep_arr }, "deeper than 100" },
      { "mixed keys", { a = 1, [1] = 2 }, "mixed" },
      { "mixed keys nested", { x = { 1, 2, k = 3 } }, "mixed" },
      { "holes", { x = { [1] = 1, [3] = 3 } }, "holes" },
      { "index 0", { x = { [0] = 1 } }, "key" },
      { "negative index", { x = { [-1] = 1 } }, "key" },
      { "float key", { x = { [1.5] = 1 } }, "non-integer key" },
      { "infinite key", { x = { [math.huge] = 1 } }, "infinite key" },
      { "boolean key", { x = { [true] = 1 } }, "boolean key" },
      { "table key", { x = { [{}] = 1 } }, "table key" },
      { "function key", { x = { [print] = 1 } }, "function key" },
      { "function value", { f = print }, "function" },
      { "coroutine value", { co = coroutine.create(function() end) }, "thread" },
      { "foreign userdata", { f = io.stdout }, "userdata" },
      { "invalid UTF-8 value", { s = "\255" }, "UTF-8" },
      { "truncated UTF-8", { s = "\195" }, "UTF-8" },
      { "overlong UTF-8", { s = "\192\175" }, "UTF-8" },
      { "surrogate UTF-8", { s = "\237\160\128" }, "UTF-8" },
      { "invalid UTF-8 deep", { a = { b = { "ok", "\254" } } }, "UTF-8" },
      { "invalid UTF-8 key", { ["\255"] = 1 }, "key" },
      { "NUL in key", { ["a\0b"] = 1 }, "NUL" },
      { "string key in marked array", { a = core.array({ x = 1 }) }, "marked as an array" },
      { "top-level array", { 1, 2, 3 }, "document expected" },
      { "top-level marked empty array", core.array(), "document expected" },
    }
    if jit then
      bad[#bad + 1] = { "LuaJIT cdata", { c = rawget(_G, "loadstring")("return 1LL")() }, "cdata" }
    else
      bad[#bad + 1] = { "NaN index in a sequence", { x = { [1] = 1, [2] = 2, [2.5] = 3 } }, "non-integer" }
    end
    -- every position of a bad value in a bigger document
    for i = 1, 22 do
      local t = { ok = "fine", list = { 1, 2, 3 } }
      t["k" .. i] = { { nested = i % 2 == 0 and "\128" or print } }
      bad[#bad + 1] = { "bad value at k" .. i, t, i % 2 == 0 and "UTF-8" or "function" }
    end

    it("has at least 50 cases", function()
      assert.is_true(#bad >= 50)
    end)

    for _, c in ipairs(bad) do
      it(c[1], function()
        local b, err = enc(c[2])
        assert.is_nil(b)
        assert.is_string(err)
        assert.is_truthy(err:find(c[3], 1, true), err)
      end)
    end

    it("says where the bad value is", function()
      local _, err = enc({ a = { b = { 1, 2, "\255" } } })
      assert.is_truthy(err:find("(at a.b.2)", 1, true), err)
    end)

    it("NaN cannot even be a table key in Lua", function()
      assert.has_error(function() rawset({}, 0 / 0, 1) end)
    end)

    it("a table shared (not cyclic) is written twice", function()
      local shared = { x = 1 }
      local back = roundtrip({ a = shared, b = shared })
      assert.equal(1, back.a.x)
      assert.equal(1, back.b.x)
    end)
  end)

  describe("malformed BSON bytes are refused", function()
    local good = assert(enc({ a = "x", b = { 1, 2 }, c = { d = true } }))
    local floor = math.floor
    local function le32(n)
      return string.char(n % 256, floor(n / 256) % 256, floor(n / 65536) % 256, floor(n / 16777216) % 256)
    end
    local inputs = {
      { "empty", "" },
      { "too short", "\5\0\0" },
      { "length too large", le32(100) .. "\0" },
      { "length too small", le32(4) .. "\0" },
      { "no terminator", le32(5) .. "\1" },
      { "truncated", good:sub(1, #good - 3) },
      { "trailing byte", good .. "\0" },
      { "bad type byte", le32(12) .. "\127a\0\0\0\0\0\0" },
      { "string length past end", le32(14) .. "\2a\0" .. le32(99) .. "x\0\0" },
      { "string without NUL", le32(14) .. "\2a\0" .. le32(2) .. "xy\0" },
      { "invalid UTF-8 string", le32(14) .. "\2a\0" .. le32(2) .. "\255\0\0", "not UTF-8" },
      { "invalid UTF-8 string in an array", le32(22) .. "\4a\0" .. le32(14) .. "\0020\0" .. le32(2)
        .. "\255\0\0\0", "not UTF-8" },
      { "invalid UTF-8 key", le32(13) .. "\8\255\0\1\0\0" },
    }
    -- every prefix of a valid document is malformed
    for i = 0, #good - 1, 3 do
      inputs[#inputs + 1] = { "prefix of length " .. i, good:sub(1, i) }
    end
    -- nesting beyond 100 levels
    do
      local inner = le32(5) .. "\0"
      for _ = 1, 101 do inner = le32(#inner + 7) .. "\3a\0" .. inner .. "\0" end
      inputs[#inputs + 1] = { "nested 102 levels", inner }
    end
    for _, c in ipairs(inputs) do
      it(c[1], function()
        local t, err = dec(c[2])
        assert.is_nil(t)
        assert.is_truthy(err:find(c[3] or "malformed BSON", 1, true), err)
        assert.same({ nil, err }, { core.Document(c[2]) })
      end)
    end
    it("decodes the valid one", function()
      local t = assert(dec(good))
      assert.equal("x", t.a)
      assert.equal(2, t.b[2])
      assert.is_true(t.c.d)
    end)
  end)
end)
