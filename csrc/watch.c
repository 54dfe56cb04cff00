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
 * The stream is a state machine that never runs a command itself, as the
 * lease engine (renew.c): stream_next says which command to send (the
 * aggregate that opens it, a getMore, the killCursors that ends it, each
 * an op of ops.c in the stream's own session, transport.h) and
 * stream_done takes the reply.  Two adapters run it:
 *   - a thread per stream (the plain path, schedulers): it sends the ops on
 *     a connection of the client's pool in a session of its own
 *     (ml_run_in_session), and waiters block on the stream's cv;
 *   - client:watch_next() / client:watch_done() (a client made external,
 *     inside nginx: mongolock.ngx.core runs each op as a worker thread's
 *     job); waiters look without blocking and sleep on the event loop.
 *
 * Invariants:
 * - watch_mu guards every stream and its ring; waiters and the thread wait
 *   on the stream's cv with it.  Nothing else is locked while it is held.
 * - ring holds the last RING events; drop_t/drop_i is the newest cluster
 *   time pushed out of it, so a waiter whose T is older than that is woken
 *   (it may have missed its event).
 * - At most one op of a stream is in flight (op_kind).  getMores are sent
 *   only while a waiter waits (or looked without blocking less than
 *   POLL_GRACE ago).  A getMore awaits up to await_ms: for the thread
 *   AWAIT_MS (at most half the socket timeout), longer than a waiter
 *   usually waits, so that a wait costs one getMore; for the external
 *   adapter AWAIT_EXTERNAL, so a job holds a worker thread briefly.
 * - A getMore that fails, or a cursor the server closed, is followed by a
 *   killCursors (which ends the session) and a new aggregate after the
 *   last batch's resume token, so no event is skipped; after REOPENS such
 *   failures in a row the stream fails.  A stream whose first aggregate
 *   fails (no change streams: a standalone server) fails at once.  A failed
 *   stream is kept FAILED_FOR seconds, so that its waiters fall back to
 *   polling at once.
 * - A stream ends (killCursors) after IDLE seconds without a waiter, or
 *   when its client closes.  Close does not wait for a thread's op in
 *   flight (in_call): it unlinks the stream and detaches the thread, which
 *   ends the stream and frees it when the op returns; the pool is then
 *   handed to those threads (ml_orphan, client.c): the last holder
 *   destroys it.  Otherwise close joins the thread.  The library stays
 *   loaded (pinned) while such a thread may still run.  An external
 *   stream open at close is ended by the adapter's next ops and freed then.
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

#include "mongolock.h"
#include "transport.h"

#define RING 256
#define AWAIT_MS 10000          /* a thread's getMore's maxAwaitTimeMS */
#define AWAIT_EXTERNAL 1000     /* the external adapter's */
#define IDLE 10.0               /* seconds without a waiter before closing */
#define FAILED_FOR 30.0         /* a failed stream is not retried for this long */
#define REOPENS 3               /* failed calls in a row before the stream fails */
#define POLL_GRACE 0.5          /* see polled_until */

enum { ST_STARTING, ST_RUNNING, ST_FAILED, ST_DONE };
enum { OP_NONE, OP_OPEN, OP_MORE, OP_KILL };

typedef struct watch_event {
  uint8_t *key;                 /* BSON of {"k": documentKey._id}; NULL = any */
  size_t keylen;
  char next[49];                /* the waiter a release was handed to (the
                                   document's next: process tag and waiter
                                   id), "" = every waiter */
  char owner[33];               /* with next: granted to that waiter */
  int64_t token;                /* with owner: the grant's token */
  uint32_t t, i;                /* clusterTime */
} watch_event;

typedef struct ml_stream {
  struct ml_stream *next;
  ml_client *c;
  mongoc_client_pool_t *pool;   /* NULL: external (no thread) */
  ml_orphan *orphan;            /* detached: the closed client's pool it
                                   shares with its other detached threads */
  pid_t pid;
  char *db, *coll, *field;
  char tag[17];                 /* the process tag its $match routes on */
  pthread_t thread;
  int joinable;                 /* thread not joined yet */
  int in_call;                  /* the thread is in a server call */
  int detached;                 /* closed during a call: the thread frees it */
  pthread_cond_t cv;            /* events, state changes */
  int state;
  int stop;                     /* its client closed */
  char errmsg[256];
  uint32_t errcode;
  double failed_at;
  uint32_t start_t, start_i;    /* the stream sees every release after this */
  watch_event ring[RING];
  unsigned long long seq;       /* events recorded so far */
  uint32_t drop_t, drop_i;      /* newest time pushed out of ring */
  int waiters;                  /* blocked in watch_wait now */
  int64_t await_ms;
  double polled_until;          /* a non-blocking waiter (timeout 0) looked
                                   recently: keep reading until then */
  double idle_since;
  /* the machine */
  int open;                     /* its session is open: a killCursors is due */
  int stale;                    /* the cursor is to be replaced (killCursors,
                                   then a new aggregate) */
  int64_t cursor_id;
  char session[33];             /* this opening's session key */
  bson_t *resume;               /* the last batch's postBatchResumeToken */
  int tries;                    /* failed calls in a row */
  double retry_at;              /* no new aggregate before */
  int op_kind;                  /* the op in flight, OP_NONE */
  long op_id;                   /* its id for the external adapter */
  ml_op op;
  long events, reopens, getmores, opens;
  long answered, handed, granted;  /* watch_wait's answers: an event, a
                                      release handed to the waiter by name,
                                      a grant */
} ml_stream;

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_stream *streams;      /* (watch_mu) */
static unsigned long openings;  /* (watch_mu) session keys made */
static long op_ids;             /* (watch_mu) */
static int ts_after(uint32_t t1, uint32_t i1, uint32_t t2, uint32_t i2) {
  return t1 > t2 || (t1 == t2 && i1 > i2);
}

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

/* ---- the ring ---------------------------------------------------------- */

/* watch_mu held: appends an event (key may be NULL: wakes everyone; next
 * NULL or "": wakes every waiter of key); the caller broadcasts s->cv */
static void record(ml_stream *s, const uint8_t *key, size_t keylen, const ml_event *ev) {
  const char *next = ev->next;
  watch_event *e = &s->ring[s->seq % RING];
  if (s->seq >= RING) {
    if (ts_after(e->t, e->i, s->drop_t, s->drop_i)) {
      s->drop_t = e->t;
      s->drop_i = e->i;
    }
    free(e->key);
  }
  e->key = NULL;
  e->keylen = 0;
  e->next[0] = '\0';
  e->owner[0] = '\0';
  if (next && strlen(next) == 48) {
    memcpy(e->next, next, 49);
    memcpy(e->owner, ev->owner, 33);
    e->token = ev->token;
  }
  if (key) {
    e->key = (uint8_t *)malloc(keylen);
    if (e->key) {
      memcpy(e->key, key, keylen);
      e->keylen = keylen;
    }
    /* out of memory: recorded as "any", which wakes too many, never too few */
  }
  e->t = ev->t;
  e->i = ev->i;
  s->seq++;
  s->events++;
}

/* watch_mu held */
static void event_from(ml_stream *s, const bson_t *doc) {
  ml_event ev;
  bson_t key;
  ml_parse_event(doc, s->tag, &ev);
  if (ev.has_key) {
    bson_init(&key);
    bson_append_iter(&key, "k", 1, &ev.key);
    record(s, bson_get_data(&key), key.len, &ev);
    bson_destroy(&key);
  } else {
    record(s, NULL, 0, &ev);
  }
}


/* ---- the machine ------------------------------------------------------- */

/* watch_mu held */
static void set_failed(ml_stream *s, const bson_error_t *e) {
  s->state = ST_FAILED;
  s->failed_at = ml_monotonic();
  bson_snprintf(s->errmsg, sizeof s->errmsg, "change stream: %s",
                e->message[0] ? e->message : "failed");
  s->errcode = e->code;
}

/* watch_mu held: a batch (the aggregate's or a getMore's) into the ring;
 * 0 when the reply holds none */
static int take_batch(ml_stream *s, const bson_t *reply) {
  bson_iter_t docs, it;
  int64_t id = 0;
  if (!ml_reply_batch(reply, &docs, &id)) return 0;
  while (bson_iter_next(&docs)) {
    const uint8_t *data;
    uint32_t len;
    bson_t doc;
    if (!BSON_ITER_HOLDS_DOCUMENT(&docs)) continue;
    bson_iter_document(&docs, &len, &data);
    if (bson_init_static(&doc, data, len)) event_from(s, &doc);
  }
  s->cursor_id = id;
  if (bson_iter_init(&it, reply) && bson_iter_find_descendant(&it, "cursor.postBatchResumeToken", &it) &&
      BSON_ITER_HOLDS_DOCUMENT(&it)) {
    const uint8_t *data;
    uint32_t len;
    bson_iter_document(&it, &len, &data);
    if (s->resume) bson_destroy(s->resume);
    s->resume = bson_new_from_data(data, len);
  }
  return 1;
}

/* watch_mu held: a stream that ended (idle, closed, failed) and has
 * nothing left to send */
static int finished(const ml_stream *s) {
  return !s->open && !s->op_kind && (s->stop || s->state == ST_FAILED || s->state == ST_DONE);
}

/*
 * watch_mu held.  The next op of s (built into s->op, s->op_kind set), or
 * 0 with *wake the time something may be due (HUGE_VAL: nothing, the
 * stream is finished or waits for its op in flight).
 */
static int stream_next(ml_stream *s, double now, double *wake) {
  int ending = s->stop || s->state == ST_FAILED || s->state == ST_DONE;
  *wake = HUGE_VAL;
  if (s->op_kind) return 0;
  if (!ending && s->open && !s->stale && s->waiters == 0 && now >= s->polled_until) {
    /* nobody waits: no getMore (events queue in the server's cursor and
     * are read when a waiter comes); ended when idle */
    if (now - s->idle_since <= IDLE) {
      *wake = s->idle_since + IDLE + 0.01;
      return 0;
    }
    s->state = ST_DONE;
    ending = 1;
  }
  if (s->open && (ending || s->stale)) {
    ml_build_killcursors(&s->op, s->db, s->coll, s->cursor_id);
    s->op_kind = OP_KILL;
  } else if (s->open) {
    ml_build_getmore(&s->op, s->db, s->coll, s->cursor_id, s->await_ms);
    s->op_kind = OP_MORE;
  } else if (ending) {
    return 0;
  } else if (now < s->retry_at) {
    *wake = s->retry_at;
    return 0;
  } else {
    /* each opening in a session of its own (transport.h) */
    bson_snprintf(s->session, sizeof s->session, "%s%016lx", s->tag, ++openings);
    ml_build_watch(&s->op, s->db, s->coll, s->field, s->tag, s->start_t, s->start_i, s->resume);
    s->op_kind = OP_OPEN;
  }
  s->op.session = s->session;
  return 1;
}

/* watch_mu held: a failed call (or a reply without a batch) */
static void call_failed(ml_stream *s, const bson_error_t *err, double now) {
  if (++s->tries > REOPENS) {
    set_failed(s, err);
    return;
  }
  s->retry_at = now + 0.05 * s->tries;
}

/* watch_mu held: the server closed the cursor (its events are in the
 * ring): a failed call too, so that a stream that keeps closing fails */
static void closed_by_server(ml_stream *s, double now) {
  bson_error_t e;
  memset(&e, 0, sizeof e);
  bson_snprintf(e.message, sizeof e.message, "the server closed the change stream");
  call_failed(s, &e, now);
  s->stale = 1;
}

/* watch_mu held: the outcome of s's op in flight (ok: reply is the
 * server's answer, else err says why) */
static void stream_done(ml_stream *s, int ok, const bson_t *reply, const bson_error_t *err) {
  int kind = s->op_kind;
  double now = ml_monotonic();
  bson_error_t e;
  s->op_kind = OP_NONE;
  ml_op_destroy(&s->op);
  if (ok || kind == OP_KILL) memset(&e, 0, sizeof e);
  else e = *err;
  if (ok && kind != OP_KILL && !take_batch(s, reply)) {
    ok = 0;
    bson_snprintf(e.message, sizeof e.message, "a reply without a cursor");
  }
  switch (kind) {
  case OP_OPEN:
    s->opens++;
    if (!ok) {
      /* the transport ended the session; a first opening that fails
       * means no change streams here */
      if (s->state == ST_STARTING) set_failed(s, &e);
      else call_failed(s, &e, now);
      break;
    }
    s->open = 1;
    if (s->state == ST_STARTING) {
      s->state = ST_RUNNING;
      s->idle_since = now;
    }
    if (s->cursor_id == 0) closed_by_server(s, now);
    else s->tries = 0;
    break;
  case OP_MORE:
    s->getmores++;
    if (!ok) {
      call_failed(s, &e, now);  /* (failed for good: killCursors next) */
      s->stale = 1;
    } else if (s->cursor_id == 0) {
      closed_by_server(s, now);
    } else {
      s->tries = 0;
    }
    break;
  case OP_KILL:
    /* sent for a cursor the server closed too: it ends the session */
    s->open = 0;
    s->cursor_id = 0;
    if (s->stale && s->state == ST_RUNNING && !s->stop) s->reopens++;
    s->stale = 0;
    break;
  }
}

/* ---- the thread adapter ------------------------------------------------ */

static void stream_free(ml_stream *s);

static void *watch_main(void *arg) {
  ml_stream *s = (ml_stream *)arg;
  mongoc_client_t *mc = NULL;
  mongoc_client_session_t *cs = NULL;
  bson_error_t err;
  int tries;

  memset(&err, 0, sizeof err);
  for (tries = 0; !mc && tries < 50; tries++) {
    mc = mongoc_client_pool_try_pop(s->pool);
    if (!mc) ml_sleep(0.02);
  }
  pthread_mutex_lock(&watch_mu);
  if (!mc) {
    bson_snprintf(err.message, sizeof err.message, "no free connection in the pool");
    set_failed(s, &err);
  }
  for (;;) {
    double wake;
    if (mc && stream_next(s, ml_monotonic(), &wake)) {
      bson_t reply;
      int ok;
      int kind = s->op_kind;
      s->in_call = 1;
      pthread_mutex_unlock(&watch_mu);
      /* the thread keeps the cursor's connection (one of the pool's, so
       * that a failed getMore tells the pool's topology, which acquire
       * reads) and its session: each opening starts one, killCursors or a
       * failed aggregate ends it */
      if (kind == OP_OPEN) {
        bson_error_t ignored;
        if (cs) mongoc_client_session_destroy(cs);
        cs = mongoc_client_start_session(mc, NULL, &ignored);   /* NULL: no sessions */
      }
      ok = ml_run_in_session(mc, cs, &s->op, &reply, &err);
      if (cs && (kind == OP_KILL || (kind == OP_OPEN && !ok))) {
        mongoc_client_session_destroy(cs);
        cs = NULL;
      }
      pthread_mutex_lock(&watch_mu);
      s->in_call = 0;
      stream_done(s, ok, &reply, &err);
      bson_destroy(&reply);
      /* woken after the unlock: a waiter woken while watch_mu is held
       * would block on it at once and need a second wake-up */
      pthread_mutex_unlock(&watch_mu);
      pthread_cond_broadcast(&s->cv);
      pthread_mutex_lock(&watch_mu);
      continue;
    }
    if (!mc || finished(s)) break;
    cv_wait_until(&s->cv, wake == HUGE_VAL ? ml_monotonic() + IDLE : wake);
  }
  if (s->state != ST_FAILED) s->state = ST_DONE;
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

static void stream_free(ml_stream *s) {
  int k;
  for (k = 0; k < RING; k++) free(s->ring[k].key);
  if (s->op_kind) ml_op_destroy(&s->op);
  if (s->resume) bson_destroy(s->resume);
  pthread_cond_destroy(&s->cv);
  free(s->db);
  free(s->coll);
  free(s->field);
  free(s);
}

static char *dupstr(const char *p) {
  size_t n = strlen(p) + 1;
  char *d = (char *)malloc(n);
  if (d) memcpy(d, p, n);
  return d;
}

/* watch_mu held: takes s out of the list */
static void stream_unlink(ml_stream *s) {
  ml_stream **p;
  for (p = &streams; *p; p = &(*p)->next) {
    if (*p == s) {
      *p = s->next;
      break;
    }
  }
}

/* watch_mu held: unlinks and joins a finished stream, then frees it */
static void stream_reap(ml_stream *s) {
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
static ml_stream *stream_get(ml_client *c, mongoc_client_pool_t *pool, const char *db,
                             const char *coll, const char *field, uint32_t t, uint32_t i) {
  ml_stream *s, *nx;
  pthread_condattr_t ca;
  sigset_t all, old;
  pid_t pid = getpid();
  int rc;

  for (s = streams; s; s = nx) {
    nx = s->next;
    if (s->c != c || s->pool != pool || s->pid != pid || strcmp(s->db, db) ||
        strcmp(s->coll, coll) || strcmp(s->field, field))
      continue;
    if (s->state == ST_STARTING || s->state == ST_RUNNING) return s;
    if (s->state == ST_FAILED && ml_monotonic() - s->failed_at < FAILED_FOR) return s;
    if (s->stop && !finished(s)) return s;    /* stopped, not ended yet: "retry" */
    if (s->waiters == 0 && finished(s) && !s->in_call) {
      stream_reap(s);
      nx = streams;             /* reaping released watch_mu: walk again */
    }
  }
  s = (ml_stream *)calloc(1, sizeof *s);
  if (!s) return NULL;
  s->db = dupstr(db);
  s->coll = dupstr(coll);
  s->field = dupstr(field);
  if (!s->db || !s->coll || !s->field) {
    free(s->db);
    free(s->coll);
    free(s->field);
    free(s);
    return NULL;
  }
  if (!ml_process_tag(s->tag)) memcpy(s->tag, "-no-randomness-", 16);
  s->c = c;
  s->pool = pool;
  s->pid = pid;
  s->start_t = t;
  s->start_i = i;
  s->drop_t = t;
  s->drop_i = i;
  {
    int32_t sock = mongoc_uri_get_option_as_int32(c->uri, MONGOC_URI_SOCKETTIMEOUTMS, 0);
    s->await_ms = pool ? AWAIT_MS : AWAIT_EXTERNAL;
    if (sock > 0 && sock / 2 < s->await_ms) s->await_ms = sock / 2;
  }
  s->state = ST_STARTING;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (pool) {
    s->in_call = 1;             /* the thread opens the stream first */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&s->thread, NULL, watch_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
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
  ml_stream *s;
  pid_t pid = getpid();
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next)
    if (s->c == c && s->pid == pid) {
      s->stop = 1;
      pthread_cond_broadcast(&s->cv);
    }
  for (s = streams; s;) {
    ml_orphan *o;
    if (s->c != c || s->pid != pid) {
      s = s->next;
    } else if (!s->pool) {
      /* external: the adapter's next ops end an open one (watch_next
       * frees it then); a waiter meanwhile is told to retry */
      if (s->open || s->op_kind) {
        if (s->state != ST_FAILED) s->state = ST_DONE;
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
int ml_m_watch_next(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);   /* closed too */
  ml_stream *s, *nx;
  double now = ml_monotonic(), wake = HUGE_VAL, w;
  pid_t pid = getpid();
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = nx) {
    nx = s->next;
    if (s->c != c || s->pid != pid || s->pool) continue;
    if (s->op_kind) {
      if (now + 1 < wake) wake = now + 1;     /* in flight */
      continue;
    }
    if (stream_next(s, now, &w)) {
      s->op_id = ++op_ids;
      lua_pushinteger(L, (lua_Integer)s->op_id);
      ml_push_op(L, &s->op);
      pthread_mutex_unlock(&watch_mu);
      return 2;
    }
    if (s->stop && finished(s)) {
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

/* client:watch_done(id, reply, err, code) -> true: the outcome of the op
 * watch_next gave (reply a BSON string, or nil and the error); waiters
 * look again after it */
int ml_m_watch_done(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);   /* closed too */
  long id = (long)luaL_checkinteger(L, 2);
  size_t len = 0;
  const char *bytes = lua_type(L, 3) == LUA_TSTRING ? lua_tolstring(L, 3, &len) : NULL;
  ml_stream *s;
  bson_t reply;
  bson_error_t err;
  int ok = 0;
  memset(&err, 0, sizeof err);
  if (bytes) ok = bson_init_static(&reply, (const uint8_t *)bytes, len);
  if (!ok) {
    bson_init(&reply);
    bson_set_error(&err, MONGOC_ERROR_SERVER, (uint32_t)luaL_optinteger(L, 5, 0), "%s",
                   luaL_optstring(L, 4, "no reply"));
  }
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next)
    if (s->c == c && s->pid == getpid() && !s->pool && s->op_kind && s->op_id == id) {
      stream_done(s, ok, &reply, &err);
      if (s->stop && finished(s)) {
        stream_unlink(s);
        stream_free(s);
      }
      break;
    }
  pthread_mutex_unlock(&watch_mu);
  bson_destroy(&reply);
  lua_pushboolean(L, 1);
  return 1;
}

/* client:watch_stop() -> true: ends the client's streams in this process
 * (an nginx worker that is shutting down): their waiters are told to
 * retry, and the adapter's next ops end the open ones */
int ml_m_watch_stop(lua_State *L) {
  ml_watch_stop((ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT));
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- Lua --------------------------------------------------------------- */

/* does an event's key (BSON {"k": _id}) name the same _id as key?  Equal
 * bytes, or numbers of equal value stored as another type (an _id the
 * caller passes as 42 matches one stored as 42.0 or as an int64) */
static int key_equal(const uint8_t *data, size_t len, const bson_t *key) {
  bson_t b;
  bson_iter_t ia, ib;
  if (len == key->len && memcmp(data, bson_get_data(key), len) == 0) return 1;
  if (!bson_init_static(&b, data, len) || !bson_iter_init_find(&ia, &b, "k") ||
      !bson_iter_init_find(&ib, key, "k"))
    return 0;
  if (!BSON_ITER_HOLDS_NUMBER(&ia) || !BSON_ITER_HOLDS_NUMBER(&ib)) return 0;
  if (!BSON_ITER_HOLDS_DOUBLE(&ia) && !BSON_ITER_HOLDS_DOUBLE(&ib))
    return bson_iter_as_int64(&ia) == bson_iter_as_int64(&ib);
  return bson_iter_as_double(&ia) == bson_iter_as_double(&ib);
}

/* watch_mu held: has a release of key after (t, i) been seen, for every
 * waiter or for this one (waiter NULL: any release)?  0 no, 1 yes (*mine:
 * handed to waiter by name), 2 it granted the lock to waiter (*grant: that
 * event) */
static int seen(const ml_stream *s, const bson_t *key, const char *waiter, uint32_t t,
                uint32_t i, const watch_event **grant, int *mine) {
  unsigned long long n = s->seq < RING ? s->seq : RING, k;
  if (ts_after(s->drop_t, s->drop_i, t, i)) return 1;
  for (k = 0; k < n; k++) {
    const watch_event *e = &s->ring[(s->seq - 1 - k) % RING];
    if (!ts_after(e->t, e->i, t, i)) continue;
    if (e->next[0] && waiter &&
        (memcmp(e->next, s->tag, 16) != 0 || strcmp(e->next + 16, waiter) != 0))
      continue;
    if (!e->key || key_equal(e->key, e->keylen, key)) {
      *mine = e->next[0] && waiter;
      if (waiter && e->owner[0] && e->key && strcmp(e->owner, waiter) == 0) {
        *grant = e;
        return 2;
      }
      return 1;
    }
  }
  return 0;
}

static uint32_t check_u32(lua_State *L, int idx) {
  lua_Number n = luaL_checknumber(L, idx);
  luaL_argcheck(L, n >= 0 && n <= 4294967295.0 && n == (lua_Number)(uint32_t)n, idx,
                "timestamp part out of range");
  return (uint32_t)n;
}

/*
 * core.watch_wait(client, db, coll, field, id, t, i, timeout [, waiter])
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
 */
static int l_watch_wait(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = luaL_checkstring(L, 2);
  const char *coll = luaL_checkstring(L, 3);
  const char *field = luaL_checkstring(L, 4);
  uint32_t t = check_u32(L, 6), i = check_u32(L, 7);
  double timeout = luaL_checknumber(L, 8);
  const char *waiter = luaL_optstring(L, 9, NULL);
  mongoc_client_pool_t *pool;
  ml_stream *s;
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
  s->waiters++;
  /* the thread reads while anyone waits; a non-blocking caller (OpenResty)
   * comes back within 20 ms, so it counts as waiting a while longer */
  if (!(timeout > 0)) s->polled_until = ml_monotonic() + POLL_GRACE;
  pthread_cond_broadcast(&s->cv);
  for (;;) {
    if (s->state == ST_FAILED) {
      /* copied out, and pushed with watch_mu released: a push may run the
       * collector, whose finalizers (a client's close) take watch_mu */
      char msg[sizeof s->errmsg];
      uint32_t code = s->errcode;
      memcpy(msg, s->errmsg, sizeof msg);
      s->waiters--;
      s->idle_since = ml_monotonic();
      pthread_mutex_unlock(&watch_mu);
      bson_destroy(&key);
      lua_pushnil(L);
      lua_pushstring(L, msg);
      if (code) lua_pushinteger(L, (lua_Integer)code);
      else lua_pushnil(L);
      return 3;
    }
    if (s->state == ST_DONE || s->stop) { res = "retry"; break; }
    if (s->state == ST_RUNNING) {
      if (ts_after(s->start_t, s->start_i, t, i)) { res = "retry"; break; }
      int r = seen(s, &key, waiter, t, i, &grant, &mine);
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
  s->waiters--;
  s->idle_since = ml_monotonic();
  if (res[0] == 'e' || res[0] == 'g') s->answered++;
  if (res[0] == 'g') s->granted++;
  if (mine) s->handed++;
  pthread_mutex_unlock(&watch_mu);
  bson_destroy(&key);
  lua_pushstring(L, res);
  if (res[0] != 'g') return 1;
  ml_pushint64(L, token);
  return 2;
}

void ml_watch_stats(ml_client *c, ml_watch_counts *out) {
  ml_stream *s;
  pid_t pid = getpid();
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&watch_mu);
  for (s = streams; s; s = s->next) {
    if (s->c != c || s->pid != pid) continue;
    if (s->state == ST_RUNNING || s->state == ST_STARTING) {
      out->streams++;
      if (s->pool) out->threads++;
    }
    if (s->state == ST_FAILED) out->failed++;
    out->events += s->events;
    out->reopens += s->reopens;
    out->getmores += s->getmores;
    out->opens += s->opens;
    out->answered += s->answered;
    out->granted += s->granted;
    out->handed += s->handed;
  }
  pthread_mutex_unlock(&watch_mu);
}

void ml_watch_open(lua_State *L) {
  pthread_once(&atfork_once, install_atfork);
  lua_pushcfunction(L, l_watch_wait);
  lua_setfield(L, -2, "watch_wait");
}
