/*
 * Connections whose reads wait through a fiber (fiber_stream.h).
 */
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "fiber.h"
#include "fiber_stream.h"

/* any value libmongoc's own streams do not use (bounded.c has 0x4d4c) */
#define FIBER_STREAM_TYPE 0x4d4d
/* a reply's header and body come in one read as a rule */
#define BUF_SIZE 16384

typedef struct fiber_stream {
  mongoc_stream_t vtable;       /* first: libmongoc sees a mongoc_stream_t */
  mongoc_stream_t *base;        /* the driver's socket stream (writes); NULL: bridged */
  int fd;                       /* its descriptor */
  int out;                      /* a read timed out or was cancelled */
  int waited;                   /* a fiber waited on its descriptor */
  ml_graves *graves;            /* where it goes when destroyed, once waited */
  size_t off, len;              /* buf[off, off + len) is read, not yet taken */
  /* bridged: */
  uint64_t id;
  char host[BSON_HOST_NAME_MAX + 1];
  uint16_t port;
  int used;                     /* it carried bytes */
  int broken;                   /* an exchange failed: never used again */
  char *wbuf;                   /* a message's iovecs, joined */
  size_t wcap;
  char buf[BUF_SIZE];
} fiber_stream;

static fiber_stream *fs_of(mongoc_stream_t *s) { return (fiber_stream *)s; }

/* ---- bridged connections: the loop moves the bytes ---------------------- */

pthread_mutex_t ml_bridge_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t bridge_next_id;
#define DEAD_KEPT 256
static uint64_t dead[DEAD_KEPT];
static size_t ndead;
static __thread uint64_t bridge_sent;

void ml_bridge_forked(void) { ndead = 0; }

size_t ml_bridge_dead(uint64_t *ids, size_t max) {
  size_t n;
  pthread_mutex_lock(&ml_bridge_mu);
  n = ndead < max ? ndead : max;
  memcpy(ids, dead + (ndead - n), n * sizeof *ids);
  ndead -= n;
  pthread_mutex_unlock(&ml_bridge_mu);
  return n;
}

uint64_t ml_bridge_sent(void) { return bridge_sent; }

/* asks the loop to do io (through the running fiber) until deadline
 * (monotonic us, 0: none): 0 done, -1 (errno) failed or cancelled; a
 * failure breaks the connection */
static int bridge_ask(fiber_stream *s, ml_bridge_io *io, int64_t deadline) {
  io->id = s->id;
  io->host = s->host;
  io->port = s->port;
  io->used = s->used;
  io->got = 0;
  io->failed = 0;
  io->why[0] = '\0';
  if (s->broken || !ml_fiber_current()) {
    s->broken = 1;
    errno = ENOTCONN;
    return -1;
  }
  if (ml_fiber_ask(io, deadline) != 0 || io->failed) {
    s->broken = 1;
    if (!io->failed || io->failed == ETIMEDOUT) s->out = 1;
    errno = io->failed ? io->failed : ECANCELED;
    return -1;
  }
  return 0;
}

static ssize_t bridge_fill(fiber_stream *s, int64_t deadline) {
  ml_bridge_io io;
  memset(&io, 0, sizeof io);
  io.kind = ML_BRIDGE_RECV;
  io.room = s->buf + s->off + s->len;
  io.max = sizeof s->buf - s->off - s->len;
  if (bridge_ask(s, &io, deadline) != 0) return -1;
  if (io.got == 0 || io.got > io.max) {
    s->broken = 1;
    errno = ECONNRESET;
    return -1;
  }
  s->used = 1;
  s->len += io.got;
  return (ssize_t)io.got;
}

static ssize_t bridge_writev(fiber_stream *s, mongoc_iovec_t *iov, size_t iovcnt, int32_t timeout_msec) {
  ml_bridge_io io;
  size_t total = 0, i;
  memset(&io, 0, sizeof io);
  for (i = 0; i < iovcnt; i++) total += iov[i].iov_len;
  if (iovcnt == 1) {
    io.data = (const char *)iov[0].iov_base;
  } else {
    size_t at = 0;
    if (total > s->wcap) {
      char *w = (char *)bson_realloc(s->wbuf, total);
      s->wbuf = w;
      s->wcap = total;
    }
    for (i = 0; i < iovcnt; i++) {
      memcpy(s->wbuf + at, iov[i].iov_base, iov[i].iov_len);
      at += iov[i].iov_len;
    }
    io.data = s->wbuf;
  }
  io.kind = ML_BRIDGE_SEND;
  io.len = total;
  if (bridge_ask(s, &io, timeout_msec < 0 ? 0 : bson_get_monotonic_time() + (int64_t)timeout_msec * 1000) != 0)
    return -1;
  s->used = 1;
  bridge_sent += total;
  return (ssize_t)total;
}

