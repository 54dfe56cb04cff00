'use strict';
// Answers that the server's faster paths must give exactly as the general
// ones do: filters on paths with and without arrays along them (a path
// that reaches one value is read without building the list of reached
// values), string equality against other types, and the updateDescription
// of pipeline updates that shift an array, write fields named like array
// indexes, and remove and re-insert fields (the delta's sizes are kept
// from one version of a document to the next).

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { BSONSymbol, Int32 } = require('mongodb');
const { setup } = require('./helpers');

let env, db;
before(async () => { env = await setup(); db = env.db('fast'); await db.createCollection('c'); await db.createCollection('q'); });
after(async () => { await env.stop(); });

const DOCS = [
  { _id: 1, a: { b: 'x' } },
  { _id: 2, a: [{ b: 'x' }, { b: 'y' }] },
  { _id: 3, a: { b: ['x', 'z'] } },
  { _id: 4, a: 'x' },
  { _id: 5, a: null },
  { _id: 6 },
  { _id: 7, a: { b: null } },
  { _id: 8, a: [{ c: 1 }, { b: 'y' }] },
  { _id: 9, a: { b: new BSONSymbol('x') } },
  { _id: 10, a: { b: { c: 'x' } } },
  { _id: 11, a: [[{ b: 'x' }]] },
  { _id: 12, a: { b: 3 } },
  { _id: 13, a: [] },
];

const CASES = [
  [{ 'a.b': 'x' }, [1, 2, 3, 9]],
  [{ 'a.b': null }, [4, 5, 6, 7, 8, 11, 13]],
  [{ 'a.b': { $eq: 'y' } }, [2, 8]],
  [{ 'a.b': { $ne: 'x' } }, [4, 5, 6, 7, 8, 10, 11, 12, 13]],
  [{ 'a.b': { $in: ['z', 'y', null] } }, [2, 3, 4, 5, 6, 7, 8, 11, 13]],
  [{ 'a.b': { $nin: ['x', 3] } }, [4, 5, 6, 7, 8, 10, 11, 13]],
  [{ 'a.b': { $type: 'string' } }, [1, 2, 3, 8]],
  [{ 'a.b': { $type: 'null' } }, [7]],
  [{ 'a.b': { $type: ['null', 'number'] } }, [7, 12]],
  [{ 'a.b.c': 'x' }, [10]],
  [{ 'a.b': { $gt: 'w' } }, [1, 2, 3, 8, 9]],
  [{ a: 'x' }, [4]],
  [{ a: { $type: 'array' } }, [2, 8, 11, 13]],
  [{ $or: [{ 'a.b': 'y' }, { a: null }] }, [2, 5, 6, 8]],
  [{ $and: [{ 'a.b': 'x' }, { 'a.b': 'y' }] }, [2]],
  [{ $nor: [{ 'a.b': 'x' }, { a: { $type: 'array' } }] }, [4, 5, 6, 7, 10, 12]],
  [{ 'a.0.b': 'x' }, [2, 11]],
  [{ _id: { $in: [1, 2] }, 'a.b': 'x' }, [1, 2]],
];

test('filters read paths with and without arrays along them as MongoDB does', async () => {
  const c = db.collection('q');
  await c.insertMany(DOCS);
  for (const [filter, want] of CASES) {
    const got = (await c.find(filter).sort({ _id: 1 }).toArray()).map((d) => d._id);
    assert.deepEqual(got, want, JSON.stringify(filter));
    // the same filter as a change stream's $match sees it, on a whole document
    const agg = (await c.aggregate([{ $match: filter }, { $sort: { _id: 1 } }]).toArray()).map((d) => d._id);
    assert.deepEqual(agg, want, 'aggregate ' + JSON.stringify(filter));
  }
});

// The waiter queue of a lock document: an update pipeline that shifts the
// first entry out, one that appends, and one that rewrites fields named
// like array indexes and moves a field to the end.
const RAW = { promoteLongs: false };
const entry = (i) => ({ w: `w${i}`, t: `t${i}`, p: i % 3 === 0, h: { host: 'h'.repeat(60), pid: new Int32(100 + i), app: `a${i}` } });

