-- A real nginx (Debian's, with lua-nginx-module on LuaJIT) running
-- examples/nginx/nginx.conf with 2 workers on a free loopback port against
-- helpers.uri(): N concurrent requests to the guarded counter lose no
-- update, and /ping keeps answering while the handlers wait for the lock.
-- The HTTP client is luasocket's, one connection per request.
local helpers = require "helpers"
local nx = require "nginx_helpers"
local socket = require "socket"

local format = string.format
local root = nx.root
local start_nginx, get, load, poll = nx.start, nx.get, nx.load, nx.poll
local open_pingers, percentile, summary = nx.open_pingers, nx.percentile, nx.summary

local REQUESTS = 500          -- all sent at once, one connection each

-- a location the spec adds to the example: the per-worker queue of
-- resty.mongolock, checked from inside one request of one worker
local SPEC_LOCATIONS = [[
        location = /api-spec {
            content_by_lua_file api_spec.lua;
        }

        location = /cosocket-spec {
            content_by_lua_file cosocket_spec.lua;
        }

        location = /doc-api-spec {
            content_by_lua_file doc_api_spec.lua;
        }

        location = /share-api-spec {
            content_by_lua_file share_api_spec.lua;
        }

        location = /election-api-spec {
            content_by_lua_file election_api_spec.lua;
        }

        # ?kind=rw|sem|doc&call=try|acquire&key=: one try or acquire of a
        # share, or of a document's lock (the document made first), answered
        # "held" or "nil <err>"
        location = /attempt-once {
            content_by_lua_block {
                local mongolock = require "mongolock"
                package.loaded.share_once_client = package.loaded.share_once_client
                  or assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "share-once-spec" }))
                local c = package.loaded.share_once_client
                local key, sem = ngx.var.arg_key, ngx.var.arg_kind == "sem"
                local obj = sem and c:semaphores({ collection = "nginx_share_once_spec", permits = 2 })
                  or c:rwlocks({ collection = "nginx_share_once_spec" })
                local h, err
                if ngx.var.arg_kind == "doc" then
                  local docs = c:documents("mongolock_test", "nginx_doc_once_spec")
                  local d
                  if ngx.var.arg_call == "try" then d, h = docs:try(key) else d, h = docs:lock(key, { timeout = 5 }) end
                  if not d then err = h; h = nil end
                elseif ngx.var.arg_call == "try" then
                  if sem then h, err = obj:try(key) else h, err = obj:try_read(key) end
                elseif sem then h, err = obj:acquire(key, { timeout = 5 })
                else h, err = obj:read(key, { timeout = 5 }) end
                local body = h and "held" or ("nil " .. tostring(err))
                if h then h:release() end
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }

        # ?key=&coll=&app=: a fenced write of resty.mongolock's object (its
        # client's app name app) waits 0.8 s on the server while another
        # holder force-releases the lock, takes it and writes: "<result of
        # the delayed write> <err> <the newer token it names> <the newer token>"
        location = /fenced-stale {
            content_by_lua_block {
                local mongolock = require "mongolock"
                local uri = os.getenv("MONGODB_URI")
                local key, coll, app = ngx.var.arg_key, ngx.var.arg_coll, ngx.var.arg_app
                local mine = assert(mongolock.connect(uri, { appname = app }))
                local other = assert(mongolock.connect(uri, { appname = "fenced-other" }))
                local lock = require("resty.mongolock"):new({ client = mine, collection = "nginx_fenced_spec" })
                assert(lock:lock(key))
                local f = assert(lock:fenced(coll, { database = "mongolock_test" }))
                assert(f:update({ _id = "d" }, { ["$set"] = { by = "first" } }, { upsert = true }))
                assert(other:command("admin", { configureFailPoint = "failCommand" }, { mode = { times = 1 },
                  data = { failCommands = mongolock.array({ "findAndModify", "update" }), blockConnection = true,
                           blockTimeMS = 800, appName = app } }))
                local th = ngx.thread.spawn(function()
                    return f:update({ _id = "d" }, { ["$set"] = { by = "stale" }, ["$inc"] = { n = 1 } })
                end)
                ngx.sleep(0.3)
                local ol = other:locks({ collection = "nginx_fenced_spec" })
                assert(ol:force_release(key))
                local h2 = assert(ol:acquire(key))
                local f2 = h2:fenced(coll, { database = "mongolock_test" })
                assert(f2:update({ _id = "d" }, { ["$set"] = { by = "next" } }) == 1)
                local newer = h2:token_string()
                local _, ok, err, info = ngx.thread.wait(th)
                h2:release()
                lock:unlock()
                other:close()
                mine:close()
                local body = table.concat({ tostring(ok), tostring(err),
                  tostring(info and info.token_string), newer }, " ")
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }

        # ?key=&coll=: two guarded transactions of resty.mongolock's object:
        # one commits, one whose lock another client force-releases and
        # takes before the commit: "<first result> <second result> <err>"
        location = /txn-spec {
            content_by_lua_block {
                local mongolock = require "mongolock"
                local uri = os.getenv("MONGODB_URI")
                local key, coll = ngx.var.arg_key, ngx.var.arg_coll
                local mine = assert(mongolock.connect(uri, { appname = "txn-spec" }))
                local other = assert(mongolock.connect(uri, { appname = "txn-other" }))
                local lock = require("resty.mongolock"):new({ client = mine, collection = "nginx_txn_spec" })
                assert(lock:lock(key))
                local function write(tx, id)
                  local c = tx:collection(coll, { database = "mongolock_test" })
                  assert(c:update({ _id = id }, { ["$inc"] = { n = 1 } }, { upsert = true }) == 1)
                end
                local r1 = lock:transaction(function(tx) write(tx, "a"); write(tx, "b"); return "committed" end)
                local r2, err = lock:transaction(function(tx)
                  write(tx, "c")
                  local ol = other:locks({ collection = "nginx_txn_spec" })
                  assert(ol:force_release(key))
                  assert(ol:acquire(key)):release()
                  return "committed"
                end)
                lock:unlock()
                other:close()
                mine:close()
                local body = table.concat({ tostring(r1), tostring(r2), tostring(err) }, " ")
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }

        location = /gate-spec {
            content_by_lua_file gate_spec.lua;
        }

        # the example's /incr waiting at most 1 s for the lock
        location = /incr-short {
            content_by_lua_block { require("guarded_counter").incr({ timeout = 1 }) }
        }

        # the example's /incr in a request that ends when its client goes
        location = /incr-abortable {
            lua_check_client_abort on;
            content_by_lua_block { require("guarded_counter").incr() }
        }

        # ?key=&ms=&timeout=: holds the lock key for ms, in a request that
        # ends when its client goes
        location = /hold-abortable {
            lua_check_client_abort on;
            content_by_lua_block {
                local lock = require("resty.mongolock"):new({ uri = os.getenv("MONGODB_URI"),
                    collection = "nginx_gate_spec", timeout = tonumber(ngx.var.arg_timeout) or 10 })
                local e, err = lock:lock(ngx.var.arg_key)
                local body = "timeout"
                if e then
                    ngx.sleep(tonumber(ngx.var.arg_ms) / 1000)
                    lock:unlock()
                    body = "locked"
                end
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }

        # ?n=&keys= guarded increments at once, from light threads of this
        # one request (so in one worker)
        location = /saturate {
            content_by_lua_file saturate_spec.lua;
        }

        # resty.mongolock and client:command in log_by_lua, where nothing
        # can yield: they block there, as before mongolock.ngx; the outcome
        # is kept in the worker for /log-phase-result
        location = /log-phase {
            return 200 "ok\n";
            log_by_lua_block {
                local lock = require("resty.mongolock"):new({ uri = os.getenv("MONGODB_URI"),
                    collection = "nginx_log_phase", timeout = 0 })
                local key = "k-" .. ngx.worker.pid()
                local e, err = lock:lock(key)
                local ok, uerr = lock:unlock()
                local c = require("mongolock").connect(os.getenv("MONGODB_URI"))
                local r, cerr = c:command("admin", { ping = 1 })
                c:close()
                package.loaded.log_phase_result = table.concat({ tostring(e), tostring(err), tostring(ok),
                    tostring(uerr), tostring(r and r.ok), tostring(cerr) }, " ")
            }
        }

        location = /log-phase-result {
            content_by_lua_block {
                local body = package.loaded.log_phase_result or "none"
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }

        # this worker's counters: mongolock.ngx (jobs) and its change streams
        # ?coll=: one increment of a counter document under its own
        # document lock (client:documents), the new value written by the
        # releasing command; then one versioned increment (client:versioned)
        location = /doc-incr {
            content_by_lua_block {
                local c = package.loaded.doc_spec_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "doc-spec" }))
                    package.loaded.doc_spec_client = c
                end
                local coll = ngx.var.arg_coll
                local docs = c:documents("mongolock_example", coll, { ttl = 10, timeout = 30 })
                local doc, h = docs:lock("counter", { insert = { n = 0 } })
                local body
                if not doc then
                    body = "lock: " .. tostring(h)
                else
                    local n = (doc.n or 0) + 1
                    local ok, err = h:release({ n = n })
                    if ok then
                        local vc = c:versioned("mongolock_example", coll .. "_v")
                        local vdoc, verr = vc:modify("counter", function(d) d.n = (d.n or 0) + 1; return d end,
                            { retries = 1000 })
                        body = vdoc and (n .. " " .. vdoc.n) or ("versioned: " .. tostring(verr))
                    else
                        body = "release: " .. tostring(err)
                    end
                end
                ngx.status = body:find("^%d") and 200 or 503
                ngx.header.content_length = #body + 1
                ngx.say(body)
            }
        }

        # ?coll=: a document lock taken with a 1 s timeout and released
        location = /doc-short {
            content_by_lua_block {
                local c = package.loaded.doc_spec_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "doc-spec" }))
                    package.loaded.doc_spec_client = c
                end
                local docs = c:documents("mongolock_example", ngx.var.arg_coll, { ttl = 10, timeout = 1 })
                local doc, h = docs:lock("counter", { insert = { n = 0 } })
                if doc then h:release() end
                local body = doc and "locked" or tostring(h)
                ngx.status = doc and 200 or 503
                ngx.header.content_length = #body + 1
                ngx.say(body)
            }
        }

        # ?coll=: a reader's share of the reader-writer lock "gate", then
        # the one permit of the semaphore "counter", which guards a read,
        # then a write of the counter document (client:command)
        location = /share-incr {
            content_by_lua_block {
                local c = package.loaded.doc_spec_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "doc-spec" }))
                    package.loaded.doc_spec_client = c
                end
                local coll = ngx.var.arg_coll
                local rw = c:rwlocks({ collection = coll .. "_rw", ttl = 30, timeout = 60 })
                local sems = c:semaphores({ collection = coll .. "_sem", permits = 1, ttl = 30, timeout = 60 })
                local body
                local share, serr = rw:read("gate")
                local permit, perr = share and sems:acquire("counter")
                if not share or not permit then
                    body = "acquire: " .. tostring(serr or perr)
                else
                    local r = assert(c:command("mongolock_example", { find = coll }, { filter = { _id = "counter" } }))
                    local cur = r.cursor.firstBatch[1]
                    local n = (cur and cur.n or 0) + 1
                    assert(c:command("mongolock_example", { update = coll }, { updates = { {
                        q = { _id = "counter" }, u = { ["$set"] = { n = n } }, upsert = true } } }))
                    local ok1, e1 = permit:release()
                    local ok2, e2 = share:release()
                    body = (ok1 and ok2) and tostring(n) or ("release: " .. tostring(e1) .. " " .. tostring(e2))
                end
                ngx.status = body:find("^%d") and 200 or 503
                ngx.header.content_length = #body + 1
                ngx.say(body)
            }
        }

        # ?coll=&key=&wait=: a named lock and a document lock, each held
        # by this request, then waited for (timeout 2 s) with wait
        location = /wait-mode {
            content_by_lua_block {
                local c = package.loaded.doc_spec_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "doc-spec" }))
                    package.loaded.doc_spec_client = c
                end
                local coll, key, wait = ngx.var.arg_coll, ngx.var.arg_key, ngx.var.arg_wait
                local locks = c:locks({ collection = coll })
                local held = assert(locks:try(key))
                local h, err = locks:acquire(key, { timeout = 2, wait = wait })
                held:release()
                local docs = c:documents("mongolock_example", coll .. "_docs")
                local _, dheld = assert(docs:try(key, { insert = {} }))
                local d, derr = docs:lock(key, { timeout = 2, wait = wait })
                dheld:release()
                local body = tostring(h or err) .. "\n" .. tostring(d or derr)
                ngx.header.content_length = #body + 1
                ngx.say(body)
            }
        }

        # ?kind=document|semaphore|rw&coll=: one waiter behind a holder
        # that releases once it is queued (0.3 s for a document lock) (wake_spec.lua)
        location = /wake-spec {
            content_by_lua_file wake_spec.lua;
        }

        # ?coll=: how often the worker's lease engine timer looks at the
        # engine over 200 lock cycles of a lease due in 10 s, and a renewed
        # lease due (0.5 s) long before the timer's next look (its cap
        # made 5 s): the handle made says so
        location = /engine-spec {
            content_by_lua_block {
                local nrunner = require "mongolock.ngx.runner"
                local c = package.loaded.engine_spec_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "engine-spec" }))
                    package.loaded.engine_spec_client = c
                end
                local locks = c:locks({ collection = ngx.var.arg_coll })
                local st = nrunner.of(c).state
                assert(locks:try("warm")):release()
                local n, looks = 200, st.looks
                for _ = 1, n do assert(locks:acquire("k", { ttl = 30, renew = true })):release() end
                local cycles = st.looks - looks
                local cap = nrunner.CAP
                nrunner.CAP = 5
                ngx.sleep(0.5)              -- the timer looks, then sleeps 5 s
                looks = st.looks
                local h = assert(locks:acquire("short", { ttl = 1.5, renew = true }))
                ngx.sleep(2)
                local ok, err = h:release()
                nrunner.CAP = cap
                st.wake:post(1)
                ngx.say("cycles ", n, " looks ", cycles)
                ngx.say("short ", tostring(ok), " ", tostring(err), " looks ", st.looks - looks)
            }
        }

        location = /mongolock-stats {
            content_by_lua_block {
                local out = {}
                for _, m in ipairs({ "mongolock.ngx", "mongolock.ngx.runner" }) do
                    local ok, mod = pcall(require, m)
                    if ok then
                        for k, v in pairs(mod.stats()) do out[#out + 1] = m .. "." .. k .. " " .. v .. "\n" end
                    end
                end
                local body = table.concat(out)
                ngx.header.content_length = #body
                ngx.print(body)
            }
        }
]]

