/*
 * bench/bench_alloc.c - what an allocation costs: dmem's device pool against
 * the allocators it replaces, every one measured in the same run.
 *
 *   alloc+free pair   one block allocated and freed again, ns per pair, at
 *                     256 B, 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB: on 1
 *                     thread; on 4 and 16 threads each with its own stream;
 *                     on 4 and 16 threads all on the default stream. Thread
 *                     rows give the aggregate (wall time from the common
 *                     start to the last thread's end / pairs of all
 *                     threads; the pairs of a repetition are split evenly)
 *                     and the speedup over the 1-thread figure.
 *   4 KiB, 1000 live  the 4 KiB pair with 1000 other blocks live (the
 *                     replay's first 1000 sizes, allocated first, untimed)
 *   replay            N live blocks (1000 and 10000) of log-uniform sizes
 *                     256 B..1 MiB; each step frees a random live block and
 *                     allocates a new one; ns per step. The sequence comes
 *                     from a fixed-seed PRNG, the same for every allocator
 *                     (each runs a prefix of it); the fill and the final
 *                     frees are not timed.
 *
 * Allocators (columns):
 *   dmem         dmem_device_malloc + dmem_device_free (raw pool memory)
 *   dmem buf     dmem_buffer_alloc + dmem_buffer_free (spillable buffers; 1 thread only)
 *   cudaMalloc   cudaMalloc + cudaFree (no stream: left out of the
 *                default-stream tables)
 *   MallocAsync  cudaMallocAsync + cudaFreeAsync on the device's default
 *                pool, release threshold UINT64_MAX
 *   RMM pool     rmm::mr::pool_memory_resource over cuda_memory_resource,
 *                8 GiB initial pool (built with RMM: DMEM_RMM_ROOT)
 *   RMM arena    rmm::mr::arena_memory_resource over cuda_memory_resource,
 *                8 GiB global arena
 * and, in a table of its own (built with RMM), dmem as an RMM resource
 * (dmem::rmm_resource, include/dmem/rmm.hpp) against the RMM pool, both
 * called through an rmm::device_async_resource_ref as RMM's users call the
 * current device resource, with RESULT lines.
 * Ratios are dmem / baseline: below 1 means dmem is faster.
 *
 * Everything is stream-ordered on the thread's stream (streams made by
 * dmem_stream_create, shared by every allocator; NULL in the default-stream
 * tables). Each timed loop ends with a synchronise of its stream, inside the
 * time. Every allocator first warms up, untimed, on the same case (runs of
 * growing length, at least two), which also sizes its repetitions to about
 * 50 ms (2 ms with --quick; at most 200000 pairs); then the allocators take
 * turns, repetition by repetition, and each figure is the median.
 *
 * Backends: under the CUDA backend every column runs. Under the host
 * backend (no GPU, or DMEM_BACKEND=host) only the dmem columns run, and they
 * measure the allocator's own CPU cost; the other columns say n/a. The host
 * backend gets a 2 GiB simulated device (DMEM_HOST_CAPACITY overrides); a
 * thread case whose live bytes would not fit twice over, or a replay whose
 * peak would not fit 1.5 times over, is skipped and says so. DMEM_BACKEND
 * picks the backend; without it dmem takes CUDA when a device is usable.
 * The last line gives dmem's 4 KiB pair alone and with 1000 live blocks
 * (target on the host backend: <= 150 ns).
 *
 *   bench_alloc [--quick] [--rmm-hook]
 *
 * --quick: 3 repetitions of ~2 ms and, on the host backend, only cases
 * needing at most 512 MiB (the CTest runs bench.alloc and cuda.bench.alloc).
 * --rmm-hook: only the RMM hook table (dmem::rmm_resource against the RMM
 * pool, built with RMM, CUDA backend).
 * Exit 77 when DMEM_BACKEND asks for a device that is not there; 1 on any
 * dmem, CUDA or RMM error; never fails on speed.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <dmem/dmem.h>

#define BENCH_NAME "bench_alloc"
#include "bench_common.h"
#include <dmem/device.h>

#ifdef DMEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#ifdef DMEM_BENCH_HAVE_RMM
#include "bench_alloc_rmm.h"
#endif

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

#define MAX_REPS 15
#define MAX_THREADS 16
#define HOST_CAPACITY_DEFAULT (2 * GiB)
#define QUICK_HOST_NEED_MAX (512 * MiB) /* --quick on the host backend */
#define RMM_BYTES (8 * GiB)             /* RMM pool's initial size, arena's size */

static int g_reps = 7;
static bool g_quick = false;
static bool g_rmm_hook_only = false; /* --rmm-hook: only table_rmm_hook */
static double g_budget_ns = 50e6;  /* aimed-at time of one repetition */
static long g_max_pairs = 200000;  /* most pairs in one repetition (all threads) */
static long g_replay_len = 200000; /* steps of the replay sequences (most per repetition) */

