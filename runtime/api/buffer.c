/*
 * runtime/api/buffer.c - the buffer calls: dmem_buffer_alloc (and the publication of a
 * new buffer it shares with dmem_device_adopt), dmem_buffer_free,
 * dmem_buffer_info, dmem_buffer_set_priority, dmem_buffer_read (the state machine
 * is spill/read.c), and the lock fast path (one CAS on a
 * resident buffer; everything else goes to the retrieve state machine in
 * spill/retrieve.c) with dmem_buffer_unlock.
 */
#include "api/api.h"
#include <string.h>

/* A buffer with a device address of its own (spill/pressure.c,
 * memory/stable.c): fresh physical memory, nothing to order after. */
static dmem_status_t alloc_stable(dmem_runtime_t *rt, size_t size, unsigned flags,
                                  dmem_handle_t *h_out) {
  void *va = NULL;
  dmem_status_t st = dmem__pressure_stable_alloc(rt, size, &va);
  if (st != DMEM_OK) return st;
  uint32_t slot;
  dmem__buffer_t *b = NULL;
  st = dmem__table_take(rt->table, &slot, &b);
  if (st != DMEM_OK) {
    dmem__stable_free(rt, va);
    return st;
  }
  *h_out = dmem__buffer_publish(rt, b, slot, size, flags, va, NULL, 0);
  return DMEM_OK;
}

dmem_status_t dmem_buffer_alloc(dmem_runtime_t *rt, size_t size, unsigned flags, dmem_handle_t *h_out) {
  if (!rt || !h_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_alloc: NULL argument");
  if (size == 0) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_alloc: size 0");
  if (flags & ~(unsigned)(DMEM_ALLOC_PINNED | DMEM_BUFFER_STABLE_ADDRESS))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_alloc: unknown flags 0x%x", flags);
  if ((flags & DMEM_ALLOC_PINNED) && (flags & DMEM_BUFFER_STABLE_ADDRESS))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_buffer_alloc: DMEM_ALLOC_PINNED with DMEM_BUFFER_STABLE_ADDRESS");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  if (flags & DMEM_BUFFER_STABLE_ADDRESS) return alloc_stable(rt, size, flags, h_out);
  /* The buffer has no stream yet: its block is taken in the order stream's
   * order. If the pool made that stream wait for the block's last use (a
   * spill copy, say), lockers order their streams after an event recorded
   * there, as after an unspill copy (UNSPILL_COPY). */
  void *dev = NULL, *ready = NULL;
  bool ordered = false;
  st = dmem__pressure_alloc(rt, size, rt->order_stream, DMEM__SRC_POOL, &dev, &ordered);
  if (st != DMEM_OK) return st;
  if (ordered) {
    st = dmem__event_get(rt, &ready);
    if (st == DMEM_OK)
      st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ready, rt->order_stream));
  }
  uint32_t slot;
  dmem__buffer_t *b = NULL;
  if (st == DMEM_OK) st = dmem__table_take(rt->table, &slot, &b);
  if (st != DMEM_OK) {
    if (ready) dmem__event_put(rt, ready);
    dmem__device_release(rt, dev, size, rt->order_stream);
    return st;
  }
  *h_out = dmem__buffer_publish(rt, b, slot, size, flags, dev, ready, 0);
  return DMEM_OK;
}

dmem_handle_t dmem__buffer_publish(dmem_runtime_t *rt, dmem__buffer_t *b, uint32_t slot,
                                   size_t size, unsigned flags, void *dev, void *ready,
                                   uint32_t locks) {
  dmem_atomic_store_relaxed(&b->size, size);
  DMEM_ASSERT(flags <= UINT16_MAX);
  dmem_atomic_store_relaxed(&b->flags, (uint16_t)flags);
  dmem_atomic_store_relaxed(&b->dev, dev);
  b->host = NULL;
  b->unspill_event = ready;
  dmem_atomic_store_relaxed(&b->spill_event, NULL);
  dmem_atomic_store_relaxed(&b->priority, 0);
  dmem_atomic_store_relaxed(&b->spill_count, 0);
  if (rt->pol_lru) {
    dmem_atomic_add_relaxed(&rt->lru_epoch, 1); /* newer than every earlier unlock */
    dmem_atomic_store_relaxed(&b->last_use, dmem__lru_stamp(rt));
  }
  if (flags & DMEM_ALLOC_PINNED) dmem_atomic_add_relaxed(&rt->device_pinned, size);
  if (locks > 0) dmem__locked_add(rt->table, size);
  dmem_atomic_add_relaxed(&rt->buffer_count, 1);
  uint64_t gen = dmem__w_gen(dmem_atomic_load_relaxed(&b->word));
  /* release: publishes the fields above; partner is the acquire load in
   * dmem_buffer_lock and every other handle-taking call */
  dmem_atomic_store_release(&b->word, (gen << DMEM__GEN_SHIFT) |
                                          ((uint64_t)DMEM_STATE_RESIDENT << DMEM__STATE_SHIFT) |
                                          (ready ? DMEM__F_UNSPILL_COPY : 0) | locks);
  dmem_handle_t h = (gen << 32) | slot;
  /* after the word is published: a drain looks at it (spill/reuse.c) */
  dmem__policy_arrive(rt, b, DMEM__ARRIVE_NEW);
  if (ready) dmem__staging_push(rt, b, h); /* clears UNSPILL_COPY once it completes */
  dmem__emit(rt, DMEM_EVENT_ALLOC, h, size, DMEM_TIER_DEVICE, 0);
  return h;
}

