/*
 * bench/bench_pin.c - how fast can a process get pinned host memory?
 *
 * A spill needs pinned host memory for its copy to run at the link's speed
 * and without a host stall, and a workload that spills gigabytes needs
 * gigabytes of it. Pinning is slow: cudaMallocHost takes 0.7-28 ms a call
 * (anchors.md), about 2.3 GB/s at 64 MiB, against 55 GB/s for the copies it
 * feeds. This bench measures, for chunks of 64 MiB, 256 MiB and 1 GiB, the
 * GB/s of each way of getting pinned memory:
 *
 *   mallochost     cudaMallocHost (what the pool did)
 *   hostalloc      cudaHostAlloc(cudaHostAllocPortable)
 *   register       mmap + first touch by one thread + cudaHostRegister
 *   register-thp   the same with madvise(MADV_HUGEPAGE) before the touch
 *   register-par   mmap + madvise(MADV_HUGEPAGE) + first touch by T threads +
 *                  cudaHostRegister
 *   reregister     cudaHostRegister of memory that was pinned and unpinned
 *                  before (pages already present): the cost of pinning alone
 *
 * and, as the rate the pinned memory must keep up with, a pinned
 * cudaMemcpyAsync device->host of the same size. Each figure is the median
 * of --reps runs (default 3). Plain C over the CUDA Runtime API.
 *
 *   bench_pin [--reps N] [--threads T] [--max BYTES]
 */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define CK(call)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                       \
      fprintf(stderr, "bench_pin: %s: %s\n", #call, cudaGetErrorString(e_));       \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

typedef struct touch {
  char *base;
  size_t bytes;
} touch_t;

static void *touch_fn(void *arg) {
  touch_t *t = arg;
  for (size_t o = 0; o < t->bytes; o += 4096) t->base[o] = 1;
  return NULL;
}

static void touch(char *p, size_t bytes, int threads) {
  if (threads <= 1) {
    touch_t t = {p, bytes};
    (void)touch_fn(&t);
    return;
  }
  pthread_t th[64];
  touch_t ts[64];
  size_t per = (bytes / (size_t)threads + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
  int n = 0;
  for (size_t o = 0; o < bytes && n < threads; o += per, n++) {
    ts[n].base = p + o;
    ts[n].bytes = o + per <= bytes ? per : bytes - o;
    if (pthread_create(&th[n], NULL, touch_fn, &ts[n]) != 0) {
      (void)touch_fn(&ts[n]);
      th[n] = 0;
    }
  }
  for (int i = 0; i < n; i++)
    if (th[i]) pthread_join(th[i], NULL);
}

enum { MALLOCHOST, HOSTALLOC, REGISTER, REGISTER_THP, REGISTER_PAR, REREGISTER, NWAYS };
static const char *way_name[NWAYS] = {"mallochost", "hostalloc", "register", "register-thp",
                                      "register-par", "reregister"};

/* Seconds to get `bytes` pinned by `way` (the memory is given back after). */
static double pin_once(int way, size_t bytes, int threads) {
  void *p = NULL;
  double t0 = now_s(), t;
  switch (way) {
    case MALLOCHOST:
      CK(cudaMallocHost(&p, bytes));
      t = now_s() - t0;
      CK(cudaFreeHost(p));
      return t;
    case HOSTALLOC:
      CK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
      t = now_s() - t0;
      CK(cudaFreeHost(p));
      return t;
    default: break;
  }
  char *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    perror("bench_pin: mmap");
    exit(1);
  }
  if (way == REREGISTER) { /* pages present and pinned once before: time the pin alone */
    touch(m, bytes, threads);
    CK(cudaHostRegister(m, bytes, cudaHostRegisterPortable));
    CK(cudaHostUnregister(m));
    t0 = now_s();
  }
  if (way == REGISTER_THP || way == REGISTER_PAR) (void)madvise(m, bytes, MADV_HUGEPAGE);
  if (way != REREGISTER) touch(m, bytes, way == REGISTER_PAR ? threads : 1);
  CK(cudaHostRegister(m, bytes, cudaHostRegisterPortable));
  t = now_s() - t0;
  CK(cudaHostUnregister(m));
  munmap(m, bytes);
  return t;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
  int reps = 3, threads = 8;
  size_t max = (size_t)1 << 30;
  for (int a = 1; a + 1 < argc; a += 2) {
    if (strcmp(argv[a], "--reps") == 0) reps = atoi(argv[a + 1]);
    else if (strcmp(argv[a], "--threads") == 0) threads = atoi(argv[a + 1]);
    else if (strcmp(argv[a], "--max") == 0) max = (size_t)strtoull(argv[a + 1], NULL, 0);
    else {
      fprintf(stderr, "usage: %s [--reps N] [--threads T] [--max BYTES]\n", argv[0]);
      return 2;
    }
  }
  if (reps < 1 || reps > 99 || threads < 1 || threads > 64) {
    fprintf(stderr, "bench_pin: bad arguments\n");
    return 2;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    fprintf(stderr, "SKIP: no CUDA device\n");
    return 77;
  }
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  printf("bench_pin: GB/s of getting pinned host memory (median of %d), %d touch threads\n",
         reps, threads);
  printf("%-10s", "chunk");
  for (int w = 0; w < NWAYS; w++) printf(" | %12s", way_name[w]);
  printf(" | %12s\n", "D2H copy");
  for (size_t bytes = (size_t)64 << 20; bytes <= max; bytes *= 4) {
    printf("%6zu MiB ", bytes >> 20);
    for (int w = 0; w < NWAYS; w++) {
      double v[99];
      for (int r = 0; r < reps; r++) v[r] = pin_once(w, bytes, threads);
      printf(" | %12.2f", (double)bytes / median(v, reps) * 1e-9);
      fflush(stdout);
    }
    void *h = NULL, *d = NULL;
    cudaStream_t s;
    CK(cudaMallocHost(&h, bytes));
    CK(cudaMalloc(&d, bytes));
    CK(cudaStreamCreate(&s));
    CK(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    double v[99];
    for (int r = 0; r < reps; r++) {
      double t0 = now_s();
      CK(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      v[r] = now_s() - t0;
    }
    printf(" | %12.2f\n", (double)bytes / median(v, reps) * 1e-9);
    CK(cudaStreamDestroy(s));
    CK(cudaFree(d));
    CK(cudaFreeHost(h));
  }
  return 0;
}
