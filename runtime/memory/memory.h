/*
 * runtime/memory/memory.h - the memory layer: the stream-ordered device pool
 * (pool.c and its parts pool_*.c, whose order pool_parts.h draws),
 * device memory charged against the runtime's limit (devmem.c), the table
 * of live raw allocations (raw.c) and the pinned host pool (hostpool.c).
 * It calls only core, the backend table and base; making room when memory
 * runs short is the spill layer's job (spill/pressure.c).
 */
#ifndef DMEM_MEMORY_LAYER_H
#define DMEM_MEMORY_LAYER_H

#include "core/runtime.h"

/* ---- the device pool (memory/pool*.c) ------------------------------------------ */
#include "memory/pool.h"

/* ---- device memory (memory/devmem.c) -------------------------------------------- */

/* The sources of device blocks: a row each in memory/devmem.c's table
 * (alloc, alloc past the source's cut, release, fits, trim, stream_forget).
 * A new source is one file (its allocator) plus one row there and a name
 * here. Buffers always come from the pool. */
typedef enum dmem__devsrc {
  DMEM__SRC_POOL,      /* the stream-ordered pool (memory/pool*.c) */
  DMEM__SRC_DEDICATED, /* a whole backend allocation each (memory/blocks.c) */
  DMEM__SRC_COUNT
} dmem__devsrc_t;
/* The source's name for messages ("pool", "dedicated block"). */
const char *dmem__device_source_name(dmem__devsrc_t src);

/* Charge size bytes against the device limit and take a pool block usable in
 * stream order on `stream`. *ordered_out (may be NULL) is set when the pool
 * had to make `stream` wait for an earlier use of the block (work on other
 * streams must then be ordered after `stream`'s current point).
 * DMEM_ERR_OUT_OF_MEMORY when the limit or the pool has no room:
 * *short_by_out is then how many bytes would have to be freed first (the
 * whole request when the pool needs a contiguous range). Other statuses are
 * backend errors. Nothing is spilled here. */
dmem_status_t dmem__device_alloc(dmem_runtime_t *rt, size_t size, void *stream, void **dev_out,
                                 bool *ordered_out, size_t *short_by_out);
/* dmem__device_alloc from source `src`, charged against the limit like a
 * pool block (DMEM__SRC_POOL: dmem__device_alloc itself). *ordered_out is
 * never set for a source that cannot tell (a dedicated block). */
dmem_status_t dmem__device_alloc_from(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size,
                                      void *stream, void **dev_out, bool *ordered_out,
                                      size_t *short_by_out);
/* dmem__device_alloc_from, except that when the charge fits the limit but
 * the source has no room under its own cut, it allocates past it: for the
 * pool, when no slab has a range for it and none can be added under the
 * limit, a slab past it (dmem__pool_alloc_past_limit): live bytes stay
 * under the limit, the slabs may hold more while live blocks keep other
 * slabs partly empty. The last resort of spill/pressure.c, once nothing can
 * be spilled and empty slabs were given back. DMEM_ERR_OUT_OF_MEMORY
 * (*short_by_out = size, nothing charged) for a source without a cut (a
 * dedicated block). */
dmem_status_t dmem__device_alloc_past_slabs(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size,
                                            void *stream, void **dev_out, bool *ordered_out,
                                            size_t *short_by_out);
/* How far the pool's slabs may pass the limit before anything is spilled:
 * limit / DMEM__PAST_CUT_DIV. */
#define DMEM__PAST_CUT_DIV 16
/* Whether spill/pressure.c may ask dmem__device_alloc_past_slabs for
 * `size` bytes from `src` before it spills anything: the source is the
 * pool, the live bytes and `size` fit the limit (the limit counts what
 * allocations hold, not how the slabs are cut), and the slabs, with one of
 * `size` bytes more, stay within limit + limit / DMEM__PAST_CUT_DIV. The
 * slabs' tails (each slab rounded up to the 2 MiB grain, the geometric
 * slabs' ends too short for one more request) then do not stop requests of
 * one size (a Dask worker's chunks) short of filling the limit. A racing
 * snapshot: the charge in dmem__device_alloc_past_slabs decides.
 * Thread-safe. */