/* reads what the socket has into the buffer, waiting (through the running
 * fiber, else in poll) until it has something or deadline (monotonic us,
 * 0: none) passes: > 0 read, -1 (errno) */
static ssize_t fill(fiber_stream *s, int64_t deadline) {
  for (;;) {
    ssize_t n;
    if (s->len == 0) s->off = 0;
    else if (s->off + s->len == sizeof s->buf) {
      memmove(s->buf, s->buf + s->off, s->len);
      s->off = 0;
    }
    if (!s->base) return bridge_fill(s, deadline);
    n = recv(s->fd, s->buf + s->off + s->len, sizeof s->buf - s->off - s->len, MSG_DONTWAIT);
    if (n > 0) {
      s->len += (size_t)n;
      return n;
    }
    if (n == 0) {                   /* the peer closed it */
      errno = ECONNRESET;
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    if (deadline && bson_get_monotonic_time() >= deadline) {
      s->out = 1;
      errno = ETIMEDOUT;
      return -1;
    }
    if (ml_fiber_current()) {
      s->waited = 1;
      if (ml_fiber_wait(s->fd, deadline) != 0) {
        s->out = 1;
        errno = ECANCELED;
        return -1;
      }
    } else {
      struct pollfd p;
      int ms = -1;
      p.fd = s->fd;
      p.events = POLLIN;
      p.revents = 0;
      if (deadline) {
        int64_t left = (deadline - bson_get_monotonic_time() + 999) / 1000;
        ms = left < 0 ? 0 : left > INT32_MAX ? INT32_MAX : (int)left;
      }
      if (poll(&p, 1, ms) < 0 && errno != EINTR) return -1;
    }
  }
}

/* as the driver's readv: at least min_bytes (at most the buffers' room)
 * into iov, or -1 */
static ssize_t f_readv(mongoc_stream_t *st, mongoc_iovec_t *iov, size_t iovcnt, size_t min_bytes,
                       int32_t timeout_msec) {
  fiber_stream *s = fs_of(st);
  int64_t deadline = timeout_msec < 0 ? 0 : bson_get_monotonic_time() + (int64_t)timeout_msec * 1000;
  size_t room = 0, total = 0, i = 0, at = 0;
  for (i = 0; i < iovcnt; i++) room += iov[i].iov_len;
  if (min_bytes > room) min_bytes = room;
  i = 0;
  for (;;) {
    /* what the buffer has, into the iovecs */
    while (s->len > 0 && i < iovcnt) {
      size_t want = iov[i].iov_len - at, n = s->len < want ? s->len : want;
      memcpy((char *)iov[i].iov_base + at, s->buf + s->off, n);
      s->off += n, s->len -= n, total += n, at += n;
      if (at == iov[i].iov_len) i++, at = 0;
    }
    if (total >= min_bytes && (total > 0 || room == 0)) return (ssize_t)total;
    if (fill(s, deadline) < 0) return -1;
  }
}

static ssize_t f_writev(mongoc_stream_t *s, mongoc_iovec_t *iov, size_t iovcnt, int32_t timeout_msec) {
  if (!fs_of(s)->base) return bridge_writev(fs_of(s), iov, iovcnt, timeout_msec);
  return mongoc_stream_writev(fs_of(s)->base, iov, iovcnt, timeout_msec);
}

/* a bridged connection's socket, which the loop keeps, is to be closed */
static void bridge_gone(fiber_stream *s) {
  pthread_mutex_lock(&ml_bridge_mu);
  if (ndead == DEAD_KEPT) memmove(dead, dead + 1, --ndead * sizeof *dead);
  dead[ndead++] = s->id;
  pthread_mutex_unlock(&ml_bridge_mu);
  bson_free(s->wbuf);
}

/* ---- graves (fiber_stream.h) --------------------------------------------- */

void ml_graves_init(ml_graves *g) {
  memset(g, 0, sizeof *g);
  pthread_mutex_init(&g->mu, NULL);
}

/* base, a socket stream the loop may watch, into the graves (closed at
 * once when there is no room for it) */
static void bury(ml_graves *g, mongoc_stream_t *base, int fd) {
  pthread_mutex_lock(&g->mu);
  if (g->n == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 8;
    mongoc_stream_t **s = (mongoc_stream_t **)realloc(g->s, cap * sizeof *s);
    int *f = s ? (int *)realloc(g->fd, cap * sizeof *f) : NULL;
    if (s) g->s = s;
    if (f) g->fd = f, g->cap = cap;
  }
  if (g->n < g->cap) {
    g->s[g->n] = base;
    g->fd[g->n++] = fd;
    base = NULL;
  }
  pthread_mutex_unlock(&g->mu);
  if (base) mongoc_stream_destroy(base);
}

mongoc_stream_t *ml_graves_pop(ml_graves *g, int *fd) {
  mongoc_stream_t *s = NULL;
  pthread_mutex_lock(&g->mu);
  if (g->n > 0) {
    s = g->s[--g->n];
    *fd = g->fd[g->n];
  }
  pthread_mutex_unlock(&g->mu);
  return s;
}

void ml_graves_destroy(ml_graves *g) {
  mongoc_stream_t *s;
  int fd;
  while ((s = ml_graves_pop(g, &fd))) mongoc_stream_destroy(s);
  free(g->s);
  free(g->fd);
  pthread_mutex_destroy(&g->mu);
  memset(g, 0, sizeof *g);
}

static void f_destroy(mongoc_stream_t *s) {
  fiber_stream *f = fs_of(s);
  if (f->base && f->graves && f->waited) bury(f->graves, f->base, f->fd);
  else if (f->base) mongoc_stream_destroy(f->base);
  else bridge_gone(f);
  bson_free(s);
}

static void f_failed(mongoc_stream_t *s) {
  fiber_stream *f = fs_of(s);
  if (f->base && f->graves && f->waited) bury(f->graves, f->base, f->fd);
  else if (f->base) mongoc_stream_failed(f->base);
  else bridge_gone(f);
  bson_free(s);
}

static int f_close(mongoc_stream_t *s) {
  fiber_stream *f = fs_of(s);
  if (!f->base) {
    f->broken = 1;
    return 0;
  }
  /* one the loop may watch keeps its descriptor until it goes to the
   * graves (f_destroy): shut down, not closed */
  if (f->graves && f->waited) return shutdown(f->fd, SHUT_RDWR) == 0 || errno == ENOTCONN ? 0 : -1;
  return mongoc_stream_close(f->base);
}
static int f_flush(mongoc_stream_t *s) { return fs_of(s)->base ? mongoc_stream_flush(fs_of(s)->base) : 0; }
static int f_setsockopt(mongoc_stream_t *s, int level, int optname, void *optval, mongoc_socklen_t optlen) {
  if (!fs_of(s)->base) return 0;     /* the loop's socket has its own */
  return mongoc_stream_setsockopt(fs_of(s)->base, level, optname, optval, optlen);
}
static mongoc_stream_t *f_base(mongoc_stream_t *s) { return fs_of(s)->base; }
/* bytes left unread in the buffer belong to no request: the connection is
 * as good as closed */
static bool f_check_closed(mongoc_stream_t *s) {
  fiber_stream *f = fs_of(s);
  if (!f->base) return f->len > 0 || f->broken;
  return f->len > 0 || mongoc_stream_check_closed(f->base);
}
static bool f_timed_out(mongoc_stream_t *s) {
  return fs_of(s)->out || (fs_of(s)->base && mongoc_stream_timed_out(fs_of(s)->base));
}
static bool f_should_retry(mongoc_stream_t *s) {
  return fs_of(s)->base && mongoc_stream_should_retry(fs_of(s)->base);
}

/* the descriptor of sock: libmongoc keeps it first in its mongoc_socket_t
 * and does not hand it out; taken from there only when the socket it names
 * has the local address mongoc_socket_getsockname gives (-1 otherwise) */
static int socket_fd(mongoc_socket_t *sock) {
  struct sockaddr_storage a, b;
  mongoc_socklen_t alen = sizeof a;
  socklen_t blen = sizeof b;
  int fd = *(const int *)sock;
  if (fd < 0 || mongoc_socket_getsockname(sock, (struct sockaddr *)&a, &alen) != 0 ||
      getsockname(fd, (struct sockaddr *)&b, &blen) != 0 || (socklen_t)alen != blen || memcmp(&a, &b, blen) != 0)
    return -1;
  return fd;
}

/* a connected TCP socket to host within the URI's connectTimeoutMS, as a
 * libmongoc socket stream; *fd its descriptor */
static mongoc_stream_t *connect_tcp(const mongoc_uri_t *uri, const mongoc_host_list_t *host, int *fd,
                                    bson_error_t *error) {
  struct addrinfo hints, *res = NULL, *ai;
  char port[8];
  int32_t ms = mongoc_uri_get_option_as_int32(uri, MONGOC_URI_CONNECTTIMEOUTMS, 10000);
  int e;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = host->family;
  hints.ai_socktype = SOCK_STREAM;
  snprintf(port, sizeof port, "%u", (unsigned)host->port);
  if ((e = getaddrinfo(host->host, port, &hints, &res)) != 0) {
    bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_NAME_RESOLUTION, "Failed to resolve '%s': %s",
                   host->host, gai_strerror(e));
    return NULL;
  }
  for (ai = res; ai; ai = ai->ai_next) {
    int one = 1;
    mongoc_socket_t *sock = mongoc_socket_new(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (!sock) continue;
    mongoc_socket_setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    mongoc_socket_setsockopt(sock, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    if (mongoc_socket_connect(sock, ai->ai_addr, (mongoc_socklen_t)ai->ai_addrlen,
                              bson_get_monotonic_time() + (int64_t)ms * 1000) == 0 &&
        (*fd = socket_fd(sock)) >= 0) {
      freeaddrinfo(res);
      return mongoc_stream_socket_new(sock);
    }
    mongoc_socket_destroy(sock);
  }
  freeaddrinfo(res);
  bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_CONNECT, "Failed to connect to target host: %s",
                 host->host_and_port);
  return NULL;
}

/* a bridged connection to host, connected by the loop within the URI's
 * connectTimeoutMS */
static fiber_stream *connect_bridged(const mongoc_uri_t *uri, const mongoc_host_list_t *host, bson_error_t *error) {
  int32_t ms = mongoc_uri_get_option_as_int32(uri, MONGOC_URI_CONNECTTIMEOUTMS, 10000);
  ml_bridge_io io;
  fiber_stream *s = (fiber_stream *)bson_malloc0(sizeof *s);
  s->fd = -1;
  bson_strncpy(s->host, host->host, sizeof s->host);
  s->port = host->port;
  pthread_mutex_lock(&ml_bridge_mu);
  s->id = ++bridge_next_id;
  pthread_mutex_unlock(&ml_bridge_mu);
  memset(&io, 0, sizeof io);
  io.kind = ML_BRIDGE_CONNECT;
  if (bridge_ask(s, &io, bson_get_monotonic_time() + (int64_t)ms * 1000) != 0) {
    bson_set_error(error, MONGOC_ERROR_STREAM, MONGOC_ERROR_STREAM_CONNECT, "Failed to connect to target host: %s%s%s%s",
                   host->host_and_port, io.why[0] ? " (" : "", io.why, io.why[0] ? ")" : "");
    bson_free(s);
    return NULL;
  }
  return s;
}

/* the initiator's user data for bridged connections (else: their graves) */
static int bridged_tag;

static mongoc_stream_t *initiator(const mongoc_uri_t *uri, const mongoc_host_list_t *host, void *user_data,
                                  bson_error_t *error) {
  fiber_stream *s;
  mongoc_stream_t *base;
  int fd = -1;
  if (user_data == &bridged_tag) {
    if (!(s = connect_bridged(uri, host, error))) return NULL;
  } else {
    if (!(base = connect_tcp(uri, host, &fd, error))) return NULL;
    s = (fiber_stream *)bson_malloc0(sizeof *s);
    s->base = base;
    s->fd = fd;
    s->graves = (ml_graves *)user_data;
  }
  s->vtable.type = FIBER_STREAM_TYPE;
  s->vtable.destroy = f_destroy;
  s->vtable.failed = f_failed;
  s->vtable.close = f_close;
  s->vtable.flush = f_flush;
  s->vtable.writev = f_writev;
  s->vtable.readv = f_readv;
  s->vtable.setsockopt = f_setsockopt;
  s->vtable.get_base_stream = s->base ? f_base : NULL;
  s->vtable.check_closed = f_check_closed;
  s->vtable.timed_out = f_timed_out;
  s->vtable.should_retry = f_should_retry;
  return (mongoc_stream_t *)s;
}

int ml_fiber_stream_fits(const mongoc_uri_t *uri) {
  const mongoc_host_list_t *h;
  if (mongoc_uri_get_tls(uri)) return 0;
  for (h = mongoc_uri_get_hosts(uri); h; h = h->next)
    if (h->family == AF_UNIX) return 0;
  return mongoc_uri_get_hosts(uri) != NULL;
}

void ml_fiber_stream_use(mongoc_client_t *mc, int bridged, ml_graves *graves) {
  mongoc_client_set_stream_initiator(mc, initiator, bridged ? (void *)&bridged_tag : (void *)graves);
}
