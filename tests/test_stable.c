/* Stable-address buffers (DMEM_BUFFER_STABLE_ADDRESS, runtime/memory/stable.c):
 * the pointer a lock returns is the same across spills to host and disk and
 * back, the bytes survive every move, the device charge is the
 * granularity-rounded size while resident and nothing while spilled, under
 * pressure and with ordinary buffers beside them, with threads racing locks,
 * spills and evictions, and a graph-style replay over pointers taken once.
 *
 * Backend-neutral (also cuda.stable.* on a GPU) except unmapped_range_faults,
 * which checks the host backend's simulation. White-box: the granularity
 * (dmem__stable_granularity) and whether a range is mapped. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "api/api.h"

static dmem_runtime_t *runtime_with(size_t limit, size_t host_limit, const char *spill_dir) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.spill_ahead = 0;
  cfg.device_limit = limit;
  cfg.host_limit = host_limit;
  cfg.spill_dir = spill_dir;
  return check_runtime_cfg(&cfg);
}

static size_t granule(dmem_runtime_t *rt) {
  size_t g = 0;
  if (dmem__stable_granularity(rt, &g) != DMEM_OK || g == 0) abort();
  return g;
}

/* The granularity of the backend DMEM_BACKEND names (a throwaway runtime). */
static size_t backend_granule(void) {
  dmem_runtime_t *rt = runtime_with((size_t)64 << 20, 0, NULL);
  size_t g = granule(rt);
  dmem_runtime_destroy(rt);
  return g;
}

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

static size_t device_used(dmem_runtime_t *rt) {
  dmem_stats_t s;
  if (dmem_stats(rt, &s) != DMEM_OK) abort();
  return s.device_used;
}

/* Lock h and return its pointer (NULL on failure, status printed). */
static void *lock_ptr(dmem_runtime_t *rt, dmem_handle_t h) {
  void *p = NULL;
  dmem_status_t st = dmem_buffer_lock(rt, h, NULL, &p);
  if (st != DMEM_OK) {
    fprintf(stderr, "lock: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
    return NULL;
  }
  return p;
}

TEST_CASE(address_survives_host_and_disk) {
  char dir[512];
  check_mkdtemp(dir, sizeof dir, "stable");
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(16 * g, 0, dir);
  size_t n = g + g / 2 + 123; /* rounded: 2 granules */
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, n, DMEM_BUFFER_STABLE_ADDRESS, &h));
  void *p0 = lock_ptr(rt, h);
  REQUIRE_TRUE(p0 != NULL);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_UEQ((uintptr_t)p0 % g, 0);
  CHECK_UEQ(device_used(rt), 2 * g); /* the rounded size is charged */
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_UEQ(info.size, n); /* the size asked */
  for (int round = 0; round < 6; round++) {
    uint64_t seed = 100 + (uint64_t)round;
    check_put(rt, h, n, seed);
    dmem_tier_t tier = round % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST;
    CHECK_OK(dmem_buffer_spill(rt, h, tier));
    CHECK_EQ(state_of(rt, h),
             tier == DMEM_TIER_DISK ? DMEM_STATE_DEFERRED_DISK : DMEM_STATE_DEFERRED_HOST);
    CHECK_UEQ(device_used(rt), 0); /* unmapped and released */
    CHECK_TRUE(!dmem__stable_mapped(p0));
    if (round == 2) CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_DISK)); /* host -> disk (round 2: host) */
    if (round % 3 == 0) CHECK_OK(dmem_buffer_unspill(rt, h, NULL));
    void *p = lock_ptr(rt, h);
    CHECK_TRUE(p == p0);
    CHECK_UEQ(device_used(rt), 2 * g);
    if (p) CHECK_OK(dmem_buffer_unlock(rt, h));
    CHECK_UEQ(check_bad_bytes(rt, h, n, seed), 0);
  }
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_UEQ(info.spill_count, 6 + 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_UEQ(device_used(rt), 0);
  CHECK_UEQ(dmem__stable_size(p0), 0); /* the range is gone */
  dmem_runtime_destroy(rt);
}

