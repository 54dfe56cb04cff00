'use strict';
// Multi-document transactions: commit, abort, snapshot reads, write
// conflicts, a plain write waiting for a transaction, the lifetime limit,
// the errors of misuse, change events at commit, and the fail points of
// the transactions tests of MongoDB's driver specifications
// (source/transactions/tests/unified, some cases ported here; the files
// themselves run with `make standin-spec-tests`, see the README), and
// killSessions/killAllSessions. Against a real server this needs a replica set started with
// --setParameter enableTestCommands=1.

const { test, before, after, afterEach } = require('node:test');
const assert = require('node:assert/strict');
const { MongoClient, Long } = require('mongodb');
const { setup } = require('./helpers');

let env, db, admin, client;
const started = [];
before(async () => {
  env = await setup();
  db = env.db('txn');
  admin = env.client.db('admin');
  client = new MongoClient(env.uri, { monitorCommands: true, serverSelectionTimeoutMS: 5000 });
  client.on('commandStarted', (e) => started.push(e));
  await client.connect();
});
afterEach(async () => { await admin.command({ configureFailPoint: 'failCommand', mode: 'off' }); });
after(async () => { await client.close(); await env.stop(); });

const coll = (name) => client.db(db.databaseName).collection(name);
const outside = (name) => db.collection(name);
const sent = (name) => started.filter((e) => e.commandName === name);
const fp = (mode, data) => admin.command({ configureFailPoint: 'failCommand', mode, data });

// fn(d, session, n) with txnNumbers of its own choosing, on a client of its
// own (its server sessions never go back to a pool the driver numbers)
async function rawSession(fn) {
  const c = new MongoClient(env.uri, { serverSelectionTimeoutMS: 5000 });
  await c.connect();
  const session = c.startSession();
  try { return await fn(c.db(db.databaseName), session); } finally { await session.endSession(); await c.close(); }
}
const T = (n, first, extra) => ({ txnNumber: Long.fromNumber(n), autocommit: false,
  ...(first ? { startTransaction: true } : {}), ...(extra || {}) });
// commitTransaction / abortTransaction of transaction n of a raw session
// (the driver numbers these commands itself: it is told the number)
function ending(d, session, name, n) {
  session.serverSession.txnNumber = n;
  session.txnNumberIncrement = 0;
  return d.admin().command({ [name]: 1, autocommit: false }, { session });
}
async function rejects(p, code, label) {
  try {
    await p;
  } catch (e) {
    assert.equal(e.code, code, `${e.message}`);
    if (label) assert.ok(e.hasErrorLabel(label), `label ${label}: ${JSON.stringify(e.errorLabels)}`);
    else if (label === null) assert.ok(!e.hasErrorLabel('TransientTransactionError'), 'no transient label');
    return e;
  }
  assert.fail(`expected error ${code}`);
}

test('commit: the writes appear together at commit, not before (spec commit.json "commit")', async () => {
  const c = coll('commit');
  await c.insertOne({ _id: 0, v: 0 });
  const s = client.startSession();
  s.startTransaction();
  await c.insertOne({ _id: 1 }, { session: s });
  await c.updateOne({ _id: 0 }, { $inc: { v: 1 } }, { session: s });
  assert.deepEqual(await c.find({}, { session: s }).sort({ _id: 1 }).toArray(), [{ _id: 0, v: 1 }, { _id: 1 }],
    'the transaction reads its own writes');
  assert.deepEqual(await outside('commit').find().sort({ _id: 1 }).toArray(), [{ _id: 0, v: 0 }], 'invisible outside');
  await s.commitTransaction();
  assert.deepEqual(await outside('commit').find().sort({ _id: 1 }).toArray(), [{ _id: 0, v: 1 }, { _id: 1 }]);
  // spec commit.json "multiple commits in a row": a commit sent again answers ok
  await s.commitTransaction();
  await s.endSession();
  assert.deepEqual(await outside('commit').find().sort({ _id: 1 }).toArray(), [{ _id: 0, v: 1 }, { _id: 1 }], 'once');
});

test('abort: nothing is written; the next transaction starts clean (spec abort.json "abort")', async () => {
  const c = coll('abort');
  const s = client.startSession();
  s.startTransaction();
  await c.insertOne({ _id: 1 }, { session: s });
  await c.deleteOne({ _id: 1 }, { session: s });
  await c.insertOne({ _id: 2 }, { session: s });
  await s.abortTransaction();
  assert.deepEqual(await outside('abort').find().toArray(), []);
  s.startTransaction();
  await c.insertOne({ _id: 1 }, { session: s });
  await s.commitTransaction();
  await s.endSession();
  assert.deepEqual(await outside('abort').find().toArray(), [{ _id: 1 }]);
});

