'use strict';
// In-memory databases and collections. A collection keeps its documents in a
// Map from the canonical key of _id to the document (insertion order is the
// natural order), so lookups by _id are O(1); each unique index keeps its own
// Map from index key to _id key. Stored documents are never mutated in place:
// a write replaces the document object, so readers holding the old object
// (cursors, change events) keep a consistent snapshot.
//
// Every write is stamped with a new cluster time (a Timestamp that strictly
// increases) and appended to the change log that change streams read.

const V = require('./values');
const query = require('./query');
const { fail, MongoError } = require('./errors');
const { ObjectId, Timestamp, Long, Int32 } = V;
const { change } = require('./diff');

// Canonical key of a value for _id and unique indexes: numerically equal
// values of different numeric types collide, as they do in mongod.
function valueKey(v) {
  const t = V.typeName(v);
  switch (t) {
    case 'string': return 's' + v;
    case 'int': case 'long': return 'n' + V.toBig(v).toString();
    case 'double': case 'decimal': {
      const n = V.num(v);
      if (Number.isInteger(n)) return 'n' + BigInt(n).toString();
      return 'n' + String(n);
    }
    case 'objectId': return 'o' + v.toHexString();
    case 'date': return 'd' + v.getTime();
    case 'bool': return 'b' + (v ? 1 : 0);
    case 'null': case 'missing': return 'z';
    case 'object': return '{' + Object.keys(v).map((k) => JSON.stringify(k) + ':' + valueKey(v[k])).join(',') + '}';
    case 'array': return '[' + v.map(valueKey).join(',') + ']';
    default: return t + ':' + V.render(v);
  }
}

class Clock {
  constructor() { this.t = 0; this.i = 0; this.big = undefined; }
  // Next cluster time: seconds of the wall clock, increment within a second.
  tick() {
    const s = Math.floor(Date.now() / 1000);
    if (s > this.t) { this.t = s; this.i = 1; } else this.i += 1;
    this.big = undefined;
    return Timestamp.fromBits(this.i, this.t);
  }
  now() {
    if (this.t === 0) return this.tick();
    return Timestamp.fromBits(this.i, this.t);
  }
  // tsBig(now()), made once per tick: every stream a write wakes reads it
  nowBig() {
    if (this.big === undefined) this.big = tsBig(this.now());
    return this.big;
  }
}

function tsBig(ts) { return (BigInt(ts.high >>> 0) << 32n) | BigInt(ts.low >>> 0); }

class Index {
  constructor(spec) {
    this.spec = spec; // {v, key, name, unique?, expireAfterSeconds?, ...}
    this.name = spec.name;
    this.fields = Object.keys(spec.key);
    this.unique = !!spec.unique;
    this.sparse = !!spec.sparse;
    this.partial = spec.partialFilterExpression ? query.compile(spec.partialFilterExpression) : null;
    this.map = this.unique ? new Map() : null;
  }
  keyOf(doc) {
    if (this.partial && !this.partial(doc)) return null;
    const vals = this.fields.map((f) => V.getPath(doc, f));
    if (this.sparse && vals.every((v) => v === undefined)) return null;
    return vals.map(valueKey).join('\u0000');
  }
  keyValue(doc) {
    const o = {};
    for (const f of this.fields) {
      const v = V.getPath(doc, f);
      o[f] = v === undefined ? null : v;
    }
    return o;
  }
}

function dupKeyError(coll, index, doc) {
  const kv = index.keyValue(doc);
  const shown = Object.keys(kv).map((k) => `${k}: ${V.render(kv[k])}`).join(', ');
  return new MongoError(11000,
    `E11000 duplicate key error collection: ${coll.db.name}.${coll.name} index: ${index.name} dup key: { ${shown} }`,
    { keyPattern: index.spec.key, keyValue: kv });
}

