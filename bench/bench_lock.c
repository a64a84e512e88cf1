/*
 * bench/bench_lock.c - cost of the lock fast path and of the RMMEP-1 launch
 * entry points, each against a baseline measured in the same run:
 *
 *   lock+unlock of a resident buffer    vs  two uncontended CAS on a plain
 *                                           _Atomic uint64_t (the floor of
 *                                           any lock that counts)
 *   launch_async + sync_and_unlock      vs  a bare dmem_stream_synchronize of
 *   (no-op launch fn; 1, 4, 16 handles)     the same stream (what the caller
 *                                           pays anyway)
 *   1000 x launch_async (the "kernel":     vs  the same host function enqueued
 *   a no-op host function), then one        bare 1000 times, then a
 *   sync_and_unlock; or with a              dmem_stream_synchronize (the launch
 *   dmem_stream_release after each          rows of bench_spill; RESULT
 *   launch, then a synchronize              bench_lock.launch_batched / _release)
 *   dmem part of launch + release: 1000 vs  two CAS (the lock+unlock floor);
 *   x (launch_async with a no-op launch     RESULT bench_lock.release_pair_ns
 *   function + stream_release), then a
 *   synchronize and a poll, ns per pair
 *   lock+unlock, 4 threads, each on its vs  4 threads doing the CAS pair on
 *   own buffer (aggregate ns per pair;      distinct cache lines
 *   buffers adjacent in the handle table,
 *   then 64 slots apart)
 *
 * Each figure is the median of several repetitions of many iterations.
 * Backend: DMEM_BACKEND if set, else the host backend. The single-thread
 * lock+unlock figure is also printed as `RESULT bench_lock.lock_unlock_ns=`
 * (scripts/gpu-test judges it against 50 ns: scripts/gpu_targets.py).
 *
 *   bench_lock [--quick] [--max-lock-ns N] [--pairs N]
 *
 * --quick: fewer iterations (the CTest run, bench.lock). --max-lock-ns N:
 * exit 1 if the single-thread lock+unlock median exceeds N ns. --pairs N: run
 * N (rounded up to a multiple of 1000) of the dmem-part pairs and nothing
 * else (for instruction counts: callgrind at two N, the difference divided). Exit 77 when
 * DMEM_BACKEND asks for a device that is not there.
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <dmem/dmem.h>

#include "api/api.h" /* rt->release_gap_ns / release_age_ns (--pairs) */

#define BENCH_NAME "bench_lock"
#include "bench_common.h"

#define NTHREADS 4
#define MAX_REPS 15

static int g_reps = 9;
static long g_lock_iters = 2000000;   /* lock+unlock pairs per repetition */
static long g_launch_iters = 100000;  /* launch+sync pairs per repetition */
static long g_mt_iters = 1000000;     /* pairs per thread per repetition */

/* ---- what is measured -------------------------------------------------------- */

#define SPACING 64 /* handle slots between the "spaced" threads' buffers */

typedef struct ctx {
  dmem_runtime_t *rt;
  dmem_stream_t stream;
  dmem_handle_t h[16];                    /* consecutive allocations */
  dmem_handle_t spaced[NTHREADS * SPACING]; /* thread i uses spaced[i * SPACING] */
} ctx_t;

static _Atomic uint64_t g_word;

/* ns per iteration of one kind of work, for one repetition */
typedef double (*measure_fn)(ctx_t *c, long iters, size_t n);

static double m_cas_pair(ctx_t *c, long iters, size_t n) {
  (void)c;
  (void)n;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    uint64_t e = atomic_load_explicit(&g_word, memory_order_relaxed);
    while (!atomic_compare_exchange_strong_explicit(&g_word, &e, e + 1, memory_order_acq_rel,
                                                    memory_order_acquire)) {
    }
    e++;
    while (!atomic_compare_exchange_strong_explicit(&g_word, &e, e - 1, memory_order_acq_rel,
                                                    memory_order_acquire)) {
    }
  }
  return (double)(now_ns() - t0) / (double)iters;
}

static double m_lock_pair(ctx_t *c, long iters, size_t n) {
  (void)n;
  void *p = NULL;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_status_t a = dmem_buffer_lock(c->rt, c->h[0], NULL, &p);
    dmem_status_t b = dmem_buffer_unlock(c->rt, c->h[0]);
    if (a != DMEM_OK || b != DMEM_OK) die("dmem_lock/dmem_unlock", a != DMEM_OK ? a : b);
  }
  return (double)(now_ns() - t0) / (double)iters;
}

static dmem_status_t noop_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)user;
  (void)s;
  (void)ptrs;
  (void)n;
  return DMEM_OK;
}

