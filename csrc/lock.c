/*
 * mongolock.Lock: the lease on a lock document, and the commands on named
 * locks (acquire, status, list, force release, the TTL index).
 *
 * Every command here is one round trip and every time decision is made by
 * the server ($$NOW); the only local clock read is the monotonic one, for
 * h:remaining().  See doc/design.md for the documents and commands.
 *
 * Handle states (liolib-style): open and held -> open, not held (released,
 * lost, or used from another process) -> closed (lease == NULL).  close(),
 * __close and __gc share lock_close, which is idempotent.
 */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "mongolock.h"

int (*ml_gc_handoff)(ml_client *c, ml_lease *l) = NULL;

#define NAME_MAX_BYTES 1024
#define TTL_MAX_MS ((int64_t)365 * 24 * 3600 * 1000)  /* a year */

/* ---- small BSON helpers ------------------------------------------------ */

/* integer value of a numeric field (int32, int64, double), else dflt */
static int64_t iter_int64(const bson_iter_t *it, int64_t dflt) {
  switch (bson_iter_type(it)) {
  case BSON_TYPE_INT32: return bson_iter_int32(it);
  case BSON_TYPE_INT64: return bson_iter_int64(it);
  case BSON_TYPE_DOUBLE: return (int64_t)bson_iter_double(it);
  case BSON_TYPE_DATE_TIME: return bson_iter_date_time(it);
  default: return dflt;
  }
}

static int find_int64(const bson_t *doc, const char *key, int64_t *out) {
  bson_iter_t it;
  if (!bson_iter_init_find(&it, doc, key)) return 0;
  if (!BSON_ITER_HOLDS_NUMBER(&it) && !BSON_ITER_HOLDS_DATE_TIME(&it)) return 0;
  *out = iter_int64(&it, 0);
  return 1;
}

/* a document field of doc as a bson_t view (valid while doc lives) */
static int find_doc(const bson_t *doc, const char *key, bson_t *out) {
  bson_iter_t it;
  const uint8_t *data;
  uint32_t len;
  if (!bson_iter_init_find(&it, doc, key) || !BSON_ITER_HOLDS_DOCUMENT(&it)) return 0;
  bson_iter_document(&it, &len, &data);
  return bson_init_static(out, data, len);
}

/*
 * A constant pipeline part from its JSON text.  A parse error is a bug in
 * this file: it aborts with the message.
 */
static bson_t *json_doc(const char *text) {
  bson_error_t err;
  bson_t *b = bson_new_from_json((const uint8_t *)text, -1, &err);
  if (!b) {
    fprintf(stderr, "mongolock: bad pipeline JSON (%s): %s\n", err.message, text);
    abort();
  }
  return b;
}

/*
 * The values of one attempt or leave, put into the constant parts where
 * they hold these placeholder strings:
 *   "@W@" the waiter id, "@T@" this process's tag, "@TW@" both (a next),
 *   "@Q@" how long the place is kept (int64 ms), "@P@" polling (bool).
 */
typedef struct {
  const char *w, *t;
  int64_t queue_ms;
  int polling;
} subst_vals;

/* appends every field of src to dst, placeholders replaced (v: NULL for a
 * part without any) */
static void append_all_with(bson_t *dst, const bson_t *src, const subst_vals *v) {
  bson_iter_t it;
  if (!bson_iter_init(&it, src)) return;
  while (bson_iter_next(&it)) {
    const char *key = bson_iter_key(&it);
    if (v && BSON_ITER_HOLDS_UTF8(&it) && bson_iter_utf8(&it, NULL)[0] == '@') {
      const char *ph = bson_iter_utf8(&it, NULL);
      if (!strcmp(ph, "@W@")) {
        BSON_APPEND_UTF8(dst, key, v->w);
      } else if (!strcmp(ph, "@T@")) {
        BSON_APPEND_UTF8(dst, key, v->t);
      } else if (!strcmp(ph, "@TW@")) {
        char tw[49];
        bson_snprintf(tw, sizeof tw, "%s%s", v->t, v->w);
        BSON_APPEND_UTF8(dst, key, tw);
      } else if (!strcmp(ph, "@Q@")) {
        BSON_APPEND_INT64(dst, key, v->queue_ms);
      } else if (!strcmp(ph, "@P@")) {
        BSON_APPEND_BOOL(dst, key, v->polling != 0);
      } else {
        bson_append_iter(dst, key, -1, &it);
      }
    } else if (v && (BSON_ITER_HOLDS_DOCUMENT(&it) || BSON_ITER_HOLDS_ARRAY(&it))) {
      uint32_t len;
      const uint8_t *data;
      bson_t sub, child;
      int is_doc = BSON_ITER_HOLDS_DOCUMENT(&it);
      if (is_doc) bson_iter_document(&it, &len, &data);
      else bson_iter_array(&it, &len, &data);
      if (!bson_init_static(&sub, data, len)) continue;
      if (is_doc) bson_append_document_begin(dst, key, -1, &child);
      else bson_append_array_begin(dst, key, -1, &child);
      append_all_with(&child, &sub, v);
      if (is_doc) bson_append_document_end(dst, &child);
      else bson_append_array_end(dst, &child);
    } else {
      bson_append_iter(dst, key, -1, &it);
    }
  }
}

/* appends every field of src to dst */
static void append_all(bson_t *dst, const bson_t *src) {
  append_all_with(dst, src, NULL);
}

/* the queue's live entries: those whose until is still ahead of the
 * server's now ("until" is refreshed by every attempt of a waiter) */
#define LIVE_QUEUE \
  "{\"$filter\": {\"input\": {\"$cond\": [{\"$isArray\": \"$queue\"}, \"$queue\", []]}," \
  " \"cond\": {\"$gt\": [\"$$this.until\", \"$$NOW\"]}}}"

/* the queue's first live watching waiter (p: false; a polling waiter
 * cannot be woken) as its process's tag and its id, 48 hex digits; null
 * when there is none */
#define QUEUE_HEAD \
  "{\"$ifNull\": [{\"$arrayElemAt\": [{\"$map\": {\"input\": {\"$filter\": {\"input\": " LIVE_QUEUE "," \
  " \"cond\": {\"$ne\": [\"$$this.p\", true]}}}," \
  " \"in\": {\"$concat\": [\"$$this.t\", \"$$this.w\"]}}}, 0]}, null]}"

/* the constant parts of the pipelines, parsed once */
static struct {
  bson_t *stage0;               /* {$set: {_mlq: LIVE}} */
  bson_t *stage1;               /* {$set: {_mlt: FREE and nobody queued
                                   ahead of @W@}} */
  bson_t *stage1_try;           /* stage1 for nobody: FREE and nobody queued */
  bson_t *token_acquired;       /* token, acquiredAt of the $set */
  bson_t *tail;                 /* queue, next of an attempt's $set */
  bson_t *tail_try;             /* queue, next of a try's $set */
  bson_t *stage3;               /* {$unset: [_mlq, _mlt]} */
  bson_t *fields;               /* an attempt's projection (position of @W@) */
  bson_t *fields_try;           /* a try's projection */
  bson_t *release_next;         /* {next: QUEUE_HEAD} */
  bson_t *waiting;              /* {waiting: live entries}, for status */
  bson_t *leave;                /* the leave pipeline */
} K;
static pthread_once_t k_once = PTHREAD_ONCE_INIT;

/* K's documents live in static storage, not on the heap: nothing to free
 * when the module is unloaded, and nothing a thread still releasing a
 * lease at exit could see freed */
#define KDOCS 12
#define KDOC_MAX 2048
static struct {
  bson_t b;
  uint8_t buf[KDOC_MAX];
} kdocs[KDOCS];
static int nkdocs;

static bson_t *keep(bson_t *heap) {
  bson_t *b;
  if (nkdocs >= KDOCS || heap->len > KDOC_MAX) {
    fprintf(stderr, "mongolock: constant pipeline part too large or too many\n");
    abort();
  }
  memcpy(kdocs[nkdocs].buf, bson_get_data(heap), heap->len);
  b = &kdocs[nkdocs].b;
  if (!bson_init_static(b, kdocs[nkdocs].buf, heap->len)) abort();
  nkdocs++;
  bson_destroy(heap);
  return b;
}

