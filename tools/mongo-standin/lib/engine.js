'use strict';
// The command engine: one instance per server. run(cmd, conn) executes one
// command document (sections already merged) and returns the reply document,
// or a Promise of it for commands that wait (getMore on a change stream,
// blockConnection). Commands run one at a time on Node's event loop, so each
// single-document write is atomic.

const V = require('./values');
const query = require('./query');
const expr = require('./expr');
const pipeline = require('./pipeline');
const update = require('./update');
const { Store, Index, tsBig } = require('./store');
const { ChangeStream } = require('./changestream');
const { fail, MongoError, codeName, nonResumable } = require('./errors');
const { memo } = require('./bsoncache');
const shape = require('./shape');
const auth = require('./auth');
const { Txn, Blocked, TxnError, txnLabels } = require('./txn');
const { Int32, Long, ObjectId, Timestamp, Binary } = V;

// Fields every command accepts (mongod's generic arguments).
const GENERIC = new Set(['$db', 'lsid', 'txnNumber', 'autocommit', 'startTransaction', 'stmtId', '$clusterTime',
  '$readPreference', 'readConcern', 'writeConcern', 'maxTimeMS', 'comment', 'apiVersion', 'apiStrict',
  'apiDeprecationErrors', '$client', '$audit', 'clientOperationKey', 'maxTimeMSOpOnly', '$queryOptions',
  'readOnce', 'mayBypassWriteBlocking', '$configTime', '$topologyTime', 'databaseVersion', 'shardVersion']);

// Accepted fields per command; commands missing here accept any field.
const FIELDS = {
  find: ['filter', 'projection', 'sort', 'hint', 'skip', 'limit', 'batchSize', 'singleBatch', 'max', 'min',
    'returnKey', 'showRecordId', 'tailable', 'oplogReplay', 'noCursorTimeout', 'awaitData', 'allowPartialResults',
    'collation', 'allowDiskUse', 'let', 'term', 'readOnce', '$_requestResumeToken', '$_resumeAfter'],
  insert: ['documents', 'ordered', 'bypassDocumentValidation', 'stmtIds'],
  update: ['updates', 'ordered', 'bypassDocumentValidation', 'let', 'stmtIds'],
  delete: ['deletes', 'ordered', 'let', 'stmtIds'],
  findAndModify: ['query', 'fields', 'sort', 'remove', 'update', 'new', 'upsert', 'bypassDocumentValidation',
    'collation', 'arrayFilters', 'hint', 'let'],
  aggregate: ['pipeline', 'cursor', 'explain', 'allowDiskUse', 'bypassDocumentValidation', 'collation', 'hint',
    'let', 'fromMongos', 'needsMerge', '$_requestReshardingResumeToken', 'exchange', 'isMapReduceCommand'],
  getMore: ['collection', 'batchSize', 'term', 'lastKnownCommittedOpTime'],
  killCursors: ['cursors'],
  count: ['query', 'limit', 'skip', 'hint', 'collation', 'fields'],
  distinct: ['key', 'query', 'collation', 'hint'],
  createIndexes: ['indexes', 'commitQuorum', 'ignoreUnknownIndexOptions', 'isTimeseriesNamespace'],
  dropIndexes: ['index', 'isTimeseriesNamespace'],
  listIndexes: ['cursor', 'isTimeseriesNamespace', 'includeIndexBuildInfo', 'includeBuildUUIDs'],
  listCollections: ['filter', 'cursor', 'nameOnly', 'authorizedCollections', 'includePendingDrops'],
  drop: [],
  ping: [],
  endSessions: [],
};
const STMT_FIELDS = {
  updates: ['q', 'u', 'c', 'upsert', 'multi', 'arrayFilters', 'hint', 'collation', 'sampleId', 'upsertSupplied'],
  deletes: ['q', 'limit', 'hint', 'collation', 'sampleId'],
};

function checkFields(name, cmd) {
  const allowed = FIELDS[name];
  if (!allowed) return;
  const keys = Object.keys(cmd);
  for (let i = 1; i < keys.length; i++) {
    const k = keys[i];
    if (!GENERIC.has(k) && !allowed.includes(k)) fail(40415, `BSON field '${name}.${k}' is an unknown field.`);
  }
}

function wantType(cmd, name, field, types, required) {
  const v = cmd[field];
  if (v === undefined) {
    if (required) fail(40414, `BSON field '${name}.${field}' is missing but a required field`);
    return;
  }
  const t = V.typeName(v);
  const ok = types.some((w) => (w === 'number' ? V.isNumber(v) : w === t));
  if (!ok) fail(14, `BSON field '${name}.${field}' is the wrong type '${t}', expected type${types.length > 1 ? 's' : ''} '${types.join(', ')}'`);
}

function collName(cmd, name) {
  const c = cmd[name];
  if (typeof c !== 'string') {
    fail(73, `collection name has invalid type ${V.typeName(c)}`);
  }
  if (c === '') fail(73, `Invalid namespace specified '${cmd.$db}.'`);
  return c;
}

function intOf(v, def) { return v === undefined ? def : Math.trunc(V.num(v)); }

// The retryable writes specification's retryable error codes: HostUnreachable,
// HostNotFound, NetworkTimeout, ShutdownInProgress, PrimarySteppedDown,
// ExceededTimeLimit, SocketException, NotWritablePrimary, InterruptedAtShutdown,
// InterruptedDueToReplStateChange, NotPrimaryNoSecondaryOk, NotPrimaryOrSecondary.
const RETRYABLE_CODES = new Set([6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436]);
const RETRYABLE_WRITES = new Set(['insert', 'update', 'delete', 'findAndModify']);
// commands that run in a multi-document transaction (as the library uses
// them), and those that only end one
const TXN_COMMANDS = new Set(['find', 'getMore', 'killCursors', 'insert', 'update', 'delete', 'findAndModify',
  'findandmodify', 'aggregate', 'distinct']);
const TXN_ONLY = new Set(['commitTransaction', 'abortTransaction']);
const RETRIED_MAX = 10000; // sessions whose last retryable write is kept
const READ_CONCERN_LEVELS = new Set(['local', 'majority', 'linearizable', 'available', 'snapshot']);

// Commands only a writable primary runs, and reads that need one unless
// the read preference allows a secondary.
const WRITE_COMMANDS = new Set(['insert', 'update', 'delete', 'findAndModify', 'findandmodify', 'createIndexes',
  'dropIndexes', 'create', 'drop', 'dropDatabase']);
const READ_COMMANDS = new Set(['find', 'aggregate', 'count', 'distinct', 'listIndexes', 'listCollections',
  'dbStats', 'collStats']);

// The error mongod answers a command with on a node that is not a writable
// primary, or null when the command runs there
function notPrimary(name, cmd) {
  if (WRITE_COMMANDS.has(name)) return new MongoError(10107, 'not primary');
  if (READ_COMMANDS.has(name)) {
    const rp = cmd.$readPreference;
    const mode = rp && typeof rp.mode === 'string' ? rp.mode : 'primary';
    if (mode === 'primary') return new MongoError(13435, 'not primary and secondaryOk=false');
  }
  return null;
}

// {session, txn} when cmd is a retryable write (a write with its session's
// txnNumber, outside a transaction), else null
function retryableWrite(name, cmd) {
  if (!RETRYABLE_WRITES.has(name) || cmd.txnNumber === undefined || cmd.autocommit !== undefined) return null;
  const id = cmd.lsid && cmd.lsid.id;
  if (!(id instanceof Binary)) return null;
  return { session: Buffer.from(id.buffer).toString('hex'), txn: BigInt(cmd.txnNumber.toString()) };
}

let cursorSeq = BigInt(Date.now()) * 1000n;

// A logical session id as mongod prints it (LogicalSessionId's operator<<:
// id, uid, and the two empty internal-transaction fields). Without
// authentication mongod's uid is the SHA-256 of the empty user name.
const NO_USER_UID = require('crypto').createHash('sha256').update('').digest('base64');
function sessionText(lsid) {
  const hex = Buffer.from(lsid.id.buffer).toString('hex');
  const id = hex.length === 32
    ? `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`
    : hex;
  const uid = lsid.uid instanceof Binary ? Buffer.from(lsid.uid.buffer).toString('base64') : NO_USER_UID;
  return `${id} - ${uid} -  - `;
}

// the session key of a command (its lsid.id as hex), or null
function sessionKey(cmd) {
  const id = cmd.lsid && cmd.lsid.id;
  return id instanceof Binary ? Buffer.from(id.buffer).toString('hex') : null;
}

class Engine {
  constructor(opts = {}) {
    this.opts = opts;
    this.replset = opts.standalone ? null : (opts.replset || 'rs0');
    this.store = new Store();
    this.cursors = new Map();
    this.failpoint = null;   // failCommand
    this.txnWriteFp = null;  // onPrimaryTransactionalWrite
    this.fpEntered = { failpoint: 0, txnWriteFp: 0 }; // times each has fired
    this.txn = null;         // the retryable write being executed
    this.retried = new Map(); // session -> { txn, body }: retryable writes' results
    this.sessions = new Map(); // session -> { number, txn }: its latest multi-document transaction
    this.txnLifetimeSecs = 60; // transactionLifetimeLimitSeconds
    this.resume = null;       // a plain write blocked by a transaction: its applied statements
    this.counters = { insert: 0, query: 0, update: 0, delete: 0, getmore: 0, command: 0 };
    this.commandMetrics = new Map(); // name -> {failed, total}
    this.startedAt = Date.now();
    this.ttlSecs = opts.ttlMonitorSecs === undefined ? 60 : opts.ttlMonitorSecs;
    this.ttlPasses = 0;
    this.ttlDeleted = 0;
    this.connections = { current: 0, totalCreated: 0 };
    this.wakes = [];          // awaiting change-stream getMores a write concerns, in order
    this.wakeScheduled = false;
    this.direct = null;       // the connection of the command being run, when its reply may be sent early
    this.electionId = new ObjectId('7fffffff0000000000000001');
    // access control (--auth) and the users (--user NAME:PWD:ROLE@DB, or
    // createUser): see auth.js
    this.auth = !!opts.auth;
    this.users = new auth.Users();
    for (const [name, pwd, roles] of opts.users || []) this.users.create('admin', name, pwd, roles);
    this.term = 1;
    this.steppedDownUntil = 0; // ms: not a writable primary before then (replSetStepDown)
    this.stepdowns = 0;        // how many times it stepped down
    this.scheduleTtl();
  }

  close() {
    if (this.ttlTimer) clearTimeout(this.ttlTimer);
    for (const c of this.cursors.values()) if (c.wake) c.wake();
  }

