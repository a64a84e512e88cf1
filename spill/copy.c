/*
 * spill/copy.c - moving one buffer between tiers: spill (device -> host, disk
 * or controller, on the runtime's own copy stream), tier changes of deferred
 * buffers, and the stream-ordered retrieve (host -> device on the locker's
 * stream). Also the event pool and the recycling of unspill staging memory.
 *
 * Every move runs while the mover owns the buffer's TRANSIT bit (see
 * runtime/internal.h); no mutex is held while copying or calling the
 * controller.
 */
#include "runtime/internal.h"
#include <stdlib.h>
#include <string.h>


/* ---- events ------------------------------------------------------------------ */

dmem_status_t dmem__event_get(dmem_runtime_t *rt, void **ev_out) {
  pthread_mutex_lock(&rt->evpool_mu);
  if (rt->evpool_n > 0) {
    *ev_out = rt->evpool[--rt->evpool_n];
    pthread_mutex_unlock(&rt->evpool_mu);
    return DMEM_OK;
  }
  pthread_mutex_unlock(&rt->evpool_mu);
  return dmem__be(rt, rt->be->event_create(rt->be, ev_out));
}

/* Events are never destroyed before the runtime is: a locker that read
 * b->spill_event may still wait on it after the spiller put it back. */
void dmem__event_put(dmem_runtime_t *rt, void *ev) {
  pthread_mutex_lock(&rt->evpool_mu);
  if (rt->evpool_n == rt->evpool_cap) {
    size_t cap = rt->evpool_cap ? rt->evpool_cap * 2 : 64;
    void **v = realloc(rt->evpool, cap * sizeof *v);
    if (!v) {
      /* keep it alive anyway: leak one event rather than risk a wait on a
       * destroyed one */
      pthread_mutex_unlock(&rt->evpool_mu);
      return;
    }
    rt->evpool = v;
    rt->evpool_cap = cap;
  }
  rt->evpool[rt->evpool_n++] = ev;
  pthread_mutex_unlock(&rt->evpool_mu);
}

/* ---- host copies ------------------------------------------------------------- */

static bool host_reserve(dmem_runtime_t *rt, size_t size) {
  return dmem__reserve(&rt->host_used, rt->host_limit ? rt->host_limit : SIZE_MAX, size, NULL);
}

void dmem__release_host_copy(dmem_runtime_t *rt, dmem__buffer_t *b) {
  if (!b->host) return;
  dmem__hostpool_free(rt->hostpool, b->host);
  if (b->host_charged) dmem_atomic_sub_relaxed(&rt->host_used, dmem__bsize(b));
  b->host = NULL;
  b->host_charged = false;
}

dmem_status_t dmem__get_disk(dmem_runtime_t *rt, dmem__disk_t **disk_out) {
  /* acquire: partner is the release store below */
  dmem__disk_t *d = dmem_atomic_load_acquire(&rt->disk);
  if (d) {
    *disk_out = d;
    return DMEM_OK;
  }
  pthread_mutex_lock(&rt->disk_mu);
  d = dmem_atomic_load_relaxed(&rt->disk);
  dmem_status_t st = DMEM_OK;
  if (!d) {
    st = dmem__disk_create(rt->spill_dir_copy, &d);
    if (st == DMEM_OK) dmem_atomic_store_release(&rt->disk, d);
  }
  pthread_mutex_unlock(&rt->disk_mu);
  if (st == DMEM_OK) *disk_out = d;
  return st;
}

static unsigned state_of_tier(dmem_tier_t t) {
  switch (t) {
    case DMEM_TIER_HOST: return DMEM_STATE_DEFERRED_HOST;
    case DMEM_TIER_DISK: return DMEM_STATE_DEFERRED_DISK;
    case DMEM_TIER_CONTROLLER: return DMEM_STATE_DEFERRED_CONTROLLER;
    default: return DMEM_STATE_RESIDENT;
  }
}

/* Hand `data` to the disk or the controller tier. */
static dmem_status_t store_outside(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                   dmem_tier_t tier, const void *data) {
  if (tier == DMEM_TIER_DISK) {
    dmem__disk_t *disk;
    dmem_status_t st = dmem__get_disk(rt, &disk);
    if (st != DMEM_OK) return st;
    st = dmem__disk_write(disk, h, data, dmem__bsize(b));
    if (st == DMEM_OK) dmem_atomic_add_relaxed(&rt->disk_used, dmem__bsize(b));
    return st;
  }
  dmem_controller_t c;
  if (!dmem__controller_get(rt, &c) || !c.store)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "no controller with store/retrieve installed");
  dmem_status_t st = c.store(c.user, h, data, dmem__bsize(b));
  if (st != DMEM_OK)
    return dmem__error(DMEM_ERR_CALLBACK, "controller store(0x%016llx) returned %s",
                       (unsigned long long)h, dmem_status_name(st));
  dmem_atomic_add_relaxed(&rt->controller_used, dmem__bsize(b));
  return DMEM_OK;
}

