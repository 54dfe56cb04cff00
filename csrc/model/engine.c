/*
 * The lease engine's decisions (engine.h): plain C over the leases
 * (lease.h: each kind's commands come from its table, ml_kind_of) and the
 * protocol's builders and parsers (protocol.h).  Includes engine.h,
 * lease.h, protocol.h, libbson and the C library only: no Lua, no
 * libmongoc, no I/O, and no clock (the adapters pass now).  renew.c
 * describes what it does and runs it.
 */
#include <stdlib.h>
#include <string.h>

#include "engine.h"

static double retry_delay(int64_t ttl_ms) {
  double d = (double)ttl_ms / 10000.0;
  if (d < 0.05) d = 0.05;
  if (d > 1.0) d = 1.0;
  return d;
}

/* l->mu held: when a held, renewed (or topped-up) lease is due */
static double renew_at(const ml_lease *l) {
  double at = l->deadline - (double)l->ttl_ms * (2.0 / 3.0) / 1000.0;
  /* a grant's short lease is extended to the ttl once (ml_lock_new) */
  if (!l->renew || (l->topup_at && l->topup_at < at)) at = l->topup_at;
  return at;
}

static int grow(void **v, size_t *cap, size_t need, size_t size) {
  void *p;
  size_t c = *cap ? *cap : 16;
  if (need <= *cap) return 1;
  while (c < need) c *= 2;
  p = realloc(*v, c * size);
  if (!p) return 0;
  *v = p;
  *cap = c;
  return 1;
}

/* the work's leases given back, its op freed */
static void work_clear(ml_work *w) {
  size_t i;
  for (i = 0; i < w->n; i++) ml_lease_unref(w->set[i]);
  free(w->set);
  if (w->has_op) ml_op_destroy(&w->op);
  memset(w, 0, sizeof *w);
}

static int work_add(ml_work *w, ml_lease *l) {
  if (!grow((void **)&w->set, &w->cap, w->n + 1, sizeof *w->set)) return 0;
  ml_lease_lock(l);
  l->refs++;
  ml_lease_unlock(l);
  w->set[w->n++] = l;
  return 1;
}

/* renewed with the leases of its collection by the keeper id */
static int by_keeper(const ml_lease *l) {
  return ml_kind_of(l->kind)->by_keeper;
}

static int cmp_lease_id(const void *x, const void *y) {
  const ml_lease *a = *(ml_lease *const *)x, *b = *(ml_lease *const *)y;
  return bson_compare(&a->iddoc, &b->iddoc);
}

/*
 * The documents a renewal of w (one collection) matches when every lease of
 * it is live: one per exclusive lease, and one per distinct document among
 * the shares and permits (this process may hold several of one document).
 * Two exclusive leases of this process on one document (one taken over,
 * then taken again) cannot both be live: counted as two, the renewal's
 * count falls short and the check says which one is.  Only the shares are
 * sorted: a batch of tens of thousands of named locks costs no sort.
 */
static size_t distinct_docs(ml_work *w) {
  ml_lease **v;
  size_t i, k = 0, d = 0;
  if (w->n < 2) return w->n;
  v = (ml_lease **)malloc(w->n * sizeof *v);
  if (!v) return w->n;
  for (i = 0; i < w->n; i++) {
    if (w->set[i]->kind == ML_KIND_NAMED) d++;
    else v[k++] = w->set[i];
  }
  if (k > 1) qsort(v, k, sizeof *v, cmp_lease_id);
  for (i = 0; i < k; i++)
    if (i == 0 || bson_compare(&v[i - 1]->iddoc, &v[i]->iddoc) != 0) d++;
  free(v);
  return d;
}

/* the lease at index i leaves the items (order not kept) */
static void item_drop(ml_engine *e, size_t i) {
  ml_lease *l = e->items[i].lease;
  l->engine = NULL;
  e->items[i] = e->items[--e->n];
  if (i < e->n) e->items[i].lease->item = i;
  ml_lease_unref(l);
}

/* l's item in e, or NULL: found in O(1), however many leases e renews */
static renew_item *item_of(ml_engine *e, const ml_lease *l) {
  if (l->engine != e || l->item >= e->n || e->items[l->item].lease != l) return NULL;
  return &e->items[l->item];
}

/* the renewal of the leases renewed with the item at first by a batch of
 * their _ids (not by_keeper: document locks of the same fields and ttl) */
