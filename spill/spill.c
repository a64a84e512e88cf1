/*
 * spill/spill.c - moving one buffer out of the device: device -> host, disk
 * or controller (the copy runs on the runtime's own copy stream), and tier
 * changes of a buffer already in the host tier. A lock that arrives while a
 * spill copies cancels it (the device copy is still the live one).
 *
 * Every move runs while the mover owns the buffer's TRANSIT bit (see
 * runtime/core/core.h); no mutex is held while copying or calling the
 * controller.
 */
#include "runtime/internal.h"

static void record_spill(dmem_runtime_t *rt, dmem_handle_t h, size_t size, dmem_tier_t tier,
                         uint64_t t0, bool emit) {
  dmem__stats_spill(rt, tier, size, dmem__now_ns() - t0);
  if (emit) dmem__emit(rt, DMEM_EVENT_SPILL, h, size, tier, 0);
}

/* Spill a resident buffer whose TRANSIT we own (state SPILLING, word w).
 *
 * To the host tier the spill is stream-ordered end to end: the copy is
 * enqueued on the spill stream, the pinned staging becomes the host tier's
 * copy, the device range goes back to the pool tagged with the copy's event,
 * and the buffer is DEFERRED_HOST with SPILL_COPY set until the copy is seen
 * complete: no cudaFree, no host synchronisation. A retrieve orders its
 * stream after b->spill_event. The disk and controller tiers need the bytes
 * on the host, so they wait for the copy (as does a full host tier, whose
 * spill goes to disk). */
static dmem_status_t spill_from_device(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                       uint64_t w, const dmem__tier_ops_t *want) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  void *dev = dmem__bdev(b);
  const dmem__tier_ops_t *dest = want;
  dmem_status_t st = DMEM_OK;
  void *ev = NULL;
  bool copied = false; /* the copy is known complete */

  /* Staging left from the last unspill (not charged to any tier): reuse it. */
  void *stage = b->host;
  bool reused = stage != NULL;
  b->host = NULL;
  if (!reused) {
    st = dmem__staging_alloc(rt, size, &stage);
    if (st != DMEM_OK) goto undo;
  }
  if (w & DMEM__F_UNSPILL_COPY) {
    st = dmem__fatal_keep(
        rt, rt->be->stream_wait_event(rt->be, rt->spill_stream, b->unspill_event));
    if (st != DMEM_OK) goto undo;
  }
  st = dmem__event_get(rt, &ev);
  if (st != DMEM_OK) goto undo;
  st = dmem__copy_chunked(rt, stage, dev, size, rt->spill_stream);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, rt->spill_stream));
  if (st != DMEM_OK) {
    (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
    copied = true;
    goto undo;
  }
  dmem_atomic_store_relaxed(&b->spill_event, ev);
  /* release: publishes spill_event; partner is the acquiring CAS of a
   * locker that cancels the spill and then waits on the event */
  dmem_atomic_or_acq_rel(&b->word, DMEM__F_SPILL_COPY);
  dmem__transit_broadcast(rt); /* lockers waiting for SPILL_COPY may cancel now */
  if (dest->adopts_staging) {
    st = dest->store(rt, b, h, stage);
    if (st == DMEM_ERR_HOST_OUT_OF_MEMORY) dest = &dmem__tier_disk; /* full: straight to disk */
  }
  if (!dest->adopts_staging) {
    st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    copied = st == DMEM_OK;
    if (st == DMEM_OK) st = dest->store(rt, b, h, stage);
  }
  if (st != DMEM_OK) goto undo;

  /* Commit unless a lock cancelled the spill meanwhile. */
  w = dmem_atomic_load_acquire(&b->word); /* partner: lockers' CAS */
  for (;;) {
    if (dmem__w_state(w) != DMEM_STATE_SPILLING) {
      /* cancelled: the device copy is the live one */
      dest->drop(rt, b, h);
      dmem_atomic_add_relaxed(&rt->cancelled_spills, 1);
      st = dmem__error(DMEM_ERR_BUSY, "spill of 0x%016llx cancelled by a lock",
                       (unsigned long long)h);
      goto undo;
    }
    DMEM_ASSERT((w & DMEM__F_TRANSIT) && dmem__w_count(w) == 0);
    uint64_t keep = copied ? 0 : DMEM__F_SPILL_COPY; /* the copy still runs */
    uint64_t nw = (dmem__w_with_state(w, dest->state) &
                   ~(DMEM__F_TRANSIT | DMEM__F_SPILL_COPY | DMEM__F_UNSPILL_COPY)) |
                  keep;
    /* release: publishes b->host; partner is the next mover's acquire */
    if (dmem_atomic_cas_acq_rel(&b->word, &w, nw)) {
      dmem_atomic_add_relaxed(&b->spill_count, 1);
      if (!dest->adopts_staging) dmem__hostpool_free(rt->hostpool, stage);
      /* the range is reusable once the copy that reads it is done */
      dmem__device_release_after(rt, dev, size, copied ? NULL : ev);
      if (copied) {
        dmem_atomic_store_relaxed(&b->spill_event, NULL);
        dmem__event_put(rt, ev);
      } else {
        dmem__staging_push(rt, b, h); /* gives ev back once it completes */
      }
      dmem__move_after(rt, b, nw);
      record_spill(rt, h, size, dest->tier, t0, !(nw & DMEM__F_FREED));
      return DMEM_OK;
    }
  }

undo:
  /* The buffer stays resident with its device data intact. The copy may
   * still be writing the staging: wait for it before the staging is reused
   * (the cancel path only). Staging taken from a pending unspill goes back
   * (UNSPILL_COPY stays: that copy may still read it). */
  if (ev && !copied) (void)dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
  b->host = reused ? stage : NULL;
  if (!reused && stage) dmem__hostpool_free(rt->hostpool, stage);
  /* b->spill_event keeps pointing at ev: a locker that cancelled this spill
   * may still be about to make its stream wait on it (events are never
   * destroyed before the runtime, so a late wait is at worst conservative) */
  dmem__move_end(rt, b,
                 (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT),
                                        .clear = DMEM__F_SPILL_COPY});
  if (ev) dmem__event_put(rt, ev);
  return st;
}

