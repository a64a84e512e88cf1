/*
 * tests/test_pool.c - the device pool suballocator (runtime/memory/pool*.c)
 * on the host backend: limits, coalescing, best fit, trimming, stream-ordered
 * reuse (streams are worker threads there, so a blocked host function shows
 * whether a stream was really made to wait), caches, many threads, timing.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#include "backend/backend.h"
#include "base/error.h"
#include "memory/pool.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static dmem__backend_t *make_backend(size_t capacity) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = capacity;
  dmem__backend_t *be = NULL;
  dmem_status_t st = dmem__backend_host_create(&cfg, &be);
  if (st != DMEM_OK) {
    fprintf(stderr, "host backend: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
    exit(1);
  }
  return be;
}

static size_t backend_used(dmem__backend_t *be) {
  size_t free_b = 0, total = 0;
  be->mem_info(be, &free_b, &total);
  return total - free_b;
}

static dmem__pool_stats_t stats_of(dmem__pool_t *p) {
  dmem__pool_stats_t s;
  dmem__pool_stats(p, &s);
  return s;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Word-wise pattern keyed by seed (cheap enough for MiB blocks under TSan). */
static void fill_words(void *p, size_t n, uint64_t seed) {
  uint64_t *w = p;
  for (size_t i = 0; i < n / 8; i++) w[i] = seed ^ (i * 0x9E3779B97F4A7C15ull);
  for (size_t i = n / 8 * 8; i < n; i++) ((unsigned char *)p)[i] = (unsigned char)(seed + i);
}

static size_t bad_words(const void *p, size_t n, uint64_t seed) {
  const uint64_t *w = p;
  size_t bad = 0;
  for (size_t i = 0; i < n / 8; i++) bad += w[i] != (seed ^ (i * 0x9E3779B97F4A7C15ull));
  for (size_t i = n / 8 * 8; i < n; i++)
    bad += ((const unsigned char *)p)[i] != (unsigned char)(seed + i);
  return bad;
}

/* ---- limits --------------------------------------------------------------------- */

TEST_CASE(exhaustion) {
  const size_t limit = 4 * MiB, bsize = 100 * KiB; /* class 112 KiB */
  dmem__backend_t *be = make_backend(8 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, limit, 1 * MiB, &p));
  CHECK_UEQ(dmem__pool_block_size(bsize), 112 * KiB);

  void *blocks[64];
  size_t n = 0;
  size_t largest = SIZE_MAX;
  dmem_status_t st = DMEM_OK;
  while (n < 64) {
    void *ptr = NULL;
    st = dmem__pool_alloc_ex(p, bsize, NULL, &ptr, &largest);
    if (st != DMEM_OK) break;
    blocks[n++] = ptr;
    dmem__pool_stats_t s = stats_of(p);
    CHECK_LE(s.reserved, limit);
    CHECK_LE(backend_used(be), limit);
  }
  CHECK_STATUS(st, DMEM_ERR_OUT_OF_MEMORY);
  CHECK_LT(largest, 112 * KiB);
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.reserved, limit); /* the last slab took exactly what the limit left */
  CHECK_UEQ(s.in_use, n * 112 * KiB);
  CHECK_GE(s.in_use + 4 * 112 * KiB, limit); /* at most a block's waste per slab */
  CHECK_UEQ(s.misses, s.slabs);
  /* Nothing larger than the limit, ever. */
  void *big = NULL;
  CHECK_STATUS(dmem__pool_alloc(p, limit + 1, NULL, &big), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_TRUE(big == NULL);

  for (size_t i = 0; i < n; i++) dmem__pool_free(p, blocks[i], bsize, NULL);
  CHECK_UEQ(stats_of(p).in_use, 0);
  /* Everything again, now on another stream (the frees' events order it). */
  void *stream = NULL;
  REQUIRE_OK(be->stream_create(be, &stream));
  size_t m = 0;
  for (; m < n; m++) {
    st = dmem__pool_alloc(p, bsize, stream, &blocks[m]);
    if (st != DMEM_OK) break;
  }
  CHECK_OK(st);
  CHECK_UEQ(m, n);
  CHECK_UEQ(stats_of(p).reserved, limit);
  CHECK_LE(backend_used(be), limit);
  for (size_t i = 0; i < m; i++) dmem__pool_free(p, blocks[i], bsize, stream);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, stream);
  be->destroy(be);
}

/* The backend runs out before the limit: the geometric slab is refused, the
 * pool falls back to a slab of the request's own size, then reports
 * OUT_OF_MEMORY with the backend's detail. */
TEST_CASE(backend_oom) {
  dmem__backend_t *be = make_backend(3 * MiB + 512 * KiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 16 * MiB, 1 * MiB, &p));
  void *b[8];
  int n = 0;
  dmem_status_t st = DMEM_OK;
  while (n < 8 && (st = dmem__pool_alloc(p, 512 * KiB, NULL, &b[n])) == DMEM_OK) n++;
  CHECK_STATUS(st, DMEM_ERR_OUT_OF_MEMORY);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "device_alloc") != NULL);
  CHECK_EQ(n, 7); /* slabs of 1 and 2 MiB, then one of 512 KiB */
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.slabs, 3);
  CHECK_UEQ(s.reserved, 3 * MiB + 512 * KiB);
  for (int i = 0; i < n; i++) dmem__pool_free(p, b[i], 512 * KiB, NULL);
  for (int i = 0; i < n; i++) REQUIRE_OK(dmem__pool_alloc(p, 512 * KiB, NULL, &b[i]));
  CHECK_UEQ(stats_of(p).slabs, 3);
  for (int i = 0; i < n; i++) dmem__pool_free(p, b[i], 512 * KiB, NULL);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- coalescing and best fit ------------------------------------------------------ */

TEST_CASE(fragmentation_coalescing) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1 * MiB, 1 * MiB, &p));
  void *b[16];
  for (int i = 0; i < 16; i++) REQUIRE_OK(dmem__pool_alloc(p, 64 * KiB, NULL, &b[i]));
  dmem__pool_stats_t s0 = stats_of(p);
  CHECK_UEQ(s0.reserved, 1 * MiB);
  CHECK_UEQ(s0.slabs, 1);
  for (int i = 1; i < 16; i += 2) dmem__pool_free(p, b[i], 64 * KiB, NULL);

  void *x = NULL;
  size_t largest = 0;
  CHECK_STATUS(dmem__pool_alloc_ex(p, 128 * KiB, NULL, &x, &largest), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_UEQ(largest, 64 * KiB);
  CHECK_UEQ(dmem__pool_largest_free(p), 64 * KiB);
  CHECK_TRUE(!dmem__pool_fits(p, 128 * KiB, NULL));
  CHECK_TRUE(dmem__pool_fits(p, 64 * KiB, NULL));

  for (int i = 0; i < 16; i += 2) dmem__pool_free(p, b[i], 64 * KiB, NULL);
  REQUIRE_OK(dmem__pool_alloc(p, 128 * KiB, NULL, &x));
  dmem__pool_free(p, x, 128 * KiB, NULL);
  /* The whole slab is one range again. */
  REQUIRE_OK(dmem__pool_alloc(p, 1 * MiB, NULL, &x));
  dmem__pool_stats_t s1 = stats_of(p);
  CHECK_UEQ(s1.reserved, 1 * MiB);
  CHECK_UEQ(s1.slabs, 1);
  CHECK_UEQ(s1.misses, s0.misses);
  dmem__pool_free(p, x, 1 * MiB, NULL);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- stream-order probes ------------------------------------------------------- */

/* A gate: a host function on a stream that blocks it until the test opens it. */
typedef struct gate {
  atomic_int open;
} gate_t;

static void gate_wait_fn(void *user) {
  gate_t *g = user;
  while (!atomic_load(&g->open)) usleep(500);
}

/* What ran on the streams, in which order. */
typedef struct probe {
  unsigned char *block;
  size_t n;
  atomic_int a_done;  /* A's writer finished */
  atomic_int b_ran;   /* B's probe ran */
  atomic_int b_saw_a; /* a_done as B's probe saw it */
} probe_t;

static void writer_a_fn(void *user) {
  probe_t *pr = user;
  memset(pr->block, 0xAA, pr->n);
  atomic_store(&pr->a_done, 1);
}

static void probe_b_fn(void *user) {
  probe_t *pr = user;
  atomic_store(&pr->b_saw_a, atomic_load(&pr->a_done));
  if (pr->block) memset(pr->block, 0xBB, pr->n);
  atomic_store(&pr->b_ran, 1);
}

static size_t count_not(const unsigned char *p, size_t n, unsigned char v) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += p[i] != v;
  return bad;
}

/* Neighbours freed on two streams whose events are still pending do not
 * merge; a request only their union covers takes both, after making its
 * stream wait on both events. */
TEST_CASE(coalescing_across_streams) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1 * MiB, 1 * MiB, &p));
  void *sa = NULL, *sb = NULL, *sc = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  REQUIRE_OK(be->stream_create(be, &sc));
  void *lo = NULL, *hi = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 512 * KiB, NULL, &lo));
  REQUIRE_OK(dmem__pool_alloc(p, 512 * KiB, NULL, &hi));
  gate_t ga = {0}, gb = {0};
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &ga));
  REQUIRE_OK(be->launch_host_func(be, sb, gate_wait_fn, &gb));
  dmem__pool_free(p, lo, 512 * KiB, sa);
  dmem__pool_free(p, hi, 512 * KiB, sb);
  dmem__pool_flush(p);
  CHECK_UEQ(dmem__pool_largest_free(p), 1 * MiB); /* one run of two ranges */
  CHECK_UEQ(dmem__pool_range_if_freed(p, lo, 512 * KiB), 0); /* not live any more */

  void *x = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 1 * MiB, sc, &x));
  CHECK_TRUE(x == (lo < hi ? lo : hi));
  CHECK_UEQ(stats_of(p).slabs, 1);
  probe_t pr = {0};
  REQUIRE_OK(be->launch_host_func(be, sc, probe_b_fn, &pr));
  usleep(30 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0); /* sc waits for sa */
  atomic_store(&ga.open, 1);
  be->stream_synchronize(be, sa);
  usleep(30 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0); /* ... and for sb */
  atomic_store(&gb.open, 1);
  be->stream_synchronize(be, sc);
  CHECK_EQ(atomic_load(&pr.b_ran), 1);
  dmem__pool_free(p, x, 1 * MiB, sc);
  dmem__pool_destroy(p);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  be->stream_destroy(be, sc);
  be->destroy(be);
}

/* Offsets of blocks in their slab (all in one slab). */
static size_t offset_in_slab(dmem__pool_t *p, void *ptr, void **base_out) {
  void *base = NULL;
  size_t off = SIZE_MAX;
  if (dmem__pool_slab_of(p, ptr, &base, &off) != DMEM_OK) return SIZE_MAX;
  if (base_out) *base_out = base;
  return off;
}

/* Holes of 128 KiB, 64 KiB and 256 KiB: each request lands in the smallest
 * hole that fits it. */
