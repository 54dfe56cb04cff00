/*
 * The lease engine and its adapters.  What every held lease of a client
 * does over its life in this process is decided in one place for every
 * kind and every transport, engine.c (plain C over lease.h and the
 * protocol: no Lua, no I/O, no clock); this file keeps the engines of the
 * process, runs them, keeps their time (ml_monotonic, passed to each call)
 * and is their Lua side.  The engine renews the leases in batches (one
 * command per collection and renewal period, however many leases), retries
 * a failed renewal every ttl/10 (50 ms .. 1 s), marks a lease lost when its
 * renewal could not be made or its local deadline passes, tops up a grant's
 * short lease, and sends the releases nobody waits for (a collected
 * handle's, a lost reply's).
 *
 * The engine only says which command to run next and takes its outcome
 * (ml_engine_next, ml_engine_done); a transport runs it.  Two adapters:
 *   - the plain one: one thread per client and process (renew_main), which
 *     pops its own connection from the client's pool and never touches a
 *     lua_State;
 *   - an external one (client:set_external(true), inside nginx): no thread;
 *     client:engine_next() hands the command to Lua as a BSON op string, an
 *     nginx timer runs it in a worker thread and gives the reply back with
 *     client:engine_done().
 *
 * Renewal in batches (protocol.h, ml_build_renew): each lease document of
 * a renewed named lock, share or permit carries the keeper id of the
 * client process that renews it and its own ttl, so one update with multi
 * extends every live lease of that keeper in a collection by its own ttl on
 * the server's clock.  It matches only the documents where one of them is
 * live: when it matched as many documents as the batch holds, every lease
 * of the batch was renewed; otherwise one aggregate (ml_build_renew_check)
 * tells which still are, and only the others are lost.  Document locks
 * (the application's documents carry no keeper) are renewed per collection
 * and ttl by one update over their listed (_id, owner) pairs; when it
 * matches fewer, each is renewed alone once, which says which is lost.
 *
 * A lease's renewal is due once a third of its ttl has passed since the last
 * successful acquire or extend; when one lease of a collection is due, the
 * whole collection's renewed leases go in the batch, so leases of one ttl
 * fall into step.
 *
 * Invariants:
 * - renew_mu guards every ml_renew, its items, its releases and its work.
 *   A lease's mu is taken only inside renew_mu (or alone, by the Lua side).
 *   No Lua function is called and nothing raises while it is held: a push
 *   may run the collector, whose finalizers (a handle's __gc) take it.
 * - A lease appears in at most one item of one state; each item, each
 *   queued release and each lease of the work in flight owns one reference.
 * - At most one command runs at a time per state (st->e.work.kind !=
 *   ML_WORK_NONE from ml_engine_next until ml_engine_done).
 * - fork: the prepare handler holds renew_mu across fork(), so the child
 *   inherits no mutex held by a renewal thread.  In the child the parent's
 *   states are abandoned (never joined, never freed) and new ones are made
 *   on first use.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "transport.h"
#include "lease.h"
#include "sys.h"
#include "args.h"
#include "client.h"
#include "lock.h"
#include "renew.h"
#include "watch.h"
#include "engine.h"
#include "stats.h"

typedef struct ml_renew {
  struct ml_renew *next;        /* all states of this process (renew_mu) */
  ml_engine e;                  /* the decisions (engine.c) */
  ml_client *c;                 /* owner; outlives the thread (close joins) */
  mongoc_client_pool_t *pool;   /* c's pool in this process; NULL external */
  pid_t pid;                    /* process the state belongs to */
  int external;                 /* driven from Lua (no thread) */
  pthread_t thread;
  pthread_cond_t cv;            /* new work or stop */
  pthread_cond_t done;          /* a release was sent (ml_renew_flush) */
  double wake_at;               /* the thread sleeps until then; 0 while it
                                   runs (it looks at every item before it
                                   sleeps again).  External: when the
                                   adapter looks again, as it said to
                                   engine_next; 0 while it runs an op */
  int poked;                    /* external: a lease added since the
                                   adapter's last look is due before it
                                   looks again (client:engine_poked) */
  int scan;                     /* a server selection is asked for */
  int scanning;                 /* the thread is inside it (do_scan) */
  ml_orphan *orphan;            /* detached by close inside a selection:
                                   the thread frees this state and drops
                                   the pool when it returns */
  ml_obs *obs;                  /* c's counters (one reference) */
  double hold_at;               /* a renewed named lease is ML_HOLD_AFTER
                                   old then: its stream is asked for
                                   (hold_due); 0 when none waits for it */
  ml_lease **holdq;             /* the named leases not yet handed to their
                                   stream, in the order they were taken
                                   (ml_renew_hold), one reference each:
                                   holdq[qhead .. qn) */
  size_t qhead, qn, qcap;
  long shown[4];                /* the engine's renewals, failures,
                                   batches, checks already added to obs */
} ml_renew;

