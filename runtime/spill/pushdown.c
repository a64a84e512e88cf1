/*
 * spill/pushdown.c - keeping the host tier under host_limit: the I/O
 * threads' background job (spill/io.c). A store that takes the host tier
 * past its limit kicks it (spill/tier_host.c); it then moves the host-tier
 * buffers that were used least recently (lowest priority first, as the
 * device's victim policy) to disk, until the tier is back under the limit.
 *
 * Each move is an ordinary tier change (dmem__spill_buffer to
 * DMEM_TIER_DISK): it owns only the moving buffer's TRANSIT and holds no
 * mutex while it writes, so locks and moves of other buffers never wait
 * for it; a locker of the buffer itself stops the write at its next chunk
 * (b->io_cancel) and takes the host copy. A write that fails leaves the
 * buffer in the host tier and ends the run; the next kick tries again.
 */
#include "spill/spill.h"
#include <stdlib.h>

/* In the host tier and nobody moving or freeing it. */
static bool in_host_tier(uint64_t w, const dmem__buffer_t *b) {
  (void)b;
  return dmem__w_state(w) == DMEM_STATE_DEFERRED_HOST && !(w & (DMEM__F_TRANSIT | DMEM__F_FREED));
}

/* The host tier holds more than its limit, not counting the bytes being
 * written down now. */
static bool over_limit(dmem_runtime_t *rt) {
  return dmem_atomic_load_relaxed(&rt->host_used) >
         rt->host_limit + dmem_atomic_load_relaxed(&rt->host_pushing);
}

/* Count size bytes as being written down, if the tier is still over its
 * limit without them: one CAS, so that threads pushing at once do not all
 * act on the same excess. */
static bool claim(dmem_runtime_t *rt, size_t size) {
  size_t pushing = dmem_atomic_load_relaxed(&rt->host_pushing);
  for (;;) {
    if (dmem_atomic_load_relaxed(&rt->host_used) <= rt->host_limit + pushing) return false;
    if (dmem_atomic_cas_relaxed(&rt->host_pushing, &pushing, pushing + size)) return true;
  }
}

bool dmem__pushdown_run(dmem_runtime_t *rt) {
  if (!rt->host_limit || !over_limit(rt)) return false;
  dmem__victim_t *cand;
  size_t n;
  /* same order as the device's victims */
  if (dmem__victims_sorted(rt, in_host_tier, &cand, &n) != DMEM_OK)
    return false; /* the next kick tries again */
  bool moved = false;
  for (size_t i = 0; i < n && over_limit(rt) && !dmem__io_stopping(rt->io); i++) {
    /* still in the host tier and nobody moving it? (the spill re-checks) */
    uint64_t w = dmem_atomic_load_acquire(&cand[i].b->word); /* partner: the mover's release */
    if (!dmem__word_live(w, cand[i].h) || dmem__w_state(w) != DMEM_STATE_DEFERRED_HOST ||
        (w & DMEM__F_TRANSIT))
      continue;
    size_t size = dmem__bsize(cand[i].b);
    if (!claim(rt, size)) break;
    dmem_status_t st = dmem__spill_buffer(rt, cand[i].b, cand[i].h, DMEM_TIER_DISK, false);
    dmem_atomic_sub_relaxed(&rt->host_pushing, size);
    if (st == DMEM_OK) {
      moved = true;
      continue;
    }
    /* locked, moved or freed meanwhile, or its write cancelled by a lock:
     * the next one */
    if (st == DMEM_ERR_BUSY || st == DMEM_ERR_STALE_HANDLE || st == DMEM_ERR_INVALID_ARGUMENT)
      continue;
    break; /* the disk failed: the buffer stays; the next kick tries again */
  }
  free(cand);
  return moved && over_limit(rt) && !dmem__io_stopping(rt->io);
}
