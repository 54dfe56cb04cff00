'use strict';
// Update pipelines and aggregation expressions as the lock library uses them
// (doc/design.md): $$NOW as one value per command, missing vs null, date
// arithmetic, no-op detection, expressions in findAndModify's fields.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { Long, Int32, Double } = require('mongodb');
const { setup } = require('./helpers');

let env, db;
before(async () => { env = await setup(); db = env.db('pipe'); });
after(async () => { await env.stop(); });

const RAW = { promoteValues: false, promoteLongs: false };

// The acquire command of doc/design.md.
function acquire(coll, name, owner, ttlMs) {
  const FREE = { $or: [{ $eq: [{ $ifNull: ['$owner', null] }, null] }, { $lte: ['$expiresAt', '$$NOW'] }] };
  return db.command({
    findAndModify: coll, query: { _id: name }, upsert: true, new: true,
    update: [{ $set: {
      owner: { $cond: [FREE, owner, '$owner'] },
      token: { $cond: [FREE, { $max: [{ $add: [{ $ifNull: ['$token', Long.fromNumber(0)] }, Long.fromNumber(1)] },
        { $multiply: [{ $toLong: '$$NOW' }, Long.fromNumber(1024)] }] }, '$token'] },
      acquiredAt: { $cond: [FREE, '$$NOW', '$acquiredAt'] },
      expiresAt: { $cond: [FREE, { $add: ['$$NOW', Long.fromNumber(ttlMs)] }, '$expiresAt'] },
      holder: { $cond: [FREE, { $literal: { host: 'h', pid: new Int32(1), app: '$notAField' } }, '$holder'] },
    } }],
    fields: { owner: 1, token: 1, expiresAt: 1, holder: 1, acquiredAt: 1, remainingMs: { $subtract: ['$expiresAt', '$$NOW'] } },
    writeConcern: { w: 'majority' },
  }, RAW);
}

test('lock acquire pipeline: upsert, token, server-side times, remainingMs as int64, $literal kept literal', async () => {
  const r = await acquire('locks', 'job', 'A'.repeat(32), 30000);
  assert.equal(r.ok.valueOf(), 1);
  const v = r.value;
  assert.equal(v._id, 'job');
  assert.equal(v.owner, 'A'.repeat(32));
  assert.equal(v.token._bsontype, 'Long');
  assert.ok(v.acquiredAt instanceof Date);
  assert.equal(v.expiresAt.getTime() - v.acquiredAt.getTime(), 30000, '$$NOW is one value for the whole command');
  assert.equal(v.remainingMs._bsontype, 'Long');
  assert.ok(v.remainingMs.toNumber() <= 30000 && v.remainingMs.toNumber() > 25000);
  assert.deepEqual(v.holder, { host: 'h', pid: new Int32(1), app: '$notAField' });
  assert.ok(v.token.toNumber() >= v.acquiredAt.getTime() * 1024);
  assert.equal(r.lastErrorObject.upserted, 'job');
});

test('a held lock: the pipeline writes every field back unchanged, which is a no-op (nModified 0)', async () => {
  const first = await acquire('locks', 'held', 'B'.repeat(32), 60000);
  const again = await acquire('locks', 'held', 'C'.repeat(32), 60000);
  assert.equal(again.value.owner, 'B'.repeat(32));
  assert.equal(again.value.token.toString(), first.value.token.toString());
  assert.equal(again.lastErrorObject.updatedExisting, true);
  // the same no-op through update reports nModified 0
  const u = await db.command({ update: 'locks', updates: [{ q: { _id: 'held' }, u: [{ $set: { owner: '$owner', token: '$token' } }] }] });
  assert.equal(u.n, 1);
  assert.equal(u.nModified, 0);
  const u2 = await db.command({ update: 'locks', updates: [{ q: { _id: 'held' }, u: [{ $set: { expiresAt: { $add: ['$$NOW', 1000] } } }] }] });
  assert.equal(u2.nModified, 1);
});