class Collection {
  constructor(db, name) {
    this.db = db;
    this.name = name;
    this.docs = new Map();
    this.uuid = new V.Binary(require('crypto').randomBytes(16), 4);
    this.indexes = [new Index({ v: 2, key: { _id: 1 }, name: '_id_' })];
  }
  get ns() { return `${this.db.name}.${this.name}`; }
  get(id) { return this.docs.get(valueKey(id)); }
  uniqueIndexes() { return this.indexes.filter((ix) => ix.unique); }

  // Checks every unique index for doc (which replaces `old`, if given).
  checkUnique(doc, old) {
    for (const ix of this.indexes) {
      if (!ix.unique) continue;
      const k = ix.keyOf(doc);
      if (k === null) continue;
      const owner = ix.map.get(k);
      if (owner !== undefined && (!old || owner !== valueKey(old._id))) throw dupKeyError(this, ix, doc);
    }
  }
  indexAdd(doc) {
    const idk = valueKey(doc._id);
    for (const ix of this.indexes) {
      if (!ix.unique) continue;
      const k = ix.keyOf(doc);
      if (k !== null) ix.map.set(k, idk);
    }
  }
  indexRemove(doc) {
    for (const ix of this.indexes) {
      if (!ix.unique) continue;
      const k = ix.keyOf(doc);
      if (k !== null && ix.map.get(k) === valueKey(doc._id)) ix.map.delete(k);
    }
  }
}

class Database {
  constructor(name) { this.name = name; this.collections = new Map(); }
}

class Store {
  constructor() {
    this.dbs = new Map();
    this.clock = new Clock();
    this.log = []; // change events, in cluster-time order
    this.logLimit = 200000;
    this.listeners = new Set();
    this.open = new Set();    // transactions in progress (txn.js)
  }

  // Before a plain write of the document idk of coll: a transaction in
  // progress that wrote it blocks the write (Blocked: the engine waits for
  // its end). After it: every transaction in progress keeps the version
  // before (old; undefined: there was none) in its snapshot.
  guard(coll, idk) {
    if (!this.open.size) return;
    const { Blocked } = require('./txn');
    for (const t of this.open) if (t.wrote(coll.ns, idk)) throw new Blocked(t);
  }
  // before a statement that writes several documents: guard() of each, so
  // that it waits before writing any (mongod's statement is not half
  // applied when it retries its write conflict)
  guardAll(coll, docs) {
    if (!this.open.size || !coll) return;
    for (const d of docs) this.guard(coll, valueKey(d._id));
  }
  captured(coll, idk, old) {
    for (const t of this.open) t.capture(coll.ns, idk, old);
  }
  db(name, create) {
    let d = this.dbs.get(name);
    if (!d && create) { d = new Database(name); this.dbs.set(name, d); }
    return d;
  }
  coll(dbName, name, create) {
    const d = this.db(dbName, create);
    if (!d) return undefined;
    let c = d.collections.get(name);
    if (!c && create) {
      validateCollName(name);
      c = new Collection(d, name);
      d.collections.set(name, c);
      this.emit({ op: 'create', coll: c });
    }
    return c;
  }

  emit(ev) {
    if (ev.op === 'create') return; // not shown in change streams by default
    ev.ts = this.clock.tick();
    ev.tsBig = tsBig(ev.ts);
    ev.wall = new Date();
    this.log.push(ev);
    // Trim in chunks so that a full log costs O(1) per write on average.
    if (this.log.length > this.logLimit * 1.25) {
      this.log.splice(0, this.log.length - this.logLimit);
      this.logTrimmed = true;
    }
    for (const l of this.listeners) l(ev);
  }

