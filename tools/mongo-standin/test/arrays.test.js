'use strict';
// Array expressions as the lock library's waiter queue uses them
// (doc/design.md, "Waiters"): $filter, $map, $concatArrays, $indexOfArray,
// with nested expressions ($isArray on a field path, $$this against $$NOW),
// in update pipelines and in findAndModify's fields; the results and error
// codes are mongod's.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { setup } = require('./helpers');

let env, db, c;
before(async () => {
  env = await setup();
  db = env.db('arrays');
  c = db.collection('a');
  await c.insertOne({ _id: 1, xs: [1, 2, 3, 4], q: [{ w: 'a', n: 1 }, { w: 'b', n: 2 }], s: 'str', nul: null });
});
after(async () => { await env.stop(); });

async function project(expr) {
  const r = await c.aggregate([{ $match: { _id: 1 } }, { $project: { _id: 0, v: expr } }]).toArray();
  return r[0].v;
}
async function fails(expr, code) {
  await assert.rejects(project(expr), (e) => {
    assert.equal(e.code, code, `${e.code}: ${e.message}`);
    return true;
  });
}

test('$filter: $$this, a named variable, limit, null and missing input', async () => {
  assert.deepEqual(await project({ $filter: { input: '$xs', cond: { $gt: ['$$this', 2] } } }), [3, 4]);
  assert.deepEqual(await project({ $filter: { input: '$xs', as: 'x', cond: { $lte: ['$$x', 2] } } }), [1, 2]);
  assert.deepEqual(await project({ $filter: { input: '$xs', cond: true, limit: 2 } }), [1, 2]);
  assert.deepEqual(await project({ $filter: { input: '$q', cond: { $eq: ['$$this.w', 'b'] } } }), [{ w: 'b', n: 2 }]);
  assert.equal(await project({ $filter: { input: '$nul', cond: true } }), null);
  assert.equal(await project({ $filter: { input: '$absent', cond: true } }), null);
  // the input of the lock pipeline: a field that may be missing
  assert.deepEqual(await project({ $filter: { input: { $cond: [{ $isArray: '$absent' }, '$absent', []] }, cond: true } }), []);
  assert.deepEqual(await project({ $filter: { input: { $cond: [{ $isArray: '$q' }, '$q', []] }, cond: { $gt: ['$$this.n', 1] } } }),
    [{ w: 'b', n: 2 }]);
  await fails({ $filter: { input: '$s', cond: true } }, 28651);
});

test('$filter limit: counts kept elements; null means none; mongod\'s codes for a bad limit', async () => {
  assert.deepEqual(await project({ $filter: { input: '$xs', cond: { $gt: ['$$this', 1] }, limit: 2 } }), [2, 3]);
  assert.deepEqual(await project({ $filter: { input: '$xs', cond: true, limit: null } }), [1, 2, 3, 4]);
  assert.deepEqual(await project({ $filter: { input: '$xs', cond: true, limit: 2.0 } }), [1, 2]);
  assert.deepEqual(await project({ $filter: { input: '$xs', cond: true, limit: 99 } }), [1, 2, 3, 4]);
  await fails({ $filter: { input: '$xs', cond: true, limit: 0 } }, 327392);
  await fails({ $filter: { input: '$xs', cond: true, limit: -1 } }, 327392);
  await fails({ $filter: { input: '$xs', cond: true, limit: 1.5 } }, 327391);
  await fails({ $filter: { input: '$xs', cond: true, limit: 'two' } }, 327391);
  // an empty input is answered before the limit is read
  assert.deepEqual(await project({ $filter: { input: [], cond: true, limit: 0 } }), []);
});

test('$filter and $map parameters: mongod\'s parse errors and variable names', async () => {
  await fails({ $filter: [] }, 28646);
  await fails({ $filter: { input: '$xs', cond: true, x: 1 } }, 28647);
  await fails({ $filter: { cond: true } }, 28648);
  await fails({ $filter: { input: '$xs' } }, 28650);
  await fails({ $map: 1 }, 16878);
  await fails({ $map: { input: '$xs', in: 1, limit: 1 } }, 16879);
  await fails({ $map: { in: 1 } }, 16880);
  await fails({ $map: { input: '$xs' } }, 16882);
  await fails({ $filter: { input: '$xs', as: '', cond: true } }, 16866);
  await fails({ $filter: { input: '$xs', as: 1, cond: true } }, 16866);
  await fails({ $map: { input: '$xs', as: '_x', in: 1 } }, 16867);
  await fails({ $map: { input: '$xs', as: 'X', in: 1 } }, 16867);
  await fails({ $map: { input: '$xs', as: 'a-b', in: 1 } }, 16868);
  await fails({ $let: { vars: { _v: 1 }, in: 1 } }, 16867);
  assert.deepEqual(await project({ $map: { input: '$xs', as: 'x_1Y', in: '$$x_1Y' } }), [1, 2, 3, 4]);
  // CURRENT may be rebound: field paths then read the element
  assert.deepEqual(await project({ $map: { input: '$q', as: 'CURRENT', in: '$w' } }), ['a', 'b']);
  assert.deepEqual(await project({ $filter: { input: [], cond: true } }), []);
  assert.deepEqual(await project({ $map: { input: [], in: { $toUpper: '$$this' } } }), []);
});

