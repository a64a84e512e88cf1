/*
 * examples/saxpy_host.c - the README's C program: y = alpha * x + y over
 * spillable buffers, on the host backend (device memory simulated in host
 * memory, streams are worker threads), where a "kernel" is a host function
 * run in stream order by dmem_stream_enqueue_host. examples/saxpy.cu is the
 * same program with a CUDA kernel.
 *
 *   saxpy_host [n (default 1 << 20)]
 *
 * The device limit is a quarter of what the buffers need, so they spill and
 * come back while the program runs. Exit 0 when every y[i] is right.
 */
#include <stdio.h>
#include <stdlib.h>

#include <dmem/dmem.h>

/* [saxpy] */
/* The kernel's arguments. They must live until the kernel has run: the
 * host backend runs it later, on the stream's thread (a CUDA kernel copies
 * its arguments at launch, a host function does not). */
typedef struct saxpy_args {
  dmem_runtime_t *rt; /* the launch function needs the runtime */
  size_t n;
  float alpha;
  const float *x; /* set by the launch function: device addresses */
  float *y;
} saxpy_args;

/* The "kernel": runs on s's thread once the work queued before it is done. */
static void saxpy_kernel(void *user) {
  saxpy_args *a = (saxpy_args *)user;
  for (size_t i = 0; i < a->n; i++) a->y[i] = a->alpha * a->x[i] + a->y[i];
}

/* Called by dmem_launch_async with the device addresses of the locked
 * buffers, in handle order. */
static dmem_status_t launch_saxpy(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  saxpy_args *a = (saxpy_args *)user;
  (void)n; /* 2: x and y */
  a->x = (const float *)ptrs[0];
  a->y = (float *)ptrs[1];
  return dmem_stream_enqueue_host(a->rt, s, saxpy_kernel, a);
}

/* Locks x and y on s (bringing them back if they were spilled, ordered on
 * s), records them in s's lock registry and launches. They stay locked until
 * dmem_sync_and_unlock(rt, s) (or dmem_stream_release): *args must live
 * until then. */
static dmem_status_t saxpy(dmem_runtime_t *rt, dmem_stream_t s, dmem_handle_t x,
                           dmem_handle_t y, saxpy_args *args) {
  dmem_handle_t hs[2] = {x, y};
  return dmem_launch_async(rt, s, hs, 2, launch_saxpy, args);
}
/* [saxpy] */

/* [fill] */
/* Copy n bytes from host memory into buffer h, or out of it. The copy is
 * ordered on s: synchronise s before unlocking (an unlocked buffer may be
 * spilled at once, while a copy still queued on s would touch its old
 * memory) and before reading or reusing the host side. */
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
/* [fill] */

#define TRY(call)                                                                      \
  do {                                                                                 \
    dmem_status_t st_ = (call);                                                        \
    if (st_ != DMEM_OK) {                                                              \
      fprintf(stderr, "saxpy: %s: %s (%s)\n", #call, dmem_status_name(st_),            \
              dmem_last_error_detail());                                               \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 0) : (size_t)1 << 20;
  size_t bytes = n * sizeof(float);
  float *host = malloc(bytes);
  if (!host || n == 0) return 1;

  /* [main] */
  dmem_config_t cfg;
  dmem_config_init(&cfg);            /* defaults + DMEM_* environment */
  cfg.backend = DMEM_BACKEND_HOST;   /* this program's kernel is a host function */
  cfg.device_limit = 2 * bytes;      /* room for two of the three buffers: spill beyond */
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
  TRY(put(rt, s, z, host, bytes));   /* makes room: x is spilled */

  saxpy_args args = {.rt = rt, .n = n, .alpha = 2.0f};
  TRY(saxpy(rt, s, x, y, &args));    /* brings x back: z is spilled */
  TRY(dmem_sync_and_unlock(rt, s));  /* the kernel has run: args is free again */
  TRY(saxpy(rt, s, z, y, &args));
  TRY(dmem_sync_and_unlock(rt, s));

  TRY(get(rt, s, y, host, bytes));   /* y = 2 * 3 + (2 * 1 + 2) = 10 */
  /* [main] */
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += host[i] != 10.0f;
  float y0 = host[0];
  dmem_stats_t stats;
  TRY(dmem_stats(rt, &stats));
  /* [main-end] */
  TRY(dmem_buffer_free(rt, x));
  TRY(dmem_buffer_free(rt, y));
  TRY(dmem_buffer_free(rt, z));
  TRY(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
  /* [main-end] */
  free(host);
  printf("saxpy: n=%zu, y[0]=%g, %zu wrong, %llu spills, %llu unspills\n", n, (double)y0, wrong,
         (unsigned long long)stats.spill_count, (unsigned long long)stats.unspill_count);
  if (stats.spill_count == 0 || stats.unspill_count == 0) {
    fprintf(stderr, "saxpy: nothing was spilled and brought back: the example shows no spilling\n");
    return 1;
  }
  return wrong == 0 ? 0 : 1;
}
