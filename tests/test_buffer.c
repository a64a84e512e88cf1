/* Handle table and buffer life cycle: alloc, free, info, lock, unlock,
 * priorities, and every bad input. */
#include <pthread.h>
#include <stdatomic.h>

#include "check.h"

#define MiB ((size_t)1 << 20)

TEST_CASE(alloc_info_free) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h = 0;
  REQUIRE_OK(dmem_buffer_alloc(rt, 1000, 0, &h));
  CHECK_NE(h, DMEM_HANDLE_NULL);
  dmem_buffer_info_t info;
  memset(&info, 0xCD, sizeof info);
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_UEQ(info.size, 1000);
  CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
  CHECK_EQ(info.lock_count, 0);
  CHECK_EQ(info.pinned, 0);
  CHECK_EQ(info.priority, 0);
  CHECK_UEQ(info.spill_count, 0);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, 1000);
  CHECK_UEQ(s.buffer_count, 1);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.buffer_count, 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(bad_arguments) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h = 77;
  void *p = (void *)0x5;
  dmem_buffer_info_t info;
  CHECK_STATUS(dmem_buffer_alloc(NULL, 10, 0, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, 10, 0, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, 0, 0, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, 10, 0x80, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, SIZE_MAX, 0, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(dmem_buffer_alloc(rt, 17 * MiB, 0, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_EQ(h, 77); /* never written on failure */
  REQUIRE_OK(dmem_buffer_alloc(rt, 10, 0, &h));
  CHECK_STATUS(dmem_buffer_lock(NULL, h, NULL, &p), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_info(rt, h, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_info(NULL, h, &info), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_free(NULL, h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_unlock(NULL, h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_set_priority(NULL, h, 1), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stats(rt, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stats(NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(p == (void *)0x5);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* A handle belongs to the runtime that made it: another runtime's handle,
 * with the same slot number, is stale in this one (generations start at a
 * random value per runtime), and changes nothing there. */
TEST_CASE(handles_of_another_runtime_are_stale) {
  enum { N = 64 };
  dmem_runtime_t *ra = check_runtime(16 * MiB), *rb = check_runtime(16 * MiB);
  dmem_handle_t ha[N], hb[N];
  unsigned char pattern[256], back[256]; /* through dmem_stream_copy: CUDA too */
  memset(pattern, 0x5B, sizeof pattern);
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_buffer_alloc(ra, 256, 0, &ha[i]));
    REQUIRE_OK(dmem_buffer_alloc(rb, 256, 0, &hb[i]));
    void *p;
    REQUIRE_OK(dmem_buffer_lock(rb, hb[i], NULL, &p));
    REQUIRE_OK(dmem_stream_copy(rb, p, pattern, 256, NULL));
    REQUIRE_OK(dmem_stream_synchronize(rb, NULL));
    REQUIRE_OK(dmem_buffer_unlock(rb, hb[i]));
  }
  size_t same = 0;
  for (int i = 0; i < N; i++) {
    same += ha[i] == hb[i];
    CHECK_EQ(ha[i] & 0xFFFFFFFFu, hb[i] & 0xFFFFFFFFu); /* same slots, so only */
    void *p = NULL;                                     /* the generation tells */
    dmem_buffer_info_t info;
    CHECK_STATUS(dmem_buffer_info(rb, ha[i], &info), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_lock(rb, ha[i], NULL, &p), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_spill(rb, ha[i], DMEM_TIER_HOST), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_set_priority(rb, ha[i], 5), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_free(rb, ha[i]), DMEM_ERR_STALE_HANDLE);
  }
  CHECK_UEQ(same, 0);
  for (int i = 0; i < N; i++) { /* b's buffers untouched */
    dmem_buffer_info_t info;
    REQUIRE_OK(dmem_buffer_info(rb, hb[i], &info));
    CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
    CHECK_EQ(info.priority, 0);
    void *p;
    REQUIRE_OK(dmem_buffer_lock(rb, hb[i], NULL, &p));
    REQUIRE_OK(dmem_stream_copy(rb, back, p, 256, NULL));
    REQUIRE_OK(dmem_stream_synchronize(rb, NULL));
    CHECK_TRUE(memcmp(back, pattern, 256) == 0);
    CHECK_OK(dmem_buffer_unlock(rb, hb[i]));
    CHECK_OK(dmem_buffer_free(ra, ha[i]));
    CHECK_OK(dmem_buffer_free(rb, hb[i]));
  }
  dmem_runtime_destroy(ra);
  dmem_runtime_destroy(rb);
}

TEST_CASE(stale_forged_and_zero_handles) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h, h2;
  REQUIRE_OK(dmem_buffer_alloc(rt, 64, 0, &h));
  const dmem_handle_t forged[] = {
      DMEM_HANDLE_NULL,
      h ^ ((dmem_handle_t)1 << 32),       /* right slot, wrong generation */
      (h & 0xFFFFFFFFu),                  /* generation 0 */
      ((dmem_handle_t)1 << 32) | 5000,    /* slot beyond the table */
      ((dmem_handle_t)7 << 32) | 0xFFFFFFFEu, /* slot beyond every chunk */
      ~(dmem_handle_t)0,
  };
  for (size_t i = 0; i < sizeof forged / sizeof forged[0]; i++) {
    void *p = NULL;
    dmem_buffer_info_t info;
    CHECK_STATUS(dmem_buffer_lock(rt, forged[i], NULL, &p), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_unlock(rt, forged[i]), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_free(rt, forged[i]), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_info(rt, forged[i], &info), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_set_priority(rt, forged[i], 3), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_spill(rt, forged[i], DMEM_TIER_HOST), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_unspill(rt, forged[i], NULL), DMEM_ERR_STALE_HANDLE);
  }
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_STATUS(dmem_buffer_free(rt, h), DMEM_ERR_STALE_HANDLE); /* double free */
  /* the slot is reused with a new generation: the old handle never reaches
   * the new buffer */
  REQUIRE_OK(dmem_buffer_alloc(rt, 128, 0, &h2));
  CHECK_EQ(h2 & 0xFFFFFFFFu, h & 0xFFFFFFFFu);
  CHECK_NE(h2, h);
  void *p;
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_free(rt, h), DMEM_ERR_STALE_HANDLE);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h2, &info));
  CHECK_UEQ(info.size, 128);
  CHECK_OK(dmem_buffer_free(rt, h2));
  dmem_runtime_destroy(rt);
}

TEST_CASE(lock_count_and_unlock_without_lock) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &h));
  CHECK_STATUS(dmem_buffer_unlock(rt, h), DMEM_ERR_NOT_LOCKED);
  void *p1, *p2;
  CHECK_OK(dmem_buffer_lock(rt, h, NULL, &p1));
  CHECK_OK(dmem_buffer_lock(rt, h, NULL, &p2));
  CHECK_TRUE(p1 == p2 && p1 != NULL);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 2);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_locked, 4096);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_STATUS(dmem_buffer_unlock(rt, h), DMEM_ERR_NOT_LOCKED);
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 0);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_locked, 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(free_while_locked) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 11);
  void *p, *p2;
  REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &p));
  CHECK_OK(dmem_buffer_lock(rt, h, NULL, &p2));
  CHECK_OK(dmem_buffer_free(rt, h));
  /* stale at once for everything but unlock */
  dmem_buffer_info_t info;
  void *q;
  CHECK_STATUS(dmem_buffer_info(rt, h, &info), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &q), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_free(rt, h), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_STALE_HANDLE);
  /* memory is not reclaimed yet: the locker may still use it */
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, MiB);
  unsigned char *tmp = malloc(MiB);
  CHECK_OK(dmem_stream_copy(rt, tmp, p, MiB, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_UEQ(check_verify(tmp, MiB, 11), 0);
  free(tmp);
  /* even under pressure it is not spilled */
  size_t freed = 1;
  CHECK_OK(dmem_runtime_evict(rt, MiB, &freed));
  CHECK_UEQ(freed, 0);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, MiB);
  CHECK_OK(dmem_buffer_unlock(rt, h)); /* last unlock reclaims */
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_STATUS(dmem_buffer_unlock(rt, h), DMEM_ERR_STALE_HANDLE);
  dmem_runtime_destroy(rt);
}

