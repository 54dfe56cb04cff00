#!/usr/bin/env node
'use strict';
// In-process cost of one command through the wire layer and the engine, no
// sockets: the lock acquire of doc/design.md (fresh owner every call, 0 ms
// lease so every call writes) against ping. For profiling:
//   node --cpu-prof tools/mongo-standin/bench/engine.js
// Prints microseconds per command (median of 5 rounds).

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
for (let i = 0; i < 3000; i++) { runFam(); runPing(); }
const f = measure(runFam, 10000);
const p = measure(runPing, 10000);
if (replies !== 2 * (3000 + 50000)) throw new Error(`expected a reply per command, got ${replies}`);
console.log(`findAndModify ${f.toFixed(1)} us\nping ${p.toFixed(1)} us`);
engine.close();
