/*
 * runtime/core/core.h - the core layer: the buffer state word and its
 * TRANSIT protocol, the handle table, the event pool, the controller's
 * callbacks, configuration, invariant checks and the lock order.
 *
 * Core calls only the backend table and base (status, error detail, log).
 *
 * Buffer state word (one _Atomic uint64_t per buffer; every transition is a
 * CAS on it, so lock/unlock of a resident buffer is lock-free):
 *
 *   bits  0..23  lock count
 *   bits 24..27  state (dmem_state_t, or DMEM__STATE_FREE for an empty slot)
 *   bit  28      FREED        dmem_buffer_free was called; stale for all but unlock
 *   bit  29      UNSPILL_COPY an unspill copy may still be in flight: lockers
 *                             order their stream after b->unspill_event until
 *                             the staging poller sees it complete and
 *                             recycles the staging memory
 *   bit  30      SPILL_COPY   a spill copy is in flight and b->spill_event is
 *                             recorded after it; lockers (which cancel the
 *                             spill) order their stream after that event
 *   bit  31      TRANSIT      one thread owns the buffer's slow-path move
 *                             (spill, unspill, tier change, staging recycle);
 *                             only the owner clears it
 *   bits 32..63  generation (never 0; part of the handle)
 *
 * Reclaim (memory freed, slot recycled) happens exactly once, by whichever
 * party's CAS makes "FREED && count == 0 && !TRANSIT" true: dmem_buffer_free, the
 * last unlock, or the TRANSIT owner when it ends its move (spill/reclaim.c).
 *
 * Lock order of the internal mutexes (a thread holding one may only take
 * mutexes further down this list; Debug builds check it, see
 * dmem__mutex_lock):
 *
 *   1 staging   rt->staging_mu   (its poll may end a move and reclaim)
 *   2 registry  rt->reg.mu
 *   3 stream    a stream record's spin lock, rt->sreg[i].lk (spill/pending.c)
 *   4 pending   rt->pending_mu
 *   5 disk      rt->disk_mu      (lazy creation of the disk tier)
 *   6 control   rt->ctl_mu
 *   7 transit   rt->tmu          (with rt->tcv)
 *   8 table     table->mu
 *   9 hostpool  the pinned host pool's mutex
 *  10 events    rt->evpool_mu
 *  11 raw       a shard of the raw-allocation table (memory/raw.c)
 *  12 blocks    the dedicated blocks' lists (memory/blocks.c)
 *  13 io        the I/O threads' queue (spill/io.c)
 *  14 diskspace the disk tier's extents and bounce buffers (spill/disk.c)
 *  15 ahead     rt->ahead_mu     (wakes the spill-ahead thread; nothing
 *                                 is taken under it)
 *  16 locked    the process's locked-bytes records (core/locked.c; nothing
 *                                 is taken under it)
 *  17 policy    rt->pol.mu       (the default eviction policy's lists,
 *                                 spill/reuse.c; nothing is taken under it)
 *  18 swap      rt->swap_mu      (a retrieve's swap enqueues its copies
 *                                 through the bounce buffer, spill/swap.c;
 *                                 nothing is taken under it)
 *
 * The device pool's mutexes (memory/pool*.c), the stable ranges' shard
 * mutexes (memory/stable.c: held only to find or unlink a range's record)
 * and the backends' own are innermost: none calls up.
 */
#ifndef DMEM_CORE_LAYER_H
#define DMEM_CORE_LAYER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/atomic.h"
#include "backend/backend.h"
#include "base/error.h"
#include "base/nvtx.h"
#include "base/trace.h"
#include "base/sched.h"
#include "dmem/dmem.h"

/* ---- invariant checks ----------------------------------------------------- */

/* Compiled in Debug builds (and so in the sanitizer presets); never on the
 * release hot path. A failed check is a dmem bug, not a user error. */
#ifdef DMEM_DEBUG
#define DMEM_ASSERT(cond)                                                                \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "dmem: invariant failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                           \
    }                                                                                    \
  } while (0)
#else
#define DMEM_ASSERT(cond) ((void)0)
#endif

/* ---- lock order (see the list above) --------------------------------------- */

