/*
 * bench/bench_scale.c - how dmem's costs grow with the number of live
 * buffers (issue 25, item 1). At 10^3, 10^4, 10^5 and 10^6 live buffers of
 * 256 bytes each it measures:
 *
 *   alloc+free         one dmem_buffer_alloc + dmem_buffer_free pair (256 B), ns
 *   lock+unlock        dmem_buffer_lock + dmem_buffer_unlock of resident buffers, ns: 64
 *                      buffers spread evenly over the live ones, in turn (the
 *                      same 64 cache lines at every count: the row measures
 *                      dmem's work, not the memory hierarchy's)
 *   eviction           one dmem_buffer_alloc that must spill one victim to make room
 *                      (a runtime whose limit the live buffers fill), us;
 *                      the victim is freed afterwards so the count stays
 *   dmem_stats         one call, us
 *   release 10^3/10^4  dmem_stream_release of a stream with 10^3 / 10^4
 *                      registered locks (one dmem_launch_async, untimed) and
 *                      the dmem_stream_synchronize that finds it finished and
 *                      unlocks them, us; the registered buffers are the same
 *                      10^3 at every count
 *   metadata           process RSS growth per live buffer from 1 to n live
 *                      buffers (a child process each), less the device
 *                      pool's slab growth (device memory is host memory on
 *                      the host backend), bytes; and the size of the
 *                      per-buffer structs
 *
 * Each row prints its cost at every count and its ratio to the cost at
 * 10^3. Target (issue 25): each cost at the largest count within 1.5x of its
 * cost at 10^3, at most 128 bytes of metadata per buffer. The figures are
 * also printed as RESULT lines, which scripts/gpu_targets.py judges:
 *   RESULT bench_scale.<row>.growth=   cost at the largest count / at 10^3
 *   RESULT bench_scale.largest=        the largest count measured
 *   RESULT bench_scale.meta_bytes=     metadata bytes per buffer there
 *
 *   bench_scale [--quick] [--check]
 *
 * --quick: up to 10^5 buffers, fewer repetitions (the CTest run,
 * bench.scale). --check: exit 1 when the metadata per buffer at the
 * largest count measured passes 128 bytes (the CTest run passes it).
 * Spill-ahead is off (unless DMEM_SPILL_AHEAD says): the eviction row
 * measures an eviction on demand. With the CUDA backend's default (on
 * demand) the thread armed at 10^5 and 10^6 buffers on an H100 and made
 * room ahead (0.7-0.8 us against 11 us); in one run the other rows' costs
 * at 10^6 read 1.56-1.73x, likely from its spilling in the background (5 %
 * of the limit: 50,000 buffers) while they were measured.
 * Backend: DMEM_BACKEND if set, else the host backend. Each figure is the
 * median of several repetitions. Exit 77 when DMEM_BACKEND asks for a device
 * that is not there, 1 on any dmem error; never fails on speed.
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dmem/dmem.h>

#define BENCH_NAME "bench_scale"
#include "bench_common.h"

#include "api/api.h"          /* sizeof(dmem__buffer_t), dmem__reg_entry_t */
#include "memory/memory.h"     /* dmem__pool_seg_bytes */

#define BUF 256u
#define SPREAD 64
#define NCOUNTS 4
#define MAX_REPS 9
#define REL_REPS 15
#define REL_BASE 1000 /* the registered buffers: the first 10^3 */

static const size_t g_counts[NCOUNTS] = {1000, 10000, 100000, 1000000};
static int g_ncounts = NCOUNTS;
static int g_reps = 7;
static bool g_quick;
static bool g_check;
#define META_TARGET 128.0 /* bytes of metadata per live buffer (issue 25) */

/* Resident set size of the process, bytes. */
static size_t rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return 0;
  unsigned long size = 0, resident = 0;
  int got = fscanf(f, "%lu %lu", &size, &resident);
  fclose(f);
  return got == 2 ? (size_t)resident * (size_t)sysconf(_SC_PAGESIZE) : 0;
}

static dmem_runtime_t *make_runtime(size_t limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  if (!getenv("DMEM_SPILL_AHEAD")) cfg.spill_ahead = 0; /* eviction on demand */
  cfg.device_limit = limit;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) {
    fprintf(stderr, "SKIP: no device for DMEM_BACKEND=%s\n", getenv("DMEM_BACKEND"));
    exit(77);
  }
  if (st != DMEM_OK) die("dmem_runtime_create", st);
  return rt;
}

