/*
 * runtime/api/runtime.c - creating and destroying a runtime; backend selection;
 * polling.
 */
#include "api/api.h"
#include "spill/summary.h"
#include "spill/ahead.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>


static dmem_status_t check_config(const dmem_config_t *cfg) {
  if (cfg->struct_size < sizeof *cfg)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_config_t.struct_size is %zu, expected %zu: use dmem_config_init",
                       cfg->struct_size, sizeof *cfg);
  /* each field's range: DMEM_CONFIG_OPTIONS (include/dmem/config.h) */
  dmem_status_t st = dmem__config_check(cfg);
  if (st != DMEM_OK) return st;
  if (cfg->backend == DMEM_BACKEND_HOST && cfg->host_backend_capacity == 0)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host_backend_capacity is 0");
  return DMEM_OK;
}

static void destroy_mutexes(dmem_runtime_t *rt) {
  pthread_mutex_destroy(&rt->ctl_mu);
  pthread_cond_destroy(&rt->tcv);
  pthread_mutex_destroy(&rt->tmu);
  pthread_mutex_destroy(&rt->staging_mu);
  pthread_mutex_destroy(&rt->pending_mu);
  pthread_mutex_destroy(&rt->evpool_mu);
  pthread_mutex_destroy(&rt->disk_mu);
  pthread_cond_destroy(&rt->ahead_cv);
  pthread_mutex_destroy(&rt->ahead_mu);
  pthread_mutex_destroy(&rt->swap_mu);
}

/* `path` made absolute against the current directory (not resolved: it
 * need not exist yet), in memory the caller frees. */
static dmem_status_t absolute_path(const char *path, char **out) {
  if (path[0] == '/') {
    *out = strdup(path);
    if (!*out) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "spill_dir copy failed");
    return DMEM_OK;
  }
  char *cwd = getcwd(NULL, 0);
  if (!cwd)
    return dmem__error(DMEM_ERR_IO, "spill_dir \"%s\" is relative and getcwd failed: %s", path,
                       strerror(errno));
  size_t n = strlen(cwd) + 1 + strlen(path) + 1;
  char *p = malloc(n);
  if (p) snprintf(p, n, "%s/%s", cwd, path);
  free(cwd);
  if (!p) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "spill_dir copy failed");
  *out = p;
  return DMEM_OK;
}

/* f * n for 0 <= f <= 1, never past n: (double)SIZE_MAX rounds up to 2^64,
 * whose conversion back to size_t is undefined (it gave 0, so a fraction
 * of a huge capacity made a limit of 0). */
static size_t fraction_of(size_t n, double f) {
  double x = (double)n * f;
  if (!(x > 0)) return 0;
  if (x >= 18446744073709551616.0 /* 2^64 */) return n;
  size_t r = (size_t)x;
  return r > n ? n : r;
}

/* The spill-ahead marks in bytes (0: off) and its trigger. */
static void ahead_marks(dmem_runtime_t *rt) {
  double high = rt->cfg.spill_ahead, low = rt->cfg.spill_ahead_low;
  /* The backend's default: on the CUDA backend at 95 % (down to 90 %),
   * with the demand trigger by default (dmem_config_t.spill_ahead_trigger):
   * it spills only after callers waited for room, and stops when it does
   * not keep ahead of them (issue 25, bench/ahead_compare on an H100,
   * docs/design.md "Spill-ahead"). Off on the host backend: its copies are
   * memcpy on the calling thread, and its tests count moves exactly. */
  if (high == DMEM_SPILL_AHEAD_DEFAULT) high = rt->be->kind == DMEM_BACKEND_CUDA ? 0.95 : 0;
  rt->ahead_demand = rt->cfg.spill_ahead_trigger == DMEM_SPILL_AHEAD_DEMAND;
  if (high <= 0) return;
  if (low <= 0 || low >= high) low = high > 0.05 ? high - 0.05 : high / 2;
  rt->ahead_high = fraction_of(rt->limit, high);
  rt->ahead_low = fraction_of(rt->limit, low);
  if (rt->ahead_high >= rt->limit) rt->ahead_high = rt->limit - 1;
}

/* Copies larger than this are enqueued in pieces of this size. */
#define DMEM__COPY_CHUNK ((size_t)64 << 20)