TEST_CASE(pinned_never_spills) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t pin, other;
  REQUIRE_OK(dmem_buffer_alloc(rt, 3 * MiB, DMEM_ALLOC_PINNED, &pin));
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, pin, &info));
  CHECK_EQ(info.pinned, 1);
  CHECK_STATUS(dmem_buffer_spill(rt, pin, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_pinned, 3 * MiB);
  /* only 1 MiB left and nothing spillable: a 2 MiB allocation fails */
  CHECK_STATUS(dmem_buffer_alloc(rt, 2 * MiB, 0, &other), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_OK(dmem_buffer_info(rt, pin, &info));
  CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_buffer_free(rt, pin));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_pinned, 0);
  CHECK_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &other));
  CHECK_OK(dmem_buffer_free(rt, other));
  dmem_runtime_destroy(rt);
}

TEST_CASE(priority_set_and_read) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 100, 0, &h));
  CHECK_OK(dmem_buffer_set_priority(rt, h, -7));
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.priority, -7);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(many_handles_grow_table) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  enum { N = 10000 }; /* more than two table chunks */
  dmem_handle_t *hs = malloc(N * sizeof *hs);
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 64, 0, &hs[i]));
  for (int i = 0; i < N; i++)
    for (int j = i + 1; j < i + 3 && j < N; j++) CHECK_NE(hs[i], hs[j]);
  for (int i = 0; i < N; i += 2) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  for (int i = 1; i < N; i += 2) {
    dmem_buffer_info_t info;
    CHECK_OK(dmem_buffer_info(rt, hs[i], &info));
  }
  for (int i = 1; i < N; i += 2) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_UEQ(s.device_used, 0);
  free(hs);
  dmem_runtime_destroy(rt);
}

