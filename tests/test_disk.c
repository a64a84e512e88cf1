/* The disk tier: the host limit and its LRU push-down to disk on the I/O
 * threads, a lock of a disk-tier buffer going straight to the device,
 * permissions and unnamed files, I/O failures (a deterministic injection
 * hook) leaving the buffer intact where it was, nothing left after SIGKILL,
 * O_DIRECT and its fallback, and locks racing push-downs and retrieves.
 *
 * White-box where it must be: the failure hook (dmem__disk_hook_set) and
 * waiting for the I/O threads (dmem__io_quiesce) are internal. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "runtime/api/api.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

static dmem_runtime_t *runtime_with_policy(size_t limit, size_t host_limit, double host_burst,
                                           const char *spill_dir, dmem_eviction_policy_t policy) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.eviction_policy = policy;
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = limit;
  cfg.host_limit = host_limit;
  cfg.host_burst = host_burst;
  cfg.spill_dir = spill_dir;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) SKIP("no device");
  if (st != DMEM_OK) abort();
  return rt;
}

static dmem_runtime_t *runtime_with_burst(size_t limit, size_t host_limit, double host_burst,
                                          const char *spill_dir) {
  return runtime_with_policy(limit, host_limit, host_burst, spill_dir, DMEM_EVICTION_DEFAULT);
}

static dmem_runtime_t *runtime_with(size_t limit, size_t host_limit, const char *spill_dir) {
  return runtime_with_burst(limit, host_limit, DMEM_HOST_BURST_DEFAULT, spill_dir);
}

static dmem_stats_t stats_of(dmem_runtime_t *rt) {
  dmem_stats_t s;
  memset(&s, 0, sizeof s);
  if (dmem_stats(rt, &s) != DMEM_OK) abort();
  return s;
}

static void touch(dmem_runtime_t *rt, dmem_handle_t h) {
  void *p;
  if (dmem_buffer_lock(rt, h, NULL, &p) != DMEM_OK || dmem_buffer_unlock(rt, h) != DMEM_OK) abort();
}

/* A fresh parent directory for spill_dir (removed by rm_tree). */
static void make_parent(char *buf, size_t n) {
  check_mkdtemp(buf, n, "dmem-disk-test-");
}

/* Regular files (and their bytes) anywhere under dir. */
static int count_files(const char *dir, long long *bytes) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    struct stat st;
    if (lstat(path, &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      n += count_files(path, bytes);
    } else {
      n++;
      if (bytes) *bytes += st.st_size;
    }
  }
  closedir(d);
  return n;
}

static int count_entries(const char *dir, char *first, size_t n) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int count = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    if (count == 0 && first) snprintf(first, n, "%s/%s", dir, e->d_name);
    count++;
  }
  closedir(d);
  return count;
}

static void rm_tree(const char *dir) {
  DIR *d = opendir(dir);
  if (d) {
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
      char path[1024];
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      struct stat st;
      if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        chmod(path, 0700);
        rm_tree(path);
      } else {
        unlink(path);
      }
    }
    closedir(d);
  }
  rmdir(dir);
}

/* ---- the failure hook ------------------------------------------------------------ */

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  dmem__disk_op_t op; /* the operation to act on */
  uint64_t min_off;   /* ... at or past this file offset */
  long skip;          /* let this many matching calls through first */
  long fail;          /* then fail this many (-1: all) */
  int err;            /* with this errno */
  long calls, failed; /* matching calls seen, failed */
  int gate_closed;    /* matching calls wait while set */
  int entered;        /* a call waited at the gate */
} hook_t;

static hook_t the_hook;

static int hook_fn(void *user, dmem__disk_op_t op, uint64_t off, size_t len) {
  (void)len;
  hook_t *k = user;
  int ret = 0;
  pthread_mutex_lock(&k->mu);
  if (op == k->op && off >= k->min_off) {
    while (k->gate_closed) {
      k->entered = 1;
      pthread_cond_broadcast(&k->cv);
      pthread_cond_wait(&k->cv, &k->mu);
    }
    if (k->calls++ >= k->skip && (k->fail < 0 || k->failed < k->fail)) {
      k->failed++;
      ret = k->err;
    }
  }
  pthread_mutex_unlock(&k->mu);
  return ret;
}

static hook_t *hook_on(dmem__disk_op_t op, long skip, long fail, int err) {
  hook_t *k = &the_hook;
  dmem__disk_hook_set(NULL, NULL);
  pthread_mutex_init(&k->mu, NULL);
  pthread_cond_init(&k->cv, NULL);
  k->op = op;
  k->min_off = 0;
  k->skip = skip;
  k->fail = fail;
  k->err = err;
  k->calls = k->failed = 0;
  k->gate_closed = k->entered = 0;
  dmem__disk_hook_set(hook_fn, k);
  return k;
}

static void hook_off(void) { dmem__disk_hook_set(NULL, NULL); }

/* ---- the host limit and its push-down ------------------------------------------------ */

/* Under DMEM_EVICTION_LRU the push-down takes the least recently unlocked
 * host-tier buffer first (under the default policy, the one whose last use
 * the policy saw longest ago, in victims taken: these unlocks, with no
 * eviction pass between them, would tie). */
TEST_CASE(pushdown_moves_least_recently_used_first) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt =
      runtime_with_policy(16 * MiB, 2 * MiB, DMEM_HOST_BURST_DEFAULT, parent, DMEM_EVICTION_LRU);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 100 + (uint64_t)i);
  }
  /* use order 1, 0, 2, 3: h[1] least recently used, though spilled second */
  touch(rt, h[1]);
  touch(rt, h[0]);
  touch(rt, h[2]);
  touch(rt, h[3]);
  CHECK_OK(dmem_buffer_spill(rt, h[0], DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, h[1], DMEM_TIER_HOST));
  dmem__io_quiesce(rt->io);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.host_used, 2 * MiB); /* at the limit, not past it: nothing moves */
  CHECK_UEQ(s.host_to_disk_count, 0);
  /* past the limit: the spill itself goes to the host tier, and the least
   * recently used host-tier buffer goes down */
  CHECK_OK(dmem_buffer_spill(rt, h[2], DMEM_TIER_HOST));
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_DEFERRED_HOST);
  dmem__io_quiesce(rt->io);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_DEFERRED_DISK);
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_DEFERRED_HOST);
  s = stats_of(rt);
  CHECK_UEQ(s.host_used, 2 * MiB);
  CHECK_UEQ(s.disk_used, MiB);
  CHECK_UEQ(s.host_to_disk_pushdowns, 1);
  /* priority first, then LRU: h[0] (older than h[2]) is kept by its priority */
  CHECK_OK(dmem_buffer_set_priority(rt, h[0], 10));
  CHECK_OK(dmem_buffer_spill(rt, h[3], DMEM_TIER_HOST));
  dmem__io_quiesce(rt->io);
  CHECK_EQ(state_of(rt, h[2]), DMEM_STATE_DEFERRED_DISK);
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_DEFERRED_HOST);
  s = stats_of(rt);
  CHECK_UEQ(s.host_used, 2 * MiB);
  CHECK_UEQ(s.disk_used, 2 * MiB);
  CHECK_UEQ(s.host_to_disk_count, 2);
  CHECK_UEQ(s.host_to_disk_pushdowns, 2);
  CHECK_UEQ(s.host_to_disk_bytes, 2 * MiB);
  CHECK_TRUE(s.seconds_host_to_disk > 0);
  CHECK_UEQ(s.disk_write_failures, 0);
  /* a lock of a disk-tier buffer brings it straight to the device: it
   * never becomes a host-tier copy */
  CHECK_UEQ(check_bad_bytes(rt, h[1], MiB, 101), 0);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_RESIDENT);
  s = stats_of(rt);
  CHECK_UEQ(s.host_used, 2 * MiB);
  CHECK_UEQ(s.disk_used, MiB);
  CHECK_UEQ(s.disk_to_device_count, 1);
  CHECK_UEQ(s.disk_to_device_bytes, MiB);
  CHECK_TRUE(s.seconds_disk_to_device > 0);
  for (int i = 0; i < 4; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 100 + (uint64_t)i), 0);
  s = stats_of(rt);
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  CHECK_UEQ(s.disk_to_device_count, 2);
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
  CHECK_EQ(count_entries(parent, NULL, 0), 0);
  rm_tree(parent);
}

/* On-demand spilling under a device limit feeds the host tier, and the
 * push-down keeps the host tier at its limit: every byte survives. */
