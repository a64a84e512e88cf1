/* Raw device memory (dmem_device_malloc / dmem_device_free, and
 * dmem_device_adopt, which makes a raw block a buffer), the pool seen
 * through the runtime (stream-ordered eviction, making room, trimming,
 * statistics), memory info, IPC, the process-wide default runtime and the
 * PyTorch symbols. Backend-neutral (run again as cuda.device.* on a GPU):
 * raw memory is written and read with dmem_stream_copy on its stream. */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "api/api.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

/* Write the pattern `seed` into raw memory p in stream s's order. */
static void raw_put(dmem_runtime_t *rt, void *p, size_t n, uint64_t seed, dmem_stream_t s) {
  void *tmp = malloc(n);
  if (!tmp) abort();
  check_fill(tmp, n, seed);
  if (dmem_stream_copy(rt, p, tmp, n, s) != DMEM_OK || dmem_stream_synchronize(rt, s) != DMEM_OK) abort();
  free(tmp);
}

/* Bytes of raw memory p that differ from the pattern `seed`. */
static size_t raw_bad(dmem_runtime_t *rt, const void *p, size_t n, uint64_t seed,
                      dmem_stream_t s) {
  void *tmp = calloc(1, n);
  if (!tmp) abort();
  if (dmem_stream_copy(rt, tmp, p, n, s) != DMEM_OK || dmem_stream_synchronize(rt, s) != DMEM_OK) abort();
  size_t bad = check_verify(tmp, n, seed);
  free(tmp);
  return bad;
}

static dmem_stats_t stats_of(dmem_runtime_t *rt) {
  dmem_stats_t s;
  memset(&s, 0, sizeof s);
  if (dmem_stats(rt, &s) != DMEM_OK) abort();
  return s;
}

TEST_CASE(raw_alloc_free_and_stats) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  void *p = NULL, *q = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 4 * KiB, NULL, &p));
  REQUIRE_OK(dmem_device_malloc(rt, 3 * MiB + 5, NULL, &q));
  CHECK_TRUE(p != NULL && q != NULL && p != q);
  CHECK_UEQ((uintptr_t)p % 256, 0);
  CHECK_UEQ((uintptr_t)q % 256, 0);
  raw_put(rt, p, 4 * KiB, 1, NULL);
  raw_put(rt, q, 3 * MiB + 5, 2, NULL);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.raw_used, 4 * KiB + 3 * MiB + 5);
  CHECK_UEQ(s.device_used, 4 * KiB + 3 * MiB + 5);
  CHECK_GE(s.device_reserved, s.device_used);
  CHECK_LE(s.device_reserved, 64 * MiB);
  CHECK_GT(s.pool_misses, 0); /* the first slab */
  CHECK_UEQ(raw_bad(rt, p, 4 * KiB, 1, NULL), 0);
  CHECK_UEQ(raw_bad(rt, q, 3 * MiB + 5, 2, NULL), 0);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  CHECK_OK(dmem_device_free(rt, q, NULL));
  CHECK_OK(dmem_device_free(rt, NULL, NULL)); /* no-op */
  s = stats_of(rt);
  CHECK_UEQ(s.raw_used, 0);
  CHECK_UEQ(s.device_used, 0);
  /* the same size again comes from memory the pool holds */
  uint64_t hits = s.pool_hits;
  REQUIRE_OK(dmem_device_malloc(rt, 4 * KiB, NULL, &p));
  CHECK_GT(stats_of(rt).pool_hits, hits);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  CHECK_STATUS(dmem_device_malloc(rt, 0, NULL, &p), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_malloc(rt, 16, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_malloc(NULL, 16, NULL, &p), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_malloc(rt, 65 * MiB, NULL, &p), DMEM_ERR_OUT_OF_MEMORY);
  dmem_runtime_destroy(rt);
}

/* Every bad free is INVALID_ARGUMENT and changes nothing. */
TEST_CASE(bad_frees_change_nothing) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  void *p = NULL, *q = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, NULL, &p));
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, NULL, &q));
  raw_put(rt, q, 64 * KiB, 7, NULL);
  dmem_stats_t before = stats_of(rt);
  int stack_var = 0;
  CHECK_STATUS(dmem_device_free(rt, &stack_var, NULL), DMEM_ERR_INVALID_ARGUMENT); /* unknown */
  CHECK_TRUE(strstr(dmem_last_error_detail(), "not a live") != NULL);
  CHECK_STATUS(dmem_device_free(rt, (char *)p + 256, NULL), DMEM_ERR_INVALID_ARGUMENT); /* inside */
  CHECK_STATUS(dmem_device_free(rt, (char *)p + 1, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  CHECK_STATUS(dmem_device_free(rt, p, NULL), DMEM_ERR_INVALID_ARGUMENT); /* double */
  CHECK_STATUS(dmem_device_free(NULL, q, NULL), DMEM_ERR_INVALID_ARGUMENT);
  dmem_stats_t after = stats_of(rt);
  CHECK_UEQ(after.raw_used, before.raw_used - 64 * KiB); /* only the good free counted */
  CHECK_UEQ(after.device_used, before.device_used - 64 * KiB);
  /* another runtime's pointer is unknown here */
  dmem_runtime_t *rt2 = check_runtime(16 * MiB);
  CHECK_STATUS(dmem_device_free(rt2, q, NULL), DMEM_ERR_INVALID_ARGUMENT);
  dmem_runtime_destroy(rt2);
  CHECK_UEQ(raw_bad(rt, q, 64 * KiB, 7, NULL), 0); /* untouched */
  /* a new allocation never overlaps the live block */
  void *r = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, NULL, &r));
  CHECK_TRUE((char *)r + 64 * KiB <= (char *)q || (char *)q + 64 * KiB <= (char *)r);
  CHECK_OK(dmem_device_free(rt, r, NULL));
  CHECK_OK(dmem_device_free(rt, q, NULL));
  CHECK_UEQ(stats_of(rt).device_used, 0);
  dmem_runtime_destroy(rt);
}