test('updateDescription of array shifts, index-named fields and moved fields', async () => {
  const c = db.collection('c');
  const cur = (await db.command({ aggregate: 'c', pipeline: [{ $changeStream: {} }], cursor: {} }, RAW)).cursor;
  await c.insertOne({ _id: 'L', owner: 'w0', queue: [0, 1, 2, 3, 4, 5, 6, 7].map(entry), 5: 'five', 10: 'ten', z: 1, pad: 'p'.repeat(2000) });
  // (native operators only: each stored version shares the elements it
  // kept with the one before)
  const steps = [
    // release to the first waiter: the queue shifts by one
    [{ $set: { owner: { $arrayElemAt: ['$queue.w', 0] }, queue: { $filter: { input: '$queue', cond: { $ne: ['$$this.w', { $arrayElemAt: ['$queue.w', 0] }] } } } } }],
    // and again: most element pairs are those of the shift before
    [{ $set: { owner: { $arrayElemAt: ['$queue.w', 0] }, queue: { $filter: { input: '$queue', cond: { $ne: ['$$this.w', { $arrayElemAt: ['$queue.w', 0] }] } } } } }],
    // a waiter queues again
    [{ $set: { queue: { $concatArrays: ['$queue', [entry(9)]] } } }],
    [{ $set: { owner: { $arrayElemAt: ['$queue.w', 0] }, queue: { $filter: { input: '$queue', cond: { $ne: ['$$this.w', { $arrayElemAt: ['$queue.w', 0] }] } } } } }],
    // two waiters in the middle leave: an element is compared with another
    // one than before
    [{ $set: { queue: { $filter: { input: '$queue', cond: { $not: { $in: ['$$this.w', ['w5', 'w6']] } } } } } }],
    // index-named fields written, one removed, a field moved to the end
    [{ $set: { 10: 'TEN', 2: 'two', owner: 'w2' } }, { $unset: ['5'] }],
    [{ $replaceWith: { _id: '$_id', queue: '$queue', 10: '$10', 2: '$2', z: 2, pad: '$pad', owner: '$owner' } }],
    // the whole queue replaced by a shorter one
    [{ $set: { queue: [entry(7)] } }],
    [{ $set: { queue: { $concatArrays: ['$queue', [entry(8), entry(9), entry(10)]] }, 3: { x: 1 } } }],
    [{ $set: { 3: { x: 2, y: 1 }, queue: { $filter: { input: '$queue', cond: { $ne: ['$$this.w', 'w9'] } } } } }],
  ];
  for (const u of steps) await c.updateOne({ _id: 'L' }, u);
  const got = [...cur.firstBatch];
  for (let i = 0; i < 10 && got.length < steps.length + 1; i++) {
    got.push(...(await db.command({ getMore: cur.id, collection: 'c', maxTimeMS: 1000 }, RAW)).cursor.nextBatch);
  }
  await db.command({ killCursors: 'c', cursors: [cur.id] });
  assert.equal(got.length, steps.length + 1);
  const summary = got.slice(1).map((e) => (e.operationType === 'update'
    ? { u: e.updateDescription.updatedFields, r: e.updateDescription.removedFields, t: e.updateDescription.truncatedArrays }
    : { op: e.operationType, doc: { ...e.fullDocument, pad: e.fullDocument.pad.length } }));
  assert.deepEqual(JSON.parse(JSON.stringify(summary)), EXPECTED_EVENTS);
  // key order matters too (index-named fields first, as in mongod's objects)
  assert.deepEqual(summary.map((s) => Object.keys(s.u || s.doc)), EXPECTED_KEYS);
});

