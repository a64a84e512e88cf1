/*
 * dmem/buffer.h - spillable buffers: allocate, free, inspect, lock, unlock.
 *
 * A buffer is named by a dmem_handle_t. Its bytes may be on the device or
 * deferred (spilled) to host memory, disk or the controller. Code that wants
 * to touch the bytes locks the buffer first: the lock brings the bytes back
 * (ordered on the locker's stream, without host synchronisation) and keeps
 * them on the device until the matching unlock. Nothing spills a locked
 * buffer.
 *
 * Every function here is thread-safe.
 */
#ifndef DMEM_BUFFER_H
#define DMEM_BUFFER_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/** dmem_buffer_alloc flags. */
enum {
  DMEM_ALLOC_DEFAULT = 0,
  /** Never spillable (for memory whose address is handed out for good). */
  DMEM_ALLOC_PINNED = 1u << 0,
  /**
   * Spillable, and the device pointer that locking returns is the same for
   * the buffer's whole life, across any number of spills and unspills: a
   * CUDA graph captured over it, a pointer kept in a library handle or a
   * long-running kernel's argument stays valid (used only while the buffer
   * is locked; the lock protocol is unchanged). The CUDA backend reserves
   * a virtual address range (cuMemAddressReserve) and maps physical memory
   * there while the buffer is resident (cuMemCreate, cuMemMap,
   * cuMemSetAccess); a spill copies the bytes out as for any buffer, waits
   * for that copy, then unmaps and releases the memory (cuMemUnmap,
   * cuMemRelease); an unspill maps new memory at the same address and
   * copies back. The host backend simulates it (the range is PROT_NONE
   * while the buffer is not resident: a stray access faults).
   *
   * Cost: the size is rounded up to the VMM granularity (2 MiB on current
   * NVIDIA GPUs; 64 KiB on the host backend), and the rounded size counts
   * against the device limit while resident (dmem_stats' device_used);
   * each unspill maps and each spill unmaps (driver calls of tens of
   * microseconds, and cuMemUnmap may synchronise the device); a spill
   * waits on the host for its copy; stable buffers are spilled one at a
   * time, never in eviction batches. docs/stable.md has the measurements
   * and the CUDA graph pattern. Not with DMEM_ALLOC_PINNED.
   */
  DMEM_BUFFER_STABLE_ADDRESS = 1u << 1
};

/** Most locks one buffer can hold at once. */
#define DMEM_LOCK_COUNT_MAX 0xFFFFFFu

/** Snapshot of one buffer, from dmem_buffer_info. */
typedef struct dmem_buffer_info {
  size_t size;           /**< bytes, as allocated */
  dmem_state_t state;    /**< where the bytes are */
  unsigned lock_count;   /**< current number of locks */
  bool pinned;           /**< allocated with DMEM_ALLOC_PINNED */
  int priority;          /**< higher stays on the device longer */
  uint64_t spill_count;  /**< completed spills of this buffer (stops at 2^32 - 1) */
} dmem_buffer_info_t;

