'use strict';
// Start contract, handshake and server-level commands, with the Node.js
// driver and libmongoc as clients.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawnSync, execFile } = require('child_process');
const path = require('path');
const { MongoClient, Long, Int32 } = require('mongodb');
const { setup, startStandin, compileC, external } = require('./helpers');

let env;
before(async () => { env = await setup(); });
after(async () => { await env.stop(); });

test('start contract: one line "listening 127.0.0.1:PORT", clean exit on SIGTERM and SIGINT', { skip: external }, async () => {
  for (const sig of ['SIGTERM', 'SIGINT']) {
    const s = await startStandin();
    assert.match(s.line, /^listening 127\.0\.0\.1:\d+$/);
    assert.ok(s.port > 0);
    const code = await new Promise((res) => { s.proc.once('exit', (c) => res(c)); s.proc.removeAllListeners('exit'); s.proc.once('exit', (c) => res(c)); s.proc.kill(sig); });
    assert.equal(code, 0);
  }
});

test('refuses a non-loopback address unless --bind is given, and bad options', { skip: external }, () => {
  const server = path.join(__dirname, '..', 'server.js');
  const r = spawnSync(process.execPath, [server, '--port', '0', '--frobnicate'], { encoding: 'utf8' });
  assert.equal(r.status, 2);
  assert.match(r.stderr, /unknown option: --frobnicate/);
  const r2 = spawnSync(process.execPath, [server, '--port', 'x'], { encoding: 'utf8' });
  assert.equal(r2.status, 2);
  assert.equal(r2.stdout, '');
});

test('hello reports a replica-set primary with the types drivers require', async () => {
  const r = await env.client.db('admin').command({ hello: 1 }, { promoteValues: false, promoteLongs: false });
  assert.equal(r.isWritablePrimary, true);
  assert.equal(typeof r.setName, 'string');
  assert.ok(Array.isArray(r.hosts) && r.hosts.length >= 1);
  for (const f of ['maxBsonObjectSize', 'maxMessageSizeBytes', 'maxWriteBatchSize', 'minWireVersion', 'maxWireVersion']) {
    assert.equal(r[f]._bsontype, 'Int32', f);
  }
  assert.ok(r.maxWireVersion.value >= 17);
  assert.ok(r.logicalSessionTimeoutMinutes);
  assert.equal(r.operationTime._bsontype, 'Timestamp');
  assert.equal(r.$clusterTime.clusterTime._bsontype, 'Timestamp');
  const legacy = await env.client.db('admin').command({ isMaster: 1 });
  assert.equal(legacy.ismaster, true);
});

test('--standalone reports a standalone server without change streams', { skip: external }, async () => {
  const s = await startStandin(['--standalone']);
  const c = new MongoClient(s.uri, { serverSelectionTimeoutMS: 3000 });
  try {
    await c.connect();
    const r = await c.db('admin').command({ hello: 1 });
    assert.equal(r.isWritablePrimary, true);
    assert.equal(r.setName, undefined);
    assert.equal(r.operationTime, undefined);
    await assert.rejects(c.db('x').command({ aggregate: 'c', pipeline: [{ $changeStream: {} }], cursor: {} }),
      (e) => e.code === 40573);
    await c.db('x').collection('c').insertOne({ a: 1 });
    assert.equal(await c.db('x').collection('c').countDocuments(), 1);
    // no retryable writes on a standalone mongod
    await assert.rejects(c.db('x').command({ insert: 'c', documents: [{ a: 2 }], txnNumber: Long.fromNumber(1) }),
      (e) => e.code === 20);
  } finally {
    await c.close();
    assert.equal(await s.stop(), 0);
  }
});

test('ping, buildInfo, endSessions', async () => {
  assert.equal((await env.client.db('admin').command({ ping: 1 })).ok, 1);
  const b = await env.client.db('admin').command({ buildInfo: 1 });
  assert.ok(Array.isArray(b.versionArray));
  assert.match(b.version, /^\d+\.\d+/);
  assert.equal((await env.client.db('admin').command({ endSessions: [] })).ok, 1);
});

