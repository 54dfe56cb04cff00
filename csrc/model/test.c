/*
 * The plain C parts of the core, linked alone and driven through their
 * public functions (as hiredis's test.c drives read.c): the lease engine's
 * decisions (engine.h), the change stream's machine (stream.h), each lease
 * kind's commands (lease.h) and the check reply's parser (protocol.h).
 * Links engine.c, lease.c, obs.c, stream.c, protocol.c and
 * protocol_shared.c with libbson and pthreads: no Lua, no libmongoc, no
 * server.  Time is what each test says it is (the engine and the stream
 * read no clock).  Prints TAP; exits 1 when a test failed.
 *
 *   make build/test/model && build/test/model
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine.h"
#include "lease.h"
#include "protocol.h"
#include "protocol_shared.h"
#include "stream.h"
#include "tap.h"

static int near(double a, double b) {
  return a - b < 1e-9 && b - a < 1e-9;
}

#define KEEPER "0123456789abcdef"
#define OWNER_A "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
#define OWNER_B "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
#define OWNER_C "cccccccccccccccccccccccccccccccc"

/* a lease of kind on {_id: name} in db.coll, won at started */
static ml_lease *lease(ml_kind kind, const char *coll, const char *name, const char *owner,
                       int64_t ttl_ms, double started, int renew) {
  ml_lease_spec s;
  ml_lease *l;
  bson_t id = BSON_INITIALIZER;
  int shares = kind == ML_KIND_SHARED || kind == ML_KIND_PERMIT;
  BSON_APPEND_UTF8(&id, "_id", name);
  ml_lease_spec_named(&s, kind == ML_KIND_DOCUMENT ? ML_KIND_NAMED : kind, "db", coll, &id,
                      shares ? ML_F_HOLDERS : ML_F_OWNER, owner, ttl_ms);
  if (kind == ML_KIND_DOCUMENT) {
    s.kind = kind;
    s.ref.queued = 0;
    s.ref.owner_field = "lockedBy";
    s.ref.time_field = "lockedAt";
    s.ref.time_mode = ML_TIME_LOCKED_AT;
  }
  s.started = started;
  s.renew = renew;
  l = ml_lease_new(&s);
  bson_destroy(&id);
  return l;
}

/* the op's command as relaxed JSON: does it contain text */
static int cmd_has(const ml_op *op, const char *text) {
  char *json = bson_as_relaxed_extended_json(&op->cmd, NULL);
  int has = json && strstr(json, text) != NULL;
  bson_free(json);
  return has;
}

/* the command's name (its first key) */
static int cmd_is(const ml_op *op, const char *name) {
  bson_iter_t it;
  return bson_iter_init(&it, &op->cmd) && bson_iter_next(&it) && !strcmp(bson_iter_key(&it), name);
}

static void reply_n(bson_t *reply, int n) {
  bson_init(reply);
  BSON_APPEND_INT32(reply, "n", n);
  BSON_APPEND_INT32(reply, "ok", 1);
}

static void an_error(bson_error_t *e, const char *msg) {
  memset(e, 0, sizeof *e);
  bson_set_error(e, 1, 2, "%s", msg);
}

/* ---- the lease engine ---------------------------------------------------- */

static void engine_init(ml_engine *e) {
  memset(e, 0, sizeof *e);
  memcpy(e->keeper, KEEPER, sizeof e->keeper);
}

