/*
 * The libmongoc transport (transport.h).
 */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "transport.h"

/* a document or array field of doc as a view */
static int find_view(const bson_t *doc, const char *path, bson_t *out) {
  bson_iter_t it, f;
  const uint8_t *data;
  uint32_t len;
  if (!bson_iter_init(&it, doc) || !bson_iter_find_descendant(&it, path, &f)) return 0;
  if (BSON_ITER_HOLDS_DOCUMENT(&f)) bson_iter_document(&f, &len, &data);
  else if (BSON_ITER_HOLDS_ARRAY(&f)) bson_iter_array(&f, &len, &data);
  else return 0;
  return bson_init_static(out, data, len);
}

static int bad_op(bson_t *reply, bson_error_t *error, const char *what) {
  bson_init(reply);
  bson_set_error(error, MONGOC_ERROR_COMMAND, MONGOC_ERROR_COMMAND_INVALID_ARG, "%s", what);
  return 0;
}

static int run_update(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op,
                      bson_t *reply, bson_error_t *error) {
  mongoc_collection_t *col;
  bson_t q, u, opts = BSON_INITIALIZER;
  bson_iter_t it, m;
  int ok;
  if (!op->coll || !find_view(&op->cmd, "updates.0.q", &q) || !find_view(&op->cmd, "updates.0.u", &u))
    return bad_op(reply, error, "malformed update op");
  mongoc_write_concern_append(wc, &opts);
  BSON_APPEND_BOOL(&opts, "validate", false);   /* built by protocol.c */
  col = mongoc_client_get_collection(mc, op->db, op->coll);
  /* a renewal in a batch (multi): not a retryable write; the engine
   * retries it, and its every statement only extends live leases */
  if (bson_iter_init(&it, &op->cmd) && bson_iter_find_descendant(&it, "updates.0.multi", &m) &&
      bson_iter_as_bool(&m))
    ok = mongoc_collection_update_many(col, &q, &u, &opts, reply, error);
  else
    ok = mongoc_collection_update_one(col, &q, &u, &opts, reply, error);
  mongoc_collection_destroy(col);
  bson_destroy(&opts);
  return ok;
}

static int run_cursor(mongoc_client_t *mc, const ml_op *op, bson_t *reply, bson_error_t *error) {
  mongoc_collection_t *col;
  mongoc_cursor_t *cur;
  const bson_t *doc;
  bson_t pipeline, cursor, batch, rc, opts = BSON_INITIALIZER;
  uint32_t n = 0;
  int ok;
  if (!op->coll || !find_view(&op->cmd, "pipeline", &pipeline))
    return bad_op(reply, error, "malformed aggregate op");
  /* the op's read concern goes with the aggregate */
  if (find_view(&op->cmd, "readConcern", &rc)) BSON_APPEND_DOCUMENT(&opts, "readConcern", &rc);
  col = mongoc_client_get_collection(mc, op->db, op->coll);
  cur = mongoc_collection_aggregate(col, MONGOC_QUERY_NONE, &pipeline, &opts, NULL);
  bson_destroy(&opts);
  bson_init(reply);
  BSON_APPEND_DOCUMENT_BEGIN(reply, "cursor", &cursor);
  BSON_APPEND_ARRAY_BEGIN(&cursor, "firstBatch", &batch);
  while (mongoc_cursor_next(cur, &doc)) {
    char buf[16];
    const char *key;
    size_t klen = bson_uint32_to_string(n++, &key, buf, sizeof buf);
    bson_append_document(&batch, key, (int)klen, doc);
  }
  bson_append_array_end(&cursor, &batch);
  BSON_APPEND_INT64(&cursor, "id", 0);
  bson_append_document_end(reply, &cursor);
  BSON_APPEND_DOUBLE(reply, "ok", 1.0);
  ok = !mongoc_cursor_error(cur, error);
  mongoc_cursor_destroy(cur);
  mongoc_collection_destroy(col);
  return ok;
}

/* commands that write: the client's write concern is added to them when
 * they carry none */
static const char *const write_commands[] = {
  "insert", "update", "delete", "findAndModify", "findandmodify", "create", "drop",
  "createIndexes", "dropIndexes", "dropDatabase", "renameCollection", "collMod", NULL
};

