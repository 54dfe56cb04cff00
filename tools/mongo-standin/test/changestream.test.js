'use strict';
// Change streams: events, resume tokens, startAtOperationTime, updateLookup,
// $match, getMore that waits and answers the moment an event arrives, and
// no event for a no-op update.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { Long } = require('mongodb');
const { setup } = require('./helpers');

let env, db;
before(async () => { env = await setup(); db = env.db('cs'); await db.createCollection('c'); });
after(async () => { await env.stop(); });

const RAW = { promoteLongs: false };

async function open(pipeline, extra = {}, session = undefined) {
  const r = await db.command({ aggregate: 'c', pipeline, cursor: {}, ...extra }, { ...RAW, session });
  return r.cursor;
}
// (a cursor is used in the session that opened it: getMores sent at the
// same time need the stream's explicit session)
async function more(id, maxTimeMS = 1000, session = undefined) {
  return (await db.command({ getMore: id, collection: 'c', maxTimeMS }, { ...RAW, session })).cursor;
}
// Reads until n events arrived (each getMore waits up to 1 s).
async function take(id, n) {
  const got = [];
  for (let i = 0; i < 10 && got.length < n; i++) got.push(...(await more(id)).nextBatch);
  return got;
}

test('insert, update, replace and delete events with resume tokens, clusterTime, documentKey, updateDescription', async () => {
  const cur = await open([{ $changeStream: {} }]);
  assert.equal(cur.firstBatch.length, 0);
  assert.ok(cur.postBatchResumeToken && cur.postBatchResumeToken._data);
  assert.equal(cur.ns, `${db.databaseName}.c`);
  const c = db.collection('c');
  await c.insertOne({ _id: 1, a: 1 });
  await c.updateOne({ _id: 1 }, { $set: { b: 2 }, $unset: { a: '' } });
  await c.replaceOne({ _id: 1 }, { z: 1 });
  await c.deleteOne({ _id: 1 });
  const ev = await take(cur.id, 4);
  assert.deepEqual(ev.map((e) => e.operationType), ['insert', 'update', 'replace', 'delete']);
  for (const e of ev) {
    assert.ok(e._id && e._id._data);
    assert.equal(e.clusterTime._bsontype, 'Timestamp');
    assert.deepEqual(e.ns, { db: db.databaseName, coll: 'c' });
    assert.deepEqual(e.documentKey, { _id: 1 });
  }
  assert.deepEqual(ev[0].fullDocument, { _id: 1, a: 1 });
  assert.deepEqual(ev[1].updateDescription.updatedFields, { b: 2 });
  assert.deepEqual(ev[1].updateDescription.removedFields, ['a']);
  assert.equal(ev[1].fullDocument, undefined);
  assert.deepEqual(ev[2].fullDocument, { _id: 1, z: 1 });
  // cluster times strictly increase
  for (let i = 1; i < ev.length; i++) assert.ok(ev[i].clusterTime.greaterThan(ev[i - 1].clusterTime));
  // resumeAfter the second event replays the last two
  const resumed = await open([{ $changeStream: { resumeAfter: ev[1]._id } }]);
  const again = [...resumed.firstBatch, ...(resumed.firstBatch.length >= 2 ? [] : await take(resumed.id, 2 - resumed.firstBatch.length))];
  assert.deepEqual(again.map((e) => e.operationType), ['replace', 'delete']);
  assert.deepEqual(again[0]._id, ev[2]._id);
  const sa = await open([{ $changeStream: { startAfter: ev[2]._id } }]);
  const after3 = [...sa.firstBatch, ...(sa.firstBatch.length ? [] : await take(sa.id, 1))];
  assert.deepEqual(after3.map((e) => e.operationType), ['delete']);
  for (const id of [cur.id, resumed.id, sa.id]) await db.command({ killCursors: 'c', cursors: [id] });
});

