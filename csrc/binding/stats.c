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
  if (c && c->obs) ml_obs_add(c->obs, &c->obs->commands, 1);
}

/* [-0, +1] {named = n, document = n, shared = n, permit = n} */
static void push_kinds(lua_State *L, const long *v) {
  int k;
  lua_createtable(L, 0, ML_KINDS);
  for (k = 0; k < ML_KINDS; k++) {
    lua_pushinteger(L, (lua_Integer)load(&v[k]));
    lua_setfield(L, -2, ml_kind_of((ml_kind)k)->name);
  }
}

/* counts are integers (lua_pushinteger: math.type "integer" under 5.3+) */
static void setint(lua_State *L, const char *k, long v) {
  lua_pushinteger(L, (lua_Integer)v);
  lua_setfield(L, -2, k);
}

/* [-0, +1] {{kind, collection, releases, lost}, ...} from the places
 * from p on (a list linked whole: read without a lock) */
static void push_places(lua_State *L, const ml_obs_place *p) {
  int i = 0;
  lua_newtable(L);
  for (; p; p = p->next) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, ml_kind_of(p->kind)->name);
    lua_setfield(L, -2, "kind");
    lua_pushstring(L, p->collection);
    lua_setfield(L, -2, "collection");
    setint(L, "releases", load(&p->releases));
    setint(L, "lost", load(&p->lost));
    lua_rawseti(L, -2, ++i);
  }
}

/* [-0, +1] {commands, releases = {<kind> = n}, lost = {<kind> = n},
 * places = {{kind, collection, releases, lost}, ...}, renewals,
 * renewal_failures, renewal_batches, renewal_checks, stream_reopens,
 * stream_getmores}: the counters of o (never going back) */
static void push_counters(lua_State *L, ml_obs *o, const ml_obs_place *places) {
  lua_createtable(L, 0, 12);
  push_places(L, places);
  lua_setfield(L, -2, "places");
  setint(L, "commands", load(&o->commands));
  push_kinds(L, o->releases);
  lua_setfield(L, -2, "releases");
  push_kinds(L, o->lost);
  lua_setfield(L, -2, "lost");
  setint(L, "renewals", load(&o->renewals));
  setint(L, "renewal_failures", load(&o->renewal_failures));
  setint(L, "renewal_batches", load(&o->renewal_batches));
  setint(L, "renewal_checks", load(&o->renewal_checks));
  setint(L, "stream_reopens", load(&o->stream_reopens));
  setint(L, "stream_getmores", load(&o->stream_getmores));
}

/*
 * client:counters() -> {commands, releases = {<kind> = n}, lost = {<kind> =
 * n}, places = {{kind, collection, releases, lost}, ...}, renewals,
 * renewal_failures, renewal_batches, renewal_checks, stream_reopens,
 * stream_getmores, streams, events_dropped}: this
 * client's C counters in this process (the engine's and the change
 * streams' count into them as they send, renew.c and watch.c), which
 * never go back: a closed client keeps them.  streams is the change
 * streams running now.
 */
static int ml_m_counters(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  ml_watch_counts wn;
  ml_obs *o = c->obs;
  static ml_obs none;           /* a client without counters: zeros */
  long dropped = 0;
  ml_watch_stats(c, &wn);
  push_counters(L, o ? o : &none, o ? __atomic_load_n(&o->places, __ATOMIC_ACQUIRE) : NULL);
  if (o) {
    pthread_mutex_lock(&o->mu);
    dropped = o->dropped;
    pthread_mutex_unlock(&o->mu);
  }
  setint(L, "streams", wn.streams);
  setint(L, "events_dropped", dropped);
  return 1;
}

/* core.totals() -> client:counters()'s counters (without streams and
 * events_dropped) summed over every client this process made, closed and
 * collected ones too (ml_obs_totals): what mongolock.metrics exposes */
static int l_totals(lua_State *L) {
  push_counters(L, &ml_obs_totals, ml_obs_total_places());
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

/* [-0, +0] the module's functions (module.c): core.totals() */
void ml_stats_open(lua_State *L) {
  lua_pushcfunction(L, l_totals);
  lua_setfield(L, -2, "totals");
}
