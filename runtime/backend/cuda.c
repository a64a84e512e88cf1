/*
 * runtime/backend/cuda.c - the CUDA backend: struct dmem__backend over the
 * CUDA Runtime API (linked statically), plus a small Driver API table looked
 * up through cudaGetDriverEntryPointByVersion so that nothing links libcuda
 * and the same binary starts (and reports DMEM_ERR_NO_DEVICE) on machines
 * without a driver.
 *
 * Threads: every function may be called from any host thread. Each call makes
 * the backend's primary context current for its duration and puts the
 * caller's context back before returning, so the caller's own current device
 * is never changed behind its back (be->make_current binds it for good,
 * for code that launches work itself).
 *
 * Errors: one mapping (cuda_fail / cuda_cu_fail) records the detail
 * "call: cudaErrorX (message)" where the failure is detected. Sticky context
 * errors (illegal address, launch failure, ECC, ...) give
 * DMEM_ERR_DEVICE_FATAL and mark the backend fatal: from then on every call
 * is refused with DMEM_ERR_DEVICE_FATAL without touching CUDA, except the
 * frees and destroy, which become no-ops returning DMEM_OK (the context and
 * everything in it is lost anyway).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* MADV_HUGEPAGE, MAP_ANONYMOUS */
#endif
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/atomic.h"
#include "backend.h"
#include "cuda_driver.h"
#include "base/error.h"

#ifndef DMEM_HAVE_CUDA

/* ---- built without CUDA: the backend exists but never starts ------------ */

dmem_status_t dmem__backend_cuda_create(const dmem_config_t *cfg, dmem__backend_t **be_out) {
  (void)cfg;
  (void)be_out;
  return dmem__error(DMEM_ERR_NO_DEVICE, "CUDA backend: built without CUDA support");
}

int dmem__backend_cuda_available(void) {
  (void)dmem__error(DMEM_ERR_NO_DEVICE, "this build of dmem has no CUDA support");
  return 0;
}

#else /* DMEM_HAVE_CUDA */

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <sys/mman.h>

#if !defined(CUDART_VERSION) || CUDART_VERSION < 12000
#error "the dmem CUDA backend needs the CUDA 12.0+ toolkit (configure with -DDMEM_WITH_CUDA=OFF)"
#endif

/* The Driver API ABI we ask cudaGetDriverEntryPointByVersion for. */
#define CUDA_DRIVER_ABI 12000

typedef struct cuda_backend {
  dmem__backend_t base;     /* first member: the runtime only sees this */
  /* Error code (cudaError_t / CUresult: the sticky codes agree) of the first
   * sticky context error, 0 while healthy. Written once by cuda_mark_fatal
   * on whichever thread detects it; read by every call. The value is
   * self-contained (it publishes no other data), so relaxed loads suffice.
   * Just before drv, whose first fields (context, ctx_get_current) every
   * cuda_enter reads too, and just after base.make_current (its last
   * field): one line for the four (the backend is allocated on a line
   * boundary; the launch path's make_current pays for every line that the
   * driver's launch evicted). */
  _Atomic int fatal;
  dmem__cuda_driver_t drv;  /* filled by create, read-only afterwards */
  /* How host_alloc pins (DMEM_HOST_PIN_MALLOC_HOST or _REGISTER; AUTO
   * resolved at create), and the regions the register way mapped (host_free
   * needs their sizes). Few: the pinned pool's chunks of 64 MiB - 1 GiB. */
  dmem_host_pin_t pin;
  pthread_mutex_t reg_mu;
  struct pinned_region *regions; /* under reg_mu */
} cuda_backend_t;

/* The launch path's make_current reads base.make_current, fatal, and drv's
 * context and ctx_get_current: one line. */
_Static_assert(offsetof(cuda_backend_t, base.make_current) / 64 ==
                   (offsetof(cuda_backend_t, drv.ctx_get_current) + sizeof(void *) - 1) / 64,
               "make_current's fields left one line");

typedef struct pinned_region {
  struct pinned_region *next;
  void *base;
  size_t size;
} pinned_region_t;

/* The context binding of one backend call (see cuda_enter / cuda_leave). */
typedef struct cuda_scope {
  CUcontext saved;  /* the caller's context, put back by cuda_leave */
  bool switched;    /* whether cuda_enter changed the current context */
} cuda_scope_t;

static cuda_backend_t *cuda_of(dmem__backend_t *be) { return (cuda_backend_t *)be; }

/* ---- error mapping ---------------------------------------------------------- */

/* Runtime and Driver API codes agree on every value the classification below
 * names, so one function classifies both (and the fatal code can be printed
 * with cudaGetErrorName whichever API reported it). */
_Static_assert((int)cudaErrorMemoryAllocation == (int)CUDA_ERROR_OUT_OF_MEMORY, "code");
_Static_assert((int)cudaErrorInitializationError == (int)CUDA_ERROR_NOT_INITIALIZED, "code");
_Static_assert((int)cudaErrorStubLibrary == (int)CUDA_ERROR_STUB_LIBRARY, "code");
_Static_assert((int)cudaErrorDevicesUnavailable == (int)CUDA_ERROR_DEVICE_UNAVAILABLE, "code");
_Static_assert((int)cudaErrorNoDevice == (int)CUDA_ERROR_NO_DEVICE, "code");
_Static_assert((int)cudaErrorDeviceNotLicensed == (int)CUDA_ERROR_DEVICE_NOT_LICENSED, "code");
_Static_assert((int)cudaErrorSystemNotReady == (int)CUDA_ERROR_SYSTEM_NOT_READY, "code");
_Static_assert((int)cudaErrorSystemDriverMismatch == (int)CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "code");
_Static_assert((int)cudaErrorCompatNotSupportedOnDevice ==
                   (int)CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "code");
