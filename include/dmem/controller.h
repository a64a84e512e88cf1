/*
 * dmem/controller.h - an external controller (a Dask worker, a Python
 * scheduler) that sees every buffer, may choose spill victims, and may hold
 * spilled bytes in storage of its own (DMEM_TIER_CONTROLLER).
 *
 * Callbacks run on the thread that caused the event, with no dmem-internal
 * mutex held: they may call back into the runtime. What such a call returns:
 *
 * Callbacks that re-enter dmem
 * ----------------------------
 * "Own buffer": the buffer a store(h) or retrieve(h) was called for, and
 * every buffer that an enclosing call on the same thread is moving: the
 * buffer whose lock, unspill or prefetch is bringing it back (making room
 * for it runs select_victims and sends PRESSURE and SPILL events; its
 * retrieve is called) and the buffer of an enclosing store or retrieve
 * (a store that locks another spilled buffer, say). Such a
 * buffer cannot move until the callback returns, so dmem never waits for
 * it: the answer is immediate, also after the callback (or dmem under it)
 * has moved other buffers.
 *
 *   call from a store, retrieve,      on an own buffer        on any other buffer
 *   select_victims or on_event
 *   --------------------------------  ----------------------  ----------------------
 *   dmem_buffer_lock, dmem_buffer_unspill,          DMEM_ERR_BUSY at once;  as from any thread
 *   dmem_buffer_prefetch, dmem_launch_async, the buffer untouched    (waits for another
 *   dmem_lock_and_launch              (launches: nothing      thread's move of it)
 *                                     locked, fn not called)
 *   dmem_buffer_spill                        DMEM_ERR_BUSY at once   as from any thread
 *   dmem_buffer_read                  DMEM_ERR_BUSY at once   as from any thread
 *   dmem_buffer_free                         DMEM_OK: the move ends  as from any thread
 *                                     first (see FREE below)
 *   dmem_buffer_info,                 DMEM_OK (state          as from any thread
 *   dmem_buffer_set_priority                 SPILLING, UNSPILLING or
 *                                     the tier it leaves)
 *   dmem_runtime_evict                        passed over             spilled by policy
 *
 *   call from any callback            returns
 *   --------------------------------  ---------------------------------------------
 *   dmem_buffer_alloc, dmem_device_malloc,   makes room by spilling other buffers and
 *   a lock that needs room            waits (oom_wait_ms) for other threads'
 *                                     moves; DMEM_ERR_OUT_OF_MEMORY at once when
 *                                     only this thread's own moves (the spill a
 *                                     store is part of) could make room
 *   dmem_controller_set               DMEM_ERR_BUSY if it would remove or replace
 *                                     a controller that holds bytes or whose
 *                                     store is running (a store: always, unless
 *                                     the same store/retrieve/user); else DMEM_OK
 *   dmem_stats, dmem_runtime_poll,    as from any thread
 *   streams, copies, sync/release
 *   dmem_runtime_destroy              must not be called from a callback
 *
 * The event's own buffer is not moving when on_event runs (ALLOC, SPILL and
 * UNSPILL come after the allocation or move ended): calls on it act as from
 * any thread (locking it after a SPILL brings it back; freeing it is fine).
 * A callback must not wait for another thread that is itself waiting for a
 * move this thread is in (a lock of a buffer this callback's store is
 * spilling, say): that is a deadlock dmem cannot see.
 *
 * FREE: a buffer freed while the controller's store for it runs (from the
 * store itself or another thread) gets its one FREE event after store()
 * returns, with the tier its bytes ended in (DMEM_TIER_CONTROLLER when the
 * store was kept): the controller drops what it stored on that event. A
 * buffer freed before its store began is not stored (the spill returns
 * DMEM_ERR_STALE_HANDLE).
 */