static pthread_mutex_t renew_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_renew *states;        /* (renew_mu) */

/* renew_mu held, after ml_engine_done: what the engine counted since,
 * added to the client's counters (which outlive this state) */
static void publish(ml_renew *st) {
  long now[4];
  int i;
  now[0] = st->e.renewals;
  now[1] = st->e.failures;
  now[2] = st->e.batches;
  now[3] = st->e.checks;
  if (st->obs) {
    ml_obs_add(st->obs, &st->obs->renewals, now[0] - st->shown[0]);
    ml_obs_add(st->obs, &st->obs->renewal_failures, now[1] - st->shown[1]);
    ml_obs_add(st->obs, &st->obs->renewal_batches, now[2] - st->shown[2]);
    ml_obs_add(st->obs, &st->obs->renewal_checks, now[3] - st->shown[3]);
  }
  for (i = 0; i < 4; i++) st->shown[i] = now[i];
}

/* ---- fork -------------------------------------------------------------- */

static void fork_prepare(void) {
  pthread_mutex_lock(&renew_mu);
}

static void fork_parent(void) {
  pthread_mutex_unlock(&renew_mu);
}

static void fork_child(void) {
  states = NULL;
  pthread_mutex_unlock(&renew_mu);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* ---- the plain adapter: a thread --------------------------------------- */

static void wait_until(pthread_cond_t *cv, double when) {
  struct timespec ts = ml_timespec(when);
  pthread_cond_timedwait(cv, &renew_mu, &ts);
}

/*
 * A server selection for writes, for a waiter that found no writable server
 * among the monitors' descriptions (loop.lua, await_server).  After a
 * connection error libmongoc marks the server unknown, and its monitor
 * looks again only after heartbeatFrequencyMS (10 s by default) unless a
 * selection asks for a check, which this one does (the monitor then checks
 * within minHeartbeatFrequencyMS, 500 ms).  It holds this thread until a
 * server is found or serverSelectionTimeoutMS passes; the description of
 * an unknown server carries no id to send to directly
 * (mongoc_client_get_server_descriptions leaves unknown servers out).
 */
static void do_scan(mongoc_client_t *mc) {
  bson_error_t err;
  mongoc_server_description_t *sd = mongoc_client_select_server(mc, true, NULL, &err);
  if (sd) mongoc_server_description_destroy(sd);
}

/* renew_mu held: the references of the hold queue dropped */
static void holdq_clear(ml_renew *st) {
  while (st->qhead < st->qn) ml_lease_unref(st->holdq[st->qhead++]);
  free(st->holdq);
  st->holdq = NULL;
  st->qhead = st->qn = st->qcap = 0;
}

/* renew_mu held: l (a reference of its own) at the end of the hold queue;
 * 0 when out of memory */
static int holdq_push(ml_renew *st, ml_lease *l) {
  if (st->qn == st->qcap) {
    if (st->qhead > 0) {
      memmove(st->holdq, st->holdq + st->qhead, (st->qn - st->qhead) * sizeof *st->holdq);
      st->qn -= st->qhead;
      st->qhead = 0;
    }
    if (st->qn == st->qcap) {
      size_t cap = st->qcap ? st->qcap * 2 : 64;
      ml_lease **q = (ml_lease **)realloc(st->holdq, cap * sizeof *q);
      if (!q) return 0;
      st->holdq = q;
      st->qcap = cap;
    }
  }
  ml_lease_lock(l);
  l->refs++;
  ml_lease_unlock(l);
  st->holdq[st->qn++] = l;
  return 1;
}

/*
 * renew_mu held, by the thread: the named leases of the client's handles
 * that are ML_HOLD_AFTER old and not yet watched are handed to their
 * collection's change stream (ml_watch_hold, with renew_mu released:
 * watch.c never runs inside it), at most HOLD_BATCH a pass; hold_at is set
 * to when the next one is due.
 */
#define HOLD_BATCH 32
static void hold_due(ml_renew *st, double now) {
  ml_lease *due[HOLD_BATCH];
  size_t i, n = 0;
  st->hold_at = 0;
  /* the queue is in the order of the acquires, so the head is the oldest
   * lease (a lease taken by another thread meanwhile may come a little
   * late): each lease is looked at once, however many the client holds */
  while (st->qhead < st->qn) {
    ml_lease *l = st->holdq[st->qhead];
    double at = l->started + ML_HOLD_AFTER;
    int wanted;
    ml_lease_lock(l);
    wanted = l->hc == st->c && !l->watched && l->pid == ml_pid() && l->held && !l->ending && now < l->deadline;
    if (wanted && (now < at || n == HOLD_BATCH)) {
      ml_lease_unlock(l);
      st->hold_at = n == HOLD_BATCH ? now : at;
      break;
    }
    if (wanted) l->watched = 1;
    ml_lease_unlock(l);
    st->qhead++;
    if (wanted) due[n++] = l;   /* the queue's reference, now due's */
    else ml_lease_unref(l);
  }
  if (st->qhead == st->qn) st->qhead = st->qn = 0;
  if (!n) return;
  pthread_mutex_unlock(&renew_mu);
  for (i = 0; i < n; i++) {
    ml_watch_hold(st->c, st->pool, due[i]);
    ml_lease_unref(due[i]);
  }
  pthread_mutex_lock(&renew_mu);
}

static void *renew_main(void *arg) {
  ml_renew *st = (ml_renew *)arg;
  mongoc_client_t *mc = NULL;
  double wake;

  pthread_mutex_lock(&renew_mu);
  for (;;) {
    double now = ml_monotonic();
    int has_work = st->e.work.kind != ML_WORK_NONE;
    if (!mc && (st->e.n || st->e.nrel || st->scan || has_work)) {
      /* try_pop: a pool exhausted by the Lua side must not block close */
      pthread_mutex_unlock(&renew_mu);
      mc = mongoc_client_pool_try_pop(st->pool);
      pthread_mutex_lock(&renew_mu);
    }
    if (mc && (has_work || ml_engine_next(&st->e, now, &wake))) {
      bson_t reply;
      bson_error_t err;
      double started = ml_monotonic();
      int ok;
      /* only this thread changes st->e.work's op (the leases keep its db and
       * coll alive) */
      pthread_mutex_unlock(&renew_mu);
      if (st->obs) ml_obs_add(st->obs, &st->obs->commands, 1);
      ok = ml_run(mc, st->c->wc, &st->e.work.op, &reply, &err);
      pthread_mutex_lock(&renew_mu);
      if (ml_engine_done(&st->e, ml_monotonic(), started, ok, &reply, &err))
        pthread_cond_broadcast(&st->done);
      publish(st);
      bson_destroy(&reply);
      continue;
    }
    if (st->scan && mc && !st->e.stop) {
      st->scan = 0;
      st->scanning = 1;
      pthread_mutex_unlock(&renew_mu);
      do_scan(mc);
      pthread_mutex_lock(&renew_mu);
      st->scanning = 0;
      continue;
    }
    if (st->hold_at && now >= st->hold_at && !st->e.stop) {
      hold_due(st, now);
      continue;
    }
    if (st->e.stop) {
      /* no connection for the releases left: those leases expire */
      ml_engine_clear(&st->e, 0);
      holdq_clear(st);
      pthread_cond_broadcast(&st->done);
      break;
    }
    if (!mc && (st->e.n || st->e.nrel || st->scan)) wake = now + 0.1;   /* no connection yet */
    else if (!mc) wake = now + 3600;
    if (st->hold_at && st->hold_at < wake) wake = st->hold_at;
    st->wake_at = wake;
    wait_until(&st->cv, wake);
    st->wake_at = 0;
  }
  {
    ml_orphan *o = st->orphan;
    pthread_mutex_unlock(&renew_mu);
    if (mc) mongoc_client_pool_push(st->pool, mc);
    if (o) {
      /* detached by close: nobody else sees this state any more */
      pthread_cond_destroy(&st->cv);
      pthread_cond_destroy(&st->done);
      pthread_mutex_lock(&renew_mu);
      holdq_clear(st);
      pthread_mutex_unlock(&renew_mu);
      ml_engine_clear(&st->e, 1);
      ml_obs_unref(st->obs);
      free(st);
      ml_orphan_drop(o);
    }
  }
  return NULL;
}

/* ---- states ------------------------------------------------------------ */

/*
 * renew_mu held.  c's state in this process, made (and its thread started,
 * unless c is external) when missing; NULL when it cannot be.
 */
static ml_renew *state_get(ml_client *c, mongoc_client_pool_t *pool) {
  ml_renew *st = (ml_renew *)c->renew_state;
  pthread_condattr_t ca;
  sigset_t old;
  int rc;

  /* a client made external (set_external) after its engine started on its
   * own thread keeps that thread: a second state would leave the first
   * one's thread renewing with the client's pool past its close */
  if (st && st->pid == ml_pid() && (st->external || st->pool == pool || c->external)) return st;
  /* a state from another process is abandoned, not freed */
  st = (ml_renew *)calloc(1, sizeof *st);
  if (!st) return NULL;
  st->c = c;
  st->obs = ml_obs_ref(c->obs);
  st->pool = pool;
  st->pid = ml_pid();
  st->external = c->external;
  {
    char r[33];
    if (ml_random_owner(r)) memcpy(st->e.keeper, r, 16);
    else memcpy(st->e.keeper, "0000000000000000", 16);
    st->e.keeper[16] = '\0';
  }
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&st->cv, &ca);
  pthread_cond_init(&st->done, &ca);
  pthread_condattr_destroy(&ca);
  if (!st->external) {
    /* the thread takes no signal: they belong to the application */
    ml_signals_block(&old);
    rc = pthread_create(&st->thread, NULL, renew_main, st);
    ml_signals_restore(&old);
    if (rc != 0) {
      pthread_cond_destroy(&st->cv);
      pthread_cond_destroy(&st->done);
      ml_obs_unref(st->obs);
      free(st);
      return NULL;
    }
  }
  st->next = states;
  states = st;
  c->renew_state = st;
  c->on_close = ml_bg_on_close;
  return st;
}

