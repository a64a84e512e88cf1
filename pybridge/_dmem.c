/*
 * pybridge/_dmem.c - the module dmem._dmem: exceptions, the call context,
 * argument converters shared by the types, and shutdown.
 *
 * The types live in runtime_obj.c (Runtime, Stream, launches), buffer.c
 * (Buffer), view.c (lock views, CUDA array interface, DLPack) and
 * controller.c (controller trampolines).
 */
#include "pydmem.h"

#include <string.h>

_Thread_local pyd_ctx_t *pyd_tls_ctx = NULL;
PyObject *pyd_controller_base = NULL;

/* ---- exceptions ------------------------------------------------------------ */

/* One row per status: the Python class name and its extra base (besides
 * DmemError). DeviceFatalError derives from DeviceError (handled below). */
#define PYD_EXC_VALUE 1
#define PYD_EXC_MEMORY 2
#define PYD_EXC_OS 3
#define PYD_EXC_DEVICE 4

static const struct {
  dmem_status_t status;
  const char *name;
  int extra;
  const char *doc;
} pyd_exc_table[] = {
    {DMEM_ERR_INVALID_ARGUMENT, "InvalidArgumentError", PYD_EXC_VALUE,
     "DMEM_ERR_INVALID_ARGUMENT: the runtime rejected an argument value."},
    {DMEM_ERR_STALE_HANDLE, "StaleHandleError", 0,
     "DMEM_ERR_STALE_HANDLE: the buffer was freed (or its runtime closed)."},
    {DMEM_ERR_BUSY, "BusyError", 0,
     "DMEM_ERR_BUSY: the buffer is locked, pinned or being moved."},
    {DMEM_ERR_NOT_LOCKED, "NotLockedError", 0,
     "DMEM_ERR_NOT_LOCKED: unlock without lock, or a view used outside its block."},
    {DMEM_ERR_OUT_OF_MEMORY, "OutOfMemoryError", PYD_EXC_MEMORY,
     "DMEM_ERR_OUT_OF_MEMORY: out of device memory after every possible eviction."},
    {DMEM_ERR_HOST_OUT_OF_MEMORY, "HostOutOfMemoryError", PYD_EXC_MEMORY,
     "DMEM_ERR_HOST_OUT_OF_MEMORY: out of host memory for spilled data."},
    {DMEM_ERR_IO, "SpillIOError", PYD_EXC_OS, "DMEM_ERR_IO: disk tier I/O failed."},
    {DMEM_ERR_CALLBACK, "CallbackError", 0,
     "DMEM_ERR_CALLBACK: a callback failed; __cause__ is the original exception."},
    {DMEM_ERR_CONFIG, "ConfigError", PYD_EXC_VALUE,
     "DMEM_ERR_CONFIG: invalid configuration or DMEM_* environment variable."},
    {DMEM_ERR_NO_DEVICE, "NoDeviceError", 0, "DMEM_ERR_NO_DEVICE: no usable device or driver."},
    {DMEM_ERR_DEVICE, "DeviceError", 0, "DMEM_ERR_DEVICE: a device or driver call failed."},
    {DMEM_ERR_DEVICE_FATAL, "DeviceFatalError", PYD_EXC_DEVICE,
     "DMEM_ERR_DEVICE_FATAL: the device context is lost; the runtime refuses work."},
};
#define PYD_NEXC (sizeof pyd_exc_table / sizeof pyd_exc_table[0])

static PyObject *pyd_dmem_error;           /* dmem.DmemError */
static PyObject *pyd_exc_types[PYD_NEXC];  /* subclasses, by table row */

static PyObject *pyd_exc_class(dmem_status_t st) {
  for (size_t i = 0; i < PYD_NEXC; i++)
    if (pyd_exc_table[i].status == st) return pyd_exc_types[i];
  return pyd_dmem_error;
}

