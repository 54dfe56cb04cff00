-- #unit: the README documents what the command offers: every long option of
-- `mongolock --help` and of each subcommand's --help, every subcommand, and
-- every exit status the command defines.
local helpers = require "helpers"

local root = helpers.root

local function help(args)
  local p = assert(io.popen("cd " .. helpers.shell_quote(root) .. " && " .. helpers.lua
    .. " bin/mongolock " .. args .. " --help 2>&1"))
  local out = p:read("*a")
  p:close()
  return out
end

describe("#unit README", function()
  local readme
  setup(function()
    readme = assert(helpers.read_file(root .. "/README.md"))
    -- the section about the command
    readme = assert(readme:match("\nThe mongolock command\n=+\n(.-)\n[^\n]+\n=+\n"),
      "no section 'The mongolock command'")
  end)

  it("names every subcommand and every long option of the command's --help", function()
    local top = help("")
    local commands = {}
    for line in ((top:match("\nCommands:\n(.-)\n\n") or "") .. "\n"):gmatch("([^\n]*)\n") do
      local cmd = line:match("^   (%l+)%s")       -- a name; continued text is indented further
      if cmd then commands[#commands + 1] = cmd end
    end
    assert.is_true(#commands >= 5, "no commands found in --help: " .. top)
    local seen = 0
    for _, cmd in ipairs(commands) do
      assert.is_truthy(readme:find("`" .. cmd .. " ", 1, true) or readme:find("mongolock " .. cmd, 1, true),
        "subcommand " .. cmd .. " is not in the README")
      for _, text in ipairs({ cmd == commands[1] and top or "", help(cmd) }) do
        for opt in text:gmatch("%s(%-%-[%l][%l-]+)") do
          if opt ~= "--help" then
            seen = seen + 1
            assert.is_truthy(readme:find(opt, 1, true), opt .. " (mongolock " .. cmd .. ") is not in the README")
          end
        end
      end
    end
    assert.is_true(seen >= 10, "too few options found in --help")
  end)

  it("lists every exit status the command defines", function()
    local cli = require "mongolock.cli"
    for name, code in pairs(cli.EXIT) do
      assert.is_truthy(readme:find("\n| " .. code .. " |", 1, true) or readme:find("\n| " .. code .. ",", 1, true)
        or readme:find(", " .. code .. " |", 1, true),
        "exit status " .. code .. " (" .. name .. ") is not in the README's table")
    end
  end)
end)
