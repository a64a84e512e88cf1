/*
 * runtime/memory/pool.c - the device pool (memory/pool.h): create and
 * destroy, the order of attempts of an allocation (this thread's cache of
 * the stream, the free ranges, the same after settling events and flushing
 * caches, a new slab, everything flushed), frees, trim, and the queries of
 * victim selection.
 * The top of the pool's files (pool_parts.h draws them): calls
 * pool_caches.c, pool_slabs.c, pool_ranges.c, pool_tags.c and pool_index.c,
 * and is called by none of them.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdlib.h>
#include <string.h>

#include "memory/pool_parts.h"
#include "memory/pool_tags.h"

/* ---- sizes ------------------------------------------------------------------ */

size_t dmem__pool_block_size(size_t size) {
  unsigned cls;
  return size > POOL_MAX_REQUEST ? size : pool_round(size, &cls);
}

size_t dmem__pool_seg_bytes(void) { return sizeof(pool_seg_t); }

/* ---- alloc and free ------------------------------------------------------------ */

/* Under mu: take `need` bytes (after noting completed events when `settle`;
 * from runs of neighbours too when `runs`), counting a hit. */
static dmem_status_t pool_take_counted(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                       void **ptr, bool *ordered, bool settle, bool runs) {
  if (settle) dmem__pool_range_settle(p);
  unsigned cls;
  (void)pool_round(need, &cls);
  dmem_status_t st =
      cls < POOL_RUN_CLASSES
          ? dmem__pool_range_take_small(p, need, cls, skey, stream, ptr, ordered)
          : dmem__pool_range_take(p, need, skey, stream, ptr, ordered);
  if (st == DMEM_ERR_OUT_OF_MEMORY && runs)
    st = dmem__pool_range_take_run(p, need, skey, stream, ptr, ordered);
  if (st == DMEM_OK) {
    p->hits++;
    p->in_use += need;
  }
  return st;
}

