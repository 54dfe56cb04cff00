/*
 * The lock protocol: the lock documents' schema and every command on them,
 * built by pure functions (no lua_State, no I/O), and their replies parsed
 * in one place.  doc/design.md describes the documents and commands.
 *
 * Each operation is build -> run -> parse -> lease: a builder fills an
 * ml_op (the command as the server receives it, and how it is run), a
 * transport (transport.h) runs it and hands back the reply, a parser here
 * reads the reply, and the caller (named.c, shared.c, documents.c) makes
 * the lease (lease.h).
 *
 * Every builder uses libbson's BCON, the JSON-like notation of the design
 * document; pieces used by several commands are BCON fragments (macros of
 * tokens) spliced into the calls.
 */
#ifndef MONGOLOCK_PROTOCOL_H
#define MONGOLOCK_PROTOCOL_H

#include <stdint.h>
#include <stddef.h>
#include <bson/bson.h>

/* ---- the schema of a named lock document (doc/design.md) --------------- */

#define ML_F_OWNER "owner"            /* 32 hex digits, or null when free */
#define ML_F_TOKEN "token"            /* int64 fencing token */
#define ML_F_ACQUIRED "acquiredAt"    /* date of the latest acquisition */
#define ML_F_EXPIRES "expiresAt"      /* date the lease ends */
#define ML_F_HOLDER "holder"          /* {host, pid, app} */
#define ML_F_QUEUE "queue"            /* [{w, t, until, p}] waiters */
#define ML_F_NEXT "next"              /* the waiter a release was handed to:
                                         its process tag and id, 48 hex */
#define ML_F_KEEPER "keeper"          /* the keeper id (16 hex digits) of the
                                         client process that renews the
                                         lease, null when nothing renews it */
#define ML_F_TTL "ttl"                /* the lease's length (ms): what a
                                         renewal extends it by */
#define ML_F_VALUE "value"            /* an election's published value (a
                                         string), written by the winning
                                         campaign and by proclaim */
#define ML_F_VTOKEN "valueToken"      /* the token (term) value was written
                                         in: it is the leader's value only
                                         while equal to token */
#define ML_F_DELAY "lockDelay"        /* the holder's lock-delay (ms), written
                                         by the write that gave it the lock
                                         when > 0, removed by a release: the
                                         name stays taken for that long after
                                         a lease that ended unreleased
                                         (ML_EXCL_FREE) */
#define ML_F_LOST "lost"              /* the lease a write ended that its
                                         holder did not end (a takeover of an
                                         expired lease, a forced release): its
                                         holder's process tag (holder.t) and
                                         owner id, 48 hex; routes the write's
                                         change event to that process */
#define ML_TTL_INDEX "expiresAt_ttl"  /* name of the TTL index */

#define ML_NAME_MAX 1024              /* bytes of a lock name */
#define ML_VALUE_MAX 16384            /* bytes of an election's value */
#define ML_TTL_MAX_MS ((int64_t)365 * 24 * 3600 * 1000)   /* a year */

/*
 * Which instant the time field of a lock document holds.
 *   ML_TIME_EXPIRES_AT: the lease end (named locks' expiresAt); free when
 *     owner is null or time <= $$NOW; extend sets $$NOW + ttl; release sets
 *     $$NOW.
 *   ML_TIME_LOCKED_AT: when it was locked (seed 000's LockTime); free when
 *     owner is null or time + ttl <= $$NOW; extend sets $$NOW; release sets
 *     null.
 */
typedef enum { ML_TIME_EXPIRES_AT = 0, ML_TIME_LOCKED_AT = 1 } ml_time_mode;

/* how the owner id is stored in the owner field */
typedef enum {
  ML_OWNER_HEX = 0,   /* string of 32 hex digits (named locks) */
  ML_OWNER_UUID = 1   /* Binary subtype 4 of the same 16 bytes (.NET Guid) */
} ml_owner_form;

/* which lock document: everything a release, extend or status needs */
typedef struct ml_lockref {
  const char *db, *coll;
  const bson_t *id;                 /* {"_id": <the document's _id>} */
  const char *owner_field;          /* ML_F_OWNER for named locks */
  const char *time_field;           /* ML_F_EXPIRES for named locks */
  ml_time_mode time_mode;
  ml_owner_form owner_form;
  int queued;                       /* a named lock: release hands it to the
                                       queue's first live watching waiter */
} ml_lockref;