test('startAtOperationTime = operationTime of a read misses nothing written after it', async () => {
  const c = db.collection('c');
  await c.insertOne({ _id: 'before' });
  const read = await db.command({ find: 'c', filter: { _id: 'before' } });
  await c.insertOne({ _id: 'after' });
  const cur = await open([{ $changeStream: { startAtOperationTime: read.operationTime } }]);
  const ev = [...cur.firstBatch];
  if (!ev.some((e) => e.documentKey._id === 'after')) ev.push(...await take(cur.id, 1));
  // startAtOperationTime is inclusive: the write the read observed may be
  // replayed (the stand-in's operationTime is that write's own time); every
  // later write is there.
  const ids = ev.map((e) => e.documentKey._id);
  assert.equal(ids[ids.length - 1], 'after');
  assert.ok(ids.every((id) => id === 'before' || id === 'after'), ids.join());
  if (!env.external) assert.deepEqual(ids, ['before', 'after']);
  await db.command({ killCursors: 'c', cursors: [cur.id] });
});

test('fullDocument updateLookup and a later $match stage', async () => {
  const cur = await open([{ $changeStream: { fullDocument: 'updateLookup' } }, { $match: { operationType: 'update', 'documentKey._id': 'watched' } }]);
  const c = db.collection('c');
  await c.insertOne({ _id: 'watched', v: 1 });
  await c.insertOne({ _id: 'other', v: 1 });
  await c.updateOne({ _id: 'other' }, { $set: { v: 2 } });
  await c.updateOne({ _id: 'watched' }, { $set: { v: 3 } });
  const ev = await take(cur.id, 1);
  assert.equal(ev.length, 1);
  assert.equal(ev[0].operationType, 'update');
  assert.deepEqual(ev[0].fullDocument, { _id: 'watched', v: 3 });
  await db.command({ killCursors: 'c', cursors: [cur.id] });
});

test('getMore waits up to maxTimeMS, then answers an empty batch with the same cursor id', async () => {
  const cur = await open([{ $changeStream: {} }]);
  const t0 = Date.now();
  const r = await more(cur.id, 300);
  const waited = Date.now() - t0;
  assert.equal(r.nextBatch.length, 0);
  assert.equal(r.id.toString(), cur.id.toString());
  assert.ok(r.postBatchResumeToken._data);
  assert.ok(waited >= 250, `returned after ${waited} ms`);
  await db.command({ killCursors: 'c', cursors: [cur.id] });
});

test('getMore answers as soon as an event arrives, not at maxTimeMS', async () => {
  const cur = await open([{ $changeStream: {} }]);
  const pending = more(cur.id, 20000);
  // the write goes over another connection while the getMore waits
  const other = env.client.db(db.databaseName).collection('c');
  const t0 = Date.now();
  setTimeout(() => { other.insertOne({ _id: 'wake' }).catch(() => {}); }, 50);
  const r = await pending;
  assert.equal(r.nextBatch.length, 1);
  assert.equal(r.nextBatch[0].documentKey._id, 'wake');
  assert.ok(Date.now() - t0 < 10000, 'woken by the event');
  await db.command({ killCursors: 'c', cursors: [cur.id] });
});