TEST_CASE(destroy_with_live_and_locked_buffers) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t a, b, c;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &c));
  void *p;
  CHECK_OK(dmem_buffer_lock(rt, a, NULL, &p));
  CHECK_OK(dmem_buffer_spill(rt, b, DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, c, DMEM_TIER_DISK));
  dmem_runtime_destroy(rt); /* ASan checks that nothing leaks */
}

/* Lock/unlock from many threads on shared buffers keeps counts exact. */
typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t *hs;
  int n;
} lock_arg_t;

static void *lock_loop(void *arg) {
  lock_arg_t *a = arg;
  for (int it = 0; it < 20000; it++) {
    dmem_handle_t h = a->hs[it % a->n];
    void *p;
    if (dmem_buffer_lock(a->rt, h, NULL, &p) != DMEM_OK) abort();
    if (dmem_buffer_unlock(a->rt, h) != DMEM_OK) abort();
  }
  return NULL;
}

TEST_CASE(concurrent_lock_unlock_counts) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t hs[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 256, 0, &hs[i]));
  lock_arg_t a = {rt, hs, 4};
  pthread_t t[8];
  for (int i = 0; i < 8; i++) pthread_create(&t[i], NULL, lock_loop, &a);
  for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++) {
    dmem_buffer_info_t info;
    CHECK_OK(dmem_buffer_info(rt, hs[i], &info));
    CHECK_EQ(info.lock_count, 0);
    CHECK_STATUS(dmem_buffer_unlock(rt, hs[i]), DMEM_ERR_NOT_LOCKED);
    CHECK_OK(dmem_buffer_free(rt, hs[i]));
  }
  dmem_runtime_destroy(rt);
}

TEST_CASE(data_survives_spill_roundtrip) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 3 * MiB + 17, 0, &h));
  check_put(rt, h, 3 * MiB + 17, 99);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB + 17, 99), 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB + 17, 99), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* ---- dmem_buffer_read: bytes read where they are ---------------------------------- */

/* The counters a read must leave alone. */
typedef struct move_counts {
  uint64_t spills, unspills, bytes_spilled, bytes_unspilled, disk_to_device, cancelled;
  size_t host_used, disk_used, device_used;
} move_counts_t;

static move_counts_t move_counts(dmem_runtime_t *rt) {
  dmem_stats_t s;
  if (dmem_stats(rt, &s) != DMEM_OK) abort();
  return (move_counts_t){s.spill_count,    s.unspill_count, s.bytes_spilled,
                         s.bytes_unspilled, s.disk_to_device_count, s.cancelled_spills,
                         s.host_used,      s.disk_used,     s.device_used};
}

