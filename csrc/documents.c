/*
 * Locks on the application's own documents: the lock lives in two fields of
 * the document itself (owner and time, names configurable), the handle is
 * the same mongolock.Lock as for named locks (lock.c's lease, of kind
 * ML_KIND_DOCUMENT).  The client's doc_acquire and doc_status are here
 * (registered in client.c), and the changes a release may write.
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

#include "mongolock.h"

/* ---- helpers ----------------------------------------------------------- */

/* converts the Lua value at idx into *v, backed by *holder (destroy it after
 * use); 0 with err on failure */
static int tovalue(lua_State *L, int idx, bson_t *holder, bson_value_t *v, char *err,
                   size_t errlen) {
  bson_iter_t it;
  idx = lua_absindex(L, idx);
  lua_createtable(L, 0, 1);
  lua_pushvalue(L, idx);
  lua_setfield(L, -2, "v");
  bson_init(holder);
  if (!ml_tobson(L, -1, holder, err, errlen)) {
    lua_pop(L, 1);
    return 0;
  }
  lua_pop(L, 1);
  if (!bson_iter_init_find(&it, holder, "v")) {
    snprintf(err, errlen, "value expected");
    return 0;
  }
  *v = *bson_iter_value(&it);
  return 1;
}

static const char *arg_field(lua_State *L, int i) {
  size_t len;
  const char *msg, *s = luaL_checklstring(L, i, &len);
  if ((msg = ml_check_field(s, len)) != NULL) luaL_argerror(L, i, msg);
  return s;
}


/* the _id at idx as {_id: value} in *out (always initialised; destroy it);
 * NULL, or why the value cannot be an _id (written to err) */
