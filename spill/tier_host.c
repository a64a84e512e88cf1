/*
 * spill/tier_host.c - the host tier: the spilled bytes stay in the pinned
 * staging memory the spill copy wrote (b->host), charged to host_used up to
 * the host limit. Retrieve copies straight from it.
 */
#include "runtime/internal.h"

static dmem_status_t host_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                void *data) {
  size_t size = dmem__bsize(b);
  if (!dmem__reserve(&rt->host_used, rt->host_limit ? rt->host_limit : SIZE_MAX, size, NULL))
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "host tier full: %zu bytes for 0x%016llx over the host limit of %zu",
                       size, (unsigned long long)h, rt->host_limit);
  b->host = data;
  return DMEM_OK;
}

static dmem_status_t host_load(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)rt;
  (void)h;
  DMEM_ASSERT(b->host != NULL);
  return DMEM_OK; /* the copy is pinned memory already */
}

static void host_drop(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  dmem_atomic_sub_relaxed(&rt->host_used, dmem__bsize(b));
}

static size_t host_used(dmem_runtime_t *rt) { return dmem_atomic_load_relaxed(&rt->host_used); }

const dmem__tier_ops_t dmem__tier_host = {
    .tier = DMEM_TIER_HOST,
    .state = DMEM_STATE_DEFERRED_HOST,
    .name = "host",
    .adopts_staging = true,
    .store = host_store,
    .load = host_load,
    .drop = host_drop,
    .used = host_used,
};
