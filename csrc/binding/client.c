/*
 * mongolock.Client: one libmongoc pool per process, the Lua side's
 * connection popped from it, the write concern, and the Client's own
 * methods; the files that implement the others (named.c, documents.c, ...)
 * each export theirs, which module.c adds with ml_client_methods.
 *
 * Fork: the pid that made the pool is kept; in another process the pool and
 * connection are abandoned (libmongoc forbids destroying them in a child)
 * and new ones are made on first use.
 */
#define _GNU_SOURCE             /* dladdr */
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bounded.h"
#include "compat.h"
#include "lease.h"
#include "args.h"
#include "client.h"
#include "renew.h"
#include "sys.h"
#include "transport.h"

/* ---- process exit ------------------------------------------------------ */

/*
 * While a pool is open, background threads (libmongoc's monitors, the
 * renewal thread of renew.c, the change-stream threads of watch.c) may be
 * inside libmongoc or OpenSSL at any moment.  A normal exit() runs the exit
 * handlers and library destructors on the main thread meanwhile: OpenSSL's
 * cleanup frees its locks and Debian's libmongoc calls mongoc_cleanup from
 * its destructor, and a thread that touches either afterwards crashes the
 * process while it exits (seen as SIGSEGV in RAND_bytes from
 * mongoc_client_start_session, about one exit in 240 under load).  Nothing
 * of that teardown matters to a process that is ending, so: the first pool
 * registers an on_exit handler, which runs before every handler registered
 * earlier (the C library's own, libmongoc's and OpenSSL's among them), and
 * while any pool is still open it flushes stdio and ends the process at
 * once with the same status.  With every client closed, exit is untouched.
 * A child after fork owns none of its parent's pools.
 */
static volatile int pools_open;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static void exit_now(int status, void *arg) {
  (void)arg;
  if (__atomic_load_n(&pools_open, __ATOMIC_SEQ_CST) > 0) {
    fflush(NULL);
    _exit(status);
  }
}

/* ---- fork: libmongoc's process-wide lock ------------------------------- */

/*
 * libmongoc (1.20 and later) guards every read of a topology description
 * (each server selection, so each command) and every update of one (each
 * monitor's check, a new pool's first) with one process-wide read-write
 * lock (mongoc-shared.c).  A fork() while a thread of the parent is inside
 * it leaves it held in the child by a thread the child does not have, for
 * ever: the child's first pool would wait for it for ever (README,
 * Limitations).  A child whose parent had pools open looks once, before
 * its first pool: a thread of its own takes the lock for writing through
 * the one call libmongoc exports that does (a store into a pointer of the
 * thread's own).  Done within LOCK_LOOK seconds, the lock is free;
 * otherwise it never will be, and every pool of the process is refused
 * with that reason (the looking thread stays blocked in it, detached).
 * Without the symbol (another libmongoc) nothing is looked at.
 */
typedef struct { void *ptr, *aux; } ml_shared_ptr;   /* mongoc_shared_ptr, 1.20 to 2.x */
extern void mongoc_atomic_shared_ptr_store(ml_shared_ptr *out, ml_shared_ptr from) __attribute__((weak));

#define LOCK_LOOK 5.0
static volatile int inherited;   /* (atomic) this process forked from one with pools open:
                                  * 1 to look, 0 looked and free, -1 held for ever */

typedef struct {
  ml_shared_ptr slot;
  int done;                     /* (atomic) */
} lock_look;

static void *look_main(void *arg) {
  lock_look *l = (lock_look *)arg;
  ml_shared_ptr none = {NULL, NULL};
  mongoc_atomic_shared_ptr_store(&l->slot, none);
  __atomic_store_n(&l->done, 1, __ATOMIC_SEQ_CST);
  return NULL;
}

/* 1 when this process may make pools; 0 when libmongoc's lock was held at
 * fork (ml_pool_refused says so) */