TEST_CASE(bad_flags_and_sizes) {
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(4 * g, 0, NULL);
  dmem_handle_t h = 42;
  CHECK_STATUS(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS | DMEM_ALLOC_PINNED, &h),
               DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, g, 1u << 7, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, 0, DMEM_BUFFER_STABLE_ADDRESS, &h), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, 4 * g + 1, DMEM_BUFFER_STABLE_ADDRESS, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(dmem_buffer_alloc(rt, SIZE_MAX, DMEM_BUFFER_STABLE_ADDRESS, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_UEQ(h, 42); /* untouched on failure */
  CHECK_UEQ(device_used(rt), 0);
  /* a full limit of locked stable buffers: the next one cannot be mapped */
  dmem_handle_t a, b;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * g, DMEM_BUFFER_STABLE_ADDRESS, &a));
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * g, DMEM_BUFFER_STABLE_ADDRESS, &b));
  void *pa = lock_ptr(rt, a), *pb = lock_ptr(rt, b);
  CHECK_STATUS(dmem_buffer_alloc(rt, 1, DMEM_BUFFER_STABLE_ADDRESS, &h), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_UEQ(h, 42);
  CHECK_UEQ(device_used(rt), 4 * g);
  if (pa) CHECK_OK(dmem_buffer_unlock(rt, a));
  if (pb) CHECK_OK(dmem_buffer_unlock(rt, b));
  CHECK_OK(dmem_buffer_alloc(rt, 1, DMEM_BUFFER_STABLE_ADDRESS, &h)); /* spills a or b */
  CHECK_UEQ(device_used(rt), 3 * g); /* one of 2 granules, and 1 byte's granule */
  CHECK_OK(dmem_buffer_free(rt, a));
  CHECK_OK(dmem_buffer_free(rt, b));
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_UEQ(device_used(rt), 0);
  dmem_runtime_destroy(rt);
}

/* Locking a spilled stable buffer when nothing else can be spilled: the
 * same status as for an ordinary buffer, the bytes stay spilled and intact,
 * and once room is made the address comes back. */
TEST_CASE(remap_out_of_memory_keeps_bytes) {
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(4 * g, 0, NULL);
  dmem_handle_t s, o1, o2;
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * g, DMEM_BUFFER_STABLE_ADDRESS, &s));
  check_put(rt, s, 2 * g, 7);
  void *p0 = lock_ptr(rt, s);
  REQUIRE_TRUE(p0 != NULL);
  CHECK_OK(dmem_buffer_unlock(rt, s));
  CHECK_OK(dmem_buffer_spill(rt, s, DMEM_TIER_HOST));
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * g, 0, &o1));
  REQUIRE_OK(dmem_buffer_alloc(rt, 2 * g, 0, &o2));
  void *q1 = lock_ptr(rt, o1), *q2 = lock_ptr(rt, o2);
  void *p = NULL;
  CHECK_STATUS(dmem_buffer_lock(rt, s, NULL, &p), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_STATUS(dmem_buffer_unspill(rt, s, NULL), DMEM_ERR_OUT_OF_MEMORY);
  CHECK_EQ(state_of(rt, s), DMEM_STATE_DEFERRED_HOST);
  CHECK_TRUE(!dmem__stable_mapped(p0));
  CHECK_UEQ(device_used(rt), 4 * g);
  if (q1) CHECK_OK(dmem_buffer_unlock(rt, o1));
  p = lock_ptr(rt, s); /* evicts o1 */
  CHECK_TRUE(p == p0);
  if (p) CHECK_OK(dmem_buffer_unlock(rt, s));
  CHECK_UEQ(check_bad_bytes(rt, s, 2 * g, 7), 0);
  if (q2) CHECK_OK(dmem_buffer_unlock(rt, o2));
  CHECK_OK(dmem_buffer_free(rt, s));
  CHECK_OK(dmem_buffer_free(rt, o1));
  CHECK_OK(dmem_buffer_free(rt, o2));
  CHECK_UEQ(device_used(rt), 0);
  dmem_runtime_destroy(rt);
}

