/*
 * runtime/memory/hostpool.c - pinned host memory for spilled bytes and staging.
 *
 * cudaMallocHost costs 0.7 ms to 28 ms a call (anchors.md), so it never runs
 * per spill: the pool takes large chunks from the backend and suballocates
 * them first-fit from an address-ordered free list, coalescing neighbours on
 * free. Each block carries a small header with its size.
 *
 * Growth happens off the spill path where it can: a background thread
 * (when the pool is created with one: the CUDA backend) keeps the free
 * bytes at or above the headroom, the bytes carved in the last 100-200 ms
 * (two buckets of DMEM__HOSTPOOL_BUCKET_NS) net of the bytes freed in them,
 * at least one minimum chunk and at most `max_headroom`
 * (dmem_config_t.host_headroom, default 4 GiB; 0: the thread never grows
 * the pool). Net: a loop that unspills as much as it spills (examples/
 * cupy_loop.py, 50 GB/s each way) drains nothing; keeping its gross rate
 * free (up to the 4 GiB cap) grew the pool by two chunks inside its timed
 * loop on an H100, against 0-1 net. Paced by demand, the pool stays ahead
 * of a burst of spills (cuBLAS at 2x oversubscription spills 256 MiB every
 * 20 ms; pinning runs at 22-24 GB/s) yet holds little more than it needs
 * when spills come slowly: a fixed fraction of what it holds (a quarter,
 * before) kept gigabytes pinned and unused in a Dask worker. Chunks grow
 * geometrically (half of what is held, between the backend's minimum and
 * 1 GiB) and are sized to a whole number of the last large block, so that
 * 256 MiB blocks fill a 1 GiB chunk four times rather than three; but no
 * chunk is larger than the largest of the block's need, max_headroom and
 * the minimum chunk, so that a small headroom also leaves no large chunk
 * unused (a Dask worker's pool held 4.8 GB more than its spilled data with
 * the 4 GiB headroom and 1 GiB chunks). An allocation that finds no room
 * still grows the pool itself. Nobody holds
 * the pool's mutex across the backend's host_alloc / host_free: one thread
 * grows at a time (`growing`), others wait for it on `cv` and look again.
 *
 * Pageable fallback (pools with a background thread: the CUDA backend): an
 * allocation that finds no room while another thread is pinning a chunk
 * does not wait for it when its block is at most the backend's
 * host_pageable_max (0: any size). With cudaMallocHost (2-3 GB/s), pinning
 * 1 GiB takes a few hundred ms, a spill's copy of 256 MiB 5 ms; with the
 * register way (22-24 GB/s) waiting for the chunk is cheaper than faulting
 * in a large pageable block from one thread, and only small blocks fall
 * back. It takes ordinary (pageable) host memory, outside the chunks:
 * copies to and from it are slower and not asynchronous, but nothing waits
 * for the pinning. Such blocks are marked in their header (no chunk) and go
 * back to the C heap when freed; the pool's limit bounds only the pinned
 * chunks.
 *
 * Bounds and shrinking: the chunks never hold more than `limit` bytes (0:
 * unlimited); dmem__hostpool_trim gives wholly free chunks back, and the
 * background thread does so itself after the pool has been idle (no
 * allocation) for DMEM__HOSTPOOL_IDLE_NS, keeping one chunk. Chunks still
 * held are returned at destroy.
 *
 * Reserve (dmem_config_t.host_reserve): pinning runs at 2-3 GB/s against
 * the 55 GB/s of the copies it feeds, so a workload that spills gigabytes
 * at once would wait for it however early the thread starts. `reserve`
 * bytes are pinned at creation instead, in chunks of at most 1 GiB by up
 * to DMEM__HOSTPOOL_PIN_THREADS threads at once (the page faults and the
 * pinning of different chunks proceed in parallel), and no trim goes below
 * them.
 */
#include "memory/memory.h"
#include <stdlib.h>
#include <string.h>
#include <time.h>


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
  bool reserve; /* pinned at create for the reserve: no trim gives it back */
} pool_chunk_t;

typedef struct free_range {
  struct free_range *next;
  char *addr;
  size_t size;
  pool_chunk_t *chunk;
} free_range_t;