test('expired lease is taken over with token previous+1 or time*1024, whichever is larger', async () => {
  await acquire('locks', 'exp', 'D'.repeat(32), 1);
  const before = (await db.collection('locks').findOne({ _id: 'exp' }, RAW)).token;
  await new Promise((r) => setTimeout(r, 5));
  const r = await acquire('locks', 'exp', 'E'.repeat(32), 1000);
  assert.equal(r.value.owner, 'E'.repeat(32));
  assert.ok(BigInt(r.value.token.toString()) > BigInt(before.toString()));
  // release keeps token, clears owner
  const rel = await db.command({ update: 'locks', updates: [{ q: { _id: 'exp', owner: 'E'.repeat(32) }, u: [{ $set: { owner: null, expiresAt: '$$NOW' } }] }] });
  assert.equal(rel.n, 1);
  const doc = await db.collection('locks').findOne({ _id: 'exp' }, RAW);
  assert.equal(doc.owner, null);
  assert.equal(doc.token.toString(), r.value.token.toString());
  const rel2 = await db.command({ update: 'locks', updates: [{ q: { _id: 'exp', owner: 'E'.repeat(32) }, u: [{ $set: { owner: null } }] }] });
  assert.equal(rel2.n, 0);
});

test('missing vs null in expressions', async () => {
  const c = db.collection('mn');
  await c.insertOne({ _id: 1, n: null });
  const [r] = await c.aggregate([{ $match: { _id: 1 } }, { $project: {
    _id: 0,
    missingEqNull: { $eq: ['$absent', null] },
    nullEqNull: { $eq: ['$n', null] },
    ifNullMissing: { $ifNull: ['$absent', 'dflt'] },
    ifNullNull: { $ifNull: ['$n', 'dflt'] },
    missingLtNull: { $lt: ['$absent', null] },
    missingLteDate: { $lte: ['$absent', '$$NOW'] },
    addNull: { $add: ['$n', 1] },
    addMissing: { $add: ['$absent', 1] },
    typeMissing: { $type: '$absent' },
    typeNull: { $type: '$n' },
    copied: '$absent',
  } }]).toArray();
  assert.deepEqual(r, {
    missingEqNull: false, nullEqNull: true, ifNullMissing: 'dflt', ifNullNull: 'dflt', missingLtNull: true,
    missingLteDate: true, addNull: null, addMissing: null, typeMissing: 'missing', typeNull: 'null',
  });
  // $set of a missing value leaves the field out; $$REMOVE removes it
  await c.updateOne({ _id: 1 }, [{ $set: { x: '$absent', n: '$$REMOVE' } }]);
  assert.deepEqual(await c.findOne({ _id: 1 }), { _id: 1 });
});

test('arithmetic keeps BSON types: int32+int32, int64, double, date +/- numbers, date - date', async () => {
  const c = db.collection('arith');
  await c.insertOne({ _id: 1, i: new Int32(2), l: Long.fromNumber(3), d: new Double(1.5), t: new Date(1000), big: new Int32(2147483647) });
  const [r] = await c.aggregate([{ $match: { _id: 1 } }, { $project: {
    _id: 0,
    ii: { $add: ['$i', '$i'] }, il: { $add: ['$i', '$l'] }, id: { $add: ['$i', '$d'] },
    overflow: { $add: ['$big', 1] },
    dateAdd: { $add: ['$t', '$l'] }, dateSub: { $subtract: ['$t', 500] }, dd: { $subtract: ['$t', { $literal: new Date(400) }] },
    toLong: { $toLong: '$t' }, mul: { $multiply: ['$l', 1024] }, max: { $max: ['$i', '$l', null] },
    cond: { $cond: { if: { $gt: ['$l', '$i'] }, then: 'yes', else: 'no' } },
  } }], RAW).toArray();
  assert.equal(r.ii._bsontype, 'Int32'); assert.equal(r.ii.value, 4);
  assert.equal(r.il._bsontype, 'Long'); assert.equal(r.il.toNumber(), 5);
  assert.equal(r.id._bsontype, 'Double'); assert.equal(r.id.value, 3.5);
  assert.equal(r.overflow._bsontype, 'Long'); assert.equal(r.overflow.toNumber(), 2147483648);
  assert.equal(r.dateAdd.getTime(), 1003);
  assert.equal(r.dateSub.getTime(), 500);
  assert.equal(r.dd._bsontype, 'Long'); assert.equal(r.dd.toNumber(), 600);
  assert.equal(r.toLong._bsontype, 'Long'); assert.equal(r.toLong.toNumber(), 1000);
  assert.equal(r.mul._bsontype, 'Long'); assert.equal(r.mul.toNumber(), 3072);
  assert.equal(r.max.toNumber(), 3);
  assert.equal(r.cond, 'yes');
});

