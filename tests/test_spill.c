/* Spilling: explicit moves between tiers, eviction policy, on-demand
 * spilling, stream-ordered retrieve, cancellation, the disk tier, the host
 * limit, and the controller. */
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

#define MiB ((size_t)1 << 20)

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

static dmem_runtime_t *runtime_with(size_t limit, size_t host_limit, const char *spill_dir) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  if (!getenv("DMEM_SPILL_AHEAD")) cfg.spill_ahead = 0;
  cfg.device_limit = limit;
  cfg.host_limit = host_limit;
  cfg.spill_dir = spill_dir;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) SKIP("no device");
  if (st != DMEM_OK) abort();
  return rt;
}

TEST_CASE(explicit_spill_unspill_tiers) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &h));
  check_put(rt, h, 2 * MiB, 1);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.host_used, 2 * MiB);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST)); /* already there: no-op */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK)); /* host -> disk */
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_DISK);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 2 * MiB);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_INVALID_ARGUMENT); /* disk -> host */
  CHECK_STATUS(dmem_buffer_spill(rt, h, (dmem_tier_t)9), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_buffer_unspill(rt, h, NULL));
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_buffer_unspill(rt, h, NULL)); /* resident: no-op */
  CHECK_UEQ(check_bad_bytes(rt, h, 2 * MiB, 1), 0);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.disk_used, 0);
  CHECK_UEQ(s.device_used, 2 * MiB);
  CHECK_UEQ(s.spill_count, 1);
  CHECK_UEQ(s.unspill_count, 1);
  CHECK_UEQ(s.bytes_spilled, 2 * MiB);
  CHECK_UEQ(s.bytes_unspilled, 2 * MiB);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_UEQ(info.spill_count, 1);
  CHECK_STATUS(dmem_buffer_spill(NULL, h, DMEM_TIER_HOST), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_unspill(NULL, h, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(spill_of_locked_is_busy) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  void *p;
  REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &p));
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_BUSY);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(lock_retrieves_spilled_data) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 3 * MiB, 0, &h));
  check_put(rt, h, 3 * MiB, 42);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB, 42), 0);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB, 42), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* Stream-ordered retrieve: a "kernel" enqueued right after the lock on the
 * same stream sees the retrieved bytes, with no host synchronisation. */
typedef struct {
  const unsigned char *dev;
  size_t n;
  uint64_t seed;
  size_t bad;
} checker_t;

static void check_kernel(void *arg) {
  checker_t *c = arg;
  c->bad = check_verify(c->dev, c->n, c->seed);
}

static dmem_status_t launch_checker(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)n;
  checker_t *c = user;
  c->dev = ptrs[0];
  return dmem_stream_enqueue_host(*(dmem_runtime_t **)((char *)user + sizeof *c), s, check_kernel, c);
}

TEST_CASE(stream_ordered_retrieve) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  struct {
    checker_t c;
    dmem_runtime_t *rt;
  } arg;
  for (int round = 0; round < 20; round++) {
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, 8 * MiB, 0, &h));
    check_put(rt, h, 8 * MiB, 1000 + round);
    CHECK_OK(dmem_buffer_spill(rt, h, round % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST));
    memset(&arg, 0, sizeof arg);
    arg.c.n = 8 * MiB;
    arg.c.seed = 1000 + round;
    arg.c.bad = 1;
    arg.rt = rt;
    CHECK_OK(dmem_launch_async(rt, s, &h, 1, launch_checker, &arg));
    CHECK_OK(dmem_sync_and_unlock(rt, s));
    CHECK_UEQ(arg.c.bad, 0);
    CHECK_OK(dmem_buffer_free(rt, h));
  }
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

TEST_CASE(second_locker_on_other_stream_waits_for_copy) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  dmem_stream_t s1, s2;
  REQUIRE_OK(dmem_stream_create(rt, &s1));
  REQUIRE_OK(dmem_stream_create(rt, &s2));
  for (int round = 0; round < 10; round++) {
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, 16 * MiB, 0, &h));
    check_put(rt, h, 16 * MiB, 7 + round);
    CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
    void *p1, *p2;
    CHECK_OK(dmem_buffer_lock(rt, h, s1, &p1)); /* copy enqueued on s1 */
    CHECK_OK(dmem_buffer_lock(rt, h, s2, &p2)); /* s2 waits on the copy's event */
    checker_t c = {p2, 16 * MiB, 7 + (uint64_t)round, 1};
    CHECK_OK(dmem_stream_enqueue_host(rt, s2, check_kernel, &c));
    CHECK_OK(dmem_stream_synchronize(rt, s2));
    CHECK_UEQ(c.bad, 0);
    CHECK_OK(dmem_stream_synchronize(rt, s1));
    CHECK_OK(dmem_buffer_unlock(rt, h));
    CHECK_OK(dmem_buffer_unlock(rt, h));
    CHECK_OK(dmem_buffer_free(rt, h));
  }
  CHECK_OK(dmem_stream_destroy(rt, s1));
  CHECK_OK(dmem_stream_destroy(rt, s2));
  dmem_runtime_destroy(rt);
}

/* DMEM_EVICTION_LRU: lower priority first, then least recently unlocked,
 * exactly (one thread: its unlocks are in order). */
TEST_CASE(on_demand_spilling_lru_and_priority) {
  dmem_runtime_t *rt = check_runtime_policy(4 * MiB, DMEM_EVICTION_LRU);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, (uint64_t)i);
  }
  /* use order: 2, 0, 3, 1 (1 most recent); 2 gets a high priority */
  int order[4] = {2, 0, 3, 1};
  for (int i = 0; i < 4; i++) {
    void *p;
    CHECK_OK(dmem_buffer_lock(rt, h[order[i]], NULL, &p));
    CHECK_OK(dmem_buffer_unlock(rt, h[order[i]]));
  }
  CHECK_OK(dmem_buffer_set_priority(rt, h[2], 10));
  dmem_handle_t x;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &x)); /* must spill exactly one: h[0] */
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_RESIDENT);
  /* Two more: next h[3], then h[1]; h[2] survives. (One 2 MiB allocation
   * would need a contiguous pool range, which is eviction_makes_a_
   * contiguous_range's subject in test_device.c, not the policy order.) */
  dmem_handle_t y, y2;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y));
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_RESIDENT);
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y2));
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_RESIDENT);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.oom_evictions, 3);
  CHECK_LE(s.device_used, 4 * MiB);
  for (int i = 0; i < 4; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, (uint64_t)i), 0);
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_buffer_free(rt, x));
  CHECK_OK(dmem_buffer_free(rt, y));
  CHECK_OK(dmem_buffer_free(rt, y2));
  dmem_runtime_destroy(rt);
}

