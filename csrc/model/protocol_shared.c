/*
 * The shared kinds' commands (protocol_shared.h, doc/design.md "Shared
 * kinds"), built with BCON as protocol.c builds the exclusive ones.
 *
 * One lock document per name holds every kind: the exclusive holder in
 * owner/expiresAt (protocol.c), shares and permits in holders, exclusive
 * waiters in queue, sharers waiting in squeue, and one token for all of
 * them.  Every decision is made by the server ($$NOW) in one command.
 */
#include <string.h>

#include "protocol_shared.h"

/* ---- fragments --------------------------------------------------------- */

/* ML_ARR, ML_LIVE, ML_WATCHING, ML_HEAD_TW, ML_NEXT_TOKEN, ML_IF_TAKEN and
 * ML_ENTRY are protocol.h's, shared with the exclusive kind's builders */

/* the exclusive holder's lease runs */
#define OWNER_LIVE                                                           \
  "{", "$and", "[",                                                          \
    "{", "$ne", "[", "{", "$ifNull", "[", "$" ML_F_OWNER, BCON_NULL, "]", "}", BCON_NULL, "]", "}", \
    "{", "$gt", "[", "$" ML_F_EXPIRES, "$$NOW", "]", "}", "]", "}"

/* the live holders' owner ids contain O (a filter's $expr) */
#define HOLDS(O)                                                             \
  "{", "$in", "[", BCON_UTF8(O),                                             \
    "{", "$map", "{", "input", ML_LIVE(ML_F_HOLDERS), "in", "$$this.o", "}", "}", "]", "}"

/* the ms left of the lock-delay that keeps the name (the exclusive
 * holder's, or the longest of the shares' that ended unreleased), 0 when
 * none */
#define DELAY_LEFT                                                           \
  "{", "$max", "[", BCON_INT64(0),                                           \
    "{", "$cond", "[", "{", "$or", "[", OWNER_LIVE, ML_EXCL_FREE, "]", "}", BCON_INT64(0), \
      "{", "$subtract", "[", "{", "$add", "[", "$" ML_F_EXPIRES, "$" ML_F_DELAY, "]", "}", "$$NOW", "]", "}", \
      "]", "}",                                                              \
    "{", "$max", "{", "$map", "{",                                           \
      "input", "{", "$filter", "{", "input", ML_KEEPS(ML_F_HOLDERS),         \
                 "cond", "{", "$lte", "[", "$$this.until", "$$NOW", "]", "}", "}", "}", \
      "in", "{", "$subtract", "[", "{", "$add", "[", "$$this.until",         \
                                     "{", "$ifNull", "[", "$$this.d", BCON_INT64(0), "]", "}", "]", "}", \
                                "$$NOW", "]", "}", "}", "}", "}", "]", "}"

/* ---- acquire ----------------------------------------------------------- */

/*
 * [ {$set: {_mlq: ML_LIVE(squeue), _mlh: ML_LIVE(holders), _mlw: ML_WATCHING(ML_LIVE(queue))}},
 *   (and _mlb: ML_KEEPS(holders), the shares that keep the name: a permit's
 *   room counts those in their lock-delay, and a taking write keeps them)
 *   {$set: {_mlk: KIND_OK, _mlm: O in _mlh.o}},
 *   {$set: {_mlt: _mlk && !_mlm && FREE(owner) && _mlw == [] && ROOM && TURN}},
 *   {$set: {permits, token, owner, expiresAt, holders, squeue, next}},
 *   {$unset: [...]} ]
 */