static double m_launch(ctx_t *c, long iters, size_t n) {
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_status_t a = dmem_launch_async(c->rt, c->stream, c->h, n, noop_launch, NULL);
    if (a != DMEM_OK) die("dmem_launch_async", a);
    a = dmem_sync_and_unlock(c->rt, c->stream);
    if (a != DMEM_OK) die("dmem_sync_and_unlock", a);
  }
  return (double)(now_ns() - t0) / (double)iters;
}

static double m_sync(ctx_t *c, long iters, size_t n) {
  (void)n;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_status_t a = dmem_stream_synchronize(c->rt, c->stream);
    if (a != DMEM_OK) die("dmem_stream_synchronize", a);
  }
  return (double)(now_ns() - t0) / (double)iters;
}

/* The launch rows of bench_spill on any backend: the "kernel" is a no-op
 * host function (dmem_stream_enqueue_host: cudaLaunchHostFunc under CUDA,
 * the stream thread's work item on the host backend). 1000 launches a
 * repetition; dmem's launch function enqueues the same host function. */
static void noop_host(void *user) { (void)user; }

static dmem_status_t host_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)ptrs;
  (void)n;
  return dmem_stream_enqueue_host((dmem_runtime_t *)user, s, noop_host, NULL);
}

/* n: 0 = then one sync_and_unlock, 1 = a dmem_stream_release after each
 * launch, then a dmem_stream_synchronize */
static double m_launch_kernel(ctx_t *c, long iters, size_t n) {
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_status_t a = dmem_launch_async(c->rt, c->stream, c->h, 1, host_launch, c->rt);
    if (a != DMEM_OK) die("dmem_launch_async", a);
    if (n == 1 && (a = dmem_stream_release(c->rt, c->stream)) != DMEM_OK)
      die("dmem_stream_release", a);
  }
  dmem_status_t a = n == 1 ? dmem_stream_synchronize(c->rt, c->stream)
                           : dmem_sync_and_unlock(c->rt, c->stream);
  if (a != DMEM_OK) die("sync", a);
  double ns = (double)(now_ns() - t0) / (double)iters;
  if (n == 1 && (a = dmem_runtime_poll(c->rt)) != DMEM_OK) die("dmem_runtime_poll", a);
  return ns;
}

/* The dmem part of launch + release: 1000 x (dmem_launch_async with a no-op
 * launch function, which enqueues nothing, + dmem_stream_release), then a
 * dmem_stream_synchronize and a dmem_runtime_poll (which unlock what is
 * left); ns per pair, the final calls included. */
static double m_pair(ctx_t *c, long iters, size_t n) {
  (void)n;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_status_t a = dmem_launch_async(c->rt, c->stream, c->h, 1, noop_launch, NULL);
    if (a != DMEM_OK) die("dmem_launch_async", a);
    if ((a = dmem_stream_release(c->rt, c->stream)) != DMEM_OK) die("dmem_stream_release", a);
  }
  dmem_status_t a = dmem_stream_synchronize(c->rt, c->stream);
  if (a != DMEM_OK) die("dmem_stream_synchronize", a);
  if ((a = dmem_runtime_poll(c->rt)) != DMEM_OK) die("dmem_runtime_poll", a);
  return (double)(now_ns() - t0) / (double)iters;
}

static double m_bare_kernel(ctx_t *c, long iters, size_t n) {
  (void)n;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_status_t a = dmem_stream_enqueue_host(c->rt, c->stream, noop_host, NULL);
    if (a != DMEM_OK) die("dmem_stream_enqueue_host", a);
  }
  dmem_status_t a = dmem_stream_synchronize(c->rt, c->stream);
  if (a != DMEM_OK) die("dmem_stream_synchronize", a);
  return (double)(now_ns() - t0) / (double)iters;
}

/* Median over g_reps repetitions, dmem and baseline interleaved so that both
 * see the same machine state; one warm-up repetition each first. */
static void measure(ctx_t *c, measure_fn dmem_fn, measure_fn base_fn, long iters, size_t n,
                    double *dmem_ns, double *base_ns) {
  double a[MAX_REPS], b[MAX_REPS];
  (void)dmem_fn(c, iters / 10 + 1, n);
  (void)base_fn(c, iters / 10 + 1, n);
  for (int r = 0; r < g_reps; r++) {
    a[r] = dmem_fn(c, iters, n);
    b[r] = base_fn(c, iters, n);
  }
  *dmem_ns = median(a, g_reps);
  *base_ns = median(b, g_reps);
}

/* ---- multi-threaded lock+unlock ---------------------------------------------- */

typedef struct padded_word {
  alignas(128) _Atomic uint64_t w;
} padded_word_t;

typedef struct mt_arg {
  ctx_t *c;
  dmem_handle_t h;
  int index;
  bool baseline;
  long iters;
  pthread_barrier_t *barrier;
  padded_word_t *words;
  uint64_t t0, t1;
} mt_arg_t;

