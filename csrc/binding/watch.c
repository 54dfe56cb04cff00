/*
 * Change-stream wake-ups: one stream per process, client, collection and
 * owner field, shared by every waiter.
 *
 * A waiter that lost an attempt at operation time T asks whether a release
 * of its document happened after T.  The stream is opened at
 * startAtOperationTime = T of the waiter that starts it, so every release
 * after that instant reaches it; a waiter whose T is older than the start
 * of the running stream is told to retry at once (its own attempt then
 * returns a newer T), so no release is ever missed between an attempt and
 * the wait.
 *
 * Only releases wake waiters.  A release handed to a queued waiter sets
 * the document's next to that waiter's process tag (16 hex digits) and id
 * (32): the stream's $match passes such an event only in the process with
 * that tag, and there it wakes only the waiter named (a
 * waiter that gives up hands on the same way).  Such a release grants the
 * lock to that waiter in the same write: the event's owner (the waiter's
 * id), token, acquiredAt and expiresAt are kept with it, and the waiter
 * is answered "granted" with them, so it holds the lock without a command.  A release with nobody
 * queued (owner set to null or removed, next not changed), a delete of the
 * document, or an event that ends the stream (drop, rename, invalidate)
 * wakes every waiter of the document.  A replace is read from its new
 * document the same way.  Acquisitions, renewals and waiters' attempts
 * (which write only the queue) pass no filter.
 *
 * Holders: a write that ends a lease of this process without its holder (a
 * takeover, a forced release) names it in lost (process tag and owner id),
 * which the filter passes here alone; the machine keeps it (and a delete)
 * as a notice, handed after each batch, outside watch_mu, to the client's
 * held leases (renew.c, ml_held_notice), which marks the lease lost.  A
 * stream reads on while holders is set: ml_watch_hold sets it for a named
 * lease held ML_HOLD_AFTER, and it is looked at again (ml_held_any) after
 * each batch with events and once a second.
 *
 * The stream is a state machine that never runs a command itself, as the
 * lease engine (engine.c): ml_stream_next (stream.c) says which command to send (the
 * aggregate that opens it, a getMore, the killCursors that ends it, each
 * an op of ops.c in the stream's own session, transport.h) and
 * ml_stream_done takes the reply.  Two adapters run it:
 *   - a thread per stream (the plain path, schedulers): it sends the ops on
 *     a connection of the client's pool in a session of its own
 *     (ml_run_in_session), and waiters block on the stream's cv;
 *   - client:watch_next() / client:watch_done() (a client made external,
 *     inside nginx: mongolock.ngx.runner runs each op as a worker thread's
 *     job); waiters look without blocking and sleep on the event loop.
 * A waiter that must not block (a coroutine of a scheduler) looks without
 * blocking and leaves a Signal (pool.c: an eventfd its loop polls) with
 * what it waits for: when an op of the stream ends (a batch, an opening, a
 * failure) the stream writes the signals of the waiters that have
 * something to look at (the event of their release, a failure, the end of
 * the stream), and all of them when it ends, and forgets those; the
 * waiter then looks again.
 *
 * Invariants:
 * - watch_mu guards every stream and its ring; waiters and the thread wait
 *   on the stream's cv with it.  Nothing else is locked while it is held,
 *   and no Lua function is called (a push may run finalizers: a client's
 *   __gc stops its streams under it).
 * - A detached stream's thread never looks at its client again: the
 *   client's memory may be freed as soon as its close returns.
 * - ring holds the last ML_RING events; drop_t/drop_i is the newest cluster
 *   time pushed out of it, so a waiter whose T is older than that is woken
 *   (it may have missed its event).
 * - At most one op of a stream is in flight (op_kind).  getMores are sent
 *   only while a waiter waits (or looked without blocking less than
 *   POLL_GRACE ago), or a lease is held that wants its notices.  A getMore awaits up to await_ms: for the thread
 *   AWAIT_MS (at most half the socket timeout), longer than a waiter
 *   usually waits, so that a wait costs one getMore; for the external
 *   adapter AWAIT_EXTERNAL, so a job holds a worker thread briefly.
 * - A getMore that fails, or a cursor the server closed, is followed by a
 *   killCursors (which ends the session) and a new aggregate after the
 *   last batch's resume token, so no event is skipped; after ML_STREAM_REOPENS such
 *   failures in a row the stream fails.  A stream whose first aggregate
 *   fails (no change streams: a standalone server) fails at once.  A failed
 *   stream is kept FAILED_FOR seconds, so that its waiters fall back to
 *   polling at once.
 * - A stream ends (killCursors) after ML_STREAM_IDLE seconds without a waiter, or
 *   when its client closes.  Close does not wait for a thread's op in
 *   flight (in_call): it unlinks the stream and detaches the thread, which
 *   ends the stream and frees it when the op returns; the pool is then
 *   handed to those threads (ml_orphan, client.c): the last holder
 *   destroys it.  Otherwise close joins the thread.  The library stays
 *   loaded (pinned) while such a thread may still run.  An external
 *   stream open at close is ended by the adapter's next ops and freed then.
 * - A signal left with a stream holds a reference on it (the Lua side may
 *   close it meanwhile: it is then written no more) until the stream writes
 *   it or is freed.
 * - The thread never touches a lua_State.
 * - fork: watch_mu is held across fork(); the child forgets the parent's
 *   streams without touching them (their threads do not exist there).
 */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "compat.h"