/* ---- the rows ------------------------------------------------------------------ */

enum { R_ALLOC, R_LOCK, R_EVICT, R_STATS, R_REL3, R_REL4, NROWS };
static const char *const g_row_name[NROWS] = {"alloc_free", "lock_unlock", "evict_one",
                                              "stats", "release_1e3", "release_1e4"};
static const char *const g_row_what[NROWS] = {
    "dmem_alloc + dmem_free (256 B), ns", "dmem_lock + dmem_unlock, ns",
    "alloc that spills one victim, us", "dmem_stats, us",
    "stream_release of 10^3 locks + sync, us", "stream_release of 10^4 locks + sync, us"};
static double g_cost[NROWS][NCOUNTS];
static double g_meta[NCOUNTS];

static double m_alloc_free(dmem_runtime_t *rt, long iters) {
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_handle_t h;
    TRY(dmem_buffer_alloc(rt, BUF, 0, &h));
    TRY(dmem_buffer_free(rt, h));
  }
  return (double)(now_ns() - t0) / (double)iters;
}

static double m_lock_unlock(dmem_runtime_t *rt, const dmem_handle_t *spread, long iters) {
  void *p;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    dmem_handle_t h = spread[i & (SPREAD - 1)];
    dmem_status_t a = dmem_buffer_lock(rt, h, NULL, &p);
    dmem_status_t b = dmem_buffer_unlock(rt, h);
    if (a != DMEM_OK || b != DMEM_OK) die("dmem_lock/dmem_unlock", a != DMEM_OK ? a : b);
  }
  return (double)(now_ns() - t0) / (double)iters;
}

static double m_stats(dmem_runtime_t *rt, long iters) {
  dmem_stats_t s;
  uint64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) TRY(dmem_stats(rt, &s));
  return (double)(now_ns() - t0) / (double)iters * 1e-3;
}

static dmem_status_t noop_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)user;
  (void)s;
  (void)ptrs;
  (void)n;
  return DMEM_OK;
}

/* R locks on the first REL_BASE buffers (cycled) registered on s by one
 * launch (untimed); then the release and the synchronisation that unlocks. */
static double m_release(dmem_runtime_t *rt, dmem_stream_t s, const dmem_handle_t *hs,
                        dmem_handle_t *scratch, size_t base, size_t r) {
  for (size_t i = 0; i < r; i++) scratch[i] = hs[i % base];
  TRY(dmem_launch_async(rt, s, scratch, r, noop_launch, NULL));
  uint64_t t0 = now_ns();
  TRY(dmem_stream_release(rt, s));
  TRY(dmem_stream_synchronize(rt, s));
  double us = (double)(now_ns() - t0) * 1e-3;
  dmem_buffer_info_t info;
  TRY(dmem_buffer_info(rt, hs[0], &info));
  if (info.lock_count != 0) {
    fprintf(stderr, "bench_scale: released buffer still locked (%u) after the sync\n",
            info.lock_count);
    exit(1);
  }
  return us;
}

/* Metadata bytes per live buffer at n live buffers, measured in a child
 * process of its own (forked before this process made any runtime), so
 * that memory freed by earlier measurements and kept by malloc cannot hide
 * growth: RSS growth from 1 live buffer to n, less the growth of the
 * pool's slabs on the host backend (device memory is host memory there,
 * every page of it written), divided by n - 1. The runtime's own fixed
 * cost (its creation) is not per buffer and not counted; the handle
 * array is the bench's, made and touched before the first reading. */
