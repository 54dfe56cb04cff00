/*
 * The client's commands on named locks (ml_named_methods): acquire
 * and try, status and list, force release, leave, the TTL index.  One lock
 * document per name in one collection (doc/design.md); the commands are
 * built by protocol.c and run by transport.c, one round trip each; a won
 * acquire becomes a mongolock.Lock of kind ML_KIND_NAMED (lock.c).
 */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "sys.h"
#include "args.h"
#include "client.h"
#include "lock.h"
#include "named.h"
#include "ops.h"
#include "renew.h"
#include "stats.h"
#include "attempt.h"

/* [-0, +1|3] runs an update op (and destroys it): pushes true, or nil,
 * none when it matched nothing (none not NULL), or nil, message, code */
int ml_push_update(lua_State *L, ml_client *c, ml_op *op, const char *none) {
  bson_error_t err;
  int64_t n = ml_run_update(ml_client_get(L, c), c, op, &err);
  if (n < 0) return ml_pusherror(L, &err);
  if (n == 0 && none) return ml_pushfail(L, none, 0);
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- the commands ------------------------------------------------------ */

/*
 * client:acquire(db, coll, name, ttl_ms [, app [, renew [, waiter, queue_ms [, polling
 *                [, _, lock_delay_ms]]]]])
 *   -> handle
 *    | nil, "busy", info      info = {owner, token, remaining (s),
 *                                     expires_at, holder, operation_time,
 *                                     queued, position, delay (s left of
 *                                     the name's lock-delay) and
 *                                     delay_until when in one}
 *    | nil, message, code     (server or network error)
 * Without waiter it is a try: it takes a free lock nobody queues for.
 * With waiter (core.waiter_id(), the same for every attempt of one
 * acquire) the attempt takes the lock when it is free and no live watching
 * waiter is queued ahead of it, and otherwise queues waiter (or keeps its
 * place) for queue_ms, marked as polling or watching; position is then its
 * place (1 = first).
 * One findAndModify.  A network error is retried once with the same owner
 * id, so that an attempt the server applied but whose reply was lost is
 * recognised as won instead of leaving the lock held by nobody; an
 * attempt whose retry has no reply either has its release sent in the
 * background (ml_push_won): a try's owner is its own, and a waiter's acquire
 * ends with that error, so nothing else may hold the lock under its id.
 */
/* campaign: client:campaign's arguments (value in polling's place) */
static int prepare_named(lua_State *L, ml_client *c, ml_acquire_attempt *t, int owner_i,
                         int campaign) {
  ml_acquire_args *a = &t->a;
  ml_arg_ns(L, 2, &a->db, &a->coll);
  a->name = ml_arg_name(L, 4, &t->namelen);
  a->ttl_ms = ml_arg_ttl_ms(L, 5);
  if (campaign) {
    size_t vlen;
    const char *msg;
    a->value = ml_arg_string(L, 10, &vlen);      /* a string, not a number */
    if ((msg = ml_check_value(a->value, vlen)) != NULL) luaL_argerror(L, 10, msg);
  }
  if (!ml_arg_attempt_owner(L, mongoc_uri_get_appname(c->uri), 6, 8, owner_i, a,
                            &t->t)) return 0;
  /* a campaigner is never granted the lock by a release (which would not
   * publish its value): its queue entry says it polls, and it takes a lock
   * that was freed by an attempt of its own, woken by the release's event */
  if (campaign && a->waiter) a->polling = 1;
  t->renew = lua_toboolean(L, 7);
  if (t->renew) a->keeper = ml_renew_keeper(L, c, t->keeper);
  a->delay_ms = ml_arg_delay_ms(L, 12);
  return 1;
}

static int prepare_acquire(lua_State *L, ml_client *c, ml_acquire_attempt *t, int owner_i) {
  return prepare_named(L, c, t, owner_i, 0);
}

static int prepare_campaign(lua_State *L, ml_client *c, ml_acquire_attempt *t, int owner_i) {
  return prepare_named(L, c, t, owner_i, 1);
}

static void build_named(const ml_acquire_attempt *t, ml_op *op) {
  ml_build_acquire(op, &t->a);
}

static int take_named(lua_State *L, ml_client *c, ml_acquire_attempt *t, int ok,
                      const bson_t *reply, const bson_error_t *err) {
  const ml_acquire_args *a = &t->a;
  ml_acquire_reply r;
  ml_lease_spec s;
  bson_t id;
  int pushed;
  ok = ml_parse_acquire(reply, a->owner, ML_F_OWNER, ML_OWNER_HEX, 0, &r) > 0 ? ok : ok ? -1 : 0;

  bson_init(&id);
  bson_append_utf8(&id, "_id", 3, a->name, (int)t->namelen);
  ml_lease_spec_named(&s, ML_KIND_NAMED, a->db, a->coll, &id, ML_F_OWNER, a->owner, a->ttl_ms);
  s.token = r.token;
  s.started = t->started;
  s.waiter = a->waiter != NULL;
  /* won by a grant this attempt found: the lease the server has left */
  if (r.won && r.has_remaining && r.remaining_ms < a->ttl_ms) {
    s.grant_ms = r.remaining_ms;
    s.grant_bounded = a->waiter != NULL && a->queue_ms < a->ttl_ms;
  }
  s.renew = t->renew;
  if (ok > 0) (void)ml_parse_operation_time(reply, &s.op_t, &s.op_i);
  pushed = ml_push_won(L, c, ok, r.won, &s, err);
  bson_destroy(&id);
  if (pushed) return pushed;
  lua_pushnil(L);
  lua_pushliteral(L, "busy");
  ml_push_acquire_info(L, &r, reply);
  return 3;
}

/* client:acquire_attempt(<acquire's arguments> [, owner]) -> a
 * mongolock.Attempt (ml_attempt_kind); owner: 32 lowercase hex digits
 * (a waiter's must be its id), else a new one */
static const ml_attempt_kind acquire_kind = {"acquire", 11, prepare_acquire, build_named,
                                             take_named};

static int ml_m_acquire(lua_State *L) { return ml_attempt_method(L, &acquire_kind); }
static int ml_m_acquire_attempt(lua_State *L) { return ml_attempt_prepare(L, &acquire_kind); }

/*
 * client:campaign(db, coll, name, ttl_ms, app, renew, waiter, queue_ms, value)
 *   -> acquire's answers
 * An election's attempt: acquire's, with value (a string, ml_check_value)
 * in polling's place, published in the lock document by the attempt that
 * takes the lock (ML_F_VALUE, its term in ML_F_VTOKEN).  Its waiter is
 * always marked polling, so that no release grants it the lock without
 * its value.  client:campaign_attempt(<campaign's arguments> [, owner])
 * is its mongolock.Attempt, as acquire_attempt is acquire's.
 */
static const ml_attempt_kind campaign_kind = {"campaign", 11, prepare_campaign, build_named,
                                              take_named};

static int ml_m_campaign(lua_State *L) { return ml_attempt_method(L, &campaign_kind); }
static int ml_m_campaign_attempt(lua_State *L) { return ml_attempt_prepare(L, &campaign_kind); }

/*
 * Runs a status op and pushes an array of status tables: one command when
 * the result fits the first batch.  Returns 1 (the array pushed) or 3
 * (error).
 */
static int run_status(lua_State *L, ml_client *c, ml_op *op) {
  bson_t reply;
  bson_error_t err;
  int ok;
  ml_obs_command(c);
  ok = ml_run(ml_client_get(L, c), c->wc, op, &reply, &err);
  ml_op_destroy(op);
  if (!ok) {
    bson_destroy(&reply);
    return ml_pusherror(L, &err);
  }
  ml_push_status_list(L, &reply);
  bson_destroy(&reply);
  return 1;
}

/* client:status(db, coll, name) -> status | nil (no such lock) |
 * nil, message, code.  One aggregate. */
static int ml_m_status(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll, *name;
  ml_op op;
  int r;
  name = ml_arg_lock(L, &db, &coll);
  ml_build_status(&op, db, coll, name);
  r = run_status(L, c, &op);
  if (r != 1) return r;
  lua_rawgeti(L, -1, 1);
  return 1;
}

/* client:list(db, coll) -> {status, ...} sorted by name | nil, msg, code */
static int ml_m_list(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll;
  ml_op op;
  ml_arg_ns(L, 2, &db, &coll);
  ml_build_status(&op, db, coll, NULL);
  return run_status(L, c, &op);
}

/* client:force_release(db, coll, name) -> true | nil, "not held" |
 * nil, msg, code.  Frees the lock whoever holds it (one update; the
 * document and its token stay). */
static int ml_m_force_release(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll, *name;
  ml_op op;
  name = ml_arg_lock(L, &db, &coll);
  ml_build_force_release(&op, db, coll, name);
  return ml_push_update(L, c, &op, "not held");
}

/*
 * client:granted(db, coll, name, waiter, ttl_ms, queue_ms, token, started
 *                [, renew]) -> handle
 * The lock a release granted to waiter (core.watch_wait answered
 * "granted"), made without a command.  The release took place after the
 * waiter's latest attempt, which began at the local monotonic time
 * started and set its entry's until to the server's now + queue_ms (every
 * failed attempt of a waiter sets it anew); the grant's lease ends at
 * min(release + ttl, until), so started + min(ttl_ms, queue_ms) is never
 * later than the server's lease end.  (The event's expiresAt - acquiredAt
 * would be a worse bound: it drops the time between the attempt and the
 * release, which can be most of queue_ms/2.)
 */
static int64_t arg_token(lua_State *L, int i) {
  lua_Number n = luaL_checknumber(L, i);
  luaL_argcheck(L, n > 0 && n < 9007199254740992.0 && n == floor(n), i, "bad token");
  return (int64_t)n;
}

static int ml_m_granted(lua_State *L) {
  size_t namelen;
  const char *db, *coll, *name, *w;
  int64_t ttl_ms, queue_ms, grant, token;
  double started;
  ml_lease_spec s;
  bson_t id;
  (void)ml_checkclient(L, 1);
  ml_arg_ns(L, 2, &db, &coll);
  name = ml_arg_name(L, 4, &namelen);
  w = ml_arg_waiter(L, 5);
  ttl_ms = ml_arg_ttl_ms(L, 6);
  queue_ms = ml_arg_ttl_ms(L, 7);
  grant = queue_ms < ttl_ms ? queue_ms : ttl_ms;
  token = arg_token(L, 8);
  started = ml_arg_started(L, 9);
  bson_init(&id);       /* after the arguments: it may allocate */
  bson_append_utf8(&id, "_id", 3, name, (int)namelen);
  ml_lease_spec_named(&s, ML_KIND_NAMED, db, coll, &id, ML_F_OWNER, w, ttl_ms);
  s.token = token;
  s.started = started;
  s.grant_ms = grant;
  s.grant_bounded = queue_ms < ttl_ms;
  s.renew = lua_toboolean(L, 10);
  ml_lock_new(L, 1, &s);
  bson_destroy(&id);
  return 1;
}

/*
 * client:leave(db, coll, name, waiter) -> true | nil, msg, code.  An
 * acquire that gives up (timeout, error) takes its place out of the queue;
 * when a release had already granted it the lock (or been handed to it),
 * the next live waiter gets it instead (a grant, which wakes that waiter).
 * One update; nothing changes when waiter is neither queued nor the owner.
 * ml_push_leave: the same for any queue, built by `build` (client:share_leave
 * leaves squeue with ml_build_share_leave).
 */
int ml_push_leave(lua_State *L, ml_leave_builder build) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll, *name = ml_arg_lock(L, &db, &coll), *w = ml_arg_waiter(L, 5);
  char tag[17];
  ml_op op;
  if (!ml_process_tag(tag)) return ml_pushfail(L, "getrandom failed", 0);
  build(&op, db, coll, name, w, tag);
  return ml_push_update(L, c, &op, NULL);
}

