/*
 * runtime/core/event.c - the runtime's pool of backend events (spill copies,
 * unspill copies, stream releases). Events are created on demand and only
 * destroyed with the runtime: a locker that read b->spill_event may still
 * make its stream wait on it after the spiller gave it back.
 *
 * An event may have several owners (dmem__event_share: a spill batch's
 * copy event is each victim's b->spill_event): it goes back to the pool at
 * its last owner's put. The few shared events live at a time sit in a
 * small array under evpool_mu that every put looks through (empty, it
 * costs nothing).
 */
#include "core/runtime.h"

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

dmem_status_t dmem__event_share(dmem_runtime_t *rt, void *ev, size_t owners) {
  if (owners <= 1) return DMEM_OK;
  dmem__mutex_lock(&rt->evpool_mu, DMEM__RANK_EVENTS);
  if (rt->evshared_n == rt->evshared_cap) {
    size_t cap = rt->evshared_cap ? rt->evshared_cap * 2 : 16;
    dmem__event_share_t *v = realloc(rt->evshared, cap * sizeof *v);
    if (!v) {
      dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "event share table allocation failed");
    }
    rt->evshared = v;
    rt->evshared_cap = cap;
  }
  rt->evshared[rt->evshared_n].ev = ev;
  rt->evshared[rt->evshared_n].refs = owners - 1; /* puts that keep it out of the pool */
  rt->evshared_n++;
  dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
  return DMEM_OK;
}

void dmem__event_put(dmem_runtime_t *rt, void *ev) {
  dmem__mutex_lock(&rt->evpool_mu, DMEM__RANK_EVENTS);
  for (size_t i = 0; i < rt->evshared_n; i++) {
    if (rt->evshared[i].ev != ev) continue;
    if (--rt->evshared[i].refs == 0) rt->evshared[i] = rt->evshared[--rt->evshared_n];
    dmem__mutex_unlock(&rt->evpool_mu, DMEM__RANK_EVENTS);
    return; /* another owner still holds it */
  }
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
  /* shared events not given back by every owner (a leak elsewhere) were
   * never pooled: not destroyed here, as before */
  free(rt->evshared);
  rt->evshared = NULL;
  rt->evshared_n = rt->evshared_cap = 0;
  rt->evpool_n = rt->evpool_cap = 0;
}