static void *mt_main(void *p) {
  mt_arg_t *a = (mt_arg_t *)p;
  pthread_barrier_wait(a->barrier);
  a->t0 = now_ns();
  if (a->baseline) {
    _Atomic uint64_t *w = &a->words[a->index].w;
    for (long i = 0; i < a->iters; i++) {
      uint64_t e = atomic_load_explicit(w, memory_order_relaxed);
      while (!atomic_compare_exchange_strong_explicit(w, &e, e + 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
      }
      e++;
      while (!atomic_compare_exchange_strong_explicit(w, &e, e - 1, memory_order_acq_rel,
                                                      memory_order_acquire)) {
      }
    }
  } else {
    dmem_handle_t h = a->h;
    void *ptr = NULL;
    for (long i = 0; i < a->iters; i++) {
      dmem_status_t x = dmem_buffer_lock(a->c->rt, h, NULL, &ptr);
      dmem_status_t y = dmem_buffer_unlock(a->c->rt, h);
      if (x != DMEM_OK || y != DMEM_OK) die("dmem_lock/dmem_unlock (thread)", x ? x : y);
    }
  }
  a->t1 = now_ns();
  return NULL;
}

/* Aggregate ns per pair: wall time of all threads / pairs done by all.
 * Thread i locks c->h[i] (neighbouring slots of the handle table) or, with
 * `spaced`, c->spaced[i * SPACING]. */
static double mt_run(ctx_t *c, bool baseline, bool spaced, long iters) {
  static padded_word_t words[NTHREADS];
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, NTHREADS);
  pthread_t th[NTHREADS];
  mt_arg_t args[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    dmem_handle_t h = spaced ? c->spaced[i * SPACING] : c->h[i];
    args[i] = (mt_arg_t){c, h, i, baseline, iters, &barrier, words, 0, 0};
    if (pthread_create(&th[i], NULL, mt_main, &args[i]) != 0) {
      fprintf(stderr, "bench_lock: pthread_create failed\n");
      exit(1);
    }
  }
  uint64_t t0 = UINT64_MAX, t1 = 0;
  for (int i = 0; i < NTHREADS; i++) {
    pthread_join(th[i], NULL);
    if (args[i].t0 < t0) t0 = args[i].t0;
    if (args[i].t1 > t1) t1 = args[i].t1;
  }
  pthread_barrier_destroy(&barrier);
  return (double)(t1 - t0) / ((double)iters * NTHREADS);
}

/* n: 0 for neighbouring buffers, 1 for spaced ones */
static double m_mt_dmem(ctx_t *c, long iters, size_t n) { return mt_run(c, false, n != 0, iters); }
static double m_mt_base(ctx_t *c, long iters, size_t n) { return mt_run(c, true, n != 0, iters); }

/* ---- main ------------------------------------------------------------------- */

static void row(const char *what, double d, double b) {
  printf("%-44s | %9.1f | %11.1f | %6.2f\n", what, d, b, b > 0 ? d / b : 0.0);
}

int main(int argc, char **argv) {
  double max_lock_ns = 0;
  bool quick = false;
  long pairs = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (strcmp(argv[i], "--max-lock-ns") == 0 && i + 1 < argc) {
      max_lock_ns = strtod(argv[++i], NULL);
    } else if (strcmp(argv[i], "--pairs") == 0 && i + 1 < argc) {
      pairs = strtol(argv[++i], NULL, 10);
    } else {
      fprintf(stderr, "usage: %s [--quick] [--max-lock-ns N] [--pairs N]\n", argv[0]);
      return 2;
    }
  }
  if (quick) {
    g_reps = 5;
    g_lock_iters = 200000;
    g_launch_iters = 10000;
    g_mt_iters = 100000;
  }

  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = 64u << 20;
  ctx_t c;
  memset(&c, 0, sizeof c);
  dmem_status_t st = dmem_runtime_create(&cfg, &c.rt);
  if (st == DMEM_ERR_NO_DEVICE) {
    fprintf(stderr, "SKIP: no device for DMEM_BACKEND=%s\n", getenv("DMEM_BACKEND"));
    return 77;
  }
  if (st != DMEM_OK) die("dmem_runtime_create", st);
  TRY(dmem_stream_create(c.rt, &c.stream));
  for (int i = 0; i < 16; i++) TRY(dmem_buffer_alloc(c.rt, 4096, 0, &c.h[i]));
  for (int i = 0; i < NTHREADS * SPACING; i++) TRY(dmem_buffer_alloc(c.rt, 4096, 0, &c.spaced[i]));

  if (pairs > 0) {
    /* only the dmem part of launch + release, pairs times (1000 at a time),
     * for an instruction count: run twice with different N under
     * valgrind --tool=callgrind and divide the difference */
    /* the grouping by count alone (a group records at its 64th release):
     * the time rules would make the count depend on how fast the run goes
     * (valgrind slows it some 50 times) */
    c.rt->release_gap_ns = c.rt->release_age_ns = 3600ull * 1000000000u;
    for (long done = 0; done < pairs; done += 1000) (void)m_pair(&c, 1000, 0);
    TRY(dmem_stream_destroy(c.rt, c.stream));
    dmem_runtime_destroy(c.rt);
    return 0;
  }
