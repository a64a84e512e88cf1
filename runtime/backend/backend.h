/*
 * runtime/backend/backend.h - the internal table of functions a backend
 * provides. Two backends: cuda.c (CUDA Runtime API, static; Driver API through
 * cudaGetDriverEntryPointByVersion) and host.c (device memory simulated in host
 * memory, streams as FIFO worker threads).
 *
 * Conventions:
 *  - Every function returns dmem_status_t and records the detail with
 *    dmem__error() (runtime/base/error.h) at the place the failure is
 *    first detected.
 *  - Outputs are written only on success.
 *  - `stream` NULL means the backend's default stream.
 *  - Every function is thread-safe.
 *  - Sticky context errors (CUDA: cudaErrorIllegalAddress, LaunchFailure,
 *    ...) return DMEM_ERR_DEVICE_FATAL; the runtime then refuses work.
 */
#ifndef DMEM_BACKEND_H
#define DMEM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "dmem/config.h"
#include "dmem/status.h"

typedef struct dmem__backend dmem__backend_t;

struct dmem__backend {
  const char *name;        /* "cuda" or "host" */
  dmem_backend_t kind;     /* DMEM_BACKEND_CUDA or DMEM_BACKEND_HOST */
  size_t device_capacity;  /* total device memory (host: simulated capacity) */
  /* Smallest chunk of pinned host memory worth asking host_alloc for: the
   * pinned pool grows by at least this much (cudaMallocHost is slow, so the
   * CUDA backend asks for large chunks; the host backend for small ones). */
  size_t host_chunk_min;
  /* Largest block the pinned pool hands out as pageable memory rather than
   * wait for a chunk another thread is pinning (0: any size). Faulting in a
   * large pageable block costs more than waiting for fast pinning. */
  size_t host_pageable_max;

  /* Device memory. device_alloc returns DMEM_ERR_OUT_OF_MEMORY when the
   * device (or the simulated capacity) is exhausted; the runtime then spills
   * and retries. device_free(NULL) is a no-op. */
  dmem_status_t (*device_alloc)(dmem__backend_t *be, size_t size, void **ptr_out);
  dmem_status_t (*device_free)(dmem__backend_t *be, void *ptr);

  /* Page-locked host memory (CUDA: cudaMallocHost; host: malloc). Returns
   * DMEM_ERR_HOST_OUT_OF_MEMORY on failure. host_free(NULL) is a no-op. */
  dmem_status_t (*host_alloc)(dmem__backend_t *be, size_t size, void **ptr_out);
  dmem_status_t (*host_free)(dmem__backend_t *be, void *ptr);

  /* Copy n bytes (any direction, cudaMemcpyDefault semantics), in stream
   * order on `stream`. Returns once enqueued. */
  dmem_status_t (*memcpy_async)(dmem__backend_t *be, void *dst, const void *src, size_t n,
                                void *stream);

  /* Streams. stream_create makes a stream that does not synchronise with the
   * default stream. stream_destroy waits for queued work first. */
  dmem_status_t (*stream_create)(dmem__backend_t *be, void **stream_out);
  dmem_status_t (*stream_destroy)(dmem__backend_t *be, void *stream);
  dmem_status_t (*stream_synchronize)(dmem__backend_t *be, void *stream);
  /* Whether all work queued on stream has completed (cudaStreamQuery):
   * DMEM_OK yes, DMEM_ERR_BUSY not yet, else a failure. */
  dmem_status_t (*stream_query)(dmem__backend_t *be, void *stream);
  /* Make later work on `stream` wait for `event`'s last record. */
  dmem_status_t (*stream_wait_event)(dmem__backend_t *be, void *stream, void *event);
  /* Run fn(user) in stream order; fn must not call the backend's device
   * API. */
  dmem_status_t (*launch_host_func)(dmem__backend_t *be, void *stream, void (*fn)(void *),
                                    void *user);

  /* Events (no timing). An event never recorded counts as complete.
   * event_query returns DMEM_OK when complete and DMEM_ERR_BUSY while the
   * work before its last record is still pending. */
  dmem_status_t (*event_create)(dmem__backend_t *be, void **event_out);
  dmem_status_t (*event_destroy)(dmem__backend_t *be, void *event);
  dmem_status_t (*event_record)(dmem__backend_t *be, void *event, void *stream);
  dmem_status_t (*event_query)(dmem__backend_t *be, void *event);
  dmem_status_t (*event_synchronize)(dmem__backend_t *be, void *event);

