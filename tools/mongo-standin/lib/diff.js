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
// The sizes of documents and arrays are kept by object: a diff asks for the
// size of a value at every level above it, and the two versions of a
// document share their unchanged parts with each other and with the
// versions before (stored documents are never mutated: store.js), so each
// part is measured once.
const sizes = new WeakMap();
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
    let n = sizes.get(v);
    if (n !== undefined) return n;
    n = 5;
    for (let i = 0; i < v.length; i++) n += elementSize(i < 10 ? 1 : String(i).length, v[i]);
    sizes.set(v, n);
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
  let n = sizes.get(v);
  if (n !== undefined) return n;
  n = 5;
  for (const k of Object.keys(v)) if (v[k] !== undefined) n += elementSize(utf8Length(k), v[k]);
  sizes.set(v, n);
  return n;
}
// an element: type byte, name and its NUL, value
const elementSize = (nameLen, v) => 2 + nameLen + valueSize(v);

// A delta node. A document's delta (mongod's {d, u, i, s<field>}) is
// {doc: true, d, u, i, s}: the removed field names, the updated and the
// inserted fields as flat [name, value, ...] lists, the sub-diffs as a
// flat [name, node, ...] list (null when empty). An array's delta (mongod's
// {a: true, u<index>, s<index>, l}) is {doc: false, e, l}: e a flat
// [kind ('u' or 's'), index as a string, value or node, ...] list, l the
// new size (an Int32) when it got shorter. Every node has its BSON size in
// mongod's form (size), and dl: whether it or a node under it removes a
// field or cuts an array. Names come out of u, i and d in the order mongod's
// objects would list them: fields whose names are array indexes ("0",
// "17") first, ascending, then the others in the order written.

function isIndexName(k) {
  const n = k.length;
  if (n === 0 || n > 10) return false;
  const c0 = k.charCodeAt(0);
  if (c0 < 0x30 || c0 > 0x39 || (c0 === 0x30 && n > 1)) return false;
  for (let x = 1; x < n; x++) {
    const c = k.charCodeAt(x);
    if (c < 0x30 || c > 0x39) return false;
  }
  return Number(k) < 4294967295;
}

// a flat [name, value, ...] list in the order of an object's keys written
// in list order
function inKeyOrder(list) {
  let any = false;
  for (let x = 0; x < list.length; x += 2) if (isIndexName(list[x])) { any = true; break; }
  if (!any) return list;
  const idx = [], rest = [];
  for (let x = 0; x < list.length; x += 2) (isIndexName(list[x]) ? idx : rest).push([list[x], list[x + 1]]);
  idx.sort((a, b) => Number(a[0]) - Number(b[0]));
  const out = [];
  for (const [k, v] of idx.concat(rest)) out.push(k, v);
  return out;
}

// A document's delta, or null when it would not be smaller than post
// (+ padding).
function docDiff(pre, post, padding) {
  let u = null, ins = null, subs = null;
  let deletes = null;
  let uSize = 0, iSize = 0, sSize = 0, nu = 0, ni = 0, dl = false;
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
        if (sub) {
          if (subs === null) subs = [];
          subs.push(k, sub);
          sSize += 2 + 1 + utf8Length(k) + sub.size;
          if (sub.dl) dl = true;
        } else {
          if (u === null) u = [];
          u.push(k, b);
          nu++;
          uSize += elementSize(utf8Length(k), b);
        }
        if (5 + sSize + (nu ? 8 + uSize : 0) >= limit) return null;
      }
      i++; j++;
    } else {
      // a field not at its old place: removed (and inserted again below
      // when post has it further on)
      if (deletes === null) deletes = new Set();
      deletes.add(k);
      i++;
    }
  }
  for (; i < preKeys.length; i++) {
    if (deletes === null) deletes = new Set();
    deletes.add(preKeys[i]);
  }
  for (; j < postKeys.length; j++) {
    const k = postKeys[j];
    if (ins === null) ins = [];
    ins.push(k, post[k]);
    ni++;
    iSize += elementSize(utf8Length(k), post[k]);
    if (deletes !== null) deletes.delete(k);
  }
  const out = { doc: true, d: null, u: null, i: null, s: subs, size: 0, dl };
  let size = 5 + sSize;
  if (deletes !== null && deletes.size) {
    const d = [];
    let dSize = 5;
    for (const k of deletes) { d.push(k, false); dSize += elementSize(utf8Length(k), false); }
    const ordered = inKeyOrder(d);
    out.d = [];
    for (let x = 0; x < ordered.length; x += 2) out.d.push(ordered[x]);
    size += 3 + dSize;
    out.dl = true;
  }
  if (nu) { out.u = inKeyOrder(u); size += 3 + 5 + uSize; }
  if (ni) { out.i = inKeyOrder(ins); size += 3 + 5 + iSize; }
  out.size = size;
  return size < limit ? out : null;
}