static void build_batch_renew(ml_engine *e, size_t first, ml_work *w) {
  ml_lease *l0 = e->items[first].lease;
  bson_t ids = BSON_INITIALIZER;
  const char **owners;
  ml_lockref r;
  size_t i, k = 0;
  for (i = 0; i < e->n; i++) {
    ml_lease *l = e->items[i].lease;
    int take;
    if (e->items[i].alone || !ml_lease_same_renewal(l, l0)) continue;
    ml_lease_lock(l);
    take = l->held && l->renew && !l->ending && !l->lost;
    ml_lease_unlock(l);
    if (take) (void)work_add(w, l);
  }
  owners = (const char **)malloc((w->n ? w->n : 1) * sizeof *owners);
  for (i = 0; i < w->n; i++) {
    bson_iter_t it;
    char key[24];
    const char *kp;
    bson_uint32_to_string((uint32_t)k, &kp, key, sizeof key);
    if (bson_iter_init_find(&it, &w->set[i]->iddoc, "_id")) {
      bson_append_iter(&ids, kp, -1, &it);
      if (owners) owners[k] = w->set[i]->owner;
      k++;
    }
  }
  ml_lease_lockref(l0, &r);
  w->kind = ML_WORK_DOC_RENEW;
  w->ttl = l0->ttl_ms;
  ml_kind_of(l0->kind)->renew_many(&w->op, &r, &ids,
                                    owners ? owners : (const char **)&l0->owner, owners ? k : 0,
                                    l0->ttl_ms);
  w->has_op = 1;
  free(owners);
  bson_destroy(&ids);
}

/* leases released by one command (ml_lease_same_release) */
#define RELEASE_BATCH 1000

/* w->op: the release of w's leases (one: a retryable update of its own) */
static void build_release(ml_work *w) {
  ml_lease *l = w->set[0];
  ml_lockref r;
  ml_lease_lockref(l, &r);
  if (w->n == 1) {
    ml_lease_release_op(l, NULL, &w->op);
  } else {
    bson_t ids = BSON_INITIALIZER;
    const char **owners = (const char **)malloc(w->n * sizeof *owners);
    size_t i, k = 0;
    for (i = 0; i < w->n && owners; i++) {
      bson_iter_t it;
      char key[24];
      const char *kp;
      if (!bson_iter_init_find(&it, &w->set[i]->iddoc, "_id")) continue;
      bson_uint32_to_string((uint32_t)k, &kp, key, sizeof key);
      bson_append_iter(&ids, kp, -1, &it);
      owners[k++] = w->set[i]->owner;
    }
    ml_kind_of(l->kind)->release_many(&w->op, &r, &ids, owners ? owners : &r.db, k);
    free(owners);
    bson_destroy(&ids);
  }
  w->has_op = 1;
}

/*
 * The next command to run now in *w (returns 1), or 0 and
 * in *wake when one may be due.  Drops items whose lease no longer wants
 * renewal and marks leases past their deadline lost.
 */
static int engine_next_renewal(ml_engine *e, double now, ml_work *w, double *wake);

static int engine_next(ml_engine *e, double now, ml_work *w, double *wake) {
  double rel_wake = now + 3600;
  int r;
  *wake = now + 3600;
  if (e->work.kind != ML_WORK_NONE) return 0;
  memset(w, 0, sizeof *w);
  w->id = ++e->seq;
  if (e->nrel > 0) {
    /* releases nobody waits for, oldest first, those due (release_at): the
     * first one's collection and kind in one command */
    ml_lease *l0 = NULL;
    size_t j, k = 0;
    for (j = 0; j < e->nrel; j++) {
      ml_lease *l = e->rel[j];
      if (l->release_at > now) {
        if (l->release_at < rel_wake) rel_wake = l->release_at;
        e->rel[k++] = l;
        continue;
      }
      if (!l0) l0 = l;
      if (w->n < RELEASE_BATCH && ml_lease_same_release(l, l0)) {
        if (!grow((void **)&w->set, &w->cap, w->n + 1, sizeof *w->set)) break;
        w->set[w->n++] = l;     /* the queue's reference */
        ml_lease_lock(l);
        l->ending = 1;
        ml_lease_unlock(l);
      } else {
        e->rel[k++] = l;
      }
    }
    for (; j < e->nrel; j++) e->rel[k++] = e->rel[j];
    e->nrel = k;
    if (w->n > 0) {
      w->kind = ML_WORK_RELEASE;
      build_release(w);
      return 1;
    }
    if (l0) {
      *wake = now + 0.1;  /* out of memory: look again soon */
      return 0;
    }
  }
  r = engine_next_renewal(e, now, w, wake);
  if (!r && rel_wake < *wake) *wake = rel_wake;
  return r;
}

