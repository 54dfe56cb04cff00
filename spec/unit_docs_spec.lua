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

describe("#unit what a new user runs first", function()
  it("mongolock --version prints the version, exit 0", function()
    local p = assert(io.popen("cd " .. helpers.shell_quote(root) .. " && " .. helpers.lua
      .. " bin/mongolock --version 2>&1; echo rc=$?"))
    local out = p:read("*a")
    p:close()
    local cli = require "mongolock.cli"
    assert.matches("^mongolock " .. cli._VERSION:gsub("%p", "%%%0") .. "[^\n]*\nrc=0\n$", out)
  end)

  it("make run installs what the command needs (lua-argparse, lua-cjson) with the rest", function()
    local p = assert(io.popen("make -s -n -C " .. helpers.shell_quote(root) .. " deps 2>&1"))
    local out = p:read("*a")
    p:close()
    assert.matches("lua%-argparse", out)
    assert.matches("lua%-cjson", out)
  end)

  it("the demo (examples/counter.lua) uses the public API only", function()
    local src = assert(helpers.read_file(root .. "/examples/counter.lua"))
    assert.is_nil(src:find("_core", 1, true), "the demo reaches into client._core")
    assert.is_nil(src:find("mongolock.core", 1, true), "the demo requires mongolock.core")
  end)

  it("the README's Synopsis releases every lock it takes, so that it can run twice", function()
    local readme = assert(helpers.read_file(root .. "/README.md"))
    local synopsis = assert(readme:match("\nSynopsis\n=+\n\n```lua\n(.-)```"))
    -- the try's handle is released when it was taken
    assert.matches('locks:try%("nightly%-report"%)\nif h then\n%s+h:release%(%)', synopsis)
  end)
end)

describe("#integration tools/with-standin", function()
  it("adds ?replicaSet=rs0 to the URI only when the stand-in is a replica set", function()
    local function uri(standin_args)
      local p = assert(io.popen("cd " .. helpers.shell_quote(root) .. " && env -u MONGODB_URI STANDIN_ARGS="
        .. helpers.shell_quote(standin_args) .. " tools/with-standin sh -c 'echo \"$MONGODB_URI\"' 2>&1"))
      local out = p:read("*a")
      p:close()
      return out
    end
    assert.matches("^mongodb://127%.0%.0%.1:%d+/%?replicaSet=rs0\n$", uri(""))
    assert.matches("^mongodb://127%.0%.0%.1:%d+/\n$", uri("--standalone"))
  end)
end)