/* Undo store_outside after a cancelled spill. */
static void unstore_outside(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                            dmem_tier_t tier) {
  if (tier == DMEM_TIER_DISK) {
    dmem__disk_remove(dmem_atomic_load_acquire(&rt->disk), h); /* partner: dmem__get_disk */
    dmem_atomic_sub_relaxed(&rt->disk_used, dmem__bsize(b));
  } else if (tier == DMEM_TIER_CONTROLLER) {
    /* The controller keeps a copy it will never be asked for; a later
     * store for the same handle replaces it, a FREE event drops it. */
    dmem_atomic_sub_relaxed(&rt->controller_used, dmem__bsize(b));
  }
}

static void record_spill(dmem_runtime_t *rt, dmem_handle_t h, size_t size, dmem_tier_t tier,
                         uint64_t t0, bool emit) {
  dmem_atomic_add_relaxed(&rt->spill_count, 1);
  dmem_atomic_add_relaxed(&rt->bytes_spilled, size);
  dmem_atomic_add_relaxed(&rt->ns_spilling, dmem__now_ns() - t0);
  if (emit) dmem__emit(rt, DMEM_EVENT_SPILL, h, size, tier, 0);
}

/* Spill a resident buffer whose TRANSIT we own (state SPILLING). */
static dmem_status_t spill_from_device(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                       uint64_t w, dmem_tier_t tier) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  void *dev = b->dev;
  dmem_tier_t dest = tier;
  bool charged = false;
  dmem_status_t st = DMEM_OK;
  void *ev = NULL;

  if (dest == DMEM_TIER_HOST) {
    charged = host_reserve(rt, size);
    if (!charged) dest = DMEM_TIER_DISK; /* host tier full: straight to disk */
  }
  void *stage = b->host; /* staging left from the last unspill: reuse it */
  bool reused = stage != NULL;
  if (stage) {
    if (b->host_charged) dmem_atomic_sub_relaxed(&rt->host_used, size);
    b->host = NULL;
    b->host_charged = false;
  } else {
    st = dmem__hostpool_alloc(rt->hostpool, size, &stage);
    if (st != DMEM_OK) goto undo;
  }
  if (w & DMEM__F_READY) {
    st = dmem__be(rt, rt->be->stream_wait_event(rt->be, rt->spill_stream, b->ready_event));
    if (st != DMEM_OK) goto undo;
  }
  st = dmem__event_get(rt, &ev);
  if (st != DMEM_OK) goto undo;
  st = dmem__be(rt, rt->be->memcpy_async(rt->be, stage, dev, size, rt->spill_stream));
  if (st == DMEM_OK) st = dmem__be(rt, rt->be->event_record(rt->be, ev, rt->spill_stream));
  if (st != DMEM_OK) {
    (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
    goto undo;
  }
  dmem_atomic_store_relaxed(&b->spill_event, ev);
  /* release: publishes spill_event; partner is the acquiring CAS of a
   * locker that cancels the spill and then waits on the event */
  atomic_fetch_or_explicit(&b->word, DMEM__F_COPYEV, memory_order_acq_rel);
  dmem__transit_broadcast(rt); /* lockers waiting for COPYEV may cancel now */
  st = dmem__be(rt, rt->be->event_synchronize(rt->be, ev));
  if (st != DMEM_OK) goto undo;
  if (dest != DMEM_TIER_HOST) {
    st = store_outside(rt, b, h, dest, stage);
    if (st != DMEM_OK) goto undo;
  }

  /* Commit unless a lock cancelled the spill meanwhile. */
  w = dmem_atomic_load_acquire(&b->word); /* partner: lockers' CAS */
  for (;;) {
    if (dmem__w_state(w) != DMEM_STATE_SPILLING) {
      /* cancelled: the device copy is the live one */
      if (dest != DMEM_TIER_HOST) unstore_outside(rt, b, h, dest);
      dmem_atomic_add_relaxed(&rt->cancelled_spills, 1);
      st = dmem__error(DMEM_ERR_BUSY, "spill of 0x%016llx cancelled by a lock",
                       (unsigned long long)h);
      goto undo;
    }
    if (dest == DMEM_TIER_HOST) {
      b->host = stage;
      b->host_charged = charged;
    }
    dmem_atomic_add_relaxed(&b->spill_count, 1);
    uint64_t nw = dmem__w_with_state(w, state_of_tier(dest)) &
                  ~(DMEM__F_TRANSIT | DMEM__F_COPYEV | DMEM__F_READY);
    /* release: publishes b->host; partner is the next mover's acquire */
    if (dmem_atomic_cas_acq_rel(&b->word, &w, nw)) {
      if (dest != DMEM_TIER_HOST) dmem__hostpool_free(rt->hostpool, stage);
      dmem__device_release(rt, dev, size);
      dmem_atomic_store_relaxed(&b->spill_event, NULL);
      dmem__transit_after(rt, b, nw);
      dmem__event_put(rt, ev);
      record_spill(rt, h, size, dest, t0, !(nw & DMEM__F_FREED));
      return DMEM_OK;
    }
    dmem_atomic_sub_relaxed(&b->spill_count, 1);
    if (dest == DMEM_TIER_HOST) {
      b->host = NULL;
      b->host_charged = false;
    }
  }

undo:
  /* The buffer stays resident with its device data intact. Staging taken
   * from a pending unspill goes back (READY stays: that copy may still read
   * it). */
  if (reused) b->host = stage;
  else if (stage) dmem__hostpool_free(rt->hostpool, stage);
  if (charged) dmem_atomic_sub_relaxed(&rt->host_used, size);
  dmem__transit_end(rt, b, DMEM__F_COPYEV, DMEM_STATE_RESIDENT, true, 0, 0);
  if (ev) dmem__event_put(rt, ev);
  return st;
}

