/*
 * runtime/memory/pool.h - the device pool: a stream-ordered suballocator of
 * large slabs taken from the backend (memory layer; it calls the backend
 * table and nothing else of the runtime). Built from pool.c and its parts
 * pool_caches.c, pool_slabs.c, pool_ranges.c, pool_tags.c, pool_index.c,
 * each calling only those after it (pool_parts.h draws the order).
 *
 * What it gives:
 *  - Blocks of device memory, 256-byte aligned, carved from slabs that come
 *    from be->device_alloc (cudaMalloc under CUDA, so CUDA IPC works on
 *    them). Slabs grow geometrically from `min_slab` (doubling) and the bytes
 *    of all slabs never pass `limit` (except through
 *    dmem__pool_alloc_past_limit); a request larger than the next
 *    geometric size gets a slab of its own (rounded up to 2 MiB where that
 *    fits under the limit).
 *  - Size classes for blocks up to 1 MiB (multiples of 256 B up to 1 KiB,
 *    then four classes per power of two); larger blocks are rounded to
 *    256 B. Free ranges are kept best fit (a treap ordered by size, then
 *    address) and coalesce with both address neighbours in their slab.
 *    Blocks up to 4 KiB are cut from 64 KiB class runs (a bit per block,
 *    no per-block record); a run whose blocks are all free goes back to
 *    the free ranges at once.
 *  - Stream-ordered reuse. A block freed on stream S is reusable at once by S
 *    and by any other stream only once an event recorded on S after the free
 *    has completed (event_query) or after that stream was made to wait on it
 *    (be->stream_wait_event). The pool never synchronises the host on the
 *    alloc or free path, unless the backend fails to record an event (see
 *    dmem__pool_free).
 *  - A per-stream cache, sharded per thread, so that the common alloc+free
 *    pair takes no pool-wide lock: small blocks by size class; large ones
 *    (above DMEM__POOL_SMALL_MAX, up to limit/64) with their exact rounded
 *    size, a few per shard (at most limit/64 bytes of them), handed out only
 *    for a request of exactly that rounded size. A cached block is only
 *    ever handed to the stream it was freed on. Every cache is flushed
 *    before an allocation fails: never an OUT_OF_MEMORY while the bytes it
 *    needs sit in a cache.
 *  - Events are recorded late: a free records none. Cached small blocks get
 *    one event per batch when their cache is flushed; a large block leaving
 *    its cache, or a block that bypasses the caches (larger than limit/64,
 *    or a small one over the cache bound), goes to the free ranges
 *    "lazily", and the event on S is recorded only when another stream
 *    first takes such a block (that stream then waits on it). So a
 *    same-stream large alloc+free pair records no event.
 *
 * Thread safety: every function is thread-safe except dmem__pool_destroy,
 * which must not run concurrently with any other call on the same pool.
 *
 * Rules for callers:
 *  - The caller is trusted: dmem__pool_free / _free_after get a pointer that
 *    dmem__pool_alloc returned and the size that was asked for then, exactly
 *    once (caches file a block under that size and hand it out for it
 *    again). The pool checks global-path frees against its records (an
 *    unknown pointer is logged and ignored) but never checks cache frees.
 *  - Under CUDA, cudaStreamPerThread ((void *)2) is a different stream in
 *    every thread: the pool keys it per calling thread and never caches its
 *    blocks (each free records its own event).
 *  - Call dmem__pool_stream_forget before destroying a stream that was
 *    passed to the pool: until then the pool may record events on it (cache
 *    flushes, lazy frees), and stream handles can be reused by the backend
 *    after a stream is destroyed. A record that fails on a stream destroyed
 *    without it quarantines the blocks concerned.
 */
#ifndef DMEM_MEMORY_POOL_H
#define DMEM_MEMORY_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

/* Block alignment; every block size is a multiple of it. */
#define DMEM__POOL_ALIGN ((size_t)256)
/* Largest size served from size classes (larger blocks are rounded to
 * DMEM__POOL_ALIGN and cached per stream by exact size up to limit/64). */
#define DMEM__POOL_SMALL_MAX ((size_t)1 << 20)

typedef struct dmem__pool dmem__pool_t;