  // ---- change-stream wake-ups ----------------------------------------------
  // A write queues the awaiting getMores it concerns; they are read right
  // after the command that wrote (before its own reply goes out: see
  // wire.js), or on the next loop turn for writes made outside a command
  // (the TTL monitor).
  queueWake(fn) {
    this.wakes.push(fn);
    if (!this.wakeScheduled) {
      this.wakeScheduled = true;
      setImmediate(() => this.flushWakes());
    }
  }

  flushWakes() {
    this.wakeScheduled = false;
    if (!this.wakes.length) return;
    const fns = this.wakes;
    this.wakes = [];
    for (const fn of fns) fn();
  }

  // ---- TTL monitor -------------------------------------------------------
  scheduleTtl() {
    if (this.ttlTimer) clearTimeout(this.ttlTimer);
    this.ttlTimer = setTimeout(() => { this.ttlPass(); this.scheduleTtl(); }, Math.max(0, this.ttlSecs) * 1000 || 1);
    this.ttlTimer.unref();
  }

  ttlPass() {
    const now = Date.now();
    this.ttlPasses += 1;
    for (const db of this.store.dbs.values()) {
      for (const coll of db.collections.values()) {
        for (const ix of coll.indexes) {
          if (ix.spec.expireAfterSeconds === undefined || ix.fields.length !== 1) continue;
          const secs = V.num(ix.spec.expireAfterSeconds);
          const expired = [];
          for (const doc of coll.docs.values()) {
            let v = V.getPath(doc, ix.fields[0]);
            if (Array.isArray(v)) {
              const dates = v.filter((x) => x instanceof Date);
              v = dates.length ? dates.reduce((a, b) => (a < b ? a : b)) : undefined;
            }
            if (ix.partial && !ix.partial(doc)) continue;
            if (v instanceof Date && v.getTime() + secs * 1000 <= now) expired.push(doc);
          }
          for (const doc of expired) {
            try {
              this.store.remove(coll, doc);
              this.ttlDeleted += 1;
            } catch (e) {
              if (!(e instanceof Blocked)) throw e; // written by a transaction: a later pass
            }
          }
        }
      }
    }
  }

  // ---- dispatch ------------------------------------------------------------
  // Replies on a replica set end with $clusterTime and operationTime; the
  // wire layer appends them from pre-encoded bytes (see wire.js), keyed by
  // the CLUSTER_TIME symbol, which BSON encoding ignores.
  reply(body) {
    if (this.replset) body[CLUSTER_TIME] = this.store.clock.now();
    return body;
  }

  // rw: the command is a retryable write
  errorReply(e, rw, labels) {
    if (e instanceof MongoError) {
      const body = { ok: 0, errmsg: e.message, code: e.code, codeName: e.codeName };
      if (e.extra) Object.assign(body, e.extra);
      if (labels) {
        if (labels.length) body.errorLabels = labels;
        return this.reply(body);
      }
      // mongod 4.4+ labels the errors of its NonResumableChangeStreamError
      // category (jstests/change_streams/error_label.js), and a retryable
      // write's retryable errors RetryableWriteError
      if (nonResumable(e.code)) body.errorLabels = ['NonResumableChangeStreamError'];
      else if (rw && RETRYABLE_CODES.has(e.code)) body.errorLabels = ['RetryableWriteError'];
      return this.reply(body);
    }
    return this.reply({ ok: 0, errmsg: String(e && e.stack || e), code: 1, codeName: 'InternalError' });
  }

  // Returns a reply document, a Promise of one, or {closeConnection: true}.
  run(cmd, conn) {
    const name = Object.keys(cmd)[0];
    const m = this.commandMetric(name);
    m.total += 1;
    let r;
    this.arrivedAt = this.stepdowns;
    if (this.auth && (COMMANDS[name] || COMMANDS[ALIASES[name]])) {
      try {
        auth.check(this, ALIASES[name] || name, cmd, conn);
      } catch (e) {
        m.failed += 1;
        return this.errorReply(e);
      }
    }
    const fp = this.failpoint && name !== 'configureFailPoint' ? this.failFor(name, conn) : null;
    if (fp) r = this.runFailing(fp, name, cmd, conn);
    else {
      // a getMore's reply may be sent from the write that ends its wait
      // (no fail point may still change that reply)
      this.direct = conn;
      try {
        r = this.runCommand(name, cmd, conn);
      } finally {
        this.direct = null;
      }
    }
    if (r && typeof r.then === 'function') {
      return r.then((b) => {
        if (b && b.ok === 0) m.failed += 1;
        return b;
      });
    }
    if (r && r.ok === 0) m.failed += 1;
    return r;
  }

  // serverStatus's metrics.commands.<name>: {failed, total}, as mongod
  // counts every command it runs (under its own name, aliases under the
  // command's; names it does not know under <UNKNOWN>)
  commandMetric(name) {
    const key = METRIC_NAMES[name] || (COMMANDS[name] ? name : '<UNKNOWN>');
    let m = this.commandMetrics.get(key);
    if (m === undefined) {
      m = { failed: 0, total: 0 };
      this.commandMetrics.set(key, m);
    }
    return m;
  }

  // resume: the record of a plain write run again after a transaction it
  // waited for ended (its statements applied before it waited)
  runCommand(name, cmd, conn, resume) {
    try {
      if (cmd.autocommit !== undefined || cmd.startTransaction !== undefined || TXN_ONLY.has(name)) {
        return this.runInTxn(name, cmd, conn);
      }
      if (!resume) this.count(name, cmd);
      const fn = COMMANDS[name] || COMMANDS[ALIASES[name]];
      if (!fn) fail(59, `no such command: '${name}'`);
      if (typeof cmd.$db !== 'string' && !conn.legacy) fail(40571, 'OP_MSG requests require a $db argument');
      checkFields(ALIASES[name] || name, cmd);
      if (cmd.readConcern !== undefined) this.checkReadConcern(cmd.readConcern);
      const rw = retryableWrite(name, cmd);
      this.txn = null;
      if (!this.isPrimary()) {
        // mongod (service_entry_point_common.cpp): a node that is not a
        // writable primary refuses writes, and reads that did not allow a
        // secondary; retryable writes' errors are labelled
        const e = notPrimary(name, cmd);
        if (e) return this.errorReply(e, !!rw);
      }
      if (cmd.txnNumber !== undefined && !this.replset) {
        fail(20, 'Transaction numbers are only allowed on a replica set member or mongos');
      }
      if (rw) {
        const rec = this.retryRecord(rw);
        if (name === 'findAndModify' && rec.body) return this.reply({ ...rec.body });
        this.txn = { rec, rw, base: cmd.stmtId === undefined ? 0 : intOf(cmd.stmtId, 0),
          ids: Array.isArray(cmd.stmtIds) ? cmd.stmtIds : null, close: false };
      }
      this.lsid = sessionKey(cmd) === null ? null : cmd.lsid;
      if (rw) this.endTxnBefore(rw);
      this.resume = rw ? null : (resume || { stmts: new Map(), since: Date.now() });
      const r = fn.call(this, cmd, conn, name);
      this.resume = null;
      if (r && typeof r.then === 'function') this.txn = null;
      if (r && typeof r.then === 'function') return r.then((b) => (b === SENT || b.closeConnection ? b : this.reply(b)), (e) => this.errorReply(e));
      const txn = this.txn;
      this.txn = null;
      if (txn && name === 'findAndModify' && r.ok === 1 && txn.wrote) txn.rec.body = { ...r };
      // onPrimaryTransactionalWrite: the write is done, the reply is lost
      if (txn && txn.close) return { closeConnection: true };
      return this.reply(r);
    } catch (e) {
      const txn = this.txn;
      const res = this.resume;
      this.txn = null;
      this.resume = null;
      if (e instanceof Blocked) return this.waitFor(e.txn, name, cmd, conn, res || { stmts: new Map(), since: Date.now() });
      if (txn && txn.close) return { closeConnection: true };
      return this.errorReply(e, !!txn);
    }
  }

  // A plain write met a document a transaction in progress wrote: as
  // mongod retries its write conflict, it waits for that transaction to end
  // and runs again (statements already applied are not applied twice), or
  // fails with 50 MaxTimeMSExpired at its maxTimeMS.
  waitFor(txn, name, cmd, conn, resume) {
    const max = cmd.maxTimeMS === undefined ? 0 : intOf(cmd.maxTimeMS, 0);
    return new Promise((resolve) => {
      let timer = null;
      const go = () => {
        if (timer) clearTimeout(timer);
        timer = null;
        resolve(this.runCommand(name, cmd, conn, resume));
      };
      txn.waiters.push(go);
      if (max > 0) {
        const left = resume.since + max - Date.now();
        timer = setTimeout(() => {
          timer = null;
          const i = txn.waiters.indexOf(go);
          if (i >= 0) txn.waiters.splice(i, 1);
          resolve(this.errorReply(new MongoError(50, 'operation exceeded time limit'), !!retryableWrite(name, cmd)));
        }, Math.max(0, left));
      }
    });
  }

  // A retryable write with a newer txnNumber than the session's transaction
  // in progress aborts that transaction (mongod's beginOrContinue).
  endTxnBefore(rw) {
    const s = this.sessions.get(rw.session);
    if (s && s.txn && rw.txn > s.number) s.txn.abort();
  }

