/* Bad input everywhere (label `badinput`): for every public function of
 * include/dmem/ (every header), a table of its bad inputs - NULL outputs and runtimes, a
 * zero, freed, forged, out-of-range or foreign (another runtime's) handle,
 * unknown enum values and flags, sizes of 0 and SIZE_MAX, duplicate handles
 * in one call, an unlock without a lock - each with the status its header
 * documents. One fixture runtime holds buffers in every state; after each
 * row the statistics of both runtimes, every buffer's state, lock count,
 * priority and spill count, and the output variables (filled with a
 * sentinel) must be as before, and no launch or host function may have run;
 * at the end every buffer's bytes must be intact.
 *
 * The last case reads the DMEM_API declarations of the installed headers
 * and fails for a public function that has no row here: a new function
 * comes with its bad inputs. */
#include <ctype.h>
#include <dirent.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "check.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define LIMIT (8 * MiB)
#define BUF (64 * KiB)

/* ---- the fixture ------------------------------------------------------------------ */

enum { B_RES, B_HOST, B_DISK, B_PINNED, B_LOCKED, NBUF };
static const char *const buf_names[NBUF] = {"resident", "host tier", "disk tier", "pinned",
                                            "locked"};

/* The bad handles each handle-taking row is run with. */
enum { H_ZERO, H_FREED, H_FORGED, H_GEN0, H_BEYOND, H_ONES, H_FOREIGN, NBAD };
static const char *const bad_names[NBAD] = {
    "zero (DMEM_HANDLE_NULL)", "freed", "forged generation", "generation 0",
    "slot never handed out", "all ones", "another runtime's"};

typedef struct fx {
  dmem_runtime_t *rt;    /* the runtime under test */
  dmem_runtime_t *other; /* another runtime: its handles and pointers are foreign here */
  dmem_handle_t b[NBUF]; /* buffers of rt in each state */
  dmem_handle_t bad_h[NBAD];
  dmem_handle_t bad;     /* the bad handle of the current run of a row */
  dmem_handle_t other_h; /* a live buffer of `other` */
  void *locked_ptr;      /* device address of b[B_LOCKED] */
  void *raw;             /* a live raw allocation of rt (4 KiB) */
  void *freed_raw;       /* a raw allocation of rt, freed */
  void *dedicated_raw;   /* a live dedicated block of rt (4 KiB) */
  void *other_raw;       /* a live raw allocation of `other` */
  dmem_stream_t s;       /* a stream of rt with nothing registered */
  char spill_dir[64];
  /* Outputs: set to the sentinel before each row, and must stay so when
   * the row fails. */
  dmem_handle_t h_out;
  void *ptr_out;
  size_t size_out, size_out2;
  double frac_out;
  dmem_buffer_info_t info_out;
  dmem_stats_t stats_out;
  dmem_stream_t stream_out;
  dmem_runtime_t *rt_out;
  unsigned char ipc_out[DMEM_IPC_HANDLE_SIZE];
  unsigned char read_out[64]; /* dmem_buffer_read's dst */
  /* Callbacks called: must stay 0 when a row fails. */
  int launches, host_fns, ctl_calls;
} fx_t;

#define SENTINEL 0xA5
static void outputs_fill(fx_t *f) {
  memset(&f->h_out, SENTINEL, sizeof f->h_out);
  memset(&f->ptr_out, SENTINEL, sizeof f->ptr_out);
  memset(&f->size_out, SENTINEL, sizeof f->size_out);
  memset(&f->size_out2, SENTINEL, sizeof f->size_out2);
  memset(&f->frac_out, SENTINEL, sizeof f->frac_out);
  memset(&f->info_out, SENTINEL, sizeof f->info_out);
  memset(&f->stats_out, SENTINEL, sizeof f->stats_out);
  memset(&f->stream_out, SENTINEL, sizeof f->stream_out);
  memset(&f->rt_out, SENTINEL, sizeof f->rt_out);
  memset(f->ipc_out, SENTINEL, sizeof f->ipc_out);
  memset(f->read_out, SENTINEL, sizeof f->read_out);
  f->launches = f->host_fns = f->ctl_calls = 0;
}
static bool all_sentinel(const void *p, size_t n) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != SENTINEL) return false;
  return true;
}
/* The first output written, or NULL. */
static const char *output_written(const fx_t *f) {
#define OUT_(field) \
  if (!all_sentinel(&f->field, sizeof f->field)) return #field;
  OUT_(h_out) OUT_(ptr_out) OUT_(size_out) OUT_(size_out2) OUT_(frac_out) OUT_(info_out)
  OUT_(stats_out) OUT_(stream_out) OUT_(rt_out) OUT_(ipc_out) OUT_(read_out)
#undef OUT_
  if (f->launches) return "a launch function ran";
  if (f->host_fns) return "a host function ran";
  if (f->ctl_calls) return "a controller callback ran";
  return NULL;
}

static dmem_status_t count_launch(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)s;
  fx_t *f = user;
  f->launches++;
  for (size_t i = 0; i < n; i++)
    if (!ptrs[i]) return DMEM_ERR_CALLBACK;
  return DMEM_OK;
}
static dmem_status_t ctl_retrieve(void *user, dmem_handle_t h, void *out, size_t n) {
  (void)h, (void)out, (void)n;
  ((fx_t *)user)->ctl_calls++;
  return DMEM_OK;
}
static void count_host_fn(void *user) { ((fx_t *)user)->host_fns++; }
static dmem_status_t ctl_store(void *user, dmem_handle_t h, const void *d, size_t n) {
  (void)h, (void)d, (void)n;
  ((fx_t *)user)->ctl_calls++;
  return DMEM_OK;
}

/* What must not change: both runtimes' statistics and every buffer. */
typedef struct snap {
  dmem_stats_t st, other_st;
  dmem_buffer_info_t info[NBUF], other_info;
} snap_t;

static void snap_take(fx_t *f, snap_t *s) {
  memset(s, 0, sizeof *s);
  if (dmem_stats(f->rt, &s->st) != DMEM_OK || dmem_stats(f->other, &s->other_st) != DMEM_OK)
    abort();
  for (int i = 0; i < NBUF; i++)
    if (dmem_buffer_info(f->rt, f->b[i], &s->info[i]) != DMEM_OK) abort();
  if (dmem_buffer_info(f->other, f->other_h, &s->other_info) != DMEM_OK) abort();
}

/* Every field of dmem_stats_t is 8 bytes wide: compare word by word. The
 * pinned pool's figures may move on their own when the pool has a
 * background thread (CUDA): they count only when it did nothing. */
static const char *stats_diff(const dmem_stats_t *a, const dmem_stats_t *b, size_t *off_out) {
  _Static_assert(sizeof(dmem_stats_t) % 8 == 0, "dmem_stats_t of 8-byte fields");
  bool bg = a->host_pool_background_grows != b->host_pool_background_grows ||
            a->host_pool_trims != b->host_pool_trims;
  const uint64_t *x = (const uint64_t *)(const void *)a, *y = (const uint64_t *)(const void *)b;
  for (size_t i = 0; i < sizeof *a / 8; i++) {
    size_t off = i * 8;
    if (x[i] == y[i]) continue;
    if (bg && off >= offsetof(dmem_stats_t, host_pool_reserved) &&
        off <= offsetof(dmem_stats_t, host_pool_trims))
      continue;
    *off_out = off;
    return "dmem_stats field at byte offset";
  }
  return NULL;
}

static bool info_same(const dmem_buffer_info_t *a, const dmem_buffer_info_t *b) {
  return a->size == b->size && a->state == b->state && a->lock_count == b->lock_count &&
         a->pinned == b->pinned && a->priority == b->priority && a->spill_count == b->spill_count;
}

static dmem_runtime_t *fixture_runtime(const char *spill_dir) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.spill_ahead = 0; /* nothing moves on its own */
  cfg.device_limit = LIMIT;
  cfg.spill_dir = spill_dir;
  cfg.oom_wait_ms = 0;
  return check_runtime_cfg(&cfg);
}

