/*
 * What a client did, given to Lua: the counters since connect and the
 * events of its leases (lost, a failed renewal) that obs.c keeps (ml_obs,
 * lease.h), for client:stats() and client:on_lost() (lua/mongolock.lua).
 * Events wait in obs.c's queue until the Lua side takes them
 * (client:take_events(), at the next call into the library, from
 * client:poll(), or inside nginx from the engine adapter's timer).
 */
#include <stdlib.h>
#include <string.h>

#include "compat.h"
#include "lease.h"
#include "bson_lua.h"
#include "client.h"
#include "stats.h"
#include "renew.h"
#include "watch.h"

static long load(const long *counter) {
  return __atomic_load_n(counter, __ATOMIC_RELAXED);
}

void ml_obs_command(const ml_client *c) {
  if (c && c->obs) __atomic_fetch_add(&c->obs->commands, 1, __ATOMIC_RELAXED);
}

/* [-0, +1] {named = n, document = n, shared = n, permit = n} */
static void push_kinds(lua_State *L, const long *v) {
  int k;
  lua_createtable(L, 0, ML_KINDS);
  for (k = 0; k < ML_KINDS; k++) {
    lua_pushnumber(L, (lua_Number)load(&v[k]));
    lua_setfield(L, -2, ml_kind_of((ml_kind)k)->name);
  }
}

static void setnum(lua_State *L, const char *k, long v) {
  lua_pushnumber(L, (lua_Number)v);
  lua_setfield(L, -2, k);
}

/*
 * client:counters() -> {commands, releases = {<kind> = n}, lost = {<kind> =
 * n}, renewals, renewal_failures, renewal_batches, renewal_checks,
 * stream_reopens, stream_getmores, streams, events_dropped}: this
 * process's C counters (the engine's and the change streams' are its own,
 * renew.c and watch.c).  Works on a closed client.
 */
static int ml_m_counters(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  ml_renew_counts rn;
  ml_watch_counts wn;
  ml_obs *o = c->obs;
  long dropped = 0;
  ml_renew_stats(c, &rn);
  ml_watch_stats(c, &wn);
  lua_createtable(L, 0, 12);
  /* the streams' aggregates and getMores are commands too (watch.c) */
  setnum(L, "commands", (o ? load(&o->commands) : 0) + wn.getmores + wn.opens);
  if (o) {
    push_kinds(L, o->releases);
    lua_setfield(L, -2, "releases");
    push_kinds(L, o->lost);
    lua_setfield(L, -2, "lost");
    pthread_mutex_lock(&o->mu);
    dropped = o->dropped;
    pthread_mutex_unlock(&o->mu);
  }
  setnum(L, "renewals", rn.renewals);
  setnum(L, "renewal_failures", rn.failures);
  setnum(L, "renewal_batches", rn.batches);
  setnum(L, "renewal_checks", rn.checks);
  setnum(L, "stream_reopens", wn.reopens);
  setnum(L, "stream_getmores", wn.getmores);
  setnum(L, "streams", wn.streams);
  setnum(L, "events_dropped", dropped);
  return 1;
}

/* client:want_events(bool): queue lease events from now on (or stop, and
 * drop those queued) */
static int ml_m_want_events(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  int want = lua_toboolean(L, 2);
  ml_obs *o = c->obs;
  if (o) {
    __atomic_store_n(&o->want, want, __ATOMIC_RELAXED);
    if (!want) {
      size_t i;
      pthread_mutex_lock(&o->mu);
      for (i = 0; i < o->nev; i++) ml_lease_event_free(&o->ev[i]);
      __atomic_store_n(&o->nev, 0, __ATOMIC_RELAXED);
      pthread_mutex_unlock(&o->mu);
    }
  }
  return 0;
}

/* client:has_events() -> boolean: events wait (no lock taken: a look at
 * the count, which take_events reads again under the lock) */
static int ml_m_has_events(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  lua_pushboolean(L, c->obs && __atomic_load_n(&c->obs->nev, __ATOMIC_RELAXED) > 0);
  return 1;
}

/*
 * client:take_events() -> {{reason = "lost" | "renewal failed", kind,
 * database, collection, name (the lock's _id), token, owner}, ...}, oldest
 * first; the queue is empty afterwards.
 */
static int ml_m_take_events(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  ml_obs *o = c->obs;
  ml_lease_event *ev = NULL;
  size_t n = 0, i;
  if (o) {
    pthread_mutex_lock(&o->mu);
    ev = o->ev;
    n = o->nev;
    o->ev = NULL;
    o->cap = 0;
    __atomic_store_n(&o->nev, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&o->mu);
  }
  lua_createtable(L, (int)n, 0);
  for (i = 0; i < n; i++) {
    ml_lease_event *e = &ev[i];
    bson_iter_t it;
    lua_createtable(L, 0, 7);
    lua_pushstring(L, e->failed ? "renewal failed" : "lost");
    lua_setfield(L, -2, "reason");
    lua_pushstring(L, ml_kind_of(e->kind)->name);
    lua_setfield(L, -2, "kind");
    lua_pushstring(L, e->db);
    lua_setfield(L, -2, "database");
    lua_pushstring(L, e->coll);
    lua_setfield(L, -2, "collection");
    if (bson_iter_init_find(&it, &e->iddoc, "_id")) {
      ml_pushbsonvalue(L, &it);
      lua_setfield(L, -2, "name");
    }
    if (e->token) {
      ml_pushint64(L, e->token);
      lua_setfield(L, -2, "token");
    }
    lua_pushstring(L, e->owner);
    lua_setfield(L, -2, "owner");
    lua_rawseti(L, -2, (int)i + 1);
    ml_lease_event_free(e);
  }
  free(ev);
  return 1;
}

/* Client methods: counters and lease events (module.c adds them to mongolock.Client) */
const luaL_Reg ml_stats_methods[] = {
  {"counters", ml_m_counters},
  {"take_events", ml_m_take_events},
  {"want_events", ml_m_want_events},
  {"has_events", ml_m_has_events},
  {NULL, NULL}
};
