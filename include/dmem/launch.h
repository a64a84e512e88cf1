/*
 * dmem/launch.h - RMMEP-1 entry points for wrapping kernel launches.
 *
 * A C library wraps each kernel launch in one of these calls; dmem locks the
 * buffers (retrieving spilled ones), passes their device addresses to the
 * launch function, and unlocks them once the work is done.
 *
 * The launch function runs with no dmem-internal mutex held and may call back
 * into the runtime. When an entry point fails before calling it, it is never
 * called. Every function here is thread-safe.
 *
 * Shared streams. Several threads may launch on, sync and release one stream
 * (the default stream is shared by every thread of a process). The rule:
 *  - a launch's buffers enter the stream's registry when its launch function
 *    returns (its work is then on the stream); until then they are locked by
 *    the launch alone, and no sync or release, on any thread or inside the
 *    launch function itself, unlocks them;
 *  - dmem_sync_and_unlock(S) and dmem_stream_release(S) cover exactly the
 *    launches registered on S when the call begins: a launch whose function
 *    returns while the call is under way stays registered (and locked) for a
 *    later sync or release of S.
 * Each registered launch is unlocked by exactly one sync or release. When two
 * threads sync or release one stream at once, each unlocks what it took:
 * a buffer the other call took may still be locked for as long as that call
 * takes to finish (a completed release's buffers likewise, until the thread
 * that found it completed has unlocked them).
 */
#ifndef DMEM_LAUNCH_H
#define DMEM_LAUNCH_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Lock all `n` handles (all or nothing), call fn(user, NULL, ptrs, n) on the
 * default stream, synchronise the default stream, unlock all. Duplicated
 * handles are allowed (each is locked once per occurrence; the duplicates
 * get the same address). n == 0 calls fn with no buffers. The handles are
 * checked before anything is locked: a bad one anywhere in hs brings no
 * buffer back.
 *
 * @return fn's status if it was called and the synchronisation succeeded;
 *         DMEM_ERR_INVALID_ARGUMENT  rt or fn NULL, hs NULL with n > 0, or
 *                                    n > SIZE_MAX / 16 (more handles than
 *                                    memory can hold);
 *         DMEM_ERR_STALE_HANDLE      a zero, freed, forged or another
 *                                    runtime's handle in hs;
 *         any other status of dmem_buffer_lock (then fn is not called and nothing
 *         stays locked); DMEM_ERR_DEVICE / DMEM_ERR_DEVICE_FATAL from the
 *         synchronisation.
 */
DMEM_API dmem_status_t dmem_lock_and_launch(dmem_runtime_t *rt, const dmem_handle_t *hs,
                                            size_t n, dmem_launch_fn fn, void *user);

/**
 * Lock all `n` handles on `stream` (all or nothing), call
 * fn(user, stream, ptrs, n), then record them in the stream's lock registry.
 * The buffers stay locked until a dmem_sync_and_unlock(stream) or
 * dmem_stream_release(stream) that begins after fn has returned (see
 * "Shared streams" above). If fn fails, its buffers are still registered:
 * work it enqueued before failing may use them. If the registry cannot grow
 * (host memory), the call waits for the stream and unlocks them itself.
 * Duplicated handles are allowed (registered once per occurrence); a bad
 * handle anywhere in hs fails before anything is locked.
 *
 * @return fn's status; DMEM_ERR_INVALID_ARGUMENT (rt or fn NULL, hs NULL with
 *         n > 0, n > SIZE_MAX / 16); DMEM_ERR_STALE_HANDLE (a zero, freed,
 *         forged or another runtime's handle in hs: fn not called, nothing
 *         locked); any other status of dmem_buffer_lock (likewise), including
 *         DMEM_ERR_HOST_OUT_OF_MEMORY (the lock set of n > 16 handles could
 *         not be allocated, or no host memory to retrieve a spilled buffer;
 *         nothing locked).
 */
DMEM_API dmem_status_t dmem_launch_async(dmem_runtime_t *rt, dmem_stream_t stream,
                                         const dmem_handle_t *hs, size_t n,
                                         dmem_launch_fn fn, void *user);

/**
 * Take the launches registered on `stream` now, synchronise the stream, then
 * unlock them (RMMEP-1 syncAndUnlock). Launches registered after the call
 * began stay registered. A stream with nothing registered is just
 * synchronised (DMEM_OK).
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL);
 *         DMEM_ERR_DEVICE (synchronisation failed; the buffers stay
 *         registered and locked);
 *         DMEM_ERR_DEVICE_FATAL (the context is lost and runs no more work:
 *         the buffers are unlocked all the same, so that they can be freed
 *         and the stream destroyed).
 */
DMEM_API dmem_status_t dmem_sync_and_unlock(dmem_runtime_t *rt, dmem_stream_t stream);

/**
 * Take the launches registered on `stream` now and return at once; their
 * buffers are unlocked once the stream's work up to an event recorded on
 * `stream` after them has completed. No host stall, and no background
 * thread: a completed release unlocks its buffers as soon as anyone can
 * tell that it completed: dmem_stream_synchronize (of any stream),
 * dmem_sync_and_unlock, dmem_buffer_spill, dmem_runtime_evict, dmem_buffer_info,
 * dmem_stats, dmem_buffer_free, an allocation that needs room, dmem_runtime_poll.
 * Each of these looks at finished releases before it looks at lock counts;
 * when none is pending that costs one relaxed load.
 *
 * Releases in quick succession share one event. On a stream made by
 * dmem_stream_create (every stream of the host backend; while 32 such
 * streams are alive, 31 on the host backend, whose default stream counts
 * as one, a further one is as a caller's stream below), a
 * release within 50 us of the stream's last release event records
 * nothing: it joins the stream's open group (O(1), no allocation, no
 * runtime-wide lock; launches and releases on the stream take only the
 * stream's own lock), and the group gets one event, recorded on the
 * stream after all its launches, when it holds 64 releases or is 200 us
 * old (looked at every 8th release), or when any of the
 * calls above looks (one that finds the stream idle unlocks the group at
 * once, with no event). dmem_stream_synchronize(stream) and
 * dmem_sync_and_unlock(stream) cover the group with their
 * synchronisation, and dmem_stream_destroy records its event before the
 * stream goes. So a grouped release's buffers may stay locked until work
 * enqueued on the stream after the release (and before its group's event)
 * has finished, never less than the work before it. Other streams (CUDA
 * streams the caller made, which it may destroy right after this call, and
 * the default stream under CUDA) get an event at every release.
 *
 * A stream with nothing registered: DMEM_OK, nothing recorded.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY; DMEM_ERR_DEVICE / DMEM_ERR_DEVICE_FATAL
 *         (event could not be recorded: for a release that records its own,
 *         the buffers stay registered; for its group's event, the group
 *         stays waiting, its buffers locked, and the next of the calls above
 *         tries again).
 */
DMEM_API dmem_status_t dmem_stream_release(dmem_runtime_t *rt, dmem_stream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_LAUNCH_H */
