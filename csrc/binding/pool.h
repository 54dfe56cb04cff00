/*
 * mongolock.Pool (pool.c): worker threads that run ops.
 *
 * May include: compat.h.
 */
#ifndef MONGOLOCK_POOL_H
#define MONGOLOCK_POOL_H

#include "compat.h"

/* [-0, +0] adds pool (worker threads that run ops) to the module table at
 * the top of the stack */
void ml_pool_open(lua_State *L);

#endif
