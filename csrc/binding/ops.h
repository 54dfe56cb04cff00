/*
 * The protocol and the transport seen from Lua (ops.c): core.op_* and
 * core.parse_*, client:run, and the Lua tables that parsed replies make.
 *
 * May include: client.h, protocol.h.
 */
#ifndef MONGOLOCK_OPS_H
#define MONGOLOCK_OPS_H

#include "client.h"
#include "protocol.h"

/* [-0, +0] sets operation_time = {t, i} in the table on top of the stack
 * from a reply's operationTime (a replica set's); nothing when it has none */
void ml_set_operation_time(lua_State *L, const bson_t *reply);

/* [-0, +1] {owner, token, remaining, expires_at, holder, queued, position,
 * operation_time} of a lost named-lock attempt */
void ml_push_acquire_info(lua_State *L, const ml_acquire_reply *r, const bson_t *reply);

/* [-0, +1] the array of status tables of a status/list reply */
void ml_push_status_list(lua_State *L, const bson_t *reply);

/* [-0, +1|4] runs op on c: pushes the reply (a table when decode, else a
 * BSON string) or nil, message, code, reply; returns the count */
int ml_push_run(lua_State *L, ml_client *c, const ml_op *op, int decode);

/* [-0, +1] a busy document attempt's info {owner, remaining, doc,
 * operation_time} */
void ml_push_doc_info(lua_State *L, const ml_acquire_reply *ar, const bson_t *reply,
                      const char *owner_field);
/* a document status reply: pushes {held, state, owner, remaining} or nil,
 * "not found"; returns the values pushed */
int ml_push_doc_status(lua_State *L, const bson_t *reply);

/* [-0, +0] adds op_* and parse_* to the module table on top */
void ml_ops_open(lua_State *L);

/* Client methods: client:run(op) */
extern const luaL_Reg ml_ops_methods[];

#endif