  /* The IPC handle (cuIpcGetMemHandle, 64 bytes at handle_out) of a device
   * allocation `base` returned by device_alloc. Host backend:
   * DMEM_ERR_NO_DEVICE (no IPC between processes there). */
  dmem_status_t (*ipc_handle)(dmem__backend_t *be, void *base, void *handle_out);

  /* Free and total device memory as the device sees it. */
  dmem_status_t (*mem_info)(dmem__backend_t *be, size_t *free_out, size_t *total_out);

  /* Virtual memory management (CUDA VMM: cuMemAddressReserve, cuMemCreate,
   * cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree),
   * for buffers that keep their device address while their physical memory
   * comes and goes (runtime/memory/stable.c). Sizes and addresses are
   * multiples of vmm_granularity. A reserved range is not accessible until
   * physical memory is mapped into it and access is set; unmapped, it is
   * a reservation again (host backend: PROT_NONE, so that an access faults).
   *
   * vmm_granularity: the size every reservation, allocation and mapping is
   *   a multiple of (cuMemGetAllocationGranularity, minimum).
   * va_reserve: reserve `size` bytes of device address space, no memory
   *   behind it. DMEM_ERR_OUT_OF_MEMORY when the address space is exhausted.
   * va_free: give a whole reserved range back (nothing mapped in it).
   * mem_create: `size` bytes of physical device memory, counted against the
   *   device's capacity as device_alloc is; *handle_out names it.
   *   DMEM_ERR_OUT_OF_MEMORY when the device is full.
   * mem_release: give physical memory back (once unmapped).
   * mem_map: map the whole of `handle` (size bytes) at va, a reserved
   *   range of that size; mem_set_access then makes it readable and
   *   writable by the backend's device. Bytes are undefined after a map.
   * mem_unmap: unmap [va, va + size), which must be one whole mapping;
   *   the range stays reserved. Waits for nothing: the caller orders it
   *   after the last use of the memory.
   * The frees (mem_unmap, mem_release, va_free) fail only with the sticky
   * error of earlier work (DMEM_ERR_DEVICE_FATAL). */
  dmem_status_t (*vmm_granularity)(dmem__backend_t *be, size_t *granularity_out);
  dmem_status_t (*va_reserve)(dmem__backend_t *be, size_t size, void **va_out);
  dmem_status_t (*va_free)(dmem__backend_t *be, void *va, size_t size);
  dmem_status_t (*mem_create)(dmem__backend_t *be, size_t size, uint64_t *handle_out);
  dmem_status_t (*mem_release)(dmem__backend_t *be, uint64_t handle);
  dmem_status_t (*mem_map)(dmem__backend_t *be, void *va, size_t size, uint64_t handle);
  dmem_status_t (*mem_set_access)(dmem__backend_t *be, void *va, size_t size);
  dmem_status_t (*mem_unmap)(dmem__backend_t *be, void *va, size_t size);

  /* Tear down (after the runtime has freed everything). */
  void (*destroy)(dmem__backend_t *be);

  /* Make the backend's device current on the calling thread and leave it
   * current, for code that launches work itself (a user launch function);
   * the backend's own functions need no call. Host backend: nothing to do.
   * Last: every dmem_launch_async calls it, and a backend's own fields
   * that it reads can follow it on the same line (the CUDA backend's). */
  dmem_status_t (*make_current)(dmem__backend_t *be);
};

/* Create the host backend with a simulated device capacity in bytes. */
dmem_status_t dmem__backend_host_create(const dmem_config_t *cfg, dmem__backend_t **be_out);

/* Create the CUDA backend on cfg->device. DMEM_ERR_NO_DEVICE when no driver
 * or device is usable (also in builds without CUDA support). */
dmem_status_t dmem__backend_cuda_create(const dmem_config_t *cfg, dmem__backend_t **be_out);

/* Whether a CUDA device is usable (for DMEM_BACKEND_AUTO). When not, the
 * error detail (dmem_last_error_detail) says why: the CUDA error of
 * cudaGetDeviceCount (e.g. cudaErrorInsufficientDriver), no device, or a
 * build without CUDA. */
int dmem__backend_cuda_available(void);

/* Fault injection: a wrapping backend and the disk tier's injection points
 * (fault.c). */
#include "fault.h"

#endif /* DMEM_BACKEND_H */
