/*
 * The lock protocol (protocol.h): every command on a lock document, built
 * with libbson's BCON, and every reply read.  No lua_State, no I/O: the
 * library, the Lua-visible seam (ops.c) and bench/raw.c build the same
 * bytes here.
 *
 * BCON reads like the JSON of doc/design.md: "{" "}" "[" "]" open and
 * close, a bare string in a value's place is a UTF-8 string, BCON_INT64(n)
 * and friends are typed values.  A fragment used by several commands is a
 * macro of tokens spliced into the call.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "protocol.h"
#include "protocol_shared.h"

/* ---- fragments --------------------------------------------------------- */

/* the queue as an array, its live entries, and its first live watching
 * waiter (tag and id) */
#define QUEUE_ARRAY ML_ARR(ML_F_QUEUE)
#define LIVE_QUEUE ML_LIVE(ML_F_QUEUE)
#define QUEUE_HEAD ML_HEAD_TW(LIVE_QUEUE)

/* the lock is free: no owner, or the lease ended by the server's clock
 * (END: the tokens of the lease end) */
#define FREE(OWNER_REF, ...)                                                       \
  "{", "$or", "[",                                                                 \
    "{", "$eq", "[", "{", "$ifNull", "[", OWNER_REF, BCON_NULL, "]", "}", BCON_NULL, "]", "}", \
    "{", "$lte", "[", __VA_ARGS__, "$$NOW", "]", "}", "]", "}"

/* no share or permit (holders, protocol_shared.h) is live or in its
 * lock-delay (ML_KEEPS): an exclusive holder waits for every one of them */
#define NO_LIVE_HOLDERS                                                            \
  "{", "$eq", "[", "{", "$size", ML_KEEPS("holders"), "}", BCON_INT32(0), "]", "}"

/* an exclusive waiter's queue entry: ML_ENTRY with the lease it asks for
 * (l, ms), its holder document (h) and its lock-delay (d, ms), which a
 * release that grants it the lock writes */
#define GRANTABLE_ENTRY(W, T, Q, P, L, H, K, D)                                   \
  "{", "w", BCON_UTF8(W), "t", BCON_UTF8(T),                                       \
       "until", "{", "$add", "[", "$$NOW", BCON_INT64(Q), "]", "}", "p", BCON_BOOL(P), \
       "l", BCON_INT64(L), "h", "{", "$literal", BCON_DOCUMENT(H), "}",            \
       "k", K, "d", BCON_INT64(D), "}"

void ml_keeper_value(bson_t *doc, bson_iter_t *it, const char *keeper) {
  bson_init(doc);
  if (keeper) BCON_APPEND(doc, "v", BCON_UTF8(keeper));
  else BCON_APPEND(doc, "v", BCON_NULL);
  bson_iter_init_find(it, doc, "v");
}

void ml_delay_value(bson_t *doc, bson_iter_t *it, int64_t delay_ms) {
  bson_init(doc);
  if (delay_ms > 0) BCON_APPEND(doc, "v", BCON_INT64(delay_ms));
  else BCON_APPEND(doc, "v", "$$REMOVE");
  bson_iter_init_find(it, doc, "v");
}

int64_t ml_delay_left(int64_t delay_ms, int has_remaining, int64_t remaining_ms) {
  if (delay_ms <= 0 || !has_remaining || remaining_ms > 0) return 0;
  return remaining_ms + delay_ms > 0 ? remaining_ms + delay_ms : 0;
}

/* the first live watching entry of the queue (an object), null when none:
 * ML_WATCHING(LIVE_QUEUE) in one pass */
#define HEAD_ENTRY                                                                 \
  "{", "$ifNull", "[", "{", "$arrayElemAt", "[",                                   \
    "{", "$filter", "{", "input", QUEUE_ARRAY,                                     \
      "cond", "{", "$and", "[", "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}", \
                              "{", "$ne", "[", "$$this.p", BCON_BOOL(true), "]", "}", "]", "}", \
      "}", "}", BCON_INT32(0), "]", "}", BCON_NULL, "]", "}"

/* the lease of the document has an owner and a holder tag: a write that
 * ends it without its holder (ENDED_BY_OTHER true) names it in lost,
 * LOST_VALUE (holder.t and owner, 48 hex digits) */
#define ENDED_BY_OTHER                                                             \
  "{", "$eq", "[", "{", "$type", "$" ML_F_OWNER, "}", "string", "]", "}",          \
  "{", "$eq", "[", "{", "$type", "$" ML_F_HOLDER ".t", "}", "string", "]", "}"
#define LOST_VALUE "{", "$concat", "[", "$" ML_F_HOLDER ".t", "$" ML_F_OWNER, "]", "}"

/* ---- operations -------------------------------------------------------- */

void ml_op_init(ml_op *op, ml_run_kind kind, const char *db, const char *coll) {
  op->kind = kind;
  op->retry = 0;
  op->db = db;
  op->coll = coll;
  op->session = NULL;
  bson_init(&op->cmd);
}

void ml_op_destroy(ml_op *op) {
  bson_destroy(&op->cmd);
}

void ml_op_update(ml_op *op, const char *db, const char *coll, const bson_t *q, const bson_t *u,
                  int pipeline) {
  ml_op_init(op, ML_RUN_UPDATE, db, coll);
  if (pipeline)
    BCON_APPEND(&op->cmd, "update", BCON_UTF8(coll),
                "updates", "[", "{", "q", BCON_DOCUMENT(q), "u", BCON_ARRAY(u), "}", "]");
  else
    BCON_APPEND(&op->cmd, "update", BCON_UTF8(coll),
                "updates", "[", "{", "q", BCON_DOCUMENT(q), "u", BCON_DOCUMENT(u), "}", "]");
}

/* the _id of r's document */
static void id_iter(const ml_lockref *r, bson_iter_t *it) {
  if (!bson_iter_init_find(it, r->id, "_id")) bson_iter_init(it, r->id);
}

/* {_id, <owner field>: owner}: the filter of every write by a holder */
static void owner_filter(bson_t *q, const ml_lockref *r, const char *owner) {
  bson_iter_t id;
  id_iter(r, &id);
  BCON_APPEND(q, "_id", BCON_ITER(&id));
  ml_append_owner(q, r->owner_field, owner, r->owner_form);
}

void ml_named_ref(ml_lockref *r, const char *db, const char *coll, const bson_t *id) {
  r->db = db;
  r->coll = coll;
  r->id = id;
  r->owner_field = ML_F_OWNER;
  r->time_field = ML_F_EXPIRES;
  r->time_mode = ML_TIME_EXPIRES_AT;
  r->owner_form = ML_OWNER_HEX;
  r->queued = 1;
}

/* "$" field into buf */
static const char *field_ref(char *buf, size_t n, const char *field) {
  snprintf(buf, n, "$%s", field);
  return buf;
}

/* ---- named locks: acquire and try -------------------------------------- */

/* the stage that decides whether this attempt takes the lock (_mlt): it is
 * free and no live watching waiter is queued ahead of W (fw: the first
 * watching entry, me: W's); W is "" for a try, which no entry has */
#define STAGE_TAKES(W)                                                             \
  "$set", "{", "_mlt", "{", "$let", "{",                                          \
    "vars", "{",                                                                   \
      "fw", "{", "$indexOfArray", "[",                                             \
              "{", "$map", "{", "input", "$_mlq",                                  \
                              "in", "{", "$ne", "[", "$$this.p", BCON_BOOL(true), "]", "}", "}", "}", \
              BCON_BOOL(true), "]", "}",                                           \
      "me", "{", "$indexOfArray", "[", "$_mlq.w", BCON_UTF8(W), "]", "}", "}",     \
    "in", "{", "$and", "[",                                                        \
      ML_EXCL_FREE,                                                                \
      NO_LIVE_HOLDERS,                                                             \
      "{", "$or", "[",                                                             \
        "{", "$eq", "[", "$$fw", BCON_INT32(-1), "]", "}",                        \
        "{", "$and", "[", "{", "$ne", "[", "$$me", BCON_INT32(-1), "]", "}",       \
                         "{", "$lte", "[", "$$me", "$$fw", "]", "}", "]", "}", "]", "}", \
      "]", "}", "}", "}", "}"

/* the live shares of the name (readers' shares and permits, the shared
 * kinds' holders array): how many, how many are readers', and a
 * semaphore's N (absent for a reader-writer lock) */
#define SHARE_COUNTS                                                               \
  "holders", "{", "$size", ML_LIVE("holders"), "}",                                \
  "readers", "{", "$size", "{", "$filter", "{", "input", ML_LIVE("holders"),       \
    "cond", "{", "$eq", "[", "$$this.m", "s", "]", "}", "}", "}", "}",             \
  "permits", BCON_INT32(1)

/* what the attempt returns: the lock document's fields, the holder's time
 * left by the server's clock, the queue's length and W's place in it */
#define FIELDS(W)                                                                  \
  ML_F_OWNER, BCON_INT32(1), ML_F_TOKEN, BCON_INT32(1), ML_F_EXPIRES, BCON_INT32(1), \
  ML_F_HOLDER, BCON_INT32(1), ML_F_ACQUIRED, BCON_INT32(1), ML_F_DELAY, BCON_INT32(1), \
  "remainingMs", "{", "$subtract", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}",       \
  "queued", "{", "$size", QUEUE_ARRAY, "}",                                        \
  SHARE_COUNTS,                                                                    \
  "position", "{", "$indexOfArray", "[",                                           \
    "{", "$cond", "[", "{", "$isArray", "$" ML_F_QUEUE, "}", "$" ML_F_QUEUE ".w", "[", "]", "]", "}", \
    BCON_UTF8(W), "]", "}"

/*
 * The hand-over of a named lock, two stages of an update pipeline (keys
 * k and k+1), applied when rel is true: the lock goes to the first live
 * watching waiter of the queue (_mlh) in the same write (its id the owner,
 * a new token, a lease of its own l ms bounded by its entry's until, its
 * holder), out of the queue, and next names it (which routes the event to
 * its process, csrc/binding/watch.c), unless a share or permit is live; with
 * nobody to hand it to, the lock is freed (owner null, expiresAt $$NOW,
 * next null).  When rel is false nothing changes.
 *
 * GRANT_STAGES(K0, K1, IF_R, OK...) spells both stages: IF_R(NEW, OLD) is
 * the value of a field the hand-over frees (NEW when rel holds, else OLD),
 * OK the condition for a grant (no live holders, and rel).  A release's rel is always
 * true (IF_ALWAYS: the values as they are); a leave's is an expression
 * the caller sets as _mlr in a stage before (IF_MLR).  The caller unsets
 * _mlh (and _mlr).
 */
