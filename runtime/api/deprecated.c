/*
 * runtime/api/deprecated.c - the public names from before dmem_noun_verb, kept
 * for one version: each is exported with its old signature and calls the
 * function it was renamed to, so programs built against the old headers keep
 * running with this library. The headers declare them with
 * DMEM_DEPRECATED_API (dmem/status.h): a call in new code warns, naming the
 * new function. To remove them: delete this file and the "Names before
 * dmem_noun_verb" block at the end of each public header.
 */
#include "dmem/dmem.h"

dmem_status_t dmem_alloc(dmem_runtime_t *rt, size_t size, unsigned flags, dmem_handle_t *h_out) {
  return dmem_buffer_alloc(rt, size, flags, h_out);
}

dmem_status_t dmem_free(dmem_runtime_t *rt, dmem_handle_t h) { return dmem_buffer_free(rt, h); }

dmem_status_t dmem_lock(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream,
                        void **dev_ptr_out) {
  return dmem_buffer_lock(rt, h, stream, dev_ptr_out);
}

dmem_status_t dmem_unlock(dmem_runtime_t *rt, dmem_handle_t h) { return dmem_buffer_unlock(rt, h); }

dmem_status_t dmem_set_priority(dmem_runtime_t *rt, dmem_handle_t h, int priority) {
  return dmem_buffer_set_priority(rt, h, priority);
}

dmem_status_t dmem_spill(dmem_runtime_t *rt, dmem_handle_t h, dmem_tier_t tier) {
  return dmem_buffer_spill(rt, h, tier);
}

dmem_status_t dmem_unspill(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream) {
  return dmem_buffer_unspill(rt, h, stream);
}

dmem_status_t dmem_prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                            dmem_stream_t stream) {
  return dmem_buffer_prefetch(rt, hs, n, stream);
}

dmem_status_t dmem_evict(dmem_runtime_t *rt, size_t bytes, size_t *freed_out) {
  return dmem_runtime_evict(rt, bytes, freed_out);
}

dmem_status_t dmem_set_controller(dmem_runtime_t *rt, const dmem_controller_t *c) {
  return dmem_controller_set(rt, c);
}

dmem_status_t dmem_copy(dmem_runtime_t *rt, void *dst, const void *src, size_t n,
                        dmem_stream_t s) {
  return dmem_stream_copy(rt, dst, src, n, s);
}

dmem_status_t dmem_ipc_handle(dmem_runtime_t *rt, void *ptr, void *handle_out,
                              size_t *offset_out) {
  return dmem_device_ipc_handle(rt, ptr, handle_out, offset_out);
}