test('$let: mongod\'s parse errors', async () => {
  assert.equal(await project({ $let: { vars: { a: 2 }, in: { $multiply: ['$$a', 3] } } }), 6);
  await fails({ $let: 1 }, 16874);
  await fails({ $let: { vars: {}, in: 1, x: 1 } }, 16875);
  await fails({ $let: { in: 1 } }, 16876);
  await fails({ $let: { vars: {} } }, 16877);
  await fails({ $let: { vars: 1, in: 1 } }, 10065);
});

test('$map: $$this, a named variable, a missing result becomes null', async () => {
  assert.deepEqual(await project({ $map: { input: '$xs', in: { $multiply: ['$$this', 10] } } }), [10, 20, 30, 40]);
  assert.deepEqual(await project({ $map: { input: '$q', as: 'e', in: '$$e.w' } }), ['a', 'b']);
  assert.deepEqual(await project({ $map: { input: '$q', in: '$$this.absent' } }), [null, null]);
  assert.equal(await project({ $map: { input: '$absent', in: 1 } }), null);
  await fails({ $map: { input: '$s', in: 1 } }, 16883);
});

test('$concatArrays: arrays joined; null or missing makes null; other types fail', async () => {
  assert.deepEqual(await project({ $concatArrays: ['$xs', [5], []] }), [1, 2, 3, 4, 5]);
  assert.equal(await project({ $concatArrays: ['$xs', '$absent'] }), null);
  assert.equal(await project({ $concatArrays: ['$xs', null] }), null);
  await fails({ $concatArrays: ['$xs', '$s'] }, 28664);
});

test('$indexOfArray: found, not found, bounds, null array; a field path through documents', async () => {
  assert.equal(await project({ $indexOfArray: ['$xs', 3] }), 2);
  assert.equal(await project({ $indexOfArray: ['$xs', 9] }), -1);
  assert.equal(await project({ $indexOfArray: ['$xs', 1, 1] }), -1);
  assert.equal(await project({ $indexOfArray: ['$xs', 4, 1, 3] }), -1);
  assert.equal(await project({ $indexOfArray: ['$xs', 3, 1, 3] }), 2);
  assert.equal(await project({ $indexOfArray: ['$q.w', 'b'] }), 1);
  assert.equal(await project({ $indexOfArray: ['$absent', 1] }), null);
  assert.equal(await project({ $indexOfArray: ['$nul', 1] }), null);
  assert.equal(await project({ $indexOfArray: ['$xs', 1, 9] }), -1);
  assert.equal(await project({ $indexOfArray: ['$xs', 1, 2, 1] }), -1);
  assert.equal(await project({ $indexOfArray: ['$xs', 4, 0, 99] }), 3);
  assert.equal(await project({ $indexOfArray: ['$xs', 2, 1.0, 2.0] }), 1);
  // null is found; a missing value is not null, so it is never found
  assert.equal(await project({ $indexOfArray: [[1, null], '$nul'] }), 1);
  assert.equal(await project({ $indexOfArray: [[1, null], '$absent'] }), -1);
  assert.equal(await project({ $indexOfArray: [{ $concatArrays: ['$xs', [null]] }, '$absent'] }), -1);
  await fails({ $indexOfArray: ['$s', 1] }, 40090);
  await fails({ $indexOfArray: [[1], 1, 'x'] }, 40096);
  await fails({ $indexOfArray: [[1], 1, 0.5] }, 40096);
  await fails({ $indexOfArray: [[1], 1, 0, 'x'] }, 40096);
  await fails({ $indexOfArray: [[1], 1, -1] }, 40097);
  await fails({ $indexOfArray: [[1], 1, 0, -1] }, 40097);
  await fails({ $indexOfArray: [[1]] }, 28667);
  await fails({ $indexOfArray: [[1], 1, 0, 1, 1] }, 28667);
});

