'use strict';
// Multi-document transactions, as a replica-set mongod runs them where the
// lock library depends on them (see the README's "Transactions").
//
// A transaction's snapshot is taken at its first command: from then on every
// write the store makes to a document (a plain write, or another
// transaction's commit) first records the document's version before it in
// the transaction's `pre` (Store.captured), so the transaction keeps reading
// that version. Its own writes go to `writes` (ns -> id key -> document, or
// null when deleted) and to `ops`, the order they are replayed in at commit;
// nobody else sees them before. A transaction that writes a document another
// open transaction wrote, or one written outside after its snapshot (it is in
// `pre`), fails with WriteConflict (112) and is aborted. A plain write to a
// document an open transaction wrote throws Blocked: the engine waits for
// that transaction to end (or the command's maxTimeMS) and runs the write
// again, as mongod retries a write conflict of a plain write internally.

const V = require('./values');
const { MongoError } = require('./errors');
const { valueKey, dupKeyError, differs, checkStorable } = require('./store');
const { ObjectId } = V;

const ABSENT = Symbol('absent'); // in `pre`: the document did not exist

// A plain write met a document an open transaction wrote.
class Blocked extends Error {
  constructor(txn) { super('blocked by a transaction'); this.txn = txn; }
}

// An error that ends a transaction (not turned into a writeErrors entry).
class TxnError extends Error {
  constructor(code, msg) { super(msg); this.mongo = new MongoError(code, msg); }
}

function writeConflict() {
  return new TxnError(112, 'WriteConflict error: this operation conflicted with another operation. '
    + 'Please retry your operation or multi-document transaction.');
}

class Txn {
  constructor(store, session, number) {
    this.store = store;
    this.session = session;   // the session key (lsid.id as hex)
    this.number = number;     // BigInt txnNumber
    this.state = 'inProgress'; // | 'committed' | 'aborted'
    this.pre = new Map();     // ns -> Map(id key -> document | ABSENT)
    this.writes = new Map();  // ns -> Map(id key -> document | null)
    this.ops = [];            // {op, db, name, doc, opType, how}
    this.waiters = [];        // plain writes waiting for the end
    this.timer = null;
    this.readConcern = undefined;
    this.view = new TxnStore(this);
    store.open.add(this);
  }

  capture(ns, idk, old) {
    let m = this.pre.get(ns);
    if (!m) { m = new Map(); this.pre.set(ns, m); }
    if (!m.has(idk)) m.set(idk, old === undefined ? ABSENT : old);
  }

  wrote(ns, idk) {
    const m = this.writes.get(ns);
    return m !== undefined && m.has(idk);
  }

  // the version of a document this transaction reads (undefined: none)
  resolve(db, name, idk) {
    const ns = `${db}.${name}`;
    const w = this.writes.get(ns);
    if (w && w.has(idk)) { const d = w.get(idk); return d === null ? undefined : d; }
    const p = this.pre.get(ns);
    if (p && p.has(idk)) { const d = p.get(idk); return d === ABSENT ? undefined : d; }
    const c = this.store.coll(db, name, false);
    return c ? c.docs.get(idk) : undefined;
  }

  // before a write of this transaction to (ns, idk)
  conflictCheck(ns, idk) {
    const p = this.pre.get(ns);
    if (p && p.has(idk)) throw writeConflict();
    for (const t of this.store.open) if (t !== this && t.wrote(ns, idk)) throw writeConflict();
  }

  record(db, name, idk, doc, op) {
    const ns = `${db}.${name}`;
    let m = this.writes.get(ns);
    if (!m) { m = new Map(); this.writes.set(ns, m); }
    m.set(idk, doc);
    this.ops.push(op);
  }

  // Ends the transaction (state: committed or aborted); the plain writes
  // that waited for it run again on the next turn of the loop.
  end(state) {
    if (this.state !== 'inProgress') return;
    this.state = state;
    this.store.open.delete(this);
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    const w = this.waiters;
    this.waiters = [];
    if (w.length) setImmediate(() => { for (const fn of w) fn(); });
  }

