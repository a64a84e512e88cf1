/*
 * pybridge/py_runtime.c - dmem.Runtime: creation from keyword arguments, close
 * (waiting for calls in flight), alloc, streams, eviction and statistics,
 * and the list of open runtimes that py_module.c closes at exit or disowns in a
 * forked child.
 *
 * The launch entry points are in py_launch.c and the controller methods in
 * py_controller.c; this file's method table lists them with its own.
 */
#include "pydmem.h"

#include <time.h>

pyd_runtime_t *pyd_live_runtimes = NULL;

/* ---- creation and close ------------------------------------------------------- */

static void pyd_live_link(pyd_runtime_t *r) {
  r->live_prev = NULL;
  r->live_next = pyd_live_runtimes;
  if (pyd_live_runtimes) pyd_live_runtimes->live_prev = r;
  pyd_live_runtimes = r;
}

static void pyd_live_unlink(pyd_runtime_t *r) {
  if (r->live_prev) r->live_prev->live_next = r->live_next;
  else if (pyd_live_runtimes == r) pyd_live_runtimes = r->live_next;
  if (r->live_next) r->live_next->live_prev = r->live_prev;
  r->live_prev = r->live_next = NULL;
}

/* Keep the runtime's backend_reason (dmem_runtime_info) in self. */
static void pyd_runtime_keep_reason(pyd_runtime_t *self) {
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  if (dmem_runtime_info(self->rt, &info) == DMEM_OK)
    snprintf(self->backend_reason, sizeof self->backend_reason, "%s", info.backend_reason);
}

static PyObject *pyd_runtime_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  PyObject *dir_bytes = NULL; /* what cfg's strings point into (spill_dir) */
  if (pyd_config_parse(args, kwds, "Runtime", 0, &cfg, &dir_bytes, NULL) < 0) return NULL;

  pyd_runtime_t *self = (pyd_runtime_t *)type->tp_alloc(type, 0);
  if (!self) {
    Py_XDECREF(dir_bytes);
    return NULL;
  }
  dmem_runtime_t *rt = NULL;
  dmem_status_t st;
  Py_BEGIN_ALLOW_THREADS
  st = dmem_runtime_create(&cfg, &rt);
  Py_END_ALLOW_THREADS
  Py_XDECREF(dir_bytes);
  if (st != DMEM_OK) {
    Py_DECREF(self);
    return pyd_raise(st, NULL);
  }
  self->rt = rt;
  self->backend = dmem_runtime_backend(rt);
  self->device = cfg.device;
  pyd_runtime_keep_reason(self);
  pyd_live_link(self);
  return (PyObject *)self;
}

/* Close: refuse new calls, wait for the calls in flight (GIL released while
 * waiting), stop controller callbacks, destroy. timeout_s < 0: wait as long
 * as needed. Returns -1 with BusyError if it cannot close (called from a
 * callback of this runtime, exports of its views still alive, or calls still
 * in flight at the timeout). */
