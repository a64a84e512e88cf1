/* dmem::rmm_resource (include/dmem/rmm.hpp): dmem as an RMM device memory
 * resource, used as RMM uses it (through rmm::device_async_resource_ref
 * and cuda::mr::any_resource, RMM's per-device map's type). Built only when
 * RMM's headers are found (cmake/DmemRmm.cmake). Backend-neutral: raw
 * memory is written and read with dmem_stream_copy; run again as cuda.rmm.* on a
 * GPU. */
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda/memory_resource>
#include <rmm/error.hpp>
#include <rmm/resource_ref.hpp>

#include "dmem/rmm.hpp"

#include "check.h"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

dmem_stats_t stats_of(dmem_runtime_t *rt) {
  dmem_stats_t s;
  std::memset(&s, 0, sizeof s);
  if (dmem_stats(rt, &s) != DMEM_OK) std::abort();
  return s;
}

/* Write the pattern `seed` into raw memory p (default stream), then read it
 * back: the bytes that differ. */
std::size_t raw_roundtrip(dmem_runtime_t *rt, void *p, std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> in(n), out(n);
  check_fill(in.data(), n, seed);
  if (dmem_stream_copy(rt, p, in.data(), n, nullptr) != DMEM_OK ||
      dmem_stream_copy(rt, out.data(), p, n, nullptr) != DMEM_OK ||
      dmem_stream_synchronize(rt, nullptr) != DMEM_OK)
    std::abort();
  return check_verify(out.data(), n, seed);
}

cuda::stream_ref default_stream() { return cuda::stream_ref{cudaStream_t{}}; }

}  // namespace

static_assert(cuda::mr::resource_with<dmem::rmm_resource, cuda::mr::device_accessible>);
static_assert(!cuda::mr::resource_with<dmem::rmm_resource, cuda::mr::host_accessible>);

TEST_CASE(resource_equality_and_null_runtime) {
  dmem_runtime_t *a = check_runtime(4 * MiB), *b = check_runtime(4 * MiB);
  dmem::rmm_resource ra{a}, ra2{a}, rb{b};
  CHECK_TRUE(ra == ra2);
  CHECK_TRUE(!(ra != ra2));
  CHECK_TRUE(ra != rb);
  CHECK_TRUE(ra.runtime() == a);
  /* refs compare through the resources */
  rmm::device_async_resource_ref ref_a{ra}, ref_a2{ra2}, ref_b{rb};
  CHECK_TRUE(ref_a == ref_a2);
  CHECK_TRUE(ref_a != ref_b);
  int threw = 0;
  try {
    dmem::rmm_resource bad{nullptr};
    (void)bad;
  } catch (const std::invalid_argument &) {
    threw = 1;
  }
  CHECK_EQ(threw, 1);
  dmem_runtime_destroy(a);
  dmem_runtime_destroy(b);
}

