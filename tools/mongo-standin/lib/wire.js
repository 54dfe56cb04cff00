'use strict';
// MongoDB wire protocol framing: OP_QUERY (the legacy handshake) answered
// with OP_REPLY, and OP_MSG with kind-0 and kind-1 sections and moreToCome.
// One Connection per socket; messages on a connection are handled strictly
// in order, one at a time, like mongod's per-connection thread.

const BSON = require('bson');
const { decode } = require('./bsoncache');

const OP_REPLY = 1;
const OP_QUERY = 2004;
const OP_COMPRESSED = 2012;
const OP_MSG = 2013;
const MAX_MESSAGE = 48000000;

const DECODE = { promoteValues: false, promoteLongs: false, promoteBuffers: false, bsonRegExp: true };
const ENCODE = { ignoreUndefined: true, checkKeys: false };

const CLUSTER_TIME = Symbol.for('mongo-standin.clusterTime');
const SENT = Symbol.for('mongo-standin.sent');

// The elements {$clusterTime: {clusterTime: T, signature: {hash: BinData(0,
// 20 zero bytes), keyId: Long(0)}}, operationTime: T} pre-encoded once, with
// the offsets where T goes.
const TAIL = (() => {
  const mark1 = BSON.Timestamp.fromBits(0x11111111, 0x22222222);
  const mark2 = BSON.Timestamp.fromBits(0x33333333, 0x44444444);
  const doc = BSON.serialize({
    $clusterTime: { clusterTime: mark1, signature: { hash: new BSON.Binary(Buffer.alloc(20), 0), keyId: BSON.Long.fromNumber(0) } },
    operationTime: mark2,
  });
  const bytes = Buffer.from(doc.subarray(4, doc.length - 1));
  const at1 = bytes.indexOf(Buffer.from([0x11, 0x11, 0x11, 0x11, 0x22, 0x22, 0x22, 0x22]));
  const at2 = bytes.indexOf(Buffer.from([0x33, 0x33, 0x33, 0x33, 0x44, 0x44, 0x44, 0x44]));
  return { bytes, at1, at2 };
})();

let nextConnId = 1;
let scratch = Buffer.alloc(1 << 20);
let nextRequestId = 1;

function readCString(buf, off) {
  const end = buf.indexOf(0, off);
  if (end < 0) throw new Error('unterminated cstring');
  return [buf.toString('utf8', off, end), end + 1];
}

function docLen(buf, off) { return buf.readInt32LE(off); }

class Connection {
  constructor(socket, engine) {
    this.socket = socket;
    this.engine = engine;
    this.id = nextConnId++;
    this.address = `${socket.localAddress.replace(/^::ffff:/, '')}:${socket.localPort}`;
    this.peer = `${(socket.remoteAddress || '').replace(/^::ffff:/, '')}:${socket.remotePort}`;
    this.appName = undefined;
    this.handshaken = false;
    this.chunks = [];
    this.buffered = 0;
    this.busy = false;
    this.closed = false;
    socket.setNoDelay(true);
    socket.on('data', (d) => this.onData(d));
    socket.on('error', () => this.close());
    socket.on('close', () => this.close());
    engine.connections.current += 1;
    engine.connections.totalCreated += 1;
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    this.engine.connections.current -= 1;
    this.socket.destroy();
  }

  onData(d) {
    this.chunks.push(d);
    this.buffered += d.length;
    if (!this.busy) this.pump();
  }

  // Takes one complete message off the buffer, or null.
  nextMessage() {
    if (this.buffered < 4) return null;
    let buf = this.chunks.length === 1 ? this.chunks[0] : Buffer.concat(this.chunks);
    this.chunks = [buf];
    const len = buf.readInt32LE(0);
    if (len < 16 || len > MAX_MESSAGE) { this.close(); return null; }
    if (buf.length < len) return null;
    const msg = buf.subarray(0, len);
    buf = buf.subarray(len);
    this.chunks = buf.length ? [buf] : [];
    this.buffered = buf.length;
    return msg;
  }

  pump() {
    this.busy = true;
    for (;;) {
      if (this.closed) return;
      const msg = this.nextMessage();
      if (!msg) { this.busy = false; return; }
      let r;
      try {
        r = this.handle(msg);
      } catch (e) {
        // A message that cannot be parsed ends the connection, as in mongod.
        this.close();
        return;
      }
      if (r && typeof r.then === 'function') {
        r.then(() => this.pump(), () => this.close());
        return;
      }
    }
  }

  handle(msg) {
    const requestId = msg.readInt32LE(4);
    const opCode = msg.readInt32LE(12);
    if (opCode === OP_MSG) return this.handleMsg(msg, requestId);
    if (opCode === OP_QUERY) return this.handleQuery(msg, requestId);
    if (opCode === OP_COMPRESSED) throw new Error('compression was not negotiated');
    throw new Error(`unsupported opcode ${opCode}`);
  }

