'use strict';
// Shape keys read straight from BSON bytes. A fresh lock acquisition differs
// from the previous one only in literal values, so for the update pipeline
// and the projection of findAndModify/update the decoder does not build the
// document tree at all: it walks the bytes once, producing the shape key and
// the literal parameters (in document order, by the same rules as shape.js),
// and keeps the bytes for a full decode only when something needs the value
// (the first command of a shape, errors, delegated operators).

const BSON = require('bson');
const V = require('./values');

const DECODE = { promoteValues: false, promoteLongs: false, promoteBuffers: false, bsonRegExp: true };
const NOSHAPE = { noshape: true };
let scratch = Buffer.allocUnsafe(4096);

class Lazy {
  constructor(buf, isArray, kind) {
    this.buf = buf; // the value's own BSON document bytes
    this.isArray = isArray;
    this.kind = kind; // 'pipeline' | 'projection'
    this.cached = undefined;
    this.shape = undefined; // {key, params} | null
    this[V.LAZY] = isArray ? 'array' : 'object';
  }
  value() {
    if (this.cached === undefined) {
      const d = BSON.deserialize(this.buf, DECODE);
      this.cached = this.isArray ? Object.values(d) : d;
    }
    return this.cached;
  }
  shaped() {
    if (this.shape === undefined) this.shape = shapeOf(this.buf, this.kind === 'pipeline' ? 0xf1 : 0xf2);
    return this.shape;
  }
}

// The last value seen per (kind, byte length), with where its parameters
// sit: a value of the same length whose bytes outside those ranges are
// identical has the same shape, and only its changed parameters are decoded
// (a handful of memcmp calls instead of a walk).
let recent = new Map();

function shapeOf(buf, kindCode) {
  const slot = kindCode * 0x1000000 + buf.length;
  const r = recent.get(slot);
  if (r) {
    const params = changedParams(r, buf);
    if (params) {
      r.params = params;
      return { key: r.key, params };
    }
  }
  let w;
  try {
    w = new Walker(buf, kindCode);
    if (kindCode === 0xf1) w.pipeline(0); else w.projection(0);
  } catch (e) {
    if (e !== NOSHAPE) throw e;
    return null;
  }
  if (recent.size >= 256) recent = new Map();
  recent.set(slot, { buf: aligned(buf), ranges: w.ranges, key: w.key, params: w.params });
  return { key: w.key, params: w.params };
}

// Word-aligned copies for comparing four bytes at a time.
function aligned(buf) {
  const ab = new ArrayBuffer((buf.length + 3) & ~3);
  const copy = Buffer.from(ab, 0, buf.length);
  buf.copy(copy);
  return copy;
}
let cmpScratch = new ArrayBuffer(4096);

// Parameters of buf when it differs from r.buf only inside parameter ranges
// (r.buf is updated to buf), else null. One pass over the bytes, a word at
// a time.
function changedParams(r, buf) {
  const old = r.buf; // aligned, zero-padded to a multiple of 4
  const ranges = r.ranges;
  const words = old.buffer.byteLength >> 2;
  if (cmpScratch.byteLength < words * 4) cmpScratch = new ArrayBuffer(words * 8);
  const cur = Buffer.from(cmpScratch, 0, words * 4);
  buf.copy(cur);
  cur.fill(0, buf.length);
  const wa = new Int32Array(cmpScratch, 0, words);
  const wb = new Int32Array(old.buffer, 0, words);
  let params = null;
  let k = 0;
  let skipTo = 0;
  for (let w = 0; w < words; w++) {
    if (wa[w] === wb[w]) continue;
    for (let i = w * 4; i < w * 4 + 4; i++) {
      if (i < skipTo || cur[i] === old[i]) continue;
      while (k < ranges.length && ranges[k][1] <= i) k++;
      if (k === ranges.length || ranges[k][0] > i) return null; // a structural byte changed
      const [a, b, type] = ranges[k];
      // A string or document that changed length would move everything
      // after it: the first one to do so shows in its own length prefix.
      if (type === 0x02 && buf.readInt32LE(a) + 4 !== b - a) return null;
      if (type === 'literal' && buf.readInt32LE(a) !== b - a) return null;
      if (!params) params = r.params.slice();
      params[k] = decodeParam(buf, a, b, type);
      skipTo = b;
    }
    if (skipTo > (w + 1) * 4) w = (skipTo >> 2) - 1;
  }
  if (!params) return r.params;
  for (let j = 0; j < ranges.length; j++) {
    if (params[j] !== r.params[j]) buf.copy(old, ranges[j][0], ranges[j][0], ranges[j][1]);
  }
  return params;
}

