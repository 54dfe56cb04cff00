/*
 * mongolock.Pool: worker threads that run ops (ops.c's envelopes) off the
 * calling thread, for event loops that must not block (a coroutine
 * scheduler: lua/mongolock/sched.lua).  One job is one op; its end is
 * signalled on an eventfd, which the event loop polls: the job's own, or
 * a mongolock.Signal the caller keeps (one per coroutine: no descriptor
 * made per job), which the change streams' threads write too (watch.c):
 *
 *   pool = core.pool(client, threads)   -- its own libmongoc pool on the
 *                                       -- client's URI and write concern
 *   job  = pool:submit(op [, sig])      -- mongolock.Job | nil, message;
 *                                       -- sig: a Signal written at its
 *                                       -- end, false: none (nobody waits)
 *   fd   = job:fd()                     -- readable once the job is done
 *   reply, err, code, ereply, domain = job:take()
 *                                       -- as client:run(op); false while
 *                                       -- the job runs
 *   job:close()                         -- (also __gc) the outcome is not
 *                                       -- wanted: the op still runs
 *   pool:close()                        -- (also __gc) queued jobs end
 *                                       -- with "closed"
 *   pool:keep(keeper), pool:bury()      -- a loop that keeps sockets
 *                                       -- watched (l_pool_keep)
 *   sig = core.signal()                 -- mongolock.Signal: an eventfd
 *   sig:fd(), sig:clear(), sig:close()  -- (clear reads it: true when it
 *                                       -- had been written)
 *
 * Each thread runs ml_run (transport.c) on a connection it pops from the
 * pool's libmongoc pool, so a job is exactly what client:run(op) does.
 * An idle thread waits on a condition of its own, and submit wakes the one
 * that went idle last (its connection and caches warm): a coroutine
 * making one round trip after another keeps to one thread.
 *
 * Invariants:
 * - jobs_mu guards every job's done, refs and outcome.  A job has one
 *   reference for its Job userdata (until taken, closed or collected) and
 *   one for the pool while it is queued or running; the last one frees it.
 * - sig_mu guards every Signal's fd and refs.  A Signal has one reference
 *   for its Lua userdata (until closed or collected) and one per job or
 *   stream that may write it; the last one frees it.  It is written only
 *   under sig_mu and only while fd >= 0, and the Lua side closes it under
 *   sig_mu: no write ever reaches a closed (or reused) descriptor.  Lock
 *   order: jobs_mu or watch_mu, then sig_mu; nothing is locked under it.
 * - A pool's shared state has one reference for its Pool userdata and one
 *   per thread; the last one destroys the libmongoc pool.  Threads are
 *   detached: close never waits for a call in flight (bounded by the URI's
 *   socket and server-selection timeouts), and the library stays loaded
 *   while one may still run (ml_pin_library).
 * - A loop that keeps sockets watched (pool:keep) never has one closed
 *   under it: a fibers' connection destroyed after a fiber waited on it
 *   keeps its descriptor open in the graves until pool:bury has the loop
 *   forget it (and pool:close has it forget all first).
 * - fork: a pool belongs to the process that made it; in another process
 *   submit answers nil, message, and close abandons it (its threads do not
 *   exist there, its libmongoc pool is the parent's); jobs_mu and refs_mu
 *   are held across fork().
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "compat.h"
#include "sys.h"
#include "protocol.h"
#include "transport.h"
#include "args.h"
#include "client.h"
#include "fiber.h"
#include "fiber_stream.h"
#include "attempt.h"
#include "pool.h"

#define ML_POOL_MT "mongolock.Pool"
#define ML_JOB_MT "mongolock.Job"
#define ML_HERE_MT "mongolock.Here"
#define THREADS_MAX 256
#define HERE_KEPT 16
/* the fibers' server selection: a selection that would wait (no server
 * known to take writes: an election) gives up this soon, in the loop's
 * thread, and the op goes to a worker thread */
#define HERE_SELECT_MS 5

typedef struct ml_job {
  struct ml_job *next;          /* the queue (the pool's mu) */
  uint8_t *op;                  /* the envelope's bytes; freed once run */
  uint32_t oplen;
  ml_signal *sig;               /* written at the end (one reference), or NULL */
  int own;                      /* sig is the job's own: closed when let go of */
  int done;                     /* the outcome below is set */
  int refs;
  int ok;
  bson_t reply;                 /* initialised once done */
  bson_error_t err;
} ml_job;

/* an idle thread, on its own stack, in the pool's idle list */
typedef struct ml_idle {
  struct ml_idle *next;
  pthread_cond_t cv;
  int woken;
} ml_idle;

typedef struct pool_state {
  pthread_mutex_t mu;           /* guards head, tail, idle, stop */
  ml_idle *idle;                /* the idle threads, the latest first */
  ml_job *head, *tail;
  int stop;
  int refs;                     /* (refs_mu) the Pool userdata's, each thread's */
  mongoc_client_pool_t *mpool;
  mongoc_write_concern_t *wc;
  pid_t pid;
  int plain;                    /* no TLS: ops may run in fibers (here) */
  int bridged;                  /* the fibers' connections are the loop's
                                 * sockets (fiber_stream.h); no threads */
  mongoc_uri_t *here_uri;       /* the fibers' pool's URI */
  mongoc_client_pool_t *hpool;  /* (mu) the fibers' pool, made at their first op */
  mongoc_client_t *here[HERE_KEPT];   /* (mu) connections of ended fibers */
  int nhere;
  int64_t writable_until;       /* (mu) the monitor knew a server that takes
                                 * writes; looked again after this */
  int64_t kick_after;           /* (mu) the next selection that asks the
                                 * monitor to look now */
  int keep;                     /* the loop keeps sockets watched after a
                                 * wait: the fibers' dead ones go to graves
                                 * (pool:keep) */
  ml_graves graves;             /* fiber_stream.h */
} pool_state;

