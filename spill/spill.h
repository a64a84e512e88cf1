/*
 * spill/spill.h - the spill layer: where a deferred buffer's bytes are kept
 * (tiers), moving a buffer out (spill.c) and back (retrieve.c), recycling
 * unspill staging (staging.c), reclaim and the end of a move (reclaim.c),
 * stream releases waiting for their event (pending.c), choosing victims
 * (policy.c) and making room when device memory runs short (pressure.c).
 *
 * Spill calls memory, core, the backend table and base; never the API
 * layer above it.
 */
#ifndef DMEM_SPILL_LAYER_H
#define DMEM_SPILL_LAYER_H

/* ---- tiers (tier.c; tier_host.c, tier_disk.c, tier_controller.c) -------------- */

/* Where a deferred buffer's bytes are kept. Every function is called by the
 * owner of the buffer's TRANSIT (or by reclaim, which owns the buffer). */
typedef struct dmem__tier_ops {
  dmem_tier_t tier;
  unsigned state; /* the buffer state of a buffer held here */
  const char *name;
  /* The host tier keeps the pinned staging itself as its copy (store adopts
   * `data`, load has nothing to do); the others copy out and in. */
  bool adopts_staging;
  /* Keep the buffer's size bytes, now at `data` (pinned). The host tier
   * adopts `data` as b->host, charging host_used (DMEM_ERR_HOST_OUT_OF_MEMORY
   * when that would pass the host limit); the others copy it out and leave
   * `data` to the caller. */
  dmem_status_t (*store)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, void *data);
  /* Bring the bytes back into pinned memory at b->host (the host tier: they
   * are there already). On failure b->host is as it was. */
  dmem_status_t (*load)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
  /* Forget the buffer: remove its file, uncharge its bytes. Pinned memory at
   * b->host stays (dmem__host_copy_release frees it; a retrieve recycles it
   * as staging). */
  void (*drop)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
  /* Bytes held by the tier. */
  size_t (*used)(dmem_runtime_t *rt);
} dmem__tier_ops_t;

extern const dmem__tier_ops_t dmem__tier_host, dmem__tier_disk, dmem__tier_controller;

/* The tier of DMEM_TIER_HOST/DISK/CONTROLLER, or NULL (DEVICE, unknown). */
const dmem__tier_ops_t *dmem__tier_of(dmem_tier_t tier);
/* The tier holding a buffer in state s, or NULL (not deferred). */
const dmem__tier_ops_t *dmem__tier_of_state(unsigned s);
/* The public tier of a buffer in state s (DMEM_TIER_DEVICE unless deferred). */
dmem_tier_t dmem__tier_public(unsigned s);
/* Free the pinned memory at b->host, if any (host copy or staging; its
 * accounting went with the tier's drop). */
void dmem__host_copy_release(dmem_runtime_t *rt, dmem__buffer_t *b);
/* The disk tier's file store, created on first use. */
dmem_status_t dmem__disk_get(dmem_runtime_t *rt, dmem__disk_t **disk_out);

/* ---- the disk tier's files (disk.c) -------------------------------------------- */
dmem_status_t dmem__disk_create(const char *parent, dmem__disk_t **disk_out);
void dmem__disk_destroy(dmem__disk_t *disk);
dmem_status_t dmem__disk_write(dmem__disk_t *disk, uint64_t key, const void *data, size_t n);
dmem_status_t dmem__disk_read(dmem__disk_t *disk, uint64_t key, void *data, size_t n);
void dmem__disk_remove(dmem__disk_t *disk, uint64_t key);

/* ---- reclaim and the end of moves (reclaim.c) ----------------------------------- */

/* Called exactly once per freed buffer, by the party whose CAS made
 * FREED && count == 0 && !TRANSIT true; w is that word. */
void dmem__reclaim(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t w);
/* After a CAS that cleared the caller's TRANSIT (new word nw): reclaim if
 * the buffer was freed meanwhile, wake waiters. */
void dmem__move_after(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw);
/* End the caller's TRANSIT as `exit` says, then dmem__move_after. */
uint64_t dmem__move_end(dmem_runtime_t *rt, dmem__buffer_t *b, dmem__transit_exit_t exit);
/* Drop one lock of h; the last unlock of a freed buffer reclaims it.
 * DMEM_ERR_STALE_HANDLE, DMEM_ERR_NOT_LOCKED. */
dmem_status_t dmem__unlock_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);

/* ---- copies in flight (staging.c) ----------------------------------------------- */

/* Remember that b has a copy in flight: UNSPILL_COPY (resident; its staging
 * b->host is recycled once b->unspill_event completes) or SPILL_COPY on a
 * DEFERRED_HOST buffer (b->spill_event goes back to the pool once the copy
 * into the host tier completes). */