typedef enum dmem__rank {
  DMEM__RANK_STAGING = 1,
  DMEM__RANK_REGISTRY,
  DMEM__RANK_STREAM,
  DMEM__RANK_PENDING,
  DMEM__RANK_DISK,
  DMEM__RANK_CONTROL,
  DMEM__RANK_TRANSIT,
  DMEM__RANK_TABLE,
  DMEM__RANK_HOSTPOOL,
  DMEM__RANK_EVENTS,
  DMEM__RANK_RAW,
  DMEM__RANK_BLOCKS,
  DMEM__RANK_IO,
  DMEM__RANK_DISK_SPACE,
  DMEM__RANK_AHEAD,
  DMEM__RANK_LOCKED,
  DMEM__RANK_POLICY,
  DMEM__RANK_SWAP
} dmem__rank_t;

#ifdef DMEM_DEBUG
/* Ranks this thread holds, one bit each (core/mutex.c). */
extern _Thread_local unsigned dmem__held_ranks;
#endif

/* Take / drop an internal mutex of the given rank. Debug builds check that
 * the thread holds no mutex of the same or a later rank. */
static inline void dmem__mutex_lock(pthread_mutex_t *m, dmem__rank_t rank) {
#ifdef DMEM_DEBUG
  if (dmem__held_ranks >> rank) {
    fprintf(stderr, "dmem: lock order violated: taking rank %d while holding ranks 0x%x\n",
            (int)rank, dmem__held_ranks);
    abort();
  }
#endif
  DMEM_SCHED_POINT(); /* the schedule fuzzer may yield here (base/sched.h) */
  pthread_mutex_lock(m);
#ifdef DMEM_DEBUG
  dmem__held_ranks |= 1u << rank;
#endif
}

/* Take an internal mutex if it is free now (true), as dmem__mutex_lock
 * checks; false when another thread holds it. */
static inline bool dmem__mutex_trylock(pthread_mutex_t *m, dmem__rank_t rank) {
#ifdef DMEM_DEBUG
  if (dmem__held_ranks >> rank) {
    fprintf(stderr, "dmem: lock order violated: taking rank %d while holding ranks 0x%x\n",
            (int)rank, dmem__held_ranks);
    abort();
  }
#endif
  DMEM_SCHED_POINT();
  if (pthread_mutex_trylock(m) != 0) return false;
#ifdef DMEM_DEBUG
  dmem__held_ranks |= 1u << rank;
#endif
  return true;
}

static inline void dmem__mutex_unlock(pthread_mutex_t *m, dmem__rank_t rank) {
#ifdef DMEM_DEBUG
  DMEM_ASSERT(dmem__held_ranks & (1u << rank));
  dmem__held_ranks &= ~(1u << rank);
#else
  (void)rank;
#endif
  pthread_mutex_unlock(m);
  DMEM_SCHED_POINT();
}

/* ---- state word ------------------------------------------------------------- */

#define DMEM__COUNT_MASK ((uint64_t)0xFFFFFF)
#define DMEM__STATE_SHIFT 24
#define DMEM__STATE_MASK ((uint64_t)0xF << DMEM__STATE_SHIFT)
#define DMEM__F_FREED ((uint64_t)1 << 28)
#define DMEM__F_UNSPILL_COPY ((uint64_t)1 << 29)
#define DMEM__F_SPILL_COPY ((uint64_t)1 << 30)
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

/* Whether word w still belongs to the live buffer named by h. */
static inline bool dmem__word_live(uint64_t w, dmem_handle_t h) {
  return dmem__w_gen(w) == dmem__h_gen(h) && !(w & DMEM__F_FREED) &&
         dmem__w_state(w) != DMEM__STATE_FREE;
}

/* ---- buffers and the handle table (core/table.c) ----------------------------- */

/* One slot: 112 bytes, 16-aligned (issue 25: at most 128 bytes of metadata
 * a buffer, the pool's included; memory/pool*.c keeps no descriptor of a
 * small block). Slots are 112 bytes apart, so no two buffers' state words
 * share a cache line, and the first 16 bytes (the word and dev, all that
 * a lock reads) never straddle one: a slot starts at 0, 16, 32 or 48 of
 * its first line. */