// Several getMores wait at once, on streams whose $match tells apart the
// documents of one write: each is answered with its own event (one that
// its $match filters out does not end its wait), and the writer's reply
// comes too.
test('one write wakes each waiting getMore whose $match it passes, with that event only', async () => {
  const c = db.collection('c');
  const streams = {}, sessions = {};
  for (const k of ['wa', 'wb', 'wz']) {
    sessions[k] = env.client.startSession();
    streams[k] = await open([{ $changeStream: {} }, { $match: { 'documentKey._id': k } }], {}, sessions[k]);
  }
  const t0 = Date.now();
  const answered = (p) => p.then((r) => Object.assign(r, { after: Date.now() - t0 }));
  const pa = answered(more(streams.wa.id, 20000, sessions.wa)), pb = answered(more(streams.wb.id, 20000, sessions.wb));
  const pz = more(streams.wz.id, 1500, sessions.wz);
  await new Promise((r) => setTimeout(r, 100));
  const w = await c.insertMany([{ _id: 'wb', n: 1 }, { _id: 'wa', n: 2 }]);
  assert.equal(w.insertedCount, 2);
  const [ra, rb, rz] = await Promise.all([pa, pb, pz]);
  // woken by their events, not answered at maxTimeMS (20 s)
  assert.ok(ra.after < 10000 && rb.after < 10000, `answered after ${ra.after} and ${rb.after} ms`);
  assert.deepEqual(ra.nextBatch.map((e) => [e.operationType, e.documentKey._id, e.fullDocument.n]), [['insert', 'wa', 2]]);
  assert.deepEqual(rb.nextBatch.map((e) => [e.operationType, e.documentKey._id, e.fullDocument.n]), [['insert', 'wb', 1]]);
  assert.deepEqual(rz.nextBatch, []);
  assert.equal(rz.id.toString(), streams.wz.id.toString());
  for (const k of Object.keys(streams)) {
    await db.command({ killCursors: 'c', cursors: [streams[k].id] });
    await sessions[k].endSession();
  }
});

// A write of several documents while a getMore waits: every event reaches
// the stream once, in the order written, over as many getMores as it takes.
test('a multi-document update while a getMore waits: every event once, in order', async () => {
  const c = db.collection('c');
  await c.insertMany([{ _id: 'm1', g: 'multi' }, { _id: 'm2', g: 'multi' }, { _id: 'm3', g: 'multi' }]);
  const session = env.client.startSession();
  const cur = await open([{ $changeStream: {} }, { $match: { operationType: 'update', 'documentKey._id': { $in: ['m1', 'm2', 'm3'] } } }], {}, session);
  const t0 = Date.now();
  const pending = more(cur.id, 20000, session);
  await new Promise((r) => setTimeout(r, 100));
  const u = await c.updateMany({ g: 'multi' }, { $set: { v: 1 } });
  assert.equal(u.modifiedCount, 3);
  const got = [...(await pending).nextBatch];
  assert.ok(Date.now() - t0 < 10000, 'woken by the events, not at maxTimeMS');
  for (let i = 0; i < 10 && got.length < 3; i++) got.push(...(await more(cur.id, 500, session)).nextBatch);
  assert.deepEqual(got.map((e) => [e.documentKey._id, e.updateDescription.updatedFields.v]), [['m1', 1], ['m2', 1], ['m3', 1]]);
  for (let i = 1; i < got.length; i++) assert.ok(got[i].clusterTime.greaterThan(got[i - 1].clusterTime));
  assert.deepEqual((await more(cur.id, 200, session)).nextBatch, []);
  await db.command({ killCursors: 'c', cursors: [cur.id] });
  await session.endSession();
});

test('a no-op update produces no event', async () => {
  const c = db.collection('c');
  await c.insertOne({ _id: 'noop', owner: 'x' });
  const cur = await open([{ $changeStream: {} }]);
  await c.updateOne({ _id: 'noop' }, [{ $set: { owner: '$owner' } }]);
  await c.updateOne({ _id: 'noop' }, { $set: { owner: 'x' } });
  await c.insertOne({ _id: 'marker' });
  const ev = await take(cur.id, 1);
  assert.deepEqual(ev.map((e) => [e.operationType, e.documentKey._id]), [['insert', 'marker']]);
  await db.command({ killCursors: 'c', cursors: [cur.id] });
});

