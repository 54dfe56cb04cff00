-- Instructions per uncontended resty.mongolock lock + unlock, counted by
-- callgrind: in an nginx worker (one worker, its counters zeroed after a
-- warm-up request and dumped after a request of N cycles) and outside nginx
-- (LuaJIT, a run of N + 100 cycles minus a run of 100), per tree, with the
-- shared libraries that take them.  A count of instructions does not move
-- with the load of a shared machine, where time per cycle moves by 10-30%
-- between runs (bench/nginx.lua, bench/nginx_ab.lua): it shows a change of
-- one percent.  The kernel's part (system calls) is not in it.  Not part of
-- make bench: it compares a change with what came before.
--
--   lua5.4 bench/nginx_cg.lua TREE [TREE...] [N]      (MONGODB_URI set;
--     LUA_PATH with spec/ of either tree; each tree built; valgrind)
--   NGINX_CG_FUNCTIONS=N: also the N functions with the most instructions
--     inside over outside
local nx = require "nginx_helpers"

local format = string.format
local trees, N = {}, 300
for _, a in ipairs(arg) do
  if tonumber(a) then N = tonumber(a) else trees[#trees + 1] = a end
end
if #trees == 0 then
  io.stderr:write("usage: lua5.4 bench/nginx_cg.lua TREE [TREE...] [N]\n")
  os.exit(2)
end

local function say(...) io.stderr:write("bench: ", format(...), "\n") end
local function sh(cmd)
  local ok = os.execute(cmd)
  return ok == true or ok == 0
end

local CYCLES = [==[
local resty = require "resty.mongolock"
local core = require "mongolock.core"
local lock = assert(resty:new({ uri = os.getenv("MONGODB_URI"), collection = "nginx_cg_bench" }))
local key = "cg-" .. core.getpid()
local function cycles(n)
  for _ = 1, n do assert(lock:lock(key)); assert(lock:unlock()) end
  return core.getpid()
end
]==]
local HANDLER = CYCLES .. "ngx.say(cycles(tonumber(ngx.var.arg_n)))\n"
local OUTSIDE = CYCLES .. "cycles(tonumber(arg[1]))\n"
local LOCATION = "        location = /cg { content_by_lua_file cg.lua; }\n"

-- nginx_helpers runs `nginx` from PATH: this script runs again with a
-- directory first in PATH whose nginx runs the real one under callgrind
-- (the worker is forked, so it is traced too)
local dir = os.getenv("NGINX_CG_DIR")
if not dir then
  dir = os.tmpname()
  os.remove(dir)
  assert(sh("mkdir -p " .. dir .. "/bin " .. dir .. "/out"))
  local wrapper = assert(io.open(dir .. "/bin/nginx", "w"))
  wrapper:write("#!/bin/sh\nexec valgrind --tool=callgrind --trace-children=yes -q --compress-strings=no ",
    "--compress-pos=no --callgrind-out-file=", dir, "/out/nginx.%p /usr/sbin/nginx \"$@\"\n")
  wrapper:close()
  assert(sh("chmod +x " .. dir .. "/bin/nginx"))
  local words = {}
  for i = 0, #arg do words[#words + 1] = "'" .. arg[i]:gsub("'", "'\\''") .. "'" end
  local ok = sh(format("NGINX_CG_DIR=%s PATH=%s/bin:\"$PATH\" %s %s", dir, dir, arg[-1], table.concat(words, " ")))
  sh("rm -rf " .. dir)
  os.exit(ok and 0 or 1)
end
local outside = assert(io.open(dir .. "/outside.lua", "w"))
outside:write(OUTSIDE)
outside:close()

-- {total, [object] = instructions}, {["object: function"] = instructions}
-- of a callgrind file (uncompressed names and positions): the cost lines
-- that are not a call's
local function costs(path)
  local t, fns, ob, fn, call = { total = 0 }, {}, "?", "?", false
  for line in io.lines(path) do
    local o = line:match("^ob=(.*)")
    if o then
      ob = o:match("[^/]*$")
      -- the VM is a shared library in nginx, the executable outside
      if ob == "luajit" or ob:find("^libluajit") then ob = "LuaJIT (its VM and collector)"
      elseif ob == "???" then ob = "code the JIT compiled" end
    elseif line:find("^fn=") then fn = ob .. ": " .. line:sub(4)
    elseif line:find("^calls=") then call = true
    elseif line:find("^%d") then
      local n = tonumber(line:match("^%d+ (%d+)"))
      if call then call = false
      elseif n then
        t[ob] = (t[ob] or 0) + n
        t.total = t.total + n
        fns[fn] = (fns[fn] or 0) + n
      end
    end
  end
  return t, fns
end

-- b - a (a: nil or counts of the same kind) per cycle, key by key
local function per_cycle(b, a)
  local t = {}
  for k, v in pairs(b) do t[k] = (v - (a and a[k] or 0)) / N end
  return t
end

-- the keys of a and b but "total", each once
local function keys(a, b)
  local names, seen = {}, { total = true }
  for _, t in ipairs({ a, b }) do
    for k in pairs(t) do
      if not seen[k] then seen[k] = true; names[#names + 1] = k end
    end
  end
  return names
end

-- instructions per cycle in the worker: {total, [object] = n}, {[function] = n}
local function inside(root)
  sh("rm -f " .. dir .. "/out/*")
  local x = nx.start({ root = root, locations = LOCATION, files = { ["cg.lua"] = HANDLER },
    edit = function(c) return (c:gsub("worker_processes%s+%d+;", "worker_processes 1;")) end })
  local ok, res = pcall(function()
    local code, body = nx.get(x.port, "/cg?n=50")             -- connections, index, JIT
    assert(code == 200, body)
    local pid = assert(body:match("%d+"), body)
    sh("callgrind_control -z " .. pid .. " >/dev/null")
    code, body = nx.get(x.port, "/cg?n=" .. N)
    assert(code == 200, body)
    sh("callgrind_control -d " .. pid .. " >/dev/null")
    return pid
  end)
  x:stop()
  assert(ok, res)
  local t, fns = costs(format("%s/out/nginx.%s.1", dir, res))
  return per_cycle(t), per_cycle(fns)
end

-- instructions per cycle outside nginx (LuaJIT, the tree's build)
local function outside_run(root)
  local env = format("LUA_PATH='%s/lua/?.lua;%s/lua/?/init.lua;;' LUA_CPATH='%s/build/luajit/?.so;;'", root, root, root)
  local function run(n)
    local out = format("%s/out/outside.%d", dir, n)
    assert(sh(format("%s valgrind --tool=callgrind -q --compress-strings=no --compress-pos=no "
      .. "--callgrind-out-file=%s luajit %s/outside.lua %d", env, out, dir, n)))
    return costs(out)
  end
  local a, afns = run(100)
  local b, bfns = run(100 + N)
  return per_cycle(b, a), per_cycle(bfns, afns)
end

local rows = {}
for _, root in ipairs(trees) do
  say("%s: %d cycles in an nginx worker under callgrind", root, N)
  local i, ifns = inside(root)
  say("%s: %d cycles outside nginx (LuaJIT) under callgrind", root, N)
  local o, ofns = outside_run(root)
  rows[#rows + 1] = { root = root, inside = i, outside = o, ifns = ifns, ofns = ofns }
end

print(format("| tree (%d cycles) | inside nginx, instructions per cycle | outside (LuaJIT) | inside / outside |", N))
print("|---|---:|---:|---:|")
for _, r in ipairs(rows) do
  print(format("| %s | %.0f | %.0f | %.3f |", r.root, r.inside.total, r.outside.total,
    r.inside.total / r.outside.total))
end
-- where they go: the objects with the most, per tree
for _, r in ipairs(rows) do
  local names = keys(r.inside, r.outside)
  table.sort(names, function(a, b)
    return (r.inside[a] or 0) + (r.outside[a] or 0) > (r.inside[b] or 0) + (r.outside[b] or 0)
  end)
  print(format("\n| %s: object | inside | outside |", r.root))
  print("|---|---:|---:|")
  for k = 1, math.min(8, #names) do
    print(format("| %s | %.0f | %.0f |", names[k], r.inside[names[k]] or 0, r.outside[names[k]] or 0))
  end
end
-- NGINX_CG_FUNCTIONS=N: the N functions with the most instructions inside
-- over outside, per tree (LuaJIT's are named only in a build with symbols:
-- doc/design.md, "Inside nginx: round trips in worker threads")
local top = tonumber(os.getenv("NGINX_CG_FUNCTIONS"))
for _, r in ipairs(rows) do
  if not top then break end
  local names = keys(r.ifns, r.ofns)
  local function extra(k) return (r.ifns[k] or 0) - (r.ofns[k] or 0) end
  table.sort(names, function(a, b) return extra(a) > extra(b) end)
  print(format("\n| %s: function | inside | outside | inside - outside |", r.root))
  print("|---|---:|---:|---:|")
  for k = 1, math.min(top, #names) do
    local name = names[k]
    print(format("| %s | %.0f | %.0f | %.0f |", name, r.ifns[name] or 0, r.ofns[name] or 0, extra(name)))
  end
end
