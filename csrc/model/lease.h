/*
 * The lease as plain C (no Lua, no I/O): what a handle holds (lock.c), what
 * the lease engine decides on (engine.c), each kind's commands (lease.c's
 * table, ml_kind_ops), and the client's counters and lease events they
 * both write (obs.c).  Implemented by lease.c and obs.c, which include
 * nothing but this header, protocol*.h, libbson and pthreads; the binding's
 * lock.h, renew.h and stats.c include it.
 */
#ifndef MONGOLOCK_LEASE_H
#define MONGOLOCK_LEASE_H

#include <stdint.h>
#include <pthread.h>
#include <sys/types.h>
#include "protocol.h"

struct ml_client;

/* seconds on CLOCK_MONOTONIC: the only clock the library reads locally */
double ml_monotonic(void);

/* getpid(), kept after the first call and forgotten in the child of a
 * fork (pthread_atfork): every look at "is this still the process that
 * made it" costs a load, not a system call */
pid_t ml_pid(void);

/*
 * What kind of lock a lease is on.  Every kind answers the same strings
 * for the same situation; the kind decides what the document looks like:
 *   ML_KIND_NAMED: a named lock's document (owner, expiresAt, token, the
 *     waiter queue: release hands it to the queue's head; doc/design.md);
 *   ML_KIND_DOCUMENT: two fields of the application's document (their
 *     names, time mode and owner form given; release may apply changes);
 *   ML_KIND_SHARED, ML_KIND_PERMIT: a reader's share or a semaphore's
 *     permit, an entry of a named lock's holders (protocol_shared.h).
 */
typedef enum { ML_KIND_NAMED = 0, ML_KIND_DOCUMENT = 1, ML_KIND_SHARED = 2, ML_KIND_PERMIT = 3 } ml_kind;
#define ML_KINDS 4

/*
 * What a caller of ml_lock_new describes: the lock document and the lease
 * it won.  Everything is copied by ml_lock_new; the caller keeps ownership
 * of what it passed.
 */
typedef struct ml_lease_spec {
  ml_lockref ref;               /* the lock document and its fields;
                                   queued for the named kind alone */
  const char *owner;            /* the 32 hex digits this acquisition wrote */
  int64_t token;                /* fencing token, 0 when the lock has none */
  int64_t ttl_ms;               /* lease length, > 0 */
  double started;               /* ml_monotonic() taken just before the
                                   acquire command was sent */
  int renew;                    /* ask background renewal for this lease */
  ml_kind kind;
  int64_t grant_ms;             /* 0, or a grant's lease (ms from started)
                                   when shorter than ttl_ms: the lease is
                                   topped up to ttl_ms in the background */
  int waiter;                   /* a waiter's attempt (owner: its waiter id,
                                   which its next attempts reuse) */
  int grant_bounded;            /* with grant_ms: the waiter's place was
                                   shorter than ttl_ms, so it may have cut
                                   the grant short */
  uint32_t op_t, op_i;          /* the acquire's operationTime: a change
                                   stream tells the holder of what ended
                                   the lease after it; 0, 0 when unknown (a
                                   standalone server, a grant) */
} ml_lease_spec;

/*
 * The lease behind a mongolock.Lock handle, a plain C struct so that the
 * background renewal thread can read and update it.  Fields marked (mu) are
 * read and written under mu once the handle is visible to another thread;
 * the others never change after ml_lock_new.
 *
 * States (lock.c's lease_state; every method answers from it):
 *   held      held == 1, in the process that acquired (pid);
 *   lost      lost == 1: a renewal or an extend matched nothing, a release
 *             found it taken, or the local deadline passed (set then);
 *             lost never becomes 0 again;
 *   not held  released by this handle, or asked from another process;
 *   closed    the handle was closed, or its client was.
 * Invariants: held == 1 from acquire until the lease ends (released or
 * lost); once 0 it never becomes 1 again.  ending == 1 while a release is
 * under way (and after it succeeded): a renewal that matches nothing then
 * saw the release, not a loss.  pid is the process that acquired: any
 * other process (a forked child) treats the handle as not held and never
 * sends a command for it.
 */