test('the Node.js driver ChangeStream API works and resumes', async () => {
  const c = db.collection('c');
  const stream = c.watch([], { maxAwaitTimeMS: 200 });
  await stream.tryNext(); // opens the cursor
  await c.insertOne({ _id: 'drv' });
  let change = null;
  for (let i = 0; i < 20 && !change; i++) change = await stream.tryNext();
  assert.equal(change.operationType, 'insert');
  assert.equal(change.documentKey._id, 'drv');
  const token = stream.resumeToken;
  await stream.close();
  await c.insertOne({ _id: 'drv2' });
  const s2 = c.watch([], { resumeAfter: token, maxAwaitTimeMS: 200 });
  let c2 = null;
  for (let i = 0; i < 20 && !c2; i++) c2 = await s2.tryNext();
  assert.equal(c2.documentKey._id, 'drv2');
  await s2.close();
});

test('bad change stream options are refused', async () => {
  await assert.rejects(open([{ $changeStream: { bogus: 1 } }]), (e) => e.code === 40415);
  await assert.rejects(open([{ $match: {} }, { $changeStream: {} }]), (e) => typeof e.code === 'number');
  await assert.rejects(db.command({ getMore: Long.fromNumber(123456789), collection: 'c' }), (e) => e.code === 43);
});

// mongod 4.4+ puts the NonResumableChangeStreamError label on the errors of
// that category of its error_codes.yml (280 ChangeStreamFatalError, 286
// ChangeStreamHistoryLost); drivers read labels, not codes, to decide
// whether to resume. As in mongod's jstests/change_streams/error_label.js:
// a stage that removes the resume token fails the getMore with 280.
test('errors 280 and 286 carry the NonResumableChangeStreamError label', async () => {
  const cur = await open([{ $changeStream: {} }, { $project: { _id: 0 } }]);
  await db.collection('c').insertOne({ _id: 'label' });
  await assert.rejects((async () => { for (let i = 0; i < 10; i++) await more(cur.id); })(),
    (e) => e.code === 280 && e.codeName === 'ChangeStreamFatalError' &&
      (e.errorLabels || []).includes('NonResumableChangeStreamError'));
  const admin = env.client.db('admin');
  try {
    for (const code of [280, 286]) {
      const cs = await open([{ $changeStream: {} }]);
      await admin.command({ configureFailPoint: 'failCommand', mode: { times: 1 }, data: { failCommands: ['getMore'], errorCode: code } });
      await assert.rejects(more(cs.id, 10), (e) => e.code === code &&
        (e.errorLabels || []).includes('NonResumableChangeStreamError'), `code ${code}`);
    }
    // other errors of a change stream are not labelled so
    const cs = await open([{ $changeStream: {} }]);
    await admin.command({ configureFailPoint: 'failCommand', mode: { times: 1 }, data: { failCommands: ['getMore'], errorCode: 2 } });
    await assert.rejects(more(cs.id, 10), (e) => e.code === 2 && !(e.errorLabels || []).includes('NonResumableChangeStreamError'));
  } finally {
    await admin.command({ configureFailPoint: 'failCommand', mode: 'off' });
  }
});

// mongod parses the pipeline before it checks what a change stream allows:
// an unknown stage name is 40324 (Unrecognized pipeline stage name), a
// known stage that a change stream does not allow is 20 (IllegalOperation)
test('an unknown stage after $changeStream is 40324; a known stage it does not allow is 20', async () => {
  await assert.rejects(open([{ $changeStream: {} }, { $noSuchStage: {} }]),
    (e) => e.code === 40324 && /Unrecognized pipeline stage name: '\$noSuchStage'/.test(e.message));
  await assert.rejects(open([{ $changeStream: {} }, { $group: { _id: null } }, { $noSuchStage: {} }]), (e) => e.code === 40324);
  await assert.rejects(open([{ $changeStream: {} }, { $group: { _id: null } }]), (e) => e.code === 20);
  await assert.rejects(open([{ $changeStream: {} }, { $sort: { a: 1 } }]), (e) => e.code === 20);
});