static int counts_same(move_counts_t a, move_counts_t b) {
  return a.spills == b.spills && a.unspills == b.unspills && a.bytes_spilled == b.bytes_spilled &&
         a.bytes_unspilled == b.bytes_unspilled && a.disk_to_device == b.disk_to_device &&
         a.cancelled == b.cancelled && a.host_used == b.host_used && a.disk_used == b.disk_used &&
         a.device_used == b.device_used;
}

/* Read [off, off + n) of h (whose bytes are the pattern in `want`) into a
 * destination that starts `mis` bytes past an aligned address; every byte
 * right, nothing written around the range. */
static size_t read_bad_bytes(dmem_runtime_t *rt, dmem_handle_t h, const unsigned char *want,
                             size_t off, size_t n, size_t mis) {
  unsigned char *dst = malloc(n + mis + 16);
  if (!dst) abort();
  memset(dst, 0xEE, n + mis + 16);
  dmem_status_t st = dmem_buffer_read(rt, h, off, dst + mis, n);
  if (st != DMEM_OK) {
    fprintf(stderr, "dmem_buffer_read(%zu, %zu): %s (%s)\n", off, n, dmem_status_name(st),
            dmem_last_error_detail());
    free(dst);
    return n ? n : 1;
  }
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += dst[mis + i] != want[off + i];
  for (size_t i = 0; i < mis; i++) bad += dst[i] != 0xEE;
  for (size_t i = 0; i < 16; i++) bad += dst[mis + n + i] != 0xEE;
  free(dst);
  return bad;
}

/* Whole and partial ranges, at offsets inside and across 4 KiB blocks and
 * 8 MiB disk chunks, into aligned and unaligned destinations. */
static void check_ranges(dmem_runtime_t *rt, dmem_handle_t h, const unsigned char *want,
                         size_t size) {
  const size_t ranges[][2] = {
      {0, size}, {0, 1}, {size - 1, 1}, {1, 4095}, {4095, 2}, {4096, 4096}, {4097, 8191},
      {12345, 3 * MiB + 7}, {size - 5000, 5000}, {8 * MiB - 3, 6}, {100, size - 200},
  };
  for (size_t k = 0; k < sizeof ranges / sizeof ranges[0]; k++) {
    size_t off = ranges[k][0], n = ranges[k][1];
    if (off > size || n > size - off) continue;
    CHECK_UEQ(read_bad_bytes(rt, h, want, off, n, 0), 0);
    CHECK_UEQ(read_bad_bytes(rt, h, want, off, n, 3), 0);
  }
}

TEST_CASE(read_in_place_each_tier) {
  dmem_runtime_t *rt = check_runtime(32 * MiB);
  const size_t size = 9 * MiB + 123; /* past one disk chunk, not whole blocks */
  unsigned char *want = malloc(size);
  REQUIRE_TRUE(want != NULL);
  check_fill(want, size, 41);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h));
  check_put(rt, h, size, 41);
  const dmem_state_t states[3] = {DMEM_STATE_RESIDENT, DMEM_STATE_DEFERRED_HOST,
                                  DMEM_STATE_DEFERRED_DISK};
  for (int t = 0; t < 3; t++) {
    if (t == 1) REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
    if (t == 2) REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
    dmem_buffer_info_t before, after;
    REQUIRE_OK(dmem_buffer_info(rt, h, &before));
    CHECK_EQ(before.state, states[t]);
    move_counts_t c0 = move_counts(rt);
    dmem_stats_t s0, s1;
    REQUIRE_OK(dmem_stats(rt, &s0));
    check_ranges(rt, h, want, size);
    /* reads from inside a block do not make O_DIRECT fail (EINVAL) and the
     * file go buffered */
    REQUIRE_OK(dmem_stats(rt, &s1));
    CHECK_UEQ(s1.disk_direct_io, s0.disk_direct_io);
    if (t == 2) fprintf(stderr, "disk tier I/O: %s\n", s1.disk_direct_io ? "direct" : "buffered");
    CHECK_OK(dmem_buffer_read(rt, h, size, NULL, 0)); /* empty range at the end */
    REQUIRE_OK(dmem_buffer_info(rt, h, &after));
    CHECK_EQ(after.state, states[t]);
    CHECK_EQ(after.lock_count, 0);
    CHECK_UEQ(after.spill_count, before.spill_count);
    CHECK_TRUE(counts_same(c0, move_counts(rt)));
  }
  /* and the bytes are still right when they come back */
  CHECK_UEQ(check_bad_bytes(rt, h, size, 41), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  free(want);
  dmem_runtime_destroy(rt);
}