bool dmem__device_may_pass_cut(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size);
/* Whether a request of `size` from `src` could be served now without a
 * contiguous range being freed first (the pool: dmem__pool_fits; a source
 * that takes whole backend allocations: always, once the bytes are free). */
int dmem__device_fits(dmem_runtime_t *rt, dmem__devsrc_t src, size_t size, void *stream);
/* Give back a block of `src` whose last use was enqueued on `stream`
 * (DMEM__SRC_POOL: dmem__device_release). */
void dmem__device_release_to(dmem_runtime_t *rt, dmem__devsrc_t src, void *dev, size_t size,
                             void *stream);
/* `stream` is about to be destroyed: every source stops naming it (the
 * pool: memory/pool.h's dmem__pool_stream_forget). */
void dmem__device_stream_forget(dmem_runtime_t *rt, void *stream);
/* Give each source's cached memory back to the backend (empty pool slabs,
 * cached dedicated blocks) until at most keep bytes of each stay held;
 * *released_out (may be NULL): bytes given back. Backend errors (the first
 * source's that fails). */
dmem_status_t dmem__device_trim(dmem_runtime_t *rt, size_t keep, size_t *released_out);
/* Give back a block whose last use was enqueued on `stream` (reusable at once
 * by that stream), or whose last use is ordered before `event` (NULL: the
 * last use has completed). No host synchronisation, no cudaFree. */
void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size, void *stream);
void dmem__device_release_after(dmem_runtime_t *rt, void *dev, size_t size, void *event);
/* The same for n blocks whose last uses are ordered before one `event`
 * (NULL entries skipped): one pool call (memory/pool.h's
 * dmem__pool_free_after_n). */
void dmem__device_release_after_n(dmem_runtime_t *rt, void *const *devs, const size_t *sizes,
                                  size_t n, void *event);

/* Charge size bytes against the device limit without taking memory (for
 * memory from elsewhere: memory/stable.c); false, *short_by_out = bytes
 * short, when the limit has no room. dmem__device_uncharge gives them back. */
bool dmem__device_charge(dmem_runtime_t *rt, size_t size, size_t *short_by_out);
void dmem__device_uncharge(dmem_runtime_t *rt, size_t size);

/* Set the shard refill size from the limit (at create). */
void dmem__charge_init(dmem_runtime_t *rt);
/* Give every shard's unused budget back to device_charged, which is then
 * the live bytes (dmem_stats_reset_peaks). Relaxed, as the charge is. */
void dmem__charge_drain(dmem_runtime_t *rt);
/* Bytes in live allocations (buffers and raw): a snapshot. */
size_t dmem__device_used(dmem_runtime_t *rt);

/* ---- stable-address device memory (memory/stable.c) ------------------------------ */

/* The backend's VMM granularity (every stable range is a multiple of it).
 * Backend errors. */
dmem_status_t dmem__stable_granularity(dmem_runtime_t *rt, size_t *granularity_out);
/* Reserve a device address range for a stable buffer of `size` bytes,
 * rounded up to the granularity (*rounded_out), with no memory behind it
 * and nothing charged. DMEM_ERR_OUT_OF_MEMORY (address space),
 * DMEM_ERR_HOST_OUT_OF_MEMORY, backend errors. */
dmem_status_t dmem__stable_reserve(dmem_runtime_t *rt, size_t size, void **va_out,
                                   size_t *rounded_out);
/* Map new physical memory at the range `va` (its whole rounded size,
 * charged against the limit). DMEM_OK at once when it is still mapped (an
 * earlier unmap failed). DMEM_ERR_OUT_OF_MEMORY, with *short_by_out the
 * bytes to free first, when the limit or the device has no room (no detail
 * recorded: the caller makes room); backend errors. Nothing is left mapped
 * or charged on failure. The caller owns the buffer's move. */
dmem_status_t dmem__stable_map(dmem_runtime_t *rt, void *va, size_t *short_by_out);
/* Unmap and release the range's physical memory, uncharge it. The caller
 * has ordered this after the last use of the memory (the backend waits for
 * nothing). A failed unmap leaves it mapped and charged (its status is
 * returned); the range stays reserved either way. */
dmem_status_t dmem__stable_unmap(dmem_runtime_t *rt, void *va);
/* Unmap (if mapped) and give the range back; forgets it. After the last
 * use. Failures are recorded only (dmem__fatal_keep). */
