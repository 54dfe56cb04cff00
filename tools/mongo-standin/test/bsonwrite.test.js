'use strict';
// lib/bsonwrite.js encodes replies itself: for every value it accepts it
// must write exactly the bytes bson's serialize writes, and hand every
// other value back to bson (-1). No server is involved.

const { test } = require('node:test');
const assert = require('node:assert/strict');
const BSON = require('bson');
const { encodeInto, encodeWithBson } = require('../lib/bsonwrite');

const { Int32, Double, Long, Timestamp, ObjectId, Binary, Decimal128, MinKey, MaxKey, BSONRegExp, BSONSymbol, Code, UUID } = BSON;

function mine(body, room = 1 << 16, at = 21) {
  const buf = Buffer.alloc(room);
  const end = encodeInto(body, buf, at);
  return end < 0 ? null : buf.subarray(at, end);
}

const SAME = [
  { ok: 1 },
  {},
  { a: 'x', b: '', c: 'é€😀', d: 'lone \ud800 surrogate', e: 'nul \u0000 inside a value' },
  { n: [0, -0, 1, -1, 2147483647, 2147483648, -2147483648, -2147483649, 1.5, NaN, Infinity, -Infinity, 2 ** 53, 2 ** 53 + 2, 1e300] },
  { t: true, f: false, z: null, u: undefined, arr: [undefined, null, 1, [2, [3, {}]], { x: undefined }] },
  { d: [new Date(0), new Date(-1), new Date(1795664980123), new Date(-62135596800000), new Date(8.64e15), new Date(-8.64e15)] },
  { i: new Int32(-5), db: new Double(1), db2: new Double(-0), l: Long.fromNumber(-1), l2: Long.fromString('9223372036854775807'), lu: Long.fromBits(1, 2, true) },
  { ts: Timestamp.fromBits(7, 1795664980), oid: new ObjectId('7fffffff0000000000000001'), uuid: new UUID('0123456789abcdef0123456789abcdef') },
  { b: new Binary(Buffer.from('abc'), 0), b4: new Binary(Buffer.alloc(16, 7), 4), big: new Binary(Buffer.alloc(100, 1), 0), empty: new Binary(Buffer.alloc(0), 5) },
  { 'dotted.key': 1, $db: 'x', $clusterTime: { a: 1 }, $ref: 'r', $id: 2, 'ключ': 'v', 10: 'index', 2: 'first' },
  { cursor: { nextBatch: [{ _id: { _data: '82' }, operationType: 'update', updateDescription: { updatedFields: { 'queue.0.w': 'w', 'h.pid': new Int32(3) }, removedFields: [], truncatedArrays: [{ field: 'queue', newSize: new Int32(2) }] } }], id: Long.fromNumber(1795664980222001), ns: 'd.c' }, ok: 1 },
];

test('documents of the accepted types are written byte for byte as bson writes them', () => {
  for (const body of SAME) {
    const got = mine(body);
    assert.ok(got, `encoded itself: ${JSON.stringify(Object.keys(body))}`);
    assert.deepEqual(Buffer.from(got), Buffer.from(encodeWithBson(body)), JSON.stringify(Object.keys(body)));
  }
  // a Binary whose buffer is larger than its contents
  const b = new Binary(Buffer.alloc(64), 0);
  b.write(Buffer.from('0123456789abcdefghijklmnop'), 0);
  assert.deepEqual(Buffer.from(mine({ b })), Buffer.from(encodeWithBson({ b })));
});

test('everything else is left to bson', () => {
  const OTHER = [
    { d: new Decimal128('1.5') }, { m: new MinKey() }, { m: new MaxKey() }, { r: new BSONRegExp('a', 'i') },
    { r: /a/ }, { s: new BSONSymbol('x') }, { c: new Code('x') }, { b: new Binary(Buffer.from('ab'), 2) },
    { big: 5n }, { buf: Buffer.from('x') }, { f: () => 1 }, { m: new Map([['a', 1]]) }, { n: Object.create(null) },
    { 'nul\u0000key': 1 }, { bad: new Date(NaN) }, { t: { toBSON: () => ({ a: 1 }) } },
  ];
  for (const body of OTHER) assert.equal(mine(body), null, Object.keys(body)[0]);
  for (const root of [[1], new Date(0), Long.fromNumber(1), null, 'x', Object.create(null), { toBSON: () => ({}) }]) {
    assert.equal(encodeInto(root, Buffer.alloc(64), 0), -1);
  }
  // nested too deep for a reply, and not enough room
  let deep = { x: 1 };
  for (let i = 0; i < 100; i++) deep = { d: deep };
  assert.equal(mine(deep), null);
  assert.equal(mine({ s: 'x'.repeat(100) }, 80), null);
  // the NUL check applies to keys of documents but not to $db, $ref, $id, $clusterTime
  assert.ok(mine({ $db: 'a' }));
});
