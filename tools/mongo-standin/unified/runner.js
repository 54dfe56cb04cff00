'use strict';
// A runner for MongoDB's unified test format
// (source/unified-test-format/unified-test-format.md of mongodb/specifications),
// on the official Node.js driver, with what the transactions tests
// (source/transactions/tests/unified) need: client, database, collection and
// session entities; initialData and outcome; the CRUD operations, bulkWrite,
// the session's transaction operations, fail points and the test runner's
// assertions; expectResult, expectError and expectEvents (commandStartedEvent)
// with the $$ operators. Whatever else a test asks for makes the test skipped
// with the reason ("operation X not supported by the runner"), never passed.
//
// runFile(path, { uri }) -> [{ file, description, status, reason }], where
// status is 'pass', 'fail' or 'skip'.

const fs = require('fs');
const path = require('path');
const { MongoClient, MongoServerError, BSON } = require('mongodb');

const { EJSON, Long, Int32, Double, Binary, ObjectId, Timestamp, Decimal128 } = BSON;
const CODES = require('../lib/error_codes.json');

// A test the runner cannot run as written.
class Unsupported extends Error {}

// ---- matching (unified-test-format.md, "Evaluating Matches") ------------------

const isDoc = (v) => v !== null && typeof v === 'object' && !Array.isArray(v) && !Buffer.isBuffer(v)
  && !(v instanceof Long) && !(v instanceof Int32) && !(v instanceof Double) && !(v instanceof Binary)
  && !(v instanceof ObjectId) && !(v instanceof Timestamp) && !(v instanceof Decimal128) && !(v instanceof Date)
  && !(v instanceof RegExp);
const isOp = (v) => isDoc(v) && Object.keys(v).length === 1 && Object.keys(v)[0].startsWith('$$');

function num(v) {
  if (typeof v === 'number') return v;
  if (typeof v === 'bigint') return Number(v);
  if (v instanceof Long) return v.toNumber();
  if (v instanceof Int32 || v instanceof Double) return v.valueOf();
  return undefined;
}

function typeName(v) {
  if (v === null) return 'null';
  if (v === undefined) return 'undefined';
  if (typeof v === 'string') return 'string';
  if (typeof v === 'boolean') return 'bool';
  if (v instanceof Long || typeof v === 'bigint') return 'long';
  if (v instanceof Int32) return 'int';
  if (v instanceof Double) return 'double';
  if (typeof v === 'number') return Number.isInteger(v) && Math.abs(v) < 2 ** 31 ? 'int' : 'double';
  if (v instanceof Decimal128) return 'decimal';
  if (v instanceof Binary || Buffer.isBuffer(v)) return 'binData';
  if (v instanceof ObjectId) return 'objectId';
  if (v instanceof Timestamp) return 'timestamp';
  if (v instanceof Date) return 'date';
  if (v instanceof RegExp) return 'regex';
  if (Array.isArray(v)) return 'array';
  return 'object';
}

function show(v) {
  try { return EJSON.stringify(v, { relaxed: true }); } catch { return String(v); }
}

function fail(where, msg) {
  throw new Error(`${where || '(root)'}: ${msg}`);
}

// match(expected, actual): throws on a mismatch. root: extra keys allowed.
function match(expected, actual, ctx, where = '', root = true) {
  if (isOp(expected)) { special(expected, actual, ctx, where, root); return; }
  if (isDoc(expected)) {
    if (!isDoc(actual)) fail(where, `expected a document ${show(expected)}, got ${show(actual)}`);
    for (const [k, v] of Object.entries(expected)) {
      const w = `${where}.${k}`;
      if (isOp(v)) {
        const op = Object.keys(v)[0];
        if (op === '$$exists') {
          if (v[op] !== (actual[k] !== undefined)) {
            fail(w, `expected ${v[op] ? 'present' : 'absent'}, got ${show(actual[k])}`);
          }
          continue;
        }
        if (op === '$$unsetOrMatches') {
          if (actual[k] === undefined) continue;
          match(v[op], actual[k], ctx, w, false);
          continue;
        }
      }
      if (actual[k] === undefined) fail(w, `missing, expected ${show(v)}`);
      match(v, actual[k], ctx, w, false);
    }
    if (!root) {
      for (const k of Object.keys(actual)) {
        if (actual[k] !== undefined && !(k in expected)) fail(`${where}.${k}`, `unexpected field ${show(actual[k])}`);
      }
    }
    return;
  }
  if (Array.isArray(expected)) {
    if (!Array.isArray(actual)) fail(where, `expected an array ${show(expected)}, got ${show(actual)}`);
    if (expected.length !== actual.length) {
      fail(where, `expected ${expected.length} elements ${show(expected)}, got ${actual.length} ${show(actual)}`);
    }
    expected.forEach((e, i) => match(e, actual[i], ctx, `${where}[${i}]`, false));
    return;
  }
  scalar(expected, actual, where);
}

