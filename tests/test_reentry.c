/* Controller callbacks that call back into dmem (include/dmem/controller.h,
 * "Callbacks that re-enter dmem"): a store or retrieve that touches its own
 * buffer gets DMEM_ERR_BUSY at once, also after other moves in the same
 * callback; an allocation that could only succeed by waiting for the
 * caller's own move fails at once; the controller cannot be removed or
 * replaced while it holds bytes or a store runs; a buffer freed during its
 * store is dropped by the controller after store() returns.
 *
 * A case that would hang on a broken runtime runs under a watchdog (see
 * run_bounded): it fails instead of blocking the suite. */
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define MiB ((size_t)1 << 20)

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- watchdog ------------------------------------------------------------------ */

typedef struct {
  void (*fn)(void *);
  void *arg;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
} bounded_t;

static void *bounded_main(void *p) {
  bounded_t *b = p;
  b->fn(b->arg);
  pthread_mutex_lock(&b->mu);
  b->done = 1;
  pthread_cond_signal(&b->cv);
  pthread_mutex_unlock(&b->mu);
  return NULL;
}

/* Run fn(arg) on a thread; if it has not returned after `seconds`, the case
 * fails and the process exits (a callback waiting for its own thread hangs
 * for ever: there is nothing to join). */
static void run_bounded(void (*fn)(void *), void *arg, int seconds, const char *what) {
  bounded_t b = {.fn = fn, .arg = arg, .mu = PTHREAD_MUTEX_INITIALIZER,
                 .cv = PTHREAD_COND_INITIALIZER};
  pthread_t t;
  if (pthread_create(&t, NULL, bounded_main, &b) != 0) abort();
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += seconds;
  pthread_mutex_lock(&b.mu);
  while (!b.done)
    if (pthread_cond_timedwait(&b.cv, &b.mu, &ts) != 0) break;
  int done = b.done;
  pthread_mutex_unlock(&b.mu);
  if (!done) {
    fprintf(stderr, "FAIL: %s did not return within %d s (a callback waits for its own thread)\n",
            what, seconds);
    fflush(stderr);
    _exit(1);
  }
  pthread_join(t, NULL);
}

/* ---- a controller whose callbacks re-enter dmem --------------------------------- */

enum { MAX_KEYS = 16 };

typedef struct ctl {
  dmem_runtime_t *rt;
  pthread_mutex_t mu;
  dmem_handle_t keys[MAX_KEYS];
  void *vals[MAX_KEYS];
  size_t nkv;
  /* what the callbacks do first */
  dmem_handle_t move_first;       /* spill this one to the host tier first */
  int self_ops;                   /* then lock / unspill / spill / read their own buffer */
  int free_self;                  /* store: free its own buffer (1: itself, 2: from
                                     another thread while it waits) */
  int remove_ctl;                 /* store: remove the controller (this thread, then another) */
  size_t alloc_in_store;          /* store: allocate (and free) this many bytes */
  dmem_handle_t lock_on_spill_event; /* on_event(SPILL of another): lock this one */
  /* what they saw */
  dmem_status_t move_st, lock_st, unspill_st, spill_st, read_st, free_st;
  dmem_status_t remove_st, remove_other_st, alloc_st, event_lock_st;
  double alloc_seconds;
  int in_store;       /* a store() is running */
  int free_events, free_events_in_store, event_locks;
  dmem_tier_t free_tier;
  int stores, retrieves;
} ctl_t;

static void drop_key(ctl_t *c, dmem_handle_t h) {
  for (size_t i = c->nkv; i-- > 0;) {
    if (c->keys[i] != h) continue;
    free(c->vals[i]);
    c->keys[i] = c->keys[--c->nkv];
    c->vals[i] = c->vals[c->nkv];
  }
}

static void own_ops(ctl_t *c, dmem_handle_t h) {
  void *p;
  c->lock_st = dmem_buffer_lock(c->rt, h, NULL, &p);
  if (c->lock_st == DMEM_OK) dmem_buffer_unlock(c->rt, h);
  c->unspill_st = dmem_buffer_unspill(c->rt, h, NULL);
  c->spill_st = dmem_buffer_spill(c->rt, h, DMEM_TIER_HOST);
  char byte;
  c->read_st = dmem_buffer_read(c->rt, h, 0, &byte, 1);
}

