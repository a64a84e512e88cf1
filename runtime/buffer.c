/*
 * runtime/buffer.c - buffer life cycle: alloc, free, info, lock, unlock,
 * priorities; device memory with on-demand eviction; the TRANSIT protocol
 * that serialises slow-path moves of one buffer without a mutex.
 */
#include "internal.h"
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


_Thread_local dmem__buffer_t *dmem__tl_transit;
_Thread_local uint64_t dmem__tl_lru_seq;

/* How long an allocation keeps waiting for in-flight moves and stream
 * releases to free memory before it reports DMEM_ERR_OUT_OF_MEMORY. */
#define DMEM__OOM_PATIENCE_NS (5ull * 1000 * 1000 * 1000)

/* ---- transit waits ---------------------------------------------------------- */

void dmem__transit_broadcast(dmem_runtime_t *rt) {
  pthread_mutex_lock(&rt->tmu);
  dmem_atomic_add_relaxed(&rt->transit_epoch, 1);
  pthread_cond_broadcast(&rt->tcv);
  pthread_mutex_unlock(&rt->tmu);
}

/* Block until b's word differs from `seen` (or a transit ends anywhere). */
void dmem__transit_wait(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t seen) {
  pthread_mutex_lock(&rt->tmu);
  uint64_t epoch = dmem_atomic_load_relaxed(&rt->transit_epoch);
  /* acquire: partner is the owner's releasing CAS in dmem__transit_end */
  while (dmem_atomic_load_acquire(&b->word) == seen &&
         dmem_atomic_load_relaxed(&rt->transit_epoch) == epoch) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 10 * 1000 * 1000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&rt->tcv, &rt->tmu, &ts);
  }
  pthread_mutex_unlock(&rt->tmu);
}

/* End the caller's TRANSIT ownership of b: clear `clear` flags and TRANSIT,
 * optionally set the state, set `set_flags`, add count_delta to the lock
 * count. Reclaims b if it was freed and is no longer locked. */
uint64_t dmem__transit_end(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t clear, unsigned state,
                       bool set_state, uint64_t set_flags, int count_delta) {
  uint64_t w = dmem_atomic_load_relaxed(&b->word), nw;
  do {
    nw = (w & ~(clear | DMEM__F_TRANSIT)) | set_flags;
    if (set_state) nw = dmem__w_with_state(nw, state);
    nw = (uint64_t)((int64_t)nw + count_delta);
    /* release: partner is the acquire load/CAS of lockers and movers */
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  dmem__transit_after(rt, b, nw);
  return nw;
}

void dmem__transit_after(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw) {
  if (dmem__tl_transit == b) dmem__tl_transit = NULL;
  if ((nw & DMEM__F_FREED) && dmem__w_count(nw) == 0) dmem__reclaim(rt, b, nw);
  dmem__transit_broadcast(rt);
}

/* ---- device memory ------------------------------------------------------------ */

void dmem__device_release(dmem_runtime_t *rt, void *dev, size_t size) {
  if (dev) (void)dmem__be(rt, rt->be->device_free(rt->be, dev));
  dmem_atomic_sub_relaxed(&rt->device_used, size);
}

dmem_status_t dmem__device_obtain(dmem_runtime_t *rt, size_t size, void **dev_out) {
  if (size > rt->limit)
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "%zu bytes exceed the device limit of %zu bytes",
                       size, rt->limit);
  uint64_t deadline = 0;
  dmem_status_t last_err = DMEM_OK;
  bool told = false;
  for (;;) {
    size_t need = 0;
    if (dmem__reserve(&rt->device_used, rt->limit, size, &need)) {
      void *p = NULL;
      dmem_status_t st = dmem__be(rt, rt->be->device_alloc(rt->be, size, &p));
      if (st == DMEM_OK) {
        *dev_out = p;
        return DMEM_OK;
      }
      dmem_atomic_sub_relaxed(&rt->device_used, size);
      if (st != DMEM_ERR_OUT_OF_MEMORY) return st;
      need = size; /* the device itself is full (other users, fragmentation) */
    }
    /* Finished stream releases unlock buffers: make them victims first. */
    dmem__registry_poll(rt, false);
    dmem__ready_poll(rt, false);
    if (!told && dmem_atomic_load_relaxed(&rt->has_ctl)) {
      /* The controller may make room itself (it runs with no mutex held);
       * look again before evicting by policy. */
      told = true;
      dmem__emit(rt, DMEM_EVENT_PRESSURE, DMEM_HANDLE_NULL, 0, DMEM_TIER_DEVICE, need);
      continue;
    }
    told = false;
    size_t freed = 0;
    dmem_status_t err = DMEM_OK;
    dmem_status_t st = dmem__evict(rt, need, true, &freed, &err);
    if (st != DMEM_OK) return st;
    if (err != DMEM_OK) last_err = err;
    if (freed > 0) {
      deadline = 0;
      continue;
    }
    /* Nothing could be spilled now. Other threads' moves or pending stream
     * releases may still free memory: wait for them, with a deadline. */
    bool hope = dmem_atomic_load_relaxed(&rt->spills_in_flight) > 0 ||
                dmem_atomic_load_relaxed(&rt->reg.npending) > 0;
    uint64_t now = dmem__now_ns();
    if (hope) {
      if (deadline == 0) deadline = now + DMEM__OOM_PATIENCE_NS;
      if (now < deadline) {
        pthread_mutex_lock(&rt->tmu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) {
          ts.tv_sec++;
          ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&rt->tcv, &rt->tmu, &ts);
        pthread_mutex_unlock(&rt->tmu);
        continue;
      }
    }
    if (last_err != DMEM_OK && last_err != DMEM_ERR_BUSY) return last_err;
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                       "no device memory for %zu bytes: %zu of %zu bytes used and nothing "
                       "left to spill",
                       size, dmem_atomic_load_relaxed(&rt->device_used), rt->limit);
  }
}

