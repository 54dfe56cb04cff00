/*
 * Lua values <-> BSON, and the typed values for BSON types Lua has no
 * equivalent for.
 *
 * Lua -> BSON
 *   table       a document when its keys are strings (or it is empty); an
 *               array when its keys are exactly 1..n, or when it carries the
 *               array metatable (mongolock.array(t): the way to write an
 *               empty array).  Anything else is refused.
 *   string      UTF-8 string; must be valid UTF-8 (NUL bytes allowed in
 *               values, never in keys)
 *   boolean     boolean
 *   number      Lua 5.4: an integer is int32 when it fits, else int64; a
 *               float is a double.  LuaJIT (no integer subtype): a number
 *               with an integral value in [-2^53, 2^53] (except -0) is
 *               int32 when it fits, else int64; every other number is a
 *               double.
 *   typed value mongolock.null, ObjectId, Date, Binary, Timestamp,
 *               Decimal128, Int64, Regex, MinKey, MaxKey, and any other
 *               BSON value read from the server: written back as it was.
 *
 * BSON -> Lua: the inverse.  int32 is an integer; int64 is an integer under
 * Lua 5.4, and under LuaJIT a number when |v| <= 2^53 (exact) else an Int64
 * typed value; double is a number; null is mongolock.null; arrays are
 * tables with the array metatable (so that [] stays [] on the way back).
 *
 * A typed value is a "mongolock.Value" userdata holding a deep copy of one
 * bson_value_t.  Invariant: the copy is owned by the userdata and freed by
 * its __gc only.  null, MinKey and MaxKey are singletons (compare with ==).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "compat.h"
#include "bson_lua.h"

#define VALUE_MT "mongolock.Value"
#define ARRAY_MT "mongolock.array"
#define MAX_DEPTH 100

/* ---- typed values ------------------------------------------------------ */

typedef struct ml_value {
  bson_value_t v;
} ml_value;

/* [-0, +1] pushes a new typed value, null until it is given its own */
static ml_value *new_value(lua_State *L) {
  ml_value *u = (ml_value *)ml_newuserdata(L, sizeof *u);
  u->v.value_type = BSON_TYPE_NULL;   /* safe for __gc until then */
  luaL_getmetatable(L, VALUE_MT);
  lua_setmetatable(L, -2);
  return u;
}

/* [-0, +1] pushes a new typed value owning a deep copy of v */
static ml_value *push_value(lua_State *L, const bson_value_t *v) {
  ml_value *u = new_value(L);
  bson_value_copy(v, &u->v);
  return u;
}

static ml_value *check_value(lua_State *L, int idx) {
  return (ml_value *)luaL_checkudata(L, idx, VALUE_MT);
}

/* [-0, +1] pushes the singleton stored in the registry under key */
static void push_singleton(lua_State *L, const char *key) {
  lua_getfield(L, LUA_REGISTRYINDEX, key);
}

static const char *type_name(bson_type_t t) {
  switch (t) {
  case BSON_TYPE_NULL: return "null";
  case BSON_TYPE_OID: return "objectid";
  case BSON_TYPE_DATE_TIME: return "date";
  case BSON_TYPE_BINARY: return "binary";
  case BSON_TYPE_TIMESTAMP: return "timestamp";
  case BSON_TYPE_DECIMAL128: return "decimal128";
  case BSON_TYPE_INT64: return "int64";
  case BSON_TYPE_INT32: return "int32";
  case BSON_TYPE_DOUBLE: return "double";
  case BSON_TYPE_REGEX: return "regex";
  case BSON_TYPE_MINKEY: return "minkey";
  case BSON_TYPE_MAXKEY: return "maxkey";
  case BSON_TYPE_UNDEFINED: return "undefined";
  case BSON_TYPE_CODE: return "javascript";
  case BSON_TYPE_CODEWSCOPE: return "javascriptwithscope";
  case BSON_TYPE_SYMBOL: return "symbol";
  case BSON_TYPE_DBPOINTER: return "dbpointer";
  case BSON_TYPE_UTF8: return "string";
  case BSON_TYPE_BOOL: return "bool";
  case BSON_TYPE_DOCUMENT: return "document";
  case BSON_TYPE_ARRAY: return "array";
  default: return "unknown";
  }
}

/* [-0, +1] ISO 8601 with milliseconds, UTC */
static void push_iso_date(lua_State *L, int64_t ms) {
  int64_t s = ms / 1000, r = ms % 1000;
  time_t t;
  struct tm tm;
  char buf[64];
  if (r < 0) {
    r += 1000;
    s -= 1;
  }
  t = (time_t)s;
  if (!gmtime_r(&t, &tm)) {
    lua_pushfstring(L, "Date(%s)", "out of range");
    return;
  }
  snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
           tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)r);
  lua_pushstring(L, buf);
}

static void push_hex(lua_State *L, const uint8_t *p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  luaL_Buffer b;
  size_t i;
  luaL_buffinit(L, &b);
  for (i = 0; i < n; i++) {
    luaL_addchar(&b, digits[p[i] >> 4]);
    luaL_addchar(&b, digits[p[i] & 15]);
  }
  luaL_pushresult(&b);
}

