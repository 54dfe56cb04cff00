/*
 * The views of the lock documents seen from Lua, for the readers that show
 * them (the command's top, an election's observer), so that no Lua file
 * names a field of the lock document or sends a cursor's commands:
 *
 *   op = core.op_queue_view{db=, coll=}
 *   waiters = core.parse_queue_view(reply)
 *       -> {[name] = {{host=, pid=, app=, polling=, remaining=}, ...}}
 *          (the live queue of each lock that has one, in order; remaining:
 *          seconds its place is kept, by the server's clock)
 *   view, ot = core.parse_election(reply)        (op_leader's reply)
 *       -> {owner=, token=, value=, value_term=, holder=, acquired_at=,
 *           expires_at=, lease_ms=, held=, remaining=} | false,
 *          {t=, i=} | false (the read's operation time)
 *   s = core.view_stream{db=, coll=, name=, t=, i=}
 *       a change stream run by stream.c's machine (resume tokens,
 *       killCursors after a failure, a new aggregate after the last
 *       batch's token), of the one document {_id: name} from (t, i), or
 *       without name of every change of the collection from now; its
 *       commands are run by the caller's runner (client:run, or a worker
 *       thread's job inside nginx):
 *     op | nil, seconds = s:next(await)   the next command (a getMore awaits
 *                         up to await seconds), or none yet (seconds until
 *                         one may be due; math.huge: the stream ended)
 *     events | nil, err, code = s:done(reply, err, code, ereply, domain)
 *                         the outcome of that command (client:run's
 *                         answers); events: {kind = "update" | "replace" |
 *                         "delete" | "end", t=, i=, fields = a view as
 *                         parse_election's (update: the fields it set;
 *                         replace: the new document), touched = {key=true}
 *                         (update: set, to null too), cleared = {key=true}
 *                         (update: set to null or removed), holder_set =
 *                         {key=value}, holder_unset = {key=true} (update:
 *                         single fields of the holder)}
 *     state, err, code = s:state()   "starting" | "running" | "failed" | "done"
 *     s:close()           ends it: next() gives its last command, if any
 *
 * May include: views.h, the binding's argument layer (args.h), its BSON
 * values (bson_lua.h), sys.h (the process tag), lease.h (the clock),
 * stream.h and protocol*.h; only module.c calls it (ml_views_open).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "protocol.h"
#include "transport.h"
#include "lease.h"
#include "sys.h"
#include "bson_lua.h"
#include "args.h"
#include "views.h"
#include "protocol_views.h"
#include "stream.h"

#define VIEW_STREAM_MT "mongolock.ViewStream"

/* ---- arguments ---------------------------------------------------------- */

/* a BSON string argument as a view (raises when malformed) */
static void arg_bson(lua_State *L, int i, bson_t *out) {
  size_t len, off;
  const char *s = luaL_checklstring(L, i, &len);
  if (len < 5 || len > (size_t)INT32_MAX || !bson_init_static(out, (const uint8_t *)s, len) ||
      !bson_validate(out, BSON_VALIDATE_NONE, &off))
    luaL_argerror(L, i, "malformed BSON");
}

/* opts[key] of the table at 1 as a string; NULL when absent and optional */
static const char *opt_string(lua_State *L, const char *key, int required) {
  const char *s;
  lua_getfield(L, 1, key);
  if (lua_isnil(L, -1) && !required) {
    lua_pop(L, 1);
    return NULL;
  }
  if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "bad option %s (string expected)", key);
  s = lua_tostring(L, -1);
  lua_pop(L, 1);                /* the table keeps it */
  return s;
}

static uint32_t opt_u32(lua_State *L, const char *key) {
  lua_Number n;
  lua_getfield(L, 1, key);
  n = lua_isnil(L, -1) ? 0 : luaL_checknumber(L, -1);
  lua_pop(L, 1);
  if (!(n >= 0 && n <= 4294967295.0 && n == (lua_Number)(uint32_t)n))
    luaL_error(L, "bad option %s (timestamp part out of range)", key);
  return (uint32_t)n;
}

/* ---- pushing views ------------------------------------------------------ */

/* [-0, +1] the holder's host, pid and app, as the document has them */
static void push_holder(lua_State *L, const bson_t *h) {
  static const char *const keys[] = {"host", "pid", "app"};
  bson_iter_t it;
  int k;
  lua_createtable(L, 0, 3);
  for (k = 0; k < 3; k++)
    if (h && bson_iter_init_find(&it, h, keys[k])) {
      ml_pushbsonvalue(L, &it);
      lua_setfield(L, -2, keys[k]);
    }
}