/* r for the named lock whose {_id: name} is id (kept by the caller) */
void ml_named_ref(ml_lockref *r, const char *db, const char *coll, const bson_t *id);

/* ---- operations -------------------------------------------------------- */

/* how a transport runs an op */
typedef enum {
  ML_RUN_WRITE = 0,     /* a write command with the client's write concern
                           (findAndModify, createIndexes) */
  ML_RUN_UPDATE = 1,    /* {update: coll, updates: [{q, u}]}: one document,
                           as a retryable write (libmongoc's update_one) */
  ML_RUN_CURSOR = 2,    /* {aggregate: ...}: every batch, folded into the
                           reply's cursor.firstBatch */
  ML_RUN_COMMAND = 3    /* any command (client:command): the write concern
                           added to write commands that have none */
} ml_run_kind;

/*
 * A built operation.  cmd is the command as the server receives it, minus
 * what the transport adds (writeConcern, lsid, txnNumber).  db and coll are
 * borrowed from the builder's caller and must outlive the op.
 */
typedef struct ml_op {
  ml_run_kind kind;
  int retry;                /* ML_RUN_WRITE: sent once more after a network
                               error (the command is idempotent for its
                               owner id) */
  const char *db, *coll;
  const char *session;      /* ML_RUN_COMMAND, a cursor's commands (the
                               aggregate, its getMores, killCursors): the
                               key of the session they all run in
                               (transport.h), or NULL */
  bson_t cmd;
} ml_op;

void ml_op_destroy(ml_op *op);

/* what a named-lock acquire writes */
typedef struct ml_acquire_args {
  const char *db, *coll;
  const char *name;                 /* 1..ML_NAME_MAX bytes, no NUL */
  const char *owner;                /* 32 lowercase hex digits */
  int64_t ttl_ms;
  const char *host;                 /* holder.host */
  int64_t pid;                      /* holder.pid */
  const char *app;                  /* holder.app, NULL for none */
  const char *waiter;               /* NULL: a try; else the waiter id (the
                                       owner id of every attempt) */
  const char *tag;                  /* with waiter: this process's tag */
  int64_t queue_ms;                 /* with waiter: how long its place is
                                       kept after this attempt */
  int polling;                      /* with waiter: it polls (cannot be
                                       woken) */
  const char *keeper;               /* 16 hex digits: the keeper id that
                                       renews the lease (ml_build_renew),
                                       NULL when nothing renews it */
  const char *htag;                 /* this process's tag, written as
                                       holder.t (a write that ends the lease
                                       names it in ML_F_LOST); NULL: none */
  const char *value;                /* an election's campaign: the value
                                       the attempt publishes when it takes
                                       the lock (ML_F_VALUE, with the new
                                       token in ML_F_VTOKEN); NULL for
                                       every other acquire */
  int64_t delay_ms;                 /* the lock-delay (ML_F_DELAY), 0: none */
} ml_acquire_args;

/* the builders; each initialises op->cmd (ml_op_destroy frees it) */
void ml_build_acquire(ml_op *op, const ml_acquire_args *a);
/* 1: a waiter's parts built afresh, not copied from their templates (the
 * model's test compares the two; not for the hot path) */
extern int ml_acquire_fresh;
void ml_build_doc_acquire(ml_op *op, const ml_lockref *r, const char *owner, int64_t ttl_ms,
                          const bson_t *insert);
/* extra: NULL, or a caller's update of operators (checked by the caller not
 * to touch the lock fields) applied in the same command */
void ml_build_release(ml_op *op, const ml_lockref *r, const char *owner, const bson_t *extra);
void ml_build_extend(ml_op *op, const ml_lockref *r, const char *owner, int64_t ttl_ms);
void ml_build_force_release(ml_op *op, const char *db, const char *coll, const char *name);
void ml_build_leave(ml_op *op, const char *db, const char *coll, const char *name,
                    const char *waiter, const char *tag);
/* the first two stages of a leave from the queue field `queue` (queue or
 * squeue): the waiter's entry out, and a wake-up handed to it (next: tag
 * and waiter) passed on to the expression handed_on.on */