_Static_assert((int)cudaErrorECCUncorrectable == (int)CUDA_ERROR_ECC_UNCORRECTABLE, "code");
_Static_assert((int)cudaErrorNvlinkUncorrectable == (int)CUDA_ERROR_NVLINK_UNCORRECTABLE, "code");
_Static_assert((int)cudaErrorNotReady == (int)CUDA_ERROR_NOT_READY, "code");
_Static_assert((int)cudaErrorIllegalAddress == (int)CUDA_ERROR_ILLEGAL_ADDRESS, "code");
_Static_assert((int)cudaErrorLaunchTimeout == (int)CUDA_ERROR_LAUNCH_TIMEOUT, "code");
_Static_assert((int)cudaErrorContextIsDestroyed == (int)CUDA_ERROR_CONTEXT_IS_DESTROYED, "code");
_Static_assert((int)cudaErrorAssert == (int)CUDA_ERROR_ASSERT, "code");
_Static_assert((int)cudaErrorHardwareStackError == (int)CUDA_ERROR_HARDWARE_STACK_ERROR, "code");
_Static_assert((int)cudaErrorIllegalInstruction == (int)CUDA_ERROR_ILLEGAL_INSTRUCTION, "code");
_Static_assert((int)cudaErrorMisalignedAddress == (int)CUDA_ERROR_MISALIGNED_ADDRESS, "code");
_Static_assert((int)cudaErrorInvalidAddressSpace == (int)CUDA_ERROR_INVALID_ADDRESS_SPACE, "code");
_Static_assert((int)cudaErrorInvalidPc == (int)CUDA_ERROR_INVALID_PC, "code");
_Static_assert((int)cudaErrorLaunchFailure == (int)CUDA_ERROR_LAUNCH_FAILED, "code");
_Static_assert((int)cudaErrorMpsClientTerminated == (int)CUDA_ERROR_MPS_CLIENT_TERMINATED, "code");
_Static_assert((int)cudaErrorExternalDevice == (int)CUDA_ERROR_EXTERNAL_DEVICE, "code");

/* Codes newer than CUDA 12.0 headers, by value (same in both APIs). */
#define CUDA_CODE_CONTAINED 226           /* cudaErrorContained (12.4+) */
#define CUDA_CODE_TENSOR_MEMORY_LEAK 721  /* cudaErrorTensorMemoryLeak (12.8+) */

/* Whether `code` is a sticky context error: the context is unusable and
 * every later call in it fails the same way until the process restarts. */
static bool cuda_code_is_sticky(int code) {
  switch (code) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case CUDA_CODE_CONTAINED:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case CUDA_CODE_TENSOR_MEMORY_LEAK:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

/* The dmem status of a (runtime or driver) error code. */
static dmem_status_t cuda_code_status(int code) {
  if (cuda_code_is_sticky(code)) return DMEM_ERR_DEVICE_FATAL;
  switch (code) {
    case cudaErrorMemoryAllocation:
      return DMEM_ERR_OUT_OF_MEMORY;
    case cudaErrorNotReady:
      return DMEM_ERR_BUSY;
    /* No usable driver or device. */
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoDevice:
    case cudaErrorDeviceNotLicensed:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return DMEM_ERR_NO_DEVICE;
    default:
      return DMEM_ERR_DEVICE;
  }
}

static void cuda_mark_fatal(cuda_backend_t *cb, int code) {
  int healthy = 0;
  /* Keeps the first code; nothing is published through the flag, so there
   * is no acquire partner (readers use relaxed loads). */
  (void)dmem_atomic_cas_strong_acq_rel(&cb->fatal, &healthy, code);
}

/* Map a failed Runtime API call: record the detail, mark the backend fatal on
 * a sticky error (cb may be NULL before the backend exists) and clear the
 * thread's last-error state, which our failure has just overwritten, so the
 * caller's later cudaGetLastError() does not see it. */
static dmem_status_t cuda_fail(cuda_backend_t *cb, cudaError_t e, const char *call) {
  (void)cudaGetLastError();
  dmem_status_t st = cuda_code_status((int)e);
  if (st == DMEM_ERR_DEVICE_FATAL && cb != NULL) cuda_mark_fatal(cb, (int)e);
  return dmem__error(st, "%s: %s (%s)", call, cudaGetErrorName(e), cudaGetErrorString(e));
}

/* Map a failed Driver API call, as cuda_fail does. */
static dmem_status_t cuda_cu_fail(cuda_backend_t *cb, CUresult r, const char *call) {
  const char *name = NULL;
  const char *msg = NULL;
  if (cb->drv.get_error_name == NULL || cb->drv.get_error_name(r, &name) != CUDA_SUCCESS ||
      name == NULL)
    name = "CUDA_ERROR_?";
  if (cb->drv.get_error_string == NULL || cb->drv.get_error_string(r, &msg) != CUDA_SUCCESS ||
      msg == NULL)
    msg = "unrecognised CUresult";
  dmem_status_t st = cuda_code_status((int)r);
  if (st == DMEM_ERR_DEVICE_FATAL) cuda_mark_fatal(cb, (int)r);
  return dmem__error(st, "%s: %s (%s; code %d)", call, name, msg, (int)r);
}

/* The refusal of a call after a sticky error. */
static dmem_status_t cuda_refuse(const cuda_backend_t *cb, const char *call, int code) {
  return dmem__error(DMEM_ERR_DEVICE_FATAL,
                     "%s: refused, device %d lost its context earlier (%s)", call,
                     cb->drv.device, cudaGetErrorName((cudaError_t)code));
}

static bool cuda_is_fatal(cuda_backend_t *cb) {
  return dmem_atomic_load_relaxed(&cb->fatal) != 0; /* self-contained flag */
}

/* ---- context binding ------------------------------------------------------- */

/* Refuse if fatal, then make the backend's primary context current on this
 * thread, remembering the caller's. Fast path (the context is already
 * current): one thread-local read in the driver. */
static dmem_status_t cuda_enter(cuda_backend_t *cb, const char *call, cuda_scope_t *sc) {
  int fatal = dmem_atomic_load_relaxed(&cb->fatal); /* self-contained flag */
  if (fatal != 0) return cuda_refuse(cb, call, fatal);
  CUcontext cur = NULL;
  CUresult r = cb->drv.ctx_get_current(&cur);
  if (r != CUDA_SUCCESS) return cuda_cu_fail(cb, r, "cuCtxGetCurrent");
  sc->saved = cur;
  sc->switched = false;
  if (cur == cb->drv.context) return DMEM_OK;
  r = cb->drv.ctx_set_current(cb->drv.context);
  if (r != CUDA_SUCCESS) return cuda_cu_fail(cb, r, "cuCtxSetCurrent");
  sc->switched = true;
  return DMEM_OK;
}

/* Put the caller's context back (best effort: it was current a moment ago). */
static void cuda_leave(cuda_backend_t *cb, const cuda_scope_t *sc) {
  if (sc->switched) (void)cb->drv.ctx_set_current(sc->saved);
}

/* ---- device and host memory ---------------------------------------------------- */

static dmem_status_t cuda_device_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (size == 0 || ptr_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaMalloc: size 0 or ptr_out NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaMalloc", &sc);
  if (st != DMEM_OK) return st;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, size);
  if (e != cudaSuccess) {
    char call[64];
    snprintf(call, sizeof call, "cudaMalloc(%zu)", size);
    st = cuda_fail(cb, e, call);
  }
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *ptr_out = p;
  return st;
}