/* engine_next's renewals, once no release is due */
static int engine_next_renewal(ml_engine *e, double now, ml_work *w, double *wake) {
  size_t i, due = (size_t)-1;
  double due_time = now + 3600;
  if (now < e->due_at) {
    *wake = e->due_at;
    return 0;
  }
  for (i = 0; i < e->n;) {
    ml_lease *l = e->items[i].lease;
    int drop = 0;
    ml_lease_lock(l);
    if (!l->held || (!l->renew && !l->topup_at) || e->stop) {
      drop = 1;
    } else if (l->ending) {
      /* the Lua side is releasing it: no renewal, no verdict */
    } else if (now >= l->deadline) {
      ml_lease_set_lost(l);
      drop = 1;
    } else {
      double at = renew_at(l);
      if (at < e->items[i].retry_at) at = e->items[i].retry_at;
      if (at < due_time) {
        due_time = at;
        due = i;
      }
      if (l->deadline < *wake) *wake = l->deadline;
    }
    /* every loss of a renewed lease is counted here, once, whoever found
     * it: a renewal, this deadline, or the Lua side's own look at it */
    if (drop && l->lost) e->lost++;
    ml_lease_unlock(l);
    if (drop) item_drop(e, i);
    else i++;
  }
  if (due == (size_t)-1 || due_time > now) {
    if (due_time < *wake) *wake = due_time;
    e->due_at = *wake;
    return 0;
  }
  e->due_at = now;             /* look again when this one is done */
  {
    renew_item *it = &e->items[due];
    ml_lease *l = it->lease;
    int alone;
    ml_lease_lock(l);
    alone = it->alone || !l->renew;
    ml_lease_unlock(l);
    if (alone) {
      /* a top-up, or a document lock to be renewed by itself */
      (void)work_add(w, l);
      ml_lease_lock(l);
      w->ttl = l->ttl_ms;
      ml_lease_unlock(l);
      w->kind = ML_WORK_EXTEND;
      ml_lease_extend_op(l, w->ttl, &w->op);
      w->has_op = 1;
      return 1;
    }
    if (!by_keeper(l)) {
      build_batch_renew(e, due, w);
      return 1;
    }
    /* every renewed lease of the collection */
    for (i = 0; i < e->n; i++) {
      ml_lease *o = e->items[i].lease;
      int take;
      if (!ml_lease_same_renewal(o, l)) continue;
      ml_lease_lock(o);
      take = o->held && o->renew && !o->ending && !o->lost;
      ml_lease_unlock(o);
      if (take) (void)work_add(w, o);
    }
    w->kind = ML_WORK_RENEW;
    w->docs = distinct_docs(w);
    ml_build_renew(&w->op, l->db, l->coll, e->keeper);
    w->has_op = 1;
    return 1;
  }
}

/* l->mu held: the renewal of l (begun at started) was made */
static void renewed(ml_lease *l, double started) {
  if (!l->held || l->lost || l->ending) return;
  l->deadline = ml_lease_deadline(started, l->ttl_ms);
  l->topup_at = 0;
}

/* l->mu held: l's renewal could not be made: lost, unless a release under
 * way or done explains it */
static void not_renewed(ml_lease *l) {
  if (l->held && !l->ending) ml_lease_set_lost(l);
}

/* every item of the leases of w retries at `at` */
static void retry_later(ml_engine *e, ml_work *w, double at) {
  size_t j;
  for (j = 0; j < w->n; j++) {
    renew_item *it = item_of(e, w->set[j]);
    if (it) it->retry_at = at;
  }
}

/*
 * The outcome of e->work (begun at started, taken at now): reply when it
 * ran (ok), else error.  Applies it to the leases and clears the work, or
 * builds the check that follows in e->work's place.
 */
