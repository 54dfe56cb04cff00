/*
 * Lua version differences, in one place.  Keyed on LUA_VERSION_NUM (501 for
 * Lua 5.1 and LuaJIT, 502, 503, 504) and, for LuaJIT, LUA_LJDIR (defined by
 * LuaJIT's luaconf.h, so that its own luajit.h can be included) and
 * LUAJIT_VERSION_NUM.  Built and unit-tested with Lua 5.1, 5.2, 5.3, 5.4
 * and LuaJIT 2.1.
 */
#ifndef MONGOLOCK_COMPAT_H
#define MONGOLOCK_COMPAT_H

#include <stdint.h>
#include <lua.h>
#include <lauxlib.h>

#if LUA_VERSION_NUM < 502
/* Lua 5.1 and LuaJIT 2.1 */
#ifdef LUA_LJDIR
/* LuaJIT: lua.h does not define LUAJIT_VERSION_NUM; luajit.h does.  Its
 * lauxlib.h has luaL_setfuncs and luaL_testudata of Lua 5.2. */
#include <luajit.h>
#if !defined(LUAJIT_VERSION_NUM) || LUAJIT_VERSION_NUM < 20100
#error "mongolock needs LuaJIT 2.1 (or Lua 5.1 .. 5.4)"
#endif
#else
/* PUC Lua 5.1: the two Lua 5.2 auxiliary functions the core uses, as
 * Lua 5.2's lauxlib.c writes them */
static inline void ml_setfuncs(lua_State *L, const luaL_Reg *l, int nup)
{
  /* [-nup, +0] the table is below the nup upvalues */
  luaL_checkstack(L, nup, "too many upvalues");
  for (; l->name != NULL; l++) {
    int i;
    for (i = 0; i < nup; i++)
      lua_pushvalue(L, -nup);
    lua_pushcclosure(L, l->func, nup);
    lua_setfield(L, -(nup + 2), l->name);
  }
  lua_pop(L, nup);
}
#define luaL_setfuncs(L, l, nup) ml_setfuncs(L, (l), (nup))

static inline void *ml_testudata(lua_State *L, int ud, const char *tname)
{
  /* [-0, +0] the userdata at ud when its metatable is tname's, else NULL */
  void *p = lua_touserdata(L, ud);
  if (p != NULL && lua_getmetatable(L, ud)) {
    lua_getfield(L, LUA_REGISTRYINDEX, tname);
    if (!lua_rawequal(L, -1, -2))
      p = NULL;
    lua_pop(L, 2);
    return p;
  }
  return NULL;
}
#define luaL_testudata(L, ud, tname) ml_testudata(L, (ud), (tname))
#endif
#ifndef luaL_newlib
#define luaL_newlibtable(L, l) lua_createtable(L, 0, (int)(sizeof(l) / sizeof((l)[0]) - 1))
#define luaL_newlib(L, l) (luaL_newlibtable(L, l), luaL_setfuncs(L, l, 0))
#endif
#define lua_rawlen(L, i) lua_objlen(L, (i))
#define ml_newuserdata(L, sz) lua_newuserdata(L, (sz))
#define ml_getuservalue(L, i) lua_getfenv(L, (i))
#define ml_setuservalue(L, i) lua_setfenv(L, (i))
#define lua_absindex(L, i) ((i) > 0 || (i) <= LUA_REGISTRYINDEX ? (i) : lua_gettop(L) + (i) + 1)
#define ML_HAS_INTEGERS 0
#else
/* Lua 5.2 .. 5.4 */
#if LUA_VERSION_NUM >= 504
#define ml_newuserdata(L, sz) lua_newuserdatauv(L, (sz), 1)
#else
#define ml_newuserdata(L, sz) lua_newuserdata(L, (sz))
#endif
#define ml_getuservalue(L, i) ((void)lua_getuservalue(L, (i)))
#define ml_setuservalue(L, i) lua_setuservalue(L, (i))
#define ML_HAS_INTEGERS (LUA_VERSION_NUM >= 503)
#endif

/* [-0, +1] pushes an int64 as a Lua integer (5.3, 5.4) or number (5.1, 5.2,
 * LuaJIT; exact up to 2^53, which tokens stay below until the year 2248) */
static inline void ml_pushint64(lua_State *L, int64_t v) {
#if ML_HAS_INTEGERS
  lua_pushinteger(L, (lua_Integer)v);
#else
  lua_pushnumber(L, (lua_Number)v);
#endif
}

#endif