/* The pool's first slab: a sixteenth of the limit, between 2 MiB and 1 GiB
 * (later slabs double). Large enough that the first allocations do not pay
 * a cudaMalloc each, small enough not to hold memory nobody asked for. */
static size_t first_slab(size_t limit) {
  size_t s = limit / 16;
  if (s < ((size_t)2 << 20)) s = (size_t)2 << 20;
  if (s > ((size_t)1 << 30)) s = (size_t)1 << 30;
  return s;
}

/* The backend, and why (into reason: logged at info, dmem_runtime_info). */
static dmem_status_t pick_backend(const dmem_config_t *cfg, dmem__backend_t **be_out,
                                  char *reason, size_t reason_size) {
  switch (cfg->backend) {
    case DMEM_BACKEND_HOST:
      snprintf(reason, reason_size, "backend host asked for");
      return dmem__backend_host_create(cfg, be_out);
    case DMEM_BACKEND_CUDA:
      snprintf(reason, reason_size, "backend cuda asked for (device %d)", cfg->device);
      return dmem__backend_cuda_create(cfg, be_out);
    default: break;
  }
  if (dmem__backend_cuda_available()) {
    dmem_status_t st = dmem__backend_cuda_create(cfg, be_out);
    if (st == DMEM_OK)
      snprintf(reason, reason_size, "backend auto: CUDA device %d usable", cfg->device);
    if (st != DMEM_ERR_NO_DEVICE) return st;
  }
  /* the detail recorded by cuda_available or cuda_create */
  snprintf(reason, reason_size, "backend auto: CUDA not usable (%s), using the host backend",
           dmem_last_error_detail());
  return dmem__backend_host_create(cfg, be_out);
}

/* The backend, wrapped by the fault injector (runtime/backend/fault.c) when
 * DMEM_FAULT_INJECT or a test armed it. */
static dmem_status_t make_backend(const dmem_config_t *cfg, dmem__backend_t **be_out,
                                  char *reason, size_t reason_size) {
  dmem__fault_from_env();
  dmem__backend_t *be = NULL;
  dmem_status_t st = dmem__fault_point(DMEM__FAULT_BACKEND_CREATE);
  if (st == DMEM_OK) st = pick_backend(cfg, &be, reason, reason_size);
  if (st == DMEM_OK) {
    st = dmem__fault_wrap(&be);
    if (st != DMEM_OK) be->destroy(be);
  }
  if (st == DMEM_OK) *be_out = be;
  return st;
}

/* The directory the disk tier makes its private directory in. */
static const char *spill_parent(const char *dir) {
  if (!dir || !*dir) dir = getenv("TMPDIR");
  if (!dir || !*dir) dir = "/tmp";
  return dir;
}

/* The disk tier makes its directory at first use (spill/disk.c): check now
 * that it will be able to, rather than at the first spill to disk. */
static dmem_status_t check_spill_dir(const char *dir) {
  dir = spill_parent(dir);
  struct stat sb;
  if (stat(dir, &sb) != 0)
    return dmem__error(DMEM_ERR_IO, "spill directory %s: %s", dir, strerror(errno));
  if (!S_ISDIR(sb.st_mode))
    return dmem__error(DMEM_ERR_IO, "spill directory %s is not a directory", dir);
  if (access(dir, W_OK | X_OK) != 0)
    return dmem__error(DMEM_ERR_IO, "spill directory %s is not writable: %s", dir,
                       strerror(errno));
  return DMEM_OK;
}