/* tostring: the value's natural text (ObjectId: 24 hex digits, Date: ISO
 * 8601, Int64: decimal digits, Decimal128: its string, ...) */
static int v_tostring(lua_State *L) {
  ml_value *u = check_value(L, 1);
  const bson_value_t *v = &u->v;
  char buf[BSON_DECIMAL128_STRING > 64 ? BSON_DECIMAL128_STRING : 64];
  switch (v->value_type) {
  case BSON_TYPE_NULL: lua_pushliteral(L, "null"); break;
  case BSON_TYPE_MINKEY: lua_pushliteral(L, "MinKey"); break;
  case BSON_TYPE_MAXKEY: lua_pushliteral(L, "MaxKey"); break;
  case BSON_TYPE_UNDEFINED: lua_pushliteral(L, "undefined"); break;
  case BSON_TYPE_OID: push_hex(L, v->value.v_oid.bytes, 12); break;
  case BSON_TYPE_DATE_TIME: push_iso_date(L, v->value.v_datetime); break;
  case BSON_TYPE_INT64:
    snprintf(buf, sizeof buf, "%lld", (long long)v->value.v_int64);
    lua_pushstring(L, buf);
    break;
  case BSON_TYPE_DECIMAL128:
    bson_decimal128_to_string(&v->value.v_decimal128, buf);
    lua_pushstring(L, buf);
    break;
  case BSON_TYPE_TIMESTAMP:
    snprintf(buf, sizeof buf, "Timestamp(%lu, %lu)", (unsigned long)v->value.v_timestamp.timestamp,
             (unsigned long)v->value.v_timestamp.increment);
    lua_pushstring(L, buf);
    break;
  case BSON_TYPE_BINARY:
    lua_pushfstring(L, "Binary(%d, \"", (int)v->value.v_binary.subtype);
    push_hex(L, v->value.v_binary.data, v->value.v_binary.data_len);
    lua_pushliteral(L, "\")");
    lua_concat(L, 3);
    break;
  case BSON_TYPE_REGEX:
    lua_pushfstring(L, "/%s/%s", v->value.v_regex.regex,
                    v->value.v_regex.options ? v->value.v_regex.options : "");
    break;
  case BSON_TYPE_DOCUMENT: {
    bson_t b;
    char *json = NULL;
    if (bson_init_static(&b, v->value.v_doc.data, v->value.v_doc.data_len))
      json = bson_as_canonical_extended_json(&b, NULL);
    lua_pushstring(L, json ? json : "{}");
    bson_free(json);
    break;
  }
  default:
    lua_pushfstring(L, "mongolock.Value (%s)", type_name(v->value_type));
  }
  return 1;
}

/* compares two values by their BSON encoding (type and bytes) */
static int values_equal(const bson_value_t *a, const bson_value_t *b) {
  bson_t x = BSON_INITIALIZER, y = BSON_INITIALIZER;
  int eq;
  if (a->value_type != b->value_type) return 0;
  bson_append_value(&x, "", 0, a);
  bson_append_value(&y, "", 0, b);
  eq = bson_equal(&x, &y);
  bson_destroy(&x);
  bson_destroy(&y);
  return eq;
}

static int v_eq(lua_State *L) {
  ml_value *a = (ml_value *)luaL_testudata(L, 1, VALUE_MT);
  ml_value *b = (ml_value *)luaL_testudata(L, 2, VALUE_MT);
  lua_pushboolean(L, a && b && values_equal(&a->v, &b->v));
  return 1;
}

/* Dates, Int64 and Timestamps order by value */
static int v_lt(lua_State *L) {
  ml_value *a = check_value(L, 1), *b = check_value(L, 2);
  if (a->v.value_type != b->v.value_type) return luaL_error(L, "attempt to compare %s with %s",
                                                            type_name(a->v.value_type),
                                                            type_name(b->v.value_type));
  switch (a->v.value_type) {
  case BSON_TYPE_DATE_TIME: lua_pushboolean(L, a->v.value.v_datetime < b->v.value.v_datetime); break;
  case BSON_TYPE_INT64: lua_pushboolean(L, a->v.value.v_int64 < b->v.value.v_int64); break;
  case BSON_TYPE_TIMESTAMP: {
    uint64_t x = (uint64_t)a->v.value.v_timestamp.timestamp << 32 | a->v.value.v_timestamp.increment;
    uint64_t y = (uint64_t)b->v.value.v_timestamp.timestamp << 32 | b->v.value.v_timestamp.increment;
    lua_pushboolean(L, x < y);
    break;
  }
  default: return luaL_error(L, "attempt to compare two %s values", type_name(a->v.value_type));
  }
  return 1;
}

static int v_gc(lua_State *L) {
  ml_value *u = check_value(L, 1);
  bson_value_destroy(&u->v);
  u->v.value_type = BSON_TYPE_NULL;
  return 0;
}

/*
 * Fields: type (every value); ObjectId: hex, time (seconds); Date: ms;
 * Binary: data, subtype; Document: data (its bytes); Timestamp: t, i;
 * Int64: value (an integer under Lua 5.4, a number under LuaJIT, inexact
 * beyond 2^53); Regex: pattern, options.  Unknown fields are nil.
 */
