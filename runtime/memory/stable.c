/*
 * runtime/memory/stable.c - device memory whose address outlives it: the
 * memory source of buffers allocated with DMEM_BUFFER_STABLE_ADDRESS.
 *
 * Each such buffer owns a range of device address space, reserved at
 * dmem_buffer_alloc and given back at its reclaim (backend va_reserve / va_free).
 * While the buffer is resident, physical memory of the range's whole
 * (granularity-rounded) size is mapped there (mem_create, mem_map,
 * mem_set_access) and charged against the runtime's device limit like a
 * pool block; spilled, it is unmapped and released (mem_unmap,
 * mem_release) and the charge goes back. An unspill maps new physical
 * memory at the same address. The spill layer decides when (spill/move_out.c,
 * spill/retrieve.c, spill/reclaim.c) and makes room (spill/pressure.c).
 *
 * Records: one per range, in a process-wide table keyed by address (device
 * addresses are unique in a process), sharded; a shard's mutex guards its
 * chain only and nothing is called under it (innermost, like the pool's).
 * A record's other fields are written by whoever owns its buffer's move
 * (TRANSIT), or by dmem_buffer_alloc before the buffer is published, or by its
 * reclaim: never by two threads at once.
 *
 * Failures: a failed map leaves nothing mapped or charged; a failed unmap
 * leaves the memory mapped and charged, and the next map of the range finds
 * it mapped and keeps it (nothing wrote it meanwhile: the buffer was not
 * resident), so no byte is lost either way.
 */
#include "memory/memory.h"

#define STABLE_SHARDS 64u

typedef struct stable_rec {
  struct stable_rec *next; /* the shard's chain (its mutex) */
  void *va;
  size_t size;      /* reserved and (while mapped) charged bytes: rounded */
  uint64_t handle;  /* the physical memory while mapped */
  bool mapped;
} stable_rec_t;

static struct stable_shard {
  pthread_mutex_t mu;
  stable_rec_t *head;
} shards[STABLE_SHARDS];

static pthread_once_t shards_once = PTHREAD_ONCE_INIT;
static void shards_init(void) {
  for (unsigned i = 0; i < STABLE_SHARDS; i++) pthread_mutex_init(&shards[i].mu, NULL);
}

static struct stable_shard *shard_of(const void *va) {
  pthread_once(&shards_once, shards_init);
  uintptr_t x = (uintptr_t)va;
  x ^= x >> 21; /* ranges are granularity-aligned: mix in the high bits */
  x ^= x >> 33;
  return &shards[(x * 0x9E3779B97F4A7C15ull) >> 58]; /* top 6 bits: 64 shards */
}

_Static_assert(STABLE_SHARDS == 64, "shard_of takes the top 6 bits");

static stable_rec_t *rec_find(const void *va) {
  struct stable_shard *sh = shard_of(va);
  pthread_mutex_lock(&sh->mu);
  stable_rec_t *r = sh->head;
  while (r && r->va != va) r = r->next;
  pthread_mutex_unlock(&sh->mu);
  return r;
}

dmem_status_t dmem__stable_granularity(dmem_runtime_t *rt, size_t *granularity_out) {
  size_t g = 0;
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->vmm_granularity(rt->be, &g));
  if (st == DMEM_OK) *granularity_out = g;
  return st;
}

dmem_status_t dmem__stable_reserve(dmem_runtime_t *rt, size_t size, void **va_out,
                                   size_t *rounded_out) {
  size_t g = 0;
  dmem_status_t st = dmem__stable_granularity(rt, &g);
  if (st != DMEM_OK) return st;
  if (size > SIZE_MAX - (g - 1))
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "stable buffer of %zu bytes: too large", size);
  size_t rounded = (size + g - 1) / g * g;
  stable_rec_t *r = calloc(1, sizeof *r);
  if (!r)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "stable buffer: calloc(%zu)", sizeof *r);
  void *va = NULL;
  st = dmem__fatal_keep(rt, rt->be->va_reserve(rt->be, rounded, &va));
  if (st != DMEM_OK) {
    free(r);
    return st;
  }
  r->va = va;
  r->size = rounded;
  struct stable_shard *sh = shard_of(va);
  pthread_mutex_lock(&sh->mu);
  r->next = sh->head;
  sh->head = r;
  pthread_mutex_unlock(&sh->mu);
  *va_out = va;
  *rounded_out = rounded;
  return DMEM_OK;
}

