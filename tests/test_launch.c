/* RMMEP-1 entry points: dmem_lock_and_launch, dmem_launch_async,
 * dmem_sync_and_unlock, dmem_stream_release; the per-stream registry;
 * all-or-nothing locking. */
#include <stdatomic.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include "check.h"
#include "api/api.h" /* rt->npending: what a call left unpolled */

#define MiB ((size_t)1 << 20)

typedef struct {
  int calls;
  size_t n;
  void *ptrs[8];
  dmem_stream_t stream;
  dmem_status_t ret;
  dmem_runtime_t *rt;
  dmem_handle_t probe; /* locked inside the launch fn (re-entrancy) */
  dmem_status_t probe_st;
} launch_rec_t;

static dmem_status_t record_fn(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  launch_rec_t *r = user;
  r->calls++;
  r->n = n;
  r->stream = s;
  for (size_t i = 0; i < n && i < 8; i++) r->ptrs[i] = ptrs[i];
  if (r->probe) {
    dmem_buffer_info_t info;
    r->probe_st = dmem_buffer_info(r->rt, r->probe, &info);
    if (r->probe_st == DMEM_OK && info.lock_count == 0) r->probe_st = DMEM_ERR_NOT_LOCKED;
  }
  return r->ret;
}

static unsigned lock_count(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return 999;
  return info.lock_count;
}

TEST_CASE(lock_and_launch_locks_calls_unlocks) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t hs[3];
  for (int i = 0; i < 3; i++) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &hs[i]));
  launch_rec_t r = {0};
  r.rt = rt;
  r.probe = hs[1];
  CHECK_OK(dmem_lock_and_launch(rt, hs, 3, record_fn, &r));
  CHECK_EQ(r.calls, 1);
  CHECK_UEQ(r.n, 3);
  CHECK_TRUE(r.stream == NULL);
  CHECK_OK(r.probe_st); /* locked during the call, and re-entrant */
  for (int i = 0; i < 3; i++) {
    void *p;
    CHECK_OK(dmem_buffer_lock(rt, hs[i], NULL, &p));
    CHECK_TRUE(p == r.ptrs[i]);
    CHECK_OK(dmem_buffer_unlock(rt, hs[i]));
    CHECK_EQ(lock_count(rt, hs[i]), 0);
  }
  /* the launch function's status is returned, and everything is unlocked */
  r.ret = DMEM_ERR_CALLBACK;
  r.probe = 0;
  CHECK_STATUS(dmem_lock_and_launch(rt, hs, 3, record_fn, &r), DMEM_ERR_CALLBACK);
  for (int i = 0; i < 3; i++) CHECK_EQ(lock_count(rt, hs[i]), 0);
  /* zero handles is allowed */
  r.ret = DMEM_OK;
  CHECK_OK(dmem_lock_and_launch(rt, NULL, 0, record_fn, &r));
  CHECK_STATUS(dmem_lock_and_launch(rt, NULL, 2, record_fn, &r), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_lock_and_launch(rt, hs, 1, NULL, &r), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_lock_and_launch(NULL, hs, 1, record_fn, &r), DMEM_ERR_INVALID_ARGUMENT);
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  dmem_runtime_destroy(rt);
}

TEST_CASE(all_or_nothing) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t hs[4];
  for (int i = 0; i < 3; i++) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &hs[i]));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &hs[3]));
  CHECK_OK(dmem_buffer_free(rt, hs[3])); /* last one is stale */
  launch_rec_t r = {0};
  CHECK_STATUS(dmem_lock_and_launch(rt, hs, 4, record_fn, &r), DMEM_ERR_STALE_HANDLE);
  CHECK_EQ(r.calls, 0); /* never called when locking fails */
  for (int i = 0; i < 3; i++) CHECK_EQ(lock_count(rt, hs[i]), 0);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  CHECK_STATUS(dmem_launch_async(rt, s, hs, 4, record_fn, &r), DMEM_ERR_STALE_HANDLE);
  CHECK_EQ(r.calls, 0);
  for (int i = 0; i < 3; i++) CHECK_EQ(lock_count(rt, hs[i]), 0);
  CHECK_OK(dmem_stream_destroy(rt, s)); /* nothing was registered */
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  dmem_runtime_destroy(rt);
}

/* A handle of a slot that was never handed out, with the generation the
 * slot will get (forged from the table's seed): the lock path finds such a
 * slot without looking at the table's high-water mark, by its word (FREE),
 * and must refuse it as stale everywhere, leaving nothing locked. */
TEST_CASE(never_handed_out_slot_is_stale) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t hs[2];
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &hs[0]));
  uint32_t slot = (uint32_t)(hs[0] & 0xFFFFFFFFu) + 100; /* in the same chunk */
  REQUIRE_TRUE((slot >> DMEM__CHUNK_BITS) == ((uint32_t)hs[0] >> DMEM__CHUNK_BITS));
  hs[1] = ((dmem_handle_t)dmem__table_first_gen(rt->table, slot) << 32) | slot;
  void *p = NULL;
  CHECK_STATUS(dmem_buffer_lock(rt, hs[1], NULL, &p), DMEM_ERR_STALE_HANDLE);
  launch_rec_t r = {0};
  CHECK_STATUS(dmem_lock_and_launch(rt, hs, 2, record_fn, &r), DMEM_ERR_STALE_HANDLE);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  CHECK_STATUS(dmem_launch_async(rt, s, hs, 2, record_fn, &r), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_launch_async(rt, s, hs + 1, 1, record_fn, &r), DMEM_ERR_STALE_HANDLE);
  CHECK_EQ(r.calls, 0);
  CHECK_EQ(lock_count(rt, hs[0]), 0);
  CHECK_OK(dmem_stream_destroy(rt, s)); /* nothing was registered */
  /* the slot, once handed out, takes that generation: the handle then names it */
  dmem_handle_t h = 0;
  for (uint32_t i = (uint32_t)(hs[0] & 0xFFFFFFFFu) + 1; i <= slot; i++)
    REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &h));
  CHECK_TRUE(h == hs[1]);
  CHECK_OK(dmem_buffer_lock(rt, hs[1], NULL, &p));
  CHECK_OK(dmem_buffer_unlock(rt, hs[1]));
  dmem_runtime_destroy(rt);
}

