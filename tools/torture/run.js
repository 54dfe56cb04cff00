#!/usr/bin/env node
'use strict';
// The torture harness: N worker processes (worker.lua) loop acquire / log /
// hold / release on one lock while this process SIGKILLs random holders,
// arms failCommand faults on the server (closeConnection; errorCode
// 91/189/11600, armed for one command or two: the driver retries once;
// blockConnection) and lost replies (onPrimaryTransactionalWrite: a lock
// write commits and its connection is closed before the reply, so the
// driver's retry is answered from the server's record; or, with
// failBeforeCommitExceptionCode, it fails uncommitted), and runs some
// workers under faketime an hour ahead or
// behind.  At the end it stops the workers and runs the
// checker (check.lua) on the log; its TAP output and exit status are ours.
//
//   tools/with-standin node tools/torture/run.js [options]
//
//   --workers N       worker processes (default 16)
//   --seconds S       length of the run (default 60)
//   --ttl S           lease of every acquisition (default 2)
//   --hold-ms MS      a section holds a random 0..MS ms (default 30)
//   --retry S         slack over ttl the checker allows a takeover (default 2)
//   --skewed N        workers under faketime, alternately +1h and -1h (default 2)
//   --lua L           lua5.4, luajit or both (alternating; default both)
//   --kill-every S    mean seconds between kills of the holder (default 4)
//   --fault-every S   mean seconds between armed faults (default 1)
//   --log PATH        the log (default build/torture/torture.log)
//   --kind K          exclusive (default), semaphore, rw or election: what
//                     the workers take (rw: one writer in four; election:
//                     they campaign, act while leading, proclaim, resign,
//                     and an observer process logs what el:observe returns);
//                     the checker's first two properties are the kind's
//   --permits N       a semaphore's permits (default 3)
//   --lie             negative control: workers claim every lease valid and
//                     one section in five outlives its ttl; the checker must
//                     then report overlaps (the run fails)
//   --freeze-every S  mean seconds between freezes of the holder (default 0:
//                     none): SIGSTOP for 1.2 to 2 ttl, then SIGCONT, logged
//                     as a Z line; the checker judges the frozen holders'
//                     work against the next holders'
//   --fenced          every section ends with a fenced write (h:fenced) of
//                     the lock's document in mongolock_torture.fenced: its
//                     token pushed to the document's list (W lines); at the
//                     end the list is logged (H lines), and the checker
//                     judges that no write with an older token landed after
//                     a newer one.  Not with --command
//   --txn             exclusive: each section is a guarded transaction
//                     (h:transaction) moving one unit between two of four
//                     accounts (100 units each at the start), the hold
//                     between its two writes, its token pushed to a ledger
//                     (W lines); at the end the ledger (H lines) and the
//                     accounts' total (Y line) are logged: the checker
//                     judges that the total is kept and no stale holder's
//                     transaction committed after a newer one.  Not with
//                     --command or --fenced
//   --command         the workers run the command (bin/mongolock exec, or
//                     elect with --kind election; cmd_worker.lua) with a
//                     child (cmd_child.lua) that ignores SIGTERM and cannot
//                     check its lease, each worker through a TCP proxy of
//                     its own (spec/proxy.js): a freeze stops the holder's
//                     proxy, cutting it off from the server.  Exclusive and
//                     election only; no kills (a SIGKILLed mongolock leaves
//                     its child unsupervised: doc/command.md) and no
//                     observer
//
// Needs MONGODB_URI, a server that accepts configureFailPoint (the
// stand-in, or mongod with enableTestCommands=1), and `make build`.

const fs = require('fs');
const path = require('path');
const { spawn, spawnSync } = require('child_process');

const root = path.resolve(__dirname, '..', '..');
const { MongoClient } = require(require.resolve('mongodb', {
  paths: [path.join(root, 'tools', 'mongo-standin'), path.join(root, 'bench', 'peer')],
}));