typedef struct block_header {
  size_t size;         /* bytes of the block including the header */
  pool_chunk_t *chunk; /* owning chunk; NULL: a pageable block */
  void *base;          /* a pageable block: what posix_memalign returned */
} block_header_t;

#define DMEM__HOSTPOOL_IDLE_NS (30ull * 1000 * 1000 * 1000)
#define DMEM__HOSTPOOL_MAX_CHUNK ((size_t)1 << 30)
#define DMEM__HOSTPOOL_BUCKET_NS (100ull * 1000 * 1000)
#define DMEM__HOSTPOOL_PIN_THREADS 4

struct dmem__hostpool {
  dmem__backend_t *be;
  pthread_mutex_t mu;   /* everything below; never held across host_alloc/free */
  pthread_cond_t cv;    /* growth finished; the thread's wake-up */
  pool_chunk_t *chunks;
  free_range_t *free;   /* address-ordered */
  size_t reserved;      /* bytes in chunks */
  size_t free_bytes;    /* bytes in free ranges */
  size_t min_chunk;
  size_t limit;         /* most bytes in chunks; 0: unlimited */
  size_t max_headroom;  /* the most free bytes the thread keeps; bounds a chunk */
  bool growing;         /* a thread is in host_alloc for the pool */
  bool want_grow;       /* the free bytes ran low: the thread should add a chunk */
  bool stop;
  bool has_thread;     /* also: allocations fall back to pageable memory */
  pthread_t thread;
  uint64_t last_alloc_ns;
  /* demand: bytes carved in the bucket that started at bucket_ns, and in
   * the one before it, and bytes given back in them (the headroom is the
   * difference) */
  uint64_t bucket_ns;
  size_t bucket_cur, bucket_prev;
  size_t freed_cur, freed_prev;
  size_t last_need;     /* the last large block's bytes: chunks hold whole ones */
  uint64_t grows, bg_grows, trims;
  size_t pageable_bytes; /* in pageable blocks now */
  uint64_t pageable_allocs;
  bool pageable_only;    /* tests: every block is a pageable one */
};

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void *pool_thread(void *arg);

static bool free_insert(dmem__hostpool_t *p, char *addr, size_t size, pool_chunk_t *c);

/* ---- the reserve: chunks pinned at create, several at a time ---------------- */

typedef struct reserve_job {
  dmem__backend_t *be;
  size_t size;
  void *base;          /* out */
  dmem_status_t st;    /* out */
  char why[160];       /* out: the backend's detail on failure */
} reserve_job_t;

static void *reserve_pin(void *arg) {
  reserve_job_t *j = arg;
  j->base = NULL;
  j->st = j->be->host_alloc(j->be, j->size, &j->base);
  if (j->st != DMEM_OK) snprintf(j->why, sizeof j->why, "%s", dmem_last_error_detail());
  return NULL;
}