/* Raw allocations are never spilled; they make spillable buffers spill. */
TEST_CASE(raw_allocations_force_spills) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t h[8];
  for (int i = 0; i < 8; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 100 + (uint64_t)i);
  }
  void *p = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 2 * MiB, NULL, &p));
  /* the block is ready in the default stream's order (the spill copies
   * that read it may still run): the copy on that stream follows them */
  raw_put(rt, p, 2 * MiB, 9, NULL);
  dmem_stats_t s = stats_of(rt);
  CHECK_GE(s.spill_count, 2);
  CHECK_LE(s.device_used, 8 * MiB);
  int deferred = 0;
  for (int i = 0; i < 8; i++) deferred += state_of(rt, h[i]) == DMEM_STATE_DEFERRED_HOST;
  CHECK_GE(deferred, 2);
  /* bringing them all back spills others, never the raw block */
  for (int i = 0; i < 8; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 100 + (uint64_t)i), 0);
  CHECK_UEQ(raw_bad(rt, p, 2 * MiB, 9, NULL), 0);
  /* with every buffer locked, a raw allocation that needs room fails */
  void *ptrs[8];
  int locked = 0;
  for (int i = 0; i < 8; i++) locked += dmem_buffer_lock(rt, h[i], NULL, &ptrs[i]) == DMEM_OK;
  CHECK_TRUE(locked >= 5); /* 6 MiB of buffers fit beside the raw block */
  void *big = NULL;
  CHECK_STATUS(dmem_device_malloc(rt, 3 * MiB, NULL, &big), DMEM_ERR_OUT_OF_MEMORY);
  for (int i = 0; i < 8; i++) (void)dmem_buffer_unlock(rt, h[i]);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  for (int i = 0; i < 8; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  s = stats_of(rt);
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.host_used, 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(memory_info_counts_spillable) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  size_t fr = 0, total = 0;
  CHECK_OK(dmem_device_memory_info(rt, &fr, &total));
  CHECK_UEQ(total, 16 * MiB);
  CHECK_UEQ(fr, 16 * MiB);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &h[i]));
  void *p = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 4 * MiB, NULL, &p));
  /* 8 MiB of buffers are spillable, 4 MiB raw are not: 12 MiB obtainable */
  CHECK_OK(dmem_device_memory_info(rt, &fr, &total));
  CHECK_UEQ(fr, 12 * MiB);
  void *dp;
  REQUIRE_OK(dmem_buffer_lock(rt, h[0], NULL, &dp)); /* locked: not obtainable */
  CHECK_OK(dmem_device_memory_info(rt, &fr, NULL));
  CHECK_UEQ(fr, 10 * MiB);
  CHECK_OK(dmem_buffer_unlock(rt, h[0]));
  /* obtainable really is obtainable (in pieces: one 12 MiB block would need
   * a contiguous range, which slab boundaries may not offer) */
  void *r[12];
  for (int i = 0; i < 12; i++) CHECK_OK(dmem_device_malloc(rt, MiB, NULL, &r[i]));
  CHECK_OK(dmem_device_memory_info(rt, &fr, NULL));
  CHECK_UEQ(fr, 0);
  for (int i = 0; i < 12; i++) CHECK_OK(dmem_device_free(rt, r[i], NULL));
  CHECK_OK(dmem_device_free(rt, p, NULL));
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_STATUS(dmem_device_memory_info(NULL, &fr, &total), DMEM_ERR_INVALID_ARGUMENT);
  dmem_runtime_destroy(rt);
}

TEST_CASE(ipc_handle_on_host_backend_is_no_device) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  void *p = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 4 * KiB, NULL, &p));
  unsigned char handle[DMEM_IPC_HANDLE_SIZE];
  size_t off = 12345;
  if (dmem_runtime_backend(rt) == DMEM_BACKEND_HOST) {
    CHECK_STATUS(dmem_device_ipc_handle(rt, p, handle, &off), DMEM_ERR_NO_DEVICE);
    CHECK_UEQ(off, 12345);
  } else {
    CHECK_OK(dmem_device_ipc_handle(rt, p, handle, &off));
    CHECK_LT(off, 16 * MiB);
    int x = 0;
    CHECK_STATUS(dmem_device_ipc_handle(rt, &x, handle, &off), DMEM_ERR_INVALID_ARGUMENT);
  }
  CHECK_STATUS(dmem_device_ipc_handle(rt, NULL, handle, &off), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  dmem_runtime_destroy(rt);
}

TEST_CASE(trim_gives_empty_slabs_back) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  void *p[8];
  for (int i = 0; i < 8; i++) REQUIRE_OK(dmem_device_malloc(rt, 3 * MiB, NULL, &p[i]));
  size_t dev_free0 = 0;
  REQUIRE_OK(rt->be->mem_info(rt->be, &dev_free0, NULL));
  dmem_stats_t s = stats_of(rt);
  CHECK_GE(s.device_reserved, 24 * MiB);
  size_t released = 1;
  CHECK_OK(dmem_device_trim(rt, 0, &released)); /* everything live: nothing to give */
  CHECK_UEQ(released, 0);
  for (int i = 0; i < 8; i++) CHECK_OK(dmem_device_free(rt, p[i], NULL));
  CHECK_OK(dmem_device_trim(rt, 0, &released));
  CHECK_UEQ(released, s.device_reserved);
  CHECK_UEQ(stats_of(rt).device_reserved, 0);
  size_t dev_free1 = 0;
  REQUIRE_OK(rt->be->mem_info(rt->be, &dev_free1, NULL));
  if (dmem_runtime_backend(rt) == DMEM_BACKEND_HOST)
    CHECK_UEQ(dev_free1, dev_free0 + released); /* the backend has it back */
  /* on a GPU other processes (tests running beside this one) move the
   * device's free memory: device_reserved == 0 above is the check there */
  CHECK_STATUS(dmem_device_trim(NULL, 0, NULL), DMEM_ERR_INVALID_ARGUMENT);
  dmem_runtime_destroy(rt);
}