/* ---- reclaim -------------------------------------------------------------------- */

/* Called exactly once per freed buffer, by the party whose CAS made
 * FREED && count == 0 && !TRANSIT true; w is that word. */
void dmem__reclaim(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t w) {
  unsigned state = dmem__w_state(w);
  if (w & DMEM__F_READY) {
    /* The unspill copy may still read the staging and write the device
     * memory: wait for it before freeing either. */
    (void)dmem__be(rt, rt->be->event_synchronize(rt->be, b->ready_event));
  }
  if (state == DMEM_STATE_RESIDENT) {
    dmem__device_release(rt, b->dev, dmem__bsize(b));
    if (dmem__bflags(b) & DMEM_ALLOC_PINNED) dmem_atomic_sub_relaxed(&rt->device_pinned, dmem__bsize(b));
  }
  if (b->host) dmem__release_host_copy(rt, b);
  if (state == DMEM_STATE_DEFERRED_DISK) {
    dmem__disk_t *disk = dmem_atomic_load_acquire(&rt->disk); /* partner: dmem__get_disk */
    if (disk) dmem__disk_remove(disk, dmem__handle_of(b, w));
    dmem_atomic_sub_relaxed(&rt->disk_used, dmem__bsize(b));
  }
  if (state == DMEM_STATE_DEFERRED_CONTROLLER)
    dmem_atomic_sub_relaxed(&rt->controller_used, dmem__bsize(b));
  if (b->ready_event) {
    dmem__event_put(rt, b->ready_event);
    b->ready_event = NULL;
  }
  dmem_atomic_sub_relaxed(&rt->buffer_count, 1);
  dmem__table_give(rt->table, b);
}

/* ---- alloc / free / info ------------------------------------------------------- */

