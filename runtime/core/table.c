/*
 * runtime/core/table.c - the handle table: chunks of buffer slots that never move,
 * so that a handle is looked up without a lock; a free list of slots; a
 * generation per slot so that a freed or forged handle is stale, never
 * another buffer. Generations start at a random value per table, so that a
 * handle of another runtime is stale here too (but with probability 2^-32).
 */
#include "core/runtime.h"
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>


/* splitmix64's finaliser: a bijection that scatters nearby inputs. */
static uint64_t table_mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A seed no other table of this or another process is likely to share:
 * getrandom when the kernel gives it, else the clock, the table's address,
 * the pid and a process-wide count. */
static uint64_t table_seed(const dmem__table_t *t) {
  static _Atomic uint64_t tables;
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r) r = 0;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t n = dmem_atomic_add_relaxed(&tables, 1);
  r ^= table_mix((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
  r ^= table_mix((uint64_t)(uintptr_t)t ^ ((uint64_t)getpid() << 40) ^ (n << 20));
  return r;
}

uint32_t dmem__table_first_gen(const dmem__table_t *t, uint32_t slot) {
  uint32_t g = (uint32_t)(table_mix(t->gen_seed ^ slot) >> 32);
  return g ? g : 1;
}

dmem_status_t dmem__table_init(dmem__table_t *t) {
  t->gen_seed = table_seed(t);
  for (uint32_t i = 0; i < DMEM__MAX_CHUNKS; i++) atomic_init(&t->chunks[i], NULL);
  atomic_init(&t->high_water, 0);
  t->free_head = DMEM__NO_SLOT;
  if (pthread_mutex_init(&t->mu, NULL) != 0)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pthread_mutex_init failed");
  dmem__locked_init(t);
  return DMEM_OK;
}

void dmem__table_fini(dmem__table_t *t) {
  for (uint32_t i = 0; i < DMEM__MAX_CHUNKS; i++) {
    dmem__buffer_t *c = dmem_atomic_load_relaxed(&t->chunks[i]);
    if (!c) break;
    free(c);
  }
  dmem__locked_fini(t);
  pthread_mutex_destroy(&t->mu);
}

dmem__buffer_t *dmem__table_slot(dmem__table_t *t, uint32_t slot) {
  /* acquire: partner is the release store in table_grow */
  dmem__buffer_t *c = dmem_atomic_load_acquire(&t->chunks[slot >> DMEM__CHUNK_BITS]);
  return c ? &c[slot & (DMEM__CHUNK_SLOTS - 1)] : NULL;
}

/* Under t->mu. */
static dmem_status_t table_grow(dmem__table_t *t, uint32_t chunk) {
  if (chunk >= DMEM__MAX_CHUNKS)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "handle table full (%u slots)",
                       DMEM__MAX_CHUNKS * DMEM__CHUNK_SLOTS);
  dmem__buffer_t *c = aligned_alloc(_Alignof(dmem__buffer_t), DMEM__CHUNK_SLOTS * sizeof *c);
  if (!c) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "handle table chunk allocation failed");
  memset(c, 0, DMEM__CHUNK_SLOTS * sizeof *c);
  for (uint32_t i = 0; i < DMEM__CHUNK_SLOTS; i++) {
    /* the slot's first generation (random per table), empty slot */
    uint32_t slot = (chunk << DMEM__CHUNK_BITS) | i;
    atomic_init(&c[i].word, ((uint64_t)dmem__table_first_gen(t, slot) << DMEM__GEN_SHIFT) |
                                ((uint64_t)DMEM__STATE_FREE << DMEM__STATE_SHIFT) | DMEM__F_FREED);
    atomic_init(&c[i].last_use, 0);
    atomic_init(&c[i].priority, 0);
    atomic_init(&c[i].spill_count, 0);
    c[i].slot = slot;
  }
  /* release: partner is the acquire load in dmem__table_lookup */
  dmem_atomic_store_release(&t->chunks[chunk], c);
  return DMEM_OK;
}

dmem_status_t dmem__table_take(dmem__table_t *t, uint32_t *slot_out, dmem__buffer_t **b_out) {
  dmem__mutex_lock(&t->mu, DMEM__RANK_TABLE);
  uint32_t slot;
  if (t->free_head != DMEM__NO_SLOT) {
    slot = t->free_head;
    t->free_head = dmem__table_slot(t, slot)->next_free;
  } else {
    slot = dmem_atomic_load_relaxed(&t->high_water);
    if (slot == DMEM__NO_SLOT) {
      dmem__mutex_unlock(&t->mu, DMEM__RANK_TABLE);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "handle table full");
    }
    if ((slot & (DMEM__CHUNK_SLOTS - 1)) == 0) {
      dmem_status_t st = table_grow(t, slot >> DMEM__CHUNK_BITS);
      if (st != DMEM_OK) {
        dmem__mutex_unlock(&t->mu, DMEM__RANK_TABLE);
        return st;
      }
    }
    /* release: partner is the acquire load of high_water in lookup */
    dmem_atomic_store_release(&t->high_water, slot + 1);
  }
  dmem__mutex_unlock(&t->mu, DMEM__RANK_TABLE);
  *slot_out = slot;
  *b_out = dmem__table_slot(t, slot);
  return DMEM_OK;
}

dmem_status_t dmem__table_check_all(dmem__table_t *t, const dmem_handle_t *hs, size_t n) {
  for (size_t i = 0; i < n; i++) {
    dmem__buffer_t *b = dmem__table_lookup(t, hs[i]);
    /* acquire: partner is the release in dmem_buffer_alloc / dmem__table_give */
    if (!b || !dmem__word_live(dmem_atomic_load_acquire(&b->word), hs[i]))
      return dmem__stale(hs[i]);
  }
  return DMEM_OK;
}

void dmem__table_give(dmem__table_t *t, dmem__buffer_t *b) {
  uint32_t slot = b->slot;
  uint64_t w = dmem_atomic_load_relaxed(&b->word);
  uint32_t gen = dmem__w_gen(w) + 1;
  if (gen == 0) gen = 1;
  DMEM_ASSERT((w & DMEM__F_FREED) && dmem__w_count(w) == 0 && !(w & DMEM__F_TRANSIT));
  dmem_atomic_store_relaxed(&b->dev, NULL);
  b->host = NULL;
  /* release: partner is the acquire load of any later lock/free with the old
   * handle, which then sees the new generation and reports it stale */
  dmem_atomic_store_release(&b->word, ((uint64_t)gen << DMEM__GEN_SHIFT) |
                                          ((uint64_t)DMEM__STATE_FREE << DMEM__STATE_SHIFT) |
                                          DMEM__F_FREED);
  dmem__mutex_lock(&t->mu, DMEM__RANK_TABLE);
  b->next_free = t->free_head;
  t->free_head = slot;
  dmem__mutex_unlock(&t->mu, DMEM__RANK_TABLE);
}
