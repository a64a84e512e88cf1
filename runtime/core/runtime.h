/*
 * runtime/core/runtime.h - the runtime object (struct dmem_runtime), shared
 * by every layer, and the core helpers that read it.
 *
 * The C files form layers, one folder each, from the bottom up; a file
 * calls only into its own layer or the ones below it (tests/layers/layers.txt
 * is the table, the `layers` test checks the built objects), and the files'
 * calls form no circle:
 *
 *   base     runtime/base/     status, error detail, log, trace, atomics
 *   backend  runtime/backend/  the backend table; cuda, host and fault backends
 *   core     runtime/core/     state word + TRANSIT, handle table, events,
 *                              controller callbacks, config, this object
 *   memory   runtime/memory/   device memory, pinned host pool
 *   spill    runtime/spill/    tiers, spill and retrieve, victim policy,
 *                              making room, pending stream releases
 *   api      runtime/api/      dmem_buffer_alloc/free/lock/unlock, entry points,
 *                              registry, streams, stats, explicit moves
 *
 * Each layer has one header that includes the one below it:
 * core/runtime.h <- memory/memory.h <- spill/spill.h <- api/api.h.
 * docs/design.md draws the same picture and follows a move downwards.
 */
#ifndef DMEM_CORE_RUNTIME_H
#define DMEM_CORE_RUNTIME_H

#include "core/core.h"
#include "core/locked.h"

/* ---- per-stream lock registry (runtime/api/registry.c) --------------------------- */
typedef struct dmem__reg_entry {
  dmem__buffer_t *b;
  dmem_handle_t h;
} dmem__reg_entry_t;

typedef struct dmem__reg_list {
  void *stream;
  dmem__reg_entry_t *v;
  size_t n, cap;
} dmem__reg_list_t;

typedef struct dmem__registry {
  pthread_mutex_t mu;
  dmem__reg_list_t *lists; /* one per stream with registered locks (not in sreg) */
  size_t nlists, caplists;
} dmem__registry_t;

/* A stream release waiting for its event (spill/pending.c). */
typedef struct dmem__pending {
  struct dmem__pending *next;
  void *event;
  dmem__reg_entry_t *v;
  size_t n;
} dmem__pending_t;

/* A stream dmem made (dmem_stream_create; the host backend's default
 * stream), which therefore stays valid until dmem_stream_destroy: its lock
 * registry and its open release group in one record with its own spin lock
 * (rank stream), so that dmem_launch_async and dmem_stream_release on it
 * take no runtime-wide mutex (spill/pending.c). A fixed array in the
 * runtime (never freed before destroy): a lookup scans the keys lock-free
 * and checks the key again under the record's lock. Streams past
 * DMEM__SREG_SLOTS live in the registry's lists, as other streams. */
#define DMEM__SREG_SLOTS 32u
typedef struct dmem__sreg {
  /* (uintptr_t)stream + 1, 0 when free. Written under lk and rt->reg.mu
   * (release); read lock-free (acquire) by lookups, which look again
   * under lk (partner: the release store of the claim). */
  _Alignas(64) _Atomic uintptr_t key; /* a line (or two) per record */
  _Atomic unsigned lk; /* the spin lock: 1 held (exchange acquire / store release) */
  /* Under lk: v[0..g) the open group (releases no event covers yet),
   * v[g..n) the launches registered and not yet released. */
  dmem__reg_entry_t *v;
  size_t g, n, cap;
  unsigned releases;       /* releases in the open group */
  uint64_t first_ns;       /* when the open group opened */
  uint64_t last_record_ns; /* the last event recorded on the stream for releases */
} dmem__sreg_t;

/* One shard of the device-limit charge (memory/devmem.c): threads charge
 * and uncharge their own shard, so allocations on many threads do not all
 * write one counter. */
#define DMEM__CHARGE_SHARDS 64
typedef struct dmem__charge_shard {
  /* Budget charged to device_charged and not used yet. Written by the
   * shard's threads (CAS) and by drains (exchange); relaxed. */
  _Alignas(64) _Atomic size_t slack;
} dmem__charge_shard_t;

/* Copy-engine and spill-ahead counters (dmem_stats' second block). Indexed
 * by dmem_tier_t (DMEM_TIER_HOST .. DMEM_TIER_CONTROLLER; 0 unused).
 * Relaxed: accounting only. */