/* ---- a counting backend: what a spill/unspill cycle asks of the device ---- */

static dmem__backend_t counted_orig;
static atomic_int n_device_free, n_host_syncs;
static dmem_status_t counting_device_free(dmem__backend_t *be, void *ptr) {
  atomic_fetch_add(&n_device_free, 1);
  return counted_orig.device_free(be, ptr);
}
static dmem_status_t counting_event_sync(dmem__backend_t *be, void *ev) {
  atomic_fetch_add(&n_host_syncs, 1);
  return counted_orig.event_synchronize(be, ev);
}
static dmem_status_t counting_stream_sync(dmem__backend_t *be, void *s) {
  atomic_fetch_add(&n_host_syncs, 1);
  return counted_orig.stream_synchronize(be, s);
}
static void count_backend(dmem_runtime_t *rt) {
  counted_orig = *rt->be;
  rt->be->device_free = counting_device_free;
  rt->be->event_synchronize = counting_event_sync;
  rt->be->stream_synchronize = counting_stream_sync;
}

/* Eviction is stream-ordered: spilling and bringing back buffers (on-demand
 * eviction included) makes no device_free and no host synchronisation. */
TEST_CASE(spill_unspill_cycle_no_free_no_sync) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t h[6];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 50 + (uint64_t)i);
  }
  count_backend(rt);
  /* on-demand: two more buffers evict two */
  for (int i = 4; i < 6; i++) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
  /* explicit spill, then locks that bring everything back (evicting others) */
  CHECK_OK(dmem_buffer_spill(rt, h[2], DMEM_TIER_HOST));
  for (int round = 0; round < 3; round++)
    for (int i = 0; i < 6; i++) { /* 6 MiB through 4 MiB: every lock moves */
      void *p;
      CHECK_OK(dmem_buffer_lock(rt, h[i], s, &p));
      CHECK_OK(dmem_buffer_unlock(rt, h[i])); /* nothing enqueued on s uses it */
    }
  int frees = atomic_load(&n_device_free), syncs = atomic_load(&n_host_syncs);
  dmem_stats_t st = stats_of(rt);
  fprintf(stderr, "cycle: %llu spills, %llu unspills, %d device_free, %d host syncs\n",
          (unsigned long long)st.spill_count, (unsigned long long)st.unspill_count, frees, syncs);
  CHECK_GE(st.spill_count, 6);
  CHECK_GE(st.unspill_count, 6);
  CHECK_EQ(frees, 0);
  CHECK_EQ(syncs, 0);
  *rt->be = counted_orig;
  /* and the data made it through */
  for (int i = 0; i < 4; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 50 + (uint64_t)i), 0);
  for (int i = 0; i < 6; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* When no free range fits, eviction spills the victim that makes one
 * rather than the least recently used ones that do not help. */
TEST_CASE(eviction_makes_a_contiguous_range) {
  /* 4 MiB limit: two 2 MiB slabs of 1 MiB buffers a b | c d */
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t h[4];
  void *dev[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 70 + (uint64_t)i);
    REQUIRE_OK(dmem_buffer_lock(rt, h[i], NULL, &dev[i]));
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  /* free c: a hole beside d. LRU order now a, b, d. */
  CHECK_OK(dmem_buffer_free(rt, h[2]));
  void *p;
  for (int i = 0; i < 4; i++) {
    if (i == 2) continue;
    REQUIRE_OK(dmem_buffer_lock(rt, h[i], NULL, &p));
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  /* which blocks neighbour each other is the pool's business: find the
   * buffer whose block is next to the hole */
  int beside = -1;
  for (int i = 0; i < 4; i++)
    if (i != 2 && ((char *)dev[i] + MiB == (char *)dev[2] || (char *)dev[2] + MiB == (char *)dev[i]))
      beside = i;
  REQUIRE_TRUE(beside >= 0);
  dmem_stats_t s0 = stats_of(rt);
  dmem_handle_t x;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &x));
  dmem_stats_t s1 = stats_of(rt);
  /* plain LRU would have spilled a and b (2 MiB, and not even adjacent to
   * each other's free neighbours in every layout); one 1 MiB victim does */
  CHECK_UEQ(s1.bytes_spilled - s0.bytes_spilled, MiB);
  CHECK_EQ(state_of(rt, h[beside]), DMEM_STATE_DEFERRED_HOST);
  for (int i = 0; i < 4; i++)
    if (i != 2 && i != beside) CHECK_EQ(state_of(rt, h[i]), DMEM_STATE_RESIDENT);
  for (int i = 0; i < 4; i++)
    if (i != 2) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 70 + (uint64_t)i), 0);
  for (int i = 0; i < 4; i++)
    if (i != 2) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_buffer_free(rt, x));
  dmem_runtime_destroy(rt);
}

/* ---- stream-ordered reuse across streams, through the runtime ------------- */

typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int open;
  atomic_int order; /* sequence of host functions that ran */
  int ran_a, ran_b;
} gate_t;

static void gate_wait(void *arg) { /* on stream A: blocks until opened */
  gate_t *g = arg;
  pthread_mutex_lock(&g->mu);
  while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
  g->ran_a = atomic_fetch_add(&g->order, 1) + 1;
}
static void gate_init(gate_t *g) {
  memset(g, 0, sizeof *g);
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
}
static void gate_open(gate_t *g) {
  pthread_mutex_lock(&g->mu);
  g->open = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}
static void mark_b(void *arg) {
  gate_t *g = arg;
  g->ran_b = atomic_fetch_add(&g->order, 1) + 1;
}

