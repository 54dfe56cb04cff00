/*
 * The protocol and the transport seen from Lua, for a transport that runs
 * elsewhere (an nginx worker thread): build an op on the event loop, run
 * it there, parse the reply back on the event loop.  Only strings, numbers
 * and tables cross.
 *
 *   op = core.op_leave{db=, coll=, name=, waiter=, tag=}
 *   op = core.op_force_release{db=, coll=, name=}
 *   op = core.op_status{db=, coll=, name=}       (name nil: the list)
 *   op = core.op_ensure_index{db=, coll=, expire_after=}
 *   op = core.op_doc_status{db=, coll=, id=, owner_field=, time_field=,
 *                           time=, owner_type=, ttl_ms=}
 *   op = core.op_share_leave{db=, coll=, name=, waiter=, tag=},
 *        op_share_force_release{db=, coll=, name=},
 *        op_share_status{db=, coll=, name=}   (the shared kinds, below)
 *   op = core.op_watch{db=, coll=, field=, tag=, t=, i=, resume_token=, session=}
 *        (all = true instead of tag: every change of the collection)
 *   op = core.op_getmore{db=, coll=, cursor_id=, await_ms=, session=}
 *   op = core.op_killcursors{db=, coll=, cursor_id=, session=}
 *   op = core.op_proclaim{db=, coll=, name=, owner=, value=}   (elections)
 *   op = core.op_leader{db=, coll=, name=}
 *   op = core.op_observe{db=, coll=, name=, t=, i=, resume_token=, session=}
 *   reply, err, code = client:run(op)            (BSON strings)
 *   n = core.parse_update(reply)
 *   list = core.parse_status(reply)
 *   b = core.parse_events(reply, tag)
 *   st = core.parse_doc_status(reply)
 *
 * session (32 hex digits, optional): the key of the logical session a
 * cursor's commands run in.  mongod binds a cursor to the session that
 * created it (a getMore in another session, or without one, fails), and
 * libmongoc gives every command an implicit session of the calling pool: a
 * watch op given a session key opens that session, its getMores and its
 * killCursors (which closes it) run in it, from any client of the process
 * (transport.h).
 *
 * An op is one BSON document, the envelope {kind, retry, db, coll, session, cmd}:
 * kind is "write", "update", "cursor" or "command" (how transport.c runs
 * it), cmd the command as the server receives it.  The C methods
 * (client:acquire, h:release, ...) run the same builders and parsers
 * without the envelope; an attempt's op and its outcome cross as a
 * mongolock.Attempt (attempt.c: client:acquire_attempt, ..., a:op(),
 * a:take(...)), a handle's release and extend as core.lease_step /
 * core.lease_done (lock.c).
 *
 * This file also holds the Lua tables that parsed replies make, shared by
 * those methods and the parse_* functions.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "compat.h"
#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "bson_lua.h"
#include "args.h"
#include "client.h"
#include "ops.h"
#include "protocol_shared.h"
#include "stats.h"

/* ---- the tables of parsed replies -------------------------------------- */

/* [-0, +1] holder sub-document as {host=, pid=, app=} (or nil) */
static void push_holder(lua_State *L, int has, const bson_t *h) {
  bson_iter_t it;
  if (!has) {
    lua_pushnil(L);
    return;
  }
  lua_createtable(L, 0, 3);
  if (bson_iter_init(&it, h)) {
    while (bson_iter_next(&it)) {
      const char *k = bson_iter_key(&it);
      if (BSON_ITER_HOLDS_UTF8(&it)) lua_pushstring(L, bson_iter_utf8(&it, NULL));
      else if (BSON_ITER_HOLDS_NUMBER(&it)) ml_pushint64(L, ml_iter_int64(&it, 0));
      else continue;
      lua_setfield(L, -2, k);
    }
  }
}

