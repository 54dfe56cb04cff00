#!/usr/bin/env node
'use strict';
// mongo-standin: an in-memory server speaking MongoDB's wire protocol.
//
//   node server.js --port 0      listen on a free loopback port; prints exactly
//                                "listening 127.0.0.1:PORT" once it accepts
//                                connections
//
// Options: --port N, --bind ADDR (anything but loopback must be asked for),
// --replset NAME (default rs0), --standalone, --ttl-monitor-secs S (default 60),
// --auth and --user NAME:PASSWORD:ROLE@DB[,ROLE@DB...] (access control and
// SCRAM users, see lib/auth.js), --tls-cert FILE --tls-key FILE (TLS only).
// Without them it serves plain TCP with no access control.
// Exits with status 0 on SIGTERM and SIGINT.

const fs = require('fs');
const net = require('net');
const tls = require('tls');
const { Engine } = require('./lib/engine');
const { Connection } = require('./lib/wire');
const { parseUserFlag, ROLES } = require('./lib/auth');

const USAGE = `usage: node server.js [--port N] [--bind ADDR] [--replset NAME | --standalone] [--ttl-monitor-secs S]
       [--auth] [--user NAME:PASSWORD:ROLE@DB[,ROLE@DB...]]... [--users-file FILE] [--tls-cert FILE --tls-key FILE]
  --port N               TCP port (0 picks a free one; default 27017)
  --bind ADDR            address to listen on (default 127.0.0.1)
  --replset NAME         report a replica-set primary of set NAME (default rs0)
  --standalone           report a standalone mongod (no change streams, no sessions)
  --ttl-monitor-secs S   seconds between TTL monitor passes (default 60)
  --auth                 access control: commands need an authenticated user with a role that allows them
  --user N:P:ROLE@DB,..  a user N of database admin with password P and these roles (read, readWrite,
                         userAdmin on a database; readAnyDatabase, readWriteAnyDatabase,
                         userAdminAnyDatabase, root on admin); implies --auth; may be repeated
  --users-file FILE      the same users, one N:P:ROLE@DB,.. a line (no password on the command line)
  --tls-cert FILE        serve TLS only, with this PEM certificate (chain) ...
  --tls-key FILE         ... and this PEM private key`;

function parseArgs(argv) {
  const o = { port: 27017, bind: '127.0.0.1', bindGiven: false, replset: 'rs0', standalone: false, ttlMonitorSecs: 60,
    auth: false, users: [], tlsCert: null, tlsKey: null };
  const need = (i, name) => {
    if (i + 1 >= argv.length) usage(`${name} needs a value`);
    return argv[i + 1];
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    switch (a) {
      case '--port': {
        const v = need(i, a); i++;
        if (!/^\d+$/.test(v) || Number(v) > 65535) usage(`bad --port: ${v}`);
        o.port = Number(v);
        break;
      }
      case '--bind': o.bind = need(i, a); o.bindGiven = true; i++; break;
      case '--replset': {
        const v = need(i, a); i++;
        if (!v || /[\s/]/.test(v)) usage(`bad --replset: ${v}`);
        o.replset = v;
        break;
      }
      case '--standalone': o.standalone = true; break;
      case '--ttl-monitor-secs': {
        const v = need(i, a); i++;
        if (!/^\d+(\.\d+)?$/.test(v) || Number(v) <= 0) usage(`bad --ttl-monitor-secs: ${v}`);
        o.ttlMonitorSecs = Number(v);
        break;
      }
      case '--auth': o.auth = true; break;
      case '--user': {
        const v = need(i, a); i++;
        const u = parseUserFlag(v);
        if (!u) usage('bad --user: expected NAME:PASSWORD:ROLE@DB[,ROLE@DB...]');
        if (u[2].some((r) => !ROLES[r.role])) usage(`bad --user: unknown role in ${v.slice(v.lastIndexOf(':') + 1)}`);
        o.users.push(u);
        o.auth = true;
        break;
      }
      case '--users-file': {
        // the same, one per line, from a file: no password on a command line
        const f = need(i, a); i++;
        let text;
        try {
          text = fs.readFileSync(f, 'utf8');
        } catch (e) {
          usage(`--users-file: ${e.message}`);
        }
        for (const line of text.split('\n')) {
          if (!line.trim()) continue;
          const u = parseUserFlag(line.replace(/\r$/, ''));
          if (!u || u[2].some((r) => !ROLES[r.role])) usage(`bad line in ${f}: expected NAME:PASSWORD:ROLE@DB[,ROLE@DB...]`);
          o.users.push(u);
        }
        o.auth = true;
        break;
      }
      case '--tls-cert': o.tlsCert = need(i, a); i++; break;
      case '--tls-key': o.tlsKey = need(i, a); i++; break;
      case '-h': case '--help': process.stdout.write(USAGE + '\n'); process.exit(0); break;
      default: usage(`unknown option: ${a}`);
    }
  }
  if (!o.tlsCert !== !o.tlsKey) usage('--tls-cert and --tls-key go together');
  return o;
}

function usage(msg) {
  process.stderr.write(`mongo-standin: ${msg}\n${USAGE}\n`);
  process.exit(2);
}

function isLoopback(addr) {
  return addr === 'localhost' || addr === '::1' || /^127\.\d+\.\d+\.\d+$/.test(addr);
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  if (!isLoopback(opts.bind) && !opts.bindGiven) usage('refusing to listen on a non-loopback address');
  let engine;
  try {
    engine = new Engine(opts);
  } catch (e) {
    usage(`bad --user: ${e.message}`);
  }
  const sockets = new Set();
  const accept = (socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
    new Connection(socket, engine); // eslint-disable-line no-new
  };
  let server;
  if (opts.tlsCert) {
    let cert;
    let key;
    try {
      cert = fs.readFileSync(opts.tlsCert);
      key = fs.readFileSync(opts.tlsKey);
    } catch (e) {
      usage(e.message);
    }
    // a client whose handshake fails (it does not trust the certificate,
    // or speaks plain TCP) is dropped, as mongod drops it
    server = tls.createServer({ cert, key, minVersion: 'TLSv1.2' }, accept);
    server.on('tlsClientError', (e, socket) => socket.destroy());
  } else {
    server = net.createServer(accept);
  }
  server.on('error', (e) => {
    process.stderr.write(`mongo-standin: ${e.message}\n`);
    process.exit(1);
  });
  server.listen(opts.port, opts.bind, () => {
    const a = server.address();
    const host = a.family === 'IPv6' ? `[${a.address}]` : a.address;
    process.stdout.write(`listening ${host}:${a.port}\n`);
  });
  const stop = () => {
    engine.close();
    server.close();
    for (const s of sockets) s.destroy();
    process.exit(0);
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

if (require.main === module) main();

module.exports = { parseArgs };
