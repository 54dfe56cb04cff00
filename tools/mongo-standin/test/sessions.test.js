'use strict';
// Cursors and logical sessions, as mongod's getMore checks them
// (validateLSID in src/mongo/db/commands/getmore_cmd.cpp): a cursor created
// in a session is continued in that session only (50737 without an lsid,
// 50738 in another one), a cursor created without a session is continued
// without one (50736 in a session). killCursors checks no session.
//
// The commands go out as raw OP_MSG messages, so that each one carries
// exactly the lsid the test gives it, or none (a driver adds its own).

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const net = require('net');
const { BSON, UUID, Long } = require('mongodb');
const { setup } = require('./helpers');

let env, db, dbName, hostPort;
before(async () => {
  env = await setup();
  db = env.db('sessions');
  dbName = db.databaseName;
  await db.collection('c').insertMany([1, 2, 3, 4, 5].map((i) => ({ _id: i })));
  const m = /^mongodb:\/\/([^/?,@]+)/.exec(env.uri);
  hostPort = m[1].split(':');
});
after(async () => { await env.stop(); });

// Sends one command as OP_MSG on a new connection; resolves its reply.
function raw(cmd) {
  return new Promise((resolve, reject) => {
    const body = BSON.serialize({ ...cmd, $db: dbName });
    const head = Buffer.alloc(21);
    head.writeInt32LE(21 + body.length, 0);
    head.writeInt32LE(1, 4);        // requestID
    head.writeInt32LE(2013, 12);    // OP_MSG
    head.writeUInt8(0, 20);         // flagBits (4 zero bytes), then section kind 0
    const s = net.connect(Number(hostPort[1] || 27017), hostPort[0], () => s.write(Buffer.concat([head, body])));
    let got = Buffer.alloc(0);
    s.on('data', (d) => {
      got = Buffer.concat([got, d]);
      if (got.length >= 4 && got.length >= got.readInt32LE(0)) {
        s.destroy();
        resolve(BSON.deserialize(got.subarray(21, got.readInt32LE(0)), { promoteLongs: false }));
      }
    });
    s.on('error', reject);
  });
}

const session = () => ({ id: new UUID() });

// a cursor on c with documents left, created in session lsid (or none)
async function cursor(lsid) {
  const r = await raw({ find: 'c', batchSize: 1, ...(lsid ? { lsid } : {}) });
  assert.equal(r.ok, 1, JSON.stringify(r));
  assert.ok(!r.cursor.id.isZero());
  return r.cursor.id;
}

const getMore = (id, lsid) => raw({ getMore: id, collection: 'c', batchSize: 1, ...(lsid ? { lsid } : {}) });

const SESSION = '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12} - \\S{44} -  - ';

function refused(r, code, text) {
  assert.equal(r.ok, 0, JSON.stringify(r));
  assert.equal(r.code, code);
  assert.equal(r.codeName, `Location${code}`);
  assert.match(r.errmsg, new RegExp(`^Cannot run getMore on cursor \\d+, ${text}$`));
}

test('a cursor created in a session is continued in that session', async () => {
  const a = session();
  const id = await cursor(a);
  const r = await getMore(id, a);
  assert.equal(r.ok, 1, JSON.stringify(r));
  assert.equal(r.cursor.nextBatch[0]._id, 2);
});

test('getMore without an lsid on a cursor created in a session fails 50737', async () => {
  const a = session();
  const id = await cursor(a);
  const r = await getMore(id, null);
  refused(r, 50737, `which was created in session ${SESSION}, without an lsid`);
  assert.ok(r.errmsg.includes(a.id.toHexString(true)));
  assert.equal((await getMore(id, a)).ok, 1, 'the refused getMore leaves the cursor alive');
});

test('getMore in another session fails 50738', async () => {
  const a = session(), b = session();
  const id = await cursor(a);
  const r = await getMore(id, b);
  refused(r, 50738, `which was created in session ${SESSION}, in session ${SESSION}`);
  const at = r.errmsg.indexOf(a.id.toHexString(true)), bt = r.errmsg.indexOf(b.id.toHexString(true));
  assert.ok(at > 0 && bt > at, r.errmsg);
});

test('a cursor created without a session is continued without one, not in a session (50736)', async () => {
  const id = await cursor(null);
  refused(await getMore(id, session()), 50736, `which was not created in a session, in session ${SESSION}`);
  const r = await getMore(id, null);
  assert.equal(r.ok, 1, JSON.stringify(r));
  assert.equal(r.cursor.nextBatch[0]._id, 2);
});

test('an aggregate cursor (a change stream) is bound to its session too', async () => {
  const a = session();
  const r = await raw({ aggregate: 'c', pipeline: [{ $changeStream: {} }], cursor: {}, lsid: a });
  assert.equal(r.ok, 1, JSON.stringify(r));
  const id = r.cursor.id;
  refused(await getMore(id, null), 50737, `which was created in session ${SESSION}, without an lsid`);
  const g = await raw({ getMore: id, collection: 'c', maxTimeMS: 10, lsid: a });
  assert.equal(g.ok, 1, JSON.stringify(g));
  await raw({ killCursors: 'c', cursors: [id], lsid: a });
});

test('killCursors checks no session', async () => {
  const id1 = await cursor(session());
  const r1 = await raw({ killCursors: 'c', cursors: [id1], lsid: session() });
  assert.equal(r1.ok, 1, JSON.stringify(r1));
  assert.deepEqual(r1.cursorsKilled.map(String), [String(id1)]);
  const id2 = await cursor(session());
  const r2 = await raw({ killCursors: 'c', cursors: [id2] });
  assert.deepEqual(r2.cursorsKilled.map(String), [String(id2)]);
  assert.equal((await getMore(id2, null)).code, 43);
  assert.ok(Long.isLong(id2));
});