dmem_status_t dmem_alloc(dmem_runtime_t *rt, size_t size, unsigned flags, dmem_handle_t *h_out) {
  if (!rt || !h_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_alloc: NULL argument");
  if (size == 0) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_alloc: size 0");
  if (flags & ~(unsigned)DMEM_ALLOC_PINNED)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_alloc: unknown flags 0x%x", flags);
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  void *dev = NULL;
  st = dmem__device_obtain(rt, size, &dev);
  if (st != DMEM_OK) return st;
  uint32_t slot;
  dmem__buffer_t *b;
  st = dmem__table_take(rt->table, &slot, &b);
  if (st != DMEM_OK) {
    dmem__device_release(rt, dev, size);
    return st;
  }
  dmem_atomic_store_relaxed(&b->size, size);
  dmem_atomic_store_relaxed(&b->flags, flags);
  b->dev = dev;
  b->host = NULL;
  b->host_charged = false;
  b->ready_event = NULL;
  dmem_atomic_store_relaxed(&b->spill_event, NULL);
  dmem_atomic_store_relaxed(&b->priority, 0);
  dmem_atomic_store_relaxed(&b->spill_count, 0);
  dmem_atomic_add_relaxed(&rt->lru_epoch, 1); /* newer than every earlier unlock */
  dmem_atomic_store_relaxed(&b->last_use, dmem__lru_stamp(rt));
  if (flags & DMEM_ALLOC_PINNED) dmem_atomic_add_relaxed(&rt->device_pinned, size);
  dmem_atomic_add_relaxed(&rt->buffer_count, 1);
  uint64_t gen = dmem__w_gen(dmem_atomic_load_relaxed(&b->word));
  /* release: publishes the fields above; partner is the acquire load in
   * dmem_lock and every other handle-taking call */
  dmem_atomic_store_release(&b->word, (gen << DMEM__GEN_SHIFT) |
                                          ((uint64_t)DMEM_STATE_RESIDENT << DMEM__STATE_SHIFT));
  dmem_handle_t h = (gen << 32) | slot;
  dmem__emit(rt, DMEM_EVENT_ALLOC, h, size, DMEM_TIER_DEVICE, 0);
  *h_out = h;
  return DMEM_OK;
}

dmem_status_t dmem__stale(dmem_handle_t h) {
  return dmem__error(DMEM_ERR_STALE_HANDLE, "handle 0x%016llx is zero, freed or forged",
                     (unsigned long long)h);
}

static dmem_tier_t tier_of_state(unsigned s) {
  switch (s) {
    case DMEM_STATE_DEFERRED_HOST: return DMEM_TIER_HOST;
    case DMEM_STATE_DEFERRED_DISK: return DMEM_TIER_DISK;
    case DMEM_STATE_DEFERRED_CONTROLLER: return DMEM_TIER_CONTROLLER;
    default: return DMEM_TIER_DEVICE;
  }
}

dmem_status_t dmem_free(dmem_runtime_t *rt, dmem_handle_t h) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_free: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  /* acquire: partner is the release in dmem_alloc / dmem__transit_end */
  uint64_t w = dmem_atomic_load_acquire(&b->word), nw;
  do {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    nw = w | DMEM__F_FREED;
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  size_t size = dmem__bsize(b);
  dmem__emit(rt, DMEM_EVENT_FREE, h, size, tier_of_state(dmem__w_state(w)), 0);
  if (dmem__w_count(nw) == 0 && !(nw & DMEM__F_TRANSIT)) dmem__reclaim(rt, b, nw);
  return DMEM_OK;
}

dmem_status_t dmem_buffer_info(dmem_runtime_t *rt, dmem_handle_t h, dmem_buffer_info_t *info_out) {
  if (!rt || !info_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_buffer_info: NULL argument");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: dmem_alloc's release */
  if (!dmem__word_live(w, h)) return dmem__stale(h);
  dmem_buffer_info_t info;
  memset(&info, 0, sizeof info);
  info.size = dmem__bsize(b);
  info.state = (dmem_state_t)dmem__w_state(w);
  info.lock_count = dmem__w_count(w);
  info.pinned = (dmem__bflags(b) & DMEM_ALLOC_PINNED) != 0;
  info.priority = dmem_atomic_load_relaxed(&b->priority);
  info.spill_count = dmem_atomic_load_relaxed(&b->spill_count);
  /* re-check: the slot may have been recycled while we read */
  if (dmem_atomic_load_acquire(&b->word) >> DMEM__GEN_SHIFT != w >> DMEM__GEN_SHIFT) return dmem__stale(h);
  *info_out = info;
  return DMEM_OK;
}

dmem_status_t dmem_set_priority(dmem_runtime_t *rt, dmem_handle_t h, int priority) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_set_priority: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: dmem_alloc's release */
  if (!dmem__word_live(w, h)) return dmem__stale(h);
  dmem_atomic_store_relaxed(&b->priority, priority);
  return DMEM_OK;
}

/* ---- lock / unlock ------------------------------------------------------------- */

/* After a successful lock CAS: order `stream` after in-flight copies. */
static dmem_status_t order_after_copies(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw,
                                        void *stream) {
  if (nw & DMEM__F_READY) {
    dmem_status_t q = dmem__be(rt, rt->be->event_query(rt->be, b->ready_event));
    if (q == DMEM_ERR_BUSY)
      q = dmem__be(rt, rt->be->stream_wait_event(rt->be, stream, b->ready_event));
    if (q != DMEM_OK) return q;
  }
  if (nw & DMEM__F_COPYEV) {
    /* stable: this lock keeps a new spill from starting */
    void *ev = dmem_atomic_load_relaxed(&b->spill_event);
    dmem_status_t q = dmem__be(rt, rt->be->stream_wait_event(rt->be, stream, ev));
    if (q != DMEM_OK) return q;
  }
  return DMEM_OK;
}

static dmem_status_t lock_slow(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                               void *stream, void **dev_out) {
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  /* acquire: partner is the releasing CAS of the TRANSIT owner */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  for (;;) {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    unsigned s = dmem__w_state(w);
    if (s == DMEM_STATE_SPILLING && dmem__tl_transit == b)
      return dmem__error(DMEM_ERR_BUSY,
                         "handle 0x%016llx is being spilled by the calling thread's callback",
                         (unsigned long long)h);
    if (s == DMEM_STATE_RESIDENT || (s == DMEM_STATE_SPILLING && (w & DMEM__F_COPYEV))) {
      if (dmem__w_count(w) >= DMEM_LOCK_COUNT_MAX)
        return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "lock count of handle 0x%016llx at maximum",
                           (unsigned long long)h);
      /* A lock on a spilling buffer cancels the spill: the device copy is
       * intact; the spiller sees the state change and discards its copy. */
      uint64_t nw = dmem__w_with_state(w + 1, DMEM_STATE_RESIDENT);
      if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
      if (s == DMEM_STATE_SPILLING) dmem__transit_broadcast(rt);
      st = order_after_copies(rt, b, nw, stream);
      if (st != DMEM_OK) {
        (void)dmem__unlock_buffer(rt, b, h);
        return st;
      }
      *dev_out = b->dev;
      return DMEM_OK;
    }
    if ((w & DMEM__F_TRANSIT) || s == DMEM_STATE_UNSPILLING || s == DMEM_STATE_SPILLING) {
      if (dmem__tl_transit == b)
        return dmem__error(DMEM_ERR_BUSY,
                           "handle 0x%016llx is being moved by the calling thread's callback",
                           (unsigned long long)h);
      dmem__transit_wait(rt, b, w);
      w = dmem_atomic_load_acquire(&b->word); /* partner: dmem__transit_end */
      continue;
    }
    /* Deferred and nobody moving it: take TRANSIT and this lock at once. */
    uint64_t nw = dmem__w_with_state(w, DMEM_STATE_UNSPILLING) | DMEM__F_TRANSIT;
    nw += 1;
    if (!dmem_atomic_cas_acq_rel(&b->word, &w, nw)) continue;
    dmem__tl_transit = b;
    st = dmem__unspill_owned(rt, b, h, w, stream, true);
    if (st != DMEM_OK) return st;
    *dev_out = b->dev;
    return DMEM_OK;
  }
}

