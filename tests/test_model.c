/*
 * tests/test_model.c - interleavings: the shared-stream rule of
 * dmem/launch.h, and the randomized model test run under the schedule
 * fuzzer (runtime/base/sched.h; this binary links dmem_fuzz_static, the
 * library built with DMEM_SCHED_FUZZ).
 *
 * The model test: several threads share three streams (the default one
 * among them) and each does random alloc / lock / launch_async /
 * sync_and_unlock / stream_release / stream_synchronize / spill (host, disk,
 * controller) / unspill / evict / prefetch / free on buffers of its own,
 * while a controller stores spilled bytes and re-enters dmem from its
 * callbacks. The model knows what every buffer must hold; each thread checks
 * its buffers' bytes whenever its own work on them is known to be done, every
 * status against the statuses the call may return there, and the lock
 * counts. At barriers every thread stops and one checks the accounting
 * (device + host + disk + controller bytes = the live buffers' sizes) and
 * that nothing stays locked. A watchdog fails the run when a call takes more
 * than 10 s. Each seed runs in a child process (a hang or a crash fails that
 * seed alone); a failure prints "FAILED seed N" and how to run it again:
 *
 *   DMEM_MODEL_SEEDS=N test_model model_fixed_seeds      one seed
 *   DMEM_MODEL_SEEDS=1-500 DMEM_MODEL_STEPS=2000 ...     a sweep (scripts/fuzz)
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "api/api.h" /* rt->release_gap_ns: wide release groups for odd seeds */

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* ---- small helpers ------------------------------------------------------------ */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void nap_us(unsigned us) {
  struct timespec ts = {0, (long)us * 1000};
  nanosleep(&ts, NULL);
}

static uint64_t rnd(uint64_t *x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static dmem_runtime_t *host_runtime(size_t limit, size_t host_limit, const char *spill_dir) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = limit;
  cfg.host_limit = host_limit;
  cfg.spill_dir = spill_dir;
  return check_runtime_cfg(&cfg);
}

/* ---- the shared-stream rule, directly ------------------------------------------
 * A launch still inside its launch function keeps its locks until a later
 * sync or release of the stream; a sync or release covers exactly the
 * launches whose work was enqueued before it. */

typedef struct {
  dmem_runtime_t *rt;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int in_fn;   /* the launch function has started */
  int go;      /* the launch function may enqueue and return */
  int written; /* the "kernel" ran */
} gate_t;

static void gate_set(gate_t *g, int *field) {
  pthread_mutex_lock(&g->mu);
  *field = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static int gate_get(gate_t *g, int *field) {
  pthread_mutex_lock(&g->mu);
  int v = *field;
  pthread_mutex_unlock(&g->mu);
  return v;
}

static void gate_wait(gate_t *g, int *field) {
  pthread_mutex_lock(&g->mu);
  while (!*field) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

static void kernel_write(void *arg) {
  gate_t *g = arg;
  nap_us(20000); /* a slow kernel: a sync that did not wait for it shows */
  gate_set(g, &g->written);
}

static dmem_status_t gated_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)ptrs;
  (void)n;
  gate_t *g = user;
  gate_set(g, &g->in_fn);
  gate_wait(g, &g->go);
  return dmem_stream_enqueue_host(g->rt, s, kernel_write, g);
}

typedef struct {
  gate_t *g;
  dmem_stream_t s;
  dmem_handle_t h;
  dmem_status_t st;
} launcher_t;

static void *launcher(void *arg) {
  launcher_t *l = arg;
  l->st = dmem_launch_async(l->g->rt, l->s, &l->h, 1, gated_launch, l->g);
  return NULL;
}

static unsigned lock_count(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return 999;
  return info.lock_count;
}

/* Thread A is inside dmem_launch_async's launch function (its buffer in the
 * stream's registry, its kernel not yet enqueued) while this thread syncs
 * and unlocks, or releases, the same stream: A's buffer must stay locked. */