#define IF_ALWAYS(NEW, OLD) NEW
#define IF_MLR(NEW, OLD) "{", "$cond", "[", "$_mlr", NEW, OLD, "]", "}"
#define GRANT_STAGES(K0, K1, IF_R, ...)                                            \
  K0, "{", "$set", "{", "_mlh", "{", "$cond", "[", __VA_ARGS__, HEAD_ENTRY, BCON_NULL, "]", "}", "}", "}", \
  K1, "{", "$set", "{",                                                            \
    ML_F_OWNER, "{", "$cond", "[", "$_mlh", "$_mlh.w", IF_R(BCON_NULL, "$" ML_F_OWNER), "]", "}", \
    ML_F_TOKEN, "{", "$cond", "[", "$_mlh", ML_NEXT_TOKEN, "$" ML_F_TOKEN, "]", "}", \
    ML_F_ACQUIRED, "{", "$cond", "[", "$_mlh", "$$NOW", "$" ML_F_ACQUIRED, "]", "}", \
    ML_F_EXPIRES, "{", "$cond", "[", "$_mlh",                                      \
                    "{", "$min", "[", "{", "$add", "[", "$$NOW", "$_mlh.l", "]", "}", \
                                      "$_mlh.until", "]", "}",                     \
                    IF_R("$$NOW", "$" ML_F_EXPIRES), "]", "}",                     \
    ML_F_HOLDER, "{", "$cond", "[", "$_mlh", "{", "$ifNull", "[", "$_mlh.h", BCON_NULL, "]", "}", \
                    "$" ML_F_HOLDER, "]", "}",                                     \
    /* the live queue without _mlh, in one pass */                                 \
    ML_F_QUEUE, "{", "$cond", "[", "$_mlh",                                        \
                  "{", "$filter", "{", "input", QUEUE_ARRAY,                       \
                    "cond", "{", "$and", "[",                                      \
                      "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}",          \
                      "{", "$ne", "[", "$$this.w", "$_mlh.w", "]", "}", "]", "}", "}", "}", \
                  "$" ML_F_QUEUE, "]", "}",                                        \
    ML_F_NEXT, "{", "$cond", "[", "$_mlh", "{", "$concat", "[", "$_mlh.t", "$_mlh.w", "]", "}", \
                 IF_R(BCON_NULL, "$" ML_F_NEXT), "]", "}",                         \
    ML_F_KEEPER, "{", "$cond", "[", "$_mlh", "{", "$ifNull", "[", "$_mlh.k", BCON_NULL, "]", "}", \
                   IF_R(BCON_NULL, "$" ML_F_KEEPER), "]", "}",                     \
    ML_F_TTL, "{", "$cond", "[", "$_mlh", "$_mlh.l", "$" ML_F_TTL, "]", "}",        \
    ML_F_DELAY, "{", "$cond", "[", "$_mlh",                                        \
                  "{", "$cond", "[", "{", "$gt", "[", "$_mlh.d", BCON_INT64(0), "]", "}", \
                                     "$_mlh.d", "$$REMOVE", "]", "}",              \
                  IF_R("$$REMOVE", "$" ML_F_DELAY), "]", "}",                      \
  "}", "}"

/*
 * A waiter's parts of an acquire that differ from one waiter to the next
 * only by its id (32 hex digits): built once with W_PLACE for the id, then
 * copied and the id written over W_PLACE where it stands (at most
 * WTPL_MAX places; the bytes are those a fresh build gives).
 */
#define W_PLACE "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~"
#define WTPL_MAX 8
typedef struct {
  bson_t *doc;
  uint32_t at[WTPL_MAX];
  int n;
} wtpl;

static void wtpl_init(wtpl *t, bson_t *doc) {
  const uint8_t *d = bson_get_data(doc);
  uint32_t len = doc->len, i;
  t->doc = doc;
  t->n = 0;
  for (i = 0; i + 32 <= len; i++)
    if (!memcmp(d + i, W_PLACE, 32)) {
      if (t->n == WTPL_MAX) abort();      /* a bug in k_init */
      t->at[t->n++] = i;
      i += 31;
    }
  if (t->n == 0) abort();
}

static void wtpl_copy(const wtpl *t, bson_t *dst, const char *w) {
  uint8_t *d;
  int i;
  bson_copy_to(t->doc, dst);
  d = (uint8_t *)bson_get_data(dst);
  for (i = 0; i < t->n; i++) memcpy(d + t->at[i], w, 32);
}

#define OWNED_STAGE(W)                                                             \
  "$set", "{", "_mlo", "{", "$and", "[",                                          \
    "{", "$eq", "[", "$" ML_F_OWNER, BCON_UTF8(W), "]", "}",                       \
    "{", "$gt", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "]", "}", "}"

/*
 * The parts of an acquire that no attempt changes, built once (a try's
 * decision and projection have W = ""): the hot path then appends them as
 * they are.  Never freed: a thread may still build a command at exit.
 */
static struct {
  bson_t *stage0;               /* {$set: {_mlq: LIVE}} */
  bson_t *takes_try;            /* STAGE_TAKES("") */
  bson_t *owned_try;            /* {$set: {_mlo: false}}: a try was granted
                                   nothing */
  bson_t *set;                  /* fields of the $set that are the same for
                                   every attempt: token, acquiredAt, next,
                                   and a try's queue */
  bson_t *stage3;               /* {$unset: [_mlq, _mlt, _mlo]} */
  bson_t *fields_try;           /* FIELDS("") */
  bson_t *release_named;        /* a named lock's release pipeline: it
                                   grants the lock to the queue's first live
                                   watching waiter (GRANT_STAGES) */
  wtpl takes_w, fields_w, owned_w;  /* a waiter's parts, built for W_PLACE */
} K;
static pthread_once_t k_once = PTHREAD_ONCE_INIT;

static void k_init(void) {
  K.stage0 = BCON_NEW("$set", "{", "_mlq", LIVE_QUEUE, "}");
  K.takes_try = BCON_NEW(STAGE_TAKES(""));
  K.owned_try = BCON_NEW("$set", "{", "_mlo", BCON_BOOL(false), "}");
  K.set = BCON_NEW(
    ML_F_TOKEN, ML_IF_TAKEN("$" ML_F_TOKEN, ML_NEXT_TOKEN),
    ML_F_ACQUIRED, ML_IF_TAKEN("$" ML_F_ACQUIRED, "$$NOW"),
    /* a try leaves a queue it did not take from as it was */
    ML_F_QUEUE, ML_IF_TAKEN("$" ML_F_QUEUE, "$_mlq"),
    ML_F_NEXT, ML_IF_TAKEN("$" ML_F_NEXT, BCON_NULL));
  K.stage3 = BCON_NEW("$unset", "[", "_mlq", "_mlt", "_mlo", "]");
  K.fields_try = BCON_NEW(FIELDS(""));
  K.release_named = BCON_NEW(GRANT_STAGES("0", "1", IF_ALWAYS, NO_LIVE_HOLDERS),
                             "2", "{", "$unset", "[", "_mlh", "]", "}");
  wtpl_init(&K.takes_w, BCON_NEW(STAGE_TAKES(W_PLACE)));
  wtpl_init(&K.fields_w, BCON_NEW(FIELDS(W_PLACE)));
  wtpl_init(&K.owned_w, BCON_NEW(OWNED_STAGE(W_PLACE)));
}

/* the field key of a constant part */
static void k_field(const bson_t *part, const char *key, bson_iter_t *it) {
  if (!bson_iter_init_find(it, part, key)) abort();    /* a bug in k_init */
}

int ml_acquire_fresh = 0;

/* a waiter's queue stage (BCON): W the waiter's id, T its tag, A the
 * acquire's arguments, H the holder document, KV an iterator on the keeper
 * value.  Taken or granted: the live queue without W; else W's place kept
 * (until refreshed) or taken at the end */
#define QUEUE_W(W, T, A, H, KV)                                                     \
  ML_F_QUEUE, "{", "$cond", "[", "{", "$or", "[", "$_mlt", "$_mlo", "]", "}",        \
    "{", "$filter", "{", "input", "$_mlq",                                         \
                         "cond", "{", "$ne", "[", "$$this.w", BCON_UTF8(W), "]", "}", "}", "}", \
    "{", "$cond", "[", "{", "$in", "[", BCON_UTF8(W), "$_mlq.w", "]", "}",            \
      "{", "$map", "{", "input", "$_mlq",                                          \
           "in", "{", "$cond", "[", "{", "$eq", "[", "$$this.w", BCON_UTF8(W), "]", "}", \
             GRANTABLE_ENTRY(W, T, (A)->queue_ms, (A)->polling != 0, (A)->ttl_ms, H, BCON_ITER(&KV), \
                             (A)->delay_ms), "$$this", "]", "}", "}", "}",          \
      "{", "$concatArrays", "[", "$_mlq",                                          \
             "[", GRANTABLE_ENTRY(W, T, (A)->queue_ms, (A)->polling != 0, (A)->ttl_ms, H, BCON_ITER(&KV), \
                             (A)->delay_ms), "]", "]", "}",                          \
    "]", "}", "]", "}"

/* a string of an acquire's settings (a cache's key), or null */
static void key_str(bson_t *key, const char *name, const char *s) {
  if (s) BSON_APPEND_UTF8(key, name, s);
  else BSON_APPEND_NULL(key, name);
}

/* does b hold place's 32 bytes (in a value the caller gave: a host, an
 * app, a tag)?  A copy's ids would be written over there too */
static int holds(const uint8_t *b, size_t len, const char *place) {
  size_t i;
  for (i = 0; i + 32 <= len; i++)
    if (b[i] == place[0] && !memcmp(b + i, place, 32)) return 1;
  return 0;
}

/* the queue stage of waiter w, in queue_w (initialised here) */
static void build_queue(bson_t *queue_w, const char *w, const ml_acquire_args *a, const bson_t *holder,
                        const bson_t *kdoc) {
  bson_iter_t kv;
  bson_init(queue_w);
  bson_iter_init_find(&kv, kdoc, "v");
  BCON_APPEND(queue_w, QUEUE_W(w, a->tag, a, holder, kv));
}

