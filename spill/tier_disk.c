/*
 * spill/tier_disk.c - the disk tier: one file per buffer (spill/disk.c),
 * keyed by the handle, in a private directory made on first use.
 */
#include "runtime/internal.h"

dmem_status_t dmem__disk_get(dmem_runtime_t *rt, dmem__disk_t **disk_out) {
  /* acquire: partner is the release store below */
  dmem__disk_t *d = dmem_atomic_load_acquire(&rt->disk);
  if (d) {
    *disk_out = d;
    return DMEM_OK;
  }
  dmem__mutex_lock(&rt->disk_mu, DMEM__RANK_DISK);
  d = dmem_atomic_load_relaxed(&rt->disk);
  dmem_status_t st = DMEM_OK;
  if (!d) {
    st = dmem__disk_create(rt->spill_dir_copy, &d);
    if (st == DMEM_OK) dmem_atomic_store_release(&rt->disk, d);
  }
  dmem__mutex_unlock(&rt->disk_mu, DMEM__RANK_DISK);
  if (st == DMEM_OK) *disk_out = d;
  return st;
}

static dmem_status_t disk_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                void *data) {
  dmem__disk_t *disk;
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st == DMEM_OK) st = dmem__disk_write(disk, h, data, dmem__bsize(b));
  if (st == DMEM_OK) dmem_atomic_add_relaxed(&rt->disk_used, dmem__bsize(b));
  return st;
}

static dmem_status_t disk_load(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  size_t size = dmem__bsize(b);
  dmem__disk_t *disk;
  void *stage = NULL;
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st == DMEM_OK) st = dmem__hostpool_alloc(rt->hostpool, size, &stage);
  if (st == DMEM_OK) st = dmem__disk_read(disk, h, stage, size);
  if (st != DMEM_OK) {
    dmem__hostpool_free(rt->hostpool, stage);
    return st;
  }
  DMEM_ASSERT(b->host == NULL);
  b->host = stage;
  return DMEM_OK;
}

static void disk_drop(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  /* acquire: partner is dmem__disk_get's release (the tier held this buffer,
   * so the store exists) */
  dmem__disk_remove(dmem_atomic_load_acquire(&rt->disk), h);
  dmem_atomic_sub_relaxed(&rt->disk_used, dmem__bsize(b));
}

static size_t disk_used(dmem_runtime_t *rt) { return dmem_atomic_load_relaxed(&rt->disk_used); }

const dmem__tier_ops_t dmem__tier_disk = {
    .tier = DMEM_TIER_DISK,
    .state = DMEM_STATE_DEFERRED_DISK,
    .name = "disk",
    .adopts_staging = false,
    .store = disk_store,
    .load = disk_load,
    .drop = disk_drop,
    .used = disk_used,
};