typedef struct dmem__buffer {
  /* Written by lock/unlock/free (CAS) and by the TRANSIT owner (CAS). */
  _Alignas(16) _Atomic uint64_t word;
  /* Device memory while RESIDENT. Written (relaxed) by the TRANSIT owner
   * before its releasing CAS; read by lockers after their acquiring CAS, and
   * (relaxed, as a hint validated by the spill that follows) by the victim
   * policy. */
  _Atomic(void *) dev;
  /* The default policy's mark (spill/reuse.c): set to 0 when the buffer
   * comes to the device; each unlock that brings the count to 0 adds 1,
   * up to 2 (a relaxed load and store next to the word, which the unlock's
   * CAS owns already); the policy consumes it (exchange) under its mutex. */
  _Atomic uint8_t ref;
  /* A pending arrival (dmem__policy_arrive): its kind, or 0. Set
   * (exchange) by the arriving thread, cleared by the policy's drain. */
  _Atomic uint8_t parr;
  /* Under the policy's mutex: the priority class (id + 1) whose list holds
   * the buffer, 0 when in none. */
  uint16_t pcls;
  /* DMEM_ALLOC_PINNED, DMEM_BUFFER_STABLE_ADDRESS: set at alloc (relaxed),
   * before the word is published. */
  _Atomic uint16_t flags;
  /* The default policy's reuse intervals (spill/reuse.c): the last two
   * intervals between unlocks, in ticks of the policy's clock, as 7-bit
   * codes (bits 0-6 the last, 7-13 the one before), and DMEM__PIV_SKIP,
   * which makes the next unlock only clear it. Relaxed load and store by
   * the unlock (next to the word, which its CAS owns already) and by the
   * arriving thread; read by the policy. */
  _Atomic uint16_t pivs;
  /* The eviction policy's recency (spill/reuse.c, spill/policy.c). Under
   * DMEM_EVICTION_LRU: the unlock's LRU stamp (relaxed). Under the default
   * policy: the policy's clock at the last unlock that brought the count
   * to 0, or at its arrival (relaxed: the unlock, the arriving thread; the
   * policy and the push-down read it). */
  _Atomic uint64_t last_use;
  /* Set at alloc before the word is published (release in dmem_buffer_alloc).
   * Atomic (relaxed) because the policy and info readers may look at a slot
   * that is being recycled; they validate the word around the read. */
  _Atomic size_t size;
  /* Written by dmem_buffer_set_priority (relaxed), read by policy. */
  _Atomic int priority;
  /* Completed spills, saturating at UINT32_MAX (dmem__spill_counted): added
   * (relaxed CAS) just after a spill's commit, so possibly by two movers at
   * once. */
  _Atomic uint32_t spill_count;
  /* Written by the TRANSIT owner before its releasing CAS; read by lockers
   * after their acquiring CAS. */
  void *host;           /* pinned host memory: the host tier's copy while
                           DEFERRED_HOST, else unspill staging (while
                           UNSPILL_COPY) or NULL */
  void *unspill_event;  /* event after the last unspill copy (owned) */
  /* Event after the current spill copy (from the pool): stored (relaxed)
   * before SPILL_COPY is set with release; read after an acquire that saw
   * SPILL_COPY. */
  _Atomic(void *) spill_event;
  /* The disk tier's extent (file offset) while the tier holds the buffer:
   * written by the TRANSIT owner's store, read by the next owner's load and
   * drop, or by reclaim. */
  uint64_t disk_off;
  uint32_t slot;      /* index in the table; set once when the chunk is made */
  uint32_t next_free; /* free-list link, under the table mutex */
  /* The default policy's list links (slots; DMEM__NO_SLOT ends a list)
   * and the bytes its list counted when it took the buffer: under the
   * policy's mutex. */
  uint32_t pprev, pnext;
  /* The policy's pending arrivals (a stack of slots): written by the
   * arriving thread before its releasing push, read by the drain. */
  _Atomic uint32_t anext;
  /* Ticks since the last unlock before it left the device, as the
   * arriving thread found them at its arrival (DMEM__ARRIVE_BACK): stored
   * (relaxed) before the push, read by the drain (spill/reuse.c), which
   * may be linking an earlier arrival of the buffer meanwhile. */
  _Atomic uint32_t preuse;
  /* Set (relaxed) by a locker that finds the buffer DEFERRED_HOST and being
   * moved: a host->disk write of it then stops at its next chunk
   * (spill/tier_disk.c), so the lock does not wait for the whole write. The
   * writer clears it when it starts. */
  _Atomic uint8_t io_cancel;
  /* DMEM__WATCH_STORING while the TRANSIT owner calls the controller's
   * store, DMEM__WATCH_FREED once dmem_buffer_free has left the FREE event to it
   * (core/controller.c: dmem__store_watch); 0 otherwise. */
  _Atomic uint8_t store_watch;
  uint8_t plist; /* under the policy's mutex: which of its class's lists */
  /* under the policy's mutex: DMEM__PB_BACK: last taken from the back
   * list; DMEM__PB_SOON: on the window, prefetched and not used since */
  uint8_t pback;
  /* The bytes its list counted when it took the buffer, in 256-byte units
   * rounded up, saturating (dmem__psize_units): under the policy's mutex. */
  uint32_t psize;
} dmem__buffer_t;

