'use strict';
// CRUD commands, cursors, indexes and collections, with MongoDB's reply
// shapes and error codes.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { Long, Int32, Double, MinKey, MaxKey, ObjectId } = require('mongodb');
const { setup } = require('./helpers');

let env, db;
before(async () => { env = await setup(); db = env.db('crud'); });
after(async () => { await env.stop(); });

test('insert, find with filter/sort/skip/limit/projection', async () => {
  const c = db.collection('people');
  const r = await db.command({ insert: 'people', documents: [
    { _id: 1, name: 'ann', age: 31, tags: ['a', 'b'], addr: { city: 'Oslo' } },
    { _id: 2, name: 'bob', age: 25, tags: ['b'], addr: { city: 'Rome' } },
    { _id: 3, name: 'cid', age: 40, addr: { city: 'Oslo' } },
    { _id: 4, name: 'dan', age: null },
  ] });
  assert.equal(r.n, 4);
  assert.deepEqual((await c.find({ age: { $gte: 30 } }).sort({ age: 1 }).toArray()).map((d) => d._id), [1, 3]);
  assert.deepEqual((await c.find({ tags: 'b' }).toArray()).map((d) => d._id), [1, 2]);
  assert.deepEqual((await c.find({ 'addr.city': 'Oslo' }).toArray()).map((d) => d._id), [1, 3]);
  assert.deepEqual((await c.find({ age: null }).toArray()).map((d) => d._id), [4]);
  assert.deepEqual((await c.find({ tags: { $exists: false } }).toArray()).map((d) => d._id), [3, 4]);
  assert.deepEqual((await c.find({ $or: [{ name: 'bob' }, { age: { $gt: 35 } }] }).toArray()).map((d) => d._id), [2, 3]);
  assert.deepEqual((await c.find({ _id: { $in: [2, 4, 9] } }).toArray()).map((d) => d._id), [2, 4]);
  assert.deepEqual((await c.find({ name: { $ne: 'ann' }, age: { $lt: 100 } }).toArray()).map((d) => d._id), [2, 3]);
  assert.deepEqual((await c.find({}).sort({ _id: -1 }).skip(1).limit(2).toArray()).map((d) => d._id), [3, 2]);
  assert.deepEqual(await c.find({ _id: 1 }).project({ name: 1, _id: 0 }).toArray(), [{ name: 'ann' }]);
  assert.deepEqual(await c.find({ _id: 1 }).project({ tags: 0, addr: 0, age: 0 }).toArray(), [{ _id: 1, name: 'ann' }]);
  assert.deepEqual(await c.find({ _id: 2 }).project({ 'addr.city': 1 }).toArray(), [{ _id: 2, addr: { city: 'Rome' } }]);
  // $expr and aggregation expressions in a find projection (4.4+)
  assert.deepEqual((await c.find({ $expr: { $gt: ['$age', 30] } }).toArray()).map((d) => d._id), [1, 3]);
  assert.deepEqual(await c.find({ _id: 3 }).project({ _id: 0, older: { $add: ['$age', 1] } }).toArray(), [{ older: 41 }]);
  // bad operators are errors, not silent matches
  await assert.rejects(c.find({ age: { $bogus: 1 } }).toArray(), (e) => e.code === 2);
});

test('inclusion projections keep the document\'s field order; $project goes into nested arrays, find does not', async () => {
  const c = db.collection('projorder');
  await c.insertOne({ _id: 1, b: 1, a: { y: 2, x: 1, z: 3 }, c: [1, { y: 1, x: 2 }, [{ x: 3, w: 0 }, 4]] });
  // included fields in the document's order, computed ones after them
  const [p] = await c.aggregate([{ $project: { c: 1, n: { $literal: 0 }, 'a.x': 1, 'a.y': 1, b: 1 } }]).toArray();
  assert.deepEqual(Object.keys(p), ['_id', 'b', 'a', 'c', 'n']);
  assert.deepEqual(Object.keys(p.a), ['y', 'x']);
  const f = await c.findOne({ _id: 1 }, { projection: { 'c.x': 1, 'a.x': 1, 'a.y': 1 } });
  assert.deepEqual(Object.keys(f), ['_id', 'a', 'c']);
  assert.deepEqual(Object.keys(f.a), ['y', 'x']);
  // into an array's documents; scalars dropped; nested arrays: aggregation
  // projects them, find drops them
  assert.deepEqual(f.c, [{ x: 2 }]);
  const [q] = await c.aggregate([{ $project: { _id: 0, 'c.x': 1 } }]).toArray();
  assert.deepEqual(q, { c: [{ x: 2 }, [{ x: 3 }]] });
});