/* _mlt: the lock is free (no owner, or the lease ended) and no watching
 * waiter is queued ahead of W (fw: the first watching entry; me: W's) */
#define STAGE1                                                                   \
  "{\"$set\": {\"_mlt\": {\"$let\": {\"vars\": {"                                 \
  "  \"fw\": {\"$indexOfArray\": [{\"$map\": {\"input\": \"$_mlq\","                 \
  "                                 \"in\": {\"$ne\": [\"$$this.p\", true]}}}, true]}," \
  "  \"me\": {\"$indexOfArray\": [\"$_mlq.w\", \"@W@\"]}},"                           \
  " \"in\": {\"$and\": ["                                                          \
  "  {\"$or\": [{\"$eq\": [{\"$ifNull\": [\"$owner\", null]}, null]},"             \
  "            {\"$lte\": [\"$expiresAt\", \"$$NOW\"]}]},"                       \
  "  {\"$or\": [{\"$eq\": [\"$$fw\", -1]},"                                         \
  "            {\"$and\": [{\"$ne\": [\"$$me\", -1]}, {\"$lte\": [\"$$me\", \"$$fw\"]}]}]}]}}}}}"
#define FIELDS                                                                   \
  "{\"owner\": 1, \"token\": 1, \"expiresAt\": 1, \"holder\": 1, \"acquiredAt\": 1," \
  " \"remainingMs\": {\"$subtract\": [\"$expiresAt\", \"$$NOW\"]},"              \
  " \"queued\": {\"$size\": {\"$cond\": [{\"$isArray\": \"$queue\"}, \"$queue\", []]}}," \
  " \"position\": {\"$indexOfArray\": [{\"$cond\": [{\"$isArray\": \"$queue\"},"  \
  "     \"$queue.w\", []]}, \"@W@\"]}}"

/* a constant part with the placeholders of v put in, kept */
static bson_t *keep_with(const bson_t *tmpl, const subst_vals *v) {
  bson_t *b = bson_new();
  append_all_with(b, tmpl, v);
  return keep(b);
}

static void k_init(void) {
  const subst_vals nobody = {"", "", 0, 0};
  K.stage0 = keep(json_doc("{\"$set\": {\"_mlq\": " LIVE_QUEUE "}}"));
  K.stage1 = keep(json_doc(STAGE1));
  K.stage1_try = keep_with(K.stage1, &nobody);
  K.token_acquired = keep(json_doc(
      "{\"token\": {\"$cond\": [\"$_mlt\", {\"$max\": ["
      "     {\"$add\": [{\"$ifNull\": [\"$token\", {\"$numberLong\": \"0\"}]}, {\"$numberLong\": \"1\"}]},"
      "     {\"$multiply\": [{\"$toLong\": \"$$NOW\"}, {\"$numberLong\": \"1024\"}]}]}, \"$token\"]},"
      " \"acquiredAt\": {\"$cond\": [\"$_mlt\", \"$$NOW\", \"$acquiredAt\"]}}"));
  /* taken: the live queue without us; else our place kept (until
   * refreshed) or taken at the end */
  K.tail = keep(json_doc(
      "{\"queue\": {\"$cond\": [\"$_mlt\","
      "   {\"$filter\": {\"input\": \"$_mlq\", \"cond\": {\"$ne\": [\"$$this.w\", \"@W@\"]}}},"
      "   {\"$cond\": [{\"$in\": [\"@W@\", \"$_mlq.w\"]},"
      "     {\"$map\": {\"input\": \"$_mlq\", \"in\": {\"$cond\": [{\"$eq\": [\"$$this.w\", \"@W@\"]},"
      "        {\"w\": \"@W@\", \"t\": \"@T@\", \"until\": {\"$add\": [\"$$NOW\", \"@Q@\"]}, \"p\": \"@P@\"},"
      "        \"$$this\"]}}},"
      "     {\"$concatArrays\": [\"$_mlq\", [{\"w\": \"@W@\", \"t\": \"@T@\","
      "        \"until\": {\"$add\": [\"$$NOW\", \"@Q@\"]}, \"p\": \"@P@\"}]]}]}]},"
      " \"next\": {\"$cond\": [\"$_mlt\", null, \"$next\"]}}"));
  /* a try leaves a queue it did not take from as it was */
  K.tail_try = keep(json_doc("{\"queue\": {\"$cond\": [\"$_mlt\", \"$_mlq\", \"$queue\"]},"
                             " \"next\": {\"$cond\": [\"$_mlt\", null, \"$next\"]}}"));
  K.stage3 = keep(json_doc("{\"$unset\": [\"_mlq\", \"_mlt\"]}"));
  K.fields = keep(json_doc(FIELDS));
  K.fields_try = keep_with(K.fields, &nobody);
  K.release_next = keep(json_doc("{\"next\": " QUEUE_HEAD "}"));
  K.waiting = keep(json_doc("{\"waiting\": {\"$size\": " LIVE_QUEUE "}}"));
  /* out of the queue; a release already handed to us (next names us)
   * goes to the next live waiter */
  K.leave = keep(json_doc(
      "{\"0\": {\"$set\": {\"queue\": {\"$filter\": {\"input\": " LIVE_QUEUE ","
      "   \"cond\": {\"$ne\": [\"$$this.w\", \"@W@\"]}}}}},"
      " \"1\": {\"$set\": {\"next\": {\"$cond\": [{\"$eq\": [\"$next\", \"@TW@\"]},"
      "   " QUEUE_HEAD ", \"$next\"]}}}}"));
}

/* pushes a date (ms since the epoch) as seconds, like ngx.now() */
static void push_date_s(lua_State *L, int64_t ms) {
  lua_pushnumber(L, (lua_Number)ms / 1000.0);
}

/* ---- validation -------------------------------------------------------- */

/* names: 1..1024 bytes of valid UTF-8 without NUL.  Returns a message or
 * NULL when fine. */
static const char *check_name(const char *s, size_t len) {
  if (len == 0) return "name must not be empty";
  if (len > NAME_MAX_BYTES) return "name longer than 1024 bytes";
  if (memchr(s, '\0', len)) return "name contains a NUL byte";
  if (!bson_utf8_validate(s, len, false)) return "name is not valid UTF-8";
  return NULL;
}

/* raises unless argument i is a string (numbers are not converted) */
static const char *arg_string(lua_State *L, int i, size_t *len) {
  if (lua_type(L, i) != LUA_TSTRING)
    luaL_argerror(L, i, lua_pushfstring(L, "string expected, got %s", luaL_typename(L, i)));
  return lua_tolstring(L, i, len);
}

static const char *arg_name(lua_State *L, int i, size_t *len) {
  const char *s = arg_string(L, i, len);
  const char *msg;
  msg = check_name(s, *len);
  if (msg) luaL_argerror(L, i, msg);
  return s;
}

/* database and collection names: non-empty, no NUL, UTF-8, no '$' */
static const char *arg_ns(lua_State *L, int i) {
  size_t len;
  const char *s = arg_string(L, i, &len);
  luaL_argcheck(L, len > 0 && len < 120, i, "database/collection name must be 1..119 bytes");
  luaL_argcheck(L, strlen(s) == len && bson_utf8_validate(s, len, false) && !strchr(s, '$'),
                i, "invalid database/collection name");
  return s;
}

/* a waiter id (core.waiter_id()): 32 lowercase hex digits; they go into
 * the pipelines' JSON as they are */
static const char *arg_waiter(lua_State *L, int i) {
  size_t len, k;
  const char *w = luaL_checklstring(L, i, &len);
  for (k = 0; k < len && ((w[k] >= '0' && w[k] <= '9') || (w[k] >= 'a' && w[k] <= 'f')); k++)
    ;
  luaL_argcheck(L, len == 32 && k == 32, i, "waiter id must be 32 lowercase hex digits");
  return w;
}

