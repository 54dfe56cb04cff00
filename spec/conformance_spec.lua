-- The handle cases of spec/conformance_cases.lua on the plain client (the
-- C core's own threads); spec/nginx_spec.lua runs the same cases inside
-- nginx.
local helpers = require "helpers"
local core = require "mongolock.core"
local cases = require "conformance_cases"

describe("#integration handle conformance, plain client", function()
  local env

  setup(function()
    local app = helpers.unique("conf"):sub(1, 60)
    env = { app = app, client = helpers.connect({ appname = app }), observer = helpers.connect(),
            sleep = core.sleep, unique = helpers.unique }
  end)
  teardown(function()
    env.observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })
    env.client:close()
    env.observer:close()
  end)

  for _, name in ipairs(cases.names) do
    it(name, function() cases.run(name, env) end)
  end
end)

-- the same cases in a coroutine of a cqueues loop, on a client connected
-- with scheduler = "cqueues": every round trip a job of the core's
-- worker threads (mongolock.sched), every sleep the loop's
describe("#integration handle conformance, in a cqueues scheduler's coroutine", function()
  local env, cqueues, mongolock

  setup(function()
    cqueues = require "cqueues"
    mongolock = require "mongolock"
    local app = helpers.unique("confsched"):sub(1, 60)
    env = { app = app, client = helpers.connect({ appname = app, scheduler = "cqueues" }),
            observer = helpers.connect(), sleep = function(s) return mongolock.sleep(s) end,
            unique = helpers.unique }
  end)
  teardown(function()
    env.observer:command("admin", { configureFailPoint = "failCommand" }, { mode = "off" })
    env.client:close()
    env.observer:close()
  end)

  for _, name in ipairs(cases.names) do
    it(name, function()
      local cq = cqueues.new()
      local ok, err, inside
      cq:wrap(function()
        inside = require("mongolock.runners").sched_core(env.client) ~= nil
        ok, err = pcall(cases.run, name, env)
      end)
      assert(cq:loop())
      assert.is_true(inside)
      assert(ok, err)
    end)
  end
end)
