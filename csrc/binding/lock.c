/*
 * mongolock.Lock: the lease on a lock document (a named lock's or a
 * document lock's: its kind), every Lock method, and the one release path.
 *
 * Every command here is built by protocol.c and run by transport.c, one
 * round trip each; every time decision is made by the server ($$NOW); the
 * only local clock read is the monotonic one, for the local deadline.
 *
 * Handle states (lease.h, ml_lease): held, lost, not held, closed, read
 * by lease_state and answered alike by every method and kind.  Every way a
 * handle ends (release, close, __close, __gc) goes through lock_end, and
 * the release itself (there and in the renewal thread) is ml_lease_end;
 * closing is idempotent (liolib-style: lease = NULL marks it closed).
 * The lease itself, its commands and its state changes are lease.c's: this
 * file runs them.
 */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "compat.h"
#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "bson_lua.h"
#include "args.h"
#include "client.h"
#include "lock.h"
#include "renew.h"
#include "watch.h"
#include "protocol_shared.h"
#include "stats.h"

int (*ml_gc_handoff)(ml_client *c, ml_lease *l) = NULL;

/* ---- the lease's commands, run (lease.c builds them) ----------------- */

int64_t ml_run_update(mongoc_client_t *mc, const ml_client *c, ml_op *op,
                      bson_error_t *error) {
  bson_t reply;
  int64_t n = -1;
  ml_obs_command(c);
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
  ml_op op;
  bson_t reply;
  int64_t n;
  int ok;
  ml_lease_release_op(l, extra, &op);
  ml_obs_command(c);
  ok = ml_run(mc, c->wc, &op, &reply, error);
  ml_op_destroy(&op);
  n = ml_release_matched(ok, &reply);
  if (ok && n < 0)
    bson_set_error(error, MONGOC_ERROR_PROTOCOL, MONGOC_ERROR_PROTOCOL_INVALID_REPLY,
                   "update reply without matchedCount");
  bson_destroy(&reply);
  if (n >= 0) error->code = 0;
  return ml_lease_release_done(l, n);
}

int ml_lease_extend(mongoc_client_t *mc, const ml_client *c, ml_lease *l,
                    int64_t ttl_ms, double started, bson_error_t *error) {
  ml_op op;
  int64_t n;
  ml_lease_extend_op(l, ttl_ms, &op);
  n = ml_run_update(mc, c, &op, error);
  if (n >= 0) error->code = 0;
  return ml_lease_extend_done(l, n, ttl_ms, started);
}

/* ---- the handle -------------------------------------------------------- */

ml_lock *ml_checklock(lua_State *L, int idx) {
  return (ml_lock *)luaL_checkudata(L, idx, ML_LOCK_MT);
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
  h->lease = ml_lease_new(spec);
  h->lease->obs = ml_obs_ref(((ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT))->obs);
  h->keep = h->lease;
  h->keep->refs++;              /* not yet visible to any other thread */
  ml_held_link((ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT), h->lease);
  /* told at once when a takeover, a forced release or a delete ends it:
   * through a stream the external adapter runs already (nginx); elsewhere
   * the client's thread asks for it once the lease is ML_HOLD_AFTER old */
  {
    ml_client *c = (ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT);
    if (spec->kind == ML_KIND_NAMED && c->external) ml_watch_hold(c, NULL, h->lease);
    else if (spec->kind == ML_KIND_NAMED) ml_renew_hold(L, c, h->lease);
  }
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
   * counted as 1 KiB allocated (about its size), it keeps handles that are
   * garbage from piling up in C memory between Lua 5.4's cycles.  Lua 5.1's
   * and LuaJIT's step does not count: it runs steps at once, ending the
   * collector's pause (it never rested: 5% of a LuaJIT lock cycle's
   * instructions, 6.5% in nginx) and restarting a stopped one; without it
   * their handles do not pile up (bench/mem.lua) */
#if LUA_VERSION_NUM >= 502
  if (lua_gc(L, LUA_GCISRUNNING, 0)) lua_gc(L, LUA_GCSTEP, 1);
#endif
  /* background renewal (renew.c) takes its own reference */
  if (spec->renew)
    (void)ml_renew_add(L, (ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT), h->lease);
  return h;
}

