/*
 * spill/tier.c - the tiers behind one interface (spill/spill.h:
 * dmem__tier_ops_t): which tier holds a buffer in which state, and the
 * release of a buffer's pinned host memory. The tiers themselves are in
 * tier_host.c, tier_disk.c and tier_controller.c.
 */
#include "spill/spill.h"

const dmem__tier_ops_t *dmem__tier_of(dmem_tier_t tier) {
  switch (tier) {
    case DMEM_TIER_HOST: return &dmem__tier_host;
    case DMEM_TIER_DISK: return &dmem__tier_disk;
    case DMEM_TIER_CONTROLLER: return &dmem__tier_controller;
    default: return NULL;
  }
}

const dmem__tier_ops_t *dmem__tier_of_state(unsigned s) {
  switch (s) {
    case DMEM_STATE_DEFERRED_HOST: return &dmem__tier_host;
    case DMEM_STATE_DEFERRED_DISK: return &dmem__tier_disk;
    case DMEM_STATE_DEFERRED_CONTROLLER: return &dmem__tier_controller;
    default: return NULL;
  }
}

dmem_tier_t dmem__tier_public(unsigned s) {
  const dmem__tier_ops_t *t = dmem__tier_of_state(s);
  return t ? t->tier : DMEM_TIER_DEVICE;
}

void dmem__host_copy_release(dmem_runtime_t *rt, dmem__buffer_t *b) {
  if (!b->host) return;
  dmem__hostpool_free(rt->hostpool, b->host);
  b->host = NULL;
}