  // ---- multi-document transactions (txn.js) ------------------------------
  runInTxn(name, cmd, conn) {
    const fn = COMMANDS[name] || COMMANDS[ALIASES[name]];
    if (!fn) fail(59, `no such command: '${name}'`);
    if (typeof cmd.$db !== 'string' && !conn.legacy) fail(40571, 'OP_MSG requests require a $db argument');
    checkFields(ALIASES[name] || name, cmd);
    this.count(name, cmd);
    if (!this.replset) {
      if (cmd.txnNumber !== undefined) fail(20, 'Transaction numbers are only allowed on a replica set member or mongos');
      fail(20, 'Transactions are not supported by this server');
    }
    if (TXN_ONLY.has(name) && cmd.$db !== 'admin') fail(13, `${name} may only be run against the admin database.`);
    const key = sessionKey(cmd);
    if (cmd.txnNumber !== undefined && key === null) fail(72, 'Transaction number requires a session ID to also be specified');
    if (cmd.autocommit === undefined) {
      if (cmd.startTransaction !== undefined) fail(72, "'startTransaction' field requires 'autocommit' field to also be specified");
      fail(125, `${name} must be run within a transaction`);
    }
    if (cmd.autocommit !== false) fail(72, 'Specifying autocommit=true is not allowed.');
    if (cmd.txnNumber === undefined) fail(72, "'autocommit' field requires a transaction number to also be specified");
    if (cmd.startTransaction !== undefined && cmd.startTransaction !== true) fail(72, 'Specifying startTransaction=false is not allowed.');
    if (!TXN_COMMANDS.has(name) && !TXN_ONLY.has(name)) fail(263, `Cannot run '${name}' in a multi-document transaction.`);
    if (!this.isPrimary()) return this.errorReply(new MongoError(10107, 'not primary'), false, txnLabels(name, 10107));
    const n = BigInt(cmd.txnNumber.toString());
    let s = this.sessions.get(key);
    if (!s) {
      s = { number: -1n, txn: null };
      this.sessions.set(key, s);
      if (this.sessions.size > RETRIED_MAX) {
        for (const [k, v] of this.sessions) if (!v.txn || v.txn.state !== 'inProgress') { this.sessions.delete(k); break; }
      }
    }
    const rec = this.retried.get(key);
    const active = rec && rec.txn > s.number ? rec.txn : s.number;
    const err = (code, msg) => this.errorReply(new MongoError(code, msg), false, txnLabels(name, code));
    if (n < active) {
      return err(225, `Cannot start transaction ${n} on session ${sessionText(cmd.lsid)} because a newer transaction ${active} has already started.`);
    }
    if (cmd.startTransaction) {
      if (n === active) return err(117, 'Only servers in a sharded cluster can start a new transaction at the active transaction number');
      if (s.txn) s.txn.abort();
      if (cmd.readConcern !== undefined) {
        const lvl = cmd.readConcern.level;
        if (lvl !== undefined && !['local', 'majority', 'snapshot'].includes(lvl)) {
          return err(72, `The readConcern level must be either 'local' (default), 'majority' or 'snapshot' in order to run in a transaction`);
        }
      }
      s.number = n;
      s.txn = new Txn(this.store, key, n);
      s.txn.readConcern = cmd.readConcern;
      const t = s.txn;
      t.timer = setTimeout(() => t.abort(), this.txnLifetimeSecs * 1000);
      t.timer.unref();
    } else if (n !== s.number || !s.txn) {
      return err(251, `Given transaction number ${n} does not match any in-progress transactions. The active transaction number is ${active}`);
    }
    const t = s.txn;
    if (name === 'commitTransaction' || name === 'abortTransaction') {
      // a w greater than the members: mongod commits (or aborts), then
      // answers the write concern error 100 (no UnknownTransactionCommitResult)
      const unsatisfiable = this.writeConcernCheck(cmd, true);
      const done = () => {
        const body = { ok: 1 };
        if (unsatisfiable) {
          body.writeConcernError = { code: new Int32(100), codeName: codeName(100),
            errmsg: 'Not enough data-bearing nodes' };
          const l = txnLabels(name, undefined, 100);
          if (l.length) body.errorLabels = l;
        }
        return this.reply(body);
      };
      if (t.state === 'aborted') return err(251, `Transaction ${n} has been aborted.`);
      if (name === 'commitTransaction') {
        if (t.state === 'inProgress') t.commit();
        return done(); // a commit sent again answers as the first
      }
      if (t.state === 'committed') return err(256, 'Transaction has been committed');
      t.abort();
      return done();
    }
    if (t.state === 'aborted') return err(251, `Transaction ${n} has been aborted.`);
    if (t.state === 'committed') return err(256, `Transaction ${n} has been committed.`);
    const abortWith = (code, msg) => { t.abort(); return err(code, msg); };
    if (!cmd.startTransaction && cmd.readConcern !== undefined) {
      return abortWith(72, 'Only the first command in a transaction may specify a readConcern');
    }
    if (cmd.writeConcern !== undefined) {
      return abortWith(72, 'Cannot set write concern after starting a transaction.');
    }
    if (name === 'aggregate' && Array.isArray(cmd.pipeline) && cmd.pipeline.some((st) => V.isPlainDoc(st) && st.$changeStream !== undefined)) {
      return abortWith(263, 'Cannot run aggregate with $changeStream in a multi-document transaction.');
    }
    const saved = this.store;
    this.store = t.view;
    this.lsid = cmd.lsid;
    this.txn = null;
    this.resume = null;
    try {
      const r = fn.call(this, cmd, conn, name);
      // mongod aborts a transaction whose statement failed
      if (r && r.writeErrors) t.abort();
      return this.reply(r);
    } catch (e) {
      t.abort();
      if (e instanceof TxnError) return this.errorReply(e.mongo, false, txnLabels(name, e.mongo.code));
      if (e instanceof MongoError) return this.errorReply(e, false, txnLabels(name, e.code));
      throw e;
    } finally {
      this.store = saved;
    }
  }

  // ---- retryable writes ----------------------------------------------------
  // Like mongod, a retryable write remembers, per session, its txnNumber
  // and the result of each of its statements by stmtId (the command's
  // stmtIds, else stmtId + index, else the index). The same txnNumber sent
  // again does not execute again what was already applied: a statement
  // recorded is skipped and its first result counted in the reply, the
  // others (those that failed, or that an ordered batch never reached) are
  // executed; a findAndModify answers its first reply. An older txnNumber is
  // refused with 225.
  retryRecord(rw) {
    const rec = this.retried.get(rw.session);
    if (rec) {
      if (rw.txn < rec.txn) {
        fail(225, `Retryable write with txnNumber ${rw.txn} is prohibited on session ${rw.session} because a newer retryable write with txnNumber ${rec.txn} has already started on this session.`);
      }
      if (rw.txn === rec.txn) return rec;
    }
    const fresh = { txn: rw.txn, body: null, stmts: new Map() };
    this.retried.delete(rw.session);
    this.retried.set(rw.session, fresh);
    if (this.retried.size > RETRIED_MAX) this.retried.delete(this.retried.keys().next().value);
    return fresh;
  }

  // stmtId of statement i of the current retryable write (null: not one)
  stmtId(i) {
    const t = this.txn;
    if (!t) return null;
    return t.ids && t.ids[i] !== undefined ? V.num(t.ids[i]) : t.base + i;
  }

  // the first result of statement i, when this retry already applied it
  applied(i) {
    if (!this.txn && this.resume) return this.resume.stmts.get(i);
    const id = this.stmtId(i);
    return id === null ? undefined : this.txn.rec.stmts.get(id);
  }

  // Before a statement of a retryable write: onPrimaryTransactionalWrite
  // with failBeforeCommitExceptionCode fails it, unapplied.
  beforeStmt() {
    if (!this.txn) return;
    const data = this.txnWriteFires(true);
    if (!data) return;
    if (data.closeConnection === undefined || V.truthy(data.closeConnection)) this.txn.close = true;
    const code = V.num(data.failBeforeCommitExceptionCode);
    fail(code, `Failing write for ${this.txn.rw.session}:${this.txn.rw.txn} due to failpoint. The write must not be reflected.`);
  }

  // After statement i of a retryable write applied (result: what it
  // counts for in the reply): recorded; onPrimaryTransactionalWrite
  // without failBeforeCommitExceptionCode loses the reply.
  afterStmt(i, result, fire = true) {
    if (!this.txn) {
      if (this.resume) this.resume.stmts.set(i, result);
      return;
    }
    this.txn.wrote = true;
    this.txn.rec.stmts.set(this.stmtId(i), result);
    const data = fire ? this.txnWriteFires(false) : null;
    if (data && (data.closeConnection === undefined || V.truthy(data.closeConnection))) this.txn.close = true;
  }

  // the onPrimaryTransactionalWrite fail point's data when it fires now
  // (before: the check made before a statement, for failBeforeCommit)
  txnWriteFires(before) {
    const fp = this.txnWriteFp;
    if (!fp) return null;
    if ((fp.data.failBeforeCommitExceptionCode !== undefined) !== before) return null;
    if (fp.skip > 0) { fp.skip -= 1; return null; }
    if (fp.times !== undefined) {
      fp.times -= 1;
      if (fp.times <= 0) this.txnWriteFp = null;
    }
    this.fpEntered.txnWriteFp += 1;
    return fp.data;
  }

  count(name, cmd) {
    // mongod: insert counts documents, update/delete count statements, find
    // counts as query, getMore as getmore; these four do not count as
    // commands. Every other command (findAndModify and aggregate included)
    // counts once as a command.
    switch (name) {
      case 'insert': this.counters.insert += Array.isArray(cmd.documents) ? cmd.documents.length : 0; break;
      case 'update': this.counters.update += Array.isArray(cmd.updates) ? cmd.updates.length : 0; break;
      case 'delete': this.counters.delete += Array.isArray(cmd.deletes) ? cmd.deletes.length : 0; break;
      case 'find': this.counters.query += 1; break;
      case 'getMore': this.counters.getmore += 1; break;
      default: this.counters.command += 1;
    }
  }

  // ---- failCommand ---------------------------------------------------------
  failFor(name, conn) {
    const fp = this.failpoint;
    const data = fp.data || {};
    if (!Array.isArray(data.failCommands) || !data.failCommands.includes(name)) return null;
    if (data.appName !== undefined && data.appName !== conn.appName) return null;
    if (fp.skip > 0) { fp.skip -= 1; return null; }
    if (fp.times !== undefined) {
      fp.times -= 1;
      if (fp.times <= 0) this.failpoint = null;
    }
    this.fpEntered.failpoint += 1;
    return data;
  }

  runFailing(data, name, cmd, conn) {
    const arrived = this.arrivedAt;
    const act = () => {
      if (data.closeConnection) return { closeConnection: true };
      // a write blocked across a stepdown: mongod kills the operations that
      // take write locks when it steps down
      if (this.stepdowns !== arrived && WRITE_COMMANDS.has(name)) {
        return this.errorReply(new MongoError(11602, 'operation was interrupted because of a replication state change'),
          !!retryableWrite(name, cmd));
      }
      // mongod labels a retryable write's retryable error (or write concern
      // error) RetryableWriteError, unless the fail point gives errorLabels
      const inTxn = cmd.autocommit !== undefined || TXN_ONLY.has(name);
      const labels = (code, wc) => (Array.isArray(data.errorLabels) ? data.errorLabels
        : inTxn ? txnLabels(name, wc ? undefined : code, wc ? code : undefined)
        : retryableWrite(name, cmd) && RETRYABLE_CODES.has(code) ? ['RetryableWriteError']
          : nonResumable(code) ? ['NonResumableChangeStreamError'] : null);
      if (data.errorCode !== undefined) {
        const code = V.num(data.errorCode);
        const body = { ok: 0, errmsg: "Failing command via 'failCommand' failpoint", code: new Int32(code), codeName: codeName(code) };
        const l = labels(code);
        if (l && l.length) body.errorLabels = l;
        return this.reply(body);
      }
      const r = this.runCommand(name, cmd, conn);
      const attach = (b) => {
        if (data.writeConcernError && !b.closeConnection) {
          b.writeConcernError = data.writeConcernError;
          const l = labels(V.num(data.writeConcernError.code), true);
          if (l && l.length) b.errorLabels = l;
        }
        return b;
      };
      return r && typeof r.then === 'function' ? r.then(attach) : attach(r);
    };
    if (data.blockConnection) {
      const ms = intOf(data.blockTimeMS, 0);
      return new Promise((resolve) => setTimeout(resolve, ms)).then(act);
    }
    return act();
  }

