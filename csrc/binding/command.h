/*
 * client:command and core.op_command (command.c).
 *
 * May include: compat.h, protocol.h.
 */
#ifndef MONGOLOCK_COMMAND_H
#define MONGOLOCK_COMMAND_H

#include "compat.h"
#include "protocol.h"

/* the op of client:command(db, cmd, opts) with db at index first (raises
 * on malformed arguments) */
void ml_command_op(lua_State *L, int first, ml_op *op);

/* [-0, +0] adds op_command to the module table at the top of the stack */
void ml_command_open(lua_State *L);

/* Client methods: client:command */
extern const luaL_Reg ml_command_methods[];

#endif
