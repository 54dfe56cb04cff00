/*
 * mongolock private header: the pieces the C files share (doc/design.md
 * has the same layout).
 *
 *   protocol.h/.c  the protocol: the lock documents' schema, every command
 *               on them (pure builders) and every reply parsed
 *   transport.h/.c the transport: runs a built op on libmongoc's pool
 *   ops.c       the protocol and transport seen from Lua (core.op_*,
 *               client:run, core.parse_*), the tables parsed replies make
 *   client.c    mongolock.Client: pool, fork, errors; registers every Client
 *               method
 *   lock.c      mongolock.Lock: the handle on a lease, every Lock method,
 *               the one release path
 *   attempt.c   mongolock.Attempt: an acquire attempt of any kind, its op
 *               and its outcome; the plain methods' one runner
 *   named.c     the named-lock commands (acquire, status, list, ...)
 *   documents.c the document-lock commands and a release's changes
 *   command.c   client:command
 *   lease.h/.c  the lease as plain C (the handle's, the engine's), each
 *               kind's commands; obs.c its counters and events (no Lua)
 *   engine.c    the lease engine's decisions: renewal in batches, queued
 *               releases (no Lua, no I/O; engine.h)
 *   renew.c     the engines of the process and their adapters (a thread per
 *               client and process; Lua, inside nginx)
 *   stream.c    a change stream's machine and ring (no Lua, no I/O; stream.h)
 *   watch.c     change-stream waits: the streams and their adapters
 *   bson.c      Lua value <-> BSON, and the typed values (null, ObjectId, ...)
 *   core.c      luaopen_mongolock_core: module table, core.monotonic, ids
 *
 * testing.c is the specs' module (mongolock.testing), built next to the
 * core and never shipped; it reads the core through ml_internals.  proc.c
 * is a module of its own (mongolock.proc, child processes for the
 * mongolock command) and does not use this header.
 *
 * Only luaopen_* are exported; everything else is static or hidden (the
 * build uses -fvisibility=hidden).
 */
#ifndef MONGOLOCK_H
#define MONGOLOCK_H

#include <stdint.h>
#include <pthread.h>
#include <sys/types.h>
#include <time.h>
#include <mongoc/mongoc.h>
#include "compat.h"
#include "protocol.h"
#include "transport.h"

#define ML_CLIENT_MT "mongolock.Client"
#define ML_LOCK_MT "mongolock.Lock"

/* ---- core.c ------------------------------------------------------------ */

/* sleeps for s seconds (s <= 0 returns at once); restarts on EINTR */
void ml_sleep(double s);

/*
 * Writes 128 random bits from getrandom(2) as 32 lowercase hex digits and a
 * NUL into out.  Returns 1, or 0 when the kernel gave no randomness (out is
 * then untouched).
 */
int ml_random_owner(char out[33]);

/* this process's tag, 16 hex digits and a NUL (drawn again after fork);
 * 0 when the kernel gave no randomness */
int ml_process_tag(char out[17]);

/* seconds on CLOCK_MONOTONIC as an absolute timespec (for timed waits on
 * condition variables with a monotonic clock), clamped to 0 .. 1e12 */
struct timespec ml_timespec(double s);

/* [-0, +0] add the Client / Lock metatables and functions to the module
 * table at the top of the stack (called once from luaopen_mongolock_core) */
void ml_client_open(lua_State *L);
void ml_lock_open(lua_State *L);

/* ---- client.c ---------------------------------------------------------- */

/*
 * A mongolock.Client userdata.  One pool per process: the pid that created
 * the pool is remembered and a child re-creates its own on first use (the
 * parent's pool is abandoned in the child, never destroyed there, as
 * libmongoc requires).
 *
 * Invariants: pool == NULL <=> closed (after close, or before first use in a
 * new process, which re-creates it).  client is this Lua state's connection,
 * popped from pool; it belongs to pool and is pushed back before pool is
 * destroyed.  Other threads (background renewal) pop their own client from
 * ml_client_pool(), never use `client`.
 */
