/*
 * spill/move_out.c - moving one buffer out of the device to a tier (the copy
 * runs on the runtime's own copy stream; a store the tier refuses as full
 * goes on down the chain, spill/tier.c), eviction batches into the tier
 * whose row takes them (the host tier), and tier changes of a buffer
 * already in a tier that keeps its bytes pinned (the host tier). A lock
 * that arrives while a spill copies cancels it (the device copy is still
 * the live one).
 *
 * Every move runs while the mover owns the buffer's TRANSIT bit (see
 * runtime/core/core.h); no mutex is held while copying or calling the
 * controller.
 */
#include "spill/spill.h"
#include "spill/summary.h"

static void record_spill(dmem_runtime_t *rt, dmem_handle_t h, size_t size, dmem_tier_t tier,
                         uint64_t t0, bool emit) {
  if (DMEM__TRACE_ON())
    dmem__trace_event(DMEM__TRACK_TIER, (uintptr_t)tier, "spill", t0, dmem__now_ns() - t0, size, 1,
                      h);
  dmem__stats_spill(rt, tier, size, dmem__now_ns() - t0);
  if (emit) dmem__emit(rt, DMEM_EVENT_SPILL, h, size, tier, 0);
}

/* dest->store of h's bytes at data. For a tier that watches frees (the
 * controller), the FREE event's handshake with dmem_buffer_free (core.h:
 * dmem__store_watch): a buffer freed before the store is not stored
 * (DMEM_ERR_STALE_HANDLE: dmem_buffer_free has told the controller already);
 * *tell_free is set when it was freed during the store, and the caller then
 * sends its FREE event once its move has ended, after store() returned. */
static dmem_status_t tier_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                const dmem__tier_ops_t *dest, void *data, bool *tell_free) {
  if (!dest->watch_free) return dest->store(rt, b, h, data);
  dmem_status_t st =
      dmem__store_watch(b, h)
          ? dest->store(rt, b, h, data)
          : dmem__error(DMEM_ERR_STALE_HANDLE, "handle 0x%016llx was freed during its spill",
                        (unsigned long long)h);
  *tell_free = dmem__store_unwatch(b);
  return st;
}

/* Spill a resident buffer whose TRANSIT we own (state SPILLING, word w).
 *
 * To a tier that adopts the staging (the host tier) the spill is
 * stream-ordered end to end: the copy is enqueued on the spill stream, the
 * pinned staging becomes the tier's copy, the device range goes back to the
 * pool tagged with the copy's event, and the buffer is DEFERRED_HOST with
 * SPILL_COPY set until the copy is seen complete: no cudaFree, no host
 * synchronisation. A retrieve orders its stream after b->spill_event. The
 * other tiers (disk, controller) need the bytes on the host, so they wait
 * for the copy (as does a full host tier, whose spill goes on to its next
 * tier, the disk). */
