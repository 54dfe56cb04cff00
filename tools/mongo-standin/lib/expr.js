'use strict';
// Aggregation expressions compiled once into closures: compile(expr) returns
// (doc, vars) => value, where undefined means "missing" (MongoDB keeps missing
// and null apart in expressions: {$eq: ["$absent", null]} is false, and
// {$set: {f: "$absent"}} leaves f out). vars.NOW is the command's single
// $$NOW; ROOT/CURRENT default to doc.

const V = require('./values');
const { fail } = require('./errors');
const { Int32, Double, Long } = V;

function fieldPath(parts) {
  const n = parts.length;
  const walk = (cur, i) => {
    for (; i < n; i++) {
      if (Array.isArray(cur)) {
        const out = [];
        for (const el of cur) {
          if (V.isPlainDoc(el) || Array.isArray(el)) {
            const r = walk(el, i);
            if (r !== undefined) out.push(r);
          }
        }
        return out;
      }
      if (!V.isPlainDoc(cur)) return undefined;
      cur = Object.prototype.hasOwnProperty.call(cur, parts[i]) ? cur[parts[i]] : undefined;
    }
    return cur;
  };
  return walk;
}

function compilePath(str) {
  // "$a.b" or "$$var.a.b"
  if (str.startsWith('$$')) {
    const parts = str.slice(2).split('.');
    const name = parts.shift();
    const walk = fieldPath(parts);
    if (name === 'REMOVE') return () => undefined;
    if (name === 'ROOT') return (doc, vars) => walk(vars.ROOT !== undefined ? vars.ROOT : doc, 0);
    if (name === 'CURRENT') return (doc, vars) => walk(vars.CURRENT !== undefined ? vars.CURRENT : doc, 0);
    if (!/^[a-zA-Z_][\w]*$/.test(name) && name !== 'NOW') fail(17276, `Use of undefined variable: ${name}`);
    return (doc, vars) => {
      const v = vars[name];
      if (v === undefined && !(name in vars)) fail(17276, `Use of undefined variable: ${name}`);
      return walk(v, 0);
    };
  }
  const path = str.slice(1);
  if (path === '') fail(16872, "'$' by itself is not a valid FieldPath");
  const parts = path.split('.');
  if (parts.length === 1) {
    const k = parts[0];
    return (doc, vars) => {
      const cur = vars.CURRENT !== undefined ? vars.CURRENT : doc;
      return V.isPlainDoc(cur) && Object.prototype.hasOwnProperty.call(cur, k) ? cur[k] : undefined;
    };
  }
  const walk = fieldPath(parts);
  return (doc, vars) => walk(vars.CURRENT !== undefined ? vars.CURRENT : doc, 0);
}

// A parameter slot of a shape-compiled template (see shape.js): evaluates to
// vars[PARAMS][i]. Client input can never produce one.
const PARAMS = Symbol('params');
class Param {
  constructor(i) { Object.defineProperty(this, 'i', { value: i, enumerable: false }); }
}
Param.prototype[V.SLOT] = true;

function compile(expr) {
  if (expr instanceof Param) {
    const i = expr.i;
    return (doc, vars) => vars[PARAMS][i];
  }
  if (typeof expr === 'string') {
    if (expr[0] === '$') return compilePath(expr);
    return () => expr;
  }
  if (Array.isArray(expr)) {
    const items = expr.map(compile);
    return (doc, vars) => items.map((f) => {
      const v = f(doc, vars);
      return v === undefined ? null : v;
    });
  }
  if (V.isPlainDoc(expr)) {
    const keys = Object.keys(expr);
    if (keys.length === 1 && keys[0][0] === '$') return compileOp(keys[0], expr[keys[0]]);
    const fields = keys.map((k) => {
      if (k[0] === '$') fail(16410, `FieldPath field names may not start with '$'. Consider using $getField or $setField.`);
      return [k, compile(expr[k])];
    });
    return (doc, vars) => {
      const o = {};
      for (const [k, f] of fields) {
        const v = f(doc, vars);
        if (v !== undefined) o[k] = v;
      }
      return o;
    };
  }
  return () => expr;
}

