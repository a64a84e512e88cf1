/* The pinned host pool (runtime/memory/hostpool.c) over a backend whose
 * pinned allocator can be made to fail. */
#include <pthread.h>
#include <time.h>

#include "check.h"
#include "api/api.h"

static int fake_fail;
static dmem_status_t fake_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  (void)be;
  if (fake_fail)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "fake pinned allocator: no pages left for %zu bytes", size);
  /* page-aligned, as pinned memory is (cudaMallocHost, mmap) */
  *ptr_out = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  return *ptr_out ? DMEM_OK : DMEM_ERR_HOST_OUT_OF_MEMORY;
}
static dmem_status_t fake_host_free(dmem__backend_t *be, void *ptr) {
  (void)be;
  free(ptr);
  return DMEM_OK;
}

static dmem__backend_t fake_backend(void) {
  dmem__backend_t be;
  memset(&be, 0, sizeof be);
  be.name = "fake";
  be.host_chunk_min = 1 << 20;
  be.host_alloc = fake_host_alloc;
  be.host_free = fake_host_free;
  return be;
}

/* The pool's detail names both its own failure and the backend's: the
 * backend's text must survive being quoted into the same thread-local
 * buffer it came from (regression: the two overlapped). */
TEST_CASE(grow_failure_keeps_backend_detail) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  fake_fail = 1;
  void *ptr = (void *)0x1;
  CHECK_STATUS(dmem__hostpool_alloc(p, 4096, &ptr), DMEM_ERR_HOST_OUT_OF_MEMORY);
  CHECK_TRUE(ptr == (void *)0x1); /* outputs only on success */
  const char *d = dmem_last_error_detail();
  fprintf(stderr, "detail: %s\n", d);
  CHECK_TRUE(strstr(d, "pinned host pool could not grow by 1048576 bytes") != NULL);
  CHECK_TRUE(strstr(d, "(fake pinned allocator: no pages left for 1048576 bytes)") != NULL);
  fake_fail = 0;
  dmem__hostpool_destroy(p);
}

/* Blocks come from one chunk, are aligned, do not overlap, and coalesce:
 * after freeing everything a chunk-sized block fits without growing. */
TEST_CASE(blocks_reuse_and_coalesce) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  void *a = NULL, *b = NULL, *c = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, 1000, &a), DMEM_OK);
  REQUIRE_EQ(dmem__hostpool_alloc(p, 5000, &b), DMEM_OK);
  REQUIRE_EQ(dmem__hostpool_alloc(p, 1, &c), DMEM_OK);
  CHECK_UEQ((uintptr_t)a % 256, 0);
  CHECK_UEQ((uintptr_t)b % 256, 0);
  CHECK_TRUE((char *)b >= (char *)a + 1000 && (char *)c >= (char *)b + 5000);
  memset(a, 1, 1000);
  memset(b, 2, 5000);
  dmem__hostpool_free(p, b);
  dmem__hostpool_free(p, a);
  dmem__hostpool_free(p, c);
  fake_fail = 1; /* no growth allowed from here on */
  void *big = NULL;
  CHECK_STATUS(dmem__hostpool_alloc(p, (1 << 20) - 512, &big), DMEM_OK);
  dmem__hostpool_free(p, big);
  fake_fail = 0;
  dmem__hostpool_destroy(p);
}


/* ---- growth off the spill path, the limit, trimming ------------------------------- */


static _Atomic int slow_in_alloc, slow_release, slow_calls;
static dmem_status_t slow_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  atomic_fetch_add(&slow_calls, 1);
  atomic_store(&slow_in_alloc, 1);
  /* hold the "cudaMallocHost" until the test lets go (at most 5 s) */
  for (int i = 0; i < 5000 && !atomic_load(&slow_release); i++) {
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  atomic_store(&slow_in_alloc, 0);
  return fake_host_alloc(be, size, ptr_out);
}

/* The pool's mutex is not held while the backend allocates: a block that
 * fits is handed out (and freed) while another thread's growth is stuck in
 * host_alloc. */
typedef struct grower {
  dmem__hostpool_t *p;
  void *ptr;
  dmem_status_t st;
} grower_t;
static void *grower_main(void *arg) {
  grower_t *g = arg;
  g->st = dmem__hostpool_alloc(g->p, (size_t)3 << 20, &g->ptr); /* does not fit: grows */
  return NULL;
}

