/*
 * runtime/internal.h - the runtime's internal structures.
 *
 * Buffer state word (one _Atomic uint64_t per buffer; every transition is a
 * CAS on it, so lock/unlock of a resident buffer is lock-free):
 *
 *   bits  0..23  lock count
 *   bits 24..27  state (dmem_state_t, or DMEM__STATE_FREE for an empty slot)
 *   bit  28      FREED    dmem_free was called; stale for all but unlock
 *   bit  29      READY    an unspill copy was enqueued; lockers order their
 *                         stream after b->ready_event until the poller sees
 *                         it complete and recycles the staging memory
 *   bit  30      COPYEV   a spill copy is in flight and b->spill_event is
 *                         recorded after it; lockers (which cancel the spill)
 *                         order their stream after that event
 *   bit  31      TRANSIT  one thread owns the buffer's slow-path move
 *                         (spill, unspill, tier change, staging recycle);
 *                         only the owner clears it
 *   bits 32..63  generation (never 0; part of the handle)
 *
 * Reclaim (memory freed, slot recycled) happens exactly once, by whichever
 * party's CAS makes "FREED && count == 0 && !TRANSIT" true: dmem_free, the
 * last dmem_unlock, or the TRANSIT owner when it ends its move.
 */
#ifndef DMEM_INTERNAL_H
#define DMEM_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "atomic.h"
#include "backend/backend.h"
#include "dmem/dmem.h"
#include "error.h"

/* ---- state word --------------------------------------------------------- */
#define DMEM__COUNT_MASK ((uint64_t)0xFFFFFF)
#define DMEM__STATE_SHIFT 24
#define DMEM__STATE_MASK ((uint64_t)0xF << DMEM__STATE_SHIFT)
#define DMEM__F_FREED ((uint64_t)1 << 28)
#define DMEM__F_READY ((uint64_t)1 << 29)
#define DMEM__F_COPYEV ((uint64_t)1 << 30)
#define DMEM__F_TRANSIT ((uint64_t)1 << 31)
#define DMEM__GEN_SHIFT 32
#define DMEM__STATE_FREE 15u

static inline unsigned dmem__w_state(uint64_t w) {
  return (unsigned)((w & DMEM__STATE_MASK) >> DMEM__STATE_SHIFT);
}
static inline uint32_t dmem__w_count(uint64_t w) { return (uint32_t)(w & DMEM__COUNT_MASK); }
static inline uint32_t dmem__w_gen(uint64_t w) { return (uint32_t)(w >> DMEM__GEN_SHIFT); }
static inline uint64_t dmem__w_with_state(uint64_t w, unsigned s) {
  return (w & ~DMEM__STATE_MASK) | ((uint64_t)s << DMEM__STATE_SHIFT);
}
static inline uint32_t dmem__h_gen(dmem_handle_t h) { return (uint32_t)(h >> 32); }
static inline uint32_t dmem__h_slot(dmem_handle_t h) { return (uint32_t)h; }

/* ---- buffers and the handle table ---------------------------------------- */
typedef struct dmem__buffer {
  /* Written by lock/unlock/free (CAS) and by the TRANSIT owner (CAS).
   * Each buffer starts a cache line: threads locking neighbouring buffers
   * do not share lines. */
  _Alignas(64) _Atomic uint64_t word;
  /* LRU tick of the last unlock; written by unlock (relaxed), read by policy. */
  _Atomic uint64_t last_use;
  /* Written by dmem_set_priority (relaxed), read by policy. */
  _Atomic int priority;
  /* Completed spills; written by the TRANSIT owner (relaxed). */
  _Atomic uint64_t spill_count;
  /* Set at alloc before the word is published (release in dmem_alloc).
   * Atomic (relaxed) because the policy and info readers may look at a slot
   * that is being recycled; they validate the word around the read. */
  _Atomic size_t size;
  _Atomic unsigned flags;
  /* Written by the TRANSIT owner before its releasing CAS; read by lockers
   * after their acquiring CAS. */
  void *dev;          /* device memory while RESIDENT */
  void *host;         /* host copy while DEFERRED_HOST; staging while READY */
  bool host_charged;  /* host counts against host_used */
  void *ready_event;  /* event after the last unspill copy (owned) */
  /* Event after the current spill copy (from the pool): stored (relaxed)
   * before COPYEV is set with release; read after an acquire that saw COPYEV. */
  _Atomic(void *) spill_event;
  uint32_t slot;      /* index in the table; set once when the chunk is made */
  uint32_t next_free; /* free-list link, under the table mutex */
} dmem__buffer_t;

