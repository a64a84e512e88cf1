/*
 * runtime/memory/pool.c - the device pool: stream-ordered suballocation of
 * backend slabs (memory layer; calls only the backend table).
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
 *
 * Fast path without the pool-wide lock
 *  - Each stream the pool sees gets a pool_stream_t, found lock-free from
 *    the stream pointer in an open-addressed table of atomic slots (insert
 *    and forget under table_mu publish with release; lookups acquire).
 *  - A pool_stream_t has POOL_SHARDS shards, picked by a per-thread index
 *    (_Thread_local, handed out round-robin at a thread's first call). A
 *    shard is a mutex (uncontended in practice) and per-class LIFO stacks of
 *    blocks freed on that stream. A small alloc pops from this thread's
 *    shard of its stream, a small free pushes there: no pool-wide lock, no
 *    event. Caches are bounded per class (POOL_CLASS_CAP) and in bytes per
 *    shard (cache_bytes); overflow moves the oldest entries out.
 *  - Large blocks (above POOL_SMALL_MAX, up to large_cache_bytes = limit/64)
 *    have a cache of their own in the same shard: up to POOL_LARGE_CAP
 *    blocks with their exact rounded sizes, oldest first, at most
 *    large_cache_bytes in all. A large alloc takes a cached block of exactly
 *    its rounded size (so the size the caller frees with is the block's), a
 *    large free pushes there: the same-stream large pair takes no pool-wide
 *    lock and records no event either. Overflow moves the oldest out.
 *    Bounds: a stream's caches hold at most POOL_SHARDS * limit/64 = limit/4
 *    of large blocks, and no allocation fails while bytes sit in a cache:
 *    the slow path flushes every cache, large ones included, before it
 *    fails. Small caches are also flushed before a slab is added; large
 *    ones are not, so that the pool grows once to a multi-threaded working
 *    set of large blocks rather than have threads take each other's cached
 *    blocks over and over, each time flushing every cache (and recording
 *    and waiting on events).
 *
 * Stream ordering
 *  - Cached blocks are only ever handed to their own stream key (same
 *    stream: ordered by construction). They leave a cache only by a flush
 *    (overflow, a slow-path allocation, trim, flush, forget; destroy for
 *    large ones). Small ones: the flusher records ONE event on the cache's
 *    stream after taking the entries out and tags every flushed segment
 *    with it (pool_tag_t). Large ones go to the free ranges under the
 *    stream's lazy tag (below), as if they had been freed uncached then:
 *    no event unless another stream wants them. free_after uses the pool's
 *    internal stream (see pool.h). Frees on streams without a cache struct
 *    (cudaStreamPerThread, a full stream table) record an event each.
 *  - Lazy tags: a free that bypasses the caches (large blocks above
 *    large_cache_bytes, small ones over the cache bound) or a large block
 *    leaving its cache, on a stream S with a cache struct, records
 *    nothing. The block goes to the free ranges under S's open lazy tag
 *    (ps->lazy, one per stream, under mu): a tag whose event is NOT recorded
 *    yet. S reuses it at once (same stream), so a same-stream large
 *    alloc+free pair that misses the caches costs two passes under mu and no
 *    event. The first time another stream T needs a range under that tag
 *    (pool_take, pool_take_run), the event is recorded on S then, under mu
 *    (with S's rec_mu and next rec_seq), and T waits on it: every block
 *    under the tag was freed before that record, so it covers their last
 *    uses (and whatever S ran since: conservative, never a host wait). The
 *    tag is then an ordinary one and S's next lazy free opens a new one. Lazy
 *    tags are never queried (no record yet, so never "done"); trim records
 *    them before waiting, stream_forget records its stream's before the
 *    stream can go away, destroy records all before its waits. If a record
 *    fails (the stream destroyed without forget, a broken device), the ranges
 *    under the tag are quarantined. An open lazy tag stays on p->tags even
 *    at refs 0, so a same-stream pair does not touch the tag free list.
 *  - A FREE segment with a tag is handed to the tag's stream at once; to
 *    another stream only if the tag's event has completed (event_query) or
 *    after be->stream_wait_event(stream, tag event) (a lazy tag recorded
 *    first). A tag without pending work (NULL, or done) makes the segment
 *    free for all.
 *  - Coalescing keeps that promise: two free neighbours join when one of
 *    them is settled (the union carries the other's tag), when they carry the
 *    same tag, or when both tags were recorded on the same stream (the
 *    later record, by a per-stream sequence number taken with the record
 *    under rec_mu, covers the earlier). A lazy tag joins only its own ranges
 *    and ranges under a recorded, pending tag of its stream (its record, to
 *    come, covers that one); never a settled range, which would tie bytes
 *    free for every stream to a record that has not happened yet. Otherwise
 *    neighbours stay apart; a request that only a run of such neighbours can
 *    serve takes the run after waiting on each foreign pending event.
 *  - Tags are reference-counted by the segments that carry them; at zero the
 *    tag and its event go back to a free list and the event is recorded
 *    again later. That is safe because a stream wait captures the event's
 *    record at the time of the call (cudaStreamWaitEvent semantics, which
 *    the host backend follows). Events are destroyed only at pool destroy,
 *    after event_synchronize.
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
#define _POSIX_C_SOURCE 200809L

#include "memory/pool.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/atomic.h"
#include "base/error.h"

#define POOL_ALIGN DMEM__POOL_ALIGN
#define POOL_SMALL_MAX DMEM__POOL_SMALL_MAX
#define POOL_NCLASSES 44u          /* classes for sizes up to POOL_SMALL_MAX */
#define POOL_CLASS_CAP 32u         /* cached blocks per class and shard */
#define POOL_LARGE_CAP 8u          /* cached large blocks per shard */
#define POOL_LARGE_DIV 64u         /* large_cache_bytes = limit / POOL_LARGE_DIV */
#define POOL_SHARDS 16u            /* shards per stream cache */
#define POOL_STREAM_SLOTS 512u     /* stream table slots (power of two) */
#define POOL_STREAM_SLOT_BITS 9u   /* log2(POOL_STREAM_SLOTS) */
#define POOL_STREAM_MAX 384u       /* streams cached at once; more go uncached */
#define POOL_FLUSH_BATCH 64u       /* blocks moved out of a cache under one event */
#define POOL_FIND_CANDIDATES 8     /* best-fit candidates looked at for one usable now */
#define POOL_SLAB_GRAIN ((size_t)2 << 20)
#define POOL_DEFAULT_MIN_SLAB ((size_t)2 << 20)
#define POOL_CACHE_MIN ((size_t)64 << 10)  /* per-shard cache byte bound, lowest */
#define POOL_CACHE_MAX ((size_t)64 << 20)  /* and highest */
#define POOL_MAX_REQUEST (SIZE_MAX / 2)
#define POOL_CUDA_PER_THREAD_STREAM ((void *)(uintptr_t)2) /* cudaStreamPerThread */

typedef struct pool_seg pool_seg_t;
typedef struct pool_slab pool_slab_t;
typedef struct pool_tag pool_tag_t;
typedef struct pool_shard pool_shard_t;
typedef struct pool_stream pool_stream_t;

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
  void *event;          /* backend event; the tag struct keeps it for life */
  uintptr_t skey;       /* stream key of the record; 0: no stream reuses at once */
  uint64_t seq;         /* record order on that stream; 0: unknown (or lazy) */
  uint32_t refs;        /* segments carrying it + the recorder's until published */
  bool done;            /* event_query said complete (monotonic while refs > 0) */
  bool lazy;            /* not recorded yet: ps->lazy == this tag, and only then */
  pool_stream_t *ps;    /* lazy: the stream's cache struct (rec_mu, rec_seq) */
  void *stream;         /* lazy: the stream to record on */
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
  uint32_t prio;             /* treap priority, random, fixed per descriptor */
  uint8_t state;             /* pool_seg_state_t */
};

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
  size_t bytes;    /* cached bytes of small blocks (the class stacks) */
  size_t in_use;   /* live-byte delta of this shard (wraps; summed by stats) */
  uint64_t hits;   /* allocations served here */
  size_t lbytes;   /* cached bytes of large blocks */
  unsigned ln;     /* cached large blocks */
  size_t lsize[POOL_LARGE_CAP]; /* their exact (rounded) sizes; [0] oldest */
  void *lptr[POOL_LARGE_CAP];
  uint16_t n[POOL_NCLASSES];
  void *stack[POOL_NCLASSES][POOL_CLASS_CAP]; /* [0] oldest, [n-1] newest */
};

struct pool_stream {
  _Atomic uintptr_t key;  /* stream key while in the table, 0 while on the free
                             list; written under table_mu (insert, forget) */
  void *stream;           /* the backend stream (written under table_mu before
                             publication; read under table_mu) */
  pthread_mutex_t rec_mu; /* records on this stream with their rec_seq */
  uint64_t rec_seq;       /* (rec_mu) */
  pool_tag_t *lazy;       /* the open lazy tag of this stream, or NULL (mu) */
  _Atomic(pool_shard_t *) shards[POOL_SHARDS]; /* written once, by the CAS of
                             the first thread to use that shard */
  pool_stream_t *next_all;  /* every struct of the pool (table_mu) */
  pool_stream_t *next_free; /* recycled structs (table_mu) */
};

/* Live segments by address: open addressing, linear probing, backward-shift
 * deletion. Under mu. */
typedef struct pool_map {
  pool_seg_t **slots;
  size_t cap;   /* power of two, or 0 */
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
  size_t reserved; /* slab bytes, device_free'd slabs excluded (written under grow_mu and mu) */
  size_t quarantined; /* bytes in quarantined segments (mu) */
  pool_seg_t *root;    /* treap of FREE segments */
  pool_seg_t *pending; /* FREE segments with a tag */
  pool_tag_t *tags;    /* tags with refs > 0 */
  pool_seg_t *unused;  /* descriptor free list */
  size_t nunused;
  pool_map_t map;
  uint32_t rng;
  uint64_t hits, misses, global_locks;
  size_t in_use; /* wraps; summed with the shards' deltas */

  pthread_mutex_t tag_mu;
  pool_tag_t *free_tags; /* tag_mu; each keeps its event */

  pthread_mutex_t aux_mu; /* the internal stream for free_after, and aux_seq */
  void *aux_stream;
  uint64_t aux_seq;
};

/* Round-robin shard index of this thread, 1-based (0: not assigned). */
static _Thread_local unsigned pool_tl_shard;
/* Only its address is used: a key for this thread's cudaStreamPerThread. */
static _Thread_local char pool_tl_anchor;
/* Next shard index to hand out; a counter that publishes nothing (relaxed). */
static _Atomic unsigned pool_shard_counter;

