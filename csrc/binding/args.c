/*
 * The argument layer of the Lua binding (args.h): the arguments every type
 * file reads and the failures they all answer.  Calls no type file.
 *
 * May include: args.h, bson_lua.h (Lua value <-> BSON), sys.h (ids) and
 * system/libbson/libmongoc headers (for the error domains).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <mongoc/mongoc.h>

#include "args.h"
#include "bson_lua.h"
#include "lease.h"
#include "sys.h"

/* ---- answers ------------------------------------------------------------ */

int ml_pusherror(lua_State *L, const bson_error_t *e) {
  lua_pushnil(L);
  lua_pushstring(L, e->message[0] ? e->message : "unknown error");
  if (e->code) lua_pushinteger(L, (lua_Integer)e->code);
  else lua_pushnil(L);
  return 3;
}

int ml_pushfail(lua_State *L, const char *msg, int code) {
  lua_pushnil(L);
  lua_pushstring(L, msg);
  if (code) lua_pushinteger(L, code);
  else lua_pushnil(L);
  return 3;
}

/* ---- the lock commands' arguments ---------------------------------------- */

void ml_arg_ns(lua_State *L, int i, const char **db, const char **coll) {
  size_t len;
  const char *msg;
  luaL_checktype(L, i, LUA_TSTRING);        /* a number is no name */
  *db = lua_tolstring(L, i, &len);
  if ((msg = ml_check_db(*db, len)) != NULL) luaL_argerror(L, i, msg);
  luaL_checktype(L, i + 1, LUA_TSTRING);
  *coll = lua_tolstring(L, i + 1, &len);
  if ((msg = ml_check_coll(*db, *coll, len)) != NULL) luaL_argerror(L, i + 1, msg);
}

/* raises unless argument i is a string (numbers are not converted) */
const char *ml_arg_string(lua_State *L, int i, size_t *len) {
  if (lua_type(L, i) != LUA_TSTRING)
    luaL_argerror(L, i, lua_pushfstring(L, "string expected, got %s", luaL_typename(L, i)));
  return lua_tolstring(L, i, len);
}

const char *ml_arg_name(lua_State *L, int i, size_t *len) {
  const char *s = ml_arg_string(L, i, len);
  const char *msg = ml_check_name(s, *len);
  if (msg) luaL_argerror(L, i, msg);
  return s;
}

/* the lock of arguments 2 .. 4: database, collection, name */
const char *ml_arg_lock(lua_State *L, const char **db, const char **coll) {
  size_t len;
  ml_arg_ns(L, 2, db, coll);
  return ml_arg_name(L, 4, &len);
}

/* a waiter id (core.waiter_id()): 32 lowercase hex digits */
const char *ml_arg_waiter(lua_State *L, int i) {
  size_t len;
  const char *w = luaL_checklstring(L, i, &len);
  luaL_argcheck(L, ml_is_hex(w, len, 32), i, "waiter id must be 32 lowercase hex digits");
  return w;
}

/* ttl in milliseconds: a positive number up to a year, rounded up */
int64_t ml_arg_ttl_ms(lua_State *L, int i) {
  int64_t ms = ml_ttl_ms(luaL_checknumber(L, i));
  luaL_argcheck(L, ms > 0, i, "ttl must be a positive number of milliseconds, at most a year");
  return ms;
}

int64_t ml_arg_delay_ms(lua_State *L, int i) {
  double ms;
  if (lua_isnoneornil(L, i)) return 0;
  ms = luaL_checknumber(L, i);
  luaL_argcheck(L, ms == 0 || ml_ttl_ms(ms) > 0, i,
                "lock delay must be a number of milliseconds >= 0, at most a year");
  return ms == 0 ? 0 : ml_ttl_ms(ms);
}

double ml_arg_started(lua_State *L, int i) {
  double started = luaL_checknumber(L, i);
  /* a time of this process's monotonic clock, not in its future: a
   * deadline is computed from it */
  luaL_argcheck(L, started == started && started <= ml_monotonic() && started > 0, i,
                "started must be a past reading of core.monotonic()");
  return started;
}

