/*
 * tests/gpu/gpu_check.cuh - helpers for the GPU tests (CUDA C++, built by
 * nvcc): a runtime on the CUDA backend that skips (exit 77) without a
 * device, checked CUDA calls, the pattern kernels and a host-side verify.
 *
 * Include after "check.h" (the C test helper: TEST_CASE, CHECK_*, main).
 *
 * Pattern: word i of a buffer with seed s at generation g holds
 * gpu_pat(s, i) + g (uint32_t, wrapping). Kernels count mismatches into a
 * device counter (block reduction in shared memory, one atomicAdd per block
 * that saw any), so compute-sanitizer's racecheck and synccheck have
 * something to look at.
 *
 * Environment:
 *   DMEM_GPU_SMALL=1  shrink every case (sizes, rounds) for compute-sanitizer
 *   DMEM_GPU_SMALL=2  shrink the spill-cycle case further (racecheck)
 *   DMEM_DEVICE       device ordinal (dmem_config_init reads it)
 */
#ifndef DMEM_GPU_CHECK_CUH
#define DMEM_GPU_CHECK_CUH

#include <cuda_runtime.h>
#include <pthread.h>
#include <time.h>

#ifndef MiB
#define MiB ((size_t)1 << 20)
#endif
#define GiB ((size_t)1 << 30)

/* ---- CUDA calls --------------------------------------------------------- */

/* In a test case: stop it on a failed CUDA call. */
#define CUDA_REQUIRE(call)                                                          \
  do {                                                                              \
    cudaError_t gpu_e_ = (call);                                                    \
    if (gpu_e_ != cudaSuccess)                                                      \
      CHECK_FAIL_(1, "%s: %s (%s)", #call, cudaGetErrorName(gpu_e_),              \
                  cudaGetErrorString(gpu_e_));                                      \
  } while (0)

/* Outside a case (threads, launch functions): report and exit(1). */
#define CUDA_DIE(call)                                                              \
  do {                                                                              \
    cudaError_t gpu_e_ = (call);                                                    \
    if (gpu_e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,           \
              cudaGetErrorName(gpu_e_), cudaGetErrorString(gpu_e_));                \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

#define DMEM_DIE(call)                                                              \
  do {                                                                              \
    dmem_status_t gpu_s_ = (call);                                                  \
    if (gpu_s_ != DMEM_OK) {                                                        \
      fprintf(stderr, "%s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,           \
              dmem_status_name(gpu_s_), dmem_last_error_detail());                  \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

/* After a kernel launch inside a launch function: DMEM_ERR_DEVICE (with the
 * CUDA error printed) if the launch failed. */
static inline dmem_status_t gpu_launched(const char *what) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return DMEM_OK;
  fprintf(stderr, "launch of %s: %s (%s)\n", what, cudaGetErrorName(e), cudaGetErrorString(e));
  return DMEM_ERR_DEVICE;
}

/* ---- environment, time ------------------------------------------------------ */

static inline bool gpu_small(void) {
  const char *s = getenv("DMEM_GPU_SMALL");
  return s && *s && strcmp(s, "0") != 0;
}

/* DMEM_GPU_SMALL=2: smaller still, for racecheck (which instruments every
 * shared-memory access of the checking kernels). */
static inline bool gpu_tiny(void) {
  const char *s = getenv("DMEM_GPU_SMALL");
  return s && strcmp(s, "2") == 0;
}

static inline double gpu_env_double(const char *name, double dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || v <= 0) {
    fprintf(stderr, "%s=%s is not a positive number\n", name, s);
    exit(2);
  }
  return v;
}

static inline double gpu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the runtime ------------------------------------------------------------- */

static int g_gpu_device; /* the runtime's device, for cudaSetDevice in threads */

static void gpu_warm_kernels(void);

/* A runtime on the CUDA backend (whatever DMEM_BACKEND says); exit 77 when
 * no device is usable. Makes the runtime's device current on this thread. */
static inline dmem_runtime_t *gpu_runtime_cfg(dmem_config_t *cfg) {
  cfg->backend = DMEM_BACKEND_CUDA;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) SKIP("no CUDA device: %s", dmem_last_error_detail());
  if (st != DMEM_OK) {
    fprintf(stderr, "dmem_runtime_create: %s (%s)\n", dmem_status_name(st),
            dmem_last_error_detail());
    exit(1);
  }
  g_gpu_device = cfg->device;
  CUDA_DIE(cudaSetDevice(cfg->device));
  gpu_warm_kernels();
  return rt;
}

/* A CUDA runtime with the given limits. Spill-ahead is off unless
 * DMEM_SPILL_AHEAD says, so that counts are exact; gpu_runtime_ahead turns
 * it on (95 %, 90 %) with the ALWAYS trigger (unless
 * DMEM_SPILL_AHEAD_TRIGGER says), so that its thread moves buffers. */
static inline dmem_runtime_t *gpu_runtime(size_t device_limit, size_t host_limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.device_limit = device_limit;
  cfg.host_limit = host_limit;
  if (!getenv("DMEM_SPILL_AHEAD")) cfg.spill_ahead = 0;
  return gpu_runtime_cfg(&cfg);
}

static inline dmem_runtime_t *gpu_runtime_ahead(size_t device_limit, size_t host_limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.device_limit = device_limit;
  cfg.host_limit = host_limit;
  if (!getenv("DMEM_SPILL_AHEAD")) cfg.spill_ahead = 0.95;
  if (!getenv("DMEM_SPILL_AHEAD_TRIGGER")) cfg.spill_ahead_trigger = DMEM_SPILL_AHEAD_ALWAYS;
  return gpu_runtime_cfg(&cfg);
}

/* ---- pattern and kernels -------------------------------------------------- */

__host__ __device__ inline uint32_t gpu_pat(uint32_t seed, size_t i) {
  uint32_t x = (uint32_t)i * 0x9E3779B1u ^ (uint32_t)(i >> 32) * 0x85EBCA6Bu ^ seed;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

#define GPU_BLOCK 256

static inline unsigned gpu_grid(size_t n) {
  size_t g = (n + GPU_BLOCK - 1) / GPU_BLOCK;
  return (unsigned)(g < 2048 ? (g ? g : 1) : 2048);
}

/* Sum `mine` over the block (shared memory, __syncthreads) and add it to
 * *bad from thread 0 if non-zero. Every thread of the block must call it. */
__device__ inline void gpu_block_count(unsigned long long mine, unsigned long long *bad) {
  __shared__ unsigned long long part[GPU_BLOCK];
  part[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0 && part[0] != 0) atomicAdd(bad, part[0]);
}

__global__ void gpu_k_fill(uint32_t *p, size_t n, uint32_t seed, uint32_t gen) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = gpu_pat(seed, i) + gen;
}

/* Count words that differ from generation `gen`. */
__global__ void gpu_k_check(const uint32_t *p, size_t n, uint32_t seed, uint32_t gen,
                            unsigned long long *bad) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    mine += p[i] != gpu_pat(seed, i) + gen;
  gpu_block_count(mine, bad);
}