static void on_event(void *user, const dmem_event_t *ev) {
  ctl_t *c = user;
  if (ev->kind == DMEM_EVENT_FREE) {
    pthread_mutex_lock(&c->mu);
    c->free_events++;
    if (c->in_store) c->free_events_in_store++;
    c->free_tier = ev->tier;
    drop_key(c, ev->handle); /* a FREE event: drop what is stored for it */
    pthread_mutex_unlock(&c->mu);
  }
  if (ev->kind == DMEM_EVENT_SPILL && c->lock_on_spill_event &&
      ev->handle != c->lock_on_spill_event) {
    /* the buffer whose lock made room by spilling this one: it is being
     * moved by this very thread */
    void *p;
    c->event_lock_st = dmem_buffer_lock(c->rt, c->lock_on_spill_event, NULL, &p);
    if (c->event_lock_st == DMEM_OK) dmem_buffer_unlock(c->rt, c->lock_on_spill_event);
    c->event_locks++;
  }
}

static void *remove_thread(void *arg) {
  ctl_t *c = arg;
  c->remove_other_st = dmem_controller_set(c->rt, NULL);
  return NULL;
}

typedef struct {
  ctl_t *c;
  dmem_handle_t h;
} free_arg_t;

static void *free_thread(void *arg) {
  free_arg_t *a = arg;
  a->c->free_st = dmem_buffer_free(a->c->rt, a->h);
  return NULL;
}

static dmem_status_t store(void *user, dmem_handle_t h, const void *data, size_t size) {
  ctl_t *c = user;
  c->stores++;
  c->in_store = 1;
  if (c->move_first) c->move_st = dmem_buffer_spill(c->rt, c->move_first, DMEM_TIER_HOST);
  if (c->self_ops) own_ops(c, h);
  if (c->free_self == 1) c->free_st = dmem_buffer_free(c->rt, h);
  if (c->free_self == 2) {
    free_arg_t a = {c, h};
    pthread_t t;
    pthread_create(&t, NULL, free_thread, &a);
    pthread_join(t, NULL);
  }
  if (c->remove_ctl) {
    c->remove_st = dmem_controller_set(c->rt, NULL);
    pthread_t t;
    pthread_create(&t, NULL, remove_thread, c);
    pthread_join(t, NULL);
  }
  if (c->alloc_in_store) {
    dmem_handle_t x;
    double t0 = now_s();
    c->alloc_st = dmem_buffer_alloc(c->rt, c->alloc_in_store, 0, &x);
    c->alloc_seconds = now_s() - t0;
    if (c->alloc_st == DMEM_OK) dmem_buffer_free(c->rt, x);
  }
  void *copy = malloc(size);
  memcpy(copy, data, size);
  pthread_mutex_lock(&c->mu);
  drop_key(c, h); /* a later store replaces an earlier one */
  c->keys[c->nkv] = h;
  c->vals[c->nkv] = copy;
  c->nkv++;
  c->in_store = 0;
  pthread_mutex_unlock(&c->mu);
  return DMEM_OK;
}

static dmem_status_t retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  ctl_t *c = user;
  c->retrieves++;
  if (c->move_first) c->move_st = dmem_buffer_spill(c->rt, c->move_first, DMEM_TIER_HOST);
  if (c->self_ops) own_ops(c, h);
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < c->nkv; i++) {
    if (c->keys[i] == h) {
      memcpy(out, c->vals[i], size);
      drop_key(c, h);
      pthread_mutex_unlock(&c->mu);
      return DMEM_OK;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return DMEM_ERR_INVALID_ARGUMENT;
}

static dmem_handle_t victim_answer;

static dmem_status_t select_victims(void *user, size_t need, dmem_handle_t *v, size_t cap,
                                    size_t *n_out) {
  (void)user;
  (void)need;
  if (!victim_answer || cap < 1) {
    *n_out = DMEM_VICTIMS_DEFAULT;
    return DMEM_OK;
  }
  v[0] = victim_answer;
  *n_out = 1;
  return DMEM_OK;
}

static void ctl_init(ctl_t *c, dmem_runtime_t *rt, dmem_controller_t *dc) {
  memset(c, 0, sizeof *c);
  c->rt = rt;
  pthread_mutex_init(&c->mu, NULL);
  c->free_tier = (dmem_tier_t)-1;
  memset(dc, 0, sizeof *dc);
  dc->struct_size = sizeof *dc;
  dc->user = c;
  dc->on_event = on_event;
  dc->store = store;
  dc->retrieve = retrieve;
}

static void ctl_fini(ctl_t *c) {
  for (size_t i = 0; i < c->nkv; i++) free(c->vals[i]);
  pthread_mutex_destroy(&c->mu);
}

static void expect_own_ops_busy(ctl_t *c) {
  CHECK_STATUS(c->lock_st, DMEM_ERR_BUSY);
  CHECK_STATUS(c->unspill_st, DMEM_ERR_BUSY);
  CHECK_STATUS(c->spill_st, DMEM_ERR_BUSY);
  CHECK_STATUS(c->read_st, DMEM_ERR_BUSY);
}

typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h;
  dmem_tier_t tier;
  dmem_status_t st;
} spill_job_t;

static void spill_job(void *p) {
  spill_job_t *j = p;
  j->st = dmem_buffer_spill(j->rt, j->h, j->tier);
}

