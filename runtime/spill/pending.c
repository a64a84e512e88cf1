/*
 * spill/pending.c - stream releases waiting for their event
 * (dmem_stream_release): the buffers they hold unlock once the stream's work
 * has finished. Nothing waits for that in the background; the list is polled
 * (one relaxed load when it is empty) by every call that could otherwise see
 * a finished release's buffers still locked: dmem_stream_synchronize,
 * dmem_sync_and_unlock, dmem_buffer_spill, dmem_runtime_evict, dmem_buffer_info,
 * dmem_stats, dmem_buffer_free, the search for spill victims (spill/pressure.c),
 * dmem_runtime_poll, and at destroy.
 *
 * Grouped releases. Recording an event costs about as much as a kernel
 * launch (cudaEventRecord), so a library that releases its stream after
 * every launch paid nearly two launches a launch. On a stream dmem made
 * (dmem_stream_create; every stream of the host backend), which therefore
 * stays valid until dmem_stream_destroy, a release that comes within
 * DMEM__RELEASE_GAP_NS of the stream's last recorded release event records
 * nothing: its entries join the stream's open group, host-only, in O(1)
 * amortised. The group gets ONE event, recorded on the stream then (so
 * after every launch of the group: an event recorded later in stream order
 * covers the earlier work, never less), when
 *  - a release finds it holds DMEM__RELEASE_GROUP releases or is
 *    DMEM__RELEASE_AGE_NS old (or holds DMEM__RELEASE_MAX_ENTRIES locks);
 *  - anyone polls (the list above: each looks at every open group first,
 *    so a group never waits for more releases to come; a group whose
 *    stream is idle, backend stream_query, unlocks at once with no event);
 *  - the stream is destroyed (dmem__pending_stream_forget).
 * A synchronisation of the stream (dmem_stream_synchronize,
 * dmem_sync_and_unlock) takes the group before it begins and unlocks it
 * after, with no event. A release after a quiet spell (the first, or one
 * DMEM__RELEASE_GAP_NS after the last event) records at once, as every
 * release did before. What a release covers does not change: exactly the
 * launches registered when it began, unlocked only once their work (and
 * possibly some later work of the stream) has finished.
 *
 * Other streams (CUDA streams the caller made, the default stream under
 * CUDA) may be destroyed by their owner right after the release, so an
 * event is recorded there at once, as before.
 *
 * Everything here is under rt->pending_mu (rank pending), events included:
 * dmem__pending_stream_forget takes it too, so no event is recorded on a
 * stream after its destroy began.
 */
#include "spill/spill.h"

#define DMEM__RELEASE_MAX_ENTRIES 65536u /* a group of this many locks records */

/* npending is raised under pending_mu; lowered (release) by the unlocker. */
static void npending_done(dmem_runtime_t *rt) {
  /* only now: an allocation that reads npending 0 and fails must have
   * seen these buffers unlocked (partner: make_room's acquire loads) */
  dmem_atomic_add_relaxed(&rt->moves_done, 1);
  dmem_atomic_sub_acq_rel(&rt->npending, 1);
}

static void unlock_entries(dmem_runtime_t *rt, dmem__reg_entry_t *v, size_t n) {
  for (size_t i = 0; i < n; i++) (void)dmem__unlock_buffer(rt, v[i].b, v[i].h);
}

dmem_status_t dmem__pending_add(dmem_runtime_t *rt, void *event, dmem__reg_entry_t *v,
                                size_t n) {
  dmem__pending_t *p = malloc(sizeof *p);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "stream release node allocation failed");
  p->event = event;
  p->v = v;
  p->n = n;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  p->next = rt->pending;
  rt->pending = p;
  dmem_atomic_add_relaxed(&rt->npending, 1);
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  return DMEM_OK;
}

/* ---- the streams whose releases may be grouped ----------------------------------- */

/* Under pending_mu. */
static dmem__defer_t *defer_find(dmem_runtime_t *rt, void *stream) {
  for (size_t i = 0; i < rt->ndefer; i++)
    if (rt->defer[i].stream == stream) return &rt->defer[i];
  return NULL;
}

