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
 * every launch paid nearly two launches a launch. A stream dmem made
 * (dmem_stream_create; the host backend's default stream), which therefore
 * stays valid until dmem_stream_destroy, has a record of its own
 * (rt->sreg, DMEM__SREG_SLOTS of them): its registered launches and its
 * open group in one array, v[0..g) the group, v[g..n) registered, under
 * the record's spin lock, found by a lock-free scan of the records' keys.
 * So a launch registers with one lock of the record and a store, and a
 * release that joins the group just moves g to n: no runtime-wide mutex,
 * no copy, no allocation, and a clock read only when a group opens (the
 * gap rule below) and every 8th release (its age). A release that opens a
 * group DMEM__RELEASE_GAP_NS or more after the stream's last release event
 * (a quiet spell: the first release, say) records an event at once, as
 * every release did before grouping. The group gets ONE event, recorded on
 * the stream then (so after every launch of the group: an event recorded
 * later in stream order covers the earlier work, never less), when
 *  - a release finds it holds DMEM__RELEASE_GROUP releases or is
 *    DMEM__RELEASE_AGE_NS old (looked at every 8th release), or holds
 *    DMEM__RELEASE_MAX_ENTRIES locks;
 *  - anyone polls (the list above: each looks at every open group first,
 *    so a group never waits for more releases to come; a group whose
 *    stream is idle, backend stream_query, unlocks at once with no event);
 *  - the stream is destroyed (dmem__pending_stream_forget).
 * A synchronisation of the stream (dmem_stream_synchronize,
 * dmem_sync_and_unlock) takes the group before it begins and unlocks it
 * after, with no event. What a release covers does not change: exactly the
 * launches registered when it began, unlocked only once their work (and
 * possibly some later work of the stream) has finished.
 *
 * Other streams (CUDA streams the caller made, the default stream under
 * CUDA, dmem's streams past the records) may be destroyed by their owner
 * right after the release (or have no record), so an event is recorded
 * there at once, and the release waits in rt->pending.
 *
 * Locks: a record's lock (rank stream) is taken alone or under reg.mu (a
 * claim); under it a group's event is recorded and queued under
 * pending_mu. Events of groups are recorded only under the record's lock,
 * which dmem__pending_stream_forget takes to give the record back before
 * the stream goes: no event is recorded on a destroyed stream. The waiting
 * releases (rt->pending) are under pending_mu.
 */
#include "spill/spill.h"
#include "base/hook.h"
#include <sched.h>
#include <string.h>


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

/* A poll's batch in two halves. First, under the lock through which the
 * batch left the list or record (pending_mu, a record's lock), one lock
 * of each entry is dropped: whoever takes that lock next sees the
 * buffers unlocked (dmem_sync_and_unlock, dmem_buffer_info: a poll that
 * finds the list empty because another thread's poll took the batch must
 * not return before the counts are down; the python.threads test once
 * saw a lock count of 1 right after dmem_sync_and_unlock). An entry whose
 * buffer was freed while locked keeps b, its h replaced by the word to
 * reclaim with; the others' b becomes NULL. Then, with no lock held
 * (a tier's drop may call the controller), the reclaims. */
static void unlock_counts(dmem_runtime_t *rt, dmem__reg_entry_t *v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint64_t w;
    (void)dmem__unlock_count(rt, v[i].b, v[i].h, &w);
    if (w)
      v[i].h = (dmem_handle_t)w;
    else
      v[i].b = NULL;
  }
}

/* The test hook and its user, read as one pair (base/hook.h): a poll that
 * read the hook just before a test removed it still calls it with its own
 * user. */
static dmem__hook_t pending_hook;

void dmem__pending_hook_set(dmem__pending_hook_fn fn, void *user) {
  dmem__hook_set(&pending_hook, (void (*)(void))fn, user);
}

