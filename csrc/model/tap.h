/*
 * TAP for the C test programs (model/test.c, driver/test_fiber.c): ok()
 * prints a line per check, tap_end() the plan and answers the exit status
 * (1 when a check failed).  Included by a test program alone.
 */
#ifndef MONGOLOCK_TAP_H
#define MONGOLOCK_TAP_H

#include <stdarg.h>
#include <stdio.h>

static int tap_tests, tap_failures;

__attribute__((format(printf, 2, 3))) static void ok(int cond, const char *fmt, ...) {
  va_list ap;
  tap_tests++;
  if (!cond) tap_failures++;
  printf("%sok %d - ", cond ? "" : "not ", tap_tests);
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
}

static int tap_end(void) {
  printf("1..%d\n", tap_tests);
  return tap_failures ? 1 : 0;
}

#endif
