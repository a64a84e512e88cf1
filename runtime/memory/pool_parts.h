/*
 * runtime/memory/pool_parts.h - what the files of the device pool share:
 * its constants, its structs, the size classes, and each file's functions
 * for the files above it. Not for use outside runtime/memory/pool*.c (the
 * pool's interface is memory/pool.h).
 *
 * The pool in files, one concept each. A file calls only files below it in
 * this order (never one above it, so no two files call each other round,
 * directly or through others; tests/layers' check sees the symbols):
 *
 *   file            concept                                      calls
 *   pool.c          the pool: create, destroy, alloc (a cache    all below
 *                   hit, then the slow path's order of attempts),
 *                   free, free_after, trim, queries, stats
 *   pool_caches.c   per-stream caches: the stream table,         ranges, tags
 *                   per-thread shards, flush, forget
 *   pool_slabs.c    slabs: growth, lookup by address, giving     ranges, tags,
 *                   empty slabs back                             index
 *   pool_ranges.c   segments and free ranges: descriptors,       tags, index
 *                   coalescing, best fit, runs of neighbours,
 *                   class runs (small blocks as bits), giving
 *                   blocks back under a tag, quarantine
 *   pool_tags.c     event tags: records, lazy tags, when a       (the backend
 *                   range is usable or may join its neighbour    table only)
 *   pool_index.c    the live-block map and the free-range treap  nothing
 *
 * pool_caches.c and pool_slabs.c do not call each other; neither do
 * pool_tags.c and pool_index.c. A new file goes where its calls put it.
 *
 * Structure
 *  - Slabs from be->device_alloc, in an array sorted by base (slab_of).
 *    Every slab is cut into segments, kept in address order (prev/next) for
 *    coalescing. A segment is LIVE (handed out, or parked in a cache), FREE,
 *    or QUARANTINED (freed but unorderable; never reused).
 *  - FREE segments sit in a treap keyed by (size, address): best fit is the
 *    lower bound of the request, O(log n) with thousands of free ranges.
 *    LIVE segments sit in a hash map keyed by address (free finds them).
 *  - Sizes up to 1 MiB are rounded to one of 44 classes (256 B steps up to
 *    1 KiB, then four per power of two), larger ones to 256 B (exact: no
 *    coarser rounding, device bytes matter).
 *  - Blocks of the classes up to 4 KiB live in class runs (struct
 *    pool_run below): a LIVE 64 KiB segment, 64 KiB-aligned, whose blocks
 *    are bits, so a live small block costs no descriptor and no map entry.
 *  - The fast path, a hit in this thread's shard of the stream's cache,
 *    takes no pool-wide lock: pool.c pops and pushes the shard that
 *    pool_caches.c finds (one call), under the shard's mutex. Everything
 *    else goes through the global structure under mu (pool_ranges.c).
 *
 * Locks, outer before inner (none is taken while an inner one is held):
 *   table_mu -> shard mu          (flush, stats)
 *   table_mu -> rec_mu            (flush records an event; rec_mu is a leaf)
 *   table_mu -> mu -> tag_mu      (flush hands blocks back; forget)
 *   table_mu -> mu -> rec_mu      (forget records its lazy tag)
 *   mu -> rec_mu, mu -> tag_mu    (a lazy tag recorded or opened under mu)
 *   grow_mu -> mu                 (slab growth and trim)
 *   aux_mu -> tag_mu              (free_after)
 * The fast path takes one shard mu and nothing else. No pool lock is held
 * across a call that can block long, except grow_mu across the backend's
 * device_alloc / device_free; event_record, event_query, event_create (a
 * new tag) and stream_wait_event (non-blocking) run under rec_mu, aux_mu or
 * mu.
 */
#ifndef DMEM_MEMORY_POOL_PARTS_H
#define DMEM_MEMORY_POOL_PARTS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"
#include "base/error.h"
#include "memory/pool.h"

