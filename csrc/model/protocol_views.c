/*
 * Views of the lock documents (protocol_views.h): the queue view's command
 * and the parsers of its rows, an election's document and its change
 * events.  Pure C over libbson and protocol.h: no Lua, no I/O.
 */
#include <string.h>

#include "protocol_views.h"

/* ---- the queues of a collection ----------------------------------------- */

void ml_build_queue_view(ml_op *op, const char *db, const char *coll) {
  ml_op_init(op, ML_RUN_CURSOR, db, coll);
  BCON_APPEND(&op->cmd, "aggregate", BCON_UTF8(coll),
    "pipeline", "[",
      "{", "$match", "{", ML_F_QUEUE ".0", "{", "$exists", BCON_BOOL(true), "}", "}", "}",
      "{", "$project", "{", "w", "{", "$map", "{",
        "input", ML_LIVE(ML_F_QUEUE),
        "in", "{", "h", "$$this.h", "p", "$$this.p",
                   "left", "{", "$subtract", "[", "$$this.until", "$$NOW", "]", "}", "}",
      "}", "}", "}", "}",
    "]",
    "cursor", "{", "}");
}

int ml_parse_queue_row(const bson_t *row, const char **name, bson_iter_t *entries) {
  bson_iter_t it;
  *name = NULL;
  if (bson_iter_init_find(&it, row, "_id") && BSON_ITER_HOLDS_UTF8(&it))
    *name = bson_iter_utf8(&it, NULL);
  return bson_iter_init_find(&it, row, "w") && BSON_ITER_HOLDS_ARRAY(&it) &&
         bson_iter_recurse(&it, entries);
}

void ml_parse_queue_entry(const bson_t *entry, ml_queue_entry *out) {
  bson_iter_t it;
  memset(out, 0, sizeof *out);
  if (bson_iter_init_find(&it, entry, "h") && BSON_ITER_HOLDS_DOCUMENT(&it)) {
    const uint8_t *data;
    uint32_t len;
    bson_iter_document(&it, &len, &data);
    out->has_holder = bson_init_static(&out->holder, data, len);
  }
  out->polling = bson_iter_init_find(&it, entry, "p") && BSON_ITER_HOLDS_BOOL(&it) &&
                 bson_iter_bool(&it);
  if (bson_iter_init_find(&it, entry, "left") && BSON_ITER_HOLDS_NUMBER(&it)) {
    double ms = bson_iter_as_double(&it);
    out->has_left = 1;
    out->left_ms = ms > 0 ? ms : 0;
  }
}

/* ---- an election's document --------------------------------------------- */

/* the document's field of each view bit, and the view's name for it */
static const char *const doc_fields[ML_EV_FIELDS] = {
  ML_F_OWNER, ML_F_TOKEN, ML_F_VALUE, ML_F_VTOKEN, ML_F_HOLDER, ML_F_ACQUIRED, ML_F_EXPIRES,
  ML_F_TTL
};
static const char *const view_keys[ML_EV_FIELDS] = {
  "owner", "token", "value", "value_term", "holder", "acquired_at", "expires_at", "lease_ms"
};

const char *ml_election_key(int k) {
  return k >= 0 && k < ML_EV_FIELDS ? view_keys[k] : NULL;
}

/* the view bit of a document field, or -1 */
static int field_bit(const char *key) {
  int k;
  for (k = 0; k < ML_EV_FIELDS; k++)
    if (strcmp(key, doc_fields[k]) == 0) return k;
  return -1;
}

/* takes the value at it as field k of out (null: not present) */
static void take_field(ml_election *out, int k, const bson_iter_t *it) {
  if (BSON_ITER_HOLDS_NULL(it) || bson_iter_type(it) == BSON_TYPE_UNDEFINED) return;
  if ((1u << k) == ML_EV_ACQUIRED || (1u << k) == ML_EV_EXPIRES) {
    /* a date, else nothing the observer can count with */
    if (!BSON_ITER_HOLDS_DATE_TIME(it)) return;
    if ((1u << k) == ML_EV_ACQUIRED) out->acquired_ms = bson_iter_date_time(it);
    else out->expires_ms = bson_iter_date_time(it);
  }
  if ((1u << k) == ML_EV_LEASE && !BSON_ITER_HOLDS_NUMBER(it)) return;
  out->field[k].it = *it;
  out->has |= 1u << k;
}

