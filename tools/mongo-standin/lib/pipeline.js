'use strict';
// Aggregation stages and projections over arrays of documents. Stages are
// compiled once per command; each compiled stage maps an array of documents
// to a new array and never mutates its input documents.

const V = require('./values');
const expr = require('./expr');
const query = require('./query');
const { fail } = require('./errors');
const { Int32 } = V;

function setPathIn(doc, parts, value) {
  let cur = doc;
  for (let i = 0; i < parts.length - 1; i++) {
    let next = cur[parts[i]];
    if (!V.isPlainDoc(next)) { next = {}; cur[parts[i]] = next; } else { next = Object.assign({}, next); cur[parts[i]] = next; }
    cur = next;
  }
  const last = parts[parts.length - 1];
  if (value === undefined) delete cur[last];
  else cur[last] = value;
}

function removePathIn(doc, parts) {
  let cur = doc;
  for (let i = 0; i < parts.length - 1; i++) {
    const next = cur[parts[i]];
    if (Array.isArray(next)) {
      cur[parts[i]] = next.map((el) => {
        if (!V.isPlainDoc(el)) return el;
        const c = Object.assign({}, el);
        removePathIn(c, parts.slice(i + 1));
        return c;
      });
      return;
    }
    if (!V.isPlainDoc(next)) return;
    cur[parts[i]] = Object.assign({}, next);
    cur = cur[parts[i]];
  }
  delete cur[parts[parts.length - 1]];
}

// mongod's FieldPath checks on a dotted name: [code, message] or null
// ("$" alone is a find projection's positional operator; a DBRef's $id,
// $ref and $db are names)
const DOLLAR_NAMES = new Set(['$id', '$ref', '$db']);
function pathError(key, positional) {
  if (key === '') return [40352, 'FieldPath cannot be constructed with empty string'];
  for (const p of key.split('.')) {
    if (p === '') return [15998, 'FieldPath field names may not be empty strings.'];
    if (p[0] === '$' && !DOLLAR_NAMES.has(p) && !(positional && p === '$')) {
      return [16410, "FieldPath field names may not start with '$'. Consider using $getField or $setField."];
    }
  }
  return null;
}

function isEmptyDoc(v) {
  return V.isPlainDoc(v) && Object.keys(v).length === 0;
}

// $set / $addFields: {path: expr}; an object that is not an expression is
// fields to set under its path. As mongod's projection nodes: one tree of
// the paths (a name -> a compiled expression, or the tree under it), applied
// in the order the names first appear; a subtree applies to a document,
// to each element of an array, and replaces anything else with a document
// of its fields. Paths that are the same or one under the other are refused
// (40176) as mongod's ProjectionSpecValidator does.
function compileAddFields(spec, name) {
  if (!V.isPlainDoc(spec)) fail(40272, `${name} specification stage must be an object, got ${V.typeName(spec)}`);
  const tree = new Map();
  const seen = [];
  const add = (obj, prefix) => {
    for (const key of Object.keys(obj)) {
      const bad = pathError(key, false);
      if (bad) fail(bad[0], `Invalid ${name} :: caused by :: ${bad[1]}`);
      const path = prefix + key;
      const val = obj[key];
      if (V.isFieldsDoc(val)) { add(val, path + '.'); continue; }
      if (isEmptyDoc(val)) {
        fail(40180, `Invalid ${name} :: caused by :: an empty object is not a valid value. Found empty object at path ${path}`);
      }
      for (const other of seen) {
        if (other === path || other.startsWith(path + '.') || path.startsWith(other + '.')) {
          fail(40176, `Invalid ${name} :: caused by :: specification contains two conflicting paths. Cannot specify both '${path}' and '${other}': ${V.render(spec)}`);
        }
      }
      seen.push(path);
      const parts = path.split('.');
      // (no leaf on the way: conflicting paths were refused above)
      internalAt(tree, parts, parts.length - 1, path, name).set(parts[parts.length - 1], expr.compile(val));
    }
  };
  add(spec, '');
  prepare(tree);
  return (out, doc, vars) => applyComputed(out, tree, doc, vars);
}

