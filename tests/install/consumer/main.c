/*
 * tests/install/consumer/main.c - uses an installed dmem through <dmem/dmem.h>
 * only (the public API table of docs/design.md), on the host backend: alloc,
 * lock, copy, unlock, spill (host and disk tiers), unspill, launch_async,
 * sync_and_unlock, stats, free, with the data checked after every move.
 * Prints "consumer: OK" and exits 0, or names the failed call and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dmem/dmem.h>

#define SIZE ((size_t)1 << 20)

static int failures;

#define EXPECT(cond)                                                      \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "consumer: %s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
      failures++;                                                         \
    }                                                                     \
  } while (0)

#define TRY(call)                                                                        \
  do {                                                                                   \
    dmem_status_t st_ = (call);                                                          \
    if (st_ != DMEM_OK) {                                                                \
      fprintf(stderr, "consumer: %s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call,       \
              dmem_status_name(st_), dmem_last_error_detail());                         \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31u + seed * 7u + (i >> 10));
}

static int same(const unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != (unsigned char)(i * 31u + seed * 7u + (i >> 10))) return 0;
  return 1;
}

/* Read a buffer's bytes back through lock / copy / unlock. */
static void read_back(dmem_runtime_t *rt, dmem_stream_t s, dmem_handle_t h, unsigned char *out) {
  void *dev = NULL;
  TRY(dmem_buffer_lock(rt, h, s, &dev));
  TRY(dmem_stream_copy(rt, out, dev, SIZE, s));
  TRY(dmem_stream_synchronize(rt, s));
  TRY(dmem_buffer_unlock(rt, h));
}

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  TRY(dmem_buffer_info(rt, h, &info));
  return info.state;
}

/* The "kernel": a stream-ordered copy of new contents into the buffer. */
typedef struct overwrite_arg {
  dmem_runtime_t *rt;
  const unsigned char *src;
} overwrite_arg_t;

static dmem_status_t overwrite(void *user, dmem_stream_t s, void *const *dev_ptrs, size_t n) {
  const overwrite_arg_t *a = (const overwrite_arg_t *)user;
  for (size_t i = 0; i < n; i++) {
    dmem_status_t st = dmem_stream_copy(a->rt, dev_ptrs[i], a->src, SIZE, s);
    if (st != DMEM_OK) return st;
  }
  return DMEM_OK;
}

int main(void) {
  EXPECT(strcmp(dmem_status_name(DMEM_ERR_BUSY), "DMEM_ERR_BUSY") == 0);

  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = 16 * SIZE;
  dmem_runtime_t *rt = NULL;
  TRY(dmem_runtime_create(&cfg, &rt));
  EXPECT(dmem_runtime_backend(rt) == DMEM_BACKEND_HOST);
  dmem_stream_t s = NULL;
  TRY(dmem_stream_create(rt, &s));

  unsigned char *host = malloc(SIZE), *other = malloc(SIZE);
  if (!host || !other) return 1;

  /* alloc, lock, copy in, unlock */
  dmem_handle_t h = DMEM_HANDLE_NULL;
  TRY(dmem_buffer_alloc(rt, SIZE, DMEM_ALLOC_DEFAULT, &h));
  EXPECT(h != DMEM_HANDLE_NULL);
  fill(host, SIZE, 1);
  void *dev = NULL;
  TRY(dmem_buffer_lock(rt, h, s, &dev));
  EXPECT(dmem_buffer_spill(rt, h, DMEM_TIER_HOST) == DMEM_ERR_BUSY); /* locked: not spillable */
  TRY(dmem_stream_copy(rt, dev, host, SIZE, s));
  TRY(dmem_stream_synchronize(rt, s));
  TRY(dmem_buffer_unlock(rt, h));
  EXPECT(dmem_buffer_unlock(rt, h) == DMEM_ERR_NOT_LOCKED);

  /* spill to host, unspill, check */
  TRY(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  EXPECT(state_of(rt, h) == DMEM_STATE_DEFERRED_HOST);
  TRY(dmem_buffer_unspill(rt, h, s));
  TRY(dmem_stream_synchronize(rt, s));
  EXPECT(state_of(rt, h) == DMEM_STATE_RESIDENT);
  memset(other, 0, SIZE);
  read_back(rt, s, h, other);
  EXPECT(same(other, SIZE, 1));

  /* launch_async overwrites the buffer in stream order; sync_and_unlock */
  fill(host, SIZE, 2);
  overwrite_arg_t arg = {rt, host};
  TRY(dmem_launch_async(rt, s, &h, 1, overwrite, &arg));
  dmem_buffer_info_t info;
  TRY(dmem_buffer_info(rt, h, &info));
  EXPECT(info.lock_count == 1);
  TRY(dmem_sync_and_unlock(rt, s));
  TRY(dmem_buffer_info(rt, h, &info));
  EXPECT(info.lock_count == 0);
  EXPECT(info.size == SIZE);

  /* spill to disk, then a lock brings it back */
  TRY(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  EXPECT(state_of(rt, h) == DMEM_STATE_DEFERRED_DISK);
  memset(other, 0, SIZE);
  read_back(rt, s, h, other);
  EXPECT(same(other, SIZE, 2));
  EXPECT(state_of(rt, h) == DMEM_STATE_RESIDENT);

  dmem_stats_t st;
  TRY(dmem_stats(rt, &st));
  EXPECT(st.spill_count >= 2);
  EXPECT(st.unspill_count >= 2);
  EXPECT(st.bytes_spilled >= 2 * SIZE);
  EXPECT(st.buffer_count == 1);
  EXPECT(st.device_limit == 16 * SIZE);

  TRY(dmem_buffer_free(rt, h));
  EXPECT(dmem_buffer_free(rt, h) == DMEM_ERR_STALE_HANDLE);
  TRY(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
  free(host);
  free(other);

  if (failures) {
    fprintf(stderr, "consumer: %d check(s) failed\n", failures);
    return 1;
  }
  printf("consumer: OK (dmem %d.%d.%d, %llu spills, %llu unspills)\n", DMEM_VERSION_MAJOR,
         DMEM_VERSION_MINOR, DMEM_VERSION_PATCH, (unsigned long long)st.spill_count,
         (unsigned long long)st.unspill_count);
  return 0;
}