/* Pin `reserve` bytes into p (no other thread uses p yet). */
static dmem_status_t pin_reserve(dmem__hostpool_t *p, size_t reserve) {
  size_t left = round_up(reserve, (size_t)2 << 20);
  if (p->limit && left > p->limit) left = p->limit;
  while (left > 0) {
    reserve_job_t jobs[DMEM__HOSTPOOL_PIN_THREADS];
    pthread_t th[DMEM__HOSTPOOL_PIN_THREADS];
    bool started[DMEM__HOSTPOOL_PIN_THREADS];
    int n = 0;
    for (; n < DMEM__HOSTPOOL_PIN_THREADS && left > 0; n++) {
      size_t c = left < DMEM__HOSTPOOL_MAX_CHUNK ? left : DMEM__HOSTPOOL_MAX_CHUNK;
      left -= c;
      jobs[n] = (reserve_job_t){.be = p->be, .size = c, .st = DMEM_OK};
      /* the first chunk on this thread; the others on threads of their own
       * (one that cannot start pins here, after it) */
      started[n] = n > 0 && pthread_create(&th[n], NULL, reserve_pin, &jobs[n]) == 0;
    }
    (void)reserve_pin(&jobs[0]);
    for (int i = 1; i < n; i++) {
      if (started[i]) pthread_join(th[i], NULL);
      else (void)reserve_pin(&jobs[i]);
    }
    dmem_status_t st = DMEM_OK;
    const char *why = "";
    size_t failed = 0;
    for (int i = 0; i < n; i++) {
      if (jobs[i].st != DMEM_OK) {
        if (st == DMEM_OK) {
          st = jobs[i].st;
          why = jobs[i].why;
          failed = jobs[i].size;
        }
        continue;
      }
      pool_chunk_t *c = malloc(sizeof *c);
      if (!c || !free_insert(p, jobs[i].base, jobs[i].size, c)) {
        free(c);
        (void)p->be->host_free(p->be, jobs[i].base);
        if (st == DMEM_OK) {
          st = DMEM_ERR_HOST_OUT_OF_MEMORY;
          why = "chunk record";
          failed = jobs[i].size;
        }
        continue;
      }
      c->base = jobs[i].base;
      c->size = jobs[i].size;
      c->reserve = true;
      c->next = p->chunks;
      p->chunks = c;
      p->reserved += c->size;
      p->free_bytes += c->size;
      p->grows++;
    }
    if (st != DMEM_OK)
      return dmem__error(st == DMEM_ERR_DEVICE_FATAL ? st : DMEM_ERR_HOST_OUT_OF_MEMORY,
                         "pinned host reserve of %zu bytes: a chunk of %zu bytes failed (%s)",
                         reserve, failed, why);
  }
  return DMEM_OK;
}

dmem_status_t dmem__hostpool_create(dmem__backend_t *be, size_t limit, bool background,
                                    size_t reserve, size_t headroom,
                                    dmem__hostpool_t **pool_out) {
  dmem__hostpool_t *p = calloc(1, sizeof *p);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host pool allocation failed");
  p->be = be;
  p->min_chunk = be->host_chunk_min ? be->host_chunk_min : (size_t)4 << 20;
  p->limit = limit;
  p->max_headroom = headroom;
  if (limit && p->min_chunk > limit) p->min_chunk = round_up(limit, 256);
  pthread_mutex_init(&p->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&p->cv, &ca);
  pthread_condattr_destroy(&ca);
  p->last_alloc_ns = mono_ns();
  if (reserve) {
    dmem_status_t st = pin_reserve(p, reserve);
    if (st != DMEM_OK) {
      dmem__hostpool_destroy(p); /* gives back the chunks that were pinned */
      return st;
    }
  }
  if (background) {
    int rc = pthread_create(&p->thread, NULL, pool_thread, p);
    if (rc != 0) {
      pthread_cond_destroy(&p->cv);
      pthread_mutex_destroy(&p->mu);
      free(p);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host pool thread: pthread_create: %d", rc);
    }
    p->has_thread = true;
  }
  *pool_out = p;
  return DMEM_OK;
}