/* [-0, +1] field bit k of e */
static void push_field(lua_State *L, const ml_election *e, int k) {
  unsigned bit = 1u << k;
  if (bit == ML_EV_ACQUIRED) lua_pushnumber(L, (lua_Number)e->acquired_ms / 1000);
  else if (bit == ML_EV_EXPIRES) lua_pushnumber(L, (lua_Number)e->expires_ms / 1000);
  else if (bit == ML_EV_LEASE) lua_pushnumber(L, bson_iter_as_double(&e->field[k].it));
  else ml_pushbsonvalue(L, &e->field[k].it);
}

/* [-0, +1] the fields e has, by their view names */
static void push_election(lua_State *L, const ml_election *e) {
  int k;
  lua_createtable(L, 0, ML_EV_FIELDS + 2);
  for (k = 0; k < ML_EV_FIELDS; k++)
    if (e->has & (1u << k)) {
      push_field(L, e, k);
      lua_setfield(L, -2, ml_election_key(k));
    }
}

/* [-0, +1] {key = true} for each bit of bits */
static void push_keys(lua_State *L, unsigned bits) {
  int k;
  lua_newtable(L);
  for (k = 0; k < ML_EV_FIELDS; k++)
    if (bits & (1u << k)) {
      lua_pushboolean(L, 1);
      lua_setfield(L, -2, ml_election_key(k));
    }
}

/* [-0, +1] one change event's view */
static void push_event(lua_State *L, const bson_t *doc) {
  static const char *const kinds[] = {"update", "replace", "delete", "end"};
  ml_election_event ev;
  ml_parse_election_event(doc, &ev);
  lua_createtable(L, 0, 8);
  lua_pushstring(L, kinds[ev.kind]);
  lua_setfield(L, -2, "kind");
  if (ev.has_time) {
    lua_pushnumber(L, (lua_Number)ev.t);
    lua_setfield(L, -2, "t");
    lua_pushnumber(L, (lua_Number)ev.i);
    lua_setfield(L, -2, "i");
  }
  if (ev.kind == ML_EVENT_UPDATE || ev.kind == ML_EVENT_REPLACE) {
    push_election(L, &ev.doc);
    lua_setfield(L, -2, "fields");
  }
  if (ev.kind == ML_EVENT_UPDATE) {
    push_keys(L, ev.touched);
    lua_setfield(L, -2, "touched");
    push_keys(L, ev.cleared);
    lua_setfield(L, -2, "cleared");
    lua_newtable(L);            /* holder_set */
    lua_newtable(L);            /* holder_unset */
    if (ev.has_holder_parts) {
      bson_iter_t it = ev.holder_parts;
      const char *key;
      while ((key = ml_next_holder_part(&it)) != NULL) {
        if (BSON_ITER_HOLDS_NULL(&it)) {
          lua_pushboolean(L, 1);
          lua_setfield(L, -2, key);
        } else {
          ml_pushbsonvalue(L, &it);
          lua_setfield(L, -3, key);
        }
      }
    }
    lua_setfield(L, -3, "holder_unset");
    lua_setfield(L, -2, "holder_set");
  }
}

/* ---- the queue view, an election's view --------------------------------- */

static int l_op_queue_view(lua_State *L) {
  const char *db, *coll;
  ml_op op;
  luaL_checktype(L, 1, LUA_TTABLE);
  db = opt_string(L, "db", 1);
  coll = opt_string(L, "coll", 1);
  ml_build_queue_view(&op, db, coll);
  ml_push_op(L, &op);
  ml_op_destroy(&op);
  return 1;
}

static int l_parse_queue_view(lua_State *L) {
  bson_t reply;
  bson_iter_t rows;
  arg_bson(L, 1, &reply);
  lua_newtable(L);
  if (!ml_reply_batch(&reply, &rows, NULL)) return 1;
  while (bson_iter_next(&rows)) {
    const uint8_t *data;
    uint32_t len;
    const char *name;
    bson_t row;
    bson_iter_t entries;
    int n = 0, has;
    if (!BSON_ITER_HOLDS_DOCUMENT(&rows)) continue;
    bson_iter_document(&rows, &len, &data);
    if (!bson_init_static(&row, data, len)) continue;
    has = ml_parse_queue_row(&row, &name, &entries);
    if (!name) continue;
    lua_newtable(L);
    while (has && bson_iter_next(&entries)) {
      ml_queue_entry e;
      bson_t entry;
      if (!BSON_ITER_HOLDS_DOCUMENT(&entries)) continue;
      bson_iter_document(&entries, &len, &data);
      if (!bson_init_static(&entry, data, len)) continue;
      ml_parse_queue_entry(&entry, &e);
      push_holder(L, e.has_holder ? &e.holder : NULL);
      lua_pushboolean(L, e.polling);
      lua_setfield(L, -2, "polling");
      if (e.has_left) {
        lua_pushnumber(L, e.left_ms / 1000);
        lua_setfield(L, -2, "remaining");
      }
      lua_rawseti(L, -2, ++n);
    }
    lua_setfield(L, -2, name);
  }
  return 1;
}