void ml_set_operation_time(lua_State *L, const bson_t *reply) {
  uint32_t t, i;
  if (!ml_parse_operation_time(reply, &t, &i)) return;
  lua_createtable(L, 0, 2);
  lua_pushnumber(L, (lua_Number)t);
  lua_setfield(L, -2, "t");
  lua_pushnumber(L, (lua_Number)i);
  lua_setfield(L, -2, "i");
  lua_setfield(L, -2, "operation_time");
}

/* [-0, +0] t[key] = v in the table on top, when has */
static void set_int(lua_State *L, int has, const char *key, int64_t v) {
  if (!has) return;
  ml_pushint64(L, v);
  lua_setfield(L, -2, key);
}

/* a date, as seconds since the epoch (like ngx.now()) */
static void set_date(lua_State *L, int has, const char *key, int64_t ms) {
  if (!has) return;
  lua_pushnumber(L, (lua_Number)ms / 1000.0);
  lua_setfield(L, -2, key);
}

/* a duration in ms as seconds, at least 0 */
static void set_seconds(lua_State *L, int has, const char *key, int64_t ms) {
  if (!has) return;
  lua_pushnumber(L, ms > 0 ? (lua_Number)ms / 1000.0 : 0);
  lua_setfield(L, -2, key);
}

static void set_str(lua_State *L, const char *key, const char *s) {
  if (!s) return;
  lua_pushstring(L, s);
  lua_setfield(L, -2, key);
}

/* a name in its lock-delay (left_ms > 0): delayed = true, delay = seconds
 * left, delay_until = its end's date (when known) */
static void set_delay(lua_State *L, int64_t left_ms, int has_until, int64_t until_ms) {
  if (left_ms <= 0) return;
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "delayed");
  set_seconds(L, 1, "delay", left_ms);
  set_date(L, has_until, "delay_until", until_ms);
}

void ml_push_acquire_info(lua_State *L, const ml_acquire_reply *r, const bson_t *reply) {
  lua_createtable(L, 0, 8);
  set_str(L, "owner", r->has_owner && BSON_ITER_HOLDS_UTF8(&r->owner)
                          ? bson_iter_utf8(&r->owner, NULL) : NULL);
  set_int(L, r->token != 0, "token", r->token);
  set_seconds(L, r->has_remaining, "remaining", r->remaining_ms);
  set_date(L, r->has_expires, "expires_at", r->expires_ms);
  push_holder(L, r->has_holder, &r->holder);
  lua_setfield(L, -2, "holder");
  set_int(L, r->queued >= 0, "queued", r->queued);
  set_int(L, r->position >= 0, "position", r->position + 1);
  /* a named lock held by readers or permits: how many */
  set_int(L, r->holders >= 0, "holders", r->holders);
  set_int(L, r->readers >= 0, "readers", r->readers);
  set_delay(L, ml_delay_left(r->delay_ms, r->has_remaining, r->remaining_ms), r->has_expires,
            r->expires_ms + r->delay_ms);
  ml_set_operation_time(L, reply);
}

/* [-0, +1] a status table */
static void push_status(lua_State *L, const ml_status *st) {
  /* held by readers' shares or permits, with no live exclusive owner */
  int shared = !st->held && st->has_holders && st->holders > 0;
  int64_t delay = st->held ? 0 : ml_delay_left(st->delay_ms, st->has_remaining, st->remaining_ms);
  lua_createtable(L, 0, 12);
  set_str(L, "name", st->name);
  lua_pushboolean(L, st->held || shared);
  lua_setfield(L, -2, "held");
  set_str(L, "state", st->held ? "held"
                      : shared ? (st->has_permits ? "permits" : "shared")
                      : delay > 0 ? "delayed"
                      : st->owner ? "expired" : "free");
  set_delay(L, delay, st->has_expires, st->expires_ms + st->delay_ms);
  set_int(L, st->has_holders, "holders", st->holders);
  set_int(L, st->has_readers, "readers", st->readers);
  set_int(L, st->has_permits, "permits", st->permits);
  set_str(L, "owner", st->owner);
  set_int(L, st->has_token, "token", st->token);
  set_date(L, st->has_acquired, "acquired_at", st->acquired_ms);
  set_date(L, st->has_expires, "expires_at", st->expires_ms);
  set_seconds(L, st->has_remaining, "remaining", st->remaining_ms);
  set_int(L, st->has_waiting, "waiting", st->waiting);
  push_holder(L, st->has_holder, &st->holder);
  lua_setfield(L, -2, "holder");
}

