#!/usr/bin/env node
'use strict';
// In-process cost of one command through the wire layer and the engine, no
// sockets: the lock acquire of doc/design.md (fresh owner every call, 0 ms
// lease so every call writes) against ping. For profiling:
//   node --cpu-prof tools/mongo-standin/bench/engine.js
// Prints microseconds per command (median of 5 rounds).
//   node tools/mongo-standin/bench/engine.js --idle MS
// also times each command alone after MS milliseconds of sleep (median of
// 60), beside the same command back to back: what idle time costs the
// server's next command on this machine, with no socket or other process.

const BSON = require('bson');
const { Engine } = require('../lib/engine');
const { Connection } = require('../lib/wire');

const { Long, Int32 } = BSON;
const FREE = { $or: [{ $eq: [{ $ifNull: ['$owner', null] }, null] }, { $lte: ['$expiresAt', '$$NOW'] }] };
const OWNER = '0'.repeat(32);
const acquire = {
  findAndModify: 'locks', query: { _id: 'bench' }, upsert: true, new: true,
  update: [{ $set: {
    owner: { $cond: [FREE, OWNER, '$owner'] },
    token: { $cond: [FREE, { $max: [{ $add: [{ $ifNull: ['$token', Long.fromNumber(0)] }, Long.fromNumber(1)] },
      { $multiply: [{ $toLong: '$$NOW' }, Long.fromNumber(1024)] }] }, '$token'] },
    acquiredAt: { $cond: [FREE, '$$NOW', '$acquiredAt'] },
    expiresAt: { $cond: [FREE, { $add: ['$$NOW', Long.fromNumber(0)] }, '$expiresAt'] },
    holder: { $cond: [FREE, { $literal: { host: 'bench', pid: new Int32(1), app: 'bench' } }, '$holder'] },
  } }],
  fields: { owner: 1, token: 1, expiresAt: 1, holder: 1, acquiredAt: 1, remainingMs: { $subtract: ['$expiresAt', '$$NOW'] } },
  writeConcern: { w: 'majority' }, $db: 'bench',
  lsid: { id: new BSON.Binary(Buffer.alloc(16, 7), 4) },
  $clusterTime: { clusterTime: BSON.Timestamp.fromBits(1, 1), signature: { hash: new BSON.Binary(Buffer.alloc(20), 0), keyId: Long.fromNumber(0) } },
};

// The acquire the library sends today (csrc/binding/lock.c build_acquire): a
// waiter that queues, with the waiter id W in the pipeline and projection.
const LIVE = { $filter: { input: { $cond: [{ $isArray: '$queue' }, '$queue', []] }, cond: { $gt: ['$$this.until', '$$NOW'] } } };
const W = 'f'.repeat(32), TAG = 'e'.repeat(16);
const cond = (k, v) => ({ $cond: ['$_mlt', v, '$' + k] });
const entry = () => ({ w: W, t: TAG, until: { $add: ['$$NOW', Long.fromNumber(3000)] }, p: false });
const queued = {
  findAndModify: 'locks', query: { _id: 'bench' }, upsert: true, new: true,
  update: [
    { $set: { _mlq: LIVE } },
    { $set: { _mlt: { $let: { vars: {
      fw: { $indexOfArray: [{ $map: { input: '$_mlq', in: { $ne: ['$$this.p', true] } } }, true] },
      me: { $indexOfArray: ['$_mlq.w', W] } },
    in: { $and: [FREE, { $or: [{ $eq: ['$$fw', -1] }, { $and: [{ $ne: ['$$me', -1] }, { $lte: ['$$me', '$$fw'] }] }] }] } } } } },
    { $set: {
      owner: cond('owner', W),
      token: cond('token', { $max: [{ $add: [{ $ifNull: ['$token', Long.fromNumber(0)] }, Long.fromNumber(1)] },
        { $multiply: [{ $toLong: '$$NOW' }, Long.fromNumber(1024)] }] }),
      acquiredAt: cond('acquiredAt', '$$NOW'),
      expiresAt: cond('expiresAt', { $add: ['$$NOW', Long.fromNumber(0)] }),
      holder: cond('holder', { $literal: { host: 'bench', pid: Long.fromNumber(1), app: 'bench' } }),
      queue: cond('queue', { $cond: [{ $in: [W, '$_mlq.w'] },
        { $map: { input: '$_mlq', in: { $cond: [{ $eq: ['$$this.w', W] }, entry(), '$$this'] } } },
        { $concatArrays: ['$_mlq', [entry()]] }] }),
      next: { $cond: ['$_mlt', null, '$next'] },
    } },
    { $unset: ['_mlq', '_mlt'] }],
  fields: { owner: 1, token: 1, expiresAt: 1, holder: 1, acquiredAt: 1, remainingMs: { $subtract: ['$expiresAt', '$$NOW'] },
    queued: { $size: { $cond: [{ $isArray: '$queue' }, '$queue', []] } },
    position: { $indexOfArray: [{ $cond: [{ $isArray: '$queue' }, '$queue.w', []] }, W] } },
  writeConcern: { w: 'majority' }, $db: 'bench', lsid: acquire.lsid, $clusterTime: acquire.$clusterTime,
};
queued.update[2].$set.queue.$cond[1] = { $filter: { input: '$_mlq', cond: { $ne: ['$$this.w', W] } } };