static int l_parse_election(lua_State *L) {
  bson_t reply, doc;
  bson_iter_t docs;
  uint32_t t, i;
  arg_bson(L, 1, &reply);
  if (ml_reply_batch(&reply, &docs, NULL) && bson_iter_next(&docs) &&
      BSON_ITER_HOLDS_DOCUMENT(&docs)) {
    const uint8_t *data;
    uint32_t len;
    ml_election e;
    bson_iter_document(&docs, &len, &data);
    if (!bson_init_static(&doc, data, len)) luaL_argerror(L, 1, "malformed BSON");
    ml_parse_election(&doc, &e);
    push_election(L, &e);
    lua_pushboolean(L, e.held);
    lua_setfield(L, -2, "held");
    lua_pushnumber(L, e.has_remaining && e.remaining_ms > 0 ? (lua_Number)e.remaining_ms / 1000 : 0);
    lua_setfield(L, -2, "remaining");
  } else {
    lua_pushboolean(L, 0);
  }
  if (ml_parse_operation_time(&reply, &t, &i)) {
    lua_createtable(L, 0, 2);
    lua_pushnumber(L, (lua_Number)t);
    lua_setfield(L, -2, "t");
    lua_pushnumber(L, (lua_Number)i);
    lua_setfield(L, -2, "i");
  } else {
    lua_pushboolean(L, 0);
  }
  return 2;
}

/* ---- a view stream ------------------------------------------------------ */

typedef struct view_stream {
  ml_stream m;                  /* the machine (stream.c) */
  char *name;                   /* the one document's _id; NULL: every change */
} view_stream;

/* the userdata holds a pointer: the machine's bson_t wants an alignment
 * (BSON_ALIGNOF) that a userdata's memory does not have, so the stream is
 * on the heap, aligned for it, as pool.c's here state */
static view_stream *check_stream(lua_State *L) {
  view_stream *s = *(view_stream **)luaL_checkudata(L, 1, VIEW_STREAM_MT);
  if (!s) luaL_error(L, "the stream is gone");
  return s;
}

static char *dupstr(const char *p) {
  size_t n = strlen(p) + 1;
  char *d = (char *)malloc(n);
  if (d) memcpy(d, p, n);
  return d;
}

static int l_view_stream(lua_State *L) {
  const char *db, *coll, *name;
  uint32_t t, i;
  view_stream *s, **ref;
  luaL_checktype(L, 1, LUA_TTABLE);
  db = opt_string(L, "db", 1);
  coll = opt_string(L, "coll", 1);
  name = opt_string(L, "name", 0);
  t = opt_u32(L, "t");
  i = opt_u32(L, "i");
  ref = (view_stream **)ml_newuserdata(L, sizeof *ref);
  *ref = NULL;
  luaL_getmetatable(L, VIEW_STREAM_MT);
  lua_setmetatable(L, -2);      /* from here __gc frees what it holds */
  if (posix_memalign((void **)ref, BSON_ALIGNOF(view_stream) > sizeof(void *) ? BSON_ALIGNOF(view_stream)
                                                                              : sizeof(void *),
                     sizeof **ref) != 0) {
    *ref = NULL;
    return luaL_error(L, "out of memory");
  }
  s = *ref;
  memset(s, 0, sizeof *s);
  s->m.db = dupstr(db);
  s->m.coll = dupstr(coll);
  s->m.field = dupstr(ML_F_OWNER);
  s->name = name ? dupstr(name) : NULL;
  if (!s->m.db || !s->m.coll || !s->m.field || (name && !s->name)) return luaL_error(L, "out of memory");
  if (!ml_process_tag(s->m.tag)) memcpy(s->m.tag, "-no-randomness-", 16);
  s->m.state = ML_STREAM_STARTING;
  s->m.start_t = s->m.drop_t = t;
  s->m.start_i = s->m.drop_i = i;
  s->m.waiters = 1;             /* its reader: it never goes idle */
  s->m.await_ms = 1000;
  return 1;
}

