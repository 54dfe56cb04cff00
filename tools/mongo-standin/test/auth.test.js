'use strict';
// Access control, SCRAM-SHA-256 / SCRAM-SHA-1 and TLS, with the Node.js
// driver and libmongoc as clients. Each test starts its own stand-in with
// --user / --tls-cert (a real MongoDB would need the same users and
// certificates made by hand: these tests run only against the stand-in).

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { execFile, execFileSync, spawnSync } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');
const { MongoClient, Binary } = require('mongodb');
const { startStandin, compileC, external } = require('./helpers');

const SERVER = path.join(__dirname, '..', 'server.js');
const skip = external;
let certs;
let tlsServer;
let plainServer;

const USERS = ['--user', 'boss:b0ss pw:root@admin', '--user', 'rw:rw-pw:readWrite@app', '--user', 'ro:ro-pw:read@app'];

function uri(s, user, pwd, extra = '') {
  const cred = user ? `${encodeURIComponent(user)}:${encodeURIComponent(pwd)}@` : '';
  return `mongodb://${cred}127.0.0.1:${s.port}/?replicaSet=rs0${extra}`;
}
const tlsOpts = () => `&tls=true&tlsCAFile=${encodeURIComponent(path.join(certs, 'ca.pem'))}`;

async function withClient(u, fn) {
  const c = new MongoClient(u, { serverSelectionTimeoutMS: 3000 });
  try {
    return await fn(c);
  } finally {
    await c.close();
  }
}

before(async () => {
  if (skip) return;
  certs = fs.mkdtempSync(path.join(os.tmpdir(), 'standin-certs-'));
  execFileSync(path.join(__dirname, '..', 'make-test-certs'), [certs]);
  tlsServer = await startStandin([...USERS, '--tls-cert', path.join(certs, 'server.pem'), '--tls-key', path.join(certs, 'server-key.pem')]);
  plainServer = await startStandin(USERS);
});
after(async () => {
  if (skip) return;
  await tlsServer.stop();
  await plainServer.stop();
  fs.rmSync(certs, { recursive: true, force: true });
});

test('SCRAM-SHA-256 and SCRAM-SHA-1 authenticate a user, over TLS and over plain TCP', { skip }, async () => {
  for (const [s, extra] of [[tlsServer, tlsOpts()], [plainServer, '']]) {
    for (const mech of ['SCRAM-SHA-256', 'SCRAM-SHA-1', null]) {
      const u = uri(s, 'rw', 'rw-pw', `${extra}${mech ? `&authMechanism=${mech}` : ''}`);
      await withClient(u, async (c) => {
        const st = await c.db('admin').command({ connectionStatus: 1 });
        assert.deepEqual(st.authInfo.authenticatedUsers, [{ user: 'rw', db: 'admin' }]);
        await c.db('app').collection('t').insertOne({ mech });
        assert.ok(await c.db('app').collection('t').findOne({ mech }));
      });
    }
  }
});

test('a wrong password or an unknown user fails with 18 AuthenticationFailed, the same message for both', { skip }, async () => {
  for (const [user, pwd] of [['rw', 'wrong'], ['nobody', 'rw-pw']]) {
    for (const mech of ['SCRAM-SHA-256', 'SCRAM-SHA-1']) {
      await withClient(uri(plainServer, user, pwd, `&authMechanism=${mech}`), async (c) => {
        await assert.rejects(c.db('app').collection('t').findOne({}), (e) => {
          assert.equal(e.code, 18, e.message);
          assert.match(e.message, /^Authentication failed\.$/);
          return true;
        });
      });
    }
  }
});

test('before authentication: hello and ping run, anything else is 13 "requires authentication"', { skip }, async () => {
  await withClient(uri(plainServer), async (c) => {
    assert.equal((await c.db('admin').command({ ping: 1 })).ok, 1);
    const h = await c.db('admin').command({ hello: 1, saslSupportedMechs: 'admin.rw' });
    assert.deepEqual(h.saslSupportedMechs.sort(), ['SCRAM-SHA-1', 'SCRAM-SHA-256']);
    const none = await c.db('admin').command({ hello: 1, saslSupportedMechs: 'admin.nobody' });
    assert.equal(none.saslSupportedMechs, undefined);
    for (const cmd of [{ find: 't' }, { insert: 't', documents: [{}] }, { serverStatus: 1 }, { listDatabases: 1 }]) {
      await assert.rejects(c.db('app').command(cmd), (e) => e.code === 13 && e.codeName === 'Unauthorized'
        && e.message === `command ${Object.keys(cmd)[0]} requires authentication`);
    }
    // an unknown command is still 59
    await assert.rejects(c.db('app').command({ frobnicate: 1 }), (e) => e.code === 59);
  });
});