TEST_CASE(raw_block_freed_on_one_stream_ordered_for_another) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_stream_t a, b;
  REQUIRE_OK(dmem_stream_create(rt, &a));
  REQUIRE_OK(dmem_stream_create(rt, &b));
  gate_t g;
  gate_init(&g);
  void *p = NULL, *q = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, a, &p));
  /* stream A is still "using" p (blocked), then frees it */
  REQUIRE_OK(dmem_stream_enqueue_host(rt, a, gate_wait, &g));
  CHECK_OK(dmem_device_free(rt, p, a));
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, b, &q));
  REQUIRE_OK(dmem_stream_enqueue_host(rt, b, mark_b, &g));
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL);
  if (q == p) CHECK_EQ(g.ran_b, 0); /* the same block: B waits for A's free */
  gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, a));
  CHECK_OK(dmem_stream_synchronize(rt, b));
  if (q == p) CHECK_TRUE(g.ran_a < g.ran_b);
  CHECK_OK(dmem_device_free(rt, q, b));
  /* same stream: reused at once, in order */
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, a, &p));
  CHECK_OK(dmem_device_free(rt, p, a));
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, a, &q));
  CHECK_TRUE(q == p);
  CHECK_OK(dmem_device_free(rt, q, a));
  /* a stream the caller made and destroys itself is forgotten first */
  CHECK_OK(dmem_stream_forget(rt, b));
  CHECK_OK(dmem_stream_forget(rt, NULL)); /* no-op */
  CHECK_STATUS(dmem_stream_forget(NULL, b), DMEM_ERR_INVALID_ARGUMENT);
  void *r2 = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, a, &r2));
  CHECK_OK(dmem_device_free(rt, r2, a));
  CHECK_OK(dmem_stream_destroy(rt, a));
  CHECK_OK(dmem_stream_destroy(rt, b));
  dmem_runtime_destroy(rt);
}

/* ---- threads ---------------------------------------------------------------- */

typedef struct worker {
  dmem_runtime_t *rt;
  dmem_stream_t s;
  bool dedicated; /* dmem_device_malloc_dedicated for every other block */
  int id;
  int bad;
  int failed;
} worker_t;

static void *raw_worker(void *arg) {
  worker_t *w = arg;
  void *ptrs[16] = {0};
  size_t sizes[16] = {0};
  uint64_t x = 0x1234567ull + (uint64_t)w->id;
  for (int it = 0; it < 1500; it++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    int k = (int)(x % 16);
    if (ptrs[k]) {
      uint64_t seed = (uint64_t)(uintptr_t)ptrs[k] ^ (uint64_t)w->id;
      if (raw_bad(w->rt, ptrs[k], sizes[k], seed, w->s)) w->bad++;
      if (dmem_device_free(w->rt, ptrs[k], w->s) != DMEM_OK) w->failed++;
      ptrs[k] = NULL;
    } else {
      size_t size = (size_t)256 << (x >> 40) % 13; /* 256 B .. 1 MiB */
      dmem_status_t st = w->dedicated && (x >> 20) % 2
                             ? dmem_device_malloc_dedicated(w->rt, size, w->s, &ptrs[k])
                             : dmem_device_malloc(w->rt, size, w->s, &ptrs[k]);
      if (st != DMEM_OK) {
        w->failed++;
        ptrs[k] = NULL;
        continue;
      }
      sizes[k] = size;
      raw_put(w->rt, ptrs[k], size, (uint64_t)(uintptr_t)ptrs[k] ^ (uint64_t)w->id, w->s);
    }
  }
  for (int k = 0; k < 16; k++)
    if (ptrs[k]) {
      uint64_t seed = (uint64_t)(uintptr_t)ptrs[k] ^ (uint64_t)w->id;
      if (raw_bad(w->rt, ptrs[k], sizes[k], seed, w->s)) w->bad++;
      if (dmem_device_free(w->rt, ptrs[k], w->s) != DMEM_OK) w->failed++;
    }
  return NULL;
}

TEST_CASE(threads_raw_alloc_free_with_checksums) {
  dmem_runtime_t *rt = check_runtime(256 * MiB);
  pthread_t t[8];
  worker_t w[8];
  for (int i = 0; i < 8; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].rt = rt;
    w[i].id = i;
    w[i].dedicated = i >= 4;
    if (i % 2) REQUIRE_OK(dmem_stream_create(rt, &w[i].s)); /* half on the default stream */
    pthread_create(&t[i], NULL, raw_worker, &w[i]);
  }
  for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 8; i++) {
    CHECK_EQ(w[i].bad, 0);
    CHECK_EQ(w[i].failed, 0);
    if (w[i].s) CHECK_OK(dmem_stream_destroy(rt, w[i].s));
  }
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.raw_used, 0);
  CHECK_UEQ(s.device_used, 0);
  dmem_runtime_destroy(rt);
}

/* ---- dedicated blocks (dmem_device_malloc_dedicated) ---------------------------- */

/* Each dedicated block is a backend allocation of its own, starting at the
 * pointer; freed blocks come back for the same rounded size; accounting,
 * bad frees and trim as for pool blocks. */