static void test_engine_renewal(void) {
  ml_engine e;
  ml_lease *l[3];
  double due, wake;
  bson_t reply;
  bson_error_t err;
  int i, has, all;
  engine_init(&e);
  /* ttl 3 s won at 0: deadline 2.995, renewal due at 0.995 */
  l[0] = lease(ML_KIND_NAMED, "locks", "a", OWNER_A, 3000, 0, 1);
  l[1] = lease(ML_KIND_NAMED, "locks", "b", OWNER_B, 3000, 0, 1);
  l[2] = lease(ML_KIND_SHARED, "locks", "c", OWNER_C, 3000, 0, 1);
  for (i = 0; i < 3; i++) ml_engine_add(&e, l[i], &due);
  ok(near(due, 2.995 - 2.0), "engine: a lease is due at two thirds of its ttl before its deadline");
  has = ml_engine_next(&e, 0.5, &wake);
  ok(!has && near(wake, 0.995), "engine: nothing to send before then, woken when due");
  has = ml_engine_next(&e, 1.0, &wake);
  ok(has && e.work.kind == ML_WORK_RENEW && e.work.n == 3,
     "engine: one renewal command for the three leases of the collection");
  ok(cmd_is(&e.work.op, "update") && cmd_has(&e.work.op, KEEPER),
     "engine: the renewal is an update by the keeper id");
  ok(!ml_engine_next(&e, 1.0, &wake), "engine: one command in flight at a time");
  reply_n(&reply, 3);
  ok(ml_engine_done(&e, 1.01, 1.0, 1, &reply, NULL) == 0, "engine: a renewal is not a release");
  bson_destroy(&reply);
  for (all = 1, i = 0; i < 3; i++) all = all && near(l[i]->deadline, 1.0 + 2.995) && l[i]->held;
  ok(all && e.renewals == 3 && e.batches == 1,
     "engine: each lease's deadline moves from the renewal's start");

  /* a failed renewal: retried after ttl/10 s (0.3), the leases kept */
  has = ml_engine_next(&e, 2.0, &wake);
  ok(has && e.work.kind == ML_WORK_RENEW, "engine: the next renewal is due after the first");
  an_error(&err, "no reply");
  bson_init(&reply);
  (void)ml_engine_done(&e, 2.05, 2.0, 0, &reply, &err);
  bson_destroy(&reply);
  ok(e.failures == 1 && l[0]->held && !l[0]->lost, "engine: a failed renewal keeps the leases");
  has = ml_engine_next(&e, 2.2, &wake);
  ok(!has && near(wake, 2.05 + 0.3), "engine: the retry waits ttl/10 from the failure's now");
  has = ml_engine_next(&e, 2.36, &wake);
  ok(has && e.work.kind == ML_WORK_RENEW && e.work.n == 3, "engine: then the renewal is sent again");
  bson_init(&reply);
  (void)ml_engine_done(&e, 2.4, 2.36, 0, &reply, &err);
  bson_destroy(&reply);

  /* the local deadline (3.995) passes: lost, dropped, counted */
  has = ml_engine_next(&e, 4.0, &wake);
  for (all = 1, i = 0; i < 3; i++) all = all && l[i]->lost && !l[i]->held;
  ok(!has && all && e.lost == 3 && e.n == 0, "engine: leases past their local deadline are lost");
  ml_engine_clear(&e, 1);
  for (i = 0; i < 3; i++) ml_lease_unref(l[i]);
}

/* a and b in a fresh engine e, their renewal sent at 1.0 and answered at
 * 1.1 with one document matched: ml_engine_done's answer */
static int renew_two_matching_one(ml_engine *e, ml_lease *a, ml_lease *b) {
  double due, wake;
  bson_t reply;
  int r;
  engine_init(e);
  ml_engine_add(e, a, &due);
  ml_engine_add(e, b, &due);
  (void)ml_engine_next(e, 1.0, &wake);
  reply_n(&reply, 1);
  r = ml_engine_done(e, 1.1, 1.0, 1, &reply, NULL);
  bson_destroy(&reply);
  return r;
}

