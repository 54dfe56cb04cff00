/*
 * A change stream's state machine (stream.h): the ring and the matching of
 * waiters, and which command the stream sends next, as plain C over the
 * protocol's builders and parsers; no Lua, no I/O, no clock (each call is
 * given now).  Includes stream.h, protocol.h, libbson and the C library
 * only.  watch.c describes what a stream is for and runs it, serialising
 * every call on one stream.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "stream.h"

/* session keys made (atomic: the streams of watch.c, serialised by its
 * mutex, and views.c's, each run by its own reader, count here) */
static unsigned long openings;

int ml_ts_after(uint32_t t1, uint32_t i1, uint32_t t2, uint32_t i2) {
  return t1 > t2 || (t1 == t2 && i1 > i2);
}

/* ---- the ring ---------------------------------------------------------- */

/* appends an event (key may be NULL: wakes everyone; next
 * NULL or "": wakes every waiter of key); the caller wakes its waiters */
static void record(ml_stream *s, const uint8_t *key, size_t keylen, const ml_event *ev) {
  const char *next = ev->next;
  watch_event *e = &s->ring[s->seq % ML_RING];
  if (s->seq >= ML_RING) {
    if (ml_ts_after(e->t, e->i, s->drop_t, s->drop_i)) {
      s->drop_t = e->t;
      s->drop_i = e->i;
    }
    free(e->key);
  }
  e->key = NULL;
  e->keylen = 0;
  e->next[0] = '\0';
  e->owner[0] = '\0';
  if (next && strlen(next) == 48) {
    memcpy(e->next, next, 49);
    memcpy(e->owner, ev->owner, 33);
    e->token = ev->token;
  }
  if (key) {
    e->key = (uint8_t *)malloc(keylen);
    if (e->key) {
      memcpy(e->key, key, keylen);
      e->keylen = keylen;
    }
    /* out of memory: recorded as "any", which wakes too many, never too few */
  }
  e->t = ev->t;
  e->i = ev->i;
  s->seq++;
  s->events++;
}

/* an event that ended a lease of this process (lost names it, or the
 * document was deleted), kept for the holders until watch.c takes it */
static void notice(ml_stream *s, const uint8_t *key, size_t keylen, const ml_event *ev) {
  ml_notice *n;
  s->noticed++;
  if (s->nnotices >= ML_NOTICES) return;      /* the renewal finds it */
  n = &s->notices[s->nnotices];
  n->key = (uint8_t *)malloc(keylen);
  if (!n->key) return;
  memcpy(n->key, key, keylen);
  n->keylen = keylen;
  memcpy(n->owner, ev->lost, 33);
  n->t = ev->t;
  n->i = ev->i;
  s->nnotices++;
}

void ml_stream_notices_clear(ml_stream *s) {
  int k;
  for (k = 0; k < s->nnotices; k++) free(s->notices[k].key);
  s->nnotices = 0;
}

static void event_from(ml_stream *s, const bson_t *doc) {
  ml_event ev;
  bson_t key;
  ml_parse_event(doc, s->tag, &ev);
  if (ev.has_key) {
    bson_init(&key);
    bson_append_iter(&key, "k", 1, &ev.key);
    if (ev.lost[0] || ev.deleted) notice(s, bson_get_data(&key), key.len, &ev);
    if (ev.wakes) record(s, bson_get_data(&key), key.len, &ev);
    bson_destroy(&key);
  } else {
    record(s, NULL, 0, &ev);
  }
}


/* ---- the machine ------------------------------------------------------- */

void ml_stream_fail(ml_stream *s, const bson_error_t *e, double now) {
  s->state = ML_STREAM_FAILED;
  s->failed_at = now;
  bson_snprintf(s->errmsg, sizeof s->errmsg, "change stream: %s",
                e->message[0] ? e->message : "failed");
  s->errcode = e->code;
}

/* a batch (the aggregate's or a getMore's) into the ring;
 * 0 when the reply holds none */
