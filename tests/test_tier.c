/* The tier chain as data (spill/tier.c): the build's table holds its rules
 * (every next chain ends, batches only on the first row, pipelined only
 * with load_device, ...), the check refuses tables that break them (a
 * circle of next tiers among them), and a buffer spilled into each row's
 * tier, moved on down the chain by a full store, pushed down past the
 * limit, or evicted as a batch, comes back with its bytes.
 *
 * White-box: the table and its check are internal (runtime/internal.h). */
#include <pthread.h>
#include <string.h>

#include "check.h"
#include "api/api.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static const dmem__tier_row_t *rows_of_build(size_t *n) {
  const dmem__tier_row_t *rows = dmem__tier_rows(n);
  if (!rows || *n < 1 || *n >= DMEM__NTIERS) {
    fprintf(stderr, "dmem__tier_rows: %zu rows\n", *n);
    abort();
  }
  return rows;
}

static size_t row_index(const dmem__tier_row_t *rows, size_t n, const dmem__tier_ops_t *t) {
  for (size_t i = 0; i < n; i++)
    if (rows[i].ops == t) return i;
  return n;
}

TEST_CASE(tier_table_of_the_build_holds_its_rules) {
  size_t n;
  const dmem__tier_row_t *rows = rows_of_build(&n);
  char why[160] = "";
  CHECK_TRUE(dmem__tier_table_check(rows, n, why, sizeof why));
  if (why[0]) fprintf(stderr, "why: %s\n", why);
  for (size_t i = 0; i < n; i++) {
    const dmem__tier_ops_t *t = rows[i].ops;
    /* every lookup finds the row itself */
    CHECK_TRUE(dmem__tier_of(t->tier) == t);
    CHECK_TRUE(dmem__tier_of_state(t->state) == t);
    CHECK_TRUE(dmem__tier_row_of_state(t->state) == &rows[i]);
    CHECK_TRUE(dmem__tier_row(t) == &rows[i]);
    CHECK_EQ((int)dmem__tier_public(t->state), (int)t->tier);
    /* its next chain ends within n steps, at a row with no next */
    size_t at = i, steps = 0;
    while (rows[at].next && steps <= n) {
      at = row_index(rows, n, rows[at].next);
      REQUIRE_TRUE(at < n);
      steps++;
    }
    CHECK_LE(steps, n - 1);
    if (rows[i].batch) CHECK_EQ(i, (size_t)0);
    if (rows[i].pipelined) CHECK_TRUE(t->load_device != NULL);
  }
  CHECK_TRUE(dmem__tier_of(DMEM_TIER_DEVICE) == NULL);
  CHECK_TRUE(dmem__tier_of_state(DMEM_STATE_RESIDENT) == NULL);
  CHECK_TRUE(dmem__tier_of_state(DMEM_STATE_SPILLING) == NULL);
  CHECK_EQ((int)dmem__tier_public(DMEM_STATE_RESIDENT), (int)DMEM_TIER_DEVICE);
  /* the documented chain: evictions go to the host tier, then on to disk */
  CHECK_TRUE(dmem__tier_top() == rows[0].ops);
  CHECK_STR(rows[0].ops->name, "host");
  REQUIRE_TRUE(rows[0].next != NULL);
  CHECK_STR(rows[0].next->name, "disk");
  CHECK_TRUE(dmem__tier_row(rows[0].next)->next == NULL);
}

/* A copy of the build's table to break, at most 8 rows. */
static size_t copy_rows(dmem__tier_row_t *out) {
  size_t n;
  const dmem__tier_row_t *rows = rows_of_build(&n);
  if (n > 8) abort();
  memcpy(out, rows, n * sizeof *rows);
  return n;
}

static void expect_refused(const dmem__tier_row_t *rows, size_t n, const char *want) {
  char why[160] = "";
  CHECK_TRUE(!dmem__tier_table_check(rows, n, why, sizeof why));
  if (!strstr(why, want)) {
    fprintf(stderr, "why: \"%s\", expected it to say \"%s\"\n", why, want);
    CHECK_TRUE(strstr(why, want) != NULL);
  }
}