size_t dmem__stable_size(const void *va) {
  stable_rec_t *r = rec_find(va);
  return r ? r->size : 0;
}

bool dmem__stable_mapped(const void *va) {
  stable_rec_t *r = rec_find(va);
  return r && r->mapped;
}

dmem_status_t dmem__stable_map(dmem_runtime_t *rt, void *va, size_t *short_by_out) {
  stable_rec_t *r = rec_find(va);
  if (!r)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "stable map: %p is no stable range", va);
  if (r->mapped) return DMEM_OK; /* an earlier unmap failed: the memory is still there */
  size_t short_by = 0;
  if (!dmem__device_charge(rt, r->size, &short_by)) {
    *short_by_out = short_by;
    return DMEM_ERR_OUT_OF_MEMORY; /* the caller makes room or records the detail */
  }
  uint64_t h = 0;
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->mem_create(rt->be, r->size, &h));
  if (st != DMEM_OK) {
    dmem__device_uncharge(rt, r->size);
    if (st == DMEM_ERR_OUT_OF_MEMORY) *short_by_out = r->size;
    return st;
  }
  st = dmem__fatal_keep(rt, rt->be->mem_map(rt->be, va, r->size, h));
  if (st == DMEM_OK) {
    st = dmem__fatal_keep(rt, rt->be->mem_set_access(rt->be, va, r->size));
    if (st != DMEM_OK) (void)dmem__fatal_keep(rt, rt->be->mem_unmap(rt->be, va, r->size));
  }
  if (st != DMEM_OK) {
    (void)dmem__fatal_keep(rt, rt->be->mem_release(rt->be, h));
    dmem__device_uncharge(rt, r->size);
    return st;
  }
  r->handle = h;
  r->mapped = true;
  return DMEM_OK;
}

dmem_status_t dmem__stable_unmap(dmem_runtime_t *rt, void *va) {
  stable_rec_t *r = rec_find(va);
  if (!r || !r->mapped) return DMEM_OK;
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->mem_unmap(rt->be, va, r->size));
  if (st != DMEM_OK) return st; /* still mapped and charged: the next map keeps it */
  /* unmapped: the memory is the device's again even if the release fails
   * (a failed free fails only with a lost context, which frees it) */
  dmem_status_t st2 = dmem__fatal_keep(rt, rt->be->mem_release(rt->be, r->handle));
  r->mapped = false;
  r->handle = 0;
  dmem__device_uncharge(rt, r->size);
  return st2;
}

void dmem__stable_free(dmem_runtime_t *rt, void *va) {
  struct stable_shard *sh = shard_of(va);
  pthread_mutex_lock(&sh->mu);
  stable_rec_t **pp = &sh->head;
  while (*pp && (*pp)->va != va) pp = &(*pp)->next;
  stable_rec_t *r = *pp;
  if (r) *pp = r->next;
  pthread_mutex_unlock(&sh->mu);
  if (!r) return;
  if (r->mapped) {
    (void)dmem__fatal_keep(rt, rt->be->mem_unmap(rt->be, va, r->size));
    (void)dmem__fatal_keep(rt, rt->be->mem_release(rt->be, r->handle));
    dmem__device_uncharge(rt, r->size);
  }
  (void)dmem__fatal_keep(rt, rt->be->va_free(rt->be, va, r->size));
  free(r);
}