void ml_leave_stages(bson_t *u, const char *queue, const char *waiter, const char *tag,
                     const bson_t *handed_on);
/*
 * Renewal of every lease a keeper holds in db.coll, in one command: an
 * update with multi that matches the lock documents where keeper holds a
 * live lease (the exclusive one: keeper and expiresAt after $$NOW; or a
 * live entry of holders with k = keeper) and sets each such lease's end to
 * $$NOW plus its own ttl (ML_F_TTL, a holder's l).  A lease whose end has
 * passed is never brought back.  matched = the documents renewed.
 */
void ml_build_renew(ml_op *op, const char *db, const char *coll, const char *keeper);
/*
 * What keeper still holds in db.coll, after a renewal that matched fewer
 * documents than expected: an aggregate whose documents are {o: the owner
 * of a live exclusive lease of keeper or null, h: [owners of its live
 * shares and permits]}.
 */
void ml_build_renew_check(ml_op *op, const char *db, const char *coll, const char *keeper);
/* The owners a check's reply names (its {o, h: [..]} documents): each live
 * exclusive lease's owner and each live share's or permit's, sorted, as
 * pointers into the reply (valid while it is).  A check after a batch of
 * tens of thousands of leases answers as many owners: each lease is looked
 * up in O(log n), not by a walk of the reply. */
typedef struct ml_owners {
  const char **v;
  size_t n;
} ml_owners;
/* 1, or 0 when out of memory (*s then empty) */
int ml_parse_check(const bson_t *reply, ml_owners *s);
int ml_owners_has(const ml_owners *s, const char *owner);
void ml_owners_free(ml_owners *s);
/*
 * Renewal of document locks: every listed (_id, owner) pair of r's
 * collection and fields whose lease is still live, in one update with
 * multi; ids: {"0": _id, ...}, owners the same count of owner ids.
 */
void ml_build_doc_renew(ml_op *op, const ml_lockref *r, const bson_t *ids, const char *const *owners,
                        size_t n, int64_t ttl_ms);
/*
 * The release of several leases of one collection and kind in one update
 * with multi (a closing client's, collected handles'): each listed
 * (_id, owner) pair whose owner still holds the lock is released as
 * ml_build_release releases it (a named lock handed to its first waiter);
 * ids {"0": _id, ...} and owners of the same count.
 */
void ml_build_release_many(ml_op *op, const ml_lockref *r, const bson_t *ids,
                           const char *const *owners, size_t n);
/*
 * Elections (a leader is the holder of a named lock):
 *   proclaim  {update: coll, updates: [{q: {_id, owner: OWNER, $expr: the lease
 *             is live}, u: [{$set: {value: V, valueToken: "$token"}}]}]}: the
 *             leader's new value, same term; matched 0 = not leading
 *   leader    {aggregate: coll, pipeline: [{$match: {_id}}, {$project: owner,
 *             token, value, valueToken, holder, acquiredAt, expiresAt, ttl,
 *             held, remainingMs}], cursor: {}} run as a command (its reply
 *             keeps the operationTime an observer starts its stream at)
 *   observe   a change stream of the one document {_id: name} from (t, i), or
 *             after resume_token when not NULL, with the events that end a
 *             stream (drop, rename, dropDatabase, invalidate)
 */
void ml_build_proclaim(ml_op *op, const char *db, const char *coll, const char *name,
                       const char *owner, const char *value);
void ml_build_leader(ml_op *op, const char *db, const char *coll, const char *name);
void ml_build_observe(ml_op *op, const char *db, const char *coll, const char *name,
                      uint32_t t, uint32_t i, const bson_t *resume_token);
/* NULL when fine, else what is wrong with an election's value */
const char *ml_check_value(const char *s, size_t len);

/* name NULL: every lock of the collection, sorted by name */
void ml_build_status(ml_op *op, const char *db, const char *coll, const char *name);
/* a document lock's status: owner and remainingMs of r's document */
void ml_build_doc_status(ml_op *op, const ml_lockref *r, int64_t ttl_ms);
void ml_build_ensure_index(ml_op *op, const char *db, const char *coll, int32_t expire_after);
/* client:command: cmd's one key, then every field of opts (may be NULL) */
void ml_build_command(ml_op *op, const char *db, const bson_t *cmd, const bson_t *opts);

