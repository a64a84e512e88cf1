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
   *  Tier changes (host -> disk) count too, the I/O threads' push-downs
   *  included. */
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

  /* ---- the disk tier: host -> disk and disk -> device moves ---------------- */
  /** Buffers written to the disk tier: pushed down from the host tier by the
   *  host limit, moved there by dmem_spill(DMEM_TIER_DISK), or spilled from
   *  the device straight to disk (their bytes go through pinned staging, so
   *  every disk write is a host -> disk move). */
  uint64_t host_to_disk_count;
  uint64_t host_to_disk_bytes;
  /** Wall time of those writes (extent reservation and pwrite, chunks shared
   *  with the I/O threads), summed over the writing threads. Push-downs run
   *  on the I/O threads: no caller waits for them. */
  double seconds_host_to_disk;
  /** Of host_to_disk_count, buffers pushed down by the host limit (the I/O
   *  threads move the least recently used host-tier buffers to disk while
   *  the host tier holds more than host_limit). */
  uint64_t host_to_disk_pushdowns;
  /** Retrieves from the disk tier: a lock (or dmem_unspill) reads the bytes
   *  into pinned staging and copies them to the device; they never become a
   *  host-tier copy. */
  uint64_t disk_to_device_count;
  uint64_t disk_to_device_bytes;
  /** Wall time of those reads (the retrieving thread and the I/O threads
   *  helping it), summed over retrieving threads. The host -> device copy
   *  that follows is ordered on the locker's stream and not included. */
  double seconds_disk_to_device;
  /** Disk writes that failed (DMEM_ERR_IO: disk full, I/O error); the
   *  buffer stayed where it was (host tier or device). */
  uint64_t disk_write_failures;
  /** 1 while the disk tier's file is read and written with O_DIRECT; 0 when
   *  it is buffered (the filesystem rejects O_DIRECT) or not made yet. */
  uint64_t disk_direct_io;
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