#define dmem__bsize(b) dmem_atomic_load_relaxed(&(b)->size)
#define dmem__bflags(b) dmem_atomic_load_relaxed(&(b)->flags)

#define DMEM__CHUNK_BITS 12
#define DMEM__CHUNK_SLOTS (1u << DMEM__CHUNK_BITS)
#define DMEM__MAX_CHUNKS 65536u
#define DMEM__NO_SLOT UINT32_MAX

typedef struct dmem__table {
  /* Chunk pointers: published with release by table_grow under mu, read
   * with acquire by dmem__table_lookup. Never freed before destroy. */
  _Atomic(dmem__buffer_t *) chunks[DMEM__MAX_CHUNKS];
  pthread_mutex_t mu;   /* free list and high-water mark */
  uint32_t free_head;
  _Atomic uint32_t high_water; /* slots ever handed out; written under mu */
} dmem__table_t;

dmem_status_t dmem__table_init(dmem__table_t *t);
void dmem__table_fini(dmem__table_t *t);
/* Take a slot; its word holds the next generation with state FREE. */
dmem_status_t dmem__table_take(dmem__table_t *t, uint32_t *slot_out, dmem__buffer_t **b_out);
/* Give back a slot: bump its generation (skipping 0), mark FREE, recycle. */
void dmem__table_give(dmem__table_t *t, dmem__buffer_t *b);
dmem__buffer_t *dmem__table_slot(dmem__table_t *t, uint32_t slot);
/* Buffer for a handle, or NULL if the slot cannot exist (gen not checked). */
static inline dmem__buffer_t *dmem__table_lookup(dmem__table_t *t, dmem_handle_t h) {
  uint32_t slot = dmem__h_slot(h);
  if (dmem__h_gen(h) == 0 || (slot >> DMEM__CHUNK_BITS) >= DMEM__MAX_CHUNKS) return NULL;
  /* acquire: partner is the release store in table.c:table_grow */
  dmem__buffer_t *c = dmem_atomic_load_acquire(&t->chunks[slot >> DMEM__CHUNK_BITS]);
  if (!c || slot >= dmem_atomic_load_acquire(&t->high_water)) return NULL;
  return &c[slot & (DMEM__CHUNK_SLOTS - 1)];
}

/* ---- per-stream lock registry ------------------------------------------- */
typedef struct dmem__reg_entry {
  dmem__buffer_t *b;
  dmem_handle_t h;
} dmem__reg_entry_t;

typedef struct dmem__reg_list {
  void *stream;
  dmem__reg_entry_t *v;
  size_t n, cap;
} dmem__reg_list_t;

typedef struct dmem__release {
  struct dmem__release *next;
  void *event;
  dmem__reg_entry_t *v;
  size_t n;
} dmem__release_t;

typedef struct dmem__registry {
  pthread_mutex_t mu;
  dmem__reg_list_t *lists; /* one per stream with registered locks */
  size_t nlists, caplists;
  dmem__release_t *pending; /* stream releases waiting for their event */
  _Atomic size_t npending;  /* written under mu; read lock-free as a hint */
} dmem__registry_t;

/* ---- pinned host pool (spill/hostpool.c) -------------------------------- */
typedef struct dmem__hostpool dmem__hostpool_t;
dmem_status_t dmem__hostpool_create(dmem__backend_t *be, dmem__hostpool_t **pool_out);
void dmem__hostpool_destroy(dmem__hostpool_t *pool);
dmem_status_t dmem__hostpool_alloc(dmem__hostpool_t *pool, size_t size, void **ptr_out);
void dmem__hostpool_free(dmem__hostpool_t *pool, void *ptr);