void dmem__hostpool_destroy(dmem__hostpool_t *p) {
  if (!p) return;
  if (p->has_thread) {
    dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
    p->stop = true;
    pthread_cond_broadcast(&p->cv);
    dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
    pthread_join(p->thread, NULL);
  }
  for (free_range_t *f = p->free, *n; f; f = n) {
    n = f->next;
    free(f);
  }
  for (pool_chunk_t *c = p->chunks, *n; c; c = n) {
    n = c->next;
    (void)p->be->host_free(p->be, c->base);
    free(c);
  }
  pthread_cond_destroy(&p->cv);
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

/* The size of the next chunk for a block of `need` bytes: geometric (half
 * of what is held), at least the backend's minimum, at most 1 GiB unless
 * the block needs more, rounded to hold a whole number (2 to 16) of the
 * last large block (and the first one's page front); then at most the
 * largest of `need` (rounded up to 2 MiB; to 64 KiB with no headroom),
 * max_headroom and the minimum
 * chunk; never past the limit. 0 when the limit leaves no room for `need`.
 * Under mu. */
static size_t next_chunk(const dmem__hostpool_t *p, size_t need) {
  size_t c = p->reserved / 2;
  if (c < p->min_chunk) c = p->min_chunk;
  if (c > DMEM__HOSTPOOL_MAX_CHUNK) c = DMEM__HOSTPOOL_MAX_CHUNK;
  /* With no headroom a chunk is often one block: sized in 64 KiB, not
   * 2 MiB, so that it pins little more than the block (the backend keeps
   * its start on a huge page) */
  size_t need_c = round_up(need, p->max_headroom ? (size_t)2 << 20 : POOL_PAGE_MIN);
  if (c < need) c = need_c;
  size_t unit = p->last_need;
  if (unit >= POOL_PAGE_MIN && unit <= c / 2 && unit > c / 16)
    c = round_up((c + unit - 1) / unit * unit + POOL_PAGE, (size_t)2 << 20);
  size_t most = need_c > p->max_headroom ? need_c : p->max_headroom;
  if (most < p->min_chunk) most = p->min_chunk;
  if (c > most) c = most;
  if (p->limit) {
    if (p->reserved >= p->limit || need > p->limit - p->reserved) return 0;
    if (c > p->limit - p->reserved) c = p->limit - p->reserved;
  }
  return c;
}

/* Add one chunk of csize bytes. Called with mu held and `growing` set by
 * the caller; drops mu around host_alloc. Returns with mu held, `growing`
 * cleared and waiters woken. */
static dmem_status_t grow_locked(dmem__hostpool_t *p, size_t csize, bool background) {
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  DMEM_NVTX_PUSH("dmem pinned pool grow");
  pool_chunk_t *c = malloc(sizeof *c);
  void *base = NULL;
  dmem_status_t st = c ? p->be->host_alloc(p->be, csize, &base) : DMEM_ERR_HOST_OUT_OF_MEMORY;
  DMEM_NVTX_POP();
  char cause[256] = "";
  if (st != DMEM_OK) {
    /* The backend's detail lives in the same thread-local buffer that
     * dmem__error writes: copy it out first (source and destination of
     * one vsnprintf must not overlap). */
    snprintf(cause, sizeof cause, "%s", c ? dmem_last_error_detail() : "chunk record");
    free(c);
  }
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  p->growing = false;
  pthread_cond_broadcast(&p->cv);
  if (st != DMEM_OK)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "pinned host pool could not grow by %zu bytes (%s)", csize, cause);
  c->base = base;
  c->size = csize;
  c->reserve = false;
  c->next = p->chunks;
  p->chunks = c;
  p->reserved += csize;
  p->grows++;
  if (background) p->bg_grows++;
  if (!free_insert(p, base, csize, c))
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host pool free-list node allocation failed");
  p->free_bytes += csize;
  return DMEM_OK;
}

/* Start a new demand bucket when the current one is DMEM__HOSTPOOL_BUCKET_NS
 * old (the one before it is forgotten when older than two). Under mu. */
static void demand_roll(dmem__hostpool_t *p, uint64_t now) {
  if (now < p->bucket_ns || now - p->bucket_ns < DMEM__HOSTPOOL_BUCKET_NS) return;
  bool adjacent = now - p->bucket_ns < 2 * DMEM__HOSTPOOL_BUCKET_NS;
  p->bucket_prev = adjacent ? p->bucket_cur : 0;
  p->freed_prev = adjacent ? p->freed_cur : 0;
  p->bucket_cur = p->freed_cur = 0;
  p->bucket_ns = now;
}

/* The free bytes the background thread keeps: what the last 100-200 ms
 * took net of what they gave back (how fast the free bytes drain), at
 * least one minimum chunk, at most max_headroom (0: none). Under mu. */
static size_t headroom(dmem__hostpool_t *p, uint64_t now) {
  demand_roll(p, now);
  size_t took = p->bucket_cur + p->bucket_prev, gave = p->freed_cur + p->freed_prev;
  size_t h = took > gave ? took - gave : 0;
  if (h < p->min_chunk) h = p->min_chunk;
  if (h > p->max_headroom) h = p->max_headroom;
  return h;
}

/* Whether the free bytes are under the headroom, with room to grow. */
static bool running_low(dmem__hostpool_t *p, uint64_t now) {
  return p->free_bytes < headroom(p, now) && (!p->limit || p->reserved < p->limit);
}