static int driver_lock_free(void) {
  int st = __atomic_load_n(&inherited, __ATOMIC_SEQ_CST);
  lock_look *l;
  pthread_t t;
  double until;
  if (st == 0 || !mongoc_atomic_shared_ptr_store) return 1;
  if (st < 0) return 0;
  /* the thread's: left to it when it stays blocked (once per process) */
  if (!(l = (lock_look *)calloc(1, sizeof *l))) return 1;
  if (pthread_create(&t, NULL, look_main, l) != 0) {
    free(l);
    return 1;
  }
  pthread_detach(t);
  until = ml_monotonic() + LOCK_LOOK;
  while (!__atomic_load_n(&l->done, __ATOMIC_SEQ_CST) && ml_monotonic() < until) ml_sleep(0.001);
  if (!__atomic_load_n(&l->done, __ATOMIC_SEQ_CST)) {
    __atomic_store_n(&inherited, -1, __ATOMIC_SEQ_CST);   /* l stays the thread's */
    return 0;
  }
  free(l);
  __atomic_store_n(&inherited, 0, __ATOMIC_SEQ_CST);
  return 1;
}

const char *ml_pool_refused(const char *otherwise) {
  if (__atomic_load_n(&inherited, __ATOMIC_SEQ_CST) < 0)
    return "libmongoc's lock was held when this process forked: the driver cannot be used in this process "
           "(fork before making clients, or close them before fork: README, Limitations)";
  return otherwise;
}

static void forget_pools(void) {
  __atomic_store_n(&inherited, __atomic_load_n(&pools_open, __ATOMIC_SEQ_CST) > 0 ? 1 : 0, __ATOMIC_SEQ_CST);
  __atomic_store_n(&pools_open, 0, __ATOMIC_SEQ_CST);
}

static void exit_register(void) {
  on_exit(exit_now, NULL);
  pthread_atfork(NULL, NULL, forget_pools);
}

/* ---- topology changes -------------------------------------------------- */

/*
 * Every pool reports its topology changes (SDAM monitoring: a server's
 * description or the topology's changed; libmongoc reports no change when
 * a heartbeat finds the same) by bumping one process-wide count, with the
 * time of the latest.  client:writable() answers true again without
 * copying the server descriptions while the count has not moved since it
 * last looked.  libmongoc reports a change just before it publishes it, so
 * a look within TOPOLOGY_SETTLE seconds of a change is not kept.
 */
#define TOPOLOGY_SETTLE 1.0
static uint64_t topology_gen;      /* (atomic) changes seen, every pool */
static int64_t topology_at_us;     /* (atomic) ml_monotonic() of the latest, us */

static void topology_changed(void) {
  __atomic_store_n(&topology_at_us, (int64_t)(ml_monotonic() * 1e6), __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&topology_gen, 1, __ATOMIC_SEQ_CST);
}

static void on_server_changed(const mongoc_apm_server_changed_t *e) {
  (void)e;
  topology_changed();
}

static void on_topology_changed(const mongoc_apm_topology_changed_t *e) {
  (void)e;
  topology_changed();
}

static void on_server_closed(const mongoc_apm_server_closed_t *e) {
  (void)e;
  topology_changed();
}

mongoc_client_pool_t *ml_pool_new(const mongoc_uri_t *uri) {
  mongoc_client_pool_t *pool;
  mongoc_apm_callbacks_t *cbs;
  pthread_once(&exit_once, exit_register);
  if (!driver_lock_free()) return NULL;
  pool = mongoc_client_pool_new(uri);
  if (!pool) return NULL;
  __atomic_add_fetch(&pools_open, 1, __ATOMIC_SEQ_CST);
  cbs = mongoc_apm_callbacks_new();
  if (cbs) {
    mongoc_apm_set_server_changed_cb(cbs, on_server_changed);
    mongoc_apm_set_topology_changed_cb(cbs, on_topology_changed);
    mongoc_apm_set_server_closed_cb(cbs, on_server_closed);
    mongoc_client_pool_set_apm_callbacks(pool, cbs, NULL);
    mongoc_apm_callbacks_destroy(cbs);
  }
  return pool;
}

void ml_pool_destroy(mongoc_client_pool_t *pool) {
  mongoc_client_pool_destroy(pool);
  __atomic_sub_fetch(&pools_open, 1, __ATOMIC_SEQ_CST);
}

/* ---- the pool ---------------------------------------------------------- */

ml_client *ml_checkclient(lua_State *L, int idx) {
  ml_client *c = (ml_client *)luaL_checkudata(L, idx, ML_CLIENT_MT);
  if (c->closed) luaL_error(L, "attempt to use a closed mongolock client");
  return c;
}

