'use strict';
// BSON values as the engine holds them: documents are decoded with
// promoteValues:false, so every number keeps its BSON type (Int32, Double,
// Long, Decimal128) and is written back exactly as it came. Plain JS numbers
// only appear in values the server builds itself; they are read as int32 when
// integral and in range, else as double, which is what the serializer does.
//
// "Missing" is JS undefined throughout; null is BSON null.

const { Int32, Double, Long, Decimal128, ObjectId, Timestamp, Binary, BSONRegExp, MinKey, MaxKey } = require('bson');

const INT32_MIN = -2147483648;
const INT32_MAX = 2147483647;
const LONG_MIN = -(2n ** 63n);
const LONG_MAX = 2n ** 63n - 1n;

// Marks a value whose decoding is deferred (lazy.js); holds its type alias.
const LAZY = Symbol.for('mongo-standin.lazy');
// a template's parameter slot (expr.js Param): a value, never a document
const SLOT = Symbol.for('mongo-standin.slot');

// BSON type alias of a value, as $type reports it.
function typeName(v) {
  if (v === undefined) return 'missing';
  if (v === null) return 'null';
  switch (typeof v) {
    case 'string': return 'string';
    case 'boolean': return 'bool';
    case 'number': return Number.isInteger(v) && v >= INT32_MIN && v <= INT32_MAX ? 'int' : 'double';
    case 'bigint': return 'long';
    default: break;
  }
  // (a document the server decoded or built: the common case; a deferred
  // value is a Lazy, never an object literal)
  if (Object.getPrototypeOf(v) === Object.prototype && v._bsontype === undefined) return 'object';
  if (Array.isArray(v)) return 'array';
  if (v instanceof Date) return 'date';
  if (v[LAZY]) return v[LAZY];
  switch (v._bsontype) {
    case 'Int32': return 'int';
    case 'Double': return 'double';
    case 'Long': return 'long';
    case 'Decimal128': return 'decimal';
    case 'ObjectId': return 'objectId';
    case 'Timestamp': return 'timestamp';
    case 'Binary': return 'binData';
    case 'BSONRegExp': return 'regex';
    case 'BSONSymbol': return 'symbol';
    case 'Code': return 'javascript';
    case 'MinKey': return 'minKey';
    case 'MaxKey': return 'maxKey';
    case 'DBRef': return 'object';
    case 'UUID': return 'binData';
    default: break;
  }
  if (v instanceof RegExp) return 'regex';
  if (v instanceof Uint8Array) return 'binData';
  return 'object';
}

const TYPE_NUMBERS = {
  double: 1, string: 2, object: 3, array: 4, binData: 5, undefined: 6, objectId: 7, bool: 8, date: 9,
  null: 10, regex: 11, javascript: 13, symbol: 14, int: 16, timestamp: 17, long: 18, decimal: 19,
  minKey: -1, maxKey: 127,
};

// Canonical sort classes (MongoDB's BSON comparison order).
const CANON = {
  minKey: 1, missing: 2, null: 2, undefined: 2,
  int: 3, long: 3, double: 3, decimal: 3,
  symbol: 4, string: 4, object: 5, array: 6, binData: 7, objectId: 8, bool: 9, date: 10,
  timestamp: 11, regex: 12, javascript: 13, maxKey: 14,
};

function isNumber(v) {
  const t = typeName(v);
  return t === 'int' || t === 'long' || t === 'double' || t === 'decimal';
}

// Numeric value as a JS number (int64 beyond 2^53 loses precision here; exact
// paths use toBig).
function num(v) {
  if (typeof v === 'number') return v;
  if (typeof v === 'bigint') return Number(v);
  switch (v._bsontype) {
    case 'Int32': case 'Double': return v.value;
    case 'Long': return v.toNumber();
    case 'Decimal128': return Number(v.toString());
    default: return NaN;
  }
}

