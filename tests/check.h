/*
 * tests/check.h - the test helper: cases, typed checks, one binary per area.
 *
 *   TEST_CASE(name) { ... }       a case; each case is its own CTest test
 *                                 (tests/CMakeLists.txt finds them by regex)
 *   CHECK_*(...)  continue on failure (the case still fails)
 *   REQUIRE_*(...) stop the case on failure
 *   SKIP(reason)  exit 77 (CTest "skipped"), from anywhere in a case
 *   SKIP_CASE(reason)  in the case's own body: return from it as skipped;
 *                 the binary exits 77 when it ran that case alone, and goes
 *                 on to the next case when it runs them all (the
 *                 compute-sanitizer runs), printing "[skip]"
 *
 * Run `binary` for every case, `binary name` for one, `binary --list`.
 */
#ifndef DMEM_TEST_CHECK_H
#define DMEM_TEST_CHECK_H

#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dmem/dmem.h>

typedef void (*check_fn)(void);
static struct { const char *name; check_fn fn; } check_cases_[256];
static int check_ncases_;
static int check_failed_;
static int check_skipped_;

static inline void check_register_(const char *name, check_fn fn) {
  if (check_ncases_ < 256) {
    check_cases_[check_ncases_].name = name;
    check_cases_[check_ncases_].fn = fn;
    check_ncases_++;
  }
}

#define TEST_CASE(name)                                                               \
  static void test_##name(void);                                                      \
  __attribute__((constructor)) static void check_reg_##name(void) {                  \
    check_register_(#name, test_##name);                                              \
  }                                                                                   \
  static void test_##name(void)

#define CHECK_FAIL_(stop, ...)                                     \
  do {                                                             \
    fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                \
    fprintf(stderr, __VA_ARGS__);                                  \
    fprintf(stderr, "\n");                                         \
    check_failed_ = 1;                                             \
    if (stop) return;                                              \
  } while (0)