/* Build an instance of the class for `st` with .status, .name, .detail. */
static PyObject *pyd_make_exc(PyObject *cls, dmem_status_t st, const char *detail,
                              const char *extra) {
  PyObject *msg;
  const char *name = dmem_status_name(st);
  if (detail && detail[0])
    msg = PyUnicode_FromFormat("%s: %s (%s)%s", name, dmem_status_string(st), detail,
                               extra ? extra : "");
  else
    msg = PyUnicode_FromFormat("%s: %s%s", name, dmem_status_string(st), extra ? extra : "");
  if (!msg) return NULL;
  PyObject *exc = PyObject_CallOneArg(cls, msg);
  Py_DECREF(msg);
  if (!exc) return NULL;
  PyObject *v_status = PyLong_FromLong((long)st);
  PyObject *v_name = PyUnicode_FromString(name);
  PyObject *v_detail = PyUnicode_DecodeUTF8(detail ? detail : "", detail ? (Py_ssize_t)strlen(detail) : 0,
                                            "replace");
  int rc = -1;
  if (v_status && v_name && v_detail && PyObject_SetAttrString(exc, "status", v_status) == 0 &&
      PyObject_SetAttrString(exc, "name", v_name) == 0 &&
      PyObject_SetAttrString(exc, "detail", v_detail) == 0)
    rc = 0;
  Py_XDECREF(v_status);
  Py_XDECREF(v_name);
  Py_XDECREF(v_detail);
  if (rc < 0) {
    Py_DECREF(exc);
    return NULL;
  }
  return exc;
}

PyObject *pyd_raise(dmem_status_t st, const char *detail) {
  if (!detail) detail = dmem_last_error_detail();
  PyObject *cls = pyd_exc_class(st);
  PyObject *exc = pyd_make_exc(cls, st, detail, NULL);
  if (exc) {
    PyErr_SetObject(cls, exc);
    Py_DECREF(exc);
  }
  return NULL;
}

PyObject *pyd_raise_callback(dmem_status_t st, PyObject *cause) {
  PyObject *cls = pyd_exc_class(DMEM_ERR_CALLBACK);
  char extra[96] = "";
  if (st != DMEM_OK && st != DMEM_ERR_CALLBACK)
    snprintf(extra, sizeof extra, "; the call returned %s", dmem_status_name(st));
  PyObject *detail = PyObject_Str(cause);
  const char *d = detail ? PyUnicode_AsUTF8(detail) : NULL;
  if (!d) PyErr_Clear();
  char buf[512];
  snprintf(buf, sizeof buf, "controller callback raised %s%s%s", Py_TYPE(cause)->tp_name,
           d && d[0] ? ": " : "", d ? d : "");
  Py_XDECREF(detail);
  PyObject *exc = pyd_make_exc(cls, DMEM_ERR_CALLBACK, buf, extra);
  if (!exc) {
    Py_DECREF(cause);
    return NULL;
  }
  PyException_SetCause(exc, cause); /* steals cause */
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

PyObject *pyd_fetch_exception(void) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (!type) return NULL;
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb && value) PyException_SetTraceback(value, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  if (!value) {
    Py_INCREF(Py_None);
    value = Py_None;
  }
  return value;
}

void pyd_callback_failed(PyObject *where) {
  pyd_ctx_t *c = pyd_tls_ctx;
  if (c && c->accept && !c->exc) {
    c->exc = pyd_fetch_exception();
    return;
  }
  PyErr_WriteUnraisable(where);
}

int pyd_finish(pyd_ctx_t *c, dmem_status_t st) {
  if (c->exc) {
    PyObject *cause = c->exc;
    c->exc = NULL;
    pyd_raise_callback(st, cause);
    return -1;
  }
  if (st != DMEM_OK) {
    pyd_raise(st, NULL);
    return -1;
  }
  return 0;
}

int pyd_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

/* ---- shared converters --------------------------------------------------- */

int pyd_runtime_check(pyd_runtime_t *rt) {
  if (!rt->rt || rt->closing) {
    PyErr_SetString(PyExc_ValueError, "dmem runtime is closed");
    return -1;
  }
  return 0;
}

/* Read an address out of an int-like object. */
static int pyd_address(PyObject *o, void **out) {
  PyObject *idx = PyNumber_Index(o);
  if (!idx) return -1;
  unsigned long long v = PyLong_AsUnsignedLongLong(idx);
  Py_DECREF(idx);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "stream address must be a non-negative 64-bit integer");
    return -1;
  }
  *out = (void *)(uintptr_t)v;
  return 0;
}

