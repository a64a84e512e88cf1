/* Fault injection, SQLite style (label `fault`): every core scenario runs
 * once per injection point, for n = 1, 2, ... with the n-th backend or disk
 * call failed (runtime/backend/fault.c), until a run reaches no n-th call.
 * After each injected failure:
 *  - every public call of the scenario returned a status its header
 *    documents;
 *  - unless the failure was fatal: every byte of every live buffer and raw
 *    allocation is intact (checksums), nothing stayed locked, the runtime
 *    still allocates, spills to host and disk and locks, and once
 *    everything is freed no byte stays charged anywhere (device, host tier,
 *    disk, controller, device pool, pinned pool);
 *  - after a fatal failure: DMEM_ERR_DEVICE_FATAL is sticky (every call
 *    that needs the device gives it), frees still work;
 *  - in every case, after destroy nothing the backend handed out is still
 *    held (device and pinned allocations, events, streams); ASan checks the
 *    heap on top.
 * Each scenario runs the loop twice: with each call's own failure status
 * (out of memory, a device error, EIO/ENOSPC, a sticky error where that is
 * the only one the call can give) and with every backend call failing as
 * DMEM_ERR_DEVICE_FATAL.
 *
 * Runs on the backend of DMEM_BACKEND (default host). DMEM_FAULT_STRIDE=k
 * (default 1) injects only at n = 1, 1+k, 1+2k, ... (scripts/gpu-test uses
 * it where each runtime costs a cudaMallocHost); DMEM_FAULT_ONLY=n (or
 * n:fatal) runs the one plan, to reproduce a failure.
 *
 * White-box: the plan (dmem__fault_arm) and a few internal counters (the
 * pools, staging) are internal. */
#include <errno.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "runtime/api/api.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
/* Buffer sizes are in units of U, the device limit is 64 U: the suite
 * scales with U (small, so that the ASan run stays within its minute). */
#define U ((size_t)32 << 10)
#define LIMIT (64 * U)

/* The byte pattern of `seed`, 8 bytes at a time (check_fill's per-byte
 * pattern costs too much under ASan for thousands of runs). */
static uint64_t pat_next(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}
static void pat_fill(void *p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  unsigned char *b = p;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = pat_next(&x);
    memcpy(b + i, &v, n - i < 8 ? n - i : 8);
  }
}
/* Bytes of p that differ from the pattern. */
static size_t pat_bad(const void *p, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  const unsigned char *b = p;
  size_t bad = 0;
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = pat_next(&x), got = 0;
    size_t k = n - i < 8 ? n - i : 8;
    memcpy(&got, b + i, k);
    if (k < 8) v &= ((uint64_t)1 << (8 * k)) - 1;
    if (got != v)
      for (size_t j = 0; j < k; j++) bad += ((got >> (8 * j)) & 0xFF) != ((v >> (8 * j)) & 0xFF);
  }
  return bad;
}

/* ---- documented statuses --------------------------------------------------------- */

#define B(st) (1ull << (unsigned)(-(int)(st)))
#define OK_ B(DMEM_OK)
#define INV B(DMEM_ERR_INVALID_ARGUMENT)
#define STALE B(DMEM_ERR_STALE_HANDLE)
#define BUSY B(DMEM_ERR_BUSY)
#define NOTL B(DMEM_ERR_NOT_LOCKED)
#define OOM B(DMEM_ERR_OUT_OF_MEMORY)
#define HOOM B(DMEM_ERR_HOST_OUT_OF_MEMORY)
#define IO B(DMEM_ERR_IO)
#define CB B(DMEM_ERR_CALLBACK)
#define CFG B(DMEM_ERR_CONFIG)
#define NODEV B(DMEM_ERR_NO_DEVICE)
#define DEV B(DMEM_ERR_DEVICE)
#define FATAL B(DMEM_ERR_DEVICE_FATAL)

typedef enum api {
  API_CREATE, API_ALLOC, API_FREE, API_LOCK, API_UNLOCK, API_INFO, API_SPILL, API_UNSPILL,
  API_PREFETCH, API_EVICT, API_LAUNCH_ASYNC, API_LOCK_AND_LAUNCH, API_SYNC_AND_UNLOCK,
  API_STREAM_RELEASE, API_STREAM_CREATE, API_STREAM_DESTROY, API_STREAM_SYNC,
  API_ENQUEUE_HOST, API_COPY, API_DEVICE_MALLOC, API_DEVICE_FREE, API_MEMORY_INFO,
  API_DEVICE_TRIM, API_HOST_TRIM, API_POLL, API_STATS, API_DEVICE_ADOPT, API_READ, API_N
} api_t;

/* What each call's header (include/dmem/) says it returns. */
static const struct {
  const char *name;
  unsigned long long ok;
} apis[API_N] = {
    [API_CREATE] = {"dmem_runtime_create", OK_ | INV | CFG | NODEV | DEV | FATAL | HOOM},
    [API_ALLOC] = {"dmem_buffer_alloc", OK_ | INV | OOM | HOOM | IO | DEV | FATAL},
    [API_FREE] = {"dmem_buffer_free", OK_ | INV | STALE},
    [API_LOCK] = {"dmem_buffer_lock", OK_ | INV | STALE | BUSY | OOM | IO | CB | DEV | FATAL},
    [API_UNLOCK] = {"dmem_buffer_unlock", OK_ | INV | STALE | NOTL},
    [API_INFO] = {"dmem_buffer_info", OK_ | INV | STALE},
    [API_SPILL] = {"dmem_buffer_spill", OK_ | INV | STALE | BUSY | HOOM | IO | CB | DEV | FATAL},
    [API_UNSPILL] = {"dmem_buffer_unspill", OK_ | INV | STALE | BUSY | OOM | IO | CB | DEV | FATAL},
    [API_PREFETCH] = {"dmem_buffer_prefetch",
                      OK_ | INV | STALE | BUSY | OOM | HOOM | IO | CB | DEV | FATAL},
    [API_EVICT] = {"dmem_runtime_evict", OK_ | INV | CB | DEV | FATAL},
    /* fn's status (the test's launch functions return dmem_stream_copy's) or
     * dmem_buffer_lock's, or HOST_OUT_OF_MEMORY */
    [API_LAUNCH_ASYNC] = {"dmem_launch_async",
                          OK_ | INV | STALE | BUSY | OOM | HOOM | IO | CB | DEV | FATAL},
    [API_LOCK_AND_LAUNCH] = {"dmem_lock_and_launch",
                             OK_ | INV | STALE | BUSY | OOM | HOOM | IO | CB | DEV | FATAL},
    [API_SYNC_AND_UNLOCK] = {"dmem_sync_and_unlock", OK_ | INV | DEV | FATAL},
    [API_STREAM_RELEASE] = {"dmem_stream_release", OK_ | INV | HOOM | DEV | FATAL},
    [API_STREAM_CREATE] = {"dmem_stream_create", OK_ | INV | HOOM | DEV | FATAL},
    [API_STREAM_DESTROY] = {"dmem_stream_destroy", OK_ | INV | BUSY | DEV | FATAL},
    [API_STREAM_SYNC] = {"dmem_stream_synchronize", OK_ | INV | DEV | FATAL},
    [API_ENQUEUE_HOST] = {"dmem_stream_enqueue_host", OK_ | INV | HOOM | DEV | FATAL},
    [API_COPY] = {"dmem_stream_copy", OK_ | INV | HOOM | DEV | FATAL},
    [API_DEVICE_MALLOC] = {"dmem_device_malloc", OK_ | INV | OOM | DEV | FATAL | HOOM},
    [API_DEVICE_FREE] = {"dmem_device_free", OK_ | INV},
    [API_MEMORY_INFO] = {"dmem_device_memory_info", OK_ | INV | DEV | FATAL},
    [API_DEVICE_TRIM] = {"dmem_device_trim", OK_ | INV | DEV | FATAL},
    [API_HOST_TRIM] = {"dmem_host_trim", OK_ | INV},
    [API_POLL] = {"dmem_runtime_poll", OK_ | INV | DEV | FATAL},
    [API_STATS] = {"dmem_stats", OK_ | INV},
    [API_DEVICE_ADOPT] = {"dmem_device_adopt", OK_ | INV | HOOM | DEV | FATAL},
    [API_READ] = {"dmem_buffer_read", OK_ | INV | STALE | BUSY | IO | DEV | FATAL},
};

/* ---- the fixture: a runtime and what lives in it ------------------------------------- */

#define NBUF 12
#define NRAW 4

/* The controller tier: copies kept by handle. */
typedef struct ctl_entry {
  dmem_handle_t h;
  void *data;
  size_t size;
} ctl_entry_t;

