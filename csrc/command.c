/*
 * Generic commands on a client: client:command(db, cmd [, opts]).
 *
 * Results follow the project's convention: the server's reply as a Lua
 * table, or nil, message, code, reply where code is MongoDB's error code
 * (nil for client-side failures).  A reply with ok: 1 that carries
 * writeErrors or a writeConcernError is a failure too: its first error's
 * errmsg and code are returned.
 */
#include <string.h>

#include "mongolock.h"

/* commands that write: the client's write concern is added to them when
 * opts has none */
static const char *const write_commands[] = {
  "insert", "update", "delete", "findAndModify", "findandmodify", "create", "drop",
  "createIndexes", "dropIndexes", "dropDatabase", "renameCollection", "collMod", NULL
};

static int is_write_command(const char *name) {
  int i;
  for (i = 0; write_commands[i]; i++)
    if (!strcmp(name, write_commands[i])) return 1;
  return 0;
}

/* a database name: 1..63 bytes, none of /\. "$ and no NUL */
static const char *check_db(lua_State *L, int i) {
  size_t len;
  const char *s;
  luaL_checktype(L, i, LUA_TSTRING);   /* a number is no database name */
  s = lua_tolstring(L, i, &len);
  luaL_argcheck(L, len > 0 && len < 64 && strlen(s) == len && strcspn(s, "/\\. \"$") == len, i,
                "invalid database name");
  return s;
}

/*
 * Sets e from the reply's first writeErrors entry or its writeConcernError.
 * Returns 1 when there was one.
 */
static int reply_write_error(const bson_t *reply, bson_error_t *e) {
  bson_iter_t it, sub, f;
  const char *which[2] = {"writeErrors", "writeConcernError"};
  int k;
  for (k = 0; k < 2; k++) {
    const char *msg = "write error";
    int32_t code = 0;
    if (!bson_iter_init_find(&it, reply, which[k])) continue;
    if (k == 0) {
      if (!BSON_ITER_HOLDS_ARRAY(&it) || !bson_iter_recurse(&it, &sub) || !bson_iter_next(&sub))
        continue;
      if (!BSON_ITER_HOLDS_DOCUMENT(&sub) || !bson_iter_recurse(&sub, &f)) continue;
    } else {
      msg = "write concern error";
      if (!BSON_ITER_HOLDS_DOCUMENT(&it) || !bson_iter_recurse(&it, &f)) continue;
    }
    while (bson_iter_next(&f)) {
      if (!strcmp(bson_iter_key(&f), "errmsg") && BSON_ITER_HOLDS_UTF8(&f))
        msg = bson_iter_utf8(&f, NULL);
      else if (!strcmp(bson_iter_key(&f), "code") && BSON_ITER_HOLDS_NUMBER(&f))
        code = (int32_t)bson_iter_as_int64(&f);
    }
    bson_set_error(e, MONGOC_ERROR_SERVER, (uint32_t)code, "%s", msg);
    return 1;
  }
  return 0;
}

/*
 * client:command(db, cmd [, opts]) -> reply | nil, message, code, reply
 *
 * cmd is a table with exactly one key, the command name (a Lua table has
 * no key order, and MongoDB needs the name first); every other field of
 * the command goes in opts.  Malformed tables raise.  Write commands get
 * the client's write concern unless opts has writeConcern.
 */
static int l_command(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  const char *db = check_db(L, 2);
  const char *name;
  int nkeys = 0;
  bson_t cmd = BSON_INITIALIZER, opts = BSON_INITIALIZER, reply;
  bson_error_t err;
  char msg[512];
  mongoc_client_t *mc;
  int ok;

  luaL_checktype(L, 3, LUA_TTABLE);
  if (!lua_isnoneornil(L, 4)) luaL_checktype(L, 4, LUA_TTABLE);
  lua_settop(L, 4);
  lua_pushnil(L);
  while (lua_next(L, 3)) {
    lua_pop(L, 1);
    nkeys++;
    if (lua_type(L, -1) != LUA_TSTRING) nkeys = 100;
  }
  luaL_argcheck(L, nkeys == 1, 3,
                "one key expected (the command name); put the other fields in opts");
  if (!ml_tobson(L, 3, &cmd, msg, sizeof msg)) {
    bson_destroy(&cmd);
    return luaL_argerror(L, 3, msg);
  }
  if (!lua_isnil(L, 4) && !ml_tobson(L, 4, &opts, msg, sizeof msg)) {
    bson_destroy(&cmd);
    bson_destroy(&opts);
    return luaL_argerror(L, 4, msg);
  }
  {
    bson_iter_t it;
    bson_iter_init(&it, &cmd);
    bson_iter_next(&it);
    name = bson_iter_key(&it);
    if (is_write_command(name) && !bson_has_field(&opts, "writeConcern"))
      ml_client_append_wc(c, &opts);
  }
  mc = ml_client_get(L, c);
  ok = mongoc_client_command_with_opts(mc, db, &cmd, NULL, &opts, &reply, &err);
  bson_destroy(&cmd);
  bson_destroy(&opts);
  if (ok && !reply_write_error(&reply, &err)) {
    ml_pushbson(L, &reply);
    bson_destroy(&reply);
    return 1;
  }
  ml_pusherror(L, &err);
  if (!bson_empty(&reply)) ml_pushbson(L, &reply);
  else lua_pushnil(L);
  bson_destroy(&reply);
  return 4;
}

static const luaL_Reg client_command_methods[] = {
  {"command", l_command},
  {NULL, NULL}
};

void ml_command_open(lua_State *L) {
  /* [module]: the methods go on mongolock.Client */
  luaL_getmetatable(L, ML_CLIENT_MT);
  lua_getfield(L, -1, "__index");
  luaL_setfuncs(L, client_command_methods, 0);
  lua_pop(L, 2);
}