#define POOL_ALIGN DMEM__POOL_ALIGN
#define POOL_SMALL_MAX DMEM__POOL_SMALL_MAX
#define POOL_NCLASSES 44u        /* classes for sizes up to POOL_SMALL_MAX */
#define POOL_CLASS_CAP 32u       /* cached blocks per class and shard */
#define POOL_LARGE_CAP 8u        /* cached large blocks per shard */
#define POOL_LARGE_DIV 64u       /* large_cache_bytes = limit / POOL_LARGE_DIV */
#define POOL_SHARDS 16u          /* shards per stream cache */
#define POOL_STREAM_SLOTS 512u   /* stream table slots (power of two) */
#define POOL_STREAM_SLOT_BITS 9u /* log2(POOL_STREAM_SLOTS) */
#define POOL_STREAM_MAX 384u     /* streams cached at once; more go uncached */
#define POOL_FLUSH_BATCH 64u     /* blocks moved out of a cache under one event */
#define POOL_FIND_CANDIDATES 8   /* best-fit candidates looked at for one usable now */
#define POOL_SLAB_GRAIN ((size_t)2 << 20)
#define POOL_DEFAULT_MIN_SLAB ((size_t)2 << 20)
#define POOL_CACHE_MIN ((size_t)64 << 10) /* per-shard cache byte bound, lowest */
#define POOL_CACHE_MAX ((size_t)64 << 20) /* and highest */
#define POOL_MAX_REQUEST (SIZE_MAX / 2)
#define POOL_CUDA_PER_THREAD_STREAM ((void *)(uintptr_t)2) /* cudaStreamPerThread */
#define POOL_RUN_BYTES ((size_t)64 << 10) /* a class run: aligned to its size */
#define POOL_RUN_CLASSES 12u  /* classes 0..11 (blocks up to 4 KiB) live in runs */
#define POOL_RUN_WORDS 4u     /* bitmap words: POOL_RUN_BYTES / 256 blocks at most */

typedef struct pool_seg pool_seg_t;
typedef struct pool_slab pool_slab_t;
typedef struct pool_tag pool_tag_t;
typedef struct pool_shard pool_shard_t;
typedef struct pool_stream pool_stream_t;
typedef struct pool_run pool_run_t;

typedef enum pool_seg_state {
  SEG_LIVE,        /* handed out or in a cache; in the map */
  SEG_FREE,        /* in the treap (and in `pending` when tagged) */
  SEG_QUARANTINED, /* freed without an event: never reused until destroy */
  SEG_UNUSED       /* descriptor on the free list */
} pool_seg_state_t;

/* One event recorded on one stream after the frees it covers, or (lazy) to
 * be recorded there when another stream first needs the blocks. All fields
 * under the pool's mu once published (the recorder fills them privately). */
struct pool_tag {
  void *event;             /* backend event; the tag struct keeps it for life */
  uintptr_t skey;          /* stream key of the record; 0: no stream reuses at once */
  uint64_t seq;            /* record order on that stream; 0: unknown (or lazy) */
  uint32_t refs;           /* segments carrying it + the recorder's until published */
  bool done;               /* event_query said complete (monotonic while refs > 0) */
  bool lazy;               /* not recorded yet: ps->lazy == this tag, and only then */
  pool_stream_t *ps;       /* lazy: the stream's cache struct (rec_mu, rec_seq) */
  void *stream;            /* lazy: the stream to record on */
  pool_tag_t *prev, *next; /* p->tags while refs > 0 or lazy; `next` links the free list */
};

/* A segment descriptor (host memory; the device bytes are never touched).
 * All fields under the pool's mu. */
struct pool_seg {
  uintptr_t addr;
  size_t size;
  pool_slab_t *slab;
  pool_seg_t *prev, *next;   /* address order in the slab */
  pool_seg_t *tl, *tr;       /* treap children (FREE) */
  pool_seg_t *pprev, *pnext; /* `pending` list (FREE, tagged); pnext also links unused descs */
  pool_tag_t *tag;           /* FREE: pending work before reuse; NULL: settled */
  pool_run_t *run;           /* LIVE: the class run it holds, or NULL (a plain block) */
  uint32_t prio;             /* treap priority, random, fixed per descriptor */
  uint8_t state;             /* pool_seg_state_t */
};

/* A class run: one LIVE segment of POOL_RUN_BYTES, aligned to that size,
 * cut into blocks of one small class (up to 4 KiB) that have no
 * descriptor and no map entry of their own: a bit each. A block's run is
 * the segment at its address rounded down to POOL_RUN_BYTES (or at its own
 * address, for block 0); a plain LIVE segment there has run NULL. A block
 * is live (handed out, cached, deferred or quarantined), pending (free,
 * reusable once `tag` allows) or free for every stream. All fields under
 * the pool's mu. */
