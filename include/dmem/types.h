/*
 * dmem/types.h - opaque handles and small shared types.
 */
#ifndef DMEM_TYPES_H
#define DMEM_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "dmem/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The runtime: owns the handle table, the backend and the spill tiers. */
typedef struct dmem_runtime dmem_runtime_t;

/** Buffer handle: slot index (low 32 bits) and generation (high 32 bits).
 *  0 (DMEM_HANDLE_NULL) is never a valid handle. A zero, freed or forged
 *  handle gives DMEM_ERR_STALE_HANDLE wherever a handle is taken, never
 *  another buffer; so does a handle of another runtime (generations start
 *  at a random value per runtime: it names a buffer here with probability
 *  2^-32 at most), and nothing changes in either runtime. */
typedef uint64_t dmem_handle_t;
#define DMEM_HANDLE_NULL ((dmem_handle_t)0)

/** A stream. Under the CUDA backend it is a cudaStream_t and callers may pass
 *  their own; under the host backend it is a stream from dmem_stream_create.
 *  NULL is the default stream. */
typedef void *dmem_stream_t;

/** Where a buffer's bytes live. */
typedef enum dmem_state {
  DMEM_STATE_RESIDENT = 0,            /**< on the device */
  DMEM_STATE_SPILLING = 1,            /**< device->host copy in flight */
  DMEM_STATE_DEFERRED_HOST = 2,       /**< in (pinned) host memory */
  DMEM_STATE_DEFERRED_DISK = 3,       /**< in a file of the spill directory */
  DMEM_STATE_DEFERRED_CONTROLLER = 4, /**< held by the controller */
  DMEM_STATE_UNSPILLING = 5           /**< host->device copy being set up */
} dmem_state_t;

/** Spill targets. */
typedef enum dmem_tier {
  DMEM_TIER_DEVICE = 0,     /**< resident (used in events and statistics) */
  DMEM_TIER_HOST = 1,       /**< pinned host memory */
  DMEM_TIER_DISK = 2,       /**< files in the spill directory */
  DMEM_TIER_CONTROLLER = 3  /**< storage owned by the controller */
} dmem_tier_t;

/** Backend selection. */
typedef enum dmem_backend {
  DMEM_BACKEND_AUTO = 0, /**< CUDA when a device is present, else host */
  DMEM_BACKEND_CUDA = 1,
  DMEM_BACKEND_HOST = 2  /**< device memory simulated in host memory */
} dmem_backend_t;

/**
 * Launch function called by the entry points with the locked buffers' device
 * pointers, in the order of the handles given. It runs with no dmem-internal
 * mutex held and may call back into the runtime. Its status is what the entry
 * point returns.
 */
typedef dmem_status_t (*dmem_launch_fn)(void *user, dmem_stream_t stream,
                                        void *const *dev_ptrs, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_TYPES_H */
