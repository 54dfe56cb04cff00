/*
 * The lease as plain C (lease.h): making and freeing one, its local
 * deadline, each kind's commands (the table below: release, release of
 * many, extend, renewal of many, the check's parser) and what a release's
 * or an extend's outcome does to its state.  Includes lease.h, protocol*.h,
 * libbson and the C library only: no Lua, no libmongoc, no I/O.  The
 * binding (lock.c) runs these commands for a handle, the engine (engine.c)
 * for the leases it renews and releases; the counters and events a state
 * change writes are obs.c's.
 */
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lease.h"
#include "protocol_shared.h"

double ml_monotonic(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* the pid kept by ml_pid (0: not known yet, or forgotten by a fork) */
static pid_t pid_kept;
static pthread_once_t pid_once = PTHREAD_ONCE_INIT;

static void pid_forget(void) {
  __atomic_store_n(&pid_kept, 0, __ATOMIC_RELAXED);
}

static void pid_register(void) {
  pthread_atfork(NULL, NULL, pid_forget);
}

pid_t ml_pid(void) {
  pid_t p = __atomic_load_n(&pid_kept, __ATOMIC_RELAXED);
  if (p) return p;
  pthread_once(&pid_once, pid_register);
  p = getpid();
  __atomic_store_n(&pid_kept, p, __ATOMIC_RELAXED);
  return p;
}

double ml_lease_deadline(double started, int64_t ms) {
  return started + (double)ms / 1000.0 * (1.0 - 1e-3) - 0.002;
}

/* ---- each kind's commands ------------------------------------------------ */

/* an entry of a named lock's holders (a reader's share, a semaphore's
 * permit): the holders' builders (protocol_shared.h) */
static void share_release(ml_op *op, const ml_lockref *r, const char *owner, const bson_t *extra) {
  (void)extra;
  ml_build_share_release(op, r->db, r->coll, r->id, owner);
}

static void share_release_many(ml_op *op, const ml_lockref *r, const bson_t *ids,
                               const char *const *owners, size_t n) {
  ml_build_share_release_many(op, r->db, r->coll, ids, owners, n);
}

static void share_extend(ml_op *op, const ml_lockref *r, const char *owner, int64_t ttl_ms) {
  ml_build_share_extend(op, r->db, r->coll, r->id, owner, ttl_ms);
}

/* release classes: kinds released by the same release_many */
enum { RELEASE_NAMED, RELEASE_DOCUMENT, RELEASE_SHARES };

static const ml_kind_ops kinds[ML_KINDS] = {
  [ML_KIND_NAMED] = {"named", 1, 0, 0, RELEASE_NAMED, 1, ml_build_release, ml_build_release_many,
                     ml_build_extend, NULL},
  [ML_KIND_DOCUMENT] = {"document", 0, 1, 1, RELEASE_DOCUMENT, 0, ml_build_release,
                        ml_build_release_many, ml_build_extend, ml_build_doc_renew},
  [ML_KIND_SHARED] = {"shared", 0, 0, 0, RELEASE_SHARES, 1, share_release, share_release_many,
                      share_extend, NULL},
  [ML_KIND_PERMIT] = {"permit", 0, 0, 0, RELEASE_SHARES, 1, share_release, share_release_many,
                      share_extend, NULL},
};

const ml_kind_ops *ml_kind_of(ml_kind kind) {
  return &kinds[kind];
}

static int same_coll(const ml_lease *a, const ml_lease *b) {
  return !strcmp(a->db, b->db) && !strcmp(a->coll, b->coll);
}

static int same_fields(const ml_lease *a, const ml_lease *b) {
  return !strcmp(a->owner_field, b->owner_field) && !strcmp(a->time_field, b->time_field) &&
         a->time_mode == b->time_mode && a->owner_form == b->owner_form;
}

int ml_lease_same_release(const ml_lease *a, const ml_lease *b) {
  return same_coll(a, b) && kinds[a->kind].release_class == kinds[b->kind].release_class &&
         (!kinds[a->kind].own_fields || same_fields(a, b));
}

/* ttl_ms of a by_keeper lease changes under its mu (an extend); the
 * others' are compared by the engine under its own lock */
int ml_lease_same_renewal(const ml_lease *a, const ml_lease *b) {
  if (kinds[a->kind].by_keeper || kinds[b->kind].by_keeper)
    return kinds[a->kind].by_keeper && kinds[b->kind].by_keeper && same_coll(a, b);
  return same_coll(a, b) && same_fields(a, b) && a->ttl_ms == b->ttl_ms;
}

/* ---- a lease -------------------------------------------------------------- */

ml_lease *ml_lease_new(const ml_lease_spec *s) {
  ml_lease *l = (ml_lease *)bson_malloc0(sizeof *l);
  bson_iter_t it;
  pthread_mutex_init(&l->mu, NULL);
  l->db = bson_strdup(s->ref.db);
  l->coll = bson_strdup(s->ref.coll);
  bson_copy_to(s->ref.id, &l->iddoc);
  if (bson_iter_init_find(&it, &l->iddoc, "_id")) bson_value_copy(bson_iter_value(&it), &l->id);
  else l->id.value_type = BSON_TYPE_NULL;
  l->kind = s->kind;
  l->owner_field = bson_strdup(s->ref.owner_field ? s->ref.owner_field : ML_F_OWNER);
  l->time_field = bson_strdup(s->ref.time_field ? s->ref.time_field : ML_F_EXPIRES);
  l->time_mode = s->ref.time_mode;
  l->owner_form = s->ref.owner_form;
  bson_strncpy(l->owner, s->owner, sizeof l->owner);
  l->token = s->token;
  l->op_t = s->op_t;
  l->started = s->started;
  l->op_i = s->op_i;
  l->pid = ml_pid();
  l->ttl_ms = s->ttl_ms;
  l->deadline = ml_lease_deadline(s->started, s->grant_ms > 0 && s->grant_ms < s->ttl_ms
                                                ? s->grant_ms : s->ttl_ms);
  l->held = 1;
  l->renew = s->renew;
  l->refs = 1;
  return l;
}

void ml_lease_spec_named(ml_lease_spec *s, ml_kind kind, const char *db, const char *coll,
                         const bson_t *id, const char *owner_field, const char *owner,
                         int64_t ttl_ms) {
  memset(s, 0, sizeof *s);
  ml_named_ref(&s->ref, db, coll, id);
  s->ref.owner_field = owner_field;
  s->ref.queued = kinds[kind].queued;
  s->owner = owner;
  s->ttl_ms = ttl_ms;
  s->kind = kind;
}

void ml_lease_unref(ml_lease *l) {
  int refs;
  ml_lease_lock(l);
  refs = --l->refs;
  ml_lease_unlock(l);
  if (refs > 0) return;
  pthread_mutex_destroy(&l->mu);
  ml_obs_unref(l->obs);
  bson_free(l->db);
  bson_free(l->coll);
  bson_free(l->owner_field);
  bson_free(l->time_field);
  bson_destroy(&l->iddoc);
  bson_value_destroy(&l->id);
  bson_free(l);
}

void ml_lease_lockref(const ml_lease *l, ml_lockref *r) {
  r->db = l->db;
  r->coll = l->coll;
  r->id = &l->iddoc;
  r->owner_field = l->owner_field;
  r->time_field = l->time_field;
  r->time_mode = l->time_mode;
  r->owner_form = l->owner_form;
  r->queued = kinds[l->kind].queued;
}

/* marks l as ending first: a renewal that then matches nothing saw the
 * release, not a loss */
void ml_lease_release_op(ml_lease *l, const bson_t *extra, ml_op *op) {
  ml_lockref r;
  ml_lease_lock(l);
  l->ending = 1;
  ml_lease_unlock(l);
  ml_lease_lockref(l, &r);
  kinds[l->kind].release(op, &r, l->owner, extra);
}

/* s->ref.queued was set with the spec (ml_lease_spec_named) */
void ml_lease_spec_release_op(const ml_lease_spec *s, ml_op *op) {
  kinds[s->kind].release(op, &s->ref, s->owner, NULL);
}

void ml_lease_extend_op(ml_lease *l, int64_t ttl_ms, ml_op *op) {
  ml_lockref r;
  ml_lease_lockref(l, &r);
  kinds[l->kind].extend(op, &r, l->owner, ttl_ms);
}

/* (were a release with a write concern error rolled back, the lease would
 * end at its ttl, as a release not sent does) */
int64_t ml_release_matched(int ok, const bson_t *reply) {
  if (ok || bson_has_field(reply, "writeConcernError") || bson_has_field(reply, "writeConcernErrors"))
    return ml_parse_matched(reply);
  return -1;
}

int ml_lease_release_done(ml_lease *l, int64_t n) {
  ml_lease_lock(l);
  if (n > 0) {
    l->held = 0;
    ml_lease_count_release(l, 1);
  } else if (n == 0) {
    ml_lease_set_lost(l);
  } else {
    l->ending = 0;              /* still held: renewal goes on */
  }
  ml_lease_unlock(l);
  return n < 0 ? -1 : n > 0 ? 1 : 0;
}

int ml_lease_extend_done(ml_lease *l, int64_t n, int64_t ttl_ms, double started) {
  if (n < 0) return -1;
  ml_lease_lock(l);
  if (n > 0 && l->held && !l->lost) {
    /* locked-at documents expire at lockTime + the ttl every party uses:
     * the lease length does not change */
    if (l->time_mode == ML_TIME_EXPIRES_AT) l->ttl_ms = ttl_ms;
    l->deadline = ml_lease_deadline(started, l->ttl_ms);
    l->topup_at = 0;
  } else if (n == 0 && l->held && !l->ending) {
    /* a release under way or done is not a loss: it cleared the owner */
    ml_lease_set_lost(l);
  }
  ml_lease_unlock(l);
  return n > 0 ? 1 : 0;
}