test('projections: sub-objects are paths; paths that collide are refused (31249, 31250); computed paths go into arrays', async () => {
  const c = db.collection('projpaths');
  await c.insertOne({ _id: 1, a: { b: 1, c: 2 }, z: 5, arr: [1, { c: 2 }, [3, { d: 4 }]] });
  // mongod's jstests/core/projection_conflicts.js, for find and $project
  const collide = [
    [{ a: 1, 'a.b': 1 }, 31249, 'Path collision at a.b remaining portion b'],
    [{ 'a.b': 1, a: 1 }, 31250, 'Path collision at a'],
    [{ 'a.b': 1, 'a.b.c': 1 }, 31249, 'Path collision at a.b.c remaining portion b.c'],
    [{ a: 0, 'a.b': 0 }, 31249, 'Path collision at a.b remaining portion b'],
    [{ 'a.b': 0, a: 0 }, 31250, 'Path collision at a'],
    [{ a: { b: { c: 1 } }, 'a.b': 1 }, 31250, 'Path collision at a.b'],
    [{ 'a.b': 1, a: { b: { c: 1 } } }, 31250, 'Path collision at b'],
    [{ 'a.b': 1, a: { b: '$$REMOVE' } }, 31250, 'Path collision at b'],
  ];
  for (const [proj, code, msg] of collide) {
    // a find's error is the parser's, a $project stage's names the stage
    await assert.rejects(c.findOne({ _id: 1 }, { projection: proj }), (e) => e.code === code && e.message === msg, JSON.stringify(proj));
    await assert.rejects(c.aggregate([{ $project: proj }]).toArray(),
      (e) => e.code === code && e.message === `Invalid $project :: caused by :: ${msg}`, JSON.stringify(proj));
  }
  await assert.rejects(c.findOne({ _id: 1 }, { projection: { a: { b: 1, c: 0 } } }),
    (e) => e.code === 31254 && e.message === 'Cannot do exclusion on field c in inclusion projection');
  // a sub-object is the paths under its field, not a computed document
  assert.deepEqual(await c.findOne({ _id: 1 }, { projection: { a: { c: 1 }, 'a.b': 1 } }), { _id: 1, a: { b: 1, c: 2 } });
  assert.deepEqual(await c.findOne({ _id: 1 }, { projection: { a: { c: 0 }, arr: 0 } }), { _id: 1, a: { b: 1 }, z: 5 });
  // a computed path through an array: into each element, a scalar replaced
  // by a document (mongod's ProjectionNode::applyExpressionsToValue)
  const [p] = await c.aggregate([{ $project: { _id: 0, 'arr.c': 1, 'arr.n': { $literal: 7 } } }]).toArray();
  assert.deepEqual(p, { arr: [{ c: 2, n: 7 }, [{ n: 7 }]] });
  const f = await c.findOne({ _id: 1 }, { projection: { _id: 0, 'arr.n': { $literal: 7 } } });
  assert.deepEqual(f, { arr: [{ n: 7 }] });
  const [s] = await c.aggregate([{ $set: { 'arr.n': { $literal: 7 }, a: { d: 3 }, 'z.y': 1 } }]).toArray();
  assert.deepEqual(s.arr, [{ n: 7 }, { c: 2, n: 7 }, [{ n: 7 }, { d: 4, n: 7 }]]);
  assert.deepEqual(s.a, { b: 1, c: 2, d: 3 });
  assert.deepEqual(s.z, { y: 1 });
  // names are field paths (mongod's FieldPath), positional only in find;
  // an exclusion takes no expression
  const bad = [
    [{ $a: 1 }, 16410, "FieldPath field names may not start with '$'. Consider using $getField or $setField."],
    [{ 'a..b': 1 }, 15998, 'FieldPath field names may not be empty strings.'],
    [{ '': 1 }, 40352, 'FieldPath cannot be constructed with empty string'],
    [{ b: 0, a: { $literal: 1 } }, 31252, 'Cannot use expression other than $meta in exclusion projection'],
    [{ b: 0, a: 'x' }, 31310, 'Cannot use an expression a: "x" in an exclusion projection'],
  ];
  for (const [proj, code, msg] of bad) {
    await assert.rejects(c.findOne({ _id: 1 }, { projection: proj }), (e) => e.code === code && e.message === msg, JSON.stringify(proj));
    await assert.rejects(c.aggregate([{ $project: proj }]).toArray(),
      (e) => e.code === code && e.message === `Invalid $project :: caused by :: ${msg}`, JSON.stringify(proj));
  }
  await assert.rejects(c.aggregate([{ $project: { 'arr.$': 1 } }]).toArray(), (e) => e.code === 31324);
  await assert.rejects(c.aggregate([{ $set: { 'a.$b': 1 } }]).toArray(), (e) => e.code === 16410 &&
    e.message === "Invalid $set :: caused by :: FieldPath field names may not start with '$'. Consider using $getField or $setField.");
  // an empty object is neither a sub-projection nor a value to set
  await assert.rejects(c.aggregate([{ $project: { a: {} } }]).toArray(), (e) => e.code === 51270 &&
    e.message === 'Invalid $project :: caused by :: An empty sub-projection is not a valid value. Found empty object at path');
  await assert.rejects(c.findOne({ _id: 1 }, { projection: { a: { b: {} } } }), (e) => e.code === 51270);
  await assert.rejects(c.updateOne({ _id: 1 }, [{ $set: { 'a.b': {} } }]), (e) => e.code === 40180 &&
    e.message === 'Invalid $set :: caused by :: an empty object is not a valid value. Found empty object at path a.b');
  assert.deepEqual((await c.aggregate([{ $set: { e: { $literal: {} } } }]).toArray())[0].e, {});
  // $set/$addFields: a path beside one under it is refused (40176)
  await assert.rejects(c.aggregate([{ $set: { a: 1, 'a.b': 2 } }]).toArray(),
    (e) => e.code === 40176 && e.message.includes("Cannot specify both 'a.b' and 'a'"));
  // (an update's pipeline compiles by shape: the message still names the
  // command's own values)
  for (let i = 0; i < 2; i++) {
    await assert.rejects(c.updateOne({ _id: 1 }, [{ $set: { 'a.b': 2 + i, a: { b: 3 } } }]), (e) => e.code === 40176 &&
      e.message === `Invalid $set :: caused by :: specification contains two conflicting paths. Cannot specify both 'a.b' and 'a.b': { a.b: ${2 + i}, a: { b: 3 } }`);
  }
  assert.deepEqual(await c.findOne({ _id: 1 }), { _id: 1, a: { b: 1, c: 2 }, z: 5, arr: [1, { c: 2 }, [3, { d: 4 }]] });
});

