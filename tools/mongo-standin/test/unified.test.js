'use strict';
// The unified-format runner (unified/runner.js, the format of MongoDB's
// driver specifications) on a test file of our own, test/unified/*.json:
// every test must pass (a skip is a failure here), so that the runner that
// runs MongoDB's transactions tests (`make standin-spec-tests`) keeps working.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const fs = require('fs');
const path = require('path');
const { runFile } = require('../unified/runner');
const { setup } = require('./helpers');

const DIR = path.join(__dirname, 'unified');
let env;
before(async () => { env = await setup(); });
after(async () => {
  await env.client.db('standin_unified_txn').dropDatabase().catch(() => {});
  await env.stop();
});

for (const name of fs.readdirSync(DIR).filter((f) => f.endsWith('.json')).sort()) {
  test(`unified runner: ${name}`, async () => {
    const results = await runFile(path.join(DIR, name), { uri: env.uri });
    assert.ok(results.length > 0);
    for (const r of results) assert.equal(r.status, 'pass', `${r.description}: ${r.status} ${r.reason || ''}`);
  });
}

test('unified runner: a mismatch fails the test, an unknown operation skips it', async () => {
  const file = path.join(require('os').tmpdir(), `standin-unified-${process.pid}.json`);
  const count = (n) => ({ object: 'k', name: 'countDocuments', arguments: { filter: {} }, expectResult: n });
  fs.writeFileSync(file, JSON.stringify({
    description: 'runner self-check', schemaVersion: '1.0',
    createEntities: [{ client: { id: 'c' } },
      { database: { id: 'd', client: 'c', databaseName: 'standin_unified_txn' } },
      { collection: { id: 'k', database: 'd', collectionName: 'self' } }],
    initialData: [{ collectionName: 'self', databaseName: 'standin_unified_txn', documents: [{ _id: 1 }] }],
    tests: [
      { description: 'wrong count', operations: [count(2)] },
      { description: 'missing field in the outcome',
        operations: [{ object: 'k', name: 'find', arguments: { filter: {} }, expectResult: [{ _id: 1 }] }],
        outcome: [{ collectionName: 'self', databaseName: 'standin_unified_txn', documents: [{ _id: 1, x: 1 }] }] },
      { description: 'unknown', operations: [{ object: 'k', name: 'listSearchIndexes' }] },
      { description: 'right', operations: [count(1)] },
    ],
  }));
  try {
    const r = await runFile(file, { uri: env.uri });
    assert.deepEqual(r.map((x) => x.status), ['fail', 'fail', 'skip', 'pass']);
    assert.match(r[2].reason, /operation listSearchIndexes not supported by the runner/);
  } finally { fs.unlinkSync(file); }
});
