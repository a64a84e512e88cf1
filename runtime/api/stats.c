/*
 * runtime/api/stats.c - dmem_stats.
 */
#include "api/api.h"
#include <string.h>


dmem_status_t dmem_stats(dmem_runtime_t *rt, dmem_stats_t *stats_out) {
  if (!rt || !stats_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stats: NULL argument");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__spill_poll(rt);
  dmem_stats_t s;
  memset(&s, 0, sizeof s);
  s.device_capacity = rt->capacity;
  s.device_limit = rt->limit;
  s.device_used = dmem__device_used(rt);
  s.device_pinned = dmem_atomic_load_relaxed(&rt->device_pinned);
  s.host_used = dmem__tier_host.used(rt);
  s.disk_used = dmem__tier_disk.used(rt);
  s.controller_used = dmem__tier_controller.used(rt);
  s.buffer_count = dmem_atomic_load_relaxed(&rt->buffer_count);
  s.spill_count = dmem_atomic_load_relaxed(&rt->spill_count);
  s.unspill_count = dmem_atomic_load_relaxed(&rt->unspill_count);
  s.bytes_spilled = dmem_atomic_load_relaxed(&rt->bytes_spilled);
  s.bytes_unspilled = dmem_atomic_load_relaxed(&rt->bytes_unspilled);
  s.seconds_spilling = (double)dmem_atomic_load_relaxed(&rt->ns_spilling) * 1e-9;
  s.seconds_unspilling = (double)dmem_atomic_load_relaxed(&rt->ns_unspilling) * 1e-9;
  s.oom_evictions = dmem_atomic_load_relaxed(&rt->oom_evictions);
  s.cancelled_spills = dmem_atomic_load_relaxed(&rt->cancelled_spills);
  s.raw_used = dmem__raw_bytes(rt->raw);
  dmem__pool_stats_t ps;
  dmem__pool_stats(rt->pool, &ps);
  dmem__blocks_stats_t bs;
  dmem__blocks_stats(rt->blocks, &bs);
  s.device_reserved = ps.reserved + bs.live_bytes + bs.cached_bytes;
  s.pool_hits = ps.hits + bs.hits;
  s.pool_misses = ps.misses + (bs.allocs - bs.hits);
  /* ---- copy engine, spill-ahead, prefetch, pinned pool ---- */
  const dmem__xstats_t *x = &rt->xs;
  for (int t = 0; t < DMEM__NTIERS; t++) {
    s.tier_spill_count[t] = dmem_atomic_load_relaxed(&x->spill_count[t]);
    s.tier_spill_bytes[t] = dmem_atomic_load_relaxed(&x->spill_bytes[t]);
    s.tier_spill_seconds[t] = (double)dmem_atomic_load_relaxed(&x->spill_ns[t]) * 1e-9;
    s.tier_unspill_count[t] = dmem_atomic_load_relaxed(&x->unspill_count[t]);
    s.tier_unspill_bytes[t] = dmem_atomic_load_relaxed(&x->unspill_bytes[t]);
    s.tier_unspill_seconds[t] = (double)dmem_atomic_load_relaxed(&x->unspill_ns[t]) * 1e-9;
  }
  s.room_waits = dmem_atomic_load_relaxed(&x->room_waits);
  s.seconds_waiting_for_room = (double)dmem_atomic_load_relaxed(&x->room_wait_ns) * 1e-9;
  s.evict_passes = dmem_atomic_load_relaxed(&x->evict_passes);
  s.ahead_passes = dmem_atomic_load_relaxed(&x->ahead_passes);
  s.ahead_evictions = dmem_atomic_load_relaxed(&x->ahead_evictions);
  s.ahead_bytes = dmem_atomic_load_relaxed(&x->ahead_bytes);
  s.ahead_wakeups = dmem_atomic_load_relaxed(&x->ahead_wakeups);
  s.ahead_polls = dmem_atomic_load_relaxed(&x->ahead_polls);
  s.prefetch_count = dmem_atomic_load_relaxed(&x->prefetch_count);
  s.prefetch_bytes = dmem_atomic_load_relaxed(&x->prefetch_bytes);
  s.spill_ahead_high = rt->ahead_high;
  s.spill_ahead_low = rt->ahead_low;
  dmem__hostpool_stats_t hp;
  dmem__hostpool_stats(rt->hostpool, &hp);
  s.host_pool_reserved = hp.reserved;
  s.host_pool_free = hp.free;
  s.host_pool_grows = hp.grows;
  s.host_pool_background_grows = hp.background_grows;
  s.host_pool_trims = hp.trims;
  s.host_pageable_used = hp.pageable;
  s.host_pageable_allocs = hp.pageable_allocs;
  s.host_to_disk_count = dmem_atomic_load_relaxed(&rt->disk_writes);
  s.host_to_disk_bytes = dmem_atomic_load_relaxed(&rt->disk_bytes_written);
  s.seconds_host_to_disk = (double)dmem_atomic_load_relaxed(&rt->ns_disk_writing) * 1e-9;
  s.host_to_disk_pushdowns = dmem_atomic_load_relaxed(&rt->disk_pushdowns);
  s.disk_to_device_count = dmem_atomic_load_relaxed(&rt->disk_reads);
  s.disk_to_device_bytes = dmem_atomic_load_relaxed(&rt->disk_bytes_read);
  s.seconds_disk_to_device = (double)dmem_atomic_load_relaxed(&rt->ns_disk_reading) * 1e-9;
  s.disk_write_failures = dmem_atomic_load_relaxed(&rt->disk_write_failures);
  /* acquire: partner is dmem__disk_get's release */
  s.disk_direct_io = dmem__disk_direct(dmem_atomic_load_acquire(&rt->disk));
  /* Locked bytes: summed from the threads' records (core/locked.c), which
   * the lock and unlock that take a count from or to 0 keep; no walk of the
   * handle table. */
  s.device_locked = dmem__locked_bytes(rt->table);
  /* peaks: never below the values now (a racing reset or a charge from a
   * shard's budget may leave the recorded peak lower) */
  size_t dp = dmem_atomic_load_relaxed(&rt->device_peak);
  s.device_used_peak = dp > s.device_used ? dp : s.device_used;
  size_t hp2 = dmem_atomic_load_relaxed(&rt->host_peak);
  s.host_used_peak = hp2 > s.host_used ? hp2 : s.host_used;
  size_t kp = dmem_atomic_load_relaxed(&rt->disk_peak);
  s.disk_used_peak = kp > s.disk_used ? kp : s.disk_used;
  s.raw_used_peak = dmem__raw_peak(rt->raw);
  s.swaps = dmem_atomic_load_relaxed(&rt->xs.swaps);
  s.ahead_arms = dmem_atomic_load_relaxed(&rt->xs.ahead_arms);
  if (s.raw_used_peak < s.raw_used) s.raw_used_peak = s.raw_used;
  *stats_out = s;
  return DMEM_OK;
}

dmem_status_t dmem_stats_reset_peaks(dmem_runtime_t *rt) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stats_reset_peaks: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__charge_drain(rt); /* device_charged is then the live bytes */
  dmem_atomic_store_relaxed(&rt->device_peak, dmem_atomic_load_relaxed(&rt->device_charged));
  dmem_atomic_store_relaxed(&rt->host_peak, dmem_atomic_load_relaxed(&rt->host_used));
  dmem_atomic_store_relaxed(&rt->disk_peak, dmem_atomic_load_relaxed(&rt->disk_used));
  dmem__raw_peak_reset(rt->raw);
  return DMEM_OK;
}
