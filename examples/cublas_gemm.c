/*
 * examples/cublas_gemm.c - a real C library as a client of dmem: cuBLAS
 * SGEMM over a tiled matrix product twice the size of the device limit.
 *
 *   C[i][j] = A[i] x B[j]     i, j < T; A[i] is n x n, B[j] is n x n
 *
 * Every tile is a spillable dmem buffer (column-major floats). Each product
 * is wrapped in dmem_launch_async: the launch function calls cublasSetStream
 * and cublasSgemm with the locked device pointers, and dmem_stream_release
 * lets the runtime unlock the three tiles once the GEMM is done. The tiles
 * together hold about twice the device limit, and the example never spills
 * anything itself: the runtime spills and retrieves on its own, in stream
 * order, as the products need their tiles. At the end every C tile is
 * checked against a CPU reference: sampled entries, or every entry when
 * n <= 512 (or with --full). Matrix entries are small integers, so the
 * products are exact in FP32 whatever the summation order.
 *
 *   cublas_gemm [--n N] [--tiles T] [--limit BYTES] [--streams S]
 *               [--samples K] [--full] [--no-prefetch] [--compare]
 *               [--host-reserve BYTES]
 *
 * Each run first computes C[0][0] once on every stream, untimed, so that
 * cuBLAS's lazily loaded kernels are not charged to the first timed run.
 * Before each product is launched, the tiles of the next one are handed to
 * dmem_buffer_prefetch on the stream that will run it (--no-prefetch: not), so
 * that their host->device copies overlap the current product.
 * --compare runs the same products three times in one process: first
 * cuBLAS alone on plain cudaMalloc memory (every tile allocated, no dmem:
 * the baseline), then through dmem at the given limit (default: half the
 * tiles' bytes, 2x oversubscription) with the pinned pool growing as the
 * spills need it, then at that limit with a pinned host reserve
 * (dmem_config_t.host_reserve: the bytes that must spill plus four tiles,
 * or --host-reserve) taken when the runtime is created, and prints both
 * ratios to the baseline's TFLOP/s, also as `RESULT cublas.ratio_pool_growing=`
 * and `RESULT cublas.ratio_reserve=` lines (scripts/gpu-test). Every run's
 * C tiles are checked. Pinning runs at a few GB/s, the spills at 55: the
 * first oversubscribed run shows what getting pinned memory costs while
 * spilling, the second what spilling costs once it is there.
 * --host-reserve alone gives the runtime of a single run that reserve.
 *
 * Defaults: n 8192, T 7, limit 8G: 2T + T^2 = 63 tiles of 256 MiB (15.75
 * GiB) under an 8 GiB device limit, 49 SGEMMs of 8192^3. A small run (for
 * compute-sanitizer): --n 256 --tiles 3 --limit 2M. BYTES takes a K/M/G
 * suffix. The device is DMEM_DEVICE (default 0). Exit status: 0 when every
 * checked entry of every run matches, 1 otherwise (or when the baseline's
 * tiles do not fit in device memory), 77 when no CUDA device is usable.
 */
#define _POSIX_C_SOURCE 200809L

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <dmem/dmem.h>

#define MAX_STREAMS 8

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what, dmem_status_t st) {
  fprintf(stderr, "cublas_gemm: %s: %s (%s)\n", what, dmem_status_name(st),
          dmem_last_error_detail());
  exit(1);
}

