/*
 * bench/bench_common.h - what the C benchmarks of bench/ share: a monotonic
 * clock, the median of repetitions, and leaving on a dmem error with the
 * benchmark's name (BENCH_NAME, defined before the include) and the
 * error's detail: exit 77 (skipped) when the error is DMEM_ERR_NO_DEVICE
 * (DMEM_BACKEND asks for a device that is not there), else 1.
 */
#ifndef DMEM_BENCH_COMMON_H
#define DMEM_BENCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <dmem/dmem.h>

#ifndef BENCH_NAME
#error "define BENCH_NAME (the program's name, for its error messages) before bench_common.h"
#endif

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of v[0..n) (sorts v). */
static inline double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static inline void die(const char *what, dmem_status_t st) {
  fprintf(stderr, BENCH_NAME ": %s: %s (%s)\n", what, dmem_status_name(st),
          dmem_last_error_detail());
  exit(st == DMEM_ERR_NO_DEVICE ? 77 : 1);
}

#define TRY(call)                        \
  do {                                   \
    dmem_status_t st_ = (call);          \
    if (st_ != DMEM_OK) die(#call, st_); \
  } while (0)

#endif
