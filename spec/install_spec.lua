-- The README's LuaJIT install recipe, run as written, gives a command that
-- works; a command whose modules do not load says why, whole.
--
--  * #integration: the lines of the README's Installation block from the
--    first that names LuaJIT run in a bash, in a copy of the tracked files,
--    with HOME a fresh directory, and each `luarocks ... make` given
--    `--tree=<temporary tree> --deps-mode=none` (argparse and cjson come
--    from the system, as tools/check-rock has them); the installed
--    bin/mongolock runs LuaJIT and answers `status` from the test server.
--  * #unit: bin/mongolock with a core that does not load, and without
--    argparse, exits 70 with the loader's whole message on one line.
local helpers = require "helpers"

local root = helpers.root
local q = helpers.shell_quote

-- runs a shell command line; returns its exit status and combined output
local function sh(cmd)
  local p = assert(io.popen("( " .. cmd .. " ) 2>&1; echo \"exit:$?\"", "r"))
  local out = p:read("*a")
  p:close()
  local code = tonumber(out:match("exit:(%d+)%s*$"))
  return code, (out:gsub("exit:%d+%s*$", ""))
end

local function tmpdir()
  local code, out = sh("mktemp -d")
  assert(code == 0, out)
  return (out:gsub("%s+$", ""))
end

-- the README's Installation block, its lines from the first naming LuaJIT
local function luajit_recipe()
  local readme = assert(helpers.read_file(root .. "/README.md"))
  local at = assert(readme:find("\nInstallation\n=+\n"), "no Installation section")
  local block = assert(readme:match("\n```sh\n(.-\n)```", at), "no ```sh block under Installation")
  local lines, on = {}, false
  for line in block:gmatch("([^\n]*)\n") do
    if line:lower():find("luajit", 1, true) then on = true end
    if on and not line:match("^%s*#") and line:match("%S") then lines[#lines + 1] = line end
  end
  return lines
end

describe("#integration README Installation, LuaJIT with LuaRocks", function()
  local work

  teardown(function()
    if work then sh("rm -rf " .. q(work)) end
  end)

  it("installs a bin/mongolock that runs LuaJIT and whose subcommands work", function()
    local recipe = luajit_recipe()
    assert.is_true(#recipe >= 1, "no LuaJIT recipe in the Installation block")
    work = tmpdir()
    local src, tree, home = work .. "/src", work .. "/tree", work .. "/home"
    local code, out = sh("mkdir -p " .. q(src) .. " " .. q(home) .. " && cd " .. q(root)
      .. " && git ls-files -z | xargs -0 cp --parents -t " .. q(src))
    assert(code == 0, out)
    local script = {}
    for _, line in ipairs(recipe) do
      if line:match("^luarocks%s.*%smake%s") then
        line = line:gsub("%s+#.*$", "") .. " --tree=" .. q(tree) .. " --deps-mode=none"
      end
      script[#script + 1] = line
    end
    code, out = sh("cd " .. q(src) .. " && env -u LUA_PATH -u LUA_CPATH HOME=" .. q(home)
      .. " bash -euo pipefail -c " .. q(table.concat(script, "\n")))
    assert(code == 0, "the recipe failed:\n" .. table.concat(script, "\n") .. "\n" .. out)

    local wrapper = assert(helpers.read_file(tree .. "/bin/mongolock"), "no bin/mongolock in the tree")
    assert.is_truthy(wrapper:find("luajit", 1, true), "bin/mongolock does not run LuaJIT:\n" .. wrapper)

    -- the tree's modules only, and the system's argparse and cjson
    local name = helpers.unique("install")
    code, out = sh("cd " .. q(work) .. " && env -u LUA_PATH -u LUA_CPATH HOME=" .. q(home)
      .. " bash -c " .. q('eval "$(luarocks --lua-version=5.1 --tree=' .. q(tree) .. ' path)"; '
        .. 'MONGODB_URI=' .. q(helpers.uri()) .. ' ' .. q(tree .. "/bin/mongolock") .. ' status ' .. q(name)))
    -- a free lock: exit 1 (README, exit statuses), the core loaded
    assert(code == 1, "mongolock status exited " .. tostring(code) .. ":\n" .. out)
    assert.is_truthy(out:find("state%s+free"), out)
  end)
end)

describe("#unit bin/mongolock whose modules do not load", function()
  local work

  setup(function()
    work = tmpdir()
    -- the command alone (away from the source tree, whose build/ it
    -- would use), and a core that is no shared object
    local code, out = sh("cp " .. q(root .. "/bin/mongolock") .. " " .. q(work .. "/mongolock")
      .. " && mkdir -p " .. q(work .. "/c/mongolock")
      .. " && head -c 4096 /dev/zero >" .. q(work .. "/c/mongolock/core.so"))
    assert(code == 0, out)
  end)

  teardown(function()
    if work then sh("rm -rf " .. q(work)) end
  end)

  local function run(lua_path, lua_cpath)
    return sh("LUA_PATH=" .. q(lua_path) .. " LUA_CPATH=" .. q(lua_cpath) .. " MONGODB_URI=mongodb://127.0.0.1:1/ "
      .. helpers.lua .. " " .. q(work .. "/mongolock") .. " status somename </dev/null")
  end

  it("a core that does not load: exit 70, the loader's whole message on one line", function()
    local code, out = run(root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;;", work .. "/c/?.so;;")
    assert.equal(70, code, out)
    assert.is_truthy(out:find("cannot load the mongolock module: error loading module 'mongolock.core'", 1, true), out)
    assert.is_truthy(out:find("invalid ELF header", 1, true), "the cause is cut: " .. out)
    assert.equal(1, select(2, out:gsub("\n", "")), "more than one line: " .. out)
  end)

  it("mongolock.cli that does not load (no argparse): exit 70, the whole message on one line", function()
    local code, out = run(root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua", work .. "/c/?.so")
    assert.equal(70, code, out)
    assert.is_truthy(out:find("cannot load mongolock.cli: ", 1, true), out)
    assert.is_truthy(out:find("module 'argparse' not found", 1, true), out)
    assert.is_truthy(out:find("no file '" .. root .. "/lua/argparse.lua'", 1, true), "the cause is cut: " .. out)
    assert.equal(1, select(2, out:gsub("\n", "")), "more than one line: " .. out)
  end)
end)