/* the pool of c's state (state_get) for a call from Lua: raises if c is
 * closed, so before renew_mu is taken (a raise would leave it locked) */
static mongoc_client_pool_t *state_pool(lua_State *L, ml_client *c) {
  mongoc_client_pool_t *pool = c->external ? NULL : ml_client_pool(L, c);   /* raises if closed */
  if (c->external && c->closed) luaL_error(L, "client is closed");
  pthread_once(&atfork_once, install_atfork);
  return pool;
}

/* renew_mu held: wakes the thread when it sleeps past `due` (an external
 * adapter: says so to client:engine_poked) */
static void poke(ml_renew *st, double due) {
  if (due < st->e.due_at) st->e.due_at = due;
  if (due < st->wake_at) {
    if (st->external) st->poked = 1;
    else pthread_cond_signal(&st->cv);
  }
}

const char *ml_renew_keeper(lua_State *L, ml_client *c, char out[17]) {
  ml_renew *st;
  mongoc_client_pool_t *pool = state_pool(L, c);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, pool);
  if (st) memcpy(out, st->e.keeper, 17);
  pthread_mutex_unlock(&renew_mu);
  return st ? out : NULL;
}

int ml_renew_add(lua_State *L, ml_client *c, ml_lease *l) {
  ml_renew *st;
  double due;
  int ok = 0;
  mongoc_client_pool_t *pool = state_pool(L, c);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, pool);
  if (st && ml_engine_add(&st->e, l, &due)) {
    poke(st, due);
    ok = 1;
  }
  pthread_mutex_unlock(&renew_mu);
  if (!ok) {
    ml_lease_lock(l);
    l->renew = 0;
    ml_lease_unlock(l);
  }
  return ok;
}

