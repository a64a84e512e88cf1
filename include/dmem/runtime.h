/*
 * dmem/runtime.h - creating and destroying a runtime, and what fork() means
 * for one.
 *
 * fork(). A child made by fork() gets a copy of its parent's runtimes but
 * none of their threads (the host backend's stream workers, the I/O
 * threads, spill-ahead, the pinned pool's grower), no usable CUDA context,
 * and possibly internal mutexes that a parent thread held at the fork and
 * that nobody in the child will ever release. So an inherited runtime is
 * unusable in the child, and dmem says so: every call on it returns
 * DMEM_ERR_FORKED, at once, without taking a mutex, calling the device or
 * waiting for anything (argument checks that need no runtime state, such as
 * a NULL output, may give DMEM_ERR_INVALID_ARGUMENT first). The exceptions:
 *   - dmem_buffer_unlock of a buffer that is not freed drops the lock in the
 *     child's own copy of the runtime (one atomic operation on memory the
 *     child owns: the lock fast path has no room for a check); the last
 *     unlock of a buffer freed while locked returns DMEM_ERR_FORKED;
 *   - dmem_runtime_backend answers as in the parent;
 *   - dmem_runtime_destroy releases nothing (see there).
 * The parent is not affected: its runtimes, buffers, data and statistics
 * are as they were, whatever the child calls. The child may create runtimes
 * of its own (and dmem_runtime_default gives it a new default runtime);
 * under CUDA, only if it has not used CUDA in the parent's context (CUDA's
 * own rule for forked children). A runtime created in the child is
 * inherited by its own children in the same way.
 */
#ifndef DMEM_RUNTIME_H
#define DMEM_RUNTIME_H

