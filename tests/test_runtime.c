/* The runtime as a whole: what fork() means for a runtime (runtime/api/fork.c).
 *
 * A child made by fork() has a copy of the parent's runtimes but none of
 * their threads, no device context, and maybe mutexes held for good by
 * parent threads that are not there: every call on an inherited runtime
 * returns DMEM_ERR_FORKED (dmem_buffer_unlock of a buffer not freed works on the
 * child's copy only; dmem_runtime_destroy releases nothing), no call hangs,
 * and the parent's buffers, statistics and data are as before. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* The sanitizers' own allocators are not fork-safe: ThreadSanitizer cannot
 * start threads in a child forked from a process with threads, and
 * AddressSanitizer's allocator can be forked with one of its locks held by
 * another thread (the child's first malloc then waits forever). The parts
 * of a child that make a new runtime are skipped under either; the default
 * build runs them. */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

static char spill_parent[512];

/* A host-backend runtime with every background thread there is: stream
 * workers, spill-ahead (at 95 %), and, once a buffer is on disk, the I/O
 * threads. */
static dmem_runtime_t *busy_runtime(size_t limit) {
  check_mkdtemp(spill_parent, sizeof spill_parent, "dmem-fork");
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = limit;
  cfg.spill_ahead = 0.95;
  cfg.spill_dir = spill_parent;
  return check_runtime_cfg(&cfg);
}

/* In the child: count the calls whose status is not the documented one. */
static int child_bad;
#define CHILD_EXPECT(expr, want)                                                          \
  do {                                                                                    \
    dmem_status_t got_ = (expr);                                                          \
    if (got_ != (want)) {                                                                 \
      fprintf(stderr, "child: %s: got %s, want %s (%s)\n", #expr, dmem_status_name(got_), \
              dmem_status_name(want), dmem_last_error_detail());                         \
      child_bad++;                                                                        \
    }                                                                                     \
  } while (0)

static atomic_int launches;
static dmem_status_t count_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)user, (void)s, (void)ptrs, (void)n;
  atomic_fetch_add(&launches, 1);
  return DMEM_OK;
}

/* A host function that holds its stream until the gate opens: a stream
 * release is still pending when the parent forks. */
static atomic_int gate;
static void wait_gate(void *user) {
  (void)user;
  while (!atomic_load(&gate)) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}
static void nop(void *user) { (void)user; }

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}
static unsigned locks_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return 999;
  return info.lock_count;
}

/* Wait for the child (it has its own alarm), return its exit code or -signal. */
static int wait_child(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1000;
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1001;
}