dmem_status_t dmem_runtime_create(const dmem_config_t *cfg_in, dmem_runtime_t **rt_out) {
  if (!rt_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_runtime_create: rt_out is NULL");
  dmem_config_t cfg;
  if (cfg_in) {
    if (cfg_in->struct_size < sizeof cfg) return check_config(cfg_in);
    memcpy(&cfg, cfg_in, sizeof cfg);
  } else {
    dmem_config_init(&cfg);
  }
  dmem_status_t st = check_config(&cfg);
  if (st != DMEM_OK) return st;
  st = dmem__config_check_env(&cfg);
  if (st != DMEM_OK) return st;
  st = check_spill_dir(cfg.spill_dir);
  if (st != DMEM_OK) return st;
  /* the tier chain's table (spill/tier.c) holds its rules */
  size_t ntiers;
  const dmem__tier_row_t *tiers = dmem__tier_rows(&ntiers);
  char why[160];
  if (!dmem__tier_table_check(tiers, ntiers, why, sizeof why))
    return dmem__error(DMEM_ERR_CONFIG, "the spill tier table (spill/tier.c): %s", why);
  /* NVTX's lazy initialisation is not safe from several threads at once:
   * once per process, before any thread of this runtime spills */
  DMEM_NVTX_INIT();

  /* aligned: the charge shards and hot counters sit on lines of their own */
  dmem_runtime_t *rt = aligned_alloc(_Alignof(dmem_runtime_t), sizeof *rt);
  if (rt) memset(rt, 0, sizeof *rt);
  dmem__table_t *table = calloc(1, sizeof *table);
  if (!rt || !table) {
    free(rt);
    free(table);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "runtime allocation failed");
  }
  rt->table = table;
  /* The spill directory's parent, absolute: the disk tier makes its
   * directory on first use, maybe after the process changed directory (a
   * relative path then named another place, and the directory dmem made
   * could not be removed at destroy). A relative TMPDIR likewise. */
  const char *parent = cfg.spill_dir;
  if (!parent || !*parent) {
    const char *tmp = getenv("TMPDIR");
    parent = tmp && *tmp && tmp[0] != '/' ? tmp : NULL;
  }
  if (parent) {
    st = absolute_path(parent, &rt->spill_dir_copy);
    if (st != DMEM_OK) goto fail_rt;
  }
  cfg.spill_dir = rt->spill_dir_copy;
  rt->cfg = cfg;
  dmem_atomic_store_relaxed(&rt->log_level, (int)cfg.log_level);
  dmem_atomic_store_relaxed(&rt->sum_last_ns, dmem__now_ns());
  st = dmem__table_init(rt->table);
  if (st != DMEM_OK) goto fail_rt;
  st = dmem__registry_init(rt);
  if (st != DMEM_OK) goto fail_table;
  pthread_mutex_init(&rt->disk_mu, NULL);
  pthread_mutex_init(&rt->evpool_mu, NULL);
  pthread_mutex_init(&rt->staging_mu, NULL);
  pthread_mutex_init(&rt->pending_mu, NULL);
  pthread_mutex_init(&rt->tmu, NULL);
  pthread_cond_init(&rt->tcv, NULL);
  pthread_mutex_init(&rt->ctl_mu, NULL);
  pthread_mutex_init(&rt->ahead_mu, NULL);
  pthread_cond_init(&rt->ahead_cv, NULL);
  pthread_mutex_init(&rt->swap_mu, NULL);
  rt->swap_off = rt->cfg.retrieve_swap == 1;
  rt->swap_pieces = rt->cfg.retrieve_swap == 2;
  rt->swap_piece = dmem__swap_piece_size();
  /* before the first thread starts: a fork from now on marks it */
  st = dmem__fork_track(rt);
  if (st != DMEM_OK) goto fail_mutexes;

  st = make_backend(&cfg, &rt->be, rt->backend_reason, sizeof rt->backend_reason);
  if (st != DMEM_OK) goto fail_track;
  DMEM_RT_LOG(rt, DMEM_LOG_INFO, "%s", rt->backend_reason);
  /* the host backend's default stream is dmem's too (its other streams
   * come from dmem_stream_create): a record of its own (api/registry.c) */
  if (rt->be->kind == DMEM_BACKEND_HOST) dmem__registry_stream_add(rt, NULL);
  rt->capacity = rt->be->device_capacity;
  if (cfg.device_limit) rt->limit_asked = cfg.device_limit;
  else if (cfg.device_limit_fraction > 0)
    rt->limit_asked = fraction_of(rt->capacity, cfg.device_limit_fraction);
  rt->limit = rt->limit_asked ? rt->limit_asked : rt->capacity;
  if (rt->limit > rt->capacity) {
    /* a limit the device cannot reach: its own out-of-memory would drive
     * spilling, and the statistics would promise room that is not there */
    DMEM_RT_LOG(rt, DMEM_LOG_WARN,
                "device limit %zu bytes is more than the device's %zu bytes: clamped to %zu",
                rt->limit, rt->capacity, rt->capacity);
    rt->limit = rt->capacity;
  }
  rt->host_limit = cfg.host_limit;
  rt->pol_lru = cfg.eviction_policy == DMEM_EVICTION_LRU;
  dmem__policy_init(rt);
  dmem__charge_init(rt);
  /* The pinned pool holds the host tier (up to its cap, host_burst past host_limit,
   * while the push-down to disk catches up) plus staging for copies in
   * flight and moves to disk and the controller: cfg.host_staging, or a
   * quarter of the limit more, at most 1 GiB (a few eviction batches' worth;
   * past that the staging waits for finished copies rather than pin host
   * memory that host_limit was set to bound); at least 64 MiB either way. */
  size_t pin_limit = 0;
  if (rt->host_limit) {
    size_t cap = dmem__host_tier_cap(rt->host_limit, cfg.host_burst);
    size_t extra = cfg.host_staging ? cfg.host_staging : rt->host_limit / 4;
    if (!cfg.host_staging && extra > ((size_t)1 << 30)) extra = (size_t)1 << 30;
    if (extra < ((size_t)64 << 20)) extra = (size_t)64 << 20;
    rt->host_staging = extra;
    pin_limit = cap > SIZE_MAX - extra ? SIZE_MAX : cap + extra;
  }
  if (pin_limit && cfg.host_reserve > pin_limit) {
    st = dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                     "host_reserve %zu is more than the pinned pool may hold with host_limit "
                     "%zu (%zu)",
                     cfg.host_reserve, rt->host_limit, pin_limit);
    goto fail_backend;
  }
  st = dmem__hostpool_create(rt->be, pin_limit, rt->be->kind == DMEM_BACKEND_CUDA,
                             cfg.host_reserve, cfg.host_headroom, &rt->hostpool);
  if (st != DMEM_OK) goto fail_backend;
  st = dmem__pool_create(rt->be, rt->limit, first_slab(rt->limit), &rt->pool);
  if (st != DMEM_OK) goto fail_hostpool;
  st = dmem__blocks_create(rt, rt->limit / 8, &rt->blocks);
  if (st != DMEM_OK) goto fail_pool;
  st = dmem__raw_create(&rt->raw);
  if (st != DMEM_OK) goto fail_blocks;
  st = dmem__io_create(rt, dmem__pushdown_run, &rt->io);
  if (st != DMEM_OK) goto fail_raw;
  st = dmem__fatal_keep(rt, rt->be->stream_create(rt->be, &rt->spill_stream));
  if (st != DMEM_OK) goto fail_io;
  st = dmem__fatal_keep(rt, rt->be->stream_create(rt->be, &rt->order_stream));
  if (st != DMEM_OK) goto fail_spill_stream;
  st = dmem__fatal_keep(rt, rt->be->stream_create(rt->be, &rt->unspill_stream));
  if (st != DMEM_OK) goto fail_order_stream;
  rt->copy_chunk = DMEM__COPY_CHUNK;
  ahead_marks(rt);
  st = dmem__ahead_start(rt);
  if (st != DMEM_OK) goto fail_unspill_stream;
  st = dmem__report_start(rt);
  if (st != DMEM_OK) goto fail_ahead;
  DMEM_RT_LOG(rt, DMEM_LOG_INFO,
              "runtime on the %s backend, device %d: capacity %zu bytes (%.1f MiB), limit %zu "
              "(%.1f MiB), host limit %zu%s, spill directory under %s, statistics %s",
              rt->be->name, cfg.device, rt->capacity, (double)rt->capacity / 1048576.0,
              rt->limit, (double)rt->limit / 1048576.0, rt->host_limit,
              rt->host_limit ? "" : " (unlimited)", spill_parent(cfg.spill_dir),
              !cfg.print_stats ? "off" : cfg.stats_interval_s ? "periodic" : "at the end");
  *rt_out = rt;
  return DMEM_OK;

