'use strict';
// Change streams: events are read from the store's change log, which is in
// cluster-time order. A resume token is {_data: hex} holding the cluster time
// of the event (or of the point scanned so far, for a postBatchResumeToken):
// resuming after it returns events with a later cluster time, so an event
// token and a high-water-mark token resume the same way.

const BSON = require('bson');
const V = require('./values');
const pipeline = require('./pipeline');
const query = require('./query');
const { tsBig } = require('./store');
const diff = require('./diff');
const { fail } = require('./errors');
const { Timestamp } = V;

function tokenFor(big, isEvent) {
  return { _data: '82' + big.toString(16).padStart(16, '0') + (isEvent ? '04' : '01') };
}

function parseToken(tok, what) {
  if (!V.isPlainDoc(tok) || typeof tok._data !== 'string' || !/^82[0-9a-f]{16}0[14]$/i.test(tok._data)) {
    fail(2, `${what} must be a resume token this server issued (an object with a _data string), got ${V.render(tok)}`);
  }
  return BigInt('0x' + tok._data.slice(2, 18));
}

const CS_OPTIONS = new Set(['fullDocument', 'resumeAfter', 'startAfter', 'startAtOperationTime',
  'allChangesForCluster', 'fullDocumentBeforeChange', 'showExpandedEvents']);

// mongod's aggregation stage names (the manual's "Aggregation Stages"
// list): a name outside it is refused as unknown, even where the stage
// would not be allowed anyway.
const MONGOD_STAGES = new Set(('$addFields $bucket $bucketAuto $changeStream $changeStreamSplitLargeEvent ' +
  '$collStats $count $currentOp $densify $documents $facet $fill $geoNear $graphLookup $group $indexStats ' +
  '$limit $listLocalSessions $listSampledQueries $listSearchIndexes $listSessions $lookup $match $merge $out ' +
  '$planCacheStats $project $redact $replaceRoot $replaceWith $sample $search $searchMeta $set ' +
  '$setWindowFields $shardedDataDistribution $skip $sort $sortByCount $unionWith $unset $unwind ' +
  '$vectorSearch').split(' '));

// A change-stream cursor over db (and coll, unless null). spec is the
// $changeStream stage's argument; rest the later stages.
class ChangeStream {
  constructor(engine, dbName, collName, spec, rest) {
    if (!V.isPlainDoc(spec)) fail(50808, '$changeStream stage expects a document as argument');
    for (const k of Object.keys(spec)) {
      if (!CS_OPTIONS.has(k)) fail(40415, `BSON field '$changeStream.${k}' is an unknown field.`);
    }
    const fd = spec.fullDocument === undefined ? 'default' : spec.fullDocument;
    if (!['default', 'updateLookup', 'whenAvailable', 'required'].includes(fd)) {
      fail(2, `Enumeration value '${fd}' for field '$changeStream.fullDocument' is not a valid value.`);
    }
    if (fd === 'whenAvailable' || fd === 'required') {
      fail(72, `fullDocument:'${fd}' needs changeStreamPreAndPostImages, which this server does not keep`);
    }
    this.fullDocument = fd;
    const starts = ['resumeAfter', 'startAfter', 'startAtOperationTime'].filter((k) => spec[k] !== undefined);
    if (starts.length > 1) {
      fail(40674, 'Only one type of resume option is allowed, but multiple were found.');
    }
    this.engine = engine;
    this.db = dbName;
    this.coll = collName;
    this.allForCluster = !!spec.allChangesForCluster;
    if (spec.resumeAfter !== undefined) this.after = parseToken(spec.resumeAfter, 'resumeAfter');
    else if (spec.startAfter !== undefined) this.after = parseToken(spec.startAfter, 'startAfter');
    else if (spec.startAtOperationTime !== undefined) {
      const ts = spec.startAtOperationTime;
      if (V.typeName(ts) !== 'timestamp') fail(14, "BSON field '$changeStream.startAtOperationTime' is the wrong type, expected type 'timestamp'");
      this.after = tsBig(ts) - 1n;
    } else {
      this.after = tsBig(engine.store.clock.now());
    }
    const log = engine.store.log;
    if ((spec.resumeAfter || spec.startAfter || spec.startAtOperationTime) && engine.store.logTrimmed && log.length && this.after < log[0].tsBig - 1n) {
      fail(286, 'Resume of change stream was not possible, as the resume point may no longer be in the oplog.');
    }
    // mongod parses every stage first (an unknown name is 40324), then
    // refuses the stages a change stream does not permit (20)
    for (const st of rest) {
      if (!V.isPlainDoc(st) || Object.keys(st).length !== 1) {
        fail(40323, 'A pipeline stage specification object must contain exactly one field.');
      }
      const name = Object.keys(st)[0];
      if (!MONGOD_STAGES.has(name)) fail(40324, `Unrecognized pipeline stage name: '${name}'`);
    }
    for (const st of rest) {
      const name = Object.keys(st)[0];
      if (!['$match', '$project', '$addFields', '$set', '$unset', '$replaceRoot', '$replaceWith', '$redact'].includes(name)) {
        fail(20, `${name} is not permitted in a $changeStream pipeline`);
      }
    }
    // a leading $match without $expr: the event passes or not, unchanged
    // (what that stage would answer), by its filter's $or branches shared
    // with the other streams (see sharedMatcher); stages: the ones after
    // it, or all of them when there is no such $match
    this.match = rest.length && Object.keys(rest[0])[0] === '$match' ? sharedMatcher(rest[0].$match) : null;
    const after = this.match ? rest.slice(1) : rest;
    this.stages = after.length ? pipeline.compileStages(after) : null;
    // whether the stream may read an update's description without the
    // updated fields under sub-diffs (diff.js: describe)
    this.pathsOnly = pathsOnly(rest);
    // stages never modify their input documents: every stream but an
    // updateLookup one (its own fullDocument) can share one event
    // document per event (built once, not once per stream)
    this.shared = fd !== 'updateLookup';
    this.invalidated = false;
    this.closed = false;
  }

