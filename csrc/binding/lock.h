/*
 * mongolock.Lock (lock.c): the handle of a lease, its methods, the one
 * release path, and the lease's commands run on a connection.
 *
 * May include: client.h, lease.h, protocol.h.
 */
#ifndef MONGOLOCK_LOCK_H
#define MONGOLOCK_LOCK_H

#include <stdint.h>
#include "client.h"
#include "lease.h"
#include "protocol.h"

#define ML_LOCK_MT "mongolock.Lock"

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

/* [-0, +0] adds the Lock metatable, core.lock_methods, core.lease_step and
 * core.lease_done to the module table at the top of the stack */
void ml_lock_open(lua_State *L);

/* Client methods: client:set_methods(t), client:release_later(...) */
extern const luaL_Reg ml_lock_client_methods[];

#endif