/* Under pending_mu; NULL when the list cannot grow. */
static dmem__defer_t *defer_add(dmem_runtime_t *rt, void *stream) {
  if (rt->ndefer == rt->capdefer) {
    size_t cap = rt->capdefer ? rt->capdefer * 2 : 8;
    dmem__defer_t *v = realloc(rt->defer, cap * sizeof *v);
    if (!v) return NULL;
    rt->defer = v;
    rt->capdefer = cap;
  }
  dmem__defer_t *d = &rt->defer[rt->ndefer++];
  memset(d, 0, sizeof *d);
  d->stream = stream;
  return d;
}

/* Under pending_mu: detach d's open group (the caller unlocks or restores
 * it; it stays counted in npending). */
static void group_detach(dmem_runtime_t *rt, dmem__defer_t *d, dmem__reg_entry_t **v_out,
                         size_t *n_out) {
  *v_out = d->v;
  *n_out = d->n;
  d->v = NULL;
  d->n = d->cap = 0;
  d->releases = 0;
  if (*n_out) dmem_atomic_sub_relaxed(&rt->ndeferred, 1);
}

/* Under pending_mu: one event on d's stream now for the whole open group,
 * which becomes an ordinary waiting release (its npending count moves with
 * it). On failure the group stays open. */
static dmem_status_t group_record(dmem_runtime_t *rt, dmem__defer_t *d, uint64_t now) {
  dmem__pending_t *p = malloc(sizeof *p);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "stream release node allocation failed");
  void *ev = NULL;
  dmem_status_t st = dmem__event_get(rt, &ev);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, d->stream));
  if (st != DMEM_OK) {
    if (ev) dmem__event_put(rt, ev);
    free(p);
    return st;
  }
  p->event = ev;
  group_detach(rt, d, &p->v, &p->n);
  p->next = rt->pending;
  rt->pending = p;
  d->last_record_ns = now;
  return DMEM_OK;
}

/* Under pending_mu: append v[0..n) to d's group, opening it if needed;
 * false when the group cannot grow. */
static bool group_append(dmem_runtime_t *rt, dmem__defer_t *d, const dmem__reg_entry_t *v,
                         size_t n, uint64_t now) {
  if (d->n + n > d->cap) {
    size_t cap = d->cap ? d->cap : 64;
    while (cap < d->n + n) cap *= 2;
    dmem__reg_entry_t *nv = realloc(d->v, cap * sizeof *nv);
    if (!nv) return false;
    d->v = nv;
    d->cap = cap;
  }
  if (d->n == 0) {
    d->first_ns = now;
    d->releases = 0;
    dmem_atomic_add_relaxed(&rt->ndeferred, 1);
    dmem_atomic_add_relaxed(&rt->npending, 1);
  }
  memcpy(d->v + d->n, v, n * sizeof *v);
  d->n += n;
  d->releases++;
  return true;
}

int dmem__pending_group(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *v,
                        size_t n) {
  uint64_t now = dmem__now_ns();
  int r = DMEM__GROUP_NO;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  dmem__defer_t *d = defer_find(rt, stream);
  /* the host backend's streams all come from dmem (stream.h) */
  if (!d && rt->be->kind == DMEM_BACKEND_HOST) d = defer_add(rt, stream);
  if (d && (d->n > 0 || now - d->last_record_ns < rt->release_gap_ns) &&
      group_append(rt, d, v, n, now)) {
    r = d->releases >= rt->release_group || now - d->first_ns >= rt->release_age_ns ||
                d->n >= DMEM__RELEASE_MAX_ENTRIES
            ? DMEM__GROUP_DUE
            : DMEM__GROUP_JOINED;
  } else if (d) {
    d->last_record_ns = now; /* the caller records now */
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  return r;
}

dmem_status_t dmem__pending_group_record(dmem_runtime_t *rt, void *stream, bool *recorded) {
  dmem_status_t st = DMEM_OK;
  *recorded = false;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  dmem__defer_t *d = defer_find(rt, stream);
  /* (a poll or synchronisation may have taken the group meanwhile) */
  if (d && d->n > 0) {
    st = group_record(rt, d, dmem__now_ns());
    *recorded = st == DMEM_OK;
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  return st;
}

dmem_status_t dmem__pending_release_now(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t *v,
                                        size_t n) {
  void *ev = NULL;
  dmem_status_t st = dmem__event_get(rt, &ev);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, stream));
  if (st == DMEM_OK) st = dmem__pending_add(rt, ev, v, n);
  if (st != DMEM_OK && ev) dmem__event_put(rt, ev);
  return st;
}

