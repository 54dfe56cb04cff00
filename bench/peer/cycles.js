'use strict';
// Uncontended acquire + release cycles through a peer lock library on the
// official Node.js driver, used the way each README shows:
//
//   mongo-locks   3.2.0 on mongodb 6: lockManager.lock(key) / lock.free()
//                 (insertOne into a unique index / deleteOne)
//   mongodb-lock  1.0.1 on mongodb 3 (its README: "Driver v3"):
//                 lock.acquire(cb) / lock.release(code, cb)
//                 (findOneAndUpdate of expired + insertOne / findOneAndUpdate)
//
//   node cycles.js LIB [SECONDS [WARMUP]]          (MONGODB_URI set)
//
// Prints one JSON line with the fields of bench/raw.c:
//   {"impl":LIB,"cycles":N,"seconds":S,"cpu":S,"ops":N,"failed":N}
// (failed: measured cycles that did not acquire and release; warmup_failed
// those of the warm-up).
// cpu is process.cpuUsage() (getrusage: user + sys, every thread); ops is
// the serverStatus opcounters delta less the closing serverStatus.

const lib = process.argv[2];
const seconds = Number(process.argv[3] || 5);
const warmup = Number(process.argv[4] || 200);
const uri = process.env.MONGODB_URI;
if (!uri || !['mongo-locks', 'mongodb-lock'].includes(lib) || !(seconds > 0)) {
  process.stderr.write('usage: MONGODB_URI=... node cycles.js mongo-locks|mongodb-lock [SECONDS [WARMUP]]\n');
  process.exit(2);
}

const DB = 'mongolock_bench';

async function opcounters(db) {
  const s = await db.admin().command({ serverStatus: 1 });
  let t = 0;
  for (const k of ['insert', 'query', 'update', 'delete', 'getmore', 'command']) t += Number(s.opcounters[k] || 0);
  return t;
}

// returns { cycle: async () => boolean, ops: async () => number, close }
async function mongoLocks() {
  const { MongoClient } = require('mongodb');
  const { LockManager } = require('mongo-locks');
  const client = new MongoClient(uri, { appName: 'bench-mongo-locks' });
  await client.connect();
  const lockManager = new LockManager(client.db(DB).collection('mongo-locks'));
  const key = `bench-mongo-locks-${process.pid}`;
  return {
    async cycle() {
      const lock = await lockManager.lock(key);
      if (!lock) return false;
      return lock.free();
    },
    ops: () => opcounters(client.db(DB)),
    close: () => client.close(true),
  };
}

async function mongodbLock() {
  const { MongoClient } = require('mongodb3');
  const mongoDbLock = require('mongodb-lock');
  const client = await MongoClient.connect(uri, { useNewUrlParser: true, useUnifiedTopology: true,
    appname: 'bench-mongodb-lock' });
  const db = client.db(DB);
  const lock = mongoDbLock(db.collection('mongodb-lock'), `bench-mongodb-lock-${process.pid}`);
  await new Promise((resolve, reject) => lock.ensureIndexes((err) => (err ? reject(err) : resolve())));
  return {
    cycle() {
      return new Promise((resolve, reject) => {
        lock.acquire((err, code) => {
          if (err) return reject(err);
          if (!code) return resolve(false);
          lock.release(code, (err2, ok) => (err2 ? reject(err2) : resolve(ok)));
        });
      });
    },
    ops: () => opcounters(db),
    close: () => client.close(true),
  };
}

async function main() {
  const b = lib === 'mongo-locks' ? await mongoLocks() : await mongodbLock();
  let failed = 0;
  const one = async () => {
    try {
      if (!(await b.cycle())) failed += 1;
    } catch (e) {
      failed += 1;
      process.stderr.write(`cycles: ${e && e.message}\n`);
    }
  };
  for (let i = 0; i < warmup; i++) await one();
  const warmupFailed = failed;
  failed = 0;                 // from here on: failures among the measured cycles
  const o0 = await b.ops();
  const c0 = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  let n = 0;
  let t1;
  for (;;) {
    for (let i = 0; i < 64; i++) await one();
    n += 64;
    t1 = process.hrtime.bigint();
    if (Number(t1 - t0) / 1e9 >= seconds) break;
  }
  const c = process.cpuUsage(c0);
  const o1 = await b.ops();
  process.stdout.write(JSON.stringify({
    impl: lib, cycles: n, seconds: Number(t1 - t0) / 1e9, cpu: (c.user + c.system) / 1e6,
    ops: o1 - o0 - 1, failed, warmup_failed: warmupFailed,
  }) + '\n');
  await b.close();
  // mongo-locks leaves one 10 s refresh timer per lock it handed out
  process.exit(failed || warmupFailed ? 1 : 0);
}

main().catch((e) => {
  process.stderr.write(`cycles: ${e && e.stack || e}\n`);
  process.exit(1);
});