TEST_CASE(out_of_memory_with_everything_locked) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t hs[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &hs[i]));
  CHECK_OK(dmem_buffer_spill(rt, hs[3], DMEM_TIER_HOST));
  dmem_handle_t extra;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &extra));
  /* 4 resident; locking all of them plus the spilled one cannot fit */
  dmem_handle_t all[5] = {hs[0], hs[1], hs[2], extra, hs[3]};
  launch_rec_t r = {0};
  CHECK_STATUS(dmem_lock_and_launch(rt, all, 5, record_fn, &r), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_EQ(r.calls, 0);
  for (int i = 0; i < 5; i++) CHECK_EQ(lock_count(rt, all[i]), 0);
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, hs[3], &info));
  CHECK_EQ(info.state, DMEM_STATE_DEFERRED_HOST); /* bytes still safe on the host */
  /* with everything locked, alloc reports OOM too */
  void *p;
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_lock(rt, hs[i], NULL, &p));
  CHECK_OK(dmem_buffer_lock(rt, extra, NULL, &p));
  dmem_handle_t h;
  CHECK_STATUS(dmem_buffer_alloc(rt, MiB, 0, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "nothing") != NULL);
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_unlock(rt, hs[i]));
  CHECK_OK(dmem_buffer_unlock(rt, extra));
  CHECK_OK(dmem_lock_and_launch(rt, all + 2, 3, record_fn, &r)); /* fits after eviction */
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  CHECK_OK(dmem_buffer_free(rt, extra));
  dmem_runtime_destroy(rt);
}

TEST_CASE(launch_async_registry_and_sync_and_unlock) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_stream_t s1, s2;
  REQUIRE_OK(dmem_stream_create(rt, &s1));
  REQUIRE_OK(dmem_stream_create(rt, &s2));
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  launch_rec_t r = {0};
  CHECK_OK(dmem_launch_async(rt, s1, &a, 1, record_fn, &r));
  CHECK_TRUE(r.stream == s1);
  CHECK_OK(dmem_launch_async(rt, s1, &b, 1, record_fn, &r));
  CHECK_OK(dmem_launch_async(rt, s2, &a, 1, record_fn, &r));
  CHECK_EQ(lock_count(rt, a), 2);
  CHECK_EQ(lock_count(rt, b), 1);
  CHECK_STATUS(dmem_buffer_spill(rt, a, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  CHECK_STATUS(dmem_stream_destroy(rt, s1), DMEM_ERR_BUSY); /* still registered */
  CHECK_OK(dmem_sync_and_unlock(rt, s1));
  CHECK_EQ(lock_count(rt, a), 1); /* s2's lock remains */
  CHECK_EQ(lock_count(rt, b), 0);
  CHECK_OK(dmem_sync_and_unlock(rt, s1)); /* nothing registered: just sync */
  CHECK_OK(dmem_sync_and_unlock(rt, s2));
  CHECK_EQ(lock_count(rt, a), 0);
  /* a failing launch fn: status returned, buffers stay registered */
  r.ret = DMEM_ERR_CALLBACK;
  CHECK_STATUS(dmem_launch_async(rt, s1, &a, 1, record_fn, &r), DMEM_ERR_CALLBACK);
  CHECK_EQ(lock_count(rt, a), 1);
  CHECK_OK(dmem_sync_and_unlock(rt, s1));
  CHECK_EQ(lock_count(rt, a), 0);
  CHECK_STATUS(dmem_launch_async(rt, s1, NULL, 1, record_fn, &r), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_sync_and_unlock(NULL, s1), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_stream_destroy(rt, s1));
  CHECK_OK(dmem_stream_destroy(rt, s2));
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  dmem_runtime_destroy(rt);
}

/* A host function that blocks its stream until released. */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int open;
} gate_t;

static void gate_wait(void *arg) {
  gate_t *g = arg;
  pthread_mutex_lock(&g->mu);
  while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

static void gate_open(gate_t *g) {
  pthread_mutex_lock(&g->mu);
  g->open = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static void *gate_open_thread(void *g) {
  gate_open(g);
  return NULL;
}

static int gate_is_open(gate_t *g) {
  pthread_mutex_lock(&g->mu);
  int open = g->open;
  pthread_mutex_unlock(&g->mu);
  return open;
}

/* Opens the gate after 100 ms. */
static void *gate_open_later_thread(void *g) {
  struct timespec ts = {0, 100 * 1000 * 1000};
  nanosleep(&ts, NULL);
  gate_open(g);
  return NULL;
}

static dmem_status_t enqueue_gate(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)ptrs;
  (void)n;
  launch_rec_t *r = user;
  return dmem_stream_enqueue_host(r->rt, s, gate_wait, r->ptrs[7]);
}

TEST_CASE(stream_release_unlocks_when_work_completes) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  CHECK_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  CHECK_OK(dmem_stream_release(rt, s)); /* returns at once */
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_EQ(lock_count(rt, a), 1); /* the "kernel" is still running */
  size_t freed = 1;
  CHECK_OK(dmem_runtime_evict(rt, MiB, &freed));
  CHECK_UEQ(freed, 0); /* so it cannot be spilled */
  gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, s));
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_EQ(lock_count(rt, a), 0);
  CHECK_OK(dmem_stream_release(rt, s)); /* nothing registered */
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_buffer_free(rt, a));
  dmem_runtime_destroy(rt);
}