function arrayDiff(pre, post) {
  const e = [];
  let size = 5 + 4; // {a: true}
  const limit = valueSize(post); // as in docDiff: null once size reaches it
  let n = 0, dl = false;
  for (; n < pre.length && n < post.length; n++) {
    if (V.identical(pre[n], post[n])) continue;
    const sub = subDiff(pre[n], post[n]);
    const name = String(n);
    if (sub) { e.push('s', name, sub); size += 3 + name.length + sub.size; if (sub.dl) dl = true; } else { e.push('u', name, post[n]); size += elementSize(1 + name.length, post[n]); }
    if (size >= limit) return null;
  }
  for (; n < post.length; n++) {
    const name = String(n);
    e.push('u', name, post[n]);
    size += elementSize(1 + name.length, post[n]);
  }
  let l;
  if (pre.length > post.length) { l = new Int32(post.length); size += 7; dl = true; }
  return size < limit ? { doc: false, e, l, size, dl } : null;
}

// a sub-diff of two documents or two arrays, or null (update the whole value)
function subDiff(a, b) {
  if (isDoc(a) && isDoc(b)) return pairDiff(a, b, false);
  if (Array.isArray(a) && Array.isArray(b)) return pairDiff(a, b, true);
  return null;
}

// The last sub-diff computed from each document or array, with what it was
// compared with: both are never modified, so the diff of the same two
// values is the same. (When a lock's queue loses its head, each element is
// compared with the one after it; the next release compares most of the
// same pairs again.)
const pairs = new WeakMap();
function pairDiff(a, b, arrays) {
  const m = pairs.get(a);
  if (m !== undefined && m.b === b) return m.r;
  const r = arrays ? arrayDiff(a, b) : docDiff(a, b, 0);
  pairs.set(a, { b, r });
  return r;
}

// updateDescription of a delta, in the order of mongod's parser: updates,
// inserts, deletes, sub-diffs; in an array the resize, then the elements
// by index.
//
// The updated fields under a sub-diff ("queue.3.until", "holder.pid") are
// left out until the whole description is asked for (complete): no field
// path of a query or a projection reaches them, since a path does not step
// into a name with a dot, so a change stream whose $match and $project only
// follow paths sends the same event without them (a granting release's
// event would otherwise name every field of every queue entry that moved).
// They come last in updatedFields, so adding them later keeps mongod's
// order. removedFields and truncatedArrays are always whole.
const PENDING = new WeakMap(); // description -> the root's sub-diffs still to describe

function describe(delta) {
  const desc = { updatedFields: {}, removedFields: [], truncatedArrays: [] };
  const uf = desc.updatedFields;
  const u = delta.u, ins = delta.i, del = delta.d, subs = delta.s;
  if (u !== null) for (let x = 0; x < u.length; x += 2) uf[u[x]] = u[x + 1];
  if (ins !== null) for (let x = 0; x < ins.length; x += 2) uf[ins[x]] = ins[x + 1];
  if (del !== null) for (let x = 0; x < del.length; x++) desc.removedFields.push(del[x]);
  if (subs !== null) {
    for (let x = 0; x < subs.length; x += 2) if (subs[x + 1].dl) removals(subs[x + 1], subs[x], desc);
    PENDING.set(desc, subs);
  }
  return desc;
}

// The description with every updated field: the one given, completed
function complete(desc) {
  const subs = PENDING.get(desc);
  if (subs === undefined) return desc;
  PENDING.delete(desc);
  for (let x = 0; x < subs.length; x += 2) updates(subs[x + 1], subs[x], desc.updatedFields);
  return desc;
}

// the removed fields and cut arrays under a node at path
function removals(d, path, desc) {
  if (d.doc) {
    if (d.d !== null) for (let x = 0; x < d.d.length; x++) desc.removedFields.push(path + '.' + d.d[x]);
    const subs = d.s;
    if (subs !== null) for (let x = 0; x < subs.length; x += 2) if (subs[x + 1].dl) removals(subs[x + 1], path + '.' + subs[x], desc);
    return;
  }
  if (d.l !== undefined) desc.truncatedArrays.push({ field: path, newSize: d.l });
  const e = d.e;
  for (let x = 0; x < e.length; x += 3) if (e[x] === 's' && e[x + 2].dl) removals(e[x + 2], path + '.' + e[x + 1], desc);
}

// the updated fields under a node at path
function updates(d, path, uf) {
  const prefix = path + '.';
  if (d.doc) {
    const u = d.u, ins = d.i, subs = d.s;
    if (u !== null) for (let x = 0; x < u.length; x += 2) uf[prefix + u[x]] = u[x + 1];
    if (ins !== null) for (let x = 0; x < ins.length; x += 2) uf[prefix + ins[x]] = ins[x + 1];
    if (subs !== null) for (let x = 0; x < subs.length; x += 2) updates(subs[x + 1], prefix + subs[x], uf);
    return;
  }
  const e = d.e;
  for (let x = 0; x < e.length; x += 3) {
    if (e[x] === 'u') uf[prefix + e[x + 1]] = e[x + 2];
    else updates(e[x + 2], prefix + e[x + 1], uf);
  }
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
  const delta = docDiff(pre, post, DELTA_METADATA);
  return delta ? { op: 'update', desc: describe(delta) } : { op: 'replace' };
}

module.exports = { change, complete, docDiff, describe, valueSize };
