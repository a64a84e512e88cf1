/*
 * runtime/backend/host.c - the host backend: device memory simulated in host
 * memory with a fixed capacity; streams are FIFO worker threads; copies, host
 * functions and events run on them.
 *
 * Device allocations carry a header in the 256 bytes before the returned
 * pointer (which stays 256-byte aligned) and are filled with HB_POISON.
 *
 * Events follow CUDA: each record gets a sequence number (event->target, under
 * the event's mutex) and sits on the event's list of pending records until the
 * stream that carries it reaches it. "Record s is done" means s is no longer
 * pending, so a wait captured for record s waits for exactly that record, even
 * when the event is re-recorded (on any stream) before s runs. An event never
 * recorded (target 0) is complete.
 *
 * Lifetimes: an event is freed when the user has destroyed it and no queued
 * record or wait refers to it (CUDA: "released once the device has completed
 * it"). Streams still alive at backend destroy are drained and freed there.
 *
 * Virtual memory (vmm_* ops): a reservation is an anonymous PROT_NONE
 * mapping (MAP_NORESERVE), so its address stays the process's and any access
 * while nothing is mapped there faults (SIGSEGV), as an access to an
 * unmapped CUDA range does. "Physical memory" is a count against the same
 * capacity as device_alloc; mem_map records which handle backs a range,
 * mem_set_access makes it readable and writable and fills it with
 * HB_POISON (new physical memory has undefined bytes), mem_unmap discards
 * the pages (MADV_DONTNEED) and makes the range PROT_NONE again. The
 * simulation keeps no bytes of a physical allocation across an unmap (the
 * runtime releases it then), and one reservation holds one mapping at a
 * time. Reservations and allocations live on lists under vmm_mu (a leaf);
 * those left at destroy are freed there.
 *
 * Simulated link: DMEM_HOST_COPY_GBPS=G (read at backend create; unset or
 * 0: off) makes each copy of n bytes also sleep n / G ns on its stream's
 * worker, so that copies are still in flight when the next call comes, as
 * they are on a GPU (bench_policy --loop replays examples/cupy_loop.py so).
 *
 * Lock order: backend streams_mu is never held with another lock; stream mu
 * before event mu; workers run ops with no stream lock held.
 */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE, MADV_DONTNEED */

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "base/atomic.h"
#include "backend/backend.h"
#include "base/error.h"
#include "base/sched.h"

#define HB_ALIGN ((size_t)256) /* device and host allocation alignment */
#define HB_POISON 0xDB         /* fill byte of new device allocations */
#define HB_DEFAULT_CAPACITY ((size_t)1 << 30)
#define HB_ALLOC_MAGIC UINT64_C(0x646d656d616c6c63)  /* "dmemallc" */
#define HB_STREAM_MAGIC UINT64_C(0x646d656d7374726d) /* "dmemstrm" */
#define HB_EVENT_MAGIC UINT64_C(0x646d656d6576656e)  /* "dmemeven" */

typedef struct hb_backend hb_backend_t;
typedef struct hb_stream hb_stream_t;
typedef struct hb_event hb_event_t;
typedef struct hb_op hb_op_t;

/* Header of a device allocation, at (returned pointer - HB_ALIGN). */
typedef struct hb_alloc_header {
  uint64_t magic; /* HB_ALLOC_MAGIC while live, 0 once freed */
  size_t size;    /* bytes charged against the capacity */
} hb_alloc_header_t;

typedef enum hb_op_kind {
  HB_OP_COPY,
  HB_OP_HOST_FUNC,
  HB_OP_RECORD, /* mark record `seq` of `event` done */
  HB_OP_WAIT    /* block the stream until record `seq` of `event` is done */
} hb_op_kind_t;

struct hb_op {
  hb_op_t *next; /* stream queue link (stream mu) */
  hb_op_kind_t kind;
  union {
    struct {
      void *dst;
      const void *src;
      size_t n;
    } copy;
    struct {
      void (*fn)(void *);
      void *user;
    } func;
    struct {
      hb_event_t *event; /* holds one reference */
      uint64_t seq;
      hb_op_t *prev_pending, *next_pending; /* RECORD: event's pending list (event mu) */
    } ev;
  } u;
};

struct hb_stream {
  uint64_t magic; /* HB_STREAM_MAGIC while live */
  hb_backend_t *be;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t work_cv;   /* worker waits for ops or stopping */
  pthread_cond_t done_cv;   /* synchronize waits for `done` to advance */
  hb_op_t *head, *tail;     /* queued ops, FIFO (mu) */
  uint64_t enqueued;        /* ops ever enqueued (mu) */
  uint64_t done;            /* ops ever completed (mu) */
  bool stopping;            /* set by destroy: exit once the queue is empty (mu) */
  hb_stream_t *prev, *next; /* backend's list of live streams (be->streams_mu) */
};