/* makes pool and client for this process; raises on failure */
static void client_make(lua_State *L, ml_client *c) {
  mongoc_client_pool_t *pool;
  if (c->pool && c->pid == ml_pid()) return;
  /* in a forked child: abandon the parent's pool and connection; the
   * parent's sockets and monitor threads are not ours to tear down */
  c->pool = NULL;
  c->client = NULL;
  c->renew_state = NULL;
  c->writable_seen = 0;
  pool = ml_pool_new(c->uri);
  if (!pool) luaL_error(L, "mongolock: %s", ml_pool_refused("cannot create a connection pool for this URI"));
  mongoc_client_pool_set_error_api(pool, MONGOC_ERROR_API_VERSION_2);
  c->pool = pool;
  c->pid = ml_pid();
}

mongoc_client_pool_t *ml_client_pool(lua_State *L, ml_client *c) {
  if (c->closed) luaL_error(L, "attempt to use a closed mongolock client");
  client_make(L, c);
  return c->pool;
}

mongoc_client_t *ml_client_get(lua_State *L, ml_client *c) {
  if (c->closed) luaL_error(L, "attempt to use a closed mongolock client");
  client_make(L, c);
  if (!c->client) {
    c->client = mongoc_client_pool_pop(c->pool);
    if (!c->client) luaL_error(L, "mongolock: cannot take a connection from the pool");
    ml_bounded_use(c->client);   /* its single attempts' deadline (one_attempt) */
  }
  return c->client;
}

const char *ml_client_dbname(const ml_client *c) {
  return c->default_db ? c->default_db : "mongolock";
}

void ml_client_append_wc(const ml_client *c, bson_t *opts) {
  mongoc_write_concern_append(c->wc, opts);
}

/* ---- a single attempt, bounded (client:one_attempt) ------------------ */

/*
 * A try (timeout = 0) must end in about a second even when the server
 * stopped answering after the client last saw it writable, where the
 * connection's socket timeout (the server bound) and the driver's retry of
 * a write would make it wait twice the server bound.  While
 * client:one_attempt is on, each ml_run of this thread on the client's own
 * connection runs with a deadline attempt_ms away (bounded.h: the
 * connection's reads, writes and new connections wait no longer).  A round
 * trip cut so answers a network error, code 4, that says why.
 */
static __thread ml_client *single_client;        /* one_attempt is on */

/* ml_run's runner while one_attempt is on (ml_run_override) */
static int single_runner(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op, bson_t *reply,
                         bson_error_t *error) {
  ml_client *c = single_client;
  int64_t before;
  int ok, passed;
  if (!c || c->closed || c->attempt_ms <= 0 || mc != c->client || op->session)
    return ml_run_direct(mc, wc, op, reply, error);
  before = ml_bounded_begin(c->attempt_ms);
  ok = ml_run_direct(mc, wc, op, reply, error);
  passed = ml_bounded_end(before);
  if (!ok && passed && error->domain == MONGOC_ERROR_STREAM)
    bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_SOCKET,
                   "no reply within %d ms (attempt_timeout): socket timeout, the server is not answering",
                   (int)c->attempt_ms);
  return ok;
}

/* client:one_attempt(on) -> the previous setting: while on, this thread's
 * round trips on the client are single attempts, each bounded by the
 * connect's attempt bound (single_runner above) */
static int l_one_attempt(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  int on = lua_toboolean(L, 2);
  lua_pushboolean(L, single_client == c);
  if (on && c->attempt_ms > 0) {
    single_client = c;
    ml_run_override(single_runner);
  } else if (!on && single_client == c) {
    single_client = NULL;
    ml_run_override(NULL);
  }
  return 1;
}

/* ---- a closed client's pool, still used by detached threads ----------- */

static pthread_mutex_t orphan_mu = PTHREAD_MUTEX_INITIALIZER;

ml_orphan *ml_orphan_take(ml_client *c) {
  ml_orphan *o = c->orphan;
  if (!o) {
    o = (ml_orphan *)calloc(1, sizeof *o);
    if (!o) return NULL;
    o->pool = c->pool;
    o->refs = 1;                /* close's own, dropped as it ends */
    c->orphan = o;
  }
  pthread_mutex_lock(&orphan_mu);
  o->refs++;
  pthread_mutex_unlock(&orphan_mu);
  return o;
}