TEST_CASE(tier_table_check_refuses_a_circle_of_next_tiers) {
  dmem__tier_row_t rows[8];
  size_t n = copy_rows(rows);
  size_t host = row_index(rows, n, &dmem__tier_host), disk = row_index(rows, n, &dmem__tier_disk),
         ctl = row_index(rows, n, &dmem__tier_controller);
  REQUIRE_TRUE(host < n && disk < n && ctl < n);
  /* host -> disk -> host */
  rows[disk].next = &dmem__tier_host;
  expect_refused(rows, n, "comes back round");
  /* host -> disk -> controller -> host: no two rows name each other */
  n = copy_rows(rows);
  rows[host].next = &dmem__tier_disk;
  rows[disk].next = &dmem__tier_controller;
  rows[ctl].next = &dmem__tier_host;
  expect_refused(rows, n, "comes back round");
  /* a row that is its own next */
  n = copy_rows(rows);
  rows[ctl].next = &dmem__tier_controller;
  expect_refused(rows, n, "comes back round");
  /* and the same chain without the circle holds */
  n = copy_rows(rows);
  rows[disk].next = &dmem__tier_controller;
  CHECK_TRUE(dmem__tier_table_check(rows, n, NULL, 0));
}

TEST_CASE(tier_table_check_refuses_broken_rows) {
  dmem__tier_row_t rows[8];
  size_t n = copy_rows(rows);
  size_t host = row_index(rows, n, &dmem__tier_host), disk = row_index(rows, n, &dmem__tier_disk),
         ctl = row_index(rows, n, &dmem__tier_controller);
  REQUIRE_TRUE(host == 0 && disk < n && ctl < n);
  expect_refused(rows, 0, "no tiers");
  /* batches on a row other than the first, or into a tier without charge_n */
  rows[disk].batch = true;
  expect_refused(rows, n, "batches go only to the first row");
  n = copy_rows(rows);
  rows[0] = rows[ctl];
  rows[ctl] = (dmem__tier_row_t){.ops = &dmem__tier_host, .next = &dmem__tier_disk};
  rows[0].batch = true;
  expect_refused(rows, n, "batches go only to the first row");
  /* pipelined without load_device */
  n = copy_rows(rows);
  rows[ctl].pipelined = dmem__disk_pipelined;
  expect_refused(rows, n, "pipelined without load_device");
  /* a limit (the host tier's) with nowhere to push down to */
  n = copy_rows(rows);
  rows[host].next = NULL;
  expect_refused(rows, n, "a limit but no next tier");
  /* a limit on a tier that does not keep its bytes pinned: no push-down
   * can move out of it */
  n = copy_rows(rows);
  dmem__tier_ops_t unpinned = dmem__tier_host;
  unpinned.adopts_staging = false;
  rows[host].ops = &unpinned;
  rows[host].batch = false;
  expect_refused(rows, n, "only a tier that keeps its bytes pinned");
  /* a next tier without a row */
  n = copy_rows(rows);
  rows[disk] = rows[ctl];
  expect_refused(rows, n - 1, "next tier has no row");
  /* one tier in two rows */
  n = copy_rows(rows);
  rows[ctl] = rows[disk];
  expect_refused(rows, n, "share a tier or a state");
  /* a tier whose value is not one of the public tiers */
  n = copy_rows(rows);
  dmem__tier_ops_t odd = dmem__tier_controller;
  odd.tier = (dmem_tier_t)DMEM__NTIERS;
  rows[ctl].ops = &odd;
  expect_refused(rows, n, "is not one of");
  /* a tier held in a state that is not deferred */
  odd = dmem__tier_controller;
  odd.state = DMEM_STATE_UNSPILLING;
  expect_refused(rows, n, "not a deferred state");
}

/* ---- bytes through every tier (host backend) ------------------------------------- */

/* A controller that keeps copies in malloc'd slots. */
#define SLOTS 64
typedef struct keeper {
  pthread_mutex_t mu;
  dmem_handle_t h[SLOTS];
  void *data[SLOTS];
  size_t size[SLOTS];
} keeper_t;