static int is_write_command(const bson_t *cmd) {
  bson_iter_t it;
  int i;
  if (!bson_iter_init(&it, cmd) || !bson_iter_next(&it)) return 0;
  for (i = 0; write_commands[i]; i++)
    if (!strcmp(bson_iter_key(&it), write_commands[i])) return 1;
  return 0;
}

/*
 * Sets e from the reply's first writeErrors entry or its writeConcernError.
 * Returns 1 when there was one.
 */
static int reply_write_error(const bson_t *reply, bson_error_t *e) {
  bson_iter_t it, sub, f;
  const char *which[2] = {"writeErrors", "writeConcernError"};
  int k;
  for (k = 0; k < 2; k++) {
    const char *msg = "write error";
    int32_t code = 0;
    if (!bson_iter_init_find(&it, reply, which[k])) continue;
    if (k == 0) {
      if (!BSON_ITER_HOLDS_ARRAY(&it) || !bson_iter_recurse(&it, &sub) || !bson_iter_next(&sub))
        continue;
      if (!BSON_ITER_HOLDS_DOCUMENT(&sub) || !bson_iter_recurse(&sub, &f)) continue;
    } else {
      msg = "write concern error";
      if (!BSON_ITER_HOLDS_DOCUMENT(&it) || !bson_iter_recurse(&it, &f)) continue;
    }
    while (bson_iter_next(&f)) {
      if (!strcmp(bson_iter_key(&f), "errmsg") && BSON_ITER_HOLDS_UTF8(&f))
        msg = bson_iter_utf8(&f, NULL);
      else if (!strcmp(bson_iter_key(&f), "code") && BSON_ITER_HOLDS_NUMBER(&f))
        code = (int32_t)bson_iter_as_int64(&f);
    }
    bson_set_error(e, MONGOC_ERROR_SERVER, (uint32_t)code, "%s", msg);
    return 1;
  }
  return 0;
}

static int run_command(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op,
                       bson_t *reply, bson_error_t *error) {
  bson_t opts = BSON_INITIALIZER;
  int ok;
  if (is_write_command(&op->cmd) && !bson_has_field(&op->cmd, "writeConcern"))
    mongoc_write_concern_append(wc, &opts);
  ok = mongoc_client_command_with_opts(mc, op->db, &op->cmd, NULL, &opts, reply, error);
  bson_destroy(&opts);
  return ok && !reply_write_error(reply, error);
}

/* ---- a cursor's session (transport.h) --------------------------------- */

/* An open session: its own connection (a single-threaded client on the
 * URI of the client that opened it) and the explicit session on it (NULL
 * when the server has no sessions: then no command carries an lsid).  In
 * the list while idle; taken out while a command runs in it, so that
 * nobody else uses the connection meanwhile. */
typedef struct cursor_session {
  char key[33];
  pid_t pid;
  mongoc_client_t *mc;
  mongoc_client_session_t *cs;
  struct cursor_session *next;
} cursor_session;

pthread_mutex_t ml_sessions_mu = PTHREAD_MUTEX_INITIALIZER;
static cursor_session *sessions;

void ml_sessions_forked(void) { sessions = NULL; }

/* takes key's session out of the list (NULL: none); sessions of another
 * process (before fork) are dropped, never destroyed (their sockets are
 * the parent's) */
static cursor_session *session_take(const char *key) {
  cursor_session **p, *s, *found = NULL;
  pid_t pid = getpid();
  pthread_mutex_lock(&ml_sessions_mu);
  for (p = &sessions; (s = *p);) {
    if (s->pid != pid || (!found && !strcmp(s->key, key))) {
      *p = s->next;
      if (s->pid == pid) found = s;
    } else {
      p = &s->next;
    }
  }
  pthread_mutex_unlock(&ml_sessions_mu);
  return found;
}

static void session_put(cursor_session *s) {
  pthread_mutex_lock(&ml_sessions_mu);
  s->next = sessions;
  sessions = s;
  pthread_mutex_unlock(&ml_sessions_mu);
}

static void session_end(cursor_session *s) {
  if (!s) return;
  if (s->cs) mongoc_client_session_destroy(s->cs);
  mongoc_client_destroy(s->mc);   /* sends endSessions */
  bson_free(s);
}

