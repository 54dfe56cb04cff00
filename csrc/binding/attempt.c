/*
 * mongolock.Attempt: one acquire attempt of any kind (attempt.h,
 * ml_acquire_attempt), prepared, its op built, its outcome taken, with each
 * kind's own table of functions (ml_attempt_kind: named.c's acquire and
 * campaign, shared.c's share_acquire, documents.c's doc_acquire).  The one
 * runner of the plain methods (the round trip on this thread) is here, and
 * the userdata through which a transport that runs the op elsewhere (an
 * nginx worker thread, a coroutine scheduler's pool: mongolock.yielding)
 * finishes the attempt with the same tail.
 *
 * May include: attempt.h, args.h, client.h, stats.h (the command
 * counter), lease.h (the clock), protocol.h and transport.h; it calls the
 * kinds only through their tables.
 */
#include <string.h>

#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "args.h"
#include "client.h"
#include "stats.h"
#include "attempt.h"

#define ML_ATTEMPT_MT "mongolock.Attempt"

static const char *const state_names[] = {"prepared", "sent", "taken"};

/* gives back what t holds; idempotent */
static void attempt_free(ml_acquire_attempt *t) {
  if (t->id) bson_destroy(t->id);
  if (t->insert) bson_destroy(t->insert);
  t->id = t->insert = NULL;
  t->ref.id = NULL;
}

/* [-0, +n] the kind's tail on an outcome (reply destroyed here), then
 * what t holds given back */
static int attempt_take(lua_State *L, ml_client *c, ml_acquire_attempt *t, int ok, bson_t *reply,
                        bson_error_t *err) {
  int n;
  t->state = ML_ATTEMPT_TAKEN;
  n = t->kind->take(L, c, t, ok, reply, err);
  bson_destroy(reply);
  attempt_free(t);
  return n;
}

/* fills t for kind k from the arguments; 0 (nothing held) when getrandom
 * failed */
static int attempt_fill(lua_State *L, ml_client *c, const ml_attempt_kind *k,
                        ml_acquire_attempt *t, int owner_i) {
  memset(t, 0, sizeof *t);
  t->kind = k;
  if (k->prepare(L, c, t, owner_i)) return 1;
  attempt_free(t);
  return 0;
}

int ml_attempt_method(lua_State *L, const ml_attempt_kind *k) {
  ml_client *c = ml_checkclient(L, 1);
  ml_acquire_attempt t;
  mongoc_client_t *mc;
  bson_t reply;
  bson_error_t err;
  ml_op op;
  int ok;
  if (!attempt_fill(L, c, k, &t, 0)) return ml_pushfail(L, "getrandom failed", 0);
  mc = ml_client_get(L, c);
  k->build(&t, &op);
  t.state = ML_ATTEMPT_SENT;
  t.started = ml_monotonic();
  ml_obs_command(c);
  ok = ml_run(mc, c->wc, &op, &reply, &err);
  ml_op_destroy(&op);
  return attempt_take(L, c, &t, ok, &reply, &err);
}

/* ---- the userdata ------------------------------------------------------ */

static ml_acquire_attempt *check_attempt(lua_State *L, int i) {
  return (ml_acquire_attempt *)luaL_checkudata(L, i, ML_ATTEMPT_MT);
}

/* builds t's op into op (destroy it): t is sent from now, its started
 * time now; raises unless t is prepared */
static void attempt_send(lua_State *L, ml_acquire_attempt *t, ml_op *op) {
  if (t->state != ML_ATTEMPT_PREPARED)
    luaL_error(L, "the attempt is %s already: one op per attempt", state_names[t->state]);
  t->kind->build(t, op);
  t->state = ML_ATTEMPT_SENT;
  t->started = ml_monotonic();
}

/* a:op() -> op (the envelope).  From now on the attempt is sent: its
 * started time is now, just before the caller hands the op on. */
static int l_op(lua_State *L) {
  ml_op op;
  attempt_send(L, check_attempt(L, 1), &op);
  ml_push_op(L, &op);
  ml_op_destroy(&op);
  return 1;
}

int ml_attempt_envelope(lua_State *L, int i, bson_t *env) {
  ml_acquire_attempt *t = (ml_acquire_attempt *)luaL_testudata(L, i, ML_ATTEMPT_MT);
  ml_op op;
  if (!t) return 0;
  attempt_send(L, t, &op);
  ml_op_envelope(&op, env);
  ml_op_destroy(&op);
  return 1;
}

void ml_attempt_unsend(lua_State *L, int i) {
  ml_acquire_attempt *t = (ml_acquire_attempt *)luaL_testudata(L, i, ML_ATTEMPT_MT);
  if (t && t->state == ML_ATTEMPT_SENT) t->state = ML_ATTEMPT_PREPARED;
}

void ml_attempt_own_reply(lua_State *L, int i, int r) {
  if (!luaL_testudata(L, i, ML_ATTEMPT_MT)) return;
  ml_getuservalue(L, i);
  lua_pushvalue(L, r);
  lua_setfield(L, -2, "reply");
  lua_pop(L, 1);
}