static dmem_status_t spill_from_device(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                       uint64_t w, const dmem__tier_ops_t *want) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  void *dev = dmem__bdev(b);
  const dmem__tier_ops_t *dest = want;
  dmem_status_t st = DMEM_OK;
  void *ev = NULL;
  bool copied = false; /* the copy is known complete */
  bool tell_free = false; /* freed during the controller's store: we send FREE */
  const bool stable = (dmem__bflags(b) & DMEM_BUFFER_STABLE_ADDRESS) != 0;

  /* Staging left from the last unspill (not charged to any tier): reuse it. */
  void *stage = b->host;
  bool reused = stage != NULL;
  b->host = NULL;
  if (!reused) {
    st = dmem__staging_alloc(rt, size, &stage);
    if (st != DMEM_OK) goto undo;
  }
  if (w & DMEM__F_UNSPILL_COPY) {
    st = dmem__fatal_keep(
        rt, rt->be->stream_wait_event(rt->be, rt->spill_stream, b->unspill_event));
    if (st != DMEM_OK) goto undo;
  }
  st = dmem__event_get(rt, &ev);
  if (st != DMEM_OK) goto undo;
  st = dmem__copy_chunked(rt, stage, dev, size, rt->spill_stream);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, rt->spill_stream));
  if (st != DMEM_OK) {
    (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
    copied = true;
    goto undo;
  }
  dmem_atomic_store_relaxed(&b->spill_event, ev);
  /* release: publishes spill_event; partner is the acquiring CAS of a
   * locker that cancels the spill and then waits on the event */
  dmem_atomic_or_acq_rel(&b->word, DMEM__F_SPILL_COPY);
  dmem__transit_broadcast(rt); /* lockers waiting for SPILL_COPY may cancel now */
  while (dest->adopts_staging) {
    st = dest->store(rt, b, h, stage);
    if (st != DMEM_ERR_HOST_OUT_OF_MEMORY) break;
    const dmem__tier_ops_t *next = dmem__tier_row(dest)->next;
    if (!next) break;
    dest = next; /* full: on down the chain (the host tier: straight to disk) */
  }
  if (!dest->adopts_staging) {
    st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    copied = st == DMEM_OK;
    if (st == DMEM_OK) st = tier_store(rt, b, h, dest, stage, &tell_free);
  }
  /* a stable buffer's memory is unmapped below: its copy must be done */
  if (st == DMEM_OK && stable && !copied) {
    st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    copied = st == DMEM_OK;
  }
  if (st != DMEM_OK) goto undo;
  /* A finished copy's event is nobody's to wait for: cleared now, while we
   * own TRANSIT. After the commit's CAS the next mover may own the buffer
   * and set spill_event for a spill of its own, which a late clear would
   * wipe (SPILL_COPY with no event: a NULL wait, an event lost). */
  if (copied) dmem_atomic_store_relaxed(&b->spill_event, NULL);

  /* Commit unless a lock cancelled the spill meanwhile. */
  w = dmem_atomic_load_acquire(&b->word); /* partner: lockers' CAS */
  for (;;) {
    if (dmem__w_state(w) != DMEM_STATE_SPILLING) {
      /* cancelled: the device copy is the live one */
      dest->drop(rt, b, h);
      dmem_atomic_add_relaxed(&rt->cancelled_spills, 1);
      st = dmem__error(DMEM_ERR_BUSY, "spill of 0x%016llx cancelled by a lock",
                       (unsigned long long)h);
      goto undo;
    }
    DMEM_ASSERT((w & DMEM__F_TRANSIT) && dmem__w_count(w) == 0);
    uint64_t keep = copied ? 0 : DMEM__F_SPILL_COPY; /* the copy still runs */
    uint64_t nw = (dmem__w_with_state(w, dest->state) &
                   ~(DMEM__F_TRANSIT | DMEM__F_SPILL_COPY | DMEM__F_UNSPILL_COPY)) |
                  keep;
    /* a stable buffer keeps TRANSIT until its memory is unmapped: no
     * unspill may map the range before */
    if (stable) nw |= DMEM__F_TRANSIT;
    /* release: publishes b->host; partner is the next mover's acquire */
    if (dmem_atomic_cas_acq_rel(&b->word, &w, nw)) {
      DMEM_SCHED_POINT(); /* the next mover may own the buffer from here */
      dmem__spill_counted(b);
      if (!dest->adopts_staging) dmem__hostpool_free(rt->hostpool, stage);
      /* the range is reusable once the copy that reads it is done */
      if (stable) {
        (void)dmem__stable_unmap(rt, dev); /* failed: still mapped, kept (stable.c) */
        nw = dmem__transit_end(b, (dmem__transit_exit_t){.to = DMEM__TO(dest->state)});
      } else {
        dmem__device_release_after(rt, dev, size, copied ? NULL : ev);
      }
      if (copied) {
        dmem__event_put(rt, ev); /* spill_event was cleared before the CAS */
      } else {
        dmem__staging_push(rt, b, h); /* gives ev back once it completes */
      }
      dmem__move_after(rt, b, nw);
      record_spill(rt, h, size, dest->tier, t0, !(nw & DMEM__F_FREED));
      if (tell_free) dmem__emit(rt, DMEM_EVENT_FREE, h, size, dest->tier, 0);
      return DMEM_OK;
    }
  }

undo:
  /* The buffer stays resident with its device data intact. The copy may
   * still be writing the staging: wait for it before the staging is reused
   * (the cancel path only). Staging taken from a pending unspill goes back
   * (UNSPILL_COPY stays: that copy may still read it). */
  if (ev && !copied) (void)dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
  b->host = reused ? stage : NULL;
  if (!reused && stage) dmem__hostpool_free(rt->hostpool, stage);
  /* b->spill_event keeps pointing at ev: a locker that cancelled this spill
   * may still be about to make its stream wait on it (events are never
   * destroyed before the runtime, so a late wait is at worst conservative) */
  dmem__move_end(rt, b,
                 (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT),
                                        .clear = DMEM__F_SPILL_COPY});
  if (ev) dmem__event_put(rt, ev);
  if (tell_free) dmem__emit(rt, DMEM_EVENT_FREE, h, size, DMEM_TIER_DEVICE, 0);
  return st;
}