#include "dmem/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Create a runtime.
 *
 * @param cfg     parameters from dmem_config_init (may be NULL: defaults and
 *                environment). Not retained; strings are copied.
 * @param rt_out  receives the runtime on success; untouched on failure.
 *
 * Thread-safe.
 *
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt_out NULL, cfg->struct_size too small,
 *                                    or a field out of range (its row of
 *                                    DMEM_CONFIG_OPTIONS, dmem/config.h; the
 *                                    detail names the field);
 *         DMEM_ERR_CONFIG            a DMEM_* environment variable is malformed
 *                                    and its field holds the default (detail
 *                                    names it; see dmem/config.h), or (a
 *                                    build mistake) the spill tier table
 *                                    breaks its rules (detail says which);
 *         DMEM_ERR_IO                the spill directory (cfg->spill_dir, else
 *                                    $TMPDIR or /tmp) is missing, not a
 *                                    directory or not writable (detail names
 *                                    it and why);
 *         DMEM_ERR_NO_DEVICE         backend CUDA asked for and no device or
 *                                    driver is usable;
 *         DMEM_ERR_DEVICE            the CUDA backend failed to start;
 *         DMEM_ERR_DEVICE_FATAL      the device's context is already broken
 *                                    (a sticky error while making the
 *                                    runtime's streams);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY allocation of runtime structures failed;
 *         DMEM_ERR_IO                spill_dir (or $TMPDIR) is relative and
 *                                    the current directory cannot be read
 *                                    (getcwd) to make it absolute.
 */
DMEM_API dmem_status_t dmem_runtime_create(const dmem_config_t *cfg,
                                           dmem_runtime_t **rt_out);

/**
 * Destroy a runtime: first tells the controller (if it listens to events) of
 * every buffer still alive, with the DMEM_EVENT_FREE that dmem_buffer_free would
 * give (the tier its bytes are in: a controller holding the bytes of some
 * drops them then; the callback must not call the runtime), then stops and
 * joins its I/O threads (a push-down to disk in
 * progress stops at its next chunk; the buffer stays in the host tier),
 * waits for the runtime's streams, frees every buffer (locked ones too), the
 * pinned host pool, and removes the spill directory (its one file has no
 * name and goes with the process in any case). rt == NULL is a no-op. Not
 * thread-safe with respect to other calls on the same runtime: no other
 * thread may use rt during or after this call.
 *
 * In a forked child, on a runtime inherited from the parent, it returns at
 * once and releases nothing: not the parent's device memory, streams,
 * spill directory or file (they are the parent's), and not the child's copy
 * of the runtime's host memory either (its mutexes may be held for good);
 * that copy goes with the child's exit or exec. The runtime stays unusable
 * (DMEM_ERR_FORKED) in the child.
 */
DMEM_API void dmem_runtime_destroy(dmem_runtime_t *rt);

/**
 * The backend actually in use (DMEM_BACKEND_CUDA or DMEM_BACKEND_HOST).
 * Thread-safe. Returns DMEM_BACKEND_AUTO for rt == NULL. Works in a forked
 * child too (it reads a field set at creation).
 */
DMEM_API dmem_backend_t dmem_runtime_backend(const dmem_runtime_t *rt);

/** What dmem_runtime_info reports. An output struct that can grow: the
 *  caller sets struct_size (sizeof(dmem_runtime_info_t) of its header) and
 *  dmem writes the fields that fit in it. */
typedef struct dmem_runtime_info {
  size_t struct_size;        /**< set by the caller */
  dmem_backend_t backend;    /**< DMEM_BACKEND_CUDA or DMEM_BACKEND_HOST */
  int device;                /**< the device ordinal */
  dmem_log_level_t log_level; /**< the runtime's log level now */
  unsigned stats_interval_s; /**< the config's (0: statistics only at the end) */
  size_t device_capacity;    /**< the device's memory (host backend: simulated) */
  size_t device_limit;       /**< the limit in effect */
  /** The limit the config asked for, in bytes (device_limit, or the fraction
   *  of the capacity); 0: none (the capacity). Above device_limit when it
   *  was clamped to the capacity. */
  size_t device_limit_asked;
  size_t host_limit;         /**< 0: unlimited */
  bool print_stats;          /**< the config's print_stats */
  /** Why this backend, e.g. "backend auto: CUDA not usable
   *  (cudaGetDeviceCount: cudaErrorInsufficientDriver (...)), using the host
   *  backend" or "backend host asked for". NUL-terminated, truncated to fit. */
  char backend_reason[384];
  /** The parent of the private spill directory (spill_dir, $TMPDIR or /tmp);
   *  NUL-terminated, truncated to fit. */
  char spill_dir[256];
  /** The pinned pool's headroom (dmem_config_t.host_headroom). */
  size_t host_headroom;
  /** The eviction policy in effect (DMEM_EVICTION_REUSE or
   *  DMEM_EVICTION_LRU; dmem_config_t.eviction_policy). */
  dmem_eviction_policy_t eviction_policy;
  /** The spill-ahead thread's trigger in effect: DMEM_SPILL_AHEAD_DEMAND or
   *  DMEM_SPILL_AHEAD_ALWAYS (dmem_config_t.spill_ahead_trigger); whether
   *  the thread runs at all is dmem_stats_t.spill_ahead_high (0: off). */
  int spill_ahead_trigger;
} dmem_runtime_info_t;

/**
 * Describe the runtime: the backend and why it was chosen, the device, the
 * limits in effect and the log level. Writes the first info_out->struct_size
 * bytes of the description (at most sizeof(dmem_runtime_info_t); struct_size
 * itself is left as the caller set it), only on success.
 *
 * Thread-safe (reads fields set at creation, and the log level).
 *
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt or info_out NULL, or
 *                                    info_out->struct_size < sizeof(size_t) * 2;
 *         DMEM_ERR_FORKED            an inherited runtime in a forked child.
 */
DMEM_API dmem_status_t dmem_runtime_info(const dmem_runtime_t *rt,
                                         dmem_runtime_info_t *info_out);

/**
 * Set the runtime's log level (its config's log_level, DMEM_LOG). Each
 * runtime logs its own messages at its own level; messages of shared code
 * that knows no runtime follow the most verbose live runtime. Takes effect
 * for messages that start after the call.
 *
 * Thread-safe.
 *
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt NULL or level not in DMEM_LOG_OFF ..
 *                                    DMEM_LOG_DEBUG;
 *         DMEM_ERR_FORKED            an inherited runtime in a forked child.
 */
DMEM_API dmem_status_t dmem_runtime_set_log_level(dmem_runtime_t *rt, dmem_log_level_t level);

/**
 * Complete deferred work that needs no waiting: unlock the buffers of
 * dmem_stream_release calls whose stream work has finished, and recycle
 * staging memory of finished copies. The runtime also does this whenever it
 * looks for spill victims or reports state. Thread-safe.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_DEVICE or
 *         DMEM_ERR_DEVICE_FATAL if querying an event failed; DMEM_ERR_FORKED
 *         (an inherited runtime in a forked child).
 */
DMEM_API dmem_status_t dmem_runtime_poll(dmem_runtime_t *rt);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_RUNTIME_H */
