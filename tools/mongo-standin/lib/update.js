'use strict';
// Updates: operator documents ({$set: ..., $inc: ...}), replacement documents
// and pipelines. compileUpdate(u) checks the update once and returns
// apply(doc, {isInsert, vars}) -> new document (the input is never mutated).

const V = require('./values');
const expr = require('./expr');
const query = require('./query');
const pipeline = require('./pipeline');
const { fail } = require('./errors');
const { Int32, Double, Long, Timestamp } = V;

const OPERATORS = new Set(['$set', '$unset', '$inc', '$mul', '$min', '$max', '$setOnInsert', '$currentDate',
  '$rename', '$push', '$addToSet', '$pull', '$pullAll', '$pop', '$bit']);

function isArrayIndex(s) { return /^\d+$/.test(s); }

// Parent container of a path, creating documents on the way when create is
// true; returns [container, lastKey] or null when the path does not exist.
function parentOf(doc, parts, create, full) {
  let cur = doc;
  for (let i = 0; i < parts.length - 1; i++) {
    const k = parts[i];
    let next;
    if (Array.isArray(cur)) {
      if (!isArrayIndex(k)) {
        fail(28, `Cannot create field '${k}' in element {${parts.slice(0, i).join('.')}: ${V.render(cur)}}`);
      }
      next = cur[Number(k)];
    } else next = Object.prototype.hasOwnProperty.call(cur, k) ? cur[k] : undefined;
    if (next === undefined || next === null && create) {
      if (!create) return null;
      if (next === null) {
        fail(28, `Cannot create field '${parts[i + 1]}' in element {${k}: null}`);
      }
      next = {};
      if (Array.isArray(cur)) {
        const idx = Number(k);
        while (cur.length < idx) cur.push(null);
        cur[idx] = next;
      } else cur[k] = next;
    } else if (!V.isPlainDoc(next) && !Array.isArray(next)) {
      if (!create) return null;
      fail(28, `Cannot create field '${parts[i + 1]}' in element {${k}: ${V.render(next)}}`);
    }
    cur = next;
  }
  return [cur, parts[parts.length - 1], full];
}

function getAt(doc, parts) {
  const p = parentOf(doc, parts, false);
  if (!p) return undefined;
  const [c, k] = p;
  if (Array.isArray(c)) return isArrayIndex(k) ? c[Number(k)] : undefined;
  return V.isPlainDoc(c) && Object.prototype.hasOwnProperty.call(c, k) ? c[k] : undefined;
}

function setAt(doc, parts, value) {
  const [c, k] = parentOf(doc, parts, true);
  if (Array.isArray(c)) {
    if (!isArrayIndex(k)) fail(28, `Cannot create field '${k}' in element {${parts.slice(0, -1).join('.')}: ${V.render(c)}}`);
    const idx = Number(k);
    while (c.length < idx) c.push(null);
    c[idx] = value;
  } else c[k] = value;
}

function unsetAt(doc, parts) {
  const p = parentOf(doc, parts, false);
  if (!p) return;
  const [c, k] = p;
  if (Array.isArray(c)) { if (isArrayIndex(k) && Number(k) < c.length) c[Number(k)] = null; }
  else if (V.isPlainDoc(c)) delete c[k];
}

function checkConflicts(paths) {
  const sorted = paths.slice().sort();
  for (let i = 1; i < sorted.length; i++) {
    const a = sorted[i - 1], b = sorted[i];
    if (a === b || b.startsWith(a + '.')) fail(40, `Updating the path '${b}' would create a conflict at '${a}'`);
  }
}

function numericOp(op, cur, arg, path, doc) {
  if (!V.isNumber(arg)) {
    fail(14, `Cannot ${op === '$inc' ? 'increment' : 'multiply'} with non-numeric argument: {${path}: ${V.render(arg)}}`);
  }
  if (cur === undefined) {
    if (op === '$inc') return arg;
    const t = V.typeName(arg);
    return t === 'int' ? new Int32(0) : t === 'long' ? Long.fromNumber(0) : t === 'decimal' ? arg : new Double(0);
  }
  if (!V.isNumber(cur)) {
    fail(14, `Cannot apply ${op} to a value of non-numeric type. {_id: ${V.render(doc._id)}} has the field '${path.split('.').pop()}' of non-numeric type ${V.typeName(cur)}`);
  }
  return op === '$inc' ? expr.addValues([cur, arg], '$inc') : expr.multiply([cur, arg]);
}