TEST_CASE(mutex_not_held_across_host_alloc) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  void *a = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, 4096, &a), DMEM_OK); /* first chunk, fast */
  be.host_alloc = slow_host_alloc;
  atomic_store(&slow_release, 0);
  grower_t g = {p, NULL, DMEM_ERR_INVALID_ARGUMENT};
  pthread_t th;
  REQUIRE_EQ(pthread_create(&th, NULL, grower_main, &g), 0);
  while (!atomic_load(&slow_in_alloc)) {
    struct timespec ts = {0, 100 * 1000};
    nanosleep(&ts, NULL);
  }
  /* the grower is inside host_alloc now */
  void *b = NULL;
  CHECK_EQ(dmem__hostpool_alloc(p, 8192, &b), DMEM_OK);
  dmem__hostpool_free(p, b);
  CHECK_EQ(atomic_load(&slow_in_alloc), 1); /* we did not wait for it */
  atomic_store(&slow_release, 1);
  pthread_join(th, NULL);
  CHECK_EQ(g.st, DMEM_OK);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows, 2);
  dmem__hostpool_free(p, g.ptr);
  dmem__hostpool_free(p, a);
  dmem__hostpool_destroy(p);
}

/* With a background thread the pool grows before it runs dry: after
 * taking most of the first chunk, a second one appears without any
 * allocation failing to fit. */
TEST_CASE(background_growth_before_running_dry) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  void *a = NULL, *b = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, 4096, &a), DMEM_OK); /* grows on demand: 1 MiB */
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)900 << 10, &b), DMEM_OK); /* now low */
  dmem__hostpool_stats_t s;
  for (int i = 0; i < 5000; i++) {
    dmem__hostpool_stats(p, &s);
    if (s.background_grows > 0) break;
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  CHECK_UEQ(s.background_grows, 1);
  CHECK_UEQ(s.grows, 2);
  CHECK_UEQ(s.reserved, (size_t)2 << 20);
  /* the next block comes from the chunk the thread added: no growth */
  void *c = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)512 << 10, &c), DMEM_OK);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows - s.background_grows, 1);
  dmem__hostpool_free(p, a);
  dmem__hostpool_free(p, b);
  dmem__hostpool_free(p, c);
  dmem__hostpool_destroy(p);
}

/* The pageable fallback: with a background thread, an allocation that
 * finds no room while the pool is pinning a chunk takes pageable memory at
 * once instead of waiting for the pinning; its block is aligned like a
 * pooled one and goes back to the heap when freed. */
static void *first_alloc_main(void *arg) {
  grower_t *g = arg;
  g->st = dmem__hostpool_alloc(g->p, 4096, &g->ptr); /* empty pool: pins the first chunk */
  return NULL;
}

/* Wait (at most 5 s) until a thread is inside slow_host_alloc; 1 if so. */
static int wait_in_slow_alloc(void) {
  for (int i = 0; i < 5000 && !atomic_load(&slow_in_alloc); i++) {
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return atomic_load(&slow_in_alloc);
}

TEST_CASE(pageable_fallback_while_the_pool_pins) {
  dmem__backend_t be = fake_backend();
  be.host_alloc = slow_host_alloc;
  atomic_store(&slow_release, 0);
  atomic_store(&slow_in_alloc, 0);
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  /* another thread is pinning the pool's first chunk (held in host_alloc) */
  grower_t g = {p, NULL, DMEM_ERR_INVALID_ARGUMENT};
  pthread_t th;
  REQUIRE_EQ(pthread_create(&th, NULL, first_alloc_main, &g), 0);
  REQUIRE_EQ(wait_in_slow_alloc(), 1);
  void *c = NULL, *d = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)2 << 20, &c), DMEM_OK); /* no room: pageable */
  REQUIRE_EQ(dmem__hostpool_alloc(p, 1000, &d), DMEM_OK);
  CHECK_EQ(atomic_load(&slow_in_alloc), 1); /* nobody waited for the pinning */
  CHECK_UEQ((uintptr_t)c % 4096, 0);        /* large blocks start on a page */
  CHECK_UEQ((uintptr_t)d % 256, 0);
  memset(c, 3, (size_t)2 << 20);
  memset(d, 4, 1000);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.pageable_allocs, 2);
  CHECK_GE(s.pageable, ((size_t)2 << 20) + 1000);
  CHECK_UEQ(s.reserved, 0); /* nothing pinned yet */
  dmem__hostpool_free(p, c);
  dmem__hostpool_free(p, d);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.pageable, 0);
  atomic_store(&slow_release, 1);
  pthread_join(th, NULL);
  REQUIRE_EQ(g.st, DMEM_OK);
  /* once the chunk is in, blocks that fit come from it again */
  void *e = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)64 << 10, &e), DMEM_OK);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.pageable_allocs, 2);
  CHECK_GE(s.reserved, (size_t)1 << 20);
  dmem__hostpool_free(p, e);
  dmem__hostpool_free(p, g.ptr);
  dmem__hostpool_destroy(p);
}