/* ttl in milliseconds: a positive integer up to a year */
static int64_t arg_ttl_ms(lua_State *L, int i) {
  lua_Number n = luaL_checknumber(L, i);
  luaL_argcheck(L, n == n && n >= 1 && n <= (lua_Number)TTL_MAX_MS, i,
                "ttl must be a positive number of milliseconds, at most a year");
  return (int64_t)ceil(n);
}

/* ---- the lease --------------------------------------------------------- */

void ml_lease_unref(ml_lease *l) {
  int refs;
  pthread_mutex_lock(&l->mu);
  refs = --l->refs;
  pthread_mutex_unlock(&l->mu);
  if (refs > 0) return;
  pthread_mutex_destroy(&l->mu);
  bson_free(l->db);
  bson_free(l->coll);
  bson_free(l->owner_field);
  bson_free(l->time_field);
  bson_value_destroy(&l->id);
  bson_free(l);
}

static int hexval(char ch) {
  if (ch >= '0' && ch <= '9') return ch - '0';
  if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
  if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
  return 0;
}

void ml_lease_append_owner(bson_t *b, const char *key, size_t keylen, const ml_lease *l) {
  if (l->owner_form == ML_OWNER_UUID) {
    uint8_t u[16];
    int i;
    for (i = 0; i < 16; i++)
      u[i] = (uint8_t)(hexval(l->owner[2 * i]) << 4 | hexval(l->owner[2 * i + 1]));
    bson_append_binary(b, key, (int)keylen, BSON_SUBTYPE_UUID, u, 16);
  } else {
    bson_append_utf8(b, key, (int)keylen, l->owner, 32);
  }
}

int ml_lease_owner_matches(const bson_iter_t *it, const ml_lease *l) {
  if (BSON_ITER_HOLDS_UTF8(it)) {
    uint32_t len;
    const char *s = bson_iter_utf8(it, &len);
    return l->owner_form == ML_OWNER_HEX && len == 32 && memcmp(s, l->owner, 32) == 0;
  }
  if (BSON_ITER_HOLDS_BINARY(it) && l->owner_form == ML_OWNER_UUID) {
    bson_subtype_t st;
    uint32_t len;
    const uint8_t *data;
    int i;
    bson_iter_binary(it, &st, &len, &data);
    if (st != BSON_SUBTYPE_UUID || len != 16) return 0;
    for (i = 0; i < 16; i++)
      if (data[i] != (uint8_t)(hexval(l->owner[2 * i]) << 4 | hexval(l->owner[2 * i + 1])))
        return 0;
    return 1;
  }
  return 0;
}

static ml_lease *lease_new(const ml_lease_spec *s) {
  ml_lease *l = (ml_lease *)bson_malloc0(sizeof *l);
  pthread_mutex_init(&l->mu, NULL);
  l->db = bson_strdup(s->db);
  l->coll = bson_strdup(s->coll);
  bson_value_copy(s->id, &l->id);
  l->owner_field = bson_strdup(s->owner_field ? s->owner_field : "owner");
  l->time_field = bson_strdup(s->time_field ? s->time_field : "expiresAt");
  l->time_mode = s->time_mode;
  l->owner_form = s->owner_form;
  bson_strncpy(l->owner, s->owner, sizeof l->owner);
  l->token = s->token;
  l->pid = getpid();
  l->ttl_ms = s->ttl_ms;
  l->deadline = s->started + (double)s->ttl_ms / 1000.0;
  l->held = 1;
  l->renew = s->renew;
  l->queued = s->queued;
  l->lost = 0;
  l->refs = 1;
  return l;
}

/* the update filter {_id: id, <owner_field>: owner} */
static void append_owner_filter(bson_t *q, const ml_lease *l) {
  BSON_APPEND_VALUE(q, "_id", &l->id);
  ml_lease_append_owner(q, l->owner_field, strlen(l->owner_field), l);
}

/*
 * Updates one document (q, u: an update document, or a pipeline as an
 * array) with the client's write concern and returns the number matched
 * (>= 0) or -1 with error set.  Takes ownership of q and u.  Sent as a
 * retryable write: the driver retries it once, with the same transaction
 * number, after a network error or an error labelled RetryableWriteError
 * (a failover), and the server applies it at most once.
 */
static int64_t run_update(mongoc_client_t *mc, const ml_client *c, const char *db,
                          const char *coll, bson_t *q, bson_t *u, bson_error_t *error) {
  mongoc_collection_t *col = mongoc_client_get_collection(mc, db, coll);
  bson_t opts = BSON_INITIALIZER, reply;
  bson_iter_t it;
  int64_t n = -1;
  ml_client_append_wc(c, &opts);
  BSON_APPEND_BOOL(&opts, "validate", false);   /* built here, or checked
                                                   by the Lua layer */
  if (mongoc_collection_update_one(col, q, u, &opts, &reply, error)) {
    if (bson_iter_init_find(&it, &reply, "matchedCount")) {
      n = iter_int64(&it, 0);
    } else {
      bson_set_error(error, MONGOC_ERROR_PROTOCOL, MONGOC_ERROR_PROTOCOL_INVALID_REPLY,
                     "update reply without matchedCount");
    }
  }
  bson_destroy(&reply);
  bson_destroy(&opts);
  bson_destroy(q);
  bson_destroy(u);
  mongoc_collection_destroy(col);
  return n;
}

/* is this operator of an extra update one the unlock also uses? */
static int merges(const char *key) {
  return !strcmp(key, "$set") || !strcmp(key, "$currentDate");
}

int ml_lease_release(mongoc_client_t *mc, const ml_client *c, ml_lease *l,
                     const bson_t *extra, bson_error_t *error) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER, stage, set;
  int64_t n;
  append_owner_filter(&q, l);
  if (!extra) {
    /* [{$set: {owner: null, time: "$$NOW" | null}}] */
    BSON_APPEND_DOCUMENT_BEGIN(&u, "0", &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
    BSON_APPEND_NULL(&set, l->owner_field);
    if (l->time_mode == ML_TIME_EXPIRES_AT) BSON_APPEND_UTF8(&set, l->time_field, "$$NOW");
    else BSON_APPEND_NULL(&set, l->time_field);
    if (l->queued) {
      /* next: the queue's first live waiter, whose process the release
       * event wakes (csrc/watch.c) */
      pthread_once(&k_once, k_init);
      append_all(&set, K.release_next);
    }
    bson_append_document_end(&stage, &set);
    bson_append_document_end(&u, &stage);
    n = run_update(mc, c, l->db, l->coll, &q, &u, error);
  } else {
    /* operator form: extra's operators, with the unlock merged into $set
     * (and $currentDate for the server's now) */
    bson_iter_t it, sub;
    bson_t cd;
    int have_cd = 0;
    BSON_APPEND_DOCUMENT_BEGIN(&u, "$set", &set);
    if (bson_iter_init_find(&it, extra, "$set") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
        bson_iter_recurse(&it, &sub)) {
      while (bson_iter_next(&sub))
        bson_append_iter(&set, bson_iter_key(&sub), -1, &sub);
    }
    BSON_APPEND_NULL(&set, l->owner_field);
    if (l->time_mode == ML_TIME_LOCKED_AT) BSON_APPEND_NULL(&set, l->time_field);
    bson_append_document_end(&u, &set);
    if (l->time_mode == ML_TIME_EXPIRES_AT) {
      have_cd = 1;
      BSON_APPEND_DOCUMENT_BEGIN(&u, "$currentDate", &cd);
      BSON_APPEND_BOOL(&cd, l->time_field, true);
    }
    if (bson_iter_init_find(&it, extra, "$currentDate") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
        bson_iter_recurse(&it, &sub)) {
      if (!have_cd) {
        have_cd = 1;
        BSON_APPEND_DOCUMENT_BEGIN(&u, "$currentDate", &cd);
      }
      while (bson_iter_next(&sub))
        bson_append_iter(&cd, bson_iter_key(&sub), -1, &sub);
    }
    if (have_cd) bson_append_document_end(&u, &cd);
    if (bson_iter_init(&it, extra)) {
      while (bson_iter_next(&it))
        if (!merges(bson_iter_key(&it))) bson_append_iter(&u, bson_iter_key(&it), -1, &it);
    }
    n = run_update(mc, c, l->db, l->coll, &q, &u, error);
  }
  if (n < 0) return -1;
  error->code = 0;
  return n > 0 ? 1 : 0;
}

