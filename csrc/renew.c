/*
 * Background renewal of leases, the release of handles collected while
 * held, and the server selections that waiters ask for (ml_renew_scan).
 *
 * One renewal thread per client and process, started on the first lease
 * that asks for renewal (or the first handle collected while held) and
 * stopped by the client's close.  It pops its own connection from the
 * client's pool and never touches a lua_State.
 *
 * A registered lease is renewed with its last ttl once a third of that ttl
 * has passed since the last successful acquire or extend (at deadline -
 * 2/3 ttl).  A renewal that matches nothing marks it lost at once; a
 * renewal that fails is retried every ttl/10 (50 ms .. 1 s), and a lease
 * that reaches its local deadline without a successful renewal is marked
 * lost.  Lost means held = 0, lost = 1: the Lua side reads both.  A
 * collected handle's release is ml_lease_end, the one release of every
 * handle (lock.c).
 *
 * Invariants:
 * - renew_mu guards every ml_renew and its items.  The thread takes a
 *   lease's mu only while it holds renew_mu, except inside the one command
 *   it is running on st->busy (ml_lease_extend / ml_lease_release).  Lock
 *   order is renew_mu, then a lease's mu; the Lua side takes a lease's mu
 *   alone, or after renew_mu.
 * - A lease appears in at most one item of one state; each item owns one
 *   reference to its lease.  Only the thread unlinks and frees items.
 * - fork: the prepare handler holds renew_mu and the busy lease's mu across
 *   fork(), so the child inherits no mutex held by a renewal thread.  In the
 *   child the parent's states are abandoned (never joined, never freed:
 *   their threads do not exist there) and new ones are made on first use.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mongolock.h"

typedef struct renew_item {
  struct renew_item *next;
  ml_lease *lease;              /* one reference owned by this item */
  int release;                  /* collected while held: release, then drop */
  double retry_at;              /* after a failed renewal: not before this */
} renew_item;

typedef struct ml_renew {
  struct ml_renew *next;        /* all states of this process (renew_mu) */
  ml_client *c;                 /* owner; outlives the thread (close joins) */
  mongoc_client_pool_t *pool;   /* c's pool in this process */
  pid_t pid;                    /* process the thread runs in */
  pthread_t thread;
  pthread_cond_t cv;            /* new work or stop */
  pthread_cond_t done;          /* a release was sent (ml_renew_flush) */
  renew_item *items;
  renew_item *busy;             /* item whose command runs outside renew_mu */
  double wake_at;               /* the thread sleeps until then; 0 while it
                                   runs (it looks at every item before it
                                   sleeps again) */
  int scan;                     /* a server selection is asked for */
  int scanning;                 /* the thread is inside it (do_scan) */
  ml_orphan *orphan;            /* detached by close inside a selection:
                                   the thread frees this state and drops
                                   the pool when it returns */
  int stop;
  /* counters for ml_renew_stats */
  long renewals, failures, lost, released;
} ml_renew;

static pthread_mutex_t renew_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_renew *states;        /* (renew_mu) */

/* ---- fork -------------------------------------------------------------- */

static void fork_prepare(void) {
  ml_renew *st;
  pthread_mutex_lock(&renew_mu);
  for (st = states; st; st = st->next) {
    if (st->pid == getpid() && st->busy) {
      /* at most one thread runs a command at a time per state; states of
       * several clients may each have one: lock them all */
      pthread_mutex_lock(&st->busy->lease->mu);
    }
  }
}

static void fork_parent(void) {
  ml_renew *st;
  for (st = states; st; st = st->next)
    if (st->pid == getpid() && st->busy) pthread_mutex_unlock(&st->busy->lease->mu);
  pthread_mutex_unlock(&renew_mu);
}