void ml_build_share_acquire(ml_op *op, const ml_acquire_args *a, int mode, int64_t permits) {
  const char *w = a->waiter ? a->waiter : "";
  int p = mode == ML_MODE_PERMIT;
  char tw[64];
  bson_t holder = BSON_INITIALIZER, kind = BSON_INITIALIZER, room = BSON_INITIALIZER,
         turn = BSON_INITIALIZER, chain = BSON_INITIALIZER, queue = BSON_INITIALIZER,
         perm = BSON_INITIALIZER;
  bson_t kdoc;
  bson_iter_t ik, ir, it, ic, iq, ip, kv;
  ml_keeper_value(&kdoc, &kv, a->keeper);
  bson_snprintf(tw, sizeof tw, "%s%s", a->waiter ? a->tag : "", w);
  BCON_APPEND(&holder, "host", BCON_UTF8(a->host), "pid", BCON_INT64(a->pid));
  if (a->app) BCON_APPEND(&holder, "app", BCON_UTF8(a->app));

  if (p) {
    /* a semaphore of this N, or a name no permit was asked of yet and no
     * reader shares */
    BCON_APPEND(&kind, "v", "{", "$or", "[",
      "{", "$eq", "[", "$" ML_F_PERMITS, BCON_INT64(permits), "]", "}",
      "{", "$and", "[",
        "{", "$eq", "[", "{", "$ifNull", "[", "$" ML_F_PERMITS, BCON_NULL, "]", "}", BCON_NULL, "]", "}",
        "{", "$not", "[", "{", "$in", "[", "s", "$_mlh.m", "]", "}", "]", "}", "]", "}",
      "]", "}");
    BCON_APPEND(&room, "v", "{", "$lt", "[", "{", "$size", "$_mlb", "}", BCON_INT64(permits), "]", "}");
    /* first come, first served among the permits' waiters */
    BCON_APPEND(&turn, "v", "{", "$let", "{",
      "vars", "{",
        "fw", "{", "$indexOfArray", "[",
                "{", "$map", "{", "input", "$_mlq",
                     "in", "{", "$ne", "[", "$$this.p", BCON_BOOL(true), "]", "}", "}", "}",
                BCON_BOOL(true), "]", "}",
        "me", "{", "$indexOfArray", "[", "$_mlq.w", BCON_UTF8(w), "]", "}", "}",
      "in", "{", "$or", "[",
        "{", "$eq", "[", "$$fw", BCON_INT32(-1), "]", "}",
        "{", "$and", "[", "{", "$ne", "[", "$$me", BCON_INT32(-1), "]", "}",
                         "{", "$lte", "[", "$$me", "$$fw", "]", "}", "]", "}", "]", "}",
      "}", "}");
    /* taken with a permit left: the next waiter is woken too */
    BCON_APPEND(&chain, "v", "{", "$let", "{",
      "vars", "{", "h", ML_HEAD_TW("{", "$filter", "{", "input", "$_mlq",
                       "cond", "{", "$ne", "[", "$$this.w", BCON_UTF8(w), "]", "}", "}", "}"), "}",
      "in", "{", "$cond", "[",
        "{", "$and", "[", "{", "$ne", "[", "$$h", BCON_NULL, "]", "}",
          "{", "$lt", "[", "{", "$add", "[", "{", "$size", "$_mlb", "}", BCON_INT32(1), "]", "}",
                           BCON_INT64(permits), "]", "}", "]", "}",
        "$$h",
        "{", "$cond", "[", "{", "$eq", "[", "$" ML_F_NEXT, BCON_UTF8(tw), "]", "}", BCON_NULL,
                           "$" ML_F_NEXT, "]", "}",
      "]", "}", "}", "}");
  } else {
    /* a reader-writer lock: no semaphore on the name */
    BCON_APPEND(&kind, "v", "{", "$eq", "[", "{", "$ifNull", "[", "$" ML_F_PERMITS, BCON_NULL, "]", "}",
                BCON_NULL, "]", "}");
    BCON_APPEND(&room, "v", BCON_BOOL(true));
    BCON_APPEND(&turn, "v", BCON_BOOL(true));
    BCON_APPEND(&chain, "v", "{", "$cond", "[", "{", "$eq", "[", "$" ML_F_NEXT, BCON_UTF8(tw), "]", "}",
                BCON_NULL, "$" ML_F_NEXT, "]", "}");
  }
  /* taken, or held already (a retry of an applied attempt): out of the
   * queue; else its place kept or taken */
  if (a->waiter)
    BCON_APPEND(&queue, "v", "{", "$cond", "[", "{", "$or", "[", "$_mlt", "$_mlm", "]", "}",
      "{", "$filter", "{", "input", "$_mlq",
                           "cond", "{", "$ne", "[", "$$this.w", BCON_UTF8(w), "]", "}", "}", "}",
      "{", "$cond", "[", "$_mlk",
        "{", "$cond", "[", "{", "$in", "[", BCON_UTF8(w), "$_mlq.w", "]", "}",
          "{", "$map", "{", "input", "$_mlq",
               "in", "{", "$cond", "[", "{", "$eq", "[", "$$this.w", BCON_UTF8(w), "]", "}",
                 ML_ENTRY(w, a->tag, a->queue_ms, a->polling != 0), "$$this", "]", "}", "}", "}",
          "{", "$concatArrays", "[", "$_mlq",
                 "[", ML_ENTRY(w, a->tag, a->queue_ms, a->polling != 0), "]", "]", "}", "]", "}",
        "$" ML_F_SQUEUE, "]", "}",
      "]", "}");
  else
    BCON_APPEND(&queue, "v", ML_IF_TAKEN("$" ML_F_SQUEUE, "$_mlq"));
  /* N is written by the first permit asked of the name, kept after */
  if (p) BCON_APPEND(&perm, "v", "{", "$cond", "[", "$_mlk", BCON_INT64(permits),
                                  "$" ML_F_PERMITS, "]", "}");
  else BCON_APPEND(&perm, "v", "$" ML_F_PERMITS);
  bson_iter_init_find(&ip, &perm, "v");
  bson_iter_init_find(&ik, &kind, "v");
  bson_iter_init_find(&ir, &room, "v");
  bson_iter_init_find(&it, &turn, "v");
  bson_iter_init_find(&ic, &chain, "v");
  bson_iter_init_find(&iq, &queue, "v");

  ml_op_init(op, ML_RUN_WRITE, a->db, a->coll);
  op->retry = 1;
  BCON_APPEND(&op->cmd,
    "findAndModify", BCON_UTF8(a->coll),
    "query", "{", "_id", BCON_UTF8(a->name), "}",
    "upsert", BCON_BOOL(true), "new", BCON_BOOL(true),
    "update", "[",
      "{", "$set", "{", "_mlq", ML_LIVE(ML_F_SQUEUE), "_mlh", ML_LIVE(ML_F_HOLDERS),
                        "_mlb", ML_KEEPS(ML_F_HOLDERS),
                        "_mlw", ML_WATCHING(ML_LIVE(ML_F_QUEUE)), "}", "}",
      "{", "$set", "{", "_mlk", BCON_ITER(&ik),
                        "_mlm", "{", "$in", "[", BCON_UTF8(a->owner), "$_mlh.o", "]", "}", "}", "}",
      "{", "$set", "{", "_mlt", "{", "$and", "[", "$_mlk", "{", "$not", "[", "$_mlm", "]", "}",
        ML_EXCL_FREE,
        "{", "$eq", "[", "{", "$size", "$_mlw", "}", BCON_INT32(0), "]", "}",
        BCON_ITER(&ir), BCON_ITER(&it), "]", "}", "}", "}",
      "{", "$set", "{",
        ML_F_PERMITS, BCON_ITER(&ip),
        ML_F_TOKEN, ML_IF_TAKEN("$" ML_F_TOKEN, ML_NEXT_TOKEN),
        /* an owner whose lease ended is cleared: its extend must not bring
         * it back while shares are held */
        ML_F_OWNER, ML_IF_TAKEN("$" ML_F_OWNER, BCON_NULL),
        ML_F_DELAY, ML_IF_TAKEN("$" ML_F_DELAY, "$$REMOVE"),
        /* the lease end the TTL index reads covers every share */
        ML_F_EXPIRES, ML_IF_TAKEN("$" ML_F_EXPIRES, "{", "$max", "[", "$" ML_F_EXPIRES,
                             "{", "$add", "[", "$$NOW", BCON_INT64(a->ttl_ms), "]", "}", "]", "}"),
        ML_F_HOLDERS, ML_IF_TAKEN("$" ML_F_HOLDERS, "{", "$concatArrays", "[", "$_mlb", "[",
          "{", "o", BCON_UTF8(a->owner), "m", BCON_UTF8(p ? "p" : "s"),
               "until", "{", "$add", "[", "$$NOW", BCON_INT64(a->ttl_ms), "]", "}",
               "tk", ML_NEXT_TOKEN, "at", "$$NOW",
               "h", "{", "$literal", BCON_DOCUMENT(&holder), "}",
               "k", BCON_ITER(&kv), "l", BCON_INT64(a->ttl_ms), "d", BCON_INT64(a->delay_ms), "}",
          "]", "]", "}"),
        ML_F_SQUEUE, BCON_ITER(&iq),
        ML_F_NEXT, "{", "$cond", "[", "$_mlt", BCON_ITER(&ic),
          "{", "$cond", "[", "{", "$eq", "[", "$" ML_F_NEXT, BCON_UTF8(tw), "]", "}", BCON_NULL,
                             "$" ML_F_NEXT, "]", "}", "]", "}",
      "}", "}",
      "{", "$unset", "[", "_mlq", "_mlh", "_mlb", "_mlw", "_mlk", "_mlm", "_mlt", "]", "}",
    "]",
    "fields", "{",
      "_id", BCON_INT32(0), ML_F_PERMITS, BCON_INT32(1), ML_F_TOKEN, BCON_INT32(1),
      ML_F_OWNER, BCON_INT32(1), ML_F_HOLDER, BCON_INT32(1),
      "me", "{", "$arrayElemAt", "[", "{", "$filter", "{", "input", ML_LIVE(ML_F_HOLDERS),
               "cond", "{", "$eq", "[", "$$this.o", BCON_UTF8(a->owner), "]", "}", "}", "}",
               BCON_INT32(0), "]", "}",
      "holders", "{", "$size", ML_LIVE(ML_F_HOLDERS), "}",
      "readers", "{", "$size", "{", "$filter", "{", "input", ML_LIVE(ML_F_HOLDERS),
                   "cond", "{", "$eq", "[", "$$this.m", "s", "]", "}", "}", "}", "}",
      "exclusive", OWNER_LIVE,
      /* until the exclusive lease ends, else the first share's */
      "remainingMs", "{", "$subtract", "[",
        "{", "$cond", "[", OWNER_LIVE, "$" ML_F_EXPIRES,
          "{", "$min", "{", "$map", "{", "input", ML_LIVE(ML_F_HOLDERS), "in", "$$this.until", "}", "}", "}",
        "]", "}", "$$NOW", "]", "}",
      "queued", "{", "$size", ML_ARR(ML_F_SQUEUE), "}",
      "position", "{", "$indexOfArray", "[",
        "{", "$cond", "[", "{", "$isArray", "$" ML_F_SQUEUE, "}", "$" ML_F_SQUEUE ".w", "[", "]", "]", "}",
        BCON_UTF8(w), "]", "}",
      "writers", "{", "$size", ML_WATCHING(ML_LIVE(ML_F_QUEUE)), "}",
      "delayMs", DELAY_LEFT,
    "}");
  bson_destroy(&holder);
  bson_destroy(&kind);
  bson_destroy(&room);
  bson_destroy(&turn);
  bson_destroy(&chain);
  bson_destroy(&queue);
  bson_destroy(&perm);
  bson_destroy(&kdoc);
}

