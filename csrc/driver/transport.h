/*
 * The transport: runs a built operation (protocol.h) and hands back the
 * server's reply.  libmongoc's pool is the transport here; another one (an
 * nginx worker thread) runs the same ml_op through client:run (ops.c) or
 * its own connection.  Nothing here knows what a lock is.
 */
#ifndef MONGOLOCK_TRANSPORT_H
#define MONGOLOCK_TRANSPORT_H

#include <pthread.h>
#include <mongoc/mongoc.h>
#include "protocol.h"

/*
 * Runs op on mc (a connection this thread popped from its pool) with wc
 * (the client's write concern, added to every write).  reply is always
 * initialised and the caller destroys it.  Returns 1, or 0 with error set;
 * after a failed write reply may still hold the server's answer (a write
 * concern error comes after the write was applied).
 *
 *   ML_RUN_WRITE    one command; sent again once after a network error
 *                   when op->retry (the owner id makes it idempotent)
 *   ML_RUN_UPDATE   mongoc_collection_update_one: a retryable write (the
 *                   driver retries it once with the same txnNumber after a
 *                   network error or a RetryableWriteError label); the
 *                   reply's matchedCount says what matched
 *   ML_RUN_CURSOR   the aggregate and its getMores; the reply is
 *                   {cursor: {firstBatch: [every document], id: 0}, ok: 1}
 *   ML_RUN_COMMAND  one command; a reply with ok: 1 and writeErrors or a
 *                   writeConcernError is an error too
 *
 * An ML_RUN_COMMAND op with a session key (op->session) is one of a
 * cursor's commands.  mongod continues a cursor only in the logical session
 * that created it, and each libmongoc pool gives each command an implicit
 * session of its own choosing; so these run in an explicit session, kept
 * per process under its key on a connection of its own: an aggregate opens
 * it (replacing one of the same key), getMores use it, killCursors or a
 * failed aggregate ends it.  A multi-document transaction's commands run
 * the same way: its first command (startTransaction) opens the session when
 * the key is not open, and an endSessions op with the key ends it (answered
 * ok without being sent).  A key that is not open (ended, or opened
 * before fork) fails with an error.  Its commands may come from any thread
 * and any client of the process, one at a time.
 */
int ml_run(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op, bson_t *reply,
           bson_error_t *error);

/* ml_run itself, whatever runner the thread has set */
int ml_run_direct(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op, bson_t *reply,
                  bson_error_t *error);

/* Sets the calling thread's runner of ml_run (NULL: none, ml_run_direct),
 * returning the one before: a single attempt runs its op with a deadline
 * (client.c, client:one_attempt; bounded.h).
 * Other threads (pools, renewals, streams) are not affected. */
typedef int (*ml_runner)(mongoc_client_t *mc, mongoc_write_concern_t *wc, const ml_op *op, bson_t *reply,
                         bson_error_t *error);
ml_runner ml_run_override(ml_runner f);

/* one of a cursor's commands (op, ML_RUN_COMMAND) on mc in the explicit
 * session cs (NULL: none, the server has no sessions), for a caller that
 * keeps the cursor's connection and session itself (the change-stream
 * thread, watch.c); same return as ml_run */
int ml_run_in_session(mongoc_client_t *mc, mongoc_client_session_t *cs, const ml_op *op, bson_t *reply,
                      bson_error_t *error);

/* the cursor sessions' lock, and fork's child handler (after the lock is
 * made anew: module.c): the list emptied (its sessions are the parent's,
 * dropped unended as a child's session_take drops them) */
extern pthread_mutex_t ml_sessions_mu;
void ml_sessions_forked(void);

#endif