struct pool_run {
  uintptr_t base;
  pool_seg_t *seg;                /* the LIVE segment the run occupies */
  pool_tag_t *tag;                /* the pending blocks' work (one ref), NULL if none */
  pool_run_t *prev, *next;        /* p->run_open[cls]: runs with a block not live */
  pool_run_t *aprev, *anext;      /* p->runs: every run */
  uint64_t live[POOL_RUN_WORDS];  /* bit i: block i is live */
  uint64_t pend[POOL_RUN_WORDS];  /* bit i: block i is free after `tag` */
  uint16_t nblocks, nlive;
  uint16_t nparked;               /* live blocks in p->deferred */
  uint8_t cls;
  bool open;                      /* on p->run_open[cls] */
};

/* A block of a run freed under a tag that cannot join the run's pending
 * tag (another stream's): it stays live until that tag settles (mu). */
typedef struct pool_deferred {
  uintptr_t addr;
  pool_tag_t *tag; /* one ref */
} pool_deferred_t;

struct pool_slab {
  uintptr_t base;
  size_t size;
  pool_seg_t *first; /* lowest segment */
  bool dirty;        /* a segment's tag settled: re-coalesce (mu) */
};

/* A shard of a stream's cache: blocks freed on that stream by the threads
 * whose shard index it is. Everything under `mu`. */
struct pool_shard {
  pthread_mutex_t mu;
  size_t bytes;                 /* cached bytes of small blocks (the class stacks) */
  size_t in_use;                /* live-byte delta of this shard (wraps; summed by stats) */
  uint64_t hits;                /* allocations served here */
  size_t lbytes;                /* cached bytes of large blocks */
  unsigned ln;                  /* cached large blocks */
  size_t lsize[POOL_LARGE_CAP]; /* their exact (rounded) sizes; [0] oldest */
  void *lptr[POOL_LARGE_CAP];
  uint16_t n[POOL_NCLASSES];
  void *stack[POOL_NCLASSES][POOL_CLASS_CAP]; /* [0] oldest, [n-1] newest */
};

struct pool_stream {
  _Atomic uintptr_t key;                       /* stream key while in the table, 0 while on the free
                                                  list; written under table_mu (insert, forget) */
  void *stream;                                /* the backend stream (written under table_mu before
                                                  publication; read under table_mu) */
  pthread_mutex_t rec_mu;                      /* records on this stream with their rec_seq */
  uint64_t rec_seq;                            /* (rec_mu) */
  pool_tag_t *lazy;                            /* the open lazy tag of this stream, or NULL (mu) */
  _Atomic(pool_shard_t *) shards[POOL_SHARDS]; /* written once, by the CAS of
                             the first thread to use that shard */
  pool_stream_t *next_all;                     /* every struct of the pool (table_mu) */
  pool_stream_t *next_free;                    /* recycled structs (table_mu) */
};

/* Live segments by address: open addressing, linear probing, backward-shift
 * deletion. Under mu. */
typedef struct pool_map {
  pool_seg_t **slots;
  size_t cap; /* power of two, or 0 */
  unsigned shift;
  size_t count;
} pool_map_t;

#define POOL_TOMB ((pool_stream_t *)(uintptr_t)1)

struct dmem__pool {
  dmem__backend_t *be;
  size_t limit;
  size_t min_slab;
  size_t cache_bytes;       /* per-shard bound of the small caches */
  size_t large_cache_bytes; /* per-shard bound of the large caches, and the
                               largest block cached (limit / POOL_LARGE_DIV) */
  bool cuda;

  /* Stream table. Slots hold NULL (never used), POOL_TOMB (forgotten) or a
   * pool_stream_t; written under table_mu with release, read lock-free with
   * acquire (pool_stream_find). */
  _Atomic(pool_stream_t *) slots[POOL_STREAM_SLOTS];
  pthread_mutex_t table_mu;
  pool_stream_t *streams;      /* table_mu */
  pool_stream_t *free_streams; /* table_mu */
  size_t live_streams;         /* table_mu */

  pthread_mutex_t grow_mu; /* serialises slab allocation and release */
  size_t next_geo;         /* next geometric slab size (grow_mu) */

