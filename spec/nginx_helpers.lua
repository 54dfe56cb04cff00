-- A real nginx (Debian's, with lua-nginx-module on LuaJIT) running
-- examples/nginx/nginx.conf on a free loopback port against helpers.uri(),
-- and HTTP clients for it (luasocket): for spec/nginx_spec.lua and
-- bench/nginx.lua.
--
--   local nx = require "nginx_helpers"
--   local nginx = nx.start({ locations =, files =, edit = })  -- :stop()
--   nx.get(port, path)                      code, body (one connection)
--   nx.open_pingers(port, workers, per)     keep-alive connections, per worker
--   nx.keepalive_get(sock, path)            code, body on one of them
--   nx.keepalive_read(sock)                 code, body of a request sent on it
--   nx.load(port, path, n, pingers, opts)   n requests at once, /ping timed
--   nx.percentile(sorted, p), nx.summary(latencies)
local helpers = require "helpers"
local socket = require "socket"

local format = string.format
local q = helpers.shell_quote
-- nginx gets symbolic links to the tree: they need an absolute path
local root = helpers.root
if root:sub(1, 1) ~= "/" then root = assert(os.getenv("PWD")) .. "/" .. root end

local _M = { root = root, EXAMPLE = root .. "/examples/nginx/nginx.conf" }
local EXAMPLE = _M.EXAMPLE

local function sh(cmd)
  local ok = os.execute(cmd)
  return ok == true or ok == 0
end

local function poll(fn, timeout, what)
  local deadline = socket.gettime() + timeout
  repeat
    local v = fn()
    if v then return v end
    socket.sleep(0.02)
  until socket.gettime() > deadline
  error("timed out waiting for " .. what, 2)
end

-- ---- the nginx we start ------------------------------------------------------

local Nginx = {}
Nginx.__index = Nginx

-- a prefix directory whose lua/, build/, examples/ and spec/ are the
-- tree's (or opts.root's), with the example's config on a free port,
-- against helpers.uri() or the URI in the file opts.uri_file.
-- opts.locations: text added before
-- the example's /ping location; opts.files: name -> content written to the
-- prefix; opts.edit(conf): the config changed further (returns it).
local WORKER_PID = [[
        location = /worker-pid {
            return 200 $pid;
        }

]]