int pyd_stream_arg(pyd_runtime_t *rt, PyObject *o, dmem_stream_t *out, PyObject **keep) {
  *keep = NULL;
  if (!o || o == Py_None) {
    *out = NULL;
    return 0;
  }
  if (Py_IS_TYPE(o, &pyd_stream_type)) {
    pyd_stream_t *s = (pyd_stream_t *)o;
    if (s->rt != rt) {
      PyErr_SetString(PyExc_ValueError, "stream belongs to another dmem runtime");
      return -1;
    }
    if (!s->s) {
      PyErr_SetString(PyExc_ValueError, "stream is closed");
      return -1;
    }
    *out = s->s;
    Py_INCREF(o);
    *keep = o;
    return 0;
  }
  if (rt->backend != DMEM_BACKEND_CUDA) {
    PyErr_Format(PyExc_TypeError,
                 "stream must be None or a dmem.Stream of this runtime on the host backend, "
                 "not %.100s",
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  /* CUDA: a cudaStream_t given as an int, or a foreign stream object. */
  if (PyIndex_Check(o) && !PyBool_Check(o)) return pyd_address(o, out);
  PyObject *v = NULL;
  if (PyObject_HasAttrString(o, "__cuda_stream__")) {
    PyObject *t = PyObject_CallMethod(o, "__cuda_stream__", NULL);
    if (!t) return -1;
    if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 2) {
      v = PyTuple_GET_ITEM(t, 1);
      Py_INCREF(v);
    }
    Py_DECREF(t);
  } else if (PyObject_HasAttrString(o, "cuda_stream")) { /* torch.cuda.Stream */
    v = PyObject_GetAttrString(o, "cuda_stream");
  } else if (PyObject_HasAttrString(o, "ptr")) { /* cupy.cuda.Stream */
    v = PyObject_GetAttrString(o, "ptr");
  } else if (PyObject_HasAttrString(o, "handle")) { /* numba.cuda stream */
    PyObject *hd = PyObject_GetAttrString(o, "handle");
    if (!hd) return -1;
    if (PyObject_HasAttrString(hd, "value")) { /* ctypes c_void_p */
      v = PyObject_GetAttrString(hd, "value");
      Py_DECREF(hd);
    } else if (PyIndex_Check(hd)) {
      v = hd;
    } else {
      v = PyNumber_Long(hd); /* cuda.bindings CUstream supports int() */
      Py_DECREF(hd);
    }
  }
  if (!v) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_TypeError,
                   "stream must be None, a dmem.Stream, an int cudaStream_t or a stream object, "
                   "not %.100s",
                   Py_TYPE(o)->tp_name);
    return -1;
  }
  int rc;
  if (v == Py_None) {
    *out = NULL;
    rc = 0;
  } else {
    rc = pyd_address(v, out);
  }
  Py_DECREF(v);
  if (rc == 0) {
    Py_INCREF(o); /* keep the foreign stream object alive as long as we use it */
    *keep = o;
  }
  return rc;
}

int pyd_handle_arg(pyd_runtime_t *rt, PyObject *o, int allow_int, dmem_handle_t *out) {
  if (PyObject_TypeCheck(o, &pyd_buffer_type)) {
    pyd_buffer_t *b = (pyd_buffer_t *)o;
    if (b->rt != rt) {
      PyErr_SetString(PyExc_ValueError, "buffer belongs to another dmem runtime");
      return -1;
    }
    if (b->freed) {
      pyd_raise(DMEM_ERR_STALE_HANDLE, "buffer was freed");
      return -1;
    }
    *out = b->h;
    return 0;
  }
  if (allow_int && PyLong_Check(o) && !PyBool_Check(o)) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "handle must be a non-negative 64-bit integer");
      return -1;
    }
    *out = (dmem_handle_t)v;
    return 0;
  }
  PyErr_Format(PyExc_TypeError, "expected a dmem.Buffer%s, not %.100s",
               allow_int ? " or an int handle" : "", Py_TYPE(o)->tp_name);
  return -1;
}