function scalar(expected, actual, where) {
  const en = num(expected);
  if (en !== undefined) {
    const an = num(actual);
    if (an === undefined || an !== en) fail(where, `expected ${show(expected)}, got ${show(actual)}`);
    return;
  }
  if (expected === null) {
    if (actual !== null) fail(where, `expected null, got ${show(actual)}`);
    return;
  }
  if (typeof expected === 'string' || typeof expected === 'boolean') {
    if (expected !== actual) fail(where, `expected ${show(expected)}, got ${show(actual)}`);
    return;
  }
  if (show(expected) !== show(actual)) fail(where, `expected ${show(expected)}, got ${show(actual)}`);
}

const TYPE_ALIASES = { number: ['int', 'long', 'double', 'decimal'] };

function special(expected, actual, ctx, where, root) {
  const [op, arg] = Object.entries(expected)[0];
  switch (op) {
    case '$$exists':
      if (arg !== (actual !== undefined)) fail(where, `expected ${arg ? 'present' : 'absent'}`);
      return;
    case '$$unsetOrMatches':
      if (actual !== undefined) match(arg, actual, ctx, where, root);
      return;
    case '$$type': {
      const want = (Array.isArray(arg) ? arg : [arg]).flatMap((t) => TYPE_ALIASES[t] || [t]);
      const got = typeName(actual);
      if (!want.includes(got)) fail(where, `expected type ${show(arg)}, got ${got} ${show(actual)}`);
      return;
    }
    case '$$sessionLsid': {
      const lsid = ctx.lsids.get(arg);
      if (!lsid) throw new Unsupported(`$$sessionLsid of unknown session ${arg}`);
      match(lsid, actual, ctx, where, false);
      return;
    }
    case '$$matchesEntity': {
      if (!ctx.entities.has(arg)) fail(where, `unknown entity ${arg}`);
      match(ctx.entities.get(arg), actual, ctx, where, false);
      return;
    }
    default:
      throw new Unsupported(`matching operator ${op} not supported by the runner`);
  }
}

// ---- requirements ---------------------------------------------------------

function versionLess(a, b) {
  const pa = a.split('.').map(Number);
  const pb = b.split('.').map(Number);
  for (let i = 0; i < 3; i++) {
    const x = pa[i] || 0;
    const y = pb[i] || 0;
    if (x !== y) return x < y;
  }
  return false;
}

// null when met, else the reason it is not
function unmet(req, server) {
  const why = [];
  if (req.minServerVersion && versionLess(server.version, req.minServerVersion)) {
    why.push(`minServerVersion ${req.minServerVersion} (server ${server.version})`);
  }
  if (req.maxServerVersion && versionLess(req.maxServerVersion, server.version)) {
    why.push(`maxServerVersion ${req.maxServerVersion} (server ${server.version})`);
  }
  if (req.topologies && !req.topologies.includes(server.topology)) {
    why.push(`topologies ${req.topologies.join('/')} (server ${server.topology})`);
  }
  if (req.serverless === 'require') why.push('serverless required');
  if (req.auth === true && !server.auth) why.push('auth required');
  if (req.auth === false && server.auth) why.push('no auth required');
  if (req.csfle) why.push('csfle required');
  if (req.serverParameters) {
    for (const [k, v] of Object.entries(req.serverParameters)) {
      const got = server.parameters[k];
      try { match(v, got, { lsids: new Map(), entities: new Map() }, k); } catch (e) {
        why.push(`serverParameters ${k}: ${show(v)} (server ${show(got)})`);
      }
    }
  }
  for (const k of Object.keys(req)) {
    if (!['minServerVersion', 'maxServerVersion', 'topologies', 'serverless', 'auth', 'csfle',
      'serverParameters'].includes(k)) why.push(`runOnRequirement ${k} not supported by the runner`);
  }
  return why.length ? why.join(', ') : null;
}

function requirementsUnmet(reqs, server) {
  if (!reqs || reqs.length === 0) return null;
  const whys = [];
  for (const r of reqs) {
    const w = unmet(r, server);
    if (w === null) return null;
    whys.push(w);
  }
  return `runOnRequirements not met: ${whys.join(' | ')}`;
}

async function describeServer(client, uri) {
  const admin = client.db('admin');
  const hello = await admin.command({ hello: 1 });
  const info = await admin.command({ buildInfo: 1 });
  let topology = 'single';
  if (hello.msg === 'isdbgrid') topology = 'sharded';
  else if (hello.setName) topology = 'replicaset';
  if (hello.serviceId) topology = 'load-balanced';
  const parameters = await admin.command({ getParameter: '*' }).catch(() => ({}));
  const auth = /^mongodb(\+srv)?:\/\/[^/@]+@/.test(uri); // credentials in the URI: a server with auth on
  return { version: info.version, topology, auth, parameters };
}

// ---- entities ---------------------------------------------------------------

const SENSITIVE = new Set(['authenticate', 'saslStart', 'saslContinue', 'getnonce', 'createUser', 'updateUser',
  'copydbgetnonce', 'copydbsaslstart', 'copydb']);

function withUriOptions(uri, opts) {
  if (!opts || Object.keys(opts).length === 0) return uri;
  const u = new URL(uri);
  for (const [k, v] of Object.entries(opts)) u.searchParams.set(k, String(v));
  return u.toString();
}

