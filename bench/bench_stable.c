/*
 * bench/bench_stable.c - what a stable address costs (DMEM_BUFFER_STABLE_ADDRESS,
 * runtime/memory/stable.c, docs/stable.md), each figure against the ordinary
 * path measured in the same run:
 *
 *   map+unmap      physical memory for one stable buffer: charge, create,
 *                  map, set access (what an unspill adds), then unmap and
 *                  release (what a spill adds), per size, us; against the
 *                  pool's allocation + release of the same size (what an
 *                  ordinary unspill and spill take: dmem__device_alloc on the
 *                  unspill stream, dmem__device_release)
 *   spill, unspill bandwidth   K buffers of S bytes to the host tier and
 *                  back (dmem_buffer_spill of each, the spill stream drained;
 *                  dmem_buffer_unspill of each, the default stream synchronised),
 *                  GB/s, stable buffers against ordinary ones
 *   graph loop     N buffers at 2x the device limit; step k runs
 *                  y_k += a * x_k over the pair (buffer k, buffer k+1),
 *                  locking the pair with dmem_launch_async each step
 *                  (bringing it back, spilling others) and releasing the
 *                  stream. With stable buffers each step replays a CUDA
 *                  graph captured once at the start over the pair's
 *                  addresses (cudaGraphLaunch); without, the same loop over
 *                  ordinary buffers calls the operation directly. The
 *                  operation is cublasSaxpy where cuBLAS is built in, else
 *                  a device-to-device cudaMemcpyAsync; on the host backend
 *                  a dmem_stream_copy (the "graph" replays its captured pointers).
 *                  Also with a limit that holds every buffer (no spills:
 *                  the launch cost alone). us per step, ratio graph /
 *                  direct.
 *
 * Prints a table per section with ratios, and RESULT lines:
 *   RESULT bench_stable.map_unmap_us.<size>=  RESULT bench_stable.pool_us.<size>=
 *   RESULT bench_stable.spill_gbps.{stable,ordinary}=  ...unspill_gbps...
 *   RESULT bench_stable.graph_step_us.{stable_graph,ordinary_direct}[.resident]=
 *
 *   bench_stable [--quick]
 *
 * --quick: small sizes, few repetitions (the CTest runs bench.stable on the
 * host backend, cuda.bench.stable on a GPU). Backend: DMEM_BACKEND if set,
 * else the host backend. Each figure is the median of repetitions. Exit 77
 * when DMEM_BACKEND asks for a device that is not there, 1 on any dmem
 * error; never fails on speed.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dmem/dmem.h>

#define BENCH_NAME "bench_stable"
#include "bench_common.h"

#include "api/api.h" /* the runtime's backend and streams; memory/stable.c, devmem.c */

#ifdef DMEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#ifdef DMEM_BENCH_HAVE_CUBLAS
#include <cublas_v2.h>
#endif
#endif

#define MiB ((size_t)1 << 20)
#define MAX_REPS 21

static bool g_quick;
static bool g_cuda;

static dmem_runtime_t *make_runtime(size_t limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = limit;
  cfg.spill_ahead = 0;
  if (cfg.backend == DMEM_BACKEND_HOST || (getenv("DMEM_BACKEND") &&
                                           strcmp(getenv("DMEM_BACKEND"), "host") == 0))
    cfg.host_backend_capacity = (size_t)4 << 30;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) {
    fprintf(stderr, "SKIP: no device for DMEM_BACKEND=%s\n", getenv("DMEM_BACKEND"));
    exit(77);
  }
  if (st != DMEM_OK) die("dmem_runtime_create", st);
  g_cuda = rt->be->kind == DMEM_BACKEND_CUDA;
  return rt;
}

static const char *size_name(size_t s, char *buf, size_t n) {
  if (s >= MiB) snprintf(buf, n, "%zuM", s / MiB);
  else snprintf(buf, n, "%zuK", s >> 10);
  return buf;
}

/* ---- map + unmap against the pool ------------------------------------------------ */

