/*
 * mongolock.Lock: the lease on a lock document (a named lock's or a
 * document lock's: its kind), every Lock method, and the one release path.
 *
 * Every command here is built by protocol.c and run by transport.c, one
 * round trip each; every time decision is made by the server ($$NOW); the
 * only local clock read is the monotonic one, for the local deadline.
 *
 * Handle states (mongolock.h, ml_lease): held, lost, not held, closed, read
 * by lease_state and answered alike by every method and kind.  Every way a
 * handle ends (release, close, __close, __gc) goes through lock_end, and
 * the release itself (there and in the renewal thread) is ml_lease_end;
 * closing is idempotent (liolib-style: lease = NULL marks it closed).
 */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "mongolock.h"
#include "protocol_shared.h"

int (*ml_gc_handoff)(ml_client *c, ml_lease *l) = NULL;

/* ---- the lease --------------------------------------------------------- */

void ml_lease_unref(ml_lease *l) {
  int refs;
  pthread_mutex_lock(&l->mu);
  refs = --l->refs;
  pthread_mutex_unlock(&l->mu);
  if (refs > 0) return;
  pthread_mutex_destroy(&l->mu);
  bson_free(l->db);
  bson_free(l->coll);
  bson_free(l->owner_field);
  bson_free(l->time_field);
  bson_destroy(&l->iddoc);
  bson_value_destroy(&l->id);
  bson_free(l);
}

static ml_lease *lease_new(const ml_lease_spec *s) {
  ml_lease *l = (ml_lease *)bson_malloc0(sizeof *l);
  bson_iter_t it;
  pthread_mutex_init(&l->mu, NULL);
  l->db = bson_strdup(s->ref.db);
  l->coll = bson_strdup(s->ref.coll);
  bson_copy_to(s->ref.id, &l->iddoc);
  if (bson_iter_init_find(&it, &l->iddoc, "_id")) bson_value_copy(bson_iter_value(&it), &l->id);
  else l->id.value_type = BSON_TYPE_NULL;
  l->kind = s->kind;
  l->owner_field = bson_strdup(s->ref.owner_field ? s->ref.owner_field : ML_F_OWNER);
  l->time_field = bson_strdup(s->ref.time_field ? s->ref.time_field : ML_F_EXPIRES);
  l->time_mode = s->ref.time_mode;
  l->owner_form = s->ref.owner_form;
  bson_strncpy(l->owner, s->owner, sizeof l->owner);
  l->token = s->token;
  l->pid = getpid();
  l->ttl_ms = s->ttl_ms;
  l->deadline = s->started + (double)(s->grant_ms > 0 && s->grant_ms < s->ttl_ms
                                      ? s->grant_ms : s->ttl_ms) / 1000.0;
  l->held = 1;
  l->renew = s->renew;
  l->refs = 1;
  return l;
}

/* the lock document of l, for the builders */
static void lease_ref(const ml_lease *l, ml_lockref *r) {
  r->db = l->db;
  r->coll = l->coll;
  r->id = &l->iddoc;
  r->owner_field = l->owner_field;
  r->time_field = l->time_field;
  r->time_mode = l->time_mode;
  r->owner_form = l->owner_form;
  r->queued = l->kind == ML_KIND_NAMED;
}

int64_t ml_run_update(mongoc_client_t *mc, const ml_client *c, ml_op *op,
                      bson_error_t *error) {
  bson_t reply;
  int64_t n = -1;
  if (ml_run(mc, c->wc, op, &reply, error)) {
    n = ml_parse_matched(&reply);
    if (n < 0)
      bson_set_error(error, MONGOC_ERROR_PROTOCOL, MONGOC_ERROR_PROTOCOL_INVALID_REPLY,
                     "update reply without matchedCount");
  }
  bson_destroy(&reply);
  ml_op_destroy(op);
  return n;
}

