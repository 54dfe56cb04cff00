/*
 * raw: the ceiling for mongolock's uncontended cycle.  The same two commands
 * the library sends (doc/design.md: acquire = one findAndModify with the
 * update pipeline, release = one update, sent as a retryable write with
 * mongoc_collection_update_one), built and sent from C on libmongoc
 * with nothing else around them: no Lua, no argument checks, no lease table.
 *
 *   raw URI [SECONDS [WARMUP]]
 *
 * Prints one JSON line:
 *   {"impl":"raw","cycles":N,"seconds":S,"cpu":S,"ops":N,"failed":N}
 * cpu is user + sys of this process (getrusage, every thread: the pool's
 * monitor included, as in the library); ops is the serverStatus opcounters
 * delta over the measured cycles (the closing serverStatus itself removed).
 */
#include <mongoc/mongoc.h>

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

/*
 * The parts of both commands that do not change between cycles are built
 * once (the library builds them every time): what is left per cycle is the
 * least any client of these two commands must do.  The acquire is a try's
 * (doc/design.md: no waiter, so it takes the lock only when it is free and
 * nobody is queued); the release hands the lock to the queue's first live
 * waiter, as the library's does.
 */
#define LIVE_QUEUE \
  "{\"$filter\": {\"input\": {\"$cond\": [{\"$isArray\": \"$queue\"}, \"$queue\", []]}," \
  " \"cond\": {\"$gt\": [\"$$this.until\", \"$$NOW\"]}}}"

static bson_t *STAGE0, *STAGE1, *SET_REST, *STAGE3, *FIELDS, *RELEASE_U, *WC_OPTS, *UPDATE_OPTS;

static bson_t *json(const char *text) {
  bson_error_t err;
  bson_t *b = bson_new_from_json((const uint8_t *)text, -1, &err);
  if (!b) {
    fprintf(stderr, "raw: bad JSON (%s): %s\n", err.message, text);
    exit(2);
  }
  return b;
}

static void build_static(int64_t ttl_ms) {
  char buf[2048];
  STAGE0 = json("{\"$set\": {\"_mlq\": " LIVE_QUEUE "}}");
  STAGE1 = json("{\"$set\": {\"_mlt\": {\"$and\": ["
                "{\"$or\": [{\"$eq\": [{\"$ifNull\": [\"$owner\", null]}, null]},"
                "           {\"$lte\": [\"$expiresAt\", \"$$NOW\"]}]},"
                "{\"$or\": [{\"$eq\": [{\"$size\": \"$_mlq\"}, 0]},"
                "           {\"$eq\": [{\"$arrayElemAt\": [\"$_mlq.w\", 0]}, \"\"]}]}]}}}");
  snprintf(buf, sizeof buf,
      "{\"token\": {\"$cond\": [\"$_mlt\", {\"$max\": ["
      "     {\"$add\": [{\"$ifNull\": [\"$token\", {\"$numberLong\": \"0\"}]}, {\"$numberLong\": \"1\"}]},"
      "     {\"$multiply\": [{\"$toLong\": \"$$NOW\"}, {\"$numberLong\": \"1024\"}]}]}, \"$token\"]},"
      " \"acquiredAt\": {\"$cond\": [\"$_mlt\", \"$$NOW\", \"$acquiredAt\"]},"
      " \"expiresAt\": {\"$cond\": [\"$_mlt\", {\"$add\": [\"$$NOW\", {\"$numberLong\": \"%lld\"}]},"
      "                \"$expiresAt\"]}}", (long long)ttl_ms);
  SET_REST = json(buf);
  STAGE3 = json("{\"$unset\": [\"_mlq\", \"_mlt\"]}");
  FIELDS = json("{\"owner\": 1, \"token\": 1, \"expiresAt\": 1, \"holder\": 1, \"acquiredAt\": 1,"
                " \"remainingMs\": {\"$subtract\": [\"$expiresAt\", \"$$NOW\"]},"
                " \"queued\": {\"$size\": {\"$cond\": [{\"$isArray\": \"$queue\"}, \"$queue\", []]}},"
                " \"position\": {\"$indexOfArray\": [{\"$cond\": [{\"$isArray\": \"$queue\"},"
                "     \"$queue.w\", []]}, \"\"]}}");
  RELEASE_U = json("{\"0\": {\"$set\": {\"owner\": null, \"expiresAt\": \"$$NOW\","
                   " \"next\": {\"$ifNull\": [{\"$arrayElemAt\": [{\"$map\": {\"input\": " LIVE_QUEUE ","
                   " \"in\": \"$$this.w\"}}, 0]}, null]}}}}");
}