TEST_CASE(on_demand_spills_feed_the_pushdown) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(4 * MiB, 2 * MiB, parent);
  enum { N = 12 };
  dmem_handle_t h[N];
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i])); /* spills the oldest as it goes */
    check_put(rt, h[i], MiB, 200 + (uint64_t)i);
  }
  dmem__io_quiesce(rt->io);
  dmem_stats_t s = stats_of(rt);
  CHECK_LE(s.host_used, 2 * MiB);
  CHECK_GE(s.disk_used, (N - 4 - 2) * MiB);
  CHECK_UEQ(s.device_used + s.host_used + s.disk_used, N * MiB);
  CHECK_GE(s.host_to_disk_pushdowns, 1);
  for (int i = 0; i < N; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 200 + (uint64_t)i), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  /* a buffer freed while a push-down writes it is reclaimed when that
   * write ends, on its I/O thread */
  dmem__io_quiesce(rt->io);
  s = stats_of(rt);
  CHECK_UEQ(s.host_used + s.disk_used, 0);
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* ---- data and I/O paths ----------------------------------------------------------------- */

static void sizes_round_trip(bool force_buffered) {
  char parent[64];
  make_parent(parent, sizeof parent);
  if (force_buffered) hook_on(DMEM__DISK_OP_DIRECT, 0, -1, EINVAL);
  dmem_runtime_t *rt = runtime_with(96 * MiB, 0, parent);
  /* odd sizes and odd host addresses take the bounce path under O_DIRECT;
   * 20 MiB + 1 is three chunks, shared with the I/O threads */
  const size_t sizes[] = {1, 4095, 4096, 4097, 3 * MiB + 5, 20 * MiB + 1};
  enum { NS = sizeof sizes / sizeof sizes[0] };
  dmem_handle_t h[NS];
  for (int i = 0; i < NS; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sizes[i], 0, &h[i]));
    check_put(rt, h[i], sizes[i], 300 + (uint64_t)i);
  }
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < NS; i++) {
      if (round == 1) CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST)); /* then host -> disk */
      CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_DISK));
      CHECK_EQ(state_of(rt, h[i]), DMEM_STATE_DEFERRED_DISK);
    }
    for (int i = 0; i < NS; i++)
      CHECK_UEQ(check_bad_bytes(rt, h[i], sizes[i], 300 + (uint64_t)i), 0);
  }
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.host_to_disk_count, 2 * NS);
  CHECK_UEQ(s.disk_to_device_count, 2 * NS);
  CHECK_UEQ(s.disk_used, 0);
  if (force_buffered) CHECK_UEQ(s.disk_direct_io, 0);
  fprintf(stderr, "disk tier in %s: %s I/O\n", parent, s.disk_direct_io ? "direct" : "buffered");
  for (int i = 0; i < NS; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
  hook_off();
  rm_tree(parent);
}

TEST_CASE(odd_sizes_round_trip) { sizes_round_trip(false); }

TEST_CASE(filesystem_without_o_direct_is_used_buffered) { sizes_round_trip(true); }

/* The pinned pool's pageable fallback (runtime/memory/hostpool.c): host
 * blocks taken outside the pinned chunks (as when the pool is busy pinning
 * a chunk under CUDA) carry spills to the host tier, staging for disk
 * writes and reads, and in-place reads, and go back to the C heap when
 * freed. Forced here for every block; under CUDA this is the D2H/H2D copy
 * into and out of pageable memory. */
TEST_CASE(pageable_host_blocks_carry_spills) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(96 * MiB, 0, parent);
  dmem__hostpool_set_pageable_only(rt->hostpool, true);
  const size_t sizes[] = {4097, 3 * MiB + 5, 20 * MiB + 1};
  enum { NS = sizeof sizes / sizeof sizes[0] };
  dmem_handle_t h[NS];
  for (int i = 0; i < NS; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sizes[i], 0, &h[i]));
    check_put(rt, h[i], sizes[i], 500 + (uint64_t)i);
  }
  for (int i = 0; i < NS; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST));
  dmem_stats_t s = stats_of(rt);
  CHECK_GE(s.host_pageable_used, s.host_used);
  CHECK_GE(s.host_pageable_allocs, NS);
  CHECK_UEQ(s.host_pool_reserved, 0); /* nothing was pinned */
  /* read where they are, then host -> disk, read again, back to the device */
  for (int i = 0; i < NS; i++) {
    uint8_t probe[64];
    CHECK_OK(dmem_buffer_read(rt, h[i], sizes[i] / 2, probe, sizeof probe < sizes[i] / 2 ? sizeof probe : 1));
    CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_DISK));
    CHECK_EQ(state_of(rt, h[i]), DMEM_STATE_DEFERRED_DISK);
    CHECK_OK(dmem_buffer_read(rt, h[i], 0, probe, 1));
  }
  for (int i = 0; i < NS; i++)
    CHECK_UEQ(check_bad_bytes(rt, h[i], sizes[i], 500 + (uint64_t)i), 0);
  /* device -> disk straight, through pageable staging, and back */
  for (int i = 0; i < NS; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_DISK));
  for (int i = 0; i < NS; i++)
    CHECK_UEQ(check_bad_bytes(rt, h[i], sizes[i], 500 + (uint64_t)i), 0);
  dmem__hostpool_set_pageable_only(rt->hostpool, false);
  for (int i = 0; i < NS; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  s = stats_of(rt);
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.host_pageable_used, 0); /* every pageable block went back */
  CHECK_GE(s.host_pageable_allocs, 3 * NS);
  /* a buffer left in a pageable host block at destroy goes with it (the
   * asan preset's leak check would see it otherwise) */
  dmem__hostpool_set_pageable_only(rt->hostpool, true);
  dmem_handle_t left;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &left));
  check_put(rt, left, MiB, 600);
  CHECK_OK(dmem_buffer_spill(rt, left, DMEM_TIER_HOST));
  CHECK_GE(stats_of(rt).host_pageable_used, MiB);
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* The filesystem takes O_DIRECT at fcntl but rejects direct writes: the
 * first EINVAL turns the file buffered and the write is done again. */
TEST_CASE(direct_write_rejected_falls_back) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(16 * MiB, 0, parent);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &h));
  check_put(rt, h, 2 * MiB, 7);
  hook_on(DMEM__DISK_OP_WRITE, 0, 1, EINVAL);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  hook_off();
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.disk_direct_io, 0);
  CHECK_UEQ(s.disk_write_failures, 0);
  CHECK_UEQ(check_bad_bytes(rt, h, 2 * MiB, 7), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* ---- permissions, unnamed files -------------------------------------------------------- */

TEST_CASE(spill_files_unnamed_and_private) {
  char parent[64];
  make_parent(parent, sizeof parent);
  mode_t old = umask(0777); /* dmem sets 0700 / 0600 itself, whatever the umask */
  dmem_runtime_t *rt = runtime_with(8 * MiB, 0, parent);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 3);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  umask(old);
  /* the data is in an unnamed file, and the private directory it was made
   * in is gone already: nothing under the parent has a name */
  CHECK_EQ(count_entries(parent, NULL, 0), 0);
  char sub[512];
  snprintf(sub, sizeof sub, "%s/dmem-spill-", parent);
  /* find that file among our descriptors */
  int found = 0;
  DIR *fds = opendir("/proc/self/fd");
  REQUIRE_TRUE(fds != NULL);
  struct dirent *e;
  while ((e = readdir(fds)) != NULL) {
    char link[300], target[1024];
    snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (strncmp(target, sub, strlen(sub)) != 0) continue;
    struct stat fst;
    if (fstat(atoi(e->d_name), &fst) != 0 || !S_ISREG(fst.st_mode)) continue;
    found++;
    CHECK_EQ(fst.st_mode & 0777, 0600);
    CHECK_EQ(fst.st_nlink, 0);
    CHECK_GE(fst.st_size, (long long)MiB);
  }
  closedir(fds);
  CHECK_EQ(found, 1);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 3), 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  dmem_runtime_destroy(rt); /* closes the file */
  CHECK_EQ(count_entries(parent, NULL, 0), 0);
  rm_tree(parent);
}

/* A spill_dir that cannot hold the spill directory: DMEM_ERR_IO naming it,
 * and the buffer stays where it was. */
/* dmem_runtime_create refuses an unusable spill directory (DMEM_ERR_IO); one
 * spoiled after creation (`spoil`) fails the disk tier's first use, and
 * nothing moves. */
