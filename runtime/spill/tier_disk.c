/*
 * spill/tier_disk.c - the disk tier: each buffer in an extent of the
 * runtime's one unnamed spill file (spill/disk.c), made on first use.
 *
 * A write (store) is cancelled between chunks when its buffer no longer
 * needs it: a lock cancelled the spill (the buffer is RESIDENT again), a
 * locker waits for this push-down (b->io_cancel), the buffer was freed, or
 * the runtime is being destroyed. A failed write is DMEM_ERR_IO and leaves
 * the buffer where it was (the caller keeps its copy).
 *
 * A retrieve reads the extent straight through to the device, pipelined
 * (load_device): its chunks (DMEM__DISK_CHUNK, or smaller pieces of a
 * buffer of fewer chunks than readers: spill/disk.c) are read by the retrieving
 * thread and the I/O threads at once, each into a staging slot (pinned,
 * DMEM__DISK_CHUNK bytes from the pinned pool), and each chunk's
 * host->device copy is enqueued on the runtime's host->device stream as
 * soon as that chunk is in, with an event recorded after it; the slot is
 * taken again once that event is complete (the oldest copy first). So a
 * chunk's copy runs while later chunks are read, the retrieve returns
 * once its last copy is enqueued (the next buffer's reads overlap its
 * copies), no host memcpy is made, and the slots are reused rather than
 * fresh staging of the whole buffer faulted in per retrieve: the slots in
 * existence are at most DISK_SLOTS_MAX (the readers at once plus a few;
 * fewer under host_limit, stage_create),
 * kept until dmem__staging_poll gives the idle ones back to the pinned pool
 * (when it runs dry, and on dmem_stats / dmem_runtime_poll) or the runtime
 * is destroyed. A failed read stops the others at their next chunk and is
 * DMEM_ERR_IO; the extent is untouched (the copies already enqueued only
 * filled device memory that the retrieve gives back in stream order). A
 * slot the pool could only give as pageable memory (it was growing) serves
 * one chunk and is freed after its copy.
 *
 * `load` (the whole extent into pinned staging of the buffer's size at
 * b->host) is the fallback of a retrieve when the pinned pool cannot give
 * even one slot. A freed extent keeps its blocks until the disk is quiet
 * (spill/disk.c): the retrieve that freed it punches nothing.
 */
#include "spill/spill.h"
#include "spill/summary.h"
#include <stdlib.h>

/* ---- staging slots for reads ------------------------------------------------------- */

/* At most this many slots: each reader (the retrieving threads, the I/O
 * threads) holds one while it reads, and a few more let the copies out of
 * the latest chunks run while the next are read. */
#define DISK_SLOTS_MAX (2u * (DMEM__IO_THREADS + 1u))

typedef struct disk_slot {
  struct disk_slot *next;
  void *mem;     /* DMEM__DISK_CHUNK bytes from the pinned pool */
  void *event;   /* recorded after the copy out of mem */
  bool recorded; /* the copy out of mem may still run: wait for event first */
  bool pageable; /* the pool gave pageable memory: freed after one use */
} disk_slot_t;

struct dmem__disk_stage {
  pthread_mutex_t mu; /* not ranked: a leaf, held for a few instructions */
  pthread_cond_t cv;  /* a slot came back */
  disk_slot_t *head, *tail; /* free slots, oldest copy first (under mu) */
  unsigned nslots;          /* slots in existence, free or taken (under mu) */
  unsigned max;             /* most slots in existence (set at creation) */
};

bool dmem__disk_pipelined(const dmem_runtime_t *rt) {
  return !rt->host_limit ||
         rt->host_staging >= 2 * (size_t)DMEM__DISK_PIPE_MIN_SLOTS * DMEM__DISK_CHUNK;
}