/* The default policy (DMEM_EVICTION_REUSE, spill/reuse.c): lower priority
 * first; within a class, buffers not used again since they arrived (cold)
 * by arrival, a cold buffer used again becomes hot instead of going, and
 * between the cold and hot heads the one whose last use the policy saw
 * less recently, in victims taken. */
TEST_CASE(on_demand_spilling_reuse_and_priority) {
  dmem_runtime_t *rt = check_runtime_policy(4 * MiB, DMEM_EVICTION_REUSE);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, (uint64_t)i); /* the arrival's own use */
  }
  /* h[1] and h[3] used again; h[2] gets a high priority */
  for (int i = 1; i < 4; i += 2) {
    void *p;
    CHECK_OK(dmem_buffer_lock(rt, h[i], NULL, &p));
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  CHECK_OK(dmem_buffer_set_priority(rt, h[2], 10));
  dmem_handle_t x, y, y2;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &x)); /* the oldest cold one: h[0] */
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_RESIDENT);
  /* h[1] and h[3] used again after x arrived, at the same tick (1 victim
   * taken): the next pass looks at them (hot) and at x (cold, not used
   * since): cold goes first on a tie */
  for (int i = 1; i < 4; i += 2) {
    void *p;
    CHECK_OK(dmem_buffer_lock(rt, h[i], NULL, &p));
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y));
  CHECK_EQ(state_of(rt, x), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_RESIDENT);
  /* y arrived after 2 victims, h[1] and h[3] were last unlocked after 1:
   * the head of their hot list, h[1], goes */
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y2));
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, y), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_RESIDENT); /* its priority */
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.oom_evictions, 3);
  for (int i = 0; i < 4; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, (uint64_t)i), 0);
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_buffer_free(rt, x));
  CHECK_OK(dmem_buffer_free(rt, y));
  CHECK_OK(dmem_buffer_free(rt, y2));
  dmem_runtime_destroy(rt);
}

/* The default policy: a buffer brought back after a victim was taken (it
 * joins the loop buffers' window) and then used twice is promoted to hot
 * when the policy looks at it, and is still a victim of that same pass.
 * Found by tests/python/test_model.py: dmem_runtime_evict freed nothing while the
 * buffer sat resident and unlocked (the pass looked at the window last and
 * stopped there). */
TEST_CASE(window_buffer_used_again_is_still_a_victim) {
  dmem_runtime_t *rt = check_runtime_policy(4 * MiB, DMEM_EVICTION_REUSE);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 7);
  size_t freed = 0;
  CHECK_OK(dmem_runtime_evict(rt, MiB, &freed));
  CHECK_UEQ(freed, MiB);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  for (int k = 0; k < 2; k++) { /* brought back by the first lock */
    void *p;
    CHECK_OK(dmem_buffer_lock(rt, h, NULL, &p));
    CHECK_OK(dmem_buffer_unlock(rt, h));
  }
  CHECK_OK(dmem_runtime_evict(rt, MiB, &freed));
  CHECK_UEQ(freed, MiB);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 7), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* A loop over more buffers than fit (the default policy): LRU would evict
 * each buffer just before its use, moving every buffer every pass; the
 * default policy keeps most of them, as Belady's MIN does (bench_policy
 * measures it against MIN). 12 buffers, room for 8, 4 passes. */
TEST_CASE(loop_keeps_most_buffers_resident) {
  uint64_t unspills[2] = {0, 0};
  for (int pol = 0; pol < 2; pol++) {
    dmem_runtime_t *rt =
        check_runtime_policy(8 * MiB, pol ? DMEM_EVICTION_LRU : DMEM_EVICTION_REUSE);
    dmem_handle_t h[12];
    for (int pass = 0; pass < 4; pass++)
      for (int i = 0; i < 12; i++) {
        if (pass == 0) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
        check_put(rt, h[i], MiB, (uint64_t)(pass * 16 + i));
      }
    dmem_stats_t s;
    CHECK_OK(dmem_stats(rt, &s));
    unspills[pol] = s.unspill_count;
    for (int i = 0; i < 12; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, (uint64_t)(48 + i)), 0);
    for (int i = 0; i < 12; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
    dmem_runtime_destroy(rt);
  }
  fprintf(stderr, "retrieves: default policy %llu, LRU %llu\n", (unsigned long long)unspills[0],
          (unsigned long long)unspills[1]);
  /* LRU: every use after the first pass brings its buffer back (36
   * retrieves). Belady's MIN: 4 a pass (12). The default policy: 15 (5 a
   * pass), at most 20 allowed. */
  CHECK_UEQ(unspills[1], 36);
  CHECK_LE(unspills[0], 20);
}

/* The fewest loads of `nbuf` buffers with room for `cap`, from the
 * resident set {nbuf - cap, ..., nbuf - 1} (what a fill in order leaves),
 * over `passes` cyclic passes in which each use of buffer i is preceded by
 * a prefetch of i+1..i+depth that is honoured (each prefetch an access:
 * the buffer is resident from then until its use), and (late) buffer i-1
 * still locked after the prefetch: Belady's MIN over that trace (evict the
 * buffer whose next access is farthest away). */
static uint64_t prefetch_loop_min_loads(int nbuf, int cap, int passes, int depth, bool late) {
  int n = passes * nbuf * (depth + 2), k = 0;
  int *ev = malloc((size_t)n * sizeof *ev), *next = malloc((size_t)n * sizeof *next);
  int last[64], up[64];
  bool in[64] = {false};
  for (int p = 0; p < passes; p++)
    for (int i = 0; i < nbuf; i++) {
      for (int d = 1; d <= depth; d++) ev[k++] = (i + d) % nbuf;
      if (late && (p > 0 || i > 0)) ev[k++] = (i + nbuf - 1) % nbuf;
      ev[k++] = i;
    }
  n = k;
  for (int b = 0; b < nbuf; b++) last[b] = n + b; /* never again: past the end */
  for (int i = n - 1; i >= 0; i--) {
    next[i] = last[ev[i]];
    last[ev[i]] = i;
  }
  for (int b = nbuf - cap; b < nbuf; b++) {
    in[b] = true;
    up[b] = last[b];
  }
  uint64_t loads = 0;
  for (int i = 0; i < n; i++) {
    if (!in[ev[i]]) {
      int v = -1;
      for (int b = 0; b < nbuf; b++)
        if (in[b] && (v < 0 || up[b] > up[v])) v = b;
      in[v] = false;
      in[ev[i]] = true;
      loads++;
    }
    up[ev[i]] = next[i];
  }
  free(ev);
  free(next);
  return loads;
}