/* an acquire's update pipeline (pipe: initialised here) */
static void build_pipe(bson_t *pipe, const ml_acquire_args *a) {
  bson_t holder = BSON_INITIALIZER, takes_w, queue_w, owned_w, kdoc, ddoc;
  const bson_t *takes, *queue, *owned;
  bson_iter_t token, acquired, q, next, kv, dv;
  bson_init(pipe);
  ml_keeper_value(&kdoc, &kv, a->keeper);
  ml_delay_value(&ddoc, &dv, a->delay_ms);
  BCON_APPEND(&holder, "host", BCON_UTF8(a->host), "pid", BCON_INT64(a->pid));
  if (a->app) BCON_APPEND(&holder, "app", BCON_UTF8(a->app));
  if (a->htag) BCON_APPEND(&holder, "t", BCON_UTF8(a->htag));
  if (a->waiter) {
    const char *w = a->waiter;
    /* _mlo: a release already granted the lock to w (its lease still
     * runs): nothing changes but w's place, which the grant took */
    build_queue(&queue_w, w, a, &holder, &kdoc);
    if (strlen(w) == 32 && !ml_acquire_fresh) {   /* a waiter id */
      wtpl_copy(&K.takes_w, &takes_w, w);
      wtpl_copy(&K.owned_w, &owned_w, w);
    } else {
      bson_init(&takes_w);
      bson_init(&owned_w);
      BCON_APPEND(&takes_w, STAGE_TAKES(w));
      BCON_APPEND(&owned_w, OWNED_STAGE(w));
    }
    takes = &takes_w;
    queue = &queue_w;
    owned = &owned_w;
  } else {
    takes = K.takes_try;
    queue = K.set;
    owned = K.owned_try;
  }
  k_field(K.set, ML_F_TOKEN, &token);
  k_field(K.set, ML_F_ACQUIRED, &acquired);
  k_field(queue, ML_F_QUEUE, &q);
  k_field(K.set, ML_F_NEXT, &next);
  /* the update pipeline, its stages keyed "0", "1", ... */
  BCON_APPEND(pipe,
      "0", BCON_DOCUMENT(K.stage0),        /* _mlq: the live queue */
      "1", BCON_DOCUMENT(takes),           /* _mlt: this attempt takes it */
      "2", BCON_DOCUMENT(owned),           /* _mlo: granted to it before */
      /* every field from _mlt: written back unchanged when it is false */
      "3", "{", "$set", "{",
        ML_F_OWNER, ML_IF_TAKEN("$" ML_F_OWNER, BCON_UTF8(a->owner)),
        ML_F_TOKEN, BCON_ITER(&token),
        ML_F_ACQUIRED, BCON_ITER(&acquired),
        ML_F_EXPIRES, ML_IF_TAKEN("$" ML_F_EXPIRES,
                               "{", "$add", "[", "$$NOW", BCON_INT64(a->ttl_ms), "]", "}"),
        ML_F_HOLDER, ML_IF_TAKEN("$" ML_F_HOLDER, "{", "$literal", BCON_DOCUMENT(&holder), "}"),
        ML_F_QUEUE, BCON_ITER(&q),
        ML_F_NEXT, BCON_ITER(&next),
        ML_F_KEEPER, ML_IF_TAKEN("$" ML_F_KEEPER, BCON_ITER(&kv)),
        ML_F_TTL, ML_IF_TAKEN("$" ML_F_TTL, BCON_INT64(a->ttl_ms)),
        ML_F_DELAY, ML_IF_TAKEN("$" ML_F_DELAY, BCON_ITER(&dv)),
        /* an expired lease of another owner taken over: named in lost */
        ML_F_LOST, "{", "$cond", "[", "{", "$and", "[", "$_mlt",
                                       "{", "$ne", "[", "$" ML_F_OWNER, BCON_UTF8(a->owner), "]", "}",
                                       ENDED_BY_OTHER, "]", "}",
                        LOST_VALUE, "$" ML_F_LOST, "]", "}",
      "}", "}");
  /* a campaign's value, published only by the attempt that takes the lock,
   * with the term it was written in (the token the stage before set); an
   * attempt that does not take writes both back as they were (a missing
   * field stays missing) */
  if (a->value)
    BCON_APPEND(pipe,
      "4", "{", "$set", "{",
        ML_F_VALUE, ML_IF_TAKEN("$" ML_F_VALUE, "{", "$literal", BCON_UTF8(a->value), "}"),
        ML_F_VTOKEN, ML_IF_TAKEN("$" ML_F_VTOKEN, "$" ML_F_TOKEN),
      "}", "}");
  BCON_APPEND(pipe, a->value ? "5" : "4", BCON_DOCUMENT(K.stage3));
  bson_destroy(&holder);
  bson_destroy(&kdoc);
  bson_destroy(&ddoc);
  if (a->waiter) {
    bson_destroy(&takes_w);
    bson_destroy(&queue_w);
    bson_destroy(&owned_w);
  }
}


/*
 * The whole pipeline of an acquire differs from one acquire to the next
 * with the same settings only by its waiter's id and its owner's (32 hex
 * digits each).  Each thread keeps the last one it built, for W_PLACE and
 * O_PLACE, with the settings it holds (key), and the places where they
 * stand; the next acquire with those settings copies it and writes its ids
 * over them (a fresh build costs most of an uncontended cycle's client
 * instructions: BCON reads its arguments token by token).
 */
#define O_PLACE "^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^"
#define PTPL_MAX 24
typedef struct {
  bson_t *doc;                  /* the pipeline for W_PLACE and O_PLACE */
  bson_t *key;                  /* the settings it was built with */
  uint32_t at[PTPL_MAX];        /* where an id stands */
  char who[PTPL_MAX];           /* 'w' (the waiter's) or 'o' (the owner's) */
  int n;
} pipe_cache;
static pthread_key_t p_key;
static pthread_once_t p_once = PTHREAD_ONCE_INIT;

static void p_free(void *v) {
  pipe_cache *c = (pipe_cache *)v;
  if (!c) return;
  bson_destroy(c->doc);
  bson_destroy(c->key);
  free(c);
}

static void p_init(void) {
  if (pthread_key_create(&p_key, p_free) != 0) abort();
}

/* the settings of a's pipeline besides its ids, in key (initialised) */
static void pipe_key(bson_t *key, const ml_acquire_args *a) {
  bson_init(key);
  BSON_APPEND_BOOL(key, "w", a->waiter != NULL);
  key_str(key, "t", a->tag);
  BSON_APPEND_INT64(key, "q", a->queue_ms);
  BSON_APPEND_BOOL(key, "p", a->polling != 0);
  BSON_APPEND_INT64(key, "l", a->ttl_ms);
  key_str(key, "host", a->host);
  BSON_APPEND_INT64(key, "pid", a->pid);
  key_str(key, "app", a->app);
  key_str(key, "ht", a->htag);
  key_str(key, "k", a->keeper);
  BSON_APPEND_INT64(key, "d", a->delay_ms);
  key_str(key, "v", a->value);
}

/* a new cache entry for the settings in key, built with the places; NULL
 * when an id stands in more places than it keeps, or out of memory */
static pipe_cache *pipe_new(const ml_acquire_args *a, const bson_t *key) {
  ml_acquire_args b = *a;
  pipe_cache *c = (pipe_cache *)calloc(1, sizeof *c);
  const uint8_t *d;
  uint32_t i;
  if (!c) return NULL;
  if (b.waiter) b.waiter = W_PLACE;
  b.owner = O_PLACE;
  {
    bson_t pipe;
    build_pipe(&pipe, &b);
    c->doc = bson_copy(&pipe);
    bson_destroy(&pipe);
  }
  c->key = bson_copy(key);
  d = bson_get_data(c->doc);
  for (i = 0; i + 32 <= c->doc->len; i++) {
    char who = !memcmp(d + i, W_PLACE, 32) ? 'w' : !memcmp(d + i, O_PLACE, 32) ? 'o' : 0;
    if (!who) continue;
    if (c->n == PTPL_MAX) {
      p_free(c);
      return NULL;
    }
    c->at[c->n] = i;
    c->who[c->n++] = who;
    i += 31;
  }
  return c;
}

/* 1 with a's pipeline in pipe (initialised), copied from this thread's
 * entry (made again when the settings changed); 0 when a's cannot be */
static int pipe_copy(bson_t *pipe, const ml_acquire_args *a) {
  bson_t key;
  pipe_cache *c;
  uint8_t *d;
  int i;
  if (ml_acquire_fresh || !a->owner || strlen(a->owner) != 32 || (a->waiter && strlen(a->waiter) != 32))
    return 0;
  pipe_key(&key, a);
  if (holds(bson_get_data(&key), key.len, W_PLACE) || holds(bson_get_data(&key), key.len, O_PLACE)) {
    bson_destroy(&key);
    return 0;
  }
  pthread_once(&p_once, p_init);
  c = (pipe_cache *)pthread_getspecific(p_key);
  if (!c || c->key->len != key.len || memcmp(bson_get_data(c->key), bson_get_data(&key), key.len)) {
    pipe_cache *n = pipe_new(a, &key);
    if (n && pthread_setspecific(p_key, n) == 0) {
      p_free(c);
      c = n;
    } else {
      p_free(n);
      c = NULL;
    }
  }
  bson_destroy(&key);
  if (!c) return 0;
  bson_copy_to(c->doc, pipe);
  d = (uint8_t *)bson_get_data(pipe);
  for (i = 0; i < c->n; i++) memcpy(d + c->at[i], c->who[i] == 'w' ? a->waiter : a->owner, 32);
  return 1;
}

void ml_build_acquire(ml_op *op, const ml_acquire_args *a) {
  bson_t pipe, fields_w;
  const bson_t *fields;
  pthread_once(&k_once, k_init);
  fields = K.fields_try;
  if (!pipe_copy(&pipe, a)) build_pipe(&pipe, a);
  if (a->waiter) {
    if (strlen(a->waiter) == 32 && !ml_acquire_fresh) {
      wtpl_copy(&K.fields_w, &fields_w, a->waiter);
    } else {
      bson_init(&fields_w);
      BCON_APPEND(&fields_w, FIELDS(a->waiter));
    }
    fields = &fields_w;
  }
  ml_op_init(op, ML_RUN_WRITE, a->db, a->coll);
  op->retry = 1;
  BCON_APPEND(&op->cmd,
    "findAndModify", BCON_UTF8(a->coll),
    "query", "{", "_id", BCON_UTF8(a->name), "}",
    "upsert", BCON_BOOL(true), "new", BCON_BOOL(true),
    "update", BCON_ARRAY(&pipe),
    "fields", BCON_DOCUMENT(fields));
  bson_destroy(&pipe);
  if (a->waiter) bson_destroy(&fields_w);
}

/* ---- document locks: acquire ------------------------------------------- */

