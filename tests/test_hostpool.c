/* The pinned host pool (runtime/memory/hostpool.c) over a backend whose
 * pinned allocator can be made to fail. */
#include "check.h"
#include "internal.h"

static int fake_fail;
static dmem_status_t fake_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  (void)be;
  if (fake_fail)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "fake pinned allocator: no pages left for %zu bytes", size);
  *ptr_out = aligned_alloc(256, (size + 255) / 256 * 256); /* as pinned memory is */
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
  REQUIRE_EQ(dmem__hostpool_create(&be, &p), DMEM_OK);
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
  REQUIRE_EQ(dmem__hostpool_create(&be, &p), DMEM_OK);
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


/* Blocks of 64 KiB and more start on a page (the disk tier's O_DIRECT I/O
 * then needs no bounce copy); the bytes skipped in front stay usable, and a
 * range that only holds the block unaligned is still used rather than
 * growing the pool. */
TEST_CASE(large_blocks_start_on_a_page) {
  dmem__backend_t be = fake_backend();
  dmem__hostpool_t *p = NULL;
  REQUIRE_EQ(dmem__hostpool_create(&be, &p), DMEM_OK);
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