typedef struct fx {
  dmem_runtime_t *rt;
  dmem_stream_t s; /* a stream of the test's */
  size_t limit, host_limit;
  bool with_controller;
  /* buffers: known content `seed` when `known` */
  int nbuf;
  dmem_handle_t h[NBUF];
  size_t size[NBUF];
  uint64_t seed[NBUF];
  bool live[NBUF], known[NBUF];
  /* DMEM_BUFFER_STABLE_ADDRESS buffers: their address, from the first
   * lock on; every later lock must return it */
  bool stable[NBUF];
  void *addr[NBUF];
  /* raw allocations (their stream is raw_s) */
  void *raw[NRAW];
  size_t rawsize[NRAW];
  uint64_t rawseed[NRAW];
  dmem_stream_t raw_s[NRAW];
  /* host memory that copies enqueued by launch functions read */
  void *src[8];
  int nsrc;
  ctl_entry_t ctl[NBUF * 2];
  int nctl;
  atomic_int host_ran; /* host functions run (the fixture outlives its stream) */
  int bad;           /* undocumented statuses */
  const char *where; /* scenario and plan, for messages */
  uint64_t seeds;    /* the next seed */
} fx_t;

static char where_buf[160];

static dmem_status_t checked(fx_t *f, api_t api, dmem_status_t st, int line) {
  if (!(apis[api].ok & B(st))) {
    fprintf(stderr, "test_fault.c:%d: %s returned %s, which its header does not document (%s) [%s]\n",
            line, apis[api].name, dmem_status_name(st), dmem_last_error_detail(), f->where);
    f->bad++;
    check_failed_ = 1;
  }
  return st;
}
#define DO(api, expr) checked(f, (api), (expr), __LINE__)

/* A failed expectation of the verification phase (which runs with no fault
 * injected): report once per run with the plan. */
#define EXPECT(cond, ...)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "test_fault.c:%d: [%s] ", __LINE__, f->where);             \
      fprintf(stderr, __VA_ARGS__);                                              \
      fprintf(stderr, "\n");                                                     \
      check_failed_ = 1;                                                         \
      f->bad++;                                                                  \
    }                                                                            \
  } while (0)

/* ---- moves whose failure must leave the buffer where it was ---------------------------- */

static int state_of(fx_t *f, int i) {
  dmem_buffer_info_t info;
  return dmem_buffer_info(f->rt, f->h[i], &info) == DMEM_OK ? (int)info.state : -1;
}

/* After a failed move of buffer i (status st): "the bytes stay where they
 * were" (dmem_buffer_spill, dmem_buffer_unspill, dmem_buffer_lock, dmem_buffer_prefetch). */
static void same_place(fx_t *f, int i, int before, dmem_status_t st, const char *what, int line) {
  if (st == DMEM_OK) return;
  int after = state_of(f, i);
  if (after != before) {
    fprintf(stderr, "test_fault.c:%d: [%s] %s of buffer %d failed (%s) but moved it: state %d -> %d\n",
            line, f->where, what, i, dmem_status_name(st), before, after);
    check_failed_ = 1;
    f->bad++;
  }
}

static dmem_status_t t_spill_(fx_t *f, int i, dmem_tier_t tier, int line) {
  int before = state_of(f, i);
  dmem_status_t st = checked(f, API_SPILL, dmem_buffer_spill(f->rt, f->h[i], tier), line);
  same_place(f, i, before, st, "spill", line);
  return st;
}
static dmem_status_t t_unspill_(fx_t *f, int i, dmem_stream_t s, int line) {
  int before = state_of(f, i);
  dmem_status_t st = checked(f, API_UNSPILL, dmem_buffer_unspill(f->rt, f->h[i], s), line);
  same_place(f, i, before, st, "unspill", line);
  return st;
}
static dmem_status_t t_lock_(fx_t *f, int i, dmem_stream_t s, void **p, int line) {
  int before = state_of(f, i);
  dmem_status_t st = checked(f, API_LOCK, dmem_buffer_lock(f->rt, f->h[i], s, p), line);
  same_place(f, i, before, st, "lock", line);
  return st;
}
#define t_spill(f, i, tier) t_spill_((f), (i), (tier), __LINE__)
#define t_unspill(f, i, s) t_unspill_((f), (i), (s), __LINE__)
#define t_lock(f, i, s, p) t_lock_((f), (i), (s), (p), __LINE__)

/* ---- the controller ---------------------------------------------------------------- */

static ctl_entry_t *ctl_find(fx_t *f, dmem_handle_t h) {
  for (int i = 0; i < f->nctl; i++)
    if (f->ctl[i].h == h) return &f->ctl[i];
  return NULL;
}

static dmem_status_t ctl_store(void *user, dmem_handle_t h, const void *data, size_t size) {
  fx_t *f = user;
  ctl_entry_t *e = ctl_find(f, h);
  if (!e) {
    if (f->nctl == (int)(sizeof f->ctl / sizeof f->ctl[0])) return DMEM_ERR_CALLBACK;
    e = &f->ctl[f->nctl++];
    e->h = h;
    e->data = NULL;
  }
  free(e->data);
  e->data = malloc(size);
  if (!e->data) return DMEM_ERR_CALLBACK;
  memcpy(e->data, data, size);
  e->size = size;
  return DMEM_OK;
}

static dmem_status_t ctl_retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  fx_t *f = user;
  ctl_entry_t *e = ctl_find(f, h);
  if (!e || !e->data || e->size != size) return DMEM_ERR_CALLBACK;
  memcpy(out, e->data, size);
  return DMEM_OK; /* the copy stays: the runtime may ask again after a failed retrieve */
}

/* Victims: the newest buffers first (not the default policy's order). */
static dmem_status_t ctl_victims(void *user, size_t need, dmem_handle_t *v, size_t cap,
                                 size_t *n_out) {
  fx_t *f = user;
  size_t n = 0, got = 0;
  for (int i = f->nbuf - 1; i >= 0 && n < cap && got < need; i--) {
    if (!f->live[i]) continue;
    v[n++] = f->h[i];
    got += f->size[i];
  }
  *n_out = n;
  return DMEM_OK;
}

static void ctl_free_all(fx_t *f) {
  for (int i = 0; i < f->nctl; i++) free(f->ctl[i].data);
  f->nctl = 0;
}

/* ---- setup helpers (no fault armed: failures abort) ------------------------------------ */

/* dmem_config_t.retrieve_swap of the runtimes made: pieces (the default),
 * or on (the swap case: the bounce's failure paths) */
static int g_retrieve_swap = 2;

static dmem_status_t create_runtime(fx_t *f, dmem_runtime_t **rt_out) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.spill_ahead = 0;
  cfg.device_limit = f->limit;
  cfg.host_limit = f->host_limit;
  cfg.oom_wait_ms = 0; /* nothing runs in the background to wait for */
  cfg.retrieve_swap = g_retrieve_swap;
  cfg.log_level = DMEM_LOG_ERROR; /* warnings of injected failures are expected here */
  return dmem_runtime_create(&cfg, rt_out);
}

static void setup_fail(const char *what, dmem_status_t st) {
  fprintf(stderr, "setup: %s: %s (%s)\n", what, dmem_status_name(st), dmem_last_error_detail());
  abort();
}

/* Write the pattern `seed` into buffer i (lock, copy, synchronise,
 * unlock). Returns the first failing status; the content is then unknown. */
static dmem_status_t put(fx_t *f, int i, uint64_t seed) {
  size_t n = f->size[i];
  void *tmp = malloc(n), *p = NULL;
  if (!tmp) abort();
  pat_fill(tmp, n, seed);
  dmem_status_t st = DO(API_LOCK, dmem_buffer_lock(f->rt, f->h[i], NULL, &p));
  if (st == DMEM_OK && f->stable[i]) {
    if (!f->addr[i]) f->addr[i] = p;
    EXPECT(p == f->addr[i], "stable buffer %d locked at %p, first at %p", i, p, f->addr[i]);
  }
  if (st == DMEM_OK) {
    f->known[i] = false;
    st = DO(API_COPY, dmem_stream_copy(f->rt, p, tmp, n, NULL));
    dmem_status_t sy = DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, NULL));
    if (st == DMEM_OK) st = sy;
    if (st == DMEM_OK) {
      f->seed[i] = seed;
      f->known[i] = true;
    }
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[i]));
  }
  free(tmp);
  return st;
}

/* Allocate buffer slot i of `size` bytes and fill it (under a plan: each
 * status is checked; a buffer whose fill failed has unknown content). */
static dmem_status_t add_buffer(fx_t *f, size_t size, unsigned flags) {
  if (f->nbuf == NBUF) abort();
  int i = f->nbuf;
  dmem_status_t st = DO(API_ALLOC, dmem_buffer_alloc(f->rt, size, flags, &f->h[i]));
  if (st != DMEM_OK) return st;
  f->nbuf++;
  f->size[i] = size;
  f->live[i] = true;
  f->known[i] = false;
  f->stable[i] = (flags & DMEM_BUFFER_STABLE_ADDRESS) != 0;
  f->addr[i] = NULL;
  return put(f, i, ++f->seeds);
}

static void setup_buffers(fx_t *f, int n, size_t size) {
  for (int k = 0; k < n; k++) {
    dmem_status_t st = add_buffer(f, size, 0);
    if (st != DMEM_OK) setup_fail("buffer", st);
  }
}

static void setup_controller(fx_t *f) {
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.user = f;
  c.store = ctl_store;
  c.retrieve = ctl_retrieve;
  c.select_victims = ctl_victims;
  dmem_status_t st = dmem_controller_set(f->rt, &c);
  if (st != DMEM_OK) setup_fail("controller", st);
}