/* examples/cupy_loop.py's calls, scaled down: 32 buffers, room for 16, 3
 * passes; before each use, a prefetch of the next `depth` on stream ps;
 * then buffer i locked on stream cs, cs synchronised, written, unlocked.
 * order 1: locked before the prefetch, which then evicts while it is
 * locked; order 2: unlocked only after the next prefetch (a Python view
 * whose export dies late). Its retrieves after the fill, under the default
 * policy, to *retrieves_out. */
static void prefetch_loop_retrieves(int depth, int order, uint64_t *retrieves_out) {
  const bool lock_first = order == 1, late = order == 2;
  const size_t sz = 64 << 10;
  dmem_runtime_t *rt = check_runtime_policy(16 * sz, DMEM_EVICTION_REUSE);
  dmem_stream_t cs, ps;
  REQUIRE_OK(dmem_stream_create(rt, &cs));
  REQUIRE_OK(dmem_stream_create(rt, &ps));
  dmem_handle_t h[32];
  for (int i = 0; i < 32; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &h[i]));
    check_put(rt, h[i], sz, (uint64_t)i);
  }
  uint64_t val[32];
  dmem_stats_t s0, s1;
  dmem_handle_t held = 0;
  CHECK_OK(dmem_stats(rt, &s0));
  for (int pass = 0; pass < 3; pass++)
    for (int i = 0; i < 32; i++) {
      dmem_handle_t ahead[4];
      for (int d = 1; d <= depth; d++) ahead[d - 1] = h[(i + d) % 32];
      void *p = NULL;
      if (lock_first) CHECK_OK(dmem_buffer_lock(rt, h[i], cs, &p));
      dmem_status_t st = dmem_buffer_prefetch(rt, ahead, (size_t)depth, ps);
      if (st != DMEM_ERR_OUT_OF_MEMORY) CHECK_OK(st); /* a hint: the lock makes room */
      if (held) CHECK_OK(dmem_buffer_unlock(rt, held));
      held = 0;
      if (!lock_first) CHECK_OK(dmem_buffer_lock(rt, h[i], cs, &p));
      /* the write ("x += 1"): the pass and the buffer, checked at the end */
      val[i] = (uint64_t)(pass + 1) * 100 + (uint64_t)i;
      if (p) CHECK_OK(dmem_stream_copy(rt, p, &val[i], sizeof val[i], cs));
      CHECK_OK(dmem_stream_synchronize(rt, cs));
      if (late) held = h[i];
      else CHECK_OK(dmem_buffer_unlock(rt, h[i]));
    }
  if (held) CHECK_OK(dmem_buffer_unlock(rt, held));
  CHECK_OK(dmem_stream_synchronize(rt, ps));
  CHECK_OK(dmem_stats(rt, &s1));
  for (int i = 0; i < 32; i++) {
    uint64_t x = 0;
    CHECK_OK(dmem_buffer_read(rt, h[i], 0, &x, sizeof x));
    CHECK_UEQ(x, (uint64_t)300 + (uint64_t)i);
    CHECK_OK(dmem_buffer_free(rt, h[i]));
  }
  CHECK_OK(dmem_stream_destroy(rt, ps));
  CHECK_OK(dmem_stream_destroy(rt, cs));
  dmem_runtime_destroy(rt);
  *retrieves_out = s1.unspill_count - s0.unspill_count;
}

/* A loop over twice what fits that prefetches ahead (examples/cupy_loop.py):
 * the best any policy that honours the prefetches can do keeps 16 - depth - 1
 * buffers for the whole loop and cycles the rest through the other places,
 * evicting the buffer just used (Belady's MIN over the trace with each
 * prefetch an access). The default policy brought 1.2-1.5x that many back
 * (it classed some prefetched buffers as cold, evicted prefetched ones
 * before their use, and made a buffer locked during the prefetch's
 * eviction hot); now within 1.1x, whether the prefetch comes before the
 * lock, after it, or before the unlock of the buffer used last. */
TEST_CASE(prefetch_loop_moves_close_to_the_fewest) {
  static const char *const orders[] = {"", " (locked first)", " (unlocked late)"};
  for (int depth = 1; depth <= 4; depth *= 2)
    for (int order = 0; order < 3; order++) {
      uint64_t got = 0;
      prefetch_loop_retrieves(depth, order, &got);
      uint64_t best = prefetch_loop_min_loads(32, 16, 3, depth, order == 2);
      fprintf(stderr, "depth %d%s: %llu retrieves, the fewest %llu\n", depth, orders[order],
              (unsigned long long)got, (unsigned long long)best);
      CHECK_LE(got * 10, best * 11);
    }
}

/* Prefetched buffers are kept from the victims until their use, but only
 * while they hold less than 3/4 of the limit: past that, a prefetch evicts
 * the newest of them (the one needed last), not the buffers in use. Room
 * for 16, 32 buffers used once each (the last 16 resident), then one
 * prefetch of the 16 spilled ones (never locked): 4 of the 16 that were
 * resident stay, and every byte is intact. */
TEST_CASE(prefetch_of_more_than_fits_keeps_a_quarter) {
  const size_t sz = 64 << 10;
  dmem_runtime_t *rt = check_runtime_policy(16 * sz, DMEM_EVICTION_REUSE);
  dmem_handle_t h[32];
  for (int i = 0; i < 32; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &h[i]));
    check_put(rt, h[i], sz, (uint64_t)i);
  }
  dmem_handle_t spilled[32], resident[32];
  size_t n = 0, nres = 0;
  for (int i = 0; i < 32; i++) {
    if (state_of(rt, h[i]) == DMEM_STATE_RESIDENT) resident[nres++] = h[i];
    else spilled[n++] = h[i];
  }
  CHECK_UEQ(n, 16);
  CHECK_OK(dmem_buffer_prefetch(rt, spilled, n, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  int kept = 0, fetched = 0;
  for (size_t i = 0; i < nres; i++) kept += state_of(rt, resident[i]) == DMEM_STATE_RESIDENT;
  for (size_t i = 0; i < n; i++) fetched += state_of(rt, spilled[i]) == DMEM_STATE_RESIDENT;
  fprintf(stderr, "kept %d of %zu, prefetched and resident %d of %zu\n", kept, nres, fetched, n);
  CHECK_EQ(kept, 4);
  CHECK_EQ(fetched, 12);
  for (int i = 0; i < 32; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], sz, (uint64_t)i), 0);
  for (int i = 0; i < 32; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
}