// Sets a tree's computed fields in out (a document of its own): a field whose
// value is missing ($$REMOVE) is removed
function applyComputed(out, tree, doc, vars) {
  for (const [name, node] of tree) {
    if (typeof node === 'function') {
      const v = node(doc, vars);
      if (v === undefined) delete out[name];
      else out[name] = v;
    } else if (node instanceof Map && node.computed) {
      out[name] = computedInto(out[name], node, doc, vars);
    }
  }
}

function computedInto(v, tree, doc, vars) {
  if (V.isPlainDoc(v)) {
    const o = Object.assign({}, v);
    applyComputed(o, tree, doc, vars);
    return o;
  }
  if (Array.isArray(v)) return v.map((el) => computedInto(el, tree, doc, vars));
  const o = {};
  applyComputed(o, tree, doc, vars);
  return o;
}

function addFieldsStage(spec, name) {
  const apply = compileAddFields(spec, name);
  return (docs, vars) => {
    const outs = new Array(docs.length);
    // ROOT and CURRENT are bound in vars itself (expr.bind), not in a copy
    const root = expr.bind(vars, 'ROOT'), current = expr.bind(vars, 'CURRENT');
    try {
      for (let i = 0; i < docs.length; i++) {
        const doc = docs[i];
        const out = Object.assign({}, doc);
        vars.ROOT = doc;
        vars.CURRENT = doc;
        apply(out, doc, vars);
        outs[i] = out;
      }
    } finally {
      expr.unbind(vars, 'CURRENT', current);
      expr.unbind(vars, 'ROOT', root);
    }
    return outs;
  };
}

function unsetStage(spec) {
  const fields = Array.isArray(spec) ? spec : [spec];
  for (const f of fields) if (typeof f !== 'string') fail(31120, '$unset specification must be a string or an array containing only string values');
  const paths = fields.map((f) => f.split('.'));
  if (paths.every((p) => p.length === 1)) {
    // top-level fields: the document is copied without them (a copy that
    // deleted them would be an object in V8's slow dictionary mode, and so
    // would every stored version made from it)
    const drop = new Set(fields);
    return (docs) => docs.map((doc) => {
      const out = {};
      const keys = Object.keys(doc);
      for (let i = 0; i < keys.length; i++) if (!drop.has(keys[i])) out[keys[i]] = doc[keys[i]];
      return out;
    });
  }
  return (docs) => docs.map((doc) => {
    const out = Object.assign({}, doc);
    for (const p of paths) removePathIn(out, p);
    return out;
  });
}

