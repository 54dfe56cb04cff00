-- #integration: mongolock exec --shared NAME and --permits N NAME (a
-- reader's share, a semaphore's permit), run as a separate OS process.
local helpers = require "helpers"

local format = string.format
local q = helpers.shell_quote
local BIN = helpers.root .. "/bin/mongolock"

-- runs the command to completion: exit status, stdout, stderr
local mongolock = helpers.mongolock

describe("#integration mongolock exec --shared / --permits", function()
  local client, coll, rw, sems
  setup(function()
    client = helpers.connect({ appname = "kinds-cli" })
    coll = helpers.unique("cli")
    rw = client:rwlocks({ database = helpers.database, collection = coll })
    sems = client:semaphores({ database = helpers.database, collection = coll, permits = 2 })
  end)
  teardown(function() client:close() end)

  -- the command with this spec's server and collection, then args
  local function run(...)
    local args = { "--uri", helpers.uri(), "--database", helpers.database, "--collection", coll }
    for _, a in ipairs({ ... }) do args[#args + 1] = a end
    return mongolock(args)
  end

  local function exec(...) return run("exec", ...) end

  it("--shared runs the command beside other readers, not beside a writer", function()
    local name = helpers.unique("shared")
    local r = assert(rw:try_read(name))
    -- the command itself sees two readers
    local code, out, err = exec("--shared", name, "--", "env",
      "LUA_PATH=" .. helpers.root .. "/lua/?.lua;;",
      "LUA_CPATH=" .. (os.getenv("LUA_CPATH") or helpers.root .. "/build/" .. helpers.lua .. "/?.so;;"),
      helpers.lua, "-e", format([[
      local m = require "mongolock"
      local c = assert(m.connect(%q))
      print(assert(c:rwlocks{ database = %q, collection = %q }:status(%q)).in_use)]],
      helpers.uri(), helpers.database, coll, name))
    assert.equal(0, code, err)
    assert.equal("2", out:match("%d+"))
    assert.is_true(r:release())
    local w = assert(rw:try_write(name))
    code = exec("-n", "--shared", name, "--", "true")
    assert.equal(1, code)
    assert.is_true(w:release())
    assert.equal(0, (exec("-n", "--shared", name, "--", "true")))
    assert.equal(0, assert(rw:status(name)).in_use)
  end)

  it("--permits N takes one of N permits and refuses another N", function()
    local name = helpers.unique("permits")
    local a = assert(sems:try(name))
    assert.equal(0, (exec("-n", "--permits", "2", name, "--", "true")))
    local b = assert(sems:try(name))
    assert.equal(1, (exec("-n", "--permits", "2", name, "--", "true")))
    assert.is_true(a:release())
    assert.is_true(b:release())
    -- another N is a usage conflict, said in the command's words
    local code, _, err = exec("-n", "--permits", "3", name, "--", "true")
    assert.equal(64, code, err)
    assert.matches("has 2 permits, not 3", err, 1, true)
    assert.matches("^mongolock: semaphore [^\n]+ has 2 permits, not 3: every caller of [^\n]+ must give "
      .. "%-%-permits 2\n$", err)
    code, _, err = exec("-w", "1", "--permits", "3", name, "--", "true")
    assert.equal(64, code, err)
    code, _, err = exec("-n", "--shared", name, "--", "true")
    assert.equal(64, code, err)
    assert.matches("^mongolock: [^\n]+ is a semaphore of 2 permits, not a reader%-writer lock: take it with "
      .. "%-%-permits 2, not %-%-shared\n$", err)
    local rname = helpers.unique("rwnotsem")
    local r = assert(rw:try_read(rname))
    code, _, err = exec("-n", "--permits", "2", rname, "--", "true")
    assert.equal(64, code, err)
    assert.matches("^mongolock: [^\n]+ is a reader%-writer lock, not a semaphore: take a share with "
      .. "%-%-shared, not %-%-permits\n$", err)
    assert.is_true(r:release())
    -- status shows the permits in use and their holders
    local h = assert(sems:try(name))
    local args = { "--uri", helpers.uri(), "--database", helpers.database, "--collection", coll,
      "status", name }
    local out
    code, out, err = mongolock(args)
    assert.equal(0, code, err)
    assert.matches("permits   1 of 2 in use", out, 1, true)
    assert.matches("permit  ", out, 1, true)
    args[#args + 1] = "--json"
    code, out = mongolock(args)
    assert.equal(0, code)
    local j = require("cjson").decode(out)
    assert.equal(1, j.shares.in_use)
    assert.equal(h.owner, j.shares.holders[1].owner)
    assert.equal(h:token_string(), j.shares.holders[1].token)
    assert.is_true(h:release())
    code, out = mongolock({ "--uri", helpers.uri(), "--database", helpers.database,
      "--collection", coll, "status", name })
    assert.equal(1, code, out)          -- free
    code, _, err = exec("--permits", "0", name, "--", "true")
    assert.equal(64, code)
    assert.matches("permits must be an integer", err, 1, true)
    code = exec("--shared", "--permits", "2", name, "--", "true")
    assert.equal(64, code)
  end)
  it("a reader's share released by another ends the command by default, saying so", function()
    local name = helpers.unique("sharedlost")
    local release = table.concat({ helpers.lua, q(BIN), "--uri", q(helpers.uri()), "--database",
      q(helpers.database), "--collection", q(coll), "release", "--force", "--yes", q(name) }, " ")
    -- the command has its share released, then runs on for up to 10 s
    local code, out, err = exec("--shared", "--ttl", "1", name, "sh", "-c", release
      .. " && echo forced; i=0; while [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; echo finished")
    assert.equal(143, code, err)
    assert.equal("forced\n", out)
    assert.matches("lost the lock " .. name .. ": it was released by another process", err, 1, true)
    assert.matches("terminating", err, 1, true)
  end)

  it("wait waits for readers and permits too, and release --force ends them", function()
    local rname, sname = helpers.unique("wait-r"), helpers.unique("wait-p")
    local r = assert(rw:try_read(rname, { ttl = 60 }))
    local p = assert(sems:try(sname, { ttl = 60 }))
    for _, name in ipairs({ rname, sname }) do
      local code, _, err = run("wait", "-w", "0.3", name)
      assert.equal(1, code, name .. " held by a share, yet free: " .. err)
      code, _, err = run("release", "--force", "--yes", name)
      assert.equal(0, code, err)
      code, _, err = run("wait", "-w", "0.3", name)
      assert.equal(0, code, err)
    end
    assert.equal(0, assert(rw:status(rname)).in_use)
    assert.equal(0, assert(sems:status(sname)).in_use)
    assert.same({ nil, "lost" }, { r:release() })
    assert.same({ nil, "lost" }, { p:release() })
    local code = run("release", "--force", "--yes", rname)
    assert.equal(1, code)
  end)

  it("status and list show shares and permits in use, their holders and waiters", function()
    local pid = tostring(require("mongolock.core").getpid())
    -- a reader-writer lock held by two readers, nobody writing
    local rname = helpers.unique("readers")
    local r1, r2 = assert(rw:try_read(rname)), assert(rw:try_read(rname))
    local code, out, err = run("status", rname)
    assert.equal(0, code, err)
    assert.matches("state     shared\n", out, 1, true)
    assert.matches("readers   2\n", out, 1, true)
    local _, lines = out:gsub("\n  shared +[^\n]*pid " .. pid .. " kinds%-cli token %d+", "")
    assert.equal(2, lines, out)
    code, out, err = run("status", "--json", rname)
    assert.equal(0, code, err)
    local j = require("cjson").decode(out)
    assert.is_true(j.held)
    assert.equal("shared", j.state)
    assert.equal(2, j.holders)
    -- a semaphore of one permit, held, with a waiter in another process
    local one = client:semaphores({ database = helpers.database, collection = coll, permits = 1 })
    local sname = helpers.unique("permit")
    local p1 = assert(one:try(sname, { ttl = 60 }))
    local w = helpers.kinds_child(coll, "wait", "permit", sname, 20, nil, 1)
    assert.truthy(helpers.eventually(function()
      return (assert(one:status(sname)).waiting or 0) == 1
    end, 10))
    code, out, err = run("status", sname)
    assert.equal(0, code, err)
    assert.matches("state     permits\n", out, 1, true)
    assert.matches("permits   1 of 1 in use\n", out, 1, true)
    assert.matches("waiting   1 for permits\n", out, 1, true)
    assert.matches("\n  permit +[^\n]*pid " .. pid, out)
    -- list: one row per name, the shares and waiters in HOLDER
    code, out, err = run("list")
    assert.equal(0, code, err)
    local rrow = out:match("\n(" .. rname:gsub("%p", "%%%0") .. " [^\n]*)")
    local srow = out:match("\n(" .. sname:gsub("%p", "%%%0") .. " [^\n]*)")
    assert.truthy(rrow, out)
    assert.truthy(srow, out)
    assert.matches("^%S+ +shared +%d+ +2 readers: [^,]*pid " .. pid .. "[^,]*, [^,]*pid " .. pid,
      rrow)
    assert.matches("^%S+ +permits +%d+ +1 of 1 permits: [^;]*pid " .. pid .. "[^;]*; 1 waiting",
      srow)
    code, out = run("list", "--json")
    assert.equal(0, code)
    local byname = {}
    for _, rec in ipairs(require("cjson").decode(out)) do byname[rec.name] = rec end
    assert.equal("shared", byname[rname].state)
    assert.equal(2, byname[rname].shares.in_use)
    assert.equal(r1.owner, byname[rname].shares.holders[1].owner)
    assert.equal(1, byname[sname].shares.waiting)
    assert.equal(p1:token_string(), byname[sname].shares.holders[1].token)
    -- the permit goes to the waiter; then the row shows its holder
    assert.is_true(p1:release())
    assert.truthy(w:wait_for("held (%d+)", 10), w:output())
    local wpid = w:output():match("held (%d+)")
    assert.equal(0, (w:wait(10)))
    w:cleanup()
    assert.is_true(r1:release())
    assert.is_true(r2:release())
    code, out = run("status", rname)
    assert.equal(1, code, out)
    assert.matches("state     free\n", out, 1, true)
    assert.is_string(wpid)
  end)
end)