/*
 * The change-stream filter: {pipeline: [{$match: ...}]} passing the events
 * that may wake a waiter of this process (tag) on the owner field `field`
 * (releases, deletes, and the events that end a stream).  csrc/binding/watch.c
 * describes them.
 */
void ml_build_watch_pipeline(bson_t *out, const char *field, const char *tag);

/* where a change stream starts: {startAtOperationTime: (t, i)}, or
 * {resumeAfter: resume_token} when it is not NULL (libmongoc's watch
 * options, and the $changeStream stage) */
void ml_build_watch_start(bson_t *out, uint32_t t, uint32_t i, const bson_t *resume_token);

/* the change stream as a plain aggregate, for a transport that keeps no
 * cursor of libmongoc: starting at (t, i), or after resume_token when it
 * is not NULL; the cursor's first batch is empty.  tag NULL: every change
 * of the collection (operationType, documentKey, clusterTime), no filter,
 * starting now when t, i and resume_token are all unset */
void ml_build_watch(ml_op *op, const char *db, const char *coll, const char *field,
                    const char *tag, uint32_t t, uint32_t i, const bson_t *resume_token);
void ml_build_getmore(ml_op *op, const char *db, const char *coll, int64_t cursor_id,
                      int64_t await_ms);
void ml_build_killcursors(ml_op *op, const char *db, const char *coll, int64_t cursor_id);

/* ---- replies ----------------------------------------------------------- */

/* an acquire's reply (named or document lock) */
typedef struct ml_acquire_reply {
  int won;                          /* the returned owner is ours */
  bson_t value;                     /* the returned lock document (named) or
                                       the application's document (document
                                       lock); a view into the reply */
  int64_t token;                    /* 0 when none */
  int has_remaining;
  int64_t remaining_ms;             /* the holder's lease, server's clock */
  int has_expires;
  int64_t expires_ms;
  int64_t queued;                   /* -1 when not in the reply */
  int64_t position;                 /* 0-based place of the waiter, -1 none */
  int has_holder;
  bson_t holder;                    /* view */
  int64_t holders, readers;         /* live shares (readers' and permits),
                                       readers' alone; -1 when not in the reply */
  bson_iter_t owner;                /* the owner field's value (when has_owner) */
  int has_owner;
  int64_t delay_ms;                 /* the lock's ML_F_DELAY, 0 when none */
} ml_acquire_reply;

/* the ms left of a name's lock-delay (ML_F_DELAY) on the server's clock,
 * given its lease's time left (remaining_ms, negative once ended): > 0
 * while a lease that ended unreleased keeps the name taken, else 0 */
int64_t ml_delay_left(int64_t delay_ms, int has_remaining, int64_t remaining_ms);

/* r: r->owner_field and r->owner_form say where and how the owner is
 * read; doc: a document-lock reply ({doc, remainingMs}).  Returns 0 when
 * the reply has no document (findAndModify matched nothing). */
int ml_parse_acquire(const bson_t *reply, const char *owner, const char *owner_field,
                     ml_owner_form form, int doc, ml_acquire_reply *out);

/* documents matched by an update (update_one's matchedCount, or a
 * server's n); -1 when the reply has neither */
int64_t ml_parse_matched(const bson_t *reply);

/* the operationTime of a reply (a replica set's); 0 when it has none */
int ml_parse_operation_time(const bson_t *reply, uint32_t *t, uint32_t *i);

/* one status document (a named lock's, from ml_build_status).  Its state:
 * held (a live exclusive owner); shared or permits (no live exclusive
 * owner, holders > 0 live readers' shares or permits: a semaphore's when
 * has_permits); expired (an owner whose lease ended unreleased: owner,
 * holder and expires_ms say whose and when); free (released, or never
 * held) */
typedef struct ml_status {
  const char *name;                 /* NULL when not a string */
  int held;                         /* a live exclusive owner */
  const char *owner;                /* NULL when free */
  int has_token, has_acquired, has_expires, has_remaining, has_waiting, has_holder;
  int has_holders, has_readers, has_permits;
  int64_t token, acquired_ms, expires_ms, remaining_ms, waiting;
  int64_t holders, readers, permits;
  bson_t holder;                    /* view */
  int64_t delay_ms;                 /* the lock's ML_F_DELAY, 0 when none */
} ml_status;

