/*
 * The lease engine: what every held lease of a client does over its life
 * in this process, decided in one place for every kind and every
 * transport.  It renews the leases in batches (one command per collection
 * and renewal period, however many leases), retries a failed renewal
 * every ttl/10 (50 ms .. 1 s), marks a lease lost when its renewal could
 * not be made or its local deadline passes, tops up a grant's short lease,
 * and sends the releases nobody waits for (a collected handle's, a lost
 * reply's).
 *
 * The engine only says which command to run next and takes its outcome
 * (engine_next, engine_done); a transport runs it.  Two adapters:
 *   - the plain one: one thread per client and process (renew_main), which
 *     pops its own connection from the client's pool and never touches a
 *     lua_State;
 *   - an external one (client:set_external(true), inside nginx): no thread;
 *     client:engine_next() hands the command to Lua as a BSON op string, an
 *     nginx timer runs it in a worker thread and gives the reply back with
 *     client:engine_done().
 *
 * Renewal in batches (protocol.h, ml_build_renew): each lease document of
 * a renewed named lock, share or permit carries the keeper id of the
 * client process that renews it and its own ttl, so one update with multi
 * extends every live lease of that keeper in a collection by its own ttl on
 * the server's clock.  It matches only the documents where one of them is
 * live: when it matched as many documents as the batch holds, every lease
 * of the batch was renewed; otherwise one aggregate (ml_build_renew_check)
 * tells which still are, and only the others are lost.  Document locks
 * (the application's documents carry no keeper) are renewed per collection
 * and ttl by one update over their listed (_id, owner) pairs; when it
 * matches fewer, each is renewed alone once, which says which is lost.
 *
 * A lease's renewal is due once a third of its ttl has passed since the last
 * successful acquire or extend; when one lease of a collection is due, the
 * whole collection's renewed leases go in the batch, so leases of one ttl
 * fall into step.
 *
 * Invariants:
 * - renew_mu guards every ml_renew, its items, its releases and its work.
 *   A lease's mu is taken only inside renew_mu (or alone, by the Lua side).
 * - A lease appears in at most one item of one state; each item, each
 *   queued release and each lease of the work in flight owns one reference.
 * - At most one command runs at a time per state (st->work.kind != W_NONE
 *   from engine_next until engine_done).
 * - fork: the prepare handler holds renew_mu across fork(), so the child
 *   inherits no mutex held by a renewal thread.  In the child the parent's
 *   states are abandoned (never joined, never freed) and new ones are made
 *   on first use.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mongolock.h"
#include "protocol_shared.h"

typedef struct renew_item {
  ml_lease *lease;              /* one reference owned by this item */
  double retry_at;              /* after a failed renewal: not before this */
  int alone;                    /* renewed by a command of its own (after a
                                   batch of document locks matched fewer) */
} renew_item;

typedef enum { W_NONE = 0, W_RELEASE, W_EXTEND, W_RENEW, W_DOC_RENEW, W_CHECK } work_kind;

/* the command in flight and what its outcome applies to */
typedef struct ml_work {
  work_kind kind;
  long id;
  ml_lease **set;               /* the leases it is for (a reference each) */
  size_t n, cap;
  size_t docs;                  /* W_RENEW: distinct documents of set */
  size_t added;                 /* W_RENEW: leases of its collection added
                                   while it ran (they may have matched) */
  int64_t ttl;                  /* W_EXTEND, W_DOC_RENEW */
  double started;               /* W_CHECK: when the renewal it checks began */
  int handed;                   /* given to the external adapter */
  ml_op op;
  int has_op;
} ml_work;

typedef struct ml_renew {
  struct ml_renew *next;        /* all states of this process (renew_mu) */
  ml_client *c;                 /* owner; outlives the thread (close joins) */
  mongoc_client_pool_t *pool;   /* c's pool in this process; NULL external */
  pid_t pid;                    /* process the state belongs to */
  int external;                 /* driven from Lua (no thread) */
  char keeper[17];              /* this client's keeper id in this process */
  pthread_t thread;
  pthread_cond_t cv;            /* new work or stop */
  pthread_cond_t done;          /* a release was sent (ml_renew_flush) */
  renew_item *items;            /* leases renewed or topped up */
  size_t n, cap;
  ml_lease **rel;               /* releases to send, in order */
  size_t nrel, caprel;
  ml_work work;                 /* the command in flight, if any */
  long seq;                     /* ids of work */
  double due_at;                /* no renewal is due before this */
  double wake_at;               /* the thread sleeps until then; 0 while it
                                   runs (it looks at every item before it
                                   sleeps again) */
  int scan;                     /* a server selection is asked for */
  int scanning;                 /* the thread is inside it (do_scan) */
  ml_orphan *orphan;            /* detached by close inside a selection:
                                   the thread frees this state and drops
                                   the pool when it returns */
  int stop;
  /* counters for ml_renew_stats */
  long renewals, failures, lost, released, batches, checks;
} ml_renew;