function opMsg(doc) {
  const body = BSON.serialize(doc);
  const msg = Buffer.alloc(21 + body.length);
  msg.writeInt32LE(msg.length, 0);
  msg.writeInt32LE(1, 4);
  msg.writeInt32LE(2013, 12);
  Buffer.from(body).copy(msg, 21);
  return msg;
}

const engine = new Engine({ ttlMonitorSecs: 3600 });
let replies = 0;
const socket = { localAddress: '127.0.0.1', localPort: 1, remoteAddress: '127.0.0.1', remotePort: 2,
  setNoDelay() {}, on() {}, write() { replies += 1; }, destroy() {} };
const conn = new Connection(socket, engine);
const fam = opMsg(acquire);
const ownerAt = fam.indexOf(OWNER);
const ping = opMsg({ ping: 1, $db: 'admin', lsid: acquire.lsid });
let seq = 0;

function measure(fn, n) {
  const rounds = [];
  for (let r = 0; r < 5; r++) {
    const t = process.hrtime.bigint();
    for (let i = 0; i < n; i++) fn();
    rounds.push(Number(process.hrtime.bigint() - t) / n / 1000);
  }
  return rounds.sort((a, b) => a - b)[2];
}

const runFam = () => {
  fam.write((++seq).toString(16).padStart(32, '0'), ownerAt, 'latin1');
  conn.onData(Buffer.from(fam));
};
const runPing = () => conn.onData(Buffer.from(ping));
// a fresh waiter id (every occurrence of W) in every call
const qfam = opMsg(queued);
const wAt = [];
for (let at = qfam.indexOf(W); at >= 0; at = qfam.indexOf(W, at + 1)) wAt.push(at);
const runQueued = () => {
  const w = (++seq).toString(16).padStart(32, '0');
  for (const at of wAt) qfam.write(w, at, 'latin1');
  conn.onData(Buffer.from(qfam));
};
for (let i = 0; i < 3000; i++) { runFam(); runPing(); runQueued(); }
const f = measure(runFam, 10000);
const p = measure(runPing, 10000);
const q = measure(runQueued, 4000);
if (replies !== 3 * 3000 + 5 * (10000 + 10000 + 4000)) throw new Error(`expected a reply per command, got ${replies}`);
console.log(`findAndModify ${f.toFixed(1)} us\nqueued acquire ${q.toFixed(1)} us\nping ${p.toFixed(1)} us`);

const idleAt = process.argv.indexOf('--idle');
if (idleAt < 0) {
  engine.close();
} else {
  const ms = Number(process.argv[idleAt + 1]);
  if (!(ms > 0)) throw new Error('--idle needs a number of milliseconds');
  const sleep = () => new Promise((res) => setTimeout(res, ms));
  const once = (fn) => { const t = process.hrtime.bigint(); fn(); return Number(process.hrtime.bigint() - t) / 1000; };
  const median = (a) => a.sort((x, y) => x - y)[a.length >> 1];
  (async () => {
    for (const [name, fn] of [['findAndModify', runFam], ['queued acquire', runQueued], ['ping', runPing]]) {
      const idle = [], hot = [];
      for (let i = 0; i < 60; i++) { await sleep(); idle.push(once(fn)); }
      for (let i = 0; i < 60; i++) hot.push(once(fn));
      console.log(`${name} after ${ms} ms idle ${median(idle).toFixed(1)} us, back to back ${median(hot).toFixed(1)} us`);
    }
    engine.close();
  })();
}
