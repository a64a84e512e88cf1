/*
 * spill/retrieve.c - bringing a buffer back: the one state machine behind
 * dmem_buffer_lock's slow path and dmem_buffer_unspill. It waits out other movers, cancels
 * a spill whose copy is in flight (the device copy is still intact), or takes
 * TRANSIT on a deferred buffer and copies it back on the caller's stream, so
 * that the caller's next work is ordered after the copy without a host
 * synchronisation.
 */
#include "spill/spill.h"
#include "spill/summary.h"

/* After a successful lock or cancel CAS (new word nw): order `stream` after
 * the copies still in flight on the buffer. */
static dmem_status_t order_after_copies(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw,
                                        void *stream) {
  if (nw & DMEM__F_UNSPILL_COPY) {
    dmem_status_t q = dmem__fatal_keep(rt, rt->be->event_query(rt->be, b->unspill_event));
    if (q == DMEM_ERR_BUSY)
      q = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, stream, b->unspill_event));
    if (q != DMEM_OK) return q;
  }
  if (nw & DMEM__F_SPILL_COPY) {
    /* A lock keeps a new spill from starting, but an unspill (no lock) that
     * cancelled a spill does not: by now the spiller may have undone it
     * (after waiting for its copy) and a later spill come and gone, its
     * event given back and spill_event cleared. NULL: no copy left to wait
     * for. Another spill's event: a conservative wait. */
    void *ev = dmem_atomic_load_relaxed(&b->spill_event);
    dmem_status_t q =
        ev ? dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, stream, ev)) : DMEM_OK;
    if (q != DMEM_OK) return q;
  }
  return DMEM_OK;
}

/* Copy a deferred buffer whose TRANSIT we own back to the device. The copy
 * runs on the runtime's host->device stream (rt->unspill_stream), so that
 * it starts at once rather than behind the caller's queued kernels and
 * overlaps the spill copies on the device->host stream; `stream` is then
 * made to wait for it (not in DMEM__RETRIEVE_PREFETCH mode: dmem_buffer_prefetch
 * orders the caller's stream once after the whole batch). `from` is the
 * deferred state; the lock (if locking) was taken with TRANSIT and is
 * dropped again on failure. A tier whose row says pipelined now (the disk,
 * unless its pool is too tight to pipeline: dmem__disk_pipelined) enqueues
 * the copies itself as its pieces arrive (load_device); the others load
 * into pinned memory at b->host, copied in one go. */
