'use strict';
// Users, SCRAM authentication and access control, as mongod answers them
// (MongoDB's auth specification, RFC 5802 and RFC 7677).
//
// Users live in the server, keyed by "db.name" (the database is the user's
// authentication database). Each keeps, per mechanism, what mongod keeps:
// salt, iteration count, StoredKey and ServerKey, never the password. For
// SCRAM-SHA-1 the password is first digested as MD5("name:mongo:password")
// in hex (mongod's "digestPassword"); for SCRAM-SHA-256 it is SASLprep'ed.
//
// A connection authenticates as at most one user, with saslStart /
// saslContinue (or hello's speculativeAuthenticate, which is a saslStart
// carried by the handshake). With access control on (--auth):
// - before authentication only the handshake, SASL and a few harmless
//   commands run; any other command fails with 13 Unauthorized,
//   "command X requires authentication";
// - after it, a command runs only if one of the user's roles grants its
//   action on the command's database, else 13 Unauthorized,
//   "not authorized on DB to execute command { ... }";
// - while no user exists, a connection may create the first user in admin
//   (mongod's localhost exception; the stand-in only ever listens on
//   loopback unless --bind says otherwise).
// Roles: read and readWrite on a database, readAnyDatabase and
// readWriteAnyDatabase, userAdmin and userAdminAnyDatabase, and root
// (everything, the server's own commands and fail points included).

const crypto = require('crypto');
const saslprep = require('@mongodb-js/saslprep');
const { Int32, Binary } = require('bson');
const V = require('./values');
const { fail } = require('./errors');

const MECHS = ['SCRAM-SHA-1', 'SCRAM-SHA-256'];
const HASH = { 'SCRAM-SHA-1': 'sha1', 'SCRAM-SHA-256': 'sha256' };
// mongod's defaults: scramIterationCount and scramSHA256IterationCount
const ITERATIONS = { 'SCRAM-SHA-1': 10000, 'SCRAM-SHA-256': 15000 };

// commands that need no authentication (mongod's requiresAuth() == false)
const OPEN = new Set(['hello', 'isMaster', 'ismaster', 'saslStart', 'saslContinue', 'ping', 'buildInfo',
  'buildinfo', 'logout', 'whatsmyuri']);
// commands any authenticated user may run
const ANY_USER = new Set(['endSessions', 'refreshSessions', 'startSession', 'killSessions', 'connectionStatus']);
const READ = new Set(['find', 'getMore', 'killCursors', 'count', 'distinct', 'aggregate', 'listIndexes',
  'listCollections', 'collStats', 'dbStats']);
const WRITE = new Set(['insert', 'update', 'delete', 'findAndModify', 'findandmodify', 'createIndexes',
  'dropIndexes', 'deleteIndexes', 'create', 'drop']);
const USER_ADMIN = new Set(['createUser', 'dropUser']);

// role -> the action classes it grants and whether on every database
const ROLES = {
  read: { grants: ['read'], any: false },
  readWrite: { grants: ['read', 'write'], any: false },
  userAdmin: { grants: ['userAdmin'], any: false },
  readAnyDatabase: { grants: ['read'], any: true, adminOnly: true },
  readWriteAnyDatabase: { grants: ['read', 'write'], any: true, adminOnly: true },
  userAdminAnyDatabase: { grants: ['userAdmin'], any: true, adminOnly: true },
  root: { grants: ['read', 'write', 'userAdmin', 'cluster'], any: true, adminOnly: true },
};

function bytesOf(v) {
  if (v instanceof Binary) return Buffer.from(v.buffer.buffer, v.buffer.byteOffset, v.position);
  if (typeof v === 'string') return Buffer.from(v, 'utf8');
  return null;
}

function hmac(alg, key, text) { return crypto.createHmac(alg, key).update(text).digest(); }
function digest(alg, data) { return crypto.createHash(alg).update(data).digest(); }
function xor(a, b) {
  const out = Buffer.alloc(a.length);
  for (let i = 0; i < a.length; i++) out[i] = a[i] ^ b[i];
  return out;
}