typedef struct ml_lease {
  pthread_mutex_t mu;
  char *db, *coll;
  bson_t iddoc;                 /* {"_id": id}, for the builders */
  bson_value_t id;              /* deep copy (bson_value_copy) */
  char *owner_field, *time_field;
  ml_time_mode time_mode;
  ml_owner_form owner_form;
  char owner[33];
  int64_t token;
  pid_t pid;
  int64_t ttl_ms;               /* (mu) last ttl sent (acquire or extend) */
  int64_t step_ttl;             /* (mu) the ttl of an extend handed out by
                                   core.lease_step, for core.lease_done */
  double deadline;              /* (mu) local monotonic lease end: the time
                                   just before the last successful acquire or
                                   extend was sent, plus ttl */
  int held;                     /* (mu) */
  int renew;                    /* (mu) background renewal wanted */
  int lost;                     /* (mu) sticky, see above */
  int ending;                   /* (mu) see above */
  int refs;                     /* (mu) 1 for the Lua handle, +1 for each
                                   thread holding it; freed at 0 */
  ml_kind kind;
  uint32_t op_t, op_i;          /* the acquire's operationTime, 0, 0 when
                                   unknown (ml_lease_spec) */
  double started;               /* ml_monotonic() just before the acquire */
  int watched;                  /* (renew.c's mutex) its process's change
                                   stream reads on for it (watch.c) */
  struct ml_client *hc;         /* (renew.c's mutex) the client whose held
                                   list has this lease, or NULL */
  struct ml_lease *hprev, *hnext;
  const void *engine;           /* (the engine's lock) the engine (engine.h)
                                   whose items hold it, or NULL; a lease is
                                   an item of one engine at most */
  size_t item;                  /* (the engine's lock) its index there */
  double topup_at;              /* (mu) a grant's short lease: renew.c
                                   extends it to ttl_ms at this monotonic
                                   time, once; 0 when not needed */
  struct ml_obs *obs;           /* its client's counters and events (one
                                   reference), or NULL */
  /* a release nobody waits for that is sent again (engine.c): an acquire
   * whose reply was lost may reach the server after the first release */
  int redo;                     /* releases with a reply still to send */
  int tries;                    /* releases sent so far */
  double release_at;            /* monotonic: not sent before */
} ml_lease;

/* l's mu, taken only in the process that made l.  A forked child's copy of
 * an inherited lease may be locked for ever, by a thread of the parent's
 * (a renewal, a stream's look) that the child does not have; there no
 * thread but the one that reads the child's handle sees the lease (the
 * child's renewal and streams start empty), and nothing acts for it (pid) */
static inline void ml_lease_lock(ml_lease *l) {
  if (l->pid == ml_pid()) pthread_mutex_lock(&l->mu);
}
static inline void ml_lease_unlock(ml_lease *l) {
  if (l->pid == ml_pid()) pthread_mutex_unlock(&l->mu);
}

/* a lost reply's release (lease.redo): sent until this many got a reply
 * (or one matched), RELEASE_REDO_STEP seconds apart, at most
 * RELEASE_REDO_TRIES times in all */
#define ML_RELEASE_REDO 2
#define ML_RELEASE_REDO_STEP 1.0
#define ML_RELEASE_REDO_TRIES 30

