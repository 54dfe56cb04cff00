/*
 * The fibers (fiber.h) linked alone and driven through their functions:
 * what a switch must keep (the resumer's and the fiber's locals, the
 * floating-point control of each, a stack aligned for SSE), waits on a
 * descriptor and on a request, a cancelled wait, and more fibers alive at
 * once than stacks are kept.  No Lua, no libmongoc.  Built twice by the
 * Makefile: with the x86-64 switch where there is one (build/test/fiber)
 * and on ucontext (build/test/fiber-ucontext, -DML_FIBER_UCONTEXT).
 * Prints TAP; exits 1 when a test failed.
 *
 *   make build/test/fiber && build/test/fiber
 */
#include <fenv.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fiber.h"
#include "tap.h"

/* ---- a fiber that waits n times on descriptor 7, summing as it goes ---- */

struct counting {
  int n, waits, cancelled;
  volatile double sum;
  char text[64];
  uintptr_t aligned;            /* an SSE-aligned local's address mod 16 */
  uint64_t mix;                 /* what mix() made of the fiber's values */
};

/* eight values live across every switch: more than the callee-saved
 * registers, so that each of them holds one */
struct eight {
  uint64_t v[8];
};

static void mix(uint64_t *a, uint64_t *b, uint64_t *c, uint64_t *d, uint64_t *e, uint64_t *f, uint64_t *g,
                uint64_t *h) {
  *a = *a * 31 + *h;
  *b = *b * 17 + *a;
  *c = *c ^ (*b << 3);
  *d = *d + (*c >> 5);
  *e = *e * 7 + *d;
  *f = *f ^ *e;
  *g = *g + *f * 3;
  *h = *h * 13 + *g;
}

static uint64_t fold(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t e, uint64_t f, uint64_t g,
                     uint64_t h) {
  return a ^ (b << 1) ^ (c << 2) ^ (d << 3) ^ (e << 4) ^ (f << 5) ^ (g << 6) ^ (h << 7);
}

static uint64_t expected_mix(int n, uint64_t seed) {
  uint64_t a = seed, b = seed + 1, c = seed + 2, d = seed + 3, e = seed + 4, f = seed + 5, g = seed + 6,
           h = seed + 7;
  for (int i = 0; i < n; i++) mix(&a, &b, &c, &d, &e, &f, &g, &h);
  return fold(a, b, c, d, e, f, g, h);
}

/* the compiler may not know where a pointer points */
static uintptr_t laundered(void *p) {
  __asm__ volatile("" : "+r"(p));
  return (uintptr_t)p;
}

static void counting(void *arg) {
  struct counting *c = (struct counting *)arg;
  double local[2] __attribute__((aligned(16))) = { 0.5, 0.25 };
  uint64_t a = 11, b = 12, cc = 13, d = 14, e = 15, f = 16, g = 17, h = 18;
  c->aligned = laundered(local) % 16;
  for (int i = 0; i < c->n; i++) {
    if (ml_fiber_wait(7, 1000 + i) != 0) {
      c->cancelled = 1;
      return;
    }
    mix(&a, &b, &cc, &d, &e, &f, &g, &h);
    c->waits++;
    c->sum += local[i % 2] * (double)i;
  }
  c->mix = fold(a, b, cc, d, e, f, g, h);
  /* printf's double formatting uses aligned SSE stores: a misaligned
   * stack would crash here */
  snprintf(c->text, sizeof c->text, "%.3f", (double)c->sum);
}

static void test_waits(void) {
  struct counting c;
  memset(&c, 0, sizeof c);
  c.n = 1000;
  ml_fiber *f = ml_fiber_new(counting, &c);
  ok(f != NULL, "a fiber is made");
  if (!f) return;
  /* locals of the resumer live across the switches */
  uint64_t a = 1, b = 2, cc = 3, d = 4, e = 5, g = 6, h = 7, k = 8;
  int rounds = 0, fd_ok = 1, deadline_ok = 1;
  while (!ml_fiber_resume(f, 0)) {
    if (ml_fiber_fd(f) != 7) fd_ok = 0;
    if (ml_fiber_deadline(f) != 1000 + rounds) deadline_ok = 0;
    mix(&a, &b, &cc, &d, &e, &g, &h, &k);
    rounds++;
  }
  ok(rounds == 1000 && c.waits == 1000, "1000 waits, 1000 resumes (%d, %d)", rounds, c.waits);
  ok(fd_ok && deadline_ok, "each wait gives its descriptor and deadline");
  ok(ml_fiber_fd(f) == -1, "no descriptor once it ended");
  ok(fold(a, b, cc, d, e, g, h, k) == expected_mix(1000, 1), "the resumer's values are kept across the switches");
  ok(c.mix == expected_mix(1000, 11), "the fiber's values are kept across the switches");
  ok(c.aligned == 0, "a 16-byte aligned local on the fiber's stack is aligned");
  ok(strcmp(c.text, "187250.000") == 0, "the fiber's doubles (%s)", c.text);
  ok(ml_fiber_resume(f, 0) == 1, "an ended fiber answers 1 again");
  ml_fiber_free(f);
}