static dmem_status_t cuda_device_free(dmem__backend_t *be, void *ptr) {
  cuda_backend_t *cb = cuda_of(be);
  if (ptr == NULL || cuda_is_fatal(cb)) return DMEM_OK; /* fatal: the memory died with the context */
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaFree", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaFree(ptr);
  /* At process exit the runtime may already be unloading: nothing to free. */
  if (e != cudaSuccess && e != cudaErrorCudartUnloading) st = cuda_fail(cb, e, "cudaFree");
  cuda_leave(cb, &sc);
  return st;
}

/* ---- pinned host memory ------------------------------------------------------------ */

/* Two ways (dmem_config_t.host_pin; bench/bench_pin.c measures them):
 * cudaMallocHost, or (the default) mmap + MADV_HUGEPAGE + a first touch by
 * several threads + cudaHostRegister. Pinning costs mostly the kernel's work
 * per page (fault, zeroing, pinning, mapping); huge pages cut the page
 * count by 512 and the threads fault different parts at once: 22-24 GB/s
 * against 2.5-3 GB/s for cudaMallocHost on the lent H200. */

#define PIN_TOUCH_THREADS 8
#define PIN_TOUCH_PART ((size_t)64 << 20) /* at least this much per thread */
#define PIN_HUGE ((size_t)2 << 20)
/* A region's length grain: the pool sizes a chunk to a block when it keeps
 * no headroom (hostpool.c), and a 200 MB block in 2 MiB grains left 1.3 MB
 * pinned and unused per chunk (0.1 GiB of a Dask worker's RSS). The start
 * stays 2 MiB-aligned, so only the tail past the last whole huge page is in
 * 4 KiB pages. */
#define PIN_GRAIN ((size_t)64 << 10)

typedef struct touch_part {
  volatile char *base;
  size_t bytes;
} touch_part_t;

static void *touch_part(void *arg) {
  touch_part_t *t = arg;
  for (size_t o = 0; o < t->bytes; o += 4096) t->base[o] = 0;
  return NULL;
}

/* Fault in [p, p + size) from up to PIN_TOUCH_THREADS threads (this one
 * included); a thread that cannot start leaves its part to this one. */
static void touch_pages(char *p, size_t size) {
  size_t parts = size / PIN_TOUCH_PART;
  if (parts > PIN_TOUCH_THREADS) parts = PIN_TOUCH_THREADS;
  if (parts < 1) parts = 1;
  size_t per = (size / parts + PIN_HUGE - 1) / PIN_HUGE * PIN_HUGE;
  pthread_t th[PIN_TOUCH_THREADS];
  bool started[PIN_TOUCH_THREADS] = {false};
  touch_part_t tp[PIN_TOUCH_THREADS];
  size_t n = 0;
  for (size_t o = 0; o < size && n < parts; o += per, n++) {
    tp[n].base = p + o;
    tp[n].bytes = size - o < per ? size - o : per;
    if (n > 0) started[n] = pthread_create(&th[n], NULL, touch_part, &tp[n]) == 0;
  }
  for (size_t i = 0; i < n; i++)
    if (!started[i]) (void)touch_part(&tp[i]);
  for (size_t i = 1; i < n; i++)
    if (started[i]) pthread_join(th[i], NULL);
}