/* ---- disk tier (spill/disk.c) -------------------------------------------- */
typedef struct dmem__disk dmem__disk_t;
dmem_status_t dmem__disk_create(const char *parent, dmem__disk_t **disk_out);
void dmem__disk_destroy(dmem__disk_t *disk);
dmem_status_t dmem__disk_write(dmem__disk_t *disk, uint64_t key, const void *data, size_t n);
dmem_status_t dmem__disk_read(dmem__disk_t *disk, uint64_t key, void *data, size_t n);
void dmem__disk_remove(dmem__disk_t *disk, uint64_t key);

/* ---- the runtime ------------------------------------------------------------ */
struct dmem_runtime {
  dmem_config_t cfg;
  char *spill_dir_copy;
  dmem__backend_t *be;
  size_t capacity;
  size_t limit;
  size_t host_limit; /* 0: unlimited */

  dmem__table_t *table;
  dmem__registry_t reg;
  dmem__hostpool_t *hostpool;

  pthread_mutex_t disk_mu; /* creates the disk tier lazily */
  _Atomic(dmem__disk_t *) disk; /* release in get_disk, acquire by readers */

  void *spill_stream; /* device->host copies of spills */

  pthread_mutex_t evpool_mu;
  void **evpool;
  size_t evpool_n, evpool_cap;

  /* Buffers with READY set, waiting for the poller to recycle staging. */
  pthread_mutex_t ready_mu;
  dmem__reg_entry_t *ready;
  size_t nready, capready;

  /* Waiters for a buffer's TRANSIT to end. */
  pthread_mutex_t tmu;
  pthread_cond_t tcv;
  _Atomic uint64_t transit_epoch; /* bumped (under tmu) at every transit end */
  _Atomic int spills_in_flight;   /* spills from the device in progress (relaxed) */

  /* Controller: copied under ctl_mu, called with no mutex held. */
  pthread_mutex_t ctl_mu;
  dmem_controller_t ctl;
  _Atomic int has_ctl; /* relaxed hint: skip the mutex when no controller */

  /* Sticky DMEM_ERR_DEVICE_FATAL. Read on the lock fast path: kept on a
   * line of its own, away from the counters that every thread writes. */
  _Alignas(64) _Atomic int fatal;

  /* LRU epoch: read (relaxed) by unlocks, bumped by allocations and
   * eviction passes. On its own line. */
  _Alignas(64) _Atomic uint64_t lru_epoch;

  /* Accounting (relaxed counters). */
  _Alignas(64) _Atomic size_t device_used;  /* reserved for resident buffers */
  _Atomic size_t device_pinned;
  _Atomic size_t host_used;
  _Atomic size_t disk_used;
  _Atomic size_t controller_used;
  _Atomic size_t buffer_count;
  _Atomic uint64_t spill_count, unspill_count, bytes_spilled, bytes_unspilled;
  _Atomic uint64_t ns_spilling, ns_unspilling, oom_evictions, cancelled_spills;
};

/* ---- internal functions shared between files ------------------------------ */
/* Map a backend status: DEVICE_FATAL becomes sticky. */
dmem_status_t dmem__be(dmem_runtime_t *rt, dmem_status_t st);
static inline dmem_status_t dmem__check_live(dmem_runtime_t *rt) {
  if (dmem_atomic_load_relaxed(&rt->fatal))
    return dmem__error(DMEM_ERR_DEVICE_FATAL, "runtime refuses work after a fatal device error");
  return DMEM_OK;
}
uint64_t dmem__now_ns(void);
/* LRU stamp of an unlock: the runtime's epoch (bumped by allocations and
 * eviction passes) above a per-thread sequence. Exact order within a thread,
 * epoch order across threads, and no cache line written that other threads
 * share (a shared counter made unlocks scale badly; the TSC is slow to read
 * on some virtual machines). */
extern _Thread_local uint64_t dmem__tl_lru_seq;
static inline uint64_t dmem__lru_stamp(dmem_runtime_t *rt) {
  return (dmem_atomic_load_relaxed(&rt->lru_epoch) << 32) | (++dmem__tl_lru_seq & 0xFFFFFFFFu);
}

