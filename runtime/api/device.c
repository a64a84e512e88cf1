/*
 * runtime/api/device.c - raw device memory for allocator hooks:
 * dmem_device_malloc / dmem_device_free (never spilled; charged against the
 * same limit as buffers, and spilling buffers when memory runs short),
 * dmem_device_adopt (a raw pool block becomes a spillable buffer in place),
 * dmem_device_memory_info, dmem_device_ipc_handle and dmem_device_trim; and
 * dmem_host_trim, its counterpart for the pinned host pool.
 */
#include "api/api.h"
#include <string.h>

static dmem_status_t device_malloc(dmem_runtime_t *rt, size_t size, dmem_stream_t stream,
                                   dmem__devsrc_t src, void **ptr_out, const char *fn) {
  if (!rt || !ptr_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%s: NULL argument", fn);
  if (size == 0) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%s: size 0", fn);
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  void *p = NULL;
  st = dmem__pressure_alloc(rt, size, stream, src, &p, NULL);
  if (st != DMEM_OK) return st;
  st = dmem__raw_insert(rt->raw, p, size, src);
  if (st != DMEM_OK) {
    dmem__device_release_to(rt, src, p, size, stream);
    return st;
  }
  *ptr_out = p;
  return DMEM_OK;
}

dmem_status_t dmem_device_malloc(dmem_runtime_t *rt, size_t size, dmem_stream_t stream,
                                 void **ptr_out) {
  return device_malloc(rt, size, stream, DMEM__SRC_POOL, ptr_out, "dmem_device_malloc");
}

dmem_status_t dmem_device_malloc_dedicated(dmem_runtime_t *rt, size_t size,
                                           dmem_stream_t stream, void **ptr_out) {
  return device_malloc(rt, size, stream, DMEM__SRC_DEDICATED, ptr_out,
                       "dmem_device_malloc_dedicated");
}

dmem_status_t dmem_device_free(dmem_runtime_t *rt, void *ptr, dmem_stream_t stream) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_device_free: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  if (!ptr) return DMEM_OK;
  size_t size;
  dmem__devsrc_t src;
  dmem_status_t st = dmem__raw_remove(rt->raw, ptr, &size, &src);
  if (st != DMEM_OK) return st;
  dmem__device_release_to(rt, src, ptr, size, stream);
  return DMEM_OK;
}

dmem_status_t dmem_device_adopt(dmem_runtime_t *rt, void *ptr, dmem_stream_t stream,
                                dmem_handle_t *h_out) {
  if (!rt || !h_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_device_adopt: NULL argument");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  if (!ptr) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_device_adopt: ptr is NULL");
  /* Everything that can fail comes before the block leaves the raw table,
   * so that a failure leaves it a raw allocation. The event is recorded
   * after the block's last use on `stream` (and after the wait the pool
   * enqueued there when it handed the block out): lockers on other
   * streams, spills and the reclaim are ordered after it (UNSPILL_COPY), as
   * dmem_buffer_alloc's are after the order stream. */
  void *ready = NULL;
  uint32_t slot = 0;
  dmem__buffer_t *b = NULL;
  size_t size = 0;
  st = dmem__event_get(rt, &ready);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ready, stream));
  if (st == DMEM_OK) st = dmem__table_take(rt->table, &slot, &b);
  if (st == DMEM_OK) st = dmem__raw_remove_pooled(rt->raw, ptr, &size);
  if (st != DMEM_OK) {
    if (b) dmem__table_give(rt->table, b); /* never published: nobody saw it */
    if (ready) dmem__event_put(rt, ready);
    return st;
  }
  /* The block's charge against the limit stays: it moves from the raw
   * bytes to the buffers', and the buffer gives it back (same size, so the
   * pool files the block as it was taken) when it is reclaimed or spilled.
   * Its bytes left raw_used with the entry. */
  *h_out = dmem__buffer_publish(rt, b, slot, size, 0, ptr, ready, 1);
  return DMEM_OK;
}

