/*
 * runtime/api/launch.c - the RMMEP-1 entry points: dmem_lock_and_launch,
 * dmem_launch_async, dmem_sync_and_unlock, and dmem_stream_release.
 */
#include "api/api.h"
#include <stdlib.h>


#define SMALL_N 16

typedef struct lockset {
  void **ptrs;
  dmem__reg_entry_t *ents;
  void *ptrs_small[SMALL_N];
  dmem__reg_entry_t ents_small[SMALL_N];
} lockset_t;

static inline dmem_status_t lockset_init(lockset_t *ls, size_t n) {
  if (n <= SMALL_N) {
    ls->ptrs = ls->ptrs_small;
    ls->ents = ls->ents_small;
    return DMEM_OK;
  }
  ls->ptrs = malloc(n * sizeof *ls->ptrs);
  ls->ents = malloc(n * sizeof *ls->ents);
  if (!ls->ptrs || !ls->ents) {
    free(ls->ptrs);
    free(ls->ents);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "lock set of %zu handles", n);
  }
  return DMEM_OK;
}

static void lockset_fini(lockset_t *ls) {
  if (ls->ptrs != ls->ptrs_small) {
    free(ls->ptrs);
    free(ls->ents);
  }
}

/* The launch function runs on the caller's thread: make the runtime's device
 * current there (CUDA), so its kernels go to the buffers' device. */
static dmem_status_t enter_device(dmem_runtime_t *rt) {
  return dmem__fatal_keep(rt, rt->be->make_current(rt->be));
}

static void unlock_n(dmem_runtime_t *rt, const dmem__reg_entry_t *e, size_t n) {
  for (size_t i = 0; i < n; i++) (void)dmem__unlock_buffer(rt, e[i].b, e[i].h);
}

/* Unlock the entries of ls that pass 1 or 2 of lock_all locked. */
static void unlock_locked(dmem_runtime_t *rt, const lockset_t *ls, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (ls->ents[i].b) (void)dmem__unlock_buffer(rt, ls->ents[i].b, ls->ents[i].h);
}

/* All or nothing: on failure nothing stays locked. A bad handle anywhere
 * fails before anything is brought back: pass 1 locks the resident buffers
 * (the lock's fast path) and checks every other handle; pass 2 brings the
 * others back and locks them. lock_all runs pass 1 while every handle
 * takes the fast path (the common case, inline in the entry points); at
 * the first that does not, lock_rest goes on from there, out of the
 * launch's hot code: the CUDA driver's launch evicts that code between
 * launches, and every line of it costs a miss a launch. */
static __attribute__((noinline, cold)) dmem_status_t lock_rest(dmem_runtime_t *rt,
                                                               const dmem_handle_t *hs, size_t n,
                                                               void *stream, lockset_t *ls,
                                                               size_t i0) {
  size_t slow = 0;
  for (size_t i = i0; i < n; i++) {
    dmem__buffer_t *b = NULL;
    dmem_status_t st = dmem__lock_resident(rt, hs[i], &ls->ptrs[i], &b);
    ls->ents[i].h = hs[i];
    ls->ents[i].b = st == DMEM_OK ? b : NULL;
    if (st == DMEM_ERR_BUSY) {
      slow++;
    } else if (st != DMEM_OK) {
      unlock_locked(rt, ls, i);
      return st;
    }
  }
  for (size_t i = i0; slow > 0 && i < n; i++) {
    if (ls->ents[i].b) continue;
    dmem__buffer_t *b = NULL;
    dmem_status_t st = dmem__lock(rt, hs[i], stream, &ls->ptrs[i], &b);
    if (st != DMEM_OK) {
      unlock_locked(rt, ls, n);
      return st;
    }
    ls->ents[i].b = b;
    slow--;
  }
  return DMEM_OK;
}

static inline __attribute__((always_inline)) dmem_status_t lock_all(dmem_runtime_t *rt,
                                                                     const dmem_handle_t *hs,
                                                                     size_t n, void *stream,
                                                                     lockset_t *ls) {
  for (size_t i = 0; i < n; i++) {
    dmem__buffer_t *b;
    uint64_t w;
    if (__builtin_expect(!dmem__lock_fast(rt, hs[i], &ls->ptrs[i], &b, &w), 0))
      return lock_rest(rt, hs, n, stream, ls, i); /* entries [0, i) are locked */
    ls->ents[i].h = hs[i];
    ls->ents[i].b = b;
  }
  return DMEM_OK;
}

/* The entry points' argument errors (cold: out of their hot code). */
static __attribute__((noinline, cold)) dmem_status_t bad_arguments(const char *who, bool null,
                                                                   size_t n) {
  if (null) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%s: NULL argument", who);
  return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%s: n %zu is too large", who, n);
}

dmem_status_t dmem_lock_and_launch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                                   dmem_launch_fn fn, void *user) {
  if (__builtin_expect(!rt || !fn || (!hs && n > 0) || n > DMEM__HANDLES_MAX, 0))
    return bad_arguments("dmem_lock_and_launch", !rt || !fn || (!hs && n > 0), n);
  dmem_status_t st = dmem__check_live(rt); /* before fn can be called (n == 0) */
  if (st != DMEM_OK) return st;
  lockset_t ls; /* lockset_init sets what is read (no 400-byte clear a call) */
  st = lockset_init(&ls, n);
  if (st != DMEM_OK) return st;
  st = lock_all(rt, hs, n, NULL, &ls);
  if (st == DMEM_OK) {
    st = enter_device(rt);
    if (st != DMEM_OK) unlock_n(rt, ls.ents, n);
  }
  if (st != DMEM_OK) {
    lockset_fini(&ls);
    return st;
  }
  DMEM_SCHED_POINT(); /* callbacks: the schedule fuzzer may yield around them */
  dmem_status_t fst = fn(user, NULL, ls.ptrs, n);
  DMEM_SCHED_POINT();
  st = dmem__fatal_keep(rt, rt->be->stream_synchronize(rt->be, NULL));
  unlock_n(rt, ls.ents, n);
  lockset_fini(&ls);
  return st != DMEM_OK ? st : fst;
}