void ml_orphan_drop(ml_orphan *o) {
  int last;
  pthread_mutex_lock(&orphan_mu);
  last = --o->refs == 0;
  pthread_mutex_unlock(&orphan_mu);
  if (last) {
    ml_pool_destroy(o->pool);
    free(o);
  }
}

static pthread_once_t pin_once = PTHREAD_ONCE_INIT;
static void pin(void) {
  Dl_info info;
  if (dladdr((const void *)&orphan_mu, &info) && info.dli_fname)
    (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_NODELETE | RTLD_NOLOAD);
}
void ml_pin_library(void) {
  pthread_once(&pin_once, pin);
}

/* idempotent; safe in a forked child (abandons instead of destroying) */
static void client_close(ml_client *c) {
  if (c->closed) return;
  c->closed = 1;
  /* this thread's single attempts (one_attempt) end with their client: the
   * runner must not look at it once it is freed */
  if (single_client == c) {
    single_client = NULL;
    ml_run_override(NULL);
  }
  if (c->pool && c->pid == ml_pid()) {
    if (c->on_close) c->on_close(c);
    if (c->client) mongoc_client_pool_push(c->pool, c->client);
    if (c->orphan) ml_orphan_drop(c->orphan);
    else ml_pool_destroy(c->pool);
    c->orphan = NULL;
  } else if (!c->pool && c->external && c->on_close) {
    c->on_close(c);             /* an external engine without a pool */
  }
  ml_held_forget(c);
  c->pool = NULL;
  c->client = NULL;
  if (c->uri) mongoc_uri_destroy(c->uri);
  c->uri = NULL;
  if (c->wc) mongoc_write_concern_destroy(c->wc);
  c->wc = NULL;
  bson_free(c->default_db);
  c->default_db = NULL;
}

/* ---- Lua functions ----------------------------------------------------- */

/*
 * What libmongoc accepts but would only report later, at the first call,
 * in words that may quote a secret or hide the cause.  On failure pushes
 * the message ("invalid URI: ...") and returns 0; never names the user
 * name, the password or tlsCertificateKeyFilePassword.
 *  - an '@' left unescaped in a user name or password: libmongoc splits
 *    the URI at the first '@' and takes the rest of the password for a
 *    host name, which its server-selection errors print;
 *  - tlsCAFile or tlsCertificateKeyFile that this process cannot read:
 *    libmongoc says only "Failed initialize TLS state."
 */
static int uri_usable(lua_State *L, const mongoc_uri_t *uri) {
  static const char *const files[] = {MONGOC_URI_TLSCAFILE, MONGOC_URI_TLSCERTIFICATEKEYFILE};
  const mongoc_host_list_t *h;
  const char *srv = mongoc_uri_get_srv_hostname(uri); /* NULL unless mongodb+srv:// */
  int at = srv && strchr(srv, '@');
  size_t k;
  for (h = mongoc_uri_get_hosts(uri); h && !at; h = h->next) at = strchr(h->host_and_port, '@') != NULL;
  if (at) {
    lua_pushliteral(L, "invalid URI: an '@' in a host name; an '@' in a user name or password must be "
                       "written %40");
    return 0;
  }
  for (k = 0; k < sizeof files / sizeof files[0]; k++) {
    const char *path = mongoc_uri_get_option_as_utf8(uri, files[k], NULL);
    FILE *f;
    if (!path) continue;
    f = fopen(path, "r");
    if (!f) {
      char buf[128];
      int e = errno;
      lua_pushfstring(L, "invalid URI: %s %s: %s", k == 0 ? "tlsCAFile" : "tlsCertificateKeyFile", path,
                      bson_strerror_r(e, buf, sizeof buf));
      return 0;
    }
    fclose(f);
  }
  return 1;
}

/*
 * core.connect(uri, appname, w, wtimeout_ms, pool_size, sst_ms, bound_ms,
 *              attempt_ms) -> client | nil, message
 * w: "majority", an integer >= 1, or nil for the URI's w, else "majority";
 * an unacknowledged write concern (the URI's w=0) is refused.  appname,
 * wtimeout_ms, pool_size and sst_ms may be nil (the URI's or libmongoc's).
 * bound_ms: serverSelectionTimeoutMS, connectTimeoutMS and socketTimeoutMS,
 * each unless the URI (or sst_ms) gives it, so that no round trip waits for
 * an unreachable or silent server longer than about that.
 * attempt_ms (nil: none): how long a single attempt waits for a reply
 * (client:one_attempt).
 * The Lua layer (mongolock.connect) checks and converts friendly options;
 * this checks types again and never trusts them.
 */
