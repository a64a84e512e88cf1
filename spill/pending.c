/*
 * spill/pending.c - stream releases waiting for their event
 * (dmem_stream_release): the buffers they hold unlock once the stream's work
 * has finished. Nothing waits for that in the background; the list is polled
 * (one relaxed load when it is empty) by every call that could otherwise see
 * a finished release's buffers still locked: dmem_stream_synchronize,
 * dmem_sync_and_unlock, dmem_spill, dmem_evict, dmem_buffer_info,
 * dmem_stats, dmem_free, the search for spill victims (spill/pressure.c),
 * dmem_runtime_poll, and at destroy.
 */
#include "runtime/internal.h"

dmem_status_t dmem__pending_add(dmem_runtime_t *rt, void *event, dmem__reg_entry_t *v,
                                size_t n) {
  dmem__pending_t *p = malloc(sizeof *p);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "stream release node allocation failed");
  p->event = event;
  p->v = v;
  p->n = n;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  p->next = rt->pending;
  rt->pending = p;
  dmem_atomic_add_relaxed(&rt->npending, 1);
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  return DMEM_OK;
}

size_t dmem__pending_poll(dmem_runtime_t *rt, bool wait_all) {
  if (!wait_all && dmem_atomic_load_relaxed(&rt->npending) == 0) return 0;
  dmem__pending_t *done = NULL;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  for (dmem__pending_t **pp = &rt->pending; *pp;) {
    dmem__pending_t *p = *pp;
    dmem_status_t q = wait_all ? rt->be->event_synchronize(rt->be, p->event)
                               : rt->be->event_query(rt->be, p->event);
    if (q == DMEM_ERR_BUSY) {
      pp = &p->next;
      continue;
    }
    /* complete, or failed (the context is gone: the work will never run) */
    (void)dmem__fatal_keep(rt, q);
    *pp = p->next;
    p->next = done;
    done = p;
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  size_t count = 0;
  while (done) {
    dmem__pending_t *p = done;
    done = p->next;
    for (size_t i = 0; i < p->n; i++) (void)dmem__unlock_buffer(rt, p->v[i].b, p->v[i].h);
    dmem__event_put(rt, p->event);
    free(p->v);
    free(p);
    count++;
    /* only now: an allocation that reads npending 0 and fails must have
     * seen these buffers unlocked (partner: make_room's acquire loads) */
    dmem_atomic_add_relaxed(&rt->moves_done, 1);
    dmem_atomic_sub_acq_rel(&rt->npending, 1);
  }
  return count;
}