/* A locked buffer is read where it is; the lock count stays. A read right
 * after an unspill (its copy maybe still in flight) sees the bytes. */
TEST_CASE(read_locked_and_just_unspilled) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  const size_t size = MiB + 5;
  unsigned char *want = malloc(size);
  REQUIRE_TRUE(want != NULL);
  check_fill(want, size, 7);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h));
  check_put(rt, h, size, 7);
  void *p;
  REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &p));
  REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &p));
  CHECK_UEQ(read_bad_bytes(rt, h, want, 0, size, 0), 0);
  dmem_buffer_info_t info;
  REQUIRE_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 2);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_OK(dmem_buffer_unlock(rt, h));
  for (int round = 0; round < 20; round++) {
    REQUIRE_OK(dmem_buffer_spill(rt, h, round % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST));
    dmem_stream_t s;
    REQUIRE_OK(dmem_stream_create(rt, &s));
    REQUIRE_OK(dmem_buffer_unspill(rt, h, s)); /* returns once the copy is enqueued */
    CHECK_UEQ(read_bad_bytes(rt, h, want, 0, size, 0), 0);
    REQUIRE_OK(dmem_buffer_info(rt, h, &info));
    CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
    CHECK_OK(dmem_stream_destroy(rt, s));
  }
  CHECK_OK(dmem_buffer_free(rt, h));
  free(want);
  dmem_runtime_destroy(rt);
}

/* A read is no use for the victim policy: the buffer read most recently
 * is still the least recently unlocked one, and is spilled first. */
TEST_CASE(read_does_not_refresh_lru) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t old, young;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &old));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &young));
  check_put(rt, old, MiB, 1);   /* unlocked first */
  check_put(rt, young, MiB, 2); /* unlocked last */
  unsigned char *want = malloc(MiB);
  REQUIRE_TRUE(want != NULL);
  check_fill(want, MiB, 1);
  for (int i = 0; i < 3; i++) CHECK_UEQ(read_bad_bytes(rt, old, want, 0, MiB, 0), 0);
  size_t freed = 0;
  CHECK_OK(dmem_runtime_evict(rt, 1, &freed));
  CHECK_UEQ(freed, MiB);
  dmem_buffer_info_t io, iy;
  REQUIRE_OK(dmem_buffer_info(rt, old, &io));
  REQUIRE_OK(dmem_buffer_info(rt, young, &iy));
  CHECK_EQ(io.state, DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(iy.state, DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_buffer_free(rt, old));
  CHECK_OK(dmem_buffer_free(rt, young));
  free(want);
  dmem_runtime_destroy(rt);
}

TEST_CASE(read_bad_ranges_and_stale) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 1000, 0, &h));
  check_put(rt, h, 1000, 3);
  unsigned char buf[1100];
  memset(buf, 0x11, sizeof buf);
  for (int t = 0; t < 3; t++) {
    if (t == 1) REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
    if (t == 2) REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
    CHECK_STATUS(dmem_buffer_read(rt, h, 0, buf, 1001), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dmem_buffer_read(rt, h, 1, buf, 1000), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dmem_buffer_read(rt, h, 1001, buf, 0), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dmem_buffer_read(rt, h, SIZE_MAX, buf, 2), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dmem_buffer_read(rt, h, 2, buf, SIZE_MAX), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dmem_buffer_read(rt, h, 0, NULL, 1), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dmem_buffer_read(NULL, h, 0, buf, 1), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_OK(dmem_buffer_read(rt, h, 1000, NULL, 0));
    CHECK_OK(dmem_buffer_read(rt, h, 0, buf, 0));
  }
  for (size_t i = 0; i < sizeof buf; i++)
    if (buf[i] != 0x11) CHECK_FAIL_(1, "byte %zu written by a failed or empty read", i);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_STATUS(dmem_buffer_read(rt, h, 0, buf, 10), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_read(rt, h, 0, NULL, 0), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_read(rt, DMEM_HANDLE_NULL, 0, buf, 10), DMEM_ERR_STALE_HANDLE);
  dmem_runtime_destroy(rt);
}