static int l_connect(lua_State *L) {
  const char *s = luaL_checkstring(L, 1);
  const char *appname = luaL_optstring(L, 2, NULL);
  bson_error_t err;
  mongoc_uri_t *uri;
  mongoc_write_concern_t *wc;
  ml_client *c;
  size_t len;

  int arg;

  /* every type check that can raise, before the URI is made (it would
   * leak): the checks below see the same values again */
  if (!lua_isnoneornil(L, 3) && lua_type(L, 3) != LUA_TSTRING) (void)luaL_checkinteger(L, 3);
  for (arg = 4; arg <= 8; arg++)
    if (!lua_isnoneornil(L, arg)) (void)luaL_checkinteger(L, arg);
  (void)lua_tolstring(L, 1, &len);
  if (strlen(s) != len) return ml_pushfail(L, "invalid URI: contains a NUL byte", 0);
  uri = mongoc_uri_new_with_error(s, &err);
  if (!uri) {
    lua_pushnil(L);
    lua_pushfstring(L, "invalid URI: %s", err.message);
    return 2;
  }
  if (!uri_usable(L, uri)) {
    mongoc_uri_destroy(uri);
    lua_pushnil(L);
    lua_insert(L, -2);
    return 2;
  }
  if (appname) {
    if (strlen(appname) > 128 || !mongoc_uri_set_appname(uri, appname)) {
      mongoc_uri_destroy(uri);
      return ml_pushfail(L, "invalid appname (at most 128 bytes)", 0);
    }
  }
  if (!lua_isnoneornil(L, 5)) {
    lua_Integer n = luaL_checkinteger(L, 5);
    if (n < 1 || n > 100000) {
      mongoc_uri_destroy(uri);
      return luaL_argerror(L, 5, "pool size must be 1 .. 100000");
    }
    mongoc_uri_set_option_as_int32(uri, MONGOC_URI_MAXPOOLSIZE, (int32_t)n);
  }
  if (!lua_isnoneornil(L, 6)) {
    lua_Integer n = luaL_checkinteger(L, 6);
    if (n < 1 || n > INT32_MAX) {
      mongoc_uri_destroy(uri);
      return luaL_argerror(L, 6, "server selection timeout out of range");
    }
    mongoc_uri_set_option_as_int32(uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, (int32_t)n);
  }
  if (!lua_isnoneornil(L, 7)) {
    static const char *const bounded[] = {MONGOC_URI_SERVERSELECTIONTIMEOUTMS,
                                          MONGOC_URI_CONNECTTIMEOUTMS,
                                          MONGOC_URI_SOCKETTIMEOUTMS};
    lua_Integer n = luaL_checkinteger(L, 7);
    size_t k;
    if (n < 1 || n > INT32_MAX) {
      mongoc_uri_destroy(uri);
      return luaL_argerror(L, 7, "server timeout out of range");
    }
    for (k = 0; k < sizeof bounded / sizeof bounded[0]; k++)
      if (!mongoc_uri_has_option(uri, bounded[k]))
        mongoc_uri_set_option_as_int32(uri, bounded[k], (int32_t)n);
  }

  /* the URI's write concern unless one was given; "majority" when neither */
  wc = mongoc_write_concern_copy(mongoc_uri_get_write_concern(uri));
  if (lua_type(L, 3) == LUA_TSTRING) {
    if (strcmp(lua_tostring(L, 3), "majority") != 0) {
      mongoc_write_concern_destroy(wc);
      mongoc_uri_destroy(uri);
      return luaL_argerror(L, 3, "write concern must be \"majority\" or a number");
    }
    mongoc_write_concern_set_w(wc, MONGOC_WRITE_CONCERN_W_MAJORITY);
  } else if (!lua_isnoneornil(L, 3)) {
    lua_Integer w = luaL_checkinteger(L, 3);
    if (w < 1 || w > 50) {
      mongoc_write_concern_destroy(wc);
      mongoc_uri_destroy(uri);
      return luaL_argerror(L, 3, "write concern w out of range (1 .. 50; 0 is unacknowledged)");
    }
    mongoc_write_concern_set_w(wc, (int32_t)w);
  } else if (mongoc_write_concern_get_w(wc) == MONGOC_WRITE_CONCERN_W_DEFAULT &&
             !mongoc_write_concern_get_wtag(wc)) {
    mongoc_write_concern_set_w(wc, MONGOC_WRITE_CONCERN_W_MAJORITY);
  }
  if (!lua_isnoneornil(L, 4)) {
    lua_Integer t = luaL_checkinteger(L, 4);
    if (t < 0) t = 0;
    mongoc_write_concern_set_wtimeout_int64(wc, (int64_t)t);
  }
  /* Invariant: every write is acknowledged.  Unacknowledged (the URI's
   * w=0 with no write_concern given) an acquire could not tell whether it
   * took the lock, nor a release whether it freed it. */
  if (!mongoc_write_concern_is_acknowledged(wc)) {
    mongoc_write_concern_destroy(wc);
    mongoc_uri_destroy(uri);
    return ml_pushfail(L, "invalid URI: w=0 asks for unacknowledged writes: a lock needs the server's "
                          "answer; use w=majority or w=1 or more (or the write_concern option)", 0);
  }

  c = (ml_client *)ml_newuserdata(L, sizeof *c);
  memset(c, 0, sizeof *c);
  luaL_getmetatable(L, ML_CLIENT_MT);
  lua_setmetatable(L, -2);
  c->uri = uri;
  c->wc = wc;
  if (!lua_isnoneornil(L, 8)) {
    lua_Integer n = luaL_checkinteger(L, 8);
    c->attempt_ms = n < 1 ? 1 : n > INT32_MAX ? INT32_MAX : (int32_t)n;
  }
  c->obs = ml_obs_new();
  if (!c->obs) {
    client_close(c);
    return ml_pushfail(L, "out of memory", 0);
  }
  if (mongoc_uri_get_database(uri))
    c->default_db = bson_strdup(mongoc_uri_get_database(uri));
  /* make the pool now so that a URI libmongoc cannot use fails here */
  c->pool = ml_pool_new(uri);
  if (!c->pool) {
    client_close(c);
    return ml_pushfail(L, ml_pool_refused("invalid URI: libmongoc cannot use it"), 0);
  }
  mongoc_client_pool_set_error_api(c->pool, MONGOC_ERROR_API_VERSION_2);
  c->pid = ml_pid();
  return 1;
}