/* ---- store ----------------------------------------------------------------------- */

/* Bug: the thread-local "buffer this thread moves" was overwritten by the
 * nested spill of another buffer, so the store's lock of its own buffer
 * cancelled its own spill (DMEM_OK) instead of DMEM_ERR_BUSY. */
TEST_CASE(store_own_buffer_busy_after_other_move) {
  for (int from_host = 0; from_host < 2; from_host++) {
    dmem_runtime_t *rt = check_runtime(8 * MiB);
    ctl_t c;
    dmem_controller_t dc;
    ctl_init(&c, rt, &dc);
    REQUIRE_OK(dmem_controller_set(rt, &dc));
    dmem_handle_t h, other;
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &other));
    check_put(rt, h, MiB, 41);
    if (from_host) REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
    c.move_first = other;
    c.self_ops = 1;
    spill_job_t j = {rt, h, DMEM_TIER_CONTROLLER, DMEM_ERR_CONFIG};
    run_bounded(spill_job, &j, 30, "a spill whose store touches its own buffer");
    CHECK_OK(j.st);
    CHECK_OK(c.move_st);
    expect_own_ops_busy(&c);
    CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
    CHECK_EQ(state_of(rt, other), DMEM_STATE_DEFERRED_HOST);
    c.move_first = 0;
    c.self_ops = 0;
    CHECK_UEQ(check_bad_bytes(rt, h, MiB, 41), 0);
    CHECK_OK(dmem_buffer_free(rt, h));
    CHECK_OK(dmem_buffer_free(rt, other));
    dmem_runtime_destroy(rt);
    ctl_fini(&c);
  }
}

/* Bug: an allocation inside store waited the whole oom_wait_ms for the
 * spill of the store's own buffer (which cannot end before store returns),
 * then failed. */
TEST_CASE(store_alloc_needing_own_move_fails_at_once) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.spill_ahead = 0;
  cfg.device_limit = 2 * MiB;
  cfg.oom_wait_ms = 30000; /* the old wait: 30 s */
  dmem_runtime_t *rt = check_runtime_cfg(&cfg);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &h)); /* the whole limit */
  check_put(rt, h, 2 * MiB, 43);
  c.alloc_in_store = MiB; /* only h's spill, in this very store, would make room */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_STATUS(c.alloc_st, DMEM_ERR_OUT_OF_MEMORY);
  CHECK_TRUE(c.alloc_seconds < 10.0);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  c.alloc_in_store = 0;
  CHECK_UEQ(check_bad_bytes(rt, h, 2 * MiB, 43), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

/* An allocation inside store that can make room by evicting another buffer
 * still succeeds. */
TEST_CASE(store_alloc_evicting_others_succeeds) {
  dmem_runtime_t *rt = check_runtime(3 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h, other;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &h));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &other));
  check_put(rt, other, MiB, 44);
  c.alloc_in_store = MiB;
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_OK(c.alloc_st);
  CHECK_EQ(state_of(rt, other), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  c.alloc_in_store = 0;
  CHECK_UEQ(check_bad_bytes(rt, other, MiB, 44), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_buffer_free(rt, other));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

/* Bug: removing the controller while a store ran returned DMEM_OK; the
 * buffer then sat in a controller tier that no longer existed (its lock
 * failed with DMEM_ERR_CALLBACK: the bytes were lost). */
TEST_CASE(remove_controller_during_store_is_busy) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 45);
  c.remove_ctl = 1;
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_STATUS(c.remove_st, DMEM_ERR_BUSY);       /* from the store itself */
  CHECK_STATUS(c.remove_other_st, DMEM_ERR_BUSY); /* from another thread */
  c.remove_ctl = 0;
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 45), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_controller_set(rt, NULL)); /* holds nothing now */
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

/* Bug: a controller holding bytes could be replaced by another one with
 * store/retrieve, which was then asked for bytes it never stored. The same
 * controller (same user, store and retrieve) may be installed again, say
 * with another on_event. */
TEST_CASE(replace_controller_holding_bytes_is_busy) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  ctl_t c, d;
  dmem_controller_t dc, dd;
  ctl_init(&c, rt, &dc);
  ctl_init(&d, rt, &dd);
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 46);
  REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_STATUS(dmem_controller_set(rt, &dd), DMEM_ERR_BUSY); /* another user */
  dmem_controller_t same = dc;
  same.on_event = NULL;
  CHECK_OK(dmem_controller_set(rt, &same)); /* the same store, retrieve and user */
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 46), 0);
  CHECK_EQ(d.retrieves, 0);
  CHECK_OK(dmem_controller_set(rt, &dd)); /* holds nothing now */
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
  ctl_fini(&d);
}

