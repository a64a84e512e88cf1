/*
 * runtime/core/controller.c - the external controller: installation, and calling
 * its callbacks with no internal mutex held. A runtime without a controller,
 * or whose controller has no on_event callback, takes no mutex to emit.
 */
#include "core/runtime.h"
#include <string.h>


dmem_status_t dmem_controller_set(dmem_runtime_t *rt, const dmem_controller_t *c) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_controller_set: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  if (c && c->struct_size < sizeof *c)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_controller_set: struct_size %zu < %zu", c->struct_size, sizeof *c);
  if (c && (!c->store) != (!c->retrieve))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_controller_set: store and retrieve go together");
  dmem__mutex_lock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  /* The bytes the controller holds, and those its stores in flight are
   * about to hold (they are added to controller_used under ctl_mu before
   * the store's count ends: dmem__controller_store_end), can only be
   * retrieved through the same store/retrieve/user: removing or replacing
   * it would strand them. */
  size_t held = dmem_atomic_load_relaxed(&rt->controller_used);
  bool same = c && c->store == rt->ctl.store && c->retrieve == rt->ctl.retrieve &&
              c->user == rt->ctl.user;
  if ((held > 0 || rt->ctl_stores > 0) && !same) {
    size_t stores = rt->ctl_stores;
    dmem__mutex_unlock(&rt->ctl_mu, DMEM__RANK_CONTROL);
    if (stores > 0)
      return dmem__error(DMEM_ERR_BUSY,
                         "%zu store(s) of the controller in flight: it cannot be removed or "
                         "replaced until they return",
                         stores);
    return dmem__error(DMEM_ERR_BUSY,
                       "buffers are held by the controller (%zu bytes): unspill them before "
                       "removing or replacing it",
                       held);
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

bool dmem__controller_store_begin(dmem_runtime_t *rt, dmem_controller_t *c_out) {
  if (!dmem_atomic_load_relaxed(&rt->has_ctl)) return false;
  dmem__mutex_lock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  bool has = dmem_atomic_load_relaxed(&rt->has_ctl) != 0 && rt->ctl.store != NULL;
  if (has) {
    *c_out = rt->ctl;
    rt->ctl_stores++;
  }
  dmem__mutex_unlock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  return has;
}

void dmem__controller_store_end(dmem_runtime_t *rt, size_t kept) {
  dmem__mutex_lock(&rt->ctl_mu, DMEM__RANK_CONTROL);
  DMEM_ASSERT(rt->ctl_stores > 0);
  dmem_atomic_add_relaxed(&rt->controller_used, kept);
  rt->ctl_stores--;
  dmem__mutex_unlock(&rt->ctl_mu, DMEM__RANK_CONTROL);
}

bool dmem__store_watch(dmem__buffer_t *b, dmem_handle_t h) {
  DMEM_ASSERT(dmem_atomic_load_relaxed(&b->store_watch) == 0);
  dmem_atomic_store_relaxed(&b->store_watch, DMEM__WATCH_STORING);
  DMEM_SCHED_POINT(); /* a free may come between: the fences decide */
  /* partner: the fence in dmem__store_hand_over. Either dmem_buffer_free's
   * hand-over sees STORING, or this load sees its FREED (store buffering:
   * not both miss). */
  dmem_atomic_fence_seq_cst();
  uint64_t w = dmem_atomic_load_relaxed(&b->word);
  return dmem__w_gen(w) == dmem__h_gen(h) && !(w & DMEM__F_FREED);
}

bool dmem__store_unwatch(dmem__buffer_t *b) {
  return dmem_atomic_exchange_relaxed(&b->store_watch, 0u) == DMEM__WATCH_FREED;
}

bool dmem__store_hand_over(dmem__buffer_t *b) {
  DMEM_SCHED_POINT(); /* the store may start or end between */
  /* partner: the fence in dmem__store_watch (see there) */
  dmem_atomic_fence_seq_cst();
  uint8_t want = DMEM__WATCH_STORING;
  return dmem_atomic_cas_strong_relaxed(&b->store_watch, &want, DMEM__WATCH_FREED);
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
