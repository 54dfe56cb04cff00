/*
 * The client's commands on named locks (named.c), and what the other
 * kinds' commands share with them: an update answered as true | nil, a
 * leave of a queue.
 *
 * May include: client.h, protocol.h.
 */
#ifndef MONGOLOCK_NAMED_H
#define MONGOLOCK_NAMED_H

#include "client.h"
#include "protocol.h"

/* [-0, +1|3] runs an update op (and destroys it): pushes true, or nil,
 * none when it matched nothing (none not NULL), or nil, message, code */
int ml_push_update(lua_State *L, ml_client *c, ml_op *op, const char *none);
/* a leave of a queue: (L: client, db, coll, name, waiter) -> true | nil, msg, code */
typedef void (*ml_leave_builder)(ml_op *op, const char *db, const char *coll, const char *name,
                                 const char *waiter, const char *tag);
int ml_push_leave(lua_State *L, ml_leave_builder build);

/* Client methods: acquire, acquire_attempt, campaign, campaign_attempt,
 * status, list, force_release, leave, granted, ensure_index */
extern const luaL_Reg ml_named_methods[];

#endif