void ml_push_status_list(lua_State *L, const bson_t *reply) {
  bson_iter_t docs;
  lua_Integer n = 0;
  lua_newtable(L);
  if (!ml_reply_batch(reply, &docs, NULL)) return;
  bson_t doc;
  while (ml_batch_next(&docs, &doc)) {
    ml_status st;
    ml_parse_status(&doc, &st);
    push_status(L, &st);
    lua_rawseti(L, -2, (int)++n);
  }
}

/* [-0, +1] what a busy attempt tells: {owner = <value>, remaining = s,
 * doc = <current>, operation_time = {t, i}} */
void ml_push_doc_info(lua_State *L, const ml_acquire_reply *ar, const bson_t *reply,
                      const char *owner_field) {
  lua_createtable(L, 0, 4);
  ml_pushbson(L, &ar->value);
  lua_getfield(L, -1, owner_field);
  lua_setfield(L, -3, "owner");
  lua_setfield(L, -2, "doc");
  lua_pushnumber(L, (lua_Number)(ar->remaining_ms > 0 ? ar->remaining_ms : 0) / 1000.0);
  lua_setfield(L, -2, "remaining");
  ml_set_operation_time(L, reply);
}

/* a status aggregate's reply (ml_build_doc_status): pushes {held, state,
 * owner, remaining}, or nil, "not found"; returns the values pushed */
int ml_push_doc_status(lua_State *L, const bson_t *reply) {
  bson_iter_t docs, f;
  int64_t rem = 0;
  int held, has_owner;
  if (!ml_reply_batch(reply, &docs, NULL) || !bson_iter_next(&docs) ||
      !BSON_ITER_HOLDS_DOCUMENT(&docs))
    return ml_pushfail(L, "not found", 0);
  bson_iter_recurse(&docs, &f);
  has_owner = bson_iter_find(&f, "owner") && !BSON_ITER_HOLDS_NULL(&f);
  bson_iter_recurse(&docs, &f);
  if (bson_iter_find(&f, "remainingMs")) rem = ml_iter_int64(&f, 0);
  held = has_owner && rem > 0;
  lua_createtable(L, 0, 4);
  lua_pushboolean(L, held);
  lua_setfield(L, -2, "held");
  lua_pushstring(L, held ? "held" : has_owner ? "expired" : "free");
  lua_setfield(L, -2, "state");
  if (held) {
    bson_iter_recurse(&docs, &f);
    bson_iter_find(&f, "owner");
    ml_pushbsonvalue(L, &f);
    lua_setfield(L, -2, "owner");
  }
  lua_pushnumber(L, held ? (lua_Number)rem / 1000.0 : 0);
  lua_setfield(L, -2, "remaining");
  return 1;
}

/* ---- arguments --------------------------------------------------------- */

/* field key of the table at 1: a string (NULL when absent and optional) */
static const char *opt_str(lua_State *L, const char *key, int required, size_t *len) {
  const char *s = NULL;
  size_t n = 0;
  lua_getfield(L, 1, key);
  if (lua_type(L, -1) == LUA_TSTRING) {
    s = lua_tolstring(L, -1, &n);
  } else if (!lua_isnil(L, -1) || required) {
    luaL_argerror(L, 1, lua_pushfstring(L, "%s: string expected, got %s", key,
                                        luaL_typename(L, -1)));
  }
  lua_pop(L, 1);               /* the string stays alive in the table */
  if (len) *len = n;
  return s;
}