TEST_CASE(stream_release_found_by_allocation) {
  /* An allocation that needs room completes finished releases and then
   * spills what they unlocked. */
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &a));
  launch_rec_t r = {0};
  CHECK_OK(dmem_launch_async(rt, s, &a, 1, record_fn, &r));
  CHECK_OK(dmem_stream_release(rt, s));
  CHECK_OK(dmem_stream_synchronize(rt, s));
  CHECK_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &b)); /* needs a unlocked and spilled */
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, a, &info));
  CHECK_EQ(info.state, DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(info.lock_count, 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* ---- a finished stream release unlocks when anyone can tell ------------------ */

typedef enum { TELL_SYNC, TELL_SYNC_UNLOCK, TELL_SPILL, TELL_EVICT, TELL_INFO, TELL_STATS,
               TELL_FREE } tell_t;

static void set_flag(void *user) { atomic_store((atomic_int *)user, 1); }

/* Buffer a, launched on s behind a gate and released while the gate is shut
 * (so the release cannot have finished when dmem_stream_release polled). The
 * gate opens; once the stream has run past the release's event (a host
 * function queued behind it says so) the call under test alone must find
 * the release finished, with no dmem_runtime_poll in between. */
static void finished_release_seen_by(tell_t how) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_stream_t s, s2;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  REQUIRE_OK(dmem_stream_create(rt, &s2));
  dmem_handle_t a;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s));
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->npending), 1); /* still running */
  atomic_int ran = 0;
  REQUIRE_OK(dmem_stream_enqueue_host(rt, s, set_flag, &ran));
  gate_open(&g);
  while (!atomic_load(&ran)) usleep(100);
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->npending), 1); /* nobody looked yet */
  dmem_buffer_info_t info;
  dmem_stats_t st;
  size_t freed = 0;
  switch (how) {
    case TELL_SYNC: /* another stream's synchronisation is enough */
      CHECK_OK(dmem_stream_synchronize(rt, s2));
      CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
      break;
    case TELL_SYNC_UNLOCK:
      CHECK_OK(dmem_sync_and_unlock(rt, s2));
      CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
      break;
    case TELL_SPILL:
      CHECK_OK(dmem_buffer_spill(rt, a, DMEM_TIER_HOST)); /* not BUSY */
      break;
    case TELL_EVICT:
      CHECK_OK(dmem_runtime_evict(rt, MiB, &freed));
      CHECK_UEQ(freed, MiB);
      break;
    case TELL_INFO:
      CHECK_OK(dmem_buffer_info(rt, a, &info));
      CHECK_EQ(info.lock_count, 0);
      break;
    case TELL_STATS:
      CHECK_OK(dmem_stats(rt, &st));
      CHECK_UEQ(st.device_locked, 0);
      break;
    case TELL_FREE: /* reclaimed at once, not at some later poll */
      CHECK_OK(dmem_buffer_free(rt, a));
      CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
      CHECK_OK(dmem_stats(rt, &st));
      CHECK_UEQ(st.buffer_count, 0);
      break;
  }
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  if (how != TELL_FREE) {
    CHECK_EQ(lock_count(rt, a), 0);
    CHECK_OK(dmem_buffer_free(rt, a));
  }
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_stream_destroy(rt, s2));
  dmem_runtime_destroy(rt);
}

/* ---- releases in quick succession share one event (spill/pending.c) ---------- */

/* Rapid releases on one stream: grouped unless the machine stalls for
 * longer than the grouping window between them (then a few more events). */
static dmem_status_t noop_fn(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)user;
  (void)s;
  (void)ptrs;
  (void)n;
  return DMEM_OK;
}

/* A library that releases its stream after every launch: one event each
 * cost nearly a second launch a launch (bench_spill: 1.86x a bare launch on
 * an H100). Behind a closed gate, 32 further launch + release pairs within
 * microseconds: they wait as one or a few groups (npending counts the
 * releases not done), not 32 events; none unlocks before the gate opens,
 * even after a poll (which records the group's event); all do once the
 * stream has run. */