static int v_index(lua_State *L) {
  ml_value *u = check_value(L, 1);
  const bson_value_t *v = &u->v;
  const char *k = lua_tostring(L, 2);
  if (!k) return 0;
  if (!strcmp(k, "type")) {
    lua_pushstring(L, type_name(v->value_type));
    return 1;
  }
  switch (v->value_type) {
  case BSON_TYPE_OID:
    if (!strcmp(k, "hex")) { push_hex(L, v->value.v_oid.bytes, 12); return 1; }
    if (!strcmp(k, "time")) { lua_pushnumber(L, (lua_Number)bson_oid_get_time_t(&v->value.v_oid)); return 1; }
    break;
  case BSON_TYPE_DATE_TIME:
    if (!strcmp(k, "ms")) { ml_pushint64(L, v->value.v_datetime); return 1; }
    break;
  case BSON_TYPE_DOCUMENT:
    if (!strcmp(k, "data")) {
      lua_pushlstring(L, (const char *)v->value.v_doc.data, v->value.v_doc.data_len);
      return 1;
    }
    break;
  case BSON_TYPE_BINARY:
    if (!strcmp(k, "data")) {
      lua_pushlstring(L, (const char *)v->value.v_binary.data, v->value.v_binary.data_len);
      return 1;
    }
    if (!strcmp(k, "subtype")) { lua_pushinteger(L, (lua_Integer)v->value.v_binary.subtype); return 1; }
    break;
  case BSON_TYPE_TIMESTAMP:
    if (!strcmp(k, "t")) { lua_pushnumber(L, (lua_Number)v->value.v_timestamp.timestamp); return 1; }
    if (!strcmp(k, "i")) { lua_pushnumber(L, (lua_Number)v->value.v_timestamp.increment); return 1; }
    break;
  case BSON_TYPE_INT64:
    if (!strcmp(k, "value")) { ml_pushint64(L, v->value.v_int64); return 1; }
    break;
  case BSON_TYPE_REGEX:
    if (!strcmp(k, "pattern")) { lua_pushstring(L, v->value.v_regex.regex); return 1; }
    if (!strcmp(k, "options")) { lua_pushstring(L, v->value.v_regex.options ? v->value.v_regex.options : ""); return 1; }
    break;
  default: break;
  }
  return 0;
}

/* ---- constructors ------------------------------------------------------ */

static int hexdigit(int c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* ObjectId([hex]) -> a new id, or the one the 24 hex digits spell */
static int l_objectid(lua_State *L) {
  bson_value_t v;
  v.value_type = BSON_TYPE_OID;
  if (lua_isnoneornil(L, 1)) {
    bson_oid_init(&v.value.v_oid, NULL);
  } else {
    size_t len, i;
    const char *s = luaL_checklstring(L, 1, &len);
    luaL_argcheck(L, len == 24, 1, "24 hex digits expected");
    for (i = 0; i < 12; i++) {
      int hi = hexdigit((unsigned char)s[2 * i]), lo = hexdigit((unsigned char)s[2 * i + 1]);
      luaL_argcheck(L, hi >= 0 && lo >= 0, 1, "24 hex digits expected");
      v.value.v_oid.bytes[i] = (uint8_t)(hi << 4 | lo);
    }
  }
  push_value(L, &v);
  return 1;
}

/* an exact int64 from a Lua number/integer at idx, or raises */
static int64_t check_int64(lua_State *L, int idx, const char *what) {
#if ML_HAS_INTEGERS
  int ok;
  lua_Integer i = lua_tointegerx(L, idx, &ok);
  if (!ok) {
    luaL_checknumber(L, idx);
    luaL_argerror(L, idx, lua_pushfstring(L, "%s must be an integer", what));
  }
  return (int64_t)i;
#else
  lua_Number n = luaL_checknumber(L, idx);
  if (!(n == floor(n)) || n < -9223372036854775808.0 || n >= 9223372036854775808.0)
    luaL_argerror(L, idx, lua_pushfstring(L, "%s must be an integer", what));
  return (int64_t)n;
#endif
}

/* Date([ms]) -> a BSON date (milliseconds since 1970, UTC); Date() is now
 * by this machine's clock */
static int l_date(lua_State *L) {
  bson_value_t v;
  v.value_type = BSON_TYPE_DATE_TIME;
  if (lua_isnoneornil(L, 1)) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    v.value.v_datetime = (int64_t)tv.tv_sec * 1000 + tv.tv_usec / 1000;
  } else {
    v.value.v_datetime = check_int64(L, 1, "milliseconds");
  }
  push_value(L, &v);
  return 1;
}

/* Binary(data [, subtype = 0]) */
static int l_binary(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  lua_Integer st = luaL_optinteger(L, 2, 0);
  bson_value_t v;
  luaL_argcheck(L, st >= 0 && st <= 255, 2, "subtype must be 0..255");
  luaL_argcheck(L, len <= (size_t)INT32_MAX - 64, 1, "too long");
  v.value_type = BSON_TYPE_BINARY;
  v.value.v_binary.subtype = (bson_subtype_t)st;
  v.value.v_binary.data = (uint8_t *)(uintptr_t)s;   /* copied by push_value */
  v.value.v_binary.data_len = (uint32_t)len;
  push_value(L, &v);
  return 1;
}