int pyd_runtime_close_impl(pyd_runtime_t *self, double timeout_s) {
  if (!self->rt) return 0;
  if (self->is_default) {
    pyd_raise(DMEM_ERR_INVALID_ARGUMENT,
              "the default runtime lives until the process exits (allocator hooks free into "
              "it until then): it cannot be closed");
    return -1;
  }
  for (pyd_ctx_t *c = pyd_tls_ctx; c; c = c->prev) {
    if (c->rt == self) {
      pyd_raise(DMEM_ERR_BUSY, "Runtime.close() called from a callback of this runtime");
      return -1;
    }
  }
  /* Destroying would free memory under live exports. Those only garbage
   * cycles still hold (a traceback's frame holding a view, say) go first. */
  if (self->exposed) PyGC_Collect();
  if (self->exposed) {
    pyd_view_raise_exposed(self, 0, "Runtime.close()");
    return -1;
  }
  int was_closing = self->closing;
  self->closing = 1;
  double waited = 0.0;
  while (self->active > 0) {
    if (timeout_s >= 0 && waited >= timeout_s) {
      self->closing = was_closing;
      pyd_raise(DMEM_ERR_BUSY, "Runtime.close(): calls still in flight on other threads");
      return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts = {0, 200 * 1000};
    nanosleep(&ts, NULL);
    Py_END_ALLOW_THREADS
    waited += 200e-6;
  }
  if (!self->rt) return 0; /* closed by another thread while we waited */
  dmem_runtime_t *rt = self->rt;
  pyd_bindings_mark_closing(self);
  /* destroy may deliver FREE events to the controller (GIL taken there). */
  Py_BEGIN_ALLOW_THREADS
  dmem_runtime_destroy(rt);
  Py_END_ALLOW_THREADS
  self->rt = NULL;
  pyd_bindings_free(self);
  pyd_live_unlink(self);
  return 0;
}

static PyObject *pyd_runtime_close(pyd_runtime_t *self, PyObject *unused) {
  if (pyd_runtime_close_impl(self, -1.0) < 0) return NULL;
  Py_RETURN_NONE;
}

static int pyd_runtime_traverse(pyd_runtime_t *self, visitproc visit, void *arg) {
  return pyd_bindings_traverse(self, visit, arg);
}

static int pyd_runtime_clear(pyd_runtime_t *self) {
  pyd_bindings_clear(self);
  return 0;
}

static void pyd_runtime_dealloc(pyd_runtime_t *self) {
  PyObject_GC_UnTrack(self);
  if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
  if (self->rt && !self->is_default) {
    /* No Buffer, Stream or call refers to us any more: nothing in flight. */
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    self->active = 0;
    self->closing = 0;
    if (pyd_runtime_close_impl(self, 0.0) < 0) PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(et, ev, etb);
  }
  pyd_bindings_free(self);
  pyd_live_unlink(self);
  PyTypeObject *tp = Py_TYPE(self);
  tp->tp_free((PyObject *)self);
  if (tp->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(tp);
}

static PyObject *pyd_runtime_enter(pyd_runtime_t *self, PyObject *unused) {
  if (pyd_runtime_check(self) < 0) return NULL;
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *pyd_runtime_exit(pyd_runtime_t *self, PyObject *args) {
  PyObject *et, *ev, *tb;
  if (!PyArg_UnpackTuple(args, "__exit__", 3, 3, &et, &ev, &tb)) return NULL;
  if (self->is_default) Py_RETURN_FALSE; /* `with dmem.default_runtime() as rt:` keeps it */
  if (pyd_runtime_close_impl(self, -1.0) < 0) return NULL;
  Py_RETURN_FALSE;
}

/* ---- calls -------------------------------------------------------------------- */

/* alloc(nbytes, *, priority=0, pinned=False, stable=False): the hot path; keep it thin. */
static PyObject *pyd_runtime_alloc(pyd_runtime_t *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
  PyObject *size_o = nargs >= 1 ? args[0] : NULL, *prio_o = NULL, *pinned_o = NULL,
           *stable_o = NULL;
  if (nargs > 1) {
    PyErr_Format(PyExc_TypeError, "alloc() takes 1 positional argument but %zd were given",
                 nargs);
    return NULL;
  }
  if (kwnames) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nk; i++) {
      PyObject *k = PyTuple_GET_ITEM(kwnames, i), *v = args[nargs + i];
      if (PyUnicode_CompareWithASCIIString(k, "priority") == 0) prio_o = v;
      else if (PyUnicode_CompareWithASCIIString(k, "pinned") == 0) pinned_o = v;
      else if (PyUnicode_CompareWithASCIIString(k, "stable") == 0) stable_o = v;
      else if (PyUnicode_CompareWithASCIIString(k, "nbytes") == 0 && !size_o) size_o = v;
      else {
        PyErr_Format(PyExc_TypeError, "alloc() got an unexpected keyword argument %R", k);
        return NULL;
      }
    }
  }
  if (!size_o) {
    PyErr_SetString(PyExc_TypeError, "alloc() missing required argument 'nbytes'");
    return NULL;
  }
  size_t size;
  if (PyLong_CheckExact(size_o)) {
    size = PyLong_AsSize_t(size_o);
  } else if (PyIndex_Check(size_o) && !PyBool_Check(size_o)) {
    PyObject *idx = PyNumber_Index(size_o);
    if (!idx) return NULL;
    size = PyLong_AsSize_t(idx);
    Py_DECREF(idx);
  } else {
    PyErr_Format(PyExc_TypeError, "nbytes must be an int, not %.100s", Py_TYPE(size_o)->tp_name);
    return NULL;
  }
  if (size == (size_t)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "nbytes must be a non-negative int that fits size_t");
    return NULL;
  }
  int priority = 0;
  if (prio_o && pyd_priority_arg(prio_o, &priority) < 0) return NULL;
  unsigned flags = DMEM_ALLOC_DEFAULT;
  if (pinned_o) {
    int t = PyObject_IsTrue(pinned_o);
    if (t < 0) return NULL;
    if (t) flags |= DMEM_ALLOC_PINNED;
  }
  if (stable_o) {
    int t = PyObject_IsTrue(stable_o);
    if (t < 0) return NULL;
    if (t) flags |= DMEM_BUFFER_STABLE_ADDRESS;
  }
  if (pyd_runtime_check(self) < 0) return NULL;

  pyd_ctx_t ctx;
  dmem_handle_t h = DMEM_HANDLE_NULL;
  dmem_status_t st;
  pyd_enter(&ctx, self, 1);
  st = dmem_buffer_alloc(self->rt, size, flags, &h);
  if (st == DMEM_OK && priority != 0) {
    st = dmem_buffer_set_priority(self->rt, h, priority);
    if (st != DMEM_OK) dmem_buffer_free(self->rt, h);
  }
  pyd_leave(&ctx);
  PyObject *buf = NULL;
  if (st == DMEM_OK) {
    buf = pyd_buffer_new(self, h, size, 1);
    if (!buf) {
      /* Keep the handle from leaking. */
      pyd_ctx_t c2;
      pyd_enter(&c2, self, 0);
      dmem_buffer_free(self->rt, h);
      pyd_leave(&c2);
      Py_XDECREF(ctx.exc);
      return NULL;
    }
  }
  if (pyd_finish(&ctx, st) < 0) {
    Py_XDECREF(buf); /* the allocation is undone: the buffer is freed */
    return NULL;
  }
  return buf;
}