/* client:close() -> true; idempotent */
static int l_close(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  client_close(c);
  lua_pushboolean(L, 1);
  return 1;
}

#if LUA_VERSION_NUM >= 504
static int l_tclose(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  client_close(c);
  return 0;
}
#endif

/* the counters stay readable after close; the client's reference to them
 * goes with the userdata (leases keep their own) */
static int l_gc(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  client_close(c);
  ml_obs_unref(c->obs);
  c->obs = NULL;
  return 0;
}

/*
 * client:writable() -> boolean: libmongoc's monitors know a server that
 * takes writes now (a primary, a standalone, a mongos or a load balancer).
 * No round trip: it reads the topology the pool's monitors keep, so a
 * caller with a deadline can wait for a server without entering server
 * selection, which would block for the whole serverSelectionTimeoutMS.
 * A true answer is kept until a pool reports a topology change (above):
 * the look copies every server's description, about 3 us per try.
 */
static int l_writable(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  mongoc_client_t *mc = ml_client_get(L, c);
  mongoc_server_description_t **sds;
  size_t n = 0, k;
  int ok = 0;
  uint64_t gen = __atomic_load_n(&topology_gen, __ATOMIC_SEQ_CST);
  if (c->writable_seen && c->writable_gen == gen) {
    lua_pushboolean(L, 1);
    return 1;
  }
  sds = mongoc_client_get_server_descriptions(mc, &n);
  for (k = 0; k < n && !ok; k++) {
    const char *t = mongoc_server_description_type(sds[k]);
    ok = !strcmp(t, "RSPrimary") || !strcmp(t, "Standalone") || !strcmp(t, "Mongos") ||
         !strcmp(t, "LoadBalancer");
  }
  mongoc_server_descriptions_destroy_all(sds, n);
  c->writable_seen = ok && ml_monotonic() - (double)__atomic_load_n(&topology_at_us, __ATOMIC_SEQ_CST) / 1e6 >
                                TOPOLOGY_SETTLE;
  c->writable_gen = gen;
  lua_pushboolean(L, ok);
  return 1;
}

