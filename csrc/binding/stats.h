/*
 * A client's counters and lease events seen from Lua (stats.c; the
 * counters themselves are lease.h's ml_obs).
 *
 * May include: compat.h; names the client only as a pointer.
 */
#ifndef MONGOLOCK_STATS_H
#define MONGOLOCK_STATS_H

#include "compat.h"

struct ml_client;

/* one command sent for c (counted in its ml_obs) */
void ml_obs_command(const struct ml_client *c);

/* Client methods: counters, take_events, want_events, has_events */
extern const luaL_Reg ml_stats_methods[];

/* [-0, +0] sets the module's totals() (every client's counters in this
 * process, for ever) in the table on top */
void ml_stats_open(lua_State *L);

#endif