/* ---- release, extend, leave, force release ----------------------------- */

/*
 * After a share ends (HS: the live holders left): a queued writer is woken
 * when none is left (writers first), else the first sharer waiting when
 * there is room; otherwise next stays as it was (no event).
 */
#define NEXT_AFTER(...)                                                      \
  "{", "$let", "{",                                                          \
    "vars", "{", "wh", ML_HEAD_TW(ML_LIVE(ML_F_QUEUE)), "sh", ML_HEAD_TW(ML_LIVE(ML_F_SQUEUE)), "}", \
    "in", "{", "$cond", "[", "{", "$ne", "[", "$$wh", BCON_NULL, "]", "}",    \
      "{", "$cond", "[", "{", "$eq", "[", "{", "$size", __VA_ARGS__, "}", BCON_INT32(0), "]", "}", \
                         "$$wh", "$" ML_F_NEXT, "]", "}",                    \
      "{", "$cond", "[", "{", "$and", "[", "{", "$ne", "[", "$$sh", BCON_NULL, "]", "}",  \
          "{", "$lt", "[", "{", "$size", __VA_ARGS__, "}",                   \
                           "{", "$ifNull", "[", "$" ML_F_PERMITS, BCON_INT64(INT64_MAX), "]", "}", \
          "]", "}", "]", "}",                                                \
        "$$sh", "$" ML_F_NEXT, "]", "}",                                     \
    "]", "}", "}", "}"

