-- #unit: what a program may depend on is visible.  The public modules are
-- `mongolock`, `resty.mongolock`, `mongolock.metrics` and `configure` of `mongolock.ngx`; every
-- other module (the Lua ones under lua/mongolock/, the C ones mongolock.core,
-- mongolock.proc, mongolock.testing) says in its header that it is internal,
-- and the README names none of them.
local helpers = require "helpers"

local root = helpers.root
local MARK = "Internal to mongolock"

local function internal_files()
  local p = assert(io.popen("cd " .. helpers.shell_quote(root)
    .. " && ls lua/mongolock/*.lua lua/mongolock/ngx/*.lua csrc/binding/module.c csrc/proc/proc.c"
    .. " csrc/testing/testing.c"))
  local files = {}
  for f in p:lines() do
    if f ~= "lua/mongolock/metrics.lua" then files[#files + 1] = f end   -- public
  end
  p:close()
  return files
end


describe("#unit internal modules", function()
  it("say so in their header", function()
    local files = internal_files()
    assert.is_true(#files >= 14, "found " .. #files)
    for _, f in ipairs(files) do
      local src = assert(helpers.read_file(root .. "/" .. f))
      local head = src:match("^/%*.-%*/") or src:match("^%-%-.-\n[^%-]")
      assert.truthy(head, f .. " has no header comment")
      assert.truthy(head:find(MARK, 1, true), f .. ": the header does not say '" .. MARK .. "'")
    end
  end)

  it("are not named in the README", function()
    local readme = assert(helpers.read_file(root .. "/README.md"))
    for _, f in ipairs(internal_files()) do
      local mod = f:match("^lua/(.-)%.lua$")
      mod = mod and mod:gsub("/", ".") or ("mongolock." .. f:match("^csrc/.-([%w_]+)%.c$"))
      -- mongolock.ngx's configure and mongolock.metrics are public
      if mod ~= "mongolock.ngx" and mod ~= "mongolock.metrics" then
        local pat = mod:gsub("%p", "%%%0") .. "[^%w_.]"
        assert.is_nil(readme:find(pat), "the README names " .. mod)
      end
    end
  end)
end)
