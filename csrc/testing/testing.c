/*
 * Internal to mongolock: the specs' hooks, not an API.
 *
 * mongolock.testing: hooks for the specs and benchmarks, built next to
 * mongolock.core by the Makefile and never shipped in the rock.  It reads
 * the core through the internals table the core leaves in the registry
 * (module.h, ml_internals); both modules come from one build.
 *
 *   testing.fork() -> 0 in the child, its pid in the parent | nil, message
 *   testing.exit(status)              _exit(2) without closing Lua
 *   testing.exit_mark(path)           at a normal exit, creates path (an
 *                                     atexit handler: shows whether exit
 *                                     ran the handlers registered before)
 *   testing.crash_trace()             on SIGSEGV, SIGBUS, SIGFPE, SIGILL or
 *                                     SIGABRT in any thread: the thread's
 *                                     C backtrace on stderr, then the
 *                                     signal's default action (the specs'
 *                                     child processes, whose crashes are
 *                                     rare and seen in CI's output only)
 *   testing.driver_lock(hold)         takes (true) or gives back libmongoc's
 *                                     process-wide lock, for reading
 *   testing.lease_lock(h, hold)       takes (true) or gives back the mutex
 *                                     of handle h's lease
 *   testing.globals_lock(hold)        takes (true) or gives back the core's
 *                                     global locks that a fork handler
 *                                     makes anew in the child
 *   testing.counters_lock(client, hold)  the same for the mutex of the
 *                                     client's counters and events
 *   testing.waitpid(pid [, timeout])  -> exit status | nil, "timeout"
 *   testing.failpoint(client, spec)   -> true | nil, message, code
 *   testing.delete(client, db, coll, name) -> number deleted | nil, msg, code
 *   testing.opcounters(client)        -> serverStatus's opcounters
 *   testing.renew_stats(client)       -> {running, leases, renewals, ...}
 *   testing.renew_flush(client [, timeout]) -> true | false
 *   testing.watch_stats(client)       -> {streams, events, reopens, ...}
 *
 * client is the core's client (mongolock.connect(...)._core).
 */
#define _GNU_SOURCE             /* dladdr */
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "client.h"
#include "lock.h"
#include "renew.h"
#include "watch.h"
#include "module.h"