void dmem__stable_free(dmem_runtime_t *rt, void *va);
/* The range's rounded size (0: no stable range), and whether memory is
 * mapped there now: snapshots, for stats and tests. */
size_t dmem__stable_size(const void *va);
bool dmem__stable_mapped(const void *va);

/* ---- live raw allocations (memory/raw.c) ---------------------------------------- */

dmem_status_t dmem__raw_create(dmem__raw_t **raw_out);
void dmem__raw_destroy(dmem__raw_t *raw);
/* Record a live raw allocation from source `src`.
 * DMEM_ERR_HOST_OUT_OF_MEMORY. */
dmem_status_t dmem__raw_insert(dmem__raw_t *raw, void *ptr, size_t size, dmem__devsrc_t src);
/* Forget a live raw allocation; *size_out is its size, *src_out what
 * insert was told. DMEM_ERR_INVALID_ARGUMENT (detail recorded) when ptr is
 * not one: nothing changes. */
dmem_status_t dmem__raw_remove(dmem__raw_t *raw, void *ptr, size_t *size_out,
                               dmem__devsrc_t *src_out);
/* The same for dmem_device_adopt: forget a live raw allocation that is a
 * pool block; a block of another source (a dedicated block) stays
 * (DMEM_ERR_INVALID_ARGUMENT, detail saying it cannot be adopted), as does
 * anything that is not a live raw allocation. */
dmem_status_t dmem__raw_remove_pooled(dmem__raw_t *raw, void *ptr, size_t *size_out);
/* Bytes of the live raw allocations (the sizes asked; dmem_stats' raw_used):
 * a snapshot, no lock taken. */
size_t dmem__raw_bytes(dmem__raw_t *raw);
/* The most bytes held in live entries at once since create or the last
 * dmem__raw_peak_reset (which starts it from the bytes now). */
size_t dmem__raw_peak(dmem__raw_t *raw);
void dmem__raw_peak_reset(dmem__raw_t *raw);

/* ---- dedicated device blocks (memory/blocks.c) ----------------------------------- */

/* Blocks of rt's backend that are each a whole backend allocation, with a
 * cache of freed ones holding at most max_bytes; events come from rt's pool
 * (core/event.c). DMEM_ERR_HOST_OUT_OF_MEMORY. */
dmem_status_t dmem__blocks_create(dmem_runtime_t *rt, size_t max_bytes,
                                  dmem__blocks_t **blocks_out);
/* Frees every block, cached or still live (the device must be idle; before
 * the event pool goes). */
void dmem__blocks_destroy(dmem__blocks_t *blocks);
/* A block of at least size bytes that starts its own backend allocation,
 * usable in stream order on `stream` (a cached block of another stream is
 * ordered by an event, no host wait). DMEM_ERR_OUT_OF_MEMORY when the
 * backend has no room even after the cache is emptied; backend errors. */
dmem_status_t dmem__blocks_alloc(dmem__blocks_t *blocks, size_t size, void *stream,
                                 void **ptr_out);
/* Cache a live block whose last use was enqueued on `stream` (or give it
 * back when the cache is full). DMEM_ERR_INVALID_ARGUMENT when ptr does not
 * start a live block; backend errors of blocks given back. */
dmem_status_t dmem__blocks_free(dmem__blocks_t *blocks, void *ptr, void *stream);
/* The live block holding ptr: its base and (rounded) size.
 * DMEM_ERR_INVALID_ARGUMENT (no detail recorded) when none holds it. */
dmem_status_t dmem__blocks_find(dmem__blocks_t *blocks, const void *ptr, void **base_out,
                                size_t *size_out);
/* `stream` is about to be destroyed: order its cached blocks by events. */
void dmem__blocks_stream_forget(dmem__blocks_t *blocks, void *stream);
/* Give cached blocks back (oldest first, each after its last use) until at
 * most keep bytes stay cached; *released_out (may be NULL): bytes given
 * back. Backend errors of the waits. */
dmem_status_t dmem__blocks_trim(dmem__blocks_t *blocks, size_t keep, size_t *released_out);
typedef struct dmem__blocks_stats {
  size_t live, live_bytes, cached, cached_bytes;
  uint64_t allocs, hits;
} dmem__blocks_stats_t;
void dmem__blocks_stats(dmem__blocks_t *blocks, dmem__blocks_stats_t *out);