test('comparisons and sorts follow MongoDB type order; range queries bracket by type', async () => {
  const c = db.collection('order');
  await c.insertMany([
    { _id: 1, v: 'b' }, { _id: 2, v: new Int32(5) }, { _id: 3, v: null }, { _id: 4, v: { a: 1 } },
    { _id: 5, v: [] }, { _id: 6, v: new ObjectId('000000000000000000000001') }, { _id: 7, v: true },
    { _id: 8, v: new Date(0) }, { _id: 9, v: new MaxKey() }, { _id: 10, v: new MinKey() }, { _id: 11 },
    { _id: 12, v: new Double(4.5) }, { _id: 13, v: Long.fromNumber(6) },
  ]);
  const order = (await c.find({}).sort({ v: 1, _id: 1 }).toArray()).map((d) => d._id);
  // MinKey < [] < null = missing < numbers < strings < objects < ObjectId < bool < date < MaxKey
  assert.deepEqual(order, [10, 5, 3, 11, 12, 2, 13, 1, 4, 6, 7, 8, 9]);
  assert.deepEqual((await c.find({ v: { $gt: 4 } }).sort({ _id: 1 }).toArray()).map((d) => d._id), [2, 12, 13]);
  assert.deepEqual((await c.find({ v: { $lt: 'z' } }).toArray()).map((d) => d._id), [1]);
  assert.deepEqual((await c.find({ v: 5 }).toArray()).map((d) => d._id), [2]);
  assert.deepEqual((await c.find({ v: { $type: 'long' } }).toArray()).map((d) => d._id), [13]);
  assert.deepEqual((await c.find({ v: { $type: 'number' } }).sort({ _id: 1 }).toArray()).map((d) => d._id), [2, 12, 13]);
});