/* ---- sizes ------------------------------------------------------------------ */

static unsigned pool_log2(size_t x) {
  return 63u - (unsigned)__builtin_clzll((unsigned long long)x);
}

/* Rounded size of a request (size <= POOL_MAX_REQUEST) and its class
 * (POOL_NCLASSES for large blocks). */
static size_t pool_round(size_t size, unsigned *cls_out) {
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

static size_t pool_class_size(unsigned c) {
  if (c < 4) return (size_t)(c + 1) * 256;
  unsigned k = 10u + (c - 4u) / 4u;
  return ((size_t)1 << k) + ((size_t)((c - 4u) % 4u) + 1) * ((size_t)1 << (k - 2));
}

size_t dmem__pool_block_size(size_t size) {
  unsigned cls;
  return size > POOL_MAX_REQUEST ? size : pool_round(size, &cls);
}

size_t dmem__pool_seg_bytes(void) { return sizeof(pool_seg_t); }

static unsigned pool_thread_shard(void) {
  unsigned s = pool_tl_shard;
  if (!s) {
    s = dmem_atomic_add_relaxed(&pool_shard_counter, 1) % POOL_SHARDS + 1;
    pool_tl_shard = s;
  }
  return s - 1;
}

static uintptr_t pool_stream_key(const dmem__pool_t *p, void *stream) {
  if (!stream) return 1; /* the default stream (CUDA: cudaStreamLegacy is 0x1 too) */
  if (p->cuda && stream == POOL_CUDA_PER_THREAD_STREAM) return (uintptr_t)&pool_tl_anchor;
  return (uintptr_t)stream;
}

/* ---- tags (mu unless noted) ------------------------------------------------- */

static void pool_tag_ref(pool_tag_t *t) { t->refs++; }

/* Off p->tags and onto the free list (its event kept for the next record). */
static void pool_tag_retire(dmem__pool_t *p, pool_tag_t *t) {
  if (t->prev)
    t->prev->next = t->next;
  else
    p->tags = t->next;
  if (t->next) t->next->prev = t->prev;
  pthread_mutex_lock(&p->tag_mu);
  t->prev = NULL;
  t->next = p->free_tags;
  p->free_tags = t;
  pthread_mutex_unlock(&p->tag_mu);
}

static void pool_tag_unref(dmem__pool_t *p, pool_tag_t *t) {
  if (--t->refs) return;
  /* An open lazy tag stays its stream's (ps->lazy) at zero: the next free
   * there takes it again without touching the free list. */
  if (!t->lazy) pool_tag_retire(p, t);
}

/* Publish a freshly recorded tag (refs 1: the recorder's) on p->tags. */
static void pool_tag_link(dmem__pool_t *p, pool_tag_t *t) {
  t->prev = NULL;
  t->next = p->tags;
  if (p->tags) p->tags->prev = t;
  p->tags = t;
}

/* A tag with its event from the free list, or a new one (event_create). Any
 * pool lock but tag_mu may be held. */
static dmem_status_t pool_tag_obtain(dmem__pool_t *p, pool_tag_t **tag_out) {
  pthread_mutex_lock(&p->tag_mu);
  pool_tag_t *t = p->free_tags;
  if (t) p->free_tags = t->next;
  pthread_mutex_unlock(&p->tag_mu);
  if (!t) {
    t = calloc(1, sizeof *t);
    if (!t) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pool: allocating an event tag failed");
    dmem_status_t st = p->be->event_create(p->be, &t->event);
    if (st != DMEM_OK) {
      free(t);
      return st;
    }
  }
  *tag_out = t;
  return DMEM_OK;
}

/* Record an event on `stream` for blocks freed there before this call. No
 * pool lock held except possibly table_mu; `rec_mu` (NULL: the caller holds
 * the lock that guards *seq, or seq is NULL) orders the record with *seq.
 * The tag comes back private with refs 1; the caller links it under mu. */
static dmem_status_t pool_tag_record(dmem__pool_t *p, pthread_mutex_t *rec_mu, uint64_t *seq,
                                     void *stream, uintptr_t skey, pool_tag_t **tag_out) {
  dmem__backend_t *be = p->be;
  pool_tag_t *t = NULL;
  dmem_status_t obtained = pool_tag_obtain(p, &t);
  if (obtained != DMEM_OK) return obtained;
  if (rec_mu) pthread_mutex_lock(rec_mu);
  dmem_status_t st = be->event_record(be, t->event, stream);
  uint64_t s = 0;
  if (st == DMEM_OK && seq) s = ++*seq;
  if (rec_mu) pthread_mutex_unlock(rec_mu);
  if (st != DMEM_OK) {
    pthread_mutex_lock(&p->tag_mu);
    t->next = p->free_tags;
    p->free_tags = t;
    pthread_mutex_unlock(&p->tag_mu);
    return st;
  }
  t->skey = skey;
  t->seq = s;
  t->refs = 1;
  t->done = false;
  t->lazy = false;
  t->ps = NULL;
  t->stream = NULL;
  t->prev = t->next = NULL;
  *tag_out = t;
  return DMEM_OK;
}

/* mu held. The open lazy tag of ps (stream `stream`), made now if there is
 * none; linked on p->tags with refs 0 (the segments that take it count). */
static dmem_status_t pool_tag_lazy(dmem__pool_t *p, pool_stream_t *ps, void *stream,
                                   pool_tag_t **tag_out) {
  pool_tag_t *t = ps->lazy;
  if (!t) {
    dmem_status_t st = pool_tag_obtain(p, &t);
    if (st != DMEM_OK) return st;
    t->skey = pool_stream_key(p, stream);
    t->seq = 0;
    t->refs = 0;
    t->done = false;
    t->lazy = true;
    t->ps = ps;
    t->stream = stream;
    t->prev = NULL;
    t->next = p->tags;
    if (p->tags) p->tags->prev = t;
    p->tags = t;
    ps->lazy = t;
  }
  *tag_out = t;
  return DMEM_OK;
}

/* mu held; t lazy. Record t's event on its stream now, under the stream's
 * rec_mu and with the next rec_seq: every block freed under t was freed
 * before this call, so the record covers them (and whatever the stream ran
 * since: conservative). t becomes an ordinary tag; the stream's next
 * bypassing free opens a new lazy tag. On failure t stays lazy. */
static dmem_status_t pool_tag_materialise(dmem__pool_t *p, pool_tag_t *t) {
  pool_stream_t *ps = t->ps;
  pthread_mutex_lock(&ps->rec_mu);
  dmem_status_t st = p->be->event_record(p->be, t->event, t->stream);
  if (st == DMEM_OK) t->seq = ++ps->rec_seq;
  pthread_mutex_unlock(&ps->rec_mu);
  if (st != DMEM_OK) return st;
  t->lazy = false;
  t->ps = NULL;
  t->stream = NULL;
  ps->lazy = NULL;
  if (!t->refs) pool_tag_retire(p, t);
  return DMEM_OK;
}

/* mu held; t lazy and refs 0 (nothing carries it): no longer ps's open tag. */
static void pool_tag_close(dmem__pool_t *p, pool_tag_t *t) {
  t->ps->lazy = NULL;
  t->lazy = false;
  t->ps = NULL;
  t->stream = NULL;
  pool_tag_retire(p, t);
}

static bool pool_tag_settled(const pool_tag_t *t) { return !t || t->done; }

/* Whether `stream` (key skey) may use a segment tagged t without waiting.
 * Queries the event once more if needed (never a lazy tag's: it has no
 * record yet). */
static bool pool_usable(dmem__pool_t *p, pool_tag_t *t, uintptr_t skey) {
  if (pool_tag_settled(t)) return true;
  if (t->skey && t->skey == skey) return true;
  if (t->lazy) return false;
  if (p->be->event_query(p->be, t->event) == DMEM_OK) {
    t->done = true;
    return true;
  }
  return false;
}

/* Whether free neighbours with tags a and b may become one segment; *keep is
 * the tag the union must carry (see the header comment). */
static bool pool_tags_mergeable(pool_tag_t *a, pool_tag_t *b, pool_tag_t **keep) {
  if (a && b && a != b && (a->lazy || b->lazy)) {
    /* A lazy range joins only pending work of its own stream: its record,
     * still to come, covers every record already made there. It never
     * joins a settled range, which would tie bytes free for every stream to
     * a record that has not happened yet. */
    pool_tag_t *l = a->lazy ? a : b, *o = a->lazy ? b : a;
    if (o->lazy || o->done || !o->skey || o->skey != l->skey) return false;
    *keep = l;
    return true;
  }
  if ((a && a->lazy) || (b && b->lazy)) {
    if (a != b) return false; /* lazy and settled */
    *keep = a;
    return true;
  }
  if (pool_tag_settled(a) && pool_tag_settled(b)) {
    *keep = NULL;
  } else if (pool_tag_settled(a)) {
    *keep = b;
  } else if (pool_tag_settled(b) || a == b) {
    *keep = a;
  } else if (a->skey && a->skey == b->skey && a->seq && b->seq) {
    *keep = a->seq > b->seq ? a : b;
  } else {
    return false;
  }
  return true;
}

/* ---- the live-segment map (mu) ---------------------------------------------- */

static size_t pool_map_home(const pool_map_t *m, uintptr_t addr) {
  return (size_t)(((uint64_t)addr >> 8) * UINT64_C(0x9E3779B97F4A7C15) >> m->shift);
}

static pool_seg_t *pool_map_find(const pool_map_t *m, uintptr_t addr) {
  if (!m->cap) return NULL;
  size_t mask = m->cap - 1;
  for (size_t i = pool_map_home(m, addr);; i = (i + 1) & mask) {
    pool_seg_t *s = m->slots[i];
    if (!s || s->addr == addr) return s;
  }
}

static void pool_map_put(pool_map_t *m, pool_seg_t *s) {
  size_t mask = m->cap - 1, i = pool_map_home(m, s->addr);
  while (m->slots[i]) i = (i + 1) & mask;
  m->slots[i] = s;
  m->count++;
}

/* Room for one more entry (load at most 1/2). */
static dmem_status_t pool_map_reserve(pool_map_t *m) {
  if ((m->count + 1) * 2 <= m->cap) return DMEM_OK;
  size_t cap = m->cap ? m->cap * 2 : 256;
  pool_seg_t **slots = calloc(cap, sizeof *slots);
  if (!slots)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "pool: growing the block map to %zu slots failed", cap);
  pool_map_t old = *m;
  m->slots = slots;
  m->cap = cap;
  m->shift = 64u - pool_log2(cap);
  m->count = 0;
  for (size_t i = 0; i < old.cap; i++)
    if (old.slots[i]) pool_map_put(m, old.slots[i]);
  free(old.slots);
  return DMEM_OK;
}

