/* Stress: 8+ threads under constant spilling pressure. Every buffer's bytes
 * are verified by checksum after every use and at the end. Threads lock
 * buffers on their own streams through dmem_launch_async, verify and rewrite
 * them in stream-ordered "kernels", while other threads allocate, free,
 * spill to host and disk, unspill and evict. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "check.h"

#define KiB ((size_t)1 << 10)
#define NBUF 48
#define NWORKERS 6

typedef struct {
  pthread_mutex_t mu; /* the test's own writer lock, not dmem's */
  dmem_handle_t h;
  size_t size;
  uint64_t seed; /* what the bytes must be */
  int live;
  _Atomic uint64_t h_pub; /* h, for the spiller that takes no writer lock */
} slot_t;

typedef struct {
  dmem_runtime_t *rt;
  slot_t slots[NBUF];
  atomic_int stop;
  atomic_long uses, bad, errors, spills, churn;
} world_t;

typedef struct {
  slot_t *slot;
  uint64_t new_seed;
  size_t bad;
} kernel_arg_t;

/* the launch fn: verify then rewrite, in stream order */
typedef struct {
  world_t *w;
  kernel_arg_t k;
  void *dev;
} job_t;

static void verify_and_rewrite(void *arg) {
  job_t *j = arg;
  j->k.bad = check_verify(j->dev, j->k.slot->size, j->k.slot->seed);
  check_fill(j->dev, j->k.slot->size, j->k.new_seed);
}

static dmem_status_t launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)n;
  job_t *j = user;
  j->dev = ptrs[0];
  return dmem_stream_enqueue_host(j->w->rt, s, verify_and_rewrite, j);
}

