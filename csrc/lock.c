/*
 * mongolock.Lock: leases on lock documents (named locks and document locks).
 */
#include "mongolock.h"

int (*ml_gc_handoff)(ml_client *c, ml_lease *l) = NULL;

void ml_lock_open(lua_State *L) {
  (void)L;
}