void ml_parse_status(const bson_t *doc, ml_status *out);

/* iterates the documents of a cursor reply's first batch (or nextBatch);
 * 0 when the reply has none; *cursor_id when not NULL */
int ml_reply_batch(const bson_t *reply, bson_iter_t *docs, int64_t *cursor_id);

/* the next document of a batch that ml_reply_batch began (a view into the
 * reply), skipping elements that are not well-formed documents; 0 at its
 * end */
int ml_batch_next(bson_iter_t *docs, bson_t *doc);

/* a change stream batch's cursor.postBatchResumeToken (a view into
 * reply); 0 when it has none */
int ml_reply_resume_token(const bson_t *reply, const uint8_t **data, uint32_t *len);

/* one change event, reduced to what a waiter needs */
typedef struct ml_event {
  int has_key;
  bson_iter_t key;                  /* documentKey._id */
  char next[49];                    /* the waiter a release was handed to,
                                       when in this process (tag); "" = every
                                       waiter */
  char owner[33];                   /* with next: the lock was granted to
                                       that waiter (owner = its id) in the
                                       same write; "" otherwise */
  int64_t token;                    /* with owner: the granted token */
  int64_t grant_ms;                 /* with owner: expiresAt - acquiredAt,
                                       -1 when the event lacks either */
  char lost[33];                    /* the owner id of a lease of this
                                       process (tag) the write ended (a
                                       takeover, a forced release: its
                                       ML_F_LOST), "" otherwise */
  int deleted;                      /* a delete of the document */
  int wakes;                        /* it may wake a waiter (an event that
                                       passed only for lost does not) */
  uint32_t t, i;                    /* clusterTime (UINT32_MAX: none) */
} ml_event;

void ml_parse_event(const bson_t *doc, const char *tag, ml_event *out);

/* ---- values, one rule each --------------------------------------------- */

/* NULL when fine, else what is wrong */
const char *ml_check_name(const char *s, size_t len);
const char *ml_check_db(const char *s, size_t len);
const char *ml_check_coll(const char *db, const char *s, size_t len);
const char *ml_check_field(const char *s, size_t len);

/* 1 when s is n lowercase hex digits */
int ml_is_hex(const char *s, size_t len, size_t n);

/* a ttl in (possibly fractional) milliseconds -> whole milliseconds,
 * rounded up; 0 when not positive, over a year, or NaN */
int64_t ml_ttl_ms(double ms);

/* appends the owner id (32 hex digits) under key in form */
void ml_append_owner(bson_t *b, const char *key, const char *owner, ml_owner_form form);

/* does the value at it (a string or a UUID binary) hold the owner id? */
int ml_owner_is(const bson_iter_t *it, const char *owner, ml_owner_form form);

/* integer value of a numeric or date field, else dflt */
int64_t ml_iter_int64(const bson_iter_t *it, int64_t dflt);

/* ---- for the builders only (protocol.c, protocol_shared.c) ------------- */

/* {v: keeper id or null} in *doc (the caller destroys it), *it at v */
void ml_keeper_value(bson_t *doc, bson_iter_t *it, const char *keeper);
/* the same for a lock-delay as an acquire writes it (ML_F_DELAY): the
 * number when > 0, else "$$REMOVE" (the field removed) */
void ml_delay_value(bson_t *doc, bson_iter_t *it, int64_t delay_ms);

/* appends to q: _id among ids and owner_field among owners (n of them) */
void ml_pairs_filter(bson_t *q, const char *owner_field, ml_owner_form form, const bson_t *ids,
                     const char *const *owners, size_t n);

/* an op of kind for db.coll with an empty command */
void ml_op_init(ml_op *op, ml_run_kind kind, const char *db, const char *coll);

/* {update: coll, updates: [{q, u}]}: u an update pipeline (pipeline != 0,
 * a document with keys "0", "1", ...) or an update of operators */
void ml_op_update(ml_op *op, const char *db, const char *coll, const bson_t *q, const bson_t *u,
                  int pipeline);

/*
 * BCON fragments shared by the builders: "{" "}" "[" "]" open and close, a
 * bare string in a value's place is a UTF-8 string.  F is a field name
 * literal (ML_F_QUEUE, ...).
 */