// Projection as $project (and find/findAndModify projections, 4.4+) reads it.
// Returns (doc, vars) => projected doc.
//
// As mongod's projection parser: the specification is one tree of paths
// (dotted names and sub-objects alike; a name -> true (included), false
// (excluded), a compiled expression, or the tree under it), and a path that
// reaches a leaf already there, or ends where a field already is, is a path
// collision (31249, 31250).
function compileProjection(spec, where = '$project') {
  if (!V.isPlainDoc(spec)) fail(2, `${where} specification must be an object`);
  const keys = Object.keys(spec);
  if (where === '$project' && keys.length === 0) fail(51272, 'Invalid $project :: caused by :: projection specification must have at least one field');
  let mode = null; // 'include' | 'exclude'
  let idMode = null;
  const tree = new Map();
  const excluded = [];
  const parse = (obj, node, prefix) => {
    for (const key of Object.keys(obj)) {
      const v = obj[key];
      if (where === '$project' && (key === '$' || key.endsWith('.$') || key.includes('.$.'))) {
        projFail(31324, where, 'Cannot use positional projection in aggregation projection');
      }
      const bad = pathError(key, where !== '$project');
      if (bad) projFail(bad[0], where, bad[1]);
      if (V.isFieldsDoc(v)) {
        parse(v, addAtPath(node, key.split('.'), key, undefined, where), prefix + key + '.');
        continue;
      }
      // (mongod's message names no path)
      if (isEmptyDoc(v)) projFail(51270, where, 'An empty sub-projection is not a valid value. Found empty object at path');
      let kind;
      if (V.isNumber(v) || typeof v === 'boolean') kind = V.truthy(v) ? 'include' : 'exclude';
      else kind = 'expr';
      const topId = node === tree && key === '_id';
      const leaf = kind === 'expr' ? expr.compile(v) : kind === 'include';
      addAtPath(node, key.split('.'), key, leaf, where);
      if (topId && kind !== 'expr') { idMode = kind; continue; }
      const m = kind === 'exclude' ? 'exclude' : 'include';
      if (kind === 'expr' && mode === 'exclude') {
        if (V.isPlainDoc(v)) projFail(31252, where, 'Cannot use expression other than $meta in exclusion projection');
        projFail(31310, where, `Cannot use an expression ${key}: ${V.render(v)} in an exclusion projection`);
      }
      if (mode && mode !== m) {
        if (m === 'exclude') projFail(31254, where, `Cannot do exclusion on field ${key} in inclusion projection`);
        projFail(31253, where, `Cannot do inclusion on field ${key} in exclusion projection`);
      }
      mode = m;
      if (kind === 'exclude') excluded.push((prefix + key).split('.'));
    }
  };
  parse(spec, tree, '');
  if (!mode) mode = idMode === 'include' ? 'include' : 'exclude';
  if (mode === 'exclude') {
    const dropId = idMode === 'exclude';
    return (doc) => {
      const out = Object.assign({}, doc);
      if (dropId) delete out._id;
      for (const p of excluded) removePathIn(out, p);
      return out;
    };
  }
  // Like mongod: the tree walked along each document, so that fields come
  // out in the document's order, then the computed fields in the order
  // their names first appear (new ones at the end), into documents and
  // arrays as $addFields sets them; a $project stage projects into arrays
  // nested in arrays, a find projection drops them (mongod's array
  // recursion policies)
  if (idMode === 'exclude') tree.delete('_id');
  else if (!tree.has('_id')) tree.set('_id', true);
  const computed = prepare(tree);
  const nested = where === '$project';
  return (doc, vars) => {
    const out = includeFields(doc, tree, nested);
    if (computed) {
      const v2 = vars ? Object.assign({}, vars, { ROOT: doc, CURRENT: doc }) : { ROOT: doc, CURRENT: doc };
      applyComputed(out, tree, doc, v2);
    }
    return out;
  };
}

// A projection's parse error: a $project stage's names the stage, as
// mongod's does; a find projection's is the parser's own
function projFail(code, where, msg) {
  return fail(code, where === '$project' ? `Invalid $project :: caused by :: ${msg}` : msg);
}

// The tree at the first n of parts under node, made where missing; a leaf
// on the way is a collision (path: parts joined, for the message)
function internalAt(node, parts, n, path, where) {
  for (let i = 0; i < n; i++) {
    let sub = node.get(parts[i]);
    if (sub === undefined) { sub = new Map(); node.set(parts[i], sub); }
    else if (!(sub instanceof Map)) {
      projFail(31249, where, `Path collision at ${path} remaining portion ${parts.slice(1).join('.')}`);
    }
    node = sub;
  }
  return node;
}

// mongod's addNodeAtPath: leaf at parts under node; a sub-object of the
// specification (leaf undefined) goes into a tree already there
function addAtPath(node, parts, path, leaf, where) {
  const last = parts.length - 1;
  const parent = internalAt(node, parts, last, path, where);
  const there = parent.get(parts[last]);
  if (leaf === undefined) {
    if (there === undefined) { const sub = new Map(); parent.set(parts[last], sub); return sub; }
    if (there instanceof Map) return there;
  }
  if (there !== undefined) projFail(31250, where, `Path collision at ${path}`);
  parent.set(parts[last], leaf);
  return leaf;
}