test('a failed statement aborts the transaction: NoSuchTransaction, transient (spec abort.json "implicit abort"...)', async () => {
  const c = coll('implicit');
  await c.insertOne({ _id: 1 });
  const s = client.startSession();
  s.startTransaction();
  await c.insertOne({ _id: 2 }, { session: s });
  await rejects(c.insertOne({ _id: 1 }, { session: s }), 11000);
  await rejects(s.commitTransaction(), 251, 'TransientTransactionError');
  await s.endSession();
  assert.deepEqual(await outside('implicit').find().toArray(), [{ _id: 1 }]);
});

test('snapshot: established at the first command; later outside writes are invisible (spec isolation.json)', async () => {
  const c = coll('snap');
  await c.insertMany([{ _id: 1, v: 1 }, { _id: 2, v: 2 }]);
  const s = client.startSession();
  s.startTransaction({ readConcern: { level: 'snapshot' } });
  assert.deepEqual(await c.findOne({ _id: 1 }, { session: s }), { _id: 1, v: 1 });
  await outside('snap').updateOne({ _id: 1 }, { $set: { v: 10 } });
  await outside('snap').deleteOne({ _id: 2 });
  await outside('snap').insertOne({ _id: 3 });
  assert.deepEqual(await c.find({}, { session: s }).sort({ _id: 1 }).toArray(), [{ _id: 1, v: 1 }, { _id: 2, v: 2 }]);
  assert.deepEqual(await c.aggregate([{ $match: { v: { $gte: 1 } } }, { $sort: { _id: 1 } }], { session: s }).toArray(),
    [{ _id: 1, v: 1 }, { _id: 2, v: 2 }]);
  // a write to a document written outside since the snapshot: WriteConflict
  await rejects(c.updateOne({ _id: 1 }, { $set: { v: 5 } }, { session: s }), 112, 'TransientTransactionError');
  await s.endSession();
  assert.deepEqual(await outside('snap').find().sort({ _id: 1 }).toArray(), [{ _id: 1, v: 10 }, { _id: 3 }]);
});

test('two transactions write one document: the second gets WriteConflict; the first commits', async () => {
  const c = coll('conflict');
  await c.insertOne({ _id: 1, v: 0 });
  const a = client.startSession(), b = client.startSession();
  a.startTransaction();
  b.startTransaction();
  await c.updateOne({ _id: 1 }, { $inc: { v: 1 } }, { session: a });
  const e = await rejects(c.updateOne({ _id: 1 }, { $inc: { v: 10 } }, { session: b }), 112, 'TransientTransactionError');
  assert.equal(e.codeName, 'WriteConflict');
  await b.abortTransaction();
  await a.commitTransaction();
  assert.deepEqual(await outside('conflict').findOne({ _id: 1 }), { _id: 1, v: 1 });
  // after a's commit, a transaction begun before it cannot write the document
  a.startTransaction();
  await c.findOne({ _id: 9 }, { session: a });
  await outside('conflict').updateOne({ _id: 1 }, { $inc: { v: 1 } });
  await rejects(c.deleteOne({ _id: 1 }, { session: a }), 112, 'TransientTransactionError');
  await a.endSession();
  await b.endSession();
});

test('withTransaction retries a write conflict and commits once', async () => {
  const c = coll('retry');
  await c.insertOne({ _id: 1, v: 0 });
  const s = client.startSession();
  let runs = 0;
  await s.withTransaction(async () => {
    runs += 1;
    await c.findOne({ _id: 1 }, { session: s });
    if (runs === 1) await outside('retry').updateOne({ _id: 1 }, { $inc: { v: 100 } });
    await c.updateOne({ _id: 1 }, { $inc: { v: 1 } }, { session: s });
  });
  await s.endSession();
  assert.equal(runs, 2);
  assert.deepEqual(await outside('retry').findOne({ _id: 1 }), { _id: 1, v: 101 });
});

test('a plain write to a document a transaction wrote waits for its end, or fails at its maxTimeMS', async () => {
  const c = coll('wait');
  await c.insertOne({ _id: 1, v: 0 });
  const s = client.startSession();
  s.startTransaction();
  await c.updateOne({ _id: 1 }, { $set: { v: 1 } }, { session: s });
  await rejects(outside('wait').updateOne({ _id: 1 }, { $inc: { v: 10 } }, { maxTimeMS: 200 }), 50);
  let done = false;
  const plain = outside('wait').updateOne({ _id: 1 }, { $inc: { v: 10 } }).then((r) => { done = true; return r; });
  await new Promise((r) => setTimeout(r, 200));
  assert.equal(done, false, 'waiting while the transaction is in progress');
  // a document the transaction did not write is not held up
  await outside('wait').insertOne({ _id: 2 });
  await s.commitTransaction();
  const r = await plain;
  assert.equal(r.modifiedCount, 1);
  await s.endSession();
  assert.deepEqual(await outside('wait').findOne({ _id: 1 }), { _id: 1, v: 11 }, 'applied after the commit');
});

