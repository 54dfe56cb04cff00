/*
 * Fibers on ucontext (fiber.h).
 *
 * A fiber's stack is an anonymous mapping with a guard page below it; the
 * stacks of ended fibers are kept (up to STACKS_KEPT) for the next ones.
 * Under AddressSanitizer no fiber is made (ml_fiber_new answers NULL: the
 * callers then use their worker threads), as its stack switches would need
 * the sanitizer's own hooks.  Under valgrind each stack is registered.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "fiber.h"

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define ML_VALGRIND 1
#endif
#endif

#if defined(__SANITIZE_ADDRESS__)
#define ML_NO_FIBERS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ML_NO_FIBERS 1
#endif
#endif

/* libmongoc's deepest calls (a reply's parsing under a retried write) take
 * a few tens of KiB; pages never touched are never committed */
#define STACK_SIZE (512 * 1024)
#define STACKS_KEPT 16

struct ml_fiber {
  ucontext_t ctx;               /* the fiber's */
  ucontext_t back;              /* the resumer's */
  void (*fn)(void *);
  void *arg;
  char *map;                    /* guard page + stack */
  unsigned vg_id;               /* valgrind's id of the stack */
  int done;
  int cancel;                   /* the wait it resumes from fails */
  int fd;                       /* waiting: the descriptor */
  void *req;                    /* waiting: the request (fd -1) */
  int64_t deadline;             /* waiting: until (monotonic us), 0: none */
};

static __thread ml_fiber *running;

static pthread_mutex_t kept_mu = PTHREAD_MUTEX_INITIALIZER;
static char *kept[STACKS_KEPT];
static int nkept;

static size_t page(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (size_t)p : 4096;
}

static char *stack_get(void) {
  char *m = NULL;
  pthread_mutex_lock(&kept_mu);
  if (nkept > 0) m = kept[--nkept];
  pthread_mutex_unlock(&kept_mu);
  if (m) return m;
  m = (char *)mmap(NULL, STACK_SIZE + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  if (m == MAP_FAILED) return NULL;
  if (mprotect(m, page(), PROT_NONE) != 0) {
    munmap(m, STACK_SIZE + page());
    return NULL;
  }
  return m;
}

static void stack_put(char *m) {
  pthread_mutex_lock(&kept_mu);
  if (nkept < STACKS_KEPT) {
    kept[nkept++] = m;
    m = NULL;
  }
  pthread_mutex_unlock(&kept_mu);
  if (m) munmap(m, STACK_SIZE + page());
}

/* getcontext returns twice (setjmp's kind): kept out of the callers'
 * frames */
__attribute__((noinline)) static int context_init(ucontext_t *c) { return getcontext(c); }

/* makecontext passes int arguments only: the fiber to start is the
 * thread's running one, set by ml_fiber_resume */
static void trampoline(void) {
  ml_fiber *f = running;
  f->fn(f->arg);
  f->done = 1;
  /* uc_link is f->back: returning resumes the resumer */
}

ml_fiber *ml_fiber_new(void (*fn)(void *), void *arg) {
#ifdef ML_NO_FIBERS
  (void)fn;
  (void)arg;
  return NULL;
#else
  ml_fiber *f = (ml_fiber *)calloc(1, sizeof *f);
  if (!f) return NULL;
  if (!(f->map = stack_get()) || context_init(&f->ctx) != 0) {
    if (f->map) stack_put(f->map);
    free(f);
    return NULL;
  }
  f->fn = fn;
  f->arg = arg;
  f->fd = -1;
  f->ctx.uc_stack.ss_sp = f->map + page();
  f->ctx.uc_stack.ss_size = STACK_SIZE;
  f->ctx.uc_link = &f->back;
#ifdef ML_VALGRIND
  f->vg_id = VALGRIND_STACK_REGISTER(f->map + page(), f->map + page() + STACK_SIZE);
#endif
  makecontext(&f->ctx, trampoline, 0);
  return f;
#endif
}

int ml_fiber_resume(ml_fiber *f, int cancel) {
  ml_fiber *outer = running;
  if (f->done) return 1;
  f->cancel = cancel;
  running = f;
  swapcontext(&f->back, &f->ctx);
  running = outer;
  return f->done;
}

int ml_fiber_fd(const ml_fiber *f) { return f->fd; }
void *ml_fiber_request(const ml_fiber *f) { return f->req; }
int64_t ml_fiber_deadline(const ml_fiber *f) { return f->deadline; }

void ml_fiber_free(ml_fiber *f) {
  if (!f) return;
#ifdef ML_VALGRIND
  VALGRIND_STACK_DEREGISTER(f->vg_id);
#endif
  stack_put(f->map);
  free(f);
}

ml_fiber *ml_fiber_current(void) { return running; }

static int wait_for(int fd, void *req, int64_t deadline_us) {
  ml_fiber *f = running;
  if (!f || f->cancel) return -1;
  f->fd = fd;
  f->req = req;
  f->deadline = deadline_us;
  swapcontext(&f->ctx, &f->back);
  f->fd = -1;
  f->req = NULL;
  return f->cancel ? -1 : 0;
}

int ml_fiber_wait(int fd, int64_t deadline_us) { return wait_for(fd, NULL, deadline_us); }
int ml_fiber_ask(void *req, int64_t deadline_us) { return wait_for(-1, req, deadline_us); }