/* the array field F, [] when missing or malformed */
#define ML_ARR(F) "{", "$cond", "[", "{", "$isArray", "$" F, "}", "$" F, "[", "]", "]", "}"

/* entries of the array field F whose until is ahead of the server's now
 * (every attempt of a waiter refreshes its until) */
#define ML_LIVE(F)                                                                 \
  "{", "$filter", "{", "input", ML_ARR(F),                                         \
                       "cond", "{", "$gt", "[", "$$this.until", "$$NOW", "]", "}", "}", "}"

/* entries of the holders array F that keep the name: live, or ended
 * unreleased less than their lock-delay (d, ms) ago */
#define ML_KEEPS(F)                                                                \
  "{", "$filter", "{", "input", ML_ARR(F),                                         \
    "cond", "{", "$gt", "[", "{", "$add", "[", "$$this.until",                    \
                               "{", "$ifNull", "[", "$$this.d", BCON_INT64(0), "]", "}", "]", "}", \
                        "$$NOW", "]", "}", "}", "}"

/* the waiters of the array expression that can be woken (p: false; a
 * polling waiter cannot be) */
#define ML_WATCHING(...)                                                           \
  "{", "$filter", "{", "input", __VA_ARGS__,                                       \
    "cond", "{", "$ne", "[", "$$this.p", BCON_BOOL(true), "]", "}", "}", "}"

/* the first watching waiter of the array expression as its process's tag
 * and its id, 48 hex digits; null when there is none */
#define ML_HEAD_TW(...)                                                            \
  "{", "$ifNull", "[",                                                             \
    "{", "$arrayElemAt", "[",                                                      \
      "{", "$map", "{", "input", ML_WATCHING(__VA_ARGS__),                         \
                 "in", "{", "$concat", "[", "$$this.t", "$$this.w", "]", "}", "}", "}", \
      BCON_INT32(0), "]", "}",                                                     \
    BCON_NULL, "]", "}"

/* max(previous + 1, server-ms * 1024): the token rule of every kind */
#define ML_NEXT_TOKEN                                                              \
  "{", "$max", "[",                                                                \
    "{", "$add", "[", "{", "$ifNull", "[", "$" ML_F_TOKEN, BCON_INT64(0), "]", "}", \
                      BCON_INT64(1), "]", "}",                                     \
    "{", "$multiply", "[", "{", "$toLong", "$$NOW", "}", BCON_INT64(1024), "]", "}", "]", "}"

/*
 * No exclusive holder keeps the name (an acquire's and a share's test): no
 * owner and no lock-delay (released), or the lease's end plus its
 * lock-delay (ML_F_DELAY; a release removes it) passed by the server's
 * clock.  A forced release of a lease with a delay leaves the delay and no
 * owner (ml_build_force_release).
 */
#define ML_EXCL_FREE                                                               \
  "{", "$or", "[",                                                                 \
    "{", "$and", "[",                                                              \
      "{", "$eq", "[", "{", "$ifNull", "[", "$" ML_F_OWNER, BCON_NULL, "]", "}", BCON_NULL, "]", "}", \
      "{", "$not", "[", "$" ML_F_DELAY, "]", "}", "]", "}",                        \
    "{", "$lte", "[", "{", "$add", "[", "$" ML_F_EXPIRES,                          \
                        "{", "$ifNull", "[", "$" ML_F_DELAY, BCON_INT64(0), "]", "}", "]", "}", \
                      "$$NOW", "]", "}", "]", "}"


/* {$cond: ["$_mlt", <taken...>, OLD]}: a field of an acquire's $set, the
 * old value written back when the attempt does not take the lock */
#define ML_IF_TAKEN(OLD, ...) "{", "$cond", "[", "$_mlt", __VA_ARGS__, OLD, "]", "}"

/* a waiter's queue entry: its id, its process's tag, until when its place
 * is kept, whether it polls */
#define ML_ENTRY(W, T, Q, P)                                                       \
  "{", "w", BCON_UTF8(W), "t", BCON_UTF8(T),                                       \
       "until", "{", "$add", "[", "$$NOW", BCON_INT64(Q), "]", "}", "p", BCON_BOOL(P), "}"

#endif