  /* The global structure, under mu. */
  pthread_mutex_t mu;
  pool_slab_t **slabs; /* sorted by base */
  size_t nslabs, slabs_cap;
  size_t reserved;     /* slab bytes, device_free'd slabs excluded (written under grow_mu and mu) */
  size_t quarantined;  /* bytes in quarantined segments (mu) */
  pool_seg_t *root;    /* treap of FREE segments */
  pool_seg_t *pending; /* FREE segments with a tag */
  pool_tag_t *tags;    /* tags with refs > 0 */
  pool_seg_t *unused;  /* descriptor free list */
  size_t nunused;
  pool_map_t map;
  pool_run_t *run_open[POOL_RUN_CLASSES]; /* runs with room, per class */
  pool_run_t *runs;                       /* every run */
  size_t nruns;
  pool_deferred_t *deferred; /* blocks of runs waiting for their tag */
  size_t ndeferred, deferred_cap;
  uint32_t rng;
  uint64_t hits, misses, global_locks;
  size_t in_use; /* wraps; summed with the shards' deltas */

  pthread_mutex_t tag_mu;
  pool_tag_t *free_tags; /* tag_mu; each keeps its event */

  pthread_mutex_t aux_mu; /* the internal stream for free_after, and aux_seq */
  void *aux_stream;
  uint64_t aux_seq;
};

/* ---- sizes ------------------------------------------------------------------ */

static inline unsigned pool_log2(size_t x) {
  return 63u - (unsigned)__builtin_clzll((unsigned long long)x);
}

/* Rounded size of a request (size <= POOL_MAX_REQUEST) and its class
 * (POOL_NCLASSES for large blocks). */
static inline size_t pool_round(size_t size, unsigned *cls_out) {
  if (size == 0) size = 1;
  if (size <= 1024) {
    unsigned c = (unsigned)((size + 255) / 256) - 1;
    *cls_out = c;
    return (size_t)(c + 1) * 256;
  }
  if (size <= POOL_SMALL_MAX) {
    unsigned k = pool_log2(size - 1); /* size in (2^k, 2^(k+1)] */
    size_t step = (size_t)1 << (k - 2);
    size_t r = (size + step - 1) & ~(step - 1);
    *cls_out = 4u + (k - 10u) * 4u + (unsigned)((r - ((size_t)1 << k)) / step) - 1u;
    return r;
  }
  *cls_out = POOL_NCLASSES;
  return (size + POOL_ALIGN - 1) & ~(POOL_ALIGN - 1);
}

static inline size_t pool_class_size(unsigned c) {
  if (c < 4) return (size_t)(c + 1) * 256;
  unsigned k = 10u + (c - 4u) / 4u;
  return ((size_t)1 << k) + ((size_t)((c - 4u) % 4u) + 1) * ((size_t)1 << (k - 2));
}

/* ---- pool_tags.c: event tags (mu unless noted) --------------------------------- */

static inline void pool_tag_ref(pool_tag_t *t) { t->refs++; }
static inline bool pool_tag_settled(const pool_tag_t *t) { return !t || t->done; }

void dmem__pool_tag_unref(dmem__pool_t *p, pool_tag_t *t);
/* Publish a freshly recorded tag (refs 1: the recorder's) on p->tags. */
void dmem__pool_tag_link(dmem__pool_t *p, pool_tag_t *t);
/* Record an event on `stream` for blocks freed there before this call (see
 * pool_tags.c). The tag comes back private with refs 1. */
dmem_status_t dmem__pool_tag_record(dmem__pool_t *p, pthread_mutex_t *rec_mu, uint64_t *seq,
                                    void *stream, uintptr_t skey, pool_tag_t **tag_out);
/* The open lazy tag of ps, made now if there is none. */
dmem_status_t dmem__pool_tag_lazy(dmem__pool_t *p, pool_stream_t *ps, void *stream,
                                  pool_tag_t **tag_out);