typedef struct { pool_state *ps; int threads; } ml_pool;
typedef struct { ml_job *job; } ml_jobref;

static pthread_mutex_t jobs_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t refs_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t sig_mu = PTHREAD_MUTEX_INITIALIZER;

/* fork: jobs_mu and refs_mu are held across fork(), so a child never
 * inherits one that a pool thread (which does not exist there) held.
 * sig_mu is taken under watch_mu by a stream's thread, and fork's other
 * handler takes watch_mu after these: it is not held across fork (that
 * could deadlock) but made anew in the child, where no thread holds it. */
static void fork_prepare(void) {
  pthread_mutex_lock(&jobs_mu);
  pthread_mutex_lock(&refs_mu);
}
static void fork_parent(void) {
  pthread_mutex_unlock(&refs_mu);
  pthread_mutex_unlock(&jobs_mu);
}
/* this process's id, taken again in a child of fork(): core.pid() and the
 * pools' checks ask no system call each time */
static volatile pid_t my_pid;

static void fork_child(void) {
  pthread_mutex_init(&sig_mu, NULL);
  my_pid = getpid();
  fork_parent();
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) {
  my_pid = getpid();
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* ---- signals ------------------------------------------------------------ */

struct ml_signal {
  int fd;                       /* eventfd, -1 once closed */
  int refs;
};

static ml_signal *signal_new(void) {
  ml_signal *g = (ml_signal *)malloc(sizeof *g);
  if (!g) return NULL;
  g->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (g->fd < 0) {
    free(g);
    return NULL;
  }
  g->refs = 1;
  return g;
}

void ml_signal_ref(ml_signal *g) {
  pthread_mutex_lock(&sig_mu);
  g->refs++;
  pthread_mutex_unlock(&sig_mu);
}

void ml_signal_unref(ml_signal *g) {
  int last;
  if (!g) return;
  pthread_mutex_lock(&sig_mu);
  last = --g->refs == 0;
  if (last && g->fd >= 0) close(g->fd);
  pthread_mutex_unlock(&sig_mu);
  if (last) free(g);
}

void ml_signal_notify(ml_signal *g) {
  pthread_mutex_lock(&sig_mu);
  if (g->fd >= 0) {
    uint64_t one = 1;
    ssize_t w = write(g->fd, &one, sizeof one);
    (void)w;                    /* an eventfd takes it unless it would overflow */
  }
  pthread_mutex_unlock(&sig_mu);
}

static void signal_close(ml_signal *g) {
  pthread_mutex_lock(&sig_mu);
  if (g->fd >= 0) close(g->fd);
  g->fd = -1;
  pthread_mutex_unlock(&sig_mu);
}

/* ---- jobs --------------------------------------------------------------- */

/* jobs_mu held: drops one reference; returns the job when it was the last */
static ml_job *job_unref_locked(ml_job *j) {
  return --j->refs == 0 ? j : NULL;
}

static void job_free(ml_job *j) {
  if (!j) return;
  if (j->done) bson_destroy(&j->reply);
  ml_signal_unref(j->sig);
  free(j->op);
  free(j);
}

/* the outcome of j (the thread's side): stores it, signals, drops the
 * pool's reference */
static void job_finish(ml_job *j, int ok, bson_t *reply, const bson_error_t *err) {
  ml_job *last;
  pthread_mutex_lock(&jobs_mu);
  j->ok = ok;
  bson_steal(&j->reply, reply);
  if (err) j->err = *err;
  j->done = 1;
  if (j->sig) ml_signal_notify(j->sig);
  last = job_unref_locked(j);
  pthread_mutex_unlock(&jobs_mu);
  job_free(last);
}

static void job_fail(ml_job *j, const char *msg) {
  bson_t reply = BSON_INITIALIZER;
  bson_error_t err;
  bson_set_error(&err, MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_NOT_READY, "%s", msg);
  job_finish(j, 0, &reply, &err);
}

static void state_unref(pool_state *ps) {
  int last;
  pthread_mutex_lock(&refs_mu);
  last = --ps->refs == 0;
  pthread_mutex_unlock(&refs_mu);
  if (!last) return;
  while (ps->nhere > 0) mongoc_client_pool_push(ps->hpool, ps->here[--ps->nhere]);
  if (ps->hpool) ml_pool_destroy(ps->hpool);
  ml_graves_destroy(&ps->graves);
  if (ps->here_uri) mongoc_uri_destroy(ps->here_uri);
  if (ps->mpool) ml_pool_destroy(ps->mpool);
  mongoc_write_concern_destroy(ps->wc);
  pthread_mutex_destroy(&ps->mu);
  free(ps);
}

static void *pool_main(void *arg) {
  pool_state *ps = (pool_state *)arg;
  mongoc_client_t *mc = NULL;
  ml_idle me;
  pthread_cond_init(&me.cv, NULL);
  for (;;) {
    ml_job *j;
    bson_t env, reply;
    bson_error_t err;
    ml_op op;
    int ok;
    pthread_mutex_lock(&ps->mu);
    while (!ps->head && !ps->stop) {
      me.woken = 0;
      me.next = ps->idle;
      ps->idle = &me;
      while (!me.woken) pthread_cond_wait(&me.cv, &ps->mu);
    }
    j = ps->head;
    if (j) {
      ps->head = j->next;
      if (!ps->head) ps->tail = NULL;
    }
    if (ps->stop) {
      pthread_mutex_unlock(&ps->mu);
      if (!j) break;
      job_fail(j, "closed");
      continue;
    }
    pthread_mutex_unlock(&ps->mu);
    if (!mc) mc = mongoc_client_pool_pop(ps->mpool);
    if (!bson_init_static(&env, j->op, j->oplen) || !ml_op_view(&env, &op)) {
      job_fail(j, "not an op");
      continue;
    }
    memset(&err, 0, sizeof err);
    ok = ml_run(mc, ps->wc, &op, &reply, &err);
    job_finish(j, ok, &reply, ok ? NULL : &err);
  }
  if (mc) mongoc_client_pool_push(ps->mpool, mc);
  pthread_cond_destroy(&me.cv);
  state_unref(ps);
  return NULL;
}

/* ps->mu held: wakes the thread that went idle last (1), or none is idle
 * (0); all: every idle one */
static void wake_idle(pool_state *ps, int all) {
  do {
    ml_idle *w = ps->idle;
    if (!w) return;
    ps->idle = w->next;
    w->woken = 1;
    pthread_cond_signal(&w->cv);
  } while (all);
}

/* ---- outcomes ----------------------------------------------------------- */

/* pushes what client:run(op) answers for an op's outcome: reply | nil,
 * message, code, ereply, domain (BSON strings); the count pushed */
static int push_outcome(lua_State *L, int ok, const bson_t *reply, const bson_error_t *err) {
  if (ok) {
    lua_pushlstring(L, (const char *)bson_get_data(reply), reply->len);
    return 1;
  }
  ml_pusherror(L, err);
  if (!bson_empty(reply)) lua_pushlstring(L, (const char *)bson_get_data(reply), reply->len);
  else lua_pushnil(L);
  lua_pushinteger(L, (lua_Integer)err->domain);
  return 5;
}

/* ---- ops in fibers: pool:here ------------------------------------------- */

static ml_pool *check_pool(lua_State *L, int i);

/* An op run in the calling thread on a fiber (fiber.h): its round trips
 * give the event loop back while they wait for the server, and no worker
 * thread is woken.  Its connection is one of the pool's, kept for fibers
 * (ps->here) and read through fiber_stream.c's stream, which waits through
 * the fiber.  The state is on the heap, aligned for its bson_t (a userdata
 * is not), and the Here userdata points to it. */
typedef struct {
  ml_fiber *f;
  pool_state *ps;               /* one reference until let go of */
  mongoc_client_t *mc;
  uint8_t *op;
  uint32_t oplen;
  int ended;                    /* the op returned: ok, reply, err are set */
  int looked;                   /* it just looked (here's first run): the
                                   first step need not look again */
  int ok;
  int elsewhere;                /* it failed unsent or unapplied: a worker thread runs it */
  int attempt;                  /* its op is a mongolock.Attempt's (the here's user value {attempt}) */
  bson_t reply;
  bson_error_t err;
} ml_here;

typedef struct { ml_here *h; } ml_hereref;

/* the op failed before it was sent (no server selected in time, no
 * connection made) or the server refused it as no primary (a step-down):
 * it did not apply, and a worker thread, whose selection waits through an
 * election, may send it again.  A network error is not such a failure (the op may have applied):
 * its error is the answer. */
static int not_applied(const bson_error_t *e) {
  if (e->domain == MONGOC_ERROR_SERVER_SELECTION) return 1;
  /* no connection was made (fiber_stream.c's connect): nothing was sent */
  if (e->domain == MONGOC_ERROR_STREAM &&
      (e->code == MONGOC_ERROR_STREAM_CONNECT || e->code == MONGOC_ERROR_STREAM_NAME_RESOLUTION))
    return 1;
  if (e->domain != MONGOC_ERROR_SERVER && e->domain != MONGOC_ERROR_QUERY) return 0;
  switch (e->code) {
  case 10107:                   /* NotWritablePrimary */
  case 13435:                   /* NotPrimaryNoSecondaryOk */
  case 13436:                   /* NotPrimaryOrSecondary */
  case 11602:                   /* InterruptedDueToReplStateChange */
  case 189:                     /* PrimarySteppedDown */
    return 1;
  }
  return 0;
}

static void here_main(void *arg) {
  ml_here *h = (ml_here *)arg;
  bson_t env;
  ml_op op;
  memset(&h->err, 0, sizeof h->err);
  if (!bson_init_static(&env, h->op, h->oplen) || !ml_op_view(&env, &op)) {
    bson_init(&h->reply);
    bson_set_error(&h->err, MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_NOT_READY, "not an op");
    h->ok = 0;
  } else {
    uint64_t sent = ml_bridge_sent();
    h->ok = ml_run_direct(h->mc, h->ps->wc, &op, &h->reply, &h->err);
    /* (a bridged op that sent no byte cannot have applied) */
    h->elsewhere = !h->ok && (not_applied(&h->err) || (h->ps->bridged && ml_bridge_sent() == sent));
  }
  h->ended = 1;
}

/* a connection for a fiber: one an ended fiber left, or a new one of the
 * pool's (NULL when the pool has none left) */
static mongoc_client_t *here_client_get(pool_state *ps) {
  mongoc_client_t *mc = NULL;
  pthread_mutex_lock(&ps->mu);
  if (ps->nhere > 0) mc = ps->here[--ps->nhere];
  pthread_mutex_unlock(&ps->mu);
  if (!mc) {
    pthread_mutex_lock(&ps->mu);
    if (!ps->hpool && ps->here_uri && (ps->hpool = ml_pool_new(ps->here_uri)))
      mongoc_client_pool_set_error_api(ps->hpool, MONGOC_ERROR_API_VERSION_2);
    pthread_mutex_unlock(&ps->mu);
    if (ps->hpool && (mc = mongoc_client_pool_try_pop(ps->hpool))) ml_fiber_stream_use(mc, ps->bridged, ps->keep ? &ps->graves : NULL);
  }
  return mc;
}

static void here_client_put(pool_state *ps, mongoc_client_t *mc) {
  pthread_mutex_lock(&ps->mu);
  if (ps->nhere < HERE_KEPT) {
    ps->here[ps->nhere++] = mc;
    mc = NULL;
  }
  pthread_mutex_unlock(&ps->mu);
  if (mc) mongoc_client_pool_push(ps->hpool, mc);
}

/* the pool's monitors know a server that takes writes: the op's server
 * selection returns at once (it would otherwise wait in the loop's thread) */
static int writable_known(mongoc_client_t *mc) {
  size_t n = 0, k;
  int yes = 0;
  mongoc_server_description_t **sds = mongoc_client_get_server_descriptions(mc, &n);
  for (k = 0; k < n && !yes; k++) {
    const char *t = mongoc_server_description_type(sds[k]);
    yes = !strcmp(t, "Standalone") || !strcmp(t, "RSPrimary") || !strcmp(t, "Mongos") || !strcmp(t, "LoadBalancer");
  }
  mongoc_server_descriptions_destroy_all(sds, n);
  return yes;
}

/* writable_known, asked at most every WRITABLE_LOOK us while it answers
 * yes (an op that finds no such server after all waits HERE_SELECT_MS at
 * most, and makes the next op ask again).  While it answers no, a server
 * selection (HERE_SELECT_MS at most, every KICK_EVERY us at most) asks the
 * fibers' monitor to look now: nothing else would before its next
 * heartbeat, the ops going to the worker threads meanwhile. */
#define WRITABLE_LOOK 100000
#define KICK_EVERY 500000
static int writable_seen(pool_state *ps, mongoc_client_t *mc) {
  int64_t now = bson_get_monotonic_time();
  int yes;
  pthread_mutex_lock(&ps->mu);
  yes = now < ps->writable_until;
  pthread_mutex_unlock(&ps->mu);
  if (yes) return 1;
  yes = writable_known(mc);
  if (!yes) {
    int kick;
    pthread_mutex_lock(&ps->mu);
    kick = now >= ps->kick_after;
    if (kick) ps->kick_after = now + KICK_EVERY;
    pthread_mutex_unlock(&ps->mu);
    if (kick) {
      bson_error_t ignored;
      mongoc_server_description_t *sd = mongoc_client_select_server(mc, true, NULL, &ignored);
      yes = sd != NULL;
      mongoc_server_description_destroy(sd);
    }
  }
  pthread_mutex_lock(&ps->mu);
  ps->writable_until = yes ? now + WRITABLE_LOOK : 0;
  pthread_mutex_unlock(&ps->mu);
  return yes;
}

/* lets go of everything: a fiber still waiting is resumed with its wait
 * cancelled until its op returns (its outcome dropped) */
static void here_release(ml_here *h) {
  if (h->ps && h->ps->pid != my_pid) {
    /* a child of fork(): the op, its connection and pool are the parent's,
     * abandoned here as pool_close abandons a pool (the fiber's stack is
     * never resumed; what its frames hold stays) */
    if (h->f) ml_fiber_free(h->f);
    h->f = NULL;
    h->mc = NULL;
    h->ps = NULL;
    if (h->ended) bson_destroy(&h->reply);
    h->ended = 0;
    free(h->op);
    h->op = NULL;
    return;
  }
  if (h->f) {
    while (!h->ended) ml_fiber_resume(h->f, 1);
    ml_fiber_free(h->f);
    h->f = NULL;
  }
  if (h->ended) {
    bson_destroy(&h->reply);
    h->ended = 0;
  }
  if (h->mc) here_client_put(h->ps, h->mc);
  h->mc = NULL;
  free(h->op);
  h->op = NULL;
  if (h->ps) state_unref(h->ps);
  h->ps = NULL;
}

static void here_free(ml_hereref *ref) {
  if (!ref->h) return;
  here_release(ref->h);
  free(ref->h);
  ref->h = NULL;
}

/* cmd opens a change stream ($changeStream first in its pipeline), or is
 * a getMore or killCursors */
static int stream_cmd(const bson_t *cmd) {
  bson_iter_t it, st;
  const char *k;
  if (!bson_iter_init(&it, cmd) || !bson_iter_next(&it)) return 0;
  k = bson_iter_key(&it);
  if (!strcmp(k, "getMore") || !strcmp(k, "killCursors")) return 1;
  return !strcmp(k, "aggregate") && bson_iter_init_find(&it, cmd, "pipeline") &&
         bson_iter_recurse(&it, &st) && bson_iter_next(&st) && BSON_ITER_HOLDS_DOCUMENT(&st) &&
         bson_iter_recurse(&st, &it) && bson_iter_find(&it, "$changeStream");
}

/* [-0, +1] false: pool:here's op did not start (an attempt is prepared
 * again, its envelope destroyed) */
static int here_refused(lua_State *L, bson_t *env) {
  if (env) {
    bson_destroy(env);
    ml_attempt_unsend(L, 2);
  }
  lua_pushboolean(L, 0);
  return 1;
}

/* pool:here(op) -> here | false: op started on a fiber in the calling
 * thread (it runs until its first wait); false when it cannot be (a TLS
 * pool or one on a unix socket, an op of a session, no connection or stack
 * left, no server known to take writes yet, a closed pool or one of
 * another process): submit it then.  op may be a prepared
 * mongolock.Attempt instead of its a:op(): its op is built straight into
 * the fiber's memory (attempt.h), and the attempt is prepared again when
 * here answers false, or its step that the op did not apply. */
static int l_here(lua_State *L) {
  ml_pool *p = check_pool(L, 1);
  pool_state *ps = p->ps;
  ml_op op;
  bson_t envelope, *env = NULL;
  size_t len;
  const char *bytes;
  ml_here *h;
  ml_hereref *ref;
  mongoc_client_t *mc;
  if (ml_attempt_envelope(L, 2, &envelope)) {
    env = &envelope;
    (void)ml_op_view(env, &op);     /* built here: an op */
    bytes = (const char *)bson_get_data(env);
    len = env->len;
  } else {
    ml_arg_op(L, 2, &op);
    bytes = lua_tolstring(L, 2, &len);
  }
  /* an op of a session runs on the session's own connection
   * (transport.c), which no fiber reads */
  if (!ps || ps->pid != my_pid || !ps->plain || op.session || ml_fiber_current()) return here_refused(L, env);
  /* a bridged pool leaves a change stream's commands to the threads: a
   * getMore waits at the server, and a cosocket's timeout is logged */
  if (ps->bridged && stream_cmd(&op.cmd)) return here_refused(L, env);
  if (!(mc = here_client_get(ps))) return here_refused(L, env);
  if (!writable_seen(ps, mc)) {
    here_client_put(ps, mc);
    return here_refused(L, env);
  }
  ref = (ml_hereref *)ml_newuserdata(L, sizeof *ref);
  ref->h = NULL;
  luaL_getmetatable(L, ML_HERE_MT);
  lua_setmetatable(L, -2);
  if (posix_memalign((void **)&h, BSON_ALIGNOF(ml_here) > sizeof(void *) ? BSON_ALIGNOF(ml_here) : sizeof(void *),
                     sizeof *h) != 0) {
    here_client_put(ps, mc);
    lua_pop(L, 1);
    return here_refused(L, env);
  }
  memset(h, 0, sizeof *h);
  ref->h = h;
  h->mc = mc;
  h->ps = ps;
  pthread_mutex_lock(&refs_mu);
  ps->refs++;
  pthread_mutex_unlock(&refs_mu);
  if (!(h->op = (uint8_t *)malloc(len)) || !(h->f = ml_fiber_new(here_main, h))) {
    here_free(ref);
    lua_pop(L, 1);
    return here_refused(L, env);
  }
  memcpy(h->op, bytes, len);
  h->oplen = (uint32_t)len;
  if (env) {
    bson_destroy(env);
    /* the here keeps its attempt (user value {attempt}), to prepare it
     * again when the op did not apply */
    h->attempt = 1;
    lua_createtable(L, 1, 0);
    lua_pushvalue(L, 2);
    lua_rawseti(L, -2, 1);
    ml_setuservalue(L, -2);
  }
  ml_fiber_resume(h->f, 0);
  h->looked = 1;
  return 1;
}

static ml_hereref *check_here(lua_State *L, int i) {
  return (ml_hereref *)luaL_checkudata(L, i, ML_HERE_MT);
}

/* the loop's answer (step's arguments from 2) to the request io: true
 * (connected, sent), the bytes received, or false|nil, why ("timeout":
 * timed out) */
static void bridge_answer(lua_State *L, ml_bridge_io *io) {
  if (lua_toboolean(L, 2)) {
    if (io->kind == ML_BRIDGE_RECV) {
      size_t len;
      const char *b = lua_tolstring(L, 2, &len);
      if (!b || len == 0 || len > io->max) {
        io->failed = ECONNRESET;
        bson_strncpy(io->why, "a receive answered no bytes, or more than asked", sizeof io->why);
      } else {
        memcpy(io->room, b, len);
        io->got = len;
      }
    }
    return;
  }
  {
    const char *why = lua_tostring(L, 3);
    bson_strncpy(io->why, why ? why : "failed", sizeof io->why);
    io->failed = why && !strcmp(why, "timeout") ? ETIMEDOUT
                 : io->kind == ML_BRIDGE_CONNECT ? ECONNREFUSED : ECONNRESET;
  }
}

/* pushes the seconds left to the fiber's deadline (nil: none) */
static void push_left(lua_State *L, ml_fiber *f) {
  int64_t dl = ml_fiber_deadline(f);
  if (dl) {
    int64_t left = dl - bson_get_monotonic_time();
    lua_pushnumber(L, left > 0 ? (lua_Number)left / 1e6 : 0);
  } else {
    lua_pushnil(L);
  }
}

/* here:step() -> false, fd, seconds while the op waits for fd (readable)
 * for at most seconds (nil: no limit); false alone when it did not apply
 * (not sent, or refused by a server that is no primary: submit it to a
 * worker thread); else what client:run(op) answers, as job:take.  The op
 * is let go of once it answered (a second step answers nil, "taken").
 * Each step but the first first lets the op look again (pool:here's own
 * run has just looked).
 *
 * A bridged pool's op asks the loop instead (fiber_stream.h):
 *   false, "connect", id, host, port, nil, seconds
 *   false, "send", id, host, port, bytes, seconds
 *   false, "recv", id, host, port, max, seconds
 * and here:step(answer [, why]) gives the answer (true, the bytes received,
 * or false, why) and goes on; a step with no answer asks again. */
static int l_here_step(lua_State *L) {
  static const char *const kinds[] = {"", "connect", "send", "recv"};
  ml_hereref *ref = check_here(L, 1);
  ml_here *h = ref->h;
  ml_bridge_io *io;
  int n, looked;
  if (!h) return ml_pushfail(L, "taken", 0);
  io = h->ended ? NULL : (ml_bridge_io *)ml_fiber_request(h->f);
  looked = h->looked;
  h->looked = 0;
  if (!h->ended && (io ? lua_gettop(L) >= 2 : !looked)) {
    if (io) bridge_answer(L, io);
    ml_fiber_resume(h->f, 0);
    io = h->ended ? NULL : (ml_bridge_io *)ml_fiber_request(h->f);
  }
  if (io) {
    lua_pushboolean(L, 0);
    lua_pushstring(L, kinds[io->kind]);
    lua_pushinteger(L, (lua_Integer)io->id);
    lua_pushstring(L, io->host);
    lua_pushinteger(L, io->port);
    if (io->kind == ML_BRIDGE_SEND) lua_pushlstring(L, io->data, io->len);
    else if (io->kind == ML_BRIDGE_RECV) lua_pushinteger(L, (lua_Integer)io->max);
    else lua_pushnil(L);
    push_left(L, h->f);
    lua_pushboolean(L, io->used);
    return 8;
  }
  if (!h->ended) {
    lua_pushboolean(L, 0);
    lua_pushinteger(L, ml_fiber_fd(h->f));
    push_left(L, h->f);
    return 3;
  }
  if (h->elsewhere) {
    pthread_mutex_lock(&h->ps->mu);
    h->ps->writable_until = 0;
    pthread_mutex_unlock(&h->ps->mu);
    if (h->attempt) {
      ml_getuservalue(L, 1);
      lua_rawgeti(L, -1, 1);
      ml_attempt_unsend(L, lua_gettop(L));
      lua_pop(L, 2);
    }
    here_free(ref);
    lua_pushboolean(L, 0);
    return 1;
  }
  n = push_outcome(L, h->ok, &h->reply, &h->err);
  if (h->attempt && lua_type(L, -n) == LUA_TSTRING) {
    int r = lua_gettop(L) - n + 1;
    ml_getuservalue(L, 1);
    lua_rawgeti(L, -1, 1);
    ml_attempt_own_reply(L, lua_gettop(L), r);
    lua_pop(L, 2);
  }
  here_free(ref);
  return n;
}

/* pool:dead() -> {id...} | nil: the bridged connections destroyed since
 * the last call (any pool's of the process), whose sockets the loop keeps;
 * nil when there is none (an op's end asks: no table then) */
static int l_dead(lua_State *L) {
  uint64_t ids[64];
  size_t n, k;
  (void)check_pool(L, 1);
  n = ml_bridge_dead(ids, sizeof ids / sizeof ids[0]);
  if (n == 0) {
    lua_pushnil(L);
    return 1;
  }
  lua_createtable(L, (int)n, 0);
  for (k = 0; k < n; k++) {
    lua_pushinteger(L, (lua_Integer)ids[k]);
    lua_rawseti(L, -2, (int)k + 1);
  }
  return 1;
}

static int l_here_close(lua_State *L) {
  here_free(check_here(L, 1));
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- Lua ---------------------------------------------------------------- */

#define ML_SIGNAL_MT "mongolock.Signal"

typedef struct { ml_signal *sig; } ml_sigref;

/* the Signal at i (raises unless one, or when closed) */
static ml_signal *check_signal(lua_State *L, int i) {
  ml_sigref *r = (ml_sigref *)luaL_checkudata(L, i, ML_SIGNAL_MT);
  luaL_argcheck(L, r->sig != NULL, i, "signal closed");
  return r->sig;
}

ml_signal *ml_check_signal(lua_State *L, int i) {
  return check_signal(L, i);
}

/* core.signal() -> sig | nil, message: an eventfd that jobs (submit's sig)
 * and change streams (watch_wait's) write when something is there */
static int l_signal(lua_State *L) {
  ml_sigref *r = (ml_sigref *)ml_newuserdata(L, sizeof *r);
  r->sig = NULL;
  luaL_getmetatable(L, ML_SIGNAL_MT);
  lua_setmetatable(L, -2);
  if (!(r->sig = signal_new())) {
    int e = errno;
    lua_pushnil(L);
    lua_pushfstring(L, "eventfd: %s", strerror(e));
    return 2;
  }
  return 1;
}

/* sig:fd() -> the descriptor | nil once closed */
static int l_signal_fd(lua_State *L) {
  ml_sigref *r = (ml_sigref *)luaL_checkudata(L, 1, ML_SIGNAL_MT);
  if (r->sig) lua_pushinteger(L, r->sig->fd);   /* only the Lua side closes it */
  else lua_pushnil(L);
  return 1;
}

/* sig:clear() -> true when it had been written since the last clear */
static int l_signal_clear(lua_State *L) {
  ml_signal *g = check_signal(L, 1);
  uint64_t n = 0;
  ssize_t got = read(g->fd, &n, sizeof n);      /* non-blocking */
  lua_pushboolean(L, got == (ssize_t)sizeof n && n > 0);
  return 1;
}

/* sig:close() (also __gc): idempotent; a job or stream holding it writes
 * it no more */
static int l_signal_close(lua_State *L) {
  ml_sigref *r = (ml_sigref *)luaL_checkudata(L, 1, ML_SIGNAL_MT);
  ml_signal *g = r->sig;
  if (g) {
    r->sig = NULL;
    signal_close(g);
    ml_signal_unref(g);
  }
  lua_pushboolean(L, 1);
  return 1;
}


static ml_pool *check_pool(lua_State *L, int i) {
  return (ml_pool *)luaL_checkudata(L, i, ML_POOL_MT);
}

/* signals the threads to end; a pool of another process is abandoned */
static void pool_close(ml_pool *p) {
  pool_state *ps = p->ps;
  if (!ps) return;
  p->ps = NULL;
  if (ps->pid != my_pid) return;
  pthread_mutex_lock(&ps->mu);
  ps->stop = 1;
  wake_idle(ps, 1);
  pthread_mutex_unlock(&ps->mu);
  state_unref(ps);
}

/* core.pool(client, threads [, "bridged"]) -> pool | nil, message:
 * threads (1..256) worker threads on a libmongoc pool of their own, made
 * from the client's URI (its options as connect set them) and write
 * concern.  "bridged": the ops of pool:here move their bytes through the
 * caller's event loop (nginx's cosockets: fiber_stream.h), and threads may
 * be 0 (pool:submit then fails) */
static int l_pool(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  lua_Integer n = luaL_checkinteger(L, 2);
  int bridged = !lua_isnoneornil(L, 3) && !strcmp(luaL_checkstring(L, 3), "bridged");
  ml_pool *p;
  pool_state *ps;
  mongoc_uri_t *uri;
  sigset_t old;
  int k;
  luaL_argcheck(L, lua_isnoneornil(L, 3) || bridged, 3, "\"bridged\" or nothing expected");
  luaL_argcheck(L, n >= (bridged ? 0 : 1) && n <= THREADS_MAX, 2,
                bridged ? "threads must be 0..256" : "threads must be 1..256");
  if (c->closed) return ml_pushfail(L, "closed", 0);
  p = (ml_pool *)ml_newuserdata(L, sizeof *p);
  p->ps = NULL;
  p->threads = 0;
  luaL_getmetatable(L, ML_POOL_MT);
  lua_setmetatable(L, -2);
  ps = (pool_state *)calloc(1, sizeof *ps);
  if (!ps) return ml_pushfail(L, "out of memory", 0);
  uri = mongoc_uri_copy(c->uri);
  ps->mpool = uri ? ml_pool_new(uri) : NULL;
  ps->plain = uri && ml_fiber_stream_fits(uri);
  ps->bridged = bridged;
  if (ps->plain && (ps->here_uri = mongoc_uri_copy(uri)))
    mongoc_uri_set_option_as_int32(ps->here_uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, HERE_SELECT_MS);
  if (uri) mongoc_uri_destroy(uri);
  if (!ps->mpool) {
    if (ps->here_uri) mongoc_uri_destroy(ps->here_uri);
    free(ps);
    return ml_pushfail(L, ml_pool_refused("cannot create a connection pool for this URI"), 0);
  }
  mongoc_client_pool_set_error_api(ps->mpool, MONGOC_ERROR_API_VERSION_2);
  ps->wc = mongoc_write_concern_copy(c->wc);
  pthread_mutex_init(&ps->mu, NULL);
  ml_graves_init(&ps->graves);
  ps->pid = my_pid;
  ps->refs = 1;
  p->ps = ps;
  ml_pin_library();
  /* the threads take no signal: the process's handlers run on its own
   * threads */
  ml_signals_block(&old);
  for (k = 0; k < n; k++) {
    pthread_t t;
    pthread_mutex_lock(&refs_mu);
    ps->refs++;
    pthread_mutex_unlock(&refs_mu);
    if (pthread_create(&t, NULL, pool_main, ps) != 0) {
      pthread_mutex_lock(&refs_mu);
      ps->refs--;
      pthread_mutex_unlock(&refs_mu);
      break;
    }
    pthread_detach(t);
    p->threads++;
  }
  ml_signals_restore(&old);
  if (p->threads == 0 && n > 0) {
    pool_close(p);
    return ml_pushfail(L, "cannot start a worker thread", 0);
  }
  return 1;
}

/* pool:submit(op [, sig]) -> job | nil, message: op (core.op_* or an
 * *_op method's string) queued for the next free thread; its end written
 * to sig (a Signal), to none (false), or to an eventfd of its own (nil) */
static int l_submit(lua_State *L) {
  ml_pool *p = check_pool(L, 1);
  pool_state *ps = p->ps;
  ml_op op;
  size_t len;
  const char *bytes;
  ml_job *j;
  ml_jobref *ref;
  ml_signal *sig = NULL;
  int own = 0;
  ml_arg_op(L, 2, &op);         /* raises unless it is an op */
  bytes = lua_tolstring(L, 2, &len);
  if (lua_isnil(L, 3) || lua_isnone(L, 3)) own = 1;
  else if (!(lua_isboolean(L, 3) && !lua_toboolean(L, 3))) sig = check_signal(L, 3);
  if (!ps) return ml_pushfail(L, "closed", 0);
  if (ps->pid != my_pid) return ml_pushfail(L, "the pool was made in another process", 0);
  if (p->threads == 0) return ml_pushfail(L, "the pool has no worker thread", 0);
  ref = (ml_jobref *)ml_newuserdata(L, sizeof *ref);
  ref->job = NULL;
  luaL_getmetatable(L, ML_JOB_MT);
  lua_setmetatable(L, -2);
  j = (ml_job *)calloc(1, sizeof *j);
  if (!j || !(j->op = (uint8_t *)malloc(len))) {
    free(j);
    return ml_pushfail(L, "out of memory", 0);
  }
  memcpy(j->op, bytes, len);
  j->oplen = (uint32_t)len;
  if (own) {
    j->own = 1;
    if (!(j->sig = signal_new())) {
      int e = errno;
      job_free(j);
      lua_pushnil(L);
      lua_pushfstring(L, "eventfd: %s", strerror(e));
      return 2;
    }
  } else if (sig) {
    ml_signal_ref(sig);
    j->sig = sig;
  }
  j->refs = 2;
  ref->job = j;
  pthread_mutex_lock(&ps->mu);
  if (ps->tail) ps->tail->next = j;
  else ps->head = j;
  ps->tail = j;
  wake_idle(ps, 0);
  pthread_mutex_unlock(&ps->mu);
  return 1;
}

/* calls the keeper's (pool:keep) field k with fd (none when fd < 0),
 * errors dropped: a loop's forget raising must not leave a socket open */
static void keeper_call(lua_State *L, int i, const char *k, int fd) {
  ml_getuservalue(L, i);
  if (lua_istable(L, -1)) {
    lua_getfield(L, -1, k);
    if (lua_isfunction(L, -1)) {
      if (fd >= 0) lua_pushinteger(L, fd);
      if (lua_pcall(L, fd >= 0 ? 1 : 0, 0, 0) != 0) lua_pop(L, 1);
    } else {
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
}

/* pool:keep(keeper): the loop keeps a fiber's socket watched after a wait
 * until keeper.forget(fd); the pool's dead sockets then wait unclosed
 * (graves) for pool:bury, and pool:close (also __gc) calls keeper.close()
 * first, which forgets every socket the loop may still watch.  Before the
 * pool's first op */
static int l_pool_keep(lua_State *L) {
  ml_pool *p = check_pool(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  if (p->ps && !p->ps->bridged) {
    lua_pushvalue(L, 2);
    ml_setuservalue(L, 1);
    p->ps->keep = 1;
  }
  lua_pushboolean(L, p->ps && p->ps->keep);
  return 1;
}

/* pool:bury(): the sockets of connections destroyed since (graves), each
 * forgotten by the loop (keeper.forget(fd)), then closed */
static int l_pool_bury(lua_State *L) {
  ml_pool *p = check_pool(L, 1);
  mongoc_stream_t *s;
  int fd;
  if (!p->ps || !p->ps->keep || p->ps->pid != my_pid) return 0;
  while ((s = ml_graves_pop(&p->ps->graves, &fd))) {
    keeper_call(L, 1, "forget", fd);
    mongoc_stream_destroy(s);
  }
  return 0;
}

static int l_pool_close(lua_State *L) {
  ml_pool *p = check_pool(L, 1);
  if (p->ps && p->ps->keep && p->ps->pid == my_pid) {
    keeper_call(L, 1, "close", -1);
    l_pool_bury(L);
  }
  pool_close(p);
  lua_pushboolean(L, 1);
  return 1;
}

static int l_pool_threads(lua_State *L) {
  ml_pool *p = check_pool(L, 1);
  lua_pushinteger(L, p->ps ? p->threads : 0);
  return 1;
}

/* the Lua side lets go of the job: its fd closed, its reference dropped */
static void job_release(ml_jobref *ref) {
  ml_job *j = ref->job, *last;
  if (!j) return;
  ref->job = NULL;
  if (j->own) signal_close(j->sig);
  pthread_mutex_lock(&jobs_mu);
  last = job_unref_locked(j);
  pthread_mutex_unlock(&jobs_mu);
  job_free(last);
}

static ml_jobref *check_job(lua_State *L, int i) {
  return (ml_jobref *)luaL_checkudata(L, i, ML_JOB_MT);
}

/* job:fd() -> the eventfd written at its end | nil once taken or closed,
 * or when it has none */
static int l_job_fd(lua_State *L) {
  ml_jobref *ref = check_job(L, 1);
  int fd = -1;
  if (ref->job && ref->job->sig) {
    pthread_mutex_lock(&sig_mu);
    fd = ref->job->sig->fd;
    pthread_mutex_unlock(&sig_mu);
  }
  if (fd < 0) lua_pushnil(L);
  else lua_pushinteger(L, fd);
  return 1;
}

/* job:take() -> false while it runs; then what client:run(op) answers:
 * reply | nil, message, code, ereply, domain (BSON strings); the job is
 * let go of then (a second take answers nil, "taken") */
static int l_job_take(lua_State *L) {
  ml_jobref *ref = check_job(L, 1);
  ml_job *j = ref->job;
  int done, n;
  if (!j) return ml_pushfail(L, "taken", 0);
  pthread_mutex_lock(&jobs_mu);
  done = j->done;
  pthread_mutex_unlock(&jobs_mu);
  if (!done) {
    lua_pushboolean(L, 0);
    return 1;
  }
  /* done: the thread no longer touches the outcome */
  n = push_outcome(L, j->ok, &j->reply, &j->err);
  job_release(ref);
  return n;
}

static int l_job_close(lua_State *L) {
  job_release(check_job(L, 1));
  lua_pushboolean(L, 1);
  return 1;
}

/* core.pid() -> this process's id, as core.getpid() answers it, without a
 * system call (kept by fork's handler) */
static int l_pid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)my_pid);
  return 1;
}

static const luaL_Reg pool_methods[] = {
  {"submit", l_submit},
  {"here", l_here},
  {"dead", l_dead},
  {"keep", l_pool_keep},
  {"bury", l_pool_bury},
  {"close", l_pool_close},
  {"threads", l_pool_threads},
  {NULL, NULL}
};

static const luaL_Reg here_methods[] = {
  {"step", l_here_step},
  {"close", l_here_close},
  {NULL, NULL}
};

static const luaL_Reg signal_methods[] = {
  {"fd", l_signal_fd},
  {"clear", l_signal_clear},
  {"close", l_signal_close},
  {NULL, NULL}
};

static const luaL_Reg job_methods[] = {
  {"fd", l_job_fd},
  {"take", l_job_take},
  {"close", l_job_close},
  {NULL, NULL}
};

static void new_mt(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc) {
  luaL_newmetatable(L, name);
  lua_newtable(L);
  luaL_setfuncs(L, methods, 0);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, gc);
  lua_setfield(L, -2, "__gc");
  lua_pushstring(L, name);
  lua_setfield(L, -2, "__name");
  lua_pop(L, 1);
}

void ml_pool_open(lua_State *L) {
  pthread_once(&atfork_once, install_atfork);
  new_mt(L, ML_POOL_MT, pool_methods, l_pool_close);
  new_mt(L, ML_JOB_MT, job_methods, l_job_close);
  new_mt(L, ML_HERE_MT, here_methods, l_here_close);
  new_mt(L, ML_SIGNAL_MT, signal_methods, l_signal_close);
  lua_pushcfunction(L, l_pool);
  lua_setfield(L, -2, "pool");
  lua_pushcfunction(L, l_signal);
  lua_setfield(L, -2, "signal");
  lua_pushcfunction(L, l_pid);
  lua_setfield(L, -2, "pid");
  /* core.fibers: false in a build without fibers (AddressSanitizer):
   * pool:here answers false, every op goes to a worker thread */
  lua_pushboolean(L, ml_fiber_available());
  lua_setfield(L, -2, "fibers");
}
