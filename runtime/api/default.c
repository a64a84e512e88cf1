/*
 * runtime/api/default.c - the process-wide runtime of each device
 * (dmem_runtime_default), created on first use from the configuration given
 * to dmem_runtime_default_configure, else from the DMEM_* environment, and
 * shared by every consumer in the process; and PyTorch's pluggable allocator
 * symbols on top of it (dmem_torch_alloc / dmem_torch_free).
 */
#include "api/api.h"

#include <stdlib.h>
#include <string.h>

#define DMEM__MAX_DEVICES 64

/* Published with release once created; never destroyed (it lives until the
 * process exits: allocator hooks may free into it during interpreter
 * shutdown, after any atexit handler of ours would have run). */
static _Atomic(dmem_runtime_t *) default_rt[DMEM__MAX_DEVICES];
static pthread_mutex_t default_mu = PTHREAD_MUTEX_INITIALIZER;
/* dmem_runtime_default_configure's copy (guarded by default_mu). */
static bool default_configured;
static dmem_config_t default_cfg;
static char *default_spill_dir; /* owned copy of default_cfg.spill_dir */
static pthread_once_t default_fork_once = PTHREAD_ONCE_INIT;

/* In a forked child the runtimes of the parent have none of their threads
 * (host-backend streams, copy engine) and no usable CUDA context: forget
 * them (their memory goes with the child's exit) so that the child's first
 * use creates its own. The mutex may have been held by a parent thread. */
static void default_after_fork_child(void) {
  pthread_mutex_init(&default_mu, NULL);
  for (int d = 0; d < DMEM__MAX_DEVICES; d++) dmem_atomic_store_relaxed(&default_rt[d], NULL);
}

static void default_register_fork(void) { pthread_atfork(NULL, NULL, default_after_fork_child); }

static bool default_any_created(void) {
  for (int d = 0; d < DMEM__MAX_DEVICES; d++)
    if (dmem_atomic_load_relaxed(&default_rt[d])) return true;
  return false;
}

dmem_status_t dmem_runtime_default_configure(const dmem_config_t *cfg) {
  if (cfg && cfg->struct_size < sizeof(dmem_config_t))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_runtime_default_configure: cfg->struct_size %zu < %zu (use "
                       "dmem_config_init)",
                       cfg->struct_size, sizeof(dmem_config_t));
  char *dir = NULL;
  if (cfg && cfg->spill_dir && !(dir = strdup(cfg->spill_dir)))
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "dmem_runtime_default_configure: strdup");
  pthread_mutex_lock(&default_mu); /* not ranked: taken with no runtime mutex held */
  if (default_any_created()) {
    pthread_mutex_unlock(&default_mu);
    free(dir);
    return dmem__error(DMEM_ERR_BUSY,
                       "dmem_runtime_default_configure: a default runtime already exists; "
                       "configure before the first use");
  }
  free(default_spill_dir);
  default_spill_dir = dir;
  default_configured = cfg != NULL;
  if (cfg) {
    default_cfg = *cfg;
    default_cfg.struct_size = sizeof default_cfg;
    default_cfg.spill_dir = dir;
  }
  pthread_mutex_unlock(&default_mu);
  return DMEM_OK;
}

dmem_status_t dmem_runtime_default(int device, dmem_runtime_t **rt_out) {
  if (!rt_out || device < 0 || device >= DMEM__MAX_DEVICES)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_runtime_default: rt_out NULL or device %d not in 0..%d", device,
                       DMEM__MAX_DEVICES - 1);
  /* acquire: partner is the release store below */
  dmem_runtime_t *rt = dmem_atomic_load_acquire(&default_rt[device]);
  if (rt) {
    *rt_out = rt;
    return DMEM_OK;
  }
  pthread_once(&default_fork_once, default_register_fork);
  pthread_mutex_lock(&default_mu); /* not ranked: taken with no runtime mutex held */
  rt = dmem_atomic_load_relaxed(&default_rt[device]);
  dmem_status_t st = DMEM_OK;
  if (!rt) {
    dmem_config_t cfg;
    if (default_configured) cfg = default_cfg;
    else dmem_config_init(&cfg);
    cfg.device = device;
    st = dmem_runtime_create(&cfg, &rt);
    if (st == DMEM_OK) dmem_atomic_store_release(&default_rt[device], rt);
  }
  pthread_mutex_unlock(&default_mu);
  if (st == DMEM_OK) *rt_out = rt;
  return st;
}

void *dmem_torch_alloc(size_t size, int device, void *stream) {
  dmem_runtime_t *rt;
  void *p = NULL;
  if (dmem_runtime_default(device, &rt) != DMEM_OK) return NULL;
  if (size == 0) size = 1; /* PyTorch asks for 0 bytes for empty tensors */
  if (dmem_device_malloc(rt, size, stream, &p) != DMEM_OK) return NULL;
  return p;
}

void dmem_torch_free(void *ptr, size_t size, int device, void *stream) {
  (void)size;
  dmem_runtime_t *rt;
  if (!ptr || dmem_runtime_default(device, &rt) != DMEM_OK) return;
  dmem_status_t st = dmem_device_free(rt, ptr, stream);
  if (st != DMEM_OK) DMEM_LOG_AT(DMEM_LOG_ERROR, "dmem_torch_free: %s", dmem_last_error_detail());
}