function concern(v, kind) {
  if (v === undefined) return undefined;
  if (kind === 'readPreference') return v.mode ? v.mode.replace(/^./, (c) => c.toLowerCase()) : v;
  return v;
}

async function createEntities(list, ctx) {
  for (const item of list) {
    const [type, spec] = Object.entries(item)[0];
    const known = {
      client: ['id', 'observeEvents', 'uriOptions', 'useMultipleMongoses', 'ignoreCommandMonitoringEvents',
        'observeSensitiveCommands'],
      database: ['id', 'client', 'databaseName', 'databaseOptions'],
      collection: ['id', 'database', 'collectionName', 'collectionOptions'],
      session: ['id', 'client', 'sessionOptions'],
    }[type];
    if (!known) throw new Unsupported(`entity type ${type} not supported by the runner`);
    for (const k of Object.keys(spec)) {
      if (!known.includes(k)) throw new Unsupported(`${type} entity option ${k} not supported by the runner`);
    }
    if (ctx.entities.has(spec.id)) throw new Error(`entity ${spec.id} defined twice`);
    if (type === 'client') {
      const observe = new Set(spec.observeEvents || []);
      for (const ev of observe) {
        if (ev !== 'commandStartedEvent') throw new Unsupported(`event ${ev} not supported by the runner`);
      }
      const ignore = new Set(spec.ignoreCommandMonitoringEvents || []);
      const uriOpts = { ...(spec.uriOptions || {}) };
      // faster recovery after a fail point's closed connection (the spec allows it)
      if (!('heartbeatFrequencyMS' in uriOpts)) uriOpts.heartbeatFrequencyMS = 500;
      const client = new MongoClient(withUriOptions(ctx.uri, uriOpts),
        { monitorCommands: observe.size > 0, serverSelectionTimeoutMS: 5000 });
      const events = [];
      // a copy of the command as sent: the driver may change objects it
      // shares with it later (a client's readConcern gets afterClusterTime)
      const copy = (cmd) => BSON.deserialize(BSON.serialize(cmd, { ignoreUndefined: true }), { promoteLongs: false });
      client.on('commandStarted', (ev) => {
        if (!ctx.listening) return;
        if (ev.commandName === 'configureFailPoint') return; // the fail point operations' own
        if (ignore.has(ev.commandName)) return;
        if (!spec.observeSensitiveCommands && SENSITIVE.has(ev.commandName)) return;
        if (!spec.observeSensitiveCommands && ['hello', 'isMaster', 'ismaster'].includes(ev.commandName)
          && Object.keys(ev.command).length === 0) return;
        events.push({ commandStartedEvent: { command: copy(ev.command), commandName: ev.commandName,
          databaseName: ev.databaseName } });
      });
      await client.connect();
      ctx.clients.push(client);
      ctx.entities.set(spec.id, client);
      ctx.events.set(spec.id, events);
    } else if (type === 'database') {
      const client = entity(ctx, spec.client, MongoClient);
      const o = spec.databaseOptions || {};
      ctx.entities.set(spec.id, client.db(spec.databaseName, {
        readConcern: o.readConcern, writeConcern: o.writeConcern, readPreference: concern(o.readPreference,
          'readPreference'),
      }));
    } else if (type === 'collection') {
      const db = entity(ctx, spec.database);
      const o = spec.collectionOptions || {};
      ctx.entities.set(spec.id, db.collection(spec.collectionName, {
        readConcern: o.readConcern, writeConcern: o.writeConcern, readPreference: concern(o.readPreference,
          'readPreference'),
      }));
    } else {
      const client = entity(ctx, spec.client, MongoClient);
      const o = spec.sessionOptions || {};
      const session = client.startSession({
        causalConsistency: o.causalConsistency,
        snapshot: o.snapshot,
        defaultTransactionOptions: txnOptions(o.defaultTransactionOptions),
      });
      ctx.entities.set(spec.id, session);
      ctx.lsids.set(spec.id, session.id);
      ctx.sessions.push(session);
    }
  }
}

function entity(ctx, id, type) {
  if (!ctx.entities.has(id)) throw new Error(`unknown entity ${id}`);
  const e = ctx.entities.get(id);
  if (type && !(e instanceof type)) throw new Error(`entity ${id} is not a ${type.name}`);
  return e;
}

function txnOptions(o) {
  if (!o) return undefined;
  const r = {};
  for (const [k, v] of Object.entries(o)) {
    if (k === 'readConcern' || k === 'writeConcern' || k === 'maxCommitTimeMS') r[k] = v;
    else if (k === 'readPreference') r.readPreference = concern(v, 'readPreference');
    else throw new Unsupported(`transaction option ${k} not supported by the runner`);
  }
  return r;
}

// ---- operations -------------------------------------------------------------

// the arguments an operation accepts; the others make the test unsupported
function args(op, allowed) {
  const a = op.arguments || {};
  for (const k of Object.keys(a)) {
    if (!allowed.includes(k)) throw new Unsupported(`argument ${k} of ${op.name} not supported by the runner`);
  }
  return a;
}

