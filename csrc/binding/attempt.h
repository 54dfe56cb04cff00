/*
 * mongolock.Attempt (attempt.c): an acquire attempt, one round trip of
 * client:acquire, campaign, share_acquire or doc_acquire, as one shape for
 * every kind: prepared from the method's arguments, its op built, its
 * outcome taken by the kind's tail (the handle made, a write concern
 * error's win given back, a reply lost even to the retry released in the
 * background).  The plain method runs the three steps on this thread
 * (ml_attempt_method); client:X_attempt(<X's arguments> [, owner]) makes a
 * mongolock.Attempt (ml_attempt_prepare) for a transport that runs the op
 * elsewhere (an nginx worker thread, a coroutine scheduler's pool):
 *   a:op()      -> the op (core.op_* envelope), nothing sent; the attempt
 *                  is sent from then (its started time: now)
 *   a:take(reply, message, code, ereply, domain) -> X's answers: the
 *                  outcome of the op as client:run answers it, taken once
 *   a:owner()   -> the owner id its op writes
 *   a:sent()    -> whether its op was handed on and not taken yet
 * pool:here(a) takes the attempt itself where it would take a:op(): its op
 * goes to the fiber without a Lua string (ml_attempt_envelope), and an op
 * that did not run or apply leaves the attempt prepared again.
 * Each kind plugs in its own table (ml_attempt_kind): named.c's acquire
 * and campaign, shared.c's share_acquire, documents.c's doc_acquire.
 *
 * May include: client.h, args.h (ml_attempt), protocol.h.
 */
#ifndef MONGOLOCK_ATTEMPT_H
#define MONGOLOCK_ATTEMPT_H

#include <stdint.h>
#include "client.h"
#include "args.h"
#include "protocol.h"

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

/* a mongolock.Attempt at Lua index i sent by C (pool:here): 1 with its op's
 * envelope in env (initialised: destroy it), the attempt sent as by a:op()
 * (which raises unless it is prepared); 0 when the value at i is no
 * attempt */
int ml_attempt_envelope(lua_State *L, int i, bson_t *env);
/* the attempt at i (sent by ml_attempt_envelope) is prepared again: its op
 * was not sent, or did not apply, and goes another way (a:op()) */
void ml_attempt_unsend(lua_State *L, int i);
/* the attempt at i (sent by ml_attempt_envelope) keeps the reply string at
 * r, which C made from the reply libmongoc parsed: its a:take of that
 * string does not walk it again (the attempt holds it, so it stays the
 * same bytes) */
void ml_attempt_own_reply(lua_State *L, int i, int r);

/* [-0, +0] makes the mongolock.Attempt metatable (once, from
 * luaopen_mongolock_core; the module table on top stays as it is) */
void ml_attempt_open(lua_State *L);

#endif
