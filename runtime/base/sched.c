/*
 * runtime/base/sched.c - the schedule fuzzer (see sched.h). Compiled into
 * every build, empty unless DMEM_SCHED_FUZZ is defined.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "base/sched.h"

#ifdef DMEM_SCHED_FUZZ
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "base/atomic.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static uint64_t seed;     /* written once under `once` */
static uint64_t rate = 8; /* likewise */
/* Order in which threads first reach a point: part of each thread's seed. */
static _Atomic uint64_t next_thread;
static _Thread_local uint64_t state; /* 0 until the thread's first point */

static void read_env(void) {
  const char *s = getenv("DMEM_SCHED_SEED");
  if (s && *s) seed = strtoull(s, NULL, 0);
  const char *r = getenv("DMEM_SCHED_RATE");
  if (r && *r) {
    unsigned long long v = strtoull(r, NULL, 0);
    if (v >= 1 && v <= 1u << 20) rate = v;
  }
}

uint64_t dmem__sched_seed(void) {
  pthread_once(&once, read_env);
  return seed;
}

/* splitmix64: a good generator from any start, including small seeds. */
static uint64_t next_rand(void) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void nap(uint64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
  nanosleep(&ts, NULL);
}

void dmem__sched_point(void) {
  if (dmem__sched_seed() == 0) return;
  if (state == 0) {
    /* relaxed: the counter only numbers threads, it orders nothing */
    uint64_t t = dmem_atomic_add_relaxed(&next_thread, 1);
    state = seed * 0x2545F4914F6CDD1Dull + t * 0x9E3779B97F4A7C15ull + 1;
  }
  uint64_t r = next_rand();
  uint64_t pick = r % (256 * rate);
  if (pick == 0)
    nap(((r >> 20) % 2000 + 1) * 1000); /* up to 2 ms */
  else if (pick < 32)
    nap(((r >> 20) % 200 + 1) * 1000); /* up to 200 us */
  else if (pick < 256)
    sched_yield();
}
#else
/* ISO C wants a declaration in every file. */
typedef int dmem__sched_c_unused;
#endif