test('unknown command answers CommandNotFound (59)', async () => {
  await assert.rejects(env.client.db('admin').command({ noSuchCommandHere: 1 }),
    (e) => e.code === 59 && e.codeName === 'CommandNotFound');
});

test('unknown fields of known commands answer 40415 like mongod', async () => {
  const db = env.db('opts');
  await assert.rejects(db.command({ find: 'c', filter: {}, bogusOption: 1 }),
    (e) => e.code === 40415 && /BSON field 'find.bogusOption' is an unknown field/.test(e.message));
  await assert.rejects(db.command({ insert: 'c', documents: [{}], nope: true }), (e) => e.code === 40415);
  await assert.rejects(db.command({ update: 'c', updates: [{ q: {}, u: { $set: { a: 1 } }, bad: 1 }] }),
    (e) => e.code === 40415 && /update\.updates\.bad/.test(e.message));
  await assert.rejects(db.command({ findAndModify: 'c', query: {}, update: { $set: { a: 1 } }, wat: 1 }), (e) => e.code === 40415);
});

test('serverStatus opcounters: insert per document, update/delete per statement, find as query, getMore as getmore, the rest as command', async () => {
  const db = env.db('ops');
  const admin = env.client.db('admin');
  const c = db.collection('c');
  await c.insertOne({ _id: 0 }); // creates the collection before we measure
  const s0 = (await admin.command({ serverStatus: 1 })).opcounters;
  await db.command({ insert: 'c', documents: [{ _id: 1 }, { _id: 2 }, { _id: 3 }] });
  await db.command({ update: 'c', updates: [{ q: { _id: 1 }, u: { $set: { a: 1 } } }, { q: { _id: 2 }, u: { $set: { a: 1 } } }] });
  await db.command({ delete: 'c', deletes: [{ q: { _id: 3 }, limit: 1 }] });
  const f = await db.command({ find: 'c', filter: {}, batchSize: 1 }, { promoteLongs: false });
  await db.command({ getMore: f.cursor.id, collection: 'c' });
  await db.command({ findAndModify: 'c', query: { _id: 1 }, update: { $set: { b: 1 } } });
  const s1 = (await admin.command({ serverStatus: 1 })).opcounters;
  const d = (k) => Number(s1[k]) - Number(s0[k]);
  // a shared real server may see other clients meanwhile: at least, then
  const same = external ? (a, b) => assert.ok(a >= b, `${a} >= ${b}`) : (a, b) => assert.equal(a, b);
  same(d('insert'), 3);
  same(d('update'), 2);
  same(d('delete'), 1);
  same(d('query'), 1);
  same(d('getmore'), 1);
  // findAndModify and the first serverStatus; the driver may add its own
  // commands (e.g. endSessions) but never fewer.
  assert.ok(d('command') >= 2, `command delta ${d('command')}`);
});

test('serverStatus metrics.commands: total and failed per command name', async () => {
  const db = env.db('ops');
  const admin = env.client.db('admin');
  await db.collection('m').insertOne({ _id: 0 });
  const get = async () => (await admin.command({ serverStatus: 1 }, { promoteLongs: false })).metrics.commands;
  const n = (m, name, k) => (m[name] ? Number(m[name][k]) : 0);
  const m0 = await get();
  await db.command({ findAndModify: 'm', query: { _id: 0 }, update: { $set: { a: 1 } } });
  await db.command({ findAndModify: 'm', query: { _id: 0 }, update: { $set: { a: 2 } } });
  await assert.rejects(db.command({ findAndModify: 'm', query: { _id: 0 }, update: { $bogus: { a: 1 } } }));
  await db.command({ ping: 1 });
  const m1 = await get();
  const same = external ? (a, b) => assert.ok(a >= b, `${a} >= ${b}`) : (a, b) => assert.equal(a, b);
  same(n(m1, 'findAndModify', 'total') - n(m0, 'findAndModify', 'total'), 3);
  same(n(m1, 'findAndModify', 'failed') - n(m0, 'findAndModify', 'failed'), 1);
  same(n(m1, 'ping', 'total') - n(m0, 'ping', 'total'), 1);
  same(n(m1, 'serverStatus', 'total') - n(m0, 'serverStatus', 'total'), 1);
  assert.ok(n(m1, 'hello', 'total') + n(m1, 'isMaster', 'total') >= 1, 'the handshake counts');
  assert.ok(m1.findAndModify.total instanceof Long);
});

