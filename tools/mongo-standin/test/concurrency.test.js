'use strict';
// Concurrent clients: 32 connections hammering one document with $inc lose
// no update; concurrent lock-style acquires elect exactly one owner.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { MongoClient, Long } = require('mongodb');
const { setup } = require('./helpers');

let env, db;
before(async () => { env = await setup(); db = env.db('conc'); });
after(async () => { await env.stop(); });

const CLIENTS = 32;
const PER_CLIENT = 50;

test(`${CLIENTS} connections x ${PER_CLIENT} $inc on one document: no lost update`, async () => {
  const clients = [];
  for (let i = 0; i < CLIENTS; i++) {
    clients.push(new MongoClient(env.uri, { maxPoolSize: 1, minPoolSize: 1, serverSelectionTimeoutMS: 5000 }));
  }
  try {
    await Promise.all(clients.map((c) => c.connect()));
    await db.collection('counter').insertOne({ _id: 'n', v: Long.fromNumber(0) });
    await Promise.all(clients.map(async (c) => {
      const coll = c.db(db.databaseName).collection('counter');
      for (let i = 0; i < PER_CLIENT; i++) await coll.updateOne({ _id: 'n' }, { $inc: { v: 1 } });
    }));
    const doc = await db.collection('counter').findOne({ _id: 'n' }, { promoteLongs: false });
    assert.equal(doc.v.toNumber(), CLIENTS * PER_CLIENT);
    assert.equal(doc.v._bsontype, 'Long');
  } finally {
    await Promise.all(clients.map((c) => c.close()));
  }
});

test('concurrent upserting acquires of one free lock: exactly one owner, no duplicate-key error', async () => {
  const clients = [];
  for (let i = 0; i < 16; i++) clients.push(new MongoClient(env.uri, { maxPoolSize: 1, serverSelectionTimeoutMS: 5000 }));
  try {
    await Promise.all(clients.map((c) => c.connect()));
    const FREE = { $or: [{ $eq: [{ $ifNull: ['$owner', null] }, null] }, { $lte: ['$expiresAt', '$$NOW'] }] };
    const results = await Promise.all(clients.map((c, i) => c.db(db.databaseName).command({
      findAndModify: 'locks', query: { _id: 'race' }, upsert: true, new: true,
      update: [{ $set: { owner: { $cond: [FREE, `owner${i}`, '$owner'] }, expiresAt: { $cond: [FREE, { $add: ['$$NOW', 60000] }, '$expiresAt'] } } }],
    })));
    const owners = new Set(results.map((r) => r.value.owner));
    assert.equal(owners.size, 1);
    const winner = [...owners][0];
    const wins = results.filter((r, i) => r.value.owner === `owner${i}`);
    assert.equal(wins.length, 1);
    assert.equal(wins[0].value.owner, winner);
  } finally {
    await Promise.all(clients.map((c) => c.close()));
  }
});