function compileOperators(u) {
  const steps = [];
  const paths = [];
  for (const op of Object.keys(u)) {
    if (!OPERATORS.has(op)) {
      if (op[0] === '$') fail(9, `Unknown modifier: ${op}. Expected a valid update modifier or pipeline-style update specified as an array`);
      fail(9, `Unknown modifier: ${op}. Expected a valid update modifier or pipeline-style update specified as an array`);
    }
    const fields = u[op];
    if (!V.isPlainDoc(fields)) {
      fail(9, `Modifiers operate on fields but we found type ${V.typeName(fields)} instead. For example: {$mod: {<field>: ...}} not {${op}: ${V.render(fields)}}`);
    }
    for (const path of Object.keys(fields)) {
      if (path === '') fail(56, `An empty update path is not valid.`);
      const parts = path.split('.');
      if (parts.some((p) => p === '')) fail(56, `The update path '${path}' contains an empty field name, which is not allowed.`);
      if (parts.some((p) => p[0] === '$')) {
        fail(2, `The positional operators in '${path}' are not supported by this server`);
      }
      const arg = fields[path];
      paths.push(path);
      if (op === '$rename') {
        if (typeof arg !== 'string') fail(2, `The 'to' field for $rename must be a string: ${path}: ${V.render(arg)}`);
        paths.push(arg);
      }
      steps.push([op, path, parts, arg]);
    }
  }
  checkConflicts(paths);
  const run = (doc, ctx) => {
    for (const [op, path, parts, arg] of steps) {
      if (parts[0] === '_id' && op !== '$setOnInsert' && !ctx.isInsert) {
        // checked after the update by comparing _id; operators other than
        // $set with the same value fail there
      }
      switch (op) {
        case '$set': setAt(doc, parts, V.clone(arg)); break;
        case '$setOnInsert': if (ctx.isInsert) setAt(doc, parts, V.clone(arg)); break;
        case '$unset': unsetAt(doc, parts); break;
        case '$inc': case '$mul': setAt(doc, parts, numericOp(op, getAt(doc, parts), arg, path, doc)); break;
        case '$min': case '$max': {
          const cur = getAt(doc, parts);
          const c = cur === undefined ? null : V.compare(arg, cur);
          if (cur === undefined || (op === '$min' ? c < 0 : c > 0)) setAt(doc, parts, V.clone(arg));
          break;
        }
        case '$currentDate': {
          const now = ctx.vars.NOW;
          let type = 'date';
          if (V.isPlainDoc(arg)) {
            type = arg.$type;
            if (type !== 'date' && type !== 'timestamp') fail(2, "The '$type' string field is required to be 'date' or 'timestamp': {$currentDate: {field : {$type: 'date'}}}");
          } else if (typeof arg !== 'boolean') fail(2, `${V.typeName(arg)} is not valid type for $currentDate. Please use a boolean ('true') or a $type expression ({$type: 'timestamp/date'}).`);
          setAt(doc, parts, type === 'date' ? new Date(now.getTime()) : ctx.clusterTime || Timestamp.fromBits(0, Math.floor(now.getTime() / 1000)));
          break;
        }
        case '$rename': {
          const v = getAt(doc, parts);
          if (v !== undefined) { unsetAt(doc, parts); setAt(doc, arg.split('.'), v); }
          break;
        }
        case '$push': case '$addToSet': {
          let cur = getAt(doc, parts);
          if (cur === undefined) { cur = []; setAt(doc, parts, cur); }
          if (!Array.isArray(cur)) {
            fail(op === '$push' ? 2 : 14, `The field '${path}' must be an array but is of type ${V.typeName(cur)} in document {_id: ${V.render(doc._id)}}`);
          }
          const each = V.isPlainDoc(arg) && '$each' in arg;
          let items = each ? arg.$each : [arg];
          if (!Array.isArray(items)) fail(2, `The argument to $each in ${op} must be an array but it was of type: ${V.typeName(items)}`);
          items = items.map(V.clone);
          if (op === '$addToSet') {
            for (const it of items) if (!cur.some((c) => V.equals(c, it))) cur.push(it);
          } else {
            const pos = each && arg.$position !== undefined ? V.num(arg.$position) : cur.length;
            cur.splice(pos < 0 ? Math.max(0, cur.length + pos) : pos, 0, ...items);
            if (each && arg.$sort !== undefined) {
              const s = arg.$sort;
              const sorted = V.isPlainDoc(s) ? pipeline.sortDocs(cur, s) : cur.slice().sort((a, b) => V.num(s) * V.compare(a, b));
              cur.splice(0, cur.length, ...sorted);
            }
            if (each && arg.$slice !== undefined) {
              const n = V.num(arg.$slice);
              const kept = n >= 0 ? cur.slice(0, n) : cur.slice(n);
              cur.splice(0, cur.length, ...kept);
            }
          }
          break;
        }
        case '$pull': case '$pullAll': {
          const cur = getAt(doc, parts);
          if (cur === undefined) break;
          if (!Array.isArray(cur)) fail(2, 'Cannot apply $pull to a non-array value');
          let test;
          if (op === '$pullAll') test = (el) => arg.some((a) => V.equals(a, el));
          else if (query.isOperatorDoc(arg)) {
            const m = query.compile({ x: arg });
            test = (el) => m({ x: el });
          } else if (V.isPlainDoc(arg)) {
            const m = query.compile(arg);
            test = (el) => V.isPlainDoc(el) && m(el);
          } else test = (el) => V.equals(el, arg);
          const kept = cur.filter((el) => !test(el));
          cur.splice(0, cur.length, ...kept);
          break;
        }
        case '$pop': {
          const cur = getAt(doc, parts);
          if (cur === undefined) break;
          if (!Array.isArray(cur)) fail(14, `Path '${path}' contains an element of non-array type '${V.typeName(cur)}'`);
          if (V.num(arg) >= 0) cur.pop(); else cur.shift();
          break;
        }
        default: fail(9, `Unknown modifier: ${op}`);
      }
    }
    return doc;
  };
  run.steps = steps; // what a change event reports (diff.js)
  return run;
}