static void reclaim_rest(dmem_runtime_t *rt, dmem__reg_entry_t *v, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (v[i].b) dmem__reclaim(rt, v[i].b, (uint64_t)v[i].h);
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

/* ---- the streams dmem made: their records (rt->sreg) ------------------------------ */

static inline void *key_stream(uintptr_t key) { return (void *)(key - 1); }

void dmem__sreg_spin(dmem__sreg_t *s) {
  /* acquire: what the last holder wrote before its release store */
  for (unsigned spins = 0; dmem_atomic_exchange_acq_rel(&s->lk, 1u) != 0;) {
    while (dmem_atomic_load_relaxed(&s->lk) != 0) {
      if (++spins > 64) sched_yield();
    }
  }
}

/* Under s's lock: an open group goes out of the record (it stays counted
 * in npending; the caller unlocks, records or restores it). */
static void group_out(dmem_runtime_t *rt, dmem__sreg_t *s) {
  s->releases = 0;
  dmem_atomic_sub_relaxed(&rt->ndeferred, 1);
}

/* Under s's lock: detach v[0..g), the open group (g > 0), as an array of its
 * own; false (nothing changed) when that needs memory and there is none.
 * The registered entries after it stay. */
static bool group_detach(dmem_runtime_t *rt, dmem__sreg_t *s, dmem__reg_entry_t **v_out,
                         size_t *n_out) {
  size_t g = s->g;
  if (g == s->n) { /* nothing registered after it: the array goes */
    *v_out = s->v;
    s->v = NULL;
    s->n = s->cap = 0;
  } else {
    dmem__reg_entry_t *gv = malloc(g * sizeof *gv);
    if (!gv) return false;
    memcpy(gv, s->v, g * sizeof *gv);
    memmove(s->v, s->v + g, (s->n - g) * sizeof *gv);
    s->n -= g;
    *v_out = gv;
  }
  *n_out = g;
  s->g = 0;
  group_out(rt, s);
  return true;
}

/* Under s's lock: one event on s's stream now for the whole open group
 * (g > 0), which becomes an ordinary waiting release (its npending count
 * moves with it). On failure the group stays open. */
static dmem_status_t group_record(dmem_runtime_t *rt, dmem__sreg_t *s, uint64_t now) {
  void *stream = key_stream(dmem_atomic_load_relaxed(&s->key));
  /* memory first: once the event is recorded nothing may fail. The group
   * gets an array of its own; the record keeps its array (and capacity)
   * for the next launches. */
  dmem__pending_t *p = malloc(sizeof *p);
  dmem__reg_entry_t *gv = malloc(s->g * sizeof *gv);
  if (!p || !gv) {
    free(p);
    free(gv);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "stream release node allocation failed");
  }
  void *ev = NULL;
  dmem_status_t st = dmem__event_get(rt, &ev);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, stream));
  if (st != DMEM_OK) {
    if (ev) dmem__event_put(rt, ev);
    free(p);
    free(gv);
    return st;
  }
  memcpy(gv, s->v, s->g * sizeof *gv);
  memmove(s->v, s->v + s->g, (s->n - s->g) * sizeof *gv);
  s->n -= s->g;
  p->event = ev;
  p->v = gv;
  p->n = s->g;
  s->g = 0;
  group_out(rt, s);
  s->last_record_ns = now;
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
  p->next = rt->pending;
  rt->pending = p;
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  return DMEM_OK;
}

bool dmem__sreg_grow(dmem__sreg_t *s, size_t more) {
  size_t cap = s->cap ? s->cap : 16;
  while (cap < s->n + more) cap *= 2;
  dmem__reg_entry_t *v = realloc(s->v, cap * sizeof *v);
  if (!v) return false;
  s->v = v;
  s->cap = cap;
  return true;
}

dmem_status_t dmem__pending_group(dmem_runtime_t *rt, dmem__sreg_t *s, bool *recorded) {
  *recorded = false;
  if (s->n == s->g) return DMEM_OK; /* nothing registered since the last release */
  bool opened = s->g == 0;
  uint64_t now = 0;
  bool alone = false; /* after a quiet spell: an event at once */
  if (opened) {
    now = dmem__now_ns();
    alone = now - s->last_record_ns >= rt->release_gap_ns;
    s->first_ns = now;
    s->releases = 0;
    dmem_atomic_add_relaxed(&rt->ndeferred, 1);
    dmem_atomic_add_relaxed(&rt->npending, 1);
  }
  size_t g0 = s->g;
  s->g = s->n;
  s->releases++;
  bool due = alone || s->releases >= rt->release_group || s->g >= DMEM__RELEASE_MAX_ENTRIES;
  if (!due && s->releases % DMEM__RELEASE_AGE_EVERY == 0) {
    now = dmem__now_ns();
    due = now - s->first_ns >= rt->release_age_ns;
  }
  if (!due) return DMEM_OK;
  if (!now) now = dmem__now_ns();
  dmem_status_t st = group_record(rt, s, now);
  if (st == DMEM_OK) {
    *recorded = true;
    return DMEM_OK;
  }
  if (alone) {
    /* this release's own event failed: its launches stay registered */
    s->g = g0;
    s->releases = 0;
    dmem_atomic_sub_relaxed(&rt->ndeferred, 1);
    dmem_atomic_sub_acq_rel(&rt->npending, 1);
  }
  return st; /* a group's event failed: it stays open, the next poll tries */
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
  bool idle; /* unlock_counts ran under the record's lock: reclaims are left */
} lost_group_t;

/* Unlock what `lost` holds: unless its stream was idle, after waiting for
 * it, unless the context is lost (then nothing will run). */
