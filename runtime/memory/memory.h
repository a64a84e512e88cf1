/*
 * runtime/memory/memory.h - the memory layer: device memory charged against
 * the runtime's limit (device.c) and the pinned host pool (hostpool.c).
 * It calls only core, the backend table and base; making room when memory
 * runs short is the spill layer's job (spill/pressure.c).
 */
#ifndef DMEM_MEMORY_LAYER_H
#define DMEM_MEMORY_LAYER_H

/* ---- device memory (memory/device.c) ------------------------------------------ */

/* Charge size bytes against the device limit and take them from the backend.
 * DMEM_ERR_OUT_OF_MEMORY when the limit or the device itself has no room:
 * *short_by_out is then how many bytes would have to be freed first. Other
 * statuses are backend errors. Nothing is spilled here. */
dmem_status_t dmem__device_alloc(dmem_runtime_t *rt, size_t size, void **dev_out,
                                 size_t *short_by_out);
/* Give back device memory taken with dmem__device_alloc (dev may be NULL:
 * then only the charge goes). */
void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size);

/* ---- pinned host pool (memory/hostpool.c) -------------------------------------- */

dmem_status_t dmem__hostpool_create(dmem__backend_t *be, dmem__hostpool_t **pool_out);
void dmem__hostpool_destroy(dmem__hostpool_t *pool);
dmem_status_t dmem__hostpool_alloc(dmem__hostpool_t *pool, size_t size, void **ptr_out);
void dmem__hostpool_free(dmem__hostpool_t *pool, void *ptr);

#endif /* DMEM_MEMORY_LAYER_H */
