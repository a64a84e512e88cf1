/*
 * dmem/rmm.hpp - dmem as an RMM device memory resource (C++17, RMM >= 26.06).
 *
 *   #include <dmem/rmm.hpp>
 *   dmem_runtime_t *rt;
 *   dmem_runtime_default(0, &rt);                  // or a runtime of your own
 *   dmem::rmm_resource mr{rt};
 *   rmm::mr::set_current_device_resource(mr);      // RMM stores a copy
 *   rmm::device_buffer b{1 << 20, stream};         // a raw allocation of rt
 *
 * dmem::rmm_resource satisfies CCCL's cuda::mr::resource_with<...,
 * cuda::mr::device_accessible> (RMM's resource concept since 26.06): each
 * allocation is a raw allocation of the runtime (dmem_device_malloc), made
 * for the caller's stream and freed in that stream's order
 * (dmem_device_free). It is never spilled and counts against the runtime's
 * device limit; when the limit or the device is full, unlocked spillable
 * buffers of the runtime are spilled to make room, as for any raw
 * allocation. No allocation is cached here: dmem's own pool is the cache.
 *
 * The resource is a plain value (the runtime's address): copies compare
 * equal and may free each other's allocations. It does not own the
 * runtime, which must outlive every allocation made through it (a default
 * runtime, dmem_runtime_default, lives until the process exits).
 *
 * Header only, over dmem's C API; it needs RMM's headers (its CCCL and
 * <rmm/error.hpp>: link librmm) and the CUDA runtime's headers. It is
 * meant for the CUDA backend, where a stream is a cudaStream_t; on the host
 * backend only the default stream (cudaStream_t{}) may be passed, as
 * tests/test_rmm.cpp does.
 *
 * Streams: dmem's pool may, later, record an event on the stream a block
 * was last freed on (when another stream wants the block). Before
 * destroying a stream it passed here, a program calls
 * dmem_stream_forget(rt, stream) (while no other call passes that stream);
 * otherwise, when that record fails, the blocks stay unused (quarantined)
 * until the runtime is destroyed. Streams that live as long as the program
 * (the default streams, RMM's cuda_stream_pool) need nothing.
 *
 * Thread safety: every member function may be called from any thread at
 * any time, as dmem's calls can.
 */
#ifndef DMEM_RMM_HPP
#define DMEM_RMM_HPP

#include <cstddef>
#include <stdexcept>
#include <string>

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <rmm/error.hpp>

#include "dmem/device.h"
#include "dmem/status.h"
#include "dmem/stream.h"

namespace dmem {

class rmm_resource {
 public:
  /** The alignment of every block (dmem's pool gives 256-byte blocks). */
  static constexpr std::size_t alignment = 256;

  /**
   * A resource over `rt`. Throws std::invalid_argument when rt is NULL.
   */
  explicit rmm_resource(dmem_runtime_t *rt) : rt_(rt) {
    if (!rt) throw std::invalid_argument("dmem::rmm_resource: the runtime is NULL");
  }

  /** The runtime allocations come from. */
  [[nodiscard]] dmem_runtime_t *runtime() const noexcept { return rt_; }

  /**
   * `bytes` of device memory usable at once by work enqueued on `stream`
   * after this call (dmem_device_malloc; 0 bytes gives nullptr, as RMM's
   * resources do). `align_to` must be a power of two no larger than 256.
   *
   * Throws rmm::out_of_memory (a std::bad_alloc) when nothing more could be
   * spilled or freed, rmm::bad_alloc for any other failure of dmem (a CUDA
   * error, the controller's callback failing, bookkeeping memory), and
   * std::invalid_argument for an alignment it cannot give; the message names
   * the dmem status and dmem_last_error_detail(). Nothing is allocated
   * then.
   */
  [[nodiscard]] void *allocate(cuda::stream_ref stream, std::size_t bytes,
                               std::size_t align_to = alignment) {
    check_alignment(align_to);
    if (bytes == 0) return nullptr;
    void *p = nullptr;
    dmem_status_t st = dmem_device_malloc(rt_, bytes, stream_of(stream), &p);
    if (st != DMEM_OK) fail("allocate", bytes, st);
    return p;
  }

  /**
   * Free `ptr` (from allocate or allocate_sync of an equal resource, with
   * the same `bytes`) whose last use was enqueued on `stream`: reusable at
   * once in that stream's order, by other streams after an event. nullptr
   * does nothing. It cannot throw: a pointer dmem does not know (not from
   * this runtime, freed twice) changes nothing, and dmem_last_error_detail()
   * of the calling thread says so afterwards.
   */
  void deallocate(cuda::stream_ref stream, void *ptr, std::size_t bytes,
                  std::size_t align_to = alignment) noexcept {
    (void)bytes;
    (void)align_to;
    if (ptr) (void)dmem_device_free(rt_, ptr, stream_of(stream));
  }

  /**
   * As allocate on the default stream, then waits for the default stream
   * (dmem_stream_synchronize): the memory is usable by any stream.
   */
  [[nodiscard]] void *allocate_sync(std::size_t bytes, std::size_t align_to = alignment) {
    void *p = allocate(cuda::stream_ref{cudaStream_t{}}, bytes, align_to);
    if (p) {
      dmem_status_t st = dmem_stream_synchronize(rt_, nullptr);
      if (st != DMEM_OK) {
        deallocate(cuda::stream_ref{cudaStream_t{}}, p, bytes, align_to);
        fail("allocate_sync", bytes, st);
      }
    }
    return p;
  }

  /**
   * Free `ptr`, whose every use has completed (the caller synchronised):
   * freed on the default stream, reusable at once. Cannot throw.
   */
  void deallocate_sync(void *ptr, std::size_t bytes, std::size_t align_to = alignment) noexcept {
    deallocate(cuda::stream_ref{cudaStream_t{}}, ptr, bytes, align_to);
  }

  /** Equal when over the same runtime (each may free the other's memory). */
  [[nodiscard]] bool operator==(rmm_resource const &o) const noexcept { return rt_ == o.rt_; }
  [[nodiscard]] bool operator!=(rmm_resource const &o) const noexcept { return rt_ != o.rt_; }

  /** Its memory is device memory (cuda::mr::device_accessible). */
  friend void get_property(rmm_resource const &, cuda::mr::device_accessible) noexcept {}

 private:
  static dmem_stream_t stream_of(cuda::stream_ref s) noexcept {
    return reinterpret_cast<dmem_stream_t>(s.get());
  }

  static void check_alignment(std::size_t a) {
    if (a == 0 || (a & (a - 1)) != 0 || a > alignment)
      throw std::invalid_argument("dmem::rmm_resource: alignment " + std::to_string(a) +
                                  " is not a power of two up to 256");
  }

  [[noreturn]] static void fail(const char *what, std::size_t bytes, dmem_status_t st) {
    std::string msg = std::string("dmem::rmm_resource::") + what + "(" + std::to_string(bytes) +
                      " bytes): " + dmem_status_name(st) + ": " + dmem_last_error_detail();
    if (st == DMEM_ERR_OUT_OF_MEMORY) throw rmm::out_of_memory(msg);
    throw rmm::bad_alloc(msg);
  }

  dmem_runtime_t *rt_;
};

static_assert(cuda::mr::resource_with<rmm_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<rmm_resource, cuda::mr::device_accessible>);

}  // namespace dmem

#endif /* DMEM_RMM_HPP */