struct hb_event {
  uint64_t magic; /* HB_EVENT_MAGIC while the user holds it */
  pthread_mutex_t mu;
  pthread_cond_t cv;     /* broadcast when a record completes */
  uint64_t target;       /* sequence number of the last record (mu) */
  hb_op_t *pending_head; /* records not yet run, ascending seq (mu) */
  hb_op_t *pending_tail;
  uint64_t refs; /* user (until destroy) + queued RECORD/WAIT ops (mu) */
};

/* A reserved range of the VMM simulation (vmm_mu). */
typedef struct hb_va {
  struct hb_va *next;
  unsigned char *base;
  size_t size;
  struct hb_phys *mapped; /* the allocation mapped at [map_at, map_at + map_size), or NULL */
  unsigned char *map_at;
  size_t map_size;
} hb_va_t;

/* "Physical memory" of the VMM simulation (vmm_mu): the handle is its
 * address. */
typedef struct hb_phys {
  struct hb_phys *next;
  size_t size;
  hb_va_t *mapped_in; /* the reservation it is mapped in, or NULL */
  bool released;      /* mem_release came while mapped: freed at the unmap */
} hb_phys_t;

struct hb_backend {
  dmem__backend_t base; /* first member: dmem__backend_t * casts to hb_backend_t * */
  size_t capacity;
  size_t vmm_granularity; /* 64 KiB, or the page size if larger */
  pthread_mutex_t vmm_mu; /* the two lists below; a leaf */
  hb_va_t *vas;
  hb_phys_t *phys;
  double copy_gbps;           /* DMEM_HOST_COPY_GBPS at create; 0: off */
  _Atomic size_t used;        /* written by device_alloc (CAS) and device_free */
  _Atomic size_t live_allocs; /* device allocations not freed (for the destroy warning) */
  _Atomic size_t live_events; /* events not destroyed by the user (same) */
  hb_stream_t *default_stream;
  pthread_mutex_t streams_mu;
  hb_stream_t *streams; /* every live stream, the default one included */
};

static hb_backend_t *hb_of(dmem__backend_t *be) { return (hb_backend_t *)be; }

/* ---- device and host memory --------------------------------------------- */

static dmem_status_t hb_device_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  hb_backend_t *hb = hb_of(be);
  if (!ptr_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend device_alloc: ptr_out NULL");
  if (size > hb->capacity)
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                       "host backend device_alloc(%zu): larger than the capacity %zu", size,
                       hb->capacity);
  /* Reserve the bytes first so that concurrent allocations never pass the
   * capacity together. The counter guards no other data: acq_rel only because
   * atomic.h offers no relaxed CAS; no partner. */
  size_t used = dmem_atomic_load_relaxed(&hb->used);
  do {
    if (size > hb->capacity - used)
      return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                         "host backend device_alloc(%zu): %zu of %zu bytes in use", size, used,
                         hb->capacity);
  } while (!dmem_atomic_cas_acq_rel(&hb->used, &used, used + size));

  void *raw = NULL;
  size_t bytes = HB_ALIGN + (size ? size : 1);
  int rc = posix_memalign(&raw, HB_ALIGN, bytes);
  if (rc != 0) {
    dmem_atomic_sub_relaxed(&hb->used, size);
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "host backend device_alloc(%zu): posix_memalign: %s",
                       size, strerror(rc));
  }
  hb_alloc_header_t *h = (hb_alloc_header_t *)raw;
  h->magic = HB_ALLOC_MAGIC;
  h->size = size;
  unsigned char *p = (unsigned char *)raw + HB_ALIGN;
  memset(p, HB_POISON, size);
  dmem_atomic_add_relaxed(&hb->live_allocs, 1);
  *ptr_out = p;
  return DMEM_OK;
}

static dmem_status_t hb_device_free(dmem__backend_t *be, void *ptr) {
  hb_backend_t *hb = hb_of(be);
  if (!ptr) return DMEM_OK;
  if ((uintptr_t)ptr % HB_ALIGN != 0)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend device_free(%p): not a device allocation", ptr);
  void *raw = (unsigned char *)ptr - HB_ALIGN;
  hb_alloc_header_t *h = (hb_alloc_header_t *)raw;
  if (h->magic != HB_ALLOC_MAGIC)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend device_free(%p): not a live device allocation", ptr);
  h->magic = 0;
  dmem_atomic_sub_relaxed(&hb->used, h->size);
  dmem_atomic_sub_relaxed(&hb->live_allocs, 1);
  free(raw);
  return DMEM_OK;
}

static dmem_status_t hb_host_alloc(dmem__backend_t *be, size_t size, void **ptr_out) {
  (void)be;
  if (!ptr_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend host_alloc: ptr_out NULL");
  void *p = NULL;
  int rc = posix_memalign(&p, HB_ALIGN, size ? size : 1);
  if (rc != 0)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                       "host backend host_alloc(%zu): posix_memalign: %s", size, strerror(rc));
  *ptr_out = p;
  return DMEM_OK;
}