/* At most DISK_SLOTS_MAX slots; under host_limit, at most half the pinned
 * bytes the pool keeps for staging past the host tier's cap: the slots
 * must not take the room that spills' staging needs (with a 64 MiB host
 * limit, 10 slots of 8 MiB beside a full host tier left no 4 MiB block for
 * a spill, and locks failed; such a pool does not pipeline at all,
 * dmem__disk_pipelined). */
static dmem_status_t stage_create(dmem_runtime_t *rt, struct dmem__disk_stage **out) {
  struct dmem__disk_stage *g = calloc(1, sizeof *g);
  if (!g) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "disk tier staging record");
  g->max = DISK_SLOTS_MAX;
  if (rt->host_limit) {
    size_t m = rt->host_staging / (2 * DMEM__DISK_CHUNK);
    if (m < 1) m = 1; /* never 0, though a pool this tight does not pipeline */
    if (m < g->max) g->max = (unsigned)m;
  }
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  *out = g;
  return DMEM_OK;
}

static void slot_destroy(dmem_runtime_t *rt, disk_slot_t *s) {
  if (s->recorded) (void)rt->be->event_synchronize(rt->be, s->event);
  dmem__hostpool_free(rt->hostpool, s->mem);
  if (s->event) dmem__event_put(rt, s->event);
  free(s);
}

void dmem__disk_stage_fini(dmem_runtime_t *rt) {
  struct dmem__disk_stage *g = rt->disk_stage;
  if (!g) return;
  for (disk_slot_t *s = g->head, *n; s; s = n) {
    n = s->next;
    slot_destroy(rt, s);
  }
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
  free(g);
  rt->disk_stage = NULL;
}

void dmem__disk_stage_trim(dmem_runtime_t *rt, bool wait) {
  /* acquire: partner is dmem__disk_get's release (publishes disk_stage) */
  if (!dmem_atomic_load_acquire(&rt->disk)) return;
  struct dmem__disk_stage *g = rt->disk_stage;
  pthread_mutex_lock(&g->mu);
  disk_slot_t *s = g->head;
  g->head = g->tail = NULL;
  pthread_mutex_unlock(&g->mu);
  disk_slot_t *keep = NULL, *keep_tail = NULL;
  unsigned gone = 0;
  for (disk_slot_t *n; s; s = n) {
    n = s->next;
    s->next = NULL;
    if (!wait && s->recorded && rt->be->event_query(rt->be, s->event) != DMEM_OK) {
      if (keep_tail) keep_tail->next = s; /* its copy still runs (or the query failed) */
      else keep = s;
      keep_tail = s;
      continue;
    }
    slot_destroy(rt, s);
    gone++;
  }
  pthread_mutex_lock(&g->mu);
  g->nslots -= gone;
  if (keep) { /* in front of any that came back meanwhile: older copies */
    keep_tail->next = g->head;
    if (!g->head) g->tail = keep_tail;
    g->head = keep;
  }
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static dmem_status_t slot_new(dmem_runtime_t *rt, disk_slot_t **out) {
  disk_slot_t *s = calloc(1, sizeof *s);
  if (!s) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "disk tier staging slot record");
  dmem_status_t st = dmem__hostpool_alloc(rt->hostpool, DMEM__DISK_CHUNK, &s->mem);
  if (st == DMEM_OK) st = dmem__event_get(rt, &s->event);
  if (st != DMEM_OK) {
    dmem__hostpool_free(rt->hostpool, s->mem);
    free(s);
    return st;
  }
  s->pageable = dmem__hostpool_pageable(s->mem);
  *out = s;
  return DMEM_OK;
}

/* One retrieve's reads: where the chunks go. */
typedef struct load_ctx {
  dmem_runtime_t *rt;
  char *dev;
  void *stream;
} load_ctx_t;

/* The sink's get: a free slot whose last copy is complete, a new one while
 * there are fewer than the stage's max (or the pool has no room for one and
 * another exists), else wait for one to come back. */