static pthread_mutex_t renew_mu = PTHREAD_MUTEX_INITIALIZER;
static ml_renew *states;        /* (renew_mu) */

/* ---- fork -------------------------------------------------------------- */

static void fork_prepare(void) {
  pthread_mutex_lock(&renew_mu);
}

static void fork_parent(void) {
  pthread_mutex_unlock(&renew_mu);
}

static void fork_child(void) {
  states = NULL;
  pthread_mutex_unlock(&renew_mu);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void install_atfork(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* ---- the engine -------------------------------------------------------- */

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

/* renew_mu held: the work's leases given back, its op freed */
static void work_clear(ml_work *w) {
  size_t i;
  for (i = 0; i < w->n; i++) ml_lease_unref(w->set[i]);
  free(w->set);
  if (w->has_op) ml_op_destroy(&w->op);
  memset(w, 0, sizeof *w);
}

static int work_add(ml_work *w, ml_lease *l) {
  if (!grow((void **)&w->set, &w->cap, w->n + 1, sizeof *w->set)) return 0;
  pthread_mutex_lock(&l->mu);
  l->refs++;
  pthread_mutex_unlock(&l->mu);
  w->set[w->n++] = l;
  return 1;
}

static int same_coll(const ml_lease *a, const ml_lease *b) {
  return !strcmp(a->db, b->db) && !strcmp(a->coll, b->coll);
}

static int named_kind(const ml_lease *l) {
  return l->kind != ML_KIND_DOCUMENT;
}

/* document locks renewed by one command: one collection, fields and ttl */
static int same_doc_group(const ml_lease *a, const ml_lease *b) {
  return same_coll(a, b) && !strcmp(a->owner_field, b->owner_field) &&
         !strcmp(a->time_field, b->time_field) && a->time_mode == b->time_mode &&
         a->owner_form == b->owner_form && a->ttl_ms == b->ttl_ms;
}

static int cmp_lease_id(const void *x, const void *y) {
  const ml_lease *a = *(ml_lease *const *)x, *b = *(ml_lease *const *)y;
  return bson_compare(&a->iddoc, &b->iddoc);
}

/* distinct documents among the leases of w (one collection) */
static size_t distinct_docs(ml_work *w) {
  ml_lease **v;
  size_t i, d = 0;
  if (w->n < 2) return w->n;
  v = (ml_lease **)malloc(w->n * sizeof *v);
  if (!v) return w->n;
  memcpy(v, w->set, w->n * sizeof *v);
  qsort(v, w->n, sizeof *v, cmp_lease_id);
  for (i = 0; i < w->n; i++)
    if (i == 0 || bson_compare(&v[i - 1]->iddoc, &v[i]->iddoc) != 0) d++;
  free(v);
  return d;
}

/* renew_mu held: the lease at index i leaves the items (order not kept) */
static void item_drop(ml_renew *st, size_t i) {
  ml_lease_unref(st->items[i].lease);
  st->items[i] = st->items[--st->n];
}

/* renew_mu held: the batch of document locks like the item at i */
static void build_doc_renew(ml_renew *st, size_t first, ml_work *w) {
  ml_lease *l0 = st->items[first].lease;
  bson_t ids = BSON_INITIALIZER;
  const char **owners;
  ml_lockref r;
  size_t i, k = 0;
  for (i = 0; i < st->n; i++) {
    ml_lease *l = st->items[i].lease;
    int take;
    if (st->items[i].alone || !same_doc_group(l, l0)) continue;
    pthread_mutex_lock(&l->mu);
    take = l->held && l->renew && !l->ending && !l->lost;
    pthread_mutex_unlock(&l->mu);
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
  w->kind = W_DOC_RENEW;
  w->ttl = l0->ttl_ms;
  ml_build_doc_renew(&w->op, &r, &ids, owners ? owners : (const char **)&l0->owner,
                     owners ? k : 0, l0->ttl_ms);
  w->has_op = 1;
  free(owners);
  bson_destroy(&ids);
}

/* leases released by one command: one collection, and the same kind of
 * document (a document lock's: the same fields) */
#define RELEASE_BATCH 1000
static int same_release_group(const ml_lease *a, const ml_lease *b) {
  int sa = a->kind == ML_KIND_SHARED || a->kind == ML_KIND_PERMIT;
  int sb = b->kind == ML_KIND_SHARED || b->kind == ML_KIND_PERMIT;
  if (!same_coll(a, b) || sa != sb || (a->kind == ML_KIND_NAMED) != (b->kind == ML_KIND_NAMED))
    return 0;
  return a->kind != ML_KIND_DOCUMENT ||
         (!strcmp(a->owner_field, b->owner_field) && !strcmp(a->time_field, b->time_field) &&
          a->time_mode == b->time_mode && a->owner_form == b->owner_form);
}

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
    if (l->kind == ML_KIND_SHARED || l->kind == ML_KIND_PERMIT)
      ml_build_share_release_many(&w->op, l->db, l->coll, &ids, owners ? owners : &r.db, k);
    else
      ml_build_release_many(&w->op, &r, &ids, owners ? owners : &r.db, k);
    free(owners);
    bson_destroy(&ids);
  }
  w->has_op = 1;
}

/*
 * renew_mu held.  The next command to run now in *w (returns 1), or 0 and
 * in *wake when one may be due.  Drops items whose lease no longer wants
 * renewal and marks leases past their deadline lost.
 */
static int engine_next(ml_renew *st, double now, ml_work *w, double *wake) {
  size_t i, due = (size_t)-1;
  double due_time = now + 3600;
  *wake = now + 3600;
  if (st->work.kind != W_NONE) return 0;
  memset(w, 0, sizeof *w);
  w->id = ++st->seq;
  if (st->nrel > 0) {
    /* releases nobody waits for, oldest first: those of the first one's
     * collection and kind in one command */
    ml_lease *l0 = st->rel[0];
    size_t j, k = 0;
    for (j = 0; j < st->nrel; j++) {
      ml_lease *l = st->rel[j];
      if (w->n < RELEASE_BATCH && same_release_group(l, l0)) {
        if (!grow((void **)&w->set, &w->cap, w->n + 1, sizeof *w->set)) break;
        w->set[w->n++] = l;     /* the queue's reference */
        pthread_mutex_lock(&l->mu);
        l->ending = 1;
        pthread_mutex_unlock(&l->mu);
      } else {
        st->rel[k++] = l;
      }
    }
    for (; j < st->nrel; j++) st->rel[k++] = st->rel[j];
    st->nrel = k;
    if (w->n == 0) return 0;
    w->kind = W_RELEASE;
    build_release(w);
    return 1;
  }
  if (now < st->due_at) {
    *wake = st->due_at;
    return 0;
  }
  for (i = 0; i < st->n;) {
    ml_lease *l = st->items[i].lease;
    int drop = 0;
    pthread_mutex_lock(&l->mu);
    if (!l->held || (!l->renew && !l->topup_at) || st->stop) {
      drop = 1;
    } else if (l->ending) {
      /* the Lua side is releasing it: no renewal, no verdict */
    } else if (now >= l->deadline) {
      ml_lease_set_lost(l);
      drop = 1;
    } else {
      double at = renew_at(l);
      if (at < st->items[i].retry_at) at = st->items[i].retry_at;
      if (at < due_time) {
        due_time = at;
        due = i;
      }
      if (l->deadline < *wake) *wake = l->deadline;
    }
    /* every loss of a renewed lease is counted here, once, whoever found
     * it: a renewal, this deadline, or the Lua side's own look at it */
    if (drop && l->lost) st->lost++;
    pthread_mutex_unlock(&l->mu);
    if (drop) item_drop(st, i);
    else i++;
  }
  if (due == (size_t)-1 || due_time > now) {
    if (due_time < *wake) *wake = due_time;
    st->due_at = *wake;
    return 0;
  }
  st->due_at = now;             /* look again when this one is done */
  {
    renew_item *it = &st->items[due];
    ml_lease *l = it->lease;
    int alone;
    pthread_mutex_lock(&l->mu);
    alone = it->alone || !l->renew;
    pthread_mutex_unlock(&l->mu);
    if (alone) {
      /* a top-up, or a document lock to be renewed by itself */
      (void)work_add(w, l);
      pthread_mutex_lock(&l->mu);
      w->ttl = l->ttl_ms;
      pthread_mutex_unlock(&l->mu);
      w->kind = W_EXTEND;
      ml_lease_extend_op(l, w->ttl, &w->op);
      w->has_op = 1;
      return 1;
    }
    if (!named_kind(l)) {
      build_doc_renew(st, due, w);
      return 1;
    }
    /* every renewed lease of the collection */
    for (i = 0; i < st->n; i++) {
      ml_lease *o = st->items[i].lease;
      int take;
      if (!named_kind(o) || !same_coll(o, l)) continue;
      pthread_mutex_lock(&o->mu);
      take = o->held && o->renew && !o->ending && !o->lost;
      pthread_mutex_unlock(&o->mu);
      if (take) (void)work_add(w, o);
    }
    w->kind = W_RENEW;
    w->docs = distinct_docs(w);
    ml_build_renew(&w->op, l->db, l->coll, st->keeper);
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

/* renew_mu held: every item of the leases of w retries at `at` */
static void retry_later(ml_renew *st, ml_work *w, double at) {
  size_t i, j;
  for (i = 0; i < st->n; i++)
    for (j = 0; j < w->n; j++)
      if (st->items[i].lease == w->set[j]) st->items[i].retry_at = at;
}

/* reply's owners (a check's {o, h: [..]} documents): is owner among them */
static int check_has(const bson_t *reply, const char *owner) {
  bson_iter_t docs, d, h;
  if (!ml_reply_batch(reply, &docs, NULL)) return 0;
  while (bson_iter_next(&docs)) {
    if (!BSON_ITER_HOLDS_DOCUMENT(&docs) || !bson_iter_recurse(&docs, &d)) continue;
    while (bson_iter_next(&d)) {
      if (!strcmp(bson_iter_key(&d), "o") && BSON_ITER_HOLDS_UTF8(&d) &&
          !strcmp(bson_iter_utf8(&d, NULL), owner))
        return 1;
      if (!strcmp(bson_iter_key(&d), "h") && BSON_ITER_HOLDS_ARRAY(&d) && bson_iter_recurse(&d, &h))
        while (bson_iter_next(&h))
          if (BSON_ITER_HOLDS_UTF8(&h) && !strcmp(bson_iter_utf8(&h, NULL), owner)) return 1;
    }
  }
  return 0;
}

/*
 * renew_mu held.  The outcome of st->work (begun at started): reply when
 * it ran (ok), else error.  Applies it to the leases and clears the work;
 * a check to run next is left in st->work's place by queueing it.
 */
static void engine_done(ml_renew *st, double started, int ok, const bson_t *reply,
                        const bson_error_t *error) {
  ml_work *w = &st->work;
  int64_t n = ok ? ml_parse_matched(reply) : -1;
  size_t i;
  (void)error;
  switch (w->kind) {
  case W_RELEASE:
    for (i = 0; i < w->n; i++) {
      ml_lease *l = w->set[i];
      pthread_mutex_lock(&l->mu);
      if (n == 0) ml_lease_set_lost(l);
      l->held = 0;              /* nobody waits for it: not sent is ended too */
      pthread_mutex_unlock(&l->mu);
    }
    if (n > 0) {
      st->released += (long)n;
      ml_lease_count_release(w->set[0], (long)n);   /* one kind per batch */
    }
    pthread_cond_broadcast(&st->done);
    break;
  case W_EXTEND: {
    (void)ml_lease_extend_done(w->set[0], n, w->ttl, started);
    if (n > 0) st->renewals++;
    else if (n < 0) {
      st->failures++;
      ml_lease_renewal_failed(w->set[0]);
      retry_later(st, w, ml_monotonic() + retry_delay(w->ttl));
    }
    break;
  }
  case W_RENEW:
  case W_DOC_RENEW: {
    size_t expect = w->kind == W_RENEW ? w->docs : w->n;
    int64_t min_ttl = INT64_MAX;
    st->batches++;
    if (n < 0) {
      st->failures++;
      for (i = 0; i < w->n; i++) {
        if (w->set[i]->ttl_ms < min_ttl) min_ttl = w->set[i]->ttl_ms;
        ml_lease_renewal_failed(w->set[i]);
      }
      retry_later(st, w, ml_monotonic() + retry_delay(min_ttl));
      break;
    }
    /* every lease of the batch was renewed when it matched as many
     * documents as the batch has (leases added meanwhile may have matched
     * too) */
    if ((size_t)n == expect + w->added || (w->added == 0 && (size_t)n == expect)) {
      for (i = 0; i < w->n; i++) {
        ml_lease *l = w->set[i];
        pthread_mutex_lock(&l->mu);
        renewed(l, started);
        pthread_mutex_unlock(&l->mu);
      }
      st->renewals += (long)w->n;
      break;
    }
    if (w->kind == W_DOC_RENEW) {
      /* which is lost: each is renewed by itself, once */
      size_t j;
      for (j = 0; j < st->n; j++)
        for (i = 0; i < w->n; i++)
          if (st->items[j].lease == w->set[i]) st->items[j].alone = 1;
      st->due_at = 0;
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
      w->kind = W_CHECK;
      w->set = set;
      w->n = cnt;
      w->cap = cap;
      w->started = started;
      w->id = ++st->seq;
      ml_build_renew_check(&w->op, set[0]->db, set[0]->coll, st->keeper);
      w->has_op = 1;
      st->checks++;
      return;                   /* in flight: the caller hands it out */
    }
  }
  case W_CHECK:
    if (n < 0 && !ok) {
      /* unknown: the next renewal (due at once) asks again */
      st->failures++;
      for (i = 0; i < w->n; i++) ml_lease_renewal_failed(w->set[i]);
      break;
    }
    for (i = 0; i < w->n; i++) {
      ml_lease *l = w->set[i];
      int alive = check_has(reply, l->owner);
      pthread_mutex_lock(&l->mu);
      if (alive) renewed(l, w->started);
      else not_renewed(l);
      pthread_mutex_unlock(&l->mu);
      if (alive) st->renewals++;
    }
    break;
  case W_NONE:
    break;
  }
  work_clear(w);
  st->due_at = 0;               /* look at every item again */
}

/* ---- the plain adapter: a thread --------------------------------------- */

static void wait_until(pthread_cond_t *cv, double when) {
  struct timespec ts = ml_timespec(when);
  pthread_cond_timedwait(cv, &renew_mu, &ts);
}

/*
 * A server selection for writes, for a waiter that found no writable server
 * among the monitors' descriptions (private.lua, await_server).  After a
 * connection error libmongoc marks the server unknown, and its monitor
 * looks again only after heartbeatFrequencyMS (10 s by default) unless a
 * selection asks for a check, which this one does (the monitor then checks
 * within minHeartbeatFrequencyMS, 500 ms).  It holds this thread until a
 * server is found or serverSelectionTimeoutMS passes; the description of
 * an unknown server carries no id to send to directly
 * (mongoc_client_get_server_descriptions leaves unknown servers out).
 */
static void do_scan(mongoc_client_t *mc) {
  bson_error_t err;
  mongoc_server_description_t *sd = mongoc_client_select_server(mc, true, NULL, &err);
  if (sd) mongoc_server_description_destroy(sd);
}

static void *renew_main(void *arg) {
  ml_renew *st = (ml_renew *)arg;
  mongoc_client_t *mc = NULL;
  double wake;

  pthread_mutex_lock(&renew_mu);
  for (;;) {
    double now = ml_monotonic();
    int has_work = st->work.kind != W_NONE;
    if (!mc && (st->n || st->nrel || st->scan || has_work)) {
      /* try_pop: a pool exhausted by the Lua side must not block close */
      pthread_mutex_unlock(&renew_mu);
      mc = mongoc_client_pool_try_pop(st->pool);
      pthread_mutex_lock(&renew_mu);
    }
    if (mc && (has_work || engine_next(st, now, &st->work, &wake))) {
      bson_t reply;
      bson_error_t err;
      double started = ml_monotonic();
      int ok;
      /* only this thread changes st->work's op (the leases keep its db and
       * coll alive) */
      pthread_mutex_unlock(&renew_mu);
      ml_obs_command(st->c);
      ok = ml_run(mc, st->c->wc, &st->work.op, &reply, &err);
      pthread_mutex_lock(&renew_mu);
      engine_done(st, started, ok, &reply, &err);
      bson_destroy(&reply);
      continue;
    }
    if (st->scan && mc && !st->stop) {
      st->scan = 0;
      st->scanning = 1;
      pthread_mutex_unlock(&renew_mu);
      do_scan(mc);
      pthread_mutex_lock(&renew_mu);
      st->scanning = 0;
      continue;
    }
    if (st->stop) {
      /* no connection for the releases left: those leases expire */
      while (st->n) item_drop(st, st->n - 1);
      while (st->nrel) ml_lease_unref(st->rel[--st->nrel]);
      if (st->work.kind != W_NONE) work_clear(&st->work);
      pthread_cond_broadcast(&st->done);
      break;
    }
    if (!mc && (st->n || st->nrel || st->scan)) wake = now + 0.1;   /* no connection yet */
    else if (!mc) wake = now + 3600;
    st->wake_at = wake;
    wait_until(&st->cv, wake);
    st->wake_at = 0;
  }
  {
    ml_orphan *o = st->orphan;
    pthread_mutex_unlock(&renew_mu);
    if (mc) mongoc_client_pool_push(st->pool, mc);
    if (o) {
      /* detached by close: nobody else sees this state any more */
      pthread_cond_destroy(&st->cv);
      pthread_cond_destroy(&st->done);
      free(st->items);
      free(st->rel);
      free(st);
      ml_orphan_drop(o);
    }
  }
  return NULL;
}

/* ---- states ------------------------------------------------------------ */

/*
 * renew_mu held.  c's state in this process, made (and its thread started,
 * unless c is external) when missing; NULL when it cannot be.
 */
static ml_renew *state_get(ml_client *c, mongoc_client_pool_t *pool) {
  ml_renew *st = (ml_renew *)c->renew_state;
  pthread_condattr_t ca;
  sigset_t all, old;
  int rc;

  if (st && st->pid == getpid() && (st->external || st->pool == pool)) return st;
  /* a state from another process (or pool) is abandoned, not freed */
  st = (ml_renew *)calloc(1, sizeof *st);
  if (!st) return NULL;
  st->c = c;
  st->pool = pool;
  st->pid = getpid();
  st->external = c->external;
  {
    char r[33];
    if (ml_random_owner(r)) memcpy(st->keeper, r, 16);
    else memcpy(st->keeper, "0000000000000000", 16);
    st->keeper[16] = '\0';
  }
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&st->cv, &ca);
  pthread_cond_init(&st->done, &ca);
  pthread_condattr_destroy(&ca);
  if (!st->external) {
    /* the thread takes no signal: they belong to the application */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&st->thread, NULL, renew_main, st);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
      pthread_cond_destroy(&st->cv);
      pthread_cond_destroy(&st->done);
      free(st);
      return NULL;
    }
  }
  st->next = states;
  states = st;
  c->renew_state = st;
  c->on_close = ml_bg_on_close;
  return st;
}