/* A pageable block of size bytes at `align` (the fallback). Called with mu
 * held, which it drops around posix_memalign and returns held. false: no
 * memory (the caller waits for the growth instead). */
static bool pageable_alloc(dmem__hostpool_t *p, size_t size, size_t align, void **ptr_out) {
  size_t lead = align > POOL_HEADER ? align : POOL_HEADER; /* header in front */
  size_t total = lead + round_up(size, POOL_ALIGN);
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  void *base = NULL;
  int rc = posix_memalign(&base, lead, total);
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  if (rc != 0) return false;
  p->pageable_bytes += total;
  p->pageable_allocs++;
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  char *ptr = (char *)base + lead;
  block_header_t *hd = (block_header_t *)(ptr - POOL_HEADER);
  hd->size = total;
  hd->chunk = NULL;
  hd->base = base;
  *ptr_out = ptr;
  return true;
}

/* Bytes a block of size bytes takes, header included, and its alignment.
 * A page-aligned block is rounded to whole pages: the next one carved
 * after it is page-aligned too, so that a run of them leaves no fragment
 * in front of each (a 64 KiB block used to leave 3840 free bytes that only
 * tiny blocks could use, and every later first-fit walked past all of
 * them: O(n) per allocation with n blocks live). */
static size_t block_need(size_t size, size_t *align_out) {
  size_t align = size >= POOL_PAGE_MIN ? POOL_PAGE : POOL_ALIGN;
  size_t need = round_up(size, POOL_ALIGN) + POOL_HEADER;
  if (align == POOL_PAGE) need = round_up(need, POOL_PAGE);
  *align_out = align;
  return need;
}

/* First fit of a block of `need` bytes at `align` (the data after the
 * header aligned); false when no range holds it. Under mu. */
static bool carve_locked(dmem__hostpool_t *p, size_t need, size_t align, void **ptr_out) {
  /* First fit at the block's alignment; failing that, a range that holds
   * the block only unaligned (the disk tier bounces such a block) rather
   * than growing the pool. */
  free_range_t **fit = NULL, **fit_unaligned = NULL;
  size_t front = 0;
  for (free_range_t **pp = &p->free; *pp; pp = &(*pp)->next) {
    free_range_t *f = *pp;
    /* the block starts `front` bytes into the range (0 unless aligned to
     * a page); that front stays free */
    size_t fr = round_up((size_t)(uintptr_t)f->addr + POOL_HEADER, align) - POOL_HEADER -
                (size_t)(uintptr_t)f->addr;
    if (f->size >= fr + need) {
      fit = pp;
      front = fr;
      break;
    }
    if (!fit_unaligned && f->size >= need) fit_unaligned = pp;
  }
  if (!fit) fit = fit_unaligned;
  if (!fit) return false;
  /* a page-aligned block in the middle of a range splits it in two: one
   * more range record (without it, the block goes unaligned) */
  free_range_t *back_rec = NULL;
  if (front > 0 && (*fit)->size > front + need) {
    back_rec = malloc(sizeof *back_rec);
    if (!back_rec) front = 0;
  }
  free_range_t **pp = fit, *f = *fit;
  char *addr = f->addr + front;
  pool_chunk_t *c = f->chunk;
  if (front > 0) {
    size_t back = f->size - front - need;
    f->size = front;
    if (back_rec) {
      back_rec->addr = addr + need;
      back_rec->size = back;
      back_rec->chunk = c;
      back_rec->next = f->next;
      f->next = back_rec;
    }
  } else if (f->size == need) {
    *pp = f->next;
    free(f);
  } else {
    f->addr += need;
    f->size -= need;
  }
  p->free_bytes -= need;
  demand_roll(p, p->last_alloc_ns);
  p->bucket_cur += need;
  if (p->has_thread && running_low(p, p->last_alloc_ns) && !p->want_grow) {
    p->want_grow = true; /* off this path: the thread adds the next chunk */
    pthread_cond_broadcast(&p->cv);
  }
  block_header_t *hd = (block_header_t *)addr;
  hd->size = need;
  hd->chunk = c;
  *ptr_out = addr + POOL_HEADER;
  return true;
}

