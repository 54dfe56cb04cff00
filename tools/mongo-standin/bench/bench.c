/* bench URI SECONDS THREADS: round trips per second of `ping` and of the
 * lock-style findAndModify of doc/design.md (update pipeline with a $cond on
 * $$NOW over every field, upsert, new, fields with remainingMs), from
 * THREADS clients at once (1: a single mongoc_client_t; more: one pooled
 * client per thread). The lease is 0 ms, so every acquire takes the lock
 * over and writes: the engine's slowest path for this command.
 * Prints "ping N" and "findAndModify N" (operations per second). */
#include <mongoc/mongoc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef struct {
  mongoc_client_pool_t *pool;
  mongoc_client_t *single;
  int id;
  int fam; /* 0: ping, 1: findAndModify */
  double seconds;
  long ops;
  int failed;
} job_t;

static bson_t *acquire_cmd(const char *name, const char *owner) {
  /* FREE = {$or: [{$eq: [{$ifNull: ["$owner", null]}, null]}, {$lte: ["$expiresAt", "$$NOW"]}]} */
#define FREE "{", "$or", "[", "{", "$eq", "[", "{", "$ifNull", "[", BCON_UTF8("$owner"), BCON_NULL, "]", "}", BCON_NULL, "]", "}", \
                           "{", "$lte", "[", BCON_UTF8("$expiresAt"), BCON_UTF8("$$NOW"), "]", "}", "]", "}"
  return BCON_NEW(
    "findAndModify", BCON_UTF8("benchlocks"), "query", "{", "_id", BCON_UTF8(name), "}",
    "upsert", BCON_BOOL(true), "new", BCON_BOOL(true),
    "update", "[", "{", "$set", "{",
      "owner", "{", "$cond", "[", FREE, BCON_UTF8(owner), BCON_UTF8("$owner"), "]", "}",
      "token", "{", "$cond", "[", FREE,
          "{", "$max", "[", "{", "$add", "[", "{", "$ifNull", "[", BCON_UTF8("$token"), BCON_INT64(0), "]", "}", BCON_INT64(1), "]", "}",
                            "{", "$multiply", "[", "{", "$toLong", BCON_UTF8("$$NOW"), "}", BCON_INT64(1024), "]", "}", "]", "}",
          BCON_UTF8("$token"), "]", "}",
      "acquiredAt", "{", "$cond", "[", FREE, BCON_UTF8("$$NOW"), BCON_UTF8("$acquiredAt"), "]", "}",
      "expiresAt", "{", "$cond", "[", FREE, "{", "$add", "[", BCON_UTF8("$$NOW"), BCON_INT64(0), "]", "}", BCON_UTF8("$expiresAt"), "]", "}",
      "holder", "{", "$cond", "[", FREE, "{", "$literal", "{", "host", BCON_UTF8("bench"), "pid", BCON_INT32(1), "app", BCON_UTF8("bench"), "}", "}",
          BCON_UTF8("$holder"), "]", "}",
    "}", "}", "]",
    "fields", "{", "owner", BCON_INT32(1), "token", BCON_INT32(1), "expiresAt", BCON_INT32(1), "holder", BCON_INT32(1),
      "acquiredAt", BCON_INT32(1), "remainingMs", "{", "$subtract", "[", BCON_UTF8("$expiresAt"), BCON_UTF8("$$NOW"), "]", "}", "}",
    "writeConcern", "{", "w", BCON_UTF8("majority"), "}");
#undef FREE
}

static void *worker(void *arg) {
  job_t *j = arg;
  mongoc_client_t *client = j->single ? j->single : mongoc_client_pool_pop(j->pool);
  char name[32], owner[40];
  snprintf(name, sizeof name, "lock-%d", j->id);
  snprintf(owner, sizeof owner, "%032x", (unsigned)(j->id + 1));
  bson_t *cmd = j->fam ? acquire_cmd(name, owner) : BCON_NEW("ping", BCON_INT32(1));
  const char *db = j->fam ? "bench" : "admin";
  bson_error_t err;
  bson_t reply;
  /* warm-up, then the timed loop */
  for (int i = 0; i < 200; i++) {
    if (!mongoc_client_command_simple(client, db, cmd, NULL, &reply, &err)) {
      fprintf(stderr, "bench: %s\n", err.message);
      j->failed = 1;
    }
    bson_destroy(&reply);
  }
  double end = now_s() + j->seconds;
  long ops = 0;
  while (!j->failed) {
    for (int i = 0; i < 100; i++) {
      if (!mongoc_client_command_simple(client, db, cmd, NULL, &reply, &err)) {
        fprintf(stderr, "bench: %s\n", err.message);
        j->failed = 1;
      }
      bson_destroy(&reply);
    }
    ops += 100;
    if (now_s() >= end) break;
  }
  j->ops = ops;
  bson_destroy(cmd);
  if (!j->single) mongoc_client_pool_push(j->pool, client);
  return NULL;
}

static double measure(mongoc_uri_t *uri, int threads, int fam, double seconds, int *failed) {
  job_t jobs[64];
  pthread_t tids[64];
  mongoc_client_pool_t *pool = NULL;
  mongoc_client_t *single = NULL;
  if (threads == 1) single = mongoc_client_new_from_uri(uri);
  else {
    pool = mongoc_client_pool_new(uri);
    mongoc_client_pool_max_size(pool, (uint32_t)threads);
  }
  double t0 = now_s();
  for (int i = 0; i < threads; i++) {
    jobs[i] = (job_t){ .pool = pool, .single = single, .id = i, .fam = fam, .seconds = seconds };
    pthread_create(&tids[i], NULL, worker, &jobs[i]);
  }
  long total = 0;
  for (int i = 0; i < threads; i++) {
    pthread_join(tids[i], NULL);
    total += jobs[i].ops;
    *failed |= jobs[i].failed;
  }
  double elapsed = now_s() - t0 - 0.0;
  (void)elapsed;
  if (single) mongoc_client_destroy(single);
  if (pool) mongoc_client_pool_destroy(pool);
  return (double)total / seconds;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s URI SECONDS THREADS\n", argv[0]);
    return 2;
  }
  double seconds = atof(argv[2]);
  int threads = atoi(argv[3]);
  if (seconds <= 0 || threads < 1 || threads > 64) {
    fprintf(stderr, "bench: SECONDS > 0 and 1 <= THREADS <= 64\n");
    return 2;
  }
  mongoc_init();
  mongoc_uri_t *uri = mongoc_uri_new(argv[1]);
  if (!uri) {
    fprintf(stderr, "bench: bad URI\n");
    return 2;
  }
  int failed = 0;
  double ping = measure(uri, threads, 0, seconds, &failed);
  double fam = measure(uri, threads, 1, seconds, &failed);
  printf("ping %.0f\nfindAndModify %.0f\n", ping, fam);
  mongoc_uri_destroy(uri);
  mongoc_cleanup();
  return failed ? 1 : 0;
}