#define DMEM__NTIERS 4
typedef struct dmem__xstats {
  _Atomic uint64_t spill_count[DMEM__NTIERS], spill_bytes[DMEM__NTIERS], spill_ns[DMEM__NTIERS];
  _Atomic uint64_t unspill_count[DMEM__NTIERS], unspill_bytes[DMEM__NTIERS],
      unspill_ns[DMEM__NTIERS];
  _Atomic uint64_t room_waits, room_wait_ns;   /* allocations that had to make room */
  _Atomic uint64_t evict_passes;               /* eviction passes (any reason) */
  _Atomic uint64_t ahead_passes, ahead_evictions, ahead_bytes;
  _Atomic uint64_t ahead_wakeups, ahead_polls; /* the thread's wakes; its polls */
  _Atomic uint64_t ahead_arms; /* waits for room that armed it (demand trigger) */
  _Atomic uint64_t prefetch_count, prefetch_bytes;
  _Atomic uint64_t swaps; /* retrieves that traded places (spill/swap.c) */
} dmem__xstats_t;

/* A priority class of the default eviction policy (spill/reuse.c): lists
 * of slots (spill/reuse.c says what each holds): cold, back, back's
 * window, and the hot buffers by reuse interval (DMEM__PHOT of them). */
#define DMEM__PHOT 36
#define DMEM__PLISTS (3 + DMEM__PHOT)
typedef struct dmem__pclass {
  int prio;
  uint32_t head[DMEM__PLISTS], tail[DMEM__PLISTS];
  size_t n[DMEM__PLISTS]; /* entries on each list */
  size_t win_bytes;       /* bytes on the window (as each entry was linked) */
  size_t soon_bytes;      /* of those, prefetched and not used since */
} dmem__pclass_t;

/* The default eviction policy's state (spill/reuse.c). Everything but
 * `arrivals` is under mu, which only eviction passes take: never an
 * unlock, a lock or an allocation. */
typedef struct dmem__policy {
  pthread_mutex_t mu;
  dmem__pclass_t *cls;   /* by class id (append-only) */
  uint16_t *order;       /* class ids by ascending priority */
  uint32_t ncls, capcls;
  /* The policy's clock: victims taken (added under mu) and allocations
   * (added by the allocating thread), relaxed. Read (relaxed) by every
   * unlock: its own line, which only eviction passes and allocations
   * write. */
  _Alignas(64) _Atomic uint64_t tick;
  size_t win_max;        /* the most bytes a class's window holds: adapts
                            between win_min and win_top */
  size_t win_min, win_top;
  size_t soon_top;       /* the most bytes a class's unused prefetched buffers
                            keep from the victims: 3/4 of the limit */
  bool no_class;         /* a class could not be made (no memory): some
                            buffers are on no list, and eviction passes
                            scan the whole table instead */
  /* Buffers that came to the device (or changed priority) since the last
   * drain: a stack of slots, the top slot in the low 32 bits and how many
   * are on it in the high 32, pushed with one CAS (release) by the
   * arriving thread, taken whole (exchange, acquire) by the drain. Its own
   * line: allocations on every thread push here. */
  _Alignas(64) _Atomic uint64_t arrivals;
} dmem__policy_t;

typedef struct dmem__hostpool dmem__hostpool_t;
typedef struct dmem__raw dmem__raw_t;
typedef struct dmem__blocks dmem__blocks_t;
typedef struct dmem__pool dmem__pool_t;
typedef struct dmem__disk dmem__disk_t;
typedef struct dmem__io dmem__io_t;

/* ---- the runtime ------------------------------------------------------------ */
struct dmem_runtime {
  dmem_config_t cfg;
  char *spill_dir_copy;
  /* The live runtimes of the process (runtime/api/fork.c), under its mutex. */
  dmem_runtime_t *fork_prev, *fork_next;
  size_t capacity;
  size_t limit;
  size_t host_limit; /* 0: unlimited */
  /* with host_limit: the pinned bytes past the host tier's cap kept for
   * staging (copies in flight, disk reads), which bounds the disk tier's
   * read slots */
  size_t host_staging;

