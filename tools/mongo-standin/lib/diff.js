'use strict';
// The updateDescription of a change event, as mongod 5.0+ reports it.
//
// mongod logs an update as a delta ($v: 2 oplog entry) and a change stream
// turns the delta into updateDescription:
// - an update pipeline (or $replaceWith) is diffed against the document
//   it replaced (mongod's src/mongo/db/update/document_diff_calculator.cpp,
//   computeOplogDiff): fields are compared in order; a field of the same name
//   holding a different value is an update, or, when both values are
//   documents or both arrays, a sub-diff; an array is compared index by
//   index, elements past the old length are updates, and an array that got
//   shorter is resized. A sub-diff that would be larger than the new value
//   is replaced by the whole value; when the whole delta would be larger than
//   the new document (plus the oplog entry's metadata), mongod logs the
//   update as the whole new document, and the change stream reports a
//   "replace" event.
// - an update with operators logs what each operator wrote: $set of a
//   field logs that field (whole), $set of a dotted path that path, a field
//   created on the way its first new ancestor, $unset the removed path, a
//   $push/$addToSet that appends the new elements as "field.<index>", other
//   array operators ($pull, $pop, $push with $position/$sort/$slice) the
//   whole array.
// The change stream reports updates and inserts of the delta in
// updatedFields under their dotted paths ("queue.2", "a.b"), deletions in
// removedFields, resizes in truncatedArrays as {field, newSize}
// (src/mongo/db/pipeline/change_stream_document_diff_parser.cpp).

const BSON = require('bson');
const V = require('./values');
const { Int32 } = V;

// bytes a delta's oplog entry adds besides the delta
// (update_oplog_entry::kSizeOfDeltaOplogEntryMetadata)
const DELTA_METADATA = 15;

const isDoc = (v) => V.isPlainDoc(v);

// BSON size of a value (as an element's value), as bson's serializer writes
// it (undefined is left out, as the server's stored documents never hold it).
// While change() runs, the sizes of documents and arrays are kept by object
// (sizes): the two versions share their unchanged parts, and a diff asks for
// the size of a value at every level above it.
let sizes = null;
// UTF-8 length of a string (names and values are mostly ASCII)
function utf8Length(s) {
  for (let i = 0; i < s.length; i++) if (s.charCodeAt(i) > 0x7f) return Buffer.byteLength(s);
  return s.length;
}
function valueSize(v) {
  switch (typeof v) {
    case 'string': return 5 + utf8Length(v);
    case 'boolean': return 1;
    case 'number': return Number.isInteger(v) && v >= -2147483648 && v <= 2147483647 ? 4 : 8;
    case 'undefined': return 0;
    default: break;
  }
  if (v === null) return 0;
  if (v instanceof Date) return 8;
  if (Array.isArray(v)) {
    let n = sizes && sizes.get(v);
    if (n !== undefined) return n;
    n = 5;
    for (let i = 0; i < v.length; i++) n += elementSize(i < 10 ? 1 : String(i).length, v[i]);
    if (sizes) sizes.set(v, n);
    return n;
  }
  switch (v._bsontype) {
    case undefined: break;
    case 'Int32': return 4;
    case 'Long': case 'Double': case 'Timestamp': return 8;
    case 'ObjectId': return 12;
    case 'Decimal128': return 16;
    default: return BSON.calculateObjectSize({ x: v }) - 8; // 4 + 1 (type) + 2 ("x\0") + 1
  }
  if (!isDoc(v)) return BSON.calculateObjectSize({ x: v }) - 8;
  let n = sizes && sizes.get(v);
  if (n !== undefined) return n;
  n = 5;
  for (const k of Object.keys(v)) if (v[k] !== undefined) n += elementSize(utf8Length(k), v[k]);
  if (sizes) sizes.set(v, n);
  return n;
}
// an element: type byte, name and its NUL, value
const elementSize = (nameLen, v) => 2 + nameLen + valueSize(v);
const nameLen = (k) => utf8Length(k);

// A document's delta as mongod serializes it ({d, u, i, s<field>}), with
// its BSON size, or null when it would not be smaller than post (+ padding).
function docDiff(pre, post, padding) {
  const u = {}, ins = {}, subs = {};
  const deletes = new Set();
  let uSize = 0, iSize = 0, sSize = 0, nu = 0, ni = 0;
  const preKeys = Object.keys(pre), postKeys = Object.keys(post);
  // the delta's size only grows: once what is counted so far is not
  // smaller than post, the answer is null
  const limit = valueSize(post) - padding;
  let i = 0, j = 0;
  while (i < preKeys.length && j < postKeys.length) {
    const k = preKeys[i];
    if (k === postKeys[j]) {
      const a = pre[k], b = post[k];
      if (!V.identical(a, b)) {
        const sub = subDiff(a, b);
        if (sub) { subs['s' + k] = sub.node; sSize += 2 + 1 + nameLen(k) + sub.size; } else { u[k] = b; nu++; uSize += elementSize(nameLen(k), b); }
        if (5 + sSize + (nu ? 8 + uSize : 0) >= limit) return null;
      }
      i++; j++;
    } else {
      // a field not at its old place: removed (and inserted again below
      // when post has it further on)
      deletes.add(k);
      i++;
    }
  }
  for (; i < preKeys.length; i++) deletes.add(preKeys[i]);
  for (; j < postKeys.length; j++) {
    const k = postKeys[j];
    ins[k] = post[k]; ni++; iSize += elementSize(nameLen(k), post[k]);
    deletes.delete(k);
  }
  const out = {};
  let size = 5 + sSize;
  if (deletes.size) {
    out.d = {};
    let dSize = 5;
    for (const k of deletes) { out.d[k] = false; dSize += elementSize(nameLen(k), false); }
    size += 3 + dSize;
  }
  if (nu) { out.u = u; size += 3 + 5 + uSize; }
  if (ni) { out.i = ins; size += 3 + 5 + iSize; }
  Object.assign(out, subs);
  return size < limit ? { node: out, size } : null;
}