int ml_lease_extend(mongoc_client_t *mc, const ml_client *c, ml_lease *l,
                    int64_t ttl_ms, double started, bson_error_t *error) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER, stage, set, add;
  int64_t n;
  append_owner_filter(&q, l);
  BSON_APPEND_DOCUMENT_BEGIN(&u, "0", &stage);
  BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
  if (l->time_mode == ML_TIME_EXPIRES_AT) {
    /* expiresAt: {$add: ["$$NOW", ttl]} */
    bson_t inner;
    BSON_APPEND_DOCUMENT_BEGIN(&set, l->time_field, &inner);
    BSON_APPEND_ARRAY_BEGIN(&inner, "$add", &add);
    BSON_APPEND_UTF8(&add, "0", "$$NOW");
    BSON_APPEND_INT64(&add, "1", ttl_ms);
    bson_append_array_end(&inner, &add);
    bson_append_document_end(&set, &inner);
  } else {
    BSON_APPEND_UTF8(&set, l->time_field, "$$NOW");
  }
  bson_append_document_end(&stage, &set);
  bson_append_document_end(&u, &stage);
  n = run_update(mc, c, l->db, l->coll, &q, &u, error);
  if (n < 0) return -1;
  error->code = 0;
  pthread_mutex_lock(&l->mu);
  if (n > 0) {
    /* locked-at documents expire at lockTime + the ttl every party uses:
     * the lease length does not change */
    if (l->time_mode == ML_TIME_EXPIRES_AT) l->ttl_ms = ttl_ms;
    l->deadline = started + (double)l->ttl_ms / 1000.0;
  } else if (l->held && !l->releasing) {
    /* a release under way or done is not a loss: it cleared the owner */
    l->held = 0;
    l->lost = 1;
  }
  pthread_mutex_unlock(&l->mu);
  return n > 0 ? 1 : 0;
}

/* ---- the handle -------------------------------------------------------- */

ml_lock *ml_checklock(lua_State *L, int idx) {
  return (ml_lock *)luaL_checkudata(L, idx, ML_LOCK_MT);
}

ml_lock *ml_lock_new(lua_State *L, int client_idx, const ml_lease_spec *spec) {
  ml_lock *h;
  client_idx = lua_absindex(L, client_idx);
  h = (ml_lock *)ml_newuserdata(L, sizeof *h);
  h->lease = NULL;
  h->keep = NULL;
  luaL_getmetatable(L, ML_LOCK_MT);
  lua_setmetatable(L, -2);
  /* uservalue {client}: the client outlives its handles */
  lua_createtable(L, 1, 0);
  lua_pushvalue(L, client_idx);
  lua_rawseti(L, -2, 1);
  ml_setuservalue(L, -2);
  h->lease = lease_new(spec);
  h->keep = h->lease;
  h->keep->refs++;              /* not yet visible to any other thread */
  /* background renewal (renew.c) takes its own reference */
  if (spec->renew)
    (void)ml_renew_add(L, (ml_client *)luaL_checkudata(L, client_idx, ML_CLIENT_MT), h->lease);
  return h;
}

/* the client of a handle (may be closed); leaves the stack as it was */
static ml_client *lock_client(lua_State *L, int idx) {
  ml_client *c;
  ml_getuservalue(L, idx);
  lua_rawgeti(L, -1, 1);
  c = (ml_client *)luaL_testudata(L, -1, ML_CLIENT_MT);
  lua_pop(L, 2);
  return c;
}

/* held by this process? (a forked child never acts for its parent) */
static int lease_held(ml_lease *l) {
  int held;
  pthread_mutex_lock(&l->mu);
  held = l->held && l->pid == getpid();
  pthread_mutex_unlock(&l->mu);
  return held;
}

/*
 * Releases a held lease from the Lua thread.  Returns 1 released, 0 not
 * held, -1 error (error set).  On -1 the lease stays marked held: the caller
 * may retry, and the server frees it at expiry anyway.
 */
static int lock_release(lua_State *L, int idx, ml_lease *l, const bson_t *extra,
                        bson_error_t *error) {
  ml_client *c = lock_client(L, idx);
  int r;
  if (!lease_held(l)) return 0;
  if (!c || c->closed) {
    bson_set_error(error, MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_NOT_READY, "closed");
    return -1;
  }
  pthread_mutex_lock(&l->mu);
  l->releasing = 1;
  pthread_mutex_unlock(&l->mu);
  r = ml_lease_release(ml_client_get(L, c), c, l, extra, error);
  pthread_mutex_lock(&l->mu);
  if (r >= 0) l->held = 0;
  l->releasing = 0;
  pthread_mutex_unlock(&l->mu);
  return r;
}

/* h:release() -> true | nil, "not held" | nil, "closed" | nil, msg, code */
static int l_release(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  bson_error_t err;
  int r;
  ml_client *c = lock_client(L, 1);
  if (!h->lease || !c || c->closed) return ml_pushfail(L, "closed", 0);
  r = lock_release(L, 1, h->lease, NULL, &err);
  if (r < 0) return ml_pusherror(L, &err);
  if (r == 0) return ml_pushfail(L, "not held", 0);
  lua_pushboolean(L, 1);
  return 1;
}

/* h:extend([ttl_seconds]) -> true | nil, "lost" | nil, "not held" |
 * nil, "closed" | nil, msg, code */
static int l_extend(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  ml_lease *l = h->lease;
  ml_client *c;
  bson_error_t err;
  int64_t ttl_ms;
  int r, lost;
  if (!lua_isnoneornil(L, 2)) {
    lua_Number s = luaL_checknumber(L, 2);
    luaL_argcheck(L, s == s && s > 0 && s * 1000 <= (lua_Number)TTL_MAX_MS, 2,
                  "ttl must be a positive, finite number of seconds (at most a year)");
    ttl_ms = (int64_t)ceil(s * 1000);
  } else {
    ttl_ms = 0;
  }
  if (!l) return ml_pushfail(L, "closed", 0);
  pthread_mutex_lock(&l->mu);
  lost = l->lost;
  if (!ttl_ms) ttl_ms = l->ttl_ms;
  pthread_mutex_unlock(&l->mu);
  if (lost) return ml_pushfail(L, "lost", 0);
  if (!lease_held(l)) return ml_pushfail(L, "not held", 0);
  c = lock_client(L, 1);
  if (!c || c->closed) return ml_pushfail(L, "closed", 0);
  r = ml_lease_extend(ml_client_get(L, c), c, l, ttl_ms, ml_monotonic(), &err);
  if (r < 0) return ml_pusherror(L, &err);
  if (r == 0) return ml_pushfail(L, "lost", 0);
  lua_pushboolean(L, 1);
  return 1;
}

/* h:remaining() -> seconds left by the local monotonic clock (>= 0), or
 * nil, "not held" | "lost" | "closed" */
static int l_remaining(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  ml_lease *l = h->lease;
  double left;
  int lost;
  if (!l) return ml_pushfail(L, "closed", 0);
  pthread_mutex_lock(&l->mu);
  left = l->deadline - ml_monotonic();
  lost = l->lost;
  pthread_mutex_unlock(&l->mu);
  if (lost) return ml_pushfail(L, "lost", 0);
  if (!lease_held(l)) return ml_pushfail(L, "not held", 0);
  lua_pushnumber(L, left > 0 ? left : 0);
  return 1;
}

/* h:held() -> boolean: held by this handle as far as this process knows
 * (not released, not lost, not closed, and made in this process) */
static int l_held(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  lua_pushboolean(L, h->lease && lease_held(h->lease));
  return 1;
}

/*
 * Idempotent close shared by close(), __close and __gc.  Releases a lease
 * still held by this process (errors swallowed: the server frees it at
 * expiry), or hands it to background renewal when that is running (gc only).
 */