/* Every public call on the inherited runtime, in the child. */
static void child_calls(dmem_runtime_t *rt, dmem_handle_t hr, dmem_handle_t hh,
                        dmem_handle_t hd, dmem_handle_t hl, dmem_handle_t hf, void *raw,
                        dmem_stream_t s, dmem_stream_t s2) {
  dmem_handle_t h = 0;
  void *p = NULL;
  dmem_buffer_info_t info;
  dmem_stats_t stats;
  unsigned char host[64] = {0}, ipc[DMEM_IPC_HANDLE_SIZE];
  size_t n = 0, off = 0;
  dmem_stream_t s3 = NULL;
  CHILD_EXPECT(dmem_buffer_alloc(rt, 4 * KiB, 0, &h), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_free(rt, hr), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_info(rt, hr, &info), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_set_priority(rt, hr, 5), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_lock(rt, hr, NULL, &p), DMEM_ERR_FORKED); /* resident: the fast path */
  CHILD_EXPECT(dmem_buffer_lock(rt, hh, NULL, &p), DMEM_ERR_FORKED); /* spilled: the retrieve */
  CHILD_EXPECT(dmem_buffer_lock(rt, hd, s, &p), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_read(rt, hr, 0, host, 16), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_read(rt, hh, 0, host, 16), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_read(rt, hd, 0, host, 16), DMEM_ERR_FORKED);
  /* unlock writes the child's own copy of the lock count, nothing else */
  CHILD_EXPECT(dmem_buffer_unlock(rt, hl), DMEM_OK);
  CHILD_EXPECT(dmem_buffer_unlock(rt, hl), DMEM_ERR_NOT_LOCKED);
  /* ... but the last unlock of a freed buffer would reclaim it: refused */
  CHILD_EXPECT(dmem_buffer_unlock(rt, hf), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_lock_and_launch(rt, NULL, 0, count_launch, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_lock_and_launch(rt, &hr, 1, count_launch, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_launch_async(rt, s, &hr, 1, count_launch, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_sync_and_unlock(rt, s), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_release(rt, s2), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_create(rt, &s3), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_destroy(rt, s), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_synchronize(rt, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_synchronize(rt, s2), DMEM_ERR_FORKED); /* blocked in the parent */
  CHILD_EXPECT(dmem_stream_enqueue_host(rt, s, nop, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_copy(rt, host, host + 32, 16, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_spill(rt, hr, DMEM_TIER_HOST), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_unspill(rt, hh, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_buffer_prefetch(rt, &hd, 1, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_runtime_evict(rt, MiB, &n), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stats(rt, &stats), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_controller_set(rt, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_device_malloc(rt, 4 * KiB, NULL, &p), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_device_free(rt, raw, NULL), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_stream_forget(rt, s), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_device_memory_info(rt, &n, &off), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_device_ipc_handle(rt, raw, ipc, &off), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_device_trim(rt, 0, &n), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_host_trim(rt, 0, &n), DMEM_ERR_FORKED);
  CHILD_EXPECT(dmem_runtime_poll(rt), DMEM_ERR_FORKED);
  if (atomic_load(&launches) != 0) {
    fprintf(stderr, "child: a launch function ran\n");
    child_bad++;
  }
  if (h != 0 || s3 != NULL || n != 0 || off != 0) {
    fprintf(stderr, "child: an output was written by a refused call\n");
    child_bad++;
  }
  if (dmem_runtime_backend(rt) != DMEM_BACKEND_HOST && dmem_runtime_backend(rt) != DMEM_BACKEND_CUDA) {
    fprintf(stderr, "child: dmem_runtime_backend\n");
    child_bad++;
  }
  dmem_runtime_destroy(rt); /* releases nothing; must return */
}

TEST_CASE(forked_child_gets_forked_status) {
  dmem_runtime_t *rt = busy_runtime(8 * MiB);
  const size_t sz = 256 * KiB;
  dmem_handle_t hr, hh, hd, hl, hf, ha;
  REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &hr)); /* resident */
  REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &hh)); /* in the host tier */
  REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &hd)); /* on disk */
  REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &hl)); /* locked by the parent */
  REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &hf)); /* freed while locked */
  REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &ha)); /* registered on s */
  check_put(rt, hr, sz, 1);
  check_put(rt, hh, sz, 2);
  check_put(rt, hd, sz, 3);
  check_put(rt, hl, sz, 4);
  check_put(rt, ha, sz, 5);
  REQUIRE_OK(dmem_buffer_spill(rt, hh, DMEM_TIER_HOST));
  REQUIRE_OK(dmem_buffer_spill(rt, hd, DMEM_TIER_DISK));
  void *pl, *pf, *raw;
  REQUIRE_OK(dmem_buffer_lock(rt, hl, NULL, &pl));
  REQUIRE_OK(dmem_buffer_lock(rt, hf, NULL, &pf));
  REQUIRE_OK(dmem_buffer_free(rt, hf));
  REQUIRE_OK(dmem_device_malloc(rt, 64 * KiB, NULL, &raw));
  dmem_stream_t s, s2;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  REQUIRE_OK(dmem_stream_create(rt, &s2));
  REQUIRE_OK(dmem_launch_async(rt, s, &ha, 1, count_launch, NULL));
  /* a release pending at the fork: s2 is held by a host function */
  atomic_store(&gate, 0);
  REQUIRE_OK(dmem_stream_enqueue_host(rt, s2, wait_gate, NULL));
  REQUIRE_OK(dmem_launch_async(rt, s2, &hr, 1, count_launch, NULL));
  REQUIRE_OK(dmem_stream_release(rt, s2));
  atomic_store(&launches, 0);
  dmem_stats_t before, after;
  REQUIRE_OK(dmem_stats(rt, &before));

  pid_t pid = fork();
  REQUIRE_TRUE(pid >= 0);
  if (pid == 0) {
    alarm(30); /* a hang is a failure, not a stuck test */
    child_calls(rt, hr, hh, hd, hl, hf, raw, s, s2);
    if (!UNDER_SANITIZER) {
      /* the child's own runtime works (on the host backend: CUDA itself
       * cannot be used in a child of a process that used it) */
      dmem_config_t cfg;
      dmem_config_init(&cfg);
      cfg.backend = DMEM_BACKEND_HOST;
      cfg.spill_ahead = 0;
      cfg.device_limit = 4 * MiB;
      dmem_runtime_t *mine = NULL;
      CHILD_EXPECT(dmem_runtime_create(&cfg, &mine), DMEM_OK);
      if (!mine) _exit(99);
      dmem_handle_t h;
      CHILD_EXPECT(dmem_buffer_alloc(mine, sz, 0, &h), DMEM_OK);
      check_put(mine, h, sz, 9);
      CHILD_EXPECT(dmem_buffer_spill(mine, h, DMEM_TIER_HOST), DMEM_OK);
      if (check_bad_bytes(mine, h, sz, 9) != 0) child_bad++;
      CHILD_EXPECT(dmem_buffer_free(mine, h), DMEM_OK);
      dmem_runtime_destroy(mine);
    }
    _exit(child_bad > 100 ? 100 : child_bad);
  }
  CHECK_EQ(wait_child(pid), 0);

  /* the parent: as it was */
  REQUIRE_OK(dmem_stats(rt, &after));
  CHECK_UEQ(after.buffer_count, before.buffer_count);
  CHECK_UEQ(after.device_used, before.device_used);
  CHECK_UEQ(after.raw_used, before.raw_used);
  CHECK_UEQ(after.host_used, before.host_used);
  CHECK_UEQ(after.disk_used, before.disk_used);
  CHECK_UEQ(after.spill_count, before.spill_count);
  CHECK_UEQ(after.unspill_count, before.unspill_count);
  CHECK_EQ(state_of(rt, hh), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, hd), DMEM_STATE_DEFERRED_DISK);
  CHECK_EQ(locks_of(rt, hl), 1);
  CHECK_EQ(locks_of(rt, hr), 1); /* the pending release */
  CHECK_EQ(locks_of(rt, ha), 1);
  /* the pending release completes as usual */
  atomic_store(&gate, 1);
  CHECK_OK(dmem_stream_synchronize(rt, s2));
  CHECK_EQ(locks_of(rt, hr), 0);
  CHECK_OK(dmem_sync_and_unlock(rt, s));
  CHECK_EQ(locks_of(rt, ha), 0);
  CHECK_OK(dmem_buffer_unlock(rt, hl));
  CHECK_OK(dmem_buffer_unlock(rt, hf)); /* reclaimed here, in the parent */
  CHECK_STATUS(dmem_buffer_info(rt, hf, &(dmem_buffer_info_t){0}), DMEM_ERR_STALE_HANDLE);
  CHECK_UEQ(check_bad_bytes(rt, hr, sz, 1), 0);
  CHECK_UEQ(check_bad_bytes(rt, hh, sz, 2), 0);
  CHECK_UEQ(check_bad_bytes(rt, hd, sz, 3), 0);
  CHECK_UEQ(check_bad_bytes(rt, hl, sz, 4), 0);
  CHECK_UEQ(check_bad_bytes(rt, ha, sz, 5), 0);
  CHECK_OK(dmem_device_free(rt, raw, NULL));
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_stream_destroy(rt, s2));
  dmem_handle_t all[] = {hr, hh, hd, hl, ha};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) CHECK_OK(dmem_buffer_free(rt, all[i]));
  CHECK_OK(dmem_stats(rt, &after));
  CHECK_UEQ(after.buffer_count, 0);
  CHECK_UEQ(after.device_used, 0);
  dmem_runtime_destroy(rt);
  CHECK_EQ(rmdir(spill_parent), 0); /* the spill directory went with destroy */
}