int ml_arg_attempt_owner(lua_State *L, const char *default_app, int app_i, int waiter_i,
                         int owner_i, ml_acquire_args *a, ml_attempt *t) {
  const char *given = NULL;
  a->app = luaL_optstring(L, app_i, NULL);
  t->tag[0] = '\0';
  if (owner_i > 0 && !lua_isnoneornil(L, owner_i)) {
    size_t len;
    given = luaL_checklstring(L, owner_i, &len);
    luaL_argcheck(L, ml_is_hex(given, len, 32), owner_i, "owner must be 32 lowercase hex digits");
  }
  if (!lua_isnoneornil(L, waiter_i)) {
    a->waiter = ml_arg_waiter(L, waiter_i);
    a->queue_ms = ml_arg_ttl_ms(L, waiter_i + 1);
    a->polling = lua_toboolean(L, waiter_i + 2);
    /* a waiter's attempts all write its id as the owner */
    luaL_argcheck(L, !given || !strcmp(given, a->waiter), owner_i, "a waiter's owner is its id");
    memcpy(t->owner, a->waiter, 33);
    if (!ml_process_tag(t->tag)) return 0;
    a->tag = t->tag;
  } else if (given) {
    memcpy(t->owner, given, 33);
  } else if (!ml_random_owner(t->owner)) {
    return 0;
  }
  a->owner = t->owner;
  /* holder.t: a write that ends the lease names this process in lost */
  if (t->tag[0] || ml_process_tag(t->tag)) a->htag = t->tag;
  if (!a->app) a->app = default_app;   /* holder.app: the URI's */
  ml_hostname(t->host);
  if (!bson_utf8_validate(t->host, strlen(t->host), false)) t->host[0] = '\0';
  a->host = t->host;
  a->pid = (int64_t)ml_pid();
  return 1;
}

/* ---- document locks' arguments ------------------------------------------ */

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