test('$$NOW is one value across every document of a multi-update', async () => {
  const c = db.collection('now');
  await c.insertMany(Array.from({ length: 50 }, (_, i) => ({ _id: i })));
  await c.updateMany({}, [{ $set: { at: '$$NOW' } }]);
  const times = new Set((await c.find({}).toArray()).map((d) => d.at.getTime()));
  assert.equal(times.size, 1);
});

test('pipeline stages in updates: $unset, $replaceWith, $project; other stages are refused', async () => {
  const c = db.collection('stages');
  await c.insertOne({ _id: 1, a: 1, b: 2, sub: { x: 1 } });
  await c.updateOne({ _id: 1 }, [{ $unset: ['b'] }, { $set: { 'sub.y': 2 } }]);
  assert.deepEqual(await c.findOne({ _id: 1 }), { _id: 1, a: 1, sub: { x: 1, y: 2 } });
  await c.updateOne({ _id: 1 }, [{ $replaceWith: { $mergeObjects: ['$sub', { _id: '$_id' }] } }]);
  assert.deepEqual(await c.findOne({ _id: 1 }), { _id: 1, x: 1, y: 2 });
  await c.updateOne({ _id: 1 }, [{ $project: { x: 1 } }]);
  assert.deepEqual(await c.findOne({ _id: 1 }), { _id: 1, x: 1 });
  await assert.rejects(c.updateOne({ _id: 1 }, [{ $match: {} }]), (e) => typeof e.code === 'number');
  await assert.rejects(c.updateOne({ _id: 1 }, [{ $set: { _id: 2 } }]), (e) => e.code === 66);
});

test('upsert with a pipeline builds the document from the filter equality fields', async () => {
  const c = db.collection('ups');
  const r = await c.updateOne({ _id: 'k', kind: 'lock' }, [{ $set: { n: { $add: [{ $ifNull: ['$n', 0] }, 1] } } }], { upsert: true });
  assert.equal(r.upsertedId, 'k');
  assert.deepEqual(await c.findOne({ _id: 'k' }), { _id: 'k', kind: 'lock', n: 1 });
});

test('unknown expression operators are errors (168)', async () => {
  const c = db.collection('bad');
  await c.insertOne({ _id: 1 });
  await assert.rejects(c.aggregate([{ $project: { x: { $noSuchOp: 1 } } }]).toArray(), (e) => e.code === 168 || e.code === 31325);
});

test('repeated pipelines with changing literals (lengths, types, $literal, "$path" vs text) use each command\'s own values', async () => {
  const c = db.collection('shapes');
  await c.insertOne({ _id: 1, b: 'from-b' });
  const kinds = [(n) => new Int32(n), (n) => Long.fromNumber(n), (n) => new Double(n + 0.5)];
  for (let i = 0; i < 30; i++) {
    const owner = 'o'.repeat((i % 7) + 1) + i;
    const num = kinds[i % 3](i);
    const lit = i % 2 ? { n: new Int32(i), pad: 'p'.repeat(i % 4) } : { n: new Int32(i) };
    const r = await db.command({
      findAndModify: 'shapes', query: { _id: 1 }, new: true,
      update: [{ $set: { owner: { $cond: [true, owner, '$owner'] }, num: { $add: [num, 0] }, lit: { $literal: lit }, s: i % 2 ? '$b' : 'xy$b' } }],
      fields: { owner: 1, num: 1, lit: 1, s: 1, calc: { $add: [num, new Int32(1)] } },
    }, RAW);
    assert.equal(r.value.owner, owner);
    assert.equal(r.value.num._bsontype, num._bsontype);
    const asNumber = (v) => (v._bsontype === 'Long' ? v.toNumber() : v.value);
    assert.equal(asNumber(r.value.num), asNumber(num));
    assert.deepEqual(r.value.lit, lit);
    assert.equal(r.value.s, i % 2 ? 'from-b' : 'xy$b');
    assert.equal(asNumber(r.value.calc), asNumber(num) + 1);
  }
});