static uint64_t rnd(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

static void fail_status(world_t *w, const char *what, dmem_status_t st) {
  fprintf(stderr, "%s: %s (%s)\n", what, dmem_status_name(st), dmem_last_error_detail());
  atomic_fetch_add(&w->errors, 1);
}

static void *worker(void *arg) {
  world_t *w = ((void **)arg)[0];
  uint64_t x = (uint64_t)(uintptr_t)((void **)arg)[1] * 7919 + 1;
  dmem_stream_t s;
  if (dmem_stream_create(w->rt, &s) != DMEM_OK) abort();
  while (!atomic_load(&w->stop)) {
    slot_t *sl = &w->slots[rnd(&x) % NBUF];
    if (pthread_mutex_trylock(&sl->mu) != 0) continue;
    if (!sl->live) {
      pthread_mutex_unlock(&sl->mu);
      continue;
    }
    job_t j;
    j.w = w;
    j.k.slot = sl;
    j.k.new_seed = rnd(&x);
    j.k.bad = 0;
    dmem_status_t st = dmem_launch_async(w->rt, s, &sl->h, 1, launch, &j);
    if (st == DMEM_OK) {
      if ((rnd(&x) & 3) == 0) {
        st = dmem_stream_release(w->rt, s);
        if (st == DMEM_OK) st = dmem_stream_synchronize(w->rt, s);
      } else {
        st = dmem_sync_and_unlock(w->rt, s);
      }
      if (st != DMEM_OK) fail_status(w, "sync", st);
      if (j.k.bad) {
        fprintf(stderr, "slot %td: %zu bad bytes\n", sl - w->slots, j.k.bad);
        atomic_fetch_add(&w->bad, 1);
      }
      sl->seed = j.k.new_seed;
      atomic_fetch_add(&w->uses, 1);
    } else if (st != DMEM_ERR_OUT_OF_MEMORY) {
      fail_status(w, "launch_async", st);
    }
    pthread_mutex_unlock(&sl->mu);
  }
  dmem_sync_and_unlock(w->rt, s);
  dmem_runtime_poll(w->rt);
  if (dmem_stream_destroy(w->rt, s) != DMEM_OK) abort();
  return NULL;
}

/* spills, unspills and evicts without taking the test's writer lock: the
 * runtime must keep moves and locks apart by itself */
static void *spiller(void *arg) {
  world_t *w = ((void **)arg)[0];
  uint64_t x = 99991;
  while (!atomic_load(&w->stop)) {
    slot_t *sl = &w->slots[rnd(&x) % NBUF];
    dmem_handle_t h = atomic_load_explicit(&sl->h_pub, memory_order_relaxed); /* may be stale */
    dmem_status_t st;
    switch (rnd(&x) % 4) {
      case 0: st = dmem_buffer_spill(w->rt, h, DMEM_TIER_HOST); break;
      case 1: st = dmem_buffer_spill(w->rt, h, DMEM_TIER_DISK); break;
      case 2: st = dmem_buffer_unspill(w->rt, h, NULL); break;
      default: {
        size_t freed;
        st = dmem_runtime_evict(w->rt, 64 * KiB, &freed);
      }
    }
    if (st == DMEM_OK) atomic_fetch_add(&w->spills, 1);
    else if (st != DMEM_ERR_BUSY && st != DMEM_ERR_STALE_HANDLE && st != DMEM_ERR_INVALID_ARGUMENT &&
             st != DMEM_ERR_OUT_OF_MEMORY)
      fail_status(w, "spiller", st);
  }
  return NULL;
}

/* frees and reallocates buffers (new sizes), which forces on-demand spills */
static void *churner(void *arg) {
  world_t *w = ((void **)arg)[0];
  uint64_t x = 424242;
  dmem_runtime_t *rt = w->rt;
  while (!atomic_load(&w->stop)) {
    slot_t *sl = &w->slots[rnd(&x) % NBUF];
    pthread_mutex_lock(&sl->mu);
    if (sl->live) {
      /* verify through a plain lock + copy before freeing */
      void *p;
      dmem_status_t st = dmem_buffer_lock(rt, sl->h, NULL, &p);
      if (st == DMEM_OK) {
        void *tmp = malloc(sl->size);
        dmem_stream_copy(rt, tmp, p, sl->size, NULL);
        dmem_stream_synchronize(rt, NULL);
        if (check_verify(tmp, sl->size, sl->seed)) atomic_fetch_add(&w->bad, 1);
        free(tmp);
        dmem_buffer_unlock(rt, sl->h);
      } else if (st != DMEM_ERR_OUT_OF_MEMORY) {
        fail_status(w, "churn lock", st);
      }
      if (dmem_buffer_free(rt, sl->h) != DMEM_OK) atomic_fetch_add(&w->errors, 1);
      sl->live = 0;
    }
    size_t size = (16 + rnd(&x) % 240) * KiB;
    dmem_handle_t h;
    dmem_status_t st = dmem_buffer_alloc(rt, size, 0, &h);
    if (st == DMEM_OK) {
      void *p, *tmp = malloc(size);
      uint64_t seed = rnd(&x);
      check_fill(tmp, size, seed);
      st = dmem_buffer_lock(rt, h, NULL, &p);
      if (st == DMEM_OK) {
        dmem_stream_copy(rt, p, tmp, size, NULL);
        dmem_stream_synchronize(rt, NULL);
        dmem_buffer_unlock(rt, h);
        sl->h = h;
        atomic_store_explicit(&sl->h_pub, h, memory_order_relaxed);
        sl->size = size;
        sl->seed = seed;
        sl->live = 1;
        atomic_fetch_add(&w->churn, 1);
      } else {
        dmem_buffer_free(rt, h);
      }
      free(tmp);
    } else if (st != DMEM_ERR_OUT_OF_MEMORY) {
      fail_status(w, "churn alloc", st);
    }
    pthread_mutex_unlock(&sl->mu);
  }
  return NULL;
}

TEST_CASE(threads_under_spilling_pressure) {
  /* 48 buffers of ~16-256 KiB (about 6 MiB) under a 2 MiB limit */
  dmem_runtime_t *rt;
  {
    dmem_config_t cfg;
    dmem_config_init(&cfg);
    if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
    cfg.device_limit = 2 << 20;
    cfg.host_limit = 3 << 20; /* the rest goes to disk */
    dmem_status_t st = dmem_runtime_create(&cfg, &rt);
    if (st == DMEM_ERR_NO_DEVICE) SKIP("no device");
    REQUIRE_OK(st);
  }
  static world_t w;
  memset(&w, 0, sizeof w);
  w.rt = rt;
  uint64_t x = 5;
  for (int i = 0; i < NBUF; i++) {
    slot_t *sl = &w.slots[i];
    pthread_mutex_init(&sl->mu, NULL);
    sl->size = (16 + rnd(&x) % 240) * KiB;
    sl->seed = rnd(&x);
    REQUIRE_OK(dmem_buffer_alloc(rt, sl->size, 0, &sl->h));
    atomic_store(&sl->h_pub, sl->h);
    void *p, *tmp = malloc(sl->size);
    check_fill(tmp, sl->size, sl->seed);
    REQUIRE_OK(dmem_buffer_lock(rt, sl->h, NULL, &p));
    dmem_stream_copy(rt, p, tmp, sl->size, NULL);
    dmem_stream_synchronize(rt, NULL);
    dmem_buffer_unlock(rt, sl->h);
    free(tmp);
    sl->live = 1;
  }
  enum { NT = NWORKERS + 2 };
  pthread_t t[NT];
  void *args[NT][2];
  for (int i = 0; i < NT; i++) {
    args[i][0] = &w;
    args[i][1] = (void *)(uintptr_t)(i + 1);
    void *(*fn)(void *) = i < NWORKERS ? worker : i == NWORKERS ? spiller : churner;
    pthread_create(&t[i], NULL, fn, args[i]);
  }
  const char *secs = getenv("DMEM_STRESS_SECONDS");
  struct timespec ts = {secs ? atoi(secs) : 3, 0};
  nanosleep(&ts, NULL);
  atomic_store(&w.stop, 1);
  for (int i = 0; i < NT; i++) pthread_join(t[i], NULL);

  /* verify every byte of every live buffer */
  long final_bad = 0;
  for (int i = 0; i < NBUF; i++) {
    slot_t *sl = &w.slots[i];
    if (!sl->live) continue;
    void *p, *tmp = malloc(sl->size);
    REQUIRE_OK(dmem_buffer_lock(rt, sl->h, NULL, &p));
    dmem_stream_copy(rt, tmp, p, sl->size, NULL);
    dmem_stream_synchronize(rt, NULL);
    dmem_buffer_unlock(rt, sl->h);
    if (check_verify(tmp, sl->size, sl->seed)) final_bad++;
    free(tmp);
    CHECK_OK(dmem_buffer_free(rt, sl->h));
    pthread_mutex_destroy(&sl->mu);
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  fprintf(stderr,
          "uses %ld, churn %ld, explicit moves %ld, spills %llu, unspills %llu, on-demand %llu, "
          "cancelled %llu, errors %ld, bad %ld, final bad %ld\n",
          atomic_load(&w.uses), atomic_load(&w.churn), atomic_load(&w.spills),
          (unsigned long long)s.spill_count, (unsigned long long)s.unspill_count,
          (unsigned long long)s.oom_evictions, (unsigned long long)s.cancelled_spills,
          atomic_load(&w.errors), atomic_load(&w.bad), final_bad);
  CHECK_EQ(atomic_load(&w.bad), 0);
  CHECK_EQ(final_bad, 0);
  CHECK_EQ(atomic_load(&w.errors), 0);
  CHECK_GT(atomic_load(&w.uses), 100);
  CHECK_GT(s.spill_count, 100);
  CHECK_GT(s.unspill_count, 100);
  CHECK_GT(s.oom_evictions, 10);
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  dmem_runtime_destroy(rt);
}