/* Counters of a pool; written whole by dmem__pool_stats. */
typedef struct dmem__pool_stats {
  size_t reserved;       /* slab bytes held (above the limit only after
                            dmem__pool_alloc_past_limit) */
  size_t in_use;         /* bytes in live blocks (rounded sizes) */
  uint64_t hits;         /* allocations served from a cache or the free ranges */
  uint64_t misses;       /* allocations that needed a new slab */
  size_t slabs;          /* slabs held */
  size_t cached;         /* bytes of freed blocks waiting in per-stream caches
                            (small and large) */
  uint64_t global_locks; /* alloc/free/flush operations that took the pool-wide mutex */
  size_t quarantined;    /* bytes freed whose reuse nothing could order: never
                            handed out again (see dmem__pool_free) */
  size_t runs;           /* class runs held (64 KiB each; their blocks count in
                            in_use as they are handed out) */
} dmem__pool_stats_t;

/*
 * Create a pool on backend `be` (which must outlive the pool).
 *   limit     the most slab bytes the pool ever holds (rounded down to 256 B);
 *             0 means be->device_capacity.
 *   min_slab  the first slab's size; later slabs double, capped by what is
 *             left under the limit. 0 means 2 MiB. Rounded up to 256 B.
 * No device memory is taken until the first allocation.
 * Returns DMEM_OK, DMEM_ERR_INVALID_ARGUMENT (be or pool_out NULL),
 * DMEM_ERR_HOST_OUT_OF_MEMORY. *pool_out is written only on success.
 */
dmem_status_t dmem__pool_create(dmem__backend_t *be, size_t limit, size_t min_slab,
                                dmem__pool_t **pool_out);

/*
 * Destroy the pool: records the events of lazily freed blocks and of cached
 * large blocks on their streams (which must still exist: see
 * dmem__pool_stream_forget), waits (event_synchronize) for every event the
 * pool recorded, destroys them and the pool's internal stream, then gives
 * every slab back with be->device_free. Blocks still live are reclaimed
 * with their slabs (logged as a warning). Work the caller enqueued on
 * device memory of the pool and did not free must have finished. Not
 * thread-safe with other calls on `p`; p NULL is a no-op.
 */
void dmem__pool_destroy(dmem__pool_t *p);

/*
 * A block of at least `size` bytes (256-byte aligned; size 0 counts as 1),
 * usable in stream order on `stream` (NULL: the default stream). When the
 * block was last freed on another stream and that free's event has not
 * completed, `stream` is made to wait on the event (be->stream_wait_event)
 * before the block is returned; a block freed lazily (see dmem__pool_free)
 * has its event recorded on the freeing stream first, then. Nothing waits
 * on the host. Among the few best-fitting free ranges, one usable without a
 * wait is preferred.
 * Order of attempts: this thread's cache of `stream` (a large request: a
 * cached block of exactly its rounded size); the free ranges; the same
 * after noting completed events; the same after flushing every small-block
 * cache (events recorded on their streams) and joining adjacent free ranges
 * (waiting on their events); a new slab; when no slab can be added, the
 * same after flushing every cache, large blocks included (their streams'
 * lazy events recorded if another stream takes them). Large caches are not
 * flushed to spare a new slab: the pool grows once to the working set
 * rather than pass blocks from thread to thread. The pool never evicts
 * anything.
 * Returns DMEM_OK (*ptr_out written); DMEM_ERR_OUT_OF_MEMORY (detail
 * recorded) when nothing fits and no slab can be added (limit reached or
 * backend device_alloc out of memory) - the caller spills and retries;
 * DMEM_ERR_INVALID_ARGUMENT (p or ptr_out NULL); DMEM_ERR_HOST_OUT_OF_MEMORY
 * (bookkeeping); DMEM_ERR_DEVICE / DMEM_ERR_DEVICE_FATAL from the backend.
 */
dmem_status_t dmem__pool_alloc(dmem__pool_t *p, size_t size, void *stream, void **ptr_out);

/*
 * dmem__pool_alloc, and on DMEM_ERR_OUT_OF_MEMORY also the largest
 * contiguous free range at the time of the failure (caches flushed) in
 * *largest_free_out. That output is the failure's payload: it is written
 * only when the status is DMEM_ERR_OUT_OF_MEMORY (and may be NULL), while
 * *ptr_out is written only on DMEM_OK.
 */
dmem_status_t dmem__pool_alloc_ex(dmem__pool_t *p, size_t size, void *stream, void **ptr_out,
                                  size_t *largest_free_out);