/*
 * A client's counters and its queue of lease events (obs.c; stats.c
 * gives them to Lua): what client:counters() and client:take_events() read.  Shared by the client and
 * each of its leases (refs), so a lease that outlives its client's userdata
 * still writes somewhere valid.
 *
 * Invariants: counters only grow, by relaxed atomic adds from any thread
 * (the Lua thread, the engine's, a change stream's), so counting takes no
 * lock and no round trip; each add goes to ml_obs_totals too, so the
 * process's totals never go back when a client closes or is collected.
 * Places (releases and losses by collection) are linked under mu, then
 * counted by atomic adds.  Events are queued only while `want` is set (a
 * callback is registered), under mu, a leaf lock: taken under renew.c's mutex and a
 * lease's mu, never the other way round; at most ML_EVENTS_MAX wait in the
 * queue (older ones are dropped, and counted).
 */
#define ML_EVENTS_MAX 1024
typedef struct ml_lease_event {
  ml_kind kind;
  int failed;                   /* 1 a renewal failed (still held), 0 lost */
  char *db, *coll;
  bson_t iddoc;                 /* {"_id": id} */
  int64_t token;
  char owner[33];
} ml_lease_event;

/* the releases and losses of one kind of lock in one collection of a
 * client (or, total NULL, of the process: ml_obs_totals' places) */
typedef struct ml_obs_place {
  struct ml_obs_place *next;
  ml_kind kind;
  char *collection;             /* "db.coll" */
  long releases, lost;          /* atomic */
  struct ml_obs_place *total;   /* the process's place of the same kind
                                   and collection (never freed) */
} ml_obs_place;

typedef struct ml_obs {
  pthread_mutex_t mu;
  int refs;                     /* atomic (ml_obs_ref, ml_obs_unref) */
  long commands;                /* commands sent by this process's C paths
                                   (the change streams' too) */
  long releases[ML_KINDS];      /* releases that matched, per kind */
  long lost[ML_KINDS];          /* leases found lost, per kind (once each) */
  long renewals, renewal_failures, renewal_batches, renewal_checks;
                                /* the lease engine's (renew.c) */
  long stream_getmores, stream_reopens;  /* the change streams' (watch.c) */
  int want;                     /* queue events (atomic) */
  ml_lease_event *ev;           /* (mu) the queue, oldest first */
  size_t nev, cap;              /* (mu) */
  long dropped;                 /* (mu) events dropped from a full queue */
  ml_obs_place *places;         /* (mu to link) releases and losses by kind
                                   and collection, newest first; a place
                                   once linked stays until the obs goes */
  struct ml_obs *next, *prev;   /* every client's, for fork (obs.c) */
} ml_obs;

/* the process's totals: every client's counters (ml_obs_add) summed, kept
 * whatever clients close or are collected; only the counters are used */
extern ml_obs ml_obs_totals;

ml_obs *ml_obs_new(void);
ml_obs *ml_obs_ref(ml_obs *o);
void ml_obs_unref(ml_obs *o);
/* adds n to *counter, a counter of o, and to the same counter of
 * ml_obs_totals (relaxed atomics); o may be NULL */
void ml_obs_add(ml_obs *o, long *counter, long n);
/* the first of the process's places (ml_obs_totals'), newest first: its
 * list only grows, each place linked whole (read without a lock) */
ml_obs_place *ml_obs_total_places(void);
/* frees what an event taken from the queue owns */
void ml_lease_event_free(ml_lease_event *e);
/* l->mu held: l is lost (held 0); the first time, counted and its event
 * queued */
void ml_lease_set_lost(ml_lease *l);
/* a release of l matched: counted */
void ml_lease_count_release(ml_lease *l, long n);
/* a renewal of l failed (l keeps its state): its event queued */
void ml_lease_renewal_failed(ml_lease *l);
/*
 * The local deadline of a lease of ms milliseconds whose command was sent
 * at started (monotonic): the server set its end after that instant, so
 * started + ms is never later than the server's end; a margin for a local
 * clock that runs slow against the server's (1e-3 of the lease, NTP slews
 * by at most 5e-4, plus 2 ms) is taken off.
 */
double ml_lease_deadline(double started, int64_t ms);

/*
 * A new lease for what s describes (everything copied), held, with one
 * reference (the caller's) and no counters (obs NULL: the binding sets
 * them); its deadline from s->started and the grant's or the ttl's length.
 */
