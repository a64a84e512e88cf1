/*
 * runtime/backend/fault.h - fault injection, SQLite style: fail the n-th
 * call of a kind (or of any kind) with the status that call really returns,
 * so that tests can walk every failure path of a scenario (tests/test_fault.c,
 * docs/reliability.md, "Fault injection").
 *
 * Where it injects:
 *  - every function of the backend table, through a wrapping backend
 *    (fault.c) installed around the real one (host or CUDA) by
 *    dmem_runtime_create when injection is on;
 *  - the creation of the backend itself (dmem__fault_point);
 *  - the disk tier's I/O (spill/disk.c asks dmem__fault_errno before making
 *    its directory and file, reserving an extent, and each pread/pwrite).
 *
 * What an injected failure returns (the status the real call can give):
 *   device_alloc, mem_create, va_reserve DMEM_ERR_OUT_OF_MEMORY
 *   host_alloc                        DMEM_ERR_HOST_OUT_OF_MEMORY
 *   memcpy_async, stream_wait_event, launch_host_func, event_record,
 *   stream_create, event_create, make_current, ipc_handle, mem_info,
 *   mem_map, mem_set_access, vmm_granularity,
 *   backend_create                    DMEM_ERR_DEVICE (nothing was done)
 *   stream_synchronize, event_synchronize, event_query, and the frees and
 *   destroys (device_free, host_free, stream_destroy, event_destroy,
 *   mem_unmap, mem_release, va_free)
 *                                     DMEM_ERR_DEVICE_FATAL: under CUDA these
 *                                     calls fail only with the sticky error
 *                                     of earlier work (a failed free frees
 *                                     nothing now; the wrapper frees it at
 *                                     a later free of it or at destroy, as
 *                                     a lost context would)
 *   disk_open, disk_alloc             ENOSPC (the tier: DMEM_ERR_IO)
 *   disk_write, disk_read             EIO (the tier: DMEM_ERR_IO)
 * A plan with `fatal` fails the chosen backend call with
 * DMEM_ERR_DEVICE_FATAL whatever its kind (disk calls keep their errno).
 *
 * After an injected DMEM_ERR_DEVICE_FATAL the wrapped backend behaves as
 * the CUDA backend does after a sticky context error: the work already
 * queued is waited for (the host backend's worker threads would otherwise
 * keep copying into memory the runtime now frees; a dead CUDA context runs
 * nothing more), then every call is refused with DMEM_ERR_DEVICE_FATAL
 * except the frees and destroys, which free and return DMEM_OK (the CUDA
 * backend makes them no-ops: the context keeps the memory until it goes).
 *
 * The wrapper copies the wrapped backend's name and kind: code must not
 * cast a backend of kind DMEM_BACKEND_CUDA to the CUDA backend's struct
 * (only runtime/backend/cuda.c does, on the backend it made).
 *
 * Enabled by DMEM_FAULT_INJECT=<call>:<n>[:fatal][:persistent] (read by
 * dmem_runtime_create; counting is process-wide) or by dmem__fault_arm
 * (tests). Every runtime created after either is
 * wrapped; without them nothing is wrapped and nothing is counted.
 */
#ifndef DMEM_BACKEND_FAULT_H
#define DMEM_BACKEND_FAULT_H

#include <stdbool.h>
#include <stdint.h>

#include "dmem/status.h"

typedef struct dmem__backend dmem__backend_t;

