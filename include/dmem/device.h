/*
 * dmem/device.h - raw device memory from dmem's pool, for allocator hooks
 * (Numba's EMM plugin, CuPy's allocator, PyTorch's pluggable allocator):
 * plain pointers that are never spilled but count against the same device
 * limit as spillable buffers, so one runtime accounts for every byte.
 *
 * Both kinds of memory come from one stream-ordered pool: large slabs taken
 * with cudaMalloc (so CUDA IPC works on them), suballocated with size
 * classes for small blocks and best fit for large ones. A block freed on
 * stream S is reused at once by S and by other streams only after an event
 * recorded at the free (the pool never synchronises the host).
 *
 * dmem_device_malloc_dedicated gives instead a block that is a whole
 * cudaMalloc of its own, for libraries that ask the driver about an
 * allocation (cuMemGetAddressRange, or a CUDA IPC handle opened at offset 0
 * by a process that was not told an offset): Numba's arrays. Freed dedicated
 * blocks are cached by size in stream order, so they cost a cudaMalloc only
 * the first time a size is seen.
 */
#ifndef DMEM_DEVICE_H
#define DMEM_DEVICE_H

#include "dmem/config.h"
#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Size of the buffer dmem_device_ipc_handle writes (a CUipcMemHandle). */
#define DMEM_IPC_HANDLE_SIZE 64

/**
 * Allocate `size` bytes of device memory for use in stream order on
 * `stream` (NULL: the default stream). The memory is never spilled; it
 * counts against the device limit, and when the limit or the device is full
 * unlocked spillable buffers are spilled to make room (as for dmem_buffer_alloc).
 * If the block was last used by another stream, `stream` is made to wait for
 * that use (no host synchronisation): work enqueued on `stream` after this
 * call may use the memory at once. Blocks are 256-byte aligned.
 *
 * Thread-safe.
 * @return DMEM_OK (*ptr_out written);
 *         DMEM_ERR_INVALID_ARGUMENT  rt or ptr_out NULL, size 0;
 *         DMEM_ERR_OUT_OF_MEMORY     nothing more could be spilled or freed
 *                                    (as for dmem_buffer_alloc: from a controller
 *                                    callback at once when only the caller's
 *                                    own move could make room);
 *         DMEM_ERR_CALLBACK          the controller's select_victims failed;
 *         DMEM_ERR_DEVICE, DMEM_ERR_DEVICE_FATAL  a CUDA error (sticky for
 *                                    the fatal kind);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY bookkeeping could not grow.
 */
DMEM_API dmem_status_t dmem_device_malloc(dmem_runtime_t *rt, size_t size, dmem_stream_t stream,
                                          void **ptr_out);

/**
 * As dmem_device_malloc, but the memory is a dedicated block: a backend
 * allocation (cudaMalloc) that begins at *ptr_out and holds nothing else.
 * cuMemGetAddressRange on the pointer gives the block (its size rounded up
 * to dmem's size classes, at most 1/4 more for sizes up to 1 MiB, 256 bytes
 * above), and dmem_device_ipc_handle gives offset 0. The first allocation of a size
 * costs a cudaMalloc; freed blocks are cached (at most an eighth of the
 * limit, in stream order as pool blocks are) and reused by later requests
 * of the same rounded size. Cached blocks are given back under memory
 * pressure and by dmem_device_trim. Freed with dmem_device_free.
 *
 * Thread-safe.
 * @return as dmem_device_malloc.
 */
DMEM_API dmem_status_t dmem_device_malloc_dedicated(dmem_runtime_t *rt, size_t size,
                                                    dmem_stream_t stream, void **ptr_out);

/**
 * Free memory from dmem_device_malloc or dmem_device_malloc_dedicated whose
 * last use was enqueued on
 * `stream` before this call. The block is reusable at once in `stream`'s
 * order, and by other streams after an event recorded at the free. ptr NULL
 * is a no-op (DMEM_OK).
 *
 * Thread-safe.
 * @return DMEM_OK;
 *         DMEM_ERR_INVALID_ARGUMENT  rt NULL, or ptr is not a live allocation
 *                                    of dmem_device_malloc of this runtime
 *                                    (an unknown pointer, a pointer inside a
 *                                    block, a double free); nothing changes.
 */
DMEM_API dmem_status_t dmem_device_free(dmem_runtime_t *rt, void *ptr, dmem_stream_t stream);