dmem_status_t dmem__hostpool_alloc(dmem__hostpool_t *p, size_t size, void **ptr_out) {
  if (size > SIZE_MAX / 2) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host block too large");
  size_t align;
  size_t need = block_need(size, &align);
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  p->last_alloc_ns = mono_ns();
  if (p->pageable_only) {
    if (pageable_alloc(p, size, align, ptr_out)) return DMEM_OK;
    dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "no pageable memory for %zu bytes", size);
  }
  if (need >= POOL_PAGE_MIN) p->last_need = need;
  for (;;) {
    if (carve_locked(p, need, align, ptr_out)) {
      dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
      return DMEM_OK;
    }
    if (p->growing) {
      /* someone is adding a chunk: with a background thread, do not wait
       * for the pinning; else wait for it and look again */
      if (p->has_thread && (!p->be->host_pageable_max || size <= p->be->host_pageable_max) &&
          pageable_alloc(p, size, align, ptr_out))
        return DMEM_OK;
      if (p->growing) pthread_cond_wait(&p->cv, &p->mu); /* still: mu was dropped */
      continue;
    }
    size_t csize = next_chunk(p, need + align);
    if (csize == 0) {
      size_t reserved = p->reserved;
      dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                         "pinned host pool at its limit: %zu of %zu bytes held, no free block "
                         "of %zu bytes",
                         reserved, p->limit, size);
    }
    p->growing = true;
    dmem_status_t st = grow_locked(p, csize, false);
    if (st != DMEM_OK) {
      dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
      return st;
    }
  }
}

dmem_status_t dmem__hostpool_alloc_n(dmem__hostpool_t *p, const size_t *sizes, size_t n,
                                     void **ptrs_out) {
  size_t i = 0;
  for (size_t k = 0; k < n; k++)
    if (sizes[k] > SIZE_MAX / 2)
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host block too large");
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  p->last_alloc_ns = mono_ns();
  if (!p->pageable_only) {
    for (; i < n; i++) {
      size_t align;
      size_t need = block_need(sizes[i], &align);
      if (need >= POOL_PAGE_MIN) p->last_need = need;
      if (!carve_locked(p, need, align, &ptrs_out[i])) break;
    }
  }
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  /* The rest one by one: growth, the pageable fallback, the limit. */
  for (size_t k = i; k < n; k++) {
    dmem_status_t st = dmem__hostpool_alloc(p, sizes[k], &ptrs_out[k]);
    if (st != DMEM_OK) {
      for (size_t j = 0; j < k; j++) dmem__hostpool_free(p, ptrs_out[j]);
      return st;
    }
  }
  return DMEM_OK;
}

void dmem__hostpool_free(dmem__hostpool_t *p, void *ptr) {
  if (!ptr) return;
  char *addr = (char *)ptr - POOL_HEADER;
  block_header_t *hd = (block_header_t *)addr;
  size_t size = hd->size;
  pool_chunk_t *c = hd->chunk;
  if (!c) { /* a pageable block: back to the C heap */
    void *base = hd->base;
    dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
    p->pageable_bytes -= size;
    dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
    free(base);
    return;
  }
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  if (free_insert(p, addr, size, c)) p->free_bytes += size;
  p->freed_cur += size; /* the demand bucket of the last allocation (rolled there) */
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
}

bool dmem__hostpool_pageable(const void *ptr) {
  const block_header_t *hd = (const block_header_t *)((const char *)ptr - POOL_HEADER);
  return hd->chunk == NULL;
}

/* Unlink wholly free chunks (largest reserved first is not needed: any)
 * but the reserve's until at most `keep` bytes stay held; the unlinked
 * chunks go on *out. Under mu. */
static size_t take_free_chunks(dmem__hostpool_t *p, size_t keep, pool_chunk_t **out) {
  size_t taken = 0;
  for (free_range_t **fp = &p->free; *fp && p->reserved > keep;) {
    free_range_t *f = *fp;
    pool_chunk_t *c = f->chunk;
    if (c->reserve || f->addr != c->base || f->size != c->size) {
      fp = &f->next;
      continue;
    }
    *fp = f->next;
    free(f);
    for (pool_chunk_t **cp = &p->chunks; *cp; cp = &(*cp)->next)
      if (*cp == c) {
        *cp = c->next;
        break;
      }
    p->reserved -= c->size;
    p->free_bytes -= c->size;
    p->trims++;
    taken += c->size;
    c->next = *out;
    *out = c;
  }
  return taken;
}