static void bench_map(void) {
  static const size_t full[] = {2 * MiB, 8 * MiB, 32 * MiB, 128 * MiB, 512 * MiB};
  static const size_t quick[] = {2 * MiB, 8 * MiB};
  const size_t *sizes = g_quick ? quick : full;
  int nsizes = g_quick ? 2 : 5, reps = g_quick ? 5 : 15;
  dmem_runtime_t *rt = make_runtime(g_quick ? 64 * MiB : (size_t)2 << 30);
  printf("\nmap + unmap of a stable buffer's memory against the pool's alloc + release "
         "(us, median of %d)\n", reps);
  printf("%8s %12s %12s %12s %12s %8s\n", "size", "map", "unmap", "map+unmap", "pool a+r", "ratio");
  for (int k = 0; k < nsizes; k++) {
    size_t size = sizes[k], rounded = 0;
    void *va = NULL;
    TRY(dmem__stable_reserve(rt, size, &va, &rounded));
    double tm[MAX_REPS], tu[MAX_REPS], tmu[MAX_REPS], tp[MAX_REPS];
    for (int r = 0; r < reps; r++) {
      size_t short_by = 0;
      uint64_t t0 = now_ns();
      TRY(dmem__stable_map(rt, va, &short_by));
      uint64_t t1 = now_ns();
      TRY(dmem__stable_unmap(rt, va));
      uint64_t t2 = now_ns();
      tm[r] = (double)(t1 - t0) / 1e3;
      tu[r] = (double)(t2 - t1) / 1e3;
      tmu[r] = (double)(t2 - t0) / 1e3;
      void *dev = NULL;
      bool ordered = false;
      t0 = now_ns();
      TRY(dmem__device_alloc(rt, size, rt->unspill_stream, &dev, &ordered, &short_by));
      dmem__device_release(rt, dev, size, rt->unspill_stream);
      tp[r] = (double)(now_ns() - t0) / 1e3;
    }
    dmem__stable_free(rt, va);
    double m = median(tm, reps), u = median(tu, reps), mu = median(tmu, reps),
           p = median(tp, reps);
    char nb[16];
    size_name(size, nb, sizeof nb);
    printf("%8s %12.1f %12.1f %12.1f %12.2f %7.0fx\n", nb, m, u, mu, p, p > 0 ? mu / p : 0);
    printf("RESULT bench_stable.map_unmap_us.%s=%.2f\n", nb, mu);
    printf("RESULT bench_stable.pool_us.%s=%.3f\n", nb, p);
  }
  dmem_runtime_destroy(rt);
}

/* ---- spill and unspill bandwidth ------------------------------------------------- */

static void spill_round(dmem_runtime_t *rt, const dmem_handle_t *h, int k, double *spill_s,
                        double *unspill_s) {
  uint64_t t0 = now_ns();
  for (int i = 0; i < k; i++) TRY(dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST));
  TRY(rt->be->stream_synchronize(rt->be, rt->spill_stream)); /* the copies are done */
  uint64_t t1 = now_ns();
  for (int i = 0; i < k; i++) TRY(dmem_buffer_unspill(rt, h[i], NULL));
  TRY(dmem_stream_synchronize(rt, NULL)); /* ordered after every unspill copy */
  uint64_t t2 = now_ns();
  *spill_s = (double)(t1 - t0) / 1e9;
  *unspill_s = (double)(t2 - t1) / 1e9;
}

static void bench_bandwidth(void) {
  const size_t size = g_quick ? 4 * MiB : 128 * MiB;
  const int k = g_quick ? 4 : 8, reps = g_quick ? 3 : 5;
  double gb = (double)size * k / 1e9;
  double sp[2][MAX_REPS], un[2][MAX_REPS];
  for (int stable = 0; stable < 2; stable++) {
    dmem_runtime_t *rt = make_runtime((size_t)(k + 2) * size);
    dmem_handle_t h[16];
    for (int i = 0; i < k; i++)
      TRY(dmem_buffer_alloc(rt, size, stable ? DMEM_BUFFER_STABLE_ADDRESS : 0, &h[i]));
    double s0, u0;
    spill_round(rt, h, k, &s0, &u0); /* warm: pinned pool, device pool */
    for (int r = 0; r < reps; r++) {
      double s, u;
      spill_round(rt, h, k, &s, &u);
      sp[stable][r] = gb / s;
      un[stable][r] = gb / u;
    }
    for (int i = 0; i < k; i++) TRY(dmem_buffer_free(rt, h[i]));
    dmem_runtime_destroy(rt);
  }
  double so = median(sp[0], reps), ss = median(sp[1], reps);
  double uo = median(un[0], reps), us = median(un[1], reps);
  char nb[16];
  printf("\nspill to the host tier and back: %d buffers of %s (GB/s, median of %d)\n", k,
         size_name(size, nb, sizeof nb), reps);
  printf("%10s %12s %12s %8s\n", "", "ordinary", "stable", "ratio");
  printf("%10s %12.2f %12.2f %8.2f\n", "spill", so, ss, so > 0 ? ss / so : 0);
  printf("%10s %12.2f %12.2f %8.2f\n", "unspill", uo, us, uo > 0 ? us / uo : 0);
  printf("RESULT bench_stable.spill_gbps.ordinary=%.3f\nRESULT bench_stable.spill_gbps.stable=%.3f\n",
         so, ss);
  printf("RESULT bench_stable.unspill_gbps.ordinary=%.3f\n"
         "RESULT bench_stable.unspill_gbps.stable=%.3f\n", uo, us);
}

/* ---- the graph loop --------------------------------------------------------------- */

