-- Puts the tables of one bench/run into doc/benchmarks.md, replacing those of
-- the run before: each file DIR/NAME.md goes between the marker comments
--
--   <!-- bench:NAME -->
--   <!-- /bench:NAME -->
--
-- of DOC, whatever was there.  A block with no file (a benchmark this run
-- skipped) keeps its tables; a file with no block is an error, as are
-- markers that do not pair up.  ROOT (the checkout's path) and the server's
-- port are left out of the text, so that two runs differ only in figures.
--
--   lua5.4 bench/splice.lua DOC DIR [ROOT]

local doc, dir, root = arg[1], arg[2], arg[3]
if not (doc and dir) then
  io.stderr:write("usage: splice.lua DOC DIR [ROOT]\n")
  os.exit(2)
end

local function fail(msg)
  io.stderr:write("splice.lua: ", msg, "\n")
  os.exit(1)
end

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local text = read(doc) or fail("cannot read " .. doc)

-- the blocks of the document, in order: name -> true
local blocks = {}
local pos = 1
while true do
  local s, e, name = text:find("<!%-%- bench:([%w-]+) %-%->\n", pos)
  if not s then break end
  if blocks[name] then fail("two blocks <!-- bench:" .. name .. " -->") end
  local close = "<!-- /bench:" .. name .. " -->"
  local c = text:find(close, e + 1, true)
  local next_open = text:find("<!-- bench:", e + 1, true)
  if not c or (next_open and next_open < c) then fail("<!-- bench:" .. name .. " --> has no " .. close) end
  blocks[name] = true
  pos = c + #close
end
local nblocks, ncloses = 0, select(2, text:gsub("<!%-%- /bench:", ""))
for _ in pairs(blocks) do nblocks = nblocks + 1 end
if ncloses ~= nblocks then fail("a closing marker without its block") end

local function clean(s)
  if root and root ~= "" then
    s = s:gsub(root:gsub("%p", "%%%0") .. "/", "")
  end
  s = s:gsub("(127%.0%.0%.1):%d+", "%1:PORT")
  s = s:gsub("^\n+", "")
  if s:sub(-1) ~= "\n" then s = s .. "\n" end
  return s
end

local p = io.popen("ls " .. ("'" .. dir:gsub("'", "'\\''") .. "'") .. " 2>/dev/null")
local files = {}
for f in p:lines() do
  local name = f:match("^([%w-]+)%.md$")
  if name then files[#files + 1] = name end
end
p:close()
table.sort(files)

for _, name in ipairs(files) do
  if not blocks[name] then fail("no block <!-- bench:" .. name .. " --> in " .. doc) end
  local body = clean(read(dir .. "/" .. name .. ".md") or "")
  local open = "<!-- bench:" .. name .. " -->\n"
  local close = "<!-- /bench:" .. name .. " -->"
  local s = text:find(open, 1, true)
  local c = text:find(close, s + #open, true)
  text = text:sub(1, s + #open - 1) .. body .. text:sub(c)
end

local f = assert(io.open(doc, "wb"))
f:write(text)
f:close()