/* Everything after a cache miss. */
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
    dmem__pool_cache_flush_all(p, false);
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
      st = dmem__pool_slab_grow(p, need, false, &ptr, why, sizeof why);
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
    dmem__pool_cache_flush_all(p, true);
    pthread_mutex_lock(&p->mu);
    st = pool_take_counted(p, need, skey, stream, &ptr, ordered, true, true);
    size_t largest = dmem__pool_range_largest(p), reserved = p->reserved;
    pthread_mutex_unlock(&p->mu);
    if (st == DMEM_ERR_OUT_OF_MEMORY && past_limit) {
      /* Nothing cached fits either: a slab past the limit (the caller
       * keeps the live bytes under it). */
      pthread_mutex_lock(&p->grow_mu);
      st = dmem__pool_slab_grow(p, need, true, &ptr, why, sizeof why);
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
    pool_shard_t *sh = dmem__pool_shard_get(p, stream, &ps);
    if (sh) {
      void *ptr = NULL;
      pthread_mutex_lock(&sh->mu);
      if (cls == POOL_NCLASSES) {
        ptr = dmem__pool_shard_pop_large(sh, rsize);
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
    pool_shard_t *sh = dmem__pool_shard_get(p, stream, &ps);
    if (sh) {
      void *out[POOL_FLUSH_BATCH + 1];
      size_t nout = 0;
      pthread_mutex_lock(&sh->mu);
      sh->in_use -= rsize;
      if (cls == POOL_NCLASSES) {
        nout = dmem__pool_shard_push_large(p, sh, ptr, rsize, out);
      } else {
        if (sh->n[cls] >= POOL_CLASS_CAP || sh->bytes + rsize > p->cache_bytes)
          nout = dmem__pool_shard_evict(p, sh, cls, rsize, out);
        if (sh->n[cls] < POOL_CLASS_CAP && sh->bytes + rsize <= p->cache_bytes) {
          sh->stack[cls][sh->n[cls]++] = ptr;
          sh->bytes += rsize;
        } else {
          out[nout++] = ptr; /* the bound could not be met: this one goes too */
        }
      }
      pthread_mutex_unlock(&sh->mu);
      if (nout && cls == POOL_NCLASSES)
        dmem__pool_range_free_lazy(p, ps, stream, out, nout, 0); /* large overflow: no event now */
      else if (nout)
        dmem__pool_range_give_back(p, ps, stream, out, nout, 0);
      return;
    }
  } else {
    ps = dmem__pool_stream_get(p, stream);
  }
  if (ps)
    dmem__pool_range_free_lazy(p, ps, stream, &ptr, 1, rsize); /* no event now */
  else
    dmem__pool_range_give_back(p, NULL, stream, &ptr, 1, rsize); /* uncached stream: an event now */
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
      st = dmem__pool_tag_record(p, NULL, &p->aux_seq, p->aux_stream, (uintptr_t)p->aux_stream,
                                 &tag);
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
  if (tag) dmem__pool_tag_link(p, tag);
  for (size_t i = 0; i < n; i++) {
    if (!ptrs[i]) continue;
    pool_seg_t *s;
    size_t rs;
    if (!dmem__pool_block_find(p, (uintptr_t)ptrs[i], &s, &rs)) {
      DMEM_LOG_AT(DMEM_LOG_ERROR, "pool: free of %p, which is not a live block: ignored", ptrs[i]);
    } else if (settled || st == DMEM_OK) {
      (void)dmem__pool_block_release(p, (uintptr_t)ptrs[i], tag);
    } else {
      (void)dmem__pool_block_quarantine(p, (uintptr_t)ptrs[i]);
      if (!lost++) lost_ptr = ptrs[i];
    }
  }
  if (tag) dmem__pool_tag_unref(p, tag);
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
  size_t n = 0, rs = 0;
  pool_seg_t *s = NULL;
  if (dmem__pool_block_find(p, (uintptr_t)ptr, &s, &rs) && !s) n = rs; /* a block of a run */
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
  size_t n = dmem__pool_range_largest(p);
  pthread_mutex_unlock(&p->mu);
  return n;
}

int dmem__pool_fits(dmem__pool_t *p, size_t size, void *stream) {
  if (!p || size > POOL_MAX_REQUEST) return 0;
  unsigned cls;
  size_t rsize = pool_round(size, &cls);
  if (cls < POOL_NCLASSES || rsize <= p->large_cache_bytes) {
    pool_stream_t *ps = NULL;
    pool_shard_t *sh = dmem__pool_shard_get(p, stream, &ps);
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
  if (cls < POOL_RUN_CLASSES) {
    pthread_mutex_lock(&p->mu);
    bool room = dmem__pool_run_room(p, cls);
    pthread_mutex_unlock(&p->mu);
    if (room) return 1;
  }
  return dmem__pool_largest_free(p) >= rsize;
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
  s.runs = p->nruns;
  pthread_mutex_unlock(&p->mu);
  dmem__pool_cache_stats(p, &s.in_use, &s.hits, &s.cached);
  *out = s;
}

/* ---- trim, create, destroy -------------------------------------------------- */

dmem_status_t dmem__pool_trim(dmem__pool_t *p, size_t keep, size_t *released_out) {
  if (!p) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem__pool_trim: pool NULL");
  dmem__pool_flush(p);
  return dmem__pool_slabs_trim(p, keep, released_out);
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

void dmem__pool_destroy(dmem__pool_t *p) {
  if (!p) return;
  dmem__backend_t *be = p->be;
  /* Cached large blocks join the free ranges under their streams' lazy
   * tags (as uncached large frees would have), so that their last uses are
   * waited for too; then every tag's event is waited for. */
  dmem__pool_caches_drain(p);
  dmem__pool_tags_destroy(p);
  if (p->aux_stream) (void)be->stream_destroy(be, p->aux_stream);

  size_t live = p->in_use + dmem__pool_caches_destroy(p);
  if (live) DMEM_LOG_AT(DMEM_LOG_WARN, "pool destroyed with %zu bytes in live blocks", live);

  dmem__pool_slabs_destroy(p);
  dmem__pool_ranges_destroy(p);
  pthread_mutex_destroy(&p->aux_mu);
  pthread_mutex_destroy(&p->tag_mu);
  pthread_mutex_destroy(&p->mu);
  pthread_mutex_destroy(&p->grow_mu);
  pthread_mutex_destroy(&p->table_mu);
  free(p);
}
