/*
 * runtime/memory/blocks.c - dedicated device blocks: raw allocations that are
 * each a whole backend allocation (cudaMalloc) rather than a range of a pool
 * slab (dmem_device_malloc_dedicated). The driver then sees the allocation
 * itself: cuMemGetAddressRange returns exactly the block, and its IPC handle
 * opens at offset 0 in another process, as libraries built on one
 * cudaMalloc per array (Numba) expect.
 *
 * Freed blocks are cached by their rounded size (the pool's size classes),
 * so an allocation of a size seen before costs no cudaMalloc:
 *  - A freed block remembers the stream its last use was enqueued on. The
 *    same stream takes it back at once (stream order). Another stream T
 *    takes it after an event recorded on that stream then (it covers the
 *    last use; recording later is only more conservative) and a
 *    stream_wait_event on T: no host wait.
 *  - dmem__blocks_stream_forget records that event for every cached block of
 *    a stream about to be destroyed, so nothing is recorded on a dead stream.
 *  - The cache holds at most BLOCKS_CACHE_MAX blocks and max_bytes bytes;
 *    the oldest leave first. A block leaving the cache (overflow, trim,
 *    destroy) waits for its last use (event_synchronize) before
 *    device_free.
 *  - When no event can be recorded (a device error), the host waits for the
 *    block's stream instead; when even that fails, the block is set aside
 *    (`lost`) and freed only at destroy, never reused or freed under a use
 *    that may be pending.
 * One mutex (rank DMEM__RANK_BLOCKS) guards the lists; no backend call that
 * can block runs under it (device_alloc, device_free and event_synchronize
 * run outside; event_record, event_query and stream_wait_event do not
 * block).
 */
#include "memory/memory.h"
#include <string.h>

#define BLOCKS_CACHE_MAX 256u

typedef struct blk_live {
  uintptr_t base;
  size_t size; /* rounded: what device_alloc was asked for */
} blk_live_t;

typedef struct blk_free {
  void *ptr;
  size_t size;
  void *stream; /* last use enqueued here, when `on_stream` */
  void *event;  /* else: last use before this event's record (NULL: done) */
  bool on_stream;
} blk_free_t;

struct dmem__blocks {
  dmem_runtime_t *rt; /* its event pool (core/event.c) */
  dmem__backend_t *be;
  pthread_mutex_t mu;
  blk_live_t *live; /* sorted by base */
  size_t nlive, cap_live;
  blk_free_t free[BLOCKS_CACHE_MAX]; /* oldest first */
  size_t nfree;
  size_t max_bytes;
  size_t live_bytes, free_bytes;
  void **lost; /* blocks whose last use could not be waited for */
  size_t nlost, cap_lost;
  uint64_t allocs, hits;
};

dmem_status_t dmem__blocks_create(dmem_runtime_t *rt, size_t max_bytes,
                                  dmem__blocks_t **blocks_out) {
  dmem__blocks_t *b = calloc(1, sizeof *b);
  if (!b) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "dedicated block table");
  b->rt = rt;
  b->be = rt->be;
  b->max_bytes = max_bytes;
  pthread_mutex_init(&b->mu, NULL);
  *blocks_out = b;
  return DMEM_OK;
}