/**
 * Allocate a spillable buffer of `size` bytes, resident on the device. Its
 * contents are uninitialised. If the allocation would pass the device limit,
 * or the backend runs out of memory, unlocked buffers are spilled (lowest
 * priority first, then by the eviction policy: dmem_buffer_set_priority) and the
 * allocation retried.
 *
 * @param flags  0, DMEM_ALLOC_PINNED or DMEM_BUFFER_STABLE_ADDRESS.
 * @param h_out  receives the handle on success; untouched on failure.
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt or h_out NULL, size 0, unknown flags,
 *                                    DMEM_ALLOC_PINNED with
 *                                    DMEM_BUFFER_STABLE_ADDRESS;
 *         DMEM_ERR_OUT_OF_MEMORY     size exceeds the limit (SIZE_MAX
 *                                    included: at once, nothing spilled), or
 *                                    nothing more can be spilled (after
 *                                    waiting up to oom_wait_ms for other
 *                                    threads' moves; from a controller
 *                                    callback, at once when only the
 *                                    caller's own move could make room: see
 *                                    dmem/controller.h);
 *         DMEM_ERR_CALLBACK          the controller's select_victims failed;
 *         DMEM_ERR_HOST_OUT_OF_MEMORY handle table could not grow, or victims
 *                                    could not be spilled for lack of host
 *                                    memory;
 *         DMEM_ERR_IO                victims could not be written to disk;
 *         DMEM_ERR_DEVICE, DMEM_ERR_DEVICE_FATAL (DMEM_ERR_DEVICE also when
 *                                    DMEM_BUFFER_STABLE_ADDRESS is asked
 *                                    of a device without virtual memory
 *                                    management).
 *         With DMEM_BUFFER_STABLE_ADDRESS, `size` rounded up to the
 *         granularity is what must fit the limit.
 */
DMEM_API dmem_status_t dmem_buffer_alloc(dmem_runtime_t *rt, size_t size, unsigned flags,
                                         dmem_handle_t *h_out);

/**
 * Free a buffer. The handle is stale at once for every call except
 * dmem_buffer_unlock: if the buffer is locked, its memory is reclaimed at the last
 * unlock (and the locks taken before the free stay valid until then).
 * A buffer in a spill or unspill is reclaimed when that move finishes. The
 * controller's FREE event is sent here, or, for a buffer freed while the
 * controller's store of it runs, by the spilling thread after store()
 * returns (dmem/controller.h). Callable from controller callbacks, on their
 * own buffer too.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL);
 *         DMEM_ERR_STALE_HANDLE (zero, freed - including a double free -,
 *         forged or another runtime's handle).
 */
DMEM_API dmem_status_t dmem_buffer_free(dmem_runtime_t *rt, dmem_handle_t h);

/**
 * Snapshot of a buffer's size, state, lock count, flags and counters.
 *
 * @param info_out written whole on success; untouched on failure.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt or info_out NULL);
 *         DMEM_ERR_STALE_HANDLE.
 */
DMEM_API dmem_status_t dmem_buffer_info(dmem_runtime_t *rt, dmem_handle_t h,
                                        dmem_buffer_info_t *info_out);

/**
 * Lock a buffer for use on `stream` and return its device address. A resident
 * buffer is locked with one atomic operation. A deferred buffer gets device
 * memory (spilling others if needed) and its host->device copy is enqueued on
 * `stream`: work the caller enqueues on `stream` afterwards is ordered after
 * the copy; no host synchronisation happens. If the bytes are already being
 * copied back on another stream, `stream` waits for that copy's event. A lock
 * on a buffer being spilled cancels the spill.
 *
 * The address is valid until the matching dmem_buffer_unlock. The caller must not
 * unlock before the device work that uses the address has completed (use
 * dmem_sync_and_unlock or dmem_stream_release to have dmem do it).
 *
 * @param dev_ptr_out receives the device address; untouched on failure.
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt or dev_ptr_out NULL, lock count at
 *                                    DMEM_LOCK_COUNT_MAX;
 *         DMEM_ERR_STALE_HANDLE;
 *         DMEM_ERR_BUSY              called from a controller callback (or
 *                                    an on_event) on a buffer that the
 *                                    calling thread is moving: the buffer of
 *                                    that store/retrieve, or one whose lock
 *                                    up the stack made the callback run (at
 *                                    once, see dmem/controller.h);
 *         DMEM_ERR_OUT_OF_MEMORY     no device memory for the retrieve (see
 *                                    dmem_buffer_alloc);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY no host memory for the retrieve's
 *                                    staging (a disk or controller copy) or
 *                                    for the spills that make room;
 *         DMEM_ERR_IO, DMEM_ERR_CALLBACK (disk or controller retrieve failed;
 *                                    the bytes stay where they were);
 *         DMEM_ERR_DEVICE, DMEM_ERR_DEVICE_FATAL;
 *         DMEM_ERR_FORKED            an inherited runtime in a forked child
 *                                    (see dmem/runtime.h).
 */
