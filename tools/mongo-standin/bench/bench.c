/* bench URI SECONDS THREADS: round trips per second of `ping` and of the
 * lock-style findAndModify of doc/design.md (update pipeline with a $cond on
 * $$NOW over every field, upsert, new, fields with remainingMs), from
 * THREADS clients at once (1: a single mongoc_client_t; more: one pooled
 * client per thread). The lease is 0 ms, so every acquire takes the lock
 * over and writes: the engine's slowest path for this command. Each
 * acquisition carries a fresh owner id, as the library's do, so the command
 * bytes differ every time.
 * Prints "ping N", "findAndModify N" (medians of operations per second over
 * alternating 0.25 s slices) and "ratio R" (median of the per-slice ratios). */
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
  for (int i = 0; i < 20; i++) {
    if (!mongoc_client_command_simple(client, db, cmd, NULL, &reply, &err)) {
      fprintf(stderr, "bench: %s\n", err.message);
      j->failed = 1;
    }
    bson_destroy(&reply);
  }
  double end = now_s() + j->seconds;
  long ops = 0;
  /* Every acquisition carries a fresh owner id, as in the library: the
   * 32 hex digits are rewritten in place in the encoded command, so the
   * client spends no time re-encoding and the server sees new bytes. */
  uint8_t *owner_at = NULL;
  if (j->fam) {
    const uint8_t *data = bson_get_data(cmd);
    for (uint32_t k = 0; k + 32 <= cmd->len; k++) {
      if (memcmp(data + k, owner, 32) == 0) {
        owner_at = (uint8_t *)data + k;
        break;
      }
    }
  }
  unsigned long seq = 0;
  while (!j->failed) {
    for (int i = 0; i < 100; i++) {
      if (owner_at) {
        char fresh[40];
        snprintf(fresh, sizeof fresh, "%08x%024lx", (unsigned)(j->id + 1), ++seq);
        memcpy(owner_at, fresh, 32);
      }
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

/* One slice: every thread runs `fam` for `seconds`; returns ops/s. */
static double slice(mongoc_client_pool_t *pool, mongoc_client_t *single, int threads, int fam, double seconds, int *failed) {
  job_t jobs[64];
  pthread_t tids[64];
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
  return (double)total / seconds;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
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
  /* The machine is shared: alternate short ping and findAndModify slices so
   * that load changes hit both alike, and report medians over the slices. */
  int failed = 0;
  int rounds = (int)(seconds / 0.5);
  if (rounds < 3) rounds = 3;
  if (rounds > 200) rounds = 200;
  double pings[200], fams[200], ratios[200];
  mongoc_client_pool_t *pool = NULL;
  mongoc_client_t *single = NULL;
  if (threads == 1) single = mongoc_client_new_from_uri(uri);
  else {
    pool = mongoc_client_pool_new(uri);
    mongoc_client_pool_max_size(pool, (uint32_t)threads);
  }
  for (int r = 0; r < rounds && !failed; r++) {
    pings[r] = slice(pool, single, threads, 0, 0.25, &failed);
    fams[r] = slice(pool, single, threads, 1, 0.25, &failed);
    ratios[r] = fams[r] / pings[r];
  }
  printf("ping %.0f\nfindAndModify %.0f\nratio %.3f\n", median(pings, rounds), median(fams, rounds), median(ratios, rounds));
  if (single) mongoc_client_destroy(single);
  if (pool) mongoc_client_pool_destroy(pool);
  mongoc_uri_destroy(uri);
  mongoc_cleanup();
  return failed ? 1 : 0;
}