dmem_status_t dmem_buffer_free(dmem_runtime_t *rt, dmem_handle_t h) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_free: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  dmem__pending_poll(rt, false); /* finished releases first: reclaim at once */
  /* acquire: partner is the release in dmem_buffer_alloc / dmem__transit_end */
  uint64_t w = dmem_atomic_load_acquire(&b->word), nw;
  do {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    nw = w | DMEM__F_FREED;
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  size_t size = dmem__bsize(b);
  /* Freed while the controller's store of it runs (TRANSIT): its mover
   * sends the FREE event after store() returns (core.h:
   * dmem__store_watch), so that the controller drops what it stored. */
  if (!(nw & DMEM__F_TRANSIT) || !dmem__store_hand_over(b))
    dmem__emit(rt, DMEM_EVENT_FREE, h, size, dmem__tier_public(dmem__w_state(w)), 0);
  if (dmem__w_count(nw) == 0 && !(nw & DMEM__F_TRANSIT)) dmem__reclaim(rt, b, nw);
  return DMEM_OK;
}

dmem_status_t dmem_buffer_info(dmem_runtime_t *rt, dmem_handle_t h, dmem_buffer_info_t *info_out) {
  if (!rt || !info_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_info: NULL argument");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  dmem__pending_poll(rt, false); /* lock counts as of now, finished releases done */
  uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: dmem_buffer_alloc's release */
  if (!dmem__word_live(w, h)) return dmem__stale(h);
  dmem_buffer_info_t info;
  memset(&info, 0, sizeof info);
  info.size = dmem__bsize(b);
  info.state = (dmem_state_t)dmem__w_state(w);
  info.lock_count = dmem__w_count(w);
  info.pinned = (dmem__bflags(b) & DMEM_ALLOC_PINNED) != 0;
  info.priority = dmem_atomic_load_relaxed(&b->priority);
  info.spill_count = dmem_atomic_load_relaxed(&b->spill_count);
  /* re-check: the slot may have been recycled while we read */
  if (dmem_atomic_load_acquire(&b->word) >> DMEM__GEN_SHIFT != w >> DMEM__GEN_SHIFT)
    return dmem__stale(h);
  *info_out = info;
  return DMEM_OK;
}

dmem_status_t dmem_buffer_set_priority(dmem_runtime_t *rt, dmem_handle_t h, int priority) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_set_priority: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: dmem_buffer_alloc's release */
  if (!dmem__word_live(w, h)) return dmem__stale(h);
  dmem_atomic_store_relaxed(&b->priority, priority);
  /* the next eviction pass moves it to its new class's lists */
  dmem__policy_arrive(rt, b, DMEM__ARRIVE_PRIO);
  return DMEM_OK;
}

dmem_status_t dmem_buffer_read(dmem_runtime_t *rt, dmem_handle_t h, size_t offset, void *dst,
                               size_t n) {
  if (!rt || (!dst && n > 0))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_read: NULL argument");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  return dmem__read(rt, b, h, offset, dst, n);
}

dmem_status_t dmem__lock(dmem_runtime_t *rt, dmem_handle_t h, void *stream, void **dev_out,
                         dmem__buffer_t **b_out) {
  dmem__buffer_t *b;
  uint64_t w = 0;
  if (dmem__lock_fast(rt, h, dev_out, &b, &w)) {
    if (b_out) *b_out = b;
    return DMEM_OK;
  }
  if (!b) return dmem__stale(h);
  uint64_t t0 = DMEM__TRACE_ON() ? dmem__now_ns() : 0;
  dmem_status_t st = dmem__retrieve(rt, b, h, stream, DMEM__RETRIEVE_LOCK, dev_out);
  if (t0) /* the slow path: a retrieve, or a wait for a move in flight */
    dmem__trace_event(DMEM__TRACK_STREAM, (uintptr_t)stream, "lock wait", t0,
                      dmem__now_ns() - t0, dmem__bsize(b), 1, h);
  if (st == DMEM_OK && b_out) *b_out = b;
  return st;
}

dmem_status_t dmem_buffer_lock(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream,
                        void **dev_ptr_out) {
  if (!rt || !dev_ptr_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_lock: NULL argument");
  return dmem__lock(rt, h, stream, dev_ptr_out, NULL);
}

dmem_status_t dmem_buffer_unlock(dmem_runtime_t *rt, dmem_handle_t h) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_unlock: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  return dmem__unlock_buffer(rt, b, h);
}