/* Many stable and ordinary buffers at 3x the limit: every lock evicts
 * others (stable ones one by one, ordinary ones in batches); each stable
 * buffer always comes back at its first address, every byte intact. */
TEST_CASE(many_mixed_under_pressure) {
  char dir[512];
  check_mkdtemp(dir, sizeof dir, "stable");
  size_t g = backend_granule();
  enum { N = 48 };
  /* the host tier holds a third: the rest goes on to disk */
  dmem_runtime_t *rt = runtime_with(16 * g, 12 * g, dir);
  dmem_handle_t h[N];
  size_t sz[N];
  void *addr[N];
  uint64_t seed[N];
  for (int i = 0; i < N; i++) {
    bool stable = i % 3 != 2;
    sz[i] = stable ? g / 2 + (size_t)i * 97 : g / 3 + (size_t)i * 31;
    REQUIRE_OK(dmem_buffer_alloc(rt, sz[i], stable ? DMEM_BUFFER_STABLE_ADDRESS : 0, &h[i]));
    seed[i] = 1000 + (uint64_t)i;
    check_put(rt, h[i], sz[i], seed[i]);
    addr[i] = stable ? lock_ptr(rt, h[i]) : NULL;
    if (stable) {
      REQUIRE_TRUE(addr[i] != NULL);
      CHECK_OK(dmem_buffer_unlock(rt, h[i]));
    }
    CHECK_TRUE(device_used(rt) <= 16 * g);
  }
  uint64_t x = 12345;
  for (int step = 0; step < 4 * N; step++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    int i = (int)((x >> 33) % N);
    void *p = lock_ptr(rt, h[i]);
    CHECK_TRUE(p != NULL);
    if (!p) continue;
    if (addr[i]) CHECK_TRUE(p == addr[i]);
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
    CHECK_UEQ(check_bad_bytes(rt, h[i], sz[i], seed[i]), 0);
    if (step % 5 == 0) { /* new content, then moved again */
      seed[i] += N;
      check_put(rt, h[i], sz[i], seed[i]);
    }
    CHECK_TRUE(device_used(rt) <= 16 * g);
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_GT(s.spill_count, N);
  for (int i = 0; i < N; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], sz[i], seed[i]), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_UEQ(device_used(rt), 0);
  dmem_runtime_destroy(rt);
}

/* Only stable buffers, more than the limit holds: on-demand eviction must
 * spill them (they never join a batch). */
