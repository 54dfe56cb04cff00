-- #unit: the backoff maths and the sleep seam; no server.
local backoff = require "mongolock.backoff"
local core = require "mongolock.core"

describe("#unit backoff.delay", function()
  local d = backoff.defaults

  it("uses lua-resty-lock's defaults", function()
    assert.equal(0.001, d.step)
    assert.equal(2, d.ratio)
    assert.equal(0.5, d.max_step)
  end)

  it("jitters each delay within [step/2, step]", function()
    for _, r in ipairs({ 0, 0.25, 0.5, 0.999999 }) do
      local delay = backoff.delay(0.1, 2, 0.5, nil, 10, r)
      assert.is_true(delay >= 0.05 and delay <= 0.1, tostring(delay))
    end
    assert.equal(0.05, backoff.delay(0.1, 2, 0.5, nil, 10, 0))
  end)

  it("grows the step by ratio up to max_step", function()
    local step, steps = d.step, {}
    for i = 1, 12 do
      local _, nxt = backoff.delay(step, d.ratio, d.max_step, nil, 100, 0.5)
      steps[i] = nxt
      step = nxt
    end
    assert.equal(0.002, steps[1])
    assert.equal(0.004, steps[2])
    assert.equal(0.256, steps[8])
    assert.equal(0.5, steps[9])
    assert.equal(0.5, steps[12])
  end)

  it("never sleeps past the holder's remaining lease", function()
    assert.equal(0.01, (backoff.delay(0.5, 2, 0.5, 0.01, 10, 0.9)))
    assert.equal(0, (backoff.delay(0.5, 2, 0.5, 0, 10, 0.9)))
    -- unknown or negative remaining does not cap
    assert.is_true(backoff.delay(0.5, 2, 0.5, nil, 10, 0) >= 0.25)
    assert.is_true(backoff.delay(0.5, 2, 0.5, -1, 10, 0) >= 0.25)
  end)

  it("never sleeps past the caller's deadline", function()
    assert.equal(0.02, (backoff.delay(0.5, 2, 0.5, 3, 0.02, 0.9)))
    assert.equal(0, (backoff.delay(0.5, 2, 0.5, 3, -1, 0.9)))
  end)
end)

describe("#unit backoff.sleep_until_retry", function()
  local real_sleep = backoff.sleep
  local slept
  before_each(function()
    slept = {}
    backoff.sleep = function(s) slept[#slept + 1] = s end
  end)
  after_each(function() backoff.sleep = real_sleep end)

  it("advances state.step and sleeps the capped delay", function()
    local state = { step = 0.1, deadline = core.monotonic() + 100,
                    opts = { ratio = 3, max_step = 1 }, info = { remaining = 0.03 } }
    backoff.sleep_until_retry(state)
    assert.is_true(math.abs(state.step - 0.3) < 1e-12)
    assert.is_true(slept[1] <= 0.03 and slept[1] >= 0)
    state.info = nil
    backoff.sleep_until_retry(state)
    assert.is_true(slept[2] >= 0.15 and slept[2] <= 0.3)
    assert.is_true(math.abs(state.step - 0.9) < 1e-12)
  end)

  it("sleeps nothing once the deadline has passed", function()
    local state = { step = 0.5, deadline = core.monotonic() - 1, opts = {} }
    backoff.sleep_until_retry(state)
    assert.equal(0, slept[1])
  end)
end)

describe("#unit backoff.sleep", function()
  local saved
  before_each(function() saved = rawget(_G, "ngx") end)
  after_each(function() rawset(_G, "ngx", saved) end)

  it("uses ngx.sleep in a yieldable OpenResty phase", function()
    local calls = {}
    rawset(_G, "ngx", { sleep = function(s) calls[#calls + 1] = s end,
                        get_phase = function() return "content" end })
    backoff.sleep(0.25)
    assert.same({ 0.25 }, calls)
  end)

  it("falls back to the C sleep where ngx.sleep cannot yield", function()
    local calls = {}
    rawset(_G, "ngx", { sleep = function(s) calls[#calls + 1] = s end,
                        get_phase = function() return "init_worker" end })
    backoff.sleep(0.001)
    assert.same({}, calls)
  end)

  it("does not sleep for zero or negative durations", function()
    local calls = {}
    rawset(_G, "ngx", { sleep = function(s) calls[#calls + 1] = s end,
                        get_phase = function() return "content" end })
    backoff.sleep(0)
    backoff.sleep(-1)
    assert.same({}, calls)
  end)
end)

describe("#unit the wait seam of locks:acquire", function()
  local mongolock = require "mongolock"
  local locks_mod = require "mongolock.locks"
  local saved
  before_each(function() saved = locks_mod.get_wait() end)
  after_each(function() locks_mod.set_wait(saved) end)

  -- a client whose acquire always answers "busy" after one command
  local function fake_locks()
    local client = assert(mongolock.connect("mongodb://127.0.0.1:9/"))
    local l = client:locks()
    local calls = 0
    l.core = setmetatable({
      closed = function() return false end,
      writable = function() return true end,
      ensure_index = function() return true end,
      acquire = function()
        calls = calls + 1
        return nil, "busy", { remaining = 5, operation_time = { t = 1, i = 2 } }
      end,
    }, {})
    return l, function() return calls end, client
  end

  it("calls the wait step after each busy attempt with the reply's info", function()
    local l, calls, client = fake_locks()
    local seen = {}
    locks_mod.set_wait({ sleep_until_retry = function(state)
      seen[#seen + 1] = { attempt = state.attempt, name = state.name, info = state.info,
                          wait = state.opts.wait }
      if state.attempt == 3 then                          -- sleep out the timeout
        require("mongolock.core").sleep(state.deadline - require("mongolock.core").monotonic())
      end
    end })
    local h, err, info = l:acquire("x", { timeout = 0.05, wait = "poll" })
    assert.is_nil(h)
    assert.equal("timeout", err)
    assert.equal(5, info.remaining)
    assert.equal(4, calls())
    assert.equal(3, #seen)
    assert.equal("x", seen[1].name)
    assert.equal("poll", seen[1].wait)
    assert.same({ t = 1, i = 2 }, seen[2].info.operation_time)
    client:close()
  end)

  it("returns the wait step's error", function()
    local l, calls, client = fake_locks()
    locks_mod.set_wait({ sleep_until_retry = function() return nil, "no change stream", 40573 end })
    assert.same({ nil, "no change stream", 40573 }, { l:acquire("x") })
    assert.equal(1, calls())
    client:close()
  end)
end)
