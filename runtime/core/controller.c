/*
 * runtime/core/controller.c - the external controller: installation, and calling
 * its callbacks with no internal mutex held. A runtime without a controller,
 * or whose controller has no on_event callback, takes no mutex to emit.
 */
#include "internal.h"
#include <string.h>


dmem_status_t dmem_set_controller(dmem_runtime_t *rt, const dmem_controller_t *c) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_set_controller: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  if (c && c->struct_size < sizeof *c)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_set_controller: struct_size %zu < %zu", c->struct_size, sizeof *c);
  if (c && (!c->store) != (!c->retrieve))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_set_controller: store and retrieve go together");
  dmem__mutex_lock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  if ((!c || !c->retrieve) && dmem_atomic_load_relaxed(&rt->controller_used) > 0) {
    dmem__mutex_unlock(&rt->ctl_mu, DMEM__RANK_CONTROL);
    return dmem__error(DMEM_ERR_BUSY,
                       "buffers are held by the controller (%zu bytes): unspill them first",
                       dmem_atomic_load_relaxed(&rt->controller_used));
  }
  if (c) {
    memset(&rt->ctl, 0, sizeof rt->ctl);
    memcpy(&rt->ctl, c, sizeof *c);
    rt->ctl.struct_size = sizeof *c;
  } else {
    memset(&rt->ctl, 0, sizeof rt->ctl);
  }
  dmem_atomic_store_relaxed(&rt->has_ctl, c != NULL);
  dmem_atomic_store_relaxed(&rt->has_ctl_events, c != NULL && c->on_event != NULL);
  dmem__mutex_unlock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  return DMEM_OK;
}

bool dmem__controller_get(dmem_runtime_t *rt, dmem_controller_t *c_out) {
  if (!dmem_atomic_load_relaxed(&rt->has_ctl)) return false;
  dmem__mutex_lock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  *c_out = rt->ctl;
  bool has = dmem_atomic_load_relaxed(&rt->has_ctl) != 0;
  dmem__mutex_unlock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  return has;
}

void dmem__emit(dmem_runtime_t *rt, dmem_event_kind_t kind, dmem_handle_t h, size_t size,
                dmem_tier_t tier, size_t bytes_needed) {
  /* The hot path of alloc/free: one relaxed load when nothing listens. */
  if (!dmem_atomic_load_relaxed(&rt->has_ctl_events)) return;
  dmem_controller_t c;
  if (!dmem__controller_get(rt, &c) || !c.on_event) return;
  dmem_event_t ev;
  memset(&ev, 0, sizeof ev);
  ev.kind = kind;
  ev.handle = h;
  ev.size = size;
  ev.tier = tier;
  ev.bytes_needed = bytes_needed;
  c.on_event(c.user, &ev);
}