static dmem_runtime_t *g_rt;
static bool g_host;       /* the runtime is on the host backend */
static size_t g_capacity; /* the runtime's device limit */
static dmem_stream_t g_streams[MAX_THREADS];
#ifdef DMEM_HAVE_CUDA
static int g_device;
#endif

/* ---- helpers ----------------------------------------------------------------- */

#ifdef DMEM_HAVE_CUDA
#define CU(call)                                                               \
  do {                                                                         \
    cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "bench_alloc: %s: %s\n", #call, cudaGetErrorString(e_)); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)
#endif

static void size_name(char *out, size_t cap, size_t size) {
  if (size >= MiB)
    snprintf(out, cap, "%zu MiB", size / MiB);
  else if (size >= KiB)
    snprintf(out, cap, "%zu KiB", size / KiB);
  else
    snprintf(out, cap, "%zu B", size);
}

/* ---- the allocators ---------------------------------------------------------- */

typedef struct allocator {
  const char *name;   /* column header */
  bool available;     /* built and usable on this backend */
  bool single_thread; /* 1-thread rows only */
  bool streamless;    /* takes no stream: left out of the default-stream tables */
  void *(*alloc)(void *self, size_t n, dmem_stream_t s);
  void (*free)(void *self, void *p, size_t n, dmem_stream_t s);
  void *self;
} allocator_t;

/* A_RMM_DMEM and A_RMM_POOL (built with RMM) run only in table_rmm_hook:
 * dmem::rmm_resource and the RMM pool, each called through an
 * rmm::device_async_resource_ref, as RMM's users call the current resource. */
enum { A_DMEM, A_BUF, A_MALLOC, A_ASYNC, A_POOL, A_ARENA, A_RMM_DMEM, A_RMM_POOL, A_COUNT };

static void *dmem_raw_alloc(void *self, size_t n, dmem_stream_t s) {
  (void)self;
  void *p = NULL;
  TRY(dmem_device_malloc(g_rt, n, s, &p));
  return p;
}

static void dmem_raw_free(void *self, void *p, size_t n, dmem_stream_t s) {
  (void)self;
  (void)n;
  TRY(dmem_device_free(g_rt, p, s));
}

/* A buffer's handle travels in the void * (handles are never 0). */
static void *dmem_buf_alloc(void *self, size_t n, dmem_stream_t s) {
  (void)self;
  (void)s;
  dmem_handle_t h = DMEM_HANDLE_NULL;
  TRY(dmem_buffer_alloc(g_rt, n, DMEM_ALLOC_DEFAULT, &h));
  return (void *)(uintptr_t)h;
}

static void dmem_buf_free(void *self, void *p, size_t n, dmem_stream_t s) {
  (void)self;
  (void)n;
  (void)s;
  TRY(dmem_buffer_free(g_rt, (dmem_handle_t)(uintptr_t)p));
}

#ifdef DMEM_HAVE_CUDA
static void *cuda_malloc_alloc(void *self, size_t n, dmem_stream_t s) {
  (void)self;
  (void)s;
  void *p = NULL;
  CU(cudaMalloc(&p, n));
  return p;
}

static void cuda_malloc_free(void *self, void *p, size_t n, dmem_stream_t s) {
  (void)self;
  (void)n;
  (void)s;
  CU(cudaFree(p));
}

static void *cuda_async_alloc(void *self, size_t n, dmem_stream_t s) {
  (void)self;
  void *p = NULL;
  CU(cudaMallocAsync(&p, n, (cudaStream_t)s));
  return p;
}

static void cuda_async_free(void *self, void *p, size_t n, dmem_stream_t s) {
  (void)self;
  (void)n;
  CU(cudaFreeAsync(p, (cudaStream_t)s));
}
#endif

static allocator_t g_alloc[A_COUNT] = {
    [A_DMEM] = {"dmem", true, false, false, dmem_raw_alloc, dmem_raw_free, NULL},
    [A_BUF] = {"dmem buf", true, true, true, dmem_buf_alloc, dmem_buf_free, NULL},
#ifdef DMEM_HAVE_CUDA
    [A_MALLOC] = {"cudaMalloc", false, false, true, cuda_malloc_alloc, cuda_malloc_free, NULL},
    [A_ASYNC] = {"MallocAsync", false, false, false, cuda_async_alloc, cuda_async_free, NULL},
#else
    [A_MALLOC] = {"cudaMalloc", false, false, true, NULL, NULL, NULL},
    [A_ASYNC] = {"MallocAsync", false, false, false, NULL, NULL, NULL},
#endif
#ifdef DMEM_BENCH_HAVE_RMM
    [A_POOL] = {"RMM pool", false, false, false, bench_rmm_pool_alloc, bench_rmm_pool_free, NULL},
    [A_ARENA] = {"RMM arena", false, false, false, bench_rmm_arena_alloc, bench_rmm_arena_free,
                 NULL},
    [A_RMM_DMEM] = {"dmem via RMM", false, false, false, bench_rmm_ref_alloc, bench_rmm_ref_free,
                    NULL},
    [A_RMM_POOL] = {"pool via RMM", false, false, false, bench_rmm_ref_alloc, bench_rmm_ref_free,
                    NULL},
#else
    [A_POOL] = {"RMM pool", false, false, false, NULL, NULL, NULL},
    [A_ARENA] = {"RMM arena", false, false, false, NULL, NULL, NULL},
    [A_RMM_DMEM] = {"dmem via RMM", false, false, false, NULL, NULL, NULL},
    [A_RMM_POOL] = {"pool via RMM", false, false, false, NULL, NULL, NULL},
#endif
};

static void sync_stream(dmem_stream_t s) { TRY(dmem_stream_synchronize(g_rt, s)); }

/* ---- alloc+free pairs ----------------------------------------------------------- */

static void pair_loop(const allocator_t *a, size_t size, long iters, dmem_stream_t s) {
  for (long i = 0; i < iters; i++) {
    void *p = a->alloc(a->self, size, s);
    a->free(a->self, p, size, s);
  }
  sync_stream(s);
}

/* The worker threads live for the whole run (as an application's would), so
 * that per-thread caches and arenas warmed up by one run serve the next.
 * Thread i of a job uses g_streams[i] (or NULL). */
typedef struct team {
  pthread_t th[MAX_THREADS];
  pthread_mutex_t mu;
  pthread_cond_t start_cv; /* main -> workers: a new job (generation), or quit */
  pthread_cond_t done_cv;  /* workers -> main: `done` grew */
  uint64_t generation;     /* jobs posted (mu) */
  int done;                /* workers finished with the current job (mu) */
  bool quit;               /* (mu) */
  /* the current job: written by main before the generation bump (mu) */
  const allocator_t *a;
  size_t size;
  long iters; /* pairs per thread */
  int threads;
  bool default_stream;
  pthread_barrier_t barrier; /* the job's threads start together */
  uint64_t t0[MAX_THREADS], t1[MAX_THREADS];
} team_t;

static team_t g_team;

typedef struct worker_arg {
  int index;
} worker_arg_t;

static worker_arg_t g_worker_args[MAX_THREADS];

static void *worker_main(void *arg) {
  int i = ((const worker_arg_t *)arg)->index;
  team_t *t = &g_team;
#ifdef DMEM_HAVE_CUDA
  if (!g_host) CU(cudaSetDevice(g_device));
#endif
  uint64_t seen = 0;
  pthread_mutex_lock(&t->mu);
  for (;;) {
    while (t->generation == seen && !t->quit) pthread_cond_wait(&t->start_cv, &t->mu);
    if (t->quit) break;
    seen = t->generation;
    if (i >= t->threads) continue;
    const allocator_t *a = t->a;
    size_t size = t->size;
    long iters = t->iters;
    dmem_stream_t s = t->default_stream ? NULL : g_streams[i];
    pthread_mutex_unlock(&t->mu);
    pthread_barrier_wait(&t->barrier);
    uint64_t t0 = now_ns();
    pair_loop(a, size, iters, s);
    uint64_t t1 = now_ns();
    pthread_mutex_lock(&t->mu);
    t->t0[i] = t0;
    t->t1[i] = t1;
    t->done++;
    pthread_cond_signal(&t->done_cv);
  }
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

static void team_start(void) {
  team_t *t = &g_team;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->start_cv, NULL);
  pthread_cond_init(&t->done_cv, NULL);
  for (int i = 0; i < MAX_THREADS; i++) {
    g_worker_args[i].index = i;
    if (pthread_create(&t->th[i], NULL, worker_main, &g_worker_args[i]) != 0) {
      fprintf(stderr, "bench_alloc: pthread_create failed\n");
      exit(1);
    }
  }
}

static void team_stop(void) {
  team_t *t = &g_team;
  pthread_mutex_lock(&t->mu);
  t->quit = true;
  pthread_cond_broadcast(&t->start_cv);
  pthread_mutex_unlock(&t->mu);
  for (int i = 0; i < MAX_THREADS; i++) pthread_join(t->th[i], NULL);
  pthread_cond_destroy(&t->done_cv);
  pthread_cond_destroy(&t->start_cv);
  pthread_mutex_destroy(&t->mu);
}

/* ns per pair: 1 thread (the main thread) on g_streams[0], or the aggregate
 * of the team's first `threads` threads on their own streams
 * (default_stream: all on NULL). `pairs` in all. */
static double pairs_ns(const allocator_t *a, size_t size, int threads, bool default_stream,
                       long pairs) {
  if (threads == 1) {
    dmem_stream_t s = default_stream ? NULL : g_streams[0];
    uint64_t t0 = now_ns();
    pair_loop(a, size, pairs, s);
    return (double)(now_ns() - t0) / (double)pairs;
  }
  team_t *t = &g_team;
  long per = pairs / threads > 0 ? pairs / threads : 1;
  pthread_mutex_lock(&t->mu);
  t->a = a;
  t->size = size;
  t->iters = per;
  t->threads = threads;
  t->default_stream = default_stream;
  t->done = 0;
  pthread_barrier_init(&t->barrier, NULL, (unsigned)threads);
  t->generation++;
  pthread_cond_broadcast(&t->start_cv);
  while (t->done < threads) pthread_cond_wait(&t->done_cv, &t->mu);
  uint64_t t0 = UINT64_MAX, t1 = 0;
  for (int i = 0; i < threads; i++) {
    if (t->t0[i] < t0) t0 = t->t0[i];
    if (t->t1[i] > t1) t1 = t->t1[i];
  }
  pthread_barrier_destroy(&t->barrier);
  pthread_mutex_unlock(&t->mu);
  return (double)(t1 - t0) / ((double)per * threads);
}

/* ---- the replay sequence --------------------------------------------------------- */

typedef struct replay {
  size_t n;         /* live blocks */
  size_t *init;     /* their sizes, allocated first */
  long steps;       /* steps generated */
  uint32_t *victim; /* step i frees slot victim[i] ... */
  size_t *size;     /* ... and allocates size[i] bytes into it */
  size_t peak;      /* most bytes live at once over the sequence */
} replay_t;

/* splitmix64: a fixed seed gives every allocator the same sequence. */
static uint64_t prng_next(uint64_t *state) {
  uint64_t z = (*state += UINT64_C(0x9E3779B97F4A7C15));
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}

static double prng_unit(uint64_t *state) { return (double)(prng_next(state) >> 11) * 0x1p-53; }

/* log-uniform in [256 B, 1 MiB] */
static size_t prng_size(uint64_t *state) {
  size_t s = (size_t)exp2(8.0 + 12.0 * prng_unit(state));
  return s < 256 ? 256 : s > MiB ? MiB : s;
}

static void replay_make(replay_t *r, size_t n, long steps, uint64_t seed) {
  r->n = n;
  r->steps = steps;
  r->init = malloc(n * sizeof *r->init);
  r->victim = malloc((size_t)steps * sizeof *r->victim);
  r->size = malloc((size_t)steps * sizeof *r->size);
  size_t *cur = malloc(n * sizeof *cur);
  if (!r->init || !r->victim || !r->size || !cur) {
    fprintf(stderr, "bench_alloc: out of host memory for the replay sequence\n");
    exit(1);
  }
  uint64_t st = seed;
  size_t live = 0;
  for (size_t i = 0; i < n; i++) {
    r->init[i] = cur[i] = prng_size(&st);
    live += cur[i];
  }
  r->peak = live;
  for (long i = 0; i < steps; i++) {
    uint32_t v = (uint32_t)(prng_next(&st) % n);
    size_t s = prng_size(&st);
    r->victim[i] = v;
    r->size[i] = s;
    live = live - cur[v] + s;
    cur[v] = s;
    if (live > r->peak) r->peak = live;
  }
  free(cur);
}

static void replay_free(replay_t *r) {
  free(r->init);
  free(r->victim);
  free(r->size);
}

/* Allocate r's first n blocks on s (untimed): live[i], sizes in cur[i]. */
static void fill(const allocator_t *a, const replay_t *r, void **live, size_t *cur,
                 dmem_stream_t s) {
  for (size_t i = 0; i < r->n; i++) {
    cur[i] = r->init[i];
    live[i] = a->alloc(a->self, cur[i], s);
  }
  sync_stream(s);
}

static void drain(const allocator_t *a, const replay_t *r, void **live, const size_t *cur,
                  dmem_stream_t s) {
  for (size_t i = 0; i < r->n; i++) a->free(a->self, live[i], cur[i], s);
  sync_stream(s);
}

/* ns per step of the first `steps` steps of r, one thread on g_streams[0]. */
static double replay_ns(const allocator_t *a, const replay_t *r, long steps, void **live,
                        size_t *cur) {
  dmem_stream_t s = g_streams[0];
  fill(a, r, live, cur, s);
  uint64_t t0 = now_ns();
  for (long i = 0; i < steps; i++) {
    uint32_t v = r->victim[i];
    a->free(a->self, live[v], cur[v], s);
    cur[v] = r->size[i];
    live[v] = a->alloc(a->self, cur[v], s);
  }
  sync_stream(s);
  double ns = (double)(now_ns() - t0) / (double)steps;
  drain(a, r, live, cur, s);
  return ns;
}

/* ns per 4 KiB pair with r's n blocks live (allocated first, untimed). */
static double live_pairs_ns(const allocator_t *a, const replay_t *r, long pairs, void **live,
                            size_t *cur) {
  dmem_stream_t s = g_streams[0];
  fill(a, r, live, cur, s);
  double ns = pairs_ns(a, 4 * KiB, 1, false, pairs);
  drain(a, r, live, cur, s);
  return ns;
}

/* ---- tables ------------------------------------------------------------------------ */

/* What one case measures, for measure(). */
typedef enum { CASE_PAIRS, CASE_LIVE_PAIRS, CASE_REPLAY } case_kind_t;

typedef struct bench_case {
  case_kind_t kind;
  size_t size;
  int threads;
  bool default_stream;
  const replay_t *replay;
} bench_case_t;

static bool runs_in(const allocator_t *a, const bench_case_t *c) {
  if (!a->available) return false;
  if (c->threads > 1 && a->single_thread) return false;
  if (c->default_stream && a->streamless) return false;
  return true;
}

static double measure_once(const allocator_t *a, const bench_case_t *c, long n, void **live,
                           size_t *cur) {
  switch (c->kind) {
    case CASE_PAIRS:
      return pairs_ns(a, c->size, c->threads, c->default_stream, n);
    case CASE_LIVE_PAIRS:
      return live_pairs_ns(a, c->replay, n, live, cur);
    case CASE_REPLAY:
      return replay_ns(a, c->replay, n, live, cur);
  }
  return 0;
}

/* The untimed pass: runs of growing length (at least two, so that the last
 * one sees a warm pool) until one takes a quarter of the budget; returns
 * the pairs (steps) per repetition that fill the budget, within
 * [min, max]. */
static long warm_up(const allocator_t *a, const bench_case_t *c, void **live, size_t *cur) {
  bool replay = c->kind == CASE_REPLAY;
  long max = replay ? c->replay->steps : g_max_pairs;
  long min = replay ? 64 : 4L * c->threads;
  long n = replay ? 16 : c->threads;
  double ns = 0;
  for (int pass = 0;; pass++) {
    ns = measure_once(a, c, n, live, cur);
    bool long_enough = ns * (double)n >= g_budget_ns / 4 || n >= max;
    if (long_enough && pass >= 1) break;
    if (!long_enough) n = n > max / 4 ? max : n * 4;
  }
  double k = g_budget_ns / (ns > 1 ? ns : 1);
  return k < (double)min ? min : k > (double)max ? max : (long)k;
}

/* Median ns of every allocator that runs in case c (NAN for the others):
 * each warms up first, then the allocators take turns per repetition.
 * count[a] is what each repetition of allocator a did (pairs or steps). */
static void measure(const bench_case_t *c, double out[A_COUNT], long count[A_COUNT]) {
  static double v[A_COUNT][MAX_REPS];
  size_t n = c->replay ? c->replay->n : 0;
  void **live = n ? malloc(n * sizeof *live) : NULL;
  size_t *cur = n ? malloc(n * sizeof *cur) : NULL;
  if (n && (!live || !cur)) {
    fprintf(stderr, "bench_alloc: out of host memory\n");
    exit(1);
  }
  if (g_host) TRY(dmem_device_trim(g_rt, 0, NULL)); /* every case from empty slabs */
  for (int a = 0; a < A_COUNT; a++)
    count[a] = runs_in(&g_alloc[a], c) ? warm_up(&g_alloc[a], c, live, cur) : 0;
  for (int r = 0; r < g_reps; r++)
    for (int a = 0; a < A_COUNT; a++)
      if (count[a]) v[a][r] = measure_once(&g_alloc[a], c, count[a], live, cur);
  for (int a = 0; a < A_COUNT; a++) out[a] = count[a] ? median(v[a], g_reps) : NAN;
  free(live);
  free(cur);
}

static void cell(double x, int width, const char *fmt) {
  if (isnan(x))
    printf(" | %*s", width, "n/a");
  else
    printf(fmt, width, x);
}

static void ratios(const double ns[A_COUNT]) {
  cell(ns[A_DMEM] / ns[A_ASYNC], 10, " | %*.2f");
  cell(ns[A_DMEM] / ns[A_POOL], 10, " | %*.2f");
  cell(ns[A_DMEM] / ns[A_ARENA], 10, " | %*.2f");
  printf("\n");
}

static const int k_cols[] = {A_DMEM, A_MALLOC, A_ASYNC, A_POOL, A_ARENA};
#define NCOLS ((int)(sizeof k_cols / sizeof k_cols[0]))

static void header(const char *first, bool with_buf, int width) {
  printf("%-18s", first);
  for (int i = 0; i < NCOLS; i++) {
    printf(" | %*s", width, g_alloc[k_cols[i]].name);
    if (with_buf && k_cols[i] == A_DMEM) printf(" | %*s", width, g_alloc[A_BUF].name);
  }
  printf(" | %10s | %10s | %10s\n", "dmem/Async", "dmem/pool", "dmem/arena");
  int ncols = NCOLS + (with_buf ? 1 : 0) + 3;
  printf("-------------------");
  for (int c = 0; c < ncols; c++)
    printf("+%.*s", (c < ncols - 3 ? width : 10) + 2, "------------------");
  printf("\n");
}

/* One row of the 1-thread table: ns per pair (or step), dmem buf included. */
static void row_single(const char *what, const double ns[A_COUNT]) {
  printf("%-18s", what);
  for (int i = 0; i < NCOLS; i++) {
    cell(ns[k_cols[i]], 11, " | %*.0f");
    if (k_cols[i] == A_DMEM) cell(ns[A_BUF], 11, " | %*.0f");
  }
  ratios(ns);
}

static const size_t k_sizes[] = {256, 4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB};
#define NSIZES ((int)(sizeof k_sizes / sizeof k_sizes[0]))

/* The RMM hook (issue 24): dmem::rmm_resource (include/dmem/rmm.hpp) against
 * the RMM pool, both through rmm::device_async_resource_ref, 1 thread, its
 * own stream; with dmem's raw pair for reference. Prints RESULT lines
 * (ns per pair and the ratio). Built with RMM only. */
static void table_rmm_hook(void) {
#ifdef DMEM_BENCH_HAVE_RMM
  if (!g_alloc[A_RMM_DMEM].self || !g_alloc[A_RMM_POOL].self) return;
  bool saved[A_COUNT];
  for (int a = 0; a < A_COUNT; a++) {
    saved[a] = g_alloc[a].available;
    g_alloc[a].available = a == A_DMEM || a == A_RMM_DMEM || a == A_RMM_POOL;
  }
  printf("\nRMM hook: alloc+free pair through rmm::device_async_resource_ref, 1 thread "
         "(its own stream), ns per pair\n");
  printf("%-18s | %11s | %12s | %12s | %13s\n", "size", "dmem raw", "dmem via RMM",
         "pool via RMM", "dmem/pool RMM");
  printf("-------------------+-------------+--------------+--------------+--------------\n");
  static const size_t sizes[] = {256, MiB, 64 * MiB};
  for (int i = 0; i < 3; i++) {
    double ns[A_COUNT];
    long count[A_COUNT];
    bench_case_t c = {CASE_PAIRS, sizes[i], 1, false, NULL};
    measure(&c, ns, count);
    char what[32];
    size_name(what, sizeof what, sizes[i]);
    printf("%-18s | %11.0f | %12.0f | %12.0f | %13.2f\n", what, ns[A_DMEM], ns[A_RMM_DMEM],
           ns[A_RMM_POOL], ns[A_RMM_DMEM] / ns[A_RMM_POOL]);
    printf("RESULT rmm_cpp_dmem_%zu_ns=%.1f\nRESULT rmm_cpp_pool_%zu_ns=%.1f\n"
           "RESULT rmm_cpp_dmem_over_pool_%zu=%.3f\n",
           sizes[i], ns[A_RMM_DMEM], sizes[i], ns[A_RMM_POOL], sizes[i],
           ns[A_RMM_DMEM] / ns[A_RMM_POOL]);
  }
  for (int a = 0; a < A_COUNT; a++) g_alloc[a].available = saved[a];
#endif
}

static double g_single[NSIZES][A_COUNT]; /* the 1-thread figures, for the speedups */
static double g_raw4k, g_raw4k_live;     /* dmem's 4 KiB pair, alone and with 1000 live */

/* Whether a case that needs `need` bytes (live bytes and headroom) runs:
 * always under CUDA; on the host backend when `need` fits the simulated
 * device (and, in --quick, QUICK_HOST_NEED_MAX: CI machines are small). */
static bool fits(size_t need) {
  if (!g_host) return true;
  return need <= g_capacity && (!g_quick || need <= QUICK_HOST_NEED_MAX);
}

static void table_single(const replay_t *r1000) {
  printf("\nalloc+free pair, 1 thread (its own stream), ns per pair\n");
  header("size", true, 11);
  long count[A_COUNT];
  for (int i = 0; i < NSIZES; i++) {
    bench_case_t c = {CASE_PAIRS, k_sizes[i], 1, false, NULL};
    measure(&c, g_single[i], count);
    char what[32];
    size_name(what, sizeof what, k_sizes[i]);
    row_single(what, g_single[i]);
  }
  double ns[A_COUNT];
  bench_case_t c = {CASE_LIVE_PAIRS, 4 * KiB, 1, false, r1000};
  measure(&c, ns, count);
  row_single("4 KiB, 1000 live", ns);
  g_raw4k = g_single[1][A_DMEM];
  g_raw4k_live = ns[A_DMEM];
  printf(
      "4 KiB, 1000 live: the 4 KiB pair with 1000 other blocks live (the replay's "
      "first 1000 sizes, allocated first, untimed)\n");
}

static void table_threads(int threads, bool default_stream) {
  printf("\nalloc+free pair, %d threads, %s: aggregate ns per pair (speedup over 1 thread)\n",
         threads, default_stream ? "all on the default stream" : "each on its own stream");
  header("size", false, 14);
  for (int i = 0; i < NSIZES; i++) {
    char what[32];
    size_name(what, sizeof what, k_sizes[i]);
    if (!fits(2 * (size_t)threads * k_sizes[i])) { /* twice the live bytes */
      printf("%-18s | skipped: %d x %s live, twice over, exceeds the host backend's %zu MiB%s\n",
             what, threads, what, (g_quick ? QUICK_HOST_NEED_MAX : g_capacity) / MiB,
             g_quick ? " in --quick" : "");
      continue;
    }
    bench_case_t c = {CASE_PAIRS, k_sizes[i], threads, default_stream, NULL};
    double ns[A_COUNT];
    long count[A_COUNT];
    measure(&c, ns, count);
    printf("%-18s", what);
    for (int k = 0; k < NCOLS; k++) {
      int a = k_cols[k];
      if (!isnan(ns[a]))
        printf(" | %8.0f %4.1fx", ns[a], g_single[i][a] / ns[a]);
      else if (default_stream && g_alloc[a].available && g_alloc[a].streamless)
        printf(" | %14s", "(no stream)");
      else
        printf(" | %14s", "n/a");
    }
    ratios(ns);
  }
}

static void table_replay(const replay_t *const *rs, int count) {
  printf(
      "\nreplay: N live blocks, log-uniform 256 B..1 MiB; each step frees a random one "
      "and allocates anew; ns per step\n");
  header("live blocks", true, 11);
  long steps[4][A_COUNT];
  for (int i = 0; i < count; i++) {
    const replay_t *r = rs[i];
    char what[32];
    snprintf(what, sizeof what, "N = %zu", r->n);
    if (!fits(r->peak + r->peak / 2)) { /* half as much again for fragmentation */
      printf(
          "%-18s | skipped: %zu MiB live at the peak, x 1.5, exceeds the host backend's "
          "%zu MiB%s\n",
          what, r->peak / MiB, (g_quick ? QUICK_HOST_NEED_MAX : g_capacity) / MiB,
          g_quick ? " in --quick" : "");
      for (int a = 0; a < A_COUNT; a++) steps[i][a] = 0;
      continue;
    }
    bench_case_t c = {CASE_REPLAY, 0, 1, false, r};
    double ns[A_COUNT];
    measure(&c, ns, steps[i]);
    row_single(what, ns);
  }
  printf(
      "steps per repetition, N = %zu / %zu (the first ones of the same sequence; the fill "
      "and the final frees untimed):",
      rs[0]->n, rs[count - 1]->n);
  const char *sep = " ";
  for (int a = 0; a < A_COUNT; a++) {
    if (!g_alloc[a].available) continue;
    printf("%s%s", sep, g_alloc[a].name);
    for (int i = 0; i < count; i++) printf("%s%ld", i ? "/" : " ", steps[i][a]);
    sep = "; ";
  }
  printf("\n");
}

/* ---- setup --------------------------------------------------------------------------- */

static void make_runtime(void) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_HOST_CAPACITY")) cfg.host_backend_capacity = HOST_CAPACITY_DEFAULT;
  dmem_status_t st = dmem_runtime_create(&cfg, &g_rt);
  if (st == DMEM_ERR_NO_DEVICE) {
    fprintf(stderr, "SKIP: no CUDA device for DMEM_BACKEND=%s (%s)\n",
            getenv("DMEM_BACKEND") ? getenv("DMEM_BACKEND") : "", dmem_last_error_detail());
    exit(77);
  }
  if (st != DMEM_OK) die("dmem_runtime_create", st);
  g_host = dmem_runtime_backend(g_rt) == DMEM_BACKEND_HOST;
  TRY(dmem_device_memory_info(g_rt, NULL, &g_capacity));
  for (int i = 0; i < MAX_THREADS; i++) TRY(dmem_stream_create(g_rt, &g_streams[i]));
  g_alloc[A_DMEM].available = true;
  g_alloc[A_BUF].available = true;
#ifdef DMEM_HAVE_CUDA
  g_device = cfg.device;
#endif
}

