/* Handle table and buffer life cycle: alloc, free, info, lock, unlock,
 * priorities, and every bad input. */
#include <pthread.h>

#include "check.h"

#define MiB ((size_t)1 << 20)

TEST_CASE(alloc_info_free) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h = 0;
  REQUIRE_OK(dmem_alloc(rt, 1000, 0, &h));
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
  CHECK_OK(dmem_free(rt, h));
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
  CHECK_STATUS(dmem_alloc(NULL, 10, 0, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_alloc(rt, 10, 0, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_alloc(rt, 0, 0, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_alloc(rt, 10, 0x80, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_alloc(rt, SIZE_MAX, 0, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(dmem_alloc(rt, 17 * MiB, 0, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_EQ(h, 77); /* never written on failure */
  REQUIRE_OK(dmem_alloc(rt, 10, 0, &h));
  CHECK_STATUS(dmem_lock(NULL, h, NULL, &p), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_lock(rt, h, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_info(rt, h, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_info(NULL, h, &info), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_free(NULL, h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_unlock(NULL, h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_set_priority(NULL, h, 1), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stats(rt, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stats(NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(p == (void *)0x5);
  CHECK_OK(dmem_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* A handle belongs to the runtime that made it: another runtime's handle,
 * with the same slot number, is stale in this one (generations start at a
 * random value per runtime), and changes nothing there. */
TEST_CASE(handles_of_another_runtime_are_stale) {
  enum { N = 64 };
  dmem_runtime_t *ra = check_runtime(16 * MiB), *rb = check_runtime(16 * MiB);
  dmem_handle_t ha[N], hb[N];
  unsigned char pattern[256], back[256]; /* through dmem_copy: CUDA too */
  memset(pattern, 0x5B, sizeof pattern);
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_alloc(ra, 256, 0, &ha[i]));
    REQUIRE_OK(dmem_alloc(rb, 256, 0, &hb[i]));
    void *p;
    REQUIRE_OK(dmem_lock(rb, hb[i], NULL, &p));
    REQUIRE_OK(dmem_copy(rb, p, pattern, 256, NULL));
    REQUIRE_OK(dmem_stream_synchronize(rb, NULL));
    REQUIRE_OK(dmem_unlock(rb, hb[i]));
  }
  size_t same = 0;
  for (int i = 0; i < N; i++) {
    same += ha[i] == hb[i];
    CHECK_EQ(ha[i] & 0xFFFFFFFFu, hb[i] & 0xFFFFFFFFu); /* same slots, so only */
    void *p = NULL;                                     /* the generation tells */
    dmem_buffer_info_t info;
    CHECK_STATUS(dmem_buffer_info(rb, ha[i], &info), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_lock(rb, ha[i], NULL, &p), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_spill(rb, ha[i], DMEM_TIER_HOST), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_set_priority(rb, ha[i], 5), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_free(rb, ha[i]), DMEM_ERR_STALE_HANDLE);
  }
  CHECK_UEQ(same, 0);
  for (int i = 0; i < N; i++) { /* b's buffers untouched */
    dmem_buffer_info_t info;
    REQUIRE_OK(dmem_buffer_info(rb, hb[i], &info));
    CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
    CHECK_EQ(info.priority, 0);
    void *p;
    REQUIRE_OK(dmem_lock(rb, hb[i], NULL, &p));
    REQUIRE_OK(dmem_copy(rb, back, p, 256, NULL));
    REQUIRE_OK(dmem_stream_synchronize(rb, NULL));
    CHECK_TRUE(memcmp(back, pattern, 256) == 0);
    CHECK_OK(dmem_unlock(rb, hb[i]));
    CHECK_OK(dmem_free(ra, ha[i]));
    CHECK_OK(dmem_free(rb, hb[i]));
  }
  dmem_runtime_destroy(ra);
  dmem_runtime_destroy(rb);
}

TEST_CASE(stale_forged_and_zero_handles) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h, h2;
  REQUIRE_OK(dmem_alloc(rt, 64, 0, &h));
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
    CHECK_STATUS(dmem_lock(rt, forged[i], NULL, &p), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_unlock(rt, forged[i]), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_free(rt, forged[i]), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_buffer_info(rt, forged[i], &info), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_set_priority(rt, forged[i], 3), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_spill(rt, forged[i], DMEM_TIER_HOST), DMEM_ERR_STALE_HANDLE);
    CHECK_STATUS(dmem_unspill(rt, forged[i], NULL), DMEM_ERR_STALE_HANDLE);
  }
  CHECK_OK(dmem_free(rt, h));
  CHECK_STATUS(dmem_free(rt, h), DMEM_ERR_STALE_HANDLE); /* double free */
  /* the slot is reused with a new generation: the old handle never reaches
   * the new buffer */
  REQUIRE_OK(dmem_alloc(rt, 128, 0, &h2));
  CHECK_EQ(h2 & 0xFFFFFFFFu, h & 0xFFFFFFFFu);
  CHECK_NE(h2, h);
  void *p;
  CHECK_STATUS(dmem_lock(rt, h, NULL, &p), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_free(rt, h), DMEM_ERR_STALE_HANDLE);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h2, &info));
  CHECK_UEQ(info.size, 128);
  CHECK_OK(dmem_free(rt, h2));
  dmem_runtime_destroy(rt);
}

TEST_CASE(lock_count_and_unlock_without_lock) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_alloc(rt, 4096, 0, &h));
  CHECK_STATUS(dmem_unlock(rt, h), DMEM_ERR_NOT_LOCKED);
  void *p1, *p2;
  CHECK_OK(dmem_lock(rt, h, NULL, &p1));
  CHECK_OK(dmem_lock(rt, h, NULL, &p2));
  CHECK_TRUE(p1 == p2 && p1 != NULL);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 2);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_locked, 4096);
  CHECK_OK(dmem_unlock(rt, h));
  CHECK_OK(dmem_unlock(rt, h));
  CHECK_STATUS(dmem_unlock(rt, h), DMEM_ERR_NOT_LOCKED);
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 0);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_locked, 0);
  CHECK_OK(dmem_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(free_while_locked) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 11);
  void *p, *p2;
  REQUIRE_OK(dmem_lock(rt, h, NULL, &p));
  CHECK_OK(dmem_lock(rt, h, NULL, &p2));
  CHECK_OK(dmem_free(rt, h));
  /* stale at once for everything but unlock */
  dmem_buffer_info_t info;
  void *q;
  CHECK_STATUS(dmem_buffer_info(rt, h, &info), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_lock(rt, h, NULL, &q), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_free(rt, h), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_STALE_HANDLE);
  /* memory is not reclaimed yet: the locker may still use it */
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, MiB);
  unsigned char *tmp = malloc(MiB);
  CHECK_OK(dmem_copy(rt, tmp, p, MiB, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_UEQ(check_verify(tmp, MiB, 11), 0);
  free(tmp);
  /* even under pressure it is not spilled */
  size_t freed = 1;
  CHECK_OK(dmem_evict(rt, MiB, &freed));
  CHECK_UEQ(freed, 0);
  CHECK_OK(dmem_unlock(rt, h));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, MiB);
  CHECK_OK(dmem_unlock(rt, h)); /* last unlock reclaims */
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_STATUS(dmem_unlock(rt, h), DMEM_ERR_STALE_HANDLE);
  dmem_runtime_destroy(rt);
}

TEST_CASE(pinned_never_spills) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t pin, other;
  REQUIRE_OK(dmem_alloc(rt, 3 * MiB, DMEM_ALLOC_PINNED, &pin));
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, pin, &info));
  CHECK_EQ(info.pinned, 1);
  CHECK_STATUS(dmem_spill(rt, pin, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_pinned, 3 * MiB);
  /* only 1 MiB left and nothing spillable: a 2 MiB allocation fails */
  CHECK_STATUS(dmem_alloc(rt, 2 * MiB, 0, &other), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_OK(dmem_buffer_info(rt, pin, &info));
  CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_free(rt, pin));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_pinned, 0);
  CHECK_OK(dmem_alloc(rt, 2 * MiB, 0, &other));
  CHECK_OK(dmem_free(rt, other));
  dmem_runtime_destroy(rt);
}

TEST_CASE(priority_set_and_read) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_alloc(rt, 100, 0, &h));
  CHECK_OK(dmem_set_priority(rt, h, -7));
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.priority, -7);
  CHECK_OK(dmem_free(rt, h));
  dmem_runtime_destroy(rt);
}