static void check_unusable_dir(const char *dir, const char *words, void (*spoil)(const char *)) {
  REQUIRE_EQ(mkdir(dir, 0700), 0);
  dmem_runtime_t *rt = runtime_with(8 * MiB, 0, dir);
  spoil(dir);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = dmem_runtime_backend(rt);
  cfg.spill_dir = dir;
  dmem_runtime_t *rt2 = NULL;
  if (geteuid() != 0 || strcmp(words, "not writable") != 0) { /* root may write anywhere */
    CHECK_STATUS(dmem_runtime_create(&cfg, &rt2), DMEM_ERR_IO);
    CHECK_TRUE(strstr(dmem_last_error_detail(), dir) != NULL);
    CHECK_TRUE(rt2 == NULL);
  }
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  check_put(rt, h, MiB, 8);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_IO);
  CHECK_TRUE(strstr(dmem_last_error_detail(), dir) != NULL);
  CHECK_TRUE(strstr(dmem_last_error_detail(), words) != NULL);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 8), 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_IO);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.host_used, MiB);
  CHECK_UEQ(s.disk_used, 0);
  CHECK_UEQ(check_bad_bytes(rt, h, MiB, 8), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* a regular file where the directory was */
static void spoil_file(const char *dir) {
  if (rmdir(dir) != 0) abort();
  int fd = open(dir, O_CREAT | O_WRONLY, 0600);
  if (fd < 0) abort();
  close(fd);
}
static void spoil_remove(const char *dir) {
  if (rmdir(dir) != 0) abort();
}
/* no write permission (root writes anyway: then the hook stands in for the
 * kernel's EACCES) */
static void spoil_readonly(const char *dir) {
  if (chmod(dir, 0500) != 0) abort();
  if (geteuid() == 0) hook_on(DMEM__DISK_OP_DIR, 0, -1, EACCES);
}

TEST_CASE(spill_dir_not_writable) {
  char parent[64], path[128];
  make_parent(parent, sizeof parent);
  snprintf(path, sizeof path, "%s/file", parent);
  check_unusable_dir(path, "not usable", spoil_file);
  snprintf(path, sizeof path, "%s/gone", parent);
  check_unusable_dir(path, "not usable", spoil_remove);
  snprintf(path, sizeof path, "%s/readonly", parent);
  check_unusable_dir(path, "not writable", spoil_readonly);
  hook_off();
  CHECK_EQ(count_entries(path, NULL, 0), 0);
  rm_tree(parent);
}

/* ---- failed I/O leaves the buffer intact where it was -------------------------------- */

TEST_CASE(failed_write_keeps_buffer) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(64 * MiB, 0, parent);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 20 * MiB, 0, &h));
  check_put(rt, h, 20 * MiB, 11);
  /* disk full when the extent is reserved: device -> disk */
  hook_on(DMEM__DISK_OP_ALLOC, 0, -1, ENOSPC);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_IO);
  CHECK_TRUE(strstr(dmem_last_error_detail(), strerror(ENOSPC)) != NULL);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, 20 * MiB, 11), 0);
  /* an I/O error in the second chunk: host -> disk */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  hook_t *k = hook_on(DMEM__DISK_OP_WRITE, 0, -1, EIO);
  pthread_mutex_lock(&k->mu);
  k->min_off = 8 * MiB;
  pthread_mutex_unlock(&k->mu);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_DISK), DMEM_ERR_IO);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "pwrite") != NULL);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_HOST);
  hook_off();
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.disk_write_failures, 2);
  CHECK_UEQ(s.host_to_disk_count, 0);
  CHECK_UEQ(s.disk_used, 0);
  CHECK_UEQ(s.host_used, 20 * MiB);
  CHECK_UEQ(check_bad_bytes(rt, h, 20 * MiB, 11), 0);
  /* and the disk works again */
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  CHECK_UEQ(check_bad_bytes(rt, h, 20 * MiB, 11), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

TEST_CASE(failed_pushdown_keeps_host_copy) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(16 * MiB, 2 * MiB, parent);
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 400 + (uint64_t)i);
  }
  hook_on(DMEM__DISK_OP_WRITE, 0, -1, EIO);
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST));
  dmem__io_quiesce(rt->io);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.host_used, 3 * MiB); /* past the limit: the push-down failed */
  CHECK_GE(s.disk_write_failures, 1);
  CHECK_UEQ(s.host_to_disk_count, 0);
  for (int i = 0; i < 3; i++) CHECK_EQ(state_of(rt, h[i]), DMEM_STATE_DEFERRED_HOST);
  /* half the limit past it: the next spill goes straight to disk, which
   * fails too, and the buffer stays on the device */
  CHECK_STATUS(dmem_buffer_spill(rt, h[3], DMEM_TIER_HOST), DMEM_ERR_IO);
  CHECK_EQ(state_of(rt, h[3]), DMEM_STATE_RESIDENT);
  hook_off();
  /* the disk is back: that spill works, and the push-down catches up */
  CHECK_OK(dmem_buffer_spill(rt, h[3], DMEM_TIER_HOST));
  dmem__io_quiesce(rt->io);
  s = stats_of(rt);
  CHECK_LE(s.host_used, 2 * MiB);
  CHECK_UEQ(s.host_used + s.disk_used, 4 * MiB);
  CHECK_GE(s.host_to_disk_pushdowns, 1);
  for (int i = 0; i < 4; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 400 + (uint64_t)i), 0);
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* host_burst sets how far past host_limit the tier may grow while the
 * push-down is behind (here: failing): 0 is the limit itself, a quarter is
 * one more 1 MiB buffer on a 4 MiB limit; past it a spill goes straight to
 * disk (which fails here, leaving the buffer resident). */
TEST_CASE(host_burst_bounds_the_host_tier) {
  static const struct { double burst; int admitted; } rows[] = {{0, 4}, {0.25, 5}, {0.5, 6}};
  for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
    char parent[64];
    make_parent(parent, sizeof parent);
    dmem_runtime_t *rt = runtime_with_burst(16 * MiB, 4 * MiB, rows[r].burst, parent);
    dmem_handle_t h[8];
    for (int i = 0; i < 8; i++) {
      REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
      check_put(rt, h[i], MiB, 700 + (uint64_t)i);
    }
    hook_on(DMEM__DISK_OP_WRITE, 0, -1, EIO);
    int admitted = 0;
    for (int i = 0; i < 8; i++) {
      dmem_status_t st = dmem_buffer_spill(rt, h[i], DMEM_TIER_HOST);
      if (st == DMEM_OK) {
        CHECK_EQ(admitted, i); /* all admitted spills come first */
        admitted++;
        dmem__io_quiesce(rt->io);
      } else {
        CHECK_STATUS(st, DMEM_ERR_IO);
        CHECK_EQ(state_of(rt, h[i]), DMEM_STATE_RESIDENT);
      }
    }
    hook_off();
    if (admitted != rows[r].admitted) fprintf(stderr, "burst %g: %d admitted\n", rows[r].burst, admitted);
    CHECK_EQ(admitted, rows[r].admitted);
    dmem_stats_t s = stats_of(rt);
    CHECK_UEQ(s.host_used, (size_t)rows[r].admitted * MiB);
    for (int i = 0; i < 8; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 700 + (uint64_t)i), 0);
    for (int i = 0; i < 8; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
    dmem_runtime_destroy(rt);
    rm_tree(parent);
  }
}

TEST_CASE(failed_read_keeps_disk_copy) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(16 * MiB, 0, parent);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 3 * MiB, 0, &h));
  check_put(rt, h, 3 * MiB, 12);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  hook_on(DMEM__DISK_OP_READ, 0, -1, EIO);
  void *p;
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_IO);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "pread") != NULL);
  CHECK_STATUS(dmem_buffer_unspill(rt, h, NULL), DMEM_ERR_IO);
  hook_off();
  CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_DISK);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.device_used, 0);
  CHECK_UEQ(s.disk_used, 3 * MiB);
  CHECK_UEQ(s.disk_to_device_count, 0);
  CHECK_UEQ(check_bad_bytes(rt, h, 3 * MiB, 12), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* ---- the pipelined retrieve (tier_disk.c: chunks into staging slots, each
 * copied to the device as soon as it is in) ---------------------------------- */

typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h;
  dmem_stream_t s;
  dmem_status_t st;
} unspiller_t;

static void *unspiller(void *arg) {
  unspiller_t *u = arg;
  u->st = dmem_buffer_unspill(u->rt, u->h, u->s);
  if (u->st == DMEM_OK) u->st = dmem_stream_synchronize(u->rt, u->s);
  return NULL;
}

/* Multi-chunk buffers read back in several threads at once, and one after
 * the other on one stream with no wait in between (the next buffer's reads
 * overlap the previous one's copies, the slots are reused): every byte
 * where it was, in order; then, once the I/O threads have punched the
 * holes of the freed extents, the file is empty again. */