#include "lease.h"
#include "sys.h"
#include "bson_lua.h"
#include "args.h"
#include "client.h"
#include "renew.h"
#include "watch.h"
#include "stream.h"
#include "transport.h"
#include "pool.h"

#define AWAIT_MS 10000          /* a thread's getMore's maxAwaitTimeMS */
#define AWAIT_EXTERNAL 1000     /* the external adapter's */
#define FAILED_FOR 30.0         /* a failed stream is not retried for this long */
#define POLL_GRACE 0.5          /* see polled_until */


/* a signal left by a waiter that does not block: what it waits for */
typedef struct {
  ml_signal *sig;               /* one reference */
  bson_t *key;                  /* {k: _id} */
  char *waiter;                 /* or NULL */
  uint32_t t, i;                /* its attempt's operation time */
} ml_sigwait;

typedef struct ml_watcher {
  struct ml_watcher *next;
  ml_stream m;                  /* the machine (stream.c) */
  ml_client *c;
  mongoc_client_pool_t *pool;   /* NULL: external (no thread) */
  ml_orphan *orphan;            /* detached: the closed client's pool it
                                   shares with its other detached threads */
  pid_t pid;
  pthread_t thread;
  int joinable;                 /* thread not joined yet */
  int in_call;                  /* the thread is in a server call */
  int detached;                 /* closed during a call: the thread frees it */
  pthread_cond_t cv;            /* events, state changes */
  long op_id;                   /* the op in flight's id for the external
                                   adapter */
  ml_obs *obs;                  /* its client's counters (one reference):
                                   every op sent counts there, the
                                   killCursors after close too */
  ml_sigwait *sigs;             /* written when their waiter has something
                                   to look at, then forgotten */
  int nsigs, capsigs;
  long holds;                   /* ml_watch_hold calls so far */
  double counted_at;            /* when holders was last counted again */
  long counted_events;          /* m.events then */
} ml_watcher;

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_watcher *streams;      /* (watch_mu) */
static long op_ids;             /* (watch_mu) */
static void cv_wait_until(pthread_cond_t *cv, double when) {
  struct timespec ts = ml_timespec(when);
  pthread_cond_timedwait(cv, &watch_mu, &ts);
}

/* ---- fork -------------------------------------------------------------- */

static void fork_prepare(void) { pthread_mutex_lock(&watch_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&watch_mu); }
static void fork_child(void) {
  streams = NULL;               /* abandoned: their threads are the parent's */
  pthread_mutex_unlock(&watch_mu);
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
  /* a detached stream thread may outlive every client */
  ml_pin_library();
}

/* ---- signals ----------------------------------------------------------- */

static char *dupstr(const char *p) {
  size_t n = strlen(p) + 1;
  char *d = (char *)malloc(n);
  if (d) memcpy(d, p, n);
  return d;
}


static void sigwait_free(ml_sigwait *w) {
  ml_signal_unref(w->sig);
  if (w->key) bson_destroy(w->key);
  free(w->waiter);
}

/* watch_mu held: writes the signals left with s whose waiter has something
 * to look at (its release seen, the stream failed, ended, or started after
 * the waiter's attempt), or all of them, and forgets those */