static dmem_status_t keep_store(void *user, dmem_handle_t h, const void *data, size_t size) {
  keeper_t *k = user;
  void *copy = malloc(size);
  if (!copy) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  memcpy(copy, data, size);
  pthread_mutex_lock(&k->mu);
  int at = -1;
  for (int i = 0; i < SLOTS; i++)
    if (k->h[i] == h || (at < 0 && !k->h[i])) at = i;
  if (at >= 0) {
    free(k->data[at]);
    k->h[at] = h;
    k->data[at] = copy;
    k->size[at] = size;
  }
  pthread_mutex_unlock(&k->mu);
  if (at < 0) free(copy);
  return at < 0 ? DMEM_ERR_HOST_OUT_OF_MEMORY : DMEM_OK;
}

static dmem_status_t keep_retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  keeper_t *k = user;
  dmem_status_t st = DMEM_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&k->mu);
  for (int i = 0; i < SLOTS; i++)
    if (k->h[i] == h && k->size[i] == size) {
      memcpy(out, k->data[i], size);
      st = DMEM_OK;
    }
  pthread_mutex_unlock(&k->mu);
  return st;
}

static void keeper_free(keeper_t *k) {
  for (int i = 0; i < SLOTS; i++) free(k->data[i]);
}

/* The host backend, unless DMEM_BACKEND says otherwise (cuda.tier.* runs
 * these cases again on the CUDA backend). */
static dmem_runtime_t *host_runtime(size_t limit, size_t host_limit, char *dir, size_t dir_len) {
  check_mkdtemp(dir, dir_len, "dmem-tier-test-");
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST; /* cuda.tier.*: CUDA */
  cfg.device_limit = limit;
  cfg.host_limit = host_limit;
  cfg.spill_dir = dir;
  return check_runtime_cfg(&cfg);
}

static dmem_state_t state_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) return (dmem_state_t)-1;
  return info.state;
}

TEST_CASE(tier_every_row_keeps_the_bytes_through_spill_and_retrieve) {
  char dir[512];
  dmem_runtime_t *rt = host_runtime(64 * MiB, 0, dir, sizeof dir);
  static keeper_t k = {.mu = PTHREAD_MUTEX_INITIALIZER};
  dmem_controller_t c = {.struct_size = sizeof c, .user = &k, .store = keep_store,
                         .retrieve = keep_retrieve};
  REQUIRE_OK(dmem_controller_set(rt, &c));
  size_t n;
  const dmem__tier_row_t *rows = rows_of_build(&n);
  for (size_t i = 0; i < n; i++) {
    const dmem__tier_ops_t *t = rows[i].ops;
    const size_t size = 3 * MiB + 123; /* several disk chunks, and a ragged end */
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h));
    check_put(rt, h, size, 100 + i);
    /* the lock path: spill into the tier, lock brings it back */
    CHECK_OK(dmem_buffer_spill(rt, h, t->tier));
    CHECK_EQ((int)state_of(rt, h), (int)t->state);
    if (t->read) {
      char head[64];
      CHECK_OK(dmem_buffer_read(rt, h, 0, head, sizeof head));
      CHECK_UEQ(check_verify(head, sizeof head, 100 + i), 0);
      CHECK_EQ((int)state_of(rt, h), (int)t->state); /* read in place */
    }
    CHECK_UEQ(check_bad_bytes(rt, h, size, 100 + i), 0);
    CHECK_EQ((int)state_of(rt, h), (int)DMEM_STATE_RESIDENT);
    /* the unspill path, twice (staging of the last unspill reused) */
    for (int round = 0; round < 2; round++) {
      CHECK_OK(dmem_buffer_spill(rt, h, t->tier));
      CHECK_EQ((int)state_of(rt, h), (int)t->state);
      CHECK_OK(dmem_buffer_unspill(rt, h, NULL));
      CHECK_OK(dmem_stream_synchronize(rt, NULL));
      CHECK_EQ((int)state_of(rt, h), (int)DMEM_STATE_RESIDENT);
      CHECK_UEQ(check_bad_bytes(rt, h, size, 100 + i), 0);
    }
    /* a tier change from a tier that keeps the bytes pinned, to each next
     * tier down the chain */
    if (t->adopts_staging) {
      CHECK_OK(dmem_buffer_spill(rt, h, t->tier));
      for (const dmem__tier_ops_t *d = rows[i].next; d; d = dmem__tier_row(d)->next) {
        CHECK_OK(dmem_buffer_spill(rt, h, d->tier));
        CHECK_EQ((int)state_of(rt, h), (int)d->state);
        if (!d->adopts_staging) break; /* no tier change from there */
      }
      CHECK_UEQ(check_bad_bytes(rt, h, size, 100 + i), 0);
    }
    CHECK_OK(dmem_buffer_free(rt, h));
  }
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.host_used, 0);
  CHECK_UEQ(s.disk_used, 0);
  CHECK_OK(dmem_controller_set(rt, NULL));
  dmem_runtime_destroy(rt);
  keeper_free(&k);
}