function checkReplacement(u) {
  for (const k of Object.keys(u)) {
    if (k[0] === '$') fail(52, `The dollar ($) prefixed field '${k}' in '${k}' is not allowed in the context of an update's replacement document. Consider using an aggregation pipeline with $replaceWith.`);
  }
}

// kind: 'pipeline' | 'operators' | 'replacement'
function kindOf(u) {
  if (Array.isArray(u)) return 'pipeline';
  if (!V.isPlainDoc(u)) fail(9, 'Update argument must be either an object or an array');
  const keys = Object.keys(u);
  if (keys.length === 0) return 'replacement';
  return keys[0][0] === '$' ? 'operators' : 'replacement';
}

function idFirst(doc) {
  if (!('_id' in doc)) return doc;
  const keys = Object.keys(doc);
  if (keys[0] === '_id') return doc;
  const out = { _id: doc._id };
  for (const k of keys) if (k !== '_id') out[k] = doc[k];
  return out;
}

function compileUpdate(u) {
  const kind = kindOf(u);
  if (kind === 'pipeline') {
    const run = pipeline.compileStages(u, { update: true });
    return {
      kind,
      apply(doc, ctx) {
        // the stages bind their variables in ctx.vars and unbind them after
        const [out] = run([doc], ctx.vars);
        if (!('_id' in out) && '_id' in doc) return idFirst(Object.assign({ _id: doc._id }, out));
        return idFirst(out);
      },
    };
  }
  if (kind === 'operators') {
    const run = compileOperators(u);
    return { kind, steps: run.steps, apply(doc, ctx) { return idFirst(run(V.clone(doc), ctx)); } };
  }
  checkReplacement(u);
  return {
    kind,
    apply(doc) {
      const out = V.clone(u);
      if ('_id' in doc && !('_id' in out)) return idFirst(Object.assign({ _id: doc._id }, out));
      return idFirst(out);
    },
  };
}

// The seed of an upsert: the filter's equality fields, dotted paths expanded.
function upsertSeed(filter) {
  const doc = {};
  for (const [path, value] of query.equalityFields(filter)) {
    const parts = path.split('.');
    if (getAt(doc, parts) !== undefined) {
      fail(54, `cannot infer query fields to set, path '${path}' is matched twice`);
    }
    setAt(doc, parts, V.clone(value));
  }
  return doc;
}

module.exports = { compileUpdate, upsertSeed, idFirst, kindOf };