function parseArgs(argv) {
  const o = { workers: 16, seconds: 60, ttl: 2, holdMs: 30, retry: 2, skewed: 2, lua: 'both',
    killEvery: 4, faultEvery: 1, freezeEvery: 0, kind: 'exclusive', permits: 3,
    log: path.join(root, 'build', 'torture', 'torture.log') };
  const num = { '--workers': 'workers', '--seconds': 'seconds', '--ttl': 'ttl', '--hold-ms': 'holdMs',
    '--retry': 'retry', '--skewed': 'skewed', '--kill-every': 'killEvery', '--fault-every': 'faultEvery',
    '--permits': 'permits', '--freeze-every': 'freezeEvery' };
  for (let i = 0; i < argv.length; i += 2) {
    const k = argv[i];
    if (k === '--lie') { o.lie = true; i -= 1; continue; }
    if (k === '--command') { o.command = true; i -= 1; continue; }
    if (k === '--fenced') { o.fenced = true; i -= 1; continue; }
    if (k === '--txn') { o.txn = true; i -= 1; continue; }
    const v = argv[i + 1];
    if (v === undefined) usage(`${k} needs a value`);
    if (num[k]) {
      const n = Number(v);
      if (!Number.isFinite(n) || n < 0) usage(`bad ${k}: ${v}`);
      o[num[k]] = n;
    } else if (k === '--lua') {
      if (!['lua5.4', 'luajit', 'both'].includes(v)) usage(`bad --lua: ${v}`);
      o.lua = v;
    } else if (k === '--kind') {
      if (!['exclusive', 'semaphore', 'rw', 'election'].includes(v)) usage(`bad --kind: ${v}`);
      o.kind = v;
    } else if (k === '--log') {
      o.log = path.resolve(v);
    } else usage(`unknown option ${k}`);
  }
  if (o.workers < 2 || o.ttl <= 0 || o.seconds <= 0) usage('need --workers >= 2, --ttl > 0, --seconds > 0');
  if (o.command && !['exclusive', 'election'].includes(o.kind)) usage('--command takes --kind exclusive or election');
  if (o.command) o.skewed = 0;
  if (o.command && o.fenced) usage('--fenced is the library\'s: not with --command');
  if (o.txn && (o.command || o.fenced || o.kind !== 'exclusive')) usage('--txn: the library\'s exclusive locks alone');
  return o;
}

function usage(msg) {
  process.stderr.write(`torture: ${msg}\n`);
  process.exit(2);
}

const mono = () => Number(process.hrtime.bigint()) / 1e9; // CLOCK_MONOTONIC, as the workers
const rand = (a, b) => a + Math.random() * (b - a);
const pick = (xs) => xs[Math.floor(Math.random() * xs.length)];
const sleep = (s) => new Promise((r) => setTimeout(r, s * 1000));

const FAULTS = [
  { kind: 'close-findAndModify', data: { failCommands: ['findAndModify'], closeConnection: true } },
  { kind: 'close-update', data: { failCommands: ['update'], closeConnection: true } },
  { kind: 'error91-findAndModify', data: { failCommands: ['findAndModify'], errorCode: 91 } },
  { kind: 'error189-findAndModify', data: { failCommands: ['findAndModify'], errorCode: 189 } },
  { kind: 'error11600-findAndModify', data: { failCommands: ['findAndModify'], errorCode: 11600 } },
  { kind: 'error91-update', data: { failCommands: ['update'], errorCode: 91 } },
  { kind: 'error189-update', data: { failCommands: ['update'], errorCode: 189 } },
  { kind: 'error11600-update', data: { failCommands: ['update'], errorCode: 11600 } },
  { kind: 'block-findAndModify', data: { failCommands: ['findAndModify'], blockConnection: true, blockTimeMS: 300 } },
  { kind: 'block-update', data: { failCommands: ['update'], blockConnection: true, blockTimeMS: 300 } },
  // onPrimaryTransactionalWrite is not scoped to an appName: it hits the
  // next retryable writes of anyone, and here only the workers write
  { kind: 'lost-reply', failPoint: 'onPrimaryTransactionalWrite', data: {} },
  { kind: 'fail-before-commit', failPoint: 'onPrimaryTransactionalWrite', data: { failBeforeCommitExceptionCode: 91 } },
];
const FAIL_POINTS = ['failCommand', 'onPrimaryTransactionalWrite'];