/* A failed pinning call: its detail "call(size): error", and a device
 * out-of-memory reported as the host's (it is host memory that ran out). */
static dmem_status_t pin_fail(cuda_backend_t *cb, cudaError_t e, const char *what, size_t size) {
  char call[64];
  snprintf(call, sizeof call, "%s(%zu)", what, size);
  dmem_status_t st = cuda_fail(cb, e, call);
  return st == DMEM_ERR_OUT_OF_MEMORY ? DMEM_ERR_HOST_OUT_OF_MEMORY : st;
}

/* len bytes of anonymous memory starting on a PIN_HUGE boundary (so that
 * every whole 2 MiB of it can be a huge page): a larger reservation, its
 * unaligned head and its tail unmapped. NULL on failure. */
static char *map_aligned(size_t len) {
  size_t span = len + PIN_HUGE;
  char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return NULL;
  uintptr_t a = ((uintptr_t)raw + PIN_HUGE - 1) & ~(uintptr_t)(PIN_HUGE - 1);
  char *p = (char *)a;
  size_t head = (size_t)(p - raw), tail = span - head - len;
  if (head) munmap(raw, head);
  if (tail) munmap(p + len, tail);
  return p;
}

static dmem_status_t register_alloc(cuda_backend_t *cb, size_t size, void **ptr_out) {
  size_t len = (size + PIN_GRAIN - 1) / PIN_GRAIN * PIN_GRAIN;
  pinned_region_t *r = malloc(sizeof *r);
  if (r == NULL) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pinned region record");
  char *p = map_aligned(len);
  if (p == NULL) {
    free(r);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "mmap(%zu) for pinned memory failed", len);
  }
  (void)madvise(p, len, MADV_HUGEPAGE); /* a hint: without THP, 4 KiB pages */
  /* A forked child does not inherit the mapping (as the driver does for
   * cudaMallocHost): else a write by the parent after fork could move a
   * page the device still reads from (copy-on-write), and the child has no
   * use for it (docs/reliability.md, fork). */
  (void)madvise(p, len, MADV_DONTFORK);
  touch_pages(p, len);
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaHostRegister", &sc);
  if (st == DMEM_OK) {
    cudaError_t e = cudaHostRegister(p, len, cudaHostRegisterPortable);
    if (e != cudaSuccess) st = pin_fail(cb, e, "cudaHostRegister", len);
    cuda_leave(cb, &sc);
  }
  if (st != DMEM_OK) {
    munmap(p, len);
    free(r);
    return st;
  }
  r->base = p;
  r->size = len;
  pthread_mutex_lock(&cb->reg_mu);
  r->next = cb->regions;
  cb->regions = r;
  pthread_mutex_unlock(&cb->reg_mu);
  *ptr_out = p;
  return DMEM_OK;
}

static dmem_status_t cuda_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (size == 0 || ptr_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaMallocHost: size 0 or ptr_out NULL");
  if (cb->pin == DMEM_HOST_PIN_REGISTER) {
    int fatal = dmem_atomic_load_relaxed(&cb->fatal); /* self-contained flag */
    if (fatal != 0) return cuda_refuse(cb, "cudaHostRegister", fatal);
    return register_alloc(cb, size, ptr_out);
  }
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaMallocHost", &sc);
  if (st != DMEM_OK) return st;
  void *p = NULL;
  cudaError_t e = cudaMallocHost(&p, size);
  if (e != cudaSuccess) st = pin_fail(cb, e, "cudaMallocHost", size);
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *ptr_out = p;
  return st;
}