  get ns() {
    if (this.coll) return `${this.db}.${this.coll}`;
    return `${this.db}.$cmd.aggregate`;
  }

  relevant(ev) {
    if (this.allForCluster) return ev.db !== 'admin' && ev.db !== 'config' && ev.db !== 'local';
    if (ev.db !== this.db) return false;
    if (this.coll === null) return ev.op !== 'dropDatabase' || true;
    return ev.name === this.coll || (ev.op === 'dropDatabase');
  }

  eventDoc(ev) {
    const out = { _id: tokenFor(ev.tsBig, true), operationType: ev.op, clusterTime: ev.ts, wallTime: ev.wall };
    if (ev.op === 'dropDatabase') { out.ns = { db: ev.db }; return out; }
    out.ns = { db: ev.db, coll: ev.name };
    if (ev.op === 'drop') return out;
    if (ev.op === 'insert' || ev.op === 'replace') out.fullDocument = ev.doc;
    if (ev.op !== 'insert' || true) out.documentKey = ev.key;
    if (ev.op === 'update') {
      out.updateDescription = ev.desc;
      if (this.fullDocument === 'updateLookup') {
        const c = this.engine.store.coll(ev.db, ev.name, false);
        const cur = c ? c.get(ev.key._id) : undefined;
        out.fullDocument = cur === undefined ? null : cur;
      }
    }
    // (documentKey comes after fullDocument in mongod's insert and replace
    // events: it was written after it above)
    return out;
  }

  // Reads up to limit events after this.after. Returns {docs, token}.
  read(limit) {
    const log = this.engine.store.log;
    let lo = 0, hi = log.length;
    // a stream that kept up has the newest event alone to read
    if (hi > 1 && log[hi - 2].tsBig <= this.after) lo = hi - 1;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (log[mid].tsBig <= this.after) lo = mid + 1; else hi = mid;
    }
    const docs = [];
    let i = lo;
    for (; i < log.length && docs.length < limit && !this.invalidated; i++) {
      const ev = log[i];
      this.after = ev.tsBig;
      if (!this.relevant(ev)) continue;
      if (ev.op === 'update' && !this.pathsOnly) diff.complete(ev.desc);
      let evDoc = this.shared ? (ev.shared || (ev.shared = this.eventDoc(ev))) : this.eventDoc(ev);
      const invalidating = (this.coll !== null && (ev.op === 'drop' || ev.op === 'dropDatabase')) ||
        (this.coll === null && !this.allForCluster && ev.op === 'dropDatabase');
      if (ev.op === 'dropDatabase' && this.coll !== null) evDoc = null; // collection streams see the drop first
      if (evDoc && this.match && !this.match(evDoc)) evDoc = null;
      if (evDoc && this.stages) evDoc = runStages(this.stages, evDoc);
      if (evDoc) docs.push(evDoc);
      if (invalidating) {
        docs.push({ _id: tokenFor(ev.tsBig, true), operationType: 'invalidate', clusterTime: ev.ts, wallTime: ev.wall });
        this.invalidated = true;
      }
    }
    if (i >= log.length && !this.invalidated) {
      const now = this.engine.store.clock.nowBig();
      if (now > this.after) this.after = now;
    }
    if (docs.length && (i < log.length || this.invalidated)) return { docs, token: docs[docs.length - 1]._id };
    // (the high-water mark's token is made only when a reply carries it:
    // a stream whose wait goes on never reads it)
    return new HighWater(docs, this.after);
  }
}

