'use strict';
// Compilation cached by shape. Two lock acquisitions send the same update
// pipeline except for literal values (owner, ttl, holder), so the pipeline is
// turned into a template whose literal leaves are parameter slots, compiled
// once per template shape, and run with the command's own literals as
// parameters. Anything the template cannot express faithfully (operators
// delegated to mingo, stages other than $set/$addFields/$replaceWith, whose
// literals are structural) is kept verbatim in the key instead.

const BSON = require('bson');
const V = require('./values');
const expr = require('./expr');

const NATIVE = new Set(('$abs $add $and $arrayElemAt $avg $ceil $cmp $concat $cond $divide $eq $floor $getField $gt ' +
  '$gte $ifNull $in $isArray $isNumber $let $lt $lte $max $mergeObjects $min $mod $multiply $ne $not $or $size ' +
  '$subtract $sum $switch $toBool $toDate $toDouble $toInt $toLong $toLower $toString $toUpper $trunc $type ' +
  '$filter $map $concatArrays $indexOfArray').split(' '));
// operators whose argument document names a variable ('as'): that name is
// structure, kept in the key, never a parameter
const NAMES_VAR = new Set(['$filter', '$map']);

const NOSHAPE = new Error('no shape');

function param(v, params) {
  params.push(v);
  return [new expr.Param(params.length - 1), '?'];
}

// [template, key] of an aggregation expression.
function shapeExpr(v, params) {
  if (typeof v === 'string') return v[0] === '$' ? [v, 'S' + JSON.stringify(v)] : param(v, params);
  if (Array.isArray(v)) {
    const t = [], k = [];
    for (const x of v) { const [a, b] = shapeExpr(x, params); t.push(a); k.push(b); }
    return [t, '[' + k.join(',') + ']'];
  }
  if (V.isPlainDoc(v)) {
    const keys = Object.keys(v);
    if (keys.length === 0) return [v, '{}'];
    if (keys[0][0] === '$') {
      if (keys.length !== 1) throw NOSHAPE;
      const op = keys[0];
      if (op === '$literal') return param(v.$literal, params);
      if (!NATIVE.has(op)) throw NOSHAPE;
      if (NAMES_VAR.has(op) && V.isPlainDoc(v[op])) {
        const arg = v[op], t = {}, k = [];
        for (const key of Object.keys(arg)) {
          if (key === 'as') { t.as = arg.as; k.push('as:' + verbatim(arg.as)); continue; }
          const [a, b] = shapeExpr(arg[key], params);
          t[key] = a;
          k.push(JSON.stringify(key) + ':' + b);
        }
        return [{ [op]: t }, '{' + op + ':{' + k.join(',') + '}}'];
      }
      const [t, k] = shapeExpr(v[op], params);
      return [{ [op]: t }, '{' + op + ':' + k + '}'];
    }
    const t = {}, k = [];
    for (const key of keys) {
      if (key[0] === '$') throw NOSHAPE;
      const [a, b] = shapeExpr(v[key], params);
      t[key] = a;
      k.push(JSON.stringify(key) + ':' + b);
    }
    return [t, '{' + k.join(',') + '}'];
  }
  return param(v, params);
}

function verbatim(v) {
  return BSON.EJSON.stringify(v, { relaxed: false });
}

// [template, key] of an update pipeline, or null.
function shapePipeline(stages, params) {
  try {
    const t = [], k = [];
    for (const st of stages) {
      const names = V.isPlainDoc(st) ? Object.keys(st) : [];
      const name = names[0];
      if (names.length === 1 && (name === '$set' || name === '$addFields') && V.isPlainDoc(st[name])) {
        const spec = st[name], ts = {}, ks = [];
        for (const key of Object.keys(spec)) {
          const [a, b] = shapeExpr(spec[key], params);
          ts[key] = a;
          ks.push(JSON.stringify(key) + ':' + b);
        }
        t.push({ [name]: ts });
        k.push(name + '{' + ks.join(',') + '}');
      } else if (names.length === 1 && name === '$replaceWith') {
        const [a, b] = shapeExpr(st[name], params);
        t.push({ $replaceWith: a });
        k.push('$replaceWith' + b);
      } else {
        t.push(st);
        k.push('R' + verbatim(st));
      }
    }
    return [t, 'P[' + k.join(',') + ']'];
  } catch (e) {
    if (e === NOSHAPE) return null;
    throw e;
  }
}

