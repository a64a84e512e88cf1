/*
 * runtime/core/locked.h - the bytes of a handle table's locked buffers
 * (dmem_stats' device_locked), counted without a shared write on the lock
 * path (locked.c).
 */
#ifndef DMEM_CORE_LOCKED_H
#define DMEM_CORE_LOCKED_H

#include "core/core.h"

/* ---- locked bytes (core/locked.c) -------------------------------------------
 * Each thread that locks or unlocks keeps a record of per-table sums that it
 * alone writes (a plain add, published relaxed: no read-modify-write on the
 * lock path, no line other threads write); dmem__locked_bytes sums the
 * records of the live threads and what exited threads left (folded in by
 * their destructor). A process holds up to DMEM__LOCKED_SLOTS tables at once
 * with a column each; a table past that counts in its locked_shared. */
#define DMEM__LOCKED_SLOTS 64u
#define DMEM__LOCKED_NONE UINT32_MAX

typedef struct dmem__locked_rec {
  /* Written by the owning thread only (relaxed store of load + delta);
   * read by dmem__locked_bytes (relaxed) under the records' mutex. */
  _Atomic uint64_t v[DMEM__LOCKED_SLOTS];
  struct dmem__locked_rec *prev, *next; /* the records' list (its mutex) */
} dmem__locked_rec_t;

extern _Thread_local dmem__locked_rec_t *dmem__tl_locked;

/* Take a column for t (zeroed in every record), or none. */
void dmem__locked_init(dmem__table_t *t);
/* Give t's column back. */
void dmem__locked_fini(dmem__table_t *t);
/* The first add of a thread: make its record (or count in locked_shared). */
void dmem__locked_add_slow(dmem__table_t *t, uint64_t delta);
/* Bytes of t's buffers with a lock count above 0, now. */
size_t dmem__locked_bytes(dmem__table_t *t);

/* Add delta (a size, or its negation as uint64_t) to t's locked bytes. */
static inline void dmem__locked_add(dmem__table_t *t, uint64_t delta) {
  dmem__locked_rec_t *r = dmem__tl_locked;
  unsigned i = t->locked_index;
  if (__builtin_expect(r != NULL && i < DMEM__LOCKED_SLOTS, 1))
    dmem_atomic_store_relaxed(&r->v[i], dmem_atomic_load_relaxed(&r->v[i]) + delta);
  else
    dmem__locked_add_slow(t, delta);
}

#endif /* DMEM_CORE_LOCKED_H */