static void pool_map_remove(pool_map_t *m, pool_seg_t *s) {
  size_t mask = m->cap - 1, i = pool_map_home(m, s->addr);
  while (m->slots[i] != s) i = (i + 1) & mask;
  for (;;) {
    m->slots[i] = NULL;
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask;
      pool_seg_t *e = m->slots[j];
      if (!e) {
        m->count--;
        return;
      }
      size_t k = pool_map_home(m, e->addr);
      /* e stays if its home lies cyclically in (i, j] */
      bool stay = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (!stay) {
        m->slots[i] = e;
        i = j;
        break;
      }
    }
  }
}

/* ---- the treap of free segments (mu) ---------------------------------------- */

static int pool_key_cmp(const pool_seg_t *s, size_t size, uintptr_t addr) {
  if (s->size != size) return s->size < size ? -1 : 1;
  if (s->addr != addr) return s->addr < addr ? -1 : 1;
  return 0;
}

/* *l gets the keys below (size, addr), *r the others. */
static void pool_treap_split(pool_seg_t *t, size_t size, uintptr_t addr, pool_seg_t **l,
                             pool_seg_t **r) {
  if (!t) {
    *l = *r = NULL;
  } else if (pool_key_cmp(t, size, addr) < 0) {
    pool_treap_split(t->tr, size, addr, &t->tr, r);
    *l = t;
  } else {
    pool_treap_split(t->tl, size, addr, l, &t->tl);
    *r = t;
  }
}

/* Every key of a below every key of b. */
static pool_seg_t *pool_treap_join(pool_seg_t *a, pool_seg_t *b) {
  if (!a) return b;
  if (!b) return a;
  if (a->prio > b->prio) {
    a->tr = pool_treap_join(a->tr, b);
    return a;
  }
  b->tl = pool_treap_join(a, b->tl);
  return b;
}

static pool_seg_t *pool_treap_insert(pool_seg_t *t, pool_seg_t *x) {
  if (!t || x->prio > t->prio) {
    pool_treap_split(t, x->size, x->addr, &x->tl, &x->tr);
    return x;
  }
  if (pool_key_cmp(t, x->size, x->addr) > 0)
    t->tl = pool_treap_insert(t->tl, x);
  else
    t->tr = pool_treap_insert(t->tr, x);
  return t;
}

static pool_seg_t *pool_treap_erase(pool_seg_t *t, pool_seg_t *x) {
  if (!t) return NULL;
  if (t == x) return pool_treap_join(x->tl, x->tr);
  if (pool_key_cmp(t, x->size, x->addr) > 0)
    t->tl = pool_treap_erase(t->tl, x);
  else
    t->tr = pool_treap_erase(t->tr, x);
  return t;
}

/* The smallest key >= (size, addr). */
static pool_seg_t *pool_treap_lower_bound(pool_seg_t *t, size_t size, uintptr_t addr) {
  pool_seg_t *best = NULL;
  while (t) {
    if (pool_key_cmp(t, size, addr) >= 0) {
      best = t;
      t = t->tl;
    } else {
      t = t->tr;
    }
  }
  return best;
}

/* ---- segments (mu) ---------------------------------------------------------- */

static dmem_status_t pool_desc_reserve(dmem__pool_t *p, size_t n) {
  while (p->nunused < n) {
    pool_seg_t *d = calloc(1, sizeof *d);
    if (!d)
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pool: allocating a range descriptor failed");
    p->rng ^= p->rng << 13;
    p->rng ^= p->rng >> 17;
    p->rng ^= p->rng << 5;
    d->prio = p->rng;
    d->state = SEG_UNUSED;
    d->pnext = p->unused;
    p->unused = d;
    p->nunused++;
  }
  return DMEM_OK;
}

/* A descriptor from the free list (reserved beforehand: never fails). */
static pool_seg_t *pool_desc_get(dmem__pool_t *p) {
  pool_seg_t *d = p->unused;
  p->unused = d->pnext;
  p->nunused--;
  uint32_t prio = d->prio;
  memset(d, 0, sizeof *d);
  d->prio = prio;
  return d;
}

static void pool_desc_put(dmem__pool_t *p, pool_seg_t *d) {
  d->state = SEG_UNUSED;
  d->tag = NULL;
  d->pnext = p->unused;
  p->unused = d;
  p->nunused++;
}

/* Enter a FREE segment in the treap (and `pending` if its tag has work). */
static void pool_index(dmem__pool_t *p, pool_seg_t *s) {
  if (s->tag && s->tag->done) {
    pool_tag_unref(p, s->tag);
    s->tag = NULL;
    s->slab->dirty = true; /* neighbours may join it now: next settle pass */
  }
  p->root = pool_treap_insert(p->root, s);
  if (s->tag) {
    s->pprev = NULL;
    s->pnext = p->pending;
    if (p->pending) p->pending->pprev = s;
    p->pending = s;
  }
}

static void pool_unindex(dmem__pool_t *p, pool_seg_t *s) {
  p->root = pool_treap_erase(p->root, s);
  s->tl = s->tr = NULL;
  if (s->tag) {
    if (s->pprev)
      s->pprev->pnext = s->pnext;
    else
      p->pending = s->pnext;
    if (s->pnext) s->pnext->pprev = s->pprev;
    s->pprev = s->pnext = NULL;
  }
}

/* lo absorbs its upper neighbour hi (both unindexed); the union carries keep. */
static void pool_absorb(dmem__pool_t *p, pool_seg_t *lo, pool_seg_t *hi, pool_tag_t *keep) {
  pool_tag_t *lt = lo->tag, *ht = hi->tag;
  if (keep) pool_tag_ref(keep);
  if (lt) pool_tag_unref(p, lt);
  if (ht) pool_tag_unref(p, ht);
  lo->tag = keep;
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  pool_desc_put(p, hi);
}

/* Join unindexed FREE s with mergeable free neighbours; returns the survivor
 * (unindexed). */
static pool_seg_t *pool_coalesce(dmem__pool_t *p, pool_seg_t *s) {
  pool_tag_t *keep;
  pool_seg_t *prev = s->prev;
  if (prev && prev->state == SEG_FREE && pool_tags_mergeable(prev->tag, s->tag, &keep)) {
    pool_unindex(p, prev);
    pool_absorb(p, prev, s, keep);
    s = prev;
  }
  pool_seg_t *next = s->next;
  if (next && next->state == SEG_FREE && pool_tags_mergeable(s->tag, next->tag, &keep)) {
    pool_unindex(p, next);
    pool_absorb(p, s, next, keep);
  }
  return s;
}

/* A LIVE segment becomes FREE, carrying `tag` (NULL: free for all). */
static void pool_release(dmem__pool_t *p, pool_seg_t *s, pool_tag_t *tag) {
  pool_map_remove(&p->map, s);
  s->state = SEG_FREE;
  s->tag = tag;
  if (tag) pool_tag_ref(tag);
  pool_index(p, pool_coalesce(p, s));
}

static void pool_quarantine(dmem__pool_t *p, pool_seg_t *s) {
  pool_map_remove(&p->map, s);
  s->state = SEG_QUARANTINED;
  s->tag = NULL;
  p->quarantined += s->size;
}

/* mu held; t lazy and its event cannot be recorded. Its stream is waited
 * for on the host instead (a failure path only; the pool's mutex stays held
 * meanwhile): then every FREE range carrying t is free for every stream.
 * When even that fails (the stream is gone or the device broken) the
 * ranges are quarantined, since nothing could order their reuse by another
 * stream. Before that wait a single failed record (a transient device
 * error) lost the ranges until destroy. */
static void pool_tag_quarantine(dmem__pool_t *p, pool_tag_t *t) {
  size_t n = 0, bytes = 0;
  bool synced = p->be->stream_synchronize(p->be, t->stream) == DMEM_OK;
  for (pool_seg_t *s = p->pending, *next; s; s = next) {
    next = s->pnext;
    if (s->tag != t) continue;
    pool_unindex(p, s);
    s->tag = NULL;
    pool_tag_unref(p, t); /* stays: lazy */
    if (synced) {
      pool_index(p, s); /* free for all; neighbours join it at the next settle */
      s->slab->dirty = true;
      continue;
    }
    s->state = SEG_QUARANTINED;
    p->quarantined += s->size;
    n++;
    bytes += s->size;
  }
  if (n)
    DMEM_LOG_AT(DMEM_LOG_WARN,
                "pool: no event can be recorded on stream %p (%s): %zu free range(s), %zu "
                "bytes, quarantined",
                t->stream, dmem_last_error_detail(), n, bytes);
}

/* Re-coalesce every segment of a slab (after tags settled). */
static void pool_coalesce_slab(dmem__pool_t *p, pool_slab_t *sl) {
  for (pool_seg_t *s = sl->first; s; s = s->next) {
    if (s->state != SEG_FREE) continue;
    pool_unindex(p, s);
    if (s->tag && s->tag->done) {
      pool_tag_unref(p, s->tag);
      s->tag = NULL;
    }
    pool_tag_t *keep;
    while (s->next && s->next->state == SEG_FREE &&
           pool_tags_mergeable(s->tag, s->next->tag, &keep)) {
      pool_seg_t *n = s->next;
      pool_unindex(p, n);
      pool_absorb(p, s, n, keep);
    }
    pool_index(p, s);
  }
  sl->dirty = false;
}

/* Note completed events (one query per pending tag) and coalesce what they
 * free up. */
static void pool_settle(dmem__pool_t *p) {
  for (pool_tag_t *t = p->tags; t; t = t->next)
    if (!t->done && !t->lazy && p->be->event_query(p->be, t->event) == DMEM_OK) t->done = true;
  for (pool_seg_t *s = p->pending; s; s = s->pnext)
    if (s->tag->done) s->slab->dirty = true;
  for (size_t i = 0; i < p->nslabs; i++)
    if (p->slabs[i]->dirty) pool_coalesce_slab(p, p->slabs[i]);
}

/* ---- taking free ranges (mu) ------------------------------------------------ */

/* Best fit: among the first POOL_FIND_CANDIDATES segments >= need in size
 * order, the first usable now; else the smallest (*wait_out: needs a wait). */
