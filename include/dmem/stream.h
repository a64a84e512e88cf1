/*
 * dmem/stream.h - streams, stream-ordered host functions and copies.
 *
 * Under the CUDA backend a dmem_stream_t is a cudaStream_t: callers may pass
 * streams they created themselves. Under the host backend streams are FIFO
 * worker threads and must come from dmem_stream_create. NULL is the default
 * stream. Every function here is thread-safe.
 */
#ifndef DMEM_STREAM_H
#define DMEM_STREAM_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Create a stream (non-blocking with respect to the default stream under
 * CUDA). Destroy it with dmem_stream_destroy, not cudaStreamDestroy: dmem
 * may record an event on it for earlier dmem_stream_release calls until
 * then (launch.h).
 * @param s_out receives the stream; untouched on failure.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt or s_out NULL);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY; DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL.
 */
DMEM_API dmem_status_t dmem_stream_create(dmem_runtime_t *rt, dmem_stream_t *s_out);

/**
 * Destroy a stream made by dmem_stream_create after its queued work has run.
 * Releases of it still waiting for their event get it first (launch.h).
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL or s NULL: the default
 *         stream is not destroyed);
 *         DMEM_ERR_BUSY (buffers are still registered on s: call
 *         dmem_sync_and_unlock first; the stream is left as it was);
 *         DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL.
 */
DMEM_API dmem_status_t dmem_stream_destroy(dmem_runtime_t *rt, dmem_stream_t s);

/**
 * Block until all work queued on s has completed (NULL: the default stream).
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_DEVICE;
 *         DMEM_ERR_DEVICE_FATAL.
 */
DMEM_API dmem_status_t dmem_stream_synchronize(dmem_runtime_t *rt, dmem_stream_t s);

/**
 * Run fn(user) in stream order on s (cudaLaunchHostFunc under CUDA; the host
 * backend's "kernels"). fn must not call CUDA, and must not block on work
 * queued after it on the same stream. When this call fails, fn is never
 * called.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt or fn NULL);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY; DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL.
 */
DMEM_API dmem_status_t dmem_stream_enqueue_host(dmem_runtime_t *rt, dmem_stream_t s,
                                                void (*fn)(void *user), void *user);

/**
 * Copy n bytes between any two addresses the backend knows (device addresses
 * of locked buffers, host memory), ordered on s. Returns once the copy is
 * enqueued; synchronise s before reading a host destination. n == 0 is a
 * no-op. Under CUDA, pageable (not page-locked) host memory follows CUDA's
 * rules for cudaMemcpyAsync: the host side may be read or written when the
 * call is made rather than in stream order, so synchronise s before a copy
 * whose host side depends on earlier work on s.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL, dst/src NULL with
 *         n > 0, or dst + n or src + n past the end of the address space,
 *         such as n SIZE_MAX); DMEM_ERR_HOST_OUT_OF_MEMORY; DMEM_ERR_DEVICE;
 *         DMEM_ERR_DEVICE_FATAL. dmem cannot check that the n bytes are
 *         memory the caller owns: copying past a buffer's end is undefined.
 */
DMEM_API dmem_status_t dmem_stream_copy(dmem_runtime_t *rt, void *dst, const void *src,
                                        size_t n, dmem_stream_t s);

/* ---- Names before dmem_noun_verb (deprecated) ----------------------------------
 * Kept for one version: exported, same signature and behaviour as the
 * function named in DMEM_DEPRECATED_API (they call it); a call warns
 * (-Wdeprecated-declarations). See dmem/status.h. */
DMEM_DEPRECATED_API(dmem_stream_copy)
dmem_status_t dmem_copy(dmem_runtime_t *rt, void *dst, const void *src, size_t n,
                        dmem_stream_t s);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_STREAM_H */