static lua_Number opt_num(lua_State *L, const char *key, int required, lua_Number dflt) {
  lua_Number v = dflt;
  lua_getfield(L, 1, key);
  if (lua_type(L, -1) == LUA_TNUMBER) v = lua_tonumber(L, -1);
  else if (!lua_isnil(L, -1) || required)
    luaL_argerror(L, 1, lua_pushfstring(L, "%s: number expected, got %s", key,
                                        luaL_typename(L, -1)));
  lua_pop(L, 1);
  return v;
}

static void bad(lua_State *L, const char *key, const char *msg) {
  luaL_argerror(L, 1, lua_pushfstring(L, "%s: %s", key, msg));
}

static void check_ns(lua_State *L, const char **db, const char **coll) {
  size_t len;
  const char *msg;
  luaL_checktype(L, 1, LUA_TTABLE);
  *db = opt_str(L, "db", 1, &len);
  if ((msg = ml_check_db(*db, len)) != NULL) bad(L, "db", msg);
  *coll = opt_str(L, "coll", 1, &len);
  if ((msg = ml_check_coll(*db, *coll, len)) != NULL) bad(L, "coll", msg);
}

static const char *check_name(lua_State *L, int required) {
  size_t len;
  const char *msg, *s = opt_str(L, "name", required, &len);
  if (s && (msg = ml_check_name(s, len)) != NULL) bad(L, "name", msg);
  return s;
}

/* db, coll and name (required or not) of the table at 1 */
static const char *check_lock(lua_State *L, const char **db, const char **coll, int required) {
  check_ns(L, db, coll);
  return check_name(L, required);
}

static const char *check_hex(lua_State *L, const char *key, size_t n, int required) {
  size_t len;
  const char *s = opt_str(L, key, required, &len);
  if (s && !ml_is_hex(s, len, n))
    bad(L, key, n == 32 ? "32 lowercase hex digits expected" : "16 lowercase hex digits expected");
  return s;
}

static int64_t check_ms(lua_State *L, const char *key) {
  int64_t ms = ml_ttl_ms(opt_num(L, key, 1, 0));
  if (ms <= 0) bad(L, key, "a positive number of milliseconds, at most a year, expected");
  return ms;
}

/* a cursor id: a decimal string (ids use all 64 bits; mongolock.ngx passes
 * them so), or a number that holds the id exactly: an integer, or a float
 * with no fraction up to 2^53 (beyond it a float has lost digits) */
static int64_t check_cursor_id(lua_State *L) {
  int64_t id = 0;
  lua_getfield(L, 1, "cursor_id");
  if (lua_type(L, -1) == LUA_TSTRING) {
    char *end;
    const char *s = lua_tostring(L, -1);
    errno = 0;
    id = (int64_t)strtoll(s, &end, 10);
    if (!*s || *end || errno == ERANGE) bad(L, "cursor_id", "a 64-bit decimal string expected");
  } else if (lua_type(L, -1) == LUA_TNUMBER) {
#if LUA_VERSION_NUM >= 503
    if (lua_isinteger(L, -1)) id = (int64_t)lua_tointeger(L, -1);
    else
#endif
    {
      double d = lua_tonumber(L, -1);
      if (!(d == floor(d) && fabs(d) <= 9007199254740992.0))
        bad(L, "cursor_id", "an integer up to 2^53 expected (a larger id as a decimal string)");
      id = (int64_t)d;
    }
  } else {
    bad(L, "cursor_id", "a decimal string or an integer expected");
  }
  lua_pop(L, 1);
  return id;
}

/* ---- the envelope ------------------------------------------------------ */

/* [-0, +1] pushes op as its envelope and destroys it; returns 1 */
static int push_op(lua_State *L, ml_op *op) {
  ml_push_op(L, op);
  ml_op_destroy(op);
  return 1;
}

/* ---- builders ---------------------------------------------------------- */

static const char *check_value(lua_State *L);