TEST_CASE(stream_release_after_each_launch_shares_events) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  enum { N = 32 };
  dmem_handle_t a, hs[N];
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 64 * 1024, 0, &hs[i]));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s));
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_launch_async(rt, s, &hs[i], 1, noop_fn, NULL));
    REQUIRE_OK(dmem_stream_release(rt, s));
  }
  size_t waiting = dmem_atomic_load_relaxed(&rt->npending);
  fprintf(stderr, "%d releases wait as %zu\n", N + 1, waiting);
  CHECK_TRUE(waiting >= 1);
  CHECK_TRUE(waiting <= 8);
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_EQ(lock_count(rt, a), 1);
  for (int i = 0; i < N; i++) CHECK_EQ(lock_count(rt, hs[i]), 1);
  size_t freed = 1;
  CHECK_OK(dmem_runtime_evict(rt, 64 * MiB, &freed));
  CHECK_UEQ(freed, 0); /* all locked until the work before their release ran */
  gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, s));
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  CHECK_EQ(lock_count(rt, a), 0);
  for (int i = 0; i < N; i++) CHECK_EQ(lock_count(rt, hs[i]), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* As finished_release_seen_by, with the gated launch's release in its
 * stream's open group (the window made wide: no stall can split it): the
 * call under test records nothing new but finds the stream idle, and
 * unlocks the group at once. */
static void finished_group_seen_by(tell_t how) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  rt->release_gap_ns = rt->release_age_ns = 3600ull * 1000000000u;
  dmem_stream_t s, s2;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  REQUIRE_OK(dmem_stream_create(rt, &s2));
  dmem_handle_t a, z;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &z));
  REQUIRE_OK(dmem_launch_async(rt, s, &z, 1, noop_fn, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s)); /* the stream's first: an event now */
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s)); /* joins the group */
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 1);
  atomic_int ran = 0;
  REQUIRE_OK(dmem_stream_enqueue_host(rt, s, set_flag, &ran));
  gate_open(&g);
  while (!atomic_load(&ran)) usleep(100);
  /* under CUDA the stream is idle a moment after its last host function
   * ran: wait for that (the backend's own look, not a dmem call) */
  while (rt->be->stream_query(rt->be, s) == DMEM_ERR_BUSY) usleep(100);
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 1); /* nobody looked yet */
  dmem_buffer_info_t info;
  dmem_stats_t st;
  size_t freed = 0;
  switch (how) {
    case TELL_SYNC:
      CHECK_OK(dmem_stream_synchronize(rt, s2));
      break;
    case TELL_SYNC_UNLOCK:
      CHECK_OK(dmem_sync_and_unlock(rt, s2));
      break;
    case TELL_SPILL:
      CHECK_OK(dmem_buffer_spill(rt, a, DMEM_TIER_HOST)); /* not BUSY */
      break;
    case TELL_EVICT:
      CHECK_OK(dmem_runtime_evict(rt, 2 * MiB, &freed));
      CHECK_UEQ(freed, 2 * MiB); /* a and z */
      break;
    case TELL_INFO:
      CHECK_OK(dmem_buffer_info(rt, a, &info));
      CHECK_EQ(info.lock_count, 0);
      break;
    case TELL_STATS:
      CHECK_OK(dmem_stats(rt, &st));
      CHECK_UEQ(st.device_locked, 0);
      break;
    case TELL_FREE:
      CHECK_OK(dmem_buffer_free(rt, a));
      CHECK_OK(dmem_stats(rt, &st));
      CHECK_UEQ(st.buffer_count, 1);
      break;
  }
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 0);
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  if (how != TELL_FREE) {
    CHECK_EQ(lock_count(rt, a), 0);
    CHECK_OK(dmem_buffer_free(rt, a));
  }
  CHECK_EQ(lock_count(rt, z), 0);
  CHECK_OK(dmem_buffer_free(rt, z));
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_stream_destroy(rt, s2));
  dmem_runtime_destroy(rt);
}

TEST_CASE(finished_group_seen_by_stream_synchronize) { finished_group_seen_by(TELL_SYNC); }
TEST_CASE(finished_group_seen_by_sync_and_unlock) { finished_group_seen_by(TELL_SYNC_UNLOCK); }
TEST_CASE(finished_group_seen_by_spill) { finished_group_seen_by(TELL_SPILL); }
TEST_CASE(finished_group_seen_by_evict) { finished_group_seen_by(TELL_EVICT); }
TEST_CASE(finished_group_seen_by_buffer_info) { finished_group_seen_by(TELL_INFO); }
TEST_CASE(finished_group_seen_by_stats) { finished_group_seen_by(TELL_STATS); }
TEST_CASE(finished_group_seen_by_free) { finished_group_seen_by(TELL_FREE); }

/* A group whose work is still running when someone looks gets its event
 * then (recorded after the whole group: never before its launches), and
 * unlocks once the stream has run it, found by a later look. A
 * synchronisation of the group's own stream unlocks it with no event. */
TEST_CASE(open_group_gets_event_when_polled) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  rt->release_gap_ns = rt->release_age_ns = 3600ull * 1000000000u;
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a, b, z;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &z));
  REQUIRE_OK(dmem_launch_async(rt, s, &z, 1, noop_fn, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s));
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 1);
  CHECK_OK(dmem_runtime_poll(rt)); /* the gate is shut: an event for the group */
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 0);
  CHECK_EQ(lock_count(rt, a), 1);
  gate_open(&g);
  int tries = 0;
  while (lock_count(rt, a) != 0 && tries++ < 10000) usleep(100); /* buffer_info looks */
  CHECK_EQ(lock_count(rt, a), 0);
  /* a new group (the last event was just recorded), synchronised */
  REQUIRE_OK(dmem_launch_async(rt, s, &b, 1, noop_fn, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s));
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 1);
  CHECK_OK(dmem_stream_synchronize(rt, s));
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 0);
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  CHECK_EQ(lock_count(rt, b), 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_buffer_free(rt, z));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* dmem_stream_destroy with a group still open: not BUSY (the launches were
 * released); the group gets its event before the stream goes, and unlocks
 * once the stream's work has run (the destroy waits for it). */
