/*
 * tests/gpu/test_gpu_stable.cu - stable-address buffers (DMEM_BUFFER_STABLE_ADDRESS,
 * CUDA VMM) with real kernels and CUDA graphs: a graph captured once over
 * stable buffers is replayed after every buffer was spilled (to pinned host
 * memory, then to disk), each replay after locking them with
 * dmem_launch_async (docs/stable.md); the kernels check every word and
 * increment it, so a replay that ran on stale, unmapped or misplaced memory
 * counts mismatches (or faults). Then the same at 2x oversubscription: one
 * graph per pair of buffers, replayed round robin, each replay bringing its
 * pair back (and spilling others).
 *
 * Exits 77 without a CUDA device. DMEM_GPU_SMALL=1 shrinks it.
 */
#include "check.h"
#include "gpu_check.cuh"

/* Check generation *g of p's words, then increment them. */
__global__ void stable_k_check_inc(uint32_t *p, size_t n, uint32_t seed, const uint32_t *g,
                                   unsigned long long *bad) {
  uint32_t gen = *g;
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t v = p[i];
    mine += v != gpu_pat(seed, i) + gen;
    p[i] = v + 1;
  }
  gpu_block_count(mine, bad);
}

__global__ void stable_k_bump(uint32_t *g) { *g += 1; }

#define SG_MAX 9

typedef struct sgraph {
  size_t bytes;                /* of each data buffer */
  uint32_t seed[SG_MAX];       /* data buffers: all but the last handle */
  unsigned long long *bad;     /* cudaMalloc'd counter, outside dmem */
  cudaGraphExec_t exec;
  void *captured[SG_MAX];      /* the addresses the graph holds */
  size_t n;                    /* handles: data buffers + the generation buffer */
  int replays, moved;          /* replays; pointers that differed from the captured */
} sgraph_t;

/* Launch function: capture the graph (data buffers p[0..n-1), generation
 * buffer p[n-1]) on s. */
static dmem_status_t sg_capture(void *user, dmem_stream_t s, void *const *p, size_t n) {
  sgraph_t *g = (sgraph_t *)user;
  cudaStream_t cs = (cudaStream_t)s;
  cudaGraph_t graph;
  if (cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
    return gpu_launched("cudaStreamBeginCapture");
  const uint32_t *gen = (const uint32_t *)p[n - 1];
  size_t words = g->bytes / 4;
  for (size_t i = 0; i + 1 < n; i++)
    stable_k_check_inc<<<gpu_grid(words), GPU_BLOCK, 0, cs>>>((uint32_t *)p[i], words, g->seed[i],
                                                              gen, g->bad);
  stable_k_bump<<<1, 1, 0, cs>>>((uint32_t *)p[n - 1]);
  cudaError_t e = cudaStreamEndCapture(cs, &graph);
  if (e != cudaSuccess) {
    fprintf(stderr, "cudaStreamEndCapture: %s\n", cudaGetErrorName(e));
    return DMEM_ERR_DEVICE;
  }
  e = cudaGraphInstantiate(&g->exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    fprintf(stderr, "cudaGraphInstantiate: %s\n", cudaGetErrorName(e));
    return DMEM_ERR_DEVICE;
  }
  for (size_t i = 0; i < n; i++) g->captured[i] = p[i];
  g->n = n;
  return DMEM_OK;
}

/* Launch function: replay (the buffers are locked: resident at their one
 * address). */
static dmem_status_t sg_replay(void *user, dmem_stream_t s, void *const *p, size_t n) {
  sgraph_t *g = (sgraph_t *)user;
  for (size_t i = 0; i < n; i++)
    if (p[i] != g->captured[i]) g->moved++;
  if (g->moved) return DMEM_ERR_DEVICE; /* never launch over moved memory */
  cudaError_t e = cudaGraphLaunch(g->exec, (cudaStream_t)s);
  if (e != cudaSuccess) {
    fprintf(stderr, "cudaGraphLaunch: %s\n", cudaGetErrorName(e));
    return DMEM_ERR_DEVICE;
  }
  g->replays++;
  return DMEM_OK;
}

/* Fill data buffer h with generation 0 of seed, and a generation buffer
 * with 0. */
static dmem_status_t fill_fn(void *user, dmem_stream_t s, void *const *p, size_t n) {
  const sgraph_t *g = (const sgraph_t *)user;
  dmem_status_t st = DMEM_OK;
  for (size_t i = 0; i + 1 < n && st == DMEM_OK; i++)
    st = gpu_fill(p[i], g->bytes, g->seed[i], 0, (cudaStream_t)s);
  if (st == DMEM_OK && cudaMemsetAsync(p[n - 1], 0, 4, (cudaStream_t)s) != cudaSuccess)
    st = gpu_launched("cudaMemsetAsync");
  return st;
}

typedef struct final_check {
  const sgraph_t *g;
  uint32_t gen;
} final_check_t;

static dmem_status_t final_check_fn(void *user, dmem_stream_t s, void *const *p, size_t n) {
  const final_check_t *c = (const final_check_t *)user;
  dmem_status_t st = DMEM_OK;
  for (size_t i = 0; i + 1 < n && st == DMEM_OK; i++)
    st = gpu_check(p[i], c->g->bytes, c->g->seed[i], c->gen, c->g->bad, (cudaStream_t)s);
  return st;
}

static unsigned long long read_bad(unsigned long long *bad) {
  unsigned long long v = ~0ull;
  if (cudaMemcpy(&v, bad, sizeof v, cudaMemcpyDeviceToHost) != cudaSuccess) return ~0ull;
  return v;
}

TEST_CASE(graph_replay_after_spilling_everything) {
  const size_t bytes = (gpu_small() ? 4 : 32) * MiB;
  const int rounds = gpu_small() ? 3 : 6;
  const size_t nd = 4; /* data buffers */
  dmem_runtime_t *rt = gpu_runtime((nd + 2) * bytes, 0);
  sgraph_t g;
  memset(&g, 0, sizeof g);
  g.bytes = bytes;
  CUDA_REQUIRE(cudaMalloc(&g.bad, sizeof *g.bad));
  CUDA_REQUIRE(cudaMemset(g.bad, 0, sizeof *g.bad));
  dmem_handle_t h[SG_MAX];
  for (size_t i = 0; i < nd; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, bytes, DMEM_BUFFER_STABLE_ADDRESS, &h[i]));
    g.seed[i] = 0x51AB1Eu + (uint32_t)i;
  }
  REQUIRE_OK(dmem_buffer_alloc(rt, 4, DMEM_BUFFER_STABLE_ADDRESS, &h[nd])); /* the generation */
  size_t n = nd + 1;
  REQUIRE_OK(dmem_lock_and_launch(rt, h, n, fill_fn, &g));
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  REQUIRE_OK(dmem_launch_async(rt, s, h, n, sg_capture, &g)); /* captured, not run */
  REQUIRE_OK(dmem_sync_and_unlock(rt, s));
  for (int r = 0; r < rounds; r++) {
    dmem_tier_t tier = r % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST;
    for (size_t i = 0; i < n; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], tier));
    dmem_stats_t st;
    CHECK_OK(dmem_stats(rt, &st));
    CHECK_UEQ(st.device_used, 0); /* every byte unmapped */
    CHECK_OK(dmem_launch_async(rt, s, h, n, sg_replay, &g));
    CHECK_OK(dmem_sync_and_unlock(rt, s));
    CHECK_UEQ(read_bad(g.bad), 0);
  }
  CHECK_EQ(g.moved, 0);
  CHECK_EQ(g.replays, rounds);
  /* without the graph: every word at generation `rounds` */
  final_check_t fc = {&g, (uint32_t)rounds};
  CHECK_OK(dmem_lock_and_launch(rt, h, n, final_check_fn, &fc));
  CHECK_UEQ(read_bad(g.bad), 0);
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.spill_count, (uint64_t)rounds * n);
  CHECK_UEQ(st.unspill_count, (uint64_t)rounds * n);
  fprintf(stderr, "graph over %zu stable buffers of %zu MiB: %d replays after spilling all\n", nd,
          bytes >> 20, g.replays);
  cudaGraphExecDestroy(g.exec);
  CHECK_OK(dmem_stream_destroy(rt, s));
  for (size_t i = 0; i < n; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CUDA_REQUIRE(cudaFree(g.bad));
  dmem_runtime_destroy(rt);
}