static pool_seg_t *pool_find(dmem__pool_t *p, size_t need, uintptr_t skey, bool *wait_out) {
  pool_seg_t *first = pool_treap_lower_bound(p->root, need, 0), *s = first;
  for (int k = 0; s && k < POOL_FIND_CANDIDATES; k++) {
    if (pool_usable(p, s->tag, skey)) {
      *wait_out = false;
      return s;
    }
    s = pool_treap_lower_bound(p->root, s->size, s->addr + 1);
  }
  *wait_out = true;
  return first;
}

/* Cut the first `need` bytes of FREE (indexed) s into a LIVE segment; map
 * room and one descriptor reserved by the caller. */
static void pool_carve(dmem__pool_t *p, pool_seg_t *s, size_t need) {
  pool_unindex(p, s);
  if (s->size > need) {
    pool_seg_t *r = pool_desc_get(p);
    r->addr = s->addr + need;
    r->size = s->size - need;
    r->slab = s->slab;
    r->state = SEG_FREE;
    r->tag = s->tag;
    if (r->tag) pool_tag_ref(r->tag);
    r->prev = s;
    r->next = s->next;
    if (s->next) s->next->prev = r;
    s->next = r;
    s->size = need;
    pool_index(p, r);
  }
  if (s->tag) pool_tag_unref(p, s->tag);
  s->tag = NULL;
  s->state = SEG_LIVE;
  pool_map_put(&p->map, s);
}

/* Make `stream` wait for the pending work of the ranges tagged t, recording
 * a lazy t on its stream first. When that record fails, t's ranges are
 * quarantined and *dropped set (look for another range). */
static dmem_status_t pool_wait_tag(dmem__pool_t *p, pool_tag_t *t, void *stream, bool *dropped) {
  *dropped = false;
  if (t->lazy && pool_tag_materialise(p, t) != DMEM_OK) {
    pool_tag_quarantine(p, t);
    *dropped = true;
    return DMEM_OK;
  }
  return p->be->stream_wait_event(p->be, stream, t->event);
}

/* DMEM_OK with *ptr_out; DMEM_ERR_OUT_OF_MEMORY when nothing fits (no detail
 * recorded); other statuses recorded where detected. */
static dmem_status_t pool_take(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                               void **ptr_out, bool *ordered) {
  bool wait, dropped;
  pool_seg_t *s;
  do {
    dropped = false;
    s = pool_find(p, need, skey, &wait);
    if (!s) return DMEM_ERR_OUT_OF_MEMORY;
    dmem_status_t st = pool_map_reserve(&p->map);
    if (st == DMEM_OK) st = pool_desc_reserve(p, 1);
    if (st == DMEM_OK && wait) st = pool_wait_tag(p, s->tag, stream, &dropped);
    if (st != DMEM_OK) return st;
  } while (dropped);
  /* `stream` was made to wait, or the block's last use on this same stream
   * may still be pending: either way it is ordered in `stream` only */
  if (!pool_tag_settled(s->tag)) *ordered = true;
  pool_carve(p, s, need);
  *ptr_out = (void *)s->addr;
  return DMEM_OK;
}

/* Length of the run of FREE segments starting at s. */
static size_t pool_run_length(const pool_seg_t *s) {
  size_t n = 0;
  for (; s && s->state == SEG_FREE; s = s->next) n += s->size;
  return n;
}

typedef struct pool_run_ctx {
  size_t need;      /* pool_take_run: the smallest run >= need */
  pool_seg_t *best; /* its first segment */
  size_t best_len;
  size_t largest; /* every visit: the longest run */
} pool_run_ctx_t;

static void pool_visit_runs(pool_seg_t *t, pool_run_ctx_t *c) {
  if (!t) return;
  pool_visit_runs(t->tl, c);
  if (!t->prev || t->prev->state != SEG_FREE) {
    size_t len = pool_run_length(t);
    if (len > c->largest) c->largest = len;
    if (len >= c->need && len < c->best_len) {
      c->best = t;
      c->best_len = len;
    }
  }
  pool_visit_runs(t->tr, c);
}

static size_t pool_largest(dmem__pool_t *p) {
  pool_run_ctx_t c = {SIZE_MAX, NULL, SIZE_MAX, 0};
  pool_visit_runs(p->root, &c);
  return c.largest;
}

/* Serve `need` from a run of adjacent free segments that no single one
 * covers: `stream` waits on every pending foreign event of the segments it
 * takes, then they become one LIVE segment. Statuses as pool_take. */
static dmem_status_t pool_take_run(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                   void **ptr_out, bool *ordered) {
  pool_run_ctx_t c;
  bool dropped;
  do {
    c = (pool_run_ctx_t){need, NULL, SIZE_MAX, 0};
    pool_visit_runs(p->root, &c);
    if (!c.best) return DMEM_ERR_OUT_OF_MEMORY;
    if (c.best->size >= need) return pool_take(p, need, skey, stream, ptr_out, ordered);
    dmem_status_t st = pool_map_reserve(&p->map);
    if (st != DMEM_OK) return st;
    dropped = false;
    size_t covered = 0;
    for (pool_seg_t *q = c.best; covered < need && !dropped; q = q->next) {
      if (!pool_tag_settled(q->tag)) *ordered = true;
      covered += q->size;
      if (!pool_usable(p, q->tag, skey)) {
        st = pool_wait_tag(p, q->tag, stream, &dropped); /* dropped: the run changed */
        if (st != DMEM_OK) return st;
      }
    }
  } while (dropped);
  pool_seg_t *s = c.best;
  pool_unindex(p, s);
  while (s->size < need) {
    pool_seg_t *q = s->next;
    pool_unindex(p, q);
    if (s->size + q->size <= need) {
      pool_absorb(p, s, q, s->tag);
    } else {
      size_t take = need - s->size;
      q->addr += take;
      q->size -= take;
      s->size = need;
      pool_index(p, q);
    }
  }
  if (s->tag) pool_tag_unref(p, s->tag);
  s->tag = NULL;
  s->state = SEG_LIVE;
  pool_map_put(&p->map, s);
  *ptr_out = (void *)s->addr;
  return DMEM_OK;
}

/* ---- slabs ---------------------------------------------------------------- */