static int l_op_leave(lua_State *L) {
  const char *db, *coll, *name, *waiter, *tag;
  ml_op op;
  name = check_lock(L, &db, &coll, 1);
  waiter = check_hex(L, "waiter", 32, 1);
  tag = check_hex(L, "tag", 16, 1);
  ml_build_leave(&op, db, coll, name, waiter, tag);
  return push_op(L, &op);
}

static int l_op_force_release(lua_State *L) {
  const char *db, *coll, *name = check_lock(L, &db, &coll, 1);
  ml_op op;
  ml_build_force_release(&op, db, coll, name);
  return push_op(L, &op);
}

static int l_op_status(lua_State *L) {
  const char *db, *coll, *name = check_lock(L, &db, &coll, 0);
  ml_op op;
  ml_build_status(&op, db, coll, name);
  return push_op(L, &op);
}

static int l_op_ensure_index(lua_State *L) {
  const char *db, *coll;
  lua_Number secs;
  ml_op op;
  check_ns(L, &db, &coll);
  secs = opt_num(L, "expire_after", 1, 0);
  if (!(secs >= 0 && secs <= INT32_MAX)) bad(L, "expire_after", "out of range");
  ml_build_ensure_index(&op, db, coll, (int32_t)secs);
  return push_op(L, &op);
}

static int l_op_watch(lua_State *L) {
  const char *db, *coll, *field, *tag, *tok, *session;
  int all;
  size_t len;
  lua_Number t, i;
  bson_t token;
  ml_op op;
  check_ns(L, &db, &coll);
  field = opt_str(L, "field", 0, &len);
  if (!field) field = ML_F_OWNER;
  else if (ml_check_field(field, len)) bad(L, "field", ml_check_field(field, len));
  lua_getfield(L, 1, "all");
  all = lua_toboolean(L, -1);
  lua_pop(L, 1);
  tag = all ? NULL : check_hex(L, "tag", 16, 1);
  t = opt_num(L, "t", 0, 0);
  i = opt_num(L, "i", 0, 0);
  if (!(t >= 0 && t <= 4294967295.0 && i >= 0 && i <= 4294967295.0))
    bad(L, "t", "timestamp part out of range");
  session = check_hex(L, "session", 32, 0);   /* before anything is built */
  tok = opt_str(L, "resume_token", 0, &len);
  if (tok) {
    lua_getfield(L, 1, "resume_token");
    ml_arg_bson(L, lua_gettop(L), &token);
  }
  ml_build_watch(&op, db, coll, field, tag, (uint32_t)t, (uint32_t)i, tok ? &token : NULL);
  op.session = session;
  return push_op(L, &op);
}

static int l_op_getmore(lua_State *L) {
  const char *db, *coll, *session;
  int64_t id, await;
  ml_op op;
  check_ns(L, &db, &coll);
  id = check_cursor_id(L);
  await = (int64_t)opt_num(L, "await_ms", 0, 1000);
  if (await < 0) bad(L, "await_ms", "must not be negative");
  session = check_hex(L, "session", 32, 0);   /* before anything is built */
  ml_build_getmore(&op, db, coll, id, await);
  op.session = session;
  return push_op(L, &op);
}

static int l_op_killcursors(lua_State *L) {
  const char *db, *coll, *session;
  int64_t id;
  ml_op op;
  check_ns(L, &db, &coll);
  id = check_cursor_id(L);
  session = check_hex(L, "session", 32, 0);   /* before anything is built */
  ml_build_killcursors(&op, db, coll, id);
  op.session = session;
  return push_op(L, &op);
}

/* ---- elections (protocol.h) ------------------------------------------- */

/* an election's value: a string of UTF-8 without NUL, up to ML_VALUE_MAX */
static const char *check_value(lua_State *L) {
  size_t len;
  const char *msg, *v = opt_str(L, "value", 1, &len);
  if ((msg = ml_check_value(v, len)) != NULL) bad(L, "value", msg);
  return v;
}