function sessionOf(a, ctx) {
  if (a.session === undefined) return undefined;
  const s = entity(ctx, a.session);
  if (!s || typeof s.startTransaction !== 'function') throw new Error(`entity ${a.session} is not a session`);
  return s;
}

function opts(a, ctx, keys) {
  const o = {};
  const s = sessionOf(a, ctx);
  if (s) o.session = s;
  for (const k of keys) {
    if (a[k] === undefined) continue;
    if (k === 'returnDocument') o.returnDocument = a[k].toLowerCase();
    else if (k === 'readPreference') o.readPreference = concern(a[k], 'readPreference');
    else o[k] = a[k];
  }
  return o;
}

const READ_OPTS = ['sort', 'projection', 'limit', 'skip', 'batchSize', 'maxTimeMS', 'readConcern', 'readPreference',
  'hint', 'comment'];
const WRITE_OPTS = ['upsert', 'writeConcern', 'hint', 'comment', 'let', 'bypassDocumentValidation'];
const FAM_OPTS = ['sort', 'projection', 'upsert', 'returnDocument', 'writeConcern', 'hint', 'comment', 'let',
  'maxTimeMS'];

const BULK_KINDS = ['insertOne', 'updateOne', 'updateMany', 'replaceOne', 'deleteOne', 'deleteMany'];

const COLLECTION_OPS = {
  async insertOne(c, op, ctx) {
    const a = args(op, ['document', 'session', 'writeConcern', 'comment', 'bypassDocumentValidation']);
    return c.insertOne(a.document, opts(a, ctx, ['writeConcern', 'comment', 'bypassDocumentValidation']));
  },
  async insertMany(c, op, ctx) {
    const a = args(op, ['documents', 'session', 'ordered', 'writeConcern', 'comment']);
    return c.insertMany(a.documents, opts(a, ctx, ['ordered', 'writeConcern', 'comment']));
  },
  async updateOne(c, op, ctx) {
    const a = args(op, ['filter', 'update', 'session', ...WRITE_OPTS]);
    return c.updateOne(a.filter, a.update, opts(a, ctx, WRITE_OPTS));
  },
  async updateMany(c, op, ctx) {
    const a = args(op, ['filter', 'update', 'session', ...WRITE_OPTS]);
    return c.updateMany(a.filter, a.update, opts(a, ctx, WRITE_OPTS));
  },
  async replaceOne(c, op, ctx) {
    const a = args(op, ['filter', 'replacement', 'session', ...WRITE_OPTS]);
    return c.replaceOne(a.filter, a.replacement, opts(a, ctx, WRITE_OPTS));
  },
  async deleteOne(c, op, ctx) {
    const a = args(op, ['filter', 'session', 'writeConcern', 'hint', 'comment', 'let']);
    return c.deleteOne(a.filter, opts(a, ctx, ['writeConcern', 'hint', 'comment', 'let']));
  },
  async deleteMany(c, op, ctx) {
    const a = args(op, ['filter', 'session', 'writeConcern', 'hint', 'comment', 'let']);
    return c.deleteMany(a.filter, opts(a, ctx, ['writeConcern', 'hint', 'comment', 'let']));
  },
  async findOneAndUpdate(c, op, ctx) {
    const a = args(op, ['filter', 'update', 'session', ...FAM_OPTS]);
    return c.findOneAndUpdate(a.filter, a.update, opts(a, ctx, FAM_OPTS));
  },
  async findOneAndReplace(c, op, ctx) {
    const a = args(op, ['filter', 'replacement', 'session', ...FAM_OPTS]);
    return c.findOneAndReplace(a.filter, a.replacement, opts(a, ctx, FAM_OPTS));
  },
  async findOneAndDelete(c, op, ctx) {
    const a = args(op, ['filter', 'session', 'sort', 'projection', 'writeConcern', 'hint', 'comment', 'let',
      'maxTimeMS']);
    return c.findOneAndDelete(a.filter, opts(a, ctx, ['sort', 'projection', 'writeConcern', 'hint', 'comment',
      'let', 'maxTimeMS']));
  },
  async find(c, op, ctx) {
    const a = args(op, ['filter', 'session', ...READ_OPTS]);
    return { root: await c.find(a.filter || {}, opts(a, ctx, READ_OPTS)).toArray() };
  },
  async findOne(c, op, ctx) {
    const a = args(op, ['filter', 'session', ...READ_OPTS]);
    return c.findOne(a.filter || {}, opts(a, ctx, READ_OPTS));
  },
  async aggregate(c, op, ctx) {
    const a = args(op, ['pipeline', 'session', 'batchSize', 'maxTimeMS', 'readConcern', 'readPreference',
      'comment', 'let', 'hint', 'allowDiskUse']);
    return { root: await c.aggregate(a.pipeline, opts(a, ctx, ['batchSize', 'maxTimeMS', 'readConcern',
      'readPreference', 'comment', 'let', 'hint', 'allowDiskUse'])).toArray() };
  },
  async countDocuments(c, op, ctx) {
    const a = args(op, ['filter', 'session', 'limit', 'skip', 'maxTimeMS', 'readConcern', 'readPreference',
      'comment', 'hint']);
    return c.countDocuments(a.filter, opts(a, ctx, ['limit', 'skip', 'maxTimeMS', 'readConcern', 'readPreference',
      'comment', 'hint']));
  },
  async count(c, op, ctx) {
    const a = args(op, ['filter', 'session', 'limit', 'skip', 'maxTimeMS', 'readConcern', 'readPreference',
      'comment', 'hint']);
    return c.count(a.filter, opts(a, ctx, ['limit', 'skip', 'maxTimeMS', 'readConcern', 'readPreference',
      'comment', 'hint']));
  },
  async distinct(c, op, ctx) {
    const a = args(op, ['fieldName', 'filter', 'session', 'maxTimeMS', 'readConcern', 'readPreference', 'comment',
      'hint']);
    return c.distinct(a.fieldName, a.filter, opts(a, ctx, ['maxTimeMS', 'readConcern', 'readPreference',
      'comment', 'hint']));
  },
  async bulkWrite(c, op, ctx) {
    const a = args(op, ['requests', 'session', 'ordered', 'writeConcern', 'comment', 'let',
      'bypassDocumentValidation']);
    const models = a.requests.map((r) => {
      const [kind, body] = Object.entries(r)[0];
      if (!BULK_KINDS.includes(kind)) throw new Unsupported(`bulkWrite model ${kind} not supported by the runner`);
      return { [kind]: body };
    });
    const r = await c.bulkWrite(models, opts(a, ctx, ['ordered', 'writeConcern', 'comment', 'let',
      'bypassDocumentValidation']));
    return {
      insertedCount: r.insertedCount, matchedCount: r.matchedCount, modifiedCount: r.modifiedCount,
      deletedCount: r.deletedCount, upsertedCount: r.upsertedCount, upsertedIds: r.upsertedIds,
      insertedIds: r.insertedIds,
    };
  },
  async createIndex(c, op, ctx) {
    const a = args(op, ['keys', 'name', 'session', 'unique', 'commitQuorum']);
    return c.createIndex(a.keys, opts(a, ctx, ['name', 'unique', 'commitQuorum']));
  },
};

