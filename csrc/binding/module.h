/*
 * What luaopen_mongolock_core (module.c) hands the specs' module,
 * mongolock.testing (csrc/testing/testing.c), built next to the core and never
 * shipped: a light userdata in the registry under ML_INTERNALS_KEY, set
 * when mongolock.core loads.  Both modules come from one build.
 *
 * May include: client.h, renew.h, watch.h.
 */
#ifndef MONGOLOCK_MODULE_H
#define MONGOLOCK_MODULE_H

#include "client.h"
#include "renew.h"
#include "watch.h"

#define ML_INTERNALS_KEY "mongolock.core.internals"
typedef struct ml_internals {
  ml_client *(*checkclient)(lua_State *L, int idx);
  mongoc_client_t *(*client_get)(lua_State *L, ml_client *c);
  void (*renew_stats)(ml_client *c, ml_renew_counts *out);
  int (*renew_flush)(ml_client *c, double timeout);
  void (*watch_stats)(ml_client *c, ml_watch_counts *out);
  void (*hold_globals)(int hold);
} ml_internals;

#endif
