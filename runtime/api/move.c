/*
 * runtime/api/move.c - the explicit moves: dmem_buffer_spill, dmem_buffer_unspill,
 * dmem_buffer_prefetch and dmem_runtime_evict. The engine behind them is the spill layer (spill/move_out.c,
 * spill/retrieve.c, spill/policy.c).
 */
#include "api/api.h"

dmem_status_t dmem_buffer_spill(dmem_runtime_t *rt, dmem_handle_t h, dmem_tier_t tier) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_spill: rt is NULL");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  if (dmem__moving_self(rt, h))
    return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is being moved by this thread",
                       (unsigned long long)h);
  dmem__pending_poll(rt, false); /* a finished stream release no longer holds it */
  return dmem__spill_buffer(rt, b, h, tier, false);
}

dmem_status_t dmem_buffer_unspill(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_unspill: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  if (!b) return dmem__stale(h);
  return dmem__retrieve(rt, b, h, stream, DMEM__RETRIEVE_ONLY, NULL);
}

dmem_status_t dmem_runtime_evict(dmem_runtime_t *rt, size_t bytes, size_t *freed_out) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_runtime_evict: rt is NULL");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  dmem__spill_poll(rt); /* finished stream releases: their buffers become victims */
  size_t freed = 0;
  if (bytes == 0) { /* nothing asked: no pass, no controller call */
    if (freed_out) *freed_out = 0;
    return DMEM_OK;
  }
  st = dmem__evict(rt, bytes, 0, DMEM__EVICT_EXPLICIT, &freed, NULL);
  if (st != DMEM_OK) return st;
  if (freed_out) *freed_out = freed;
  return DMEM_OK;
}

dmem_status_t dmem_buffer_prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                            dmem_stream_t stream) {
  if (!rt || (!hs && n > 0))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_prefetch: NULL argument");
  if (n > DMEM__HANDLES_MAX)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_prefetch: n %zu is too large", n);
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  return dmem__prefetch(rt, hs, n, stream, NULL);
}
