/*
 * bench/bench_alloc_rmm.cpp - the RMM side of bench_alloc (C++17): a pool
 * and an arena memory resource over cuda_memory_resource, each called
 * directly (no type erasure on the alloc/free path), stream-ordered on the
 * caller's stream through cuda::stream_ref (RMM 26.10 deprecates
 * rmm::cuda_stream_view in its favour; the view only wraps one).
 *
 * Any exception prints its message and exits with status 1.
 */
#include "bench_alloc_rmm.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>

#include <cuda_runtime_api.h>

#include <cuda/stream_ref>
#include <rmm/aligned.hpp>
#include <rmm/mr/arena_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>
#include <rmm/resource_ref.hpp>
#include <rmm/version_config.hpp>

#include <dmem/rmm.hpp>

namespace {

[[noreturn]] void die(const char *what, const std::exception &e) {
  std::fprintf(stderr, "bench_alloc: RMM %s: %s\n", what, e.what());
  std::exit(1);
}

cuda::stream_ref stream_of(void *stream) {
  return cuda::stream_ref{static_cast<cudaStream_t>(stream)};
}

constexpr std::size_t align = rmm::CUDA_ALLOCATION_ALIGNMENT;

template <class MR>
void *mr_create(const char *what, std::size_t bytes) {
  try {
    return new MR(rmm::mr::cuda_memory_resource{}, bytes);
  } catch (const std::exception &e) {
    die(what, e);
  }
}

template <class MR>
void *mr_alloc(void *mr, std::size_t n, void *stream, const char *what) {
  try {
    return static_cast<MR *>(mr)->allocate(stream_of(stream), n, align);
  } catch (const std::exception &e) {
    die(what, e);
  }
}

template <class MR>
void mr_release(void *mr, void *p, std::size_t n, void *stream) {
  static_cast<MR *>(mr)->deallocate(stream_of(stream), p, n, align); /* noexcept */
}

template <class MR>
void mr_destroy(void *mr, const char *what) {
  try {
    delete static_cast<MR *>(mr);
  } catch (const std::exception &e) {
    die(what, e);
  }
}

using pool_mr = rmm::mr::pool_memory_resource;
using arena_mr = rmm::mr::arena_memory_resource;

/* A ref and, for dmem, the resource it refers to. */
struct ref_holder {
  std::optional<dmem::rmm_resource> dmem;
  std::optional<rmm::device_async_resource_ref> ref;
};

}  // namespace

extern "C" {

void *bench_rmm_pool_create(size_t initial_bytes) {
  return mr_create<pool_mr>("pool_memory_resource", initial_bytes);
}
void *bench_rmm_pool_alloc(void *mr, size_t n, void *stream) {
  return mr_alloc<pool_mr>(mr, n, stream, "pool allocate");
}
void bench_rmm_pool_free(void *mr, void *p, size_t n, void *stream) {
  mr_release<pool_mr>(mr, p, n, stream);
}
void bench_rmm_pool_destroy(void *mr) { mr_destroy<pool_mr>(mr, "pool destroy"); }

void *bench_rmm_arena_create(size_t arena_bytes) {
  return mr_create<arena_mr>("arena_memory_resource", arena_bytes);
}
void *bench_rmm_arena_alloc(void *mr, size_t n, void *stream) {
  return mr_alloc<arena_mr>(mr, n, stream, "arena allocate");
}
void bench_rmm_arena_free(void *mr, void *p, size_t n, void *stream) {
  mr_release<arena_mr>(mr, p, n, stream);
}
void bench_rmm_arena_destroy(void *mr) { mr_destroy<arena_mr>(mr, "arena destroy"); }

void *bench_rmm_dmem_ref_create(void *rt) {
  try {
    auto *h = new ref_holder;
    h->dmem.emplace(static_cast<dmem_runtime_t *>(rt));
    h->ref.emplace(*h->dmem);
    return h;
  } catch (const std::exception &e) {
    die("dmem::rmm_resource", e);
  }
}
void *bench_rmm_pool_ref_create(void *pool) {
  auto *h = new ref_holder;
  h->ref.emplace(*static_cast<pool_mr *>(pool));
  return h;
}
void *bench_rmm_ref_alloc(void *ref, size_t n, void *stream) {
  try {
    return static_cast<ref_holder *>(ref)->ref->allocate(stream_of(stream), n, align);
  } catch (const std::exception &e) {
    die("allocate through a resource_ref", e);
  }
}
void bench_rmm_ref_free(void *ref, void *p, size_t n, void *stream) {
  static_cast<ref_holder *>(ref)->ref->deallocate(stream_of(stream), p, n, align);
}
void bench_rmm_ref_destroy(void *ref) { delete static_cast<ref_holder *>(ref); }

const char *bench_rmm_version(void) { return RMM_VERSION; }

}  // extern "C"