// Marks each tree with what the walks need: walk (how many of its fields
// the inclusion walk takes from the document) and computed (whether
// computed fields lie under it). Whether the tree has computed fields.
function prepare(tree) {
  let walk = 0, computed = false;
  for (const node of tree.values()) {
    if (typeof node === 'function') { computed = true; continue; }
    walk += 1;
    if (node instanceof Map && prepare(node)) computed = true;
  }
  tree.walk = walk;
  tree.computed = computed;
  return computed;
}

function includeFields(doc, tree, nested) {
  const out = {};
  let left = tree.walk;
  if (left === 0) return out;
  for (const k of Object.keys(doc)) {
    const t = tree.get(k);
    if (t === undefined || typeof t === 'function') continue;
    const v = t === true ? doc[k] : includeUnder(doc[k], t, nested);
    if (v !== undefined) out[k] = v;
    if (--left === 0) break;
  }
  return out;
}

// what a subtree keeps of a value: a document's included fields, an array's
// documents (and nested arrays, when nested) projected, nothing of a scalar
function includeUnder(v, tree, nested) {
  if (V.isPlainDoc(v)) return includeFields(v, tree, nested);
  if (!Array.isArray(v)) return undefined;
  const arr = [];
  for (const el of v) {
    if (V.isPlainDoc(el)) arr.push(includeFields(el, tree, nested));
    else if (nested && Array.isArray(el)) arr.push(includeUnder(el, tree, nested));
  }
  return arr;
}

function sortKeyFn(spec) {
  if (!V.isPlainDoc(spec) || Object.keys(spec).length === 0) fail(15976, '$sort stage must have at least one sort key');
  const keys = Object.keys(spec).map((k) => {
    const d = spec[k];
    let dir;
    if (V.isNumber(d)) dir = V.num(d);
    else if (V.isPlainDoc(d) && d.$meta) dir = 0;
    else fail(15974, 'Illegal key in $sort specification: ' + k + ': ' + V.render(d));
    if (dir !== 1 && dir !== -1) fail(15975, '$sort key ordering must be 1 (for ascending) or -1 (for descending)');
    return [k.split('.'), dir];
  });
  const keyOf = (doc, parts, dir) => {
    const vals = query.reach(doc, parts, 0, []);
    // Arrays sort by their smallest (ascending) or largest (descending)
    // element; an empty array sorts before null and missing.
    let best;
    let seen = false;
    for (const v of vals) {
      const cands = Array.isArray(v) ? (v.length ? v : [EMPTY_ARRAY]) : [v];
      for (const c of cands) {
        if (!seen || dir * sortCompare(c, best) < 0) { best = c; seen = true; }
      }
    }
    return best;
  };
  return (a, b) => {
    for (const [parts, dir] of keys) {
      const c = sortCompare(keyOf(a, parts, dir), keyOf(b, parts, dir));
      if (c) return dir * c;
    }
    return 0;
  };
}

const EMPTY_ARRAY = Symbol('empty array');

function sortCompare(a, b) {
  if (a === EMPTY_ARRAY || b === EMPTY_ARRAY) {
    if (a === b) return 0;
    const other = a === EMPTY_ARRAY ? b : a;
    const c = V.typeName(other) === 'minKey' ? 1 : -1; // EMPTY_ARRAY vs other
    return a === EMPTY_ARRAY ? c : -c;
  }
  return V.compare(a, b);
}

function sortDocs(docs, spec) {
  const cmp = sortKeyFn(spec);
  // Array.prototype.sort is stable, so ties keep natural order as mongod's does.
  return docs.slice().sort(cmp);
}