function toBig(v) {
  if (typeof v === 'bigint') return v;
  if (v && v._bsontype === 'Long') {
    // (Long.toBigInt goes through a decimal string)
    if (v.high === 0 || v.high === -1) {
      const n = v.high === 0 ? v.low >>> 0 : v.low - 0; // fits in 33 bits
      if (v.high === 0 || v.low < 0) return BigInt(v.high === 0 ? n : v.low);
    }
    const b = (BigInt(v.high) << 32n) | BigInt(v.low >>> 0);
    return v.unsigned ? BigInt.asUintN(64, b) : b;
  }
  const n = num(v);
  return BigInt(Math.trunc(n));
}

function isIntegral(v) {
  const t = typeName(v);
  return t === 'int' || t === 'long';
}

function makeInt(n) { return new Int32(n); }
function makeDouble(n) { return new Double(n); }
function makeLong(b) { return Long.fromBigInt(BigInt.asIntN(64, b)); }

// Integer result with MongoDB's widening: int32 when it fits and both inputs
// were int32, otherwise int64; beyond int64 the result becomes a double.
function intResult(b, wide) {
  if (!wide && b >= INT32_MIN && b <= INT32_MAX) return new Int32(Number(b));
  if (b >= LONG_MIN && b <= LONG_MAX) return Long.fromBigInt(b);
  return new Double(Number(b));
}

function compareNumbers(a, b) {
  const ta = typeName(a), tb = typeName(b);
  if ((ta === 'long' || ta === 'int') && (tb === 'long' || tb === 'int')) {
    const x = toBig(a), y = toBig(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  const x = num(a), y = num(b);
  if (Number.isNaN(x)) return Number.isNaN(y) ? 0 : -1; // NaN sorts before every number
  if (Number.isNaN(y)) return 1;
  if (ta === 'long' && Math.abs(y) >= 2 ** 53 && Number.isInteger(y)) {
    const p = toBig(a), q = BigInt(y);
    return p < q ? -1 : p > q ? 1 : 0;
  }
  if (tb === 'long' && Math.abs(x) >= 2 ** 53 && Number.isInteger(x)) {
    const p = BigInt(x), q = toBig(b);
    return p < q ? -1 : p > q ? 1 : 0;
  }
  return x < y ? -1 : x > y ? 1 : 0;
}

function cmpPrim(a, b) { return a < b ? -1 : a > b ? 1 : 0; }

function compareBytes(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return a[i] < b[i] ? -1 : 1;
  return cmpPrim(a.length, b.length);
}

function compareStrings(a, b) {
  // MongoDB compares strings by their UTF-8 bytes (simple binary collation),
  // which is the order of their code points. UTF-16 code units are in that
  // order too, except that a surrogate (U+10000 and up) sorts below
  // U+E000..U+FFFF: the first differing unit decides, surrogates moved up.
  if (a === b) return 0;
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    let x = a.charCodeAt(i), y = b.charCodeAt(i);
    if (x === y) continue;
    if (x >= 0xD800 && y >= 0xD800) {
      x = x >= 0xE000 ? x - 0x800 : x + 0x2000;
      y = y >= 0xE000 ? y - 0x800 : y + 0x2000;
    }
    return x < y ? -1 : 1;
  }
  return cmpPrim(a.length, b.length);
}

// Total order over BSON values (missing sorts with null, before everything
// but MinKey). Used for sorts, $min/$max, range matching within a type class.
function compare(a, b) {
  // two strings, two booleans or two dates (what a lock's pipelines and
  // queries compare most: ids, flags, expiry times) without their types
  const t = typeof a;
  if (t === 'string' && typeof b === 'string') return a === b ? 0 : compareStrings(a, b);
  if (t === 'boolean' && typeof b === 'boolean') return cmpPrim(a ? 1 : 0, b ? 1 : 0);
  if (a instanceof Date && b instanceof Date) return cmpPrim(a.getTime(), b.getTime());
  const ta = typeName(a), tb = typeName(b);
  const ca = CANON[ta], cb = CANON[tb];
  if (ca !== cb) return ca < cb ? -1 : 1;
  switch (ca) {
    case 1: case 2: case 14: return 0;
    case 3: return compareNumbers(a, b);
    case 4: return compareStrings(String(a.valueOf ? a.valueOf() : a), String(b.valueOf ? b.valueOf() : b));
    case 5: return compareDocs(a, b);
    case 6: return compareArrays(a, b);
    case 7: {
      const ba = binBytes(a), bb = binBytes(b);
      if (ba.length !== bb.length) return ba.length < bb.length ? -1 : 1;
      const sa = a.sub_type || 0, sb = b.sub_type || 0;
      if (sa !== sb) return sa < sb ? -1 : 1;
      return compareBytes(ba, bb);
    }
    case 8: return compareBytes(a.id, b.id);
    case 9: return cmpPrim(a ? 1 : 0, b ? 1 : 0);
    case 10: return cmpPrim(a.getTime(), b.getTime());
    case 11: {
      const x = a.toBigInt ? a.toBigInt() : BigInt(a.toString());
      const y = b.toBigInt ? b.toBigInt() : BigInt(b.toString());
      return x < y ? -1 : x > y ? 1 : 0;
    }
    case 12: {
      const c = compareStrings(a.pattern !== undefined ? a.pattern : a.source, b.pattern !== undefined ? b.pattern : b.source);
      if (c) return c;
      return compareStrings(a.options !== undefined ? a.options : a.flags, b.options !== undefined ? b.options : b.flags);
    }
    case 13: return compareStrings(a.code, b.code);
    default: return 0;
  }
}

function binBytes(v) {
  if (v instanceof Uint8Array) return v;
  if (v.buffer) return v.buffer.subarray(0, v.position !== undefined ? v.position : v.buffer.length);
  return new Uint8Array(0);
}

function compareDocs(a, b) {
  const ka = Object.keys(a), kb = Object.keys(b);
  const n = Math.min(ka.length, kb.length);
  for (let i = 0; i < n; i++) {
    const va = a[ka[i]], vb = b[kb[i]];
    const ca = CANON[typeName(va)], cb = CANON[typeName(vb)];
    if (ca !== cb) return ca < cb ? -1 : 1;
    const c = compareStrings(ka[i], kb[i]);
    if (c) return c;
    const d = compare(va, vb);
    if (d) return d;
  }
  return cmpPrim(ka.length, kb.length);
}

function compareArrays(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    const c = compare(a[i], b[i]);
    if (c) return c;
  }
  return cmpPrim(a.length, b.length);
}