static void sigs_notify(ml_watcher *s, int all) {
  int k, n = 0;
  for (k = 0; k < s->nsigs; k++) {
    ml_sigwait *w = &s->sigs[k];
    const watch_event *grant = NULL;
    int mine = 0;
    if (all || s->m.stop || s->m.state != ML_STREAM_RUNNING ||
        ml_ts_after(s->m.start_t, s->m.start_i, w->t, w->i) ||
        ml_stream_seen(&s->m, w->key, w->waiter, w->t, w->i, &grant, &mine)) {
      ml_signal_notify(w->sig);
      sigwait_free(w);
    } else {
      s->sigs[n++] = *w;
    }
  }
  s->nsigs = n;
}

/* watch_mu held: leaves g with s for the waiter (key, waiter, t, i) of its
 * coroutine, in place of what it waited for before */
static void sigs_add(ml_watcher *s, ml_signal *g, const bson_t *key, const char *waiter, uint32_t t,
                     uint32_t i) {
  ml_sigwait w;
  int k;
  memset(&w, 0, sizeof w);
  w.key = bson_copy(key);
  w.waiter = waiter ? dupstr(waiter) : NULL;
  if (!w.key || (waiter && !w.waiter)) {
    sigwait_free(&w);           /* not kept: the waiter looks again within its bound */
    return;
  }
  w.sig = g;
  w.t = t;
  w.i = i;
  ml_signal_ref(g);
  for (k = 0; k < s->nsigs; k++)
    if (s->sigs[k].sig == g) {
      sigwait_free(&s->sigs[k]);
      s->sigs[k] = w;
      return;
    }
  if (s->nsigs == s->capsigs) {
    int cap = s->capsigs ? 2 * s->capsigs : 8;
    ml_sigwait *nw = (ml_sigwait *)realloc(s->sigs, (size_t)cap * sizeof *nw);
    if (!nw) {
      sigwait_free(&w);
      return;
    }
    s->sigs = nw;
    s->capsigs = cap;
  }
  s->sigs[s->nsigs++] = w;
}

/* ---- holders ---------------------------------------------------------- */

/* the notices of a batch, copied out of a stream to be handed to the held
 * leases with watch_mu released (renew.c's mutex is never taken inside it) */
typedef struct notices {
  int n;
  ml_notice v[ML_NOTICES];
  long holds;                   /* s->holds when they were taken */
  int count;                    /* count holders again */
} notices;

/* watch_mu held: takes s's notices into out (the stream keeps none), and
 * whether its holders are to be counted again: after a batch with events
 * (a holder's own release, which marks its lease as ending before it is
 * sent, then stops the getMores at once), else once a second */
static void notices_take(ml_watcher *s, notices *out) {
  double now = ml_monotonic();
  out->n = s->m.nnotices;
  memcpy(out->v, s->m.notices, sizeof out->v[0] * (size_t)out->n);
  s->m.nnotices = 0;            /* the keys are out's now */
  out->holds = s->holds;
  out->count = s->m.holders > 0 && (s->m.events != s->counted_events || now - s->counted_at >= 1.0);
  if (out->count) {
    s->counted_at = now;
    s->counted_events = s->m.events;
  }
}

/*
 * watch_mu not held, s's client alive (close joins the thread, or runs on
 * the thread that calls this): each notice to the client's held leases;
 * then, when asked, the leases still held counted, which keep the stream
 * reading.  Takes watch_mu again to set holders (unless an ml_watch_hold
 * came meanwhile).
 */
static void notices_hand(ml_watcher *s, notices *in) {
  int k, n = 1, count = in->count;
  for (k = 0; k < in->n; k++) {
    ml_notice *x = &in->v[k];
    ml_held_notice(s->c, s->m.db, s->m.coll, x->key, x->keylen, x->owner, x->t, x->i);
    free(x->key);
  }
  /* handed: the next batch's are taken afresh */
  in->n = 0;
  in->count = 0;
  if (count) n = ml_held_any(s->c, s->m.db, s->m.coll, s->m.field);
  pthread_mutex_lock(&watch_mu);
  if (count && n == 0 && s->holds == in->holds && s->m.holders) {
    s->m.holders = 0;
    s->m.idle_since = ml_monotonic();
  }
  pthread_mutex_unlock(&watch_mu);
}

/* ---- the thread adapter ------------------------------------------------ */

static void stream_free(ml_watcher *s);

