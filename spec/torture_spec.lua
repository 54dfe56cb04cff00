-- #unit: the torture checker (tools/torture/check.lua) on synthetic logs:
-- it must pass a clean log and catch each kind of violation.
local helpers = require "helpers"

local check = dofile(helpers.root .. "/tools/torture/check.lua")

-- runs the checker on lines; returns violations and the printed TAP
local function run(lines, opts)
  local out = {}
  opts = opts or {}
  local v = check.run(lines, { ttl = opts.ttl or 2, retry = opts.retry or 1,
                               kind = opts.kind, permits = opts.permits,
                               print = function(s) out[#out + 1] = s end })
  return v, table.concat(out, "\n")
end

-- a clean history: three holders one after another, a kill and a takeover
-- after the lease ran out, a section whose lease ran out overlapped by the
-- next holder (allowed: it was not valid any more)
local clean = {
  "X begin 100.0",
  "A 1000 100.10 11",
  "S 1000 100.10 100.20 11 1",
  "R 1000 11 ok",
  "A 1001 100.25 12",
  "S 1001 100.25 100.30 12 1",
  "R 1001 12 ok",
  "F close-findAndModify 100.31",
  "A 1002 100.40 13",
  "K 13 1002 100.45",
  "E 14 Failing command via 'failCommand' failpoint",
  "A 1003 102.50 14",
  "S 1003 102.50 105.00 14 0",
  "A 1004 104.60 15",
  "S 1004 104.60 104.70 15 1",
  "R 1003 14 lost",
  "R 1004 15 ok",
  "X end 110.0",
}

describe("#unit torture checker", function()
  it("passes a clean log and counts what it saw", function()
    local v, tap = run(clean)
    assert.equal(0, v, tap)
    assert.is_nil(tap:find("not ok", 1, true), tap)
    assert.truthy(tap:find("# sections 4 (valid 3, lease ran out 1), failed releases 1, acquire errors 1, "
      .. "kills 1, faults 1, freezes 0, violations 0", 1, true), tap)
    assert.truthy(tap:find("1 checked", 1, true), tap)
  end)

  it("judges a frozen holder's work: a section that knew its lease ran out passes, one that claimed it fails",
    function()
    local frozen = {
      "A 1 10.0 1", "S 1 10.0 13.5 1 0",          -- frozen 10.2..13.4, then learned it had lost
      "Z 1 1 10.2 13.4",
      "A 2 12.1 2", "S 2 12.1 12.3 2 1",
    }
    local v, tap = run(frozen)
    assert.equal(0, v, tap)
    assert.truthy(tap:find("ok 5 - a frozen holder's valid work never overlaps another holder's (1 freezes, "
      .. "1 caught a holder at work, 0 of its sections claimed a valid lease)", 1, true), tap)
    frozen[2] = "S 1 10.0 13.5 1 1"               -- a child that cannot check: claims it
    v, tap = run(frozen)
    assert.is_true(v > 0)
    assert.truthy(tap:find("not ok 5 - a frozen holder's valid work", 1, true), tap)
    assert.truthy(tap:find("frozen holder of token 1 (pid 1 frozen 10.200000..13.400000) acted", 1, true), tap)
  end)

  it("judges fenced writes: the tokens that landed never go back, every ok write landed", function()
    local log = {
      "A 1 10.0 1", "S 1 10.0 10.2 1 1", "W 1 1 ok",
      "A 2 10.3 2", "S 2 10.3 10.5 2 1", "W 2 2 ok",
      "W 1 1 fenced",                              -- a stale holder's late write, refused
      "H 1", "H 2",
    }
    local v, tap = run(log)
    assert.equal(0, v, tap)
    assert.truthy(tap:find("ok 5 - fenced writes never go back in token (2 landed; answers: ok 2, fenced 1, "
      .. "lost 0, not held 0, error 0)", 1, true), tap)
    log[#log + 1] = "H 1"                          -- the stale write landed after the newer one
    v, tap = run(log)
    assert.is_true(v > 0)
    assert.truthy(tap:find("write 3 of the document has token 1 after 2", 1, true), tap)
    table.remove(log)
    table.remove(log, #log - 1)                    -- token 1's ok write never landed
    v, tap = run(log)
    assert.is_true(v > 0)
    assert.truthy(tap:find("token 1: 1 writes answered ok, 0 landed", 1, true), tap)
  end)

  it("judges guarded transactions: the accounts' total is kept", function()
    local log = {
      "A 1 10.0 1", "S 1 10.0 10.2 1 1", "W 1 1 ok",
      "A 2 10.3 2", "S 2 10.3 10.5 2 1", "W 2 2 lost",
      "H 1", "Y 400 400",
    }
    local v, tap = run(log)
    assert.equal(0, v, tap)
    assert.truthy(tap:find("ok 6 - guarded transactions keep the accounts' total (400 of 400)", 1, true), tap)
    log[#log] = "Y 399 400"
    v, tap = run(log)
    assert.is_true(v > 0)
    assert.truthy(tap:find("not ok 6 - guarded transactions keep the accounts' total (399 of 400)", 1, true), tap)
  end)

  it("catches two valid sections that overlap", function()
    local log = {
      "A 1 10.0 1", "S 1 10.0 10.5 1 1",
      "A 2 10.4 2", "S 2 10.4 10.6 2 1",
    }
    local v, tap = run(log)
    assert.is_true(v > 0)
    assert.truthy(tap:find("not ok 3 - no two valid critical sections overlap", 1, true), tap)
    assert.truthy(tap:find("token 1 (pid 1, 10.000000..10.500000) overlaps token 2", 1, true), tap)
  end)

  it("catches an overlap with a section that started earlier than the last one", function()
    -- a long section spanning two short ones: the sweep keeps the furthest end
    local log = {
      "A 1 10.0 1", "S 1 10.0 12.0 1 1",
      "A 2 10.5 2", "S 2 10.5 10.6 2 0",
      "A 3 11.0 3", "S 3 11.0 11.1 3 1",
    }
    local v, tap = run(log)
    assert.is_true(v > 0, tap)
    assert.truthy(tap:find("overlaps token 3", 1, true), tap)
  end)

  it("catches a token going backwards", function()
    local log = {
      "A 10 10.0 1", "S 10 10.0 10.1 1 1",
      "A 9 10.2 2", "S 9 10.2 10.3 2 1",
    }
    local v, tap = run(log)
    assert.is_true(v > 0)
    assert.truthy(tap:find("not ok 4 - fencing tokens increase", 1, true), tap)
    assert.truthy(tap:find("token 9 (pid 2, start 10.200000) follows token 10", 1, true), tap)
  end)

  it("catches a token granted twice", function()
    local log = {
      "A 7 10.0 1", "S 7 10.0 10.1 1 0",
      "A 7 10.2 2", "S 7 10.2 10.3 2 0",
    }
    local v, tap = run(log)
    assert.is_true(v > 0)
    assert.truthy(tap:find("token 7 granted twice", 1, true), tap)
  end)

  it("catches a lock left held by a killed process beyond ttl + retry", function()
    local log = {
      "A 5 10.0 1", "K 1 5 10.1",
      "A 6 13.5 2", "S 6 13.5 13.6 2 1",
      "X end 20",
    }
    local v, tap = run(log, { ttl = 2, retry = 1 })
    assert.is_true(v > 0)
    assert.truthy(tap:find("not ok 5", 1, true), tap)
    assert.truthy(tap:find("taken again after 3.500 s > ttl + retry = 3.000 s", 1, true), tap)
    -- within the bound it passes
    log[3] = "A 6 12.5 2"
    log[4] = "S 6 12.5 12.6 2 1"
    assert.equal(0, (run(log, { ttl = 2, retry = 1 })))
  end)

  it("counts a renewing holder's bound from its kill, not from its acquisition", function()
    -- pid 1 renews (N): held 2.3 s when killed, its lease ran on up to ttl
    -- after its last renewal, before the kill
    local log = {
      "N 1", "A 5 10.0 1", "K 1 5 12.3",
      "A 6 14.9 2", "S 6 14.9 15.0 2 1",
      "X end 20",
    }
    assert.equal(0, (run(log, { ttl = 2, retry = 1 })))
    -- a holder that does not renew is judged from its acquisition
    table.remove(log, 1)
    local v, tap = run(log, { ttl = 2, retry = 1 })
    assert.is_true(v > 0)
    assert.truthy(tap:find("taken again after 4.900 s", 1, true), tap)
    -- and a renewing one beyond ttl + retry of its kill is caught
    log = { "N 1", "A 5 10.0 1", "K 1 5 12.3", "A 6 15.5 2", "S 6 15.5 15.6 2 1", "X end 20" }
    v = run(log, { ttl = 2, retry = 1 })
    assert.is_true(v > 0)
  end)

  it("catches a lock never taken again after its holder was killed", function()
    local v, tap = run({ "A 5 10.0 1", "S 5 10.0 10.1 1 1", "K 1 5 10.2", "X end 20" })
    assert.is_true(v > 0)
    assert.truthy(tap:find("never taken again", 1, true), tap)
    -- unless the run ended too soon to tell
    v, tap = run({ "A 5 10.0 1", "S 5 10.0 10.1 1 1", "K 1 5 10.2", "X end 11" })
    assert.equal(0, v, tap)
    assert.truthy(tap:find("1 too near the end to judge", 1, true), tap)
  end)

  it("does not count a kill after a clean release", function()
    local v, tap = run({ "A 5 10.0 1", "S 5 10.0 10.1 1 1", "R 5 1 ok", "K 1 5 10.2", "X end 20" })
    assert.equal(0, v, tap)
  end)

  it("rejects malformed lines and an empty log", function()
    local v, tap = run({ "A 1 10.0", "S 1 x 2 3 1", "S 1 1 2 3 2", "Q what", "A 1 10 1 extra",
                         "K 1 nan 3", "X middle 3" })
    assert.is_true(v > 0)
    assert.truthy(tap:find("7 lines did not", 1, true), tap)
    assert.truthy(tap:find("not ok 2 - critical sections were logged (0)", 1, true), tap)
  end)

  describe("for the shared kinds", function()
    -- three permits: three sections at once are fine, a fourth is not
    local function permits(extra)
      local l = {
        "M 1 p", "A 1 10.0 1", "S 1 10.0 10.5 1 1",
        "M 2 p", "A 2 10.1 2", "S 2 10.1 10.5 2 1",
        "M 3 p", "A 3 10.2 3", "S 3 10.2 10.5 3 1",
        "M 4 p", "A 4 10.5 4", "S 4 10.5 10.9 4 1",
      }
      for _, x in ipairs(extra or {}) do l[#l + 1] = x end
      return l
    end

    it("a semaphore: never more than N valid sections; no token twice", function()
      local v, tap = run(permits(), { kind = "semaphore", permits = 3 })
      assert.equal(0, v, tap)
      assert.truthy(tap:find("at most 3 at once", 1, true), tap)
      v, tap = run(permits({ "M 5 p", "A 5 10.3 5", "S 5 10.3 10.4 5 1" }),
        { kind = "semaphore", permits = 3 })
      assert.is_true(v > 0)
      assert.truthy(tap:find("4 valid sections at 10.300000", 1, true), tap)
      -- a section whose lease ran out does not count
      v, tap = run(permits({ "M 5 p", "A 5 10.3 5", "S 5 10.3 10.4 5 0" }),
        { kind = "semaphore", permits = 3 })
      assert.equal(0, v, tap)
      v, tap = run(permits({ "A 4 10.6 6" }), { kind = "semaphore", permits = 3 })
      assert.is_true(v > 0)
      assert.truthy(tap:find("token 4 granted twice", 1, true), tap)
    end)

    it("a reader-writer lock: readers overlap, a writer overlaps nobody", function()
      local base = {
        "M 1 s", "A 1 10.0 1", "S 1 10.0 10.5 1 1",
        "M 2 s", "A 2 10.1 2", "S 2 10.1 10.6 2 1",
        "M 3 w", "A 3 10.7 3", "S 3 10.7 10.8 3 1",
        "M 4 s", "A 4 10.9 4", "S 4 10.9 11.0 4 1",
      }
      local v, tap = run(base, { kind = "rw" })
      assert.equal(0, v, tap)
      local l = {}
      for i, x in ipairs(base) do l[i] = x end
      l[#l + 1] = "M 5 s"
      l[#l + 1] = "A 5 10.75 5"
      l[#l + 1] = "S 5 10.75 10.76 5 1"
      v, tap = run(l, { kind = "rw" })
      assert.is_true(v > 0)
      assert.truthy(tap:find("writer token 3", 1, true), tap)
      -- a token smaller than a writer's, after the writer's section
      v, tap = run({ "M 9 w", "A 9 10.0 1", "S 9 10.0 10.1 1 1",
                     "M 8 s", "A 8 10.2 2", "S 8 10.2 10.3 2 1" }, { kind = "rw" })
      assert.is_true(v > 0)
      assert.truthy(tap:find("after writer token 9", 1, true), tap)
    end)
  end)

  describe("for elections", function()
    -- two terms, each a leader's several acts and a proclaim
    local terms = {
      "M 5 l", "A 5 10.0 1", "S 5 10.0 10.1 1 1", "P 5 1 ok", "S 5 10.1 10.2 1 1", "R 5 1 ok",
      "M 6 l", "A 6 10.3 2", "S 6 10.3 10.4 2 1", "P 6 2 lost", "S 6 10.4 10.5 2 0",
    }
    local function with(extra)
      local l = {}
      for _, x in ipairs(terms) do l[#l + 1] = x end
      for _, x in ipairs(extra or {}) do l[#l + 1] = x end
      return l
    end

    it("passes leaders acting one term after another, several acts a term", function()
      local v, tap = run(with(), { kind = "election" })
      assert.equal(0, v, tap)
      assert.truthy(tap:find("ok 3 - no two leaders act with valid terms at once (3 valid acts of 4)", 1, true), tap)
      assert.truthy(tap:find("proclaims 2 (lost 1)", 1, true), tap)
    end)

    it("judges an observer: terms never back, values of their own term, every term returned", function()
      local obs = { "O 0 current 9.9 -", "O 5 leader 10.01 1", "O 5 value 10.15 1-2", "O 0 none 10.25 -",
                    "O 6 leader 10.31 2", "X end 20.0" }
      local v, tap = run(with(obs), { kind = "election" })
      assert.equal(0, v, tap)
      assert.truthy(tap:find("ok 6 - the observer's leaders never go back in term", 1, true), tap)
      assert.truthy(tap:find("ok 7 - the observer returned every term granted while it watched (2 judged)", 1,
        true), tap)
      -- a stale term after a newer one; a value of another term; a term missed
      v, tap = run(with({ "O 0 current 9.9 -", "O 6 leader 10.31 2", "O 5 leader 10.4 1", "X end 20.0" }),
        { kind = "election" })
      assert.is_true(v > 0)
      assert.truthy(tap:find("not ok 6 - ", 1, true), tap)
      assert.truthy(tap:find("observer returned term 5 (leader) at 10.400000 after term 6", 1, true), tap)
      v, tap = run(with({ "O 0 current 9.9 -", "O 5 leader 10.01 2", "X end 20.0" }), { kind = "election" })
      assert.truthy(tap:find("observer returned value 2 for term 5, which pid 1 led", 1, true), tap)
      assert.truthy(tap:find("not ok 7 - ", 1, true), tap)
      assert.truthy(tap:find("term 6 (pid 2, led at 10.300000) never returned by the observer", 1, true), tap)
      assert.is_true(v > 0)
    end)

    it("catches two leaders acting at once, and a term going backwards", function()
      local v, tap = run(with({ "M 7 l", "A 7 10.15 3", "S 7 10.15 10.16 3 1" }), { kind = "election" })
      assert.is_true(v > 0)
      assert.truthy(tap:find("not ok 3 - no two leaders act with valid terms at once", 1, true), tap)
      v, tap = run(with({ "M 4 l", "A 4 10.6 3", "S 4 10.6 10.7 3 1" }), { kind = "election" })
      assert.is_true(v > 0)
      assert.truthy(tap:find("not ok 4 - terms never decrease", 1, true), tap)
    end)
  end)
end)