fail_ahead:
  dmem__ahead_stop(rt);
fail_unspill_stream:
  (void)rt->be->stream_destroy(rt->be, rt->unspill_stream);
fail_order_stream:
  (void)rt->be->stream_destroy(rt->be, rt->order_stream);
fail_spill_stream:
  (void)rt->be->stream_destroy(rt->be, rt->spill_stream);
fail_io:
  dmem__io_destroy(rt->io);
fail_raw:
  dmem__raw_destroy(rt->raw);
fail_blocks:
  dmem__blocks_destroy(rt->blocks);
fail_pool:
  dmem__pool_destroy(rt->pool);
fail_hostpool:
  dmem__hostpool_destroy(rt->hostpool);
fail_backend:
  dmem__policy_fini(rt);
  rt->be->destroy(rt->be);
fail_track:
  dmem__fork_untrack(rt);
fail_mutexes:
  destroy_mutexes(rt);
  pthread_mutex_destroy(&rt->reg.mu);
fail_table:
  dmem__table_fini(rt->table);
fail_rt:
  free(rt->spill_dir_copy);
  free(rt->table);
  free(rt);
  return st;
}

/* The FREE event of every buffer still alive at destroy, as dmem_buffer_free gives
 * it (the tier its bytes are in), so that a controller holding the bytes of
 * some can drop them. Nothing is torn down yet: the callbacks see a whole
 * runtime (the caller's guarantee that no other thread uses it holds). */