/* b->psize's units of a size (rounded up, saturating). */
static inline uint32_t dmem__psize_units(size_t size) {
  size_t u = size / 256 + (size % 256 != 0);
  return u > UINT32_MAX ? UINT32_MAX : (uint32_t)u;
}

/* The whole slot (issue 25: at most 128 bytes of metadata a buffer, the
 * pool's share included: bench_scale --check measures it). */
_Static_assert(sizeof(dmem__buffer_t) <= 112, "buffer metadata grew past 112 bytes");
_Static_assert(offsetof(dmem__buffer_t, dev) + sizeof(void *) <= 16,
               "the lock path's fields leave the slot's first 16 bytes");

/* One more completed spill of b (saturating). */
static inline void dmem__spill_counted(dmem__buffer_t *b) {
  uint32_t c = dmem_atomic_load_relaxed(&b->spill_count);
  while (c != UINT32_MAX && !dmem_atomic_cas_relaxed(&b->spill_count, &c, c + 1u)) {
  }
}

#define dmem__bsize(b) dmem_atomic_load_relaxed(&(b)->size)
#define dmem__bflags(b) dmem_atomic_load_relaxed(&(b)->flags)
#define dmem__bdev(b) dmem_atomic_load_relaxed(&(b)->dev)

static inline dmem_handle_t dmem__handle_of(const dmem__buffer_t *b, uint64_t w) {
  return ((uint64_t)dmem__w_gen(w) << 32) | b->slot;
}

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
  /* Seed of the slots' first generations, random per table: a handle of
   * another runtime (or a forged one) names a live buffer here only if its
   * 32 generation bits happen to match, so it is stale with probability
   * 1 - 2^-32. Written once by dmem__table_init. */
  uint64_t gen_seed;
  /* Locked bytes (dmem_stats' device_locked), counted where a lock count
   * leaves or reaches 0 (core/locked.c): this table's column in every
   * thread's record, DMEM__LOCKED_NONE when all columns were taken (then
   * locked_shared alone counts). Written once by dmem__table_init. */
  unsigned locked_index;
  /* Deltas of threads without a record (relaxed; wraps, summed). */
  _Atomic uint64_t locked_shared;
} dmem__table_t;

dmem_status_t dmem__table_init(dmem__table_t *t);
void dmem__table_fini(dmem__table_t *t);
/* The first generation of a slot of t (never 0). */
uint32_t dmem__table_first_gen(const dmem__table_t *t, uint32_t slot);
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
/* The slot h names, for a caller that checks h against the slot's word
 * before it uses anything else of it (the lock path): as
 * dmem__table_lookup without the look at high_water, whose line (a page
 * away from the chunk pointers) a launch would otherwise pay for. A slot
 * of a made chunk past high_water holds its first generation with state
 * FREE and FREED set (table_grow, before the chunk is published), which
 * every handle check (dmem__word_live, the lock's fast path) refuses, as
 * it refuses a freed slot (and with the same status). */
static inline dmem__buffer_t *dmem__table_lookup_checked(dmem__table_t *t, dmem_handle_t h) {
  uint32_t slot = dmem__h_slot(h);
  if (dmem__h_gen(h) == 0 || (slot >> DMEM__CHUNK_BITS) >= DMEM__MAX_CHUNKS) return NULL;
  /* acquire: partner is the release store in table.c:table_grow */
  dmem__buffer_t *c = dmem_atomic_load_acquire(&t->chunks[slot >> DMEM__CHUNK_BITS]);
  return c ? &c[slot & (DMEM__CHUNK_SLOTS - 1)] : NULL;
}
/* Record and return DMEM_ERR_STALE_HANDLE for h. */
dmem_status_t dmem__stale(dmem_handle_t h);
/* DMEM_ERR_STALE_HANDLE (for the first) unless every handle of hs[0..n)
 * names a live buffer of t now: the entry points check their handles before
 * they move or lock anything, so that a bad one changes nothing. */