/* appends every field of src to dst */
static void append_all(bson_t *dst, const bson_t *src) {
  bson_iter_t it;
  if (bson_iter_init(&it, src))
    while (bson_iter_next(&it)) bson_append_iter(dst, bson_iter_key(&it), -1, &it);
}

/* the try of doc/design.md into cmd (initialised by the caller) */
static void acquire_cmd(bson_t *cmd, const char *coll, const char *name, const char *owner,
                        const bson_t *holder) {
  bson_t q, u, stage, set, d, arr, lit;
  BSON_APPEND_UTF8(cmd, "findAndModify", coll);
  BSON_APPEND_DOCUMENT_BEGIN(cmd, "query", &q);
  BSON_APPEND_UTF8(&q, "_id", name);
  bson_append_document_end(cmd, &q);
  BSON_APPEND_BOOL(cmd, "upsert", true);
  BSON_APPEND_BOOL(cmd, "new", true);
  BSON_APPEND_ARRAY_BEGIN(cmd, "update", &u);
  BSON_APPEND_DOCUMENT(&u, "0", STAGE0);
  BSON_APPEND_DOCUMENT(&u, "1", STAGE1);
  BSON_APPEND_DOCUMENT_BEGIN(&u, "2", &stage);
  BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
  BSON_APPEND_DOCUMENT_BEGIN(&set, "owner", &d);
  BSON_APPEND_ARRAY_BEGIN(&d, "$cond", &arr);
  BSON_APPEND_UTF8(&arr, "0", "$_mlt");
  BSON_APPEND_UTF8(&arr, "1", owner);
  BSON_APPEND_UTF8(&arr, "2", "$owner");
  bson_append_array_end(&d, &arr);
  bson_append_document_end(&set, &d);
  append_all(&set, SET_REST);
  BSON_APPEND_DOCUMENT_BEGIN(&set, "holder", &d);
  BSON_APPEND_ARRAY_BEGIN(&d, "$cond", &arr);
  BSON_APPEND_UTF8(&arr, "0", "$_mlt");
  BSON_APPEND_DOCUMENT_BEGIN(&arr, "1", &lit);
  BSON_APPEND_DOCUMENT(&lit, "$literal", holder);
  bson_append_document_end(&arr, &lit);
  BSON_APPEND_UTF8(&arr, "2", "$holder");
  bson_append_array_end(&d, &arr);
  bson_append_document_end(&set, &d);
  {
    bson_t qd, qa, nd, na;
    BSON_APPEND_DOCUMENT_BEGIN(&set, "queue", &qd);
    BSON_APPEND_ARRAY_BEGIN(&qd, "$cond", &qa);
    BSON_APPEND_UTF8(&qa, "0", "$_mlt");
    BSON_APPEND_UTF8(&qa, "1", "$_mlq");
    BSON_APPEND_UTF8(&qa, "2", "$queue");
    bson_append_array_end(&qd, &qa);
    bson_append_document_end(&set, &qd);
    BSON_APPEND_DOCUMENT_BEGIN(&set, "next", &nd);
    BSON_APPEND_ARRAY_BEGIN(&nd, "$cond", &na);
    BSON_APPEND_UTF8(&na, "0", "$_mlt");
    BSON_APPEND_NULL(&na, "1");
    BSON_APPEND_UTF8(&na, "2", "$next");
    bson_append_array_end(&nd, &na);
    bson_append_document_end(&set, &nd);
  }
  bson_append_document_end(&stage, &set);
  bson_append_document_end(&u, &stage);
  BSON_APPEND_DOCUMENT(&u, "3", STAGE3);
  bson_append_array_end(cmd, &u);
  BSON_APPEND_DOCUMENT(cmd, "fields", FIELDS);
}

/* the release of doc/design.md into cmd */
/* the release's filter {_id: name, owner: owner}; the update is RELEASE_U */
static void release_filter(bson_t *q, const char *name, const char *owner) {
  BSON_APPEND_UTF8(q, "_id", name);
  BSON_APPEND_UTF8(q, "owner", owner);
}