const char *ml_doc_id(lua_State *L, int idx, bson_t *out, char *err, size_t errlen) {
  bson_t holder;
  bson_value_t v;
  bson_init(out);
  if (lua_isnoneornil(L, idx)) return "_id expected, got nil";
  if (!tovalue(L, idx, &holder, &v, err, errlen)) {
    bson_destroy(&holder);
    return err;
  }
  if (v.value_type == BSON_TYPE_ARRAY) {
    bson_destroy(&holder);
    return "an array cannot be an _id";
  }
  BSON_APPEND_VALUE(out, "_id", &v);
  bson_destroy(&holder);
  return NULL;
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

/* the insert document (the table at idx) in *ins (initialised by the
 * caller); NULL, or why it cannot be one (written to err) */
const char *ml_doc_insert(lua_State *L, int idx, const char *owner_field, const char *time_field,
                          bson_t *ins, char *err, size_t errlen) {
  bson_iter_t ii;
  if (!ml_tobson(L, idx, ins, err, errlen)) return err;
  if (bson_iter_init(&ii, ins))
    while (bson_iter_next(&ii))
      if (!strcmp(bson_iter_key(&ii), owner_field) || !strcmp(bson_iter_key(&ii), time_field))
        return "the insert document must not set the lock fields";
  return NULL;
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

/* [-0, +1] what a busy attempt tells: {owner = <value>, remaining = s,
 * doc = <current>, operation_time = {t, i}} */
void ml_push_doc_info(lua_State *L, const ml_acquire_reply *ar, const bson_t *reply,
                      const char *owner_field) {
  lua_createtable(L, 0, 4);
  ml_pushbson(L, &ar->value);
  lua_getfield(L, -1, owner_field);
  lua_setfield(L, -3, "owner");
  lua_setfield(L, -2, "doc");
  lua_pushnumber(L, (lua_Number)(ar->remaining_ms > 0 ? ar->remaining_ms : 0) / 1000.0);
  lua_setfield(L, -2, "remaining");
  ml_set_operation_time(L, reply);
}

/* a status aggregate's reply (ml_build_doc_status): pushes {held, state,
 * owner, remaining}, or nil, "not found"; returns the values pushed */
int ml_push_doc_status(lua_State *L, const bson_t *reply) {
  bson_iter_t docs, f;
  int64_t rem = 0;
  int held, has_owner;
  if (!ml_reply_batch(reply, &docs, NULL) || !bson_iter_next(&docs) ||
      !BSON_ITER_HOLDS_DOCUMENT(&docs))
    return ml_pushfail(L, "not found", 0);
  bson_iter_recurse(&docs, &f);
  has_owner = bson_iter_find(&f, "owner") && !BSON_ITER_HOLDS_NULL(&f);
  bson_iter_recurse(&docs, &f);
  if (bson_iter_find(&f, "remainingMs")) rem = ml_iter_int64(&f, 0);
  held = has_owner && rem > 0;
  lua_createtable(L, 0, 4);
  lua_pushboolean(L, held);
  lua_setfield(L, -2, "held");
  lua_pushstring(L, held ? "held" : has_owner ? "expired" : "free");
  lua_setfield(L, -2, "state");
  if (held) {
    bson_iter_recurse(&docs, &f);
    bson_iter_find(&f, "owner");
    ml_pushbsonvalue(L, &f);
    lua_setfield(L, -2, "owner");
  }
  lua_pushnumber(L, held ? (lua_Number)rem / 1000.0 : 0);
  lua_setfield(L, -2, "remaining");
  return 1;
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

int ml_m_doc_acquire(lua_State *L) { return ml_attempt_method(L, &doc_kind); }
int ml_m_doc_acquire_attempt(lua_State *L) { return ml_attempt_prepare(L, &doc_kind); }

/*
 * client:doc_status(db, coll, id, ttl_ms, owner_field, time_field,
 *                   "expires" | "locked", "hex" | "uuid")
 *   -> {held, state = "held" | "expired" | "free", owner, remaining} |
 *      nil, "not found" | nil, message, code
 * One aggregate; remaining by the server's clock.
 */
int ml_m_doc_status(lua_State *L) {
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

/* the lock's two fields, which changes must not touch */
typedef struct {
  const char *owner_field, *time_field;
} lock_fields;

/* does key (a field path) start with one of the lock's fields or _id? */
static int touches(const char *key, const lock_fields *l) {
  size_t n = strcspn(key, ".");
  return (n == strlen(l->owner_field) && !strncmp(key, l->owner_field, n)) ||
         (n == strlen(l->time_field) && !strncmp(key, l->time_field, n)) ||
         (n == 3 && !strncmp(key, "_id", 3));
}

/*
 * Converts changes (the table at idx) into an update document of operators
 * in out: a table whose keys all start with '$' is one already; any other
 * is the $set of its fields.  0 with err when malformed or when it touches
 * the lock fields or _id.
 */
int ml_doc_changes(lua_State *L, int idx, const ml_lease *lease, bson_t *out, char *err,
                   size_t errlen) {
  return ml_doc_changes_of(L, idx, lease->owner_field, lease->time_field, out, err, errlen);
}

int ml_doc_changes_of(lua_State *L, int idx, const char *owner_field, const char *time_field,
                      bson_t *out, char *err, size_t errlen) {
  lock_fields fields = {owner_field, time_field}, *l = &fields;
  bson_t tmp = BSON_INITIALIZER;
  bson_iter_t it, sub;
  int ops = 0, plain = 0;
  if (!ml_tobson(L, idx, &tmp, err, errlen)) {
    bson_destroy(&tmp);
    return 0;
  }
  bson_iter_init(&it, &tmp);
  while (bson_iter_next(&it)) {
    if (bson_iter_key(&it)[0] == '$') ops++;
    else plain++;
  }
  if (ops && plain) {
    snprintf(err, errlen, "changes mix update operators and fields");
    bson_destroy(&tmp);
    return 0;
  }
  bson_iter_init(&it, &tmp);
  while (bson_iter_next(&it)) {
    if (plain) {
      if (touches(bson_iter_key(&it), l)) {
        snprintf(err, errlen, "changes must not touch %s", bson_iter_key(&it));
        bson_destroy(&tmp);
        return 0;
      }
      continue;
    }
    if (!BSON_ITER_HOLDS_DOCUMENT(&it) || !bson_iter_recurse(&it, &sub)) {
      snprintf(err, errlen, "%s needs a document", bson_iter_key(&it));
      bson_destroy(&tmp);
      return 0;
    }
    while (bson_iter_next(&sub)) {
      if (touches(bson_iter_key(&sub), l)) {
        snprintf(err, errlen, "changes must not touch %s", bson_iter_key(&sub));
        bson_destroy(&tmp);
        return 0;
      }
    }
    if (!strcmp(bson_iter_key(&it), "$rename")) {
      bson_iter_recurse(&it, &sub);
      while (bson_iter_next(&sub)) {
        if (BSON_ITER_HOLDS_UTF8(&sub) && touches(bson_iter_utf8(&sub, NULL), l)) {
          snprintf(err, errlen, "changes must not touch %s", bson_iter_utf8(&sub, NULL));
          bson_destroy(&tmp);
          return 0;
        }
      }
    }
  }
  if (plain) BSON_APPEND_DOCUMENT(out, "$set", &tmp);
  else bson_concat(out, &tmp);
  bson_destroy(&tmp);
  return 1;
}