static size_t pool_slab_index(const dmem__pool_t *p, uintptr_t addr) {
  /* the number of slabs whose base is <= addr */
  size_t lo = 0, hi = p->nslabs;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (p->slabs[mid]->base <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static void pool_slab_insert(dmem__pool_t *p, pool_slab_t *sl) {
  size_t i = pool_slab_index(p, sl->base);
  memmove(&p->slabs[i + 1], &p->slabs[i], (p->nslabs - i) * sizeof *p->slabs);
  p->slabs[i] = sl;
  p->nslabs++;
}

static void pool_slab_remove(dmem__pool_t *p, pool_slab_t *sl) {
  size_t i = pool_slab_index(p, sl->base) - 1;
  memmove(&p->slabs[i], &p->slabs[i + 1], (p->nslabs - i - 1) * sizeof *p->slabs);
  p->nslabs--;
}

/* grow_mu held, mu not. Add a slab able to hold `need` and take the block
 * from it. With `past_limit`, when no slab fits under the limit, a slab of
 * exactly `need` bytes past it (see dmem__pool_alloc_past_limit).
 * Statuses: DMEM_OK, DMEM_ERR_OUT_OF_MEMORY (not recorded; the backend's
 * detail, if any, is copied into *why), others recorded. */
static dmem_status_t pool_grow(dmem__pool_t *p, size_t need, bool past_limit, void **ptr_out,
                               char *why, size_t why_len) {
  dmem__backend_t *be = p->be;
  pthread_mutex_lock(&p->mu);
  /* reserved passes the limit only after a past_limit slab */
  size_t left = p->reserved < p->limit ? p->limit - p->reserved : 0;
  dmem_status_t st = DMEM_OK;
  if (p->nslabs == p->slabs_cap) {
    size_t cap = p->slabs_cap ? p->slabs_cap * 2 : 16;
    pool_slab_t **a = realloc(p->slabs, cap * sizeof *a);
    if (!a) st = dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pool: growing the slab array failed");
    if (a) {
      p->slabs = a;
      p->slabs_cap = cap;
    }
  }
  pthread_mutex_unlock(&p->mu);
  if (st != DMEM_OK) return st;

  /* Sizes to try, largest first: the geometric one, the request rounded to
   * the slab grain, the request itself; each under what the limit leaves. */
  size_t geo = p->next_geo < left ? p->next_geo : left & ~(POOL_ALIGN - 1);
  size_t grain = need <= SIZE_MAX - POOL_SLAB_GRAIN ? (need + POOL_SLAB_GRAIN - 1) &
                                                         ~(POOL_SLAB_GRAIN - 1)
                                                   : need;
  size_t tries[3];
  int ntries = 0;
  if (geo >= need) tries[ntries++] = geo;
  if (grain <= left && (ntries == 0 || grain < tries[ntries - 1])) tries[ntries++] = grain;
  if (need <= left && (ntries == 0 || need < tries[ntries - 1])) tries[ntries++] = need;
  if (ntries == 0 && past_limit) tries[ntries++] = need;
  if (ntries == 0) {
    snprintf(why, why_len, "the limit of %zu bytes leaves %zu (%zu reserved)", p->limit, left,
             p->reserved);
    return DMEM_ERR_OUT_OF_MEMORY;
  }

  pool_slab_t *sl = malloc(sizeof *sl);
  if (!sl) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pool: allocating a slab record failed");
  void *base = NULL;
  size_t size = 0;
  st = DMEM_ERR_OUT_OF_MEMORY;
  for (int i = 0; i < ntries && st == DMEM_ERR_OUT_OF_MEMORY; i++) {
    size = tries[i];
    st = be->device_alloc(be, size, &base);
  }
  if (st != DMEM_OK) {
    free(sl);
    if (st == DMEM_ERR_OUT_OF_MEMORY)
      snprintf(why, why_len, "backend device_alloc(%zu): %s", size, dmem_last_error_detail());
    return st;
  }

  /* Bookkeeping room now (other threads use the same descriptor and map
   * reserves while mu is released); the slab array is only changed under
   * grow_mu, which we hold. */
  pthread_mutex_lock(&p->mu);
  st = pool_desc_reserve(p, 2);
  if (st == DMEM_OK) st = pool_map_reserve(&p->map);
  if (st != DMEM_OK) {
    pthread_mutex_unlock(&p->mu);
    (void)be->device_free(be, base);
    free(sl);
    return st;
  }
  if (size == geo && geo >= need && p->next_geo <= SIZE_MAX / 2) p->next_geo *= 2;
  sl->base = (uintptr_t)base;
  sl->size = size;
  sl->dirty = false;
  pool_seg_t *s = pool_desc_get(p);
  s->addr = sl->base;
  s->size = size;
  s->slab = sl;
  s->state = SEG_FREE;
  sl->first = s;
  pool_slab_insert(p, sl);
  p->reserved += size;
  p->misses++;
  pool_index(p, s);
  pool_carve(p, s, need);
  pthread_mutex_unlock(&p->mu);
  *ptr_out = base;
  return DMEM_OK;
}

/* ---- stream caches ------------------------------------------------------------ */

static size_t pool_slot_home(uintptr_t key) {
  return (size_t)(((uint64_t)key >> 4) * UINT64_C(0x9E3779B97F4A7C15) >>
                  (64u - POOL_STREAM_SLOT_BITS));
}

/* Lock-free lookup. */
static pool_stream_t *pool_stream_find(dmem__pool_t *p, uintptr_t key) {
  size_t i = pool_slot_home(key);
  for (unsigned n = 0; n < POOL_STREAM_SLOTS; n++, i = (i + 1) & (POOL_STREAM_SLOTS - 1)) {
    /* acquire: partner is the release store in pool_stream_insert, which
     * published the struct's key and stream */
    pool_stream_t *ps = dmem_atomic_load_acquire(&p->slots[i]);
    if (!ps) return NULL;
    if (ps != POOL_TOMB && dmem_atomic_load_relaxed(&ps->key) == key) return ps;
  }
  return NULL;
}

/* The cache struct of a stream, made on first use; NULL when the table is
 * full or host memory ran out (the stream then goes uncached). */
static pool_stream_t *pool_stream_insert(dmem__pool_t *p, uintptr_t key, void *stream) {
  pthread_mutex_lock(&p->table_mu);
  pool_stream_t *ps = pool_stream_find(p, key);
  if (ps || p->live_streams >= POOL_STREAM_MAX) goto out;
  ps = p->free_streams;
  if (ps) {
    p->free_streams = ps->next_free;
  } else {
    ps = calloc(1, sizeof *ps);
    if (!ps) goto out;
    if (pthread_mutex_init(&ps->rec_mu, NULL) != 0) {
      free(ps);
      ps = NULL;
      goto out;
    }
    for (unsigned i = 0; i < POOL_SHARDS; i++) atomic_init(&ps->shards[i], NULL);
    ps->next_all = p->streams;
    p->streams = ps;
  }
  ps->stream = stream;
  dmem_atomic_store_relaxed(&ps->key, key);
  size_t i = pool_slot_home(key);
  for (;;) {
    pool_stream_t *cur = dmem_atomic_load_relaxed(&p->slots[i]); /* writers hold table_mu */
    if (!cur || cur == POOL_TOMB) break;
    i = (i + 1) & (POOL_STREAM_SLOTS - 1);
  }
  /* release: partner is the acquire load in pool_stream_find */
  dmem_atomic_store_release(&p->slots[i], ps);
  p->live_streams++;
out:
  pthread_mutex_unlock(&p->table_mu);
  return ps;
}

static pool_shard_t *pool_shard_install(pool_stream_t *ps, unsigned i) {
  void *mem = NULL;
  if (posix_memalign(&mem, 64, sizeof(pool_shard_t)) != 0) return NULL;
  pool_shard_t *sh = mem;
  memset(sh, 0, sizeof *sh);
  if (pthread_mutex_init(&sh->mu, NULL) != 0) {
    free(sh);
    return NULL;
  }
  pool_shard_t *expected = NULL;
  /* release: publishes the initialised shard; partner is the acquire load in
   * pool_shard_get. On failure the acquire reads the winner's shard. */
  if (!dmem_atomic_cas_strong_acq_rel(&ps->shards[i], &expected, sh)) {
    pthread_mutex_destroy(&sh->mu);
    free(sh);
    return expected;
  }
  return sh;
}

/* The cache struct of `stream`, made on first use; NULL: go uncached. */
static pool_stream_t *pool_stream_get(dmem__pool_t *p, void *stream) {
  if (p->cuda && stream == POOL_CUDA_PER_THREAD_STREAM) return NULL;
  uintptr_t key = pool_stream_key(p, stream);
  pool_stream_t *ps = pool_stream_find(p, key);
  return ps ? ps : pool_stream_insert(p, key, stream);
}

/* This thread's shard of the cache of `stream`; NULL: go uncached
 * (*ps_out is then the stream's struct, or NULL). */
static pool_shard_t *pool_shard_get(dmem__pool_t *p, void *stream, pool_stream_t **ps_out) {
  pool_stream_t *ps = pool_stream_get(p, stream);
  *ps_out = ps;
  if (!ps) return NULL;
  unsigned i = pool_thread_shard();
  /* acquire: partner is the releasing CAS in pool_shard_install */
  pool_shard_t *sh = dmem_atomic_load_acquire(&ps->shards[i]);
  return sh ? sh : pool_shard_install(ps, i);
}

/* Move the oldest k entries of class c out of sh into out (sh->mu held). */
static size_t pool_shard_take_oldest(pool_shard_t *sh, unsigned c, size_t k, void **out) {
  size_t n = sh->n[c];
  if (k > n) k = n;
  memcpy(out, sh->stack[c], k * sizeof *out);
  memmove(sh->stack[c], sh->stack[c] + k, (n - k) * sizeof *out);
  sh->n[c] = (uint16_t)(n - k);
  sh->bytes -= k * pool_class_size(c);
  return k;
}

/* Make room in sh for a block of class cls (rsize bytes): the oldest half of
 * a full class, then the oldest of the largest classes while over the byte
 * bound. Returns how many entries went to out (<= POOL_FLUSH_BATCH). */
static size_t pool_shard_evict(const dmem__pool_t *p, pool_shard_t *sh, unsigned cls, size_t rsize,
                               void **out) {
  size_t n = 0;
  if (sh->n[cls] >= POOL_CLASS_CAP) n += pool_shard_take_oldest(sh, cls, POOL_CLASS_CAP / 2, out);
  for (unsigned c = POOL_NCLASSES; c-- > 0 && sh->bytes + rsize > p->cache_bytes &&
                                   n < POOL_FLUSH_BATCH;) {
    size_t csize = pool_class_size(c);
    size_t over = sh->bytes + rsize - p->cache_bytes;
    size_t k = (over + csize - 1) / csize;
    if (k > POOL_FLUSH_BATCH - n) k = POOL_FLUSH_BATCH - n;
    n += pool_shard_take_oldest(sh, c, k, out + n);
  }
  return n;
}

/* Large cache of sh (sh->mu held). The newest cached block of exactly
 * `rsize` bytes, taken out; NULL if none. */
static void *pool_shard_pop_large(pool_shard_t *sh, size_t rsize) {
  for (unsigned i = sh->ln; i-- > 0;) {
    if (sh->lsize[i] != rsize) continue;
    void *ptr = sh->lptr[i];
    unsigned n = --sh->ln;
    memmove(&sh->lsize[i], &sh->lsize[i + 1], (n - i) * sizeof *sh->lsize);
    memmove(&sh->lptr[i], &sh->lptr[i + 1], (n - i) * sizeof *sh->lptr);
    sh->lbytes -= rsize;
    return ptr;
  }
  return NULL;
}

/* Move the oldest k large entries of sh out into out (sh->mu held). */
static size_t pool_shard_take_large(pool_shard_t *sh, size_t k, void **out) {
  unsigned n = sh->ln;
  if (k > n) k = n;
  for (size_t i = 0; i < k; i++) {
    out[i] = sh->lptr[i];
    sh->lbytes -= sh->lsize[i];
  }
  memmove(sh->lsize, sh->lsize + k, (n - k) * sizeof *sh->lsize);
  memmove(sh->lptr, sh->lptr + k, (n - k) * sizeof *sh->lptr);
  sh->ln = n - (unsigned)k;
  return k;
}

/* Push a large block of rsize (<= large_cache_bytes) bytes on sh (sh->mu
 * held), after moving the oldest entries to out while the count or the byte
 * bound would be passed. Returns how many went to out (<= POOL_LARGE_CAP). */
static size_t pool_shard_push_large(const dmem__pool_t *p, pool_shard_t *sh, void *ptr,
                                    size_t rsize, void **out) {
  size_t k = 0, gone = 0;
  while (k < sh->ln &&
         (sh->ln - k >= POOL_LARGE_CAP || sh->lbytes - gone + rsize > p->large_cache_bytes))
    gone += sh->lsize[k++];
  size_t n = pool_shard_take_large(sh, k, out);
  sh->lsize[sh->ln] = rsize;
  sh->lptr[sh->ln] = ptr;
  sh->ln++;
  sh->lbytes += rsize;
  return n;
}

/* Blocks freed on `stream` whose reuse no event could order (recording
 * failed): wait for the stream on the host (a failure path only) and free
 * them for every stream; when even that fails (the stream is gone or the
 * device lost) they are quarantined until destroy. No pool lock held but
 * possibly table_mu. */
static void pool_release_synced(dmem__pool_t *p, void *stream, void *const *ptrs, size_t n) {
  dmem_status_t st = p->be->stream_synchronize(p->be, stream);
  size_t lost = 0;
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < n; i++) {
    pool_seg_t *s = pool_map_find(&p->map, (uintptr_t)ptrs[i]);
    if (!s) continue; /* logged by the caller */
    if (st == DMEM_OK) {
      pool_release(p, s, NULL);
    } else {
      pool_quarantine(p, s);
      lost++;
    }
  }
  pthread_mutex_unlock(&p->mu);
  if (lost)
    DMEM_LOG_AT(DMEM_LOG_WARN, "pool: no event for %zu freed block(s) (%s): quarantined", lost,
                dmem_last_error_detail());
}

/* Hand blocks freed on `stream` (ps: its cache struct, or NULL) to the
 * global structure under one event recorded now. in_use_dec: bytes to take
 * off the global in_use (frees that bypass the caches). No lock held except
 * possibly table_mu. */
static void pool_give_back(dmem__pool_t *p, pool_stream_t *ps, void *stream, void *const *ptrs,
                           size_t n, size_t in_use_dec) {
  pool_tag_t *tag = NULL;
  dmem_status_t st = pool_tag_record(p, ps ? &ps->rec_mu : NULL, ps ? &ps->rec_seq : NULL, stream,
                                     pool_stream_key(p, stream), &tag);
  pthread_mutex_lock(&p->mu);
  p->global_locks++;
  p->in_use -= in_use_dec;
  if (tag) pool_tag_link(p, tag);
  for (size_t i = 0; i < n; i++) {
    pool_seg_t *s = pool_map_find(&p->map, (uintptr_t)ptrs[i]);
    if (!s)
      DMEM_LOG_AT(DMEM_LOG_ERROR, "pool: free of %p, which is not a live block: ignored", ptrs[i]);
    else if (st == DMEM_OK)
      pool_release(p, s, tag);
  }
  if (tag) pool_tag_unref(p, tag);
  pthread_mutex_unlock(&p->mu);
  if (st != DMEM_OK) pool_release_synced(p, stream, ptrs, n);
}

/* Blocks freed on a stream with a cache struct that do not go to (or leave)
 * a cache: they join the free ranges under the stream's open lazy tag,
 * recording nothing (see the header comment). in_use_dec as in
 * pool_give_back. No lock held except possibly table_mu. */
static void pool_free_lazy(dmem__pool_t *p, pool_stream_t *ps, void *stream, void *const *ptrs,
                           size_t n, size_t in_use_dec) {
  pool_tag_t *tag = NULL;
  dmem_status_t st = DMEM_OK;
  size_t failed_from = n; /* blocks from here on got no tag */
  pthread_mutex_lock(&p->mu);
  p->global_locks++;
  p->in_use -= in_use_dec;
  for (size_t i = 0; i < n; i++) {
    pool_seg_t *s = pool_map_find(&p->map, (uintptr_t)ptrs[i]);
    if (!s) {
      DMEM_LOG_AT(DMEM_LOG_ERROR, "pool: free of %p, which is not a live block: ignored", ptrs[i]);
      continue;
    }
    if (st == DMEM_OK) st = pool_tag_lazy(p, ps, stream, &tag);
    if (st == DMEM_OK) {
      pool_release(p, s, tag);
    } else {
      failed_from = i;
      break;
    }
  }
  pthread_mutex_unlock(&p->mu);
  if (failed_from < n) pool_release_synced(p, stream, ptrs + failed_from, n - failed_from);
}

/* Empty one shard into the global structure: small blocks under one event
 * per batch, and (if `large`) large ones under the stream's lazy tag. */
static void pool_flush_shard(dmem__pool_t *p, pool_stream_t *ps, void *stream, pool_shard_t *sh,
                             bool large) {
  void *batch[POOL_FLUSH_BATCH], *lbatch[POOL_LARGE_CAP];
  for (;;) {
    size_t n = 0, nl = 0;
    pthread_mutex_lock(&sh->mu);
    for (unsigned c = 0; c < POOL_NCLASSES && n < POOL_FLUSH_BATCH; c++)
      n += pool_shard_take_oldest(sh, c, POOL_FLUSH_BATCH - n, batch + n);
    if (large) nl = pool_shard_take_large(sh, POOL_LARGE_CAP, lbatch);
    pthread_mutex_unlock(&sh->mu);
    if (nl) pool_free_lazy(p, ps, stream, lbatch, nl, 0);
    if (n) pool_give_back(p, ps, stream, batch, n, 0);
    if (!n && !nl) return;
  }
}

/* table_mu held. */
static void pool_flush_stream(dmem__pool_t *p, pool_stream_t *ps, bool large) {
  for (unsigned i = 0; i < POOL_SHARDS; i++) {
    /* acquire: partner is the releasing CAS in pool_shard_install */
    pool_shard_t *sh = dmem_atomic_load_acquire(&ps->shards[i]);
    if (sh) pool_flush_shard(p, ps, ps->stream, sh, large);
  }
}

/* Every stream's caches: the small ones, and the large ones if `large`. */
static void pool_flush_all(dmem__pool_t *p, bool large) {
  pthread_mutex_lock(&p->table_mu);
  for (pool_stream_t *ps = p->streams; ps; ps = ps->next_all)
    if (dmem_atomic_load_relaxed(&ps->key)) /* key: table_mu held */
      pool_flush_stream(p, ps, large);
  pthread_mutex_unlock(&p->table_mu);
}

void dmem__pool_flush(dmem__pool_t *p) {
  if (p) pool_flush_all(p, true);
}

void dmem__pool_stream_forget(dmem__pool_t *p, void *stream) {
  if (!p || !stream) return;
  uintptr_t key = pool_stream_key(p, stream);
  pthread_mutex_lock(&p->table_mu);
  size_t i = pool_slot_home(key);
  for (unsigned n = 0; n < POOL_STREAM_SLOTS; n++, i = (i + 1) & (POOL_STREAM_SLOTS - 1)) {
    pool_stream_t *ps = dmem_atomic_load_relaxed(&p->slots[i]); /* writers hold table_mu */
    if (!ps) break;
    if (ps == POOL_TOMB || dmem_atomic_load_relaxed(&ps->key) != key) continue;
    pool_flush_stream(p, ps, true);
    /* Record the event of its lazily freed blocks (cached large ones
     * included, just flushed) while the stream exists. */
    pthread_mutex_lock(&p->mu);
    pool_tag_t *t = ps->lazy;
    if (t && t->refs && pool_tag_materialise(p, t) != DMEM_OK) pool_tag_quarantine(p, t);
    if (ps->lazy) pool_tag_close(p, ps->lazy); /* nothing carries it now */
    pthread_mutex_unlock(&p->mu);
    /* release: pairs with the acquire in pool_stream_find (nothing else is
     * published by a tombstone; release keeps every slot store alike) */
    dmem_atomic_store_release(&p->slots[i], POOL_TOMB);
    dmem_atomic_store_relaxed(&ps->key, 0);
    ps->stream = NULL;
    ps->next_free = p->free_streams;
    p->free_streams = ps;
    p->live_streams--;
    break;
  }
  /* Events recorded on the old stream no longer mean "same stream". */
  pthread_mutex_lock(&p->mu);
  for (pool_tag_t *t = p->tags; t; t = t->next)
    if (t->skey == key) t->skey = 0;
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->table_mu);
}