static void emit_frees_at_destroy(dmem_runtime_t *rt) {
  if (!dmem_atomic_load_relaxed(&rt->has_ctl_events)) return;
  uint32_t hw = dmem_atomic_load_relaxed(&rt->table->high_water);
  for (uint32_t slot = 0; slot < hw; slot++) {
    dmem__buffer_t *b = dmem__table_slot(rt->table, slot);
    if (!b) break;
    /* acquire: partner is the release in dmem__buffer_publish */
    uint64_t w = dmem_atomic_load_acquire(&b->word);
    if (dmem__w_state(w) == DMEM__STATE_FREE || (w & DMEM__F_FREED)) continue;
    dmem__emit(rt, DMEM_EVENT_FREE, dmem__handle_of(b, w), dmem__bsize(b),
               dmem__tier_public(dmem__w_state(w)), 0);
  }
}

void dmem_runtime_destroy(dmem_runtime_t *rt) {
  if (!rt) return;
  /* Inherited by a forked child (runtime/api/fork.c): its threads are not
   * here, its mutexes may be held for good and its device context is the
   * parent's. Release nothing: the child's copy of its memory goes with
   * the child's exit or exec. */
  if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__FORKED) return;
  dmem__fork_untrack(rt); /* the exit handler of DMEM_STATS no longer sees it */
  dmem__report_stop(rt);  /* the DMEM_STATS=N thread */
  dmem__ahead_stop(rt);   /* first of the movers */
  emit_frees_at_destroy(rt);
  /* The I/O threads first: a push-down in progress stops at its next
   * chunk. Nothing reads or writes the disk after this. */
  dmem__io_destroy(rt->io);
  rt->io = NULL;
  /* the holes of freed extents still queued for an I/O thread */
  dmem__disk_io_gone(dmem_atomic_load_relaxed(&rt->disk));
  dmem__summary_flush(rt);
  if (rt->cfg.print_stats) dmem__report_print(rt, "at destroy");
  (void)dmem__trace_write();
  (void)rt->be->stream_synchronize(rt->be, NULL);
  (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
  (void)rt->be->stream_synchronize(rt->be, rt->unspill_stream);
  (void)rt->be->stream_synchronize(rt->be, rt->order_stream);
  dmem__registry_fini(rt);
  dmem__staging_fini(rt);
  dmem__disk_stage_fini(rt); /* the disk tier's read staging (its copies are done) */
  /* Free every buffer still alive, locked ones too. */
  uint32_t hw = dmem_atomic_load_relaxed(&rt->table->high_water);
  for (uint32_t slot = 0; slot < hw; slot++) {
    dmem__buffer_t *b = dmem__table_slot(rt->table, slot);
    if (!b) break;
    uint64_t w = dmem_atomic_load_relaxed(&b->word);
    if (dmem__w_state(w) == DMEM__STATE_FREE) continue;
    w = (w & ~(DMEM__COUNT_MASK | DMEM__F_TRANSIT)) | DMEM__F_FREED;
    dmem_atomic_store_relaxed(&b->word, w);
    dmem__reclaim(rt, b, w);
  }
  dmem__blocks_destroy(rt->blocks); /* live or cached dedicated blocks */
  if (rt->swap_bounce) { /* its copies are done (the streams were synchronised) */
    (void)rt->be->device_free(rt->be, rt->swap_bounce);
    for (int i = 0; i < 4; i++) (void)rt->be->event_destroy(rt->be, rt->swap_ev[i]);
  }
  dmem__event_pool_fini(rt);
  dmem__disk_destroy(dmem_atomic_load_relaxed(&rt->disk));
  dmem__raw_destroy(rt->raw); /* raw allocations still live go with the pool */
  dmem__pool_stream_forget(rt->pool, rt->spill_stream);
  dmem__pool_stream_forget(rt->pool, rt->order_stream);
  dmem__pool_stream_forget(rt->pool, rt->unspill_stream);
  dmem__pool_destroy(rt->pool);
  (void)rt->be->stream_destroy(rt->be, rt->spill_stream);
  (void)rt->be->stream_destroy(rt->be, rt->unspill_stream);
  (void)rt->be->stream_destroy(rt->be, rt->order_stream);
  dmem__hostpool_destroy(rt->hostpool);
  rt->be->destroy(rt->be);
  dmem__policy_fini(rt);
  destroy_mutexes(rt);
  dmem__table_fini(rt->table);
  free(rt->table);
  free(rt->spill_dir_copy);
  free(rt);
}