function args(arg) {
  return Array.isArray(arg) ? arg : [arg];
}

function nullish(v) { return v === undefined || v === null; }

function needNumber(op, v) {
  if (!V.isNumber(v)) fail(16554, `${op} only supports numeric types, not ${V.typeName(v)}`);
}

// Sum with MongoDB's result typing: int32 + int32 stays int32 unless it
// overflows (then int64), any int64 makes int64, any double makes double,
// and a date plus numbers is a date.
function addValues(values, op = '$add') {
  let date = null;
  let kind = 'int';
  let big = 0n;
  let dbl = 0;
  for (const v of values) {
    if (nullish(v)) return null;
    const t = V.typeName(v);
    if (t === 'date') {
      if (date) fail(16612, 'only one date allowed in an $add expression');
      date = v;
      continue;
    }
    if (!V.isNumber(v)) fail(14, `${op} only supports numeric or date types, not ${t}`);
    if (t === 'double' || t === 'decimal') kind = 'double';
    else if (t === 'long' && kind === 'int') kind = 'long';
    if (kind !== 'double' && t !== 'double' && t !== 'decimal') big += V.toBig(v);
    dbl += V.num(v);
  }
  if (date) {
    const ms = kind === 'double' ? Math.round(dbl) : Number(big);
    return new Date(date.getTime() + ms);
  }
  if (kind === 'double') return new Double(dbl);
  return V.intResult(big, kind === 'long');
}

function subtract(a, b) {
  if (nullish(a) || nullish(b)) return null;
  const ta = V.typeName(a), tb = V.typeName(b);
  if (ta === 'date' && tb === 'date') return Long.fromNumber(a.getTime() - b.getTime());
  if (ta === 'date' && V.isNumber(b)) return new Date(a.getTime() - Math.round(V.num(b)));
  if (!V.isNumber(a) || !V.isNumber(b)) {
    fail(16556, `cant $subtract a ${ta} from a ${tb}`);
  }
  if (ta === 'double' || tb === 'double' || ta === 'decimal' || tb === 'decimal') return new Double(V.num(a) - V.num(b));
  return V.intResult(V.toBig(a) - V.toBig(b), ta === 'long' || tb === 'long');
}

function multiply(values) {
  let kind = 'int';
  let big = 1n;
  let dbl = 1;
  for (const v of values) {
    if (nullish(v)) return null;
    const t = V.typeName(v);
    if (!V.isNumber(v)) fail(16555, `$multiply only supports numeric types, not ${t}`);
    if (t === 'double' || t === 'decimal') kind = 'double';
    else if (t === 'long' && kind === 'int') kind = 'long';
    if (t !== 'double' && t !== 'decimal') big *= V.toBig(v);
    dbl *= V.num(v);
  }
  if (kind === 'double') return new Double(dbl);
  return V.intResult(big, kind === 'long');
}

function toLong(v) {
  if (nullish(v)) return null;
  const t = V.typeName(v);
  switch (t) {
    case 'date': return Long.fromNumber(v.getTime());
    case 'int': case 'long': return Long.fromBigInt(V.toBig(v));
    case 'double': case 'decimal': {
      const n = V.num(v);
      if (!Number.isFinite(n)) fail(241, `Attempt to convert ${n} value to integer type in $convert with no onError value`);
      return Long.fromNumber(Math.trunc(n));
    }
    case 'bool': return Long.fromNumber(v ? 1 : 0);
    case 'string': {
      if (!/^-?\d+$/.test(v)) fail(241, `Failed to parse number '${v}' in $convert with no onError value: Did not consume whole string.`);
      return Long.fromBigInt(BigInt(v));
    }
    default: fail(241, `Unsupported conversion from ${t} to long in $convert with no onError value`);
  }
  return null;
}

function toInt(v) {
  if (nullish(v)) return null;
  const t = V.typeName(v);
  if (t === 'bool') return new Int32(v ? 1 : 0);
  if (t === 'string') {
    if (!/^-?\d+$/.test(v)) fail(241, `Failed to parse number '${v}' in $convert with no onError value`);
    return new Int32(Number(v));
  }
  if (!V.isNumber(v)) fail(241, `Unsupported conversion from ${t} to int in $convert with no onError value`);
  return new Int32(Math.trunc(V.num(v)));
}