TEST_CASE(pipelined_reads_keep_every_byte_in_place) {
  char parent[64];
  make_parent(parent, sizeof parent);
  enum { NB = 6 };
  /* 2 chunks and an odd tail; 3 chunks exactly; under one chunk */
  const size_t sizes[NB] = {2 * DMEM__DISK_CHUNK + 4097, 3 * DMEM__DISK_CHUNK,
                            DMEM__DISK_CHUNK - 5,        2 * DMEM__DISK_CHUNK + 1,
                            5 * MiB + 3,                 DMEM__DISK_CHUNK + 4096};
  size_t total = 0;
  for (int i = 0; i < NB; i++) total += sizes[i];
  dmem_runtime_t *rt = runtime_with(total + 16 * MiB, 0, parent);
  dmem_handle_t h[NB];
  for (int i = 0; i < NB; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, sizes[i], 0, &h[i]));
    check_put(rt, h[i], sizes[i], 700 + (uint64_t)i);
  }
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_DISK));
    if (round == 0) {
      /* one stream, back to back */
      dmem_stream_t s;
      REQUIRE_OK(dmem_stream_create(rt, &s));
      for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_unspill(rt, h[i], s));
      CHECK_OK(dmem_stream_synchronize(rt, s));
      CHECK_OK(dmem_stream_destroy(rt, s));
    } else if (round == 1) {
      /* every buffer from its own thread: more readers than slots */
      pthread_t t[NB];
      unspiller_t u[NB];
      for (int i = 0; i < NB; i++) {
        u[i] = (unspiller_t){rt, h[i], NULL, DMEM_OK};
        REQUIRE_OK(dmem_stream_create(rt, &u[i].s));
        REQUIRE_TRUE(pthread_create(&t[i], NULL, unspiller, &u[i]) == 0);
      }
      for (int i = 0; i < NB; i++) {
        pthread_join(t[i], NULL);
        CHECK_OK(u[i].st);
        CHECK_OK(dmem_stream_destroy(rt, u[i].s));
      }
    } /* round 2: each by its lock (check_bad_bytes) */
    for (int i = 0; i < NB; i++) {
      if (round < 2) CHECK_EQ(state_of(rt, h[i]), DMEM_STATE_RESIDENT);
      CHECK_UEQ(check_bad_bytes(rt, h[i], sizes[i], 700 + (uint64_t)i), 0);
    }
  }
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.disk_to_device_count, 3 * NB);
  CHECK_UEQ(s.disk_to_device_bytes, 3 * total);
  CHECK_UEQ(s.disk_used, 0);
  /* the holes are punched off the retrieves, on the I/O threads: once they
   * are idle, every extent is free and the file cut back to nothing */
  dmem__io_quiesce(rt->io);
  long long bytes = 0;
  CHECK_EQ(count_files(parent, &bytes), 0); /* the file has no name */
  dmem__disk_t *disk = dmem_atomic_load_acquire(&rt->disk);
  REQUIRE_TRUE(disk != NULL);
  uint64_t off = 1;
  REQUIRE_OK(dmem__disk_alloc(disk, 4096, &off)); /* a new extent starts at 0 */
  CHECK_UEQ(off, 0);
  dmem__disk_free(disk, off, 4096);
  for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* ---- freed extents: kept while the disk is busy, reused, punched when quiet -------------- */

/* The descriptor of the runtime's unnamed spill file under parent, or -1
 * (/proc/self/fd: the file has no name, its link reads "<dir>/#N (deleted)"). */
static int spill_fd(const char *parent) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int fd = -1;
  struct dirent *e;
  while (fd < 0 && (e = readdir(d)) != NULL) {
    char path[300], link[1024];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0) continue;
    link[n] = '\0';
    struct stat st;
    if (strstr(link, parent) == link && strstr(link, "/dmem-spill-") &&
        fstat(atoi(e->d_name), &st) == 0 && S_ISREG(st.st_mode))
      fd = atoi(e->d_name);
  }
  closedir(d);
  return fd;
}

/* DMEM_DISK_FALLOCATE=off (testing only): an extent gets no blocks before
 * its write; by default a 16 MiB one has them at dmem__disk_alloc (where
 * the filesystem has fallocate). */
static void blocks_after_alloc(const char *knob, long long *blocks_out) {
  if (knob) setenv("DMEM_DISK_FALLOCATE", knob, 1);
  else unsetenv("DMEM_DISK_FALLOCATE");
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem__disk_t *d = NULL;
  REQUIRE_OK(dmem__disk_create(parent, NULL, &d));
  uint64_t off = 1;
  REQUIRE_OK(dmem__disk_alloc(d, 16 * MiB, &off));
  int fd = spill_fd(parent);
  REQUIRE_TRUE(fd >= 0);
  struct stat st;
  REQUIRE_TRUE(fstat(fd, &st) == 0);
  dmem__disk_free(d, off, 16 * MiB);
  dmem__disk_destroy(d);
  rm_tree(parent);
  unsetenv("DMEM_DISK_FALLOCATE");
  *blocks_out = (long long)st.st_blocks;
}

TEST_CASE(fallocate_knob_reserves_nothing) {
  long long with = -1, without = -1;
  blocks_after_alloc(NULL, &with);
  blocks_after_alloc("off", &without);
  CHECK_EQ(without, 0);
  if (with == 0) {
    fprintf(stderr, "note: this filesystem has no fallocate; the default reserves nothing either\n");
    return;
  }
  CHECK_GE(with, (long long)(16 * MiB / 512));
}

/* At each pread: the fewest 512-byte blocks the spill file had, after a
 * pause that gives the I/O threads time to punch what the previous
 * retrieve freed. */
typedef struct {
  int fd;
  _Atomic long long min_blocks;
  _Atomic int reads;
} blocks_probe_t;

static int blocks_probe_fn(void *user, dmem__disk_op_t op, uint64_t off, size_t len) {
  (void)off;
  (void)len;
  blocks_probe_t *p = user;
  if (op != DMEM__DISK_OP_READ) return 0;
  struct stat st;
  if (fstat(p->fd, &st) == 0 && (long long)st.st_blocks < atomic_load(&p->min_blocks))
    atomic_store(&p->min_blocks, (long long)st.st_blocks);
  atomic_fetch_add(&p->reads, 1);
  struct timespec ts = {0, 3 * 1000 * 1000};
  nanosleep(&ts, NULL);
  return 0;
}

/* Buffers read back one after the other: no extent a retrieve freed is
 * punched while the next reads go on (each punch held ext4's inode lock
 * and stalled the next read: small buffers came back at 0.5-0.8 of a plain
 * pread in bench_disk); spilled again, they take the kept extents (the
 * file does not grow); once the file is quiet its blocks all go back. */
TEST_CASE(freed_extents_keep_their_blocks_while_reads_go_on) {
  char parent[64];
  make_parent(parent, sizeof parent);
  enum { NB = 8 };
  dmem_runtime_t *rt = runtime_with((NB + 16) * MiB, 0, parent);
  dmem_handle_t h[NB];
  for (int i = 0; i < NB; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 900 + (uint64_t)i);
    REQUIRE_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_DISK));
  }
  dmem__disk_t *disk = dmem_atomic_load_acquire(&rt->disk);
  REQUIRE_TRUE(disk != NULL);
  dmem__disk_quiet_set(disk, (uint64_t)60 * 1000 * 1000 * 1000); /* no stall punches here */
  int fd = spill_fd(parent);
  REQUIRE_TRUE(fd >= 0);
  struct stat st0;
  REQUIRE_TRUE(fstat(fd, &st0) == 0);
  CHECK_GE((long long)st0.st_size, (long long)(NB * MiB));
  blocks_probe_t probe = {fd, (long long)st0.st_blocks, 0};
  dmem__disk_hook_set(blocks_probe_fn, &probe);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_unspill(rt, h[i], s));
  CHECK_OK(dmem_stream_synchronize(rt, s));
  dmem__disk_hook_set(NULL, NULL);
  const int reads = atomic_load(&probe.reads);
  const long long min_blocks = atomic_load(&probe.min_blocks);
  CHECK_GE(reads, NB); /* each buffer in one or more pieces */
  /* less than one buffer's blocks gone (metadata may move a little) */
  CHECK_GT(min_blocks, (long long)st0.st_blocks - (long long)(MiB / 512));
  /* spilled again: into the kept extents */
  for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], DMEM_TIER_DISK));
  struct stat st1;
  REQUIRE_TRUE(fstat(fd, &st1) == 0);
  CHECK_EQ((long long)st1.st_size, (long long)st0.st_size);
  for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_unspill(rt, h[i], s));
  CHECK_OK(dmem_stream_synchronize(rt, s));
  for (int i = 0; i < NB; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 900 + (uint64_t)i), 0);
  /* quiet now: the I/O thread gives every block back, the file is cut */
  dmem__disk_quiet_set(disk, 0);
  dmem__io_quiesce(rt->io);
  struct stat st2;
  REQUIRE_TRUE(fstat(fd, &st2) == 0);
  CHECK_EQ((long long)st2.st_size, 0);
  CHECK_EQ((long long)st2.st_blocks, 0);
  CHECK_OK(dmem_stream_destroy(rt, s));
  for (int i = 0; i < NB; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* Readers of a buffer's chunks met at a gate: how many were in at once
 * (the gate opens when `target` are in, or after 2 s). */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int inside, most, target;
  bool open;
} read_gate_t;

static int read_gate_fn(void *user, dmem__disk_op_t op, uint64_t off, size_t len) {
  (void)off;
  (void)len;
  read_gate_t *g = user;
  if (op != DMEM__DISK_OP_READ) return 0;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 2;
  pthread_mutex_lock(&g->mu);
  if (++g->inside > g->most) g->most = g->inside;
  if (g->inside >= g->target) g->open = true;
  pthread_cond_broadcast(&g->cv);
  while (!g->open && pthread_cond_timedwait(&g->cv, &g->mu, &until) != ETIMEDOUT) {
  }
  g->open = true;
  g->inside--;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  return 0;
}