/*
 * client:probe(seconds) -> true | nil, message, code: why no server takes
 * writes, in libmongoc's words (a refused connection, a TLS handshake that
 * failed, ...).  One selection that tries each server once, each connect
 * bounded by seconds, on a connection of its own made from the client's
 * URI (its credentials and TLS options), so that a caller that gave up
 * waiting for the pool's monitors can name the cause; blocks at most about
 * seconds per server.
 */
static int l_probe(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  double s = luaL_checknumber(L, 2);
  int32_t ms = s <= 0.001 ? 1 : s > 60 ? 60000 : (int32_t)(s * 1000);
  mongoc_uri_t *uri = mongoc_uri_copy(c->uri);
  mongoc_client_t *mc;
  mongoc_server_description_t *sd;
  bson_error_t err;
  if (!uri) return ml_pushfail(L, "out of memory", 0);
  mongoc_uri_set_option_as_bool(uri, MONGOC_URI_SERVERSELECTIONTRYONCE, true);
  mongoc_uri_set_option_as_int32(uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, ms);
  mongoc_uri_set_option_as_int32(uri, MONGOC_URI_CONNECTTIMEOUTMS, ms);
  mc = mongoc_client_new_from_uri(uri);
  mongoc_uri_destroy(uri);
  if (!mc) return ml_pushfail(L, "the client's URI makes no client", 0);
  sd = mongoc_client_select_server(mc, true, NULL, &err);
  mongoc_client_destroy(mc);
  if (sd) {
    mongoc_server_description_destroy(sd);
    lua_pushboolean(L, 1);
    return 1;
  }
  return ml_pusherror(L, &err);
}

/* client:request_scan() -> boolean: asks the background thread for a server
 * selection (renew.c, ml_renew_scan), which makes libmongoc check its
 * servers now; returns at once (false: no thread could be started) */
static int l_request_scan(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  lua_pushboolean(L, ml_renew_scan(L, c));
  return 1;
}

/* client:closed() -> boolean */
static int l_closed(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  lua_pushboolean(L, c->closed);
  return 1;
}

/* client:default_database() -> the URI's database or "mongolock" */
static int l_default_db(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  lua_pushstring(L, ml_client_dbname(c));
  lua_pushboolean(L, c->default_db != NULL);
  return 2;
}

static int l_tostring(lua_State *L) {
  ml_client *c = (ml_client *)luaL_checkudata(L, 1, ML_CLIENT_MT);
  if (c->closed) lua_pushliteral(L, "mongolock.Client (closed)");
  else lua_pushfstring(L, "mongolock.Client (%p)", (void *)c);
  return 1;
}

/*
 * client:get_number(db, coll, id, field) -> number | nil (no document or
 * no such field) | nil, message, code.  One find on the primary.
 * client:set_number(db, coll, id, field, value) -> true | nil, msg, code.
 * One upserting update ($set) with the client's write concern.
 * Plain reads and writes of one numeric field, for demos and benchmarks
 * (examples/counter.lua) that need a shared value without locks of their
 * own; id is a string _id.
 */
static int l_get_number(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = luaL_checkstring(L, 2);
  const char *coll = luaL_checkstring(L, 3);
  const char *id = luaL_checkstring(L, 4);
  const char *field = luaL_checkstring(L, 5);
  mongoc_collection_t *col = mongoc_client_get_collection(ml_client_get(L, c), db, coll);
  bson_t filter = BSON_INITIALIZER, opts = BSON_INITIALIZER, proj;
  const bson_t *doc;
  bson_error_t err;
  bson_iter_t it;
  mongoc_cursor_t *cur;
  int found = 0;
  BSON_APPEND_UTF8(&filter, "_id", id);
  BSON_APPEND_DOCUMENT_BEGIN(&opts, "projection", &proj);
  BSON_APPEND_INT32(&proj, field, 1);
  bson_append_document_end(&opts, &proj);
  BSON_APPEND_INT64(&opts, "limit", 1);
  BSON_APPEND_BOOL(&opts, "singleBatch", true);
  cur = mongoc_collection_find_with_opts(col, &filter, &opts, NULL);
  bson_destroy(&filter);
  bson_destroy(&opts);
  if (mongoc_cursor_next(cur, &doc) && bson_iter_init_find(&it, doc, field) &&
      BSON_ITER_HOLDS_NUMBER(&it)) {
    if (BSON_ITER_HOLDS_DOUBLE(&it)) lua_pushnumber(L, bson_iter_double(&it));
    else ml_pushint64(L, bson_iter_as_int64(&it));
    found = 1;
  }
  if (mongoc_cursor_error(cur, &err)) {
    if (found) lua_pop(L, 1);
    mongoc_cursor_destroy(cur);
    mongoc_collection_destroy(col);
    return ml_pusherror(L, &err);
  }
  mongoc_cursor_destroy(cur);
  mongoc_collection_destroy(col);
  if (!found) lua_pushnil(L);
  return 1;
}