/* Timestamp(t, i): two unsigned 32-bit integers */
static int l_timestamp(lua_State *L) {
  int64_t t = check_int64(L, 1, "t"), i = check_int64(L, 2, "i");
  bson_value_t v;
  luaL_argcheck(L, t >= 0 && t <= UINT32_MAX, 1, "t must be 0..2^32-1");
  luaL_argcheck(L, i >= 0 && i <= UINT32_MAX, 2, "i must be 0..2^32-1");
  v.value_type = BSON_TYPE_TIMESTAMP;
  v.value.v_timestamp.timestamp = (uint32_t)t;
  v.value.v_timestamp.increment = (uint32_t)i;
  push_value(L, &v);
  return 1;
}

/* Decimal128(string) */
static int l_decimal128(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  bson_value_t v;
  v.value_type = BSON_TYPE_DECIMAL128;
  luaL_argcheck(L, strlen(s) == len && bson_decimal128_from_string(s, &v.value.v_decimal128), 1,
                "not a decimal number");
  /* libbson reads anything unparsable as NaN: accept only a spelt NaN */
  if (!bson_strcasecmp(s, "nan") || !bson_strcasecmp(s, "-nan")) {
    push_value(L, &v);
    return 1;
  }
  {
    char back[BSON_DECIMAL128_STRING];
    bson_decimal128_to_string(&v.value.v_decimal128, back);
    luaL_argcheck(L, strcmp(back, "NaN") != 0, 1, "not a decimal number");
  }
  push_value(L, &v);
  return 1;
}

/* Int64(n | "digits"): a value stored as int64 whatever its size */
static int l_int64(lua_State *L) {
  bson_value_t v;
  v.value_type = BSON_TYPE_INT64;
  if (lua_type(L, 1) == LUA_TSTRING) {
    size_t len;
    const char *s = lua_tolstring(L, 1, &len);
    char *end;
    long long x;
    errno = 0;
    x = strtoll(s, &end, 10);
    luaL_argcheck(L, len > 0 && end == s + len && errno == 0 && !(s[0] == ' ' || s[0] == '\t'), 1,
                  "decimal integer in the int64 range expected");
    v.value.v_int64 = (int64_t)x;
  } else {
    v.value.v_int64 = check_int64(L, 1, "value");
  }
  push_value(L, &v);
  return 1;
}

/* Regex(pattern [, options]) */
static int l_regex(lua_State *L) {
  size_t plen, olen;
  const char *p = luaL_checklstring(L, 1, &plen);
  const char *o = luaL_optlstring(L, 2, "", &olen);
  bson_value_t v;
  luaL_argcheck(L, strlen(p) == plen && bson_utf8_validate(p, plen, false), 1,
                "valid UTF-8 without NUL expected");
  luaL_argcheck(L, strlen(o) == olen && strspn(o, "ilmsux") == olen, 2,
                "options are letters of \"ilmsux\"");
  v.value_type = BSON_TYPE_REGEX;
  v.value.v_regex.regex = (char *)(uintptr_t)p;
  v.value.v_regex.options = (char *)(uintptr_t)o;
  push_value(L, &v);
  return 1;
}

/* array([t]) -> t (or a new table) marked as a BSON array */
static int l_array(lua_State *L) {
  if (lua_isnoneornil(L, 1)) lua_newtable(L);
  else luaL_checktype(L, 1, LUA_TTABLE);
  lua_settop(L, 1);
  luaL_getmetatable(L, ARRAY_MT);
  lua_setmetatable(L, 1);
  return 1;
}

/* is_array(t) -> true when t carries the array marker */
static int l_is_array(lua_State *L) {
  int r = 0;
  if (lua_type(L, 1) == LUA_TTABLE && lua_getmetatable(L, 1)) {
    luaL_getmetatable(L, ARRAY_MT);
    r = lua_rawequal(L, -1, -2);
  }
  lua_pushboolean(L, r);
  return 1;
}

/* bsontype(v) -> the BSON type name v is written as ("string", "int32",
 * "int64", "double", "document", "array", "null", "objectid", ...), or nil
 * for a value that cannot be written */
static int classify_table(lua_State *L, int idx, char *err, size_t errlen);
static int number_is_integer(lua_State *L, int idx, int64_t *out);
static int l_bsontype(lua_State *L) {
  switch (lua_type(L, 1)) {
  case LUA_TSTRING: lua_pushliteral(L, "string"); return 1;
  case LUA_TBOOLEAN: lua_pushliteral(L, "bool"); return 1;
  case LUA_TNUMBER: {
    int64_t i;
    if (number_is_integer(L, 1, &i))
      lua_pushstring(L, i >= INT32_MIN && i <= INT32_MAX ? "int32" : "int64");
    else
      lua_pushliteral(L, "double");
    return 1;
  }
  case LUA_TTABLE: {
    char err[256];
    int k = classify_table(L, 1, err, sizeof err);
    if (k < 0) lua_pushnil(L);
    else lua_pushstring(L, k ? "array" : "document");
    return 1;
  }
  case LUA_TUSERDATA: {
    ml_value *u = (ml_value *)luaL_testudata(L, 1, VALUE_MT);
    if (u) lua_pushstring(L, type_name(u->v.value_type));
    else lua_pushnil(L);
    return 1;
  }
  default: lua_pushnil(L); return 1;
  }
}