void dmem__staging_push(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
/* Finish the copies that completed (wait_all: wait for all of them). */
void dmem__staging_poll(dmem_runtime_t *rt, bool wait_all);
void dmem__staging_fini(dmem_runtime_t *rt);

/* ---- stream releases waiting for their event (pending.c) ------------------------ */

/* Unlock entries v[0..n) once `event` completes; takes ownership of v and
 * event. */
dmem_status_t dmem__pending_add(dmem_runtime_t *rt, void *event, dmem__reg_entry_t *v, size_t n);
/* Unlock the releases whose event completed (wait_all: wait for all).
 * Returns how many releases completed. */
size_t dmem__pending_poll(dmem_runtime_t *rt, bool wait_all);

/* ---- moving out (spill.c) and back (retrieve.c) --------------------------------- */

/* Spill b (handle h) to `tier`. by_policy: b is an eviction victim, skipped
 * (BUSY) unless it is still resident. */
dmem_status_t dmem__spill_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 dmem_tier_t tier, bool by_policy);

typedef enum dmem__retrieve_mode {
  DMEM__RETRIEVE_LOCK,    /* bring back and lock (dmem_lock's slow path) */
  DMEM__RETRIEVE_ONLY,    /* bring back, no lock (dmem_unspill) */
  DMEM__RETRIEVE_PREFETCH /* bring back, no lock, and leave `stream` alone:
                             the caller orders it after the whole batch */
} dmem__retrieve_mode_t;
/* The one retrieve state machine: wait out other movers, cancel a spill in
 * flight, or bring a deferred buffer back with a copy ordered on `stream`.
 * In DMEM__RETRIEVE_LOCK mode *dev_out is the device address of the now
 * locked buffer; in DMEM__RETRIEVE_ONLY mode dev_out may be NULL. */
dmem_status_t dmem__retrieve(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                             void *stream, dmem__retrieve_mode_t mode, void **dev_out);

/* ---- the copy engine (copy.c) and prefetch (prefetch.c) --------------------------- */

/* Enqueue a copy of size bytes on `stream` (one of the runtime's copy
 * streams), in pieces of at most rt->copy_chunk bytes. Returns once
 * enqueued. */
dmem_status_t dmem__copy_chunked(dmem_runtime_t *rt, void *dst, const void *src, size_t size,
                                 void *stream);
/* Bring hs[0..n) back to the device on the host->device stream without
 * locking them, then make `stream` wait for all of the copies with one
 * event. Stops at the first error (the buffers before it stay
 * prefetched); *done_out (may be NULL) counts the buffers handled. */
dmem_status_t dmem__prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                             void *stream, size_t *done_out);

/* ---- spill-ahead (ahead.c) -------------------------------------------------------- */

/* Start the background thread when rt->ahead_high is set. */
dmem_status_t dmem__ahead_start(dmem_runtime_t *rt);
/* Stop and join it (at destroy). */
void dmem__ahead_stop(dmem_runtime_t *rt);
/* Wake the thread when device use passed the high-water mark. Called after
 * allocations; one relaxed load when under the mark. */
void dmem__ahead_kick_slow(dmem_runtime_t *rt);
static inline void dmem__ahead_note(dmem_runtime_t *rt) {
  if (rt->ahead_high && dmem_atomic_load_relaxed(&rt->device_charged) > rt->ahead_high &&
      !dmem_atomic_load_relaxed(&rt->ahead_kick))
    dmem__ahead_kick_slow(rt);
}

/* ---- victims (policy.c) and room (pressure.c) ------------------------------------ */

/* Why an eviction pass runs (stats and the DMEM_LOG=info line). */
typedef enum dmem__evict_reason {
  DMEM__EVICT_EXPLICIT, /* dmem_evict */
  DMEM__EVICT_ON_DEMAND, /* an allocation needed room */
  DMEM__EVICT_AHEAD      /* the spill-ahead thread: use above the high-water mark */
} dmem__evict_reason_t;

/* Spill unlocked buffers (the controller's choice, then by priority and
 * LRU) until `need` bytes were freed or nothing is left. When `contig` is
 * not 0 an allocation of that size needs a contiguous pool range: a victim
 * whose block, with the free ranges beside it, makes such a range is spilled
 * first, alone (one spill that helps rather than several that do not).
 * reason: DMEM__EVICT_ON_DEMAND counts as oom_evictions, DMEM__EVICT_AHEAD
 * as ahead_evictions; DMEM_LOG=info logs one line per pass that spilled
 * something (victims, bytes, reason). *first_error_out (may be NULL): the
 * first error other than BUSY/STALE met on the way. */
dmem_status_t dmem__evict(dmem_runtime_t *rt, size_t need, size_t contig,
                          dmem__evict_reason_t reason, size_t *freed_out,
                          dmem_status_t *first_error_out);
/* Device memory for size bytes in stream order on `stream`, spilling (and
 * waiting for moves and stream releases in flight, up to a deadline) when
 * memory runs short. *ordered_out as for dmem__device_alloc.
 * DMEM_ERR_OUT_OF_MEMORY when nothing more can be freed. */
dmem_status_t dmem__pressure_alloc(dmem_runtime_t *rt, size_t size, void *stream,
                                   void **dev_out, bool *ordered_out);
/* Complete what finished in the background: stream releases, staging. */
void dmem__spill_poll(dmem_runtime_t *rt);

#endif /* DMEM_SPILL_LAYER_H */