dmem_status_t dmem_launch_async(dmem_runtime_t *rt, dmem_stream_t stream, const dmem_handle_t *hs,
                                size_t n, dmem_launch_fn fn, void *user) {
  if (__builtin_expect(!rt || !fn || (!hs && n > 0) || n > DMEM__HANDLES_MAX, 0))
    return bad_arguments("dmem_launch_async", !rt || !fn || (!hs && n > 0), n);
  dmem_status_t st = dmem__check_live(rt); /* before fn can be called (n == 0) */
  if (st != DMEM_OK) return st;
  lockset_t ls; /* lockset_init sets what is read (no 400-byte clear a call) */
  st = lockset_init(&ls, n);
  if (st != DMEM_OK) return st;
  st = lock_all(rt, hs, n, stream, &ls);
  if (st == DMEM_OK) {
    st = enter_device(rt);
    if (st != DMEM_OK) unlock_n(rt, ls.ents, n);
  }
  if (st != DMEM_OK) {
    lockset_fini(&ls);
    return st;
  }
  /* The locks belong to this call until fn has enqueued its work: only then
   * do they go into the stream's registry, so that a sync or release of the
   * stream on another thread (or inside fn) cannot unlock them before the
   * work that uses them is on the stream (launch.h). */
  DMEM_SCHED_POINT();
  st = fn(user, stream, ls.ptrs, n);
  DMEM_SCHED_POINT();
  if (n > 0) {
    /* a stream dmem made: into its record here (the common case, inline);
     * else (or when its array cannot grow) the registry's way */
    dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
    bool done = s && dmem__sreg_append(s, ls.ents, n);
    if (s) dmem__sreg_unlock(s);
    if (!done) dmem__registry_commit(rt, stream, ls.ents, n);
  }
  lockset_fini(&ls);
  return st;
}

dmem_status_t dmem_sync_and_unlock(dmem_runtime_t *rt, dmem_stream_t stream) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_sync_and_unlock: rt is NULL");
  dmem_status_t st = dmem__check_forked(rt);
  if (st != DMEM_OK) return st;
  /* What is registered now is what this call covers: launches registered
   * later (their work may be enqueued after the synchronisation began) stay
   * for a later sync or release. */
  dmem__reg_entry_t *v, *w;
  size_t n, wg, wn;
  (void)dmem__registry_take(rt, stream, &v, &n);
  /* the stream's record (a stream dmem made): its registered launches, and
   * its releases that wait for an event, which this synchronisation covers
   * (spill/pending.c): w[0..wg) the group, w[wg..wn) registered */
  dmem__pending_take_stream(rt, stream, true, &w, &wg, &wn);
  st = dmem__fatal_keep(rt, rt->be->stream_synchronize(rt->be, stream));
  dmem__pending_taken_done(rt, stream, w, wg, st);
  dmem__pending_poll(rt, false); /* releases of this stream finished too */
  /* A lost context runs nothing more: the buffers are unlocked as after a
   * successful synchronisation (else the stream could never be destroyed).
   * Any other failure leaves them locked and registered: the work may still
   * run. */
  if (st != DMEM_OK && st != DMEM_ERR_DEVICE_FATAL) {
    if (n > 0) dmem__registry_commit(rt, stream, v, n);
    if (wn > wg) dmem__registry_commit(rt, stream, w + wg, wn - wg);
    free(v);
    free(w);
    return st;
  }
  unlock_n(rt, v, n);
  unlock_n(rt, w + wg, wn - wg);
  free(v);
  free(w);
  return st;
}

/* dmem_stream_release past its common case: s (locked) is the stream's
 * record, whose group this release opens or makes due, or NULL: the
 * stream has none (its list's launches get an event now). */
static __attribute__((noinline)) dmem_status_t release_rest(dmem_runtime_t *rt, void *stream,
                                                            dmem__sreg_t *s) {
  bool recorded = false;
  dmem_status_t st;
  if (s) {
    st = dmem__pending_group(rt, s, &recorded);
    dmem__sreg_unlock(s);
  } else {
    st = dmem__registry_release_list(rt, stream, &recorded);
  }
  /* Finished releases unlock when anyone looks (launch.h); this call looks
   * at the recorded events only when it recorded one itself, so that a
   * release that joined its stream's group stays O(1) and host-only, and
   * the list stays short for a caller that does nothing but release. */
  if (recorded) dmem__pending_poll_recorded(rt);
  return st;
}

dmem_status_t dmem_stream_release(dmem_runtime_t *rt, dmem_stream_t stream) {
  if (__builtin_expect(!rt, 0))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_release: rt is NULL");
  dmem_status_t st = dmem__check_live(rt);
  if (__builtin_expect(st != DMEM_OK, 0)) return st;
  /* A stream dmem made: the release joins its open group (spill/pending.c)
   * here, inline, in the common case (the launch path's lines and code
   * only); else release_rest. */
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (__builtin_expect(s && dmem__pending_join(rt, s), 1)) {
    dmem__sreg_unlock(s);
    return DMEM_OK;
  }
  return release_rest(rt, stream, s);
}