// the password as the mechanism hashes it
function preparePassword(mech, user, pwd) {
  if (mech === 'SCRAM-SHA-1') return crypto.createHash('md5').update(`${user}:mongo:${pwd}`).digest('hex');
  return saslprep(pwd);
}

// {salt, iterations, storedKey, serverKey} for one mechanism
function credentials(mech, user, pwd) {
  const alg = HASH[mech];
  const salt = crypto.randomBytes(mech === 'SCRAM-SHA-1' ? 16 : 28);
  const iterations = ITERATIONS[mech];
  const keyLen = alg === 'sha1' ? 20 : 32;
  const salted = crypto.pbkdf2Sync(preparePassword(mech, user, pwd), salt, iterations, keyLen, alg);
  return {
    salt, iterations,
    storedKey: digest(alg, hmac(alg, salted, 'Client Key')),
    serverKey: hmac(alg, salted, 'Server Key'),
  };
}

// a role given as "name" (on db) or {role, db}; raises 31 RoleNotFound
function parseRole(r, db) {
  let role;
  let rdb = db;
  if (typeof r === 'string') role = r;
  else if (V.isPlainDoc(r) && typeof r.role === 'string' && typeof r.db === 'string') { role = r.role; rdb = r.db; }
  else fail(2, 'Role names must be either strings or objects');
  const def = ROLES[role];
  if (!def || (def.adminOnly && rdb !== 'admin')) fail(31, `Could not find role: ${role}@${rdb}`);
  return { role, db: rdb };
}

class Users {
  constructor() { this.users = new Map(); }

  get size() { return this.users.size; }

  get(db, name) { return this.users.get(`${db}.${name}`); }

  // raises 51003 when the user exists, 31 for an unknown role
  create(db, name, pwd, roles, mechanisms) {
    if (typeof name !== 'string' || name === '') fail(2, 'User name must be a non-empty string');
    if (typeof pwd !== 'string' || pwd === '') fail(2, 'Must provide a \'pwd\' field for all user documents, except those with \'$external\' as the user\'s source db');
    if (this.get(db, name)) fail(51003, `User "${name}@${db}" already exists`);
    const mechs = mechanisms === undefined ? MECHS : mechanisms;
    if (!Array.isArray(mechs) || !mechs.length || mechs.some((m) => !MECHS.includes(m))) {
      fail(2, 'mechanisms field must be a non-empty subset of SCRAM-SHA-1 and SCRAM-SHA-256');
    }
    const parsed = roles.map((r) => parseRole(r, db));
    const creds = {};
    for (const m of mechs) creds[m] = credentials(m, name, pwd);
    this.users.set(`${db}.${name}`, { name, db, roles: parsed, creds });
  }

  drop(db, name) {
    if (!this.users.delete(`${db}.${name}`)) fail(11, `User '${name}@${db}' not found`);
  }
}

// "NAME:PASSWORD:ROLE@DB[,ROLE@DB...]" (a user of admin) -> [name, pwd, roles]
function parseUserFlag(s) {
  const first = s.indexOf(':');
  const last = s.lastIndexOf(':');
  if (first <= 0 || last === first) return null;
  const name = s.slice(0, first);
  const pwd = s.slice(first + 1, last);
  const roles = [];
  for (const r of s.slice(last + 1).split(',')) {
    const m = /^([A-Za-z]+)@([^@\s/.]+)$/.exec(r);
    if (!m) return null;
    roles.push({ role: m[1], db: m[2] });
  }
  if (!pwd) return null;
  return [name, pwd, roles];
}

// ---- SCRAM conversations ---------------------------------------------------

function authFailed() { fail(18, 'Authentication failed.'); }

function unescapeName(s) {
  if (/=(?!2C|3D)/.test(s)) authFailed();
  return s.replace(/=2C/g, ',').replace(/=3D/g, '=');
}

