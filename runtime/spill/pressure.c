/*
 * spill/pressure.c - making room: device memory for a buffer when the limit
 * or the device is full. Finished stream releases are completed first (their
 * buffers become victims), then the controller hears of the pressure and may
 * make room itself, then victims are spilled by policy. When nothing can be
 * spilled now but moves or stream releases are in flight, it waits for them,
 * up to a deadline.
 */
#include "spill/spill.h"
#include "spill/ahead.h"


void dmem__spill_poll(dmem_runtime_t *rt) {
  dmem__pending_poll(rt, false);
  dmem__staging_poll(rt, false);
}

/* Where the memory comes from: a row of the device memory sources
 * (memory.h: the pool, dedicated blocks), or FROM_STABLE: physical memory
 * mapped at a stable buffer's range, which *dev_out holds (memory/stable.c;
 * not a row: it allocates at an address the buffer already has). */
#define FROM_STABLE ((int)DMEM__SRC_COUNT)

static dmem_status_t make_room(dmem_runtime_t *rt, size_t size, void *stream, int src,
                               void **dev_out, bool *ordered_out, size_t need, dmem__swap_t *sw);

/* One attempt, without making room. */
static dmem_status_t try_alloc(dmem_runtime_t *rt, size_t size, void *stream, int src,
                               void **dev_out, bool *ordered_out, size_t *need) {
  if (src == FROM_STABLE) return dmem__stable_map(rt, *dev_out, need);
  return dmem__device_alloc_from(rt, (dmem__devsrc_t)src, size, stream, dev_out, ordered_out,
                                 need);
}

static dmem_status_t pressure_alloc(dmem_runtime_t *rt, size_t size, void *stream,
                                    int src, void **dev_out, bool *ordered_out, dmem__swap_t *sw);

dmem_status_t dmem__pressure_alloc(dmem_runtime_t *rt, size_t size, void *stream,
                                   dmem__devsrc_t src, void **dev_out, bool *ordered_out) {
  return pressure_alloc(rt, size, stream, (int)src, dev_out, ordered_out, NULL);
}

dmem_status_t dmem__pressure_retrieve(dmem_runtime_t *rt, size_t size, void *stream,
                                      dmem__swap_t *sw, void **dev_out) {
  return pressure_alloc(rt, size, stream, (int)DMEM__SRC_POOL, dev_out, NULL, sw);
}

dmem_status_t dmem__pressure_map(dmem_runtime_t *rt, void *va, void *stream) {
  return pressure_alloc(rt, dmem__stable_size(va), stream, FROM_STABLE, &va, NULL, NULL);
}

dmem_status_t dmem__pressure_stable_alloc(dmem_runtime_t *rt, size_t size, void **va_out) {
  void *va = NULL;
  size_t rounded = 0;
  if (size > rt->limit) /* before the granularity rounds it */
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "%zu bytes exceed the device limit of %zu bytes",
                       size, rt->limit);
  dmem_status_t st = dmem__stable_reserve(rt, size, &va, &rounded);
  if (st == DMEM_OK) st = dmem__pressure_map(rt, va, rt->order_stream);
  if (st != DMEM_OK) {
    if (va) dmem__stable_free(rt, va);
    return st;
  }
  *va_out = va;
  return DMEM_OK;
}

