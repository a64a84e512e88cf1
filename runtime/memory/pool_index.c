/*
 * runtime/memory/pool_index.c - the device pool's two indexes of segments
 * (see pool_parts.h for the pool's files): the map of LIVE segments by
 * address (open addressing, linear probing, backward-shift deletion), which
 * a free uses to find its block, and the treap of FREE segments keyed by
 * (size, address), whose lower bound is the best fit.
 * Plain data structures: they call no other file of the pool (the bottom
 * of its files). Every function runs under the pool's mu.
 */
#include <stdlib.h>

#include "memory/pool_parts.h"

/* ---- the live-segment map (mu) ---------------------------------------------- */

static size_t pool_map_home(const pool_map_t *m, uintptr_t addr) {
  return (size_t)(((uint64_t)addr >> 8) * UINT64_C(0x9E3779B97F4A7C15) >> m->shift);
}

pool_seg_t *dmem__pool_map_find(const pool_map_t *m, uintptr_t addr) {
  if (!m->cap) return NULL;
  size_t mask = m->cap - 1;
  for (size_t i = pool_map_home(m, addr);; i = (i + 1) & mask) {
    pool_seg_t *s = m->slots[i];
    if (!s || s->addr == addr) return s;
  }
}

void dmem__pool_map_put(pool_map_t *m, pool_seg_t *s) {
  size_t mask = m->cap - 1, i = pool_map_home(m, s->addr);
  while (m->slots[i]) i = (i + 1) & mask;
  m->slots[i] = s;
  m->count++;
}

/* Room for one more entry (load at most 1/2). */
dmem_status_t dmem__pool_map_reserve(pool_map_t *m) {
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
    if (old.slots[i]) dmem__pool_map_put(m, old.slots[i]);
  free(old.slots);
  return DMEM_OK;
}

void dmem__pool_map_remove(pool_map_t *m, pool_seg_t *s) {
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

pool_seg_t *dmem__pool_treap_insert(pool_seg_t *t, pool_seg_t *x) {
  if (!t || x->prio > t->prio) {
    pool_treap_split(t, x->size, x->addr, &x->tl, &x->tr);
    return x;
  }
  if (pool_key_cmp(t, x->size, x->addr) > 0)
    t->tl = dmem__pool_treap_insert(t->tl, x);
  else
    t->tr = dmem__pool_treap_insert(t->tr, x);
  return t;
}

pool_seg_t *dmem__pool_treap_erase(pool_seg_t *t, pool_seg_t *x) {
  if (!t) return NULL;
  if (t == x) return pool_treap_join(x->tl, x->tr);
  if (pool_key_cmp(t, x->size, x->addr) > 0)
    t->tl = dmem__pool_treap_erase(t->tl, x);
  else
    t->tr = dmem__pool_treap_erase(t->tr, x);
  return t;
}

/* The smallest key >= (size, addr). */
pool_seg_t *dmem__pool_treap_lower_bound(pool_seg_t *t, size_t size, uintptr_t addr) {
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