  abort() {
    this.end('aborted');
    this.pre = new Map();
    this.writes = new Map();
    this.ops = [];
  }

  // Applies the writes to the store, in order, and ends the transaction.
  // Every document written was unchanged outside since the snapshot (else
  // the write had a conflict), and no plain write changes it before the
  // waiting writes run again (after this): each replays as it ran.
  commit() {
    const ops = this.ops;
    const s = this.store;
    s.open.delete(this);
    this.writes = new Map();
    for (const o of ops) {
      const coll = s.coll(o.db, o.name, true);
      if (o.op === 'insert') s.insert(coll, o.doc);
      else {
        const cur = coll.docs.get(valueKey(o.doc._id));
        if (o.op === 'replace') s.replace(coll, cur, o.doc, o.opType, o.how);
        else if (cur !== undefined) s.remove(coll, cur);
      }
    }
    this.store.open.add(this);
    this.end('committed');
    this.pre = new Map();
    this.ops = [];
  }
}

// A collection as a transaction sees it: what Store.coll returns while a
// command of the transaction runs (get, docs, indexes, db, name).
class CollView {
  constructor(txn, db, name) {
    this.txn = txn;
    this.db = { name: db };
    this.name = name;
    this.ns = `${db}.${name}`;
    const self = this;
    this.docs = {
      get(idk) { return txn.resolve(db, name, idk); },
      has(idk) { return txn.resolve(db, name, idk) !== undefined; },
      * keys() { for (const [k] of self.entries()) yield k; },
      * values() { for (const [, d] of self.entries()) yield d; },
      get size() { let n = 0; for (const e of self.entries()) n += e.length ? 1 : 0; return n; },
    };
  }
  base() { return this.txn.store.coll(this.db.name, this.name, false); }
  get indexes() {
    const b = this.base();
    return b ? b.indexes : [];
  }
  get(id) { return this.txn.resolve(this.db.name, this.name, valueKey(id)); }
  // [id key, document] in the base collection's order, then the documents
  // deleted outside since the snapshot, then those the transaction inserted
  * entries() {
    const seen = new Set();
    const b = this.base();
    const t = this.txn;
    const one = (k) => {
      if (seen.has(k)) return undefined;
      seen.add(k);
      return t.resolve(this.db.name, this.name, k);
    };
    if (b) for (const k of b.docs.keys()) { const d = one(k); if (d !== undefined) yield [k, d]; }
    const p = t.pre.get(this.ns);
    if (p) for (const k of p.keys()) { const d = one(k); if (d !== undefined) yield [k, d]; }
    const w = t.writes.get(this.ns);
    if (w) for (const k of w.keys()) { const d = one(k); if (d !== undefined) yield [k, d]; }
  }
  // unique indexes other than _id, checked against what the transaction sees
  checkUnique(doc, old) {
    for (const ix of this.indexes) {
      if (!ix.unique || ix.name === '_id_') continue;
      const k = ix.keyOf(doc);
      if (k === null) continue;
      for (const [idk, d] of this.entries()) {
        if (old && idk === valueKey(old._id)) continue;
        if (idk !== valueKey(doc._id) && ix.keyOf(d) === k) throw dupKeyError(this, ix, doc);
      }
    }
  }
}

