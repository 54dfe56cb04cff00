-- #unit: the LDoc reference (`make doc`, config.ld) is generated from the
-- public modules' doc comments: ldoc runs cleanly, and every function the
-- README's syntax lines name appears in it under the name a program uses
-- (the handle's methods, h:..., are the C core's and are left out), with
-- the public modules' functions that no syntax line names.
local helpers = require "helpers"

local root = helpers.root
local q = helpers.shell_quote

-- named in the reference though no **syntax:** line names them
local MORE = {
  "connect(uri, opts)", "sleep(s)", "monotonic()", "configure(opts)",
  "render(dict)", "start(dict, interval)", "serve(dict)", "sync(dict)",
  "leader:resign()", "leader:proclaim(value)", "observer:next()", "observer:close()",
  "set:release(changes)", "set:get(i)", "set:close()", "set:check()",
  "rw:write(name, opts)", "rw:try_write(name, opts)", "rw:with_write(name, opts, fn, ...)",
  "sem:with(name, opts, fn, ...)", "vc:insert_many(docs)", "vc:replace_many(docs)",
  "vc:update_many(docs, update)", "vc:delete_many(docs)",
}

local function read_all(cmd)
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  return out
end

describe("#unit make doc (LDoc)", function()
  local out, text

  setup(function()
    out = read_all("mktemp -d"):gsub("%s+$", "")
    local log = read_all("cd " .. q(root) .. " && ldoc -d " .. q(out) .. " . 2>&1; echo \"exit:$?\"")
    assert(log:match("exit:0%s*$"), "ldoc failed:\n" .. log)
    assert(not log:lower():find("warning", 1, true) and not log:find("error", 1, true), "ldoc complained:\n" .. log)
    local pages = {}
    for f in read_all("find " .. q(out) .. " -name '*.html'"):gmatch("[^\n]+") do
      pages[#pages + 1] = assert(helpers.read_file(f))
    end
    -- the pages' text, tags and entities left out
    text = table.concat(pages, "\n"):gsub("<[^>]*>", ""):gsub("&amp;", "&"):gsub("&lt;", "<"):gsub("&gt;", ">")
  end)

  teardown(function()
    if out and out ~= "" then os.execute("rm -rf " .. q(out)) end
  end)

  it("config.ld writes under build/doc, from the public modules", function()
    local cfg = assert(helpers.read_file(root .. "/config.ld"))
    assert.is_truthy(cfg:find('dir = "build/doc"', 1, true))
    for _, f in ipairs({ "lua/mongolock.lua", "lua/mongolock/metrics.lua", "lua/resty/mongolock.lua" }) do
      assert.is_truthy(cfg:find('"' .. f .. '"', 1, true), f)
    end
  end)

  it("names every function of the README's syntax lines, as a program calls it", function()
    local readme = assert(helpers.read_file(root .. "/README.md"))
    local names, seen = {}, {}
    for line in readme:gmatch("[^\n]*syntax:[^\n]*\n[^\n]*\n[^\n]*") do
      for recv, sep, f in line:gmatch("([%w_]*)([:.])([%w_]+)%(") do
        local name
        if recv == "h" then name = nil                              -- the C core's handle
        elseif recv == "mongolock" and sep == "." then name = f .. "("
        elseif recv == "mongolock" then name = "resty.mongolock:" .. f .. "("
        elseif recv == "" then name = f .. "("                         -- require(...).render(
        else name = recv .. ":" .. f .. "(" end
        if name and not seen[name] then seen[name] = true; names[#names + 1] = name end
      end
    end
    assert.is_true(#names >= 40, "found " .. #names .. " names in the README's syntax lines")
    local missing = {}
    for _, n in ipairs(names) do
      if not text:find(n, 1, true) then missing[#missing + 1] = n end
    end
    assert.same({}, missing)
  end)

  it("names the public functions no syntax line names", function()
    local missing = {}
    for _, n in ipairs(MORE) do
      if not text:find(n, 1, true) then missing[#missing + 1] = n end
    end
    assert.same({}, missing)
  end)
end)