/* Without a background thread (the host backend) there is no fallback: a
 * block waits for the growth in progress and comes from the pool. */
TEST_CASE(no_pageable_fallback_without_a_thread) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  void *a = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)3 << 20, &a), DMEM_OK);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.pageable_allocs, 0);
  CHECK_GE(s.reserved, (size_t)3 << 20);
  dmem__hostpool_free(p, a);
  dmem__hostpool_destroy(p);
}

/* The limit bounds the chunks; trim gives wholly free chunks back. */
TEST_CASE(limit_and_trim) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, (size_t)3 << 20, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  void *v[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i++) REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)900 << 10, &v[i]), DMEM_OK);
  void *x = (void *)0x1;
  CHECK_STATUS(dmem__hostpool_alloc(p, (size_t)900 << 10, &x), DMEM_ERR_HOST_OUT_OF_MEMORY);
  CHECK_TRUE(x == (void *)0x1);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "at its limit") != NULL);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.reserved, (size_t)3 << 20);
  size_t released = 7;
  CHECK_EQ(dmem__hostpool_trim(p, 0, &released), DMEM_OK);
  CHECK_UEQ(released, 0); /* every chunk holds a block */
  dmem__hostpool_free(p, v[0]);
  dmem__hostpool_free(p, v[2]);
  CHECK_EQ(dmem__hostpool_trim(p, (size_t)2 << 20, &released), DMEM_OK);
  CHECK_UEQ(released, (size_t)1 << 20); /* one chunk down to the keep */
  CHECK_EQ(dmem__hostpool_trim(p, 0, &released), DMEM_OK);
  CHECK_UEQ(released, (size_t)1 << 20);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.reserved, (size_t)1 << 20);
  CHECK_UEQ(s.trims, 2);
  /* a page-aligned block takes whole pages, its header included */
  CHECK_UEQ(s.free, (size_t)(1 << 20) - (size_t)(904 << 10));
  dmem__hostpool_free(p, v[1]);
  dmem__hostpool_destroy(p);
}

/* Through the public API: dmem_host_trim after the spilled buffers are
 * gone gives the pinned memory back; the stats follow. */
TEST_CASE(host_trim_public) {
  dmem_runtime_t *rt = check_runtime((size_t)16 << 20);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, (size_t)1 << 20, 0, &h[i]));
    REQUIRE_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST));
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_GE(s.host_pool_reserved, (size_t)4 << 20);
  CHECK_GE(s.host_pool_grows, 1);
  size_t released = 0;
  CHECK_OK(dmem_host_trim(rt, 0, &released));
  CHECK_UEQ(released, 0); /* the host tier holds its copies */
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_host_trim(rt, 0, &released));
  CHECK_UEQ(released, s.host_pool_reserved);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.host_pool_reserved, 0);
  CHECK_GE(s.host_pool_trims, 1);
  CHECK_STATUS(dmem_host_trim(NULL, 0, NULL), DMEM_ERR_INVALID_ARGUMENT);
  dmem_runtime_destroy(rt);
}

/* Blocks of 64 KiB and more start on a page (the disk tier's O_DIRECT I/O
 * then needs no bounce copy); the bytes skipped in front stay usable, and a
 * range that only holds the block unaligned is still used rather than
 * growing the pool. */