TEST_CASE(dedicated_blocks_are_whole_backend_allocations) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  const size_t sizes[] = {40, 4 * KiB, 3 * MiB + 5};
  void *p[3];
  for (int i = 0; i < 3; i++) {
    REQUIRE_OK(dmem_device_malloc_dedicated(rt, sizes[i], NULL, &p[i]));
    CHECK_UEQ((uintptr_t)p[i] % 256, 0);
    void *base = NULL, *slab = NULL;
    size_t bsize = 0, off = 0;
    REQUIRE_OK(dmem__blocks_find(rt->blocks, (char *)p[i] + sizes[i] - 1, &base, &bsize));
    CHECK_TRUE(base == p[i]); /* the block starts at the pointer */
    CHECK_GE(bsize, sizes[i]);
    CHECK_LE(bsize, sizes[i] + sizes[i] / 4 + 256);
    CHECK_TRUE(dmem__pool_slab_of(rt->pool, p[i], &slab, &off) != DMEM_OK); /* no slab */
    raw_put(rt, p[i], sizes[i], 30 + (uint64_t)i, NULL);
  }
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 3; j++)
      if (i != j)
        CHECK_TRUE((char *)p[i] + sizes[i] <= (char *)p[j] ||
                   (char *)p[j] + sizes[j] <= (char *)p[i]);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.raw_used, 40 + 4 * KiB + 3 * MiB + 5);
  CHECK_UEQ(s.device_used, s.raw_used);
  CHECK_GE(s.device_reserved, s.raw_used);
  for (int i = 0; i < 3; i++) CHECK_UEQ(raw_bad(rt, p[i], sizes[i], 30 + (uint64_t)i, NULL), 0);
  /* bad frees: inside a block, twice */
  CHECK_STATUS(dmem_device_free(rt, (char *)p[1] + 256, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_UEQ(stats_of(rt).raw_used, s.raw_used);
  CHECK_OK(dmem_device_free(rt, p[1], NULL));
  CHECK_STATUS(dmem_device_free(rt, p[1], NULL), DMEM_ERR_INVALID_ARGUMENT);
  /* the same size again: the cached block, no new backend allocation */
  uint64_t misses = stats_of(rt).pool_misses;
  void *again = NULL;
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 4 * KiB, NULL, &again));
  CHECK_TRUE(again == p[1]);
  CHECK_UEQ(stats_of(rt).pool_misses, misses);
  /* a pool block never lands inside a dedicated one */
  void *q = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 4 * KiB, NULL, &q));
  for (int i = 0; i < 3; i++)
    CHECK_TRUE((char *)q + 4 * KiB <= (char *)p[i] || (char *)p[i] + sizes[i] <= (char *)q);
  CHECK_OK(dmem_device_free(rt, q, NULL));
  CHECK_OK(dmem_device_free(rt, again, NULL));
  CHECK_OK(dmem_device_free(rt, p[0], NULL));
  CHECK_OK(dmem_device_free(rt, p[2], NULL));
  s = stats_of(rt);
  CHECK_UEQ(s.raw_used, 0);
  CHECK_UEQ(s.device_used, 0);
  CHECK_GT(s.device_reserved, 0); /* cached blocks, pool slab */
  size_t released = 0;
  CHECK_OK(dmem_device_trim(rt, 0, &released));
  CHECK_UEQ(released, s.device_reserved);
  CHECK_UEQ(stats_of(rt).device_reserved, 0);
  CHECK_STATUS(dmem_device_malloc_dedicated(rt, 0, NULL, &q), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_malloc_dedicated(rt, 16, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_malloc_dedicated(NULL, 16, NULL, &q), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_malloc_dedicated(rt, 65 * MiB, NULL, &q), DMEM_ERR_OUT_OF_MEMORY);
  dmem_runtime_destroy(rt);
}

/* A dedicated block freed on stream A and taken by stream B: B waits for
 * A's last use (an event, no host wait); the stream's own blocks come back
 * at once; a stream forgotten before destroy leaves its cached blocks
 * usable. */
TEST_CASE(dedicated_block_freed_on_one_stream_ordered_for_another) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_stream_t a, b;
  REQUIRE_OK(dmem_stream_create(rt, &a));
  REQUIRE_OK(dmem_stream_create(rt, &b));
  gate_t g;
  gate_init(&g);
  void *p = NULL, *q = NULL;
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 64 * KiB, a, &p));
  REQUIRE_OK(dmem_stream_enqueue_host(rt, a, gate_wait, &g));
  CHECK_OK(dmem_device_free(rt, p, a));
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 64 * KiB, b, &q));
  CHECK_TRUE(q == p); /* the only cached block of that size */
  REQUIRE_OK(dmem_stream_enqueue_host(rt, b, mark_b, &g));
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL);
  CHECK_EQ(g.ran_b, 0); /* B waits for A */
  gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, a));
  CHECK_OK(dmem_stream_synchronize(rt, b));
  CHECK_TRUE(g.ran_a < g.ran_b);
  CHECK_OK(dmem_device_free(rt, q, b));
  /* forgotten, then destroyed: its cached block is still handed out */
  CHECK_OK(dmem_stream_destroy(rt, b));
  void *r = NULL;
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 64 * KiB, a, &r));
  CHECK_TRUE(r == p);
  raw_put(rt, r, 64 * KiB, 5, a);
  CHECK_UEQ(raw_bad(rt, r, 64 * KiB, 5, a), 0);
  CHECK_OK(dmem_device_free(rt, r, a));
  CHECK_OK(dmem_stream_destroy(rt, a));
  dmem_runtime_destroy(rt);
}

/* Dedicated blocks count against the limit: they make spillable buffers
 * spill, whose data stays intact. */
TEST_CASE(dedicated_blocks_force_spills) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t h[6];
  for (int i = 0; i < 6; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 50 + (uint64_t)i);
  }
  void *p = NULL;
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 4 * MiB, NULL, &p));
  dmem_stats_t s = stats_of(rt);
  CHECK_LE(s.device_used, 8 * MiB);
  CHECK_GE(s.spill_count, 2);
  for (int i = 0; i < 6; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 50 + (uint64_t)i), 0);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 6 * MiB, NULL, &p));
  CHECK_OK(dmem_device_free(rt, p, NULL));
  for (int i = 0; i < 6; i++) {
    CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 50 + (uint64_t)i), 0);
    CHECK_OK(dmem_buffer_free(rt, h[i]));
  }
  dmem_runtime_destroy(rt);
}

/* ---- adopting raw allocations as buffers ---------------------------------------- */

static int adopt_events[4]; /* DMEM_EVENT_ALLOC / FREE seen for adopt_seen */
static dmem_handle_t adopt_seen;
static size_t adopt_seen_size;
static void adopt_on_event(void *user, const dmem_event_t *e) {
  (void)user;
  if (e->kind > DMEM_EVENT_FREE) return;
  if (e->kind == DMEM_EVENT_ALLOC) {
    adopt_seen = e->handle;
    adopt_seen_size = e->size;
  }
  if (e->handle == adopt_seen) adopt_events[e->kind]++;
}

