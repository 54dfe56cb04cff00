/*
 * raw: the ceiling for mongolock's uncontended cycle.  The library's two
 * commands (doc/design.md: acquire = one findAndModify with the update
 * pipeline, release = one update, sent as a retryable write with
 * mongoc_collection_update_one), built by the library's csrc/model/protocol.c and
 * run by its csrc/driver/transport.c (both compiled into this program), with
 * nothing else around them: no Lua, no argument checks, no lease table.
 *
 *   raw URI [SECONDS [WARMUP]]
 *
 * Prints one JSON line:
 *   {"impl":"raw","cycles":N,"seconds":S,"cpu":S,"ops":N,"failed":N}
 * cpu is user + sys of this process (getrusage, every thread: the pool's
 * monitor included, as in the library); ops is the serverStatus opcounters
 * delta over the measured cycles (the closing serverStatus itself removed).
 */
#include "protocol.h"
#include "transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/random.h>
#include <sys/resource.h>

#define TTL_MS 30000

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu_s(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
         (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

/* 32 hex digits from 16 random bytes, as the library's owner id */
static void new_owner(char out[33]) {
  static const char hex[] = "0123456789abcdef";
  unsigned char b[16];
  size_t i;
  if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
    for (i = 0; i < sizeof b; i++) b[i] = (unsigned char)rand();
  }
  for (i = 0; i < 16; i++) {
    out[2 * i] = hex[b[i] >> 4];
    out[2 * i + 1] = hex[b[i] & 15];
  }
  out[32] = '\0';
}

/* sum of serverStatus opcounters, or -1 */
static int64_t opcounters(mongoc_client_t *c) {
  bson_t cmd = BSON_INITIALIZER, reply;
  bson_iter_t it, sub;
  bson_error_t err;
  int64_t total = -1;
  BSON_APPEND_INT32(&cmd, "serverStatus", 1);
  if (mongoc_client_command_simple(c, "admin", &cmd, NULL, &reply, &err) &&
      bson_iter_init_find(&it, &reply, "opcounters") && bson_iter_recurse(&it, &sub)) {
    total = 0;
    while (bson_iter_next(&sub))
      if (BSON_ITER_HOLDS_NUMBER(&sub)) total += bson_iter_as_int64(&sub);
  } else if (err.code) {
    fprintf(stderr, "raw: serverStatus: %s\n", err.message);
  }
  bson_destroy(&reply);
  bson_destroy(&cmd);
  return total;
}

/*
 * One acquire + release, built by the library's protocol.c and run by its
 * transport.c: the acquire is a try's (no waiter: it takes the lock only
 * when it is free and no live watching waiter is queued), the release
 * hands the lock to the queue's first live watching waiter, a retryable
 * update_one.  0 on success.
 */
static int cycle(mongoc_client_t *c, mongoc_write_concern_t *wc, const ml_lockref *r,
                 const char *name, const char *host, int64_t pid) {
  char owner[33];
  ml_acquire_args a;
  ml_acquire_reply ar;
  ml_op op;
  bson_t reply;
  bson_error_t err;
  int ok;
  new_owner(owner);
  memset(&a, 0, sizeof a);
  a.db = r->db;
  a.coll = r->coll;
  a.name = name;
  a.owner = owner;
  a.ttl_ms = TTL_MS;
  a.host = host;
  a.pid = pid;
  ml_build_acquire(&op, &a);
  ok = ml_run(c, wc, &op, &reply, &err) &&
       ml_parse_acquire(&reply, owner, ML_F_OWNER, ML_OWNER_HEX, 0, &ar) > 0 && ar.won;
  if (!ok && err.code) fprintf(stderr, "raw: findAndModify: %s\n", err.message);
  ml_op_destroy(&op);
  bson_destroy(&reply);
  if (!ok) return -1;
  ml_build_release(&op, r, owner, NULL);
  ok = ml_run(c, wc, &op, &reply, &err) && ml_parse_matched(&reply) == 1;
  if (!ok && err.code) fprintf(stderr, "raw: update: %s\n", err.message);
  ml_op_destroy(&op);
  bson_destroy(&reply);
  return ok ? 0 : -1;
}

int main(int argc, char **argv) {
  const char *uri_s = argc > 1 ? argv[1] : getenv("MONGODB_URI");
  double seconds = argc > 2 ? atof(argv[2]) : 5.0;
  long warmup = argc > 3 ? atol(argv[3]) : 200;
  mongoc_uri_t *uri;
  mongoc_client_pool_t *pool;
  mongoc_client_t *c;
  mongoc_write_concern_t *wc;
  bson_t id;
  ml_lockref ref;
  bson_error_t err;
  char host[256], name[64];
  const char *db = "mongolock_bench", *coll = "locks";
  int64_t pid = (int64_t)getpid(), ops0, ops1;
  long i, n = 0, failed = 0;
  double t0, t1, c0, c1;

  if (!uri_s || seconds <= 0) {
    fprintf(stderr, "usage: raw URI [SECONDS [WARMUP]]\n");
    return 2;
  }
  mongoc_init();
  uri = mongoc_uri_new_with_error(uri_s, &err);
  if (!uri) {
    fprintf(stderr, "raw: %s\n", err.message);
    return 2;
  }
  mongoc_uri_set_option_as_utf8(uri, MONGOC_URI_APPNAME, "bench-raw");
  pool = mongoc_client_pool_new(uri);
  mongoc_client_pool_set_error_api(pool, MONGOC_ERROR_API_VERSION_2);
  c = mongoc_client_pool_pop(pool);
  wc = mongoc_write_concern_new();
  mongoc_write_concern_set_wmajority(wc, 0);
  if (gethostname(host, sizeof host) != 0) strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  snprintf(name, sizeof name, "bench-raw-%ld", (long)pid);
  bson_init(&id);
  BSON_APPEND_UTF8(&id, "_id", name);
  ml_named_ref(&ref, db, coll, &id);   /* the library's lock document */

  for (i = 0; i < warmup; i++)
    if (cycle(c, wc, &ref, name, host, pid) != 0) failed++;

  ops0 = opcounters(c);
  c0 = cpu_s();
  t0 = now_s();
  do {
    for (i = 0; i < 64; i++) {
      if (cycle(c, wc, &ref, name, host, pid) != 0) failed++;
      n++;
    }
    t1 = now_s();
  } while (t1 - t0 < seconds);
  c1 = cpu_s();
  ops1 = opcounters(c);

  printf("{\"impl\":\"raw\",\"cycles\":%ld,\"seconds\":%.6f,\"cpu\":%.6f,\"ops\":%lld,\"failed\":%ld}\n",
         n, t1 - t0, c1 - c0, (ops0 < 0 || ops1 < 0) ? -1LL : (long long)(ops1 - ops0 - 1), failed);

  bson_destroy(&id);
  mongoc_write_concern_destroy(wc);
  mongoc_client_pool_push(pool, c);
  mongoc_client_pool_destroy(pool);
  mongoc_uri_destroy(uri);
  mongoc_cleanup();
  return failed ? 1 : 0;
}
