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
  size_t device_reserved;    /**< bytes of pool slabs and dedicated blocks
                                  (live or cached) held on the device
                                  (>= device_used; dmem_device_trim gives
                                  empty slabs and cached blocks back) */
  size_t raw_used;           /**< of device_used, bytes in live raw
                                  allocations (dmem_device_malloc) */
  uint64_t pool_hits;        /**< allocations served from pool memory already
                                  held (dedicated blocks: from the cache) */
  uint64_t pool_misses;      /**< allocations that needed a new slab (or a
                                  new dedicated block) */

  /* ---- copy engine, spill-ahead, prefetch, pinned pool (issue 9) ----------
   * Arrays are indexed by dmem_tier_t: [DMEM_TIER_HOST], [DMEM_TIER_DISK],
   * [DMEM_TIER_CONTROLLER] ([DMEM_TIER_DEVICE] stays 0). A move counts
   * under the tier it went to (spill) or came from (unspill). Seconds are
   * wall time of the calls as for seconds_spilling / seconds_unspilling:
   * copies to and from the host tier are stream-ordered and complete after
   * the call; bytes / (copy engine time) is what bench_spill measures. */
  uint64_t tier_spill_count[4];     /**< spills from the device, per tier */
  uint64_t tier_spill_bytes[4];
  double tier_spill_seconds[4];
  uint64_t tier_unspill_count[4];   /**< retrieves to the device, per tier */
  uint64_t tier_unspill_bytes[4];
  double tier_unspill_seconds[4];
  uint64_t room_waits;              /**< allocations (and retrieves) that found no
                                         room and had to spill or wait */
  double seconds_waiting_for_room;  /**< their time spent making room */
  uint64_t evict_passes;            /**< eviction passes, any reason */
  uint64_t ahead_passes;            /**< passes of the spill-ahead thread */
  uint64_t ahead_evictions;         /**< buffers it spilled */
  uint64_t ahead_bytes;             /**< bytes it spilled */
  uint64_t ahead_wakeups;           /**< times the spill-ahead thread woke (an
                                         allocation past the mark, or its period) */
  uint64_t ahead_polls;             /**< times it looked for finished stream
                                         releases and copies (backend event
                                         queries when any are in flight) */
  uint64_t prefetch_count;          /**< buffers brought back by dmem_buffer_prefetch */
  uint64_t prefetch_bytes;
  size_t spill_ahead_high;          /**< the marks in bytes (0: spill-ahead off) */
  size_t spill_ahead_low;
  size_t host_pool_reserved;        /**< pinned host memory held by the pool */
  size_t host_pool_free;            /**< of which free */
  uint64_t host_pool_grows;         /**< chunks added (cudaMallocHost calls) */
  uint64_t host_pool_background_grows; /**< of which by the background thread */
  uint64_t host_pool_trims;         /**< chunks given back (trim, idle) */
  /** Pageable host memory taken instead of pinned (CUDA backend): when a
   *  spill or a copy needs host memory while the pool is pinning a new chunk,
   *  it does not wait for cudaMallocHost but uses ordinary memory (slower,
   *  synchronous copies). Bytes held in such blocks now, and blocks taken. */
  size_t host_pageable_used;
  uint64_t host_pageable_allocs;
  /* ---- the disk tier: host -> disk and disk -> device moves ---------------- */
  /** Buffers written to the disk tier: pushed down from the host tier by the
   *  host limit, moved there by dmem_buffer_spill(DMEM_TIER_DISK), or spilled from
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
  /** Retrieves from the disk tier: a lock (or dmem_buffer_unspill) reads the bytes
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
  /* ---- peaks: the most held at once since creation or the last
   * dmem_stats_reset_peaks (never below the value now) ---------------------- */
  /** device_used at its highest. Exact with one allocating thread; with
   *  several it may count the other threads' unused budget of the limit
   *  (at most limit / 256, 64 KiB .. 8 MiB, a thread): an upper bound. */
  size_t device_used_peak;
  size_t host_used_peak;     /**< host_used at its highest */
  size_t disk_used_peak;     /**< disk_used at its highest */
  size_t raw_used_peak;      /**< raw_used at its highest */
  /** Retrieves from the host tier that traded places with their victim,
   *  or took its device block in pieces (dmem_config_t.retrieve_swap: on,
   *  or pieces, the default): each is also counted as one spill (its
   *  victim's, to the host tier) and one unspill. */
  uint64_t swaps;
  /** Waits for room that armed the spill-ahead thread (its demand
   *  trigger: dmem_config_t.spill_ahead_trigger). */
  uint64_t ahead_arms;
} dmem_stats_t;

/**
 * Fill *stats_out (written whole) after completing finished stream releases.
 * Thread-safe; the figures are a consistent-enough snapshot, not atomic as a
 * whole.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt or stats_out NULL).
 */
DMEM_API dmem_status_t dmem_stats(dmem_runtime_t *rt, dmem_stats_t *stats_out);

/**
 * Start the peaks of dmem_stats (device_used_peak, host_used_peak,
 * disk_used_peak, raw_used_peak) again from the values now: the next
 * dmem_stats reports the most held at once since this call. Gives every
 * thread's unused device budget back to the runtime first, so that the
 * device peak starts exact. Take dmem_stats first to keep the old peaks.
 * Thread-safe; an allocation racing the reset may count in the new peak or
 * not.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_FORKED (an
 *         inherited runtime in a forked child).
 */
DMEM_API dmem_status_t dmem_stats_reset_peaks(dmem_runtime_t *rt);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_STATS_H */
