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

/* [-0, +1] pushes op as its envelope (a BSON string: {kind, retry, db,
 * coll, session, cmd}) */
void ml_push_op(lua_State *L, const ml_op *op);

/*
 * A mongolock.Op: an envelope whose bytes are C memory, not a Lua string.
 * a:op() and core.lease_step answer one.  Every function that takes an op
 * takes it as it takes the string (client:run, pool:submit, core.bson_decode
 * does not: core.op_string(op) gives the string, for a worker thread's job
 * in nginx).  pool:here moves its bytes into the fiber's state, and back
 * when the op did not apply (its caller sends it another way): an op run
 * on the event loop never becomes a string for the collector to count and
 * sweep (an acquire's envelope is 3-5 KB; in an nginx worker the envelopes
 * of a lock + unlock were about a third of what it allocated per cycle).
 * Its bytes are freed with it (__gc), or when pool:here's op has answered.
 */
#define ML_OP_MT "mongolock.Op"
typedef struct ml_opbox {
  uint8_t *bytes;               /* the envelope (bson_malloc), NULL once moved */
  uint32_t len;
} ml_opbox;

/* [-0, +1] pushes op as a mongolock.Op */
void ml_push_op_box(lua_State *L, const ml_op *op);
/* the mongolock.Op at i, or NULL (a string, or anything else) */
ml_opbox *ml_test_op_box(lua_State *L, int i);
/* the envelope's bytes of the op at i (a string or a mongolock.Op), after
 * ml_arg_op has checked it */
const uint8_t *ml_op_bytes(lua_State *L, int i, size_t *len);
/* the metatable, and core.op_string, in the module at the top */
void ml_op_box_open(lua_State *L);

/* the op of an envelope: views into env's bytes, never destroyed; 0 when
 * env is not an op */
int ml_op_view(const bson_t *env, ml_op *op);
/* the op of the envelope at Lua index i, a string or a mongolock.Op
 * (raises when it is not one) */
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

#endif
