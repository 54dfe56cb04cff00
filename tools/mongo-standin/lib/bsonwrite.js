'use strict';
// Reply encoding: writes a reply document into a buffer with exactly the
// bytes bson's serialize (ignoreUndefined, checkKeys off) writes, for the
// values replies are made of: documents, arrays, strings, numbers,
// booleans, null, dates, Int32, Double, Long, Timestamp, ObjectId and
// Binary. Anything else (other BSON types, toBSON, keys with a NUL byte,
// values of another bson version, no room left) answers null, and the
// caller encodes the reply with bson itself, which writes the same bytes or
// throws the same error.

const BSON = require('bson');

const VERSION = Symbol.for('@@mdb.bson.version');
const MAJOR = 6;
const FALLBACK = Symbol('fallback');
const OBJECT_PROTO = Object.prototype;
const TWO32 = 4294967296;

let buf = null;
let pos = 0;
let end = 0;
let depth = 0;
// (deeper than replies go: bson checks for cycles)
const MAX_DEPTH = 64;

function need(n) {
  if (pos + n > end) throw FALLBACK;
}

// a key or string's UTF-8 bytes at pos (no NUL check)
function writeUtf8(s) {
  const n = s.length;
  need(n * 3 + 1);
  let ascii = true;
  for (let i = 0; i < n; i++) {
    const c = s.charCodeAt(i);
    if (c > 0x7f) { ascii = false; break; }
    buf[pos + i] = c;
  }
  if (ascii) { pos += n; return n; }
  const w = buf.utf8Write(s, pos);
  pos += w;
  return w;
}

function writeKey(type, key, checkNul) {
  if (checkNul && key.indexOf('\u0000') >= 0) throw FALLBACK;
  need(1);
  buf[pos++] = type;
  writeUtf8(key);
  need(1);
  buf[pos++] = 0;
}

function writeInt32(v) {
  need(4);
  buf.writeInt32LE(v, pos);
  pos += 4;
}

// one element (key, value); false when nothing is written (undefined)
function element(key, v, inArray) {
  const checkNul = !inArray && key !== '$db' && key !== '$ref' && key !== '$id' && key !== '$clusterTime';
  if (v !== null && v !== undefined && typeof v.toBSON === 'function') throw FALLBACK;
  switch (typeof v) {
    case 'undefined':
      if (!inArray) return;
      writeKey(0x0a, key, checkNul);
      return;
    case 'string': {
      writeKey(0x02, key, checkNul);
      need(4);
      const at = pos;
      pos += 4;
      const n = writeUtf8(v);
      buf.writeInt32LE(n + 1, at);
      need(1);
      buf[pos++] = 0;
      return;
    }
    case 'number':
      if (!Object.is(v, -0) && Number.isSafeInteger(v) && v <= 2147483647 && v >= -2147483648) {
        writeKey(0x10, key, checkNul);
        writeInt32(v);
      } else {
        writeKey(0x01, key, checkNul);
        need(8);
        buf.writeDoubleLE(v, pos);
        pos += 8;
      }
      return;
    case 'boolean':
      writeKey(0x08, key, checkNul);
      need(1);
      buf[pos++] = v ? 1 : 0;
      return;
    case 'object': break;
    default: throw FALLBACK;
  }
  if (v === null) { writeKey(0x0a, key, checkNul); return; }
  const t = v._bsontype;
  if (t == null) {
    const proto = Object.getPrototypeOf(v);
    if (proto === OBJECT_PROTO) {
      writeKey(0x03, key, checkNul);
      doc(v, false);
      return;
    }
    if (Array.isArray(v)) {
      writeKey(0x04, key, checkNul);
      doc(v, true);
      return;
    }
    if (v instanceof Date) {
      const ms = v.getTime();
      if (!Number.isSafeInteger(ms)) throw FALLBACK;
      writeKey(0x09, key, checkNul);
      const high = Math.floor(ms / TWO32);
      need(8);
      buf.writeUInt32LE(ms - high * TWO32, pos);
      buf.writeInt32LE(high, pos + 4);
      pos += 8;
      return;
    }
    throw FALLBACK;
  }
  if (v[VERSION] !== MAJOR) throw FALLBACK;
  switch (t) {
    case 'Int32':
      writeKey(0x10, key, checkNul);
      writeInt32(v.valueOf());
      return;
    case 'Double':
      writeKey(0x01, key, checkNul);
      need(8);
      buf.writeDoubleLE(v.value, pos);
      pos += 8;
      return;
    case 'Long': case 'Timestamp':
      writeKey(t === 'Long' ? 0x12 : 0x11, key, checkNul);
      writeInt32(v.getLowBits());
      writeInt32(v.getHighBits());
      return;
    case 'ObjectId':
      writeKey(0x07, key, checkNul);
      need(12);
      pos += v.serializeInto(buf, pos);
      return;
    case 'Binary': {
      // (the old binary subtype and vectors: bson's own rules)
      if (v.sub_type === 2 || v.sub_type === 9) throw FALLBACK;
      writeKey(0x05, key, checkNul);
      const size = v.position;
      need(5 + size);
      buf.writeInt32LE(size, pos);
      buf[pos + 4] = v.sub_type;
      pos += 5;
      const data = v.buffer;
      for (let i = 0; i < size; i++) buf[pos + i] = data[i];
      pos += size;
      return;
    }
    default: throw FALLBACK;
  }
}

function doc(o, isArray) {
  if (++depth > MAX_DEPTH) throw FALLBACK;
  need(4);
  const start = pos;
  pos += 4;
  if (isArray) {
    for (let i = 0; i < o.length; i++) element(`${i}`, o[i], true);
  } else {
    const keys = Object.keys(o);
    for (let i = 0; i < keys.length; i++) element(keys[i], o[keys[i]], false);
  }
  need(1);
  buf[pos++] = 0;
  buf.writeInt32LE(pos - start, start);
  depth--;
}

// Writes body (a plain object) into target at index; returns the index
// after its last byte, or -1 when bson must encode it.
function encodeInto(body, target, index) {
  if (body === null || typeof body !== 'object' || Object.getPrototypeOf(body) !== OBJECT_PROTO ||
      body._bsontype != null || typeof body.toBSON === 'function') return -1;
  buf = target;
  pos = index;
  end = target.length;
  depth = 0;
  try {
    doc(body, false);
    return pos;
  } catch (e) {
    if (e === FALLBACK) return -1;
    throw e;
  } finally {
    buf = null;
  }
}

// (bson's own encoder, for comparison in tests)
function encodeWithBson(body) {
  return BSON.serialize(body, { ignoreUndefined: true, checkKeys: false });
}

module.exports = { encodeInto, encodeWithBson };