dmem_status_t dmem_stream_forget(dmem_runtime_t *rt, dmem_stream_t stream) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_forget: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  if (stream) dmem__device_stream_forget(rt, stream);
  return DMEM_OK;
}

/* Bytes of resident buffers that could be spilled now. */
static size_t spillable_bytes(dmem_runtime_t *rt) {
  size_t total = 0;
  uint32_t hw = dmem_atomic_load_acquire(&rt->table->high_water); /* partner: table_take */
  for (uint32_t slot = 0; slot < hw; slot++) {
    dmem__buffer_t *b = dmem__table_slot(rt->table, slot);
    if (!b) break;
    uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: dmem_buffer_alloc's release */
    if (dmem__w_state(w) == DMEM_STATE_RESIDENT && dmem__w_count(w) == 0 &&
        !(w & DMEM__F_FREED) && !(dmem__bflags(b) & DMEM_ALLOC_PINNED))
      total += dmem__bsize(b);
  }
  return total;
}

dmem_status_t dmem_device_memory_info(dmem_runtime_t *rt, size_t *free_out, size_t *total_out) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_device_memory_info: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__spill_poll(rt); /* finished stream releases make buffers spillable */
  size_t dev_free = 0;
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->mem_info(rt->be, &dev_free, NULL));
  if (st != DMEM_OK) return st;
  dmem__pool_stats_t ps;
  dmem__pool_stats(rt->pool, &ps);
  size_t used = dmem__device_used(rt);
  size_t under_limit = used < rt->limit ? rt->limit - used : 0;
  size_t device_can = (ps.reserved > ps.in_use ? ps.reserved - ps.in_use : 0) + dev_free;
  size_t free_now = under_limit < device_can ? under_limit : device_can;
  size_t spillable = spillable_bytes(rt);
  size_t free_total = free_now + spillable;
  if (free_total > rt->limit) free_total = rt->limit;
  if (free_out) *free_out = free_total;
  if (total_out) *total_out = rt->limit;
  return DMEM_OK;
}

dmem_status_t dmem_device_ipc_handle(dmem_runtime_t *rt, void *ptr, void *handle_out,
                              size_t *offset_out) {
  if (!rt || !ptr || !handle_out || !offset_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_device_ipc_handle: NULL argument");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  void *base = NULL;
  size_t off = 0, bsize = 0;
  dmem_status_t st;
  if (dmem__blocks_find(rt->blocks, ptr, &base, &bsize) == DMEM_OK) {
    off = (size_t)((char *)ptr - (char *)base);
  } else {
    st = dmem__pool_slab_of(rt->pool, ptr, &base, &off);
    if (st != DMEM_OK) return st;
  }
  if (rt->be->kind != DMEM_BACKEND_CUDA)
    return dmem__error(DMEM_ERR_NO_DEVICE, "dmem_device_ipc_handle: the %s backend has no CUDA IPC",
                       rt->be->name);
  unsigned char h[DMEM_IPC_HANDLE_SIZE];
  st = dmem__fatal_keep(rt, rt->be->ipc_handle(rt->be, base, h));
  if (st != DMEM_OK) return st;
  memcpy(handle_out, h, sizeof h);
  *offset_out = off;
  return DMEM_OK;
}

dmem_status_t dmem_device_trim(dmem_runtime_t *rt, size_t keep_bytes, size_t *released_out) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_device_trim: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  size_t released = 0;
  dmem_status_t st = dmem__device_trim(rt, keep_bytes, &released);
  if (st != DMEM_OK) return st;
  if (released_out) *released_out = released;
  return DMEM_OK;
}

dmem_status_t dmem_host_trim(dmem_runtime_t *rt, size_t keep_bytes, size_t *released_out) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_host_trim: rt is NULL");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  dmem__spill_poll(rt); /* finished unspills give their staging back first */
  size_t released = 0;
  dmem_status_t st = dmem__hostpool_trim(rt->hostpool, keep_bytes, &released);
  if (st != DMEM_OK) return st;
  if (released_out) *released_out = released;
  return DMEM_OK;
}
