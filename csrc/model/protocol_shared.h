/*
 * The protocol of the shared kinds (doc/design.md, "Shared kinds"):
 * reader shares of a reader-writer lock and permits of a counting
 * semaphore, each an entry of the lock document's holders array with its
 * own owner id, lease end (server time) and fencing token.  Pure builders
 * and a parser, like protocol.h (whose ml_op and fragments they use).
 */
#ifndef MONGOLOCK_PROTOCOL_SHARED_H
#define MONGOLOCK_PROTOCOL_SHARED_H

#include "protocol.h"

#define ML_F_HOLDERS "holders"        /* [{o, m, until, tk, at, h, k, l}] shares */
#define ML_F_PERMITS "permits"        /* a semaphore's N, fixed at first use */
#define ML_F_SQUEUE "squeue"          /* [{w, t, until, p}] waiting sharers */

#define ML_MODE_SHARED 's'            /* a reader's share */
#define ML_MODE_PERMIT 'p'            /* a semaphore's permit */
#define ML_PERMITS_MAX 1000000

/* a share's acquire: what an exclusive attempt writes (a), and mode
 * (ML_MODE_SHARED or ML_MODE_PERMIT) with permits (N, 1..ML_PERMITS_MAX) */
void ml_build_share_acquire(ml_op *op, const ml_acquire_args *a, int mode, int64_t permits);
/* id: {_id: name} */
void ml_build_share_release(ml_op *op, const char *db, const char *coll, const bson_t *id,
                            const char *owner);
/* the release of several shares or permits of one collection (ids and
 * owners: ml_build_release_many's) in one update with multi */
void ml_build_share_release_many(ml_op *op, const char *db, const char *coll, const bson_t *ids,
                                 const char *const *owners, size_t n);
void ml_build_share_extend(ml_op *op, const char *db, const char *coll, const bson_t *id,
                           const char *owner, int64_t ttl_ms);
void ml_build_share_leave(ml_op *op, const char *db, const char *coll, const char *name,
                          const char *waiter, const char *tag);
void ml_build_share_force_release(ml_op *op, const char *db, const char *coll, const char *name);
void ml_build_share_status(ml_op *op, const char *db, const char *coll, const char *name);

/* a share acquire's reply */
typedef struct ml_share_reply {
  int won;                          /* our entry is among the live holders */
  int mismatch;                     /* the name is of another kind, or a
                                       semaphore of another N (permits) */
  int64_t token;                    /* ours when won */
  int64_t permits;                  /* -1: none */
  bson_t value;                     /* the projected document (a view) */
} ml_share_reply;

/* 0 when the reply has no document */
int ml_parse_share_acquire(const bson_t *reply, const char *owner, int mode, int64_t permits,
                           ml_share_reply *out);

#endif
