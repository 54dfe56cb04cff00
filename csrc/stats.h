/*
 * A client's counters and lease events seen from Lua (stats.c; the
 * counters themselves are lease.h's ml_obs).
 *
 * May include: compat.h.
 */
#ifndef MONGOLOCK_STATS_H
#define MONGOLOCK_STATS_H

#include "compat.h"

/* Client methods: counters, take_events, want_events, has_events */
extern const luaL_Reg ml_stats_methods[];

#endif