typedef struct ml_client {
  mongoc_client_pool_t *pool;   /* this process's pool, NULL until made */
  mongoc_client_t *client;      /* the Lua side's connection from pool */
  mongoc_uri_t *uri;            /* parsed once at connect; owns options */
  mongoc_write_concern_t *wc;   /* for every write ("majority" default) */
  pid_t pid;                    /* process that made pool/client */
  int closed;                   /* 1 after close(): every use raises */
  char *default_db;             /* the URI's database, or NULL */
  /*
   * Called (if set) from close and __gc before the pool is destroyed, with
   * the pool still valid: the background renewal thread (renew.c) stops
   * using the pool and drops its connection there.  renew_state is its own.
   */
  void (*on_close)(struct ml_client *c);
  void *renew_state;
  struct ml_lease *held;        /* (renew.c's mutex) the leases of handles
                                   made on this client: close releases
                                   those still held */
  int external;                 /* its lease engine is driven from Lua
                                   (client:set_external, renew.c) */
  struct ml_orphan *orphan;     /* on_close handed the pool to background
                                   threads still inside a call (a getMore, a
                                   server selection): the last holder
                                   destroys it, not close */
  struct ml_obs *obs;           /* its counters and events (stats.c); one
                                   reference, dropped by __gc */
} ml_client;

/*
 * A closing client's pool that background threads still use: close hands
 * it over when a thread is inside a call it cannot interrupt, and detaches
 * that thread.  Each holder (close until it ends, each such thread) has
 * one reference; the last one dropped destroys the pool.
 */
typedef struct ml_orphan {
  mongoc_client_pool_t *pool;
  int refs;
} ml_orphan;

/* c's orphan (made on first use, with close's own reference), with one
 * more reference for the caller; NULL when out of memory.  From close's
 * on_close only. */
ml_orphan *ml_orphan_take(ml_client *c);
/* drops one reference; the last destroys the pool */
void ml_orphan_drop(ml_orphan *o);
/* keeps this library loaded for the rest of the process: a detached
 * thread may outlive every client, and lua_close unloads the library */
void ml_pin_library(void);

/* raises unless idx is an open mongolock.Client */
ml_client *ml_checkclient(lua_State *L, int idx);

/* [-0, +0] raises on a closed client.  The calling process's connection
 * (the pool and the connection are created on first use, and re-created in
 * a child after fork).  Use it from the Lua thread only. */
mongoc_client_t *ml_client_get(lua_State *L, ml_client *c);

/* [-0, +0] raises on a closed client.  The calling process's pool (made on
 * first use / after fork): other threads pop their own client from it with
 * mongoc_client_pool_pop and push it back.  The pool lives until close. */
mongoc_client_pool_t *ml_client_pool(lua_State *L, ml_client *c);

/* Every pool is made and destroyed through these two: while one is open,
 * process exit skips the C library's and libmongoc's teardown, which would
 * race the background threads (client.c, "process exit"). */
mongoc_client_pool_t *ml_pool_new(const mongoc_uri_t *uri);
void ml_pool_destroy(mongoc_client_pool_t *pool);

/* the database locks live in when none is given: the URI's, else
 * "mongolock" */
const char *ml_client_dbname(const ml_client *c);

/* appends writeConcern (the client's) to opts: every write command uses it */
void ml_client_append_wc(const ml_client *c, bson_t *opts);

/* [-0, +3] pushes nil, e->message, e->code; returns 3 */
int ml_pusherror(lua_State *L, const bson_error_t *e);

/* [-0, +3] pushes nil, msg, code; returns 3 (code 0 pushes nil as the code) */
int ml_pushfail(lua_State *L, const char *msg, int code);

/* [-0, +1] pushes an int64 as a Lua integer (5.4) or number (LuaJIT; exact
 * up to 2^53, which tokens stay below until the year 2248) */
void ml_pushint64(lua_State *L, int64_t v);

/* ---- lock.c ------------------------------------------------------------ */