static dmem_status_t copy_back(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                               unsigned from, void *stream, dmem__retrieve_mode_t mode) {
  const bool locking = mode == DMEM__RETRIEVE_LOCK;
  uint64_t t0 = dmem__now_ns();
  const dmem__tier_row_t *row = dmem__tier_row_of_state(from);
  DMEM_ASSERT(row != NULL);
  const dmem__tier_ops_t *tier = row->ops;
  size_t size = dmem__bsize(b);
  void *dev = NULL;
  void *cs = rt->unspill_stream;
  DMEM_NVTX_PUSH("dmem unspill");
  /* a spill into the host tier may still be copying: order after it */
  void *spill_ev = (dmem_atomic_load_relaxed(&b->word) & DMEM__F_SPILL_COPY)
                       ? dmem_atomic_load_relaxed(&b->spill_event)
                       : NULL;
  const bool stable = (dmem__bflags(b) & DMEM_BUFFER_STABLE_ADDRESS) != 0;
  /* From the host tier into a full device: trade places with the victim
   * rather than pin its bytes anew (spill/swap.c) */
  dmem__swap_t sw = {.size = size, .self = b};
  bool offer = !stable && tier == &dmem__tier_host && b->host && size > 0 &&
               dmem__swap_ready(rt);
  bool swapped = false;
  dmem_status_t st;
  /* a swap cannot be undone once traded: its event first */
  if (offer && !b->unspill_event && dmem__event_get(rt, &b->unspill_event) != DMEM_OK)
    offer = false;
  if (offer) {
    st = dmem__pressure_retrieve(rt, size, cs, &sw, &dev);
    if (st == DMEM_OK && !dev) {
      st = dmem__swap_in(rt, b, &sw, spill_ev, &dev);
      swapped = st == DMEM_OK;
      if (st == DMEM_ERR_HOST_OUT_OF_MEMORY)
        st = dmem__pressure_alloc(rt, size, cs, DMEM__SRC_POOL, &dev, NULL); /* the usual way */
    }
  } else {
    st = stable ? dmem__pressure_map(rt, dmem__bdev(b), cs)
                : dmem__pressure_alloc(rt, size, cs, DMEM__SRC_POOL, &dev, NULL);
  }
  if (stable && st == DMEM_OK) dev = dmem__bdev(b); /* mapped at the same address */
  bool piped = false;
  if (!swapped && st == DMEM_OK && row->pipelined && row->pipelined(rt)) {
    /* pipelined: the tier enqueues the copies on cs itself, piece by piece
     * (after the wait for the spill copy) */
    if (spill_ev) st = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, cs, spill_ev));
    if (st == DMEM_OK && !b->unspill_event) st = dmem__event_get(rt, &b->unspill_event);
    if (st == DMEM_OK) st = tier->load_device(rt, b, h, dev, cs);
    if (st == DMEM_ERR_HOST_OUT_OF_MEMORY) {
      /* no pinned staging slot: recycle that of finished unspill copies,
       * again; then (the pool cannot give a slot's worth) the whole buffer
       * through staging of its own size, below */
      dmem__staging_poll(rt, true);
      st = tier->load_device(rt, b, h, dev, cs);
    }
    piped = st != DMEM_ERR_HOST_OUT_OF_MEMORY;
    if (!piped) st = DMEM_OK;
    else if (st != DMEM_OK) goto rollback; /* dev goes back ordered after the copies */
  }
  if (!piped && !swapped) {
    if (st != DMEM_OK) goto rollback; /* no device range: nothing to load into */
    st = tier->load(rt, b, h); /* the bytes are now pinned at b->host */
    if (st == DMEM_ERR_HOST_OUT_OF_MEMORY && !tier->adopts_staging) {
      /* no pinned staging: recycle that of finished unspill copies, again */
      dmem__staging_poll(rt, true);
      st = tier->load(rt, b, h);
    }
    if (st != DMEM_OK) goto rollback;
    if (spill_ev) st = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, cs, spill_ev));
    if (st == DMEM_OK && !b->unspill_event) st = dmem__event_get(rt, &b->unspill_event);
    if (st == DMEM_OK) st = dmem__copy_chunked(rt, dev, b->host, size, cs);
  }
  if (st == DMEM_OK)
    st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, b->unspill_event, cs));
  if (st == DMEM_OK && mode != DMEM__RETRIEVE_PREFETCH)
    st = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, stream, b->unspill_event));
  if (st != DMEM_OK) {
    (void)rt->be->stream_synchronize(rt->be, cs);
    /* traded places: the bytes are on the device now, and b->host is the
     * victim's; there is nothing to go back to, and nothing left to order */
    if (swapped) st = DMEM_OK;
  }
  if (st != DMEM_OK) {
    if (!tier->adopts_staging) dmem__host_copy_release(rt, b); /* the tier keeps its copy */
    goto rollback;
  }
  dmem_atomic_store_relaxed(&b->dev, dev);
  if (spill_ev) { /* our stream's wait captured it: the event may go back */
    dmem_atomic_store_relaxed(&b->spill_event, NULL);
    dmem__event_put(rt, spill_ev);
  }
  /* The tier forgets the buffer; b->host (if the tier used it) is now
   * staging, recycled once the copy is done (spill/staging.c). */
  tier->drop(rt, b, h);
  if (DMEM__TRACE_ON())
    dmem__trace_event(DMEM__TRACK_TIER, (uintptr_t)tier->tier,
                      mode == DMEM__RETRIEVE_PREFETCH ? "prefetch" : "unspill", t0,
                      dmem__now_ns() - t0, size, 1, h);
  dmem__stats_unspill(rt, tier->tier, size, dmem__now_ns() - t0);
  if (mode == DMEM__RETRIEVE_PREFETCH) {
    dmem_atomic_add_relaxed(&rt->xs.prefetch_count, 1);
    dmem_atomic_add_relaxed(&rt->xs.prefetch_bytes, size);
  }
  dmem__staging_push(rt, b, h);
  /* release: publishes b->dev and b->unspill_event; partner is the lockers'
   * acquire */
  uint64_t nw = dmem__move_end(rt, b,
                               (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT),
                                                      .set = DMEM__F_UNSPILL_COPY,
                                                      .clear = DMEM__F_SPILL_COPY});
  /* back on the device, and resident when a drain looks (spill/reuse.c) */
  if (!(nw & DMEM__F_FREED)) dmem__policy_arrive(rt, b, DMEM__ARRIVE_BACK);
  DMEM_NVTX_POP();
  if (!(nw & DMEM__F_FREED)) dmem__emit(rt, DMEM_EVENT_UNSPILL, h, size, tier->tier, 0);
  return DMEM_OK;