static dmem_status_t hb_host_free(dmem__backend_t *be, void *ptr) {
  (void)be;
  free(ptr);
  return DMEM_OK;
}

static dmem_status_t hb_make_current(dmem__backend_t *be) {
  (void)be; /* simulated device memory is host memory: every thread sees it */
  return DMEM_OK;
}

static dmem_status_t hb_ipc_handle(dmem__backend_t *be, void *base, void *handle_out) {
  (void)be;
  (void)base;
  (void)handle_out;
  return dmem__error(DMEM_ERR_NO_DEVICE,
                     "host backend: no CUDA IPC (device memory is this process's host memory)");
}

static dmem_status_t hb_mem_info(dmem__backend_t *be, size_t *free_out, size_t *total_out) {
  hb_backend_t *hb = hb_of(be);
  size_t used = dmem_atomic_load_relaxed(&hb->used);
  if (free_out) *free_out = hb->capacity - used;
  if (total_out) *total_out = hb->capacity;
  return DMEM_OK;
}

/* ---- virtual memory (the CUDA VMM simulation) ------------------------------ */

/* Charge size bytes against the capacity (as device_alloc does). */
static bool hb_capacity_take(hb_backend_t *hb, size_t size, size_t *used_out) {
  /* acq_rel only because atomic.h offers no relaxed CAS; no partner */
  size_t used = dmem_atomic_load_relaxed(&hb->used);
  do {
    if (size > hb->capacity - used) {
      *used_out = used;
      return false;
    }
  } while (!dmem_atomic_cas_acq_rel(&hb->used, &used, used + size));
  return true;
}

static dmem_status_t hb_vmm_granularity(dmem__backend_t *be, size_t *granularity_out) {
  if (!granularity_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend vmm_granularity: NULL argument");
  *granularity_out = hb_of(be)->vmm_granularity;
  return DMEM_OK;
}

static bool hb_vmm_aligned(hb_backend_t *hb, const void *va, size_t size) {
  return size > 0 && size % hb->vmm_granularity == 0 &&
         (uintptr_t)va % hb->vmm_granularity == 0;
}

/* The reservation holding [va, va + size) (vmm_mu held), or NULL. */
static hb_va_t *hb_va_find(hb_backend_t *hb, const void *va, size_t size) {
  const unsigned char *p = va;
  for (hb_va_t *r = hb->vas; r; r = r->next)
    if (p >= r->base && p < r->base + r->size) return size <= (size_t)(r->base + r->size - p) ? r : NULL;
  return NULL;
}

static hb_phys_t *hb_phys_find(hb_backend_t *hb, uint64_t handle) {
  for (hb_phys_t *m = hb->phys; m; m = m->next)
    if ((uint64_t)(uintptr_t)m == handle) return m;
  return NULL;
}

static void hb_phys_unlink(hb_backend_t *hb, hb_phys_t *m) {
  for (hb_phys_t **pp = &hb->phys; *pp; pp = &(*pp)->next)
    if (*pp == m) {
      *pp = m->next;
      break;
    }
  dmem_atomic_sub_relaxed(&hb->used, m->size);
  free(m);
}

static dmem_status_t hb_va_reserve(dmem__backend_t *be, size_t size, void **va_out) {
  hb_backend_t *hb = hb_of(be);
  if (!va_out || !hb_vmm_aligned(hb, NULL, size))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend va_reserve(%zu): size not a multiple of %zu, or NULL", size,
                       hb->vmm_granularity);
  hb_va_t *r = calloc(1, sizeof *r);
  if (!r) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend va_reserve: calloc");
  /* one granule more, to align the start to the granularity */
  size_t span = size + hb->vmm_granularity;
  unsigned char *raw =
      mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    int e = errno;
    free(r);
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "host backend va_reserve(%zu): mmap: %s", size,
                       strerror(e));
  }
  uintptr_t g = hb->vmm_granularity;
  unsigned char *base = (unsigned char *)(((uintptr_t)raw + g - 1) / g * g);
  if (base > raw) munmap(raw, (size_t)(base - raw));
  if (base + size < raw + span) munmap(base + size, (size_t)(raw + span - (base + size)));
  r->base = base;
  r->size = size;
  pthread_mutex_lock(&hb->vmm_mu);
  r->next = hb->vas;
  hb->vas = r;
  pthread_mutex_unlock(&hb->vmm_mu);
  *va_out = base;
  return DMEM_OK;
}

static dmem_status_t hb_va_free(dmem__backend_t *be, void *va, size_t size) {
  hb_backend_t *hb = hb_of(be);
  pthread_mutex_lock(&hb->vmm_mu);
  hb_va_t **pp = &hb->vas;
  while (*pp && ((*pp)->base != va || (*pp)->size != size)) pp = &(*pp)->next;
  hb_va_t *r = *pp;
  if (!r || r->mapped) {
    pthread_mutex_unlock(&hb->vmm_mu);
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend va_free(%p, %zu): %s", va, size,
                       r ? "memory is still mapped in the range" : "not a whole reserved range");
  }
  *pp = r->next;
  pthread_mutex_unlock(&hb->vmm_mu);
  munmap(r->base, r->size);
  free(r);
  return DMEM_OK;
}

