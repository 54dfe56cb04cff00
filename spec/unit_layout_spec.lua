-- #unit: the transports stay thin (doc/design.md, "The lease engine inside
-- nginx"): what a lease and a change stream do is decided in the C core
-- (csrc/renew.c, csrc/watch.c) for every transport, and OpenResty's own
-- Lua only runs its commands as jobs, keeps time and wakes waiters.  Its
-- size is the measure that tells when a second copy of that behaviour
-- creeps back in.
local helpers = require "helpers"

local LIMIT = 1200

local function lines(path)
  local n = 0
  for _ in assert(io.open(path, "rb")):lines() do n = n + 1 end
  return n
end

-- the local headers src includes, transitively, and the system ones
local function includes(file, seen, out)
  seen, out = seen or {}, out or {}
  if seen[file] then return out end
  seen[file] = true
  local src = assert(helpers.read_file(helpers.root .. "/csrc/" .. file))
  for kind, name in src:gmatch('#include%s*([<"])([^>"]+)') do
    out[#out + 1] = name
    if kind == '"' then includes(name, seen, out) end
  end
  return out
end

describe("#unit layout", function()
  -- the decisions (the protocol, the lease engine, the change stream's
  -- machine) are plain C: what runs them (threads, Lua inside nginx) is
  -- elsewhere
  it("keeps Lua and libmongoc out of the protocol, the lease engine and the change stream's machine", function()
    for _, f in ipairs({ "protocol.c", "protocol_shared.c", "engine.c", "stream.c" }) do
      for _, h in ipairs(includes(f)) do
        assert.is_nil(h:match("^lua") or h:match("^lauxlib") or h:match("^mongoc") or h:match("compat%.h")
          or h:match("mongolock%.h") or h:match("transport%.h"), f .. " includes " .. h)
      end
    end
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