/* Move a DEFERRED_HOST buffer whose TRANSIT we own to disk or controller. */
static dmem_status_t spill_from_host(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                     dmem_tier_t tier) {
  uint64_t t0 = dmem__now_ns();
  dmem_status_t st = store_outside(rt, b, h, tier, b->host);
  if (st != DMEM_OK) {
    dmem__transit_end(rt, b, 0, 0, false, 0, 0);
    return st;
  }
  void *host = b->host;
  bool charged = b->host_charged;
  b->host = NULL;
  b->host_charged = false;
  uint64_t w = dmem_atomic_load_relaxed(&b->word), nw;
  do {
    nw = dmem__w_with_state(w, state_of_tier(tier)) & ~DMEM__F_TRANSIT;
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  dmem__hostpool_free(rt->hostpool, host);
  if (charged) dmem_atomic_sub_relaxed(&rt->host_used, dmem__bsize(b));
  size_t size = dmem__bsize(b);
  dmem__transit_after(rt, b, nw);
  dmem_atomic_add_relaxed(&rt->ns_spilling, dmem__now_ns() - t0);
  if (!(nw & DMEM__F_FREED)) dmem__emit(rt, DMEM_EVENT_SPILL, h, size, tier, 0);
  return DMEM_OK;
}

dmem_status_t dmem__spill_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 dmem_tier_t tier, bool by_policy) {
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  if (tier != DMEM_TIER_HOST && tier != DMEM_TIER_DISK && tier != DMEM_TIER_CONTROLLER)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "spill: invalid tier %d", (int)tier);
  if (tier == DMEM_TIER_CONTROLLER) {
    dmem_controller_t c;
    if (!dmem__controller_get(rt, &c) || !c.store || !c.retrieve)
      return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                         "spill to the controller tier needs a controller with store/retrieve");
  }
  /* acquire: partner is the release of the last mover / dmem_alloc */
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
      uint64_t nw = dmem__w_with_state(w, DMEM_STATE_SPILLING) | DMEM__F_TRANSIT;
      if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
      dmem__tl_transit = b;
      dmem_atomic_add_relaxed(&rt->spills_in_flight, 1);
      st = spill_from_device(rt, b, h, nw, tier);
      dmem_atomic_sub_relaxed(&rt->spills_in_flight, 1);
      return st;
    }
    if (s == state_of_tier(tier)) return DMEM_OK;
    if (s == DMEM_STATE_DEFERRED_HOST) {
      uint64_t nw = w | DMEM__F_TRANSIT;
      if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
      dmem__tl_transit = b;
      return spill_from_host(rt, b, h, tier);
    }
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "cannot move handle 0x%016llx from state %u to tier %d; unspill first",
                       (unsigned long long)h, s, (int)tier);
  }
}

/* ---- retrieve ------------------------------------------------------------------ */

