-- Credentials (SCRAM) and TLS through every path that opens connections:
-- a plain client, the renewal thread, a change-stream waiter, a forked
-- child, the command and nginx; what a wrong password, an untrusted
-- certificate and a read-only user get; and that the password never shows
-- in an error, the command's output or any process's command line.
--
-- The server is helpers.secure(): a second stand-in with users and TLS, or
-- MONGODB_AUTH_URI / MONGODB_AUTH_RO_URI on a real MongoDB (without them
-- these specs are pending).  URIs reach child processes through a file read
-- by the shell ("$(cat FILE)"), so that no command line holds the password.
local helpers = require "helpers"
local core = require "mongolock.core"
local testing = require "mongolock.testing"
local locks_mod = require "mongolock.locks"
local mongolock = require "mongolock"
local cjson = require "cjson"

local format = string.format
local q = helpers.shell_quote
local BIN = helpers.root .. "/bin/mongolock"
local SERVER_TIMEOUT = 2

-- plain=true find: text never holds the password, raw or percent-encoded
local function assert_no_secret(s, text, what)
  text = tostring(text)
  assert.is_nil(text:find(s.password, 1, true), what .. " shows the password: " .. text)
  assert.is_nil(text:find(helpers.pct_encode(s.password), 1, true), what .. " shows the password: " .. text)
end

-- every process's command line, one a line (ps's view)
local function command_lines()
  local p = assert(io.popen("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <\"$f\"; echo; done 2>/dev/null", "r"))
  local all = p:read("*a")
  p:close()
  return all
end