TEST_CASE(large_blocks_start_on_a_page) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  void *small = NULL, *big[3] = {NULL, NULL, NULL}, *after = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, 100, &small), DMEM_OK);
  for (int i = 0; i < 3; i++) {
    REQUIRE_EQ(dmem__hostpool_alloc(p, (64 << 10) + 1000 * (size_t)i, &big[i]), DMEM_OK);
    CHECK_UEQ((uintptr_t)big[i] % 4096, 0);
    memset(big[i], i + 1, (64 << 10) + 1000 * (size_t)i);
  }
  fake_fail = 1; /* no growth from here on */
  /* a small block fits in the gap in front of a page-aligned one */
  REQUIRE_EQ(dmem__hostpool_alloc(p, 1000, &after), DMEM_OK);
  CHECK_TRUE((char *)after < (char *)big[2]);
  dmem__hostpool_free(p, after);
  for (int i = 0; i < 3; i++) dmem__hostpool_free(p, big[i]);
  dmem__hostpool_free(p, small);
  /* the whole chunk again: only unaligned at the chunk's start, no growth */
  void *whole = NULL;
  CHECK_STATUS(dmem__hostpool_alloc(p, (1 << 20) - 512, &whole), DMEM_OK);
  dmem__hostpool_free(p, whole);
  fake_fail = 0;
  dmem__hostpool_destroy(p);
}

/* ---- the reserve (dmem_config_t.host_reserve) ---------------------------------- */

/* A pinned allocator of large, lazily backed chunks (mmap with
 * MAP_NORESERVE: only the pages the pool writes a header to are ever
 * backed) that takes 30 ms a call, counts calls in flight at once and can
 * fail its n-th call. */
#include <sys/mman.h>
#define RES_MAX 16
static struct {
  pthread_mutex_t mu;
  void *base[RES_MAX];
  size_t size[RES_MAX];
  int live, calls, fail_call, in_flight, max_in_flight;
} res = {.mu = PTHREAD_MUTEX_INITIALIZER};

static dmem_status_t res_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  (void)be;
  pthread_mutex_lock(&res.mu);
  int call = ++res.calls;
  if (++res.in_flight > res.max_in_flight) res.max_in_flight = res.in_flight;
  pthread_mutex_unlock(&res.mu);
  struct timespec ts = {0, 30 * 1000 * 1000};
  nanosleep(&ts, NULL);
  void *p = call == res.fail_call ? MAP_FAILED
                                  : mmap(NULL, size, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  pthread_mutex_lock(&res.mu);
  res.in_flight--;
  if (p != MAP_FAILED) {
    for (int i = 0; i < RES_MAX; i++)
      if (!res.base[i]) {
        res.base[i] = p;
        res.size[i] = size;
        res.live++;
        break;
      }
  }
  pthread_mutex_unlock(&res.mu);
  if (p == MAP_FAILED)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "fake pinning: call %d refused", call);
  *ptr_out = p;
  return DMEM_OK;
}

static dmem_status_t res_host_free(dmem__backend_t *be, void *ptr) {
  (void)be;
  pthread_mutex_lock(&res.mu);
  for (int i = 0; i < RES_MAX; i++)
    if (res.base[i] == ptr) {
      munmap(ptr, res.size[i]);
      res.base[i] = NULL;
      res.live--;
      break;
    }
  pthread_mutex_unlock(&res.mu);
  return DMEM_OK;
}

static dmem__backend_t res_backend(int fail_call) {
  dmem__backend_t be = fake_backend();
  be.host_alloc = res_host_alloc;
  be.host_free = res_host_free;
  pthread_mutex_lock(&res.mu);
  res.calls = 0;
  res.fail_call = fail_call;
  res.max_in_flight = 0;
  pthread_mutex_unlock(&res.mu);
  return be;
}

/* 2.5 GiB of reserve: three chunks (1 GiB, 1 GiB, 0.5 GiB) pinned at once
 * before create returns; blocks come out of them without growth; no trim
 * goes below the reserve, memory past it is trimmed; destroy gives all
 * back. */
TEST_CASE(reserve_pinned_at_create_in_parallel_and_kept) {
  dmem__backend_t be = res_backend(0);
  const size_t GiB = (size_t)1 << 30, reserve = 2 * GiB + GiB / 2;
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, reserve, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.reserved, reserve);
  CHECK_UEQ(s.free, reserve);
  CHECK_UEQ(s.grows, 3);
  CHECK_EQ(res.calls, 3);
  CHECK_GE(res.max_in_flight, 2); /* pinned at once, not one after another */
  void *a = NULL, *b = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, GiB - 4096, &a), DMEM_OK);
  REQUIRE_EQ(dmem__hostpool_alloc(p, GiB / 4, &b), DMEM_OK);
  memset(a, 1, 4096);
  memset(b, 2, 4096);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows, 3); /* out of the reserve */
  /* a block past the reserve grows the pool; that chunk is trimmed later */
  void *c = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, GiB, &c), DMEM_OK);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows, 4);
  CHECK_GT(s.reserved, reserve);
  dmem__hostpool_free(p, c);
  dmem__hostpool_free(p, a);
  dmem__hostpool_free(p, b);
  dmem__hostpool_stats(p, &s);
  const size_t grown = s.reserved - reserve;
  size_t released = 0;
  CHECK_EQ(dmem__hostpool_trim(p, 0, &released), DMEM_OK);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.reserved, reserve); /* exactly the reserve stays, whatever the chunks' order */
  CHECK_UEQ(released, grown);     /* and exactly what grew past it went */
  CHECK_EQ(dmem__hostpool_trim(p, 0, &released), DMEM_OK);
  CHECK_UEQ(released, 0);
  dmem__hostpool_destroy(p);
  CHECK_EQ(res.live, 0);
}