TEST_CASE(best_fit) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1 * MiB, 1 * MiB, &p));
  const size_t sizes[6] = {128 * KiB, 64 * KiB, 64 * KiB, 64 * KiB, 256 * KiB, 448 * KiB};
  const size_t offs[6] = {0, 128 * KiB, 192 * KiB, 256 * KiB, 320 * KiB, 576 * KiB};
  void *b[6];
  for (int i = 0; i < 6; i++) {
    REQUIRE_OK(dmem__pool_alloc(p, sizes[i], NULL, &b[i]));
    CHECK_UEQ(offset_in_slab(p, b[i], NULL), offs[i]); /* a fresh slab fills from its base */
  }
  dmem__pool_free(p, b[0], sizes[0], NULL);
  dmem__pool_free(p, b[2], sizes[2], NULL);
  dmem__pool_free(p, b[4], sizes[4], NULL);
  dmem__pool_flush(p);
  void *x = NULL, *y = NULL, *z = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 64 * KiB, NULL, &x));
  CHECK_UEQ(offset_in_slab(p, x, NULL), 192 * KiB);
  REQUIRE_OK(dmem__pool_alloc(p, 96 * KiB, NULL, &y));
  CHECK_UEQ(offset_in_slab(p, y, NULL), 0);
  REQUIRE_OK(dmem__pool_alloc(p, 200 * KiB, NULL, &z));
  CHECK_UEQ(offset_in_slab(p, z, NULL), 320 * KiB);
  CHECK_UEQ(stats_of(p).slabs, 1);
  dmem__pool_free(p, x, 64 * KiB, NULL);
  dmem__pool_free(p, y, 96 * KiB, NULL);
  dmem__pool_free(p, z, 200 * KiB, NULL);
  for (int i = 1; i < 6; i += 2) dmem__pool_free(p, b[i], sizes[i], NULL);
  CHECK_UEQ(stats_of(p).in_use, 0);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- trimming ------------------------------------------------------------------ */

TEST_CASE(trimming) {
  dmem__backend_t *be = make_backend(16 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 16 * MiB, 1 * MiB, &p));
  /* 768 KiB blocks: slabs of 1, 2 and 4 MiB hold 1, 2 and 5 of them. */
  void *b[8];
  for (int i = 0; i < 8; i++) REQUIRE_OK(dmem__pool_alloc(p, 768 * KiB, NULL, &b[i]));
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.slabs, 3);
  CHECK_UEQ(s.reserved, 7 * MiB);
  CHECK_UEQ(backend_used(be), 7 * MiB);

  /* A live block keeps its slab. Straight after the frees (their events
   * may be pending: trim waits for those of empty slabs). */
  for (int i = 0; i < 7; i++) dmem__pool_free(p, b[i], 768 * KiB, NULL);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 3 * MiB);                /* the 1 and 2 MiB slabs */
  CHECK_UEQ(stats_of(p).reserved, 4 * MiB); /* the 4 MiB one holds b[7] */
  CHECK_UEQ(backend_used(be), 4 * MiB);
  dmem__pool_free(p, b[7], 768 * KiB, NULL);

  /* Three slabs again; keep > 0 keeps slabs (largest given back first). */
  for (int i = 0; i < 8; i++) REQUIRE_OK(dmem__pool_alloc(p, 768 * KiB, NULL, &b[i]));
  for (int i = 0; i < 8; i++) dmem__pool_free(p, b[i], 768 * KiB, NULL);
  s = stats_of(p);
  size_t before = s.reserved;
  CHECK_GT(before, 4 * MiB);
  REQUIRE_OK(dmem__pool_trim(p, before - 1, &rel));
  CHECK_GT(rel, 0);
  CHECK_LE(stats_of(p).reserved, before - 1);
  CHECK_GT(stats_of(p).reserved, 0);
  CHECK_UEQ(stats_of(p).reserved + rel, before);
  REQUIRE_OK(dmem__pool_trim(p, stats_of(p).reserved, &rel));
  CHECK_UEQ(rel, 0); /* already at keep */

  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(stats_of(p).reserved, 0);
  CHECK_UEQ(stats_of(p).slabs, 0);
  CHECK_UEQ(backend_used(be), 0);
  CHECK_UEQ(stats_of(p).cached, 0);

  /* Still usable, growing from min_slab again. A cached block is flushed
   * (an event recorded now) and its slab given back once that completes. */
  void *x = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, NULL, &x));
  CHECK_UEQ(stats_of(p).reserved, 1 * MiB);
  dmem__pool_free(p, x, 4 * KiB, NULL);
  CHECK_UEQ(stats_of(p).cached, 4 * KiB);
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 1 * MiB);
  CHECK_UEQ(stats_of(p).cached, 0);
  CHECK_UEQ(backend_used(be), 0);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->destroy(be);
}

/* ---- class runs: small blocks without descriptors ---------------------------------------- */

/* Blocks of 256 B each up to 4 KiB come from 64 KiB class runs: distinct,
 * 256-aligned, inside the pool's slab, and their bytes do not overlap. Freed
 * and flushed, every run empties and goes back to the free ranges; the
 * same blocks come again without a new slab. */
TEST_CASE(runs_reuse_after_free) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 2 * MiB, 1 * MiB, &p));
  enum { N = 600 };
  static void *b[N];
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem__pool_alloc(p, 200, NULL, &b[i]));
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.slabs, 1);
  CHECK_UEQ(s.in_use, (size_t)N * 256);
  CHECK_GE(s.runs, 2); /* 256 blocks a run; the slab's first block is a plain one */
  CHECK_LE(s.runs, 4);
  for (int i = 0; i < N; i++) {
    CHECK_UEQ((uintptr_t)b[i] % 256, 0);
    void *base = NULL;
    size_t off = 0;
    REQUIRE_OK(dmem__pool_slab_of(p, b[i], &base, &off));
    CHECK_LE(off + 256, 1 * MiB);
    fill_words(b[i], 256, (uint64_t)i);
  }
  for (int i = 0; i < N; i++) CHECK_UEQ(bad_words(b[i], 256, (uint64_t)i), 0);
  for (int i = 0; i < N; i++) dmem__pool_free(p, b[i], 200, NULL);
  dmem__pool_flush(p);
  s = stats_of(p);
  CHECK_UEQ(s.in_use, 0);
  CHECK_UEQ(s.runs, 0);
  uint64_t misses = s.misses;
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem__pool_alloc(p, 256, NULL, &b[i]));
  s = stats_of(p);
  CHECK_UEQ(s.misses, misses); /* reused: no new slab */
  CHECK_UEQ(s.slabs, 1);
  CHECK_GE(s.runs, 2);
  for (int i = 0; i < N; i++) dmem__pool_free(p, b[i], 256, NULL);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 1 * MiB);
  CHECK_UEQ(backend_used(be), 0);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* Every run class at once (256 B .. 4 KiB), interleaved: no two blocks
 * overlap, each class fills runs of its own, and freeing everything in a
 * scrambled order empties every run. */
TEST_CASE(runs_many_classes) {
  static const size_t sizes[] = {256,  512,  768,  1024, 1280, 1536,
                                 1792, 2048, 2560, 3072, 3584, 4096};
  enum { NC = sizeof sizes / sizeof sizes[0], PER = 40 };
  dmem__backend_t *be = make_backend(16 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 8 * MiB, 4 * MiB, &p));
  static void *b[NC * PER];
  size_t total = 0;
  for (int k = 0; k < PER; k++)
    for (int c = 0; c < NC; c++) {
      REQUIRE_OK(dmem__pool_alloc(p, sizes[c], NULL, &b[k * NC + c]));
      fill_words(b[k * NC + c], sizes[c], (uint64_t)(k * NC + c));
      total += sizes[c];
    }
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.in_use, total);
  CHECK_GE(s.runs, NC);
  for (int k = 0; k < PER; k++)
    for (int c = 0; c < NC; c++)
      CHECK_UEQ(bad_words(b[k * NC + c], sizes[c], (uint64_t)(k * NC + c)), 0);
  for (int j = 0; j < NC * PER; j++) {
    int i = (j * 7919) % (NC * PER); /* 7919 is prime to NC * PER: a permutation */
    dmem__pool_free(p, b[i], sizes[i % NC], NULL);
  }
  dmem__pool_flush(p);
  s = stats_of(p);
  CHECK_UEQ(s.in_use, 0);
  CHECK_UEQ(s.runs, 0);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(backend_used(be), 0);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* A 1 MiB pool filled with 256 B blocks holds exactly 4096 of them (runs
 * waste nothing: the unaligned rest of the slab is cut into plain blocks).
 * With every other block freed, a 1 KiB block does not fit (the holes sit
 * in runs); with all of them freed, the runs go back, coalesce, and one
 * 1 MiB block fits without a new slab. */
TEST_CASE(runs_exhaustion_and_fragmentation) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1 * MiB, 1 * MiB, &p));
  enum { N = 4096 };
  static void *b[N + 1];
  size_t n = 0;
  dmem_status_t st = DMEM_OK;
  while (n <= N) {
    st = dmem__pool_alloc(p, 256, NULL, &b[n]);
    if (st != DMEM_OK) break;
    n++;
  }
  CHECK_STATUS(st, DMEM_ERR_OUT_OF_MEMORY);
  CHECK_UEQ(n, N);
  CHECK_GE(stats_of(p).runs, 14);
  for (size_t i = 0; i < n; i += 2) dmem__pool_free(p, b[i], 256, NULL);
  dmem__pool_flush(p);
  CHECK_UEQ(stats_of(p).in_use, (size_t)N / 2 * 256);
  void *k = NULL;
  CHECK_STATUS(dmem__pool_alloc(p, 1024, NULL, &k), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_EQ(dmem__pool_fits(p, 256, NULL), 1); /* a run has room */
  /* the holes serve 256 B blocks again, all of them */
  for (size_t i = 0; i < n; i += 2) REQUIRE_OK(dmem__pool_alloc(p, 256, NULL, &b[i]));
  void *extra = NULL;
  CHECK_STATUS(dmem__pool_alloc(p, 256, NULL, &extra), DMEM_ERR_OUT_OF_MEMORY);
  for (size_t i = 0; i < n; i++) dmem__pool_free(p, b[i], 256, NULL);
  dmem__pool_flush(p);
  CHECK_UEQ(stats_of(p).runs, 0);
  void *whole = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 1 * MiB, NULL, &whole));
  CHECK_UEQ(stats_of(p).slabs, 1);
  dmem__pool_free(p, whole, 1 * MiB, NULL);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->destroy(be);
}

/* What B's probe saw of the two writers (runs_stream_order). */
typedef struct probe2 {
  probe_t *a, *c;
  atomic_int ran, saw_both;
} probe2_t;

static void probe2_fn(void *user) {
  probe2_t *q = user;
  atomic_store(&q->saw_both, atomic_load(&q->a->a_done) && atomic_load(&q->c->a_done));
  memset(q->a->block, 0xBB, q->a->n);
  memset(q->c->block, 0xBB, q->c->n);
  atomic_store(&q->ran, 1);
}

/* Stream order inside a run. The pool is full of 256 B blocks; X and Z
 * (blocks of one run) are written behind gates on streams A and C and
 * freed there. Their events cannot be joined (two streams): one block
 * waits as the run's pending block, the other is parked. B gets both, one
 * after the other, and is made to wait for both writers: B's probe runs
 * only after both gates open, and its writes land last. */