static dmem_status_t slot_get(void *arg, void **buf_out, void **token_out) {
  load_ctx_t *c = arg;
  dmem_runtime_t *rt = c->rt;
  struct dmem__disk_stage *g = rt->disk_stage;
  disk_slot_t *s = NULL;
  bool full = false; /* the pool could not give one more */
  for (;;) {
    pthread_mutex_lock(&g->mu);
    while (!g->head && (g->nslots >= g->max || (full && g->nslots > 0)))
      pthread_cond_wait(&g->cv, &g->mu);
    s = g->head;
    if (s) {
      g->head = s->next;
      if (!g->head) g->tail = NULL;
      s->next = NULL;
    } else {
      g->nslots++;
    }
    bool may_grow = !full && g->nslots < g->max;
    pthread_mutex_unlock(&g->mu);
    /* The oldest free slot's copy still running: rather than wait for it
     * (the copy would be serialised with this read), make another slot
     * while there may be more. */
    if (s && s->recorded && may_grow &&
        rt->be->event_query(rt->be, s->event) == DMEM_ERR_BUSY) {
      pthread_mutex_lock(&g->mu);
      s->next = g->head; /* back at the front: still the oldest copy */
      g->head = s;
      if (!g->tail) g->tail = s;
      g->nslots++;
      pthread_mutex_unlock(&g->mu);
      s = NULL;
    }
    if (s) break;
    dmem_status_t st = slot_new(rt, &s);
    if (st == DMEM_OK) break;
    pthread_mutex_lock(&g->mu);
    g->nslots--;
    bool others = g->nslots > 0;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    /* no room for another slot: wait for one of those in use */
    if (st != DMEM_ERR_HOST_OUT_OF_MEMORY || !others) return st;
    full = true;
  }
  if (s->recorded) {
    dmem_status_t st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, s->event));
    if (st != DMEM_OK) {
      pthread_mutex_lock(&g->mu); /* back at the front: still the oldest copy */
      s->next = g->head;
      g->head = s;
      if (!g->tail) g->tail = s;
      pthread_cond_broadcast(&g->cv);
      pthread_mutex_unlock(&g->mu);
      return st;
    }
    s->recorded = false;
  }
  *buf_out = s->mem;
  *token_out = s;
  return DMEM_OK;
}

/* The sink's put: enqueue the chunk's copy to the device and the slot's
 * event after it; the slot goes to the back of the free list. */
static dmem_status_t slot_put(void *arg, void *token, size_t at, size_t len, bool ok) {
  load_ctx_t *c = arg;
  dmem_runtime_t *rt = c->rt;
  struct dmem__disk_stage *g = rt->disk_stage;
  disk_slot_t *s = token;
  dmem_status_t st = DMEM_OK;
  if (ok) {
    st = dmem__copy_chunked(rt, c->dev + at, s->mem, len, c->stream);
    if (st == DMEM_OK) {
      st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, s->event, c->stream));
      if (st == DMEM_OK) s->recorded = true;
    }
    /* a copy enqueued with no event after it: wait for it here */
    if (st != DMEM_OK) (void)rt->be->stream_synchronize(rt->be, c->stream);
  }
  /* read before the slot is back on the list: from then on a trim may
   * destroy it (reading s->pageable after the unlock was a use after free
   * that TSan found: evict.unspill_racing_cancelled_spill) */
  const bool pageable = s->pageable;
  pthread_mutex_lock(&g->mu);
  if (pageable) {
    g->nslots--;
  } else {
    if (g->tail) g->tail->next = s;
    else g->head = s;
    g->tail = s;
  }
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  if (pageable) slot_destroy(rt, s); /* waits for its copy; never on the list */
  return st;
}

/* ---- the tier ------------------------------------------------------------------------ */