void ml_build_share_release(ml_op *op, const char *db, const char *coll, const bson_t *id,
                            const char *owner) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  bson_iter_t i;
  bson_iter_init_find(&i, id, "_id");
  BCON_APPEND(&q, "_id", BCON_ITER(&i), "$expr", HOLDS(owner));
  BCON_APPEND(&u,
    "0", "{", "$set", "{", "_mlh", "{", "$filter", "{", "input", ML_KEEPS(ML_F_HOLDERS),
           "cond", "{", "$ne", "[", "$$this.o", BCON_UTF8(owner), "]", "}", "}", "}", "}", "}",
    "1", "{", "$set", "{", ML_F_HOLDERS, "$_mlh", ML_F_NEXT, NEXT_AFTER("$_mlh"), "}", "}",
    "2", "{", "$unset", "[", "_mlh", "]", "}");
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

void ml_build_share_release_many(ml_op *op, const char *db, const char *coll, const bson_t *ids,
                                 const char *const *owners, size_t n) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER, os = BSON_INITIALIZER;
  size_t i;
  ml_pairs_filter(&q, ML_F_HOLDERS ".o", ML_OWNER_HEX, ids, owners, n);
  for (i = 0; i < n; i++) {
    char k[24];
    const char *key;
    bson_uint32_to_string((uint32_t)i, &key, k, sizeof k);
    BSON_APPEND_UTF8(&os, key, owners[i]);
  }
  BCON_APPEND(&u,
    "0", "{", "$set", "{", "_mlh", "{", "$filter", "{", "input", ML_KEEPS(ML_F_HOLDERS),
           "cond", "{", "$not", "[", "{", "$in", "[", "$$this.o", "{", "$literal", BCON_ARRAY(&os), "}",
           "]", "}", "]", "}", "}", "}", "}", "}",
    "1", "{", "$set", "{", ML_F_HOLDERS, "$_mlh", ML_F_NEXT, NEXT_AFTER("$_mlh"), "}", "}",
    "2", "{", "$unset", "[", "_mlh", "]", "}");
  ml_op_init(op, ML_RUN_UPDATE, db, coll);
  BCON_APPEND(&op->cmd, "update", BCON_UTF8(coll), "updates", "[", "{",
              "q", BCON_DOCUMENT(&q), "u", BCON_ARRAY(&u), "multi", BCON_BOOL(true), "}", "]");
  bson_destroy(&q);
  bson_destroy(&u);
  bson_destroy(&os);
}