// Equality as $eq sees it: numbers by value across types, documents field by
// field in order.
function equals(a, b) {
  if (a === b) return true;
  const ta = typeName(a), tb = typeName(b);
  if (CANON[ta] !== CANON[tb]) return false;
  if ((ta === 'missing') !== (tb === 'missing')) return false;
  return compare(a, b) === 0;
}

// Strict identity used for no-op detection: same BSON types, same values.
function identical(a, b) {
  if (a === b) return true;
  const ta = typeName(a), tb = typeName(b);
  if (ta !== tb) return false;
  switch (ta) {
    case 'object': {
      const ka = Object.keys(a), kb = Object.keys(b);
      if (ka.length !== kb.length) return false;
      for (let i = 0; i < ka.length; i++) {
        if (ka[i] !== kb[i] || !identical(a[ka[i]], b[kb[i]])) return false;
      }
      return true;
    }
    case 'array':
      if (a.length !== b.length) return false;
      for (let i = 0; i < a.length; i++) if (!identical(a[i], b[i])) return false;
      return true;
    case 'double': {
      const x = num(a), y = num(b);
      return Object.is(x, y) || (x === y);
    }
    case 'string': return false; // (a === b above)
    case 'long':
      if (a._bsontype === 'Long' && b._bsontype === 'Long' && !!a.unsigned === !!b.unsigned) return a.high === b.high && a.low === b.low;
      return compare(a, b) === 0;
    case 'date': {
      const x = a.getTime(), y = b.getTime();
      if (x === x && y === y) return x === y; // (NaN: as compare orders it)
      return compare(a, b) === 0;
    }
    case 'decimal': return a.toString() === b.toString();
    case 'binData': return (a.sub_type || 0) === (b.sub_type || 0) && compareBytes(binBytes(a), binBytes(b)) === 0;
    default: return compare(a, b) === 0;
  }
}

