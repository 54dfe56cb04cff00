/*
 * The views of the lock documents seen from Lua (views.c): the queue view,
 * an election's view, and a change stream a reader drives by its own
 * runner.  Included by module.c, which calls ml_views_open.
 *
 * May include: compat.h.
 */
#ifndef MONGOLOCK_VIEWS_H
#define MONGOLOCK_VIEWS_H

#include "compat.h"

/* [-0, +0] sets core.op_queue_view, parse_queue_view, parse_election and
 * view_stream in the module table on top of the stack */
void ml_views_open(lua_State *L);

#endif