/* A reserve chunk the backend refuses fails the create with
 * DMEM_ERR_HOST_OUT_OF_MEMORY naming the reserve and the backend's cause;
 * the chunks pinned before it are given back; *pool_out is not written. */
TEST_CASE(reserve_failure_fails_create_and_gives_back) {
  for (int fail = 1; fail <= 4; fail++) {
    dmem__backend_t be = res_backend(fail);
    dmem__hostpool_t *p = (dmem__hostpool_t *)0x1;
    CHECK_STATUS(dmem__hostpool_create(&be, 0, true, ((size_t)7 << 30) / 2, DMEM_HOST_HEADROOM_DEFAULT,
                                        &p),
                 DMEM_ERR_HOST_OUT_OF_MEMORY);
    CHECK_TRUE(p == (dmem__hostpool_t *)0x1);
    const char *d = dmem_last_error_detail();
    CHECK_TRUE(strstr(d, "pinned host reserve of 3758096384 bytes") != NULL);
    CHECK_TRUE(strstr(d, "refused") != NULL);
    CHECK_EQ(res.live, 0);
  }
}

/* Through the public API: host_reserve pins at create (the host backend
 * takes it from the heap), dmem_host_trim keeps it, a reserve past the
 * pool's bound under host_limit and a bad host_pin are refused. */
TEST_CASE(host_reserve_public) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = (size_t)16 << 20;
  cfg.host_reserve = (size_t)24 << 20;
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_GE(s.host_pool_reserved, (size_t)24 << 20);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, (size_t)1 << 20, 0, &h));
  REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_free(rt, h));
  size_t released = 7;
  CHECK_OK(dmem_host_trim(rt, 0, &released));
  CHECK_UEQ(released, 0);
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_GE(s.host_pool_reserved, (size_t)24 << 20);
  dmem_runtime_destroy(rt);

  dmem_runtime_t *bad = (dmem_runtime_t *)0x1;
  cfg.host_limit = (size_t)8 << 20; /* pool bound: 8 MiB tier + cap + 64 MiB staging */
  cfg.host_reserve = (size_t)1 << 30;
  CHECK_STATUS(dmem_runtime_create(&cfg, &bad), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "host_reserve") != NULL);
  CHECK_TRUE(bad == (dmem_runtime_t *)0x1);
  cfg.host_limit = 0;
  cfg.host_reserve = 0;
  cfg.host_pin = (dmem_host_pin_t)7;
  CHECK_STATUS(dmem_runtime_create(&cfg, &bad), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(bad == (dmem_runtime_t *)0x1);
}

/* 64 KiB blocks pack: a run of them leaves no free fragment in front of
 * each (each used to leave 3840 bytes, and a first-fit walked past all of
 * them, O(n) per block). Every block is page-aligned, consecutive blocks
 * are 17 pages apart, the pool holds one free range after them, and
 * alloc_n carves the same way under one lock. */