static int l_set_number(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = luaL_checkstring(L, 2);
  const char *coll = luaL_checkstring(L, 3);
  const char *id = luaL_checkstring(L, 4);
  const char *field = luaL_checkstring(L, 5);
  lua_Number v = luaL_checknumber(L, 6);
  mongoc_collection_t *col = mongoc_client_get_collection(ml_client_get(L, c), db, coll);
  bson_t filter = BSON_INITIALIZER, update = BSON_INITIALIZER, set, opts = BSON_INITIALIZER;
  bson_error_t err;
  int ok;
  BSON_APPEND_UTF8(&filter, "_id", id);
  BSON_APPEND_DOCUMENT_BEGIN(&update, "$set", &set);
  if (v == floor(v) && fabs(v) < 9007199254740992.0) BSON_APPEND_INT64(&set, field, (int64_t)v);
  else BSON_APPEND_DOUBLE(&set, field, (double)v);
  bson_append_document_end(&update, &set);
  BSON_APPEND_BOOL(&opts, "upsert", true);
  ml_client_append_wc(c, &opts);
  ok = mongoc_collection_update_one(col, &filter, &update, &opts, NULL, &err);
  bson_destroy(&filter);
  bson_destroy(&update);
  bson_destroy(&opts);
  mongoc_collection_destroy(col);
  if (!ok) return ml_pusherror(L, &err);
  lua_pushboolean(L, 1);
  return 1;
}

/* client:set_external(on) -> true: this process's lease engine and change
 * streams of the client are driven from Lua (client:engine_next /
 * engine_done, renew.c; client:watch_next / watch_done, watch.c) instead
 * of threads of their own; set before the first lease and wait */
static int l_set_external(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  c->external = lua_toboolean(L, 2);
  lua_pushboolean(L, 1);
  return 1;
}

/* client:keeper() -> the 16 hex digits the leases this client renews in
 * this process carry (an acquire's keeper) | nil, message */
static int l_keeper(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  char k[17];
  if (!ml_renew_keeper(L, c, k)) return ml_pushfail(L, "out of memory", 0);
  lua_pushstring(L, k);
  return 1;
}

static const luaL_Reg client_methods[] = {
  {"close", l_close},
  {"closed", l_closed},
  {"writable", l_writable},
  {"request_scan", l_request_scan},
  {"probe", l_probe},
  {"one_attempt", l_one_attempt},
  {"set_external", l_set_external},
  {"keeper", l_keeper},
  {"default_database", l_default_db},
  {"get_number", l_get_number},
  {"set_number", l_set_number},
  {NULL, NULL}
};

static const luaL_Reg client_meta[] = {
  {"__gc", l_gc},
  {"__tostring", l_tostring},
#if LUA_VERSION_NUM >= 504
  {"__close", l_tclose},
#endif
  {NULL, NULL}
};

void ml_client_open(lua_State *L) {
  /* [module] */
  luaL_newmetatable(L, ML_CLIENT_MT);
  luaL_setfuncs(L, client_meta, 0);
  luaL_newlib(L, client_methods);
  lua_setfield(L, -2, "__index");
  lua_pushliteral(L, "mongolock.Client");
  lua_setfield(L, -2, "__name");
  lua_pop(L, 1);
  lua_pushcfunction(L, l_connect);
  lua_setfield(L, -2, "connect");
}

void ml_client_methods(lua_State *L, const luaL_Reg *methods) {
  luaL_getmetatable(L, ML_CLIENT_MT);            /* [mt] */
  lua_getfield(L, -1, "__index");                /* [mt, methods] */
  luaL_setfuncs(L, methods, 0);
  lua_pop(L, 2);
}