const DATABASE_OPS = {
  async runCommand(db, op, ctx) {
    const a = args(op, ['command', 'commandName', 'session', 'readPreference']);
    return db.command(a.command, opts(a, ctx, ['readPreference']));
  },
  async aggregate(db, op, ctx) {
    const a = args(op, ['pipeline', 'session', 'batchSize', 'maxTimeMS', 'readConcern', 'comment', 'let']);
    return { root: await db.aggregate(a.pipeline, opts(a, ctx, ['batchSize', 'maxTimeMS', 'readConcern', 'comment',
      'let'])).toArray() };
  },
  async createCollection(db, op, ctx) {
    const a = args(op, ['collection', 'session']);
    await db.createCollection(a.collection, opts(a, ctx, []));
    return undefined;
  },
  async dropCollection(db, op, ctx) {
    const a = args(op, ['collection', 'session']);
    await db.dropCollection(a.collection, opts(a, ctx, [])).catch((e) => {
      if (e.code !== 26) throw e; // NamespaceNotFound: a missing collection drops fine in the drivers
    });
    return undefined;
  },
};

const SESSION_OPS = {
  async startTransaction(s, op) {
    const a = args(op, ['readConcern', 'writeConcern', 'readPreference', 'maxCommitTimeMS']);
    s.startTransaction(txnOptions(a));
    return undefined;
  },
  async commitTransaction(s, op) {
    args(op, []);
    await s.commitTransaction();
    return undefined;
  },
  async abortTransaction(s, op) {
    args(op, []);
    await s.abortTransaction();
    return undefined;
  },
  async endSession(s, op) {
    args(op, []);
    await s.endSession();
    return undefined;
  },
  async withTransaction(s, op, ctx) {
    const a = args(op, ['callback', 'readConcern', 'writeConcern', 'readPreference', 'maxCommitTimeMS']);
    await s.withTransaction(async () => {
      for (const inner of a.callback) await runOperation(inner, ctx, true);
    }, txnOptions({ readConcern: a.readConcern, writeConcern: a.writeConcern, readPreference: a.readPreference,
      maxCommitTimeMS: a.maxCommitTimeMS }));
    return undefined;
  },
};

const STATES = {
  NO_TRANSACTION: 'none', STARTING_TRANSACTION: 'starting', TRANSACTION_IN_PROGRESS: 'in_progress',
  TRANSACTION_COMMITTED: 'committed', TRANSACTION_COMMITTED_EMPTY: 'committed', TRANSACTION_ABORTED: 'aborted',
};

async function listCollections(ctx, dbName) {
  return (await ctx.internal.db(dbName).listCollections({}, { nameOnly: true }).toArray()).map((c) => c.name);
}