/* Spills plus retrieves of examples/cublas_gemm.c's order under policy pol:
 * C[i][j] = A[i] x B[j] for i, j < 7 (A and B filled first, each C
 * allocated by its product), the next product's A and B prefetched after
 * each product; room for 16 of the 63 tiles. */
static void blas_moves(dmem_eviction_policy_t pol, uint64_t *moves_out) {
  const size_t sz = 64 << 10;
  enum { T = 7 };
  dmem_runtime_t *rt = check_runtime_policy(16 * sz, pol);
  dmem_handle_t A[T], B[T], C[T * T];
  for (int x = 0; x < T; x++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &A[x]));
    check_put(rt, A[x], sz, (uint64_t)x);
  }
  for (int x = 0; x < T; x++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &B[x]));
    check_put(rt, B[x], sz, (uint64_t)(T + x));
  }
  for (int k = 0; k < T * T; k++) {
    void *p;
    dmem_handle_t use[3] = {0, A[k / T], B[k % T]};
    REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &C[k]));
    use[0] = C[k];
    for (int u = 0; u < 3; u++) {
      CHECK_OK(dmem_buffer_lock(rt, use[u], NULL, &p));
      CHECK_OK(dmem_buffer_unlock(rt, use[u]));
    }
    if (k + 1 < T * T) {
      dmem_handle_t next[2] = {A[(k + 1) / T], B[(k + 1) % T]};
      dmem_status_t st = dmem_buffer_prefetch(rt, next, 2, NULL);
      if (st != DMEM_ERR_OUT_OF_MEMORY) CHECK_OK(st);
    }
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  for (int x = 0; x < T; x++) CHECK_UEQ(check_bad_bytes(rt, A[x], sz, (uint64_t)x), 0);
  for (int x = 0; x < T; x++) CHECK_UEQ(check_bad_bytes(rt, B[x], sz, (uint64_t)(T + x)), 0);
  for (int x = 0; x < T; x++) CHECK_OK(dmem_buffer_free(rt, A[x]));
  for (int x = 0; x < T; x++) CHECK_OK(dmem_buffer_free(rt, B[x]));
  for (int k = 0; k < T * T; k++) CHECK_OK(dmem_buffer_free(rt, C[k]));
  dmem_runtime_destroy(rt);
  *moves_out = s.spill_count + s.unspill_count;
}

/* cublas_gemm's order: the A tile that every product of a row uses (and
 * prefetches again right after its use) fits, and the B tiles are used
 * once a row; the C tiles are used once. The default policy must not move
 * more than LRU here (it moved 1.2x LRU's buffers, and a prefetch-aware
 * version that made every prefetched buffer a loop's member evicted the A
 * tile after each product: 2.2x). */
TEST_CASE(prefetch_after_use_keeps_a_buffer_that_fits) {
  uint64_t reuse = 0, lru = 0;
  blas_moves(DMEM_EVICTION_REUSE, &reuse);
  blas_moves(DMEM_EVICTION_LRU, &lru);
  fprintf(stderr, "moved: default policy %llu, LRU %llu\n", (unsigned long long)reuse,
          (unsigned long long)lru);
  CHECK_LE(reuse, lru);
}

/* Retrieves of a tiled C += A * B (8x8 tiles of each, blocked i-j-k order,
 * 3 repetitions; room for 64 of the 192 tiles) under policy pol: to
 * *retrieves_out. */
static void tiled_gemm_retrieves(dmem_eviction_policy_t pol, uint64_t *retrieves_out) {
  const size_t sz = 64 << 10;
  dmem_runtime_t *rt = check_runtime_policy(64 * sz, pol);
  dmem_handle_t h[192];
  bool live[192] = {false};
  for (int r = 0; r < 3; r++)
    for (int i = 0; i < 8; i++)
      for (int j = 0; j < 8; j++)
        for (int k = 0; k < 8; k++) {
          int t[3] = {i * 8 + k, 64 + k * 8 + j, 128 + i * 8 + j}; /* A[i][k], B[k][j], C[i][j] */
          for (int x = 0; x < 3; x++) {
            void *p;
            if (!live[t[x]]) REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &h[t[x]]));
            live[t[x]] = true;
            CHECK_OK(dmem_buffer_lock(rt, h[t[x]], NULL, &p));
            CHECK_OK(dmem_buffer_unlock(rt, h[t[x]]));
          }
        }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  for (int i = 0; i < 192; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
  *retrieves_out = s.unspill_count;
}

/* A tiled GEMM (bench_policy's gemm trace): a row of products needs more
 * than fits (A's row, all of B, a C tile). Belady's MIN keeps A's row and
 * most of B, and drops each C tile and A row once done with them; LRU
 * brings every B tile back for every row. The default policy predicts the
 * finished C tiles and A rows dead (steady short reuse intervals, then
 * idle past twice them), keeps the B tiles it has (back's newest first),
 * and takes an A row back for a new burst of uses, not as a loop's member.
 * Before: 1458 retrieves (2.93x MIN's bytes in bench_policy); LRU 1728;
 * MIN 456; now 555 (1.19x). */
TEST_CASE(tiled_gemm_drops_dead_tiles_and_keeps_b) {
  uint64_t reuse = 0, lru = 0;
  tiled_gemm_retrieves(DMEM_EVICTION_REUSE, &reuse);
  tiled_gemm_retrieves(DMEM_EVICTION_LRU, &lru);
  fprintf(stderr, "retrieves: default policy %llu, LRU %llu (MIN 456)\n",
          (unsigned long long)reuse, (unsigned long long)lru);
  CHECK_TRUE(lru >= 1700);
  CHECK_LE(reuse, 600);
}

TEST_CASE(evict_by_policy) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
  size_t freed = 0;
  CHECK_OK(dmem_runtime_evict(rt, MiB + 1, &freed));
  CHECK_UEQ(freed, 2 * MiB);
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST); /* oldest first */
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_runtime_evict(rt, 100 * MiB, &freed)); /* more than there is: frees the rest */
  CHECK_UEQ(freed, 2 * MiB);
  CHECK_OK(dmem_runtime_evict(rt, MiB, NULL));
  CHECK_STATUS(dmem_runtime_evict(NULL, MiB, &freed), DMEM_ERR_INVALID_ARGUMENT);
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
}