  handleMsg(msg, requestId) {
    const flags = msg.readUInt32LE(16);
    const moreToCome = (flags & 2) !== 0;
    const end = (flags & 1) ? msg.length - 4 : msg.length;
    let off = 20;
    let cmd = null;
    const seqs = [];
    while (off < end) {
      const kind = msg[off];
      off += 1;
      if (kind === 0) {
        const n = docLen(msg, off);
        cmd = decode(msg.subarray(off, off + n));
        off += n;
      } else if (kind === 1) {
        const size = msg.readInt32LE(off);
        const stop = off + size;
        let [ident, p] = readCString(msg, off + 4);
        const docs = [];
        while (p < stop) {
          const n = docLen(msg, p);
          docs.push(ident === 'documents' ? BSON.deserialize(msg.subarray(p, p + n), DECODE) : decode(msg.subarray(p, p + n)));
          p += n;
        }
        seqs.push([ident, docs]);
        off = stop;
      } else throw new Error(`unknown section kind ${kind}`);
    }
    if (!cmd) throw new Error('OP_MSG without a body');
    for (const [ident, docs] of seqs) {
      if (cmd[ident] !== undefined) {
        return this.respond(requestId, moreToCome, {
          ok: 0, errmsg: `Duplicate field '${ident}' in a document sequence and the command body`, code: 40413, codeName: 'Location40413',
        }, OP_MSG);
      }
      cmd[ident] = docs;
    }
    this.legacy = false;
    this.waiting = { requestId, moreToCome };
    const r = this.engine.run(cmd, this);
    // the change events this command wrote go out before its own reply
    if (r && typeof r.then === 'function') {
      return r.then((b) => {
        this.engine.flushWakes();
        if (b === SENT) return;
        this.waiting = null;
        this.respond(requestId, moreToCome, b, OP_MSG);
      });
    }
    this.waiting = null;
    this.engine.flushWakes();
    return this.respond(requestId, moreToCome, r, OP_MSG);
  }

  // Sends body as the reply to the message this connection waits on (a
  // getMore whose wait a write ended), from within that write's command.
  // False when no message waits.
  sendNow(body) {
    const w = this.waiting;
    if (!w) return false;
    this.waiting = null;
    this.respond(w.requestId, w.moreToCome, body, OP_MSG);
    return true;
  }

  handleQuery(msg, requestId) {
    let off = 20;
    const [ns, p] = readCString(msg, off);
    off = p + 8; // numberToSkip, numberToReturn
    const n = docLen(msg, off);
    let q = BSON.deserialize(msg.subarray(off, off + n), DECODE);
    if (!ns.endsWith('.$cmd')) {
      return this.respond(requestId, false, { $err: 'OP_QUERY is only supported for commands', code: 5739101, ok: 0 }, OP_REPLY);
    }
    if (q.$query !== undefined) q = q.$query;
    const name = Object.keys(q)[0];
    if (!['hello', 'isMaster', 'ismaster'].includes(name)) {
      return this.respond(requestId, false, {
        ok: 0, errmsg: `Unsupported OP_QUERY command: ${name}. The client driver may require an upgrade.`, code: 352, codeName: 'UnsupportedOpQueryCommand',
      }, OP_REPLY);
    }
    q.$db = ns.slice(0, -5);
    this.legacy = true;
    const r = this.engine.run(q, this);
    if (r && typeof r.then === 'function') return r.then((b) => this.respond(requestId, false, b, OP_REPLY));
    return this.respond(requestId, false, r, OP_REPLY);
  }

  respond(requestId, moreToCome, body, opCode) {
    if (this.closed) return;
    if (body && body.closeConnection) { this.close(); return; }
    if (moreToCome) return;
    // The body is encoded into a scratch buffer after room for the header,
    // then header, body and the cluster-time tail go out in one new buffer.
    const headLen = opCode === OP_MSG ? 21 : 36;
    let end = -1;
    let src = scratch;
    try {
      end = BSON.serializeWithBufferAndIndex(body, scratch, Object.assign({ index: headLen }, ENCODE)) + 1;
    } catch (e) {
      if (!(e instanceof RangeError)) throw e;
    }
    if (end < 0 || end > scratch.length) {
      // larger than the scratch buffer: encode on its own
      const doc = BSON.serialize(body, ENCODE);
      src = Buffer.allocUnsafe(headLen + doc.length);
      doc.copy(src, headLen);
      end = src.length;
    }
    const ct = body[CLUSTER_TIME];
    const total = ct ? end + TAIL.bytes.length : end; // (end - 1) + tail + final 0
    const out = Buffer.allocUnsafe(total);
    src.copy(out, 0, 0, ct ? end - 1 : end);
    if (ct) {
      const base = end - 1;
      TAIL.bytes.copy(out, base);
      for (const at of [TAIL.at1, TAIL.at2]) {
        out.writeUInt32LE(ct.low >>> 0, base + at);
        out.writeUInt32LE(ct.high >>> 0, base + at + 4);
      }
      out[total - 1] = 0;
    }
    out.writeInt32LE(total - headLen, headLen); // the body document's length
    out.writeInt32LE(total, 0);
    out.writeInt32LE(nextRequestId++, 4);
    out.writeInt32LE(requestId, 8);
    if (opCode === OP_MSG) {
      out.writeInt32LE(OP_MSG, 12);
      out.writeUInt32LE(0, 16);
      out[20] = 0;
    } else {
      out.writeInt32LE(OP_REPLY, 12);
      out.writeInt32LE(8, 16); // responseFlags: AwaitCapable
      out.writeBigInt64LE(0n, 20); // cursorID
      out.writeInt32LE(0, 28); // startingFrom
      out.writeInt32LE(1, 32); // numberReturned
    }
    this.socket.write(out);
  }

}

module.exports = { Connection };
