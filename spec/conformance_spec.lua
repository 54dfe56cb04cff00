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