/* renew_mu held: c's state for a call from Lua (made when missing) */
static ml_renew *state_of(lua_State *L, ml_client *c) {
  mongoc_client_pool_t *pool = c->external ? NULL : ml_client_pool(L, c);   /* raises if closed */
  if (c->external && c->closed) luaL_error(L, "client is closed");
  pthread_once(&atfork_once, install_atfork);
  return state_get(c, pool);
}

/* renew_mu held: wakes the thread when it sleeps past `due` */
static void poke(ml_renew *st, double due) {
  if (due < st->due_at) st->due_at = due;
  if (!st->external && due < st->wake_at) pthread_cond_signal(&st->cv);
}

const char *ml_renew_keeper(lua_State *L, ml_client *c, char out[17]) {
  ml_renew *st;
  pthread_mutex_lock(&renew_mu);
  st = state_of(L, c);
  if (st) memcpy(out, st->keeper, 17);
  pthread_mutex_unlock(&renew_mu);
  return st ? out : NULL;
}

int ml_renew_add(lua_State *L, ml_client *c, ml_lease *l) {
  ml_renew *st;
  size_t i;
  int ok = 0;
  pthread_mutex_lock(&renew_mu);
  st = state_of(L, c);
  if (st) {
    for (i = 0; i < st->n; i++)
      if (st->items[i].lease == l) break;
    if (i < st->n) {
      ok = 1;
    } else if (grow((void **)&st->items, &st->cap, st->n + 1, sizeof *st->items)) {
      double due;
      memset(&st->items[st->n], 0, sizeof st->items[st->n]);
      st->items[st->n++].lease = l;
      pthread_mutex_lock(&l->mu);
      l->refs++;
      due = renew_at(l);
      if (l->deadline < due) due = l->deadline;
      pthread_mutex_unlock(&l->mu);
      /* a renewal in flight in l's collection may match l's document */
      if (st->work.kind == W_RENEW && named_kind(l) && same_coll(l, st->work.set[0]))
        st->work.added++;
      poke(st, due);
      ok = 1;
    }
  }
  pthread_mutex_unlock(&renew_mu);
  if (!ok) {
    pthread_mutex_lock(&l->mu);
    l->renew = 0;
    pthread_mutex_unlock(&l->mu);
  }
  return ok;
}