void ml_renew_hold(lua_State *L, ml_client *c, ml_lease *l) {
  ml_renew *st;
  double at = l->started + ML_HOLD_AFTER;
  mongoc_client_pool_t *pool;
  if (c->external || l->kind != ML_KIND_NAMED) return;
  pool = state_pool(L, c);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, pool);
  /* out of memory: the lease goes without its stream, and its holder
   * learns of a takeover at its next renewal, as before it was held long */
  if (st && holdq_push(st, l) && (!st->hold_at || at < st->hold_at)) {
    st->hold_at = at;
    if (at < st->wake_at) pthread_cond_signal(&st->cv);
  }
  pthread_mutex_unlock(&renew_mu);
}

int ml_renew_scan(lua_State *L, ml_client *c) {
  ml_renew *st;
  mongoc_client_pool_t *pool;
  if (c->external) return 0;
  pool = state_pool(L, c);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, pool);
  if (st) {
    st->scan = 1;
    pthread_cond_signal(&st->cv);
  }
  pthread_mutex_unlock(&renew_mu);
  return st != NULL;
}

/*
 * ml_gc_handoff: a lease whose release nobody waits for (a collected
 * handle's, a lost reply's).  Takes over the caller's reference and queues
 * the release; returns 0 (the caller then releases synchronously, or gives
 * up) when this process cannot.
 */
