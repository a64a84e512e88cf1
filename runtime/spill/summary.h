/*
 * runtime/spill/summary.h - the statistics of moves, and the info-level summary of them
 * (summary.c).
 * Its own header (not spill.h): the files that count or kick include it,
 * so the layer's header names no function of the files that include it.
 */
#ifndef DMEM_SPILL_SUMMARY_H
#define DMEM_SPILL_SUMMARY_H

#include "core/runtime.h"

/* spill/summary.c: at info, log at most once a second what moved since the
 * last summary (never a line per buffer). dmem__summary_note is called
 * where spills, unspills, push-downs and evictions are counted. */
void dmem__summary_tick(dmem_runtime_t *rt);
/* Log what moved since the last summary, if anything (destroy calls it). */
void dmem__summary_flush(dmem_runtime_t *rt);
static inline void dmem__summary_note(dmem_runtime_t *rt) {
  if (dmem_atomic_load_relaxed(&rt->log_level) >= DMEM_LOG_INFO) dmem__summary_tick(rt);
}

/* Count a completed spill / retrieve into `tier` (stats). */
static inline void dmem__stats_spill(dmem_runtime_t *rt, dmem_tier_t tier, size_t size,
                                     uint64_t ns) {
  dmem_atomic_add_relaxed(&rt->spill_count, 1);
  dmem_atomic_add_relaxed(&rt->bytes_spilled, size);
  dmem_atomic_add_relaxed(&rt->ns_spilling, ns);
  if ((unsigned)tier < DMEM__NTIERS) {
    dmem_atomic_add_relaxed(&rt->xs.spill_count[tier], 1);
    dmem_atomic_add_relaxed(&rt->xs.spill_bytes[tier], size);
    dmem_atomic_add_relaxed(&rt->xs.spill_ns[tier], ns);
  }
  dmem__summary_note(rt);
}
/* The same for n spills of `size` bytes in all (one spill batch). */
static inline void dmem__stats_spill_n(dmem_runtime_t *rt, dmem_tier_t tier, size_t n,
                                       size_t size, uint64_t ns) {
  dmem_atomic_add_relaxed(&rt->spill_count, n);
  dmem_atomic_add_relaxed(&rt->bytes_spilled, size);
  dmem_atomic_add_relaxed(&rt->ns_spilling, ns);
  if ((unsigned)tier < DMEM__NTIERS) {
    dmem_atomic_add_relaxed(&rt->xs.spill_count[tier], n);
    dmem_atomic_add_relaxed(&rt->xs.spill_bytes[tier], size);
    dmem_atomic_add_relaxed(&rt->xs.spill_ns[tier], ns);
  }
  dmem__summary_note(rt);
}
static inline void dmem__stats_unspill(dmem_runtime_t *rt, dmem_tier_t tier, size_t size,
                                       uint64_t ns) {
  dmem_atomic_add_relaxed(&rt->unspill_count, 1);
  dmem_atomic_add_relaxed(&rt->bytes_unspilled, size);
  dmem_atomic_add_relaxed(&rt->ns_unspilling, ns);
  if ((unsigned)tier < DMEM__NTIERS) {
    dmem_atomic_add_relaxed(&rt->xs.unspill_count[tier], 1);
    dmem_atomic_add_relaxed(&rt->xs.unspill_bytes[tier], size);
    dmem_atomic_add_relaxed(&rt->xs.unspill_ns[tier], ns);
  }
  dmem__summary_note(rt);
}

#endif /* DMEM_SPILL_SUMMARY_H */