void ml_build_share_extend(ml_op *op, const char *db, const char *coll, const bson_t *id,
                           const char *owner, int64_t ttl_ms) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  bson_iter_t i;
  bson_iter_init_find(&i, id, "_id");
  BCON_APPEND(&q, "_id", BCON_ITER(&i), "$expr", HOLDS(owner));
  BCON_APPEND(&u,
    "0", "{", "$set", "{",
      ML_F_HOLDERS, "{", "$map", "{", "input", ML_ARR(ML_F_HOLDERS),
        "in", "{", "$cond", "[",
          "{", "$and", "[", "{", "$eq", "[", "$$this.o", BCON_UTF8(owner), "]", "}",
                           "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}", "]", "}",
          "{", "$mergeObjects", "[", "$$this",
            "{", "until", "{", "$add", "[", "$$NOW", BCON_INT64(ttl_ms), "]", "}",
                 "l", BCON_INT64(ttl_ms), "}", "]", "}",
          "$$this", "]", "}", "}", "}",
      ML_F_EXPIRES, "{", "$max", "[", "$" ML_F_EXPIRES,
                      "{", "$add", "[", "$$NOW", BCON_INT64(ttl_ms), "]", "}", "]", "}",
    "}", "}");
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

void ml_build_share_leave(ml_op *op, const char *db, const char *coll, const char *name,
                          const char *waiter, const char *tag) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER, on = BSON_INITIALIZER;
  BCON_APPEND(&q, "_id", BCON_UTF8(name), ML_F_SQUEUE ".w", BCON_UTF8(waiter));
  /* a wake-up handed to the leaver goes on */
  BCON_APPEND(&on, "on", NEXT_AFTER(ML_LIVE(ML_F_HOLDERS)));
  ml_leave_stages(&u, ML_F_SQUEUE, waiter, tag, &on);
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&on);
  bson_destroy(&q);
  bson_destroy(&u);
}