static int renew_handoff(ml_client *c, ml_lease *l) {
  ml_renew *st;
  if (c->closed || l->pid != ml_pid()) return 0;
  if (!c->external && (!c->pool || c->pid != ml_pid())) return 0;
  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, c->pool);
  if (!st || !ml_engine_queue_release(&st->e, l)) {
    pthread_mutex_unlock(&renew_mu);
    return 0;
  }
  ml_lease_lock(l);
  l->ending = 1;                /* its release is under way */
  ml_lease_unlock(l);
  if (!st->external) pthread_cond_signal(&st->cv);
  pthread_mutex_unlock(&renew_mu);
  return 1;
}

void ml_held_link(ml_client *c, ml_lease *l) {
  pthread_mutex_lock(&renew_mu);
  l->hc = c;
  l->hprev = NULL;
  l->hnext = c->held;
  if (c->held) c->held->hprev = l;
  c->held = l;
  if (!c->on_close) c->on_close = ml_bg_on_close;
  pthread_mutex_unlock(&renew_mu);
}

/* renew_mu held */
static void held_unlink_locked(ml_lease *l) {
  if (!l->hc) return;
  if (l->hprev) l->hprev->hnext = l->hnext;
  else l->hc->held = l->hnext;
  if (l->hnext) l->hnext->hprev = l->hprev;
  l->hc = NULL;
  l->hprev = l->hnext = NULL;
}

void ml_held_unlink(ml_lease *l) {
  pthread_mutex_lock(&renew_mu);
  held_unlink_locked(l);
  pthread_mutex_unlock(&renew_mu);
}