int ml_lease_end(mongoc_client_t *mc, const ml_client *c, ml_lease *l, const bson_t *extra,
                 bson_error_t *error) {
  ml_lockref r;
  ml_op op;
  int64_t n;
  pthread_mutex_lock(&l->mu);
  l->ending = 1;
  pthread_mutex_unlock(&l->mu);
  lease_ref(l, &r);
  if (l->kind == ML_KIND_SHARED || l->kind == ML_KIND_PERMIT)
    ml_build_share_release(&op, l->db, l->coll, &l->iddoc, l->owner);
  else
    ml_build_release(&op, &r, l->owner, extra);
  n = ml_run_update(mc, c, &op, error);
  pthread_mutex_lock(&l->mu);
  if (n >= 0) {
    l->held = 0;
    if (n == 0) l->lost = 1;
  } else {
    l->ending = 0;              /* still held: renewal goes on */
  }
  pthread_mutex_unlock(&l->mu);
  if (n < 0) return -1;
  error->code = 0;
  return n > 0 ? 1 : 0;
}

int ml_lease_extend(mongoc_client_t *mc, const ml_client *c, ml_lease *l,
                    int64_t ttl_ms, double started, bson_error_t *error) {
  ml_lockref r;
  ml_op op;
  int64_t n;
  lease_ref(l, &r);
  if (l->kind == ML_KIND_SHARED || l->kind == ML_KIND_PERMIT)
    ml_build_share_extend(&op, l->db, l->coll, &l->iddoc, l->owner, ttl_ms);
  else
    ml_build_extend(&op, &r, l->owner, ttl_ms);
  n = ml_run_update(mc, c, &op, error);
  if (n < 0) return -1;
  error->code = 0;
  pthread_mutex_lock(&l->mu);
  if (n > 0 && l->held && !l->lost) {
    /* locked-at documents expire at lockTime + the ttl every party uses:
     * the lease length does not change */
    if (l->time_mode == ML_TIME_EXPIRES_AT) l->ttl_ms = ttl_ms;
    l->deadline = started + (double)l->ttl_ms / 1000.0;
    l->topup_at = 0;
  } else if (n == 0 && l->held && !l->ending) {
    /* a release under way or done is not a loss: it cleared the owner */
    l->held = 0;
    l->lost = 1;
  }
  pthread_mutex_unlock(&l->mu);
  return n > 0 ? 1 : 0;
}

/* ---- the handle -------------------------------------------------------- */

ml_lock *ml_checklock(lua_State *L, int idx) {
  return (ml_lock *)luaL_checkudata(L, idx, ML_LOCK_MT);
}

void ml_lease_spec_named(ml_lease_spec *s, ml_kind kind, const char *db, const char *coll,
                         const bson_t *id, const char *owner_field, const char *owner,
                         int64_t ttl_ms) {
  memset(s, 0, sizeof *s);
  ml_named_ref(&s->ref, db, coll, id);
  s->ref.owner_field = owner_field;
  s->ref.queued = kind == ML_KIND_NAMED;
  s->owner = owner;
  s->ttl_ms = ttl_ms;
  s->kind = kind;
}