static dmem_status_t hb_mem_create(dmem__backend_t *be, size_t size, uint64_t *handle_out) {
  hb_backend_t *hb = hb_of(be);
  if (!handle_out || !hb_vmm_aligned(hb, NULL, size))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend mem_create(%zu): size not a multiple of %zu, or NULL", size,
                       hb->vmm_granularity);
  size_t used = 0;
  if (!hb_capacity_take(hb, size, &used))
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY,
                       "host backend mem_create(%zu): %zu of %zu bytes in use", size, used,
                       hb->capacity);
  hb_phys_t *m = calloc(1, sizeof *m);
  if (!m) {
    dmem_atomic_sub_relaxed(&hb->used, size);
    return dmem__error(DMEM_ERR_OUT_OF_MEMORY, "host backend mem_create(%zu): calloc", size);
  }
  m->size = size;
  pthread_mutex_lock(&hb->vmm_mu);
  m->next = hb->phys;
  hb->phys = m;
  pthread_mutex_unlock(&hb->vmm_mu);
  *handle_out = (uint64_t)(uintptr_t)m;
  return DMEM_OK;
}

static dmem_status_t hb_mem_release(dmem__backend_t *be, uint64_t handle) {
  hb_backend_t *hb = hb_of(be);
  pthread_mutex_lock(&hb->vmm_mu);
  hb_phys_t *m = hb_phys_find(hb, handle);
  if (!m || m->released) {
    pthread_mutex_unlock(&hb->vmm_mu);
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend mem_release(0x%llx): not a live allocation",
                       (unsigned long long)handle);
  }
  if (m->mapped_in)
    m->released = true; /* freed when unmapped, as CUDA does */
  else
    hb_phys_unlink(hb, m);
  pthread_mutex_unlock(&hb->vmm_mu);
  return DMEM_OK;
}

static dmem_status_t hb_mem_map(dmem__backend_t *be, void *va, size_t size, uint64_t handle) {
  hb_backend_t *hb = hb_of(be);
  if (!hb_vmm_aligned(hb, va, size))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend mem_map(%p, %zu): not aligned to %zu", va, size,
                       hb->vmm_granularity);
  pthread_mutex_lock(&hb->vmm_mu);
  hb_va_t *r = hb_va_find(hb, va, size);
  hb_phys_t *m = hb_phys_find(hb, handle);
  const char *why = !r               ? "not inside a reserved range"
                    : r->mapped      ? "the range already has memory mapped"
                    : !m             ? "not a live allocation"
                    : m->released    ? "the allocation was released"
                    : m->mapped_in   ? "the allocation is mapped elsewhere"
                    : m->size != size ? "size differs from the allocation's"
                                      : NULL;
  if (!why) {
    r->mapped = m;
    r->map_at = va;
    r->map_size = size;
    m->mapped_in = r;
  }
  pthread_mutex_unlock(&hb->vmm_mu);
  if (why)
    return dmem__error(DMEM_ERR_DEVICE, "host backend mem_map(%p, %zu, 0x%llx): %s", va, size,
                       (unsigned long long)handle, why);
  return DMEM_OK;
}

static dmem_status_t hb_mem_set_access(dmem__backend_t *be, void *va, size_t size) {
  hb_backend_t *hb = hb_of(be);
  pthread_mutex_lock(&hb->vmm_mu);
  hb_va_t *r = hb_va_find(hb, va, size);
  bool ok = r && r->mapped && r->map_at == va && r->map_size == size;
  pthread_mutex_unlock(&hb->vmm_mu);
  if (!ok)
    return dmem__error(DMEM_ERR_DEVICE, "host backend mem_set_access(%p, %zu): not one mapping",
                       va, size);
  if (mprotect(va, size, PROT_READ | PROT_WRITE) != 0)
    return dmem__error(DMEM_ERR_DEVICE, "host backend mem_set_access(%p, %zu): mprotect: %s", va,
                       size, strerror(errno));
  memset(va, HB_POISON, size); /* new physical memory: undefined bytes */
  return DMEM_OK;
}

/* Discard and protect [va, va + size): a reservation again. */
static void hb_va_protect(void *va, size_t size) {
  (void)madvise(va, size, MADV_DONTNEED);
  (void)mprotect(va, size, PROT_NONE);
}

