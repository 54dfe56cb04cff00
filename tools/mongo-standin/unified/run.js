#!/usr/bin/env node
'use strict';
// Runs unified-format test files (a directory, or files) against the
// stand-in, or against MONGODB_URI when it is set, and prints each test's
// result and the counts by file:
//   node unified/run.js DIR|FILE... [--filter TEXT] [--verbose] [--no-skips]
// (--no-skips runs the tests unified/skips.js skips for the stand-in)
// DIR defaults to $SPEC_TESTS (e.g. source/transactions/tests/unified of a
// mongodb/specifications checkout). Without one it says so and exits 0.
// Exit status 1 when a test failed.

const fs = require('fs');
const path = require('path');
const { runFile } = require('./runner');
const SKIPS = require('./skips');
const { startStandin } = require('../test/helpers');

async function main() {
  const argv = process.argv.slice(2);
  let filter = null;
  let verbose = false;
  let noSkips = false;
  const targets = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === '--filter') filter = argv[++i];
    else if (argv[i] === '--verbose') verbose = true;
    else if (argv[i] === '--no-skips') noSkips = true;
    else targets.push(argv[i]);
  }
  if (targets.length === 0 && process.env.SPEC_TESTS) targets.push(process.env.SPEC_TESTS);
  if (targets.length === 0) {
    console.log('skipped: no unified test directory given (SPEC_TESTS=.../source/transactions/tests/unified '
      + 'of a mongodb/specifications checkout, or an argument)');
    return 0;
  }
  const files = [];
  for (const t of targets) {
    if (!fs.existsSync(t)) { console.error(`no such file or directory: ${t}`); return 2; }
    if (fs.statSync(t).isDirectory()) {
      for (const f of fs.readdirSync(t).sort()) if (f.endsWith('.json')) files.push(path.join(t, f));
    } else files.push(t);
  }
  let server = null;
  let uri = process.env.MONGODB_URI;
  if (!uri) { server = await startStandin(); uri = server.uri; }
  const total = { pass: 0, fail: 0, skip: 0 };
  const rows = [];
  try {
    for (const f of files) {
      const results = await runFile(f, { uri, filter: filter ? (d) => d.includes(filter) : null,
        skips: noSkips ? {} : SKIPS[path.basename(f)] });
      const c = { pass: 0, fail: 0, skip: 0 };
      for (const r of results) {
        c[r.status]++;
        total[r.status]++;
        if (r.status !== 'pass' || verbose) {
          console.log(`${r.status.toUpperCase()} ${r.file}: ${r.description}${r.reason ? ` -- ${r.reason}` : ''}`);
        }
      }
      rows.push([path.basename(f), c]);
    }
  } finally {
    if (server) await server.stop();
  }
  console.log('\nfile                                         pass fail skip');
  for (const [f, c] of rows) {
    const n = (x) => String(x).padStart(4);
    console.log(`${f.padEnd(44)} ${n(c.pass)} ${n(c.fail)} ${n(c.skip)}`);
  }
  console.log(`${'total'.padEnd(44)} ${String(total.pass).padStart(4)} ${String(total.fail).padStart(4)} `
    + `${String(total.skip).padStart(4)}`);
  return total.fail > 0 ? 1 : 0;
}

main().then((code) => { process.exitCode = code; }, (e) => { console.error(e); process.exitCode = 2; });