/* A spill directory that goes away after dmem_runtime_create checked it. */
static void gone_dir(char *dir, size_t n) {
  snprintf(dir, n, "%s/dmem-gone-XXXXXX", getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(dir)) abort();
}

TEST_CASE(disk_failure_keeps_data) {
  char dir[256];
  gone_dir(dir, sizeof dir);
  dmem_runtime_t *rt = runtime_with(8 * MiB, 0, dir);
  REQUIRE_EQ(rmdir(dir), 0);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 8);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_IO);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "mkdtemp") != NULL);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 8), 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_IO);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 8), 0);
  /* host limit 0 bytes of room and a broken disk: on-demand spilling fails
   * with the I/O error, data intact */
  dmem_runtime_destroy(rt);
  gone_dir(dir, sizeof dir);
  rt = runtime_with(2 * MiB, MiB / 2, dir);
  REQUIRE_EQ(rmdir(dir), 0);
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &h));
  check_put(rt, h, 2 * MiB, 9);
  dmem_handle_t x;
  CHECK_STATUS(dmem_buffer_alloc(rt, MiB, 0, &x), DMEM_ERR_IO);
  CHECK_UEQ(check_bad_bytes(rt, h, 2 * MiB, 9), 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(free_spilled_buffers) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  CHECK_OK(dmem_buffer_spill(rt, a, DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, b, DMEM_TIER_DISK));
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  CHECK_UEQ(s.buffer_count, 0);
  dmem_runtime_destroy(rt);
}

/* ---- controller ------------------------------------------------------------ */

typedef struct {
  dmem_runtime_t *rt;
  pthread_mutex_t mu;
  int events[5];
  size_t last_pressure;
  /* controller tier storage */
  dmem_handle_t keys[64];
  void *vals[64];
  size_t nkv;
  dmem_status_t store_ret, retrieve_ret, select_ret;
  dmem_handle_t victim;  /* select_victims answer, 0: default */
  int select_calls;
  /* cancellation test: lock the buffer from another thread during store */
  int lock_during_store, free_during_store, self_lock_in_store;
  dmem_status_t self_lock_st, self_unspill_st;
  dmem_status_t side_st;
  /* re-entrancy: spill something from the pressure event */
  dmem_handle_t spill_on_pressure;
} ctl_t;

static void on_event(void *user, const dmem_event_t *ev) {
  ctl_t *c = user;
  pthread_mutex_lock(&c->mu);
  c->events[ev->kind]++;
  if (ev->kind == DMEM_EVENT_PRESSURE) c->last_pressure = ev->bytes_needed;
  dmem_handle_t sp = c->spill_on_pressure;
  pthread_mutex_unlock(&c->mu);
  if (ev->kind == DMEM_EVENT_PRESSURE && sp) {
    c->side_st = dmem_buffer_spill(c->rt, sp, DMEM_TIER_HOST); /* calls back into the runtime */
    c->spill_on_pressure = 0;
  }
}

static dmem_status_t select_victims(void *user, size_t need, dmem_handle_t *v, size_t cap,
                                    size_t *n_out) {
  (void)need;
  ctl_t *c = user;
  c->select_calls++;
  if (c->select_ret != DMEM_OK) return c->select_ret;
  if (!c->victim || cap < 1) {
    *n_out = DMEM_VICTIMS_DEFAULT;
    return DMEM_OK;
  }
  v[0] = c->victim;
  *n_out = 1;
  return DMEM_OK;
}

typedef struct {
  ctl_t *c;
  dmem_handle_t h;
} side_arg_t;

static void *lock_unlock_thread(void *arg) {
  side_arg_t *a = arg;
  void *p;
  a->c->side_st = dmem_buffer_lock(a->c->rt, a->h, NULL, &p);
  if (a->c->side_st == DMEM_OK) {
    /* write while the spill's copy is done: the lock cancelled the spill */
    char *tmp = malloc(MiB);
    check_fill(tmp, MiB, 777);
    dmem_stream_copy(a->c->rt, p, tmp, MiB, NULL);
    dmem_stream_synchronize(a->c->rt, NULL);
    free(tmp);
    dmem_buffer_unlock(a->c->rt, a->h);
  }
  return NULL;
}

static dmem_status_t store(void *user, dmem_handle_t h, const void *data, size_t size) {
  ctl_t *c = user;
  if (c->lock_during_store) {
    side_arg_t a = {c, h};
    pthread_t t;
    pthread_create(&t, NULL, lock_unlock_thread, &a);
    pthread_join(t, NULL);
  }
  if (c->free_during_store) c->side_st = dmem_buffer_free(c->rt, h);
  if (c->self_lock_in_store) {
    void *p;
    c->self_lock_st = dmem_buffer_lock(c->rt, h, NULL, &p);
    if (c->self_lock_st == DMEM_OK) dmem_buffer_unlock(c->rt, h);
    c->self_unspill_st = dmem_buffer_unspill(c->rt, h, NULL);
  }
  if (c->store_ret != DMEM_OK) return c->store_ret;
  void *copy = malloc(size);
  memcpy(copy, data, size);
  pthread_mutex_lock(&c->mu);
  c->keys[c->nkv] = h;
  c->vals[c->nkv] = copy;
  c->nkv++;
  pthread_mutex_unlock(&c->mu);
  return DMEM_OK;
}