-- As root, nginx runs its workers as nobody, who may not read the tree (a
-- checkout in a private directory: root's home is mode 0700 on Debian):
-- then they run as the invoking user and group.  "" when not root (nginx
-- does not change its workers' user then).
local function user_directive()
  local p = assert(io.popen("id -u; id -un; id -gn"))
  local uid, user, group = p:read("*l"), p:read("*l"), p:read("*l")
  p:close()
  if uid ~= "0" then return "" end
  return format("user %s %s;\n", user, group)
end

-- true when a socket bound without SO_REUSEPORT can take 127.0.0.1:port,
-- that is, when no socket holds it (one of another nginx with reuseport
-- included)
local function port_free(port)
  local s = assert(socket.tcp())
  local ok = s:bind("127.0.0.1", port)
  s:close()
  return ok ~= nil
end

local function start_nginx(opts)
  opts = opts or {}
  local example = assert(helpers.read_file(EXAMPLE))
  local prefix = os.tmpname()
  os.remove(prefix)
  assert(sh(format("mkdir -p %s/logs %s/conf", q(prefix), q(prefix))))
  for _, d in ipairs({ "lua", "build", "examples", "spec" }) do
    local src = (opts.root or root) .. "/" .. d
    if d ~= "spec" or not opts.root then
      assert(sh(format("ln -s %s %s", q(src), q(prefix .. "/" .. d))))
    end
  end
  local log = prefix .. "/logs/error.log"
  for name, content in pairs(opts.files or {}) do
    local g = assert(io.open(prefix .. "/" .. name, "w"))
    g:write(content)
    g:close()
  end
  for _ = 1, 10 do
    local port = math.random(20000, 60000)
    -- a port another nginx holds with reuseport would be shared with it (the
    -- kernel spreads the connections over both): only a port a plain socket
    -- can bind (nothing holds it) is taken
    if port_free(port) then
      -- reuseport: the kernel spreads connections over the workers by their
      -- addresses, so that a loaded machine's busiest worker does not accept
      -- them all (open_pingers wants some on each worker)
      local conf, n = example:gsub("listen 127%.0%.0%.1:8080;", format("listen 127.0.0.1:%d reuseport;", port))
      assert(n == 1, "the example's listen directive moved")
      -- /worker-pid (open_pingers) and the caller's locations
      local locations = WORKER_PID .. (opts.locations or "")
      conf, n = conf:gsub("\n        location = /ping {", "\n" .. locations:gsub("%%", "%%%%") .. "%0")
      assert(n == 1, "the example's /ping location moved")
      conf = user_directive() .. conf
      if opts.edit then conf = opts.edit(conf) end
      os.remove(log)         -- the last attempt's only
      local f = assert(io.open(prefix .. "/conf/nginx.conf", "w"))
      f:write(conf)
      f:close()
      -- the config alone decides where nginx's LuaJIT finds modules
      -- opts.uri_file: a file holding the URI, read by the shell so that no
      -- command line holds it (credentials)
      local uri_word = opts.uri_file and format('"$(cat %s)"', q(opts.uri_file)) or q(helpers.uri())
      if sh(format("env -u LUA_PATH -u LUA_CPATH MONGODB_URI=%s nginx -p %s/ -c conf/nginx.conf -e logs/error.log",
          uri_word, q(prefix))) then
        local self = setmetatable({ prefix = prefix, port = port, log = log }, Nginx)
        self.pid = poll(function()
          return tonumber((helpers.read_file(prefix .. "/logs/nginx.pid") or ""):match("%d+"))
        end, 10, "nginx's pid file")
        return self
      end
      local err = helpers.read_file(log) or ""
      if not err:find("Address already in use", 1, true) then
        error("nginx did not start: " .. err)
      end
    end
  end
  error("no free port for nginx")
end

-- true when process pid is gone, or a zombie (its parent did not reap it)
local function gone(pid)
  local stat = helpers.read_file("/proc/" .. pid .. "/stat")
  return stat == nil or stat:match("^%d+ %b() (%a)") == "Z"
end

-- what the processes in pids (a list) are doing: each one's threads'
-- stacks (gdb, where it is installed), for a request that got no answer
-- or a worker that stays
local function stacks(pids)
  local out, seen = {}, {}
  for _, pid in ipairs(pids) do
    if not seen[pid] then
      seen[pid] = true
      local f = assert(io.popen(format("timeout 20 gdb -p %s -batch -ex 'thread apply all bt 16' 2>/dev/null", pid)))
      -- each thread's functions, threads of the same stack counted once
      local order, count, cur = {}, {}, nil
      local function done()
        if cur then
          if not count[cur] then order[#order + 1] = cur end
          count[cur] = (count[cur] or 0) + 1
        end
      end
      for line in f:lines() do
        if line:find("^Thread ") then done(); cur = ""
        elseif cur and line:find("^#") then
          cur = cur .. " < " .. (line:match(" in ([%w_?.]+) ") or line:match("^#%d+%s+([%w_?.]+) ") or "?")
        end
      end
      done()
      f:close()
      out[#out + 1] = "-- worker " .. pid .. ":"
      for _, st in ipairs(order) do out[#out + 1] = format("%d thread(s): %s", count[st], st:sub(4)) end
    end
  end
  return table.concat(out, "\n")
end

-- stops the nginx we started (its pid file), and waits until it is gone
function Nginx:stop()
  if not self.pid then return end
  -- what a crashed or stuck worker left
  for line in (helpers.read_file(self.log) or ""):gmatch("[^\n]+") do
    if line:find("%[alert%]") or line:find("%[crit%]") or line:find("%[emerg%]") then print("# " .. line) end
  end
  sh(format("kill -QUIT %d 2>/dev/null", self.pid))
  local pid = self.pid
  local ok, err = pcall(poll, function() return gone(pid) end, 20, "nginx to exit")
  if not ok then
    -- a worker that does not exit (it may spin): ended here, so that it
    -- does not outlive the spec, then the failure is reported with the end
    -- of nginx's log and what its processes were doing
    local tail = (helpers.read_file(self.log) or ""):sub(-3000)
    local ps = assert(io.popen(format("ps -o pid,stat,wchan:20,args --ppid %d 2>&1", self.pid))):read("*a")
    -- each worker's TCP connections and threads' stacks: what a worker
    -- shutting down still waits for (its listening sockets are closed)
    local conns = assert(io.popen(format("for p in $(pgrep -P %d); do ss -tanp 2>/dev/null | grep \"pid=$p,\"; "
      .. "done", self.pid))):read("*a")
    local pids = {}
    for w in assert(io.popen(format("pgrep -P %d", self.pid))):read("*a"):gmatch("%d+") do pids[#pids + 1] = w end
    err = err .. "\n-- nginx's log, its end:\n" .. tail .. "\n-- its workers:\n" .. ps .. conns .. stacks(pids)
    sh(format("pkill -KILL -P %d 2>/dev/null; kill -KILL %d 2>/dev/null", self.pid, self.pid))
    self.pid = nil
    error(err, 0)
  end
  self.pid = nil
  sh(format("rm -rf %s", q(self.prefix)))
end

-- ---- HTTP over luasocket ----------------------------------------------------------

local function request_text(path)
  -- HTTP/1.0: the body comes unchunked, the server closes after it
  return format("GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path)
end

-- a connection in flight: connects, sends, reads until the server closes
local function open(port, path)
  local c = assert(socket.tcp())
  c:settimeout(0)
  local ok, err = c:connect("127.0.0.1", port)
  if not ok and err ~= "timeout" then error("connect: " .. err) end
  return { sock = c, path = path, out = request_text(path), sent = 0, buf = {}, t0 = socket.gettime() }
end

-- status code and body of a complete response
local function parse(raw)
  local code = tonumber(raw:match("^HTTP/1%.%d (%d%d%d)"))
  local body = raw:match("\r\n\r\n(.*)$") or ""
  return code, body
end

-- one request, to completion (for /count, /reset)
-- (a request that has no answer in GET_WAIT seconds raises, saying so:
-- every handler the specs call ends within a few seconds, which CI's load
-- may stretch several times)
local GET_WAIT = 30
local function get(port, path)
  local c = assert(socket.connect("127.0.0.1", port))
  c:settimeout(GET_WAIT)
  local t0 = socket.gettime()
  assert(c:send(request_text(path)))
  local raw, err, partial = c:receive("*a")
  c:close()
  if not raw then
    -- the workers listening on port
    local pids = {}
    for pid in assert(io.popen(format("ss -ltnpH 'sport = :%d' 2>/dev/null", port))):read("*a"):gmatch("pid=(%d+)") do
      pids[#pids + 1] = pid
    end
    error(format("GET %s: %s after %.1f s (%d bytes came)\n%s", path, tostring(err), socket.gettime() - t0,
      #(partial or ""), stacks(pids)), 2)
  end
  return parse(raw)
end

-- ---- /ping on keep-alive connections -------------------------------------------

-- A keep-alive connection is served by one worker for its life, as a
-- browser's or a proxy's is: while that worker is stopped, its requests
-- wait.  (A new connection per request would go to whichever worker is free
-- to accept it, and never see the stopped one.)  Each connection pings on a
-- fixed schedule, one ping at a time; a slot that passes while a ping is
-- unanswered counts as a ping sent at that slot and answered with the one
-- in flight (what a request arriving then would have seen: wrk2's
-- correction), so a stopped worker weighs as much as the time it is
-- stopped, not as one slow sample.
local PING_EVERY = 0.05        -- each pinger sends one /ping this often

-- the first complete keep-alive response in buf: code, body, rest | nil
local function keepalive_response(buf)
  local head_end = buf:find("\r\n\r\n", 1, true)
  if not head_end then return nil end
  local head = buf:sub(1, head_end - 1)
  local len = tonumber(head:match("\r\n[Cc]ontent%-[Ll]ength: *(%d+)"))
  assert(len, "no Content-Length in " .. head)
  if #buf < head_end + 3 + len then return nil end
  return tonumber(head:match("^HTTP/1%.%d (%d%d%d)")), buf:sub(head_end + 4, head_end + 3 + len),
    buf:sub(head_end + 4 + len)
end

local function keepalive_text(path)
  return format("GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", path)
end

-- one response on a blocking keep-alive connection: code, body
local function keepalive_read(sock)
  local buf = ""
  while true do
    local code, body = keepalive_response(buf)
    if code then return code, body end
    local data, err, partial = sock:receive(1)
    if not data and err ~= "timeout" then error("keep-alive: " .. err) end
    buf = buf .. (data or partial or "")
  end
end

-- one request on a blocking keep-alive connection: code, body
local function keepalive_get(sock, path)
  assert(sock:send(keepalive_text(path)))
  local buf = ""
  while true do
    local code, body = keepalive_response(buf)
    if code then return code, body end
    local data, err, partial = sock:receive(1)
    if not data and err ~= "timeout" then error("keep-alive " .. path .. ": " .. err) end
    buf = buf .. (data or partial or "")
  end
end

-- keep-alive connections, `per` on each of the `workers` workers (asked
-- for their worker's pid on /worker-pid)
local function open_pingers(port, workers, per)
  local count, list, distinct = {}, {}, 0
  for _ = 1, 200 do
    local c = assert(socket.connect("127.0.0.1", port))
    c:settimeout(10)
    local code, pid = keepalive_get(c, "/worker-pid")
    assert(code == 200, pid)
    count[pid] = (count[pid] or 0) + 1
    if count[pid] <= per then
      list[#list + 1] = { sock = c, pid = pid }
      if count[pid] == per then distinct = distinct + 1 end
      if distinct == workers then return list end
    else
      c:close()
    end
  end
  error("could not open " .. per .. " keep-alive connections to each of " .. workers .. " workers")
end

-- n keep-alive connections to one worker (its sockets)
local function one_worker(port, n)
  local conns, mine, count = open_pingers(port, 1, n), {}, {}
  for _, p in ipairs(conns) do count[p.pid] = (count[p.pid] or 0) + 1 end
  for _, p in ipairs(conns) do
    if count[p.pid] == n then mine[#mine + 1] = p.sock else p.sock:close() end
  end
  return mine
end

local function close_pingers(pingers)
  for _, p in ipairs(pingers) do p.sock:close() end
end

--[[
Sends n requests to path at once (HTTP/1.0, one connection each) and, while
any of them is unanswered, sends /ping every PING_EVERY seconds on each
keep-alive connection of pingers (see above).  Returns the responses
({code, body, took}, in completion order), the ping latencies (seconds; the
pings still unanswered at the end are waited for) and the wall time.  With seconds,
the pings go on at least that long.  The pingers are closed.
]]
local function load(port, path, n, pingers, seconds)
  local conns, done, pings = {}, {}, {}
  for i = 1, n do conns[i] = open(port, path) end
  local t0 = socket.gettime()
  for i, p in ipairs(pingers) do
    p.sock:settimeout(0)
    -- spread over the interval
    p.next_at, p.sent, p.buf = t0 + PING_EVERY * (i - 1) / #pingers, nil, ""
    p.missed = {}
  end
  local active = n
  local deadline = t0 + math.max(45, (seconds or 0) + 15)
  local stop_at = t0 + (seconds or 0)
  while active > 0 or pingers.waiting or socket.gettime() < stop_at do
    local now = socket.gettime()
    local going = active > 0 or now < stop_at
    assert(now < deadline, "the load did not finish in " .. (deadline - t0) .. " s")
    local recvt, sendt, by = {}, {}, {}
    local wait = 0.1
    for _, c in ipairs(conns) do
      by[c.sock] = c
      if c.sent < #c.out then sendt[#sendt + 1] = c.sock else recvt[#recvt + 1] = c.sock end
    end
    pingers.waiting = false
    for _, p in ipairs(pingers) do
      while going and now >= p.next_at do
        if p.sent then
          p.missed[#p.missed + 1] = p.next_at
        else
          -- a few bytes: the socket's buffer takes them whole
          assert(p.sock:send(keepalive_text("/ping")))
          p.sent = now
        end
        p.next_at = p.next_at + PING_EVERY
      end
      if going then wait = math.min(wait, p.next_at - now) end
      if p.sent then
        by[p.sock] = p
        recvt[#recvt + 1] = p.sock
        pingers.waiting = true
      end
    end
    local readable, writable = socket.select(recvt, sendt, math.max(wait, 0.001))
    for _, s in ipairs(writable) do
      local c = by[s]
      local last, err, partial = s:send(c.out, c.sent + 1)
      if last then c.sent = last
      elseif err == "timeout" then c.sent = partial or c.sent
      else error("send " .. c.path .. ": " .. err) end
    end
    for _, s in ipairs(readable) do
      local c = by[s]
      local data, err, partial = s:receive(8192)
      if c.missed then
        -- a pinger
        c.buf = c.buf .. (data or partial or "")
        local code, _, rest = keepalive_response(c.buf)
        if code then
          assert(code == 200, "/ping answered " .. tostring(code))
          local t = socket.gettime()
          pings[#pings + 1] = t - c.sent
          for _, slot in ipairs(c.missed) do pings[#pings + 1] = t - slot end
          c.sent, c.missed, c.buf = nil, {}, rest
        elseif err == "closed" then
          error("the server closed a keep-alive /ping connection")
        end
      else
        c.buf[#c.buf + 1] = data or partial or ""
        if err == "closed" then
          s:close()
          local code, body = parse(table.concat(c.buf))
          done[#done + 1] = { code = code, body = body, took = socket.gettime() - c.t0 }
          active = active - 1
          for i, x in ipairs(conns) do
            if x == c then table.remove(conns, i); break end
          end
        elseif err and err ~= "timeout" then
          error("receive " .. c.path .. ": " .. err)
        end
      end
    end
  end
  close_pingers(pingers)
  return done, pings, socket.gettime() - t0
end

local function percentile(sorted, p)
  if #sorted == 0 then return 0 end
  return sorted[math.max(1, math.ceil(#sorted * p))]
end

-- "N requests, p50 .. ms, p90 .. ms, max .. ms" of unsorted latencies (s)
local function summary(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  return format("%d requests, p50 %.1f ms, p90 %.1f ms, max %.1f ms", #s, percentile(s, 0.5) * 1000,
    percentile(s, 0.9) * 1000, (s[#s] or 0) * 1000)
end

_M.start = start_nginx
_M.sh = sh
_M.poll = poll
_M.gone = gone
_M.get = get
_M.open_pingers = open_pingers
_M.one_worker = one_worker
_M.keepalive_get = keepalive_get
_M.keepalive_read = keepalive_read
_M.load = load
_M.percentile = percentile
_M.summary = summary

return _M