TEST_CASE(runs_stream_order) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1 * MiB, 1 * MiB, &p));
  void *sa = NULL, *sb = NULL, *sc = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  REQUIRE_OK(be->stream_create(be, &sc));
  enum { N = 4096 };
  static void *b[N];
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem__pool_alloc(p, 256, NULL, &b[i]));
  void *none = NULL;
  REQUIRE_STATUS(dmem__pool_alloc(p, 256, NULL, &none), DMEM_ERR_OUT_OF_MEMORY);
  /* X and Z: two blocks of one run (same 64 KiB window, not its first) */
  void *x = NULL, *z = NULL;
  for (int i = 1; i < N && !z; i++) {
    uintptr_t a = (uintptr_t)b[i];
    if (a % (64 * KiB) == 0) continue;
    for (int j = i + 1; j < N; j++)
      if ((uintptr_t)b[j] / (64 * KiB) == a / (64 * KiB) && (uintptr_t)b[j] % (64 * KiB) != 0) {
        x = b[i];
        z = b[j];
        break;
      }
  }
  REQUIRE_TRUE(x && z);
  CHECK_GE(stats_of(p).runs, 1);
  gate_t ga = {0}, gc = {0};
  probe_t pa = {0}, pc = {0};
  pa.block = x;
  pa.n = 256;
  pc.block = z;
  pc.n = 256;
  probe2_t q = {&pa, &pc, 0, 0};
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &ga));
  REQUIRE_OK(be->launch_host_func(be, sa, writer_a_fn, &pa));
  REQUIRE_OK(be->launch_host_func(be, sc, gate_wait_fn, &gc));
  REQUIRE_OK(be->launch_host_func(be, sc, writer_a_fn, &pc));
  dmem__pool_free(p, x, 256, sa);
  dmem__pool_free(p, z, 256, sc);
  dmem__pool_flush(p); /* each under its stream's event: pending behind the gates */

  void *y1 = NULL, *y2 = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 256, sb, &y1));
  REQUIRE_OK(dmem__pool_alloc(p, 256, sb, &y2));
  CHECK_TRUE((y1 == x && y2 == z) || (y1 == z && y2 == x));
  void *w = NULL;
  CHECK_STATUS(dmem__pool_alloc(p, 256, sb, &w), DMEM_ERR_OUT_OF_MEMORY);
  REQUIRE_OK(be->launch_host_func(be, sb, probe2_fn, &q));
  usleep(30 * 1000);
  CHECK_EQ(atomic_load(&q.ran), 0);
  atomic_store(&ga.open, 1);
  usleep(30 * 1000);
  CHECK_EQ(atomic_load(&q.ran), 0); /* still behind C's writer */
  atomic_store(&gc.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sb));
  CHECK_EQ(atomic_load(&q.ran), 1);
  CHECK_EQ(atomic_load(&q.saw_both), 1);
  REQUIRE_OK(be->stream_synchronize(be, sa));
  REQUIRE_OK(be->stream_synchronize(be, sc));
  CHECK_UEQ(count_not(x, 256, 0xBB), 0);
  CHECK_UEQ(count_not(z, 256, 0xBB), 0);
  dmem__pool_free(p, y1, 256, sb);
  dmem__pool_free(p, y2, 256, sb);
  for (int i = 0; i < N; i++)
    if (b[i] != x && b[i] != z) dmem__pool_free(p, b[i], 256, NULL);
  dmem__pool_flush(p);
  CHECK_UEQ(stats_of(p).in_use, 0);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  be->stream_destroy(be, sc);
  be->destroy(be);
}

/* A free of an address inside a run that is no live block (a block's
 * interior, a block already freed) is logged and ignored on the global
 * path: the run and the live bytes stay as they were. */
TEST_CASE(runs_bad_free_ignored) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 2 * MiB, 1 * MiB, &p));
  void *b[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(dmem__pool_alloc(p, 256, NULL, &b[i]));
  size_t runs = stats_of(p).runs;
  CHECK_GE(runs, 1);
  dmem__pool_free_after(p, (char *)b[2] + 16, 256, NULL); /* interior: logged */
  dmem__pool_free_after(p, b[3], 256, NULL);
  dmem__pool_free_after(p, b[3], 256, NULL); /* twice: logged */
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.runs, runs);
  for (int i = 0; i < 3; i++) dmem__pool_free(p, b[i], 256, NULL);
  dmem__pool_flush(p);
  CHECK_UEQ(stats_of(p).runs, 0);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- stream-ordered reuse ------------------------------------------------------------ */

/* Block X is written by a host function on stream A that cannot run until
 * the gate opens, then freed on A. The pool is full: the only block B can
 * get is X. B must be made to wait for A (a host function on B runs only
 * after A's writer), and B's write lands last. A pool that hands X to B
 * without ordering fails every check below. */
static void cross_stream_case(size_t size, int how) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, size, size, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, size, sa, &x));
  gate_t g = {0};
  probe_t pr = {0};
  pr.block = x;
  pr.n = size;
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g));
  REQUIRE_OK(be->launch_host_func(be, sa, writer_a_fn, &pr));
  if (how == 0) {
    dmem__pool_free(p, x, size, sa);
  } else {
    /* free_after with the caller's event, destroyed at once: the pool must
     * not keep it */
    void *ev = NULL;
    REQUIRE_OK(be->event_create(be, &ev));
    REQUIRE_OK(be->event_record(be, ev, sa));
    dmem__pool_free_after(p, x, size, ev);
    REQUIRE_OK(be->event_destroy(be, ev));
  }

  void *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, size, sb, &y));
  CHECK_TRUE(y == x);
  CHECK_UEQ(stats_of(p).reserved, size);
  REQUIRE_OK(be->launch_host_func(be, sb, probe_b_fn, &pr));
  usleep(50 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0);
  CHECK_EQ(atomic_load(&pr.a_done), 0);
  atomic_store(&g.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sb));
  CHECK_EQ(atomic_load(&pr.b_ran), 1);
  CHECK_EQ(atomic_load(&pr.b_saw_a), 1);
  REQUIRE_OK(be->stream_synchronize(be, sa));
  CHECK_UEQ(count_not(x, size, 0xBB), 0);
  dmem__pool_free(p, y, size, sb);
  dmem__pool_destroy(p);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  be->destroy(be);
}

TEST_CASE(cross_stream_large) { cross_stream_case(2 * MiB, 0); }   /* global path */
TEST_CASE(cross_stream_cached) { cross_stream_case(512 * KiB, 0); } /* via A's cache */
TEST_CASE(cross_stream_free_after) { cross_stream_case(2 * MiB, 1); }

/* Two neighbours freed on one stream behind two gates join under the LATER
 * of their events: a stream that takes the union waits for both gates. */
TEST_CASE(same_stream_merge_keeps_later_event) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 2 * MiB, 2 * MiB, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL, *z = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 1 * MiB, sa, &x));
  REQUIRE_OK(dmem__pool_alloc(p, 1 * MiB, sa, &y));
  gate_t g1 = {0}, g2 = {0};
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g1));
  dmem__pool_free(p, x, 1 * MiB, sa);
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g2));
  dmem__pool_free(p, y, 1 * MiB, sa);
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sb, &z));
  CHECK_TRUE(z == (x < y ? x : y));
  probe_t pr = {0};
  REQUIRE_OK(be->launch_host_func(be, sb, probe_b_fn, &pr));
  atomic_store(&g1.open, 1);
  usleep(50 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0); /* still behind the second gate */
  atomic_store(&g2.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sb));
  CHECK_EQ(atomic_load(&pr.b_ran), 1);
  dmem__pool_free(p, z, 2 * MiB, sb);
  dmem__pool_destroy(p);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  be->destroy(be);
}

/* A block whose event completed is taken by another stream without a wait. */
TEST_CASE(cross_stream_completed) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 2 * MiB, 2 * MiB, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &x));
  dmem__pool_free(p, x, 2 * MiB, sa);
  REQUIRE_OK(be->stream_synchronize(be, sa));
  /* sb is blocked: had the pool queued a wait on sb, nothing changes; but a
   * completed event must let sb take x at once */
  gate_t g = {0};
  REQUIRE_OK(be->launch_host_func(be, sb, gate_wait_fn, &g));
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sb, &y));
  CHECK_TRUE(y == x);
  atomic_store(&g.open, 1);
  dmem__pool_free(p, y, 2 * MiB, sb);
  /* free_after with a completed event: free for everyone, no internal stream */
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &x));
  void *ev = NULL;
  REQUIRE_OK(be->event_create(be, &ev));
  REQUIRE_OK(be->event_record(be, ev, sa));
  REQUIRE_OK(be->event_synchronize(be, ev));
  dmem__pool_free_after(p, x, 2 * MiB, ev);
  REQUIRE_OK(be->event_destroy(be, ev));
  REQUIRE_OK(be->stream_synchronize(be, sb));
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sb, &y));
  CHECK_TRUE(y == x);
  dmem__pool_free(p, y, 2 * MiB, sb);
  dmem__pool_destroy(p);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  be->destroy(be);
}

/* An event the backend rejects cannot order reuse: the block is never
 * handed out again (and its slab is never trimmed). */
TEST_CASE(free_after_bad_event_quarantines) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 2 * MiB, 2 * MiB, &p));
  void *x = NULL, *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, NULL, &x));
  uint64_t not_an_event[8] = {0};
  dmem__pool_free_after(p, x, 2 * MiB, not_an_event);
  CHECK_UEQ(stats_of(p).in_use, 0);
  CHECK_STATUS(dmem__pool_alloc(p, 2 * MiB, NULL, &y), DMEM_ERR_OUT_OF_MEMORY);
  size_t rel = 1;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 0);
  CHECK_UEQ(stats_of(p).reserved, 2 * MiB);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->destroy(be);
}

/* ---- same-stream reuse and caches ------------------------------------------------- */

TEST_CASE(same_stream_reuse) {
  dmem__backend_t *be = make_backend(16 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 16 * MiB, 4 * MiB, &p));
  void *s = NULL, *t = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  REQUIRE_OK(be->stream_create(be, &t));
  void *x = NULL, *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, s, &x));
  dmem__pool_free(p, x, 4 * KiB, s);
  dmem__pool_stats_t s0 = stats_of(p);
  CHECK_UEQ(s0.cached, 4 * KiB);
  REQUIRE_OK(dmem__pool_alloc(p, 4000, s, &y)); /* same class */
  CHECK_TRUE(y == x);
  dmem__pool_stats_t s1 = stats_of(p);
  CHECK_UEQ(s1.hits, s0.hits + 1);
  CHECK_UEQ(s1.misses, s0.misses);
  CHECK_UEQ(s1.global_locks, s0.global_locks); /* the pair took no pool-wide lock */
  CHECK_UEQ(s1.in_use, 4 * KiB);
  /* Another stream does not get s's cached block. */
  dmem__pool_free(p, y, 4 * KiB, s);
  REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, t, &y));
  CHECK_TRUE(y != x);
  dmem__pool_free(p, y, 4 * KiB, t);
  /* A large block freed on s comes back to s at once (same stream, no wait). */
  REQUIRE_OK(dmem__pool_alloc(p, 3 * MiB, s, &x));
  dmem__pool_free(p, x, 3 * MiB, s);
  s0 = stats_of(p);
  REQUIRE_OK(dmem__pool_alloc(p, 3 * MiB, s, &y));
  CHECK_TRUE(y == x);
  s1 = stats_of(p);
  CHECK_UEQ(s1.hits, s0.hits + 1);
  CHECK_UEQ(s1.misses, s0.misses);
  dmem__pool_free(p, y, 3 * MiB, s);

  /* forget flushes the stream's caches */
  REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, s, &x));
  dmem__pool_free(p, x, 4 * KiB, s);
  CHECK_GT(stats_of(p).cached, 0);
  dmem__pool_stream_forget(p, s);
  dmem__pool_stream_forget(p, t);
  CHECK_UEQ(stats_of(p).cached, 0);
  CHECK_UEQ(stats_of(p).in_use, 0);
  REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, s, &x)); /* usable again */
  dmem__pool_free(p, x, 4 * KiB, s);
  dmem__pool_stream_forget(p, s);
  dmem__pool_destroy(p);
  be->stream_destroy(be, s);
  be->stream_destroy(be, t);
  be->destroy(be);
}

/* The cache is bounded: many frees on one stream overflow to the free
 * ranges, with one event per batch, and the blocks stay reusable. */
TEST_CASE(cache_overflow) {
  dmem__backend_t *be = make_backend(8 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 8 * MiB, 8 * MiB, &p));
  enum { N = 1000 };
  static void *b[N];
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, NULL, &b[i]));
  for (int i = 0; i < N; i++) dmem__pool_free(p, b[i], 4 * KiB, NULL);
  dmem__pool_stats_t s = stats_of(p);
  CHECK_LE(s.cached, 32 * 4 * KiB); /* class bound */
  CHECK_UEQ(s.in_use, 0);
  CHECK_UEQ(s.slabs, 1);
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, NULL, &b[i]));
  CHECK_UEQ(stats_of(p).slabs, 1);
  for (int i = 0; i < N; i++) dmem__pool_free(p, b[i], 4 * KiB, NULL);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- lazy events for blocks that bypass the caches ----------------------------------- */

