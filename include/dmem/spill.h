/*
 * dmem/spill.h - explicit moves between tiers, and eviction by policy.
 * Every function here is thread-safe.
 */
#ifndef DMEM_SPILL_H
#define DMEM_SPILL_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Move an unlocked buffer to `tier` and wait for the move to finish. A
 * resident buffer is copied device->host on the runtime's own copy stream
 * (never the caller's); a buffer in the host tier may be moved further to
 * disk or to the controller. Spilling to the tier the buffer is already in is
 * a no-op. A lock arriving during the copy cancels the spill; this call then
 * returns DMEM_ERR_BUSY and the buffer stays resident with its data intact.
 * A lock arriving during a write to disk stops it at its next chunk (8 MiB)
 * the same way, whether the buffer came from the device or the host tier.
 *
 * To the host tier with a host limit (dmem_config_t.host_limit): the spill
 * may take the tier past its limit, and the runtime's I/O threads then push
 * the least recently used host-tier buffers down to disk in the background;
 * when the tier is too far past it, the buffer goes straight to disk. A
 * write to disk that fails (the spill directory not writable, the disk full,
 * an I/O error) is DMEM_ERR_IO, the detail says which, and the buffer stays
 * where it was (on the device or in the host tier), data intact.
 *
 * @param tier DMEM_TIER_HOST, DMEM_TIER_DISK or DMEM_TIER_CONTROLLER (the
 *             latter only with a controller that has store and retrieve).
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt NULL, tier not one of those three
 *                                    (DMEM_TIER_DEVICE included: that is
 *                                    dmem_buffer_unspill), controller tier without
 *                                    such a controller, or moving from
 *                                    disk/controller back to host;
 *         DMEM_ERR_STALE_HANDLE      zero, freed, forged or another
 *                                    runtime's handle, or freed by another
 *                                    thread before the controller's store
 *                                    began (not stored; the buffer is
 *                                    reclaimed);
 *         DMEM_ERR_BUSY              locked, pinned, being moved by another
 *                                    thread or by the calling thread (from a
 *                                    controller callback on its own buffer,
 *                                    at once: dmem/controller.h), or the
 *                                    spill was cancelled;
 *         DMEM_ERR_HOST_OUT_OF_MEMORY, DMEM_ERR_IO, DMEM_ERR_CALLBACK (the
 *                                    buffer stays where it was, data intact);
 *         DMEM_ERR_DEVICE, DMEM_ERR_DEVICE_FATAL.
 */
DMEM_API dmem_status_t dmem_buffer_spill(dmem_runtime_t *rt, dmem_handle_t h, dmem_tier_t tier);

/**
 * Bring a deferred buffer back to the device, with the host->device copy
 * ordered on `stream` (returns once it is enqueued). A resident buffer is left
 * as it is. Does not lock. A buffer on disk is read into pinned staging
 * (this call waits for the read) and copied to the device from there; it
 * does not become a host-tier copy. A buffer being pushed down to disk stops
 * that write at its next chunk and comes back from the host tier.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL);
 *         DMEM_ERR_STALE_HANDLE; DMEM_ERR_BUSY (called from a controller
 *         callback on a buffer the calling thread is moving, at once: see
 *         dmem/controller.h; a move by another thread is waited for);
 *         DMEM_ERR_OUT_OF_MEMORY (as for dmem_buffer_alloc); DMEM_ERR_HOST_OUT_OF_MEMORY
 *         (no host memory for the staging of a disk or controller copy, or
 *         for the spills that make room); DMEM_ERR_IO; DMEM_ERR_CALLBACK;
 *         DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL; DMEM_ERR_FORKED (see
 *         dmem/runtime.h). On failure the bytes stay where they were.
 */
DMEM_API dmem_status_t dmem_buffer_unspill(dmem_runtime_t *rt, dmem_handle_t h,
                                           dmem_stream_t stream);

/**
 * Start bringing buffers back to the device that the caller will lock soon,
 * without locking them. Each deferred buffer's host->device copy is enqueued
 * on the runtime's own host->device copy stream (so it starts at once, not
 * behind the work queued on `stream`, and overlaps spills, which use the
 * device->host stream), and `stream` is made to wait for the whole batch
 * with one event: work enqueued on `stream` after this call sees the bytes.
 * Returns once the copies are enqueued (a buffer on disk is read first). A
 * resident buffer is left as it is; a buffer whose spill copy is in flight
 * has its spill cancelled (it stays resident). Making room for the copies
 * may spill other unlocked buffers by policy, as a lock would. Nothing is
 * locked, but each buffer counts as just used, so the policy takes the
 * others first (DMEM_EVICTION_LRU: its LRU position is that of a buffer
 * unlocked now; the default policy: a buffer brought back is the newest
 * arrival of its class, one resident already is marked as by an unlock:
 * dmem_buffer_set_priority); it may still be spilled again before it is locked
 * (the lock then brings it back as usual). A lock that arrives while the
 * prefetch copy is in flight orders its stream after that copy.
 *
 * The handles are checked first: a zero, freed, forged or another
 * runtime's handle anywhere in hs gives DMEM_ERR_STALE_HANDLE and nothing
 * is prefetched. Then they are taken in order; on the first failure the
 * call stops and returns its status: the buffers before it stay prefetched
 * (and `stream` waits for them), the ones after it are untouched.
 *
 * @param hs  n handles (may be NULL when n is 0: a no-op); duplicates are
 *            allowed.
 * @param stream  the stream whose later work uses the buffers (NULL: the
 *                default stream).
 * Thread-safe.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL, hs NULL with n > 0,
 *         or n > SIZE_MAX / 16); DMEM_ERR_STALE_HANDLE; DMEM_ERR_BUSY (called from a
 *         controller callback on a buffer the calling thread is moving, at
 *         once: see dmem/controller.h);
 *         DMEM_ERR_OUT_OF_MEMORY (no room even after spilling; as for
 *         dmem_buffer_alloc);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY; DMEM_ERR_IO; DMEM_ERR_CALLBACK;
 *         DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL. A buffer that failed stays
 *         where it was, data intact.
 */
DMEM_API dmem_status_t dmem_buffer_prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs,
                                            size_t n, dmem_stream_t stream);