static int l_op_proclaim(lua_State *L) {
  const char *db, *coll, *name, *owner, *value;
  ml_op op;
  name = check_lock(L, &db, &coll, 1);
  owner = check_hex(L, "owner", 32, 1);
  value = check_value(L);
  ml_build_proclaim(&op, db, coll, name, owner, value);
  return push_op(L, &op);
}

static int l_op_leader(lua_State *L) {
  const char *db, *coll, *name = check_lock(L, &db, &coll, 1);
  ml_op op;
  ml_build_leader(&op, db, coll, name);
  return push_op(L, &op);
}

static int l_op_observe(lua_State *L) {
  const char *db, *coll, *name, *tok, *session;
  size_t len;
  lua_Number t, i;
  bson_t token;
  ml_op op;
  name = check_lock(L, &db, &coll, 1);
  t = opt_num(L, "t", 0, 0);
  i = opt_num(L, "i", 0, 0);
  if (!(t >= 0 && t <= 4294967295.0 && i >= 0 && i <= 4294967295.0))
    bad(L, "t", "timestamp part out of range");
  session = check_hex(L, "session", 32, 0);   /* before anything is built */
  tok = opt_str(L, "resume_token", 0, &len);
  if (tok) {
    lua_getfield(L, 1, "resume_token");
    ml_arg_bson(L, lua_gettop(L), &token);
  }
  ml_build_observe(&op, db, coll, name, (uint32_t)t, (uint32_t)i, tok ? &token : NULL);
  op.session = session;
  return push_op(L, &op);
}

/* ---- document locks (documents.c) -------------------------------------- */

/* the document lock of an op's table: db, coll, id (into *id, initialised
 * here: destroy it), owner_field, time_field, time ("expires" | "locked"),
 * owner_type ("hex" | "uuid"); raises on a bad field */
static void check_docref(lua_State *L, ml_lockref *r, bson_t *id) {
  size_t len;
  const char *msg, *s;
  char err[512];
  memset(r, 0, sizeof *r);
  check_ns(L, &r->db, &r->coll);
  r->owner_field = opt_str(L, "owner_field", 1, &len);
  if ((msg = ml_check_field(r->owner_field, len)) != NULL) bad(L, "owner_field", msg);
  r->time_field = opt_str(L, "time_field", 1, &len);
  if ((msg = ml_check_field(r->time_field, len)) != NULL) bad(L, "time_field", msg);
  if (!strcmp(r->owner_field, r->time_field)) bad(L, "time_field", "must differ from owner_field");
  s = opt_str(L, "time", 0, NULL);
  if (!s || !strcmp(s, "expires")) r->time_mode = ML_TIME_EXPIRES_AT;
  else if (!strcmp(s, "locked")) r->time_mode = ML_TIME_LOCKED_AT;
  else bad(L, "time", "\"expires\" or \"locked\" expected");
  s = opt_str(L, "owner_type", 0, NULL);
  if (!s || !strcmp(s, "hex")) r->owner_form = ML_OWNER_HEX;
  else if (!strcmp(s, "uuid")) r->owner_form = ML_OWNER_UUID;
  else bad(L, "owner_type", "\"hex\" or \"uuid\" expected");
  lua_getfield(L, 1, "id");
  msg = ml_doc_id(L, -1, id, err, sizeof err);
  lua_pop(L, 1);
  if (msg) {
    bson_destroy(id);
    bad(L, "id", msg);
  }
  r->id = id;
}

/* core.op_doc_status{db, coll, id, owner_field, time_field, time,
 * owner_type, ttl_ms} */
static int l_op_doc_status(lua_State *L) {
  ml_lockref r;
  bson_t id;
  int64_t ttl_ms = check_ms(L, "ttl_ms");
  ml_op op;
  check_docref(L, &r, &id);
  ml_build_doc_status(&op, &r, ttl_ms);
  bson_destroy(&id);
  return push_op(L, &op);
}

/* ---- the transport ----------------------------------------------------- */