function isPlainDoc(v) {
  if (v === null || typeof v !== 'object') return false;
  // an object literal (neither an array, a Date, a Uint8Array nor a RegExp)
  if (Object.getPrototypeOf(v) === Object.prototype) return v._bsontype === undefined; // (a Lazy is not one)
  return !Array.isArray(v) && !(v instanceof Date) && !v[LAZY] && !v[SLOT] &&
    v._bsontype === undefined && !(v instanceof Uint8Array) && !(v instanceof RegExp);
}

// a document of fields (a projection's or $set's sub-object), not an
// operator expression: not empty, its first name not starting with '$'
function isFieldsDoc(v) {
  if (!isPlainDoc(v)) return false;
  const keys = Object.keys(v);
  return keys.length > 0 && keys[0][0] !== '$';
}

// Deep copy of documents and arrays; BSON value objects are immutable in the
// engine and shared.
function clone(v) {
  if (Array.isArray(v)) return v.map(clone);
  if (isPlainDoc(v)) {
    const o = {};
    for (const k of Object.keys(v)) o[k] = clone(v[k]);
    return o;
  }
  return v;
}

function truthy(v) {
  if (v === undefined || v === null || v === false) return false;
  if (isNumber(v)) return num(v) !== 0;
  return true;
}

// A short rendering of a value for error messages ("dup key: { _id: "a" }").
function render(v) {
  const t = typeName(v);
  switch (t) {
    case 'missing': return 'undefined';
    case 'null': return 'null';
    case 'string': return JSON.stringify(v);
    case 'int': case 'double': return String(num(v));
    case 'long': return String(v);
    case 'decimal': return v.toString();
    case 'bool': return String(v);
    case 'date': return `new Date(${v.getTime()})`;
    case 'objectId': return `ObjectId('${v.toHexString()}')`;
    case 'timestamp': return `Timestamp(${v.high}, ${v.low})`;
    case 'array': return `[ ${v.map(render).join(', ')} ]`;
    case 'object': {
      const ks = Object.keys(v);
      if (!ks.length) return '{}';
      return `{ ${ks.map((k) => `${k}: ${render(v[k])}`).join(', ')} }`;
    }
    default: return String(v);
  }
}

// Reads a dotted path; arrays along the path are not traversed (callers that
// need MongoDB's implicit array traversal use query.js).
function getPath(doc, path) {
  if (path.indexOf('.') < 0) return doc === null || typeof doc !== 'object' ? undefined : doc[path];
  let cur = doc;
  for (const part of path.split('.')) {
    if (cur === null || typeof cur !== 'object') return undefined;
    if (Array.isArray(cur)) {
      if (!/^\d+$/.test(part)) return undefined;
      cur = cur[Number(part)];
    } else if (isPlainDoc(cur)) {
      cur = Object.prototype.hasOwnProperty.call(cur, part) ? cur[part] : undefined;
    } else return undefined;
  }
  return cur;
}

module.exports = {
  Int32, Double, Long, Decimal128, ObjectId, Timestamp, Binary, BSONRegExp, MinKey, MaxKey,
  LAZY, SLOT, INT32_MIN, INT32_MAX, LONG_MIN, LONG_MAX, TYPE_NUMBERS, CANON,
  typeName, isNumber, num, toBig, isIntegral, makeInt, makeDouble, makeLong, intResult,
  compare, equals, identical, isPlainDoc, isFieldsDoc, clone, truthy, render, getPath, compareStrings,
};
