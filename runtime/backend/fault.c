/*
 * runtime/backend/fault.c - fault injection (see fault.h): the process-wide
 * plan and counters, and the wrapping backend that fails the planned call.
 *
 * The wrapper forwards every call to the backend it wraps. Before a call it
 * counts it and, if the plan names that call, fails it instead with the
 * status the real call would give. An injected DMEM_ERR_DEVICE_FATAL turns
 * the wrapper "dead", as the CUDA backend turns after a sticky context
 * error: the streams it knows (every stream made through it, and the
 * default stream) are drained first, then every later call is refused with
 * DMEM_ERR_DEVICE_FATAL except the frees and destroys, which still free
 * and return DMEM_OK (the CUDA backend makes them no-ops: the context holds
 * the memory until it goes). A free or destroy that is itself failed frees
 * nothing; the wrapper keeps what it was given and frees it at a later
 * free of the same thing or at destroy, as a lost CUDA context would, so
 * that neither a runtime that retries the free nor one that forgets it
 * leaks or frees twice.
 */
#define _POSIX_C_SOURCE 200809L

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/atomic.h"
#include "backend/backend.h"
#include "base/error.h"

/* ---- the plan (process-wide) ----------------------------------------------------- */

static const char *const call_names[DMEM__FAULT_NCALLS] = {
    [DMEM__FAULT_ANY] = "any",
    [DMEM__FAULT_BACKEND_CREATE] = "backend_create",
    [DMEM__FAULT_DEVICE_ALLOC] = "device_alloc",
    [DMEM__FAULT_DEVICE_FREE] = "device_free",
    [DMEM__FAULT_HOST_ALLOC] = "host_alloc",
    [DMEM__FAULT_HOST_FREE] = "host_free",
    [DMEM__FAULT_MEMCPY_ASYNC] = "memcpy_async",
    [DMEM__FAULT_STREAM_CREATE] = "stream_create",
    [DMEM__FAULT_STREAM_DESTROY] = "stream_destroy",
    [DMEM__FAULT_STREAM_SYNCHRONIZE] = "stream_synchronize",
    [DMEM__FAULT_STREAM_QUERY] = "stream_query",
    [DMEM__FAULT_STREAM_WAIT_EVENT] = "stream_wait_event",
    [DMEM__FAULT_LAUNCH_HOST_FUNC] = "launch_host_func",
    [DMEM__FAULT_EVENT_CREATE] = "event_create",
    [DMEM__FAULT_EVENT_DESTROY] = "event_destroy",
    [DMEM__FAULT_EVENT_RECORD] = "event_record",
    [DMEM__FAULT_EVENT_QUERY] = "event_query",
    [DMEM__FAULT_EVENT_SYNCHRONIZE] = "event_synchronize",
    [DMEM__FAULT_MAKE_CURRENT] = "make_current",
    [DMEM__FAULT_IPC_HANDLE] = "ipc_handle",
    [DMEM__FAULT_MEM_INFO] = "mem_info",
    [DMEM__FAULT_DISK_OPEN] = "disk_open",
    [DMEM__FAULT_DISK_ALLOC] = "disk_alloc",
    [DMEM__FAULT_DISK_WRITE] = "disk_write",
    [DMEM__FAULT_DISK_READ] = "disk_read",
    [DMEM__FAULT_VMM_GRANULARITY] = "vmm_granularity",
    [DMEM__FAULT_VA_RESERVE] = "va_reserve",
    [DMEM__FAULT_VA_FREE] = "va_free",
    [DMEM__FAULT_MEM_CREATE] = "mem_create",
    [DMEM__FAULT_MEM_RELEASE] = "mem_release",
    [DMEM__FAULT_MEM_MAP] = "mem_map",
    [DMEM__FAULT_MEM_SET_ACCESS] = "mem_set_access",
    [DMEM__FAULT_MEM_UNMAP] = "mem_unmap",
};

/* Set by the first arm, never cleared: backends created afterwards are
 * wrapped. Relaxed: a flag that publishes nothing. */