  // readConcern: {level} of mongod's levels. Every write the stand-in
  // acknowledged is on its only member, so "majority" reads what "local"
  // reads (as mongod answers it on a standalone); "linearizable" and
  // "snapshot" need a replica set (123 NotAReplicaSet on --standalone).
  checkReadConcern(rc) {
    if (!V.isPlainDoc(rc)) fail(14, "BSON field 'readConcern' is the wrong type, expected type 'object'");
    if (rc.level === undefined) return;
    if (typeof rc.level !== 'string') fail(14, "BSON field 'readConcern.level' is the wrong type, expected type 'string'");
    if (!READ_CONCERN_LEVELS.has(rc.level)) {
      fail(2, `Enumeration value '${rc.level}' for field 'readConcern.level' is not a valid value.`);
    }
    if (!this.replset && (rc.level === 'linearizable' || rc.level === 'snapshot')) {
      fail(123, 'node needs to be a replica set member to use read concern');
    }
  }

  // ---- elections -------------------------------------------------------------
  // A single-node replica set's primary that stepped down (replSetStepDown)
  // stands for election again when its stepdown period ends, and wins it:
  // a new term and electionId.
  isPrimary() {
    if (!this.replset || this.steppedDownUntil === 0) return true;
    if (Date.now() < this.steppedDownUntil) return false;
    this.steppedDownUntil = 0;
    this.term += 1;
    this.electionId = new ObjectId(`7fffffff${this.term.toString(16).padStart(16, '0')}`);
    return true;
  }

  // ---- helpers -------------------------------------------------------------
  vars() {
    // $$NOW and $$CLUSTER_TIME: one value for the whole command.
    const v = { NOW: new Date() };
    if (this.replset) v.CLUSTER_TIME = this.store.clock.now();
    return v;
  }

  // A cursor belongs to the session of the command that created it (none
  // when that command had no lsid): getMore checks it (validateLSID).
  newCursor(c) {
    c.lsid = this.lsid || null;
    cursorSeq += 1n;
    c.id = Long.fromBigInt(cursorSeq);
    this.cursors.set(c.id.toString(), c);
    return c.id;
  }

  batchFrom(cursor, batchSize) {
    const docs = cursor.docs;
    let end = batchSize === undefined ? docs.length : Math.min(docs.length, cursor.pos + batchSize);
    // like mongod, a batch stops before 16 MiB of documents (at least one)
    let bytes = 0;
    for (let i = cursor.pos; i < end; i++) {
      bytes += BSON_SIZE(docs[i]);
      if (bytes > 16 * 1024 * 1024 - 16384 && i > cursor.pos) { end = i; break; }
    }
    const batch = docs.slice(cursor.pos, end);
    cursor.pos = end;
    return batch;
  }

  matcher(filter, vars) {
    return query.compile(filter, { compileExpr: expr.compile, vars: () => vars });
  }

  // Documents matching filter, in natural order (O(1) for an _id equality).
  select(coll, filter, vars, limit = Infinity) {
    if (!coll) return [];
    const id = query.idEquality(filter);
    const m = this.matcher(filter, vars);
    if (id !== undefined) {
      const d = coll.get(id);
      return d !== undefined && m(d) ? [d] : [];
    }
    const out = [];
    for (const d of coll.docs.values()) {
      if (m(d)) { out.push(d); if (out.length >= limit) break; }
    }
    return out;
  }

  // throws for a write concern mongod refuses; with `after`, a w greater
  // than the members is not thrown but answered true (the caller writes,
  // then reports it as a writeConcernError, as mongod does)
  writeConcernCheck(cmd, after = false) {
    const wc = cmd.writeConcern;
    if (wc === undefined) return;
    if (!V.isPlainDoc(wc)) fail(14, "BSON field 'writeConcern' is the wrong type, expected type 'object'");
    for (const k of Object.keys(wc)) {
      if (!['w', 'wtimeout', 'j', 'fsync', 'wtimeoutMS', 'provenance', 'getLastError'].includes(k)) {
        fail(9, `unrecognized write concern field: ${k}`);
      }
    }
    if (wc.w !== undefined && !V.isNumber(wc.w) && typeof wc.w !== 'string' && !V.isPlainDoc(wc.w)) {
      fail(14, "w has to be a number, string or object");
    }
    if (typeof wc.w === 'string' && wc.w !== 'majority') fail(79, `Write Concern mode '${wc.w}' is not known`);
    if (V.isNumber(wc.w) && V.num(wc.w) > 1) {
      if (after) return true;
      fail(100, `Not enough data-bearing nodes`);
    }
    return false;
  }
}

const CLUSTER_TIME = Symbol.for('mongo-standin.clusterTime');
// what a waiting command's Promise resolves to when its reply was already
// written to its connection (Connection.sendNow)
const SENT = Symbol.for('mongo-standin.sent');
const BSON_SIZE = (d) => require('bson').calculateObjectSize(d, { ignoreUndefined: true });

const ALIASES = { ismaster: 'isMaster', findandmodify: 'findAndModify' };
const METRIC_NAMES = { ...ALIASES, buildinfo: 'buildInfo' }; // serverStatus metrics.commands
const COMMANDS = {};

// ---- handshake and server commands ------------------------------------------

function helloReply(engine, conn, legacy) {
  const addr = conn.address;
  const r = {};
  const primary = engine.isPrimary();
  if (legacy) r.ismaster = primary; else r.isWritablePrimary = primary;
  r.helloOk = true;
  if (engine.replset) {
    r.hosts = [addr];
    r.setName = engine.replset;
    r.setVersion = new Int32(1);
    r.secondary = !primary;
    if (primary) r.primary = addr;
    r.me = addr;
    if (primary) r.electionId = engine.electionId;
    const ct = engine.store.clock.now();
    const t = Long.fromNumber(engine.term);
    r.lastWrite = {
      opTime: { ts: ct, t }, lastWriteDate: new Date(ct.high * 1000),
      majorityOpTime: { ts: ct, t }, majorityWriteDate: new Date(ct.high * 1000),
    };
  }
  r.maxBsonObjectSize = new Int32(16777216);
  r.maxMessageSizeBytes = new Int32(48000000);
  r.maxWriteBatchSize = new Int32(100000);
  r.localTime = new Date();
  if (engine.replset) r.logicalSessionTimeoutMinutes = new Int32(30);
  r.connectionId = new Int32(conn.id);
  r.minWireVersion = new Int32(0);
  r.maxWireVersion = new Int32(17);
  r.readOnly = false;
  r.ok = 1;
  return r;
}

COMMANDS.hello = function (cmd, conn) {
  if (cmd.client !== undefined) {
    if (conn.handshaken) fail(186, 'The client metadata document may only be sent in the first hello');
    if (V.isPlainDoc(cmd.client) && V.isPlainDoc(cmd.client.application)) conn.appName = cmd.client.application.name;
    conn.handshaken = true;
  }
  const r = helloReply(this, conn, false);
  auth.helloExtras(this, cmd, conn, r);
  return r;
};
COMMANDS.isMaster = function (cmd, conn) {
  const r = COMMANDS.hello.call(this, cmd, conn);
  const primary = r.isWritablePrimary;
  delete r.isWritablePrimary;
  return Object.assign({ ismaster: primary }, r);
};

COMMANDS.ping = () => ({ ok: 1 });

COMMANDS.buildInfo = () => ({
  version: '6.0.0', gitVersion: 'mongo-standin', versionArray: [new Int32(6), new Int32(0), new Int32(0), new Int32(0)],
  modules: [], allocator: 'system', javascriptEngine: 'none', sysInfo: 'deprecated', bits: new Int32(64),
  debug: false, maxBsonObjectSize: new Int32(16777216), storageEngines: ['inMemory'], openssl: { running: 'disabled' },
  ok: 1,
});
COMMANDS.buildinfo = COMMANDS.buildInfo;

COMMANDS.serverStatus = function () {
  const c = this.counters;
  const up = Date.now() - this.startedAt;
  const r = {
    host: require('os').hostname(), version: '6.0.0', process: 'mongod', pid: Long.fromNumber(process.pid),
    uptime: up / 1000, uptimeMillis: Long.fromNumber(up), uptimeEstimate: Long.fromNumber(Math.floor(up / 1000)),
    localTime: new Date(),
    connections: { current: new Int32(this.connections.current), available: new Int32(838860 - this.connections.current),
      totalCreated: new Int32(this.connections.totalCreated) },
    opcounters: { insert: Long.fromNumber(c.insert), query: Long.fromNumber(c.query), update: Long.fromNumber(c.update),
      delete: Long.fromNumber(c.delete), getmore: Long.fromNumber(c.getmore), command: Long.fromNumber(c.command) },
    metrics: {
      commands: Object.fromEntries([...this.commandMetrics].sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
        .map(([k, v]) => [k, { failed: Long.fromNumber(v.failed), total: Long.fromNumber(v.total) }])),
      ttl: { passes: Long.fromNumber(this.ttlPasses), deletedDocuments: Long.fromNumber(this.ttlDeleted) },
    },
    storageEngine: { name: 'inMemory', persistent: false },
    ok: 1,
  };
  if (this.replset) {
    const primary = this.isPrimary();
    r.repl = { setName: this.replset, isWritablePrimary: primary, secondary: !primary, hosts: [] };
  }
  return r;
};