static void lock_close(lua_State *L, int idx, ml_lock *h, int from_gc) {
  ml_lease *l = h->lease;
  bson_error_t err;
  if (!l) return;
  h->lease = NULL;  /* mark closed */
  if (lease_held(l)) {
    ml_client *c = lock_client(L, idx);
    if (c && !c->closed && c->pool && c->pid == getpid()) {
      if (from_gc && ml_gc_handoff && ml_gc_handoff(c, l))
        return;  /* renew.c owns this reference now */
      (void)ml_lease_release(ml_client_get(L, c), c, l, NULL, &err);
    }
    pthread_mutex_lock(&l->mu);
    l->held = 0;
    pthread_mutex_unlock(&l->mu);
  }
  ml_lease_unref(l);
}

/* h:close() -> true: releases if held; afterwards every method answers
 * nil, "closed" */
static int l_close(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  if (h->lease) {
    ml_lease *l = h->lease;
    bson_error_t err;
    int r = lock_release(L, 1, l, NULL, &err);
    h->lease = NULL;
    if (r < 0 && lease_held(l)) {
      pthread_mutex_lock(&l->mu);
      l->held = 0;
      pthread_mutex_unlock(&l->mu);
    }
    ml_lease_unref(l);
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int l_gc(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  lock_close(L, 1, h, 1);
  if (h->keep) {
    ml_lease_unref(h->keep);
    h->keep = NULL;
  }
  return 0;
}

static int l_tclose(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  lock_close(L, 1, h, 0);
  return 0;
}

static int l_tostring(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  ml_lease *l = h->lease;
  if (!l) lua_pushliteral(L, "mongolock.Lock (closed)");
  else if (l->id.value_type == BSON_TYPE_UTF8)
    lua_pushfstring(L, "mongolock.Lock (%s, %s)", l->id.value.v_utf8.str,
                    lease_held(l) ? "held" : "not held");
  else lua_pushfstring(L, "mongolock.Lock (%p, %s)", (void *)l, lease_held(l) ? "held" : "not held");
  return 1;
}

/* pushes the lock's _id: a string for named locks; other BSON values as
 * bson.c maps them */
static void push_id(lua_State *L, const bson_value_t *v) {
  switch (v->value_type) {
  case BSON_TYPE_UTF8: lua_pushlstring(L, v->value.v_utf8.str, v->value.v_utf8.len); return;
  case BSON_TYPE_INT32: lua_pushinteger(L, v->value.v_int32); return;
  case BSON_TYPE_INT64: ml_pushint64(L, v->value.v_int64); return;
  case BSON_TYPE_DOUBLE: lua_pushnumber(L, v->value.v_double); return;
  default: {
    bson_t tmp = BSON_INITIALIZER;
    bson_iter_t it;
    BSON_APPEND_VALUE(&tmp, "v", v);
    if (bson_iter_init_find(&it, &tmp, "v")) ml_pushbsonvalue(L, &it);
    else lua_pushnil(L);
    bson_destroy(&tmp);
  }
  }
}

/*
 * __index: methods first, then the lease's data, readable after close too: name (the _id), token, owner, ttl (seconds),
 * database, collection, renew, lost.  Unknown keys give nil.
 * Upvalue 1: the methods table.
 */
static int l_index(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  const char *k;
  lua_pushvalue(L, 2);
  lua_rawget(L, lua_upvalueindex(1));
  if (!lua_isnil(L, -1) || lua_type(L, 2) != LUA_TSTRING) return 1;
  lua_pop(L, 1);
  k = lua_tostring(L, 2);
  if (!h->keep) {
    lua_pushnil(L);
    return 1;
  }
  if (!strcmp(k, "name") || !strcmp(k, "id")) push_id(L, &h->keep->id);
  else if (!strcmp(k, "token")) ml_pushint64(L, h->keep->token);
  else if (!strcmp(k, "owner")) lua_pushstring(L, h->keep->owner);
  else if (!strcmp(k, "ttl")) {
    pthread_mutex_lock(&h->keep->mu);
    lua_pushnumber(L, (lua_Number)h->keep->ttl_ms / 1000.0);
    pthread_mutex_unlock(&h->keep->mu);
  } else if (!strcmp(k, "database")) lua_pushstring(L, h->keep->db);
  else if (!strcmp(k, "collection")) lua_pushstring(L, h->keep->coll);
  else if (!strcmp(k, "renew") || !strcmp(k, "lost")) {
    int v;
    pthread_mutex_lock(&h->keep->mu);
    v = k[0] == 'r' ? h->keep->renew : h->keep->lost;
    pthread_mutex_unlock(&h->keep->mu);
    lua_pushboolean(L, v);
  } else lua_pushnil(L);
  return 1;
}

/* ---- named-lock commands on the client --------------------------------- */

/* key: {$cond: ["$_mlt", <value appended by the caller>, "$key"]}: begins
 * the $cond array with the take decision; the caller appends "1" and calls
 * cond_end, which keeps the old value when the attempt does not take */
static void cond_begin(bson_t *set, const char *key, bson_t *d, bson_t *arr) {
  BSON_APPEND_DOCUMENT_BEGIN(set, key, d);
  BSON_APPEND_ARRAY_BEGIN(d, "$cond", arr);
  BSON_APPEND_UTF8(arr, "0", "$_mlt");
}

static void cond_end(bson_t *set, const char *key, bson_t *d, bson_t *arr) {
  char old[64];
  bson_snprintf(old, sizeof old, "$%s", key);
  BSON_APPEND_UTF8(arr, "2", old);
  bson_append_array_end(d, arr);
  bson_append_document_end(set, d);
}

/*
 * The acquire pipeline of doc/design.md.  waiter != NULL: an acquire that
 * queues (waiter is its owner id, tag its process's, queue_ms how long its
 * place is kept without a new attempt, polling whether it polls instead of
 * watching);
 * NULL: a try, which takes the lock only when no live watching waiter is
 * queued and never queues.
 */
static void build_acquire(bson_t *cmd, const char *coll, const char *name, size_t namelen,
                          const char *owner, int64_t ttl_ms, const char *host, int64_t pid,
                          const char *app, const char *waiter, const char *tag,
                          int64_t queue_ms, int polling) {
  bson_t q, u, stage, set, d, arr, x, xa, holder;
  const subst_vals v = {waiter, tag, queue_ms, polling};
  pthread_once(&k_once, k_init);
  BSON_APPEND_UTF8(cmd, "findAndModify", coll);
  BSON_APPEND_DOCUMENT_BEGIN(cmd, "query", &q);
  bson_append_utf8(&q, "_id", 3, name, (int)namelen);
  bson_append_document_end(cmd, &q);
  BSON_APPEND_BOOL(cmd, "upsert", true);
  BSON_APPEND_BOOL(cmd, "new", true);

  BSON_APPEND_ARRAY_BEGIN(cmd, "update", &u);
  /* 0: _mlq, the live queue */
  BSON_APPEND_DOCUMENT(&u, "0", K.stage0);
  /* 1: _mlt, whether this attempt takes the lock: it is free (no owner,
   * or the lease ended) and nobody waits ahead of us */
  if (waiter) {
    BSON_APPEND_DOCUMENT_BEGIN(&u, "1", &stage);
    append_all_with(&stage, K.stage1, &v);
    bson_append_document_end(&u, &stage);
  } else {
    BSON_APPEND_DOCUMENT(&u, "1", K.stage1_try);
  }
  /* 2: every field from _mlt; when it is false everything but the queue
   * is written back unchanged */
  BSON_APPEND_DOCUMENT_BEGIN(&u, "2", &stage);
  BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
  cond_begin(&set, "owner", &d, &arr);
  BSON_APPEND_UTF8(&arr, "1", owner);
  cond_end(&set, "owner", &d, &arr);
  append_all(&set, K.token_acquired);
  cond_begin(&set, "expiresAt", &d, &arr);
  BSON_APPEND_DOCUMENT_BEGIN(&arr, "1", &x);
  BSON_APPEND_ARRAY_BEGIN(&x, "$add", &xa);
  BSON_APPEND_UTF8(&xa, "0", "$$NOW");
  BSON_APPEND_INT64(&xa, "1", ttl_ms);
  bson_append_array_end(&x, &xa);
  bson_append_document_end(&arr, &x);
  cond_end(&set, "expiresAt", &d, &arr);
  cond_begin(&set, "holder", &d, &arr);
  BSON_APPEND_DOCUMENT_BEGIN(&arr, "1", &x);
  BSON_APPEND_DOCUMENT_BEGIN(&x, "$literal", &holder);
  BSON_APPEND_UTF8(&holder, "host", host);
  BSON_APPEND_INT64(&holder, "pid", pid);
  if (app) BSON_APPEND_UTF8(&holder, "app", app);
  bson_append_document_end(&x, &holder);
  bson_append_document_end(&arr, &x);
  cond_end(&set, "holder", &d, &arr);
  if (waiter) append_all_with(&set, K.tail, &v);
  else append_all(&set, K.tail_try);
  bson_append_document_end(&stage, &set);
  bson_append_document_end(&u, &stage);
  BSON_APPEND_DOCUMENT(&u, "3", K.stage3);
  bson_append_array_end(cmd, &u);

  if (waiter) {
    BSON_APPEND_DOCUMENT_BEGIN(cmd, "fields", &x);
    append_all_with(&x, K.fields, &v);
    bson_append_document_end(cmd, &x);
  } else {
    BSON_APPEND_DOCUMENT(cmd, "fields", K.fields_try);
  }
}

/* [-0, +1] holder sub-document as {host=, pid=, app=} (or nil) */
static void push_holder(lua_State *L, const bson_t *doc) {
  bson_t h;
  bson_iter_t it;
  if (!find_doc(doc, "holder", &h)) {
    lua_pushnil(L);
    return;
  }
  lua_createtable(L, 0, 3);
  if (bson_iter_init(&it, &h)) {
    while (bson_iter_next(&it)) {
      const char *k = bson_iter_key(&it);
      if (BSON_ITER_HOLDS_UTF8(&it)) lua_pushstring(L, bson_iter_utf8(&it, NULL));
      else if (BSON_ITER_HOLDS_NUMBER(&it)) ml_pushint64(L, iter_int64(&it, 0));
      else continue;
      lua_setfield(L, -2, k);
    }
  }
}

/* [-0, +1] {owner=, token=, remaining=, holder=, operation_time={t=, i=}}
 * from a lock document as returned by acquire (value) and its reply */
static void push_busy_info(lua_State *L, const bson_t *value, const bson_t *reply) {
  bson_iter_t it;
  int64_t v;
  lua_createtable(L, 0, 6);
  if (bson_iter_init_find(&it, value, "owner") && BSON_ITER_HOLDS_UTF8(&it)) {
    lua_pushstring(L, bson_iter_utf8(&it, NULL));
    lua_setfield(L, -2, "owner");
  }
  if (find_int64(value, "token", &v)) {
    ml_pushint64(L, v);
    lua_setfield(L, -2, "token");
  }
  if (find_int64(value, "remainingMs", &v)) {
    lua_pushnumber(L, v > 0 ? (lua_Number)v / 1000.0 : 0);
    lua_setfield(L, -2, "remaining");
  }
  if (find_int64(value, "expiresAt", &v)) {
    push_date_s(L, v);
    lua_setfield(L, -2, "expires_at");
  }
  push_holder(L, value);
  lua_setfield(L, -2, "holder");
  if (find_int64(value, "queued", &v)) {
    ml_pushint64(L, v);
    lua_setfield(L, -2, "queued");
  }
  if (find_int64(value, "position", &v) && v >= 0) {
    ml_pushint64(L, v + 1);
    lua_setfield(L, -2, "position");
  }
  ml_set_operation_time(L, reply);
}

void ml_set_operation_time(lua_State *L, const bson_t *reply) {
  bson_iter_t it;
  if (bson_iter_init_find(&it, reply, "operationTime") && BSON_ITER_HOLDS_TIMESTAMP(&it)) {
    uint32_t t, i;
    bson_iter_timestamp(&it, &t, &i);
    lua_createtable(L, 0, 2);
    lua_pushnumber(L, (lua_Number)t);
    lua_setfield(L, -2, "t");
    lua_pushnumber(L, (lua_Number)i);
    lua_setfield(L, -2, "i");
    lua_setfield(L, -2, "operation_time");
  }
}

/*
 * client:acquire(db, coll, name, ttl_ms [, app [, renew [, waiter, queue_ms [, polling]]]])
 *   -> handle
 *    | nil, "busy", info      info = {owner, token, remaining (s),
 *                                     expires_at, holder, operation_time,
 *                                     queued, position}
 *    | nil, message, code     (server or network error)
 * Without waiter it is a try: it takes a free lock nobody queues for.
 * With waiter (core.waiter_id(), the same for every attempt of one
 * acquire) the attempt takes the lock when it is free and no live watching
 * waiter is queued ahead of it, and otherwise queues waiter (or keeps its
 * place) for queue_ms, marked as polling or watching; position is then its
 * place (1 = first).
 * One findAndModify.  A network error is retried once with the same owner
 * id, so that an attempt the server applied but whose reply was lost is
 * recognised as won instead of leaving the lock held by nobody.
 */
static int l_acquire(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  size_t namelen;
  const char *name = arg_name(L, 4, &namelen);
  int64_t ttl_ms = arg_ttl_ms(L, 5);
  const char *app = luaL_optstring(L, 6, NULL);
  int renew = lua_toboolean(L, 7);
  const char *waiter = NULL;
  int64_t queue_ms = 0;
  int polling = 0;
  char tag[17] = "";
  char owner[33], host[256];
  mongoc_client_t *mc;
  bson_t cmd = BSON_INITIALIZER, opts = BSON_INITIALIZER, reply, value;
  bson_error_t err;
  bson_iter_t it;
  double started = 0;
  int ok = 0, attempt, won;

  if (!lua_isnoneornil(L, 8)) {
    waiter = arg_waiter(L, 8);
    queue_ms = arg_ttl_ms(L, 9);
    polling = lua_toboolean(L, 10);
    memcpy(owner, waiter, 33);
    if (!ml_process_tag(tag)) return ml_pushfail(L, "getrandom failed", 0);
  } else if (!ml_random_owner(owner)) {
    return ml_pushfail(L, "getrandom failed", 0);
  }
  if (!app) app = mongoc_uri_get_appname(c->uri);   /* holder.app: the URI's */
  if (gethostname(host, sizeof host) != 0) host[0] = '\0';
  host[sizeof host - 1] = '\0';
  if (!bson_utf8_validate(host, strlen(host), false)) host[0] = '\0';
  mc = ml_client_get(L, c);
  build_acquire(&cmd, coll, name, namelen, owner, ttl_ms, host, (int64_t)getpid(), app, waiter,
                tag, queue_ms, polling);
  ml_client_append_wc(c, &opts);
  /* reply is initialised by every call; destroyed only before a retry */
  for (attempt = 0;; attempt++) {
    started = ml_monotonic();
    ok = mongoc_client_write_command_with_opts(mc, db, &cmd, &opts, &reply, &err);
    if (ok || err.domain != MONGOC_ERROR_STREAM || attempt == 1) break;
    bson_destroy(&reply);
  }
  bson_destroy(&cmd);
  bson_destroy(&opts);
  if (!ok) {
    /* A write concern error comes after the write was applied: if it took
     * the lock, give it back (best effort; the lease ends at ttl anyway)
     * so that a failed acquire leaves no lock held by nobody. */
    if (find_doc(&reply, "value", &value) && bson_iter_init_find(&it, &value, "owner") &&
        BSON_ITER_HOLDS_UTF8(&it) && strcmp(bson_iter_utf8(&it, NULL), owner) == 0) {
      ml_lease_spec s;
      ml_lease *l;
      bson_value_t id;
      bson_error_t err2;
      id.value_type = BSON_TYPE_UTF8;
      id.value.v_utf8.str = (char *)name;
      id.value.v_utf8.len = (uint32_t)namelen;
      memset(&s, 0, sizeof s);
      s.db = db;
      s.coll = coll;
      s.id = &id;
      s.owner = owner;
      s.ttl_ms = ttl_ms;
      s.queued = 1;
      l = lease_new(&s);
      (void)ml_lease_release(mc, c, l, NULL, &err2);
      ml_lease_unref(l);
    }
    bson_destroy(&reply);
    return ml_pusherror(L, &err);
  }
  if (!find_doc(&reply, "value", &value)) {
    bson_destroy(&reply);
    return ml_pushfail(L, "findAndModify returned no document", 0);
  }
  won = bson_iter_init_find(&it, &value, "owner") && BSON_ITER_HOLDS_UTF8(&it) &&
        strcmp(bson_iter_utf8(&it, NULL), owner) == 0;
  if (won) {
    ml_lease_spec s;
    bson_value_t id;
    int64_t token = 0;
    find_int64(&value, "token", &token);
    id.value_type = BSON_TYPE_UTF8;
    id.value.v_utf8.str = (char *)name;
    id.value.v_utf8.len = (uint32_t)namelen;
    memset(&s, 0, sizeof s);
    s.db = db;
    s.coll = coll;
    s.id = &id;
    s.owner_field = "owner";
    s.time_field = "expiresAt";
    s.time_mode = ML_TIME_EXPIRES_AT;
    s.owner_form = ML_OWNER_HEX;
    s.owner = owner;
    s.token = token;
    s.ttl_ms = ttl_ms;
    s.started = started;
    s.renew = renew;
    s.queued = 1;
    bson_destroy(&reply);
    ml_lock_new(L, 1, &s);
    return 1;
  }
  lua_pushnil(L);
  lua_pushliteral(L, "busy");
  push_busy_info(L, &value, &reply);
  bson_destroy(&reply);
  return 3;
}

/* [-0, +1] a status table from a status/list document */
static void push_status(lua_State *L, const bson_t *doc) {
  bson_iter_t it;
  int64_t v;
  lua_createtable(L, 0, 9);
  if (bson_iter_init_find(&it, doc, "_id") && BSON_ITER_HOLDS_UTF8(&it)) {
    lua_pushstring(L, bson_iter_utf8(&it, NULL));
    lua_setfield(L, -2, "name");
  }
  lua_pushboolean(L, bson_iter_init_find(&it, doc, "held") && bson_iter_as_bool(&it));
  lua_setfield(L, -2, "held");
  if (bson_iter_init_find(&it, doc, "owner") && BSON_ITER_HOLDS_UTF8(&it)) {
    lua_pushstring(L, bson_iter_utf8(&it, NULL));
    lua_setfield(L, -2, "owner");
  }
  if (find_int64(doc, "token", &v)) {
    ml_pushint64(L, v);
    lua_setfield(L, -2, "token");
  }
  if (find_int64(doc, "acquiredAt", &v)) {
    push_date_s(L, v);
    lua_setfield(L, -2, "acquired_at");
  }
  if (find_int64(doc, "expiresAt", &v)) {
    push_date_s(L, v);
    lua_setfield(L, -2, "expires_at");
  }
  if (find_int64(doc, "remainingMs", &v)) {
    lua_pushnumber(L, v > 0 ? (lua_Number)v / 1000.0 : 0);
    lua_setfield(L, -2, "remaining");
  }
  if (find_int64(doc, "waiting", &v)) {
    ml_pushint64(L, v);
    lua_setfield(L, -2, "waiting");
  }
  push_holder(L, doc);
  lua_setfield(L, -2, "holder");
}

/* {$project: {owner, token, acquiredAt, expiresAt, holder,
 *   held: {$and: [{$ne: [{$ifNull: ["$owner", null]}, null]},
 *                 {$gt: ["$expiresAt", "$$NOW"]}]},
 *   remainingMs: {$subtract: ["$expiresAt", "$$NOW"]}}} */
static void append_status_project(bson_t *pipeline, const char *key) {
  bson_t st, p, held, anda, ne, nea, ifn, ifna, gt, gta, rem, rema;
  BSON_APPEND_DOCUMENT_BEGIN(pipeline, key, &st);
  BSON_APPEND_DOCUMENT_BEGIN(&st, "$project", &p);
  BSON_APPEND_INT32(&p, "owner", 1);
  BSON_APPEND_INT32(&p, "token", 1);
  BSON_APPEND_INT32(&p, "acquiredAt", 1);
  BSON_APPEND_INT32(&p, "expiresAt", 1);
  BSON_APPEND_INT32(&p, "holder", 1);
  pthread_once(&k_once, k_init);
  append_all(&p, K.waiting);          /* live queued waiters */
  BSON_APPEND_DOCUMENT_BEGIN(&p, "held", &held);
  BSON_APPEND_ARRAY_BEGIN(&held, "$and", &anda);
  BSON_APPEND_DOCUMENT_BEGIN(&anda, "0", &ne);
  BSON_APPEND_ARRAY_BEGIN(&ne, "$ne", &nea);
  BSON_APPEND_DOCUMENT_BEGIN(&nea, "0", &ifn);
  BSON_APPEND_ARRAY_BEGIN(&ifn, "$ifNull", &ifna);
  BSON_APPEND_UTF8(&ifna, "0", "$owner");
  BSON_APPEND_NULL(&ifna, "1");
  bson_append_array_end(&ifn, &ifna);
  bson_append_document_end(&nea, &ifn);
  BSON_APPEND_NULL(&nea, "1");
  bson_append_array_end(&ne, &nea);
  bson_append_document_end(&anda, &ne);
  BSON_APPEND_DOCUMENT_BEGIN(&anda, "1", &gt);
  BSON_APPEND_ARRAY_BEGIN(&gt, "$gt", &gta);
  BSON_APPEND_UTF8(&gta, "0", "$expiresAt");
  BSON_APPEND_UTF8(&gta, "1", "$$NOW");
  bson_append_array_end(&gt, &gta);
  bson_append_document_end(&anda, &gt);
  bson_append_array_end(&held, &anda);
  bson_append_document_end(&p, &held);
  BSON_APPEND_DOCUMENT_BEGIN(&p, "remainingMs", &rem);
  BSON_APPEND_ARRAY_BEGIN(&rem, "$subtract", &rema);
  BSON_APPEND_UTF8(&rema, "0", "$expiresAt");
  BSON_APPEND_UTF8(&rema, "1", "$$NOW");
  bson_append_array_end(&rem, &rema);
  bson_append_document_end(&p, &rem);
  bson_append_document_end(&st, &p);
  bson_append_document_end(pipeline, &st);
}

/*
 * Runs an aggregate on the primary and pushes an array of status tables:
 * one command when the result fits the first batch.  name == NULL lists the
 * whole collection.  Returns 1 (the array pushed) or 3 (error).
 */
static int run_status(lua_State *L, ml_client *c, const char *db, const char *coll,
                      const char *name, size_t namelen) {
  mongoc_client_t *mc = ml_client_get(L, c);
  mongoc_collection_t *col = mongoc_client_get_collection(mc, db, coll);
  bson_t pipeline = BSON_INITIALIZER, m, mm;
  const bson_t *doc;
  bson_error_t err;
  mongoc_cursor_t *cur;
  lua_Integer n = 0;
  if (name) {
    BSON_APPEND_DOCUMENT_BEGIN(&pipeline, "0", &m);
    BSON_APPEND_DOCUMENT_BEGIN(&m, "$match", &mm);
    bson_append_utf8(&mm, "_id", 3, name, (int)namelen);
    bson_append_document_end(&m, &mm);
    bson_append_document_end(&pipeline, &m);
    append_status_project(&pipeline, "1");
  } else {
    bson_t s, sd;
    append_status_project(&pipeline, "0");
    BSON_APPEND_DOCUMENT_BEGIN(&pipeline, "1", &s);
    BSON_APPEND_DOCUMENT_BEGIN(&s, "$sort", &sd);
    BSON_APPEND_INT32(&sd, "_id", 1);
    bson_append_document_end(&s, &sd);
    bson_append_document_end(&pipeline, &s);
  }
  cur = mongoc_collection_aggregate(col, MONGOC_QUERY_NONE, &pipeline, NULL, NULL);
  bson_destroy(&pipeline);
  lua_newtable(L);
  while (mongoc_cursor_next(cur, &doc)) {
    push_status(L, doc);
    lua_rawseti(L, -2, (int)++n);
  }
  if (mongoc_cursor_error(cur, &err)) {
    mongoc_cursor_destroy(cur);
    mongoc_collection_destroy(col);
    lua_pop(L, 1);
    return ml_pusherror(L, &err);
  }
  mongoc_cursor_destroy(cur);
  mongoc_collection_destroy(col);
  return 1;
}

/* client:status(db, coll, name) -> status | nil (no such lock) |
 * nil, message, code.  One aggregate. */
static int l_status(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  size_t namelen;
  const char *name = arg_name(L, 4, &namelen);
  int r = run_status(L, c, db, coll, name, namelen);
  if (r != 1) return r;
  lua_rawgeti(L, -1, 1);
  return 1;
}

/* client:list(db, coll) -> {status, ...} sorted by name | nil, msg, code */
static int l_list(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  return run_status(L, c, db, coll, NULL, 0);
}

/* client:force_release(db, coll, name) -> true | nil, "not held" |
 * nil, msg, code.  Frees the lock whoever holds it (one update; the
 * document and its token stay). */
static int l_force_release(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  size_t namelen;
  const char *name = arg_name(L, 4, &namelen);
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER, qo, stage, set;
  bson_error_t err;
  int64_t n;
  bson_append_utf8(&q, "_id", 3, name, (int)namelen);
  BSON_APPEND_DOCUMENT_BEGIN(&q, "owner", &qo);
  BSON_APPEND_NULL(&qo, "$ne");
  bson_append_document_end(&q, &qo);
  BSON_APPEND_DOCUMENT_BEGIN(&u, "0", &stage);
  BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
  BSON_APPEND_NULL(&set, "owner");
  BSON_APPEND_UTF8(&set, "expiresAt", "$$NOW");
  pthread_once(&k_once, k_init);
  append_all(&set, K.release_next);
  bson_append_document_end(&stage, &set);
  bson_append_document_end(&u, &stage);
  n = run_update(ml_client_get(L, c), c, db, coll, &q, &u, &err);
  if (n < 0) return ml_pusherror(L, &err);
  if (n == 0) return ml_pushfail(L, "not held", 0);
  lua_pushboolean(L, 1);
  return 1;
}

/*
 * client:leave(db, coll, name, waiter) -> true | nil, msg, code.  An
 * acquire that gives up (timeout, error) takes its place out of the queue;
 * when a release had already been handed to it, the next live waiter gets
 * it instead (an update of next, which wakes that waiter).  One update;
 * nothing changes when waiter is not queued.
 */
static int l_leave(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  size_t namelen;
  const char *name = arg_name(L, 4, &namelen);
  const char *w = arg_waiter(L, 5);
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  bson_error_t err;
  char tag[17];
  subst_vals v = {w, tag, 0, 0};
  if (!ml_process_tag(tag)) return ml_pushfail(L, "getrandom failed", 0);
  pthread_once(&k_once, k_init);
  bson_append_utf8(&q, "_id", 3, name, (int)namelen);
  BSON_APPEND_UTF8(&q, "queue.w", w);
  append_all_with(&u, K.leave, &v);
  if (run_update(ml_client_get(L, c), c, db, coll, &q, &u, &err) < 0)
    return ml_pusherror(L, &err);
  lua_pushboolean(L, 1);
  return 1;
}

/* client:ensure_index(db, coll, expire_after_seconds) -> true |
 * nil, msg, code.  The TTL index on expiresAt (cleanup of idle documents
 * only; correctness never depends on it). */
static int l_ensure_index(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  lua_Integer secs = luaL_checkinteger(L, 4);
  bson_t cmd = BSON_INITIALIZER, idx, one, key, opts = BSON_INITIALIZER, reply;
  bson_error_t err;
  int ok;
  luaL_argcheck(L, secs >= 0 && secs <= INT32_MAX, 4, "expire_after out of range");
  BSON_APPEND_UTF8(&cmd, "createIndexes", coll);
  BSON_APPEND_ARRAY_BEGIN(&cmd, "indexes", &idx);
  BSON_APPEND_DOCUMENT_BEGIN(&idx, "0", &one);
  BSON_APPEND_DOCUMENT_BEGIN(&one, "key", &key);
  BSON_APPEND_INT32(&key, "expiresAt", 1);
  bson_append_document_end(&one, &key);
  BSON_APPEND_UTF8(&one, "name", "expiresAt_ttl");
  BSON_APPEND_INT32(&one, "expireAfterSeconds", (int32_t)secs);
  bson_append_document_end(&idx, &one);
  bson_append_array_end(&cmd, &idx);
  ml_client_append_wc(c, &opts);
  ok = mongoc_client_write_command_with_opts(ml_client_get(L, c), db, &cmd, &opts, &reply, &err);
  bson_destroy(&cmd);
  bson_destroy(&opts);
  bson_destroy(&reply);
  if (!ok) return ml_pusherror(L, &err);
  lua_pushboolean(L, 1);
  return 1;
}

/* client:_delete(db, coll, name) -> number deleted | nil, msg, code.
 * INTERNAL, for tests: deletes a lock document as a person or the TTL
 * monitor would.  Not part of the API. */
static int l_delete(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2);
  const char *coll = arg_ns(L, 3);
  size_t namelen;
  const char *name = arg_name(L, 4, &namelen);
  mongoc_collection_t *col;
  bson_t q = BSON_INITIALIZER, opts = BSON_INITIALIZER, reply;
  bson_error_t err;
  bson_iter_t it;
  int64_t n = 0;
  int ok;
  bson_append_utf8(&q, "_id", 3, name, (int)namelen);
  ml_client_append_wc(c, &opts);
  /* a retryable write, as run_update's */
  col = mongoc_client_get_collection(ml_client_get(L, c), db, coll);
  ok = mongoc_collection_delete_one(col, &q, &opts, &reply, &err);
  if (ok && bson_iter_init_find(&it, &reply, "deletedCount")) n = iter_int64(&it, 0);
  mongoc_collection_destroy(col);
  bson_destroy(&q);
  bson_destroy(&opts);
  bson_destroy(&reply);
  if (!ok) return ml_pusherror(L, &err);
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

/* ---- registration ------------------------------------------------------ */

static const luaL_Reg lock_methods[] = {
  {"release", l_release},
  {"extend", l_extend},
  {"remaining", l_remaining},
  {"held", l_held},
  {"close", l_close},
  {NULL, NULL}
};

static const luaL_Reg client_lock_methods[] = {
  {"acquire", l_acquire},
  {"status", l_status},
  {"list", l_list},
  {"force_release", l_force_release},
  {"leave", l_leave},
  {"ensure_index", l_ensure_index},
  {"_delete", l_delete},
  {NULL, NULL}
};

void ml_lock_open(lua_State *L) {
  /* [module] */
  luaL_newmetatable(L, ML_LOCK_MT);              /* [module, mt] */
  lua_pushliteral(L, "mongolock.Lock");
  lua_setfield(L, -2, "__name");
  lua_pushcfunction(L, l_gc);
  lua_setfield(L, -2, "__gc");
  lua_pushcfunction(L, l_tclose);
  lua_setfield(L, -2, "__close");
  lua_pushcfunction(L, l_tostring);
  lua_setfield(L, -2, "__tostring");
  luaL_newlib(L, lock_methods);                  /* [module, mt, methods] */
  /* the methods table is shared: renew.c and the Lua layer may add to it
   * (mt.__methods, module.Lock) */
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, "__methods");
  lua_pushvalue(L, -1);
  lua_setfield(L, -4, "Lock");
  lua_pushcclosure(L, l_index, 1);               /* [module, mt, index] */
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);                                 /* [module] */

  /* named-lock commands are methods of the client */
  luaL_getmetatable(L, ML_CLIENT_MT);
  lua_getfield(L, -1, "__index");
  luaL_setfuncs(L, client_lock_methods, 0);
  lua_pop(L, 2);
}
