/*
 * Reader shares and permits (shared.c).
 *
 * May include: compat.h.
 */
#ifndef MONGOLOCK_SHARED_H
#define MONGOLOCK_SHARED_H

#include "compat.h"

/* Client methods: share_acquire, share_acquire_attempt, share_leave,
 * share_force_release, share_status */
extern const luaL_Reg ml_shared_methods[];

#endif
