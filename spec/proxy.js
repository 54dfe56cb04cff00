#!/usr/bin/env node
'use strict';
// A TCP proxy for the specs: a path to the server that can be frozen.
//
//   node spec/proxy.js HOST:PORT      prints "listening 127.0.0.1:PORT" once ready
//
// Every connection made to the printed address is piped to HOST:PORT, byte
// for byte.  SIGSTOP freezes the whole path at once, as a network that
// drops its packets or a server that stopped answering would look to a
// client: connections already open stay open and carry nothing, new ones
// are accepted by the kernel (the listening backlog) and carry nothing;
// SIGCONT lets everything through again.  Ends on SIGTERM or SIGKILL (the
// specs' helpers.proxy; helpers.lua says how to reach the server through it).

const net = require('net');

const target = process.argv[2] || '';
const m = /^\[?([^\]]*?)\]?:(\d+)$/.exec(target);
if (!m) {
  process.stderr.write('usage: node spec/proxy.js HOST:PORT\n');
  process.exit(2);
}
const [host, port] = [m[1], Number(m[2])];

const server = net.createServer((down) => {
  const up = net.connect({ host, port });
  down.setNoDelay(true);
  up.setNoDelay(true);
  down.pipe(up);
  up.pipe(down);
  const end = () => { down.destroy(); up.destroy(); };
  down.on('error', end);
  up.on('error', end);
  down.on('close', end);
  up.on('close', end);
});
server.listen(0, '127.0.0.1', () => {
  const a = server.address();
  process.stdout.write(`listening ${a.address}:${a.port}\n`);
});
process.on('SIGTERM', () => process.exit(0));