/*
 * [ {$replaceWith: {$cond: [ONLY_ID, {$mergeObjects: [{$literal: INSERT},
 *                                                     {_id: "$_id"}]},
 *                           "$$ROOT"]}},                 (insert only)
 *   {$set: {O: {$cond: [FREE, OWNER, "$O"]},
 *           T: {$cond: [FREE, TIME,  "$T"]}}} ]
 * upsert: INSERT given, new: true,
 * fields: {_id: 0, doc: "$$ROOT", remainingMs: END - $$NOW}
 *
 *   expires-at mode: END = T; TIME = $$NOW + ttl
 *   locked-at mode:  END = T + ttl; TIME = $$NOW
 */
void ml_build_doc_acquire(ml_op *op, const ml_lockref *r, const char *owner, int64_t ttl_ms,
                          const bson_t *insert) {
  char oref[300], tref[300];
  bson_t end = BSON_INITIALIZER, vals = BSON_INITIALIZER, u = BSON_INITIALIZER;
  bson_iter_t id, e, free_, time_, own;
  field_ref(oref, sizeof oref, r->owner_field);
  field_ref(tref, sizeof tref, r->time_field);
  /* the parts that depend on the time mode and the owner's form */
  if (r->time_mode == ML_TIME_EXPIRES_AT)
    BCON_APPEND(&end, "end", BCON_UTF8(tref));
  else
    BCON_APPEND(&end, "end", "{", "$add", "[", BCON_UTF8(tref), BCON_INT64(ttl_ms), "]", "}");
  bson_iter_init_find(&e, &end, "end");
  BCON_APPEND(&vals, "free", FREE(BCON_UTF8(oref), BCON_ITER(&e)));
  if (r->time_mode == ML_TIME_EXPIRES_AT)
    BCON_APPEND(&vals, "time", "{", "$add", "[", "$$NOW", BCON_INT64(ttl_ms), "]", "}");
  else
    BCON_APPEND(&vals, "time", "$$NOW");
  ml_append_owner(&vals, "owner", owner, r->owner_form);
  bson_iter_init_find(&free_, &vals, "free");
  bson_iter_init_find(&time_, &vals, "time");
  bson_iter_init_find(&own, &vals, "owner");
  id_iter(r, &id);

  /* the pipeline: its stages under "0", "1" */
  if (insert)
    BCON_APPEND(&u,
      "0", "{", "$replaceWith", "{", "$cond", "[",
        "{", "$eq", "[", "{", "$size", "{", "$objectToArray", "$$ROOT", "}", "}", BCON_INT32(1), "]", "}",
        "{", "$mergeObjects", "[", "{", "$literal", BCON_DOCUMENT(insert), "}",
                                   "{", "_id", "$_id", "}", "]", "}",
        "$$ROOT", "]", "}", "}");
  BCON_APPEND(&u,
    insert ? "1" : "0", "{", "$set", "{",
      r->owner_field, "{", "$cond", "[", BCON_ITER(&free_), BCON_ITER(&own), BCON_UTF8(oref), "]", "}",
      r->time_field, "{", "$cond", "[", BCON_ITER(&free_), BCON_ITER(&time_), BCON_UTF8(tref), "]", "}",
    "}", "}");
  ml_op_init(op, ML_RUN_WRITE, r->db, r->coll);
  op->retry = 1;
  BCON_APPEND(&op->cmd,
    "findAndModify", BCON_UTF8(r->coll),
    "query", "{", "_id", BCON_ITER(&id), "}",
    "update", BCON_ARRAY(&u),
    "new", BCON_BOOL(true),
    "upsert", BCON_BOOL(insert != NULL),
    "fields", "{", "_id", BCON_INT32(0), "doc", "$$ROOT",
                   "remainingMs", "{", "$subtract", "[", BCON_ITER(&e), "$$NOW", "]", "}", "}");
  bson_destroy(&u);
  bson_destroy(&vals);
  bson_destroy(&end);
}

/* ---- release, extend, force release, leave ----------------------------- */

/* a named lock's: grant_stages; else [{$set: {O: null, T: "$$NOW" | null}}]
 * (as a document with keys "0", ...) */
static void release_pipeline(bson_t *u, const ml_lockref *r) {
  pthread_once(&k_once, k_init);
  if (r->queued) bson_concat(u, K.release_named);   /* a named lock's */
  else if (r->time_mode == ML_TIME_EXPIRES_AT)
    BCON_APPEND(u, "0", "{", "$set", "{", r->owner_field, BCON_NULL, r->time_field, "$$NOW", "}", "}");
  else
    BCON_APPEND(u, "0", "{", "$set", "{", r->owner_field, BCON_NULL, r->time_field, BCON_NULL,
                "}", "}");
}

/* is this operator of a caller's update one the unlock also uses? */
static int merges(const char *key) {
  return !strcmp(key, "$set") || !strcmp(key, "$currentDate");
}

/* appends every field of the document at extra[key] (if any) */
static void append_fields_of(bson_t *dst, bcon_append_ctx_t *ctx, const bson_t *extra,
                             const char *key) {
  bson_iter_t it, sub;
  if (bson_iter_init_find(&it, extra, key) && BSON_ITER_HOLDS_DOCUMENT(&it) &&
      bson_iter_recurse(&it, &sub))
    while (bson_iter_next(&sub)) BCON_APPEND_CTX(dst, ctx, bson_iter_key(&sub), BCON_ITER(&sub));
}

/* operator form: extra's operators, with the unlock merged into $set (and
 * into $currentDate for the server's now) */
static void release_operators(bson_t *u, const ml_lockref *r, const bson_t *extra) {
  bcon_append_ctx_t ctx;
  bson_iter_t it;
  bcon_append_ctx_init(&ctx);
  BCON_APPEND_CTX(u, &ctx, "$set", "{");
  append_fields_of(u, &ctx, extra, "$set");
  BCON_APPEND_CTX(u, &ctx, r->owner_field, BCON_NULL);
  if (r->time_mode == ML_TIME_LOCKED_AT) BCON_APPEND_CTX(u, &ctx, r->time_field, BCON_NULL);
  BCON_APPEND_CTX(u, &ctx, "}");
  if (r->time_mode == ML_TIME_EXPIRES_AT || bson_has_field(extra, "$currentDate")) {
    BCON_APPEND_CTX(u, &ctx, "$currentDate", "{");
    if (r->time_mode == ML_TIME_EXPIRES_AT)
      BCON_APPEND_CTX(u, &ctx, r->time_field, BCON_BOOL(true));
    append_fields_of(u, &ctx, extra, "$currentDate");
    BCON_APPEND_CTX(u, &ctx, "}");
  }
  if (bson_iter_init(&it, extra))
    while (bson_iter_next(&it))
      if (!merges(bson_iter_key(&it))) BCON_APPEND_CTX(u, &ctx, bson_iter_key(&it), BCON_ITER(&it));
}

void ml_build_release(ml_op *op, const ml_lockref *r, const char *owner, const bson_t *extra) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  owner_filter(&q, r, owner);
  if (extra) release_operators(&u, r, extra);
  else release_pipeline(&u, r);
  ml_op_update(op, r->db, r->coll, &q, &u, extra == NULL);
  bson_destroy(&q);
  bson_destroy(&u);
}

/* appends to q: r's lease is still live by the server's clock ($expr) */
static void live_filter(bson_t *q, const ml_lockref *r, int64_t ttl_ms) {
  char tref[300];
  field_ref(tref, sizeof tref, r->time_field);
  if (r->time_mode == ML_TIME_EXPIRES_AT)
    BCON_APPEND(q, "$expr", "{", "$gt", "[", BCON_UTF8(tref), "$$NOW", "]", "}");
  else
    BCON_APPEND(q, "$expr", "{", "$gt", "[", "{", "$add", "[", BCON_UTF8(tref), BCON_INT64(ttl_ms),
                "]", "}", "$$NOW", "]", "}");
}

/* the update of a renewal or extend: the lease's end (or lock time) moved
 * to the server's now; a named lock's ttl field set to the new length */
static void extend_update(bson_t *u, const ml_lockref *r, int64_t ttl_ms) {
  if (r->time_mode == ML_TIME_LOCKED_AT)
    BCON_APPEND(u, "0", "{", "$set", "{", r->time_field, "$$NOW", "}", "}");
  else if (r->queued)
    BCON_APPEND(u, "0", "{", "$set", "{",
                r->time_field, "{", "$add", "[", "$$NOW", BCON_INT64(ttl_ms), "]", "}",
                ML_F_TTL, BCON_INT64(ttl_ms), "}", "}");
  else
    BCON_APPEND(u, "0", "{", "$set", "{",
                r->time_field, "{", "$add", "[", "$$NOW", BCON_INT64(ttl_ms), "]", "}", "}", "}");
}

/* only a live lease of owner: an extend that arrives after the lease's end
 * (a frozen client, a slow network) never brings it back */
void ml_build_extend(ml_op *op, const ml_lockref *r, const char *owner, int64_t ttl_ms) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  owner_filter(&q, r, owner);
  live_filter(&q, r, ttl_ms);
  extend_update(&u, r, ttl_ms);
  ml_op_update(op, r->db, r->coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

/* ---- renewal in batches ------------------------------------------------ */

/* the live exclusive lease of keeper K */
#define KEEPS_OWNER(K)                                                             \
  "{", "$and", "[", "{", "$eq", "[", "$" ML_F_KEEPER, BCON_UTF8(K), "]", "}",      \
                    "{", "$gt", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "]", "}"
/* the live holders' entries of keeper K */
#define KEPT_HOLDERS(K)                                                            \
  "{", "$filter", "{", "input", ML_ARR(ML_F_HOLDERS),                              \
    "cond", "{", "$and", "[", "{", "$eq", "[", "$$this.k", BCON_UTF8(K), "]", "}",  \
                             "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}", "]", "}", "}", "}"
/* documents keeper K has a lease in (live or not) */
#define KEEPER_DOCS(K)                                                             \
  "$or", "[", "{", ML_F_KEEPER, BCON_UTF8(K), "}", "{", ML_F_HOLDERS ".k", BCON_UTF8(K), "}", "]"

void ml_build_renew(ml_op *op, const char *db, const char *coll, const char *keeper) {
  ml_op_init(op, ML_RUN_UPDATE, db, coll);
  BCON_APPEND(&op->cmd, "update", BCON_UTF8(coll), "updates", "[", "{",
    "q", "{", KEEPER_DOCS(keeper),
              "$expr", "{", "$or", "[", KEEPS_OWNER(keeper),
                "{", "$gt", "[", "{", "$size", KEPT_HOLDERS(keeper), "}", BCON_INT32(0), "]", "}",
              "]", "}", "}",
    "u", "[",
      "{", "$set", "{",
        ML_F_HOLDERS, "{", "$map", "{", "input", ML_ARR(ML_F_HOLDERS),
          "in", "{", "$cond", "[",
            "{", "$and", "[", "{", "$eq", "[", "$$this.k", BCON_UTF8(keeper), "]", "}",
                             "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}", "]", "}",
            "{", "$mergeObjects", "[", "$$this",
              "{", "until", "{", "$add", "[", "$$NOW", "$$this.l", "]", "}", "}", "]", "}",
            "$$this", "]", "}", "}", "}",
        ML_F_EXPIRES, "{", "$cond", "[", KEEPS_OWNER(keeper),
                        "{", "$add", "[", "$$NOW", "$" ML_F_TTL, "]", "}", "$" ML_F_EXPIRES, "]", "}",
      "}", "}",
      /* the lease end the TTL index reads covers every share */
      "{", "$set", "{", ML_F_EXPIRES, "{", "$max", "[", "$" ML_F_EXPIRES,
                                        "{", "$max", "$" ML_F_HOLDERS ".until", "}", "]", "}", "}", "}",
    "]",
    "multi", BCON_BOOL(true), "}", "]");
}

void ml_build_renew_check(ml_op *op, const char *db, const char *coll, const char *keeper) {
  ml_op_init(op, ML_RUN_CURSOR, db, coll);
  BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll), "pipeline", "[",
    "{", "$match", "{", KEEPER_DOCS(keeper), "}", "}",
    "{", "$project", "{", "_id", BCON_INT32(0),
      "o", "{", "$cond", "[", KEEPS_OWNER(keeper), "$" ML_F_OWNER, BCON_NULL, "]", "}",
      "h", "{", "$map", "{", "input", KEPT_HOLDERS(keeper), "in", "$$this.o", "}", "}", "}", "}",
    "]", "cursor", "{", "}");
}