/* 1 when the reply's value.owner is ours */
static int won(const bson_t *reply, const char *owner) {
  bson_iter_t it;
  return bson_iter_init(&it, reply) && bson_iter_find_descendant(&it, "value.owner", &it) &&
         BSON_ITER_HOLDS_UTF8(&it) && strcmp(bson_iter_utf8(&it, NULL), owner) == 0;
}

/* matchedCount of an update_one reply, or -1 */
static int64_t reply_matched(const bson_t *reply) {
  bson_iter_t it;
  if (bson_iter_init_find(&it, reply, "matchedCount") && BSON_ITER_HOLDS_NUMBER(&it))
    return bson_iter_as_int64(&it);
  return -1;
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

/* one acquire + release; 0 on success */
static int cycle(mongoc_client_t *c, mongoc_collection_t *col, const char *db,
                 const char *coll, const char *name, const bson_t *holder) {
  char owner[33];
  bson_t cmd, reply;
  bson_error_t err;
  int ok;
  new_owner(owner);
  bson_init(&cmd);
  acquire_cmd(&cmd, coll, name, owner, holder);
  ok = mongoc_client_write_command_with_opts(c, db, &cmd, WC_OPTS, &reply, &err) && won(&reply, owner);
  if (!ok && err.code) fprintf(stderr, "raw: findAndModify: %s\n", err.message);
  bson_destroy(&reply);
  bson_destroy(&cmd);
  if (!ok) return -1;
  /* release: a retryable write through update_one, as the library's */
  bson_init(&cmd);
  release_filter(&cmd, name, owner);
  ok = mongoc_collection_update_one(col, &cmd, RELEASE_U, UPDATE_OPTS, &reply, &err) &&
       reply_matched(&reply) == 1;
  if (!ok && err.code) fprintf(stderr, "raw: update: %s\n", err.message);
  bson_destroy(&reply);
  bson_destroy(&cmd);
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
  bson_t wc_opts = BSON_INITIALIZER, update_opts, *holder;
  mongoc_collection_t *col;
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
  mongoc_write_concern_append(wc, &wc_opts);
  if (gethostname(host, sizeof host) != 0) strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  snprintf(name, sizeof name, "bench-raw-%ld", (long)pid);
  build_static(TTL_MS);
  WC_OPTS = &wc_opts;
  bson_copy_to(&wc_opts, &update_opts);
  BSON_APPEND_BOOL(&update_opts, "validate", false);
  UPDATE_OPTS = &update_opts;
  col = mongoc_client_get_collection(c, db, coll);
  holder = BCON_NEW("host", BCON_UTF8(host), "pid", BCON_INT64(pid));

  for (i = 0; i < warmup; i++)
    if (cycle(c, col, db, coll, name, holder) != 0) failed++;

  ops0 = opcounters(c);
  c0 = cpu_s();
  t0 = now_s();
  do {
    for (i = 0; i < 64; i++) {
      if (cycle(c, col, db, coll, name, holder) != 0) failed++;
      n++;
    }
    t1 = now_s();
  } while (t1 - t0 < seconds);
  c1 = cpu_s();
  ops1 = opcounters(c);

  printf("{\"impl\":\"raw\",\"cycles\":%ld,\"seconds\":%.6f,\"cpu\":%.6f,\"ops\":%lld,\"failed\":%ld}\n",
         n, t1 - t0, c1 - c0, (ops0 < 0 || ops1 < 0) ? -1LL : (long long)(ops1 - ops0 - 1), failed);

  bson_destroy(holder);
  bson_destroy(&update_opts);
  mongoc_collection_destroy(col);
  bson_destroy(STAGE0);
  bson_destroy(STAGE1);
  bson_destroy(SET_REST);
  bson_destroy(STAGE3);
  bson_destroy(FIELDS);
  bson_destroy(RELEASE_U);
  mongoc_write_concern_destroy(wc);
  bson_destroy(&wc_opts);
  mongoc_client_pool_push(pool, c);
  mongoc_client_pool_destroy(pool);
  mongoc_uri_destroy(uri);
  mongoc_cleanup();
  return failed ? 1 : 0;
}
