/*
 * mongolock private header: the pieces the C files share.
 *
 *   core.c    luaopen_mongolock_core: module table, monotonic clock, sleep
 *   client.c  mongolock.Client: the connection pool, fork detection, errors
 *   lock.c    mongolock.Lock: leases (named locks and document locks)
 *   bson.c    Lua value <-> BSON, and the typed values (null, ObjectId, ...)
 *
 * Only luaopen_mongolock_core is exported; everything else is static or
 * hidden (the build uses -fvisibility=hidden).
 */
#ifndef MONGOLOCK_H
#define MONGOLOCK_H

#include <sys/types.h>
#include <mongoc/mongoc.h>
#include "compat.h"

#define ML_CLIENT_MT "mongolock.Client"
#define ML_LOCK_MT "mongolock.Lock"

/* ---- bson.c ------------------------------------------------------------ */

/*
 * Converts the Lua table at idx into a BSON document appended to out (which
 * the caller has initialised).  Returns 1 on success; on malformed input
 * (cycles, mixed keys, NaN, depth > 100, invalid UTF-8, ...) returns 0 and
 * writes a message into err.  Never raises, so the caller can destroy out
 * before raising.
 */
int ml_tobson(lua_State *L, int idx, bson_t *out, char *err, size_t errlen);

/* [-0, +1] pushes doc as a Lua table (typed values for non-Lua BSON types) */
void ml_pushbson(lua_State *L, const bson_t *doc);

/* [-0, +1] pushes the value the iterator points at */
void ml_pushbsonvalue(lua_State *L, const bson_iter_t *it);

/* [-0, +0] registers the typed-value metatables and adds the constructors
 * (null, array, ObjectId, Date, Binary, Timestamp, Decimal128, Int64, ...)
 * to the module table at the top of the stack */
void ml_bson_open(lua_State *L);

#endif