COMMANDS.endSessions = function (cmd) {
  // an ended session sends no more retries: forget its last write
  if (Array.isArray(cmd.endSessions)) {
    for (const s of cmd.endSessions) {
      if (!(s && s.id instanceof Binary)) continue;
      const key = Buffer.from(s.id.buffer).toString('hex');
      this.retried.delete(key);
      // and its transaction in progress ends (aborted)
      const st = this.sessions.get(key);
      if (st && st.txn) st.txn.abort();
      this.sessions.delete(key);
    }
  }
  return { ok: 1 };
};
// killSessions: [{id}...] / killAllSessions: [] (every session; a list of
// users is taken as every session too, the stand-in has one user at most):
// as mongod, a killed session's transaction in progress is aborted (its
// next command gets NoSuchTransaction); the session itself stays known
COMMANDS.killSessions = function (cmd) {
  if (Array.isArray(cmd.killSessions)) {
    for (const s of cmd.killSessions) {
      if (!(s && s.id instanceof Binary)) continue;
      const st = this.sessions.get(Buffer.from(s.id.buffer).toString('hex'));
      if (st && st.txn) st.txn.abort();
    }
  }
  return { ok: 1 };
};
COMMANDS.killAllSessions = function (cmd) {
  if (!Array.isArray(cmd.killAllSessions)) fail(14, "BSON field 'killAllSessions.killAllSessions' is the wrong type");
  for (const st of this.sessions.values()) if (st.txn) st.txn.abort();
  return { ok: 1 };
};
COMMANDS.refreshSessions = () => ({ ok: 1 });
COMMANDS.startSession = function () {
  if (!this.replset) fail(20, 'Sessions are not supported by the mongod standalone this server emulates');
  return { id: { id: new Binary(require('crypto').randomBytes(16), 4) }, timeoutMinutes: new Int32(30), ok: 1 };
};
COMMANDS.whatsmyuri = (cmd, conn) => ({ you: conn.peer, ok: 1 });
COMMANDS.getCmdLineOpts = function () {
  return { argv: process.argv.slice(1), parsed: {}, ok: 1 };
};

COMMANDS.getParameter = function (cmd) {
  const r = { ok: 1 };
  if (cmd.ttlMonitorSleepSecs !== undefined || cmd.getParameter === '*') r.ttlMonitorSleepSecs = new Int32(this.ttlSecs);
  if (cmd.enableTestCommands !== undefined || cmd.getParameter === '*') r.enableTestCommands = true;
  if (cmd.transactionLifetimeLimitSeconds !== undefined || cmd.getParameter === '*') {
    r.transactionLifetimeLimitSeconds = new Int32(this.txnLifetimeSecs);
  }
  if (Object.keys(r).length === 1) fail(72, 'no option found to get');
  return r;
};

COMMANDS.setParameter = function (cmd) {
  if (cmd.$db !== 'admin') fail(13, 'setParameter may only be run against the admin database.');
  const keys = Object.keys(cmd).filter((k) => k !== 'setParameter' && !GENERIC.has(k));
  if (!keys.length) fail(2, 'no option found to set, use help:true to see options ');
  const r = { ok: 1 };
  for (const k of keys) {
    if (k === 'ttlMonitorSleepSecs') {
      const v = cmd[k];
      if (!V.isNumber(v)) fail(14, `Failed parsing value for parameter ${k}`);
      const n = V.num(v);
      if (n < 1) fail(2, `Invalid value for parameter ttlMonitorSleepSecs: ${n} is not greater than or equal to 1`);
      r.was = new Int32(this.ttlSecs);
      this.ttlSecs = n;
      this.scheduleTtl();
    } else if (k === 'transactionLifetimeLimitSeconds') {
      const v = cmd[k];
      if (!V.isNumber(v)) fail(14, `Failed parsing value for parameter ${k}`);
      const n = V.num(v);
      if (n < 1) fail(2, `Invalid value for parameter transactionLifetimeLimitSeconds: ${n} is not greater than or equal to 1`);
      r.was = new Int32(this.txnLifetimeSecs);
      this.txnLifetimeSecs = n;
    } else {
      fail(2, `attempted to set unrecognized parameter [${k}], use help:true to see options `);
    }
  }
  return r;
};

// replSetStepDown: N (stepDownSecs, default 60), secondaryCatchUpPeriodSecs
// (default 10, or 0 with force), force. As on a single-node replica set: with force the
// primary steps down at once, is a secondary for stepDownSecs and then
// elects itself again; without force there is no secondary to catch up,
// and after secondaryCatchUpPeriodSecs it answers 262 and stays primary.
COMMANDS.replSetStepDown = function (cmd) {
  if (cmd.$db !== 'admin') fail(13, 'replSetStepDown may only be run against the admin database.');
  if (!this.replset) fail(76, 'not running with --replSet');
  if (!V.isNumber(cmd.replSetStepDown)) fail(14, "BSON field 'replSetStepDown' is the wrong type, expected a number");
  const secs = V.num(cmd.replSetStepDown);
  // mongod's default catch-up period: 0 with force, else 10 s
  const catchUp = cmd.secondaryCatchUpPeriodSecs === undefined ? (V.truthy(cmd.force) ? 0 : 10)
    : V.num(cmd.secondaryCatchUpPeriodSecs);
  if (!(secs >= 0) || !(catchUp >= 0)) fail(2, 'stepDownSecs and secondaryCatchUpPeriodSecs must be numbers >= 0');
  if (secs < catchUp) fail(2, 'Step down period must be longer than secondaryCatchUpPeriodSecs');
  if (!this.isPrimary()) fail(10107, 'not primary so can\'t step down');
  if (!V.truthy(cmd.force)) {
    return new Promise((resolve) => setTimeout(resolve, catchUp * 1000)).then(() => {
      fail(262, `No electable secondaries caught up as of ${new Date().toISOString()}. Please use the replSetStepDown command with the argument {force: true} to force node to step down.`);
    });
  }
  this.steppedDownUntil = Date.now() + secs * 1000;
  this.stepdowns += 1;
  return { ok: 1 };
};

COMMANDS.configureFailPoint = function (cmd) {
  if (cmd.$db !== 'admin') fail(13, 'configureFailPoint may only be run against the admin database.');
  const name = cmd.configureFailPoint;
  if (name !== 'failCommand' && name !== 'onPrimaryTransactionalWrite') fail(2, `Cannot find failpoint: ${name}`);
  const slot = name === 'failCommand' ? 'failpoint' : 'txnWriteFp';
  const mode = cmd.mode;
  const data = cmd.data === undefined || (cmd.data === null && mode === 'off') ? {} : cmd.data;
  if (!V.isPlainDoc(data)) fail(14, "the 'data' field must be an object");
  const fp = { data };
  // like mongod (fail_point_cmd.cpp), the reply's count is how many times
  // the fail point has fired so far (waitForFailPoint counts from it)
  const entered = () => ({ count: Long.fromNumber(this.fpEntered[slot]), ok: 1 });
  if (mode === 'off') { this[slot] = null; return entered(); }
  if (mode === 'alwaysOn') {
    // no counters
  } else if (V.isPlainDoc(mode) && mode.times !== undefined && V.isNumber(mode.times)) {
    fp.times = V.num(mode.times);
    if (fp.times < 0) fail(2, "'times' option to 'mode' must be positive");
    if (fp.times === 0) { this[slot] = null; return entered(); }
  } else if (V.isPlainDoc(mode) && mode.skip !== undefined && V.isNumber(mode.skip)) {
    fp.skip = V.num(mode.skip);
    if (fp.skip < 0) fail(2, "'skip' option to 'mode' must be positive");
  } else if (V.isPlainDoc(mode) && mode.activationProbability !== undefined) {
    fail(2, 'activationProbability is not supported by this server');
  } else {
    fail(2, "'mode' must be one of 'off', 'alwaysOn', 'times', and 'skip'");
  }
  if (data.failCommands !== undefined && !Array.isArray(data.failCommands)) fail(14, "'failCommands' must be an array");
  if (data.errorCode !== undefined && !V.isNumber(data.errorCode)) fail(14, "'errorCode' must be a number");
  if (data.failBeforeCommitExceptionCode !== undefined && !V.isNumber(data.failBeforeCommitExceptionCode)) {
    fail(14, "'failBeforeCommitExceptionCode' must be a number");
  }
  this[slot] = fp;
  return entered();
};

// ---- CRUD ----------------------------------------------------------------------

COMMANDS.insert = function (cmd) {
  const name = collName(cmd, 'insert');
  wantType(cmd, 'insert', 'documents', ['array'], true);
  wantType(cmd, 'insert', 'ordered', ['bool']);
  this.writeConcernCheck(cmd);
  const ordered = cmd.ordered !== false;
  const coll = this.store.coll(cmd.$db, name, true);
  let n = 0;
  const writeErrors = [];
  // mongod commits the documents of one insert command together: the
  // onPrimaryTransactionalWrite fail point is evaluated once per command
  // (the retryable writes tests' README), per statement for update/delete
  let checked = false, fired = false;
  cmd.documents.forEach((doc, index) => {
    if (writeErrors.length && ordered) return;
    const prev = this.applied(index);
    if (prev !== undefined) { n += prev.n; return; }
    try {
      if (!V.isPlainDoc(doc)) fail(14, 'documents must be objects');
      if (!checked) { checked = true; this.beforeStmt(); }
      this.store.insert(coll, doc);
      n += 1;
      this.afterStmt(index, { n: 1 }, !fired);
      fired = true;
    } catch (e) {
      if (!(e instanceof MongoError)) throw e;
      writeErrors.push(writeError(index, e));
    }
  });
  const r = { n: new Int32(n) };
  if (writeErrors.length) r.writeErrors = writeErrors;
  r.ok = 1;
  return r;
};

function writeError(index, e) {
  const we = { index: new Int32(index), code: new Int32(e.code) };
  if (e.extra) Object.assign(we, e.extra);
  we.errmsg = e.message;
  return we;
}

function checkStmt(kind, stmt, i) {
  if (!V.isPlainDoc(stmt)) fail(14, `BSON field '${kind}.${i}' is the wrong type, expected type 'object'`);
  for (const k of Object.keys(stmt)) {
    if (!STMT_FIELDS[kind].includes(k)) fail(40415, `BSON field '${kind === 'updates' ? 'update' : 'delete'}.${kind}.${k}' is an unknown field.`);
  }
}

