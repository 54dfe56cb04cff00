/*
 * Change-stream waits (watch.c): the streams of the process and their two
 * adapters (a thread per stream; Lua, inside nginx).
 *
 * May include: client.h, lease.h.
 */
#ifndef MONGOLOCK_WATCH_H
#define MONGOLOCK_WATCH_H

#include "client.h"
#include "lease.h"

/* [-0, +0] adds watch_wait to the module table at the top of the stack */
void ml_watch_open(lua_State *L);

/* stops and joins c's change-stream threads in this process (an external
 * client's streams are ended by its adapter's next ops) */
void ml_watch_stop(ml_client *c);

/*
 * l (a named lease of c held in this process) wants to hear of a write
 * that ends it: the stream of its collection reads on while c holds such
 * leases there (renew.c's ml_held_any), started at l's acquire's
 * operation time when none runs (pool: c's pool; NULL for an external
 * client, whose streams are opened for waiters alone), and hands what it
 * sees to the held leases (ml_held_notice).  Nothing when no stream can be
 * had (no operation time, or the stream failed: the renewal finds the
 * loss).  Called without renew.c's mutex.
 */
void ml_watch_hold(ml_client *c, mongoc_client_pool_t *pool, const ml_lease *l);

/* this process's change streams of a client (for mongolock.testing) */
typedef struct ml_watch_counts {
  long streams, threads, events, reopens, getmores, opens, failed, answered, handed, granted;
} ml_watch_counts;
void ml_watch_stats(ml_client *c, ml_watch_counts *out);

/* Client methods: watch_next, watch_done, watch_stop (the external
 * adapter) */
extern const luaL_Reg ml_watch_methods[];

#endif
