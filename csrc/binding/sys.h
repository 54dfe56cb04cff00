/*
 * What the binding asks of the system (sys.c): sleeping, timed waits,
 * random owner ids, this process's tag, its threads' signals.  No Lua, no
 * libmongoc.
 *
 * May include: system headers only.
 */
#ifndef MONGOLOCK_SYS_H
#define MONGOLOCK_SYS_H

#include <pthread.h>
#include <signal.h>
#include <time.h>

/* sleeps for s seconds (s <= 0 returns at once); restarts on EINTR */
void ml_sleep(double s);

/*
 * Writes 128 random bits from getrandom(2) as 32 lowercase hex digits and a
 * NUL into out.  Returns 1, or 0 when the kernel gave no randomness (out is
 * then untouched).
 */
int ml_random_owner(char out[33]);

/* this process's tag, 16 hex digits and a NUL (drawn again after fork);
 * 0 when the kernel gave no randomness */
int ml_process_tag(char out[17]);

/* this host's name (gethostname, read once per process; "" when it
 * fails), NUL-terminated in out */
void ml_hostname(char out[256]);

/* the tag's and host name's lock (made anew in a forked child: module.c;
 * both are taken again there) */
extern pthread_mutex_t ml_tag_mu;

/* seconds on CLOCK_MONOTONIC as an absolute timespec (for timed waits on
 * condition variables with a monotonic clock), clamped to 0 .. 1e12 */
struct timespec ml_timespec(double s);

/* Blocks in the calling thread every signal a thread it then starts
 * should not take (the application's: they belong to its own threads),
 * keeping the old mask in old for ml_signals_restore.  The faults
 * (SIGSEGV, SIGBUS, SIGFPE, SIGILL) and SIGABRT stay unblocked: a
 * blocked fault kills the process without running its handler (a crash
 * trace, a crash reporter). */
void ml_signals_block(sigset_t *old);

/* puts back the mask ml_signals_block kept */
void ml_signals_restore(const sigset_t *old);

#endif