/* ---- alloc and free ------------------------------------------------------------ */

/* Everything after a cache miss. */
/* Under mu: take `need` bytes (after noting completed events when `settle`;
 * from runs of neighbours too when `runs`), counting a hit. */
static dmem_status_t pool_take_counted(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                      void **ptr, bool *ordered, bool settle, bool runs) {
  if (settle) pool_settle(p);
  dmem_status_t st = pool_take(p, need, skey, stream, ptr, ordered);
  if (st == DMEM_ERR_OUT_OF_MEMORY && runs) st = pool_take_run(p, need, skey, stream, ptr, ordered);
  if (st == DMEM_OK) {
    p->hits++;
    p->in_use += need;
  }
  return st;
}

static dmem_status_t pool_alloc_slow(dmem__pool_t *p, size_t need, void *stream, void **ptr_out,
                                     size_t *largest_out, bool *ordered, bool past_limit) {
  uintptr_t skey = pool_stream_key(p, stream);
  void *ptr = NULL;

  pthread_mutex_lock(&p->mu);
  p->global_locks++;
  dmem_status_t st = pool_take_counted(p, need, skey, stream, &ptr, ordered, false, false);
  if (st == DMEM_ERR_OUT_OF_MEMORY)
    st = pool_take_counted(p, need, skey, stream, &ptr, ordered, true, false);
  pthread_mutex_unlock(&p->mu);

  if (st == DMEM_ERR_OUT_OF_MEMORY) {
    /* Small caches before a new slab; large ones only before failing (below):
     * flushing them whenever a slab could be added would let a few blocks
     * pass from thread to thread, each theft flushing every cache, instead
     * of the pool growing once to the working set. */
    pool_flush_all(p, false);
    pthread_mutex_lock(&p->mu);
    st = pool_take_counted(p, need, skey, stream, &ptr, ordered, true, true);
    pthread_mutex_unlock(&p->mu);
  }

  char why[384] = "";
  if (st == DMEM_ERR_OUT_OF_MEMORY) {
    pthread_mutex_lock(&p->grow_mu);
    /* Another thread may have grown the pool or freed blocks meanwhile. */
    pthread_mutex_lock(&p->mu);
    st = pool_take_counted(p, need, skey, stream, &ptr, ordered, false, false);
    pthread_mutex_unlock(&p->mu);
    if (st == DMEM_ERR_OUT_OF_MEMORY) {
      st = pool_grow(p, need, false, &ptr, why, sizeof why);
      if (st == DMEM_OK) {
        pthread_mutex_lock(&p->mu);
        p->in_use += need;
        pthread_mutex_unlock(&p->mu);
      }
    }
    pthread_mutex_unlock(&p->grow_mu);
  }

  if (st == DMEM_ERR_OUT_OF_MEMORY) {
    /* Every cache, large blocks included, and frees that landed while the
     * slab allocation failed: no failure while the bytes sit in a cache. */
    pool_flush_all(p, true);
    pthread_mutex_lock(&p->mu);
    st = pool_take_counted(p, need, skey, stream, &ptr, ordered, true, true);
    size_t largest = pool_largest(p), reserved = p->reserved;
    pthread_mutex_unlock(&p->mu);
    if (st == DMEM_ERR_OUT_OF_MEMORY && past_limit) {
      /* Nothing cached fits either: a slab past the limit (the caller
       * keeps the live bytes under it). */
      pthread_mutex_lock(&p->grow_mu);
      st = pool_grow(p, need, true, &ptr, why, sizeof why);
      if (st == DMEM_OK) {
        pthread_mutex_lock(&p->mu);
        p->in_use += need;
        pthread_mutex_unlock(&p->mu);
      }
      pthread_mutex_unlock(&p->grow_mu);
    }
    if (st == DMEM_ERR_OUT_OF_MEMORY) {
      if (largest_out) *largest_out = largest;
      return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                         "pool: no free range of %zu bytes (largest %zu, %zu of %zu bytes "
                         "reserved) and no slab can be added: %s",
                         need, largest, reserved, p->limit, why);
    }
  }
  if (st != DMEM_OK) return st;
  *ptr_out = ptr;
  return DMEM_OK;
}