TEST_CASE(stream_destroy_with_open_group) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  rt->release_gap_ns = rt->release_age_ns = 3600ull * 1000000000u;
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a, z;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &z));
  REQUIRE_OK(dmem_launch_async(rt, s, &z, 1, noop_fn, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s));
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 1);
  pthread_t opener;
  pthread_create(&opener, NULL, gate_open_later_thread, &g);
  CHECK_OK(dmem_stream_destroy(rt, s)); /* waits for the gate */
  CHECK_TRUE(gate_is_open(&g));
  pthread_join(opener, NULL);
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 0);
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  CHECK_EQ(lock_count(rt, a), 0);
  CHECK_EQ(lock_count(rt, z), 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, z));
  dmem_runtime_destroy(rt);
}

/* An allocation that needs the memory of buffers in an open group whose
 * work has finished gets it (the pressure path looks at the groups). */
TEST_CASE(open_group_found_by_allocation) {
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  rt->release_gap_ns = rt->release_age_ns = 3600ull * 1000000000u;
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a, z, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &z));
  REQUIRE_OK(dmem_launch_async(rt, s, &z, 1, noop_fn, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s));
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, noop_fn, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s));
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 1);
  CHECK_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &b)); /* needs a and z spilled */
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, a, &info));
  CHECK_EQ(info.state, DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(info.lock_count, 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, z));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

TEST_CASE(finished_release_seen_by_stream_synchronize) { finished_release_seen_by(TELL_SYNC); }
TEST_CASE(finished_release_seen_by_sync_and_unlock) { finished_release_seen_by(TELL_SYNC_UNLOCK); }
TEST_CASE(finished_release_seen_by_spill) { finished_release_seen_by(TELL_SPILL); }
TEST_CASE(finished_release_seen_by_evict) { finished_release_seen_by(TELL_EVICT); }
TEST_CASE(finished_release_seen_by_buffer_info) { finished_release_seen_by(TELL_INFO); }
TEST_CASE(finished_release_seen_by_stats) { finished_release_seen_by(TELL_STATS); }
TEST_CASE(finished_release_seen_by_free) { finished_release_seen_by(TELL_FREE); }

/* A stream whose buffer a is locked by a launch behind a shut gate, and
 * released: in the stream's open group (group: the stream's first release,
 * of z's launch, recorded an event of its own and is done), or with an
 * event of its own. gated_end opens nothing: the caller opens t->g. */
typedef struct {
  dmem_runtime_t *rt;
  dmem_stream_t s;
  dmem_handle_t a, z;
  gate_t g;
  launch_rec_t r;
} gated_t;

static void gated_release(gated_t *t, bool group) {
  t->rt = check_runtime(4 * MiB);
  if (group) t->rt->release_gap_ns = t->rt->release_age_ns = 3600ull * 1000000000u;
  REQUIRE_OK(dmem_stream_create(t->rt, &t->s));
  REQUIRE_OK(dmem_buffer_alloc(t->rt, MiB, 0, &t->a));
  REQUIRE_OK(dmem_buffer_alloc(t->rt, MiB, 0, &t->z));
  if (group) {
    REQUIRE_OK(dmem_launch_async(t->rt, t->s, &t->z, 1, noop_fn, NULL));
    REQUIRE_OK(dmem_stream_release(t->rt, t->s));
  }
  pthread_mutex_init(&t->g.mu, NULL);
  pthread_cond_init(&t->g.cv, NULL);
  t->g.open = 0;
  memset(&t->r, 0, sizeof t->r);
  t->r.rt = t->rt;
  t->r.ptrs[7] = &t->g;
  REQUIRE_OK(dmem_launch_async(t->rt, t->s, &t->a, 1, enqueue_gate, &t->r));
  REQUIRE_OK(dmem_stream_release(t->rt, t->s));
}

/* Open the gate and wait until the stream has run everything (the
 * backend's own look, not a dmem call). */
static void gated_run(gated_t *t) {
  gate_open(&t->g);
  while (t->rt->be->stream_query(t->rt->be, t->s) == DMEM_ERR_BUSY) usleep(100);
}

static void gated_end(gated_t *t) {
  CHECK_OK(dmem_buffer_free(t->rt, t->z));
  CHECK_OK(dmem_stream_destroy(t->rt, t->s));
  dmem_runtime_destroy(t->rt);
}

/* Another thread's poll that has taken a finished release (from the list
 * of recorded events, or an idle stream's open group) has dropped its
 * locks by the time it lets go of the list or the record: the stream's
 * owner, synchronising meanwhile, finds nothing left to unlock and must
 * still see the buffer unlocked. Before, such a poll dropped the locks
 * after, with no lock held: python.threads once saw a lock count of 1
 * right after dmem_sync_and_unlock. The hook holds the other poll there
 * (the first poll that takes something: this test's other thread). */
typedef struct {
  gate_t gate;
  atomic_int held;
} poll_hold_t;

static void hold_first_poll(void *user) {
  poll_hold_t *h = user;
  int was = 0;
  if (atomic_compare_exchange_strong(&h->held, &was, 1)) gate_wait(&h->gate);
}

static void *poll_thread(void *rt) {
  (void)dmem_runtime_poll(rt);
  return NULL;
}

