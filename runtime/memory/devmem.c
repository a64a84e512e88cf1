/*
 * runtime/memory/devmem.c - device memory for buffers and raw allocations:
 * a charge against the runtime's device limit, then a block of the
 * stream-ordered pool (memory/pool.c), or a dedicated block
 * (memory/blocks.c) for raw allocations that must be a whole backend
 * allocation.
 *
 * The charge is sharded so that threads allocating at once do not all write
 * one counter: the global device_charged holds live bytes plus every
 * shard's unused budget (slack) and never passes the limit; a thread takes
 * budget from its shard, refills it a chunk at a time, and near the limit
 * drains every shard's slack back before it gives up. Live bytes
 * (dmem_stats' device_used) are device_charged minus the slack.
 * When the limit or the pool has no room it says how short it is; the spill
 * layer (spill/pressure.c) makes room and asks again. Nothing here spills,
 * frees a slab or waits on the host.
 */
#include "memory/memory.h"

/* ---- the charge against the limit ------------------------------------------- */

/* This thread's shard: assigned round robin at first use. */
static _Thread_local unsigned tl_shard_plus1;
static _Atomic unsigned shard_counter;

static inline dmem__charge_shard_t *my_shard(dmem_runtime_t *rt) {
  if (!tl_shard_plus1)
    tl_shard_plus1 = dmem_atomic_add_relaxed(&shard_counter, 1) % DMEM__CHARGE_SHARDS + 1;
  return &rt->charge[tl_shard_plus1 - 1];
}

void dmem__charge_init(dmem_runtime_t *rt) {
  size_t chunk = rt->limit / 256;
  if (chunk < ((size_t)64 << 10)) chunk = (size_t)64 << 10;
  if (chunk > ((size_t)8 << 20)) chunk = (size_t)8 << 20;
  rt->charge_chunk = chunk;
}

/* Give every shard's unused budget back to the global charge. */
static void drain(dmem_runtime_t *rt) {
  for (unsigned i = 0; i < DMEM__CHARGE_SHARDS; i++) {
    size_t x = dmem_atomic_exchange_acq_rel(&rt->charge[i].slack, 0);
    if (x) dmem_atomic_sub_relaxed(&rt->device_charged, x);
  }
}

/* Charge size bytes: from this thread's shard budget when it has enough
 * (no shared write), else a refill from the global charge (a chunk, or the
 * exact size for large requests), else, near the limit, after draining
 * every shard's budget. */
/* Raise the device peak after a charge: the charge less this shard's unused
 * budget (exact with one allocating thread; other threads' budget counts).
 * Two relaxed loads; the peak's line is written only when it rises. */
static void peak_note(dmem_runtime_t *rt, dmem__charge_shard_t *sh) {
  size_t charged = dmem_atomic_load_relaxed(&rt->device_charged);
  size_t slack = dmem_atomic_load_relaxed(&sh->slack);
  dmem__peak_raise(&rt->device_peak, charged > slack ? charged - slack : 0);
}

static bool charge(dmem_runtime_t *rt, size_t size, size_t *short_by) {
  dmem__charge_shard_t *sh = my_shard(rt);
  size_t s = dmem_atomic_load_relaxed(&sh->slack);
  while (s >= size)
    if (dmem_atomic_cas_relaxed(&sh->slack, &s, s - size)) {
      peak_note(rt, sh);
      return true;
    }
  size_t take = size < rt->charge_chunk ? rt->charge_chunk : size;
  if (dmem__reserve(&rt->device_charged, rt->limit, take, NULL)) {
    if (take > size) dmem_atomic_add_relaxed(&sh->slack, take - size);
    peak_note(rt, sh);
    return true;
  }
  drain(rt);
  if (!dmem__reserve(&rt->device_charged, rt->limit, size, short_by)) return false;
  peak_note(rt, sh);
  return true;
}

void dmem__charge_drain(dmem_runtime_t *rt) { drain(rt); }

/* Uncharge size bytes into this thread's shard. The shard keeps budget for
 * the block it just freed (the next allocation of that size charges no
 * shared counter) plus a chunk, and gives the excess back; near the limit a
 * failing charge drains every shard anyway. */
static void uncharge(dmem_runtime_t *rt, size_t size) {
  dmem__charge_shard_t *sh = my_shard(rt);
  size_t cur = dmem_atomic_add_relaxed(&sh->slack, size) + size;
  const size_t keep = (size > rt->charge_chunk ? size : rt->charge_chunk);
  if (cur <= keep + rt->charge_chunk) return;
  cur = dmem_atomic_load_relaxed(&sh->slack);
  while (cur > keep) {
    if (dmem_atomic_cas_relaxed(&sh->slack, &cur, keep)) {
      dmem_atomic_sub_relaxed(&rt->device_charged, cur - keep);
      return;
    }
  }
}

bool dmem__device_charge(dmem_runtime_t *rt, size_t size, size_t *short_by_out) {
  return charge(rt, size, short_by_out);
}

void dmem__device_uncharge(dmem_runtime_t *rt, size_t size) { uncharge(rt, size); }