void ml_held_forget(ml_client *c) {
  pthread_mutex_lock(&renew_mu);
  while (c->held) held_unlink_locked(c->held);
  pthread_mutex_unlock(&renew_mu);
}

/* is l's _id the k of key (BSON {"k": _id})? */
static int held_key_is(const ml_lease *l, const uint8_t *key, size_t keylen) {
  bson_t b, k;
  int same;
  if (!bson_init_static(&b, key, keylen)) return 0;
  bson_init(&k);
  bson_append_value(&k, "k", 1, &l->id);
  same = k.len == b.len && memcmp(bson_get_data(&k), key, keylen) == 0;
  bson_destroy(&k);
  return same;
}

void ml_held_notice(ml_client *c, const char *db, const char *coll, const uint8_t *key,
                    size_t keylen, const char *owner, uint32_t t, uint32_t i) {
  ml_lease *l;
  pid_t pid = ml_pid();
  pthread_mutex_lock(&renew_mu);
  for (l = c->held; l; l = l->hnext) {
    if (l->kind != ML_KIND_NAMED || l->pid != pid || strcmp(l->db, db) || strcmp(l->coll, coll))
      continue;
    if (owner[0] ? strcmp(l->owner, owner) != 0
                 : !(l->op_t && (t > l->op_t || (t == l->op_t && i > l->op_i))))
      continue;
    if (!held_key_is(l, key, keylen)) continue;
    ml_lease_lock(l);
    if (l->held && !l->ending) ml_lease_set_lost(l);
    ml_lease_unlock(l);
  }
  pthread_mutex_unlock(&renew_mu);
}

int ml_held_any(ml_client *c, const char *db, const char *coll, const char *field) {
  ml_lease *l;
  pid_t pid = ml_pid();
  double now = ml_monotonic();
  int any = 0;
  pthread_mutex_lock(&renew_mu);
  /* the first one found ends the walk: a client holding tens of thousands
   * of leases of one collection answers at once */
  for (l = c->held; l && !any; l = l->hnext) {
    if (l->kind != ML_KIND_NAMED || l->pid != pid || strcmp(l->db, db) || strcmp(l->coll, coll) ||
        strcmp(l->owner_field, field))
      continue;
    if (!l->watched && !c->external) continue;
    ml_lease_lock(l);
    any = l->held && !l->ending && now < l->deadline;
    ml_lease_unlock(l);
  }
  pthread_mutex_unlock(&renew_mu);
  return any;
}

/*
 * renew_mu held.  A closing client's leases still held in this process go
 * to the release queue (sent in batches before the engine stops); every
 * lease leaves c's list.
 */
static void queue_held(ml_client *c, ml_renew *st) {
  while (c->held) {
    ml_lease *l = c->held;
    int take;
    held_unlink_locked(l);
    ml_lease_lock(l);
    take = st && l->held && !l->ending && l->pid == ml_pid();
    if (take) {
      l->ending = 1;
      l->refs++;
    }
    ml_lease_unlock(l);
    if (take) {
      if (!ml_engine_queue_release(&st->e, l)) ml_lease_unref(l);
    }
  }
}

/* renew_mu held: takes st out of the process's states and off c */
static void state_unlink(ml_client *c, ml_renew *st) {
  ml_renew **p;
  for (p = &states; *p; p = &(*p)->next) {
    if (*p == st) {
      *p = st->next;
      break;
    }
  }
  c->renew_state = NULL;
}

static void state_free(ml_renew *st) {
  holdq_clear(st);
  ml_engine_clear(&st->e, 1);
  ml_obs_unref(st->obs);
  pthread_cond_destroy(&st->cv);
  pthread_cond_destroy(&st->done);
  free(st);
}

/* stops c's engine in this process, if any (pool still valid), after the
 * releases of what c's handles still hold are sent */