/* The baselines: the CUDA backend only. */
static void make_baselines(char *desc, size_t cap) {
  snprintf(desc, cap, "host backend, %zu MiB simulated device: dmem columns only",
           g_capacity / MiB);
#ifdef DMEM_HAVE_CUDA
  if (g_host) return;
  CU(cudaSetDevice(g_device));
  struct cudaDeviceProp prop;
  CU(cudaGetDeviceProperties(&prop, g_device));
  cudaMemPool_t pool;
  CU(cudaDeviceGetDefaultMemPool(&pool, g_device));
  uint64_t threshold = UINT64_MAX;
  CU(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  g_alloc[A_MALLOC].available = true;
  g_alloc[A_ASYNC].available = true;
  const char *rmm = "RMM not built (configure with -DDMEM_RMM_ROOT=<unzipped wheels>)";
#ifdef DMEM_BENCH_HAVE_RMM
  static char rmm_desc[64];
  size_t dev_free = 0, dev_total = 0;
  CU(cudaMemGetInfo(&dev_free, &dev_total));
  size_t bytes = RMM_BYTES;
  if (bytes > dev_free / 4) bytes = dev_free / 4 / (2 * MiB) * (2 * MiB);
  g_alloc[A_POOL].self = bench_rmm_pool_create(bytes);
  g_alloc[A_ARENA].self = bench_rmm_arena_create(bytes);
  g_alloc[A_POOL].available = g_alloc[A_ARENA].available = true;
  /* only in table_rmm_hook (not available in the other tables) */
  g_alloc[A_RMM_DMEM].self = bench_rmm_dmem_ref_create(g_rt);
  g_alloc[A_RMM_POOL].self = bench_rmm_pool_ref_create(g_alloc[A_POOL].self);
  snprintf(rmm_desc, sizeof rmm_desc, "RMM %s, pool and arena of %zu MiB", bench_rmm_version(),
           bytes / MiB);
  rmm = rmm_desc;
#endif
  snprintf(desc, cap, "CUDA backend, %.96s (device %d); %.100s", prop.name, g_device, rmm);
#else
  (void)cap;
#endif
}

static void destroy_baselines(void) {
#ifdef DMEM_BENCH_HAVE_RMM
  if (g_alloc[A_RMM_DMEM].self) bench_rmm_ref_destroy(g_alloc[A_RMM_DMEM].self);
  if (g_alloc[A_RMM_POOL].self) bench_rmm_ref_destroy(g_alloc[A_RMM_POOL].self);
  if (g_alloc[A_POOL].self) bench_rmm_pool_destroy(g_alloc[A_POOL].self);
  if (g_alloc[A_ARENA].self) bench_rmm_arena_destroy(g_alloc[A_ARENA].self);
#endif
}

/* ---- main ------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) {
      g_quick = true;
    } else if (strcmp(argv[i], "--rmm-hook") == 0) {
      g_rmm_hook_only = true;
    } else {
      fprintf(stderr, "usage: %s [--quick] [--rmm-hook]\n", argv[0]);
      return 2;
    }
  }
  if (g_quick) {
    g_reps = 3;
    g_budget_ns = 2e6;
    g_max_pairs = 4000;
    g_replay_len = 2000;
  }
  uint64_t t_start = now_ns();
  make_runtime();
  char desc[256];
  make_baselines(desc, sizeof desc);
#ifdef __OPTIMIZE__
  const char *opt = "optimised";
#else
  const char *opt = "NOT optimised: build with CMAKE_BUILD_TYPE=Release for real figures";
#endif
  printf("bench_alloc: %s\n%s: %d repetitions (median) of ~%.0f ms (at most %ld pairs), %s\n", desc,
         g_quick ? "quick" : "full", g_reps, g_budget_ns * 1e-6, g_max_pairs, opt);

  replay_t r1000, r10000;
  replay_make(&r1000, 1000, g_replay_len, 1);
  replay_make(&r10000, 10000, g_replay_len, 2);

  team_start();
  if (g_rmm_hook_only) {
    table_rmm_hook();
    team_stop();
    printf("bench_alloc --rmm-hook: %s\n",
           g_alloc[A_RMM_DMEM].self ? "done"
                                    : "no RMM hook table (built without RMM, or the host backend)");
  } else {
    table_single(&r1000);
    table_threads(4, false);
    table_threads(16, false);
    table_threads(4, true);
    table_threads(16, true);
    printf(
        "threads: the pairs of a repetition split evenly among them; speedup = 1-thread "
        "ns / aggregate ns (default-stream tables too: against 1 thread on its own stream); "
        "cudaMalloc takes no stream: see the own-stream tables\n");

    const replay_t *rs[] = {&r1000, &r10000};
    table_replay(rs, 2);
    table_rmm_hook();
    team_stop();
    printf("ratios: dmem / baseline, below 1 = dmem faster\n");
    printf(
        "\n== dmem raw 4 KiB pair (dmem_device_malloc + dmem_device_free, 1 thread, %s "
        "backend): %.0f ns alone, %.0f ns with 1000 live blocks%s\n",
        g_host ? "host" : "CUDA", g_raw4k, g_raw4k_live, g_host ? " (target <= 150 ns)" : "");
  }

  /* Sanity: everything given back. */
  for (int i = 0; i < MAX_THREADS; i++) sync_stream(g_streams[i]);
  dmem_stats_t st;
  TRY(dmem_stats(g_rt, &st));
  if (st.device_used != 0) {
    fprintf(stderr, "bench_alloc: %zu bytes still in use after every block was freed\n",
            st.device_used);
    return 1;
  }
  destroy_baselines();
  for (int i = 0; i < MAX_THREADS; i++) TRY(dmem_stream_destroy(g_rt, g_streams[i]));
  dmem_runtime_destroy(g_rt);
  replay_free(&r1000);
  replay_free(&r10000);
  printf("\nbench_alloc: done in %.1f s\n", (double)(now_ns() - t_start) * 1e-9);
  return 0;
}