#define GN_MAX 64

typedef struct gloop {
  dmem_runtime_t *rt;
  size_t bytes;
  void *captured[GN_MAX][2]; /* step k's pair, as captured */
#ifdef DMEM_HAVE_CUDA
  cudaGraphExec_t exec[GN_MAX];
#ifdef DMEM_BENCH_HAVE_CUBLAS
  cublasHandle_t blas;
#endif
#endif
  int step; /* which graph the next launch replays */
  long moved;
} gloop_t;

static const char *g_op_name = "dmem_stream_copy (host backend)";

/* The step's operation on (x, y), on stream s: y += a*x (cuBLAS), or y = x. */
static dmem_status_t op(gloop_t *g, void *x, void *y, dmem_stream_t s) {
#ifdef DMEM_HAVE_CUDA
  if (g_cuda) {
#ifdef DMEM_BENCH_HAVE_CUBLAS
    const float a = 0.5f;
    if (cublasSetStream(g->blas, (cudaStream_t)s) != CUBLAS_STATUS_SUCCESS ||
        cublasSaxpy(g->blas, (int)(g->bytes / 4), &a, (const float *)x, 1, (float *)y, 1) !=
            CUBLAS_STATUS_SUCCESS)
      return DMEM_ERR_DEVICE;
    return DMEM_OK;
#else
    return cudaMemcpyAsync(y, x, g->bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)s) ==
                   cudaSuccess
               ? DMEM_OK
               : DMEM_ERR_DEVICE;
#endif
  }
#endif
  return dmem_stream_copy(g->rt, y, x, g->bytes, s);
}

static dmem_status_t direct_fn(void *user, dmem_stream_t s, void *const *p, size_t n) {
  (void)n;
  return op((gloop_t *)user, p[0], p[1], s);
}