/* ---- Lua -> BSON ------------------------------------------------------- */

typedef struct enc {
  lua_State *L;
  char *err;
  size_t errlen;
  int depth;
  const void *open[MAX_DEPTH + 1];   /* tables being written: cycle check */
  char path[512];                    /* where we are, for messages */
  size_t pathlen;
} enc;

static int fail(enc *e, const char *fmt, const char *arg) {
  char what[200];
  snprintf(what, sizeof what, fmt, arg ? arg : "");
  if (e->pathlen) snprintf(e->err, e->errlen, "%s (at %s)", what, e->path);
  else snprintf(e->err, e->errlen, "%s", what);
  return 0;
}

/* appends ".key" to the path (truncated with "..." when too long) */
static size_t path_push(enc *e, const char *key, size_t keylen) {
  size_t old = e->pathlen, room = sizeof e->path - old - 1;
  size_t need = keylen + (old ? 1 : 0);
  if (need > room) {
    if (room >= 3) {
      memcpy(e->path + old, "...", 3);
      e->pathlen = old + 3;
    }
  } else {
    if (old) e->path[e->pathlen++] = '.';
    memcpy(e->path + e->pathlen, key, keylen);
    e->pathlen += keylen;
  }
  e->path[e->pathlen] = '\0';
  return old;
}

static void path_pop(enc *e, size_t old) {
  e->pathlen = old;
  e->path[old] = '\0';
}

/* is the number at idx an integral value usable as an array index or an
 * integer?  Writes it to *out. */
static int number_is_integer(lua_State *L, int idx, int64_t *out) {
#if ML_HAS_INTEGERS
  if (lua_isinteger(L, idx)) {
    *out = (int64_t)lua_tointeger(L, idx);
    return 1;
  }
  return 0;
#else
  lua_Number n = lua_tonumber(L, idx);
  if (n == floor(n) && n >= -9007199254740992.0 && n <= 9007199254740992.0 &&
      !(n == 0 && signbit(n))) {
    *out = (int64_t)n;
    return 1;
  }
  return 0;
#endif
}

/*
 * Classifies the table at idx: 0 document, 1 array, -1 malformed (err
 * written).  Arrays: the marker, or keys exactly 1..n (n >= 1).
 */
static int classify_table(lua_State *L, int idx, char *err, size_t errlen) {
  int marked = 0, nstr = 0;
  int64_t nint = 0, maxint = 0;
  idx = lua_absindex(L, idx);
  if (lua_getmetatable(L, idx)) {
    luaL_getmetatable(L, ARRAY_MT);
    marked = lua_rawequal(L, -1, -2);
    lua_pop(L, 2);
  }
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    int64_t k;
    lua_pop(L, 1);
    if (lua_type(L, -1) == LUA_TSTRING) {
      nstr++;
    } else if (lua_type(L, -1) == LUA_TNUMBER && number_is_integer(L, -1, &k) && k >= 1) {
      nint++;
      if (k > maxint) maxint = k;
    } else {
      const char *tn = luaL_typename(L, -1);
      if (lua_type(L, -1) == LUA_TNUMBER) {
        lua_Number n = lua_tonumber(L, -1);
        snprintf(err, errlen, "%s key %.17g in a table (keys are strings, or 1..n in an array)",
                 n != n ? "NaN" : (n == HUGE_VAL || n == -HUGE_VAL) ? "infinite" :
                 n == floor(n) ? "non-positive" : "non-integer", (double)n);
      } else {
        snprintf(err, errlen, "%s key in a table (keys are strings, or 1..n in an array)", tn);
      }
      lua_pop(L, 1);
      return -1;
    }
  }
  if (nstr && nint) {
    snprintf(err, errlen, "mixed string and integer keys in a table");
    return -1;
  }
  if (nstr) {
    if (marked) {
      snprintf(err, errlen, "string key in a table marked as an array");
      return -1;
    }
    return 0;
  }
  if (nint == 0) return marked ? 1 : 0;
  if (maxint != nint) {
    snprintf(err, errlen, "array with holes (%lld elements, largest index %lld)",
             (long long)nint, (long long)maxint);
    return -1;
  }
  return 1;
}

static int append_table(enc *e, int idx, bson_t *b, int is_array);

