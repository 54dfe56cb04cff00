# mongolock: distributed locks on MongoDB for Lua.
#
#   make run     install what is missing, build, start the stand-in (unless
#                MONGODB_URI is set) and run the flagship demo
#   make test    the same set-up and the test tools, then the #unit specs
#                with no server under Lua 5.1 .. 5.4 and LuaJIT, and the
#                whole suite under Lua 5.4 and LuaJIT (tools/run-tests)
#   make build   the C core for Lua 5.4 and LuaJIT, installing only what
#                building needs (the default target)
#   make bench   benchmarks (tables on stdout and into doc/benchmarks.md, plots under bench/out/)
#   make torture, make torture-freeze, make test-asan, make test-valgrind: doc/testing.md
#   make doc     the API reference (LDoc, config.ld) under build/doc/
#
# Debian packages are installed with apt-get when missing (run as root, or
# install them yourself first); npm packages for the stand-in with npm ci.

SHELL := /bin/bash
.DEFAULT_GOAL := build

# ---- dependencies ----------------------------------------------------------
#
# Each target installs the Debian packages it needs, and only those, with
# apt-get when they are missing:  make build  the C compiler, libmongoc and
# the Lua headers;  make run  also the command's rocks (lua-argparse,
# lua-cjson), node/npm and the stand-in's npm packages;
# make test  also busted and what the specs start (faketime, nginx, wrk, ...);
# make bench/torture/test-asan/test-valgrind  their own tools on top.

PKGS_BUILD := gcc make pkg-config libmongoc-dev libbson-dev \
	lua5.4 liblua5.4-dev luajit2 libluajit2-5.1-dev
# what the command (bin/mongolock) loads, for the README's next steps
PKGS_RUN := lua-argparse lua-cjson
PKGS_TEST := lua-busted lua-argparse lua-cjson lua-check lua-socket luarocks \
	faketime nginx libnginx-mod-http-lua wrk lua-cqueues lua-luv prometheus \
	lua-coxpcall lua-binaryheap
# the #unit specs under the other Lua versions the core supports
PKGS_LUAS := lua5.1 liblua5.1-0-dev lua5.2 liblua5.2-dev lua5.3 liblua5.3-dev
PKGS_BENCH := wrk gnuplot-nox valgrind nginx libnginx-mod-http-lua lua-socket lua-cjson \
	lua-cqueues
PKGS_TORTURE := faketime
PKGS_VALGRIND := valgrind
# make doc's LDoc (and the spec that runs it)
PKGS_DOC := lua-ldoc
PKGS_TEST += $(PKGS_DOC)

# $(call apt,PACKAGES): installs those of PACKAGES that are missing
# (node and npm count as present when found on PATH, however installed)
apt = @missing=$$(for p in $(1); do \
	    case $$p in nodejs|npm) command -v $${p%js} >/dev/null && continue;; esac; \
	    dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; \
	  done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

STANDIN := tools/mongo-standin
STANDIN_MODULES := $(STANDIN)/node_modules/.installed

.PHONY: deps deps-apt deps-run deps-node deps-npm deps-test deps-luas deps-bench deps-torture deps-valgrind
# what make run needs: the build's packages, the command's, node and the
# stand-in
deps: deps-apt deps-run deps-npm

# what building needs (the C build rules depend on it)
deps-apt:
	$(call apt,$(PKGS_BUILD))

deps-run:
	$(call apt,$(PKGS_RUN))

deps-node:
	$(call apt,nodejs npm)

deps-npm: $(STANDIN_MODULES)

$(STANDIN_MODULES): $(STANDIN)/package.json $(STANDIN)/package-lock.json | deps-node
	cd $(STANDIN) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

deps-test: deps
	$(call apt,$(PKGS_TEST))

deps-luas:
	$(call apt,$(PKGS_LUAS))

deps-bench: deps
	$(call apt,$(PKGS_BENCH))

deps-torture: deps
	$(call apt,$(PKGS_TORTURE))

deps-valgrind: deps-test
	$(call apt,$(PKGS_VALGRIND))

# ---- build -----------------------------------------------------------------