static void batch_held_by_another_poll(bool group, tell_t how) {
  gated_t t;
  gated_release(&t, group);
  dmem_runtime_t *rt = t.rt;
  REQUIRE_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), group ? 1 : 0);
  CHECK_EQ(lock_count(rt, t.a), 1);
  gated_run(&t);
  poll_hold_t h = {{PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0}, 0};
  dmem__pending_hook_set(hold_first_poll, &h);
  pthread_t th;
  REQUIRE_EQ(pthread_create(&th, NULL, poll_thread, rt), 0);
  while (!atomic_load(&h.held)) usleep(100);
  /* the other poll holds a's release, taken */
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 0);
  if (how == TELL_SYNC_UNLOCK)
    CHECK_OK(dmem_sync_and_unlock(rt, t.s));
  else
    CHECK_OK(dmem_stream_synchronize(rt, t.s));
  CHECK_EQ(lock_count(rt, t.a), 0);
  CHECK_OK(dmem_buffer_spill(rt, t.a, DMEM_TIER_HOST)); /* not BUSY */
  gate_open(&h.gate);
  pthread_join(th, NULL);
  dmem__pending_hook_set(NULL, NULL);
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  CHECK_OK(dmem_buffer_free(rt, t.a));
  gated_end(&t);
}

TEST_CASE(release_taken_by_another_poll_seen_by_sync_and_unlock) {
  batch_held_by_another_poll(false, TELL_SYNC_UNLOCK);
}
TEST_CASE(release_taken_by_another_poll_seen_by_stream_synchronize) {
  batch_held_by_another_poll(false, TELL_SYNC);
}
TEST_CASE(group_taken_by_another_poll_seen_by_sync_and_unlock) {
  batch_held_by_another_poll(true, TELL_SYNC_UNLOCK);
}
TEST_CASE(group_taken_by_another_poll_seen_by_stream_synchronize) {
  batch_held_by_another_poll(true, TELL_SYNC);
}

/* A buffer freed while a release still holds it is reclaimed by the poll
 * that finds the release finished (its lock dropped under the poll's lock,
 * the reclaim after it): from the list of recorded events, or from an
 * idle stream's open group. */
static void freed_while_released(bool group) {
  gated_t t;
  gated_release(&t, group);
  dmem_runtime_t *rt = t.rt;
  CHECK_OK(dmem_buffer_free(rt, t.a)); /* locked: reclaimed by the last unlock */
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.buffer_count, 2);
  gated_run(&t);
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.buffer_count, 1);
  CHECK_UEQ(st.device_used, MiB);
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  gated_end(&t);
}

TEST_CASE(release_of_freed_buffer_reclaims_it_when_polled) { freed_while_released(false); }
TEST_CASE(group_of_freed_buffer_reclaims_it_when_polled) { freed_while_released(true); }

TEST_CASE(allocation_waits_for_pending_release) {
  /* Memory is full of buffers locked by a running "kernel" whose stream was
   * released: the allocation waits for it rather than failing. The gate
   * opens 100 ms after the allocation starts, and the allocation must
   * return after it opened (it waited), not before. */
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &a));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  CHECK_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  CHECK_OK(dmem_stream_release(rt, s));
  pthread_t opener;
  pthread_create(&opener, NULL, gate_open_later_thread, &g);
  CHECK_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &b));
  CHECK_TRUE(gate_is_open(&g)); /* it returned only once the kernel was done */
  pthread_join(opener, NULL);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* dmem_config_t.oom_wait_ms: an allocation waiting on a stream release
 * succeeds as soon as the stream finishes (not at the end of the wait);
 * with nothing finishing it gives up after the wait; with 0 at once. */
static dmem_runtime_t *runtime_waiting(size_t limit, unsigned wait_ms) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST; /* cuda.launch.*: CUDA */
  cfg.device_limit = limit;
  cfg.oom_wait_ms = wait_ms;
  return check_runtime_cfg(&cfg);
}

static double secs(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void oom_wait_case(unsigned wait_ms, int open_after_ms, dmem_status_t want,
                          double min_s, double max_s) {
  dmem_runtime_t *rt = runtime_waiting(2 * MiB, wait_ms);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a, b = DMEM_HANDLE_NULL;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &a));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s));
  pthread_t opener;
  struct timespec ts = {open_after_ms / 1000, (long)(open_after_ms % 1000) * 1000000L};
  double t0 = secs();
  if (open_after_ms >= 0) {
    nanosleep(&ts, NULL);
    pthread_create(&opener, NULL, gate_open_thread, &g);
  }
  dmem_status_t st = dmem_buffer_alloc(rt, 2 * MiB, 0, &b);
  double dt = secs() - t0;
  CHECK_STATUS(st, want);
  fprintf(stderr, "oom_wait_ms %u, stream done after %d ms: %s after %.3f s\n", wait_ms,
          open_after_ms, dmem_status_name(st), dt);
  CHECK_TRUE(dt >= min_s);
  CHECK_TRUE(dt < max_s);
  if (open_after_ms >= 0) pthread_join(opener, NULL);
  else gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, s));
  if (st == DMEM_OK) CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* at least the 100 ms before the stream finishes (it waited), far less than
 * the 20 s of the wait */
TEST_CASE(oom_wait_ends_when_stream_finishes) { oom_wait_case(20000, 100, DMEM_OK, 0.095, 5.0); }
TEST_CASE(oom_wait_gives_up_after_its_time) {
  oom_wait_case(300, -1, DMEM_ERR_OUT_OF_MEMORY, 0.29, 5.0);
}
TEST_CASE(oom_wait_zero_does_not_wait) {
  oom_wait_case(0, -1, DMEM_ERR_OUT_OF_MEMORY, 0.0, 0.25);
}