/* The controller tier is not read in place (its retrieve may drop the
 * copy): DMEM_ERR_BUSY, and nothing is asked of the controller. */
typedef struct { void *data; size_t size; int retrieves; } one_copy_t;
static dmem_status_t one_store(void *user, dmem_handle_t h, const void *d, size_t n) {
  (void)h;
  one_copy_t *c = user;
  free(c->data);
  c->data = malloc(n);
  if (!c->data) return DMEM_ERR_CALLBACK;
  memcpy(c->data, d, n);
  c->size = n;
  return DMEM_OK;
}
static dmem_status_t one_retrieve(void *user, dmem_handle_t h, void *out, size_t n) {
  (void)h;
  one_copy_t *c = user;
  c->retrieves++;
  if (!c->data || c->size != n) return DMEM_ERR_CALLBACK;
  memcpy(out, c->data, n);
  return DMEM_OK;
}

TEST_CASE(read_controller_tier_is_busy) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  one_copy_t copy = {NULL, 0, 0};
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.user = &copy;
  c.store = one_store;
  c.retrieve = one_retrieve;
  REQUIRE_OK(dmem_controller_set(rt, &c));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &h));
  check_put(rt, h, 4096, 5);
  REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  unsigned char buf[16];
  CHECK_STATUS(dmem_buffer_read(rt, h, 0, buf, sizeof buf), DMEM_ERR_BUSY);
  CHECK_EQ(copy.retrieves, 0);
  dmem_buffer_info_t info;
  REQUIRE_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.state, DMEM_STATE_DEFERRED_CONTROLLER);
  CHECK_UEQ(check_bad_bytes(rt, h, 4096, 5), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_controller_set(rt, NULL));
  free(copy.data);
  dmem_runtime_destroy(rt);
}

/* Reads on two threads while another spills to host and disk, unspills,
 * locks and frees nothing: every read sees the right bytes, never a torn
 * state; a host limit makes the I/O threads push buffers down meanwhile. */
#define RACE_SIZE (256 * 1024 + 5)
typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h[2];
  const unsigned char *want[2];
  _Atomic int stop;
  _Atomic int reads, bad, errors;
} race_t;