#define TRY(call)                           \
  do {                                      \
    dmem_status_t st_ = (call);             \
    if (st_ != DMEM_OK) die(#call, st_);    \
  } while (0)

/* ---- the matrices: small integers from a hash ----------------------------- */

static uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/* Entry (r, c) of A[t] (seed 1) or B[t] (seed 2): an integer in -2..2. */
static float entry(uint32_t seed, int t, size_t r, size_t c) {
  uint32_t x = mix(seed * 0x27D4EB2Fu ^ (uint32_t)t * 0x165667B1u ^ (uint32_t)r * 0x9E3779B1u ^
                   mix((uint32_t)c * 0x85EBCA6Bu + seed));
  return (float)((int)(x % 5u) - 2);
}

static void make_tile(float *host, uint32_t seed, int t, size_t n) {
  for (size_t c = 0; c < n; c++)
    for (size_t r = 0; r < n; r++) host[c * n + r] = entry(seed, t, r, c); /* column-major */
}

/* ---- the launch function ---------------------------------------------------- */

typedef struct gemm {
  cublasHandle_t handle;
  int n;
} gemm_t;

/* dev_ptrs: A[i], B[j], C[i][j]. C = A x B (beta 0: C is only written). */
static dmem_status_t gemm_launch(void *user, dmem_stream_t stream, void *const *dev_ptrs,
                                 size_t count) {
  const gemm_t *g = (const gemm_t *)user;
  if (count != 3) return DMEM_ERR_INVALID_ARGUMENT;
  const float one = 1.0f, zero = 0.0f;
  cublasStatus_t cs = cublasSetStream(g->handle, (cudaStream_t)stream);
  if (cs == CUBLAS_STATUS_SUCCESS)
    cs = cublasSgemm(g->handle, CUBLAS_OP_N, CUBLAS_OP_N, g->n, g->n, g->n, &one,
                     (const float *)dev_ptrs[0], g->n, (const float *)dev_ptrs[1], g->n, &zero,
                     (float *)dev_ptrs[2], g->n);
  if (cs != CUBLAS_STATUS_SUCCESS) {
    fprintf(stderr, "cublas_gemm: cublasSgemm: %s\n", cublasGetStatusString(cs));
    return DMEM_ERR_DEVICE;
  }
  return DMEM_OK;
}

/* ---- arguments ---------------------------------------------------------------- */

static size_t parse_bytes(const char *s) {
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || v <= 0) return 0;
  switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= 1024.0 * 1024; break;
    case 'g': case 'G': v *= 1024.0 * 1024 * 1024; break;
    case '\0': break;
    default: return 0;
  }
  return (size_t)v;
}

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--n N] [--tiles T] [--limit BYTES] [--streams S] [--samples K] [--full]\n"
          "          [--no-prefetch] [--compare] [--host-reserve BYTES]\n",
          argv0);
  exit(2);
}

static void print_stats(dmem_runtime_t *rt, const char *when) {
  dmem_stats_t s;
  TRY(dmem_stats(rt, &s));
  printf("  %-12s device used %7.2f GiB of limit %.2f GiB; host tier %7.2f GiB; "
         "spills %5llu (%7.2f GiB, %6.2f s); unspills %5llu (%7.2f GiB); "
         "on-demand evictions %llu\n",
         when, (double)s.device_used / (1 << 30), (double)s.device_limit / (1 << 30),
         (double)s.host_used / (1 << 30), (unsigned long long)s.spill_count,
         (double)s.bytes_spilled / (1 << 30), s.seconds_spilling,
         (unsigned long long)s.unspill_count, (double)s.bytes_unspilled / (1 << 30),
         (unsigned long long)s.oom_evictions);
  /* where spilling time goes: pinning host memory, waiting for room,
   * spill-ahead, prefetches */
  printf("  %-12s unspill %6.2f s; room waits %llu (%6.2f s); pinned pool %.2f GiB in %llu "
         "grows (%llu in the background), %llu pageable blocks; prefetched %llu; ahead %llu; "
         "cancelled %llu\n",
         "", s.seconds_unspilling, (unsigned long long)s.room_waits, s.seconds_waiting_for_room,
         (double)s.host_pool_reserved / (1 << 30), (unsigned long long)s.host_pool_grows,
         (unsigned long long)s.host_pool_background_grows,
         (unsigned long long)s.host_pageable_allocs, (unsigned long long)s.prefetch_count,
         (unsigned long long)s.ahead_evictions, (unsigned long long)s.cancelled_spills);
}

typedef struct opts {
  size_t n, tile_bytes, limit, host_reserve;
  int T;
  long nstreams, samples;
  int full, prefetch;
} opts_t;

/* One whole run (fill, products, the check) on a runtime of its own with
 * device limit `limit`. Returns the products' TFLOP/s; *ok_out is 0 when a
 * checked entry is wrong or nothing was spilled although the tiles exceed
 * the limit. Exits 77 without a device. */
static double run(const opts_t *o, size_t limit, size_t host_reserve, int *ok_out);

/* The same products with cuBLAS alone on plain cudaMalloc memory on device
 * `device` (the --compare baseline), checked. Returns the TFLOP/s; *ok_out
 * 0 when a checked entry is wrong, -1 when the tiles do not fit. */