static PyObject *pyd_runtime_stream(pyd_runtime_t *self, PyObject *unused) {
  if (pyd_runtime_check(self) < 0) return NULL;
  return pyd_stream_new(self);
}

static PyObject *pyd_runtime_evict(pyd_runtime_t *self, PyObject *arg) {
  if (!PyLong_Check(arg) || PyBool_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "nbytes must be an int, not %.100s", Py_TYPE(arg)->tp_name);
    return NULL;
  }
  size_t nbytes = PyLong_AsSize_t(arg);
  if (nbytes == (size_t)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "nbytes must be a non-negative int that fits size_t");
    return NULL;
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  size_t freed = 0;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_runtime_evict(self->rt, nbytes, &freed);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  return PyLong_FromSize_t(freed);
}

static PyObject *pyd_runtime_host_trim(pyd_runtime_t *self, PyObject *const *args,
                                       Py_ssize_t nargs) {
  size_t keep = 0;
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "host_trim(keep=0) takes at most one argument");
    return NULL;
  }
  if (nargs == 1) {
    if (!PyLong_Check(args[0]) || PyBool_Check(args[0])) {
      PyErr_Format(PyExc_TypeError, "keep must be an int, not %.100s", Py_TYPE(args[0])->tp_name);
      return NULL;
    }
    keep = PyLong_AsSize_t(args[0]);
    if (keep == (size_t)-1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "keep must be a non-negative int that fits size_t");
      return NULL;
    }
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  size_t released = 0;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_host_trim(self->rt, keep, &released);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  return PyLong_FromSize_t(released);
}