/* A store the first tier refuses as full goes on to its next tier (the host
 * tier past its cap: the disk), and the bytes come back. */
TEST_CASE(tier_full_store_goes_on_to_the_next_tier) {
  char dir[512];
  const dmem__tier_row_t *top = dmem__tier_row(dmem__tier_top());
  REQUIRE_TRUE(top->next != NULL && top->ops->limit != NULL);
  dmem_runtime_t *rt = host_runtime(64 * MiB, 1 * MiB, dir, sizeof dir);
  REQUIRE_UEQ(top->ops->limit(rt), 1 * MiB);
  dmem_handle_t h;
  const size_t size = 2 * MiB; /* larger than the limit: refused */
  REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h));
  check_put(rt, h, size, 7);
  CHECK_OK(dmem_buffer_spill(rt, h, top->ops->tier));
  CHECK_EQ((int)state_of(rt, h), (int)top->next->state);
  CHECK_UEQ(check_bad_bytes(rt, h, size, 7), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}

/* Past its limit the first tier is pushed down to its next tier by the I/O
 * threads, least recently used first; every byte survives. */
TEST_CASE(tier_pushdown_walks_to_the_next_tier) {
  char dir[512];
  const dmem__tier_row_t *top = dmem__tier_row(dmem__tier_top());
  REQUIRE_TRUE(top->next != NULL && top->ops->limit != NULL);
  dmem_runtime_t *rt = host_runtime(64 * MiB, 4 * MiB, dir, sizeof dir);
  enum { N = 8 };
  dmem_handle_t h[N];
  const size_t size = 1 * MiB;
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h[i]));
    check_put(rt, h[i], size, 200 + (uint64_t)i);
  }
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_spill(rt, h[i], top->ops->tier));
  dmem__io_quiesce(rt->io);
  CHECK_LE(top->ops->used(rt), 4 * MiB);
  int below = 0;
  for (int i = 0; i < N; i++) below += state_of(rt, h[i]) == (dmem_state_t)top->next->state;
  CHECK_GE(below, N - 4);
  CHECK_EQ((int)state_of(rt, h[0]), (int)top->next->state); /* the least recently used */
  CHECK_UEQ(dmem_atomic_load_relaxed(&rt->tier_pushing[top->ops->tier]), 0);
  for (int i = 0; i < N; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], size, 200 + (uint64_t)i), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
}

/* Eviction batches go to the row that takes them (the first), admitted at
 * once; the victims come back intact. */
TEST_CASE(tier_eviction_batch_goes_to_the_batch_row) {
  char dir[512];
  const dmem__tier_row_t *top = dmem__tier_row(dmem__tier_top());
  REQUIRE_TRUE(top->batch);
  dmem_runtime_t *rt = host_runtime(64 * MiB, 0, dir, sizeof dir);
  enum { N = 32 };
  dmem_handle_t h[N];
  const size_t size = 64 * KiB;
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, size, 0, &h[i]));
    check_put(rt, h[i], size, 300 + (uint64_t)i);
  }
  dmem_stats_t before, after;
  REQUIRE_OK(dmem_stats(rt, &before));
  size_t freed = 0;
  CHECK_OK(dmem_runtime_evict(rt, N * size, &freed));
  CHECK_UEQ(freed, N * size);
  REQUIRE_OK(dmem_stats(rt, &after));
  CHECK_UEQ(after.host_used, before.host_used + N * size);
  for (int i = 0; i < N; i++) CHECK_EQ((int)state_of(rt, h[i]), (int)top->ops->state);
  for (int i = 0; i < N; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], size, 300 + (uint64_t)i), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
}