/* 2x oversubscription: 8 data buffers under a limit that holds 4 (plus the
 * generation buffers); one graph per pair, replayed round robin: each replay
 * unspills its pair at their captured addresses and evicts others. */
TEST_CASE(graphs_round_robin_oversubscribed) {
  const size_t bytes = (gpu_small() ? 4 : 16) * MiB;
  const int rounds = gpu_small() ? 2 : 5;
  enum { NP = 4 }; /* pairs */
  dmem_runtime_t *rt = gpu_runtime(4 * bytes + NP * 2 * MiB, 0);
  unsigned long long *bad = NULL;
  CUDA_REQUIRE(cudaMalloc(&bad, sizeof *bad));
  CUDA_REQUIRE(cudaMemset(bad, 0, sizeof *bad));
  sgraph_t g[NP];
  dmem_handle_t h[NP][3];
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  for (int k = 0; k < NP; k++) {
    memset(&g[k], 0, sizeof g[k]);
    g[k].bytes = bytes;
    g[k].bad = bad;
    for (int i = 0; i < 2; i++) {
      REQUIRE_OK(dmem_buffer_alloc(rt, bytes, DMEM_BUFFER_STABLE_ADDRESS, &h[k][i]));
      g[k].seed[i] = 0xC0FFEEu + (uint32_t)(2 * k + i);
    }
    REQUIRE_OK(dmem_buffer_alloc(rt, 4, DMEM_BUFFER_STABLE_ADDRESS, &h[k][2]));
    REQUIRE_OK(dmem_lock_and_launch(rt, h[k], 3, fill_fn, &g[k]));
    REQUIRE_OK(dmem_launch_async(rt, s, h[k], 3, sg_capture, &g[k]));
    REQUIRE_OK(dmem_sync_and_unlock(rt, s));
  }
  for (int r = 0; r < rounds; r++)
    for (int k = 0; k < NP; k++) {
      CHECK_OK(dmem_launch_async(rt, s, h[k], 3, sg_replay, &g[k]));
      CHECK_OK(dmem_stream_release(rt, s)); /* unlocked once the replay is done */
    }
  CHECK_OK(dmem_sync_and_unlock(rt, s));
  CHECK_UEQ(read_bad(bad), 0);
  for (int k = 0; k < NP; k++) {
    CHECK_EQ(g[k].moved, 0);
    CHECK_EQ(g[k].replays, rounds);
    final_check_t fc = {&g[k], (uint32_t)rounds};
    CHECK_OK(dmem_lock_and_launch(rt, h[k], 3, final_check_fn, &fc));
  }
  CHECK_UEQ(read_bad(bad), 0);
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_GT(st.spill_count, 0);
  fprintf(stderr, "%d graphs over %d stable buffers at 2x the limit: %llu spills\n", NP, 2 * NP,
          (unsigned long long)st.spill_count);
  for (int k = 0; k < NP; k++) {
    cudaGraphExecDestroy(g[k].exec);
    for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_free(rt, h[k][i]));
  }
  CHECK_OK(dmem_stream_destroy(rt, s));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}
