/*
 * Locks on the application's own documents: the lock lives in two fields of
 * the document itself (owner and time, names configurable), the handle is
 * the same mongolock.Lock as for named locks (lock.c's lease).
 *
 * Acquire is one findAndModify on {_id} alone whose update pipeline takes
 * the lock only when it is free by the server's clock, and (when the caller
 * gave a document to insert) creates the document when it is missing:
 *
 *   [ {$replaceWith: {$cond: [ONLY_ID, {$mergeObjects: [{$literal: INSERT},
 *                                                       {_id: "$_id"}]},
 *                             "$$ROOT"]}},                 (insert only)
 *     {$set: {O: {$cond: [FREE, OWNER, "$O"]},
 *             T: {$cond: [FREE, TIME,  "$T"]}}} ]
 *   upsert: INSERT given, new: true,
 *   fields: {_id: 0, doc: "$$ROOT", remainingMs: END - $$NOW}
 *
 *   expires-at mode: FREE = O null/missing or T <= $$NOW;  TIME = $$NOW + ttl
 *   locked-at mode:  FREE = O null/missing or T + ttl <= $$NOW; TIME = $$NOW
 *
 * An upsert runs the pipeline on {_id: id}: ONLY_ID holds, the insert
 * document is merged in and locked in the same write.  A held lock is
 * written back unchanged (a no-op for the server).  Won when the returned
 * owner is ours.
 *
 * Release with changes (h:release(changes)) is one update that applies the
 * changes and clears the lock fields, filtered on {_id, O: ours}.
 */
#include <string.h>
#include <unistd.h>

#include "mongolock.h"

#define DOCHANDLES "mongolock.documents.handles"
#define TTL_MAX_MS ((int64_t)365 * 24 * 3600 * 1000)

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

static int hexval(char ch) {
  if (ch >= '0' && ch <= '9') return ch - '0';
  if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
  return 0;
}

static void append_owner(bson_t *b, const char *key, const char *owner, ml_owner_form form) {
  if (form == ML_OWNER_UUID) {
    uint8_t u[16];
    int i;
    for (i = 0; i < 16; i++)
      u[i] = (uint8_t)(hexval(owner[2 * i]) << 4 | hexval(owner[2 * i + 1]));
    bson_append_binary(b, key, -1, BSON_SUBTYPE_UUID, u, 16);
  } else {
    bson_append_utf8(b, key, -1, owner, 32);
  }
}

static int owner_is(const bson_iter_t *it, const char *owner, ml_owner_form form) {
  if (form == ML_OWNER_HEX) {
    uint32_t len;
    return BSON_ITER_HOLDS_UTF8(it) && !strcmp(bson_iter_utf8(it, &len), owner) && len == 32;
  }
  if (BSON_ITER_HOLDS_BINARY(it)) {
    bson_subtype_t st;
    uint32_t len;
    const uint8_t *data;
    int i;
    bson_iter_binary(it, &st, &len, &data);
    if (st != BSON_SUBTYPE_UUID || len != 16) return 0;
    for (i = 0; i < 16; i++)
      if (data[i] != (uint8_t)(hexval(owner[2 * i]) << 4 | hexval(owner[2 * i + 1]))) return 0;
    return 1;
  }
  return 0;
}

/* "$" .. field into buf */
static const char *fref(char *buf, size_t n, const char *field) {
  snprintf(buf, n, "$%s", field);
  return buf;
}

/* END: the lease end as an expression, under key */
static void append_end(bson_t *p, const char *key, const char *tf, ml_time_mode mode,
                       int64_t ttl_ms) {
  char r[300];
  if (mode == ML_TIME_EXPIRES_AT) {
    BSON_APPEND_UTF8(p, key, fref(r, sizeof r, tf));
  } else {
    bson_t d, a;
    BSON_APPEND_DOCUMENT_BEGIN(p, key, &d);
    BSON_APPEND_ARRAY_BEGIN(&d, "$add", &a);
    BSON_APPEND_UTF8(&a, "0", fref(r, sizeof r, tf));
    BSON_APPEND_INT64(&a, "1", ttl_ms);
    bson_append_array_end(&d, &a);
    bson_append_document_end(p, &d);
  }
}