static _Atomic int fault_on;
/* The plan: written by arm while `armed` is 0, then published by the
 * release store of `armed`; read by counting calls after their acquire
 * load of it. Atomic (relaxed) themselves because a re-arm may overlap a
 * late reader of the previous plan. */
static _Atomic int armed;
static _Atomic int plan_call;
static _Atomic uint64_t plan_n;
static _Atomic int plan_fatal;
static _Atomic int plan_persistent;
/* Counts since the last arm (relaxed: each call takes its own number). */
static _Atomic uint64_t counts[DMEM__FAULT_NCALLS];
/* The injected failure (relaxed: read by the tests after the scenario). */
static _Atomic int fired, fired_call, fired_status;
/* Resources held through wrapped backends, process-wide and never reset:
 * device and host allocations, events, streams (relaxed counters). */
static _Atomic int64_t live_device, live_host, live_events, live_streams, live_vmm;

const char *dmem__fault_call_name(dmem__fault_call_t call) {
  return (unsigned)call < DMEM__FAULT_NCALLS ? call_names[call] : NULL;
}

void dmem__fault_arm(const dmem__fault_plan_t *plan) {
  dmem_atomic_store_release(&armed, 0);
  dmem_atomic_store_relaxed(&plan_call, (int)plan->call);
  dmem_atomic_store_relaxed(&plan_n, plan->n);
  dmem_atomic_store_relaxed(&plan_fatal, plan->fatal ? 1 : 0);
  dmem_atomic_store_relaxed(&plan_persistent, plan->persistent ? 1 : 0);
  for (int i = 0; i < DMEM__FAULT_NCALLS; i++) dmem_atomic_store_relaxed(&counts[i], 0);
  dmem_atomic_store_relaxed(&fired, 0);
  dmem_atomic_store_relaxed(&fired_call, 0);
  dmem_atomic_store_relaxed(&fired_status, 0);
  dmem_atomic_store_relaxed(&fault_on, 1);
  /* release: publishes the plan; partner is the acquire in fires() */
  dmem_atomic_store_release(&armed, 1);
}

void dmem__fault_disarm(void) { dmem_atomic_store_release(&armed, 0); }

void dmem__fault_report(dmem__fault_report_t *out) {
  dmem__fault_report_t r;
  memset(&r, 0, sizeof r);
  for (int i = 0; i < DMEM__FAULT_NCALLS; i++) r.calls[i] = dmem_atomic_load_relaxed(&counts[i]);
  r.fired = dmem_atomic_load_relaxed(&fired) != 0;
  r.fired_call = (dmem__fault_call_t)dmem_atomic_load_relaxed(&fired_call);
  r.fired_status = (dmem_status_t)dmem_atomic_load_relaxed(&fired_status);
  r.live_device_allocs = dmem_atomic_load_relaxed(&live_device);
  r.live_host_allocs = dmem_atomic_load_relaxed(&live_host);
  r.live_events = dmem_atomic_load_relaxed(&live_events);
  r.live_streams = dmem_atomic_load_relaxed(&live_streams);
  r.live_vmm = dmem_atomic_load_relaxed(&live_vmm);
  *out = r;
}

bool dmem__fault_on(void) { return dmem_atomic_load_relaxed(&fault_on) != 0; }

/* The status a failure of `call` gives (see fault.h). */
static dmem_status_t own_status(dmem__fault_call_t call) {
  switch (call) {
    case DMEM__FAULT_DEVICE_ALLOC:
    case DMEM__FAULT_MEM_CREATE:
    case DMEM__FAULT_VA_RESERVE: return DMEM_ERR_OUT_OF_MEMORY;
    case DMEM__FAULT_HOST_ALLOC: return DMEM_ERR_HOST_OUT_OF_MEMORY;
    case DMEM__FAULT_DEVICE_FREE:
    case DMEM__FAULT_HOST_FREE:
    case DMEM__FAULT_STREAM_DESTROY:
    case DMEM__FAULT_EVENT_DESTROY:
    case DMEM__FAULT_MEM_UNMAP:
    case DMEM__FAULT_MEM_RELEASE:
    case DMEM__FAULT_VA_FREE:
    case DMEM__FAULT_STREAM_SYNCHRONIZE:
    case DMEM__FAULT_STREAM_QUERY:
    case DMEM__FAULT_EVENT_SYNCHRONIZE:
    case DMEM__FAULT_EVENT_QUERY: return DMEM_ERR_DEVICE_FATAL;
    case DMEM__FAULT_DISK_OPEN:
    case DMEM__FAULT_DISK_ALLOC:
    case DMEM__FAULT_DISK_WRITE:
    case DMEM__FAULT_DISK_READ: return DMEM_ERR_IO;
    default: return DMEM_ERR_DEVICE;
  }
}