TEST_CASE(page_blocks_pack_without_fragments) {
  dmem__backend_t be = fake_backend();
  be.host_chunk_min = (size_t)16 << 20; /* all 128 blocks in one chunk */
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  enum { N = 64 };
  void *v[N];
  for (int i = 0; i < N; i++) REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)64 << 10, &v[i]), DMEM_OK);
  for (int i = 0; i < N; i++) CHECK_UEQ((uintptr_t)v[i] % 4096, 0);
  for (int i = 1; i < N; i++) CHECK_UEQ((uintptr_t)v[i] - (uintptr_t)v[i - 1], (size_t)17 << 12);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  /* the only free bytes: one front fragment before the first block, and
   * the tail of the chunk */
  CHECK_UEQ(s.free, s.reserved - (size_t)N * (17 << 12));
  size_t sizes[N];
  void *w[N];
  for (int i = 0; i < N; i++) sizes[i] = (size_t)64 << 10;
  REQUIRE_EQ(dmem__hostpool_alloc_n(p, sizes, N, w), DMEM_OK);
  CHECK_UEQ((uintptr_t)w[0] - (uintptr_t)v[N - 1], (size_t)17 << 12);
  for (int i = 1; i < N; i++) CHECK_UEQ((uintptr_t)w[i] - (uintptr_t)w[i - 1], (size_t)17 << 12);
  for (int i = 0; i < N; i++) {
    memset(w[i], i, (size_t)64 << 10); /* writable, no overlap with the headers */
    dmem__hostpool_free(p, v[i]);
  }
  for (int i = 0; i < N; i++) {
    CHECK_UEQ(((unsigned char *)w[i])[0], (unsigned)i);
    dmem__hostpool_free(p, w[i]);
  }
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.free, s.reserved);
  dmem__hostpool_destroy(p);
}

/* alloc_n is all or nothing: at the pool's limit, no block stays taken. */
TEST_CASE(alloc_n_all_or_nothing) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, (size_t)1 << 20, false, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  size_t sizes[20];
  void *w[20];
  for (int i = 0; i < 20; i++) sizes[i] = (size_t)64 << 10; /* 20 x 68 KiB > 1 MiB */
  CHECK_STATUS(dmem__hostpool_alloc_n(p, sizes, 20, w), DMEM_ERR_HOST_OUT_OF_MEMORY);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.free, s.reserved);
  REQUIRE_EQ(dmem__hostpool_alloc_n(p, sizes, 14, w), DMEM_OK); /* 14 x 68 KiB fit */
  for (int i = 0; i < 14; i++) dmem__hostpool_free(p, w[i]);
  dmem__hostpool_destroy(p);
}

/* The background thread keeps as many bytes free as the last 100-200 ms
 * took (the headroom), chunk after chunk, not a fixed fraction of what the
 * pool holds: after a burst of 32 blocks of 1 MiB it grows until about the
 * next 32 MiB are free (a quarter-of-the-pool rule added one chunk of at
 * most half the pool), and once the burst is over it adds nothing more. */
TEST_CASE(headroom_paced_by_demand) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  enum { N = 32, BURSTS = 3 };
  void *v[BURSTS][N];
  dmem__hostpool_stats_t s;
  /* The headroom is the demand of the last 100-200 ms: a thread that the
   * machine schedules later than that (a loaded 2-core CI runner under
   * ASan: once, 9.5 MiB free) finds the burst forgotten. Another burst then
   * asks again; the thread catches up within a few ms of being scheduled. */
  int bursts = 0;
  for (; bursts < BURSTS; bursts++) {
    for (int i = 0; i < N; i++)
      REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)1 << 20, &v[bursts][i]), DMEM_OK);
    for (int i = 0; i < 150; i++) {
      dmem__hostpool_stats(p, &s);
      if (s.free >= (size_t)24 << 20) break;
      struct timespec ts = {0, 1000 * 1000};
      nanosleep(&ts, NULL);
    }
    if (s.free >= (size_t)24 << 20) break;
  }
  if (bursts == BURSTS) bursts--;
  CHECK_GE(s.free, (size_t)24 << 20);
  CHECK_GE(s.background_grows, 1);
  /* bounded: the headroom (at most the 33 MiB carved) and one chunk */
  CHECK_LE(s.free, (size_t)96 << 20);
  /* the burst is over: a small block later grows nothing */
  struct timespec quiet = {0, 250 * 1000 * 1000};
  nanosleep(&quiet, NULL);
  dmem__hostpool_stats(p, &s);
  uint64_t grows = s.grows;
  void *x = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, 4096, &x), DMEM_OK);
  struct timespec settle = {0, 50 * 1000 * 1000};
  nanosleep(&settle, NULL);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows, grows);
  dmem__hostpool_free(p, x);
  for (int b = 0; b <= bursts; b++)
    for (int i = 0; i < N; i++) dmem__hostpool_free(p, v[b][i]);
  dmem__hostpool_destroy(p);
}

/* Wait until the background thread has settled: its grows and the free
 * bytes unchanged for 200 ms (a loaded machine may start it late; up to
 * 10 s). *out: the statistics then. */
