/*
 * bench/bench_alloc_rmm.h - the RMM resources of bench_alloc, behind a C
 * interface (bench_alloc_rmm.cpp, C++17, built only when RMM is found:
 * DMEM_BENCH_HAVE_RMM).
 *
 * Every function prints the error and exits with status 1 when RMM or CUDA
 * throws; none returns a failure.
 */
#ifndef DMEM_BENCH_ALLOC_RMM_H
#define DMEM_BENCH_ALLOC_RMM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** rmm::mr::pool_memory_resource over rmm::mr::cuda_memory_resource, with an
 *  initial pool of `initial_bytes` (a multiple of 256) taken at once. */
void *bench_rmm_pool_create(size_t initial_bytes);
void *bench_rmm_pool_alloc(void *mr, size_t n, void *stream);
void bench_rmm_pool_free(void *mr, void *p, size_t n, void *stream);
void bench_rmm_pool_destroy(void *mr);

/** rmm::mr::arena_memory_resource over rmm::mr::cuda_memory_resource, with a
 *  global arena of `arena_bytes`. */
void *bench_rmm_arena_create(size_t arena_bytes);
void *bench_rmm_arena_alloc(void *mr, size_t n, void *stream);
void bench_rmm_arena_free(void *mr, void *p, size_t n, void *stream);
void bench_rmm_arena_destroy(void *mr);

/** A resource called through an rmm::device_async_resource_ref (as RMM's
 *  users call the current device resource): over dmem::rmm_resource of the
 *  runtime `rt` (a dmem_runtime_t *), or over the pool of
 *  bench_rmm_pool_create. Destroying it leaves the pool and the runtime. */
void *bench_rmm_dmem_ref_create(void *rt);
void *bench_rmm_pool_ref_create(void *pool);
void *bench_rmm_ref_alloc(void *ref, size_t n, void *stream);
void bench_rmm_ref_free(void *ref, void *p, size_t n, void *stream);
void bench_rmm_ref_destroy(void *ref);

/** RMM's version string, e.g. "26.10.0". */
const char *bench_rmm_version(void);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_BENCH_ALLOC_RMM_H */