// updateDescription as mongod 5.0+ reports it. A pipeline update is logged
// as the delta of mongod's document_diff_calculator.cpp (computeOplogDiff,
// called by pipeline_executor.cpp with 15 bytes of padding), which the
// change stream turns into dotted paths, removedFields and truncatedArrays
// (change_stream_document_diff_parser.cpp); when that delta is not smaller
// than the new document, the update is logged as the whole document and the
// event is a replace. An update with operators reports what each operator
// wrote (a $push onto a non-empty array: the appended elements).
test('updateDescription: dotted paths inside arrays and embedded documents, truncatedArrays, replace for a large delta', async () => {
  const c = db.collection('c');
  const long = 'x'.repeat(200);
  const q = (ws) => ws.map((w) => ({ w, t: long.slice(0, 16), p: false }));
  await c.insertOne({ _id: 'ud', owner: null, e: { x: 1, y: long }, queue: q(['a', 'b', 'c']), next: null });
  const cur = await open([{ $changeStream: {} }, { $match: { 'documentKey._id': 'ud' } }]);
  const upd = (u) => c.updateOne({ _id: 'ud' }, u);
  const entry = { w: 'd', t: long.slice(0, 16), p: false };
  // pipelines: an element appended, the array cut at the end, a field of an
  // embedded document, an element's field in the middle of the array
  await upd([{ $set: { queue: { $concatArrays: ['$queue', [{ $literal: entry }]] } } }]);
  await upd([{ $set: { queue: { $filter: { input: '$queue', cond: { $in: ['$$this.w', ['a', 'b']] } } } } }]);
  await upd([{ $set: { 'e.x': 2 } }]);
  await upd([{ $set: { queue: { $map: { input: '$queue', in: { $cond: [{ $eq: ['$$this.w', 'b'] },
    { $mergeObjects: ['$$this', { p: true }] }, '$$this'] } } } } }]);
  await upd([{ $set: { next: 'n1', owner: 'o1' } }]);
  // operators
  await upd({ $push: { queue: entry } });
  await upd({ $set: { 'e.x': 3 } });
  await upd({ $set: { queue: q(['z']) } });
  await upd({ $unset: { 'e.x': '' } });
  const ev = (await take(cur.id, 9)).map((e) => [e.operationType, e.updateDescription]);
  assert.deepEqual(ev, [
    ['update', { updatedFields: { 'queue.3': entry }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: {}, removedFields: [], truncatedArrays: [{ field: 'queue', newSize: 2 }] }],
    ['update', { updatedFields: { 'e.x': 2 }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: { 'queue.1.p': true }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: { owner: 'o1', next: 'n1' }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: { 'queue.2': entry }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: { 'e.x': 3 }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: { queue: q(['z']) }, removedFields: [], truncatedArrays: [] }],
    ['update', { updatedFields: {}, removedFields: ['e.x'], truncatedArrays: [] }],
  ]);
  // a small document most of which a pipeline rewrites: logged whole, a replace
  await c.insertOne({ _id: 'small', a: 1 });
  const cur2 = await open([{ $changeStream: {} }, { $match: { 'documentKey._id': 'small' } }]);
  await c.updateOne({ _id: 'small' }, [{ $set: { a: 2, b: 'x' } }]);
  await c.updateOne({ _id: 'small' }, { $set: { a: 3 } });
  const [r1, r2] = await take(cur2.id, 2);
  assert.equal(r1.operationType, 'replace');
  assert.deepEqual(r1.fullDocument, { _id: 'small', a: 2, b: 'x' });
  assert.equal(r2.operationType, 'update');
  assert.deepEqual(r2.updateDescription, { updatedFields: { a: 3 }, removedFields: [], truncatedArrays: [] });
});

