/*
 * runtime/memory/devmem.c - device memory for buffers and raw allocations:
 * a charge against the runtime's device limit (device_used: bytes in live
 * allocations), then a block of the stream-ordered pool (memory/pool.c).
 * When the limit or the pool has no room it says how short it is; the spill
 * layer (spill/pressure.c) makes room and asks again. Nothing here spills,
 * frees a slab or waits on the host.
 */
#include "internal.h"

dmem_status_t dmem__device_alloc(dmem_runtime_t *rt, size_t size, void *stream, void **dev_out,
                                 bool *ordered_out, size_t *short_by_out) {
  size_t short_by = 0;
  if (!dmem__reserve(&rt->device_used, rt->limit, size, &short_by)) {
    *short_by_out = short_by;
    return DMEM_ERR_OUT_OF_MEMORY; /* the caller makes room or records the detail */
  }
  void *p = NULL;
  bool ordered = false;
  dmem_status_t st =
      dmem__fatal_keep(rt, dmem__pool_alloc_ordered(rt->pool, size, stream, &p, &ordered));
  if (st != DMEM_OK) {
    dmem_atomic_sub_relaxed(&rt->device_used, size);
    /* no free range fits and no slab can be added */
    if (st == DMEM_ERR_OUT_OF_MEMORY) *short_by_out = size;
    return st;
  }
  *dev_out = p;
  if (ordered_out) *ordered_out = ordered;
  return DMEM_OK;
}

void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size, void *stream) {
  dmem__pool_free(rt->pool, dev, size, stream);
  dmem_atomic_sub_relaxed(&rt->device_used, size);
}

void dmem__device_release_after(dmem_runtime_t *rt, void *dev, size_t size, void *event) {
  dmem__pool_free_after(rt->pool, dev, size, event);
  dmem_atomic_sub_relaxed(&rt->device_used, size);
}
