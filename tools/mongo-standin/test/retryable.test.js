'use strict';
// Retryable writes whose reply is lost: the onPrimaryTransactionalWrite
// fail point of mongod (SERVER-29606; described in the README of the
// retryable-writes tests of MongoDB's driver specifications): after a
// retryable write commits, the server closes the connection instead of
// replying (closeConnection, default true); with failBeforeCommitExceptionCode
// it fails the write before committing it. The driver retries, and the
// server answers a statement it already applied from its record, by stmtId.
// Against a real server this needs --setParameter enableTestCommands=1.

const { test, before, after, afterEach } = require('node:test');
const assert = require('node:assert/strict');
const { MongoClient, Long } = require('mongodb');
const { setup } = require('./helpers');

let env, db, admin, client;
const started = [];
before(async () => {
  env = await setup();
  db = env.db('rw');
  admin = env.client.db('admin');
  // a client of its own whose commands are counted
  client = new MongoClient(env.uri, { monitorCommands: true, serverSelectionTimeoutMS: 5000 });
  client.on('commandStarted', (e) => started.push(e.commandName));
  await client.connect();
});
afterEach(async () => { await admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode: 'off' }); });
after(async () => { await client.close(); await env.stop(); });

const fp = (mode, data) => admin.command({ configureFailPoint: 'onPrimaryTransactionalWrite', mode, ...(data ? { data } : {}) });
const coll = (name) => client.db(db.databaseName).collection(name);
const sent = (name) => started.filter((n) => n === name).length;
// fn(db, session) with txnNumbers of its own choosing, on a client of its
// own: its server sessions never go back to a pool the driver numbers itself
async function rawSession(fn) {
  const c = new MongoClient(env.uri, { serverSelectionTimeoutMS: 5000 });
  await c.connect();
  const session = c.startSession();
  try { return await fn(c.db(db.databaseName), session); } finally { await session.endSession(); await c.close(); }
}

test('the reply of a committed write is lost; the retry answers as if it had arrived; applied once', async () => {
  const c = coll('lost');
  await c.insertOne({ _id: 'n', v: 0 });
  for (const [op, run, check] of [
    ['insert', () => c.insertOne({ _id: 'a' }), (r) => assert.equal(r.insertedId, 'a')],
    ['update', () => c.updateOne({ _id: 'n' }, { $inc: { v: 1 } }), (r) => { assert.equal(r.matchedCount, 1); assert.equal(r.modifiedCount, 1); }],
    ['update', () => c.updateOne({ _id: 'up' }, { $inc: { v: 1 } }, { upsert: true }), (r) => assert.equal(r.upsertedId, 'up')],
    ['findAndModify', () => c.findOneAndUpdate({ _id: 'n' }, { $inc: { v: 10 } }, { returnDocument: 'after' }),
      (r) => assert.deepEqual(r, { _id: 'n', v: 11 })],
    ['delete', () => c.deleteOne({ _id: 'a' }), (r) => assert.equal(r.deletedCount, 1)],
  ]) {
    await fp({ times: 1 });
    const before = sent(op);
    check(await run());
    assert.equal(sent(op) - before, 2, `${op}: the first attempt's connection was closed and the write sent again`);
  }
  assert.deepEqual(await c.find().sort({ _id: 1 }).toArray(), [{ _id: 'n', v: 11 }, { _id: 'up', v: 1 }]);
});

test('a retry that is answered from the record does not trigger the fail point again', async () => {
  const c = coll('twice');
  const was = (await fp({ times: 2 })).count;      // how often it fired so far (mongod: timesEntered)
  await c.insertOne({ _id: 1 });                   // commits, reply lost; the retry is answered
  await c.insertOne({ _id: 2 });                   // the second activation: lost again, answered again
  assert.equal((await c.insertOne({ _id: 3 })).insertedId, 3);
  assert.equal((await fp('off')).count - was, 2);
  assert.deepEqual(await c.find().sort({ _id: 1 }).toArray(), [{ _id: 1 }, { _id: 2 }, { _id: 3 }]);
});