// Pipelines that differ only in literals share one compiled form on the
// stand-in; the variable a $filter or $map names ('as') is structure, not a
// literal: two commands that differ in it must each see their own variable.
test('$filter and $map with literals and named variables: each command gets its own values and names', async () => {
  const c = db.collection('asvars');
  await c.insertOne({ _id: 1, q: [{ w: 'a', n: 1 }, { w: 'b', n: 2 }, { w: 'c', n: 3 }] });
  const run = (as, drop, add) => db.command({
    findAndModify: 'asvars', query: { _id: 1 }, new: true,
    update: [{ $set: {
      kept: { $filter: { input: '$q', as, cond: { $ne: [`$$${as}.w`, drop] } } },
      plus: { $map: { input: '$q', as, in: { $add: [`$$${as}.n`, add] } } },
      at: { $indexOfArray: ['$q.w', drop] },
      all: { $concatArrays: ['$q.w', [drop]] },
    } }],
    fields: { _id: 0, kept: '$kept.w', plus: 1, at: 1, all: 1 },
  });
  for (const [as, drop, add, kept, plus, at] of [
    ['x', 'a', 10, ['b', 'c'], [11, 12, 13], 0], ['y', 'b', 20, ['a', 'c'], [21, 22, 23], 1],
    ['x', 'c', 30, ['a', 'b'], [31, 32, 33], 2], ['zz', 'none', 0, ['a', 'b', 'c'], [1, 2, 3], -1]]) {
    const r = await run(as, drop, add);
    assert.deepEqual(r.value, { kept, plus, at, all: ['a', 'b', 'c', drop] }, `as ${as}, drop ${drop}`);
  }
  // an undefined variable is still refused whatever the cached shape
  await assert.rejects(db.command({ findAndModify: 'asvars', query: { _id: 1 },
    update: [{ $set: { k: { $filter: { input: '$q', as: 'x', cond: { $ne: ['$$y.w', 'a'] } } } } }] }),
  (e) => e.code === 17276);
});

test('variables a scope binds ($filter/$map as, $let vars, ROOT/CURRENT of a stage) are seen inside it only, also after an error in it', async () => {
  const c = db.collection('scopes');
  await c.insertOne({ _id: 1, q: [{ w: 'a', n: 1, r: [1, 2] }, { w: 'b', n: 0, r: [3] }], k: 5 });
  // nested scopes with the same name, $let shadowing and its vars evaluated outside it, CURRENT rebound
  const r = await db.command({
    findAndModify: 'scopes', query: { _id: 1 }, new: true,
    update: [
      { $set: {
        nested: { $map: { input: '$q', as: 'x', in: { $concatArrays: [
          { $map: { input: '$$x.r', as: 'x', in: { $add: ['$$x', 100] } } }, ['$$x.w']] } } },
        shadow: { $let: { vars: { k: 1, j: { $subtract: ['$k', 5] } }, in: { $let: { vars: { k: { $add: ['$$k', 10] } },
          in: [{ $filter: { input: '$q', as: 'k', cond: { $eq: ['$$k.n', '$$j'] } } }, '$$k', '$$j'] } } } },
        cur: { $map: { input: '$q', as: 'CURRENT', in: '$w' } },
        after: '$k',
      } },
      { $set: { root: { $size: { $objectToArray: '$$ROOT' } }, cur2: '$$CURRENT.after' } },
    ],
    fields: { _id: 0, nested: 1, shadow: 1, cur: 1, after: 1, root: 1, cur2: 1 },
  });
  assert.deepEqual(r.value, {
    nested: [[101, 102, 'a'], [103, 'b']], shadow: [[{ w: 'b', n: 0, r: [3] }], 11, 0], cur: ['a', 'b'], after: 5, root: 7, cur2: 5,
  });
  // a later stage does not know the names
  await assert.rejects(db.command({ findAndModify: 'scopes', query: { _id: 1 }, update: [
    { $set: { f: { $filter: { input: '$q', as: 'x', cond: { $gt: ['$$x.n', 0] } } } } }, { $set: { g: '$$x' } }] }),
  (e) => e.code === 17276);
  // one command's statements share its variables: a name bound inside the first
  // statement's scopes is unknown to the second, even when the first failed inside
  // it ($objectToArray, which mingo evaluates, keeps these pipelines off the
  // shape cache, whose parameters come in a copy of the variables)
  for (const first of [
    [{ $set: { f: { $filter: { input: '$q', as: 'x', cond: { $gt: ['$$x.n', 0] } } } } }],
    [{ $set: { f: { $filter: { input: '$q', as: 'x', cond: { $gt: [{ $divide: [1, '$$x.n'] }, 0] } } } } }],
    [{ $set: { f: { $let: { vars: { x: 1 }, in: { $divide: ['$$x', 0] } } } } }],
  ]) {
    const u = await db.command({ update: 'scopes', ordered: false, updates: [
      { q: { _id: 1 }, u: [{ $set: { o: { $objectToArray: { a: 1 } } } }, ...first] },
      { q: { _id: 1 }, u: [{ $set: { g: '$$x' } }] },
      { q: { _id: 1 }, u: [{ $set: { h: { $type: '$$ROOT' }, i: { $type: '$$CURRENT' } } }] },
    ] });
    const codes = (u.writeErrors || []).map((e) => [e.index, e.code]);
    assert.deepEqual(codes.filter(([i]) => i === 1), [[1, 17276]], JSON.stringify(first));
    assert.equal(codes.filter(([i]) => i === 2).length, 0);
  }
  const d = await c.findOne({ _id: 1 });
  assert.equal(d.h, 'object');
  assert.equal(d.i, 'object');
  assert.equal(d.g, undefined);
});