/* A backend that forwards to the host backend and counts what orders
 * streams: event_record (which it can be told to fail) and
 * stream_wait_event. Only the functions the pool calls are forwarded; the
 * tests call the inner backend for everything else. */
typedef struct cbe {
  dmem__backend_t base; /* the table the pool gets */
  dmem__backend_t *inner;
  atomic_int records;
  atomic_int waits;
  atomic_int fail_records; /* event_record fails while set */
  atomic_int fail_syncs;   /* stream_synchronize fails while set */
  atomic_int syncs;
} cbe_t;

static dmem__backend_t *cbe_inner(dmem__backend_t *be) { return ((cbe_t *)be)->inner; }
static int nrec(cbe_t *c) { return atomic_load(&c->records); }
static int nwait(cbe_t *c) { return atomic_load(&c->waits); }

static dmem_status_t cbe_device_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  return cbe_inner(be)->device_alloc(cbe_inner(be), size, ptr_out);
}
static dmem_status_t cbe_device_free(dmem__backend_t *be, void *ptr) {
  return cbe_inner(be)->device_free(cbe_inner(be), ptr);
}
static dmem_status_t cbe_stream_create(dmem__backend_t *be, void **stream_out) {
  return cbe_inner(be)->stream_create(cbe_inner(be), stream_out);
}
static dmem_status_t cbe_stream_destroy(dmem__backend_t *be, void *stream) {
  return cbe_inner(be)->stream_destroy(cbe_inner(be), stream);
}
static dmem_status_t cbe_stream_wait_event(dmem__backend_t *be, void *stream, void *event) {
  atomic_fetch_add(&((cbe_t *)be)->waits, 1);
  return cbe_inner(be)->stream_wait_event(cbe_inner(be), stream, event);
}
static dmem_status_t cbe_event_create(dmem__backend_t *be, void **event_out) {
  return cbe_inner(be)->event_create(cbe_inner(be), event_out);
}
static dmem_status_t cbe_event_destroy(dmem__backend_t *be, void *event) {
  return cbe_inner(be)->event_destroy(cbe_inner(be), event);
}
static dmem_status_t cbe_event_record(dmem__backend_t *be, void *event, void *stream) {
  cbe_t *c = (cbe_t *)be;
  if (atomic_load(&c->fail_records))
    return dmem__error(DMEM_ERR_DEVICE, "test backend: event_record refused");
  atomic_fetch_add(&c->records, 1);
  return c->inner->event_record(c->inner, event, stream);
}
static dmem_status_t cbe_stream_synchronize(dmem__backend_t *be, void *stream) {
  cbe_t *c = (cbe_t *)be;
  if (atomic_load(&c->fail_syncs))
    return dmem__error(DMEM_ERR_DEVICE, "test backend: stream_synchronize refused");
  atomic_fetch_add(&c->syncs, 1);
  return c->inner->stream_synchronize(c->inner, stream);
}
static dmem_status_t cbe_event_query(dmem__backend_t *be, void *event) {
  return cbe_inner(be)->event_query(cbe_inner(be), event);
}
static dmem_status_t cbe_event_synchronize(dmem__backend_t *be, void *event) {
  return cbe_inner(be)->event_synchronize(cbe_inner(be), event);
}

static cbe_t *cbe_wrap(dmem__backend_t *inner) {
  cbe_t *c = calloc(1, sizeof *c);
  if (!c) exit(1);
  c->base = *inner; /* name, kind, capacity */
  c->inner = inner;
  c->base.device_alloc = cbe_device_alloc;
  c->base.device_free = cbe_device_free;
  c->base.host_alloc = NULL;
  c->base.host_free = NULL;
  c->base.memcpy_async = NULL;
  c->base.stream_create = cbe_stream_create;
  c->base.stream_destroy = cbe_stream_destroy;
  c->base.stream_synchronize = cbe_stream_synchronize;
  c->base.stream_wait_event = cbe_stream_wait_event;
  c->base.launch_host_func = NULL;
  c->base.event_create = cbe_event_create;
  c->base.event_destroy = cbe_event_destroy;
  c->base.event_record = cbe_event_record;
  c->base.event_query = cbe_event_query;
  c->base.event_synchronize = cbe_event_synchronize;
  c->base.make_current = NULL;
  c->base.ipc_handle = NULL;
  c->base.mem_info = NULL;
  c->base.destroy = NULL;
  return c;
}

/* Poll until *flag is set (or 2 s pass); its value then. */
static int wait_flag(atomic_int *flag) {
  for (int i = 0; i < 2000 && !atomic_load(flag); i++) usleep(1000);
  return atomic_load(flag);
}

/* The same-stream alloc+free pair of a block that bypasses the caches (3,
 * 16 and 64 MiB; on a stream and on the default stream) records no event and
 * makes no stream wait: the block comes back at once, same address, no new
 * slab. Before lazy tags every such free recorded an event. */
TEST_CASE(large_pair_no_event) {
  dmem__backend_t *be = make_backend(256 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 192 * MiB, 4 * MiB, &p));
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  const size_t sizes[3] = {3 * MiB, 16 * MiB, 64 * MiB};
  for (int k = 0; k < 3; k++) {
    for (int on_s = 0; on_s < 2; on_s++) {
      void *stream = on_s ? s : NULL, *x = NULL, *y = NULL;
      REQUIRE_OK(dmem__pool_alloc(p, sizes[k], stream, &x));
      dmem__pool_free(p, x, sizes[k], stream);
      int r0 = nrec(c), w0 = nwait(c);
      dmem__pool_stats_t s0 = stats_of(p);
      int same = 0;
      for (int i = 0; i < 100; i++) {
        bool ordered = false;
        REQUIRE_OK(dmem__pool_alloc_ordered(p, sizes[k], stream, &y, &ordered));
        same += y == x && ordered; /* its last use, on this stream, may be pending */
        dmem__pool_free(p, y, sizes[k], stream);
      }
      CHECK_EQ(same, 100);
      CHECK_EQ(nrec(c) - r0, 0);
      CHECK_EQ(nwait(c) - w0, 0);
      dmem__pool_stats_t s1 = stats_of(p);
      CHECK_UEQ(s1.misses, s0.misses);
      CHECK_UEQ(s1.hits, s0.hits + 100);
      CHECK_UEQ(s1.reserved, s0.reserved);
      CHECK_UEQ(s1.in_use, 0);
    }
  }
  dmem__pool_stream_forget(p, s);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, s);
  free(c);
  be->destroy(be);
}

/* Blocks X and Y freed lazily on A behind a gate and A's writer of X (no
 * event at the frees); B takes both. The pool records the event on A when
 * B takes the first (once: the second, under the same tag, needs no second
 * record) and makes B wait: B's probe runs only after A's writer, and B's
 * write lands last. */
TEST_CASE(cross_stream_lazy) {
  dmem__backend_t *be = make_backend(16 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 8 * MiB, 8 * MiB, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL, *z1 = NULL, *z2 = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sa, &x));
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sa, &y));
  CHECK_UEQ(stats_of(p).slabs, 1);
  gate_t g = {0};
  probe_t pr = {0};
  pr.block = x;
  pr.n = 4 * MiB;
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g));
  REQUIRE_OK(be->launch_host_func(be, sa, writer_a_fn, &pr));
  int r0 = nrec(c), w0 = nwait(c);
  dmem__pool_free(p, x, 4 * MiB, sa);
  dmem__pool_free(p, y, 4 * MiB, sa);
  CHECK_EQ(nrec(c), r0); /* nothing recorded by the frees */
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sb, &z1));
  CHECK_EQ(nrec(c), r0 + 1); /* on A, now */
  CHECK_EQ(nwait(c), w0 + 1);
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sb, &z2));
  CHECK_EQ(nrec(c), r0 + 1); /* the same record covers Y */
  CHECK_TRUE((z1 == x && z2 == y) || (z1 == y && z2 == x));
  CHECK_UEQ(stats_of(p).slabs, 1);
  REQUIRE_OK(be->launch_host_func(be, sb, probe_b_fn, &pr));
  usleep(50 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0);
  CHECK_EQ(atomic_load(&pr.a_done), 0);
  atomic_store(&g.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sb));
  CHECK_EQ(atomic_load(&pr.b_ran), 1);
  CHECK_EQ(atomic_load(&pr.b_saw_a), 1);
  REQUIRE_OK(be->stream_synchronize(be, sa));
  CHECK_UEQ(count_not(x, 4 * MiB, 0xBB), 0);
  /* B's frees open B's own lazy tag: again nothing recorded. */
  int r1 = nrec(c);
  dmem__pool_free(p, z1, 4 * MiB, sb);
  dmem__pool_free(p, z2, 4 * MiB, sb);
  CHECK_EQ(nrec(c), r1);
  dmem__pool_stream_forget(p, sa);
  dmem__pool_stream_forget(p, sb);
  dmem__pool_destroy(p);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  free(c);
  be->destroy(be);
}

/* A lazily freed block does not join its settled neighbour (that would tie
 * bytes free for every stream to A's record to come): B gets the settled
 * range with nothing recorded and nothing to wait for, and runs while A is
 * still blocked; A gets its block back at once. */
TEST_CASE(lazy_block_stays_apart) {
  dmem__backend_t *be = make_backend(16 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 8 * MiB, 8 * MiB, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL, *z = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &x));
  gate_t g = {0};
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g));
  dmem__pool_free(p, x, 2 * MiB, sa);
  CHECK_UEQ(dmem__pool_largest_free(p), 8 * MiB); /* one run, two ranges */
  int r0 = nrec(c), w0 = nwait(c);
  REQUIRE_OK(dmem__pool_alloc(p, 6 * MiB, sb, &y));
  CHECK_TRUE(y == (char *)x + 2 * MiB);
  CHECK_EQ(nrec(c), r0);
  CHECK_EQ(nwait(c), w0);
  probe_t pr = {0};
  REQUIRE_OK(be->launch_host_func(be, sb, probe_b_fn, &pr));
  CHECK_EQ(wait_flag(&pr.b_ran), 1); /* B was not made to wait for A */
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &z));
  CHECK_TRUE(z == x);
  CHECK_EQ(nrec(c), r0);
  atomic_store(&g.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sa));
  REQUIRE_OK(be->stream_synchronize(be, sb));
  dmem__pool_free(p, z, 2 * MiB, sa);
  dmem__pool_free(p, y, 6 * MiB, sb);
  /* trim records the lazy events of its empty slab, waits, gives it back */
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 8 * MiB);
  CHECK_EQ(nrec(c), r0 + 2);
  CHECK_UEQ(backend_used(be), 0);
  dmem__pool_stream_forget(p, sa);
  dmem__pool_stream_forget(p, sb);
  dmem__pool_destroy(p);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  free(c);
  be->destroy(be);
}

/* stream_forget records the event of the stream's lazily freed blocks: they
 * are still handed out in order (B waits for A's writer), and once the
 * stream is destroyed nothing is recorded on it any more. */
