'use strict';
// A primary that steps down and is elected again: mongod's replSetStepDown
// on a single-node replica set (force: true; the node stands for election
// again when stepDownSecs have passed), and a write batch whose statement
// fails before it commits (the retryable-writes tests of MongoDB's driver
// specifications, unified/bulkWrite.json). Against a real server this needs
// a single-node replica set started with --setParameter enableTestCommands=1.

const { test, before, after, afterEach } = require('node:test');
const assert = require('node:assert/strict');
const net = require('net');
const { MongoClient, Long, BSON } = require('mongodb');
const { setup, sleep } = require('./helpers');

// a direct connection: its commands go to the server whatever its state,
// where a replica-set client would wait for a primary
let env, db, admin, direct;
before(async () => {
  env = await setup();
  direct = new MongoClient(env.uri, { directConnection: true, serverSelectionTimeoutMS: 5000 });
  await direct.connect();
  db = direct.db(env.db('el').databaseName);
  admin = direct.db('admin');
});
afterEach(async () => {
  await admin.command({ configureFailPoint: 'failCommand', mode: 'off' });
  await admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode: 'off' });
  await writable(20000);
});
after(async () => { await direct.close(); await env.stop(); });

const hello = () => admin.command({ hello: 1 });

// one command as OP_MSG on a connection of its own, with no read
// preference (a driver's direct connection always allows a secondary)
function raw(cmd) {
  const m = /^mongodb:\/\/([^/?,@]+)/.exec(env.uri)[1].split(':');
  return new Promise((resolve, reject) => {
    const body = BSON.serialize(cmd);
    const head = Buffer.alloc(21);
    head.writeInt32LE(21 + body.length, 0);
    head.writeInt32LE(1, 4);
    head.writeInt32LE(2013, 12);
    const s = net.connect(Number(m[1] || 27017), m[0], () => s.write(Buffer.concat([head, body])));
    let got = Buffer.alloc(0);
    s.on('data', (d) => {
      got = Buffer.concat([got, d]);
      if (got.length >= 4 && got.length >= got.readInt32LE(0)) {
        s.destroy();
        resolve(BSON.deserialize(got.subarray(21, got.readInt32LE(0))));
      }
    });
    s.on('error', reject);
  });
}
// waits until the server is a writable primary again
async function writable(ms) {
  const until = Date.now() + ms;
  for (;;) {
    if ((await hello()).isWritablePrimary) return true;
    if (Date.now() > until) return false;
    await sleep(100);
  }
}

test('replSetStepDown: no writable primary for stepDownSecs, writes and reads refused with mongod codes, then elected again', async () => {
  await db.command({ insert: 'c', documents: [{ _id: 0 }] });
  const h0 = await hello();
  assert.equal(h0.isWritablePrimary, true);
  const t0 = Date.now();
  assert.equal((await admin.command({ replSetStepDown: 3, secondaryCatchUpPeriodSecs: 0, force: true })).ok, 1);
  const h = await hello();
  assert.equal(h.isWritablePrimary, false);
  assert.equal(h.secondary, true);
  assert.equal(h.setName, h0.setName);
  assert.equal(h.primary, undefined);
  // a write: NotWritablePrimary, without a label outside a retryable write
  await assert.rejects(db.command({ insert: 'c', documents: [{ _id: 1 }] }),
    (e) => e.code === 10107 && e.codeName === 'NotWritablePrimary' && !(e.errorLabels || []).includes('RetryableWriteError'));
  await assert.rejects(db.command({ createIndexes: 'c', indexes: [{ key: { a: 1 }, name: 'a_1' }] }), (e) => e.code === 10107);
  // a retryable write: labelled RetryableWriteError
  const c = new MongoClient(env.uri, { directConnection: true, serverSelectionTimeoutMS: 1000 });
  await c.connect().catch(() => {});
  const session = c.startSession();
  try {
    await assert.rejects(c.db(db.databaseName).command({ findAndModify: 'c', query: { _id: 0 }, update: { $set: { x: 1 } }, txnNumber: Long.fromNumber(1) }, { session }),
      (e) => e.code === 10107 && e.errorLabels.includes('RetryableWriteError'));
  } finally { await session.endSession().catch(() => {}); await c.close(); }
  // a read that must go to the primary
  const rd = await raw({ find: 'c', filter: {}, $db: db.databaseName });
  assert.deepEqual([rd.ok, rd.code, rd.codeName], [0, 13435, 'NotPrimaryNoSecondaryOk']);
  assert.equal((await db.command({ find: 'c', filter: {} }, { readPreference: 'secondaryPreferred' })).ok, 1);
  // commands any member answers
  assert.equal((await db.command({ ping: 1 })).ok, 1);
  // stepping down again while not primary
  await assert.rejects(admin.command({ replSetStepDown: 3, force: true }), (e) => e.code === 10107);
  assert.ok(await writable(20000), 'elected again');
  assert.ok(Date.now() - t0 >= 2900, `not writable for the stepdown period (${Date.now() - t0} ms)`);
  const h1 = await hello();
  assert.equal(h1.primary, h1.me);
  assert.equal((await db.command({ insert: 'c', documents: [{ _id: 1 }] })).n, 1);
  assert.equal((await db.command({ find: 'c', filter: {} })).cursor.firstBatch.length, 2);
});