test('update: operators, multi, upsert from the filter equality fields, replacement, nModified', async () => {
  const c = db.collection('upd');
  await c.insertMany([{ _id: 1, a: 1, n: new Int32(1) }, { _id: 2, a: 1, n: new Int32(1) }, { _id: 3, a: 2 }]);
  let r = await db.command({ update: 'upd', updates: [{ q: { a: 1 }, u: { $inc: { n: 1 }, $set: { s: 'x' } }, multi: true }] });
  assert.equal(r.n, 2); assert.equal(r.nModified, 2);
  // the same $set again changes nothing: matched 2, modified 0
  r = await db.command({ update: 'upd', updates: [{ q: { a: 1 }, u: { $set: { s: 'x' } }, multi: true }] });
  assert.equal(r.n, 2); assert.equal(r.nModified, 0);
  r = await db.command({ update: 'upd', updates: [{ q: { k: 'new', 'sub.z': 5, w: { $gt: 1 } }, u: { $set: { y: 1 }, $setOnInsert: { created: true } }, upsert: true }] });
  assert.equal(r.n, 1); assert.equal(r.nModified, 0);
  assert.equal(r.upserted.length, 1); assert.equal(r.upserted[0].index, 0);
  const up = await c.findOne({ _id: r.upserted[0]._id });
  assert.equal(up.k, 'new'); assert.deepEqual(up.sub, { z: 5 }); assert.equal(up.w, undefined);
  assert.equal(up.y, 1); assert.equal(up.created, true);
  assert.ok(up._id instanceof ObjectId);
  await c.replaceOne({ _id: 3 }, { b: 2 });
  assert.deepEqual(await c.findOne({ _id: 3 }), { _id: 3, b: 2 });
  await c.updateOne({ _id: 3 }, { $unset: { b: '' }, $push: { list: { $each: [1, 2] } }, $currentDate: { at: true } });
  const d3 = await c.findOne({ _id: 3 });
  assert.deepEqual(d3.list, [1, 2]); assert.ok(d3.at instanceof Date); assert.equal(d3.b, undefined);
  await c.updateOne({ _id: 3 }, { $max: { m: 5 }, $min: { lo: 2 }, $rename: { list: 'arr' } });
  assert.deepEqual(await c.findOne({ _id: 3 }, { projection: { at: 0 } }), { _id: 3, m: 5, lo: 2, arr: [1, 2] });
  // errors: immutable _id, conflicting paths, unknown modifier, $inc of a string
  await assert.rejects(c.updateOne({ _id: 3 }, { $set: { _id: 9 } }), (e) => e.code === 66);
  await assert.rejects(c.updateOne({ _id: 3 }, { $set: { a: 1 }, $inc: { a: 1 } }), (e) => e.code === 40);
  await assert.rejects(db.command({ update: 'upd', updates: [{ q: {}, u: { $frob: { a: 1 } } }] }).then((x) => {
    if (x.writeErrors) { const e = new Error(x.writeErrors[0].errmsg); e.code = x.writeErrors[0].code; throw e; }
  }), (e) => e.code === 9);
  await c.updateOne({ _id: 3 }, { $set: { s: 'str' } });
  await assert.rejects(c.updateOne({ _id: 3 }, { $inc: { s: 1 } }), (e) => e.code === 14);
});

test('delete with limit 1 and 0', async () => {
  const c = db.collection('del');
  await c.insertMany([{ a: 1 }, { a: 1 }, { a: 1 }, { a: 2 }]);
  let r = await db.command({ delete: 'del', deletes: [{ q: { a: 1 }, limit: 1 }] });
  assert.equal(r.n, 1);
  r = await db.command({ delete: 'del', deletes: [{ q: { a: 1 }, limit: 0 }] });
  assert.equal(r.n, 2);
  assert.equal(await c.countDocuments(), 1);
});