TEST_CASE(forget_records_lazy) {
  dmem__backend_t *be = make_backend(8 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 4 * MiB, 4 * MiB, &p));
  void *sa = NULL, *sb = NULL, *sc = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sa, &x));
  gate_t g = {0};
  probe_t pr = {0};
  pr.block = x;
  pr.n = 4 * MiB;
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g));
  REQUIRE_OK(be->launch_host_func(be, sa, writer_a_fn, &pr));
  int r0 = nrec(c), w0 = nwait(c);
  dmem__pool_free(p, x, 4 * MiB, sa);
  CHECK_EQ(nrec(c), r0);
  dmem__pool_stream_forget(p, sa);
  CHECK_EQ(nrec(c), r0 + 1); /* on A, before it can go */
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sb, &y));
  CHECK_TRUE(y == x);
  CHECK_EQ(nrec(c), r0 + 1);
  CHECK_EQ(nwait(c), w0 + 1);
  REQUIRE_OK(be->launch_host_func(be, sb, probe_b_fn, &pr));
  usleep(50 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0);
  atomic_store(&g.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sb));
  CHECK_EQ(atomic_load(&pr.b_saw_a), 1);
  CHECK_UEQ(count_not(x, 4 * MiB, 0xBB), 0);
  REQUIRE_OK(be->stream_destroy(be, sa));

  /* C takes the block from B (B's lazy event recorded then), frees it
   * lazily, is forgotten and destroyed: B then takes it back with nothing
   * recorded on C, which is gone. */
  REQUIRE_OK(be->stream_create(be, &sc));
  dmem__pool_free(p, y, 4 * MiB, sb);
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sc, &x));
  CHECK_TRUE(x == y);
  dmem__pool_free(p, x, 4 * MiB, sc);
  int r1 = nrec(c);
  dmem__pool_stream_forget(p, sc);
  CHECK_EQ(nrec(c), r1 + 1);
  REQUIRE_OK(be->stream_destroy(be, sc));
  REQUIRE_OK(dmem__pool_alloc(p, 4 * MiB, sb, &y));
  CHECK_TRUE(y == x);
  CHECK_EQ(nrec(c), r1 + 1);
  CHECK_UEQ(stats_of(p).slabs, 1);
  dmem__pool_free(p, y, 4 * MiB, sb);
  dmem__pool_stream_forget(p, sb);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, sb);
  free(c);
  be->destroy(be);
}

/* When the lazy event cannot be recorded and the stream cannot be waited
 * for either (here: the backend refuses both; a destroyed stream, a lost
 * device), the blocks under it are quarantined: never handed to another
 * stream unordered, nor to anyone later; the limit holds and the slab is
 * never trimmed. */
TEST_CASE(lazy_record_failure_quarantines) {
  dmem__backend_t *be = make_backend(8 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 4 * MiB, 4 * MiB, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL, *z = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &x));
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &y));
  dmem__pool_free(p, x, 2 * MiB, sa);
  atomic_store(&c->fail_records, 1);
  atomic_store(&c->fail_syncs, 1);
  CHECK_STATUS(dmem__pool_alloc(p, 2 * MiB, sb, &z), DMEM_ERR_OUT_OF_MEMORY);
  atomic_store(&c->fail_records, 0);
  atomic_store(&c->fail_syncs, 0);
  CHECK_STATUS(dmem__pool_alloc(p, 2 * MiB, sa, &z), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_TRUE(z == NULL);
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.in_use, 2 * MiB);
  CHECK_UEQ(s.reserved, 4 * MiB);
  CHECK_UEQ(s.quarantined, 2 * MiB);
  dmem__pool_free(p, y, 2 * MiB, sa);
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sb, &z)); /* Y, ordered as usual */
  CHECK_TRUE(z == y);
  dmem__pool_free(p, z, 2 * MiB, sb);
  size_t rel = 1;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 0);
  dmem__pool_stream_forget(p, sa);
  dmem__pool_destroy(p);

  /* Sixteen lazy 256 KiB ranges (between live blocks) fill the best-fit
   * candidates; the settled 256 KiB at the slab's end comes after them. The
   * failed record quarantines the sixteen and the allocation goes on to
   * that range. */
  REQUIRE_OK(dmem__pool_create(&c->base, 8 * MiB, 8 * MiB, &p));
  enum { NB = 31 };
  void *b[NB];
  for (int i = 0; i < NB; i++) REQUIRE_OK(dmem__pool_alloc(p, 256 * KiB, sa, &b[i]));
  for (int i = 0; i < NB; i += 2) dmem__pool_free(p, b[i], 256 * KiB, sa);
  atomic_store(&c->fail_records, 1);
  atomic_store(&c->fail_syncs, 1);
  z = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 256 * KiB, sb, &z));
  atomic_store(&c->fail_records, 0);
  atomic_store(&c->fail_syncs, 0);
  void *base = NULL;
  CHECK_UEQ(offset_in_slab(p, z, &base), 7 * MiB + 768 * KiB);
  CHECK_UEQ(stats_of(p).slabs, 1);
  CHECK_STATUS(dmem__pool_alloc(p, 256 * KiB, sb, &y), DMEM_ERR_OUT_OF_MEMORY);
  dmem__pool_free(p, z, 256 * KiB, sb);
  for (int i = 1; i < NB; i += 2) dmem__pool_free(p, b[i], 256 * KiB, sa);
  dmem__pool_stream_forget(p, sa);
  dmem__pool_stream_forget(p, sb);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  free(c);
  be->destroy(be);
}

/* When only the record fails (a transient device error), the pool waits
 * for the freeing stream on the host instead: the blocks are free for
 * every stream, nothing is quarantined. Before, one failed record lost
 * them until destroy (found by the fault-injection suite). */
TEST_CASE(lazy_record_failure_waits_for_the_stream) {
  dmem__backend_t *be = make_backend(8 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 4 * MiB, 4 * MiB, &p));
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *y = NULL, *z = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &x));
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &y));
  dmem__pool_free(p, x, 2 * MiB, sa); /* lazy: no event yet */
  int syncs = atomic_load(&c->syncs);
  atomic_store(&c->fail_records, 1);
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sb, &z)); /* X, after a host wait on sa */
  atomic_store(&c->fail_records, 0);
  CHECK_TRUE(z == x);
  CHECK_EQ(atomic_load(&c->syncs), syncs + 1);
  dmem__pool_stats_t s = stats_of(p);
  CHECK_UEQ(s.quarantined, 0);
  CHECK_UEQ(s.in_use, 4 * MiB);
  dmem__pool_free(p, z, 2 * MiB, sb);
  dmem__pool_free(p, y, 2 * MiB, sa);
  /* an uncached free whose event fails: the same */
  atomic_store(&c->fail_records, 1);
  dmem__pool_stream_forget(p, sa);
  dmem__pool_stream_forget(p, sb);
  atomic_store(&c->fail_records, 0);
  CHECK_UEQ(stats_of(p).quarantined, 0);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, 4 * MiB); /* the slab is whole again */
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  free(c);
  be->destroy(be);
}

/* ---- per-stream caches of large blocks ------------------------------------------------ */

/* A 16 MiB same-stream pair (on a stream and on the default stream) is
 * served from this thread's large cache of the stream: the same block,
 * no pool-wide lock, no event, no stream wait. Only the exact rounded size
 * is handed out (the caller frees with the size it asked for). Overflow
 * moves the oldest block to the free ranges with nothing recorded; fits
 * sees the cache; forget empties it. Before large caches every such pair
 * took the pool-wide mutex twice. */
TEST_CASE(large_pair_cached_no_lock) {
  dmem__backend_t *be = make_backend(1024 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  /* large blocks up to limit/64 = 16 MiB are cached */
  REQUIRE_OK(dmem__pool_create(&c->base, 1024 * MiB, 4 * MiB, &p));
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  for (int on_s = 0; on_s < 2; on_s++) {
    void *stream = on_s ? s : NULL, *x = NULL, *y = NULL, *w = NULL;
    /* c0: the default stream's block in the second round, which stays
     * cached: s's first allocations get a new slab rather than flush
     * another stream's large cache (the limit leaves room) */
    size_t c0 = stats_of(p).cached;
    /* w: 20 MiB, above the bound, freed to the free ranges (room for y) */
    REQUIRE_OK(dmem__pool_alloc(p, 20 * MiB, stream, &w));
    REQUIRE_OK(dmem__pool_alloc(p, 16 * MiB, stream, &x));
    dmem__pool_free(p, x, 16 * MiB, stream);
    dmem__pool_free(p, w, 20 * MiB, stream);
    dmem__pool_stats_t s0 = stats_of(p);
    CHECK_UEQ(s0.cached, c0 + 16 * MiB);
    CHECK_UEQ(c0, on_s ? 16 * MiB : 0);
    CHECK_TRUE(dmem__pool_fits(p, 16 * MiB, stream));
    int r0 = nrec(c), w0 = nwait(c);
    int same = 0;
    for (int i = 0; i < 100; i++) {
      bool ordered = false;
      REQUIRE_OK(dmem__pool_alloc_ordered(p, 16 * MiB, stream, &y, &ordered));
      same += y == x && ordered; /* its last use, on this stream, may be pending */
      dmem__pool_free(p, y, 16 * MiB, stream);
    }
    CHECK_EQ(same, 100);
    CHECK_EQ(nrec(c) - r0, 0);
    CHECK_EQ(nwait(c) - w0, 0);
    dmem__pool_stats_t s1 = stats_of(p);
    CHECK_UEQ(s1.global_locks, s0.global_locks);
    CHECK_UEQ(s1.hits, s0.hits + 100);
    CHECK_UEQ(s1.misses, s0.misses);
    CHECK_UEQ(s1.in_use, 0);
    CHECK_UEQ(s1.cached, c0 + 16 * MiB);

    /* 256 bytes less is another rounded size: not the cached block. */
    REQUIRE_OK(dmem__pool_alloc(p, 16 * MiB - 256, stream, &y));
    CHECK_TRUE(y != x);
    CHECK_UEQ(stats_of(p).in_use, 16 * MiB - 256);
    CHECK_UEQ(stats_of(p).cached, c0 + 16 * MiB);
    /* Its free overflows the 16 MiB bound: x, the oldest, goes to the free
     * ranges under the stream's lazy tag (nothing recorded) and comes back
     * to this stream at once. */
    int r1 = nrec(c), w1 = nwait(c);
    dmem__pool_free(p, y, 16 * MiB - 256, stream);
    CHECK_UEQ(stats_of(p).cached, c0 + 16 * MiB - 256);
    CHECK_UEQ(stats_of(p).in_use, 0);
    void *z = NULL;
    REQUIRE_OK(dmem__pool_alloc(p, 16 * MiB, stream, &z));
    CHECK_TRUE(z == x);
    dmem__pool_free(p, z, 16 * MiB, stream); /* y's block goes, lazily */
    CHECK_UEQ(stats_of(p).cached, c0 + 16 * MiB);
    CHECK_EQ(nrec(c) - r1, 0);
    CHECK_EQ(nwait(c) - w1, 0);
    CHECK_UEQ(stats_of(p).in_use, 0);
  }
  /* forget empties s's caches (one event recorded on s for its large
   * frees). */
  size_t cached = stats_of(p).cached;
  int r1 = nrec(c);
  dmem__pool_stream_forget(p, s);
  CHECK_UEQ(stats_of(p).cached, cached - 16 * MiB);
  CHECK_EQ(nrec(c) - r1, 1);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, s);
  free(c);
  be->destroy(be);
}

/* A 2 MiB block written on A behind a gate and freed on A sits in A's large
 * cache (nothing recorded). The pool is full, so B's request can only be
 * met by flushing A's cache: A's event is recorded then, B waits on it (B's
 * probe runs after A's writer) and gets the block. */
