-- A skynet service of spec/skynet_spec.lua: a 10 ms ticker (skynet.sleep(1))
-- that measures its own worst gap between two ticks while started.
--   "start"        the gaps counted from now
--   "stop"         -> worst gap (s), ticks since start
local skynet = require "skynet"
local core = require "mongolock.core"

local on, last, worst, ticks = false, 0, 0, 0

skynet.start(function()
  skynet.dispatch("lua", function(_, _, cmd)
    if cmd == "start" then
      on, last, worst, ticks = true, core.monotonic(), 0, 0
      skynet.retpack(true)
    elseif cmd == "stop" then
      on = false
      skynet.retpack(worst, ticks)
    end
  end)
  skynet.fork(function()
    while true do
      skynet.sleep(1)
      local now = core.monotonic()
      if on then
        if now - last > worst then worst = now - last end
        ticks = ticks + 1
      end
      last = now
    end
  end)
end)
