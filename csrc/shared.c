/*
 * The client's commands on the shared kinds (protocol_shared.h): a reader's
 * share of a reader-writer lock and a semaphore's permit.  Each is won as a
 * mongolock.Lock whose lease is an entry of the document's holders array
 * (ML_KIND_SHARED, ML_KIND_PERMIT): release, extend, renewal, lost, close,
 * __close and __gc are the exclusive lock's (lock.c), whose release and
 * extend build the shared kinds' commands for these kinds.
 */
#include <string.h>
#include <unistd.h>

#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "bson_lua.h"
#include "args.h"
#include "client.h"
#include "lock.h"
#include "named.h"
#include "shared.h"
#include "ops.h"
#include "renew.h"
#include "protocol_shared.h"

/* [-0, +1] the reply's projected document, with operation_time */
static void push_info(lua_State *L, const bson_t *value, const bson_t *reply) {
  ml_pushbson(L, value);
  ml_set_operation_time(L, reply);
}

/*
 * client:share_acquire(db, coll, name, mode, permits, ttl_ms [, app [, renew
 *                      [, waiter, queue_ms [, polling]]]])
 *   mode "shared" (a reader's share) or "permit" (permits: N)
 *   -> handle
 *    | nil, "busy", info          info: the projected lock document
 *                                 (permits, token, holders, readers,
 *                                 exclusive, remainingMs, queued, position
 *                                 (0-based, -1), writers, holder) and
 *                                 operation_time
 *    | nil, "mismatch", info      the name is of another kind, or a
 *                                 semaphore of another N: nothing written
 *    | nil, message, code
 * One findAndModify, retried once after a network error with the same
 * owner id (an applied attempt is then found won); without a reply to the
 * retry either, a share it may have taken is released in the background
 * (ml_push_won).
 */
static int share_acquire(lua_State *L, ml_attempt_mode how) {
  ml_client *c = ml_checkclient(L, 1);
  ml_acquire_args a;
  ml_attempt t;
  const char *owner = t.owner;
  size_t namelen;
  const char *mode_s;
  int mode;
  int64_t permits = 0;
  mongoc_client_t *mc;
  bson_t reply, id;
  bson_error_t err;
  ml_share_reply r;
  ml_op op;
  ml_lease_spec s;
  double started;
  int ok, pushed;
  char keeper[17];

  memset(&a, 0, sizeof a);
  ml_arg_ns(L, 2, &a.db, &a.coll);
  a.name = ml_arg_name(L, 4, &namelen);
  mode_s = luaL_checkstring(L, 5);
  if (!strcmp(mode_s, "shared")) mode = ML_MODE_SHARED;
  else if (!strcmp(mode_s, "permit")) mode = ML_MODE_PERMIT;
  else return luaL_argerror(L, 5, "mode must be \"shared\" or \"permit\"");
  if (mode == ML_MODE_PERMIT) {
    lua_Integer n = luaL_checkinteger(L, 6);
    luaL_argcheck(L, n >= 1 && n <= ML_PERMITS_MAX, 6, "permits must be an integer from 1 to 1000000");
    permits = n;
  }
  a.ttl_ms = ml_arg_ttl_ms(L, 7);
  if (!ml_arg_attempt_owner(L, mongoc_uri_get_appname(c->uri), 8, 10,
                            how == ML_ATTEMPT_RUN ? 0 : 13, &a, &t))
    return ml_pushfail(L, "getrandom failed", 0);
  if (how == ML_ATTEMPT_TAKE) {
    luaL_argcheck(L, !lua_isnoneornil(L, 13), 13, "the owner of the attempt expected");
    started = ml_arg_started(L, 14);
    ok = ml_arg_outcome(L, 15, &reply, &err);
  } else {
    if (lua_toboolean(L, 9)) a.keeper = ml_renew_keeper(L, c, keeper);
    ml_build_share_acquire(&op, &a, mode, permits);
    if (how == ML_ATTEMPT_OP) return ml_push_op_owner(L, &op, owner);
    mc = ml_client_get(L, c);
    started = ml_monotonic();
    ml_obs_command(c);
    ok = ml_run(mc, c->wc, &op, &reply, &err);
    ml_op_destroy(&op);
  }
  ok = ml_parse_share_acquire(&reply, owner, mode, permits, &r) > 0 ? ok : ok ? -1 : 0;

  bson_init(&id);
  bson_append_utf8(&id, "_id", 3, a.name, (int)namelen);
  ml_lease_spec_named(&s, mode == ML_MODE_PERMIT ? ML_KIND_PERMIT : ML_KIND_SHARED, a.db, a.coll,
                      &id, ML_F_HOLDERS, owner, a.ttl_ms);
  s.token = r.token;
  s.started = started;
  s.waiter = a.waiter != NULL;
  s.renew = lua_toboolean(L, 9);
  pushed = ml_push_won(L, c, ok, r.won, &s, &err);
  if (pushed) {
    bson_destroy(&id);
    bson_destroy(&reply);
    return pushed;
  }
  bson_destroy(&id);
  lua_pushnil(L);
  if (r.mismatch) lua_pushliteral(L, "mismatch");
  else lua_pushliteral(L, "busy");
  push_info(L, &r.value, &reply);
  bson_destroy(&reply);
  return 3;
}