#ifndef DMEM_CONTROLLER_H
#define DMEM_CONTROLLER_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dmem_event_kind {
  DMEM_EVENT_ALLOC = 0,    /**< handle, size */
  DMEM_EVENT_FREE = 1,     /**< handle, size, tier the bytes were in: drop
                                 what is stored for handle (sent once; after
                                 store() when freed during a store); also for
                                 each buffer still alive when the runtime is
                                 destroyed */
  DMEM_EVENT_SPILL = 2,    /**< handle, size, tier moved to */
  DMEM_EVENT_UNSPILL = 3,  /**< handle, size, tier moved from */
  DMEM_EVENT_PRESSURE = 4  /**< bytes_needed: an allocation needs room (before eviction) */
} dmem_event_kind_t;

/** One event, passed to on_event; valid for the duration of the call. */
typedef struct dmem_event {
  dmem_event_kind_t kind;
  dmem_handle_t handle;    /**< DMEM_HANDLE_NULL for PRESSURE */
  size_t size;             /**< buffer size (0 for PRESSURE) */
  dmem_tier_t tier;        /**< see dmem_event_kind_t */
  size_t bytes_needed;     /**< PRESSURE only */
} dmem_event_t;

/** select_victims sets *n_out to this to ask for the default policy. */
#define DMEM_VICTIMS_DEFAULT ((size_t)-1)

/**
 * Controller callbacks. Start from a zeroed struct, set struct_size to
 * sizeof(dmem_controller_t). Any callback may be NULL.
 */
typedef struct dmem_controller {
  size_t struct_size;
  void *user;
  /** Notification; cannot fail. */
  void (*on_event)(void *user, const dmem_event_t *event);
  /**
   * Choose buffers to spill so that `bytes_needed` bytes are freed: write up
   * to `capacity` handles to victims[] and their number to *n_out, or
   * DMEM_VICTIMS_DEFAULT for the default policy. Victims that are locked,
   * pinned or stale are skipped; if the victims do not free enough, the
   * default policy frees the rest. Returning an error makes the eviction fail
   * with DMEM_ERR_CALLBACK (nothing is spilled by it).
   */
  dmem_status_t (*select_victims)(void *user, size_t bytes_needed, dmem_handle_t *victims,
                                  size_t capacity, size_t *n_out);
  /**
   * Take a copy of a spilled buffer's `size` bytes at `data` (host memory,
   * valid during the call only). On error the buffer stays where it was.
   * A lock of h from another thread during the call cancels the spill: the
   * copy taken is then never asked for (the next store of h replaces it,
   * its FREE event ends it). See the table above for calls from store.
   */
  dmem_status_t (*store)(void *user, dmem_handle_t h, const void *data, size_t size);
  /**
   * Give back the bytes stored for h into `out` (host memory of `size` bytes).
   * The runtime asks once per store; the controller may drop its copy after
   * a successful retrieve. On error the buffer stays in the controller tier.
   */
  dmem_status_t (*retrieve)(void *user, dmem_handle_t h, void *out, size_t size);
} dmem_controller_t;

/**
 * Install (or, with c == NULL, remove) the controller. The struct is copied.
 * While the installed controller holds bytes (buffers in
 * DMEM_TIER_CONTROLLER) or one of its stores is running, it can only be
 * installed again with the same store, retrieve and user (to change
 * on_event or select_victims, say): removing it, or installing any other,
 * gives DMEM_ERR_BUSY and changes nothing (the bytes could no longer be
 * retrieved). Thread-safe, and callable from the controller's own callbacks
 * (a store removing its controller gets DMEM_ERR_BUSY); callbacks already
 * running finish with the old controller.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL, struct_size too small,
 *         store without retrieve or the reverse); DMEM_ERR_BUSY (see above);
 *         DMEM_ERR_FORKED (in a forked child, see dmem/runtime.h).
 */
DMEM_API dmem_status_t dmem_controller_set(dmem_runtime_t *rt, const dmem_controller_t *c);

/* ---- Names before dmem_noun_verb (deprecated) ----------------------------------
 * Kept for one version: exported, same signature and behaviour as the
 * function named in DMEM_DEPRECATED_API (they call it); a call warns
 * (-Wdeprecated-declarations). See dmem/status.h. */
DMEM_DEPRECATED_API(dmem_controller_set)
dmem_status_t dmem_set_controller(dmem_runtime_t *rt, const dmem_controller_t *c);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_CONTROLLER_H */