/* Bytes of buffer i that differ from its pattern, or SIZE_MAX when it
 * cannot be read (the status printed). */
static size_t bad_bytes(fx_t *f, int i) {
  size_t n = f->size[i];
  void *tmp = calloc(1, n), *p = NULL;
  if (!tmp) abort();
  dmem_status_t st = dmem_buffer_lock(f->rt, f->h[i], NULL, &p);
  if (st == DMEM_OK && f->stable[i] && f->addr[i])
    EXPECT(p == f->addr[i], "stable buffer %d locked at %p, first at %p", i, p, f->addr[i]);
  if (st == DMEM_OK) st = dmem_stream_copy(f->rt, tmp, p, n, NULL);
  if (st == DMEM_OK) st = dmem_stream_synchronize(f->rt, NULL);
  if (p) (void)dmem_buffer_unlock(f->rt, f->h[i]);
  size_t bad = st == DMEM_OK ? pat_bad(tmp, n, f->seed[i]) : SIZE_MAX;
  if (st != DMEM_OK)
    fprintf(stderr, "reading buffer %d: %s (%s)\n", i, dmem_status_name(st),
            dmem_last_error_detail());
  free(tmp);
  return bad;
}

static size_t raw_bad_bytes(fx_t *f, int r) {
  size_t n = f->rawsize[r];
  void *tmp = calloc(1, n);
  if (!tmp) abort();
  dmem_status_t st = dmem_stream_copy(f->rt, tmp, f->raw[r], n, f->raw_s[r]);
  if (st == DMEM_OK) st = dmem_stream_synchronize(f->rt, f->raw_s[r]);
  size_t bad = st == DMEM_OK ? pat_bad(tmp, n, f->rawseed[r]) : SIZE_MAX;
  free(tmp);
  return bad;
}

/* ---- launch functions: "kernels" that write a buffer through a copy ------------------- */

typedef struct launch_arg {
  fx_t *f;
  int target;    /* which of the handles (index into the launch's list) is written */
  int buf;       /* and its buffer slot */
  uint64_t seed; /* with this pattern */
} launch_arg_t;

/* A host buffer holding pattern `seed` for n bytes, alive until the
 * fixture is torn down (copies read it in stream order). */
static void *pattern(fx_t *f, size_t n, uint64_t seed) {
  if (f->nsrc == (int)(sizeof f->src / sizeof f->src[0])) abort();
  void *p = malloc(n);
  if (!p) abort();
  pat_fill(p, n, seed);
  f->src[f->nsrc++] = p;
  return p;
}

static dmem_status_t launch_write(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  launch_arg_t *a = user;
  fx_t *f = a->f;
  (void)n;
  size_t size = f->size[a->buf];
  void *src = pattern(f, size, a->seed);
  f->known[a->buf] = false;
  dmem_status_t st = DO(API_COPY, dmem_stream_copy(f->rt, ptrs[a->target], src, size, s));
  if (st == DMEM_OK) {
    /* enqueued: the buffer holds the new pattern once the stream gets there
     * (and unknown content only if the stream's work is lost: fatal) */
    f->seed[a->buf] = a->seed;
    f->known[a->buf] = true;
  } else {
    f->known[a->buf] = true; /* nothing was enqueued: the old content stays */
  }
  return st;
}

static void host_noop(void *user) { atomic_fetch_add((atomic_int *)user, 1); }

/* ---- scenarios ------------------------------------------------------------------------- */

typedef struct scenario {
  const char *name;
  size_t limit, host_limit;
  bool controller;
  bool in_run; /* the runtime is created (and destroyed) under the plan */
  bool full;   /* also the fatal and the persistent loops (not for the
                  slow large-buffer scenario, whose paths the others reach) */
  void (*setup)(fx_t *f);
  void (*run)(fx_t *f);
} scenario_t;

/* alloc: allocations under the limit, a pinned one, then more than the
 * limit holds (on-demand eviction to the host tier). */
static void alloc_setup(fx_t *f) { setup_buffers(f, 3, 8 * U); }
static void alloc_run(fx_t *f) {
  (void)add_buffer(f, 8 * U, 0);
  (void)add_buffer(f, 4 * U, DMEM_ALLOC_PINNED);
  (void)add_buffer(f, 16 * U, 0);
  (void)add_buffer(f, 32 * U, 0); /* past the limit: spills */
  (void)add_buffer(f, 3 * U / 2, 0);
}

/* lock / unlock: resident, from the host tier, from disk, twice, on a
 * stream, and the lock of a spilled buffer that needs room. */
static void lock_setup(fx_t *f) {
  setup_buffers(f, 5, 8 * U);
  dmem_status_t st = dmem_buffer_spill(f->rt, f->h[1], DMEM_TIER_HOST);
  if (st == DMEM_OK) st = dmem_buffer_spill(f->rt, f->h[2], DMEM_TIER_DISK);
  if (st != DMEM_OK) setup_fail("spill", st);
  (void)add_buffer(f, 24 * U, 0); /* 56 U resident of 64 */
}
static void lock_run(fx_t *f) {
  void *p[6] = {0};
  dmem_status_t st[6];
  st[0] = t_lock(f, 0, NULL, &p[0]);
  st[1] = t_lock(f, 1, f->s, &p[1]); /* host tier */
  st[2] = t_lock(f, 2, NULL, &p[2]); /* disk, needs room */
  st[3] = t_lock(f, 0, f->s, &p[3]); /* a second lock */
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
  for (int k = 0; k < 4; k++)
    if (st[k] == DMEM_OK) (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[k == 3 ? 0 : k]));
  (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[3])); /* not locked */
  /* written while locked on a stream */
  if (t_lock(f, 4, f->s, &p[4]) == DMEM_OK) {
    uint64_t seed = ++f->seeds;
    void *src = pattern(f, f->size[4], seed);
    f->known[4] = false;
    if (DO(API_COPY, dmem_stream_copy(f->rt, p[4], src, f->size[4], f->s)) == DMEM_OK) f->seed[4] = seed;
    f->known[4] = true;
    (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[4]));
  }
  dmem_buffer_info_t info;
  (void)DO(API_INFO, dmem_buffer_info(f->rt, f->h[2], &info));
}

/* spill and unspill through the host tier: spill, unspill on a stream,
 * prefetch, lock after spill, pinned-pool trim. */
static void host_setup(fx_t *f) { setup_buffers(f, 4, 4 * U); }
static void host_run(fx_t *f) {
  (void)t_spill(f, 0, DMEM_TIER_HOST);
  (void)t_spill(f, 1, DMEM_TIER_HOST);
  (void)t_spill(f, 2, DMEM_TIER_HOST);
  (void)t_unspill(f, 0, f->s);
  dmem_handle_t pf[3] = {f->h[1], f->h[0], f->h[3]}; /* spilled, back, resident */
  (void)DO(API_PREFETCH, dmem_buffer_prefetch(f->rt, pf, 3, f->s));
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
  void *p;
  if (t_lock(f, 2, NULL, &p) == DMEM_OK)
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[2]));
  (void)t_spill(f, 3, DMEM_TIER_HOST);
  (void)t_spill(f, 0, DMEM_TIER_HOST);
  (void)DO(API_FREE, dmem_buffer_free(f->rt, f->h[3]));
  f->live[3] = false;
  (void)DO(API_HOST_TRIM, dmem_host_trim(f->rt, 0, NULL));
  (void)DO(API_POLL, dmem_runtime_poll(f->rt));
}

/* spill and unspill through disk: device -> disk, host -> disk, disk ->
 * device by lock, unspill and prefetch. */
static void disk_setup(fx_t *f) { setup_buffers(f, 4, 4 * U); }
static void disk_run(fx_t *f) {
  (void)t_spill(f, 0, DMEM_TIER_DISK);
  (void)t_spill(f, 1, DMEM_TIER_HOST);
  (void)t_spill(f, 1, DMEM_TIER_DISK);
  (void)t_spill(f, 2, DMEM_TIER_DISK);
  void *p;
  if (t_lock(f, 0, f->s, &p) == DMEM_OK) {
    (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[0]));
  }
  (void)t_unspill(f, 1, NULL);
  (void)DO(API_PREFETCH, dmem_buffer_prefetch(f->rt, &f->h[2], 1, f->s));
  (void)t_spill(f, 3, DMEM_TIER_DISK);
  (void)DO(API_FREE, dmem_buffer_free(f->rt, f->h[3])); /* freed on disk */
  f->live[3] = false;
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
}

/* a buffer larger than one disk chunk (8 MiB): its write and read are
 * shared with the I/O threads, and a failed chunk stops the others. */
static void disk_large_setup(fx_t *f) {
  setup_buffers(f, 1, 9 * MiB);
  f->rt->copy_chunk = 4 * MiB;
}
static void disk_large_run(fx_t *f) {
  (void)t_spill(f, 0, DMEM_TIER_DISK);
  void *p;
  if (t_lock(f, 0, NULL, &p) == DMEM_OK)
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[0]));
}

/* the host tier over its limit: the I/O threads push the least recently
 * used buffers down to disk; then they come back. */