function toDouble(v) {
  if (nullish(v)) return null;
  const t = V.typeName(v);
  if (t === 'date') return new Double(v.getTime());
  if (t === 'bool') return new Double(v ? 1 : 0);
  if (t === 'string') {
    const n = Number(v);
    if (v.trim() === '' || Number.isNaN(n)) fail(241, `Failed to parse number '${v}' in $convert with no onError value`);
    return new Double(n);
  }
  if (!V.isNumber(v)) fail(241, `Unsupported conversion from ${t} to double in $convert with no onError value`);
  return new Double(V.num(v));
}

function toStringValue(v) {
  if (nullish(v)) return null;
  const t = V.typeName(v);
  switch (t) {
    case 'string': return v;
    case 'int': case 'double': case 'long': case 'decimal': return V.render(v);
    case 'bool': return String(v);
    case 'objectId': return v.toHexString();
    case 'date': return v.toISOString();
    default: fail(241, `Unsupported conversion from ${t} to string in $convert with no onError value`);
  }
  return null;
}

// (equal under cmpMissing is $eq's equality: the same type class, both
// missing or neither, and V.compare's 0)
function cmpOp(op) {
  return (a, b) => {
    const c = cmpMissing(a, b);
    switch (op) {
      case '$eq': return c === 0;
      case '$ne': return c !== 0;
      case '$gt': return c > 0;
      case '$gte': return c >= 0;
      case '$lt': return c < 0;
      case '$lte': return c <= 0;
      case '$cmp': return new Int32(Math.sign(c));
      default: return false;
    }
  };
}

// In expressions missing sorts before null.
function cmpMissing(a, b) {
  if (a === undefined || b === undefined) {
    if (a === undefined && b === undefined) return 0;
    if (a === undefined) return V.typeName(b) === 'minKey' ? 1 : -1;
    return V.typeName(a) === 'minKey' ? -1 : 1;
  }
  return V.compare(a, b);
}

function arity(op, list, min, max = min) {
  if (list.length < min || list.length > max) {
    if (min === max) fail(16020, `Expression ${op} takes exactly ${min} arguments. ${list.length} were passed in.`);
    fail(28667, `Expression ${op} takes at least ${min} arguments, and at most ${max}, but ${list.length} were passed in.`);
  }
}

// A variable that $let, $filter or $map defines: mongod's rules (a lowercase
// or non-ASCII first character, then letters, digits, _ or non-ASCII;
// CURRENT is the one system variable a user may rebind). A name that is not
// a string reads as "" there.
function checkUserVar(name) {
  if (name === 'CURRENT') return;
  if (typeof name !== 'string' || name === '') fail(16866, 'empty variable names are not allowed');
  const ok = (c, first) => c > 0x7f || (c >= 0x61 && c <= 0x7a) ||
    (!first && ((c >= 0x41 && c <= 0x5a) || (c >= 0x30 && c <= 0x39) || c === 0x5f));
  if (!ok(name.charCodeAt(0), true)) fail(16867, `'${name}' starts with an invalid character for a user variable name`);
  for (let i = 1; i < name.length; i++) {
    if (!ok(name.charCodeAt(i), false)) fail(16868, `'${name}' contains an invalid character for a variable name: '${name[i]}'`);
  }
}