// Whatever form an update event takes, its updateDescription applied to the
// document before the write gives the document after it (dotted paths into
// arrays, removedFields, truncatedArrays), and a replace carries the whole
// new document: checked on a lock-like queue that loses its head, grows, has
// an element rewritten and is cut, beside a large field that never changes.
test('updateDescription applied to the previous version gives the new one, for queue rewrites', async () => {
  const c = db.collection('c');
  const entry = (i) => ({ w: `w${i}`.padEnd(32, '0'), t: `t${i}`.padEnd(16, '0'), until: new Date(1e12 + i), p: false });
  await c.insertOne({ _id: 'q', owner: 'o0', queue: Array.from({ length: 12 }, (_, i) => entry(i)), next: null, big: 'b'.repeat(2000) });
  const cur = await open([{ $changeStream: {} }, { $match: { 'documentKey._id': 'q' } }]);
  const steps = [
    [{ $set: { owner: { $arrayElemAt: ['$queue.w', 0] }, queue: { $filter: { input: '$queue', cond: { $ne: ['$$this.w', { $arrayElemAt: ['$queue.w', 0] }] } } } } }],
    [{ $set: { queue: { $concatArrays: ['$queue', [{ $literal: entry(20) }, { $literal: entry(21) }]] } } }],
    [{ $set: { queue: { $map: { input: '$queue', in: { $cond: [{ $eq: ['$$this.w', entry(5).w] }, { $mergeObjects: ['$$this', { p: true }] }, '$$this'] } } } } }],
    [{ $set: { queue: { $slice: ['$queue', 3] }, next: 'n1' } }],
    [{ $set: { queue: [], owner: null } }, { $unset: 'next' }],
  ];
  const versions = [await c.findOne({ _id: 'q' })];
  for (const u of steps) {
    await c.updateOne({ _id: 'q' }, u);
    versions.push(await c.findOne({ _id: 'q' }));
  }
  const events = await take(cur.id, steps.length);
  assert.equal(events.length, steps.length);
  const setPath = (doc, path, v) => {
    const parts = path.split('.');
    let o = doc;
    for (const p of parts.slice(0, -1)) o = o[p];
    o[parts[parts.length - 1]] = v;
  };
  events.forEach((e, i) => {
    if (e.operationType === 'replace') { assert.deepEqual(e.fullDocument, versions[i + 1]); return; }
    assert.equal(e.operationType, 'update');
    const doc = structuredClone(versions[i]);
    const d = e.updateDescription;
    for (const t of d.truncatedArrays) setPath(doc, t.field, doc[t.field].slice(0, t.newSize));
    for (const f of Object.keys(d.updatedFields)) setPath(doc, f, d.updatedFields[f]);
    for (const f of d.removedFields) delete doc[f];
    assert.deepEqual(doc, versions[i + 1], `event ${i}: ${JSON.stringify(d)}`);
  });
  // the head removed: every element moved, so the whole queue is reported
  assert.deepEqual(Object.keys(events[0].updateDescription.updatedFields).sort(), ['owner', 'queue']);
  // elements appended: reported by index
  assert.deepEqual(Object.keys(events[1].updateDescription.updatedFields), ['queue.11', 'queue.12']);
  assert.deepEqual(events[3].updateDescription.truncatedArrays, [{ field: 'queue', newSize: 3 }]);
  await db.command({ killCursors: 'c', cursors: [cur.id] });
});