static dmem_status_t cuda_host_free(dmem__backend_t *be, void *ptr) {
  cuda_backend_t *cb = cuda_of(be);
  if (ptr == NULL) return DMEM_OK;
  pinned_region_t *r = NULL;
  pthread_mutex_lock(&cb->reg_mu);
  for (pinned_region_t **rp = &cb->regions; *rp; rp = &(*rp)->next)
    if ((*rp)->base == ptr) {
      r = *rp;
      *rp = r->next;
      break;
    }
  pthread_mutex_unlock(&cb->reg_mu);
  dmem_status_t st = DMEM_OK;
  if (r != NULL) { /* the register way: unpin (unless the context died), unmap */
    cuda_scope_t sc;
    if (!cuda_is_fatal(cb) && (st = cuda_enter(cb, "cudaHostUnregister", &sc)) == DMEM_OK) {
      cudaError_t e = cudaHostUnregister(ptr);
      if (e != cudaSuccess && e != cudaErrorCudartUnloading)
        st = cuda_fail(cb, e, "cudaHostUnregister");
      cuda_leave(cb, &sc);
    }
    munmap(r->base, r->size);
    free(r);
    return st == DMEM_ERR_DEVICE_FATAL ? DMEM_OK : st;
  }
  if (cuda_is_fatal(cb)) return DMEM_OK;
  cuda_scope_t sc;
  st = cuda_enter(cb, "cudaFreeHost", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaFreeHost(ptr);
  if (e != cudaSuccess && e != cudaErrorCudartUnloading) st = cuda_fail(cb, e, "cudaFreeHost");
  cuda_leave(cb, &sc);
  return st;
}

/* ---- copies, streams, host functions ---------------------------------------------- */

static dmem_status_t cuda_memcpy_async(dmem__backend_t *be, void *dst, const void *src, size_t n,
                                       void *stream) {
  cuda_backend_t *cb = cuda_of(be);
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaMemcpyAsync", &sc);
  if (st != DMEM_OK) return st;
  /* stream NULL is 0: the legacy default stream. */
  cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, (cudaStream_t)stream);
  if (e != cudaSuccess) {
    char call[96];
    snprintf(call, sizeof call, "cudaMemcpyAsync(%p <- %p, %zu)", dst, src, n);
    st = cuda_fail(cb, e, call);
  }
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_stream_create(dmem__backend_t *be, void **stream_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (stream_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaStreamCreateWithFlags: stream_out NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaStreamCreateWithFlags", &sc);
  if (st != DMEM_OK) return st;
  cudaStream_t s = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaStreamCreateWithFlags(cudaStreamNonBlocking)");
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *stream_out = (void *)s;
  return st;
}

static dmem_status_t cuda_stream_destroy(dmem__backend_t *be, void *stream) {
  cuda_backend_t *cb = cuda_of(be);
  if (stream == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaStreamDestroy: the default stream");
  if (cuda_is_fatal(cb)) return DMEM_OK;
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaStreamDestroy", &sc);
  if (st != DMEM_OK) return st;
  /* The contract waits for queued work; cudaStreamDestroy alone would not. */
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  cudaError_t e2 = cudaStreamDestroy((cudaStream_t)stream);
  if (e != cudaSuccess)
    st = cuda_fail(cb, e, "cudaStreamSynchronize (before cudaStreamDestroy)");
  else if (e2 != cudaSuccess && e2 != cudaErrorCudartUnloading)
    st = cuda_fail(cb, e2, "cudaStreamDestroy");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_stream_synchronize(dmem__backend_t *be, void *stream) {
  cuda_backend_t *cb = cuda_of(be);
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaStreamSynchronize", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaStreamSynchronize");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_stream_query(dmem__backend_t *be, void *stream) {
  cuda_backend_t *cb = cuda_of(be);
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaStreamQuery", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
  /* Not ready is an answer, not a failure (as cudaEventQuery's) */
  if (e == cudaErrorNotReady)
    st = DMEM_ERR_BUSY;
  else if (e != cudaSuccess)
    st = cuda_fail(cb, e, "cudaStreamQuery");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_stream_wait_event(dmem__backend_t *be, void *stream, void *event) {
  cuda_backend_t *cb = cuda_of(be);
  if (event == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaStreamWaitEvent: event NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaStreamWaitEvent", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaStreamWaitEvent");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_launch_host_func(dmem__backend_t *be, void *stream, void (*fn)(void *),
                                           void *user) {
  cuda_backend_t *cb = cuda_of(be);
  if (fn == NULL) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaLaunchHostFunc: fn NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaLaunchHostFunc", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaLaunchHostFunc((cudaStream_t)stream, fn, user);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaLaunchHostFunc");
  cuda_leave(cb, &sc);
  return st;
}

/* ---- events ------------------------------------------------------------------------- */

static dmem_status_t cuda_event_create(dmem__backend_t *be, void **event_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (event_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaEventCreateWithFlags: event_out NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaEventCreateWithFlags", &sc);
  if (st != DMEM_OK) return st;
  cudaEvent_t ev = NULL;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaEventCreateWithFlags(cudaEventDisableTiming)");
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *event_out = (void *)ev;
  return st;
}

static dmem_status_t cuda_event_destroy(dmem__backend_t *be, void *event) {
  cuda_backend_t *cb = cuda_of(be);
  if (event == NULL || cuda_is_fatal(cb)) return DMEM_OK;
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaEventDestroy", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaEventDestroy((cudaEvent_t)event);
  if (e != cudaSuccess && e != cudaErrorCudartUnloading) st = cuda_fail(cb, e, "cudaEventDestroy");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_event_record(dmem__backend_t *be, void *event, void *stream) {
  cuda_backend_t *cb = cuda_of(be);
  if (event == NULL) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaEventRecord: event NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaEventRecord", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaEventRecord");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_event_query(dmem__backend_t *be, void *event) {
  cuda_backend_t *cb = cuda_of(be);
  if (event == NULL) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaEventQuery: event NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaEventQuery", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaEventQuery((cudaEvent_t)event);
  /* Not ready is an answer, not a failure: no detail, and the thread's
   * last-error state is left alone (this is a polling path). */
  if (e == cudaErrorNotReady)
    st = DMEM_ERR_BUSY;
  else if (e != cudaSuccess)
    st = cuda_fail(cb, e, "cudaEventQuery");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_event_synchronize(dmem__backend_t *be, void *event) {
  cuda_backend_t *cb = cuda_of(be);
  if (event == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cudaEventSynchronize: event NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaEventSynchronize", &sc);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaEventSynchronize((cudaEvent_t)event);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaEventSynchronize");
  cuda_leave(cb, &sc);
  return st;
}

/* ---- virtual memory management ---------------------------------------------------------- */

/* Physical memory of the backend's device: pinned (not migratable), no
 * shareable handle (nothing is exported). */
static CUmemAllocationProp cuda_vmm_prop(const cuda_backend_t *cb) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cb->drv.device;
  return prop;
}

static dmem_status_t cuda_vmm_granularity(dmem__backend_t *be, size_t *granularity_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (granularity_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cuMemGetAllocationGranularity: NULL argument");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemGetAllocationGranularity", &sc);
  if (st != DMEM_OK) return st;
  CUmemAllocationProp prop = cuda_vmm_prop(cb);
  size_t g = 0;
  CUresult r = cb->drv.mem_get_allocation_granularity(&g, &prop,
                                                        CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) st = cuda_cu_fail(cb, r, "cuMemGetAllocationGranularity");
  else if (g == 0)
    st = dmem__error(DMEM_ERR_DEVICE, "cuMemGetAllocationGranularity: granularity 0");
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *granularity_out = g;
  return st;
}

static dmem_status_t cuda_va_reserve(dmem__backend_t *be, size_t size, void **va_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (size == 0 || va_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cuMemAddressReserve: size 0 or va_out NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemAddressReserve", &sc);
  if (st != DMEM_OK) return st;
  CUdeviceptr va = 0;
  CUresult r = cb->drv.mem_address_reserve(&va, size, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    char call[64];
    snprintf(call, sizeof call, "cuMemAddressReserve(%zu)", size);
    st = cuda_cu_fail(cb, r, call);
  }
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *va_out = (void *)(uintptr_t)va;
  return st;
}

static dmem_status_t cuda_va_free(dmem__backend_t *be, void *va, size_t size) {
  cuda_backend_t *cb = cuda_of(be);
  if (va == NULL || cuda_is_fatal(cb)) return DMEM_OK; /* fatal: gone with the context */
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemAddressFree", &sc);
  if (st != DMEM_OK) return st;
  CUresult r = cb->drv.mem_address_free((CUdeviceptr)(uintptr_t)va, size);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) st = cuda_cu_fail(cb, r, "cuMemAddressFree");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_mem_create(dmem__backend_t *be, size_t size, uint64_t *handle_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (size == 0 || handle_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cuMemCreate: size 0 or handle_out NULL");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemCreate", &sc);
  if (st != DMEM_OK) return st;
  CUmemAllocationProp prop = cuda_vmm_prop(cb);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = cb->drv.mem_create(&h, size, &prop, 0);
  if (r != CUDA_SUCCESS) {
    char call[64];
    snprintf(call, sizeof call, "cuMemCreate(%zu)", size);
    st = cuda_cu_fail(cb, r, call);
  }
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) *handle_out = (uint64_t)h;
  return st;
}

static dmem_status_t cuda_mem_release(dmem__backend_t *be, uint64_t handle) {
  cuda_backend_t *cb = cuda_of(be);
  if (cuda_is_fatal(cb)) return DMEM_OK;
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemRelease", &sc);
  if (st != DMEM_OK) return st;
  CUresult r = cb->drv.mem_release((CUmemGenericAllocationHandle)handle);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) st = cuda_cu_fail(cb, r, "cuMemRelease");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_mem_map(dmem__backend_t *be, void *va, size_t size, uint64_t handle) {
  cuda_backend_t *cb = cuda_of(be);
  if (va == NULL || size == 0)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cuMemMap: va NULL or size 0");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemMap", &sc);
  if (st != DMEM_OK) return st;
  CUresult r = cb->drv.mem_map((CUdeviceptr)(uintptr_t)va, size, 0,
                               (CUmemGenericAllocationHandle)handle, 0);
  if (r != CUDA_SUCCESS) st = cuda_cu_fail(cb, r, "cuMemMap");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_mem_set_access(dmem__backend_t *be, void *va, size_t size) {
  cuda_backend_t *cb = cuda_of(be);
  if (va == NULL || size == 0)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cuMemSetAccess: va NULL or size 0");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemSetAccess", &sc);
  if (st != DMEM_OK) return st;
  CUmemAccessDesc desc;
  memset(&desc, 0, sizeof desc);
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = cb->drv.device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = cb->drv.mem_set_access((CUdeviceptr)(uintptr_t)va, size, &desc, 1);
  if (r != CUDA_SUCCESS) st = cuda_cu_fail(cb, r, "cuMemSetAccess");
  cuda_leave(cb, &sc);
  return st;
}

static dmem_status_t cuda_mem_unmap(dmem__backend_t *be, void *va, size_t size) {
  cuda_backend_t *cb = cuda_of(be);
  if (va == NULL || cuda_is_fatal(cb)) return DMEM_OK;
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuMemUnmap", &sc);
  if (st != DMEM_OK) return st;
  CUresult r = cb->drv.mem_unmap((CUdeviceptr)(uintptr_t)va, size);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) st = cuda_cu_fail(cb, r, "cuMemUnmap");
  cuda_leave(cb, &sc);
  return st;
}

/* ---- memory information, teardown --------------------------------------------------- */

_Static_assert(sizeof(CUipcMemHandle) == 64, "dmem_device_ipc_handle writes DMEM_IPC_HANDLE_SIZE bytes");

static dmem_status_t cuda_ipc_handle(dmem__backend_t *be, void *base, void *handle_out) {
  cuda_backend_t *cb = cuda_of(be);
  if (base == NULL || handle_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "cuIpcGetMemHandle: NULL argument");
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cuIpcGetMemHandle", &sc);
  if (st != DMEM_OK) return st;
  CUipcMemHandle h;
  CUresult r = cb->drv.ipc_get_mem_handle(&h, (CUdeviceptr)(uintptr_t)base);
  if (r != CUDA_SUCCESS) st = cuda_cu_fail(cb, r, "cuIpcGetMemHandle");
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) memcpy(handle_out, &h, sizeof h);
  return st;
}

/* be->make_current: the backend's primary context made current on the calling
 * thread and left current (no cuda_leave), for code that launches work itself. */
static dmem_status_t cuda_make_current(dmem__backend_t *be) {
  cuda_scope_t sc;
  return cuda_enter(cuda_of(be), "cuCtxSetCurrent", &sc);
}

static dmem_status_t cuda_mem_info(dmem__backend_t *be, size_t *free_out, size_t *total_out) {
  cuda_backend_t *cb = cuda_of(be);
  cuda_scope_t sc;
  dmem_status_t st = cuda_enter(cb, "cudaMemGetInfo", &sc);
  if (st != DMEM_OK) return st;
  size_t free_b = 0, total_b = 0;
  cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
  if (e != cudaSuccess) st = cuda_fail(cb, e, "cudaMemGetInfo");
  cuda_leave(cb, &sc);
  if (st == DMEM_OK) {
    if (free_out != NULL) *free_out = free_b;
    if (total_out != NULL) *total_out = total_b;
  }
  return st;
}

/* Synchronise the device (best effort) and free the backend. The primary
 * context is neither reset nor released: other users in the process may
 * share it. */
static void cuda_destroy(dmem__backend_t *be) {
  cuda_backend_t *cb = cuda_of(be);
  if (cb == NULL) return;
  cuda_scope_t sc;
  if (!cuda_is_fatal(cb) && cuda_enter(cb, "cudaDeviceSynchronize", &sc) == DMEM_OK) {
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      if (cuda_code_is_sticky((int)e)) cuda_mark_fatal(cb, (int)e);
      (void)cudaGetLastError(); /* ours: do not leave it for the caller */
    }
    cuda_leave(cb, &sc);
  }
  /* regions the pool did not give back (it always does): unmapped */
  for (pinned_region_t *r = cb->regions, *n; r; r = n) {
    n = r->next;
    munmap(r->base, r->size);
    free(r);
  }
  pthread_mutex_destroy(&cb->reg_mu);
  free(cb);
}

/* ---- creation ------------------------------------------------------------------------ */

/* One Driver API entry point, ABI of CUDA_DRIVER_ABI. */
static dmem_status_t cuda_lookup(const char *symbol, void **fn_out) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  static const char api[] = "cudaGetDriverEntryPointByVersion";
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, CUDA_DRIVER_ABI, cudaEnableDefault, &q);
#else
  static const char api[] = "cudaGetDriverEntryPoint";
  cudaError_t e = cudaGetDriverEntryPoint(symbol, &fn, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess) {
    char call[128];
    snprintf(call, sizeof call, "%s(%s, %d)", api, symbol, CUDA_DRIVER_ABI);
    return cuda_fail(NULL, e, call);
  }
  if (q != cudaDriverEntryPointSuccess || fn == NULL)
    return dmem__error(DMEM_ERR_NO_DEVICE, "%s(%s, %d): %s", api, symbol, CUDA_DRIVER_ABI,
                       q == cudaDriverEntryPointVersionNotSufficent
                           ? "the driver is too old for this entry point"
                           : "symbol not found in the driver");
  *fn_out = fn;
  return DMEM_OK;
}

/* Fill the driver table's entry points. */
static dmem_status_t cuda_load_driver(dmem__cuda_driver_t *drv) {
  dmem_status_t st;
  void *fn = NULL;
  /* Object pointer -> function pointer through memcpy (ISO C has no cast). */
#define CUDA_LOAD(field, symbol)                                                \
  do {                                                                          \
    _Static_assert(sizeof drv->field == sizeof fn, "function pointer size");    \
    st = cuda_lookup(symbol, &fn);                                              \
    if (st != DMEM_OK) return st;                                               \
    memcpy(&drv->field, &fn, sizeof fn);                                        \
  } while (0)
  CUDA_LOAD(get_error_name, "cuGetErrorName");
  CUDA_LOAD(get_error_string, "cuGetErrorString");
  CUDA_LOAD(ctx_get_current, "cuCtxGetCurrent");
  CUDA_LOAD(ctx_set_current, "cuCtxSetCurrent");
  CUDA_LOAD(ipc_get_mem_handle, "cuIpcGetMemHandle");
  CUDA_LOAD(mem_address_reserve, "cuMemAddressReserve");
  CUDA_LOAD(mem_address_free, "cuMemAddressFree");
  CUDA_LOAD(mem_create, "cuMemCreate");
  CUDA_LOAD(mem_release, "cuMemRelease");
  CUDA_LOAD(mem_map, "cuMemMap");
  CUDA_LOAD(mem_unmap, "cuMemUnmap");
  CUDA_LOAD(mem_set_access, "cuMemSetAccess");
  CUDA_LOAD(mem_get_allocation_granularity, "cuMemGetAllocationGranularity");
#undef CUDA_LOAD
  return DMEM_OK;
}

int dmem__backend_cuda_available(void) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cuda_fail(NULL, e, "cudaGetDeviceCount"); /* the reason; clears the error */
    return 0;
  }
  if (count <= 0) (void)dmem__error(DMEM_ERR_NO_DEVICE, "cudaGetDeviceCount: no CUDA device");
  return count > 0;
}