static void test_engine_check(void) {
  ml_engine e;
  ml_lease *a, *b;
  bson_t reply, batch, doc, h;
  a = lease(ML_KIND_NAMED, "locks", "a", OWNER_A, 3000, 0, 1);
  b = lease(ML_KIND_NAMED, "locks", "b", OWNER_B, 3000, 0, 1);
  ok(renew_two_matching_one(&e, a, b) == 0 && e.work.kind == ML_WORK_CHECK && e.checks == 1,
     "engine: a renewal that matched fewer leaves a check in flight");
  ok(cmd_is(&e.work.op, "aggregate") && cmd_has(&e.work.op, KEEPER),
     "engine: the check is an aggregate over the keeper's documents");
  /* the check's answer: a still holds, b does not */
  bson_init(&reply);
  BSON_APPEND_DOCUMENT_BEGIN(&reply, "cursor", &doc);
  BSON_APPEND_INT64(&doc, "id", 0);
  BSON_APPEND_ARRAY_BEGIN(&doc, "firstBatch", &batch);
  {
    bson_t d;
    BSON_APPEND_DOCUMENT_BEGIN(&batch, "0", &d);
    BSON_APPEND_UTF8(&d, "o", OWNER_A);
    BSON_APPEND_ARRAY_BEGIN(&d, "h", &h);
    bson_append_array_end(&d, &h);
    bson_append_document_end(&batch, &d);
  }
  bson_append_array_end(&doc, &batch);
  bson_append_document_end(&reply, &doc);
  BSON_APPEND_INT32(&reply, "ok", 1);
  (void)ml_engine_done(&e, 1.2, 1.1, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(a->held && near(a->deadline, 1.0 + 2.995) && !b->held && b->lost && e.work.kind == ML_WORK_NONE,
     "engine: the check renews the owner it found and loses the other");
  ml_engine_clear(&e, 1);
  ml_lease_unref(a);
  ml_lease_unref(b);
}

/* one document, two leases of this process: two permits of one semaphore
 * are both renewed when it matched; two exclusive leases (one taken over,
 * then the lock taken again) cannot both be, and a check follows */
static void test_engine_one_document(void) {
  ml_engine e;
  ml_lease *p1, *p2, *old, *again;
  p1 = lease(ML_KIND_PERMIT, "locks", "sem", OWNER_A, 3000, 0, 1);
  p2 = lease(ML_KIND_PERMIT, "locks", "sem", OWNER_B, 3000, 0, 1);
  ok(renew_two_matching_one(&e, p1, p2) == 0 && e.work.kind == ML_WORK_NONE && e.checks == 0 &&
     near(p1->deadline, 1.0 + 2.995) && near(p2->deadline, 1.0 + 2.995),
     "engine: two permits of one document are renewed by the one document it matched");
  ml_engine_clear(&e, 1);
  old = lease(ML_KIND_NAMED, "locks", "x", OWNER_A, 3000, 0, 1);
  again = lease(ML_KIND_NAMED, "locks", "x", OWNER_B, 3000, 0, 1);
  ok(renew_two_matching_one(&e, old, again) == 0 && e.work.kind == ML_WORK_CHECK && e.checks == 1,
     "engine: two exclusive leases of one document that matched once leave a check: one of them is lost");
  ml_engine_clear(&e, 1);
  ml_lease_unref(p1);
  ml_lease_unref(p2);
  ml_lease_unref(old);
  ml_lease_unref(again);
}

static void test_engine_release(void) {
  ml_engine e;
  ml_lease *l[3];
  double wake;
  bson_t reply;
  int i;
  engine_init(&e);
  l[0] = lease(ML_KIND_NAMED, "locks", "a", OWNER_A, 3000, 0, 0);
  l[1] = lease(ML_KIND_SHARED, "locks", "b", OWNER_B, 3000, 0, 0);
  l[2] = lease(ML_KIND_NAMED, "locks", "c", OWNER_C, 3000, 0, 0);
  for (i = 0; i < 3; i++) {
    l[i]->refs++;               /* the queue takes one over; this test keeps one */
    ml_engine_queue_release(&e, l[i]);
  }
  ok(ml_engine_next(&e, 0, &wake) && e.work.kind == ML_WORK_RELEASE && e.work.n == 2 &&
     e.work.set[0] == l[0] && e.work.set[1] == l[2] && e.nrel == 1,
     "engine: queued releases of one collection and kind are one command");
  ok(cmd_is(&e.work.op, "update") && cmd_has(&e.work.op, "$in") && cmd_has(&e.work.op, OWNER_A) &&
     cmd_has(&e.work.op, OWNER_C) && !cmd_has(&e.work.op, OWNER_B),
     "engine: the command releases the listed (_id, owner) pairs");
  ok(l[0]->ending && l[2]->ending && !l[1]->ending, "engine: the leases of the command are ending");
  reply_n(&reply, 2);
  ok(ml_engine_done(&e, 0.1, 0, 1, &reply, NULL) == 1 && e.released == 2 && !l[0]->held && !l[2]->held &&
     !l[0]->lost, "engine: its outcome releases them and says a release ended");
  bson_destroy(&reply);
  ok(ml_engine_next(&e, 0.1, &wake) && e.work.kind == ML_WORK_RELEASE && e.work.n == 1 &&
     e.work.set[0] == l[1] && cmd_has(&e.work.op, ML_F_HOLDERS),
     "engine: a share's release is a command of its own kind");
  reply_n(&reply, 0);
  (void)ml_engine_done(&e, 0.2, 0.1, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(!l[1]->held && l[1]->lost, "engine: a release that matched nothing finds the lease lost");
  ml_engine_clear(&e, 1);
  for (i = 0; i < 3; i++) ml_lease_unref(l[i]);
}

/* a lost reply's release (lease.redo) is sent again a second later, until
 * enough of them got a reply or one matched; a failed one does not count */
static void test_engine_release_redo(void) {
  ml_engine e;
  ml_lease *l;
  double wake;
  bson_t reply;
  bson_error_t err;
  engine_init(&e);
  memset(&err, 0, sizeof err);
  l = lease(ML_KIND_NAMED, "locks", "a", OWNER_A, 3000, 0, 0);
  l->redo = ML_RELEASE_REDO;
  l->refs++;
  ml_engine_queue_release(&e, l);
  ok(ml_engine_next(&e, 0, &wake) && e.work.kind == ML_WORK_RELEASE, "engine: a lost reply's release is sent");
  bson_init(&reply);
  (void)ml_engine_done(&e, 0.1, 0, 0, &reply, &err);   /* no reply */
  bson_destroy(&reply);
  ok(e.nrel == 1 && l->redo == ML_RELEASE_REDO && !ml_engine_next(&e, 0.5, &wake) && near(wake, 1.1),
     "engine: a failed one is sent again a second later");
  ok(ml_engine_next(&e, 1.2, &wake) && e.work.kind == ML_WORK_RELEASE, "engine: then sent again");
  reply_n(&reply, 0);
  (void)ml_engine_done(&e, 1.3, 1.2, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(e.nrel == 1 && l->redo == ML_RELEASE_REDO - 1, "engine: one that matched nothing is sent once more");
  ok(ml_engine_next(&e, 2.4, &wake) && e.work.kind == ML_WORK_RELEASE, "engine: a second later");
  reply_n(&reply, 1);
  (void)ml_engine_done(&e, 2.5, 2.4, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(e.nrel == 0 && l->redo == 0 && !ml_engine_next(&e, 5, &wake), "engine: one that matched ends it");
  ml_engine_clear(&e, 1);
  ml_lease_unref(l);
}

static void test_engine_documents(void) {
  ml_engine e;
  ml_lease *a, *b;
  double due, wake;
  bson_t reply;
  engine_init(&e);
  a = lease(ML_KIND_DOCUMENT, "jobs", "a", OWNER_A, 3000, 0, 1);
  b = lease(ML_KIND_DOCUMENT, "jobs", "b", OWNER_B, 3000, 0, 1);
  ml_engine_add(&e, a, &due);
  ml_engine_add(&e, b, &due);
  ok(ml_engine_next(&e, 1.0, &wake) && e.work.kind == ML_WORK_DOC_RENEW && e.work.n == 2 &&
     cmd_has(&e.work.op, "lockedBy") && cmd_has(&e.work.op, OWNER_A) && cmd_has(&e.work.op, OWNER_B),
     "engine: document locks of the same fields are renewed by one command of their _ids");
  reply_n(&reply, 1);
  (void)ml_engine_done(&e, 1.1, 1.0, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(ml_engine_next(&e, 1.1, &wake) && e.work.kind == ML_WORK_EXTEND && e.work.n == 1,
     "engine: after one matched fewer, each is extended by itself");
  ml_engine_clear(&e, 1);
  ml_lease_unref(a);
  ml_lease_unref(b);
}

/* ---- the lease's commands, per kind ---------------------------------------- */

static void test_lease_kinds(void) {
  ml_lease *n = lease(ML_KIND_NAMED, "locks", "a", OWNER_A, 3000, 0, 0);
  ml_lease *s = lease(ML_KIND_SHARED, "locks", "a", OWNER_B, 3000, 0, 0);
  ml_lease *p = lease(ML_KIND_PERMIT, "locks", "a", OWNER_C, 3000, 0, 0);
  ml_lease *d = lease(ML_KIND_DOCUMENT, "jobs", "a", OWNER_A, 3000, 0, 0);
  ml_op op;
  bson_t extra = BSON_INITIALIZER, reply;
  ok(!strcmp(ml_kind_of(ML_KIND_NAMED)->name, "named") && !strcmp(ml_kind_of(ML_KIND_DOCUMENT)->name,
     "document") &&
     !strcmp(ml_kind_of(ML_KIND_SHARED)->name, "shared") && !strcmp(ml_kind_of(ML_KIND_PERMIT)->name,
          "permit"),
     "lease: each kind's name");
  ml_lease_release_op(n, NULL, &op);
  ok(n->ending && cmd_is(&op, "update") && cmd_has(&op, OWNER_A) && cmd_has(&op, ML_F_QUEUE),
     "lease: a named lock's release hands it to the queue, the lease ending");
  ml_op_destroy(&op);
  ml_lease_release_op(s, NULL, &op);
  ok(cmd_has(&op, ML_F_HOLDERS) && cmd_has(&op, OWNER_B),
     "lease: a share's release pulls it from holders");
  ml_op_destroy(&op);
  BSON_APPEND_UTF8(&extra, "state", "done");
  ml_lease_release_op(d, &extra, &op);
  ok(cmd_has(&op, "lockedBy") && cmd_has(&op, "\"done\""),
     "lease: a document lock's release writes its changes");
  ml_op_destroy(&op);
  bson_destroy(&extra);
  ml_lease_extend_op(p, 7000, &op);
  ok(cmd_has(&op, ML_F_HOLDERS) && cmd_has(&op, "7000"),
     "lease: a permit's extend sets its entry's lease");
  ml_op_destroy(&op);
  ml_lease_extend_op(d, 7000, &op);
  ok(cmd_has(&op, "lockedAt") && cmd_has(&op, OWNER_A),
     "lease: a document lock's extend writes its fields");
  ml_op_destroy(&op);
  ok(!ml_kind_of(ML_KIND_NAMED)->changes && ml_kind_of(ML_KIND_DOCUMENT)->changes,
     "lease: only a document lock's release takes changes");
  ok(ml_lease_same_release(s, p) && !ml_lease_same_release(n, s) && !ml_lease_same_release(n, d),
     "lease: shares and permits are released together, not with named or document locks");
  ok(ml_lease_same_renewal(n, s) && !ml_lease_same_renewal(n, d),
     "lease: named kinds renew together by keeper");

  /* outcomes */
  ok(ml_lease_extend_done(p, 1, 7000, 10.0) == 1 && near(p->deadline, 10.0 + 7 * 0.999 - 0.002) &&
     p->ttl_ms == 7000,
     "lease: an extend that matched moves the deadline and the ttl");
  ok(ml_lease_extend_done(p, -1, 9000, 20.0) == -1 && p->ttl_ms == 7000 && p->held,
     "lease: an extend's error changes nothing");
  ok(ml_lease_extend_done(p, 0, 7000, 20.0) == 0 && p->lost && !p->held,
     "lease: an extend that matched nothing is a loss");
  bson_init(&reply);
  BSON_APPEND_INT32(&reply, "n", 1);
  BSON_APPEND_DOCUMENT(&reply, "writeConcernError", &extra);
  ok(ml_release_matched(0, &reply) == 1,
     "lease: a release with a write concern error says what it matched");
  bson_destroy(&reply);
  bson_init(&reply);
  ok(ml_release_matched(0, &reply) == -1, "lease: a release with no answer matched unknown");
  bson_destroy(&reply);
  ok(ml_lease_release_done(s, -1) == -1 && !s->ending && s->held,
     "lease: a release not made keeps the lease");
  ok(ml_lease_release_done(s, 1) == 1 && !s->held && !s->lost,
     "lease: a release that matched ends the lease");
  ml_lease_unref(n);
  ml_lease_unref(s);
  ml_lease_unref(p);
  ml_lease_unref(d);
}

static void test_check_parser(void) {
  bson_t reply = BSON_INITIALIZER, cur, batch, d, h;
  BSON_APPEND_DOCUMENT_BEGIN(&reply, "cursor", &cur);
  BSON_APPEND_ARRAY_BEGIN(&cur, "firstBatch", &batch);
  BSON_APPEND_DOCUMENT_BEGIN(&batch, "0", &d);
  BSON_APPEND_NULL(&d, "o");
  BSON_APPEND_ARRAY_BEGIN(&d, "h", &h);
  BSON_APPEND_UTF8(&h, "0", OWNER_B);
  bson_append_array_end(&d, &h);
  bson_append_document_end(&batch, &d);
  bson_append_array_end(&cur, &batch);
  bson_append_document_end(&reply, &cur);
  {
    ml_owners live;
    ok(ml_parse_check(&reply, &live) && ml_owners_has(&live, OWNER_B) && !ml_owners_has(&live, OWNER_A),
       "protocol: the check's reply lists a share's owner among h, not a missing one");
    ml_owners_free(&live);
  }
  bson_destroy(&reply);
}

/* a check after a batch of many leases: every owner named is found, in
 * o or in h, and none that is not */
static void test_check_many(void) {
  enum { N = 20000 };
  bson_t reply = BSON_INITIALIZER, cur, batch, d, h;
  ml_owners live, none;
  char owner[40], key[16];
  int i, found = 0, wrong = 0;
  BSON_APPEND_DOCUMENT_BEGIN(&reply, "cursor", &cur);
  BSON_APPEND_ARRAY_BEGIN(&cur, "firstBatch", &batch);
  for (i = 0; i < N; i++) {
    snprintf(key, sizeof key, "%d", i);
    snprintf(owner, sizeof owner, "owner-%07d", (i * 7919) % N);   /* not in order */
    BSON_APPEND_DOCUMENT_BEGIN(&batch, key, &d);
    if (i % 2) {
      BSON_APPEND_UTF8(&d, "o", owner);
      BSON_APPEND_ARRAY_BEGIN(&d, "h", &h);
    } else {
      BSON_APPEND_NULL(&d, "o");
      BSON_APPEND_ARRAY_BEGIN(&d, "h", &h);
      BSON_APPEND_UTF8(&h, "0", owner);
    }
    bson_append_array_end(&d, &h);
    bson_append_document_end(&batch, &d);
  }
  bson_append_array_end(&cur, &batch);
  bson_append_document_end(&reply, &cur);
  ok(ml_parse_check(&reply, &live) && live.n == N, "protocol: a check's reply of %d owners gives them all", N);
  for (i = 0; i < N; i++) {
    snprintf(owner, sizeof owner, "owner-%07d", i);
    found += ml_owners_has(&live, owner);
    snprintf(owner, sizeof owner, "owner-%07dx", i);
    wrong += ml_owners_has(&live, owner);
  }
  ok(found == N && wrong == 0, "protocol: each of them is found in it, and no other owner (%d, %d)", found, wrong);
  ml_owners_free(&live);
  bson_destroy(&reply);
  bson_init(&reply);
  ok(ml_parse_check(&reply, &none) && none.n == 0 && !ml_owners_has(&none, "owner-0000001"),
     "protocol: a reply without a batch names no owner");
  ml_owners_free(&none);
  bson_destroy(&reply);
}

/* ---- the change stream ------------------------------------------------------ */

static char *copy_str(const char *s) {
  char *p = (char *)malloc(strlen(s) + 1);
  if (p) strcpy(p, s);
  return p;
}

/* a stream machine of db.locks on the owner field, tagged KEEPER, that
 * starts at operation time (100, 1) and waits 1 s per getMore */
static ml_stream *stream_new(void) {
  ml_stream *s = (ml_stream *)calloc(1, sizeof *s);
  s->db = copy_str("db");
  s->coll = copy_str("locks");
  s->field = copy_str(ML_F_OWNER);
  memcpy(s->tag, KEEPER, 17);
  s->start_t = s->drop_t = 100;
  s->start_i = s->drop_i = 1;
  s->await_ms = 1000;
  return s;
}

static void test_stream(void) {
  ml_stream *s = stream_new();
  bson_t reply, cur, batch, ev, key, tok;
  bson_error_t err;
  double wake;
  int i, mine = 0;
  const watch_event *grant = NULL;
  s->state = ML_STREAM_STARTING;

  ok(ml_stream_next(s, 0, &wake) && s->op_kind == ML_STREAM_OP_OPEN && cmd_is(&s->op, "aggregate") &&
     cmd_has(&s->op, "startAtOperationTime"),
          "stream: the first command is the aggregate from the start time");
  bson_init(&reply);
  BSON_APPEND_DOCUMENT_BEGIN(&reply, "cursor", &cur);
  BSON_APPEND_INT64(&cur, "id", 42);
  BSON_APPEND_ARRAY_BEGIN(&cur, "firstBatch", &batch);
  BSON_APPEND_DOCUMENT_BEGIN(&batch, "0", &ev);
  BSON_APPEND_UTF8(&ev, "operationType", "update");
  BSON_APPEND_TIMESTAMP(&ev, "clusterTime", 101, 1);
  BSON_APPEND_DOCUMENT_BEGIN(&ev, "documentKey", &key);
  BSON_APPEND_UTF8(&key, "_id", "a");
  bson_append_document_end(&ev, &key);
  bson_append_document_end(&batch, &ev);
  bson_append_array_end(&cur, &batch);
  BSON_APPEND_DOCUMENT_BEGIN(&cur, "postBatchResumeToken", &tok);
  BSON_APPEND_UTF8(&tok, "_data", "R1");
  bson_append_document_end(&cur, &tok);
  bson_append_document_end(&reply, &cur);
  BSON_APPEND_INT32(&reply, "ok", 1);
  ml_stream_done(s, 0.1, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(s->state == ML_STREAM_RUNNING && s->open && s->cursor_id == 42 && s->events == 1,
     "stream: the aggregate's batch starts it running");
  bson_init(&key);
  BSON_APPEND_UTF8(&key, "k", "a");
  ok(ml_stream_seen(s, &key, NULL, 100, 1, &grant, &mine) == 1 &&
     ml_stream_seen(s, &key, NULL, 101, 1, &grant, &mine) == 0,
     "stream: a release after a waiter's time is seen, one before it is not");
  bson_destroy(&key);

  ok(!ml_stream_next(s, 0.2, &wake), "stream: no getMore while nobody waits");
  s->waiters = 1;
  ok(ml_stream_next(s, 0.2, &wake) && s->op_kind == ML_STREAM_OP_MORE && cmd_is(&s->op, "getMore"),
     "stream: a getMore while someone waits");
  an_error(&err, "boom");
  ml_stream_done(s, 0.3, 0, NULL, &err);
  ok(ml_stream_next(s, 0.3, &wake) && s->op_kind == ML_STREAM_OP_KILL && cmd_is(&s->op, "killCursors"),
     "stream: killCursors after a failed getMore");
  ml_stream_done(s, 0.35, 1, NULL, NULL);
  ok(!s->open && s->reopens == 1 && !ml_stream_next(s, 0.34, &wake) && near(wake, 0.3 + 0.05),
     "stream: it reopens after a pause");
  ok(ml_stream_next(s, wake, &wake) && s->op_kind == ML_STREAM_OP_OPEN && cmd_has(&s->op,
     "resumeAfter") &&
     cmd_has(&s->op, "R1"), "stream: the new aggregate resumes after the last batch's token");
  /* three more failures in a row: the fourth gives up */
  for (i = 0; i < 3; i++) {
    double now = 1.0 + i;
    if (s->op_kind == ML_STREAM_OP_NONE && !ml_stream_next(s, now, &wake)) break;
    ml_stream_done(s, now, 0, NULL, &err);
  }
  ok(i == 3 && s->state == ML_STREAM_FAILED && ml_stream_finished(s) && !strcmp(s->errmsg,
     "change stream: boom"),
     "stream: gives up after 4 failed calls in a row, with the last error");
  ml_stream_clear(s);
  free(s);
}

/* a getMore reply holding the events of evs (n of them), cursor 42 */
static void batch_reply(bson_t *reply, bson_t *const *evs, int n) {
  bson_t cur, batch;
  char k[12];
  int j;
  bson_init(reply);
  BSON_APPEND_DOCUMENT_BEGIN(reply, "cursor", &cur);
  BSON_APPEND_INT64(&cur, "id", 42);
  BSON_APPEND_ARRAY_BEGIN(&cur, "nextBatch", &batch);
  for (j = 0; j < n; j++) {
    bson_snprintf(k, sizeof k, "%d", j);
    BSON_APPEND_DOCUMENT(&batch, k, evs[j]);
  }
  bson_append_array_end(&cur, &batch);
  bson_append_document_end(reply, &cur);
  BSON_APPEND_INT32(reply, "ok", 1);
}

/* an update event of {_id: id} at (t, 1) with the string fields of kv
 * (key, value pairs, NULL value: null) as its updatedFields */
static bson_t *update_event(const char *id, uint32_t t, const char *const *kv, int n) {
  bson_t *ev = bson_new(), key, ud, uf;
  int j;
  BSON_APPEND_UTF8(ev, "operationType", "update");
  BSON_APPEND_TIMESTAMP(ev, "clusterTime", t, 1);
  BSON_APPEND_DOCUMENT_BEGIN(ev, "documentKey", &key);
  BSON_APPEND_UTF8(&key, "_id", id);
  bson_append_document_end(ev, &key);
  BSON_APPEND_DOCUMENT_BEGIN(ev, "updateDescription", &ud);
  BSON_APPEND_DOCUMENT_BEGIN(&ud, "updatedFields", &uf);
  for (j = 0; j < n; j++) {
    if (kv[2 * j + 1]) BSON_APPEND_UTF8(&uf, kv[2 * j], kv[2 * j + 1]);
    else BSON_APPEND_NULL(&uf, kv[2 * j]);
  }
  bson_append_document_end(&ud, &uf);
  bson_append_document_end(ev, &ud);
  return ev;
}

/* the holders' side of the machine: a write that ended a lease of this
 * process (lost with its tag) becomes a notice and wakes no waiter; a
 * forced release with nobody queued is both; another process's lost is
 * no notice; a delete is a notice for every lease of its key; a holder
 * keeps the getMores going without a waiter */
static void test_stream_holders(void) {
  ml_stream *s = stream_new();
  bson_t reply, key, *evs[4], del, dk;
  double wake;
  int mine = 0;
  const watch_event *grant = NULL;
  static const char *const takeover[] = {ML_F_OWNER, OWNER_B, ML_F_LOST, KEEPER OWNER_A};
  static const char *const forced[] = {ML_F_OWNER, NULL, ML_F_NEXT, NULL, ML_F_LOST, KEEPER OWNER_C};
  static const char *const other[] = {ML_F_OWNER, OWNER_A, ML_F_LOST, "fedcba9876543210" OWNER_B};
  s->state = ML_STREAM_RUNNING;
  s->open = 1;
  s->cursor_id = 42;
  s->idle_since = 0;

  ok(!ml_stream_next(s, 0.1, &wake), "holders: no getMore with neither a waiter nor a holder");
  s->holders = 1;
  ok(ml_stream_next(s, 0.1, &wake) && s->op_kind == ML_STREAM_OP_MORE,
     "holders: a getMore while a lease is held, without a waiter");
  ok(ml_stream_next(s, 20.0, &wake) == 0 && s->state == ML_STREAM_RUNNING,
     "holders: a stream with a getMore in flight is not ended");
  evs[0] = update_event("a", 101, takeover, 2);
  evs[1] = update_event("b", 102, forced, 3);
  evs[2] = update_event("c", 103, other, 2);
  bson_init(&del);
  BSON_APPEND_UTF8(&del, "operationType", "delete");
  BSON_APPEND_TIMESTAMP(&del, "clusterTime", 104, 1);
  BSON_APPEND_DOCUMENT_BEGIN(&del, "documentKey", &dk);
  BSON_APPEND_UTF8(&dk, "_id", "d");
  bson_append_document_end(&del, &dk);
  evs[3] = &del;
  batch_reply(&reply, evs, 4);
  ml_stream_done(s, 0.2, 1, &reply, NULL);
  bson_destroy(&reply);
  ok(s->nnotices == 3 && !strcmp(s->notices[0].owner, OWNER_A) && s->notices[0].t == 101 &&
     !strcmp(s->notices[1].owner, OWNER_C) && s->notices[2].owner[0] == '\0' &&
     s->notices[2].t == 104,
     "holders: a takeover and a forced release of this process's leases and a delete are notices");
  bson_init(&key);
  BSON_APPEND_UTF8(&key, "k", "a");
  ok(ml_stream_seen(s, &key, NULL, 100, 1, &grant, &mine) == 0,
     "holders: the takeover wakes no waiter of its document");
  bson_reinit(&key);
  BSON_APPEND_UTF8(&key, "k", "b");
  ok(ml_stream_seen(s, &key, NULL, 100, 1, &grant, &mine) == 1,
     "holders: the forced release wakes its waiters too");
  bson_reinit(&key);
  BSON_APPEND_UTF8(&key, "k", "c");
  ok(ml_stream_seen(s, &key, NULL, 100, 1, &grant, &mine) == 1,
     "holders: another process's lost is no notice (an event passed otherwise wakes as before)");
  bson_reinit(&key);
  BSON_APPEND_UTF8(&key, "k", "d");
  ok(ml_stream_seen(s, &key, NULL, 100, 1, &grant, &mine) == 1, "holders: a delete wakes as before");
  bson_destroy(&key);
  ml_stream_notices_clear(s);
  ok(s->nnotices == 0 && s->noticed == 3, "holders: notices taken are cleared");
  s->holders = 0;
  ok(!ml_stream_next(s, 0.3, &wake) && ml_stream_next(s, 11.0, &wake) &&
     s->op_kind == ML_STREAM_OP_KILL,
     "holders: without a holder or a waiter it ends when idle");
  bson_destroy(evs[0]);
  bson_destroy(evs[1]);
  bson_destroy(evs[2]);
  bson_destroy(&del);
  ml_stream_clear(s);
  free(s);
}

/* a waiter's acquire built from the templates is the command a fresh
 * build gives, byte for byte, for every kind of attempt */
static void test_acquire_templates(void) {
  static const char *const waiters[] = {"0123456789abcdef0123456789abcdef",
                                        "ffffffffffffffffffffffffffffffff"};
  int i, v, k;
  /* k < 8: the settings change at every build (the thread's queue stage
   * is built again); k < 16: they stay while the waiter changes (it is
   * copied) */
  /* k = 16, 17: an app name that is the template's place holder itself
   * (the stage is built for each waiter) */
  for (k = 0; k < 18; k++) {
    i = k < 8 ? k / 4 : k % 2;
    v = k < 8 ? k % 4 : k < 16 ? (k - 8) / 2 : 2;
    {
      ml_acquire_args a;
      ml_op t, f;
      memset(&a, 0, sizeof a);
      a.db = "db";
      a.coll = "locks";
      a.name = "n";
      a.owner = waiters[i];
      a.waiter = waiters[i];
      a.ttl_ms = 30000 + v;
      a.host = "h";
      a.pid = 42;
      a.tag = "0011223344556677";
      a.queue_ms = 5000;
      a.polling = v & 1;
      a.app = k >= 16 ? "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~" : v & 2 ? "app" : NULL;
      a.keeper = v & 2 ? "0011223344556677" : NULL;
      a.htag = v & 1 ? "0011223344556677" : NULL;
      a.value = v == 3 ? "v" : NULL;
      a.delay_ms = v == 2 ? 100 : 0;
      ml_acquire_fresh = 0;
      ml_build_acquire(&t, &a);
      ml_acquire_fresh = 1;
      ml_build_acquire(&f, &a);
      ml_acquire_fresh = 0;
      ok(t.cmd.len == f.cmd.len && !memcmp(bson_get_data(&t.cmd), bson_get_data(&f.cmd), f.cmd.len),
         "acquire: waiter %d, variant %d (%s): the templates' command is the fresh build's", i, v,
         k < 8 ? "settings changed" : k < 16 ? "same settings" : "app name as the place holder");
      ml_op_destroy(&t);
      ml_op_destroy(&f);
    }
  }
}

/* a try's acquire, and a waiter's with an owner of its own, copied from
 * the thread's pipeline are the fresh builds, settings changing or not */
static void test_acquire_copies(void) {
  static const char *const ids[] = {"0123456789abcdef0123456789abcdef", "ffffffffffffffffffffffffffffffff",
                                    "00000000000000001111111111111111"};
  int k;
  for (k = 0; k < 12; k++) {
    ml_acquire_args a;
    ml_op t, f;
    int waiter = k % 3 != 0, same = k >= 6;
    memset(&a, 0, sizeof a);
    a.db = "db";
    a.coll = "locks";
    a.name = k & 1 ? "n" : "another";
    a.owner = ids[k % 3];
    a.waiter = waiter ? ids[(k + 1) % 3] : NULL;
    a.ttl_ms = same ? 1000 : 2000 + k;
    a.host = "h";
    a.pid = 42;
    a.tag = "0011223344556677";
    a.queue_ms = 5000;
    a.app = same ? "app" : k & 1 ? "x" : NULL;
    ml_acquire_fresh = 0;
    ml_build_acquire(&t, &a);
    ml_acquire_fresh = 1;
    ml_build_acquire(&f, &a);
    ml_acquire_fresh = 0;
    ok(t.cmd.len == f.cmd.len && !memcmp(bson_get_data(&t.cmd), bson_get_data(&f.cmd), f.cmd.len),
       "acquire: %s, owner %d, %s: the copy's command is the fresh build's", waiter ? "a waiter" : "a try",
       k % 3, same ? "same settings" : "settings changed");
    ml_op_destroy(&t);
    ml_op_destroy(&f);
  }
}

/* a process's first command is a try's acquire, copied (the constant
 * parts are made by that call): it builds (a child, before any other
 * build of this program made them) */
static void test_acquire_first(void) {
  pid_t pid = fork();
  int status = -1;
  if (pid == 0) {
    ml_acquire_args a;
    ml_op op;
    memset(&a, 0, sizeof a);
    a.db = "db";
    a.coll = "locks";
    a.name = "n";
    a.owner = "0123456789abcdef0123456789abcdef";
    a.ttl_ms = 1000;
    a.host = "h";
    a.tag = "0011223344556677";
    ml_build_acquire(&op, &a);
    _exit(op.cmd.len > 0 ? 0 : 1);
  }
  if (pid > 0) waitpid(pid, &status, 0);
  ok(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
     "acquire: a process's first build, a try's copy, builds (wait status %d)", status);
}

int main(void) {
  test_acquire_first();
  test_engine_renewal();
  test_engine_check();
  test_engine_one_document();
  test_engine_release();
  test_engine_release_redo();
  test_engine_documents();
  test_lease_kinds();
  test_check_parser();
  test_check_many();
  test_stream();
  test_stream_holders();
  test_acquire_templates();
  test_acquire_copies();
  return tap_end();
}