static int ml_m_leave(lua_State *L) {
  return ml_push_leave(L, ml_build_leave);
}

/* client:ensure_index(db, coll, expire_after_seconds) -> true |
 * nil, msg, code.  The TTL index on expiresAt (cleanup of idle documents
 * only; correctness never depends on it). */
static int ml_m_ensure_index(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db, *coll;
  lua_Integer secs;
  bson_t reply;
  bson_error_t err;
  ml_op op;
  int ok;
  ml_arg_ns(L, 2, &db, &coll);
  secs = luaL_checkinteger(L, 4);
  luaL_argcheck(L, secs >= 0 && secs <= INT32_MAX, 4, "expire_after out of range");
  ml_build_ensure_index(&op, db, coll, (int32_t)secs);
  ml_obs_command(c);
  ok = ml_run(ml_client_get(L, c), c->wc, &op, &reply, &err);
  ml_op_destroy(&op);
  bson_destroy(&reply);
  if (!ok) return ml_pusherror(L, &err);
  lua_pushboolean(L, 1);
  return 1;
}

/* Client methods: named locks (client:acquire, status, list, ...) (module.c adds them to mongolock.Client) */
const luaL_Reg ml_named_methods[] = {
  {"acquire", ml_m_acquire},
  {"acquire_attempt", ml_m_acquire_attempt},
  {"campaign", ml_m_campaign},
  {"campaign_attempt", ml_m_campaign_attempt},
  {"status", ml_m_status},
  {"list", ml_m_list},
  {"force_release", ml_m_force_release},
  {"leave", ml_m_leave},
  {"granted", ml_m_granted},
  {"ensure_index", ml_m_ensure_index},
  {NULL, NULL}
};
