/*
 * mongolock.Pool (pool.c): worker threads that run ops.
 *
 * May include: compat.h.
 */
#ifndef MONGOLOCK_POOL_H
#define MONGOLOCK_POOL_H

#include "compat.h"

/* an eventfd that pool jobs and change streams write (core.signal) */
typedef struct ml_signal ml_signal;

/* the Signal at index i (raises unless an open one) */
ml_signal *ml_check_signal(lua_State *L, int i);
/* a reference more / less (the last frees it); thread-safe */
void ml_signal_ref(ml_signal *g);
void ml_signal_unref(ml_signal *g);
/* writes it unless closed; thread-safe, never blocks */
void ml_signal_notify(ml_signal *g);

/* [-0, +0] adds pool (worker threads that run ops) to the module table at
 * the top of the stack */
void ml_pool_open(lua_State *L);

#endif