TEST_CASE(eviction_of_stable_only) {
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(4 * g, 0, NULL);
  dmem_handle_t h[10];
  void *a[10];
  for (int i = 0; i < 10; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS, &h[i]));
    check_put(rt, h[i], g, (uint64_t)i + 1);
    a[i] = lock_ptr(rt, h[i]);
    REQUIRE_TRUE(a[i] != NULL);
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  CHECK_UEQ(device_used(rt), 4 * g);
  CHECK_OK(dmem_runtime_evict(rt, 2 * g, NULL));
  CHECK_TRUE(device_used(rt) <= 2 * g);
  for (int i = 9; i >= 0; i--) {
    void *p = lock_ptr(rt, h[i]);
    CHECK_TRUE(p == a[i]);
    if (p) CHECK_OK(dmem_buffer_unlock(rt, h[i]));
    CHECK_UEQ(check_bad_bytes(rt, h[i], g, (uint64_t)i + 1), 0);
  }
  /* prefetch a batch of them back (three fit with room to spare) */
  CHECK_OK(dmem_buffer_spill(rt, h[0], DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_prefetch(rt, h, 3, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_EQ(state_of(rt, h[0]), DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h[0], g, 1), 0);
  /* read in place, spilled */
  CHECK_OK(dmem_buffer_spill(rt, h[1], DMEM_TIER_HOST));
  unsigned char *buf = malloc(g);
  CHECK_OK(dmem_buffer_read(rt, h[1], 0, buf, g));
  CHECK_UEQ(check_verify(buf, g, 2), 0);
  free(buf);
  for (int i = 0; i < 10; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_UEQ(device_used(rt), 0);
  dmem_runtime_destroy(rt);
}

/* Freed in every place: resident, locked (reclaimed at the last unlock),
 * on the host tier, on disk. Nothing stays charged or reserved. */
TEST_CASE(free_anywhere) {
  char dir[512];
  check_mkdtemp(dir, sizeof dir, "stable");
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(8 * g, 0, dir);
  dmem_handle_t h[4];
  void *a[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS, &h[i]));
    a[i] = lock_ptr(rt, h[i]);
    REQUIRE_TRUE(a[i] != NULL);
    if (i != 1) CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  CHECK_OK(dmem_buffer_spill(rt, h[2], DMEM_TIER_HOST));
  CHECK_OK(dmem_buffer_spill(rt, h[3], DMEM_TIER_DISK));
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_UEQ(device_used(rt), g); /* h[1] stays locked */
  CHECK_UEQ(dmem__stable_size(a[1]), g);
  CHECK_OK(dmem_buffer_unlock(rt, h[1])); /* reclaimed now */
  CHECK_UEQ(device_used(rt), 0);
  for (int i = 0; i < 4; i++) CHECK_UEQ(dmem__stable_size(a[i]), 0);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  /* left live at destroy: destroy gives them back */
  REQUIRE_OK(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS, &h[0]));
  REQUIRE_OK(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS, &h[1]));
  void *p0 = lock_ptr(rt, h[0]);
  CHECK_OK(dmem_buffer_spill(rt, h[1], DMEM_TIER_HOST));
  dmem_runtime_destroy(rt);
  CHECK_UEQ(dmem__stable_size(p0), 0);
}

/* The host backend's simulation: a spilled stable buffer's range is not
 * accessible (an access faults, as on a GPU), mapped again after unspill. */
TEST_CASE(unmapped_range_faults) {
  const char *be = getenv("DMEM_BACKEND");
  if (be && strcmp(be, "host") != 0) SKIP_CASE("the host backend's simulation");
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(4 * g, 0, NULL);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS, &h));
  check_put(rt, h, g, 3);
  volatile unsigned char *p = lock_ptr(rt, h);
  REQUIRE_TRUE(p != NULL);
  CHECK_OK(dmem_buffer_unlock(rt, h));
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  fflush(NULL);
  pid_t pid = fork();
  REQUIRE_TRUE(pid >= 0);
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL);
    unsigned char c = p[g / 2]; /* must fault */
    _exit(c == 0xFF ? 3 : 4);
  }
  int status = 0;
  REQUIRE_EQ(waitpid(pid, &status, 0), pid);
  CHECK_TRUE(WIFSIGNALED(status));
  if (WIFSIGNALED(status)) CHECK_EQ(WTERMSIG(status), SIGSEGV);
  void *q = lock_ptr(rt, h);
  CHECK_TRUE(q == (void *)p);
  if (q) {
    CHECK_OK(dmem_stream_synchronize(rt, NULL)); /* the unspill copy is ordered before it */
    CHECK_UEQ(check_verify(q, g, 3), 0); /* readable in place again */
    CHECK_OK(dmem_buffer_unlock(rt, h));
  }
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* ---- races ------------------------------------------------------------------- */

enum { RN = 12 };
typedef struct race {
  dmem_runtime_t *rt;
  dmem_handle_t h[RN];
  size_t size[RN];
  void *addr[RN];
  atomic_int stop;
  atomic_long locks, wrong_addr, wrong_bytes, bad_status;
} race_t;

static bool documented_lock(dmem_status_t st) {
  return st == DMEM_OK || st == DMEM_ERR_BUSY || st == DMEM_ERR_OUT_OF_MEMORY;
}