/* Kept blocks waiting for a quiet disk hold no I/O thread that a read
 * wants: a buffer of 1 + DMEM__IO_THREADS chunks is read by the retrieving
 * thread and every I/O thread at once. */
TEST_CASE(kept_blocks_wait_without_an_io_thread) {
  char parent[64];
  make_parent(parent, sizeof parent);
  const size_t big = (1 + DMEM__IO_THREADS) * DMEM__DISK_CHUNK;
  dmem_runtime_t *rt = runtime_with(big + 32 * MiB, 0, parent);
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, big, 0, &b));
  check_put(rt, a, MiB, 51);
  check_put(rt, b, big, 52);
  CHECK_OK(dmem_buffer_spill(rt, b, DMEM_TIER_DISK));
  CHECK_OK(dmem_buffer_spill(rt, a, DMEM_TIER_DISK));
  dmem__disk_t *disk = dmem_atomic_load_acquire(&rt->disk);
  REQUIRE_TRUE(disk != NULL);
  dmem__disk_quiet_set(disk, (uint64_t)60 * 1000 * 1000 * 1000);
  CHECK_OK(dmem_buffer_unspill(rt, a, NULL)); /* its extent kept: the punch waits */
  struct timespec ts = {0, 50 * 1000 * 1000};
  nanosleep(&ts, NULL); /* an I/O thread has taken the waiting punch */
  read_gate_t g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0,
                   1 + DMEM__IO_THREADS, false};
  dmem__disk_hook_set(read_gate_fn, &g);
  CHECK_OK(dmem_buffer_unspill(rt, b, NULL));
  dmem__disk_hook_set(NULL, NULL);
  CHECK_EQ(g.most, 1 + DMEM__IO_THREADS);
  CHECK_UEQ(check_bad_bytes(rt, b, big, 52), 0);
  CHECK_UEQ(check_bad_bytes(rt, a, MiB, 51), 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* The pieces of one buffer's reads or writes (op) met at a gate, as in
 * read_gate_fn. */
typedef struct {
  read_gate_t g;
  dmem__disk_op_t op;
} op_gate_t;

static int op_gate_fn(void *user, dmem__disk_op_t op, uint64_t off, size_t len) {
  op_gate_t *o = user;
  return op == o->op ? read_gate_fn(&o->g, DMEM__DISK_OP_READ, off, len) : 0;
}

/* A 2 MiB or 8 MiB buffer goes to the file several requests deep (in
 * pieces that the calling thread and the I/O threads take at once), as a
 * buffer of many chunks does, and an 8 MiB one comes back so; a 1 MiB one
 * goes whole. One request at a time, 8 MiB buffers read at 0.87-0.95 of a
 * plain loop of preads on an H100 machine's disk (bench_disk); 1 MiB
 * buffers in 4 pieces wrote at 0.80 where whole they wrote at 0.95. */
static void small_io(const size_t *sizes, const int *deep, const int *deep_read, int n) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(32 * MiB, 0, parent);
  for (int i = 0; i < n; i++) {
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, sizes[i], 0, &h));
    check_put(rt, h, sizes[i], 61 + (uint64_t)i);
    for (int w = 1; w >= 0; w--) { /* written, then read back */
      if (!w && sizes[i] < 2 * MiB) { /* read whole */
        CHECK_OK(dmem_buffer_unspill(rt, h, NULL));
        continue;
      }
      /* the gate waits up to 2 s for a second request at once */
      op_gate_t o = {{PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 2, false},
                     w ? DMEM__DISK_OP_WRITE : DMEM__DISK_OP_READ};
      dmem__disk_hook_set(op_gate_fn, &o);
      CHECK_OK(w ? dmem_buffer_spill(rt, h, DMEM_TIER_DISK) : dmem_buffer_unspill(rt, h, NULL));
      dmem__disk_hook_set(NULL, NULL);
      if (w ? deep[i] : (deep_read ? deep_read[i] : 1))
        CHECK_GE(o.g.most, 2);
      else
        CHECK_EQ(o.g.most, 1);
    }
    CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
    CHECK_UEQ(check_bad_bytes(rt, h, sizes[i], 61 + (uint64_t)i), 0);
    CHECK_OK(dmem_buffer_free(rt, h));
  }
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

static void small_writes(const size_t *sizes, const int *deep, int n) {
  small_io(sizes, deep, NULL, n);
}

TEST_CASE(small_buffers_go_to_the_file_several_requests_deep) {
  unsetenv("DMEM_DISK_WRITE_PIECE");
  unsetenv("DMEM_DISK_READ_PIECE");
  const size_t sizes[3] = {MiB, 2 * MiB, 8 * MiB};
  const int deep[3] = {0, 1, 1};
  small_writes(sizes, deep, 3);
}

/* DMEM_DISK_WRITE_PIECE (testing only) sets the smallest write piece: 256K
 * cuts a 1 MiB buffer in 4 requests at once, 8M writes an 8 MiB one whole. */
TEST_CASE(write_piece_knob_sets_the_pieces) {
  setenv("DMEM_DISK_WRITE_PIECE", "256K", 1);
  const size_t a[1] = {MiB};
  const int deep_a[1] = {1};
  small_writes(a, deep_a, 1);
  setenv("DMEM_DISK_WRITE_PIECE", "8M", 1);
  const size_t b[1] = {8 * MiB};
  const int deep_b[1] = {0};
  small_writes(b, deep_b, 1);
  unsetenv("DMEM_DISK_WRITE_PIECE");
}

/* DMEM_DISK_READ_PIECE (testing only) likewise for reads: 8M reads an
 * 8 MiB buffer back whole, in one request from the calling thread. */
TEST_CASE(read_piece_knob_sets_the_pieces) {
  setenv("DMEM_DISK_READ_PIECE", "8M", 1);
  const size_t b[1] = {8 * MiB};
  const int deep_w[1] = {1}, deep_r[1] = {0};
  small_io(b, deep_w, deep_r, 1);
  unsetenv("DMEM_DISK_READ_PIECE");
}

/* An extent starts at a multiple of its length's largest power of two, up
 * to 1 MiB, whatever was placed before it (a 4 KiB extent first put every
 * 1 MiB buffer after it 4 KiB past a 1 MiB boundary); the gap left before
 * it goes to the next small extents. */
TEST_CASE(extents_start_aligned_to_their_size) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem__disk_t *d = NULL;
  REQUIRE_OK(dmem__disk_create(parent, NULL, &d));
  uint64_t a = 1, b = 1, c = 1, e = 1, f = 1;
  REQUIRE_OK(dmem__disk_alloc(d, 4096, &a));
  CHECK_UEQ(a, 0);
  REQUIRE_OK(dmem__disk_alloc(d, MiB, &b));
  CHECK_UEQ(b, MiB);
  REQUIRE_OK(dmem__disk_alloc(d, 3 * MiB + 5, &c));
  CHECK_UEQ(c, 2 * MiB);
  REQUIRE_OK(dmem__disk_alloc(d, 20 * KiB, &e)); /* at 16 KiB, in the gap */
  CHECK_UEQ(e, 16 * KiB);
  REQUIRE_OK(dmem__disk_alloc(d, 4096, &f)); /* the gap's first block */
  CHECK_UEQ(f, 4096);
  /* bytes in and back at each */
  const uint64_t offs[5] = {a, b, c, e, f};
  const size_t lens[5] = {4096, MiB, 3 * MiB + 5, 20 * KiB, 4096};
  char *buf = NULL, *back = NULL;
  REQUIRE_TRUE(posix_memalign((void **)&buf, 4096, 4 * MiB) == 0);
  REQUIRE_TRUE(posix_memalign((void **)&back, 4096, 4 * MiB) == 0);
  for (int i = 0; i < 5; i++) {
    memset(buf, 'a' + i, lens[i]);
    CHECK_OK(dmem__disk_write(d, offs[i], buf, lens[i], NULL, NULL));
  }
  for (int i = 0; i < 5; i++) {
    memset(buf, 'a' + i, lens[i]);
    memset(back, 0, lens[i]);
    CHECK_OK(dmem__disk_read(d, offs[i], back, lens[i]));
    CHECK_TRUE(memcmp(buf, back, lens[i]) == 0);
  }
  free(buf);
  free(back);
  for (int i = 0; i < 5; i++) dmem__disk_free(d, offs[i], lens[i]);
  /* all free: punched here (no I/O threads), the file cut to nothing */
  uint64_t z = 1;
  REQUIRE_OK(dmem__disk_alloc(d, 4096, &z));
  CHECK_UEQ(z, 0);
  dmem__disk_free(d, z, 4096);
  dmem__disk_destroy(d);
  rm_tree(parent);
}

/* A reservation that finds the filesystem full while freed extents keep
 * their blocks: those go back to the filesystem and it is tried once more
 * (a disk full only of kept blocks does not fail a spill); a full disk
 * still fails it, leaving the buffer where it was. */