#include "lease.h"

/* one command sent for c (stats.c) */
void ml_obs_command(const ml_client *c);

/* client:counters(), client:take_events(), client:watch_events(bool) */
int ml_m_counters(lua_State *L);
/* core.totals(): every client's counters in this process, for ever */
int ml_l_totals(lua_State *L);
int ml_m_take_events(lua_State *L);
int ml_m_want_events(lua_State *L);
int ml_m_has_events(lua_State *L);

/* the userdata: a box, so that the lease can outlive it (handed to renew.c) */
typedef struct ml_lock {
  ml_lease *lease;              /* NULL once closed */
  ml_lease *keep;               /* a reference kept until __gc, so that
                                   h.name, h.token, ... stay readable after
                                   close; never used to act on the lock */
} ml_lock;

/*
 * [-0, +1] pushes a new mongolock.Lock for a lease just won.  client_idx is
 * the client's stack index (kept alive through the handle's uservalue).
 * Raises only on out-of-memory.
 */
ml_lock *ml_lock_new(lua_State *L, int client_idx, const ml_lease_spec *spec);

/*
 * The end of an acquire attempt whose findAndModify ran, for every kind
 * that makes a handle (the client at stack index 1).  ok: 1 a reply with
 * the document, 0 an error in err, -1 a reply without the document.
 * Returns 1 with the new handle pushed (won), 3 with nil, message, code
 * pushed (an error: what the write took, s's lease, is released first),
 * or 0 with nothing pushed (not won: the caller answers "busy" and what
 * the reply says).
 */
int ml_push_won(lua_State *L, ml_client *c, int ok, int won, const ml_lease_spec *s,
                const bson_error_t *err);

/* raises unless idx is a mongolock.Lock (open or closed) */
ml_lock *ml_checklock(lua_State *L, int idx);

/*
 * The one release of a lease, whoever ends it (h:release, h:close,
 * __close, __gc, the renewal thread for a collected handle): one command
 * that clears the lock fields of l's document if l's owner still holds it,
 * applying `extra` (an update document of operators, e.g. {$set: {...}};
 * may be NULL) in the same command, then the lease's state: 1 released
 * (held = 0), 0 it was no longer ours (held = 0, lost = 1), -1 error
 * (error set; the lease stays held and renewed).  Uses the given
 * connection (any thread).
 */
int ml_lease_end(mongoc_client_t *mc, const ml_client *c, ml_lease *l, const bson_t *extra,
                 bson_error_t *error);

/*
 * One command: renews l's lease to ttl_ms from the server's now if l's owner
 * still holds it; on success sets l->deadline from `started` (the local
 * monotonic time just before the command).  Returns 1 extended, 0 lost,
 * -1 error.
 */
int ml_lease_extend(mongoc_client_t *mc, const ml_client *c, ml_lease *l,
                    int64_t ttl_ms, double started, bson_error_t *error);

/*
 * Hook for background renewal (renew.c): when set, __gc of a handle whose
 * lease is still held calls it instead of releasing synchronously, handing
 * over the Lua handle's reference (it must release the lease and unref it).
 * Returns 0 to decline, then __gc releases synchronously.
 */
extern int (*ml_gc_handoff)(ml_client *c, ml_lease *l);

/* runs an update op (and destroys it): documents matched (>= 0), or -1
 * with error set */
int64_t ml_run_update(mongoc_client_t *mc, const ml_client *c, ml_op *op, bson_error_t *error);

/* named.c: the arguments of the lock commands.  A lock name at i (1..1024
 * bytes of UTF-8, no NUL; a number is no name); a waiter id at i (32
 * lowercase hex digits); a ttl in milliseconds at i (positive, at most a
 * year, rounded up).  Each raises at the caller. */
