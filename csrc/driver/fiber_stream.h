/*
 * Connections whose reads wait through a fiber (fiber.h).
 *
 * A connection of a client given ml_fiber_stream_use is a TCP socket of its
 * own (no TLS) read through a small buffer of the stream's: a read that finds
 * too little there and on the socket gives the event loop back from the
 * running fiber until the socket is readable (outside a fiber it waits in
 * poll(), as the driver's own stream).  Writes are the driver's own.
 */
#ifndef MONGOLOCK_FIBER_STREAM_H
#define MONGOLOCK_FIBER_STREAM_H

#include <mongoc/mongoc.h>

/* 1 when uri's connections can be such streams: no TLS, TCP hosts only */
int ml_fiber_stream_fits(const mongoc_uri_t *uri);

/* mc's connections made from now on are such streams */
void ml_fiber_stream_use(mongoc_client_t *mc);

#endif
