/*
 * Internal to mongolock: programs use require "mongolock", not this module
 * (nor mongolock.core through it), which may change without notice.
 *
 * luaopen_mongolock_core: the module table, the local monotonic clock
 * (lease.c's ml_monotonic), sleeping, and random owner ids; it opens each
 * part (its metatables, its core.* functions) and adds the Client methods
 * each file exports.
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include "lease.h"
#include "sys.h"
#include "bson_lua.h"
#include "client.h"
#include "lock.h"
#include "named.h"
#include "documents.h"
#include "shared.h"
#include "ops.h"
#include "command.h"
#include "stats.h"
#include "renew.h"
#include "watch.h"
#include "pool.h"
#include "attempt.h"
#include "views.h"
#include "module.h"
#include "fiber.h"
#include "fiber_stream.h"
#include "transport.h"

/* core.monotonic() -> seconds (a local, monotonic clock; not wall time) */
static int l_monotonic(lua_State *L) {
  lua_pushnumber(L, ml_monotonic());
  return 1;
}

/* core.sleep(seconds): blocks the calling thread; negative or 0 returns */
static int l_sleep(lua_State *L) {
  double s = luaL_checknumber(L, 1);
  luaL_argcheck(L, s == s, 1, "not a number");
  ml_sleep(s);
  return 0;
}

/* [-0, +1|2] hex (when ok) or nil, the getrandom error */
static int push_random_hex(lua_State *L, int ok, const char *hex) {
  if (!ok) {
    lua_pushnil(L);
    lua_pushfstring(L, "getrandom: %s", strerror(errno));
    return 2;
  }
  lua_pushstring(L, hex);
  return 1;
}

/* core.random_owner() -> 32 hex digits, or nil, message */
static int l_random_owner(lua_State *L) {
  char id[33];
  int ok = ml_random_owner(id);
  return push_random_hex(L, ok, id);
}

/* core.process_tag() -> 16 hex digits, or nil, message: this process's
 * tag (a queued waiter's entry carries it; a release handed to one of its
 * waiters sets next to it and the waiter's id) */
static int l_process_tag(lua_State *L) {
  char tag[17];
  int ok = ml_process_tag(tag);
  return push_random_hex(L, ok, tag);
}

/*
 * core.random() -> a float in [0, 1) for jitter: xorshift64* per thread,
 * seeded from getrandom (and re-seeded after fork, so that processes forked
 * from one parent do not back off in step).  Not for secrets.
 */
static __thread uint64_t rng_state;
static __thread pid_t rng_pid;

static int l_random(lua_State *L) {
  uint64_t x;
  /* ml_pid: this process's id, kept (taken again at fork), no system call */
  if (rng_state == 0 || rng_pid != ml_pid()) {
    if (getrandom(&rng_state, sizeof rng_state, 0) != (ssize_t)sizeof rng_state)
      rng_state = (uint64_t)ml_monotonic() * 2654435761u ^ (uint64_t)ml_pid();
    if (rng_state == 0) rng_state = 88172645463325252ull;
    rng_pid = ml_pid();
  }
  x = rng_state;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  rng_state = x;
  lua_pushnumber(L, (lua_Number)((x * 2685821657736338717ull) >> 11) / 9007199254740992.0);
  return 1;
}

/* core.utf8_valid(s) -> true when s is valid UTF-8 without NUL bytes */
static int l_utf8_valid(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  lua_pushboolean(L, bson_utf8_validate(s, len, false));
  return 1;
}

/* core.getpid() -> this process's id */
static int l_getpid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)ml_pid());
  return 1;
}

/* core.hostname() -> the host name (holder.host in lock documents) */
static int l_hostname(lua_State *L) {
  char h[256];
  ml_hostname(h);
  lua_pushstring(L, h);
  return 1;
}

/* core.resolve(host) -> host's first address as text | nil, message:
 * getaddrinfo, which blocks (inside nginx a worker thread runs it, and
 * the cosockets connect to the address: mongolock.ngx) */
static int l_resolve(lua_State *L) {
  const char *host = luaL_checkstring(L, 1);
  struct addrinfo hints, *res = NULL, *ai;
  char buf[INET6_ADDRSTRLEN];
  const void *a;
  int e;
  memset(&hints, 0, sizeof hints);
  hints.ai_socktype = SOCK_STREAM;
  if ((e = getaddrinfo(host, NULL, &hints, &res)) != 0 || !res) {
    lua_pushnil(L);
    lua_pushfstring(L, "cannot resolve '%s': %s", host, e ? gai_strerror(e) : "no address");
    return 2;
  }
  for (ai = res; ai && ai->ai_family != AF_INET; ai = ai->ai_next) {}
  if (!ai) ai = res;            /* an IPv4 address first, as servers mostly listen there */
  if (ai->ai_family == AF_INET6) a = &((const struct sockaddr_in6 *)(const void *)ai->ai_addr)->sin6_addr;
  else a = &((const struct sockaddr_in *)(const void *)ai->ai_addr)->sin_addr;
  if (!inet_ntop(ai->ai_family, a, buf, sizeof buf)) buf[0] = '\0';
  freeaddrinfo(res);
  lua_pushstring(L, buf);
  return 1;
}

