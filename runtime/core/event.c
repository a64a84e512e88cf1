/*
 * runtime/core/event.c - the runtime's pool of backend events (spill copies,
 * unspill copies, stream releases). Events are created on demand and only
 * destroyed with the runtime: a locker that read b->spill_event may still
 * make its stream wait on it after the spiller gave it back.
 */
#include "internal.h"

dmem_status_t dmem__event_get(dmem_runtime_t *rt, void **ev_out) {
  dmem__mutex_lock(&rt->evpool_mu, DMEM__RANK_EVENTS);
  if (rt->evpool_n > 0) {
    *ev_out = rt->evpool[--rt->evpool_n];
    dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
    return DMEM_OK;
  }
  dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
  return dmem__fatal_keep(rt, rt->be->event_create(rt->be, ev_out));
}

void dmem__event_put(dmem_runtime_t *rt, void *ev) {
  dmem__mutex_lock(&rt->evpool_mu, DMEM__RANK_EVENTS);
  if (rt->evpool_n == rt->evpool_cap) {
    size_t cap = rt->evpool_cap ? rt->evpool_cap * 2 : 64;
    void **v = realloc(rt->evpool, cap * sizeof *v);
    if (!v) {
      /* keep it alive anyway: leak one event rather than risk a wait on a
       * destroyed one */
      dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
      return;
    }
    rt->evpool = v;
    rt->evpool_cap = cap;
  }
  rt->evpool[rt->evpool_n++] = ev;
  dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
}

void dmem__event_pool_fini(dmem_runtime_t *rt) {
  for (size_t i = 0; i < rt->evpool_n; i++) (void)rt->be->event_destroy(rt->be, rt->evpool[i]);
  free(rt->evpool);
  rt->evpool = NULL;
  rt->evpool_n = rt->evpool_cap = 0;
}
