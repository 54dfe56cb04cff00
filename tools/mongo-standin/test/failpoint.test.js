'use strict';
// The failCommand fail point in every mode, and the TTL monitor.
// Against a real server this needs --setParameter enableTestCommands=1.

const { test, before, after, afterEach } = require('node:test');
const assert = require('node:assert/strict');
const { MongoClient } = require('mongodb');
const { setup, sleep } = require('./helpers');

let env, db, admin;
before(async () => { env = await setup(); db = env.db('fp'); admin = env.client.db('admin'); });
afterEach(async () => { await admin.command({ configureFailPoint: 'failCommand', mode: 'off' }); });
after(async () => { await env.stop(); });

const fp = (mode, data) => admin.command(data ? { configureFailPoint: 'failCommand', mode, data } : { configureFailPoint: 'failCommand', mode });
const ping = () => db.command({ ping: 1 });
const find = () => db.command({ find: 'c', filter: {} });

test('alwaysOn with errorCode and errorLabels fails only the listed commands until turned off', async () => {
  await fp('alwaysOn', { failCommands: ['find'], errorCode: 91, errorLabels: ['RetryableWriteError'] });
  for (let i = 0; i < 3; i++) {
    await assert.rejects(find(), (e) => e.code === 91 && e.codeName === 'ShutdownInProgress' && e.errorLabels.includes('RetryableWriteError'));
  }
  assert.equal((await ping()).ok, 1);
  await fp('off');
  assert.equal((await find()).ok, 1);
});

test('{times: N} fails N times then turns itself off', async () => {
  await fp({ times: 2 }, { failCommands: ['ping'], errorCode: 2 });
  await assert.rejects(ping(), (e) => e.code === 2);
  await assert.rejects(ping(), (e) => e.code === 2);
  assert.equal((await ping()).ok, 1);
});

test('{skip: N} lets N pass, then fails', async () => {
  await fp({ skip: 2 }, { failCommands: ['ping'], errorCode: 11600 });
  assert.equal((await ping()).ok, 1);
  assert.equal((await ping()).ok, 1);
  await assert.rejects(ping(), (e) => e.code === 11600);
  await assert.rejects(ping(), (e) => e.code === 11600);
});

test('closeConnection closes the socket instead of answering', async () => {
  const c = new MongoClient(env.uri, { retryReads: false, retryWrites: false, serverSelectionTimeoutMS: 3000 });
  await c.connect();
  try {
    await fp({ times: 1 }, { failCommands: ['find'], closeConnection: true });
    await assert.rejects(c.db(db.databaseName).command({ find: 'c', filter: {} }), (e) => /clos|ECONNRESET|socket/i.test(e.message) || e.name === 'MongoNetworkError');
    assert.equal((await c.db(db.databaseName).command({ find: 'c', filter: {} })).ok, 1);
  } finally { await c.close(); }
});

test('writeConcernError is attached to a command that succeeds', async () => {
  await fp({ times: 1 }, { failCommands: ['insert'], writeConcernError: { code: 64, codeName: 'WriteConcernFailed', errmsg: 'waiting for replication timed out' } });
  // the driver surfaces the reply {ok: 1, n: 1, writeConcernError} as a MongoWriteConcernError
  await assert.rejects(db.command({ insert: 'c', documents: [{ _id: 'wce' }] }),
    (e) => e.name === 'MongoWriteConcernError' && e.code === 64 && e.result.n === 1);
  assert.ok(await db.collection('c').findOne({ _id: 'wce' }), 'the write itself happened');
});

test('blockConnection delays the command by blockTimeMS, then runs it', async () => {
  await fp({ times: 1 }, { failCommands: ['ping'], blockConnection: true, blockTimeMS: 300 });
  const t0 = Date.now();
  assert.equal((await ping()).ok, 1);
  assert.ok(Date.now() - t0 >= 280, `took ${Date.now() - t0} ms`);
});

test('appName restricts the fail point to matching connections', async () => {
  const tagged = new MongoClient(env.uri, { appName: 'victim', serverSelectionTimeoutMS: 3000 });
  await tagged.connect();
  try {
    await fp('alwaysOn', { failCommands: ['ping'], errorCode: 8, appName: 'victim' });
    assert.equal((await ping()).ok, 1);
    await assert.rejects(tagged.db('x').command({ ping: 1 }), (e) => e.code === 8);
  } finally { await tagged.close(); }
});

test('bad fail point arguments are refused', async () => {
  await assert.rejects(admin.command({ configureFailPoint: 'failCommand', mode: 'sometimes' }), (e) => typeof e.code === 'number');
  await assert.rejects(admin.command({ configureFailPoint: 'noSuchFailPoint', mode: 'off' }), (e) => typeof e.code === 'number');
});