static double measure_meta(size_t n) {
  int fd[2];
  if (pipe(fd) != 0) die("pipe", DMEM_ERR_HOST_OUT_OF_MEMORY);
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) die("fork", DMEM_ERR_HOST_OUT_OF_MEMORY);
  if (pid == 0) {
    close(fd[0]);
    dmem_handle_t *hs = malloc(n * sizeof *hs);
    if (!hs) _exit(1);
    memset(hs, 0, n * sizeof *hs);
    dmem_runtime_t *rt = make_runtime(n * BUF * 2 + ((size_t)64 << 20));
    bool host = dmem_runtime_backend(rt) == DMEM_BACKEND_HOST;
    dmem_stats_t s0, s1;
    TRY(dmem_buffer_alloc(rt, BUF, 0, &hs[0]));
    TRY(dmem_stats(rt, &s0));
    size_t rss0 = rss_bytes();
    for (size_t i = 1; i < n; i++) TRY(dmem_buffer_alloc(rt, BUF, 0, &hs[i]));
    TRY(dmem_stats(rt, &s1));
    size_t rss1 = rss_bytes();
    size_t dev = host ? s1.device_reserved - s0.device_reserved : 0;
    double meta = rss1 > rss0 + dev ? (double)(rss1 - rss0 - dev) / (double)(n - 1) : 0.0;
    ssize_t w = write(fd[1], &meta, sizeof meta);
    _exit(w == (ssize_t)sizeof meta ? 0 : 1);
  }
  close(fd[1]);
  double meta = -1.0;
  ssize_t r = read(fd[0], &meta, sizeof meta);
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) exit(77); /* no device: skip */
  if (r != (ssize_t)sizeof meta || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "bench_scale: the metadata measurement at %zu buffers failed\n", n);
    exit(1);
  }
  return meta;
}

static void measure_roomy(int ci) {
  size_t n = g_counts[ci];
  /* room for the live buffers, the alloc+free pairs and nothing to spill */
  dmem_runtime_t *rt = make_runtime(n * BUF * 2 + ((size_t)64 << 20));
  dmem_handle_t *hs = malloc(n * sizeof *hs);
  dmem_handle_t *scratch = malloc(10000 * sizeof *scratch);
  if (!hs || !scratch) die("malloc", DMEM_ERR_HOST_OUT_OF_MEMORY);
  for (size_t i = 0; i < n; i++) TRY(dmem_buffer_alloc(rt, BUF, 0, &hs[i]));

  dmem_handle_t spread[SPREAD];
  for (int i = 0; i < SPREAD; i++) spread[i] = hs[(size_t)i * (n / SPREAD)];
  dmem_stream_t st;
  TRY(dmem_stream_create(rt, &st));

  long pair_iters = g_quick ? 100000 : 500000;
  long stats_iters = g_quick ? 200 : 1000;
  double a[MAX_REPS], b[MAX_REPS], c[MAX_REPS], d[REL_REPS], e[REL_REPS];
  (void)m_alloc_free(rt, pair_iters / 10);
  (void)m_lock_unlock(rt, spread, pair_iters / 10);
  for (int r = 0; r < g_reps; r++) {
    a[r] = m_alloc_free(rt, pair_iters);
    b[r] = m_lock_unlock(rt, spread, pair_iters);
    c[r] = m_stats(rt, stats_iters);
  }
  /* a release costs tens of microseconds, mostly waking the stream's
   * thread on the host backend: more repetitions, after a warm-up */
  size_t base = n < REL_BASE ? n : REL_BASE;
  for (int r = -2; r < REL_REPS; r++) {
    double x = m_release(rt, st, hs, scratch, base, 1000);
    double y = m_release(rt, st, hs, scratch, base, 10000);
    if (r >= 0) d[r] = x, e[r] = y;
  }
  g_cost[R_ALLOC][ci] = median(a, g_reps);
  g_cost[R_LOCK][ci] = median(b, g_reps);
  g_cost[R_STATS][ci] = median(c, g_reps);
  g_cost[R_REL3][ci] = median(d, REL_REPS);
  g_cost[R_REL4][ci] = median(e, REL_REPS);

  TRY(dmem_stream_destroy(rt, st));
  for (size_t i = 0; i < n; i++) TRY(dmem_buffer_free(rt, hs[i]));
  dmem_runtime_destroy(rt);
  free(scratch);
  free(hs);
}

/* A runtime whose limit the n live buffers fill: each allocation spills one
 * victim (the least recently used: the oldest of the n), which is then freed
 * so that the live count stays n. At most 200 evictions, or about a second
 * of them. */
