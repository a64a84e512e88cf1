/*
 * dmem/runtime.h - creating and destroying a runtime.
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
 *                                    or a field out of range;
 *         DMEM_ERR_CONFIG            a DMEM_* environment variable is malformed
 *                                    (detail names it);
 *         DMEM_ERR_NO_DEVICE         backend CUDA asked for and no device or
 *                                    driver is usable;
 *         DMEM_ERR_DEVICE            the CUDA backend failed to start;
 *         DMEM_ERR_DEVICE_FATAL      the device's context is already broken
 *                                    (a sticky error while making the
 *                                    runtime's streams);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY allocation of runtime structures failed.
 */
DMEM_API dmem_status_t dmem_runtime_create(const dmem_config_t *cfg,
                                           dmem_runtime_t **rt_out);

/**
 * Destroy a runtime: stops and joins its I/O threads (a push-down to disk in
 * progress stops at its next chunk; the buffer stays in the host tier),
 * waits for the runtime's streams, frees every buffer (locked ones too), the
 * pinned host pool, and removes the spill directory (its one file has no
 * name and goes with the process in any case). rt == NULL is a no-op. Not
 * thread-safe with respect to other calls on the same runtime: no other
 * thread may use rt during or after this call.
 */
DMEM_API void dmem_runtime_destroy(dmem_runtime_t *rt);

/**
 * The backend actually in use (DMEM_BACKEND_CUDA or DMEM_BACKEND_HOST).
 * Thread-safe. Returns DMEM_BACKEND_AUTO for rt == NULL.
 */
DMEM_API dmem_backend_t dmem_runtime_backend(const dmem_runtime_t *rt);

/**
 * Complete deferred work that needs no waiting: unlock the buffers of
 * dmem_stream_release calls whose stream work has finished, and recycle
 * staging memory of finished copies. The runtime also does this whenever it
 * looks for spill victims or reports state. Thread-safe.
 *
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_DEVICE or
 *         DMEM_ERR_DEVICE_FATAL if querying an event failed.
 */
DMEM_API dmem_status_t dmem_runtime_poll(dmem_runtime_t *rt);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_RUNTIME_H */