int ml_engine_done(ml_engine *e, double now, double started, int ok, const bson_t *reply,
                   const bson_error_t *error) {
  ml_work *w = &e->work;
  int64_t n = ok ? ml_parse_matched(reply) : -1;
  size_t i;
  (void)error;
  switch (w->kind) {
  case ML_WORK_RELEASE:
    for (i = 0; i < w->n; i++) {
      ml_lease *l = w->set[i];
      int again = 0;
      ml_lease_lock(l);
      if (n == 0) ml_lease_set_lost(l);
      l->held = 0;              /* nobody waits for it: not sent is ended too */
      if (l->redo > 0) {
        /* a lost reply's: again, until enough replies (or one matched) */
        l->tries++;
        if (n > 0 && w->n == 1) l->redo = 0;
        else if (n >= 0) l->redo--;
        if (l->redo > 0 && l->tries < ML_RELEASE_REDO_TRIES) {
          l->release_at = now + ML_RELEASE_REDO_STEP;
          l->refs++;            /* the queue's, again (work_clear drops the work's) */
          again = 1;
        }
      }
      ml_lease_unlock(l);
      if (again && !ml_engine_queue_release(e, l)) ml_lease_unref(l);
    }
    if (n > 0) {
      e->released += (long)n;
      ml_lease_count_release(w->set[0], (long)n);   /* one kind per batch */
    }
    work_clear(w);
    e->due_at = 0;
    return 1;
  case ML_WORK_EXTEND: {
    (void)ml_lease_extend_done(w->set[0], n, w->ttl, started);
    if (n > 0) e->renewals++;
    else if (n < 0) {
      e->failures++;
      ml_lease_renewal_failed(w->set[0]);
      retry_later(e, w, now + retry_delay(w->ttl));
    }
    break;
  }
  case ML_WORK_RENEW:
  case ML_WORK_DOC_RENEW: {
    size_t expect = w->kind == ML_WORK_RENEW ? w->docs : w->n;
    int64_t min_ttl = INT64_MAX;
    e->batches++;
    if (n < 0) {
      e->failures++;
      for (i = 0; i < w->n; i++) {
        if (w->set[i]->ttl_ms < min_ttl) min_ttl = w->set[i]->ttl_ms;
        ml_lease_renewal_failed(w->set[i]);
      }
      retry_later(e, w, now + retry_delay(min_ttl));
      break;
    }
    /* every lease of the batch was renewed when it matched as many
     * documents as the batch has (leases added meanwhile may have matched
     * too) */
    if ((size_t)n == expect + w->added || (w->added == 0 && (size_t)n == expect)) {
      for (i = 0; i < w->n; i++) {
        ml_lease *l = w->set[i];
        ml_lease_lock(l);
        renewed(l, started);
        ml_lease_unlock(l);
      }
      e->renewals += (long)w->n;
      break;
    }
    if (w->kind == ML_WORK_DOC_RENEW) {
      /* which is lost: each is renewed by itself, once */
      for (i = 0; i < w->n; i++) {
        renew_item *it = item_of(e, w->set[i]);
        if (it) it->alone = 1;
      }
      e->due_at = 0;
      break;
    }
    {
      /* a check follows, for the same leases (their references move to
       * it); built in place: a bson_t must not be copied */
      ml_lease **set = w->set;
      size_t cnt = w->n, cap = w->cap;
      w->set = NULL;
      w->n = 0;
      work_clear(w);
      w->kind = ML_WORK_CHECK;
      w->set = set;
      w->n = cnt;
      w->cap = cap;
      w->started = started;
      w->id = ++e->seq;
      ml_build_renew_check(&w->op, set[0]->db, set[0]->coll, e->keeper);
      w->has_op = 1;
      e->checks++;
      return 0;                 /* in flight: the caller hands it out */
    }
  }
  case ML_WORK_CHECK: {
    ml_owners live;
    if ((n < 0 && !ok) || !ml_parse_check(reply, &live)) {
      /* unknown (or no memory to read it): the next renewal (due at once)
       * asks again */
      e->failures++;
      for (i = 0; i < w->n; i++) ml_lease_renewal_failed(w->set[i]);
      break;
    }
    for (i = 0; i < w->n; i++) {
      ml_lease *l = w->set[i];
      int alive = ml_owners_has(&live, l->owner);
      ml_lease_lock(l);
      if (alive) renewed(l, w->started);
      else not_renewed(l);
      ml_lease_unlock(l);
      if (alive) e->renewals++;
    }
    ml_owners_free(&live);
    break;
  }
  case ML_WORK_NONE:
    break;
  }
  work_clear(w);
  e->due_at = 0;               /* look at every item again */
  return 0;
}

int ml_engine_next(ml_engine *e, double now, double *wake) {
  return engine_next(e, now, &e->work, wake);
}

int ml_engine_add(ml_engine *e, ml_lease *l, double *due) {
  if (!item_of(e, l)) {
    if (!grow((void **)&e->items, &e->cap, e->n + 1, sizeof *e->items)) return 0;
    memset(&e->items[e->n], 0, sizeof e->items[e->n]);
    l->engine = e;
    l->item = e->n;
    e->items[e->n++].lease = l;
    ml_lease_lock(l);
    l->refs++;
    ml_lease_unlock(l);
    /* a renewal in flight in l's collection may match l's document */
    if (e->work.kind == ML_WORK_RENEW && ml_lease_same_renewal(l, e->work.set[0])) e->work.added++;
  }
  ml_lease_lock(l);
  *due = renew_at(l);
  if (l->deadline < *due) *due = l->deadline;
  ml_lease_unlock(l);
  return 1;
}

int ml_engine_queue_release(ml_engine *e, ml_lease *l) {
  if (!grow((void **)&e->rel, &e->caprel, e->nrel + 1, sizeof *e->rel)) return 0;
  e->rel[e->nrel++] = l;
  return 1;
}

void ml_engine_clear(ml_engine *e, int free_arrays) {
  while (e->n) item_drop(e, e->n - 1);
  while (e->nrel) ml_lease_unref(e->rel[--e->nrel]);
  if (e->work.kind != ML_WORK_NONE) work_clear(&e->work);
  if (free_arrays) {
    free(e->items);
    free(e->rel);
    e->items = NULL;
    e->rel = NULL;
    e->cap = e->caprel = 0;
  }
}