static bool is_disk(dmem__fault_call_t call) {
  return call >= DMEM__FAULT_DISK_OPEN && call <= DMEM__FAULT_DISK_READ;
}

/* Count a call of kind `call`; DMEM_OK, or the status it must fail with
 * (nothing recorded yet). *nth_out: its number in the plan's count. */
static dmem_status_t fires(dmem__fault_call_t call, uint64_t *nth_out) {
  if (!dmem_atomic_load_acquire(&armed)) return DMEM_OK; /* partner: release in arm */
  uint64_t any = dmem_atomic_add_relaxed(&counts[DMEM__FAULT_ANY], 1) + 1;
  uint64_t own = dmem_atomic_add_relaxed(&counts[call], 1) + 1;
  uint64_t n = dmem_atomic_load_relaxed(&plan_n);
  int want = dmem_atomic_load_relaxed(&plan_call);
  uint64_t at = want == DMEM__FAULT_ANY ? any : want == (int)call ? own : 0;
  if (n == 0 || at < n || (at > n && !dmem_atomic_load_relaxed(&plan_persistent)))
    return DMEM_OK;
  dmem_status_t st = own_status(call);
  if (dmem_atomic_load_relaxed(&plan_fatal) && !is_disk(call)) st = DMEM_ERR_DEVICE_FATAL;
  if (at == n) { /* the report names the first failure (of a persistent plan too) */
    dmem_atomic_store_relaxed(&fired_call, (int)call);
    dmem_atomic_store_relaxed(&fired_status, (int)st);
    dmem_atomic_store_relaxed(&fired, 1);
  }
  *nth_out = at;
  return st;
}

static dmem_status_t injected(dmem__fault_call_t call, dmem_status_t st, uint64_t nth) {
  return dmem__error(st, "%s: injected failure (fault plan: %s call %llu) gives %s",
                     call_names[call],
                     call_names[dmem_atomic_load_relaxed(&plan_call)],
                     (unsigned long long)nth, dmem_status_name(st));
}

dmem_status_t dmem__fault_point(dmem__fault_call_t call) {
  uint64_t nth = 0;
  dmem_status_t st = fires(call, &nth);
  return st == DMEM_OK ? DMEM_OK : injected(call, st, nth);
}

int dmem__fault_errno(dmem__fault_call_t call) {
  uint64_t nth = 0;
  if (fires(call, &nth) == DMEM_OK) return 0;
  return call == DMEM__FAULT_DISK_OPEN || call == DMEM__FAULT_DISK_ALLOC ? ENOSPC : EIO;
}

dmem_status_t dmem__fault_parse(const char *text, dmem__fault_plan_t *plan_out) {
  if (!text) return DMEM_ERR_CONFIG;
  const char *colon = strchr(text, ':');
  if (!colon) return DMEM_ERR_CONFIG;
  size_t len = (size_t)(colon - text);
  int call = -1;
  for (int i = 0; i < DMEM__FAULT_NCALLS; i++)
    if (strlen(call_names[i]) == len && strncmp(call_names[i], text, len) == 0) call = i;
  if (call < 0 || !isdigit((unsigned char)colon[1])) return DMEM_ERR_CONFIG;
  errno = 0;
  char *end = NULL;
  unsigned long long n = strtoull(colon + 1, &end, 10);
  if (errno != 0 || n == 0) return DMEM_ERR_CONFIG;
  bool fatal = false, persistent = false;
  while (*end == ':') {
    const char *opt = end + 1;
    end = strchr(opt, ':');
    if (!end) end = (char *)opt + strlen(opt);
    size_t olen = (size_t)(end - opt);
    if (olen == 5 && strncmp(opt, "fatal", 5) == 0) fatal = true;
    else if (olen == 10 && strncmp(opt, "persistent", 10) == 0) persistent = true;
    else return DMEM_ERR_CONFIG;
  }
  if (*end != '\0') return DMEM_ERR_CONFIG;
  plan_out->call = (dmem__fault_call_t)call;
  plan_out->n = n;
  plan_out->fatal = fatal;
  plan_out->persistent = persistent;
  return DMEM_OK;
}