TEST_CASE(full_filesystem_takes_the_kept_blocks_back) {
  char parent[64];
  make_parent(parent, sizeof parent);
  dmem_runtime_t *rt = runtime_with(32 * MiB, 0, parent);
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * MiB, 0, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, 4 * MiB, 0, &b));
  check_put(rt, a, 2 * MiB, 41);
  check_put(rt, b, 4 * MiB, 42);
  CHECK_OK(dmem_buffer_spill(rt, a, DMEM_TIER_DISK));
  dmem__disk_t *disk = dmem_atomic_load_acquire(&rt->disk);
  REQUIRE_TRUE(disk != NULL);
  dmem__disk_quiet_set(disk, (uint64_t)60 * 1000 * 1000 * 1000);
  CHECK_OK(dmem_buffer_unspill(rt, a, NULL)); /* a's extent is kept */
  /* b does not fit a's extent: a new one, whose reservation fails once */
  hook_t *k = hook_on(DMEM__DISK_OP_ALLOC, 0, 1, ENOSPC);
  CHECK_OK(dmem_buffer_spill(rt, b, DMEM_TIER_DISK));
  CHECK_EQ(k->failed, 1);
  CHECK_EQ(k->calls, 2);
  hook_off();
  CHECK_EQ(state_of(rt, b), DMEM_STATE_DEFERRED_DISK);
  CHECK_UEQ(check_bad_bytes(rt, b, 4 * MiB, 42), 0);
  /* full for good: the spill fails, the buffer stays on the device */
  k = hook_on(DMEM__DISK_OP_ALLOC, 0, -1, ENOSPC);
  CHECK_STATUS(dmem_buffer_spill(rt, a, DMEM_TIER_DISK), DMEM_ERR_IO);
  hook_off();
  CHECK_EQ(state_of(rt, a), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, a, 2 * MiB, 41), 0);
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* A read that fails after some chunks were read and their copies to the
 * device enqueued: DMEM_ERR_IO, the buffer still on disk with all its
 * bytes, nothing left on the device; the slots stay usable. Every chunk
 * position in turn. */
TEST_CASE(failed_read_mid_buffer_keeps_disk_copy) {
  char parent[64];
  make_parent(parent, sizeof parent);
  const size_t n = 4 * DMEM__DISK_CHUNK + 4099; /* 5 chunks */
  dmem_runtime_t *rt = runtime_with(n + 16 * MiB, 0, parent);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, n, 0, &h));
  check_put(rt, h, n, 31);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  for (long skip = 0; skip < 5; skip++) {
    hook_t *k = hook_on(DMEM__DISK_OP_READ, skip, 1, EIO);
    CHECK_STATUS(dmem_buffer_unspill(rt, h, NULL), DMEM_ERR_IO);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "pread") != NULL);
    CHECK_EQ(k->failed, 1);
    hook_off();
    CHECK_EQ(state_of(rt, h), DMEM_STATE_DEFERRED_DISK);
    dmem_stats_t s = stats_of(rt);
    CHECK_UEQ(s.device_used, 0);
    CHECK_UEQ(s.disk_used, n);
    CHECK_UEQ(s.disk_to_device_count, 0);
  }
  /* then read back whole, through the same slots */
  CHECK_UEQ(check_bad_bytes(rt, h, n, 31), 0);
  CHECK_EQ(state_of(rt, h), DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
  CHECK_UEQ(check_bad_bytes(rt, h, n, 31), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* ---- a push-down blocks nobody ------------------------------------------------------------ */

typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h;
  size_t n;
  uint64_t seed;
  size_t bad;
  atomic_int done;
} locker_t;

static void *locker_thread(void *arg) {
  locker_t *l = arg;
  l->bad = check_bad_bytes(l->rt, l->h, l->n, l->seed);
  atomic_store(&l->done, 1);
  return NULL;
}

TEST_CASE(pushdown_blocks_no_other_lock_and_yields_to_its_own) {
  char parent[64];
  make_parent(parent, sizeof parent);
  alarm(60); /* a lock that waited for the blocked write would hang here */
  dmem_runtime_t *rt = runtime_with(96 * MiB, 40 * MiB, parent);
  dmem_handle_t x, y, z;
  REQUIRE_OK(dmem_buffer_alloc(rt, 40 * MiB, 0, &x)); /* 5 chunks: more than the I/O threads take at once */
  REQUIRE_OK(dmem_buffer_alloc(rt, 8 * MiB, 0, &y));
  REQUIRE_OK(dmem_buffer_alloc(rt, 8 * MiB, 0, &z));
  check_put(rt, x, 40 * MiB, 21);
  check_put(rt, y, 8 * MiB, 22);
  check_put(rt, z, 8 * MiB, 23);
  /* every write waits at the gate */
  hook_t *k = hook_on(DMEM__DISK_OP_WRITE, 0, 0, 0);
  pthread_mutex_lock(&k->mu);
  k->gate_closed = 1;
  pthread_mutex_unlock(&k->mu);
  CHECK_OK(dmem_buffer_spill(rt, x, DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, y, DMEM_TIER_HOST)); /* 48 MiB: x goes down */
  pthread_mutex_lock(&k->mu);
  while (!k->entered) pthread_cond_wait(&k->cv, &k->mu);
  pthread_mutex_unlock(&k->mu);
  /* x's write is stuck: other buffers' locks and moves go on */
  CHECK_UEQ(check_bad_bytes(rt, y, 8 * MiB, 22), 0); /* host tier -> device */
  CHECK_UEQ(check_bad_bytes(rt, z, 8 * MiB, 23), 0); /* resident */
  CHECK_OK(dmem_buffer_spill(rt, z, DMEM_TIER_HOST));
  CHECK_UEQ(check_bad_bytes(rt, z, 8 * MiB, 23), 0);
  /* a lock of x itself stops the write at its next chunk */
  locker_t l = {rt, x, 40 * MiB, 21, 1, 0};
  pthread_t t;
  pthread_create(&t, NULL, locker_thread, &l);
  /* the locker asks the writer to stop (b->io_cancel); wait for that
   * rather than for a fixed time, which a loaded machine under the
   * sanitizers can overrun (the write then finished and the checks below
   * failed) */
  dmem__buffer_t *xb = dmem__table_lookup(rt->table, x);
  REQUIRE_TRUE(xb != NULL);
  for (int i = 0; i < 10000 && !dmem_atomic_load_relaxed(&xb->io_cancel); i++) {
    struct timespec ms1 = {0, 1000 * 1000};
    nanosleep(&ms1, NULL);
  }
  CHECK_EQ(dmem_atomic_load_relaxed(&xb->io_cancel), 1);
  CHECK_EQ(atomic_load(&l.done), 0);
  pthread_mutex_lock(&k->mu);
  k->gate_closed = 0;
  pthread_cond_broadcast(&k->cv);
  pthread_mutex_unlock(&k->mu);
  pthread_join(t, NULL);
  hook_off();
  CHECK_UEQ(l.bad, 0);
  CHECK_EQ(state_of(rt, x), DMEM_STATE_RESIDENT);
  dmem__io_quiesce(rt->io);
  dmem_stats_t s = stats_of(rt);
  CHECK_UEQ(s.host_to_disk_count, 0); /* the write was abandoned, not finished */
  CHECK_UEQ(s.disk_to_device_count, 0); /* x came back from the host tier */
  CHECK_UEQ(s.disk_used, 0);
  CHECK_GE(s.cancelled_spills, 1);
  CHECK_OK(dmem_buffer_free(rt, x));
  CHECK_OK(dmem_buffer_free(rt, y));
  CHECK_OK(dmem_buffer_free(rt, z));
  dmem_runtime_destroy(rt);
  alarm(0);
  rm_tree(parent);
}

/* ---- nothing left behind after SIGKILL ---------------------------------------------------- */

static int kill_pipe[2];
static atomic_int kill_signalled;

/* The child's hook: the first write goes through; the next one (the
 * spill's second chunk, on whichever thread) reports and then hangs. */
static int hang_hook(void *user, dmem__disk_op_t op, uint64_t off, size_t len) {
  (void)user;
  (void)len;
  if (op != DMEM__DISK_OP_WRITE || off == 0) return 0;
  if (atomic_exchange(&kill_signalled, 1) == 0) (void)!write(kill_pipe[1], "w", 1);
  for (;;) pause();
}

TEST_CASE(killed_mid_spill_leaves_nothing) {
  char parent[64];
  make_parent(parent, sizeof parent);
  REQUIRE_EQ(pipe(kill_pipe), 0);
  pid_t pid = fork();
  REQUIRE_TRUE(pid >= 0);
  if (pid == 0) { /* the child: never returns to the test runner */
    close(kill_pipe[0]);
    dmem_config_t cfg;
    dmem_config_init(&cfg);
    if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
    cfg.device_limit = 64 * MiB;
    cfg.spill_dir = parent;
    dmem_runtime_t *rt = NULL;
    dmem_status_t st = dmem_runtime_create(&cfg, &rt);
    if (st != DMEM_OK) _exit(st == DMEM_ERR_NO_DEVICE ? 77 : 2);
    dmem_handle_t h;
    if (dmem_buffer_alloc(rt, 32 * MiB, 0, &h) != DMEM_OK) _exit(3);
    check_put(rt, h, 32 * MiB, 5);
    dmem__disk_hook_set(hang_hook, NULL);
    dmem_buffer_spill(rt, h, DMEM_TIER_DISK); /* hangs mid-write */
    _exit(4);
  }
  close(kill_pipe[1]);
  /* data: the child is mid-write; end of file: it exited first */
  struct pollfd pfd = {kill_pipe[0], POLLIN, 0};
  int ready = poll(&pfd, 1, 60000);
  char c = 0;
  bool mid = ready == 1 && read(kill_pipe[0], &c, 1) == 1;
  if (!mid) {
    int status = 0;
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    close(kill_pipe[0]);
    rm_tree(parent);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) SKIP("no device in the child");
    CHECK_FAIL_(1, "the child never reached the write (status 0x%x)", status);
  }
  if (mid) {
    /* mid-spill: the child holds an unnamed file with data in it, and no
     * file under the parent has a name */
    char fddir[64];
    snprintf(fddir, sizeof fddir, "/proc/%d/fd", (int)pid);
    int open_spill = 0;
    DIR *fds = opendir(fddir);
    struct dirent *e;
    while (fds && (e = readdir(fds)) != NULL) {
      char link[400], target[1024];
      snprintf(link, sizeof link, "%s/%s", fddir, e->d_name);
      ssize_t n = readlink(link, target, sizeof target - 1);
      if (n <= 0) continue;
      target[n] = '\0';
      struct stat st;
      if (strncmp(target, parent, strlen(parent)) != 0 || stat(link, &st) != 0) continue;
      open_spill++;
      CHECK_EQ(st.st_nlink, 0);
      CHECK_GE(st.st_size, (long long)(32 * MiB)); /* reserved, part written */
    }
    if (fds) closedir(fds);
    CHECK_EQ(open_spill, 1);
    CHECK_EQ(count_files(parent, NULL), 0);
  }
  kill(pid, SIGKILL);
  int status = 0;
  REQUIRE_EQ(waitpid(pid, &status, 0), pid);
  CHECK_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  close(kill_pipe[0]);
  /* the process is gone: no file, no byte of data anywhere under the
   * parent, and no private directory (removed once the file was open) */
  long long bytes = 0;
  CHECK_EQ(count_files(parent, &bytes), 0);
  CHECK_EQ(bytes, 0);
  CHECK_EQ(count_entries(parent, NULL, 0), 0); /* not even the private directory */
  rm_tree(parent);
}