/* ---- floating-point control is each side's own -------------------------- */

struct rounding {
  int seen_inside[3];
  int upward_inside;            /* SSE division rounded upward each time */
};

/* 1/3 in the SSE unit, rounded as MXCSR says (fegetround reads x87's
 * control word only) */
static double third(void) {
  volatile double one = 1.0, three = 3.0;
  return one / three;
}

static void rounding(void *arg) {
  struct rounding *r = (struct rounding *)arg;
  double up;
  fesetround(FE_UPWARD);
  up = third();
  r->seen_inside[0] = fegetround();
  ml_fiber_wait(3, 0);
  r->seen_inside[1] = fegetround();
  r->upward_inside = third() == up;
  ml_fiber_wait(3, 0);
  r->seen_inside[2] = fegetround();
  r->upward_inside = r->upward_inside && third() == up;
}

static void test_rounding(void) {
  struct rounding r;
  memset(&r, 0, sizeof r);
  fesetround(FE_TONEAREST);
  double nearest = third();
  ml_fiber *f = ml_fiber_new(rounding, &r);
  if (!f) {
    ok(0, "a fiber is made");
    return;
  }
  ml_fiber_resume(f, 0);
  int outside1 = fegetround();
  int nearest_outside = third() == nearest;
  fesetround(FE_DOWNWARD);
  ml_fiber_resume(f, 0);
  int outside2 = fegetround();
  ml_fiber_resume(f, 0);
  fesetround(FE_TONEAREST);
  ok(r.seen_inside[0] == FE_UPWARD && r.seen_inside[1] == FE_UPWARD && r.seen_inside[2] == FE_UPWARD,
     "the fiber keeps its x87 rounding mode across switches");
  ok(r.upward_inside && third() == nearest, "and its SSE rounding (1/3 rounded up inside, to nearest outside)");
  ok(outside1 == FE_TONEAREST && nearest_outside && outside2 == FE_DOWNWARD, "the resumer keeps its own");
  ml_fiber_free(f);
}

/* ---- a request instead of a descriptor, and a cancelled wait ------------ */

static void asking(void *arg) {
  int *answers = (int *)arg;
  answers[0] = ml_fiber_ask(&answers[2], 42);
  answers[1] = ml_fiber_ask(&answers[3], 0);
}

static void test_ask_cancel(void) {
  int answers[4] = { 9, 9, 0, 0 };
  ml_fiber *f = ml_fiber_new(asking, answers);
  if (!f) {
    ok(0, "a fiber is made");
    return;
  }
  ok(ml_fiber_resume(f, 0) == 0, "a fiber that asks gives the loop back");
  ok(ml_fiber_request(f) == &answers[2] && ml_fiber_fd(f) == -1 && ml_fiber_deadline(f) == 42,
     "its request and deadline, no descriptor");
  ok(ml_fiber_resume(f, 0) == 0 && ml_fiber_request(f) == &answers[3], "the next request");
  ok(ml_fiber_resume(f, 1) == 1, "resumed cancelled, it ends");
  ok(answers[0] == 0 && answers[1] == -1, "the answered ask gives 0, the cancelled one -1");
  ml_fiber_free(f);
}

/* ---- more fibers at once than stacks are kept --------------------------- */

#define MANY 40

static void test_many(void) {
  struct counting c[MANY];
  ml_fiber *f[MANY];
  int made = 0, ended = 0, right = 1;
  memset(c, 0, sizeof c);
  for (int i = 0; i < MANY; i++) {
    c[i].n = 5 + i % 7;
    if ((f[i] = ml_fiber_new(counting, &c[i])) != NULL) made++;
  }
  ok(made == MANY, "%d fibers alive at once", made);
  if (made != MANY) return;
  for (int round = 0; ended < MANY && round < 100; round++)
    for (int i = 0; i < MANY; i++)
      if (f[i] && ml_fiber_resume(f[i], i == 3 && round == 2)) {
        ml_fiber_free(f[i]);
        f[i] = NULL;
        ended++;
      }
  for (int i = 0; i < MANY; i++) {
    if (i == 3) continue;
    if (c[i].waits != c[i].n || c[i].cancelled) right = 0;
  }
  ok(ended == MANY, "every one ended and was freed");
  ok(right, "each waited its own number of times, interleaved");
  ok(c[3].cancelled && c[3].waits == 1, "the one resumed cancelled saw its wait fail");
  /* the kept stacks serve new fibers */
  struct counting again;
  memset(&again, 0, sizeof again);
  again.n = 2;
  ml_fiber *g = ml_fiber_new(counting, &again);
  ok(g != NULL, "a fiber on a kept stack");
  if (g) {
    while (!ml_fiber_resume(g, 0)) {
    }
    ok(again.waits == 2 && ml_fiber_current() == NULL, "it runs; no fiber runs outside one");
    ml_fiber_free(g);
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  test_waits();
  test_rounding();
  test_ask_cancel();
  test_many();
  return tap_end();
}