static const luaL_Reg core_funcs[] = {
  {"monotonic", l_monotonic},
  {"sleep", l_sleep},
  {"random_owner", l_random_owner},
  {"waiter_id", l_random_owner},   /* a queued acquire's id: its owner id */
  {"process_tag", l_process_tag},
  {"random", l_random},
  {"utf8_valid", l_utf8_valid},
  {"getpid", l_getpid},
  {"hostname", l_hostname},
  {"resolve", l_resolve},
  {NULL, NULL}
};

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* the global locks that a thread takes for a moment (the process tag's,
 * the kept fiber stacks', the bridged connections' and the cursor
 * sessions' lists): made anew in a forked child, where a thread of the
 * parent's may have held one at the fork and is not there to give it
 * back.  (The pool's, the streams' and the renewal's are held across the
 * fork by their own handlers; a lease's is never taken in a child:
 * ml_lease_lock.) */
static pthread_mutex_t *const globals[] = { &ml_tag_mu, &ml_kept_mu, &ml_bridge_mu, &ml_sessions_mu };
#define NGLOBALS (sizeof globals / sizeof globals[0])

static void forked(void) {
  size_t i;
  for (i = 0; i < NGLOBALS; i++) pthread_mutex_init(globals[i], NULL);
  ml_fiber_forked();
  ml_bridge_forked();
  ml_sessions_forked();
}

/* mongolock.testing: takes those locks (1) or gives them back (0) */
static void hold_globals(int hold) {
  size_t i;
  for (i = 0; i < NGLOBALS; i++) (hold ? pthread_mutex_lock : pthread_mutex_unlock)(globals[i]);
}

/* for mongolock.testing (module.h) */
static const ml_internals internals = {
  ml_checkclient, ml_client_get, ml_renew_stats, ml_renew_flush, ml_watch_stats, hold_globals
};

/* libmongoc's log goes to stderr only when MONGOLOCK_LOG is set (to a
 * level: error, warning, message, info, debug); failures reach the caller
 * as nil, message, code instead */
static mongoc_log_level_t log_max = MONGOC_LOG_LEVEL_ERROR;
static int log_on = 0;

static void log_handler(mongoc_log_level_t level, const char *domain, const char *message,
                        void *ud) {
  (void)ud;
  if (log_on && level <= log_max) fprintf(stderr, "mongolock: %s: %s\n", domain, message);
}

/* Removes /dev/shm/mongoc-PID names whose process no longer exists
 * (kill(pid, 0) fails with ESRCH; a live process of another user answers
 * EPERM and keeps its name). */
static void sweep_counters(void) {
  DIR *d = opendir("/dev/shm");
  struct dirent *e;
  if (!d) return;
  while ((e = readdir(d)) != NULL) {
    char *end;
    unsigned long pid;
    if (strncmp(e->d_name, "mongoc-", 7) != 0) continue;
    errno = 0;
    pid = strtoul(e->d_name + 7, &end, 10);
    if (e->d_name[7] < '1' || e->d_name[7] > '9' || errno || *end ||
        pid > INT_MAX)
      continue;
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH) {
      char shm[32];
      snprintf(shm, sizeof shm, "/mongoc-%lu", pid);
      shm_unlink(shm);
    }
  }
  closedir(d);
}

static void init_mongoc(void) {
  const char *lv = getenv("MONGOLOCK_LOG");
  if (lv && *lv) {
    log_on = 1;
    if (!strcmp(lv, "warning")) log_max = MONGOC_LOG_LEVEL_WARNING;
    else if (!strcmp(lv, "message")) log_max = MONGOC_LOG_LEVEL_MESSAGE;
    else if (!strcmp(lv, "info")) log_max = MONGOC_LOG_LEVEL_INFO;
    else if (!strcmp(lv, "debug")) log_max = MONGOC_LOG_LEVEL_DEBUG;
  }
  mongoc_log_set_handler(log_handler, NULL);
  pthread_atfork(NULL, NULL, forked);
  /* never paired with mongoc_cleanup: other Lua states in this process
   * (nginx workers' VMs, threads) may still use the driver */
  mongoc_init();
  /* libmongoc keeps its statistics counters in a shared-memory segment
   * named after the pid (/dev/shm/mongoc-PID), created when the library
   * is loaded and removed at a normal exit only.  A process killed
   * (SIGKILL, a crash) leaves the name behind, and a later process given
   * the same pid finds it taken and prints "Falling back to malloc for
   * counters" on stderr, before any log handler of ours exists.  So:
   * remove our own name now (the mapping stays valid, and nothing is left
   * behind whatever the exit), and remove the names of dead processes
   * that others left, so that the next process given their pid starts
   * quietly. */
  {
    char shm[32];
    snprintf(shm, sizeof shm, "/mongoc-%u", (unsigned)getpid());
    shm_unlink(shm);
    sweep_counters();
  }
}

__attribute__((visibility("default")))
int luaopen_mongolock_core(lua_State *L);

int luaopen_mongolock_core(lua_State *L) {
  pthread_once(&init_once, init_mongoc);
  ml_renew_init();
  luaL_newlib(L, core_funcs);
  lua_pushliteral(L, "0.1.0");
  lua_setfield(L, -2, "_VERSION");
  ml_client_open(L);
  ml_client_methods(L, ml_named_methods);
  ml_client_methods(L, ml_documents_methods);
  ml_client_methods(L, ml_shared_methods);
  ml_client_methods(L, ml_lock_client_methods);
  ml_client_methods(L, ml_stats_methods);
  ml_client_methods(L, ml_renew_methods);
  ml_client_methods(L, ml_watch_methods);
  ml_client_methods(L, ml_command_methods);
  ml_client_methods(L, ml_ops_methods);
  ml_lock_open(L);
  ml_attempt_open(L);
  ml_watch_open(L);
  ml_pool_open(L);
  ml_bson_open(L);
  ml_ops_open(L);
  ml_command_open(L);
  ml_views_open(L);
  ml_stats_open(L);
  lua_pushlightuserdata(L, (void *)&internals);
  lua_setfield(L, LUA_REGISTRYINDEX, ML_INTERNALS_KEY);
  return 1;
}
