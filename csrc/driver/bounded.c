/*
 * Round trips bounded per thread (bounded.h).
 */
#include "bounded.h"

/* libmongoc's own initiator (exported by every libmongoc since 1.0, but
 * declared only in its private mongoc-client-private.h): a TCP stream, in
 * TLS when the URI asks, made with the URI's connectTimeoutMS */
mongoc_stream_t *mongoc_client_default_stream_initiator(const mongoc_uri_t *uri, const mongoc_host_list_t *host,
                                                        void *user_data, bson_error_t *error);

/* the calling thread's deadline, bson_get_monotonic_time() microseconds;
 * 0: none */
static __thread int64_t deadline_us;
/* a read or write of this thread, its time cut to the deadline, timed out */
static __thread int cut_out;

/* any value libmongoc's own streams do not use */
#define BOUNDED_STREAM_TYPE 0x4d4c

typedef struct bounded_stream {
  mongoc_stream_t vtable;   /* first: libmongoc sees a mongoc_stream_t */
  mongoc_stream_t *base;    /* the driver's TCP or TLS stream */
} bounded_stream;

static mongoc_stream_t *base_of(mongoc_stream_t *s) { return ((bounded_stream *)s)->base; }

/* milliseconds left before the thread's deadline, at least 1 (0 would not
 * wait at all, a negative value without end) */
static int32_t left_ms(void) {
  int64_t left = (deadline_us - bson_get_monotonic_time()) / 1000;
  if (left < 1) return 1;
  return left > INT32_MAX ? INT32_MAX : (int32_t)left;
}

/* timeout_msec (negative: none), cut to the thread's deadline; *was_cut
 * says whether it was */
static int32_t cut(int32_t timeout_msec, int *was_cut) {
  int32_t left;
  *was_cut = 0;
  if (!deadline_us) return timeout_msec;
  left = left_ms();
  if (timeout_msec >= 0 && timeout_msec <= left) return timeout_msec;
  *was_cut = 1;
  return left;
}

/* n, a read's or write's result: notes a time out that the cut made */
static ssize_t noted(mongoc_stream_t *s, ssize_t n, int was_cut) {
  if (n < 0 && was_cut && mongoc_stream_timed_out(base_of(s))) cut_out = 1;
  return n;
}

static void b_destroy(mongoc_stream_t *s) {
  mongoc_stream_destroy(base_of(s));
  bson_free(s);
}

static void b_failed(mongoc_stream_t *s) {
  mongoc_stream_failed(base_of(s));
  bson_free(s);
}

static int b_close(mongoc_stream_t *s) { return mongoc_stream_close(base_of(s)); }
static int b_flush(mongoc_stream_t *s) { return mongoc_stream_flush(base_of(s)); }

static ssize_t b_writev(mongoc_stream_t *s, mongoc_iovec_t *iov, size_t iovcnt, int32_t timeout_msec) {
  int was_cut;
  int32_t t = cut(timeout_msec, &was_cut);
  return noted(s, mongoc_stream_writev(base_of(s), iov, iovcnt, t), was_cut);
}

static ssize_t b_readv(mongoc_stream_t *s, mongoc_iovec_t *iov, size_t iovcnt, size_t min_bytes,
                       int32_t timeout_msec) {
  int was_cut;
  int32_t t = cut(timeout_msec, &was_cut);
  return noted(s, mongoc_stream_readv(base_of(s), iov, iovcnt, min_bytes, t), was_cut);
}

static int b_setsockopt(mongoc_stream_t *s, int level, int optname, void *optval, mongoc_socklen_t optlen) {
  return mongoc_stream_setsockopt(base_of(s), level, optname, optval, optlen);
}

static mongoc_stream_t *b_base(mongoc_stream_t *s) { return base_of(s); }
static bool b_check_closed(mongoc_stream_t *s) { return mongoc_stream_check_closed(base_of(s)); }
static bool b_timed_out(mongoc_stream_t *s) { return mongoc_stream_timed_out(base_of(s)); }
static bool b_should_retry(mongoc_stream_t *s) { return mongoc_stream_should_retry(base_of(s)); }

/* mongoc_client_set_stream_initiator's: the driver's own stream (user_data
 * is the client, as its default initiator wants), connected and, with TLS,
 * shaken hands within the thread's deadline, wrapped */
static mongoc_stream_t *initiator(const mongoc_uri_t *uri, const mongoc_host_list_t *host, void *user_data,
                                  bson_error_t *error) {
  mongoc_stream_t *base;
  bounded_stream *s;
  if (deadline_us) {
    mongoc_uri_t *u = mongoc_uri_copy(uri);
    int32_t left = left_ms();
    if (!u) return NULL;
    if (left < mongoc_uri_get_option_as_int32(u, MONGOC_URI_CONNECTTIMEOUTMS, 10000))
      mongoc_uri_set_option_as_int32(u, MONGOC_URI_CONNECTTIMEOUTMS, left);
    base = mongoc_client_default_stream_initiator(u, host, user_data, error);
    mongoc_uri_destroy(u);
  } else {
    base = mongoc_client_default_stream_initiator(uri, host, user_data, error);
  }
  if (!base) return NULL;
  s = (bounded_stream *)bson_malloc0(sizeof *s);
  s->base = base;
  s->vtable.type = BOUNDED_STREAM_TYPE;
  s->vtable.destroy = b_destroy;
  s->vtable.failed = b_failed;
  s->vtable.close = b_close;
  s->vtable.flush = b_flush;
  s->vtable.writev = b_writev;
  s->vtable.readv = b_readv;
  s->vtable.setsockopt = b_setsockopt;
  s->vtable.get_base_stream = b_base;
  s->vtable.check_closed = b_check_closed;
  s->vtable.timed_out = b_timed_out;
  s->vtable.should_retry = b_should_retry;
  /* no poll: mongoc_stream_poll polls the root stream (get_base_stream) */
  return (mongoc_stream_t *)s;
}

void ml_bounded_use(mongoc_client_t *mc) { mongoc_client_set_stream_initiator(mc, initiator, mc); }

int64_t ml_bounded_begin(int32_t ms) {
  int64_t before = deadline_us;
  deadline_us = bson_get_monotonic_time() + (int64_t)ms * 1000;
  cut_out = 0;
  return before;
}

int ml_bounded_end(int64_t before) {
  int out = cut_out || (deadline_us && bson_get_monotonic_time() >= deadline_us);
  deadline_us = before;
  cut_out = 0;
  return out;
}