const RUNNER_OPS = {
  async failPoint(op, ctx) {
    const a = args(op, ['client', 'failPoint']);
    const client = entity(ctx, a.client, MongoClient);
    ctx.failPoints.push({ client, name: a.failPoint.configureFailPoint });
    await client.db('admin').command(a.failPoint);
  },
  async targetedFailPoint(op, ctx) {
    const a = args(op, ['session', 'failPoint']);
    const s = sessionOf(a, ctx);
    if (!s.isPinned) throw new Error('targetedFailPoint: the session is not pinned to a mongos');
    throw new Unsupported('targetedFailPoint on a pinned session not supported by the runner');
  },
  async assertSessionTransactionState(op, ctx) {
    const a = args(op, ['session', 'state']);
    const s = sessionOf(a, ctx);
    const got = STATES[s.transaction.state];
    if (got !== a.state) throw new Error(`session ${a.session} transaction state ${got}, expected ${a.state}`);
  },
  async assertSessionPinned(op, ctx) {
    const a = args(op, ['session']);
    if (!sessionOf(a, ctx).isPinned) throw new Error(`session ${a.session} is not pinned`);
  },
  async assertSessionUnpinned(op, ctx) {
    const a = args(op, ['session']);
    if (sessionOf(a, ctx).isPinned) throw new Error(`session ${a.session} is pinned`);
  },
  async assertCollectionExists(op, ctx) {
    const a = args(op, ['databaseName', 'collectionName']);
    if (!(await listCollections(ctx, a.databaseName)).includes(a.collectionName)) {
      throw new Error(`collection ${a.databaseName}.${a.collectionName} does not exist`);
    }
  },
  async assertCollectionNotExists(op, ctx) {
    const a = args(op, ['databaseName', 'collectionName']);
    if ((await listCollections(ctx, a.databaseName)).includes(a.collectionName)) {
      throw new Error(`collection ${a.databaseName}.${a.collectionName} exists`);
    }
  },
  async assertIndexExists(op, ctx) {
    const a = args(op, ['databaseName', 'collectionName', 'indexName']);
    const names = (await ctx.internal.db(a.databaseName).collection(a.collectionName).listIndexes().toArray()
      .catch(() => [])).map((i) => i.name);
    if (!names.includes(a.indexName)) throw new Error(`index ${a.indexName} does not exist`);
  },
  async assertIndexNotExists(op, ctx) {
    const a = args(op, ['databaseName', 'collectionName', 'indexName']);
    const names = (await ctx.internal.db(a.databaseName).collection(a.collectionName).listIndexes().toArray()
      .catch(() => [])).map((i) => i.name);
    if (names.includes(a.indexName)) throw new Error(`index ${a.indexName} exists`);
  },
  async createEntities(op, ctx) {
    const a = args(op, ['entities']);
    await createEntities(a.entities, ctx);
  },
};

// every operation a test uses is known before any runs, so that an unknown
// one skips the test instead of failing it halfway
function checkSupported(ops, where = 'operation') {
  for (const op of ops) {
    const known = op.object === 'testRunner' ? RUNNER_OPS[op.name]
      : (COLLECTION_OPS[op.name] || DATABASE_OPS[op.name] || SESSION_OPS[op.name]);
    if (!known) throw new Unsupported(`${where} ${op.name} not supported by the runner`);
    for (const k of Object.keys(op)) {
      if (!['name', 'object', 'arguments', 'expectResult', 'expectError', 'ignoreResultAndError'].includes(k)) {
        throw new Unsupported(`operation field ${k} not supported by the runner`);
      }
    }
    if (op.expectError) {
      for (const k of Object.keys(op.expectError)) {
        if (!['isError', 'isClientError', 'errorContains', 'errorCode', 'errorCodeName', 'errorLabelsContain',
          'errorLabelsOmit', 'errorResponse', 'expectResult'].includes(k)) {
          throw new Unsupported(`expectError.${k} not supported by the runner`);
        }
      }
    }
    if (op.name === 'withTransaction' && op.arguments) checkSupported(op.arguments.callback || [], where);
  }
}

async function execute(op, ctx) {
  if (op.object === 'testRunner') return RUNNER_OPS[op.name](op, ctx);
  const target = entity(ctx, op.object);
  let table;
  if (target instanceof MongoClient) table = {};
  else if (typeof target.startTransaction === 'function') table = SESSION_OPS;
  else if (typeof target.insertOne === 'function') table = COLLECTION_OPS;
  else table = DATABASE_OPS;
  const fn = table[op.name];
  if (!fn) throw new Unsupported(`operation ${op.name} on ${op.object} not supported by the runner`);
  return fn(target, op, ctx);
}

function codeName(err) {
  if (err.codeName) return err.codeName;
  if (err.code !== undefined) {
    const c = CODES.names[String(err.code)];
    if (typeof c === 'string') return c;
  }
  return undefined;
}