/**
 * Turn a raw allocation into a spillable buffer in place, without a copy:
 * `ptr` (the start of a live block of dmem_device_malloc of this runtime,
 * whose last use so far was enqueued on `stream`) stops being a raw
 * allocation and becomes the device memory of a new buffer of the block's
 * size (the size asked of dmem_device_malloc), at the same address with the
 * same bytes. The buffer comes back locked once on `stream`, as
 * dmem_buffer_lock(rt, *h_out, stream, &p) would leave it (p == ptr): it cannot
 * move until the caller's dmem_buffer_unlock (which, as for every lock, must come
 * after the device work that uses the address has completed). From then on
 * it is an ordinary buffer: spilled and brought back (to another address)
 * like any, freed with dmem_buffer_free (dmem_device_free(ptr) is refused). Lockers
 * on other streams, spills and the final release are ordered after the
 * work enqueued on `stream` before this call (an event recorded there; no
 * host synchronisation). The bytes move in the statistics from raw_used to
 * the buffers' (buffer_count, device_locked while locked); device_used does
 * not change. The controller gets DMEM_EVENT_ALLOC for the new buffer.
 *
 * For allocator hooks whose blocks are later kept as data (the dmem.cupy
 * allocator under Dask): the hook's owner of the block unlocks the buffer
 * where it would have freed the block.
 *
 * Thread-safe (one of concurrent adopts or frees of the same ptr wins; the
 * others get DMEM_ERR_INVALID_ARGUMENT).
 * @return DMEM_OK (*h_out written);
 *         DMEM_ERR_INVALID_ARGUMENT  rt or h_out NULL; ptr not the start of
 *                                    a live raw allocation of this runtime
 *                                    (NULL, unknown, inside a block, freed,
 *                                    adopted already); ptr a dedicated block
 *                                    (dmem_device_malloc_dedicated: those
 *                                    cannot be adopted, the detail says so;
 *                                    copy the bytes into a buffer instead);
 *         DMEM_ERR_HOST_OUT_OF_MEMORY the handle table could not grow or no
 *                                    event could be made;
 *         DMEM_ERR_DEVICE, DMEM_ERR_DEVICE_FATAL  recording the event failed
 *                                    (the fatal kind also once the runtime
 *                                    refuses work after a fatal error);
 *         DMEM_ERR_FORKED            in a forked child (see dmem/runtime.h).
 *         On every error the raw allocation stays as it was.
 */
DMEM_API dmem_status_t dmem_device_adopt(dmem_runtime_t *rt, void *ptr, dmem_stream_t stream,
                                         dmem_handle_t *h_out);

/**
 * Forget `stream` before the caller destroys it itself: a stream that was
 * passed to dmem_device_malloc / dmem_device_free (or dmem_buffer_lock,
 * dmem_launch_async ...) may still be named by the pool as the last user of
 * free blocks, and the pool records events on it when another stream wants
 * them. This records what is pending on it now; afterwards the stream is not
 * used again. Streams destroyed with dmem_stream_destroy are forgotten there.
 * stream NULL (the default stream) is never forgotten (no-op). Must not run
 * while other calls pass the same stream.
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL).
 */
DMEM_API dmem_status_t dmem_stream_forget(dmem_runtime_t *rt, dmem_stream_t stream);

/**
 * Memory as an allocator hook sees it (Numba's get_memory_info).
 *  *total_out  the device limit of the runtime (bytes);
 *  *free_out   what an allocation could obtain now: the bytes under the
 *              limit not used by live buffers or raw allocations, capped by
 *              what the device itself can still give (the pool's free
 *              ranges plus the device's free memory), plus the bytes of
 *              resident buffers that could be spilled now (unlocked, not
 *              pinned). It may overstate what one allocation gets when the
 *              free bytes are fragmented.
 * Either output may be NULL. Thread-safe; O(live buffers).
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_DEVICE;
 *         DMEM_ERR_DEVICE_FATAL (the device's context is lost).
 */
DMEM_API dmem_status_t dmem_device_memory_info(dmem_runtime_t *rt, size_t *free_out,
                                               size_t *total_out);

/**
 * The CUDA IPC handle (cuIpcGetMemHandle, DMEM_IPC_HANDLE_SIZE bytes) of the
 * pool slab or dedicated block that holds `ptr`, and ptr's offset in it:
 * another process opens the handle with cudaIpcOpenMemHandle and adds the
 * offset (0 at the start of a dedicated block). `ptr` is an allocation of
 * dmem_device_malloc or dmem_device_malloc_dedicated (or points inside
 * one); the handle stays valid while the allocation lives.
 *
 * Thread-safe.
 * @return DMEM_OK (both outputs written);
 *         DMEM_ERR_INVALID_ARGUMENT  NULL argument, or ptr in no slab of the
 *                                    runtime's pool (checked first);
 *         DMEM_ERR_NO_DEVICE         the host backend, which has no IPC;
 *         DMEM_ERR_DEVICE            the driver refused.
 */
DMEM_API dmem_status_t dmem_device_ipc_handle(dmem_runtime_t *rt, void *ptr, void *handle_out,
                                              size_t *offset_out);