/* The launch fn runs with no internal mutex held: it may alloc, free, spill,
 * launch nested work. */
static dmem_status_t reentrant_fn(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)ptrs;
  (void)n;
  launch_rec_t *r = user;
  dmem_handle_t h;
  dmem_status_t st = dmem_buffer_alloc(r->rt, MiB, 0, &h);
  if (st != DMEM_OK) return st;
  launch_rec_t inner = {0};
  st = dmem_launch_async(r->rt, s, &h, 1, record_fn, &inner);
  if (st != DMEM_OK) return st;
  st = dmem_buffer_spill(r->rt, h, DMEM_TIER_HOST);
  if (st != DMEM_ERR_BUSY) return DMEM_ERR_INVALID_ARGUMENT; /* locked by inner */
  st = dmem_buffer_free(r->rt, h); /* reclaimed at sync_and_unlock */
  if (st != DMEM_OK) return st;
  dmem_stats_t stats;
  return dmem_stats(r->rt, &stats);
}

TEST_CASE(launch_fn_may_reenter) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t a;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  launch_rec_t r = {0};
  r.rt = rt;
  CHECK_OK(dmem_launch_async(rt, s, &a, 1, reentrant_fn, &r));
  CHECK_OK(dmem_lock_and_launch(rt, &a, 1, reentrant_fn, &r));
  CHECK_OK(dmem_sync_and_unlock(rt, s));
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.buffer_count, 2); /* a, and the one freed inside lock_and_launch's fn (its
                                    inner lock is on the default stream's registry) */
  CHECK_OK(dmem_sync_and_unlock(rt, NULL));
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.buffer_count, 1);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

TEST_CASE(duplicate_handles_in_one_launch) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t a;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  dmem_handle_t hs[3] = {a, a, a};
  launch_rec_t r = {0};
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  CHECK_OK(dmem_launch_async(rt, s, hs, 3, record_fn, &r));
  CHECK_EQ(lock_count(rt, a), 3);
  CHECK_TRUE(r.ptrs[0] == r.ptrs[2]);
  CHECK_OK(dmem_sync_and_unlock(rt, s));
  CHECK_EQ(lock_count(rt, a), 0);
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_buffer_free(rt, a));
  dmem_runtime_destroy(rt);
}

TEST_CASE(many_handles_launch) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  enum { N = 100 }; /* more than the small-set fast path */
  dmem_handle_t hs[N];
  for (int i = 0; i < N; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &hs[i]));
  launch_rec_t r = {0};
  CHECK_OK(dmem_lock_and_launch(rt, hs, N, record_fn, &r));
  CHECK_UEQ(r.n, N);
  for (int i = 0; i < N; i++) CHECK_EQ(lock_count(rt, hs[i]), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, hs[i]));
  dmem_runtime_destroy(rt);
}