#define SETUP_OK(expr)                                                                      \
  do {                                                                                      \
    dmem_status_t st_ = (expr);                                                             \
    if (st_ != DMEM_OK) {                                                                   \
      fprintf(stderr, "setup: %s: %s (%s)\n", #expr, dmem_status_name(st_),                \
              dmem_last_error_detail());                                                    \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

static void fixture_init(fx_t *f) {
  memset(f, 0, sizeof *f);
  check_mkdtemp(f->spill_dir, sizeof f->spill_dir, "dmem-bad");
  f->rt = fixture_runtime(f->spill_dir);
  f->other = fixture_runtime(f->spill_dir);
  for (int i = 0; i < NBUF; i++) {
    SETUP_OK(dmem_buffer_alloc(f->rt, BUF, i == B_PINNED ? DMEM_ALLOC_PINNED : 0, &f->b[i]));
    check_put(f->rt, f->b[i], BUF, (uint64_t)i + 1);
  }
  SETUP_OK(dmem_buffer_spill(f->rt, f->b[B_HOST], DMEM_TIER_HOST));
  SETUP_OK(dmem_buffer_spill(f->rt, f->b[B_DISK], DMEM_TIER_DISK));
  SETUP_OK(dmem_buffer_lock(f->rt, f->b[B_LOCKED], NULL, &f->locked_ptr));
  SETUP_OK(dmem_device_malloc(f->rt, 4 * KiB, NULL, &f->raw));
  SETUP_OK(dmem_device_malloc(f->rt, 4 * KiB, NULL, &f->freed_raw));
  SETUP_OK(dmem_device_free(f->rt, f->freed_raw, NULL));
  SETUP_OK(dmem_device_malloc_dedicated(f->rt, 4 * KiB, NULL, &f->dedicated_raw));
  SETUP_OK(dmem_stream_create(f->rt, &f->s));
  SETUP_OK(dmem_buffer_alloc(f->other, BUF, 0, &f->other_h));
  SETUP_OK(dmem_device_malloc(f->other, 4 * KiB, NULL, &f->other_raw));
  dmem_handle_t freed;
  SETUP_OK(dmem_buffer_alloc(f->rt, BUF, 0, &freed));
  SETUP_OK(dmem_buffer_free(f->rt, freed));
  f->bad_h[H_ZERO] = DMEM_HANDLE_NULL;
  f->bad_h[H_FREED] = freed;
  f->bad_h[H_FORGED] = f->b[B_RES] ^ ((uint64_t)0x5A5A << 32); /* live slot, wrong generation */
  f->bad_h[H_GEN0] = f->b[B_RES] & 0xFFFFFFFFu;                    /* live slot, generation 0 */
  f->bad_h[H_BEYOND] = ((uint64_t)1 << 32) | 0x00FFFFFFu;      /* a slot never handed out */
  f->bad_h[H_ONES] = UINT64_MAX;
  f->bad_h[H_FOREIGN] = f->other_h;
  /* The default runtime, for dmem_torch_alloc's rows: small and on the
   * host backend unless DMEM_BACKEND says otherwise. */
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = 16 * MiB;
  SETUP_OK(dmem_runtime_default_configure(&cfg));
  dmem_runtime_t *def;
  SETUP_OK(dmem_runtime_default(0, &def));
}

static void fixture_fini(fx_t *f) {
  for (int i = 0; i < NBUF; i++)
    CHECK_UEQ(check_bad_bytes(f->rt, f->b[i], BUF, (uint64_t)i + 1), 0);
  CHECK_OK(dmem_buffer_unlock(f->rt, f->b[B_LOCKED]));
  for (int i = 0; i < NBUF; i++) CHECK_OK(dmem_buffer_free(f->rt, f->b[i]));
  CHECK_OK(dmem_device_free(f->rt, f->raw, NULL));
  CHECK_OK(dmem_device_free(f->rt, f->dedicated_raw, NULL));
  CHECK_OK(dmem_stream_destroy(f->rt, f->s));
  CHECK_OK(dmem_buffer_free(f->other, f->other_h));
  CHECK_OK(dmem_device_free(f->other, f->other_raw, NULL));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(f->rt, &s));
  CHECK_UEQ(s.buffer_count, 0);
  CHECK_UEQ(s.device_used, 0);
  dmem_runtime_destroy(f->rt);
  dmem_runtime_destroy(f->other);
  CHECK_EQ(rmdir(f->spill_dir), 0);
}

/* ---- the table ------------------------------------------------------------------- */

enum { ROW_EACH_BAD_HANDLE = 1 };

typedef struct row {
  const char *fn;   /* the public function */
  const char *what; /* the bad input */
  dmem_status_t want;
  dmem_status_t (*call)(fx_t *f);
  unsigned flags;
  int line;
} row_t;

#define MAX_ROWS 400
static row_t rows[MAX_ROWS];
static int nrows;
static int rows_overflow;

static void row_add(const char *fn, void (*fn_ptr)(void), const char *what, dmem_status_t want,
                    dmem_status_t (*call)(fx_t *), unsigned flags, int line) {
  (void)fn_ptr; /* only there so that the name must be a declared function */
  if (nrows == MAX_ROWS) {
    rows_overflow = 1;
    return;
  }
  rows[nrows++] = (row_t){fn, what, want, call, flags, line};
}

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

/* ROW_BODY(fn, what, want, flags) { ...statements; return status; }  */
#define ROW_BODY(fn, what, want, flags)                                                      \
  static dmem_status_t CAT(row_call_, __LINE__)(fx_t * f);                                  \
  __attribute__((constructor)) static void CAT(row_reg_, __LINE__)(void) {                  \
    row_add(#fn, (void (*)(void))fn, what, want, CAT(row_call_, __LINE__), flags, __LINE__); \
  }                                                                                         \
  static dmem_status_t CAT(row_call_, __LINE__)(fx_t * f)

/* ROW(fn, what, want, call expression) */
#define ROW(fn, what, want, ...) \
  ROW_BODY(fn, what, want, 0) { (void)f; return (__VA_ARGS__); }
/* ROW_H(fn, what, want, call expression using f->bad): once per bad handle */
#define ROW_H(fn, what, want, ...) \
  ROW_BODY(fn, what, want, ROW_EACH_BAD_HANDLE) { return (__VA_ARGS__); }

/* For functions that return no status: DMEM_OK when the documented outcome
 * held, else a value outside the table (printed DMEM_UNKNOWN_STATUS). */
#define DOCUMENTED(cond) ((cond) ? DMEM_OK : (dmem_status_t)-999)

#define INVAL DMEM_ERR_INVALID_ARGUMENT
#define STALE DMEM_ERR_STALE_HANDLE
#define RES f->b[B_RES]
#define HOST f->b[B_HOST]
#define DISK f->b[B_DISK]
#define PINNED f->b[B_PINNED]
#define LOCKED f->b[B_LOCKED]

/* ---- status.h, config.h ---- */
ROW(dmem_status_name, "a value outside the table", DMEM_OK,
    DOCUMENTED(strcmp(dmem_status_name((dmem_status_t)-999), "DMEM_UNKNOWN_STATUS") == 0 &&
               strcmp(dmem_status_name((dmem_status_t)1), "DMEM_UNKNOWN_STATUS") == 0 &&
               strcmp(dmem_status_name((dmem_status_t)INT_MIN), "DMEM_UNKNOWN_STATUS") == 0))
ROW(dmem_status_string, "a value outside the table", DMEM_OK,
    DOCUMENTED(strcmp(dmem_status_string((dmem_status_t)-999), "unknown status") == 0 &&
               strcmp(dmem_status_string((dmem_status_t)INT_MAX), "unknown status") == 0))
ROW(dmem_last_error_detail, "never NULL", DMEM_OK, DOCUMENTED(dmem_last_error_detail() != NULL))
ROW_BODY(dmem_config_init, "cfg NULL (ignored)", DMEM_OK, 0) {
  (void)f;
  dmem_config_init(NULL);
  return DMEM_OK;
}
ROW(dmem_size_parse, "text NULL", INVAL, dmem_size_parse(NULL, &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "bytes_out NULL", INVAL, dmem_size_parse("4096", NULL, &f->frac_out))
ROW(dmem_size_parse, "empty", DMEM_ERR_CONFIG, dmem_size_parse("", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "blank", DMEM_ERR_CONFIG, dmem_size_parse("  ", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "negative", DMEM_ERR_CONFIG, dmem_size_parse("-1", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "not a number", DMEM_ERR_CONFIG, dmem_size_parse("abc", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "unknown suffix", DMEM_ERR_CONFIG, dmem_size_parse("12Q", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "trailing text", DMEM_ERR_CONFIG, dmem_size_parse("12M x", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "not whole bytes", DMEM_ERR_CONFIG, dmem_size_parse("1.5", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "2^64 bytes", DMEM_ERR_CONFIG,
    dmem_size_parse("18446744073709551616", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "SIZE_MAX bytes", DMEM_ERR_CONFIG,
    dmem_size_parse("18446744073709551615", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "16777216Ti", DMEM_ERR_CONFIG,
    dmem_size_parse("16777216Ti", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "18447PB", DMEM_ERR_CONFIG, dmem_size_parse("18447PB", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "inf", DMEM_ERR_CONFIG, dmem_size_parse("inf", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "nan", DMEM_ERR_CONFIG, dmem_size_parse("nan", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "0%", DMEM_ERR_CONFIG, dmem_size_parse("0%", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "101%", DMEM_ERR_CONFIG, dmem_size_parse("101%", &f->size_out, &f->frac_out))
ROW(dmem_size_parse, "50% without fraction_out", DMEM_ERR_CONFIG,
    dmem_size_parse("50%", &f->size_out, NULL))

/* ---- runtime.h ---- */
static dmem_status_t create_with(fx_t *f, void (*edit)(dmem_config_t *)) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = 16 * MiB;
  cfg.spill_ahead = 0;
  edit(&cfg);
  dmem_status_t st = dmem_runtime_create(&cfg, &f->rt_out);
  if (st == DMEM_OK) dmem_runtime_destroy(f->rt_out);
  return st;
}
#define ROW_CFG(what, want, stmt)                          \
  static void CAT(cfg_edit_, __LINE__)(dmem_config_t * c) { stmt; } \
  ROW(dmem_runtime_create, what, want, create_with(f, CAT(cfg_edit_, __LINE__)))

ROW(dmem_runtime_create, "rt_out NULL", INVAL, dmem_runtime_create(NULL, NULL))
ROW_CFG("struct_size 0", INVAL, c->struct_size = 0)
ROW_CFG("struct_size one short", INVAL, c->struct_size = sizeof *c - 1)
ROW_CFG("backend 7", INVAL, c->backend = (dmem_backend_t)7)
ROW_CFG("backend -1", INVAL, c->backend = (dmem_backend_t)-1)
ROW_CFG("device -1", INVAL, c->device = -1)
ROW_CFG("device_limit_fraction 1.5", INVAL, c->device_limit_fraction = 1.5)
ROW_CFG("device_limit_fraction -0.5", INVAL, c->device_limit_fraction = -0.5)
ROW_CFG("device_limit_fraction NaN", INVAL, c->device_limit_fraction = NAN)
ROW_CFG("log_level 9", INVAL, c->log_level = (dmem_log_level_t)9)
ROW_CFG("log_level -1", INVAL, c->log_level = (dmem_log_level_t)-1)
ROW_CFG("oom_wait_ms UINT_MAX", INVAL, c->oom_wait_ms = UINT_MAX)
ROW_CFG("host_burst 1.5", INVAL, c->host_burst = 1.5)
ROW_CFG("host_burst -0.1", INVAL, c->host_burst = -0.1)
ROW_CFG("host_burst NaN", INVAL, c->host_burst = NAN)
ROW_CFG("spill_ahead 2", INVAL, c->spill_ahead = 2)
ROW_CFG("spill_ahead NaN", INVAL, c->spill_ahead = NAN)
ROW_CFG("spill_ahead_low 1", INVAL, c->spill_ahead_low = 1)
ROW_CFG("spill_ahead_low above spill_ahead", INVAL, c->spill_ahead = 0.5; c->spill_ahead_low = 0.6)
ROW_CFG("host_backend_capacity 0", INVAL, c->host_backend_capacity = 0)
/* A limit past the device is clamped to the capacity (logged at warn);
 * nothing overflows, up to SIZE_MAX, and dmem_runtime_info says what was
 * asked. */
static dmem_status_t limit_clamped(size_t limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_backend_capacity = 16 * MiB;
  cfg.spill_ahead = 0;
  cfg.device_limit = limit;
  dmem_runtime_t *rt;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st != DMEM_OK) return st;
  dmem_stats_t s;
  size_t free_b = 0, total_b = 0;
  void *p = NULL;
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  st = dmem_stats(rt, &s);
  if (st == DMEM_OK) st = dmem_device_memory_info(rt, &free_b, &total_b);
  if (st == DMEM_OK) st = dmem_runtime_info(rt, &info);
  /* the limit says no */
  dmem_status_t big = dmem_device_malloc(rt, 32 * MiB, NULL, &p);
  dmem_runtime_destroy(rt);
  if (st != DMEM_OK) return st;
  return DOCUMENTED(s.device_limit == 16 * MiB && s.device_capacity == 16 * MiB &&
                    total_b == 16 * MiB && free_b <= 16 * MiB &&
                    info.device_limit == 16 * MiB && info.device_limit_asked == limit &&
                    big == DMEM_ERR_OUT_OF_MEMORY);
}
ROW(dmem_runtime_create, "device_limit above the capacity (clamped)", DMEM_OK,
    limit_clamped(32 * MiB))
ROW(dmem_runtime_create, "device_limit SIZE_MAX (clamped)", DMEM_OK, limit_clamped(SIZE_MAX))
ROW_CFG("stats_interval_s past a day", INVAL, c->stats_interval_s = DMEM_STATS_INTERVAL_MAX + 1)
ROW_CFG("spill_dir missing", DMEM_ERR_IO, c->spill_dir = "/nonexistent-dmem-dir/x")
ROW_CFG("spill_dir a file", DMEM_ERR_IO, c->spill_dir = "/dev/null")
ROW_CFG("host_limit SIZE_MAX (no limit to speak of)", DMEM_OK, c->host_limit = SIZE_MAX)
ROW_BODY(dmem_runtime_destroy, "rt NULL (no-op)", DMEM_OK, 0) {
  (void)f;
  dmem_runtime_destroy(NULL);
  return DMEM_OK;
}
ROW(dmem_runtime_backend, "rt NULL", DMEM_OK,
    DOCUMENTED(dmem_runtime_backend(NULL) == DMEM_BACKEND_AUTO))
ROW(dmem_runtime_poll, "rt NULL", INVAL, dmem_runtime_poll(NULL))
ROW_BODY(dmem_runtime_info, "rt NULL", INVAL, 0) {
  (void)f;
  dmem_runtime_info_t info;
  memset(&info, SENTINEL, sizeof info);
  info.struct_size = sizeof info;
  dmem_status_t st = dmem_runtime_info(NULL, &info);
  return st == DMEM_OK || info.device_limit != (size_t)0xA5A5A5A5A5A5A5A5ull ? DMEM_OK : st;
}
ROW(dmem_runtime_info, "info_out NULL", INVAL, dmem_runtime_info(f->rt, NULL))
ROW_BODY(dmem_runtime_info, "struct_size 0 (nothing written)", INVAL, 0) {
  dmem_runtime_info_t info;
  memset(&info, SENTINEL, sizeof info);
  info.struct_size = 0;
  dmem_status_t st = dmem_runtime_info(f->rt, &info);
  return st == DMEM_OK || info.device_limit != (size_t)0xA5A5A5A5A5A5A5A5ull ? DMEM_OK : st;
}
ROW_BODY(dmem_runtime_info, "struct_size of an older, shorter struct (only that written)",
         DMEM_OK, 0) {
  dmem_runtime_info_t info;
  memset(&info, SENTINEL, sizeof info);
  info.struct_size = offsetof(dmem_runtime_info_t, device_limit);
  dmem_status_t st = dmem_runtime_info(f->rt, &info);
  if (st != DMEM_OK) return st;
  return DOCUMENTED(info.struct_size == offsetof(dmem_runtime_info_t, device_limit) &&
                    info.device_capacity != (size_t)0xA5A5A5A5A5A5A5A5ull &&
                    info.device_limit == (size_t)0xA5A5A5A5A5A5A5A5ull &&
                    info.backend == dmem_runtime_backend(f->rt));
}
ROW(dmem_runtime_set_log_level, "rt NULL", INVAL, dmem_runtime_set_log_level(NULL, DMEM_LOG_WARN))
ROW(dmem_runtime_set_log_level, "level 5", INVAL,
    dmem_runtime_set_log_level(f->rt, (dmem_log_level_t)5))
ROW(dmem_runtime_set_log_level, "level -1", INVAL,
    dmem_runtime_set_log_level(f->rt, (dmem_log_level_t)-1))

/* ---- buffer.h ---- */
ROW(dmem_buffer_alloc, "rt NULL", INVAL, dmem_buffer_alloc(NULL, BUF, 0, &f->h_out))
ROW(dmem_buffer_alloc, "h_out NULL", INVAL, dmem_buffer_alloc(f->rt, BUF, 0, NULL))
ROW(dmem_buffer_alloc, "size 0", INVAL, dmem_buffer_alloc(f->rt, 0, 0, &f->h_out))
ROW(dmem_buffer_alloc, "size SIZE_MAX", DMEM_ERR_OUT_OF_MEMORY, dmem_buffer_alloc(f->rt, SIZE_MAX, 0, &f->h_out))
ROW(dmem_buffer_alloc, "size SIZE_MAX, pinned", DMEM_ERR_OUT_OF_MEMORY,
    dmem_buffer_alloc(f->rt, SIZE_MAX, DMEM_ALLOC_PINNED, &f->h_out))
ROW(dmem_buffer_alloc, "size one past the limit", DMEM_ERR_OUT_OF_MEMORY,
    dmem_buffer_alloc(f->rt, LIMIT + 1, 0, &f->h_out))
ROW(dmem_buffer_alloc, "unknown flag 1<<2", INVAL, dmem_buffer_alloc(f->rt, BUF, 1u << 2, &f->h_out))
ROW(dmem_buffer_alloc, "pinned and stable", INVAL,
    dmem_buffer_alloc(f->rt, BUF, DMEM_ALLOC_PINNED | DMEM_BUFFER_STABLE_ADDRESS, &f->h_out))
ROW(dmem_buffer_alloc, "size SIZE_MAX, stable", DMEM_ERR_OUT_OF_MEMORY,
    dmem_buffer_alloc(f->rt, SIZE_MAX, DMEM_BUFFER_STABLE_ADDRESS, &f->h_out))
ROW(dmem_buffer_alloc, "size one past the limit, stable", DMEM_ERR_OUT_OF_MEMORY,
    dmem_buffer_alloc(f->rt, LIMIT + 1, DMEM_BUFFER_STABLE_ADDRESS, &f->h_out))
ROW(dmem_buffer_alloc, "unknown flag 1<<31", INVAL, dmem_buffer_alloc(f->rt, BUF, 1u << 31, &f->h_out))
ROW(dmem_buffer_alloc, "all flags", INVAL, dmem_buffer_alloc(f->rt, BUF, ~0u, &f->h_out))
ROW(dmem_buffer_free, "rt NULL", INVAL, dmem_buffer_free(NULL, RES))
ROW_H(dmem_buffer_free, "bad handle", STALE, dmem_buffer_free(f->rt, f->bad))
ROW(dmem_buffer_info, "rt NULL", INVAL, dmem_buffer_info(NULL, RES, &f->info_out))
ROW(dmem_buffer_info, "info_out NULL", INVAL, dmem_buffer_info(f->rt, RES, NULL))
ROW_H(dmem_buffer_info, "bad handle", STALE, dmem_buffer_info(f->rt, f->bad, &f->info_out))
ROW(dmem_buffer_lock, "rt NULL", INVAL, dmem_buffer_lock(NULL, RES, NULL, &f->ptr_out))
ROW(dmem_buffer_lock, "dev_ptr_out NULL", INVAL, dmem_buffer_lock(f->rt, RES, NULL, NULL))
ROW(dmem_buffer_lock, "dev_ptr_out NULL, spilled buffer", INVAL, dmem_buffer_lock(f->rt, HOST, NULL, NULL))
ROW_H(dmem_buffer_lock, "bad handle", STALE, dmem_buffer_lock(f->rt, f->bad, NULL, &f->ptr_out))
ROW(dmem_buffer_unlock, "rt NULL", INVAL, dmem_buffer_unlock(NULL, LOCKED))
ROW_H(dmem_buffer_unlock, "bad handle", STALE, dmem_buffer_unlock(f->rt, f->bad))
ROW(dmem_buffer_unlock, "without a lock (resident)", DMEM_ERR_NOT_LOCKED, dmem_buffer_unlock(f->rt, RES))
ROW(dmem_buffer_unlock, "without a lock (host tier)", DMEM_ERR_NOT_LOCKED, dmem_buffer_unlock(f->rt, HOST))
ROW(dmem_buffer_unlock, "without a lock (disk tier)", DMEM_ERR_NOT_LOCKED, dmem_buffer_unlock(f->rt, DISK))
ROW(dmem_buffer_unlock, "without a lock (pinned)", DMEM_ERR_NOT_LOCKED, dmem_buffer_unlock(f->rt, PINNED))
ROW(dmem_buffer_set_priority, "rt NULL", INVAL, dmem_buffer_set_priority(NULL, RES, 1))
ROW_H(dmem_buffer_set_priority, "bad handle", STALE, dmem_buffer_set_priority(f->rt, f->bad, 7))
ROW_H(dmem_buffer_set_priority, "bad handle, INT_MIN", STALE, dmem_buffer_set_priority(f->rt, f->bad, INT_MIN))
ROW(dmem_buffer_read, "rt NULL", INVAL, dmem_buffer_read(NULL, RES, 0, f->read_out, 8))
ROW(dmem_buffer_read, "dst NULL, n 8", INVAL, dmem_buffer_read(f->rt, RES, 0, NULL, 8))
ROW(dmem_buffer_read, "dst NULL, n 8, disk tier", INVAL, dmem_buffer_read(f->rt, DISK, 0, NULL, 8))
ROW(dmem_buffer_read, "dst NULL, n 0 (nothing to read)", DMEM_OK,
    dmem_buffer_read(f->rt, HOST, 0, NULL, 0))
ROW(dmem_buffer_read, "one byte past the end (resident)", INVAL,
    dmem_buffer_read(f->rt, RES, BUF - 7, f->read_out, 8))
ROW(dmem_buffer_read, "one byte past the end (host tier)", INVAL,
    dmem_buffer_read(f->rt, HOST, BUF - 7, f->read_out, 8))
ROW(dmem_buffer_read, "one byte past the end (disk tier)", INVAL,
    dmem_buffer_read(f->rt, DISK, BUF - 7, f->read_out, 8))
ROW(dmem_buffer_read, "one byte past the end (locked)", INVAL,
    dmem_buffer_read(f->rt, LOCKED, 1, f->read_out, BUF))
ROW(dmem_buffer_read, "offset past the end, n 0", INVAL,
    dmem_buffer_read(f->rt, RES, BUF + 1, f->read_out, 0))
ROW(dmem_buffer_read, "offset SIZE_MAX", INVAL,
    dmem_buffer_read(f->rt, HOST, SIZE_MAX, f->read_out, 1))
ROW(dmem_buffer_read, "n SIZE_MAX (offset + n wraps)", INVAL,
    dmem_buffer_read(f->rt, DISK, 8, f->read_out, SIZE_MAX))
ROW_H(dmem_buffer_read, "bad handle", STALE, dmem_buffer_read(f->rt, f->bad, 0, f->read_out, 8))
ROW_H(dmem_buffer_read, "bad handle, n 0", STALE, dmem_buffer_read(f->rt, f->bad, 0, NULL, 0))

/* ---- launch.h ---- */
ROW(dmem_lock_and_launch, "rt NULL", INVAL, dmem_lock_and_launch(NULL, &RES, 1, count_launch, f))
ROW(dmem_lock_and_launch, "fn NULL", INVAL, dmem_lock_and_launch(f->rt, &RES, 1, NULL, f))
ROW(dmem_lock_and_launch, "hs NULL, n 1", INVAL, dmem_lock_and_launch(f->rt, NULL, 1, count_launch, f))
ROW_BODY(dmem_lock_and_launch, "n SIZE_MAX", INVAL, 0) {
  dmem_handle_t hs[2] = {RES, RES};
  return dmem_lock_and_launch(f->rt, hs, SIZE_MAX, count_launch, f);
}
ROW_BODY(dmem_lock_and_launch, "n SIZE_MAX / 8 + 2 (n * 8 wraps)", INVAL, 0) {
  dmem_handle_t hs[2] = {RES, RES};
  return dmem_lock_and_launch(f->rt, hs, SIZE_MAX / 8 + 2, count_launch, f);
}
ROW_H(dmem_lock_and_launch, "bad handle", STALE, dmem_lock_and_launch(f->rt, &f->bad, 1, count_launch, f))
ROW_BODY(dmem_lock_and_launch, "bad handle after a spilled one and a resident one", STALE,
         ROW_EACH_BAD_HANDLE) {
  dmem_handle_t hs[3] = {HOST, RES, f->bad};
  return dmem_lock_and_launch(f->rt, hs, 3, count_launch, f);
}
ROW_BODY(dmem_lock_and_launch, "duplicate handles (allowed)", DMEM_OK, 0) {
  dmem_handle_t hs[3] = {RES, RES, LOCKED};
  dmem_status_t st = dmem_lock_and_launch(f->rt, hs, 3, count_launch, f);
  return st == DMEM_OK && f->launches == 1 ? (f->launches = 0, DMEM_OK) : DMEM_ERR_CALLBACK;
}
ROW_BODY(dmem_lock_and_launch, "n 0 (fn called with no buffers)", DMEM_OK, 0) {
  dmem_status_t st = dmem_lock_and_launch(f->rt, NULL, 0, count_launch, f);
  return st == DMEM_OK && f->launches == 1 ? (f->launches = 0, DMEM_OK) : DMEM_ERR_CALLBACK;
}
ROW(dmem_launch_async, "rt NULL", INVAL, dmem_launch_async(NULL, f->s, &RES, 1, count_launch, f))
ROW(dmem_launch_async, "fn NULL", INVAL, dmem_launch_async(f->rt, f->s, &RES, 1, NULL, f))
ROW(dmem_launch_async, "hs NULL, n 1", INVAL, dmem_launch_async(f->rt, f->s, NULL, 1, count_launch, f))
ROW_BODY(dmem_launch_async, "n SIZE_MAX", INVAL, 0) {
  dmem_handle_t hs[2] = {RES, RES};
  return dmem_launch_async(f->rt, f->s, hs, SIZE_MAX, count_launch, f);
}
ROW_BODY(dmem_launch_async, "n SIZE_MAX / 16 + 2 (n * 16 wraps)", INVAL, 0) {
  dmem_handle_t hs[2] = {RES, RES};
  return dmem_launch_async(f->rt, f->s, hs, SIZE_MAX / 16 + 2, count_launch, f);
}
ROW_H(dmem_launch_async, "bad handle", STALE, dmem_launch_async(f->rt, f->s, &f->bad, 1, count_launch, f))
ROW_BODY(dmem_launch_async, "bad handle after a spilled one and a resident one", STALE,
         ROW_EACH_BAD_HANDLE) {
  dmem_handle_t hs[3] = {DISK, RES, f->bad};
  return dmem_launch_async(f->rt, f->s, hs, 3, count_launch, f);
}
ROW_BODY(dmem_launch_async, "duplicate handles (allowed; then sync_and_unlock)", DMEM_OK, 0) {
  dmem_handle_t hs[2] = {RES, RES};
  dmem_status_t st = dmem_launch_async(f->rt, f->s, hs, 2, count_launch, f);
  dmem_status_t st2 = dmem_sync_and_unlock(f->rt, f->s);
  if (st != DMEM_OK) return st;
  return st2 == DMEM_OK && f->launches == 1 ? (f->launches = 0, DMEM_OK) : DMEM_ERR_CALLBACK;
}
ROW(dmem_sync_and_unlock, "rt NULL", INVAL, dmem_sync_and_unlock(NULL, f->s))
ROW(dmem_sync_and_unlock, "nothing registered", DMEM_OK, dmem_sync_and_unlock(f->rt, f->s))
ROW(dmem_stream_release, "rt NULL", INVAL, dmem_stream_release(NULL, f->s))
ROW(dmem_stream_release, "nothing registered", DMEM_OK, dmem_stream_release(f->rt, f->s))

/* ---- stream.h ---- */
ROW(dmem_stream_create, "rt NULL", INVAL, dmem_stream_create(NULL, &f->stream_out))
ROW(dmem_stream_create, "s_out NULL", INVAL, dmem_stream_create(f->rt, NULL))
ROW(dmem_stream_destroy, "rt NULL", INVAL, dmem_stream_destroy(NULL, f->s))
ROW(dmem_stream_destroy, "the default stream (NULL)", INVAL, dmem_stream_destroy(f->rt, NULL))
ROW_BODY(dmem_stream_destroy, "buffers still registered", DMEM_ERR_BUSY, 0) {
  dmem_status_t st = dmem_launch_async(f->rt, f->s, &RES, 1, count_launch, f);
  if (st != DMEM_OK) return st;
  f->launches = 0;
  st = dmem_stream_destroy(f->rt, f->s);
  dmem_status_t st2 = dmem_sync_and_unlock(f->rt, f->s);
  return st2 != DMEM_OK ? st2 : st;
}
ROW(dmem_stream_synchronize, "rt NULL", INVAL, dmem_stream_synchronize(NULL, f->s))
ROW(dmem_stream_enqueue_host, "rt NULL", INVAL, dmem_stream_enqueue_host(NULL, f->s, count_host_fn, f))
ROW(dmem_stream_enqueue_host, "fn NULL", INVAL, dmem_stream_enqueue_host(f->rt, f->s, NULL, f))
ROW(dmem_stream_copy, "rt NULL", INVAL, dmem_stream_copy(NULL, f->ipc_out, f->ipc_out + 8, 8, NULL))
ROW(dmem_stream_copy, "dst NULL", INVAL, dmem_stream_copy(f->rt, NULL, f->ipc_out, 8, NULL))
ROW(dmem_stream_copy, "src NULL", INVAL, dmem_stream_copy(f->rt, f->ipc_out, NULL, 8, NULL))
ROW(dmem_stream_copy, "n SIZE_MAX", INVAL, dmem_stream_copy(f->rt, f->ipc_out, f->ipc_out + 8, SIZE_MAX, NULL))
ROW(dmem_stream_copy, "n 0, NULL addresses (no-op)", DMEM_OK, dmem_stream_copy(f->rt, NULL, NULL, 0, NULL))

/* ---- spill.h ---- */
ROW(dmem_buffer_spill, "rt NULL", INVAL, dmem_buffer_spill(NULL, RES, DMEM_TIER_HOST))
ROW_H(dmem_buffer_spill, "bad handle", STALE, dmem_buffer_spill(f->rt, f->bad, DMEM_TIER_HOST))
ROW(dmem_buffer_spill, "tier DMEM_TIER_DEVICE", INVAL, dmem_buffer_spill(f->rt, RES, DMEM_TIER_DEVICE))
ROW(dmem_buffer_spill, "tier 4", INVAL, dmem_buffer_spill(f->rt, RES, (dmem_tier_t)4))
ROW(dmem_buffer_spill, "tier -1", INVAL, dmem_buffer_spill(f->rt, RES, (dmem_tier_t)-1))
ROW(dmem_buffer_spill, "tier INT_MAX, spilled buffer", INVAL, dmem_buffer_spill(f->rt, HOST, (dmem_tier_t)INT_MAX))
ROW(dmem_buffer_spill, "controller tier without a controller", INVAL,
    dmem_buffer_spill(f->rt, RES, DMEM_TIER_CONTROLLER))
ROW(dmem_buffer_spill, "locked buffer", DMEM_ERR_BUSY, dmem_buffer_spill(f->rt, LOCKED, DMEM_TIER_HOST))
ROW(dmem_buffer_spill, "pinned buffer", DMEM_ERR_BUSY, dmem_buffer_spill(f->rt, PINNED, DMEM_TIER_HOST))
ROW(dmem_buffer_spill, "from disk back to host", INVAL, dmem_buffer_spill(f->rt, DISK, DMEM_TIER_HOST))
ROW(dmem_buffer_spill, "to the tier it is in (no-op)", DMEM_OK, dmem_buffer_spill(f->rt, HOST, DMEM_TIER_HOST))
ROW(dmem_buffer_spill, "to the disk it is on (no-op)", DMEM_OK, dmem_buffer_spill(f->rt, DISK, DMEM_TIER_DISK))
ROW(dmem_buffer_unspill, "rt NULL", INVAL, dmem_buffer_unspill(NULL, HOST, NULL))
ROW_H(dmem_buffer_unspill, "bad handle", STALE, dmem_buffer_unspill(f->rt, f->bad, NULL))
ROW(dmem_buffer_unspill, "resident (no-op)", DMEM_OK, dmem_buffer_unspill(f->rt, RES, NULL))
ROW(dmem_buffer_unspill, "locked (no-op)", DMEM_OK, dmem_buffer_unspill(f->rt, LOCKED, NULL))
ROW(dmem_buffer_prefetch, "rt NULL", INVAL, dmem_buffer_prefetch(NULL, &HOST, 1, NULL))
ROW(dmem_buffer_prefetch, "hs NULL, n 1", INVAL, dmem_buffer_prefetch(f->rt, NULL, 1, NULL))
ROW_BODY(dmem_buffer_prefetch, "n SIZE_MAX", INVAL, 0) {
  dmem_handle_t hs[2] = {HOST, DISK};
  return dmem_buffer_prefetch(f->rt, hs, SIZE_MAX, NULL);
}
ROW_H(dmem_buffer_prefetch, "bad handle", STALE, dmem_buffer_prefetch(f->rt, &f->bad, 1, NULL))
ROW_BODY(dmem_buffer_prefetch, "bad handle after spilled ones", STALE, ROW_EACH_BAD_HANDLE) {
  dmem_handle_t hs[3] = {HOST, DISK, f->bad};
  return dmem_buffer_prefetch(f->rt, hs, 3, NULL);
}
ROW_BODY(dmem_buffer_prefetch, "duplicate resident handles (no-op)", DMEM_OK, 0) {
  dmem_handle_t hs[3] = {RES, LOCKED, RES};
  return dmem_buffer_prefetch(f->rt, hs, 3, NULL);
}
ROW(dmem_buffer_prefetch, "n 0, hs NULL (no-op)", DMEM_OK, dmem_buffer_prefetch(f->rt, NULL, 0, NULL))
ROW(dmem_runtime_evict, "rt NULL", INVAL, dmem_runtime_evict(NULL, MiB, &f->size_out))
ROW_BODY(dmem_runtime_evict, "bytes 0 (no-op, *freed_out 0)", DMEM_OK, 0) {
  dmem_status_t st = dmem_runtime_evict(f->rt, 0, &f->size_out);
  if (st != DMEM_OK || f->size_out != 0) return st != DMEM_OK ? st : DMEM_ERR_CALLBACK;
  memset(&f->size_out, SENTINEL, sizeof f->size_out);
  return DMEM_OK;
}

/* ---- stats.h, controller.h ---- */
ROW(dmem_stats, "rt NULL", INVAL, dmem_stats(NULL, &f->stats_out))
ROW(dmem_stats, "stats_out NULL", INVAL, dmem_stats(f->rt, NULL))
ROW(dmem_stats_reset_peaks, "rt NULL", INVAL, dmem_stats_reset_peaks(NULL))
ROW(dmem_controller_set, "rt NULL", INVAL, dmem_controller_set(NULL, NULL))
ROW_BODY(dmem_controller_set, "struct_size 0", INVAL, 0) {
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.user = f;
  return dmem_controller_set(f->rt, &c);
}
ROW_BODY(dmem_controller_set, "struct_size one short", INVAL, 0) {
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c - 1;
  return dmem_controller_set(f->rt, &c);
}
ROW_BODY(dmem_controller_set, "store without retrieve", INVAL, 0) {
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.user = f;
  c.store = ctl_store;
  return dmem_controller_set(f->rt, &c);
}
ROW_BODY(dmem_controller_set, "retrieve without store", INVAL, 0) {
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.user = f;
  c.retrieve = ctl_retrieve;
  return dmem_controller_set(f->rt, &c);
}
ROW(dmem_controller_set, "none installed, removing (no-op)", DMEM_OK, dmem_controller_set(f->rt, NULL))

/* ---- device.h ---- */
ROW(dmem_device_malloc, "rt NULL", INVAL, dmem_device_malloc(NULL, 64, NULL, &f->ptr_out))
ROW(dmem_device_malloc, "ptr_out NULL", INVAL, dmem_device_malloc(f->rt, 64, NULL, NULL))
ROW(dmem_device_malloc, "size 0", INVAL, dmem_device_malloc(f->rt, 0, NULL, &f->ptr_out))
ROW(dmem_device_malloc, "size SIZE_MAX", DMEM_ERR_OUT_OF_MEMORY,
    dmem_device_malloc(f->rt, SIZE_MAX, NULL, &f->ptr_out))
ROW(dmem_device_malloc, "size one past the limit", DMEM_ERR_OUT_OF_MEMORY,
    dmem_device_malloc(f->rt, LIMIT + 1, NULL, &f->ptr_out))
ROW(dmem_device_malloc_dedicated, "rt NULL", INVAL,
    dmem_device_malloc_dedicated(NULL, 64, NULL, &f->ptr_out))
ROW(dmem_device_malloc_dedicated, "ptr_out NULL", INVAL,
    dmem_device_malloc_dedicated(f->rt, 64, NULL, NULL))
ROW(dmem_device_malloc_dedicated, "size 0", INVAL,
    dmem_device_malloc_dedicated(f->rt, 0, NULL, &f->ptr_out))
ROW(dmem_device_malloc_dedicated, "size SIZE_MAX", DMEM_ERR_OUT_OF_MEMORY,
    dmem_device_malloc_dedicated(f->rt, SIZE_MAX, NULL, &f->ptr_out))
ROW(dmem_device_malloc_dedicated, "size one past the limit", DMEM_ERR_OUT_OF_MEMORY,
    dmem_device_malloc_dedicated(f->rt, LIMIT + 1, NULL, &f->ptr_out))
ROW(dmem_device_free, "rt NULL", INVAL, dmem_device_free(NULL, f->raw, NULL))
ROW(dmem_device_free, "ptr NULL (no-op)", DMEM_OK, dmem_device_free(f->rt, NULL, NULL))
ROW(dmem_device_free, "an unknown address", INVAL, dmem_device_free(f->rt, f->ipc_out, NULL))
ROW(dmem_device_free, "inside a block", INVAL, dmem_device_free(f->rt, (char *)f->raw + 256, NULL))
ROW(dmem_device_free, "already freed", INVAL, dmem_device_free(f->rt, f->freed_raw, NULL))
ROW(dmem_device_free, "another runtime's block", INVAL, dmem_device_free(f->rt, f->other_raw, NULL))
ROW(dmem_device_free, "a locked buffer's address", INVAL, dmem_device_free(f->rt, f->locked_ptr, NULL))
ROW(dmem_device_free, "address ~0", INVAL, dmem_device_free(f->rt, (void *)UINTPTR_MAX, NULL))
ROW(dmem_device_adopt, "rt NULL", INVAL, dmem_device_adopt(NULL, f->raw, NULL, &f->h_out))
ROW(dmem_device_adopt, "h_out NULL", INVAL, dmem_device_adopt(f->rt, f->raw, NULL, NULL))
ROW(dmem_device_adopt, "ptr NULL", INVAL, dmem_device_adopt(f->rt, NULL, NULL, &f->h_out))
ROW(dmem_device_adopt, "an unknown address", INVAL,
    dmem_device_adopt(f->rt, f->ipc_out, NULL, &f->h_out))
ROW(dmem_device_adopt, "inside a block", INVAL,
    dmem_device_adopt(f->rt, (char *)f->raw + 256, NULL, &f->h_out))
ROW(dmem_device_adopt, "already freed", INVAL,
    dmem_device_adopt(f->rt, f->freed_raw, NULL, &f->h_out))
ROW(dmem_device_adopt, "a dedicated block", INVAL,
    dmem_device_adopt(f->rt, f->dedicated_raw, NULL, &f->h_out))
ROW(dmem_device_adopt, "another runtime's block", INVAL,
    dmem_device_adopt(f->rt, f->other_raw, NULL, &f->h_out))
ROW(dmem_device_adopt, "a locked buffer's address", INVAL,
    dmem_device_adopt(f->rt, f->locked_ptr, NULL, &f->h_out))
ROW(dmem_device_adopt, "address ~0", INVAL,
    dmem_device_adopt(f->rt, (void *)UINTPTR_MAX, NULL, &f->h_out))
ROW(dmem_stream_forget, "rt NULL", INVAL, dmem_stream_forget(NULL, f->s))
ROW(dmem_stream_forget, "the default stream (no-op)", DMEM_OK, dmem_stream_forget(f->rt, NULL))
ROW(dmem_device_memory_info, "rt NULL", INVAL, dmem_device_memory_info(NULL, &f->size_out, &f->size_out2))
ROW(dmem_device_memory_info, "both outputs NULL (allowed)", DMEM_OK, dmem_device_memory_info(f->rt, NULL, NULL))
ROW(dmem_device_ipc_handle, "rt NULL", INVAL, dmem_device_ipc_handle(NULL, f->raw, f->ipc_out, &f->size_out))
ROW(dmem_device_ipc_handle, "ptr NULL", INVAL, dmem_device_ipc_handle(f->rt, NULL, f->ipc_out, &f->size_out))
ROW(dmem_device_ipc_handle, "handle_out NULL", INVAL, dmem_device_ipc_handle(f->rt, f->raw, NULL, &f->size_out))
ROW(dmem_device_ipc_handle, "offset_out NULL", INVAL, dmem_device_ipc_handle(f->rt, f->raw, f->ipc_out, NULL))
ROW(dmem_device_ipc_handle, "an address in no slab", INVAL,
    dmem_device_ipc_handle(f->rt, &f->size_out2, f->ipc_out, &f->size_out))
ROW(dmem_device_ipc_handle, "another runtime's block", INVAL,
    dmem_device_ipc_handle(f->rt, f->other_raw, f->ipc_out, &f->size_out))
ROW(dmem_device_trim, "rt NULL", INVAL, dmem_device_trim(NULL, 0, &f->size_out))
ROW_BODY(dmem_device_trim, "keep SIZE_MAX (releases nothing)", DMEM_OK, 0) {
  dmem_status_t st = dmem_device_trim(f->rt, SIZE_MAX, &f->size_out);
  if (st != DMEM_OK || f->size_out != 0) return st != DMEM_OK ? st : DMEM_ERR_CALLBACK;
  memset(&f->size_out, SENTINEL, sizeof f->size_out);
  return DMEM_OK;
}
ROW(dmem_host_trim, "rt NULL", INVAL, dmem_host_trim(NULL, 0, &f->size_out))
ROW_BODY(dmem_host_trim, "keep SIZE_MAX (releases nothing)", DMEM_OK, 0) {
  dmem_status_t st = dmem_host_trim(f->rt, SIZE_MAX, &f->size_out);
  if (st != DMEM_OK || f->size_out != 0) return st != DMEM_OK ? st : DMEM_ERR_CALLBACK;
  memset(&f->size_out, SENTINEL, sizeof f->size_out);
  return DMEM_OK;
}
ROW(dmem_runtime_default, "rt_out NULL", INVAL, dmem_runtime_default(0, NULL))
ROW(dmem_runtime_default, "device -1", INVAL, dmem_runtime_default(-1, &f->rt_out))
ROW(dmem_runtime_default, "device 64", INVAL, dmem_runtime_default(64, &f->rt_out))
ROW(dmem_runtime_default, "device INT_MAX", INVAL, dmem_runtime_default(INT_MAX, &f->rt_out))
ROW_BODY(dmem_runtime_default_configure, "struct_size 0", INVAL, 0) {
  (void)f;
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.struct_size = 0;
  return dmem_runtime_default_configure(&cfg);
}
ROW(dmem_runtime_default_configure, "after the default runtime exists", DMEM_ERR_BUSY,
    dmem_runtime_default_configure(NULL))
ROW(dmem_torch_alloc, "device -1", DMEM_OK, DOCUMENTED(dmem_torch_alloc(64, -1, NULL) == NULL))
ROW(dmem_torch_alloc, "device 64", DMEM_OK, DOCUMENTED(dmem_torch_alloc(64, 64, NULL) == NULL))
ROW(dmem_torch_alloc, "size SIZE_MAX", DMEM_OK, DOCUMENTED(dmem_torch_alloc(SIZE_MAX, 0, NULL) == NULL))
ROW_BODY(dmem_torch_alloc, "size 0 (a block of 1 byte)", DMEM_OK, 0) {
  (void)f;
  void *p = dmem_torch_alloc(0, 0, NULL);
  if (!p) return DMEM_ERR_OUT_OF_MEMORY;
  dmem_torch_free(p, 0, 0, NULL);
  return DMEM_OK;
}
ROW_BODY(dmem_torch_free, "ptr NULL, an unknown pointer, device -1 (nothing happens)", DMEM_OK, 0) {
  dmem_torch_free(NULL, 64, 0, NULL);
  dmem_torch_free(f->raw, 4 * KiB, -1, NULL); /* f->raw is not the default runtime's either */
  dmem_torch_free(f->ipc_out, 64, 0, NULL);   /* logged as a bad free */
  dmem_runtime_t *def;
  dmem_stats_t s;
  if (dmem_runtime_default(0, &def) != DMEM_OK || dmem_stats(def, &s) != DMEM_OK)
    return DMEM_ERR_CALLBACK;
  return DOCUMENTED(s.raw_used == 0);
}

/* ---- running the table ----------------------------------------------------------------- */

static int run_row(fx_t *f, const row_t *r, int bad) {
  char label[256];
  if (bad >= 0) {
    f->bad = f->bad_h[bad];
    snprintf(label, sizeof label, "%s: %s (%s) [line %d]", r->fn, r->what, bad_names[bad], r->line);
  } else {
    f->bad = DMEM_HANDLE_NULL;
    snprintf(label, sizeof label, "%s: %s [line %d]", r->fn, r->what, r->line);
  }
  snap_t before, after;
  snap_take(f, &before);
  outputs_fill(f);
  dmem_status_t st = r->call(f);
  int failed = 0;
  if (st != r->want) {
    fprintf(stderr, "%s: got %s, want %s (%s)\n", label, dmem_status_name(st),
            dmem_status_name(r->want), dmem_last_error_detail());
    failed = 1;
  } else if (st != DMEM_OK && dmem_last_error_detail()[0] == '\0') {
    fprintf(stderr, "%s: %s with no error detail\n", label, dmem_status_name(st));
    failed = 1;
  }
  const char *out = output_written(f);
  if (out && r->want != DMEM_OK) {
    fprintf(stderr, "%s: failed but changed an output: %s\n", label, out);
    failed = 1;
  }
  snap_take(f, &after);
  size_t off = 0;
  const char *d = stats_diff(&before.st, &after.st, &off);
  if (d) {
    fprintf(stderr, "%s: changed the runtime's %s %zu\n", label, d, off);
    failed = 1;
  }
  d = stats_diff(&before.other_st, &after.other_st, &off);
  if (d) {
    fprintf(stderr, "%s: changed the other runtime's %s %zu\n", label, d, off);
    failed = 1;
  }
  for (int i = 0; i < NBUF; i++)
    if (!info_same(&before.info[i], &after.info[i])) {
      fprintf(stderr, "%s: changed the %s buffer (state %d->%d, locks %u->%u)\n", label,
              buf_names[i], before.info[i].state, after.info[i].state,
              before.info[i].lock_count, after.info[i].lock_count);
      failed = 1;
    }
  if (!info_same(&before.other_info, &after.other_info)) {
    fprintf(stderr, "%s: changed the other runtime's buffer\n", label);
    failed = 1;
  }
  return failed;
}

TEST_CASE(every_bad_input_changes_nothing) {
  REQUIRE_EQ(rows_overflow, 0);
  fx_t *f = calloc(1, sizeof *f);
  REQUIRE_TRUE(f != NULL);
  fixture_init(f);
  int runs = 0, failures = 0;
  for (int i = 0; i < nrows; i++) {
    const row_t *r = &rows[i];
    if (r->flags & ROW_EACH_BAD_HANDLE) {
      for (int b = 0; b < NBAD; b++, runs++) failures += run_row(f, r, b);
    } else {
      failures += run_row(f, r, -1);
      runs++;
    }
  }
  fprintf(stderr, "%d rows, %d runs, %d failed\n", nrows, runs, failures);
  CHECK_EQ(failures, 0);
  CHECK_GT(runs, 150);
  fixture_fini(f);
  free(f);
}

/* ---- every public function has rows ------------------------------------------------------ */

/* The names declared `DMEM_API <type> <name>(` in one header. */
static int header_functions(const char *path, char names[][64], int max) {
  FILE *fp = fopen(path, "r");
  if (!fp) return -1;
  fseek(fp, 0, SEEK_END);
  long len = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  char *text = malloc((size_t)len + 1);
  size_t got = fread(text, 1, (size_t)len, fp);
  fclose(fp);
  text[got] = '\0';
  int n = 0;
  for (char *p = strstr(text, "DMEM_API"); p; p = strstr(p + 8, "DMEM_API")) {
    char *paren = strchr(p, '(');
    if (!paren) break;
    if (p > text && (isalnum((unsigned char)p[-1]) || p[-1] == '_')) continue; /* #define */
    char *e = paren;
    while (e > p && isspace((unsigned char)e[-1])) e--;
    char *b = e;
    while (b > p && (isalnum((unsigned char)b[-1]) || b[-1] == '_')) b--;
    if (e - b <= 0 || e - b >= 64 || strncmp(b, "dmem_", 5) != 0) continue;
    if (n < max) {
      memcpy(names[n], b, (size_t)(e - b));
      names[n][e - b] = '\0';
      n++;
    }
  }
  free(text);
  return n;
}

static bool has_rows(const char *fn) {
  for (int i = 0; i < nrows; i++)
    if (strcmp(rows[i].fn, fn) == 0) return true;
  return false;
}

TEST_CASE(every_public_function_has_rows) {
  DIR *d = opendir(DMEM_PUBLIC_HEADERS);
  REQUIRE_TRUE(d != NULL);
  static char names[256][64];
  int total = 0, missing = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    size_t len = strlen(e->d_name);
    if (len < 3 || strcmp(e->d_name + len - 2, ".h") != 0) continue;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", DMEM_PUBLIC_HEADERS, e->d_name);
    int n = header_functions(path, names, 256);
    REQUIRE_TRUE(n >= 0);
    for (int i = 0; i < n; i++, total++) {
      if (has_rows(names[i])) continue;
      fprintf(stderr, "%s: %s has no bad-input rows in tests/test_badinput.c\n", e->d_name,
              names[i]);
      missing++;
    }
  }
  closedir(d);
  fprintf(stderr, "%d public functions, %d rows\n", total, nrows);
  CHECK_EQ(missing, 0);
  CHECK_GE(total, 41); /* the scan found the headers' functions (41 when written) */
  /* and no row names a function the headers do not declare (the table's
   * names are checked by the compiler; this catches a stale scan) */
  for (int i = 0; i < nrows; i++) {
    bool found = false;
    DIR *d2 = opendir(DMEM_PUBLIC_HEADERS);
    while (!found && d2 && (e = readdir(d2)) != NULL) {
      size_t len = strlen(e->d_name);
      if (len < 3 || strcmp(e->d_name + len - 2, ".h") != 0) continue;
      char path[1024];
      snprintf(path, sizeof path, "%s/%s", DMEM_PUBLIC_HEADERS, e->d_name);
      int n = header_functions(path, names, 256);
      for (int k = 0; k < n && !found; k++) found = strcmp(names[k], rows[i].fn) == 0;
    }
    if (d2) closedir(d2);
    if (!found) fprintf(stderr, "row at line %d names %s, not in the headers\n", rows[i].line, rows[i].fn);
    CHECK_TRUE(found);
  }
}

/* ---- duplicate handles of spilled buffers (allowed; not bad input) ------------------------ */

typedef struct dup_check {
  dmem_runtime_t *rt;
  dmem_handle_t h, d;
  int calls, bad;
} dup_check_t;

/* hs = {h, h, d, d, h}: the duplicates get the same address, and h holds
 * three locks, d two, while fn runs. */
static dmem_status_t dup_launch(void *user, dmem_stream_t s, void *const *p, size_t n) {
  (void)s;
  dup_check_t *c = user;
  c->calls++;
  dmem_buffer_info_t hi, di;
  if (n != 5 || p[0] != p[1] || p[0] != p[4] || p[2] != p[3] || p[0] == p[2]) c->bad++;
  if (dmem_buffer_info(c->rt, c->h, &hi) != DMEM_OK || hi.lock_count != 3 ||
      hi.state != DMEM_STATE_RESIDENT)
    c->bad++;
  if (dmem_buffer_info(c->rt, c->d, &di) != DMEM_OK || di.lock_count != 2) c->bad++;
  return DMEM_OK;
}

static void expect_unlocked_resident(dmem_runtime_t *rt, dmem_handle_t h, size_t n, uint64_t seed) {
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 0);
  CHECK_EQ(info.state, DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, n, seed), 0);
}

TEST_CASE(duplicate_handles_of_spilled_buffers) {
  char dir[512];
  check_mkdtemp(dir, sizeof dir, "dmem-dup");
  dmem_runtime_t *rt = fixture_runtime(dir);
  dup_check_t c = {.rt = rt};
  REQUIRE_OK(dmem_buffer_alloc(rt, BUF, 0, &c.h));
  REQUIRE_OK(dmem_buffer_alloc(rt, BUF, 0, &c.d));
  check_put(rt, c.h, BUF, 11);
  check_put(rt, c.d, BUF, 12);
  dmem_handle_t hs[5] = {c.h, c.h, c.d, c.d, c.h};
  /* dmem_lock_and_launch */
  REQUIRE_OK(dmem_buffer_spill(rt, c.h, DMEM_TIER_HOST));
  REQUIRE_OK(dmem_buffer_spill(rt, c.d, DMEM_TIER_DISK));
  CHECK_OK(dmem_lock_and_launch(rt, hs, 5, dup_launch, &c));
  CHECK_EQ(c.calls, 1);
  expect_unlocked_resident(rt, c.h, BUF, 11);
  expect_unlocked_resident(rt, c.d, BUF, 12);
  /* dmem_launch_async, then dmem_sync_and_unlock and dmem_stream_release */
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  for (int release = 0; release < 2; release++) {
    REQUIRE_OK(dmem_buffer_spill(rt, c.h, DMEM_TIER_DISK));
    REQUIRE_OK(dmem_buffer_spill(rt, c.d, DMEM_TIER_HOST));
    CHECK_OK(dmem_launch_async(rt, s, hs, 5, dup_launch, &c));
    if (release) {
      CHECK_OK(dmem_stream_release(rt, s));
      CHECK_OK(dmem_stream_synchronize(rt, s));
    } else {
      CHECK_OK(dmem_sync_and_unlock(rt, s));
    }
    expect_unlocked_resident(rt, c.h, BUF, 11);
    expect_unlocked_resident(rt, c.d, BUF, 12);
  }
  CHECK_EQ(c.calls, 3);
  CHECK_EQ(c.bad, 0);
  /* dmem_buffer_prefetch */
  REQUIRE_OK(dmem_buffer_spill(rt, c.h, DMEM_TIER_HOST));
  REQUIRE_OK(dmem_buffer_spill(rt, c.d, DMEM_TIER_DISK));
  CHECK_OK(dmem_buffer_prefetch(rt, hs, 5, s));
  CHECK_OK(dmem_stream_synchronize(rt, s));
  expect_unlocked_resident(rt, c.h, BUF, 11);
  expect_unlocked_resident(rt, c.d, BUF, 12);
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_buffer_free(rt, c.h));
  CHECK_OK(dmem_buffer_free(rt, c.d));
  dmem_runtime_destroy(rt);
  CHECK_EQ(rmdir(dir), 0);
}

/* ---- every status a call returns is in its header -------------------------------------- */

/* The documentation comment of public function fn (the text from the last
 * comment opening before its DMEM_API declaration to the declaration), in
 * buf; false if no header declares fn. */
static bool doc_of(const char *fn, char *buf, size_t n) {
  DIR *d = opendir(DMEM_PUBLIC_HEADERS);
  if (!d) return false;
  bool found = false;
  struct dirent *e;
  while (!found && (e = readdir(d)) != NULL) {
    size_t len = strlen(e->d_name);
    if (len < 3 || strcmp(e->d_name + len - 2, ".h") != 0) continue;
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", DMEM_PUBLIC_HEADERS, e->d_name);
    FILE *fp = fopen(path, "r");
    if (!fp) continue;
    static char text[1 << 17];
    size_t got = fread(text, 1, sizeof text - 1, fp);
    fclose(fp);
    text[got] = '\0';
    for (char *p = strstr(text, "DMEM_API"); p && !found; p = strstr(p + 8, "DMEM_API")) {
      char *paren = strchr(p, '(');
      if (!paren) break;
      char *b = paren;
      while (b > p && isspace((unsigned char)b[-1])) b--;
      char *name_end = b;
      while (b > p && (isalnum((unsigned char)b[-1]) || b[-1] == '_')) b--;
      if ((size_t)(name_end - b) != strlen(fn) || strncmp(b, fn, strlen(fn)) != 0) continue;
      char *c = p;
      while (c > text && strncmp(c, "/*", 2) != 0) c--;
      size_t k = (size_t)(p - c) < n - 1 ? (size_t)(p - c) : n - 1;
      memcpy(buf, c, k);
      buf[k] = '\0';
      found = true;
    }
  }
  closedir(d);
  return found;
}

/* Whether fn's header comment names status st, following "@return as
 * dmem_other" to the comment it points to. */
static bool documents(const char *fn, dmem_status_t st) {
  static char doc[16384];
  for (int hops = 0; hops < 3; hops++) {
    if (!doc_of(fn, doc, sizeof doc)) return false;
    if (strstr(doc, dmem_status_name(st))) return true;
    const char *as = strstr(doc, "@return as dmem_");
    if (!as) return false;
    static char next[64];
    size_t k = 0;
    for (as += strlen("@return as "); k < sizeof next - 1 && (isalnum((unsigned char)*as) || *as == '_');)
      next[k++] = *as++;
    next[k] = '\0';
    fn = next;
  }
  return false;
}

/* Statuses a call can return that no bad input provokes (read from the
 * code; each row names where it comes from). */
static const struct {
  const char *fn;
  dmem_status_t st;
  const char *where;
} known[] = {
    {"dmem_buffer_lock", DMEM_ERR_HOST_OUT_OF_MEMORY, "retrieve staging (disk/controller load)"},
    {"dmem_buffer_unspill", DMEM_ERR_HOST_OUT_OF_MEMORY, "retrieve staging (disk/controller load)"},
    {"dmem_runtime_evict", DMEM_ERR_HOST_OUT_OF_MEMORY, "the victim list (policy.c)"},
    {"dmem_runtime_evict", DMEM_ERR_CALLBACK, "select_victims failed"},
    {"dmem_runtime_evict", DMEM_ERR_DEVICE_FATAL, "check_live after a fatal error"},
    {"dmem_runtime_create", DMEM_ERR_IO, "getcwd for a relative spill_dir"},
    {"dmem_buffer_alloc", DMEM_ERR_OUT_OF_MEMORY, "nothing left to spill"},
};

/* Every status the table above expects of a function, and every status in
 * `known`, is named in that function's header comment (DMEM_ERR_FORKED is
 * documented once for all calls in dmem/runtime.h). Before the audit
 * dmem_buffer_lock, dmem_buffer_unspill and dmem_runtime_evict did not list
 * DMEM_ERR_HOST_OUT_OF_MEMORY. */
TEST_CASE(every_status_is_documented) {
  int bad = 0;
  for (int i = 0; i < nrows; i++) {
    dmem_status_t st = rows[i].want;
    if (st == DMEM_OK || st == DMEM_ERR_FORKED || !dmem_status_name(st) ||
        strncmp(dmem_status_name(st), "DMEM_", 5) != 0)
      continue;
    if (!documents(rows[i].fn, st)) {
      fprintf(stderr, "%s (row at line %d, %s): %s not in its header comment\n", rows[i].fn,
              rows[i].line, rows[i].what, dmem_status_name(st));
      bad++;
    }
  }
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
    if (!documents(known[i].fn, known[i].st)) {
      fprintf(stderr, "%s: %s (%s) not in its header comment\n", known[i].fn,
              dmem_status_name(known[i].st), known[i].where);
      bad++;
    }
  }
  CHECK_EQ(bad, 0);
}
