/*
 * A change stream's state machine (stream.c): the ring of recent release
 * events that waiters are matched against, and which command the stream
 * needs next, as plain C with no Lua and no I/O.  watch.c keeps the
 * streams of the process, runs their commands (a thread, or Lua inside
 * nginx) and is their Lua side; it serialises every call on one stream.
 */
#ifndef MONGOLOCK_STREAM_H
#define MONGOLOCK_STREAM_H

#include <stdint.h>
#include "protocol.h"

#define ML_RING 256
#define ML_STREAM_IDLE 10.0     /* seconds without a waiter before it ends */
#define ML_STREAM_REOPENS 3     /* failed calls in a row before it fails */

/* a stream's state (state): its first aggregate not yet answered,
 * running, failed (its waiters fall back), ended */
enum { ML_STREAM_STARTING, ML_STREAM_RUNNING, ML_STREAM_FAILED, ML_STREAM_DONE };
/* the op in flight (op_kind): none, the aggregate, a getMore, killCursors */
enum { ML_STREAM_OP_NONE, ML_STREAM_OP_OPEN, ML_STREAM_OP_MORE, ML_STREAM_OP_KILL };

typedef struct watch_event {
  uint8_t *key;                 /* BSON of {"k": documentKey._id}; NULL = any */
  size_t keylen;
  char next[49];                /* the waiter a release was handed to (the
                                   document's next: process tag and waiter
                                   id), "" = every waiter */
  char owner[33];               /* with next: granted to that waiter */
  int64_t token;                /* with owner: the grant's token */
  uint32_t t, i;                /* clusterTime */
} watch_event;

/* an event that ended a lease of this process, for its holder (watch.c
 * hands it to the process's held leases, renew.c) */
#define ML_NOTICES 64
typedef struct ml_notice {
  uint8_t *key;                 /* BSON of {"k": documentKey._id} */
  size_t keylen;
  char owner[33];               /* the lease's owner id (the event's lost),
                                   "" for a delete: every lease of key held
                                   since before (t, i) */
  uint32_t t, i;                /* clusterTime */
} ml_notice;

typedef struct ml_stream {
  char *db, *coll, *field;
  char tag[17];                 /* the process tag its $match routes on */
  int state;
  int stop;                     /* its client closed, or it was stopped */
  char errmsg[256];
  uint32_t errcode;
  double failed_at;
  uint32_t start_t, start_i;    /* the stream sees every release after this */
  watch_event ring[ML_RING];
  unsigned long long seq;       /* events recorded so far */
  uint32_t drop_t, drop_i;      /* newest time pushed out of ring */
  int waiters;                  /* blocked in watch_wait now */
  int holders;                  /* leases of the process on the collection
                                   want its notices: it reads on without a
                                   waiter (watch.c keeps it) */
  ml_notice notices[ML_NOTICES];  /* not yet handed to the holders */
  int nnotices;
  long noticed;                 /* notices made (those past ML_NOTICES
                                   not yet handed over are dropped) */
  int64_t await_ms;             /* a getMore's maxAwaitTimeMS */
  double polled_until;          /* a non-blocking waiter (timeout 0) looked
                                   recently: keep reading until then */
  double idle_since;
  int open;                     /* its session is open: a killCursors is due */
  int stale;                    /* the cursor is to be replaced (killCursors,
                                   then a new aggregate) */
  int64_t cursor_id;
  char session[33];             /* this opening's session key */
  bson_t *resume;               /* the last batch's postBatchResumeToken */
  int tries;                    /* failed calls in a row */
  double retry_at;              /* no new aggregate before */
  int op_kind;                  /* the op in flight, ML_STREAM_OP_NONE */
  ml_op op;
  long events, reopens, getmores, opens;
  long answered, handed, granted;  /* watch_wait's answers: an event, a
                                      release handed to the waiter by name,
                                      a grant */
} ml_stream;

/* the next op of s (built into s->op, s->op_kind set), or 0 with *wake the
 * time something may be due (HUGE_VAL: nothing, the stream is finished or
 * waits for its op in flight) */
int ml_stream_next(ml_stream *s, double now, double *wake);

/* the outcome of s's op in flight, at now (ok: reply is the server's
 * answer, else err says why) */
void ml_stream_done(ml_stream *s, double now, int ok, const bson_t *reply, const bson_error_t *err);

/* s failed at now: its waiters fall back (e's message, "change stream: "
 * first) */
void ml_stream_fail(ml_stream *s, const bson_error_t *e, double now);

/* a stream that ended (idle, stopped, failed) and has nothing left to send */
int ml_stream_finished(const ml_stream *s);

/* has a release of key (BSON {"k": _id}) after (t, i) been seen, for every
 * waiter or for this one (waiter NULL: any release)?  0 no, 1 yes (*mine:
 * handed to waiter by name), 2 it granted the lock to waiter (*grant: that
 * event) */
int ml_stream_seen(const ml_stream *s, const bson_t *key, const char *waiter, uint32_t t,
                   uint32_t i, const watch_event **grant, int *mine);

/* frees the notices taken (s->notices[0 .. nnotices)) and empties them */
void ml_stream_notices_clear(ml_stream *s);

/* is (t1, i1) after (t2, i2) */
int ml_ts_after(uint32_t t1, uint32_t i1, uint32_t t2, uint32_t i2);

/* frees what s owns (not s) */
void ml_stream_clear(ml_stream *s);

#endif