#define CHECK_CMP_(stop, a, op, b)                                                       \
  do {                                                                                   \
    long long check_a_ = (long long)(a), check_b_ = (long long)(b);                      \
    if (!(check_a_ op check_b_))                                                         \
      CHECK_FAIL_(stop, "%s %s %s: %lld vs %lld", #a, #op, #b, check_a_, check_b_);    \
  } while (0)

#define CHECK_UCMP_(stop, a, op, b)                                                      \
  do {                                                                                   \
    unsigned long long check_a_ = (unsigned long long)(a),                               \
                       check_b_ = (unsigned long long)(b);                               \
    if (!(check_a_ op check_b_))                                                         \
      CHECK_FAIL_(stop, "%s %s %s: %llu vs %llu", #a, #op, #b, check_a_, check_b_);    \
  } while (0)

#define CHECK_ST_(stop, expr, want)                                                       \
  do {                                                                                    \
    dmem_status_t check_s_ = (expr), check_w_ = (want);                                   \
    if (check_s_ != check_w_)                                                             \
      CHECK_FAIL_(stop, "%s: got %s, want %s (%s)", #expr, dmem_status_name(check_s_),   \
                  dmem_status_name(check_w_), dmem_last_error_detail());                 \
  } while (0)

#define CHECK_EQ(a, b) CHECK_CMP_(0, a, ==, b)
#define CHECK_NE(a, b) CHECK_CMP_(0, a, !=, b)
#define CHECK_LT(a, b) CHECK_CMP_(0, a, <, b)
#define CHECK_LE(a, b) CHECK_CMP_(0, a, <=, b)
#define CHECK_GT(a, b) CHECK_CMP_(0, a, >, b)
#define CHECK_GE(a, b) CHECK_CMP_(0, a, >=, b)
#define CHECK_UEQ(a, b) CHECK_UCMP_(0, a, ==, b)
#define CHECK_TRUE(x) CHECK_CMP_(0, !!(x), ==, 1)
#define CHECK_OK(expr) CHECK_ST_(0, expr, DMEM_OK)
#define CHECK_STATUS(expr, want) CHECK_ST_(0, expr, want)
#define CHECK_STR(a, b)                                                              \
  do {                                                                               \
    const char *check_a_ = (a), *check_b_ = (b);                                     \
    if (strcmp(check_a_, check_b_) != 0)                                             \
      CHECK_FAIL_(0, "%s == %s: \"%s\" vs \"%s\"", #a, #b, check_a_, check_b_);    \
  } while (0)

#define REQUIRE_EQ(a, b) CHECK_CMP_(1, a, ==, b)
#define REQUIRE_UEQ(a, b) CHECK_UCMP_(1, a, ==, b)
#define REQUIRE_TRUE(x) CHECK_CMP_(1, !!(x), ==, 1)
#define REQUIRE_OK(expr) CHECK_ST_(1, expr, DMEM_OK)
#define REQUIRE_STATUS(expr, want) CHECK_ST_(1, expr, want)

#define SKIP(...)                          \
  do {                                     \
    fprintf(stderr, "SKIP: " __VA_ARGS__); \
    fprintf(stderr, "\n");                 \
    exit(77);                              \
  } while (0)

#define SKIP_CASE(...)                     \
  do {                                     \
    fprintf(stderr, "SKIP: " __VA_ARGS__); \
    fprintf(stderr, "\n");                 \
    check_skipped_ = 1;                    \
    return;                                \
  } while (0)

/* mkdtemp of "$TMPDIR/<prefix>XXXXXX" ($TMPDIR unset or empty: /tmp) into
 * buf, or abort: the tests make their folders where the test run says, so
 * that scripts/test can check that a run leaves nothing behind. Whatever is
 * still under such a folder when the process exits (a case that stopped
 * early: SKIP, a failed REQUIRE) is removed then, by the process that made
 * it (not by a forked child). */
static char check_tmp_dirs_[16][512];
static int check_ntmp_dirs_;
static pid_t check_tmp_pid_;

static inline int check_rm_entry_(const char *path, const struct stat *st, int flag,
                                  struct FTW *ftw) {
  (void)st;
  (void)ftw;
  if (flag == FTW_DP || flag == FTW_D) {
    chmod(path, 0700);
    rmdir(path);
  } else {
    unlink(path);
  }
  return 0;
}

static inline void check_rm_tmp_dirs_(void) {
  if (getpid() != check_tmp_pid_) return;
  for (int i = 0; i < check_ntmp_dirs_; i++) {
    /* a folder made unreadable by a test: make it readable first */
    chmod(check_tmp_dirs_[i], 0700);
    nftw(check_tmp_dirs_[i], check_rm_entry_, 16, FTW_DEPTH | FTW_PHYS);
  }
}

static inline char *check_mkdtemp(char *buf, size_t n, const char *prefix) {
  const char *tmp = getenv("TMPDIR");
  snprintf(buf, n, "%s/%sXXXXXX", tmp && *tmp ? tmp : "/tmp", prefix);
  if (!mkdtemp(buf)) {
    fprintf(stderr, "mkdtemp(%s) failed\n", buf);
    abort();
  }
  if (check_ntmp_dirs_ == 0) {
    check_tmp_pid_ = getpid();
    atexit(check_rm_tmp_dirs_);
  }
  if (check_ntmp_dirs_ < 16 && strlen(buf) < sizeof check_tmp_dirs_[0])
    strcpy(check_tmp_dirs_[check_ntmp_dirs_++], buf);
  return buf;
}

/* Deterministic fill and verification of a byte pattern keyed by `seed`. */
static inline void check_fill(void *p, size_t n, uint64_t seed) {
  unsigned char *b = (unsigned char *)p;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    b[i] = (unsigned char)x;
  }
}
static inline size_t check_verify(const void *p, size_t n, uint64_t seed) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    if (b[i] != (unsigned char)x) bad++;
  }
  return bad;
}

/* Write the pattern `seed` into buffer h through a lock and a copy (the
 * default stream), or abort: setup, not the thing under test. */
static inline void check_put(dmem_runtime_t *rt, dmem_handle_t h, size_t n, uint64_t seed) {
  void *p, *tmp = malloc(n);
  check_fill(tmp, n, seed);
  if (!tmp || dmem_buffer_lock(rt, h, NULL, &p) != DMEM_OK) abort();
  dmem_stream_copy(rt, p, tmp, n, NULL);
  dmem_stream_synchronize(rt, NULL);
  dmem_buffer_unlock(rt, h);
  free(tmp);
}

