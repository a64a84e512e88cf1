/*
 * runtime/memory/raw.c - the table of live raw allocations
 * (dmem_device_malloc): pointer -> size. It is what makes a bad free
 * (an unknown pointer, a pointer inside a block, a double free) a clear
 * DMEM_ERR_INVALID_ARGUMENT instead of a corrupted pool, and what
 * dmem_device_adopt takes a pool block out of when it becomes a buffer.
 *
 * 64 shards, each an open-addressed table (linear probing, deletion by
 * backward shift) under its own mutex, chosen by a hash of the pointer:
 * threads freeing different blocks rarely meet on one mutex. Each shard
 * also counts the bytes of its entries (dmem_stats' raw_used), under the
 * mutex it holds anyway: an allocation and its free cost no counter
 * update of their own.
 */
#include "memory/memory.h"
#include <string.h>

#define RAW_SHARDS 64u

typedef struct raw_entry {
  void *ptr; /* NULL: empty */
  size_t size;
  uint8_t src; /* its source (dmem__devsrc_t): a pool range, a dedicated block */
} raw_entry_t;

typedef struct raw_shard {
  _Alignas(64) pthread_mutex_t mu;
  raw_entry_t *v;
  size_t cap; /* power of two, or 0 */
  size_t n;
  /* Bytes of the live entries. Written under mu (relaxed stores: no RMW),
   * read without it by dmem__raw_bytes (relaxed: a snapshot). */
  _Atomic size_t bytes;
} raw_shard_t;

struct dmem__raw {
  raw_shard_t shards[RAW_SHARDS];
  /* All shards' bytes (one add per insert, one subtraction per remove) and
   * the most at once (dmem__raw_peak); relaxed, accounting only. */
  _Alignas(64) _Atomic size_t total;
  _Atomic size_t peak;
};

static inline uint64_t raw_hash(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p >> 8; /* blocks are 256-byte aligned */
  x *= 0x9E3779B97F4A7C15ull;
  return x ^ (x >> 29);
}

static inline raw_shard_t *raw_shard(dmem__raw_t *t, const void *p, uint64_t *h) {
  *h = raw_hash(p);
  return &t->shards[*h & (RAW_SHARDS - 1)];
}

dmem_status_t dmem__raw_create(dmem__raw_t **raw_out) {
  dmem__raw_t *t = aligned_alloc(64, sizeof *t);
  if (!t) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "raw allocation table");
  memset(t, 0, sizeof *t);
  for (unsigned i = 0; i < RAW_SHARDS; i++) pthread_mutex_init(&t->shards[i].mu, NULL);
  *raw_out = t;
  return DMEM_OK;
}

void dmem__raw_destroy(dmem__raw_t *t) {
  if (!t) return;
  for (unsigned i = 0; i < RAW_SHARDS; i++) {
    pthread_mutex_destroy(&t->shards[i].mu);
    free(t->shards[i].v);
  }
  free(t);
}

/* Under s->mu: grow to twice the capacity (load factor kept under 1/2). */
static bool raw_grow(raw_shard_t *s) {
  size_t cap = s->cap ? s->cap * 2 : 64;
  raw_entry_t *v = calloc(cap, sizeof *v);
  if (!v) return false;
  for (size_t i = 0; i < s->cap; i++) {
    if (!s->v[i].ptr) continue;
    size_t j = (raw_hash(s->v[i].ptr) >> 6) & (cap - 1);
    while (v[j].ptr) j = (j + 1) & (cap - 1);
    v[j] = s->v[i];
  }
  free(s->v);
  s->v = v;
  s->cap = cap;
  return true;
}

dmem_status_t dmem__raw_insert(dmem__raw_t *t, void *ptr, size_t size, dmem__devsrc_t src) {
  uint64_t h;
  raw_shard_t *s = raw_shard(t, ptr, &h);
  dmem__mutex_lock(&s->mu, DMEM__RANK_RAW);
  if ((s->n + 1) * 2 > s->cap && !raw_grow(s)) {
    dmem__mutex_unlock(&s->mu, DMEM__RANK_RAW);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "raw allocation table could not grow");
  }
  size_t j = (h >> 6) & (s->cap - 1);
  while (s->v[j].ptr) {
    DMEM_ASSERT(s->v[j].ptr != ptr); /* the pool never hands out a live block */
    j = (j + 1) & (s->cap - 1);
  }
  s->v[j].ptr = ptr;
  s->v[j].size = size;
  s->v[j].src = (uint8_t)src;
  s->n++;
  dmem_atomic_store_relaxed(&s->bytes, dmem_atomic_load_relaxed(&s->bytes) + size);
  dmem__mutex_unlock(&s->mu, DMEM__RANK_RAW);
  size_t now = dmem_atomic_add_relaxed(&t->total, size) + size;
  size_t p = dmem_atomic_load_relaxed(&t->peak);
  while (now > p && !dmem_atomic_cas_relaxed(&t->peak, &p, now)) {
  }
  return DMEM_OK;
}