static dmem_status_t pressure_alloc(dmem_runtime_t *rt, size_t size, void *stream,
                                    int src, void **dev_out, bool *ordered_out, dmem__swap_t *sw) {
  if (size > rt->limit)
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "%zu bytes exceed the device limit of %zu bytes",
                       size, rt->limit);
  size_t need = 0;
  dmem_status_t st = try_alloc(rt, size, stream, src, dev_out, ordered_out, &need);
  if (st != DMEM_ERR_OUT_OF_MEMORY) {
    if (st == DMEM_OK) dmem__ahead_note(rt);
    return st; /* done, or a device error */
  }
  /* The slow path: this allocation waits for room (stats, NVTX). */
  uint64_t t0 = dmem__now_ns();
  DMEM_NVTX_PUSH("dmem wait for room");
  /* it should have been ahead of this */
  if (rt->ahead_high && dmem__ahead_wanted(rt)) dmem__ahead_kick_slow(rt);
  st = make_room(rt, size, stream, src, dev_out, ordered_out, need, sw);
  DMEM_NVTX_POP();
  uint64_t t1 = dmem__now_ns(), waited = t1 - t0;
  if (rt->ahead_high) dmem__ahead_waited(rt, t0, t1); /* the demand trigger */
  dmem_atomic_add_relaxed(&rt->xs.room_waits, 1);
  dmem_atomic_add_relaxed(&rt->xs.room_wait_ns, waited);
  if (DMEM__TRACE_ON()) {
    /* the runtime's own streams (dmem_buffer_alloc's order, the retrieves') are
     * no user's: their waits go on the device's track */
    if (stream == rt->unspill_stream)
      dmem__trace_event(DMEM__TRACK_TIER, DMEM_TIER_DEVICE, "retrieve waited for room", t0,
                        waited, size, 0, 0);
    else if (stream == rt->order_stream)
      dmem__trace_event(DMEM__TRACK_TIER, DMEM_TIER_DEVICE, "allocation waited for room", t0,
                        waited, size, 0, 0);
    else
      dmem__trace_event(DMEM__TRACK_STREAM, (uintptr_t)stream, "allocation waited for room", t0,
                        waited, size, 0, 0);
  }
  if (st == DMEM_OK) dmem__ahead_note(rt);
  return st;
}

/* Spill (and wait) until the allocation fits; the first attempt already
 * failed, `need` bytes short.
 *
 * It fails only when nothing is left to do: no victim could be spilled, no
 * spill or stream release is in flight (they lower their counters only
 * after their memory is back), none finished since the last attempt (the
 * bytes it freed may have gone to another allocation, which left spillable
 * buffers behind), the empty slabs were given back, and a slab past the
 * pool's cut (dmem__device_alloc_past_slabs) does not fit either. */
