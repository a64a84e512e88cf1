/*
 * runtime/core/locked.c - the locked bytes of each handle table
 * (dmem_stats' device_locked) without walking the table and without a
 * shared write on the lock path.
 *
 * A lock that takes a buffer's count from 0 adds its size, the unlock (or
 * failed retrieve) that takes it back to 0 subtracts it. The add goes to
 * the calling thread's record, a column per table: only that thread writes
 * the record (relaxed load + store, no read-modify-write), and a reader sums
 * the column over the records of the live threads plus what the exited ones
 * left. A buffer locked on one thread and unlocked on another adds on one
 * record and subtracts on the other; the sum (mod 2^64) is exact whenever no
 * lock or unlock is under way.
 *
 * Records live on one list under g_mu (rank DMEM__RANK_LOCKED, innermost).
 * A thread makes its record at its first add (pthread key: the destructor
 * folds the record into g_retired and frees it at thread exit). A table
 * takes a free column at init and zeroes it in every record (no thread can
 * be writing to a column no live table owns), and gives it back at fini.
 * Past DMEM__LOCKED_SLOTS live tables, or when a record cannot be made, the
 * delta goes to the table's locked_shared (an atomic add).
 */
#include "core/locked.h"

#include <pthread.h>
#include <stdlib.h>

_Thread_local dmem__locked_rec_t *dmem__tl_locked;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_key;
static bool g_key_ok;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static dmem__locked_rec_t *g_recs;            /* g_mu */
static uint64_t g_retired[DMEM__LOCKED_SLOTS]; /* exited threads' sums (g_mu) */
static uint64_t g_used;                       /* columns owned by a table (g_mu) */

_Static_assert(DMEM__LOCKED_SLOTS == 64, "g_used is one bit per column");

/* Thread exit: the record's sums stay counted, in g_retired. */
static void rec_destroy(void *p) {
  dmem__locked_rec_t *r = p;
  dmem__mutex_lock(&g_mu, DMEM__RANK_LOCKED);
  for (unsigned i = 0; i < DMEM__LOCKED_SLOTS; i++)
    g_retired[i] += dmem_atomic_load_relaxed(&r->v[i]);
  if (r->prev) r->prev->next = r->next;
  else g_recs = r->next;
  if (r->next) r->next->prev = r->prev;
  dmem__mutex_unlock(&g_mu, DMEM__RANK_LOCKED);
  if (dmem__tl_locked == r) dmem__tl_locked = NULL;
  free(r);
}

/* fork(): the child gets g_mu unlocked, whoever held it in the parent. */
static void fork_prepare(void) { pthread_mutex_lock(&g_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&g_mu); }
static void fork_child(void) { pthread_mutex_init(&g_mu, NULL); }

static void once_init(void) {
  g_key_ok = pthread_key_create(&g_key, rec_destroy) == 0;
  (void)pthread_atfork(fork_prepare, fork_parent, fork_child);
}

void dmem__locked_init(dmem__table_t *t) {
  pthread_once(&g_once, once_init);
  atomic_init(&t->locked_shared, 0);
  t->locked_index = DMEM__LOCKED_NONE;
  dmem__mutex_lock(&g_mu, DMEM__RANK_LOCKED);
  if (g_used != UINT64_MAX) {
    unsigned i = (unsigned)__builtin_ctzll(~g_used);
    g_used |= (uint64_t)1 << i;
    g_retired[i] = 0;
    for (dmem__locked_rec_t *r = g_recs; r; r = r->next) dmem_atomic_store_relaxed(&r->v[i], 0);
    t->locked_index = i;
  }
  dmem__mutex_unlock(&g_mu, DMEM__RANK_LOCKED);
}

void dmem__locked_fini(dmem__table_t *t) {
  if (t->locked_index >= DMEM__LOCKED_SLOTS) return;
  dmem__mutex_lock(&g_mu, DMEM__RANK_LOCKED);
  g_used &= ~((uint64_t)1 << t->locked_index);
  dmem__mutex_unlock(&g_mu, DMEM__RANK_LOCKED);
  t->locked_index = DMEM__LOCKED_NONE;
}

/* This thread's record, made now; NULL when it cannot be. */
static dmem__locked_rec_t *rec_make(void) {
  pthread_once(&g_once, once_init);
  if (!g_key_ok) return NULL;
  dmem__locked_rec_t *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  if (pthread_setspecific(g_key, r) != 0) {
    free(r);
    return NULL;
  }
  dmem__mutex_lock(&g_mu, DMEM__RANK_LOCKED);
  /* columns of live tables start from 0 in a new record; calloc did it */
  r->next = g_recs;
  if (g_recs) g_recs->prev = r;
  g_recs = r;
  dmem__mutex_unlock(&g_mu, DMEM__RANK_LOCKED);
  dmem__tl_locked = r;
  return r;
}

void dmem__locked_add_slow(dmem__table_t *t, uint64_t delta) {
  unsigned i = t->locked_index;
  if (i < DMEM__LOCKED_SLOTS) {
    dmem__locked_rec_t *r = dmem__tl_locked ? dmem__tl_locked : rec_make();
    if (r) {
      dmem_atomic_store_relaxed(&r->v[i], dmem_atomic_load_relaxed(&r->v[i]) + delta);
      return;
    }
  }
  dmem_atomic_add_relaxed(&t->locked_shared, delta);
}

size_t dmem__locked_bytes(dmem__table_t *t) {
  uint64_t sum = dmem_atomic_load_relaxed(&t->locked_shared);
  unsigned i = t->locked_index;
  if (i < DMEM__LOCKED_SLOTS) {
    dmem__mutex_lock(&g_mu, DMEM__RANK_LOCKED);
    sum += g_retired[i];
    for (dmem__locked_rec_t *r = g_recs; r; r = r->next) sum += dmem_atomic_load_relaxed(&r->v[i]);
    dmem__mutex_unlock(&g_mu, DMEM__RANK_LOCKED);
  }
  return (size_t)sum;
}