int ml_renew_scan(lua_State *L, ml_client *c) {
  ml_renew *st;
  if (c->external) return 0;
  pthread_mutex_lock(&renew_mu);
  st = state_of(L, c);
  if (st) {
    st->scan = 1;
    pthread_cond_signal(&st->cv);
  }
  pthread_mutex_unlock(&renew_mu);
  return st != NULL;
}

/*
 * ml_gc_handoff: a lease whose release nobody waits for (a collected
 * handle's, a lost reply's).  Takes over the caller's reference and queues
 * the release; returns 0 (the caller then releases synchronously, or gives
 * up) when this process cannot.
 */
static int renew_handoff(ml_client *c, ml_lease *l) {
  ml_renew *st;
  if (c->closed || l->pid != getpid()) return 0;
  if (!c->external && (!c->pool || c->pid != getpid())) return 0;
  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&renew_mu);
  st = state_get(c, c->pool);
  if (!st || !grow((void **)&st->rel, &st->caprel, st->nrel + 1, sizeof *st->rel)) {
    pthread_mutex_unlock(&renew_mu);
    return 0;
  }
  st->rel[st->nrel++] = l;
  pthread_mutex_lock(&l->mu);
  l->ending = 1;                /* its release is under way */
  pthread_mutex_unlock(&l->mu);
  if (!st->external) pthread_cond_signal(&st->cv);
  pthread_mutex_unlock(&renew_mu);
  return 1;
}

