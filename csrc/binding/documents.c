/*
 * Locks on the application's own documents: the lock lives in two fields of
 * the document itself (owner and time, names configurable), the handle is
 * the same mongolock.Lock as for named locks (lock.c's lease, of kind
 * ML_KIND_DOCUMENT).  The client's doc_acquire and doc_status are here
 * (ml_documents_methods); the changes a release may write are read by
 * args.c (ml_doc_changes).
 *
 * Acquire is one findAndModify on {_id} alone whose update pipeline takes
 * the lock only when it is free by the server's clock, and (when the caller
 * gave a document to insert) creates the document when it is missing
 * (protocol.c, ml_build_doc_acquire).  Won when the returned owner is ours.
 *
 * Release with changes (h:release(changes), lock.c) is one update that
 * applies the changes and clears the lock fields, filtered on {_id, O:
 * ours}.
 */
#include <string.h>
#include <unistd.h>

#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "sys.h"
#include "bson_lua.h"
#include "args.h"
#include "client.h"
#include "lock.h"
#include "named.h"
#include "documents.h"
#include "ops.h"
#include "stats.h"
#include "attempt.h"

/* ---- helpers ----------------------------------------------------------- */

static const char *arg_field(lua_State *L, int i) {
  size_t len;
  const char *msg, *s = luaL_checklstring(L, i, &len);
  if ((msg = ml_check_field(s, len)) != NULL) luaL_argerror(L, i, msg);
  return s;
}

/* the _id at idx as {_id: value} in *out (destroy it); raises on a value
 * that cannot be an _id */
static void arg_id(lua_State *L, int idx, bson_t *out) {
  char err[512];
  const char *msg = ml_doc_id(L, idx, out, err, sizeof err);
  if (msg) {
    bson_destroy(out);
    luaL_argerror(L, idx, msg);
  }
}

/* the document lock of arguments 2 .. 9: db, coll, id (checked, not
 * converted), ttl_ms (returned), owner_field, time_field, "expires" |
 * "locked", "hex" | "uuid" */
static int64_t arg_lockref(lua_State *L, ml_lockref *r) {
  const char *mode_s, *form_s;
  int64_t ttl_ms;
  int i = 6;
  ml_arg_ns(L, 2, &r->db, &r->coll);
  luaL_checkany(L, 4);
  ttl_ms = ml_ttl_ms(luaL_checknumber(L, 5));
  luaL_argcheck(L, ttl_ms > 0, 5, "ttl must be a positive number of milliseconds, at most a year");
  r->owner_field = arg_field(L, i);
  r->time_field = arg_field(L, i + 1);
  luaL_argcheck(L, strcmp(r->owner_field, r->time_field) != 0, i + 1,
                "owner and time fields must differ");
  mode_s = luaL_checkstring(L, i + 2);
  if (!strcmp(mode_s, "expires")) r->time_mode = ML_TIME_EXPIRES_AT;
  else if (!strcmp(mode_s, "locked")) r->time_mode = ML_TIME_LOCKED_AT;
  else luaL_argerror(L, i + 2, "\"expires\" or \"locked\" expected");
  form_s = luaL_checkstring(L, i + 3);
  if (!strcmp(form_s, "hex")) r->owner_form = ML_OWNER_HEX;
  else if (!strcmp(form_s, "uuid")) r->owner_form = ML_OWNER_UUID;
  else luaL_argerror(L, i + 3, "\"hex\" or \"uuid\" expected");
  r->queued = 0;
  return ttl_ms;
}

/*
 * client:doc_acquire(db, coll, id, ttl_ms, owner_field, time_field,
 *                    "expires" | "locked", "hex" | "uuid", insert | nil,
 *                    renew)
 *   -> handle, doc
 *    | nil, "busy", {owner = <value>, remaining = s, doc = <current>,
 *                    operation_time = {t, i}}
 *    | nil, "not found"            (no such document and no insert given)
 *    | nil, message, code
 */