dmem_status_t dmem__table_check_all(dmem__table_t *t, const dmem_handle_t *hs, size_t n);

/* ---- the TRANSIT protocol (core/transit.c) ----------------------------------- */

/* The moves the calling thread runs while a callback may be called (a
 * controller's store or retrieve, the events and victim selection of the
 * eviction under a retrieve), innermost first: a stack whose entries live
 * in the movers' frames, so nesting has no bound and costs no allocation.
 * A call from a callback on a buffer of this list gets DMEM_ERR_BUSY at
 * once instead of waiting for its own thread, and an allocation does not
 * wait for this thread's spills (spill/pressure.c). Moves that call no
 * callback while they own TRANSIT (eviction batches, the staging poller,
 * reads, push-downs) are not listed. */
typedef struct dmem__moving {
  const dmem_runtime_t *rt;
  dmem_handle_t h;
  bool spill;               /* a spill from the device: in rt->spills_in_flight */
  struct dmem__moving *up;  /* the enclosing move of this thread, or NULL */
} dmem__moving_t;

/* Push m (in the caller's frame) for h, whose TRANSIT the caller owns; pop
 * it (the innermost entry) when the move and its callbacks are done. */
void dmem__moving_push(dmem__moving_t *m, const dmem_runtime_t *rt, dmem_handle_t h, bool spill);
void dmem__moving_pop(dmem__moving_t *m);
/* h's move has ended (its TRANSIT is given up): its entry, if the calling
 * thread has one, no longer names it, though it stays on the stack (and
 * counts as a spill) until popped. Called at every move's end
 * (spill/reclaim.c). */
void dmem__moving_end(const dmem_runtime_t *rt, dmem_handle_t h);
/* Whether the calling thread is moving h of rt in an enclosing call. */
bool dmem__moving_self(const dmem_runtime_t *rt, dmem_handle_t h);
/* How many of rt->spills_in_flight the calling thread runs itself. */
int dmem__moving_spills(const dmem_runtime_t *rt);

/* Try to take TRANSIT on b, whose word the caller read as *w: one CAS to
 * `(*w | TRANSIT)` with the state set to `state` and `locks` added to the
 * lock count. On failure *w holds the current word (retry or give up). */
bool dmem__transit_take(dmem__buffer_t *b, uint64_t *w, unsigned state, uint32_t locks);

/* How the TRANSIT owner leaves the buffer when its move ends. Zero fields
 * change nothing: `to` is DMEM__TO(state) or 0 to keep the state. */
typedef struct dmem__transit_exit {
  unsigned to;        /* DMEM__TO(new state), or 0: keep */
  uint64_t set;       /* flags to set (DMEM__F_UNSPILL_COPY ...) */
  uint64_t clear;     /* flags to clear besides TRANSIT */
  bool drop_lock;     /* undo the lock taken with TRANSIT (failed retrieve) */
} dmem__transit_exit_t;
#define DMEM__TO(state) ((unsigned)(state) + 1u)

/* End the caller's TRANSIT ownership of b as `exit` says, with a releasing
 * CAS. Returns the new word. Reclaim and waking waiters are the caller's
 * (spill/reclaim.c: dmem__move_end). */
uint64_t dmem__transit_end(dmem__buffer_t *b, dmem__transit_exit_t exit);
/* Wake every thread waiting for a transit to end. */
void dmem__transit_broadcast(dmem_runtime_t *rt);
/* Block until b's word differs from `seen` (or a transit ends anywhere; at
 * most about 10 ms, then the caller looks again). */
void dmem__transit_wait(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t seen);
/* Block until some transit ends, at most `ns` nanoseconds. */
void dmem__transit_wait_any(dmem_runtime_t *rt, uint64_t ns);

/* ---- events (core/event.c) ----------------------------------------------------- */