/* ---- locks racing push-downs and retrieves (stress; TSan) ---------------------------------- */

#define RACE_N 20
#define RACE_SIZE (512 * KiB)

typedef struct {
  dmem_runtime_t *rt;
  dmem_handle_t h[RACE_N];
  pthread_mutex_t mu[RACE_N]; /* the test's writer locks, not dmem's */
  uint64_t seed[RACE_N];      /* under mu[i] */
  atomic_int stop;
  atomic_long bad, errors, uses, moves;
} race_t;

typedef struct {
  race_t *r;
  unsigned id;
} race_arg_t;

static uint64_t next_rand(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* One explicit move of h picked at random: to host, to disk or back (no
 * lock). BUSY (locked or moving), INVALID_ARGUMENT (disk -> host is no move)
 * and `also_ok` are expected; any other failure is printed and counted. */
static void random_move(dmem_runtime_t *rt, dmem_handle_t h, uint64_t *x, dmem_status_t also_ok,
                        atomic_long *moves, atomic_long *errors) {
  dmem_status_t st;
  switch (next_rand(x) % 3) {
    case 0: st = dmem_buffer_spill(rt, h, DMEM_TIER_HOST); break;
    case 1: st = dmem_buffer_spill(rt, h, DMEM_TIER_DISK); break;
    default: st = dmem_buffer_unspill(rt, h, NULL); break;
  }
  if (st == DMEM_OK) atomic_fetch_add(moves, 1);
  else if (st != DMEM_ERR_BUSY && st != DMEM_ERR_INVALID_ARGUMENT && st != also_ok) {
    fprintf(stderr, "move: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
    atomic_fetch_add(errors, 1);
  }
}

/* lock a random buffer (from any tier), check it, write a new pattern */
static void *race_worker(void *arg) {
  race_arg_t *a = arg;
  race_t *r = a->r;
  uint64_t x = 0x9E3779B97F4A7C15ull * (a->id + 1);
  unsigned char *tmp = malloc(RACE_SIZE);
  while (!atomic_load(&r->stop)) {
    unsigned i = (unsigned)(next_rand(&x) % RACE_N);
    pthread_mutex_lock(&r->mu[i]);
    void *p;
    dmem_status_t st = dmem_buffer_lock(r->rt, r->h[i], NULL, &p);
    if (st == DMEM_OK) {
      dmem_stream_copy(r->rt, tmp, p, RACE_SIZE, NULL);
      dmem_stream_synchronize(r->rt, NULL);
      if (check_verify(tmp, RACE_SIZE, r->seed[i]) != 0) atomic_fetch_add(&r->bad, 1);
      r->seed[i] = next_rand(&x);
      check_fill(tmp, RACE_SIZE, r->seed[i]);
      dmem_stream_copy(r->rt, p, tmp, RACE_SIZE, NULL);
      dmem_stream_synchronize(r->rt, NULL);
      dmem_buffer_unlock(r->rt, r->h[i]);
      atomic_fetch_add(&r->uses, 1);
    } else {
      fprintf(stderr, "lock: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
      atomic_fetch_add(&r->errors, 1);
    }
    pthread_mutex_unlock(&r->mu[i]);
  }
  free(tmp);
  return NULL;
}

/* explicit moves of random buffers: to host, to disk, back (no lock) */
static void *race_mover(void *arg) {
  race_arg_t *a = arg;
  race_t *r = a->r;
  uint64_t x = 0xD1B54A32D192ED03ull;
  while (!atomic_load(&r->stop)) {
    unsigned i = (unsigned)(next_rand(&x) % RACE_N);
    random_move(r->rt, r->h[i], &x, DMEM_ERR_BUSY, &r->moves, &r->errors);
  }
  return NULL;
}

TEST_CASE(locks_race_pushdowns_and_retrieves) {
  char parent[64];
  make_parent(parent, sizeof parent);
  /* device: 10 buffers (at most 4 held at once by the 3 lockers and the
   * mover's unspill, so that there is always a victim); host tier: 4; the
   * rest on disk */
  race_t *r = calloc(1, sizeof *r);
  r->rt = runtime_with(10 * RACE_SIZE, 4 * RACE_SIZE, parent);
  for (int i = 0; i < RACE_N; i++) {
    pthread_mutex_init(&r->mu[i], NULL);
    REQUIRE_OK(dmem_buffer_alloc(r->rt, RACE_SIZE, 0, &r->h[i]));
    r->seed[i] = 1000 + (uint64_t)i;
    check_put(r->rt, r->h[i], RACE_SIZE, r->seed[i]);
  }
  enum { NW = 3 };
  pthread_t t[NW + 1];
  race_arg_t args[NW + 1];
  for (unsigned i = 0; i <= NW; i++) {
    args[i].r = r;
    args[i].id = i;
    pthread_create(&t[i], NULL, i < NW ? race_worker : race_mover, &args[i]);
  }
  struct timespec dur = {1, 0};
  nanosleep(&dur, NULL);
  atomic_store(&r->stop, 1);
  for (unsigned i = 0; i <= NW; i++) pthread_join(t[i], NULL);
  dmem__io_quiesce(r->rt->io);
  dmem_stats_t s = stats_of(r->rt);
  fprintf(stderr,
          "uses %ld, moves %ld; pushdowns %llu, disk writes %llu, disk reads %llu, cancelled %llu\n",
          atomic_load(&r->uses), atomic_load(&r->moves),
          (unsigned long long)s.host_to_disk_pushdowns, (unsigned long long)s.host_to_disk_count,
          (unsigned long long)s.disk_to_device_count, (unsigned long long)s.cancelled_spills);
  CHECK_EQ(atomic_load(&r->bad), 0);
  CHECK_EQ(atomic_load(&r->errors), 0);
  CHECK_GT(atomic_load(&r->uses), 0);
  CHECK_GT(s.host_to_disk_pushdowns, 0);
  CHECK_GT(s.disk_to_device_count, 0);
  CHECK_LE(s.host_used, 4 * RACE_SIZE);
  CHECK_UEQ(s.device_used + s.host_used + s.disk_used, RACE_N * RACE_SIZE);
  for (int i = 0; i < RACE_N; i++) CHECK_UEQ(check_bad_bytes(r->rt, r->h[i], RACE_SIZE, r->seed[i]), 0);
  for (int i = 0; i < RACE_N; i++) CHECK_OK(dmem_buffer_free(r->rt, r->h[i]));
  dmem_runtime_destroy(r->rt);
  for (int i = 0; i < RACE_N; i++) pthread_mutex_destroy(&r->mu[i]);
  free(r);
  rm_tree(parent);
}

/* The GPU suite's spill cycles on the host backend: 64 buffers of 4 MiB
 * under a 96 MiB device limit and a 64 MiB host limit (a pinned pool of
 * 160 MiB: the host tier's cap of 96 MiB and 64 MiB for staging), four
 * threads locking buffers in turn (disk-tier ones read back through the
 * read slots) while a fifth moves buffers to the host tier and to disk at
 * random. Every lock and every move succeeds or is refused as documented
 * (BUSY, INVALID_ARGUMENT, OUT_OF_MEMORY): the read slots must leave the
 * spills their staging (ten slots of 8 MiB beside a full host tier left no
 * 4 MiB block, and locks failed with DMEM_ERR_HOST_OUT_OF_MEMORY). */
enum { TIGHT_NB = 64, TIGHT_THREADS = 4 };

typedef struct tight {
  dmem_runtime_t *rt;
  dmem_handle_t h[TIGHT_NB];
  _Atomic int stop;
  atomic_long errors, locks, moves;
} tight_t;

typedef struct tight_arg {
  tight_t *w;
  int t;
} tight_arg_t;

static void *tight_worker(void *arg) {
  tight_arg_t *a = arg;
  tight_t *w = a->w;
  for (int round = 0; round < 3; round++) {
    for (int k = 0; k < TIGHT_NB / TIGHT_THREADS; k++) {
      int i = a->t + TIGHT_THREADS * ((k + round) % (TIGHT_NB / TIGHT_THREADS));
      void *p;
      dmem_status_t st = dmem_buffer_lock(w->rt, w->h[i], NULL, &p);
      if (st != DMEM_OK) {
        fprintf(stderr, "lock %d: %s (%s)\n", i, dmem_status_name(st), dmem_last_error_detail());
        atomic_fetch_add(&w->errors, 1);
        continue;
      }
      atomic_fetch_add(&w->locks, 1);
      if (dmem_buffer_unlock(w->rt, w->h[i]) != DMEM_OK) atomic_fetch_add(&w->errors, 1);
    }
  }
  return NULL;
}

static void *tight_mover(void *arg) {
  tight_t *w = ((tight_arg_t *)arg)->w;
  uint64_t x = 88172645463325252ull;
  while (!atomic_load(&w->stop)) {
    dmem_handle_t h = w->h[next_rand(&x) % TIGHT_NB];
    /* an unspill may find no device room: every buffer locked or moving */
    random_move(w->rt, h, &x, DMEM_ERR_OUT_OF_MEMORY, &w->moves, &w->errors);
  }
  return NULL;
}

TEST_CASE(disk_reads_leave_staging_room_under_a_tight_host_limit) {
  char parent[64];
  make_parent(parent, sizeof parent);
  const size_t B = 4 * MiB;
  static tight_t w;
  memset(&w, 0, sizeof w);
  w.rt = runtime_with(24 * B, 16 * B, parent);
  for (int i = 0; i < TIGHT_NB; i++) {
    REQUIRE_OK(dmem_buffer_alloc(w.rt, B, 0, &w.h[i]));
    check_put(w.rt, w.h[i], B, 900 + (uint64_t)i);
  }
  pthread_t t[TIGHT_THREADS + 1];
  tight_arg_t a[TIGHT_THREADS + 1];
  for (int i = 0; i <= TIGHT_THREADS; i++) {
    a[i] = (tight_arg_t){&w, i};
    REQUIRE_TRUE(pthread_create(&t[i], NULL, i < TIGHT_THREADS ? tight_worker : tight_mover,
                                &a[i]) == 0);
  }
  for (int i = 0; i < TIGHT_THREADS; i++) pthread_join(t[i], NULL);
  atomic_store(&w.stop, 1);
  pthread_join(t[TIGHT_THREADS], NULL);
  CHECK_EQ(atomic_load(&w.errors), 0);
  CHECK_EQ(atomic_load(&w.locks), 3 * TIGHT_NB);
  for (int i = 0; i < TIGHT_NB; i++) CHECK_UEQ(check_bad_bytes(w.rt, w.h[i], B, 900 + (uint64_t)i), 0);
  dmem_stats_t s = stats_of(w.rt); /* polls: finished copies give their staging back */
  CHECK_GT(s.disk_to_device_count, 0);
  dmem__hostpool_stats_t ps;
  dmem__hostpool_stats(w.rt->hostpool, &ps);
  fprintf(stderr, "pool %zu held, %zu free, host tier %zu\n", ps.reserved, ps.free, (size_t)s.host_used);
  fprintf(stderr, "locks %ld, moves %ld, disk->device %llu\n", atomic_load(&w.locks),
          atomic_load(&w.moves), (unsigned long long)s.disk_to_device_count);
  dmem_runtime_destroy(w.rt);
  rm_tree(parent);
}

/* A pinned pool that holds its limit with nothing to recycle (here: every
 * free byte taken from outside) does not fail moves: spills and disk loads
 * stage in pageable memory, and every byte comes back. */
TEST_CASE(moves_stage_in_pageable_memory_when_the_pool_holds_its_limit) {
  char parent[64];
  make_parent(parent, sizeof parent);
  const size_t B = 1 * MiB;
  dmem_runtime_t *rt = runtime_with(8 * B, 4 * B, parent); /* pool: 6 + 64 MiB */
  dmem_handle_t h[3];
  for (int i = 0; i < 3; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, B, 0, &h[i]));
    check_put(rt, h[i], B, 300 + (uint64_t)i);
  }
  /* take every pinned byte the pool may hold */
  enum { MAXB = 256 };
  static void *taken[MAXB];
  int nt = 0;
  while (nt < MAXB && dmem__hostpool_alloc(rt->hostpool, 512 * KiB, &taken[nt]) == DMEM_OK) nt++;
  REQUIRE_TRUE(nt < MAXB);
  REQUIRE_TRUE(dmem__hostpool_at_limit(rt->hostpool));
  dmem_stats_t s0 = stats_of(rt);
  CHECK_OK(dmem_buffer_spill(rt, h[0], DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, h[1], DMEM_TIER_DISK));
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_DEFERRED_HOST);
  CHECK_EQ(state_of(rt, h[1]), DMEM_STATE_DEFERRED_DISK);
  for (int i = 0; i < 3; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], B, 300 + (uint64_t)i), 0);
  dmem_stats_t s1 = stats_of(rt);
  CHECK_GE(s1.host_pageable_allocs - s0.host_pageable_allocs, 3); /* 2 spills, 1 disk load */
  for (int i = 0; i < nt; i++) dmem__hostpool_free(rt->hostpool, taken[i]);
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_UEQ(stats_of(rt).host_pageable_used, 0);
  dmem_runtime_destroy(rt);
  rm_tree(parent);
}