static size_t lost_unlock(dmem_runtime_t *rt, lost_group_t *lost) {
  size_t count = 0;
  while (lost) {
    lost_group_t *g = lost;
    lost = g->next;
    if (g->idle) {
      reclaim_rest(rt, g->v, g->n);
    } else {
      if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)
        (void)rt->be->stream_synchronize(rt->be, g->stream);
      unlock_entries(rt, g->v, g->n);
    }
    free(g->v);
    free(g);
    npending_done(rt);
    count++;
  }
  return count;
}

/* Every open group is done if its stream has run all its work (then it
 * goes to *lost, marked idle: its buffers unlock now, as a release's whose
 * event completed), else gets its event. A group whose event cannot be
 * recorded stays open (the next poll tries again), unless the context is
 * lost or `force` (destroy): then it goes to *lost too, unlocked by the
 * caller (when not even that node can be had, it stays open;
 * dmem__pending_fini unlocks what is left). Takes each record's lock in
 * turn, and pending_mu under it to queue an event. */
static void record_open_groups(dmem_runtime_t *rt, bool force, lost_group_t **lost) {
  if (dmem_atomic_load_relaxed(&rt->ndeferred) == 0) return;
  uint64_t now = dmem__now_ns();
  size_t ns = dmem_atomic_load_acquire(&rt->nsreg); /* partner: the claim's release */
  for (size_t i = 0; i < ns; i++) {
    dmem__sreg_t *s = &rt->sreg[i];
    if (dmem_atomic_load_relaxed(&s->key) == 0) continue;
    dmem__sreg_take(s);
    uintptr_t key = dmem_atomic_load_relaxed(&s->key);
    if (key == 0 || s->g == 0) {
      dmem__sreg_unlock(s);
      continue;
    }
    /* the group's launches were on the stream before its releases, which
     * came before this query: an idle stream has run them */
    dmem_status_t q = dmem__fatal_keep(rt, rt->be->stream_query(rt->be, key_stream(key)));
    bool idle = q == DMEM_OK;
    if ((!idle && q != DMEM_ERR_DEVICE_FATAL && group_record(rt, s, now) == DMEM_OK) ||
        (!idle && !force && dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)) {
      dmem__sreg_unlock(s);
      continue;
    }
    lost_group_t *g = malloc(sizeof *g);
    if (g && group_detach(rt, s, &g->v, &g->n)) {
      g->stream = key_stream(key);
      g->idle = idle;
      if (idle) unlock_counts(rt, g->v, g->n);
      g->next = *lost;
      *lost = g;
    } else {
      free(g);
    }
    dmem__sreg_unlock(s);
  }
}