static int l_stream_next(lua_State *L) {
  view_stream *s = check_stream(L);
  lua_Number await = luaL_optnumber(L, 2, 1);
  double now = ml_monotonic(), wake;
  if (s->m.op_kind) return luaL_error(L, "the stream's command in flight has no outcome yet");
  await = await * 1000;
  s->m.await_ms = await >= 1 ? (await <= 86400000 ? (int64_t)await : 86400000) : 1;
  if (ml_stream_next(&s->m, now, &wake)) {
    if (s->m.op_kind == ML_STREAM_OP_OPEN) {
      /* the machine's opening is a waiter's (releases only): this
       * stream's reads the document, or every change */
      ml_op_destroy(&s->m.op);
      if (s->name)
        ml_build_observe(&s->m.op, s->m.db, s->m.coll, s->name, s->m.start_t, s->m.start_i,
                         s->m.resume);
      else
        ml_build_watch(&s->m.op, s->m.db, s->m.coll, s->m.field, NULL, s->m.start_t, s->m.start_i,
                       s->m.resume);
      s->m.op.session = s->m.session;
    }
    ml_push_op(L, &s->m.op);
    return 1;
  }
  lua_pushnil(L);
  lua_pushnumber(L, wake == HUGE_VAL ? HUGE_VAL : (wake > now ? wake - now : 0));
  return 2;
}

static int l_stream_done(lua_State *L) {
  view_stream *s = check_stream(L);
  int kind = s->m.op_kind, ok, n = 0, batch = 1;
  bson_t reply;
  bson_error_t err;
  bson_iter_t docs;
  if (!kind) return luaL_error(L, "the stream has no command in flight");
  memset(&err, 0, sizeof err);
  ok = ml_arg_outcome(L, 2, &reply, &err);
  lua_newtable(L);
  if (ok && kind != ML_STREAM_OP_KILL) {
    bson_t doc;
    batch = ml_reply_batch(&reply, &docs, NULL);
    while (batch && ml_batch_next(&docs, &doc)) {
      push_event(L, &doc);
      lua_rawseti(L, -2, ++n);
    }
  }
  ml_stream_done(&s->m, ml_monotonic(), ok, &reply, &err);
  bson_destroy(&reply);
  if (kind == ML_STREAM_OP_KILL) return 1;
  if (!ok) {
    lua_pushnil(L);
    lua_pushstring(L, err.message);
    if (err.code) lua_pushinteger(L, (lua_Integer)err.code);
    else lua_pushnil(L);
    return 3;
  }
  if (!batch) return ml_pushfail(L, "change stream: a reply without a cursor", 0);
  return 1;
}

static int l_stream_state(lua_State *L) {
  static const char *const states[] = {"starting", "running", "failed", "done"};
  view_stream *s = check_stream(L);
  int st = s->m.state;
  lua_pushstring(L, st >= ML_STREAM_STARTING && st <= ML_STREAM_DONE ? states[st] : "done");
  if (st != ML_STREAM_FAILED) return 1;
  lua_pushstring(L, s->m.errmsg);
  if (s->m.errcode) lua_pushinteger(L, (lua_Integer)s->m.errcode);
  else lua_pushnil(L);
  return 3;
}

static int l_stream_close(lua_State *L) {
  check_stream(L)->m.stop = 1;
  lua_pushboolean(L, 1);
  return 1;
}

static int l_stream_gc(lua_State *L) {
  view_stream **ref = (view_stream **)luaL_checkudata(L, 1, VIEW_STREAM_MT), *s = *ref;
  if (!s) return 0;
  *ref = NULL;                  /* cleared: a second __gc finds nothing */
  ml_stream_clear(&s->m);
  free(s->name);
  free(s);
  return 0;
}

static const luaL_Reg stream_methods[] = {
  {"next", l_stream_next},
  {"done", l_stream_done},
  {"state", l_stream_state},
  {"close", l_stream_close},
  {NULL, NULL}
};

static const luaL_Reg views_funcs[] = {
  {"op_queue_view", l_op_queue_view},
  {"parse_queue_view", l_parse_queue_view},
  {"parse_election", l_parse_election},
  {"view_stream", l_view_stream},
  {NULL, NULL}
};

void ml_views_open(lua_State *L) {
  /* [module] */
  luaL_newmetatable(L, VIEW_STREAM_MT);          /* [module, mt] */
  lua_newtable(L);
  luaL_setfuncs(L, stream_methods, 0);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, l_stream_gc);
  lua_setfield(L, -2, "__gc");
  lua_pop(L, 1);
  luaL_setfuncs(L, views_funcs, 0);
}
