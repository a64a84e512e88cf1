/*
 * spill/tier_disk.c - the disk tier: each buffer in an extent of the
 * runtime's one unnamed spill file (spill/disk.c), made on first use.
 *
 * A write (store) is cancelled between chunks when its buffer no longer
 * needs it: a lock cancelled the spill (the buffer is RESIDENT again), a
 * locker waits for this push-down (b->io_cancel), the buffer was freed, or
 * the runtime is being destroyed. A failed write is DMEM_ERR_IO and leaves
 * the buffer where it was (the caller keeps its copy). A load reads the
 * extent into pinned staging, which the retrieve copies to the device and
 * then recycles: the bytes never become a host-tier copy.
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
    st = dmem__disk_create(rt->spill_dir_copy, rt->io, &d);
    if (st == DMEM_OK) dmem_atomic_store_release(&rt->disk, d);
  }
  dmem__mutex_unlock(&rt->disk_mu, DMEM__RANK_DISK);
  if (st == DMEM_OK) *disk_out = d;
  return st;
}

typedef struct store_ctx {
  dmem_runtime_t *rt;
  dmem__buffer_t *b;
  /* set when a lock is why the write stopped: by any of the threads taking
   * chunks (relaxed; read by the writer after they have finished) */
  _Atomic int by_lock;
} store_ctx_t;

static bool store_cancelled(void *arg) {
  store_ctx_t *c = arg;
  uint64_t w = dmem_atomic_load_relaxed(&c->b->word); /* a hint; the mover re-checks */
  unsigned s = dmem__w_state(w);
  if (dmem_atomic_load_relaxed(&c->b->io_cancel) ||
      (s != DMEM_STATE_SPILLING && s != DMEM_STATE_DEFERRED_HOST)) {
    dmem_atomic_store_relaxed(&c->by_lock, 1);
    return true;
  }
  return (w & DMEM__F_FREED) || dmem__io_stopping(c->rt->io);
}

static dmem_status_t disk_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                void *data) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  /* a request left from an earlier move is not for this one */
  dmem_atomic_store_relaxed(&b->io_cancel, 0);
  dmem__disk_t *disk;
  uint64_t off = 0;
  store_ctx_t ctx = {rt, b, 0};
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st == DMEM_OK) st = dmem__disk_alloc(disk, size, &off);
  if (st == DMEM_OK) {
    st = dmem__disk_write(disk, off, data, size, store_cancelled, &ctx);
    if (st != DMEM_OK) dmem__disk_free(disk, off, size);
  }
  if (st != DMEM_OK) {
    if (st == DMEM_ERR_IO) {
      dmem_atomic_add_relaxed(&rt->disk_write_failures, 1);
      /* a push-down has no caller to hand the status to */
      if (dmem__io_tl_background)
        DMEM_LOG_AT(DMEM_LOG_WARN, "push-down of 0x%016llx failed, it stays in the host tier: %s",
                    (unsigned long long)h, dmem_last_error_detail());
    } else if (st == DMEM_ERR_BUSY && dmem_atomic_load_relaxed(&ctx.by_lock)) {
      dmem_atomic_add_relaxed(&rt->cancelled_spills, 1);
    }
    return st;
  }
  b->disk_off = off;
  dmem_atomic_add_relaxed(&rt->disk_used, size);
  dmem_atomic_add_relaxed(&rt->disk_writes, 1);
  dmem_atomic_add_relaxed(&rt->disk_bytes_written, size);
  dmem_atomic_add_relaxed(&rt->ns_disk_writing, dmem__now_ns() - t0);
  if (dmem__io_tl_background) dmem_atomic_add_relaxed(&rt->disk_pushdowns, 1);
  return DMEM_OK;
}

static dmem_status_t disk_load(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  dmem__disk_t *disk;
  void *stage = NULL;
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st == DMEM_OK) st = dmem__hostpool_alloc(rt->hostpool, size, &stage);
  if (st == DMEM_OK) st = dmem__disk_read(disk, b->disk_off, stage, size);
  if (st != DMEM_OK) {
    dmem__hostpool_free(rt->hostpool, stage);
    return st;
  }
  DMEM_ASSERT(b->host == NULL);
  b->host = stage;
  dmem_atomic_add_relaxed(&rt->disk_reads, 1);
  dmem_atomic_add_relaxed(&rt->disk_bytes_read, size);
  dmem_atomic_add_relaxed(&rt->ns_disk_reading, dmem__now_ns() - t0);
  return DMEM_OK;
}

/* Straight from the extent into dst (no staging): a failed read is
 * DMEM_ERR_IO and leaves the extent as it was. Not counted as a disk read
 * (those are retrieves). */
static dmem_status_t disk_read_range(dmem_runtime_t *rt, dmem__buffer_t *b, size_t off,
                                     void *dst, size_t n) {
  dmem__disk_t *disk;
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st != DMEM_OK) return st;
  return dmem__disk_read(disk, b->disk_off + off, dst, n);
}

static void disk_drop(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  /* acquire: partner is dmem__disk_get's release (the tier held this buffer,
   * so the file exists) */
  dmem__disk_free(dmem_atomic_load_acquire(&rt->disk), b->disk_off, dmem__bsize(b));
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
    .read = disk_read_range,
    .drop = disk_drop,
    .used = disk_used,
};
