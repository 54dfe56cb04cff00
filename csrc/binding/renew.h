/*
 * The lease engines of the process and their adapters (renew.c): a
 * renewal thread per client, or the engine driven from Lua (inside nginx).
 *
 * May include: client.h, lease.h.
 */
#ifndef MONGOLOCK_RENEW_H
#define MONGOLOCK_RENEW_H

#include "client.h"
#include "lease.h"

/* seconds a named lease is held before the client's thread asks
 * for its collection's change stream (watch.c's ml_watch_hold), which then
 * tells it at once of a write that ends it: a lock held and released
 * sooner (an uncontended cycle) costs no stream, and a loss in those first
 * seconds is told when they end (the stream starts at the acquire) */
#define ML_HOLD_AFTER 0.25

/* once per process: fork handlers, and the renewal thread as the releaser
 * of collected handles (ml_gc_handoff) */
void ml_renew_init(void);

/*
 * Hands l (a lease just won whose handle asked for renewal) to c's renewal
 * thread in this process, starting it when needed; the thread takes its
 * own reference.  Raises on a closed client.  Returns 1, or 0 when no
 * thread could be started (l->renew is then cleared).
 */
int ml_renew_add(lua_State *L, ml_client *c, ml_lease *l);

/* l (a named lease of a handle just made, linked to c's list) is handed
 * to its collection's change stream by c's thread once it is
 * ML_HOLD_AFTER old and still held (started when needed; nothing for an
 * external client).  Raises on a closed client. */
void ml_renew_hold(lua_State *L, ml_client *c, ml_lease *l);

/* c's keeper id in this process (16 hex digits and a NUL in out), which
 * the lease documents it renews carry (protocol.h); NULL when its engine
 * cannot be made.  Raises on a closed client. */
const char *ml_renew_keeper(lua_State *L, ml_client *c, char out[17]);

/*
 * Asks c's background thread in this process (started when needed) for one
 * server selection for writes: libmongoc then checks its servers at once,
 * where after a connection error it would otherwise look again only after
 * heartbeatFrequencyMS.  Never blocks the caller.  Raises on a closed
 * client; returns 1, or 0 when no thread could be started.
 */
int ml_renew_scan(lua_State *L, ml_client *c);

/* the list of the leases of c's handles (close releases those held); a
 * lease leaves it when its handle is collected or c closes (the list owns
 * no reference: the handle's keeps the lease alive meanwhile) */
void ml_held_link(ml_client *c, ml_lease *l);
void ml_held_unlink(ml_lease *l);
/* every lease leaves c's list (a closing client's, in any process) */
void ml_held_forget(ml_client *c);

/*
 * A change event ended a lease of c in this process (watch.c): the named
 * lease on db.coll whose _id is key's k (BSON {"k": _id}) and whose owner
 * id is owner is lost; owner "": a delete, every such lease acquired
 * before (t, i) is.  Marked lost as a renewal that matched nothing marks
 * it (counted, its event queued); one being released is left alone.
 */
void ml_held_notice(ml_client *c, const char *db, const char *coll, const uint8_t *key,
                    size_t keylen, const char *owner, uint32_t t, uint32_t i);
/* does c hold in this process a named lease (live by its local deadline)
 * on db.coll with the owner field field that its change stream reads for
 * (those handed to ml_watch_hold: every one of an external client; else
 * those c's thread handed, ML_HOLD_AFTER after their acquire)?  It reads
 * on while there is one */
int ml_held_any(ml_client *c, const char *db, const char *coll, const char *field);

/* c->on_close of a client with a renewal thread or change streams: stops
 * them (pending releases are sent first) while the pool is still valid */
void ml_bg_on_close(ml_client *c);

/* this process's renewal thread of a client (for mongolock.testing) */
typedef struct ml_renew_counts {
  int running;
  long leases, renewals, failures, lost, released, batches, checks;
} ml_renew_counts;
void ml_renew_stats(ml_client *c, ml_renew_counts *out);
/* waits up to timeout seconds until no release of a collected handle is
 * pending; 1 when none is */
int ml_renew_flush(ml_client *c, double timeout);

/* Client methods: engine_next, engine_done (the external adapter) */
extern const luaL_Reg ml_renew_methods[];

#endif