test('duplicate keys on _id and on a unique index: E11000 with keyPattern and keyValue', async () => {
  const c = db.collection('dups');
  await c.createIndex({ email: 1 }, { unique: true });
  await c.insertOne({ _id: 'x', email: 'a@b' });
  const r = await db.command({ insert: 'dups', documents: [{ _id: 'x' }, { _id: 'y' }] });
  assert.equal(r.n, 0); // ordered: stops at the first error
  assert.equal(r.writeErrors[0].code, 11000);
  assert.equal(r.writeErrors[0].index, 0);
  assert.match(r.writeErrors[0].errmsg, /^E11000 duplicate key error collection: \S+\.dups index: _id_ dup key: \{ _id: "x" \}$/);
  const r2 = await db.command({ insert: 'dups', documents: [{ _id: 'x' }, { _id: 'y', email: 'a@b' }, { _id: 'z' }], ordered: false });
  assert.equal(r2.n, 1);
  assert.deepEqual(r2.writeErrors.map((w) => [w.index, w.code]), [[0, 11000], [1, 11000]]);
  assert.deepEqual(r2.writeErrors[1].keyPattern, { email: 1 });
  assert.deepEqual(r2.writeErrors[1].keyValue, { email: 'a@b' });
  assert.match(r2.writeErrors[1].errmsg, /index: email_1 dup key: \{ email: "a@b" \}/);
  // a unique index treats a missing field as null: a second document without email collides
  await assert.rejects(c.insertOne({ _id: 'w' }), (e) => e.code === 11000 && /dup key: \{ email: null \}/.test(e.message));
  const c2 = db.collection('dups2');
  // int32 1 and double 1.0 are the same _id
  await c2.insertOne({ _id: new Int32(1) });
  await assert.rejects(c2.insertOne({ _id: new Double(1) }), (e) => e.code === 11000);
  await c2.insertOne({ _id: 'x', email: 'a@b' });
  // an upsert whose filter is not equality on _id alone gets E11000
  await assert.rejects(db.command({ findAndModify: 'dups2', query: { _id: 'x', email: 'other' }, update: { $set: { v: 1 } }, upsert: true }),
    (e) => e.code === 11000 && e.codeName === 'DuplicateKey');
  // building a unique index over duplicates fails
  await c2.insertMany([{ _id: 'p', k: 1 }, { _id: 'q', k: 1 }]);
  await assert.rejects(c2.createIndex({ k: 1 }, { unique: true }), (e) => e.code === 11000);
});

test('getMore, batchSize and killCursors', async () => {
  const c = db.collection('many');
  await c.insertMany(Array.from({ length: 25 }, (_, i) => ({ _id: i })));
  const f = await db.command({ find: 'many', filter: {}, batchSize: 10 }, { promoteLongs: false });
  assert.equal(f.cursor.firstBatch.length, 10);
  assert.ok(!f.cursor.id.isZero());
  assert.equal(f.cursor.ns, `${db.databaseName}.many`);
  const g = await db.command({ getMore: f.cursor.id, collection: 'many', batchSize: 10 }, { promoteLongs: false });
  assert.deepEqual(g.cursor.nextBatch.map((d) => d._id), [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]);
  const k = await db.command({ killCursors: 'many', cursors: [f.cursor.id] });
  assert.equal(k.cursorsKilled.length, 1);
  await assert.rejects(db.command({ getMore: f.cursor.id, collection: 'many' }), (e) => e.code === 43 && e.codeName === 'CursorNotFound');
  assert.equal((await c.find({}).batchSize(3).toArray()).length, 25);
});

test('findAndModify: query, sort, update, remove, new, upsert, fields', async () => {
  const c = db.collection('fam');
  await c.insertMany([{ _id: 1, q: 'a', p: 2 }, { _id: 2, q: 'a', p: 1 }]);
  let r = await db.command({ findAndModify: 'fam', query: { q: 'a' }, sort: { p: 1 }, update: { $set: { hit: true } } });
  assert.deepEqual(r.value, { _id: 2, q: 'a', p: 1 });
  assert.deepEqual(r.lastErrorObject, { n: 1, updatedExisting: true });
  r = await db.command({ findAndModify: 'fam', query: { q: 'a' }, sort: { p: -1 }, update: { $inc: { p: 10 } }, new: true, fields: { p: 1, _id: 0 } });
  assert.deepEqual(r.value, { p: 12 });
  r = await db.command({ findAndModify: 'fam', query: { _id: 'u' }, update: { $set: { v: 1 } }, upsert: true });
  assert.equal(r.value, null);
  assert.deepEqual(r.lastErrorObject, { n: 1, updatedExisting: false, upserted: 'u' });
  r = await db.command({ findAndModify: 'fam', query: { _id: 'none' }, update: { $set: { v: 1 } } });
  assert.equal(r.value, null);
  assert.deepEqual(r.lastErrorObject, { n: 0, updatedExisting: false });
  r = await db.command({ findAndModify: 'fam', query: { _id: 'u' }, remove: true });
  assert.deepEqual(r.value, { _id: 'u', v: 1 });
  assert.deepEqual(r.lastErrorObject, { n: 1 });
  await assert.rejects(db.command({ findAndModify: 'fam', query: {} }), (e) => e.code === 9);
  await assert.rejects(db.command({ findAndModify: 'fam', query: {}, remove: true, update: { $set: { a: 1 } } }), (e) => e.code === 9);
});

