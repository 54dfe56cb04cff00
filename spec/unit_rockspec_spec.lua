-- #unit: the rockspec ships the product and only the product.
--
--  * every Lua file under lua/ is a module of the rock, under the name its
--    path gives, and every file the rockspec names exists;
--  * every C file under csrc/ is compiled into the module whose
--    luaopen_* it defines (or, without one, into a module of the rock);
--  * test-only modules (a name segment starting with "_", or naming a test,
--    spec or hooks) are never shipped, nor are their C files;
--  * every module the installed files require is shipped, standard,
--    OpenResty's, or a declared dependency (argparse, lua-cjson);
--  * the source is a URL a user can fetch, and the Lua versions are bounded.
-- (tools/check-rock builds the rock with luarocks and loads what it installed.)
local helpers = require "helpers"

local root = helpers.root
local q = helpers.shell_quote

local function lines(cmd)
  local out = {}
  local p = assert(io.popen("cd " .. q(root) .. " && " .. cmd))
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

local function exists(path)
  local f = io.open(root .. "/" .. path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- a module name only the specs may load
local function test_only(name)
  for seg in name:gmatch("[^.]+") do
    if seg:sub(1, 1) == "_" or seg:find("test") or seg:find("spec") or seg:find("hook") then
      return true
    end
  end
  return false
end

-- the rock each third-party module comes from
local ROCK_OF = { argparse = "argparse", cjson = "lua-cjson", ["cjson.safe"] = "lua-cjson" }
-- the standard library, and what OpenResty provides (optional: required under pcall)
local STANDARD = { string = true, table = true, math = true, io = true, os = true,
                   coroutine = true, debug = true, package = true, utf8 = true, bit = true,
                   jit = true, ffi = true, ["table.new"] = true, ["table.clear"] = true }
local function openresty(name)
  return name == "ngx" or name:match("^ngx%.") ~= nil or name:match("^resty%.core") ~= nil
end
-- loaded only when the user asks for them, under pcall (no dependency of
-- the rock): cqueues by connect{scheduler = "cqueues"}, luv by
-- connect{scheduler = "luv"} (mongolock.sched.luv), skynet's lualib and
-- Copas by "skynet" and "copas" (mongolock.sched.skynet, .copas)
local OPTIONAL = { cqueues = true, luv = true, skynet = true, ["skynet.socket"] = true, copas = true }

local function read(path)
  return assert(helpers.read_file(root .. "/" .. path), path)
end

describe("#unit mongolock-scm-1.rockspec", function()
  local spec = {}
  local modules, c_modules = {}, {}

  setup(function()
    local path = root .. "/mongolock-scm-1.rockspec"
    local chunk = assert(loadfile(path, "t", spec) or loadfile(path))
    local setfenv = rawget(_G, "setfenv")          -- Lua 5.1, LuaJIT
    if setfenv then setfenv(chunk, spec) end
    chunk()
    for name, m in pairs(spec.build.modules) do
      modules[name] = m
      if type(m) == "table" then c_modules[name] = m end
    end
  end)

  it("is a builtin rock with a busted test section and libmongoc, libbson", function()
    assert.equal("mongolock", spec.package)
    assert.equal("builtin", spec.build.type)
    assert.equal("busted", spec.test.type)
    assert.is_table(spec.external_dependencies.LIBMONGOC)
    assert.is_table(spec.external_dependencies.LIBBSON)
  end)

  it("takes its source from a URL a user can fetch", function()
    local url = spec.source.url
    assert.is_string(url)
    assert.is_truthy(url:match("^git%+https://[%w.-]+/") or url:match("^https://[%w.-]+/"),
      "source.url is not a public https URL: " .. url)
    assert.is_nil(url:find("file:", 1, true), "source.url is a local path: " .. url)
  end)

  it("declares the Lua versions it is built and tested for", function()
    local lua_dep
    for _, d in ipairs(spec.dependencies) do
      if d:match("^lua%s") then lua_dep = d end
    end
    assert.equal("lua >= 5.1, < 5.5", lua_dep)
  end)

  it("names only files that exist", function()
    for name, m in pairs(modules) do
      if type(m) == "string" then
        assert.is_true(exists(m), name .. ": " .. m .. " does not exist")
      else
        for _, s in ipairs(m.sources) do
          assert.is_true(exists(s), name .. ": " .. s .. " does not exist")
        end
      end
    end
    for _, file in pairs(spec.build.install.bin) do
      assert.is_true(exists(file), file .. " does not exist")
    end
    assert.equal("bin/mongolock", spec.build.install.bin.mongolock)
  end)

  it("ships every Lua module under lua/ and no test-only module", function()
    local shipped = {}
    for _, f in ipairs(lines("find lua -name '*.lua' | sort")) do
      local mod = f:gsub("^lua/", ""):gsub("%.lua$", ""):gsub("/init$", ""):gsub("/", ".")
      if test_only(mod) then
        assert.is_nil(modules[mod], "test-only module " .. mod .. " is in the rockspec")
      else
        assert.equal(f, modules[mod], "module " .. mod .. " (" .. f .. ") missing from the rockspec")
        shipped[mod] = true
      end
    end
    for name, m in pairs(modules) do
      assert.is_false(test_only(name), "test-only module " .. name .. " is in the rockspec")
      if type(m) == "string" then
        assert.is_true(shipped[name] or false, name .. " is listed but is not lua/" .. name:gsub("%.", "/") .. ".lua")
      end
    end
  end)

  it("compiles every C file under csrc/ into the module it belongs to", function()
    local in_module = {}                -- C file -> shipped module names
    for name, m in pairs(c_modules) do
      for _, s in ipairs(m.sources) do
        in_module[s] = in_module[s] or {}
        in_module[s][#in_module[s] + 1] = name
      end
    end
    for _, f in ipairs(lines("ls csrc/*/*.c")) do
      local src = read(f)
      local opens = {}
      for fn in src:gmatch("\nint%s+luaopen_([%w_]+)%s*%(lua_State%s*%*%s*L%s*%)%s*{") do
        opens[#opens + 1] = fn
      end
      for _, fn in ipairs(opens) do
        -- luaopen_mongolock_core -> mongolock.core
        local mod = fn:gsub("_", ".")
        local m = c_modules[mod]
        if not m then
          for name in pairs(c_modules) do
            if name:gsub("%.", "_") == fn then mod, m = name, c_modules[name] end
          end
        end
        if test_only(mod) then
          assert.is_nil(m, "test-only module " .. mod .. " is in the rockspec")
          assert.is_nil(in_module[f], f .. " (test-only " .. mod .. ") is compiled into "
            .. table.concat(in_module[f] or {}, ", "))
        else
          assert.is_table(m, f .. " opens " .. mod .. ", which the rockspec does not build")
          local found = false
          for _, s in ipairs(m.sources) do found = found or s == f end
          assert.is_true(found, f .. " is not among the sources of " .. mod)
        end
      end
      if #opens == 0 and not test_only((f:gsub("^csrc/", ""):gsub("%.c$", ""):gsub("/", "."))) then
        assert.is_table(in_module[f], f .. " is compiled into no module of the rockspec")
      end
    end
  end)

  it("declares every rock the installed files require", function()
    local declared = {}
    for _, d in ipairs(spec.dependencies) do declared[d:match("^[%w_.-]+")] = true end
    local files = {}
    for name, m in pairs(modules) do
      if type(m) == "string" then files[#files + 1] = m end
      assert.is_truthy(name)
    end
    for _, f in pairs(spec.build.install.bin) do files[#files + 1] = f end
    table.sort(files)
    local needs = {}
    for _, f in ipairs(files) do
      local src = read(f):gsub("%-%-%[(=*)%[.-%]%1%]", ""):gsub("%-%-[^\n]*", "")
      for _, pat in ipairs({ "require%s*%(?%s*[\"']([%w_.]+)[\"']", "pcall%(%s*require%s*,%s*[\"']([%w_.]+)[\"']" }) do
        for mod in src:gmatch(pat) do
          if OPTIONAL[mod] then
            local plain = src:gsub("pcall%(%s*require%s*,%s*[\"']" .. mod:gsub("%.", "%%.") .. "[\"']", "")
            assert.is_nil(plain:match("require%s*%(?%s*[\"']" .. mod:gsub("%.", "%%.") .. "[\"']"),
              f .. " requires the optional " .. mod .. " without pcall")
          elseif not modules[mod] and not STANDARD[mod] and not openresty(mod) then
            local rock = ROCK_OF[mod]
            assert.is_string(rock, f .. " requires " .. mod .. ", which is neither shipped nor a known rock")
            assert.is_true(declared[rock] or false, f .. " requires " .. mod .. ": rock " .. rock .. " not declared")
            needs[rock] = true
          end
        end
      end
    end
    -- the command's two rocks, found by the scan above
    assert.is_true(needs.argparse or false)
    assert.is_true(needs["lua-cjson"] or false)
  end)

  it("catches a test-only module or an undeclared rock (the checks can fail)", function()
    assert.is_true(test_only("mongolock._test"))
    assert.is_true(test_only("mongolock.testhooks"))
    assert.is_true(test_only("mongolock.core_hooks"))
    assert.is_false(test_only("mongolock.core"))
    assert.is_false(test_only("mongolock.proc"))
    assert.is_false(test_only("resty.mongolock"))
    assert.is_nil(ROCK_OF["socket"])
  end)
end)