  dmem__registry_t reg;        /* API */
  dmem__hostpool_t *hostpool;  /* memory */
  dmem__pool_t *pool;          /* memory: every device byte of the runtime */
  dmem__blocks_t *blocks;      /* memory: ... but dedicated raw blocks */
  dmem__raw_t *raw;            /* memory: live raw allocations */

  pthread_mutex_t disk_mu;      /* creates the disk tier lazily */
  _Atomic(dmem__disk_t *) disk; /* release in spill/tier_disk.c, acquire by readers */
  /* the disk tier's pinned staging slots for reads (spill/tier_disk.c):
   * made with the file, published by the same release store */
  struct dmem__disk_stage *disk_stage;

  void *spill_stream;   /* device->host copies of spills */
  void *unspill_stream; /* host->device copies of retrieves and prefetches */
  size_t copy_chunk;    /* copies larger than this are issued in chunks */

  /* Spill-ahead (spill/ahead.c): above ahead_high bytes of device use a
   * background thread spills by policy down to ahead_low. ahead_high 0:
   * off (no thread). */
  size_t ahead_high, ahead_low;
  pthread_mutex_t ahead_mu; /* with ahead_cv: the thread's sleep */
  pthread_cond_t ahead_cv;
  pthread_t ahead_thread;
  bool ahead_started;
  _Atomic int ahead_stop; /* written under ahead_mu; read by the thread */
  _Atomic int ahead_kick; /* set (exchange) by allocations past ahead_high */
  /* Demand trigger (dmem_config_t.spill_ahead_trigger): the thread spills
   * only while armed. A wait for room of DMEM_SPILL_AHEAD_ARM_WAIT_US or
   * more stores ahead_armed_until (now + DMEM_SPILL_AHEAD_ARM_MS), then
   * sets ahead_armed (release); a shorter wait clears it, and so does one
   * that began while it was armed, which also stores ahead_hold_until
   * (before it, no wait arms it) from ahead_hold_ns, and doubles that; the
   * thread (or the next wait) clears it once the time has passed (the
   * thread looks at ahead_armed_until again after), and then sets
   * ahead_hold_ns to 0. Allocations read ahead_armed (relaxed) before they
   * kick. */
  bool ahead_demand;
  _Atomic int ahead_armed;
  _Atomic uint64_t ahead_armed_until;
  _Atomic uint64_t ahead_hold_until;
  _Atomic uint64_t ahead_hold_ns; /* the next hold-off's length (0: ARM_MS) */
  /* A retrieve's swap with a victim (spill/swap.c): the device bounce
   * buffer (two pieces of DMEM__SWAP_PIECE bytes, outside the limit, made
   * at the first swap) with its events, and the mutex that keeps one
   * swap's copies through it together. swap_off, swap_pieces:
   * dmem_config_t.retrieve_swap (pieces: no bounce; swap.c). */
  pthread_mutex_t swap_mu;
  void *swap_bounce;
  _Atomic int swap_ready;     /* the bounce and its events are made */
  _Atomic int swap_no_bounce; /* the bounce could not be made: swaps stay off */
  void *swap_ev[4]; /* per half of the bounce: filled (0, 1), emptied (2, 3) */
  bool swap_off;
  bool swap_pieces;
  size_t swap_piece; /* a pieces swap's piece (dmem__swap_piece_size) */
  /* Buffers allocated without a stream (dmem_buffer_alloc) get pool blocks in this
   * stream's order; it carries nothing but the waits the pool enqueues. */
  void *order_stream;

  pthread_mutex_t evpool_mu; /* core/event.c */
  void **evpool;
  size_t evpool_n, evpool_cap;
  /* Events held by several owners (a spill batch's copy event, one
   * reference per victim): the extra references, under evpool_mu. */
  dmem__event_share_t *evshared;
  size_t evshared_n, evshared_cap;

  /* Buffers with UNSPILL_COPY set, waiting for the poller to recycle their
   * staging (spill/staging.c). */
  pthread_mutex_t staging_mu;
  dmem__reg_entry_t *staging;
  size_t nstaging, capstaging;

