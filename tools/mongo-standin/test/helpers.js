'use strict';
// Shared set-up for the conformance suite. Each test file calls setup(): it
// starts its own stand-in on port 0, unless MONGODB_URI is set, in which case
// the file runs against that server (a real replica set must pass too).

const { spawn, execFileSync } = require('child_process');
const fs = require('fs');
const os = require('os');
const path = require('path');
const crypto = require('crypto');
const readline = require('readline');
const { MongoClient } = require('mongodb');

const SERVER = path.join(__dirname, '..', 'server.js');
const external = !!process.env.MONGODB_URI;

// Starts a stand-in with extra args; resolves {port, uri, proc, line, stop}.
function startStandin(args = []) {
  return new Promise((resolve, reject) => {
    const proc = spawn(process.execPath, [SERVER, '--port', '0', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    let err = '';
    proc.stderr.on('data', (d) => { err += d; });
    const rl = readline.createInterface({ input: proc.stdout });
    const timer = setTimeout(() => reject(new Error(`stand-in did not start: ${err}`)), 10000);
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`stand-in exited with ${code}: ${err}`)); });
    rl.once('line', (line) => {
      clearTimeout(timer);
      const m = /^listening 127\.0\.0\.1:(\d+)$/.exec(line);
      if (!m) { proc.kill(); reject(new Error(`unexpected first line: ${line}`)); return; }
      const port = Number(m[1]);
      const standalone = args.includes('--standalone');
      resolve({
        port, line, proc,
        uri: `mongodb://127.0.0.1:${port}/${standalone ? '' : '?replicaSet=rs0'}`,
        stop: () => new Promise((res) => {
          if (proc.exitCode !== null) { res(proc.exitCode); return; }
          proc.removeAllListeners('exit');
          proc.once('exit', (code) => res(code));
          proc.kill('SIGTERM');
        }),
      });
    });
  });
}

// One server per test file: {uri, client, db(name), stop}.
async function setup(args = []) {
  let server = null;
  let uri = process.env.MONGODB_URI;
  if (!external) {
    server = await startStandin(args);
    uri = server.uri;
  }
  const client = new MongoClient(uri, { serverSelectionTimeoutMS: 5000 });
  await client.connect();
  const prefix = `standin_${crypto.randomBytes(3).toString('hex')}`;
  const dbs = [];
  return {
    uri, client, server, external,
    db(name) {
      const full = `${prefix}_${name}`;
      dbs.push(full);
      return client.db(full);
    },
    async stop() {
      for (const d of dbs) await client.db(d).dropDatabase().catch(() => {});
      await client.close();
      if (server) await server.stop();
    },
  };
}

// Compiles a C program of this directory against libmongoc, once per
// content, into the temp dir; returns the executable's path.
function compileC(name) {
  const src = path.join(__dirname, name);
  const hash = crypto.createHash('sha1').update(fs.readFileSync(src)).digest('hex').slice(0, 12);
  const exe = path.join(os.tmpdir(), `mongo-standin-${path.basename(name, '.c')}-${hash}`);
  if (!fs.existsSync(exe)) {
    const flags = execFileSync('pkg-config', ['--cflags', '--libs', 'libmongoc-1.0']).toString().trim().split(/\s+/);
    const tmp = `${exe}.${process.pid}`;
    execFileSync('cc', ['-O2', '-Wall', '-Wextra', '-Werror', '-o', tmp, src, ...flags]);
    fs.renameSync(tmp, exe);
  }
  return exe;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

module.exports = { setup, startStandin, compileC, external, sleep };
