/*
 * tests/test_scale.c - costs that must not grow with the number of live
 * buffers (issue 25; bench/bench_scale.c measures them), and the locked-bytes
 * count (core/locked.c) that dmem_stats reads instead of walking the handle
 * table.
 */
#include <pthread.h>
#include <time.h>

#include "check.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t locked(dmem_runtime_t *rt) {
  dmem_stats_t s;
  if (dmem_stats(rt, &s) != DMEM_OK) return (size_t)-1;
  return s.device_locked;
}

/* Fastest of 15 runs of 50 dmem_stats calls, ns per call (the fastest: a
 * loaded machine may stall any one run). */
static double stats_ns(dmem_runtime_t *rt) {
  double best = 1e30;
  for (int r = 0; r < 15; r++) {
    dmem_stats_t s;
    uint64_t t0 = now_ns();
    for (int i = 0; i < 50; i++)
      if (dmem_stats(rt, &s) != DMEM_OK) return 1e30;
    double ns = (double)(now_ns() - t0) / 50.0;
    if (ns < best) best = ns;
  }
  return best;
}

/* dmem_stats at 2 * 10^5 live buffers costs about what it costs at 16: it
 * used to walk every slot of the handle table for device_locked (about 300
 * times slower at 10^5 buffers than at 10^3 on the CI machine: about a
 * millisecond a call). The bound leaves a factor of 8 and 5 us for noise. */
TEST_CASE(stats_cost_does_not_grow_with_buffers) {
  const size_t many = 200000;
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  dmem_handle_t few[16];
  for (int i = 0; i < 16; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 256, 0, &few[i]));
  double t_few = stats_ns(rt);
  dmem_handle_t *hs = malloc(many * sizeof *hs);
  REQUIRE_TRUE(hs != NULL);
  for (size_t i = 0; i < many; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 256, 0, &hs[i]));
  double t_many = stats_ns(rt);
  fprintf(stderr, "dmem_stats: %.0f ns at 16 buffers, %.0f ns at %zu\n", t_few, t_many,
          many + 16);
  CHECK_LT(t_many, 8.0 * t_few + 5000.0);
  void *p;
  REQUIRE_OK(dmem_buffer_lock(rt, hs[many - 1], NULL, &p));
  CHECK_UEQ(locked(rt), 256);
  REQUIRE_OK(dmem_buffer_unlock(rt, hs[many - 1]));
  CHECK_UEQ(locked(rt), 0);
  for (size_t i = 0; i < many; i++) REQUIRE_OK(dmem_buffer_free(rt, hs[i]));
  for (int i = 0; i < 16; i++) REQUIRE_OK(dmem_buffer_free(rt, few[i]));
  free(hs);
  dmem_runtime_destroy(rt);
}

typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h;
  int op; /* 0: lock, 1: unlock */
  dmem_status_t st;
} lock_job_t;

static void *lock_job(void *p) {
  lock_job_t *j = p;
  void *ptr;
  j->st = j->op == 0 ? dmem_buffer_lock(j->rt, j->h, NULL, &ptr) : dmem_buffer_unlock(j->rt, j->h);
  return NULL;
}

static dmem_status_t on_thread(dmem_runtime_t *rt, dmem_handle_t h, int op) {
  lock_job_t j = {rt, h, op, DMEM_ERR_INVALID_ARGUMENT};
  pthread_t t;
  if (pthread_create(&t, NULL, lock_job, &j) != 0) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  pthread_join(t, NULL); /* the thread exits: its record is folded */
  return j.st;
}

/* device_locked is the bytes of buffers with a lock count above 0, whoever
 * locked and unlocked them: locks taken on a thread that has exited, an
 * unlock on another thread than the lock, nested locks counted once, a lock
 * that brings a spilled buffer back, and a free while locked. */