local SATURATE_HANDLER = [==[
-- n light threads at once, each one guarded increment of the counter
-- document "saturate-<k>" under the lock "saturate-<k>", k = 1..keys: up
-- to keys lock calls in flight at once, and n data commands
local counter = require "guarded_counter"
local n, keys = tonumber(ngx.var.arg_n), tonumber(ngx.var.arg_keys)
local threads, ok, errors = {}, 0, {}
for i = 1, n do
  local k = "saturate-" .. (i % keys + 1)
  threads[i] = ngx.thread.spawn(function()
    local v, err = counter.guarded_add(k, nil, k)
    if v then ok = ok + 1 else errors[#errors + 1] = tostring(err) end
  end)
end
for i = 1, n do ngx.thread.wait(threads[i]) end
ngx.say("ok ", ok, " failed ", #errors)
for _, e in ipairs(errors) do ngx.say(e) end
]==]
-- mongolock's own API inside a handler (client:locks(): try, acquire,
-- with, the handle's methods)
local API_HANDLER = [==[
local mongolock = require "mongolock"
package.loaded.api_spec_client = package.loaded.api_spec_client
  or assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "api-spec" }))
local locks = package.loaded.api_spec_client:locks({ collection = "nginx_api_spec", ttl = 5 })
local key = ngx.var.arg_key
local out = {}
local function say(...) out[#out + 1] = table.concat({ ... }, " ") end

local h = assert(locks:try(key))
say("try", tostring(h:held()), h.kind, tostring(h.name == key), tostring(type(h.token) == "number"))
say("busy", tostring(select(2, locks:try(key))), tostring(select(2, locks:acquire(key, { timeout = 0.3 }))))
assert(h:extend(10))
say("extended", tostring(h:remaining() > 5))
say("released", tostring(h:release()), tostring(h:held()), tostring(select(2, h:release())))

-- a waiter gets the lock when its holder releases it
local h2 = assert(locks:acquire(key, { timeout = 5 }))
local t = ngx.thread.spawn(function() ngx.sleep(0.3); return h2:release() end)
local h3, err = locks:acquire(key, { timeout = 5 })
say("handed", tostring(h3 and h3:held()), tostring(err), tostring(select(2, ngx.thread.wait(t))))
h3:close()
say("closed", tostring(select(2, h3:release())))

say("with", tostring(locks:with(key, function(hh) return hh:check() and "inside" end)))
local h4 = assert(locks:try(key))
local st = assert(locks:status(key))
say("status", tostring(st.held), tostring(st.token == h4.token), tostring(#assert(locks:list()) >= 1))
say("forced", tostring(locks:force_release(key)), tostring(select(2, h4:release())),
  tostring(select(2, locks:force_release(key))))
ngx.header.content_length = #table.concat(out, "\n") + 1
ngx.say(table.concat(out, "\n"))
]==]

-- ?key=: try/release cycles, counting the worker's round trips run on
-- cosockets (here) and in worker threads (jobs); then the same with
-- configure{cosockets = false}
local COSOCKET_HANDLER = [==[
local mongolock = require "mongolock"
local transport = require "mongolock.ngx"
-- ?name=1: the stand-in by the name "localhost", directly (nginx resolves
-- no name for a cosocket by itself)
local uri = os.getenv("MONGODB_URI")
if ngx.var.arg_name then
  uri = uri:gsub("127%.0%.0%.1", "localhost"):gsub("replicaSet=rs0", "directConnection=true")
end
package.loaded[uri] = package.loaded[uri] or assert(mongolock.connect(uri, { appname = "cosocket-spec" }))
local locks = package.loaded[uri]:locks({ collection = "nginx_cosocket_spec", ttl = 5 })
local key = ngx.var.arg_key
-- outcomes: the most that the worker held for their callers just after a
-- try returned (its own taken: none of this request's)
local outcomes = 0
local function cycles(n)
  local s0 = transport.stats()
  for _ = 1, n do
    local h = assert(locks:try(key))
    outcomes = math.max(outcomes, transport.stats().outcomes)
    assert(h:release())
  end
  local s1 = transport.stats()
  return s1.here - s0.here, s1.jobs - s0.jobs
end
-- the first round trips go to the threads until the fibers' own monitor
-- knows the server
local deadline = ngx.now() + 5
repeat ngx.update_time() until cycles(1) == 2 or ngx.now() > deadline
-- the cosocket objects made meanwhile (ngx.socket.tcp counted)
local tcp, objects = ngx.socket.tcp, 0
ngx.socket.tcp = function() objects = objects + 1; return tcp() end
local cok, here, jobs = pcall(cycles, 20)
ngx.socket.tcp = tcp
assert(cok, here)
transport.configure({ cosockets = false })
local ok, here2, jobs2 = pcall(cycles, 5)
transport.configure({ cosockets = true })
assert(ok, here2)
ngx.say("cosockets ", here, " ", jobs)
ngx.say("threads ", here2, " ", jobs2)
ngx.say("outcomes held ", outcomes)
ngx.say("objects ", objects)
]==]

local DOC_API_HANDLER = [==[
local mongolock = require "mongolock"
local transport = require "mongolock.ngx"
package.loaded.api_spec_client = package.loaded.api_spec_client
  or assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "api-spec" }))
local docs = package.loaded.api_spec_client:documents("mongolock_example", "nginx_doc_api_spec", { ttl = 5 })
local key = ngx.var.arg_key
local out = {}
local function say(...) out[#out + 1] = table.concat({ ... }, " ") end
local jobs0 = transport.stats().jobs + transport.stats().here

say("missing", tostring(select(2, docs:try(key))))
local doc, h = assert(docs:try(key, { insert = { n = 1 } }))
say("try", tostring(h:held()), h.kind, tostring(h.id == key), tostring(doc.n))
local _, berr, info = docs:try(key)
say("busy", tostring(berr), tostring(info.owner == h.owner), tostring(info.doc.n),
  tostring(select(2, docs:lock(key, { timeout = 0.3 }))))
local st = assert(docs:status(key))
say("status", tostring(st.held), tostring(st.owner == h.owner))
assert(h:extend(10))
say("extended", tostring(h:remaining() > 5))
say("bad changes", tostring(not pcall(h.release, h, { lockId = "x" })), tostring(h:held()))
say("released", tostring(h:release({ n = 2 })), tostring(h:held()), tostring(select(2, h:release())))

-- a waiter gets the document when its holder releases it
local d2, h2 = assert(docs:lock(key, { timeout = 5 }))
local t = ngx.thread.spawn(function() ngx.sleep(0.3); return h2:release({ n = d2.n + 1 }) end)
local d3, h3 = docs:lock(key, { timeout = 5 })
say("handed", tostring(d3 and d3.n), tostring(h3 and h3:held()), tostring(select(2, ngx.thread.wait(t))))
h3:close()
say("closed", tostring(select(2, h3:release())))
-- fn writes by its own release; the table it returns is only returned
local w = docs:with(key, function(d, hh) assert(hh:release({ n = d.n + 1 })); return { n = d.n + 1, ok = true } end)
local d5, h5 = assert(docs:try(key))
say("with", tostring(w and w.n), tostring(d5.n), tostring(d5.ok))
h5:release()

-- a handle collected while it holds is released from a timer
do
  local _, hg = assert(docs:try(key, { ttl = 30 }))
end
collectgarbage()
collectgarbage()
local dg, hg2 = docs:lock(key, { timeout = 5 })
say("collected", tostring(dg ~= nil))
if hg2 then hg2:release() end
say("jobs", tostring(transport.stats().jobs + transport.stats().here - jobs0 >= 15))
ngx.header.content_length = #table.concat(out, "\n") + 1
ngx.say(table.concat(out, "\n"))
]==]

-- elections inside a handler: campaign, proclaim, leader, resign, and an
-- observer in a light thread
local ELECTION_API_HANDLER = [==[
local mongolock = require "mongolock"
local transport = require "mongolock.ngx"
package.loaded.api_spec_client = package.loaded.api_spec_client
  or assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "api-spec" }))