// Applies one update statement. Returns {n, nModified, upserted}.
Engine.prototype.updateOne = function (coll, db, name, filter, u, opts, vars) {
  const upd = memo(u, 'update', shape.compileUpdate);
  if (opts.multi && upd.kind === 'replacement') fail(9, 'multi update is not supported for replacement-style update');
  let matched = this.select(coll, filter, vars, opts.multi ? Infinity : 1);
  if (opts.sort && matched.length && !opts.multi) {
    matched = pipeline.sortDocs(this.select(coll, filter, vars), opts.sort).slice(0, 1);
  }
  const ctx = { isInsert: false, vars, clusterTime: this.replset ? this.store.clock.now() : undefined };
  const opType = upd.kind === 'replacement' ? 'replace' : 'update';
  if (matched.length) {
    if (matched.length > 1) this.store.guardAll(coll, matched);
    let nModified = 0;
    const results = [];
    for (const old of matched) {
      const next = upd.apply(old, ctx);
      if (!V.identical(old._id, next._id)) {
        fail(66, upd.kind === 'replacement'
          ? `After applying the update, the (immutable) field '_id' was found to have been altered to _id: ${V.render(next._id)}`
          : `Performing an update on the path '_id' would modify the immutable field '_id'`);
      }
      if (this.store.replace(coll, old, next, opType, upd)) nModified += 1;
      results.push([old, next]);
    }
    return { n: matched.length, nModified, results };
  }
  if (!opts.upsert) return { n: 0, nModified: 0, results: [] };
  const seed = update.upsertSeed(filter);
  let doc = upd.kind === 'replacement' ? upd.apply(seed, ctx) : upd.apply(seed, Object.assign({}, ctx, { isInsert: true }));
  if ('_id' in seed && !V.identical(seed._id, doc._id)) {
    fail(66, `After applying the update, the (immutable) field '_id' was found to have been altered to _id: ${V.render(doc._id)}`);
  }
  if (!('_id' in doc)) doc = Object.assign({ _id: new ObjectId() }, doc);
  const target = coll || this.store.coll(db, name, true);
  doc = this.store.insert(target, doc);
  return { n: 1, nModified: 0, upserted: doc._id, results: [[null, doc]] };
};

COMMANDS.update = function (cmd) {
  const name = collName(cmd, 'update');
  wantType(cmd, 'update', 'updates', ['array'], true);
  wantType(cmd, 'update', 'ordered', ['bool']);
  this.writeConcernCheck(cmd);
  cmd.updates.forEach((s, i) => checkStmt('updates', s, i));
  const ordered = cmd.ordered !== false;
  const vars = this.vars();
  if (V.isPlainDoc(cmd.let)) for (const k of Object.keys(cmd.let)) vars[k] = expr.compile(cmd.let[k])({}, vars);
  let n = 0, nModified = 0;
  const upserted = [];
  const writeErrors = [];
  cmd.updates.forEach((s, index) => {
    if (writeErrors.length && ordered) return;
    const prev = this.applied(index);
    if (prev !== undefined) {
      n += prev.n;
      nModified += prev.nModified;
      if (prev.upserted !== undefined) upserted.push({ index: new Int32(index), _id: prev.upserted });
      return;
    }
    try {
      if (s.q === undefined) fail(40414, "BSON field 'update.updates.q' is missing but a required field");
      if (s.u === undefined) fail(40414, "BSON field 'update.updates.u' is missing but a required field");
      if (!V.isPlainDoc(s.q)) fail(14, "BSON field 'update.updates.q' is the wrong type, expected type 'object'");
      const coll = this.store.coll(cmd.$db, name, false);
      // mongod's write_ops_exec.cpp: a multi update is no retryable write
      if (this.txn && V.truthy(s.multi)) fail(72, 'Cannot use (or request) retryable writes with multi=true');
      this.beforeStmt();
      const r = this.updateOne(coll, cmd.$db, name, s.q, s.u, { multi: V.truthy(s.multi), upsert: V.truthy(s.upsert) }, vars);
      n += r.n;
      nModified += r.nModified;
      if (r.upserted !== undefined) upserted.push({ index: new Int32(index), _id: r.upserted });
      if (r.nModified || r.upserted !== undefined) this.afterStmt(index, { n: r.n, nModified: r.nModified, upserted: r.upserted });
    } catch (e) {
      if (!(e instanceof MongoError)) throw e;
      writeErrors.push(writeError(index, e));
    }
  });
  const r = { n: new Int32(n) };
  if (upserted.length) r.upserted = upserted;
  r.nModified = new Int32(nModified);
  if (writeErrors.length) r.writeErrors = writeErrors;
  r.ok = 1;
  return r;
};

COMMANDS.delete = function (cmd) {
  const name = collName(cmd, 'delete');
  wantType(cmd, 'delete', 'deletes', ['array'], true);
  this.writeConcernCheck(cmd);
  cmd.deletes.forEach((s, i) => checkStmt('deletes', s, i));
  const ordered = cmd.ordered !== false;
  const vars = this.vars();
  let n = 0;
  const writeErrors = [];
  cmd.deletes.forEach((s, index) => {
    if (writeErrors.length && ordered) return;
    const prev = this.applied(index);
    if (prev !== undefined) { n += prev.n; return; }
    try {
      if (s.q === undefined) fail(40414, "BSON field 'delete.deletes.q' is missing but a required field");
      if (s.limit === undefined) fail(40414, "BSON field 'delete.deletes.limit' is missing but a required field");
      const limit = V.num(s.limit);
      if (limit !== 0 && limit !== 1) fail(9, `The limit field in delete objects must be 0 or 1. Got ${limit}`);
      const coll = this.store.coll(cmd.$db, name, false);
      if (this.txn && limit === 0) fail(72, 'Cannot use (or request) retryable writes with limit=0');
      this.beforeStmt();
      const docs = this.select(coll, s.q, vars, limit === 1 ? 1 : Infinity);
      if (docs.length > 1) this.store.guardAll(coll, docs);
      let removed = 0;
      for (const d of docs) if (this.store.remove(coll, d)) removed += 1;
      n += removed;
      if (removed) this.afterStmt(index, { n: removed });
    } catch (e) {
      if (!(e instanceof MongoError)) throw e;
      writeErrors.push(writeError(index, e));
    }
  });
  const r = { n: new Int32(n) };
  if (writeErrors.length) r.writeErrors = writeErrors;
  r.ok = 1;
  return r;
};

COMMANDS.find = function (cmd) {
  const name = collName(cmd, 'find');
  wantType(cmd, 'find', 'filter', ['object']);
  wantType(cmd, 'find', 'sort', ['object']);
  wantType(cmd, 'find', 'projection', ['object']);
  wantType(cmd, 'find', 'skip', ['number']);
  wantType(cmd, 'find', 'limit', ['number']);
  wantType(cmd, 'find', 'batchSize', ['number']);
  const skip = intOf(cmd.skip, 0), limit = intOf(cmd.limit, 0), batchSize = intOf(cmd.batchSize, undefined);
  if (skip < 0) fail(51024, `BSON field 'skip' value must be >= 0, actual value '${skip}'`);
  if (limit < 0) fail(51024, `BSON field 'limit' value must be >= 0, actual value '${limit}'`);
  if (batchSize !== undefined && batchSize < 0) fail(51024, `BSON field 'batchSize' value must be >= 0, actual value '${batchSize}'`);
  const vars = this.vars();
  const coll = this.store.coll(cmd.$db, name, false);
  const proj = cmd.projection && Object.keys(cmd.projection).length ? memo(cmd.projection, 'projection', (f) => shape.compileProjection(f, 'projection')) : null;
  let docs;
  if (cmd.sort && Object.keys(cmd.sort).length) {
    docs = pipeline.sortDocs(this.select(coll, cmd.filter, vars), cmd.sort);
  } else {
    docs = this.select(coll, cmd.filter, vars, limit ? skip + limit : Infinity);
  }
  if (skip) docs = docs.slice(skip);
  if (limit) docs = docs.slice(0, limit);
  if (proj) docs = docs.map((d) => proj(d, vars));
  return this.cursorReply(`${cmd.$db}.${name}`, docs, cmd.singleBatch ? undefined : batchSize === undefined ? 101 : batchSize, cmd.singleBatch);
};

Engine.prototype.cursorReply = function (ns, docs, firstBatchSize, single) {
  const cursor = { kind: 'find', ns, docs, pos: 0 };
  const first = this.batchFrom(cursor, firstBatchSize);
  let id = Long.fromNumber(0);
  if (cursor.pos < docs.length && !single) id = this.newCursor(cursor);
  return { cursor: { firstBatch: first, id, ns }, ok: 1 };
};

COMMANDS.getMore = function (cmd) {
  const idv = cmd.getMore;
  if (V.typeName(idv) !== 'long') fail(14, `BSON field 'getMore.getMore' is the wrong type '${V.typeName(idv)}', expected type 'long'`);
  wantType(cmd, 'getMore', 'collection', ['string'], true);
  wantType(cmd, 'getMore', 'batchSize', ['number']);
  const cursor = this.cursors.get(idv.toString());
  if (!cursor) fail(43, `cursor id ${idv.toString()} not found`);
  if (cursor.ns.split('.').slice(1).join('.') !== cmd.collection && cursor.ns !== `${cmd.$db}.${cmd.collection}`) {
    fail(13, `Requested getMore on namespace '${cmd.$db}.${cmd.collection}', but cursor belongs to a different namespace ${cursor.ns}`);
  }
  validateLsid(idv, cmd, cursor);
  const batchSize = intOf(cmd.batchSize, undefined);
  if (cursor.kind === 'changeStream') return this.changeStreamGetMore(cursor, cmd, batchSize, this.direct);
  const batch = this.batchFrom(cursor, batchSize === 0 ? undefined : batchSize);
  let id = cursor.id;
  if (cursor.pos >= cursor.docs.length) { this.cursors.delete(idv.toString()); id = Long.fromNumber(0); }
  return { cursor: { nextBatch: batch, id, ns: cursor.ns }, ok: 1 };
};

// mongod's validateLSID (src/mongo/db/commands/getmore_cmd.cpp): a getMore
// runs in the session its cursor was created in, or in none when the cursor
// was created outside a session. killCursors checks no session (mongod's
// CursorManager::killCursor): any session, or none, may kill a cursor.
function validateLsid(idv, cmd, cursor) {
  const mine = sessionKey(cmd);
  const its = cursor.lsid ? sessionKey(cursor) : null;
  if (mine !== null && its === null) {
    fail(50736, `Cannot run getMore on cursor ${idv}, which was not created in a session, in session ${sessionText(cmd.lsid)}`);
  }
  if (mine === null && its !== null) {
    fail(50737, `Cannot run getMore on cursor ${idv}, which was created in session ${sessionText(cursor.lsid)}, without an lsid`);
  }
  if (mine !== its) {
    fail(50738, `Cannot run getMore on cursor ${idv}, which was created in session ${sessionText(cursor.lsid)}, in session ${sessionText(cmd.lsid)}`);
  }
}

COMMANDS.killCursors = function (cmd) {
  collName(cmd, 'killCursors');
  wantType(cmd, 'killCursors', 'cursors', ['array'], true);
  const killed = [], notFound = [];
  for (const id of cmd.cursors) {
    const key = id.toString();
    const c = this.cursors.get(key);
    if (c) {
      this.cursors.delete(key);
      if (c.wake) c.wake();
      killed.push(id);
    } else notFound.push(id);
  }
  return { cursorsKilled: killed, cursorsNotFound: notFound, cursorsAlive: [], cursorsUnknown: [], ok: 1 };
};