dmem_status_t dmem__unspill_owned(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                  uint64_t w, void *stream, bool locking) {
  uint64_t t0 = dmem__now_ns();
  unsigned from = dmem__w_state(w);
  size_t size = dmem__bsize(b);
  void *dev = NULL, *stage = NULL;
  dmem_status_t st = dmem__device_obtain(rt, size, &dev);
  if (st != DMEM_OK) goto rollback;
  const void *src;
  if (from == DMEM_STATE_DEFERRED_HOST) {
    src = b->host;
  } else {
    st = dmem__hostpool_alloc(rt->hostpool, size, &stage);
    if (st != DMEM_OK) goto rollback;
    if (from == DMEM_STATE_DEFERRED_DISK) {
      dmem__disk_t *disk;
      st = dmem__get_disk(rt, &disk);
      if (st == DMEM_OK) st = dmem__disk_read(disk, h, stage, size);
      if (st != DMEM_OK) goto rollback;
    } else {
      dmem_controller_t c;
      if (!dmem__controller_get(rt, &c) || !c.retrieve) {
        st = dmem__error(DMEM_ERR_CALLBACK, "no controller to retrieve 0x%016llx from",
                         (unsigned long long)h);
        goto rollback;
      }
      st = c.retrieve(c.user, h, stage, size);
      if (st != DMEM_OK) {
        st = dmem__error(DMEM_ERR_CALLBACK, "controller retrieve(0x%016llx) returned %s",
                         (unsigned long long)h, dmem_status_name(st));
        goto rollback;
      }
    }
    src = stage;
  }
  if (!b->ready_event) {
    st = dmem__event_get(rt, &b->ready_event);
    if (st != DMEM_OK) goto rollback;
  }
  /* Stream-ordered retrieve: the caller's next work on `stream` follows. */
  st = dmem__be(rt, rt->be->memcpy_async(rt->be, dev, src, size, stream));
  if (st == DMEM_OK) st = dmem__be(rt, rt->be->event_record(rt->be, b->ready_event, stream));
  if (st != DMEM_OK) {
    (void)rt->be->stream_synchronize(rt->be, stream);
    goto rollback;
  }
  b->dev = dev;
  if (from == DMEM_STATE_DEFERRED_HOST) {
    if (b->host_charged) dmem_atomic_sub_relaxed(&rt->host_used, size);
    b->host_charged = false; /* now staging, recycled once the copy is done */
  } else {
    if (from == DMEM_STATE_DEFERRED_DISK) {
      dmem__disk_remove(dmem_atomic_load_acquire(&rt->disk), h); /* partner: dmem__get_disk */
      dmem_atomic_sub_relaxed(&rt->disk_used, size);
    } else {
      dmem_atomic_sub_relaxed(&rt->controller_used, size);
    }
    b->host = stage;
    b->host_charged = false;
  }
  dmem_atomic_add_relaxed(&rt->unspill_count, 1);
  dmem_atomic_add_relaxed(&rt->bytes_unspilled, size);
  dmem_atomic_add_relaxed(&rt->ns_unspilling, dmem__now_ns() - t0);
  dmem__ready_push(rt, b, h);
  /* release: publishes b->dev and b->ready_event; partner is the lockers'
   * acquire */
  uint64_t nw = dmem__transit_end(rt, b, 0, DMEM_STATE_RESIDENT, true, DMEM__F_READY, 0);
  if (!(nw & DMEM__F_FREED))
    dmem__emit(rt, DMEM_EVENT_UNSPILL, h, size,
               from == DMEM_STATE_DEFERRED_HOST   ? DMEM_TIER_HOST
               : from == DMEM_STATE_DEFERRED_DISK ? DMEM_TIER_DISK
                                                  : DMEM_TIER_CONTROLLER,
               0);
  return DMEM_OK;

rollback:
  if (dev) dmem__device_release(rt, dev, size);
  if (stage) dmem__hostpool_free(rt->hostpool, stage);
  dmem__transit_end(rt, b, 0, from, true, 0, locking ? -1 : 0);
  return st;
}

/* ---- recycling unspill staging ------------------------------------------------ */

void dmem__ready_push(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  pthread_mutex_lock(&rt->ready_mu);
  if (rt->nready == rt->capready) {
    size_t cap = rt->capready ? rt->capready * 2 : 64;
    dmem__reg_entry_t *v = realloc(rt->ready, cap * sizeof *v);
    if (!v) {
      /* Not tracked: the staging is recycled at the next spill or at
       * reclaim instead. */
      pthread_mutex_unlock(&rt->ready_mu);
      return;
    }
    rt->ready = v;
    rt->capready = cap;
  }
  rt->ready[rt->nready].b = b;
  rt->ready[rt->nready].h = h;
  rt->nready++;
  pthread_mutex_unlock(&rt->ready_mu);
}