/* Lock, check the address and the buffer's first and last 8 bytes (each
 * buffer keeps the pattern of its index), unlock. */
static void *race_locker(void *arg) {
  race_t *r = arg;
  dmem_stream_t s = NULL;
  if (dmem_stream_create(r->rt, &s) != DMEM_OK) abort();
  unsigned x = (unsigned)(uintptr_t)&s;
  unsigned char want[16], got[16];
  while (!atomic_load(&r->stop)) {
    x = x * 1103515245u + 12345u;
    int i = (int)((x >> 8) % RN);
    void *p = NULL;
    dmem_status_t st = dmem_buffer_lock(r->rt, r->h[i], s, &p);
    if (!documented_lock(st)) atomic_fetch_add(&r->bad_status, 1);
    if (st != DMEM_OK) continue;
    atomic_fetch_add(&r->locks, 1);
    if (r->addr[i] && p != r->addr[i]) atomic_fetch_add(&r->wrong_addr, 1);
    size_t n = r->size[i];
    unsigned char *full = malloc(n);
    check_fill(full, n, (uint64_t)i + 77);
    memcpy(want, full, 8);
    memcpy(want + 8, full + n - 8, 8);
    free(full);
    dmem_status_t c1 = dmem_stream_copy(r->rt, got, p, 8, s);
    dmem_status_t c2 = dmem_stream_copy(r->rt, got + 8, (char *)p + n - 8, 8, s);
    dmem_status_t sy = dmem_stream_synchronize(r->rt, s);
    if (c1 != DMEM_OK || c2 != DMEM_OK || sy != DMEM_OK || memcmp(want, got, 16) != 0)
      atomic_fetch_add(&r->wrong_bytes, 1);
    if (dmem_buffer_unlock(r->rt, r->h[i]) != DMEM_OK) atomic_fetch_add(&r->bad_status, 1);
  }
  dmem_stream_destroy(r->rt, s);
  return NULL;
}

static void *race_mover(void *arg) {
  race_t *r = arg;
  unsigned x = 99;
  while (!atomic_load(&r->stop)) {
    x = x * 1103515245u + 12345u;
    int i = (int)((x >> 8) % RN);
    dmem_status_t st;
    switch ((x >> 20) % 4) {
      case 0: st = dmem_buffer_spill(r->rt, r->h[i], DMEM_TIER_HOST); break;
      case 1: st = dmem_buffer_spill(r->rt, r->h[i], DMEM_TIER_DISK); break;
      case 2: st = dmem_buffer_unspill(r->rt, r->h[i], NULL); break;
      default: st = dmem_runtime_evict(r->rt, r->size[i], NULL); break;
    }
    /* BUSY: locked or moving; INVALID_ARGUMENT: disk -> host is no move */
    if (st != DMEM_OK && st != DMEM_ERR_BUSY && st != DMEM_ERR_INVALID_ARGUMENT &&
        st != DMEM_ERR_OUT_OF_MEMORY)
      atomic_fetch_add(&r->bad_status, 1);
  }
  return NULL;
}