/**
 * Spill unlocked buffers by policy (or by the controller's victim selection)
 * until at least `bytes` of device memory have been freed or nothing more can
 * be spilled (bytes SIZE_MAX: every unlocked, unpinned buffer). bytes 0 is a
 * no-op: no eviction pass, no controller call, *freed_out 0. Buffers being
 * moved (by any thread; from a controller callback, its own buffer) are
 * passed over.
 *
 * @param freed_out receives the bytes actually freed (may be less than
 *                  `bytes`); may be NULL. Written on DMEM_OK only.
 * @return DMEM_OK (even if fewer bytes could be freed: victims that could
 *         not be spilled for lack of host memory or a failed disk write
 *         stay resident);
 *         DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_CALLBACK (victim
 *         selection failed); DMEM_ERR_HOST_OUT_OF_MEMORY (no host memory
 *         for the list of victims); DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL;
 *         DMEM_ERR_FORKED (see dmem/runtime.h).
 */
DMEM_API dmem_status_t dmem_runtime_evict(dmem_runtime_t *rt, size_t bytes, size_t *freed_out);

/* ---- Names before dmem_noun_verb (deprecated) ----------------------------------
 * Kept for one version: exported, same signature and behaviour as the
 * function named in DMEM_DEPRECATED_API (they call it); a call warns
 * (-Wdeprecated-declarations). See dmem/status.h. */
DMEM_DEPRECATED_API(dmem_buffer_spill)
dmem_status_t dmem_spill(dmem_runtime_t *rt, dmem_handle_t h, dmem_tier_t tier);
DMEM_DEPRECATED_API(dmem_buffer_unspill)
dmem_status_t dmem_unspill(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream);
DMEM_DEPRECATED_API(dmem_buffer_prefetch)
dmem_status_t dmem_prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                            dmem_stream_t stream);
DMEM_DEPRECATED_API(dmem_runtime_evict)
dmem_status_t dmem_evict(dmem_runtime_t *rt, size_t bytes, size_t *freed_out);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_SPILL_H */