dmem_status_t dmem__lock(dmem_runtime_t *rt, dmem_handle_t h, void *stream, void **dev_out,
                         dmem__buffer_t **b_out) {
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  /* acquire: partner is the release in dmem_alloc / dmem__transit_end, which
   * published b->dev */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  const uint64_t slow_bits = DMEM__F_FREED | DMEM__F_READY | DMEM__F_COPYEV | DMEM__STATE_MASK;
  if (dmem__w_gen(w) == dmem__h_gen(h) && (w & slow_bits) == 0 &&
      dmem__w_count(w) < DMEM_LOCK_COUNT_MAX && !dmem_atomic_load_relaxed(&rt->fatal)) {
    if (dmem_atomic_cas_strong_acq_rel(&b->word, &w, w + 1)) {
      *dev_out = b->dev;
      if (b_out) *b_out = b;
      return DMEM_OK;
    }
  }
  dmem_status_t st = lock_slow(rt, b, h, stream, dev_out);
  if (st == DMEM_OK && b_out) *b_out = b;
  return st;
}

dmem_status_t dmem_lock(dmem_runtime_t *rt, dmem_handle_t h, dmem_stream_t stream,
                        void **dev_ptr_out) {
  if (!rt || !dev_ptr_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_lock: NULL argument");
  return dmem__lock(rt, h, stream, dev_ptr_out, NULL);
}

dmem_status_t dmem__unlock_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  /* acquire: partner is the lock's CAS */
  uint64_t w = dmem_atomic_load_acquire(&b->word), nw;
  do {
    if (dmem__w_gen(w) != dmem__h_gen(h) || dmem__w_state(w) == DMEM__STATE_FREE) return dmem__stale(h);
    if (dmem__w_count(w) == 0) {
      if (w & DMEM__F_FREED) return dmem__stale(h);
      return dmem__error(DMEM_ERR_NOT_LOCKED, "handle 0x%016llx is not locked",
                         (unsigned long long)h);
    }
    nw = w - 1;
    /* release: the caller's device work is done; partner is the spiller's
     * acquiring CAS */
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  if (dmem__w_count(nw) == 0) {
    dmem_atomic_store_relaxed(&b->last_use, dmem__lru_stamp(rt));
    if ((nw & DMEM__F_FREED) && !(nw & DMEM__F_TRANSIT)) dmem__reclaim(rt, b, nw);
  }
  return DMEM_OK;
}

dmem_status_t dmem_unlock(dmem_runtime_t *rt, dmem_handle_t h) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_unlock: rt is NULL");
  dmem__buffer_t *b = dmem__table_lookup(rt->table, h);
  if (!b) return dmem__stale(h);
  return dmem__unlock_buffer(rt, b, h);
}