static void renew_stop(ml_client *c) {
  ml_renew *st;
  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if ((!c->external || (st && !st->external)) && c->pool && c->pid == ml_pid()) {
    int any = 0;
    ml_lease *l;
    for (l = c->held; l && !any; l = l->hnext) {
      ml_lease_lock(l);
      any = l->held && !l->ending && l->pid == ml_pid();
      ml_lease_unlock(l);
    }
    if (any && (!st || st->pid != ml_pid())) st = state_get(c, c->pool);
    queue_held(c, st && st->pid == ml_pid() ? st : NULL);
  } else {
    queue_held(c, NULL);
  }
  if (!st || st->pid != ml_pid()) {
    pthread_mutex_unlock(&renew_mu);
    return;
  }
  if (st->external) {
    state_unlink(c, st);
    state_free(st);
    pthread_mutex_unlock(&renew_mu);
    return;
  }
  st->e.stop = 1;
  pthread_cond_signal(&st->cv);
  if (st->scanning && !st->e.n && !st->e.nrel && (st->orphan = ml_orphan_take(c)) != NULL) {
    /* inside a server selection, which may wait for a server that is gone
     * up to serverSelectionTimeoutMS, with nothing left to release: close
     * does not wait for it.  The thread frees its state and drops its
     * reference to the pool when the selection returns. */
    state_unlink(c, st);
    pthread_detach(st->thread);
    pthread_mutex_unlock(&renew_mu);
    ml_pin_library();
    return;
  }
  pthread_mutex_unlock(&renew_mu);
  pthread_join(st->thread, NULL);
  pthread_mutex_lock(&renew_mu);
  state_unlink(c, st);
  state_free(st);
  pthread_mutex_unlock(&renew_mu);
}

/*
 * In this order: the renewal thread is joined (its connection is back in
 * the pool) and the client's own connection pushed before the streams
 * stop, because a stream in a getMore is detached and takes the pool with
 * it: the last such thread destroys it, and nothing of the pool may be
 * out then.
 */
void ml_bg_on_close(ml_client *c) {
  renew_stop(c);
  if (c->client) {
    mongoc_client_pool_push(c->pool, c->client);
    c->client = NULL;
  }
  ml_watch_stop(c);
}

/* ---- the external adapter, seen from Lua ------------------------------- */

/* renew_mu held: c's engine state when this process's external adapter
 * runs it (a state whose thread runs its engine, or a parent's after
 * fork, is none of the adapter's), else NULL */
static ml_renew *external_state(ml_client *c) {
  ml_renew *st = (ml_renew *)c->renew_state;
  return st && st->pid == ml_pid() && st->external ? st : NULL;
}

/* client:engine_next([cap]) -> id, op (a BSON op string, ops.c) | nil,
 * seconds until something may be due (math.huge: nothing held).  cap: the
 * adapter looks again after at most cap seconds when it gets no op (it
 * then calls engine_poked after each lease it made, to know whether it must
 * look sooner) */
static int ml_m_engine_next(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  ml_renew *st;
  double now = ml_monotonic(), wake = now + 3600;
  double cap = luaL_optnumber(L, 2, HUGE_VAL);
  int has = 0;
  luaL_argcheck(L, c->external, 1, "the client's engine runs on its own thread");
  luaL_argcheck(L, cap >= 0, 2, "seconds >= 0 expected");
  pthread_mutex_lock(&renew_mu);
  if ((st = external_state(c)) != NULL) {
    st->poked = 0;
    if (st->e.work.kind == ML_WORK_NONE) has = ml_engine_next(&st->e, now, &wake);
    else if (!st->e.work.handed) has = 1;       /* a check engine_done queued */
    else wake = now + 1;                      /* in flight */
    /* the adapter runs the op, then looks again at once */
    st->wake_at = has ? 0 : (wake - now < cap ? wake : now + cap);
    if (has) {
      /* the op copied out, pushed once renew_mu is released: a push may
       * run the collector, whose finalizers (a handle's __gc) take it */
      bson_t env;
      lua_Integer id = (lua_Integer)st->e.work.id;
      st->e.work.handed = 1;
      ml_op_envelope(&st->e.work.op, &env);
      pthread_mutex_unlock(&renew_mu);
      lua_pushinteger(L, id);
      lua_pushlstring(L, (const char *)bson_get_data(&env), env.len);
      bson_destroy(&env);
      return 2;
    }
    if (st->e.n == 0 && st->e.nrel == 0 && st->e.work.kind == ML_WORK_NONE) wake = HUGE_VAL;
  } else {
    wake = HUGE_VAL;
  }
  pthread_mutex_unlock(&renew_mu);
  lua_pushnil(L);
  lua_pushnumber(L, wake == HUGE_VAL ? HUGE_VAL : (wake > now ? wake - now : 0));
  return 2;
}