static void measure_evict(int ci) {
  size_t n = g_counts[ci];
  dmem_runtime_t *rt = make_runtime(n * BUF);
  dmem_handle_t *hs = malloc(n * sizeof *hs);
  if (!hs) die("malloc", DMEM_ERR_HOST_OUT_OF_MEMORY);
  for (size_t i = 0; i < n; i++) TRY(dmem_buffer_alloc(rt, BUF, 0, &hs[i]));
  dmem_stats_t s0, s1;
  TRY(dmem_stats(rt, &s0));
  int max_iters = g_quick ? 50 : 200;
  double v[200];
  int k = 0;
  uint64_t spent = 0;
  size_t next_victim = 0;
  while (k < max_iters && (k < 5 || spent < 1000000000u)) {
    dmem_handle_t h;
    uint64_t t0 = now_ns();
    TRY(dmem_buffer_alloc(rt, BUF, 0, &h));
    uint64_t dt = now_ns() - t0;
    spent += dt;
    v[k++] = (double)dt * 1e-3;
    /* the new buffer takes the place of the one spilled: free the victim
     * (the oldest still live), so that the count stays n */
    dmem_buffer_info_t info;
    TRY(dmem_buffer_info(rt, hs[next_victim], &info));
    if (info.state == DMEM_STATE_RESIDENT) {
      fprintf(stderr, "bench_scale: eviction at %zu buffers spilled another victim than the "
              "least recently used\n", n);
    }
    TRY(dmem_buffer_free(rt, hs[next_victim]));
    hs[next_victim++] = h;
  }
  TRY(dmem_stats(rt, &s1));
  size_t spills = s1.spill_count - s0.spill_count;
  if (spills != (size_t)k)
    printf("note: %zu buffers: %d allocations spilled %zu victims\n", n, k, spills);
  g_cost[R_EVICT][ci] = median(v, k);
  for (size_t i = 0; i < n; i++) TRY(dmem_buffer_free(rt, hs[i]));
  dmem_runtime_destroy(rt);
  free(hs);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) {
      g_quick = true;
    } else if (strcmp(argv[i], "--check") == 0) {
      g_check = true;
    } else {
      fprintf(stderr, "usage: %s [--quick] [--check]\n", argv[0]);
      return 2;
    }
  }
  if (g_quick) {
    g_ncounts = 3;
    g_reps = 5;
  }
#ifdef __OPTIMIZE__
  const char *opt = "optimised";
#else
  const char *opt = "NOT optimised (-O0): set CMAKE_BUILD_TYPE=Release for real figures";
#endif
  const char *be = getenv("DMEM_BACKEND");
  printf("bench_scale: backend %s, %s, %d repetitions (median), %s\n", be ? be : "host",
         g_quick ? "quick (up to 10^5 buffers)" : "full", g_reps, opt);
  printf("per-buffer structs: handle-table slot (dmem__buffer_t) %zu B, pool segment "
         "descriptor %zu B, registry entry %zu B\n",
         sizeof(dmem__buffer_t), dmem__pool_seg_bytes(), sizeof(dmem__reg_entry_t));
  fflush(stdout);
  for (int ci = 0; ci < g_ncounts; ci++) g_meta[ci] = measure_meta(g_counts[ci]);
  for (int ci = 0; ci < g_ncounts; ci++) {
    measure_roomy(ci);
    measure_evict(ci);
    printf("measured %zu live buffers\n", g_counts[ci]);
    fflush(stdout);
  }

  printf("\n%-42s", "what \\ live buffers");
  for (int ci = 0; ci < g_ncounts; ci++) printf(" | %16zu", g_counts[ci]);
  printf("\n");
  int last = g_ncounts - 1;
  for (int r = 0; r < NROWS; r++) {
    printf("%-42s", g_row_what[r]);
    for (int ci = 0; ci < g_ncounts; ci++) {
      double x = g_cost[r][ci], ratio = g_cost[r][0] > 0 ? x / g_cost[r][0] : 0.0;
      printf(" | %9.2f %5.2fx", x, ratio);
    }
    printf("\n");
  }
  printf("%-42s", "metadata, bytes per live buffer");
  for (int ci = 0; ci < g_ncounts; ci++) printf(" | %16.1f", g_meta[ci]);
  printf("\n(ratios are to the cost at 10^3 live buffers; target: <= 1.50x at 10^6, "
         "<= 128 bytes of metadata per buffer)\n");
  for (int r = 0; r < NROWS; r++)
    printf("RESULT bench_scale.%s.growth=%.3f\n", g_row_name[r],
           g_cost[r][0] > 0 ? g_cost[r][last] / g_cost[r][0] : 0.0);
  printf("RESULT bench_scale.largest=%zu\n", g_counts[last]);
  printf("RESULT bench_scale.meta_bytes=%.1f\n", g_meta[last]);
  if (g_check && g_meta[last] > META_TARGET) {
    fprintf(stderr, "bench_scale: FAIL: %.1f bytes of metadata per buffer at %zu buffers (at "
            "most %.0f)\n", g_meta[last], g_counts[last], META_TARGET);
    return 1;
  }
  return 0;
}