test('a queue kept by an update pipeline: append, renew in place, drop lapsed entries', async () => {
  const q = db.collection('queue');
  const attempt = (w, ms) => q.findOneAndUpdate({ _id: 'lock' }, [
    { $set: { _q: { $filter: { input: { $cond: [{ $isArray: '$queue' }, '$queue', []] }, cond: { $gt: ['$$this.until', '$$NOW'] } } } } },
    { $set: { queue: { $cond: [{ $in: [w, '$_q.w'] },
      { $map: { input: '$_q', in: { $cond: [{ $eq: ['$$this.w', w] }, { w, until: { $add: ['$$NOW', ms] } }, '$$this'] } } },
      { $concatArrays: ['$_q', [{ w, until: { $add: ['$$NOW', ms] } }]] }] } } },
    { $unset: ['_q'] },
  ], { upsert: true, returnDocument: 'after', projection: { position: { $indexOfArray: ['$queue.w', w] }, n: { $size: '$queue' } } });
  assert.deepEqual(await attempt('a', 60000), { _id: 'lock', position: 0, n: 1 });
  assert.deepEqual(await attempt('b', 60000), { _id: 'lock', position: 1, n: 2 });
  assert.deepEqual(await attempt('a', 60000), { _id: 'lock', position: 0, n: 2 });
  // an entry that lapsed is dropped by the next attempt
  await q.updateOne({ _id: 'lock' }, { $set: { 'queue.0.until': new Date(Date.now() - 1000) } });
  assert.deepEqual(await attempt('c', 60000), { _id: 'lock', position: 1, n: 2 });
  const doc = await q.findOne({ _id: 'lock' });
  assert.deepEqual(doc.queue.map((e) => e.w), ['b', 'c']);
  assert.equal(doc._q, undefined);
});

test('updateOne with a pipeline: the queue pruned and appended, the scratch field unset', async () => {
  const q = db.collection('queue2');
  const now = Date.now();
  await q.insertOne({ _id: 'lock', queue: [{ w: 'old', until: new Date(now - 1000) }, { w: 'live', until: new Date(now + 60000) }] });
  const r = await q.updateOne({ _id: 'lock' }, [
    { $set: { _q: { $filter: { input: { $cond: [{ $isArray: '$queue' }, '$queue', []] }, as: 'e', cond: { $gt: ['$$e.until', '$$NOW'] } } } } },
    { $set: { queue: { $concatArrays: ['$_q', [{ w: 'new', until: { $add: ['$$NOW', 60000] } }]] }, n: { $size: '$_q' } } },
    { $unset: ['_q'] },
  ]);
  assert.equal(r.matchedCount, 1);
  assert.equal(r.modifiedCount, 1);
  const doc = await q.findOne({ _id: 'lock' });
  assert.deepEqual(doc.queue.map((e) => e.w), ['live', 'new']);
  assert.ok(doc.queue[1].until instanceof Date);
  assert.equal(doc.n, 1);
  assert.equal('_q' in doc, false);
  // a document without a queue: $isArray on the missing field picks []
  await q.insertOne({ _id: 'bare' });
  await q.updateOne({ _id: 'bare' }, [
    { $set: { queue: { $concatArrays: [{ $filter: { input: { $cond: [{ $isArray: '$queue' }, '$queue', []] }, cond: true } }, [{ w: 'x' }]] } } },
  ]);
  assert.deepEqual((await q.findOne({ _id: 'bare' })).queue, [{ w: 'x' }]);
  // a queue that is not an array makes the update fail with $filter's code
  await q.insertOne({ _id: 'bad', queue: 'str' });
  await assert.rejects(q.updateOne({ _id: 'bad' }, [{ $set: { queue: { $filter: { input: '$queue', cond: true } } } }]),
    (e) => { assert.equal(e.code, 28651, `${e.code}: ${e.message}`); return true; });
});

test('an awaitData getMore is not ended by events its $match filters out', async () => {
  const w = db.collection('w');
  await w.insertOne({ _id: 'noise', n: 0 });
  const RAW = { promoteLongs: false };
  const r = await db.command({ aggregate: 'w', pipeline: [{ $changeStream: {} }, { $match: { 'documentKey._id': 'signal' } }], cursor: {} }, RAW);
  const id = r.cursor.id;
  const other = env.client.db(db.databaseName).collection('w');
  // updates that the stream filters out, while the getMore waits
  const noise = setInterval(() => { other.updateOne({ _id: 'noise' }, { $inc: { n: 1 } }).catch(() => {}); }, 20);
  let t0 = Date.now();
  let b, waited;
  try {
    b = (await db.command({ getMore: id, collection: 'w', maxTimeMS: 400 }, RAW)).cursor;
    waited = Date.now() - t0;
  } finally {
    clearInterval(noise);
  }
  assert.equal(b.nextBatch.length, 0);
  assert.ok(waited >= 350, `returned after ${waited} ms`);
  // an event that passes answers at once
  t0 = Date.now();
  setTimeout(() => { other.insertOne({ _id: 'signal' }).catch(() => {}); }, 50);
  b = (await db.command({ getMore: id, collection: 'w', maxTimeMS: 20000 }, RAW)).cursor;
  assert.equal(b.nextBatch.length, 1);
  assert.ok(Date.now() - t0 < 10000);
  await db.command({ killCursors: 'w', cursors: [id] });
});