static void pushdown_setup(fx_t *f) { setup_buffers(f, 4, 4 * U); }
static void pushdown_run(fx_t *f) {
  for (int i = 0; i < 4; i++) (void)t_spill(f, i, DMEM_TIER_HOST);
  dmem__io_quiesce(f->rt->io);
  void *p;
  if (t_lock(f, 0, NULL, &p) == DMEM_OK)
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[0]));
  (void)t_unspill(f, 3, NULL);
  (void)t_spill(f, 0, DMEM_TIER_HOST);
  dmem__io_quiesce(f->rt->io);
}

/* the controller tier: spill to it from the device and from the host tier,
 * bring back by unspill and lock, and eviction with the controller's
 * victims. */
static void controller_setup(fx_t *f) {
  setup_controller(f);
  setup_buffers(f, 5, 8 * U);
}
static void controller_run(fx_t *f) {
  (void)t_spill(f, 0, DMEM_TIER_CONTROLLER);
  (void)t_spill(f, 1, DMEM_TIER_HOST);
  (void)t_spill(f, 1, DMEM_TIER_CONTROLLER);
  (void)t_unspill(f, 0, f->s);
  void *p;
  if (t_lock(f, 1, NULL, &p) == DMEM_OK)
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[1]));
  size_t freed = 0;
  (void)DO(API_EVICT, dmem_runtime_evict(f->rt, 16 * U, &freed));
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
}

/* read in place: resident (also right after an unspill, its copy maybe in
 * flight), from the host tier and from disk, whole and from inside a
 * block. A read moves nothing, failed or not; one that succeeded got the
 * right bytes. */
static void t_read_(fx_t *f, int i, size_t off, size_t n, int line) {
  int before = state_of(f, i);
  unsigned char *dst = malloc(n), *want = malloc(f->size[i]);
  if (!dst || !want) abort();
  dmem_status_t st = checked(f, API_READ, dmem_buffer_read(f->rt, f->h[i], off, dst, n), line);
  int after = state_of(f, i);
  if (after != before) {
    fprintf(stderr, "test_fault.c:%d: [%s] read of buffer %d (%s) moved it: state %d -> %d\n",
            line, f->where, i, dmem_status_name(st), before, after);
    check_failed_ = 1;
    f->bad++;
  }
  pat_fill(want, f->size[i], f->seed[i]);
  if (st == DMEM_OK && f->known[i] && memcmp(dst, want + off, n) != 0) {
    fprintf(stderr, "test_fault.c:%d: [%s] read of buffer %d returned wrong bytes\n", line,
            f->where, i);
    check_failed_ = 1;
    f->bad++;
  }
  free(dst);
  free(want);
}
#define t_read(f, i, off, n) t_read_((f), (i), (off), (n), __LINE__)

static void read_setup(fx_t *f) {
  setup_buffers(f, 4, 4 * U + 100);
  dmem_status_t st = dmem_buffer_spill(f->rt, f->h[1], DMEM_TIER_HOST);
  if (st == DMEM_OK) st = dmem_buffer_spill(f->rt, f->h[2], DMEM_TIER_DISK);
  if (st == DMEM_OK) st = dmem_buffer_spill(f->rt, f->h[3], DMEM_TIER_DISK);
  if (st != DMEM_OK) setup_fail("spill", st);
}
static void read_run(fx_t *f) {
  for (int i = 0; i < 3; i++) {
    t_read(f, i, 0, f->size[i]);
    t_read(f, i, 4097, 2 * U);
  }
  (void)t_unspill(f, 3, f->s);
  t_read(f, 3, 5, f->size[3] - 5);
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
}

/* evict: by policy, then an allocation that needs room, then locks that
 * bring everything back (each spilling others). */
static void evict_setup(fx_t *f) { setup_buffers(f, 5, 8 * U); }
static void evict_run(fx_t *f) {
  size_t freed = 0;
  (void)DO(API_EVICT, dmem_runtime_evict(f->rt, 16 * U, &freed));
  (void)add_buffer(f, 24 * U, 0);
  for (int i = 0; i < 3; i++) {
    void *p;
    if (t_lock(f, i, NULL, &p) == DMEM_OK)
      (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[i]));
  }
  (void)DO(API_EVICT, dmem_runtime_evict(f->rt, 128 * U, &freed));
}

/* evict_batch: ten small buffers out in one dmem_runtime_evict (one spill batch:
 * one staging carve, ten copies, one event, one pool release), back with
 * one prefetch, and out again right away (their unspill copies may still
 * run: staging reused after unspill_event). A failure anywhere in a batch
 * leaves every victim resident with its bytes. */
static void evict_batch_setup(fx_t *f) { setup_buffers(f, 10, U); }
static void evict_batch_run(fx_t *f) {
  size_t freed = 0;
  (void)DO(API_EVICT, dmem_runtime_evict(f->rt, 10 * U, &freed));
  (void)DO(API_PREFETCH, dmem_buffer_prefetch(f->rt, f->h, 10, f->s));
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
  (void)DO(API_EVICT, dmem_runtime_evict(f->rt, 6 * U, &freed));
  void *p;
  if (t_lock(f, 9, NULL, &p) == DMEM_OK) (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[9]));
}

/* swap: six equal buffers under a limit that holds four, locked in turn:
 * each one brought back from the host tier trades places with a victim of
 * its size (spill/swap.c: a device bounce buffer, three copies a piece). A
 * failure before, during or after the copies leaves both buffers' bytes
 * where they were. */
static void swap_setup(fx_t *f) { setup_buffers(f, 6, 16 * U); }
static void swap_run(fx_t *f) {
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < 6; i++) {
      void *p;
      if (t_lock(f, i, NULL, &p) == DMEM_OK)
        (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[i]));
    }
}

/* launch_async / stream_release / sync_and_unlock / lock_and_launch, a
 * host function, and a spill of a buffer a release still holds. */
static void launch_setup(fx_t *f) {
  setup_buffers(f, 4, 4 * U);
  dmem_status_t st = dmem_buffer_spill(f->rt, f->h[2], DMEM_TIER_HOST);
  if (st != DMEM_OK) setup_fail("spill", st);
}
static void launch_run(fx_t *f) {
  launch_arg_t a1 = {f, 1, 1, ++f->seeds};
  dmem_handle_t hs1[2] = {f->h[0], f->h[1]};
  (void)DO(API_LAUNCH_ASYNC, dmem_launch_async(f->rt, f->s, hs1, 2, launch_write, &a1));
  (void)DO(API_STREAM_RELEASE, dmem_stream_release(f->rt, f->s));
  /* h[3] locks first, then h[2] must come back from the host tier: a
   * failure there must leave h[3] unlocked (all or nothing) */
  launch_arg_t a2 = {f, 1, 2, ++f->seeds};
  dmem_handle_t hs2[2] = {f->h[3], f->h[2]};
  (void)DO(API_LAUNCH_ASYNC, dmem_launch_async(f->rt, f->s, hs2, 2, launch_write, &a2));
  (void)DO(API_ENQUEUE_HOST, dmem_stream_enqueue_host(f->rt, f->s, host_noop, &f->host_ran));
  (void)t_spill(f, 1, DMEM_TIER_HOST); /* may be BUSY */
  (void)DO(API_SYNC_AND_UNLOCK, dmem_sync_and_unlock(f->rt, f->s));
  launch_arg_t a3 = {f, 1, 3, ++f->seeds};
  dmem_handle_t hs3[2] = {f->h[1], f->h[3]};
  (void)DO(API_LOCK_AND_LAUNCH, dmem_lock_and_launch(f->rt, hs3, 2, launch_write, &a3));
  (void)DO(API_STREAM_RELEASE, dmem_stream_release(f->rt, f->s));
  (void)DO(API_POLL, dmem_runtime_poll(f->rt));
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
}

/* raw allocations: on a stream and on the default stream, one that needs
 * buffers spilled, memory info, one adopted as a buffer, free and trim;
 * dedicated blocks too, one of them freed on one stream and taken back from
 * the cache by another (and refused by adopt). */
static dmem_status_t raw_add(fx_t *f, int r, size_t size, dmem_stream_t s, bool dedicated) {
  void *p = NULL;
  dmem_status_t st =
      dedicated ? DO(API_DEVICE_MALLOC, dmem_device_malloc_dedicated(f->rt, size, s, &p))
                : DO(API_DEVICE_MALLOC, dmem_device_malloc(f->rt, size, s, &p));
  if (st != DMEM_OK) return st;
  f->raw[r] = p;
  f->rawsize[r] = size;
  f->raw_s[r] = s;
  f->rawseed[r] = ++f->seeds;
  void *src = pattern(f, size, f->rawseed[r]);
  st = DO(API_COPY, dmem_stream_copy(f->rt, p, src, size, s));
  if (st != DMEM_OK) f->rawseed[r] = 0; /* unknown */
  return st;
}
/* Raw allocation r becomes buffer slot f->nbuf (dmem_device_adopt on its
 * stream), unlocked once its writes are done, then spilled to the host tier
 * and locked back. A failed adopt leaves it a raw allocation. */