local el = package.loaded.api_spec_client:elections({ collection = "nginx_election_api_spec", ttl = 5 })
local key = ngx.var.arg_key
local out = {}
local function say(...) out[#out + 1] = table.concat({ ... }, " ") end
local jobs0 = transport.stats().jobs + transport.stats().here

local it = el:observe(key, { timeout = 10 })
local first = assert(it())
say("current", first.change, tostring(first.leader))
local seen = {}
local obs = ngx.thread.spawn(function()
  for _ = 1, 4 do
    local ch, err = it()
    if not ch then seen[#seen + 1] = "error " .. tostring(err) break end
    seen[#seen + 1] = ch.change .. (ch.value and (" " .. ch.value) or "")
  end
end)
local l1 = assert(el:campaign(key, "one"))
say("lead", tostring(l1:held()), tostring(type(l1.token) == "number"), l1.value)
say("busy", tostring(select(2, el:campaign(key, "two", { timeout = 0.3 }))))
assert(l1:proclaim("uno"))
local info = assert(el:leader(key))
say("leader", info.value, tostring(info.token == l1.token))
-- a campaigner waiting here leads when the first resigns
local t = ngx.thread.spawn(function() ngx.sleep(0.3); return l1:resign() end)
local l2, err = el:campaign(key, "two", { timeout = 5 })
say("handed", tostring(l2 and l2:held()), tostring(err), tostring(select(2, ngx.thread.wait(t))),
  tostring(l2 and l2.token > l1.token))
ngx.thread.wait(obs)
it:close()
assert(l2:resign())
say("observed", table.concat(seen, ","))
say("jobs", tostring(transport.stats().jobs + transport.stats().here - jobs0 >= 10))
ngx.header.content_length = #table.concat(out, "\n") + 1
ngx.say(table.concat(out, "\n"))
]==]

local SHARE_API_HANDLER = [==[
local mongolock = require "mongolock"
local transport = require "mongolock.ngx"
package.loaded.api_spec_client = package.loaded.api_spec_client
  or assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "api-spec" }))
local c = package.loaded.api_spec_client
local rw = c:rwlocks({ collection = "nginx_share_api_spec", ttl = 5 })
local sems = c:semaphores({ collection = "nginx_share_api_spec_sem", permits = 2, ttl = 5 })
local key = ngx.var.arg_key
local out = {}
local function say(...) out[#out + 1] = table.concat({ ... }, " ") end
local jobs0 = transport.stats().jobs + transport.stats().here

local r1 = assert(rw:try_read(key))
local r2 = assert(rw:read(key, { timeout = 1 }))
say("read", r1.kind, tostring(r1:held()), tostring(r2:held()), tostring(type(r1.token) == "number"))
local _, werr, winfo = rw:try_write(key)
say("write", tostring(werr), tostring(winfo.readers))
local nst = assert(c:locks({ collection = "nginx_share_api_spec" }):status(key))
say("named", tostring(nst.held), tostring(nst.state), tostring(nst.holders))
say("status", tostring(assert(rw:status(key)).in_use))
assert(r1:extend(10))
say("extended", tostring(r1:remaining() > 5))
say("released", tostring(r1:release()), tostring(r1:held()), tostring(select(2, r1:release())))
r2:release()

local p1 = assert(sems:try(key))
local p2 = assert(sems:acquire(key, { timeout = 1 }))
say("permits", p1.kind, tostring(select(2, sems:try(key))))
local t = ngx.thread.spawn(function() ngx.sleep(0.3); return p1:release() end)
local p3, err = sems:acquire(key, { timeout = 5 })
say("handed", tostring(p3 and p3:held()), tostring(err), tostring(select(2, ngx.thread.wait(t))))
local _, merr = c:semaphores({ collection = "nginx_share_api_spec_sem", permits = 3 }):try(key)
say("mismatch", tostring(type(merr) == "string" and merr:find("permits") ~= nil))
say("list", tostring(#assert(sems:list()) >= 1))
say("forced", tostring(sems:force_release(key)), tostring(select(2, p2:release())),
  tostring(select(2, sems:force_release(key))))
do
  local g1, g2 = assert(sems:try(key, { ttl = 30 })), assert(sems:try(key, { ttl = 30 }))
end
collectgarbage()
collectgarbage()
local p4 = sems:acquire(key, { timeout = 5 })
say("collected", tostring(p4 ~= nil))
if p4 then p4:release() end
say("jobs", tostring(transport.stats().jobs + transport.stats().here - jobs0 >= 15))
ngx.header.content_length = #table.concat(out, "\n") + 1
ngx.say(table.concat(out, "\n"))
]==]

-- one waiter of kind (a document lock, a semaphore's permit, a reader
-- behind a writer) behind a holder that releases once it is queued (0.3 s), waiting with
-- poll steps of 4 to 8 s (and, queued, a place refreshed every 10 s): only
-- a wake-up brings it in before then.  Answers what the worker's change
-- stream counted meanwhile (the client's, csrc/binding/watch.c, through
-- mongolock.testing): read by the worker's jobs, no thread of its own
local WAKE_HANDLER = [==[
local mongolock = require "mongolock"
local nrunner = require "mongolock.ngx.runner"
local testing = require "mongolock.testing"
local c = package.loaded.wake_spec_client
if not c then
  c = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "wake-spec" }))
  package.loaded.wake_spec_client = c
end
local kind, coll = ngx.var.arg_kind, ngx.var.arg_coll
local WAIT = { timeout = 20, step = 8, max_step = 8 }
local release, acquire, after, queued
if kind == "document" then
  -- ?id=: the holder's _id and the waiter's, the same document
  local hid, wid = "d", "d"
  if ngx.var.arg_id == "int64" then
    hid, wid = mongolock.Int64(42), 42
  elseif ngx.var.arg_id == "int64-waiter" then
    hid, wid = 42, mongolock.Int64(42)
  elseif ngx.var.arg_id == "objectid" then
    hid = mongolock.ObjectId()
    wid = mongolock.ObjectId(hid.hex)
  end
  local docs = c:documents("mongolock_example", coll, { ttl = 30 })
  local _, h = assert(docs:try(hid, { insert = { n = 0 } }))
  release = function() return h:release({ n = 1 }) end
  acquire = function()
    local d, h2 = docs:lock(wid, WAIT)
    if d then return h2 end
    return nil, h2
  end
elseif kind == "named" then
  -- ?short=1: a place in the queue of 1 s and a ttl of 10 s, so that the
  -- grant's lease (under 1 s) must be topped up to the ttl; ?short=2: a
  -- place of 2 s and a ttl of 2.5 s (the lease, under 2 s, is over two
  -- thirds of the ttl, and still short of it)
  local short = ngx.var.arg_short == "1" or ngx.var.arg_short == "2"
  local ttl, qt = 30, 20
  if ngx.var.arg_short == "1" then ttl, qt = 10, 1 end
  if ngx.var.arg_short == "2" then ttl, qt = 2.5, 2 end
  local locks = c:locks({ collection = coll, ttl = ttl })
  local h = assert(locks:try("n"))
  release = function() return h:release() end
  WAIT.queue_ttl = qt
  acquire = function() return locks:acquire("n", WAIT) end
  queued = function() return (assert(locks:status("n")).waiting or 0) > 0 end
  if ngx.var.arg_short == "2" then
    -- until the server's lease is over 2 s (the top-up) or the handle's
    -- has ended (none came)
    after = function(h2)
      local st
      repeat
        ngx.sleep(0.05)
        st = assert(locks:status("n"))
      until st.remaining > 2 or not h2:held()
      return "after " .. tostring(h2:held()) .. " " .. string.format("%.4f", h2:remaining() or 0)
        .. " " .. string.format("%.4f", st.remaining)
    end
  elseif short then
    after = function(h2)
      ngx.sleep(1.5)
      -- the server's view first: the handle's, read later, must be smaller
      local st = assert(locks:status("n"))
      return "after " .. tostring(h2:held()) .. " " .. string.format("%.4f", h2:remaining())
        .. " " .. string.format("%.4f", st.remaining)
    end
  end
elseif kind == "semaphore" then
  local sems = c:semaphores({ collection = coll, permits = 1, ttl = 30 })
  local p = assert(sems:try("s"))
  release = function() return p:release() end
  WAIT.queue_ttl = 20
  acquire = function() return sems:acquire("s", WAIT) end
  queued = function() return (assert(sems:status("s")).waiting or 0) > 0 end
else
  local rw = c:rwlocks({ collection = coll, ttl = 30 })
  local w = assert(rw:try_write("g"))
  release = function() return w:release() end
  WAIT.queue_ttl = 20
  acquire = function() return rw:read("g", WAIT) end
  queued = function() return (assert(rw:status("g")).waiting or 0) > 0 end
end
local s0, l0 = testing.watch_stats(c._core), nrunner.stats()
ngx.update_time()
local t0 = ngx.now()
-- a queued kind is released once its waiter is in the queue (its first
-- attempt came back busy): a release before it would be no hand-off, and
-- a late one could meet the waiter's refresh of its place (queue_ttl / 2,
-- 0.5 s for short=1) before the event does
local t = ngx.thread.spawn(function()
  ngx.sleep(0.05)
  if queued then
    local deadline = ngx.now() + 5
    while not queued() and ngx.now() < deadline do ngx.sleep(0.01) end
  else
    ngx.sleep(0.25)
  end
  return release()
end)
local h, err = acquire()
ngx.update_time()
local elapsed = ngx.now() - t0
local _, released = ngx.thread.wait(t)
local s1, l1 = testing.watch_stats(c._core), nrunner.stats()
local out = {
  "acquired " .. tostring(h ~= nil and h.held ~= nil and h:held()) .. " " .. tostring(err),
  "released " .. tostring(released),
  "elapsed " .. string.format("%.3f", elapsed),
  "getmores " .. (s1.getmores - s0.getmores),
  "wakes " .. (s1.answered - s0.answered),
  "handoffs " .. (s1.handed + s1.granted - s0.handed - s0.granted),
  "threads " .. s1.threads,
  -- named locks (mongolock.ngx.runner): attempts sent, locks made from a
  -- grant's event alone
  "attempts " .. (l1.attempts - l0.attempts),
  "granted " .. (l1.granted - l0.granted),
}
if h and after then out[#out + 1] = after(h) end
if h and h.release then h:release() end
local body = table.concat(out, "\n") .. "\n"
ngx.header.content_length = #body
ngx.print(body)
]==]