/* Wait for the spill copy into the tier of a buffer held by a tier that
 * adopts staging (DEFERRED_HOST) whose TRANSIT we own, and give its event
 * back (tier changes need the bytes on the host). */
static dmem_status_t finish_spill_copy(dmem_runtime_t *rt, dmem__buffer_t *b) {
  uint64_t w = dmem_atomic_load_relaxed(&b->word);
  if (!(w & DMEM__F_SPILL_COPY)) return DMEM_OK;
  void *ev = dmem_atomic_load_relaxed(&b->spill_event);
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
  if (st != DMEM_OK) return st;
  dmem_atomic_and_acq_rel(&b->word, ~DMEM__F_SPILL_COPY);
  dmem_atomic_store_relaxed(&b->spill_event, NULL);
  dmem__event_put(rt, ev);
  return DMEM_OK;
}

/* Move a buffer whose TRANSIT we own from `src`, a tier that keeps its
 * bytes pinned at b->host (the host tier), to another tier. */
static dmem_status_t spill_from_pinned(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                       const dmem__tier_ops_t *src,
                                       const dmem__tier_ops_t *dest) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  bool tell_free = false; /* freed during the controller's store: we send FREE */
  dmem_status_t st = finish_spill_copy(rt, b);
  if (st == DMEM_OK) st = tier_store(rt, b, h, dest, b->host, &tell_free);
  if (st != DMEM_OK) {
    dmem__move_end(rt, b, (dmem__transit_exit_t){0});
    if (tell_free) dmem__emit(rt, DMEM_EVENT_FREE, h, size, src->tier, 0);
    return st;
  }
  src->drop(rt, b, h);
  dmem__host_copy_release(rt, b);
  uint64_t nw = dmem__move_end(rt, b, (dmem__transit_exit_t){.to = DMEM__TO(dest->state)});
  dmem_atomic_add_relaxed(&rt->ns_spilling, dmem__now_ns() - t0);
  if (!(nw & DMEM__F_FREED)) dmem__emit(rt, DMEM_EVENT_SPILL, h, size, dest->tier, 0);
  else if (tell_free) dmem__emit(rt, DMEM_EVENT_FREE, h, size, dest->tier, 0);
  return DMEM_OK;
}