/* Record lazy t's event on its stream now; on failure t stays lazy. */
dmem_status_t dmem__pool_tag_materialise(dmem__pool_t *p, pool_tag_t *t);
/* Lazy t with refs 0: no longer its stream's open tag. */
void dmem__pool_tag_close(dmem__pool_t *p, pool_tag_t *t);
/* Whether stream key skey may use a range tagged t without waiting. */
bool dmem__pool_tag_usable(dmem__pool_t *p, pool_tag_t *t, uintptr_t skey);
/* Whether free neighbours tagged a and b may join; *keep: the union's tag. */
bool dmem__pool_tags_mergeable(pool_tag_t *a, pool_tag_t *b, pool_tag_t **keep);
/* Destroy: record the lazy tags that carry ranges, wait for every tag's
 * event and destroy them all (no other thread). */
void dmem__pool_tags_destroy(dmem__pool_t *p);

/* ---- pool_index.c: the live-block map and the free-range treap (mu) ------------- */

pool_seg_t *dmem__pool_map_find(const pool_map_t *m, uintptr_t addr);
void dmem__pool_map_put(pool_map_t *m, pool_seg_t *s);
/* Room for one more entry. DMEM_ERR_HOST_OUT_OF_MEMORY (recorded). */
dmem_status_t dmem__pool_map_reserve(pool_map_t *m);
void dmem__pool_map_remove(pool_map_t *m, pool_seg_t *s);
/* The treap rooted at t with x inserted / erased; its new root. */
pool_seg_t *dmem__pool_treap_insert(pool_seg_t *t, pool_seg_t *x);
pool_seg_t *dmem__pool_treap_erase(pool_seg_t *t, pool_seg_t *x);
/* The smallest key >= (size, addr). */
pool_seg_t *dmem__pool_treap_lower_bound(pool_seg_t *t, size_t size, uintptr_t addr);

/* ---- pool_ranges.c: segments and free ranges (mu unless noted) ------------------ */

/* At least n descriptors on the free list. DMEM_ERR_HOST_OUT_OF_MEMORY. */
dmem_status_t dmem__pool_desc_reserve(dmem__pool_t *p, size_t n);
/* A reserved descriptor (never fails) / one given back. */
pool_seg_t *dmem__pool_desc_get(dmem__pool_t *p);
void dmem__pool_desc_put(dmem__pool_t *p, pool_seg_t *d);
/* Enter a FREE segment in the treap (and `pending`), or take it out. */
void dmem__pool_range_index(dmem__pool_t *p, pool_seg_t *s);
void dmem__pool_range_unindex(dmem__pool_t *p, pool_seg_t *s);
/* A LIVE segment becomes FREE carrying tag (coalesced), or QUARANTINED. */
void dmem__pool_range_release(dmem__pool_t *p, pool_seg_t *s, pool_tag_t *tag);
void dmem__pool_range_quarantine(dmem__pool_t *p, pool_seg_t *s);
/* Lazy t could not be recorded: its stream waited for on the host, and its
 * ranges freed for all (or quarantined when that fails too). */
void dmem__pool_range_sync_tag(dmem__pool_t *p, pool_tag_t *t);
/* Note completed events and coalesce what they free up. */
void dmem__pool_range_settle(dmem__pool_t *p);
/* Cut `need` bytes of FREE s into a LIVE segment (room reserved). */
void dmem__pool_range_carve(dmem__pool_t *p, pool_seg_t *s, size_t need);
/* Take `need` bytes from one free range / a run of neighbours.
 * DMEM_ERR_OUT_OF_MEMORY (not recorded) when nothing fits. */
dmem_status_t dmem__pool_range_take(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                    void **ptr_out, bool *ordered);
dmem_status_t dmem__pool_range_take_run(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                        void **ptr_out, bool *ordered);
/* Small blocks (classes below POOL_RUN_CLASSES): a block of a class run
 * (an open run's block usable now, else one of a new run, else a plain
 * block from the free ranges, else a run's pending block after a wait).
 * Statuses as dmem__pool_range_take. */
dmem_status_t dmem__pool_range_take_small(dmem__pool_t *p, size_t need, unsigned cls,
                                          uintptr_t skey, void *stream, void **ptr_out,
                                          bool *ordered);
/* The run holding live block addr, or NULL. */
pool_run_t *dmem__pool_run_of(dmem__pool_t *p, uintptr_t addr);
/* Whether an open run of class cls has a block that is not live. */
bool dmem__pool_run_room(const dmem__pool_t *p, unsigned cls);
/* The live block at addr: false if there is none; else *seg_out is its
 * segment (a plain block) or NULL with *run_size_out its class size (a
 * block of a run). */