/* An event shared by several owners, each of which gives it back with
 * dmem__event_put (core/event.c): `refs` puts are still to come. */
typedef struct dmem__event_share {
  void *ev;
  size_t refs;
} dmem__event_share_t;

/* An event from the runtime's pool (created on demand). */
dmem_status_t dmem__event_get(dmem_runtime_t *rt, void **ev_out);
/* Give an event back. Events are never destroyed before the runtime is: a
 * locker that read b->spill_event may still wait on it. */
void dmem__event_put(dmem_runtime_t *rt, void *ev);
/* Make ev, which the caller holds, owned by `owners` parties (owners >= 1):
 * it goes back to the pool at the owners-th dmem__event_put, not before
 * (a spill batch's one copy event, referenced by each victim's
 * b->spill_event until that buffer's copy is seen complete). Call it
 * before ev is published to the other owners.
 * DMEM_ERR_HOST_OUT_OF_MEMORY (nothing changes: ev still has one owner). */
dmem_status_t dmem__event_share(dmem_runtime_t *rt, void *ev, size_t owners);
/* At destroy: destroy every pooled event. */
void dmem__event_pool_fini(dmem_runtime_t *rt);

/* ---- controller callbacks (core/controller.c) ---------------------------------- */

/* Copy the installed controller; false when none is installed. */
bool dmem__controller_get(dmem_runtime_t *rt, dmem_controller_t *c_out);
/* The controller's store for a buffer whose TRANSIT the caller owns,
 * counted as in flight (dmem_controller_set refuses to remove or replace a
 * controller while a store runs or it holds bytes): copies the controller
 * into *c_out and returns false (nothing counted) when none with store is
 * installed. dmem__controller_store_end ends the count, adding `kept` bytes
 * (0 after a failed store) to rt->controller_used first. */
bool dmem__controller_store_begin(dmem_runtime_t *rt, dmem_controller_t *c_out);
void dmem__controller_store_end(dmem_runtime_t *rt, size_t kept);

/* A FREE event during a store. The TRANSIT owner of b calls
 * dmem__store_watch before the controller's store: false when b was freed
 * already (the store is then skipped). It calls dmem__store_unwatch after
 * store() returns (or is skipped), still owning TRANSIT: true when
 * dmem_buffer_free ran meanwhile and left the FREE event to the owner, who sends
 * it once its move has ended. dmem_buffer_free, after setting FREED on a
 * word with TRANSIT, calls dmem__store_hand_over: true when the owner will
 * send the event. So the one FREE event of a buffer freed during its store
 * comes after store() returns. */
#define DMEM__WATCH_STORING 1u
#define DMEM__WATCH_FREED 2u
bool dmem__store_watch(dmem__buffer_t *b, dmem_handle_t h);
bool dmem__store_unwatch(dmem__buffer_t *b);
bool dmem__store_hand_over(dmem__buffer_t *b);

/* Send an event to the controller's on_event callback, if it has one. Takes
 * no mutex when it has none. */
void dmem__emit(dmem_runtime_t *rt, dmem_event_kind_t kind, dmem_handle_t h, size_t size,
                dmem_tier_t tier, size_t bytes_needed);

/* ---- configuration (core/config.c) -------------------------------------------- */

/* Check each field of cfg against its row of DMEM_CONFIG_OPTIONS (its
 * range, its choices): DMEM_OK, or DMEM_ERR_INVALID_ARGUMENT with the detail
 * naming the first field out of range. */
dmem_status_t dmem__config_check(const dmem_config_t *cfg);
/* Check the DMEM_* environment against cfg, the config of a runtime being
 * created: DMEM_ERR_CONFIG (detail recorded) for the first malformed
 * variable whose field cfg holds at its default; a malformed variable whose
 * field cfg sets is logged (warn, at cfg->log_level) and ignored. */
dmem_status_t dmem__config_check_env(const dmem_config_t *cfg);
/* A testing knob's size from the environment variable `name`: a power of
 * two from lo to hi, with an optional K or M; unset or anything else:
 * dflt. Thread-safe (reads the environment). */
size_t dmem__config_env_pow2(const char *name, size_t lo, size_t hi, size_t dflt);

/* ---- time (core/transit.c) ----------------------------------------------------- */

uint64_t dmem__now_ns(void);

#endif /* DMEM_CORE_LAYER_H */
