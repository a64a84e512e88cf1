/*
 * spill/tier_controller.c - the controller tier: the installed controller's
 * store/retrieve callbacks keep the bytes (a Dask worker, say). Called with
 * no mutex held.
 */
#include "spill/spill.h"

static dmem_status_t ctl_ready(dmem_runtime_t *rt) {
  dmem_controller_t c;
  if (!dmem__controller_get(rt, &c) || !c.store || !c.retrieve)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "spill to the controller tier needs a controller with store/retrieve");
  return DMEM_OK;
}

static dmem_status_t ctl_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                               void *data) {
  dmem_controller_t c;
  /* counted as in flight: the controller cannot be removed or replaced
   * until the bytes it keeps are counted in controller_used */
  if (!dmem__controller_store_begin(rt, &c))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "no controller with store/retrieve installed");
  dmem_status_t st = c.store(c.user, h, data, dmem__bsize(b));
  dmem__controller_store_end(rt, st == DMEM_OK ? dmem__bsize(b) : 0);
  if (st != DMEM_OK)
    return dmem__error(DMEM_ERR_CALLBACK, "controller store(0x%016llx) returned %s",
                       (unsigned long long)h, dmem_status_name(st));
  return DMEM_OK;
}

static dmem_status_t ctl_load(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  size_t size = dmem__bsize(b);
  dmem_controller_t c;
  if (!dmem__controller_get(rt, &c) || !c.retrieve)
    return dmem__error(DMEM_ERR_CALLBACK, "no controller to retrieve 0x%016llx from",
                       (unsigned long long)h);
  void *stage = NULL;
  dmem_status_t st = dmem__hostpool_alloc(rt->hostpool, size, &stage);
  if (st != DMEM_OK) return st;
  st = c.retrieve(c.user, h, stage, size);
  if (st != DMEM_OK) {
    dmem__hostpool_free(rt->hostpool, stage);
    return dmem__error(DMEM_ERR_CALLBACK, "controller retrieve(0x%016llx) returned %s",
                       (unsigned long long)h, dmem_status_name(st));
  }
  DMEM_ASSERT(b->host == NULL);
  b->host = stage;
  return DMEM_OK;
}

/* The controller may keep a copy it will never be asked for (a cancelled
 * spill, a freed buffer): a later store for the same handle replaces it, the
 * FREE event lets it drop it. */
static void ctl_drop(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  dmem_atomic_sub_relaxed(&rt->controller_used, dmem__bsize(b));
}

static size_t ctl_used(dmem_runtime_t *rt) {
  return dmem_atomic_load_relaxed(&rt->controller_used);
}

const dmem__tier_ops_t dmem__tier_controller = {
    .tier = DMEM_TIER_CONTROLLER,
    .state = DMEM_STATE_DEFERRED_CONTROLLER,
    .name = "controller",
    .adopts_staging = false,
    .watch_free = true,
    .ready = ctl_ready,
    .store = ctl_store,
    .load = ctl_load,
    .read = NULL, /* retrieve may drop the controller's copy */
    .drop = ctl_drop,
    .used = ctl_used,
};
