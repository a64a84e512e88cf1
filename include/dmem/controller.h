/*
 * dmem/controller.h - an external controller (a Dask worker, a Python
 * scheduler) that sees every buffer, may choose spill victims, and may hold
 * spilled bytes in storage of its own (DMEM_TIER_CONTROLLER).
 *
 * Callbacks run on the thread that caused the event, with no dmem-internal
 * mutex held: they may call back into the runtime (dmem_spill, dmem_free,
 * dmem_buffer_info, ...). The one exception: store and retrieve must not lock,
 * spill or unspill the buffer they were called for (that returns
 * DMEM_ERR_BUSY).
 */
#ifndef DMEM_CONTROLLER_H
#define DMEM_CONTROLLER_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dmem_event_kind {
  DMEM_EVENT_ALLOC = 0,    /**< handle, size */
  DMEM_EVENT_FREE = 1,     /**< handle, size, tier the bytes were in; also for each
                                buffer still alive when the runtime is destroyed */
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
 * Removing a controller, or installing one without store/retrieve, while
 * buffers are in DMEM_TIER_CONTROLLER gives DMEM_ERR_BUSY: their bytes would
 * be lost. Thread-safe; callbacks already running finish with the old
 * controller.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL, struct_size too small,
 *         store without retrieve or the reverse); DMEM_ERR_BUSY.
 */
DMEM_API dmem_status_t dmem_set_controller(dmem_runtime_t *rt, const dmem_controller_t *c);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_CONTROLLER_H */