static void *race_reader(void *arg) {
  race_t *r = arg;
  unsigned char *dst = malloc(RACE_SIZE);
  if (!dst) abort();
  unsigned x = 12345;
  while (!atomic_load(&r->stop)) {
    x = x * 1103515245u + 12345u;
    int i = (int)(x >> 20) & 1;
    size_t off = (x >> 4) % RACE_SIZE, n = RACE_SIZE - off;
    if (x & 1) off = 0, n = RACE_SIZE;
    dmem_status_t st = dmem_buffer_read(r->rt, r->h[i], off, dst, n);
    if (st != DMEM_OK) {
      fprintf(stderr, "race read: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
      atomic_fetch_add(&r->errors, 1);
      continue;
    }
    if (memcmp(dst, r->want[i] + off, n) != 0) atomic_fetch_add(&r->bad, 1);
    atomic_fetch_add(&r->reads, 1);
  }
  free(dst);
  return NULL;
}

static void *race_mover(void *arg) {
  race_t *r = arg;
  /* at least 300 moves, and until the readers have read 400 times */
  for (int it = 0; it < 300 || (atomic_load(&r->reads) < 400 && it < 200000); it++) {
    dmem_handle_t h = r->h[it & 1];
    dmem_status_t st;
    void *p;
    switch (it % 5) {
      case 0: st = dmem_buffer_spill(r->rt, h, DMEM_TIER_HOST); break;
      case 1: st = dmem_buffer_spill(r->rt, h, DMEM_TIER_DISK); break;
      case 2: st = dmem_buffer_unspill(r->rt, h, NULL); break;
      case 3:
        st = dmem_buffer_lock(r->rt, h, NULL, &p);
        if (st == DMEM_OK) st = dmem_buffer_unlock(r->rt, h);
        break;
      default: st = dmem_buffer_spill(r->rt, h, DMEM_TIER_HOST); break;
    }
    /* BUSY: being read or moved; INVALID: disk -> host is no move */
    if (st != DMEM_OK && st != DMEM_ERR_BUSY && st != DMEM_ERR_INVALID_ARGUMENT) {
      fprintf(stderr, "race move %d: %s (%s)\n", it % 5, dmem_status_name(st),
              dmem_last_error_detail());
      atomic_fetch_add(&r->errors, 1);
    }
  }
  atomic_store(&r->stop, 1);
  return NULL;
}

TEST_CASE(read_races_moves) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.spill_ahead = 0;
  cfg.device_limit = 16 * MiB;
  cfg.host_limit = RACE_SIZE + RACE_SIZE / 2; /* two in the host tier: one is pushed down */
  dmem_runtime_t *rt = check_runtime_cfg(&cfg);
  race_t r;
  memset(&r, 0, sizeof r);
  r.rt = rt;
  unsigned char *want[2];
  for (int i = 0; i < 2; i++) {
    want[i] = malloc(RACE_SIZE);
    REQUIRE_TRUE(want[i] != NULL);
    check_fill(want[i], RACE_SIZE, 60 + (uint64_t)i);
    r.want[i] = want[i];
    REQUIRE_OK(dmem_buffer_alloc(rt, RACE_SIZE, 0, &r.h[i]));
    check_put(rt, r.h[i], RACE_SIZE, 60 + (uint64_t)i);
  }
  move_counts_t c0 = move_counts(rt);
  pthread_t t[3];
  pthread_create(&t[0], NULL, race_reader, &r);
  pthread_create(&t[1], NULL, race_reader, &r);
  pthread_create(&t[2], NULL, race_mover, &r);
  for (int i = 0; i < 3; i++) pthread_join(t[i], NULL);
  fprintf(stderr, "read_races_moves: %d reads\n", atomic_load(&r.reads));
  CHECK_GT(atomic_load(&r.reads), 0);
  CHECK_EQ(atomic_load(&r.bad), 0);
  CHECK_EQ(atomic_load(&r.errors), 0);
  CHECK_GT(move_counts(rt).spills, c0.spills); /* the mover did move them */
  for (int i = 0; i < 2; i++) {
    CHECK_UEQ(check_bad_bytes(rt, r.h[i], RACE_SIZE, 60 + (uint64_t)i), 0);
    CHECK_OK(dmem_buffer_free(rt, r.h[i]));
    free(want[i]);
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  dmem_runtime_destroy(rt);
}

/* A free while a read copies: the read finishes with the right bytes (or
 * finds the handle stale), and the buffer is reclaimed once. */
typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h;
  const unsigned char *want;
  size_t size;
  _Atomic int bad;
} free_race_t;

static void *free_race_reader(void *arg) {
  free_race_t *r = arg;
  unsigned char *dst = malloc(r->size);
  if (!dst) abort();
  dmem_status_t st = dmem_buffer_read(r->rt, r->h, 0, dst, r->size);
  if (st == DMEM_OK ? memcmp(dst, r->want, r->size) != 0 : st != DMEM_ERR_STALE_HANDLE)
    atomic_fetch_add(&r->bad, 1);
  free(dst);
  return NULL;
}

TEST_CASE(read_races_free) {
  dmem_runtime_t *rt = check_runtime(32 * MiB);
  const size_t size = 2 * MiB + 1;
  unsigned char *want = malloc(size);
  REQUIRE_TRUE(want != NULL);
  check_fill(want, size, 77);
  for (int round = 0; round < 30; round++) {
    free_race_t r = {rt, 0, want, size, 0};
    REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &r.h));
    check_put(rt, r.h, size, 77);
    if (round % 3 == 1) REQUIRE_OK(dmem_buffer_spill(rt, r.h, DMEM_TIER_HOST));
    if (round % 3 == 2) REQUIRE_OK(dmem_buffer_spill(rt, r.h, DMEM_TIER_DISK));
    pthread_t t;
    pthread_create(&t, NULL, free_race_reader, &r);
    CHECK_OK(dmem_buffer_free(rt, r.h));
    pthread_join(t, NULL);
    CHECK_EQ(atomic_load(&r.bad), 0);
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  free(want);
  dmem_runtime_destroy(rt);
}