static void raw_adopt(fx_t *f, int r) {
  if (!f->raw[r] || f->nbuf == NBUF) return;
  int i = f->nbuf;
  if (DO(API_DEVICE_ADOPT, dmem_device_adopt(f->rt, f->raw[r], f->raw_s[r], &f->h[i])) != DMEM_OK)
    return;
  f->nbuf++;
  f->size[i] = f->rawsize[r];
  f->seed[i] = f->rawseed[r];
  f->known[i] = f->rawseed[r] != 0;
  f->live[i] = true;
  f->raw[r] = NULL;
  /* the lock may only go once the raw writes are done; a failed wait leaves
   * them unknown */
  if (DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->raw_s[r])) != DMEM_OK)
    f->known[i] = false;
  (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[i]));
  (void)t_spill(f, i, DMEM_TIER_HOST);
  void *p;
  if (t_lock(f, i, NULL, &p) == DMEM_OK) (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[i]));
}
static void raw_setup(fx_t *f) { setup_buffers(f, 4, 8 * U); }
static void raw_run(fx_t *f) {
  (void)raw_add(f, 0, 16 * U, f->s, false);
  (void)raw_add(f, 1, 24 * U, NULL, false); /* spills buffers */
  size_t fr = 0, tot = 0;
  (void)DO(API_MEMORY_INFO, dmem_device_memory_info(f->rt, &fr, &tot));
  raw_adopt(f, 1); /* now a buffer: spilled and brought back like one */
  if (f->raw[0]) {
    (void)DO(API_DEVICE_FREE, dmem_device_free(f->rt, f->raw[0], f->s));
    f->raw[0] = NULL;
  }
  /* a dedicated block freed on s, then taken from the cache by the default
   * stream (an event orders it) */
  (void)raw_add(f, 2, U / 2, f->s, true);
  if (f->raw[2]) {
    (void)DO(API_DEVICE_FREE, dmem_device_free(f->rt, f->raw[2], f->s));
    f->raw[2] = NULL;
  }
  (void)raw_add(f, 2, U / 2, NULL, true);
  if (f->raw[2]) { /* a dedicated block is refused (or the plan failed the call) and stays raw */
    dmem_handle_t h = 0;
    dmem_status_t st = DO(API_DEVICE_ADOPT, dmem_device_adopt(f->rt, f->raw[2], NULL, &h));
    EXPECT(st != DMEM_OK, "adopt of a dedicated block succeeded");
  }
  (void)DO(API_DEVICE_TRIM, dmem_device_trim(f->rt, 0, NULL));
  (void)raw_add(f, 3, 32 * U, f->s, true); /* more spilling */
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
}

/* create / destroy: the whole life of a runtime under the plan. */
static void create_run(fx_t *f) {
  dmem_status_t st = DO(API_CREATE, create_runtime(f, &f->rt));
  if (st != DMEM_OK) {
    f->rt = NULL;
    return;
  }
  dmem_stream_t s = NULL;
  if (DO(API_STREAM_CREATE, dmem_stream_create(f->rt, &s)) != DMEM_OK) s = NULL;
  (void)add_buffer(f, 4 * U, 0);
  (void)add_buffer(f, 4 * U, 0);
  if (f->nbuf > 0) (void)t_spill(f, 0, DMEM_TIER_HOST);
  if (f->nbuf > 1) (void)t_spill(f, 1, DMEM_TIER_DISK);
  for (int i = 0; i < f->nbuf; i++) {
    void *p;
    if (t_lock(f, i, s, &p) == DMEM_OK)
      (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[i]));
  }
  void *raw = NULL;
  if (DO(API_DEVICE_MALLOC, dmem_device_malloc(f->rt, U, s, &raw)) == DMEM_OK)
    (void)DO(API_DEVICE_FREE, dmem_device_free(f->rt, raw, s));
  if (s) (void)DO(API_STREAM_DESTROY, dmem_stream_destroy(f->rt, s));
  dmem_stats_t stats;
  (void)DO(API_STATS, dmem_stats(f->rt, &stats));
  dmem_runtime_destroy(f->rt); /* with buffers still live, under the plan too */
  f->rt = NULL;
  f->nbuf = 0;
}

/* ---- verification ------------------------------------------------------------------------ */

/* No fault armed. The runtime must work: nothing left locked, every known
 * byte intact, alloc / spill to host and disk / lock still fine. */
static void verify_working(fx_t *f) {
  dmem_runtime_t *rt = f->rt;
  dmem_status_t st;
  if (f->s) EXPECT((st = dmem_sync_and_unlock(rt, f->s)) == DMEM_OK, "sync_and_unlock(s): %s",
                   dmem_status_name(st));
  EXPECT((st = dmem_sync_and_unlock(rt, NULL)) == DMEM_OK, "sync_and_unlock(NULL): %s",
         dmem_status_name(st));
  EXPECT((st = dmem_runtime_poll(rt)) == DMEM_OK, "poll: %s", dmem_status_name(st));
  if (rt->io) dmem__io_quiesce(rt->io);
  /* every byte is charged to the tier that holds it, once */
  size_t want[8] = {0}, raw = 0;
  for (int i = 0; i < f->nbuf; i++) {
    int state = f->live[i] ? state_of(f, i) : -1;
    if (state >= 0 && state < 8) want[state] += f->size[i];
  }
  for (int r = 0; r < NRAW; r++)
    if (f->raw[r]) raw += f->rawsize[r];
  dmem_stats_t s0;
  memset(&s0, 0, sizeof s0);
  EXPECT(dmem_stats(rt, &s0) == DMEM_OK, "stats");
  EXPECT(s0.device_used == want[DMEM_STATE_RESIDENT] + raw,
         "device_used %zu, but resident buffers hold %zu and raw allocations %zu", s0.device_used,
         want[DMEM_STATE_RESIDENT], raw);
  EXPECT(s0.host_used == want[DMEM_STATE_DEFERRED_HOST],
         "host_used %zu, but host-tier buffers hold %zu", s0.host_used,
         want[DMEM_STATE_DEFERRED_HOST]);
  EXPECT(s0.disk_used == want[DMEM_STATE_DEFERRED_DISK],
         "disk_used %zu, but disk-tier buffers hold %zu", s0.disk_used,
         want[DMEM_STATE_DEFERRED_DISK]);
  EXPECT(s0.controller_used == want[DMEM_STATE_DEFERRED_CONTROLLER],
         "controller_used %zu, but controller-tier buffers hold %zu", s0.controller_used,
         want[DMEM_STATE_DEFERRED_CONTROLLER]);
  EXPECT(want[DMEM_STATE_SPILLING] == 0 && want[DMEM_STATE_UNSPILLING] == 0,
         "buffers left in a move: %zu bytes spilling, %zu unspilling", want[DMEM_STATE_SPILLING],
         want[DMEM_STATE_UNSPILLING]);
  EXPECT(s0.raw_used == raw, "raw_used %zu, raw allocations %zu", s0.raw_used, raw);
  /* raw allocations first (then freed: they are never spilled and would
   * keep the buffers below from coming back) */
  for (int r = 0; r < NRAW; r++) {
    if (!f->raw[r]) continue;
    if (f->rawseed[r]) {
      size_t bad = raw_bad_bytes(f, r);
      EXPECT(bad == 0, "raw allocation %d: %zu bytes differ", r, bad);
    }
    st = dmem_device_free(rt, f->raw[r], f->raw_s[r]);
    EXPECT(st == DMEM_OK, "device_free of raw %d: %s", r, dmem_status_name(st));
    f->raw[r] = NULL;
  }
  for (int i = 0; i < f->nbuf; i++) {
    if (!f->live[i]) continue;
    dmem_buffer_info_t info;
    st = dmem_buffer_info(rt, f->h[i], &info);
    EXPECT(st == DMEM_OK, "buffer %d: info %s", i, dmem_status_name(st));
    if (st == DMEM_OK)
      EXPECT(info.lock_count == 0, "buffer %d still locked (%u) in state %d", i, info.lock_count,
             (int)info.state);
    if (!f->known[i]) continue;
    size_t bad = bad_bytes(f, i);
    EXPECT(bad == 0, "buffer %d (state %d): %zu bytes differ from its pattern", i,
           st == DMEM_OK ? (int)info.state : -1, bad);
  }
  /* still working: a new buffer through host, disk and back */
  dmem_handle_t h = 0;
  st = dmem_buffer_alloc(rt, U, 0, &h);
  EXPECT(st == DMEM_OK, "alloc after the fault: %s (%s)", dmem_status_name(st),
         dmem_last_error_detail());
  if (st != DMEM_OK) return;
  void *tmp = malloc(U), *p = NULL;
  pat_fill(tmp, U, 77);
  st = dmem_buffer_lock(rt, h, NULL, &p);
  if (st == DMEM_OK) st = dmem_stream_copy(rt, p, tmp, U, NULL);
  if (st == DMEM_OK) st = dmem_stream_synchronize(rt, NULL);
  if (p) (void)dmem_buffer_unlock(rt, h);
  if (st == DMEM_OK) st = dmem_buffer_spill(rt, h, DMEM_TIER_HOST);
  if (st == DMEM_OK) st = dmem_buffer_spill(rt, h, DMEM_TIER_DISK);
  memset(tmp, 0, U);
  p = NULL;
  if (st == DMEM_OK) st = dmem_buffer_lock(rt, h, NULL, &p);
  if (st == DMEM_OK) st = dmem_stream_copy(rt, tmp, p, U, NULL);
  if (st == DMEM_OK) st = dmem_stream_synchronize(rt, NULL);
  if (p) (void)dmem_buffer_unlock(rt, h);
  EXPECT(st == DMEM_OK, "a new buffer through host and disk: %s (%s)", dmem_status_name(st),
         dmem_last_error_detail());
  if (st == DMEM_OK) EXPECT(pat_bad(tmp, U, 77) == 0, "a new buffer came back wrong");
  free(tmp);
  EXPECT(dmem_buffer_free(rt, h) == DMEM_OK, "free of the new buffer");
}