const EXPECTED_EVENTS = [{"u":{"queue.0.w":"w1","queue.0.t":"t1","queue.0.p":false,"queue.0.h.pid":101,"queue.0.h.app":"a1","queue.1.w":"w2","queue.1.t":"t2","queue.1.h.pid":102,"queue.1.h.app":"a2","queue.2.w":"w3","queue.2.t":"t3","queue.2.p":true,"queue.2.h.pid":103,"queue.2.h.app":"a3","queue.3.w":"w4","queue.3.t":"t4","queue.3.p":false,"queue.3.h.pid":104,"queue.3.h.app":"a4","queue.4.w":"w5","queue.4.t":"t5","queue.4.h.pid":105,"queue.4.h.app":"a5","queue.5.w":"w6","queue.5.t":"t6","queue.5.p":true,"queue.5.h.pid":106,"queue.5.h.app":"a6","queue.6.w":"w7","queue.6.t":"t7","queue.6.p":false,"queue.6.h.pid":107,"queue.6.h.app":"a7"},"r":[],"t":[{"field":"queue","newSize":7}]},{"u":{"owner":"w1","queue.0.w":"w2","queue.0.t":"t2","queue.0.h.pid":102,"queue.0.h.app":"a2","queue.1.w":"w3","queue.1.t":"t3","queue.1.p":true,"queue.1.h.pid":103,"queue.1.h.app":"a3","queue.2.w":"w4","queue.2.t":"t4","queue.2.p":false,"queue.2.h.pid":104,"queue.2.h.app":"a4","queue.3.w":"w5","queue.3.t":"t5","queue.3.h.pid":105,"queue.3.h.app":"a5","queue.4.w":"w6","queue.4.t":"t6","queue.4.p":true,"queue.4.h.pid":106,"queue.4.h.app":"a6","queue.5.w":"w7","queue.5.t":"t7","queue.5.p":false,"queue.5.h.pid":107,"queue.5.h.app":"a7"},"r":[],"t":[{"field":"queue","newSize":6}]},{"u":{"queue.6":{"w":"w9","t":"t9","p":true,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":109,"app":"a9"}}},"r":[],"t":[]},{"u":{"owner":"w2","queue.0.w":"w3","queue.0.t":"t3","queue.0.p":true,"queue.0.h.pid":103,"queue.0.h.app":"a3","queue.1.w":"w4","queue.1.t":"t4","queue.1.p":false,"queue.1.h.pid":104,"queue.1.h.app":"a4","queue.2.w":"w5","queue.2.t":"t5","queue.2.h.pid":105,"queue.2.h.app":"a5","queue.3.w":"w6","queue.3.t":"t6","queue.3.p":true,"queue.3.h.pid":106,"queue.3.h.app":"a6","queue.4.w":"w7","queue.4.t":"t7","queue.4.p":false,"queue.4.h.pid":107,"queue.4.h.app":"a7","queue.5.w":"w9","queue.5.t":"t9","queue.5.p":true,"queue.5.h.pid":109,"queue.5.h.app":"a9"},"r":[],"t":[{"field":"queue","newSize":6}]},{"u":{"queue.2.w":"w7","queue.2.t":"t7","queue.2.h.pid":107,"queue.2.h.app":"a7","queue.3.w":"w9","queue.3.t":"t9","queue.3.h.pid":109,"queue.3.h.app":"a9"},"r":[],"t":[{"field":"queue","newSize":4}]},{"op":"replace","doc":{"2":"two","10":"TEN","_id":"L","owner":"w2","queue":[{"w":"w3","t":"t3","p":true,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":103,"app":"a3"}},{"w":"w4","t":"t4","p":false,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":104,"app":"a4"}},{"w":"w7","t":"t7","p":false,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":107,"app":"a7"}},{"w":"w9","t":"t9","p":true,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":109,"app":"a9"}}],"z":1,"pad":2000}},{"u":{"z":2,"owner":"w2"},"r":[],"t":[]},{"u":{"queue.0.w":"w7","queue.0.t":"t7","queue.0.p":false,"queue.0.h.pid":107,"queue.0.h.app":"a7"},"r":[],"t":[{"field":"queue","newSize":1}]},{"op":"replace","doc":{"2":"two","3":{"x":1},"10":"TEN","_id":"L","queue":[{"w":"w7","t":"t7","p":false,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":107,"app":"a7"}},{"w":"w8","t":"t8","p":false,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":108,"app":"a8"}},{"w":"w9","t":"t9","p":true,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":109,"app":"a9"}},{"w":"w10","t":"t10","p":false,"h":{"host":"hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh","pid":110,"app":"a10"}}],"z":2,"pad":2000,"owner":"w2"}},{"u":{"3":{"x":2,"y":1},"queue.2.w":"w10","queue.2.t":"t10","queue.2.p":false,"queue.2.h.pid":110,"queue.2.h.app":"a10"},"r":[],"t":[{"field":"queue","newSize":3}]}];
const EXPECTED_KEYS = [["queue.0.w","queue.0.t","queue.0.p","queue.0.h.pid","queue.0.h.app","queue.1.w","queue.1.t","queue.1.h.pid","queue.1.h.app","queue.2.w","queue.2.t","queue.2.p","queue.2.h.pid","queue.2.h.app","queue.3.w","queue.3.t","queue.3.p","queue.3.h.pid","queue.3.h.app","queue.4.w","queue.4.t","queue.4.h.pid","queue.4.h.app","queue.5.w","queue.5.t","queue.5.p","queue.5.h.pid","queue.5.h.app","queue.6.w","queue.6.t","queue.6.p","queue.6.h.pid","queue.6.h.app"],["owner","queue.0.w","queue.0.t","queue.0.h.pid","queue.0.h.app","queue.1.w","queue.1.t","queue.1.p","queue.1.h.pid","queue.1.h.app","queue.2.w","queue.2.t","queue.2.p","queue.2.h.pid","queue.2.h.app","queue.3.w","queue.3.t","queue.3.h.pid","queue.3.h.app","queue.4.w","queue.4.t","queue.4.p","queue.4.h.pid","queue.4.h.app","queue.5.w","queue.5.t","queue.5.p","queue.5.h.pid","queue.5.h.app"],["queue.6"],["owner","queue.0.w","queue.0.t","queue.0.p","queue.0.h.pid","queue.0.h.app","queue.1.w","queue.1.t","queue.1.p","queue.1.h.pid","queue.1.h.app","queue.2.w","queue.2.t","queue.2.h.pid","queue.2.h.app","queue.3.w","queue.3.t","queue.3.p","queue.3.h.pid","queue.3.h.app","queue.4.w","queue.4.t","queue.4.p","queue.4.h.pid","queue.4.h.app","queue.5.w","queue.5.t","queue.5.p","queue.5.h.pid","queue.5.h.app"],["queue.2.w","queue.2.t","queue.2.h.pid","queue.2.h.app","queue.3.w","queue.3.t","queue.3.h.pid","queue.3.h.app"],["2","10","_id","owner","queue","z","pad"],["z","owner"],["queue.0.w","queue.0.t","queue.0.p","queue.0.h.pid","queue.0.h.app"],["2","3","10","_id","queue","z","pad","owner"],["3","queue.2.w","queue.2.t","queue.2.p","queue.2.h.pid","queue.2.h.app"]];

