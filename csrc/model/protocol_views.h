/*
 * Views of the lock documents for readers that show them (the command's
 * top, an election's observer): the commands that read them and the
 * parsers that reduce a reply, a document or a change event to what the
 * reader shows, so that no layer above names a field of the lock document.
 * Pure, like protocol.h (whose ml_op, schema and fragments they use): no
 * lua_State, no I/O; includes only protocol.h.
 */
#ifndef MONGOLOCK_PROTOCOL_VIEWS_H
#define MONGOLOCK_PROTOCOL_VIEWS_H

#include "protocol.h"

/* ---- the queues of a collection (top's waiters) ------------------------- */

/*
 * Every lock of db.coll with a queue, each as {_id, w: [{h, p, left}]}: its
 * live queue entries in order (the waiter's holder, whether it polls, the
 * milliseconds its place is kept, by the server's clock).  An aggregate
 * that reads, never writes; every batch folded into the reply.
 */
void ml_build_queue_view(ml_op *op, const char *db, const char *coll);

/* the rows of a queue view's reply: each row's lock name (NULL when not a
 * string) and its entries (an array iterator); 0 when the row has none */
int ml_parse_queue_row(const bson_t *row, const char **name, bson_iter_t *entries);

/* one waiter of a row */
typedef struct ml_queue_entry {
  int has_holder;
  bson_t holder;                    /* {host, pid, app}: a view */
  int polling;                      /* it polls: no event wakes it */
  int has_left;
  double left_ms;                   /* its place is kept this long (>= 0) */
} ml_queue_entry;

void ml_parse_queue_entry(const bson_t *entry, ml_queue_entry *out);

/* ---- an election's document, as its observer sees it -------------------- */

/* the fields of an election's view, one bit each */
enum {
  ML_EV_OWNER = 1 << 0,             /* owner id */
  ML_EV_TOKEN = 1 << 1,             /* the term */
  ML_EV_VALUE = 1 << 2,             /* the published value */
  ML_EV_VALUE_TERM = 1 << 3,        /* the term value was written in */
  ML_EV_HOLDER = 1 << 4,            /* {host, pid, app} */
  ML_EV_ACQUIRED = 1 << 5,          /* a date */
  ML_EV_EXPIRES = 1 << 6,           /* a date */
  ML_EV_LEASE = 1 << 7              /* the lease's length, ms */
};
#define ML_EV_FIELDS 8

/* the view's name of field bit k (0..ML_EV_FIELDS-1): "owner", "token",
 * "value", "value_term", "holder", "acquired_at", "expires_at", "lease_ms" */
const char *ml_election_key(int k);

/*
 * An election's fields, read from a document (the leader read's projection
 * or a change event's fullDocument) or from an update's changes.  has: the
 * bits whose value is present and not null; the iterators point into the
 * parsed document.  Dates are also given in ms (acquired_ms, expires_ms).
 */
typedef struct ml_field {
  bson_iter_t it;                   /* (libbson aligns it: no bare array) */
} ml_field;

typedef struct ml_election {
  unsigned has;
  ml_field field[ML_EV_FIELDS];
  int64_t acquired_ms, expires_ms;
  int held;                         /* the leader read: a live owner */
  int has_remaining;
  int64_t remaining_ms;             /* the leader read: its lease left */
} ml_election;

void ml_parse_election(const bson_t *doc, ml_election *out);

/* a change event of an election's document */
typedef enum {
  ML_EVENT_UPDATE = 0,              /* set, touched, cleared, holder parts */
  ML_EVENT_REPLACE = 1,             /* an insert or a replace: doc */
  ML_EVENT_DELETE = 2,
  ML_EVENT_END = 3                  /* drop, rename, dropDatabase,
                                       invalidate: the stream ends */
} ml_event_kind;

typedef struct ml_election_event {
  ml_event_kind kind;
  int has_time;
  uint32_t t, i;                    /* clusterTime */
  ml_election doc;                  /* ML_EVENT_REPLACE: the new document;
                                       ML_EVENT_UPDATE: the fields set to a
                                       value (doc.has) */
  unsigned touched;                 /* update: fields set, to null too */
  unsigned cleared;                 /* update: fields set to null or removed */
  int has_holder_parts;
  bson_iter_t holder_parts;         /* update: the updated fields (iterate
                                       with ml_next_holder_part) */
} ml_election_event;

void ml_parse_election_event(const bson_t *ev, ml_election_event *out);

/* the next change of one field of the holder in an update's fields (it:
 * holder_parts, advanced): its key within the holder, *it at its value;
 * NULL at the end */
const char *ml_next_holder_part(bson_iter_t *it);

#endif