/* A group taken from its stream by a poll: its stream had run all its work
 * (`idle`), or it could not get its event and must not wait for one (the
 * context is lost, or the runtime is going). */
typedef struct lost_group {
  struct lost_group *next;
  void *stream;
  dmem__reg_entry_t *v;
  size_t n;
  bool idle;
} lost_group_t;

/* Unlock what `lost` holds: unless its stream was idle, after waiting for
 * it, unless the context is lost (then nothing will run). */
static size_t lost_unlock(dmem_runtime_t *rt, lost_group_t *lost) {
  size_t count = 0;
  while (lost) {
    lost_group_t *g = lost;
    lost = g->next;
    if (!g->idle && dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)
      (void)rt->be->stream_synchronize(rt->be, g->stream);
    unlock_entries(rt, g->v, g->n);
    free(g->v);
    free(g);
    npending_done(rt);
    count++;
  }
  return count;
}

/* Under pending_mu: every open group is done if its stream has run all its
 * work (then it goes to *lost, marked idle: its buffers unlock now, as a
 * release's whose event completed), else gets its event. A group whose
 * event cannot be recorded stays open (the next poll tries again), unless
 * the context is lost or `force` (destroy): then it goes to *lost too,
 * unlocked by the caller after the mutex (when not even that node can be
 * had, it stays open; dmem__pending_fini unlocks what is left). */
static void record_open_groups(dmem_runtime_t *rt, bool force, lost_group_t **lost) {
  if (dmem_atomic_load_relaxed(&rt->ndeferred) == 0) return;
  uint64_t now = dmem__now_ns();
  for (size_t i = 0; i < rt->ndefer; i++) {
    dmem__defer_t *d = &rt->defer[i];
    if (d->n == 0) continue;
    /* the group's launches were on the stream before its releases, which
     * came before this query: an idle stream has run them */
    dmem_status_t q = dmem__fatal_keep(rt, rt->be->stream_query(rt->be, d->stream));
    bool idle = q == DMEM_OK;
    if (!idle && q != DMEM_ERR_DEVICE_FATAL && group_record(rt, d, now) == DMEM_OK) continue;
    if (!idle && !force && dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE) continue;
    lost_group_t *g = malloc(sizeof *g);
    if (!g) continue;
    g->stream = d->stream;
    g->idle = idle;
    group_detach(rt, d, &g->v, &g->n);
    g->next = *lost;
    *lost = g;
  }
}