TEST_CASE(cross_stream_large_cached) {
  dmem__backend_t *be = make_backend(256 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 128 * MiB, 128 * MiB, &p)); /* caches up to 2 MiB */
  void *sa = NULL, *sb = NULL;
  REQUIRE_OK(be->stream_create(be, &sa));
  REQUIRE_OK(be->stream_create(be, &sb));
  void *x = NULL, *rest = NULL, *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sa, &x));
  REQUIRE_OK(dmem__pool_alloc(p, 126 * MiB, NULL, &rest));
  CHECK_UEQ(stats_of(p).slabs, 1);
  gate_t g = {0};
  probe_t pr = {0};
  pr.block = x;
  pr.n = 2 * MiB;
  REQUIRE_OK(be->launch_host_func(be, sa, gate_wait_fn, &g));
  REQUIRE_OK(be->launch_host_func(be, sa, writer_a_fn, &pr));
  int r0 = nrec(c), w0 = nwait(c);
  dmem__pool_free(p, x, 2 * MiB, sa);
  CHECK_UEQ(stats_of(p).cached, 2 * MiB);
  CHECK_EQ(nrec(c), r0);
  REQUIRE_OK(dmem__pool_alloc(p, 2 * MiB, sb, &y));
  CHECK_TRUE(y == x);
  CHECK_EQ(nrec(c), r0 + 1); /* on A, when B needed the block */
  CHECK_EQ(nwait(c), w0 + 1);
  CHECK_UEQ(stats_of(p).cached, 0);
  CHECK_UEQ(stats_of(p).reserved, 128 * MiB);
  REQUIRE_OK(be->launch_host_func(be, sb, probe_b_fn, &pr));
  usleep(50 * 1000);
  CHECK_EQ(atomic_load(&pr.b_ran), 0);
  CHECK_EQ(atomic_load(&pr.a_done), 0);
  atomic_store(&g.open, 1);
  REQUIRE_OK(be->stream_synchronize(be, sb));
  CHECK_EQ(atomic_load(&pr.b_ran), 1);
  CHECK_EQ(atomic_load(&pr.b_saw_a), 1);
  REQUIRE_OK(be->stream_synchronize(be, sa));
  CHECK_UEQ(count_not(x, 2 * MiB, 0xBB), 0);
  dmem__pool_free(p, y, 2 * MiB, sb);
  dmem__pool_free(p, rest, 126 * MiB, NULL);
  dmem__pool_stream_forget(p, sa);
  dmem__pool_stream_forget(p, sb);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  be->stream_destroy(be, sa);
  be->stream_destroy(be, sb);
  free(c);
  be->destroy(be);
}

typedef struct lc_arg {
  dmem__pool_t *p;
  void *ptr;
  size_t size;
  void *stream;
  int fits_same, fits_other; /* dmem__pool_fits from the freeing thread */
} lc_arg_t;

static void *lc_free_worker(void *arg) {
  lc_arg_t *a = arg;
  dmem__pool_free(a->p, a->ptr, a->size, a->stream);
  a->fits_same = dmem__pool_fits(a->p, a->size, a->stream);
  a->fits_other = dmem__pool_fits(a->p, a->size + 256, a->stream);
  return NULL;
}

/* Memory in large caches is reclaimed before the pool fails or grows: two
 * threads each free a 3 MiB block on their own stream into their caches
 * while the rest of the (full) pool is live; a 6 MiB request on a third
 * stream flushes both caches and takes the two blocks together, with no new
 * slab. Also the bound: at an 8 MiB limit a 3 MiB block is not cached
 * (large blocks are cached up to limit/64). */
TEST_CASE(large_cache_reclaimed_before_oom) {
  dmem__backend_t *be = make_backend(256 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 8 * MiB, 8 * MiB, &p));
  void *x = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 3 * MiB, NULL, &x));
  dmem__pool_free(p, x, 3 * MiB, NULL);
  CHECK_UEQ(stats_of(p).cached, 0);
  dmem__pool_destroy(p);

  const size_t limit = 192 * MiB; /* caches up to 3 MiB */
  REQUIRE_OK(dmem__pool_create(be, limit, limit, &p));
  void *s[3];
  for (int i = 0; i < 3; i++) REQUIRE_OK(be->stream_create(be, &s[i]));
  void *a = NULL, *b = NULL, *rest = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 3 * MiB, s[0], &a));
  REQUIRE_OK(dmem__pool_alloc(p, 3 * MiB, s[1], &b));
  REQUIRE_OK(dmem__pool_alloc(p, limit - 6 * MiB, NULL, &rest));
  dmem__pool_stats_t s0 = stats_of(p);
  CHECK_UEQ(s0.reserved, limit);
  CHECK_UEQ(s0.slabs, 1);
  CHECK_UEQ(dmem__pool_largest_free(p), 0);
  lc_arg_t args[2] = {{p, a, 3 * MiB, s[0], 0, 0}, {p, b, 3 * MiB, s[1], 0, 0}};
  for (int i = 0; i < 2; i++) {
    pthread_t th;
    REQUIRE_EQ(pthread_create(&th, NULL, lc_free_worker, &args[i]), 0);
    pthread_join(th, NULL);
    CHECK_EQ(args[i].fits_same, 1);  /* from the thread's cache */
    CHECK_EQ(args[i].fits_other, 0); /* exact sizes only; no free range */
  }
  CHECK_UEQ(stats_of(p).cached, 6 * MiB);
  CHECK_UEQ(stats_of(p).in_use, limit - 6 * MiB);
  CHECK_UEQ(dmem__pool_largest_free(p), 0); /* cached blocks count as live */
  void *y = NULL;
  REQUIRE_OK(dmem__pool_alloc(p, 6 * MiB, s[2], &y));
  CHECK_TRUE(y == (a < b ? a : b));
  dmem__pool_stats_t s1 = stats_of(p);
  CHECK_UEQ(s1.reserved, limit);
  CHECK_UEQ(s1.slabs, 1);
  CHECK_UEQ(s1.misses, s0.misses);
  CHECK_UEQ(s1.cached, 0);
  CHECK_UEQ(s1.in_use, limit);
  CHECK_LE(backend_used(be), limit);
  dmem__pool_free(p, y, 6 * MiB, s[2]);
  dmem__pool_free(p, rest, limit - 6 * MiB, NULL);
  CHECK_UEQ(stats_of(p).in_use, 0);
  for (int i = 0; i < 3; i++) dmem__pool_stream_forget(p, s[i]);
  dmem__pool_destroy(p);
  CHECK_UEQ(backend_used(be), 0);
  for (int i = 0; i < 3; i++) be->stream_destroy(be, s[i]);
  be->destroy(be);
}

/* trim after every block is freed, the large ones sitting in caches (on a
 * stream and on the default stream, behind a short host function): trim
 * flushes them, records their events, waits, and gives every slab back. */
static void sleep_fn(void *user) {
  (void)user;
  usleep(20 * 1000);
}

TEST_CASE(trim_large_cached) {
  dmem__backend_t *be = make_backend(2048 * MiB);
  cbe_t *c = cbe_wrap(be);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(&c->base, 2048 * MiB, 4 * MiB, &p)); /* caches up to 32 MiB */
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  const size_t sizes[3] = {16 * MiB, 3 * MiB, 5 * MiB + 256};
  void *b[2][3];
  for (int on_s = 0; on_s < 2; on_s++)
    for (int k = 0; k < 3; k++) REQUIRE_OK(dmem__pool_alloc(p, sizes[k], on_s ? s : NULL, &b[on_s][k]));
  REQUIRE_OK(be->launch_host_func(be, s, sleep_fn, NULL));
  for (int on_s = 0; on_s < 2; on_s++)
    for (int k = 0; k < 3; k++) dmem__pool_free(p, b[on_s][k], sizes[k], on_s ? s : NULL);
  dmem__pool_stats_t s0 = stats_of(p);
  CHECK_UEQ(s0.in_use, 0);
  CHECK_UEQ(s0.cached, 2 * (16 * MiB + 3 * MiB + 5 * MiB + 256));
  CHECK_GT(s0.reserved, 0);
  int r0 = nrec(c);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(rel, s0.reserved);
  dmem__pool_stats_t s1 = stats_of(p);
  CHECK_UEQ(s1.reserved, 0);
  CHECK_UEQ(s1.slabs, 0);
  CHECK_UEQ(s1.cached, 0);
  CHECK_UEQ(backend_used(be), 0);
  CHECK_EQ(nrec(c) - r0, 2); /* one lazy event per stream */
  dmem__pool_stream_forget(p, s);
  dmem__pool_destroy(p);
  be->stream_destroy(be, s);
  free(c);
  be->destroy(be);
}

/* More pending tags than trim waits for in one round (64), all still
 * pending when trim starts, ahead of a lazily freed range in the same slab:
 * trim waits in rounds and records the lazy tag too, so the slab goes back.
 * (Once, trim stopped counting at the 64th tag and left the lazy one
 * unrecorded: its slab stayed; pool.threads_random failed now and then.) */
#define TM_STREAMS 70
static void *open_gate_later(void *arg) {
  usleep(20000);
  atomic_store(&((gate_t *)arg)->open, 1);
  return NULL;
}

TEST_CASE(trim_waits_for_many_tags) {
  dmem__backend_t *be = make_backend(64 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 64 * MiB, 64 * MiB, &p)); /* one slab */
  void *st[TM_STREAMS], *b[TM_STREAMS], *big = NULL;
  gate_t g = {0};
  for (int i = 0; i < TM_STREAMS; i++) {
    REQUIRE_OK(be->stream_create(be, &st[i]));
    REQUIRE_OK(be->launch_host_func(be, st[i], gate_wait_fn, &g));
    REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, st[i], &b[i]));
  }
  REQUIRE_OK(dmem__pool_alloc(p, 8 * MiB, NULL, &big)); /* above the blocks, past the caches */
  for (int i = 0; i < TM_STREAMS; i++) dmem__pool_free(p, b[i], 4 * KiB, st[i]);
  dmem__pool_free(p, big, 8 * MiB, NULL);
  dmem__pool_stats_t s0 = stats_of(p);
  CHECK_UEQ(s0.slabs, 1);
  CHECK_UEQ(s0.in_use, 0);
  pthread_t opener;
  REQUIRE_EQ(pthread_create(&opener, NULL, open_gate_later, &g), 0);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  pthread_join(opener, NULL);
  CHECK_UEQ(rel, s0.reserved);
  CHECK_UEQ(stats_of(p).reserved, 0);
  CHECK_UEQ(backend_used(be), 0);
  for (int i = 0; i < TM_STREAMS; i++) {
    dmem__pool_stream_forget(p, st[i]);
    be->stream_destroy(be, st[i]);
  }
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- victim-selection queries -------------------------------------------------------- */