void ml_build_share_force_release(ml_op *op, const char *db, const char *coll, const char *name) {
  bson_t q = BSON_INITIALIZER, u = BSON_INITIALIZER;
  BCON_APPEND(&q, "_id", BCON_UTF8(name),
              "$expr", "{", "$gt", "[", "{", "$size", ML_LIVE(ML_F_HOLDERS), "}", BCON_INT32(0), "]", "}");
  /* every share ends now; those with a lock-delay keep the name for it
   * from their end (ML_KEEPS) */
  BCON_APPEND(&u,
    "0", "{", "$set", "{", ML_F_HOLDERS, "{", "$map", "{",
      "input", "{", "$filter", "{", "input", ML_KEEPS(ML_F_HOLDERS),
        "cond", "{", "$gt", "[", "{", "$ifNull", "[", "$$this.d", BCON_INT64(0), "]", "}", BCON_INT64(0), "]", "}",
        "}", "}",
      "in", "{", "$mergeObjects", "[", "$$this",
        "{", "until", "{", "$min", "[", "$$this.until", "$$NOW", "]", "}", "}", "]", "}", "}", "}", "}", "}",
    "1", "{", "$set", "{", ML_F_NEXT, NEXT_AFTER("{", "$literal", "[", "]", "}"), "}", "}");
  ml_op_update(op, db, coll, &q, &u, 1);
  bson_destroy(&q);
  bson_destroy(&u);
}

/* name NULL: every document a share, permit or sharer's wait ever wrote
 * to, sorted by name */
void ml_build_share_status(ml_op *op, const char *db, const char *coll, const char *name) {
  bson_t match = BSON_INITIALIZER;
  if (name) BCON_APPEND(&match, "_id", BCON_UTF8(name));
  else BCON_APPEND(&match, "$or", "[", "{", ML_F_HOLDERS, "{", "$exists", BCON_BOOL(true), "}", "}",
                                       "{", ML_F_PERMITS, "{", "$exists", BCON_BOOL(true), "}", "}",
                                       "{", ML_F_SQUEUE, "{", "$exists", BCON_BOOL(true), "}", "}", "]");
  ml_op_init(op, ML_RUN_CURSOR, db, coll);
  BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
    "pipeline", "[", "{", "$match", BCON_DOCUMENT(&match), "}",
      "{", "$sort", "{", "_id", BCON_INT32(1), "}", "}",
      "{", "$project", "{", "_id", BCON_INT32(1), ML_F_PERMITS, BCON_INT32(1), ML_F_TOKEN, BCON_INT32(1),
        "exclusive", OWNER_LIVE,
        "holders", "{", "$map", "{", "input", ML_LIVE(ML_F_HOLDERS), "in", "{",
          "owner", "$$this.o", "mode", "$$this.m", "token", "$$this.tk", "holder", "$$this.h",
          "remainingMs", "{", "$subtract", "[", "$$this.until", "$$NOW", "]", "}", "}", "}", "}",
        "waiting", "{", "$size", ML_LIVE(ML_F_SQUEUE), "}",
        "writers", "{", "$size", ML_LIVE(ML_F_QUEUE), "}",
        "delayMs", DELAY_LEFT, "}", "}", "]",
    "cursor", "{", "}", "readConcern", "{", "level", "majority", "}");
  bson_destroy(&match);
}

/* ---- replies ----------------------------------------------------------- */

int ml_parse_share_acquire(const bson_t *reply, const char *owner, int mode, int64_t permits,
                           ml_share_reply *out) {
  bson_iter_t it, me;
  const uint8_t *data;
  uint32_t len;
  memset(out, 0, sizeof *out);
  out->permits = -1;
  if (!bson_iter_init_find(&it, reply, "value") || !BSON_ITER_HOLDS_DOCUMENT(&it)) return 0;
  bson_iter_document(&it, &len, &data);
  if (!bson_init_static(&out->value, data, len)) return 0;
  if (bson_iter_init_find(&it, &out->value, ML_F_PERMITS) && BSON_ITER_HOLDS_NUMBER(&it))
    out->permits = ml_iter_int64(&it, -1);
  out->mismatch = mode == ML_MODE_PERMIT ? out->permits != permits : out->permits != -1;
  if (bson_iter_init_find(&it, &out->value, "me") && BSON_ITER_HOLDS_DOCUMENT(&it) &&
      bson_iter_recurse(&it, &me)) {
    bson_iter_t o = me, tk = me;
    if (bson_iter_find(&o, "o") && BSON_ITER_HOLDS_UTF8(&o) &&
        strcmp(bson_iter_utf8(&o, NULL), owner) == 0) {
      out->won = 1;
      out->mismatch = 0;
      if (bson_iter_find(&tk, "tk")) out->token = ml_iter_int64(&tk, 0);
    }
  }
  return 1;
}