TEST_CASE(streams_and_copies) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_stream_t s;
  CHECK_STATUS(dmem_stream_create(rt, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stream_create(NULL, &s), DMEM_ERR_INVALID_ARGUMENT);
  REQUIRE_OK(dmem_stream_create(rt, &s));
  char a[64], b[64];
  memset(a, 7, sizeof a);
  memset(b, 0, sizeof b);
  CHECK_OK(dmem_stream_copy(rt, b, a, 0, s));
  CHECK_OK(dmem_stream_copy(rt, NULL, NULL, 0, s));
  CHECK_STATUS(dmem_stream_copy(rt, NULL, a, 8, s), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stream_copy(NULL, b, a, 8, s), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_stream_copy(rt, b, a, sizeof a, s));
  CHECK_OK(dmem_stream_synchronize(rt, s));
  CHECK_EQ(memcmp(a, b, sizeof a), 0);
  CHECK_STATUS(dmem_stream_enqueue_host(rt, s, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stream_destroy(rt, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_stream_synchronize(NULL, s), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* ---- releases on one stream from several threads (the stream's record) ------- */

enum { RT_THREADS = 2, RT_BUFS = 8, RT_ITERS = 400 };

typedef struct {
  dmem_runtime_t *rt;
  dmem_stream_t s;
  dmem_handle_t hs[RT_BUFS];
  int release_every; /* release after every n-th launch (1: each) */
  atomic_int *go;
  dmem_status_t st;
} rel_thread_t;

static void *release_thread(void *arg) {
  rel_thread_t *t = arg;
  while (!atomic_load(t->go)) sched_yield();
  for (int i = 0; i < RT_ITERS && t->st == DMEM_OK; i++) {
    t->st = dmem_launch_async(t->rt, t->s, &t->hs[i % RT_BUFS], 1, noop_fn, NULL);
    if (t->st == DMEM_OK && i % t->release_every == 0) t->st = dmem_stream_release(t->rt, t->s);
  }
  return NULL;
}

/* Two threads launch on and release one stream that a gated host function
 * blocks, while a third polls (which records the open group's event) and
 * reads lock counts: no release may unlock a buffer before the gate opens
 * (all of their work is behind it), and once the stream has run, every
 * lock is gone (a release never leaves one behind). `nstreams` streams
 * are made first, so that with more than the runtime's stream records the
 * stream under test has none (its registry is in the shared lists). */
static void shared_stream_releases(int nstreams, int release_every) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  rt->release_group = 16; /* several groups (and events) in the run */
  dmem_stream_t ss[48];
  REQUIRE_TRUE(nstreams >= 1 && nstreams <= 48);
  for (int i = 0; i < nstreams; i++) REQUIRE_OK(dmem_stream_create(rt, &ss[i]));
  dmem_stream_t s = ss[nstreams - 1];
  dmem_handle_t a;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  launch_rec_t r = {0};
  r.rt = rt;
  r.ptrs[7] = &g;
  REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, enqueue_gate, &r));
  REQUIRE_OK(dmem_stream_release(rt, s));
  atomic_int go = 0;
  rel_thread_t th[RT_THREADS];
  pthread_t tid[RT_THREADS];
  for (int k = 0; k < RT_THREADS; k++) {
    th[k] = (rel_thread_t){rt, s, {0}, release_every, &go, DMEM_OK};
    for (int i = 0; i < RT_BUFS; i++) REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &th[k].hs[i]));
    pthread_create(&tid[k], NULL, release_thread, &th[k]);
  }
  atomic_store(&go, 1);
  /* the poller: while the threads run, nothing of theirs may come unlocked */
  int early = 0;
  unsigned seen[RT_THREADS][RT_BUFS] = {{0}};
  for (int round = 0; round < 200; round++) {
    CHECK_OK(dmem_runtime_poll(rt));
    if (lock_count(rt, a) != 1) early++;
    /* a count never drops while the gate is shut: it only grows */
    for (int k = 0; k < RT_THREADS; k++) {
      unsigned c = lock_count(rt, th[k].hs[round % RT_BUFS]);
      if (c < seen[k][round % RT_BUFS] || c > RT_ITERS / RT_BUFS) early++;
      seen[k][round % RT_BUFS] = c;
    }
  }
  for (int k = 0; k < RT_THREADS; k++) {
    pthread_join(tid[k], NULL);
    CHECK_OK(th[k].st);
  }
  CHECK_EQ(early, 0);
  CHECK_OK(dmem_runtime_poll(rt));
  /* every launch so far is behind the gate: each lock still held */
  CHECK_EQ(lock_count(rt, a), 1);
  for (int k = 0; k < RT_THREADS; k++)
    for (int i = 0; i < RT_BUFS; i++) CHECK_EQ(lock_count(rt, th[k].hs[i]), RT_ITERS / RT_BUFS);
  size_t freed = 1;
  CHECK_OK(dmem_runtime_evict(rt, 64 * MiB, &freed));
  CHECK_UEQ(freed, 0);
  /* the launches not released yet (release_every > 1) go with the last release */
  CHECK_OK(dmem_stream_release(rt, s));
  gate_open(&g);
  CHECK_OK(dmem_stream_synchronize(rt, s));
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  CHECK_EQ(lock_count(rt, a), 0);
  for (int k = 0; k < RT_THREADS; k++)
    for (int i = 0; i < RT_BUFS; i++) {
      CHECK_EQ(lock_count(rt, th[k].hs[i]), 0);
      CHECK_OK(dmem_buffer_free(rt, th[k].hs[i]));
    }
  CHECK_OK(dmem_buffer_free(rt, a));
  for (int i = 0; i < nstreams; i++) CHECK_OK(dmem_stream_destroy(rt, ss[i]));
  dmem_runtime_destroy(rt);
}

TEST_CASE(two_threads_release_one_stream) { shared_stream_releases(1, 1); }
TEST_CASE(two_threads_release_one_stream_now_and_then) { shared_stream_releases(1, 3); }
/* more streams than the runtime has records (DMEM__SREG_SLOTS) */
TEST_CASE(two_threads_release_a_stream_without_record) {
  REQUIRE_TRUE(DMEM__SREG_SLOTS < 40);
  shared_stream_releases(40, 1);
}

/* A stream's record is given back at destroy and taken by the next stream:
 * what was registered or grouped on the old stream is not the new one's,
 * and a release on the new stream covers exactly its own launches. */
TEST_CASE(stream_record_reused_after_destroy) {
  dmem_runtime_t *rt = check_runtime(64 * MiB);
  rt->release_gap_ns = rt->release_age_ns = 3600ull * 1000000000u;
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &b));
  for (unsigned round = 0; round < 3 * DMEM__SREG_SLOTS; round++) {
    dmem_stream_t s;
    REQUIRE_OK(dmem_stream_create(rt, &s));
    REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, noop_fn, NULL));
    REQUIRE_OK(dmem_stream_release(rt, s)); /* an event at once (the stream's first) */
    REQUIRE_OK(dmem_launch_async(rt, s, &a, 1, noop_fn, NULL));
    REQUIRE_OK(dmem_stream_release(rt, s)); /* the open group */
    REQUIRE_OK(dmem_launch_async(rt, s, &b, 1, noop_fn, NULL)); /* registered */
    CHECK_EQ(dmem_stream_destroy(rt, s), DMEM_ERR_BUSY);
    REQUIRE_OK(dmem_sync_and_unlock(rt, s)); /* b, and the group with it */
    CHECK_EQ(lock_count(rt, b), 0);
    REQUIRE_OK(dmem_stream_destroy(rt, s)); /* records nothing: all done */
    CHECK_EQ(lock_count(rt, a), 0);
    CHECK_UEQ(dmem_atomic_load_relaxed(&rt->ndeferred), 0);
  }
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->npending), 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  dmem_runtime_destroy(rt);
}