test('replSetStepDown checks its arguments; without force a single node has no secondary to hand over to', async () => {
  await assert.rejects(db.command({ replSetStepDown: 5, force: true }), (e) => e.code === 13);
  await assert.rejects(admin.command({ replSetStepDown: 1, secondaryCatchUpPeriodSecs: 2, force: true }), (e) => e.code === 2);
  const t0 = Date.now();
  await assert.rejects(admin.command({ replSetStepDown: 2, secondaryCatchUpPeriodSecs: 1 }),
    (e) => e.code === 262 && e.codeName === 'ExceededTimeLimit');
  assert.ok(Date.now() - t0 >= 900);
  assert.equal((await hello()).isWritablePrimary, true, 'still primary');
});

test('a write in flight when the primary steps down is interrupted with InterruptedDueToReplStateChange', async () => {
  await admin.command({ configureFailPoint: 'failCommand', mode: { times: 1 }, data: { failCommands: ['insert'], blockConnection: true, blockTimeMS: 600 } });
  const w = db.command({ insert: 'c', documents: [{ _id: 'inflight' }] });
  await sleep(200);
  await admin.command({ replSetStepDown: 2, secondaryCatchUpPeriodSecs: 0, force: true });
  await assert.rejects(w, (e) => e.code === 11602 && e.codeName === 'InterruptedDueToReplStateChange');
  assert.ok(await writable(20000));
  assert.equal((await db.command({ find: 'c', filter: { _id: 'inflight' } })).cursor.firstBatch.length, 0);
});

// unified/bulkWrite.json of the retryable-writes tests: "First insertOne is
// never committed", "Second updateOne is never committed", "Third updateOne
// is never committed" (ordered bulk writes; the driver sends one command per
// run of the same kind; the fail point fails a statement before it commits)
const BULK = [
  ['First insertOne is never committed', { times: 2 },
    [{ insertOne: { document: { _id: 2, x: 22 } } }, { updateOne: { filter: { _id: 2 }, update: { $inc: { x: 1 } } } },
      { deleteOne: { filter: { _id: 1 } } }],
    { insertedCount: 0, matchedCount: 0, modifiedCount: 0, deletedCount: 0 }, [{ _id: 1, x: 11 }]],
  ['Second updateOne is never committed', { skip: 1 },
    [{ insertOne: { document: { _id: 2, x: 22 } } }, { updateOne: { filter: { _id: 2 }, update: { $inc: { x: 1 } } } },
      { deleteOne: { filter: { _id: 1 } } }],
    { insertedCount: 1, matchedCount: 0, modifiedCount: 0, deletedCount: 0 }, [{ _id: 1, x: 11 }, { _id: 2, x: 22 }]],
  ['Third updateOne is never committed', { skip: 2 },
    [{ updateOne: { filter: { _id: 1 }, update: { $inc: { x: 1 } } } }, { insertOne: { document: { _id: 2, x: 22 } } },
      { updateOne: { filter: { _id: 2 }, update: { $inc: { x: 1 } } } }],
    { insertedCount: 1, matchedCount: 1, modifiedCount: 1, deletedCount: 0 }, [{ _id: 1, x: 12 }, { _id: 2, x: 22 }]],
];
for (const [name, mode, requests, counts, outcome] of BULK) {
  test(`retryable-writes bulkWrite.json: ${name}`, async () => {
    const coll = db.collection(`bulk${BULK.findIndex((b) => b[0] === name)}`);
    await coll.insertOne({ _id: 1, x: 11 });
    await admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode, data: { failBeforeCommitExceptionCode: 1 } });
    const e = await coll.bulkWrite(requests, { ordered: true }).then(() => null, (x) => x);
    assert.ok(e, 'the bulk write fails');
    const r = e.result;
    assert.deepEqual({ insertedCount: r.insertedCount, matchedCount: r.matchedCount, modifiedCount: r.modifiedCount,
      deletedCount: r.deletedCount }, counts);
    assert.equal(r.upsertedCount, 0);
    await admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode: 'off' });
    assert.deepEqual(await coll.find().sort({ _id: 1 }).toArray(), outcome);
  });
}