test('a plain multi-document write waits for a transaction that holds one of its documents, each written once', async () => {
  const c = coll('waitmany');
  await c.insertMany([{ _id: 1, v: 0 }, { _id: 2, v: 0 }, { _id: 3, v: 0 }]);
  const s = client.startSession();
  s.startTransaction();
  await c.updateOne({ _id: 2 }, { $inc: { v: 1 } }, { session: s });
  const plain = outside('waitmany').updateMany({}, { $inc: { v: 10 } });
  await new Promise((r) => setTimeout(r, 150));
  assert.equal((await outside('waitmany').findOne({ _id: 2 })).v, 0, 'waiting');
  await s.commitTransaction();
  assert.equal((await plain).modifiedCount, 3);
  await s.endSession();
  assert.deepEqual((await outside('waitmany').find().sort({ _id: 1 }).toArray()).map((d) => d.v), [10, 11, 10]);
});

test('the lifetime limit aborts a transaction: NoSuchTransaction on its next command', async (t) => {
  if (env.external) { t.skip('changes a server parameter'); return; }
  await admin.command({ setParameter: 1, transactionLifetimeLimitSeconds: 1 });
  try {
    const c = coll('lifetime');
    const s = client.startSession();
    s.startTransaction();
    await c.insertOne({ _id: 1 }, { session: s });
    await new Promise((r) => setTimeout(r, 1500));
    // the document it held is free again
    await outside('lifetime').insertOne({ _id: 1, plain: true });
    await rejects(c.insertOne({ _id: 2 }, { session: s }), 251, 'TransientTransactionError');
    await s.endSession();
    assert.deepEqual(await outside('lifetime').find().toArray(), [{ _id: 1, plain: true }]);
  } finally {
    const r = await admin.command({ getParameter: 1, transactionLifetimeLimitSeconds: 1 });
    assert.equal(r.transactionLifetimeLimitSeconds, 1);
    await admin.command({ setParameter: 1, transactionLifetimeLimitSeconds: 60 });
  }
});

test('misuse answers as mongod does', async () => {
  await rawSession(async (d, session) => {
    const ins = (n, first, extra) => d.command({ insert: 'misuse', documents: [{}], ...T(n, first, extra) }, { session });
    await ins(1, true);
    // startTransaction again at the active number
    await rejects(ins(1, true), 117);
    // a number that is not the transaction in progress
    const e = await rejects(ins(2, false), 251, 'TransientTransactionError');
    assert.match(e.message, /^Given transaction number 2 does not match any in-progress transactions/);
    // readConcern after the first command; the transaction is aborted
    await rejects(d.command({ find: 'misuse', readConcern: { level: 'local' }, ...T(1) }, { session }), 72);
    await rejects(ins(1, false), 251, 'TransientTransactionError');
    // writeConcern inside a transaction
    await ins(3, true);
    await rejects(d.command({ insert: 'misuse', documents: [{}], writeConcern: { w: 1 }, ...T(3) }, { session }), 72);
    // commit and abort of a transaction that does not exist
    await rejects(ending(d, session, 'commitTransaction', 9), 251, 'TransientTransactionError');
    await rejects(ending(d, session, 'abortTransaction', 9), 251);
    // an older number
    await rejects(ins(2, true), 225);
    // commands a transaction cannot run
    await rejects(d.command({ count: 'misuse', ...T(4, true) }, { session }), 263);
    await rejects(d.command({ insert: 'misuse', documents: [{}], txnNumber: Long.fromNumber(5), autocommit: true }, { session }), 72);
    // commit after abort; abort after commit
    await ins(6, true);
    await ending(d, session, 'abortTransaction', 6);
    await rejects(ending(d, session, 'commitTransaction', 6), 251, 'TransientTransactionError');
    await ins(7, true);
    await ending(d, session, 'commitTransaction', 7);
    await ending(d, session, 'commitTransaction', 7);
    await rejects(ending(d, session, 'abortTransaction', 7), 256);
  });
  assert.equal(await outside('misuse').countDocuments(), 1, 'only transaction 7 committed');
});

test('change events of a transaction appear at commit, never for an aborted one', async () => {
  const c = coll('events');
  const cs = outside('events').watch();
  await cs.tryNext();
  const s = client.startSession();
  s.startTransaction();
  await c.insertOne({ _id: 'aborted' }, { session: s });
  await s.abortTransaction();
  s.startTransaction();
  await c.insertOne({ _id: 1, v: 0 }, { session: s });
  await c.updateOne({ _id: 1 }, { $set: { v: 1 } }, { session: s });
  assert.equal(await cs.tryNext(), null, 'nothing before the commit');
  await s.commitTransaction();
  await s.endSession();
  const a = await cs.next(), b = await cs.next();
  assert.deepEqual([a.operationType, a.documentKey, b.operationType, b.updateDescription.updatedFields],
    ['insert', { _id: 1 }, 'update', { v: 1 }]);
  assert.equal(await cs.tryNext(), null);
  await cs.close();
});