ml_lock *ml_lock_new(lua_State *L, int client_idx, const ml_lease_spec *spec) {
  ml_lock *h;
  client_idx = lua_absindex(L, client_idx);
  h = (ml_lock *)ml_newuserdata(L, sizeof *h);
  h->lease = NULL;
  h->keep = NULL;
  luaL_getmetatable(L, ML_LOCK_MT);
  lua_setmetatable(L, -2);
  /* uservalue {client}: the client outlives its handles */
  lua_createtable(L, 1, 0);
  lua_pushvalue(L, client_idx);
  lua_rawseti(L, -2, 1);
  ml_setuservalue(L, -2);
  h->lease = lease_new(spec);
  h->keep = h->lease;
  h->keep->refs++;              /* not yet visible to any other thread */
  /* a grant's lease shorter than two thirds of the ttl (what renewal
   * keeps), or one that the waiter's place may have cut short when nothing
   * renews it, is extended to the ttl once, in the background, shortly
   * before it ends: a lock released by then costs no command */
  if (spec->grant_ms > 0 && spec->grant_ms < spec->ttl_ms) {
    double left = h->lease->deadline - ml_monotonic();
    if (left < (double)spec->ttl_ms / 1500.0 || (!spec->renew && spec->grant_bounded)) {
      /* a second before the end, or at a quarter of what is left */
      double before = left * 0.75 < 1.0 ? left * 0.75 : 1.0;
      h->lease->topup_at = h->lease->deadline - (before > 0 ? before : 0);
      if (!spec->renew)
        (void)ml_renew_add(L, (ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT), h->lease);
    }
  }
  /* the lease lives outside Lua's heap, where the collector cannot see it:
   * a step of collector work for it (about its size, in KiB) keeps handles
   * that are garbage from piling up in C memory between cycles */
  lua_gc(L, LUA_GCSTEP, 1);
  /* background renewal (renew.c) takes its own reference */
  if (spec->renew)
    (void)ml_renew_add(L, (ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT), h->lease);
  return h;
}

/* builds the release of the lease s describes, as ml_lease_end does for a
 * handle's (s->ref.queued was set with the spec: ml_lease_spec_named) */
static void spec_release(ml_op *op, const ml_lease_spec *s) {
  if (s->kind == ML_KIND_SHARED || s->kind == ML_KIND_PERMIT)
    ml_build_share_release(op, s->ref.db, s->ref.coll, s->ref.id, s->owner);
  else
    ml_build_release(op, &s->ref, s->owner, NULL);
}

int ml_push_won(lua_State *L, ml_client *c, int ok, int won, const ml_lease_spec *s,
                const bson_error_t *err) {
  if (ok == 0) {
    /* A write concern error comes after the write was applied: if it took
     * the lock, give it back (best effort; the lease ends at ttl anyway)
     * so that a failed acquire leaves no lock held by nobody. */
    if (won) {
      ml_op op;
      bson_error_t err2;
      spec_release(&op, s);
      (void)ml_run_update(ml_client_get(L, c), c, &op, &err2);
    } else if (err->domain == MONGOC_ERROR_STREAM && ml_gc_handoff) {
      /* No reply, even to libmongoc's retry: the write may have been
       * applied, taking the lock under an owner nobody will use again (a
       * try's or a document lock attempt's own, or a waiter's, whose
       * acquire ends with this error).  Its release goes to the background
       * thread, as a collected handle's does (it matches nothing when the
       * write was not applied); the caller does not wait for a server that
       * may be gone. */
      ml_lease *l = lease_new(s);
      if (!ml_gc_handoff(c, l)) ml_lease_unref(l);
    }
    return ml_pusherror(L, err);
  }
  if (ok < 0) return ml_pushfail(L, "findAndModify returned no document", 0);
  if (!won) return 0;
  ml_lock_new(L, 1, s);
  return 1;
}

/* the client of a handle (may be closed); leaves the stack as it was */
static ml_client *lock_client(lua_State *L, int idx) {
  ml_client *c;
  ml_getuservalue(L, idx);
  lua_rawgeti(L, -1, 1);
  c = (ml_client *)luaL_testudata(L, -1, ML_CLIENT_MT);
  lua_pop(L, 2);
  return c;
}

/* a handle's state (mongolock.h, ml_lease): what every method answers */
enum { ST_HELD, ST_LOST, ST_NOT_HELD, ST_CLOSED };
static const char *const state_names[] = {"held", "lost", "not held", "closed"};

