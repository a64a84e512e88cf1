/*
 * runtime/memory/pool_caches.c - the device pool's per-stream caches (see
 * pool_parts.h for the pool's files): the lock-free table of streams,
 * per-thread shards of blocks freed on each stream (small ones by size
 * class, large ones by exact size), the alloc/free fast path that takes no
 * pool-wide lock, and the flushes that hand cached blocks to the free
 * ranges (overflow, flush, trim, forget, destroy).
 * Calls pool_ranges.c (blocks given back), pool_tags.c (a forgotten
 * stream's lazy tag) and the backend table; never pool_slabs.c.
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
 */
#define _POSIX_C_SOURCE 200809L

#include <stdlib.h>
#include <string.h>

#include "memory/pool_parts.h"
#include "memory/pool_tags.h"

/* Round-robin shard index of this thread, 1-based (0: not assigned). */
static _Thread_local unsigned pool_tl_shard;
/* Next shard index to hand out; a counter that publishes nothing (relaxed). */
static _Atomic unsigned pool_shard_counter;

static unsigned pool_thread_shard(void) {
  unsigned s = pool_tl_shard;
  if (!s) {
    s = dmem_atomic_add_relaxed(&pool_shard_counter, 1) % POOL_SHARDS + 1;
    pool_tl_shard = s;
  }
  return s - 1;
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
pool_stream_t *dmem__pool_stream_get(dmem__pool_t *p, void *stream) {
  if (p->cuda && stream == POOL_CUDA_PER_THREAD_STREAM) return NULL;
  uintptr_t key = pool_stream_key(p, stream);
  pool_stream_t *ps = pool_stream_find(p, key);
  return ps ? ps : pool_stream_insert(p, key, stream);
}

/* This thread's shard of the cache of `stream`; NULL: go uncached
 * (*ps_out is then the stream's struct, or NULL). */
pool_shard_t *dmem__pool_shard_get(dmem__pool_t *p, void *stream, pool_stream_t **ps_out) {
  pool_stream_t *ps = dmem__pool_stream_get(p, stream);
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
size_t dmem__pool_shard_evict(const dmem__pool_t *p, pool_shard_t *sh, unsigned cls, size_t rsize,
                              void **out) {
  size_t n = 0;
  if (sh->n[cls] >= POOL_CLASS_CAP) n += pool_shard_take_oldest(sh, cls, POOL_CLASS_CAP / 2, out);
  for (unsigned c = POOL_NCLASSES;
       c-- > 0 && sh->bytes + rsize > p->cache_bytes && n < POOL_FLUSH_BATCH;) {
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
void *dmem__pool_shard_pop_large(pool_shard_t *sh, size_t rsize) {
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
size_t dmem__pool_shard_push_large(const dmem__pool_t *p, pool_shard_t *sh, void *ptr, size_t rsize,
                                   void **out) {
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
    if (nl) dmem__pool_range_free_lazy(p, ps, stream, lbatch, nl, 0);
    if (n) dmem__pool_range_give_back(p, ps, stream, batch, n, 0);
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
void dmem__pool_cache_flush_all(dmem__pool_t *p, bool large) {
  pthread_mutex_lock(&p->table_mu);
  for (pool_stream_t *ps = p->streams; ps; ps = ps->next_all)
    if (dmem_atomic_load_relaxed(&ps->key)) /* key: table_mu held */
      pool_flush_stream(p, ps, large);
  pthread_mutex_unlock(&p->table_mu);
}

void dmem__pool_flush(dmem__pool_t *p) {
  if (p) dmem__pool_cache_flush_all(p, true);
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
    if (t && t->refs && dmem__pool_tag_materialise(p, t) != DMEM_OK)
      dmem__pool_range_sync_tag(p, t);
    if (ps->lazy) dmem__pool_tag_close(p, ps->lazy); /* nothing carries it now */
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

/* ---- stats and destroy ------------------------------------------------------- */

void dmem__pool_cache_stats(dmem__pool_t *p, size_t *in_use, uint64_t *hits, size_t *cached) {
  pthread_mutex_lock(&p->table_mu);
  for (pool_stream_t *ps = p->streams; ps; ps = ps->next_all) {
    for (unsigned i = 0; i < POOL_SHARDS; i++) {
      /* acquire: partner is the releasing CAS in pool_shard_install */
      pool_shard_t *sh = dmem_atomic_load_acquire(&ps->shards[i]);
      if (!sh) continue;
      pthread_mutex_lock(&sh->mu);
      *in_use += sh->in_use;
      *hits += sh->hits;
      *cached += sh->bytes + sh->lbytes;
      pthread_mutex_unlock(&sh->mu);
    }
  }
  pthread_mutex_unlock(&p->table_mu);
}

void dmem__pool_caches_drain(dmem__pool_t *p) {
  for (pool_stream_t *ps = p->streams; ps; ps = ps->next_all) {
    if (!dmem_atomic_load_relaxed(&ps->key)) continue; /* no other thread now */
    for (unsigned i = 0; i < POOL_SHARDS; i++) {
      pool_shard_t *sh = dmem_atomic_load_relaxed(&ps->shards[i]);
      void *large[POOL_LARGE_CAP];
      size_t n = sh ? pool_shard_take_large(sh, POOL_LARGE_CAP, large) : 0;
      if (n) dmem__pool_range_free_lazy(p, ps, ps->stream, large, n, 0);
    }
  }
}

size_t dmem__pool_caches_destroy(dmem__pool_t *p) {
  size_t live = 0;
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
  return live;
}
