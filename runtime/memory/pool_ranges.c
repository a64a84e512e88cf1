/*
 * runtime/memory/pool_ranges.c - the device pool's segments and free ranges
 * (see pool_parts.h for the pool's files): segment descriptors, FREE
 * segments entered in the treap (and the `pending` list when tagged),
 * coalescing with address neighbours as their tags allow, best-fit takes
 * from one range or from a run of neighbours (the allocating stream made to
 * wait on foreign events), and blocks given back to the free ranges under an
 * event recorded now or under their stream's lazy tag, or quarantined when
 * nothing can order their reuse.
 * Calls pool_tags.c and pool_index.c (and the backend table); everything
 * here runs under the pool's mu unless noted.
 */
#include <stdlib.h>
#include <string.h>

#include "memory/pool_parts.h"
#include "memory/pool_tags.h"

static void run_sync_tag(dmem__pool_t *p, pool_tag_t *t, bool synced, size_t *n, size_t *bytes);
static void run_retry_deferred(dmem__pool_t *p);

/* ---- segments (mu) ---------------------------------------------------------- */

dmem_status_t dmem__pool_desc_reserve(dmem__pool_t *p, size_t n) {
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
pool_seg_t *dmem__pool_desc_get(dmem__pool_t *p) {
  pool_seg_t *d = p->unused;
  p->unused = d->pnext;
  p->nunused--;
  uint32_t prio = d->prio;
  memset(d, 0, sizeof *d);
  d->prio = prio;
  return d;
}

void dmem__pool_desc_put(dmem__pool_t *p, pool_seg_t *d) {
  d->state = SEG_UNUSED;
  d->tag = NULL;
  d->pnext = p->unused;
  p->unused = d;
  p->nunused++;
}

/* Enter a FREE segment in the treap (and `pending` if its tag has work). */
void dmem__pool_range_index(dmem__pool_t *p, pool_seg_t *s) {
  if (s->tag && s->tag->done) {
    dmem__pool_tag_unref(p, s->tag);
    s->tag = NULL;
    s->slab->dirty = true; /* neighbours may join it now: next settle pass */
  }
  p->root = dmem__pool_treap_insert(p->root, s);
  if (s->tag) {
    s->pprev = NULL;
    s->pnext = p->pending;
    if (p->pending) p->pending->pprev = s;
    p->pending = s;
  }
}

void dmem__pool_range_unindex(dmem__pool_t *p, pool_seg_t *s) {
  p->root = dmem__pool_treap_erase(p->root, s);
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
  if (lt) dmem__pool_tag_unref(p, lt);
  if (ht) dmem__pool_tag_unref(p, ht);
  lo->tag = keep;
  lo->size += hi->size;
  lo->next = hi->next;
  if (hi->next) hi->next->prev = lo;
  dmem__pool_desc_put(p, hi);
}

/* Join unindexed FREE s with mergeable free neighbours; returns the survivor
 * (unindexed). */
static pool_seg_t *pool_coalesce(dmem__pool_t *p, pool_seg_t *s) {
  pool_tag_t *keep;
  pool_seg_t *prev = s->prev;
  if (prev && prev->state == SEG_FREE && dmem__pool_tags_mergeable(prev->tag, s->tag, &keep)) {
    dmem__pool_range_unindex(p, prev);
    pool_absorb(p, prev, s, keep);
    s = prev;
  }
  pool_seg_t *next = s->next;
  if (next && next->state == SEG_FREE && dmem__pool_tags_mergeable(s->tag, next->tag, &keep)) {
    dmem__pool_range_unindex(p, next);
    pool_absorb(p, s, next, keep);
  }
  return s;
}

/* A LIVE segment becomes FREE, carrying `tag` (NULL: free for all). */
void dmem__pool_range_release(dmem__pool_t *p, pool_seg_t *s, pool_tag_t *tag) {
  dmem__pool_map_remove(&p->map, s);
  s->run = NULL;
  s->state = SEG_FREE;
  s->tag = tag;
  if (tag) pool_tag_ref(tag);
  dmem__pool_range_index(p, pool_coalesce(p, s));
}

void dmem__pool_range_quarantine(dmem__pool_t *p, pool_seg_t *s) {
  dmem__pool_map_remove(&p->map, s);
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
void dmem__pool_range_sync_tag(dmem__pool_t *p, pool_tag_t *t) {
  size_t n = 0, bytes = 0;
  bool synced = p->be->stream_synchronize(p->be, t->stream) == DMEM_OK;
  for (pool_seg_t *s = p->pending, *next; s; s = next) {
    next = s->pnext;
    if (s->tag != t) continue;
    dmem__pool_range_unindex(p, s);
    s->tag = NULL;
    dmem__pool_tag_unref(p, t); /* stays: lazy */
    if (synced) {
      dmem__pool_range_index(p, s); /* free for all; neighbours join it at the next settle */
      s->slab->dirty = true;
      continue;
    }
    s->state = SEG_QUARANTINED;
    p->quarantined += s->size;
    n++;
    bytes += s->size;
  }
  run_sync_tag(p, t, synced, &n, &bytes);
  if (n)
    DMEM_LOG_AT(DMEM_LOG_WARN,
                "pool: no event can be recorded on stream %p (%s): %zu free range(s) or "
                "block(s), %zu "
                "bytes, quarantined",
                t->stream, dmem_last_error_detail(), n, bytes);
}

/* Re-coalesce every segment of a slab (after tags settled). */
static void pool_coalesce_slab(dmem__pool_t *p, pool_slab_t *sl) {
  for (pool_seg_t *s = sl->first; s; s = s->next) {
    if (s->state != SEG_FREE) continue;
    dmem__pool_range_unindex(p, s);
    if (s->tag && s->tag->done) {
      dmem__pool_tag_unref(p, s->tag);
      s->tag = NULL;
    }
    pool_tag_t *keep;
    while (s->next && s->next->state == SEG_FREE &&
           dmem__pool_tags_mergeable(s->tag, s->next->tag, &keep)) {
      pool_seg_t *n = s->next;
      dmem__pool_range_unindex(p, n);
      pool_absorb(p, s, n, keep);
    }
    dmem__pool_range_index(p, s);
  }
  sl->dirty = false;
}

/* Note completed events (one query per pending tag) and coalesce what they
 * free up. */
void dmem__pool_range_settle(dmem__pool_t *p) {
  for (pool_tag_t *t = p->tags; t; t = t->next)
    if (!t->done && !t->lazy && p->be->event_query(p->be, t->event) == DMEM_OK) t->done = true;
  for (pool_seg_t *s = p->pending; s; s = s->pnext)
    if (s->tag->done) s->slab->dirty = true;
  run_retry_deferred(p); /* before coalescing: a run it empties joins its neighbours */
  for (size_t i = 0; i < p->nslabs; i++)
    if (p->slabs[i]->dirty) pool_coalesce_slab(p, p->slabs[i]);
}

/* ---- taking free ranges (mu) ------------------------------------------------ */

/* Best fit: among the first POOL_FIND_CANDIDATES segments >= need in size
 * order, the first usable now; else the smallest (*wait_out: needs a wait). */
static pool_seg_t *pool_find(dmem__pool_t *p, size_t need, uintptr_t skey, bool *wait_out) {
  pool_seg_t *first = dmem__pool_treap_lower_bound(p->root, need, 0), *s = first;
  for (int k = 0; s && k < POOL_FIND_CANDIDATES; k++) {
    if (dmem__pool_tag_usable(p, s->tag, skey)) {
      *wait_out = false;
      return s;
    }
    s = dmem__pool_treap_lower_bound(p->root, s->size, s->addr + 1);
  }
  *wait_out = true;
  return first;
}

/* Cut the first `need` bytes of FREE (indexed) s into a LIVE segment; map
 * room and one descriptor reserved by the caller. */
void dmem__pool_range_carve(dmem__pool_t *p, pool_seg_t *s, size_t need) {
  dmem__pool_range_unindex(p, s);
  if (s->size > need) {
    pool_seg_t *r = dmem__pool_desc_get(p);
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
    dmem__pool_range_index(p, r);
  }
  if (s->tag) dmem__pool_tag_unref(p, s->tag);
  s->tag = NULL;
  s->state = SEG_LIVE;
  dmem__pool_map_put(&p->map, s);
}

/* Make `stream` wait for the pending work of the ranges tagged t, recording
 * a lazy t on its stream first. When that record fails, t's ranges are
 * quarantined and *dropped set (look for another range). */
static dmem_status_t pool_wait_tag(dmem__pool_t *p, pool_tag_t *t, void *stream, bool *dropped) {
  *dropped = false;
  if (t->lazy && dmem__pool_tag_materialise(p, t) != DMEM_OK) {
    dmem__pool_range_sync_tag(p, t);
    *dropped = true;
    return DMEM_OK;
  }
  return p->be->stream_wait_event(p->be, stream, t->event);
}

/* DMEM_OK with *ptr_out; DMEM_ERR_OUT_OF_MEMORY when nothing fits (no detail
 * recorded); other statuses recorded where detected. */
dmem_status_t dmem__pool_range_take(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                    void **ptr_out, bool *ordered) {
  bool wait, dropped;
  pool_seg_t *s;
  do {
    dropped = false;
    s = pool_find(p, need, skey, &wait);
    if (!s) return DMEM_ERR_OUT_OF_MEMORY;
    dmem_status_t st = dmem__pool_map_reserve(&p->map);
    if (st == DMEM_OK) st = dmem__pool_desc_reserve(p, 1);
    if (st == DMEM_OK && wait) st = pool_wait_tag(p, s->tag, stream, &dropped);
    if (st != DMEM_OK) return st;
  } while (dropped);
  /* `stream` was made to wait, or the block's last use on this same stream
   * may still be pending: either way it is ordered in `stream` only */
  if (!pool_tag_settled(s->tag)) *ordered = true;
  dmem__pool_range_carve(p, s, need);
  *ptr_out = (void *)s->addr;
  return DMEM_OK;
}

/* ---- class runs (mu) ----------------------------------------------------------- */

static inline bool run_bit(const uint64_t *w, unsigned i) { return (w[i >> 6] >> (i & 63)) & 1u; }
static inline void run_set(uint64_t *w, unsigned i) { w[i >> 6] |= (uint64_t)1 << (i & 63); }
static inline void run_clr(uint64_t *w, unsigned i) { w[i >> 6] &= ~((uint64_t)1 << (i & 63)); }

/* The mask of run r's blocks in bitmap word k. */
static inline uint64_t run_valid(const pool_run_t *r, unsigned k) {
  unsigned lo = k * 64u;
  if (r->nblocks <= lo) return 0;
  unsigned n = r->nblocks - lo;
  return n >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1);
}

static bool run_any(const uint64_t *w) {
  for (unsigned k = 0; k < POOL_RUN_WORDS; k++)
    if (w[k]) return true;
  return false;
}

static void run_open_link(dmem__pool_t *p, pool_run_t *r) {
  if (r->open) return;
  r->open = true;
  r->prev = NULL;
  r->next = p->run_open[r->cls];
  if (r->next) r->next->prev = r;
  p->run_open[r->cls] = r;
}

static void run_open_unlink(dmem__pool_t *p, pool_run_t *r) {
  if (!r->open) return;
  r->open = false;
  if (r->prev)
    r->prev->next = r->next;
  else
    p->run_open[r->cls] = r->next;
  if (r->next) r->next->prev = r->prev;
  r->prev = r->next = NULL;
}

/* r's pending tag settled: its pending blocks are free for all. */
static void run_settle(dmem__pool_t *p, pool_run_t *r) {
  if (!r->tag || !r->tag->done) return;
  memset(r->pend, 0, sizeof r->pend);
  dmem__pool_tag_unref(p, r->tag);
  r->tag = NULL;
}

/* Every block of r free: its segment back to the free ranges, carrying the
 * pending blocks' tag. */
static void run_drop(dmem__pool_t *p, pool_run_t *r) {
  run_open_unlink(p, r);
  if (r->aprev)
    r->aprev->anext = r->anext;
  else
    p->runs = r->anext;
  if (r->anext) r->anext->aprev = r->aprev;
  p->nruns--;
  pool_seg_t *s = r->seg;
  pool_tag_t *t = run_any(r->pend) ? r->tag : NULL;
  s->run = NULL;
  dmem__pool_range_release(p, s, t); /* takes its own reference */
  if (r->tag) dmem__pool_tag_unref(p, r->tag);
  free(r);
}

/* Block i of r is live: hand it out. */
static void *run_take_block(dmem__pool_t *p, pool_run_t *r, unsigned i) {
  if (run_bit(r->pend, i)) {
    run_clr(r->pend, i);
    if (!run_any(r->pend)) {
      dmem__pool_tag_unref(p, r->tag);
      r->tag = NULL;
    }
  }
  run_set(r->live, i);
  if (++r->nlive == r->nblocks) run_open_unlink(p, r);
  return (void *)(r->base + (uintptr_t)i * pool_class_size(r->cls));
}

/* The first block of r set in (~live & want), want: the free blocks
 * (pending ones too when `pending`); -1 if none. */
static int run_first(const pool_run_t *r, bool pending) {
  for (unsigned k = 0; k < POOL_RUN_WORDS; k++) {
    uint64_t w = ~r->live[k] & run_valid(r, k);
    if (!pending) w &= ~r->pend[k];
    if (w) return (int)(k * 64u + (unsigned)__builtin_ctzll(w));
  }
  return -1;
}

/* A block of an open run of class cls usable by skey now; NULL if none. */
static void *run_take_usable(dmem__pool_t *p, unsigned cls, uintptr_t skey, bool *ordered) {
  int k = 0;
  for (pool_run_t *r = p->run_open[cls]; r && k < POOL_FIND_CANDIDATES; r = r->next, k++) {
    run_settle(p, r);
    int i = run_first(r, false);
    if (i < 0 && r->tag && dmem__pool_tag_usable(p, r->tag, skey)) {
      if (!pool_tag_settled(r->tag)) *ordered = true; /* this stream's own pending work */
      i = run_first(r, true);
    }
    if (i >= 0) return run_take_block(p, r, (unsigned)i);
  }
  return NULL;
}

bool dmem__pool_run_room(const dmem__pool_t *p, unsigned cls) {
  return cls < POOL_RUN_CLASSES && p->run_open[cls] != NULL;
}

/* A new run of class cls in a free range usable by skey now (its blocks
 * pending under that range's tag if it is this stream's unsettled work).
 * DMEM_ERR_OUT_OF_MEMORY (not recorded) when no such range holds an aligned
 * POOL_RUN_BYTES window; DMEM_ERR_HOST_OUT_OF_MEMORY. */
static dmem_status_t run_new(dmem__pool_t *p, unsigned cls, uintptr_t skey, pool_run_t **run_out) {
  pool_seg_t *s = dmem__pool_treap_lower_bound(p->root, POOL_RUN_BYTES, 0);
  uintptr_t a = 0;
  bool found = false;
  for (int k = 0; s && k < 2 * POOL_FIND_CANDIDATES; k++) {
    a = (s->addr + POOL_RUN_BYTES - 1) & ~(uintptr_t)(POOL_RUN_BYTES - 1);
    if (a - s->addr <= s->size - POOL_RUN_BYTES && dmem__pool_tag_usable(p, s->tag, skey)) {
      found = true;
      break;
    }
    s = dmem__pool_treap_lower_bound(p->root, s->size, s->addr + 1);
  }
  if (!found) return DMEM_ERR_OUT_OF_MEMORY;
  pool_run_t *r = calloc(1, sizeof *r);
  if (!r) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pool: allocating a class run failed");
  dmem_status_t st = dmem__pool_map_reserve(&p->map);
  if (st == DMEM_OK) st = dmem__pool_desc_reserve(p, 2);
  if (st != DMEM_OK) {
    free(r);
    return st;
  }
  if (a > s->addr) { /* split off the unaligned head, which stays free */
    dmem__pool_range_unindex(p, s);
    pool_seg_t *hi = dmem__pool_desc_get(p);
    hi->addr = a;
    hi->size = s->addr + s->size - a;
    hi->slab = s->slab;
    hi->state = SEG_FREE;
    hi->tag = s->tag;
    if (hi->tag) pool_tag_ref(hi->tag);
    hi->prev = s;
    hi->next = s->next;
    if (s->next) s->next->prev = hi;
    s->next = hi;
    s->size = a - s->addr;
    dmem__pool_range_index(p, s);
    dmem__pool_range_index(p, hi);
    s = hi;
  }
  pool_tag_t *t = pool_tag_settled(s->tag) ? NULL : s->tag;
  if (t) pool_tag_ref(t);
  dmem__pool_range_carve(p, s, POOL_RUN_BYTES);
  r->base = a;
  r->seg = s;
  r->cls = (uint8_t)cls;
  r->nblocks = (uint16_t)(POOL_RUN_BYTES / pool_class_size(cls));
  r->tag = t;
  if (t)
    for (unsigned k = 0; k < POOL_RUN_WORDS; k++) r->pend[k] = run_valid(r, k);
  s->run = r;
  r->anext = p->runs;
  if (p->runs) p->runs->aprev = r;
  p->runs = r;
  p->nruns++;
  run_open_link(p, r);
  *run_out = r;
  return DMEM_OK;
}

/* The run holding live block addr (*idx_out its index), or NULL; *seg_out:
 * the plain LIVE segment at addr, or NULL. */
static pool_run_t *run_of(dmem__pool_t *p, uintptr_t addr, pool_seg_t **seg_out, unsigned *idx_out) {
  *seg_out = NULL;
  pool_seg_t *s = dmem__pool_map_find(&p->map, addr);
  if (s && !s->run) {
    *seg_out = s;
    return NULL;
  }
  if (!s) s = dmem__pool_map_find(&p->map, addr & ~(uintptr_t)(POOL_RUN_BYTES - 1));
  if (!s || !s->run || addr < s->addr) return NULL;
  pool_run_t *r = s->run;
  size_t off = addr - r->base, cs = pool_class_size(r->cls);
  if (off % cs || off / cs >= r->nblocks || !run_bit(r->live, (unsigned)(off / cs))) return NULL;
  *idx_out = (unsigned)(off / cs);
  return r;
}

pool_run_t *dmem__pool_run_of(dmem__pool_t *p, uintptr_t addr) {
  pool_seg_t *s;
  unsigned i;
  return run_of(p, addr, &s, &i);
}

bool dmem__pool_block_find(dmem__pool_t *p, uintptr_t addr, pool_seg_t **seg_out,
                           size_t *run_size_out) {
  unsigned i;
  pool_run_t *r = run_of(p, addr, seg_out, &i);
  if (r) *run_size_out = pool_class_size(r->cls);
  return r || *seg_out;
}

/* Park live block addr of a run until t settles (t unsettled, another
 * stream's than the run's pending work); quarantined if no room. */
static void run_defer(dmem__pool_t *p, pool_run_t *r, uintptr_t addr, pool_tag_t *t) {
  if (p->ndeferred == p->deferred_cap) {
    size_t cap = p->deferred_cap ? p->deferred_cap * 2 : 16;
    pool_deferred_t *d = realloc(p->deferred, cap * sizeof *d);
    if (!d) {
      p->quarantined += pool_class_size(r->cls);
      DMEM_LOG_AT(DMEM_LOG_WARN, "pool: no room to park freed block %p: quarantined",
                  (void *)addr);
      return;
    }
    p->deferred = d;
    p->deferred_cap = cap;
  }
  pool_tag_ref(t);
  p->deferred[p->ndeferred++] = (pool_deferred_t){addr, t};
  r->nparked++;
}

/* Live block i of r becomes free carrying t. */
static void run_release(dmem__pool_t *p, pool_run_t *r, unsigned i, pool_tag_t *t) {
  if (pool_tag_settled(t)) t = NULL;
  run_settle(p, r);
  if (t && r->tag != t) {
    pool_tag_t *keep = NULL;
    if (!r->tag) {
      r->tag = t;
      pool_tag_ref(t);
    } else if (dmem__pool_tags_mergeable(r->tag, t, &keep)) {
      if (keep != r->tag) {
        pool_tag_ref(keep);
        dmem__pool_tag_unref(p, r->tag);
        r->tag = keep;
      }
    } else {
      run_defer(p, r, r->base + (uintptr_t)i * pool_class_size(r->cls), t);
      return;
    }
  }
  if (t) run_set(r->pend, i);
  run_clr(r->live, i);
  if (--r->nlive == 0) {
    run_drop(p, r);
    return;
  }
  run_open_link(p, r);
}

bool dmem__pool_block_release(dmem__pool_t *p, uintptr_t addr, pool_tag_t *tag) {
  pool_seg_t *s;
  unsigned i;
  pool_run_t *r = run_of(p, addr, &s, &i);
  if (r)
    run_release(p, r, i, tag);
  else if (s)
    dmem__pool_range_release(p, s, tag);
  return r || s;
}

bool dmem__pool_block_quarantine(dmem__pool_t *p, uintptr_t addr) {
  pool_seg_t *s;
  unsigned i;
  pool_run_t *r = run_of(p, addr, &s, &i);
  if (r)
    p->quarantined += pool_class_size(r->cls); /* stays live until destroy */
  else if (s)
    dmem__pool_range_quarantine(p, s);
  return r || s;
}

/* Parked blocks whose tag settled, or that may join their run's pending
 * work now, are released again. */
static void run_retry_deferred(dmem__pool_t *p) {
  size_t keep = 0;
  for (size_t j = 0; j < p->ndeferred; j++) {
    pool_deferred_t e = p->deferred[j];
    pool_seg_t *s;
    unsigned i;
    pool_tag_t *kt;
    pool_run_t *r = run_of(p, e.addr, &s, &i);
    if (r && !pool_tag_settled(e.tag) && r->tag && !r->tag->done &&
        !dmem__pool_tags_mergeable(r->tag, e.tag, &kt)) {
      p->deferred[keep++] = e;
      continue;
    }
    if (r) {
      r->nparked--;
      run_release(p, r, i, e.tag); /* parks nothing: see the test above */
    }
    dmem__pool_tag_unref(p, e.tag);
  }
  p->ndeferred = keep;
}

/* t (lazy) cannot be recorded and its stream was waited for (synced) or
 * not: the run blocks pending under t become free for all, or are
 * quarantined (dmem__pool_range_sync_tag). */
static void run_sync_tag(dmem__pool_t *p, pool_tag_t *t, bool synced, size_t *n, size_t *bytes) {
  for (pool_run_t *r = p->runs; r; r = r->anext) {
    if (r->tag != t) continue;
    if (!synced) {
      size_t q = 0;
      for (unsigned k = 0; k < POOL_RUN_WORDS; k++) {
        q += (size_t)__builtin_popcountll(r->pend[k]);
        r->live[k] |= r->pend[k];
      }
      r->nlive = (uint16_t)(r->nlive + q);
      if (r->nlive == r->nblocks) run_open_unlink(p, r);
      p->quarantined += q * pool_class_size(r->cls);
      *n += q;
      *bytes += q * pool_class_size(r->cls);
    }
    memset(r->pend, 0, sizeof r->pend);
    r->tag = NULL;
    dmem__pool_tag_unref(p, t);
  }
  size_t keep = 0;
  for (size_t j = 0; j < p->ndeferred; j++) {
    pool_deferred_t e = p->deferred[j];
    if (e.tag != t) {
      p->deferred[keep++] = e;
      continue;
    }
    pool_seg_t *s;
    unsigned i;
    pool_run_t *r = run_of(p, e.addr, &s, &i);
    if (r) r->nparked--;
    if (r && synced) {
      run_release(p, r, i, NULL);
    } else if (r) {
      p->quarantined += pool_class_size(r->cls);
      (*n)++;
      *bytes += pool_class_size(r->cls);
    }
    dmem__pool_tag_unref(p, t);
  }
  p->ndeferred = keep;
}

dmem_status_t dmem__pool_range_take_small(dmem__pool_t *p, size_t need, unsigned cls,
                                          uintptr_t skey, void *stream, void **ptr_out,
                                          bool *ordered) {
  void *ptr = run_take_usable(p, cls, skey, ordered);
  if (ptr) {
    *ptr_out = ptr;
    return DMEM_OK;
  }
  pool_run_t *r = NULL;
  dmem_status_t st = run_new(p, cls, skey, &r);
  if (st == DMEM_OK) {
    if (r->tag) *ordered = true; /* this stream's own pending work */
    *ptr_out = run_take_block(p, r, 0);
    return DMEM_OK;
  }
  if (st != DMEM_ERR_OUT_OF_MEMORY) return st;
  st = dmem__pool_range_take(p, need, skey, stream, ptr_out, ordered);
  if (st != DMEM_ERR_OUT_OF_MEMORY) return st;
  /* Last: a pending block of a run, after `stream` waits for its work. */
  for (;;) {
    pool_run_t *w = p->run_open[cls];
    while (w && !w->tag) w = w->next;
    if (!w) return DMEM_ERR_OUT_OF_MEMORY;
    bool dropped = false;
    st = pool_wait_tag(p, w->tag, stream, &dropped);
    if (st != DMEM_OK) return st;
    if (dropped) continue; /* the run's pending blocks are free or quarantined now */
    *ordered = true;
    *ptr_out = run_take_block(p, w, (unsigned)run_first(w, true));
    return DMEM_OK;
  }
}

/* ---- runs of free neighbours (mu) ------------------------------------------- */

/* Length of the run of FREE segments starting at s. */
static size_t pool_run_length(const pool_seg_t *s) {
  size_t n = 0;
  for (; s && s->state == SEG_FREE; s = s->next) n += s->size;
  return n;
}

typedef struct pool_run_ctx {
  size_t need;      /* dmem__pool_range_take_run: the smallest run >= need */
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

size_t dmem__pool_range_largest(dmem__pool_t *p) {
  pool_run_ctx_t c = {SIZE_MAX, NULL, SIZE_MAX, 0};
  pool_visit_runs(p->root, &c);
  return c.largest;
}

/* Serve `need` from a run of adjacent free segments that no single one
 * covers: `stream` waits on every pending foreign event of the segments it
 * takes, then they become one LIVE segment. Statuses as dmem__pool_range_take. */
dmem_status_t dmem__pool_range_take_run(dmem__pool_t *p, size_t need, uintptr_t skey, void *stream,
                                        void **ptr_out, bool *ordered) {
  pool_run_ctx_t c;
  bool dropped;
  do {
    c = (pool_run_ctx_t){need, NULL, SIZE_MAX, 0};
    pool_visit_runs(p->root, &c);
    if (!c.best) return DMEM_ERR_OUT_OF_MEMORY;
    if (c.best->size >= need) return dmem__pool_range_take(p, need, skey, stream, ptr_out, ordered);
    dmem_status_t st = dmem__pool_map_reserve(&p->map);
    if (st != DMEM_OK) return st;
    dropped = false;
    size_t covered = 0;
    for (pool_seg_t *q = c.best; covered < need && !dropped; q = q->next) {
      if (!pool_tag_settled(q->tag)) *ordered = true;
      covered += q->size;
      if (!dmem__pool_tag_usable(p, q->tag, skey)) {
        st = pool_wait_tag(p, q->tag, stream, &dropped); /* dropped: the run changed */
        if (st != DMEM_OK) return st;
      }
    }
  } while (dropped);
  pool_seg_t *s = c.best;
  dmem__pool_range_unindex(p, s);
  while (s->size < need) {
    pool_seg_t *q = s->next;
    dmem__pool_range_unindex(p, q);
    if (s->size + q->size <= need) {
      pool_absorb(p, s, q, s->tag);
    } else {
      size_t take = need - s->size;
      q->addr += take;
      q->size -= take;
      s->size = need;
      dmem__pool_range_index(p, q);
    }
  }
  if (s->tag) dmem__pool_tag_unref(p, s->tag);
  s->tag = NULL;
  s->state = SEG_LIVE;
  dmem__pool_map_put(&p->map, s);
  *ptr_out = (void *)s->addr;
  return DMEM_OK;
}

/* ---- giving blocks back ---------------------------------------------------- */

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
    /* an unknown block was logged by the caller */
    if (st == DMEM_OK)
      (void)dmem__pool_block_release(p, (uintptr_t)ptrs[i], NULL);
    else if (dmem__pool_block_quarantine(p, (uintptr_t)ptrs[i]))
      lost++;
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
void dmem__pool_range_give_back(dmem__pool_t *p, pool_stream_t *ps, void *stream, void *const *ptrs,
                                size_t n, size_t in_use_dec) {
  pool_tag_t *tag = NULL;
  dmem_status_t st = dmem__pool_tag_record(p, ps ? &ps->rec_mu : NULL, ps ? &ps->rec_seq : NULL,
                                           stream, pool_stream_key(p, stream), &tag);
  pthread_mutex_lock(&p->mu);
  p->global_locks++;
  p->in_use -= in_use_dec;
  if (tag) dmem__pool_tag_link(p, tag);
  for (size_t i = 0; i < n; i++) {
    pool_seg_t *s;
    size_t rs;
    if (!dmem__pool_block_find(p, (uintptr_t)ptrs[i], &s, &rs))
      DMEM_LOG_AT(DMEM_LOG_ERROR, "pool: free of %p, which is not a live block: ignored", ptrs[i]);
    else if (st == DMEM_OK)
      (void)dmem__pool_block_release(p, (uintptr_t)ptrs[i], tag);
  }
  if (tag) dmem__pool_tag_unref(p, tag);
  pthread_mutex_unlock(&p->mu);
  if (st != DMEM_OK) pool_release_synced(p, stream, ptrs, n);
}

/* Blocks freed on a stream with a cache struct that do not go to (or leave)
 * a cache: they join the free ranges under the stream's open lazy tag,
 * recording nothing (see the header comment). in_use_dec as in
 * dmem__pool_range_give_back. No lock held except possibly table_mu. */
void dmem__pool_range_free_lazy(dmem__pool_t *p, pool_stream_t *ps, void *stream, void *const *ptrs,
                                size_t n, size_t in_use_dec) {
  pool_tag_t *tag = NULL;
  dmem_status_t st = DMEM_OK;
  size_t failed_from = n; /* blocks from here on got no tag */
  pthread_mutex_lock(&p->mu);
  p->global_locks++;
  p->in_use -= in_use_dec;
  for (size_t i = 0; i < n; i++) {
    pool_seg_t *s;
    size_t rs;
    if (!dmem__pool_block_find(p, (uintptr_t)ptrs[i], &s, &rs)) {
      DMEM_LOG_AT(DMEM_LOG_ERROR, "pool: free of %p, which is not a live block: ignored", ptrs[i]);
      continue;
    }
    if (st == DMEM_OK) st = dmem__pool_tag_lazy(p, ps, stream, &tag);
    if (st == DMEM_OK) {
      (void)dmem__pool_block_release(p, (uintptr_t)ptrs[i], tag);
    } else {
      failed_from = i;
      break;
    }
  }
  pthread_mutex_unlock(&p->mu);
  if (failed_from < n) pool_release_synced(p, stream, ptrs + failed_from, n - failed_from);
}

void dmem__pool_ranges_destroy(dmem__pool_t *p) {
  for (pool_run_t *r = p->runs, *n; r; r = n) {
    n = r->anext;
    free(r);
  }
  free(p->deferred);
  for (pool_seg_t *d = p->unused, *n; d; d = n) {
    n = d->pnext;
    free(d);
  }
  free(p->map.slots);
}