static void free_chunks(dmem__hostpool_t *p, pool_chunk_t *c) {
  while (c) {
    pool_chunk_t *n = c->next;
    (void)p->be->host_free(p->be, c->base);
    free(c);
    c = n;
  }
}

dmem_status_t dmem__hostpool_trim(dmem__hostpool_t *p, size_t keep, size_t *released_out) {
  pool_chunk_t *gone = NULL;
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  size_t released = take_free_chunks(p, keep, &gone);
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  free_chunks(p, gone); /* cudaFreeHost outside the mutex */
  if (released_out) *released_out = released;
  return DMEM_OK;
}

dmem_status_t dmem__hostpool_alloc_staging(dmem__hostpool_t *p, size_t size, void **ptr_out) {
  dmem_status_t st = dmem__hostpool_alloc(p, size, ptr_out);
  if (st != DMEM_ERR_HOST_OUT_OF_MEMORY || size > SIZE_MAX / 2) return st;
  size_t align;
  (void)block_need(size, &align);
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  if (!p->limit || p->reserved < p->limit) { /* the backend refused: that error stands */
    dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
    return st;
  }
  if (pageable_alloc(p, size, align, ptr_out)) return DMEM_OK; /* mu dropped */
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "no pageable memory for %zu bytes", size);
}

bool dmem__hostpool_at_limit(dmem__hostpool_t *p) {
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  bool at = p->limit && p->reserved >= p->limit;
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  return at;
}

void dmem__hostpool_set_pageable_only(dmem__hostpool_t *p, bool on) {
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  p->pageable_only = on;
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
}

void dmem__hostpool_stats(dmem__hostpool_t *p, dmem__hostpool_stats_t *out) {
  dmem__hostpool_stats_t s;
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  s.reserved = p->reserved;
  s.free = p->free_bytes;
  s.grows = p->grows;
  s.background_grows = p->bg_grows;
  s.trims = p->trims;
  s.pageable = p->pageable_bytes;
  s.pageable_allocs = p->pageable_allocs;
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  *out = s;
}

/* The background thread: grows the pool when it runs low, trims it when
 * idle. Sleeps on cv (at most a second at a time). */
static void *pool_thread(void *arg) {
  dmem__hostpool_t *p = arg;
  dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
  while (!p->stop) {
    if (p->want_grow && !p->growing) {
      /* grow chunk after chunk until the free bytes reach the headroom; a
       * failure stops until the next allocation asks again (allocations
       * then grow the pool themselves, and report) */
      uint64_t now = mono_ns();
      bool again = false;
      if (running_low(p, now)) {
        size_t want = headroom(p, now) - p->free_bytes;
        if (want > DMEM__HOSTPOOL_MAX_CHUNK) want = DMEM__HOSTPOOL_MAX_CHUNK;
        size_t csize = next_chunk(p, want + POOL_PAGE); /* a page-aligned block's front */
        if (csize) {
          p->growing = true;
          again = grow_locked(p, csize, true) == DMEM_OK && running_low(p, mono_ns());
        }
      }
      p->want_grow = again;
      continue;
    }
    uint64_t now = mono_ns();
    if (!p->growing && now - p->last_alloc_ns > DMEM__HOSTPOOL_IDLE_NS &&
        p->reserved > p->min_chunk && p->free_bytes > p->min_chunk) {
      pool_chunk_t *gone = NULL;
      (void)take_free_chunks(p, p->min_chunk, &gone); /* never a reserve chunk */
      p->last_alloc_ns = now; /* once per idle period */
      if (gone) {
        dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
        free_chunks(p, gone);
        dmem__mutex_lock(&p->mu, DMEM__RANK_HOSTPOOL);
      }
      continue;
    }
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += 1;
    pthread_cond_timedwait(&p->cv, &p->mu, &dl);
  }
  dmem__mutex_unlock(&p->mu, DMEM__RANK_HOSTPOOL);
  return NULL;
}
