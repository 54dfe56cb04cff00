/*
 * A client's counters and the queue of its leases' events (ml_obs,
 * lease.h): what the lease's state changes write, from the Lua thread or
 * the engine's (a loss, a release, a failed renewal).  Includes lease.h,
 * libbson and the C library only: no Lua, no libmongoc.  stats.c gives
 * them to Lua.
 *
 * Counting costs no round trip and no lock: each counter is a relaxed
 * atomic add on the client's own struct.  Loss and renewal failure are
 * decided in C threads that never call Lua (renew.c): their events wait in
 * the queue until the Lua side takes them (stats.c).
 */
#include <stdlib.h>
#include <string.h>

#include "lease.h"

ml_obs *ml_obs_new(void) {
  ml_obs *o = (ml_obs *)calloc(1, sizeof *o);
  if (!o) return NULL;
  pthread_mutex_init(&o->mu, NULL);
  o->refs = 1;
  return o;
}

ml_obs *ml_obs_ref(ml_obs *o) {
  if (!o) return NULL;
  pthread_mutex_lock(&o->mu);
  o->refs++;
  pthread_mutex_unlock(&o->mu);
  return o;
}

void ml_lease_event_free(ml_lease_event *e) {
  bson_free(e->db);
  bson_free(e->coll);
  bson_destroy(&e->iddoc);
}

void ml_obs_unref(ml_obs *o) {
  int refs;
  size_t i;
  if (!o) return;
  pthread_mutex_lock(&o->mu);
  refs = --o->refs;
  pthread_mutex_unlock(&o->mu);
  if (refs > 0) return;
  for (i = 0; i < o->nev; i++) ml_lease_event_free(&o->ev[i]);
  free(o->ev);
  pthread_mutex_destroy(&o->mu);
  free(o);
}

void ml_obs_add(ml_obs *o, long *counter, long n) {
  if (o) __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
}

/* l's fields read here never change after ml_lock_new */
static void queue_event(ml_lease *l, int failed) {
  ml_obs *o = l->obs;
  ml_lease_event *e;
  if (!o || !__atomic_load_n(&o->want, __ATOMIC_RELAXED)) return;
  pthread_mutex_lock(&o->mu);
  if (o->nev == ML_EVENTS_MAX) {
    /* full: the oldest goes */
    ml_lease_event_free(&o->ev[0]);
    memmove(o->ev, o->ev + 1, (o->nev - 1) * sizeof *o->ev);
    __atomic_store_n(&o->nev, o->nev - 1, __ATOMIC_RELAXED);
    o->dropped++;
  }
  if (o->nev == o->cap) {
    size_t cap = o->cap ? o->cap * 2 : 8;
    ml_lease_event *v = (ml_lease_event *)realloc(o->ev, cap * sizeof *v);
    if (!v) {
      o->dropped++;
      pthread_mutex_unlock(&o->mu);
      return;
    }
    o->ev = v;
    o->cap = cap;
  }
  e = &o->ev[o->nev];
  /* nev is read without mu by has_events: every write of it is atomic */
  __atomic_store_n(&o->nev, o->nev + 1, __ATOMIC_RELAXED);
  e->kind = l->kind;
  e->failed = failed;
  e->db = bson_strdup(l->db);
  e->coll = bson_strdup(l->coll);
  bson_copy_to(&l->iddoc, &e->iddoc);
  e->token = l->token;
  memcpy(e->owner, l->owner, sizeof e->owner);
  pthread_mutex_unlock(&o->mu);
}

void ml_lease_set_lost(ml_lease *l) {
  l->held = 0;
  if (l->lost) return;
  l->lost = 1;
  if (l->obs) {
    ml_obs_add(l->obs, &l->obs->lost[l->kind], 1);
    queue_event(l, 0);
  }
}

void ml_lease_count_release(ml_lease *l, long n) {
  if (l->obs && n > 0) ml_obs_add(l->obs, &l->obs->releases[l->kind], n);
}

void ml_lease_renewal_failed(ml_lease *l) {
  queue_event(l, 1);
}
