-- #unit: the rockspec installs every Lua module and compiles every C file
-- of the tree (the Makefile builds from csrc/*.c; the rock must match).
local helpers = require "helpers"

local function lines(cmd)
  local out = {}
  local p = assert(io.popen(cmd))
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

describe("#unit mongolock-scm-1.rockspec", function()
  local spec = {}
  setup(function()
    local path = helpers.root .. "/mongolock-scm-1.rockspec"
    local chunk = assert(loadfile(path, "t", spec) or loadfile(path))
    local setfenv = rawget(_G, "setfenv")          -- LuaJIT
    if setfenv then setfenv(chunk, spec) end
    chunk()
  end)

  it("is a builtin rock with a busted test section", function()
    assert.equal("mongolock", spec.package)
    assert.equal("builtin", spec.build.type)
    assert.equal("busted", spec.test.type)
    assert.is_table(spec.external_dependencies.LIBMONGOC)
    assert.is_table(spec.external_dependencies.LIBBSON)
  end)

  it("lists every Lua module under lua/", function()
    local root = helpers.root
    for _, f in ipairs(lines("cd " .. helpers.shell_quote(root) .. " && find lua -name '*.lua' | sort")) do
      local mod = f:gsub("^lua/", ""):gsub("%.lua$", ""):gsub("/init$", ""):gsub("/", ".")
      assert.equal(f, spec.build.modules[mod], "module " .. mod .. " missing from the rockspec")
    end
  end)

  it("compiles every C file under csrc/ into mongolock.core", function()
    local srcs = {}
    for _, s in ipairs(spec.build.modules["mongolock.core"].sources) do srcs[s] = true end
    for _, f in ipairs(lines("cd " .. helpers.shell_quote(helpers.root) .. " && ls csrc/*.c")) do
      assert.is_true(srcs[f] or false, f .. " missing from the rockspec")
    end
  end)
end)