DMEM_API dmem_status_t dmem_buffer_lock(dmem_runtime_t *rt, dmem_handle_t h,
                                        dmem_stream_t stream, void **dev_ptr_out);

/**
 * Release one lock. At the last unlock the buffer becomes spillable again, and
 * if it was freed while locked its memory is reclaimed.
 *
 * In a forked child, on an inherited runtime, the lock is dropped in the
 * child's own copy of the buffer's state (the parent keeps its lock), with
 * the same statuses; the last unlock of a buffer freed while locked gives
 * DMEM_ERR_FORKED and changes nothing (see dmem/runtime.h).
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL);
 *         DMEM_ERR_STALE_HANDLE (zero, freed, forged or another runtime's
 *         handle); DMEM_ERR_NOT_LOCKED (lock count is 0: an unlock without a
 *         lock changes nothing); DMEM_ERR_FORKED (see above).
 */
DMEM_API dmem_status_t dmem_buffer_unlock(dmem_runtime_t *rt, dmem_handle_t h);

/**
 * Copy bytes [offset, offset + n) of a buffer into host memory at `dst`,
 * from wherever the bytes are, and leave the buffer there: a resident buffer
 * is copied device->host on the runtime's device->host copy stream (after an
 * unspill copy still in flight) and this call waits for the copy; a buffer in
 * the host tier is copied from its pinned copy; one on disk is read from its
 * spill file (pread, no staging). Nothing is unspilled, the buffer's state,
 * lock count and spill count stay as they were, no spill or unspill is
 * counted in dmem_stats, and the read does not count as a use for the victim
 * policy (only unlocks do).
 *
 * While the bytes are copied the buffer is owned by the read as by a move:
 * dmem_buffer_spill of it gives DMEM_ERR_BUSY and eviction passes it over; a lock
 * of a resident buffer proceeds at once, a lock of a deferred one waits for
 * the read; a free marks it and it is reclaimed when the read ends. A read
 * that finds the buffer being moved (spilled, unspilled, pushed down to
 * disk) waits for the move and reads from where it ended. Bytes written by
 * device work still running on a locked buffer are not ordered before the
 * read (as for dmem_stream_copy): read after that work, or after the unlock.
 *
 * Thread-safe. Reads of one buffer from several threads run one after the
 * other.
 *
 * @param dst  host memory of at least n bytes (not device memory); may be
 *             NULL when n is 0.
 * @return DMEM_OK (n == 0 included, once h and offset are checked; dst is
 *         written only then, and may be partly written on failure);
 *         DMEM_ERR_INVALID_ARGUMENT  rt NULL, dst NULL with n > 0, or
 *                                    offset + n past the buffer's size;
 *         DMEM_ERR_STALE_HANDLE;
 *         DMEM_ERR_BUSY              the bytes are held by the controller
 *                                    (DMEM_STATE_DEFERRED_CONTROLLER: its
 *                                    retrieve may drop its copy; lock or
 *                                    unspill it instead), or called from a
 *                                    controller callback on a buffer the
 *                                    calling thread is moving (at once, see
 *                                    dmem/controller.h);
 *         DMEM_ERR_IO                the disk read failed (the buffer stays
 *                                    on disk, intact);
 *         DMEM_ERR_FORKED            in a forked child (see dmem/runtime.h);
 *         DMEM_ERR_DEVICE, DMEM_ERR_DEVICE_FATAL (a resident buffer's copy
 *                                    or its event; the second also for any
 *                                    call after a fatal device error).
 */
DMEM_API dmem_status_t dmem_buffer_read(dmem_runtime_t *rt, dmem_handle_t h, size_t offset,
                                        void *dst, size_t n);