void ml_parse_election(const bson_t *doc, ml_election *out) {
  bson_iter_t it;
  memset(out, 0, sizeof *out);
  if (!bson_iter_init(&it, doc)) return;
  while (bson_iter_next(&it)) {
    const char *key = bson_iter_key(&it);
    int k = field_bit(key);
    if (k >= 0) {
      take_field(out, k, &it);
    } else if (strcmp(key, "held") == 0) {
      out->held = bson_iter_as_bool(&it);
    } else if (strcmp(key, "remainingMs") == 0 && BSON_ITER_HOLDS_NUMBER(&it)) {
      out->has_remaining = 1;
      out->remaining_ms = ml_iter_int64(&it, 0);
    }
  }
}

/* the sub-document at key of doc as a view */
static int sub_doc(const bson_t *doc, const char *key, bson_t *out) {
  bson_iter_t it;
  const uint8_t *data;
  uint32_t len;
  if (!bson_iter_init(&it, doc) || !bson_iter_find_descendant(&it, key, &it) ||
      !BSON_ITER_HOLDS_DOCUMENT(&it))
    return 0;
  bson_iter_document(&it, &len, &data);
  return bson_init_static(out, data, len);
}

#define HOLDER_PREFIX ML_F_HOLDER "."

void ml_parse_election_event(const bson_t *ev, ml_election_event *out) {
  bson_iter_t it;
  bson_t doc;
  const char *kind = "";
  memset(out, 0, sizeof *out);
  out->kind = ML_EVENT_END;
  if (bson_iter_init_find(&it, ev, "operationType") && BSON_ITER_HOLDS_UTF8(&it))
    kind = bson_iter_utf8(&it, NULL);
  if (bson_iter_init_find(&it, ev, "clusterTime") && BSON_ITER_HOLDS_TIMESTAMP(&it)) {
    bson_iter_timestamp(&it, &out->t, &out->i);
    out->has_time = 1;
  }
  if (strcmp(kind, "update") == 0) {
    bson_t removed;
    out->kind = ML_EVENT_UPDATE;
    if (sub_doc(ev, "updateDescription.updatedFields", &doc) && bson_iter_init(&it, &doc)) {
      out->has_holder_parts = 1;
      out->holder_parts = it;
      while (bson_iter_next(&it)) {
        int k = field_bit(bson_iter_key(&it));
        if (k < 0) continue;
        take_field(&out->doc, k, &it);
        out->touched |= 1u << k;
        if (!(out->doc.has & (1u << k))) out->cleared |= 1u << k;
      }
    }
    if (sub_doc(ev, "updateDescription", &doc) && bson_iter_init_find(&it, &doc, "removedFields") &&
        BSON_ITER_HOLDS_ARRAY(&it)) {
      const uint8_t *data;
      uint32_t len;
      bson_iter_array(&it, &len, &data);
      if (bson_init_static(&removed, data, len) && bson_iter_init(&it, &removed))
        while (bson_iter_next(&it)) {
          int k = BSON_ITER_HOLDS_UTF8(&it) ? field_bit(bson_iter_utf8(&it, NULL)) : -1;
          if (k >= 0) out->cleared |= 1u << k;
        }
    }
  } else if (strcmp(kind, "replace") == 0 || strcmp(kind, "insert") == 0) {
    out->kind = ML_EVENT_REPLACE;
    if (sub_doc(ev, "fullDocument", &doc)) ml_parse_election(&doc, &out->doc);
  } else if (strcmp(kind, "delete") == 0) {
    out->kind = ML_EVENT_DELETE;
  }
}

const char *ml_next_holder_part(bson_iter_t *it) {
  size_t n = strlen(HOLDER_PREFIX);
  while (bson_iter_next(it)) {
    const char *key = bson_iter_key(it);
    if (strncmp(key, HOLDER_PREFIX, n) == 0 && key[n]) return key + n;
  }
  return NULL;
}