COMMANDS.findAndModify = function (cmd) {
  const name = collName(cmd, Object.keys(cmd)[0]);
  const fam = 'findAndModify';
  wantType(cmd, fam, 'query', ['object', 'null']);
  wantType(cmd, fam, 'sort', ['object']);
  wantType(cmd, fam, 'fields', ['object']);
  wantType(cmd, fam, 'remove', ['bool', 'number']);
  wantType(cmd, fam, 'new', ['bool', 'number']);
  wantType(cmd, fam, 'upsert', ['bool', 'number']);
  wantType(cmd, fam, 'update', ['object', 'array']);
  this.writeConcernCheck(cmd);
  const remove = V.truthy(cmd.remove), isNew = V.truthy(cmd.new), upsert = V.truthy(cmd.upsert);
  if (remove && cmd.update !== undefined) fail(9, 'Cannot specify both an update and remove=true');
  if (!remove && cmd.update === undefined) fail(9, 'Either an update or remove=true must be specified');
  if (remove && upsert) fail(9, 'Cannot specify both upsert=true and remove=true ');
  if (remove && isNew) fail(9, "Cannot specify both new=true and remove=true; 'remove' always returns the deleted document");
  const vars = this.vars();
  if (V.isPlainDoc(cmd.let)) for (const k of Object.keys(cmd.let)) vars[k] = expr.compile(cmd.let[k])({}, vars);
  const filter = cmd.query || {};
  const proj = cmd.fields && Object.keys(cmd.fields).length ? memo(cmd.fields, 'projection', (f) => shape.compileProjection(f, 'projection')) : null;
  const show = (d) => (d === null || d === undefined ? null : proj ? proj(d, vars) : d);
  const coll = this.store.coll(cmd.$db, name, false);
  let target;
  if (cmd.sort && Object.keys(cmd.sort).length) target = pipeline.sortDocs(this.select(coll, filter, vars), cmd.sort)[0];
  else target = this.select(coll, filter, vars, 1)[0];
  if (target || upsert) this.beforeStmt();
  if (remove) {
    if (!target) return { lastErrorObject: { n: new Int32(0) }, value: null, ok: 1 };
    this.store.remove(coll, target);
    this.afterStmt(0, {});
    return { lastErrorObject: { n: new Int32(1) }, value: show(target), ok: 1 };
  }
  const upd = memo(cmd.update, 'update', shape.compileUpdate);
  if (target) {
    const ctx = { isInsert: false, vars, clusterTime: this.replset ? this.store.clock.now() : undefined };
    const next = upd.apply(target, ctx);
    if (!V.identical(target._id, next._id)) {
      fail(66, upd.kind === 'replacement'
        ? `After applying the update, the (immutable) field '_id' was found to have been altered to _id: ${V.render(next._id)}`
        : `Performing an update on the path '_id' would modify the immutable field '_id'`);
    }
    if (this.store.replace(coll, target, next, upd.kind === 'replacement' ? 'replace' : 'update', upd)) this.afterStmt(0, {});
    return { lastErrorObject: { n: new Int32(1), updatedExisting: true }, value: show(isNew ? next : target), ok: 1 };
  }
  if (!upsert) return { lastErrorObject: { n: new Int32(0), updatedExisting: false }, value: null, ok: 1 };
  const r = this.updateOne(coll, cmd.$db, name, filter, cmd.update, { upsert: true }, vars);
  const doc = r.results[0][1];
  this.afterStmt(0, {});
  return { lastErrorObject: { n: new Int32(1), updatedExisting: false, upserted: doc._id }, value: isNew ? show(doc) : null, ok: 1 };
};

COMMANDS.count = function (cmd) {
  const name = collName(cmd, 'count');
  wantType(cmd, 'count', 'query', ['object', 'null']);
  const vars = this.vars();
  let docs = this.select(this.store.coll(cmd.$db, name, false), cmd.query || {}, vars);
  const skip = intOf(cmd.skip, 0);
  const limit = Math.abs(intOf(cmd.limit, 0));
  if (skip) docs = docs.slice(skip);
  if (limit) docs = docs.slice(0, limit);
  return { n: new Int32(docs.length), ok: 1 };
};

COMMANDS.distinct = function (cmd) {
  const name = collName(cmd, 'distinct');
  wantType(cmd, 'distinct', 'key', ['string'], true);
  wantType(cmd, 'distinct', 'query', ['object', 'null']);
  const vars = this.vars();
  const docs = this.select(this.store.coll(cmd.$db, name, false), cmd.query || {}, vars);
  const values = [];
  const parts = cmd.key.split('.');
  for (const d of docs) {
    for (const v of query.reach(d, parts, 0, [])) {
      const items = Array.isArray(v) ? v : [v];
      for (const it of items) {
        if (it === undefined) continue;
        if (!values.some((x) => V.equals(x, it))) values.push(it);
      }
    }
  }
  values.sort(V.compare);
  return { values, ok: 1 };
};

COMMANDS.aggregate = function (cmd) {
  const target = cmd.aggregate;
  const dbLevel = V.isNumber(target) && V.num(target) === 1;
  if (!dbLevel && typeof target !== 'string') fail(73, `collection name has invalid type ${V.typeName(target)}`);
  wantType(cmd, 'aggregate', 'pipeline', ['array'], true);
  if (cmd.explain) fail(72, 'explain is not supported by this server');
  const pl = cmd.pipeline;
  if (cmd.cursor === undefined) fail(9, "The 'cursor' option is required, except for aggregate with the explain argument");
  wantType(cmd, 'aggregate', 'cursor', ['object']);
  const batchSize = cmd.cursor.batchSize === undefined ? 101 : intOf(cmd.cursor.batchSize);
  const first = pl.length && V.isPlainDoc(pl[0]) ? Object.keys(pl[0])[0] : null;
  if (first === '$changeStream') {
    if (!this.replset) fail(40573, 'The $changeStream stage is only supported on replica sets');
    const spec = pl[0].$changeStream;
    let db = cmd.$db, coll = dbLevel ? null : target;
    if (V.isPlainDoc(spec) && spec.allChangesForCluster) {
      if (cmd.$db !== 'admin' || !dbLevel) fail(ErrorCodes_InvalidOptions(), "$changeStream may not be opened on the internal admin database");
    } else if (cmd.$db === 'admin' || cmd.$db === 'config' || cmd.$db === 'local') {
      fail(73, `$changeStream may not be opened on the internal ${cmd.$db} database`);
    }
    const cs = new ChangeStream(this, db, coll, spec, pl.slice(1));
    const c = { kind: 'changeStream', cs, ns: cs.ns };
    const id = this.newCursor(c);
    // The first batch is empty unless events are already waiting (resume).
    const { docs, token } = cs.read(batchSize);
    const reply = { cursor: { firstBatch: docs, postBatchResumeToken: token, id, ns: cs.ns }, ok: 1 };
    if (cs.invalidated) { this.cursors.delete(id.toString()); reply.cursor.id = Long.fromNumber(0); }
    return reply;
  }
  if (dbLevel) fail(73, 'aggregate with {aggregate: 1} is only supported for $changeStream here');
  for (const st of pl) {
    const n = V.isPlainDoc(st) ? Object.keys(st)[0] : '';
    if (n === '$changeStream') fail(40602, '$changeStream is only valid as the first stage in a pipeline.');
  }
  const vars = this.vars();
  if (V.isPlainDoc(cmd.let)) for (const k of Object.keys(cmd.let)) vars[k] = expr.compile(cmd.let[k])({}, vars);
  const run = pipeline.compileStages(pl);
  const coll = this.store.coll(cmd.$db, target, false);
  let input;
  // Leading $match on _id: O(1) lookup instead of a scan.
  if (pl.length && pl[0].$match && query.idEquality(pl[0].$match) !== undefined) input = this.select(coll, pl[0].$match, vars);
  else input = coll ? [...coll.docs.values()] : [];
  const out = run(input, vars);
  return this.cursorReply(`${cmd.$db}.${target}`, out, batchSize);
};

function ErrorCodes_InvalidOptions() { return 72; }

Engine.prototype.changeStreamGetMore = function (cursor, cmd, batchSize, direct) {
  const cs = cursor.cs;
  const limit = batchSize === undefined || batchSize === 0 ? 1000 : batchSize;
  const finish = (docs, token) => {
    const reply = { cursor: { nextBatch: docs, postBatchResumeToken: token, id: cursor.id, ns: cursor.ns }, ok: 1 };
    if (cs.invalidated) { this.cursors.delete(cursor.id.toString()); reply.cursor.id = Long.fromNumber(0); }
    return reply;
  };
  const now = cs.read(limit);
  if (now.docs.length || cs.invalidated) return finish(now.docs, now.token);
  const wait = cmd.maxTimeMS === undefined ? 1000 : intOf(cmd.maxTimeMS, 1000);
  if (wait <= 0) return finish(now.docs, now.token);
  // Like mongod, an awaitData getMore returns when an event passes the
  // stream's pipeline or at maxTimeMS: events the pipeline filters out do
  // not end the wait (the stream still advances past them). An event that
  // ends the wait is sent at once, from the command that wrote it, before
  // that command's own reply (direct: the getMore's connection).
  const idKey = cursor.id.toString();
  return new Promise((resolve, reject) => {
    let timer = null, pending = false;
    const done = (final) => {
      pending = false;
      if (timer === null && !final) return;   // already answered
      try {
        if (!this.cursors.has(idKey)) {
          stop();
          reject(new MongoError(43, `cursor id ${cursor.id} not found`));
          return;
        }
        const r = cs.read(limit);
        if (!final && !r.docs.length && !cs.invalidated) return;
        stop();
        const body = finish(r.docs, r.token);
        if (direct && direct.sendNow(this.reply(body))) resolve(SENT);
        else resolve(body);
      } catch (e) { stop(); reject(e); }
    };
    const stop = () => {
      this.store.listeners.delete(listener);
      if (timer) clearTimeout(timer);
      timer = null;
      cursor.wake = null;
    };
    const listener = (ev) => {
      if (cs.relevant(ev) && !pending) { pending = true; this.queueWake(() => done(false)); }
    };
    this.store.listeners.add(listener);
    cursor.wake = () => done(true);
    timer = setTimeout(() => done(true), wait);
  });
};

// ---- collections, databases, indexes -------------------------------------------

