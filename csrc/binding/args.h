/*
 * The argument layer of the Lua binding, at its bottom: what every type
 * file (client.c, named.c, documents.c, shared.c, lock.c, ops.c, ...) reads
 * from the Lua stack and the answers they all push (nil, message, code).
 * args.c calls none of the type files: only bson.c (Lua value <-> BSON),
 * sys.c (ids), the protocol and the lease's clock.
 *
 * May include: compat.h, protocol.h, lease.h and system/libbson headers;
 * never a type file's header.
 */
#ifndef MONGOLOCK_ARGS_H
#define MONGOLOCK_ARGS_H

#include <stdint.h>
#include <bson/bson.h>
#include "compat.h"
#include "protocol.h"
#include "lease.h"

/* ---- answers ------------------------------------------------------------ */

/* [-0, +3] pushes nil, e->message, e->code; returns 3 */
int ml_pusherror(lua_State *L, const bson_error_t *e);

/* [-0, +3] pushes nil, msg, code; returns 3 (code 0 pushes nil as the code) */
int ml_pushfail(lua_State *L, const char *msg, int code);

/* ---- the lock commands' arguments ---------------------------------------- */

/* Each raises at the caller (luaL_argerror on argument i). */

/* raises unless the database at i and the collection at i + 1 are names
 * MongoDB takes (protocol.c's rule) */
void ml_arg_ns(lua_State *L, int i, const char **db, const char **coll);
/* a string at i (a number is no string here) */
const char *ml_arg_string(lua_State *L, int i, size_t *len);
/* a lock name at i: 1..1024 bytes of UTF-8, no NUL (a number is no name) */
const char *ml_arg_name(lua_State *L, int i, size_t *len);
/* the lock of arguments 2 .. 4: database, collection, name */
const char *ml_arg_lock(lua_State *L, const char **db, const char **coll);
/* a waiter id at i (core.waiter_id()): 32 lowercase hex digits */
const char *ml_arg_waiter(lua_State *L, int i);
/* a ttl in milliseconds at i: positive, at most a year, rounded up */
int64_t ml_arg_ttl_ms(lua_State *L, int i);
/* an optional lock-delay in ms (nil: 0), >= 0, at most a year */
int64_t ml_arg_delay_ms(lua_State *L, int i);
/* a past reading of core.monotonic() at i */
double ml_arg_started(lua_State *L, int i);

/* what an attempt's strings point into */
typedef struct ml_attempt {
  char owner[33], tag[17], host[256];
} ml_attempt;

/*
 * An acquire's attempt (ml_acquire_args) from arguments: the holder (this
 * host and process, the app at app_i or else default_app, the URI's
 * appname) and, with a waiter id at waiter_i, the waiter with queue_ms at
 * waiter_i + 1 and polling at waiter_i + 2 (the waiter id is then the
 * owner), else the owner at owner_i (owner_i > 0: 32 lowercase hex digits,
 * or nil for a new one; a waiter's must be nil or the waiter id), else a
 * new owner id; a's strings point into t.  Raises on a bad argument;
 * returns 0 when getrandom failed.
 */
int ml_arg_attempt_owner(lua_State *L, const char *default_app, int app_i, int waiter_i,
                         int owner_i, ml_acquire_args *a, ml_attempt *t);

/* ---- document locks' arguments ------------------------------------------ */

/* the _id at idx as {_id: value} in *out (always initialised: destroy it);
 * NULL, or why the value cannot be an _id (written to err) */
const char *ml_doc_id(lua_State *L, int idx, bson_t *out, char *err, size_t errlen);
/* the insert document at idx in *ins (initialised by the caller); NULL, or
 * why it cannot be one (malformed, or it sets a lock field) */
const char *ml_doc_insert(lua_State *L, int idx, const char *owner_field, const char *time_field,
                          bson_t *ins, char *err, size_t errlen);
/* a document lock's release changes (the table at idx) as an update of
 * operators in out; 0 with err when malformed or when they touch the lock
 * fields of l or _id */
int ml_doc_changes(lua_State *L, int idx, const ml_lease *l, bson_t *out, char *err,
                   size_t errlen);

/* ---- ops and their outcomes ---------------------------------------------- */

/* a BSON string argument at i as a view into it (raises when malformed) */
void ml_arg_bson(lua_State *L, int i, bson_t *out);

/* op's envelope ({kind, retry, db, coll, session, cmd}) in env, which it
 * initialises (destroy it) */
void ml_op_envelope(const ml_op *op, bson_t *env);
/* [-0, +1] pushes op as its envelope (a BSON string) */
void ml_push_op(lua_State *L, const ml_op *op);

/* the op of an envelope: views into env's bytes, never destroyed; 0 when
 * env is not an op */
int ml_op_view(const bson_t *env, ml_op *op);
/* the op of the envelope string at Lua index i (raises when it is not one) */
void ml_arg_op(lua_State *L, int i, ml_op *op);

/*
 * The outcome of a round trip run elsewhere, at i .. i + 4 as client:run
 * answers it: reply (BSON string) | nil, message, code, ereply (BSON string
 * or nil), domain (libmongoc's error domain, or nil).  Returns 1 with
 * *reply a copy of reply, or 0 with *err set and *reply a copy of ereply
 * (empty without one), as ml_run returns them.  An error without a domain
 * (the transport's own, before or around the call) counts as one without a
 * reply (MONGOC_ERROR_STREAM) unless ereply is the server's answer: what
 * the op asked may have been applied.  Raises on malformed BSON.  With
 * reply NULL it only checks the arguments (returns whether reply was given).
 */
int ml_arg_outcome(lua_State *L, int i, bson_t *reply, bson_error_t *err);
/* the same, the reply at i not walked when own (a string C made from a
 * reply libmongoc parsed: ml_attempt_own_reply) */
int ml_arg_outcome_own(lua_State *L, int i, bson_t *reply, bson_error_t *err, int own);

#endif