// $eq ... $cmp on two strings, two booleans or two dates agree with the
// server's own sort order of the same values, and on mixed types with the
// order of types; that order is MongoDB's (strings by UTF-8 bytes: a
// character above U+FFFF sorts after U+FFFD; null, numbers, strings,
// booleans, dates).
test('comparison operators on strings, booleans and dates agree with $sort', async () => {
  const c = db.collection('cmp');
  const pairs = db.collection('cmpPairs');
  // each group with the indexes of its values in ascending order
  const groups = [
    [['', 'a', 'ab', 'b', 'B', '\u00e9', '\uFFFD', '\u{1F600}', 'a\u0000'], [0, 4, 1, 8, 2, 3, 5, 6, 7]],
    [[true, false], [1, 0]],
    [[new Date(0), new Date(1e12), new Date(-5), new Date(1e12 + 1)], [2, 0, 1, 3]],
    [['x', true, new Date(3), 7, null], [4, 3, 0, 1, 2]],
  ];
  for (const [values, order] of groups) {
    await c.deleteMany({});
    await pairs.deleteMany({});
    await c.insertMany(values.map((v, i) => ({ _id: i, v })));
    const sorted = (await c.find({}).sort({ v: 1 }).toArray()).map((d) => d._id);
    assert.deepEqual(sorted, order);
    const rank = new Map(sorted.map((id, r) => [id, r]));
    const docs = [];
    values.forEach((a, i) => values.forEach((b, j) => docs.push({ _id: `${i}-${j}`, i, j, a, b })));
    await pairs.insertMany(docs);
    const rows = await pairs.aggregate([{ $project: { i: 1, j: 1, eq: { $eq: ['$a', '$b'] }, ne: { $ne: ['$a', '$b'] },
      gt: { $gt: ['$a', '$b'] }, gte: { $gte: ['$a', '$b'] }, lt: { $lt: ['$a', '$b'] }, lte: { $lte: ['$a', '$b'] },
      cmp: { $cmp: ['$a', '$b'] } } }]).toArray();
    assert.equal(rows.length, values.length * values.length);
    for (const r of rows) {
      const d = Math.sign(rank.get(r.i) - rank.get(r.j));
      assert.deepEqual([r.eq, r.ne, r.gt, r.gte, r.lt, r.lte, Number(r.cmp)], [d === 0, d !== 0, d > 0, d >= 0, d < 0, d <= 0, d], JSON.stringify(r));
    }
  }
});