static dmem_status_t hb_mem_unmap(dmem__backend_t *be, void *va, size_t size) {
  hb_backend_t *hb = hb_of(be);
  pthread_mutex_lock(&hb->vmm_mu);
  hb_va_t *r = hb_va_find(hb, va, size);
  bool ok = r && r->mapped && r->map_at == va && r->map_size == size;
  if (ok) {
    hb_phys_t *m = r->mapped;
    r->mapped = NULL;
    m->mapped_in = NULL;
    if (m->released) hb_phys_unlink(hb, m);
    hb_va_protect(va, size);
  }
  pthread_mutex_unlock(&hb->vmm_mu);
  if (!ok)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend mem_unmap(%p, %zu): not one mapping", va, size);
  return DMEM_OK;
}

/* Destroy: what the runtime left (nothing, unless a failure left it). */
static size_t hb_vmm_free_all(hb_backend_t *hb) {
  size_t n = 0;
  for (hb_va_t *r = hb->vas, *next; r; r = next, n++) {
    next = r->next;
    munmap(r->base, r->size);
    free(r);
  }
  for (hb_phys_t *m = hb->phys, *next; m; m = next, n++) {
    next = m->next;
    dmem_atomic_sub_relaxed(&hb->used, m->size);
    free(m);
  }
  hb->vas = NULL;
  hb->phys = NULL;
  return n;
}

/* ---- events ----------------------------------------------------------------- */

/* Whether record `seq` has run (event mu held). The pending list is sorted by
 * seq, so the scan stops at the first larger one. */
static bool hb_event_done_locked(const hb_event_t *e, uint64_t seq) {
  for (const hb_op_t *op = e->pending_head; op; op = op->u.ev.next_pending) {
    if (op->u.ev.seq == seq) return false;
    if (op->u.ev.seq > seq) break;
  }
  return true;
}

static void hb_event_free(hb_event_t *e) {
  pthread_cond_destroy(&e->cv);
  pthread_mutex_destroy(&e->mu);
  free(e);
}

/* Drop one reference (event mu not held); frees the event on the last one. */
static void hb_event_unref(hb_event_t *e) {
  pthread_mutex_lock(&e->mu);
  bool last = --e->refs == 0;
  pthread_mutex_unlock(&e->mu);
  if (last) hb_event_free(e);
}

static dmem_status_t hb_event_get(void *event, hb_event_t **e_out) {
  hb_event_t *e = (hb_event_t *)event;
  if (!e || e->magic != HB_EVENT_MAGIC)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%p is not a host-backend event", event);
  *e_out = e;
  return DMEM_OK;
}

static dmem_status_t hb_event_create(dmem__backend_t *be, void **event_out) {
  hb_backend_t *hb = hb_of(be);
  if (!event_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend event_create: event_out NULL");
  hb_event_t *e = calloc(1, sizeof *e);
  if (!e)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend event_create: calloc failed");
  int rc = pthread_mutex_init(&e->mu, NULL);
  if (rc != 0) goto fail_free;
  rc = pthread_cond_init(&e->cv, NULL);
  if (rc != 0) goto fail_mutex;
  e->refs = 1;
  e->magic = HB_EVENT_MAGIC;
  dmem_atomic_add_relaxed(&hb->live_events, 1);
  *event_out = e;
  return DMEM_OK;

fail_mutex:
  pthread_mutex_destroy(&e->mu);
fail_free:
  free(e);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend event_create: pthread init: %s",
                     strerror(rc));
}

static dmem_status_t hb_event_destroy(dmem__backend_t *be, void *event) {
  hb_backend_t *hb = hb_of(be);
  hb_event_t *e = NULL;
  dmem_status_t st = hb_event_get(event, &e);
  if (st != DMEM_OK) return st;
  e->magic = 0; /* queued records and waits keep it alive until they have run */
  dmem_atomic_sub_relaxed(&hb->live_events, 1);
  hb_event_unref(e);
  return DMEM_OK;
}

static dmem_status_t hb_event_query(dmem__backend_t *be, void *event) {
  (void)be;
  hb_event_t *e = NULL;
  dmem_status_t st = hb_event_get(event, &e);
  if (st != DMEM_OK) return st;
  pthread_mutex_lock(&e->mu);
  /* The last record has the largest seq, so it is pending iff it is the tail. */
  bool done = !e->pending_tail || e->pending_tail->u.ev.seq != e->target;
  pthread_mutex_unlock(&e->mu);
  return done ? DMEM_OK : DMEM_ERR_BUSY;
}

static dmem_status_t hb_event_synchronize(dmem__backend_t *be, void *event) {
  (void)be;
  hb_event_t *e = NULL;
  dmem_status_t st = hb_event_get(event, &e);
  if (st != DMEM_OK) return st;
  pthread_mutex_lock(&e->mu);
  uint64_t seq = e->target;
  while (!hb_event_done_locked(e, seq)) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
  return DMEM_OK;
}

/* ---- streams --------------------------------------------------------------- */