const char *ml_arg_name(lua_State *L, int i, size_t *len);
/* the lock of arguments 2 .. 4: database, collection, name */
const char *ml_arg_lock(lua_State *L, const char **db, const char **coll);
const char *ml_arg_waiter(lua_State *L, int i);
int64_t ml_arg_ttl_ms(lua_State *L, int i);
/* what an attempt's strings point into */
typedef struct ml_attempt {
  char owner[33], tag[17], host[256];
} ml_attempt;
/* an acquire's attempt (ml_acquire_args) from arguments: the holder (this
 * host and process, the app at app_i or else the URI's appname) and, with a
 * waiter id at waiter_i, the waiter with queue_ms at waiter_i + 1 and
 * polling at waiter_i + 2 (the waiter id is then the owner), else a new
 * owner id; a's strings point into t.  Raises on a bad argument; returns
 * 0 when getrandom failed. */
int ml_arg_attempt(lua_State *L, ml_client *c, int app_i, int waiter_i, ml_acquire_args *a,
                   ml_attempt *t);
/* the same with the owner at owner_i (owner_i > 0): 32 lowercase hex
 * digits, or nil for a new one; a waiter's must be nil or the waiter id */
int ml_arg_attempt_owner(lua_State *L, ml_client *c, int app_i, int waiter_i, int owner_i,
                         ml_acquire_args *a, ml_attempt *t);

/*
 * An acquire attempt, one round trip of client:acquire, campaign,
 * share_acquire or doc_acquire, as one shape for every kind (attempt.c):
 * prepared from the method's arguments, its op built, its outcome taken
 * by the kind's tail (the handle made, a write concern error's win given
 * back, a reply lost even to the retry released in the background).  The
 * plain method runs the three steps on this thread (ml_attempt_method);
 * client:X_attempt(<X's arguments> [, owner]) makes a mongolock.Attempt
 * (ml_attempt_prepare) for a transport that runs the op elsewhere (an nginx
 * worker thread, a coroutine scheduler's pool):
 *   a:op()      -> the op (core.op_* envelope), nothing sent; the attempt
 *                  is sent from then (its started time: now)
 *   a:take(reply, message, code, ereply, domain) -> X's answers: the
 *                  outcome of the op as client:run answers it, taken once
 *   a:owner()   -> the owner id its op writes
 * Each kind plugs in its own table (ml_attempt_kind).
 */
typedef struct ml_acquire_attempt ml_acquire_attempt;

typedef struct ml_attempt_kind {
  const char *name;                 /* the plain method's name */
  int owner_i;                      /* client:X_attempt's optional owner */
  /* fills t (zeroed, t->kind set) from the method's arguments, the client
   * at 1; owner_i: the slot of a given owner (0: none, a new one).  Raises
   * on a bad argument, holding nothing then; 0 when getrandom failed (the
   * caller gives back what t holds) */
  int (*prepare)(lua_State *L, ml_client *c, ml_acquire_attempt *t, int owner_i);
  /* initialises op->cmd: the command t sends */
  void (*build)(const ml_acquire_attempt *t, ml_op *op);
  /* [-0, +n] the tail, with the client at stack index 1: ok, reply and err
   * as ml_run returns them (reply stays the caller's); pushes the
   * method's answers and returns their count */
  int (*take)(lua_State *L, ml_client *c, ml_acquire_attempt *t, int ok, const bson_t *reply,
              const bson_error_t *err);
} ml_attempt_kind;

/* what an attempt keeps between its op and its outcome.  Its strings point
 * into its own buffers or into the method's Lua arguments (on the stack
 * for the plain method; a mongolock.Attempt keeps them in its uservalue) */
struct ml_acquire_attempt {
  const ml_attempt_kind *kind;
  int state;                        /* ML_ATTEMPT_PREPARED, SENT, TAKEN */
  double started;                   /* ml_monotonic() just before the op
                                       was sent (or a:op() returned it) */
  int renew;                        /* the handle asks for renewal */
  ml_acquire_args a;                /* the named kinds' command (a document
                                       lock's: owner and ttl_ms alone);
                                       a.owner, host, tag and keeper point
                                       into t and keeper */
  ml_attempt t;                     /* owner (every kind's), tag, host */
  char keeper[17];
  size_t namelen;
  int mode;                         /* shared kinds: ML_MODE_* */
  int64_t permits;
  ml_lockref ref;                   /* a document lock: ref.id is id */
  bson_t *id, *insert;              /* owned (bson_copy); NULL once freed */
};