async function main() {
  const o = parseArgs(process.argv.slice(2));
  const uri = process.env.MONGODB_URI;
  if (!uri) usage('MONGODB_URI is not set (run under tools/with-standin)');
  fs.mkdirSync(path.dirname(o.log), { recursive: true });
  fs.writeFileSync(o.log, '');
  const stopfile = `${o.log}.stop`;
  fs.rmSync(stopfile, { force: true });
  const errlog = fs.openSync(`${o.log}.stderr`, 'w');
  const emit = (line) => fs.appendFileSync(o.log, `${line}\n`);
  const name = `torture-${process.pid}-${Date.now()}`;

  const client = new MongoClient(uri, { appName: 'torture-harness', serverSelectionTimeoutMS: 10000 });
  await client.connect();
  const admin = client.db('admin');
  const coll = client.db('mongolock_torture').collection('locks');
  const accounts = client.db('mongolock_torture').collection('accounts');
  // --txn: a killed or frozen holder's open transaction keeps the accounts
  // it wrote from everyone else's transactions until the server aborts it;
  // the server's limit is lowered to the ttl for the run (doc/transactions.md)
  let lifetime = null;
  if (o.txn) {
    lifetime = (await admin.command({ getParameter: 1, transactionLifetimeLimitSeconds: 1 }))
      .transactionLifetimeLimitSeconds;
    await admin.command({ setParameter: 1, transactionLifetimeLimitSeconds: Math.max(1, Math.ceil(o.ttl)) });
    await accounts.insertMany([1, 2, 3, 4].map((i) => ({ _id: `${name}:${i}`, units: 100 })));
  }

  const workers = new Map(); // child process pid -> { proc, lua, skew, pid (the Lua process's) }
  let started = 0;
  let stopping = false;
  const stats = { kills: 0, faults: 0, respawns: 0, freezes: 0 };

  // --command: a proxy per worker slot (spec/proxy.js), kept across respawns
  const proxies = new Map(); // slot -> { proc, uri }
  const target = /^mongodb:\/\/(?:[^@/]*@)?([^,/?]+)/.exec(uri);
  async function proxyOf(slot) {
    if (proxies.has(slot)) return proxies.get(slot);
    const proc = spawn('node', [path.join(root, 'spec', 'proxy.js'), target[1]], { stdio: ['ignore', 'pipe', errlog] });
    const addr = await new Promise((resolve) => {
      proc.stdout.on('data', (b) => { const m = /listening (\S+)/.exec(String(b)); if (m) resolve(m[1]); });
      proc.on('exit', () => resolve(null));
    });
    if (!addr) throw new Error('the proxy did not start');
    const p = { proc, uri: `mongodb://${addr}/?directConnection=true` };
    proxies.set(slot, p);
    return p;
  }
  if (o.command) for (let i = 0; i < o.workers; i++) await proxyOf(i);

  function startWorker(slot) {
    const lua = o.lua === 'both' ? (slot % 2 ? 'luajit' : 'lua5.4') : o.lua;
    const skew = !o.command && slot < o.skewed ? (slot % 2 ? '-1h' : '+1h') : null;
    const env = {
      ...process.env,
      LUA_PATH: `${root}/lua/?.lua;${root}/lua/?/init.lua;;`,
      LUA_CPATH: `${root}/build/${lua}/?.so;;`,
    };
    const args = [path.join(__dirname, 'worker.lua'), o.log, name, String(o.ttl), String(o.holdMs), stopfile,
      o.lie ? '200' : '10'];
    if (o.lie) env.TORTURE_LIE = '1';
    if (o.fenced) env.TORTURE_FENCED = '1';
    if (o.txn) env.TORTURE_TXN = '1';
    env.TORTURE_KIND = o.kind;
    env.TORTURE_PERMITS = String(o.permits);
    let proc;
    if (o.command) {
      env.TORTURE_URI = proxies.get(slot).uri;
      env.TORTURE_APP = `torture-cmd-${slot}`;
      env.TORTURE_LUA = lua;
      args[0] = path.join(__dirname, 'cmd_worker.lua');
      proc = spawn(lua, args, { env, stdio: ['ignore', 'pipe', errlog] });
    } else if (skew) {
      // the monotonic clock stays real so that log times compare
      env.FAKETIME_DONT_FAKE_MONOTONIC = '1';
      proc = spawn('faketime', ['-f', skew, lua, ...args], { env, stdio: ['ignore', 'pipe', errlog] });
    } else {
      proc = spawn(lua, args, { env, stdio: ['ignore', 'pipe', errlog] });
    }
    started += 1;
    const w = { proc, lua, skew, slot, pid: null };
    workers.set(proc.pid, w);
    proc.stdout.on('data', (b) => {
      const m = /ready (\d+)/.exec(String(b));
      if (m) w.pid = Number(m[1]);
    });
    proc.on('exit', () => {
      workers.delete(proc.pid);
      if (!stopping) {
        stats.respawns += 1;
        startWorker(slot);
      }
    });
  }

  // an election's observer (not a worker: never killed), logging O lines
  let observer = null;
  if (o.kind === 'election' && !o.command) {
    observer = spawn('lua5.4', [path.join(__dirname, 'observer.lua'), o.log, name, stopfile], {
      env: { ...process.env, LUA_PATH: `${root}/lua/?.lua;${root}/lua/?/init.lua;;`,
             LUA_CPATH: `${root}/build/lua5.4/?.so;;` },
      stdio: ['ignore', 'pipe', errlog],
    });
    await new Promise((resolve) => {
      observer.stdout.on('data', (b) => { if (/ready/.test(String(b))) resolve(); });
      observer.on('exit', resolve);
    });
  }

  emit(`X begin ${mono().toFixed(6)}`);
  for (let i = 0; i < o.workers; i++) startWorker(i);
  const deadline = mono() + o.seconds;

  async function killer() {
    while (!o.command && mono() < deadline) {
      await sleep(rand(0.5, 1.5) * o.killEvery);
      if (mono() >= deadline) break;
      const doc = await coll.findOne({ _id: name }).catch(() => null);
      if (!doc) continue;
      // the exclusive holder, else one of the shares or permits
      let hpid = null;
      let token = null;
      if (doc.owner != null && doc.holder) {
        hpid = doc.holder.pid;
        token = doc.token;
      } else if (Array.isArray(doc.holders) && doc.holders.length) {
        const e = pick(doc.holders);
        hpid = e.h && e.h.pid;
        token = e.tk;
      }
      if (hpid == null) continue;
      const victim = [...workers.values()].find((w) => w.pid === Number(hpid));
      if (!victim) continue;
      const t = mono();
      try {
        process.kill(victim.pid, 'SIGKILL');
      } catch (e) {
        continue;
      }
      stats.kills += 1;
      emit(`K ${victim.pid} ${String(token)} ${t.toFixed(6)}`);
    }
  }

  async function faulter() {
    while (mono() < deadline) {
      await sleep(rand(0.5, 1.5) * o.faultEvery);
      if (mono() >= deadline) break;
      const f = pick(FAULTS);
      const failPoint = f.failPoint || 'failCommand';
      const data = failPoint === 'failCommand' ? { ...f.data, appName: 'torture' } : { ...f.data };
      if (data.blockConnection) data.blockTimeMS = Math.round(rand(100, 400));
      // the server labels these errors RetryableWriteError and the driver
      // retries once: a fault armed for one command is absorbed by the
      // retry, one armed for two reaches the caller (a lost reply armed
      // twice loses the replies of two writes: a retry answered from the
      // record does not trigger it)
      try {
        await admin.command({ configureFailPoint: failPoint, mode: { times: 1 + Math.floor(Math.random() * 2) }, data });
        stats.faults += 1;
        emit(`F ${f.kind} ${mono().toFixed(6)}`);
      } catch (e) {
        process.stderr.write(`torture: configureFailPoint: ${e.message}\n`);
      }
    }
  }

  // the holder frozen past its ttl: its process (SIGSTOP), or with
  // --command the proxy it reaches the server through; Z pid token stop cont
  async function freezer() {
    while (o.freezeEvery > 0 && mono() < deadline) {
      await sleep(rand(0.5, 1.5) * o.freezeEvery);
      if (mono() >= deadline) break;
      const doc = await coll.findOne({ _id: name }).catch(() => null);
      if (!doc || doc.owner == null || !doc.holder) continue;
      let victim = null;
      if (o.command) {
        const m = /^torture-cmd-(\d+)$/.exec(String(doc.holder.app));
        const p = m && proxies.get(Number(m[1]));
        victim = p && p.proc.pid;
      } else {
        const w = [...workers.values()].find((x) => x.pid === Number(doc.holder.pid));
        victim = w && w.pid;
      }
      if (!victim) continue;
      const t = mono();
      try { process.kill(victim, 'SIGSTOP'); } catch (e) { continue; }
      await sleep(o.ttl * rand(1.2, 2));
      try { process.kill(victim, 'SIGCONT'); } catch (e) { /* gone */ }
      stats.freezes += 1;
      emit(`Z ${victim} ${String(doc.token)} ${t.toFixed(6)} ${mono().toFixed(6)}`);
    }
  }

  await Promise.all([killer(), faulter(), freezer()]);

  // stop: no new acquisitions; those in flight finish their section
  stopping = true;
  emit(`X end ${mono().toFixed(6)}`);
  fs.writeFileSync(stopfile, '');
  for (const fp of FAIL_POINTS) await admin.command({ configureFailPoint: fp, mode: 'off' }).catch(() => {});
  const until = mono() + 10 * o.ttl + 5;
  while (workers.size && mono() < until) await sleep(0.1);
  if (observer && observer.exitCode === null) {
    await Promise.race([new Promise((r) => observer.on('exit', r)), sleep(5)]);
    try { observer.kill('SIGKILL'); } catch (e) { /* gone */ }
  }
  for (const w of workers.values()) {
    try { process.kill(w.proc.pid, 'SIGKILL'); } catch (e) { /* gone */ }
    if (w.pid) try { process.kill(w.pid, 'SIGKILL'); } catch (e) { /* gone */ }
  }
  for (const p of proxies.values()) {
    try { p.proc.kill('SIGKILL'); } catch (e) { /* gone */ }
  }
  // --fenced: the list of tokens whose fenced writes landed, in order
  if (o.fenced) {
    const doc = await client.db('mongolock_torture').collection('fenced').findOne({ _id: name });
    for (const t of (doc && doc.h) || []) emit(`H ${String(t)}`);
  }
  // --txn: the ledger of committed transfers, in order, and the total
  if (o.txn) {
    const docs = await accounts.find({ _id: { $in: [1, 2, 3, 4, 'ledger'].map((i) => `${name}:${i}`) } }).toArray();
    let sum = 0;
    for (const d of docs) {
      if (d.h) for (const t of d.h) emit(`H ${String(t)}`);
      else sum += Number(d.units);
    }
    emit(`Y ${sum} 400`);
    await admin.command({ setParameter: 1, transactionLifetimeLimitSeconds: lifetime });
  }
  await client.close();
  fs.rmSync(stopfile, { force: true });

  const r = spawnSync('lua5.4', [path.join(__dirname, 'check.lua'), '--ttl', String(o.ttl),
    '--retry', String(o.retry), '--kind', o.kind, '--permits', String(o.permits), ...(o.command ? ['--acts'] : []),
    ...(o.fenced || o.txn ? ['--fenced'] : []), o.log], { stdio: ['ignore', 'inherit', 'inherit'] });
  process.stdout.write(`# kind ${o.kind}${o.kind === 'semaphore' ? ` (${o.permits} permits)` : ''}, workers ${o.workers} (${o.skewed} under faketime +/-1h, lua ${o.lua}), `
    + `${o.command ? 'the command (mongolock exec/elect) through proxies, ' : ''}${o.fenced ? 'fenced writes, ' : ''}${o.txn ? 'guarded transactions, ' : ''}`
    + `processes started ${started}, killed ${stats.kills}, faults armed ${stats.faults}, frozen ${stats.freezes}, `
    + `${o.seconds} s, ttl ${o.ttl} s, log ${path.relative(root, o.log)}\n`);
  process.exit(r.status === null ? 1 : r.status);
}

main().catch((e) => {
  process.stderr.write(`torture: ${e && e.stack || e}\n`);
  process.exit(1);
});