static void wait_settled(dmem__hostpool_t *p, dmem__hostpool_stats_t *out) {
  struct timespec tick = {0, 50 * 1000 * 1000};
  dmem__hostpool_stats_t prev = {0};
  dmem__hostpool_stats(p, &prev);
  for (int quiet = 0, waited = 0; quiet < 4 && waited < 200; waited++) {
    nanosleep(&tick, NULL);
    dmem__hostpool_stats(p, out);
    quiet = out->background_grows == prev.background_grows && out->free == prev.free ? quiet + 1 : 0;
    prev = *out;
  }
  dmem__hostpool_stats(p, out);
}

/* The headroom is net of frees: a loop that gives back as much as it takes
 * (a cyclic spill + unspill loop) drains nothing, and the thread adds no
 * chunk for it however fast it runs (the gross rate, 1 MiB a millisecond
 * here, asked for the 100-200 MiB carved in the window). */
TEST_CASE(headroom_net_of_frees) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  enum { RING = 8 };
  void *ring[RING];
  for (int i = 0; i < RING; i++) REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)1 << 20, &ring[i]), DMEM_OK);
  /* 4 MiB more held free: a window that loses one free to a roll (a
   * stall of 200 ms between two steps, on a loaded machine) asks for 1 MiB
   * and a header, which that covers */
  void *spare = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)4 << 20, &spare), DMEM_OK);
  dmem__hostpool_free(p, spare);
  /* the first blocks' demand is forgotten after 200 ms, and the thread's
   * growth for them done (on a loaded machine one came after a fixed
   * 300 ms once, and counted as the loop's) */
  struct timespec settle = {0, 300 * 1000 * 1000}, tick = {0, 1000 * 1000};
  nanosleep(&settle, NULL);
  dmem__hostpool_stats_t s;
  wait_settled(p, &s);
  uint64_t grows = s.grows;
  CHECK_GE(s.free, (size_t)4 << 20);
  /* 300 ms of taking one block and giving one back */
  for (int i = 0; i < 300; i++) {
    dmem__hostpool_free(p, ring[i % RING]);
    REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)1 << 20, &ring[i % RING]), DMEM_OK);
    nanosleep(&tick, NULL);
  }
  nanosleep(&tick, NULL);
  dmem__hostpool_stats(p, &s);
  /* at most one chunk (CI on 2 loaded cores saw one, twice in five full
   * runs, cause not found); the gross rule asks for 100-200 MiB free, six
   * or more chunks and well past 64 MiB held */
  CHECK_LE(s.grows, grows + 1);
  CHECK_LE(s.reserved, (size_t)64 << 20);
  for (int i = 0; i < RING; i++) dmem__hostpool_free(p, ring[i]);
  dmem__hostpool_destroy(p);
}

/* The pageable fallback is for blocks up to the backend's host_pageable_max:
 * a larger one waits for the chunk being pinned (with fast pinning, cheaper
 * than faulting in fresh pageable pages) and comes from the pool. */
static _Atomic int big_done;
static void *big_alloc_main(void *arg) {
  grower_t *g = arg;
  g->st = dmem__hostpool_alloc(g->p, (size_t)3 << 20, &g->ptr);
  atomic_store(&big_done, 1);
  return NULL;
}

TEST_CASE(large_blocks_wait_for_the_pinning) {
  dmem__backend_t be = fake_backend();
  be.host_alloc = slow_host_alloc;
  be.host_pageable_max = (size_t)1 << 20;
  atomic_store(&slow_release, 0);
  atomic_store(&slow_in_alloc, 0);
  atomic_store(&big_done, 0);
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, DMEM_HOST_HEADROOM_DEFAULT, &p), DMEM_OK);
  grower_t g = {p, NULL, DMEM_ERR_INVALID_ARGUMENT}; /* pins the first chunk */
  pthread_t th;
  REQUIRE_EQ(pthread_create(&th, NULL, first_alloc_main, &g), 0);
  REQUIRE_EQ(wait_in_slow_alloc(), 1);
  void *small = NULL;
  REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)512 << 10, &small), DMEM_OK); /* pageable */
  grower_t big = {p, NULL, DMEM_ERR_INVALID_ARGUMENT};
  pthread_t tb;
  REQUIRE_EQ(pthread_create(&tb, NULL, big_alloc_main, &big), 0);
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL);
  CHECK_EQ(atomic_load(&big_done), 0); /* waits for the pinning */
  atomic_store(&slow_release, 1);
  pthread_join(tb, NULL);
  pthread_join(th, NULL);
  REQUIRE_EQ(big.st, DMEM_OK);
  REQUIRE_EQ(g.st, DMEM_OK);
  memset(big.ptr, 5, (size_t)3 << 20);
  dmem__hostpool_free(p, small);
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.pageable_allocs, 1); /* the small block only */
  CHECK_UEQ(s.pageable, 0);
  CHECK_GE(s.reserved, (size_t)4 << 20);
  dmem__hostpool_free(p, big.ptr);
  dmem__hostpool_free(p, g.ptr);
  dmem__hostpool_destroy(p);
}