/* watch_mu held: the outcome of s's op in flight, given to the machine;
 * the op (an aggregate, a getMore, a killCursors) counted as a command of
 * its client, with the getMores and reopenings it made */
static void stream_done(ml_watcher *s, int ok, const bson_t *reply, const bson_error_t *err) {
  int kind = s->m.op_kind;
  long getmores = s->m.getmores, reopens = s->m.reopens;
  ml_stream_done(&s->m, ml_monotonic(), ok, reply, err);
  sigs_notify(s, 0);
  if (!s->obs) return;
  if (kind != ML_STREAM_OP_NONE) ml_obs_add(s->obs, &s->obs->commands, 1);
  ml_obs_add(s->obs, &s->obs->stream_getmores, s->m.getmores - getmores);
  ml_obs_add(s->obs, &s->obs->stream_reopens, s->m.reopens - reopens);
}

static void *watch_main(void *arg) {
  ml_watcher *s = (ml_watcher *)arg;
  mongoc_client_t *mc = NULL;
  mongoc_client_session_t *cs = NULL;
  bson_error_t err;
  int tries;
  notices got;

  memset(&err, 0, sizeof err);
  got.n = 0;
  got.count = 0;
  for (tries = 0; !mc && tries < 50; tries++) {
    mc = mongoc_client_pool_try_pop(s->pool);
    if (!mc) ml_sleep(0.02);
  }
  pthread_mutex_lock(&watch_mu);
  /* the opening's connection is had (or not): no call in flight, so a
   * close reaps the stream (a stream left in_call was never freed, nor its
   * client's pool) */
  s->in_call = 0;
  if (!mc) {
    bson_snprintf(err.message, sizeof err.message, "no free connection in the pool");
    ml_stream_fail(&s->m, &err, ml_monotonic());
  }
  for (;;) {
    double wake;
    if (mc && ml_stream_next(&s->m, ml_monotonic(), &wake)) {
      bson_t reply;
      int ok;
      int kind = s->m.op_kind;
      s->in_call = 1;
      pthread_mutex_unlock(&watch_mu);
      /* the thread keeps the cursor's connection (one of the pool's, so
       * that a failed getMore tells the pool's topology, which acquire
       * reads) and its session: each opening starts one, killCursors or a
       * failed aggregate ends it */
      if (kind == ML_STREAM_OP_OPEN) {
        bson_error_t ignored;
        if (cs) mongoc_client_session_destroy(cs);
        cs = mongoc_client_start_session(mc, NULL, &ignored);   /* NULL: no sessions */
      }
      ok = ml_run_in_session(mc, cs, &s->m.op, &reply, &err);
      if (cs && (kind == ML_STREAM_OP_KILL || (kind == ML_STREAM_OP_OPEN && !ok))) {
        mongoc_client_session_destroy(cs);
        cs = NULL;
      }
      pthread_mutex_lock(&watch_mu);
      s->in_call = 0;
      stream_done(s, ok, &reply, &err);
      bson_destroy(&reply);
      /* a detached stream's client is gone (collected, maybe): its
       * notices with it, and nothing of it is looked at again */
      if (s->detached) ml_stream_notices_clear(&s->m);
      else notices_take(s, &got);
      /* woken after the unlock: a waiter woken while watch_mu is held
       * would block on it at once and need a second wake-up */
      pthread_mutex_unlock(&watch_mu);
      pthread_cond_broadcast(&s->cv);
      /* (in_call is 0: a close joins this thread, so the client lives) */
      if (got.n || got.count) notices_hand(s, &got);
      pthread_mutex_lock(&watch_mu);
      continue;
    }
    if (!mc || ml_stream_finished(&s->m)) break;
    cv_wait_until(&s->cv, wake == HUGE_VAL ? ml_monotonic() + ML_STREAM_IDLE : wake);
  }
  if (s->m.state != ML_STREAM_FAILED) s->m.state = ML_STREAM_DONE;
  sigs_notify(s, 1);
  pthread_cond_broadcast(&s->cv);
  {
    int detached = s->detached;
    ml_orphan *o = s->orphan;
    pthread_mutex_unlock(&watch_mu);
    if (cs) mongoc_client_session_destroy(cs);
    if (mc) mongoc_client_pool_push(s->pool, mc);
    if (detached) {
      stream_free(s);           /* unlinked by close: nobody else sees it */
      if (o) ml_orphan_drop(o);
    }
  }
  return NULL;
}

