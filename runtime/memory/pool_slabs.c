/*
 * runtime/memory/pool_slabs.c - the device pool's slabs (see pool_parts.h
 * for the pool's files): the large allocations it takes from the backend
 * (be->device_alloc), kept in an array sorted by base. Growth (geometric from
 * min_slab, capped by the limit, or one slab past it for
 * dmem__pool_alloc_past_limit), lookup by address (dmem__pool_slab_of),
 * and giving empty slabs back (trim, destroy).
 * Calls pool_ranges.c (a new slab's first range), pool_tags.c (trim waits
 * for the events of empty slabs) and the backend table.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memory/pool_parts.h"

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
dmem_status_t dmem__pool_slab_grow(dmem__pool_t *p, size_t need, bool past_limit, void **ptr_out,
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
  size_t grain = need <= SIZE_MAX - POOL_SLAB_GRAIN
                     ? (need + POOL_SLAB_GRAIN - 1) & ~(POOL_SLAB_GRAIN - 1)
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
  st = dmem__pool_desc_reserve(p, 2);
  if (st == DMEM_OK) st = dmem__pool_map_reserve(&p->map);
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
  pool_seg_t *s = dmem__pool_desc_get(p);
  s->addr = sl->base;
  s->size = size;
  s->slab = sl;
  s->state = SEG_FREE;
  sl->first = s;
  pool_slab_insert(p, sl);
  p->reserved += size;
  p->misses++;
  dmem__pool_range_index(p, s);
  dmem__pool_range_carve(p, s, need);
  pthread_mutex_unlock(&p->mu);
  *ptr_out = base;
  return DMEM_OK;
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

/* ---- trim -------------------------------------------------------------------- */

#define POOL_TRIM_WAIT_MAX 64
/* Rounds of waiting when more tags are pending than one round holds (other
 * threads may keep freeing meanwhile: trim does not chase them forever). */
#define POOL_TRIM_PASSES 16

/* Take a reference on each distinct pending tag of the slabs that hold
 * nothing but free ranges (at most POOL_TRIM_WAIT_MAX; the caller comes back
 * for the rest). Lazy tags there are recorded first, all of them: a lazy tag
 * never settles on its own, so one left unrecorded would keep its slab. */
/* Add pending tag t to out[0..*n) (recorded first if lazy; skipped when
 * that fails or out is full). */
static void pool_trim_add(dmem__pool_t *p, pool_tag_t *t, pool_tag_t **out, size_t *n) {
  if (pool_tag_settled(t)) return;
  if (t->lazy && dmem__pool_tag_materialise(p, t) != DMEM_OK) return;
  if (*n == POOL_TRIM_WAIT_MAX) return;
  for (size_t j = 0; j < *n; j++)
    if (out[j] == t) return;
  pool_tag_ref(t);
  out[(*n)++] = t;
}

static size_t pool_trim_pending(dmem__pool_t *p, pool_tag_t **out) {
  size_t n = 0;
  /* A class run whose live blocks are all parked goes back to the free
   * ranges once their tags settle (dmem__pool_range_settle), carrying its
   * own pending tag. Only such runs: a run with a block in use cannot
   * leave its slab, and waiting for its tag would only make trim slow. */
  for (size_t j = 0; j < p->ndeferred; j++) {
    pool_run_t *r = dmem__pool_run_of(p, p->deferred[j].addr);
    if (!r || r->nparked != r->nlive) continue;
    pool_trim_add(p, p->deferred[j].tag, out, &n);
    if (r->tag) pool_trim_add(p, r->tag, out, &n);
  }
  for (size_t i = 0; i < p->nslabs; i++) {
    pool_seg_t *s = p->slabs[i]->first;
    while (s && s->state == SEG_FREE) s = s->next;
    if (s) continue; /* a live or quarantined block */
    for (s = p->slabs[i]->first; s; s = s->next) pool_trim_add(p, s->tag, out, &n);
  }
  return n;
}

dmem_status_t dmem__pool_slabs_trim(dmem__pool_t *p, size_t keep, size_t *released_out) {
  /* Slabs that are empty but for pending frees: wait for those events (no
   * pool lock held; giving a slab back, cudaFree, synchronises the device
   * anyway). The tags' references keep their events from being recycled. */
  pool_tag_t *wait[POOL_TRIM_WAIT_MAX];
  for (int pass = 0; pass < POOL_TRIM_PASSES; pass++) {
    pthread_mutex_lock(&p->mu);
    dmem__pool_range_settle(p); /* completed tags do not take a place in `wait` */
    size_t nwait = p->reserved > keep ? pool_trim_pending(p, wait) : 0;
    pthread_mutex_unlock(&p->mu);
    if (!nwait) break;
    for (size_t i = 0; i < nwait; i++) (void)p->be->event_synchronize(p->be, wait[i]->event);
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < nwait; i++) dmem__pool_tag_unref(p, wait[i]);
    pthread_mutex_unlock(&p->mu);
    if (nwait < POOL_TRIM_WAIT_MAX) break; /* every pending tag was waited for */
  }

  size_t released = 0;
  dmem_status_t st = DMEM_OK;
  pthread_mutex_lock(&p->grow_mu);
  for (;;) {
    pthread_mutex_lock(&p->mu);
    dmem__pool_range_settle(p);
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
    dmem__pool_range_unindex(p, victim->first);
    pool_slab_remove(p, victim);
    pthread_mutex_unlock(&p->mu);
    st = p->be->device_free(p->be, (void *)victim->base);
    pthread_mutex_lock(&p->mu);
    if (st != DMEM_OK) {
      pool_slab_insert(p, victim); /* room: it was just removed */
      dmem__pool_range_index(p, victim->first);
      pthread_mutex_unlock(&p->mu);
      break;
    }
    p->reserved -= victim->size;
    released += victim->size;
    dmem__pool_desc_put(p, victim->first);
    free(victim);
    if (p->reserved == 0) p->next_geo = p->min_slab;
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&p->grow_mu);
  if (st != DMEM_OK) return st;
  if (released_out) *released_out = released;
  return DMEM_OK;
}

void dmem__pool_slabs_destroy(dmem__pool_t *p) {
  dmem__backend_t *be = p->be;
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
  free(p->slabs);
}