/* a:sent() -> true once its op was handed on (a:op(), pool:here), until
 * it was taken; false while it is prepared (nothing of it was sent) */
static int l_sent(lua_State *L) {
  lua_pushboolean(L, check_attempt(L, 1)->state == ML_ATTEMPT_SENT);
  return 1;
}

/* a:take(reply, message, code, ereply, domain) -> the plain method's
 * answers: the op's outcome as client:run answers it (ml_arg_outcome),
 * taken once, on the attempt's client (which must be open) */
static int l_take(lua_State *L) {
  ml_acquire_attempt *t = check_attempt(L, 1);
  ml_client *c;
  bson_t reply;
  bson_error_t err;
  int ok, own;
  if (t->state != ML_ATTEMPT_SENT)
    return luaL_error(L, t->state == ML_ATTEMPT_TAKEN ? "the attempt was taken already"
                                                      : "the attempt was not sent (a:op() first)");
  lua_settop(L, 6);
  /* a reply that pool:here made for this attempt was well formed when
   * made (ml_attempt_own_reply): not walked again */
  ml_getuservalue(L, 1);
  lua_getfield(L, -1, "reply");
  own = lua_type(L, 2) == LUA_TSTRING && lua_rawequal(L, -1, 2);
  lua_pop(L, 2);
  /* [client, reply, message, code, ereply, domain, attempt]: the tails
   * make handles of the client at 1; the attempt stays anchored */
  lua_pushvalue(L, 1);
  ml_getuservalue(L, 1);
  lua_rawgeti(L, -1, 1);
  lua_replace(L, 1);
  lua_pop(L, 1);
  c = ml_checkclient(L, 1);
  /* raises when malformed, before it copies anything: the attempt stays
   * sent, to be taken again */
  ok = ml_arg_outcome_own(L, 2, &reply, &err, own);
  return attempt_take(L, c, t, ok, &reply, &err);
}

/* a:owner() -> the owner id its op writes (32 hex digits) */
static int l_owner(lua_State *L) {
  lua_pushstring(L, check_attempt(L, 1)->t.owner);
  return 1;
}

static int l_gc(lua_State *L) {
  attempt_free(check_attempt(L, 1));
  return 0;
}

static int l_tostring(lua_State *L) {
  ml_acquire_attempt *t = check_attempt(L, 1);
  lua_pushfstring(L, ML_ATTEMPT_MT " (%s, %s)", t->kind->name, state_names[t->state]);
  return 1;
}

static const luaL_Reg attempt_methods[] = {
  {"op", l_op},
  {"take", l_take},
  {"owner", l_owner},
  {"sent", l_sent},
  {NULL, NULL}
};

/* [-0, +1] the metatable, made on first use in this Lua state */
static void push_metatable(lua_State *L) {
  if (!luaL_newmetatable(L, ML_ATTEMPT_MT)) return;
  lua_pushcfunction(L, l_gc);
  lua_setfield(L, -2, "__gc");
  lua_pushcfunction(L, l_tostring);
  lua_setfield(L, -2, "__tostring");
  lua_pushliteral(L, ML_ATTEMPT_MT);
  lua_setfield(L, -2, "__name");
  luaL_newlib(L, attempt_methods);
  lua_setfield(L, -2, "__index");
}

/* a's strings point into the struct it was filled in: moved, they point
 * into the new one */
static void attempt_move(ml_acquire_attempt *to, const ml_acquire_attempt *from) {
  *to = *from;
  if (from->a.owner) to->a.owner = to->t.owner;
  if (from->a.host) to->a.host = to->t.host;
  if (from->a.tag) to->a.tag = to->t.tag;
  if (from->a.htag) to->a.htag = to->t.tag;
  if (from->a.keeper) to->a.keeper = to->keeper;
}

void ml_attempt_open(lua_State *L) {
  push_metatable(L);
  lua_pop(L, 1);
}

int ml_attempt_prepare(lua_State *L, const ml_attempt_kind *k) {
  ml_client *c = ml_checkclient(L, 1);
  int i, n = lua_gettop(L);
  ml_acquire_attempt t, *u;
  if (!attempt_fill(L, c, k, &t, k->owner_i)) return ml_pushfail(L, "getrandom failed", 0);
  /* the owned bsons are taken over at once: the allocations below raise
   * only when memory is out */
  u = (ml_acquire_attempt *)ml_newuserdata(L, sizeof *u);
  attempt_move(u, &t);
  push_metatable(L);
  lua_setmetatable(L, -2);
  /* uservalue {client, the arguments}: the client outlives the attempt,
   * and the strings its fields point into stay */
  lua_createtable(L, n, 0);
  for (i = 1; i <= n; i++) {
    lua_pushvalue(L, i);
    lua_rawseti(L, -2, i);
  }
  ml_setuservalue(L, -2);
  return 1;
}