/* ---- forks while other threads use the runtime ------------------------------------ */

typedef struct worker {
  dmem_runtime_t *rt;
  dmem_handle_t h[4];
  size_t size;
  atomic_int *stop;
  long rounds;
  int bad;
} worker_t;

/* Spill, lock, unlock, allocate and free as fast as possible: at any fork,
 * some mutex or TRANSIT bit is likely held by this thread. */
static void *work(void *arg) {
  worker_t *w = arg;
  while (!atomic_load(w->stop)) {
    for (int i = 0; i < 4; i++) {
      void *p;
      dmem_status_t st = dmem_buffer_spill(w->rt, w->h[i], (i & 1) ? DMEM_TIER_DISK : DMEM_TIER_HOST);
      if (st != DMEM_OK && st != DMEM_ERR_BUSY) w->bad++;
      if (dmem_buffer_lock(w->rt, w->h[i], NULL, &p) != DMEM_OK) w->bad++;
      else if (dmem_buffer_unlock(w->rt, w->h[i]) != DMEM_OK) w->bad++;
      dmem_handle_t t;
      if (dmem_buffer_alloc(w->rt, 8 * KiB, 0, &t) == DMEM_OK) (void)dmem_buffer_free(w->rt, t);
      dmem_stats_t s;
      (void)dmem_stats(w->rt, &s);
    }
    w->rounds++;
  }
  return NULL;
}