size_t dmem__device_used(dmem_runtime_t *rt) {
  size_t slack = 0;
  for (unsigned i = 0; i < DMEM__CHARGE_SHARDS; i++)
    slack += dmem_atomic_load_relaxed(&rt->charge[i].slack);
  size_t charged = dmem_atomic_load_relaxed(&rt->device_charged);
  return charged > slack ? charged - slack : 0; /* a racing snapshot may cross */
}

/* ---- device memory sources ------------------------------------------------------ */

/* Where device blocks come from: one row per source, each a thin adapter
 * over its allocator's file. A new source is its file plus a row here (and
 * a DMEM__SRC_ name in memory.h). The charge against the limit is the same
 * for every source (device_alloc below). Buffers always come from the pool:
 * their calls (dmem__device_alloc, dmem__device_release*) name the pool
 * directly, so the buffer path pays no indirect call; raw allocations and
 * the spill layer's make-room loop go through the table. */
typedef struct devsrc {
  const char *name; /* in messages */
  /* A block of size bytes in stream order on `stream`; *ordered_out (may be
   * NULL) as for dmem__device_alloc, written only on DMEM_OK, and only by a
   * source that can tell. DMEM_ERR_OUT_OF_MEMORY when the source has no
   * room; backend errors. */
  dmem_status_t (*alloc)(dmem_runtime_t *rt, size_t size, void *stream, void **ptr_out,
                         bool *ordered_out);
  /* The same past the source's own cut (dmem__device_alloc_past_slabs);
   * NULL: the source has none. */
  dmem_status_t (*alloc_past)(dmem_runtime_t *rt, size_t size, void *stream, void **ptr_out,
                              bool *ordered_out);
  /* Give back a block whose last use was enqueued on `stream`. */
  dmem_status_t (*release)(dmem_runtime_t *rt, void *ptr, size_t size, void *stream);
  /* Whether a request could be served now without a contiguous range being
   * freed first; NULL: always (freed bytes are enough). */
  int (*fits)(dmem_runtime_t *rt, size_t size, void *stream);
  /* Give cached memory back until at most keep bytes stay held. */
  dmem_status_t (*trim)(dmem_runtime_t *rt, size_t keep, size_t *released_out);
  /* `stream` is about to be destroyed. */
  void (*stream_forget)(dmem_runtime_t *rt, void *stream);
} devsrc_t;

static dmem_status_t pool_src_alloc(dmem_runtime_t *rt, size_t size, void *stream, void **ptr_out,
                                    bool *ordered_out) {
  return dmem__pool_alloc_ordered(rt->pool, size, stream, ptr_out, ordered_out);
}
static dmem_status_t pool_src_alloc_past(dmem_runtime_t *rt, size_t size, void *stream,
                                         void **ptr_out, bool *ordered_out) {
  return dmem__pool_alloc_past_limit(rt->pool, size, stream, ptr_out, ordered_out);
}
static dmem_status_t pool_src_release(dmem_runtime_t *rt, void *ptr, size_t size, void *stream) {
  dmem__pool_free(rt->pool, ptr, size, stream);
  return DMEM_OK;
}
static int pool_src_fits(dmem_runtime_t *rt, size_t size, void *stream) {
  return dmem__pool_fits(rt->pool, size, stream);
}
static dmem_status_t pool_src_trim(dmem_runtime_t *rt, size_t keep, size_t *released_out) {
  return dmem__pool_trim(rt->pool, keep, released_out);
}
static void pool_src_stream_forget(dmem_runtime_t *rt, void *stream) {
  dmem__pool_stream_forget(rt->pool, stream);
}

static dmem_status_t blocks_src_alloc(dmem_runtime_t *rt, size_t size, void *stream,
                                      void **ptr_out, bool *ordered_out) {
  (void)ordered_out; /* never set for a dedicated block */
  return dmem__blocks_alloc(rt->blocks, size, stream, ptr_out);
}
static dmem_status_t blocks_src_release(dmem_runtime_t *rt, void *ptr, size_t size,
                                        void *stream) {
  (void)size;
  return dmem__blocks_free(rt->blocks, ptr, stream);
}
static dmem_status_t blocks_src_trim(dmem_runtime_t *rt, size_t keep, size_t *released_out) {
  return dmem__blocks_trim(rt->blocks, keep, released_out);
}
static void blocks_src_stream_forget(dmem_runtime_t *rt, void *stream) {
  dmem__blocks_stream_forget(rt->blocks, stream);
}

/* Rows in dmem__devsrc_t order (stream_forget visits them in it, trim last
 * to first). */
static const devsrc_t devsrc_table[DMEM__SRC_COUNT] = {
    [DMEM__SRC_POOL] = {"pool", pool_src_alloc, pool_src_alloc_past, pool_src_release,
                        pool_src_fits, pool_src_trim, pool_src_stream_forget},
    [DMEM__SRC_DEDICATED] = {"dedicated block", blocks_src_alloc, NULL, blocks_src_release, NULL,
                             blocks_src_trim, blocks_src_stream_forget},
};

const char *dmem__device_source_name(dmem__devsrc_t src) {
  return (unsigned)src < DMEM__SRC_COUNT ? devsrc_table[src].name : "unknown source";
}