/* A raw block becomes a locked buffer at the same address with the same
 * bytes; the bytes move from raw to buffer accounting; unlocked, it spills
 * to host and disk and comes back intact; freed, nothing stays charged. */
TEST_CASE(adopt_keeps_bytes_and_address_then_spills_like_a_buffer) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.on_event = adopt_on_event;
  REQUIRE_OK(dmem_controller_set(rt, &c));
  const size_t n = MiB + 40; /* not a multiple of the pool's alignment */
  void *other = NULL, *p = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, NULL, &other)); /* stays raw */
  REQUIRE_OK(dmem_device_malloc(rt, n, NULL, &p));
  raw_put(rt, p, n, 61, NULL);
  dmem_stats_t s0 = stats_of(rt);
  CHECK_UEQ(s0.raw_used, 64 * KiB + n);
  CHECK_UEQ(s0.buffer_count, 0);
  size_t free0 = 0, total = 0;
  CHECK_OK(dmem_device_memory_info(rt, &free0, &total));

  dmem_handle_t h = 0;
  REQUIRE_OK(dmem_device_adopt(rt, p, NULL, &h));
  CHECK_TRUE(h != 0);
  CHECK_TRUE(adopt_seen == h);
  CHECK_UEQ(adopt_seen_size, n);
  CHECK_EQ(adopt_events[DMEM_EVENT_ALLOC], 1);
  dmem_buffer_info_t info;
  REQUIRE_OK(dmem_buffer_info(rt, h, &info));
  CHECK_UEQ(info.size, n);
  CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
  CHECK_EQ(info.lock_count, 1); /* locked once, as dmem_buffer_lock leaves it */
  CHECK_TRUE(!info.pinned);
  void *q = NULL;
  REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &q));
  CHECK_TRUE(q == p); /* same address: no copy */
  CHECK_UEQ(raw_bad(rt, q, n, 61, NULL), 0);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  dmem_stats_t s1 = stats_of(rt);
  CHECK_UEQ(s1.raw_used, 64 * KiB);           /* the block left the raw bytes */
  CHECK_UEQ(s1.buffer_count, 1);              /* ... for the buffers' */
  CHECK_UEQ(s1.device_used, s0.device_used);  /* counted once, not twice */
  CHECK_UEQ(s1.device_locked, n);
  CHECK_UEQ(s1.device_reserved, s0.device_reserved);
  size_t fr = 0;
  CHECK_OK(dmem_device_memory_info(rt, &fr, NULL));
  CHECK_UEQ(fr, free0); /* locked: no more obtainable than as raw memory */
  /* locked: not spillable; it is no raw allocation any more */
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  CHECK_STATUS(dmem_device_free(rt, p, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_UEQ(stats_of(rt).raw_used, 64 * KiB);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);

  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_STATUS(dmem_buffer_unlock(rt, h), DMEM_ERR_NOT_LOCKED);
  CHECK_OK(dmem_device_memory_info(rt, &fr, NULL));
  CHECK_UEQ(fr, free0 + n); /* unlocked: spillable, so obtainable */
  CHECK_UEQ(stats_of(rt).device_locked, 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  dmem_stats_t s2 = stats_of(rt);
  CHECK_UEQ(s2.device_used, 64 * KiB);
  CHECK_UEQ(s2.host_used, n);
  CHECK_UEQ(check_bad_bytes(rt, h, n, 61), 0); /* back through a lock */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_DISK);
  CHECK_UEQ(stats_of(rt).disk_used, n);
  CHECK_OK(dmem_buffer_unspill(rt, h, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, n, 61), 0);

  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_EQ(adopt_events[DMEM_EVENT_FREE], 1);
  dmem_stats_t s3 = stats_of(rt);
  CHECK_UEQ(s3.device_used, 64 * KiB); /* back to the start but for the other block */
  CHECK_UEQ(s3.raw_used, 64 * KiB);
  CHECK_UEQ(s3.buffer_count, 0);
  CHECK_UEQ(s3.host_used + s3.disk_used, 0);
  CHECK_OK(dmem_device_free(rt, other, NULL));
  CHECK_UEQ(stats_of(rt).device_used, 0);
  /* the block went back to the pool: the same size again needs no new slab */
  uint64_t misses = stats_of(rt).pool_misses;
  REQUIRE_OK(dmem_device_malloc(rt, n, NULL, &p));
  CHECK_UEQ(stats_of(rt).pool_misses, misses);
  CHECK_OK(dmem_device_free(rt, p, NULL));
  dmem_runtime_destroy(rt);
}

/* Everything that is not the start of a live pool block of this runtime is
 * refused, and nothing changes: the block stays raw, the stats stay. */
