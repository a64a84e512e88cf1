/*
 * spill/reclaim.c - the end of a buffer's life and of a move. A freed
 * buffer's memory goes back exactly once, by whichever party's CAS makes
 * "FREED && count == 0 && !TRANSIT" true: dmem_buffer_free (runtime/api/buffer.c), the
 * last unlock (here), or the TRANSIT owner ending its move (here).
 */
#include "spill/spill.h"

_Thread_local uint64_t dmem__tl_lru_seq;

void dmem__reclaim(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t w) {
  DMEM_ASSERT((w & DMEM__F_FREED) && dmem__w_count(w) == 0 && !(w & DMEM__F_TRANSIT));
  unsigned state = dmem__w_state(w);
  size_t size = dmem__bsize(b);
  if (w & DMEM__F_UNSPILL_COPY) {
    /* The unspill copy may still read the staging and write the device
     * memory: wait for it before freeing either. */
    (void)dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, b->unspill_event));
  }
  if (w & DMEM__F_SPILL_COPY) {
    /* A spill copy may still write the host tier's copy (DEFERRED_HOST), or
     * read the device memory (a cancelled spill not yet undone cannot be
     * here: its owner holds TRANSIT). */
    void *ev = dmem_atomic_load_relaxed(&b->spill_event);
    (void)dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    dmem_atomic_store_relaxed(&b->spill_event, NULL);
    dmem__event_put(rt, ev);
  }
  const bool stable = (dmem__bflags(b) & DMEM_BUFFER_STABLE_ADDRESS) != 0;
  if (stable) dmem__stable_free(rt, dmem__bdev(b)); /* mapped or not: the range goes */
  if (state == DMEM_STATE_RESIDENT) {
    /* unlocked and freed: the last user's work is done */
    if (!stable) dmem__device_release_after(rt, dmem__bdev(b), size, NULL);
    if (dmem__bflags(b) & DMEM_ALLOC_PINNED) dmem_atomic_sub_relaxed(&rt->device_pinned, size);
  } else {
    const dmem__tier_ops_t *tier = dmem__tier_of_state(state);
    DMEM_ASSERT(tier != NULL);
    if (tier) tier->drop(rt, b, dmem__handle_of(b, w));
  }
  dmem__host_copy_release(rt, b);
  if (b->unspill_event) {
    dmem__event_put(rt, b->unspill_event);
    b->unspill_event = NULL;
  }
  dmem_atomic_sub_relaxed(&rt->buffer_count, 1);
  dmem__table_give(rt->table, b);
}

void dmem__move_after(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw) {
  DMEM_ASSERT(!(nw & DMEM__F_TRANSIT));
  dmem__moving_end(rt, dmem__handle_of(b, nw));
  if ((nw & DMEM__F_FREED) && dmem__w_count(nw) == 0) dmem__reclaim(rt, b, nw);
  dmem__transit_broadcast(rt);
}

void dmem__moves_after(dmem_runtime_t *rt, dmem__buffer_t *const *bs, const uint64_t *nws,
                       size_t n) {
  for (size_t i = 0; i < n; i++) {
    DMEM_ASSERT(!(nws[i] & DMEM__F_TRANSIT));
    dmem__moving_end(rt, dmem__handle_of(bs[i], nws[i]));
    if ((nws[i] & DMEM__F_FREED) && dmem__w_count(nws[i]) == 0) dmem__reclaim(rt, bs[i], nws[i]);
  }
  if (n) dmem__transit_broadcast(rt);
}

uint64_t dmem__move_end(dmem_runtime_t *rt, dmem__buffer_t *b, dmem__transit_exit_t exit) {
  uint64_t nw = dmem__transit_end(b, exit);
  dmem__move_after(rt, b, nw);
  return nw;
}

/* The body of both (inlined into each: an unlock is on the lock path's
 * hot loop, bench_lock). */
static inline __attribute__((always_inline)) dmem_status_t
unlock_count(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, uint64_t *reclaim_w_out) {
  *reclaim_w_out = 0;
  /* acquire: partner is the lock's CAS */
  uint64_t w = dmem_atomic_load_acquire(&b->word), nw;
  size_t size;
  do {
    if (dmem__w_gen(w) != dmem__h_gen(h) || dmem__w_state(w) == DMEM__STATE_FREE)
      return dmem__stale(h);
    if (dmem__w_count(w) == 0) {
      if (w & DMEM__F_FREED) return dmem__stale(h);
      return dmem__error(DMEM_ERR_NOT_LOCKED, "handle 0x%016llx is not locked",
                         (unsigned long long)h);
    }
    /* The last unlock of a freed buffer reclaims it, which a forked child
     * must not do (mutexes, the backend): refused there, nothing changes.
     * Any other unlock in a child only writes the child's copy of the word
     * (and so costs no check here). */
    nw = w - 1;
    /* read while the word says this generation is locked: the CAS below
     * succeeds only if that is still so, and the size is set before a
     * generation is published */
    size = dmem__bsize(b);
    /* one compare of the new word, a branch not taken on the hot path */
    if (__builtin_expect((nw & (DMEM__F_FREED | DMEM__COUNT_MASK)) == DMEM__F_FREED, 0) &&
        dmem_atomic_load_relaxed(&rt->fatal) == DMEM__FORKED)
      return dmem__forked_error();
    /* release: the caller's device work is done; partner is the spiller's
     * acquiring CAS */
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  if (dmem__w_count(nw) == 0) {
    dmem__locked_add(rt->table, (uint64_t)0 - size);
    /* the eviction policy's recency: a mark on this buffer's own line (the
     * default), or the LRU stamp (DMEM_EVICTION_POLICY=lru) */
    if (__builtin_expect(rt->pol_lru, 0))
      dmem_atomic_store_relaxed(&b->last_use, dmem__lru_stamp(rt));
    else
      dmem__policy_mark(rt, b);
    if ((nw & DMEM__F_FREED) && !(nw & DMEM__F_TRANSIT)) *reclaim_w_out = nw;
  }
  return DMEM_OK;
}

dmem_status_t dmem__unlock_count(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 uint64_t *reclaim_w_out) {
  return unlock_count(rt, b, h, reclaim_w_out);
}

dmem_status_t dmem__unlock_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  uint64_t w;
  dmem_status_t st = unlock_count(rt, b, h, &w);
  if (__builtin_expect(w != 0, 0)) dmem__reclaim(rt, b, w);
  return st;
}