/* The injection points. DMEM__FAULT_ANY counts every one of the others. */
typedef enum dmem__fault_call {
  DMEM__FAULT_ANY = 0,
  DMEM__FAULT_BACKEND_CREATE,
  DMEM__FAULT_DEVICE_ALLOC,
  DMEM__FAULT_DEVICE_FREE,
  DMEM__FAULT_HOST_ALLOC,
  DMEM__FAULT_HOST_FREE,
  DMEM__FAULT_MEMCPY_ASYNC,
  DMEM__FAULT_STREAM_CREATE,
  DMEM__FAULT_STREAM_DESTROY,
  DMEM__FAULT_STREAM_SYNCHRONIZE,
  DMEM__FAULT_STREAM_QUERY,
  DMEM__FAULT_STREAM_WAIT_EVENT,
  DMEM__FAULT_LAUNCH_HOST_FUNC,
  DMEM__FAULT_EVENT_CREATE,
  DMEM__FAULT_EVENT_DESTROY,
  DMEM__FAULT_EVENT_RECORD,
  DMEM__FAULT_EVENT_QUERY,
  DMEM__FAULT_EVENT_SYNCHRONIZE,
  DMEM__FAULT_MAKE_CURRENT,
  DMEM__FAULT_IPC_HANDLE,
  DMEM__FAULT_MEM_INFO,
  DMEM__FAULT_DISK_OPEN,  /* the private directory (mkdtemp) or the file (open) */
  DMEM__FAULT_DISK_ALLOC, /* reserving an extent (fallocate) */
  DMEM__FAULT_DISK_WRITE, /* one pwrite */
  DMEM__FAULT_DISK_READ,  /* one pread */
  /* the virtual memory calls of the backend table (stable buffers) */
  DMEM__FAULT_VMM_GRANULARITY,
  DMEM__FAULT_VA_RESERVE,
  DMEM__FAULT_VA_FREE,
  DMEM__FAULT_MEM_CREATE,
  DMEM__FAULT_MEM_RELEASE,
  DMEM__FAULT_MEM_MAP,
  DMEM__FAULT_MEM_SET_ACCESS,
  DMEM__FAULT_MEM_UNMAP,
  DMEM__FAULT_NCALLS
} dmem__fault_call_t;

/* What to fail: the n-th call counted for `call` (DMEM__FAULT_ANY: the
 * n-th injection point reached, whatever its kind). n 0: count only. */
typedef struct dmem__fault_plan {
  dmem__fault_call_t call;
  uint64_t n;
  bool fatal;      /* DMEM_ERR_DEVICE_FATAL instead of the call's own status */
  bool persistent; /* the n-th and every later counted call fail */
} dmem__fault_plan_t;

/* Calls counted since the plan was armed, and the failure injected. */
typedef struct dmem__fault_report {
  uint64_t calls[DMEM__FAULT_NCALLS]; /* [DMEM__FAULT_ANY]: all of them */
  bool fired;                         /* a call was failed */
  dmem__fault_call_t fired_call;      /* which kind (when fired) */
  dmem_status_t fired_status;         /* with what (DMEM_ERR_IO for disk calls) */
  /* Held now through wrapped backends, process-wide, never reset by arm:
   * 0 after every wrapped runtime was destroyed, unless something leaked. */
  int64_t live_device_allocs, live_host_allocs, live_events, live_streams;
  int64_t live_vmm; /* address reservations + physical allocations (mem_create) */
} dmem__fault_report_t;

/* Tests (internal, never the public API): arm `plan` process-wide, counts
 * reset; runtimes created from now on are wrapped. */
void dmem__fault_arm(const dmem__fault_plan_t *plan);
/* Stop counting and failing (wrapped backends pass calls through; one that
 * went fatal stays so). */
void dmem__fault_disarm(void);
/* Counts and the injected failure since the last arm; written whole. */
void dmem__fault_report(dmem__fault_report_t *out);

/* "device_alloc", ... ("any" for DMEM__FAULT_ANY); NULL when out of range. */
const char *dmem__fault_call_name(dmem__fault_call_t call);
/* Parse "<call>:<n>[:fatal][:persistent]" (n >= 1). DMEM_ERR_CONFIG (no
 * detail recorded: the caller names the variable) when malformed. */
dmem_status_t dmem__fault_parse(const char *text, dmem__fault_plan_t *plan_out);
/* Arm from DMEM_FAULT_INJECT (dmem_runtime_create calls it): when it is set
 * to a value other than the one armed last, the plan is armed with counts
 * from 0; the same value again keeps counting (so a program's runtimes
 * share one count). A malformed value arms nothing
 * (dmem__config_check_env reports it). */
void dmem__fault_from_env(void);

/* Whether backends are wrapped (injection was armed at some point). */
bool dmem__fault_on(void);
/* Count a call of kind `call` at an injection point outside the backend
 * table; DMEM_OK, or the injected status with the detail recorded. */
dmem_status_t dmem__fault_point(dmem__fault_call_t call);
/* The same for a disk operation: 0, or the errno it must fail with. */
int dmem__fault_errno(dmem__fault_call_t call);
/* When injection is on, wrap *be (taking ownership: destroying the wrapper
 * destroys it) and replace *be by the wrapper; otherwise leave it.
 * DMEM_ERR_HOST_OUT_OF_MEMORY (then *be is left as it was). */
dmem_status_t dmem__fault_wrap(dmem__backend_t **be);

#endif /* DMEM_BACKEND_FAULT_H */