static dmem_status_t retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  ctl_t *c = user;
  if (c->retrieve_ret != DMEM_OK) return c->retrieve_ret;
  /* a lock of this very buffer from its own retrieve is refused, not a hang */
  void *p;
  if (dmem_buffer_lock(c->rt, h, NULL, &p) != DMEM_ERR_BUSY) return DMEM_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&c->mu);
  for (size_t i = c->nkv; i-- > 0;) {
    if (c->keys[i] == h) {
      memcpy(out, c->vals[i], size);
      free(c->vals[i]);
      c->keys[i] = c->keys[--c->nkv];
      c->vals[i] = c->vals[c->nkv];
      pthread_mutex_unlock(&c->mu);
      return DMEM_OK;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return DMEM_ERR_INVALID_ARGUMENT;
}

static void ctl_init(ctl_t *c, dmem_runtime_t *rt, dmem_controller_t *dc) {
  memset(c, 0, sizeof *c);
  c->rt = rt;
  pthread_mutex_init(&c->mu, NULL);
  memset(dc, 0, sizeof *dc);
  dc->struct_size = sizeof *dc;
  dc->user = c;
  dc->on_event = on_event;
  dc->select_victims = select_victims;
  dc->store = store;
  dc->retrieve = retrieve;
}

static void ctl_fini(ctl_t *c) {
  for (size_t i = 0; i < c->nkv; i++) free(c->vals[i]);
  pthread_mutex_destroy(&c->mu);
}

/* dmem_runtime_destroy tells the controller of every buffer still alive
 * (DMEM_EVENT_FREE), those whose bytes it holds included, and only once for
 * a buffer freed before. */
TEST_CASE(controller_hears_free_of_every_buffer_at_destroy) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t held, other, gone, locked;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &held));
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &other));
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &gone));
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &locked));
  check_put(rt, held, MiB, 5);
  CHECK_OK(dmem_buffer_spill(rt, held, DMEM_TIER_CONTROLLER));
  CHECK_OK(dmem_buffer_spill(rt, other, DMEM_TIER_HOST));
  void *p;
  CHECK_OK(dmem_buffer_lock(rt, locked, NULL, &p));
  CHECK_OK(dmem_buffer_free(rt, gone));
  CHECK_EQ(c.events[DMEM_EVENT_FREE], 1);
  CHECK_UEQ(c.nkv, 1);
  dmem_runtime_destroy(rt);
  CHECK_EQ(c.events[DMEM_EVENT_FREE], 4); /* held, other and locked at destroy */
  ctl_fini(&c);
}

TEST_CASE(controller_events_and_tier) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  CHECK_EQ(c.events[DMEM_EVENT_ALLOC], 1);
  check_put(rt, h, MiB, 21);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  CHECK_EQ(c.events[DMEM_EVENT_SPILL], 1);
  CHECK_UEQ(c.nkv, 1);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.controller_used, MiB);
  /* cannot remove a controller that holds bytes */
  CHECK_STATUS(dmem_controller_set(rt, NULL), DMEM_ERR_BUSY);
  /* a failing retrieve: CALLBACK, bytes stay with the controller */
  c.retrieve_ret = DMEM_ERR_IO;
  void *p;
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_CALLBACK);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  c.retrieve_ret = DMEM_OK;
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 21), 0);
  CHECK_EQ(c.events[DMEM_EVENT_UNSPILL], 1);
  CHECK_UEQ(c.nkv, 0);
  /* host -> controller */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 21), 0);
  /* a failing store: CALLBACK, the buffer stays resident and intact */
  c.store_ret = DMEM_ERR_HOST_OUT_OF_MEMORY;
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER), DMEM_ERR_CALLBACK);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 21), 0);
  c.store_ret = DMEM_OK;
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_EQ(c.events[DMEM_EVENT_FREE], 1);
  CHECK_OK(dmem_controller_set(rt, NULL));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

TEST_CASE(controller_bad_struct) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_controller_t dc;
  memset(&dc, 0, sizeof dc);
  dc.struct_size = 4;
  CHECK_STATUS(dmem_controller_set(rt, &dc), DMEM_ERR_INVALID_ARGUMENT);
  dc.struct_size = sizeof dc;
  dc.store = store;
  CHECK_STATUS(dmem_controller_set(rt, &dc), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_controller_set(NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  dc.store = NULL;
  CHECK_OK(dmem_controller_set(rt, &dc)); /* no callbacks at all is fine */
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 64, 0, &h));
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(controller_selects_victims) {
  dmem_runtime_t *rt = check_runtime(3 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  dc.store = NULL;
  dc.retrieve = NULL;
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h[3];
  for (int i = 0; i < 3; i++) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
  c.victim = h[2]; /* the newest, not what LRU would pick */
  dmem_handle_t x;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &x));
  CHECK_EQ(c.select_calls, 1);
  CHECK_EQ(c.events[DMEM_EVENT_PRESSURE], 1);
  CHECK_UEQ(c.last_pressure, MiB);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_RESIDENT);
  /* a victim that is locked is skipped and the default policy frees the rest */
  void *p;
  CHECK_OK(dmem_buffer_lock(rt, h[1], NULL, &p));
  c.victim = h[1];
  dmem_handle_t y;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y));
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_RESIDENT);
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST);
  CHECK_OK(dmem_buffer_unlock(rt, h[1]));
  /* a failing selection fails the allocation with CALLBACK */
  c.select_ret = DMEM_ERR_INVALID_ARGUMENT;
  dmem_handle_t z;
  CHECK_STATUS(dmem_buffer_alloc(rt, MiB, 0, &z), DMEM_ERR_CALLBACK);
  c.select_ret = DMEM_OK;
  c.victim = 0;
  CHECK_OK(dmem_buffer_alloc(rt, MiB, 0, &z)); /* default policy */
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_buffer_free(rt, x));
  CHECK_OK(dmem_buffer_free(rt, y));
  CHECK_OK(dmem_buffer_free(rt, z));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

TEST_CASE(controller_callback_reenters) {
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  dc.select_victims = NULL;
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t a, b, x;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  c.spill_on_pressure = b; /* the pressure callback spills b itself */
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &x));
  CHECK_OK(c.side_st);
  CHECK_EQ(state_of(rt, b), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, a), DMEM_STATE_RESIDENT); /* nothing else needed spilling */
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_buffer_free(rt, x));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

TEST_CASE(lock_during_spill_cancels_it) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 5);
  /* store runs after the device->host copy, before the commit: another
   * thread locks and writes new data meanwhile */
  c.lock_during_store = 1;
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER), DMEM_ERR_BUSY);
  CHECK_OK(c.side_st);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 777), 0); /* the new data, not the stale copy */
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.cancelled_spills, 1);
  CHECK_UEQ(s.controller_used, 0);
  CHECK_UEQ(s.spill_count, 0);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_UEQ(info.spill_count, 0);
  c.lock_during_store = 0;
  /* and a later spill works and keeps the new data */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 777), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

TEST_CASE(free_during_spill) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  c.free_during_store = 1;
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_OK(c.side_st);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.buffer_count, 0); /* reclaimed by the spiller when it finished */
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.controller_used, 0);
  CHECK_EQ(c.events[DMEM_EVENT_FREE], 1);
  dmem_buffer_info_t info;
  CHECK_STATUS(dmem_buffer_info(rt, h, &info), DMEM_ERR_STALE_HANDLE);
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