int ml_push_won(lua_State *L, ml_client *c, int ok, int won, const ml_lease_spec *s,
                const bson_error_t *err) {
  if (ok == 0) {
    /* A write concern error comes after the write was applied: if it took
     * the lock, give it back (best effort; the lease ends at ttl anyway)
     * so that a failed acquire leaves no lock held by nobody. */
    if (won) {
      ml_op op;
      bson_t reply;
      bson_error_t err2;
      int64_t n;
      ml_lease_spec_release_op(s, &op);
      ml_obs_command(c);
      n = ml_release_matched(ml_run(ml_client_get(L, c), c->wc, &op, &reply, &err2), &reply);
      ml_op_destroy(&op);
      bson_destroy(&reply);
      if (n < 0) {
        /* the name stays taken under an owner nobody holds: say so */
        lua_pushnil(L);
        lua_pushfstring(L, "%s; giving back the lock it took failed too (%s): the name stays blocked "
                           "until its ttl", err->message, err2.message);
        lua_pushinteger(L, (lua_Integer)err->code);
        return 3;
      }
    } else if (err->domain == MONGOC_ERROR_STREAM && ml_gc_handoff && !s->waiter) {
      /* No reply, even to libmongoc's retry: the write may have been
       * applied, taking the lock under an owner nobody will use again (a
       * try's or a document lock attempt's own, or a waiter's, whose
       * acquire ends with this error).  Its release goes to the background
       * thread, as a collected handle's does (it matches nothing when the
       * write was not applied), and is sent again until answered twice
       * (lease.redo: the write may land after the first); the caller does
       * not wait for a server that may be gone. */
      ml_lease *l = ml_lease_new(s);
      if (l) l->redo = ML_RELEASE_REDO;   /* the write may land after it */
      if (l && !ml_gc_handoff(c, l)) ml_lease_unref(l);
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

/* a handle's state (lease.h, ml_lease): what every method answers */
enum { ML_HANDLE_HELD, ML_HANDLE_LOST, ML_HANDLE_NOT_HELD, ML_HANDLE_CLOSED };
static const char *const state_names[] = {"held", "lost", "not held", "closed"};

/* the state of the handle at idx; *cp its client when not closed */
static int lease_state(lua_State *L, int idx, ml_lock *h, ml_client **cp) {
  ml_lease *l = h->lease;
  ml_client *c = lock_client(L, idx);
  int st;
  if (!l || !c || c->closed) return ML_HANDLE_CLOSED;
  if (cp) *cp = c;
  ml_lease_lock(l);
  if (l->pid != ml_pid()) {
    st = ML_HANDLE_NOT_HELD;           /* a forked child never acts for its parent */
  } else {
    if (l->held && !l->ending && ml_monotonic() >= l->deadline) {
      ml_lease_set_lost(l);     /* the local deadline passed: lost for good */
    }
    st = l->lost ? ML_HANDLE_LOST : l->held ? ML_HANDLE_HELD : ML_HANDLE_NOT_HELD;
  }
  ml_lease_unlock(l);
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
 * ended in: ML_HANDLE_HELD released, ML_HANDLE_LOST, ML_HANDLE_NOT_HELD,
 * ML_HANDLE_CLOSED, or -1 with error set (release only: the lease stays
 * held).
 */
static int lock_end(lua_State *L, int idx, ml_lock *h, const bson_t *extra, int closing,
                    int from_gc, bson_error_t *error) {
  ml_client *c = NULL;
  ml_lease *l = h->lease;
  int st = lease_state(L, idx, h, &c), r = 1;
  if (st == ML_HANDLE_HELD && ((c->pool && c->pid == ml_pid()) || c->external)) {
    if (from_gc && ml_gc_handoff && ml_gc_handoff(c, l)) {
      h->lease = NULL;          /* renew.c owns this reference now */
      return ML_HANDLE_HELD;
    }
    r = ml_lease_end(ml_client_get(L, c), c, l, extra, error);
    if (r == 0) st = ML_HANDLE_LOST;
  }
  if (closing && l) {
    if (r < 0) {
      ml_lease_lock(l);
      l->held = 0;              /* not sent: the lease ends at its ttl */
      ml_lease_unlock(l);
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
/* h:release's changes at idx (nil: none) into *extra (initialised by the
 * caller); returns whether there are any.  Raises at the caller as
 * "bad argument #1 to 'release'" (a named lock's release takes none). */
static int release_changes(lua_State *L, ml_lock *h, int idx, bson_t *extra) {
  char msg[512];
  if (lua_isnoneornil(L, idx)) return 0;
  if (lua_type(L, idx) != LUA_TTABLE)
    luaL_error(L, "bad argument #1 to 'release' (table expected, got %s)", luaL_typename(L, idx));
  if (h->keep && !ml_kind_of(h->keep->kind)->changes)
    luaL_error(L, "bad argument #1 to 'release' (a named lock's release takes no changes)");
  if (h->lease && !ml_doc_changes(L, idx, h->lease, extra, msg, sizeof msg)) {
    bson_destroy(extra);
    luaL_error(L, "bad argument #1 to 'release' (%s)", msg);
  }
  return 1;
}

static int l_release(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  bson_t extra = BSON_INITIALIZER;
  bson_error_t err;
  int st, has = release_changes(L, h, 2, &extra);
  st = lock_end(L, 1, h, has ? &extra : NULL, 0, 0, &err);
  bson_destroy(&extra);
  if (st < 0) return ml_pusherror(L, &err);
  if (st != ML_HANDLE_HELD) return push_state(L, st);
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
/* the ttl of h:extend(ttl) (argument 2, nil: the lease's own) for a held
 * lease, remembered for core.lease_done; raises at the caller when a
 * locked-at document's would change */
static int64_t extend_ttl(lua_State *L, ml_lock *h, int64_t ttl_ms) {
  ml_lease_lock(h->lease);
  /* a locked-at document's lease is the ttl every party uses */
  if (ttl_ms && h->lease->time_mode == ML_TIME_LOCKED_AT && ttl_ms != h->lease->ttl_ms) {
    ml_lease_unlock(h->lease);
    luaL_error(L, "bad argument #1 to 'extend' (ttl is fixed per collection when "
                  "time = \"locked\")");
  }
  if (!ttl_ms) ttl_ms = h->lease->ttl_ms;
  h->lease->step_ttl = ttl_ms;
  ml_lease_unlock(h->lease);
  return ttl_ms;
}

static int l_extend(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  ml_client *c = NULL;
  bson_error_t err;
  int64_t ttl_ms = lua_isnoneornil(L, 2) ? 0 : arg_extend_ttl(L);
  int st = lease_state(L, 1, h, &c), r;
  if (st != ML_HANDLE_HELD) return push_state(L, st);
  ttl_ms = extend_ttl(L, h, ttl_ms);
  r = ml_lease_extend(ml_client_get(L, c), c, h->lease, ttl_ms, ml_monotonic(), &err);
  if (r < 0) return ml_pusherror(L, &err);
  if (r == 0) return push_state(L, ML_HANDLE_LOST);
  lua_pushboolean(L, 1);
  return 1;
}

/* h:remaining() -> seconds left by the local monotonic clock (> 0), or
 * nil, "lost" | "not held" | "closed" */
static int l_remaining(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  int st = lease_state(L, 1, h, NULL);
  double left;
  if (st != ML_HANDLE_HELD) return push_state(L, st);
  ml_lease_lock(h->lease);
  left = h->lease->deadline - ml_monotonic();
  ml_lease_unlock(h->lease);
  lua_pushnumber(L, left > 0 ? left : 0);
  return 1;
}

/* h:held() -> boolean: held by this handle, as far as this process knows */
static int l_held(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  lua_pushboolean(L, lease_state(L, 1, h, NULL) == ML_HANDLE_HELD);
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
  if (st != ML_HANDLE_HELD) return push_state(L, st);
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
  ml_lease_lock(h->keep);
  lost = h->keep->lost;
  ml_lease_unlock(h->keep);
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
    ml_held_unlink(h->keep);    /* the list holds no reference of its own */
    ml_lease_unref(h->keep);
    h->keep = NULL;
  }
  return 0;
}

static int l_tostring(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  int st = lease_state(L, 1, h, NULL);
  if (st == ML_HANDLE_CLOSED) lua_pushliteral(L, "mongolock.Lock (closed)");
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
static int any_methods;        /* client:set_methods was ever called */
#define ML_METHODS_KEY "mongolock.Lock.methods"

/* [-0, +1] the methods set for the client of the handle at 1 (set_methods)
 * under key 2, or nil */
static void push_override(lua_State *L) {
  lua_pushnil(L);
  if (!any_methods) return;
  lua_pop(L, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, ML_METHODS_KEY);   /* [t] */
  ml_getuservalue(L, 1);                                /* [t, uv] */
  lua_rawgeti(L, -1, 1);                                /* [t, uv, client] */
  lua_rawget(L, -3);                                    /* [t, uv, methods] */
  if (lua_istable(L, -1)) {
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);                                  /* [t, uv, methods, m] */
    lua_replace(L, -4);
    lua_pop(L, 2);
    return;
  }
  lua_pop(L, 3);
  lua_pushnil(L);
}

static int l_index(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  const char *k;
  ml_lease *l = h->keep;
  push_override(L);
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 1);
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
    ml_lease_lock(l);
    lua_pushnumber(L, (lua_Number)l->ttl_ms / 1000.0);
    ml_lease_unlock(l);
  } else if (!strcmp(k, "database")) lua_pushstring(L, l->db);
  else if (!strcmp(k, "collection")) lua_pushstring(L, l->coll);
  else if (!strcmp(k, "kind")) {
    lua_pushstring(L, ml_kind_of(l->kind)->name);
  }
  else if (!strcmp(k, "renew")) {
    int v;
    ml_lease_lock(l);
    v = l->renew;
    ml_lease_unlock(l);
    lua_pushboolean(L, v);
  } else lua_pushnil(L);
  return 1;
}

/* ---- the steps of a method, for a transport that runs them elsewhere --- */

/*
 * core.lease_step(h, what [, arg]) -> op, started | nil, state | true
 * The command of h:release([changes]) (what "release"), h:extend([ttl])
 * ("extend") or h:close() ("close"), as a BSON op string (ops.c) and the
 * monotonic time it is handed out at; nil and the state's name when the
 * method answers without a command; true for a close with nothing to send
 * (the handle is closed then).  core.lease_done takes the outcome.
 */
static int l_lease_step(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  const char *what = luaL_checkstring(L, 2);
  ml_client *c = NULL;
  int st = lease_state(L, 1, h, &c);
  ml_op op;
  if (!strcmp(what, "close")) {
    if (st != ML_HANDLE_HELD) {
      bson_error_t err;
      (void)lock_end(L, 1, h, NULL, 1, 0, &err);
      lua_pushboolean(L, 1);
      return 1;
    }
    ml_lease_release_op(h->lease, NULL, &op);
  } else if (!strcmp(what, "release")) {
    bson_t extra = BSON_INITIALIZER;
    int has = release_changes(L, h, 3, &extra);
    if (st != ML_HANDLE_HELD) {
      bson_destroy(&extra);
      return push_state(L, st);
    }
    ml_lease_release_op(h->lease, has ? &extra : NULL, &op);
    bson_destroy(&extra);
  } else if (!strcmp(what, "extend")) {
    int64_t ttl_ms;
    lua_settop(L, 3);
    lua_remove(L, 2);           /* extend's argument at 2, as l_extend's */
    ttl_ms = lua_isnoneornil(L, 2) ? 0 : arg_extend_ttl(L);
    if (st != ML_HANDLE_HELD) return push_state(L, st);
    ttl_ms = extend_ttl(L, h, ttl_ms);
    ml_lease_extend_op(h->lease, ttl_ms, &op);
  } else {
    return luaL_argerror(L, 2, "\"release\", \"extend\" or \"close\" expected");
  }
  ml_push_op(L, &op);
  ml_op_destroy(&op);
  lua_pushnumber(L, ml_monotonic());
  return 2;
}

/*
 * core.lease_done(h, what, started, reply, err, code, ereply) -> what the
 * method answers (true | nil, "lost" | nil, message, code): the outcome of
 * the command lease_step gave (reply a BSON string; or nil, the error, its
 * code and the server's reply when there was one), applied to h's state as
 * the method itself applies it.
 */
static int l_lease_done(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  const char *what = luaL_checkstring(L, 2);
  double started = luaL_checknumber(L, 3);
  ml_lease *l = h->lease;
  bson_t reply;
  size_t len = 0;
  const char *bytes = NULL;
  int ok = 0, r, closing = !strcmp(what, "close");
  int64_t n;
  if (lua_type(L, 4) == LUA_TSTRING) {
    bytes = lua_tolstring(L, 4, &len);
    ok = 1;
  } else if (lua_type(L, 7) == LUA_TSTRING) {
    bytes = lua_tolstring(L, 7, &len);
  }
  if (!bytes || !bson_init_static(&reply, (const uint8_t *)bytes, len)) {
    bson_init(&reply);
    ok = 0;
  }
  if (!l) {
    if (closing) {
      lua_pushboolean(L, 1);
      return 1;
    }
    return push_state(L, ML_HANDLE_CLOSED);
  }
  if (closing || !strcmp(what, "release")) {
    n = ml_release_matched(ok, &reply);
    r = ml_lease_release_done(l, n);
    if (closing) {
      if (r < 0) {
        ml_lease_lock(l);
        l->held = 0;            /* not sent: the lease ends at its ttl */
        ml_lease_unlock(l);
      }
      h->lease = NULL;          /* mark closed */
      ml_lease_unref(l);
      lua_pushboolean(L, 1);
      return 1;
    }
  } else {
    int64_t ttl;
    n = ok ? ml_parse_matched(&reply) : -1;
    ml_lease_lock(l);
    ttl = l->step_ttl ? l->step_ttl : l->ttl_ms;
    ml_lease_unlock(l);
    r = ml_lease_extend_done(l, n, ttl, started);
  }
  if (r > 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  if (r == 0) return push_state(L, ML_HANDLE_LOST);
  lua_pushnil(L);
  if (lua_isstring(L, 5)) lua_pushvalue(L, 5);
  else lua_pushliteral(L, "update reply without matchedCount");
  lua_pushvalue(L, 6);
  return 3;
}

/*
 * client:release_later(kind, db, coll, name, owner) -> true | nil, message:
 * the release of what owner may hold of the named lock name ("named") or
 * of its shares or permits ("shared"), sent by the lease engine in the
 * background (it matches nothing when owner holds nothing).  For a waiter
 * that gives up after an attempt whose reply was lost, even to the
 * driver's retry: that attempt may have taken the lock under its id.
 */
static int l_release_later(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *kind = luaL_checkstring(L, 2);
  const char *db, *coll, *name, *owner;
  ml_lease_spec s;
  ml_lease *l;
  bson_t id = BSON_INITIALIZER;
  int shared = !strcmp(kind, "shared");
  luaL_argcheck(L, shared || !strcmp(kind, "named"), 2, "\"named\" or \"shared\" expected");
  ml_arg_ns(L, 3, &db, &coll);
  name = ml_arg_name(L, 5, &(size_t){0});
  owner = ml_arg_waiter(L, 6);
  BSON_APPEND_UTF8(&id, "_id", name);
  ml_lease_spec_named(&s, shared ? ML_KIND_SHARED : ML_KIND_NAMED, db, coll, &id,
                      shared ? ML_F_HOLDERS : ML_F_OWNER, owner, 1000);
  s.started = ml_monotonic();
  l = ml_lease_new(&s);
  bson_destroy(&id);
  if (l) l->redo = ML_RELEASE_REDO;   /* the lost write may land after it */
  if (!l || !ml_gc_handoff || !ml_gc_handoff(c, l)) {
    if (l) ml_lease_unref(l);
    return ml_pushfail(L, "no background release in this process", 0);
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* client:set_methods(t) -> true: the handles of this client look up
 * methods in t first (a transport's release, extend and close) */
static int l_set_methods(lua_State *L) {
  (void)ml_checkclient(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_getfield(L, LUA_REGISTRYINDEX, ML_METHODS_KEY);
  lua_pushvalue(L, 1);
  lua_pushvalue(L, 2);
  lua_rawset(L, -3);
  any_methods = 1;
  lua_pushboolean(L, 1);
  return 1;
}

/* core.handle_client(h) -> the client (mongolock.Client) that made h */
static int l_handle_client(lua_State *L) {
  (void)ml_checklock(L, 1);
  ml_getuservalue(L, 1);
  lua_rawgeti(L, -1, 1);
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
  lua_pushvalue(L, -1);
  lua_setfield(L, -4, "lock_methods");           /* core.lock_methods */
  lua_pushcclosure(L, l_index, 1);               /* [module, mt, index] */
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);                                 /* [module] */
  lua_pushcfunction(L, l_lease_step);
  lua_setfield(L, -2, "lease_step");
  lua_pushcfunction(L, l_lease_done);
  lua_setfield(L, -2, "lease_done");
  lua_pushcfunction(L, l_handle_client);
  lua_setfield(L, -2, "handle_client");
  /* client -> methods, weak keys */
  lua_newtable(L);
  lua_createtable(L, 0, 1);
  lua_pushliteral(L, "k");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, ML_METHODS_KEY);
}

/* Client methods: handles' transports and background releases (module.c
 * adds them to mongolock.Client) */
const luaL_Reg ml_lock_client_methods[] = {
  {"set_methods", l_set_methods},
  {"release_later", l_release_later},
  {NULL, NULL}
};