static int ml_m_share_acquire(lua_State *L) { return share_acquire(L, ML_ATTEMPT_RUN); }

/* client:share_acquire_op(<share_acquire's arguments> [, owner]) -> op,
 * owner; client:take_share_acquire(<share_acquire's arguments>, owner,
 * started, reply, message, code, ereply, domain) -> share_acquire's
 * answers (ml_attempt_mode) */
static int ml_m_share_acquire_op(lua_State *L) { return share_acquire(L, ML_ATTEMPT_OP); }
static int ml_m_take_share_acquire(lua_State *L) { return share_acquire(L, ML_ATTEMPT_TAKE); }

/* client:share_leave(db, coll, name, waiter) -> true | nil, msg, code */
static int ml_m_share_leave(lua_State *L) {
  return ml_push_leave(L, ml_build_share_leave);
}

/* client:share_force_release(db, coll, name) -> true | nil, "not held" |
 * nil, msg, code: ends every share and permit of the name */
static int ml_m_share_force_release(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll, *name = ml_arg_lock(L, &db, &coll);
  ml_op op;
  ml_build_share_force_release(&op, db, coll, name);
  return ml_push_update(L, c, &op, "not held");
}

/* client:share_status(db, coll, name) -> {_id, permits, token, exclusive,
 * holders = {{owner, mode, token, holder, remainingMs}}, waiting, writers}
 * | nil (no such lock) | nil, msg, code.  name nil: the array of every
 * such document with shares, permits or sharers waiting, sorted by name.
 * One aggregate (while the result fits the first batch). */
static int ml_m_share_status(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll, *name;
  size_t namelen;
  bson_t reply;
  bson_error_t err;
  bson_iter_t docs;
  ml_op op;
  int ok;
  ml_arg_ns(L, 2, &db, &coll);
  name = lua_isnoneornil(L, 4) ? NULL : ml_arg_name(L, 4, &namelen);
  ml_build_share_status(&op, db, coll, name);
  ml_obs_command(c);
  ok = ml_run(ml_client_get(L, c), c->wc, &op, &reply, &err);
  ml_op_destroy(&op);
  if (!ok) {
    bson_destroy(&reply);
    return ml_pusherror(L, &err);
  }
  if (!name) {
    lua_Integer n = 0;
    lua_newtable(L);
    if (ml_reply_batch(&reply, &docs, NULL))
      while (bson_iter_next(&docs)) {
        const uint8_t *data;
        uint32_t len;
        bson_t doc;
        if (!BSON_ITER_HOLDS_DOCUMENT(&docs)) continue;
        bson_iter_document(&docs, &len, &data);
        if (!bson_init_static(&doc, data, len)) continue;
        ml_pushbson(L, &doc);
        lua_rawseti(L, -2, ++n);
      }
    bson_destroy(&reply);
    return 1;
  }
  lua_pushnil(L);
  if (ml_reply_batch(&reply, &docs, NULL) && bson_iter_next(&docs) &&
      BSON_ITER_HOLDS_DOCUMENT(&docs)) {
    const uint8_t *data;
    uint32_t len;
    bson_t doc;
    bson_iter_document(&docs, &len, &data);
    if (bson_init_static(&doc, data, len)) {
      lua_pop(L, 1);
      ml_pushbson(L, &doc);
    }
  }
  bson_destroy(&reply);
  return 1;
}

/* Client methods: reader shares and permits (module.c adds them to mongolock.Client) */
const luaL_Reg ml_shared_methods[] = {
  {"share_acquire", ml_m_share_acquire},
  {"share_acquire_op", ml_m_share_acquire_op},
  {"take_share_acquire", ml_m_take_share_acquire},
  {"share_leave", ml_m_share_leave},
  {"share_force_release", ml_m_share_force_release},
  {"share_status", ml_m_share_status},
  {NULL, NULL}
};
