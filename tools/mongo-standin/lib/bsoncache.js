'use strict';
// Command decoding with a cache for the sub-documents that repeat from one
// command to the next (an acquire loop sends the same update pipeline,
// fields and query every time): top-level scalars are decoded directly, and
// documents/arrays under CACHED keys are decoded once per distinct byte
// string. Cached values are shared between commands, so the engine treats
// every command value as immutable (it copies before it modifies).
// Compiled forms are attached per value with memo(), so a repeated command
// also skips compilation.

const BSON = require('bson');
const { Lazy } = require('./lazy');
const { LAZY } = require('./values');

const DECODE = { promoteValues: false, promoteLongs: false, promoteBuffers: false, bsonRegExp: true };
const CACHED = new Set(['update', 'fields', 'query', 'filter', 'sort', 'projection', 'pipeline', 'q', 'u', 'lsid']);
const LIMIT = 4096;
let cache = new Map();

function decodeSub(buf, start, end, isArray) {
  const doc = BSON.deserialize(buf.subarray(start, end), DECODE);
  return isArray ? Object.values(doc) : doc;
}

function cachedSub(buf, start, end, isArray) {
  const key = (isArray ? 'a' : 'd') + buf.toString('latin1', start, end);
  let v = cache.get(key);
  if (v === undefined) {
    v = decodeSub(buf, start, end, isArray);
    if (cache.size >= LIMIT) cache = new Map();
    cache.set(key, v);
  }
  return v;
}

// decode(buf) -> the command document; falls back to the full decoder for
// top-level types it does not read itself.
function decode(buf, cacheable = true) {
  const size = buf.readInt32LE(0);
  if (size !== buf.length) throw new Error('BSON size mismatch');
  const out = {};
  let p = 4;
  const end = size - 1;
  while (p < end) {
    const type = buf[p++];
    const z = buf.indexOf(0, p);
    if (z < 0 || z >= end) throw new Error('bad BSON key');
    const name = buf.toString('utf8', p, z);
    p = z + 1;
    switch (type) {
      case 0x01: out[name] = new BSON.Double(buf.readDoubleLE(p)); p += 8; break;
      case 0x02: {
        const n = buf.readInt32LE(p);
        out[name] = buf.toString('utf8', p + 4, p + 4 + n - 1);
        p += 4 + n;
        break;
      }
      case 0x03: case 0x04: {
        const n = buf.readInt32LE(p);
        const isArray = type === 0x04;
        if (cacheable && isArray && (name === 'update' || name === 'u')) {
          out[name] = new Lazy(buf.subarray(p, p + n), true, 'pipeline');
          p += n;
          break;
        }
        if (name === '$clusterTime' && !isArray) {
          // gossiped by drivers, never read here: not decoded at all
          out[name] = new Lazy(buf.subarray(p, p + n), false, 'raw');
          p += n;
          break;
        }
        if (cacheable && !isArray && (name === 'fields' || name === 'projection')) {
          out[name] = new Lazy(buf.subarray(p, p + n), false, 'projection');
          p += n;
          break;
        }
        out[name] = cacheable && CACHED.has(name) ? cachedSub(buf, p, p + n, isArray) : decodeSub(buf, p, p + n, isArray);
        p += n;
        break;
      }
      case 0x08: out[name] = buf[p] === 1; p += 1; break;
      case 0x0a: out[name] = null; break;
      case 0x10: out[name] = new BSON.Int32(buf.readInt32LE(p)); p += 4; break;
      case 0x12: out[name] = BSON.Long.fromBits(buf.readInt32LE(p), buf.readInt32LE(p + 4)); p += 8; break;
      case 0x09: out[name] = new Date(Number(buf.readBigInt64LE(p))); p += 8; break;
      default:
        return BSON.deserialize(buf, DECODE);
    }
  }
  return out;
}

const memos = new WeakMap();
// memo(value, kind, make) -> make(value), computed once per (value, kind).
function memo(value, kind, make) {
  // lazily decoded values are fresh per command: their shape cache is enough
  // (short-lived WeakMap keys are costly for the garbage collector)
  if (value === null || typeof value !== 'object' || value[LAZY]) return make(value);
  let m = memos.get(value);
  if (!m) { m = new Map(); memos.set(value, m); }
  let r = m.get(kind);
  if (r === undefined) { r = make(value); m.set(kind, r); }
  return r;
}

module.exports = { decode, memo, DECODE };