void ml_held_link(ml_client *c, ml_lease *l) {
  pthread_mutex_lock(&renew_mu);
  l->hc = c;
  l->hprev = NULL;
  l->hnext = c->held;
  if (c->held) c->held->hprev = l;
  c->held = l;
  if (!c->on_close) c->on_close = ml_bg_on_close;
  pthread_mutex_unlock(&renew_mu);
}

/* renew_mu held */
static void held_unlink_locked(ml_lease *l) {
  if (!l->hc) return;
  if (l->hprev) l->hprev->hnext = l->hnext;
  else l->hc->held = l->hnext;
  if (l->hnext) l->hnext->hprev = l->hprev;
  l->hc = NULL;
  l->hprev = l->hnext = NULL;
}

void ml_held_unlink(ml_lease *l) {
  pthread_mutex_lock(&renew_mu);
  held_unlink_locked(l);
  pthread_mutex_unlock(&renew_mu);
}

void ml_held_forget(ml_client *c) {
  pthread_mutex_lock(&renew_mu);
  while (c->held) held_unlink_locked(c->held);
  pthread_mutex_unlock(&renew_mu);
}

/*
 * renew_mu held.  A closing client's leases still held in this process go
 * to the release queue (sent in batches before the engine stops); every
 * lease leaves c's list.
 */