#ifdef __OPTIMIZE__
  const char *opt = "optimised";
#else
  const char *opt = "NOT optimised (-O0): set CMAKE_BUILD_TYPE=Release for real figures";
#endif
  printf("bench_lock: backend %s, %s, %d repetitions (median), %s\n",
         dmem_runtime_backend(c.rt) == DMEM_BACKEND_CUDA ? "cuda" : "host",
         quick ? "quick" : "full", g_reps, opt);
  printf("%-44s | %9s | %11s | %6s\n", "what", "dmem ns", "baseline ns", "ratio");
  printf("---------------------------------------------+-----------+-------------+-------\n");

  double d, b, lock_ns;
  measure(&c, m_lock_pair, m_cas_pair, g_lock_iters, 1, &d, &b);
  lock_ns = d;
  row("dmem_lock+dmem_unlock (resident)", d, b);
  printf("RESULT bench_lock.lock_unlock_ns=%.2f\n", d);
  static const size_t ns[] = {1, 4, 16};
  for (int i = 0; i < 3; i++) {
    char name[64];
    snprintf(name, sizeof name, "launch_async+sync_and_unlock, %zu handle%s", ns[i],
             ns[i] > 1 ? "s" : "");
    measure(&c, m_launch, m_sync, g_launch_iters, ns[i], &d, &b);
    row(name, d, b);
  }
  measure(&c, m_launch_kernel, m_bare_kernel, 1000, 0, &d, &b);
  row("1000 launches, then sync_and_unlock", d, b);
  printf("RESULT bench_lock.launch_batched=%.4f\n", d / b);
  measure(&c, m_launch_kernel, m_bare_kernel, 1000, 1, &d, &b);
  row("1000 x (launch + stream_release), then sync", d, b);
  printf("RESULT bench_lock.launch_release=%.4f\n", d / b);
  measure(&c, m_pair, m_cas_pair, 1000, 0, &d, &b);
  row("dmem part: 1000 x (no-op launch + release)", d, b);
  printf("RESULT bench_lock.release_pair_ns=%.1f\n", d);
  int saved = g_reps;
  g_reps = quick ? 3 : 5;
  measure(&c, m_mt_dmem, m_mt_base, g_mt_iters, 0, &d, &b);
  row("lock+unlock, 4 threads, adjacent buffers", d, b);
  measure(&c, m_mt_dmem, m_mt_base, g_mt_iters, 1, &d, &b);
  row("lock+unlock, 4 threads, spaced buffers", d, b);
  g_reps = saved;
  printf("baselines: lock+unlock = two CAS on a plain _Atomic uint64_t; launch rows = "
         "dmem_stream_synchronize of the same (idle) stream; 1000-launch rows = the same "
         "no-op host function enqueued bare (dmem_stream_enqueue_host), then a "
         "synchronisation (bench_spill's launch rows with a host function for the "
         "kernel); 4 threads = the CAS pair on "
         "4 distinct cache lines. 4-thread rows: aggregate ns per pair (wall time / all "
         "pairs), each thread on its own buffer: adjacent = 4 consecutive allocations, "
         "spaced = %d handle slots apart\n", SPACING);

  /* Sanity: every lock was released. */
  for (int i = 0; i < 16; i++) {
    dmem_buffer_info_t info;
    TRY(dmem_buffer_info(c.rt, c.h[i], &info));
    if (info.lock_count != 0 || info.state != DMEM_STATE_RESIDENT) {
      fprintf(stderr, "bench_lock: buffer %d left with lock count %u, state %d\n", i,
              info.lock_count, (int)info.state);
      return 1;
    }
  }
  for (int i = 0; i < 16; i++) TRY(dmem_buffer_free(c.rt, c.h[i]));
  for (int i = 0; i < NTHREADS * SPACING; i++) TRY(dmem_buffer_free(c.rt, c.spaced[i]));
  TRY(dmem_stream_destroy(c.rt, c.stream));
  dmem_runtime_destroy(c.rt);

  if (max_lock_ns > 0 && lock_ns > max_lock_ns) {
    fprintf(stderr, "bench_lock: lock+unlock %.1f ns exceeds --max-lock-ns %.1f\n", lock_ns,
            max_lock_ns);
    return 1;
  }
  return 0;
}