test('libmongoc 1.23 accepts the server: single client, pool with replicaSet=rs0, and no replicaSet', async () => {
  const exe = compileC('mongoc_probe.c');
  const base = env.uri;
  const run = (uri, mode) => new Promise((resolve) => {
    execFile(exe, [uri, mode], { timeout: 20000 }, (err, stdout, stderr) => resolve({ err, stdout, stderr }));
  });
  const uris = external ? [[base, 'single'], [base, 'pool']] : [[base, 'single'], [base, 'pool'], [base.replace('?replicaSet=rs0', ''), 'single']];
  for (const [uri, mode] of uris) {
    const r = await run(uri, mode);
    assert.equal(r.err, null, `${mode} ${uri}: ${r.stdout}${r.stderr}`);
    assert.match(r.stdout, /^acquire ok .*"owner" : "me"/m);
    assert.match(r.stdout, /^duplicate error 11000 E11000 duplicate key error/m);
    assert.match(r.stdout, /^failures 0$/m);
  }
});

test('int32, int64 and doubles keep their BSON types through storage', async () => {
  const c = env.db('types').collection('t');
  const { Double, Decimal128, Timestamp, Binary, ObjectId } = require('mongodb');
  const doc = {
    _id: 1, i: new Int32(7), l: Long.fromNumber(7), d: new Double(1), big: Long.fromString('9007199254740993'),
    dec: Decimal128.fromString('1.10'), ts: new Timestamp({ t: 5, i: 6 }), bin: new Binary(Buffer.from('ab'), 4),
    oid: new ObjectId(), n: null, nested: { a: [new Int32(1), [new Double(2.5)], { x: Long.fromNumber(3) }] }, dt: new Date(12345),
  };
  await c.insertOne(doc);
  const got = await c.findOne({ _id: 1 }, { promoteValues: false, promoteLongs: false });
  assert.equal(got.i._bsontype, 'Int32');
  assert.equal(got.l._bsontype, 'Long');
  assert.equal(got.d._bsontype, 'Double');
  assert.equal(got.big.toString(), '9007199254740993');
  assert.equal(got.dec.toString(), '1.10');
  assert.equal(got.ts._bsontype, 'Timestamp');
  assert.equal(got.bin.sub_type, 4);
  assert.equal(got.n, null);
  assert.equal(got.nested.a[0]._bsontype, 'Int32');
  assert.equal(got.nested.a[1][0]._bsontype, 'Double');
  assert.equal(got.nested.a[2].x._bsontype, 'Long');
  assert.equal(got.dt.getTime(), 12345);
  // $inc keeps int64 an int64 and a double a double
  await c.updateOne({ _id: 1 }, { $inc: { l: new Int32(1), d: new Int32(1), i: new Int32(1) } });
  const after = await c.findOne({ _id: 1 }, { promoteValues: false, promoteLongs: false });
  assert.equal(after.l._bsontype, 'Long');
  assert.equal(after.l.toNumber(), 8);
  assert.equal(after.d._bsontype, 'Double');
  assert.equal(after.i._bsontype, 'Int32');
});

test('a malformed message closes that connection only; the server keeps serving', { skip: external }, async () => {
  const net = require('net');
  const port = Number(/:(\d+)/.exec(env.uri)[1]);
  const closed = await new Promise((resolve) => {
    const s = net.connect(port, '127.0.0.1', () => {
      const bad = Buffer.alloc(40, 0xab);
      bad.writeInt32LE(40, 0);
      bad.writeInt32LE(2013, 12); // OP_MSG with a body that is not BSON
      s.write(bad);
    });
    s.on('close', () => resolve(true));
    s.on('error', () => {});
    setTimeout(() => { s.destroy(); resolve(false); }, 5000);
  });
  assert.equal(closed, true);
  assert.equal((await env.client.db('admin').command({ ping: 1 })).ok, 1);
});