/* calls fn(owner, arg) for each owner a check's reply names */
static void check_owners(const bson_t *reply, void (*fn)(const char *, void *), void *arg) {
  bson_iter_t docs, d, h;
  if (!ml_reply_batch(reply, &docs, NULL)) return;
  while (bson_iter_next(&docs)) {
    if (!BSON_ITER_HOLDS_DOCUMENT(&docs) || !bson_iter_recurse(&docs, &d)) continue;
    while (bson_iter_next(&d)) {
      if (!strcmp(bson_iter_key(&d), "o") && BSON_ITER_HOLDS_UTF8(&d)) fn(bson_iter_utf8(&d, NULL), arg);
      if (!strcmp(bson_iter_key(&d), "h") && BSON_ITER_HOLDS_ARRAY(&d) && bson_iter_recurse(&d, &h))
        while (bson_iter_next(&h))
          if (BSON_ITER_HOLDS_UTF8(&h)) fn(bson_iter_utf8(&h, NULL), arg);
    }
  }
}

static void count_owner(const char *owner, void *arg) {
  (void)owner;
  ((ml_owners *)arg)->n++;
}

static void put_owner(const char *owner, void *arg) {
  ml_owners *s = (ml_owners *)arg;
  s->v[s->n++] = owner;
}

static int cmp_owner(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int ml_parse_check(const bson_t *reply, ml_owners *s) {
  size_t n;
  s->v = NULL;
  s->n = 0;
  check_owners(reply, count_owner, s);
  n = s->n;
  s->n = 0;
  if (!n) return 1;
  s->v = (const char **)malloc(n * sizeof *s->v);
  if (!s->v) return 0;
  check_owners(reply, put_owner, s);
  qsort(s->v, s->n, sizeof *s->v, cmp_owner);
  return 1;
}

int ml_owners_has(const ml_owners *s, const char *owner) {
  return s->n && bsearch(&owner, s->v, s->n, sizeof *s->v, cmp_owner) != NULL;
}

void ml_owners_free(ml_owners *s) {
  free(s->v);
  s->v = NULL;
  s->n = 0;
}

void ml_pairs_filter(bson_t *q, const char *owner_field, ml_owner_form form, const bson_t *ids,
                     const char *const *owners, size_t n) {
  bson_t in, os;
  size_t i;
  BCON_APPEND(q, "_id", "{", "$in", BCON_ARRAY(ids), "}");
  BSON_APPEND_DOCUMENT_BEGIN(q, owner_field, &in);
  BSON_APPEND_ARRAY_BEGIN(&in, "$in", &os);
  for (i = 0; i < n; i++) {
    char k[24];
    const char *key;
    bson_uint32_to_string((uint32_t)i, &key, k, sizeof k);
    ml_append_owner(&os, key, owners[i], form);
  }
  bson_append_array_end(&in, &os);
  bson_append_document_end(q, &in);
}

void ml_build_release_many(ml_op *op, const ml_lockref *r, const bson_t *ids,
                           const char *const *owners, size_t n) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  ml_pairs_filter(&q, r->owner_field, r->owner_form, ids, owners, n);
  release_pipeline(&u, r);
  ml_op_init(op, ML_RUN_UPDATE, r->db, r->coll);
  BCON_APPEND(&op->cmd, "update", BCON_UTF8(r->coll), "updates", "[", "{",
              "q", BCON_DOCUMENT(&q), "u", BCON_ARRAY(&u), "multi", BCON_BOOL(true), "}", "]");
  bson_destroy(&q);
  bson_destroy(&u);
}

void ml_build_doc_renew(ml_op *op, const ml_lockref *r, const bson_t *ids, const char *const *owners,
                        size_t n, int64_t ttl_ms) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  ml_pairs_filter(&q, r->owner_field, r->owner_form, ids, owners, n);
  live_filter(&q, r, ttl_ms);
  extend_update(&u, r, ttl_ms);
  ml_op_init(op, ML_RUN_UPDATE, r->db, r->coll);
  BCON_APPEND(&op->cmd, "update", BCON_UTF8(r->coll), "updates", "[", "{",
              "q", BCON_DOCUMENT(&q), "u", BCON_ARRAY(&u), "multi", BCON_BOOL(true), "}", "]");
  bson_destroy(&q);
  bson_destroy(&u);
}

/*
 * Frees the lock whoever holds it: a release filtered on any owner.  Its
 * first stage names the lease it ends in lost (its holder's stream then
 * passes the event, csrc/binding/watch.c).  A lease with a lock-delay
 * (ML_F_DELAY) that has not run out ends without its holder's consent:
 * owner, keeper and next null, the lease's end now (or when it ended), the
 * delay kept, no grant (_mlr false: GRANT_STAGES writes nothing), so that
 * nobody takes the name before the delay after that end; its event wakes
 * the waiters, whose attempts are told when.
 */
void ml_build_force_release(ml_op *op, const char *db, const char *coll, const char *name) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  BCON_APPEND(&q, "_id", BCON_UTF8(name), ML_F_OWNER, "{", "$ne", BCON_NULL, "}");
  BCON_APPEND(&u,
    "0", "{", "$set", "{", ML_F_LOST, "{", "$cond", "[", "{", "$and", "[", ENDED_BY_OTHER, "]", "}",
                                          LOST_VALUE, "$" ML_F_LOST, "]", "}", "}", "}",
    "1", "{", "$set", "{", "_mlr", "{", "$not", "[", "{", "$and", "[",
      "{", "$gt", "[", "{", "$ifNull", "[", "$" ML_F_DELAY, BCON_INT64(0), "]", "}", BCON_INT64(0), "]", "}",
      "{", "$gt", "[", "{", "$add", "[", "$" ML_F_EXPIRES, "$" ML_F_DELAY, "]", "}", "$$NOW", "]", "}",
      "]", "}", "]", "}", "}", "}",
    GRANT_STAGES("2", "3", IF_MLR, "{", "$and", "[", "$_mlr", NO_LIVE_HOLDERS, "]", "}"),
    "4", "{", "$set", "{",
      ML_F_OWNER, "{", "$cond", "[", "$_mlr", "$" ML_F_OWNER, BCON_NULL, "]", "}",
      ML_F_KEEPER, "{", "$cond", "[", "$_mlr", "$" ML_F_KEEPER, BCON_NULL, "]", "}",
      ML_F_NEXT, "{", "$cond", "[", "$_mlr", "$" ML_F_NEXT, BCON_NULL, "]", "}",
      ML_F_EXPIRES, "{", "$cond", "[", "$_mlr", "$" ML_F_EXPIRES,
                      "{", "$min", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "]", "}", "}", "}",
    "5", "{", "$unset", "[", "_mlr", "_mlh", "]", "}");
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

/* out of the queue; a lock already granted to the waiter (owner), or a
 * release handed to it (next names it), goes to the next live waiter */
void ml_leave_stages(bson_t *u, const char *queue, const char *waiter, const char *tag,
                     const bson_t *handed_on) {
  char tw[64], path[32];
  bson_iter_t on;
  bson_snprintf(tw, sizeof tw, "%s%s", tag, waiter);
  bson_snprintf(path, sizeof path, "$%s", queue);
  bson_iter_init_find(&on, handed_on, "on");
  /* the waiter out of the live entries of the queue (ML_LIVE, with the
   * field named at run time) */
  BCON_APPEND(u,
    "0", "{", "$set", "{", queue, "{", "$filter", "{",
      "input", "{", "$filter", "{",
        "input", "{", "$cond", "[", "{", "$isArray", path, "}", path, "[", "]", "]", "}",
        "cond", "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}", "}", "}",
      "cond", "{", "$ne", "[", "$$this.w", BCON_UTF8(waiter), "]", "}", "}", "}", "}", "}",
    "1", "{", "$set", "{", ML_F_NEXT, "{", "$cond", "[",
           "{", "$eq", "[", "$" ML_F_NEXT, BCON_UTF8(tw), "]", "}", BCON_ITER(&on), "$" ML_F_NEXT,
           "]", "}", "}", "}");
}

void ml_build_leave(ml_op *op, const char *db, const char *coll, const char *name,
                    const char *waiter, const char *tag) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER, on = BSON_INITIALIZER;
  BCON_APPEND(&q, "_id", BCON_UTF8(name),
              "$or", "[", "{", ML_F_QUEUE ".w", BCON_UTF8(waiter), "}",
                          "{", ML_F_OWNER, BCON_UTF8(waiter), "}", "]");
  BCON_APPEND(&on, "on", QUEUE_HEAD);
  ml_leave_stages(&u, ML_F_QUEUE, waiter, tag, &on);
  bson_destroy(&on);
  /* a lock already granted to the waiter goes on to the next one */
  BCON_APPEND(&u,
    "2", "{", "$set", "{", "_mlr", "{", "$eq", "[", "$" ML_F_OWNER, BCON_UTF8(waiter), "]", "}", "}", "}",
    GRANT_STAGES("3", "4", IF_MLR, "{", "$and", "[", "$_mlr", NO_LIVE_HOLDERS, "]", "}"),
    "5", "{", "$unset", "[", "_mlr", "_mlh", "]", "}");
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