/*
 * dmem__pool_alloc, and *ordered_out (may be NULL; written on DMEM_OK) says
 * whether the block is usable only in `stream`'s order: `stream` was made to
 * wait for the block's last use, or that last use was on `stream` itself and
 * may still be pending. When false, every earlier use of the block is known
 * complete and any stream may use it at once. For callers that allocate on
 * one stream on behalf of others (dmem_buffer_alloc, which has no stream: it then
 * records an event for the buffer's lockers).
 */
dmem_status_t dmem__pool_alloc_ordered(dmem__pool_t *p, size_t size, void *stream, void **ptr_out,
                                       bool *ordered_out);

/*
 * dmem__pool_alloc_ordered, except that when no free range fits and no slab
 * can be added under the limit, a slab of exactly the request's (rounded)
 * size is added past it. For a caller that keeps the bytes of live blocks
 * under the limit itself (the runtime's device charge) and has nothing left
 * to free: live blocks can hold slabs whose free parts no request fits in
 * (a cudaMalloc'd slab cannot be cut smaller), and an allocation that fits
 * the limit must not fail because of that. Such slabs go back, as any
 * other, once they are empty and the pool is trimmed; while the pool holds
 * more than the limit, no other slab is added (until trim brings it under).
 */
dmem_status_t dmem__pool_alloc_past_limit(dmem__pool_t *p, size_t size, void *stream,
                                          void **ptr_out, bool *ordered_out);

/*
 * Free a block whose last use was enqueued on `stream` before this call.
 * It is reusable at once by `stream`; by any other stream only after an
 * event recorded on `stream` after this call has completed or the other
 * stream was made to wait on it. No host synchronisation, and no event
 * recorded by the free itself:
 *  - a small block goes to this thread's cache of `stream`; the event comes
 *    when that cache is flushed (overflow, a slow-path allocation, flush,
 *    trim, forget), one per batch;
 *  - a large block up to limit/64 goes to this thread's large cache of
 *    `stream` (no lock but the shard's); the cache's oldest blocks when it
 *    holds too many (8) or too many bytes (limit/64), and all of them on a
 *    flush (failing allocation, flush, trim, forget, destroy), leave as
 *    below, under the lazy tag;
 *  - any other block (larger than limit/64, or a small one over the cache
 *    bound) goes to the free ranges at once, exact size, under `stream`'s
 *    lazy tag: allocations on `stream` take it with no event; the first
 *    allocation on another stream that takes a block under the tag records
 *    the event on `stream` then (so it covers this free and whatever
 *    `stream` ran since) and waits on it; trim, stream_forget and destroy
 *    record it too. Takes the pool-wide mutex (as a cache overflow does).
 *  - On a stream the pool keeps no cache struct for (cudaStreamPerThread,
 *    or a full stream table) the free records an event at once.
 * p or ptr NULL is a no-op. If no event can be recorded when one is needed
 * (backend failure), the pool waits for the freeing stream on the host
 * instead and the blocks are free for everyone; only if that fails too (the
 * stream is gone, the device lost) are they quarantined until
 * dmem__pool_destroy: never handed out again, since nothing would order
 * their reuse.
 */
void dmem__pool_free(dmem__pool_t *p, void *ptr, size_t size, void *stream);

/*
 * Free a block whose last use is ordered before `event`, an event of the
 * caller's that is already recorded (e.g. a spill copy's).
 * Ownership: the pool never keeps `event`. If event_query says it has
 * completed, the block is free for everyone at once. Otherwise the pool makes
 * its own internal stream wait on `event` (which captures the event's
 * current record, as cudaStreamWaitEvent does) and records one of its own
 * events there; the block is reusable by a stream after that event completes
 * or after the stream waits on it. The caller may destroy or re-record
 * `event` as soon as this returns. event NULL means the last use has
 * completed. When the internal stream cannot be made or the event not
 * recorded, the pool waits for `event` on the host instead; a block whose
 * event cannot be waited for either (an invalid event, a lost device) is
 * quarantined (as in dmem__pool_free).
 */
void dmem__pool_free_after(dmem__pool_t *p, void *ptr, size_t size, void *event);
/* The same for n blocks (ptrs[i] of sizes[i] bytes; NULL entries are
 * skipped) whose last uses are all ordered before `event`: one query of
 * `event`, at most one wait and one record on the internal stream, and one
 * acquisition of the pool-wide mutex for all of them (a spill batch gives
 * its victims' ranges back this way). */