/* Bug: a buffer freed while its store ran (by the store itself or by
 * another thread) sent its FREE event before store() returned (the
 * controller found nothing to drop) and none after, so the controller kept
 * the bytes for ever. Now the one FREE event comes after store() returns,
 * with the tier the bytes ended in. */
TEST_CASE(free_during_store_event_after_store) {
  for (int run = 0; run < 4; run++) {
    int from_host = run & 1;
    dmem_runtime_t *rt = check_runtime(8 * MiB);
    ctl_t c;
    dmem_controller_t dc;
    ctl_init(&c, rt, &dc);
    REQUIRE_OK(dmem_controller_set(rt, &dc));
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
    if (from_host) REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
    c.free_self = run < 2 ? 1 : 2; /* from the store, then from another thread */
    CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
    CHECK_OK(c.free_st);
    CHECK_EQ(c.free_events, 1);
    CHECK_EQ(c.free_events_in_store, 0);
    CHECK_EQ(c.free_tier, DMEM_TIER_CONTROLLER);
    CHECK_UEQ(c.nkv, 0); /* the controller dropped the bytes it stored */
    dmem_stats_t s;
    CHECK_OK(dmem_stats(rt, &s));
    CHECK_UEQ(s.buffer_count, 0);
    CHECK_UEQ(s.controller_used, 0);
    CHECK_UEQ(s.device_used, 0);
    CHECK_OK(dmem_controller_set(rt, NULL));
    dmem_runtime_destroy(rt);
    ctl_fini(&c);
  }
}

/* ---- retrieve -------------------------------------------------------------------- */

typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h;
  dmem_status_t st;
} lock_job_t;

static void lock_job(void *p) {
  lock_job_t *j = p;
  void *d;
  j->st = dmem_buffer_lock(j->rt, j->h, NULL, &d);
  if (j->st == DMEM_OK) dmem_buffer_unlock(j->rt, j->h);
}

/* Bug: a retrieve that moved another buffer and then locked its own waited
 * for itself for ever. */
TEST_CASE(retrieve_own_buffer_busy_after_other_move) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h, other;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &other));
  check_put(rt, h, MiB, 47);
  REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  c.move_first = other;
  c.self_ops = 1;
  lock_job_t j = {rt, h, DMEM_ERR_CONFIG};
  run_bounded(lock_job, &j, 30, "a lock whose retrieve locks its own buffer");
  CHECK_OK(j.st);
  CHECK_OK(c.move_st);
  expect_own_ops_busy(&c);
  c.move_first = 0;
  c.self_ops = 0;
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 47), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_buffer_free(rt, other));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

/* The same when dmem itself moved another buffer first: the lock of a
 * buffer in the controller tier needs room, and the victim the controller
 * names is spilled on the lock's thread before retrieve is called. */
TEST_CASE(retrieve_own_buffer_busy_after_eviction_under_it) {
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  dc.select_victims = select_victims;
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h, x, y;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 48);
  REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &x));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y)); /* the limit is full */
  victim_answer = x;
  c.self_ops = 1;
  lock_job_t j = {rt, h, DMEM_ERR_CONFIG};
  run_bounded(lock_job, &j, 30, "a lock whose retrieve locks its own buffer after an eviction");
  victim_answer = 0;
  CHECK_OK(j.st);
  expect_own_ops_busy(&c);
  c.self_ops = 0;
  CHECK_EQ(state_of(rt, x), DMEM_STATE_DEFERRED_HOST);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 48), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_buffer_free(rt, x));
  CHECK_OK(dmem_buffer_free(rt, y));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}

/* ---- on_event -------------------------------------------------------------------- */

/* Bug: an on_event callback that ran inside a lock's retrieve (the SPILL
 * event of the victim that made room) and locked the buffer being
 * retrieved waited for its own thread for ever. */
TEST_CASE(event_during_retrieve_locking_that_buffer_busy) {
  dmem_runtime_t *rt = check_runtime(2 * MiB);
  ctl_t c;
  dmem_controller_t dc;
  ctl_init(&c, rt, &dc);
  dc.select_victims = select_victims;
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h, x, y;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 49);
  REQUIRE_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &x));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &y));
  victim_answer = x;
  c.lock_on_spill_event = h;
  lock_job_t j = {rt, h, DMEM_ERR_CONFIG};
  run_bounded(lock_job, &j, 30, "an on_event that locks the buffer being retrieved");
  victim_answer = 0;
  c.lock_on_spill_event = 0;
  CHECK_OK(j.st);
  CHECK_EQ(c.event_locks, 1);
  CHECK_STATUS(c.event_lock_st, DMEM_ERR_BUSY);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 49), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_buffer_free(rt, x));
  CHECK_OK(dmem_buffer_free(rt, y));
  dmem_runtime_destroy(rt);
  ctl_fini(&c);
}