/* appends the Lua value at idx under key */
static int append_value(enc *e, int idx, bson_t *b, const char *key, int keylen) {
  lua_State *L = e->L;
  switch (lua_type(L, idx)) {
  case LUA_TSTRING: {
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    if (len > (size_t)INT32_MAX - 64) return fail(e, "string too long", NULL);
    if (!bson_utf8_validate(s, len, true)) return fail(e, "invalid UTF-8 in a string", NULL);
    if (!bson_append_utf8(b, key, keylen, s, (int)len)) return fail(e, "document too large", NULL);
    return 1;
  }
  case LUA_TBOOLEAN:
    bson_append_bool(b, key, keylen, lua_toboolean(L, idx));
    return 1;
  case LUA_TNUMBER: {
    int64_t i;
    if (number_is_integer(L, idx, &i)) {
      if (i >= INT32_MIN && i <= INT32_MAX) bson_append_int32(b, key, keylen, (int32_t)i);
      else bson_append_int64(b, key, keylen, i);
    } else {
      bson_append_double(b, key, keylen, (double)lua_tonumber(L, idx));
    }
    return 1;
  }
  case LUA_TUSERDATA: {
    ml_value *u = (ml_value *)luaL_testudata(L, idx, VALUE_MT);
    if (!u) return fail(e, "cannot convert a userdata to BSON", NULL);
    if (!bson_append_value(b, key, keylen, &u->v)) return fail(e, "document too large", NULL);
    return 1;
  }
  case LUA_TTABLE: {
    bson_t child;
    int kind, ok, i;
    const void *p = lua_topointer(L, idx);
    for (i = 0; i < e->depth; i++)
      if (e->open[i] == p) return fail(e, "cycle: a table contains itself", NULL);
    if (e->depth >= MAX_DEPTH) return fail(e, "nested deeper than 100 levels", NULL);
    kind = classify_table(L, idx, e->err, e->errlen);
    if (kind < 0) {
      char what[200];
      bson_strncpy(what, e->err, sizeof what);
      return fail(e, "%s", what);
    }
    if (kind) bson_append_array_begin(b, key, keylen, &child);
    else bson_append_document_begin(b, key, keylen, &child);
    ok = append_table(e, idx, &child, kind);
    if (kind) bson_append_array_end(b, &child);
    else bson_append_document_end(b, &child);
    return ok;
  }
  default:
    return fail(e, "cannot convert a %s to BSON", luaL_typename(L, idx));
  }
}

/* appends the entries of the table at idx (already classified) to b */
static int append_table(enc *e, int idx, bson_t *b, int is_array) {
  lua_State *L = e->L;
  idx = lua_absindex(L, idx);
  if (!lua_checkstack(L, 8)) return fail(e, "out of Lua stack", NULL);
  e->open[e->depth++] = lua_topointer(L, idx);
  if (is_array) {
    size_t n = lua_rawlen(L, idx), i;
    for (i = 1; i <= n; i++) {
      char keybuf[24];
      const char *key;
      size_t old;
      int ok;
      bson_uint32_to_string((uint32_t)(i - 1), &key, keybuf, sizeof keybuf);
      old = path_push(e, key, strlen(key));
      lua_rawgeti(L, idx, (int)i);
      ok = append_value(e, lua_gettop(L), b, key, -1);
      lua_pop(L, 1);
      path_pop(e, old);
      if (!ok) return 0;
    }
  } else {
    lua_pushnil(L);
    while (lua_next(L, idx)) {
      size_t klen, old;
      const char *k = lua_tolstring(L, -2, &klen);   /* keys are strings here */
      int ok;
      if (!bson_utf8_validate(k, klen, false)) {
        lua_pop(L, 2);
        return fail(e, "key is not valid UTF-8 or contains a NUL byte", NULL);
      }
      old = path_push(e, k, klen);
      ok = append_value(e, lua_gettop(L), b, k, (int)klen);
      path_pop(e, old);
      lua_pop(L, 1);
      if (!ok) {
        lua_pop(L, 1);
        return 0;
      }
    }
  }
  e->depth--;
  return 1;
}

int ml_tobson(lua_State *L, int idx, bson_t *out, char *err, size_t errlen) {
  enc e;
  int kind, top = lua_gettop(L), ok;
  idx = lua_absindex(L, idx);
  e.L = L;
  e.err = err;
  e.errlen = errlen;
  e.depth = 0;
  e.pathlen = 0;
  e.path[0] = '\0';
  if (lua_type(L, idx) != LUA_TTABLE) {
    snprintf(err, errlen, "document expected, got %s", luaL_typename(L, idx));
    return 0;
  }
  kind = classify_table(L, idx, err, errlen);
  if (kind < 0) return 0;
  if (kind == 1) {
    snprintf(err, errlen, "document expected, got an array");
    return 0;
  }
  ok = append_table(&e, idx, out, 0);
  lua_settop(L, top);
  return ok;
}

/* ---- BSON -> Lua ------------------------------------------------------- */

static void push_doc_iter(lua_State *L, bson_iter_t *it, int is_array);