const char *pyd_state_name(dmem_state_t s) {
  switch (s) {
    case DMEM_STATE_RESIDENT: return "resident";
    case DMEM_STATE_SPILLING: return "spilling";
    case DMEM_STATE_DEFERRED_HOST: return "deferred_host";
    case DMEM_STATE_DEFERRED_DISK: return "deferred_disk";
    case DMEM_STATE_DEFERRED_CONTROLLER: return "deferred_controller";
    case DMEM_STATE_UNSPILLING: return "unspilling";
  }
  return "unknown";
}

const char *pyd_tier_name(dmem_tier_t t) {
  switch (t) {
    case DMEM_TIER_DEVICE: return "device";
    case DMEM_TIER_HOST: return "host";
    case DMEM_TIER_DISK: return "disk";
    case DMEM_TIER_CONTROLLER: return "controller";
  }
  return "unknown";
}

/* ---- module functions ------------------------------------------------------ */

static PyObject *pyd_mod_shutdown(PyObject *mod, PyObject *unused) {
  /* Close every open runtime (atexit), so that spill directories are removed
   * even for runtimes that are never collected. Runtimes with calls still in
   * flight on daemon threads after 2 s are left alone. */
  for (;;) {
    pyd_runtime_t *r = pyd_live_runtimes;
    while (r && (r->closing || !r->rt)) r = r->live_next;
    if (!r) break;
    Py_INCREF(r);
    int rc = pyd_runtime_close_impl(r, 2.0);
    if (rc < 0) {
      PyErr_Clear();
      r->closing = 1; /* give up on it; do not loop forever */
    }
    Py_DECREF(r);
  }
  Py_RETURN_NONE;
}

static PyObject *pyd_mod_after_fork_child(PyObject *mod, PyObject *unused) {
  /* The child has none of the runtime's threads (host-backend streams, copy
   * engine) and no usable CUDA context: destroying a runtime there could wait
   * forever. Disown every runtime: its objects raise as after close(), and its
   * memory is left to the process's exit. */
  pyd_runtime_t *r = pyd_live_runtimes;
  pyd_live_runtimes = NULL;
  while (r) {
    pyd_runtime_t *next = r->live_next;
    r->live_prev = r->live_next = NULL;
    r->rt = NULL;
    r->active = 0;
    r->closing = 1;
    for (pyd_binding_t *b = r->bindings; b; b = b->next) b->closing = 1;
    r = next;
  }
  Py_RETURN_NONE;
}

static PyObject *pyd_mod_set_controller_base(PyObject *mod, PyObject *cls) {
  if (!PyType_Check(cls)) {
    PyErr_SetString(PyExc_TypeError, "expected a class");
    return NULL;
  }
  Py_INCREF(cls);
  Py_XSETREF(pyd_controller_base, cls);
  Py_RETURN_NONE;
}

static PyObject *pyd_mod_status_name(PyObject *mod, PyObject *arg) {
  long v = PyLong_AsLong(arg);
  if (v == -1 && PyErr_Occurred()) return NULL;
  return PyUnicode_FromString(dmem_status_name((dmem_status_t)v));
}

static PyMethodDef pyd_mod_methods[] = {
    {"_shutdown", pyd_mod_shutdown, METH_NOARGS, "Close every open runtime (atexit hook)."},
    {"_after_fork_child", pyd_mod_after_fork_child, METH_NOARGS,
     "Disown every runtime in a forked child (os.register_at_fork hook)."},
    {"_set_controller_base", pyd_mod_set_controller_base, METH_O,
     "Register dmem.Controller, the class controllers must derive from."},
    {"status_name", pyd_mod_status_name, METH_O, "Name of a dmem status code."},
    {NULL, NULL, 0, NULL}};

static int pyd_mod_traverse(PyObject *m, visitproc visit, void *arg) {
  Py_VISIT(pyd_controller_base);
  return 0;
}

static struct PyModuleDef pyd_module = {
    PyModuleDef_HEAD_INIT, "_dmem",
    "dmem._dmem: CPython bindings of the dmem runtime (use the package `dmem`).", -1,
    pyd_mod_methods, NULL, pyd_mod_traverse, NULL, NULL};