TEST_CASE(many_handles_grow_table) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  enum { N = 10000 }; /* more than two table chunks */
  dmem_handle_t *hs = malloc(N * sizeof *hs);
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem_alloc(rt, 64, 0, &hs[i]));
  for (int i = 0; i < N; i++)
    for (int j = i + 1; j < i + 3 && j < N; j++) CHECK_NE(hs[i], hs[j]);
  for (int i = 0; i < N; i += 2) CHECK_OK(dmem_free(rt, hs[i]));
  for (int i = 1; i < N; i += 2) {
    dmem_buffer_info_t info;
    CHECK_OK(dmem_buffer_info(rt, hs[i], &info));
  }
  for (int i = 1; i < N; i += 2) CHECK_OK(dmem_free(rt, hs[i]));
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
  REQUIRE_OK(dmem_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_alloc(rt, MiB, 0, &b));
  REQUIRE_OK(dmem_alloc(rt, MiB, 0, &c));
  void *p;
  CHECK_OK(dmem_lock(rt, a, NULL, &p));
  CHECK_OK(dmem_spill(rt, b, DMEM_TIER_HOST));
  CHECK_OK(dmem_spill(rt, c, DMEM_TIER_DISK));
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
    if (dmem_lock(a->rt, h, NULL, &p) != DMEM_OK) abort();
    if (dmem_unlock(a->rt, h) != DMEM_OK) abort();
  }
  return NULL;
}

TEST_CASE(concurrent_lock_unlock_counts) {
  dmem_runtime_t *rt = check_runtime(16 * MiB);
  dmem_handle_t hs[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(dmem_alloc(rt, 256, 0, &hs[i]));
  lock_arg_t a = {rt, hs, 4};
  pthread_t t[8];
  for (int i = 0; i < 8; i++) pthread_create(&t[i], NULL, lock_loop, &a);
  for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++) {
    dmem_buffer_info_t info;
    CHECK_OK(dmem_buffer_info(rt, hs[i], &info));
    CHECK_EQ(info.lock_count, 0);
    CHECK_STATUS(dmem_unlock(rt, hs[i]), DMEM_ERR_NOT_LOCKED);
    CHECK_OK(dmem_free(rt, hs[i]));
  }
  dmem_runtime_destroy(rt);
}

TEST_CASE(data_survives_spill_roundtrip) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t h;
  REQUIRE_OK(dmem_alloc(rt, 3 * MiB + 17, 0, &h));
  check_put(rt, h, 3 * MiB + 17, 99);
  CHECK_OK(dmem_spill(rt, h, DMEM_TIER_HOST));
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB + 17, 99), 0);
  CHECK_OK(dmem_spill(rt, h, DMEM_TIER_DISK));
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB + 17, 99), 0);
  CHECK_OK(dmem_free(rt, h));
  dmem_runtime_destroy(rt);
}