/* Index of the first live block whose base is > addr (under mu). */
static size_t live_upper(const dmem__blocks_t *b, uintptr_t addr) {
  size_t lo = 0, hi = b->nlive;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (b->live[mid].base <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Under mu. False: no host memory to grow the table. */
static bool live_insert(dmem__blocks_t *b, void *ptr, size_t size) {
  if (b->nlive == b->cap_live) {
    size_t cap = b->cap_live ? b->cap_live * 2 : 64;
    blk_live_t *v = realloc(b->live, cap * sizeof *v);
    if (!v) return false;
    b->live = v;
    b->cap_live = cap;
  }
  size_t i = live_upper(b, (uintptr_t)ptr);
  memmove(&b->live[i + 1], &b->live[i], (b->nlive - i) * sizeof *b->live);
  b->live[i] = (blk_live_t){(uintptr_t)ptr, size};
  b->nlive++;
  b->live_bytes += size;
  return true;
}

/* Under mu: the live block that starts at ptr, or NULL. */
static blk_live_t *live_at(dmem__blocks_t *b, const void *ptr) {
  size_t i = live_upper(b, (uintptr_t)ptr);
  if (i == 0 || b->live[i - 1].base != (uintptr_t)ptr) return NULL;
  return &b->live[i - 1];
}

static void live_erase(dmem__blocks_t *b, blk_live_t *e) {
  size_t i = (size_t)(e - b->live);
  b->live_bytes -= e->size;
  memmove(&b->live[i], &b->live[i + 1], (b->nlive - i - 1) * sizeof *b->live);
  b->nlive--;
}

/* Under mu: remove cache entry i, keeping the age order. */
static blk_free_t free_take(dmem__blocks_t *b, size_t i) {
  blk_free_t e = b->free[i];
  memmove(&b->free[i], &b->free[i + 1], (b->nfree - i - 1) * sizeof *b->free);
  b->nfree--;
  b->free_bytes -= e.size;
  return e;
}

static void put_event(dmem__blocks_t *b, void *ev) {
  if (ev) dmem__event_put(b->rt, ev);
}

/* Turn e's stream into an event recorded now (covers its last use). */
static dmem_status_t entry_record(dmem__blocks_t *b, blk_free_t *e) {
  if (!e->on_stream) return DMEM_OK;
  void *ev = NULL;
  dmem_status_t st = dmem__event_get(b->rt, &ev);
  if (st != DMEM_OK) return st;
  st = b->be->event_record(b->be, ev, e->stream);
  if (st != DMEM_OK) {
    dmem__event_put(b->rt, ev);
    return st;
  }
  e->on_stream = false;
  e->stream = NULL;
  e->event = ev;
  return DMEM_OK;
}

/* Set a block aside until destroy (outside mu). */
static void set_aside(dmem__blocks_t *b, void *ptr) {
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  if (b->nlost == b->cap_lost) {
    size_t cap = b->cap_lost ? b->cap_lost * 2 : 8;
    void **v = realloc(b->lost, cap * sizeof *v);
    if (!v) {
      dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
      return; /* no host memory even for that: the device keeps it to the end */
    }
    b->lost = v;
    b->cap_lost = cap;
  }
  b->lost[b->nlost++] = ptr;
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
}

/* Wait on the host for e's last use: its event, or else its whole stream. */
static dmem_status_t entry_wait(dmem__blocks_t *b, blk_free_t *e) {
  dmem_status_t st = entry_record(b, e);
  if (st != DMEM_OK && e->on_stream) st = b->be->stream_synchronize(b->be, e->stream);
  else if (st == DMEM_OK && e->event) st = b->be->event_synchronize(b->be, e->event);
  if (st == DMEM_OK) {
    e->on_stream = false;
    put_event(b, e->event);
    e->event = NULL;
  }
  return st;
}

/* Give a block that left the cache back to the backend after its last use.
 * When that use cannot be waited for (a device error) the block is set
 * aside until destroy rather than freed under a pending use; the status is
 * returned for the caller to keep (fatal errors are sticky). */
static dmem_status_t entry_release(dmem__blocks_t *b, blk_free_t *e) {
  dmem_status_t st = entry_wait(b, e);
  if (st != DMEM_OK) {
    put_event(b, e->event); /* destroyed with the others */
    set_aside(b, e->ptr);
    return st;
  }
  return b->be->device_free(b->be, e->ptr);
}

/* Release n entries the caller took out of the cache, outside mu. */
static dmem_status_t release_all(dmem__blocks_t *b, blk_free_t *out, size_t n) {
  dmem_status_t first = DMEM_OK;
  for (size_t i = 0; i < n; i++) {
    dmem_status_t st = entry_release(b, &out[i]);
    if (st != DMEM_OK && first == DMEM_OK) first = st;
  }
  return first;
}

dmem_status_t dmem__blocks_alloc(dmem__blocks_t *b, size_t size, void *stream, void **ptr_out) {
  size_t rsize = dmem__pool_block_size(size);
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  b->allocs++;
  /* newest first: the same stream's block, else any block of that size */
  size_t pick = SIZE_MAX;
  for (size_t i = b->nfree; i-- > 0;) {
    blk_free_t *e = &b->free[i];
    if (e->size != rsize) continue;
    if (e->on_stream && e->stream == stream) {
      pick = i;
      break;
    }
    if (pick == SIZE_MAX) pick = i;
  }
  if (pick != SIZE_MAX) {
    blk_free_t e = free_take(b, pick);
    b->hits++;
    if (!live_insert(b, e.ptr, e.size)) {
      b->free[b->nfree++] = e; /* back where it was: the newest end is free */
      b->free_bytes += e.size;
      b->hits--;
      dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "dedicated block table could not grow");
    }
    dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
    dmem_status_t st = DMEM_OK;
    if (!(e.on_stream && e.stream == stream)) {
      /* another stream's block: order `stream` after its last use (an
       * event), or else wait for it on the host */
      st = entry_record(b, &e);
      if (st == DMEM_OK && e.event && b->be->event_query(b->be, e.event) != DMEM_OK)
        st = b->be->stream_wait_event(b->be, stream, e.event);
      if (st != DMEM_OK) st = entry_wait(b, &e);
      if (st != DMEM_OK) {
        /* unorderable: set aside, never handed out */
        dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
        blk_live_t *l = live_at(b, e.ptr);
        if (l) live_erase(b, l);
        dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
        put_event(b, e.event);
        set_aside(b, e.ptr);
        return st;
      }
      put_event(b, e.event);
    }
    *ptr_out = e.ptr;
    return DMEM_OK;
  }
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);

  void *p = NULL;
  dmem_status_t st = b->be->device_alloc(b->be, rsize, &p);
  if (st == DMEM_ERR_OUT_OF_MEMORY) {
    /* cached blocks of other sizes may be what fills the device */
    size_t released = 0;
    if (dmem__blocks_trim(b, 0, &released) == DMEM_OK && released > 0)
      st = b->be->device_alloc(b->be, rsize, &p);
  }
  if (st != DMEM_OK) return st;
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  bool ok = live_insert(b, p, rsize);
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
  if (!ok) {
    b->be->device_free(b->be, p); /* never used: nothing pending on it */
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "dedicated block table could not grow");
  }
  *ptr_out = p;
  return DMEM_OK;
}

