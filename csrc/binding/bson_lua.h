/*
 * Lua values <-> BSON (bson.c), and the typed values (null, array,
 * ObjectId, Date, Binary, Timestamp, Decimal128, Int64, ...).
 *
 * May include: compat.h and libbson.
 */
#ifndef MONGOLOCK_BSON_LUA_H
#define MONGOLOCK_BSON_LUA_H

#include <stddef.h>
#include <bson/bson.h>
#include "compat.h"

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