/* A copy's time on the simulated link (after its memcpy): n / gbps ns. */
static void hb_copy_wait(double gbps, size_t n) {
  if (gbps <= 0) return;
  double ns = (double)n / gbps;
  struct timespec ts = {.tv_sec = (time_t)(ns / 1e9), .tv_nsec = (long)((uint64_t)ns % 1000000000u)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static void hb_op_run(const hb_backend_t *hb, hb_op_t *op) {
  DMEM_SCHED_POINT(); /* the schedule fuzzer may delay the stream (base/sched.h) */
  switch (op->kind) {
    case HB_OP_COPY:
      memcpy(op->u.copy.dst, op->u.copy.src, op->u.copy.n);
      hb_copy_wait(hb->copy_gbps, op->u.copy.n);
      break;
    case HB_OP_HOST_FUNC:
      op->u.func.fn(op->u.func.user);
      break;
    case HB_OP_RECORD: {
      hb_event_t *e = op->u.ev.event;
      pthread_mutex_lock(&e->mu);
      if (op->u.ev.prev_pending)
        op->u.ev.prev_pending->u.ev.next_pending = op->u.ev.next_pending;
      else
        e->pending_head = op->u.ev.next_pending;
      if (op->u.ev.next_pending)
        op->u.ev.next_pending->u.ev.prev_pending = op->u.ev.prev_pending;
      else
        e->pending_tail = op->u.ev.prev_pending;
      pthread_cond_broadcast(&e->cv);
      pthread_mutex_unlock(&e->mu);
      hb_event_unref(e);
      break;
    }
    case HB_OP_WAIT: {
      hb_event_t *e = op->u.ev.event;
      pthread_mutex_lock(&e->mu);
      while (!hb_event_done_locked(e, op->u.ev.seq)) pthread_cond_wait(&e->cv, &e->mu);
      pthread_mutex_unlock(&e->mu);
      hb_event_unref(e);
      break;
    }
  }
}

static void *hb_stream_main(void *arg) {
  hb_stream_t *s = (hb_stream_t *)arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->stopping) pthread_cond_wait(&s->work_cv, &s->mu);
    hb_op_t *op = s->head;
    if (!op) break; /* stopping and drained */
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    pthread_mutex_unlock(&s->mu);
    hb_op_run(s->be, op);
    free(op);
    pthread_mutex_lock(&s->mu);
    s->done++;
    pthread_cond_broadcast(&s->done_cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* Append op (stream mu held). */
static void hb_stream_push_locked(hb_stream_t *s, hb_op_t *op) {
  op->next = NULL;
  if (s->tail)
    s->tail->next = op;
  else
    s->head = op;
  s->tail = op;
  s->enqueued++;
  pthread_cond_signal(&s->work_cv);
}

static dmem_status_t hb_stream_get(hb_backend_t *hb, void *stream, hb_stream_t **s_out) {
  if (!stream) {
    *s_out = hb->default_stream;
    return DMEM_OK;
  }
  hb_stream_t *s = (hb_stream_t *)stream;
  if (s->magic != HB_STREAM_MAGIC || s->be != hb)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%p is not a host-backend stream", stream);
  *s_out = s;
  return DMEM_OK;
}

static hb_op_t *hb_op_new(hb_op_kind_t kind, const char *what) {
  hb_op_t *op = calloc(1, sizeof *op);
  if (!op) {
    dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend %s: allocating the queue entry failed",
                what);
    return NULL;
  }
  op->kind = kind;
  return op;
}

static dmem_status_t hb_stream_new(hb_backend_t *hb, hb_stream_t **s_out) {
  hb_stream_t *s = calloc(1, sizeof *s);
  if (!s)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend stream_create: calloc failed");
  const char *what = "pthread_mutex_init";
  int rc = pthread_mutex_init(&s->mu, NULL);
  if (rc != 0) goto fail_free;
  what = "pthread_cond_init";
  rc = pthread_cond_init(&s->work_cv, NULL);
  if (rc != 0) goto fail_mutex;
  rc = pthread_cond_init(&s->done_cv, NULL);
  if (rc != 0) goto fail_work_cv;
  s->be = hb;
  s->magic = HB_STREAM_MAGIC;
  what = "pthread_create";
  rc = pthread_create(&s->thread, NULL, hb_stream_main, s);
  if (rc != 0) goto fail_done_cv;

  pthread_mutex_lock(&hb->streams_mu);
  s->next = hb->streams;
  if (hb->streams) hb->streams->prev = s;
  hb->streams = s;
  pthread_mutex_unlock(&hb->streams_mu);
  *s_out = s;
  return DMEM_OK;

fail_done_cv:
  pthread_cond_destroy(&s->done_cv);
fail_work_cv:
  pthread_cond_destroy(&s->work_cv);
fail_mutex:
  pthread_mutex_destroy(&s->mu);
fail_free:
  free(s);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend stream_create: %s: %s", what,
                     strerror(rc));
}

/* Drain, join and free a stream already unlinked from the backend's list. */
static void hb_stream_free(hb_stream_t *s) {
  pthread_mutex_lock(&s->mu);
  s->stopping = true;
  pthread_cond_signal(&s->work_cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  s->magic = 0;
  pthread_cond_destroy(&s->done_cv);
  pthread_cond_destroy(&s->work_cv);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

static dmem_status_t hb_stream_create(dmem__backend_t *be, void **stream_out) {
  if (!stream_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend stream_create: stream_out NULL");
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_stream_new(hb_of(be), &s);
  if (st != DMEM_OK) return st;
  *stream_out = s;
  return DMEM_OK;
}

static dmem_status_t hb_stream_destroy(dmem__backend_t *be, void *stream) {
  hb_backend_t *hb = hb_of(be);
  if (!stream)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend stream_destroy: the default stream cannot be destroyed");
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_stream_get(hb, stream, &s);
  if (st != DMEM_OK) return st;
  s->magic = 0;
  pthread_mutex_lock(&hb->streams_mu);
  if (s->prev)
    s->prev->next = s->next;
  else
    hb->streams = s->next;
  if (s->next) s->next->prev = s->prev;
  pthread_mutex_unlock(&hb->streams_mu);
  hb_stream_free(s);
  return DMEM_OK;
}

static dmem_status_t hb_stream_synchronize(dmem__backend_t *be, void *stream) {
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_stream_get(hb_of(be), stream, &s);
  if (st != DMEM_OK) return st;
  pthread_mutex_lock(&s->mu);
  uint64_t target = s->enqueued;
  while (s->done < target) pthread_cond_wait(&s->done_cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return DMEM_OK;
}

static dmem_status_t hb_stream_query(dmem__backend_t *be, void *stream) {
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_stream_get(hb_of(be), stream, &s);
  if (st != DMEM_OK) return st;
  pthread_mutex_lock(&s->mu);
  bool idle = s->done >= s->enqueued;
  pthread_mutex_unlock(&s->mu);
  return idle ? DMEM_OK : DMEM_ERR_BUSY;
}

static dmem_status_t hb_memcpy_async(dmem__backend_t *be, void *dst, const void *src, size_t n,
                                     void *stream) {
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_stream_get(hb_of(be), stream, &s);
  if (st != DMEM_OK) return st;
  if (n == 0) return DMEM_OK;
  if (!dst || !src)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "host backend memcpy_async(%p, %p, %zu): NULL pointer", dst, src, n);
  hb_op_t *op = hb_op_new(HB_OP_COPY, "memcpy_async");
  if (!op) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  op->u.copy.dst = dst;
  op->u.copy.src = src;
  op->u.copy.n = n;
  pthread_mutex_lock(&s->mu);
  hb_stream_push_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return DMEM_OK;
}

static dmem_status_t hb_launch_host_func(dmem__backend_t *be, void *stream, void (*fn)(void *),
                                         void *user) {
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_stream_get(hb_of(be), stream, &s);
  if (st != DMEM_OK) return st;
  if (!fn) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend launch_host_func: fn NULL");
  hb_op_t *op = hb_op_new(HB_OP_HOST_FUNC, "launch_host_func");
  if (!op) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  op->u.func.fn = fn;
  op->u.func.user = user;
  pthread_mutex_lock(&s->mu);
  hb_stream_push_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return DMEM_OK;
}

static dmem_status_t hb_event_record(dmem__backend_t *be, void *event, void *stream) {
  hb_event_t *e = NULL;
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_event_get(event, &e);
  if (st != DMEM_OK) return st;
  st = hb_stream_get(hb_of(be), stream, &s);
  if (st != DMEM_OK) return st;
  hb_op_t *op = hb_op_new(HB_OP_RECORD, "event_record");
  if (!op) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  op->u.ev.event = e;
  /* Numbering and queueing under both locks: a wait captured on this stream
   * always finds its record queued ahead of it, so waits cannot deadlock. */
  pthread_mutex_lock(&s->mu);
  pthread_mutex_lock(&e->mu);
  op->u.ev.seq = ++e->target;
  op->u.ev.prev_pending = e->pending_tail;
  if (e->pending_tail)
    e->pending_tail->u.ev.next_pending = op;
  else
    e->pending_head = op;
  e->pending_tail = op;
  e->refs++;
  pthread_mutex_unlock(&e->mu);
  hb_stream_push_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return DMEM_OK;
}

static dmem_status_t hb_stream_wait_event(dmem__backend_t *be, void *stream, void *event) {
  hb_event_t *e = NULL;
  hb_stream_t *s = NULL;
  dmem_status_t st = hb_event_get(event, &e);
  if (st != DMEM_OK) return st;
  st = hb_stream_get(hb_of(be), stream, &s);
  if (st != DMEM_OK) return st;
  hb_op_t *op = hb_op_new(HB_OP_WAIT, "stream_wait_event");
  if (!op) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  pthread_mutex_lock(&s->mu);
  pthread_mutex_lock(&e->mu);
  uint64_t seq = e->target;
  bool done = hb_event_done_locked(e, seq);
  if (!done) e->refs++;
  pthread_mutex_unlock(&e->mu);
  if (!done) {
    op->u.ev.event = e;
    op->u.ev.seq = seq;
    hb_stream_push_locked(s, op);
    op = NULL;
  }
  pthread_mutex_unlock(&s->mu);
  free(op); /* the record already ran: nothing to wait for */
  return DMEM_OK;
}

/* ---- the backend -------------------------------------------------------------- */

static void hb_destroy(dmem__backend_t *be) {
  hb_backend_t *hb = hb_of(be);
  if (!hb) return;
  /* Streams the runtime left alive, the default one included: drain and join
   * each. Waits only target records queued before them, so draining one at a
   * time always makes progress. */
  for (;;) {
    pthread_mutex_lock(&hb->streams_mu);
    hb_stream_t *s = hb->streams;
    if (s) {
      hb->streams = s->next;
      if (s->next) s->next->prev = NULL;
    }
    pthread_mutex_unlock(&hb->streams_mu);
    if (!s) break;
    s->magic = 0;
    hb_stream_free(s);
  }
  size_t vmm = hb_vmm_free_all(hb);
  size_t allocs = dmem_atomic_load_relaxed(&hb->live_allocs) + vmm;
  size_t events = dmem_atomic_load_relaxed(&hb->live_events);
  if (allocs || events)
    DMEM_LOG_AT(DMEM_LOG_WARN,
                "host backend destroyed with %zu device allocations (%zu bytes) "
                "and %zu events still live",
                allocs, dmem_atomic_load_relaxed(&hb->used), events);
  pthread_mutex_destroy(&hb->vmm_mu);
  pthread_mutex_destroy(&hb->streams_mu);
  free(hb);
}

dmem_status_t dmem__backend_host_create(const dmem_config_t *cfg, dmem__backend_t **be_out) {
  if (!be_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "host backend create: be_out NULL");
  hb_backend_t *hb = calloc(1, sizeof *hb);
  if (!hb) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend create: calloc failed");
  int rc = pthread_mutex_init(&hb->streams_mu, NULL);
  if (rc != 0) {
    free(hb);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend create: pthread_mutex_init: %s",
                       strerror(rc));
  }
  rc = pthread_mutex_init(&hb->vmm_mu, NULL);
  if (rc != 0) {
    pthread_mutex_destroy(&hb->streams_mu);
    free(hb);
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "host backend create: pthread_mutex_init: %s",
                       strerror(rc));
  }
  long page = sysconf(_SC_PAGESIZE);
  hb->vmm_granularity = page > (64 << 10) ? (size_t)page : (size_t)64 << 10;
  hb->capacity =
      (cfg && cfg->host_backend_capacity) ? cfg->host_backend_capacity : HB_DEFAULT_CAPACITY;
  const char *gbps = getenv("DMEM_HOST_COPY_GBPS");
  hb->copy_gbps = gbps ? strtod(gbps, NULL) : 0;
  if (!(hb->copy_gbps > 0)) hb->copy_gbps = 0;
  atomic_init(&hb->used, 0);
  atomic_init(&hb->live_allocs, 0);
  atomic_init(&hb->live_events, 0);

  dmem__backend_t *b = &hb->base;
  b->name = "host";
  b->kind = DMEM_BACKEND_HOST;
  b->device_capacity = hb->capacity;
  b->host_chunk_min = (size_t)4 << 20;
  b->device_alloc = hb_device_alloc;
  b->device_free = hb_device_free;
  b->host_alloc = hb_host_alloc;
  b->host_free = hb_host_free;
  b->memcpy_async = hb_memcpy_async;
  b->stream_create = hb_stream_create;
  b->stream_destroy = hb_stream_destroy;
  b->stream_synchronize = hb_stream_synchronize;
  b->stream_query = hb_stream_query;
  b->stream_wait_event = hb_stream_wait_event;
  b->launch_host_func = hb_launch_host_func;
  b->event_create = hb_event_create;
  b->event_destroy = hb_event_destroy;
  b->event_record = hb_event_record;
  b->event_query = hb_event_query;
  b->event_synchronize = hb_event_synchronize;
  b->make_current = hb_make_current;
  b->ipc_handle = hb_ipc_handle;
  b->mem_info = hb_mem_info;
  b->vmm_granularity = hb_vmm_granularity;
  b->va_reserve = hb_va_reserve;
  b->va_free = hb_va_free;
  b->mem_create = hb_mem_create;
  b->mem_release = hb_mem_release;
  b->mem_map = hb_mem_map;
  b->mem_set_access = hb_mem_set_access;
  b->mem_unmap = hb_mem_unmap;
  b->destroy = hb_destroy;

  dmem_status_t st = hb_stream_new(hb, &hb->default_stream);
  if (st != DMEM_OK) {
    pthread_mutex_destroy(&hb->vmm_mu);
    pthread_mutex_destroy(&hb->streams_mu);
    free(hb);
    return st;
  }
  *be_out = b;
  return DMEM_OK;
}