// spec error-labels.json, retry-commit / commit.json cases on failCommand
test('commit whose connection closes: UnknownTransactionCommitResult, the retry commits once', async () => {
  const c = coll('commitclose');
  await fp({ times: 1 }, { failCommands: ['commitTransaction'], closeConnection: true });
  const s = client.startSession();
  s.startTransaction();
  await c.insertOne({ _id: 1 }, { session: s });
  const before = sent('commitTransaction').length;
  await s.commitTransaction();    // the driver retries it once
  await s.endSession();
  const commits = sent('commitTransaction').slice(before);
  assert.equal(commits.length, 2);
  assert.equal(commits[1].command.writeConcern.w, 'majority', 'a retried commit asks for majority');
  assert.deepEqual(await outside('commitclose').find().toArray(), [{ _id: 1 }]);
});

test('commit errors carry mongod\'s labels (spec error-labels.json)', async () => {
  await rawSession(async (d, session) => {
    let n = 10;
    const begin = async () => { n += 1; await d.command({ insert: 'labels', documents: [{ _id: n }], ...T(n, true) }, { session }); };
    // a retryable error on commit: RetryableWriteError and UnknownTransactionCommitResult, not transient
    await begin();
    await fp({ times: 1 }, { failCommands: ['commitTransaction'], errorCode: 11602 });
    let e = await rejects(ending(d, session, 'commitTransaction', n), 11602, null);
    assert.deepEqual(e.errorLabels.sort(), ['RetryableWriteError', 'UnknownTransactionCommitResult']);
    await ending(d, session, 'commitTransaction', n);   // the transaction was still open
    // a write concern error on commit: committed, UnknownTransactionCommitResult
    await begin();
    await fp({ times: 1 }, { failCommands: ['commitTransaction'], writeConcernError: { code: 64, errmsg: 'wc' } });
    const r = await ending(d, session, 'commitTransaction', n).catch((x) => x);
    assert.equal(r.errorResponse ? r.errorResponse.writeConcernError.code : r.writeConcernError.code, 64);
    const labels = r.errorLabels || (r.errorResponse && r.errorResponse.errorLabels);
    assert.deepEqual(labels, ['UnknownTransactionCommitResult']);
    // an error of a statement inside: transient
    await begin();
    await fp({ times: 1 }, { failCommands: ['insert'], errorCode: 10107 });
    e = await rejects(d.command({ insert: 'labels', documents: [{}], ...T(n) }, { session }), 10107, 'TransientTransactionError');
    assert.ok(!e.hasErrorLabel('RetryableWriteError'));
    await ending(d, session, 'abortTransaction', n);
    // a snapshot error or PreparedTransactionInProgress on commit: transient,
    // not unknown (spec transactions-convenient-api commit-transienttransactionerror.json)
    for (const code of [246, 267]) {
      await begin();
      await fp({ times: 1 }, { failCommands: ['commitTransaction'], errorCode: code });
      e = await rejects(ending(d, session, 'commitTransaction', n), code, 'TransientTransactionError');
      assert.deepEqual(e.errorLabels, ['TransientTransactionError']);
      await ending(d, session, 'abortTransaction', n);
    }
  });
  assert.deepEqual((await outside('labels').find().sort({ _id: 1 }).toArray()).map((x) => x._id), [11, 12]);
});

test('a stand-alone server has no transactions', async (t) => {
  if (env.external) { t.skip('the stand-in\'s own command line'); return; }
  const { startStandin } = require('./helpers');
  const sa = await startStandin(['--standalone']);
  const c = new MongoClient(sa.uri, { serverSelectionTimeoutMS: 5000 });
  try {
    await c.connect();
    const r = await c.db('x').command({ insert: 'y', documents: [{}], txnNumber: Long.fromNumber(1), autocommit: false,
      startTransaction: true }).catch((e) => e);
    assert.equal(r.code, 20);
  } finally { await c.close(); await sa.stop(); }
});

test('killSessions and killAllSessions abort the sessions\' transactions in progress (the next command: NoSuchTransaction)', async () => {
  for (const kill of [(s) => ({ killSessions: [s.id] }), () => ({ killAllSessions: [] })]) {
    const session = client.startSession();
    try {
      session.startTransaction();
      await coll('killed').insertOne({ _id: 1 }, { session });
      await admin.command(kill(session));
      await assert.rejects(session.commitTransaction(), (e) => e.code === 251
        && e.hasErrorLabel('TransientTransactionError'));
      assert.equal(await outside('killed').countDocuments({}), 0);
    } finally { await session.endSession(); }
  }
});