TEST_CASE(callback_cannot_move_its_own_buffer) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 31);
  c.self_lock_in_store = 1;
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER)); /* from the device */
  CHECK_STATUS(c.self_lock_st, DMEM_ERR_BUSY);
  CHECK_STATUS(c.self_unspill_st, DMEM_ERR_BUSY);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 31), 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  c.self_lock_st = c.self_unspill_st = DMEM_OK;
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER)); /* from the host tier */
  CHECK_STATUS(c.self_lock_st, DMEM_ERR_BUSY);
  CHECK_STATUS(c.self_unspill_st, DMEM_ERR_BUSY);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

TEST_CASE(victims_already_spilled_are_skipped) {
  /* Regression: a victim that is no longer resident (spilled by someone
   * else) must not count as freed - with a controller naming it every
   * time, the allocation looped forever - nor turn into an
   * INVALID_ARGUMENT from the explicit-move rules. */
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  dc.store = NULL;
  dc.retrieve = NULL;
  CHECK_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t a, b, d;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &d)); /* spills a */
  CHECK_EQ(state_of(rt, a), DMEM_STATE_DEFERRED_HOST);
  void *p;
  CHECK_OK(dmem_buffer_lock(rt, b, NULL, &p));
  CHECK_OK(dmem_buffer_lock(rt, d, NULL, &p));
  c.victim = a; /* already on the host */
  dmem_handle_t x;
  CHECK_STATUS(dmem_buffer_alloc(rt, MiB, 0, &x), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_OK(dmem_buffer_spill(rt, a, DMEM_TIER_DISK));
  CHECK_STATUS(dmem_buffer_alloc(rt, MiB, 0, &x), DMEM_ERR_OUT_OF_MEMORY); /* not INVALID_ARGUMENT */
  CHECK_OK(dmem_buffer_unlock(rt, d));
  CHECK_OK(dmem_buffer_alloc(rt, MiB, 0, &x)); /* the default policy spills d */
  CHECK_EQ(state_of(rt, d), DMEM_STATE_DEFERRED_HOST);
  CHECK_OK(dmem_buffer_unlock(rt, b));
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_buffer_free(rt, d));
  CHECK_OK(dmem_buffer_free(rt, x));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

/* ---- eviction batches (spill/move_out.c, dmem__spill_batch) ------------------------- */

#define KiB ((size_t)1 << 10)
#define NB 200 /* more than three batches of DMEM__SPILL_BATCH_MAX (64) */

/* One dmem_runtime_evict of 200 small buffers: every one is in the host tier
 * afterwards with its own bytes (each is a 64 KiB copy into its own
 * staging, ordered by the batch's one event); dmem_buffer_unspill and
 * dmem_buffer_prefetch bring them back intact. A second eviction right after the
 * prefetch, before any poll, spills buffers whose unspill copy may still
 * be in flight (their staging is reused, ordered after unspill_event), and
 * the data survive that too. */
TEST_CASE(evict_batch_data_intact) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  static dmem_handle_t h[NB];
  const size_t size = 64 * KiB;
  for (int i = 0; i < NB; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h[i]));
    check_put(rt, h[i], size, 1000 + (uint64_t)i);
  }
  size_t freed = 0;
  CHECK_OK(dmem_runtime_evict(rt, NB * size, &freed));
  CHECK_UEQ(freed, NB * size);
  int deferred = 0;
  for (int i = 0; i < NB; i++) deferred += state_of(rt, h[i]) == DMEM_STATE_DEFERRED_HOST;
  CHECK_EQ(deferred, NB);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.spill_count, NB);
  CHECK_UEQ(s.bytes_spilled, NB * size);
  CHECK_UEQ(s.host_used, NB * size);
  CHECK_UEQ(s.device_used, 0);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h[NB - 1], &info));
  CHECK_UEQ(info.spill_count, 1);
  dmem_stream_t st;
  REQUIRE_OK(dmem_stream_create(rt, &st));
  for (int i = 0; i < NB / 2; i++) CHECK_OK(dmem_buffer_unspill(rt, h[i], st));
  CHECK_OK(dmem_buffer_prefetch(rt, h + NB / 2, NB - NB / 2, st));
  CHECK_OK(dmem_stream_synchronize(rt, st));
  /* no poll: the unspill copies' flags and staging are still there */
  CHECK_OK(dmem_runtime_evict(rt, NB * size, &freed));
  CHECK_UEQ(freed, NB * size);
  CHECK_OK(dmem_buffer_prefetch(rt, h, NB, st));
  CHECK_OK(dmem_stream_synchronize(rt, st));
  size_t bad = 0;
  for (int i = 0; i < NB; i++) bad += check_bad_bytes(rt, h[i], size, 1000 + (uint64_t)i);
  CHECK_UEQ(bad, 0);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.spill_count, 2 * NB);
  CHECK_UEQ(s.host_used, 0);
  for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, 0);
  CHECK_OK(dmem_stream_destroy(rt, st));
  dmem_runtime_destroy(rt);
}

/* Victims freed after they were chosen are skipped, and a batch that the
 * host tier (limit 1 MiB) cannot take at once goes one by one, the excess
 * straight to disk (as single spills do); every byte survives and nothing
 * stays charged. */
TEST_CASE(evict_batch_host_limit_goes_one_by_one) {
  dmem_runtime_t *rt = runtime_with(64 * MiB, 1 * MiB, NULL);
  static dmem_handle_t h[64];
  const size_t size = 64 * KiB;
  for (int i = 0; i < 64; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h[i]));
    check_put(rt, h[i], size, 7 + (uint64_t)i);
  }
  for (int i = 0; i < 64; i += 8) CHECK_OK(dmem_buffer_free(rt, h[i]));
  size_t freed = 0;
  CHECK_OK(dmem_runtime_evict(rt, 64 * size, &freed));
  CHECK_UEQ(freed, 56 * size);
  int on_disk = 0, on_host = 0;
  for (int i = 0; i < 64; i++) {
    if (i % 8 == 0) continue;
    dmem_state_t sti = state_of(rt, h[i]);
    on_disk += sti == DMEM_STATE_DEFERRED_DISK;
    on_host += sti == DMEM_STATE_DEFERRED_HOST;
  }
  CHECK_EQ(on_disk + on_host, 56);
  CHECK_TRUE(on_disk > 0);
  size_t bad = 0;
  for (int i = 0; i < 64; i++)
    if (i % 8) bad += check_bad_bytes(rt, h[i], size, 7 + (uint64_t)i);
  CHECK_UEQ(bad, 0);
  for (int i = 0; i < 64; i++)
    if (i % 8) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_stats_t s;
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  CHECK_UEQ(s.device_used, 0);
  dmem_runtime_destroy(rt);
}