function groupStage(spec) {
  if (!V.isPlainDoc(spec) || !('_id' in spec)) fail(15955, "a group specification must include an _id");
  const idf = expr.compile(spec._id);
  const accs = Object.keys(spec).filter((k) => k !== '_id').map((k) => {
    const a = spec[k];
    if (!V.isPlainDoc(a) || Object.keys(a).length !== 1) fail(40234, `The field '${k}' must be an accumulator object`);
    const op = Object.keys(a)[0];
    const f = expr.compile(a[op]);
    return [k, op, f];
  });
  return (docs, vars) => {
    const groups = new Map();
    for (const doc of docs) {
      const v2 = Object.assign({}, vars, { ROOT: doc, CURRENT: doc });
      let id = idf(doc, v2);
      if (id === undefined) id = null;
      const key = groupKey(id);
      let g = groups.get(key);
      if (!g) { g = { _id: id, st: accs.map(() => ({ vals: [] })) }; groups.set(key, g); }
      accs.forEach(([, , f], i) => g.st[i].vals.push(f(doc, v2)));
    }
    const out = [];
    for (const g of groups.values()) {
      const o = { _id: g._id };
      accs.forEach(([k, op], i) => {
        const vals = g.st[i].vals;
        o[k] = accumulate(op, vals);
      });
      out.push(o);
    }
    return out;
  };
}

function groupKey(v) {
  const t = V.typeName(v);
  if (V.isNumber(v)) return 'n:' + V.num(v);
  if (t === 'string') return 's:' + v;
  return t + ':' + V.render(v);
}

function accumulate(op, vals) {
  switch (op) {
    case '$sum': {
      const nums = vals.filter((v) => V.isNumber(v));
      return nums.length ? expr.addValues(nums, '$sum') : new Int32(0);
    }
    case '$avg': {
      const nums = vals.filter((v) => V.isNumber(v));
      return nums.length ? new V.Double(nums.reduce((s, v) => s + V.num(v), 0) / nums.length) : null;
    }
    case '$min': case '$max': {
      let best;
      for (const v of vals) {
        if (v === undefined || v === null) continue;
        if (best === undefined || (op === '$max' ? V.compare(v, best) > 0 : V.compare(v, best) < 0)) best = v;
      }
      return best === undefined ? null : best;
    }
    case '$first': return vals.length ? (vals[0] === undefined ? null : vals[0]) : null;
    case '$last': return vals.length ? (vals[vals.length - 1] === undefined ? null : vals[vals.length - 1]) : null;
    case '$push': return vals.filter((v) => v !== undefined);
    case '$addToSet': {
      const out = [];
      for (const v of vals) if (v !== undefined && !out.some((o) => V.equals(o, v))) out.push(v);
      return out;
    }
    case '$count': return new Int32(vals.length);
    default: return fail(15952, `unknown group operator '${op}'`);
  }
}

function unwindStage(spec) {
  const opts = typeof spec === 'string' ? { path: spec } : spec;
  if (!opts || typeof opts.path !== 'string' || opts.path[0] !== '$') fail(28818, "path option to $unwind stage should be prefixed with a '$'");
  const parts = opts.path.slice(1).split('.');
  const keepEmpty = !!opts.preserveNullAndEmptyArrays;
  const idxField = opts.includeArrayIndex;
  return (docs) => {
    const out = [];
    for (const doc of docs) {
      const v = V.getPath(doc, parts.join('.'));
      if (Array.isArray(v) && v.length) {
        v.forEach((el, i) => {
          const o = V.clone(doc);
          setPathIn(o, parts, el);
          if (idxField) o[idxField] = V.Long.fromNumber(i);
          out.push(o);
        });
      } else if (v !== undefined && v !== null && !Array.isArray(v)) {
        const o = Object.assign({}, doc);
        if (idxField) o[idxField] = null;
        out.push(o);
      } else if (keepEmpty) {
        const o = Object.assign({}, doc);
        if (Array.isArray(v)) removePathIn(o, parts);
        if (idxField) o[idxField] = null;
        out.push(o);
      }
    }
    return out;
  };
}