function checkError(expect, err, ctx) {
  if (!err) throw new Error(`expected an error ${show(expect)}, the operation succeeded`);
  const serverErr = err instanceof MongoServerError;
  const labels = (n) => (typeof err.hasErrorLabel === 'function' ? err.hasErrorLabel(n)
    : (err.errorLabels || []).includes(n));
  if (expect.isClientError !== undefined && expect.isClientError === serverErr) {
    const want = expect.isClientError ? 'a client' : 'a server';
    throw new Error(`expected ${want} error, got ${err.name}: ${err.message}`);
  }
  if (expect.errorContains !== undefined
    && !String(err.message).toLowerCase().includes(expect.errorContains.toLowerCase())) {
    throw new Error(`expected an error containing "${expect.errorContains}", got "${err.message}"`);
  }
  if (expect.errorCode !== undefined && err.code !== expect.errorCode) {
    throw new Error(`expected error code ${expect.errorCode}, got ${err.code} (${err.message})`);
  }
  if (expect.errorCodeName !== undefined
    && String(codeName(err)).toLowerCase() !== expect.errorCodeName.toLowerCase()) {
    throw new Error(`expected error ${expect.errorCodeName}, got ${codeName(err)} (${err.message})`);
  }
  for (const l of expect.errorLabelsContain || []) {
    if (!labels(l)) throw new Error(`expected label ${l}, got ${show(err.errorLabels)} (${err.message})`);
  }
  for (const l of expect.errorLabelsOmit || []) {
    if (labels(l)) throw new Error(`expected no label ${l}, got ${show(err.errorLabels)} (${err.message})`);
  }
  if (expect.errorResponse !== undefined) match(expect.errorResponse, err.errorResponse, ctx, 'errorResponse');
  if (expect.expectResult !== undefined) {
    const partial = err.result && typeof err.result === 'object' ? err.result : undefined;
    match(expect.expectResult, partial, ctx, 'expectError.expectResult');
  }
}

// inCallback: an operation of withTransaction's callback, whose error goes
// on to withTransaction whatever ignoreResultAndError or expectError say
// (unified-test-format.md, withTransaction)
async function runOperation(op, ctx, inCallback = false) {
  let result;
  let err = null;
  try {
    result = await execute(op, ctx);
  } catch (e) {
    if (e instanceof Unsupported) throw e;
    err = e;
  }
  if (op.ignoreResultAndError) {
    if (inCallback && err) throw err;
    return;
  }
  if (op.expectError) {
    checkError(op.expectError, err, ctx);
    if (inCallback && err) throw err;
    return;
  }
  if (err) throw err;
  if (op.expectResult !== undefined) {
    if (result && result.root) {
      if (!Array.isArray(op.expectResult) || op.expectResult.length !== result.root.length) {
        match(op.expectResult, result.root, ctx, op.name, false);
      }
      op.expectResult.forEach((e, i) => match(e, result.root[i], ctx, `${op.name}[${i}]`, true));
    } else {
      match(op.expectResult, result, ctx, op.name, true);
    }
  }
}

// ---- files and tests ----------------------------------------------------------

async function setUpData(ctx, data) {
  for (const d of data || []) {
    const db = ctx.internal.db(d.databaseName);
    await db.collection(d.collectionName).drop({ writeConcern: { w: 'majority' } }).catch((e) => {
      if (e.code !== 26) throw e;
    });
    if (d.createOptions) {
      await db.createCollection(d.collectionName, { ...d.createOptions, writeConcern: { w: 'majority' } });
    }
    if (d.documents && d.documents.length > 0) {
      await db.collection(d.collectionName).insertMany(d.documents, { writeConcern: { w: 'majority' } });
    } else if (!d.createOptions) {
      await db.createCollection(d.collectionName, { writeConcern: { w: 'majority' } });
    }
  }
}

async function checkOutcome(ctx, outcome) {
  for (const d of outcome || []) {
    const docs = await ctx.internal.db(d.databaseName).collection(d.collectionName)
      .find({}, { sort: { _id: 1 }, readPreference: 'primary', readConcern: { level: 'local' } }).toArray();
    const where = `outcome ${d.databaseName}.${d.collectionName}`;
    match(d.documents, docs, ctx, where, false);
  }
}

function checkEvents(ctx, expected) {
  for (const e of expected) {
    for (const k of Object.keys(e)) {
      if (!['client', 'events', 'eventType', 'ignoreExtraEvents'].includes(k)) {
        throw new Unsupported(`expectEvents.${k} not supported by the runner`);
      }
    }
    if (e.eventType && e.eventType !== 'command') {
      throw new Unsupported(`expectEvents of eventType ${e.eventType} not supported by the runner`);
    }
    for (const ev of e.events) {
      const kind = Object.keys(ev)[0];
      if (kind !== 'commandStartedEvent') throw new Unsupported(`event ${kind} not supported by the runner`);
      for (const k of Object.keys(ev[kind])) {
        if (!['command', 'commandName', 'databaseName'].includes(k)) {
          throw new Unsupported(`commandStartedEvent.${k} not supported by the runner`);
        }
      }
    }
  }
  for (const e of expected) {
    const actual = ctx.events.get(e.client);
    if (!actual) throw new Error(`expectEvents: unknown client ${e.client}`);
    const n = e.ignoreExtraEvents ? Math.min(actual.length, e.events.length) : actual.length;
    const got = actual.slice(0, n);
    if (got.length !== e.events.length) {
      throw new Error(`expectEvents for ${e.client}: expected ${e.events.length} events `
        + `(${e.events.map((x) => x.commandStartedEvent.commandName).join(', ')}), got ${got.length} `
        + `(${got.map((x) => x.commandStartedEvent.commandName).join(', ')})`);
    }
    e.events.forEach((ev, i) => {
      const exp = ev.commandStartedEvent;
      const act = got[i].commandStartedEvent;
      const w = `events[${i}] (${act.commandName})`;
      if (exp.commandName !== undefined && exp.commandName !== act.commandName) {
        fail(w, `expected command ${exp.commandName}`);
      }
      if (exp.databaseName !== undefined && exp.databaseName !== act.databaseName) {
        fail(w, `expected database ${exp.databaseName}, got ${act.databaseName}`);
      }
      if (exp.command !== undefined) match(exp.command, driverWtimeout(exp.command, act), ctx, `${w}.command`, true);
    });
  }
}