COMMANDS.create = function (cmd) {
  const name = collName(cmd, 'create');
  if (this.store.coll(cmd.$db, name, false)) fail(48, `Collection ${cmd.$db}.${name} already exists.`);
  this.store.coll(cmd.$db, name, true);
  return { ok: 1 };
};

COMMANDS.drop = function (cmd) {
  const name = collName(cmd, 'drop');
  const coll = this.store.coll(cmd.$db, name, false);
  if (!coll) fail(26, 'ns not found');
  const n = coll.indexes.length;
  this.store.dropCollection(coll);
  return { nIndexesWas: new Int32(n), ns: `${cmd.$db}.${name}`, ok: 1 };
};

COMMANDS.dropDatabase = function (cmd) {
  const db = this.store.db(cmd.$db, false);
  if (db) this.store.dropDatabase(db);
  return { dropped: cmd.$db, ok: 1 };
};

COMMANDS.listDatabases = function (cmd) {
  if (cmd.$db !== 'admin') fail(13, 'listDatabases may only be run against the admin database.');
  const databases = [];
  for (const db of this.store.dbs.values()) {
    if (!db.collections.size) continue;
    const e = { name: db.name };
    if (!cmd.nameOnly) { e.sizeOnDisk = Long.fromNumber(0); e.empty = false; }
    databases.push(e);
  }
  const r = { databases };
  if (!cmd.nameOnly) r.totalSize = Long.fromNumber(0);
  r.ok = 1;
  return r;
};

COMMANDS.listCollections = function (cmd) {
  const db = this.store.db(cmd.$db, false);
  const out = [];
  if (db) {
    for (const c of db.collections.values()) {
      if (cmd.nameOnly) out.push({ name: c.name, type: 'collection' });
      else {
        out.push({ name: c.name, type: 'collection', options: {}, info: { readOnly: false, uuid: c.uuid },
          idIndex: { v: new Int32(2), key: { _id: new Int32(1) }, name: '_id_' } });
      }
    }
  }
  const m = cmd.filter ? this.matcher(cmd.filter, this.vars()) : null;
  const docs = m ? out.filter((d) => m(d)) : out;
  const bs = cmd.cursor && cmd.cursor.batchSize !== undefined ? intOf(cmd.cursor.batchSize) : 101;
  return this.cursorReply(`${cmd.$db}.$cmd.listCollections`, docs, bs);
};

const INDEX_OPTIONS = new Set(['key', 'name', 'unique', 'expireAfterSeconds', 'sparse', 'partialFilterExpression',
  'background', 'v', 'hidden', 'collation', 'weights', 'default_language', 'language_override', 'textIndexVersion',
  '2dsphereIndexVersion', 'bits', 'min', 'max', 'storageEngine', 'wildcardProjection', 'ns', 'dropDups']);

function sameIndexKey(a, b) {
  const ka = Object.keys(a), kb = Object.keys(b);
  return ka.length === kb.length && ka.every((k, i) => k === kb[i] && V.num(a[k]) === V.num(b[k]));
}

COMMANDS.createIndexes = function (cmd) {
  const name = collName(cmd, 'createIndexes');
  wantType(cmd, 'createIndexes', 'indexes', ['array'], true);
  if (!cmd.indexes.length) fail(2, 'Must specify at least one index to create');
  const existed = !!this.store.coll(cmd.$db, name, false);
  const specs = cmd.indexes.map((spec) => {
    if (!V.isPlainDoc(spec)) fail(14, "The field 'indexes' must be an array of objects");
    for (const k of Object.keys(spec)) {
      if (!INDEX_OPTIONS.has(k)) fail(197, `The field '${k}' is not valid for an index specification. Specification: ${V.render(spec)}`);
    }
    if (!V.isPlainDoc(spec.key) || !Object.keys(spec.key).length) fail(67, "The 'key' field must be a non-empty object");
    if (typeof spec.name !== 'string' || !spec.name) fail(9, "The 'name' field must be a non-empty string");
    for (const k of Object.keys(spec.key)) {
      const d = spec.key[k];
      if (!(V.isNumber(d) && V.num(d) !== 0) && typeof d !== 'string') fail(67, `Values in the index key pattern can only be numbers or strings, found ${V.render(d)}`);
    }
    if (spec.expireAfterSeconds !== undefined) {
      if (!V.isNumber(spec.expireAfterSeconds)) fail(2, `TTL index 'expireAfterSeconds' option must be numeric, but received a type of '${V.typeName(spec.expireAfterSeconds)}'. Index spec: ${V.render(spec)}`);
      const s = V.num(spec.expireAfterSeconds);
      if (s < 0) fail(2, `TTL index 'expireAfterSeconds' option must be within an acceptable range, try a lower number. Index spec: ${V.render(spec)}`);
      if (Object.keys(spec.key).length !== 1) fail(67, 'TTL indexes are single-field indexes, compound indexes do not support TTL.');
      if (spec.key._id !== undefined) fail(67, 'The field \'expireAfterSeconds\' is not valid for an _id index specification.');
    }
    if (spec.key._id !== undefined && Object.keys(spec.key).length === 1 && spec.unique === false) {
      fail(197, "The field 'unique' is not valid for an _id index specification.");
    }
    return spec;
  });
  const coll = this.store.coll(cmd.$db, name, true);
  const before = coll.indexes.length;
  let created = 0;
  for (const spec of specs) {
    const same = coll.indexes.find((ix) => ix.name === spec.name);
    const sameKey = coll.indexes.find((ix) => sameIndexKey(ix.spec.key, spec.key));
    if (same) {
      if (!sameIndexKey(same.spec.key, spec.key)) {
        fail(86, `An existing index has the same name as the requested index. When index names are not specified, they are auto generated and can cause conflicts. Please refer to our documentation. Requested index: ${V.render(spec)}, existing index: ${V.render(same.spec)}`);
      }
      if (!!same.spec.unique !== !!spec.unique || numOr(same.spec.expireAfterSeconds) !== numOr(spec.expireAfterSeconds)) {
        fail(85, `An equivalent index already exists with the same name but different options. Requested index: ${V.render(spec)}, existing index: ${V.render(same.spec)}`);
      }
      continue;
    }
    if (sameKey) {
      if (sameKey.name === '_id_' || !!sameKey.spec.unique !== !!spec.unique || numOr(sameKey.spec.expireAfterSeconds) !== numOr(spec.expireAfterSeconds)) {
        fail(85, `An existing index has the same key pattern but a different name or options. Requested index: ${V.render(spec)}, existing index: ${V.render(sameKey.spec)}`);
      }
      fail(85, `Index already exists with a different name: ${sameKey.name}`);
    }
    const clean = { v: new Int32(2), key: spec.key, name: spec.name };
    for (const k of ['unique', 'sparse', 'expireAfterSeconds', 'partialFilterExpression', 'hidden', 'collation']) {
      if (spec[k] !== undefined) clean[k] = spec[k];
    }
    if (clean.unique === false) delete clean.unique;
    const ix = new Index(clean);
    if (ix.unique) {
      for (const d of coll.docs.values()) {
        const k = ix.keyOf(d);
        if (k === null) continue;
        if (ix.map.has(k)) {
          const { dupKeyError } = require('./store');
          throw dupKeyError(coll, ix, d);
        }
        ix.map.set(k, require('./store').valueKey(d._id));
      }
    }
    coll.indexes.push(ix);
    created += 1;
  }
  const r = { numIndexesBefore: new Int32(before), numIndexesAfter: new Int32(coll.indexes.length) };
  if (!created) r.note = 'all indexes already exist';
  r.createdCollectionAutomatically = !existed;
  r.ok = 1;
  return r;
};

function numOr(v) { return v === undefined ? undefined : V.num(v); }

COMMANDS.listIndexes = function (cmd) {
  const name = collName(cmd, 'listIndexes');
  const coll = this.store.coll(cmd.$db, name, false);
  if (!coll) fail(26, `ns does not exist: ${cmd.$db}.${name}`);
  const docs = coll.indexes.map((ix) => ix.spec);
  const bs = cmd.cursor && cmd.cursor.batchSize !== undefined ? intOf(cmd.cursor.batchSize) : 101;
  return this.cursorReply(`${cmd.$db}.$cmd.listIndexes.${name}`, docs, bs);
};

COMMANDS.dropIndexes = function (cmd) {
  const name = collName(cmd, Object.keys(cmd)[0]);
  const coll = this.store.coll(cmd.$db, name, false);
  if (!coll) fail(26, `ns not found ${cmd.$db}.${name}`);
  const was = coll.indexes.length;
  const idx = cmd.index;
  if (idx === undefined) fail(40414, "BSON field 'dropIndexes.index' is missing but a required field");
  const drop = (pred, label) => {
    const i = coll.indexes.findIndex(pred);
    if (i < 0) fail(27, label);
    if (coll.indexes[i].name === '_id_') fail(72, 'cannot drop _id index');
    coll.indexes.splice(i, 1);
  };
  if (idx === '*') coll.indexes = coll.indexes.filter((ix) => ix.name === '_id_');
  else if (typeof idx === 'string') drop((ix) => ix.name === idx, `index not found with name [${idx}]`);
  else if (Array.isArray(idx)) for (const n of idx) drop((ix) => ix.name === n, `index not found with name [${n}]`);
  else if (V.isPlainDoc(idx)) drop((ix) => sameIndexKey(ix.spec.key, idx), `can't find index with key: ${V.render(idx)}`);
  else fail(14, "BSON field 'dropIndexes.index' is the wrong type");
  return { nIndexesWas: new Int32(was), ok: 1 };
};
COMMANDS.deleteIndexes = COMMANDS.dropIndexes;

COMMANDS.dbStats = function (cmd) {
  const db = this.store.db(cmd.$db, false);
  let objects = 0;
  if (db) for (const c of db.collections.values()) objects += c.docs.size;
  return { db: cmd.$db, collections: new Int32(db ? db.collections.size : 0), objects: Long.fromNumber(objects), ok: 1 };
};

COMMANDS.collStats = function (cmd) {
  const name = collName(cmd, 'collStats');
  const coll = this.store.coll(cmd.$db, name, false);
  if (!coll) fail(26, `Collection [${cmd.$db}.${name}] not found.`);
  return { ns: coll.ns, count: new Int32(coll.docs.size), nindexes: new Int32(coll.indexes.length), ok: 1 };
};

// (run by Engine.runInTxn)
for (const name of ['abortTransaction', 'commitTransaction']) {
  COMMANDS[name] = function () {
    fail(125, `${name} must be run within a transaction`);
  };
}

auth.install(COMMANDS);

module.exports = { Engine, COMMANDS, CLUSTER_TIME, SENT };
