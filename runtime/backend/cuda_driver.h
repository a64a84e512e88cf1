/*
 * runtime/backend/cuda_driver.h - the CUDA backend's Driver API table and
 * helpers for code that needs more than struct dmem__backend (IPC handles,
 * pointer attributes, allocation ranges).
 *
 * Nothing links libcuda: the Driver API functions are looked up once, at
 * dmem__backend_cuda_create, through cudaGetDriverEntryPointByVersion (ABI of
 * CUDA 12.0), so the same binary starts on machines without a driver.
 *
 * In builds without DMEM_HAVE_CUDA the table is an incomplete type and every
 * function here answers "not CUDA" (NULL, 0, DMEM_ERR_NO_DEVICE).
 */
#ifndef DMEM_CUDA_DRIVER_H
#define DMEM_CUDA_DRIVER_H

#include "backend.h"

typedef struct dmem__cuda_driver dmem__cuda_driver_t;

#ifdef DMEM_HAVE_CUDA
#include <cuda.h>

/* Driver API signatures as of the CUDA 12.0 ABI (the version we ask for). */
typedef CUresult(CUDAAPI *dmem__pfn_cuGetErrorName_t)(CUresult error, const char **str);
typedef CUresult(CUDAAPI *dmem__pfn_cuGetErrorString_t)(CUresult error, const char **str);
typedef CUresult(CUDAAPI *dmem__pfn_cuCtxGetCurrent_t)(CUcontext *ctx);
typedef CUresult(CUDAAPI *dmem__pfn_cuCtxSetCurrent_t)(CUcontext ctx);
typedef CUresult(CUDAAPI *dmem__pfn_cuCtxGetDevice_t)(CUdevice *device);
typedef CUresult(CUDAAPI *dmem__pfn_cuPointerGetAttribute_t)(void *data,
                                                             CUpointer_attribute attribute,
                                                             CUdeviceptr ptr);
typedef CUresult(CUDAAPI *dmem__pfn_cuPointerGetAttributes_t)(unsigned int num_attributes,
                                                              CUpointer_attribute *attributes,
                                                              void **data, CUdeviceptr ptr);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemGetAddressRange_t)(CUdeviceptr *base, size_t *size,
                                                            CUdeviceptr ptr);
typedef CUresult(CUDAAPI *dmem__pfn_cuIpcGetMemHandle_t)(CUipcMemHandle *handle,
                                                         CUdeviceptr ptr);
/* Virtual memory management (the backend's vmm ops) */
typedef CUresult(CUDAAPI *dmem__pfn_cuMemAddressReserve_t)(CUdeviceptr *ptr, size_t size,
                                                           size_t alignment, CUdeviceptr addr,
                                                           unsigned long long flags);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemAddressFree_t)(CUdeviceptr ptr, size_t size);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemCreate_t)(CUmemGenericAllocationHandle *handle,
                                                   size_t size, const CUmemAllocationProp *prop,
                                                   unsigned long long flags);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemRelease_t)(CUmemGenericAllocationHandle handle);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemMap_t)(CUdeviceptr ptr, size_t size, size_t offset,
                                                CUmemGenericAllocationHandle handle,
                                                unsigned long long flags);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemUnmap_t)(CUdeviceptr ptr, size_t size);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemSetAccess_t)(CUdeviceptr ptr, size_t size,
                                                      const CUmemAccessDesc *desc, size_t count);
typedef CUresult(CUDAAPI *dmem__pfn_cuMemGetAllocationGranularity_t)(
    size_t *granularity, const CUmemAllocationProp *prop,
    CUmemAllocationGranularity_flags option);

/* Filled once by dmem__backend_cuda_create, read-only afterwards (so any
 * thread may read it without synchronisation). Every pointer is non-NULL. */
struct dmem__cuda_driver {
  int device;          /* CUDA device ordinal of the backend */
  int driver_version;  /* cudaDriverGetVersion, e.g. 12080 */
  CUcontext context;   /* the device's primary context */
  dmem__pfn_cuGetErrorName_t get_error_name;
  dmem__pfn_cuGetErrorString_t get_error_string;
  dmem__pfn_cuCtxGetCurrent_t ctx_get_current;
  dmem__pfn_cuCtxSetCurrent_t ctx_set_current;
  dmem__pfn_cuCtxGetDevice_t ctx_get_device;
  dmem__pfn_cuPointerGetAttribute_t pointer_get_attribute;
  dmem__pfn_cuPointerGetAttributes_t pointer_get_attributes;
  dmem__pfn_cuMemGetAddressRange_t mem_get_address_range;
  dmem__pfn_cuIpcGetMemHandle_t ipc_get_mem_handle;
  dmem__pfn_cuMemAddressReserve_t mem_address_reserve;
  dmem__pfn_cuMemAddressFree_t mem_address_free;
  dmem__pfn_cuMemCreate_t mem_create;
  dmem__pfn_cuMemRelease_t mem_release;
  dmem__pfn_cuMemMap_t mem_map;
  dmem__pfn_cuMemUnmap_t mem_unmap;
  dmem__pfn_cuMemSetAccess_t mem_set_access;
  dmem__pfn_cuMemGetAllocationGranularity_t mem_get_allocation_granularity;
};

/* Map a Driver API result to a dmem status and record the detail
 * ("call: CUDA_ERROR_X (message)"), exactly as the backend does for its own
 * Runtime API calls: sticky context errors give DMEM_ERR_DEVICE_FATAL and
 * mark the backend fatal. `r` must not be CUDA_SUCCESS; `be` must be a CUDA
 * backend. Thread-safe. */
dmem_status_t dmem__cuda_driver_error(dmem__backend_t *be, CUresult r, const char *call);
#endif /* DMEM_HAVE_CUDA */

/* The Driver API table of a CUDA backend; NULL when `be` is NULL or not the
 * CUDA backend (be->kind != DMEM_BACKEND_CUDA). Thread-safe. Driver calls
 * made through it act on the calling thread's current context: call
 * dmem__cuda_make_current first. */
const dmem__cuda_driver_t *dmem__cuda_driver(dmem__backend_t *be);

/* Whether the backend has seen a sticky context error (it then refuses every
 * call with DMEM_ERR_DEVICE_FATAL, frees are no-ops). 0 for other backends.
 * Thread-safe. */
int dmem__backend_cuda_is_fatal(dmem__backend_t *be);

/* Make the backend's primary context current on the calling thread and leave
 * it current (the backend's own functions restore the caller's context when
 * they return; code that launches work itself, e.g. around a user launch
 * function, calls this first).
 * Returns DMEM_OK; DMEM_ERR_NO_DEVICE (not a CUDA backend, or built without
 * CUDA); DMEM_ERR_DEVICE; DMEM_ERR_DEVICE_FATAL. Thread-safe. */
dmem_status_t dmem__cuda_make_current(dmem__backend_t *be);

#endif /* DMEM_CUDA_DRIVER_H */