function arrayDiff(pre, post) {
  const out = { a: true };
  let size = 5 + 4; // {a: true}
  const limit = valueSize(post); // as in docDiff: null once size reaches it
  let n = 0;
  for (; n < pre.length && n < post.length; n++) {
    if (V.identical(pre[n], post[n])) continue;
    const sub = subDiff(pre[n], post[n]);
    const name = String(n);
    if (sub) { out['s' + name] = sub.node; size += 3 + name.length + sub.size; } else { out['u' + name] = post[n]; size += elementSize(1 + name.length, post[n]); }
    if (size >= limit) return null;
  }
  for (; n < post.length; n++) { out['u' + n] = post[n]; size += elementSize(1 + String(n).length, post[n]); }
  if (pre.length > post.length) { out.l = new Int32(post.length); size += 7; }
  return size < limit ? { node: out, size } : null;
}

// a sub-diff of two documents or two arrays, or null (update the whole value)
function subDiff(a, b) {
  if (isDoc(a) && isDoc(b)) return docDiff(a, b, 0);
  if (Array.isArray(a) && Array.isArray(b)) return arrayDiff(a, b);
  return null;
}

// updateDescription of a delta
function describe(delta) {
  const desc = { updatedFields: {}, removedFields: [], truncatedArrays: [] };
  // in the order of mongod's parser: updates, inserts, deletes, sub-diffs;
  // in an array the resize, then the elements by index
  const walkDoc = (d, prefix) => {
    for (const sec of ['u', 'i']) if (d[sec]) for (const f of Object.keys(d[sec])) desc.updatedFields[prefix + f] = d[sec][f];
    if (d.d) for (const f of Object.keys(d.d)) desc.removedFields.push(prefix + f);
    for (const k of Object.keys(d)) if (k[0] === 's') walk(d[k], prefix + k.slice(1));
  };
  const walkArray = (d, path) => {
    if (d.l !== undefined) desc.truncatedArrays.push({ field: path, newSize: d.l });
    for (const k of Object.keys(d)) {
      if (k[0] === 'u') desc.updatedFields[path + '.' + k.slice(1)] = d[k];
      else if (k[0] === 's') walk(d[k], path + '.' + k.slice(1));
    }
  };
  const walk = (d, path) => (d.a === true ? walkArray(d, path) : walkDoc(d, path + '.'));
  walkDoc(delta, '');
  return desc;
}

function getPath(doc, parts) {
  let cur = doc;
  for (const p of parts) {
    if (Array.isArray(cur)) { if (!/^\d+$/.test(p)) return undefined; cur = cur[Number(p)]; }
    else if (isDoc(cur) && Object.prototype.hasOwnProperty.call(cur, p)) cur = cur[p];
    else return undefined;
  }
  return cur;
}

// updateDescription of an update with operators: steps are its
// [op, path, parts, arg] in the order applied
function describeOperators(pre, post, steps) {
  const desc = { updatedFields: {}, removedFields: [], truncatedArrays: [] };
  const set = (parts) => {
    // a path created on the way is logged at its first new ancestor
    for (let n = 1; n <= parts.length; n++) {
      if (getPath(pre, parts.slice(0, n)) === undefined) {
        desc.updatedFields[parts.slice(0, n).join('.')] = getPath(post, parts.slice(0, n));
        return;
      }
    }
    desc.updatedFields[parts.join('.')] = getPath(post, parts);
  };
  for (const [op, path, parts, arg] of steps) {
    const before = getPath(pre, parts), after = getPath(post, parts);
    if (op === '$rename') {
      if (before !== undefined) { desc.removedFields.push(path); set(arg.split('.')); }
      continue;
    }
    if (V.identical(before, after)) continue;
    if (after === undefined) { if (before !== undefined) desc.removedFields.push(path); continue; }
    // mongod's push_node.cpp / addtoset_node.cpp: kArrayAppendUpdate
    if ((op === '$addToSet' || (op === '$push' && Array.isArray(before) && before.length > 0)) &&
        Array.isArray(before) && Array.isArray(after) &&
        after.length > before.length && before.every((x, n) => V.identical(x, after[n]))) {
      for (let n = before.length; n < after.length; n++) desc.updatedFields[`${path}.${n}`] = after[n];
      continue;
    }
    set(parts);
  }
  return desc;
}

// The change of an update of pre into post: {op: 'update', desc} or, when
// mongod would log the whole document, {op: 'replace'}. how is the compiled
// update ({kind, steps}); without it, the pipeline rules apply.
function change(pre, post, how) {
  if (how && how.kind === 'operators' && how.steps) return { op: 'update', desc: describeOperators(pre, post, how.steps) };
  sizes = new Map();
  try {
    const delta = docDiff(pre, post, DELTA_METADATA);
    return delta ? { op: 'update', desc: describe(delta.node) } : { op: 'replace' };
  } finally {
    sizes = null;
  }
}

module.exports = { change, docDiff, describe, valueSize };