  insert(coll, doc) {
    if (!('_id' in doc)) doc = Object.assign({ _id: new ObjectId() }, doc);
    else if (Object.keys(doc)[0] !== '_id') {
      const o = { _id: doc._id };
      for (const k of Object.keys(doc)) if (k !== '_id') o[k] = doc[k];
      doc = o;
    }
    checkStorable(doc);
    const idk = valueKey(doc._id);
    this.guard(coll, idk);
    if (coll.docs.has(idk)) throw dupKeyError(coll, coll.indexes[0], doc);
    coll.checkUnique(doc, null);
    if (this.open.size) this.captured(coll, idk, undefined);
    coll.docs.set(idk, doc);
    coll.indexAdd(doc);
    this.emit({ op: 'insert', coll, db: coll.db.name, name: coll.name, key: { _id: doc._id }, doc });
    return doc;
  }

  // Replaces old with doc (same _id). Returns false when nothing changed
  // (a no-op: no write, no change event). how: the compiled update, which
  // decides what the change event reports (diff.js).
  replace(coll, old, doc, opType = 'update', how = undefined) {
    if (!differs(old, doc)) return false; // identical: a no-op
    if (!V.identical(old._id, doc._id)) {
      fail(66, `Performing an update on the path '_id' would modify the immutable field '_id'`);
    }
    checkStorable(doc);
    this.guard(coll, valueKey(doc._id));
    coll.checkUnique(doc, old);
    if (this.open.size) this.captured(coll, valueKey(doc._id), old);
    coll.indexRemove(old);
    coll.docs.set(valueKey(doc._id), doc);
    coll.indexAdd(doc);
    // An update event keeps only its updateDescription, a replace event the
    // new document: the log holds no old versions.
    const ch = opType === 'update' ? change(old, doc, how) : { op: 'replace' };
    if (ch.op === 'update') this.emit({ op: 'update', coll, db: coll.db.name, name: coll.name, key: { _id: doc._id }, desc: ch.desc });
    else this.emit({ op: 'replace', coll, db: coll.db.name, name: coll.name, key: { _id: doc._id }, doc });
    return true;
  }

  remove(coll, doc) {
    const idk = valueKey(doc._id);
    if (!coll.docs.has(idk)) return false;
    this.guard(coll, idk);
    if (this.open.size) this.captured(coll, idk, coll.docs.get(idk));
    coll.indexRemove(doc);
    coll.docs.delete(idk);
    this.emit({ op: 'delete', coll, db: coll.db.name, name: coll.name, key: { _id: doc._id } });
    return true;
  }

  dropCollection(coll) {
    coll.db.collections.delete(coll.name);
    this.emit({ op: 'drop', coll, db: coll.db.name, name: coll.name });
  }

  dropDatabase(db) {
    for (const c of [...db.collections.values()]) this.dropCollection(c);
    this.dbs.delete(db.name);
    this.emit({ op: 'dropDatabase', db: db.name });
  }
}

// Whether two versions of a document are identical, field order and BSON
// types included (an update to the same document is a no-op).
function differs(old, doc) {
  const ko = Object.keys(old), kd = Object.keys(doc);
  if (ko.length !== kd.length) return true;
  for (let i = 0; i < kd.length; i++) {
    if (ko[i] !== kd[i] || !V.identical(old[ko[i]], doc[kd[i]])) return true;
  }
  return false;
}

function validateCollName(name) {
  if (typeof name !== 'string' || name === '') fail(73, `Invalid namespace specified '${name}'`);
  if (name.includes('$') || name.includes('\u0000')) fail(73, `Invalid collection name: ${name}`);
}

function checkStorable(doc) {
  for (const k of Object.keys(doc)) {
    if (k === '') continue;
    if (k[0] === '$') fail(52, `Document can't have $ prefixed field names: ${k}`);
  }
  const t = V.typeName(doc._id);
  if (t === 'array' || t === 'regex' || t === 'undefined') {
    fail(53, `The '_id' value cannot be of type ${t === 'regex' ? 'regex' : 'array'}`);
  }
}

module.exports = { Store, Collection, Index, valueKey, tsBig, dupKeyError, differs, checkStorable, validateCollName };