/* The DMEM_FAULT_INJECT value armed last (under env_mu). */
static pthread_mutex_t env_mu = PTHREAD_MUTEX_INITIALIZER;
static char env_armed[128];

void dmem__fault_from_env(void) {
  const char *v = getenv("DMEM_FAULT_INJECT");
  if (!v || !*v) return;
  dmem__fault_plan_t plan;
  pthread_mutex_lock(&env_mu);
  if (strlen(v) < sizeof env_armed && strcmp(v, env_armed) != 0 &&
      dmem__fault_parse(v, &plan) == DMEM_OK) {
    strcpy(env_armed, v);
    dmem__fault_arm(&plan);
    DMEM_LOG_AT(DMEM_LOG_WARN, "DMEM_FAULT_INJECT=%s: fault injection on", v);
  }
  pthread_mutex_unlock(&env_mu);
}

/* ---- the wrapping backend ------------------------------------------------------------ */

typedef struct fault_backend {
  dmem__backend_t base; /* first member: dmem__backend_t * casts to it */
  dmem__backend_t *inner;
  /* 1 once a fatal failure was injected. Set by exchange (only the first
   * one drains); read relaxed: the flag publishes no data. */
  _Atomic int dead;
  pthread_mutex_t mu; /* the lists below (a leaf) */
  void **streams;     /* streams made through the wrapper */
  size_t nstreams, capstreams;
  /* Memory, events and streams whose free or destroy was failed (with the
   * sticky error): not freed then, as under CUDA, where a lost context
   * keeps them until it goes; a later free of one frees it, destroy frees
   * the rest (the context going). */
  struct orphan {
    dmem__fault_call_t call; /* the free that failed */
    void *p;                 /* mem_release: the handle */
    size_t size;             /* mem_unmap, va_free: the range's */
  } *orphans;
  size_t norphans, caporphans;
} fault_backend_t;

static fault_backend_t *fb_of(dmem__backend_t *be) { return (fault_backend_t *)be; }

/* Wait for the work queued on every stream the wrapper knows (the dead
 * context of a real device runs nothing more; the host backend's workers
 * must not keep writing memory the runtime now frees). */
static void go_dead(fault_backend_t *fb) {
  if (dmem_atomic_exchange_acq_rel(&fb->dead, 1)) return;
  pthread_mutex_lock(&fb->mu);
  for (size_t i = 0; i < fb->nstreams; i++)
    (void)fb->inner->stream_synchronize(fb->inner, fb->streams[i]);
  (void)fb->inner->stream_synchronize(fb->inner, NULL);
  pthread_mutex_unlock(&fb->mu);
}

/* Before a call that does work: refused once dead; the planned failure. */
static dmem_status_t enter(fault_backend_t *fb, dmem__fault_call_t call) {
  if (dmem_atomic_load_relaxed(&fb->dead))
    return dmem__error(DMEM_ERR_DEVICE_FATAL,
                       "%s: refused, the backend failed fatally earlier (injected fault)",
                       call_names[call]);
  uint64_t nth = 0;
  dmem_status_t st = fires(call, &nth);
  if (st == DMEM_OK) return DMEM_OK;
  if (st == DMEM_ERR_DEVICE_FATAL) go_dead(fb);
  return injected(call, st, nth);
}