enum { ML_ATTEMPT_PREPARED, ML_ATTEMPT_SENT, ML_ATTEMPT_TAKEN };

/* the plain method of kind k: prepare, build, run on this thread, take */
int ml_attempt_method(lua_State *L, const ml_attempt_kind *k);
/* client:X_attempt of kind k: [-0, +1] a mongolock.Attempt | nil,
 * "getrandom failed" */
int ml_attempt_prepare(lua_State *L, const ml_attempt_kind *k);

/* a past reading of core.monotonic() at i (raises otherwise) */
double ml_arg_started(lua_State *L, int i);

/* [-0, +2] pushes op as its envelope (and destroys it), then owner;
 * returns 2 */
int ml_push_op_owner(lua_State *L, ml_op *op, const char *owner);

/*
 * The outcome of a round trip run elsewhere, at i .. i + 4 as client:run
 * answers it: reply (BSON string) | nil, message, code, ereply (BSON string
 * or nil), domain (libmongoc's error domain, or nil).  Returns 1 with
 * *reply a copy of reply, or 0 with *err set and *reply a copy of ereply
 * (empty without one), as ml_run returns them.  An error without a domain
 * (the transport's own, before or around the call) counts as one without a
 * reply (MONGOC_ERROR_STREAM) unless ereply is the server's answer: what
 * the op asked may have been applied.  Raises on malformed BSON.
 */
int ml_arg_outcome(lua_State *L, int i, bson_t *reply, bson_error_t *err);

/* [-0, +1|3] runs an update op (and destroys it): pushes true, or nil,
 * none when it matched nothing (none not NULL), or nil, message, code */
int ml_push_update(lua_State *L, ml_client *c, ml_op *op, const char *none);
/* a leave of a queue: (L: client, db, coll, name, waiter) -> true | nil, msg, code */
typedef void (*ml_leave_builder)(ml_op *op, const char *db, const char *coll, const char *name,
                                 const char *waiter, const char *tag);
int ml_push_leave(lua_State *L, ml_leave_builder build);

/* Client methods on locks, implemented next to what they make and
 * registered with the others in client.c: named.c (named locks) ... */
int ml_m_acquire(lua_State *L);
int ml_m_acquire_attempt(lua_State *L);
int ml_m_campaign(lua_State *L);
int ml_m_campaign_attempt(lua_State *L);
int ml_m_status(lua_State *L);
int ml_m_list(lua_State *L);
int ml_m_force_release(lua_State *L);
int ml_m_leave(lua_State *L);
int ml_m_granted(lua_State *L);
int ml_m_ensure_index(lua_State *L);
/* ... documents.c (document locks) ... */
int ml_m_doc_acquire(lua_State *L);
int ml_m_doc_acquire_attempt(lua_State *L);
int ml_m_doc_status(lua_State *L);
/* ... shared.c (reader shares and permits) ... */
int ml_m_share_acquire(lua_State *L);
int ml_m_share_acquire_attempt(lua_State *L);
int ml_m_share_leave(lua_State *L);
int ml_m_share_force_release(lua_State *L);
int ml_m_share_status(lua_State *L);
/* ... command.c and ops.c */
int ml_m_command(lua_State *L);
int ml_m_run(lua_State *L);

/* documents.c: a document lock's release changes (the table at idx) as an
 * update of operators in out; 0 with err when malformed or when they touch
 * the lock fields or _id */
int ml_doc_changes(lua_State *L, int idx, const ml_lease *l, bson_t *out, char *err,
                   size_t errlen);
/* the same for the lock fields owner_field and time_field */
int ml_doc_changes_of(lua_State *L, int idx, const char *owner_field, const char *time_field,
                      bson_t *out, char *err, size_t errlen);
