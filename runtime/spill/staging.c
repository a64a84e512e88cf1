/*
 * spill/staging.c - finishing copies in flight. A retrieve copies from
 * pinned memory (b->host) to the device on the locker's stream and returns
 * at once: the staging may only be reused after that copy (UNSPILL_COPY). A
 * spill into the host tier returns once its copy is enqueued: its event goes
 * back to the pool only after the copy (SPILL_COPY on a DEFERRED_HOST
 * buffer). Such buffers are kept here, and polled (when memory runs short,
 * by dmem_runtime_poll and dmem_stats) until their event completes.
 */
#include "spill/spill.h"
#include <string.h>

void dmem__staging_push(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  dmem__reg_entry_t e = {.b = b, .h = h};
  dmem__staging_push_n(rt, &e, 1);
}

void dmem__staging_push_n(dmem_runtime_t *rt, const dmem__reg_entry_t *v, size_t n) {
  if (n == 0) return;
  dmem__mutex_lock(&rt->staging_mu, DMEM__RANK_STAGING);
  if (rt->nstaging + n > rt->capstaging) {
    size_t cap = rt->capstaging ? rt->capstaging * 2 : 64;
    while (cap < rt->nstaging + n) cap *= 2;
    dmem__reg_entry_t *nv = realloc(rt->staging, cap * sizeof *nv);
    if (!nv) {
      /* Not tracked: the staging is recycled at the next spill or at
       * reclaim instead. */
      dmem__mutex_unlock(&rt->staging_mu, DMEM__RANK_STAGING);
      return;
    }
    rt->staging = nv;
    rt->capstaging = cap;
  }
  memcpy(rt->staging + rt->nstaging, v, n * sizeof *v);
  rt->nstaging += n;
  dmem__mutex_unlock(&rt->staging_mu, DMEM__RANK_STAGING);
}

dmem_status_t dmem__staging_alloc(dmem_runtime_t *rt, size_t size, void **stage_out) {
  dmem_status_t st = dmem__hostpool_alloc(rt->hostpool, size, stage_out);
  if (st != DMEM_ERR_HOST_OUT_OF_MEMORY) return st;
  /* Unspilled buffers keep their staging until a poll sees the copy done:
   * under a bounded pool that is what runs it dry. Entries whose TRANSIT
   * another mover (this caller included) holds are skipped, so this waits
   * only for copies already enqueued. */
  dmem__staging_poll(rt, true);
  /* Still none, and the pool holds its limit (host_limit): the host tier at
   * its cap and the other moves' staging in flight. Rather than fail the
   * move (and the lock waiting for it), stage it in pageable memory: the
   * copy is slower and synchronous, and the block is freed with the others
   * (host_pageable_used counts it). */
  return dmem__hostpool_alloc_staging(rt->hostpool, size, stage_out);
}

void dmem__staging_poll(dmem_runtime_t *rt, bool wait_all) {
  dmem__mutex_lock(&rt->staging_mu, DMEM__RANK_STAGING);
  size_t keep = 0;
  for (size_t i = 0; i < rt->nstaging; i++) {
    dmem__buffer_t *b = rt->staging[i].b;
    dmem_handle_t h = rt->staging[i].h;
    /* acquire: partner is the unspiller's releasing CAS */
    uint64_t w = dmem_atomic_load_acquire(&b->word);
    /* done elsewhere, or freed (then reclaim recycles the staging; TRANSIT
     * is never taken on a freed buffer) */
    unsigned s = dmem__w_state(w);
    /* resident: the unspill copy; held by a tier that adopted the staging
     * (the host tier): the spill copy into it */
    const dmem__tier_ops_t *held = s == DMEM_STATE_RESIDENT ? NULL : dmem__tier_of_state(s);
    uint64_t flag = s == DMEM_STATE_RESIDENT        ? DMEM__F_UNSPILL_COPY
                    : held && held->adopts_staging ? DMEM__F_SPILL_COPY
                                                    : 0;
    if (dmem__w_gen(w) != dmem__h_gen(h) || !(w & flag) || (w & DMEM__F_FREED)) continue;
    /* the take fails if FREED was set meanwhile: the entry is kept and
     * dropped by the next poll */
    if ((w & DMEM__F_TRANSIT) || !dmem__transit_take(b, &w, s, 0)) {
      rt->staging[keep++] = rt->staging[i];
      continue;
    }
    void *ev = flag == DMEM__F_UNSPILL_COPY ? b->unspill_event
                                            : dmem_atomic_load_relaxed(&b->spill_event);
    dmem_status_t q = wait_all ? rt->be->event_synchronize(rt->be, ev)
                               : rt->be->event_query(rt->be, ev);
    if (q == DMEM_OK || (q != DMEM_ERR_BUSY && wait_all)) {
      if (flag == DMEM__F_UNSPILL_COPY) {
        dmem__host_copy_release(rt, b); /* the staging */
      } else {
        dmem_atomic_store_relaxed(&b->spill_event, NULL);
        dmem__event_put(rt, ev);
      }
      dmem__move_end(rt, b, (dmem__transit_exit_t){.clear = flag});
    } else {
      (void)dmem__fatal_keep(rt, q == DMEM_ERR_BUSY ? DMEM_OK : q);
      dmem__move_end(rt, b, (dmem__transit_exit_t){0});
      rt->staging[keep++] = rt->staging[i];
    }
  }
  rt->nstaging = keep;
  dmem__mutex_unlock(&rt->staging_mu, DMEM__RANK_STAGING);
  dmem__disk_stage_trim(rt, wait_all);
}

void dmem__staging_fini(dmem_runtime_t *rt) {
  dmem__staging_poll(rt, true);
  free(rt->staging);
  rt->staging = NULL;
  rt->nstaging = rt->capstaging = 0;
}