int ml_push_run(lua_State *L, ml_client *c, const ml_op *op, int decode) {
  bson_t reply;
  bson_error_t err;
  int ok, n = 1;
  ml_obs_command(c);
  ok = ml_run(ml_client_get(L, c), c->wc, op, &reply, &err);
  if (!ok) n = ml_pusherror(L, &err) + 1;
  if (ok || !bson_empty(&reply)) {
    if (decode) ml_pushbson(L, &reply);
    else lua_pushlstring(L, (const char *)bson_get_data(&reply), reply.len);
  } else {
    lua_pushnil(L);
  }
  bson_destroy(&reply);
  return n;
}

/* client:run(op) -> reply | nil, message, code, reply, domain (BSON
 * strings; domain: libmongoc's error domain, which tells an error without
 * a reply, MONGOC_ERROR_STREAM, from the others) */
static int ml_m_run(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  bson_t reply;
  bson_error_t err;
  ml_op op;
  int ok;
  ml_arg_op(L, 2, &op);
  ml_obs_command(c);
  ok = ml_run(ml_client_get(L, c), c->wc, &op, &reply, &err);
  if (ok) {
    lua_pushlstring(L, (const char *)bson_get_data(&reply), reply.len);
    bson_destroy(&reply);
    return 1;
  }
  ml_pusherror(L, &err);
  if (!bson_empty(&reply)) lua_pushlstring(L, (const char *)bson_get_data(&reply), reply.len);
  else lua_pushnil(L);
  lua_pushinteger(L, (lua_Integer)err.domain);
  bson_destroy(&reply);
  return 5;
}

/* ---- parsers ----------------------------------------------------------- */

/* core.parse_doc_status(reply) -> {held, state, owner, remaining} |
 * nil, "not found" */
static int l_parse_doc_status(lua_State *L) {
  bson_t reply;
  ml_arg_bson(L, 1, &reply);
  return ml_push_doc_status(L, &reply);
}

/* ---- the shared kinds (protocol_shared.h) ------------------------------ */

static int l_op_share_leave(lua_State *L) {
  const char *db, *coll, *name, *waiter, *tag;
  ml_op op;
  name = check_lock(L, &db, &coll, 1);
  waiter = check_hex(L, "waiter", 32, 1);
  tag = check_hex(L, "tag", 16, 1);
  ml_build_share_leave(&op, db, coll, name, waiter, tag);
  return push_op(L, &op);
}

/* core.op_share_force_release{db, coll, name}: ends every share and
 * permit of the name */
static int l_op_share_force_release(lua_State *L) {
  const char *db, *coll, *name = check_lock(L, &db, &coll, 1);
  ml_op op;
  ml_build_share_force_release(&op, db, coll, name);
  return push_op(L, &op);
}

/* core.op_share_status{db, coll, name} (name nil: every such document) */
static int l_op_share_status(lua_State *L) {
  const char *db, *coll, *name = check_lock(L, &db, &coll, 0);
  ml_op op;
  ml_build_share_status(&op, db, coll, name);
  return push_op(L, &op);
}