// [template, key] of a find/findAndModify projection, or null.
function shapeProjection(spec, params) {
  try {
    const [t, k] = shapeProjFields(spec, params);
    return [t, 'J' + k];
  } catch (e) {
    if (e === NOSHAPE) return null;
    throw e;
  }
}

// a projection's fields: flags are shape, and so is a sub-object that is
// not an expression (a sub-projection: its own fields)
function shapeProjFields(spec, params) {
  const t = {}, k = [];
  for (const key of Object.keys(spec)) {
    const v = spec[key];
    if (V.isNumber(v) || typeof v === 'boolean') { t[key] = v; k.push(JSON.stringify(key) + ':N' + (V.truthy(v) ? 1 : 0)); continue; }
    if (V.isFieldsDoc(v)) {
      const [a, b] = shapeProjFields(v, params);
      t[key] = a;
      k.push(JSON.stringify(key) + ':P' + b);
      continue;
    }
    const [a, b] = shapeExpr(v, params);
    t[key] = a;
    k.push(JSON.stringify(key) + ':' + b);
  }
  return [t, '{' + k.join(',') + '}'];
}

const compiled = new Map();
const LIMIT = 2048;

function cached(key, make) {
  let c = compiled.get(key);
  if (c === undefined) {
    c = make();
    if (compiled.size >= LIMIT) compiled.clear();
    compiled.set(key, c);
  }
  return c;
}

function withParams(vars, params) {
  const v = Object.assign({}, vars);
  v[expr.PARAMS] = params;
  return v;
}

const { Lazy } = require('./lazy');
const { MongoError } = require('./errors');

// A template that fails to compile is kept as null: each command of that
// shape compiles its own value, so that the error names the command's
// values (a template's parameter slots would show as {})
function orNull(make) {
  try {
    return make();
  } catch (e) {
    if (e instanceof MongoError) return null;
    throw e;
  }
}

// Compiled template for a value decoded lazily: keyed by the shape read from
// its bytes; the template itself comes from the decoded value, and is used
// only if the object walk finds exactly the parameters the byte walk found.
function lazyCompiled(lazy, shapeOf, compile) {
  const s = lazy.shaped();
  if (!s) return null;
  const c = cached(s.key, () => {
    const params = [];
    const t = shapeOf(lazy.value(), params);
    if (!t || params.length !== s.params.length) return { mismatch: true };
    const fn = orNull(() => compile(t[0]));
    return fn === null ? { mismatch: true } : { fn };
  });
  return c.mismatch ? null : { fn: c.fn, params: s.params };
}

// compileUpdate(u) as update.compileUpdate, shared by shape for pipelines.
// (update.js and pipeline.js require this module: theirs are looked up on
// first use, once)
let updateModule = null, pipelineModule = null;

function compileUpdate(u) {
  const update = updateModule || (updateModule = require('./update'));
  if (u instanceof Lazy) {
    const lc = lazyCompiled(u, shapePipeline, update.compileUpdate);
    if (!lc) return update.compileUpdate(u.value());
    const { fn: c, params } = lc;
    return { kind: c.kind, apply: (doc, ctx) => c.apply(doc, Object.assign({}, ctx, { vars: withParams(ctx.vars, params) })) };
  }
  if (!Array.isArray(u)) return update.compileUpdate(u);
  const params = [];
  const s = shapePipeline(u, params);
  if (!s) return update.compileUpdate(u);
  const c = cached(s[1], () => orNull(() => update.compileUpdate(s[0])));
  if (c === null) return update.compileUpdate(u);
  return { kind: c.kind, apply: (doc, ctx) => c.apply(doc, Object.assign({}, ctx, { vars: withParams(ctx.vars, params) })) };
}

function compileProjection(spec, where) {
  const pipeline = pipelineModule || (pipelineModule = require('./pipeline'));
  if (spec instanceof Lazy) {
    const lc = lazyCompiled(spec, shapeProjection, (t) => pipeline.compileProjection(t, where));
    if (!lc) return pipeline.compileProjection(spec.value(), where);
    const { fn: c, params } = lc;
    return (doc, vars) => c(doc, withParams(vars || {}, params));
  }
  const params = [];
  const s = shapeProjection(spec, params);
  if (!s) return pipeline.compileProjection(spec, where);
  const c = cached(s[1] + where, () => orNull(() => pipeline.compileProjection(s[0], where)));
  if (c === null) return pipeline.compileProjection(spec, where);
  return (doc, vars) => c(doc, withParams(vars || {}, params));
}

module.exports = { compileUpdate, compileProjection, shapePipeline, shapeProjection };