void ml_pushbsonvalue(lua_State *L, const bson_iter_t *cit) {
  bson_iter_t it = *cit, child;
  luaL_checkstack(L, 4, "BSON nested too deeply");
  switch (bson_iter_type(&it)) {
  case BSON_TYPE_UTF8: {
    uint32_t len;
    const char *s = bson_iter_utf8(&it, &len);
    lua_pushlstring(L, s, len);
    break;
  }
  case BSON_TYPE_BOOL: lua_pushboolean(L, bson_iter_bool(&it)); break;
  case BSON_TYPE_INT32: lua_pushinteger(L, (lua_Integer)bson_iter_int32(&it)); break;
  case BSON_TYPE_DOUBLE: lua_pushnumber(L, (lua_Number)bson_iter_double(&it)); break;
  case BSON_TYPE_INT64: {
    int64_t v = bson_iter_int64(&it);
#if ML_HAS_INTEGERS
    lua_pushinteger(L, (lua_Integer)v);
#else
    if (v >= -9007199254740992LL && v <= 9007199254740992LL) {
      lua_pushnumber(L, (lua_Number)v);
    } else {
      push_value(L, bson_iter_value(&it));
    }
#endif
    break;
  }
  case BSON_TYPE_NULL: push_singleton(L, "mongolock.null"); break;
  case BSON_TYPE_MINKEY: push_singleton(L, "mongolock.MinKey"); break;
  case BSON_TYPE_MAXKEY: push_singleton(L, "mongolock.MaxKey"); break;
  case BSON_TYPE_DOCUMENT:
    if (bson_iter_recurse(&it, &child)) push_doc_iter(L, &child, 0);
    else lua_newtable(L);
    break;
  case BSON_TYPE_ARRAY:
    if (bson_iter_recurse(&it, &child)) push_doc_iter(L, &child, 1);
    else {
      lua_newtable(L);
      luaL_getmetatable(L, ARRAY_MT);
      lua_setmetatable(L, -2);
    }
    break;
  default: push_value(L, bson_iter_value(&it)); break;
  }
}

static void push_doc_iter(lua_State *L, bson_iter_t *it, int is_array) {
  lua_Integer i = 0;
  lua_newtable(L);
  if (is_array) {
    luaL_getmetatable(L, ARRAY_MT);
    lua_setmetatable(L, -2);
  }
  while (bson_iter_next(it)) {
    if (is_array) {
      ml_pushbsonvalue(L, it);
      lua_rawseti(L, -2, (int)++i);
    } else {
      lua_pushstring(L, bson_iter_key(it));
      ml_pushbsonvalue(L, it);
      lua_rawset(L, -3);
    }
  }
}

void ml_pushbson(lua_State *L, const bson_t *doc) {
  bson_iter_t it;
  if (bson_iter_init(&it, doc)) push_doc_iter(L, &it, 0);
  else lua_newtable(L);
}

/* depth of the deepest nesting in doc (1 for a flat document) */
static int bson_depth(const bson_t *doc, int limit) {
  bson_iter_t it;
  int max = 1;
  if (!bson_iter_init(&it, doc)) return 1;
  while (bson_iter_next(&it)) {
    if (BSON_ITER_HOLDS_DOCUMENT(&it) || BSON_ITER_HOLDS_ARRAY(&it)) {
      const uint8_t *data;
      uint32_t len;
      bson_t sub;
      int d;
      if (limit <= 1) return limit + 1;
      if (BSON_ITER_HOLDS_DOCUMENT(&it)) bson_iter_document(&it, &len, &data);
      else bson_iter_array(&it, &len, &data);
      if (!bson_init_static(&sub, data, len)) continue;
      d = 1 + bson_depth(&sub, limit - 1);
      if (d > max) max = d;
    }
  }
  return max;
}

/* ---- module functions -------------------------------------------------- */

/* encode(t) -> BSON bytes | nil, message */
static int l_encode(lua_State *L) {
  bson_t b = BSON_INITIALIZER;
  char err[512];
  luaL_checktype(L, 1, LUA_TTABLE);
  if (!ml_tobson(L, 1, &b, err, sizeof err)) {
    bson_destroy(&b);
    lua_pushnil(L);
    lua_pushstring(L, err);
    return 2;
  }
  lua_pushlstring(L, (const char *)bson_get_data(&b), b.len);
  bson_destroy(&b);
  return 1;
}

/* are the strings of doc (at most limit levels deep) UTF-8?  libbson's
 * bson_validate checks the keys only */
static int strings_valid(const bson_t *doc, int limit) {
  bson_iter_t it;
  if (!bson_iter_init(&it, doc)) return 0;
  while (bson_iter_next(&it)) {
    if (BSON_ITER_HOLDS_UTF8(&it)) {
      uint32_t len;
      const char *str = bson_iter_utf8(&it, &len);
      if (!bson_utf8_validate(str, len, true)) return 0;
    } else if (BSON_ITER_HOLDS_DOCUMENT(&it) || BSON_ITER_HOLDS_ARRAY(&it)) {
      const uint8_t *data;
      uint32_t len;
      bson_t sub;
      if (limit <= 1) return 0;
      if (BSON_ITER_HOLDS_DOCUMENT(&it)) bson_iter_document(&it, &len, &data);
      else bson_iter_array(&it, &len, &data);
      if (!bson_init_static(&sub, data, len) || !strings_valid(&sub, limit - 1)) return 0;
    }
  }
  return 1;
}

/* NULL when s (len bytes) is one well-formed BSON document (lengths,
 * terminators, UTF-8 keys and strings, nesting at most 100 levels), b
 * then reading it in place; otherwise what is wrong, in msg */
static const char *check_bytes(const char *s, size_t len, bson_t *b, char *msg, size_t msglen) {
  size_t off;
  if (len < 5 || len > (size_t)INT32_MAX || !bson_init_static(b, (const uint8_t *)s, len))
    return "malformed BSON: bad length";
  if (!bson_validate(b, BSON_VALIDATE_UTF8 | BSON_VALIDATE_UTF8_ALLOW_NULL, &off)) {
    snprintf(msg, msglen, "malformed BSON at byte %d", (int)off);
    return msg;
  }
  if (bson_depth(b, MAX_DEPTH) > MAX_DEPTH) return "malformed BSON: nested deeper than 100 levels";
  if (!strings_valid(b, MAX_DEPTH)) return "malformed BSON: a string is not UTF-8";
  return NULL;
}