dmem_status_t dmem__backend_cuda_create(const dmem_config_t *cfg, dmem__backend_t **be_out) {
  if (cfg == NULL || be_out == NULL)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem__backend_cuda_create: cfg or be_out NULL");
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return cuda_fail(NULL, e, "cudaGetDeviceCount");
  if (count <= 0) return dmem__error(DMEM_ERR_NO_DEVICE, "cudaGetDeviceCount: no CUDA device");
  if (cfg->device < 0 || cfg->device >= count)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "CUDA device %d requested, %d present (0..%d)",
                       cfg->device, count, count - 1);

  /* on a line boundary: fatal and drv's first fields share one line */
  const size_t cb_size = (sizeof(cuda_backend_t) + 63) / 64 * 64;
  cuda_backend_t *cb = aligned_alloc(64, cb_size);
  if (cb == NULL)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "aligned_alloc(%zu) for the CUDA backend",
                       cb_size);
  memset(cb, 0, cb_size);
  atomic_init(&cb->fatal, 0);
  pthread_mutex_init(&cb->reg_mu, NULL);
  /* AUTO: the register way, 22-24 GB/s against cudaMallocHost's 2.5-3
   * on the lent H200 (bench_pin, docs/benchmarks.md) */
  cb->pin = cfg->host_pin == DMEM_HOST_PIN_MALLOC_HOST ? DMEM_HOST_PIN_MALLOC_HOST
                                                       : DMEM_HOST_PIN_REGISTER;
  cb->drv.device = cfg->device;
  dmem_status_t st = cuda_load_driver(&cb->drv);
  if (st != DMEM_OK) goto fail_free;

  /* Initialise the primary context (cudaSetDevice does, since CUDA 12.0),
   * note it, and put the creating thread's context back afterwards. */
  CUcontext saved = NULL;
  CUresult r = cb->drv.ctx_get_current(&saved);
  if (r != CUDA_SUCCESS) {
    st = cuda_cu_fail(cb, r, "cuCtxGetCurrent");
    goto fail_free;
  }
  e = cudaSetDevice(cfg->device);
  if (e != cudaSuccess) {
    char call[48];
    snprintf(call, sizeof call, "cudaSetDevice(%d)", cfg->device);
    st = cuda_fail(NULL, e, call);
    goto fail_restore;
  }
  r = cb->drv.ctx_get_current(&cb->drv.context);
  if (r != CUDA_SUCCESS) {
    st = cuda_cu_fail(cb, r, "cuCtxGetCurrent");
    goto fail_restore;
  }
  if (cb->drv.context == NULL) {
    st = dmem__error(DMEM_ERR_DEVICE, "cudaSetDevice(%d): no context current afterwards",
                     cfg->device);
    goto fail_restore;
  }
  size_t free_b = 0, total_b = 0;
  e = cudaMemGetInfo(&free_b, &total_b);
  if (e != cudaSuccess) {
    st = cuda_fail(NULL, e, "cudaMemGetInfo");
    goto fail_restore;
  }
  (void)cb->drv.ctx_set_current(saved);

  dmem__backend_t *be = &cb->base;
  be->name = "cuda";
  be->kind = DMEM_BACKEND_CUDA;
  be->device_capacity = total_b;
  be->host_chunk_min = (size_t)64 << 20;
  /* register pins at 22-24 GB/s: a large block waits for the chunk being
   * pinned (tens of ms) rather than fault in fresh pageable pages from one
   * thread at a few GB/s; cudaMallocHost pins at 2-3 GB/s, slower than that */
  be->host_pageable_max = cb->pin == DMEM_HOST_PIN_REGISTER ? (size_t)4 << 20 : 0;
  be->device_alloc = cuda_device_alloc;
  be->device_free = cuda_device_free;
  be->host_alloc = cuda_host_alloc;
  be->host_free = cuda_host_free;
  be->memcpy_async = cuda_memcpy_async;
  be->stream_create = cuda_stream_create;
  be->stream_destroy = cuda_stream_destroy;
  be->stream_synchronize = cuda_stream_synchronize;
  be->stream_query = cuda_stream_query;
  be->stream_wait_event = cuda_stream_wait_event;
  be->launch_host_func = cuda_launch_host_func;
  be->event_create = cuda_event_create;
  be->event_destroy = cuda_event_destroy;
  be->event_record = cuda_event_record;
  be->event_query = cuda_event_query;
  be->event_synchronize = cuda_event_synchronize;
  be->make_current = cuda_make_current;
  be->ipc_handle = cuda_ipc_handle;
  be->mem_info = cuda_mem_info;
  be->vmm_granularity = cuda_vmm_granularity;
  be->va_reserve = cuda_va_reserve;
  be->va_free = cuda_va_free;
  be->mem_create = cuda_mem_create;
  be->mem_release = cuda_mem_release;
  be->mem_map = cuda_mem_map;
  be->mem_set_access = cuda_mem_set_access;
  be->mem_unmap = cuda_mem_unmap;
  be->destroy = cuda_destroy;
  *be_out = be;
  return DMEM_OK;

fail_restore:
  (void)cb->drv.ctx_set_current(saved);
fail_free:
  pthread_mutex_destroy(&cb->reg_mu);
  free(cb);
  return st;
}

#endif /* DMEM_HAVE_CUDA */