function decodeParam(buf, a, b, type) {
  if (type === 'literal') return BSON.deserialize(buf.subarray(a, b), DECODE).$literal;
  return Walker.prototype.scalar.call({ buf }, type, a);
}

function cstr(buf, p) {
  const z = buf.indexOf(0, p);
  return [buf.toString('utf8', p, z), z + 1];
}

// Size in bytes of an element's value of the given type at p.
function valueSize(buf, type, p) {
  switch (type) {
    case 0x01: case 0x09: case 0x11: case 0x12: return 8;
    case 0x02: case 0x0d: case 0x0e: return 4 + buf.readInt32LE(p);
    case 0x03: case 0x04: case 0x0f: return buf.readInt32LE(p);
    case 0x05: return 5 + buf.readInt32LE(p);
    case 0x06: case 0x0a: case 0x7f: case 0xff: return 0;
    case 0x07: return 12;
    case 0x08: return 1;
    case 0x0b: { const a = buf.indexOf(0, p); const b = buf.indexOf(0, a + 1); return b + 1 - p; }
    case 0x0c: return 4 + buf.readInt32LE(p) + 12;
    case 0x10: return 4;
    case 0x13: return 16;
    default: throw NOSHAPE;
  }
}

const NATIVE = new Set(('$abs $add $and $arrayElemAt $avg $ceil $cmp $concat $cond $divide $eq $floor $getField $gt ' +
  '$gte $ifNull $in $isArray $isNumber $let $lt $lte $max $mergeObjects $min $mod $multiply $ne $not $or $size ' +
  '$subtract $sum $switch $toBool $toDate $toDouble $toInt $toLong $toLower $toString $toUpper $trunc $type ' +
  '$filter $map $concatArrays $indexOfArray').split(' '));

// The key is the value's bytes with every literal parameter and every
// container length prefix cut out (so literals of other lengths share the
// key); what remains (types, field names, operator names, "$field" strings,
// numeric projection flags) is the shape.
class Walker {
  constructor(buf, kindCode) {
    this.buf = buf;
    this.params = [];
    this.ranges = []; // [start, end, type] of each parameter, in order
    this.mark = 0;
    // the key is assembled in a scratch buffer (escaped bytes) and read out
    // as one flat string, which is cheap to hash
    if (scratch.length < buf.length * 2 + 16) scratch = Buffer.allocUnsafe(buf.length * 2 + 1024);
    this.out = scratch;
    this.out[0] = 0xff;
    this.out[1] = kindCode; // keeps pipeline and projection keys apart
    this.n = 2;
  }

  // Keeps bytes [mark, a) (0xFF escaped as FF 00), then removes [a, b)
  // leaving the two-byte marker FF code, so no two shapes share a key.
  cut(a, b, code = 1) {
    this.keep(a);
    this.out[this.n++] = 0xff;
    this.out[this.n++] = code;
    this.mark = b;
  }

  keep(a) {
    const src = this.buf, out = this.out;
    let n = this.n;
    for (let i = this.mark; i < a; i++) {
      const c = src[i];
      out[n++] = c;
      if (c === 0xff) out[n++] = 0;
    }
    this.n = n;
    this.mark = a;
  }

  finish() {
    this.keep(this.buf.length);
    this.key = this.out.latin1Slice(0, this.n);
  }

  // Decodes one scalar literal the way BSON.deserialize(DECODE) would.
  scalar(type, p) {
    const b = this.buf;
    switch (type) {
      case 0x01: return new V.Double(b.readDoubleLE(p));
      case 0x02: return b.utf8Slice(p + 4, p + 4 + b.readInt32LE(p) - 1);
      case 0x08: return b[p] === 1;
      case 0x09: return new Date(Number(b.readBigInt64LE(p)));
      case 0x0a: return null;
      case 0x10: return new V.Int32(b.readInt32LE(p));
      case 0x12: return V.Long.fromBits(b.readInt32LE(p), b.readInt32LE(p + 4));
      default: throw NOSHAPE;
    }
  }

