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

describe("#unit layout", function()
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