/* ---- pinned host pool (memory/hostpool.c) -------------------------------------- */

/* A pool over be's pinned allocator holding at most `limit` bytes (0:
 * unlimited); `background`: a thread grows it before it runs dry and trims
 * it when idle. `reserve` bytes (<= limit when limit is set) are pinned
 * before it returns, several chunks at once, and kept until destroy: trims
 * never go below them. `headroom` (dmem_config_t.host_headroom): the most
 * free bytes the thread keeps ahead of demand, and with the block's bytes
 * and the backend's minimum chunk the bound of one chunk.
 * DMEM_ERR_HOST_OUT_OF_MEMORY (nothing is left pinned). */
dmem_status_t dmem__hostpool_create(dmem__backend_t *be, size_t limit, bool background,
                                    size_t reserve, size_t headroom,
                                    dmem__hostpool_t **pool_out);
void dmem__hostpool_destroy(dmem__hostpool_t *pool);
/* A block of size bytes (256-byte aligned; 4 KiB from 64 KiB up, and then
 * taking whole pages, header included, so that such blocks pack). Grows
 * the pool when nothing fits (one grower at a time, no mutex held across the
 * backend call). With a background thread, a block that would have to wait
 * for another thread's growth is pageable memory instead (the pageable
 * fallback, hostpool.c). DMEM_ERR_HOST_OUT_OF_MEMORY: the limit, or the
 * backend refused. */
dmem_status_t dmem__hostpool_alloc(dmem__hostpool_t *pool, size_t size, void **ptr_out);
/* n blocks of sizes[i] bytes each (as dmem__hostpool_alloc), carved under
 * one acquisition of the pool's mutex as far as the free ranges hold them;
 * the rest, if any, one by one (growth, the pageable fallback). Each block
 * is freed on its own with dmem__hostpool_free. All or nothing: on failure
 * no block stays allocated and ptrs_out[0..n) is undefined.
 * DMEM_ERR_HOST_OUT_OF_MEMORY. */
dmem_status_t dmem__hostpool_alloc_n(dmem__hostpool_t *pool, const size_t *sizes, size_t n,
                                     void **ptrs_out);
void dmem__hostpool_free(dmem__hostpool_t *pool, void *ptr);
/* Staging: a block as dmem__hostpool_alloc gives it, or, when no chunk
 * holds it and the pool holds its limit, a pageable block (as the
 * fallback's: marked in its header, freed with dmem__hostpool_free,
 * counted in the pageable stats, outside the limit) rather than a failed
 * move. DMEM_ERR_HOST_OUT_OF_MEMORY: the backend could not pin (not at the
 * limit), or no pageable memory either. */
dmem_status_t dmem__hostpool_alloc_staging(dmem__hostpool_t *pool, size_t size, void **ptr_out);
/* Whether the pool's chunks hold its limit (a limit is set and reached). */
bool dmem__hostpool_at_limit(dmem__hostpool_t *pool);
/* Whether a block from the pool is pageable memory (the fallback taken
 * while the pool grows) rather than pinned. Thread-safe (reads the block's
 * header). */
bool dmem__hostpool_pageable(const void *ptr);
/* Give wholly free chunks back until at most `keep` bytes stay held;
 * *released_out (may be NULL) = bytes given back. Always DMEM_OK. */
dmem_status_t dmem__hostpool_trim(dmem__hostpool_t *pool, size_t keep, size_t *released_out);
typedef struct dmem__hostpool_stats {
  size_t reserved, free;
  uint64_t grows, background_grows, trims;
  size_t pageable;          /* bytes in pageable fallback blocks now */
  uint64_t pageable_allocs; /* fallback blocks taken */
} dmem__hostpool_stats_t;
void dmem__hostpool_stats(dmem__hostpool_t *pool, dmem__hostpool_stats_t *out);
/* Tests: every later block is a pageable fallback block (on), or back to
 * the pool (off), so that the pageable path runs on demand. */
void dmem__hostpool_set_pageable_only(dmem__hostpool_t *pool, bool on);

#endif /* DMEM_MEMORY_LAYER_H */