dmem_backend_t dmem_runtime_backend(const dmem_runtime_t *rt) {
  return rt ? rt->be->kind : DMEM_BACKEND_AUTO;
}

dmem_status_t dmem_runtime_poll(dmem_runtime_t *rt) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_runtime_poll: rt is NULL");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  dmem__spill_poll(rt);
  return DMEM_OK;
}

dmem_status_t dmem_runtime_info(const dmem_runtime_t *rt, dmem_runtime_info_t *info_out) {
  if (!rt || !info_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_runtime_info: NULL argument");
  size_t n = info_out->struct_size;
  if (n < sizeof(size_t) * 2)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_runtime_info: info_out->struct_size %zu is too small (set it to "
                       "sizeof(dmem_runtime_info_t), %zu)",
                       n, sizeof(dmem_runtime_info_t));
  if (dmem_atomic_load_relaxed(&rt->fatal) == DMEM__FORKED) return dmem__forked_error();
  dmem_runtime_info_t info;
  memset(&info, 0, sizeof info);
  info.struct_size = n;
  info.backend = rt->be->kind;
  info.device = rt->cfg.device;
  info.log_level = (dmem_log_level_t)dmem_atomic_load_relaxed(&rt->log_level);
  info.stats_interval_s = rt->cfg.stats_interval_s;
  info.device_capacity = rt->capacity;
  info.device_limit = rt->limit;
  info.device_limit_asked = rt->limit_asked;
  info.host_limit = rt->host_limit;
  info.print_stats = rt->cfg.print_stats;
  info.host_headroom = rt->cfg.host_headroom;
  info.eviction_policy = rt->pol_lru ? DMEM_EVICTION_LRU : DMEM_EVICTION_REUSE;
  info.spill_ahead_trigger = rt->ahead_demand ? DMEM_SPILL_AHEAD_DEMAND : DMEM_SPILL_AHEAD_ALWAYS;
  snprintf(info.backend_reason, sizeof info.backend_reason, "%s", rt->backend_reason);
  snprintf(info.spill_dir, sizeof info.spill_dir, "%s", spill_parent(rt->cfg.spill_dir));
  memcpy(info_out, &info, n < sizeof info ? n : sizeof info);
  return DMEM_OK;
}

dmem_status_t dmem_runtime_set_log_level(dmem_runtime_t *rt, dmem_log_level_t level) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_runtime_set_log_level: rt is NULL");
  if ((int)level < DMEM_LOG_OFF || (int)level > DMEM_LOG_DEBUG)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_runtime_set_log_level: level %d not in 0..4 (off .. debug)",
                       (int)level);
  dmem_status_t st = dmem__check_forked(rt);
  if (st != DMEM_OK) return st;
  dmem__log_level_set(rt, (int)level);
  return DMEM_OK;
}