bool dmem__pool_block_find(dmem__pool_t *p, uintptr_t addr, pool_seg_t **seg_out,
                           size_t *run_size_out);
/* The live block at addr becomes free carrying tag (NULL: free for all) /
 * is quarantined; false (nothing changes) if addr is no live block. */
bool dmem__pool_block_release(dmem__pool_t *p, uintptr_t addr, pool_tag_t *tag);
bool dmem__pool_block_quarantine(dmem__pool_t *p, uintptr_t addr);
/* The longest run of free neighbours. */
size_t dmem__pool_range_largest(dmem__pool_t *p);
/* Blocks freed on `stream` back to the free ranges, under one event recorded
 * now / under the stream's lazy tag. No lock held but possibly table_mu. */
void dmem__pool_range_give_back(dmem__pool_t *p, pool_stream_t *ps, void *stream, void *const *ptrs,
                                size_t n, size_t in_use_dec);
void dmem__pool_range_free_lazy(dmem__pool_t *p, pool_stream_t *ps, void *stream, void *const *ptrs,
                                size_t n, size_t in_use_dec);
/* Destroy: the descriptor free list and the map (no other thread). */
void dmem__pool_ranges_destroy(dmem__pool_t *p);

/* ---- pool_slabs.c: slabs ---------------------------------------------------------- */

/* grow_mu held, mu not: add a slab able to hold `need` and take the block
 * from it (see pool_slabs.c for the statuses). */
dmem_status_t dmem__pool_slab_grow(dmem__pool_t *p, size_t need, bool past_limit, void **ptr_out,
                                   char *why, size_t why_len);
/* Give empty slabs back until at most keep bytes stay reserved (the caches
 * flushed first by the caller); dmem__pool_trim's statuses. */
dmem_status_t dmem__pool_slabs_trim(dmem__pool_t *p, size_t keep, size_t *released_out);
/* Destroy: every slab back to the backend, with its descriptors. */
void dmem__pool_slabs_destroy(dmem__pool_t *p);

/* ---- pool_caches.c: per-stream caches ------------------------------------------------ */

/* The cache struct of `stream`, made on first use; NULL: go uncached. */
pool_stream_t *dmem__pool_stream_get(dmem__pool_t *p, void *stream);
/* The fast path (pool.c's alloc, free and fits work on the shard under its
 * mu, so that a cache hit costs no call beyond this lookup). This thread's
 * shard of the cache of `stream`, made on first use; NULL: go uncached
 * (*ps_out is then the stream's struct, or NULL). */
pool_shard_t *dmem__pool_shard_get(dmem__pool_t *p, void *stream, pool_stream_t **ps_out);
/* sh->mu held. The newest cached large block of exactly rsize bytes, taken
 * out; NULL if none. */
void *dmem__pool_shard_pop_large(pool_shard_t *sh, size_t rsize);
/* sh->mu held. Push a large block (rsize <= large_cache_bytes), after moving
 * the oldest entries to out (returned: how many, <= POOL_LARGE_CAP) while
 * the count or byte bound would be passed. */
size_t dmem__pool_shard_push_large(const dmem__pool_t *p, pool_shard_t *sh, void *ptr, size_t rsize,
                                   void **out);
/* sh->mu held. Make room for a block of class cls: entries moved to out
 * (returned: how many, <= POOL_FLUSH_BATCH). */
size_t dmem__pool_shard_evict(const dmem__pool_t *p, pool_shard_t *sh, unsigned cls, size_t rsize,
                              void **out);
/* Every stream's caches to the free ranges: the small ones, and the large
 * ones if `large`. */
void dmem__pool_cache_flush_all(dmem__pool_t *p, bool large);
/* Sum of the shards' counters (dmem__pool_stats). */
void dmem__pool_cache_stats(dmem__pool_t *p, size_t *in_use, uint64_t *hits, size_t *cached);
/* Destroy, first step: cached large blocks to the free ranges under their
 * streams' lazy tags. Second step (after the tags): free every cache
 * struct; returns the shards' live-byte deltas summed. No other thread. */
void dmem__pool_caches_drain(dmem__pool_t *p);
size_t dmem__pool_caches_destroy(dmem__pool_t *p);

#endif /* DMEM_MEMORY_POOL_PARTS_H */