CC ?= gcc
CFLAGS ?= -O2 -g
WARN := -std=gnu99 -Wall -Wextra -Wpedantic -Wshadow -Wmissing-prototypes -Werror
MONGOC_CFLAGS = $(shell pkg-config --cflags libmongoc-1.0)
MONGOC_LIBS = $(shell pkg-config --libs libmongoc-1.0)
# csrc/proc/proc.c is the command's own module (mongolock.proc), not the core's;
# csrc/testing/testing.c is the specs' module (mongolock.testing), never shipped;
# csrc/model/test.c is the plain C parts' test program (build/test/model),
# csrc/driver/test_fiber.c the fibers' (build/test/fiber, fiber-ucontext)
# The core's layers, each a folder whose files include only their own and
# those below (spec/unit_layout_spec.lua checks it):
#   csrc/binding/  mongolock.core's Lua types, the adapters (threads, nginx)
#   csrc/driver/   runs a built command on libmongoc (no Lua)
#   csrc/model/    the protocol, the lease, its engine, the change stream's
#                  machine: plain C on libbson (no Lua, no libmongoc)
CORE_DIRS := csrc/binding csrc/driver csrc/model
CSRC := $(filter-out csrc/model/test.c csrc/driver/test_fiber.c,$(wildcard $(addsuffix /*.c,$(CORE_DIRS))))
CHDR := $(wildcard $(addsuffix /*.h,$(CORE_DIRS)))
CORE_INC := $(addprefix -I,$(CORE_DIRS))

# one build tree per Lua: build/<lua>/mongolock/core.so
LUAS := lua5.4 luajit
INC_lua5.4 := -I/usr/include/lua5.4
INC_luajit := -I/usr/include/luajit-2.1
CORE_SO := $(foreach l,$(LUAS),build/$(l)/mongolock/core.so)
PROC_SO := $(foreach l,$(LUAS),build/$(l)/mongolock/proc.so)
TESTING_SO := $(foreach l,$(LUAS),build/$(l)/mongolock/testing.so)
# the other Lua versions the core supports (make test runs the #unit specs
# under each; make build-luas builds them)
MORE_LUAS := lua5.1 lua5.2 lua5.3
INC_lua5.1 := -I/usr/include/lua5.1
INC_lua5.2 := -I/usr/include/lua5.2
INC_lua5.3 := -I/usr/include/lua5.3
MORE_SO := $(foreach l,$(MORE_LUAS),build/$(l)/mongolock/core.so build/$(l)/mongolock/proc.so \
  build/$(l)/mongolock/testing.so)

.PHONY: build
build: deps-apt $(CORE_SO) $(PROC_SO) $(TESTING_SO)

.PHONY: build-luas
build-luas: deps-luas $(MORE_SO)

build/%/mongolock/core.so: $(CSRC) $(CHDR) | deps-apt
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(WARN) $(SANFLAGS) -fPIC -fvisibility=hidden -shared $(INC_$*) $(CORE_INC) $(MONGOC_CFLAGS) \
	  -o $@ $(CSRC) $(MONGOC_LIBS) -lpthread

# the specs' hooks (fork, fail points, the core's thread counters): built
# next to the core for the specs and benchmarks, not in the rockspec
build/%/mongolock/testing.so: csrc/testing/testing.c $(CHDR) | deps-apt
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(WARN) $(SANFLAGS) -fPIC -fvisibility=hidden -shared $(INC_$*) $(CORE_INC) $(MONGOC_CFLAGS) \
	  -o $@ csrc/testing/testing.c $(MONGOC_LIBS)

# the mongolock command's child processes and signals (no libmongoc)
build/%/mongolock/proc.so: csrc/proc/proc.c csrc/binding/compat.h | deps-apt
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(WARN) $(SANFLAGS) -fPIC -fvisibility=hidden -shared $(INC_$*) -Icsrc/binding \
	  -o $@ csrc/proc/proc.c -lpthread

# environment for running anything against the build tree
export LUA_PATH := $(CURDIR)/lua/?.lua;$(CURDIR)/lua/?/init.lua;$(CURDIR)/spec/?.lua;;
LUA_CPATH_lua5.4 := $(CURDIR)/build/lua5.4/?.so;;
LUA_CPATH_luajit := $(CURDIR)/build/luajit/?.so;;

# ---- run, test -------------------------------------------------------------

.PHONY: run test standin lint clean
run: deps build
	@LUA_CPATH='$(LUA_CPATH_lua5.4)' tools/with-standin lua5.4 examples/counter.lua

test: deps-test build build-luas build/test/model $(FIBER_TESTS) frameworks
	@tools/run-tests

# ---- the game-server frameworks the scheduler specs run in ---------------
#
# skynet and Copas are in neither Debian nor npm: ../shared/vendor holds
# their released tarballs (its README).  make frameworks builds skynet into
# build/skynet (its own Makefile, no jemalloc: about 20 s) and unpacks Copas
# and timerwheel into build/copas/lua with Debian's coxpcall and binaryheap
# (installed for Lua 5.1 to 5.3 only; pure Lua, they serve 5.4 too).
# Without the folder it says so, and spec/skynet_spec.lua and
# spec/copas_spec.lua skip themselves.  VENDOR=DIR: the tarballs elsewhere.
VENDOR ?= $(abspath $(CURDIR)/../shared/vendor)
export MONGOLOCK_VENDOR := $(VENDOR)
SKYNET := build/skynet/skynet
COPAS := build/copas/lua/copas.lua
.PHONY: frameworks
frameworks: deps-test
	@if [ -d '$(VENDOR)' ]; then $(MAKE) -s $(SKYNET) $(COPAS); \
	else echo "no $(VENDOR): the skynet and Copas specs skip"; fi

$(SKYNET): $(VENDOR)/skynet-1.8.0.tar.gz
	@rm -rf build/skynet && mkdir -p build/skynet
	@echo "building skynet 1.8.0 into build/skynet (log: build/skynet.log)"
	@tar xzf $< -C build/skynet --strip-components=1
	@$(MAKE) -C build/skynet linux MALLOC_STATICLIB= SKYNET_DEFINES=-DNOUSE_JEMALLOC >build/skynet.log 2>&1 \
	  || { tail -20 build/skynet.log; exit 1; }

$(COPAS): $(VENDOR)/copas-4.11.0.tar.gz $(VENDOR)/timerwheel-1.0.2.tar.gz
	@rm -rf build/copas && mkdir -p build/copas/src build/copas/lua
	@tar xzf $(VENDOR)/copas-4.11.0.tar.gz -C build/copas/src
	@tar xzf $(VENDOR)/timerwheel-1.0.2.tar.gz -C build/copas/src
	@cp -r build/copas/src/copas-4.11.0/src/. build/copas/src/timerwheel-1.0.2/src/. build/copas/lua/
	@cp /usr/share/lua/5.1/coxpcall.lua /usr/share/lua/5.1/binaryheap.lua build/copas/lua/
	@touch $@
	@echo "Copas 4.11.0 and timerwheel 1.0.2 in build/copas/lua"

# the API reference: LDoc on the public modules' doc comments (config.ld)
.PHONY: doc
doc:
	$(call apt,$(PKGS_DOC))
	@rm -rf build/doc
	ldoc .

# the parts of the core that link alone (the lease, its engine, the change
# stream's machine, the protocol) and their test program: libbson and
# pthreads, no Lua, no libmongoc (tools/run-tests runs it as "model-c")
MODEL_SRC := $(wildcard csrc/model/*.c)
MODEL_HDR := $(wildcard csrc/model/*.h)
BSON_CFLAGS = $(shell pkg-config --cflags libbson-1.0)
BSON_LIBS = $(shell pkg-config --libs libbson-1.0)
build/test/model: $(MODEL_SRC) $(MODEL_HDR) | deps-apt
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(WARN) $(SANFLAGS) -Icsrc/model $(BSON_CFLAGS) -o $@ $(MODEL_SRC) $(BSON_LIBS) -lpthread -lm

# the fibers linked alone (fiber.c and its test program): with the x86-64
# switch where there is one, and on glibc's ucontext, the other platforms'
# (tools/run-tests runs both as "fiber-c")
FIBER_TESTS := build/test/fiber build/test/fiber-ucontext
FIBER_TEST_DEPS := csrc/driver/fiber.c csrc/driver/fiber.h csrc/driver/test_fiber.c csrc/model/tap.h
build/test/fiber: $(FIBER_TEST_DEPS) | deps-apt
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(WARN) -Icsrc/driver -Icsrc/model -o $@ csrc/driver/fiber.c csrc/driver/test_fiber.c -lpthread -lm
build/test/fiber-ucontext: $(FIBER_TEST_DEPS) | deps-apt
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(WARN) -DML_FIBER_UCONTEXT -Icsrc/driver -Icsrc/model -o $@ csrc/driver/fiber.c \
	  csrc/driver/test_fiber.c -lpthread -lm

# the rock built with luarocks into a temporary tree and loaded from there
.PHONY: check-rock
check-rock: deps-test
	@tools/check-rock lua5.4 luajit

# the stand-in in the foreground (PORT=27017 unless given; ARGS for more options)
standin: deps-npm
	$(STANDIN)/run --port $${PORT:-27017} $(ARGS)

# MongoDB's unified transactions tests against the stand-in (SPEC_TESTS: the
# directory source/transactions/tests/unified of a mongodb/specifications
# checkout; without it the runner says so and skips); the skipped ones and
# why: tools/mongo-standin/unified/skips.js and the stand-in's README
.PHONY: standin-spec-tests
standin-spec-tests: deps-npm
	node $(STANDIN)/unified/run.js $(SPEC_TESTS)

# ping vs lock-style findAndModify through libmongoc, 1 and 8 clients
.PHONY: bench-standin
bench-standin: deps-npm
	@$(STANDIN)/bench/run

# ---- benchmarks, torture, sanitizers ---------------------------------------

# peers for the benchmarks, pinned by bench/peer/package-lock.json
BENCH_PEER_MODULES := bench/peer/node_modules/.installed
# (their output goes to stderr: make bench's stdout is the report alone)
$(BENCH_PEER_MODULES): bench/peer/package.json bench/peer/package-lock.json | deps-node
	@echo "npm ci in bench/peer" >&2
	@cd bench/peer && npm ci --no-audit --no-fund --loglevel=error >&2
	@touch $@

# the raw-driver ceiling: the library's two commands from C, built by the
# library's protocol.c and run by its transport.c
RAW_SRC := bench/raw.c csrc/model/protocol.c csrc/driver/transport.c
build/bench/raw: $(RAW_SRC) csrc/model/protocol.h csrc/driver/transport.h | deps-apt
	@mkdir -p $(dir $@)
	@echo "cc -o $@ $(RAW_SRC)" >&2
	@$(CC) $(CFLAGS) $(WARN) $(MONGOC_CFLAGS) -Icsrc/model -Icsrc/driver -o $@ $(RAW_SRC) $(MONGOC_LIBS) -lm >&2

.PHONY: bench torture test-asan test-valgrind
bench: deps-bench build build/bench/raw $(BENCH_PEER_MODULES) frameworks
	@bench/run

# TORTURE_ARGS: e.g. --workers 32 --seconds 300 (tools/torture/run.js); one
# run per kind (exclusive locks, semaphores, reader-writer locks, elections) of
# TORTURE_SECONDS each: 100 s gives every kind more than 10^3 sections here
# (60 s gave the exclusive kind 942)
TORTURE_SECONDS ?= 100
torture: deps-torture build
	@for k in exclusive semaphore rw election; do \
	  tools/with-standin node tools/torture/run.js --kind $$k --log build/torture/$$k.log \
	    --seconds $(TORTURE_SECONDS) $(TORTURE_ARGS) || exit 1; \
	done

# make torture-freeze: holders frozen past their ttl (SIGSTOP, then SIGCONT)
# every TORTURE_FREEZE_EVERY seconds or so, for exclusive locks and
# elections: the library's workers (the holder's process frozen; sections
# of up to 300 ms, so that a freeze finds the holder at work), then the
# command's (mongolock exec or elect, 4 workers, each through a proxy of its
# own: the holder's proxy frozen); TORTURE_SECONDS each.  The library's
# runs end each section with a fenced write (--fenced), half of them blind
# to the handle's own check: the checker judges the document's token order
TORTURE_FREEZE_EVERY ?= 3
.PHONY: torture-freeze
torture-freeze: deps-torture build
	@for k in exclusive election; do \
	  tools/with-standin node tools/torture/run.js --kind $$k --freeze-every $(TORTURE_FREEZE_EVERY) \
	    --hold-ms 300 --fenced --log build/torture/freeze-$$k.log --seconds $(TORTURE_SECONDS) $(TORTURE_ARGS) \
	    || exit 1; \
	  if [ $$k = exclusive ]; then \
	    tools/with-standin node tools/torture/run.js --kind $$k --txn --workers 4 --hold-ms 100 \
	      --freeze-every $(TORTURE_FREEZE_EVERY) --log build/torture/freeze-txn.log --seconds $(TORTURE_SECONDS) \
	      $(TORTURE_ARGS) || exit 1; \
	  fi; \
	  tools/with-standin node tools/torture/run.js --kind $$k --command --workers 4 \
	    --freeze-every $(TORTURE_FREEZE_EVERY) --log build/torture/freeze-command-$$k.log \
	    --seconds $(TORTURE_SECONDS) $(TORTURE_ARGS) || exit 1; \
	done

# The C core under AddressSanitizer + UBSan in its own tree (build/asan),
# the Lua 5.4 specs run with libasan preloaded into the interpreter.  The
# preload reaches every program the specs start (shells, script, forked
# workers), so leak detection is off here: LeakSanitizer reports the system
# tools' own leaks and crashes in forked children of threaded processes.
# Leaks are test-valgrind's job.  The specs with clocks an hour off are left
# out: under faketime the child preloads libfaketime and libasan together
# and hangs at start-up.
ASAN_SO = build/asan/mongolock/core.so
INC_asan := $(INC_lua5.4)
$(ASAN_SO) build/asan/mongolock/proc.so build/asan/mongolock/testing.so: SANFLAGS = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
ASAN_ENV = LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:exitcode=86 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ASAN_SPECS ?= spec
# procps's ps hangs at start-up with libasan preloaded: the specs' ps (a
# child's state) is a wrapper that runs it without the preload
build/asan/bin/ps:
	@mkdir -p $(@D)
	@printf '#!/bin/sh\nunset LD_PRELOAD\nexec %s "$$@"\n' "$$(command -v ps)" > $@
	@chmod +x $@
test-asan: deps-test $(ASAN_SO) build/asan/mongolock/proc.so build/asan/mongolock/testing.so build/asan/bin/ps
	@LUA_CPATH='$(CURDIR)/build/asan/?.so;;' MONGOLOCK_ROOT=$(CURDIR) PATH='$(CURDIR)/build/asan/bin':"$$PATH" \
	  tools/with-standin env $(ASAN_ENV) busted --lua=lua5.4 --filter-out=hour.off $(ASAN_SPECS)

# The Lua 5.4 specs under valgrind (spawned children are not traced).  Left
# out: the specs that depend on tight timing (renewal, the command's child
# processes, nginx), which valgrind slows past their deadlines, and fork() tests:
# a forked child abandons its parent's pool by design (libmongoc forbids
# destroying it there), which valgrind reports as definitely lost at the
# child's exit.  VALGRIND_SPECS to change the set.
VALGRIND_SPECS ?= spec/unit_args_spec.lua spec/unit_backoff_spec.lua spec/bson_spec.lua \
	spec/locks_basic_spec.lua spec/locks_failures_spec.lua spec/locks_roundtrips_spec.lua \
	spec/malformed_spec.lua spec/torture_spec.lua spec/queue_spec.lua spec/watch_spec.lua \
	spec/documents_spec.lua spec/versioned_spec.lua
test-valgrind: deps-valgrind build
	@LUA_CPATH='$(LUA_CPATH_lua5.4)' MONGOLOCK_ROOT=$(CURDIR) tools/with-standin \
	  valgrind -q --leak-check=full --errors-for-leak-kinds=definite --error-exitcode=1 \
	  lua5.4 /usr/bin/busted --filter-out=fork $(VALGRIND_SPECS)

lint:
	$(call apt,lua-check)
	luacheck lua spec examples bin tools bench

clean:
	rm -rf build bench/out