static double run_plain(const opts_t *o, int device, int *ok_out);

/* Where check_tiles finds C[i][j]: `get` returns its device pointer (valid
 * and complete until `put`). */
typedef struct tile_source {
  const float *(*get)(void *ctx, size_t k);
  void (*put)(void *ctx, size_t k);
  void *ctx;
} tile_source_t;

/* Checks every C tile against the CPU (sampled entries or every entry);
 * prints the count. Returns the number of wrong entries. */
static long check_tiles(const opts_t *o, const tile_source_t *src);

int main(int argc, char **argv) {
  long n_arg = 8192, tiles = 7, nstreams = 2, samples = 64;
  size_t limit = 0, reserve = 0;
  int full = 0, compare = 0, prefetch = 1;
  for (int a = 1; a < argc; a++) {
    if (strcmp(argv[a], "--full") == 0) { full = 1; continue; }
    if (strcmp(argv[a], "--compare") == 0) { compare = 1; continue; }
    if (strcmp(argv[a], "--no-prefetch") == 0) { prefetch = 0; continue; }
    if (a + 1 >= argc) usage(argv[0]);
    const char *v = argv[++a];
    if (strcmp(argv[a - 1], "--n") == 0) n_arg = atol(v);
    else if (strcmp(argv[a - 1], "--tiles") == 0) tiles = atol(v);
    else if (strcmp(argv[a - 1], "--limit") == 0) {
      limit = parse_bytes(v);
      if (!limit) usage(argv[0]);
    } else if (strcmp(argv[a - 1], "--host-reserve") == 0) {
      reserve = parse_bytes(v);
      if (!reserve) usage(argv[0]);
    } else if (strcmp(argv[a - 1], "--streams") == 0) nstreams = atol(v);
    else if (strcmp(argv[a - 1], "--samples") == 0) samples = atol(v);
    else usage(argv[0]);
  }
  opts_t o;
  o.n = (size_t)n_arg;
  o.tile_bytes = o.n * o.n * sizeof(float);
  o.T = (int)tiles;
  o.nstreams = nstreams;
  o.samples = samples;
  o.full = full || o.n <= 512;
  o.prefetch = prefetch;
  const size_t ntiles = (size_t)(2 * tiles + tiles * tiles);
  const size_t all = ntiles * o.tile_bytes;
  if (!limit) limit = compare ? all / 2 : (size_t)8 << 30;
  o.limit = limit;
  if (n_arg < 1 || n_arg > 65536 || tiles < 1 || tiles > 64 || nstreams < 1 ||
      nstreams > MAX_STREAMS || samples < 1 || limit < 3 * o.tile_bytes) {
    fprintf(stderr, "cublas_gemm: bad arguments (the limit must hold 3 tiles of %zu bytes)\n",
            o.tile_bytes);
    return 2;
  }
  int ok = 1;
  if (!compare) {
    (void)run(&o, limit, reserve, &ok);
  } else {
    if (!reserve) reserve = (all > limit ? all - limit : 0) + 4 * o.tile_bytes;
    const char *dev_env = getenv("DMEM_DEVICE");
    int ok1 = 1, ok2 = 1, ok3 = 1;
    double plain = run_plain(&o, dev_env && *dev_env ? atoi(dev_env) : 0, &ok1);
    double cold = run(&o, limit, 0, &ok2);
    double over = run(&o, limit, reserve, &ok3);
    ok = ok1 == 1 && ok2 && ok3;
    if (ok1 == -1) {
      printf("cublas_gemm --compare: the tiles (%.2f GiB) do not fit in device memory for the "
             "plain cudaMalloc baseline: no ratio\n",
             (double)all / (1 << 30));
    } else {
      const char *pin = getenv("DMEM_HOST_PIN");
      printf("cublas_gemm --compare: plain cudaMalloc %.1f TFLOP/s; through dmem %.2fx "
             "oversubscribed, pinned pool growing %.1f TFLOP/s (ratio %.2f); %.2fx "
             "oversubscribed with a %.2f GiB pinned reserve %.1f TFLOP/s: ratio %.2f (prefetch "
             "%s, DMEM_HOST_PIN %s)\n",
             plain, (double)all / (double)limit, cold, cold / plain, (double)all / (double)limit,
             (double)reserve / (1 << 30), over, over / plain, prefetch ? "on" : "off",
             pin && *pin ? pin : "auto");
      printf("RESULT cublas.tflops_plain=%.3f\n", plain);
      printf("RESULT cublas.ratio_pool_growing=%.4f\n", cold / plain);
      printf("RESULT cublas.ratio_reserve=%.4f\n", over / plain);
    }
  }
  printf("cublas_gemm: %s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

/* ---- checking the C tiles ---------------------------------------------------- */

typedef struct dmem_check_ctx {
  dmem_runtime_t *rt;
  dmem_handle_t *C;
  dmem_stream_t stream;
} dmem_check_ctx_t;

/* C[k] locked (retrieved if spilled) and its stream synchronised, so that a
 * plain cudaMemcpy reads complete data */
static const float *dmem_tile_get(void *ctx, size_t k) {
  dmem_check_ctx_t *c = (dmem_check_ctx_t *)ctx;
  void *dev;
  TRY(dmem_buffer_lock(c->rt, c->C[k], c->stream, &dev));
  TRY(dmem_stream_synchronize(c->rt, c->stream));
  return (const float *)dev;
}

static void dmem_tile_put(void *ctx, size_t k) {
  dmem_check_ctx_t *c = (dmem_check_ctx_t *)ctx;
  TRY(dmem_buffer_unlock(c->rt, c->C[k]));
}

static void cuda_check(const char *what, cudaError_t e) {
  if (e != cudaSuccess) {
    fprintf(stderr, "cublas_gemm: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
  }
}

static long check_tiles(const opts_t *o, const tile_source_t *src) {
  const size_t n = o->n, tile_bytes = o->tile_bytes;
  const long samples = o->samples;
  const int full = o->full, T = o->T;
  double t0 = now_s();
  long bad = 0, checked = 0;
  float *host = full ? malloc(tile_bytes) : NULL;
  float *a_tile = full ? malloc(tile_bytes) : NULL;
  float *b_tile = full ? malloc(tile_bytes) : NULL;
  float *got = malloc((size_t)samples * sizeof *got);
  size_t *rows = malloc((size_t)samples * sizeof *rows), *cols = malloc((size_t)samples * sizeof *cols);
  if ((full && (!host || !a_tile || !b_tile)) || !got || !rows || !cols) {
    fprintf(stderr, "cublas_gemm: out of host memory\n");
    exit(1);
  }
  uint32_t rng = 12345;
  for (int i = 0; i < T; i++) {
    if (full) make_tile(a_tile, 1u, i, n);
    for (int j = 0; j < T; j++) {
      size_t k = (size_t)i * (size_t)T + (size_t)j;
      const float *cdev = src->get(src->ctx, k);
      if (full) {
        cuda_check("cudaMemcpy", cudaMemcpy(host, cdev, tile_bytes, cudaMemcpyDeviceToHost));
      } else {
        for (long q = 0; q < samples; q++) {
          rng = mix(rng + 0x9E3779B9u);
          rows[q] = q == 0 ? 0 : q == 1 ? n - 1 : rng % n;
          rng = mix(rng + 0x9E3779B9u);
          cols[q] = q == 0 ? 0 : q == 1 ? n - 1 : rng % n;
          cuda_check("cudaMemcpy", cudaMemcpy(&got[q], cdev + cols[q] * n + rows[q], sizeof(float),
                                              cudaMemcpyDeviceToHost));
        }
      }
      src->put(src->ctx, k);
      if (full) {
        make_tile(b_tile, 2u, j, n);
        for (size_t c = 0; c < n; c++) {
          for (size_t r = 0; r < n; r++) {
            double ref = 0;
            for (size_t kk = 0; kk < n; kk++)
              ref += (double)a_tile[kk * n + r] * (double)b_tile[c * n + kk];
            checked++;
            if ((double)host[c * n + r] != ref) {
              if (bad < 10)
                fprintf(stderr, "C[%d][%d](%zu, %zu) = %g, want %g\n", i, j, r, c,
                        (double)host[c * n + r], ref);
              bad++;
            }
          }
        }
      } else {
        for (long q = 0; q < samples; q++) {
          double ref = 0;
          for (size_t kk = 0; kk < n; kk++)
            ref += (double)entry(1u, i, rows[q], kk) * (double)entry(2u, j, kk, cols[q]);
          checked++;
          if ((double)got[q] != ref) {
            if (bad < 10)
              fprintf(stderr, "C[%d][%d](%zu, %zu) = %g, want %g\n", i, j, rows[q], cols[q],
                      (double)got[q], ref);
            bad++;
          }
        }
      }
    }
  }
  printf("  checked %ld entries (%s) in %.2f s: %ld wrong\n", checked,
         full ? "every entry" : "sampled", now_s() - t0, bad);
  free(host);
  free(a_tile);
  free(b_tile);
  free(got);
  free(rows);
  free(cols);
  return bad;
}

/* ---- the baseline: cuBLAS on plain cudaMalloc memory ----------------------------- */

typedef struct plain_ctx {
  float **C;
} plain_ctx_t;

static const float *plain_tile_get(void *ctx, size_t k) { return ((plain_ctx_t *)ctx)->C[k]; }

static void plain_tile_put(void *ctx, size_t k) {
  (void)ctx;
  (void)k;
}

static double run_plain(const opts_t *o, int device, int *ok_out) {
  const size_t n = o->n, tile_bytes = o->tile_bytes;
  const int T = o->T;
  const long nstreams = o->nstreams;
  const size_t nC = (size_t)T * (size_t)T, ntiles = 2 * (size_t)T + nC;
  cudaError_t ce = cudaSetDevice(device);
  if (ce == cudaErrorNoDevice || ce == cudaErrorInvalidDevice || ce == cudaErrorInsufficientDriver) {
    fprintf(stderr, "SKIP: no CUDA device (%s)\n", cudaGetErrorString(ce));
    exit(77);
  }
  cuda_check("cudaSetDevice", ce);
  printf("cublas_gemm: baseline, cuBLAS alone on plain cudaMalloc memory (device %d): %zu tiles "
         "= %.2f GiB, %ld streams\n",
         device, ntiles, (double)ntiles * (double)tile_bytes / (1 << 30), nstreams);
  float **tiles = calloc(ntiles, sizeof *tiles);
  float *host = malloc(tile_bytes);
  if (!tiles || !host) {
    fprintf(stderr, "cublas_gemm: out of host memory\n");
    exit(1);
  }
  float **A = tiles, **B = tiles + T, **C = tiles + 2 * T;
  for (size_t t = 0; t < ntiles; t++) {
    ce = cudaMalloc((void **)&tiles[t], tile_bytes);
    if (ce != cudaSuccess) {
      (void)cudaGetLastError();
      for (size_t u = 0; u < t; u++) cudaFree(tiles[u]);
      free(tiles);
      free(host);
      *ok_out = -1;
      return 0;
    }
  }
  cudaStream_t streams[MAX_STREAMS];
  gemm_t gemms[MAX_STREAMS];
  for (long s = 0; s < nstreams; s++) {
    cuda_check("cudaStreamCreateWithFlags",
               cudaStreamCreateWithFlags(&streams[s], cudaStreamNonBlocking));
    if (cublasCreate(&gemms[s].handle) != CUBLAS_STATUS_SUCCESS) {
      fprintf(stderr, "cublas_gemm: cublasCreate failed\n");
      exit(1);
    }
    gemms[s].n = (int)n;
  }
  double t0 = now_s();
  for (int t = 0; t < 2 * T; t++) {
    make_tile(host, t < T ? 1u : 2u, t % T, n);
    cuda_check("cudaMemcpy", cudaMemcpy(tiles[t], host, tile_bytes, cudaMemcpyHostToDevice));
  }
  double t_fill = now_s() - t0;
  /* the same untimed warm-up as run(): C[0][0] once on every stream */
  for (long s = 0; s < nstreams; s++) {
    void *ptrs[3] = {A[0], B[0], C[0]};
    if (gemm_launch(&gemms[s], (dmem_stream_t)streams[s], ptrs, 3) != DMEM_OK) exit(1);
    cuda_check("cudaStreamSynchronize", cudaStreamSynchronize(streams[s]));
  }
  t0 = now_s();
  for (int i = 0; i < T; i++) {
    for (int j = 0; j < T; j++) {
      size_t k = (size_t)i * (size_t)T + (size_t)j;
      long s = (long)(k % (size_t)nstreams);
      void *ptrs[3] = {A[i], B[j], C[k]};
      if (gemm_launch(&gemms[s], (dmem_stream_t)streams[s], ptrs, 3) != DMEM_OK) exit(1);
    }
  }
  for (long s = 0; s < nstreams; s++)
    cuda_check("cudaStreamSynchronize", cudaStreamSynchronize(streams[s]));
  double t_gemm = now_s() - t0;
  double flops = 2.0 * (double)n * (double)n * (double)n * (double)(T * T);
  printf("  fill %.2f s; %d SGEMMs in %.2f s (%.1f TFLOP/s, plain cudaMalloc)\n", t_fill, T * T,
         t_gemm, flops / t_gemm * 1e-12);
  plain_ctx_t pc = {C};
  tile_source_t src = {plain_tile_get, plain_tile_put, &pc};
  long bad = check_tiles(o, &src);
  for (long s = 0; s < nstreams; s++) {
    cublasDestroy(gemms[s].handle);
    cuda_check("cudaStreamDestroy", cudaStreamDestroy(streams[s]));
  }
  for (size_t t = 0; t < ntiles; t++) cuda_check("cudaFree", cudaFree(tiles[t]));
  free(tiles);
  free(host);
  *ok_out = bad == 0;
  return flops / t_gemm * 1e-12;
}

static double run(const opts_t *o, size_t limit, size_t host_reserve, int *ok_out) {
  const size_t n = o->n, tile_bytes = o->tile_bytes;
  const long nstreams = o->nstreams;
  const int tiles = o->T;
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_CUDA;
  cfg.device_limit = limit;
  if (host_reserve) cfg.host_reserve = host_reserve;
  dmem_runtime_t *rt = NULL;
  double t_create = now_s();
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  t_create = now_s() - t_create;
  if (st == DMEM_ERR_NO_DEVICE) {
    fprintf(stderr, "SKIP: no CUDA device (%s)\n", dmem_last_error_detail());
    exit(77);
  }
  if (st != DMEM_OK) die("dmem_runtime_create", st);
  /* cuBLAS works on the calling thread's current device: make it dmem's */
  cudaError_t ce = cudaSetDevice(cfg.device);
  if (ce != cudaSuccess) {
    fprintf(stderr, "cublas_gemm: cudaSetDevice(%d): %s\n", cfg.device, cudaGetErrorString(ce));
    exit(1);
  }

  const int T = (int)tiles;
  const size_t ntiles = (size_t)(2 * T + T * T);
  printf("cublas_gemm: %d x %d tiled SGEMM, tiles %zu x %zu (%.0f MiB), %zu tiles = %.2f GiB "
         "under a device limit of %.2f GiB (%.2fx), %ld streams; pinned reserve %.2f GiB "
         "(runtime created in %.2f s)\n",
         T, T, n, n, (double)tile_bytes / (1 << 20), ntiles,
         (double)ntiles * (double)tile_bytes / (1 << 30), (double)limit / (1 << 30),
         (double)ntiles * (double)tile_bytes / (double)limit, nstreams,
         (double)cfg.host_reserve / (1 << 30), t_create);

  dmem_stream_t streams[MAX_STREAMS];
  gemm_t gemms[MAX_STREAMS];
  for (long s = 0; s < nstreams; s++) {
    TRY(dmem_stream_create(rt, &streams[s]));
    if (cublasCreate(&gemms[s].handle) != CUBLAS_STATUS_SUCCESS) {
      fprintf(stderr, "cublas_gemm: cublasCreate failed\n");
      exit(1);
    }
    gemms[s].n = (int)n;
  }

  /* A[i] and B[j], filled from the host */
  dmem_handle_t *A = calloc((size_t)T, sizeof *A), *B = calloc((size_t)T, sizeof *B);
  dmem_handle_t *C = calloc((size_t)T * (size_t)T, sizeof *C);
  float *host = malloc(tile_bytes);
  if (!A || !B || !C || !host) {
    fprintf(stderr, "cublas_gemm: out of host memory\n");
    exit(1);
  }
  double t0 = now_s();
  for (int t = 0; t < 2 * T; t++) {
    dmem_handle_t *h = t < T ? &A[t] : &B[t - T];
    TRY(dmem_buffer_alloc(rt, tile_bytes, 0, h));
    make_tile(host, t < T ? 1u : 2u, t % T, n);
    void *dev;
    TRY(dmem_buffer_lock(rt, *h, streams[0], &dev));
    TRY(dmem_stream_copy(rt, dev, host, tile_bytes, streams[0]));
    TRY(dmem_stream_synchronize(rt, streams[0]));
    TRY(dmem_buffer_unlock(rt, *h));
  }
  double t_fill = now_s() - t0;

  /* Warm-up, untimed: the first product on every stream's handle, so that
   * loading cuBLAS's kernels (lazily, at their first launch) and its
   * workspace are not charged to whichever run comes first. C[0][0] is
   * computed again, to the same values, in the timed loop. */
  TRY(dmem_buffer_alloc(rt, tile_bytes, 0, &C[0]));
  for (long s = 0; s < nstreams; s++) {
    dmem_handle_t hs[3] = {A[0], B[0], C[0]};
    TRY(dmem_launch_async(rt, streams[s], hs, 3, gemm_launch, &gemms[s]));
    TRY(dmem_sync_and_unlock(rt, streams[s]));
  }

  /* the products: the runtime spills and retrieves as they need; the next
   * product's inputs are prefetched on its stream while this one runs */
  t0 = now_s();
  for (int i = 0; i < T; i++) {
    for (int j = 0; j < T; j++) {
      size_t k = (size_t)i * (size_t)T + (size_t)j;
      long s = (long)(k % (size_t)nstreams);
      if (k > 0) TRY(dmem_buffer_alloc(rt, tile_bytes, 0, &C[k]));
      dmem_handle_t hs[3] = {A[i], B[j], C[k]};
      TRY(dmem_launch_async(rt, streams[s], hs, 3, gemm_launch, &gemms[s]));
      TRY(dmem_stream_release(rt, streams[s]));
      if (o->prefetch && k + 1 < (size_t)T * (size_t)T) {
        int i2 = (int)((k + 1) / (size_t)T), j2 = (int)((k + 1) % (size_t)T);
        dmem_handle_t next[2] = {A[i2], B[j2]};
        dmem_status_t ps = dmem_buffer_prefetch(rt, next, 2, streams[(k + 1) % (size_t)nstreams]);
        /* a hint: no room now is not an error (the lock will make room) */
        if (ps != DMEM_OK && ps != DMEM_ERR_OUT_OF_MEMORY) die("dmem_buffer_prefetch", ps);
      }
    }
  }
  for (long s = 0; s < nstreams; s++) TRY(dmem_stream_synchronize(rt, streams[s]));
  TRY(dmem_runtime_poll(rt));
  double t_gemm = now_s() - t0;
  double flops = 2.0 * (double)n * (double)n * (double)n * (double)(T * T);
  printf("  fill %.2f s; %d SGEMMs in %.2f s (%.1f TFLOP/s, spilling included)\n", t_fill, T * T,
         t_gemm, flops / t_gemm * 1e-12);
  print_stats(rt, "after GEMMs");

  double tflops = flops / t_gemm * 1e-12;
  /* check every C tile against the CPU */
  dmem_check_ctx_t cc = {rt, C, streams[0]};
  tile_source_t src = {dmem_tile_get, dmem_tile_put, &cc};
  long bad = check_tiles(o, &src);
  print_stats(rt, "after check");

  dmem_stats_t s;
  TRY(dmem_stats(rt, &s));
  int ok = bad == 0;
  if (ntiles * tile_bytes > limit && s.spill_count == 0) {
    fprintf(stderr, "cublas_gemm: the tiles exceed the limit but nothing was spilled\n");
    ok = 0;
  }
  for (size_t k = 0; k < (size_t)T * (size_t)T; k++) TRY(dmem_buffer_free(rt, C[k]));
  for (int t = 0; t < T; t++) {
    TRY(dmem_buffer_free(rt, A[t]));
    TRY(dmem_buffer_free(rt, B[t]));
  }
  for (long q = 0; q < nstreams; q++) {
    cublasDestroy(gemms[q].handle);
    TRY(dmem_stream_destroy(rt, streams[q]));
  }
  dmem_runtime_destroy(rt);
  free(A);
  free(B);
  free(C);
  free(host);
  *ok_out = ok;
  return tflops;
}