static size_t poll_events(dmem_runtime_t *rt, bool wait_all, bool record) {
  if (!wait_all && dmem_atomic_load_relaxed(&rt->npending) == 0) return 0;
  dmem__pending_t *done = NULL;
  lost_group_t *lost = NULL;
  if (record) record_open_groups(rt, wait_all, &lost);
  dmem__mutex_lock(&rt->pending_mu, DMEM__RANK_PENDING);
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
    unlock_counts(rt, p->v, p->n);
  }
  dmem__mutex_unlock(&rt->pending_mu, DMEM__RANK_PENDING);
  if (done || lost) {
    const dmem__hook_pair_t *hook = dmem__hook_get(&pending_hook);
    if (__builtin_expect(hook != NULL, 0)) ((dmem__pending_hook_fn)hook->fn)(hook->user);
  }
  size_t count = lost_unlock(rt, lost);
  while (done) {
    dmem__pending_t *p = done;
    done = p->next;
    reclaim_rest(rt, p->v, p->n);
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

void dmem__pending_take_stream(dmem_runtime_t *rt, void *stream, bool with_registered,
                               dmem__reg_entry_t **v_out, size_t *g_out, size_t *n_out) {
  *v_out = NULL;
  *g_out = *n_out = 0;
  if (!with_registered && dmem_atomic_load_relaxed(&rt->ndeferred) == 0) return;
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (!s) return;
  if (with_registered) { /* everything: the group first, then the registered launches */
    if (s->n > 0) {
      *v_out = s->v;
      *g_out = s->g;
      *n_out = s->n;
      if (s->g > 0) group_out(rt, s); /* still counted in npending */
      s->v = NULL;
      s->g = s->n = s->cap = 0;
    }
  } else if (s->g > 0 && group_detach(rt, s, v_out, g_out)) { /* still counted in npending */
    *n_out = *g_out;
  }
  dmem__sreg_unlock(s);
}

void dmem__pending_taken_done(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t *v, size_t g,
                              dmem_status_t sync_status) {
  if (g == 0) return;
  if (sync_status == DMEM_OK || sync_status == DMEM_ERR_DEVICE_FATAL) {
    /* the synchronisation covered the group's work (or nothing will run) */
    unlock_entries(rt, v, g);
    npending_done(rt);
    return;
  }
  /* The work may still run: back into the stream's group, before what the
   * record holds now (the group's entries must stay a prefix). */
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (!s) {
    /* dmem_stream_destroy gave the record back meanwhile, after the
     * stream's work had run (it waits for it): nothing of the group's can
     * still run */
    unlock_entries(rt, v, g);
    npending_done(rt);
    return;
  }
  dmem__reg_entry_t *nv = malloc((g + s->n) * sizeof *nv);
  if (nv) {
    memcpy(nv, v, g * sizeof *nv);
    if (s->n) memcpy(nv + g, s->v, s->n * sizeof *nv);
    free(s->v);
    s->v = nv;
    s->cap = s->n = g + s->n;
    if (s->g > 0) {
      /* merged into a group a release opened meanwhile: two counted
       * groups become one */
      dmem_atomic_sub_relaxed(&rt->npending, 1);
    } else {
      s->first_ns = dmem__now_ns();
      dmem_atomic_add_relaxed(&rt->ndeferred, 1);
    }
    s->g += g;
    s->releases++;
    dmem__sreg_unlock(s);
    return;
  }
  dmem__sreg_unlock(s);
  /* no memory to keep it waiting: wait for the stream here */
  (void)rt->be->stream_synchronize(rt->be, stream);
  unlock_entries(rt, v, g);
  npending_done(rt);
}

bool dmem__pending_stream_add(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *carry,
                              size_t ncarry) {
  uintptr_t key = dmem__sreg_key(stream);
  size_t ns = dmem_atomic_load_relaxed(&rt->nsreg); /* written under reg.mu, held */
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (s) { /* a record kept for this address (a destroy that found launches registered) */
    bool ok = dmem__sreg_append(s, carry, ncarry);
    dmem__sreg_unlock(s);
    return ok;
  }
  for (size_t i = 0; i < DMEM__SREG_SLOTS; i++) {
    s = &rt->sreg[i];
    if (i < ns && dmem_atomic_load_relaxed(&s->key) != 0) continue;
    dmem__sreg_take(s);
    if (dmem_atomic_load_relaxed(&s->key) != 0) {
      dmem__sreg_unlock(s);
      continue;
    }
    s->g = s->n = 0;
    s->releases = 0;
    s->last_record_ns = 0;
    if (!dmem__sreg_append(s, carry, ncarry)) {
      dmem__sreg_unlock(s);
      return false;
    }
    dmem_atomic_store_release(&s->key, key); /* partner: dmem__sreg_lock's acquire */
    dmem__sreg_unlock(s);
    if (i >= ns) dmem_atomic_store_release(&rt->nsreg, i + 1); /* partner: the lookups */
    return true;
  }
  return false;
}

void dmem__pending_stream_forget(dmem_runtime_t *rt, void *stream) {
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (!s) return;
  dmem__reg_entry_t *lv = NULL;
  size_t ln = 0;
  if (s->g > 0 && group_record(rt, s, dmem__now_ns()) != DMEM_OK) {
    /* no event: everything the record holds goes (no memory needed), and
     * unlocks once the stream has run it (all of it was enqueued before
     * it was registered) */
    lv = s->v;
    ln = s->n;
    group_out(rt, s);
    s->v = NULL;
    s->g = s->n = s->cap = 0;
  }
  if (s->n == 0) { /* give the record back; else launches registered meanwhile keep it */
    free(s->v);
    s->v = NULL;
    s->cap = 0;
    dmem_atomic_store_release(&s->key, (uintptr_t)0);
  }
  dmem__sreg_unlock(s);
  if (lv) {
    /* the stream is still there: its work done, the group unlocks */
    if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)
      (void)rt->be->stream_synchronize(rt->be, stream);
    unlock_entries(rt, lv, ln);
    free(lv);
    npending_done(rt);
  }
}

void dmem__pending_fini(dmem_runtime_t *rt) {
  size_t ns = dmem_atomic_load_relaxed(&rt->nsreg);
  for (size_t i = 0; i < ns; i++) {
    dmem__sreg_t *s = &rt->sreg[i];
    if (s->g > 0) { /* no event and no memory for a node: wait here */
      uintptr_t key = dmem_atomic_load_relaxed(&s->key);
      if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__LIVE)
        (void)rt->be->stream_synchronize(rt->be, key_stream(key));
      unlock_entries(rt, s->v, s->g);
      dmem_atomic_sub_relaxed(&rt->ndeferred, 1);
      npending_done(rt);
    }
    /* launches still registered: as the registry's lists at destroy */
    unlock_entries(rt, s->v + s->g, s->n - s->g);
    free(s->v);
    s->v = NULL;
    s->g = s->n = s->cap = 0;
    dmem_atomic_store_relaxed(&s->key, (uintptr_t)0);
  }
}
