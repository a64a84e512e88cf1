/*
 * runtime/memory/hostpool.c - pinned host memory for spilled bytes and staging.
 *
 * cudaMallocHost costs 0.7 ms to 28 ms a call (anchors.md), so it never runs
 * per spill: the pool takes large chunks from the backend and suballocates
 * them first-fit from an address-ordered free list, coalescing neighbours on
 * free. Chunks are returned at destroy. Each block carries a small header
 * with its size.
 */
#include "internal.h"
#include <stdlib.h>
#include <string.h>


#define POOL_ALIGN 256u
#define POOL_HEADER POOL_ALIGN /* keeps blocks POOL_ALIGN-aligned */
/* Blocks of at least POOL_PAGE_MIN bytes start on a POOL_PAGE boundary, so
 * that the disk tier reads and writes them with O_DIRECT without a bounce
 * copy (spill/disk.c). */
#define POOL_PAGE ((size_t)4096)
#define POOL_PAGE_MIN ((size_t)64 << 10)

typedef struct pool_chunk {
  struct pool_chunk *next;
  char *base;
  size_t size;
} pool_chunk_t;

typedef struct free_range {
  struct free_range *next;
  char *addr;
  size_t size;
  pool_chunk_t *chunk;
} free_range_t;

typedef struct block_header {
  size_t size;         /* bytes of the block including the header */
  pool_chunk_t *chunk; /* owning chunk */
} block_header_t;

struct dmem__hostpool {
  dmem__backend_t *be;
  pthread_mutex_t mu;
  pool_chunk_t *chunks;
  free_range_t *free; /* address-ordered */
  size_t reserved;    /* bytes in chunks */
  size_t min_chunk;
};

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

dmem_status_t dmem__hostpool_create(dmem__backend_t *be, dmem__hostpool_t **pool_out) {
  dmem__hostpool_t *p = calloc(1, sizeof *p);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host pool allocation failed");
  p->be = be;
  p->min_chunk = be->host_chunk_min ? be->host_chunk_min : (size_t)4 << 20;
  pthread_mutex_init(&p->mu, NULL);
  *pool_out = p;
  return DMEM_OK;
}

void dmem__hostpool_destroy(dmem__hostpool_t *p) {
  if (!p) return;
  for (free_range_t *f = p->free, *n; f; f = n) {
    n = f->next;
    free(f);
  }
  for (pool_chunk_t *c = p->chunks, *n; c; c = n) {
    n = c->next;
    (void)p->be->host_free(p->be, c->base);
    free(c);
  }
  pthread_mutex_destroy(&p->mu);
  free(p);
}

/* Insert [addr, addr+size) of chunk c into the free list, coalescing. Under
 * mu. Returns false if a node could not be allocated (the range is lost
 * until destroy; no data is involved). */
static bool free_insert(dmem__hostpool_t *p, char *addr, size_t size, pool_chunk_t *c) {
  free_range_t **pp = &p->free, *prev = NULL;
  while (*pp && (*pp)->addr < addr) {
    prev = *pp;
    pp = &(*pp)->next;
  }
  free_range_t *next = *pp;
  if (prev && prev->chunk == c && prev->addr + prev->size == addr) {
    prev->size += size;
    if (next && next->chunk == c && prev->addr + prev->size == next->addr) {
      prev->size += next->size;
      prev->next = next->next;
      free(next);
    }
    return true;
  }
  if (next && next->chunk == c && addr + size == next->addr) {
    next->addr = addr;
    next->size += size;
    return true;
  }
  free_range_t *f = malloc(sizeof *f);
  if (!f) return false;
  f->addr = addr;
  f->size = size;
  f->chunk = c;
  f->next = next;
  *pp = f;
  return true;
}

dmem_status_t dmem__hostpool_alloc(dmem__hostpool_t *p, size_t size, void **ptr_out) {
  if (size > SIZE_MAX / 2) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host block too large");
  size_t need = round_up(size, POOL_ALIGN) + POOL_HEADER;
  size_t align = size >= POOL_PAGE_MIN ? POOL_PAGE : POOL_ALIGN;
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  for (int attempt = 0; attempt < 2; attempt++) {
    /* first fit at the block's alignment; failing that, a range that holds
     * the block only unaligned (the disk tier bounces such a block) */
    free_range_t **fit = NULL, **fit_unaligned = NULL;
    size_t front = 0;
    for (free_range_t **pp = &p->free; *pp; pp = &(*pp)->next) {
      free_range_t *f = *pp;
      /* the block starts `front` bytes into the range (0 unless aligned
       * to a page); that front stays free */
      front = round_up((size_t)(uintptr_t)f->addr + POOL_HEADER, align) - POOL_HEADER -
              (size_t)(uintptr_t)f->addr;
      if (f->size >= front + need) {
        fit = pp;
        break;
      }
      if (!fit_unaligned && f->size >= need) fit_unaligned = pp;
    }
    if (!fit && fit_unaligned) {
      fit = fit_unaligned;
      front = 0;
    }
    if (fit) {
      free_range_t **pp = fit, *f = *fit;
      char *addr = f->addr + front;
      pool_chunk_t *c = f->chunk;
      if (front > 0) {
        size_t back = f->size - front - need;
        f->size = front;
        if (back > 0) {
          free_range_t *n = malloc(sizeof *n);
          if (n) { /* else the back is lost until destroy; no data is involved */
            n->addr = addr + need;
            n->size = back;
            n->chunk = c;
            n->next = f->next;
            f->next = n;
          }
        }
      } else if (f->size == need) {
        *pp = f->next;
        free(f);
      } else {
        f->addr += need;
        f->size -= need;
      }
      dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
      block_header_t *hd = (block_header_t *)addr;
      hd->size = need;
      hd->chunk = c;
      *ptr_out = addr + POOL_HEADER;
      return DMEM_OK;
    }
    if (attempt == 1) break;
    /* grow: one chunk large enough for this block */
    size_t csize = need + align > p->min_chunk ? round_up(need + align, (size_t)2 << 20)
                                                : p->min_chunk;
    pool_chunk_t *c = malloc(sizeof *c);
    void *base = NULL;
    dmem_status_t st = c ? p->be->host_alloc(p->be, csize, &base) : DMEM_ERR_HOST_OUT_OF_MEMORY;
    if (st != DMEM_OK) {
      free(c);
      dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
      /* The backend's detail lives in the same thread-local buffer that
       * dmem__error writes: copy it out first (source and destination of
       * one vsnprintf must not overlap). */
      char cause[256];
      snprintf(cause, sizeof cause, "%s", dmem_last_error_detail());
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                         "pinned host pool could not grow by %zu bytes (%s)", csize, cause);
    }
    c->base = base;
    c->size = csize;
    c->next = p->chunks;
    p->chunks = c;
    p->reserved += csize;
    if (!free_insert(p, base, csize, c)) {
      dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host pool free-list node allocation failed");
    }
  }
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host pool: no block of %zu bytes", size);
}

void dmem__hostpool_free(dmem__hostpool_t *p, void *ptr) {
  if (!ptr) return;
  char *addr = (char *)ptr - POOL_HEADER;
  block_header_t *hd = (block_header_t *)addr;
  size_t size = hd->size;
  pool_chunk_t *c = hd->chunk;
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  (void)free_insert(p, addr, size, c);
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
}
