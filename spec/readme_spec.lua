-- #integration: every ```lua block of README.md runs as written against the
-- test server (the stand-in unless MONGODB_URI is set), the Synopsis first,
-- then the others in the order the README gives them.  A block fails when it
-- raises or returns nil and a message.
--
-- The README's conventions, stated there under Synopsis:
--   * the blocks after the Synopsis use `mongolock` and `client` as the
--     Synopsis makes them (the spec gives each block a fresh client on the
--     test server; locals do not carry over from one block to the next);
--   * a block whose first line is `-- not run: <why>` is not run (kept few);
--   * a block whose first line is `-- Lua 5.4` runs only where `<close>`
--     exists (Lua 5.4), and must at least compile there.
-- `os.getenv("MONGODB_URI")` in a block is the test server's URI.  The
-- collections the blocks write to (`client:documents(db, coll)`,
-- `client:versioned(db, coll)`) are dropped first, so that a block inserting
-- a fixed _id runs again on a real MongoDB.
local helpers = require "helpers"
local mongolock = require "mongolock"

local readme = assert(helpers.read_file(helpers.root .. "/README.md"))
local lua54 = _VERSION == "Lua 5.4" and not rawget(_G, "jit")

-- { src, line } in the README's order, then the Synopsis's block moved first
local blocks = {}
local synopsis
do
  local synopsis_at = readme:find("\nSynopsis\n=+\n")
  local pos = 1
  while true do
    local s, e, src = readme:find("\n```lua\n(.-\n)```", pos)
    if not s then break end
    local _, lines = readme:sub(1, s):gsub("\n", "")
    blocks[#blocks + 1] = { src = src, line = lines + 2 }    -- its first line of code
    if synopsis_at and s > synopsis_at and not synopsis then
      synopsis = table.remove(blocks)
      table.insert(blocks, 1, synopsis)
    end
    pos = e + 1
  end
end

local function first_line(src) return src:match("^([^\n]*)") end

-- the collections the blocks write to
local collections = {}
for _, b in ipairs(blocks) do
  for db, coll in b.src:gmatch(":%a+%(%s*\"([%w_]+)\",%s*\"([%w_]+)\"") do
    collections[db .. "." .. coll] = { db, coll }
  end
end

local function env_for(client)
  local uri = helpers.uri()
  local os_ = setmetatable({
    getenv = function(k) if k == "MONGODB_URI" then return uri end return os.getenv(k) end,
  }, { __index = os })
  return setmetatable({ mongolock = client and mongolock, client = client, os = os_ }, { __index = _G })
end

local function pack(...) return { n = select("#", ...), ... } end

local function run(b, client)
  local name = "README.md:" .. b.line
  local chunk, err = load(b.src, "@" .. name, "t", env_for(client))
  assert(chunk, err)
  local res = pack(xpcall(chunk, debug.traceback))
  assert(res[1], res[2])
  if res.n >= 3 and res[2] == nil then
    error(name .. ": the block returned nil, " .. tostring(res[3]), 0)
  end
end

describe("#integration README", function()
  it("has a Synopsis, first of the blocks, and few blocks that are not run", function()
    assert.is_truthy(synopsis, "no ```lua block under Synopsis")
    assert.is_true(#blocks >= 5, "too few ```lua blocks: " .. #blocks)
    local skipped = 0
    for _, b in ipairs(blocks) do
      if first_line(b.src):match("^%-%- not run:") then skipped = skipped + 1 end
    end
    assert.is_true(skipped <= 3, skipped .. " blocks are marked '-- not run:' (at most 3)")
    assert.is_nil(first_line(synopsis.src):match("^%-%- "), "the Synopsis must run everywhere")
  end)

  setup(function()
    local c = helpers.connect()
    for _, dc in pairs(collections) do
      local _, err = c:command(dc[1], { drop = dc[2] })
      assert(_ or tostring(err):match("ns not found") or tostring(err):match("NamespaceNotFound"), err)
    end
    c:close()
  end)

  it("the Synopsis prints the token's exact digits (LuaJIT's print writes 14 significant digits)", function()
    local printed = {}
    local env = env_for(nil)
    rawset(env, "print", function(...)
      local words = {}
      for i = 1, select("#", ...) do words[i] = tostring((select(i, ...))) end
      printed[#printed + 1] = table.concat(words, " ")
    end)
    local chunk = assert(load(synopsis.src, "@README.md:" .. synopsis.line, "t", env))
    local res = pack(xpcall(chunk, debug.traceback))
    assert(res[1], res[2])
    local token
    for _, line in ipairs(printed) do token = token or line:match("token (%S+)$") end
    assert.is_truthy(token, "the Synopsis printed no token: " .. table.concat(printed, "\n"))
    -- tokens are above 10^15: 16 digits, no exponent
    assert.matches("^%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d+$", token)
    local c = helpers.connect()
    local st = assert(c:locks({ ttl = 30 }):status("nightly-report"))
    c:close()
    -- the token of the Synopsis's first acquisition; its try took a later one
    assert.is_true(tonumber(token) <= st.token, token .. " > " .. string.format("%.0f", st.token))
  end)

  for i, b in ipairs(blocks) do
    local head = first_line(b.src)
    local title = ("block %d (README.md:%d) runs as written"):format(i, b.line)
    if head:match("^%-%- not run:") then
      pending(title .. ": " .. head)
    elseif head:match("^%-%- Lua 5%.4") and not lua54 then
      pending(title .. ": Lua 5.4 only")
    else
      it(title, function()
        if i == 1 then
          run(b, nil)            -- the Synopsis makes its own client
        else
          local client = helpers.connect()
          local ok, err = pcall(run, b, client)
          client:close()
          assert(ok, err)
        end
      end)
    end
  end
end)