void dmem__pool_free_after_n(dmem__pool_t *p, void *const *ptrs, const size_t *sizes, size_t n,
                             void *event);

/*
 * Give back empty slabs with be->device_free until at most `keep` slab bytes
 * remain reserved (largest first), after flushing every cache (large ones
 * included). Only slabs whose every block is free and whose free events
 * have completed are given back. When more than `keep` is reserved, trim first waits
 * (be->event_synchronize, no pool lock held) for the pending free events of
 * slabs that hold nothing but free ranges - including the events its own
 * cache flush just recorded, and the events of lazily freed blocks there,
 * which it records first - since giving a slab back (cudaFree)
 * synchronises the device anyway. It never waits for anything else: a slab
 * with a live block stays. Not for the alloc/free path.
 * Returns DMEM_OK (*released_out, may be NULL, = bytes given back),
 * DMEM_ERR_INVALID_ARGUMENT (p NULL), or the backend's device_free status
 * (that slab stays in the pool; bytes given back before it are not
 * reported).
 */
dmem_status_t dmem__pool_trim(dmem__pool_t *p, size_t keep, size_t *released_out);

/*
 * Move every cached free block of every stream to the free ranges: small
 * ones under one event per stream shard and batch, large ones under their
 * stream's lazy tag (no event until another stream takes them). Victim
 * selection calls this first so that dmem__pool_range_if_freed and
 * dmem__pool_largest_free see cached blocks as free. Blocks freed lazily
 * are in the free ranges already (their events stay unrecorded). Never
 * waits.
 */
void dmem__pool_flush(dmem__pool_t *p);

/*
 * Forget `stream` before it is destroyed: flushes its caches (an event on
 * it), records the event of the blocks freed lazily on it, its cached large
 * blocks included (so that they stay
 * usable, by any stream, in order, once the stream is gone), and stops
 * treating later blocks' events on it as "same stream", so a new stream that
 * reuses the handle is ordered after the old one's work. The pool records
 * nothing on `stream` afterwards unless it is passed again. stream NULL (the
 * default stream) is never forgotten. Must not run concurrently with calls
 * that pass the same stream.
 */
void dmem__pool_stream_forget(dmem__pool_t *p, void *stream);

/*
 * For victim selection: the size of the contiguous free range that would
 * exist if the live block at `ptr` (from dmem__pool_alloc with `size`) were
 * freed now: the block plus the free ranges next to it in its slab, whatever
 * their events. Blocks in caches count as live (call dmem__pool_flush
 * first). A block of a class run (up to 4 KiB) counts as its class size
 * alone. 0 when ptr is not a live block of the global structure.
 */
size_t dmem__pool_range_if_freed(dmem__pool_t *p, void *ptr, size_t size);

/*
 * The largest contiguous free range now, over all slabs (adjacent free
 * ranges whose events differ count as one: an allocation can take them
 * together by waiting on their events). Cached blocks are not counted (call
 * dmem__pool_flush first). A request of `size` can be served without a new
 * slab when dmem__pool_block_size(size) <= this value (see dmem__pool_fits).
 */
size_t dmem__pool_largest_free(dmem__pool_t *p);

/* Whether a request of `size` bytes could be served now without a new slab
 * (from this thread's cache of `stream` or the free ranges). */
int dmem__pool_fits(dmem__pool_t *p, size_t size, void *stream);

/* The bytes a request of `size` occupies (its size class or 256-byte
 * rounding); what stats.in_use counts. Thread-safe, pure. */
size_t dmem__pool_block_size(size_t size);
/* Bytes of the host-side descriptor the pool keeps per live block
 * (bench/bench_scale.c reports it). */
size_t dmem__pool_seg_bytes(void);

/*
 * The slab holding `ptr`: its base (what be->device_alloc returned, the
 * address IPC handles are made of) and ptr's offset in it.
 * Returns DMEM_OK (both outputs written), DMEM_ERR_INVALID_ARGUMENT (ptr in
 * no slab of the pool, or an output NULL; detail recorded).
 */
dmem_status_t dmem__pool_slab_of(dmem__pool_t *p, const void *ptr, void **slab_base_out,
                                 size_t *offset_out);

/* Snapshot of the counters (each consistent; together approximate while
 * other threads run). out is written whole; p or out NULL is a no-op. */
void dmem__pool_stats(dmem__pool_t *p, dmem__pool_stats_t *out);

#endif /* DMEM_MEMORY_POOL_H */