void dmem__ready_poll(dmem_runtime_t *rt, bool wait_all) {
  pthread_mutex_lock(&rt->ready_mu);
  size_t keep = 0;
  for (size_t i = 0; i < rt->nready; i++) {
    dmem__buffer_t *b = rt->ready[i].b;
    dmem_handle_t h = rt->ready[i].h;
    /* acquire: partner is the unspiller's releasing CAS */
    uint64_t w = dmem_atomic_load_acquire(&b->word);
    /* done elsewhere, or freed (then reclaim recycles the staging; TRANSIT
     * is never taken on a freed buffer) */
    if (dmem__w_gen(w) != dmem__h_gen(h) || !(w & DMEM__F_READY) || (w & DMEM__F_FREED)) continue;
    /* the CAS fails if FREED was set meanwhile: the entry is kept and
     * dropped by the next poll */
    if ((w & DMEM__F_TRANSIT) ||
        !dmem_atomic_cas_strong_acq_rel(&b->word, &w, w | DMEM__F_TRANSIT)) {
      rt->ready[keep++] = rt->ready[i];
      continue;
    }
    dmem_status_t q = wait_all ? rt->be->event_synchronize(rt->be, b->ready_event)
                               : rt->be->event_query(rt->be, b->ready_event);
    if (q == DMEM_OK || (q != DMEM_ERR_BUSY && wait_all)) {
      void *host = b->host;
      bool charged = b->host_charged;
      b->host = NULL;
      b->host_charged = false;
      if (host) {
        dmem__hostpool_free(rt->hostpool, host);
        if (charged) dmem_atomic_sub_relaxed(&rt->host_used, dmem__bsize(b));
      }
      dmem__transit_end(rt, b, DMEM__F_READY, 0, false, 0, 0);
    } else {
      (void)dmem__be(rt, q == DMEM_ERR_BUSY ? DMEM_OK : q);
      dmem__transit_end(rt, b, 0, 0, false, 0, 0);
      rt->ready[keep++] = rt->ready[i];
    }
  }
  rt->nready = keep;
  pthread_mutex_unlock(&rt->ready_mu);
}

/* ---- public entry points ------------------------------------------------------- */

dmem_status_t dmem_spill(dmem_runtime_t *rt, dmem_handle_t h, dmem_tier_t tier) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_spill: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  if (dmem__tl_transit == b)
    return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is being moved by this thread",
                       (unsigned long long)h);
  return dmem__spill_buffer(rt, b, h, tier, false);
}

dmem_status_t dmem_unspill(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_unspill: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  /* acquire: partner is the release of the last mover / dmem_alloc */
  uint64_t w = b ? dmem_atomic_load_acquire(&b->word) : 0;
  for (;;) {
    if (!b || !dmem__word_live(w, h)) return dmem__stale(h);
    unsigned s = dmem__w_state(w);
    if (s == DMEM_STATE_RESIDENT) return DMEM_OK;
    if (s == DMEM_STATE_SPILLING && dmem__tl_transit == b)
      return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is being spilled by this thread",
                         (unsigned long long)h);
    if (s == DMEM_STATE_SPILLING && (w & DMEM__F_COPYEV)) {
      /* cancel the spill, as a lock would, and order `stream` after the
       * copy that still reads the device memory */
      void *ev = dmem_atomic_load_relaxed(&b->spill_event); /* ours if the CAS succeeds */
      uint64_t nw = dmem__w_with_state(w, DMEM_STATE_RESIDENT);
      if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
      dmem__transit_broadcast(rt);
      return dmem__be(rt, rt->be->stream_wait_event(rt->be, stream, ev));
    }
    if ((w & DMEM__F_TRANSIT) || s == DMEM_STATE_SPILLING || s == DMEM_STATE_UNSPILLING) {
      if (dmem__tl_transit == b)
        return dmem__error(DMEM_ERR_BUSY, "handle 0x%016llx is being moved by this thread",
                           (unsigned long long)h);
      dmem__transit_wait(rt, b, w);
      w = dmem_atomic_load_acquire(&b->word); /* partner: dmem__transit_end */
      continue;
    }
    uint64_t nw = dmem__w_with_state(w, DMEM_STATE_UNSPILLING) | DMEM__F_TRANSIT;
    if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
    dmem__tl_transit = b;
    return dmem__unspill_owned(rt, b, h, w, stream, false);
  }
}