static int prepare_doc(lua_State *L, ml_client *c, ml_acquire_attempt *t, int owner_i) {
  ml_lockref *r = &t->ref;
  int have_insert;
  bson_t id, ins = BSON_INITIALIZER;
  char err[512];
  (void)c;

  t->a.ttl_ms = arg_lockref(L, r);
  have_insert = !lua_isnoneornil(L, 10);
  if (have_insert) luaL_checktype(L, 10, LUA_TTABLE);
  t->renew = lua_toboolean(L, 11);
  /* the _id first: it raises on a bad one (then nothing else is built),
   * and what is built after it is given back on every way out */
  arg_id(L, 4, &id);
  if (have_insert) {
    const char *bad = ml_doc_insert(L, 10, r->owner_field, r->time_field, &ins, err, sizeof err);
    if (bad) {
      bson_destroy(&ins);
      bson_destroy(&id);
      return luaL_argerror(L, 10, bad);
    }
  }
  if (owner_i > 0 && !lua_isnoneornil(L, owner_i)) {
    size_t len;
    const char *given = lua_tolstring(L, owner_i, &len);
    if (!given || !ml_is_hex(given, len, 32)) {
      bson_destroy(&ins);
      bson_destroy(&id);
      return luaL_argerror(L, owner_i, "owner must be 32 lowercase hex digits");
    }
    memcpy(t->t.owner, given, 33);
  } else if (!ml_random_owner(t->t.owner)) {
    bson_destroy(&ins);
    bson_destroy(&id);
    return 0;
  }
  t->a.owner = t->t.owner;
  t->id = bson_copy(&id);
  r->id = t->id;
  bson_destroy(&id);
  if (have_insert) t->insert = bson_copy(&ins);
  bson_destroy(&ins);
  return 1;
}

static void build_doc(const ml_acquire_attempt *t, ml_op *op) {
  ml_build_doc_acquire(op, &t->ref, t->a.owner, t->a.ttl_ms, t->insert);
}

static int take_doc(lua_State *L, ml_client *c, ml_acquire_attempt *t, int ok,
                    const bson_t *reply, const bson_error_t *e) {
  ml_acquire_reply ar;
  ml_lease_spec s;
  int found, pushed;
  found = ml_parse_acquire(reply, t->a.owner, t->ref.owner_field, t->ref.owner_form, 1, &ar);
  if (ok && found <= 0)
    return ml_pushfail(L, found == 0 ? "not found" : "findAndModify returned no document", 0);
  memset(&s, 0, sizeof s);
  s.ref = t->ref;               /* ref.id is t->id */
  s.owner = t->a.owner;
  s.ttl_ms = t->a.ttl_ms;
  s.started = t->started;
  s.renew = t->renew;
  s.kind = ML_KIND_DOCUMENT;
  /* a write concern error after a won write: ml_push_won gives it back */
  pushed = ml_push_won(L, c, ok ? 1 : 0, found > 0 && ar.won, &s, e);
  if (pushed == 1) ml_pushbson(L, &ar.value);     /* [.. h doc] */
  if (pushed) return pushed == 1 ? 2 : pushed;
  lua_pushnil(L);
  lua_pushliteral(L, "busy");
  ml_push_doc_info(L, &ar, reply, t->ref.owner_field);
  return 3;
}

/* client:doc_acquire_attempt(<doc_acquire's arguments> [, owner]) -> a
 * mongolock.Attempt (ml_attempt_kind) */
static const ml_attempt_kind doc_kind = {"doc_acquire", 12, prepare_doc, build_doc, take_doc};

static int ml_m_doc_acquire(lua_State *L) { return ml_attempt_method(L, &doc_kind); }
static int ml_m_doc_acquire_attempt(lua_State *L) { return ml_attempt_prepare(L, &doc_kind); }

/*
 * client:doc_status(db, coll, id, ttl_ms, owner_field, time_field,
 *                   "expires" | "locked", "hex" | "uuid")
 *   -> {held, state = "held" | "expired" | "free", owner, remaining} |
 *      nil, "not found" | nil, message, code
 * One aggregate; remaining by the server's clock.
 */
static int ml_m_doc_status(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  ml_lockref r;
  int64_t ttl_ms;
  bson_t id, reply;
  bson_error_t e;
  ml_op op;
  int ok;
  ttl_ms = arg_lockref(L, &r);
  arg_id(L, 4, &id);
  r.id = &id;
  ml_build_doc_status(&op, &r, ttl_ms);
  ml_obs_command(c);
  ok = ml_run(ml_client_get(L, c), c->wc, &op, &reply, &e);
  ml_op_destroy(&op);
  bson_destroy(&id);
  if (!ok) {
    bson_destroy(&reply);
    return ml_pusherror(L, &e);
  }
  ok = ml_push_doc_status(L, &reply);
  bson_destroy(&reply);
  return ok;
}

/* ---- release with changes ---------------------------------------------- */

/* Client methods: document locks (module.c adds them to mongolock.Client) */
const luaL_Reg ml_documents_methods[] = {
  {"doc_acquire", ml_m_doc_acquire},
  {"doc_acquire_attempt", ml_m_doc_acquire_attempt},
  {"doc_status", ml_m_doc_status},
  {NULL, NULL}
};