  /* Stream releases waiting for their event (spill/pending.c). */
  pthread_mutex_t pending_mu;
  dmem__pending_t *pending;
  /* Releases not yet done (events waiting, open groups, groups a
   * synchronisation took): raised under pending_mu, lowered (release) only
   * after the release unlocked its buffers; read lock-free (acquire). */
  _Atomic size_t npending;
  /* The streams dmem made (dmem__sreg_t; claimed and given back under
   * reg.mu; nsreg, their high-water mark, is on fatal's line below).
   * ndeferred: how many slots have an open group (changed under the slot's
   * lock, read relaxed by pollers as a hint). */
  dmem__sreg_t sreg[DMEM__SREG_SLOTS];
  _Atomic size_t ndeferred;

  /* Waiters for a buffer's TRANSIT to end (core/transit.c). */
  pthread_mutex_t tmu;
  pthread_cond_t tcv;
  _Atomic uint64_t transit_epoch; /* bumped (under tmu) at every transit end */
  /* Spills from the device in progress (a buffer or a batch each): raised
   * before a spill takes its victims' TRANSIT, lowered (release) only after
   * their device ranges went back to the pool, so that an allocation that
   * reads 0 (acquire) and then fails has seen every range they freed
   * (spill/pressure.c). */
  _Atomic int spills_in_flight;
  /* Moves and stream releases that finished (bumped before spills_in_flight
   * or npending is lowered): an allocation that found nothing to spill
   * tries again when this moved since its last attempt. */
  _Atomic uint64_t moves_done;

  /* Controller: copied under ctl_mu, called with no mutex held. */
  pthread_mutex_t ctl_mu;
  dmem_controller_t ctl;
  _Atomic int has_ctl;        /* relaxed hint: skip the mutex when no controller */
  _Atomic int has_ctl_events; /* relaxed hint: the controller has on_event */
  size_t ctl_stores;          /* the controller's stores in flight (under ctl_mu) */

  /* ---- one line that the lock, launch and release paths read, and that
   * is (nearly) never written: everything here is set at create but fatal
   * (written once, at a fatal error or in a forked child) and nsreg
   * (raised when a stream is created). A launch + release reads no other
   * line of the runtime (the CUDA driver's launch between them evicts what
   * they read: every further line costs a miss a launch). */
  /* Why the runtime refuses work, or DMEM__LIVE: DMEM__FATAL (sticky
   * DMEM_ERR_DEVICE_FATAL, set by dmem__fatal_keep) or DMEM__FORKED (set in
   * a forked child by runtime/api/fork.c). Read (relaxed) on the lock fast
   * path, which so refuses both at no extra cost: away from the counters
   * that every thread writes. */
  _Alignas(64) _Atomic int fatal;
  /* cfg.eviction_policy is DMEM_EVICTION_LRU: the unlock stamps last_use
   * instead of marking the buffer. Set at create; read by every unlock
   * that brings a count to 0. */
  bool pol_lru;
  /* When releases are grouped (spill/pending.c; DMEM__RELEASE_* by
   * default, set by dmem__registry_init; tests may change them before the
   * first release). */
  unsigned release_group;
  uint64_t release_gap_ns, release_age_ns;
  dmem__backend_t *be;
  dmem__table_t *table; /* core */
  /* The high-water mark of the claimed stream records (rt->sreg): raised
   * under reg.mu (release); lookups scan up to it (acquire). */
  _Atomic size_t nsreg;

  /* LRU epoch (DMEM_EVICTION_LRU only): read (relaxed) by unlocks, bumped
   * by allocations and eviction passes. On its own line. */
  _Alignas(64) _Atomic uint64_t lru_epoch;

  /* The default eviction policy (spill/reuse.c). */
  dmem__policy_t pol;

  /* Device bytes charged against the limit: live allocations (buffers and
   * raw) plus the shards' unused budget (memory/devmem.c). Never above the
   * limit. Its own line: every shard refill and give-back writes it. */
  _Alignas(64) _Atomic size_t device_charged;
  size_t charge_chunk; /* a shard's refill; set at create */
  dmem__charge_shard_t charge[DMEM__CHARGE_SHARDS];

  /* Accounting (relaxed counters). */
  _Alignas(64) _Atomic size_t device_pinned;
  _Atomic size_t host_used;       /* the host tier's copies (DEFERRED_HOST) */
  _Atomic size_t disk_used;
  _Atomic size_t controller_used;
  _Atomic size_t buffer_count;
  _Atomic uint64_t spill_count, unspill_count, bytes_spilled, bytes_unspilled;
  _Atomic uint64_t ns_spilling, ns_unspilling, oom_evictions, cancelled_spills;