static size_t poll_events(dmem_runtime_t *rt, bool wait_all, bool record) {
  if (!wait_all && dmem_atomic_load_relaxed(&rt->npending) == 0) return 0;
  dmem__pending_t *done = NULL;
  lost_group_t *lost = NULL;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  if (record) record_open_groups(rt, wait_all, &lost);
  for (dmem__pending_t **pp = &rt->pending; *pp;) {
    dmem__pending_t *p = *pp;
    dmem_status_t q = wait_all ? rt->be->event_synchronize(rt->be, p->event)
                               : rt->be->event_query(rt->be, p->event);
    if (q == DMEM_ERR_BUSY) {
      pp = &p->next;
      continue;
    }
    /* complete, or failed (the context is gone: the work will never run) */
    (void)dmem__fatal_keep(rt, q);
    *pp = p->next;
    p->next = done;
    done = p;
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  size_t count = lost_unlock(rt, lost);
  while (done) {
    dmem__pending_t *p = done;
    done = p->next;
    unlock_entries(rt, p->v, p->n);
    dmem__event_put(rt, p->event);
    free(p->v);
    free(p);
    count++;
    npending_done(rt);
  }
  return count;
}

size_t dmem__pending_poll(dmem_runtime_t *rt, bool wait_all) {
  return poll_events(rt, wait_all, true);
}

size_t dmem__pending_poll_recorded(dmem_runtime_t *rt) { return poll_events(rt, false, false); }

void dmem__pending_take_stream(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t **v_out,
                               size_t *n_out) {
  *v_out = NULL;
  *n_out = 0;
  if (dmem_atomic_load_relaxed(&rt->ndeferred) == 0) return;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  dmem__defer_t *d = defer_find(rt, stream);
  if (d && d->n > 0) group_detach(rt, d, v_out, n_out); /* still counted in npending */
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
}

void dmem__pending_taken_done(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t *v, size_t n,
                              dmem_status_t sync_status) {
  if (n == 0) {
    free(v);
    return;
  }
  if (sync_status == DMEM_OK || sync_status == DMEM_ERR_DEVICE_FATAL) {
    /* the synchronisation covered the group's work (or nothing will run) */
    unlock_entries(rt, v, n);
    free(v);
    npending_done(rt);
    return;
  }
  /* The work may still run: back into the stream's group. */
  uint64_t now = dmem__now_ns();
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  dmem__defer_t *d = defer_find(rt, stream);
  if (!d) {
    /* dmem_stream_destroy forgot the stream meanwhile, after its work had
     * run (it waits for it): nothing of the group's can still run */
    dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
    unlock_entries(rt, v, n);
    free(v);
    npending_done(rt);
    return;
  }
  if (group_append(rt, d, v, n, now)) {
    /* group_append counted a newly opened group: this one was counted
     * already (and a merge into a group a release opened meanwhile joins
     * two counted groups into one) */
    dmem_atomic_sub_relaxed(&rt->npending, 1);
    dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
    free(v);
    return;
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  /* no memory to keep it waiting: wait for the stream here */
  (void)rt->be->stream_synchronize(rt->be, stream);
  unlock_entries(rt, v, n);
  free(v);
  npending_done(rt);
}

void dmem__pending_stream_add(dmem_runtime_t *rt, void *stream) {
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  if (!defer_find(rt, stream)) (void)defer_add(rt, stream);
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
}

void dmem__pending_stream_forget(dmem_runtime_t *rt, void *stream) {
  lost_group_t *lost = NULL, one = {NULL, stream, NULL, 0, false};
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  dmem__defer_t *d = defer_find(rt, stream);
  if (d) {
    if (d->n > 0 && group_record(rt, d, dmem__now_ns()) != DMEM_OK) {
      group_detach(rt, d, &one.v, &one.n);
      lost = &one;
    }
    free(d->v);
    *d = rt->defer[--rt->ndefer];
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  if (lost) {
    /* the stream is still there: its work done, the group unlocks */
    if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)
      (void)rt->be->stream_synchronize(rt->be, stream);
    unlock_entries(rt, one.v, one.n);
    free(one.v);
    npending_done(rt);
  }
}

void dmem__pending_fini(dmem_runtime_t *rt) {
  for (size_t i = 0; i < rt->ndefer; i++) {
    dmem__defer_t *d = &rt->defer[i];
    if (d->n > 0) { /* no event and no memory for a node: wait here */
      if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)
        (void)rt->be->stream_synchronize(rt->be, d->stream);
      unlock_entries(rt, d->v, d->n);
      dmem_atomic_sub_relaxed(&rt->ndeferred, 1);
      npending_done(rt);
    }
    free(d->v);
  }
  free(rt->defer);
  rt->defer = NULL;
  rt->ndefer = rt->capdefer = 0;
}
