/*
 * The client's commands on named locks (named.c), and what the other
 * kinds' commands share with them: how an attempt method runs, an update
 * answered as true | nil, a leave of a queue.
 *
 * May include: client.h, protocol.h.
 */
#ifndef MONGOLOCK_NAMED_H
#define MONGOLOCK_NAMED_H

#include "client.h"
#include "protocol.h"

/*
 * How an attempt method (client:acquire, share_acquire, doc_acquire) runs.
 * Each is split at its round trip, so that a transport other than
 * libmongoc's pool on this thread (an nginx worker thread) runs the op and
 * the same C code finishes it:
 *   ML_ATTEMPT_RUN   the plain method: build, ml_run, finish;
 *   ML_ATTEMPT_OP    client:X_op(<X's arguments>, [owner]) -> op, owner:
 *                    the op X would send (core.op_* envelope), nothing sent;
 *   ML_ATTEMPT_TAKE  client:take_X(<X's arguments>, owner, started, reply,
 *                    message, code, ereply, domain) -> X's answers: the
 *                    outcome of op, run elsewhere (started: core.monotonic()
 *                    just before it was sent; the rest as client:run
 *                    answers), finished as X finishes its own round trip:
 *                    the handle made, a write concern error's win given
 *                    back, a reply lost even to the retry released in the
 *                    background.
 */
typedef enum { ML_ATTEMPT_RUN, ML_ATTEMPT_OP, ML_ATTEMPT_TAKE } ml_attempt_mode;

/* [-0, +1|3] runs an update op (and destroys it): pushes true, or nil,
 * none when it matched nothing (none not NULL), or nil, message, code */
int ml_push_update(lua_State *L, ml_client *c, ml_op *op, const char *none);
/* a leave of a queue: (L: client, db, coll, name, waiter) -> true | nil, msg, code */
typedef void (*ml_leave_builder)(ml_op *op, const char *db, const char *coll, const char *name,
                                 const char *waiter, const char *tag);
int ml_push_leave(lua_State *L, ml_leave_builder build);

/* Client methods: acquire, acquire_op, take_acquire, campaign, campaign_op,
 * take_campaign, status, list, force_release, leave, granted, ensure_index */
extern const luaL_Reg ml_named_methods[];

#endif
