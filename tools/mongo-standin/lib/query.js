'use strict';
// Query filters ({a: 1, b: {$gt: 2}}) compiled into predicates over stored
// documents, with MongoDB's rules: implicit traversal of arrays along a path,
// {f: null} matching a missing field, comparisons only within one type class
// (type bracketing), and equality on whole arrays as well as their elements.

const V = require('./values');
const { fail } = require('./errors');

// Values reached by a dotted path, descending into array elements the way
// MongoDB does. Each entry is [value, fromArrayTraversal].
function reach(doc, parts, i, out) {
  if (i === parts.length) { out.push(doc); return out; }
  if (doc === null || doc === undefined || typeof doc !== 'object') { out.push(undefined); return out; }
  const part = parts[i];
  if (Array.isArray(doc)) {
    if (/^\d+$/.test(part)) {
      const idx = Number(part);
      reach(idx < doc.length ? doc[idx] : undefined, parts, i + 1, out);
    }
    let any = false;
    for (const el of doc) {
      if (V.isPlainDoc(el)) { reach(el, parts, i, out); any = true; }
      else if (Array.isArray(el) && false) reach(el, parts, i, out);
    }
    if (!any && !/^\d+$/.test(part)) out.push(undefined);
    return out;
  }
  if (!V.isPlainDoc(doc)) { out.push(undefined); return out; }
  const next = Object.prototype.hasOwnProperty.call(doc, part) ? doc[part] : undefined;
  if (next === undefined) { out.push(undefined); return out; }
  return reach(next, parts, i + 1, out);
}

// A predicate over one reached value: tried on the value itself and, when it
// is an array, on each element.
function anyOf(vals, test, elements = true) {
  for (const v of vals) {
    if (test(v)) return true;
    if (elements && Array.isArray(v)) {
      for (const e of v) if (test(e)) return true;
    }
  }
  return false;
}

// What reach(doc, parts, 0, []) finds when no array lies along the path
// (before its last part): that one value; MULTI when an array does (the
// caller then reaches the general way).
const MULTI = Symbol('multi');
function reachOne(doc, parts) {
  let cur = doc;
  for (let i = 0; i < parts.length; i++) {
    if (cur === null || cur === undefined || typeof cur !== 'object') return undefined;
    if (Array.isArray(cur)) return MULTI;
    if (!V.isPlainDoc(cur)) return undefined;
    const part = parts[i];
    cur = Object.prototype.hasOwnProperty.call(cur, part) ? cur[part] : undefined;
    if (cur === undefined) return undefined;
  }
  return cur;
}

// anyOf(reach(doc, parts, 0, []), test) without building the list when the
// path reaches a single value.
function anyReached(doc, parts, test) {
  const v = reachOne(doc, parts);
  if (v === MULTI) return anyOf(reach(doc, parts, 0, []), test);
  if (test(v)) return true;
  if (Array.isArray(v)) {
    for (let i = 0; i < v.length; i++) if (test(v[i])) return true;
  }
  return false;
}

function isOperatorDoc(v) {
  if (!V.isPlainDoc(v)) return false;
  const ks = Object.keys(v);
  return ks.length > 0 && ks[0][0] === '$';
}

function regexOf(v) {
  if (v instanceof RegExp) return v;
  if (v && v._bsontype === 'BSONRegExp') {
    const flags = (v.options || '').replace(/[^imsu]/g, '');
    return new RegExp(v.pattern, flags);
  }
  return null;
}

function eqTest(target) {
  const re = regexOf(target);
  if (re) return (v) => (typeof v === 'string' && re.test(v)) || (V.typeName(v) === 'regex' && V.equals(v, target));
  if (target === null) return (v) => v === null || v === undefined;
  // a string equals only the same string (or a BSON symbol of it)
  if (typeof target === 'string') {
    return (v) => (typeof v === 'string' ? v === target : v !== null && typeof v === 'object' && V.equals(v, target));
  }
  return (v) => v !== undefined && V.equals(v, target);
}

function rangeTest(op, target) {
  const cls = V.CANON[V.typeName(target)];
  return (v) => {
    if (v === undefined) {
      if (target !== null) return false;
      return op === '$gte' || op === '$lte';
    }
    const tv = V.typeName(v);
    if (V.typeName(target) === 'minKey' || V.typeName(target) === 'maxKey') {
      const c = V.compare(v, target);
      return cmpOk(op, c);
    }
    if (V.CANON[tv] !== cls) return false;
    const c = V.compare(v, target);
    return cmpOk(op, c);
  };
}

function cmpOk(op, c) {
  switch (op) {
    case '$gt': return c > 0;
    case '$gte': return c >= 0;
    case '$lt': return c < 0;
    case '$lte': return c <= 0;
    default: return false;
  }
}