static dmem_status_t pool_alloc(dmem__pool_t *p, size_t size, void *stream, void **ptr_out,
                                size_t *largest_free_out, bool *ordered, bool past_limit) {
  if (!p || !ptr_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem__pool_alloc: %s NULL",
                       p ? "ptr_out" : "pool");
  if (size > POOL_MAX_REQUEST || size > p->limit) {
    if (largest_free_out) *largest_free_out = dmem__pool_largest_free(p);
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "pool: %zu bytes exceed the pool limit of %zu", size,
                       p->limit);
  }
  unsigned cls;
  size_t rsize = pool_round(size, &cls);
  if (cls < POOL_NCLASSES || rsize <= p->large_cache_bytes) {
    pool_stream_t *ps = NULL;
    pool_shard_t *sh = pool_shard_get(p, stream, &ps);
    if (sh) {
      void *ptr = NULL;
      pthread_mutex_lock(&sh->mu);
      if (cls == POOL_NCLASSES) {
        ptr = pool_shard_pop_large(sh, rsize);
      } else if (sh->n[cls]) {
        ptr = sh->stack[cls][--sh->n[cls]];
        sh->bytes -= rsize;
      }
      if (ptr) {
        sh->hits++;
        sh->in_use += rsize;
      }
      pthread_mutex_unlock(&sh->mu);
      if (ptr) {
        *ptr_out = ptr;
        *ordered = true; /* freed on this stream: its last use may be pending */
        return DMEM_OK;
      }
    }
  }
  return pool_alloc_slow(p, rsize, stream, ptr_out, largest_free_out, ordered, past_limit);
}

dmem_status_t dmem__pool_alloc_ex(dmem__pool_t *p, size_t size, void *stream, void **ptr_out,
                                  size_t *largest_free_out) {
  bool ordered = false;
  return pool_alloc(p, size, stream, ptr_out, largest_free_out, &ordered, false);
}

dmem_status_t dmem__pool_alloc_ordered(dmem__pool_t *p, size_t size, void *stream, void **ptr_out,
                                       bool *ordered_out) {
  bool ordered = false;
  dmem_status_t st = pool_alloc(p, size, stream, ptr_out, NULL, &ordered, false);
  if (st == DMEM_OK && ordered_out) *ordered_out = ordered;
  return st;
}

dmem_status_t dmem__pool_alloc_past_limit(dmem__pool_t *p, size_t size, void *stream,
                                          void **ptr_out, bool *ordered_out) {
  bool ordered = false;
  dmem_status_t st = pool_alloc(p, size, stream, ptr_out, NULL, &ordered, true);
  if (st == DMEM_OK && ordered_out) *ordered_out = ordered;
  return st;
}

dmem_status_t dmem__pool_alloc(dmem__pool_t *p, size_t size, void *stream, void **ptr_out) {
  bool ordered = false;
  return pool_alloc(p, size, stream, ptr_out, NULL, &ordered, false);
}

void dmem__pool_free(dmem__pool_t *p, void *ptr, size_t size, void *stream) {
  if (!p || !ptr) return;
  unsigned cls = POOL_NCLASSES;
  size_t rsize = size > POOL_MAX_REQUEST ? size : pool_round(size, &cls);
  pool_stream_t *ps = NULL;
  if (cls < POOL_NCLASSES ? rsize <= p->cache_bytes : rsize <= p->large_cache_bytes) {
    pool_shard_t *sh = pool_shard_get(p, stream, &ps);
    if (sh) {
      void *out[POOL_FLUSH_BATCH + 1];
      size_t nout = 0;
      pthread_mutex_lock(&sh->mu);
      sh->in_use -= rsize;
      if (cls == POOL_NCLASSES) {
        nout = pool_shard_push_large(p, sh, ptr, rsize, out);
      } else {
        if (sh->n[cls] >= POOL_CLASS_CAP || sh->bytes + rsize > p->cache_bytes)
          nout = pool_shard_evict(p, sh, cls, rsize, out);
        if (sh->n[cls] < POOL_CLASS_CAP && sh->bytes + rsize <= p->cache_bytes) {
          sh->stack[cls][sh->n[cls]++] = ptr;
          sh->bytes += rsize;
        } else {
          out[nout++] = ptr; /* the bound could not be met: this one goes too */
        }
      }
      pthread_mutex_unlock(&sh->mu);
      if (nout && cls == POOL_NCLASSES)
        pool_free_lazy(p, ps, stream, out, nout, 0); /* large overflow: no event now */
      else if (nout)
        pool_give_back(p, ps, stream, out, nout, 0);
      return;
    }
  } else {
    ps = pool_stream_get(p, stream);
  }
  if (ps)
    pool_free_lazy(p, ps, stream, &ptr, 1, rsize); /* no event now */
  else
    pool_give_back(p, NULL, stream, &ptr, 1, rsize); /* uncached stream: an event now */
}

void dmem__pool_free_after(dmem__pool_t *p, void *ptr, size_t size, void *event) {
  dmem__pool_free_after_n(p, &ptr, &size, 1, event);
}

void dmem__pool_free_after_n(dmem__pool_t *p, void *const *ptrs, const size_t *sizes, size_t n,
                             void *event) {
  if (!p || n == 0) return;
  dmem__backend_t *be = p->be;
  size_t rsize = 0;
  for (size_t i = 0; i < n; i++)
    if (ptrs[i]) rsize += dmem__pool_block_size(sizes[i]);
  pool_tag_t *tag = NULL;
  dmem_status_t st = event ? be->event_query(be, event) : DMEM_OK;
  bool settled = st == DMEM_OK;
  if (st == DMEM_ERR_BUSY) {
    pthread_mutex_lock(&p->aux_mu);
    st = p->aux_stream ? DMEM_OK : be->stream_create(be, &p->aux_stream);
    if (st == DMEM_OK) st = be->stream_wait_event(be, p->aux_stream, event);
    /* aux_mu guards aux_seq: no separate record mutex */
    if (st == DMEM_OK)
      st = pool_tag_record(p, NULL, &p->aux_seq, p->aux_stream, (uintptr_t)p->aux_stream, &tag);
    pthread_mutex_unlock(&p->aux_mu);
  }
  if (!settled && st != DMEM_OK && event) {
    /* No event of the pool's could order the reuse: wait for the caller's
     * on the host (a failure path only). Before that wait one transient
     * failure lost the block until destroy. */
    settled = be->event_synchronize(be, event) == DMEM_OK;
  }
  size_t lost = 0;
  void *lost_ptr = NULL;
  pthread_mutex_lock(&p->mu);
  p->global_locks++;
  p->in_use -= rsize;
  if (tag) pool_tag_link(p, tag);
  for (size_t i = 0; i < n; i++) {
    if (!ptrs[i]) continue;
    pool_seg_t *s = pool_map_find(&p->map, (uintptr_t)ptrs[i]);
    if (!s) {
      DMEM_LOG_AT(DMEM_LOG_ERROR, "pool: free of %p, which is not a live block: ignored",
                  ptrs[i]);
    } else if (settled || st == DMEM_OK) {
      pool_release(p, s, tag);
    } else {
      pool_quarantine(p, s);
      if (!lost++) lost_ptr = ptrs[i];
    }
  }
  if (tag) pool_tag_unref(p, tag);
  pthread_mutex_unlock(&p->mu);
  if (lost)
    DMEM_LOG_AT(DMEM_LOG_WARN,
                "pool: cannot order the reuse of %zu block(s) (%p, ...) after event %p (%s): "
                "quarantined",
                lost, lost_ptr, event, dmem_last_error_detail());
}

/* ---- queries ---------------------------------------------------------------- */

size_t dmem__pool_range_if_freed(dmem__pool_t *p, void *ptr, size_t size) {
  (void)size; /* the segment's own size is authoritative */
  if (!p || !ptr) return 0;
  pthread_mutex_lock(&p->mu);
  size_t n = 0;
  pool_seg_t *s = pool_map_find(&p->map, (uintptr_t)ptr);
  if (s) {
    n = s->size;
    for (pool_seg_t *q = s->prev; q && q->state == SEG_FREE; q = q->prev) n += q->size;
    for (pool_seg_t *q = s->next; q && q->state == SEG_FREE; q = q->next) n += q->size;
  }
  pthread_mutex_unlock(&p->mu);
  return n;
}

size_t dmem__pool_largest_free(dmem__pool_t *p) {
  if (!p) return 0;
  pthread_mutex_lock(&p->mu);
  size_t n = pool_largest(p);
  pthread_mutex_unlock(&p->mu);
  return n;
}

int dmem__pool_fits(dmem__pool_t *p, size_t size, void *stream) {
  if (!p || size > POOL_MAX_REQUEST) return 0;
  unsigned cls;
  size_t rsize = pool_round(size, &cls);
  if (cls < POOL_NCLASSES || rsize <= p->large_cache_bytes) {
    pool_stream_t *ps = NULL;
    pool_shard_t *sh = pool_shard_get(p, stream, &ps);
    if (sh) {
      bool hit = false;
      pthread_mutex_lock(&sh->mu);
      if (cls < POOL_NCLASSES) {
        hit = sh->n[cls] != 0;
      } else {
        for (unsigned i = 0; i < sh->ln && !hit; i++) hit = sh->lsize[i] == rsize;
      }
      pthread_mutex_unlock(&sh->mu);
      if (hit) return 1;
    }
  }
  return dmem__pool_largest_free(p) >= rsize;
}

dmem_status_t dmem__pool_slab_of(dmem__pool_t *p, const void *ptr, void **slab_base_out,
                                 size_t *offset_out) {
  if (!p || !slab_base_out || !offset_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem__pool_slab_of: NULL argument");
  uintptr_t a = (uintptr_t)ptr;
  pthread_mutex_lock(&p->mu);
  size_t i = pool_slab_index(p, a);
  pool_slab_t *sl = i ? p->slabs[i - 1] : NULL;
  uintptr_t base = 0;
  if (sl && a - sl->base < sl->size) base = sl->base;
  pthread_mutex_unlock(&p->mu);
  if (!base)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "pool: %p is in no slab of the pool", ptr);
  *slab_base_out = (void *)base;
  *offset_out = a - base;
  return DMEM_OK;
}

void dmem__pool_stats(dmem__pool_t *p, dmem__pool_stats_t *out) {
  if (!p || !out) return;
  dmem__pool_stats_t s;
  memset(&s, 0, sizeof s);
  pthread_mutex_lock(&p->mu);
  s.reserved = p->reserved;
  s.quarantined = p->quarantined;
  s.in_use = p->in_use;
  s.hits = p->hits;
  s.misses = p->misses;
  s.slabs = p->nslabs;
  s.global_locks = p->global_locks;
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_lock(&p->table_mu);
  for (pool_stream_t *ps = p->streams; ps; ps = ps->next_all) {
    for (unsigned i = 0; i < POOL_SHARDS; i++) {
      /* acquire: partner is the releasing CAS in pool_shard_install */
      pool_shard_t *sh = dmem_atomic_load_acquire(&ps->shards[i]);
      if (!sh) continue;
      pthread_mutex_lock(&sh->mu);
      s.in_use += sh->in_use;
      s.hits += sh->hits;
      s.cached += sh->bytes + sh->lbytes;
      pthread_mutex_unlock(&sh->mu);
    }
  }
  pthread_mutex_unlock(&p->table_mu);
  *out = s;
}