TEST_CASE(range_and_slab_of) {
  dmem__backend_t *be = make_backend(4 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1 * MiB, 1 * MiB, &p));
  void *b[4], *base = NULL;
  size_t off[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem__pool_alloc(p, 256 * KiB, NULL, &b[i]));
    void *bs = NULL;
    off[i] = offset_in_slab(p, b[i], &bs);
    if (i == 0) base = bs;
    CHECK_TRUE(bs == base);
    CHECK_UEQ(off[i] % (256 * KiB), 0);
    CHECK_TRUE((char *)b[i] == (char *)base + off[i]);
  }
  /* Sort by offset: the four tile the slab. */
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++)
      if (off[j] < off[i]) {
        size_t to = off[i];
        off[i] = off[j];
        off[j] = to;
        void *tp = b[i];
        b[i] = b[j];
        b[j] = tp;
      }
  for (int i = 0; i < 4; i++) CHECK_UEQ(off[i], (size_t)i * 256 * KiB);

  void *bs = NULL;
  size_t o = 0;
  REQUIRE_OK(dmem__pool_slab_of(p, (char *)b[2] + 100, &bs, &o));
  CHECK_TRUE(bs == base);
  CHECK_UEQ(o, 512 * KiB + 100);
  int local = 0;
  bs = (void *)&local;
  o = 7;
  CHECK_STATUS(dmem__pool_slab_of(p, &local, &bs, &o), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(bs == (void *)&local && o == 7); /* outputs untouched on failure */
  CHECK_STATUS(dmem__pool_slab_of(p, (char *)base + 1 * MiB, &bs, &o), DMEM_ERR_INVALID_ARGUMENT);

  /* Layout [b0 live][b1 free][b2 live][b3 free]. */
  CHECK_UEQ(dmem__pool_range_if_freed(p, b[0], 256 * KiB), 256 * KiB);
  dmem__pool_free(p, b[1], 256 * KiB, NULL);
  dmem__pool_free(p, b[3], 256 * KiB, NULL);
  dmem__pool_flush(p);
  CHECK_UEQ(dmem__pool_range_if_freed(p, b[0], 256 * KiB), 512 * KiB);
  CHECK_UEQ(dmem__pool_range_if_freed(p, b[2], 256 * KiB), 768 * KiB);
  CHECK_UEQ(dmem__pool_range_if_freed(p, b[1], 256 * KiB), 0);
  CHECK_UEQ(dmem__pool_largest_free(p), 256 * KiB);
  dmem__pool_free(p, b[2], 256 * KiB, NULL);
  dmem__pool_flush(p);
  CHECK_UEQ(dmem__pool_range_if_freed(p, b[0], 256 * KiB), 1 * MiB);
  CHECK_UEQ(dmem__pool_largest_free(p), 768 * KiB);
  dmem__pool_free(p, b[0], 256 * KiB, NULL);
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* ---- many threads -------------------------------------------------------------- */

#define RT_THREADS 8
#define RT_ROUNDS 12
#define RT_OPS 250
#define RT_MAX_LIVE 24
#define RT_LIMIT (32 * MiB)

typedef struct rt_block {
  void *ptr;
  size_t size;
  uint64_t seed;
} rt_block_t;

typedef struct rt_shared {
  dmem__backend_t *be;
  dmem__pool_t *p;
  pthread_barrier_t barrier;
  rt_block_t live[RT_THREADS][RT_MAX_LIVE];
  int nlive[RT_THREADS];
  atomic_size_t bad;    /* corrupted blocks */
  atomic_size_t overlaps;
  atomic_size_t ooms;
  atomic_size_t errors; /* statuses other than OK and OUT_OF_MEMORY */
} rt_shared_t;

typedef struct rt_arg {
  rt_shared_t *sh;
  int id;
} rt_arg_t;

static uint64_t rt_rand(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

static int rt_cmp(const void *a, const void *b) {
  const rt_block_t *x = a, *y = b;
  return (uintptr_t)x->ptr < (uintptr_t)y->ptr ? -1 : (uintptr_t)x->ptr > (uintptr_t)y->ptr;
}

/* Verify and free block i of thread id (swap-remove). */
static void rt_release(rt_shared_t *sh, int id, int i, void *stream, void *ev, uint64_t *rng) {
  rt_block_t *b = &sh->live[id][i];
  if (bad_words(b->ptr, b->size, b->seed)) atomic_fetch_add(&sh->bad, 1);
  if (ev && rt_rand(rng) % 4 == 0 && sh->be->event_record(sh->be, ev, stream) == DMEM_OK)
    dmem__pool_free_after(sh->p, b->ptr, b->size, ev);
  else
    dmem__pool_free(sh->p, b->ptr, b->size, stream);
  *b = sh->live[id][--sh->nlive[id]];
}

/* All live blocks, sorted: no two overlap (rounded sizes), and in_use is
 * their sum (run while every worker waits at the barrier). */
static void rt_check(rt_shared_t *sh) {
  rt_block_t all[RT_THREADS * RT_MAX_LIVE];
  size_t n = 0, sum = 0;
  for (int t = 0; t < RT_THREADS; t++)
    for (int i = 0; i < sh->nlive[t]; i++) {
      all[n] = sh->live[t][i];
      sum += dmem__pool_block_size(all[n].size);
      n++;
    }
  qsort(all, n, sizeof *all, rt_cmp);
  for (size_t i = 1; i < n; i++)
    if ((uintptr_t)all[i - 1].ptr + dmem__pool_block_size(all[i - 1].size) > (uintptr_t)all[i].ptr)
      atomic_fetch_add(&sh->overlaps, 1);
  for (size_t i = 0; i < n; i++) {
    void *base;
    size_t off;
    if (dmem__pool_slab_of(sh->p, all[i].ptr, &base, &off) != DMEM_OK ||
        (uintptr_t)all[i].ptr % 256)
      atomic_fetch_add(&sh->overlaps, 1);
  }
  dmem__pool_stats_t s = stats_of(sh->p);
  if (s.reserved > RT_LIMIT || backend_used(sh->be) > RT_LIMIT) {
    fprintf(stderr, "reserved %zu, backend used %zu: over the limit\n", s.reserved,
            backend_used(sh->be));
    atomic_fetch_add(&sh->bad, 1);
  }
  if (s.in_use != sum) {
    fprintf(stderr, "in_use %zu, live blocks %zu\n", s.in_use, sum);
    atomic_fetch_add(&sh->bad, 1);
  }
}

static void *rt_worker(void *arg) {
  rt_arg_t *a = arg;
  rt_shared_t *sh = a->sh;
  dmem__backend_t *be = sh->be;
  int id = a->id;
  uint64_t rng = 0x12345678u + (uint64_t)id * 7919u;
  void *own = NULL, *ev = NULL;
  if (be->stream_create(be, &own) != DMEM_OK || be->event_create(be, &ev) != DMEM_OK) {
    atomic_fetch_add(&sh->errors, 1);
    return NULL;
  }
  for (int round = 0; round < RT_ROUNDS; round++) {
    for (int op = 0; op < RT_OPS; op++) {
      void *stream = rt_rand(&rng) % 3 ? own : NULL;
      int n = sh->nlive[id];
      if (n > 0 && (n == RT_MAX_LIVE || rt_rand(&rng) % 2)) {
        rt_release(sh, id, (int)(rt_rand(&rng) % (uint64_t)n), stream, ev, &rng);
        continue;
      }
      /* log-uniform 256 B .. 1 MiB, sometimes a large block */
      size_t size = (size_t)256 << (rt_rand(&rng) % 13);
      size += rt_rand(&rng) % size;
      if (size > 1 * MiB) size = 1 * MiB;
      if (rt_rand(&rng) % 16 == 0) size = 1 * MiB + rt_rand(&rng) % (2 * MiB);
      void *ptr = NULL;
      dmem_status_t st;
      while ((st = dmem__pool_alloc(sh->p, size, stream, &ptr)) == DMEM_ERR_OUT_OF_MEMORY &&
             sh->nlive[id] > 0) {
        atomic_fetch_add(&sh->ooms, 1); /* "spill" one of ours and retry */
        rt_release(sh, id, 0, stream, ev, &rng);
      }
      if (st == DMEM_ERR_OUT_OF_MEMORY) continue; /* others hold everything now */
      if (st != DMEM_OK) {
        atomic_fetch_add(&sh->errors, 1);
        continue;
      }
      uint64_t seed = rt_rand(&rng);
      fill_words(ptr, size, seed);
      rt_block_t *b = &sh->live[id][sh->nlive[id]++];
      b->ptr = ptr;
      b->size = size;
      b->seed = seed;
    }
    pthread_barrier_wait(&sh->barrier);
    if (id == 0) rt_check(sh);
    pthread_barrier_wait(&sh->barrier);
  }
  while (sh->nlive[id] > 0) rt_release(sh, id, 0, own, NULL, &rng);
  dmem__pool_stream_forget(sh->p, own);
  be->stream_synchronize(be, own);
  be->stream_destroy(be, own);
  be->event_destroy(be, ev);
  return NULL;
}

TEST_CASE(threads_random) {
  static rt_shared_t sh;
  memset(&sh, 0, sizeof sh);
  sh.be = make_backend(48 * MiB);
  REQUIRE_OK(dmem__pool_create(sh.be, RT_LIMIT, 1 * MiB, &sh.p));
  pthread_barrier_init(&sh.barrier, NULL, RT_THREADS);
  pthread_t th[RT_THREADS];
  rt_arg_t args[RT_THREADS];
  for (int i = 0; i < RT_THREADS; i++) {
    args[i].sh = &sh;
    args[i].id = i;
    REQUIRE_EQ(pthread_create(&th[i], NULL, rt_worker, &args[i]), 0);
  }
  for (int i = 0; i < RT_THREADS; i++) pthread_join(th[i], NULL);
  pthread_barrier_destroy(&sh.barrier);
  CHECK_UEQ(atomic_load(&sh.bad), 0);
  CHECK_UEQ(atomic_load(&sh.overlaps), 0);
  CHECK_UEQ(atomic_load(&sh.errors), 0);
  dmem__pool_stats_t s = stats_of(sh.p);
  fprintf(stderr, "threads_random: %zu slabs, %zu bytes reserved, %" PRIu64 " hits, %" PRIu64
                  " misses, %zu OOM retries\n",
          s.slabs, s.reserved, s.hits, s.misses, atomic_load(&sh.ooms));
  CHECK_UEQ(s.in_use, 0);
  CHECK_LE(s.reserved, RT_LIMIT);
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(sh.p, 0, &rel));
  CHECK_UEQ(rel, s.reserved);
  CHECK_UEQ(stats_of(sh.p).reserved, 0);
  CHECK_UEQ(backend_used(sh.be), 0);
  dmem__pool_destroy(sh.p);
  sh.be->destroy(sh.be);
}

/* ---- no pool-wide lock on the fast path, and timing ---------------------------------- */

#define NL_THREADS 16
#define NL_PAIRS 20000

typedef struct nl_arg {
  dmem__pool_t *p;
  dmem__backend_t *be;
  int own_stream;
  pthread_barrier_t *barrier;
  atomic_size_t *errors;
} nl_arg_t;

static void *nl_worker(void *arg) {
  nl_arg_t *a = arg;
  void *stream = NULL;
  if (a->own_stream && a->be->stream_create(a->be, &stream) != DMEM_OK)
    atomic_fetch_add(a->errors, 1);
  pthread_barrier_wait(a->barrier);
  for (int i = 0; i < NL_PAIRS; i++) {
    void *ptr = NULL;
    if (dmem__pool_alloc(a->p, 4 * KiB, stream, &ptr) != DMEM_OK) {
      atomic_fetch_add(a->errors, 1);
      break;
    }
    *(volatile char *)ptr = (char)i;
    dmem__pool_free(a->p, ptr, 4 * KiB, stream);
  }
  pthread_barrier_wait(a->barrier);
  if (stream) {
    dmem__pool_stream_forget(a->p, stream);
    a->be->stream_destroy(a->be, stream);
  }
  return NULL;
}

/* 16 threads doing 4 KiB pairs, all on the default stream and then each on
 * its own: the pool-wide mutex is taken a few times per thread (first
 * allocation), never per pair. */
TEST_CASE(threads_no_global_lock) {
  dmem__backend_t *be = make_backend(64 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 64 * MiB, 4 * MiB, &p));
  for (int own = 0; own < 2; own++) {
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, NL_THREADS + 1);
    atomic_size_t errors = 0;
    nl_arg_t args[NL_THREADS];
    pthread_t th[NL_THREADS];
    dmem__pool_stats_t s0 = stats_of(p);
    for (int i = 0; i < NL_THREADS; i++) {
      args[i] = (nl_arg_t){p, be, own, &barrier, &errors};
      REQUIRE_EQ(pthread_create(&th[i], NULL, nl_worker, &args[i]), 0);
    }
    pthread_barrier_wait(&barrier);
    double t0 = now_s();
    pthread_barrier_wait(&barrier);
    double t1 = now_s();
    dmem__pool_stats_t s1 = stats_of(p);
    for (int i = 0; i < NL_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&barrier);
    CHECK_UEQ(atomic_load(&errors), 0);
    uint64_t locks = s1.global_locks - s0.global_locks;
    fprintf(stderr,
            "%d threads, %s: %.1f ns per 4 KiB pair per thread (%.1f M pairs/s in all), "
            "%" PRIu64 " pool-wide locks for %d pairs\n",
            NL_THREADS, own ? "a stream each" : "all on the default stream",
            (t1 - t0) * 1e9 / NL_PAIRS, NL_THREADS * (double)NL_PAIRS / (t1 - t0) / 1e6, locks,
            NL_THREADS * NL_PAIRS);
    CHECK_LE(locks, 4 * NL_THREADS);
    CHECK_UEQ(s1.in_use, 0);
  }
  dmem__pool_destroy(p);
  be->destroy(be);
}