test('a statement that fails before it commits answers in writeErrors, the batch before it applied', async () => {
  // jstests/replsets/retryable_writes_direct_ops.js: closeConnection false
  const c = new MongoClient(env.uri, { serverSelectionTimeoutMS: 5000 });
  await c.connect();
  const session = c.startSession();
  try {
    const d = c.db(db.databaseName);
    await d.collection('we').insertMany([{ _id: 0, y: 0 }, { _id: 1, y: 0 }]);
    await admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode: { skip: 1 },
      data: { closeConnection: false, failBeforeCommitExceptionCode: 1 } });
    const cmd = { update: 'we', updates: [{ q: { _id: 0 }, u: { $inc: { y: 1 } } }, { q: { _id: 1 }, u: { $inc: { y: 1 } } }],
      ordered: true, txnNumber: Long.fromNumber(2) };
    const r = await d.command(cmd, { session });
    assert.equal(r.ok, 1);
    assert.equal(r.nModified, 1);
    assert.deepEqual(r.writeErrors.map((x) => [x.index, x.code]), [[1, 1]]);
    await admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode: 'off' });
    const r2 = await d.command(cmd, { session });
    assert.equal(r2.nModified, 2);
    assert.equal(r2.writeErrors, undefined);
    assert.deepEqual(await d.collection('we').find().sort({ _id: 1 }).toArray(), [{ _id: 0, y: 1 }, { _id: 1, y: 1 }]);
  } finally { await session.endSession(); await c.close(); }
});

// What pymongo sends for an ordered bulk write's runs (its OP_MSG puts the
// statements in a document sequence, kind 1): the failed statement answers
// in writeErrors with closeConnection false, and by a closed connection (no
// reply at all) by default, on the first attempt and on the retry
function rawSeq(cmd, ident, docs) {
  const m = /^mongodb:\/\/([^/?,@]+)/.exec(env.uri)[1].split(':');
  return new Promise((resolve, reject) => {
    const body = BSON.serialize(cmd);
    const seq = Buffer.concat([Buffer.from(`${ident}\0`), ...docs.map((d) => BSON.serialize(d))]);
    const seqHead = Buffer.alloc(5);
    seqHead.writeUInt8(1, 0);
    seqHead.writeInt32LE(4 + seq.length, 1);
    const head = Buffer.alloc(21);
    const len = 21 + body.length + 5 + seq.length;
    head.writeInt32LE(len, 0);
    head.writeInt32LE(7, 4);
    head.writeInt32LE(2013, 12);
    const s = net.connect(Number(m[1] || 27017), m[0], () => s.write(Buffer.concat([head, body, seqHead, seq])));
    let got = Buffer.alloc(0);
    s.on('data', (d) => {
      got = Buffer.concat([got, d]);
      if (got.length >= 4 && got.length >= got.readInt32LE(0)) {
        s.destroy();
        resolve(BSON.deserialize(got.subarray(21, got.readInt32LE(0))));
      }
    });
    s.on('close', () => resolve(null));
    s.on('error', reject);
  });
}

test("pymongo's ordered bulk write runs: a statement failed before it commits is a write error, never a command error", async () => {
  const lsid = { id: new (require('mongodb').Binary)(require('crypto').randomBytes(16), 4) };
  const coll = 'py';
  await db.collection(coll).insertOne({ _id: 1, x: 11 });
  const base = { ordered: true, lsid, $db: db.databaseName };
  const ins = (txn) => rawSeq({ insert: coll, ...base, txnNumber: Long.fromNumber(txn) }, 'documents', [{ _id: 2, x: 22 }]);
  const upd = (txn) => rawSeq({ update: coll, ...base, txnNumber: Long.fromNumber(txn) }, 'updates',
    [{ q: { _id: 2 }, u: { $inc: { x: 1 } }, multi: false, upsert: false }]);
  const fp = (mode, data) => admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode, data });
  // First insertOne is never committed: both attempts lose their connection
  await fp({ times: 2 }, { failBeforeCommitExceptionCode: 1 });
  assert.equal(await ins(1), null, 'first attempt: connection closed, no reply');
  assert.equal(await ins(1), null, 'retry: connection closed, no reply');
  // with closeConnection false the reply says which statement failed
  await fp({ times: 1 }, { failBeforeCommitExceptionCode: 1, closeConnection: false });
  const r = await ins(2);
  assert.equal(r.ok, 1);
  assert.equal(r.n, 0);
  assert.deepEqual(r.writeErrors.map((x) => [x.index, x.code]), [[0, 1]]);
  assert.match(r.writeErrors[0].errmsg, /due to failpoint\. The write must not be reflected\.$/);
  assert.equal(r.code, undefined);
  // Second updateOne is never committed: the insert (skipped) commits
  await fp({ skip: 1 }, { failBeforeCommitExceptionCode: 1, closeConnection: false });
  assert.equal((await ins(3)).n, 1);
  const u = await upd(4);
  assert.equal(u.ok, 1);
  assert.equal(u.nModified, 0);
  assert.deepEqual(u.writeErrors.map((x) => [x.index, x.code]), [[0, 1]]);
  await fp('off');
  assert.deepEqual(await db.collection(coll).find().sort({ _id: 1 }).toArray(), [{ _id: 1, x: 11 }, { _id: 2, x: 22 }]);
});