-- a file (mode 600) holding uri; the shell words that put it in MONGODB_URI
local uri_files = {}
local function uri_env(uri)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(uri)
  f:close()
  uri_files[#uri_files + 1] = path
  return format('MONGODB_URI="$(cat %s)" ', q(path))
end

-- runs bin/mongolock with MONGODB_URI=uri: exit status, stdout, stderr
local function cli(uri, args)
  return helpers.mongolock(args, { env = uri_env(uri) })
end

describe("#integration #auth credentials and TLS", function()
  local s, why, client, locks

  setup(function()
    s, why = helpers.secure()
    if s then
      client = assert(mongolock.connect(s.uri, { appname = "auth-spec", server_timeout = SERVER_TIMEOUT }))
      locks = assert(helpers.locks(client))
    end
  end)
  teardown(function()
    if client then client:close() end
    for _, f in ipairs(uri_files) do os.remove(f) end
  end)

  it("a plain client acquires, reports and releases over TLS with SCRAM credentials", function()
    if not s then return pending(why) end
    local name = helpers.unique("plain")
    local h = assert(locks:acquire(name, { ttl = 30 }))
    local st = assert(locks:status(name))
    assert.is_true(st.held)
    assert.equal(h.owner, st.owner)
    local list = assert(locks:list())
    assert_no_secret(s, cjson.encode(list), "list()")
    assert.is_true(h:release())
    assert.is_false(assert(locks:status(name)).held)
  end)

  it("a client's fields, as a dump or a failure message prints them, hold no password; client.uri reads it", function()
    if not s then return pending(why) end
    local seen = {}
    for k, v in pairs(client) do seen[#seen + 1] = tostring(k) .. "=" .. tostring(v) end
    assert_no_secret(s, table.concat(seen, " ") .. " " .. tostring(client), "the client's fields")
    assert.equal(s.uri, client.uri)
  end)

  it("the renewal thread keeps a short lease alive over the same connection settings", function()
    if not s then return pending(why) end
    local short = client:locks({ database = locks.database, collection = locks.collection, ttl = 1 })
    local other = assert(mongolock.connect(s.uri, { appname = "auth-other" }))
    local ol = other:locks({ database = locks.database, collection = locks.collection })
    local name = helpers.unique("renew")
    local h = assert(short:acquire(name, { renew = true }))
    for _ = 1, 3 do
      core.sleep(1)
      local h2, err = ol:try(name)
      assert.is_nil(h2)
      assert.equal("busy", err)
      assert.is_true(h:check())
    end
    assert.is_true(testing.renew_stats(client._core).renewals >= 3)
    assert.is_true(h:release())
    other:close()
  end)

  it("a change-stream waiter is woken by another process's release", function()
    if not s then return pending(why) end
    local holder = helpers.script([[
local mongolock = require "mongolock"
local core = require "mongolock.core"
local name, db, coll, trigger = ...
local c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "auth-holder" }))
local h = assert(c:locks({ database = db, collection = coll, ttl = 60 }):acquire(name))
io.stdout:write("held\n"); io.stdout:flush()
local deadline = core.monotonic() + 30
while core.monotonic() < deadline do
  local f = io.open(trigger, "rb")
  if f then f:close() break end
  core.sleep(0.005)
end
core.sleep(0.3)
io.stdout:write("released ", tostring(h:release()), "\n"); io.stdout:flush()
c:close()
]])
    local trigger = os.tmpname()
    os.remove(trigger)
    local name = helpers.unique("watch")
    local p = helpers.spawn(holder, { name, locks.database, locks.collection, trigger }, uri_env(s.uri))
    assert(p:wait_for("held"))
    -- a wait step that counts the waits and makes the trigger at the first
    local real = locks_mod.get_wait()
    local waits = 0
    locks_mod.set_wait({ check_mode = real.check_mode, sleep_until_retry = function(state)
      waits = waits + 1
      if waits == 1 then assert(io.open(trigger, "wb")):close() end
      return real.sleep_until_retry(state)
    end })
    local before = testing.watch_stats(client._core)
    local ok, h, err = pcall(locks.acquire, locks, name, { timeout = 20, wait = "watch" })
    locks_mod.set_wait(real)
    assert(ok, h)
    assert.is_truthy(h, err)
    local after = testing.watch_stats(client._core)
    local code, out = p:wait()
    assert.equal(0, code, out)
    assert.matches("released true", out)
    -- woken once, by the stream's event
    assert.equal(1, waits)
    assert.is_true(after.events > before.events)
    assert.is_true(h:release())
    p:cleanup()
    os.remove(trigger)
    os.remove(holder)
  end)

  it("a client made before fork() works in the child over TLS with credentials", function()
    if not s then return pending(why) end
    local name = helpers.unique("fork")
    local h = assert(locks:acquire(name, { ttl = 30 }))
    local pid = assert(testing.fork())
    if pid == 0 then
      local ok, code = pcall(function()
        local h2 = locks:try(helpers.unique("fork-child"))
        if not h2 then return 10 end
        if not h2:release() then return 11 end
        local st = locks:status(name)
        if not (st and st.held and st.owner == h.owner) then return 12 end
        return 0
      end)
      helpers.child_exit(client, ok, code)
    end
    assert.equal(0, helpers.wait_child(pid, 60, pending, function() h:release() end))
    assert.is_true(h:release())
  end)

  it("the command: exec, status --json and list --json work, and no command line shows the password", function()
    if not s then return pending(why) end
    local name = helpers.unique("cli")
    local db, coll = locks.database, locks.collection
    local out, err, rc = os.tmpname(), os.tmpname(), os.tmpname()
    os.remove(rc)
    -- exec holds the lock while its command runs (until the file stop exists)
    local stop = os.tmpname()
    os.remove(stop)
    os.execute(format("( %s%s %s --database %s --collection %s exec %s -- sh -c %s >%s 2>%s </dev/null; echo $? >%s ) "
      .. ">/dev/null 2>&1 &", uri_env(s.uri), helpers.lua, q(BIN), q(db), q(coll), q(name),
      q(format("echo started; while [ ! -e %s ]; do sleep 0.05; done", q(stop))), q(out), q(err), q(rc)))
    assert.is_truthy(helpers.eventually(function() return (helpers.read_file(out) or ""):find("started") end, 20),
      helpers.read_file(err))
    assert_no_secret(s, command_lines(), "a command line")
    local code, sout, serr = cli(s.uri, { "--database", db, "--collection", coll, "status", "--json", name })
    assert.equal(0, code, serr)
    assert.is_true(cjson.decode(sout).held)
    assert_no_secret(s, sout .. serr, "status --json")
    code, sout, serr = cli(s.uri, { "--database", db, "--collection", coll, "list", "--json" })
    assert.equal(0, code, serr)
    assert.matches(name, sout, 1, true)
    assert_no_secret(s, sout .. serr, "list --json")
    code, sout, serr = cli(s.uri, { "--database", db, "--collection", coll, "status", name })
    assert.equal(0, code, serr)
    assert_no_secret(s, sout .. serr, "status")
    assert(io.open(stop, "w")):close()
    -- (the shell creates rc, then writes the status: wait for the digits)
    local status = helpers.eventually(function() return (helpers.read_file(rc) or ""):match("%d+") end, 20)
    assert.equal("0", status, helpers.read_file(err))
    assert_no_secret(s, (helpers.read_file(out) or "") .. (helpers.read_file(err) or ""), "exec's output")
    for _, f in ipairs({ out, err, rc, stop }) do os.remove(f) end
  end)

  it("the command with a wrong password exits 69 naming the cause, without the password", function()
    if not s then return pending(why) end
    local started = core.monotonic()
    local code, sout, serr = cli(s.wrong_password_uri, { "--server-timeout", tostring(SERVER_TIMEOUT),
      "--database", locks.database, "status", "job" })
    assert.equal(69, code, serr)
    assert.matches("Authentication failed", serr, 1, true)
    assert.is_true(core.monotonic() - started < SERVER_TIMEOUT + 5)
    assert_no_secret(s, sout .. serr, "the command's error")
  end)

  it("the demo runs over TLS with credentials and shows the password nowhere", function()
    if not s then return pending(why) end
    local out = os.tmpname()
    local done = os.tmpname()
    os.remove(done)
    os.execute(format("( %s%s %s demo 2 3 >%s 2>&1 </dev/null; echo $? >%s ) >/dev/null 2>&1 &",
      uri_env(s.uri), helpers.lua, q(BIN), q(out), q(done)))
    -- its processes' command lines, while it runs
    repeat
      assert_no_secret(s, command_lines(), "a command line")
      core.sleep(0.05)
    until helpers.read_file(done)
    local text = helpers.read_file(out) or ""
    assert.equal("0", helpers.read_file(done):match("%d+"), text)
    assert.matches("no update lost", text, 1, true)
    assert_no_secret(s, text, "the demo's output")
    os.remove(out); os.remove(done)
  end)

  it("inside nginx: the example's guarded counter over TLS with credentials", function()
    if not s then return pending(why) end
    local nx = require "nginx_helpers"
    local f = os.tmpname()
    local g = assert(io.open(f, "w"))
    g:write(s.uri)
    g:close()
    uri_files[#uri_files + 1] = f
    local nginx = nx.start({ uri_file = f })
    local ok, e = pcall(function()
      local code, body = nx.get(nginx.port, "/reset")
      assert.equal(200, code, body)
      for i = 1, 3 do
        code, body = nx.get(nginx.port, "/incr")
        assert.equal(200, code, body)
        assert.matches("^" .. i .. " ", body)
      end
      code, body = nx.get(nginx.port, "/count")
      assert.equal(200, code)
      assert.equal("3 0\n", body)
      assert_no_secret(s, command_lines(), "a command line")
      assert_no_secret(s, helpers.read_file(nginx.log) or "", "nginx's error log")
    end)
    nginx:stop()
    assert(ok, e)
  end)

  it("a wrong password fails the first call within the bound, naming the cause, without the password", function()
    if not s then return pending(why) end
    local started = core.monotonic()
    local c, cerr = mongolock.connect(s.wrong_password_uri, { server_timeout = SERVER_TIMEOUT })
    local h, err
    if c then
      local l
      l, err = c:locks({ database = locks.database, collection = locks.collection })
      if l then h, err = l:try(helpers.unique("wrong")) end
      c:close()
    else
      err = cerr
    end
    assert.is_nil(h)
    assert.matches("Authentication failed", err, 1, true)
    assert.is_true(core.monotonic() - started < SERVER_TIMEOUT + 5)
    assert_no_secret(s, err, "the error")
  end)

  it("an untrusted certificate fails the first call within the bound, naming the cause", function()
    if not s then return pending(why) end
    local started = core.monotonic()
    local c = assert(mongolock.connect(s.untrusted_uri, { server_timeout = SERVER_TIMEOUT }))
    local l = assert(c:locks({ database = locks.database, collection = locks.collection }))
    local h, err = l:try(helpers.unique("untrusted"))
    c:close()
    assert.is_nil(h)
    assert.matches("certificate verify failed", err, 1, true)
    assert.is_true(core.monotonic() - started < SERVER_TIMEOUT + 5)
    assert_no_secret(s, err, "the error")
  end)

  -- issue 42: a wait, not only try, ends with the driver's cause (not
  -- "no server that takes writes was reachable before the timeout")
  it("acquire and exec -w against an untrusted certificate end naming the cause", function()
    if not s then return pending(why) end
    local c = assert(mongolock.connect(s.untrusted_uri, { server_timeout = SERVER_TIMEOUT }))
    local l = assert(c:locks({ database = locks.database, collection = locks.collection }))
    -- a timeout shorter than the server bound (no attempt is sent), and a
    -- longer one (attempts fail, then the wait for a server)
    for _, timeout in ipairs({ 1, 3 }) do
      local started = core.monotonic()
      local h, err = l:acquire(helpers.unique("untrusted"), { timeout = timeout })
      assert.is_nil(h)
      assert.matches("certificate verify failed", err, 1, true)
      assert.is_true(core.monotonic() - started < timeout + SERVER_TIMEOUT + 2)
    end
    c:close()
    local code, _, serr = cli(s.untrusted_uri, { "--server-timeout", tostring(SERVER_TIMEOUT),
      "--database", locks.database, "exec", "-w", "1", "job", "--", "true" })
    assert.equal(69, code, serr)
    assert.matches("certificate verify failed", serr, 1, true)
  end)

  it("a read-only user gets 13 on acquire, with nothing written and nothing held", function()
    if not s then return pending(why) end
    if not s.ro_uri then return pending("no MONGODB_AUTH_RO_URI") end
    local ro = assert(mongolock.connect(s.ro_uri, { server_timeout = SERVER_TIMEOUT }))
    local rl = assert(ro:locks({ database = locks.database, collection = locks.collection }))
    local name = helpers.unique("ro")
    for _, call in ipairs({ "try", "acquire" }) do
      local started = core.monotonic()
      local h, err, code = rl[call](rl, name, { timeout = 10 })
      assert.is_nil(h)
      assert.equal(13, code, err)
      -- an error, not a wait: well under the acquire's timeout
      assert.is_true(core.monotonic() - started < 5)
    end
    ro:close()
    assert.is_nil(helpers.lock_doc(client, locks.collection, name))
    -- never taken: no document, so status answers nil and no error
    assert.same({}, { locks:status(name) })
  end)

  it("a URI whose password has an unescaped '@' is refused by connect, without any of the password", function()
    if not s then return pending(why) end
    local bad = s.uri:gsub("^(mongodb://[^:]*:)[^@]*@", "%1" .. "se@cr3tpart@")
    local c, err = mongolock.connect(bad, { server_timeout = SERVER_TIMEOUT })
    if c then
      -- today: accepted, and the first call names a host made of the password's end
      local l = assert(c:locks({ database = locks.database, collection = locks.collection }))
      local _, e2 = l:try("job")
      c:close()
      err = e2
    end
    assert.is_nil(c)
    assert.matches("^invalid URI", err)
    assert.is_nil(err:lower():find("cr3tpart", 1, true), err)
  end)

  it("a tlsCAFile that cannot be read is named by connect", function()
    if not s then return pending(why) end
    local missing = os.tmpname()
    os.remove(missing)
    local bad = s.uri:gsub("([?&]tlsCAFile=)[^&]*", "%1" .. missing)
    local c, err = mongolock.connect(bad, { server_timeout = SERVER_TIMEOUT })
    if c then c:close() end
    assert.is_nil(c)
    assert.matches("tlsCAFile", err, 1, true)
    assert.matches(missing, err, 1, true)
    assert_no_secret(s, err, "the error")
  end)
end)
