/*
 * A client's counters and the queue of its leases' events (ml_obs,
 * lease.h): what the lease's state changes write, from the Lua thread or
 * the engine's (a loss, a release, a failed renewal).  Includes lease.h,
 * libbson and the C library only: no Lua, no libmongoc.  stats.c gives
 * them to Lua.
 *
 * Counting costs no round trip and no lock: each counter is a relaxed
 * atomic add on the client's own struct, and one on the process's totals
 * (ml_obs_totals), which keep every client's counts for the life of the
 * process; a release or a loss also takes the client's mu, a moment, to
 * find its collection's place (count_place).  Loss and renewal failure are decided in C threads that never
 * call Lua (renew.c): their events wait in the queue until the Lua side
 * takes them (stats.c).
 */
#include <stdlib.h>
#include <string.h>

#include "lease.h"

/* ---- fork --------------------------------------------------------------
 * A forked child may inherit a client's mu held by a thread of the
 * parent's (a renewal counting a release, a stream queueing a loss) that
 * it does not have.  Every ml_obs is listed (all_mu): the child's handler
 * makes each mu anew and empties each queue (its events are of the
 * parent's leases, and a thread of the parent's may have been moving it).
 * The list is walked by next, each link written before the head that
 * publishes it, so a link or unlink cut by the fork leaves it walkable. */
static pthread_mutex_t all_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_obs *all;             /* (all_mu) */
static pthread_mutex_t totals_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void forked(void) {
  ml_obs *o;
  pthread_mutex_init(&all_mu, NULL);
  pthread_mutex_init(&totals_mu, NULL);
  for (o = all; o; o = o->next) {
    pthread_mutex_init(&o->mu, NULL);
    o->ev = NULL;
    o->cap = 0;
    o->nev = 0;
  }
}

static void fork_register(void) { pthread_atfork(NULL, NULL, forked); }

ml_obs *ml_obs_new(void) {
  ml_obs *o = (ml_obs *)calloc(1, sizeof *o);
  if (!o) return NULL;
  pthread_once(&fork_once, fork_register);
  pthread_mutex_init(&o->mu, NULL);
  o->refs = 1;
  pthread_mutex_lock(&all_mu);
  o->next = all;
  if (all) all->prev = o;
  __atomic_store_n(&all, o, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&all_mu);
  return o;
}

/* refs are atomic, not under mu: a forked child may drop the last
 * reference of what it inherited while mu is held by a thread of the
 * parent's that it does not have */
ml_obs *ml_obs_ref(ml_obs *o) {
  if (!o) return NULL;
  __atomic_fetch_add(&o->refs, 1, __ATOMIC_RELAXED);
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
  ml_obs_place *p, *nx;
  if (!o) return;
  refs = __atomic_sub_fetch(&o->refs, 1, __ATOMIC_ACQ_REL);
  if (refs > 0) return;
  pthread_mutex_lock(&all_mu);
  if (o->prev) o->prev->next = o->next;
  else all = o->next;
  if (o->next) o->next->prev = o->prev;
  pthread_mutex_unlock(&all_mu);
  for (p = o->places; p; p = nx) {
    nx = p->next;
    free(p->collection);
    free(p);
  }
  for (i = 0; i < o->nev; i++) ml_lease_event_free(&o->ev[i]);
  free(o->ev);
  pthread_mutex_destroy(&o->mu);
  free(o);
}

ml_obs ml_obs_totals;

void ml_obs_add(ml_obs *o, long *counter, long n) {
  /* the same field of the totals: counter's offset in o */
  long *total;
  if (!o) return;
  total = (long *)((char *)&ml_obs_totals + ((char *)counter - (char *)o));
  __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
  __atomic_fetch_add(total, n, __ATOMIC_RELAXED);
}

/* ---- places: releases and losses by kind and collection ------------ */

ml_obs_place *ml_obs_total_places(void) {
  return __atomic_load_n(&ml_obs_totals.places, __ATOMIC_ACQUIRE);
}

/* mu (o's, or totals_mu for the totals) held: the place of (kind, db.coll)
 * in *list, made and linked when missing; NULL when out of memory */
static ml_obs_place *place_in(ml_obs_place **list, ml_kind kind, const char *db, const char *coll) {
  ml_obs_place *p;
  size_t ndb = strlen(db), ncoll = strlen(coll);
  for (p = *list; p; p = p->next)
    if (p->kind == kind && !strncmp(p->collection, db, ndb) && p->collection[ndb] == '.' &&
        !strcmp(p->collection + ndb + 1, coll))
      return p;
  p = (ml_obs_place *)calloc(1, sizeof *p);
  if (!p) return NULL;
  p->collection = (char *)malloc(ndb + ncoll + 2);
  if (!p->collection) {
    free(p);
    return NULL;
  }
  memcpy(p->collection, db, ndb);
  p->collection[ndb] = '.';
  memcpy(p->collection + ndb + 1, coll, ncoll + 1);
  p->kind = kind;
  p->next = *list;
  /* readers walk the list without a lock: p is whole before it is seen */
  __atomic_store_n(list, p, __ATOMIC_RELEASE);
  return p;
}

/* l's place in its client's counters (and the process's), counted by n */
static void count_place(ml_lease *l, int lost, long n) {
  ml_obs *o = l->obs;
  ml_obs_place *p;
  pthread_mutex_lock(&o->mu);
  p = place_in(&o->places, l->kind, l->db, l->coll);
  if (p && !p->total) {
    pthread_mutex_lock(&totals_mu);
    p->total = place_in(&ml_obs_totals.places, l->kind, l->db, l->coll);
    pthread_mutex_unlock(&totals_mu);
  }
  pthread_mutex_unlock(&o->mu);
  if (!p) return;
  __atomic_fetch_add(lost ? &p->lost : &p->releases, n, __ATOMIC_RELAXED);
  if (p->total) __atomic_fetch_add(lost ? &p->total->lost : &p->total->releases, n, __ATOMIC_RELAXED);
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
    count_place(l, 1, 1);
    queue_event(l, 0);
  }
}

void ml_lease_count_release(ml_lease *l, long n) {
  if (l->obs && n > 0) {
    ml_obs_add(l->obs, &l->obs->releases[l->kind], n);
    count_place(l, 0, n);
  }
}

void ml_lease_renewal_failed(ml_lease *l) {
  queue_event(l, 1);
}