/* The same with large blocks: 8 threads doing 16 MiB and 3 MiB pairs, each
 * on its own stream and then all on the default stream. After a warm-up
 * (the first allocation of each size and thread: the pool grows to the
 * working set rather than flush other threads' large caches) every pair
 * comes from the thread's large cache: no pool-wide lock at all (before
 * large caches: two per pair). */
#define NLL_THREADS 8
#define NLL_PAIRS 5000
#define NLL_WARM 8

typedef struct nll_arg {
  nl_arg_t base;
  pthread_barrier_t *hold; /* the main thread reads the counters (after the warm-up,
                              and after the timed pairs, before the forgets) */
} nll_arg_t;

static int nll_pairs(nl_arg_t *a, void *stream, int pairs) {
  static const size_t sizes[2] = {16 * MiB, 3 * MiB};
  for (int i = 0; i < pairs; i++) {
    for (int k = 0; k < 2; k++) {
      void *ptr = NULL;
      if (dmem__pool_alloc(a->p, sizes[k], stream, &ptr) != DMEM_OK) return -1;
      *(volatile char *)ptr = (char)i;
      dmem__pool_free(a->p, ptr, sizes[k], stream);
    }
  }
  return 0;
}

static void *nll_worker(void *arg) {
  nll_arg_t *la = arg;
  nl_arg_t *a = &la->base;
  void *stream = NULL;
  if (a->own_stream && a->be->stream_create(a->be, &stream) != DMEM_OK)
    atomic_fetch_add(a->errors, 1);
  if (nll_pairs(a, stream, NLL_WARM) != 0) atomic_fetch_add(a->errors, 1);
  pthread_barrier_wait(la->hold);
  pthread_barrier_wait(a->barrier);
  if (nll_pairs(a, stream, NLL_PAIRS) != 0) atomic_fetch_add(a->errors, 1);
  pthread_barrier_wait(a->barrier);
  pthread_barrier_wait(la->hold);
  if (stream) {
    dmem__pool_stream_forget(a->p, stream);
    a->be->stream_destroy(a->be, stream);
  }
  return NULL;
}

TEST_CASE(threads_no_global_lock_large) {
  dmem__backend_t *be = make_backend(2048 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 2048 * MiB, 4 * MiB, &p)); /* caches up to 32 MiB */
  for (int own = 1; own >= 0; own--) {
    pthread_barrier_t barrier, hold;
    pthread_barrier_init(&barrier, NULL, NLL_THREADS + 1);
    pthread_barrier_init(&hold, NULL, NLL_THREADS + 1);
    atomic_size_t errors = 0;
    nll_arg_t args[NLL_THREADS];
    pthread_t th[NLL_THREADS];
    dmem__pool_stats_t s0 = stats_of(p);
    for (int i = 0; i < NLL_THREADS; i++) {
      args[i] = (nll_arg_t){{p, be, own, &barrier, &errors}, &hold};
      REQUIRE_EQ(pthread_create(&th[i], NULL, nll_worker, &args[i]), 0);
    }
    pthread_barrier_wait(&hold);
    dmem__pool_stats_t sw = stats_of(p);
    pthread_barrier_wait(&barrier);
    double t0 = now_s();
    pthread_barrier_wait(&barrier);
    double t1 = now_s();
    dmem__pool_stats_t s1 = stats_of(p);
    pthread_barrier_wait(&hold);
    for (int i = 0; i < NLL_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&barrier);
    pthread_barrier_destroy(&hold);
    CHECK_UEQ(atomic_load(&errors), 0);
    uint64_t warm_locks = sw.global_locks - s0.global_locks, locks = s1.global_locks - sw.global_locks;
    fprintf(stderr,
            "%d threads, %s: %.1f ns per 16 MiB + 3 MiB pair couple per thread, %" PRIu64
            " pool-wide locks for %d pairs (%" PRIu64 " in the warm-up of %d pairs)\n",
            NLL_THREADS, own ? "a stream each" : "all on the default stream",
            (t1 - t0) * 1e9 / NLL_PAIRS, locks, 2 * NLL_THREADS * NLL_PAIRS, warm_locks,
            2 * NLL_THREADS * NLL_WARM);
    CHECK_UEQ(locks, 0);                      /* every pair from a cache */
    CHECK_LE(warm_locks, 4 * NLL_THREADS);    /* first allocations (two per thread) */
    CHECK_UEQ(s1.misses, sw.misses);
    CHECK_UEQ(s1.in_use, 0);
    CHECK_UEQ(s1.cached, NLL_THREADS * (16 * MiB + 3 * MiB));
    CHECK_LE(s1.reserved, 2048 * MiB);
  }
  size_t rel = 0;
  REQUIRE_OK(dmem__pool_trim(p, 0, &rel));
  CHECK_UEQ(stats_of(p).reserved, 0);
  CHECK_UEQ(backend_used(be), 0);
  dmem__pool_destroy(p);
  be->destroy(be);
}

static double pair_ns_of(dmem__pool_t *p, size_t size, void *stream, long pairs) {
  void *ptr = NULL;
  double t0 = now_s();
  for (long i = 0; i < pairs; i++) {
    if (dmem__pool_alloc(p, size, stream, &ptr) != DMEM_OK) return -1;
    dmem__pool_free(p, ptr, size, stream);
  }
  return (now_s() - t0) * 1e9 / (double)pairs;
}

static double pair_ns(dmem__pool_t *p, void *stream, long pairs) {
  return pair_ns_of(p, 4 * KiB, stream, pairs);
}

/* ns per malloc(4 KiB) + free pair: the same-run baseline of the timing
 * checks (a loaded machine slows both alike). */
static double malloc_pair_ns(long pairs) {
  double best = 1e9;
  for (int rep = 0; rep < 3; rep++) {
    double t0 = now_s();
    for (long i = 0; i < pairs; i++) {
      void *volatile q = malloc(4 * KiB);
      free(q);
    }
    double v = (now_s() - t0) * 1e9 / (double)pairs;
    if (v < best) best = v;
  }
  return best;
}

/* ns per 4 KiB alloc+free pair, one thread, with 0 and 1000 other live
 * blocks; checked against 10 times a malloc+free pair of the same run
 * (measured 1.5-2x on the loaded 2-core CI machine; a pool pair that made a
 * system call, or slept, is far above), and against 150 ns only with
 * DMEM_CHECK_TIMING=1 (an idle machine). Also the
 * 16 MiB pair, on a stream and on the default stream, with the 1000 blocks
 * live: under a 64 MiB limit (16 MiB is above limit/64, so the global path:
 * pool-wide mutex, lazy tag, no event) and under a 1 GiB limit (from the
 * thread's large cache) (printed only). */
TEST_CASE(timing) {
  dmem__backend_t *be = make_backend(64 * MiB);
  dmem__pool_t *p = NULL;
  REQUIRE_OK(dmem__pool_create(be, 64 * MiB, 4 * MiB, &p));
  void *stream = NULL;
  REQUIRE_OK(be->stream_create(be, &stream));
  const long pairs = 1000000;
  double best0 = 1e9, best1 = 1e9, best_s = 1e9;
  REQUIRE_TRUE(pair_ns(p, NULL, 10000) >= 0);
  for (int rep = 0; rep < 3; rep++) {
    double v = pair_ns(p, NULL, pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best0) best0 = v;
  }
  static void *live[1000];
  for (int i = 0; i < 1000; i++) REQUIRE_OK(dmem__pool_alloc(p, 4 * KiB, NULL, &live[i]));
  for (int rep = 0; rep < 3; rep++) {
    double v = pair_ns(p, NULL, pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best1) best1 = v;
    v = pair_ns(p, stream, pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best_s) best_s = v;
  }
  const long big_pairs = 200000;
  double best_big = 1e9, best_big0 = 1e9;
  REQUIRE_TRUE(pair_ns_of(p, 16 * MiB, stream, 1000) >= 0);
  REQUIRE_TRUE(pair_ns_of(p, 16 * MiB, NULL, 1000) >= 0);
  for (int rep = 0; rep < 3; rep++) {
    double v = pair_ns_of(p, 16 * MiB, stream, big_pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best_big) best_big = v;
    v = pair_ns_of(p, 16 * MiB, NULL, big_pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best_big0) best_big0 = v;
  }
  /* The same pair from the large caches: a pool whose limit/64 is 16 MiB. */
  dmem__pool_t *q = NULL;
  REQUIRE_OK(dmem__pool_create(be, 1024 * MiB, 4 * MiB, &q));
  static void *qlive[1000];
  for (int i = 0; i < 1000; i++) REQUIRE_OK(dmem__pool_alloc(q, 4 * KiB, NULL, &qlive[i]));
  double best_c = 1e9, best_c0 = 1e9;
  REQUIRE_TRUE(pair_ns_of(q, 16 * MiB, stream, 1000) >= 0);
  REQUIRE_TRUE(pair_ns_of(q, 16 * MiB, NULL, 1000) >= 0);
  uint64_t locks0 = stats_of(q).global_locks;
  for (int rep = 0; rep < 3; rep++) {
    double v = pair_ns_of(q, 16 * MiB, stream, big_pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best_c) best_c = v;
    v = pair_ns_of(q, 16 * MiB, NULL, big_pairs);
    REQUIRE_TRUE(v >= 0);
    if (v < best_c0) best_c0 = v;
  }
  CHECK_UEQ(stats_of(q).global_locks, locks0);
  for (int i = 0; i < 1000; i++) dmem__pool_free(q, qlive[i], 4 * KiB, NULL);
  dmem__pool_stream_forget(q, stream);
  dmem__pool_destroy(q);

  fprintf(stderr,
          "pool timing: 4 KiB alloc+free pair: %.1f ns (0 live blocks), %.1f ns (1000 live), "
          "%.1f ns (1000 live, own stream); best of 3 x %ld pairs\n",
          best0, best1, best_s, pairs);
  fprintf(stderr,
          "pool timing: 16 MiB alloc+free pair: %.1f ns (own stream), %.1f ns (default "
          "stream); 1000 live, best of 3 x %ld pairs\n",
          best_big, best_big0, big_pairs);
  fprintf(stderr,
          "pool timing: 16 MiB alloc+free pair from the large cache (limit 1 GiB): %.1f ns "
          "(own stream), %.1f ns (default stream); 1000 live, best of 3 x %ld pairs\n",
          best_c, best_c0, big_pairs);
  printf("pool_pair_ns_0_live %.1f\npool_pair_ns_1000_live %.1f\n", best0, best1);
  printf("pool_pair_ns_16MiB %.1f\n", best_big);
  printf("pool_pair_ns_16MiB_cached %.1f\n", best_c);
  double base = malloc_pair_ns(pairs);
  printf("pool timing: malloc(4 KiB)+free pair %.1f ns (baseline): pool %.2fx, %.2fx (1000 live)\n",
         base, best0 / base, best1 / base);
  CHECK_LE(best0, 10 * base);
  CHECK_LE(best1, 10 * base);
  const char *check = getenv("DMEM_CHECK_TIMING");
  if (check && strcmp(check, "1") == 0) {
    CHECK_LE(best0, 150);
    CHECK_LE(best1, 150);
  }
  for (int i = 0; i < 1000; i++) dmem__pool_free(p, live[i], 4 * KiB, NULL);
  dmem__pool_stream_forget(p, stream);
  dmem__pool_destroy(p);
  be->stream_destroy(be, stream);
  be->destroy(be);
}