/* A burst of 256 blocks of 60 KiB (15 MiB) through a pool with a background
 * thread and a headroom of `headroom` bytes; the free bytes once the
 * thread has settled (after 200 ms). */
static void small_headroom_burst(size_t headroom, dmem__hostpool_stats_t *out) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, headroom, &p), DMEM_OK);
  enum { N = 256 };
  void *v[N];
  for (int i = 0; i < N; i++) REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)60 << 10, &v[i]), DMEM_OK);
  wait_settled(p, out);
  for (int i = 0; i < N; i++) dmem__hostpool_free(p, v[i]);
  dmem__hostpool_destroy(p);
}

/* dmem_config_t.host_headroom bounds what the pool holds beyond its blocks:
 * the default keeps the demand of the burst (15 MiB) free ahead; a
 * headroom of 2 MiB keeps at most that, in chunks of at most 2 MiB (the
 * headroom, and here the block's need rounded up), plus the ends of full
 * chunks (less than a block each); 0 keeps nothing ahead: the thread adds
 * no chunk, and what is free is only the end of the last chunk the
 * allocations added and those of the full ones. */
TEST_CASE(small_headroom_holds_little_beyond_need) {
  dmem__hostpool_stats_t s;
  small_headroom_burst(DMEM_HOST_HEADROOM_DEFAULT, &s);
  CHECK_GE(s.free, (size_t)12 << 20); /* the default: the burst's demand ahead */
  small_headroom_burst((size_t)2 << 20, &s);
  CHECK_LE(s.free, (size_t)5 << 20); /* headroom + a chunk + chunk ends */
  CHECK_LE(s.reserved, ((size_t)256 * 61696) + ((size_t)5 << 20));
  small_headroom_burst(0, &s);
  CHECK_UEQ(s.background_grows, 0);
  CHECK_LE(s.free, (size_t)3 << 20); /* the last chunk's end + the full ones' */
  CHECK_LE(s.reserved, ((size_t)256 * 61696) + ((size_t)3 << 20));
}

/* With headroom 0, a block larger than the geometric chunk gets a chunk of
 * its own bytes rounded up to 2 MiB, not one of half of what the pool
 * holds (up to 1 GiB): 8 blocks of 5 MiB take 8 chunks of 6 MiB. */
TEST_CASE(zero_headroom_chunks_fit_the_block) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, 0, true, 0, 0, &p), DMEM_OK);
  enum { N = 8 };
  void *v[N];
  for (int i = 0; i < N; i++) {
    REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)5 << 20, &v[i]), DMEM_OK);
    memset(v[i], i, (size_t)5 << 20);
  }
  dmem__hostpool_stats_t s;
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows, N);
  CHECK_UEQ(s.background_grows, 0);
  /* each chunk: the block and its page-aligned front, in 64 KiB (2 MiB
   * grains pinned 6 MiB a block, of which 0.9 MiB was never used) */
  CHECK_UEQ(s.reserved, (size_t)N * ((5 << 20) + (64 << 10)));
  for (int i = 0; i < N; i++) {
    CHECK_EQ(((unsigned char *)v[i])[(5 << 20) - 1], i);
    dmem__hostpool_free(p, v[i]);
  }
  /* freed, the chunks serve the same blocks again without growing */
  for (int i = 0; i < N; i++) REQUIRE_EQ(dmem__hostpool_alloc(p, (size_t)5 << 20, &v[i]), DMEM_OK);
  dmem__hostpool_stats(p, &s);
  CHECK_UEQ(s.grows, N);
  for (int i = 0; i < N; i++) dmem__hostpool_free(p, v[i]);
  dmem__hostpool_destroy(p);
}