dmem_status_t dmem__disk_get(dmem_runtime_t *rt, dmem__disk_t **disk_out) {
  /* acquire: partner is the release store below */
  dmem__disk_t *d = dmem_atomic_load_acquire(&rt->disk);
  if (d) {
    *disk_out = d;
    return DMEM_OK;
  }
  dmem__mutex_lock(&rt->disk_mu, DMEM__RANK_DISK);
  d = dmem_atomic_load_relaxed(&rt->disk);
  dmem_status_t st = DMEM_OK;
  if (!d) {
    struct dmem__disk_stage *g = NULL;
    st = stage_create(rt, &g);
    if (st == DMEM_OK) st = dmem__disk_create(rt->spill_dir_copy, rt->io, &d);
    if (st == DMEM_OK) {
      rt->disk_stage = g;
      /* release: publishes the file and the slots (rt->disk_stage) */
      dmem_atomic_store_release(&rt->disk, d);
    } else if (g) {
      pthread_cond_destroy(&g->cv);
      pthread_mutex_destroy(&g->mu);
      free(g);
    }
  }
  dmem__mutex_unlock(&rt->disk_mu, DMEM__RANK_DISK);
  if (st == DMEM_OK) *disk_out = d;
  return st;
}

typedef struct store_ctx {
  dmem_runtime_t *rt;
  dmem__buffer_t *b;
  /* set when a lock is why the write stopped: by any of the threads taking
   * chunks (relaxed; read by the writer after they have finished) */
  _Atomic int by_lock;
} store_ctx_t;

static bool store_cancelled(void *arg) {
  store_ctx_t *c = arg;
  uint64_t w = dmem_atomic_load_relaxed(&c->b->word); /* a hint; the mover re-checks */
  unsigned s = dmem__w_state(w);
  /* neither spilling nor held by the tier it is written from: a lock
   * cancelled the spill */
  if (dmem_atomic_load_relaxed(&c->b->io_cancel) || s == DMEM_STATE_RESIDENT ||
      s == DMEM_STATE_UNSPILLING || s == DMEM__STATE_FREE) {
    dmem_atomic_store_relaxed(&c->by_lock, 1);
    return true;
  }
  return (w & DMEM__F_FREED) || dmem__io_stopping(c->rt->io);
}

static dmem_status_t disk_store(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                void *data) {
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  /* a request left from an earlier move is not for this one */
  dmem_atomic_store_relaxed(&b->io_cancel, 0);
  dmem__disk_t *disk;
  uint64_t off = 0;
  store_ctx_t ctx = {rt, b, 0};
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st == DMEM_OK) st = dmem__disk_alloc(disk, size, &off);
  if (st == DMEM_OK) {
    st = dmem__disk_write(disk, off, data, size, store_cancelled, &ctx);
    if (st != DMEM_OK) dmem__disk_free(disk, off, size);
  }
  if (st != DMEM_OK) {
    if (st == DMEM_ERR_IO) {
      dmem_atomic_add_relaxed(&rt->disk_write_failures, 1);
      /* a push-down has no caller to hand the status to */
      if (dmem__io_tl_background)
        DMEM_RT_LOG(rt, DMEM_LOG_WARN, "push-down of 0x%016llx failed, it stays in the host tier: %s",
                    (unsigned long long)h, dmem_last_error_detail());
    } else if (st == DMEM_ERR_BUSY && dmem_atomic_load_relaxed(&ctx.by_lock)) {
      dmem_atomic_add_relaxed(&rt->cancelled_spills, 1);
    }
    return st;
  }
  b->disk_off = off;
  dmem__peak_raise(&rt->disk_peak, dmem_atomic_add_relaxed(&rt->disk_used, size) + size);
  dmem_atomic_add_relaxed(&rt->disk_writes, 1);
  dmem_atomic_add_relaxed(&rt->disk_bytes_written, size);
  dmem_atomic_add_relaxed(&rt->ns_disk_writing, dmem__now_ns() - t0);
  if (dmem__io_tl_background) {
    dmem_atomic_add_relaxed(&rt->disk_pushdowns, 1);
    if (DMEM__TRACE_ON())
      dmem__trace_event(DMEM__TRACK_TIER, DMEM_TIER_DISK, "push-down", t0, dmem__now_ns() - t0,
                        size, 1, h);
    dmem__summary_note(rt);
  } else if (DMEM__TRACE_ON()) {
    dmem__trace_event(DMEM__TRACK_TIER, DMEM_TIER_DISK, "write to disk", t0,
                      dmem__now_ns() - t0, size, 1, h);
  }
  return DMEM_OK;
}