test('count, distinct, aggregate with $match/$project/$sort/$limit/$group/$count', async () => {
  const c = db.collection('agg');
  await c.insertMany([
    { _id: 1, k: 'a', v: new Int32(1) }, { _id: 2, k: 'b', v: new Int32(2) }, { _id: 3, k: 'a', v: new Int32(3) },
    { _id: 4, k: 'c', v: new Double(0.5) }, { _id: 5, k: ['a', 'd'] },
  ]);
  assert.equal((await db.command({ count: 'agg', query: { k: 'a' } })).n, 3);
  assert.deepEqual((await db.command({ distinct: 'agg', key: 'k' })).values, ['a', 'b', 'c', 'd']);
  const g = await c.aggregate([
    { $match: { v: { $exists: true } } },
    { $group: { _id: '$k', total: { $sum: '$v' }, n: { $sum: 1 }, max: { $max: '$v' } } },
    { $sort: { _id: 1 } },
  ]).toArray();
  assert.deepEqual(g, [{ _id: 'a', total: 4, n: 2, max: 3 }, { _id: 'b', total: 2, n: 1, max: 2 }, { _id: 'c', total: 0.5, n: 1, max: 0.5 }]);
  const p = await c.aggregate([{ $sort: { _id: -1 } }, { $limit: 2 }, { $project: { _id: 1, twice: { $multiply: ['$v', 2] } } }]).toArray();
  assert.deepEqual(p, [{ _id: 5, twice: null }, { _id: 4, twice: 1 }]);
  assert.deepEqual(await c.aggregate([{ $match: { k: 'a' } }, { $count: 'n' }]).toArray(), [{ n: 3 }]);
  assert.deepEqual(await c.aggregate([{ $match: { _id: 5 } }, { $unwind: '$k' }, { $project: { k: 1 } }]).toArray(), [{ _id: 5, k: 'a' }, { _id: 5, k: 'd' }]);
  // a stage and an expression operator the stand-in delegates to mingo
  const f = await c.aggregate([{ $facet: { as: [{ $match: { k: 'a' } }, { $count: 'n' }], all: [{ $count: 'n' }] } }], { promoteValues: false }).toArray();
  assert.equal(f[0].as[0].n._bsontype, 'Int32');
  assert.equal(f[0].as[0].n.value, 3);
  assert.equal(f[0].all[0].n.value, 5);
  const l = await c.aggregate([{ $match: { _id: 2 } }, { $project: { _id: 0, len: { $strLenCP: { $concat: ['$k', 'xyz'] } } } }]).toArray();
  assert.deepEqual(l, [{ len: 4 }]);
  await assert.rejects(c.aggregate([{ $noSuchStage: {} }]).toArray(), (e) => e.code === 40324);
});

