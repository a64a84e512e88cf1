/*
 * spill/prefetch.c - dmem_buffer_prefetch's batch: buffers brought back on the
 * host->device copy stream without being locked, and the caller's stream
 * ordered after the whole batch by one event. Each counts as just used (its
 * LRU stamp renewed), or under the default policy as about to be used (on
 * the window until its unlock), so that eviction does not take it back
 * first.
 */
#include "spill/spill.h"

dmem_status_t dmem__prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                             void *stream, size_t *done_out) {
  size_t i = 0;
  /* a bad handle anywhere: nothing is prefetched */
  dmem_status_t st = dmem__table_check_all(rt->table, hs, n);
  if (st != DMEM_OK) {
    if (done_out) *done_out = 0;
    return st;
  }
  DMEM_NVTX_PUSH("dmem prefetch");
  for (; i < n; i++) {
    dmem__buffer_t *b = dmem__table_lookup(rt->table, hs[i]);
    if (!b) {
      st = dmem__stale(hs[i]);
      break;
    }
    st = dmem__retrieve(rt, b, hs[i], stream, DMEM__RETRIEVE_PREFETCH, NULL);
    if (st != DMEM_OK) break;
    /* About to be locked: not the next victim, which would evict it before
     * the lock it was brought back for. LRU: the most recently used, as an
     * unlock would make it (its old stamp made it the first victim). The
     * default policy (spill/reuse.c): brought back (its arrival is
     * retrieve.c's), it joins the window unused, and once used it is the
     * first victim: a loop that prefetches ahead keeps the buffers it did
     * not cycle, as Belady's MIN does; resident, it moves to its list's
     * newest end (to hot if used since it came back: it fits). Not a use:
     * a loop that prefetches ahead would make every buffer hot (LRU
     * again). */
    if (rt->pol_lru) dmem_atomic_store_relaxed(&b->last_use, dmem__lru_stamp(rt));
    else dmem__policy_arrive(rt, b, DMEM__ARRIVE_SOON);
  }
  /* One event after every copy enqueued so far on the host->device stream
   * (a FIFO): the caller's stream waits for the batch once. Buffers that
   * were resident already, or whose spill was cancelled, need no wait: a
   * lock orders after their copies by their flags. */
  if (i > 0) {
    void *ev = NULL;
    dmem_status_t q = dmem__event_get(rt, &ev);
    if (q == DMEM_OK) q = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, rt->unspill_stream));
    if (q == DMEM_OK) q = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, stream, ev));
    /* the wait captured the record: the event may go back at once */
    if (ev) dmem__event_put(rt, ev);
    if (st == DMEM_OK) st = q;
  }
  DMEM_NVTX_POP();
  if (done_out) *done_out = i;
  return st;
}