/* client:engine_poked() -> true once when a lease made since the external
 * adapter's last look (engine_next) is due before the adapter said it
 * would look again: it is to look now */
static int ml_m_engine_poked(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  ml_renew *st;
  int poked = 0;
  pthread_mutex_lock(&renew_mu);
  if ((st = external_state(c)) != NULL) {
    poked = st->poked;
    st->poked = 0;
  }
  pthread_mutex_unlock(&renew_mu);
  lua_pushboolean(L, poked);
  return 1;
}

/* client:engine_done(id, started, reply, err, code, ereply, domain) -> true:
 * the outcome of the command engine_next gave, as client:run answers it */
static int ml_m_engine_done(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  long id = (long)luaL_checkinteger(L, 2);
  double started = luaL_checknumber(L, 3);
  ml_renew *st;
  bson_t reply;
  bson_error_t err;
  int ok;
  memset(&err, 0, sizeof err);
  ok = ml_arg_outcome(L, 4, &reply, &err);
  pthread_mutex_lock(&renew_mu);
  st = external_state(c);
  if (st && st->e.work.kind != ML_WORK_NONE && st->e.work.id == id) {
    if (ml_engine_done(&st->e, ml_monotonic(), started, ok, &reply, &err))
      pthread_cond_broadcast(&st->done);
    publish(st);
  }
  pthread_mutex_unlock(&renew_mu);
  bson_destroy(&reply);
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- what the specs read (mongolock.testing) -------------------------- */

void ml_renew_stats(ml_client *c, ml_renew_counts *out) {
  ml_renew *st;
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (st && st->pid == ml_pid()) {
    out->running = 1;
    out->leases = (long)st->e.n;
    out->renewals = st->e.renewals;
    out->failures = st->e.failures;
    out->lost = st->e.lost;
    out->released = st->e.released;
    out->batches = st->e.batches;
    out->checks = st->e.checks;
  }
  pthread_mutex_unlock(&renew_mu);
}

int ml_renew_flush(ml_client *c, double timeout) {
  double until = ml_monotonic() + timeout;
  int pending = 0;
  pthread_mutex_lock(&renew_mu);
  for (;;) {
    ml_renew *st = (ml_renew *)c->renew_state;
    pending = 0;
    if (!st || st->pid != ml_pid()) break;
    pending = st->e.nrel > 0 || st->e.work.kind == ML_WORK_RELEASE;
    if (!pending || ml_monotonic() >= until) break;
    if (st->external) {
      pthread_mutex_unlock(&renew_mu);
      ml_sleep(0.005);
      pthread_mutex_lock(&renew_mu);
    } else {
      wait_until(&st->done, until);
    }
  }
  pthread_mutex_unlock(&renew_mu);
  return !pending;
}

void ml_renew_init(void) {
  pthread_once(&atfork_once, install_atfork);
  ml_gc_handoff = renew_handoff;
}

/* Client methods: the lease engine's external adapter (module.c adds them to mongolock.Client) */
const luaL_Reg ml_renew_methods[] = {
  {"engine_next", ml_m_engine_next},
  {"engine_done", ml_m_engine_done},
  {"engine_poked", ml_m_engine_poked},
  {NULL, NULL}
};