TEST_CASE(device_locked_across_threads_and_paths) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t a, b, c;
  REQUIRE_OK(dmem_buffer_alloc(rt, 64 * KiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, 128 * KiB, 0, &b));
  REQUIRE_OK(dmem_buffer_alloc(rt, 256 * KiB, 0, &c));
  CHECK_UEQ(locked(rt), 0);
  /* locked on a thread that exits, unlocked here */
  REQUIRE_OK(on_thread(rt, a, 0));
  CHECK_UEQ(locked(rt), 64 * KiB);
  void *p;
  REQUIRE_OK(dmem_buffer_lock(rt, a, NULL, &p)); /* nested: counted once */
  CHECK_UEQ(locked(rt), 64 * KiB);
  REQUIRE_OK(dmem_buffer_unlock(rt, a));
  CHECK_UEQ(locked(rt), 64 * KiB);
  REQUIRE_OK(dmem_buffer_unlock(rt, a));
  CHECK_UEQ(locked(rt), 0);
  /* locked here, unlocked on a thread that exits */
  REQUIRE_OK(dmem_buffer_lock(rt, b, NULL, &p));
  CHECK_UEQ(locked(rt), 128 * KiB);
  REQUIRE_OK(on_thread(rt, b, 1));
  CHECK_UEQ(locked(rt), 0);
  /* the lock's slow path: a spilled buffer comes back locked */
  REQUIRE_OK(dmem_buffer_spill(rt, c, DMEM_TIER_HOST));
  REQUIRE_OK(dmem_buffer_lock(rt, c, NULL, &p));
  CHECK_UEQ(locked(rt), 256 * KiB);
  /* freed while locked: still locked until the unlock reclaims it */
  REQUIRE_OK(dmem_buffer_free(rt, c));
  CHECK_UEQ(locked(rt), 256 * KiB);
  REQUIRE_OK(dmem_buffer_unlock(rt, c));
  CHECK_UEQ(locked(rt), 0);
  /* a failed unlock changes nothing */
  CHECK_STATUS(dmem_buffer_unlock(rt, a), DMEM_ERR_NOT_LOCKED);
  CHECK_UEQ(locked(rt), 0);
  REQUIRE_OK(dmem_buffer_free(rt, a));
  REQUIRE_OK(dmem_buffer_free(rt, b));
  dmem_runtime_destroy(rt);
}

/* More live runtimes than the records have columns (64): the ones past it
 * count in their table's shared counter, and each runtime's figure is its
 * own. A runtime destroyed with a buffer still locked leaves nothing in the
 * column the next runtime takes. */
TEST_CASE(device_locked_per_runtime_past_the_columns) {
  enum { N = 66 };
  dmem_runtime_t *rts[N];
  dmem_handle_t hs[N];
  void *p;
  for (int i = 0; i < N; i++) {
    rts[i] = check_runtime(4 * MiB);
    REQUIRE_OK(dmem_buffer_alloc(rts[i], (size_t)(i + 1) * KiB, 0, &hs[i]));
    REQUIRE_OK(dmem_buffer_lock(rts[i], hs[i], NULL, &p));
  }
  for (int i = 0; i < N; i++) CHECK_UEQ(locked(rts[i]), (size_t)(i + 1) * KiB);
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_buffer_unlock(rts[i], hs[i]));
    CHECK_UEQ(locked(rts[i]), 0);
  }
  /* destroyed with a lock held: its column goes to the next runtime clean */
  REQUIRE_OK(dmem_buffer_lock(rts[0], hs[0], NULL, &p));
  for (int i = 0; i < N; i++) {
    if (i > 0) REQUIRE_OK(dmem_buffer_free(rts[i], hs[i]));
    dmem_runtime_destroy(rts[i]);
  }
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  CHECK_UEQ(locked(rt), 0);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 4 * KiB, 0, &h));
  REQUIRE_OK(on_thread(rt, h, 0));
  CHECK_UEQ(locked(rt), 4 * KiB);
  REQUIRE_OK(dmem_buffer_unlock(rt, h));
  CHECK_UEQ(locked(rt), 0);
  REQUIRE_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}