test('indexes and collections: createIndexes, listIndexes, dropIndexes, listCollections, listDatabases, create, drop, dropDatabase', async () => {
  const d = env.db('ddl');
  await d.command({ create: 'one' });
  await assert.rejects(d.command({ create: 'one' }), (e) => e.code === 48 && e.codeName === 'NamespaceExists');
  const ci = await d.command({ createIndexes: 'one', indexes: [{ key: { a: 1 }, name: 'a_1', unique: true }, { key: { t: 1 }, name: 't_ttl', expireAfterSeconds: 3600 }] });
  assert.equal(ci.numIndexesBefore, 1); assert.equal(ci.numIndexesAfter, 3);
  const again = await d.command({ createIndexes: 'one', indexes: [{ key: { a: 1 }, name: 'a_1', unique: true }] });
  assert.equal(again.numIndexesAfter, 3);
  await assert.rejects(d.command({ createIndexes: 'one', indexes: [{ key: { b: 1 }, name: 'a_1' }] }), (e) => e.code === 86);
  await assert.rejects(d.command({ createIndexes: 'one', indexes: [{ key: { a: 1 }, name: 'a_1' }] }), (e) => e.code === 85);
  await assert.rejects(d.command({ createIndexes: 'one', indexes: [{ key: { c: 1 }, name: 'c_1', bogus: 1 }] }), (e) => e.code === 197);
  const ix = await d.collection('one').indexes();
  assert.deepEqual(ix.map((i) => i.name), ['_id_', 'a_1', 't_ttl']);
  assert.equal(ix[1].unique, true); assert.equal(ix[2].expireAfterSeconds, 3600);
  await d.command({ dropIndexes: 'one', index: 'a_1' });
  await assert.rejects(d.command({ dropIndexes: 'one', index: 'nope' }), (e) => e.code === 27 && e.codeName === 'IndexNotFound');
  assert.deepEqual((await d.collection('one').indexes()).map((i) => i.name), ['_id_', 't_ttl']);
  const cols = await d.listCollections().toArray();
  assert.deepEqual(cols.map((x) => x.name), ['one']);
  assert.equal(cols[0].type, 'collection');
  const dbs = await env.client.db('admin').command({ listDatabases: 1 });
  assert.ok(dbs.databases.some((x) => x.name === d.databaseName));
  await assert.rejects(d.command({ listIndexes: 'nothere' }), (e) => e.code === 26);
  const dr = await d.command({ drop: 'one' });
  assert.equal(dr.ok, 1);
  assert.deepEqual(await d.listCollections().toArray(), []);
  await d.collection('two').insertOne({});
  await d.dropDatabase();
  assert.deepEqual(await d.listCollections().toArray(), []);
});

test('write concern majority/1/0 and read concern are accepted; w:0 gets no reply', async () => {
  const c = db.collection('wc');
  await c.insertOne({ _id: 1 }, { writeConcern: { w: 'majority', wtimeoutMS: 1000, j: true } });
  await c.insertOne({ _id: 2 }, { writeConcern: { w: 1 } });
  await c.insertOne({ _id: 3 }, { writeConcern: { w: 0 } });
  const docs = await c.find({}, { readConcern: { level: 'majority' } }).toArray();
  assert.deepEqual(docs.map((x) => x._id), [1, 2, 3]);
});

test('batches stop before 16 MiB; large replies go through whole', async () => {
  const c = db.collection('big');
  const blob = 'x'.repeat(4 * 1024 * 1024);
  await c.insertMany([0, 1, 2, 3, 4].map((i) => ({ _id: i, blob })));
  const f = await db.command({ find: 'big', filter: {}, batchSize: 0 }, { promoteLongs: false });
  assert.equal(f.cursor.firstBatch.length, 0);
  const g = await db.command({ getMore: f.cursor.id, collection: 'big' }, { promoteLongs: false });
  assert.ok(g.cursor.nextBatch.length >= 1 && g.cursor.nextBatch.length <= 3, `batch of ${g.cursor.nextBatch.length}`);
  assert.equal((await c.find({}).toArray()).length, 5);
  await c.drop();
});

test('readConcern: majority and local read as mongod reads them; an unknown level is refused', async () => {
  const d = env.db('rc');
  await d.collection('c').insertOne({ _id: 1 });
  for (const level of ['majority', 'local', 'available']) {
    const r = await d.command({ aggregate: 'c', pipeline: [], cursor: {}, readConcern: { level } });
    assert.deepEqual(r.cursor.firstBatch, [{ _id: 1 }], level);
    assert.equal((await d.command({ find: 'c', filter: {}, readConcern: { level } })).cursor.firstBatch.length, 1);
  }
  await assert.rejects(d.command({ find: 'c', filter: {}, readConcern: { level: 'most' } }), (e) => e.code === 2);
  await assert.rejects(d.command({ find: 'c', filter: {}, readConcern: { level: 1 } }), (e) => e.code === 14);
});