function compileOp(op, arg) {
  switch (op) {
    case '$literal': return () => arg;
    case '$cond': {
      let c, t, e;
      if (Array.isArray(arg)) {
        arity(op, arg, 3);
        [c, t, e] = arg.map(compile);
      } else if (V.isPlainDoc(arg)) {
        if (!('if' in arg)) fail(17080, "Missing 'if' parameter to $cond");
        if (!('then' in arg)) fail(17081, "Missing 'then' parameter to $cond");
        if (!('else' in arg)) fail(17082, "Missing 'else' parameter to $cond");
        c = compile(arg.if); t = compile(arg.then); e = compile(arg.else);
      } else fail(16020, 'Expression $cond takes exactly 3 arguments. 1 were passed in.');
      return (doc, vars) => (V.truthy(c(doc, vars)) ? t(doc, vars) : e(doc, vars));
    }
    case '$ifNull': {
      const list = args(arg);
      if (list.length < 2) fail(1257300, '$ifNull needs at least two arguments, had: ' + list.length);
      const fs = list.map(compile);
      return (doc, vars) => {
        for (let i = 0; i < fs.length - 1; i++) {
          const v = fs[i](doc, vars);
          if (!nullish(v)) return v;
        }
        return fs[fs.length - 1](doc, vars);
      };
    }
    case '$switch': {
      if (!V.isPlainDoc(arg) || !Array.isArray(arg.branches)) fail(40060, '$switch requires at least one branch.');
      const br = arg.branches.map((b) => [compile(b.case), compile(b.then)]);
      const def = 'default' in arg ? compile(arg.default) : null;
      return (doc, vars) => {
        for (const [c, t] of br) if (V.truthy(c(doc, vars))) return t(doc, vars);
        if (!def) fail(40066, '$switch could not find a matching branch for an input, and no default was specified.');
        return def(doc, vars);
      };
    }
    case '$eq': case '$ne': case '$gt': case '$gte': case '$lt': case '$lte': case '$cmp': {
      const list = args(arg);
      arity(op, list, 2);
      const [a, b] = list.map(compile);
      const f = cmpOp(op);
      return (doc, vars) => f(a(doc, vars), b(doc, vars));
    }
    case '$and': {
      const fs = args(arg).map(compile);
      return (doc, vars) => { for (const f of fs) if (!V.truthy(f(doc, vars))) return false; return true; };
    }
    case '$or': {
      const fs = args(arg).map(compile);
      return (doc, vars) => { for (const f of fs) if (V.truthy(f(doc, vars))) return true; return false; };
    }
    case '$not': {
      const list = args(arg);
      arity(op, list, 1);
      const f = compile(list[0]);
      return (doc, vars) => !V.truthy(f(doc, vars));
    }
    case '$add': {
      const fs = args(arg).map(compile);
      return (doc, vars) => addValues(fs.map((f) => f(doc, vars)));
    }
    case '$subtract': {
      const list = args(arg);
      arity(op, list, 2);
      const [a, b] = list.map(compile);
      return (doc, vars) => subtract(a(doc, vars), b(doc, vars));
    }
    case '$multiply': {
      const fs = args(arg).map(compile);
      return (doc, vars) => multiply(fs.map((f) => f(doc, vars)));
    }
    case '$divide': {
      const list = args(arg);
      arity(op, list, 2);
      const [a, b] = list.map(compile);
      return (doc, vars) => {
        const x = a(doc, vars), y = b(doc, vars);
        if (nullish(x) || nullish(y)) return null;
        if (!V.isNumber(x) || !V.isNumber(y)) fail(16609, `$divide only supports numeric types, not ${V.typeName(x)} and ${V.typeName(y)}`);
        if (V.num(y) === 0) fail(16608, "can't $divide by zero");
        return new Double(V.num(x) / V.num(y));
      };
    }
    case '$mod': {
      const list = args(arg);
      arity(op, list, 2);
      const [a, b] = list.map(compile);
      return (doc, vars) => {
        const x = a(doc, vars), y = b(doc, vars);
        if (nullish(x) || nullish(y)) return null;
        if (!V.isNumber(x) || !V.isNumber(y)) fail(16611, `$mod only supports numeric types, not ${V.typeName(x)} and ${V.typeName(y)}`);
        if (V.num(y) === 0) fail(16610, "can't $mod by zero");
        if (V.isIntegral(x) && V.isIntegral(y)) {
          return V.intResult(V.toBig(x) % V.toBig(y), V.typeName(x) === 'long' || V.typeName(y) === 'long');
        }
        return new Double(V.num(x) % V.num(y));
      };
    }
    case '$abs': case '$floor': case '$ceil': case '$trunc': {
      const list = args(arg);
      const f = compile(list[0]);
      const m = { $abs: Math.abs, $floor: Math.floor, $ceil: Math.ceil, $trunc: Math.trunc }[op];
      return (doc, vars) => {
        const v = f(doc, vars);
        if (nullish(v)) return null;
        needNumber(op, v);
        const t = V.typeName(v);
        if (t === 'int') return new Int32(m(V.num(v)));
        if (t === 'long') return op === '$abs' ? Long.fromBigInt(V.toBig(v) < 0n ? -V.toBig(v) : V.toBig(v)) : v;
        return new Double(m(V.num(v)));
      };
    }
    case '$max': case '$min': {
      const single = !Array.isArray(arg);
      const fs = args(arg).map(compile);
      const sign = op === '$max' ? 1 : -1;
      return (doc, vars) => {
        let vals = fs.map((f) => f(doc, vars));
        if (single && fs.length === 1 && Array.isArray(vals[0])) vals = vals[0];
        let best;
        for (const v of vals) {
          if (nullish(v)) continue;
          if (best === undefined || sign * V.compare(v, best) > 0) best = v;
        }
        return best === undefined ? null : best;
      };
    }
    case '$sum': case '$avg': {
      const single = !Array.isArray(arg);
      const fs = args(arg).map(compile);
      return (doc, vars) => {
        let vals = fs.map((f) => f(doc, vars));
        if (single && Array.isArray(vals[0])) vals = vals[0];
        const nums = vals.filter((v) => V.isNumber(v));
        if (op === '$avg') return nums.length ? new Double(nums.reduce((s, v) => s + V.num(v), 0) / nums.length) : null;
        return nums.length ? addValues(nums, '$sum') : new Int32(0);
      };
    }
    case '$toLong': return unary(op, arg, toLong);
    case '$toInt': return unary(op, arg, toInt);
    case '$toDouble': return unary(op, arg, toDouble);
    case '$toString': return unary(op, arg, toStringValue);
    case '$toBool': return unary(op, arg, (v) => (nullish(v) ? null : V.truthy(v)));
    case '$toDate': return unary(op, arg, (v) => {
      if (nullish(v)) return null;
      const t = V.typeName(v);
      if (t === 'date') return v;
      if (V.isNumber(v)) return new Date(V.num(v));
      if (t === 'objectId') return v.getTimestamp();
      if (t === 'string') {
        const d = new Date(v);
        if (Number.isNaN(d.getTime())) fail(241, `Error parsing date string '${v}'`);
        return d;
      }
      return fail(241, `Unsupported conversion from ${t} to date in $convert with no onError value`);
    });
    case '$type': return unary(op, arg, (v) => V.typeName(v));
    case '$isNumber': return unary(op, arg, (v) => V.isNumber(v));
    case '$isArray': return unary(op, arg, (v) => Array.isArray(v));
    case '$size': return unary(op, arg, (v) => {
      if (!Array.isArray(v)) fail(17124, `The argument to $size must be an array. Type of argument: ${V.typeName(v)}`);
      return new Int32(v.length);
    });
    case '$concat': {
      const fs = args(arg).map(compile);
      return (doc, vars) => {
        let s = '';
        for (const f of fs) {
          const v = f(doc, vars);
          if (nullish(v)) return null;
          if (typeof v !== 'string') fail(16702, `$concat only supports strings, not ${V.typeName(v)}`);
          s += v;
        }
        return s;
      };
    }
    case '$toUpper': return unary(op, arg, (v) => (nullish(v) ? '' : String(toStringValue(v)).toUpperCase()));
    case '$toLower': return unary(op, arg, (v) => (nullish(v) ? '' : String(toStringValue(v)).toLowerCase()));
    case '$in': {
      const list = args(arg);
      arity(op, list, 2);
      const [a, b] = list.map(compile);
      return (doc, vars) => {
        const x = a(doc, vars), arr = b(doc, vars);
        if (!Array.isArray(arr)) fail(40081, `$in requires an array as a second argument, found: ${V.typeName(arr)}`);
        return arr.some((e) => V.equals(e, x === undefined ? null : x));
      };
    }
    case '$arrayElemAt': {
      const list = args(arg);
      arity(op, list, 2);
      const [a, b] = list.map(compile);
      return (doc, vars) => {
        const arr = a(doc, vars), i = b(doc, vars);
        if (nullish(arr) || nullish(i)) return null;
        if (!Array.isArray(arr)) fail(28689, `$arrayElemAt's first argument must be an array, but is ${V.typeName(arr)}`);
        let idx = V.num(i);
        if (idx < 0) idx += arr.length;
        return idx >= 0 && idx < arr.length ? arr[idx] : undefined;
      };
    }
    case '$filter': case '$map': {
      const isFilter = op === '$filter';
      if (!V.isPlainDoc(arg)) fail(isFilter ? 28646 : 16878, `${op} only supports an object as its argument`);
      const body = isFilter ? 'cond' : 'in';
      for (const k of Object.keys(arg)) {
        if (!['input', 'as', body].concat(isFilter ? ['limit'] : []).includes(k)) {
          fail(isFilter ? 28647 : 16879, `Unrecognized parameter to ${op}: ${k}`);
        }
      }
      if (!('input' in arg)) fail(isFilter ? 28648 : 16880, `Missing 'input' parameter to ${op}`);
      if (!(body in arg)) fail(isFilter ? 28650 : 16882, `Missing '${body}' parameter to ${op}`);
      const as = arg.as === undefined ? 'this' : arg.as;
      checkUserVar(as);
      const input = compile(arg.input), fn = compile(arg[body]);
      const limit = isFilter && arg.limit !== undefined ? compile(arg.limit) : null;
      return (doc, vars) => {
        const arr = input(doc, vars);
        if (nullish(arr)) return null;
        if (!Array.isArray(arr)) fail(isFilter ? 28651 : 16883, `input to ${op} must be an array not ${V.typeName(arr)}`);
        // mongod answers an empty input as it is, before it reads the limit
        if (arr.length === 0) return [];
        const out = [];
        let max = Infinity;
        if (limit) {
          const l = limit(doc, vars);
          if (!nullish(l)) {
            const n = V.isNumber(l) ? V.num(l) : NaN;
            if (!Number.isInteger(n) || n < -2147483648 || n > 2147483647) fail(327391, `$filter: limit must be represented as a 32-bit integral value: ${V.render(l)}`);
            if (n < 1) fail(327392, `$filter: limit must be greater than 0: ${V.render(l)}`);
            max = n;
          }
        }
        // the element is bound in vars itself for the loop and unbound after
        // it (see bind): no copy of the variables per evaluation
        const saved = bind(vars, as);
        try {
          for (let i = 0; i < arr.length; i++) {
            if (out.length >= max) break;
            const el = arr[i];
            vars[as] = el;
            const v = fn(doc, vars);
            if (isFilter) { if (V.truthy(v)) out.push(el); } else out.push(v === undefined ? null : v);
          }
        } finally {
          unbind(vars, as, saved);
        }
        return out;
      };
    }
    case '$concatArrays': {
      const fs = args(arg).map(compile);
      return (doc, vars) => {
        const out = [];
        for (const f of fs) {
          const v = f(doc, vars);
          if (nullish(v)) return null;
          if (!Array.isArray(v)) fail(28664, `$concatArrays only supports arrays, not ${V.typeName(v)}`);
          for (const el of v) out.push(el);
        }
        return out;
      };
    }
    case '$indexOfArray': {
      const list = args(arg);
      arity(op, list, 2, 4);
      const fs = list.map(compile);
      return (doc, vars) => {
        const arr = fs[0](doc, vars);
        if (nullish(arr)) return null;
        if (!Array.isArray(arr)) fail(40090, `$indexOfArray requires an array as a first argument, found: ${V.typeName(arr)}`);
        const x = fs[1](doc, vars);
        const bound = (f, dflt, which) => {
          if (!f) return dflt;
          const b = f(doc, vars);
          const n = V.isNumber(b) ? V.num(b) : NaN;
          if (!Number.isInteger(n) || n < -2147483648 || n > 2147483647) {
            fail(40096, `$indexOfArrayrequires an integral ${which} index, found a value of type: ${V.typeName(b)}, with value: ${V.render(b)}`);
          }
          if (n < 0) fail(40097, `$indexOfArray requires a nonnegative ${which} index, found: ${n}`);
          return n;
        };
        const from = bound(fs[2], 0, 'starting'), to = Math.min(bound(fs[3], arr.length, 'ending'), arr.length);
        // a missing value is not null: it equals nothing an array holds
        for (let i = from; i < to; i++) if (V.equals(arr[i], x)) return new Int32(i);
        return new Int32(-1);
      };
    }
    case '$mergeObjects': {
      const fs = args(arg).map(compile);
      return (doc, vars) => {
        const o = {};
        for (const f of fs) {
          const v = f(doc, vars);
          if (nullish(v)) continue;
          if (!V.isPlainDoc(v)) fail(40400, `$mergeObjects requires object inputs, but input ${V.render(v)} is of type ${V.typeName(v)}`);
          Object.assign(o, v);
        }
        return o;
      };
    }
    case '$let': {
      if (!V.isPlainDoc(arg)) fail(16874, '$let only supports an object as its argument');
      for (const k of Object.keys(arg)) if (k !== 'vars' && k !== 'in') fail(16875, `Unrecognized parameter to $let: ${k}`);
      if (!('vars' in arg)) fail(16876, "Missing 'vars' parameter to $let");
      if (!('in' in arg)) fail(16877, "Missing 'in' parameter to $let");
      if (!V.isPlainDoc(arg.vars)) fail(10065, 'invalid parameter: expected an object (vars)');
      for (const k of Object.keys(arg.vars)) checkUserVar(k);
      const defs = Object.keys(arg.vars).map((k) => [k, compile(arg.vars[k])]);
      const body = compile(arg.in);
      const n = defs.length;
      return (doc, vars) => {
        // every definition is evaluated in the outer scope first
        const vals = new Array(n);
        for (let i = 0; i < n; i++) vals[i] = defs[i][1](doc, vars);
        const saved = new Array(n);
        let bound = 0;
        try {
          for (; bound < n; bound++) {
            saved[bound] = bind(vars, defs[bound][0]);
            vars[defs[bound][0]] = vals[bound];
          }
          return body(doc, vars);
        } finally {
          while (bound-- > 0) unbind(vars, defs[bound][0], saved[bound]);
        }
      };
    }
    case '$getField': {
      const spec = V.isPlainDoc(arg) ? arg : { field: arg, input: '$$CURRENT' };
      const field = compile(spec.field);
      const input = compile('input' in spec ? spec.input : '$$CURRENT');
      return (doc, vars) => {
        const o = input(doc, vars);
        const k = field(doc, vars);
        if (nullish(o)) return null;
        return V.isPlainDoc(o) && Object.prototype.hasOwnProperty.call(o, k) ? o[k] : undefined;
      };
    }
    default: {
      const delegated = require('./mingo-bridge').compileExpression(op, arg);
      if (delegated) return delegated;
      return fail(168, `Unrecognized expression '${op}'`);
    }
  }
}

// Scoped variables ($filter/$map's 'as', $let's vars, a stage's ROOT and
// CURRENT) are set in the variables object itself while their scope is
// evaluated, and bind/unbind put back what the name held before (unbinding
// in the reverse order of binding, so that a name that was absent is the
// last property added and deleting it keeps the object's fast shape).
// Evaluation is synchronous and nothing keeps the object past it, so no
// other evaluation can see the scope's names.
const UNBOUND = Symbol('unbound');
const hasOwn = Object.prototype.hasOwnProperty;

function bind(vars, name) {
  return hasOwn.call(vars, name) ? vars[name] : UNBOUND;
}

function unbind(vars, name, saved) {
  if (saved === UNBOUND) delete vars[name];
  else vars[name] = saved;
}

function unary(op, arg, fn) {
  const list = args(arg);
  arity(op, list, 1);
  const f = compile(list[0]);
  return (doc, vars) => fn(f(doc, vars));
}

module.exports = { compile, addValues, multiply, subtract, cmpMissing, Param, PARAMS, bind, unbind };