/* ---- streams ----------------------------------------------------------- */

static void stream_free(ml_watcher *s) {
  sigs_notify(s, 1);
  free(s->sigs);
  ml_obs_unref(s->obs);
  ml_stream_clear(&s->m);
  pthread_cond_destroy(&s->cv);
  free(s);
}

/* watch_mu held: takes s out of the list */
static void stream_unlink(ml_watcher *s) {
  ml_watcher **p;
  for (p = &streams; *p; p = &(*p)->next) {
    if (*p == s) {
      *p = s->next;
      break;
    }
  }
}

/* watch_mu held: unlinks and joins a finished stream, then frees it */
static void stream_reap(ml_watcher *s) {
  stream_unlink(s);
  if (s->joinable) {
    pthread_mutex_unlock(&watch_mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_lock(&watch_mu);
  }
  stream_free(s);
}

/*
 * watch_mu held.  The stream for (c, db, coll, field) in this process,
 * started at (t, i) when there is none (or the last one ended); a failed
 * one is kept for FAILED_FOR seconds so that waiters fall back at once.
 * pool NULL: an external stream (no thread).  NULL on out-of-memory or
 * when no thread can be started.
 */
static ml_watcher *stream_get(ml_client *c, mongoc_client_pool_t *pool, const char *db,
                             const char *coll, const char *field, uint32_t t, uint32_t i) {
  ml_watcher *s, *nx;
  pthread_condattr_t ca;
  sigset_t old;
  pid_t pid = ml_pid();
  int rc;

  for (s = streams; s; s = nx) {
    nx = s->next;
    if (s->c != c || s->pool != pool || s->pid != pid || strcmp(s->m.db, db) ||
        strcmp(s->m.coll, coll) || strcmp(s->m.field, field))
      continue;
    if (s->m.state == ML_STREAM_STARTING || s->m.state == ML_STREAM_RUNNING) return s;
    if (s->m.state == ML_STREAM_FAILED && ml_monotonic() - s->m.failed_at < FAILED_FOR) return s;
    if (s->m.stop && !ml_stream_finished(&s->m)) return s;    /* stopped, not ended yet: "retry" */
    if (s->m.waiters == 0 && ml_stream_finished(&s->m) && !s->in_call) {
      stream_reap(s);
      nx = streams;             /* reaping released watch_mu: walk again */
    }
  }
  s = (ml_watcher *)calloc(1, sizeof *s);
  if (!s) return NULL;
  s->m.db = dupstr(db);
  s->m.coll = dupstr(coll);
  s->m.field = dupstr(field);
  if (!s->m.db || !s->m.coll || !s->m.field) {
    free(s->m.db);
    free(s->m.coll);
    free(s->m.field);
    free(s);
    return NULL;
  }
  s->obs = ml_obs_ref(c->obs);
  if (!ml_process_tag(s->m.tag)) memcpy(s->m.tag, "-no-randomness-", 16);
  s->c = c;
  s->pool = pool;
  s->pid = pid;
  s->m.start_t = t;
  s->m.start_i = i;
  s->m.drop_t = t;
  s->m.drop_i = i;
  {
    int32_t sock = mongoc_uri_get_option_as_int32(c->uri, MONGOC_URI_SOCKETTIMEOUTMS, 0);
    s->m.await_ms = pool ? AWAIT_MS : AWAIT_EXTERNAL;
    if (sock > 0 && sock / 2 < s->m.await_ms) s->m.await_ms = sock / 2;
  }
  s->m.state = ML_STREAM_STARTING;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (pool) {
    s->in_call = 1;             /* the thread opens the stream first */
    ml_signals_block(&old);
    rc = pthread_create(&s->thread, NULL, watch_main, s);
    ml_signals_restore(&old);
    if (rc != 0) {
      stream_free(s);
      return NULL;
    }
    s->joinable = 1;
  }
  s->next = streams;
  streams = s;
  c->on_close = ml_bg_on_close;
  return s;
}

void ml_watch_stop(ml_client *c) {
  ml_watcher *s;
  pid_t pid = ml_pid();
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next)
    if (s->c == c && s->pid == pid) {
      s->m.stop = 1;
      sigs_notify(s, 1);
      pthread_cond_broadcast(&s->cv);
    }
  for (s = streams; s;) {
    ml_orphan *o;
    if (s->c != c || s->pid != pid) {
      s = s->next;
    } else if (!s->pool) {
      /* external: the adapter's next ops end an open one (watch_next
       * frees it then); a waiter meanwhile is told to retry */
      if (s->m.open || s->m.op_kind) {
        if (s->m.state != ML_STREAM_FAILED) s->m.state = ML_STREAM_DONE;
        s = s->next;
      } else {
        stream_unlink(s);
        stream_free(s);
        s = streams;
      }
    } else if (s->in_call && s->joinable && (o = ml_orphan_take(c)) != NULL) {
      /* in a call: do not wait for it, the thread ends the stream and
       * frees it when the call returns, the last one the pool */
      stream_unlink(s);
      s->orphan = o;
      s->detached = 1;
      s->joinable = 0;
      pthread_detach(s->thread);
      s = streams;
    } else {
      stream_reap(s);
      s = streams;
    }
  }
  pthread_mutex_unlock(&watch_mu);
}