/* A relative spill_dir names the directory it named when the runtime was
 * created, whatever directory the process is in when the disk tier is first
 * used, and the directory dmem made there is gone after destroy. Before
 * the fix: the first spill after a chdir failed (DMEM_ERR_IO, no such
 * directory), and a tier made before the chdir left its directory behind. */
TEST_CASE(relative_spill_dir_survives_chdir) {
  char parent[512], cwd[1024], dir[512];
  make_parent(parent, sizeof parent);
  REQUIRE_TRUE(getcwd(cwd, sizeof cwd) != NULL);
  /* parent is $TMPDIR/dmem-disk-test-XXXXXX: relative to $TMPDIR, its name */
  const char *base = strrchr(parent, '/');
  REQUIRE_TRUE(base != NULL);
  snprintf(dir, sizeof dir, "%.*s", (int)(base - parent), parent);
  for (int spill_first = 0; spill_first < 2; spill_first++) {
    REQUIRE_EQ(chdir(dir), 0);
    dmem_runtime_t *rt = runtime_with(8 * MiB, 0, base + 1);
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
    check_put(rt, h, MiB, 5);
    if (spill_first) CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
    REQUIRE_EQ(chdir("/"), 0);
    /* taken against "/", the directory could not be made: DMEM_ERR_IO */
    CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK));
    /* dmem's directory was made in parent, and removed once its file was open */
    CHECK_EQ(count_entries(parent, NULL, 0), 0);
    CHECK_UEQ(check_bad_bytes(rt, h, MiB, 5), 0);
    CHECK_OK(dmem_buffer_free(rt, h));
    dmem_runtime_destroy(rt);
    CHECK_EQ(count_entries(parent, NULL, 0), 0);
  }
  REQUIRE_EQ(chdir(cwd), 0);
  rm_tree(parent);
}