test('failBeforeCommitExceptionCode: the write is not committed; the retry applies it, a second failure leaves nothing', async () => {
  const c = coll('before');
  await fp({ times: 1 }, { failBeforeCommitExceptionCode: 1 });
  await c.insertOne({ _id: 'once' });
  await fp({ times: 2 }, { failBeforeCommitExceptionCode: 1 });
  await assert.rejects(c.insertOne({ _id: 'never' }));
  await fp({ times: 2 }, { failBeforeCommitExceptionCode: 1 });
  await assert.rejects(c.findOneAndUpdate({ _id: 'once' }, { $set: { x: 1 } }));
  assert.deepEqual(await c.find().toArray(), [{ _id: 'once' }]);
  // closeConnection: false: the error itself reaches the client, nothing is written
  await fp({ times: 1 }, { failBeforeCommitExceptionCode: 1, closeConnection: false });
  await rawSession(async (d, session) => {
    const r = await d.command({ insert: 'before', documents: [{ _id: 'x' }], txnNumber: Long.fromNumber(1) }, { session });
    assert.equal(r.n, 0);
    assert.equal(r.writeErrors[0].code, 1);
  });
  assert.deepEqual(await c.find().toArray(), [{ _id: 'once' }]);
  // a retryable error code is labelled RetryableWriteError, so the driver
  // retries it on the same connection, and the retry applies the write once
  await fp({ times: 1 }, { failBeforeCommitExceptionCode: 91, closeConnection: false });
  assert.deepEqual(await c.findOneAndUpdate({ _id: 'once' }, { $inc: { n: 1 } }, { returnDocument: 'after' }), { _id: 'once', n: 1 });
});

test('a retried batch that had write errors skips the statements it applied and still counts them', async () => {
  await rawSession(async (d, session) => {
    await d.collection('batch').insertOne({ _id: 0, v: 0 });
    const base = 0;
    const ins = { insert: 'batch', documents: [{ _id: 1 }, { _id: 0 }, { _id: 2 }], ordered: false, txnNumber: Long.fromNumber(base + 5) };
    for (let i = 0; i < 2; i++) {
      const r = await d.command(ins, { session });
      assert.equal(r.n, 2, `insert attempt ${i}`);
      assert.deepEqual(r.writeErrors.map((e) => [e.index, e.code]), [[1, 11000]], `insert attempt ${i}`);
    }
    const upd = { update: 'batch', ordered: false, txnNumber: Long.fromNumber(base + 6), updates: [
      { q: { _id: 0 }, u: { $inc: { v: 1 } } },
      { q: { _id: 1 }, u: { $set: { _id: 9 } } },
      { q: { _id: 'new' }, u: { $inc: { v: 1 } }, upsert: true },
      { q: { _id: 2 }, u: { $inc: { v: 1 } } }] };
    for (let i = 0; i < 2; i++) {
      const r = await d.command(upd, { session });
      assert.equal(r.n, 3, `update attempt ${i}`);
      assert.equal(r.nModified, 2, `update attempt ${i}`);
      assert.deepEqual(r.upserted, [{ index: 2, _id: 'new' }], `update attempt ${i}`);
      assert.deepEqual(r.writeErrors.map((e) => [e.index, e.code]), [[1, 66]], `update attempt ${i}`);
    }
    const del = { delete: 'batch', ordered: true, txnNumber: Long.fromNumber(base + 7), deletes: [
      { q: { _id: 'new' }, limit: 1 }, { q: { $foo: 1 }, limit: 1 }, { q: { _id: 2 }, limit: 1 }] };
    for (let i = 0; i < 2; i++) {
      const r = await d.command(del, { session });
      assert.equal(r.n, 1, `delete attempt ${i}`);
      assert.deepEqual(r.writeErrors.map((e) => [e.index, e.code]), [[1, 2]], `delete attempt ${i}`);
    }
    assert.deepEqual(await d.collection('batch').find().sort({ _id: 1 }).toArray(),
      [{ _id: 0, v: 1 }, { _id: 1 }, { _id: 2, v: 1 }]);
  });
});

// mongod refuses a multi-document statement inside a retryable write, per
// statement (write_ops_exec.cpp; jstests/replsets/retryable_writes_direct_ops
// "Only the update statements with multi=true in a batch fail")
test('a retryable write refuses multi updates and limit: 0 deletes, statement by statement', async () => {
  await rawSession(async (d, session) => {
    await d.collection('multi').insertMany([{ _id: 1, x: 1 }, { _id: 2, x: 1 }]);
    const base = 1;
    const u = await d.command({ update: 'multi', ordered: false, txnNumber: Long.fromNumber(base), updates: [
      { q: { _id: 1 }, u: { $set: { y: 1 } } }, { q: { x: 1 }, u: { $set: { z: 1 } }, multi: true }] }, { session });
    assert.equal(u.n, 1);
    assert.deepEqual(u.writeErrors.map((e) => [e.index, e.code]), [[1, 72]]);
    const r = await d.command({ delete: 'multi', ordered: false, txnNumber: Long.fromNumber(base + 1), deletes: [
      { q: { x: 1 }, limit: 0 }, { q: { _id: 2 }, limit: 1 }] }, { session });
    assert.equal(r.n, 1);
    assert.deepEqual(r.writeErrors.map((e) => [e.index, e.code]), [[0, 72]]);
    assert.deepEqual(await d.collection('multi').find().toArray(), [{ _id: 1, x: 1, y: 1 }]);
    // without a txnNumber they are ordinary writes
    assert.equal((await d.collection('multi').updateMany({ x: 1 }, { $set: { z: 2 } })).modifiedCount, 1);
  });
});