/* Check generation `gen`, then increment every word (to gen + 1). */
__global__ void gpu_k_check_inc(uint32_t *p, size_t n, uint32_t seed, uint32_t gen,
                                unsigned long long *bad) {
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t v = p[i];
    mine += v != gpu_pat(seed, i) + gen;
    p[i] = v + 1;
  }
  gpu_block_count(mine, bad);
}

__device__ inline unsigned long long gpu_globaltimer(void) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* One thread spins for `ns` nanoseconds of wall time (%globaltimer), then
 * sets *done (if not NULL). */
__global__ void gpu_k_spin(unsigned long long ns, int *done) {
  unsigned long long t0 = gpu_globaltimer();
  while (gpu_globaltimer() - t0 < ns) {
  }
  if (done) *done = 1;
}

/* Launch helpers: check the launch, return a dmem status. */
static inline dmem_status_t gpu_fill(void *p, size_t bytes, uint32_t seed, uint32_t gen,
                                     cudaStream_t s) {
  size_t n = bytes / 4;
  gpu_k_fill<<<gpu_grid(n), GPU_BLOCK, 0, s>>>((uint32_t *)p, n, seed, gen);
  return gpu_launched("gpu_k_fill");
}

static inline dmem_status_t gpu_check(const void *p, size_t bytes, uint32_t seed, uint32_t gen,
                                      unsigned long long *bad, cudaStream_t s) {
  size_t n = bytes / 4;
  gpu_k_check<<<gpu_grid(n), GPU_BLOCK, 0, s>>>((const uint32_t *)p, n, seed, gen, bad);
  return gpu_launched("gpu_k_check");
}

static inline dmem_status_t gpu_check_inc(void *p, size_t bytes, uint32_t seed, uint32_t gen,
                                          unsigned long long *bad, cudaStream_t s) {
  size_t n = bytes / 4;
  gpu_k_check_inc<<<gpu_grid(n), GPU_BLOCK, 0, s>>>((uint32_t *)p, n, seed, gen, bad);
  return gpu_launched("gpu_k_check_inc");
}

static inline dmem_status_t gpu_spin(double seconds, int *done, cudaStream_t s) {
  gpu_k_spin<<<1, 1, 0, s>>>((unsigned long long)(seconds * 1e9), done);
  return gpu_launched("gpu_k_spin");
}

/* Load every kernel once (modules load lazily, and compute-sanitizer
 * instruments a kernel at its first launch), so that the first launch in a
 * timed section costs no more than any other. */