// Whether a stream's stages (after $changeStream) see an update event only
// through field paths, up to an inclusion $project that keeps neither the
// updateDescription nor its updatedFields whole: $match stages without
// $expr, $where or the like and without a condition on those two, then such
// a $project. What that projection lets through holds no field of the
// description's updatedFields but those it named, and no path reaches an
// updated field under a sub-diff (its name has a dot): the event is sent
// the same whether those are described or not.
const WHOLE = new Set(['updateDescription', 'updateDescription.updatedFields']);

function filterPathsOnly(f) {
  if (!V.isPlainDoc(f)) return false;
  for (const k of Object.keys(f)) {
    if (k === '$and' || k === '$or' || k === '$nor') {
      if (!Array.isArray(f[k]) || !f[k].every(filterPathsOnly)) return false;
    } else if (k[0] === '$' || WHOLE.has(k)) return false;
  }
  return true;
}

function pathsOnly(stages) {
  for (const st of stages) {
    const name = Object.keys(st)[0], arg = st[name];
    if (name === '$match') { if (!filterPathsOnly(arg)) return false; continue; }
    if (name !== '$project' || !V.isPlainDoc(arg)) return false;
    const keys = Object.keys(arg);
    let included = false;
    for (const k of keys) {
      const v = arg[k];
      if (!(V.isNumber(v) || typeof v === 'boolean')) return false; // a computed field or a sub-projection
      if (!V.truthy(v)) { if (k !== '_id') return false; continue; } // an exclusion keeps the rest whole
      if (WHOLE.has(k) || k[0] === '$') return false;
      included = true;
    }
    return included;
  }
  return false; // no such $project: the event goes out whole
}

// The event document out of a stream's stages, null when they drop it
function runStages(stages, evDoc) {
  const r = stages([evDoc], { NOW: new Date() });
  if (r.length && !V.identical(r[0]._id, evDoc._id)) {
    fail(280, 'Encountered an event whose _id field, which contains the resume token, was modified by the pipeline. Modifying the _id field of an event makes it impossible to resume the stream from that point. Only transformations that retain the unmodified _id field are allowed.');
  }
  return r.length ? r[0] : null;
}

class HighWater {
  constructor(docs, after) { this.docs = docs; this.after = after; this.made = undefined; }
  get token() {
    if (this.made === undefined) this.made = tokenFor(this.after, false);
    return this.made;
  }
}

// Change streams watching for the same thing often share most of their
// $match: a lock's waiters each match the same $or branches but one or two
// that name the waiter. Each branch of a top-level $or (without $expr, so
// a function of the event alone) is compiled once for all streams, and
// remembers its answer for the last event document it saw: the streams
// read an event one after another, as one shared document (eventDoc), so
// every branch but a stream's own is evaluated once per event. Event
// documents are never modified. null: the filter is not of that form (the
// stages evaluate it).
const BRANCHES = new Map();
const BRANCHES_LIMIT = 1024;

function hasExpr(v) {
  if (Array.isArray(v)) return v.some(hasExpr);
  if (!V.isPlainDoc(v)) return false;
  for (const k of Object.keys(v)) {
    if (k === '$expr' || k === '$where' || hasExpr(v[k])) return true;
  }
  return false;
}

function sharedMatcher(filter) {
  if (!V.isPlainDoc(filter) || Object.keys(filter).length !== 1 || !Array.isArray(filter.$or)) return null;
  const list = filter.$or;
  if (!list.length || !list.every((b) => V.isPlainDoc(b)) || hasExpr(list)) return null;
  const branches = list.map((b) => {
    const key = BSON.EJSON.stringify(b, { relaxed: false });
    let br = BRANCHES.get(key);
    if (br === undefined) {
      if (BRANCHES.size >= BRANCHES_LIMIT) BRANCHES.clear();
      const test = query.compile(b);
      let last = null, answer = false;
      br = (doc) => {
        if (doc !== last) { answer = test(doc); last = doc; }
        return answer;
      };
      BRANCHES.set(key, br);
    }
    return br;
  });
  return (doc) => {
    for (let i = 0; i < branches.length; i++) if (branches[i](doc)) return true;
    return false;
  };
}

module.exports = { ChangeStream, tokenFor, parseToken };