/* Forget p as an orphan of `call` (it is being freed now). */
static void orphan_forget(fault_backend_t *fb, dmem__fault_call_t call, void *p) {
  pthread_mutex_lock(&fb->mu);
  for (size_t i = 0; i < fb->norphans; i++) {
    if (fb->orphans[i].p != p || fb->orphans[i].call != call) continue;
    fb->orphans[i] = fb->orphans[--fb->norphans];
    break;
  }
  pthread_mutex_unlock(&fb->mu);
}

/* Before a free or destroy of p: DMEM_OK (go ahead), or the injected
 * DMEM_ERR_DEVICE_FATAL: then p is kept as an orphan (freed by a later
 * free or by destroy) and the wrapper is dead. Once dead, frees go ahead. */
static dmem_status_t enter_free_sized(fault_backend_t *fb, dmem__fault_call_t call, void *p,
                                      size_t size) {
  if (dmem_atomic_load_relaxed(&fb->dead)) {
    orphan_forget(fb, call, p);
    return DMEM_OK;
  }
  uint64_t nth = 0;
  if (fires(call, &nth) == DMEM_OK) return DMEM_OK;
  go_dead(fb);
  pthread_mutex_lock(&fb->mu);
  if (fb->norphans == fb->caporphans) {
    size_t cap = fb->caporphans ? fb->caporphans * 2 : 16;
    struct orphan *v = realloc(fb->orphans, cap * sizeof *v);
    if (v) {
      fb->orphans = v;
      fb->caporphans = cap;
    }
  }
  bool kept = fb->norphans < fb->caporphans;
  if (kept) fb->orphans[fb->norphans++] = (struct orphan){call, p, size};
  pthread_mutex_unlock(&fb->mu);
  /* no room to remember it: free it now rather than leak it */
  if (!kept) return DMEM_OK;
  return injected(call, DMEM_ERR_DEVICE_FATAL, nth);
}

static dmem_status_t enter_free(fault_backend_t *fb, dmem__fault_call_t call, void *p) {
  return enter_free_sized(fb, call, p, 0);
}

static dmem_status_t fb_device_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_DEVICE_ALLOC);
  if (st == DMEM_OK) st = fb->inner->device_alloc(fb->inner, size, ptr_out);
  if (st == DMEM_OK) dmem_atomic_add_relaxed(&live_device, 1);
  return st;
}

static dmem_status_t fb_device_free(dmem__backend_t *be, void *ptr) {
  fault_backend_t *fb = fb_of(be);
  if (!ptr) return DMEM_OK;
  dmem_status_t st = enter_free(fb, DMEM__FAULT_DEVICE_FREE, ptr);
  if (st != DMEM_OK) return st;
  st = fb->inner->device_free(fb->inner, ptr);
  if (st == DMEM_OK) dmem_atomic_sub_relaxed(&live_device, 1);
  return st;
}

static dmem_status_t fb_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_HOST_ALLOC);
  if (st == DMEM_OK) st = fb->inner->host_alloc(fb->inner, size, ptr_out);
  if (st == DMEM_OK) dmem_atomic_add_relaxed(&live_host, 1);
  return st;
}

static dmem_status_t fb_host_free(dmem__backend_t *be, void *ptr) {
  fault_backend_t *fb = fb_of(be);
  if (!ptr) return DMEM_OK;
  dmem_status_t st = enter_free(fb, DMEM__FAULT_HOST_FREE, ptr);
  if (st != DMEM_OK) return st;
  st = fb->inner->host_free(fb->inner, ptr);
  if (st == DMEM_OK) dmem_atomic_sub_relaxed(&live_host, 1);
  return st;
}

static dmem_status_t fb_memcpy_async(dmem__backend_t *be, void *dst, const void *src, size_t n,
                                     void *stream) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_MEMCPY_ASYNC);
  return st != DMEM_OK ? st : fb->inner->memcpy_async(fb->inner, dst, src, n, stream);
}

