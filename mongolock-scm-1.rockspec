-- From a checkout:  luarocks --lua-version=5.4 make mongolock-scm-1.rockspec
-- (5.1 .. 5.4; for LuaJIT --lua-version=5.1 with LUA_INCDIR=/usr/include/luajit-2.1).
-- Where LuaRocks cannot reach its server, install lua-argparse and lua-cjson
-- from the system's packages and add --deps-mode=none.  The Makefile builds
-- the same C module for Lua 5.4 and LuaJIT without LuaRocks.
rockspec_format = "3.0"
package = "mongolock"
version = "scm-1"

source = {
  url = "git+https://github.com/mongolock/mongolock.git",
  branch = "main",
}

description = {
  summary = "Distributed locks on MongoDB for Lua: named locks with fencing tokens, document locks",
  detailed = [[
Named locks that any number of processes on any number of machines can
contend for, that expire when their holder dies and that only their holder
can release.  Every expiry decision uses the server's clock; every
uncontended operation is one round trip; fencing tokens strictly increase.
A C core on libmongoc, a Lua layer, a command-line tool and an
OpenResty-friendly API.]],
  homepage = "https://github.com/mongolock/mongolock",
  license = "MIT",
  labels = { "mongodb", "lock", "distributed", "openresty" },
}

dependencies = {
  "lua >= 5.1, < 5.5",   -- Lua 5.1 .. 5.4, and LuaJIT 2.1 (which reports 5.1)
  "lua-cjson >= 2.1.0",  -- bin/mongolock (mongolock.cli): --json output
  "argparse >= 0.7",     -- bin/mongolock (mongolock.cli): its command line
}

external_dependencies = {
  LIBMONGOC = {
    header = "libmongoc-1.0/mongoc/mongoc.h",
    library = "mongoc-1.0",
  },
  LIBBSON = {
    header = "libbson-1.0/bson/bson.h",
    library = "bson-1.0",
  },
}

build = {
  type = "builtin",
  modules = {
    ["mongolock"] = "lua/mongolock.lua",
    ["mongolock.locks"] = "lua/mongolock/locks.lua",
    ["mongolock.elections"] = "lua/mongolock/elections.lua",
    ["mongolock.backoff"] = "lua/mongolock/backoff.lua",
    ["mongolock.wait"] = "lua/mongolock/wait.lua",
    ["mongolock.metrics"] = "lua/mongolock/metrics.lua",
    ["mongolock.args"] = "lua/mongolock/args.lua",
    ["mongolock.errors"] = "lua/mongolock/errors.lua",
    ["mongolock.loop"] = "lua/mongolock/loop.lua",
    ["mongolock.runners"] = "lua/mongolock/runners.lua",
    ["mongolock.stats"] = "lua/mongolock/stats.lua",
    ["mongolock.cli"] = "lua/mongolock/cli.lua",
    ["mongolock.versioned"] = "lua/mongolock/versioned.lua",
    ["mongolock.fenced"] = "lua/mongolock/fenced.lua",
    ["mongolock.transaction"] = "lua/mongolock/transaction.lua",
    ["mongolock.documents"] = "lua/mongolock/documents.lua",
    ["mongolock.shared"] = "lua/mongolock/shared.lua",
    ["resty.mongolock"] = "lua/resty/mongolock.lua",
    ["mongolock.ngx"] = "lua/mongolock/ngx.lua",
    ["mongolock.ngx.thread"] = "lua/mongolock/ngx/thread.lua",
    ["mongolock.ngx.runner"] = "lua/mongolock/ngx/runner.lua",
    ["mongolock.yielding"] = "lua/mongolock/yielding.lua",
    ["mongolock.bridge"] = "lua/mongolock/bridge.lua",
    ["mongolock.sched"] = "lua/mongolock/sched.lua",
    ["mongolock.sched.luv"] = "lua/mongolock/sched/luv.lua",
    ["mongolock.sched.skynet"] = "lua/mongolock/sched/skynet.lua",
    ["mongolock.sched.copas"] = "lua/mongolock/sched/copas.lua",
    ["mongolock.core"] = {
      sources = {
        -- the binding: mongolock.core's Lua types and the adapters
        "csrc/binding/module.c", "csrc/binding/client.c", "csrc/binding/lock.c", "csrc/binding/attempt.c",
        "csrc/binding/named.c", "csrc/binding/shared.c", "csrc/binding/documents.c", "csrc/binding/ops.c",
        "csrc/binding/command.c", "csrc/binding/views.c", "csrc/binding/stats.c", "csrc/binding/renew.c",
        "csrc/binding/watch.c", "csrc/binding/pool.c", "csrc/binding/bson.c", "csrc/binding/args.c",
        "csrc/binding/sys.c",
        -- the driver: a built command run on libmongoc
        "csrc/driver/transport.c", "csrc/driver/bounded.c", "csrc/driver/fiber.c", "csrc/driver/fiber_stream.c",
        -- the model: plain C on libbson
        "csrc/model/protocol.c", "csrc/model/protocol_shared.c", "csrc/model/protocol_views.c",
        "csrc/model/lease.c", "csrc/model/obs.c", "csrc/model/engine.c", "csrc/model/stream.c",
      },
      -- Debian: /usr/include/libmongoc-1.0 and /usr/include/libbson-1.0
      incdirs = { "csrc/binding", "csrc/driver", "csrc/model",
                  "$(LIBMONGOC_INCDIR)/libmongoc-1.0", "$(LIBBSON_INCDIR)/libbson-1.0" },
      libdirs = { "$(LIBMONGOC_LIBDIR)", "$(LIBBSON_LIBDIR)" },
      libraries = { "mongoc-1.0", "bson-1.0", "pthread" },
    },
    -- the mongolock command's child processes (bin/mongolock only)
    ["mongolock.proc"] = { sources = { "csrc/proc/proc.c" }, incdirs = { "csrc/binding" },
                         libraries = { "pthread" } },
  },
  install = {
    bin = { mongolock = "bin/mongolock" },
  },
}

test = {
  type = "busted",
}