/* ---- elections (protocol.h) ------------------------------------------- */

void ml_build_proclaim(ml_op *op, const char *db, const char *coll, const char *name,
                       const char *owner, const char *value) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  BCON_APPEND(&q, "_id", BCON_UTF8(name), ML_F_OWNER, BCON_UTF8(owner),
              "$expr", "{", "$gt", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}");
  BCON_APPEND(&u, "0", "{", "$set", "{", ML_F_VALUE, "{", "$literal", BCON_UTF8(value), "}",
                                        ML_F_VTOKEN, "$" ML_F_TOKEN, "}", "}");
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

void ml_build_leader(ml_op *op, const char *db, const char *coll, const char *name) {
  ml_op_init(op, ML_RUN_COMMAND, db, coll);
  BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
    "pipeline", "[",
      "{", "$match", "{", "_id", BCON_UTF8(name), "}", "}",
      "{", "$project", "{",
        ML_F_OWNER, BCON_INT32(1), ML_F_TOKEN, BCON_INT32(1), ML_F_VALUE, BCON_INT32(1),
        ML_F_VTOKEN, BCON_INT32(1), ML_F_HOLDER, BCON_INT32(1), ML_F_ACQUIRED, BCON_INT32(1),
        ML_F_EXPIRES, BCON_INT32(1), ML_F_TTL, BCON_INT32(1),
        "held", "{", "$and", "[",
          "{", "$ne", "[", "{", "$ifNull", "[", "$" ML_F_OWNER, BCON_NULL, "]", "}", BCON_NULL, "]", "}",
          "{", "$gt", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "]", "}",
        "remainingMs", "{", "$subtract", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "}", "}",
    "]",
    "cursor", "{", "}");
}

void ml_build_observe(ml_op *op, const char *db, const char *coll, const char *name,
                      uint32_t t, uint32_t i, const bson_t *resume_token) {
  bson_t start = BSON_INITIALIZER;
  ml_build_watch_start(&start, t, i, resume_token);
  ml_op_init(op, ML_RUN_COMMAND, db, coll);
  BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
    "pipeline", "[",
      "{", "$changeStream", BCON_DOCUMENT(&start), "}",
      "{", "$match", "{", "$or", "[",
        "{", "documentKey._id", BCON_UTF8(name), "}",
        "{", "operationType", "{", "$in", "[", "drop", "rename", "dropDatabase", "invalidate", "]", "}", "}",
      "]", "}", "}",
    "]",
    "cursor", "{", "}");
  bson_destroy(&start);
}

const char *ml_check_value(const char *s, size_t len) {
  if (len > ML_VALUE_MAX) return "value longer than 16384 bytes";
  if (memchr(s, '\0', len)) return "value contains a NUL byte";
  if (!bson_utf8_validate(s, len, false)) return "value is not valid UTF-8";
  return NULL;
}

/* ---- status, list, the TTL index --------------------------------------- */

#define STATUS_PROJECT                                                             \
  "{", "$project", "{",                                                            \
    ML_F_OWNER, BCON_INT32(1), ML_F_TOKEN, BCON_INT32(1), ML_F_ACQUIRED, BCON_INT32(1), \
    ML_F_EXPIRES, BCON_INT32(1), ML_F_HOLDER, BCON_INT32(1), ML_F_DELAY, BCON_INT32(1), \
    "waiting", "{", "$size", LIVE_QUEUE, "}", SHARE_COUNTS,                        \
    "held", "{", "$and", "[",                                                      \
      "{", "$ne", "[", "{", "$ifNull", "[", "$" ML_F_OWNER, BCON_NULL, "]", "}", BCON_NULL, "]", "}", \
      "{", "$gt", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "]", "}",             \
    "remainingMs", "{", "$subtract", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "}", "}"

/* status reads see what a majority of the replica set has: an acquisition
 * a failover may still roll back is not reported as held (mongod takes it
 * as "local" on a standalone, where every write is committed) */
#define READ_MAJORITY "readConcern", "{", "level", "majority", "}"

void ml_build_status(ml_op *op, const char *db, const char *coll, const char *name) {
  ml_op_init(op, ML_RUN_CURSOR, db, coll);
  if (name)
    BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
                "pipeline", "[", "{", "$match", "{", "_id", BCON_UTF8(name), "}", "}",
                                 STATUS_PROJECT, "]",
                "cursor", "{", "}", READ_MAJORITY);
  else
    BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
                "pipeline", "[", STATUS_PROJECT,
                                 "{", "$sort", "{", "_id", BCON_INT32(1), "}", "}", "]",
                "cursor", "{", "}", READ_MAJORITY);
}

void ml_build_doc_status(ml_op *op, const ml_lockref *r, int64_t ttl_ms) {
  char oref[300], tref[300];
  bson_iter_t id;
  id_iter(r, &id);
  field_ref(oref, sizeof oref, r->owner_field);
  field_ref(tref, sizeof tref, r->time_field);
  ml_op_init(op, ML_RUN_CURSOR, r->db, r->coll);
  if (r->time_mode == ML_TIME_EXPIRES_AT)
    BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(r->coll),
                "pipeline", "[", "{", "$match", "{", "_id", BCON_ITER(&id), "}", "}",
                  "{", "$project", "{", "_id", BCON_INT32(0), "owner", BCON_UTF8(oref),
                    "remainingMs", "{", "$subtract", "[", BCON_UTF8(tref), "$$NOW", "]", "}",
                  "}", "}", "]",
                "cursor", "{", "}", READ_MAJORITY);
  else
    BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(r->coll),
                "pipeline", "[", "{", "$match", "{", "_id", BCON_ITER(&id), "}", "}",
                  "{", "$project", "{", "_id", BCON_INT32(0), "owner", BCON_UTF8(oref),
                    "remainingMs", "{", "$subtract", "[",
                      "{", "$add", "[", BCON_UTF8(tref), BCON_INT64(ttl_ms), "]", "}", "$$NOW",
                    "]", "}",
                  "}", "}", "]",
                "cursor", "{", "}", READ_MAJORITY);
}

void ml_build_ensure_index(ml_op *op, const char *db, const char *coll, int32_t expire_after) {
  ml_op_init(op, ML_RUN_WRITE, db, coll);
  BCON_APPEND(&op->cmd, "createIndexes", BCON_UTF8(coll),
              "indexes", "[", "{", "key", "{", ML_F_EXPIRES, BCON_INT32(1), "}",
                                   "name", ML_TTL_INDEX,
                                   "expireAfterSeconds", BCON_INT32(expire_after), "}", "]");
}

void ml_build_command(ml_op *op, const char *db, const bson_t *cmd, const bson_t *opts) {
  ml_op_init(op, ML_RUN_COMMAND, db, NULL);
  bson_concat(&op->cmd, cmd);
  if (opts) bson_concat(&op->cmd, opts);
}

/* ---- change streams ---------------------------------------------------- */

/*
 * Appends to the $or array (as a document with keys "0", "1", ...; *n is
 * the next index) the clauses that pass a release in an event of type
 * optype, whose new values are under prefix
 * ("updateDescription.updatedFields" for an update, "fullDocument" for a
 * replace):
 *   owner null and next null: a release handed to nobody, for every waiter;
 *   next starting with this process's tag: for one waiter of this process
 *   (in an update, next alone may change: a waiter that gave up hands on),
 *   whether the write freed the lock or granted it to that waiter (owner
 *   its id).
 * For every waiter, an update's owner must be among the updated fields
 * (set to null); a replace's new document must have it null or missing.
 */
static void release_clauses(bson_t *or_, int *n, const char *field, const char *tag,
                            const char *optype, const char *prefix) {
  char owner[300], next[300], re[24], k0[12], k1[12];
  bson_snprintf(owner, sizeof owner, "%s.%s", prefix, field);
  bson_snprintf(next, sizeof next, "%s.%s", prefix, ML_F_NEXT);
  bson_snprintf(re, sizeof re, "^%s", tag);
  bson_snprintf(k0, sizeof k0, "%d", (*n)++);
  bson_snprintf(k1, sizeof k1, "%d", (*n)++);
  if (!strcmp(optype, "update"))
    BCON_APPEND(or_,
      k0, "{", "operationType", optype, owner, "{", "$type", "null", "}", next, BCON_NULL, "}",
      k1, "{", "operationType", optype, next, BCON_REGEX(re, ""), "}");
  else
    BCON_APPEND(or_,
      k0, "{", "operationType", optype, owner, BCON_NULL, next, BCON_NULL, "}",
      k1, "{", "operationType", optype, next, BCON_REGEX(re, ""), "}");
}

/*
 * The parts of an event that ml_parse_event reads, for the stream's
 * $project: a granting release's event would otherwise carry the diff of
 * the whole queue (its update description) to the waiter, which reads five
 * fields of it.  _id (the resume token) stays, as a change stream needs.
 */
static void event_fields(bson_t *keep, const char *field) {
  static const char *const prefixes[] = {"updateDescription.updatedFields.", "fullDocument."};
  const char *names[] = {field, ML_F_OWNER, ML_F_NEXT, ML_F_TOKEN, ML_F_ACQUIRED, ML_F_EXPIRES,
                         ML_F_LOST};
  char path[300];
  size_t p, i, j;
  BCON_APPEND(keep, "operationType", BCON_INT32(1), "clusterTime", BCON_INT32(1),
              "documentKey", BCON_INT32(1), "updateDescription.removedFields", BCON_INT32(1));
  for (p = 0; p < 2; p++)
    for (i = 0; i < sizeof names / sizeof names[0]; i++) {
      for (j = 0; j < i && strcmp(names[j], names[i]) != 0; j++) {}
      if (j < i) continue;      /* the owner field may be one of the others */
      bson_snprintf(path, sizeof path, "%s%s", prefixes[p], names[i]);
      BSON_APPEND_INT32(keep, path, 1);
    }
}