/* ---- the external adapter, seen from Lua ------------------------------- */

/* client:watch_next() -> id, op (a BSON op string) | nil, seconds until
 * something may be due (math.huge: no stream of the client needs one) */
static int ml_m_watch_next(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);   /* closed too */
  ml_watcher *s, *nx;
  double now = ml_monotonic(), wake = HUGE_VAL, w;
  pid_t pid = ml_pid();
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = nx) {
    nx = s->next;
    if (s->c != c || s->pid != pid || s->pool) continue;
    if (s->m.op_kind) {
      if (now + 1 < wake) wake = now + 1;     /* in flight */
      continue;
    }
    if (ml_stream_next(&s->m, now, &w)) {
      /* the op copied out, pushed once watch_mu is released: a push may
       * run the collector, whose finalizers (a client's __gc) take it */
      bson_t env;
      lua_Integer id = (lua_Integer)(s->op_id = ++op_ids);
      ml_op_envelope(&s->m.op, &env);
      pthread_mutex_unlock(&watch_mu);
      lua_pushinteger(L, id);
      lua_pushlstring(L, (const char *)bson_get_data(&env), env.len);
      bson_destroy(&env);
      return 2;
    }
    if (s->m.stop && ml_stream_finished(&s->m)) {
      stream_unlink(s);
      stream_free(s);
    } else if (w < wake) {
      wake = w;
    }
  }
  pthread_mutex_unlock(&watch_mu);
  lua_pushnil(L);
  lua_pushnumber(L, wake == HUGE_VAL ? HUGE_VAL : (wake > now ? wake - now : 0));
  return 2;
}

/* client:watch_done(id, reply, err, code, ereply, domain) -> true: the
 * outcome of the op watch_next gave, as client:run answers it; waiters
 * look again after it */
static int ml_m_watch_done(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);   /* closed too */
  long id = (long)luaL_checkinteger(L, 2);
  ml_watcher *s;
  bson_t reply;
  bson_error_t err;
  int ok;
  notices got;
  memset(&err, 0, sizeof err);
  ok = ml_arg_outcome(L, 3, &reply, &err);
  got.n = 0;
  got.count = 0;
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next)
    if (s->c == c && s->pid == ml_pid() && !s->pool && s->m.op_kind && s->op_id == id) {
      stream_done(s, ok, &reply, &err);
      if (s->m.stop && ml_stream_finished(&s->m)) {
        stream_unlink(s);
        stream_free(s);
        s = NULL;
      } else {
        notices_take(s, &got);
      }
      break;
    }
  pthread_mutex_unlock(&watch_mu);
  /* s is only freed by this client's calls on this thread (watch_next,
   * watch_done, watch_stop), none of which can run meanwhile */
  if (s && (got.n || got.count)) notices_hand(s, &got);
  bson_destroy(&reply);
  lua_pushboolean(L, 1);
  return 1;
}

/* client:watch_stop() -> true: ends the client's streams in this process
 * (an nginx worker that is shutting down): their waiters are told to
 * retry, and the adapter's next ops end the open ones */