// runs a saslStart (from the command or from hello's speculativeAuthenticate)
// and returns its reply body; the conversation is kept on the connection
function saslStart(engine, conn, cmd, db) {
  const mech = cmd.mechanism;
  if (!MECHS.includes(mech)) {
    fail(334, `Received authentication for mechanism ${mech} which is not enabled`);
  }
  const payload = bytesOf(cmd.payload);
  if (!payload) fail(14, 'BSON field \'saslStart.payload\' is the wrong type, expected types \'binData, string\'');
  const text = payload.toString('utf8');
  // gs2 header: no channel binding, no authorization identity
  const m = /^[ny],,(n=([^,]*),r=([^,]+)(?:,.*)?)$/.exec(text);
  if (!m) authFailed();
  const bare = m[1];
  const name = unescapeName(m[2]);
  const clientNonce = m[3];
  const user = engine.users.get(db, name);
  if (!user) authFailed();
  const cred = user.creds[mech];
  if (!cred) {
    fail(334, `Unable to use ${mech} based authentication for user without any ${mech} credentials registered`);
  }
  const nonce = clientNonce + crypto.randomBytes(24).toString('base64');
  const serverFirst = `r=${nonce},s=${cred.salt.toString('base64')},i=${cred.iterations}`;
  const skipEmpty = V.isPlainDoc(cmd.options) && cmd.options.skipEmptyExchange === true;
  conn.sasl = { id: 1, mech, user, bare, nonce, serverFirst, skipEmpty, step: 1 };
  return { conversationId: new Int32(1), done: false, payload: new Binary(Buffer.from(serverFirst), 0), ok: 1 };
}

function saslContinue(conn, cmd) {
  const s = conn.sasl;
  if (!s || !V.isNumber(cmd.conversationId) || V.num(cmd.conversationId) !== s.id) {
    conn.sasl = null;
    fail(17, 'No SASL session state found');
  }
  const payload = bytesOf(cmd.payload);
  if (!payload) { conn.sasl = null; authFailed(); }
  if (s.step === 2) {
    // the empty exchange a client sends when it did not ask to skip it
    conn.sasl = null;
    if (payload.length) authFailed();
    conn.user = s.user;
    return { conversationId: new Int32(s.id), done: true, payload: new Binary(Buffer.alloc(0), 0), ok: 1 };
  }
  const text = payload.toString('utf8');
  const m = /^(c=([^,]*),r=([^,]*)(?:,[^p][^,]*)*),p=([^,]+)$/.exec(text);
  const alg = HASH[s.mech];
  const cred = s.user.creds[s.mech];
  if (!m || m[2] !== 'biws' || m[3] !== s.nonce) { conn.sasl = null; authFailed(); }
  const authMessage = `${s.bare},${s.serverFirst},${m[1]}`;
  const proof = Buffer.from(m[4], 'base64');
  const signature = hmac(alg, cred.storedKey, authMessage);
  if (proof.length !== signature.length
      || !crypto.timingSafeEqual(digest(alg, xor(proof, signature)), cred.storedKey)) {
    conn.sasl = null;
    authFailed();
  }
  const serverFinal = `v=${hmac(alg, cred.serverKey, authMessage).toString('base64')}`;
  if (s.skipEmpty) {
    conn.sasl = null;
    conn.user = s.user;
    return { conversationId: new Int32(s.id), done: true, payload: new Binary(Buffer.from(serverFinal), 0), ok: 1 };
  }
  s.step = 2;
  return { conversationId: new Int32(s.id), done: false, payload: new Binary(Buffer.from(serverFinal), 0), ok: 1 };
}

// ---- access control ----------------------------------------------------------

// the action class a command needs, given its name and document
function actionOf(name, cmd) {
  if (OPEN.has(name)) return 'open';
  if (ANY_USER.has(name)) return 'any';
  if (name === 'aggregate') {
    const p = Array.isArray(cmd.pipeline) ? cmd.pipeline : [];
    const last = p[p.length - 1];
    return V.isPlainDoc(last) && (last.$out !== undefined || last.$merge !== undefined) ? 'write' : 'read';
  }
  if (READ.has(name)) return 'read';
  if (WRITE.has(name)) return 'write';
  if (USER_ADMIN.has(name)) return 'userAdmin';
  return 'cluster';
}

