/*
 * runtime/memory/pool_tags.h - the stream keys the pool files blocks and
 * records events under (pool_tags.c keeps the per-thread key). Its own
 * header, included by the pool files that key streams, so that
 * pool_parts.h calls no function of a file that includes it.
 */
#ifndef DMEM_MEMORY_POOL_TAGS_H
#define DMEM_MEMORY_POOL_TAGS_H

#include "memory/pool_parts.h"

/* The key of cudaStreamPerThread in the calling thread (one per thread). */
uintptr_t dmem__pool_thread_key(void);

/* The key the pool files a stream's blocks and records under. */
static inline uintptr_t pool_stream_key(const dmem__pool_t *p, void *stream) {
  if (!stream) return 1; /* the default stream (CUDA: cudaStreamLegacy is 0x1 too) */
  if (p->cuda && stream == POOL_CUDA_PER_THREAD_STREAM) return dmem__pool_thread_key();
  return (uintptr_t)stream;
}

#endif /* DMEM_MEMORY_POOL_TAGS_H */