static int ml_m_watch_stop(lua_State *L) {
  ml_watch_stop((ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT));
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- Lua --------------------------------------------------------------- */

static uint32_t check_u32(lua_State *L, int idx) {
  lua_Number n = luaL_checknumber(L, idx);
  luaL_argcheck(L, n >= 0 && n <= 4294967295.0 && n == (lua_Number)(uint32_t)n, idx,
                "timestamp part out of range");
  return (uint32_t)n;
}

/*
 * core.watch_wait(client, db, coll, field, id, t, i, timeout [, waiter [, sig]])
 *   -> "event" | "granted", token | "timeout" | "retry" |
 *      nil, message, code
 *
 * Waits up to timeout seconds (0: just looks) for a release of the lock
 * document whose _id is id (a named lock's string, or a document's _id of
 * any BSON type), made after the operation time
 * (t, i) of the caller's failed attempt.  With waiter (a queued acquire's
 * id) a release handed to another waiter does not wake it, and a release
 * that granted the lock to waiter answers "granted" with the token: the
 * waiter owns the lock, no attempt needed (client:granted makes its handle,
 * the deadline from the waiter's own latest attempt).
 * "retry": the shared stream began
 * after (t, i) and cannot vouch for that interval; attempt again at once.
 * nil, message: the stream failed (standalone server, no change streams,
 * an error it could not resume from); the caller falls back to polling.
 * Blocks the calling thread: inside nginx call it with timeout 0 and sleep
 * cooperatively between calls.  A client made external (its streams read
 * by client:watch_next / watch_done) never blocks: with timeout 0 it
 * looks, with more it answers nil, message (no stream can be read here).
 * With sig (a Signal, core.signal) it never blocks either: it looks, and
 * on "timeout" leaves sig with the stream, which writes it when it has
 * read something (or failed, or ended), and keeps reading for timeout
 * seconds: the caller waits on sig's descriptor, then calls again.
 */
static int l_watch_wait(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = luaL_checkstring(L, 2);
  const char *coll = luaL_checkstring(L, 3);
  const char *field = luaL_checkstring(L, 4);
  uint32_t t = check_u32(L, 6), i = check_u32(L, 7);
  double timeout = luaL_checknumber(L, 8);
  const char *waiter = luaL_optstring(L, 9, NULL);
  ml_signal *sig = lua_isnoneornil(L, 10) ? NULL : ml_check_signal(L, 10);
  double grace = 0;
  mongoc_client_pool_t *pool;
  ml_watcher *s;
  bson_t key;
  double deadline;
  const char *res;
  const watch_event *grant = NULL;
  int64_t token = 0;
  int mine = 0;

  luaL_argcheck(L, timeout == timeout, 8, "not a number");
  luaL_argcheck(L, strlen(field) > 0 && strlen(field) < 200, 4, "bad field name");
  pool = c->external ? NULL : ml_client_pool(L, c);
  pthread_once(&atfork_once, install_atfork);
  if (sig) {
    grace = timeout;            /* it looks; the stream reads that long */
    timeout = 0;
  }
  if (c->external && timeout > 0)
    return ml_pushfail(L, "change stream: this client's streams are read by its event loop, "
                          "which cannot run while this call blocks", 0);
  deadline = ml_monotonic() + (timeout > 0 ? timeout : 0);
  bson_init(&key);
  {
    /* {k: id}, the _id of any type as the stream's documentKey has it */
    char err[256];
    int ok;
    luaL_argcheck(L, !lua_isnoneornil(L, 5), 5, "_id expected, got nil");
    lua_createtable(L, 0, 1);
    lua_pushvalue(L, 5);
    lua_setfield(L, -2, "k");
    ok = ml_tobson(L, -1, &key, err, sizeof err);
    lua_pop(L, 1);
    if (!ok) {
      bson_destroy(&key);
      return luaL_argerror(L, 5, err);
    }
  }

  pthread_mutex_lock(&watch_mu);
  s = stream_get(c, pool, db, coll, field, t, i);
  if (!s) {
    pthread_mutex_unlock(&watch_mu);
    bson_destroy(&key);
    return ml_pushfail(L, "change stream: cannot start its thread", 0);
  }
  s->m.waiters++;
  /* the thread reads while anyone waits; a non-blocking caller (OpenResty)
   * comes back within 20 ms, so it counts as waiting a while longer */
  if (!(timeout > 0)) {
    double until = ml_monotonic() + (grace > POLL_GRACE ? grace : POLL_GRACE);
    if (until > s->m.polled_until) s->m.polled_until = until;
  }
  pthread_cond_broadcast(&s->cv);
  for (;;) {
    if (s->m.state == ML_STREAM_FAILED) {
      /* copied out, and pushed with watch_mu released: a push may run the
       * collector, whose finalizers (a client's close) take watch_mu */
      char msg[sizeof s->m.errmsg];
      uint32_t code = s->m.errcode;
      memcpy(msg, s->m.errmsg, sizeof msg);
      s->m.waiters--;
      s->m.idle_since = ml_monotonic();
      pthread_mutex_unlock(&watch_mu);
      bson_destroy(&key);
      lua_pushnil(L);
      lua_pushstring(L, msg);
      if (code) lua_pushinteger(L, (lua_Integer)code);
      else lua_pushnil(L);
      return 3;
    }
    if (s->m.state == ML_STREAM_DONE || s->m.stop) { res = "retry"; break; }
    if (s->m.state == ML_STREAM_RUNNING) {
      if (ml_ts_after(s->m.start_t, s->m.start_i, t, i)) { res = "retry"; break; }
      int r = ml_stream_seen(&s->m, &key, waiter, t, i, &grant, &mine);
      if (r == 2) {
        res = "granted";
        token = grant->token;
        break;
      }
      if (r) { res = "event"; break; }
    }
    if (ml_monotonic() >= deadline) { res = "timeout"; break; }
    cv_wait_until(&s->cv, deadline);
  }
  s->m.waiters--;
  s->m.idle_since = ml_monotonic();
  if (sig && res[0] == 't') sigs_add(s, sig, &key, waiter, t, i);
  if (res[0] == 'e' || res[0] == 'g') s->m.answered++;
  if (res[0] == 'g') s->m.granted++;
  if (mine) s->m.handed++;
  pthread_mutex_unlock(&watch_mu);
  bson_destroy(&key);
  lua_pushstring(L, res);
  if (res[0] != 'g') return 1;
  ml_pushint64(L, token);
  return 2;
}

void ml_watch_hold(ml_client *c, mongoc_client_pool_t *pool, const ml_lease *l) {
  ml_watcher *s;
  pid_t pid = ml_pid();
  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next)
    if (s->c == c && s->pool == pool && s->pid == pid && !strcmp(s->m.db, l->db) &&
        !strcmp(s->m.coll, l->coll) && !strcmp(s->m.field, l->owner_field) &&
        (s->m.state == ML_STREAM_STARTING || s->m.state == ML_STREAM_RUNNING))
      break;
  /* none running: one from the acquire's operation time, when it is known
   * (a standalone server gives none, and has no change streams); an
   * external client's are opened for waiters alone */
  if (!s && l->op_t && pool)
    s = stream_get(c, pool, l->db, l->coll, l->owner_field, l->op_t, l->op_i);
  if (s && (s->m.state == ML_STREAM_STARTING || s->m.state == ML_STREAM_RUNNING)) {
    s->holds++;
    if (!s->m.holders) {
      s->m.holders = 1;
      s->counted_at = ml_monotonic();
      pthread_cond_broadcast(&s->cv);
    }
  }
  pthread_mutex_unlock(&watch_mu);
}

