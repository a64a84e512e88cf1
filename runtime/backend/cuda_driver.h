/*
 * runtime/backend/cuda_driver.h - the CUDA backend's Driver API table (error
 * names, contexts, IPC handles), filled and used by runtime/backend/cuda.c.
 *
 * Nothing links libcuda: the Driver API functions are looked up once, at
 * dmem__backend_cuda_create, through cudaGetDriverEntryPointByVersion (ABI of
 * CUDA 12.0), so the same binary starts on machines without a driver.
 *
 * In builds without DMEM_HAVE_CUDA the table is an incomplete type.
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
  CUcontext context;   /* the device's primary context */
  dmem__pfn_cuGetErrorName_t get_error_name;
  dmem__pfn_cuGetErrorString_t get_error_string;
  dmem__pfn_cuCtxGetCurrent_t ctx_get_current;
  dmem__pfn_cuCtxSetCurrent_t ctx_set_current;
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

#endif /* DMEM_HAVE_CUDA */

#endif /* DMEM_CUDA_DRIVER_H */