const TYPE_ALIASES = {
  double: 1, string: 2, object: 3, array: 4, binData: 5, undefined: 6, objectId: 7, bool: 8, date: 9,
  null: 10, regex: 11, dbPointer: 12, javascript: 13, symbol: 14, javascriptWithScope: 15, int: 16,
  timestamp: 17, long: 18, decimal: 19, minKey: -1, maxKey: 127,
};

function typeTest(spec) {
  const wanted = (Array.isArray(spec) ? spec : [spec]).map((t) => {
    if (typeof t === 'string') {
      if (t === 'number') return 'number';
      if (!(t in TYPE_ALIASES)) fail(2, `Unknown type name alias: ${t}`);
      return t;
    }
    const n = V.num(t);
    const name = Object.keys(TYPE_ALIASES).find((k) => TYPE_ALIASES[k] === n);
    if (!name) fail(2, `Invalid numerical type code: ${n}`);
    return name;
  });
  if (wanted.length === 1 && wanted[0] !== 'number') {
    const w = wanted[0];
    return (v) => v !== undefined && V.typeName(v) === w;
  }
  return (v) => {
    if (v === undefined) return false;
    const t = V.typeName(v);
    return wanted.some((w) => w === t || (w === 'number' && V.isNumber(v)));
  };
}

// compileOps(path, opsDoc) -> predicate over the document
function compileField(path, spec, ctx) {
  const parts = path.split('.');
  const get = (doc) => reach(doc, parts, 0, []);
  if (!isOperatorDoc(spec)) {
    const t = eqTest(spec);
    return (doc) => anyReached(doc, parts, t);
  }
  const preds = [];
  const keys = Object.keys(spec);
  for (const op of keys) {
    const arg = spec[op];
    switch (op) {
      case '$eq': { const t = eqTest(arg); preds.push((doc) => anyReached(doc, parts, t)); break; }
      case '$ne': { const t = eqTest(arg); preds.push((doc) => !anyReached(doc, parts, t)); break; }
      case '$gt': case '$gte': case '$lt': case '$lte': {
        const t = rangeTest(op, arg); preds.push((doc) => anyReached(doc, parts, t)); break;
      }
      case '$in': case '$nin': {
        if (!Array.isArray(arg)) fail(2, `${op} needs an array`);
        const tests = arg.map((a) => {
          if (isOperatorDoc(a)) fail(2, 'cannot nest $ under $in');
          return eqTest(a);
        });
        const t = (v) => {
          for (let i = 0; i < tests.length; i++) if (tests[i](v)) return true;
          return false;
        };
        if (op === '$in') preds.push((doc) => anyReached(doc, parts, t));
        else preds.push((doc) => !anyReached(doc, parts, t));
        break;
      }
      case '$exists': {
        const want = V.truthy(arg);
        preds.push((doc) => get(doc).some((v) => v !== undefined) === want);
        break;
      }
      case '$type': { const t = typeTest(arg); preds.push((doc) => anyReached(doc, parts, t)); break; }
      case '$size': {
        if (!V.isNumber(arg)) fail(2, '$size needs a number');
        const n = V.num(arg);
        preds.push((doc) => get(doc).some((v) => Array.isArray(v) && v.length === n));
        break;
      }
      case '$all': {
        if (!Array.isArray(arg)) fail(2, '$all needs an array');
        const tests = arg.map((a) => (isOperatorDoc(a) && a.$elemMatch ? elemMatchTest(a.$elemMatch, ctx) : eqTest(a)));
        preds.push((doc) => tests.length > 0 && tests.every((t) => anyOf(get(doc), t)));
        break;
      }
      case '$elemMatch': {
        if (!V.isPlainDoc(arg)) fail(2, '$elemMatch needs an Object');
        const t = elemMatchTest(arg, ctx);
        preds.push((doc) => get(doc).some((v) => Array.isArray(v) && v.some(t)));
        break;
      }
      case '$regex': {
        const re = regexOf(arg) || new RegExp(String(arg), (spec.$options || '').replace(/[^imsu]/g, ''));
        preds.push((doc) => anyOf(get(doc), (v) => typeof v === 'string' && re.test(v)));
        break;
      }
      case '$options': if (!('$regex' in spec)) fail(2, '$options needs a $regex'); break;
      case '$mod': {
        if (!Array.isArray(arg) || arg.length !== 2) fail(2, 'malformed mod, needs to be an array');
        const d = V.num(arg[0]), r = V.num(arg[1]);
        if (d === 0) fail(2, 'divisor cannot be 0');
        preds.push((doc) => anyOf(get(doc), (v) => V.isNumber(v) && Math.trunc(V.num(v)) % d === r));
        break;
      }
      case '$not': {
        let inner;
        if (regexOf(arg)) inner = compileField(path, arg, ctx);
        else if (isOperatorDoc(arg)) inner = compileField(path, arg, ctx);
        else fail(2, '$not needs a regex or a document');
        preds.push((doc) => !inner(doc));
        break;
      }
      default:
        fail(2, `unknown operator: ${op}`);
    }
  }
  if (preds.length === 1) return preds[0];
  return (doc) => {
    for (let i = 0; i < preds.length; i++) if (!preds[i](doc)) return false;
    return true;
  };
}

