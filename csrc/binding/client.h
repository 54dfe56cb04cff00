/*
 * mongolock.Client (client.c): the client's userdata, its pool and
 * connection in this process, and the registration of Client methods.
 *
 * May include: compat.h, libmongoc; names the lease and the counters
 * (lease.h) only as pointers.
 */
#ifndef MONGOLOCK_CLIENT_H
#define MONGOLOCK_CLIENT_H

#include <sys/types.h>
#include <mongoc/mongoc.h>
#include "compat.h"

#define ML_CLIENT_MT "mongolock.Client"

struct ml_lease;
struct ml_obs;

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
  int32_t attempt_ms;           /* a single attempt's bound (client.c's
                                   client:one_attempt); 0: none */
  int writable_seen;            /* client:writable() found a writable
                                   server at topology change writable_gen
                                   (client.c): true again without a look
                                   until the topology changes */
  uint64_t writable_gen;
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
 * more reference for the caller; NULL when out of memory.  On the Lua
 * side's thread only: close's on_close, or a single attempt abandoned to
 * its thread (client.c). */
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
/* why ml_pool_new answered NULL: that libmongoc's lock was held at this
 * process's fork (client.c), else otherwise (a URI libmongoc refused) */
const char *ml_pool_refused(const char *otherwise);
void ml_pool_destroy(mongoc_client_pool_t *pool);

/* the database locks live in when none is given: the URI's, else
 * "mongolock" */
const char *ml_client_dbname(const ml_client *c);

/* appends writeConcern (the client's) to opts: every write command uses it */
void ml_client_append_wc(const ml_client *c, bson_t *opts);

/* [-0, +0] adds the Client metatable and core.connect to the module table
 * at the top of the stack (once, from luaopen_mongolock_core) */
void ml_client_open(lua_State *L);

/* [-0, +0] adds methods to every mongolock.Client: the module's opener adds
 * the Client methods each file implements (named.c's ml_named_methods, ...) */
void ml_client_methods(lua_State *L, const luaL_Reg *methods);

#endif
