/*
 * runtime/api/api.h - the API layer's internal declarations (the public
 * calls are in include/dmem/): the per-stream lock registry, fork tracking,
 * the statistics report, the lock fast path. Includes every layer below.
 */
#ifndef DMEM_API_LAYER_H
#define DMEM_API_LAYER_H

#include "spill/spill.h"

/* ---- API layer internals -------------------------------------------------------- */

/* The most handles one call takes (dmem_lock_and_launch, dmem_launch_async,
 * dmem_buffer_prefetch): an array of more could not be in memory, and the entry
 * points' lock sets (16 bytes a handle) would overflow. */
#define DMEM__HANDLES_MAX (SIZE_MAX / 16)
_Static_assert(sizeof(dmem__reg_entry_t) <= 16, "DMEM__HANDLES_MAX assumes 16-byte entries");

/* runtime/api/fork.c: the process's live runtimes, marked DMEM__FORKED in a
 * forked child. Tracked by create (DMEM_ERR_HOST_OUT_OF_MEMORY when the
 * fork handler could not be installed), untracked by destroy (but not in a
 * forked child, whose list starts empty). */
dmem_status_t dmem__fork_track(dmem_runtime_t *rt);
void dmem__fork_untrack(dmem_runtime_t *rt);
/* Call fn(rt, arg) for each live runtime of the process, under the list's
 * mutex (fn must not create or destroy a runtime). */
void dmem__fork_each(void (*fn)(dmem_runtime_t *rt, void *arg), void *arg);
/* Set rt's log level, and the process-wide one (dmem__log_level) to the
 * most verbose of the live runtimes' (DMEM_LOG_WARN when none is live).
 * Takes no mutex. */
void dmem__log_level_set(dmem_runtime_t *rt, int level);

/* runtime/api/report.c: DMEM_STATS and DMEM_TRACE. Start (at create; the
 * statistics thread when cfg->stats_interval_s, the exit handler when
 * cfg->print_stats, the trace when DMEM_TRACE is set) and stop (at destroy,
 * which prints the statistics and writes the trace). Start gives
 * DMEM_ERR_HOST_OUT_OF_MEMORY when the thread cannot start. */
dmem_status_t dmem__report_start(dmem_runtime_t *rt);
void dmem__report_stop(dmem_runtime_t *rt);
/* Print rt's statistics to stderr, headed by `when`. */
void dmem__report_print(dmem_runtime_t *rt, const char *when);

/* The lock's fast path (inline: dmem_buffer_lock and the launch entry
 * points): a resident, unlocked-or-locked buffer of the right generation,
 * no move in flight, the runtime live: one load and one CAS. Returns b
 * (the slot's buffer, NULL: stale slot) and whether it locked; *w_out is
 * the word it read. */
static inline bool dmem__lock_fast(dmem_runtime_t *rt, dmem_handle_t h, void **dev_out,
                                   dmem__buffer_t **b_out, uint64_t *w_out) {
  /* every caller checks h against the word (here, dmem__lock_resident,
   * dmem__retrieve) before it uses the slot */
  dmem__buffer_t *b = dmem__table_lookup_checked(rt->table, h);
  *b_out = b;
  if (!b) return false;
  /* acquire: partner is the release in dmem_buffer_alloc / dmem__transit_end, which
   * published b->dev */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  const uint64_t slow_bits =
      DMEM__F_FREED | DMEM__F_UNSPILL_COPY | DMEM__F_SPILL_COPY | DMEM__STATE_MASK;
  if (__builtin_expect(dmem__w_gen(w) == dmem__h_gen(h) && (w & slow_bits) == 0 &&
                           dmem__w_count(w) < DMEM_LOCK_COUNT_MAX &&
                           !dmem_atomic_load_relaxed(&rt->fatal),
                       1) &&
      dmem_atomic_cas_strong_acq_rel(&b->word, &w, w + 1)) {
    *dev_out = dmem__bdev(b);
    /* the first lock: its bytes count as locked (a thread-private add) */
    if (dmem__w_count(w) == 0) dmem__locked_add(rt->table, dmem__bsize(b));
    return true;
  }
  *w_out = w;
  return false;
}

/* The fast path alone: DMEM_OK (locked, resident), DMEM_ERR_STALE_HANDLE
 * (detail recorded), or DMEM_ERR_BUSY (no detail) when h names a live
 * buffer that only the slow path can lock (spilled, moving, its count at
 * the maximum, a fatal runtime); nothing moved. *b_out is the buffer unless
 * stale. */
static inline dmem_status_t dmem__lock_resident(dmem_runtime_t *rt, dmem_handle_t h,
                                                void **dev_out, dmem__buffer_t **b_out) {
  dmem__buffer_t *b;
  uint64_t w = 0;
  if (dmem__lock_fast(rt, h, dev_out, &b, &w)) {
    *b_out = b;
    return DMEM_OK;
  }
  if (!b || !dmem__word_live(w, h)) return dmem__stale(h);
  *b_out = b;
  return DMEM_ERR_BUSY; /* live, but the slow path must lock it */
}

/* runtime/api/buffer.c: lock h for the caller (the fast path above, the
 * slow path in spill/retrieve.c); *b_out (may be NULL) is the buffer. */
dmem_status_t dmem__lock(dmem_runtime_t *rt, dmem_handle_t h, void *stream, void **dev_out,
                         dmem__buffer_t **b_out);

/* runtime/api/buffer.c: make slot `slot` (b, just taken from the table) a live
 * buffer of `size` bytes and `flags`, resident at `dev`, holding `locks`
 * locks; `ready` (may be NULL; owned by the buffer from now on) is an event
 * recorded after the last use of `dev` so far: UNSPILL_COPY is set with it,
 * so that lockers on other streams, spills and the reclaim are ordered
 * after it until the staging poller sees it complete. Counts the buffer,
 * tells the controller (DMEM_EVENT_ALLOC) and returns the handle. */
dmem_handle_t dmem__buffer_publish(dmem_runtime_t *rt, dmem__buffer_t *b, uint32_t slot,
                                   size_t size, unsigned flags, void *dev, void *ready,
                                   uint32_t locks);

/* runtime/api/registry.c */
dmem_status_t dmem__registry_init(dmem_runtime_t *rt);
void dmem__registry_fini(dmem_runtime_t *rt);
dmem_status_t dmem__registry_add(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *e,
                                 size_t n);
/* Register the locks of a launch whose function has returned; if the
 * registry cannot grow, wait for the stream and unlock them instead. */
void dmem__registry_commit(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *e,
                           size_t n);
dmem_status_t dmem__registry_take(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t **v_out,
                                  size_t *n_out);
bool dmem__registry_has(dmem_runtime_t *rt, void *stream);
/* dmem_stream_release below the API on a stream without a record (the
 * caller's dmem__sreg_lock found none; a stream with one releases into its
 * group, spill/pending.c): an event now for what its list holds;
 * *recorded: an event was recorded. */
dmem_status_t dmem__registry_release_list(dmem_runtime_t *rt, void *stream, bool *recorded);
/* dmem_stream_create (and registry init, for the host backend's default
 * stream): give `stream` a record of its own (spill/pending.c), into which
 * its list, if any, moves; with no record free it keeps a list here. */
void dmem__registry_stream_add(dmem_runtime_t *rt, void *stream);
/* dmem_stream_destroy: drop the stream's (empty) list. */
void dmem__registry_forget(dmem_runtime_t *rt, void *stream);

#endif /* DMEM_API_LAYER_H */