/* the state of the handle at idx; *cp its client when not closed */
static int lease_state(lua_State *L, int idx, ml_lock *h, ml_client **cp) {
  ml_lease *l = h->lease;
  ml_client *c = lock_client(L, idx);
  int st;
  if (!l || !c || c->closed) return ST_CLOSED;
  if (cp) *cp = c;
  pthread_mutex_lock(&l->mu);
  if (l->pid != getpid()) {
    st = ST_NOT_HELD;           /* a forked child never acts for its parent */
  } else {
    if (l->held && !l->ending && ml_monotonic() >= l->deadline) {
      l->held = 0;              /* the local deadline passed: lost for good */
      l->lost = 1;
    }
    st = l->lost ? ST_LOST : l->held ? ST_HELD : ST_NOT_HELD;
  }
  pthread_mutex_unlock(&l->mu);
  return st;
}

/* [-0, +3] nil, the state's name; returns 3 */
static int push_state(lua_State *L, int st) {
  return ml_pushfail(L, state_names[st], 0);
}

/*
 * The one way a handle ends: h:release([changes]), h:close(), __close and
 * __gc (which may hand the release to the renewal thread, from_gc).  Sends
 * the release when the lease is held (errors of close and __gc are
 * swallowed: the server frees the lock at the ttl).  Returns the state it
 * ended in: ST_HELD released, ST_LOST, ST_NOT_HELD, ST_CLOSED, or -1 with
 * error set (release only: the lease stays held).
 */
static int lock_end(lua_State *L, int idx, ml_lock *h, const bson_t *extra, int closing,
                    int from_gc, bson_error_t *error) {
  ml_client *c = NULL;
  ml_lease *l = h->lease;
  int st = lease_state(L, idx, h, &c), r = 1;
  if (st == ST_HELD && c->pool && c->pid == getpid()) {
    if (from_gc && ml_gc_handoff && ml_gc_handoff(c, l)) {
      h->lease = NULL;          /* renew.c owns this reference now */
      return ST_HELD;
    }
    r = ml_lease_end(ml_client_get(L, c), c, l, extra, error);
    if (r == 0) st = ST_LOST;
  }
  if (closing && l) {
    if (r < 0) {
      pthread_mutex_lock(&l->mu);
      l->held = 0;              /* not sent: the lease ends at its ttl */
      pthread_mutex_unlock(&l->mu);
    }
    h->lease = NULL;            /* mark closed */
    ml_lease_unref(l);
  }
  return r < 0 ? -1 : st;
}

/*
 * h:release([changes]) -> true | nil, "lost" | nil, "not held" |
 * nil, "closed" | nil, message, code.  changes (document locks only): the
 * application's update, written by the releasing command.
 */
static int l_release(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  bson_t extra = BSON_INITIALIZER;
  bson_error_t err;
  char msg[512];
  int st, has = !lua_isnoneornil(L, 2);
  if (has) {
    luaL_checktype(L, 2, LUA_TTABLE);
    if (h->keep && h->keep->kind != ML_KIND_DOCUMENT)
      return luaL_argerror(L, 2, "a named lock's release takes no changes");
    if (h->lease && !ml_doc_changes(L, 2, h->lease, &extra, msg, sizeof msg)) {
      bson_destroy(&extra);
      return luaL_argerror(L, 2, msg);
    }
  }
  st = lock_end(L, 1, h, has ? &extra : NULL, 0, 0, &err);
  bson_destroy(&extra);
  if (st < 0) return ml_pusherror(L, &err);
  if (st != ST_HELD) return push_state(L, st);
  lua_pushboolean(L, 1);
  return 1;
}

/* the seconds of extend's argument as milliseconds; raises at the caller
 * ("bad argument #1 to 'extend'") unless a positive number up to a year */
static int64_t arg_extend_ttl(lua_State *L) {
  int64_t ms;
  if (lua_type(L, 2) != LUA_TNUMBER)
    luaL_error(L, "bad argument #1 to 'extend' (number expected, got %s)", luaL_typename(L, 2));
  ms = ml_ttl_ms(lua_tonumber(L, 2) * 1000);
  if (ms <= 0)
    luaL_error(L, "bad argument #1 to 'extend' (ttl must be a positive, finite number of "
                  "seconds, at most a year)");
  return ms;
}

