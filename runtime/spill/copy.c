/*
 * spill/copy.c - the copy engine: the runtime's two copy streams (spills on
 * rt->spill_stream, device->host; retrieves and prefetches on
 * rt->unspill_stream, host->device), so that spills and unspills use both
 * copy engines at once and neither waits behind the callers' kernels; large
 * copies are issued in chunks.
 */
#include "spill/spill.h"

dmem_status_t dmem__copy_chunked(dmem_runtime_t *rt, void *dst, const void *src, size_t size,
                                 void *stream) {
  size_t chunk = rt->copy_chunk ? rt->copy_chunk : size;
  for (size_t off = 0; off < size; off += chunk) {
    size_t n = size - off < chunk ? size - off : chunk;
    dmem_status_t st = dmem__fatal_keep(
        rt, rt->be->memcpy_async(rt->be, (char *)dst + off, (const char *)src + off, n, stream));
    if (st != DMEM_OK) return st;
    if (size == 0) break;
  }
  return DMEM_OK;
}