TEST_CASE(fork_while_threads_use_the_runtime) {
  enum { THREADS = 2, FORKS = 12 };
  dmem_runtime_t *rt = busy_runtime(16 * MiB);
  const size_t sz = 128 * KiB;
  atomic_int stop = 0;
  worker_t w[THREADS];
  pthread_t t[THREADS];
  for (int k = 0; k < THREADS; k++) {
    w[k] = (worker_t){.rt = rt, .size = sz, .stop = &stop};
    for (int i = 0; i < 4; i++) {
      REQUIRE_OK(dmem_buffer_alloc(rt, sz, 0, &w[k].h[i]));
      check_put(rt, w[k].h[i], sz, (uint64_t)(10 * k + i + 1));
    }
    REQUIRE_EQ(pthread_create(&t[k], NULL, work, &w[k]), 0);
  }
  int children_ok = 0;
  for (int f = 0; f < FORKS; f++) {
    struct timespec ts = {0, 3000000};
    nanosleep(&ts, NULL);
    pid_t pid = fork();
    REQUIRE_TRUE(pid >= 0);
    if (pid == 0) {
      alarm(20);
      void *p;
      dmem_handle_t h = w[0].h[f % 4];
      dmem_stats_t s;
      CHILD_EXPECT(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_FORKED);
      CHILD_EXPECT(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_FORKED);
      CHILD_EXPECT(dmem_buffer_alloc(rt, sz, 0, &h), DMEM_ERR_FORKED);
      CHILD_EXPECT(dmem_buffer_free(rt, w[1].h[0]), DMEM_ERR_FORKED);
      CHILD_EXPECT(dmem_stats(rt, &s), DMEM_ERR_FORKED);
      CHILD_EXPECT(dmem_stream_synchronize(rt, NULL), DMEM_ERR_FORKED);
      CHILD_EXPECT(dmem_runtime_evict(rt, sz, NULL), DMEM_ERR_FORKED);
      dmem_runtime_destroy(rt);
      _exit(child_bad > 100 ? 100 : child_bad);
    }
    int rc = wait_child(pid);
    CHECK_EQ(rc, 0);
    children_ok += rc == 0;
  }
  atomic_store(&stop, 1);
  for (int k = 0; k < THREADS; k++) {
    pthread_join(t[k], NULL);
    CHECK_EQ(w[k].bad, 0);
    CHECK_GT(w[k].rounds, 0);
    for (int i = 0; i < 4; i++) {
      CHECK_UEQ(check_bad_bytes(rt, w[k].h[i], sz, (uint64_t)(10 * k + i + 1)), 0);
      CHECK_OK(dmem_buffer_free(rt, w[k].h[i]));
    }
  }
  CHECK_EQ(children_ok, FORKS);
  dmem_runtime_destroy(rt);
  CHECK_EQ(rmdir(spill_parent), 0);
}