  /* Copy engine, spill-ahead and prefetch counters (issue 9). */
  dmem__xstats_t xs;
  /* ---- the disk tier (spill/io.c, spill/pushdown.c, spill/tier_disk.c) ---- */
  dmem__io_t *io; /* I/O threads; made at create, threads started on demand */
  /* Per tier (dmem_tier_t): bytes of its buffers the push-down is writing
   * to the next tier now (relaxed: accounting). */
  _Atomic size_t tier_pushing[DMEM__NTIERS];
  /* Disk-tier moves (relaxed counters): buffers written (pushed down from
   * the host tier, moved there by dmem_buffer_spill, or spilled straight to
   * disk), of which push-downs; buffers read back for a retrieve; failed
   * writes. */
  _Atomic uint64_t disk_writes, disk_bytes_written, ns_disk_writing, disk_pushdowns;
  _Atomic uint64_t disk_reads, disk_bytes_read, ns_disk_reading, disk_write_failures;

  /* ---- observability (runtime/api/report.c, spill/summary.c) ---- */
  /* The runtime's log level (DMEM_RT_LOG): set at create and by
   * dmem_runtime_set_log_level; relaxed (a message more or less). */
  _Atomic int log_level;
  char backend_reason[384]; /* why this backend: set at create */
  size_t limit_asked;       /* the config's limit in bytes (0: none), before the clamp */
  /* Peaks since create or dmem_stats_reset_peaks (relaxed: accounting):
   * raised by dmem__peak_raise where the counters grow. The raw peak is
   * the raw table's own (memory/raw.c). */
  _Atomic size_t device_peak, host_peak, disk_peak;
  /* The once-a-second summary at info (spill/summary.c): when the last one
   * was logged (CAS by the thread that logs the next), and the counters
   * then. */
  _Atomic uint64_t sum_last_ns;
  _Atomic uint64_t sum_spills, sum_spill_bytes, sum_unspills, sum_unspill_bytes, sum_pushdowns,
      sum_evictions;
  /* DMEM_STATS=N (stats_interval_s): the thread that prints the statistics
   * every N seconds (runtime/api/report.c); report_stop under report_mu. */
  pthread_mutex_t report_mu;
  pthread_cond_t report_cv;
  pthread_t report_thread;
  bool report_started;
  bool report_stop;
};

/* fatal's line holds what a launch + release reads of the runtime. */
_Static_assert(offsetof(struct dmem_runtime, nsreg) + sizeof(size_t) -
                       offsetof(struct dmem_runtime, fatal) <= 64,
               "the launch path's runtime fields left fatal's line");

/* Log a message about rt at rt's own level. */
#define DMEM_RT_LOG(rt, level, ...)                                      \
  do {                                                                   \
    if ((int)(level) <= dmem_atomic_load_relaxed(&(rt)->log_level))      \
      dmem__log((level), __VA_ARGS__);                                   \
  } while (0)

/* Raise *peak to v if v is higher (relaxed: accounting). */
static inline void dmem__peak_raise(_Atomic size_t *peak, size_t v) {
  size_t p = dmem_atomic_load_relaxed(peak);
  while (v > p && !dmem_atomic_cas_relaxed(peak, &p, v)) {
  }
}

/* ---- core helpers that read the runtime --------------------------------------- */

/* rt->fatal: why the runtime refuses work. */
#define DMEM__LIVE 0
#define DMEM__FATAL 1  /* a fatal device error: DMEM_ERR_DEVICE_FATAL */
#define DMEM__FORKED 2 /* inherited by a forked child: DMEM_ERR_FORKED */

/* Pass a backend status on, making DMEM_ERR_DEVICE_FATAL sticky: after it
 * the runtime refuses new work (dmem__check_live). A forked runtime stays
 * forked. */
static inline dmem_status_t dmem__fatal_keep(dmem_runtime_t *rt, dmem_status_t st) {
  if (st == DMEM_ERR_DEVICE_FATAL) {
    int why = DMEM__LIVE;
    while (!dmem_atomic_cas_relaxed(&rt->fatal, &why, DMEM__FATAL) && why == DMEM__LIVE) {
    }
  }
  return st;
}

/* The status of a call made in a forked child on a runtime it inherited
 * (runtime/api/fork.c marks them). */