/* h:extend([ttl_seconds]) -> true | nil, "lost" | nil, "not held" |
 * nil, "closed" | nil, msg, code */
static int l_extend(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  ml_client *c = NULL;
  bson_error_t err;
  int64_t ttl_ms = lua_isnoneornil(L, 2) ? 0 : arg_extend_ttl(L);
  int st = lease_state(L, 1, h, &c), r;
  if (st != ST_HELD) return push_state(L, st);
  pthread_mutex_lock(&h->lease->mu);
  /* a locked-at document's lease is the ttl every party uses */
  if (ttl_ms && h->lease->time_mode == ML_TIME_LOCKED_AT && ttl_ms != h->lease->ttl_ms) {
    pthread_mutex_unlock(&h->lease->mu);
    return luaL_error(L, "bad argument #1 to 'extend' (ttl is fixed per collection when "
                         "time = \"locked\")");
  }
  if (!ttl_ms) ttl_ms = h->lease->ttl_ms;
  pthread_mutex_unlock(&h->lease->mu);
  r = ml_lease_extend(ml_client_get(L, c), c, h->lease, ttl_ms, ml_monotonic(), &err);
  if (r < 0) return ml_pusherror(L, &err);
  if (r == 0) return push_state(L, ST_LOST);
  lua_pushboolean(L, 1);
  return 1;
}

/* h:remaining() -> seconds left by the local monotonic clock (> 0), or
 * nil, "lost" | "not held" | "closed" */
static int l_remaining(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  int st = lease_state(L, 1, h, NULL);
  double left;
  if (st != ST_HELD) return push_state(L, st);
  pthread_mutex_lock(&h->lease->mu);
  left = h->lease->deadline - ml_monotonic();
  pthread_mutex_unlock(&h->lease->mu);
  lua_pushnumber(L, left > 0 ? left : 0);
  return 1;
}

/* h:held() -> boolean: held by this handle, as far as this process knows */
static int l_held(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  lua_pushboolean(L, lease_state(L, 1, h, NULL) == ST_HELD);
  return 1;
}

/*
 * h:check() -> true | nil, "lost" | nil, "not held" | nil, "closed": may
 * the holder still act under the lock?  No round trip: it reads what the
 * renewal thread and the local deadline say.
 */
static int l_check(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  int st = lease_state(L, 1, h, NULL);
  if (st != ST_HELD) return push_state(L, st);
  lua_pushboolean(L, 1);
  return 1;
}

/*
 * h:lost() -> boolean: the lease can no longer be trusted (a renewal or
 * extend found it gone, a release found it taken, or this process held it
 * past its local deadline).  Once true, always true.
 */
static int l_lost(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  int lost;
  (void)lease_state(L, 1, h, NULL);
  if (!h->keep) {
    lua_pushboolean(L, 0);
    return 1;
  }
  pthread_mutex_lock(&h->keep->mu);
  lost = h->keep->lost;
  pthread_mutex_unlock(&h->keep->mu);
  lua_pushboolean(L, lost);
  return 1;
}

/* h:token_string() -> the fencing token in decimal digits, exact under
 * LuaJIT too (its numbers print 16 significant digits) */
static int l_token_string(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  char buf[32];
  bson_snprintf(buf, sizeof buf, "%lld", (long long)(h->keep ? h->keep->token : 0));
  lua_pushstring(L, buf);
  return 1;
}

/* h:close() -> true: releases if held; afterwards every method answers
 * nil, "closed" */
static int l_close(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  bson_error_t err;
  (void)lock_end(L, 1, h, NULL, 1, 0, &err);
  lua_pushboolean(L, 1);
  return 1;
}

static int l_tclose(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  bson_error_t err;
  (void)lock_end(L, 1, h, NULL, 1, 0, &err);
  return 0;
}