/* decode(bytes) -> table | nil, message (the bytes are validated first:
 * check_bytes) */
static int l_decode(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len), *msg;
  char buf[64];
  bson_t b;
  if ((msg = check_bytes(s, len, &b, buf, sizeof buf)) != NULL) {
    lua_pushnil(L);
    lua_pushstring(L, msg);
    return 2;
  }
  ml_pushbson(L, &b);
  return 1;
}

/* Document(t | bytes) -> a typed value written as that document wherever
 * a value goes | nil, message.  A table is encoded once, here (nil,
 * message as bson_encode answers); bytes (bson_encode's, a reply's) are
 * validated as decode does.  For a document sent more than once, or
 * checked before it is sent. */
static int l_document(lua_State *L) {
  if (lua_type(L, 1) == LUA_TTABLE) {
    bson_t b = BSON_INITIALIZER;
    char err[512];
    ml_value *u = new_value(L);         /* first: nothing to free if it raises */
    if (!ml_tobson(L, 1, &b, err, sizeof err)) {
      bson_destroy(&b);
      lua_pushnil(L);
      lua_pushstring(L, err);
      return 2;
    }
    u->v.value.v_doc.data = bson_destroy_with_steal(&b, true, &u->v.value.v_doc.data_len);
    if (!u->v.value.v_doc.data) return luaL_error(L, "Document: out of memory");
    u->v.value_type = BSON_TYPE_DOCUMENT;
  } else {
    size_t len;
    const char *s, *msg;
    char buf[64];
    bson_t b;
    bson_value_t v;
    if (lua_type(L, 1) != LUA_TSTRING)
      return luaL_argerror(L, 1, lua_pushfstring(L, "table or BSON bytes expected, got %s",
                                                 luaL_typename(L, 1)));
    s = lua_tolstring(L, 1, &len);
    if ((msg = check_bytes(s, len, &b, buf, sizeof buf)) != NULL) {
      lua_pushnil(L);
      lua_pushstring(L, msg);
      return 2;
    }
    v.value_type = BSON_TYPE_DOCUMENT;
    v.value.v_doc.data = (uint8_t *)(uintptr_t)s;   /* copied by push_value */
    v.value.v_doc.data_len = (uint32_t)len;
    push_value(L, &v);
  }
  return 1;
}

/* tojson(t) -> canonical extended JSON | nil, message */
static int l_tojson(lua_State *L) {
  bson_t b = BSON_INITIALIZER;
  char err[512];
  char *json;
  luaL_checktype(L, 1, LUA_TTABLE);
  if (!ml_tobson(L, 1, &b, err, sizeof err)) {
    bson_destroy(&b);
    lua_pushnil(L);
    lua_pushstring(L, err);
    return 2;
  }
  json = bson_as_canonical_extended_json(&b, NULL);
  bson_destroy(&b);
  lua_pushstring(L, json ? json : "");
  bson_free(json);
  return 1;
}

static const luaL_Reg value_meta[] = {
  {"__tostring", v_tostring},
  {"__eq", v_eq},
  {"__lt", v_lt},
  {"__gc", v_gc},
  {"__index", v_index},
  {NULL, NULL}
};

static const luaL_Reg bson_funcs[] = {
  {"ObjectId", l_objectid},
  {"Date", l_date},
  {"Binary", l_binary},
  {"Timestamp", l_timestamp},
  {"Decimal128", l_decimal128},
  {"Int64", l_int64},
  {"Regex", l_regex},
  {"array", l_array},
  {"is_array", l_is_array},
  {"bsontype", l_bsontype},
  {"bson_encode", l_encode},
  {"bson_decode", l_decode},
  {"Document", l_document},
  {"bson_tojson", l_tojson},
  {NULL, NULL}
};

/* [-0, +0] makes a singleton of type t, stores it in the registry under
 * key and in the module table (at -1) under name */
static void make_singleton(lua_State *L, bson_type_t t, const char *key, const char *name) {
  bson_value_t v;
  v.value_type = t;
  push_value(L, &v);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, key);
  lua_setfield(L, -2, name);
}

void ml_bson_open(lua_State *L) {
  /* [module] */
  luaL_newmetatable(L, VALUE_MT);
  luaL_setfuncs(L, value_meta, 0);
  lua_pushliteral(L, VALUE_MT);
  lua_setfield(L, -2, "__name");
  lua_pop(L, 1);
  luaL_newmetatable(L, ARRAY_MT);
  lua_pushliteral(L, ARRAY_MT);
  lua_setfield(L, -2, "__name");
  lua_setfield(L, -2, "array_mt");
  luaL_setfuncs(L, bson_funcs, 0);
  make_singleton(L, BSON_TYPE_NULL, "mongolock.null", "null");
  make_singleton(L, BSON_TYPE_MINKEY, "mongolock.MinKey", "MinKey");
  make_singleton(L, BSON_TYPE_MAXKEY, "mongolock.MaxKey", "MaxKey");
}