static dmem_status_t make_room(dmem_runtime_t *rt, size_t size, void *stream, int src,
                               void **dev_out, bool *ordered_out, size_t need, dmem__swap_t *sw) {
  uint64_t deadline = 0;
  dmem_status_t last_err = DMEM_OK;
  bool told = false, trimmed = false, cut_trimmed = false, passed = false;
  /* acquire: partner is dmem__move_finished's / pending_poll's release */
  uint64_t seen = dmem_atomic_load_acquire(&rt->moves_done);
  for (bool first = true;; first = false) {
    dmem_status_t st = DMEM_ERR_OUT_OF_MEMORY;
    if (!first) {
      seen = dmem_atomic_load_acquire(&rt->moves_done); /* partner: as above */
      st = try_alloc(rt, size, stream, src, dev_out, ordered_out, &need);
    }
    if (st != DMEM_ERR_OUT_OF_MEMORY) return st; /* done, or a device error */
    dmem__spill_poll(rt);
    if (!told && dmem_atomic_load_relaxed(&rt->has_ctl)) {
      /* The controller may make room itself (it runs with no mutex held);
       * look again before evicting by policy. */
      told = true;
      dmem__emit(rt, DMEM_EVENT_PRESSURE, DMEM_HANDLE_NULL, 0, DMEM_TIER_DEVICE, need);
      continue;
    }
    told = false;
    /* When the pool has no range for `size` now, freeing bytes is not
     * enough: they must make one contiguous range (a dedicated block needs
     * none: the trim below gives the device the bytes). Empty slabs go back
     * first (once per allocation: a trim waits for their events): they may
     * make room for a new slab without spilling anything. */
    size_t contig =
        src == FROM_STABLE || dmem__device_fits(rt, (dmem__devsrc_t)src, size, stream) ? 0 : size;
    if (contig && !cut_trimmed) {
      cut_trimmed = trimmed = true;
      size_t released = 0;
      if (dmem__device_trim(rt, 0, &released) == DMEM_OK && released > 0) continue;
    }
    /* The limit holds it, the pool's cut does not (the slabs' tails): a
     * slab past the cut rather than a spill, within a 16th of the limit. */
    if (contig && !passed && src != FROM_STABLE &&
        dmem__device_may_pass_cut(rt, (dmem__devsrc_t)src, size)) {
      passed = true;
      st = dmem__device_alloc_past_slabs(rt, (dmem__devsrc_t)src, size, stream, dev_out,
                                         ordered_out, &need);
      if (st != DMEM_ERR_OUT_OF_MEMORY) return st;
    }
    size_t freed = 0;
    dmem_status_t err = DMEM_OK;
    st = sw ? dmem__evict_swap(rt, need, contig, sw, &freed, &err)
            : dmem__evict(rt, need, contig, DMEM__EVICT_ON_DEMAND, &freed, &err);
    if (st != DMEM_OK) return st;
    if (sw && sw->b) {
      *dev_out = NULL; /* a victim to trade places with, not room */
      return DMEM_OK;
    }
    if (err != DMEM_OK) last_err = err;
    if (freed > 0) {
      deadline = 0;
      trimmed = false;
      continue;
    }
    /* Nothing left to spill. Empty slabs and cached dedicated blocks may
     * be in the way of a larger one (or of other users of the device): give
     * them back once. */
    if (!trimmed) {
      trimmed = true;
      size_t released = 0;
      if (dmem__device_trim(rt, 0, &released) == DMEM_OK && released > 0) continue;
    }
    /* Other threads' moves or pending stream releases may still free
     * memory, or have freed some since the last attempt: wait for them, or
     * try again, with a deadline. acquire: partner is the release that
     * lowers each counter after its memory is back. Not for this thread's
     * own spills (an allocation from a controller's store): they cannot
     * end before the callback returns, so the allocation fails at once. */
    int own = dmem__moving_spills(rt);
    bool hope = dmem_atomic_load_acquire(&rt->spills_in_flight) > own ||
                dmem_atomic_load_acquire(&rt->npending) > 0;
    bool moved = dmem_atomic_load_acquire(&rt->moves_done) != seen; /* partner: as above */
    uint64_t now = dmem__now_ns();
    if (hope || moved) {
      /* dmem_config_t.oom_wait_ms / DMEM_OOM_WAIT */
      if (deadline == 0) deadline = now + (uint64_t)rt->cfg.oom_wait_ms * 1000000u;
      if (now < deadline) {
        if (!moved) dmem__transit_wait_any(rt, 1000u * 1000);
        trimmed = false;
        continue;
      }
    }
    /* The limit holds it but the pool's slabs are cut so that no range
     * fits and none can be added (live blocks keep them): a slab past the
     * pool's cut, the live bytes still under the limit. */
    if (src != FROM_STABLE) {
      st = dmem__device_alloc_past_slabs(rt, (dmem__devsrc_t)src, size, stream, dev_out,
                                         ordered_out, &need);
      if (st != DMEM_ERR_OUT_OF_MEMORY) return st;
    }
    if (last_err != DMEM_OK && last_err != DMEM_ERR_BUSY) return last_err;
    if (own > 0 && !hope)
      return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                         "no device memory for %zu bytes: %zu of %zu bytes used, nothing left "
                         "to spill, and the only spill in flight is the calling thread's own "
                         "(a controller callback's): not waiting for it",
                         size, dmem__device_used(rt), rt->limit);
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                       "no device memory for %zu bytes: %zu of %zu bytes used and nothing "
                       "left to spill",
                       size, dmem__device_used(rt), rt->limit);
  }
}