test('a $match of $or branches then $project: streams share the match and each projects its own copy', async () => {
  const match = (tag) => ({ $match: { $or: [
    { operationType: 'delete' },
    { operationType: 'update', 'updateDescription.updatedFields.next': { $regex: `^${tag}` } },
  ] } });
  const project = { $project: { operationType: 1, documentKey: 1, 'updateDescription.updatedFields.next': 1 } };
  const a = await open([{ $changeStream: {} }, match('a'), project]);
  const b = await open([{ $changeStream: {} }, match('b'), project]);
  const all = await open([{ $changeStream: {} }, match('a')]);
  const c = db.collection('c');
  // (pad: a diff much smaller than the document, so that mongod logs an
  // update, not a replace)
  await c.insertOne({ _id: 'p', next: null, queue: [1, 2, 3], pad: 'x'.repeat(200) });
  await c.updateOne({ _id: 'p' }, [{ $set: { next: 'a1', queue: [2, 3] } }]);
  await c.updateOne({ _id: 'p' }, [{ $set: { next: 'b1', queue: [3] } }]);
  await c.deleteOne({ _id: 'p' });
  const ea = await take(a.id, 2), eb = await take(b.id, 2), eall = await take(all.id, 2);
  assert.deepEqual(ea.map((e) => e.operationType), ['update', 'delete']);
  assert.deepEqual(ea[0].updateDescription, { updatedFields: { next: 'a1' } });
  assert.deepEqual(Object.keys(ea[0]), ['_id', 'operationType', 'documentKey', 'updateDescription']);
  assert.deepEqual(eb[0].updateDescription, { updatedFields: { next: 'b1' } });
  assert.deepEqual(eb[1].documentKey, { _id: 'p' });
  // the same event, unprojected, in a stream of the $match alone: the
  // projections above took nothing from it
  assert.equal(eall[0].updateDescription.updatedFields.next, 'a1');
  assert.ok('queue' in eall[0].updateDescription.updatedFields || eall[0].updateDescription.truncatedArrays.length);
  assert.ok(eall[0].clusterTime && eall[0].ns);
  assert.equal(ea[1]._id._data, eall[1]._id._data);
});

// An update's event is the same in every stream, whichever read it first:
// a stream that projects a few fields of updatedFields, one that sends the
// event whole, one that keeps updateDescription whole in its $project and
// one whose $match looks at updatedFields itself all see what mongod
// reports (the fields under the array's elements included).
test('an update event read first by a projecting stream is whole in the streams that read it whole', async () => {
  const c = db.collection('c');
  const same = 'same'.repeat(10);
  const q = (ws) => ws.map(([w, t]) => ({ w, t, p: false, h: same }));
  await c.insertOne({ _id: 'lz', next: null, queue: q([['a', 'x1'], ['b', 'x2'], ['c', 'x3']]), pad: 'x'.repeat(300) });
  const m = { $match: { 'documentKey._id': 'lz' } };
  const proj = await open([{ $changeStream: {} }, m, { $project: { operationType: 1, 'updateDescription.updatedFields.next': 1, 'updateDescription.truncatedArrays': 1 } }]);
  const all = await open([{ $changeStream: {} }, m]);
  const whole = await open([{ $changeStream: {} }, m, { $project: { updateDescription: 1 } }]);
  const byFields = await open([{ $changeStream: {} }, { $match: { 'updateDescription.updatedFields': { $exists: true } } }]);
  await c.updateOne({ _id: 'lz' }, [{ $set: { next: 'a1', queue: { $slice: ['$queue', 1, 2] } } }]);
  const [ep] = await take(proj.id, 1);
  const [ea] = await take(all.id, 1);
  const [ew] = await take(whole.id, 1);
  const [eb] = await take(byFields.id, 1);
  const full = {
    updatedFields: { next: 'a1', 'queue.0.w': 'b', 'queue.0.t': 'x2', 'queue.1.w': 'c', 'queue.1.t': 'x3' },
    removedFields: [],
    truncatedArrays: [{ field: 'queue', newSize: 2 }],
  };
  assert.deepEqual(ep.updateDescription, { updatedFields: { next: 'a1' }, truncatedArrays: full.truncatedArrays });
  assert.deepEqual(ea.updateDescription, full);
  assert.deepEqual(Object.keys(ea.updateDescription.updatedFields), Object.keys(full.updatedFields));
  assert.deepEqual(ew.updateDescription, full);
  assert.deepEqual(eb.updateDescription, full);
  await db.command({ killCursors: 'c', cursors: [proj.id, all.id, whole.id, byFields.id] });
});
