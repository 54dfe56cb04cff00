/*
 * What the binding asks of the system: sleeping, timed waits on a
 * monotonic clock, random owner ids, this process's tag and the signals
 * its threads take.  No Lua.
 *
 * May include: sys.h and system headers; calls no other file of csrc.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/random.h>

#include "lease.h"
#include "sys.h"

struct timespec ml_timespec(double s) {
  struct timespec ts;
  if (!(s > 0)) s = 0;                 /* also NaN */
  if (s > 1e12) s = 1e12;
  ts.tv_sec = (time_t)s;
  ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
  if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
  return ts;
}

void ml_sleep(double s) {
  struct timespec req, rem;
  if (!(s > 0)) return;                /* also NaN */
  req = ml_timespec(s > 1e9 ? 1e9 : s);
  while (nanosleep(&req, &rem) == -1 && errno == EINTR)
    req = rem;
}

int ml_random_owner(char out[33]) {
  static const char hex[] = "0123456789abcdef";
  unsigned char b[16];
  size_t got = 0;
  int i;
  while (got < sizeof b) {
    ssize_t n = getrandom(b + got, sizeof b - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return 0;
    }
    got += (size_t)n;
  }
  for (i = 0; i < 16; i++) {
    out[2 * i] = hex[b[i] >> 4];
    out[2 * i + 1] = hex[b[i] & 15];
  }
  out[32] = '\0';
  return 1;
}

/*
 * This process's tag: 64 random bits as 16 hex digits, drawn again in a
 * forked child.  A queued waiter's entry carries it, and a release handed
 * to a waiter names it in the document's next (tag and waiter id), so that
 * the event reaches only the process that waits (csrc/binding/watch.c filters its
 * stream on the tag).
 */
pthread_mutex_t ml_tag_mu = PTHREAD_MUTEX_INITIALIZER;
static char tag_hex[17];
static pid_t tag_pid;

static char host_name[256];
static pid_t host_pid;

void ml_hostname(char out[256]) {
  pthread_mutex_lock(&ml_tag_mu);
  if (host_pid != ml_pid()) {
    if (gethostname(host_name, sizeof host_name) != 0) host_name[0] = '\0';
    host_name[sizeof host_name - 1] = '\0';
    host_pid = ml_pid();
  }
  memcpy(out, host_name, sizeof host_name);
  pthread_mutex_unlock(&ml_tag_mu);
}

int ml_process_tag(char out[17]) {
  int ok = 1;
  pthread_mutex_lock(&ml_tag_mu);
  if (tag_pid != ml_pid()) {
    char full[33];
    if (ml_random_owner(full)) {
      memcpy(tag_hex, full, 16);
      tag_hex[16] = '\0';
      tag_pid = ml_pid();
    } else {
      ok = 0;
    }
  }
  if (ok) memcpy(out, tag_hex, 17);
  pthread_mutex_unlock(&ml_tag_mu);
  return ok;
}

void ml_signals_block(sigset_t *old) {
  static const int faults[] = { SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT };
  sigset_t set;
  size_t k;
  sigfillset(&set);
  for (k = 0; k < sizeof faults / sizeof faults[0]; k++) sigdelset(&set, faults[k]);
  pthread_sigmask(SIG_SETMASK, &set, old);
}

void ml_signals_restore(const sigset_t *old) {
  pthread_sigmask(SIG_SETMASK, old, NULL);
}
