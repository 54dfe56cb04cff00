-- bench/coroutine_rows.lua's rows for a cqueues loop and a Copas loop in
-- this process (skynet's: bench/skynet/cycles.lua).
--
--   lua5.4|luajit bench/frameworks.lua [SECONDS [N,...]]    (MONGODB_URI set)
--
-- Copas is taken from build/copas/lua (make frameworks) when it is there.
-- Prints a Markdown table on stdout (its header only with HEADER=1 unset:
-- bench/run joins it with skynet's rows).
local root = os.getenv("MONGOLOCK_ROOT") or "."
package.path = root .. "/build/copas/lua/?.lua;" .. root .. "/build/copas/lua/?/init.lua;" .. root
  .. "/bench/?.lua;" .. package.path
local rows = require "coroutine_rows"

local uri = assert(os.getenv("MONGODB_URI"), "MONGODB_URI is not set")
local seconds = tonumber(arg[1]) or 3
local counts = {}
for n in (arg[2] or "1,100"):gmatch("%d+") do counts[#counts + 1] = tonumber(n) end

local loops = {}
do
  local ok, cqueues = pcall(require, "cqueues")
  if ok then
    local cq
    loops[#loops + 1] = { name = "cqueues", scheduler = "cqueues",
      spawn = function(fn) cq = cq or cqueues.new(); cq:wrap(fn) end,
      sleep = function(s) cqueues.sleep(s) end,
      run = function() assert(cq:loop()); cq = nil end }
  end
  local okc, copas = pcall(require, "copas")
  if okc then
    loops[#loops + 1] = { name = "Copas", scheduler = "copas",
      spawn = function(fn) copas.addthread(fn) end,
      sleep = function(s) copas.pause(s) end,
      run = function() copas.loop() end }
  end
end

if os.getenv("NO_HEADER") ~= "1" then
  for _, l in ipairs(rows.header()) do print(l) end
end
for _, L in ipairs(loops) do
  for _, line in ipairs(rows.rows(L, uri, seconds, counts)) do
    io.stderr:write("frameworks: ", line, "\n")
    print(line)
  end
end
