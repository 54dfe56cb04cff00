-- The torture checker: reads the log written by the workers (worker.lua)
-- and the harness (run.js) and decides, property by property, whether the
-- lock kept its promises.  Prints TAP (one "ok"/"not ok" line per property,
-- then the counts) and exits 1 on any violation.
--
--   lua check.lua --ttl S [--retry S] [--kind K [--permits N]] [--acts] [--fenced] LOG
--     (--acts: a holder acts several times a token, as an election's
--     leader does: the command's child of run.js --command)
--   local check = dofile("tools/torture/check.lua"); check.run(lines, opts)
--
-- Log lines (times are CLOCK_MONOTONIC seconds, comparable across processes):
--   M token mode                       what token was: x exclusive, w a
--                                      writer, s a reader's share, p a
--                                      permit, l a leader's term
--   A token start pid                  acquired
--   S token start end pid valid        a critical section; valid = 1 when the
--                                      holder's lease still ran after `end`
--   R token pid ok|lost|error          the release's answer
--   P token pid ok|lost|error          a leader's proclaim and its answer
--   O token change time value          an election's observer returned a
--                                      change (token 0: nobody leads)
--   E pid message                      acquire failed
--   K pid token time                   the harness SIGKILLed pid, which the
--                                      server showed holding token
--   N pid                              pid renews its leases (the lease engine)
--   F kind time                        the harness armed a failCommand fault
--   Z pid token stop cont              the harness froze pid (SIGSTOP at stop,
--                                      SIGCONT at cont): the holder of token,
--                                      or the proxy it reached the server by
--   X begin|end time                   the run's bounds
--   W token pid ok|fenced|lost|error   a fenced write of the section's end
--                                      (run.js --fenced) and its answer
--   H token                            the fenced document's list of the
--                                      tokens whose writes landed, in order
--                                      (run.js --txn: the ledger's)
--   Y sum expected                     run.js --txn: the accounts' total at
--                                      the end, and what it must be
--
-- Properties:
--   1. no two valid critical sections overlap (mutual exclusion);
--   2. among valid sections, tokens strictly increase in the order the
--      sections started, and no token was granted twice;
--   Their forms for the shared kinds (--kind):
--   1s. semaphore: never more than N valid sections at once;
--   2s. semaphore: no token granted twice (permits overlap: no start order);
--   1r. rw: no valid writer's section overlaps any other valid section;
--   2r. rw: a valid section that started after a valid writer's section
--       ended has a larger token, one that ended before it began a
--       smaller one; no token granted twice.
--   1l. election: no two valid acts of leaders (sections, several a
--       term) overlap: at no time two leaders act with valid terms;
--   2l. election: among valid acts, terms never decrease in the order the
--       acts started, and no term was granted twice.
--   4l. election, with an observer (O lines): the leaders it returns never
--       go back in term, each shows a value its own term published (the
--       leader's pid, or pid-k from its proclaims), and it returned every
--       term granted while it watched (from its first line to a second
--       before the end).
--   5. a frozen holder's valid work (its sections that ended after the
--      freeze began) never overlaps another token's valid section
--      (judged when the log has Z lines; part of 1, reported apart);
--   6. fenced writes (W and H lines): the tokens that landed never go
--      back (no write with an older token landed after a newer one), and
--      every write answered ok landed;
--   7. guarded transactions (Y line): the accounts' total is kept;
--   3. a lock held by a killed process is taken again within ttl + retry of
--      the acquisition that process held (or, when that acquisition was
--      not logged yet or the process renewed its leases, of the kill),
--      unless the run ended before that.

local M = {}

local tonumber, ipairs, sort, format = tonumber, ipairs, table.sort, string.format

-- line kinds: field names after the kind letter; "#" marks a number, "*"
-- the rest of the line
local SHAPES = {
  M = { list = "modes", "#token", "mode" },
  A = { list = "acquired", "#token", "#start", "#pid" },
  S = { list = "sections", "#token", "#start", "#stop", "#pid", "valid" },
  R = { list = "releases", "#token", "#pid", "result" },
  P = { list = "proclaims", "#token", "#pid", "result" },
  O = { list = "observed", "#token", "change", "#time", "value" },
  E = { list = "errors", "#pid", "*message" },
  K = { list = "kills", "#pid", "#token", "#time" },
  N = { list = "renewers", "#pid" },
  F = { list = "faults", "kind", "#time" },
  Z = { list = "freezes", "#pid", "#token", "#stop", "#cont" },
  X = { list = "bounds", "what", "#time" },
  W = { list = "writes", "#token", "#pid", "result" },
  H = { list = "landed", "#token" },
  Y = { list = "totals", "#sum", "#expected" },
}

-- parses one line into (list name, record), or nil when malformed
local function parse_line(line)
  local shape = SHAPES[line:sub(1, 1)]
  if not shape or line:sub(2, 2) ~= " " then return nil end
  local rest = line:sub(3)
  local rec = {}
  for i, spec in ipairs(shape) do
    local kind, key = spec:sub(1, 1), spec:match("^[#*]?(.*)$")
    local w
    if kind == "*" then
      w, rest = rest:match("^(.+)$"), ""
    else
      w, rest = rest:match("^(%S+)%s*(.*)$")
    end
    if not w then return nil end
    if kind == "#" then
      w = tonumber(w)
      if not w or w ~= w then return nil end
    end
    rec[key] = w
    if i == #shape and rest ~= "" then return nil end
  end
  return shape.list, rec
end

-- parses lines (an iterator or a table of strings) into a log table
function M.parse(lines)
  local log = { modes = {}, acquired = {}, sections = {}, releases = {}, proclaims = {}, observed = {},
                errors = {}, kills = {}, faults = {}, bounds = {}, bad = {}, freezes = {},
                renewers = {}, writes = {}, landed = {}, totals = {} }
  local function one(line)
    if line:match("^%s*$") then return end
    local list, rec = parse_line(line)
    if not list or (list == "sections" and rec.valid ~= "0" and rec.valid ~= "1")
       or (list == "bounds" and rec.what ~= "begin" and rec.what ~= "end") then
      log.bad[#log.bad + 1] = line
      return
    end
    if list == "sections" then rec.valid = rec.valid == "1" end
    if list == "bounds" then log[rec.what == "begin" and "began" or "ended"] = rec.time end
    local t = log[list]
    t[#t + 1] = rec
  end
  if type(lines) == "table" then
    for _, l in ipairs(lines) do one(l) end
  else
    for l in lines do one(l) end
  end
  return log
end

-- property 1: overlapping valid sections; returns a list of messages
function M.overlaps(log)
  local v = {}
  for _, s in ipairs(log.sections) do if s.valid then v[#v + 1] = s end end
  sort(v, function(a, b) return a.start < b.start end)
  local out = {}
  -- sweep: the section reaching furthest so far against the next one
  local far
  for _, s in ipairs(v) do
    if s.stop < s.start then
      out[#out + 1] = format("section of token %s ends before it starts", tostring(s.token))
    end
    if far and s.start < far.stop then
      out[#out + 1] = format("token %s (pid %d, %.6f..%.6f) overlaps token %s (pid %d, %.6f..%.6f)",
        tostring(far.token), far.pid, far.start, far.stop, tostring(s.token), s.pid, s.start, s.stop)
    end
    if not far or s.stop > far.stop then far = s end
  end
  return out, #v
end

-- property 6: the fenced writes that landed (H, in order) never go back
-- in token, and every write answered ok is among them; returns messages,
-- the counts of answers by kind
function M.fenced(log)
  local out, answers = {}, { ok = 0, fenced = 0, lost = 0, ["not-held"] = 0, error = 0 }
  local landed = {}
  local last
  for i, h in ipairs(log.landed) do
    if last and h.token < last then
      out[#out + 1] = format("write %d of the document has token %s after %s", i, tostring(h.token), tostring(last))
    end
    last = h.token
    landed[h.token] = (landed[h.token] or 0) + 1
  end
  local ok = {}
  for _, w in ipairs(log.writes) do
    answers[w.result] = (answers[w.result] or 0) + 1
    if w.result == "ok" then ok[w.token] = (ok[w.token] or 0) + 1 end
  end
  for t, n in pairs(ok) do
    if (landed[t] or 0) < n then
      out[#out + 1] = format("token %s: %d writes answered ok, %d landed", tostring(t), n, landed[t] or 0)
    end
  end
  return out, answers
end

-- appends to out a message for every token granted to two acquisitions
local function granted_twice(log, out)
  local seen = {}
  for _, a in ipairs(log.acquired) do
    local p = seen[a.token]
    if p then
      out[#out + 1] = format("token %s granted twice (pids %d and %d)", tostring(a.token), p, a.pid)
    end
    seen[a.token] = a.pid
  end
end

-- property 2: tokens against start order; duplicate grants
function M.token_order(log)
  local out = {}
  local v = {}
  for _, s in ipairs(log.sections) do if s.valid then v[#v + 1] = s end end
  sort(v, function(a, b) return a.start < b.start end)
  for i = 2, #v do
    if v[i].token <= v[i - 1].token then
      out[#out + 1] = format("token %s (pid %d, start %.6f) follows token %s (pid %d, start %.6f)",
        tostring(v[i].token), v[i].pid, v[i].start, tostring(v[i - 1].token), v[i - 1].pid, v[i - 1].start)
    end
  end
  granted_twice(log, out)
  return out
end

-- property 2l: a leader acts several times a term (sections of one
-- token); terms never decrease in the order acts started; no term granted
-- twice
function M.term_order(log)
  local out = {}
  local v = {}
  for _, s in ipairs(log.sections) do if s.valid then v[#v + 1] = s end end
  sort(v, function(a, b) return a.start < b.start end)
  for i = 2, #v do
    if v[i].token < v[i - 1].token then
      out[#out + 1] = format("term %s (pid %d, act at %.6f) follows term %s (pid %d, act at %.6f)",
        tostring(v[i].token), v[i].pid, v[i].start, tostring(v[i - 1].token), v[i - 1].pid, v[i - 1].start)
    end
  end
  granted_twice(log, out)
  return out
end

-- property 4l: what an election's observer returned.  Returns messages
-- about terms going back or values of another term, messages about
-- granted terms it never returned, and how many terms were judged.
function M.observer(log)
  local back, missed = {}, {}
  local pid_of, seen = {}, {}
  for _, a in ipairs(log.acquired) do pid_of[a.token] = a.pid end
  local obs = {}
  for _, o in ipairs(log.observed) do obs[#obs + 1] = o end
  sort(obs, function(a, b) return a.time < b.time end)
  local last = 0
  for _, o in ipairs(obs) do
    if o.token > 0 then
      seen[o.token] = true
      if o.token < last then
        back[#back + 1] = format("observer returned term %s (%s) at %.6f after term %s", tostring(o.token),
          o.change, o.time, tostring(last))
      end
      if o.token > last then last = o.token end
      local p = pid_of[o.token]
      if p and o.value ~= "-" and o.value ~= tostring(p) and not o.value:match("^" .. p .. "%-%d+$") then
        back[#back + 1] = format("observer returned value %s for term %s, which pid %d led", o.value,
          tostring(o.token), p)
      end
    end
  end
  local judged = 0
  if obs[1] and log.ended then
    for _, a in ipairs(log.acquired) do
      if a.start > obs[1].time and a.start < log.ended - 1 then
        judged = judged + 1
        if not seen[a.token] then
          missed[#missed + 1] = format("term %s (pid %d, led at %.6f) never returned by the observer",
            tostring(a.token), a.pid, a.start)
        end
      end
    end
  end
  return back, missed, judged
end

-- the mode of every token, and the valid sections sorted by start
local function valid_sections(log)
  local mode = {}
  for _, m in ipairs(log.modes) do mode[m.token] = m.mode end
  local v = {}
  for _, s in ipairs(log.sections) do
    if s.valid then
      s.mode = mode[s.token]
      v[#v + 1] = s
    end
  end
  sort(v, function(a, b) return a.start < b.start end)
  return v
end

-- property 1s: at most n valid sections at once
function M.over_permits(log, n)
  local v = valid_sections(log)
  local ev = {}
  for _, s in ipairs(v) do
    ev[#ev + 1] = { t = s.start, d = 1, s = s }
    ev[#ev + 1] = { t = s.stop, d = -1, s = s }
  end
  -- at equal times an end comes first: touching sections do not overlap
  sort(ev, function(a, b) if a.t ~= b.t then return a.t < b.t end return a.d < b.d end)
  local out, inside, most = {}, 0, 0
  for _, e in ipairs(ev) do
    inside = inside + e.d
    if inside > most then most = inside end
    if inside > n then
      out[#out + 1] = format("%d valid sections at %.6f (token %s, pid %d, entering) with %d permits",
        inside, e.t, tostring(e.s.token), e.s.pid, n)
    end
  end
  return out, #v, most
end

-- property 1r: a valid writer's section overlapping any other valid one
function M.writer_overlaps(log)
  local v = valid_sections(log)
  local out = {}
  for i, w in ipairs(v) do
    if w.mode == "w" then
      for j = 1, #v do
        local s = v[j]
        if j ~= i and s.start < w.stop and w.start < s.stop then
          out[#out + 1] = format("writer token %s (pid %d, %.6f..%.6f) overlaps %s token %s (pid %d, %.6f..%.6f)",
            tostring(w.token), w.pid, w.start, w.stop, s.mode == "w" and "writer" or "reader",
            tostring(s.token), s.pid, s.start, s.stop)
        end
      end
    end
  end
  return out, #v
end

-- property 2r (writers against every other section) and 2s (no token
-- granted twice): token order wherever the kind orders sections
function M.shared_token_order(log, writers)
  local out = {}
  if writers then
    local v = valid_sections(log)
    for _, w in ipairs(v) do
      if w.mode == "w" then
        for _, s in ipairs(v) do
          if s.start >= w.stop and s.token <= w.token then
            out[#out + 1] = format("token %s (pid %d, start %.6f) after writer token %s (pid %d, end %.6f)",
              tostring(s.token), s.pid, s.start, tostring(w.token), w.pid, w.stop)
          elseif s.stop <= w.start and s.token >= w.token then
            out[#out + 1] = format("token %s (pid %d, end %.6f) before writer token %s (pid %d, start %.6f)",
              tostring(s.token), s.pid, s.stop, tostring(w.token), w.pid, w.start)
          end
        end
      end
    end
  end
  granted_twice(log, out)
  return out
end

-- property 5: the work of frozen holders.  Returns messages, the number of
-- freezes that caught a holder at work (a section of its token that ended
-- after the freeze began), and how many of those sections claimed a valid
-- lease.
function M.frozen(log)
  local out, caught, claimed = {}, 0, 0
  local others = {}
  for _, s in ipairs(log.sections) do if s.valid then others[#others + 1] = s end end
  for _, z in ipairs(log.freezes) do
    local hit = false
    for _, s in ipairs(log.sections) do
      if s.token == z.token and s.stop > z.stop then
        hit = true
        if s.valid then
          claimed = claimed + 1
          for _, o in ipairs(others) do
            if o.token ~= z.token and o.start < s.stop and s.start < o.stop then
              out[#out + 1] = format("frozen holder of token %s (pid %d frozen %.6f..%.6f) acted %.6f..%.6f, "
                .. "token %s (pid %d) %.6f..%.6f", tostring(z.token), z.pid, z.stop, z.cont, s.start, s.stop,
                tostring(o.token), o.pid, o.start, o.stop)
            end
          end
        end
      end
    end
    if hit then caught = caught + 1 end
  end
  return out, caught, claimed
end

-- property 3: recovery after SIGKILL of a holder.  Returns messages, the
-- number of kills checked, the largest recovery seen, and how many kills
-- came too close to the end of the run to be judged.
function M.recovery(log, ttl, retry)
  local out, checked, worst, unjudged = {}, 0, 0, 0
  local acq = {}
  for _, a in ipairs(log.acquired) do acq[#acq + 1] = a end
  sort(acq, function(a, b) return a.start < b.start end)
  local by_token = {}
  for _, a in ipairs(acq) do by_token[a.token] = a end
  local released = {}
  for _, r in ipairs(log.releases) do if r.result == "ok" then released[r.token] = true end end
  -- a renewing holder's lease ends within ttl of its last renewal, which
  -- came before the kill: its bound counts from the kill
  local renews = {}
  for _, n in ipairs(log.renewers or {}) do renews[n.pid] = true end
  for _, k in ipairs(log.kills) do
    if not released[k.token] then
      local a = by_token[k.token]
      local from = a and a.start or k.time
      if renews[k.pid] and k.time > from then from = k.time end
      local nxt
      for _, b in ipairs(acq) do
        if b.token > k.token and b.start >= from then nxt = b break end
      end
      local bound = from + ttl + retry
      if nxt then
        checked = checked + 1
        local took = nxt.start - from
        if took > worst then worst = took end
        if nxt.start > bound then
          out[#out + 1] = format("lock of killed pid %d (token %s) taken again after %.3f s > ttl + retry = %.3f s",
            k.pid, tostring(k.token), took, ttl + retry)
        end
      elseif log.ended and log.ended > bound then
        checked = checked + 1
        out[#out + 1] = format("lock of killed pid %d (token %s) never taken again in the %.3f s left",
          k.pid, tostring(k.token), log.ended - from)
      else
        unjudged = unjudged + 1
      end
    end
  end
  return out, checked, worst, unjudged
end

-- runs every check; prints TAP through `print`; returns the number of
-- violations
function M.run(lines, opts)
  local print = opts.print or print
  local ttl, retry = assert(opts.ttl, "ttl"), opts.retry or 2
  local log = M.parse(lines)
  local violations = 0
  local n = 0
  local function report(ok, desc, msgs)
    n = n + 1
    print(format("%s %d - %s", ok and "ok" or "not ok", n, desc))
    for i, m in ipairs(msgs or {}) do
      if i > 20 then print(format("#   ... and %d more", #msgs - 20)) break end
      print("#   " .. m)
    end
    if not ok then violations = violations + math.max(1, #(msgs or {})) end
  end
  print("TAP version 13")
  report(#log.bad == 0, format("every log line parses (%d lines did not)", #log.bad), log.bad)
  report(#log.sections > 0, format("critical sections were logged (%d)", #log.sections))
  local kind = opts.kind or "exclusive"
  local ov, nvalid, to
  if kind == "semaphore" then
    local permits = assert(opts.permits, "permits")
    local most
    ov, nvalid, most = M.over_permits(log, permits)
    report(#ov == 0, format("never more than %d valid sections at once (%d valid of %d, at most %d "
      .. "at once)", permits, nvalid, #log.sections, most), ov)
    to = M.shared_token_order(log, false)
    report(#to == 0, "no fencing token granted twice", to)
  elseif kind == "rw" then
    ov, nvalid = M.writer_overlaps(log)
    local w = 0
    for _, m in ipairs(log.modes) do if m.mode == "w" then w = w + 1 end end
    report(#ov == 0, format("no valid writer's section overlaps another valid section (%d valid of %d, "
      .. "%d writers)", nvalid, #log.sections, w), ov)
    to = M.shared_token_order(log, true)
    report(#to == 0, "fencing tokens increase across every writer's section; none granted twice", to)
  elseif kind == "election" then
    ov, nvalid = M.overlaps(log)
    report(#ov == 0, format("no two leaders act with valid terms at once (%d valid acts of %d)", nvalid,
      #log.sections), ov)
    to = M.term_order(log)
    report(#to == 0, "terms never decrease in the order leaders acted; no term granted twice", to)
  else
    ov, nvalid = M.overlaps(log)
    report(#ov == 0, format("no two valid critical sections overlap (%d valid of %d)", nvalid, #log.sections), ov)
    if opts.acts then
      -- several acts per token (the command's child, run.js --command)
      to = M.term_order(log)
      report(#to == 0, "fencing tokens never decrease in the order acts started; none granted twice", to)
    else
      to = M.token_order(log)
      report(#to == 0, "fencing tokens increase in the order sections started; none granted twice", to)
    end
  end
  if #log.freezes > 0 then
    local fz, caught, claimed = M.frozen(log)
    report(#fz == 0, format("a frozen holder's valid work never overlaps another holder's (%d freezes, %d caught "
      .. "a holder at work, %d of its sections claimed a valid lease)", #log.freezes, caught, claimed), fz)
  end
  if opts.fenced or #log.writes > 0 then
    local fw, a = M.fenced(log)
    report(#fw == 0 and #log.writes > 0, format("fenced writes never go back in token (%d landed; answers: ok %d, "
      .. "fenced %d, lost %d, not held %d, error %d)", #log.landed, a.ok, a.fenced, a.lost, a["not-held"], a.error), fw)
  end
  for _, y in ipairs(log.totals) do
    report(y.sum == y.expected, format("guarded transactions keep the accounts' total (%s of %s)",
      tostring(y.sum), tostring(y.expected)))
  end
  local rc, checked, worst, unjudged = M.recovery(log, ttl, retry)
  report(#rc == 0, format("locks of killed holders taken again within ttl + retry = %.1f s "
    .. "(%d checked, slowest %.3f s, %d too near the end to judge)", ttl + retry, checked, worst, unjudged), rc)
  if kind == "election" and #log.observed > 0 then
    local back, missed, judged = M.observer(log)
    report(#back == 0, format("the observer's leaders never go back in term and show their own term's "
      .. "values (%d changes)", #log.observed), back)
    report(#missed == 0, format("the observer returned every term granted while it watched (%d judged)",
      judged), missed)
  end
  print(format("1..%d", n))
  local lost = 0
  for _, r in ipairs(log.releases) do if r.result ~= "ok" then lost = lost + 1 end end
  local invalid = #log.sections - nvalid
  print(format("# sections %d (valid %d, lease ran out %d), failed releases %d, acquire errors %d, "
    .. "kills %d, faults %d, freezes %d, violations %d", #log.sections, nvalid, invalid, lost, #log.errors,
    #log.kills, #log.faults, #log.freezes, violations))
  if kind == "election" then
    local plost = 0
    for _, p in ipairs(log.proclaims) do if p.result ~= "ok" then plost = plost + 1 end end
    print(format("# terms %d, proclaims %d (lost %d)", #log.acquired, #log.proclaims, plost))
  end
  return violations, log
end

local function main(argv)
  local opts, path = {}, nil
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--ttl" then opts.ttl = tonumber(argv[i + 1]); i = i + 2
    elseif a == "--retry" then opts.retry = tonumber(argv[i + 1]); i = i + 2
    elseif a == "--kind" then opts.kind = argv[i + 1]; i = i + 2
    elseif a == "--permits" then opts.permits = tonumber(argv[i + 1]); i = i + 2
    elseif a == "--acts" then opts.acts = true; i = i + 1
    elseif a == "--fenced" then opts.fenced = true; i = i + 1
    else path = a; i = i + 1 end
  end
  if not path or not opts.ttl then
    io.stderr:write("usage: check.lua --ttl S [--retry S] [--kind K [--permits N]] [--acts] [--fenced] LOG\n")
    os.exit(2)
  end
  local f = assert(io.open(path, "r"))
  local v = M.run(f:lines(), opts)
  f:close()
  os.exit(v == 0 and 0 or 1)
end

if arg and arg[0] and arg[0]:match("check%.lua$") and select("#", ...) > 0 then
  main({ ... })
end

return M