static dmem_status_t capture_fn(void *user, dmem_stream_t s, void *const *p, size_t n) {
  gloop_t *g = user;
  (void)n;
  g->captured[g->step][0] = p[0];
  g->captured[g->step][1] = p[1];
#ifdef DMEM_HAVE_CUDA
  if (g_cuda) {
    cudaGraph_t graph;
    if (cudaStreamBeginCapture((cudaStream_t)s, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
      return DMEM_ERR_DEVICE;
    dmem_status_t st = op(g, p[0], p[1], s);
    if (cudaStreamEndCapture((cudaStream_t)s, &graph) != cudaSuccess || st != DMEM_OK)
      return DMEM_ERR_DEVICE;
    cudaError_t e = cudaGraphInstantiate(&g->exec[g->step], graph, 0);
    cudaGraphDestroy(graph);
    return e == cudaSuccess ? DMEM_OK : DMEM_ERR_DEVICE;
  }
#endif
  (void)s;
  return DMEM_OK;
}

static dmem_status_t replay_fn(void *user, dmem_stream_t s, void *const *p, size_t n) {
  gloop_t *g = user;
  (void)n;
  int k = g->step;
  if (p[0] != g->captured[k][0] || p[1] != g->captured[k][1]) {
    g->moved++;
    return DMEM_ERR_DEVICE;
  }
#ifdef DMEM_HAVE_CUDA
  if (g_cuda)
    return cudaGraphLaunch(g->exec[k], (cudaStream_t)s) == cudaSuccess ? DMEM_OK
                                                                        : DMEM_ERR_DEVICE;
#endif
  return op(g, g->captured[k][0], g->captured[k][1], s); /* the "graph": captured pointers */
}

/* us per step of `rounds` passes over n steps. */
static double graph_loop(bool stable, size_t bytes, int n, size_t limit, int rounds) {
  static gloop_t g;
  memset(&g, 0, sizeof g);
  g.rt = make_runtime(limit);
  g.bytes = bytes;
#if defined(DMEM_HAVE_CUDA) && defined(DMEM_BENCH_HAVE_CUBLAS)
  if (g_cuda && cublasCreate(&g.blas) != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "bench_stable: cublasCreate failed\n");
    exit(1);
  }
#endif
  dmem_handle_t h[GN_MAX];
  for (int i = 0; i < n; i++)
    TRY(dmem_buffer_alloc(g.rt, bytes, stable ? DMEM_BUFFER_STABLE_ADDRESS : 0, &h[i]));
  dmem_stream_t s;
  TRY(dmem_stream_create(g.rt, &s));
  for (int i = 0; i < n; i++) { /* zeros: saxpy stays finite */
    void *p;
    TRY(dmem_buffer_lock(g.rt, h[i], s, &p));
    void *zero = calloc(1, bytes);
    TRY(dmem_stream_copy(g.rt, p, zero, bytes, s));
    TRY(dmem_stream_synchronize(g.rt, s));
    free(zero);
    TRY(dmem_buffer_unlock(g.rt, h[i]));
  }
  if (stable) /* capture once, every step's graph */
    for (g.step = 0; g.step < n; g.step++) {
      dmem_handle_t pair[2] = {h[g.step], h[(g.step + 1) % n]};
      TRY(dmem_launch_async(g.rt, s, pair, 2, capture_fn, &g));
      TRY(dmem_sync_and_unlock(g.rt, s));
    }
  uint64_t t0 = 0;
  for (int r = -1; r < rounds; r++) { /* round -1: warm-up */
    if (r == 0) {
      TRY(dmem_sync_and_unlock(g.rt, s));
      t0 = now_ns();
    }
    for (g.step = 0; g.step < n; g.step++) {
      dmem_handle_t pair[2] = {h[g.step], h[(g.step + 1) % n]};
      TRY(dmem_launch_async(g.rt, s, pair, 2, stable ? replay_fn : direct_fn, &g));
      TRY(dmem_stream_release(g.rt, s));
    }
  }
  TRY(dmem_sync_and_unlock(g.rt, s));
  double us = (double)(now_ns() - t0) / 1e3 / ((double)rounds * n);
  if (g.moved) {
    fprintf(stderr, "bench_stable: %ld replays found a moved buffer\n", g.moved);
    exit(1);
  }
#ifdef DMEM_HAVE_CUDA
  if (g_cuda && stable)
    for (int i = 0; i < n; i++) cudaGraphExecDestroy(g.exec[i]);
#ifdef DMEM_BENCH_HAVE_CUBLAS
  if (g_cuda) cublasDestroy(g.blas);
#endif
#endif
  TRY(dmem_stream_destroy(g.rt, s));
  for (int i = 0; i < n; i++) TRY(dmem_buffer_free(g.rt, h[i]));
  dmem_runtime_destroy(g.rt);
  return us;
}

static void bench_graph(void) {
  const size_t bytes = g_quick ? 2 * MiB : 64 * MiB;
  const int n = g_quick ? 8 : 16, rounds = g_quick ? 3 : 5, reps = g_quick ? 1 : 3;
  /* stable buffers are charged whole granules: the sizes are multiples */
  const size_t over = (size_t)n / 2 * bytes; /* half the buffers: 2x oversubscription */
  const size_t all = (size_t)(n + 2) * bytes;
#ifdef DMEM_HAVE_CUDA
  if (g_cuda) {
#ifdef DMEM_BENCH_HAVE_CUBLAS
    g_op_name = "cublasSaxpy";
#else
    g_op_name = "cudaMemcpyAsync device to device";
#endif
  }
#endif
  double v[4][MAX_REPS];
  for (int r = 0; r < reps; r++) { /* alternating, back to back */
    v[0][r] = graph_loop(true, bytes, n, over, rounds);
    v[1][r] = graph_loop(false, bytes, n, over, rounds);
    v[2][r] = graph_loop(true, bytes, n, all, rounds * 4);
    v[3][r] = graph_loop(false, bytes, n, all, rounds * 4);
  }
  double sg = median(v[0], reps), od = median(v[1], reps), sgr = median(v[2], reps),
         odr = median(v[3], reps);
  char nb[16];
  printf("\ngraph loop: %d buffers of %s, step k = %s over buffers (k, k+1), locked by "
         "dmem_launch_async (us per step, median of %d)\n", n, size_name(bytes, nb, sizeof nb),
         g_op_name, reps);
  printf("%26s %14s %16s %8s\n", "", "stable+graph", "ordinary+direct", "ratio");
  printf("%26s %14.1f %16.1f %8.2f\n", "2x oversubscribed", sg, od, od > 0 ? sg / od : 0);
  printf("%26s %14.1f %16.1f %8.2f\n", "all resident", sgr, odr, odr > 0 ? sgr / odr : 0);
  printf("RESULT bench_stable.graph_step_us.stable_graph=%.2f\n", sg);
  printf("RESULT bench_stable.graph_step_us.ordinary_direct=%.2f\n", od);
  printf("RESULT bench_stable.graph_step_us.stable_graph.resident=%.2f\n", sgr);
  printf("RESULT bench_stable.graph_step_us.ordinary_direct.resident=%.2f\n", odr);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) g_quick = true;
    else {
      fprintf(stderr, "usage: bench_stable [--quick]\n");
      return 2;
    }
  }
  dmem_runtime_t *rt = make_runtime(64 * MiB); /* which backend; 77 without a device */
  size_t gran = 0;
  TRY(dmem__stable_granularity(rt, &gran));
  dmem_runtime_destroy(rt);
  printf("bench_stable: backend %s, VMM granularity %zu KiB%s\n", g_cuda ? "cuda" : "host",
         gran >> 10, g_quick ? " (quick)" : "");
  bench_map();
  bench_bandwidth();
  bench_graph();
  return 0;
}