static PyObject *pyd_runtime_poll(pyd_runtime_t *self, PyObject *unused) {
  if (pyd_runtime_check(self) < 0) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_runtime_poll(self->rt);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

/* stats() returns every field of dmem_stats_t: a new field must be added to
 * the dict below (and to STATS_FIELDS in tests/python/test_runtime.py). */
_Static_assert(sizeof(dmem_stats_t) == 16 * sizeof(size_t) + 37 * sizeof(uint64_t) +
                                           11 * sizeof(double) + /* disk tier: */
                                           7 * sizeof(uint64_t) + 2 * sizeof(double) +
                                           /* peaks: */ 4 * sizeof(size_t) +
                                           /* swaps, ahead_arms: */ 2 * sizeof(uint64_t),
               "dmem_stats_t changed: update pyd_runtime_stats");

/* d[key] = {"host": v[1], "disk": v[2], "controller": v[3]}; -1 on error. */
static int stats_tiers_u64(PyObject *d, const char *key, const uint64_t *v) {
  PyObject *t = Py_BuildValue("{s:K,s:K,s:K}", "host", (unsigned long long)v[DMEM_TIER_HOST],
                              "disk", (unsigned long long)v[DMEM_TIER_DISK], "controller",
                              (unsigned long long)v[DMEM_TIER_CONTROLLER]);
  int rc = t ? PyDict_SetItemString(d, key, t) : -1;
  Py_XDECREF(t);
  return rc;
}
static int stats_tiers_f64(PyObject *d, const char *key, const double *v) {
  PyObject *t = Py_BuildValue("{s:d,s:d,s:d}", "host", v[DMEM_TIER_HOST], "disk",
                              v[DMEM_TIER_DISK], "controller", v[DMEM_TIER_CONTROLLER]);
  int rc = t ? PyDict_SetItemString(d, key, t) : -1;
  Py_XDECREF(t);
  return rc;
}

/* The copy-engine / spill-ahead / prefetch / pinned-pool block of
 * dmem_stats_t, added to d. -1 on error. */
static int stats_copy_block(PyObject *d, const dmem_stats_t *s) {
  if (stats_tiers_u64(d, "tier_spill_count", s->tier_spill_count) < 0 ||
      stats_tiers_u64(d, "tier_spill_bytes", s->tier_spill_bytes) < 0 ||
      stats_tiers_f64(d, "tier_spill_seconds", s->tier_spill_seconds) < 0 ||
      stats_tiers_u64(d, "tier_unspill_count", s->tier_unspill_count) < 0 ||
      stats_tiers_u64(d, "tier_unspill_bytes", s->tier_unspill_bytes) < 0 ||
      stats_tiers_f64(d, "tier_unspill_seconds", s->tier_unspill_seconds) < 0)
    return -1;
  PyObject *x = Py_BuildValue(
      "{s:K,s:d,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:n,s:K,s:K,s:K}",
      "room_waits",
      (unsigned long long)s->room_waits, "seconds_waiting_for_room", s->seconds_waiting_for_room,
      "evict_passes", (unsigned long long)s->evict_passes, "ahead_passes",
      (unsigned long long)s->ahead_passes, "ahead_evictions",
      (unsigned long long)s->ahead_evictions, "ahead_bytes", (unsigned long long)s->ahead_bytes,
      "ahead_wakeups", (unsigned long long)s->ahead_wakeups, "ahead_polls",
      (unsigned long long)s->ahead_polls,
      "prefetch_count", (unsigned long long)s->prefetch_count, "prefetch_bytes",
      (unsigned long long)s->prefetch_bytes, "spill_ahead_high", (Py_ssize_t)s->spill_ahead_high,
      "spill_ahead_low", (Py_ssize_t)s->spill_ahead_low, "host_pool_reserved",
      (Py_ssize_t)s->host_pool_reserved, "host_pool_free", (Py_ssize_t)s->host_pool_free,
      "host_pool_grows", (unsigned long long)s->host_pool_grows, "host_pool_background_grows",
      (unsigned long long)s->host_pool_background_grows, "host_pool_trims",
      (unsigned long long)s->host_pool_trims, "host_pageable_used",
      (Py_ssize_t)s->host_pageable_used, "host_pageable_allocs",
      (unsigned long long)s->host_pageable_allocs, "swaps", (unsigned long long)s->swaps,
      "ahead_arms", (unsigned long long)s->ahead_arms);
  if (!x) return -1;
  int rc = PyDict_Update(d, x);
  Py_DECREF(x);
  return rc;
}

static PyObject *pyd_runtime_prefetch(pyd_runtime_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"buffers", "stream", NULL};
  PyObject *bufs_o = NULL, *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:prefetch", kwlist, &bufs_o, &stream_o))
    return NULL;
  if (pyd_runtime_check(self) < 0) return NULL;
  PyObject *seq = PySequence_Fast(bufs_o, "buffers must be a sequence of Buffers");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  dmem_handle_t *hs = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof *hs);
  if (!hs) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    if (pyd_handle_arg(self, PySequence_Fast_GET_ITEM(seq, i), 0, &hs[i]) < 0) {
      PyMem_Free(hs);
      Py_DECREF(seq);
      return NULL;
    }
  }
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(self, stream_o, &s, &keep) < 0) {
    PyMem_Free(hs);
    Py_DECREF(seq);
    return NULL;
  }
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_buffer_prefetch(self->rt, hs, (size_t)n, s);
  pyd_leave(&ctx);
  Py_XDECREF(keep);
  PyMem_Free(hs);
  Py_DECREF(seq); /* after the call: keeps the Buffers (and handles) alive */
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *pyd_runtime_stats(pyd_runtime_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"reset_peaks", NULL};
  int reset = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$p:stats", kwlist, &reset)) return NULL;
  if (pyd_runtime_check(self) < 0) return NULL;
  dmem_stats_t s;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_stats(self->rt, &s);
  if (st == DMEM_OK && reset) st = dmem_stats_reset_peaks(self->rt);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  PyObject *d = Py_BuildValue(
      "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:d,s:d,s:K,s:K,s:n,s:n,s:K,s:K}",
      "device_capacity", (Py_ssize_t)s.device_capacity, "device_limit", (Py_ssize_t)s.device_limit,
      "device_used", (Py_ssize_t)s.device_used, "device_locked", (Py_ssize_t)s.device_locked,
      "device_pinned", (Py_ssize_t)s.device_pinned, "host_used", (Py_ssize_t)s.host_used,
      "disk_used", (Py_ssize_t)s.disk_used, "controller_used", (Py_ssize_t)s.controller_used,
      "buffer_count", (Py_ssize_t)s.buffer_count, "spill_count",
      (unsigned long long)s.spill_count, "unspill_count", (unsigned long long)s.unspill_count,
      "bytes_spilled", (unsigned long long)s.bytes_spilled, "bytes_unspilled",
      (unsigned long long)s.bytes_unspilled, "seconds_spilling", s.seconds_spilling,
      "seconds_unspilling", s.seconds_unspilling, "oom_evictions",
      (unsigned long long)s.oom_evictions, "cancelled_spills",
      (unsigned long long)s.cancelled_spills, "device_reserved", (Py_ssize_t)s.device_reserved,
      "raw_used", (Py_ssize_t)s.raw_used, "pool_hits", (unsigned long long)s.pool_hits,
      "pool_misses", (unsigned long long)s.pool_misses);
  if (d && stats_copy_block(d, &s) < 0) Py_CLEAR(d);
  if (!d) return NULL;
  /* the bridge's own: buffers held by exports of lock views (py_view.c) */
  Py_ssize_t exposed = pyd_view_exposed_buffers(self);
  PyObject *ex = exposed < 0 ? NULL
                             : Py_BuildValue("{s:n,s:{s:n,s:n,s:n}}", "exposed", exposed, "exports",
                                             "buffer", self->exports[PYD_EXPORT_BUFFER],
                                             "array_interface", self->exports[PYD_EXPORT_IFACE],
                                             "dlpack", self->exports[PYD_EXPORT_DLPACK]);
  if (!ex || PyDict_Update(d, ex) < 0) {
    Py_XDECREF(ex);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(ex);
  /* the disk tier */
  PyObject *disk = Py_BuildValue(
      "{s:K,s:K,s:d,s:K,s:K,s:K,s:d,s:K,s:O}", "host_to_disk_count",
      (unsigned long long)s.host_to_disk_count, "host_to_disk_bytes",
      (unsigned long long)s.host_to_disk_bytes, "seconds_host_to_disk", s.seconds_host_to_disk,
      "host_to_disk_pushdowns", (unsigned long long)s.host_to_disk_pushdowns,
      "disk_to_device_count", (unsigned long long)s.disk_to_device_count,
      "disk_to_device_bytes", (unsigned long long)s.disk_to_device_bytes,
      "seconds_disk_to_device", s.seconds_disk_to_device, "disk_write_failures",
      (unsigned long long)s.disk_write_failures, "disk_direct_io",
      s.disk_direct_io ? Py_True : Py_False);
  if (!disk || PyDict_Update(d, disk) < 0) {
    Py_XDECREF(disk);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(disk);
  /* the peaks (before the reset, when reset_peaks) */
  PyObject *peaks = Py_BuildValue("{s:n,s:n,s:n,s:n}", "device_used_peak",
                                  (Py_ssize_t)s.device_used_peak, "host_used_peak",
                                  (Py_ssize_t)s.host_used_peak, "disk_used_peak",
                                  (Py_ssize_t)s.disk_used_peak, "raw_used_peak",
                                  (Py_ssize_t)s.raw_used_peak);
  if (!peaks || PyDict_Update(d, peaks) < 0) {
    Py_XDECREF(peaks);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(peaks);
  return d;
}

static PyObject *pyd_runtime_info(pyd_runtime_t *self, PyObject *unused) {
  if (pyd_runtime_check(self) < 0) return NULL;
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  dmem_status_t st = dmem_runtime_info(self->rt, &info);
  if (st != DMEM_OK) return pyd_raise(st, NULL);
  PyObject *dir = PyUnicode_DecodeFSDefault(info.spill_dir);
  if (!dir) return NULL;
  PyObject *d = Py_BuildValue(
      "{s:s,s:s,s:i,s:s,s:n,s:n,s:n,s:n,s:O,s:I,s:N,s:n,s:s,s:s}", "backend",
      info.backend == DMEM_BACKEND_CUDA ? "cuda" : "host", "backend_reason", info.backend_reason,
      "device", info.device, "log_level",
      (unsigned)info.log_level <= 4u ? pyd_log_names[info.log_level] : "?", "device_capacity",
      (Py_ssize_t)info.device_capacity, "device_limit", (Py_ssize_t)info.device_limit,
      "device_limit_asked", (Py_ssize_t)info.device_limit_asked, "host_limit",
      (Py_ssize_t)info.host_limit, "print_stats", info.print_stats ? Py_True : Py_False,
      "stats_interval_s", info.stats_interval_s, "spill_dir", dir, "host_headroom",
      (Py_ssize_t)info.host_headroom, "eviction_policy",
      info.eviction_policy == DMEM_EVICTION_LRU ? "lru" : "reuse", "spill_ahead_trigger",
      info.spill_ahead_trigger == DMEM_SPILL_AHEAD_ALWAYS ? "always" : "demand");
  return d;
}

/* ---- the default runtimes ------------------------------------------------------ */

#define PYD_MAX_DEVICES 64 /* dmem_runtime_default's range */

/* The Runtime objects of dmem_runtime_default, by device (strong; GIL). They
 * are never closed, and not on the list of open runtimes (atexit leaves
 * them: allocator hooks free into them until the process exits). */
static pyd_runtime_t *pyd_defaults[PYD_MAX_DEVICES];
static int pyd_default_device = -1; /* configure(device=...), else -1 */

pyd_runtime_t *pyd_runtime_default(int device) {
  if (device < 0) {
    device = pyd_default_device;
    if (device < 0) {
      dmem_config_t cfg;
      dmem_config_init(&cfg); /* DMEM_DEVICE, else 0 */
      device = cfg.device;
    }
  }
  if (device < PYD_MAX_DEVICES && pyd_defaults[device]) {
    Py_INCREF(pyd_defaults[device]);
    return pyd_defaults[device];
  }
  dmem_runtime_t *rt = NULL;
  dmem_status_t st;
  Py_BEGIN_ALLOW_THREADS
  st = dmem_runtime_default(device, &rt); /* device >= 64: INVALID_ARGUMENT */
  Py_END_ALLOW_THREADS
  if (st != DMEM_OK) return (pyd_runtime_t *)pyd_raise(st, NULL);
  if (!pyd_defaults[device]) { /* another thread may have made it meanwhile */
    pyd_runtime_t *self = (pyd_runtime_t *)pyd_runtime_type.tp_alloc(&pyd_runtime_type, 0);
    if (!self) return NULL;
    self->rt = rt;
    self->backend = dmem_runtime_backend(rt);
    self->device = device;
    self->is_default = 1;
    pyd_runtime_keep_reason(self);
    pyd_defaults[device] = self;
  }
  Py_INCREF(pyd_defaults[device]);
  return pyd_defaults[device];
}

PyObject *pyd_mod_default_runtime(PyObject *mod, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"device", NULL};
  PyObject *device = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:default_runtime", kwlist, &device))
    return NULL;
  int d = -1;
  if (device != Py_None) {
    if (!PyLong_Check(device) || PyBool_Check(device)) {
      PyErr_Format(PyExc_TypeError, "device must be an int or None, not %.100s",
                   Py_TYPE(device)->tp_name);
      return NULL;
    }
    int ovf = 0;
    long v = PyLong_AsLongAndOverflow(device, &ovf);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (ovf || v < 0 || v >= PYD_MAX_DEVICES) {
      PyErr_Format(PyExc_ValueError, "device must be an ordinal in 0..%d, not %R",
                   PYD_MAX_DEVICES - 1, device);
      return NULL;
    }
    d = (int)v;
  }
  return (PyObject *)pyd_runtime_default(d);
}

PyObject *pyd_mod_default_runtimes(PyObject *mod, PyObject *unused) {
  PyObject *l = PyList_New(0);
  for (int d = 0; l && d < PYD_MAX_DEVICES; d++)
    if (pyd_defaults[d] && PyList_Append(l, (PyObject *)pyd_defaults[d]) < 0) Py_CLEAR(l);
  return l;
}

PyObject *pyd_mod_configure(PyObject *mod, PyObject *args, PyObject *kwds) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  PyObject *dir_bytes = NULL; /* what cfg's strings point into (spill_dir) */
  int device_given = 0;
  if (pyd_config_parse(args, kwds, "configure", 1, &cfg, &dir_bytes, &device_given) < 0)
    return NULL;
  for (int d = 0; d < PYD_MAX_DEVICES; d++) {
    if (pyd_defaults[d]) {
      Py_XDECREF(dir_bytes);
      return pyd_raise(DMEM_ERR_BUSY,
                       "configure() after the first use of the default runtime: call it before "
                       "dmem.default_runtime() and before Numba, CuPy or PyTorch allocate "
                       "through dmem");
    }
  }
  dmem_status_t st = dmem_runtime_default_configure(&cfg); /* copies spill_dir */
  Py_XDECREF(dir_bytes);
  if (st != DMEM_OK) return pyd_raise(st, NULL);
  pyd_default_device = device_given ? cfg.device : -1;
  Py_RETURN_NONE;
}

