-- #unit: the transports stay thin (doc/design.md, "The lease engine inside
-- nginx"): what a lease and a change stream do is decided in the C core
-- (csrc/binding/renew.c, csrc/binding/watch.c) for every transport, and OpenResty's own
-- Lua only runs its commands as jobs, keeps time and wakes waiters.  Its
-- size is the measure that tells when a second copy of that behaviour
-- creeps back in.  The plain C parts (the protocol, the lease, its engine,
-- the change stream's machine) prove they are plain by linking alone, with
-- libbson and without Lua or libmongoc, into their test program.
local helpers = require "helpers"

-- (1,200 until round trips ran on cosockets: mongolock.ngx's adapter of
-- nginx's sockets to mongolock.bridge, and its name lookup, are nginx's
-- alone; they re-express nothing of the core; 1,260 until a runner kept
-- its cosocket objects, nginx's own reuse)
local LIMIT = 1280

local function lines(path)
  local n = 0
  for _ in assert(io.open(path, "rb")):lines() do n = n + 1 end
  return n
end

-- the core's layers, top down: a file may include its own folder's headers
-- and those of the folders below it, never one above
local LAYERS = { "binding", "driver", "model" }

-- the folder of csrc/ that holds a header or source, or nil (a system one)
local function folder_of(name)
  for _, d in ipairs(LAYERS) do
    if helpers.read_file(helpers.root .. "/csrc/" .. d .. "/" .. name) then return d end
  end
end

-- the local headers path (under csrc/) includes, transitively, and the
-- system ones
local function includes(path, seen, out)
  seen, out = seen or {}, out or {}
  if seen[path] then return out end
  seen[path] = true
  local src = assert(helpers.read_file(helpers.root .. "/csrc/" .. path))
  for kind, name in src:gmatch('#include%s*([<"])([^>"]+)') do
    out[#out + 1] = name
    local d = kind == '"' and folder_of(name)
    if d then includes(d .. "/" .. name, seen, out) end
  end
  return out
end

-- the plain C parts, and the test program that links them alone
-- (csrc/model/: its test program, test.c, and the parts)
local PLAIN = { "model/engine.c", "model/lease.c", "model/obs.c", "model/stream.c", "model/protocol.c",
                "model/protocol_shared.c", "model/protocol_views.c" }
-- the Lua binding's files whose symbols the plain parts must not use
local BINDING = { "binding/lock.c", "binding/module.c", "binding/stats.c", "binding/args.c", "binding/sys.c",
                  "binding/client.c" }
local CC = os.getenv("CC") or "cc"
local WARN = "-std=gnu99 -Wall -Wextra -Wpedantic -Wshadow -Wmissing-prototypes -Werror"

-- runs a shell command: its combined output and whether it exited 0 (the
-- status echoed: LuaJIT's and Lua 5.1's pclose do not report it)
local function sh(cmd)
  local p = assert(io.popen("{ " .. cmd .. " ; } 2>&1; echo \"exit:$?\"", "r"))
  local out = p:read("*a")
  p:close()
  local status = tonumber(out:match("exit:(%d+)%s*$"))
  return out:gsub("exit:%d+%s*$", ""), status == 0
end

-- a new empty directory (removed by the caller)
local function tmpdir()
  local out, ok = sh("mktemp -d")
  assert(ok, out)
  return (out:gsub("%s+$", ""))
end

local function csrc(f)
  return helpers.shell_quote(helpers.root .. "/csrc/" .. f)
end

-- compiles csrc/f into dir/f.o with flags; asserts it compiled
local function object(dir, f, flags)
  local o = dir .. "/" .. f:gsub("/", "_"):gsub("%.c$", ".o")
  local out, ok = sh(CC .. " " .. WARN .. " " .. flags .. " -c -o " .. helpers.shell_quote(o) .. " " .. csrc(f))
  assert(ok, "cc -c csrc/" .. f .. ":\n" .. out)
  return o
end

-- the symbols an object uses but does not define (nm -u), or defines
-- globally (nm -g --defined-only), as a set
local function symbols(o, defined)
  local out, ok = sh("nm " .. (defined and "-g --defined-only " or "-u ") .. helpers.shell_quote(o))
  assert(ok, out)
  local set = {}
  for name in out:gmatch("[%w_]+%s+([%w_.@]+)\n") do set[name] = true end
  return set
end

describe("#unit layout", function()
  local bson_cflags = (sh("pkg-config --cflags libbson-1.0"):gsub("%s+$", ""))
  local bson_libs = (sh("pkg-config --libs libbson-1.0"):gsub("%s+$", ""))

  -- as hiredis's test.c links its reader alone
  it("links the plain C parts' test program with libbson alone, and it passes", function()
    local dir = tmpdir()
    local srcs = { csrc("model/test.c") }
    for _, f in ipairs(PLAIN) do srcs[#srcs + 1] = csrc(f) end
    local exe = helpers.shell_quote(dir .. "/model")
    local out, ok = sh(CC .. " " .. WARN .. " -I" .. csrc("model") .. " " .. bson_cflags .. " -o " .. exe .. " "
      .. table.concat(srcs, " ")
      .. " " .. bson_libs .. " -lpthread -lm")
    if ok then out, ok = sh(exe) end
    sh("rm -rf " .. helpers.shell_quote(dir))
    assert(ok, out)
    assert.is_truthy(out:match("\n1%.%.%d+\n") or out:match("^1%.%.%d+\n"), out)
    assert.is_nil(out:match("not ok"), out)
  end)

  it("keeps the plain C parts free of the binding's symbols (" .. table.concat(BINDING, ", ")
     .. "), Lua's and libmongoc's", function()
    local dir = tmpdir()
    local ok, err = pcall(function()
      local binding = {}
      local lua_inc = "-I/usr/include/lua5.4 -I" .. csrc("binding") .. " -I" .. csrc("driver") .. " -I" .. csrc("model")
      local mongoc = (sh("pkg-config --cflags libmongoc-1.0"):gsub("%s+$", ""))
      for _, f in ipairs(BINDING) do
        for name in pairs(symbols(object(dir, f, "-fPIC " .. lua_inc .. " " .. mongoc), true)) do
          binding[name] = f
        end
      end
      for _, f in ipairs(PLAIN) do
        for name in pairs(symbols(object(dir, f, "-I" .. csrc("model") .. " " .. bson_cflags))) do
          assert.is_nil(binding[name], f .. " uses " .. name .. " of " .. tostring(binding[name]))
          assert.is_nil(name:match("^luaL?_") or name:match("^mongoc_"), f .. " uses " .. name)
        end
      end
    end)
    sh("rm -rf " .. helpers.shell_quote(dir))
    assert(ok, err)
  end)

  -- the decisions (the protocol, the lease engine, the change stream's
  -- machine) are plain C: what runs them (threads, Lua inside nginx) is
  -- elsewhere
  it("keeps Lua and libmongoc out of the protocol, the lease engine and the change stream's machine", function()
    for _, f in ipairs(PLAIN) do
      for _, h in ipairs(includes(f)) do
        assert.is_nil(h:match("^lua") or h:match("^lauxlib") or h:match("^mongoc") or h:match("compat%.h")
          or h:match("mongolock%.h") or h:match("transport%.h"), f .. " includes " .. h)
      end
    end
  end)

  -- the folders are the layers: binding (Lua) over driver (libmongoc) over
  -- model (plain C); the separate modules (proc, testing) stand beside
  it("has each folder of csrc/ include only its own headers and those of the layers below", function()
    local p = assert(io.popen("cd " .. helpers.shell_quote(helpers.root .. "/csrc") .. " && ls */*.[ch]"))
    local files, seen = {}, {}
    for f in p:lines() do files[#files + 1] = f end
    p:close()
    for _, d in ipairs(LAYERS) do seen[d] = 0 end
    for _, f in ipairs(files) do
      local d = f:match("^([^/]+)/")
      if seen[d] then seen[d] = seen[d] + 1 end
      local rank = {}
      for i, l in ipairs(LAYERS) do rank[l] = i end
      for name in assert(helpers.read_file(helpers.root .. "/csrc/" .. f)):gmatch('#include%s*"([^"]+)"') do
        local hd = folder_of(name)
        assert.is_truthy(hd, f .. " includes " .. name .. ", found in no layer of csrc/")
        if rank[d] then
          assert.is_true(rank[hd] >= rank[d], f .. " includes " .. hd .. "/" .. name .. ", a layer above its own")
        end
        if d == "model" then
          assert.equal("model", hd, f .. " includes " .. hd .. "/" .. name)
        end
      end
    end
    for _, d in ipairs(LAYERS) do assert.is_true(seen[d] > 0, "csrc/" .. d .. " holds no file") end
  end)

  it("keeps OpenResty-specific Lua (lua/mongolock/ngx*.lua, lua/mongolock/ngx/, lua/resty/) at most "
     .. LIMIT .. " lines", function()
    local p = assert(io.popen("cd " .. helpers.shell_quote(helpers.root)
      .. " && ls lua/mongolock/ngx*.lua lua/mongolock/ngx/*.lua lua/resty/*.lua"))
    local total, each = 0, {}
    for f in p:lines() do
      local n = lines(helpers.root .. "/" .. f)
      total = total + n
      each[#each + 1] = f .. " " .. n
    end
    p:close()
    assert.is_true(#each >= 3, "found " .. #each .. " files")
    assert.is_true(total <= LIMIT, total .. " lines: " .. table.concat(each, ", "))
  end)
end)