test('TTL index: the monitor deletes expired documents, and the deletions show in change streams', async () => {
  const was = await admin.command({ getParameter: 1, ttlMonitorSleepSecs: 1 });
  await admin.command({ setParameter: 1, ttlMonitorSleepSecs: 1 });
  try {
    const d = env.db('ttl');
    const c = d.collection('t');
    await c.createIndex({ at: 1 }, { expireAfterSeconds: 0 });
    const cs = await d.command({ aggregate: 't', pipeline: [{ $changeStream: {} }], cursor: {} }, { promoteLongs: false });
    await c.insertMany([{ _id: 'old', at: new Date(Date.now() - 60000) }, { _id: 'fresh', at: new Date(Date.now() + 3600000) }, { _id: 'nodate', at: 'x' }]);
    const events = [];
    for (let i = 0; i < 40 && !events.some((e) => e.operationType === 'delete'); i++) {
      const r = await d.command({ getMore: cs.cursor.id, collection: 't', maxTimeMS: 1000 }, { promoteLongs: false });
      events.push(...r.cursor.nextBatch);
    }
    const del = events.find((e) => e.operationType === 'delete');
    assert.ok(del, 'a delete event from the TTL monitor');
    assert.deepEqual(del.documentKey, { _id: 'old' });
    assert.deepEqual((await c.find({}).toArray()).map((x) => x._id), ['fresh', 'nodate']);
    await d.command({ killCursors: 't', cursors: [cs.cursor.id] });
  } finally {
    await admin.command({ setParameter: 1, ttlMonitorSleepSecs: was.ttlMonitorSleepSecs });
  }
  await assert.rejects(admin.command({ setParameter: 1, noSuchParameterAtAll: 1 }), (e) => typeof e.code === 'number');
});

// mongod 4.4+ labels the retryable errors of retryable writes itself; the
// driver retries a retryable write once on that label
const { Long } = require('bson');

test('a retryable write failing with a retryable code is labelled RetryableWriteError; others are not', async () => {
  const session = env.client.startSession();
  try {
    const insert = (txn, code) => db.command(
      { insert: 'lbl', documents: [{ code, txn }], ...(txn ? { txnNumber: Long.fromNumber(txn) } : {}) }, { session });
    for (const [code, txn, labelled] of [[91, 1, true], [189, 2, true], [11600, 3, true], [10107, 4, true],
      [2, 5, false], [91, 0, false]]) {
      await fp({ times: 1 }, { failCommands: ['insert'], errorCode: code });
      await assert.rejects(insert(txn, code), (e) => e.code === code &&
        (e.errorLabels || []).includes('RetryableWriteError') === labelled, `code ${code} txn ${txn}`);
    }
    // errorLabels in the fail point replace the server's own
    await fp({ times: 1 }, { failCommands: ['insert'], errorCode: 91, errorLabels: [] });
    await assert.rejects(insert(6, 91), (e) => e.code === 91 && !(e.errorLabels || []).includes('RetryableWriteError'));
  } finally { await session.endSession(); }
});

test('the driver retries a retryable write once on the label: one fault is absorbed, two are not', async () => {
  const c = db.collection('retry');
  await fp({ times: 1 }, { failCommands: ['insert'], errorCode: 189 });
  await c.insertOne({ _id: 'once' });
  await fp({ times: 2 }, { failCommands: ['insert'], errorCode: 189 });
  await assert.rejects(c.insertOne({ _id: 'twice' }), (e) => e.code === 189);
  assert.deepEqual(await c.find().sort({ _id: 1 }).toArray(), [{ _id: 'once' }]);
});

test('a retryable write sent again with its txnNumber is answered, not executed again; an older one is refused', async () => {
  const session = env.client.startSession();
  try {
    const fam = (txn) => db.command({ findAndModify: 'dedup', query: { _id: 1 }, update: { $inc: { n: 1 } },
      upsert: true, new: true, txnNumber: Long.fromNumber(txn) }, { session });
    const a = await fam(7);
    const b = await fam(7);
    assert.equal(a.value.n, 1);
    assert.equal(b.value.n, 1);
    assert.equal((await db.collection('dedup').findOne({ _id: 1 })).n, 1);
    await assert.rejects(fam(6), (e) => e.code === 225);
    assert.equal((await fam(8)).value.n, 2);
  } finally { await session.endSession(); }
});

// An injected error comes back with mongod's name for its code (mongod's
// src/mongo/base/error_codes.yml), not a made-up Location<code>; codes that
// mongod raises by number only (assertions such as 40324) are Location<code>.
test('failCommand errors carry the codeName of mongod\'s error code table', async () => {
  for (const [code, name] of [[13436, /^NotPrimaryOrSecondary$/], [150, /^StaleEpoch$/], [234, /^RetryChangeStream$/],
    [133, /^FailedToSatisfyReadPreference$/], [216, /^ElectionInProgress$/], [63, /^(OBSOLETE_)?StaleShardVersion$/],
    [237, /^CursorKilled$/], [11601, /^Interrupted$/], [40324, /^Location40324$/]]) {
    await fp({ times: 1 }, { failCommands: ['ping'], errorCode: code });
    await assert.rejects(ping(), (e) => e.code === code && name.test(e.codeName), `code ${code}`);
  }
});