// The store as a transaction's commands see it (Engine swaps it in).
class TxnStore {
  constructor(txn) {
    this.txn = txn;
    this.views = new Map();
  }
  get clock() { return this.txn.store.clock; }
  guardAll() {} // (a transaction's writes conflict at once: conflictCheck)
  coll(db, name, create) {
    const ns = `${db}.${name}`;
    const t = this.txn;
    if (!create && !t.store.coll(db, name, false) && !t.writes.has(ns) && !t.pre.has(ns)) return undefined;
    let v = this.views.get(ns);
    if (!v) {
      if (create) require('./store').validateCollName(name);
      v = new CollView(t, db, name);
      this.views.set(ns, v);
    }
    return v;
  }
  insert(cv, doc) {
    if (!('_id' in doc)) doc = Object.assign({ _id: new ObjectId() }, doc);
    else if (Object.keys(doc)[0] !== '_id') {
      const o = { _id: doc._id };
      for (const k of Object.keys(doc)) if (k !== '_id') o[k] = doc[k];
      doc = o;
    }
    checkStorable(doc);
    const idk = valueKey(doc._id);
    this.txn.conflictCheck(cv.ns, idk);
    if (cv.get(doc._id) !== undefined) throw dupKeyError(cv, { name: '_id_', spec: { key: { _id: 1 } }, keyValue: (d) => ({ _id: d._id }) }, doc);
    cv.checkUnique(doc, null);
    this.txn.record(cv.db.name, cv.name, idk, doc, { op: 'insert', db: cv.db.name, name: cv.name, doc });
    return doc;
  }
  replace(cv, old, doc, opType = 'update', how = undefined) {
    if (!differs(old, doc)) return false;
    if (!V.identical(old._id, doc._id)) {
      throw new MongoError(66, `Performing an update on the path '_id' would modify the immutable field '_id'`);
    }
    checkStorable(doc);
    const idk = valueKey(doc._id);
    this.txn.conflictCheck(cv.ns, idk);
    cv.checkUnique(doc, old);
    this.txn.record(cv.db.name, cv.name, idk, doc, { op: 'replace', db: cv.db.name, name: cv.name, doc, opType, how });
    return true;
  }
  remove(cv, doc) {
    const idk = valueKey(doc._id);
    if (cv.get(doc._id) === undefined) return false;
    this.txn.conflictCheck(cv.ns, idk);
    this.txn.record(cv.db.name, cv.name, idk, null, { op: 'remove', db: cv.db.name, name: cv.name, doc });
    return true;
  }
}

// Codes mongod counts as retryable (ErrorCodes::isRetriableError)
const RETRIABLE = new Set([6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436]);

// Transient in every command of a transaction (isTransientTransactionError):
// WriteConflict, LockTimeout, PreparedTransactionInProgress, the
// SnapshotError category (SnapshotTooOld, SnapshotUnavailable,
// StaleChunkHistory, MigrationConflict), the NeedRetargettingError one
// (StaleEpoch, StaleConfig) and StaleDbVersion
const TRANSIENT = new Set([112, 24, 267, 239, 246, 250, 272, 150, 13388, 249]);

// The error labels mongod gives an error of a command in a transaction
// (src/mongo/db/error_labels.cpp): TransientTransactionError for the codes
// of TRANSIENT, a retryable error or NoSuchTransaction (on commit and abort only
// NoSuchTransaction without a write concern error); on commitTransaction,
// UnknownTransactionCommitResult for a retryable error, MaxTimeMSExpired or
// a write concern error; RetryableWriteError for a retryable error of commit
// or abort.
function txnLabels(name, code, wcCode) {
  const labels = [];
  const commitOrAbort = name === 'commitTransaction' || name === 'abortTransaction';
  if (code !== undefined) {
    let transient = TRANSIENT.has(code);
    if (commitOrAbort) transient = transient || (code === 251 && wcCode === undefined);
    else transient = transient || RETRIABLE.has(code) || code === 251;
    if (transient) labels.push('TransientTransactionError');
  }
  if (commitOrAbort && ((code !== undefined && RETRIABLE.has(code)) || (wcCode !== undefined && RETRIABLE.has(wcCode)))) {
    labels.push('RetryableWriteError');
  }
  if (name === 'commitTransaction') {
    const unknown = (code !== undefined && (RETRIABLE.has(code) || code === 50))
      || (wcCode !== undefined && wcCode !== 100 && wcCode !== 79);
    if (unknown) labels.push('UnknownTransactionCommitResult');
  }
  return labels;
}

module.exports = { Txn, TxnStore, Blocked, TxnError, ABSENT, txnLabels, RETRIABLE };