local GATE_HANDLER = [==[
local mongolock = require "resty.mongolock"
local key = ngx.var.arg_key
local function new(o)
  local t = { uri = os.getenv("MONGODB_URI"), collection = "nginx_gate_spec" }
  for k, v in pairs(o or {}) do t[k] = v end
  return assert(mongolock:new(t))
end
local out = {}

-- five waiters queue behind a holder, for longer than their max_step
-- (they look again several times), and get the lock in arrival order
local holder = new()
assert(holder:lock(key .. "-fifo") == 0)
local order, threads = {}, {}
for i = 1, 5 do
  threads[i] = ngx.thread.spawn(function()
    local l = new({ timeout = 10, max_step = 0.05 })
    local elapsed, err = l:lock(key .. "-fifo")
    if not elapsed then order[#order + 1] = "error:" .. tostring(err); return end
    order[#order + 1] = i
    ngx.sleep(0.01)
    assert(l:unlock() == 1)
  end)
end
ngx.sleep(0.3)
assert(holder:unlock() == 1)
for i = 1, 5 do ngx.thread.wait(threads[i]) end
out[#out + 1] = "order " .. table.concat(order, ",")

-- a holder that never unlocks holds the queue no longer than its lease
do
  local a = new({ exptime = 0.3 })
  assert(a:lock(key .. "-abandoned") == 0)
end
local b = new({ timeout = 5 })
local elapsed, err = b:lock(key .. "-abandoned")
out[#out + 1] = "abandoned " .. (elapsed and "locked" or tostring(err))
if elapsed then b:unlock() end

-- a waiter behind a holder gives up after its timeout
local c = new()
assert(c:lock(key .. "-timeout") == 0)
local d = new({ timeout = 0.2 })
local e2, err2 = d:lock(key .. "-timeout")
out[#out + 1] = "timeout " .. tostring(e2) .. " " .. tostring(err2)
assert(c:unlock() == 1)

-- a holder whose lease ended and was taken over learns it at unlock
do
  local a = new({ exptime = 0.2 })
  assert(a:lock(key .. "-lost") == 0)
  ngx.sleep(0.4)
  local b = new()
  assert(b:lock(key .. "-lost"))
  local okl, errl = a:unlock()
  out[#out + 1] = "lost " .. tostring(okl) .. " " .. tostring(errl)
  assert(b:unlock() == 1)
end

-- a holder whose lease ended, taken by nobody: expire and unlock answer
-- lost, as a handle does past its deadline (the lease is not revived)
do
  local a = new({ exptime = 0.2 })
  assert(a:lock(key .. "-ended") == 0)
  ngx.sleep(0.4)
  local oke, erre = a:expire(5)
  local okl, errl = a:unlock()
  out[#out + 1] = "ended " .. tostring(oke) .. " " .. tostring(erre) .. " " .. tostring(okl) .. " "
    .. tostring(errl)
end

-- timeout 0: one attempt, which takes a free lock
do
  local z = new({ timeout = 0 })
  local ez, errz = z:lock(key .. "-zero")
  out[#out + 1] = "zero " .. tostring(ez) .. " " .. tostring(errz)
  if ez then z:unlock() end
end

-- a lock object collected while it holds releases its lock (its lease,
-- 30 s, would free it only later)
do
  local g = new({ exptime = 30 })
  assert(g:lock(key .. "-collected") == 0)
end
collectgarbage()
collectgarbage()
local h = new({ timeout = 5 })
local e3, err3 = h:lock(key .. "-collected")
out[#out + 1] = "collected " .. (e3 and "locked" or tostring(err3))
if e3 then h:unlock() end

ngx.say(table.concat(out, "\n"))
]==]

-- the example's database and its lock collection (the URI's database, as
-- resty.mongolock's default)
local EXAMPLE_DB = "mongolock_example"
local LOCK_COLLECTION = "nginx_locks"

-- every command of the library and of the example's counter goes through
-- these (the change stream's aggregate and getMore do not)
local SLOW_COMMANDS = { "findAndModify", "update", "find" }

describe("#integration nginx with resty.mongolock", function()
  local nginx, observer

  -- the failCommand fail point on every connection (mongod needs
  -- enableTestCommands); turned off by the caller, and by teardown
  local function failpoint(spec)
    assert(require("mongolock.testing").failpoint(observer._core, spec))
  end

  local function counter_lock()
    return assert(observer:locks({ collection = LOCK_COLLECTION }))
  end

  setup(function()
    assert(io.open(root .. "/build/luajit/mongolock/core.so"), "build/luajit is not built (make build)"):close()
    math.randomseed(os.time() + math.floor(socket.gettime() * 1000) % 100000)
    observer = helpers.connect()
    -- a new user's database: no counter document yet
    assert(observer:command(EXAMPLE_DB, { dropDatabase = 1 }))
    nginx = start_nginx({ locations = SPEC_LOCATIONS, files = { ["gate_spec.lua"] = GATE_HANDLER,
      ["saturate_spec.lua"] = SATURATE_HANDLER, ["api_spec.lua"] = API_HANDLER,
      ["cosocket_spec.lua"] = COSOCKET_HANDLER,
      ["doc_api_spec.lua"] = DOC_API_HANDLER, ["share_api_spec.lua"] = SHARE_API_HANDLER,
      ["election_api_spec.lua"] = ELECTION_API_HANDLER,
      ["wake_spec.lua"] = WAKE_HANDLER } })
  end)

  teardown(function()
    if observer then
      pcall(failpoint, { mode = "off" })
    end
    if nginx then nginx:stop() end
    if observer then observer:close() end
  end)

  it("answers the first /incr on an empty database with 200 (the fenced write creates the counter)", function()
    local code, body = get(nginx.port, "/incr")
    assert.equal(200, code, body)
    assert.equal("1 0\n", body)
    code, body = get(nginx.port, "/count")
    assert.equal(200, code)
    assert.equal("1 0\n", body)
    -- and stays fenced: a write with an older token than the document's is
    -- refused (a duplicate key of the upsert, read as "fenced off")
    local r = assert(observer:command(EXAMPLE_DB, { find = "counters" },
      { filter = { _id = "guarded" }, limit = 1, singleBatch = true }))
    local doc = assert(r.cursor.firstBatch[1])
    assert.is_number(doc.token)
    local _, err, ecode = observer:command(EXAMPLE_DB, { update = "counters" },
      { updates = { { q = { _id = "guarded", token = { ["$lt"] = doc.token } },
                      u = { ["$set"] = { n = 99, token = doc.token } }, upsert = true } } })
    assert.equal(11000, ecode, err)
  end)

  it("refuses resty.mongolock's fenced write delayed on the way past a takeover; nothing of it lands", function()
    local coll = helpers.unique("fenced")
    local code, body = get(nginx.port, "/fenced-stale?key=" .. helpers.unique("k") .. "&coll=" .. coll
      .. "&app=" .. helpers.unique("fenced-app"))
    assert.equal(200, code, body)
    local ok, err, named, newer = body:match("^(%S+) (%S+) (%S+) (%S+)$")
    assert.equal("nil", ok, body)
    assert.equal("fenced", err, body)
    assert.equal(newer, named, body)
    local r = assert(observer:command(helpers.database, { find = coll }, { filter = { _id = "d" } }))
    local d = r.cursor.firstBatch[1]
    assert.equal("next", d.by)
    assert.is_nil(d.n)
  end)

  it("commits resty.mongolock's guarded transaction, and nothing of one whose lock was taken over", function()
    local coll = helpers.unique("txn")
    local code, body = get(nginx.port, "/txn-spec?key=" .. helpers.unique("k") .. "&coll=" .. coll)
    assert.equal(200, code, body)
    assert.equal("committed nil lost", body)
    local r = assert(observer:command(helpers.database, { find = coll }, { sort = { _id = 1 } }))
    assert.equal(2, #r.cursor.firstBatch)
    assert.same({ "a", "b" }, { r.cursor.firstBatch[1]._id, r.cursor.firstBatch[2]._id })
  end)

  it("queues a worker's waiters in arrival order, never past a holder's lease or a waiter's timeout", function()
    local code, body = get(nginx.port, "/gate-spec?key=" .. helpers.unique("gate"))
    assert.equal(200, code, body)
    assert.equal(table.concat({ "order 1,2,3,4,5", "abandoned locked", "timeout nil timeout", "lost nil lost",
      "ended nil lost nil unlocked", "zero 0 nil", "collected locked" }, "\n") .. "\n", body)
  end)

  it("loses no update of the guarded counter under " .. REQUESTS
     .. " concurrent requests, and /ping answers meanwhile", function()
    local code, body = get(nginx.port, "/reset")
    assert.equal(200, code)
    assert.equal("0 0\n", body)

    -- /ping alone first, for comparison
    local idle = {}
    for i = 1, 200 do
      local t0 = socket.gettime()
      assert.equal(200, (get(nginx.port, "/ping")))
      idle[i] = socket.gettime() - t0
    end
    table.sort(idle)

    local client = helpers.connect()
    local ops0 = helpers.opcounters(client)
    -- a second view of /ping from another process (wrk, one connection,
    -- for the first second of the load), free of this client's own loop
    local wrk = io.popen(format("wrk -t1 -c1 -d1s --latency http://127.0.0.1:%d/ping 2>&1", nginx.port))
    local responses, pings, wall = load(nginx.port, "/incr", REQUESTS, open_pingers(nginx.port, 2, 2))
    local wrk_out = wrk:read("*a")
    wrk:close()
    local ops1 = helpers.opcounters(client)
    client:close()
    assert.equal(REQUESTS, #responses)
    local seen, waited = {}, 0
    for _, r in ipairs(responses) do
      assert.equal(200, r.code, r.body)
      local n, elapsed = r.body:match("^(%d+) (%S+)\n$")
      n = tonumber(n)
      assert.is_nil(seen[n], "two requests wrote " .. tostring(n))
      seen[n] = true
      if tonumber(elapsed) > 0 then waited = waited + 1 end
    end
    -- every value 1..N was written exactly once
    for i = 1, REQUESTS do assert.is_true(seen[i], "no request wrote " .. i) end
    code, body = get(nginx.port, "/count")
    assert.equal(200, code)
    assert.equal(REQUESTS, tonumber(body:match("^(%d+)")))
    assert.is_true(#pings > 0, "no /ping completed during the load")

    table.sort(pings)
    print(format("# nginx: %d concurrent /incr in %.2f s (%.0f req/s), %d waited for the lock; counter %d",
      REQUESTS, wall, REQUESTS / wall, waited, REQUESTS))
    local function latency(label, t)
      print(format("# nginx: /ping %s: %d requests, median %.2f ms, p90 %.2f ms, p99 %.2f ms, max %.2f ms",
        label, #t, percentile(t, 0.5) * 1000, percentile(t, 0.9) * 1000, percentile(t, 0.99) * 1000,
        t[#t] * 1000))
    end
    latency("alone", idle)
    latency("during the load", pings)
    local p50, p90, p99 = wrk_out:match("50%%%s+(%S+).-90%%%s+(%S+).-99%%%s+(%S+)")
    print(format("# nginx: /ping during the load, by wrk -c1 for 1 s: %s requests, median %s, p90 %s, p99 %s",
      wrk_out:match("(%d+) requests in") or "?", p50 or "?", p90 or "?", p99 or "?"))
    -- (the count includes one serverStatus)
    print(format("# nginx: server commands during the load: %d (%.2f per /incr; uncontended: 4, "
      .. "lock, read, write, unlock)",
      ops1.total - ops0.total, (ops1.total - ops0.total) / REQUESTS))

    -- the same without the lock, for the record (not asserted)
    local unguarded = load(nginx.port, "/incr-unguarded", REQUESTS, open_pingers(nginx.port, 2, 2))
    code, body = get(nginx.port, "/count")
    assert.equal(200, code)
    local u = tonumber(body:match("^%d+ (%d+)"))
    print(format("# nginx: without the lock: %d responses, counter %d (%d updates lost)",
      #unguarded, u, REQUESTS - u))

    local log = helpers.read_file(nginx.log) or ""
    assert.is_nil(log:match("%[error%][^\n]*"), log:match("%[error%][^\n]*"))
  end)

  -- issue 12's "before" case: each call blocked a worker for its round trip
  it("keeps /ping answering while every lock and counter command takes 200 ms (16 concurrent /incr)", function()
    local code, body = get(nginx.port, "/reset")
    assert.equal(200, code, body)
    local idle = {}
    for i = 1, 50 do
      local t0 = socket.gettime()
      assert.equal(200, (get(nginx.port, "/ping")))
      idle[i] = socket.gettime() - t0
    end
    local pingers = open_pingers(nginx.port, 2, 2)
    failpoint({ mode = "alwaysOn", commands = SLOW_COMMANDS, block_ms = 200 })
    local ok, responses, pings, wall = pcall(load, nginx.port, "/incr", 16, pingers)
    failpoint({ mode = "off" })
    assert(ok, responses)
    print(format("# nginx, server delayed 200 ms: 16 concurrent /incr in %.2f s; /ping alone: %s", wall,
      summary(idle)))
    print("# nginx, server delayed 200 ms: /ping during the load: " .. summary(pings))
    local seen = {}
    for _, r in ipairs(responses) do
      assert.equal(200, r.code, r.body)
      local n = tonumber(r.body:match("^(%d+) "))
      assert.is_nil(seen[n], "two requests wrote " .. tostring(n))
      seen[n] = true
    end
    for i = 1, 16 do assert.is_true(seen[i], "no request wrote " .. i) end
    code, body = get(nginx.port, "/count")
    assert.equal(200, code)
    assert.equal(16, tonumber(body:match("^(%d+)")))
    local st = counter_lock():status("counter")
    assert.is_false(st and st.held)
    -- the workers' waiters were woken by the releases handed to them (the
    -- change stream of each worker), not by polling
    local handoffs = 0
    local conns = open_pingers(nginx.port, 2, 1)
    for _, p in ipairs(conns) do
      local scode, stats = nx.keepalive_get(p.sock, "/mongolock-stats")
      assert.equal(200, scode)
      print("# worker " .. p.pid .. ": " .. stats:gsub("\n(.)", " %1"))
      handoffs = handoffs + (tonumber(stats:match("mongolock%.ngx%.runner%.granted (%d+)")) or 0)
      p.sock:close()
    end
    assert.is_true(handoffs > 0, "no waiter was woken by a release handed to it")
    table.sort(pings)
    assert.is_true(#pings >= 20, "only " .. #pings .. " /ping answered during the load")
    -- idle, a /ping takes well under a millisecond here: 50 ms is the
    -- margin, a blocked worker's 200 ms round trip is what it tells apart
    assert.is_true(percentile(pings, 0.9) < 0.05, "/ping p90 " .. percentile(pings, 0.9) * 1000 .. " ms")
  end)

  -- 16 concurrent requests to path (each answers the counter value it
  -- wrote first in its body) with every command delayed 200 ms, /ping timed
  -- meanwhile: every request answered 200 and wrote a distinct value 1..16;
  -- returns /ping's latencies
  local function slow_counter_load(path)
    local pingers = open_pingers(nginx.port, 2, 2)
    failpoint({ mode = "alwaysOn", commands = SLOW_COMMANDS, block_ms = 200 })
    local ok, responses, pings, wall = pcall(load, nginx.port, path, 16, pingers)
    failpoint({ mode = "off" })
    assert(ok, responses)
    print(format("# nginx, server delayed 200 ms: 16 concurrent %s in %.2f s; /ping meanwhile: %s",
      path:match("^[^?]*"), wall, summary(pings)))
    local seen = {}
    for _, r in ipairs(responses) do
      assert.equal(200, r.code, r.body)
      local n = tonumber(r.body:match("^(%d+)"))
      assert.is_nil(seen[n], "two requests wrote " .. tostring(n))
      seen[n] = true
    end
    for i = 1, 16 do assert.is_true(seen[i], "no request wrote " .. i) end
    return pings
  end

  -- at least 20 /ping answered, p90 under 50 ms (a blocked worker's 200 ms
  -- round trip is what it tells apart)
  local function assert_ping_p90(pings)
    table.sort(pings)
    assert.is_true(#pings >= 20, "only " .. #pings .. " /ping answered during the load")
    assert.is_true(percentile(pings, 0.9) < 0.05, "/ping p90 " .. percentile(pings, 0.9) * 1000 .. " ms")
  end

  -- issue 12, document locks and versioned collections: each of their
  -- round trips blocked a worker before they went through worker threads
  it("keeps /ping answering while 16 concurrent requests take a document lock and write a versioned "
     .. "document, every command 200 ms", function()
    local coll = helpers.unique("doccounter")
    -- the versioned document exists before (vc:modify reads, then writes)
    assert(observer:versioned(EXAMPLE_DB, coll .. "_v"):insert({ _id = "counter", n = 0 }))
    local pings = slow_counter_load("/doc-incr?coll=" .. coll)
    local docs = observer:documents(EXAMPLE_DB, coll)
    local doc, h = assert(docs:try("counter"))
    assert.equal(16, doc.n)
    assert(h:release())
    assert.equal(16, assert(observer:versioned(EXAMPLE_DB, coll .. "_v"):get("counter")).n)
    assert_ping_p90(pings)
  end)

  -- issue 12, reader-writer locks and semaphores
  it("keeps /ping answering while 16 concurrent requests take a reader's share and a semaphore's permit, "
     .. "every command 200 ms", function()
    local coll = helpers.unique("sharecounter")
    local pings = slow_counter_load("/share-incr?coll=" .. coll)
    local r = assert(observer:command(EXAMPLE_DB, { find = coll }, { filter = { _id = "counter" } }))
    assert.equal(16, r.cursor.firstBatch[1].n)
    local rst = observer:rwlocks({ collection = coll .. "_rw" }):status("gate")
    assert.equal(0, rst and rst.in_use or 0)
    local sst = observer:semaphores({ collection = coll .. "_sem", permits = 1 }):status("counter")
    assert.equal(0, sst and sst.in_use or 0)
    assert_ping_p90(pings)
  end)

  it("answers /incr with an error within its lock timeout while the server does not answer; "
     .. "/ping unaffected; the lock free afterwards", function()
    -- every command blocked 4 s, longer than /incr-short's 1 s timeout
    local pingers = open_pingers(nginx.port, 2, 2)
    failpoint({ mode = "alwaysOn", commands = SLOW_COMMANDS, block_ms = 4000 })
    local blocked_at = socket.gettime()
    local ok, responses, pings = pcall(load, nginx.port, "/incr-short", 2, pingers)
    failpoint({ mode = "off" })
    assert(ok, responses)
    print("# nginx, server not answering: /ping meanwhile: " .. summary(pings))
    for _, r in ipairs(responses) do
      assert.equal(503, r.code, r.body)
      assert.is_true(r.took < 2, format("/incr-short answered after %.2f s (timeout 1 s)", r.took))
    end
    table.sort(pings)
    assert.is_true(#pings >= 10, "only " .. #pings .. " /ping answered meanwhile")
    assert.is_true(percentile(pings, 0.9) < 0.05, "/ping p90 " .. percentile(pings, 0.9) * 1000 .. " ms")
    -- the attempts sent meanwhile end after the block; one that won the
    -- lock for a caller that had given up releases it at once (the lease,
    -- 10 s, would free it only later)
    local locks = counter_lock()
    local free = poll(function()
      local st = locks:status("counter")
      return (st == nil or not st.held) and socket.gettime()
    end, 9, "the lock to be free")
    assert.is_true(free - blocked_at < 9, "the lock was held until its lease ended")
    -- and it works again once the attempt that lost has left the queue
    -- too (it leaves when its reply comes; its place would lapse after 3 s)
    poll(function()
      local st = locks:status("counter")
      return st == nil or (not st.held and (st.waiting or 0) == 0)
    end, 5, "the queue to be empty")
    local code, body = get(nginx.port, "/incr-short")
    assert.equal(200, code, body)
  end)

  it("answers a document lock's timeout while the server does not answer, and releases at once the "
     .. "document an attempt locked after its caller gave up", function()
    local coll = helpers.unique("docshort")
    local pingers = open_pingers(nginx.port, 2, 2)
    failpoint({ mode = "alwaysOn", commands = SLOW_COMMANDS, block_ms = 4000 })
    local blocked_at = socket.gettime()
    local ok, responses, pings = pcall(load, nginx.port, "/doc-short?coll=" .. coll, 2, pingers)
    failpoint({ mode = "off" })
    assert(ok, responses)
    print("# nginx, server not answering, document locks: /ping meanwhile: " .. summary(pings))
    for _, r in ipairs(responses) do
      assert.equal(503, r.code, r.body)
      assert.equal("timeout\n", r.body)
      assert.is_true(r.took < 2, format("/doc-short answered after %.2f s (timeout 1 s)", r.took))
    end
    table.sort(pings)
    assert.is_true(percentile(pings, 0.9) < 0.05, "/ping p90 " .. percentile(pings, 0.9) * 1000 .. " ms")
    -- the attempts end after the block: the one that locked the document
    -- (created by its insert) for a caller gone releases it at once (its
    -- lease, 10 s, would free it only later)
    local docs = observer:documents(EXAMPLE_DB, coll)
    local free = poll(function()
      local st = docs:status("counter")
      return st and not st.held and socket.gettime()
    end, 9, "the document to be unlocked")
    assert.is_true(free - blocked_at < 9, "the document stayed locked until its lease ended")
    local code, body = get(nginx.port, "/doc-short?coll=" .. coll)
    assert.equal(200, code, body)
  end)

  it("releases at once a lock won for a request whose client went away meanwhile", function()
    local locks = counter_lock()
    local st0 = locks:status("counter")
    local token0 = st0 and st0.token or 0
    failpoint({ mode = "alwaysOn", commands = { "findAndModify" }, block_ms = 2000 })
    local c = assert(socket.connect("127.0.0.1", nginx.port))
    assert(c:send("GET /incr-abortable HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"))
    socket.sleep(0.3)
    c:close()            -- nginx ends the request (499); its attempt is in flight
    local gone_at = socket.gettime()
    failpoint({ mode = "off" })
    -- the attempt ends after its 2 s block and wins the free lock for
    -- nobody: it is released then, long before its 10 s lease ends
    local ok, free = pcall(poll, function()
      local st = locks:status("counter")
      return st and st.token > token0 and not st.held and socket.gettime()
    end, 9, "the lock to be won and released")
    assert(ok, tostring(free) .. "\n" .. (helpers.read_file(nginx.log) or ""))
    assert.is_true(free - gone_at < 8, "the lock was held until its lease ended")
    -- (a worker thread's job ends with the reply: the lock it won is
    -- released; an op on the request's cosocket ends with the request: its
    -- reply is lost, and what it may have won is given back)
    local log = helpers.read_file(nginx.log) or ""
    assert.is_truthy(log:find("was won after its caller gave up: released", 1, true)
      or log:find("got no reply after its caller gave up", 1, true), log)
  end)

  it("lets a worker's next waiter in when the one waiting at the server went away", function()
    local mine = nx.one_worker(nginx.port, 2)
    local key = helpers.unique("gone-owner")
    -- held from outside the worker, so that its first waiter owns the
    -- worker's gate while it waits at the server
    local olocks = observer:locks({ database = observer:default_database(),
      collection = "nginx_gate_spec" })
    local held = assert(olocks:acquire(key, { ttl = 30 }))
    local function send(sock, timeout)
      assert(sock:send(format("GET /hold-abortable?key=%s&ms=0&timeout=%d HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        key, timeout)))
    end
    send(mine[1], 30)
    socket.sleep(0.5)
    mine[1]:close()                    -- the gate's owner gone
    local t0 = socket.gettime()
    send(mine[2], 10)
    socket.sleep(0.5)
    assert.is_true(held:release())      -- granted to the waiter that went away
    mine[2]:settimeout(15)
    local code, body = nx.keepalive_read(mine[2])
    local took = socket.gettime() - t0
    assert.equal(200, code)
    -- the gate within a beat (queue_ttl / 2 + 2 s), the dead waiter's
    -- grant within its place (queue_ttl): not the 30 s of its timeout
    assert.equal("locked", body, format("after %.2f s", took))
    mine[2]:close()
  end)

  it("lets a worker's next waiter in when the waiters ahead of it went away", function()
    -- five keep-alive connections to one worker
    local mine = nx.one_worker(nginx.port, 5)
    local key = helpers.unique("gone")
    local function send(sock, ms, timeout)
      assert(sock:send(format("GET /hold-abortable?key=%s&ms=%d&timeout=%d HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        key, ms, timeout)))
    end
    send(mine[1], 1000, 10)            -- holds the lock for 1 s
    socket.sleep(0.1)
    for i = 2, 4 do send(mine[i], 0, 10) end
    socket.sleep(0.2)
    for i = 2, 4 do mine[i]:close() end   -- three queued waiters gone
    local t0 = socket.gettime()
    send(mine[5], 0, 5)
    mine[5]:settimeout(10)
    local code, body = nx.keepalive_read(mine[5])
    local took = socket.gettime() - t0
    assert.equal(200, code)
    assert.equal("locked", body)
    -- the holder's second, then at most a couple of max_step (0.5 s)
    assert.is_true(took < 3, format("the next waiter got the lock after %.2f s", took))
    mine[1]:close()
    mine[5]:close()
  end)

  -- one request to path (an /…-api-spec location: it runs every call of
  -- an API and answers one line per step) with every command delayed
  -- 200 ms: answered 200 with exactly the lines expected, /ping p90 under
  -- 50 ms meanwhile
  local function api_case(path, what, expected, commands)
    local pingers = open_pingers(nginx.port, 2, 2)
    failpoint({ mode = "alwaysOn", commands = commands or SLOW_COMMANDS, block_ms = 200 })
    local ok, responses, pings = pcall(load, nginx.port, path, 1, pingers)
    failpoint({ mode = "off" })
    assert(ok, tostring(responses) .. "\n" .. (helpers.read_file(nginx.log) or ""))
    print("# nginx, " .. what .. " with every command delayed 200 ms: /ping meanwhile: " .. summary(pings))
    assert.equal(200, responses[1].code, responses[1].body .. (helpers.read_file(nginx.log) or ""))
    assert.equal(table.concat(expected, "\n") .. "\n", responses[1].body)
    assert_ping_p90(pings)
  end

  it("runs a lock's round trips on the event loop through cosockets, no worker thread, a cosocket object per "
     .. "runner and connection; with configure{cosockets = false} in worker threads; holds no outcome its caller "
     .. "took", function()
    -- a try and a release: two round trips a cycle, 40 on cosockets; the
    -- worker's other work (a stream's command, another client's renewal)
    -- may run a job meanwhile
    local function counts(path)
      local code, body = get(nginx.port, path .. "&key=" .. helpers.unique("cosocket"))
      assert.equal(200, code, body)
      local here, jobs, here2, jobs2, held, objects = body:match(
        "^cosockets (%d+) (%d+)\nthreads (%d+) (%d+)\noutcomes held (%d+)\nobjects (%d+)\n$")
      assert(here, body)
      -- a runner takes a kept connection with the cosocket object it used
      -- for it before: one object per runner and connection (a runner at
      -- a time here), not one per round trip (40)
      assert.is_true(tonumber(objects) <= 4, body)
      -- a job's outcome taken by its caller is not held until the janitor's
      -- next sweep (it held the op and the reply: 4 MB at full speed)
      assert.equal(0, tonumber(held), body)
      assert.is_true(tonumber(here) >= 40, body)
      assert.is_true(tonumber(jobs) <= 4, body)
      assert.equal(0, tonumber(here2), body)
      assert.is_true(tonumber(jobs2) >= 10, body)
    end
    counts("/cosocket-spec?")
    -- a server named in the URI: its address comes from a worker thread's
    -- getaddrinfo (nginx resolves no name for a cosocket without a resolver)
    counts("/cosocket-spec?name=1")
  end)

  it("runs client:locks() (try, acquire, with, the handle) off the event loop", function()
    api_case("/api-spec?key=" .. helpers.unique("api"), "client:locks()", {
      "try true named true true",
      "busy busy timeout",
      "extended true",
      "released true false not held",
      "handed true nil true",
      "closed closed",
      "with inside",
      "status true true true",
      "forced true lost not held",
    })
  end)

  it("runs client:documents() (try, lock, with, status, the handle) off the event loop", function()
    api_case("/doc-api-spec?key=" .. helpers.unique("doc"), "client:documents()", {
      "missing not found",
      "try true document true 1",
      "busy busy true 1 timeout",
      "status true true",
      "extended true",
      "bad changes true true",
      "released true false not held",
      "handed 3 true true",
      "closed closed",
      "with 4 4 nil",
      "collected true",
      "jobs true",
    })
  end)

  it("runs client:rwlocks() and client:semaphores() (shares, permits, status, list, force_release, the "
     .. "handle) off the event loop", function()
    api_case("/share-api-spec?key=" .. helpers.unique("share"), "rwlocks and semaphores", {
      "read shared true true true",
      "write busy 2",
      "named true shared 2",
      "status 2",
      "extended true",
      "released true false not held",
      "permits permit busy",
      "handed true nil true",
      "mismatch true",
      "list true",
      "forced true lost not held",
      "collected true",
      "jobs true",
    })
  end)

  it("runs client:elections() (campaign, proclaim, leader, resign, observe) off the event loop", function()
    api_case("/election-api-spec?key=" .. helpers.unique("election"), "client:elections()", {
      "current current false",
      "lead true true one",
      "busy timeout",
      "leader uno true",
      "handed true nil true true",
      "observed leader one,value uno,none,leader two",
      "jobs true",
    }, { "findAndModify", "update", "find", "aggregate" })
  end)

  it('wait = "watch" without a change stream answers an error for named and document locks, never polls',
     function()
    -- every change stream's aggregate fails: the worker's (named locks) and
    -- the process's (document locks) cannot open
    failpoint({ mode = "alwaysOn", commands = { "aggregate" }, error_code = 2 })
    local ok, code, body = pcall(get, nginx.port, "/wait-mode?wait=watch&key=w&coll=" .. helpers.unique("wm"))
    local ok2, code2, body2 = pcall(get, nginx.port, "/wait-mode?wait=auto&key=w&coll=" .. helpers.unique("wm"))
    failpoint({ mode = "off" })
    assert(ok, code)
    assert(ok2, code2)
    assert.equal(200, code, body)
    local named, doc = body:match("^(.-)\n(.-)\n$")
    -- as outside nginx: "change stream: ..." or "change streams need a
    -- replica set ..." (README, wait)
    assert.matches("change stream", named, 1, true)
    assert.is_not.equal("timeout", doc)
    assert.is_nil(doc:find("mongolock.Lock", 1, true), doc)
    -- "auto" falls back to polling: both wait out their timeout
    assert.equal(200, code2, body2)
    assert.equal("timeout\ntimeout\n", body2)
  end)

  -- issue 12: every kind's waiters wait on the client's change stream read
  -- by the worker (csrc/binding/watch.c's machine, each getMore a worker-thread
  -- job: mongolock.ngx.runner), woken through a semaphore; no stream thread
  -- is started
  local function wake(kind, id)
    local code, body = get(nginx.port, "/wake-spec?kind=" .. kind .. "&coll=" .. helpers.unique("wake")
      .. "&id=" .. (id or ""))
    assert.equal(200, code, body .. (helpers.read_file(nginx.log) or ""))
    print(format("# nginx, a %s%s waiter woken: %s", kind, id and " (_id " .. id .. ")" or "",
      (body:gsub("\n(.)", ", %1"):gsub("\n$", ""))))
    local r = {}
    for k, v in body:gmatch("(%a+) ([^\n]*)\n") do r[k] = v end
    assert.equal("true nil", r.acquired)
    assert.equal("true", r.released)
    -- the waiter's first poll would come 4 to 8 s after its attempt
    assert.is_true(tonumber(r.elapsed) < 3, "acquired after " .. r.elapsed .. " s")
    assert.is_true(tonumber(r.getmores) >= 1, "no getMore of the worker's stream")
    assert.is_true(tonumber(r.wakes) >= 1, "no waiter woken by the worker's stream")
    assert.equal("0", r.threads)
    return r
  end

  it("wakes a document lock's waiter through the worker's change stream, not the process's", function()
    wake("document")
  end)

  it("wakes a document lock's waiter whose _id is an ObjectId, or a number the holder wrote as another type",
     function()
    wake("document", "objectid")
    wake("document", "int64")
    wake("document", "int64-waiter")
  end)

  it("grants a named lock's waiter the lock from the release's event alone: one attempt, no other command",
     function()
    local r = wake("named")
    assert.is_true(tonumber(r.handoffs) >= 1, "the release was not handed to the waiter")
    assert.equal("1", r.granted)
    assert.equal("1", r.attempts)
  end)

  -- short=1: a grant of under 1 s (the place) of a ttl of 10 s, looked at
  -- 1.5 s after; short=2: about 1.7 s (a place of 2 s) of a ttl of 2.5 s,
  -- over two thirds of it and still short, looked at once the server's
  -- lease is over 2 s (or the handle's has ended)
  for _, case in ipairs({ { "1", 5 }, { "2", 2 } }) do
    it("tops a granted named lock's short lease up to its ttl before it ends, never past the server's view ("
       .. "short=" .. case[1] .. ")", function()
      local r = wake("named&short=" .. case[1])
      assert.equal("1", r.granted)
      local held, mine, server = r.after:match("^(%a+) ([%d.]+) ([%d.]+)$")
      assert.equal("true", held, r.after)
      assert.is_true(tonumber(mine) > case[2], r.after)
      assert.is_true(tonumber(mine) <= tonumber(server) + 0.001, r.after)
    end)
  end

  it("wakes the worker's lease engine timer for a lease made only when it is due before the timer's next look",
     function()
    local code, body = get(nginx.port, "/engine-spec?coll=" .. helpers.unique("engine"))
    assert.equal(200, code, body .. (helpers.read_file(nginx.log) or ""))
    print("# nginx, the lease engine's timer: " .. body:gsub("\n(.)", ", %1"):gsub("\n$", ""))
    -- the timer looks every 0.25 s at most while nothing is due: 200
    -- cycles took nowhere near 12 s (a look for each lease made: 200)
    local looks = tonumber(body:match("cycles 200 looks (%d+)"))
    assert.is_true(looks < 50, body)
    -- renewed at 0.5 s, 1 s and 1.5 s, though the timer meant to sleep 5 s
    assert.truthy(body:find("short true nil", 1, true), body)
  end)

  it("wakes a semaphore's waiter through the worker's change stream (the release handed to it)", function()
    local r = wake("semaphore")
    assert.is_true(tonumber(r.handoffs) >= 1, "the release was not handed to the waiter")
  end)

  it("wakes a reader waiting behind a writer through the worker's change stream", function()
    wake("rw")
  end)

  it("a waiter whose attempt got no reply gives back what it may hold, and waits on", function()
    local key = helpers.unique("noreply")
    failpoint({ times = 2, commands = { "findAndModify" }, close_connection = true,
      app_name = "resty.mongolock" })
    local before = helpers.opcounters(observer).update
    local code, body = get(nginx.port, "/hold-abortable?ms=0&timeout=5&key=" .. key)
    failpoint({ mode = "off" })
    assert.equal(200, code, body)
    -- a closed connection is transient: the wait goes on (under a new
    -- waiter id) and takes the lock
    assert.equal("locked", body)
    assert.truthy(helpers.eventually(function()
      return helpers.opcounters(observer).update - before >= 1
    end, 5), "no leave")
  end)

  -- (a try of each: an acquire's attempt goes through the same function)
  it("a share or a document's lock whose attempt and its retry both got no reply is given back",
     function()
    local admin = observer._core
    -- the fail point's count of times it fired (mongod's timesEntered)
    local function fp(name, mode, data)
      return assert(admin:command("admin", { configureFailPoint = name }, { mode = mode, data = data })).count
    end
    local docs = observer:documents("mongolock_test", "nginx_doc_once_spec")
    for _, kind in ipairs({ "rw", "doc" }) do
      for _, call in ipairs({ "try" }) do
        local key = helpers.unique("share-once")
        if kind == "doc" then
          assert(observer:command("mongolock_test", { insert = "nginx_doc_once_spec" },
            { documents = { { _id = key } } }))
        end
        -- the attempt commits and its connection closes instead of the
        -- reply; the retry's connection closes before it runs
        fp("failCommand", { skip = 1 }, { failCommands = { "findAndModify" }, closeConnection = true,
          appName = "share-once-spec" })
        local before = fp("onPrimaryTransactionalWrite", { times = 1 })
        local code, body = get(nginx.port, "/attempt-once?kind=" .. kind .. "&call=" .. call .. "&key=" .. key)
        local after = fp("onPrimaryTransactionalWrite", "off")
        fp("failCommand", "off")
        -- the attempt was applied, its reply dropped (not another write's)
        assert.equal(1, after - before, "the fail point fired once")
        assert.equal(200, code, body)
        assert.matches("^nil ", body)
        if kind == "doc" then
          assert.truthy(helpers.eventually(function() return not assert(docs:status(key)).held end, 5),
            "doc " .. call .. ": still locked by nobody")
        else
          local obj = kind == "sem" and observer:semaphores({ collection = "nginx_share_once_spec", permits = 2 })
            or observer:rwlocks({ collection = "nginx_share_once_spec" })
          local st = assert(obj:status(key), "the attempt was applied")
          assert.truthy(helpers.eventually(function() return assert(obj:status(key)).in_use == 0 end, 5),
            kind .. " " .. call .. ": still held by nobody (" .. tostring(st.in_use) .. ")")
        end
      end
    end
  end)

  it("in log_by_lua (no yield possible) locks and commands keep working, blocking", function()
    local conns = open_pingers(nginx.port, 2, 1)
    for _, p in ipairs(conns) do
      local code = nx.keepalive_get(p.sock, "/log-phase")
      assert.equal(200, code)
      local body
      poll(function()
        code, body = nx.keepalive_get(p.sock, "/log-phase-result")
        return body ~= "none"
      end, 10, "the log phase's result")
      assert.equal("0 nil 1 nil 1 nil", body)
      p.sock:close()
    end
  end)
end)

-- a worker shutting down (nginx -s quit) while requests wait for a lock:
-- they wait on, polling (no change stream is opened in an exiting worker),
-- and nginx exits once they are answered
describe("#integration nginx shutting down while waiters wait", function()
  local nginx, observer

  setup(function()
    observer = helpers.connect()
    nginx = start_nginx({ locations = SPEC_LOCATIONS })
  end)

  teardown(function()
    if nginx then nginx:stop() end
    if observer then observer:close() end
  end)

  it("keeps its waiters polling, not reopening the change stream in a loop, and exits once they are "
     .. "answered", function()
    local key = helpers.unique("quit")
    local locks = observer:locks({ collection = "nginx_gate_spec" })
    local holder = assert(locks:acquire(key, { ttl = 60 }))
    finally(function() pcall(holder.release, holder) end)
    -- waiters in both workers (resty.mongolock: one per worker asks the
    -- server, the others queue behind it in the worker)
    local conns = {}
    for i = 1, 8 do
      local c = assert(socket.connect("127.0.0.1", nginx.port))
      assert(c:send(format("GET /hold-abortable?key=%s&ms=0&timeout=30 HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
        key)))
      conns[i] = c
    end
    poll(function()
      local st = locks:status(key)
      return st and (st.waiting or 0) >= 1
    end, 10, "the waiters to queue")
    socket.sleep(1)
    local ops0 = helpers.opcounters(observer)
    assert(nx.sh(format("kill -QUIT %d", nginx.pid)))
    socket.sleep(2)
    local ops1 = helpers.opcounters(observer)
    local commands = ops1.total - ops0.total
    print(format("# nginx shutting down, waiters waiting: %d server commands in 2 s", commands))
    -- polling, the waiters ask every max_step (0.5 s) at most: a few
    -- dozen commands; a worker that opened a stream per wake-up, which
    -- its exit ended at once, sent thousands
    assert.is_true(commands < 300, commands .. " server commands in 2 s")
    -- released: every waiter gets the lock in turn, and nginx exits
    assert(holder:release())
    for i, c in ipairs(conns) do
      c:settimeout(20)
      local raw = c:receive("*a") or ""
      c:close()
      assert.equal("locked", raw:match("\r\n\r\n(.*)$"), "waiter " .. i .. ": " .. raw)
    end
    local ok = pcall(poll, function() return nx.gone(nginx.pid) end, 10,
      "nginx to exit")
    assert.is_true(ok, "nginx did not exit once its requests were answered")
  end)
end)

-- a lock whose handle is collected while its worker shuts down
describe("#integration nginx shutting down while a request drops a lock it holds", function()
  local nginx, observer
  local LOCATION = [[
        # ?key=&before=: takes the lock key (ttl 30 s) and drops its handle
        # after `before` seconds, then sleeps 4 s more
        location = /drop-held {
            content_by_lua_block {
                local c = package.loaded.drop_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "drop" }))
                    package.loaded.drop_client = c
                end
                do
                    local h = assert(c:locks({ collection = "nginx_drop_spec" }):try(ngx.var.arg_key, { ttl = 30 }))
                end
                ngx.sleep(tonumber(ngx.var.arg_before))
                collectgarbage()
                collectgarbage()
                ngx.sleep(4)
                ngx.header.content_length = 5
                ngx.say("done")
            }
        }

]]

  setup(function()
    observer = helpers.connect()
    nginx = start_nginx({ locations = LOCATION })
  end)

  teardown(function()
    if nginx then nginx:stop() end
    if observer then observer:close() end
  end)

  it("releases it from its janitor (the lease, 30 s, would free it only later), then exits", function()
    local key = helpers.unique("drop")
    local locks = observer:locks({ collection = "nginx_drop_spec" })
    local c = assert(socket.connect("127.0.0.1", nginx.port))
    assert(c:send(format("GET /drop-held?key=%s&before=2 HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", key)))
    poll(function()
      local st = locks:status(key)
      return st and st.held
    end, 10, "the request to take the lock")
    assert(nx.sh(format("kill -QUIT %d", nginx.pid)))
    local t0 = socket.gettime()
    local ok = pcall(poll, function()
      local st = locks:status(key)
      return st and not st.held
    end, 15, "the lock to be released")
    local took = socket.gettime() - t0
    assert.is_true(ok, format("the dropped lock was still held %.1f s after its worker began shutting down", took))
    print(format("# nginx shutting down: a lock its request dropped (about 2 s after it was taken) was free "
      .. "%.1f s after QUIT", took))
    c:settimeout(20)
    local raw = c:receive("*a") or ""
    c:close()
    assert.equal("done\n", raw:match("\r\n\r\n(.*)$"))
    local exited = pcall(poll, function() return nx.gone(nginx.pid) end, 10,
      "nginx to exit")
    assert.is_true(exited, "nginx did not exit once its request was answered")
  end)
end)

-- a lock a request keeps held (its handle in a global) while its worker
-- shuts down: the lease engine keeps the worker up to the lease's end, and
-- the log says so (after mongolock.ngx's LINGER seconds, 0.5 here)
describe("#integration nginx shutting down while a lock is held", function()
  local nginx, observer
  local LOCATION = [[
        # ?key=&ttl=: takes the lock key and keeps its handle
        location = /keep-held {
            content_by_lua_block {
                require("mongolock.ngx").LINGER = 0.5
                local c = package.loaded.keep_client
                if not c then
                    c = assert(require("mongolock").connect(os.getenv("MONGODB_URI"), { appname = "keep" }))
                    package.loaded.keep_client = c
                end
                local h = assert(c:locks({ collection = "nginx_keep_spec" }):try(ngx.var.arg_key,
                  { ttl = tonumber(ngx.var.arg_ttl) }))
                package.loaded.keep_handles = package.loaded.keep_handles or {}
                table.insert(package.loaded.keep_handles, h)
                ngx.say("held")
            }
        }

]]

  setup(function()
    observer = helpers.connect()
    nginx = start_nginx({ locations = LOCATION })
  end)

  teardown(function()
    if observer then pcall(require("mongolock.testing").failpoint, observer._core, { mode = "off" }) end
    if nginx then nginx:stop() end
    if observer then observer:close() end
  end)

  it("stays up to the lease's end and says in its log what keeps it (the lock, a job in flight)", function()
    local key = helpers.unique("keep")
    local code, body = get(nginx.port, format("/keep-held?key=%s&ttl=4", key))
    assert.equal(200, code, body)
    assert.equal("held\n", body)
    -- a second request's attempt, its reply delayed 2.5 s, in flight at QUIT
    assert(require("mongolock.testing").failpoint(observer._core, { times = 1, commands = { "findAndModify" },
      block_ms = 2500, app_name = "keep" }))
    local c = assert(socket.connect("127.0.0.1", nginx.port))
    assert(c:send(format("GET /keep-held?key=%s-2&ttl=4 HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", key)))
    socket.sleep(0.5)
    local t0 = socket.gettime()
    assert(nx.sh(format("kill -QUIT %d", nginx.pid)))
    c:settimeout(10)
    local raw = c:receive("*a") or ""
    c:close()
    assert.equal("held\n", raw:match("\r\n\r\n(.*)$"), raw)
    local exited = pcall(poll, function() return nx.gone(nginx.pid) end, 15, "nginx to exit")
    local took = socket.gettime() - t0
    assert.is_true(exited, "nginx did not exit after the lease's end")
    print(format("# nginx shutting down with a lock of 4 s held: exited %.1f s after QUIT", took))
    local log = helpers.read_file(nginx.log) or ""
    assert.truthy(log:find("this worker is shutting down; locks held here keep it up to", 1, true),
      log:sub(-2000))
    assert.truthy(log:find("this worker is shutting down and still has jobs after 0.5 s: 1 running, 0 queued", 1, true),
      log:sub(-2000))
  end)
end)

describe("#integration nginx without the thread pool", function()
  local nginx

  setup(function()
    nginx = start_nginx({
      edit = function(conf)
        local n
        conf, n = conf:gsub("\nthread_pool mongolock [^\n]*\n", "\n")
        assert.equal(1, n, "the example's thread_pool directive moved")
        return conf
      end,
    })
  end)

  teardown(function()
    if nginx then nginx:stop() end
  end)

  it("answers /incr with an error that names the missing directive, and /ping", function()
    local code = get(nginx.port, "/incr")
    assert.equal(503, code)
    assert.equal(200, (get(nginx.port, "/ping")))
    local log = helpers.read_file(nginx.log) or ""
    assert.is_truthy(log:find("nginx.conf needs 'thread_pool mongolock threads=N;'", 1, true), log)
  end)
end)

describe("#integration nginx saturated: one worker, 4 thread VMs", function()
  local nginx, observer
  local CALLS, KEYS = 64, 16

  setup(function()
    observer = helpers.connect()
    nginx = start_nginx({
      locations = SPEC_LOCATIONS,
      files = { ["gate_spec.lua"] = GATE_HANDLER, ["saturate_spec.lua"] = SATURATE_HANDLER },
      edit = function(conf)
        local n
        conf, n = conf:gsub("worker_processes %d+;", "worker_processes 1;")
        assert.equal(1, n, "the example's worker_processes moved")
        -- fewer VMs than mongolock.ngx's max_running (8): mongolock.ngx
        -- must hold calls back rather than pass "no available Lua vm" on
        if conf:find("lua_worker_thread_vm_pool_size %d+;") then
          conf = conf:gsub("lua_worker_thread_vm_pool_size %d+;", "lua_worker_thread_vm_pool_size 4;")
        else
          conf = conf:gsub("\nhttp {\n", "%0    lua_worker_thread_vm_pool_size 4;\n", 1)
        end
        return conf
      end,
    })
  end)

  teardown(function()
    if observer then
      pcall(require("mongolock.testing").failpoint, observer._core, { mode = "off" })
    end
    if nginx then nginx:stop() end
    if observer then observer:close() end
  end)

  local function total()
    local ids = {}
    for k = 1, KEYS do ids[k] = "saturate-" .. k end
    local r = assert(observer:command(EXAMPLE_DB, { find = "counters" },
      { filter = { _id = { ["$in"] = ids } } }))
    local sum = 0
    for _, d in ipairs(r.cursor.firstBatch) do sum = sum + d.n end
    return sum
  end

  it(CALLS .. " concurrent lock cycles on " .. KEYS .. " locks in one worker: none refused, none lost, "
     .. "/ping answers", function()
    local before = total()
    local pingers = open_pingers(nginx.port, 1, 2)
    assert(require("mongolock.testing").failpoint(observer._core,
      { mode = "alwaysOn", commands = SLOW_COMMANDS, block_ms = 20 }))
    local ok, responses, pings = pcall(load, nginx.port, format("/saturate?n=%d&keys=%d", CALLS, KEYS), 1,
      pingers)
    assert(require("mongolock.testing").failpoint(observer._core, { mode = "off" }))
    assert(ok, responses)
    print("# nginx saturated (" .. CALLS .. " lock cycles, server delayed 20 ms): /ping meanwhile: "
      .. summary(pings))
    local _, stats = get(nginx.port, "/mongolock-stats")
    print("# " .. stats:gsub("\n(.)", " %1"))
    assert.equal(200, responses[1].code, responses[1].body)
    assert.equal(format("ok %d failed 0\n", CALLS), responses[1].body)
    assert.equal(before + CALLS, total())
    local log = helpers.read_file(nginx.log) or ""
    assert.is_nil(log:find("no available Lua vm", 1, true))
    -- every round trip went off the blocking path, on cosockets or through
    -- the worker threads (lock attempts, releases, the counter's find and
    -- update: at least 4 per cycle), and the VMs the worker was short of
    -- were waited for, not failed
    assert.is_true(tonumber(stats:match("mongolock%.ngx%.jobs (%d+)"))
      + tonumber(stats:match("mongolock%.ngx%.here (%d+)")) >= 4 * CALLS, stats)
    assert.is_true(tonumber(stats:match("mongolock%.ngx%.errors (%d+)")) == 0, stats)
    -- (/ping is timed above for the record; the slow-server cases assert it)
  end)
end)

-- the handle cases of spec/conformance_cases.lua inside nginx: every round
-- trip a worker thread's job, the waits and sleeps on the event loop
describe("#integration the specs' nginx (nginx_helpers.start)", function()
  -- with reuseport on both, a second nginx binds the port of another (of
  -- the same user, another spec run's on a shared machine) and the kernel
  -- spreads the connections over both: a spec then reads the other's
  -- answers.  The port is drawn again instead.
  it("never takes a port another nginx listens on with reuseport", function()
    local a = nx.start()
    local random, drawn = math.random, 0
    math.random = function(...) -- luacheck: ignore 122
      drawn = drawn + 1
      if drawn == 1 then return a.port end
      return random(...)
    end
    local ok, b = pcall(nx.start)
    math.random = random -- luacheck: ignore 122
    a:stop()
    assert(ok, b)
    local port = b.port
    b:stop()
    assert.is_true(drawn >= 2)
    assert.are_not.equal(a.port, port)
  end)
end)

describe("#integration nginx handle conformance", function()
  local nginx
  local cases = require "conformance_cases"
  local LOCATION = [[
        # ?case=: runs one case of spec/conformance_cases.lua, answers "ok"
        # or what differed
        location = /conformance {
            content_by_lua_block {
                local cases = require "conformance_cases"
                local env = package.loaded.conformance_env
                if not env then
                    local mongolock = require "mongolock"
                    local app = "conf-ngx-" .. ngx.worker.pid()
                    local n = 0
                    env = {
                        app = app, sleep = ngx.sleep,
                        client = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = app })),
                        observer = assert(mongolock.connect(os.getenv("MONGODB_URI"), { appname = "conf-observer" })),
                        unique = function(p)
                            n = n + 1
                            return string.format("%s-%d-%d-%d", p, ngx.worker.pid(), ngx.time(), n)
                        end,
                    }
                    package.loaded.conformance_env = env
                end
                local ok, err = pcall(cases.run, ngx.unescape_uri(ngx.var.arg_case), env)
                local body = ok and "ok" or tostring(err)
                ngx.header.content_length = #body + 1
                ngx.say(body)
            }
        }

]]

  setup(function()
    nginx = start_nginx({ locations = LOCATION, edit = function(conf)
      return (conf:gsub('lua_package_path "', 'lua_package_path "$prefix/spec/?.lua;', 1))
    end })
  end)

  teardown(function()
    if nginx then nginx:stop() end
  end)

  for _, name in ipairs(cases.names) do
    it(name, function()
      local c = assert(socket.connect("127.0.0.1", nginx.port))
      c:settimeout(30)
      assert(c:send(format("GET /conformance?case=%s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
        name:gsub("[^%w]", function(ch) return format("%%%02X", ch:byte()) end))))
      local raw = c:receive("*a") or ""
      c:close()
      assert.equal("ok\n", raw:match("\r\n\r\n(.*)$"), raw)
    end)
  end
end)

describe("#integration nginx serving a tree in a directory only its owner may enter (mode 0700)", function()
  local nginx, dir

  setup(function()
    -- a copy of what nginx loads (lua/, build/luajit/, examples/) inside a
    -- private directory, as a checkout under root's home is
    dir = assert(io.popen("mktemp -d")):read("*l")
    assert(os.execute(string.format("chmod 700 %s && mkdir -p %s/tree/build && cp -a %s %s %s/tree/ && "
      .. "cp -a %s %s/tree/build/", helpers.shell_quote(dir), helpers.shell_quote(dir),
      helpers.shell_quote(root .. "/lua"), helpers.shell_quote(root .. "/examples"), helpers.shell_quote(dir),
      helpers.shell_quote(root .. "/build/luajit"), helpers.shell_quote(dir))))
    nginx = start_nginx({ root = dir .. "/tree" })
  end)

  teardown(function()
    if nginx then nginx:stop() end
    if dir then os.execute("rm -rf " .. helpers.shell_quote(dir)) end
  end)

  it("its workers load the library from there and answer /incr", function()
    local code, body = get(nginx.port, "/incr")
    assert.equal(200, code, body .. (helpers.read_file(nginx.log) or ""))
  end)
end)

describe("#integration nginx: the example's error log under load", function()
  local nginx

  -- a wait that polls (wait = "poll": its first steps are shorter than a
  -- millisecond, ngx.sleep's unit) for a lock a light thread of the same
  -- request releases after 50 ms
  local POLL_WAIT = [[
        location = /poll-wait-spec {
            content_by_lua_block {
                local mongolock = require "mongolock"
                local c = assert(mongolock.connect(os.getenv("MONGODB_URI")))
                local locks = assert(c:locks({ collection = "nginx_poll_wait_spec" }))
                local key = ngx.var.arg_key
                local h = assert(locks:acquire(key, { ttl = 5 }))
                ngx.thread.spawn(function() ngx.sleep(0.05); h:release() end)
                local h2, err = locks:acquire(key, { wait = "poll", timeout = 5 })
                ngx.say(h2 and "held" or ("nil " .. tostring(err)))
                if h2 then h2:release() end
                c:close()
            }
        }
]]

  setup(function()
    nginx = start_nginx({ locations = POLL_WAIT })
  end)

  teardown(function()
    if nginx then nginx:stop() end
  end)

  it("stays clean through 400 concurrent /incr and polling waits (no ngx.sleep(0), no [error] or [warn])",
     function()
    assert.equal(200, (get(nginx.port, "/reset")))
    local responses = load(nginx.port, "/incr", 400, {})
    assert.equal(400, #responses)
    for _, r in ipairs(responses) do assert.equal(200, r.code, r.body) end
    assert.equal(200, (get(nginx.port, "/metrics")))
    for i = 1, 5 do
      local code, body = get(nginx.port, "/poll-wait-spec?key=" .. helpers.unique("poll" .. i))
      assert.equal(200, code, body)
      assert.equal("held\n", body)
    end
    local log = helpers.read_file(nginx.log) or ""
    assert.is_falsy(log:find("ngx.sleep(0)", 1, true), log)
    local bad = {}
    for line in log:gmatch("[^\n]+") do
      if line:find("%[error%]") or line:find("%[warn%]") or line:find("%[alert%]") or line:find("%[crit%]") then
        bad[#bad + 1] = line
      end
    end
    assert.same({}, bad)
  end)
end)