void pyd_runtime_defaults_after_fork(void) {
  for (int d = 0; d < PYD_MAX_DEVICES; d++) {
    pyd_runtime_t *r = pyd_defaults[d];
    if (!r) continue;
    pyd_defaults[d] = NULL;
    r->rt = NULL; /* the C library forgets it in the child too */
    r->active = 0;
    r->closing = 1;
    r->forked = 1;
    pyd_bindings_mark_closing(r);
    Py_DECREF(r);
  }
}

/* ---- properties and the type ------------------------------------------------ */

static PyObject *pyd_runtime_get_backend(pyd_runtime_t *self, void *closure) {
  return PyUnicode_FromString(self->backend == DMEM_BACKEND_CUDA ? "cuda" : "host");
}

static PyObject *pyd_runtime_get_closed(pyd_runtime_t *self, void *closure) {
  return PyBool_FromLong(!self->rt || self->closing);
}

static PyObject *pyd_runtime_get_device(pyd_runtime_t *self, void *closure) {
  return PyLong_FromLong(self->device);
}

static PyObject *pyd_runtime_get_backend_reason(pyd_runtime_t *self, void *closure) {
  return PyUnicode_FromString(self->backend_reason);
}

static PyObject *pyd_runtime_get_log_level(pyd_runtime_t *self, void *closure) {
  if (pyd_runtime_check(self) < 0) return NULL;
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  dmem_status_t st = dmem_runtime_info(self->rt, &info);
  if (st != DMEM_OK) return pyd_raise(st, NULL);
  return PyUnicode_FromString((unsigned)info.log_level <= 4u ? pyd_log_names[info.log_level]
                                                             : "?");
}

