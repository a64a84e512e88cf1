/*
 * spill/tier_host.c - the host tier: the spilled bytes stay in the pinned
 * staging memory the spill copy wrote (b->host), charged to host_used.
 * Retrieve copies straight from it.
 *
 * host_limit (0: none) is the tier's target, not a wall: a spill that takes
 * the tier past it is admitted and kicks the push-down (spill/pushdown.c),
 * which moves the least recently used host-tier buffers to disk on the I/O
 * threads, so that neither the spiller nor anyone else waits for a disk
 * write. While the push-down catches up the tier may hold up to host_burst
 * (dmem_config_t; half, by default) of the limit more; past that (the disk is slower than the spills, or failing),
 * and for a buffer larger than the limit, the store refuses
 * (DMEM_ERR_HOST_OUT_OF_MEMORY) and the spill goes straight to disk, as a
 * brake that keeps pinned memory bounded.
 */
#include "spill/spill.h"
#include <string.h>

size_t dmem__host_tier_cap(size_t limit, double burst) {
  double extra = (double)limit * burst; /* burst in [0, 1] (checked at create) */
  return extra >= (double)(SIZE_MAX - limit) ? SIZE_MAX : limit + (size_t)extra;
}

static dmem_status_t host_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                void *data) {
  size_t size = dmem__bsize(b), limit = rt->host_limit;
  if (!limit) {
    dmem__peak_raise(&rt->host_peak, dmem_atomic_add_relaxed(&rt->host_used, size) + size);
    b->host = data;
    return DMEM_OK;
  }
  if (size > limit)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "0x%016llx (%zu bytes) is larger than the host limit of %zu",
                       (unsigned long long)h, size, limit);
  bool admitted =
      dmem__reserve(&rt->host_used, dmem__host_tier_cap(limit, rt->cfg.host_burst), size, NULL);
  if (admitted) dmem__peak_raise(&rt->host_peak, dmem_atomic_load_relaxed(&rt->host_used));
  if (dmem_atomic_load_relaxed(&rt->host_used) > limit) dmem__io_kick(rt->io);
  if (!admitted)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "host tier full: %zu bytes for 0x%016llx with %zu of %zu held and the "
                       "push-down to disk behind",
                       size, (unsigned long long)h, dmem_atomic_load_relaxed(&rt->host_used),
                       limit);
  b->host = data;
  return DMEM_OK;
}

/* Batch admission (dmem__spill_batch): `bytes` of several buffers charged
 * at once, as host_store does per buffer: past host_limit it kicks the
 * push-down; false when the tier cannot take them all (nothing charged). */
static bool host_charge_n(dmem_runtime_t *rt, size_t bytes) {
  size_t limit = rt->host_limit;
  if (!limit) {
    dmem__peak_raise(&rt->host_peak, dmem_atomic_add_relaxed(&rt->host_used, bytes) + bytes);
    return true;
  }
  if (bytes > limit) return false;
  bool admitted =
      dmem__reserve(&rt->host_used, dmem__host_tier_cap(limit, rt->cfg.host_burst), bytes, NULL);
  if (admitted) dmem__peak_raise(&rt->host_peak, dmem_atomic_load_relaxed(&rt->host_used));
  if (dmem_atomic_load_relaxed(&rt->host_used) > limit) dmem__io_kick(rt->io);
  return admitted;
}

static void host_uncharge_n(dmem_runtime_t *rt, size_t bytes) {
  dmem_atomic_sub_relaxed(&rt->host_used, bytes);
}

static dmem_status_t host_load(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)rt;
  (void)h;
  DMEM_ASSERT(b->host != NULL);
  return DMEM_OK; /* the copy is pinned memory already */
}

/* The copy is b->host; a spill copy into it may still run (SPILL_COPY):
 * wait for its event first. Both are stable while the caller owns TRANSIT
 * (the staging poller takes TRANSIT to clear them). */
static dmem_status_t host_read(dmem_runtime_t *rt, dmem__buffer_t *b, size_t off, void *dst,
                               size_t n) {
  DMEM_ASSERT(b->host != NULL);
  if (dmem_atomic_load_relaxed(&b->word) & DMEM__F_SPILL_COPY) {
    void *ev = dmem_atomic_load_relaxed(&b->spill_event);
    dmem_status_t st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    if (st != DMEM_OK) return st;
  }
  memcpy(dst, (const char *)b->host + off, n);
  return DMEM_OK;
}

static void host_drop(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  dmem_atomic_sub_relaxed(&rt->host_used, dmem__bsize(b));
}

static size_t host_used(dmem_runtime_t *rt) { return dmem_atomic_load_relaxed(&rt->host_used); }

static size_t host_limit(const dmem_runtime_t *rt) { return rt->host_limit; }

const dmem__tier_ops_t dmem__tier_host = {
    .tier = DMEM_TIER_HOST,
    .state = DMEM_STATE_DEFERRED_HOST,
    .name = "host",
    .adopts_staging = true,
    .store = host_store,
    .charge_n = host_charge_n,
    .uncharge_n = host_uncharge_n,
    .load = host_load,
    .read = host_read,
    .drop = host_drop,
    .used = host_used,
    .limit = host_limit,
};