static void gpu_warm_kernels(void) {
  gpu_k_fill<<<1, GPU_BLOCK>>>(NULL, 0, 0, 0);
  CUDA_DIE(cudaGetLastError());
  gpu_k_check<<<1, GPU_BLOCK>>>(NULL, 0, 0, 0, NULL);
  CUDA_DIE(cudaGetLastError());
  gpu_k_check_inc<<<1, GPU_BLOCK>>>(NULL, 0, 0, 0, NULL);
  CUDA_DIE(cudaGetLastError());
  gpu_k_spin<<<1, 1>>>(0, NULL);
  CUDA_DIE(cudaGetLastError());
  CUDA_DIE(cudaDeviceSynchronize());
}

/* Mismatch counters: device memory outside dmem (cudaMalloc), zeroed. */
static inline unsigned long long *gpu_counters(size_t n) {
  unsigned long long *c = NULL;
  CUDA_DIE(cudaMalloc(&c, n * sizeof *c));
  CUDA_DIE(cudaMemset(c, 0, n * sizeof *c));
  return c;
}

static inline unsigned long long gpu_counter_read(const unsigned long long *c) {
  unsigned long long v = 0;
  CUDA_DIE(cudaMemcpy(&v, c, sizeof v, cudaMemcpyDeviceToHost));
  return v;
}

/* Overwrite freed device memory with 0xA5 so that a buffer brought back to
 * the same address cannot look right by accident: allocate (and free) as
 * much as is free, up to `bytes`, and memset it. */
static inline void gpu_poison_free_memory(size_t bytes) {
  void *p = NULL;
  while (bytes >= MiB && cudaMalloc(&p, bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    bytes /= 2;
  }
  if (!p) return;
  CUDA_DIE(cudaMemset(p, 0xA5, bytes));
  CUDA_DIE(cudaDeviceSynchronize());
  CUDA_DIE(cudaFree(p));
}

/* A buffer freed while a background move holds it (the I/O threads' push-down
 * to disk, the spill-ahead thread) is reclaimed when that move ends
 * (include/dmem/buffer.h, dmem_buffer_free). After the last free, wait up to
 * `seconds` for the runtime to hold no buffer, and give the stats then: a
 * buffer that is never reclaimed still fails the caller's checks. */
static inline dmem_stats_t gpu_stats_once_reclaimed(dmem_runtime_t *rt, double seconds) {
  dmem_stats_t st;
  double t0 = gpu_now();
  for (;;) {
    DMEM_DIE(dmem_runtime_poll(rt));
    DMEM_DIE(dmem_stats(rt, &st));
    if (st.buffer_count == 0 || gpu_now() - t0 > seconds) break;
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  double waited = gpu_now() - t0;
  if (waited > 0.001)
    fprintf(stderr, "%llu buffers left %.3f s after the last free\n",
            (unsigned long long)st.buffer_count, waited);
  return st;
}

/* ---- host-side verification -------------------------------------------------- */

/* Lock h on s (retrieving it if deferred), copy it to the pinned host
 * memory `host` (bytes long) with cudaMemcpyAsync on s, synchronise, unlock,
 * and count the words that differ from generation gen. Returns (size_t)-1
 * if the lock failed. */
static inline size_t gpu_host_verify_into(dmem_runtime_t *rt, dmem_handle_t h, size_t bytes,
                                          uint32_t seed, uint32_t gen, dmem_stream_t s,
                                          uint32_t *host) {
  void *dev = NULL;
  dmem_status_t st = dmem_buffer_lock(rt, h, s, &dev);
  if (st != DMEM_OK) {
    fprintf(stderr, "gpu_host_verify: dmem_buffer_lock: %s (%s)\n", dmem_status_name(st),
            dmem_last_error_detail());
    return (size_t)-1;
  }
  CUDA_DIE(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)s));
  CUDA_DIE(cudaStreamSynchronize((cudaStream_t)s));
  DMEM_DIE(dmem_buffer_unlock(rt, h));
  size_t bad = 0, n = bytes / 4;
  for (size_t i = 0; i < n; i++) bad += host[i] != gpu_pat(seed, i) + gen;
  return bad;
}

/* The same with pinned memory of its own. */
static inline size_t gpu_host_verify(dmem_runtime_t *rt, dmem_handle_t h, size_t bytes,
                                     uint32_t seed, uint32_t gen, dmem_stream_t s) {
  uint32_t *host = NULL;
  CUDA_DIE(cudaMallocHost(&host, bytes));
  size_t bad = gpu_host_verify_into(rt, h, bytes, seed, gen, s, host);
  CUDA_DIE(cudaFreeHost(host));
  return bad;
}

static inline dmem_state_t gpu_state(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

static inline unsigned gpu_lock_count(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return 999;
  return info.lock_count;
}

#endif /* DMEM_GPU_CHECK_CUH */