/* Bytes of buffer h that differ from the pattern `seed` (all n if the lock
 * fails, with the status printed). */
static inline size_t check_bad_bytes(dmem_runtime_t *rt, dmem_handle_t h, size_t n, uint64_t seed) {
  void *p, *tmp = calloc(1, n);
  dmem_status_t st = dmem_buffer_lock(rt, h, NULL, &p);
  if (st != DMEM_OK) {
    fprintf(stderr, "lock: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
    free(tmp);
    return n;
  }
  dmem_stream_copy(rt, tmp, p, n, NULL);
  dmem_stream_synchronize(rt, NULL);
  dmem_buffer_unlock(rt, h);
  size_t bad = check_verify(tmp, n, seed);
  free(tmp);
  return bad;
}

/* A runtime from cfg, or skip the case when its backend has no device, or
 * exit(1) on any other failure: setup, not the thing under test. */
static inline dmem_runtime_t *check_runtime_cfg(const dmem_config_t *cfg) {
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(cfg, &rt);
  if (st == DMEM_ERR_NO_DEVICE) SKIP("no device for DMEM_BACKEND=%s", getenv("DMEM_BACKEND"));
  if (st != DMEM_OK) {
    fprintf(stderr, "dmem_runtime_create: %s (%s)\n", dmem_status_name(st), dmem_last_error_detail());
    exit(1);
  }
  return rt;
}

/* A runtime on the backend from DMEM_BACKEND (default host) with a small
 * simulated device; spill-ahead off unless DMEM_SPILL_AHEAD says. */
static inline dmem_runtime_t *check_runtime(size_t device_limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  /* deterministic: no background spilling unless a test asks for it */
  if (!getenv("DMEM_SPILL_AHEAD")) cfg.spill_ahead = 0;
  cfg.device_limit = device_limit;
  return check_runtime_cfg(&cfg);
}

/* check_runtime with the given eviction policy (cases about one policy's
 * order: dmem_config_t.eviction_policy). */
static inline dmem_runtime_t *check_runtime_policy(size_t device_limit,
                                                   dmem_eviction_policy_t policy) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  if (!getenv("DMEM_SPILL_AHEAD")) cfg.spill_ahead = 0;
  cfg.device_limit = device_limit;
  cfg.eviction_policy = policy;
  return check_runtime_cfg(&cfg);
}

/* runtime/backend/backend.h (the tests link dmem_static) */
#ifdef __cplusplus
extern "C"
#endif
int dmem__backend_cuda_available(void);

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--list") == 0) {
    for (int i = 0; i < check_ncases_; i++) printf("%s\n", check_cases_[i].name);
    return 0;
  }
  /* DMEM_BACKEND=cuda (the cuda.* CTest cases, tests/gpu/CMakeLists.txt):
   * the cases are there to run on a CUDA device; without one they are
   * skipped, not passed on the host backend. */
  const char *backend = getenv("DMEM_BACKEND");
  if (backend && strcmp(backend, "cuda") == 0 && !dmem__backend_cuda_available())
    SKIP("DMEM_BACKEND=cuda and no usable CUDA device");
  int ran = 0, failed = 0, skipped = 0;
  for (int i = 0; i < check_ncases_; i++) {
    if (argc > 1 && strcmp(argv[1], check_cases_[i].name) != 0) continue;
    check_failed_ = 0;
    check_skipped_ = 0;
    check_cases_[i].fn();
    ran++;
    if (check_failed_) failed++;
    else if (check_skipped_) skipped++;
    fprintf(stderr, "[%s] %s\n", check_failed_ ? "FAIL" : check_skipped_ ? "skip" : " ok ",
            check_cases_[i].name);
  }
  if (ran == 0) {
    fprintf(stderr, "no such case: %s\n", argc > 1 ? argv[1] : "(none)");
    return 2;
  }
  if (failed) return 1;
  return skipped == ran ? 77 : 0;
}

#endif /* DMEM_TEST_CHECK_H */