static int take_batch(ml_stream *s, const bson_t *reply) {
  bson_iter_t docs;
  int64_t id = 0;
  const uint8_t *data;
  uint32_t len;
  bson_t doc;
  if (!ml_reply_batch(reply, &docs, &id)) return 0;
  while (ml_batch_next(&docs, &doc)) event_from(s, &doc);
  s->cursor_id = id;
  if (ml_reply_resume_token(reply, &data, &len)) {
    if (s->resume) bson_destroy(s->resume);
    s->resume = bson_new_from_data(data, len);
  }
  return 1;
}

/* a stream that ended (idle, closed, failed) and has
 * nothing left to send */
int ml_stream_finished(const ml_stream *s) {
  return !s->open && !s->op_kind &&
         (s->stop || s->state == ML_STREAM_FAILED || s->state == ML_STREAM_DONE);
}

/*
 * The next op of s (built into s->op, s->op_kind set), or
 * 0 with *wake the time something may be due (HUGE_VAL: nothing, the
 * stream is finished or waits for its op in flight).
 */
int ml_stream_next(ml_stream *s, double now, double *wake) {
  int ending = s->stop || s->state == ML_STREAM_FAILED || s->state == ML_STREAM_DONE;
  *wake = HUGE_VAL;
  if (s->op_kind) return 0;
  if (!ending && s->open && !s->stale && s->waiters == 0 && s->holders == 0 &&
      now >= s->polled_until) {
    /* nobody waits or holds: no getMore (events queue in the server's
     * cursor and are read when a waiter comes); ended when idle */
    if (now - s->idle_since <= ML_STREAM_IDLE) {
      *wake = s->idle_since + ML_STREAM_IDLE + 0.01;
      return 0;
    }
    s->state = ML_STREAM_DONE;
    ending = 1;
  }
  if (s->open && (ending || s->stale)) {
    ml_build_killcursors(&s->op, s->db, s->coll, s->cursor_id);
    s->op_kind = ML_STREAM_OP_KILL;
  } else if (s->open) {
    ml_build_getmore(&s->op, s->db, s->coll, s->cursor_id, s->await_ms);
    s->op_kind = ML_STREAM_OP_MORE;
  } else if (ending) {
    return 0;
  } else if (now < s->retry_at) {
    *wake = s->retry_at;
    return 0;
  } else {
    /* each opening in a session of its own (transport.h) */
    bson_snprintf(s->session, sizeof s->session, "%s%016lx", s->tag,
                  __atomic_add_fetch(&openings, 1, __ATOMIC_RELAXED));
    ml_build_watch(&s->op, s->db, s->coll, s->field, s->tag, s->start_t, s->start_i, s->resume);
    s->op_kind = ML_STREAM_OP_OPEN;
  }
  s->op.session = s->session;
  return 1;
}

/* a failed call (or a reply without a batch) */
static void call_failed(ml_stream *s, const bson_error_t *err, double now) {
  if (++s->tries > ML_STREAM_REOPENS) {
    ml_stream_fail(s, err, now);
    return;
  }
  s->retry_at = now + 0.05 * s->tries;
}

/* the server closed the cursor (its events are in the
 * ring): a failed call too, so that a stream that keeps closing fails */
static void closed_by_server(ml_stream *s, double now) {
  bson_error_t e;
  memset(&e, 0, sizeof e);
  bson_snprintf(e.message, sizeof e.message, "the server closed the change stream");
  call_failed(s, &e, now);
  s->stale = 1;
}

/* the outcome of s's op in flight (ok: reply is the
 * server's answer, else err says why) */