  param(type, p) {
    this.params.push(this.scalar(type, p));
    const end = p + valueSize(this.buf, type, p);
    this.ranges.push([p, end, type]);
    this.cut(p, end);
  }

  // One element's value at p (type given) in expression context.
  expr(type, p) {
    const b = this.buf;
    if (type === 0x02) {
      if (b[p + 4] !== 0x24) this.param(type, p); // a "$path" string is shape
      return;
    }
    if (type !== 0x03 && type !== 0x04) { this.param(type, p); return; }
    const len = b.readInt32LE(p);
    if (len === 5) return;
    if (type === 0x03 && b[p + 5] === 0x24) { // {$op: arg}
      const q = b.indexOf(0, p + 5) + 1;
      const t = b[p + 4];
      const next = q + valueSize(b, t, q);
      if (b[next] !== 0) throw NOSHAPE; // more than one key
      const op = b.latin1Slice(p + 5, q - 1);
      if (op === '$literal') {
        const d = BSON.deserialize(b.subarray(p, p + len), DECODE);
        this.params.push(d.$literal);
        this.ranges.push([p, p + len, 'literal']);
        this.cut(p, p + len, 3);
        return;
      }
      if (!NATIVE.has(op)) throw NOSHAPE;
      this.cut(p, p + 4, 2);
      if ((op === '$filter' || op === '$map') && t === 0x03) {
        // the variable name ('as') is structure: its bytes stay in the key
        this.each(q, (et, nameAt, ev) => {
          if (b.latin1Slice(nameAt, ev - 1) !== 'as') this.expr(et, ev);
        });
        return;
      }
      this.expr(t, q);
      return;
    }
    // an array, or an object expression (no field may start with '$')
    const end = p + len - 1;
    this.cut(p, p + 4, 2);
    let e = p + 4;
    while (e < end) {
      const t = b[e];
      if (type === 0x03 && b[e + 1] === 0x24) throw NOSHAPE;
      const v = b.indexOf(0, e + 1) + 1;
      this.expr(t, v);
      e = v + valueSize(b, t, v);
    }
  }

  // Calls fn(type, nameOffset, valueOffset, elementOffset) for each element
  // of the document at p; cuts the document's length prefix from the key.
  each(p, fn) {
    const b = this.buf;
    const end = p + b.readInt32LE(p) - 1;
    this.cut(p, p + 4, 2);
    let q = p + 4;
    while (q < end) {
      const t = b[q];
      const v = b.indexOf(0, q + 1) + 1;
      fn(t, q + 1, v, q);
      q = v + valueSize(b, t, v);
    }
  }

  pipeline(p) {
    const b = this.buf;
    this.each(p, (t, n, q) => {
      if (t !== 0x03) throw NOSHAPE;
      let stages = 0;
      this.each(q, (st, nameAt, v) => {
        if (++stages > 1) throw NOSHAPE;
        const name = b.latin1Slice(nameAt, v - 1);
        if ((name === '$set' || name === '$addFields') && st === 0x03) {
          this.each(v, (et, fAt, ev) => this.expr(et, ev));
        } else if (name === '$replaceWith') {
          this.expr(st, v);
        }
        // any other stage stays in the key, bytes and all
      });
    });
    this.finish();
  }

  projection(p) {
    this.projFields(p);
    this.finish();
  }

  // a projection's fields: flags are shape, and so is a sub-object that is
  // not an expression (a sub-projection: its own fields)
  projFields(p) {
    const b = this.buf;
    this.each(p, (t, nameAt, v) => {
      if (t === 0x01 || t === 0x10 || t === 0x12) {
        const n = V.num(this.scalar(t, v));
        this.cut(v, v + valueSize(b, t, v), n !== 0 ? 4 : 5);
      } else if (t === 0x08) {
        // kept as it is: one byte, 0 or 1
      } else if (t === 0x03 && b.readInt32LE(v) > 5 && b[v + 5] !== 0x24) {
        this.projFields(v);
      } else this.expr(t, v);
    });
  }
}

module.exports = { Lazy };