test('roles: read may find, change streams and list, not write; readWrite writes its own database only', { skip }, async () => {
  await withClient(uri(plainServer, 'rw', 'rw-pw'), (c) => c.db('app').collection('r').insertOne({ _id: 1 }));
  await withClient(uri(plainServer, 'ro', 'ro-pw'), async (c) => {
    const coll = c.db('app').collection('r');
    assert.deepEqual(await coll.findOne({ _id: 1 }), { _id: 1 });
    await coll.aggregate([{ $changeStream: {} }]).tryNext();
    for (const op of [() => coll.insertOne({ _id: 2 }), () => coll.updateOne({ _id: 1 }, { $set: { a: 1 } }),
      () => coll.deleteOne({ _id: 1 }), () => coll.findOneAndUpdate({ _id: 1 }, { $set: { a: 1 } }),
      () => coll.createIndex({ a: 1 })]) {
      await assert.rejects(op(), (e) => e.code === 13 && /^not authorized on app to execute command \{ /.test(e.message));
    }
    await assert.rejects(c.db('other').collection('r').findOne({}), (e) => e.code === 13);
  });
  await withClient(uri(plainServer, 'rw', 'rw-pw'), async (c) => {
    assert.deepEqual(await c.db('app').collection('r').findOne({ _id: 1 }), { _id: 1 });
    await assert.rejects(c.db('other').collection('r').insertOne({}), (e) => e.code === 13);
    await assert.rejects(c.db('admin').command({ serverStatus: 1 }), (e) => e.code === 13);
    await assert.rejects(c.db('admin').command({ configureFailPoint: 'failCommand', mode: 'off' }), (e) => e.code === 13);
  });
  await withClient(uri(plainServer, 'boss', 'b0ss pw'), async (c) => {
    assert.equal((await c.db('admin').command({ serverStatus: 1 })).ok, 1);
    await c.db('other').collection('r').insertOne({});
  });
});

test('createUser: the first user through the localhost exception, later ones by a user administrator', { skip }, async () => {
  const s = await startStandin(['--auth']);
  try {
    await withClient(uri(s), async (c) => {
      await assert.rejects(c.db('app').collection('t').findOne({}), (e) => e.code === 13);
      await c.db('admin').command({ createUser: 'adm', pwd: 'adm-pw', roles: ['root'] });
      // the exception ends with the first user
      await assert.rejects(c.db('admin').command({ createUser: 'x', pwd: 'x', roles: [] }), (e) => e.code === 13);
    });
    await withClient(uri(s, 'adm', 'adm-pw'), async (c) => {
      await c.db('app').command({ createUser: 'w', pwd: 'pä ss', roles: [{ role: 'readWrite', db: 'app' }], mechanisms: ['SCRAM-SHA-256'] });
      await assert.rejects(c.db('app').command({ createUser: 'w', pwd: 'x', roles: [] }), (e) => e.code === 51003);
      await assert.rejects(c.db('app').command({ createUser: 'v', pwd: 'x', roles: ['nosuchrole'] }), (e) => e.code === 31);
      await assert.rejects(c.db('app').command({ createUser: 'v', pwd: 'x' }), (e) => e.code === 40414);
    });
    // a user of database app authenticates there (authSource), with a non-ASCII password SASLprep'ed
    await withClient(`mongodb://w:${encodeURIComponent('pä ss')}@127.0.0.1:${s.port}/app?replicaSet=rs0`, async (c) => {
      await c.db('app').collection('t').insertOne({ a: 1 });
    });
    // it has no SCRAM-SHA-1 credentials: 334 MechanismUnavailable
    await withClient(`mongodb://w:${encodeURIComponent('pä ss')}@127.0.0.1:${s.port}/app?replicaSet=rs0&authMechanism=SCRAM-SHA-1`, async (c) => {
      await assert.rejects(c.db('app').collection('t').findOne({}), (e) => e.code === 334);
    });
  } finally {
    await s.stop();
  }
});

test('hello answers a speculative saslStart; a wrong conversation is refused', { skip }, async () => {
  await withClient(uri(plainServer, 'rw', 'rw-pw'), async (c) => {
    const payload = new Binary(Buffer.from('n,,n=rw,r=abcdefghijklmnopqrstuvwx'), 0);
    const h = await c.db('admin').command({ hello: 1, speculativeAuthenticate: { saslStart: 1, mechanism: 'SCRAM-SHA-256', payload, db: 'admin' } });
    assert.equal(h.speculativeAuthenticate.done, false);
    assert.match(Buffer.from(h.speculativeAuthenticate.payload.buffer).toString(), /^r=abcdefghijklmnopqrstuvwx[^,]+,s=[^,]+,i=15000$/);
    const bad = await c.db('admin').command({ hello: 1, speculativeAuthenticate: { saslStart: 1, mechanism: 'SCRAM-SHA-256', payload: new Binary(Buffer.from('n,,n=nobody,r=abc'), 0), db: 'admin' } });
    assert.equal(bad.speculativeAuthenticate, undefined);
    await assert.rejects(c.db('admin').command({ saslContinue: 1, conversationId: 7, payload: new Binary(Buffer.alloc(0), 0) }), (e) => e.code === 17);
  });
});

test('TLS: a client that does not trust the certificate, or speaks plain TCP, never gets a reply', { skip }, async () => {
  const other = `&tls=true&tlsCAFile=${encodeURIComponent(path.join(certs, 'other-ca.pem'))}`;
  for (const u of [uri(tlsServer, 'rw', 'rw-pw', other), uri(tlsServer, 'rw', 'rw-pw')]) {
    const c = new MongoClient(u, { serverSelectionTimeoutMS: 1500 });
    await assert.rejects(c.connect(), (e) => e.name === 'MongoServerSelectionError');
    await c.close();
  }
});

test('libmongoc 1.23 authenticates over TLS with SCRAM-SHA-256 and SCRAM-SHA-1 (single client and pool), and is refused with a wrong password', { skip }, async () => {
  const exe = compileC('mongoc_probe.c');
  const run = (u, mode) => new Promise((resolve) => {
    execFile(exe, [u, mode], { timeout: 20000 }, (err, stdout, stderr) => resolve({ err, stdout, stderr }));
  });
  for (const mech of ['SCRAM-SHA-256', 'SCRAM-SHA-1']) {
    for (const mode of ['single', 'pool']) {
      const r = await run(uri(tlsServer, 'boss', 'b0ss pw', `${tlsOpts()}&authMechanism=${mech}`), mode);
      assert.equal(r.err, null, `${mech} ${mode}: ${r.stdout}${r.stderr}`);
      assert.match(r.stdout, /^acquire ok .*"owner" : "me"/m);
      assert.match(r.stdout, /^failures 0$/m);
    }
  }
  const r = await run(uri(tlsServer, 'boss', 'wrong', tlsOpts()), 'pool');
  assert.match(r.stdout, /^ping error 11 Authentication failed\.$/m);
});

test('--users-file reads the same users, one a line', { skip }, async () => {
  const f = path.join(certs, 'users');
  fs.writeFileSync(f, 'a:pw:with:colons:readWrite@app,read@other\n\nb:x:read@app\n');
  const s = await startStandin(['--users-file', f]);
  try {
    await withClient(uri(s, 'a', 'pw:with:colons'), (c) => c.db('app').collection('t').insertOne({}));
    await withClient(uri(s, 'b', 'x'), async (c) => {
      await assert.rejects(c.db('app').collection('t').insertOne({}), (e) => e.code === 13);
    });
  } finally {
    await s.stop();
  }
  fs.writeFileSync(f, 'nonsense\n');
  const r = spawnSync(process.execPath, [SERVER, '--port', '0', '--users-file', f], { encoding: 'utf8' });
  assert.equal(r.status, 2);
});

test('--user and --tls-* refuse bad values', { skip }, () => {
  for (const args of [['--user', 'x'], ['--user', 'x::read@app'], ['--user', 'x:p:nosuchrole@app'], ['--user', 'x:p:root@app'],
    ['--tls-cert', '/nonexistent'], ['--tls-cert', '/nonexistent', '--tls-key', '/nonexistent']]) {
    const r = spawnSync(process.execPath, [SERVER, '--port', '0', ...args], { encoding: 'utf8' });
    assert.equal(r.status, 2, `${args.join(' ')}: ${r.stdout}${r.stderr}`);
    assert.equal(r.stdout, '');
  }
});