static cursor_session *session_open(mongoc_client_t *from, const char *key, bson_error_t *error) {
  cursor_session *s;
  mongoc_client_t *mc = mongoc_client_new_from_uri(mongoc_client_get_uri(from));
  bson_error_t ignored;
  if (!mc) {
    bson_set_error(error, MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_NOT_READY,
                   "cannot make a connection for the cursor's session");
    return NULL;
  }
  mongoc_client_set_error_api(mc, MONGOC_ERROR_API_VERSION_2);
  s = bson_malloc0(sizeof *s);
  bson_strncpy(s->key, key, sizeof s->key);
  s->pid = getpid();
  s->mc = mc;
  s->cs = mongoc_client_start_session(mc, NULL, &ignored);  /* NULL: no sessions */
  return s;
}

static const char *command_name(const bson_t *cmd) {
  bson_iter_t it;
  return bson_iter_init(&it, cmd) && bson_iter_next(&it) ? bson_iter_key(&it) : "";
}

int ml_run_in_session(mongoc_client_t *mc, mongoc_client_session_t *cs, const ml_op *op, bson_t *reply,
                      bson_error_t *error) {
  bson_t opts = BSON_INITIALIZER;
  int ok = !cs || mongoc_client_session_append(cs, &opts, error);
  if (ok) ok = mongoc_client_command_with_opts(mc, op->db, &op->cmd, NULL, &opts, reply, error);
  else bson_init(reply);
  bson_destroy(&opts);
  return ok;
}

static int run_in_session(mongoc_client_t *mc, const ml_op *op, bson_t *reply, bson_error_t *error) {
  const char *name = command_name(&op->cmd);
  int opening = !strcmp(name, "aggregate"), closing = !strcmp(name, "killCursors"), ok;
  /* a transaction's first command opens its session unless open; the
   * session's end is endSessions, answered here (destroying the client
   * ends its server sessions) */
  int txn = bson_has_field(&op->cmd, "startTransaction");
  cursor_session *s = session_take(op->session);
  if (!strcmp(name, "endSessions")) {
    session_end(s);
    bson_init(reply);
    BSON_APPEND_INT32(reply, "ok", 1);
    return 1;
  }
  if (opening || (txn && !s)) {
    session_end(s);
    s = session_open(mc, op->session, error);
    if (!s) {
      bson_init(reply);
      return 0;
    }
  } else if (!s) {
    return bad_op(reply, error, "the cursor's session is not open in this process");
  }
  ok = ml_run_in_session(s->mc, s->cs, op, reply, error);
  if (closing || (opening && !ok)) session_end(s);
  else session_put(s);
  return ok;
}

/* the calling thread's runner of ml_run, when one is set (ml_run_override) */
static __thread ml_runner run_override;

ml_runner ml_run_override(ml_runner f) {
  ml_runner prev = run_override;
  run_override = f;
  return prev;
}

int ml_run(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op, bson_t *reply,
           bson_error_t *error) {
  if (run_override) return run_override(mc, wc, op, reply, error);
  return ml_run_direct(mc, wc, op, reply, error);
}

int ml_run_direct(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op, bson_t *reply,
                  bson_error_t *error) {
  switch (op->kind) {
  case ML_RUN_WRITE: {
    bson_t opts = BSON_INITIALIZER;
    int ok, attempt;
    mongoc_write_concern_append(wc, &opts);
    for (attempt = 0;; attempt++) {
      ok = mongoc_client_write_command_with_opts(mc, op->db, &op->cmd, &opts, reply, error);
      /* with retryWrites (the default) the driver has already sent it once
       * more in the same transaction: a resend would wait for a server a
       * second time */
      if (ok || !op->retry || error->domain != MONGOC_ERROR_STREAM || attempt == 1 ||
          mongoc_uri_get_option_as_bool(mongoc_client_get_uri(mc), MONGOC_URI_RETRYWRITES, true))
        break;
      bson_destroy(reply);
    }
    bson_destroy(&opts);
    return ok;
  }
  case ML_RUN_UPDATE: return run_update(mc, wc, op, reply, error);
  case ML_RUN_CURSOR: return run_cursor(mc, op, reply, error);
  case ML_RUN_COMMAND:
    if (op->session) return run_in_session(mc, op, reply, error);
    return run_command(mc, wc, op, reply, error);
  }
  return bad_op(reply, error, "unknown op kind");
}