/* No fault armed, the runtime went fatal: it says so at every call that
 * needs the device, from the first one on. */
static void verify_fatal(fx_t *f) {
  dmem_runtime_t *rt = f->rt;
  dmem_status_t st = dmem_stream_synchronize(rt, NULL);
  EXPECT(st == DMEM_ERR_DEVICE_FATAL, "synchronize after a fatal fault: %s", dmem_status_name(st));
  dmem_handle_t h;
  EXPECT((st = dmem_buffer_alloc(rt, 4 * KiB, 0, &h)) == DMEM_ERR_DEVICE_FATAL, "alloc: %s",
         dmem_status_name(st));
  void *p = NULL;
  for (int i = 0; i < f->nbuf; i++) {
    if (!f->live[i]) continue;
    EXPECT((st = dmem_buffer_lock(rt, f->h[i], NULL, &p)) == DMEM_ERR_DEVICE_FATAL, "lock %d: %s", i,
           dmem_status_name(st));
    if (st == DMEM_OK) (void)dmem_buffer_unlock(rt, f->h[i]);
    EXPECT((st = dmem_buffer_spill(rt, f->h[i], DMEM_TIER_HOST)) == DMEM_ERR_DEVICE_FATAL,
           "spill %d: %s", i, dmem_status_name(st));
    break;
  }
  EXPECT((st = dmem_device_malloc(rt, 4 * KiB, NULL, &p)) == DMEM_ERR_DEVICE_FATAL,
         "device_malloc: %s", dmem_status_name(st));
  if (st == DMEM_OK) (void)dmem_device_free(rt, p, NULL);
  EXPECT((st = dmem_stream_copy(rt, &h, &p, sizeof h, NULL)) == DMEM_ERR_DEVICE_FATAL, "copy: %s",
         dmem_status_name(st));
  EXPECT((st = dmem_runtime_poll(rt)) == DMEM_ERR_DEVICE_FATAL, "poll: %s", dmem_status_name(st));
  dmem_stream_t s2;
  EXPECT((st = dmem_stream_create(rt, &s2)) == DMEM_ERR_DEVICE_FATAL, "stream_create: %s",
         dmem_status_name(st));
  if (st == DMEM_OK) (void)dmem_stream_destroy(rt, s2);
  /* what a stream still holds is let go: the lost context runs nothing */
  if (f->s)
    EXPECT((st = dmem_sync_and_unlock(rt, f->s)) == DMEM_ERR_DEVICE_FATAL,
           "sync_and_unlock(s): %s", dmem_status_name(st));
  EXPECT((st = dmem_sync_and_unlock(rt, NULL)) == DMEM_ERR_DEVICE_FATAL,
         "sync_and_unlock(NULL): %s", dmem_status_name(st));
  for (int i = 0; i < f->nbuf; i++) {
    dmem_buffer_info_t info;
    if (!f->live[i] || dmem_buffer_info(rt, f->h[i], &info) != DMEM_OK) continue;
    EXPECT(info.lock_count == 0, "buffer %d still locked (%u) after a fatal error", i,
           info.lock_count);
  }
}

/* Free what the fixture holds; when the runtime works, nothing may stay
 * charged anywhere afterwards. */
static void teardown(fx_t *f, bool fatal) {
  dmem_runtime_t *rt = f->rt;
  dmem_status_t st;
  for (int i = 0; i < f->nbuf; i++) {
    if (!f->live[i]) continue;
    st = dmem_buffer_free(rt, f->h[i]);
    EXPECT(st == DMEM_OK, "free of buffer %d: %s", i, dmem_status_name(st));
    f->live[i] = false;
  }
  for (int r = 0; r < NRAW; r++) {
    if (!f->raw[r]) continue;
    st = dmem_device_free(rt, f->raw[r], f->raw_s[r]);
    EXPECT(st == DMEM_OK, "device_free of raw %d: %s", r, dmem_status_name(st));
    f->raw[r] = NULL;
  }
  if (!fatal) {
    EXPECT(dmem_stream_synchronize(rt, f->s) == DMEM_OK, "synchronize");
    dmem__staging_poll(rt, true);
    dmem__pending_poll(rt, true);
    dmem_stats_t s;
    memset(&s, 0, sizeof s);
    EXPECT(dmem_stats(rt, &s) == DMEM_OK, "stats");
    EXPECT(s.buffer_count == 0, "%zu buffers left after every free", s.buffer_count);
    EXPECT(s.device_used == 0, "%zu device bytes still charged", s.device_used);
    EXPECT(s.device_locked == 0 && s.device_pinned == 0, "locked %zu, pinned %zu",
           s.device_locked, s.device_pinned);
    EXPECT(s.host_used == 0, "%zu bytes left in the host tier", s.host_used);
    EXPECT(s.disk_used == 0, "%zu bytes left on disk", s.disk_used);
    EXPECT(s.controller_used == 0, "%zu bytes left with the controller", s.controller_used);
    EXPECT(s.raw_used == 0, "%zu raw bytes left", s.raw_used);
    EXPECT(s.host_pool_free == s.host_pool_reserved,
           "pinned pool: %zu of %zu bytes free (staging or a host copy lost)",
           s.host_pool_free, s.host_pool_reserved);
    dmem__pool_stats_t ps;
    dmem__pool_stats(rt->pool, &ps);
    EXPECT(ps.in_use == 0, "device pool: %zu bytes in blocks nobody owns", ps.in_use);
    EXPECT(ps.quarantined == 0,
           "device pool: %zu bytes quarantined (lost until destroy) after a transient failure",
           ps.quarantined);
    /* and, the empty slabs given back, the whole limit can be had again:
     * eight locked buffers of an eighth each */
    EXPECT((st = dmem_device_trim(rt, 0, NULL)) == DMEM_OK, "trim: %s", dmem_status_name(st));
    dmem_handle_t hs[8];
    int nh = 0;
    for (; nh < 8; nh++) {
      void *p;
      st = dmem_buffer_alloc(rt, f->limit / 8, 0, &hs[nh]);
      if (st != DMEM_OK) break;
      st = dmem_buffer_lock(rt, hs[nh], NULL, &p); /* locked: never spilled for the next one */
      if (st != DMEM_OK) {
        (void)dmem_buffer_free(rt, hs[nh]);
        break;
      }
    }
    EXPECT(nh == 8, "only %d of 8 locked buffers of %zu bytes fit the empty runtime: %s (%s)",
           nh, f->limit / 8, dmem_status_name(st), dmem_last_error_detail());
    for (int k = 0; k < nh; k++) {
      (void)dmem_buffer_unlock(rt, hs[k]);
      (void)dmem_buffer_free(rt, hs[k]);
    }
  }
  if (f->s) {
    st = dmem_stream_destroy(rt, f->s);
    EXPECT(st == DMEM_OK, "stream_destroy: %s", dmem_status_name(st));
    f->s = NULL;
  }
}

/* ---- the loop ------------------------------------------------------------------------- */

typedef struct loop_result {
  int points;       /* runs in which a call was failed */
  int fatal_points; /* of which the failure was (or became) fatal */
  uint64_t clean_calls;
  int by_call[DMEM__FAULT_NCALLS]; /* failed calls per kind */
} loop_result_t;

static int64_t live_sum(const dmem__fault_report_t *r) {
  return r->live_device_allocs + r->live_host_allocs + r->live_events + r->live_streams +
         r->live_vmm;
}