// Streams whose $match shares $or branches with other streams' (each
// branch is evaluated once per event for all of them): every stream still
// gets exactly the events its own filter passes.
test('change streams with $or filters that differ in literals each get their own events', async () => {
  await db.createCollection('s');
  const filter = (tag) => ({ $or: [
    { operationType: 'insert', 'fullDocument.t': { $regex: `^${tag}` } },
    { operationType: 'delete' },
    { operationType: 'insert', 'fullDocument.t': 'shared' },
    { operationType: 'update', 'updateDescription.updatedFields.t': tag },
  ] });
  const specs = {
    a: [{ $match: filter('a') }],
    b: [{ $match: filter('b') }],
    // the same filter as a's, and one with $expr (evaluated by the stages)
    a2: [{ $match: filter('a') }],
    x: [{ $match: { $or: [{ operationType: 'delete' }, { $expr: { $eq: ['$fullDocument.t', 'b1'] } }] } }],
  };
  const curs = {};
  for (const [k, st] of Object.entries(specs)) {
    curs[k] = (await db.command({ aggregate: 's', pipeline: [{ $changeStream: {} }, ...st], cursor: {} }, RAW)).cursor;
  }
  const s = db.collection('s');
  await s.insertMany([{ _id: 1, t: 'a1' }, { _id: 2, t: 'b1' }, { _id: 3, t: 'shared' }, { _id: 4, t: 'c1' }]);
  await s.updateOne({ _id: 4 }, { $set: { t: 'b' } });
  await s.updateOne({ _id: 4 }, { $set: { t: 'a' } });
  await s.deleteOne({ _id: 1 });
  const want = {
    a: ['insert 1', 'insert 3', 'update 4', 'delete 1'],
    b: ['insert 2', 'insert 3', 'update 4', 'delete 1'],
    a2: ['insert 1', 'insert 3', 'update 4', 'delete 1'],
    x: ['insert 2', 'delete 1'],
  };
  for (const [k, cur] of Object.entries(curs)) {
    const got = [...cur.firstBatch];
    for (let i = 0; i < 10 && got.length < want[k].length; i++) {
      got.push(...(await db.command({ getMore: cur.id, collection: 's', maxTimeMS: 300 }, RAW)).cursor.nextBatch);
    }
    // nothing more arrives
    got.push(...(await db.command({ getMore: cur.id, collection: 's', maxTimeMS: 300 }, RAW)).cursor.nextBatch);
    assert.deepEqual(got.map((e) => `${e.operationType} ${e.documentKey._id}`), want[k], k);
    await db.command({ killCursors: 's', cursors: [cur.id] });
  }
});

// $unset of top-level fields copies the document without them; with a
// dotted path it removes inside the embedded document.
test('$unset in update pipelines and aggregations keeps the other fields in order', async () => {
  const c = db.collection('u');
  await c.insertOne({ _id: 1, a: 1, 7: 'seven', b: { x: 1, y: 2 }, c: [1, 2], d: null, e: 'e' });
  await c.updateOne({ _id: 1 }, [{ $set: { f: 'f', a: 2 } }, { $unset: ['c', 'missing', '7'] }]);
  assert.deepEqual(Object.entries(await c.findOne({ _id: 1 })), [['_id', 1], ['a', 2], ['b', { x: 1, y: 2 }], ['d', null], ['e', 'e'], ['f', 'f']]);
  await c.updateOne({ _id: 1 }, [{ $unset: ['b.x', 'd'] }]);
  assert.deepEqual(Object.entries(await c.findOne({ _id: 1 })), [['_id', 1], ['a', 2], ['b', { y: 2 }], ['e', 'e'], ['f', 'f']]);
  const agg = await c.aggregate([{ $unset: 'a' }, { $unset: ['_id', 'e'] }]).toArray();
  assert.deepEqual(agg.map((d) => Object.entries(d)), [[['b', { y: 2 }], ['f', 'f']]]);
});