/* FREE under key */
static void append_free(bson_t *p, const char *key, const char *of, const char *tf,
                        ml_time_mode mode, int64_t ttl_ms) {
  bson_t d, or_, eq, eqa, ifn, ifna, lte, ltea;
  char r[300];
  BSON_APPEND_DOCUMENT_BEGIN(p, key, &d);
  BSON_APPEND_ARRAY_BEGIN(&d, "$or", &or_);
  BSON_APPEND_DOCUMENT_BEGIN(&or_, "0", &eq);
  BSON_APPEND_ARRAY_BEGIN(&eq, "$eq", &eqa);
  BSON_APPEND_DOCUMENT_BEGIN(&eqa, "0", &ifn);
  BSON_APPEND_ARRAY_BEGIN(&ifn, "$ifNull", &ifna);
  BSON_APPEND_UTF8(&ifna, "0", fref(r, sizeof r, of));
  BSON_APPEND_NULL(&ifna, "1");
  bson_append_array_end(&ifn, &ifna);
  bson_append_document_end(&eqa, &ifn);
  BSON_APPEND_NULL(&eqa, "1");
  bson_append_array_end(&eq, &eqa);
  bson_append_document_end(&or_, &eq);
  BSON_APPEND_DOCUMENT_BEGIN(&or_, "1", &lte);
  BSON_APPEND_ARRAY_BEGIN(&lte, "$lte", &ltea);
  append_end(&ltea, "0", tf, mode, ttl_ms);
  BSON_APPEND_UTF8(&ltea, "1", "$$NOW");
  bson_append_array_end(&lte, &ltea);
  bson_append_document_end(&or_, &lte);
  bson_append_array_end(&d, &or_);
  bson_append_document_end(p, &d);
}

/* {key: {$cond: [FREE, <then>, "$key"]}}: opens the array; the caller
 * appends "1" (the value when free) and calls cond_close */
static void cond_open(bson_t *set, const char *key, bson_t *d, bson_t *a, const char *of,
                      const char *tf, ml_time_mode mode, int64_t ttl_ms) {
  BSON_APPEND_DOCUMENT_BEGIN(set, key, d);
  BSON_APPEND_ARRAY_BEGIN(d, "$cond", a);
  append_free(a, "0", of, tf, mode, ttl_ms);
}

static void cond_close(bson_t *set, const char *key, bson_t *d, bson_t *a) {
  char r[300];
  BSON_APPEND_UTF8(a, "2", fref(r, sizeof r, key));
  bson_append_array_end(d, a);
  bson_append_document_end(set, d);
}

/* ---- acquire ----------------------------------------------------------- */

static int check_field(const char *s, size_t len) {
  return len > 0 && len < 256 && strlen(s) == len && s[0] != '$' && !strchr(s, '.') &&
         strcmp(s, "_id") != 0 && bson_utf8_validate(s, len, false);
}

static const char *arg_field(lua_State *L, int i) {
  size_t len;
  const char *s = luaL_checklstring(L, i, &len);
  luaL_argcheck(L, check_field(s, len), i,
                "field name must be 1..255 bytes of UTF-8, no '.', no leading '$', not _id");
  return s;
}