/* the _id at idx as {_id: value} in *out (always initialised: destroy it);
 * NULL, or why the value cannot be an _id */
const char *ml_doc_id(lua_State *L, int idx, bson_t *out, char *err, size_t errlen);
/* the insert document at idx in *ins (initialised by the caller); NULL, or
 * why it cannot be one (malformed, or it sets a lock field) */
const char *ml_doc_insert(lua_State *L, int idx, const char *owner_field, const char *time_field,
                          bson_t *ins, char *err, size_t errlen);
/* [-0, +1] a busy document attempt's info {owner, remaining, doc,
 * operation_time} */
void ml_push_doc_info(lua_State *L, const ml_acquire_reply *ar, const bson_t *reply,
                      const char *owner_field);
/* a document status reply: pushes {held, state, owner, remaining} or nil,
 * "not found"; returns the values pushed */
int ml_push_doc_status(lua_State *L, const bson_t *reply);

/* ---- ops.c ------------------------------------------------------------- */

/* [-0, +0] sets operation_time = {t, i} in the table on top of the stack
 * from a reply's operationTime (a replica set's); nothing when it has none */
void ml_set_operation_time(lua_State *L, const bson_t *reply);

/* [-0, +1] {owner, token, remaining, expires_at, holder, queued, position,
 * operation_time} of a lost named-lock attempt */
void ml_push_acquire_info(lua_State *L, const ml_acquire_reply *r, const bson_t *reply);

/* [-0, +1] the array of status tables of a status/list reply */
void ml_push_status_list(lua_State *L, const bson_t *reply);

/* [-0, +1|4] runs op on c: pushes the reply (a table when decode, else a
 * BSON string) or nil, message, code, reply; returns the count */
int ml_push_run(lua_State *L, ml_client *c, const ml_op *op, int decode);

/* raises unless the database at i and the collection at i + 1 are names
 * MongoDB takes (protocol.c's rule) */
void ml_arg_ns(lua_State *L, int i, const char **db, const char **coll);

/* [-0, +0] adds op_* and parse_* to the module table on top */
void ml_ops_open(lua_State *L);

/* ---- bson.c ------------------------------------------------------------ */

/*
 * Converts the Lua table at idx into a BSON document appended to out (which
 * the caller has initialised).  Returns 1 on success; on malformed input
 * (cycles, mixed keys, NaN, depth > 100, invalid UTF-8, ...) returns 0 and
 * writes a message into err.  Never raises, so the caller can destroy out
 * before raising.
 */
int ml_tobson(lua_State *L, int idx, bson_t *out, char *err, size_t errlen);

/* [-0, +1] pushes doc as a Lua table (typed values for non-Lua BSON types) */
void ml_pushbson(lua_State *L, const bson_t *doc);

/* [-0, +1] pushes the value the iterator points at */
void ml_pushbsonvalue(lua_State *L, const bson_iter_t *it);

/* [-0, +0] registers the typed-value metatables and adds the constructors
 * (null, array, ObjectId, Date, Binary, Timestamp, Decimal128, Int64, ...)
 * to the module table at the top of the stack */
void ml_bson_open(lua_State *L);

/* command.c: the op of client:command(db, cmd, opts) with db at index
 * first (raises on malformed arguments) */
void ml_command_op(lua_State *L, int first, ml_op *op);

/* ---- renew.c, watch.c: background renewal and change-stream waits ----- */

/* once per process: fork handlers, and the renewal thread as the releaser
 * of collected handles (ml_gc_handoff) */
void ml_renew_init(void);

/* [-0, +0] adds watch_wait to the module table at the top of the stack */
void ml_watch_open(lua_State *L);

/*
 * Hands l (a lease just won whose handle asked for renewal) to c's renewal
 * thread in this process, starting it when needed; the thread takes its
 * own reference.  Raises on a closed client.  Returns 1, or 0 when no
 * thread could be started (l->renew is then cleared).
 */
int ml_renew_add(lua_State *L, ml_client *c, ml_lease *l);