rollback:
  DMEM_NVTX_POP();
  if (dev && stable) {
    (void)rt->be->stream_synchronize(rt->be, cs); /* copies into it: done before the unmap */
    (void)dmem__stable_unmap(rt, dev);
  } else if (dev) {
    dmem__device_release(rt, dev, size, cs);
  }
  uint64_t rw = dmem__move_end(rt, b, (dmem__transit_exit_t){.to = DMEM__TO(from), .drop_lock = locking});
  /* the lock taken with TRANSIT is gone again (no other could be added
   * while UNSPILLING): its bytes no longer count as locked */
  if (locking && dmem__w_count(rw) == 0) dmem__locked_add(rt->table, (uint64_t)0 - size);
  return st;
}

dmem_status_t dmem__retrieve(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                             void *stream, dmem__retrieve_mode_t mode, void **dev_out) {
  const bool locking = mode == DMEM__RETRIEVE_LOCK;
  const uint32_t locks = locking ? 1u : 0u;
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  /* acquire: partner is the releasing CAS of the TRANSIT owner */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  for (;;) {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    unsigned s = dmem__w_state(w);
    bool moving = (w & DMEM__F_TRANSIT) || s == DMEM_STATE_SPILLING || s == DMEM_STATE_UNSPILLING;
    bool cancellable = s == DMEM_STATE_SPILLING && (w & DMEM__F_SPILL_COPY);
    if (moving && dmem__moving_self(rt, h))
      return dmem__error(DMEM_ERR_BUSY,
                         "handle 0x%016llx is being moved by the calling thread's callback",
                         (unsigned long long)h);
    /* Resident (even while the staging poller owns TRANSIT to recycle its
     * staging: a lock does not disturb that), or spilling with the copy in
     * flight: lock / cancel with one CAS. */
    if (s == DMEM_STATE_RESIDENT || cancellable) {
      if (!locking && s == DMEM_STATE_RESIDENT) return DMEM_OK;
      if (locking && dmem__w_count(w) >= DMEM_LOCK_COUNT_MAX)
        return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "lock count of handle 0x%016llx at maximum",
                           (unsigned long long)h);
      /* A lock (or unspill) on a spilling buffer cancels the spill: the
       * device copy is intact; the spiller sees the state change and
       * discards its copy. */
      uint64_t nw = dmem__w_with_state(w + locks, DMEM_STATE_RESIDENT);
      if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
      if (locking && dmem__w_count(w) == 0) dmem__locked_add(rt->table, dmem__bsize(b));
      if (cancellable) dmem__transit_broadcast(rt);
      /* a prefetch leaves the caller's stream alone: a later lock orders
       * it after the copies still in flight (their flags stay set) */
      st = mode == DMEM__RETRIEVE_PREFETCH ? DMEM_OK : order_after_copies(rt, b, nw, stream);
      if (st != DMEM_OK) {
        if (locking) (void)dmem__unlock_buffer(rt, b, h);
        return st;
      }
      if (dev_out) *dev_out = dmem__bdev(b);
      return DMEM_OK;
    }
    if (moving) {
      /* a move of it out of a tier that keeps its bytes pinned (the host
       * tier: a push-down to disk) stops at its next chunk (tier_disk.c) */
      const dmem__tier_ops_t *held = dmem__tier_of_state(s);
      if (held && held->adopts_staging) dmem_atomic_store_relaxed(&b->io_cancel, 1);
      dmem__transit_wait(rt, b, w);
      w = dmem_atomic_load_acquire(&b->word); /* partner: dmem__transit_end */
      continue;
    }
    /* Deferred and nobody moving it: take TRANSIT (and the lock) at once. */
    if (!dmem__transit_take(b, &w, DMEM_STATE_UNSPILLING, locks)) continue;
    /* a deferred buffer is never locked: this is its first lock */
    if (locking) dmem__locked_add(rt->table, dmem__bsize(b));
    /* its eviction's callbacks and the controller's retrieve may call back
     * in: a call on h from them gets BUSY (core.h) */
    dmem__moving_t m;
    dmem__moving_push(&m, rt, h, false);
    st = copy_back(rt, b, h, s, stream, mode);
    dmem__moving_pop(&m);
    if (st != DMEM_OK) return st;
    if (dev_out) *dev_out = dmem__bdev(b);
    return DMEM_OK;
  }
}
