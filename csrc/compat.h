/*
 * Lua version differences, in one place.  Keyed on LUA_VERSION_NUM (501 for
 * Lua 5.1 and LuaJIT, 504 for Lua 5.4) and LUAJIT_VERSION_NUM.
 */
#ifndef MONGOLOCK_COMPAT_H
#define MONGOLOCK_COMPAT_H

#include <lua.h>
#include <lauxlib.h>

#if LUA_VERSION_NUM < 502
/* Lua 5.1 / LuaJIT 2.1 (lua.h does not define LUAJIT_VERSION_NUM) */
#include <luajit.h>
#ifndef luaL_newlib
#define luaL_newlibtable(L, l) lua_createtable(L, 0, (int)(sizeof(l) / sizeof((l)[0]) - 1))
#define luaL_newlib(L, l) (luaL_newlibtable(L, l), luaL_setfuncs(L, l, 0))
#endif
#define lua_rawlen(L, i) lua_objlen(L, (i))
#define ml_newuserdata(L, sz) lua_newuserdata(L, (sz))
#define ml_getuservalue(L, i) lua_getfenv(L, (i))
#define ml_setuservalue(L, i) lua_setfenv(L, (i))
#if !defined(LUAJIT_VERSION_NUM) || LUAJIT_VERSION_NUM < 20100
#error "mongolock needs Lua 5.4 or LuaJIT 2.1"
#endif
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

#endif
