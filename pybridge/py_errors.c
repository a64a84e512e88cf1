/*
 * pybridge/py_errors.c - the bottom layer of dmem._dmem: dmem statuses as
 * Python exceptions (pyd_raise), the per-thread call context that carries a
 * controller callback's exception back to the Python call waiting on the same
 * thread, and pyd_finish, which turns both into the exception a call raises.
 *
 * The exception classes themselves are created at import by py_module.c from
 * the table below; this file only maps statuses to them.
 */
#include "pydmem.h"

#include <string.h>

_Thread_local pyd_ctx_t *pyd_tls_ctx = NULL;

/* ---- status -> exception class ------------------------------------------------ */

/* One row per status: the Python class name and its extra base (besides
 * DmemError). DeviceFatalError derives from DeviceError (py_module.c). */
const pyd_exc_def_t pyd_exc_defs[] = {
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
    {DMEM_ERR_FORKED, "ForkedError", 0,
     "DMEM_ERR_FORKED: the runtime was inherited through fork(); a child cannot use it."},
};
#define PYD_NEXC (sizeof pyd_exc_defs / sizeof pyd_exc_defs[0])
const size_t pyd_exc_ndefs = PYD_NEXC;

PyObject *pyd_dmem_error = NULL;         /* set by py_module.c at import */
PyObject *pyd_exc_types[PYD_NEXC] = {0}; /* likewise */

static PyObject *pyd_exc_class(dmem_status_t st) {
  for (size_t i = 0; i < PYD_NEXC; i++)
    if (pyd_exc_defs[i].status == st) return pyd_exc_types[i];
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

/* ---- callback errors and the end of a call ---------------------------------- */

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