static dmem_status_t fb_stream_create(dmem__backend_t *be, void **stream_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_STREAM_CREATE);
  if (st != DMEM_OK) return st;
  void *s = NULL;
  st = fb->inner->stream_create(fb->inner, &s);
  if (st != DMEM_OK) return st;
  pthread_mutex_lock(&fb->mu);
  if (fb->nstreams == fb->capstreams) {
    size_t cap = fb->capstreams ? fb->capstreams * 2 : 16;
    void **v = realloc(fb->streams, cap * sizeof *v);
    if (!v) {
      pthread_mutex_unlock(&fb->mu);
      (void)fb->inner->stream_destroy(fb->inner, s);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "fault backend: stream list");
    }
    fb->streams = v;
    fb->capstreams = cap;
  }
  fb->streams[fb->nstreams++] = s;
  pthread_mutex_unlock(&fb->mu);
  dmem_atomic_add_relaxed(&live_streams, 1);
  *stream_out = s;
  return DMEM_OK;
}

static dmem_status_t fb_stream_destroy(dmem__backend_t *be, void *stream) {
  fault_backend_t *fb = fb_of(be);
  if (!stream) return fb->inner->stream_destroy(fb->inner, stream); /* refused there */
  dmem_status_t st = enter_free(fb, DMEM__FAULT_STREAM_DESTROY, stream);
  if (st != DMEM_OK) return st; /* an orphan: still drained by go_dead */
  pthread_mutex_lock(&fb->mu);
  for (size_t i = 0; i < fb->nstreams; i++) {
    if (fb->streams[i] != stream) continue;
    fb->streams[i] = fb->streams[--fb->nstreams];
    break;
  }
  pthread_mutex_unlock(&fb->mu);
  st = fb->inner->stream_destroy(fb->inner, stream);
  if (st == DMEM_OK) dmem_atomic_sub_relaxed(&live_streams, 1);
  return st;
}

static dmem_status_t fb_stream_synchronize(dmem__backend_t *be, void *stream) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_STREAM_SYNCHRONIZE);
  return st != DMEM_OK ? st : fb->inner->stream_synchronize(fb->inner, stream);
}

static dmem_status_t fb_stream_query(dmem__backend_t *be, void *stream) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_STREAM_QUERY);
  return st != DMEM_OK ? st : fb->inner->stream_query(fb->inner, stream);
}

static dmem_status_t fb_stream_wait_event(dmem__backend_t *be, void *stream, void *event) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_STREAM_WAIT_EVENT);
  return st != DMEM_OK ? st : fb->inner->stream_wait_event(fb->inner, stream, event);
}

static dmem_status_t fb_launch_host_func(dmem__backend_t *be, void *stream, void (*fn)(void *),
                                         void *user) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_LAUNCH_HOST_FUNC);
  return st != DMEM_OK ? st : fb->inner->launch_host_func(fb->inner, stream, fn, user);
}

static dmem_status_t fb_event_create(dmem__backend_t *be, void **event_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_EVENT_CREATE);
  if (st == DMEM_OK) st = fb->inner->event_create(fb->inner, event_out);
  if (st == DMEM_OK) dmem_atomic_add_relaxed(&live_events, 1);
  return st;
}

static dmem_status_t fb_event_destroy(dmem__backend_t *be, void *event) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter_free(fb, DMEM__FAULT_EVENT_DESTROY, event);
  if (st != DMEM_OK) return st;
  st = fb->inner->event_destroy(fb->inner, event);
  if (st == DMEM_OK) dmem_atomic_sub_relaxed(&live_events, 1);
  return st;
}

static dmem_status_t fb_event_record(dmem__backend_t *be, void *event, void *stream) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_EVENT_RECORD);
  return st != DMEM_OK ? st : fb->inner->event_record(fb->inner, event, stream);
}

static dmem_status_t fb_event_query(dmem__backend_t *be, void *event) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_EVENT_QUERY);
  return st != DMEM_OK ? st : fb->inner->event_query(fb->inner, event);
}

static dmem_status_t fb_event_synchronize(dmem__backend_t *be, void *event) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_EVENT_SYNCHRONIZE);
  return st != DMEM_OK ? st : fb->inner->event_synchronize(fb->inner, event);
}

