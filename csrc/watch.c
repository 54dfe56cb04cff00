/*
 * Change-stream wake-ups: one stream per process, client, collection and
 * owner field, shared by every waiter, read by a background thread.
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
 * Invariants:
 * - watch_mu guards every stream and its ring; waiters and the thread wait
 *   on the stream's cv with it.  Nothing else is locked while it is held.
 * - ring holds the last RING events; drop_t/drop_i is the newest cluster
 *   time pushed out of it, so a waiter whose T is older than that is woken
 *   (it may have missed its event).
 * - The thread owns its connection (one of the client's pool, so that a
 *   failed getMore tells the pool's topology, which acquire reads) and
 *   change stream; it never touches a lua_State.  It sends getMore only while a waiter waits (or looked
 *   without blocking less than POLL_GRACE ago).  A getMore awaits up to
 *   AWAIT_MS (at most half the socket timeout): longer than a waiter
 *   usually waits, so that a wait costs one getMore, not one per AWAIT_MS.
 * - A stream is stopped by the client's close, or by the thread itself
 *   after IDLE seconds without a waiter.  Close does not wait for a
 *   getMore in flight (in_call): it unlinks the stream and detaches the
 *   thread, which frees the stream when the getMore returns (an event, or
 *   AWAIT_MS); the pool is then handed to those threads (ml_orphan,
 *   client.c): the last holder destroys it.
 *   Otherwise close joins the thread.  The library stays loaded (pinned)
 *   while such a thread may still run.
 * - fork: watch_mu is held across fork(); the child forgets the parent's
 *   streams without touching them (their threads do not exist there).
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mongolock.h"

#define RING 256
#define AWAIT_MS 10000          /* getMore's maxAwaitTimeMS (see await_ms) */
#define IDLE 10.0               /* seconds without a waiter before closing */
#define FAILED_FOR 30.0         /* a failed stream is not retried for this long */
#define REOPENS 3               /* reopen attempts after the driver's own resume */
#define POLL_GRACE 0.5          /* see polled_until */

enum { ST_STARTING, ST_RUNNING, ST_FAILED, ST_DONE };

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
  mongoc_client_pool_t *pool;
  ml_orphan *orphan;            /* detached: the closed client's pool it
                                   shares with its other detached threads */
  pid_t pid;
  char *db, *coll, *field;
  char tag[17];                 /* the process tag its $match routes on */
  pthread_t thread;
  int joinable;                 /* thread not joined yet */
  int in_call;                  /* the thread is in a server call (watch_mu) */
  int detached;                 /* closed during a call: the thread frees it */
  pthread_cond_t cv;            /* events, state changes */
  int state;
  int stop;
  char errmsg[256];
  uint32_t errcode;
  double failed_at;
  uint32_t start_t, start_i;    /* the stream sees every release after this */
  watch_event ring[RING];
  unsigned long long seq;       /* events recorded so far */
  uint32_t drop_t, drop_i;      /* newest time pushed out of ring */
  int waiters;                  /* blocked in watch_wait now */
  int64_t await_ms;             /* getMore's maxAwaitTimeMS: AWAIT_MS, or half
                                   the client's socketTimeoutMS when that is
                                   shorter, so a getMore never outlasts it */
  double polled_until;          /* a non-blocking waiter (timeout 0) looked
                                   recently: keep reading until then */
  double idle_since;
  long events, reopens, getmores;
} ml_stream;

static pthread_mutex_t watch_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_stream *streams;      /* (watch_mu) */

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

/* ---- the thread -------------------------------------------------------- */

static void stream_free(ml_stream *s);

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
  /* the thread broadcasts it once watch_mu is released (watch_main) */
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

/* [pipeline] and opts for a stream starting after (t, i) or at a token */
static mongoc_change_stream_t *stream_open(mongoc_collection_t *coll, const ml_stream *s,
                                           const bson_t *resume_token) {
  bson_t pipeline = BSON_INITIALIZER, opts;
  mongoc_change_stream_t *cs;

  ml_build_watch_pipeline(&pipeline, s->field, s->tag);
  bson_init(&opts);
  BSON_APPEND_INT64(&opts, "maxAwaitTimeMS", s->await_ms);
  ml_build_watch_start(&opts, s->start_t, s->start_i, resume_token);
  cs = mongoc_collection_watch(coll, &pipeline, &opts);
  bson_destroy(&pipeline);
  bson_destroy(&opts);
  return cs;
}