/* core.parse_update(reply) -> documents matched | nil, message */
static int l_parse_update(lua_State *L) {
  bson_t reply;
  int64_t n;
  ml_arg_bson(L, 1, &reply);
  n = ml_parse_matched(&reply);
  if (n < 0) return ml_pushfail(L, "update reply without matchedCount", 0);
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

/* core.parse_status(reply) -> {status, ...} */
static int l_parse_status(lua_State *L) {
  bson_t reply;
  ml_arg_bson(L, 1, &reply);
  ml_push_status_list(L, &reply);
  return 1;
}

/* core.parse_events(reply, tag) -> {cursor_id = "decimal", resume_token =
 * BSON string | nil, events = {{id =, next = "" | 48 hex, lost = nil | 32
 * hex, wakes =, t =, i =}}}: a change-stream batch (aggregate or getMore
 * reply).  next names the waiter of this process (tag) a release was
 * handed to; "" wakes every waiter of id (nil: of every document); lost
 * the owner id of a lease of this process the write ended; wakes false
 * when it passed the filter for lost alone */
static int l_parse_events(lua_State *L) {
  bson_t reply;
  bson_iter_t docs;
  size_t len;
  const char *tag;
  int64_t id = 0;
  char buf[32];
  int n = 0;
  ml_arg_bson(L, 1, &reply);
  tag = luaL_checklstring(L, 2, &len);
  luaL_argcheck(L, ml_is_hex(tag, len, 16), 2, "16 lowercase hex digits expected");
  lua_createtable(L, 0, 3);
  lua_newtable(L);
  if (ml_reply_batch(&reply, &docs, &id)) {
    while (bson_iter_next(&docs)) {
      const uint8_t *data;
      uint32_t dlen;
      bson_t doc;
      ml_event ev;
      if (!BSON_ITER_HOLDS_DOCUMENT(&docs)) continue;
      bson_iter_document(&docs, &dlen, &data);
      if (!bson_init_static(&doc, data, dlen)) continue;
      ml_parse_event(&doc, tag, &ev);
      lua_createtable(L, 0, 4);
      if (ev.has_key) {
        ml_pushbsonvalue(L, &ev.key);
        lua_setfield(L, -2, "id");
      }
      lua_pushstring(L, ev.next);
      lua_setfield(L, -2, "next");
      if (ev.owner[0]) {
        /* the release granted the lock to the waiter next names */
        lua_pushstring(L, ev.owner);
        lua_setfield(L, -2, "owner");
        ml_pushint64(L, ev.token);
        lua_setfield(L, -2, "token");
        if (ev.grant_ms >= 0) {
          lua_pushinteger(L, (lua_Integer)ev.grant_ms);
          lua_setfield(L, -2, "grant_ms");
        }
      }
      if (ev.lost[0]) {
        /* it ended a lease of this process: that lease's owner id */
        lua_pushstring(L, ev.lost);
        lua_setfield(L, -2, "lost");
      }
      lua_pushboolean(L, ev.wakes);
      lua_setfield(L, -2, "wakes");
      lua_pushnumber(L, (lua_Number)ev.t);
      lua_setfield(L, -2, "t");
      lua_pushnumber(L, (lua_Number)ev.i);
      lua_setfield(L, -2, "i");
      lua_rawseti(L, -2, ++n);
    }
  }
  lua_setfield(L, -2, "events");
  bson_snprintf(buf, sizeof buf, "%lld", (long long)id);
  lua_pushstring(L, buf);
  lua_setfield(L, -2, "cursor_id");
  {
    const uint8_t *data;
    uint32_t tlen;
    if (ml_reply_resume_token(&reply, &data, &tlen)) {
      lua_pushlstring(L, (const char *)data, tlen);
      lua_setfield(L, -2, "resume_token");
    }
  }
  return 1;
}

static const luaL_Reg ops_funcs[] = {
  {"op_leave", l_op_leave},
  {"op_force_release", l_op_force_release},
  {"op_status", l_op_status},
  {"op_ensure_index", l_op_ensure_index},
  {"op_watch", l_op_watch},
  {"op_getmore", l_op_getmore},
  {"op_killcursors", l_op_killcursors},
  {"op_proclaim", l_op_proclaim},
  {"op_leader", l_op_leader},
  {"op_observe", l_op_observe},
  {"op_doc_status", l_op_doc_status},
  {"parse_doc_status", l_parse_doc_status},
  {"op_share_leave", l_op_share_leave},
  {"op_share_force_release", l_op_share_force_release},
  {"op_share_status", l_op_share_status},
  {"parse_update", l_parse_update},
  {"parse_status", l_parse_status},
  {"parse_events", l_parse_events},
  {NULL, NULL}
};

void ml_ops_open(lua_State *L) {
  /* [module] */
  luaL_setfuncs(L, ops_funcs, 0);
}

/* Client methods: any op (module.c adds them to mongolock.Client) */
const luaL_Reg ml_ops_methods[] = {
  {"run", ml_m_run},
  {NULL, NULL}
};