dmem_status_t dmem__blocks_free(dmem__blocks_t *b, void *ptr, void *stream) {
  blk_free_t out[BLOCKS_CACHE_MAX];
  size_t nout = 0;
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  blk_live_t *l = live_at(b, ptr);
  if (!l) {
    dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%p is not a live dedicated block", ptr);
  }
  size_t size = l->size;
  live_erase(b, l);
  /* make room: the oldest leave while the cache is over its bounds */
  while (b->nfree > 0 &&
         (b->nfree == BLOCKS_CACHE_MAX || b->free_bytes + size > b->max_bytes))
    out[nout++] = free_take(b, 0);
  bool cached = size <= b->max_bytes;
  if (cached) {
    b->free[b->nfree++] = (blk_free_t){ptr, size, stream, NULL, true};
    b->free_bytes += size;
  }
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
  if (!cached) out[nout++] = (blk_free_t){ptr, size, stream, NULL, true};
  return release_all(b, out, nout);
}

dmem_status_t dmem__blocks_find(dmem__blocks_t *b, const void *ptr, void **base_out,
                                size_t *size_out) {
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  size_t i = live_upper(b, (uintptr_t)ptr);
  bool in = i > 0 && (uintptr_t)ptr < b->live[i - 1].base + b->live[i - 1].size;
  blk_live_t e = in ? b->live[i - 1] : (blk_live_t){0, 0};
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
  if (!in) return DMEM_ERR_INVALID_ARGUMENT; /* not ours: the caller looks elsewhere */
  *base_out = (void *)e.base;
  *size_out = e.size;
  return DMEM_OK;
}

void dmem__blocks_stream_forget(dmem__blocks_t *b, void *stream) {
  /* Take the stream's entries out, record their events, put them back at
   * the old end (they keep their place among the oldest). */
  blk_free_t mine[BLOCKS_CACHE_MAX];
  size_t n = 0;
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  for (size_t i = 0; i < b->nfree;) {
    if (b->free[i].on_stream && b->free[i].stream == stream) mine[n++] = free_take(b, i);
    else i++;
  }
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
  if (n == 0) return;
  for (size_t i = 0; i < n; i++) {
    if (entry_record(b, &mine[i]) != DMEM_OK && entry_wait(b, &mine[i]) != DMEM_OK) {
      put_event(b, mine[i].event);
      set_aside(b, mine[i].ptr); /* neither: never reused */
      mine[i].size = 0;
    }
  }
  size_t m = 0; /* compact out the ones set aside */
  for (size_t i = 0; i < n; i++)
    if (mine[i].size) mine[m++] = mine[i];
  n = m;
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  size_t room = BLOCKS_CACHE_MAX - b->nfree, keep = n < room ? n : room;
  memmove(&b->free[keep], &b->free[0], b->nfree * sizeof *b->free);
  memcpy(&b->free[0], &mine[n - keep], keep * sizeof *b->free);
  b->nfree += keep;
  for (size_t i = 0; i < keep; i++) b->free_bytes += mine[n - keep + i].size;
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
  release_all(b, mine, n - keep); /* only when other threads refilled the cache */
}

dmem_status_t dmem__blocks_trim(dmem__blocks_t *b, size_t keep, size_t *released_out) {
  blk_free_t out[BLOCKS_CACHE_MAX];
  size_t nout = 0, bytes = 0;
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  while (b->nfree > 0 && b->free_bytes > keep) {
    out[nout] = free_take(b, 0);
    bytes += out[nout++].size;
  }
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
  dmem_status_t st = release_all(b, out, nout);
  if (released_out) *released_out = bytes;
  return st;
}

void dmem__blocks_stats(dmem__blocks_t *b, dmem__blocks_stats_t *out) {
  dmem__mutex_lock(&b->mu, DMEM__RANK_BLOCKS);
  out->live = b->nlive;
  out->live_bytes = b->live_bytes;
  out->cached = b->nfree;
  out->cached_bytes = b->free_bytes;
  out->allocs = b->allocs;
  out->hits = b->hits;
  dmem__mutex_unlock(&b->mu, DMEM__RANK_BLOCKS);
}

void dmem__blocks_destroy(dmem__blocks_t *b) {
  if (!b) return;
  dmem__blocks_trim(b, 0, NULL);
  /* blocks the user never freed, and those set aside: the runtime
   * synchronised before destroy */
  for (size_t i = 0; i < b->nlive; i++) b->be->device_free(b->be, (void *)b->live[i].base);
  for (size_t i = 0; i < b->nlost; i++) b->be->device_free(b->be, b->lost[i]);
  free(b->lost);
  free(b->live);
  pthread_mutex_destroy(&b->mu);
  free(b);
}