function elemMatchTest(spec, ctx) {
  // {$elemMatch: {$gt: 1}} tests the element itself; otherwise a subquery.
  if (isOperatorDoc(spec) && !['$and', '$or', '$nor', '$expr', '$where'].includes(Object.keys(spec)[0])) {
    const inner = compileField('x', spec, ctx);
    return (el) => inner({ x: el });
  }
  const inner = compile(spec, ctx);
  return (el) => V.isPlainDoc(el) && inner(el);
}

// compile(filter, ctx) -> (doc) => boolean. ctx.expr compiles $expr.
function compile(filter, ctx = {}) {
  if (filter === undefined || filter === null) return () => true;
  if (!V.isPlainDoc(filter)) fail(2, 'filter must be an object');
  const preds = [];
  for (const key of Object.keys(filter)) {
    const arg = filter[key];
    if (key[0] === '$') {
      switch (key) {
        case '$and': case '$or': case '$nor': {
          if (!Array.isArray(arg) || arg.length === 0) fail(2, `${key} argument must be a non-empty array`);
          const subs = arg.map((f) => {
            if (!V.isPlainDoc(f)) fail(2, `${key} argument's entries must be objects`);
            return compile(f, ctx);
          });
          const some = (d) => {
            for (let i = 0; i < subs.length; i++) if (subs[i](d)) return true;
            return false;
          };
          if (key === '$and') {
            preds.push((d) => {
              for (let i = 0; i < subs.length; i++) if (!subs[i](d)) return false;
              return true;
            });
          } else if (key === '$or') preds.push(some);
          else preds.push((d) => !some(d));
          break;
        }
        case '$expr': {
          if (!ctx.compileExpr) fail(2, '$expr is not allowed in this context');
          const e = ctx.compileExpr(arg);
          preds.push((d) => V.truthy(e(d, ctx.vars ? ctx.vars() : {})));
          break;
        }
        case '$comment': break;
        case '$alwaysTrue': break;
        case '$alwaysFalse': preds.push(() => false); break;
        default: fail(2, `unknown top level operator: ${key}`);
      }
      continue;
    }
    preds.push(compileField(key, arg, ctx));
  }
  if (preds.length === 1) return preds[0];
  return (doc) => {
    for (let i = 0; i < preds.length; i++) if (!preds[i](doc)) return false;
    return true;
  };
}

// Equality fields of a filter, as an upsert seeds its new document with them:
// {a: 1, b: {$eq: 2}, $and: [{c: 3}]} -> [['a', 1], ['b', 2], ['c', 3]].
function equalityFields(filter, out = []) {
  if (!V.isPlainDoc(filter)) return out;
  for (const key of Object.keys(filter)) {
    const v = filter[key];
    if (key === '$and' && Array.isArray(v)) { for (const f of v) equalityFields(f, out); continue; }
    if (key[0] === '$') continue;
    if (!isOperatorDoc(v)) {
      if (!regexOf(v)) out.push([key, v]);
    } else if (Object.prototype.hasOwnProperty.call(v, '$eq')) {
      out.push([key, v.$eq]);
    } else if (Array.isArray(v.$in) && v.$in.length === 1 && !regexOf(v.$in[0])) {
      out.push([key, v.$in[0]]);
    }
  }
  return out;
}

// The _id a filter pins down by equality on a scalar, or undefined.
function idEquality(filter) {
  if (!V.isPlainDoc(filter)) return undefined;
  const keys = Object.keys(filter);
  if (!keys.includes('_id')) return undefined;
  let v = filter._id;
  if (isOperatorDoc(v)) {
    const ks = Object.keys(v);
    if (ks.length !== 1 || ks[0] !== '$eq') return undefined;
    v = v.$eq;
  }
  const t = V.typeName(v);
  if (t === 'object' || t === 'array' || t === 'regex' || t === 'null' || t === 'missing') return undefined;
  return v;
}

module.exports = { compile, equalityFields, idEquality, isOperatorDoc, reach };