static int l_gc(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  bson_error_t err;
  (void)lock_end(L, 1, h, NULL, 1, 1, &err);
  if (h->keep) {
    ml_lease_unref(h->keep);
    h->keep = NULL;
  }
  return 0;
}

static int l_tostring(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  int st = lease_state(L, 1, h, NULL);
  if (st == ST_CLOSED) lua_pushliteral(L, "mongolock.Lock (closed)");
  else if (h->keep->id.value_type == BSON_TYPE_UTF8)
    lua_pushfstring(L, "mongolock.Lock (%s, %s)", h->keep->id.value.v_utf8.str, state_names[st]);
  else lua_pushfstring(L, "mongolock.Lock (%p, %s)", (void *)h->keep, state_names[st]);
  return 1;
}

/* pushes the lock's _id: a string for named locks; other BSON values as
 * bson.c maps them */
static void push_id(lua_State *L, const ml_lease *l) {
  bson_iter_t it;
  if (bson_iter_init_find(&it, &l->iddoc, "_id")) ml_pushbsonvalue(L, &it);
  else lua_pushnil(L);
}

/*
 * __index: methods first, then the lease's data, readable after close too:
 * name (the _id; also id), token, owner, ttl (seconds), database,
 * collection, renew, kind ("named" | "document").  Unknown keys give nil.
 * Upvalue 1: the methods table.
 */
static int l_index(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  const char *k;
  ml_lease *l = h->keep;
  lua_pushvalue(L, 2);
  lua_rawget(L, lua_upvalueindex(1));
  if (!lua_isnil(L, -1) || lua_type(L, 2) != LUA_TSTRING) return 1;
  lua_pop(L, 1);
  k = lua_tostring(L, 2);
  if (!l) {
    lua_pushnil(L);
    return 1;
  }
  if (!strcmp(k, "name") || !strcmp(k, "id")) push_id(L, l);
  else if (!strcmp(k, "token")) ml_pushint64(L, l->token);
  else if (!strcmp(k, "owner")) lua_pushstring(L, l->owner);
  else if (!strcmp(k, "ttl")) {
    pthread_mutex_lock(&l->mu);
    lua_pushnumber(L, (lua_Number)l->ttl_ms / 1000.0);
    pthread_mutex_unlock(&l->mu);
  } else if (!strcmp(k, "database")) lua_pushstring(L, l->db);
  else if (!strcmp(k, "collection")) lua_pushstring(L, l->coll);
  else if (!strcmp(k, "kind")) {
    static const char *const kinds[] = {"named", "document", "shared", "permit"};
    lua_pushstring(L, kinds[l->kind]);
  }
  else if (!strcmp(k, "renew")) {
    int v;
    pthread_mutex_lock(&l->mu);
    v = l->renew;
    pthread_mutex_unlock(&l->mu);
    lua_pushboolean(L, v);
  } else lua_pushnil(L);
  return 1;
}

/* ---- registration ------------------------------------------------------ */

static const luaL_Reg lock_methods[] = {
  {"release", l_release},
  {"extend", l_extend},
  {"remaining", l_remaining},
  {"held", l_held},
  {"check", l_check},
  {"lost", l_lost},
  {"token_string", l_token_string},
  {"close", l_close},
  {NULL, NULL}
};

static const luaL_Reg lock_meta[] = {
  {"__gc", l_gc},
  {"__close", l_tclose},
  {"__tostring", l_tostring},
  {NULL, NULL}
};

void ml_lock_open(lua_State *L) {
  /* [module] */
  luaL_newmetatable(L, ML_LOCK_MT);              /* [module, mt] */
  luaL_setfuncs(L, lock_meta, 0);
  lua_pushliteral(L, ML_LOCK_MT);
  lua_setfield(L, -2, "__name");
  luaL_newlib(L, lock_methods);                  /* [module, mt, methods] */
  lua_pushcclosure(L, l_index, 1);               /* [module, mt, index] */
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);                                 /* [module] */
}