void ml_stream_done(ml_stream *s, double now, int ok, const bson_t *reply, const bson_error_t *err) {
  int kind = s->op_kind;
  bson_error_t e;
  s->op_kind = ML_STREAM_OP_NONE;
  ml_op_destroy(&s->op);
  if (ok || kind == ML_STREAM_OP_KILL) memset(&e, 0, sizeof e);
  else e = *err;
  if (ok && kind != ML_STREAM_OP_KILL && !take_batch(s, reply)) {
    ok = 0;
    bson_snprintf(e.message, sizeof e.message, "a reply without a cursor");
  }
  switch (kind) {
  case ML_STREAM_OP_OPEN:
    s->opens++;
    if (!ok) {
      /* the transport ended the session; a first opening that fails
       * means no change streams here */
      if (s->state == ML_STREAM_STARTING) ml_stream_fail(s, &e, now);
      else call_failed(s, &e, now);
      break;
    }
    s->open = 1;
    if (s->state == ML_STREAM_STARTING) {
      s->state = ML_STREAM_RUNNING;
      s->idle_since = now;
    }
    if (s->cursor_id == 0) closed_by_server(s, now);
    else s->tries = 0;
    break;
  case ML_STREAM_OP_MORE:
    s->getmores++;
    if (!ok) {
      call_failed(s, &e, now);  /* (failed for good: killCursors next) */
      s->stale = 1;
    } else if (s->cursor_id == 0) {
      closed_by_server(s, now);
    } else {
      s->tries = 0;
    }
    break;
  case ML_STREAM_OP_KILL:
    /* sent for a cursor the server closed too: it ends the session */
    s->open = 0;
    s->cursor_id = 0;
    if (s->stale && s->state == ML_STREAM_RUNNING && !s->stop) s->reopens++;
    s->stale = 0;
    break;
  }
}

/* does an event's key (BSON {"k": _id}) name the same _id as key?  Equal
 * bytes, or numbers of equal value stored as another type (an _id the
 * caller passes as 42 matches one stored as 42.0 or as an int64) */
static int key_equal(const uint8_t *data, size_t len, const bson_t *key) {
  bson_t b;
  bson_iter_t ia, ib;
  if (len == key->len && memcmp(data, bson_get_data(key), len) == 0) return 1;
  if (!bson_init_static(&b, data, len) || !bson_iter_init_find(&ia, &b, "k") ||
      !bson_iter_init_find(&ib, key, "k"))
    return 0;
  if (!BSON_ITER_HOLDS_NUMBER(&ia) || !BSON_ITER_HOLDS_NUMBER(&ib)) return 0;
  if (!BSON_ITER_HOLDS_DOUBLE(&ia) && !BSON_ITER_HOLDS_DOUBLE(&ib))
    return bson_iter_as_int64(&ia) == bson_iter_as_int64(&ib);
  return bson_iter_as_double(&ia) == bson_iter_as_double(&ib);
}

/* has a release of key after (t, i) been seen, for every
 * waiter or for this one (waiter NULL: any release)?  0 no, 1 yes (*mine:
 * handed to waiter by name), 2 it granted the lock to waiter (*grant: that
 * event) */
int ml_stream_seen(const ml_stream *s, const bson_t *key, const char *waiter, uint32_t t,
                   uint32_t i, const watch_event **grant, int *mine) {
  unsigned long long n = s->seq < ML_RING ? s->seq : ML_RING, k;
  if (ml_ts_after(s->drop_t, s->drop_i, t, i)) return 1;
  for (k = 0; k < n; k++) {
    const watch_event *e = &s->ring[(s->seq - 1 - k) % ML_RING];
    if (!ml_ts_after(e->t, e->i, t, i)) continue;
    if (e->next[0] && waiter &&
        (memcmp(e->next, s->tag, 16) != 0 || strcmp(e->next + 16, waiter) != 0))
      continue;
    if (!e->key || key_equal(e->key, e->keylen, key)) {
      *mine = e->next[0] && waiter;
      if (waiter && e->owner[0] && e->key && strcmp(e->owner, waiter) == 0) {
        *grant = e;
        return 2;
      }
      return 1;
    }
  }
  return 0;
}


void ml_stream_clear(ml_stream *s) {
  int k;
  ml_stream_notices_clear(s);
  for (k = 0; k < ML_RING; k++) free(s->ring[k].key);
  if (s->op_kind) ml_op_destroy(&s->op);
  if (s->resume) bson_destroy(s->resume);
  free(s->db);
  free(s->coll);
  free(s->field);
}