/* One run with `plan`; returns whether a call was failed. */
static bool run_once(const scenario_t *sc, const dmem__fault_plan_t *plan, loop_result_t *res) {
  static fx_t fx;
  fx_t *f = &fx;
  memset(f, 0, sizeof *f);
  snprintf(where_buf, sizeof where_buf, "%s, %s call %llu%s%s", sc->name,
           dmem__fault_call_name(plan->call), (unsigned long long)plan->n,
           plan->fatal ? " (fatal)" : "", plan->persistent ? " and later" : "");
  f->where = where_buf;
  f->limit = sc->limit;
  f->host_limit = sc->host_limit;
  f->with_controller = sc->controller;
  dmem__fault_report_t r0;
  dmem__fault_report(&r0);
  if (!sc->in_run) {
    /* counted from here on: the runtime is wrapped */
    dmem__fault_plan_t none = {DMEM__FAULT_ANY, 0, false, false};
    dmem__fault_arm(&none);
    dmem_status_t st = create_runtime(f, &f->rt);
    if (st == DMEM_ERR_NO_DEVICE) SKIP("no device for DMEM_BACKEND=%s", getenv("DMEM_BACKEND"));
    if (st != DMEM_OK) setup_fail("runtime", st);
    st = dmem_stream_create(f->rt, &f->s);
    if (st != DMEM_OK) setup_fail("stream", st);
    /* copies in pieces (white-box): a failure can hit the middle of one */
    f->rt->copy_chunk = 2 * U;
    sc->setup(f);
    dmem__fault_disarm();
  }
  dmem__fault_arm(plan);
  sc->run(f);
  dmem__fault_disarm();
  dmem__fault_report_t r;
  dmem__fault_report(&r);
  if (getenv("DMEM_FAULT_ONLY"))
    fprintf(stderr, "[%s] %s; %llu calls counted\n", f->where,
            r.fired ? dmem__fault_call_name(r.fired_call) : "nothing failed",
            (unsigned long long)r.calls[DMEM__FAULT_ANY]);
  if (r.fired) {
    res->points++;
    res->by_call[r.fired_call]++;
  } else {
    res->clean_calls = r.calls[DMEM__FAULT_ANY];
  }
  bool fatal = r.fired && r.fired_status == DMEM_ERR_DEVICE_FATAL;
  if (f->rt) {
    if (dmem_atomic_load_relaxed(&f->rt->fatal)) fatal = true;
    if (fatal) {
      res->fatal_points++;
      verify_fatal(f);
    } else {
      verify_working(f);
    }
    teardown(f, fatal);
    dmem_runtime_destroy(f->rt);
    f->rt = NULL;
  } else if (sc->in_run && !fatal) {
    /* the failure was in create or during the runtime's life: a new one
     * works */
    dmem_runtime_t *rt = NULL;
    dmem_status_t st = create_runtime(f, &rt);
    EXPECT(st == DMEM_OK, "create after the fault: %s", dmem_status_name(st));
    dmem_runtime_destroy(rt);
  }
  ctl_free_all(f);
  for (int i = 0; i < f->nsrc; i++) free(f->src[i]);
  dmem__fault_report_t r1;
  dmem__fault_report(&r1);
  EXPECT(live_sum(&r1) == live_sum(&r0),
         "after destroy the backend still holds %lld device allocations, %lld pinned, "
         "%lld events, %lld streams, %lld address ranges and physical allocations more "
         "than before",
         (long long)(r1.live_device_allocs - r0.live_device_allocs),
         (long long)(r1.live_host_allocs - r0.live_host_allocs),
         (long long)(r1.live_events - r0.live_events),
         (long long)(r1.live_streams - r0.live_streams),
         (long long)(r1.live_vmm - r0.live_vmm));
  if (f->bad && r.fired)
    fprintf(stderr, "  (the injected failure: %s gave %s)\n", dmem__fault_call_name(r.fired_call),
            dmem_status_name(r.fired_status));
  return r.fired;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Failed calls per kind in the last run_scenario's two loops. */
static int last_failed[DMEM__FAULT_NCALLS];

/* For n = 1, 2, ... (every stride-th): fail the n-th call, check, until a
 * run fails nothing. Both plans: own statuses, then everything fatal. */
static void run_scenario(const scenario_t *sc) {
  long stride = 1;
  const char *e = getenv("DMEM_FAULT_STRIDE");
  if (e && *e) stride = strtol(e, NULL, 10);
  if (stride < 1) stride = 1;
  double t0 = now_s();
  loop_result_t res[2];
  memset(res, 0, sizeof res);
  const char *only = getenv("DMEM_FAULT_ONLY"); /* "n" or "n:fatal": one run (reproducing) */
  if (only && *only) {
    dmem__fault_plan_t plan = {DMEM__FAULT_ANY, strtoull(only, NULL, 10),
                               strstr(only, "fatal") != NULL, false};
    CHECK_TRUE(run_once(sc, &plan, &res[0]));
    return;
  }
  for (int fatal = 0; fatal < (sc->full ? 2 : 1); fatal++) {
    uint64_t n = 1;
    int clean = 0;
    for (;; n += (uint64_t)stride) {
      dmem__fault_plan_t plan = {DMEM__FAULT_ANY, n, fatal != 0, false};
      bool fired = run_once(sc, &plan, &res[fatal]);
      /* two runs in a row that reach no n-th call: the number of calls
       * varies a little (event queries), so one more makes sure */
      clean = fired ? 0 : clean + 1;
      if (clean == 2) break;
      if (n > 100000) {
        fprintf(stderr, "%s: more than 100000 injection points: stopping\n", sc->name);
        check_failed_ = 1;
        break;
      }
    }
  }
  /* Persistent failures of one kind from its n-th call on (a full disk, a
   * device out of memory, a broken copy engine): every later call of the
   * kind fails too, then the runtime must recover once they stop. */
  static const dmem__fault_call_t persistent[] = {
      DMEM__FAULT_DEVICE_ALLOC, DMEM__FAULT_HOST_ALLOC,  DMEM__FAULT_MEMCPY_ASYNC,
      DMEM__FAULT_EVENT_RECORD, DMEM__FAULT_DISK_ALLOC, DMEM__FAULT_DISK_WRITE,
      DMEM__FAULT_DISK_READ,    DMEM__FAULT_MEM_CREATE, DMEM__FAULT_MEM_MAP,
      DMEM__FAULT_VA_RESERVE};
  loop_result_t pres;
  memset(&pres, 0, sizeof pres);
  for (size_t k = 0; sc->full && k < sizeof persistent / sizeof persistent[0]; k++) {
    /* from the 1st, 2nd, 4th, 8th ... call of the kind on */
    for (uint64_t n = 1;; n *= 2) {
      dmem__fault_plan_t plan = {persistent[k], n, false, true};
      if (!run_once(sc, &plan, &pres) || n > 100000) break;
    }
  }
  /* the clean run passed every check too (it ended each loop) */
  CHECK_GT(res[0].points, 0);
  for (int c = 0; c < DMEM__FAULT_NCALLS; c++)
    last_failed[c] = res[0].by_call[c] + res[1].by_call[c];
  if (sc->full) CHECK_GT(res[1].points, 0);
  char kinds[1024];
  size_t at = 0;
  for (int c = 1; c < DMEM__FAULT_NCALLS; c++)
    if (res[0].by_call[c] && at < sizeof kinds)
      at += (size_t)snprintf(kinds + at, sizeof kinds - at, " %s %d", dmem__fault_call_name(c),
                             res[0].by_call[c]);
  fprintf(stderr,
          "fault %s: %d injection points with each call's own status (%d of them fatal), "
          "%d with fatal errors, %d persistent; %llu backend and disk calls in a clean run; "
          "%.2f s\n  failed:%s\n",
          sc->name, res[0].points, res[0].fatal_points, res[1].points, pres.points,
          (unsigned long long)res[0].clean_calls, now_s() - t0, kinds);
}

TEST_CASE(alloc) {
  scenario_t sc = {"alloc", LIMIT, 0, false, false, true, alloc_setup, alloc_run};
  run_scenario(&sc);
}

TEST_CASE(lock_unlock) {
  scenario_t sc = {"lock_unlock", LIMIT, 0, false, false, true, lock_setup, lock_run};
  run_scenario(&sc);
}

TEST_CASE(spill_host) {
  scenario_t sc = {"spill_host", LIMIT, 0, false, false, true, host_setup, host_run};
  run_scenario(&sc);
}

TEST_CASE(spill_disk) {
  scenario_t sc = {"spill_disk", LIMIT, 0, false, false, true, disk_setup, disk_run};
  run_scenario(&sc);
}

TEST_CASE(spill_disk_large) {
  scenario_t sc = {"spill_disk_large", 16 * MiB, 0, false, false, false, disk_large_setup,
                   disk_large_run};
  run_scenario(&sc);
}

TEST_CASE(pushdown) {
  scenario_t sc = {"pushdown", LIMIT, 8 * U, false, false, true, pushdown_setup,
                   pushdown_run};
  run_scenario(&sc);
}

TEST_CASE(controller) {
  scenario_t sc = {"controller", LIMIT, 0, true, false, true, controller_setup,
                   controller_run};
  run_scenario(&sc);
}

TEST_CASE(read) {
  scenario_t sc = {"read", LIMIT, 0, false, false, true, read_setup, read_run};
  run_scenario(&sc);
}

TEST_CASE(evict) {
  scenario_t sc = {"evict", LIMIT, 0, false, false, true, evict_setup, evict_run};
  run_scenario(&sc);
}

TEST_CASE(evict_batch) {
  scenario_t sc = {"evict_batch", LIMIT, 0, false, false, true, evict_batch_setup,
                   evict_batch_run};
  run_scenario(&sc);
}

TEST_CASE(swap) {
  g_retrieve_swap = 0; /* on: through the device bounce */
  scenario_t sc = {"swap", LIMIT, 0, false, false, true, swap_setup, swap_run};
  run_scenario(&sc);
  g_retrieve_swap = 2;
}

/* The same with DMEM_RETRIEVE_SWAP=pieces (the default): each retrieve
 * takes its victim's block and the copies out and in run in 64 KiB pieces
 * (eight a buffer). A failure while the copies out are enqueued leaves the
 * victim resident; one while the copies in are, leaves it spilled (its
 * copy out is whole) and the retrieved buffer where it was. */
TEST_CASE(swap_pieces) {
  setenv("DMEM_SWAP_PIECE", "64K", 1);
  scenario_t sc = {"swap_pieces", LIMIT, 0, false, false, true, swap_setup, swap_run};
  run_scenario(&sc);
  unsetenv("DMEM_SWAP_PIECE");
}

TEST_CASE(launch) {
  scenario_t sc = {"launch", LIMIT, 0, false, false, true, launch_setup, launch_run};
  run_scenario(&sc);
}

TEST_CASE(raw) {
  scenario_t sc = {"raw", LIMIT, 0, false, false, true, raw_setup, raw_run};
  run_scenario(&sc);
}

/* stable-address buffers (DMEM_BUFFER_STABLE_ADDRESS): every VMM call of
 * the backend fails somewhere in alloc, spill to host and disk, unspill,
 * lock, eviction under pressure and free; the bytes and the addresses stay.
 * Sizes are multiples of the backend's granularity (stable_g), so that the
 * charge of a buffer is its size. */
static size_t stable_g;
static void stable_setup(fx_t *f) {
  for (int k = 0; k < 3; k++)
    if (add_buffer(f, stable_g, DMEM_BUFFER_STABLE_ADDRESS) != DMEM_OK) setup_fail("stable", 0);
  if (add_buffer(f, stable_g, 0) != DMEM_OK) setup_fail("buffer", 0);
}
static void stable_run(fx_t *f) {
  (void)t_spill(f, 0, DMEM_TIER_HOST);
  (void)t_spill(f, 1, DMEM_TIER_DISK);
  (void)t_unspill(f, 0, f->s);
  void *p;
  if (t_lock(f, 1, NULL, &p) == DMEM_OK) {
    if (f->addr[1]) EXPECT(p == f->addr[1], "stable buffer 1 moved: %p, first %p", p, f->addr[1]);
    (void)DO(API_UNLOCK, dmem_buffer_unlock(f->rt, f->h[1]));
  }
  (void)add_buffer(f, 2 * stable_g, DMEM_BUFFER_STABLE_ADDRESS); /* 6 of 8 */
  (void)add_buffer(f, 3 * stable_g, DMEM_BUFFER_STABLE_ADDRESS); /* past the limit: evicts */
  (void)t_spill(f, 2, DMEM_TIER_HOST);
  (void)DO(API_FREE, dmem_buffer_free(f->rt, f->h[2])); /* freed spilled */
  f->live[2] = false;
  (void)DO(API_FREE, dmem_buffer_free(f->rt, f->h[0])); /* freed resident (or wherever it is) */
  f->live[0] = false;
  (void)DO(API_STREAM_SYNC, dmem_stream_synchronize(f->rt, f->s));
}

TEST_CASE(stable) {
  {
    fx_t g0;
    memset(&g0, 0, sizeof g0);
    g0.limit = LIMIT;
    dmem_runtime_t *rt = NULL;
    dmem_status_t st = create_runtime(&g0, &rt);
    if (st == DMEM_ERR_NO_DEVICE) SKIP("no device for DMEM_BACKEND=%s", getenv("DMEM_BACKEND"));
    if (st != DMEM_OK || dmem__stable_granularity(rt, &stable_g) != DMEM_OK) setup_fail("granularity", st);
    dmem_runtime_destroy(rt);
  }
  static const dmem__fault_call_t must[] = {
      DMEM__FAULT_VMM_GRANULARITY, DMEM__FAULT_VA_RESERVE, DMEM__FAULT_VA_FREE,
      DMEM__FAULT_MEM_CREATE,      DMEM__FAULT_MEM_RELEASE, DMEM__FAULT_MEM_MAP,
      DMEM__FAULT_MEM_SET_ACCESS,  DMEM__FAULT_MEM_UNMAP,   DMEM__FAULT_ANY};
  scenario_t sc = {"stable", 8 * stable_g, 0, false, false, true, stable_setup, stable_run};
  run_scenario(&sc);
  /* Every stride-th n (DMEM_FAULT_STRIDE, 3 in scripts/gpu-test) may step
   * over a call made once or twice per run: fail each such call by kind,
   * its 1st, 2nd, ... call, until a run reaches none. */
  for (const dmem__fault_call_t *c = must; *c != DMEM__FAULT_ANY; c++) {
    loop_result_t r;
    memset(&r, 0, sizeof r);
    for (uint64_t n = 1; last_failed[*c] == 0; n++) {
      dmem__fault_plan_t plan = {*c, n, false, false};
      if (!run_once(&sc, &plan, &r)) break;
      last_failed[*c] += r.by_call[*c] > 0;
      if (n > 1000) break;
    }
  }
  for (const dmem__fault_call_t *c = must; *c != DMEM__FAULT_ANY; c++) {
    if (last_failed[*c] == 0) fprintf(stderr, "stable: no run failed %s\n", dmem__fault_call_name(*c));
    CHECK_GT(last_failed[*c], 0);
  }
}

TEST_CASE(create_destroy) {
  scenario_t sc = {"create_destroy", LIMIT, 0, false, true, true, NULL, create_run};
  run_scenario(&sc);
}

/* DMEM_FAULT_INJECT: malformed values are a configuration error; a plan
 * armed from it fails the named call (counting across runtimes while the
 * value stays), :persistent keeps failing, a new value re-arms. */
static dmem_status_t env_create(const char *value, dmem_runtime_t **rt_out) {
  setenv("DMEM_FAULT_INJECT", value, 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  if (!getenv("DMEM_BACKEND")) cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = LIMIT;
  cfg.log_level = DMEM_LOG_ERROR;
  *rt_out = NULL;
  return dmem_runtime_create(&cfg, rt_out);
}

TEST_CASE(env_plan) {
  dmem_runtime_t *rt = NULL;
  const char *bad[] = {"nosuch:1", "device_alloc", "device_alloc:0", "device_alloc:x",
                       "device_alloc:1:bogus", "device_alloc:1:fatal:", ":1"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK_STATUS(env_create(bad[i], &rt), DMEM_ERR_CONFIG);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_FAULT_INJECT") != NULL);
    CHECK_TRUE(rt == NULL);
  }
  /* the third stream of the first runtime: create fails and cleans up */
  dmem__fault_report_t r0, r;
  dmem__fault_report(&r0);
  dmem_status_t st = env_create("stream_create:3", &rt);
  if (st == DMEM_ERR_NO_DEVICE) SKIP("no device");
  CHECK_STATUS(st, DMEM_ERR_DEVICE);
  dmem__fault_report(&r);
  CHECK_TRUE(r.fired);
  CHECK_EQ(r.fired_call, DMEM__FAULT_STREAM_CREATE);
  CHECK_UEQ(r.calls[DMEM__FAULT_STREAM_CREATE], 3);
  CHECK_EQ(r.live_streams, r0.live_streams);
  /* the same value: counting goes on, nothing fails any more */
  REQUIRE_OK(env_create("stream_create:3", &rt));
  dmem__fault_report(&r);
  CHECK_UEQ(r.calls[DMEM__FAULT_STREAM_CREATE], 6);
  dmem_runtime_destroy(rt);
  /* the backend itself */
  CHECK_STATUS(env_create("backend_create:1", &rt), DMEM_ERR_DEVICE);
  /* persistent: every copy from the first fails, until disarmed */
  REQUIRE_OK(env_create("memcpy_async:1:persistent", &rt));
  dmem_handle_t h;
  void *p;
  char buf[64] = {0};
  REQUIRE_OK(dmem_buffer_alloc(rt, sizeof buf, 0, &h));
  REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &p));
  CHECK_STATUS(dmem_stream_copy(rt, p, buf, sizeof buf, NULL), DMEM_ERR_DEVICE);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "memcpy_async: injected failure") != NULL);
  CHECK_STATUS(dmem_stream_copy(rt, p, buf, sizeof buf, NULL), DMEM_ERR_DEVICE);
  dmem__fault_disarm();
  CHECK_OK(dmem_stream_copy(rt, p, buf, sizeof buf, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_OK(dmem_buffer_unlock(rt, h));
  /* fatal: the runtime refuses work from then on, destroy frees all */
  dmem_runtime_destroy(rt);
  REQUIRE_OK(env_create("event_record:1:fatal", &rt));
  REQUIRE_OK(dmem_buffer_alloc(rt, sizeof buf, 0, &h));
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_buffer_alloc(rt, sizeof buf, 0, &h), DMEM_ERR_DEVICE_FATAL);
  dmem_runtime_destroy(rt);
  dmem__fault_report(&r);
  CHECK_EQ(r.live_device_allocs, r0.live_device_allocs);
  CHECK_EQ(r.live_host_allocs, r0.live_host_allocs);
  CHECK_EQ(r.live_events, r0.live_events);
  CHECK_EQ(r.live_streams, r0.live_streams);
  unsetenv("DMEM_FAULT_INJECT");
  dmem__fault_disarm();
}