static void queue_held(ml_client *c, ml_renew *st) {
  while (c->held) {
    ml_lease *l = c->held;
    int take;
    held_unlink_locked(l);
    pthread_mutex_lock(&l->mu);
    take = st && l->held && !l->ending && l->pid == getpid();
    if (take) {
      l->ending = 1;
      l->refs++;
    }
    pthread_mutex_unlock(&l->mu);
    if (take) {
      if (grow((void **)&st->rel, &st->caprel, st->nrel + 1, sizeof *st->rel)) st->rel[st->nrel++] = l;
      else ml_lease_unref(l);
    }
  }
}

/* renew_mu held: takes st out of the process's states and off c */
static void state_unlink(ml_client *c, ml_renew *st) {
  ml_renew **p;
  for (p = &states; *p; p = &(*p)->next) {
    if (*p == st) {
      *p = st->next;
      break;
    }
  }
  c->renew_state = NULL;
}

static void state_free(ml_renew *st) {
  while (st->n) item_drop(st, st->n - 1);
  while (st->nrel) ml_lease_unref(st->rel[--st->nrel]);
  if (st->work.kind != W_NONE) work_clear(&st->work);
  pthread_cond_destroy(&st->cv);
  pthread_cond_destroy(&st->done);
  free(st->items);
  free(st->rel);
  free(st);
}

