/*
 * Round trips bounded per thread: a socket timeout of a single attempt's
 * own on a pooled connection.
 *
 * libmongoc 1.23 has one socket timeout per pool (socketTimeoutMS) and no
 * timeout per operation.  A connection given ml_bounded_use reads and
 * writes through a thin stream around the driver's own (TCP or TLS): while
 * the calling thread has a deadline (ml_bounded_begin), no read or write
 * waits past it, and a connection it opens meanwhile connects and shakes
 * hands within what is left.  A read cut so is the driver's socket timeout
 * ("Failed to read 4 bytes: socket error or timeout"): it closes that
 * connection, and its retry of a write, already past the deadline, fails
 * at once.  Without a deadline the stream changes nothing.  Other threads
 * (the pool's monitors, renewals, streams, workers) never have one.
 */
#ifndef MONGOLOCK_BOUNDED_H
#define MONGOLOCK_BOUNDED_H

#include <stdint.h>
#include <mongoc/mongoc.h>

/* mc's connections made from now on go through the bounded stream */
void ml_bounded_use(mongoc_client_t *mc);

/* Sets the calling thread's deadline to ms from now; returns the one
 * before (0: none), for ml_bounded_end. */
int64_t ml_bounded_begin(int32_t ms);

/* Restores the deadline ml_bounded_begin returned; answers 1 when the
 * deadline being ended had passed or cut a read or write short. */
int ml_bounded_end(int64_t before);

#endif
