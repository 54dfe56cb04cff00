-- #unit: the Lua modules load one way (doc/design.md, "Layers"): the
-- product modules and the adapters (mongolock.ngx, mongolock.ngx.runner,
-- mongolock.sched) load the shared code, which never loads them back (the
-- client carries its runners: mongolock.runners).  Every require of a
-- module under lua/ counts, at load and inside functions (the lazy ones),
-- and so does pcall(require, "...").
local helpers = require "helpers"

local root = helpers.root

-- every Lua file under lua/, as module name -> path
local function modules()
  local p = assert(io.popen("cd " .. helpers.shell_quote(root) .. " && find lua -name '*.lua' | sort"))
  local out = {}
  for f in p:lines() do
    local name = f:match("^lua/(.-)%.lua$"):gsub("/init$", ""):gsub("/", ".")
    out[name] = f
  end
  p:close()
  return out
end

-- the source without its comments (long ones first, then to the end of
-- the line); a "--" in a string may cut a line short, never add a require
local function code(src)
  src = src:gsub("%-%-%[(=*)%[.-%]%1%]", "")
  return (src:gsub("%-%-[^\n]*", ""))
end

-- the modules src requires, by name (each once)
local function requires(src)
  local seen, out = {}, {}
  local function add(name)
    if not seen[name] then seen[name] = true; out[#out + 1] = name end
  end
  src = code(src)
  for name in src:gmatch("require%s*%(?%s*[\"']([%w_%.]+)[\"']") do add(name) end
  for name in src:gmatch("pcall%s*%(%s*require%s*,%s*[\"']([%w_%.]+)[\"']") do add(name) end
  table.sort(out)
  return out
end

-- the require graph among the modules under lua/: name -> {names}
local function graph()
  local mods, g = modules(), {}
  for name, path in pairs(mods) do
    g[name] = {}
    for _, r in ipairs(requires(assert(helpers.read_file(root .. "/" .. path)))) do
      if mods[r] and r ~= name then g[name][#g[name] + 1] = r end
    end
  end
  return g
end

-- the first cycle found (a list of names, the first again at its end), or nil
local function cycle(g)
  local state, stack = {}, {}
  local names = {}
  for name in pairs(g) do names[#names + 1] = name end
  table.sort(names)
  local function visit(n)
    state[n] = "open"
    stack[#stack + 1] = n
    for _, m in ipairs(g[n]) do
      if state[m] == "open" then
        local out, from = {}, nil
        for i, s in ipairs(stack) do if s == m then from = i end end
        for i = from, #stack do out[#out + 1] = stack[i] end
        out[#out + 1] = m
        return out
      elseif state[m] == nil then
        local c = visit(m)
        if c then return c end
      end
    end
    stack[#stack] = nil
    state[n] = "done"
    return nil
  end
  for _, n in ipairs(names) do
    if state[n] == nil then
      local c = visit(n)
      if c then return c end
    end
  end
  return nil
end

describe("#unit the Lua require graph", function()
  it("finds requires at load, inside functions and under pcall, and no comment's", function()
    assert.same({ "a.b", "c", "d_e", "f" }, requires([[
local x = require "a.b"
local function g() return require("c") end
local ok, m = pcall(require, 'd_e')
-- require "commented"
--[==[ require "long.comment" ]==]
local y = require('f')
]]))
    local c = cycle({ a = { "b" }, b = { "c" }, c = { "a" }, d = {} })
    assert.same({ "a", "b", "c", "a" }, c)
    assert.is_nil(cycle({ a = { "b", "c" }, b = { "c" }, c = {} }))
  end)

  -- the adapters, and the modules above them that make clients and give
  -- them their runners
  local ADAPTERS = { ["mongolock.ngx"] = true, ["mongolock.ngx.runner"] = true,
                     ["mongolock.ngx.thread"] = true, ["mongolock.sched"] = true,
                     ["mongolock.sched.luv"] = true, ["mongolock.sched.skynet"] = true,
                     ["mongolock.sched.copas"] = true }
  local TOP = { ["mongolock"] = true, ["resty.mongolock"] = true, ["mongolock.cli"] = true }

  it("keeps the adapters out of the shared code: none of it loads one, even through another module", function()
    local g = graph()
    for name in pairs(g) do
      if not ADAPTERS[name] and not TOP[name] then
        local seen, path = {}, {}
        local function reach(n)
          if seen[n] then return nil end
          seen[n] = true
          path[#path + 1] = n
          if ADAPTERS[n] then return table.concat(path, " -> ") end
          for _, m in ipairs(g[n]) do
            local found = reach(m)
            if found then return found end
          end
          path[#path] = nil
          return nil
        end
        local found = reach(name)
        assert.is_nil(found, found and ("the shared code loads an adapter: " .. found))
      end
    end
  end)

  it("has no cycle among the modules under lua/", function()
    local g = graph()
    assert.truthy(g["mongolock"] and g["mongolock.locks"], "lua/ not found")
    local c = cycle(g)
    assert.is_nil(c, c and ("require cycle: " .. table.concat(c, " -> ")))
  end)
end)