static inline dmem_status_t dmem__forked_error(void) {
  return dmem__error(DMEM_ERR_FORKED,
                     "this runtime was inherited through fork(): a child process cannot use "
                     "its parent's runtimes (create a new one)");
}

/* Every call that starts new work checks this first: DMEM_ERR_DEVICE_FATAL
 * after a fatal device error, DMEM_ERR_FORKED in a forked child. */
static inline dmem_status_t dmem__check_live(dmem_runtime_t *rt) {
  int why = dmem_atomic_load_relaxed(&rt->fatal);
  if (why == DMEM__LIVE) return DMEM_OK;
  if (why == DMEM__FORKED) return dmem__forked_error();
  return dmem__error(DMEM_ERR_DEVICE_FATAL, "runtime refuses work after a fatal device error");
}

/* Calls that still work after a fatal device error (free, stats, trims,
 * synchronisation ...) check this first: in a forked child a mutex may be
 * held for good by a parent thread that is not there, and the backend's
 * threads and context are gone, so they must touch nothing. */
static inline dmem_status_t dmem__check_forked(dmem_runtime_t *rt) {
  if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__FORKED) return dmem__forked_error();
  return DMEM_OK;
}

/* A reuse interval of d policy ticks as a 7-bit code: d itself below 16,
 * then 4 steps per power of two (within 25 %); DMEM__PIV_NONE (127) is no
 * interval known. */
#define DMEM__PIV_NONE 127u
#define DMEM__PIV_SKIP 0x8000u
static inline uint16_t dmem__piv_code(uint64_t d) {
  if (d < 16) return (uint16_t)d;
  if (d >= ((uint64_t)1 << 31)) return 126;
  unsigned e = 63u - (unsigned)__builtin_clzll(d);
  unsigned c = 16 + (e - 4) * 4 + (unsigned)((d >> (e - 2)) & 3);
  return (uint16_t)(c < 126 ? c : 126);
}

/* Mark b as unlocked (its count just reached 0) for the default eviction
 * policy: relaxed loads and stores on b's first line, which the unlock's
 * CAS owns already (the mark byte, the stamp last_use, the intervals
 * pivs), and a relaxed load of the policy's clock. The policy consumes the
 * mark with an exchange under its mutex (spill/reuse.c); a mark racing
 * that exchange may survive it, which only keeps the buffer a pass longer.
 * Unlocks of one buffer racing on two threads may lose one's interval: a
 * hint, as the stamp is. */
static inline void dmem__policy_mark(dmem_runtime_t *rt, dmem__buffer_t *b) {
  uint8_t r = dmem_atomic_load_relaxed(&b->ref);
  if (r < 2) dmem_atomic_store_relaxed(&b->ref, (uint8_t)(r + 1));
  /* the reuse interval (spill/reuse.c): the ticks since the last unlock
   * join the last two, unless the arrival already counted them */
  uint64_t t = dmem_atomic_load_relaxed(&rt->pol.tick);
  uint16_t v = dmem_atomic_load_relaxed(&b->pivs);
  if (v & DMEM__PIV_SKIP) v = (uint16_t)(v & ~DMEM__PIV_SKIP);
  else {
    uint64_t l = dmem_atomic_load_relaxed(&b->last_use);
    v = (uint16_t)((v & 0x7F) << 7 | dmem__piv_code(t > l ? t - l : 0));
  }
  dmem_atomic_store_relaxed(&b->pivs, v);
  dmem_atomic_store_relaxed(&b->last_use, t);
}

/* LRU stamp of an unlock: the runtime's epoch (bumped by allocations and
 * eviction passes) above a per-thread sequence. Exact order within a thread,
 * epoch order across threads, and no cache line written that other threads
 * share (a shared counter made unlocks scale badly; the TSC is slow to read
 * on some virtual machines). */
extern _Thread_local uint64_t dmem__tl_lru_seq;
static inline uint64_t dmem__lru_stamp(dmem_runtime_t *rt) {
  return (dmem_atomic_load_relaxed(&rt->lru_epoch) << 32) | (++dmem__tl_lru_seq & 0xFFFFFFFFu);
}

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
    if (dmem_atomic_cas_relaxed(used_p, &used, used + size)) return true;
  }
}


#endif /* DMEM_CORE_RUNTIME_H */