static const char *arg_ns(lua_State *L, int i) {
  size_t len;
  const char *s = luaL_checklstring(L, i, &len);
  luaL_argcheck(L, len > 0 && len < 256 && strlen(s) == len && bson_utf8_validate(s, len, false),
                i, "name must be 1..255 bytes of UTF-8 without NUL");
  return s;
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
static int l_doc_acquire(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = arg_ns(L, 2), *coll = arg_ns(L, 3);
  const char *of, *tf, *mode_s, *form_s;
  ml_time_mode mode;
  ml_owner_form form;
  lua_Number ttl_n;
  int64_t ttl_ms;
  int have_insert, renew;
  bson_t idholder, ins = BSON_INITIALIZER;
  bson_value_t id;
  char err[512], owner[33];
  bson_t cmd = BSON_INITIALIZER, opts = BSON_INITIALIZER, reply, q, u, stage, set, d, a, fields;
  bson_error_t e;
  bson_iter_t it;
  double started;
  int ok;

  luaL_checkany(L, 4);
  ttl_n = luaL_checknumber(L, 5);
  luaL_argcheck(L, ttl_n == ttl_n && ttl_n >= 1 && ttl_n <= (lua_Number)TTL_MAX_MS, 5,
                "ttl must be a positive number of milliseconds, at most a year");
  ttl_ms = (int64_t)ttl_n;
  of = arg_field(L, 6);
  tf = arg_field(L, 7);
  luaL_argcheck(L, strcmp(of, tf) != 0, 7, "owner and time fields must differ");
  mode_s = luaL_checkstring(L, 8);
  if (!strcmp(mode_s, "expires")) mode = ML_TIME_EXPIRES_AT;
  else if (!strcmp(mode_s, "locked")) mode = ML_TIME_LOCKED_AT;
  else return luaL_argerror(L, 8, "\"expires\" or \"locked\" expected");
  form_s = luaL_checkstring(L, 9);
  if (!strcmp(form_s, "hex")) form = ML_OWNER_HEX;
  else if (!strcmp(form_s, "uuid")) form = ML_OWNER_UUID;
  else return luaL_argerror(L, 9, "\"hex\" or \"uuid\" expected");
  have_insert = !lua_isnoneornil(L, 10);
  if (have_insert) luaL_checktype(L, 10, LUA_TTABLE);
  renew = lua_toboolean(L, 11);

  if (lua_isnil(L, 4)) return luaL_argerror(L, 4, "_id expected, got nil");
  if (!tovalue(L, 4, &idholder, &id, err, sizeof err)) {
    bson_destroy(&idholder);
    return luaL_argerror(L, 4, err);
  }
  if (id.value_type == BSON_TYPE_ARRAY) {
    bson_destroy(&idholder);
    return luaL_argerror(L, 4, "an array cannot be an _id");
  }
  if (have_insert) {
    bson_iter_t ii;
    if (!ml_tobson(L, 10, &ins, err, sizeof err)) {
      bson_destroy(&idholder);
      bson_destroy(&ins);
      return luaL_argerror(L, 10, err);
    }
    if (bson_iter_init(&ii, &ins)) {
      while (bson_iter_next(&ii)) {
        const char *k = bson_iter_key(&ii);
        if (!strcmp(k, of) || !strcmp(k, tf)) {
          bson_destroy(&idholder);
          bson_destroy(&ins);
          return luaL_argerror(L, 10, "the insert document must not set the lock fields");
        }
      }
    }
  }
  if (!ml_random_owner(owner)) {
    bson_destroy(&idholder);
    bson_destroy(&ins);
    return ml_pushfail(L, "getrandom failed", 0);
  }

  BSON_APPEND_UTF8(&cmd, "findAndModify", coll);
  BSON_APPEND_DOCUMENT_BEGIN(&cmd, "query", &q);
  BSON_APPEND_VALUE(&q, "_id", &id);
  bson_append_document_end(&cmd, &q);
  BSON_APPEND_ARRAY_BEGIN(&cmd, "update", &u);
  if (have_insert) {
    /* {$replaceWith: {$cond: [{$eq: [{$size: {$objectToArray: "$$ROOT"}}, 1]},
     *   {$mergeObjects: [{$literal: INSERT}, {_id: "$_id"}]}, "$$ROOT"]}} */
    bson_t rw, ca, eq, eqa, sz, ota, mo, moa, litd, idd;
    BSON_APPEND_DOCUMENT_BEGIN(&u, "0", &stage);
    BSON_APPEND_DOCUMENT_BEGIN(&stage, "$replaceWith", &rw);
    BSON_APPEND_ARRAY_BEGIN(&rw, "$cond", &ca);
    BSON_APPEND_DOCUMENT_BEGIN(&ca, "0", &eq);
    BSON_APPEND_ARRAY_BEGIN(&eq, "$eq", &eqa);
    BSON_APPEND_DOCUMENT_BEGIN(&eqa, "0", &sz);
    BSON_APPEND_DOCUMENT_BEGIN(&sz, "$size", &ota);
    BSON_APPEND_UTF8(&ota, "$objectToArray", "$$ROOT");
    bson_append_document_end(&sz, &ota);
    bson_append_document_end(&eqa, &sz);
    BSON_APPEND_INT32(&eqa, "1", 1);
    bson_append_array_end(&eq, &eqa);
    bson_append_document_end(&ca, &eq);
    BSON_APPEND_DOCUMENT_BEGIN(&ca, "1", &mo);
    BSON_APPEND_ARRAY_BEGIN(&mo, "$mergeObjects", &moa);
    BSON_APPEND_DOCUMENT_BEGIN(&moa, "0", &litd);
    BSON_APPEND_DOCUMENT(&litd, "$literal", &ins);
    bson_append_document_end(&moa, &litd);
    BSON_APPEND_DOCUMENT_BEGIN(&moa, "1", &idd);
    BSON_APPEND_UTF8(&idd, "_id", "$_id");
    bson_append_document_end(&moa, &idd);
    bson_append_array_end(&mo, &moa);
    bson_append_document_end(&ca, &mo);
    BSON_APPEND_UTF8(&ca, "2", "$$ROOT");
    bson_append_array_end(&rw, &ca);
    bson_append_document_end(&stage, &rw);
    bson_append_document_end(&u, &stage);
  }
  BSON_APPEND_DOCUMENT_BEGIN(&u, have_insert ? "1" : "0", &stage);
  BSON_APPEND_DOCUMENT_BEGIN(&stage, "$set", &set);
  cond_open(&set, of, &d, &a, of, tf, mode, ttl_ms);
  append_owner(&a, "1", owner, form);
  cond_close(&set, of, &d, &a);
  cond_open(&set, tf, &d, &a, of, tf, mode, ttl_ms);
  if (mode == ML_TIME_EXPIRES_AT) {
    bson_t x, xa;
    BSON_APPEND_DOCUMENT_BEGIN(&a, "1", &x);
    BSON_APPEND_ARRAY_BEGIN(&x, "$add", &xa);
    BSON_APPEND_UTF8(&xa, "0", "$$NOW");
    BSON_APPEND_INT64(&xa, "1", ttl_ms);
    bson_append_array_end(&x, &xa);
    bson_append_document_end(&a, &x);
  } else {
    BSON_APPEND_UTF8(&a, "1", "$$NOW");
  }
  cond_close(&set, tf, &d, &a);
  bson_append_document_end(&stage, &set);
  bson_append_document_end(&u, &stage);
  bson_append_array_end(&cmd, &u);
  BSON_APPEND_BOOL(&cmd, "new", true);
  BSON_APPEND_BOOL(&cmd, "upsert", have_insert);
  BSON_APPEND_DOCUMENT_BEGIN(&cmd, "fields", &fields);
  BSON_APPEND_INT32(&fields, "_id", 0);
  BSON_APPEND_UTF8(&fields, "doc", "$$ROOT");
  {
    bson_t sub, suba;
    BSON_APPEND_DOCUMENT_BEGIN(&fields, "remainingMs", &sub);
    BSON_APPEND_ARRAY_BEGIN(&sub, "$subtract", &suba);
    append_end(&suba, "0", tf, mode, ttl_ms);
    BSON_APPEND_UTF8(&suba, "1", "$$NOW");
    bson_append_array_end(&sub, &suba);
    bson_append_document_end(&fields, &sub);
  }
  bson_append_document_end(&cmd, &fields);
  bson_destroy(&ins);

  ml_client_append_wc(c, &opts);
  started = ml_monotonic();
  ok = mongoc_client_write_command_with_opts(ml_client_get(L, c), db, &cmd, &opts, &reply, &e);
  bson_destroy(&cmd);
  bson_destroy(&opts);
  if (!ok) {
    bson_destroy(&idholder);
    bson_destroy(&reply);
    return ml_pusherror(L, &e);
  }
  if (!bson_iter_init_find(&it, &reply, "value") || !BSON_ITER_HOLDS_DOCUMENT(&it)) {
    bson_destroy(&idholder);
    bson_destroy(&reply);
    return ml_pushfail(L, "not found", 0);
  }
  {
    bson_iter_t v, docit, own;
    int64_t remaining = 0;
    int won = 0, has_doc;
    bson_iter_recurse(&it, &v);
    has_doc = bson_iter_find(&v, "doc") && BSON_ITER_HOLDS_DOCUMENT(&v);
    if (has_doc) {
      docit = v;
      if (bson_iter_recurse(&docit, &own) && bson_iter_find(&own, of))
        won = owner_is(&own, owner, form);
    }
    bson_iter_recurse(&it, &v);
    if (bson_iter_find(&v, "remainingMs") && BSON_ITER_HOLDS_NUMBER(&v))
      remaining = bson_iter_as_int64(&v);
    if (!has_doc) {
      bson_destroy(&idholder);
      bson_destroy(&reply);
      return ml_pushfail(L, "findAndModify returned no document", 0);
    }
    if (won) {
      ml_lease_spec s;
      memset(&s, 0, sizeof s);
      s.db = db;
      s.coll = coll;
      s.id = &id;
      s.owner_field = of;
      s.time_field = tf;
      s.time_mode = mode;
      s.owner_form = form;
      s.owner = owner;
      s.token = 0;
      s.ttl_ms = ttl_ms;
      s.started = started;
      s.renew = renew;
      ml_lock_new(L, 1, &s);                          /* [.. h] */
      lua_getfield(L, LUA_REGISTRYINDEX, DOCHANDLES);
      lua_pushvalue(L, -2);
      lua_pushboolean(L, 1);
      lua_rawset(L, -3);
      lua_pop(L, 1);
      ml_pushbsonvalue(L, &docit);                    /* [.. h doc] */
      bson_destroy(&idholder);
      bson_destroy(&reply);
      return 2;
    }
    lua_pushnil(L);
    lua_pushliteral(L, "busy");
    lua_createtable(L, 0, 3);
    ml_pushbsonvalue(L, &docit);
    lua_getfield(L, -1, of);
    lua_setfield(L, -3, "owner");
    lua_setfield(L, -2, "doc");
    lua_pushnumber(L, (lua_Number)(remaining > 0 ? remaining : 0) / 1000.0);
    lua_setfield(L, -2, "remaining");
    ml_set_operation_time(L, &reply);
    bson_destroy(&idholder);
    bson_destroy(&reply);
    return 3;
  }
}

/* ---- release with changes ---------------------------------------------- */

/* does key (a field path) start with one of the lock's fields or _id? */
static int touches(const char *key, const ml_lease *l) {
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
static int changes_tobson(lua_State *L, int idx, const ml_lease *l, bson_t *out, char *err,
                          size_t errlen) {
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

/* the client of a handle (NULL when gone); leaves the stack as it was */
static ml_client *handle_client(lua_State *L, int idx) {
  ml_client *c;
  ml_getuservalue(L, idx);
  if (!lua_istable(L, -1)) {
    lua_pop(L, 1);
    return NULL;
  }
  lua_rawgeti(L, -1, 1);
  c = (ml_client *)luaL_testudata(L, -1, ML_CLIENT_MT);
  lua_pop(L, 2);
  return c;
}

static int is_doc_handle(lua_State *L, int idx) {
  int r;
  lua_getfield(L, LUA_REGISTRYINDEX, DOCHANDLES);
  lua_pushvalue(L, idx);
  lua_rawget(L, -2);
  r = lua_toboolean(L, -1);
  lua_pop(L, 2);
  return r;
}

/*
 * h:release([changes]) for every mongolock.Lock: named locks go to lock.c's
 * release (upvalue 1) and take no changes; document locks apply changes in
 * the unlocking command.
 *   -> true | nil, "lost" (no longer ours on the server) | nil, "not held"
 *      (already released) | nil, "closed" | nil, message, code
 */
static int l_release(lua_State *L) {
  ml_lock *h = ml_checklock(L, 1);
  ml_lease *l = h->lease;
  ml_client *c;
  bson_t extra = BSON_INITIALIZER;
  bson_error_t e;
  char err[512];
  int r, held, lost, has_changes = !lua_isnoneornil(L, 2);
  if (!is_doc_handle(L, 1)) {
    if (has_changes) return luaL_argerror(L, 2, "a named lock's release takes no changes");
    int base = lua_gettop(L);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_pushvalue(L, 1);
    lua_call(L, 1, LUA_MULTRET);
    return lua_gettop(L) - base;
  }
  if (has_changes) luaL_checktype(L, 2, LUA_TTABLE);
  if (!l) return ml_pushfail(L, "closed", 0);
  c = handle_client(L, 1);
  if (!c || c->closed) return ml_pushfail(L, "closed", 0);
  pthread_mutex_lock(&l->mu);
  held = l->held && l->pid == getpid();
  lost = l->lost;
  pthread_mutex_unlock(&l->mu);
  if (lost) return ml_pushfail(L, "lost", 0);
  if (!held) return ml_pushfail(L, "not held", 0);
  if (has_changes && !changes_tobson(L, 2, l, &extra, err, sizeof err)) {
    bson_destroy(&extra);
    return luaL_argerror(L, 2, err);
  }
  r = ml_lease_release(ml_client_get(L, c), c, l, has_changes ? &extra : NULL, &e);
  bson_destroy(&extra);
  if (r < 0) return ml_pusherror(L, &e);
  pthread_mutex_lock(&l->mu);
  l->held = 0;
  if (r == 0) l->lost = 1;
  pthread_mutex_unlock(&l->mu);
  if (r == 0) return ml_pushfail(L, "lost", 0);
  lua_pushboolean(L, 1);
  return 1;
}

static const luaL_Reg client_doc_methods[] = {
  {"doc_acquire", l_doc_acquire},
  {NULL, NULL}
};

void ml_documents_open(lua_State *L) {
  /* [module] */
  lua_newtable(L);                               /* weak set of handles */
  lua_createtable(L, 0, 1);
  lua_pushliteral(L, "k");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_setfield(L, LUA_REGISTRYINDEX, DOCHANDLES);

  luaL_getmetatable(L, ML_CLIENT_MT);
  lua_getfield(L, -1, "__index");
  luaL_setfuncs(L, client_doc_methods, 0);
  lua_pop(L, 2);

  /* Lock.release gains the changes argument (document locks) */
  luaL_getmetatable(L, ML_LOCK_MT);
  lua_getfield(L, -1, "__methods");              /* [module, mt, methods] */
  lua_getfield(L, -1, "release");
  lua_pushcclosure(L, l_release, 1);
  lua_setfield(L, -2, "release");
  lua_pop(L, 2);
}