static dmem_status_t fb_make_current(dmem__backend_t *be) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_MAKE_CURRENT);
  return st != DMEM_OK ? st : fb->inner->make_current(fb->inner);
}

static dmem_status_t fb_ipc_handle(dmem__backend_t *be, void *base, void *handle_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_IPC_HANDLE);
  return st != DMEM_OK ? st : fb->inner->ipc_handle(fb->inner, base, handle_out);
}

static dmem_status_t fb_mem_info(dmem__backend_t *be, size_t *free_out, size_t *total_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_MEM_INFO);
  return st != DMEM_OK ? st : fb->inner->mem_info(fb->inner, free_out, total_out);
}

/* ---- virtual memory --------------------------------------------------------------- */

static dmem_status_t fb_vmm_granularity(dmem__backend_t *be, size_t *granularity_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_VMM_GRANULARITY);
  return st != DMEM_OK ? st : fb->inner->vmm_granularity(fb->inner, granularity_out);
}

static dmem_status_t fb_va_reserve(dmem__backend_t *be, size_t size, void **va_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_VA_RESERVE);
  if (st == DMEM_OK) st = fb->inner->va_reserve(fb->inner, size, va_out);
  if (st == DMEM_OK) dmem_atomic_add_relaxed(&live_vmm, 1);
  return st;
}

/* Unmap the orphaned (failed) unmaps inside [va, va + size) now: the range
 * or the memory is being freed, which a lost context would do too. */
static void orphan_unmaps_in(fault_backend_t *fb, void *va, size_t size) {
  pthread_mutex_lock(&fb->mu);
  for (size_t i = 0; i < fb->norphans;) {
    struct orphan o = fb->orphans[i];
    unsigned char *p = o.p, *lo = va;
    if (o.call == DMEM__FAULT_MEM_UNMAP && (!va || (p >= lo && p < lo + size))) {
      fb->orphans[i] = fb->orphans[--fb->norphans];
      (void)fb->inner->mem_unmap(fb->inner, o.p, o.size);
      continue;
    }
    i++;
  }
  pthread_mutex_unlock(&fb->mu);
}

static dmem_status_t fb_va_free(dmem__backend_t *be, void *va, size_t size) {
  fault_backend_t *fb = fb_of(be);
  if (!va) return DMEM_OK;
  dmem_status_t st = enter_free_sized(fb, DMEM__FAULT_VA_FREE, va, size);
  if (st != DMEM_OK) return st;
  orphan_unmaps_in(fb, va, size);
  st = fb->inner->va_free(fb->inner, va, size);
  if (st == DMEM_OK) dmem_atomic_sub_relaxed(&live_vmm, 1);
  return st;
}

static dmem_status_t fb_mem_create(dmem__backend_t *be, size_t size, uint64_t *handle_out) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_MEM_CREATE);
  if (st == DMEM_OK) st = fb->inner->mem_create(fb->inner, size, handle_out);
  if (st == DMEM_OK) dmem_atomic_add_relaxed(&live_vmm, 1);
  return st;
}

static dmem_status_t fb_mem_release(dmem__backend_t *be, uint64_t handle) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter_free(fb, DMEM__FAULT_MEM_RELEASE, (void *)(uintptr_t)handle);
  if (st != DMEM_OK) return st;
  st = fb->inner->mem_release(fb->inner, handle);
  if (st == DMEM_OK) dmem_atomic_sub_relaxed(&live_vmm, 1);
  return st;
}

static dmem_status_t fb_mem_map(dmem__backend_t *be, void *va, size_t size, uint64_t handle) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_MEM_MAP);
  return st != DMEM_OK ? st : fb->inner->mem_map(fb->inner, va, size, handle);
}

static dmem_status_t fb_mem_set_access(dmem__backend_t *be, void *va, size_t size) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter(fb, DMEM__FAULT_MEM_SET_ACCESS);
  return st != DMEM_OK ? st : fb->inner->mem_set_access(fb->inner, va, size);
}