static void fork_child(void) {
  ml_renew *st;
  /* the parent's pid is still recorded in the states: unlock what the
   * prepare handler locked, then forget them all */
  for (st = states; st; st = st->next)
    if (st->busy) pthread_mutex_unlock(&st->busy->lease->mu);
  states = NULL;
  pthread_mutex_unlock(&renew_mu);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* ---- the thread -------------------------------------------------------- */

static void wait_until(pthread_cond_t *cv, double when) {
  struct timespec ts = ml_timespec(when);
  pthread_cond_timedwait(cv, &renew_mu, &ts);
}

/* renew_mu held: unlinks it and drops its reference */
static void item_drop(ml_renew *st, renew_item *it) {
  renew_item **p = &st->items;
  while (*p && *p != it) p = &(*p)->next;
  if (*p) *p = it->next;
  ml_lease_unref(it->lease);
  free(it);
}

static double retry_delay(int64_t ttl_ms) {
  double d = (double)ttl_ms / 10000.0;
  if (d < 0.05) d = 0.05;
  if (d > 1.0) d = 1.0;
  return d;
}

/* l->mu held: when a held, renewed (or topped-up) lease is due for its
 * renewal */
static double renew_at(const ml_lease *l) {
  double at = l->deadline - (double)l->ttl_ms * (2.0 / 3.0) / 1000.0;
  /* a grant's short lease is extended to the ttl once (ml_lock_new) */
  if (!l->renew || (l->topup_at && l->topup_at < at)) at = l->topup_at;
  return at;
}

/*
 * renew_mu held.  Drops items whose lease no longer wants renewal, marks
 * leases past their deadline lost, and returns the item to work on now (a
 * release first, else a renewal that is due), or NULL and the time to
 * wake up in *wake.
 */
static renew_item *next_work(ml_renew *st, double now, double *wake) {
  renew_item *it, *nx, *due = NULL;
  *wake = now + 3600;
  for (it = st->items; it; it = nx) {
    ml_lease *l = it->lease;
    int drop = 0;
    nx = it->next;
    if (it->release) return it;
    pthread_mutex_lock(&l->mu);
    if (!l->held || (!l->renew && !l->topup_at) || st->stop) {
      drop = 1;
    } else if (l->ending) {
      /* the Lua side is releasing it: no renewal, no verdict */
    } else if (now >= l->deadline) {
      l->held = 0;
      l->lost = 1;
      drop = 1;
    } else {
      double at = renew_at(l);
      if (at < it->retry_at) at = it->retry_at;
      if (at <= now) {
        if (!due) due = it;
      } else {
        if (at < *wake) *wake = at;
      }
      if (l->deadline < *wake) *wake = l->deadline;
    }
    /* every loss of a renewed lease is counted here, once, whoever found
     * it: a renewal, this deadline, or the Lua side's own look at it */
    if (drop && l->lost) st->lost++;
    pthread_mutex_unlock(&l->mu);
    if (drop) item_drop(st, it);
  }
  return due;
}

/* renew_mu held on entry and exit; runs the command of it without it */
static void do_work(ml_renew *st, mongoc_client_t *mc, renew_item *it) {
  ml_lease *l = it->lease;
  bson_error_t err;
  int r;
  int64_t ttl;
  double started;

  st->busy = it;
  if (it->release) {
    pthread_mutex_unlock(&renew_mu);
    r = ml_lease_end(mc, st->c, l, NULL, &err);
    pthread_mutex_lock(&renew_mu);
    st->busy = NULL;
    pthread_mutex_lock(&l->mu);
    l->held = 0;                /* collected: not sent is ended too */
    pthread_mutex_unlock(&l->mu);
    if (r == 1) st->released++;
    item_drop(st, it);
    pthread_cond_broadcast(&st->done);
    return;
  }
  pthread_mutex_lock(&l->mu);
  ttl = l->ttl_ms;
  pthread_mutex_unlock(&l->mu);
  pthread_mutex_unlock(&renew_mu);
  started = ml_monotonic();
  r = ml_lease_extend(mc, st->c, l, ttl, started, &err);
  pthread_mutex_lock(&renew_mu);
  st->busy = NULL;
  /* r == 0: matched nothing, expired and taken or the document gone
   * (ml_lease_extend marked it lost, unless a release is under way or
   * done): next_work drops it and counts the loss */
  if (r == 1) {
    st->renewals++;
    it->retry_at = 0;
  } else if (r < 0) {
    st->failures++;
    it->retry_at = ml_monotonic() + retry_delay(ttl);
  }
}

/*
 * A server selection for writes, for a waiter that found no writable server
 * among the monitors' descriptions (private.lua, await_server).  After a
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

static void *renew_main(void *arg) {
  ml_renew *st = (ml_renew *)arg;
  mongoc_client_t *mc = NULL;
  double wake;

  pthread_mutex_lock(&renew_mu);
  for (;;) {
    double now = ml_monotonic();
    renew_item *work;
    if (!mc && (st->items || st->scan)) {
      /* try_pop: a pool exhausted by the Lua side must not block close */
      pthread_mutex_unlock(&renew_mu);
      mc = mongoc_client_pool_try_pop(st->pool);
      pthread_mutex_lock(&renew_mu);
    }
    work = next_work(st, now, &wake);
    if (work && mc) {
      do_work(st, mc, work);
      continue;
    }
    if (st->scan && mc && !st->stop) {
      st->scan = 0;
      st->scanning = 1;
      pthread_mutex_unlock(&renew_mu);
      do_scan(mc);
      pthread_mutex_lock(&renew_mu);
      st->scanning = 0;
      continue;
    }
    if (st->stop) {
      /* no connection for the releases left: those leases expire */
      while (st->items) item_drop(st, st->items);
      pthread_cond_broadcast(&st->done);
      break;
    }
    if (work || (!mc && (st->items || st->scan))) wake = now + 0.1;   /* no connection yet */
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
      free(st);
      ml_orphan_drop(o);
    }
  }
  return NULL;
}