// The Node.js driver (6.x, sessions.js) adds `wtimeout: 10000` to the write
// concern of every commitTransaction and abortTransaction that has one, where
// the transactions spec expects the write concern as given: a client-side
// difference, taken out of the observed command unless the test names wtimeout.
function driverWtimeout(expected, act) {
  const wc = act.command.writeConcern;
  if (!['commitTransaction', 'abortTransaction'].includes(act.commandName) || !wc || num(wc.wtimeout) !== 10000
    || !isDoc(expected.writeConcern) || 'wtimeout' in expected.writeConcern) return act.command;
  const { wtimeout, ...rest } = wc; // eslint-disable-line no-unused-vars
  return { ...act.command, writeConcern: rest };
}

function usesTransactions(ops) {
  return ops.some((o) => o.name === 'startTransaction' || o.name === 'withTransaction');
}

async function runTest(file, test, env) {
  if (test.skipReason) return { status: 'skip', reason: `skipReason: ${test.skipReason}` };
  const why = requirementsUnmet(file.runOnRequirements, env.server)
    || requirementsUnmet(test.runOnRequirements, env.server);
  if (why) return { status: 'skip', reason: why };
  for (const k of Object.keys(test)) {
    if (!['description', 'runOnRequirements', 'skipReason', 'operations', 'expectEvents', 'outcome'].includes(k)) {
      return { status: 'skip', reason: `test field ${k} not supported by the runner` };
    }
  }
  const ctx = {
    uri: env.uri, internal: env.internal, entities: new Map(), lsids: new Map(), events: new Map(),
    clients: [], sessions: [], failPoints: [], listening: false,
  };
  try {
    checkSupported(test.operations);
    await setUpData(ctx, file.initialData);
    await createEntities(file.createEntities || [], ctx);
    ctx.listening = true;
    for (const op of test.operations) await runOperation(op, ctx);
    ctx.listening = false;
    await disableFailPoints(ctx);
    if (test.expectEvents) checkEvents(ctx, test.expectEvents);
    await checkOutcome(ctx, test.outcome);
    return { status: 'pass' };
  } catch (e) {
    if (e instanceof Unsupported) return { status: 'skip', reason: e.message };
    return { status: 'fail', reason: e && e.stack ? e.message : String(e) };
  } finally {
    ctx.listening = false;
    await disableFailPoints(ctx);
    for (const s of ctx.sessions) await s.endSession().catch(() => {});
    for (const c of ctx.clients) await c.close(true).catch(() => {});
    if (usesTransactions(test.operations)) {
      await env.internal.db('admin').command({ killAllSessions: [] }).catch(() => {});
    }
  }
}

async function disableFailPoints(ctx) {
  while (ctx.failPoints.length) {
    const { client, name } = ctx.failPoints.pop();
    await client.db('admin').command({ configureFailPoint: name, mode: 'off' }).catch(() => {});
  }
}

// the tests of one file, in order; filter(description) picks some; skips:
// { description (or '*'): reason } skips those tests with that reason
async function runFile(filePath, { uri, filter, skips = {} } = {}) {
  const file = EJSON.parse(fs.readFileSync(filePath, 'utf8'), { relaxed: true });
  const internal = new MongoClient(uri, { serverSelectionTimeoutMS: 5000 });
  await internal.connect();
  const results = [];
  try {
    const server = await describeServer(internal, uri);
    const env = { uri, internal, server };
    const major = Number(String(file.schemaVersion || '0').split('.')[0]);
    for (const test of file.tests) {
      if (filter && !filter(test.description)) continue;
      let r;
      const skip = skips[test.description] || skips['*'];
      if (skip) r = { status: 'skip', reason: skip };
      else if (major !== 1) r = { status: 'skip', reason: `schemaVersion ${file.schemaVersion} not supported` };
      else r = await runTest(file, test, env);
      results.push({ file: path.basename(filePath), description: test.description, ...r });
    }
  } finally {
    await internal.close(true);
  }
  return results;
}

module.exports = { runFile, match, Unsupported };