/* buffer.c */
dmem_status_t dmem__lock(dmem_runtime_t *rt, dmem_handle_t h, void *stream, void **dev_out,
                         dmem__buffer_t **b_out);
dmem_status_t dmem__unlock_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
/* Whether word w still belongs to the live buffer named by h. */
static inline bool dmem__word_live(uint64_t w, dmem_handle_t h) {
  return dmem__w_gen(w) == dmem__h_gen(h) && !(w & DMEM__F_FREED) &&
         dmem__w_state(w) != DMEM__STATE_FREE;
}
/* Record and return DMEM_ERR_STALE_HANDLE for h. */
dmem_status_t dmem__stale(dmem_handle_t h);
/* Add size to *used unless that passes limit; on failure *short_by (may be
 * NULL) says by how much. Relaxed: accounting, not synchronisation. */
static inline bool dmem__reserve(_Atomic size_t *used_p, size_t limit, size_t size,
                                 size_t *short_by) {
  size_t used = dmem_atomic_load_relaxed(used_p);
  for (;;) {
    if (used > limit || size > limit - used) {
      if (short_by) *short_by = used + size - limit;
      return false;
    }
    if (atomic_compare_exchange_weak_explicit(used_p, &used, used + size, memory_order_relaxed,
                                              memory_order_relaxed))
      return true;
  }
}
uint64_t dmem__transit_end(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t clear, unsigned state,
                       bool set_state, uint64_t set_flags, int count_delta);
void dmem__reclaim(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t w);
/* After a CAS that cleared TRANSIT (word nw): bookkeeping, reclaim, wake. */
void dmem__transit_after(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw);
static inline dmem_handle_t dmem__handle_of(const dmem__buffer_t *b, uint64_t w) {
  return ((uint64_t)dmem__w_gen(w) << 32) | b->slot;
}
void dmem__transit_wait(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t seen);
void dmem__transit_broadcast(dmem_runtime_t *rt);
dmem_status_t dmem__device_obtain(dmem_runtime_t *rt, size_t size, void **dev_out);
void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size);
extern _Thread_local dmem__buffer_t *dmem__tl_transit;

/* spill/copy.c */
dmem_status_t dmem__spill_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 dmem_tier_t tier, bool by_policy);
dmem_status_t dmem__unspill_owned(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                  uint64_t w, void *stream, bool locking);
void dmem__ready_push(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
void dmem__ready_poll(dmem_runtime_t *rt, bool wait_all);
dmem_status_t dmem__event_get(dmem_runtime_t *rt, void **ev_out);
void dmem__event_put(dmem_runtime_t *rt, void *ev);
dmem_status_t dmem__get_disk(dmem_runtime_t *rt, dmem__disk_t **disk_out);
void dmem__release_host_copy(dmem_runtime_t *rt, dmem__buffer_t *b);

/* spill/policy.c */
dmem_status_t dmem__evict(dmem_runtime_t *rt, size_t need, bool on_demand, size_t *freed_out,
                          dmem_status_t *first_error_out);

/* registry.c */
dmem_status_t dmem__registry_init(dmem__registry_t *r);
void dmem__registry_fini(dmem_runtime_t *rt);
dmem_status_t dmem__registry_add(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *e,
                                 size_t n);
dmem_status_t dmem__registry_take(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t **v_out,
                                  size_t *n_out);
bool dmem__registry_has(dmem_runtime_t *rt, void *stream);
dmem_status_t dmem__registry_release(dmem_runtime_t *rt, void *stream);
size_t dmem__registry_poll(dmem_runtime_t *rt, bool wait_all);

/* controller.c */
void dmem__emit(dmem_runtime_t *rt, dmem_event_kind_t kind, dmem_handle_t h, size_t size,
                dmem_tier_t tier, size_t bytes_needed);
bool dmem__controller_get(dmem_runtime_t *rt, dmem_controller_t *c_out);

/* config.c */
dmem_status_t dmem__config_validate_env(void);

#endif /* DMEM_INTERNAL_H */