/* seconds on CLOCK_MONOTONIC (this module cannot call the core's) */
static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const ml_internals *core_internals(lua_State *L) {
  const ml_internals *in;
  lua_getfield(L, LUA_REGISTRYINDEX, ML_INTERNALS_KEY);
  in = (const ml_internals *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (!in) luaL_error(L, "mongolock.testing: mongolock.core is not loaded");
  return in;
}

static int push_error(lua_State *L, const bson_error_t *e) {
  lua_pushnil(L);
  lua_pushstring(L, e->message[0] ? e->message : "unknown error");
  if (e->code) lua_pushinteger(L, (lua_Integer)e->code);
  else lua_pushnil(L);
  return 3;
}

static void setint(lua_State *L, const char *key, long v) {
  lua_pushinteger(L, (lua_Integer)v);
  lua_setfield(L, -2, key);
}

/* ---- processes --------------------------------------------------------- */

static int l_fork(lua_State *L) {
  pid_t p;
  fflush(NULL);
  p = fork();
  if (p < 0) {
    lua_pushnil(L);
    lua_pushstring(L, strerror(errno));
    return 2;
  }
  lua_pushinteger(L, (lua_Integer)p);
  return 1;
}

/* ---- libmongoc's process-wide topology lock ---------------------------- */

/* mongoc_atomic_shared_ptr_load (exported by libmongoc 1.20 and later)
 * takes that lock, a static pthread_rwlock_t (mongoc-shared.c), for
 * reading; on x86-64 its first instruction that loads an address is a
 * lea of the lock, relative to the instruction pointer.  NULL elsewhere,
 * or when the code is not so. */
typedef struct { void *ptr, *aux; } shared_ptr_t;
extern shared_ptr_t mongoc_atomic_shared_ptr_load(const shared_ptr_t *p) __attribute__((weak));

static pthread_rwlock_t *driver_lock(void) {
#if defined(__x86_64__)
  shared_ptr_t (*load)(const shared_ptr_t *) = mongoc_atomic_shared_ptr_load;
  const unsigned char *code;
  Dl_info in_fn, lock_info;
  memcpy(&code, &load, sizeof code);    /* its machine code */
  if (!code || !dladdr((const void *)code, &in_fn)) return NULL;
  for (int i = 0; i < 48; i++) {
    /* REX.W (or REX.WR) 8D, ModRM mod 00 r/m 101: lea disp32(%rip), reg */
    if ((code[i] == 0x48 || code[i] == 0x4c) && code[i + 1] == 0x8d && (code[i + 2] & 0xc7) == 0x05) {
      int32_t disp;
      const unsigned char *lock;
      memcpy(&disp, code + i + 3, sizeof disp);
      lock = code + i + 7 + disp;
      if (!dladdr((const void *)lock, &lock_info) || lock_info.dli_fbase != in_fn.dli_fbase) return NULL;
      return (pthread_rwlock_t *)(void *)lock;
    }
  }
#endif
  return NULL;
}

/* testing.driver_lock(hold) -> true | nil, why: the calling thread takes
 * libmongoc's topology lock for reading (hold true) or gives it back: a
 * fork() meanwhile leaves a child with the lock held by a thread it does
 * not have, as a driver thread of the parent would */
static int l_driver_lock(lua_State *L) {
  pthread_rwlock_t *lock = driver_lock();
  int r;
  if (!lock) {
    lua_pushnil(L);
    lua_pushliteral(L, "libmongoc's lock not found (x86-64 and libmongoc 1.20 or later only)");
    return 2;
  }
  r = lua_toboolean(L, 1) ? pthread_rwlock_rdlock(lock) : pthread_rwlock_unlock(lock);
  if (r != 0) {
    lua_pushnil(L);
    lua_pushstring(L, strerror(r));
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* the calling thread takes mu (hold true) or gives it back: a fork()
 * meanwhile leaves a child with it held by a thread the child does not
 * have, as one of the parent's threads would; answers true */
static int hold_mutex(lua_State *L, pthread_mutex_t *mu, int hold) {
  if (hold) pthread_mutex_lock(mu);
  else pthread_mutex_unlock(mu);
  lua_pushboolean(L, 1);
  return 1;
}

/* testing.lease_lock(h, hold) -> true: the mutex of handle h's lease */
static int l_lease_lock(lua_State *L) {
  ml_lock *h = (ml_lock *)luaL_checkudata(L, 1, ML_LOCK_MT);
  if (!h->keep) return luaL_error(L, "testing.lease_lock: the handle has no lease");
  return hold_mutex(L, &h->keep->mu, lua_toboolean(L, 2));
}

/* testing.globals_lock(hold) -> true: the calling thread takes the core's
 * global locks that its threads hold for a moment (module.c, forked), or
 * gives them back: a fork() meanwhile leaves the child's copies held */
static int l_globals_lock(lua_State *L) {
  core_internals(L)->hold_globals(lua_toboolean(L, 1));
  lua_pushboolean(L, 1);
  return 1;
}

/* testing.counters_lock(client, hold) -> true: the mutex of the client's
 * counters and lease events */
static int l_counters_lock(lua_State *L) {
  ml_client *c = core_internals(L)->checkclient(L, 1);
  if (!c->obs) return luaL_error(L, "testing.counters_lock: the client has no counters");
  return hold_mutex(L, &c->obs->mu, lua_toboolean(L, 2));
}

static int l_exit(lua_State *L) {
  int st = (int)luaL_optinteger(L, 1, 0);
  fflush(NULL);
  _exit(st);
  return 0;
}

static char *mark_path;

static void mark_at_exit(void) {
  FILE *f = fopen(mark_path, "w");
  if (f) fclose(f);
}

static int l_exit_mark(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  if (mark_path) return luaL_error(L, "exit_mark: already set");
  mark_path = strdup(path);
  if (!mark_path || atexit(mark_at_exit) != 0) return luaL_error(L, "exit_mark: out of memory");
  lua_pushboolean(L, 1);
  return 1;
}

/* With timeout (seconds), a child still running then is killed (SIGKILL)
 * and reaped, so that a child stuck after fork fails its spec instead of
 * hanging the run. */
/* A child past its deadline is stuck (a lock its parent's thread held at
 * fork, README Limitations): where, said before it is killed.  gdb, where
 * installed, prints every thread (without a preloaded sanitizer, under
 * which gdb does not start); else SIGABRT, whose handler
 * (crash_trace, inherited from the specs' process) prints the thread that
 * takes it, the main one. */
static void hung_child_trace(pid_t p) {
  char cmd[160];
  fprintf(stderr, "mongolock.testing: child %ld past its deadline\n", (long)p);
  fflush(stderr);
  if (access("/usr/bin/gdb", X_OK) == 0) {
    snprintf(cmd, sizeof cmd, "env -u LD_PRELOAD gdb -p %ld -batch -ex 'thread apply all bt' 1>&2 2>/dev/null", (long)p);
    if (system(cmd) != 0) { /* nothing more to tell */ }
  }
  kill(p, SIGABRT);
  for (int i = 0; i < 300; i++) {       /* its handler writes, then it ends */
    siginfo_t si;
    si.si_pid = 0;
    /* WNOWAIT: left for the caller to reap */
    if (waitid(P_PID, (id_t)p, &si, WEXITED | WNOHANG | WNOWAIT) != 0 || si.si_pid == p) return;
    usleep(10000);
  }
}

static int l_waitpid(lua_State *L) {
  pid_t p = (pid_t)luaL_checkinteger(L, 1);
  double timeout = luaL_optnumber(L, 2, -1);
  double deadline = now() + timeout;
  int st = 0;
  pid_t r;
  for (;;) {
    r = waitpid(p, &st, timeout < 0 ? 0 : WNOHANG);
    if (r == p) break;
    if (r < 0 && errno != EINTR) {
      lua_pushnil(L);
      lua_pushstring(L, strerror(errno));
      return 2;
    }
    if (r == 0) {
      if (now() >= deadline) {
        hung_child_trace(p);
        kill(p, SIGKILL);
        while (waitpid(p, &st, 0) < 0 && errno == EINTR)
          ;
        lua_pushnil(L);
        lua_pushliteral(L, "timeout");
        return 2;
      }
      usleep(10000);
    }
  }
  lua_pushinteger(L, WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  return 1;
}

/* ---- the server -------------------------------------------------------- */

/* the connection of the client at 1 */
static mongoc_client_t *conn(lua_State *L) {
  const ml_internals *in = core_internals(L);
  return in->client_get(L, in->checkclient(L, 1));
}

/*
 * failpoint(client, spec): configures the failCommand fail point (mongod
 * started with enableTestCommands, or the stand-in).  spec = {mode =
 * "alwaysOn" | "off", times = n, commands = {...}, error_code = n,
 * write_concern_error = n (the write applies, then the reply carries a
 * writeConcernError with code n), close_connection = bool, app_name = s,
 * block_ms = n}.
 */
static int l_failpoint(lua_State *L) {
  mongoc_client_t *mc = conn(L);
  bson_t cmd = BSON_INITIALIZER, mode, data, names, reply;
  bson_error_t err;
  int ok, n;
  luaL_checktype(L, 2, LUA_TTABLE);
  BSON_APPEND_UTF8(&cmd, "configureFailPoint", "failCommand");
  lua_getfield(L, 2, "times");
  if (lua_isnumber(L, -1)) {
    BSON_APPEND_DOCUMENT_BEGIN(&cmd, "mode", &mode);
    BSON_APPEND_INT32(&mode, "times", (int32_t)lua_tointeger(L, -1));
    bson_append_document_end(&cmd, &mode);
  } else {
    lua_getfield(L, 2, "mode");
    BSON_APPEND_UTF8(&cmd, "mode", lua_isstring(L, -1) ? lua_tostring(L, -1) : "alwaysOn");
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  BSON_APPEND_DOCUMENT_BEGIN(&cmd, "data", &data);
  BSON_APPEND_ARRAY_BEGIN(&data, "failCommands", &names);
  lua_getfield(L, 2, "commands");
  for (n = 1; lua_istable(L, -1); n++) {
    char k[16];
    lua_rawgeti(L, -1, n);
    if (!lua_isstring(L, -1)) {
      lua_pop(L, 1);
      break;
    }
    bson_snprintf(k, sizeof k, "%d", n - 1);
    BSON_APPEND_UTF8(&names, k, lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  bson_append_array_end(&data, &names);
  lua_getfield(L, 2, "error_code");
  if (lua_isnumber(L, -1)) BSON_APPEND_INT32(&data, "errorCode", (int32_t)lua_tointeger(L, -1));
  lua_pop(L, 1);
  lua_getfield(L, 2, "write_concern_error");
  if (lua_isnumber(L, -1)) {
    bson_t wce;
    BSON_APPEND_DOCUMENT_BEGIN(&data, "writeConcernError", &wce);
    BSON_APPEND_INT32(&wce, "code", (int32_t)lua_tointeger(L, -1));
    BSON_APPEND_UTF8(&wce, "errmsg", "write concern error via failCommand");
    bson_append_document_end(&data, &wce);
  }
  lua_pop(L, 1);
  lua_getfield(L, 2, "close_connection");
  if (lua_toboolean(L, -1)) BSON_APPEND_BOOL(&data, "closeConnection", true);
  lua_pop(L, 1);
  lua_getfield(L, 2, "app_name");
  if (lua_isstring(L, -1)) BSON_APPEND_UTF8(&data, "appName", lua_tostring(L, -1));
  lua_pop(L, 1);
  lua_getfield(L, 2, "block_ms");
  if (lua_isnumber(L, -1)) {
    BSON_APPEND_BOOL(&data, "blockConnection", true);
    BSON_APPEND_INT32(&data, "blockTimeMS", (int32_t)lua_tointeger(L, -1));
  }
  lua_pop(L, 1);
  bson_append_document_end(&cmd, &data);
  ok = mongoc_client_command_simple(mc, "admin", &cmd, NULL, &reply, &err);
  bson_destroy(&cmd);
  bson_destroy(&reply);
  if (!ok) return push_error(L, &err);
  lua_pushboolean(L, 1);
  return 1;
}

/* delete(client, db, coll, name): deletes a lock document as a person or
 * the TTL monitor would (majority write concern) */
static int l_delete(lua_State *L) {
  mongoc_client_t *mc = conn(L);
  const char *db = luaL_checkstring(L, 2), *coll = luaL_checkstring(L, 3);
  const char *name = luaL_checkstring(L, 4);
  mongoc_collection_t *col = mongoc_client_get_collection(mc, db, coll);
  mongoc_write_concern_t *wc = mongoc_write_concern_new();
  bson_t q = BSON_INITIALIZER, opts = BSON_INITIALIZER, reply;
  bson_error_t err;
  bson_iter_t it;
  int64_t n = 0;
  int ok;
  BSON_APPEND_UTF8(&q, "_id", name);
  mongoc_write_concern_set_w(wc, MONGOC_WRITE_CONCERN_W_MAJORITY);
  mongoc_write_concern_append(wc, &opts);
  ok = mongoc_collection_delete_one(col, &q, &opts, &reply, &err);
  if (ok && bson_iter_init_find(&it, &reply, "deletedCount")) n = bson_iter_as_int64(&it);
  mongoc_write_concern_destroy(wc);
  mongoc_collection_destroy(col);
  bson_destroy(&q);
  bson_destroy(&opts);
  bson_destroy(&reply);
  if (!ok) return push_error(L, &err);
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

/* opcounters(client) -> {insert=, query=, update=, delete=, getmore=,
 * command=, commands = {name = total, ...}}: one serverStatus, for specs
 * and benchmarks that count round trips (commands: metrics.commands, each
 * command's total by name) */
static int l_opcounters(lua_State *L) {
  mongoc_client_t *mc = conn(L);
  bson_t cmd = BSON_INITIALIZER, reply;
  bson_error_t err;
  bson_iter_t it, sub;
  int ok;
  BSON_APPEND_INT32(&cmd, "serverStatus", 1);
  ok = mongoc_client_command_simple(mc, "admin", &cmd, NULL, &reply, &err);
  bson_destroy(&cmd);
  if (!ok) {
    bson_destroy(&reply);
    return push_error(L, &err);
  }
  lua_newtable(L);
  if (bson_iter_init_find(&it, &reply, "opcounters") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
      bson_iter_recurse(&it, &sub)) {
    while (bson_iter_next(&sub)) {
      if (BSON_ITER_HOLDS_NUMBER(&sub)) {
        lua_pushnumber(L, (lua_Number)bson_iter_as_int64(&sub));
        lua_setfield(L, -2, bson_iter_key(&sub));
      }
    }
  }
  lua_newtable(L);
  if (bson_iter_init_find(&it, &reply, "metrics") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
      bson_iter_recurse(&it, &sub) && bson_iter_find(&sub, "commands") &&
      BSON_ITER_HOLDS_DOCUMENT(&sub) && bson_iter_recurse(&sub, &it)) {
    while (bson_iter_next(&it)) {
      bson_iter_t total;
      if (BSON_ITER_HOLDS_DOCUMENT(&it) && bson_iter_recurse(&it, &total) &&
          bson_iter_find(&total, "total") && BSON_ITER_HOLDS_NUMBER(&total)) {
        lua_pushnumber(L, (lua_Number)bson_iter_as_int64(&total));
        lua_setfield(L, -2, bson_iter_key(&it));
      }
    }
  }
  lua_setfield(L, -2, "commands");
  bson_destroy(&reply);
  return 1;
}

/* ---- the core's threads ------------------------------------------------ */

static int l_renew_stats(lua_State *L) {
  const ml_internals *in = core_internals(L);
  ml_renew_counts n;
  in->renew_stats(in->checkclient(L, 1), &n);
  lua_createtable(L, 0, 6);
  lua_pushboolean(L, n.running);
  lua_setfield(L, -2, "running");
  if (n.running) {
    setint(L, "leases", n.leases);
    setint(L, "renewals", n.renewals);
    setint(L, "failures", n.failures);
    setint(L, "lost", n.lost);
    setint(L, "released", n.released);
    setint(L, "batches", n.batches);
    setint(L, "checks", n.checks);
  }
  return 1;
}

static int l_renew_flush(lua_State *L) {
  const ml_internals *in = core_internals(L);
  ml_client *c = in->checkclient(L, 1);
  lua_pushboolean(L, in->renew_flush(c, luaL_optnumber(L, 2, 10)));
  return 1;
}

static int l_watch_stats(lua_State *L) {
  const ml_internals *in = core_internals(L);
  ml_watch_counts n;
  in->watch_stats(in->checkclient(L, 1), &n);
  lua_createtable(L, 0, 10);
  setint(L, "streams", n.streams);
  setint(L, "threads", n.threads);
  setint(L, "opens", n.opens);
  setint(L, "answered", n.answered);
  setint(L, "handed", n.handed);
  setint(L, "granted", n.granted);
  setint(L, "events", n.events);
  setint(L, "reopens", n.reopens);
  setint(L, "getmores", n.getmores);
  setint(L, "failed", n.failed);
  return 1;
}

/* ---- crash_trace ------------------------------------------------------ */

static void crash_handler(int sig) {
  void *frames[64];
  char head[96];
  int n;
  /* the line first: the unwinder may fault on a stack it cannot read (a
   * trace's machine code, a corrupted frame), and the process then dies of
   * the default action with at least this said */
  int len = snprintf(head, sizeof head, "mongolock.testing: signal %d in pid %ld, thread %ld; backtrace:\n", sig,
                     (long)getpid(), (long)syscall(SYS_gettid));
  if (len > 0 && write(2, head, (size_t)len) < 0) { /* stderr is gone: nothing to tell */ }
  n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  raise(sig);                   /* SA_RESETHAND: the default action now */
}

/* The calling thread's alternate signal stack: a stack overflow (a fiber's
 * guard page, a deep recursion) leaves no room for the handler on the
 * stack that overflowed, and the process died without a word.  Other
 * threads have none: their crash on an overflowed stack stays silent. */
static char crash_stack[64 * 1024];

static int l_crash_trace(lua_State *L) {
  static const int sigs[] = { SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT };
  void *warm[1];
  size_t k;
  struct sigaction sa;
  stack_t alt;
  (void)backtrace(warm, 1);     /* loads libgcc now: the handler must not */
  memset(&alt, 0, sizeof alt);
  alt.ss_sp = crash_stack;
  alt.ss_size = sizeof crash_stack;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = crash_handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | (sigaltstack(&alt, NULL) == 0 ? SA_ONSTACK : 0);
  for (k = 0; k < sizeof sigs / sizeof sigs[0]; k++) sigaction(sigs[k], &sa, NULL);
  lua_pushboolean(L, 1);
  return 1;
}

static const luaL_Reg testing_funcs[] = {
  {"crash_trace", l_crash_trace},
  {"fork", l_fork},
  {"driver_lock", l_driver_lock},
  {"lease_lock", l_lease_lock},
  {"globals_lock", l_globals_lock},
  {"counters_lock", l_counters_lock},
  {"exit", l_exit},
  {"exit_mark", l_exit_mark},
  {"waitpid", l_waitpid},
  {"failpoint", l_failpoint},
  {"delete", l_delete},
  {"opcounters", l_opcounters},
  {"renew_stats", l_renew_stats},
  {"renew_flush", l_renew_flush},
  {"watch_stats", l_watch_stats},
  {NULL, NULL}
};

__attribute__((visibility("default")))
int luaopen_mongolock_testing(lua_State *L);

int luaopen_mongolock_testing(lua_State *L) {
  /* the core first: it leaves its internals in the registry */
  lua_getglobal(L, "require");
  lua_pushliteral(L, "mongolock.core");
  lua_call(L, 1, 0);
  (void)core_internals(L);
  luaL_newlib(L, testing_funcs);
  return 1;
}
