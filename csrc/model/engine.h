/*
 * The lease engine's decisions (engine.c): what every renewed lease of a
 * client does in this process, for every kind and every transport, as
 * plain C with no Lua, no I/O and no clock.  It never runs a command:
 * ml_engine_next puts the next one in e->work, ml_engine_done takes its
 * outcome; the adapters (renew.c: a thread, or Lua inside nginx) run it
 * and keep time (each call is given now).
 * The caller serialises every call on one engine (renew.c's mutex).
 */
#ifndef MONGOLOCK_ENGINE_H
#define MONGOLOCK_ENGINE_H

#include "lease.h"

typedef struct renew_item {
  ml_lease *lease;              /* one reference owned by this item */
  double retry_at;              /* after a failed renewal: not before this */
  int alone;                    /* renewed by a command of its own (after a
                                   batch of document locks matched fewer) */
} renew_item;

/* what the command in flight is: a release (of one lease, or many of one
 * collection and kind), an extend of one lease (a top-up, or a lease
 * renewed by itself), the renewal of a collection's leases by the keeper
 * id, the renewal of a batch of document locks by their _ids, the check
 * after a renewal by the keeper id that matched fewer */
typedef enum {
  ML_WORK_NONE = 0,
  ML_WORK_RELEASE,
  ML_WORK_EXTEND,
  ML_WORK_RENEW,
  ML_WORK_DOC_RENEW,
  ML_WORK_CHECK
} ml_work_kind;

/* the command in flight and what its outcome applies to */
typedef struct ml_work {
  ml_work_kind kind;
  long id;
  ml_lease **set;               /* the leases it is for (a reference each) */
  size_t n, cap;
  size_t docs;                  /* ML_WORK_RENEW: distinct documents of set */
  size_t added;                 /* ML_WORK_RENEW: leases of its collection added
                                   while it ran (they may have matched) */
  int64_t ttl;                  /* ML_WORK_EXTEND, ML_WORK_DOC_RENEW */
  double started;               /* ML_WORK_CHECK: when the renewal it checks began */
  int handed;                   /* given to the external adapter */
  ml_op op;
  int has_op;
} ml_work;

typedef struct ml_engine {
  char keeper[17];              /* the client's keeper id in this process */
  renew_item *items;            /* leases renewed or topped up */
  size_t n, cap;
  ml_lease **rel;               /* releases to send, in order */
  size_t nrel, caprel;
  ml_work work;                 /* the command in flight, if any */
  long seq;                     /* ids of work */
  double due_at;                /* no renewal is due before this */
  int stop;                     /* stopping: every item is dropped */
  /* counters (client:counters, mongolock.testing) */
  long renewals, failures, lost, released, batches, checks;
} ml_engine;

/* The next command to run now in e->work (returns 1), or 0 and in *wake
 * (monotonic) when one may be due.  Drops items whose lease no longer
 * wants renewal and marks leases past their deadline lost. */
int ml_engine_next(ml_engine *e, double now, double *wake);

/* The outcome of e->work (begun at started; now: when the outcome came,
 * monotonic, from which a failed renewal's retry is timed): reply when it
 * ran (ok), else error.  Applies it to the leases and clears the work, or
 * leaves the check that follows a batch that matched fewer in its place
 * (handed out next).  Returns 1 when it was a release (a waiter of the
 * queue's end may look again). */
int ml_engine_done(ml_engine *e, double now, double started, int ok, const bson_t *reply,
                   const bson_error_t *error);

/* l (a lease that asked for renewal) among e's items (one reference
 * taken); *due: when it may need a command.  0 out of memory. */
int ml_engine_add(ml_engine *e, ml_lease *l, double *due);

/* l's release queued (takes over the caller's reference).  0 out of
 * memory. */
int ml_engine_queue_release(ml_engine *e, ml_lease *l);

/* every item, queued release and the work in flight dropped (their
 * references given back); free: the arrays too */
void ml_engine_clear(ml_engine *e, int free_arrays);

#endif