void ml_build_watch_pipeline(bson_t *out, const char *field, const char *tag) {
  bson_t or_ = BSON_INITIALIZER, keep;
  int n = 1;
  /* the document went away, or the stream ends */
  BCON_APPEND(&or_, "0", "{", "operationType", "{", "$in", "[",
              "delete", "drop", "rename", "dropDatabase", "invalidate", "]", "}", "}");
  /* releases by update; by replace (a person's, or an update mongod logged
   * as a whole new document): acquisitions, renewals and waiters' attempts
   * pass none of these */
  release_clauses(&or_, &n, field, tag, "update", "updateDescription.updatedFields");
  release_clauses(&or_, &n, field, tag, "replace", "fullDocument");
  /* owner removed: a release by $unset */
  BCON_APPEND(&or_, "5", "{", "operationType", "update",
              "updateDescription.removedFields", BCON_UTF8(field), "}");
  /* a write that ended a lease held in this process (lost, a takeover or
   * a forced release), by update or replace */
  {
    char re[24];
    bson_snprintf(re, sizeof re, "^%s", tag);
    BCON_APPEND(&or_,
      "6", "{", "operationType", "update",
                "updateDescription.updatedFields." ML_F_LOST, BCON_REGEX(re, ""), "}",
      "7", "{", "operationType", "replace", "fullDocument." ML_F_LOST, BCON_REGEX(re, ""), "}");
  }
  bson_init(&keep);
  event_fields(&keep, field);
  BCON_APPEND(out, "pipeline", "[", "{", "$match", "{", "$or", BCON_ARRAY(&or_), "}", "}",
                                    "{", "$project", BCON_DOCUMENT(&keep), "}", "]");
  bson_destroy(&keep);
  bson_destroy(&or_);
}

void ml_build_watch_start(bson_t *out, uint32_t t, uint32_t i, const bson_t *resume_token) {
  if (resume_token) BCON_APPEND(out, "resumeAfter", BCON_DOCUMENT(resume_token));
  else BCON_APPEND(out, "startAtOperationTime", BCON_TIMESTAMP(t, i));
}

void ml_build_watch(ml_op *op, const char *db, const char *coll, const char *field,
                    const char *tag, uint32_t t, uint32_t i, const bson_t *resume_token) {
  bson_t p = BSON_INITIALIZER, start = BSON_INITIALIZER;
  bson_iter_t it, match, project;
  if (!tag) {
    /* every change of the collection, reduced to what names it (a reader
     * such as the command's top re-reads the locks on any); without t, i
     * or a resume token it starts now */
    if (resume_token || t || i) ml_build_watch_start(&start, t, i, resume_token);
    ml_op_init(op, ML_RUN_COMMAND, db, coll);
    BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
                "pipeline", "[", "{", "$changeStream", BCON_DOCUMENT(&start), "}",
                                 "{", "$project", "{", "operationType", BCON_INT32(1),
                                      "documentKey", BCON_INT32(1), "clusterTime", BCON_INT32(1),
                                 "}", "}", "]",
                "cursor", "{", "}");
    bson_destroy(&start);
    return;
  }
  ml_build_watch_pipeline(&p, field, tag);
  bson_iter_init(&it, &p);
  bson_iter_find_descendant(&it, "pipeline.0", &match);
  bson_iter_init(&it, &p);
  bson_iter_find_descendant(&it, "pipeline.1", &project);
  ml_build_watch_start(&start, t, i, resume_token);
  ml_op_init(op, ML_RUN_COMMAND, db, coll);
  BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
              "pipeline", "[", "{", "$changeStream", BCON_DOCUMENT(&start), "}",
                               BCON_ITER(&match), BCON_ITER(&project), "]",
              "cursor", "{", "}");
  bson_destroy(&start);
  bson_destroy(&p);
}

void ml_build_getmore(ml_op *op, const char *db, const char *coll, int64_t cursor_id,
                      int64_t await_ms) {
  ml_op_init(op, ML_RUN_COMMAND, db, coll);
  BCON_APPEND(&op->cmd, "getMore", BCON_INT64(cursor_id), "collection", BCON_UTF8(coll),
              "maxTimeMS", BCON_INT64(await_ms));
}

void ml_build_killcursors(ml_op *op, const char *db, const char *coll, int64_t cursor_id) {
  ml_op_init(op, ML_RUN_COMMAND, db, coll);
  BCON_APPEND(&op->cmd, "killCursors", BCON_UTF8(coll), "cursors", "[", BCON_INT64(cursor_id), "]");
}

/* ---- replies ----------------------------------------------------------- */

int64_t ml_iter_int64(const bson_iter_t *it, int64_t dflt) {
  switch (bson_iter_type(it)) {
  case BSON_TYPE_INT32: return bson_iter_int32(it);
  case BSON_TYPE_INT64: return bson_iter_int64(it);
  case BSON_TYPE_DOUBLE: return (int64_t)bson_iter_double(it);
  case BSON_TYPE_DATE_TIME: return bson_iter_date_time(it);
  default: return dflt;
  }
}

/* a numeric or date field of doc */
static int find_int64(const bson_t *doc, const char *key, int64_t *out) {
  bson_iter_t it;
  if (!bson_iter_init_find(&it, doc, key)) return 0;
  if (!BSON_ITER_HOLDS_NUMBER(&it) && !BSON_ITER_HOLDS_DATE_TIME(&it)) return 0;
  *out = ml_iter_int64(&it, 0);
  return 1;
}

/* a document field of doc as a view (valid while doc lives) */
static int find_doc(const bson_t *doc, const char *key, bson_t *out) {
  bson_iter_t it;
  const uint8_t *data;
  uint32_t len;
  if (!bson_iter_init_find(&it, doc, key) || !BSON_ITER_HOLDS_DOCUMENT(&it)) return 0;
  bson_iter_document(&it, &len, &data);
  return bson_init_static(out, data, len);
}

/* a numeric or date value at it */
static int iter_number(const bson_iter_t *it, int64_t *out) {
  if (!BSON_ITER_HOLDS_NUMBER(it) && !BSON_ITER_HOLDS_DATE_TIME(it)) return 0;
  *out = ml_iter_int64(it, 0);
  return 1;
}

/* the document at it as a view */
static int iter_doc(const bson_iter_t *it, bson_t *out) {
  const uint8_t *data;
  uint32_t len;
  if (!BSON_ITER_HOLDS_DOCUMENT(it)) return 0;
  bson_iter_document(it, &len, &data);
  return bson_init_static(out, data, len);
}

int ml_parse_acquire(const bson_t *reply, const char *owner, const char *owner_field,
                     ml_owner_form form, int doc, ml_acquire_reply *out) {
  bson_t value;
  bson_iter_t it;
  int has_doc = 0;
  memset(out, 0, sizeof *out);
  out->queued = -1;
  out->position = -1;
  out->holders = -1;
  out->readers = -1;
  if (!find_doc(reply, "value", &value) || !bson_iter_init(&it, &value)) return 0;
  out->value = value;
  /* one pass over the returned fields (a named lock's projection, or a
   * document lock's {doc, remainingMs}) */
  while (bson_iter_next(&it)) {
    const char *k = bson_iter_key(&it);
    if (!strcmp(k, "remainingMs")) {
      out->has_remaining = iter_number(&it, &out->remaining_ms);
    } else if (doc) {
      if (!strcmp(k, "doc")) has_doc = iter_doc(&it, &out->value);
    } else if (!strcmp(k, owner_field)) {
      out->owner = it;
      out->has_owner = 1;
    } else if (!strcmp(k, ML_F_TOKEN)) {
      iter_number(&it, &out->token);
    } else if (!strcmp(k, ML_F_EXPIRES)) {
      out->has_expires = iter_number(&it, &out->expires_ms);
    } else if (!strcmp(k, "queued")) {
      iter_number(&it, &out->queued);
    } else if (!strcmp(k, "position")) {
      iter_number(&it, &out->position);
    } else if (!strcmp(k, ML_F_HOLDER)) {
      out->has_holder = iter_doc(&it, &out->holder);
    } else if (!strcmp(k, "holders")) {
      iter_number(&it, &out->holders);
    } else if (!strcmp(k, "readers")) {
      iter_number(&it, &out->readers);
    } else if (!strcmp(k, ML_F_DELAY)) {
      iter_number(&it, &out->delay_ms);
    }
  }
  if (doc) {
    if (!has_doc) return -1;
    out->has_owner = bson_iter_init_find(&out->owner, &out->value, owner_field);
  }
  out->won = out->has_owner && ml_owner_is(&out->owner, owner, form);
  /* a named lock granted to this waiter whose lease has run out is not
   * won (the attempt queued it again) */
  if (!doc && out->won && out->has_remaining && out->remaining_ms <= 0) out->won = 0;
  return 1;
}

int64_t ml_parse_matched(const bson_t *reply) {
  bson_iter_t it;
  if (bson_iter_init_find(&it, reply, "matchedCount") && BSON_ITER_HOLDS_NUMBER(&it))
    return ml_iter_int64(&it, -1);
  if (bson_iter_init_find(&it, reply, "n") && BSON_ITER_HOLDS_NUMBER(&it))
    return ml_iter_int64(&it, -1);
  return -1;
}

int ml_parse_operation_time(const bson_t *reply, uint32_t *t, uint32_t *i) {
  bson_iter_t it;
  if (!bson_iter_init_find(&it, reply, "operationTime") || !BSON_ITER_HOLDS_TIMESTAMP(&it))
    return 0;
  bson_iter_timestamp(&it, t, i);
  return 1;
}

void ml_parse_status(const bson_t *doc, ml_status *out) {
  bson_iter_t it;
  memset(out, 0, sizeof *out);
  if (bson_iter_init_find(&it, doc, "_id") && BSON_ITER_HOLDS_UTF8(&it))
    out->name = bson_iter_utf8(&it, NULL);
  out->held = bson_iter_init_find(&it, doc, "held") && bson_iter_as_bool(&it);
  if (bson_iter_init_find(&it, doc, ML_F_OWNER) && BSON_ITER_HOLDS_UTF8(&it))
    out->owner = bson_iter_utf8(&it, NULL);
  out->has_token = find_int64(doc, ML_F_TOKEN, &out->token);
  out->has_acquired = find_int64(doc, ML_F_ACQUIRED, &out->acquired_ms);
  out->has_expires = find_int64(doc, ML_F_EXPIRES, &out->expires_ms);
  out->has_remaining = find_int64(doc, "remainingMs", &out->remaining_ms);
  out->has_waiting = find_int64(doc, "waiting", &out->waiting);
  out->has_holder = find_doc(doc, ML_F_HOLDER, &out->holder);
  out->has_holders = find_int64(doc, "holders", &out->holders);
  out->has_readers = find_int64(doc, "readers", &out->readers);
  out->has_permits = find_int64(doc, "permits", &out->permits);
  if (!find_int64(doc, ML_F_DELAY, &out->delay_ms)) out->delay_ms = 0;
}