dmem_status_t dmem__spill_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 dmem_tier_t tier, bool by_policy) {
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  const dmem__tier_ops_t *dest = dmem__tier_of(tier);
  if (!dest) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "spill: invalid tier %d", (int)tier);
  if (dest->ready) {
    st = dest->ready(rt);
    if (st != DMEM_OK) return st;
  }
  /* acquire: partner is the release of the last mover / dmem_buffer_alloc */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  for (;;) {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    if (dmem__bflags(b) & DMEM_ALLOC_PINNED)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is pinned", (unsigned long long)h);
    unsigned s = dmem__w_state(w);
    if ((w & DMEM__F_TRANSIT) || s == DMEM_STATE_SPILLING || s == DMEM_STATE_UNSPILLING)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is being moved", (unsigned long long)h);
    /* A victim only frees device memory if it is still resident: one that
     * another thread spilled meanwhile is skipped, not "moved" again. */
    if (by_policy && s != DMEM_STATE_RESIDENT)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is no longer resident",
                         (unsigned long long)h);
    if (s == DMEM_STATE_RESIDENT) {
      if (dmem__w_count(w) > 0)
        return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is locked (%u)",
                           (unsigned long long)h, dmem__w_count(w));
      /* Counted before the buffer leaves the spillable set: an allocation
       * that finds it in TRANSIT sees the spill in flight (the take's
       * release publishes the count; partner: the victim scan's acquire). */
      dmem_atomic_add_relaxed(&rt->spills_in_flight, 1);
      if (!dmem__transit_take(b, &w, DMEM_STATE_SPILLING, 0)) {
        dmem_atomic_sub_relaxed(&rt->spills_in_flight, 1);
        continue;
      }
      /* the controller's store may call back in: a call on h from it gets
       * BUSY, and an allocation does not wait for this spill (core.h) */
      dmem__moving_t m;
      dmem__moving_push(&m, rt, h, true);
      DMEM_NVTX_PUSH("dmem spill");
      st = spill_from_device(rt, b, h, w, dest);
      DMEM_NVTX_POP();
      dmem__moving_pop(&m);
      dmem__move_finished(rt);
      return st;
    }
    if (s == dest->state) return DMEM_OK;
    const dmem__tier_ops_t *src = dmem__tier_of_state(s);
    if (src && src->adopts_staging) {
      if (!dmem__transit_take(b, &w, s, 0)) continue;
      dmem__moving_t m;
      dmem__moving_push(&m, rt, h, false);
      st = spill_from_pinned(rt, b, h, src, dest);
      dmem__moving_pop(&m);
      return st;
    }
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "cannot move handle 0x%016llx, %s, to the %s tier; unspill first",
                       (unsigned long long)h, dmem__state_name(s), dmem__tier_name((int)tier));
  }
}

/* ---- eviction batches ---------------------------------------------------------- */

/* One victim of a batch while the batch owns its TRANSIT. */
typedef struct batch_item {
  dmem__buffer_t *b;
  dmem_handle_t h;
  void *dev;
  void *stage;
  size_t size;
  uint64_t w;  /* the word after our CAS */
  bool reused; /* stage is the staging of a finished unspill (b->host) */
  bool staged; /* batch_staging took b->host into stage (batch_undo gives it back) */
  bool cancelled; /* a lock cancelled its spill after SPILL_COPY was set */
} batch_item_t;

/* Take TRANSIT on the spillable candidates of v[0..n), in order, until
 * DMEM__SPILL_BATCH_MAX are taken or their bytes reach need. Returns how
 * many were taken; *used_out: candidates looked at. */