/* Forget ptr's entry unless pooled_only is set and it is not a pool block
 * (then DMEM_ERR_INVALID_ARGUMENT, detail recorded, nothing changes). */
static dmem_status_t raw_remove(dmem__raw_t *t, void *ptr, bool pooled_only, size_t *size_out,
                                dmem__devsrc_t *src_out) {
  uint64_t h;
  raw_shard_t *s = raw_shard(t, ptr, &h);
  dmem__mutex_lock(&s->mu, DMEM__RANK_RAW);
  size_t mask = s->cap - 1, j = (h >> 6) & mask;
  if (s->cap) {
    while (s->v[j].ptr && s->v[j].ptr != ptr) j = (j + 1) & mask;
  }
  if (!s->cap || !s->v[j].ptr) {
    dmem__mutex_unlock(&s->mu, DMEM__RANK_RAW);
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "%p is not a live dmem_device_malloc allocation of this runtime "
                       "(unknown, inside a block, or already freed)",
                       ptr);
  }
  size_t size = s->v[j].size;
  dmem__devsrc_t src = (dmem__devsrc_t)s->v[j].src;
  if (src != DMEM__SRC_POOL && pooled_only) {
    dmem__mutex_unlock(&s->mu, DMEM__RANK_RAW);
    if (src == DMEM__SRC_DEDICATED)
      return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                         "%p is a dedicated block (dmem_device_malloc_dedicated): dedicated "
                         "blocks cannot be adopted as buffers (copy the bytes instead)",
                         ptr);
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "%p is a block of the %s source, not of the pool: it cannot be adopted "
                       "as a buffer (copy the bytes instead)",
                       ptr, dmem__device_source_name(src));
  }
  /* backward-shift deletion: move later entries of the probe run up */
  size_t i = j;
  for (;;) {
    s->v[i].ptr = NULL;
    size_t k = i;
    for (;;) {
      k = (k + 1) & mask;
      if (!s->v[k].ptr) goto done;
      size_t home = (raw_hash(s->v[k].ptr) >> 6) & mask;
      /* k may fill i unless its home lies cyclically in (i, k] */
      if (i <= k ? (home <= i || home > k) : (home <= i && home > k)) break;
    }
    s->v[i] = s->v[k];
    i = k;
  }
done:
  s->n--;
  dmem_atomic_store_relaxed(&s->bytes, dmem_atomic_load_relaxed(&s->bytes) - size);
  dmem__mutex_unlock(&s->mu, DMEM__RANK_RAW);
  dmem_atomic_sub_relaxed(&t->total, size);
  *size_out = size;
  *src_out = src;
  return DMEM_OK;
}

dmem_status_t dmem__raw_remove(dmem__raw_t *t, void *ptr, size_t *size_out,
                               dmem__devsrc_t *src_out) {
  return raw_remove(t, ptr, false, size_out, src_out);
}

dmem_status_t dmem__raw_remove_pooled(dmem__raw_t *t, void *ptr, size_t *size_out) {
  dmem__devsrc_t src;
  return raw_remove(t, ptr, true, size_out, &src);
}

size_t dmem__raw_bytes(dmem__raw_t *t) {
  size_t n = 0;
  for (unsigned i = 0; i < RAW_SHARDS; i++) n += dmem_atomic_load_relaxed(&t->shards[i].bytes);
  return n;
}

size_t dmem__raw_peak(dmem__raw_t *t) {
  size_t p = dmem_atomic_load_relaxed(&t->peak), now = dmem_atomic_load_relaxed(&t->total);
  return p > now ? p : now;
}

void dmem__raw_peak_reset(dmem__raw_t *t) {
  dmem_atomic_store_relaxed(&t->peak, dmem_atomic_load_relaxed(&t->total));
}