static int pyd_runtime_set_log_level(pyd_runtime_t *self, PyObject *value, void *closure) {
  if (!value) {
    PyErr_SetString(PyExc_AttributeError, "log_level cannot be deleted");
    return -1;
  }
  int l = pyd_log_level_arg(value);
  if (l < 0) return -1;
  if (pyd_runtime_check(self) < 0) return -1;
  dmem_status_t st = dmem_runtime_set_log_level(self->rt, (dmem_log_level_t)l);
  if (st != DMEM_OK) {
    pyd_raise(st, NULL);
    return -1;
  }
  return 0;
}

static PyObject *pyd_runtime_get_is_default(pyd_runtime_t *self, void *closure) {
  return PyBool_FromLong(self->is_default);
}

static PyObject *pyd_runtime_repr(pyd_runtime_t *self) {
  if (!self->rt) return PyUnicode_FromString("<dmem.Runtime closed>");
  return PyUnicode_FromFormat("<dmem.Runtime%s backend=%s device=%d (%s)>",
                              self->is_default ? " (default)" : "",
                              self->backend == DMEM_BACKEND_CUDA ? "cuda" : "host", self->device,
                              self->backend_reason);
}

static PyMethodDef pyd_runtime_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))pyd_runtime_alloc, METH_FASTCALL | METH_KEYWORDS,
     "alloc(nbytes, *, priority=0, pinned=False, stable=False) -> Buffer\n\n"
     "Allocate a spillable buffer (uninitialised). May spill other buffers.\n"
     "stable=True: the device address (view.ptr while locked) is the same for the buffer's\n"
     "whole life, across spills (CUDA VMM; nbytes is rounded up to the granularity, 2 MiB\n"
     "on current GPUs, for the device limit; not with pinned=True: ValueError)."},
    {"stream", (PyCFunction)pyd_runtime_stream, METH_NOARGS,
     "stream() -> Stream: a new stream of this runtime."},
    {"lock_and_launch", (PyCFunction)(void (*)(void))pyd_runtime_lock_and_launch,
     METH_VARARGS | METH_KEYWORDS,
     "lock_and_launch(buffers, fn) -> fn's result\n\n"
     "Lock the buffers, call fn(None, ptrs) with their device addresses (ints) on the default\n"
     "stream, synchronise, unlock. An exception raised by fn propagates unchanged."},
    {"launch_async", (PyCFunction)(void (*)(void))pyd_runtime_launch_async,
     METH_VARARGS | METH_KEYWORDS,
     "launch_async(stream, buffers, fn) -> fn's result\n\n"
     "Lock the buffers on stream, register them there, call fn(stream_int_or_None, ptrs).\n"
     "They stay locked until sync_and_unlock(stream) or stream_release(stream). An exception\n"
     "raised by fn propagates unchanged (the buffers stay registered)."},
    {"sync_and_unlock", (PyCFunction)(void (*)(void))pyd_runtime_sync_and_unlock, METH_FASTCALL,
     "sync_and_unlock(stream=None): synchronise stream, unlock what it registered."},
    {"stream_release", (PyCFunction)(void (*)(void))pyd_runtime_stream_release, METH_FASTCALL,
     "stream_release(stream=None): unlock what stream registered once its work completes."},
    {"synchronize", (PyCFunction)(void (*)(void))pyd_runtime_synchronize, METH_FASTCALL,
     "synchronize(stream=None): wait for the work queued on stream."},
    {"evict", (PyCFunction)pyd_runtime_evict, METH_O,
     "evict(nbytes) -> int: spill by policy until nbytes are freed; returns bytes freed."},
    {"prefetch", (PyCFunction)(void (*)(void))pyd_runtime_prefetch,
     METH_VARARGS | METH_KEYWORDS,
     "prefetch(buffers, stream=None): start bringing the buffers back to the device without\n"
     "locking them; work on stream after this call sees their bytes (dmem_buffer_prefetch)."},
    {"host_trim", (PyCFunction)(void (*)(void))pyd_runtime_host_trim, METH_FASTCALL,
     "host_trim(keep=0) -> int: give free pinned host pool chunks back until at most keep\n"
     "bytes stay; returns the bytes given back (dmem_host_trim)."},
    {"poll", (PyCFunction)pyd_runtime_poll, METH_NOARGS,
     "poll(): complete finished stream releases."},
    {"stats", (PyCFunction)(void (*)(void))pyd_runtime_stats, METH_VARARGS | METH_KEYWORDS,
     "stats(*, reset_peaks=False) -> dict: every field of dmem_stats_t, plus the bridge's\n"
     "'exposed' (buffers held by exports of lock views) and 'exports' (live exports by\n"
     "kind). reset_peaks=True starts the *_peak fields again from the values now\n"
     "(dmem_stats_reset_peaks) after taking these."},
    {"info", (PyCFunction)pyd_runtime_info, METH_NOARGS,
     "info() -> dict: dmem_runtime_info: backend, backend_reason, device, log_level,\n"
     "device_capacity, device_limit (in effect), device_limit_asked, host_limit,\n"
     "print_stats, stats_interval_s, spill_dir, host_headroom, eviction_policy,\n"
     "spill_ahead_trigger ('demand' or 'always')."},
    {"device_malloc", (PyCFunction)(void (*)(void))pyd_runtime_device_malloc,
     METH_VARARGS | METH_KEYWORDS,
     "device_malloc(nbytes, stream=None, *, dedicated=False) -> DeviceMemory\n\n"
     "Raw device memory (never spilled; counts against the device limit; spills buffers\n"
     "when memory runs short), for use in stream order on `stream`. Freed on that stream\n"
     "when the DeviceMemory is collected or freed. A foreign stream object (CuPy, PyTorch,\n"
     "Numba) is kept alive until then; an int stream must outlive the block.\n"
     "dedicated=True: a whole cudaMalloc of its own (dmem_device_malloc_dedicated), for\n"
     "code that asks the driver for the allocation's extent or opens its IPC handle at\n"
     "offset 0; freed blocks are cached by size."},
    {"_oom_message", (PyCFunction)pyd_runtime_oom_message, METH_O,
     "_oom_message(nbytes) -> str: what an out-of-memory error of a raw allocation of\n"
     "nbytes says about the device limit now (raw, locked, pinned, spillable, free)."},
    {"memory_info", (PyCFunction)pyd_runtime_memory_info, METH_NOARGS,
     "memory_info() -> (free, total): total is the device limit; free counts the bytes\n"
     "that spilling unlocked buffers would give (dmem_device_memory_info)."},
    {"ipc_handle", (PyCFunction)pyd_runtime_ipc_handle, METH_O,
     "ipc_handle(ptr) -> (handle: bytes of 64, offset): the CUDA IPC handle of the pool\n"
     "slab or dedicated block that holds ptr (an address of a raw allocation, or a\n"
     "DeviceMemory) and ptr's offset in it. NoDeviceError on the host backend."},
    {"adopt", (PyCFunction)(void (*)(void))pyd_runtime_adopt, METH_VARARGS | METH_KEYWORDS,
     "adopt(mem, stream=None) -> Buffer\n\n"
     "Make the raw block of mem (a DeviceMemory of this runtime from device_malloc, not\n"
     "dedicated) a spillable Buffer in place, without a copy (dmem_device_adopt): same\n"
     "address, same bytes, size mem.size. The Buffer comes back locked once, and that\n"
     "lock is mem's: while mem lives (the arrays made on it keep it alive) the buffer\n"
     "cannot be spilled. When mem is freed or collected it waits for the work on its\n"
     "stream and unlocks the buffer instead of freeing the block; the Buffer frees the\n"
     "memory (freed while mem still holds its lock: at that unlock). stream: where the\n"
     "block's last use so far was queued (None: mem.stream). TypeError unless mem is a\n"
     "DeviceMemory; InvalidArgumentError for another runtime's, a freed, an adopted\n"
     "or a dedicated one."},
    {"set_controller", (PyCFunction)pyd_runtime_set_controller, METH_O,
     "set_controller(controller): install a dmem.Controller (None removes it)."},
    {"close", (PyCFunction)pyd_runtime_close, METH_NOARGS,
     "close(): destroy the runtime. Live Buffers raise StaleHandleError afterwards.\n"
     "BusyError while exports of lock views (arrays, DLPack tensors) are alive."},
    {"__enter__", (PyCFunction)pyd_runtime_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)pyd_runtime_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pyd_runtime_getset[] = {
    {"backend", (getter)pyd_runtime_get_backend, NULL, "'cuda' or 'host'", NULL},
    {"closed", (getter)pyd_runtime_get_closed, NULL, "True after close()", NULL},
    {"device", (getter)pyd_runtime_get_device, NULL, "device ordinal", NULL},
    {"backend_reason", (getter)pyd_runtime_get_backend_reason, NULL,
     "why this backend, e.g. 'backend auto: CUDA not usable (cudaGetDeviceCount: "
     "cudaErrorInsufficientDriver (...)), using the host backend'",
     NULL},
    {"log_level", (getter)pyd_runtime_get_log_level, (setter)pyd_runtime_set_log_level,
     "the runtime's log level: 'off', 'error', 'warn', 'info' or 'debug' (set: a name or "
     "0..4)",
     NULL},
    {"is_default", (getter)pyd_runtime_get_is_default, NULL,
     "True for the process-wide runtime of dmem.default_runtime() (never closed)", NULL},
    {"controller", (getter)pyd_runtime_get_controller, NULL, "the installed controller or None",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject pyd_runtime_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem.Runtime",
    .tp_basicsize = sizeof(pyd_runtime_t),
    .tp_dealloc = (destructor)pyd_runtime_dealloc,
    .tp_repr = (reprfunc)pyd_runtime_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    /* PyInit__dmem puts the signature first, from the table of options */
    .tp_doc = "A dmem runtime. Each argument is a row of the C library's table of options\n"
              "(DMEM_CONFIG_OPTIONS in dmem/config.h, where each is described;\n"
              "dmem._dmem._config_options() lists them); None: its DMEM_* variable, else its\n"
              "default. device_limit: bytes, '8GB' (8e9), '8GiB' (2**33) or '80%'; host_limit:\n"
              "bytes of spilled data kept in host memory (None: unlimited); host_burst: how far\n"
              "past host_limit (a fraction of it, 0 to 1; default 0.5) the host tier may grow\n"
              "while it is pushed down to disk; host_reserve: pinned host memory taken at\n"
              "creation and kept; host_headroom: the most free pinned host memory the pinned\n"
              "pool keeps ahead of spills (default 4GiB; 0: it grows only by what spills need);\n"
              "eviction_policy: 'reuse' (the default: scan-resistant) or 'lru'; spill_ahead:\n"
              "False, True (95% of the limit), a fraction, (high, low) or 'N%,M%' (default: on\n"
              "with the cuda backend, off with the host one); spill_ahead_trigger: 'demand' (the\n"
              "default: only after waits for room) or 'always'; host_capacity:\n"
              "simulated device memory of the host backend. Strings are read as the DMEM_*\n"
              "variables are, which is as dask.utils.parse_bytes reads them: K/M/G/T/P alone or\n"
              "with B are powers of 1000 ('8G' = '8GB' = 8e9), Ki/Mi/Gi/Ti/Pi alone or with B\n"
              "powers of 1024. Context manager; close() destroys it.",
    .tp_traverse = (traverseproc)pyd_runtime_traverse,
    .tp_clear = (inquiry)pyd_runtime_clear,
    .tp_weaklistoffset = offsetof(pyd_runtime_t, weakreflist),
    .tp_methods = pyd_runtime_methods,
    .tp_getset = pyd_runtime_getset,
    .tp_new = pyd_runtime_new,
};
