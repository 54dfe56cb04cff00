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
#include "stats.h"
#include "attempt.h"

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
static int prepare_share(lua_State *L, ml_client *c, ml_acquire_attempt *t, int owner_i) {
  ml_acquire_args *a = &t->a;
  const char *mode_s;
  ml_arg_ns(L, 2, &a->db, &a->coll);
  a->name = ml_arg_name(L, 4, &t->namelen);
  mode_s = luaL_checkstring(L, 5);
  if (!strcmp(mode_s, "shared")) t->mode = ML_MODE_SHARED;
  else if (!strcmp(mode_s, "permit")) t->mode = ML_MODE_PERMIT;
  else return luaL_argerror(L, 5, "mode must be \"shared\" or \"permit\"");
  if (t->mode == ML_MODE_PERMIT) {
    lua_Integer n = luaL_checkinteger(L, 6);
    luaL_argcheck(L, n >= 1 && n <= ML_PERMITS_MAX, 6, "permits must be an integer from 1 to 1000000");
    t->permits = n;
  }
  a->ttl_ms = ml_arg_ttl_ms(L, 7);
  if (!ml_arg_attempt_owner(L, mongoc_uri_get_appname(c->uri), 8, 10, owner_i, a,
                            &t->t)) return 0;
  t->renew = lua_toboolean(L, 9);
  if (t->renew) a->keeper = ml_renew_keeper(L, c, t->keeper);
  a->delay_ms = ml_arg_delay_ms(L, 14);
  return 1;
}

static void build_share(const ml_acquire_attempt *t, ml_op *op) {
  ml_build_share_acquire(op, &t->a, t->mode, t->permits);
}

static int take_share(lua_State *L, ml_client *c, ml_acquire_attempt *t, int ok,
                      const bson_t *reply, const bson_error_t *err) {
  const ml_acquire_args *a = &t->a;
  ml_share_reply r;
  ml_lease_spec s;
  bson_t id;
  int pushed;
  ok = ml_parse_share_acquire(reply, a->owner, t->mode, t->permits, &r) > 0 ? ok : ok ? -1 : 0;

  bson_init(&id);
  bson_append_utf8(&id, "_id", 3, a->name, (int)t->namelen);
  ml_lease_spec_named(&s, t->mode == ML_MODE_PERMIT ? ML_KIND_PERMIT : ML_KIND_SHARED, a->db,
                      a->coll, &id, ML_F_HOLDERS, a->owner, a->ttl_ms);
  s.token = r.token;
  s.started = t->started;
  s.waiter = a->waiter != NULL;
  s.renew = t->renew;
  pushed = ml_push_won(L, c, ok, r.won, &s, err);
  bson_destroy(&id);
  if (pushed) return pushed;
  lua_pushnil(L);
  if (r.mismatch) lua_pushliteral(L, "mismatch");
  else lua_pushliteral(L, "busy");
  push_info(L, &r.value, reply);
  return 3;
}

/* client:share_acquire_attempt(<share_acquire's arguments> [, owner]) -> a
 * mongolock.Attempt (ml_attempt_kind) */
static const ml_attempt_kind share_kind = {"share_acquire", 13, prepare_share, build_share,
                                           take_share};

static int ml_m_share_acquire(lua_State *L) { return ml_attempt_method(L, &share_kind); }
static int ml_m_share_acquire_attempt(lua_State *L) { return ml_attempt_prepare(L, &share_kind); }

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
    bson_t doc;
    if (ml_reply_batch(&reply, &docs, NULL))
      while (ml_batch_next(&docs, &doc)) {
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
  {"share_acquire_attempt", ml_m_share_acquire_attempt},
  {"share_leave", ml_m_share_leave},
  {"share_force_release", ml_m_share_force_release},
  {"share_status", ml_m_share_status},
  {NULL, NULL}
};