static dmem_status_t disk_load(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  dmem__disk_t *disk;
  void *stage = NULL;
  dmem_status_t st = dmem__disk_get(rt, &disk);
  /* at the pool's limit: pageable staging rather than a failed retrieve */
  if (st == DMEM_OK) st = dmem__hostpool_alloc_staging(rt->hostpool, size, &stage);
  if (st == DMEM_OK) st = dmem__disk_read(disk, b->disk_off, stage, size);
  if (st != DMEM_OK) {
    dmem__hostpool_free(rt->hostpool, stage);
    return st;
  }
  DMEM_ASSERT(b->host == NULL);
  b->host = stage;
  dmem_atomic_add_relaxed(&rt->disk_reads, 1);
  dmem_atomic_add_relaxed(&rt->disk_bytes_read, size);
  dmem_atomic_add_relaxed(&rt->ns_disk_reading, dmem__now_ns() - t0);
  return DMEM_OK;
}

/* The pipelined retrieve (see the top of this file). */
static dmem_status_t disk_load_device(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                      void *dev, void *stream) {
  (void)h;
  uint64_t t0 = dmem__now_ns();
  size_t size = dmem__bsize(b);
  dmem__disk_t *disk;
  /* dmem__disk_get's acquire also makes rt->disk_stage visible */
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st != DMEM_OK) return st;
  load_ctx_t c = {rt, dev, stream};
  const dmem__disk_sink_t sink = {slot_get, slot_put, &c};
  st = dmem__disk_read_chunks(disk, b->disk_off, size, &sink);
  if (st != DMEM_OK) return st;
  dmem_atomic_add_relaxed(&rt->disk_reads, 1);
  dmem_atomic_add_relaxed(&rt->disk_bytes_read, size);
  dmem_atomic_add_relaxed(&rt->ns_disk_reading, dmem__now_ns() - t0);
  return DMEM_OK;
}

/* Straight from the extent into dst (no staging): a failed read is
 * DMEM_ERR_IO and leaves the extent as it was. Not counted as a disk read
 * (those are retrieves). */
static dmem_status_t disk_read_range(dmem_runtime_t *rt, dmem__buffer_t *b, size_t off,
                                     void *dst, size_t n) {
  dmem__disk_t *disk;
  dmem_status_t st = dmem__disk_get(rt, &disk);
  if (st != DMEM_OK) return st;
  return dmem__disk_read(disk, b->disk_off + off, dst, n);
}

static void disk_drop(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h) {
  (void)h;
  /* acquire: partner is dmem__disk_get's release (the tier held this buffer,
   * so the file exists) */
  dmem__disk_free(dmem_atomic_load_acquire(&rt->disk), b->disk_off, dmem__bsize(b));
  dmem_atomic_sub_relaxed(&rt->disk_used, dmem__bsize(b));
}

static size_t disk_used(dmem_runtime_t *rt) { return dmem_atomic_load_relaxed(&rt->disk_used); }

const dmem__tier_ops_t dmem__tier_disk = {
    .tier = DMEM_TIER_DISK,
    .state = DMEM_STATE_DEFERRED_DISK,
    .name = "disk",
    .adopts_staging = false,
    .store = disk_store,
    .load = disk_load,
    .load_device = disk_load_device,
    .read = disk_read_range,
    .drop = disk_drop,
    .used = disk_used,
};
