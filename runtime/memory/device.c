/*
 * runtime/memory/device.c - device memory for buffers: a charge against the
 * runtime's device limit, then the backend's allocation. When either has no
 * room it says how short it is; the spill layer (spill/pressure.c) makes room
 * and asks again.
 */
#include "internal.h"

dmem_status_t dmem__device_alloc(dmem_runtime_t *rt, size_t size, void **dev_out,
                                 size_t *short_by_out) {
  size_t short_by = 0;
  if (!dmem__reserve(&rt->device_used, rt->limit, size, &short_by)) {
    *short_by_out = short_by;
    return DMEM_ERR_OUT_OF_MEMORY; /* the caller makes room or records the detail */
  }
  void *p = NULL;
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->device_alloc(rt->be, size, &p));
  if (st != DMEM_OK) {
    dmem_atomic_sub_relaxed(&rt->device_used, size);
    /* the device itself is full (other users, fragmentation) */
    if (st == DMEM_ERR_OUT_OF_MEMORY) *short_by_out = size;
    return st;
  }
  *dev_out = p;
  return DMEM_OK;
}

void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size) {
  if (dev) (void)dmem__fatal_keep(rt, rt->be->device_free(rt->be, dev));
  dmem_atomic_sub_relaxed(&rt->device_used, size);
}