static size_t batch_take(const dmem__victim_t *v, size_t n, size_t need, batch_item_t *it,
                         size_t *bytes_out, size_t *used_out) {
  size_t k = 0, bytes = 0, i = 0;
  for (; i < n && k < DMEM__SPILL_BATCH_MAX && bytes < need; i++) {
    dmem__buffer_t *b = v[i].b;
    if (!b || (dmem__bflags(b) & DMEM_ALLOC_PINNED)) continue;
    /* a stable buffer is spilled on its own (dmem__spill_batch) */
    if (dmem__bflags(b) & DMEM_BUFFER_STABLE_ADDRESS) break;
    /* acquire: partner is the release of the last mover / dmem_buffer_alloc */
    uint64_t w = dmem_atomic_load_acquire(&b->word);
    for (;;) {
      /* as dmem__spill_buffer by policy: another thread's move, a lock, a
       * free, a spill done meanwhile: skipped */
      if (!dmem__word_live(w, v[i].h) || dmem__w_state(w) != DMEM_STATE_RESIDENT ||
          dmem__w_count(w) > 0 || (w & DMEM__F_TRANSIT))
        break;
      if (!dmem__transit_take(b, &w, DMEM_STATE_SPILLING, 0)) continue;
      size_t size = dmem__bsize(b);
      it[k++] = (batch_item_t){.b = b, .h = v[i].h, .dev = dmem__bdev(b), .size = size, .w = w};
      bytes += size;
      break;
    }
  }
  *bytes_out = bytes;
  *used_out = i;
  return k;
}

/* Before any victim's SPILL_COPY is published: every victim back to
 * resident, its staging given back (the copies, if any were enqueued, are
 * complete: the caller synchronised the spill stream). A victim whose
 * staging was not taken yet (the host tier refused the batch) keeps its
 * b->host: before, it was set to NULL, and the staging of a finished unspill
 * (pinned or pageable) leaked. */
static void batch_undo(dmem_runtime_t *rt, batch_item_t *it, size_t k) {
  for (size_t j = 0; j < k; j++) {
    dmem__buffer_t *b = it[j].b;
    if (it[j].staged) {
      b->host = it[j].reused ? it[j].stage : NULL;
      if (!it[j].reused && it[j].stage) dmem__hostpool_free(rt->hostpool, it[j].stage);
    }
    dmem__move_end(rt, b, (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT)});
  }
}

/* Pinned staging for every victim: the staging a finished unspill left
 * (b->host), else one pinned-pool call for all the others. On failure the
 * items keep what they had (stage and reused) for batch_undo. */
static dmem_status_t batch_staging(dmem_runtime_t *rt, batch_item_t *it, size_t k) {
  size_t sizes[DMEM__SPILL_BATCH_MAX];
  void *ptrs[DMEM__SPILL_BATCH_MAX];
  size_t m = 0;
  for (size_t j = 0; j < k; j++) {
    it[j].stage = it[j].b->host;
    it[j].reused = it[j].stage != NULL;
    it[j].staged = true;
    it[j].b->host = NULL;
    if (!it[j].reused) sizes[m++] = it[j].size;
  }
  dmem_status_t st = m ? dmem__hostpool_alloc_n(rt->hostpool, sizes, m, ptrs) : DMEM_OK;
  if (st != DMEM_OK) {
    /* Nothing taken. A reused staging stays the item's: batch_undo (which
     * the caller runs) puts it back at b->host. (Clearing `reused` here
     * made batch_undo set b->host to NULL: the staging of every finished
     * unspill that met a failed batch was lost.) */
    return st;
  }
  for (size_t j = 0, q = 0; j < k; j++)
    if (!it[j].reused) it[j].stage = ptrs[q++];
  return DMEM_OK;
}

/* Enqueue every victim's copy on the spill stream (after its unspill copy,
 * if one may still read the staging) and record one event after them. */
static dmem_status_t batch_copy(dmem_runtime_t *rt, batch_item_t *it, size_t k, void *ev) {
  dmem_status_t st = DMEM_OK;
  for (size_t j = 0; j < k && st == DMEM_OK; j++) {
    if (it[j].w & DMEM__F_UNSPILL_COPY)
      st = dmem__fatal_keep(
          rt, rt->be->stream_wait_event(rt->be, rt->spill_stream, it[j].b->unspill_event));
    if (st == DMEM_OK) st = dmem__copy_chunked(rt, it[j].stage, it[j].dev, it[j].size, rt->spill_stream);
  }
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, rt->spill_stream));
  return st;
}