/* watch_mu held */
static void set_failed(ml_stream *s, const bson_error_t *e) {
  s->state = ST_FAILED;
  s->failed_at = ml_monotonic();
  bson_snprintf(s->errmsg, sizeof s->errmsg, "change stream: %s",
                e->message[0] ? e->message : "failed");
  s->errcode = e->code;
  pthread_cond_broadcast(&s->cv);
}

static void *watch_main(void *arg) {
  ml_stream *s = (ml_stream *)arg;
  mongoc_client_t *mc = NULL;
  mongoc_collection_t *coll = NULL;
  mongoc_change_stream_t *cs = NULL;
  bson_error_t err;
  const bson_t *doc, *errdoc;
  int tries, recorded = 0;

  memset(&err, 0, sizeof err);
  for (tries = 0; !mc && tries < 50; tries++) {
    mc = mongoc_client_pool_try_pop(s->pool);
    if (!mc) ml_sleep(0.02);
  }
  if (!mc) {
    pthread_mutex_lock(&watch_mu);
    bson_snprintf(err.message, sizeof err.message, "no free connection in the pool");
    set_failed(s, &err);
    goto done;
  }
  coll = mongoc_client_get_collection(mc, s->db, s->coll);
  cs = stream_open(coll, s, NULL);
  pthread_mutex_lock(&watch_mu);
  s->in_call = 0;
  if (mongoc_change_stream_error_document(cs, &err, &errdoc)) {
    set_failed(s, &err);
    goto done;
  }
  s->state = ST_RUNNING;
  s->idle_since = ml_monotonic();
  pthread_cond_broadcast(&s->cv);
  tries = 0;
  while (!s->stop) {
    int got;
    if (s->waiters == 0 && ml_monotonic() >= s->polled_until) {
      /* nobody waits: send no getMore (events queue in the server's
       * cursor and are read when a waiter comes); close when idle */
      recorded = 0;             /* no waiter blocks on s->cv to hear it */
      if (ml_monotonic() - s->idle_since > IDLE) break;
      cv_wait_until(&s->cv, s->idle_since + IDLE + 0.01);
      continue;
    }
    s->in_call = 1;
    pthread_mutex_unlock(&watch_mu);
    if (recorded) {
      /* after the unlock: a waiter woken while watch_mu is held would
       * block on it at once and need a second wake-up */
      pthread_cond_broadcast(&s->cv);
      recorded = 0;
    }
    got = mongoc_change_stream_next(cs, &doc);
    pthread_mutex_lock(&watch_mu);
    s->in_call = 0;
    s->getmores++;
    if (s->stop) break;
    if (got) {
      event_from(s, doc);
      recorded = 1;
      tries = 0;
      continue;
    }
    if (!mongoc_change_stream_error_document(cs, &err, &errdoc)) {
      tries = 0;
      continue;                 /* an empty batch after maxAwaitTimeMS */
    }
    /* the driver already resumed once where it could: reopen from the
     * last resume token, so no event is skipped; give up after REOPENS */
    if (s->stop || ++tries > REOPENS) {
      set_failed(s, &err);
      break;
    }
    {
      const bson_t *tok = mongoc_change_stream_get_resume_token(cs);
      bson_t *copy = tok ? bson_copy(tok) : NULL;
      mongoc_change_stream_t *next;
      s->reopens++;
      s->in_call = 1;
      pthread_mutex_unlock(&watch_mu);
      ml_sleep(0.05 * tries);
      next = stream_open(coll, s, copy);
      /* its killCursors is a round trip: not under watch_mu */
      mongoc_change_stream_destroy(cs);
      pthread_mutex_lock(&watch_mu);
      s->in_call = 0;
      if (copy) bson_destroy(copy);
      cs = next;
      if (mongoc_change_stream_error_document(cs, &err, &errdoc)) {
        if (tries >= REOPENS) {
          set_failed(s, &err);
          break;
        }
      }
    }
  }
done:
  if (s->state != ST_FAILED) s->state = ST_DONE;
  s->in_call = 0;
  pthread_cond_broadcast(&s->cv);
  {
    int detached = s->detached;
    ml_orphan *o = s->orphan;
    pthread_mutex_unlock(&watch_mu);
    mongoc_change_stream_destroy(cs);
    mongoc_collection_destroy(coll);
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

/* watch_mu held: unlinks and joins a finished stream, then frees it */
static void stream_reap(ml_stream *s) {
  ml_stream **p;
  for (p = &streams; *p; p = &(*p)->next) {
    if (*p == s) {
      *p = s->next;
      break;
    }
  }
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
 * NULL on out-of-memory or when no thread can be started.
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
    if (s->waiters == 0) {
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
  s->in_call = 1;               /* the thread opens the stream first */
  s->start_t = t;
  s->start_i = i;
  {
    int32_t sock = mongoc_uri_get_option_as_int32(c->uri, MONGOC_URI_SOCKETTIMEOUTMS, 0);
    s->await_ms = (sock > 0 && sock / 2 < AWAIT_MS) ? sock / 2 : AWAIT_MS;
  }
  s->state = ST_STARTING;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = pthread_create(&s->thread, NULL, watch_main, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    stream_free(s);
    return NULL;
  }
  s->joinable = 1;
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
    if (s->c == c && s->pid == pid && s->in_call && s->joinable &&
        (o = ml_orphan_take(c)) != NULL) {
      /* in a getMore (or opening): do not wait for it, the thread frees
       * the stream when the call returns, the last one the pool */
      ml_stream **p;
      for (p = &streams; *p != s; p = &(*p)->next) {}
      *p = s->next;
      s->orphan = o;
      s->detached = 1;
      s->joinable = 0;
      pthread_detach(s->thread);
      s = streams;
    } else if (s->c == c && s->pid == pid) {
      stream_reap(s);
      s = streams;
    } else {
      s = s->next;
    }
  }
  pthread_mutex_unlock(&watch_mu);
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
 * waiter or for this one (waiter NULL: any release)?  0 no, 1 yes, 2 it
 * granted the lock to waiter (*grant: that event) */
static int seen(const ml_stream *s, const bson_t *key, const char *waiter, uint32_t t,
                uint32_t i, const watch_event **grant) {
  unsigned long long n = s->seq < RING ? s->seq : RING, k;
  if (ts_after(s->drop_t, s->drop_i, t, i)) return 1;
  for (k = 0; k < n; k++) {
    const watch_event *e = &s->ring[(s->seq - 1 - k) % RING];
    if (!ts_after(e->t, e->i, t, i)) continue;
    if (e->next[0] && waiter &&
        (memcmp(e->next, s->tag, 16) != 0 || strcmp(e->next + 16, waiter) != 0))
      continue;
    if (!e->key || key_equal(e->key, e->keylen, key)) {
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
 * cooperatively between calls.
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

  luaL_argcheck(L, timeout == timeout, 8, "not a number");
  luaL_argcheck(L, strlen(field) > 0 && strlen(field) < 200, 4, "bad field name");
  pool = ml_client_pool(L, c);
  pthread_once(&atfork_once, install_atfork);
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
    if (s->state == ST_DONE) { res = "retry"; break; }
    if (s->state == ST_RUNNING) {
      if (ts_after(s->start_t, s->start_i, t, i)) { res = "retry"; break; }
      int r = seen(s, &key, waiter, t, i, &grant);
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
    if (s->state == ST_RUNNING || s->state == ST_STARTING) out->streams++;
    if (s->state == ST_FAILED) out->failed++;
    out->events += s->events;
    out->reopens += s->reopens;
    out->getmores += s->getmores;
  }
  pthread_mutex_unlock(&watch_mu);
}

void ml_watch_open(lua_State *L) {
  pthread_once(&atfork_once, install_atfork);
  lua_pushcfunction(L, l_watch_wait);
  lua_setfield(L, -2, "watch_wait");
}
