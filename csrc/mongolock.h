/*
 * mongolock private header: the pieces the C files share.
 *
 *   core.c    luaopen_mongolock_core: module table, monotonic clock, sleep
 *   protocol.c  the lock documents' commands and replies (pure; protocol.h)
 *   transport.c runs a built command on libmongoc (transport.h)
 *   ops.c     the protocol and transport seen from Lua: core.op_*,
 *             client:run, core.parse_*, and the tables parsed replies make
 *   client.c  mongolock.Client: the connection pool, fork detection, errors
 *   lock.c    mongolock.Lock: leases (named locks and document locks)
 *   bson.c    Lua value <-> BSON, and the typed values (null, ObjectId, ...)
 *   command.c client:command, a generic command for the Lua layer
 *   documents.c  locks on the application's own documents
 *   renew.c   background lease renewal (a thread per process)
 *   watch.c   change-stream waits
 *
 * proc.c is a module of its own (mongolock.proc, child processes for the
 * mongolock command) and does not use this header.
 *
 * Only luaopen_mongolock_core is exported; everything else is static or
 * hidden (the build uses -fvisibility=hidden).
 */
#ifndef MONGOLOCK_H
#define MONGOLOCK_H

#include <stdint.h>
#include <pthread.h>
#include <sys/types.h>
#include <mongoc/mongoc.h>
#include "compat.h"
#include "protocol.h"
#include "transport.h"

#define ML_CLIENT_MT "mongolock.Client"
#define ML_LOCK_MT "mongolock.Lock"

/* ---- core.c ------------------------------------------------------------ */

/* seconds on CLOCK_MONOTONIC: the only clock the library reads locally */
double ml_monotonic(void);

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
} ml_client;

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

/*
 * What a caller of ml_lock_new describes: the lock document and the lease
 * it won.  Everything is copied by ml_lock_new; the caller keeps ownership
 * of what it passed.
 */
typedef struct ml_lease_spec {
  const char *db, *coll;        /* namespace of the lock document */
  const bson_t *id;             /* {"_id": <its _id, any BSON value>} */
  const char *owner_field;      /* "owner" for named locks */
  const char *time_field;       /* "expiresAt" for named locks */
  ml_time_mode time_mode;
  ml_owner_form owner_form;
  const char *owner;            /* the 32 hex digits this acquisition wrote */
  int64_t token;                /* fencing token, 0 when the lock has none */
  int64_t ttl_ms;               /* lease length, > 0 */
  double started;               /* ml_monotonic() taken just before the
                                   acquire command was sent */
  int renew;                    /* ask background renewal for this lease */
  int queued;                   /* a named lock's document, with a waiter
                                   queue: release hands it to the queue's
                                   head (doc/design.md) */
} ml_lease_spec;

/*
 * The lease behind a mongolock.Lock handle, a plain C struct so that the
 * background renewal thread can read and update it.  Fields marked (mu) are
 * read and written under mu once the handle is visible to another thread;
 * the others never change after ml_lock_new.
 *
 * Invariants: held == 1 from acquire until release/close/lost/expiry is
 * observed; once 0 it never becomes 1 again.  pid is the process that
 * acquired: any other process (a forked child) treats the handle as not
 * held and never sends a command for it.
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
  double deadline;              /* (mu) local monotonic lease end: the time
                                   just before the last successful acquire or
                                   extend was sent, plus ttl */
  int held;                     /* (mu) */
  int renew;                    /* (mu) background renewal wanted */
  int lost;                     /* (mu) renewal found the lease gone */
  int releasing;                /* (mu) the Lua side is releasing it: a
                                   renewal that then matches nothing saw
                                   the release, not a loss */
  int refs;                     /* (mu) 1 for the Lua handle, +1 for each
                                   thread holding it; freed at 0 */
  int queued;                   /* see ml_lease_spec */
} ml_lease;

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

/* raises unless idx is a mongolock.Lock (open or closed) */
ml_lock *ml_checklock(lua_State *L, int idx);

/* [-0, +0] drops one reference to lease (frees it at zero) */
void ml_lease_unref(ml_lease *l);

/*
 * One command: clears the lock fields of l's document if l's owner still
 * holds it, applying `extra` (an update document of operators, e.g.
 * {$set: {...}}; may be NULL) in the same command.  extra must not touch
 * the owner or time field.  Uses the given connection (any thread).
 * Returns 1 released, 0 not held (error->code 0), -1 error (error set).
 */
int ml_lease_release(mongoc_client_t *mc, const ml_client *c, ml_lease *l,
                     const bson_t *extra, bson_error_t *error);

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

/* [-0, +0] adds op_*, parse_* and client:run to the module table on top */
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

/* [-0, +0] command.c, documents.c: add client:command and the document-lock
 * commands to mongolock.Client (after ml_client_open) */
void ml_command_open(lua_State *L);
void ml_documents_open(lua_State *L);

/* ---- renew.c, watch.c: background renewal and change-stream waits ----- */

/* [-0, +0] add the renewal and wait functions to the module table at the
 * top of the stack (after ml_lock_open: they add methods to Lock) */
void ml_renew_open(lua_State *L);
void ml_watch_open(lua_State *L);


/*
 * Hands l (a lease just won whose handle asked for renewal) to c's renewal
 * thread in this process, starting it when needed; the thread takes its
 * own reference.  Raises on a closed client.  Returns 1, or 0 when no
 * thread could be started (l->renew is then cleared).
 */
int ml_renew_add(lua_State *L, ml_client *c, ml_lease *l);

/* c->on_close of a client with a renewal thread or change streams: stops
 * them (pending releases are sent first) while the pool is still valid */
void ml_bg_on_close(ml_client *c);

/* stops and joins c's change-stream threads in this process */
void ml_watch_stop(ml_client *c);

#endif