static void launch_in_flight_keeps_its_lock(dmem_stream_t s, int release) {
  dmem_runtime_t *rt = host_runtime(4 * MiB, 0, NULL);
  gate_t g = {.rt = rt, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  launcher_t l = {.g = &g, .s = s};
  REQUIRE_STATUS(dmem_buffer_alloc(rt, 64 * KiB, 0, &l.h), DMEM_OK);
  pthread_t t;
  pthread_create(&t, NULL, launcher, &l);
  gate_wait(&g, &g.in_fn);
  if (release) {
    CHECK_STATUS(dmem_stream_release(rt, s), DMEM_OK);
    CHECK_STATUS(dmem_stream_synchronize(rt, s), DMEM_OK); /* a release's event is done */
  } else {
    CHECK_STATUS(dmem_sync_and_unlock(rt, s), DMEM_OK);
  }
  CHECK_EQ(lock_count(rt, l.h), 1); /* still A's */
  /* the buffer is A's: it may be neither spilled nor freed under A */
  CHECK_STATUS(dmem_buffer_spill(rt, l.h, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  gate_set(&g, &g.go);
  pthread_join(t, NULL);
  CHECK_STATUS(l.st, DMEM_OK);
  CHECK_EQ(lock_count(rt, l.h), 1);
  CHECK_STATUS(dmem_sync_and_unlock(rt, s), DMEM_OK); /* this one covers A's launch */
  CHECK_EQ(gate_get(&g, &g.written), 1);
  CHECK_EQ(lock_count(rt, l.h), 0);
  CHECK_STATUS(dmem_buffer_free(rt, l.h), DMEM_OK);
  dmem_runtime_destroy(rt);
}

TEST_CASE(sync_during_launch_keeps_its_locks_default_stream) {
  launch_in_flight_keeps_its_lock(NULL, 0);
}

TEST_CASE(release_during_launch_keeps_its_locks_default_stream) {
  launch_in_flight_keeps_its_lock(NULL, 1);
}

static void block_stream(void *arg) { gate_wait(arg, &((gate_t *)arg)->go); }

typedef struct {
  dmem_runtime_t *rt;
  dmem_stream_t s;
  dmem_status_t st;
  _Atomic int done;
} syncer_t;

static void *syncer(void *arg) {
  syncer_t *y = arg;
  y->st = dmem_sync_and_unlock(y->rt, y->s);
  atomic_store(&y->done, 1);
  return NULL;
}

static dmem_status_t plain_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)ptrs;
  (void)n;
  gate_t *g = user;
  return dmem_stream_enqueue_host(g->rt, s, kernel_write, g);
}

/* Thread B's synchronisation began before A's launch: B may return before
 * A's kernel ran, so it must not unlock A's buffer. */
TEST_CASE(sync_that_began_before_a_launch_does_not_unlock_it) {
  dmem_runtime_t *rt = host_runtime(4 * MiB, 0, NULL);
  dmem_stream_t s;
  REQUIRE_STATUS(dmem_stream_create(rt, &s), DMEM_OK);
  gate_t blocker = {.rt = rt, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  gate_t g = {.rt = rt, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  dmem_handle_t h;
  REQUIRE_STATUS(dmem_buffer_alloc(rt, 64 * KiB, 0, &h), DMEM_OK);
  REQUIRE_STATUS(dmem_stream_enqueue_host(rt, s, block_stream, &blocker), DMEM_OK);
  syncer_t y = {.rt = rt, .s = s};
  pthread_t t;
  pthread_create(&t, NULL, syncer, &y);
  nap_us(20000); /* B is waiting for the stream */
  CHECK_EQ(atomic_load(&y.done), 0);
  REQUIRE_STATUS(dmem_launch_async(rt, s, &h, 1, plain_launch, &g), DMEM_OK);
  gate_set(&blocker, &blocker.go); /* B's wait ends; A's kernel may still be queued */
  pthread_join(t, NULL);
  CHECK_STATUS(y.st, DMEM_OK);
  if (!gate_get(&g, &g.written)) CHECK_EQ(lock_count(rt, h), 1);
  CHECK_STATUS(dmem_sync_and_unlock(rt, s), DMEM_OK);
  CHECK_EQ(gate_get(&g, &g.written), 1);
  CHECK_EQ(lock_count(rt, h), 0);
  CHECK_STATUS(dmem_buffer_free(rt, h), DMEM_OK);
  CHECK_STATUS(dmem_stream_destroy(rt, s), DMEM_OK);
  dmem_runtime_destroy(rt);
}

/* A launch function that syncs its own stream does not unlock its own
 * buffers (they are not launched yet). */
static dmem_status_t self_syncing_launch(void *user, dmem_stream_t s, void *const *ptrs,
                                         size_t n) {
  gate_t *g = user;
  dmem_status_t st = dmem_sync_and_unlock(g->rt, s);
  if (st != DMEM_OK) return st;
  return plain_launch(user, s, ptrs, n);
}

TEST_CASE(launch_function_that_syncs_its_stream_keeps_its_locks) {
  dmem_runtime_t *rt = host_runtime(4 * MiB, 0, NULL);
  gate_t g = {.rt = rt, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  dmem_handle_t h;
  REQUIRE_STATUS(dmem_buffer_alloc(rt, 64 * KiB, 0, &h), DMEM_OK);
  CHECK_STATUS(dmem_launch_async(rt, NULL, &h, 1, self_syncing_launch, &g), DMEM_OK);
  CHECK_EQ(lock_count(rt, h), 1);
  CHECK_STATUS(dmem_sync_and_unlock(rt, NULL), DMEM_OK);
  CHECK_EQ(lock_count(rt, h), 0);
  CHECK_STATUS(dmem_buffer_free(rt, h), DMEM_OK);
  dmem_runtime_destroy(rt);
}

/* ---- the randomized model --------------------------------------------------------- */

#define NTHREADS 4
#define NSTREAMS 3 /* shared by every thread; [0] is the default stream */
#define PER_THREAD 5
#define NAUX 2     /* buffers only the controller's callbacks touch */
#define MAXSTORED 256
/* A call taking longer than this fails the seed: 10 s, as the model
 * promises; 60 s in the sanitizer builds, which run 5-15 times slower on a
 * CI machine that may be loaded; DMEM_MODEL_STUCK_S overrides both. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STUCK_S_DEFAULT 60
#else
#define STUCK_S_DEFAULT 10
#endif
static uint64_t stuck_ns(void) {
  const char *s = getenv("DMEM_MODEL_STUCK_S");
  long v = s && *s ? atol(s) : STUCK_S_DEFAULT;
  return (uint64_t)(v > 0 ? v : STUCK_S_DEFAULT) * 1000000000u;
}

typedef struct {
  dmem_handle_t h;
  size_t size;
  uint64_t val;  /* the pattern the bytes hold (0: unknown, not checked) */
  int live;
  int pending;   /* index+1 of the shared stream our unfinished kernel is on */
  unsigned registered; /* streams whose registry may still hold it (bit per stream) */
  int launched;        /* launched since the last barrier: another thread's sync or
                          release of the stream may be unlocking it right now */
} mbuf_t;

typedef struct world world_t;

typedef struct {
  world_t *w;
  int id;
  uint64_t rng;
  dmem_stream_t own; /* for fills and checks */
  mbuf_t b[PER_THREAD];
  _Atomic uint64_t call_start; /* watchdog: 0 when not inside a dmem call */
  const char *_Atomic call_name;
} mthread_t;

typedef struct {
  dmem_handle_t h;
  void *bytes;
  size_t size;
} stored_t;

struct world {
  dmem_runtime_t *rt;
  uint64_t seed;
  int steps;
  dmem_stream_t streams[NSTREAMS];
  mthread_t th[NTHREADS];
  dmem_handle_t aux[NAUX];
  pthread_barrier_t barrier;
  dmem_controller_t ctl;
  pthread_mutex_t ctl_mu; /* the controller's own table, not dmem's */
  stored_t stored[MAXSTORED];
  _Atomic int in_store;
  _Atomic int failures;
  _Atomic int done;
};

static _Thread_local mthread_t *self; /* NULL on dmem's own threads */

#define MODEL_FAIL(w, ...)                                               \
  do {                                                                   \
    fprintf(stderr, "model seed %llu: ", (unsigned long long)(w)->seed); \
    fprintf(stderr, __VA_ARGS__);                                        \
    fprintf(stderr, "\n");                                               \
    atomic_fetch_add(&(w)->failures, 1);                                 \
  } while (0)

static void enter(const char *name) {
  if (!self) return;
  atomic_store(&self->call_name, name);
  atomic_store(&self->call_start, now_ns());
}

static void leave(void) {
  if (self) atomic_store(&self->call_start, 0);
}

/* Run one dmem call under the watchdog and check its status is one of the
 * allowed ones (a bit set of statuses). */
#define ST(s) (1ull << (unsigned)(-(int)(s)))
#define CALL(w, allowed, expr)                                                          \
  ({                                                                                  \
    enter(#expr);                                                                     \
    dmem_status_t call_st_ = (expr);                                                  \
    leave();                                                                          \
    if (!((allowed) & ST(call_st_)))                                                  \
      MODEL_FAIL(w, "%s:%d: %s returned %s (%s)", __FILE__, __LINE__, #expr,          \
                 dmem_status_name(call_st_), dmem_last_error_detail());               \
    call_st_;                                                                         \
  })

/* Statuses a move may meet under pressure in this model. */
#define ROOM (ST(DMEM_ERR_OUT_OF_MEMORY) | ST(DMEM_ERR_HOST_OUT_OF_MEMORY))

/* ---- the controller ---- */

static stored_t *stored_find(world_t *w, dmem_handle_t h) {
  for (int i = 0; i < MAXSTORED; i++)
    if (w->stored[i].h == h) return &w->stored[i];
  return NULL;
}

static int stored_count(world_t *w) {
  pthread_mutex_lock(&w->ctl_mu);
  int n = 0;
  for (int i = 0; i < MAXSTORED; i++) n += w->stored[i].h != DMEM_HANDLE_NULL;
  pthread_mutex_unlock(&w->ctl_mu);
  return n;
}

/* DMEM_MODEL_REENTER=0: the controller's callbacks do not call back into
 * dmem (to tell re-entrancy failures from the others). */
static int reenter(void) {
  const char *s = getenv("DMEM_MODEL_REENTER");
  return !(s && strcmp(s, "0") == 0);
}

static uint64_t cb_rand(world_t *w) {
  if (!reenter()) return 3; /* no re-entry below */
  static _Thread_local uint64_t x;
  if (!x) x = w->seed * 31 + (uint64_t)(uintptr_t)&x;
  return rnd(&x);
}

/* Re-entry that every callback may try: touching its own buffer is BUSY. */
static void touch_own(world_t *w, dmem_handle_t h, const char *cb) {
  void *p;
  dmem_status_t st = dmem_buffer_lock(w->rt, h, NULL, &p);
  if (st == DMEM_OK) {
    MODEL_FAIL(w, "%s: dmem_buffer_lock of its own buffer returned DMEM_OK, not DMEM_ERR_BUSY", cb);
    dmem_buffer_unlock(w->rt, h);
  } else if (st != DMEM_ERR_BUSY) {
    MODEL_FAIL(w, "%s: dmem_buffer_lock of its own buffer returned %s", cb, dmem_status_name(st));
  }
}

static dmem_status_t ctl_store(void *user, dmem_handle_t h, const void *data, size_t size) {
  world_t *w = user;
  atomic_fetch_add(&w->in_store, 1);
  uint64_t r = cb_rand(w);
  if (r % 4 == 0) touch_own(w, h, "store");
  if (r % 4 == 1) {
    dmem_status_t st = dmem_buffer_unspill(w->rt, h, NULL);
    if (st != DMEM_ERR_BUSY)
      MODEL_FAIL(w, "store: dmem_buffer_unspill of its own buffer returned %s", dmem_status_name(st));
  }
  if (r % 4 == 2) {
    /* an allocation inside store: at once, whatever it returns */
    uint64_t t0 = now_ns();
    dmem_handle_t a;
    dmem_status_t st = dmem_buffer_alloc(w->rt, 4 * KiB, 0, &a);
    if (st == DMEM_OK) dmem_buffer_free(w->rt, a);
    if (now_ns() - t0 > 2000000000ull)
      MODEL_FAIL(w, "store: dmem_buffer_alloc waited %.1f s (%s)", (now_ns() - t0) / 1e9,
                 dmem_status_name(st));
  }
  dmem_status_t out = DMEM_OK;
  void *copy = malloc(size);
  if (!copy) abort();
  memcpy(copy, data, size);
  pthread_mutex_lock(&w->ctl_mu);
  stored_t *e = stored_find(w, h);
  if (!e) e = stored_find(w, DMEM_HANDLE_NULL);
  if (!e) {
    out = DMEM_ERR_HOST_OUT_OF_MEMORY; /* table full: the spill fails, nothing lost */
    free(copy);
  } else {
    free(e->bytes);
    e->h = h;
    e->bytes = copy;
    e->size = size;
  }
  pthread_mutex_unlock(&w->ctl_mu);
  atomic_fetch_sub(&w->in_store, 1);
  return out;
}

static dmem_status_t ctl_retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  world_t *w = user;
  uint64_t r = cb_rand(w);
  if (!reenter()) {
  } else if (r % 3 == 0) {
    /* move another buffer first, then touch our own */
    dmem_handle_t o = w->aux[r / 3 % NAUX];
    dmem_status_t st = (r / 7) % 2 ? dmem_buffer_spill(w->rt, o, DMEM_TIER_HOST)
                                   : dmem_buffer_unspill(w->rt, o, NULL);
    (void)st; /* any status: the aux buffers may be anywhere */
    touch_own(w, h, "retrieve");
  } else if (r % 3 == 1) {
    touch_own(w, h, "retrieve");
  }
  pthread_mutex_lock(&w->ctl_mu);
  stored_t *e = stored_find(w, h);
  dmem_status_t st = DMEM_OK;
  if (!e || e->size != size) {
    st = DMEM_ERR_CALLBACK;
  } else {
    memcpy(out, e->bytes, size);
    free(e->bytes);
    memset(e, 0, sizeof *e);
  }
  pthread_mutex_unlock(&w->ctl_mu);
  if (st != DMEM_OK)
    MODEL_FAIL(w, "retrieve: asked for %#llx, which the controller does not hold",
               (unsigned long long)h);
  return st;
}

static void ctl_event(void *user, const dmem_event_t *ev) {
  world_t *w = user;
  if (ev->kind != DMEM_EVENT_FREE) return;
  pthread_mutex_lock(&w->ctl_mu);
  stored_t *e = stored_find(w, ev->handle);
  if (e) {
    free(e->bytes);
    memset(e, 0, sizeof *e);
  }
  pthread_mutex_unlock(&w->ctl_mu);
}

/* ---- the threads' operations ---- */

typedef struct {
  mthread_t *t;
  mbuf_t *bufs[2];
  uint64_t vals[2];
  size_t n;
  unsigned delay_us; /* inside the launch function, before the kernel is enqueued */
} launch_t;

typedef struct {
  void *dev;
  size_t size;
  uint64_t val;
} kjob_t;

static void kernel_fill(void *arg) {
  kjob_t *j = arg;
  check_fill(j->dev, j->size, j->val);
  free(j);
}

static dmem_status_t model_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  launch_t *l = user;
  if (l->delay_us) nap_us(l->delay_us);
  for (size_t i = 0; i < n; i++) {
    kjob_t *j = malloc(sizeof *j); /* outlives this call: the kernel frees it */
    if (!j) abort();
    j->dev = ptrs[i];
    j->size = l->bufs[i]->size;
    j->val = l->vals[i];
    dmem_status_t st = dmem_stream_enqueue_host(l->t->w->rt, s, kernel_fill, j);
    if (st != DMEM_OK) {
      free(j);
      return st;
    }
  }
  return DMEM_OK;
}

static uint64_t new_val(mthread_t *t) { return (rnd(&t->rng) | 1) & 0xFFFFFFFFFFFF; }

/* Check a buffer whose own work is done: its bytes, read through a lock on
 * this thread's stream. */
static void verify(mthread_t *t, mbuf_t *b, const char *after) {
  world_t *w = t->w;
  if (!b->live || b->pending || b->val == 0) return;
  void *p;
  dmem_status_t st = CALL(w, ST(DMEM_OK) | ROOM, dmem_buffer_lock(w->rt, b->h, t->own, &p));
  if (st != DMEM_OK) return;
  unsigned char *tmp = malloc(b->size);
  if (!tmp) abort();
  CALL(w, ST(DMEM_OK), dmem_stream_copy(w->rt, tmp, p, b->size, t->own));
  CALL(w, ST(DMEM_OK), dmem_stream_synchronize(w->rt, t->own));
  CALL(w, ST(DMEM_OK), dmem_buffer_unlock(w->rt, b->h));
  size_t bad = check_verify(tmp, b->size, b->val);
  if (bad)
    MODEL_FAIL(w, "thread %d: buffer %#llx (%zu bytes) has %zu wrong bytes after %s", t->id,
               (unsigned long long)b->h, b->size, bad, after);
  free(tmp);
}

static void fill(mthread_t *t, mbuf_t *b) {
  world_t *w = t->w;
  void *p;
  uint64_t v = new_val(t);
  dmem_status_t st = CALL(w, ST(DMEM_OK) | ROOM, dmem_buffer_lock(w->rt, b->h, t->own, &p));
  if (st != DMEM_OK) {
    b->val = 0;
    return;
  }
  unsigned char *tmp = malloc(b->size);
  if (!tmp) abort();
  check_fill(tmp, b->size, v);
  CALL(w, ST(DMEM_OK), dmem_stream_copy(w->rt, p, tmp, b->size, t->own));
  CALL(w, ST(DMEM_OK), dmem_stream_synchronize(w->rt, t->own));
  CALL(w, ST(DMEM_OK), dmem_buffer_unlock(w->rt, b->h));
  free(tmp);
  b->val = v;
}

/* The stream's own work is done: our kernels there have run. */
static void stream_done(mthread_t *t, int si, const char *after) {
  for (int i = 0; i < PER_THREAD; i++) {
    mbuf_t *b = &t->b[i];
    if (b->live && b->pending == si + 1) {
      b->pending = 0;
      verify(t, b, after);
    }
  }
}

static mbuf_t *pick(mthread_t *t, int live, int idle) {
  int start = (int)(rnd(&t->rng) % PER_THREAD);
  for (int k = 0; k < PER_THREAD; k++) {
    mbuf_t *b = &t->b[(start + k) % PER_THREAD];
    if (b->live == live && (!idle || !b->pending)) return b;
  }
  return NULL;
}

static void step(mthread_t *t) {
  world_t *w = t->w;
  dmem_runtime_t *rt = w->rt;
  uint64_t r = rnd(&t->rng);
  int si = (int)((r >> 8) % NSTREAMS);
  dmem_stream_t s = w->streams[si];
  mbuf_t *b;
  switch (r % 14) {
    case 0:
    case 1: /* alloc and fill */
      if (!(b = pick(t, 0, 0))) break;
      b->size = 4 * KiB * (1 + (r >> 16) % 40);
      if (CALL(w, ST(DMEM_OK) | ROOM, dmem_buffer_alloc(rt, b->size, 0, &b->h)) != DMEM_OK) break;
      b->live = 1;
      b->pending = 0;
      b->registered = 0;
      b->launched = 0;
      fill(t, b);
      break;
    case 2: /* free */
      if (!(b = pick(t, 1, 1))) break;
      CALL(w, ST(DMEM_OK), dmem_buffer_free(rt, b->h));
      b->live = 0;
      break;
    case 3:
    case 4: { /* launch on a shared stream */
      launch_t l = {.t = t, .delay_us = (r >> 20) % 4 == 0 ? (unsigned)((r >> 24) % 300) : 0};
      mbuf_t *a = pick(t, 1, 1);
      if (!a) break;
      l.bufs[l.n++] = a;
      mbuf_t *c = pick(t, 1, 1);
      if (c && c != a && (r >> 30) % 2) l.bufs[l.n++] = c;
      dmem_handle_t hs[2];
      for (size_t i = 0; i < l.n; i++) {
        hs[i] = l.bufs[i]->h;
        l.vals[i] = new_val(t);
      }
      if (CALL(w, ST(DMEM_OK) | ROOM, dmem_launch_async(rt, s, hs, l.n, model_launch, &l)) !=
          DMEM_OK)
        break;
      for (size_t i = 0; i < l.n; i++) {
        l.bufs[i]->pending = si + 1;
        l.bufs[i]->registered |= 1u << si;
        l.bufs[i]->launched = 1;
        l.bufs[i]->val = l.vals[i];
      }
      break;
    }
    case 5:
      CALL(w, ST(DMEM_OK), dmem_sync_and_unlock(rt, s));
      for (int i = 0; i < PER_THREAD; i++) t->b[i].registered &= ~(1u << si);
      stream_done(t, si, "dmem_sync_and_unlock");
      break;
    case 6:
      CALL(w, ST(DMEM_OK), dmem_stream_release(rt, s));
      break;
    case 7:
      CALL(w, ST(DMEM_OK), dmem_stream_synchronize(rt, s));
      stream_done(t, si, "dmem_stream_synchronize");
      break;
    case 8: { /* spill to a tier */
      if (!(b = pick(t, 1, 0))) break;
      dmem_tier_t tier = (dmem_tier_t)(DMEM_TIER_HOST + (r >> 12) % 3);
      /* INVALID_ARGUMENT: an eviction moved it to a tier past `tier` first */
      CALL(w, ST(DMEM_OK) | ST(DMEM_ERR_BUSY) | ST(DMEM_ERR_INVALID_ARGUMENT) | ROOM,
           dmem_buffer_spill(rt, b->h, tier));
      break;
    }
    case 9:
      if (!(b = pick(t, 1, 0))) break;
      CALL(w, ST(DMEM_OK) | ST(DMEM_ERR_BUSY) | ROOM, dmem_buffer_unspill(rt, b->h, t->own));
      break;
    case 10: {
      size_t freed = 0;
      CALL(w, ST(DMEM_OK) | ROOM, dmem_runtime_evict(rt, (r >> 12) % (512 * KiB) + 1, &freed));
      break;
    }
    case 11: {
      dmem_handle_t hs[PER_THREAD];
      size_t n = 0;
      for (int i = 0; i < PER_THREAD; i++)
        if (t->b[i].live) hs[n++] = t->b[i].h;
      CALL(w, ST(DMEM_OK) | ROOM, dmem_buffer_prefetch(rt, hs, n, t->own));
      break;
    }
    case 12:
      if (t->id == 0 && (r >> 40) % 4 == 0) {
        /* remove the controller and put it back: refused (BUSY) while it
         * holds bytes or a store is in flight, else nothing may be stranded */
        if (CALL(w, ST(DMEM_OK) | ST(DMEM_ERR_BUSY), dmem_controller_set(rt, NULL)) == DMEM_OK)
          CALL(w, ST(DMEM_OK), dmem_controller_set(rt, &w->ctl));
        break;
      }
      /* fall through */
    default: /* check */
      if ((b = pick(t, 1, 1))) verify(t, b, "random moves");
      break;
  }
  /* Lock counts: our buffers that no registry may hold are locked by nobody
   * (the controller's re-entries that lock them must have got DMEM_ERR_BUSY
   * and let go). */
  for (int i = 0; i < PER_THREAD; i++) {
    mbuf_t *m = &t->b[i];
    if (!m->live || m->pending || m->registered || m->launched) continue;
    dmem_buffer_info_t info;
    if (dmem_buffer_info(rt, m->h, &info) != DMEM_OK)
      MODEL_FAIL(w, "thread %d: buffer %#llx: dmem_buffer_info failed", t->id,
                 (unsigned long long)m->h);
    else if (info.lock_count != 0)
      MODEL_FAIL(w, "thread %d: idle buffer %#llx has lock count %u", t->id,
                 (unsigned long long)m->h, info.lock_count);
  }
}

/* At a barrier, with every thread stopped: nothing locked once every stream
 * is synced, and every byte accounted for. */
static void quiescent_check(world_t *w, int round) {
  for (int si = 0; si < NSTREAMS; si++)
    CALL(w, ST(DMEM_OK), dmem_sync_and_unlock(w->rt, w->streams[si]));
  size_t want = 0;
  for (int a = 0; a < NAUX; a++) {
    dmem_buffer_info_t info;
    if (dmem_buffer_info(w->rt, w->aux[a], &info) == DMEM_OK) want += info.size;
  }
  for (int k = 0; k < NTHREADS; k++) {
    mthread_t *t = &w->th[k];
    for (int i = 0; i < PER_THREAD; i++) {
      mbuf_t *b = &t->b[i];
      if (!b->live) continue;
      want += b->size;
      b->pending = 0;
      b->registered = 0;
      b->launched = 0;
      dmem_buffer_info_t info;
      if (dmem_buffer_info(w->rt, b->h, &info) != DMEM_OK || info.lock_count != 0)
        MODEL_FAIL(w, "round %d: buffer %#llx still locked (%u) with every stream synced",
                   round, (unsigned long long)b->h, info.lock_count);
    }
  }
  /* moves in flight on dmem's own threads (push-downs) settle */
  dmem_stats_t st;
  size_t have = 0;
  for (int tries = 0; tries < 400; tries++) {
    dmem_runtime_poll(w->rt);
    memset(&st, 0, sizeof st);
    dmem_stats(w->rt, &st);
    have = st.device_used - st.raw_used + st.host_used + st.disk_used + st.controller_used;
    if (have == want) break;
    nap_us(5000);
  }
  if (have != want)
    MODEL_FAIL(w, "round %d: accounting: device %zu + host %zu + disk %zu + controller %zu = "
               "%zu, live buffers %zu", round, st.device_used - st.raw_used, st.host_used,
               st.disk_used, st.controller_used, have, want);
}

static void *model_thread(void *arg) {
  mthread_t *t = arg;
  world_t *w = t->w;
  self = t;
  if (dmem_stream_create(w->rt, &t->own) != DMEM_OK) abort();
  int round = 0;
  for (int i = 0; i < w->steps; i++) {
    step(t);
    if ((i + 1) % 50 == 0 || i + 1 == w->steps) {
      pthread_barrier_wait(&w->barrier);
      if (t->id == 0) quiescent_check(w, round);
      pthread_barrier_wait(&w->barrier);
      for (int k = 0; k < PER_THREAD; k++) verify(t, &t->b[k], "a barrier");
      round++;
    }
  }
  for (int k = 0; k < PER_THREAD; k++)
    if (t->b[k].live) {
      CALL(w, ST(DMEM_OK), dmem_buffer_free(w->rt, t->b[k].h));
      t->b[k].live = 0;
    }
  CALL(w, ST(DMEM_OK), dmem_stream_destroy(w->rt, t->own));
  self = NULL;
  return NULL;
}

static void *watchdog(void *arg) {
  world_t *w = arg;
  uint64_t limit = stuck_ns();
  while (!atomic_load(&w->done)) {
    nap_us(100000);
    uint64_t now = now_ns();
    for (int k = 0; k < NTHREADS; k++) {
      uint64_t t0 = atomic_load(&w->th[k].call_start);
      if (t0 && now > t0 && now - t0 > limit) { /* t0 may be newer than now */
        fprintf(stderr, "model seed %llu: thread %d stuck for over %llu s in %s\n",
                (unsigned long long)w->seed, k, (unsigned long long)(limit / 1000000000u),
                atomic_load(&w->th[k].call_name));
        _exit(3);
      }
    }
  }
  return NULL;
}

/* One seed, in this (child) process; spill files under `dir`. */
static int run_model(uint64_t seed, int steps, const char *dir) {
  static world_t w; /* large: keep it off the stack */
  memset(&w, 0, sizeof w);
  w.seed = seed;
  w.steps = steps;
  pthread_mutex_init(&w.ctl_mu, NULL);
  w.rt = host_runtime(2 * MiB, 512 * KiB, dir);
  if (seed % 2) {
    /* odd seeds: every release after a stream's first joins its group
     * (spill/pending.c) until someone looks, whatever the timing */
    w.rt->release_gap_ns = w.rt->release_age_ns = 1000000000u;
  }
  for (int si = 1; si < NSTREAMS; si++)
    if (dmem_stream_create(w.rt, &w.streams[si]) != DMEM_OK) return 2;
  for (int a = 0; a < NAUX; a++)
    if (dmem_buffer_alloc(w.rt, 16 * KiB, 0, &w.aux[a]) != DMEM_OK) return 2;
  w.ctl.struct_size = sizeof w.ctl;
  w.ctl.user = &w;
  w.ctl.store = ctl_store;
  w.ctl.retrieve = ctl_retrieve;
  w.ctl.on_event = ctl_event;
  if (dmem_controller_set(w.rt, &w.ctl) != DMEM_OK) return 2;
  pthread_barrier_init(&w.barrier, NULL, NTHREADS);
  pthread_t wd, ts[NTHREADS];
  pthread_create(&wd, NULL, watchdog, &w);
  for (int k = 0; k < NTHREADS; k++) {
    w.th[k].w = &w;
    w.th[k].id = k;
    w.th[k].rng = seed * 0x9E3779B97F4A7C15ull + (uint64_t)k * 7919 + 1;
    pthread_create(&ts[k], NULL, model_thread, &w.th[k]);
  }
  for (int k = 0; k < NTHREADS; k++) pthread_join(ts[k], NULL);
  for (int a = 0; a < NAUX; a++) dmem_buffer_free(w.rt, w.aux[a]);
  for (int si = 0; si < NSTREAMS; si++) dmem_sync_and_unlock(w.rt, w.streams[si]);
  dmem_runtime_poll(w.rt);
  /* every buffer is freed: the controller was told to drop everything */
  int left = stored_count(&w);
  if (left) MODEL_FAIL(&w, "the controller still holds %d copies of freed buffers", left);
  dmem_status_t st = dmem_controller_set(w.rt, NULL);
  if (st != DMEM_OK) MODEL_FAIL(&w, "removing the controller: %s", dmem_status_name(st));
  for (int si = 1; si < NSTREAMS; si++) dmem_stream_destroy(w.rt, w.streams[si]);
  atomic_store(&w.done, 1);
  pthread_join(wd, NULL);
  dmem_runtime_destroy(w.rt);
  for (int i = 0; i < MAXSTORED; i++) free(w.stored[i].bytes);
  return atomic_load(&w.failures) ? 1 : 0;
}

/* DMEM_MODEL_SEEDS: "a,b,c" or "a-b"; else the fixed CI set. */
static int parse_seeds(uint64_t *out, int cap) {
  const char *s = getenv("DMEM_MODEL_SEEDS");
  int n = 0;
  if (!s || !*s) { /* the fixed CI set */
    for (uint64_t x = 1; x <= 24 && n < cap; x++) out[n++] = x;
    return n;
  }
  unsigned long long a, b;
  if (sscanf(s, "%llu-%llu", &a, &b) == 2 && strchr(s, '-')) {
    for (unsigned long long x = a; x <= b && n < cap; x++) out[n++] = x;
    return n;
  }
  const char *p = s;
  while (*p && n < cap) {
    char *end;
    unsigned long long v = strtoull(p, &end, 0);
    if (end == p) break;
    out[n++] = v;
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

/* Every seed in a child process, at most `limit_s` seconds each. */
TEST_CASE(model_fixed_seeds) {
  static uint64_t seeds[100000];
  int n = parse_seeds(seeds, 100000);
  const char *st = getenv("DMEM_MODEL_STEPS");
  int steps = st && *st ? atoi(st) : 300;
  int failed = 0;
  char dir[512]; /* removed at exit by this process, whatever the children left */
  check_mkdtemp(dir, sizeof dir, "dmem-model-");
  for (int i = 0; i < n; i++) {
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
      char buf[32];
      snprintf(buf, sizeof buf, "%llu", (unsigned long long)seeds[i]);
      setenv("DMEM_SCHED_SEED", buf, 1);
      alarm(240); /* the watchdog catches a stuck call first; this, anything else */
      _exit(run_model(seeds[i], steps, dir));
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok) {
      failed++;
      fprintf(stderr, "FAILED seed %llu (%s %d): run again with DMEM_MODEL_SEEDS=%llu "
              "DMEM_MODEL_STEPS=%d %s model_fixed_seeds\n",
              (unsigned long long)seeds[i], WIFEXITED(status) ? "exit" : "signal",
              WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
              (unsigned long long)seeds[i], steps, "test_model");
    }
  }
  fprintf(stderr, "model: %d of %d seeds passed (%d steps x %d threads each)\n", n - failed, n,
          steps, NTHREADS);
  CHECK_EQ(failed, 0);
}