static int pyd_add_exceptions(PyObject *m) {
  PyObject *dict = Py_BuildValue("{s:O,s:O,s:s}", "status", Py_None, "name", Py_None, "detail", "");
  if (!dict) return -1;
  pyd_dmem_error = PyErr_NewExceptionWithDoc(
      "dmem.DmemError",
      "Base class of dmem errors: .status (int), .name (e.g. 'DMEM_ERR_BUSY'), "
      ".detail (dmem_last_error_detail() at the failure).",
      PyExc_Exception, dict);
  Py_DECREF(dict);
  if (!pyd_dmem_error || PyModule_AddObjectRef(m, "DmemError", pyd_dmem_error) < 0) return -1;
  PyObject *device_error = NULL;
  for (size_t i = 0; i < PYD_NEXC; i++) {
    PyObject *bases;
    switch (pyd_exc_table[i].extra) {
      case PYD_EXC_VALUE: bases = PyTuple_Pack(2, pyd_dmem_error, PyExc_ValueError); break;
      case PYD_EXC_MEMORY: bases = PyTuple_Pack(2, pyd_dmem_error, PyExc_MemoryError); break;
      case PYD_EXC_OS: bases = PyTuple_Pack(2, pyd_dmem_error, PyExc_OSError); break;
      case PYD_EXC_DEVICE: bases = PyTuple_Pack(1, device_error); break;
      default: bases = PyTuple_Pack(1, pyd_dmem_error); break;
    }
    if (!bases) return -1;
    char qual[96];
    snprintf(qual, sizeof qual, "dmem.%s", pyd_exc_table[i].name);
    dict = Py_BuildValue("{s:i,s:s}", "status", (int)pyd_exc_table[i].status, "name",
                         dmem_status_name(pyd_exc_table[i].status));
    if (!dict) {
      Py_DECREF(bases);
      return -1;
    }
    pyd_exc_types[i] = PyErr_NewExceptionWithDoc(qual, pyd_exc_table[i].doc, bases, dict);
    Py_DECREF(bases);
    Py_DECREF(dict);
    if (!pyd_exc_types[i] || PyModule_AddObjectRef(m, pyd_exc_table[i].name, pyd_exc_types[i]) < 0)
      return -1;
    if (pyd_exc_table[i].status == DMEM_ERR_DEVICE) device_error = pyd_exc_types[i];
  }
  /* Status codes as module constants. */
#define PYD_ADD_STATUS_(name, value, msg) \
  if (PyModule_AddIntConstant(m, "DMEM_" #name, value) < 0) return -1;
  DMEM_STATUS_MAP(PYD_ADD_STATUS_)
#undef PYD_ADD_STATUS_
  return 0;
}

PyMODINIT_FUNC PyInit__dmem(void) {
  if (PyType_Ready(&pyd_runtime_type) < 0 || PyType_Ready(&pyd_buffer_type) < 0 ||
      PyType_Ready(&pyd_stream_type) < 0 || pyd_view_type_ready() < 0 ||
      pyd_controller_types_ready() < 0)
    return NULL;
  PyObject *m = PyModule_Create(&pyd_module);
  if (!m) return NULL;
  if (pyd_add_exceptions(m) < 0 ||
      PyModule_AddObjectRef(m, "Runtime", (PyObject *)&pyd_runtime_type) < 0 ||
      PyModule_AddObjectRef(m, "Buffer", (PyObject *)&pyd_buffer_type) < 0 ||
      PyModule_AddObjectRef(m, "Stream", (PyObject *)&pyd_stream_type) < 0 ||
      PyModule_AddObjectRef(m, "View", (PyObject *)&pyd_view_type) < 0 ||
      PyModule_AddIntConstant(m, "VERSION_MAJOR", DMEM_VERSION_MAJOR) < 0 ||
      PyModule_AddIntConstant(m, "VERSION_MINOR", DMEM_VERSION_MINOR) < 0 ||
      PyModule_AddIntConstant(m, "VERSION_PATCH", DMEM_VERSION_PATCH) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