int ml_reply_batch(const bson_t *reply, bson_iter_t *docs, int64_t *cursor_id) {
  bson_iter_t it, cur;
  if (!bson_iter_init_find(&it, reply, "cursor") || !BSON_ITER_HOLDS_DOCUMENT(&it) ||
      !bson_iter_recurse(&it, &cur))
    return 0;
  if (cursor_id) {
    bson_iter_t id = cur;
    *cursor_id = bson_iter_find(&id, "id") ? ml_iter_int64(&id, 0) : 0;
  }
  if ((bson_iter_find(&cur, "firstBatch") ||
       (bson_iter_recurse(&it, &cur) && bson_iter_find(&cur, "nextBatch"))) &&
      BSON_ITER_HOLDS_ARRAY(&cur))
    return bson_iter_recurse(&cur, docs);
  return 0;
}

int ml_batch_next(bson_iter_t *docs, bson_t *doc) {
  while (bson_iter_next(docs)) {
    const uint8_t *data;
    uint32_t len;
    if (!BSON_ITER_HOLDS_DOCUMENT(docs)) continue;
    bson_iter_document(docs, &len, &data);
    if (bson_init_static(doc, data, len)) return 1;
  }
  return 0;
}

int ml_reply_resume_token(const bson_t *reply, const uint8_t **data, uint32_t *len) {
  bson_iter_t it;
  if (!bson_iter_init(&it, reply) || !bson_iter_find_descendant(&it, "cursor.postBatchResumeToken", &it) ||
      !BSON_ITER_HOLDS_DOCUMENT(&it))
    return 0;
  bson_iter_document(&it, len, data);
  return 1;
}

/* the new value of field in an event: updatedFields (an update) or
 * fullDocument (a replace) */
static int event_field(const bson_t *doc, const char *field, bson_iter_t *k) {
  bson_iter_t it;
  char path[64];
  bson_snprintf(path, sizeof path, "updateDescription.updatedFields.%s", field);
  if (bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, path, k)) return 1;
  bson_snprintf(path, sizeof path, "fullDocument.%s", field);
  return bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, path, k);
}

/* does the array of strings at path in doc hold s? */
static int path_has_string(const bson_t *doc, const char *path, const char *s) {
  bson_iter_t it, f, a;
  if (!bson_iter_init(&it, doc) || !bson_iter_find_descendant(&it, path, &f) ||
      !BSON_ITER_HOLDS_ARRAY(&f) || !bson_iter_recurse(&f, &a))
    return 0;
  while (bson_iter_next(&a))
    if (BSON_ITER_HOLDS_UTF8(&a) && !strcmp(bson_iter_utf8(&a, NULL), s)) return 1;
  return 0;
}

/*
 * out->lost, out->deleted and out->wakes of an event whose next and key are
 * read.  An event that names a lease of this process in lost (a takeover, a
 * forced release) passed the filter for that alone unless it also is a
 * release for this process's waiters: next names one of them, or the
 * owner was set to null (an update) or is null or missing with next (a
 * replace), or removed.  (Only a named lock's document, whose owner field
 * is ML_F_OWNER, has lost.)
 */
static void event_lost(const bson_t *doc, const char *tag, ml_event *out) {
  bson_iter_t it, k;
  const char *op = "";
  out->wakes = 1;
  if (bson_iter_init_find(&it, doc, "operationType") && BSON_ITER_HOLDS_UTF8(&it))
    op = bson_iter_utf8(&it, NULL);
  out->deleted = !strcmp(op, "delete");
  if (event_field(doc, ML_F_LOST, &k) && BSON_ITER_HOLDS_UTF8(&k)) {
    uint32_t len;
    const char *v = bson_iter_utf8(&k, &len);
    if (len == 48 && memcmp(v, tag, 16) == 0 && ml_is_hex(v + 16, 32, 32)) {
      memcpy(out->lost, v + 16, 32);
      out->lost[32] = '\0';
    }
  }
  if (!out->lost[0] || out->next[0]) return;
  if (!strcmp(op, "update")) {
    out->wakes = (bson_iter_init(&it, doc) &&
                  bson_iter_find_descendant(&it, "updateDescription.updatedFields." ML_F_OWNER, &k) &&
                  BSON_ITER_HOLDS_NULL(&k)) ||
                 path_has_string(doc, "updateDescription.removedFields", ML_F_OWNER);
  } else if (!strcmp(op, "replace")) {
    int owned = bson_iter_init(&it, doc) &&
                bson_iter_find_descendant(&it, "fullDocument." ML_F_OWNER, &k) && !BSON_ITER_HOLDS_NULL(&k);
    int named = bson_iter_init(&it, doc) &&
                bson_iter_find_descendant(&it, "fullDocument." ML_F_NEXT, &k) && !BSON_ITER_HOLDS_NULL(&k);
    out->wakes = !owned && !named;
  }
}

void ml_parse_event(const bson_t *doc, const char *tag, ml_event *out) {
  bson_iter_t it, k;
  memset(out, 0, sizeof *out);
  out->grant_ms = -1;
  out->t = UINT32_MAX;             /* no clusterTime: after everything */
  out->i = UINT32_MAX;
  if (bson_iter_init_find(&it, doc, "clusterTime") && BSON_ITER_HOLDS_TIMESTAMP(&it))
    bson_iter_timestamp(&it, &out->t, &out->i);
  /* a release handed to one waiter names it in next */
  if (bson_iter_init(&it, doc) &&
      (bson_iter_find_descendant(&it, "updateDescription.updatedFields." ML_F_NEXT, &k) ||
       (bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, "fullDocument." ML_F_NEXT, &k))) &&
      BSON_ITER_HOLDS_UTF8(&k)) {
    uint32_t len;
    const char *w = bson_iter_utf8(&k, &len);
    if (len == 48 && memcmp(w, tag, 16) == 0) memcpy(out->next, w, 49);
  }
  /* a release that granted the lock to that waiter: owner, token and the
   * lease (expiresAt - acquiredAt, when both are in the event) */
  if (out->next[0] && event_field(doc, ML_F_OWNER, &k) && BSON_ITER_HOLDS_UTF8(&k)) {
    uint32_t len;
    const char *o = bson_iter_utf8(&k, &len);
    bson_iter_t tk, ex, ac;
    if (len == 32 && memcmp(o, out->next + 16, 32) == 0 && event_field(doc, ML_F_TOKEN, &tk) &&
        (BSON_ITER_HOLDS_INT64(&tk) || BSON_ITER_HOLDS_INT32(&tk))) {
      memcpy(out->owner, o, 32);
      out->owner[32] = '\0';
      out->token = ml_iter_int64(&tk, 0);
      if (event_field(doc, ML_F_EXPIRES, &ex) && BSON_ITER_HOLDS_DATE_TIME(&ex) &&
          event_field(doc, ML_F_ACQUIRED, &ac) && BSON_ITER_HOLDS_DATE_TIME(&ac))
        out->grant_ms = bson_iter_date_time(&ex) - bson_iter_date_time(&ac);
    }
  }
  if (bson_iter_init(&it, doc) && bson_iter_find_descendant(&it, "documentKey._id", &out->key))
    out->has_key = 1;
  event_lost(doc, tag, out);
}

/* ---- values ------------------------------------------------------------ */

const char *ml_check_name(const char *s, size_t len) {
  if (len == 0) return "name must not be empty";
  if (len > ML_NAME_MAX) return "name longer than 1024 bytes";
  if (memchr(s, '\0', len)) return "name contains a NUL byte";
  if (!bson_utf8_validate(s, len, false)) return "name is not valid UTF-8";
  return NULL;
}

/* MongoDB's limits: a database name is 1..63 bytes without /\. "$ and NUL;
 * a collection name has no '$' or NUL, does not start with "system.", and
 * with its database and a dot makes at most 255 bytes */
const char *ml_check_db(const char *s, size_t len) {
  if (len == 0 || len > 63 || strcspn(s, "/\\. \"$") != len ||
      !bson_utf8_validate(s, len, false))
    return "invalid database name (1..63 bytes of UTF-8, none of /\\. \"$ or NUL)";
  return NULL;
}

const char *ml_check_coll(const char *db, const char *s, size_t len) {
  if (len == 0 || strlen(s) != len || strchr(s, '$') || strncmp(s, "system.", 7) == 0 ||
      strlen(db) + 1 + len > 255 || !bson_utf8_validate(s, len, false))
    return "invalid collection name (UTF-8 without '$' or NUL, not system.*, at most 255 bytes "
           "with the database name)";
  return NULL;
}

const char *ml_check_field(const char *s, size_t len) {
  if (len == 0 || len > 255 || strlen(s) != len || s[0] == '$' || strchr(s, '.') ||
      strcmp(s, "_id") == 0 || !bson_utf8_validate(s, len, false))
    return "field name must be 1..255 bytes of UTF-8, no '.', no leading '$', not _id";
  return NULL;
}

int ml_is_hex(const char *s, size_t len, size_t n) {
  size_t k;
  if (len != n) return 0;
  for (k = 0; k < len; k++)
    if (!((s[k] >= '0' && s[k] <= '9') || (s[k] >= 'a' && s[k] <= 'f'))) return 0;
  return 1;
}

int64_t ml_ttl_ms(double ms) {
  if (!(ms > 0) || ms > (double)ML_TTL_MAX_MS) return 0;
  return (int64_t)ceil(ms);
}

/* owner ids are written by this library: lowercase hex */
static int hexval(char ch) {
  return ch >= 'a' ? ch - 'a' + 10 : ch - '0';
}

static void owner_bytes(const char *owner, uint8_t u[16]) {
  int i;
  for (i = 0; i < 16; i++) u[i] = (uint8_t)(hexval(owner[2 * i]) << 4 | hexval(owner[2 * i + 1]));
}

void ml_append_owner(bson_t *b, const char *key, const char *owner, ml_owner_form form) {
  if (form == ML_OWNER_UUID) {
    uint8_t u[16];
    owner_bytes(owner, u);
    bson_append_binary(b, key, -1, BSON_SUBTYPE_UUID, u, 16);
  } else {
    bson_append_utf8(b, key, -1, owner, 32);
  }
}

int ml_owner_is(const bson_iter_t *it, const char *owner, ml_owner_form form) {
  if (form == ML_OWNER_HEX) {
    uint32_t len;
    const char *s;
    if (!BSON_ITER_HOLDS_UTF8(it)) return 0;
    s = bson_iter_utf8(it, &len);
    return len == 32 && memcmp(s, owner, 32) == 0;
  }
  if (BSON_ITER_HOLDS_BINARY(it)) {
    bson_subtype_t st;
    uint32_t len;
    const uint8_t *data;
    uint8_t u[16];
    bson_iter_binary(it, &st, &len, &data);
    owner_bytes(owner, u);
    return st == BSON_SUBTYPE_UUID && len == 16 && memcmp(data, u, 16) == 0;
  }
  return 0;
}
