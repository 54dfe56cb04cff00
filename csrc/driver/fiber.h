/*
 * Round trips in the event loop's own thread: a call into the driver run on
 * a stack of its own (a fiber), which gives the loop back whenever it would
 * wait for a socket.
 *
 * libmongoc 1.23 blocks in poll() for every reply.  A scheduler's coroutine
 * that hands each call to a worker thread pays two thread wake-ups per round
 * trip (the worker's, then the loop's).  A fiber runs the same call in the
 * loop's thread instead: where a connection's read would wait
 * (bounded.c's stream, while a fiber runs), the fiber switches back to the
 * loop with the socket's descriptor and its deadline; the loop waits on it
 * as on any descriptor and resumes the fiber, which reads.  No Lua runs on a
 * fiber's stack, and nothing of the fiber outlives its call.
 *
 *   f = ml_fiber_new(fn, arg)     a fiber that will run fn(arg); NULL
 *                                 when no stack can be had
 *   ml_fiber_resume(f, 0)         runs it until it waits (0) or fn returned
 *                                 (1); then ml_fiber_fd(f) is the descriptor
 *                                 to wait for and ml_fiber_deadline(f) the
 *                                 monotonic microseconds it waits until
 *                                 (0: none)
 *   ml_fiber_resume(f, 1)         the same, the wait cancelled: the read
 *                                 in it fails at once (the caller went away)
 *   ml_fiber_free(f)              once fn returned
 *
 * Inside fn: ml_fiber_wait(fd, deadline) switches back to the loop; it
 * returns 0 to look at fd again, -1 when cancelled or past the deadline.
 * ml_fiber_ask(req, deadline) switches back with a request instead of a
 * descriptor (ml_fiber_request(f) while it waits; ml_fiber_fd is -1): the
 * loop does what req asks (bridge.h) and resumes it; -1 when cancelled.
 * ml_fiber_current() is the running fiber (NULL on a thread's own stack).
 */
#ifndef MONGOLOCK_FIBER_H
#define MONGOLOCK_FIBER_H

#include <pthread.h>
#include <stdint.h>

typedef struct ml_fiber ml_fiber;

ml_fiber *ml_fiber_new(void (*fn)(void *), void *arg);
/* 0 in a build that makes no fiber (ml_fiber_new always NULL) */
int ml_fiber_available(void);
int ml_fiber_resume(ml_fiber *f, int cancel);
int ml_fiber_fd(const ml_fiber *f);
void *ml_fiber_request(const ml_fiber *f);
int64_t ml_fiber_deadline(const ml_fiber *f);
void ml_fiber_free(ml_fiber *f);

ml_fiber *ml_fiber_current(void);
int ml_fiber_wait(int fd, int64_t deadline_us);
int ml_fiber_ask(void *req, int64_t deadline_us);

/* the kept stacks' lock, and fork's child handler (after the lock is made
 * anew: module.c): the list emptied (a thread of the parent's may have
 * been changing it; the parent's stacks stay mapped, unused) */
extern pthread_mutex_t ml_kept_mu;
void ml_fiber_forked(void);

#endif