/* A victim whose spill a lock cancelled after its SPILL_COPY was published
 * (we still own TRANSIT; the copy is complete: the caller waited for it):
 * as spill_from_device's undo. */
static void batch_cancelled(dmem_runtime_t *rt, const dmem__tier_ops_t *dest, batch_item_t *x,
                            void *ev, bool copied) {
  dmem__buffer_t *b = x->b;
  dest->drop(rt, b, x->h);
  dmem_atomic_add_relaxed(&rt->cancelled_spills, 1);
  b->host = x->reused ? x->stage : NULL;
  if (!x->reused) dmem__hostpool_free(rt->hostpool, x->stage);
  /* b->spill_event keeps pointing at ev, as in spill_from_device */
  dmem__move_end(rt, b,
                 (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT),
                                        .clear = DMEM__F_SPILL_COPY});
  if (!copied) dmem__event_put(rt, ev); /* this victim's reference */
}

dmem_status_t dmem__spill_batch(dmem_runtime_t *rt, const dmem__victim_t *v, size_t n,
                                size_t need, dmem__spill_batch_result_t *res_out) {
  *res_out = (dmem__spill_batch_result_t){0};
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  /* the tier whose row takes batches (the first row: the host tier) */
  const dmem__tier_row_t *row = dmem__tier_row(dmem__tier_top());
  if (!row->batch) { /* no batches: the caller spills these one by one */
    res_out->single = true;
    res_out->used = n < DMEM__SPILL_BATCH_MAX ? n : DMEM__SPILL_BATCH_MAX;
    return DMEM_OK;
  }
  const dmem__tier_ops_t *dest = row->ops;
  batch_item_t it[DMEM__SPILL_BATCH_MAX];
  size_t bytes = 0;
  /* one count for the whole batch, raised before its victims leave the
   * spillable set (as in dmem__spill_buffer) */
  dmem_atomic_add_relaxed(&rt->spills_in_flight, 1);
  size_t k = batch_take(v, n, need, it, &bytes, &res_out->used);
  if (k == 0) {
    dmem_atomic_sub_relaxed(&rt->spills_in_flight, 1);
    /* a stable buffer first: spilled one by one (its memory is unmapped,
     * not pooled) */
    size_t u = res_out->used;
    if (u < n && v[u].b && (dmem__bflags(v[u].b) & DMEM_BUFFER_STABLE_ADDRESS)) {
      res_out->single = true;
      res_out->used = u + 1;
    }
    return DMEM_OK;
  }
  uint64_t t0 = dmem__now_ns();
  DMEM_NVTX_PUSH("dmem spill batch");
  void *ev = NULL;
  bool copied = false; /* the copies are known complete */

  if (!dest->charge_n(rt, bytes)) {
    res_out->single = true; /* one by one: some go to disk */
    batch_undo(rt, it, k);
    goto out;
  }
  st = batch_staging(rt, it, k);
  if (st == DMEM_ERR_HOST_OUT_OF_MEMORY) {
    st = DMEM_OK;
    res_out->single = true; /* one by one: they recycle staging, or go to disk */
  }
  if (st != DMEM_OK || res_out->single) {
    dest->uncharge_n(rt, bytes);
    batch_undo(rt, it, k);
    goto out;
  }
  st = dmem__event_get(rt, &ev);
  if (st == DMEM_OK) {
    st = batch_copy(rt, it, k, ev);
    if (st != DMEM_OK) (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
  }
  if (st == DMEM_OK && dmem__event_share(rt, ev, k) != DMEM_OK) {
    /* no reference per victim: wait for the copies, and share nothing */
    st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    copied = st == DMEM_OK;
  }
  if (st != DMEM_OK) {
    dest->uncharge_n(rt, bytes);
    batch_undo(rt, it, k);
    if (ev) dmem__event_put(rt, ev);
    goto out;
  }

  /* Publish: each victim's spill_event, then SPILL_COPY (lockers cancel
   * from now on); one wake-up for the lockers waiting for it. */
  for (size_t j = 0; j < k; j++) {
    dmem_atomic_store_relaxed(&it[j].b->spill_event, ev);
    /* release: publishes spill_event; partner is the acquiring CAS of a
     * locker that cancels the spill and then waits on the event */
    dmem_atomic_or_acq_rel(&it[j].b->word, DMEM__F_SPILL_COPY);
    it[j].b->host = it[j].stage; /* the tier adopts the staging */
  }
  dmem__transit_broadcast(rt);

  /* Commit each victim unless a lock cancelled its spill meanwhile. */
  dmem__buffer_t *done_b[DMEM__SPILL_BATCH_MAX];
  uint64_t done_w[DMEM__SPILL_BATCH_MAX];
  void *devs[DMEM__SPILL_BATCH_MAX];
  size_t sizes[DMEM__SPILL_BATCH_MAX];
  dmem__reg_entry_t entries[DMEM__SPILL_BATCH_MAX];
  size_t m = 0, freed = 0, ncancel = 0;
  const uint64_t keep = copied ? 0 : DMEM__F_SPILL_COPY; /* the copies still run */
  for (size_t j = 0; j < k; j++) {
    dmem__buffer_t *b = it[j].b;
    uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: lockers' CAS */
    for (;;) {
      if (dmem__w_state(w) != DMEM_STATE_SPILLING) {
        it[j].cancelled = true; /* the device copy is the live one */
        ncancel++;
        break;
      }
      DMEM_ASSERT((w & DMEM__F_TRANSIT) && dmem__w_count(w) == 0);
      /* cleared while we own TRANSIT, as in spill_from_device */
      if (copied) dmem_atomic_store_relaxed(&b->spill_event, NULL);
      uint64_t nw = (dmem__w_with_state(w, dest->state) &
                     ~(DMEM__F_TRANSIT | DMEM__F_SPILL_COPY | DMEM__F_UNSPILL_COPY)) |
                    keep;
      /* release: publishes b->host; partner is the next mover's acquire */
      if (dmem_atomic_cas_acq_rel(&b->word, &w, nw)) {
        DMEM_SCHED_POINT(); /* the next mover may own the buffer from here */
        dmem__spill_counted(b);
        done_b[m] = b;
        done_w[m] = nw;
        devs[m] = it[j].dev;
        sizes[m] = it[j].size;
        entries[m] = (dmem__reg_entry_t){.b = b, .h = it[j].h};
        freed += it[j].size;
        m++;
        break;
      }
    }
  }
  if (ncancel) {
    /* their copies may still write the staging they give back */
    if (!copied) (void)dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
    for (size_t j = 0; j < k; j++)
      if (it[j].cancelled) batch_cancelled(rt, dest, &it[j], ev, copied);
  }
  /* The ranges are reusable once the copies that read them are done: one
   * pool call tagged with the batch's event. */
  dmem__device_release_after_n(rt, devs, sizes, m, copied ? NULL : ev);
  if (copied)
    dmem__event_put(rt, ev); /* never shared */
  else
    dmem__staging_push_n(rt, entries, m); /* each gives its reference back once ev completes */
  dmem__moves_after(rt, done_b, done_w, m);
  if (m && DMEM__TRACE_ON())
    dmem__trace_event(DMEM__TRACK_TIER, dest->tier, "spill", t0, dmem__now_ns() - t0, freed, m,
                      0);
  if (m) dmem__stats_spill_n(rt, dest->tier, m, freed, dmem__now_ns() - t0);
  for (size_t j = 0; j < m; j++)
    if (!(done_w[j] & DMEM__F_FREED))
      dmem__emit(rt, DMEM_EVENT_SPILL, entries[j].h, sizes[j], dest->tier, 0);
  res_out->victims = m;
  res_out->freed = freed;
out:
  DMEM_NVTX_POP();
  dmem__move_finished(rt);
  return st;
}
