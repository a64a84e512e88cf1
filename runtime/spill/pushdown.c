/*
 * spill/pushdown.c - keeping each tier under its limit: the I/O threads'
 * background job (spill/io.c). It walks the tier table (spill/tier.c): a
 * tier with a limit (ops->limit; the host tier: host_limit) and a next tier
 * (the disk) is pushed down. A store that takes such a tier past its limit
 * kicks the job (spill/tier_host.c); it then moves the tier's buffers that
 * were used least recently (lowest priority first, as the device's victim
 * policy) to the next tier, until the tier is back under the limit.
 *
 * Each move is an ordinary tier change (dmem__spill_buffer to the next
 * tier): it owns only the moving buffer's TRANSIT and holds no mutex while
 * it writes, so locks and moves of other buffers never wait for it; a
 * locker of the buffer itself stops the write at its next chunk
 * (b->io_cancel) and takes the pinned copy. A write that fails leaves the
 * buffer where it was and ends the run; the next kick tries again.
 */
#include "spill/spill.h"
#include <stdlib.h>

/* In a tier that is pushed down (a limit and a next tier) and nobody
 * moving or freeing it. */
static bool in_pushed_tier(uint64_t w, const dmem__buffer_t *b) {
  (void)b;
  const dmem__tier_row_t *r = dmem__tier_row_of_state(dmem__w_state(w));
  return r && r->next && r->ops->limit && !(w & (DMEM__F_TRANSIT | DMEM__F_FREED));
}

/* The tier holds more than its limit, not counting the bytes being
 * written down now. */
static bool over_limit(dmem_runtime_t *rt, const dmem__tier_ops_t *t, size_t limit) {
  return t->used(rt) > limit + dmem_atomic_load_relaxed(&rt->tier_pushing[t->tier]);
}

/* Count size bytes as being written down, if the tier is still over its
 * limit without them: one CAS, so that threads pushing at once do not all
 * act on the same excess. */
static bool claim(dmem_runtime_t *rt, const dmem__tier_ops_t *t, size_t limit, size_t size) {
  _Atomic size_t *pushing = &rt->tier_pushing[t->tier];
  size_t p = dmem_atomic_load_relaxed(pushing);
  for (;;) {
    if (t->used(rt) <= limit + p) return false;
    if (dmem_atomic_cas_relaxed(pushing, &p, p + size)) return true;
  }
}

/* Push one tier down to its next; cand: the buffers of every pushed tier,
 * in victim order. Returns whether it moved any. */
static bool push_tier(dmem_runtime_t *rt, const dmem__tier_row_t *r, size_t limit,
                      const dmem__victim_t *cand, size_t n) {
  const dmem__tier_ops_t *t = r->ops;
  bool moved = false;
  for (size_t i = 0; i < n && over_limit(rt, t, limit) && !dmem__io_stopping(rt->io); i++) {
    /* still in this tier and nobody moving it? (the spill re-checks) */
    uint64_t w = dmem_atomic_load_acquire(&cand[i].b->word); /* partner: the mover's release */
    if (!dmem__word_live(w, cand[i].h) || dmem__w_state(w) != t->state ||
        (w & DMEM__F_TRANSIT))
      continue;
    size_t size = dmem__bsize(cand[i].b);
    if (!claim(rt, t, limit, size)) break;
    dmem_status_t st = dmem__spill_buffer(rt, cand[i].b, cand[i].h, r->next->tier, false);
    dmem_atomic_sub_relaxed(&rt->tier_pushing[t->tier], size);
    if (st == DMEM_OK) {
      moved = true;
      continue;
    }
    /* locked, moved or freed meanwhile, or its write cancelled by a lock:
     * the next one */
    if (st == DMEM_ERR_BUSY || st == DMEM_ERR_STALE_HANDLE || st == DMEM_ERR_INVALID_ARGUMENT)
      continue;
    break; /* the next tier failed (the disk): the buffer stays; the next kick tries again */
  }
  return moved;
}

bool dmem__pushdown_run(dmem_runtime_t *rt) {
  size_t nrows;
  const dmem__tier_row_t *rows = dmem__tier_rows(&nrows);
  bool any = false;
  for (size_t k = 0; k < nrows && !any; k++) {
    const dmem__tier_ops_t *t = rows[k].ops;
    any = rows[k].next && t->limit && t->limit(rt) && over_limit(rt, t, t->limit(rt));
  }
  if (!any) return false;
  dmem__victim_t *cand;
  size_t n;
  /* same order as the device's victims */
  if (dmem__victims_sorted(rt, in_pushed_tier, &cand, &n) != DMEM_OK)
    return false; /* the next kick tries again */
  bool again = false;
  for (size_t k = 0; k < nrows; k++) {
    const dmem__tier_row_t *r = &rows[k];
    size_t limit = r->next && r->ops->limit ? r->ops->limit(rt) : 0;
    if (!limit) continue;
    bool moved = push_tier(rt, r, limit, cand, n);
    again |= moved && over_limit(rt, r->ops, limit) && !dmem__io_stopping(rt->io);
  }
  free(cand);
  return again;
}