/* stops c's engine in this process, if any (pool still valid), after the
 * releases of what c's handles still hold are sent */
static void renew_stop(ml_client *c) {
  ml_renew *st;
  pthread_once(&atfork_once, install_atfork);
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (!c->external && c->pool && c->pid == getpid()) {
    int any = 0;
    ml_lease *l;
    for (l = c->held; l && !any; l = l->hnext) {
      pthread_mutex_lock(&l->mu);
      any = l->held && !l->ending && l->pid == getpid();
      pthread_mutex_unlock(&l->mu);
    }
    if (any && (!st || st->pid != getpid())) st = state_get(c, c->pool);
    queue_held(c, st && st->pid == getpid() ? st : NULL);
  } else {
    queue_held(c, NULL);
  }
  if (!st || st->pid != getpid()) {
    pthread_mutex_unlock(&renew_mu);
    return;
  }
  if (st->external) {
    state_unlink(c, st);
    state_free(st);
    pthread_mutex_unlock(&renew_mu);
    return;
  }
  st->stop = 1;
  pthread_cond_signal(&st->cv);
  if (st->scanning && !st->n && !st->nrel && (st->orphan = ml_orphan_take(c)) != NULL) {
    /* inside a server selection, which may wait for a server that is gone
     * up to serverSelectionTimeoutMS, with nothing left to release: close
     * does not wait for it.  The thread frees its state and drops its
     * reference to the pool when the selection returns. */
    state_unlink(c, st);
    pthread_detach(st->thread);
    pthread_mutex_unlock(&renew_mu);
    ml_pin_library();
    return;
  }
  pthread_mutex_unlock(&renew_mu);
  pthread_join(st->thread, NULL);
  pthread_mutex_lock(&renew_mu);
  state_unlink(c, st);
  state_free(st);
  pthread_mutex_unlock(&renew_mu);
}