static int changes_of(lua_State *L, int idx, const char *owner_field, const char *time_field,
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

/*
 * Converts changes (the table at idx) into an update document of operators
 * in out: a table whose keys all start with '$' is one already; any other
 * is the $set of its fields.  0 with err when malformed or when it touches
 * the lock fields or _id.
 */
int ml_doc_changes(lua_State *L, int idx, const ml_lease *lease, bson_t *out, char *err,
                   size_t errlen) {
  return changes_of(L, idx, lease->owner_field, lease->time_field, out, err, errlen);
}

/* ---- ops and their outcomes ---------------------------------------------- */

static const char *const kinds[] = {"write", "update", "cursor", "command", NULL};

void ml_op_envelope(const ml_op *op, bson_t *env) {
  bson_init(env);
  BSON_APPEND_UTF8(env, "kind", kinds[op->kind]);
  BSON_APPEND_BOOL(env, "retry", op->retry != 0);
  BSON_APPEND_UTF8(env, "db", op->db);
  if (op->coll) BSON_APPEND_UTF8(env, "coll", op->coll);
  if (op->session) BSON_APPEND_UTF8(env, "session", op->session);
  BSON_APPEND_DOCUMENT(env, "cmd", &op->cmd);
}

void ml_push_op(lua_State *L, const ml_op *op) {
  bson_t env;
  ml_op_envelope(op, &env);
  lua_pushlstring(L, (const char *)bson_get_data(&env), env.len);
  bson_destroy(&env);
}

/* the string at i as a view, its length and terminator checked (raises
 * when it is no string); 0 when they are wrong */
static int arg_view(lua_State *L, int i, bson_t *out) {
  size_t len;
  const char *s = luaL_checklstring(L, i, &len);
  return len >= 5 && len <= (size_t)INT32_MAX && bson_init_static(out, (const uint8_t *)s, len);
}

/* a BSON string argument as a view (raises when malformed) */
void ml_arg_bson(lua_State *L, int i, bson_t *out) {
  size_t off;
  if (!arg_view(L, i, out) || !bson_validate(out, BSON_VALIDATE_NONE, &off)) luaL_argerror(L, i, "malformed BSON");
}

int ml_op_view(const bson_t *env, ml_op *op) {
  /* one pass over the envelope's keys, the first of each name counting
   * (as bson_iter_init_find would find it) */
  enum { K_KIND = 1, K_RETRY = 2, K_DB = 4, K_COLL = 8, K_SESSION = 16, K_CMD = 32 };
  bson_iter_t it;
  int k, seen = 0;
  const uint8_t *data = NULL;
  uint32_t len = 0;
  memset(op, 0, sizeof *op);
  op->kind = (ml_run_kind)-1;
  if (!bson_iter_init(&it, env)) return 0;
  while (bson_iter_next(&it)) {
    const char *key = bson_iter_key(&it);
    int utf8 = BSON_ITER_HOLDS_UTF8(&it);
    if (!strcmp(key, "kind") && !(seen & K_KIND)) {
      seen |= K_KIND;
      if (utf8)
        for (k = 0; kinds[k]; k++)
          if (!strcmp(bson_iter_utf8(&it, NULL), kinds[k])) op->kind = (ml_run_kind)k;
    } else if (!strcmp(key, "retry") && !(seen & K_RETRY)) {
      seen |= K_RETRY;
      op->retry = bson_iter_as_bool(&it);
    } else if (!strcmp(key, "db") && !(seen & K_DB)) {
      seen |= K_DB;
      if (utf8) op->db = bson_iter_utf8(&it, NULL);
    } else if (!strcmp(key, "coll") && !(seen & K_COLL)) {
      seen |= K_COLL;
      if (utf8) op->coll = bson_iter_utf8(&it, NULL);
    } else if (!strcmp(key, "session") && !(seen & K_SESSION)) {
      seen |= K_SESSION;
      if (utf8) op->session = bson_iter_utf8(&it, NULL);
    } else if (!strcmp(key, "cmd") && !(seen & K_CMD)) {
      seen |= K_CMD;
      if (BSON_ITER_HOLDS_DOCUMENT(&it)) bson_iter_document(&it, &len, &data);
    }
  }
  if ((int)op->kind < 0 || !op->db || !data) return 0;
  return bson_init_static(&op->cmd, data, len);
}

/* do b's top-level elements read to its end (lengths within bounds,
 * strings terminated)?  Nested documents are not walked */
static int top_level_whole(const bson_t *b) {
  bson_iter_t it;
  if (!bson_iter_init(&it, b)) return 0;
  while (bson_iter_next(&it)) continue;
  return it.err_off == 0;
}

/* the op of an envelope at i: views into the Lua string (never destroyed).
 * The envelope and its command are checked at their top level only, where
 * this library and libmongoc read them (with bounds-checked iterators); what
 * is nested in the command (a filter, a pipeline) only the server reads, and
 * it refuses what is malformed.  A full walk (ml_arg_bson) cost more than
 * the rest of an op's preparation: ops are an event loop's hot path. */
void ml_arg_op(lua_State *L, int i, ml_op *op) {
  bson_t env;
  if (!arg_view(L, i, &env) || !top_level_whole(&env)) luaL_argerror(L, i, "malformed BSON");
  if (!ml_op_view(&env, op) || !top_level_whole(&op->cmd)) luaL_argerror(L, i, "not an op (core.op_*)");
}

/* a BSON string at i, or nil (0); raises when malformed */
static int opt_bson(lua_State *L, int i, bson_t *view) {
  if (lua_isnoneornil(L, i)) return 0;
  ml_arg_bson(L, i, view);
  return 1;
}

int ml_arg_outcome(lua_State *L, int i, bson_t *reply, bson_error_t *err) {
  return ml_arg_outcome_own(L, i, reply, err, 0);
}

int ml_arg_outcome_own(lua_State *L, int i, bson_t *reply, bson_error_t *err, int own) {
  bson_t r, e;
  int has_reply = own ? arg_view(L, i, &r) : opt_bson(L, i, &r), has_ereply = opt_bson(L, i + 3, &e);
  const char *msg = lua_isnoneornil(L, i + 1) ? NULL : luaL_checkstring(L, i + 1);
  lua_Integer code = luaL_optinteger(L, i + 2, 0);
  lua_Integer domain = luaL_optinteger(L, i + 4, 0);
  if (!reply) return has_reply;            /* checked only */
  if (has_reply) {
    bson_copy_to(&r, reply);
    return 1;
  }
  if (has_ereply) bson_copy_to(&e, reply);
  else bson_init(reply);
  if (domain <= 0) {
    /* the transport's own error: without the server's answer (one has
     * ok), what the op asked may have been applied */
    bson_iter_t it;
    domain = has_ereply && bson_iter_init_find(&it, &e, "ok") ? MONGOC_ERROR_SERVER
                                                                : MONGOC_ERROR_STREAM;
  }
  bson_set_error(err, (uint32_t)domain, (uint32_t)code, "%s", msg ? msg : "unknown error");
  return 0;
}
