/*
 * Fibers (fiber.h): on x86-64 a switch of our own, elsewhere ucontext.
 *
 * glibc's swapcontext, getcontext and setcontext each make a system call
 * (rt_sigprocmask), three to five per round trip; the switch below saves
 * and loads only what the calling convention keeps (the callee-saved
 * registers, the SSE and x87 control words) and makes none.  Nothing on a
 * fiber changes the signal mask, so no mask needs switching.
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
#include <string.h>
#include <sys/mman.h>
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

#if defined(__x86_64__) && !defined(ML_FIBER_UCONTEXT)
#define ML_OWN_SWITCH 1
#else
#include <ucontext.h>
#endif

/* libmongoc's deepest calls (a reply's parsing under a retried write) take
 * a few tens of KiB; pages never touched are never committed */
#define STACK_SIZE (512 * 1024)
#define STACKS_KEPT 16

struct ml_fiber {
#ifdef ML_OWN_SWITCH
  void *sp;                     /* the fiber's saved stack pointer */
  void *back;                   /* the resumer's */
#else
  ucontext_t ctx;               /* the fiber's */
  ucontext_t back;              /* the resumer's */
#endif
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

pthread_mutex_t ml_kept_mu = PTHREAD_MUTEX_INITIALIZER;
static char *kept[STACKS_KEPT];
static int nkept;

static size_t page(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p > 0 ? (size_t)p : 4096;
}

void ml_fiber_forked(void) { nkept = 0; }

static char *stack_get(void) {
  char *m = NULL;
  pthread_mutex_lock(&ml_kept_mu);
  if (nkept > 0) m = kept[--nkept];
  pthread_mutex_unlock(&ml_kept_mu);
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
  pthread_mutex_lock(&ml_kept_mu);
  if (nkept < STACKS_KEPT) {
    kept[nkept++] = m;
    m = NULL;
  }
  pthread_mutex_unlock(&ml_kept_mu);
  if (m) munmap(m, STACK_SIZE + page());
}

#ifdef ML_OWN_SWITCH
/* ml_switch(&save, to): pushes the callee-saved registers and the control
 * words on the current stack, stores the stack pointer in save, takes `to`
 * as the stack pointer and pops what the switch away from it pushed (or
 * what ml_fiber_new laid out), returning where that switch was called */
void ml_switch(void **save, void *to);
__asm__(".text\n"
        ".globl ml_switch\n"
        ".hidden ml_switch\n"
        ".type ml_switch, @function\n"
        "ml_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  subq $8, %rsp\n"
        "  stmxcsr (%rsp)\n"
        "  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n"
        "  fldcw 4(%rsp)\n"
        "  addq $8, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size ml_switch, .-ml_switch\n");

/* the first switch to a fiber returns here, on its stack; the fiber to
 * start is the thread's running one, set by ml_fiber_resume */
static void trampoline(void) {
  ml_fiber *f = running;
  f->fn(f->arg);
  f->done = 1;
  ml_switch(&f->sp, f->back);
  abort();                      /* a finished fiber is never resumed */
}

/* the stack's top as ml_switch leaves it: the control words, six
 * registers, the return address (trampoline), and a zero above it where a
 * call would have put trampoline's own.  A function starts with its stack
 * pointer 8 past a multiple of 16: sp + 64 is, as the top is page-aligned
 * and sp is 88 bytes below it. */
static int context_init(ml_fiber *f) {
  uint64_t *sp = (uint64_t *)(f->map + page() + STACK_SIZE) - 11;
  uint32_t csr;
  uint16_t cw;
  __asm__ volatile("stmxcsr %0" : "=m"(csr));
  __asm__ volatile("fnstcw %0" : "=m"(cw));
  memset(sp, 0, 9 * sizeof *sp);
  memcpy(sp, &csr, sizeof csr);
  memcpy((char *)sp + 4, &cw, sizeof cw);
  sp[7] = (uint64_t)(uintptr_t)trampoline;
  f->sp = sp;
  return 0;
}

static void switch_in(ml_fiber *f) { ml_switch(&f->back, f->sp); }
static void switch_out(ml_fiber *f) { ml_switch(&f->sp, f->back); }
#else
/* getcontext returns twice (setjmp's kind): kept out of the callers'
 * frames */
__attribute__((noinline)) static int context_get(ucontext_t *c) { return getcontext(c); }

/* makecontext passes int arguments only: the fiber to start is the
 * thread's running one, set by ml_fiber_resume */
static void trampoline(void) {
  ml_fiber *f = running;
  f->fn(f->arg);
  f->done = 1;
  /* uc_link is f->back: returning resumes the resumer */
}

static int context_init(ml_fiber *f) {
  if (context_get(&f->ctx) != 0) return -1;
  f->ctx.uc_stack.ss_sp = f->map + page();
  f->ctx.uc_stack.ss_size = STACK_SIZE;
  f->ctx.uc_link = &f->back;
  makecontext(&f->ctx, trampoline, 0);
  return 0;
}

static void switch_in(ml_fiber *f) { swapcontext(&f->back, &f->ctx); }
static void switch_out(ml_fiber *f) { swapcontext(&f->ctx, &f->back); }
#endif

int ml_fiber_available(void) {
#ifdef ML_NO_FIBERS
  return 0;
#else
  return 1;
#endif
}

ml_fiber *ml_fiber_new(void (*fn)(void *), void *arg) {
#ifdef ML_NO_FIBERS
  (void)fn;
  (void)arg;
  (void)stack_get;              /* kept for the build without sanitizers */
  (void)context_init;
  return NULL;
#else
  ml_fiber *f = (ml_fiber *)calloc(1, sizeof *f);
  if (!f) return NULL;
  if (!(f->map = stack_get()) || context_init(f) != 0) {
    if (f->map) stack_put(f->map);
    free(f);
    return NULL;
  }
  f->fn = fn;
  f->arg = arg;
  f->fd = -1;
#ifdef ML_VALGRIND
  f->vg_id = VALGRIND_STACK_REGISTER(f->map + page(), f->map + page() + STACK_SIZE);
#endif
  return f;
#endif
}

int ml_fiber_resume(ml_fiber *f, int cancel) {
  ml_fiber *outer = running;
  if (f->done) return 1;
  f->cancel = cancel;
  running = f;
  switch_in(f);
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
  switch_out(f);
  f->fd = -1;
  f->req = NULL;
  return f->cancel ? -1 : 0;
}

int ml_fiber_wait(int fd, int64_t deadline_us) { return wait_for(fd, NULL, deadline_us); }
int ml_fiber_ask(void *req, int64_t deadline_us) { return wait_for(-1, req, deadline_us); }