ml_lease *ml_lease_new(const ml_lease_spec *s);

/*
 * Fills s (zeroed first) for a lease on the lock document of a named kind
 * (exclusive, shared, permit): {_id: name} in db.coll (ml_named_ref), the
 * owner or holders in owner_field.  id must outlive s.
 */
void ml_lease_spec_named(ml_lease_spec *s, ml_kind kind, const char *db, const char *coll,
                         const bson_t *id, const char *owner_field, const char *owner,
                         int64_t ttl_ms);

/* [-0, +0] drops one reference to lease (frees it at zero) */
void ml_lease_unref(ml_lease *l);

/*
 * What each kind does with the lease's commands (lease.c's table, indexed
 * by ml_kind): the engine and the handle ask it instead of switching on
 * the kind.
 */
typedef struct ml_kind_ops {
  const char *name;             /* "named", "document", "shared", "permit" */
  int queued;                   /* its document has the waiter queue */
  int changes;                  /* its release may write the application's
                                   changes (a document lock's) */
  int own_fields;               /* its fields are the application's: leases
                                   share a command only with the same
                                   fields */
  int release_class;            /* leases of one collection, one class and
                                   the same fields are released by one
                                   release_many */
  int by_keeper;                /* renewed with every such lease of its
                                   collection by the keeper id
                                   (ml_build_renew; ml_parse_check reads
                                   the check that follows a batch that
                                   matched fewer); 0: by a batch of its _ids of the
                                   same fields and ttl (renew_many) */
  void (*release)(ml_op *op, const ml_lockref *r, const char *owner, const bson_t *extra);
  void (*release_many)(ml_op *op, const ml_lockref *r, const bson_t *ids,
                       const char *const *owners, size_t n);
  void (*extend)(ml_op *op, const ml_lockref *r, const char *owner, int64_t ttl_ms);
  void (*renew_many)(ml_op *op, const ml_lockref *r, const bson_t *ids,
                     const char *const *owners, size_t n, int64_t ttl_ms);
} ml_kind_ops;

const ml_kind_ops *ml_kind_of(ml_kind kind);

/* a and b released by one command (release_many): one collection, one
 * release class (and for own_fields kinds the same fields) */
int ml_lease_same_release(const ml_lease *a, const ml_lease *b);
/* a and b renewed by one command: by_keeper kinds of one collection; else
 * one collection, the same fields and the same ttl */
int ml_lease_same_renewal(const ml_lease *a, const ml_lease *b);

/* the steps of the lease's commands, shared by the handle's methods
 * (lock.c) and the engine (engine.c): r for the builders; the release of l
 * (marked as ending first; extra: a document lock's changes or NULL); the
 * release of what s describes (a lease not yet made); the extend of l to
 * ttl_ms */
void ml_lease_lockref(const ml_lease *l, ml_lockref *r);
void ml_lease_release_op(ml_lease *l, const bson_t *extra, ml_op *op);
void ml_lease_spec_release_op(const ml_lease_spec *s, ml_op *op);
void ml_lease_extend_op(ml_lease *l, int64_t ttl_ms, ml_op *op);

/*
 * The documents a release matched, from its outcome (ok: reply is the
 * server's answer; else the error's reply, or empty): a write concern
 * error comes after the write was applied on the primary, so its count
 * says what the release did; -1 for any other error.
 */
int64_t ml_release_matched(int ok, const bson_t *reply);
/* l's state after its release matched n documents (-1: not sent, or no
 * answer): 1 released, 0 it was no longer ours, -1 still held */
int ml_lease_release_done(ml_lease *l, int64_t n);
/* l's state after an extend to ttl_ms begun at started matched n
 * documents (-1: an error, nothing changes): 1 extended, 0 lost, -1 */
int ml_lease_extend_done(ml_lease *l, int64_t n, int64_t ttl_ms, double started);

#endif
