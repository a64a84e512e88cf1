/*
 * examples/saxpy.cu - the README's saxpy with a CUDA kernel: y = alpha * x + y
 * over spillable buffers on the CUDA backend (examples/saxpy_host.c is the
 * same program on the host backend). Built with nvcc when the CUDA toolkit
 * is there; exits 77 (CTest: skipped) without a device.
 *
 *   saxpy_cuda [n (default 1 << 24)]
 *
 * The device limit is room for two of the three buffers, so they spill and
 * come back while the program runs. Exit 0 when every y[i] is right.
 */
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>
#include <dmem/dmem.h>

/* [saxpy] */
__global__ void saxpy_kernel(size_t n, float alpha, const float *x, float *y) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = alpha * x[i] + y[i];
}

/* A kernel launch copies its arguments: *args need only live for the
 * dmem_launch_async call here (unlike the host backend's host functions). */
typedef struct saxpy_args {
  size_t n;
  float alpha;
} saxpy_args;

/* Called by dmem_launch_async with the device addresses of the locked
 * buffers, in handle order; under CUDA a dmem_stream_t is a cudaStream_t. */
static dmem_status_t launch_saxpy(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  const saxpy_args *a = static_cast<const saxpy_args *>(user);
  (void)n; /* 2: x and y */
  unsigned blocks = (unsigned)((a->n + 255) / 256);
  saxpy_kernel<<<blocks, 256, 0, (cudaStream_t)s>>>(a->n, a->alpha,
                                                      static_cast<const float *>(ptrs[0]),
                                                      static_cast<float *>(ptrs[1]));
  return cudaGetLastError() == cudaSuccess ? DMEM_OK : DMEM_ERR_DEVICE;
}

/* Locks x and y on s (bringing them back if they were spilled, ordered on
 * s), records them in s's lock registry and launches. They stay locked until
 * dmem_sync_and_unlock(rt, s) (or dmem_stream_release). */
static dmem_status_t saxpy(dmem_runtime_t *rt, dmem_stream_t s, dmem_handle_t x,
                           dmem_handle_t y, size_t n, float alpha) {
  dmem_handle_t hs[2] = {x, y};
  saxpy_args args = {n, alpha};
  return dmem_launch_async(rt, s, hs, 2, launch_saxpy, &args);
}
/* [saxpy] */

/* Copy n bytes between host memory and buffer h, ordered on s; synchronise
 * s before unlocking and before the host side is read or reused. */
static dmem_status_t put(dmem_runtime_t *rt, dmem_stream_t s, dmem_handle_t h, const void *src,
                         size_t n) {
  void *dev;
  dmem_status_t st = dmem_buffer_lock(rt, h, s, &dev);
  if (st != DMEM_OK) return st;
  st = dmem_stream_copy(rt, dev, src, n, s);
  if (st == DMEM_OK) st = dmem_stream_synchronize(rt, s);
  dmem_status_t st2 = dmem_buffer_unlock(rt, h);
  return st != DMEM_OK ? st : st2;
}

static dmem_status_t get(dmem_runtime_t *rt, dmem_stream_t s, dmem_handle_t h, void *dst,
                         size_t n) {
  void *dev;
  dmem_status_t st = dmem_buffer_lock(rt, h, s, &dev);
  if (st != DMEM_OK) return st;
  st = dmem_stream_copy(rt, dst, dev, n, s);
  if (st == DMEM_OK) st = dmem_stream_synchronize(rt, s);
  dmem_status_t st2 = dmem_buffer_unlock(rt, h);
  return st != DMEM_OK ? st : st2;
}

#define TRY(call)                                                                      \
  do {                                                                                 \
    dmem_status_t st_ = (call);                                                        \
    if (st_ != DMEM_OK) {                                                              \
      fprintf(stderr, "saxpy: %s: %s (%s)\n", #call, dmem_status_name(st_),            \
              dmem_last_error_detail());                                               \
      return st_ == DMEM_ERR_NO_DEVICE ? 77 : 1;                                       \
    }                                                                                  \
  } while (0)

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 0) : (size_t)1 << 24;
  size_t bytes = n * sizeof(float);
  float *host = static_cast<float *>(malloc(bytes));
  if (!host || n == 0) return 1;

  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_CUDA;
  cfg.device_limit = 2 * bytes; /* room for two of the three buffers: spill beyond */
  dmem_runtime_t *rt;
  TRY(dmem_runtime_create(&cfg, &rt));
  dmem_stream_t s;
  TRY(dmem_stream_create(rt, &s));

  dmem_handle_t x, y, z;
  TRY(dmem_buffer_alloc(rt, bytes, DMEM_ALLOC_DEFAULT, &x));
  TRY(dmem_buffer_alloc(rt, bytes, DMEM_ALLOC_DEFAULT, &y));
  TRY(dmem_buffer_alloc(rt, bytes, DMEM_ALLOC_DEFAULT, &z));
  for (size_t i = 0; i < n; i++) host[i] = 1.0f;
  TRY(put(rt, s, x, host, bytes));
  for (size_t i = 0; i < n; i++) host[i] = 2.0f;
  TRY(put(rt, s, y, host, bytes));
  for (size_t i = 0; i < n; i++) host[i] = 3.0f;
  TRY(put(rt, s, z, host, bytes)); /* makes room: x is spilled */

  TRY(saxpy(rt, s, x, y, n, 2.0f)); /* brings x back: z is spilled */
  TRY(dmem_sync_and_unlock(rt, s));
  TRY(saxpy(rt, s, z, y, n, 2.0f));
  TRY(dmem_sync_and_unlock(rt, s));
  TRY(get(rt, s, y, host, bytes)); /* y = 2 * 3 + (2 * 1 + 2) = 10 */

  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += host[i] != 10.0f;
  float y0 = host[0];
  dmem_stats_t stats;
  TRY(dmem_stats(rt, &stats));
  TRY(dmem_buffer_free(rt, x));
  TRY(dmem_buffer_free(rt, y));
  TRY(dmem_buffer_free(rt, z));
  TRY(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
  free(host);
  printf("saxpy (CUDA): n=%zu, y[0]=%g, %zu wrong, %llu spills, %llu unspills\n", n, (double)y0,
         wrong, (unsigned long long)stats.spill_count, (unsigned long long)stats.unspill_count);
  if (stats.spill_count == 0 || stats.unspill_count == 0) {
    fprintf(stderr, "saxpy: nothing was spilled and brought back: the example shows no spilling\n");
    return 1;
  }
  return wrong == 0 ? 0 : 1;
}