/* ---- trim, create, destroy -------------------------------------------------- */

#define POOL_TRIM_WAIT_MAX 64
/* Rounds of waiting when more tags are pending than one round holds (other
 * threads may keep freeing meanwhile: trim does not chase them forever). */
#define POOL_TRIM_PASSES 16

/* Take a reference on each distinct pending tag of the slabs that hold
 * nothing but free ranges (at most POOL_TRIM_WAIT_MAX; the caller comes back
 * for the rest). Lazy tags there are recorded first, all of them: a lazy tag
 * never settles on its own, so one left unrecorded would keep its slab. */
static size_t pool_trim_pending(dmem__pool_t *p, pool_tag_t **out) {
  size_t n = 0;
  for (size_t i = 0; i < p->nslabs; i++) {
    pool_seg_t *s = p->slabs[i]->first;
    while (s && s->state == SEG_FREE) s = s->next;
    if (s) continue; /* a live or quarantined block */
    for (s = p->slabs[i]->first; s; s = s->next) {
      if (pool_tag_settled(s->tag)) continue;
      /* on failure the slab stays */
      if (s->tag->lazy && pool_tag_materialise(p, s->tag) != DMEM_OK) continue;
      if (n == POOL_TRIM_WAIT_MAX) continue;
      size_t j = 0;
      while (j < n && out[j] != s->tag) j++;
      if (j < n) continue;
      pool_tag_ref(s->tag);
      out[n++] = s->tag;
    }
  }
  return n;
}

dmem_status_t dmem__pool_trim(dmem__pool_t *p, size_t keep, size_t *released_out) {
  if (!p) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem__pool_trim: pool NULL");
  dmem__pool_flush(p);

  /* Slabs that are empty but for pending frees: wait for those events (no
   * pool lock held; giving a slab back, cudaFree, synchronises the device
   * anyway). The tags' references keep their events from being recycled. */
  pool_tag_t *wait[POOL_TRIM_WAIT_MAX];
  for (int pass = 0; pass < POOL_TRIM_PASSES; pass++) {
    pthread_mutex_lock(&p->mu);
    pool_settle(p); /* completed tags do not take a place in `wait` */
    size_t nwait = p->reserved > keep ? pool_trim_pending(p, wait) : 0;
    pthread_mutex_unlock(&p->mu);
    if (!nwait) break;
    for (size_t i = 0; i < nwait; i++) (void)p->be->event_synchronize(p->be, wait[i]->event);
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < nwait; i++) pool_tag_unref(p, wait[i]);
    pthread_mutex_unlock(&p->mu);
    if (nwait < POOL_TRIM_WAIT_MAX) break; /* every pending tag was waited for */
  }

  size_t released = 0;
  dmem_status_t st = DMEM_OK;
  pthread_mutex_lock(&p->grow_mu);
  for (;;) {
    pthread_mutex_lock(&p->mu);
    pool_settle(p);
    pool_slab_t *victim = NULL;
    for (size_t i = 0; p->reserved > keep && i < p->nslabs; i++) {
      pool_slab_t *sl = p->slabs[i];
      pool_seg_t *s = sl->first;
      if (s->state == SEG_FREE && s->size == sl->size && !s->tag &&
          (!victim || sl->size > victim->size))
        victim = sl;
    }
    if (!victim) {
      pthread_mutex_unlock(&p->mu);
      break;
    }
    /* Out of reach of allocations, still counted until device_free returns
     * (so a concurrent grow never passes the limit). */
    pool_unindex(p, victim->first);
    pool_slab_remove(p, victim);
    pthread_mutex_unlock(&p->mu);
    st = p->be->device_free(p->be, (void *)victim->base);
    pthread_mutex_lock(&p->mu);
    if (st != DMEM_OK) {
      pool_slab_insert(p, victim); /* room: it was just removed */
      pool_index(p, victim->first);
      pthread_mutex_unlock(&p->mu);
      break;
    }
    p->reserved -= victim->size;
    released += victim->size;
    pool_desc_put(p, victim->first);
    free(victim);
    if (p->reserved == 0) p->next_geo = p->min_slab;
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&p->grow_mu);
  if (st != DMEM_OK) return st;
  if (released_out) *released_out = released;
  return DMEM_OK;
}

dmem_status_t dmem__pool_create(dmem__backend_t *be, size_t limit, size_t min_slab,
                                dmem__pool_t **pool_out) {
  if (!be || !pool_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem__pool_create: %s NULL",
                       be ? "pool_out" : "backend");
  dmem__pool_t *p = calloc(1, sizeof *p);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "dmem__pool_create: calloc failed");
  int rc = pthread_mutex_init(&p->table_mu, NULL);
  if (rc != 0) goto fail_free;
  rc = pthread_mutex_init(&p->grow_mu, NULL);
  if (rc != 0) goto fail_table_mu;
  rc = pthread_mutex_init(&p->mu, NULL);
  if (rc != 0) goto fail_grow_mu;
  rc = pthread_mutex_init(&p->tag_mu, NULL);
  if (rc != 0) goto fail_mu;
  rc = pthread_mutex_init(&p->aux_mu, NULL);
  if (rc != 0) goto fail_tag_mu;

  p->be = be;
  p->cuda = be->kind == DMEM_BACKEND_CUDA;
  p->limit = (limit ? limit : be->device_capacity) & ~(POOL_ALIGN - 1);
  if (!min_slab) min_slab = POOL_DEFAULT_MIN_SLAB;
  p->min_slab = min_slab <= SIZE_MAX - POOL_ALIGN ? (min_slab + POOL_ALIGN - 1) & ~(POOL_ALIGN - 1)
                                                  : SIZE_MAX & ~(POOL_ALIGN - 1);
  p->next_geo = p->min_slab;
  size_t cb = p->limit / 64;
  p->cache_bytes = cb < POOL_CACHE_MIN ? POOL_CACHE_MIN : cb > POOL_CACHE_MAX ? POOL_CACHE_MAX : cb;
  p->large_cache_bytes = p->limit / POOL_LARGE_DIV; /* <= POOL_SMALL_MAX: no large caching */
  p->rng = 0x9E3779B9u;
  for (unsigned i = 0; i < POOL_STREAM_SLOTS; i++) atomic_init(&p->slots[i], NULL);
  *pool_out = p;
  return DMEM_OK;

fail_tag_mu:
  pthread_mutex_destroy(&p->tag_mu);
fail_mu:
  pthread_mutex_destroy(&p->mu);
fail_grow_mu:
  pthread_mutex_destroy(&p->grow_mu);
fail_table_mu:
  pthread_mutex_destroy(&p->table_mu);
fail_free:
  free(p);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "dmem__pool_create: pthread_mutex_init: %s",
                     strerror(rc));
}

static void pool_tag_destroy(dmem__backend_t *be, pool_tag_t *t) {
  (void)be->event_synchronize(be, t->event);
  (void)be->event_destroy(be, t->event);
  free(t);
}

void dmem__pool_destroy(dmem__pool_t *p) {
  if (!p) return;
  dmem__backend_t *be = p->be;
  /* Cached large blocks join the free ranges under their streams' lazy
   * tags (as uncached large frees would have), so that their last uses are
   * waited for too. Forgotten streams have empty caches. */
  for (pool_stream_t *ps = p->streams; ps; ps = ps->next_all) {
    if (!dmem_atomic_load_relaxed(&ps->key)) continue; /* no other thread now */
    for (unsigned i = 0; i < POOL_SHARDS; i++) {
      pool_shard_t *sh = dmem_atomic_load_relaxed(&ps->shards[i]);
      void *large[POOL_LARGE_CAP];
      size_t n = sh ? pool_shard_take_large(sh, POOL_LARGE_CAP, large) : 0;
      if (n) pool_free_lazy(p, ps, ps->stream, large, n, 0);
    }
  }
  /* Lazily freed blocks: record their events (their streams are alive:
   * forgotten streams have none) so that the waits below cover them. */
  for (pool_tag_t *t = p->tags, *n; t; t = n) {
    n = t->next;
    if (t->lazy && t->refs) (void)pool_tag_materialise(p, t);
  }
  for (pool_tag_t *t = p->tags, *n; t; t = n) {
    n = t->next;
    pool_tag_destroy(be, t);
  }
  for (pool_tag_t *t = p->free_tags, *n; t; t = n) {
    n = t->next;
    pool_tag_destroy(be, t);
  }
  if (p->aux_stream) (void)be->stream_destroy(be, p->aux_stream);

  size_t live = p->in_use;
  for (pool_stream_t *ps = p->streams, *n; ps; ps = n) {
    n = ps->next_all;
    for (unsigned i = 0; i < POOL_SHARDS; i++) {
      pool_shard_t *sh = dmem_atomic_load_relaxed(&ps->shards[i]); /* no other thread now */
      if (!sh) continue;
      live += sh->in_use;
      pthread_mutex_destroy(&sh->mu);
      free(sh);
    }
    pthread_mutex_destroy(&ps->rec_mu);
    free(ps);
  }
  if (live)
    DMEM_LOG_AT(DMEM_LOG_WARN, "pool destroyed with %zu bytes in live blocks", live);

  for (size_t i = 0; i < p->nslabs; i++) {
    pool_slab_t *sl = p->slabs[i];
    dmem_status_t st = be->device_free(be, (void *)sl->base);
    if (st != DMEM_OK)
      DMEM_LOG_AT(DMEM_LOG_WARN, "pool destroy: device_free(%p): %s", (void *)sl->base,
                  dmem_last_error_detail());
    for (pool_seg_t *s = sl->first, *n; s; s = n) {
      n = s->next;
      free(s);
    }
    free(sl);
  }
  for (pool_seg_t *d = p->unused, *n; d; d = n) {
    n = d->pnext;
    free(d);
  }
  free(p->slabs);
  free(p->map.slots);
  pthread_mutex_destroy(&p->aux_mu);
  pthread_mutex_destroy(&p->tag_mu);
  pthread_mutex_destroy(&p->mu);
  pthread_mutex_destroy(&p->grow_mu);
  pthread_mutex_destroy(&p->table_mu);
  free(p);
}
