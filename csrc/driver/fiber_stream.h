/*
 * Connections whose reads wait through a fiber (fiber.h).
 *
 * A connection of a client given ml_fiber_stream_use is a TCP socket of its
 * own (no TLS) read through a small buffer of the stream's: a read that finds
 * too little there and on the socket gives the event loop back from the
 * running fiber until the socket is readable (outside a fiber it waits in
 * poll(), as the driver's own stream).  Writes are the driver's own.
 *
 * A bridged connection (ml_fiber_stream_use(mc, 1)) has no socket of its
 * own: the event loop moves its bytes (nginx's cosockets).  It connects,
 * sends and receives by asking the loop through the running fiber
 * (ml_fiber_ask with an ml_bridge_io), and the loop answers in the same
 * struct before it resumes the fiber.  The loop names its socket by the
 * connection's id, and keeps it between ops (nginx's keepalive pool).
 */
#ifndef MONGOLOCK_FIBER_STREAM_H
#define MONGOLOCK_FIBER_STREAM_H

#include <pthread.h>

#include <mongoc/mongoc.h>

/* 1 when uri's connections can be such streams: no TLS, TCP hosts only */
int ml_fiber_stream_fits(const mongoc_uri_t *uri);

/* Connections whose descriptors the loop may still watch after a wait (a
 * scheduler that keeps a descriptor watched until told to forget it): one
 * of them destroyed is not closed at once but waits in its pool's graves
 * until the loop has forgotten its descriptor (a descriptor closed while
 * watched, or its number taken by a new socket, confuses such a loop) */
typedef struct ml_graves {
  pthread_mutex_t mu;
  mongoc_stream_t **s;          /* the connections' sockets, unclosed */
  int *fd;                      /* their descriptors */
  size_t n, cap;
} ml_graves;

void ml_graves_init(ml_graves *g);
/* the latest grave's socket (its descriptor in *fd), out of the graves,
 * for the caller to destroy; NULL when there is none */
mongoc_stream_t *ml_graves_pop(ml_graves *g, int *fd);
/* closes every socket left in the graves and frees them */
void ml_graves_destroy(ml_graves *g);

/* mc's connections made from now on are such streams (bridged: 1); a
 * plain one, once waited on through a fiber, goes to graves when
 * destroyed (NULL: closed at once) */
void ml_fiber_stream_use(mongoc_client_t *mc, int bridged, ml_graves *graves);

/* what a bridged connection asks the loop to do */
enum { ML_BRIDGE_CONNECT = 1, ML_BRIDGE_SEND, ML_BRIDGE_RECV };

typedef struct {
  int kind;                     /* ML_BRIDGE_* */
  uint64_t id;                  /* the connection's (its socket's name) */
  const char *host;
  uint16_t port;
  int used;                     /* it carried bytes before: a socket the loop
                                 * finds anew under its name is not it */
  const char *data;             /* SEND: len bytes */
  size_t len;
  char *room;                   /* RECV: at most max bytes go there */
  size_t max;
  /* the loop's answer */
  size_t got;                   /* RECV: the bytes put in room (> 0) */
  int failed;                   /* 0, or an errno (ETIMEDOUT: timed out) */
  char why[128];                /* the loop's words for a failure */
} ml_bridge_io;

/* ids of bridged connections destroyed since the last call (at most max
 * into ids): their sockets, kept by the loop, are to be closed */
size_t ml_bridge_dead(uint64_t *ids, size_t max);

/* the dead list's lock, and fork's child handler (after the lock is made
 * anew: module.c): the list emptied (its ids are the parent's loop's) */
extern pthread_mutex_t ml_bridge_mu;
void ml_bridge_forked(void);

/* bytes bridged connections sent from this thread so far: an op during
 * which it did not grow sent nothing, so it did not apply */
uint64_t ml_bridge_sent(void);

#endif