function replaceRootStage(spec, name) {
  let e;
  if (name === '$replaceRoot') {
    if (!V.isPlainDoc(spec) || !('newRoot' in spec)) fail(40231, "no newRoot specified for the $replaceRoot stage");
    e = expr.compile(spec.newRoot);
  } else e = expr.compile(spec);
  return (docs, vars) => docs.map((doc) => {
    const v = e(doc, Object.assign({}, vars, { ROOT: doc, CURRENT: doc }));
    if (!V.isPlainDoc(v)) {
      fail(40228, `'replacement document' must evaluate to an object, but resulting value was: ${V.render(v === undefined ? 'MISSING' : v)}. Type of resulting value: '${V.typeName(v)}'. Input document: ${V.render(doc)}`);
    }
    return v;
  });
}

const UPDATE_STAGES = new Set(['$addFields', '$set', '$project', '$unset', '$replaceRoot', '$replaceWith']);

// compileStages(pipeline, {update}) -> (docs, vars) => docs
function compileStages(pipeline, opts = {}) {
  if (!Array.isArray(pipeline)) fail(14, "'pipeline' option must be specified as an array");
  const stages = pipeline.map((st) => {
    if (!V.isPlainDoc(st) || Object.keys(st).length !== 1) {
      fail(40323, 'A pipeline stage specification object must contain exactly one field.');
    }
    const name = Object.keys(st)[0];
    const spec = st[name];
    if (opts.update && !UPDATE_STAGES.has(name)) {
      fail(72, `${name} is not allowed to be used within an update`);
    }
    switch (name) {
      case '$addFields': case '$set': return addFieldsStage(spec, name);
      case '$unset': return unsetStage(spec);
      case '$project': {
        const p = compileProjection(spec);
        return (docs, vars) => docs.map((d) => p(d, vars));
      }
      case '$replaceRoot': case '$replaceWith': return replaceRootStage(spec, name);
      case '$match': {
        if (!V.isPlainDoc(spec)) fail(15959, 'the match filter must be an expression in an object');
        let curVars = {};
        const m = query.compile(spec, { compileExpr: expr.compile, vars: () => curVars });
        return (docs, vars) => { curVars = vars; return docs.filter((d) => m(d)); };
      }
      case '$sort': { sortKeyFn(spec); return (docs) => sortDocs(docs, spec); }
      case '$limit': {
        if (!V.isNumber(spec) || V.num(spec) <= 0) fail(15958, 'the limit must be positive');
        const n = V.num(spec);
        return (docs) => docs.slice(0, n);
      }
      case '$skip': {
        if (!V.isNumber(spec) || V.num(spec) < 0) fail(15956, 'the skip must be a non-negative number');
        const n = V.num(spec);
        return (docs) => docs.slice(n);
      }
      case '$count': {
        if (typeof spec !== 'string' || !spec) fail(40156, 'the count field must be a non-empty string');
        return (docs) => (docs.length ? [{ [spec]: new Int32(docs.length) }] : []);
      }
      case '$group': return groupStage(spec);
      case '$unwind': return unwindStage(spec);
      case '$sortByCount': {
        const g = groupStage({ _id: spec, count: { $sum: 1 } });
        return (docs, vars) => sortDocs(g(docs, vars), { count: -1 });
      }
      default: {
        const delegated = opts.update ? null : require('./mingo-bridge').compileStage(name, spec);
        if (delegated) return delegated;
        return fail(40324, `Unrecognized pipeline stage name: '${name}'`);
      }
    }
  });
  return (docs, vars) => {
    let cur = docs;
    for (const s of stages) cur = s(cur, vars);
    return cur;
  };
}

module.exports = { compileStages, compileProjection, sortDocs, sortKeyFn, setPathIn };