/*
 * In this order: the renewal thread is joined (its connection is back in
 * the pool) and the client's own connection pushed before the streams
 * stop, because a stream in a getMore is detached and takes the pool with
 * it: the last such thread destroys it, and nothing of the pool may be
 * out then.
 */
void ml_bg_on_close(ml_client *c) {
  renew_stop(c);
  if (c->client) {
    mongoc_client_pool_push(c->pool, c->client);
    c->client = NULL;
  }
  ml_watch_stop(c);
}

/* ---- the external adapter, seen from Lua ------------------------------- */

/* client:engine_next() -> id, op (a BSON op string, ops.c) | nil, seconds
 * until something may be due (math.huge: nothing held) */
int ml_m_engine_next(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  ml_renew *st;
  double now = ml_monotonic(), wake = now + 3600;
  int has = 0;
  luaL_argcheck(L, c->external, 1, "the client's engine runs on its own thread");
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (st && st->pid == getpid()) {
    if (st->work.kind == W_NONE) has = engine_next(st, now, &st->work, &wake);
    else if (!st->work.handed) has = 1;       /* a check engine_done queued */
    else wake = now + 1;                      /* in flight */
    if (has) {
      st->work.handed = 1;
      lua_pushinteger(L, (lua_Integer)st->work.id);
      ml_push_op(L, &st->work.op);
      pthread_mutex_unlock(&renew_mu);
      return 2;
    }
    if (st->n == 0 && st->nrel == 0 && st->work.kind == W_NONE) wake = HUGE_VAL;
  } else {
    wake = HUGE_VAL;
  }
  pthread_mutex_unlock(&renew_mu);
  lua_pushnil(L);
  lua_pushnumber(L, wake == HUGE_VAL ? HUGE_VAL : (wake > now ? wake - now : 0));
  return 2;
}

/* client:engine_done(id, started, reply, err, code) -> true: the outcome of
 * the command engine_next gave (reply a BSON string, or nil and the error) */
int ml_m_engine_done(lua_State *L) {
  ml_client *c = ml_checkclient(L, 1);
  long id = (long)luaL_checkinteger(L, 2);
  double started = luaL_checknumber(L, 3);
  size_t len = 0;
  const char *bytes = lua_type(L, 4) == LUA_TSTRING ? lua_tolstring(L, 4, &len) : NULL;
  ml_renew *st;
  bson_t reply;
  bson_error_t err;
  int ok = 0;
  memset(&err, 0, sizeof err);
  if (bytes) ok = bson_init_static(&reply, (const uint8_t *)bytes, len);
  if (!ok) {
    bson_init(&reply);
    bson_set_error(&err, MONGOC_ERROR_SERVER, (uint32_t)luaL_optinteger(L, 6, 0), "%s",
                   luaL_optstring(L, 5, "no reply"));
  }
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (st && st->pid == getpid() && st->work.kind != W_NONE && st->work.id == id) {
    engine_done(st, started, ok, &reply, &err);
  }
  pthread_mutex_unlock(&renew_mu);
  bson_destroy(&reply);
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- what the specs read (mongolock.testing) -------------------------- */

void ml_renew_stats(ml_client *c, ml_renew_counts *out) {
  ml_renew *st;
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&renew_mu);
  st = (ml_renew *)c->renew_state;
  if (st && st->pid == getpid()) {
    out->running = 1;
    out->leases = (long)st->n;
    out->renewals = st->renewals;
    out->failures = st->failures;
    out->lost = st->lost;
    out->released = st->released;
    out->batches = st->batches;
    out->checks = st->checks;
  }
  pthread_mutex_unlock(&renew_mu);
}

int ml_renew_flush(ml_client *c, double timeout) {
  double until = ml_monotonic() + timeout;
  int pending = 0;
  pthread_mutex_lock(&renew_mu);
  for (;;) {
    ml_renew *st = (ml_renew *)c->renew_state;
    pending = 0;
    if (!st || st->pid != getpid()) break;
    pending = st->nrel > 0 || st->work.kind == W_RELEASE;
    if (!pending || ml_monotonic() >= until) break;
    if (st->external) {
      pthread_mutex_unlock(&renew_mu);
      ml_sleep(0.005);
      pthread_mutex_lock(&renew_mu);
    } else {
      wait_until(&st->done, until);
    }
  }
  pthread_mutex_unlock(&renew_mu);
  return !pending;
}

void ml_renew_init(void) {
  pthread_once(&atfork_once, install_atfork);
  ml_gc_handoff = renew_handoff;
}