static dmem_status_t fb_mem_unmap(dmem__backend_t *be, void *va, size_t size) {
  fault_backend_t *fb = fb_of(be);
  dmem_status_t st = enter_free_sized(fb, DMEM__FAULT_MEM_UNMAP, va, size);
  return st != DMEM_OK ? st : fb->inner->mem_unmap(fb->inner, va, size);
}

static void fb_destroy(dmem__backend_t *be) {
  fault_backend_t *fb = fb_of(be);
  if (!fb) return;
  /* the context goes: what it still held with it (mappings first) */
  orphan_unmaps_in(fb, NULL, 0);
  for (size_t i = 0; i < fb->norphans; i++) {
    dmem__backend_t *in = fb->inner;
    void *p = fb->orphans[i].p;
    switch (fb->orphans[i].call) {
      case DMEM__FAULT_MEM_RELEASE:
        if (in->mem_release(in, (uint64_t)(uintptr_t)p) == DMEM_OK)
          dmem_atomic_sub_relaxed(&live_vmm, 1);
        break;
      case DMEM__FAULT_VA_FREE:
        if (in->va_free(in, p, fb->orphans[i].size) == DMEM_OK)
          dmem_atomic_sub_relaxed(&live_vmm, 1);
        break;
      case DMEM__FAULT_DEVICE_FREE:
        if (in->device_free(in, p) == DMEM_OK) dmem_atomic_sub_relaxed(&live_device, 1);
        break;
      case DMEM__FAULT_HOST_FREE:
        if (in->host_free(in, p) == DMEM_OK) dmem_atomic_sub_relaxed(&live_host, 1);
        break;
      case DMEM__FAULT_EVENT_DESTROY:
        if (in->event_destroy(in, p) == DMEM_OK) dmem_atomic_sub_relaxed(&live_events, 1);
        break;
      default: /* a stream */
        if (in->stream_destroy(in, p) == DMEM_OK) dmem_atomic_sub_relaxed(&live_streams, 1);
        break;
    }
  }
  free(fb->orphans);
  fb->inner->destroy(fb->inner);
  free(fb->streams);
  pthread_mutex_destroy(&fb->mu);
  free(fb);
}

dmem_status_t dmem__fault_wrap(dmem__backend_t **be) {
  if (!dmem__fault_on()) return DMEM_OK;
  fault_backend_t *fb = calloc(1, sizeof *fb);
  if (!fb) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "fault backend allocation failed");
  int rc = pthread_mutex_init(&fb->mu, NULL);
  if (rc != 0) {
    free(fb);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "fault backend: pthread_mutex_init: %s",
                       strerror(rc));
  }
  fb->inner = *be;
  dmem__backend_t *b = &fb->base;
  *b = **be; /* name, kind, capacity, chunk size */
  b->device_alloc = fb_device_alloc;
  b->device_free = fb_device_free;
  b->host_alloc = fb_host_alloc;
  b->host_free = fb_host_free;
  b->memcpy_async = fb_memcpy_async;
  b->stream_create = fb_stream_create;
  b->stream_destroy = fb_stream_destroy;
  b->stream_synchronize = fb_stream_synchronize;
  b->stream_query = fb_stream_query;
  b->stream_wait_event = fb_stream_wait_event;
  b->launch_host_func = fb_launch_host_func;
  b->event_create = fb_event_create;
  b->event_destroy = fb_event_destroy;
  b->event_record = fb_event_record;
  b->event_query = fb_event_query;
  b->event_synchronize = fb_event_synchronize;
  b->make_current = fb_make_current;
  b->ipc_handle = fb_ipc_handle;
  b->mem_info = fb_mem_info;
  b->vmm_granularity = fb_vmm_granularity;
  b->va_reserve = fb_va_reserve;
  b->va_free = fb_va_free;
  b->mem_create = fb_mem_create;
  b->mem_release = fb_mem_release;
  b->mem_map = fb_mem_map;
  b->mem_set_access = fb_mem_set_access;
  b->mem_unmap = fb_mem_unmap;
  b->destroy = fb_destroy;
  *be = b;
  return DMEM_OK;
}
