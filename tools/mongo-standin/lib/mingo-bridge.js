'use strict';
// The engine evaluates the operators the lock library and the conformance
// suite exercise natively (expr.js, pipeline.js), because they must keep BSON
// number types exact: mingo works on JS numbers, where int32 1, int64 1 and
// double 1.0 are the same value. Every other aggregation expression operator
// and pipeline stage mingo knows is delegated to mingo through this bridge:
// values are converted to plain JS on the way in and back on the way out
// (an integral result becomes int32, or int64 beyond int32; any other number
// a double). Two of mingo's differences from MongoDB are corrected here:
// $$NOW is pinned to the command's single time (mingo reads the clock at
// each use) and missing/null are kept apart on the way back.

const mingo = require('mingo');
const core = require('mingo/core');
require('mingo/init/system');
const V = require('./values');
const { fail } = require('./errors');

function toPlain(v) {
  if (v === null || v === undefined) return v;
  if (Array.isArray(v)) return v.map(toPlain);
  if (V.isPlainDoc(v)) {
    const o = {};
    for (const k of Object.keys(v)) o[k] = toPlain(v[k]);
    return o;
  }
  if (V.isNumber(v)) return V.num(v);
  return v;
}

function fromPlain(v) {
  if (v === null || v === undefined) return v;
  if (typeof v === 'number') {
    if (Number.isInteger(v)) {
      if (v >= V.INT32_MIN && v <= V.INT32_MAX) return new V.Int32(v);
      if (Number.isSafeInteger(v)) return V.Long.fromNumber(v);
    }
    return new V.Double(v);
  }
  if (Array.isArray(v)) return v.map(fromPlain);
  if (V.isPlainDoc(v)) {
    const o = {};
    for (const k of Object.keys(v)) {
      const x = fromPlain(v[k]);
      if (x !== undefined) o[k] = x;
    }
    return o;
  }
  return v;
}

// "$$NOW" (and "$$NOW.x") becomes the command's time as a literal.
function pinNow(expr, now) {
  if (typeof expr === 'string') return expr === '$$NOW' ? { $literal: now } : expr;
  if (Array.isArray(expr)) return expr.map((e) => pinNow(e, now));
  if (V.isPlainDoc(expr)) {
    const o = {};
    for (const k of Object.keys(expr)) o[k] = k === '$literal' ? expr[k] : pinNow(expr[k], now);
    return o;
  }
  return expr;
}

function options(vars) {
  const variables = {};
  for (const k of Object.keys(vars || {})) {
    if (k !== 'ROOT' && k !== 'CURRENT' && k !== 'NOW') variables[k] = toPlain(vars[k]);
  }
  return core.initOptions({ variables, useStrictMode: true, scriptEnabled: false });
}

function knowsExpression(op) {
  return !!core.getOperator('expression', op, { useGlobalContext: true }) ||
    !!core.getOperator('accumulator', op, { useGlobalContext: true });
}

function knowsStage(name) {
  return !!core.getOperator('pipeline', name, { useGlobalContext: true });
}

function guard(what, fn) {
  try {
    return fn();
  } catch (e) {
    if (e && e.code !== undefined) throw e;
    return fail(2, `${what}: ${e && e.message ? e.message : e}`);
  }
}

// compileExpression(op, arg) -> (doc, vars) => value
function compileExpression(op, arg) {
  if (!knowsExpression(op)) return null;
  return (doc, vars) => guard(`Invalid ${op}`, () => {
    const now = vars && vars.NOW ? vars.NOW : new Date();
    const expr = pinNow(toPlain({ [op]: arg }), now);
    const cur = vars && vars.CURRENT !== undefined ? vars.CURRENT : doc;
    return fromPlain(core.computeValue(toPlain(cur), expr, null, options(vars)));
  });
}

// compileStage(name, spec) -> (docs, vars) => docs
function compileStage(name, spec) {
  if (!knowsStage(name) || ['$out', '$merge', '$lookup', '$graphLookup', '$unionWith'].includes(name)) return null;
  return (docs, vars) => guard(`Invalid ${name}`, () => {
    const now = vars && vars.NOW ? vars.NOW : new Date();
    const stage = pinNow(toPlain({ [name]: spec }), now);
    return mingo.aggregate(docs.map(toPlain), [stage], options(vars)).map(fromPlain);
  });
}

module.exports = { compileExpression, compileStage, toPlain, fromPlain };
