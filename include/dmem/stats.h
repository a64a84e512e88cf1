/*
 * dmem/stats.h - runtime-wide statistics.
 */
#ifndef DMEM_STATS_H
#define DMEM_STATS_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Snapshot of the runtime's accounting. Sizes in bytes. */
typedef struct dmem_stats {
  size_t device_capacity;    /**< device memory of the backend */
  size_t device_limit;       /**< the limit dmem keeps to */
  size_t device_used;        /**< bytes in live device allocations: resident
                                  buffers and raw allocations (0 once all
                                  are freed) */
  size_t device_locked;      /**< of which locked */
  size_t device_pinned;      /**< of which pinned (never spillable) */
  size_t host_used;          /**< spilled bytes held in host memory */
  size_t disk_used;          /**< spilled bytes held on disk */
  size_t controller_used;    /**< spilled bytes held by the controller */
  size_t buffer_count;       /**< live buffers */
  uint64_t spill_count;      /**< completed spills (device -> any tier) */
  uint64_t unspill_count;    /**< completed retrieves (any tier -> device) */
  uint64_t bytes_spilled;
  uint64_t bytes_unspilled;
  /** Wall time of the spill calls, summed over threads. To the host tier a
   *  spill is stream-ordered: staging and enqueueing the device->host copy
   *  (the copy completes asynchronously, before any retrieve of the buffer),
   *  so this measures the same thing as seconds_unspilling. To disk or the
   *  controller a spill also waits for the copy and the write or store.
   *  Tier changes (host -> disk) count too. */
  double seconds_spilling;
  /** Wall time of the retrieves, summed over threads, up to the moment the
   *  host->device copy is enqueued on the locker's stream: device memory
   *  (including any spilling that needs), the disk read or the controller's
   *  retrieve, and enqueueing. The copy itself runs asynchronously, ordered
   *  before the locker's next work, and is not included. */
  double seconds_unspilling;
  uint64_t oom_evictions;    /**< buffers spilled because an allocation needed room */
  uint64_t cancelled_spills; /**< spills cancelled by a lock */
  size_t device_reserved;    /**< bytes of pool slabs held on the device
                                  (>= device_used; dmem_device_trim gives
                                  empty slabs back) */
  size_t raw_used;           /**< of device_used, bytes in live raw
                                  allocations (dmem_device_malloc) */
  uint64_t pool_hits;        /**< allocations served from pool memory already held */
  uint64_t pool_misses;      /**< allocations that needed a new slab */
} dmem_stats_t;

/**
 * Fill *stats_out (written whole) after completing finished stream releases.
 * Thread-safe; the figures are a consistent-enough snapshot, not atomic as a
 * whole.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt or stats_out NULL).
 */
DMEM_API dmem_status_t dmem_stats(dmem_runtime_t *rt, dmem_stats_t *stats_out);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_STATS_H */
