/*
 * examples/stable_graph.cu - a CUDA graph over spillable memory
 * (docs/stable.md): three buffers allocated with DMEM_BUFFER_STABLE_ADDRESS,
 * a graph captured once over their addresses (z = x + y, then x += 1), and
 * replayed after every buffer was spilled, each replay locking them with
 * dmem_launch_async. Built with nvcc when the CUDA toolkit is there; exits
 * 77 (CTest: skipped) without a device.
 *
 *   stable_graph [rounds (default 5)]
 *
 * Exit 0 when every z[i] is right after every round.
 */
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>
#include <dmem/dmem.h>

__global__ void add_kernel(size_t n, float *x, const float *y, float *z) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    z[i] = x[i] + y[i];
    x[i] += 1.0f;
  }
}

/* [graph] */
typedef struct graph {
  size_t n;              /* floats per buffer */
  cudaGraphExec_t exec;  /* captured once */
  void *captured[3];     /* the addresses it holds */
} graph;

/* Launch function, called with the buffers locked: capture the work on s
 * (a stream of our own: the default stream cannot be captured). */
static dmem_status_t capture(void *user, dmem_stream_t s, void *const *p, size_t n) {
  graph *g = static_cast<graph *>(user);
  cudaGraph_t cg;
  cudaStream_t cs = (cudaStream_t)s;
  if (cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
    return DMEM_ERR_DEVICE;
  add_kernel<<<(unsigned)((g->n + 255) / 256), 256, 0, cs>>>(
      g->n, static_cast<float *>(p[0]), static_cast<const float *>(p[1]),
      static_cast<float *>(p[2]));
  if (cudaStreamEndCapture(cs, &cg) != cudaSuccess) return DMEM_ERR_DEVICE;
  cudaError_t e = cudaGraphInstantiate(&g->exec, cg, 0);
  cudaGraphDestroy(cg);
  for (size_t i = 0; i < n; i++) g->captured[i] = p[i];
  return e == cudaSuccess ? DMEM_OK : DMEM_ERR_DEVICE;
}

/* Launch function of every replay: the buffers are locked, so resident, at
 * the addresses the graph holds (stable buffers come back where they were). */
static dmem_status_t replay(void *user, dmem_stream_t s, void *const *p, size_t n) {
  graph *g = static_cast<graph *>(user);
  for (size_t i = 0; i < n; i++)
    if (p[i] != g->captured[i]) return DMEM_ERR_DEVICE; /* never with stable buffers */
  return cudaGraphLaunch(g->exec, (cudaStream_t)s) == cudaSuccess ? DMEM_OK : DMEM_ERR_DEVICE;
}

/* Capture once (locking the buffers for the capture), on stream s. */
static dmem_status_t graph_capture(dmem_runtime_t *rt, dmem_stream_t s,
                                   const dmem_handle_t h[3], graph *g) {
  dmem_status_t st = dmem_launch_async(rt, s, h, 3, capture, g);
  dmem_status_t st2 = dmem_sync_and_unlock(rt, s);
  return st != DMEM_OK ? st : st2;
}

/* Every replay, after any number of spills: lock, launch the graph; the
 * buffers stay locked until dmem_sync_and_unlock(rt, s) or
 * dmem_stream_release(rt, s). */
static dmem_status_t graph_replay(dmem_runtime_t *rt, dmem_stream_t s,
                                  const dmem_handle_t h[3], graph *g) {
  return dmem_launch_async(rt, s, h, 3, replay, g);
}
/* [graph] */

#define DIE(what, st)                                                                    \
  do {                                                                                   \
    fprintf(stderr, "stable_graph: %s: %s (%s)\n", what, dmem_status_name(st),          \
            dmem_last_error_detail());                                                   \
    return 1;                                                                            \
  } while (0)

int main(int argc, char **argv) {
  int rounds = argc > 1 ? atoi(argv[1]) : 5;
  const size_t n = (size_t)1 << 22; /* 16 MiB per buffer */
  const size_t bytes = n * sizeof(float);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_CUDA;
  cfg.device_limit = 4 * bytes;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) {
    fprintf(stderr, "stable_graph: no CUDA device (%s)\n", dmem_last_error_detail());
    return 77;
  }
  if (st != DMEM_OK) DIE("dmem_runtime_create", st);
  dmem_handle_t h[3];
  for (int i = 0; i < 3; i++)
    if ((st = dmem_buffer_alloc(rt, bytes, DMEM_BUFFER_STABLE_ADDRESS, &h[i])) != DMEM_OK)
      DIE("dmem_buffer_alloc", st);
  std::vector<float> x(n), y(n), z(n);
  for (size_t i = 0; i < n; i++) {
    x[i] = (float)(i % 1000);
    y[i] = 0.5f;
  }
  const float *src[2] = {x.data(), y.data()};
  for (int i = 0; i < 2; i++) { /* x and y in, through a lock */
    void *p;
    if ((st = dmem_buffer_lock(rt, h[i], NULL, &p)) != DMEM_OK) DIE("dmem_buffer_lock", st);
    if ((st = dmem_stream_copy(rt, p, src[i], bytes, NULL)) != DMEM_OK) DIE("dmem_stream_copy", st);
    if ((st = dmem_stream_synchronize(rt, NULL)) != DMEM_OK) DIE("synchronize", st);
    dmem_buffer_unlock(rt, h[i]);
  }
  dmem_stream_t s;
  if ((st = dmem_stream_create(rt, &s)) != DMEM_OK) DIE("dmem_stream_create", st);
  graph g = {n, NULL, {NULL, NULL, NULL}};
  if ((st = graph_capture(rt, s, h, &g)) != DMEM_OK) DIE("capture", st);
  size_t wrong = 0;
  for (int r = 0; r < rounds; r++) {
    for (int i = 0; i < 3; i++)
      if ((st = dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST)) != DMEM_OK) DIE("dmem_buffer_spill", st);
    if ((st = graph_replay(rt, s, h, &g)) != DMEM_OK) DIE("replay", st);
    if ((st = dmem_sync_and_unlock(rt, s)) != DMEM_OK) DIE("dmem_sync_and_unlock", st);
    void *p; /* z out */
    if ((st = dmem_buffer_lock(rt, h[2], NULL, &p)) != DMEM_OK) DIE("dmem_buffer_lock", st);
    if ((st = dmem_stream_copy(rt, z.data(), p, bytes, NULL)) != DMEM_OK) DIE("dmem_stream_copy", st);
    if ((st = dmem_stream_synchronize(rt, NULL)) != DMEM_OK) DIE("synchronize", st);
    dmem_buffer_unlock(rt, h[2]);
    for (size_t i = 0; i < n; i++) wrong += z[i] != (float)(i % 1000) + (float)r + 0.5f;
  }
  dmem_stats_t stats;
  dmem_stats(rt, &stats);
  printf("stable_graph: %d replays after spilling all 3 buffers, %llu spills, %zu wrong\n",
         rounds, (unsigned long long)stats.spill_count, wrong);
  cudaGraphExecDestroy(g.exec);
  dmem_stream_destroy(rt, s);
  for (int i = 0; i < 3; i++) dmem_buffer_free(rt, h[i]);
  dmem_runtime_destroy(rt);
  return wrong == 0 ? 0 : 1;
}
