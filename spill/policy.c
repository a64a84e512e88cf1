/*
 * spill/policy.c - choosing spill victims and spilling them: the controller's
 * selection when it gives one, else lowest priority first and, within a
 * priority, least recently unlocked first.
 */
#include "runtime/internal.h"
#include <stdlib.h>


typedef struct candidate {
  int priority;
  uint64_t last_use;
  dmem__buffer_t *b;
  dmem_handle_t h;
} candidate_t;

static int cmp_candidates(const void *a, const void *b) {
  const candidate_t *x = a, *y = b;
  if (x->priority != y->priority) return x->priority < y->priority ? -1 : 1;
  if (x->last_use != y->last_use) return x->last_use < y->last_use ? -1 : 1;
  return 0;
}

/* Stop early on errors that every further victim would hit too. */
static bool hopeless(dmem_status_t st) {
  return st == DMEM_ERR_DEVICE || st == DMEM_ERR_DEVICE_FATAL;
}

static void note(dmem_status_t st, dmem_status_t *first) {
  if (st != DMEM_OK && st != DMEM_ERR_BUSY && st != DMEM_ERR_STALE_HANDLE && *first == DMEM_OK)
    *first = st;
}

static dmem_status_t spill_victim(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                  bool on_demand, size_t *freed, dmem_status_t *first) {
  size_t size = dmem__bsize(b);
  dmem_status_t st = dmem__spill_buffer(rt, b, h, DMEM_TIER_HOST, true);
  if (st == DMEM_OK) {
    *freed += size;
    if (on_demand) dmem_atomic_add_relaxed(&rt->oom_evictions, 1);
  }
  note(st, first);
  return st;
}

/* The first candidate (in policy order) whose block, freed, would join the
 * free ranges beside it into one of at least `contig` bytes; -1 if none. */
static long find_range_maker(dmem_runtime_t *rt, const candidate_t *cand, size_t n,
                             size_t contig) {
  size_t want = dmem__pool_block_size(contig);
  dmem__pool_flush(rt->pool); /* cached free blocks count as free ranges */
  for (size_t i = 0; i < n; i++) {
    void *dev = dmem__bdev(cand[i].b); /* a hint: the spill re-validates */
    if (dev && dmem__pool_range_if_freed(rt->pool, dev, dmem__bsize(cand[i].b)) >= want)
      return (long)i;
  }
  return -1;
}

dmem_status_t dmem__evict(dmem_runtime_t *rt, size_t need, size_t contig, bool on_demand,
                          size_t *freed_out, dmem_status_t *first_error_out) {
  size_t freed = 0;
  dmem_status_t first = DMEM_OK;
  dmem_atomic_add_relaxed(&rt->lru_epoch, 1); /* unlocks from now on are newer */
  dmem_controller_t c;
  if (dmem__controller_get(rt, &c) && c.select_victims) {
    size_t cap = dmem_atomic_load_relaxed(&rt->buffer_count);
    if (cap < 64) cap = 64;
    dmem_handle_t *v = malloc(cap * sizeof *v);
    if (!v) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "victim array allocation failed");
    size_t n = 0;
    dmem_status_t st = c.select_victims(c.user, need, v, cap, &n);
    if (st != DMEM_OK) {
      free(v);
      return dmem__error(DMEM_ERR_CALLBACK, "controller select_victims returned %s",
                         dmem_status_name(st));
    }
    if (n != DMEM_VICTIMS_DEFAULT) {
      if (n > cap) n = cap;
      for (size_t i = 0; i < n && freed < need; i++) {
        dmem__buffer_t *b = dmem__table_lookup(rt->table, v[i]);
        if (!b) continue;
        st = spill_victim(rt, b, v[i], on_demand, &freed, &first);
        if (hopeless(st)) {
          free(v);
          return st;
        }
      }
    }
    free(v);
    if (freed >= need) goto done;
  }
  {
    uint32_t hw = dmem_atomic_load_acquire(&rt->table->high_water); /* partner: table_take */
    candidate_t *cand = malloc((size_t)(hw ? hw : 1) * sizeof *cand);
    if (!cand) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "candidate array allocation failed");
    size_t n = 0;
    for (uint32_t slot = 0; slot < hw; slot++) {
      dmem__buffer_t *b = dmem__table_slot(rt->table, slot);
      if (!b) break;
      uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: dmem_alloc's release */
      if (dmem__w_state(w) != DMEM_STATE_RESIDENT || dmem__w_count(w) != 0 ||
          (w & (DMEM__F_TRANSIT | DMEM__F_FREED)) || (dmem__bflags(b) & DMEM_ALLOC_PINNED))
        continue;
      cand[n].priority = dmem_atomic_load_relaxed(&b->priority);
      cand[n].last_use = dmem_atomic_load_relaxed(&b->last_use);
      cand[n].b = b;
      cand[n].h = dmem__handle_of(b, w);
      n++;
    }
    qsort(cand, n, sizeof *cand, cmp_candidates);
    long first_pick = contig ? find_range_maker(rt, cand, n, contig) : -1;
    if (first_pick >= 0) {
      /* One victim that makes the range beats several that do not. */
      dmem_status_t st = spill_victim(rt, cand[first_pick].b, cand[first_pick].h, on_demand,
                                      &freed, &first);
      if (hopeless(st)) {
        free(cand);
        return st;
      }
      if (st == DMEM_OK && dmem__pool_fits(rt->pool, contig, NULL)) need = freed;
    }
    for (size_t i = 0; i < n && freed < need; i++) {
      if ((long)i == first_pick) continue;
      dmem_status_t st = spill_victim(rt, cand[i].b, cand[i].h, on_demand, &freed, &first);
      if (hopeless(st)) {
        free(cand);
        return st;
      }
      if (st == DMEM_ERR_HOST_OUT_OF_MEMORY || st == DMEM_ERR_IO) break;
    }
    free(cand);
  }
done:
  *freed_out = freed;
  if (first_error_out) *first_error_out = first;
  return DMEM_OK;
}
