/*
 * runtime/base/nvtx.h - NVTX ranges for Nsight Systems, or nothing.
 *
 * With the CUDA toolkit (DMEM_HAVE_NVTX, set by CMake when it finds the
 * header-only nvtx3 C API, <nvtx3/nvToolsExt.h>) the macros open and close
 * ranges on the calling thread: spill, unspill, eviction passes, waits for
 * room. NVTX costs a few nanoseconds while no tool is attached. Without it
 * (CI, the host backend only) they compile to nothing.
 *
 *   DMEM_NVTX_PUSH("dmem spill");   ...   DMEM_NVTX_POP();
 *
 * Every PUSH must be matched by one POP on the same thread.
 *
 * NVTX initialises itself lazily at its first call; several threads making
 * their first calls at once (threads that start spilling together) raced
 * inside that initialisation (ThreadSanitizer reports). DMEM_NVTX_INIT(),
 * called by dmem_runtime_create, initialises it once per process first.
 */
#ifndef DMEM_NVTX_H
#define DMEM_NVTX_H

#ifdef DMEM_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#include <pthread.h>
static inline void dmem__nvtx_init_once(void) { nvtxInitialize(NULL); }
static inline void dmem__nvtx_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  (void)pthread_once(&once, dmem__nvtx_init_once);
}
#define DMEM_NVTX_INIT() dmem__nvtx_init()
#define DMEM_NVTX_PUSH(name) ((void)nvtxRangePushA(name))
#define DMEM_NVTX_POP() ((void)nvtxRangePop())
#else
#define DMEM_NVTX_INIT() ((void)0)
#define DMEM_NVTX_PUSH(name) ((void)0)
#define DMEM_NVTX_POP() ((void)0)
#endif

#endif /* DMEM_NVTX_H */