TEST_CASE(allocations_are_raw_bytes_of_the_runtime) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem::rmm_resource mr{rt};
  rmm::device_async_resource_ref ref{mr};
  void *p = ref.allocate(default_stream(), 3 * MiB, 256);
  REQUIRE_TRUE(p != nullptr);
  CHECK_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0);
  CHECK_GE(stats_of(rt).raw_used, 3 * MiB);
  CHECK_UEQ(raw_roundtrip(rt, p, 3 * MiB, 7), 0);
  ref.deallocate(default_stream(), p, 3 * MiB, 256);
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  /* zero bytes: nullptr, nothing counted; freeing nullptr does nothing */
  CHECK_TRUE(ref.allocate(default_stream(), 0, 256) == nullptr);
  ref.deallocate(default_stream(), nullptr, 0, 256);
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  /* through any_resource, the type RMM's per-device map keeps */
  cuda::mr::any_resource<cuda::mr::device_accessible> any{mr};
  void *q = any.allocate(default_stream(), MiB, 256);
  REQUIRE_TRUE(q != nullptr);
  CHECK_GE(stats_of(rt).raw_used, MiB);
  any.deallocate(default_stream(), q, MiB, 256);
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(sync_variants_allocate_and_free) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem::rmm_resource mr{rt};
  void *p = mr.allocate_sync(MiB);
  REQUIRE_TRUE(p != nullptr);
  CHECK_GE(stats_of(rt).raw_used, MiB);
  CHECK_UEQ(raw_roundtrip(rt, p, MiB, 3), 0);
  mr.deallocate_sync(p, MiB);
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(bad_alignment_and_bad_free_change_nothing) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem::rmm_resource mr{rt};
  for (std::size_t a : {std::size_t{0}, std::size_t{3}, std::size_t{512}, std::size_t{4096}}) {
    int threw = 0;
    try {
      (void)mr.allocate(default_stream(), MiB, a);
    } catch (const std::invalid_argument &e) {
      threw = std::strstr(e.what(), "alignment") != nullptr;
    }
    CHECK_EQ(threw, 1);
  }
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  /* smaller alignments than 256 are given (256 satisfies them) */
  void *p = mr.allocate(default_stream(), 100, 16);
  REQUIRE_TRUE(p != nullptr);
  std::size_t used = stats_of(rt).raw_used;
  CHECK_GE(used, 100);
  /* a pointer dmem did not give, and a pointer inside the block: no-ops */
  int local = 0;
  mr.deallocate(default_stream(), &local, sizeof local);
  mr.deallocate(default_stream(), static_cast<char *>(p) + 64, 36);
  CHECK_UEQ(stats_of(rt).raw_used, used);
  CHECK_TRUE(std::strlen(dmem_last_error_detail()) > 0);
  mr.deallocate(default_stream(), p, 100, 16);
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  /* and again: a double free changes nothing either */
  mr.deallocate(default_stream(), p, 100, 16);
  CHECK_UEQ(stats_of(rt).raw_used, 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(allocation_spills_buffers_whose_bytes_survive) {
  dmem_runtime_t *rt = check_runtime(8 * MiB);
  dmem_handle_t h[8];
  for (int i = 0; i < 8; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    check_put(rt, h[i], MiB, 100 + (std::uint64_t)i);
  }
  dmem::rmm_resource mr{rt};
  rmm::device_async_resource_ref ref{mr};
  void *p = ref.allocate(default_stream(), 3 * MiB, 256);
  REQUIRE_TRUE(p != nullptr);
  CHECK_UEQ(raw_roundtrip(rt, p, 3 * MiB, 11), 0);
  dmem_stats_t s = stats_of(rt);
  CHECK_GE(s.spill_count, 3);
  CHECK_LE(s.device_used, 8 * MiB);
  /* the spilled buffers come back whole (spilling others, never p) */
  for (int i = 0; i < 8; i++) CHECK_UEQ(check_bad_bytes(rt, h[i], MiB, 100 + (std::uint64_t)i), 0);
  CHECK_UEQ(raw_roundtrip(rt, p, 3 * MiB, 12), 0);
  ref.deallocate(default_stream(), p, 3 * MiB, 256);
  for (int i = 0; i < 8; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_UEQ(stats_of(rt).device_used, 0);
  dmem_runtime_destroy(rt);
}

TEST_CASE(out_of_memory_is_rmm_out_of_memory) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  dmem_handle_t h[3];
  void *ptrs[3];
  for (int i = 0; i < 3; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h[i]));
    REQUIRE_OK(dmem_buffer_lock(rt, h[i], nullptr, &ptrs[i])); /* nothing can be spilled */
  }
  dmem::rmm_resource mr{rt};
  rmm::device_async_resource_ref ref{mr};
  std::size_t before = stats_of(rt).raw_used;
  std::string what;
  int caught = 0;
  try {
    (void)ref.allocate(default_stream(), 2 * MiB, 256);
  } catch (const rmm::out_of_memory &e) {
    caught = 1;
    what = e.what();
  } catch (const std::exception &e) {
    caught = 2;
    what = e.what();
  }
  CHECK_EQ(caught, 1);
  CHECK_TRUE(what.find("DMEM_ERR_OUT_OF_MEMORY") != std::string::npos);
  CHECK_UEQ(stats_of(rt).raw_used, before);
  /* RMM's Python and adaptors catch it as a std::bad_alloc */
  caught = 0;
  try {
    (void)mr.allocate_sync(2 * MiB);
  } catch (const std::bad_alloc &) {
    caught = 1;
  }
  CHECK_EQ(caught, 1);
  /* once a buffer is unlocked it spills and the allocation fits */
  CHECK_OK(dmem_buffer_unlock(rt, h[0]));
  CHECK_OK(dmem_buffer_unlock(rt, h[1]));
  void *p = ref.allocate(default_stream(), 2 * MiB, 256);
  CHECK_TRUE(p != nullptr);
  ref.deallocate(default_stream(), p, 2 * MiB, 256);
  CHECK_OK(dmem_buffer_unlock(rt, h[2]));
  for (int i = 0; i < 3; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  dmem_runtime_destroy(rt);
}
