/*
 * runtime/spill/ahead.h - the spill-ahead thread (ahead.c): start, stop, and the
 * kick after allocations.
 * Its own header (not spill.h): the files that count or kick include it,
 * so the layer's header names no function of the files that include it.
 */
#ifndef DMEM_SPILL_AHEAD_H
#define DMEM_SPILL_AHEAD_H

#include "core/runtime.h"

/* Start the background thread when rt->ahead_high is set. */
dmem_status_t dmem__ahead_start(dmem_runtime_t *rt);
/* Stop and join it (at destroy). */
void dmem__ahead_stop(dmem_runtime_t *rt);
/* Wake the thread when device use passed the high-water mark. Called after
 * allocations; one relaxed load when under the mark. With the demand
 * trigger, only while the thread is armed (it would do nothing). */
void dmem__ahead_kick_slow(dmem_runtime_t *rt);
static inline bool dmem__ahead_wanted(dmem_runtime_t *rt) {
  return !rt->ahead_demand || dmem_atomic_load_relaxed(&rt->ahead_armed);
}
static inline void dmem__ahead_note(dmem_runtime_t *rt) {
  if (rt->ahead_high && dmem_atomic_load_relaxed(&rt->device_charged) > rt->ahead_high &&
      dmem__ahead_wanted(rt) && !dmem_atomic_load_relaxed(&rt->ahead_kick))
    dmem__ahead_kick_slow(rt);
}
/* An allocation or retrieve waited for room from start_ns to now_ns
 * (pressure.c). With the demand trigger: a wait that began while the
 * thread was armed disarms it (the thread was not ahead of it), and when
 * it lasted DMEM_SPILL_AHEAD_ARM_WAIT_US or more no wait arms it again for
 * a hold-off (DMEM_SPILL_AHEAD_ARM_MS, doubling with each such wait in a
 * row up to 64 s, and back after an arming that ran out with no wait begun
 * in it); otherwise a wait of DMEM_SPILL_AHEAD_ARM_WAIT_US
 * or more arms it for DMEM_SPILL_AHEAD_ARM_MS from now_ns, and kicks it,
 * and a shorter one disarms it. */
void dmem__ahead_waited(dmem_runtime_t *rt, uint64_t start_ns, uint64_t now_ns);

#endif /* DMEM_SPILL_AHEAD_H */