TEST_CASE(races_lock_spill_evict) {
  char dir[512];
  check_mkdtemp(dir, sizeof dir, "stable");
  size_t g = backend_granule();
  static race_t r;
  memset(&r, 0, sizeof r);
  r.rt = runtime_with(8 * g, 0, dir);
  for (int i = 0; i < RN; i++) {
    r.size[i] = i % 4 == 3 ? g / 2 : g; /* a quarter ordinary */
    REQUIRE_OK(dmem_buffer_alloc(r.rt, r.size[i], i % 4 == 3 ? 0 : DMEM_BUFFER_STABLE_ADDRESS, &r.h[i]));
    check_put(r.rt, r.h[i], r.size[i], (uint64_t)i + 77);
    void *p = lock_ptr(r.rt, r.h[i]);
    REQUIRE_TRUE(p != NULL);
    CHECK_OK(dmem_buffer_unlock(r.rt, r.h[i]));
    /* ordinary buffers move: their address is not checked */
    r.addr[i] = i % 4 == 3 ? NULL : p;
  }
  pthread_t t[4];
  for (int k = 0; k < 3; k++) REQUIRE_EQ(pthread_create(&t[k], NULL, race_locker, &r), 0);
  REQUIRE_EQ(pthread_create(&t[3], NULL, race_mover, &r), 0);
  usleep(1500 * 1000);
  atomic_store(&r.stop, 1);
  for (int k = 0; k < 4; k++) pthread_join(t[k], NULL);
  fprintf(stderr, "races: %ld locks\n", (long)atomic_load(&r.locks));
  CHECK_GT(atomic_load(&r.locks), 10);
  CHECK_EQ(atomic_load(&r.wrong_bytes), 0);
  CHECK_EQ(atomic_load(&r.bad_status), 0);
  CHECK_EQ(atomic_load(&r.wrong_addr), 0);
  for (int i = 0; i < RN; i++) CHECK_UEQ(check_bad_bytes(r.rt, r.h[i], r.size[i], (uint64_t)i + 77), 0);
  for (int i = 0; i < RN; i++) CHECK_OK(dmem_buffer_free(r.rt, r.h[i]));
  CHECK_UEQ(device_used(r.rt), 0);
  dmem_runtime_destroy(r.rt);
}

/* ---- graph-style replay -------------------------------------------------------- */

/* The docs/stable.md pattern without CUDA: "capture" the buffers' pointers
 * once (a CUDA graph would bake them in), then before each replay lock the
 * buffers through dmem_launch_async, whose launch function checks that
 * the pointers it gets are the captured ones and replays the recorded work
 * (b[i] = b[i-1]: a copy between buffers, stream-ordered), after spills of
 * every buffer. */
typedef struct graph {
  dmem_runtime_t *rt;
  void *captured[4];
  size_t n;
  int mismatches;
} graph_t;

static dmem_status_t replay(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  graph_t *gr = user;
  for (size_t i = 0; i < n; i++)
    if (ptrs[i] != gr->captured[i]) gr->mismatches++;
  /* the "graph": captured pointers, not the ones passed */
  for (size_t i = 1; i < n; i++) {
    dmem_status_t st = dmem_stream_copy(gr->rt, gr->captured[i], gr->captured[i - 1], gr->n, s);
    if (st != DMEM_OK) return st;
  }
  return DMEM_OK;
}

TEST_CASE(graph_replay_after_spills) {
  char dir[512];
  check_mkdtemp(dir, sizeof dir, "stable");
  size_t g = backend_granule();
  dmem_runtime_t *rt = runtime_with(8 * g, 0, dir);
  static graph_t gr;
  memset(&gr, 0, sizeof gr);
  gr.rt = rt;
  gr.n = g;
  dmem_handle_t h[4];
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, g, DMEM_BUFFER_STABLE_ADDRESS, &h[i]));
    gr.captured[i] = lock_ptr(rt, h[i]);
    REQUIRE_TRUE(gr.captured[i] != NULL);
    CHECK_OK(dmem_buffer_unlock(rt, h[i]));
  }
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  for (int round = 0; round < 5; round++) {
    uint64_t seed = 500 + (uint64_t)round;
    check_put(rt, h[0], g, seed);
    for (int i = 0; i < 4; i++)
      CHECK_OK(dmem_buffer_spill(rt, h[i], round % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST));
    CHECK_UEQ(device_used(rt), 0);
    CHECK_OK(dmem_launch_async(rt, s, h, 4, replay, &gr));
    CHECK_OK(dmem_sync_and_unlock(rt, s));
    for (int i = 0; i < 4; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], g, seed), 0);
  }
  CHECK_EQ(gr.mismatches, 0);
  CHECK_OK(dmem_stream_destroy(rt, s));
  for (int i = 0; i < 4; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
}