/* ---- states ------------------------------------------------------------ */

/*
 * renew_mu held.  c's state in this process, started when missing; NULL
 * when the thread cannot be started.
 */
static ml_renew *state_get(ml_client *c, mongoc_client_pool_t *pool) {
  ml_renew *st = (ml_renew *)c->renew_state;
  pthread_condattr_t ca;
  sigset_t all, old;
  int rc;

  if (st && st->pid == getpid() && st->pool == pool) return st;
  /* a state from another process (or pool) is abandoned, not freed */
  st = (ml_renew *)calloc(1, sizeof *st);
  if (!st) return NULL;
  st->c = c;
  st->pool = pool;
  st->pid = getpid();
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&st->cv, &ca);
  pthread_cond_init(&st->done, &ca);
  pthread_condattr_destroy(&ca);
  /* the thread takes no signal: they belong to the application */
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = pthread_create(&st->thread, NULL, renew_main, st);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    pthread_cond_destroy(&st->cv);
    pthread_cond_destroy(&st->done);
    free(st);
    return NULL;
  }
  st->next = states;
  states = st;
  c->renew_state = st;
  c->on_close = ml_bg_on_close;
  return st;
}

/* renew_mu held: the item of l in st, or NULL */
static renew_item *item_find(ml_renew *st, ml_lease *l) {
  renew_item *it;
  for (it = st->items; it; it = it->next)
    if (it->lease == l) return it;
  return NULL;
}

