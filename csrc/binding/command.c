/*
 * Generic commands on a client: client:command(db, cmd [, opts])
 * (ml_command_methods), and the op it runs (also core.op_command).
 *
 * Results follow the project's convention: the server's reply as a Lua
 * table, or nil, message, code, reply where code is MongoDB's error code
 * (nil for client-side failures).  A reply with ok: 1 that carries
 * writeErrors or a writeConcernError is a failure too: its first error's
 * errmsg and code are returned.
 */
#include <string.h>

#include "protocol.h"
#include "bson_lua.h"
#include "args.h"
#include "client.h"
#include "ops.h"
#include "command.h"

/* a database name (MongoDB's limits, protocol.c) */
static const char *check_db(lua_State *L, int i) {
  size_t len;
  const char *s, *msg;
  luaL_checktype(L, i, LUA_TSTRING);   /* a number is no database name */
  s = lua_tolstring(L, i, &len);
  if ((msg = ml_check_db(s, len)) != NULL) luaL_argerror(L, i, msg);
  return s;
}

/*
 * The op of a command: db at first, cmd (a table with exactly one key, the
 * command name) at first + 1, opts (the other fields, may be nil) at
 * first + 2.  Raises on malformed arguments.
 */
void ml_command_op(lua_State *L, int first, ml_op *op) {
  const char *db = check_db(L, first);
  int nkeys = 0, icmd = first + 1, iopts = first + 2, isession = first + 3;
  const char *session = NULL;
  if (!lua_isnoneornil(L, isession)) {
    size_t len, i;
    session = luaL_checklstring(L, isession, &len);
    for (i = 0; i < len && strchr("0123456789abcdef", session[i]) && session[i]; i++) {}
    luaL_argcheck(L, len == 32 && i == len, isession, "session key: 32 lowercase hex digits expected");
  }
  bson_t cmd = BSON_INITIALIZER, opts = BSON_INITIALIZER;
  char msg[512];
  luaL_checktype(L, icmd, LUA_TTABLE);
  if (!lua_isnoneornil(L, iopts)) luaL_checktype(L, iopts, LUA_TTABLE);
  lua_settop(L, isession);
  lua_pushnil(L);
  while (lua_next(L, icmd)) {
    lua_pop(L, 1);
    nkeys++;
    if (lua_type(L, -1) != LUA_TSTRING) nkeys = 100;
  }
  luaL_argcheck(L, nkeys == 1, icmd,
                "one key expected (the command name); put the other fields in opts");
  if (!ml_tobson(L, icmd, &cmd, msg, sizeof msg)) {
    bson_destroy(&cmd);
    luaL_argerror(L, icmd, msg);
  }
  if (!lua_isnil(L, iopts) && !ml_tobson(L, iopts, &opts, msg, sizeof msg)) {
    bson_destroy(&cmd);
    bson_destroy(&opts);
    luaL_argerror(L, iopts, msg);
  }
  ml_build_command(op, db, &cmd, &opts);
  op->session = session;   /* (a string on the Lua stack: the op lives no longer) */
  bson_destroy(&cmd);
  bson_destroy(&opts);
}

/*
 * client:command(db, cmd [, opts [, session]]) -> reply | nil, message, code, reply
 *
 * session (32 hex digits): the command runs in that explicit session on a
 * connection of its own (transport.h): a multi-document transaction's
 * commands (mongolock.transaction).
 * cmd is a table with exactly one key, the command name (a Lua table has
 * no key order, and MongoDB needs the name first); every other field of
 * the command goes in opts.  Malformed tables raise.  Write commands get
 * the client's write concern unless opts has writeConcern.
 */
static int ml_m_command(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  ml_op op;
  int n;
  ml_command_op(L, 2, &op);
  n = ml_push_run(L, c, &op, 1);
  ml_op_destroy(&op);
  return n;
}

/* Client methods: any command (module.c adds them to mongolock.Client) */
const luaL_Reg ml_command_methods[] = {
  {"command", ml_m_command},
  {NULL, NULL}
};

/* core.op_command(db, cmd, opts) -> op: what client:command sends (an op
 * envelope, args.h) */
static int l_op_command(lua_State *L) {
  ml_op op;
  ml_command_op(L, 1, &op);
  ml_push_op(L, &op);
  ml_op_destroy(&op);
  return 1;
}

/* [-0, +0] adds op_command to the module table at the top of the stack */
void ml_command_open(lua_State *L) {
  lua_pushcfunction(L, l_op_command);
  lua_setfield(L, -2, "op_command");
}