/* ---- device memory ------------------------------------------------------------ */

/* Charge the limit, then a block of `src` (past its cut with `past`). */
static inline dmem_status_t device_alloc(dmem_runtime_t *rt, const devsrc_t *src, bool past,
                                         size_t size, void *stream, void **dev_out,
                                         bool *ordered_out, size_t *short_by_out) {
  size_t short_by = 0;
  if (!charge(rt, size, &short_by)) {
    *short_by_out = short_by;
    return DMEM_ERR_OUT_OF_MEMORY; /* the caller makes room or records the detail */
  }
  void *p = NULL;
  dmem_status_t st = past ? src->alloc_past(rt, size, stream, &p, ordered_out)
                          : src->alloc(rt, size, stream, &p, ordered_out);
  st = dmem__fatal_keep(rt, st);
  if (st != DMEM_OK) {
    uncharge(rt, size);
    /* no free range fits and no slab can be added */
    if (st == DMEM_ERR_OUT_OF_MEMORY) *short_by_out = size;
    return st;
  }
  *dev_out = p;
  return DMEM_OK;
}

dmem_status_t dmem__device_alloc(dmem_runtime_t *rt, size_t size, void *stream, void **dev_out,
                                 bool *ordered_out, size_t *short_by_out) {
  /* a constant row: the pool's calls are direct */
  return device_alloc(rt, &devsrc_table[DMEM__SRC_POOL], false, size, stream, dev_out,
                      ordered_out, short_by_out);
}

dmem_status_t dmem__device_alloc_from(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size,
                                      void *stream, void **dev_out, bool *ordered_out,
                                      size_t *short_by_out) {
  if (src == DMEM__SRC_POOL)
    return dmem__device_alloc(rt, size, stream, dev_out, ordered_out, short_by_out);
  return device_alloc(rt, &devsrc_table[src], false, size, stream, dev_out, ordered_out,
                      short_by_out);
}

dmem_status_t dmem__device_alloc_past_slabs(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size,
                                            void *stream, void **dev_out, bool *ordered_out,
                                            size_t *short_by_out) {
  const devsrc_t *s = &devsrc_table[src];
  if (!s->alloc_past) {
    *short_by_out = size;
    return DMEM_ERR_OUT_OF_MEMORY; /* no cut to pass */
  }
  return device_alloc(rt, s, true, size, stream, dev_out, ordered_out, short_by_out);
}

bool dmem__device_may_pass_cut(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size) {
  if (src != DMEM__SRC_POOL || size > rt->limit / DMEM__PAST_CUT_DIV) return false;
  if (dmem__device_used(rt) + size > rt->limit) return false; /* the limit is short, not the cut */
  dmem__pool_stats_t ps;
  dmem__pool_stats(rt->pool, &ps);
  /* the slabs past the cut, this one's included, within a 16th of the limit */
  return ps.reserved <= rt->limit + rt->limit / DMEM__PAST_CUT_DIV - size;
}

int dmem__device_fits(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size, void *stream) {
  const devsrc_t *s = &devsrc_table[src];
  return s->fits ? s->fits(rt, size, stream) : 1;
}

void dmem__device_release_to(dmem_runtime_t *rt, dmem__devsrc_t src, void *dev, size_t size,
                             void *stream) {
  if (src == DMEM__SRC_POOL) {
    dmem__device_release(rt, dev, size, stream);
    return;
  }
  (void)dmem__fatal_keep(rt, devsrc_table[src].release(rt, dev, size, stream));
  uncharge(rt, size);
}

void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size, void *stream) {
  dmem__pool_free(rt->pool, dev, size, stream);
  uncharge(rt, size);
}

void dmem__device_release_after(dmem_runtime_t *rt, void *dev, size_t size, void *event) {
  dmem__pool_free_after(rt->pool, dev, size, event);
  uncharge(rt, size);
}

void dmem__device_release_after_n(dmem_runtime_t *rt, void *const *devs, const size_t *sizes,
                                  size_t n, void *event) {
  dmem__pool_free_after_n(rt->pool, devs, sizes, n, event);
  for (size_t i = 0; i < n; i++)
    if (devs[i]) uncharge(rt, sizes[i]); /* this thread's shard: no shared write */
}

dmem_status_t dmem__device_trim(dmem_runtime_t *rt, size_t keep, size_t *released_out) {
  size_t total = 0;
  dmem_status_t first = DMEM_OK;
  /* last row first: cached dedicated blocks go back before the pool's slabs */
  for (unsigned i = DMEM__SRC_COUNT; i-- > 0;) {
    size_t released = 0;
    dmem_status_t st = dmem__fatal_keep(rt, devsrc_table[i].trim(rt, keep, &released));
    total += released;
    if (first == DMEM_OK) first = st;
  }
  if (released_out) *released_out = total;
  return first;
}

void dmem__device_stream_forget(dmem_runtime_t *rt, void *stream) {
  for (unsigned i = 0; i < DMEM__SRC_COUNT; i++) devsrc_table[i].stream_forget(rt, stream);
}