function allowed(user, action, db) {
  return user.roles.some((r) => {
    const def = ROLES[r.role];
    if (!def.grants.includes(action)) return false;
    return def.any || (action !== 'cluster' && r.db === db);
  });
}

// how mongod names the command in its message: the first field and its value
function shortCommand(name, cmd) {
  const v = cmd[name];
  const shown = typeof v === 'string' ? JSON.stringify(v) : (V.isNumber(v) ? String(V.num(v)) : '...');
  return `{ ${name}: ${shown}, $db: ${JSON.stringify(String(cmd.$db))} }`;
}

// null when conn may run cmd, else raises 13 Unauthorized
function check(engine, name, cmd, conn) {
  const action = actionOf(name, cmd);
  if (action === 'open') return;
  const user = conn.user;
  if (!user) {
    // the localhost exception: the first user, in admin
    if (name === 'createUser' && cmd.$db === 'admin' && engine.users.size === 0) return;
    fail(13, `command ${name} requires authentication`);
  }
  if (action === 'any') return;
  if (!allowed(user, action, cmd.$db)) {
    fail(13, `not authorized on ${cmd.$db} to execute command ${shortCommand(name, cmd)}`);
  }
}

// what hello adds: saslSupportedMechs for "db.name", and the first step of a
// speculative authentication (left out when it fails, as mongod does: the
// client then authenticates the usual way and sees the error)
function helloExtras(engine, cmd, conn, r) {
  if (typeof cmd.saslSupportedMechs === 'string') {
    const dot = cmd.saslSupportedMechs.indexOf('.');
    const user = dot > 0 ? engine.users.get(cmd.saslSupportedMechs.slice(0, dot), cmd.saslSupportedMechs.slice(dot + 1)) : null;
    if (user) r.saslSupportedMechs = MECHS.filter((m) => user.creds[m]);
  }
  const spec = cmd.speculativeAuthenticate;
  if (V.isPlainDoc(spec) && spec.saslStart !== undefined && typeof spec.db === 'string') {
    try {
      const body = saslStart(engine, conn, spec, spec.db);
      delete body.ok;
      r.speculativeAuthenticate = body;
    } catch (e) {
      conn.sasl = null;
    }
  }
}

function install(COMMANDS) {
  COMMANDS.saslStart = function (cmd, conn) {
    conn.sasl = null;
    return saslStart(this, conn, cmd, cmd.$db);
  };
  COMMANDS.saslContinue = function (cmd, conn) {
    return saslContinue(conn, cmd);
  };
  COMMANDS.logout = function (cmd, conn) {
    conn.user = null;
    conn.sasl = null;
    return { ok: 1 };
  };
  COMMANDS.connectionStatus = function (cmd, conn) {
    const u = conn.user;
    return {
      authInfo: {
        authenticatedUsers: u ? [{ user: u.name, db: u.db }] : [],
        authenticatedUserRoles: u ? u.roles.map((r) => ({ role: r.role, db: r.db })) : [],
      },
      ok: 1,
    };
  };
  COMMANDS.createUser = function (cmd) {
    if (cmd.roles === undefined) fail(40414, 'BSON field \'createUser.roles\' is missing but a required field');
    if (!Array.isArray(cmd.roles)) fail(14, 'BSON field \'createUser.roles\' is the wrong type, expected type \'array\'');
    this.users.create(cmd.$db, cmd.createUser, cmd.pwd, cmd.roles, cmd.mechanisms);
    return { ok: 1 };
  };
  COMMANDS.dropUser = function (cmd) {
    this.users.drop(cmd.$db, cmd.dropUser);
    return { ok: 1 };
  };
}

module.exports = { Users, parseUserFlag, check, helloExtras, install, ROLES };