/* Locks racing the batches' completion: lockers on two threads lock,
 * check and rewrite random buffers while the main thread evicts them all
 * over and over. A lock that lands on a victim between its copy and the
 * batch's commit cancels that victim alone (it stays resident with the
 * locker's bytes); one that lands after waits on the shared copy event.
 * Every buffer holds its latest bytes at the end, and no byte stays
 * charged to the host tier for a resident buffer. */
#define RB 96
typedef struct race {
  dmem_runtime_t *rt;
  dmem_handle_t h[RB];
  _Atomic uint64_t seed[RB]; /* the buffer's current pattern; owner: the locker */
  pthread_mutex_t mu[RB];    /* one writer per buffer at a time */
  _Atomic int stop;
} race_t;
typedef struct racer {
  race_t *r;
  unsigned rng;
  size_t bad;          /* read after the join */
  _Atomic int locks;   /* read by the main thread while it runs */
} racer_t;

static void *race_locker(void *arg) {
  racer_t *me = arg;
  race_t *r = me->r;
  const size_t size = 16 * KiB;
  void *tmp = malloc(size);
  while (!atomic_load_explicit(&r->stop, memory_order_relaxed)) {
    me->rng = me->rng * 1103515245u + 12345u;
    int i = (int)((me->rng >> 8) % RB);
    pthread_mutex_lock(&r->mu[i]);
    uint64_t seed = atomic_load_explicit(&r->seed[i], memory_order_relaxed);
    void *p;
    dmem_status_t st = dmem_buffer_lock(r->rt, r->h[i], NULL, &p);
    if (st == DMEM_OK) {
      dmem_stream_copy(r->rt, tmp, p, size, NULL);
      dmem_stream_synchronize(r->rt, NULL);
      me->bad += check_verify(tmp, size, seed);
      seed += RB; /* a new pattern, written while locked */
      check_fill(tmp, size, seed);
      dmem_stream_copy(r->rt, p, tmp, size, NULL);
      dmem_stream_synchronize(r->rt, NULL);
      atomic_store_explicit(&r->seed[i], seed, memory_order_relaxed);
      dmem_buffer_unlock(r->rt, r->h[i]);
      atomic_fetch_add_explicit(&me->locks, 1, memory_order_relaxed);
    } else {
      fprintf(stderr, "race lock: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
      me->bad++;
    }
    pthread_mutex_unlock(&r->mu[i]);
  }
  free(tmp);
  return NULL;
}

TEST_CASE(lock_races_evict_batch) {
  static race_t r;
  memset(&r, 0, sizeof r);
  r.rt = check_runtime(64 * MiB);
  const size_t size = 16 * KiB;
  for (int i = 0; i < RB; i++) {
    REQUIRE_OK(dmem_buffer_alloc(r.rt, size, 0, &r.h[i]));
    atomic_store_explicit(&r.seed[i], (uint64_t)i, memory_order_relaxed);
    check_put(r.rt, r.h[i], size, (uint64_t)i);
    pthread_mutex_init(&r.mu[i], NULL);
  }
  racer_t a = {&r, 1, 0, 0}, b = {&r, 2, 0, 0};
  dmem_stream_t st;
  REQUIRE_OK(dmem_stream_create(r.rt, &st));
  pthread_t ta, tb;
  REQUIRE_EQ(pthread_create(&ta, NULL, race_locker, &a), 0);
  REQUIRE_EQ(pthread_create(&tb, NULL, race_locker, &b), 0);
  /* each pass: everything out in batches, then everything back; until both
   * lockers did 300 locks (at most 20 s) */
  size_t total = 0;
  time_t t_end = time(NULL) + 20;
  for (int pass = 0; time(NULL) < t_end; pass++) {
    size_t freed = 0;
    CHECK_OK(dmem_runtime_evict(r.rt, RB * size, &freed));
    total += freed;
    CHECK_OK(dmem_buffer_prefetch(r.rt, r.h, RB, st));
    CHECK_OK(dmem_stream_synchronize(r.rt, st));
    if (pass % 16 == 0) CHECK_OK(dmem_runtime_poll(r.rt));
    if (atomic_load_explicit(&a.locks, memory_order_relaxed) >= 300 &&
        atomic_load_explicit(&b.locks, memory_order_relaxed) >= 300)
      break;
  }
  size_t last = 0;
  CHECK_OK(dmem_runtime_evict(r.rt, RB * size, &last)); /* end with a batch racing them */
  atomic_store_explicit(&r.stop, 1, memory_order_relaxed);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  CHECK_UEQ(a.bad + b.bad, 0);
  int locks = atomic_load_explicit(&a.locks, memory_order_relaxed) +
              atomic_load_explicit(&b.locks, memory_order_relaxed);
  CHECK_TRUE(locks >= 600);
  CHECK_TRUE(total > 0);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(r.rt, &s));
  fprintf(stderr, "lock_races_evict_batch: %d locks, %zu bytes evicted, %llu cancelled spills\n",
          locks, total, (unsigned long long)s.cancelled_spills);
  size_t host = 0;
  for (int i = 0; i < RB; i++) {
    dmem_state_t sti = state_of(r.rt, r.h[i]);
    CHECK_TRUE(sti == DMEM_STATE_RESIDENT || sti == DMEM_STATE_DEFERRED_HOST);
    if (sti == DMEM_STATE_DEFERRED_HOST) host += size;
    dmem_buffer_info_t info;
    CHECK_OK(dmem_buffer_info(r.rt, r.h[i], &info));
    CHECK_UEQ(info.lock_count, 0);
  }
  CHECK_UEQ(s.host_used, host);
  size_t bad = 0;
  for (int i = 0; i < RB; i++)
    bad += check_bad_bytes(r.rt, r.h[i], size, atomic_load_explicit(&r.seed[i], memory_order_relaxed));
  CHECK_UEQ(bad, 0);
  for (int i = 0; i < RB; i++) {
    CHECK_OK(dmem_buffer_free(r.rt, r.h[i]));
    pthread_mutex_destroy(&r.mu[i]);
  }
  CHECK_OK(dmem_stream_destroy(r.rt, st));
  dmem_runtime_destroy(r.rt);
}