/**
 * Give empty pool slabs and cached (freed) dedicated blocks back to the
 * device (cudaFree) until at most keep_bytes of each stay reserved. Slabs
 * holding any live block stay.
 * The pool also trims itself when the device runs out of memory. This call
 * may synchronise the device (cudaFree does): not for hot paths.
 *
 * Thread-safe.
 * @return DMEM_OK (*released_out, may be NULL, = bytes given back);
 *         DMEM_ERR_INVALID_ARGUMENT (rt NULL); DMEM_ERR_DEVICE;
 *         DMEM_ERR_DEVICE_FATAL (cudaFree reported a lost context; the slab
 *         stays with the pool until destroy).
 */
DMEM_API dmem_status_t dmem_device_trim(dmem_runtime_t *rt, size_t keep_bytes,
                                        size_t *released_out);

/**
 * Give wholly free chunks of the pinned host pool (the memory that holds
 * spilled bytes and staging; cudaMallocHost under CUDA) back until at most
 * keep_bytes stay reserved. Chunks holding any spilled bytes or staging
 * stay. Finished unspills are completed first, so their staging counts as
 * free. The pool also shrinks itself after 30 s without allocations
 * (keeping one chunk) and grows in the background before it runs dry.
 * cudaFreeHost may synchronise the device: not for hot paths.
 *
 * Thread-safe.
 * @return DMEM_OK (*released_out, may be NULL, = bytes given back);
 *         DMEM_ERR_INVALID_ARGUMENT (rt NULL).
 */
DMEM_API dmem_status_t dmem_host_trim(dmem_runtime_t *rt, size_t keep_bytes,
                                      size_t *released_out);

/**
 * The process-wide runtime of CUDA device `device`, created on first use
 * from the configuration given to dmem_runtime_default_configure, else from
 * the DMEM_* environment (dmem_config_init), with cfg.device = device.
 * Every consumer in a process that uses it (the PyTorch symbols below, the
 * Numba and CuPy hooks, dmem.default_runtime() in Python) shares one
 * accounting point. It lives until the process exits; never pass it to
 * dmem_runtime_destroy. In a child made by fork() the parent's default
 * runtimes are forgotten (not destroyed: their threads are not there) and
 * the child's first call creates its own.
 *
 * Thread-safe (the first calls race to create it; one wins).
 * @return DMEM_OK; DMEM_ERR_INVALID_ARGUMENT (rt_out NULL, device negative
 *         or >= 64); any status of dmem_runtime_create.
 */
DMEM_API dmem_status_t dmem_runtime_default(int device, dmem_runtime_t **rt_out);

/**
 * Set the configuration of the default runtimes created from now on (every
 * device; cfg->device is ignored: each gets its own ordinal). `cfg` comes
 * from dmem_config_init (so the DMEM_* environment still applies to fields
 * the caller leaves alone) and is copied, spill_dir included; NULL goes back
 * to the environment. Must come before the first dmem_runtime_default of
 * any device (dmem.configure() in Python calls it).
 *
 * Thread-safe.
 * @return DMEM_OK;
 *         DMEM_ERR_BUSY              a default runtime already exists (nothing
 *                                    changes);
 *         DMEM_ERR_INVALID_ARGUMENT  cfg->struct_size too small;
 *         DMEM_ERR_HOST_OUT_OF_MEMORY copying spill_dir failed.
 * Errors in the configuration itself surface at creation, from
 * dmem_runtime_default (as from dmem_runtime_create).
 */
DMEM_API dmem_status_t dmem_runtime_default_configure(const dmem_config_t *cfg);

/**
 * PyTorch's pluggable allocator interface
 * (torch.cuda.memory.CUDAPluggableAllocator(path, "dmem_torch_alloc",
 * "dmem_torch_free")): raw allocations of the default runtime of `device`.
 * `stream` is a cudaStream_t. dmem_torch_alloc returns NULL when the memory
 * cannot be had (PyTorch then raises its out-of-memory error); the detail is
 * in dmem_last_error_detail(). dmem_torch_free ignores `size` (dmem knows
 * it) and reports a bad pointer through the log. Thread-safe.
 */
DMEM_API void *dmem_torch_alloc(size_t size, int device, void *stream);
DMEM_API void dmem_torch_free(void *ptr, size_t size, int device, void *stream);

/* ---- Names before dmem_noun_verb (deprecated) ----------------------------------
 * Kept for one version: exported, same signature and behaviour as the
 * function named in DMEM_DEPRECATED_API (they call it); a call warns
 * (-Wdeprecated-declarations). See dmem/status.h. */
DMEM_DEPRECATED_API(dmem_device_ipc_handle)
dmem_status_t dmem_ipc_handle(dmem_runtime_t *rt, void *ptr, void *handle_out,
                              size_t *offset_out);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_DEVICE_H */