int ml_renew_add(lua_State *L, ml_client *c, ml_lease *l) {
  mongoc_client_pool_t *pool = ml_client_pool(L, c);   /* raises if closed */
  ml_renew *st;
  renew_item *it;

  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, pool);
  it = st ? item_find(st, l) : NULL;
  if (st && !it) {
    it = (renew_item *)calloc(1, sizeof *it);
    if (it) {
      it->lease = l;
      pthread_mutex_lock(&l->mu);
      l->refs++;
      pthread_mutex_unlock(&l->mu);
      it->next = st->items;
      st->items = it;
    }
  }
  if (it) {
    /* wake the thread only when it sleeps past the time this lease is
     * due (a running one sees it before it sleeps): a wake-up costs the
     * caller (an acquire returning) a system call and the thread's run
     * beside it */
    double due;
    pthread_mutex_lock(&l->mu);
    due = renew_at(l);
    if (l->deadline < due) due = l->deadline;
    pthread_mutex_unlock(&l->mu);
    if (due < st->wake_at) pthread_cond_signal(&st->cv);
  }
  pthread_mutex_unlock(&renew_mu);
  if (!it) {
    pthread_mutex_lock(&l->mu);
    l->renew = 0;
    pthread_mutex_unlock(&l->mu);
    return 0;
  }
  return 1;
}

int ml_renew_scan(lua_State *L, ml_client *c) {
  mongoc_client_pool_t *pool = ml_client_pool(L, c);   /* raises if closed */
  ml_renew *st;
  pthread_once(&atfork_once, install_atfork);
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
 * ml_gc_handoff: the handle of a held lease was collected.  Takes over the
 * handle's reference and queues the release for the thread; returns 0 (the
 * caller then releases synchronously) when this process cannot.
 */
static int renew_handoff(ml_client *c, ml_lease *l) {
  ml_renew *st;
  renew_item *it;
  if (c->closed || !c->pool || c->pid != getpid() || l->pid != getpid()) return 0;
  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, c->pool);
  if (!st) {
    pthread_mutex_unlock(&renew_mu);
    return 0;
  }
  it = item_find(st, l);
  if (it) {
    /* already renewed by us: our reference is enough */
    it->release = 1;
    ml_lease_unref(l);
  } else {
    it = (renew_item *)calloc(1, sizeof *it);
    if (!it) {
      pthread_mutex_unlock(&renew_mu);
      return 0;
    }
    it->lease = l;
    it->release = 1;
    it->next = st->items;
    st->items = it;
  }
  pthread_cond_signal(&st->cv);
  pthread_mutex_unlock(&renew_mu);
  return 1;
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

/* stops c's renewal thread in this process, if any (pool still valid) */
static void renew_stop(ml_client *c) {
  ml_renew *st;
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (!st || st->pid != getpid()) {
    pthread_mutex_unlock(&renew_mu);
    return;
  }
  st->stop = 1;
  pthread_cond_signal(&st->cv);
  if (st->scanning && !st->items && (st->orphan = ml_orphan_take(c)) != NULL) {
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
  pthread_mutex_unlock(&renew_mu);
  pthread_cond_destroy(&st->cv);
  pthread_cond_destroy(&st->done);
  free(st);
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

/* ---- what the specs read (mongolock.testing) -------------------------- */

void ml_renew_stats(ml_client *c, ml_renew_counts *out) {
  ml_renew *st;
  renew_item *it;
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (st && st->pid == getpid()) {
    out->running = 1;
    for (it = st->items; it; it = it->next) out->leases++;
    out->renewals = st->renewals;
    out->failures = st->failures;
    out->lost = st->lost;
    out->released = st->released;
  }
  pthread_mutex_unlock(&renew_mu);
}

int ml_renew_flush(ml_client *c, double timeout) {
  double until = ml_monotonic() + timeout;
  int pending = 0;
  pthread_mutex_lock(&renew_mu);
  for (;;) {
    ml_renew *st = (ml_renew *)c->renew_state;
    renew_item *it;
    pending = 0;
    if (!st || st->pid != getpid()) break;
    for (it = st->items; it; it = it->next)
      if (it->release) pending = 1;
    if (!pending || ml_monotonic() >= until) break;
    wait_until(&st->done, until);
  }
  pthread_mutex_unlock(&renew_mu);
  return !pending;
}

void ml_renew_init(void) {
  pthread_once(&atfork_once, install_atfork);
  ml_gc_handoff = renew_handoff;
}