/* Wait for the spill copy into the host tier of a DEFERRED_HOST buffer
 * whose TRANSIT we own, and give its event back (tier changes need the
 * bytes on the host). */
static dmem_status_t finish_spill_copy(dmem_runtime_t *rt, dmem__buffer_t *b) {
  uint64_t w = dmem_atomic_load_relaxed(&b->word);
  if (!(w & DMEM__F_SPILL_COPY)) return DMEM_OK;
  void *ev = dmem_atomic_load_relaxed(&b->spill_event);
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
  if (st != DMEM_OK) return st;
  dmem_atomic_and_acq_rel(&b->word, ~DMEM__F_SPILL_COPY);
  dmem_atomic_store_relaxed(&b->spill_event, NULL);
  dmem__event_put(rt, ev);
  return DMEM_OK;
}

/* Move a DEFERRED_HOST buffer whose TRANSIT we own to another tier. */
static dmem_status_t spill_from_host(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                     const dmem__tier_ops_t *dest) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  dmem_status_t st = finish_spill_copy(rt, b);
  if (st == DMEM_OK) st = dest->store(rt, b, h, b->host);
  if (st != DMEM_OK) {
    dmem__move_end(rt, b, (dmem__transit_exit_t){0});
    return st;
  }
  dmem__tier_host.drop(rt, b, h);
  dmem__host_copy_release(rt, b);
  uint64_t nw = dmem__move_end(rt, b, (dmem__transit_exit_t){.to = DMEM__TO(dest->state)});
  dmem_atomic_add_relaxed(&rt->ns_spilling, dmem__now_ns() - t0);
  if (!(nw & DMEM__F_FREED)) dmem__emit(rt, DMEM_EVENT_SPILL, h, size, dest->tier, 0);
  return DMEM_OK;
}

dmem_status_t dmem__spill_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 dmem_tier_t tier, bool by_policy) {
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  const dmem__tier_ops_t *dest = dmem__tier_of(tier);
  if (!dest) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "spill: invalid tier %d", (int)tier);
  if (dest == &dmem__tier_controller) {
    dmem_controller_t c;
    if (!dmem__controller_get(rt, &c) || !c.store || !c.retrieve)
      return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                         "spill to the controller tier needs a controller with store/retrieve");
  }
  /* acquire: partner is the release of the last mover / dmem_alloc */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  for (;;) {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    if (dmem__bflags(b) & DMEM_ALLOC_PINNED)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is pinned", (unsigned long long)h);
    unsigned s = dmem__w_state(w);
    if ((w & DMEM__F_TRANSIT) || s == DMEM_STATE_SPILLING || s == DMEM_STATE_UNSPILLING)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is being moved", (unsigned long long)h);
    /* A victim only frees device memory if it is still resident: one that
     * another thread spilled meanwhile is skipped, not "moved" again. */
    if (by_policy && s != DMEM_STATE_RESIDENT)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is no longer resident",
                         (unsigned long long)h);
    if (s == DMEM_STATE_RESIDENT) {
      if (dmem__w_count(w) > 0)
        return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is locked (%u)",
                           (unsigned long long)h, dmem__w_count(w));
      if (!dmem__transit_take(b, &w, DMEM_STATE_SPILLING, 0)) continue;
      dmem_atomic_add_relaxed(&rt->spills_in_flight, 1);
      DMEM_NVTX_PUSH("dmem spill");
      st = spill_from_device(rt, b, h, w, dest);
      DMEM_NVTX_POP();
      dmem_atomic_sub_relaxed(&rt->spills_in_flight, 1);
      return st;
    }
    if (s == dest->state) return DMEM_OK;
    if (s == DMEM_STATE_DEFERRED_HOST) {
      if (!dmem__transit_take(b, &w, s, 0)) continue;
      return spill_from_host(rt, b, h, dest);
    }
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "cannot move handle 0x%016llx from state %u to tier %d; unspill first",
                       (unsigned long long)h, s, (int)tier);
  }
}
