/*
 * tests/test_backend_host.c - the host backend, driven directly through its
 * function table: simulated capacity, poison fill, FIFO streams, copies,
 * events (query, cross-stream waits, re-records), concurrency, bad handles,
 * teardown with queued work.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "backend/backend.h"
#include "check.h"

#define MiB ((size_t)1 << 20)

static dmem__backend_t *make_backend(size_t capacity) {
  dmem_config_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.struct_size = sizeof cfg;
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = capacity;
  dmem__backend_t *be = NULL;
  dmem_status_t st = dmem__backend_host_create(&cfg, &be);
  if (st != DMEM_OK || !be) {
    fprintf(stderr, "dmem__backend_host_create: %s (%s)\n", dmem_status_name(st),
            dmem_last_error_detail());
    exit(1);
  }
  return be;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

/* A gate: a host function that blocks its stream until the test opens it. */
typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int open;
  atomic_int entered;
} gate_t;

static void gate_init(gate_t *g) {
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->open = 0;
  atomic_init(&g->entered, 0);
}
static void gate_open(gate_t *g) {
  pthread_mutex_lock(&g->mu);
  g->open = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}
static void gate_fini(gate_t *g) {
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
}
static void gate_fn(void *arg) {
  gate_t *g = (gate_t *)arg;
  atomic_fetch_add(&g->entered, 1);
  pthread_mutex_lock(&g->mu);
  while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

/* atomic_load as a function, so that failed checks print readably. */
static int ld(atomic_int *p) { return atomic_load(p); }

static void incr_fn(void *arg) { atomic_fetch_add((atomic_int *)arg, 1); }

static void slow_incr_fn(void *arg) {
  sleep_ms(1);
  atomic_fetch_add((atomic_int *)arg, 1);
}

/* ---- memory ------------------------------------------------------------------ */

TEST_CASE(capacity_exhaustion) {
  dmem__backend_t *be = make_backend(1 * MiB);
  CHECK_STR(be->name, "host");
  CHECK_EQ(be->kind, DMEM_BACKEND_HOST);
  CHECK_UEQ(be->device_capacity, 1 * MiB);

  void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
  REQUIRE_OK(be->device_alloc(be, 512 * 1024, &a));
  REQUIRE_OK(be->device_alloc(be, 512 * 1024, &b));
  CHECK_TRUE(a && b && a != b);
  CHECK_UEQ((uintptr_t)a % 256, 0);
  CHECK_UEQ((uintptr_t)b % 256, 0);

  size_t free_b = 1, total = 0;
  CHECK_OK(be->mem_info(be, &free_b, &total));
  CHECK_UEQ(free_b, 0);
  CHECK_UEQ(total, 1 * MiB);

  c = (void *)0x1;
  CHECK_STATUS(be->device_alloc(be, 1, &c), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_TRUE(c == (void *)0x1); /* output untouched on failure */
  CHECK_TRUE(strlen(dmem_last_error_detail()) > 0);

  CHECK_OK(be->device_free(be, a));
  CHECK_OK(be->mem_info(be, &free_b, &total));
  CHECK_UEQ(free_b, 512 * 1024);
  CHECK_OK(be->device_alloc(be, 256 * 1024, &c));
  CHECK_OK(be->device_alloc(be, 256 * 1024, &d));
  CHECK_STATUS(be->device_alloc(be, 1, &a), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(be->device_alloc(be, 2 * MiB, &a), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(be->device_alloc(be, SIZE_MAX, &a), DMEM_ERR_OUT_OF_MEMORY);

  CHECK_OK(be->device_free(be, b));
  CHECK_OK(be->device_free(be, c));
  CHECK_OK(be->device_free(be, d));
  CHECK_OK(be->device_free(be, NULL));
  CHECK_OK(be->mem_info(be, &free_b, NULL));
  CHECK_UEQ(free_b, 1 * MiB);
  /* The whole capacity in one piece fits again. */
  CHECK_OK(be->device_alloc(be, 1 * MiB, &a));
  CHECK_OK(be->device_free(be, a));
  be->destroy(be);
}

TEST_CASE(default_capacity) {
  dmem__backend_t *be = make_backend(0);
  CHECK_UEQ(be->device_capacity, (size_t)1 << 30);
  size_t f = 0, t = 0;
  CHECK_OK(be->mem_info(be, &f, &t));
  CHECK_UEQ(f, (size_t)1 << 30);
  CHECK_UEQ(t, (size_t)1 << 30);
  be->destroy(be);
}

TEST_CASE(poison_fill) {
  dmem__backend_t *be = make_backend(16 * MiB);
  for (int round = 0; round < 3; round++) {
    unsigned char *p = NULL;
    REQUIRE_OK(be->device_alloc(be, 65536 + 3, (void **)&p));
    size_t bad = 0;
    for (size_t i = 0; i < 65536 + 3; i++) bad += p[i] != 0xDB;
    CHECK_UEQ(bad, 0);
    memset(p, 0, 65536 + 3); /* a reused block must be poisoned again */
    CHECK_OK(be->device_free(be, p));
  }
  void *h = NULL;
  REQUIRE_OK(be->host_alloc(be, 1000, &h));
  CHECK_UEQ((uintptr_t)h % 64, 0);
  memset(h, 1, 1000);
  CHECK_OK(be->host_free(be, h));
  CHECK_OK(be->host_free(be, NULL));
  be->destroy(be);
}

typedef struct alloc_race {
  dmem__backend_t *be;
  pthread_barrier_t start;
  atomic_int ok;
  atomic_int oom;
  atomic_int other;    /* statuses other than OK and OUT_OF_MEMORY */
  atomic_long live;    /* bytes held by the threads right now */
  atomic_long overrun; /* times `live` was seen above the capacity */
  void *ptrs[8][64];
} alloc_race_t;

typedef struct alloc_arg {
  alloc_race_t *r;
  int idx;
} alloc_arg_t;

/* Phase 1: churn (hold up to 4 blocks of 64 KiB, free, repeat). Phase 2: grab
 * 64 blocks each, keep them. */
static void *alloc_thread(void *arg) {
  alloc_arg_t *a = (alloc_arg_t *)arg;
  alloc_race_t *r = a->r;
  const long blk = 64 * 1024;
  pthread_barrier_wait(&r->start);
  for (int round = 0; round < 400; round++) {
    void *held[4] = {NULL, NULL, NULL, NULL};
    for (int k = 0; k < 4; k++) {
      dmem_status_t st = r->be->device_alloc(r->be, (size_t)blk, &held[k]);
      if (st == DMEM_OK) {
        if (atomic_fetch_add(&r->live, blk) + blk > (long)MiB) atomic_fetch_add(&r->overrun, 1);
      } else if (st != DMEM_ERR_OUT_OF_MEMORY) {
        atomic_fetch_add(&r->other, 1);
      }
    }
    for (int k = 0; k < 4; k++) {
      if (!held[k]) continue;
      atomic_fetch_sub(&r->live, blk);
      if (r->be->device_free(r->be, held[k]) != DMEM_OK) atomic_fetch_add(&r->other, 1);
    }
  }
  pthread_barrier_wait(&r->start);
  for (int i = 0; i < 64; i++) {
    void *p = NULL;
    dmem_status_t st = r->be->device_alloc(r->be, (size_t)blk, &p);
    if (st == DMEM_OK) {
      r->ptrs[a->idx][i] = p;
      atomic_fetch_add(&r->ok, 1);
    } else if (st == DMEM_ERR_OUT_OF_MEMORY) {
      atomic_fetch_add(&r->oom, 1);
    } else {
      atomic_fetch_add(&r->other, 1);
    }
  }
  return NULL;
}

/* 8 threads against a 1 MiB capacity: never more than 1 MiB handed out, the
 * count returns to zero, and of 8 x 64 blocks of 64 KiB exactly 16 fit. */
TEST_CASE(concurrent_alloc_respects_capacity) {
  static alloc_race_t r;
  memset(&r, 0, sizeof r);
  atomic_init(&r.ok, 0);
  atomic_init(&r.oom, 0);
  atomic_init(&r.other, 0);
  atomic_init(&r.live, 0);
  atomic_init(&r.overrun, 0);
  r.be = make_backend(1 * MiB);
  pthread_barrier_init(&r.start, NULL, 8);
  pthread_t t[8];
  alloc_arg_t args[8];
  for (int i = 0; i < 8; i++) {
    args[i].r = &r;
    args[i].idx = i;
    pthread_create(&t[i], NULL, alloc_thread, &args[i]);
  }
  for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
  pthread_barrier_destroy(&r.start);
  long overrun = atomic_load(&r.overrun);
  CHECK_EQ(overrun, 0);
  CHECK_EQ(ld(&r.other), 0);
  CHECK_EQ(ld(&r.ok), 16);
  CHECK_EQ(ld(&r.oom), 8 * 64 - 16);
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 64; j++) CHECK_OK(r.be->device_free(r.be, r.ptrs[i][j]));
  size_t f = 0;
  CHECK_OK(r.be->mem_info(r.be, &f, NULL));
  CHECK_UEQ(f, 1 * MiB);
  r.be->destroy(r.be);
}

/* ---- streams and copies -------------------------------------------------------- */

typedef struct fifo_log {
  int order[4096];
  int n; /* touched only by the stream's worker, read after synchronize */
} fifo_log_t;

typedef struct fifo_item {
  fifo_log_t *log;
  int value;
} fifo_item_t;

static void fifo_append(void *arg) {
  fifo_item_t *it = (fifo_item_t *)arg;
  it->log->order[it->log->n++] = it->value;
}

TEST_CASE(fifo_order_one_stream) {
  dmem__backend_t *be = make_backend(1 * MiB);
  static fifo_log_t log;
  static fifo_item_t items[4096];
  memset(&log, 0, sizeof log);
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  void *streams[2] = {NULL, s};
  for (int k = 0; k < 2; k++) {
    log.n = 0;
    gate_t g;
    gate_init(&g);
    /* Hold the stream so the whole queue builds up before anything runs. */
    REQUIRE_OK(be->launch_host_func(be, streams[k], gate_fn, &g));
    for (int i = 0; i < 4096; i++) {
      items[i].log = &log;
      items[i].value = i;
      REQUIRE_OK(be->launch_host_func(be, streams[k], fifo_append, &items[i]));
    }
    gate_open(&g);
    CHECK_OK(be->stream_synchronize(be, streams[k]));
    CHECK_EQ(log.n, 4096);
    int wrong = 0;
    for (int i = 0; i < log.n; i++) wrong += log.order[i] != i;
    CHECK_EQ(wrong, 0);
    gate_fini(&g);
  }
  CHECK_OK(be->stream_destroy(be, s));
  be->destroy(be);
}

static size_t count_nonzero(const void *p, size_t n) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) k += ((const unsigned char *)p)[i] != 0;
  return k;
}

TEST_CASE(copies_in_stream_order) {
  dmem__backend_t *be = make_backend(8 * MiB);
  const size_t n = 1 * MiB + 17;
  void *dev = NULL, *h1 = NULL, *h2 = NULL, *o1 = NULL, *o2 = NULL;
  REQUIRE_OK(be->device_alloc(be, n, &dev));
  REQUIRE_OK(be->host_alloc(be, n, &h1));
  REQUIRE_OK(be->host_alloc(be, n, &h2));
  REQUIRE_OK(be->host_alloc(be, n, &o1));
  REQUIRE_OK(be->host_alloc(be, n, &o2));
  check_fill(h1, n, 1);
  check_fill(h2, n, 2);
  memset(o1, 0, n);
  memset(o2, 0, n);
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  gate_t g;
  gate_init(&g);
  REQUIRE_OK(be->launch_host_func(be, s, gate_fn, &g));
  /* h1 -> dev -> o1, then h2 -> dev -> o2: only stream order keeps o1 == h1. */
  CHECK_OK(be->memcpy_async(be, dev, h1, n, s));
  CHECK_OK(be->memcpy_async(be, o1, dev, n, s));
  CHECK_OK(be->memcpy_async(be, dev, h2, n, s));
  CHECK_OK(be->memcpy_async(be, o2, dev, n, s));
  CHECK_OK(be->memcpy_async(be, NULL, NULL, 0, s)); /* n == 0: no-op */
  CHECK_STATUS(be->memcpy_async(be, NULL, h1, 1, s), DMEM_ERR_INVALID_ARGUMENT);
  sleep_ms(20);
  CHECK_UEQ(count_nonzero(o1, n), 0); /* nothing ran yet: still zeros */
  gate_open(&g);
  CHECK_OK(be->stream_synchronize(be, s));
  CHECK_UEQ(check_verify(o1, n, 1), 0);
  CHECK_UEQ(check_verify(o2, n, 2), 0);

  /* The default stream copies too. */
  memset(o1, 0, n);
  CHECK_OK(be->memcpy_async(be, o1, dev, n, NULL));
  CHECK_OK(be->stream_synchronize(be, NULL));
  CHECK_UEQ(check_verify(o1, n, 2), 0);

  gate_fini(&g);
  CHECK_OK(be->stream_destroy(be, s));
  CHECK_OK(be->device_free(be, dev));
  CHECK_OK(be->host_free(be, h1));
  CHECK_OK(be->host_free(be, h2));
  CHECK_OK(be->host_free(be, o1));
  CHECK_OK(be->host_free(be, o2));
  be->destroy(be);
}

TEST_CASE(stream_synchronize_waits) {
  dmem__backend_t *be = make_backend(1 * MiB);
  atomic_int count;
  atomic_init(&count, 0);
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  for (int i = 0; i < 50; i++) REQUIRE_OK(be->launch_host_func(be, s, slow_incr_fn, &count));
  CHECK_OK(be->stream_synchronize(be, s));
  CHECK_EQ(ld(&count), 50);
  CHECK_OK(be->stream_synchronize(be, s)); /* empty stream */
  CHECK_STATUS(be->launch_host_func(be, s, NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(be->stream_destroy(be, s));
  be->destroy(be);
}

TEST_CASE(stream_destroy_drains) {
  dmem__backend_t *be = make_backend(1 * MiB);
  atomic_int count;
  atomic_init(&count, 0);
  void *s = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  for (int i = 0; i < 50; i++) REQUIRE_OK(be->launch_host_func(be, s, slow_incr_fn, &count));
  CHECK_OK(be->stream_destroy(be, s));
  CHECK_EQ(ld(&count), 50);
  CHECK_STATUS(be->stream_destroy(be, NULL), DMEM_ERR_INVALID_ARGUMENT);
  be->destroy(be);
}

/* ---- events ---------------------------------------------------------------------- */

TEST_CASE(event_query_before_after) {
  dmem__backend_t *be = make_backend(1 * MiB);
  void *e = NULL, *s = NULL;
  REQUIRE_OK(be->event_create(be, &e));
  REQUIRE_OK(be->stream_create(be, &s));
  CHECK_OK(be->event_query(be, e)); /* never recorded: complete */
  CHECK_OK(be->event_synchronize(be, e));

  gate_t g;
  gate_init(&g);
  REQUIRE_OK(be->launch_host_func(be, s, gate_fn, &g));
  REQUIRE_OK(be->event_record(be, e, s));
  CHECK_STATUS(be->event_query(be, e), DMEM_ERR_BUSY);
  sleep_ms(20);
  CHECK_STATUS(be->event_query(be, e), DMEM_ERR_BUSY);
  gate_open(&g);
  CHECK_OK(be->event_synchronize(be, e));
  CHECK_OK(be->event_query(be, e));

  /* Recorded on the default stream behind nothing: completes on its own. */
  REQUIRE_OK(be->event_record(be, e, NULL));
  CHECK_OK(be->stream_synchronize(be, NULL));
  CHECK_OK(be->event_query(be, e));

  gate_fini(&g);
  CHECK_OK(be->event_destroy(be, e));
  CHECK_OK(be->stream_destroy(be, s));
  be->destroy(be);
}

typedef struct cross {
  atomic_int a_done;   /* set by A's host function */
  atomic_int observed; /* what B's host function saw, -1 until it runs */
} cross_t;

static void cross_a(void *arg) {
  sleep_ms(50);
  atomic_store(&((cross_t *)arg)->a_done, 1);
}
static void cross_b(void *arg) {
  cross_t *c = (cross_t *)arg;
  atomic_store(&c->observed, atomic_load(&c->a_done));
}

TEST_CASE(wait_event_orders_two_streams) {
  dmem__backend_t *be = make_backend(1 * MiB);
  void *a = NULL, *b = NULL, *e = NULL;
  REQUIRE_OK(be->stream_create(be, &a));
  REQUIRE_OK(be->stream_create(be, &b));
  REQUIRE_OK(be->event_create(be, &e));
  for (int round = 0; round < 5; round++) {
    cross_t c;
    atomic_init(&c.a_done, 0);
    atomic_init(&c.observed, -1);
    gate_t g;
    gate_init(&g);
    REQUIRE_OK(be->launch_host_func(be, a, gate_fn, &g));
    REQUIRE_OK(be->launch_host_func(be, a, cross_a, &c));
    REQUIRE_OK(be->event_record(be, e, a));
    REQUIRE_OK(be->stream_wait_event(be, b, e));
    REQUIRE_OK(be->launch_host_func(be, b, cross_b, &c));
    sleep_ms(20);
    CHECK_EQ(ld(&c.observed), -1); /* B is held by A's gate */
    gate_open(&g);
    CHECK_OK(be->stream_synchronize(be, b));
    CHECK_EQ(ld(&c.observed), 1);
    CHECK_OK(be->stream_synchronize(be, a));
    gate_fini(&g);
  }
  /* Waiting on a complete (or never recorded) event does not block. */
  void *e2 = NULL;
  REQUIRE_OK(be->event_create(be, &e2));
  CHECK_OK(be->stream_wait_event(be, b, e2));
  CHECK_OK(be->stream_wait_event(be, NULL, e));
  CHECK_OK(be->stream_synchronize(be, b));
  CHECK_OK(be->stream_synchronize(be, NULL));
  CHECK_OK(be->event_destroy(be, e2));
  CHECK_OK(be->event_destroy(be, e));
  CHECK_OK(be->stream_destroy(be, a));
  CHECK_OK(be->stream_destroy(be, b));
  be->destroy(be);
}

/* A wait binds to the record that was last when it was enqueued: re-recording
 * the event elsewhere neither releases it early nor leaves it hanging. */
TEST_CASE(rerecorded_event) {
  dmem__backend_t *be = make_backend(1 * MiB);
  void *a = NULL, *b = NULL, *c = NULL, *e = NULL;
  REQUIRE_OK(be->stream_create(be, &a));
  REQUIRE_OK(be->stream_create(be, &b));
  REQUIRE_OK(be->stream_create(be, &c));
  REQUIRE_OK(be->event_create(be, &e));

  gate_t g;
  gate_init(&g);
  atomic_int b_ran;
  atomic_init(&b_ran, 0);
  REQUIRE_OK(be->launch_host_func(be, a, gate_fn, &g));
  REQUIRE_OK(be->event_record(be, e, a));      /* record 1: held by the gate */
  REQUIRE_OK(be->stream_wait_event(be, b, e)); /* waits for record 1 */
  REQUIRE_OK(be->launch_host_func(be, b, incr_fn, &b_ran));
  REQUIRE_OK(be->event_record(be, e, c)); /* record 2: completes at once */
  CHECK_OK(be->stream_synchronize(be, c));
  CHECK_OK(be->event_query(be, e)); /* the last record is done */
  sleep_ms(20);
  CHECK_EQ(ld(&b_ran), 0); /* but B still waits for record 1 */
  gate_open(&g);
  CHECK_OK(be->stream_synchronize(be, b));
  CHECK_EQ(ld(&b_ran), 1);
  gate_fini(&g);

  /* Re-recorded on the same stream while waiters wait on older records. */
  gate_init(&g);
  REQUIRE_OK(be->launch_host_func(be, a, gate_fn, &g));
  for (int i = 0; i < 100; i++) {
    REQUIRE_OK(be->event_record(be, e, a));
    REQUIRE_OK(be->stream_wait_event(be, i % 2 ? b : c, e));
    REQUIRE_OK(be->launch_host_func(be, i % 2 ? b : c, incr_fn, &b_ran));
  }
  CHECK_STATUS(be->event_query(be, e), DMEM_ERR_BUSY);
  gate_open(&g);
  CHECK_OK(be->event_synchronize(be, e));
  CHECK_OK(be->stream_synchronize(be, b));
  CHECK_OK(be->stream_synchronize(be, c));
  CHECK_EQ(ld(&b_ran), 101);
  gate_fini(&g);

  CHECK_OK(be->event_destroy(be, e));
  CHECK_OK(be->stream_destroy(be, a));
  CHECK_OK(be->stream_destroy(be, b));
  CHECK_OK(be->stream_destroy(be, c));
  be->destroy(be);
}

/* Destroying an event with a pending record and pending waits is allowed; the
 * waits still complete and nothing leaks (ASan). */
TEST_CASE(event_destroy_while_pending) {
  dmem__backend_t *be = make_backend(1 * MiB);
  void *a = NULL, *b = NULL, *e = NULL;
  REQUIRE_OK(be->stream_create(be, &a));
  REQUIRE_OK(be->stream_create(be, &b));
  REQUIRE_OK(be->event_create(be, &e));
  gate_t g;
  gate_init(&g);
  atomic_int ran;
  atomic_init(&ran, 0);
  REQUIRE_OK(be->launch_host_func(be, a, gate_fn, &g));
  REQUIRE_OK(be->event_record(be, e, a));
  REQUIRE_OK(be->stream_wait_event(be, b, e));
  REQUIRE_OK(be->launch_host_func(be, b, incr_fn, &ran));
  CHECK_OK(be->event_destroy(be, e));
  CHECK_STATUS(be->event_query(be, e), DMEM_ERR_INVALID_ARGUMENT); /* still allocated */
  sleep_ms(10);
  CHECK_EQ(ld(&ran), 0);
  gate_open(&g);
  CHECK_OK(be->stream_synchronize(be, b));
  CHECK_EQ(ld(&ran), 1);
  gate_fini(&g);
  CHECK_OK(be->stream_destroy(be, a));
  CHECK_OK(be->stream_destroy(be, b));
  be->destroy(be);
}

/* ---- concurrency ----------------------------------------------------------------- */

#define NTHREADS 8
#define NPER 2000

typedef struct conc {
  dmem__backend_t *be;
  void *shared;       /* one stream every thread enqueues on */
  int next[NTHREADS]; /* worker-only: next index expected per thread */
  atomic_int disorder;
  atomic_int total;
  atomic_int cross_bad;
} conc_t;

typedef struct conc_item {
  conc_t *c;
  int thread, index;
} conc_item_t;

static void conc_fn(void *arg) {
  conc_item_t *it = (conc_item_t *)arg;
  conc_t *c = it->c;
  if (c->next[it->thread] != it->index) atomic_fetch_add(&c->disorder, 1);
  c->next[it->thread] = it->index + 1;
  atomic_fetch_add(&c->total, 1);
}

typedef struct conc_arg conc_arg_t;

typedef struct conc_check {
  conc_arg_t *a;
  int expect; /* own_count the shared stream must at least see after its wait */
} conc_check_t;

struct conc_arg {
  conc_t *c;
  int thread;
  conc_item_t items[NPER];
  conc_check_t checks[NPER / 100];
  atomic_int own_count; /* bumped on the thread's own stream, read on the shared one */
};

static void own_incr(void *arg) {
  sleep_ms(1);
  atomic_fetch_add(&((conc_arg_t *)arg)->own_count, 1);
}
static void own_check(void *arg) {
  conc_check_t *k = (conc_check_t *)arg;
  /* At least: the own stream may have run further since the record. */
  if (atomic_load(&k->a->own_count) < k->expect) atomic_fetch_add(&k->a->c->cross_bad, 1);
}

static void *conc_thread(void *arg) {
  conc_arg_t *a = (conc_arg_t *)arg;
  dmem__backend_t *be = a->c->be;
  void *own = NULL, *e = NULL;
  if (be->stream_create(be, &own) != DMEM_OK || be->event_create(be, &e) != DMEM_OK) {
    atomic_fetch_add(&a->c->cross_bad, 1000);
    return NULL;
  }
  int bad = 0;
  for (int i = 0; i < NPER; i++) {
    a->items[i].c = a->c;
    a->items[i].thread = a->thread;
    a->items[i].index = i;
    bad += be->launch_host_func(be, a->c->shared, conc_fn, &a->items[i]) != DMEM_OK;
    if (i % 100 == 99) {
      /* Count on the own stream; the shared stream waits, then checks. */
      conc_check_t *k = &a->checks[i / 100];
      k->a = a;
      k->expect = i / 100 + 1;
      bad += be->launch_host_func(be, own, own_incr, a) != DMEM_OK;
      bad += be->event_record(be, e, own) != DMEM_OK;
      bad += be->stream_wait_event(be, a->c->shared, e) != DMEM_OK;
      bad += be->launch_host_func(be, a->c->shared, own_check, k) != DMEM_OK;
    }
  }
  bad += be->stream_synchronize(be, own) != DMEM_OK;
  bad += be->event_destroy(be, e) != DMEM_OK;
  bad += be->stream_destroy(be, own) != DMEM_OK;
  atomic_fetch_add(&a->c->cross_bad, bad);
  return NULL;
}

TEST_CASE(concurrent_enqueue_8_threads) {
  dmem__backend_t *be = make_backend(1 * MiB);
  static conc_t c;
  static conc_arg_t args[NTHREADS];
  memset(&c, 0, sizeof c);
  c.be = be;
  REQUIRE_OK(be->stream_create(be, &c.shared));
  pthread_t t[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    memset(&args[i], 0, sizeof args[i]);
    atomic_init(&args[i].own_count, 0);
    args[i].c = &c;
    args[i].thread = i;
    pthread_create(&t[i], NULL, conc_thread, &args[i]);
  }
  for (int i = 0; i < NTHREADS; i++) pthread_join(t[i], NULL);
  CHECK_OK(be->stream_synchronize(be, c.shared));
  int total = atomic_load(&c.total), disorder = atomic_load(&c.disorder);
  int cross_bad = atomic_load(&c.cross_bad);
  CHECK_EQ(total, NTHREADS * NPER);
  CHECK_EQ(disorder, 0);
  CHECK_EQ(cross_bad, 0);
  for (int i = 0; i < NTHREADS; i++) {
    CHECK_EQ(c.next[i], NPER);
    CHECK_EQ(ld(&args[i].own_count), NPER / 100);
  }
  CHECK_OK(be->stream_destroy(be, c.shared));
  be->destroy(be);
}

/* ---- bad handles and teardown ------------------------------------------------------ */

static void never_fn(void *arg) { atomic_fetch_add((atomic_int *)arg, 1); }

TEST_CASE(bad_stream_pointer) {
  dmem__backend_t *be = make_backend(1 * MiB);
  dmem__backend_t *other = make_backend(1 * MiB);
  uint64_t fake[64];
  memset(fake, 0x5A, sizeof fake);
  atomic_int ran;
  atomic_init(&ran, 0);
  void *e = NULL, *s = NULL, *os = NULL;
  REQUIRE_OK(be->event_create(be, &e));
  REQUIRE_OK(be->stream_create(be, &s));
  REQUIRE_OK(other->stream_create(other, &os));
  char buf[16];

  CHECK_STATUS(be->launch_host_func(be, fake, never_fn, &ran), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "not a host-backend stream") != NULL);
  CHECK_STATUS(be->memcpy_async(be, buf, buf + 8, 8, fake), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->stream_synchronize(be, fake), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->stream_destroy(be, fake), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->event_record(be, e, fake), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->stream_wait_event(be, fake, e), DMEM_ERR_INVALID_ARGUMENT);
  /* An event is not a stream, a stream is not an event. */
  CHECK_STATUS(be->launch_host_func(be, e, never_fn, &ran), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->event_query(be, s), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->event_record(be, s, s), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(be->event_record(be, fake, NULL), DMEM_ERR_INVALID_ARGUMENT);
  /* A stream of another backend. */
  CHECK_STATUS(be->launch_host_func(be, os, never_fn, &ran), DMEM_ERR_INVALID_ARGUMENT);
  /* Not a device allocation (misaligned, or aligned without the header). */
  CHECK_STATUS(be->device_free(be, (unsigned char *)fake + 1), DMEM_ERR_INVALID_ARGUMENT);
  unsigned char *h = NULL;
  REQUIRE_OK(be->host_alloc(be, 1024, (void **)&h));
  memset(h, 0, 1024);
  CHECK_STATUS(be->device_free(be, h + 256), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(be->host_free(be, h));

  CHECK_OK(be->stream_synchronize(be, s));
  CHECK_OK(be->stream_synchronize(be, NULL));
  CHECK_EQ(ld(&ran), 0);
  CHECK_OK(be->event_destroy(be, e));
  CHECK_OK(be->stream_destroy(be, s));
  CHECK_OK(other->stream_destroy(other, os));
  other->destroy(other);
  be->destroy(be);
}

/* destroy drains queued work on the default stream and on streams the caller
 * never destroyed, with events destroyed while still pending. */
TEST_CASE(destroy_with_queued_work) {
  dmem__backend_t *be = make_backend(1 * MiB);
  atomic_int count;
  atomic_init(&count, 0);
  void *s = NULL, *t = NULL, *e = NULL;
  REQUIRE_OK(be->stream_create(be, &s));
  REQUIRE_OK(be->stream_create(be, &t));
  REQUIRE_OK(be->event_create(be, &e));
  static unsigned char src[4096], dst[4096];
  memset(src, 7, sizeof src);
  memset(dst, 0, sizeof dst);
  for (int i = 0; i < 40; i++) {
    REQUIRE_OK(be->launch_host_func(be, NULL, slow_incr_fn, &count));
    REQUIRE_OK(be->launch_host_func(be, s, slow_incr_fn, &count));
  }
  REQUIRE_OK(be->event_record(be, e, s));
  REQUIRE_OK(be->stream_wait_event(be, t, e));
  REQUIRE_OK(be->launch_host_func(be, t, incr_fn, &count));
  REQUIRE_OK(be->memcpy_async(be, dst, src, sizeof src, t));
  CHECK_OK(be->event_destroy(be, e));
  be->destroy(be);
  CHECK_EQ(ld(&count), 81);
  CHECK_EQ(dst[0], 7);
  CHECK_EQ(dst[4095], 7);
}

/* The VMM simulation: a reserved range keeps its address, memory mapped
 * there counts against the capacity, is poisoned and writable after
 * set_access, gone after unmap (the same address maps again); misuse gives
 * a status, never a crash. */
TEST_CASE(vmm_reserve_map_unmap) {
  dmem__backend_t *be = make_backend(1 * MiB);
  size_t g = 0;
  REQUIRE_OK(be->vmm_granularity(be, &g));
  REQUIRE_TRUE(g >= 4096 && 1 * MiB % g == 0);
  void *va = NULL;
  CHECK_STATUS(be->va_reserve(be, g + 1, &va), DMEM_ERR_INVALID_ARGUMENT);
  REQUIRE_OK(be->va_reserve(be, 2 * g, &va));
  CHECK_UEQ((uintptr_t)va % g, 0);
  size_t free_b = 0;
  CHECK_OK(be->mem_info(be, &free_b, NULL));
  CHECK_UEQ(free_b, 1 * MiB); /* address space costs nothing */
  uint64_t h = 0, h2 = 0;
  REQUIRE_OK(be->mem_create(be, 2 * g, &h));
  CHECK_OK(be->mem_info(be, &free_b, NULL));
  CHECK_UEQ(free_b, 1 * MiB - 2 * g);
  CHECK_STATUS(be->mem_create(be, 1 * MiB, &h2), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(be->mem_set_access(be, va, 2 * g), DMEM_ERR_DEVICE); /* nothing mapped */
  CHECK_STATUS(be->mem_map(be, va, g, h), DMEM_ERR_DEVICE);        /* size differs */
  CHECK_STATUS(be->mem_map(be, (char *)va + 4 * g, 2 * g, h), DMEM_ERR_DEVICE); /* outside */
  REQUIRE_OK(be->mem_map(be, va, 2 * g, h));
  CHECK_STATUS(be->mem_map(be, va, 2 * g, h), DMEM_ERR_DEVICE); /* already mapped */
  REQUIRE_OK(be->mem_set_access(be, va, 2 * g));
  unsigned char *p = va;
  CHECK_EQ(p[0], 0xDB); /* new memory: poison */
  CHECK_EQ(p[2 * g - 1], 0xDB);
  memset(p, 7, 2 * g);
  CHECK_STATUS(be->va_free(be, va, 2 * g), DMEM_ERR_INVALID_ARGUMENT); /* still mapped */
  CHECK_STATUS(be->mem_unmap(be, va, g), DMEM_ERR_INVALID_ARGUMENT);   /* not the mapping */
  REQUIRE_OK(be->mem_unmap(be, va, 2 * g));
  CHECK_STATUS(be->mem_unmap(be, va, 2 * g), DMEM_ERR_INVALID_ARGUMENT);
  REQUIRE_OK(be->mem_release(be, h));
  CHECK_STATUS(be->mem_release(be, h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(be->mem_info(be, &free_b, NULL));
  CHECK_UEQ(free_b, 1 * MiB);
  /* the same address, new memory */
  REQUIRE_OK(be->mem_create(be, 2 * g, &h2));
  REQUIRE_OK(be->mem_map(be, va, 2 * g, h2));
  REQUIRE_OK(be->mem_set_access(be, va, 2 * g));
  CHECK_EQ(p[g], 0xDB);
  /* released while mapped: freed at the unmap (as CUDA does) */
  REQUIRE_OK(be->mem_release(be, h2));
  CHECK_OK(be->mem_info(be, &free_b, NULL));
  CHECK_UEQ(free_b, 1 * MiB - 2 * g);
  REQUIRE_OK(be->mem_unmap(be, va, 2 * g));
  CHECK_OK(be->mem_info(be, &free_b, NULL));
  CHECK_UEQ(free_b, 1 * MiB);
  REQUIRE_OK(be->va_free(be, va, 2 * g));
  CHECK_STATUS(be->va_free(be, va, 2 * g), DMEM_ERR_INVALID_ARGUMENT);
  /* left live at destroy: destroy frees them */
  REQUIRE_OK(be->va_reserve(be, g, &va));
  REQUIRE_OK(be->mem_create(be, g, &h));
  REQUIRE_OK(be->mem_map(be, va, g, h));
  be->destroy(be);
}