/* c's keeper id in this process (16 hex digits and a NUL in out), which
 * the lease documents it renews carry (protocol.h); NULL when its engine
 * cannot be made.  Raises on a closed client. */
const char *ml_renew_keeper(lua_State *L, ml_client *c, char out[17]);

/* client:set_methods(t), client:release_later(...) (lock.c) */
int ml_m_set_methods(lua_State *L);
int ml_m_release_later(lua_State *L);

/* the list of the leases of c's handles (close releases those held); a
 * lease leaves it when its handle is collected or c closes (the list owns
 * no reference: the handle's keeps the lease alive meanwhile) */
void ml_held_link(ml_client *c, ml_lease *l);
void ml_held_unlink(ml_lease *l);
/* every lease leaves c's list (a closing client's, in any process) */
void ml_held_forget(ml_client *c);

/* client:engine_next(), client:engine_done(): the external adapter */
int ml_m_engine_next(lua_State *L);
int ml_m_engine_done(lua_State *L);
/* client:watch_next(), watch_done(), watch_stop(): its change streams' */
int ml_m_watch_next(lua_State *L);
int ml_m_watch_done(lua_State *L);
int ml_m_watch_stop(lua_State *L);

/* [-0, +1] pushes op as its envelope (a BSON string, ops.c) */
void ml_push_op(lua_State *L, const ml_op *op);

/* the op of an envelope (ops.c): views into env's bytes, never destroyed;
 * 0 when env is not an op */
int ml_op_view(const bson_t *env, ml_op *op);
/* the op of the envelope string at Lua index i (raises when it is not one) */
void ml_arg_op(lua_State *L, int i, ml_op *op);

/* pool.c: [-0, +0] adds pool (worker threads that run ops) to the module
 * table at the top of the stack */
void ml_pool_open(lua_State *L);

/*
 * Asks c's background thread in this process (started when needed) for one
 * server selection for writes: libmongoc then checks its servers at once,
 * where after a connection error it would otherwise look again only after
 * heartbeatFrequencyMS.  Never blocks the caller.  Raises on a closed
 * client; returns 1, or 0 when no thread could be started.
 */
int ml_renew_scan(lua_State *L, ml_client *c);

/* c->on_close of a client with a renewal thread or change streams: stops
 * them (pending releases are sent first) while the pool is still valid */
void ml_bg_on_close(ml_client *c);

/* stops and joins c's change-stream threads in this process (an external
 * client's streams are ended by its adapter's next ops) */
void ml_watch_stop(ml_client *c);

/* ---- what the specs' module (testing.c) reads ------------------------- */

/* this process's renewal thread of a client */
typedef struct ml_renew_counts {
  int running;
  long leases, renewals, failures, lost, released, batches, checks;
} ml_renew_counts;

/* this process's change streams of a client */
typedef struct ml_watch_counts {
  long streams, threads, events, reopens, getmores, opens, failed, answered, handed, granted;
} ml_watch_counts;

void ml_renew_stats(ml_client *c, ml_renew_counts *out);
/* waits up to timeout seconds until no release of a collected handle is
 * pending; 1 when none is */
int ml_renew_flush(ml_client *c, double timeout);
void ml_watch_stats(ml_client *c, ml_watch_counts *out);

/*
 * The core's internals for mongolock.testing, a module built for the specs
 * only (csrc/testing.c): a light userdata in the registry under
 * ML_INTERNALS_KEY, set when mongolock.core loads.  Both modules come from
 * one build.
 */
#define ML_INTERNALS_KEY "mongolock.core.internals"
typedef struct ml_internals {
  ml_client *(*checkclient)(lua_State *L, int idx);
  mongoc_client_t *(*client_get)(lua_State *L, ml_client *c);
  void (*renew_stats)(ml_client *c, ml_renew_counts *out);
  int (*renew_flush)(ml_client *c, double timeout);
  void (*watch_stats)(ml_client *c, ml_watch_counts *out);
} ml_internals;

#endif