TEST_CASE(adopt_refuses_what_is_not_an_adoptable_raw_block) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  void *p = NULL, *d = NULL, *gone = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, NULL, &p));
  REQUIRE_OK(dmem_device_malloc_dedicated(rt, 64 * KiB, NULL, &d));
  REQUIRE_OK(dmem_device_malloc(rt, 32 * KiB, NULL, &gone));
  REQUIRE_OK(dmem_device_free(rt, gone, NULL));
  raw_put(rt, p, 64 * KiB, 62, NULL);
  raw_put(rt, d, 64 * KiB, 63, NULL);
  dmem_stats_t before = stats_of(rt);
  dmem_handle_t h = 77;
  int stack_var = 0;
  CHECK_STATUS(dmem_device_adopt(NULL, p, NULL, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_adopt(rt, p, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_adopt(rt, NULL, NULL, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_adopt(rt, &stack_var, NULL, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "not a live") != NULL);
  CHECK_STATUS(dmem_device_adopt(rt, (char *)p + 256, NULL, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_device_adopt(rt, gone, NULL, &h), DMEM_ERR_INVALID_ARGUMENT); /* freed */
  CHECK_STATUS(dmem_device_adopt(rt, d, NULL, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "dedicated") != NULL);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "cannot be adopted") != NULL);
  dmem_runtime_t *rt2 = check_runtime(16 * MiB); /* another runtime's pointer */
  CHECK_STATUS(dmem_device_adopt(rt2, p, NULL, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_UEQ(stats_of(rt2).buffer_count, 0);
  dmem_runtime_destroy(rt2);
  CHECK_UEQ(h, 77); /* never written on failure */
  dmem_stats_t after = stats_of(rt);
  CHECK_UEQ(after.raw_used, before.raw_used);
  CHECK_UEQ(after.device_used, before.device_used);
  CHECK_UEQ(after.buffer_count, 0);
  /* adopted once, then never again */
  REQUIRE_OK(dmem_device_adopt(rt, p, NULL, &h));
  dmem_handle_t h2 = 78;
  CHECK_STATUS(dmem_device_adopt(rt, p, NULL, &h2), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_UEQ(h2, 78);
  CHECK_UEQ(stats_of(rt).buffer_count, 1);
  /* the refused blocks are intact and still raw */
  CHECK_UEQ(raw_bad(rt, d, 64 * KiB, 63, NULL), 0);
  CHECK_OK(dmem_device_free(rt, d, NULL));
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_UEQ(check_bad_bytes(rt, h, 64 * KiB, 62), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_STATUS(dmem_device_adopt(rt, p, NULL, &h2), DMEM_ERR_INVALID_ARGUMENT); /* freed buffer */
  dmem_stats_t end = stats_of(rt);
  CHECK_UEQ(end.device_used, 0);
  CHECK_UEQ(end.raw_used, 0);
  CHECK_UEQ(end.buffer_count, 0);
  dmem_runtime_destroy(rt);
}

/* Work enqueued on the raw block's stream before the adopt orders a locker
 * on another stream after it (an event, no host wait). */
TEST_CASE(adopted_buffer_orders_other_streams_after_the_raw_stream) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_stream_t a, b;
  REQUIRE_OK(dmem_stream_create(rt, &a));
  REQUIRE_OK(dmem_stream_create(rt, &b));
  gate_t g;
  gate_init(&g);
  void *p = NULL, *q = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, a, &p));
  REQUIRE_OK(dmem_stream_enqueue_host(rt, a, gate_wait, &g)); /* A still "writes" p */
  dmem_handle_t h = 0;
  REQUIRE_OK(dmem_device_adopt(rt, p, a, &h));
  REQUIRE_OK(dmem_buffer_lock(rt, h, b, &q)); /* a second locker, on B */
  CHECK_TRUE(q == p);
  REQUIRE_OK(dmem_stream_enqueue_host(rt, b, mark_b, &g));
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL);
  CHECK_EQ(g.ran_b, 0); /* B waits for A's work */
  gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, b));
  CHECK_TRUE(g.ran_a > 0 && g.ran_a < g.ran_b);
  CHECK_OK(dmem_stream_synchronize(rt, a));
  CHECK_OK(dmem_buffer_unlock(rt, h));
  /* freed while the adopter still holds its lock: reclaimed at its unlock */
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_UEQ(stats_of(rt).device_used, 64 * KiB);
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &q), DMEM_ERR_STALE_HANDLE);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_UEQ(stats_of(rt).device_used, 0);
  CHECK_UEQ(stats_of(rt).buffer_count, 0);
  CHECK_OK(dmem_stream_destroy(rt, a));
  CHECK_OK(dmem_stream_destroy(rt, b));
  dmem_runtime_destroy(rt);
}

/* ---- the default runtime and the PyTorch symbols ------------------------------ */

TEST_CASE(default_runtime_and_torch_symbols) {
  setenv("DMEM_BACKEND", "host", 1);
  dmem_runtime_t *a = NULL, *b = NULL;
  REQUIRE_OK(dmem_runtime_default(0, &a));
  REQUIRE_OK(dmem_runtime_default(0, &b));
  CHECK_TRUE(a == b);
  CHECK_STATUS(dmem_runtime_default(-1, &b), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_runtime_default(64, &b), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_runtime_default(0, NULL), DMEM_ERR_INVALID_ARGUMENT);
  void *p = dmem_torch_alloc(1000, 0, NULL);
  REQUIRE_TRUE(p != NULL);
  CHECK_UEQ(stats_of(a).raw_used, 1000);
  raw_put(a, p, 1000, 3, NULL);
  CHECK_UEQ(raw_bad(a, p, 1000, 3, NULL), 0);
  void *z = dmem_torch_alloc(0, 0, NULL); /* empty tensors */
  CHECK_TRUE(z != NULL);
  dmem_torch_free(z, 0, 0, NULL);
  dmem_torch_free(p, 1000, 0, NULL);
  CHECK_UEQ(stats_of(a).raw_used, 0);
  dmem_torch_free(p, 1000, 0, NULL); /* a double free is reported, not a crash */
  CHECK_TRUE(dmem_torch_alloc((size_t)1 << 62, 0, NULL) == NULL);
  /* the C API and the torch symbols share the accounting */
  void *q = NULL;
  REQUIRE_OK(dmem_device_malloc(a, 4096, NULL, &q));
  dmem_torch_free(q, 4096, 0, NULL);
  CHECK_UEQ(stats_of(a).raw_used, 0);
  unsetenv("DMEM_BACKEND");
}

/* configure before the first use sets the default runtimes' limits; after
 * it, BUSY and nothing changes. */