void ml_watch_stats(ml_client *c, ml_watch_counts *out) {
  ml_watcher *s;
  pid_t pid = ml_pid();
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next) {
    if (s->c != c || s->pid != pid) continue;
    if (s->m.state == ML_STREAM_RUNNING || s->m.state == ML_STREAM_STARTING) {
      out->streams++;
      if (s->pool) out->threads++;
    }
    if (s->m.state == ML_STREAM_FAILED) out->failed++;
    out->events += s->m.events;
    out->reopens += s->m.reopens;
    out->getmores += s->m.getmores;
    out->opens += s->m.opens;
    out->answered += s->m.answered;
    out->granted += s->m.granted;
    out->handed += s->m.handed;
  }
  pthread_mutex_unlock(&watch_mu);
}

void ml_watch_open(lua_State *L) {
  pthread_once(&atfork_once, install_atfork);
  lua_pushcfunction(L, l_watch_wait);
  lua_setfield(L, -2, "watch_wait");
}

/* Client methods: the change streams' external adapter (module.c adds them to mongolock.Client) */
const luaL_Reg ml_watch_methods[] = {
  {"watch_next", ml_m_watch_next},
  {"watch_done", ml_m_watch_done},
  {"watch_stop", ml_m_watch_stop},
  {NULL, NULL}
};