/**
 * Set a buffer's priority class. Eviction spills lower priorities first (a
 * controller's select_victims, when it names victims, before any); within
 * a class the runtime's eviction policy (dmem_config_t.eviction_policy)
 * orders them:
 *
 * DMEM_EVICTION_REUSE (the default). An unlock that brings a buffer's lock
 * count to 0 marks the buffer; the policy reads and clears marks when it
 * looks at a buffer, and counts time in victims taken. A buffer is "cold"
 * from its arrival (its allocation, or the lock, dmem_buffer_unspill or
 * dmem_buffer_prefetch that brought it back to the device) until it is unlocked
 * twice: the first unlock after the arrival is the arrival's own use, the
 * second makes it "hot". A buffer brought back that had been unused longer
 * (in victims taken since the policy last saw it used) than every resident
 * buffer of its class, that is one LRU would have evicted too, is a
 * "loop" buffer. Within a class eviction takes: first loop buffers, newest
 * arrival first, except those among the newest arrivals that fit in a
 * window of 1/64 to 1/2 of the limit (at least the newest one); then, of
 * the oldest-arrived cold buffer and the hot buffer the policy saw used
 * least recently, the one seen used less recently (the cold one on a tie);
 * then the window's buffers, oldest first. A cold or loop buffer found
 * unlocked twice since its arrival becomes hot instead of being taken; a hot
 * buffer found marked is passed over, its mark cleared and its recency
 * renewed, so a hot buffer unlocked since the policy last looked at it is
 * taken only after every hot buffer of its class that was not. These hold
 * exactly whichever threads made the unlocks: every unlock that happens
 * before an eviction pass starts (the same thread, or ordered before it by
 * the caller's synchronisation) is seen by that pass, and unlocks write no
 * memory that other threads or buffers share. Within one tick (no victim
 * taken between two unlocks) recency is not ordered further.
 *
 * A dmem_buffer_prefetch of a resident buffer is not a use: it moves the buffer to
 * its list's newest end (a loop buffer to the window's).
 *
 * DMEM_EVICTION_LRU. Least recently unlocked first. "Least recently" is
 * exact among the unlocks of one thread; across threads it holds between
 * unlocks with an allocation or an eviction pass between them (each starts
 * a new LRU epoch), and within one epoch two threads' unlocks are ordered by
 * how many each thread did (exact order across threads would cost every
 * unlock a write to a line all threads share).
 *
 * A buffer whose priority changes joins its new class at the next eviction
 * pass. Default 0; every int (INT_MIN to INT_MAX) is a priority.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL);
 *         DMEM_ERR_STALE_HANDLE.
 */
DMEM_API dmem_status_t dmem_buffer_set_priority(dmem_runtime_t *rt, dmem_handle_t h,
                                                int priority);

/* ---- Names before dmem_noun_verb (deprecated) ----------------------------------
 * Kept for one version: exported, same signature and behaviour as the
 * function named in DMEM_DEPRECATED_API (they call it); a call warns
 * (-Wdeprecated-declarations). See dmem/status.h. */
DMEM_DEPRECATED_API(dmem_buffer_alloc)
dmem_status_t dmem_alloc(dmem_runtime_t *rt, size_t size, unsigned flags,
                         dmem_handle_t *h_out);
DMEM_DEPRECATED_API(dmem_buffer_free)
dmem_status_t dmem_free(dmem_runtime_t *rt, dmem_handle_t h);
DMEM_DEPRECATED_API(dmem_buffer_lock)
dmem_status_t dmem_lock(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream,
                        void **dev_ptr_out);
DMEM_DEPRECATED_API(dmem_buffer_unlock)
dmem_status_t dmem_unlock(dmem_runtime_t *rt, dmem_handle_t h);
DMEM_DEPRECATED_API(dmem_buffer_set_priority)
dmem_status_t dmem_set_priority(dmem_runtime_t *rt, dmem_handle_t h, int priority);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_BUFFER_H */