TEST_CASE(default_runtime_configure_before_first_use) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = 64 * MiB;
  cfg.device_limit = 3 * MiB;
  cfg.device = 7; /* ignored: each device gets its own ordinal */
  char dir[512], saved[512];
  check_mkdtemp(dir, sizeof dir, "dmem-cfg-");
  memcpy(saved, dir, sizeof dir);
  cfg.spill_dir = dir;
  dmem_config_t bad = cfg;
  bad.struct_size = 8;
  CHECK_STATUS(dmem_runtime_default_configure(&bad), DMEM_ERR_INVALID_ARGUMENT);
  REQUIRE_OK(dmem_runtime_default_configure(&cfg));
  memset(dir, 'x', strlen(dir)); /* the runtime must have copied the string */
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(dmem_runtime_default(0, &rt));
  CHECK_UEQ(stats_of(rt).device_limit, 3 * MiB);
  CHECK_EQ(dmem_runtime_backend(rt), DMEM_BACKEND_HOST);
  void *p = NULL;
  CHECK_STATUS(dmem_device_malloc(rt, 4 * MiB, NULL, &p), DMEM_ERR_OUT_OF_MEMORY);
  dmem_config_t other = cfg;
  other.device_limit = 5 * MiB;
  CHECK_STATUS(dmem_runtime_default_configure(&other), DMEM_ERR_BUSY);
  CHECK_STATUS(dmem_runtime_default_configure(NULL), DMEM_ERR_BUSY);
  dmem_runtime_t *rt1 = NULL;
  REQUIRE_OK(dmem_runtime_default(1, &rt1)); /* another device: the same configuration */
  CHECK_TRUE(rt1 != rt);
  CHECK_UEQ(stats_of(rt1).device_limit, 3 * MiB);
  CHECK_EQ(rmdir(saved), 0); /* nothing left in it */
}

/* A forked child does not inherit the parent's default runtime (its threads
 * are gone): it gets its own, which works. */
TEST_CASE(default_runtime_fresh_in_forked_child) {
#if defined(__SANITIZE_THREAD__)
  SKIP("ThreadSanitizer does not support threads started after a multi-threaded fork");
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
  SKIP("ThreadSanitizer does not support threads started after a multi-threaded fork");
#endif
#endif
  setenv("DMEM_BACKEND", "host", 1);
  setenv("DMEM_HOST_CAPACITY", "64M", 1);
  dmem_runtime_t *parent = NULL;
  REQUIRE_OK(dmem_runtime_default(0, &parent));
  void *p = dmem_torch_alloc(4096, 0, NULL);
  REQUIRE_TRUE(p != NULL);
  pid_t pid = fork();
  REQUIRE_TRUE(pid >= 0);
  if (pid == 0) {
    dmem_runtime_t *child = NULL;
    int bad = dmem_runtime_default(0, &child) != DMEM_OK || child == parent;
    void *q = NULL;
    bad |= dmem_device_malloc(child, 1000, NULL, &q) != DMEM_OK;
    bad |= stats_of(child).raw_used != 1000;
    bad |= dmem_device_free(child, q, NULL) != DMEM_OK;
    _exit(bad);
  }
  int status = 0;
  REQUIRE_TRUE(waitpid(pid, &status, 0) == pid);
  CHECK_TRUE(WIFEXITED(status));
  CHECK_EQ(WEXITSTATUS(status), 0);
  dmem_runtime_t *again = NULL;
  REQUIRE_OK(dmem_runtime_default(0, &again));
  CHECK_TRUE(again == parent);
  CHECK_UEQ(stats_of(parent).raw_used, 4096);
  dmem_torch_free(p, 4096, 0, NULL);
  unsetenv("DMEM_BACKEND");
  unsetenv("DMEM_HOST_CAPACITY");
}

/* ---- the allocator's own cost on the host backend -------------------------------- */

static double pair_ns(dmem_runtime_t *rt, size_t size, int n) {
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < n; i++) {
    void *p;
    if (dmem_device_malloc(rt, size, NULL, &p) != DMEM_OK) abort();
    if (dmem_device_free(rt, p, NULL) != DMEM_OK) abort();
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / n;
}

/* ns per malloc(4 KiB) + free pair: the same-run baseline of raw_pair_cost
 * (a loaded machine slows both alike). */
static double malloc_pair_ns(long n) {
  double best = 1e9;
  for (int r = 0; r < 5; r++) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) {
      void *volatile q = malloc(4 * KiB);
      free(q);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double v = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
    if (v < best) best = v;
  }
  return best;
}

/* The 4 KiB raw pair, checked against 10 times a malloc+free pair of the
 * same run (measured 3.4-4.4x on the loaded 2-core CI machine), and against
 * 150 ns only with DMEM_CHECK_TIMING=1 (an idle machine). */
TEST_CASE(raw_pair_cost) {
  dmem_runtime_t *rt = check_runtime(256 * MiB);
  (void)pair_ns(rt, 4 * KiB, 10000); /* warm */
  double best0 = 1e9, best1 = 1e9;
  for (int r = 0; r < 5; r++) {
    double v = pair_ns(rt, 4 * KiB, 100000);
    if (v < best0) best0 = v;
  }
  void **live = calloc(1000, sizeof *live);
  for (int i = 0; i < 1000; i++) REQUIRE_OK(dmem_device_malloc(rt, 256 << (i % 10), NULL, &live[i]));
  for (int r = 0; r < 5; r++) {
    double v = pair_ns(rt, 4 * KiB, 100000);
    if (v < best1) best1 = v;
  }
  for (int i = 0; i < 1000; i++) CHECK_OK(dmem_device_free(rt, live[i], NULL));
  free(live);
  double base = malloc_pair_ns(100000);
  fprintf(stderr,
          "4 KiB raw alloc+free pair: %.1f ns, %.1f ns with 1000 live blocks; malloc+free "
          "pair %.1f ns (%.2fx, %.2fx)\n",
          best0, best1, base, best0 / base, best1 / base);
  CHECK_LE(best0, 10 * base);
  CHECK_LE(best1, 10 * base);
  const char *strict = getenv("DMEM_CHECK_TIMING");
  if (strict && strcmp(strict, "1") == 0) {
    CHECK_LE(best0, 150);
    CHECK_LE(best1, 150);
  }
  dmem_runtime_destroy(rt);
}
