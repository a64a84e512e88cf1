/*
 * pybridge/py_args.c - converters from Python arguments to the C API's values
 * (sizes, priorities, handles given as ints, addresses, tiers) and the
 * checks every method makes first (runtime open, buffer usable).
 *
 * Nothing here calls the runtime except dmem_size_parse: sizes given as
 * strings go through the C library's own parser, so Runtime(device_limit=...)
 * and DMEM_DEVICE_LIMIT spell sizes alike. Converters that need an object
 * type of a higher layer (a dmem.Stream, a dmem.Buffer) live with that type:
 * pyd_stream_arg in py_stream.c, pyd_handle_arg in py_buffer.c.
 */
#include "pydmem.h"

#include <string.h>

/* ---- checks ------------------------------------------------------------------ */

/* In a forked child, every object of an inherited runtime raises this. */
static int pyd_forked_raise(void) {
  pyd_raise(DMEM_ERR_FORKED,
            "this runtime was inherited through fork(): a child process cannot use its "
            "parent's runtimes (create a new one, or use dmem.default_runtime())");
  return -1;
}

int pyd_runtime_check(pyd_runtime_t *rt) {
  if (rt->forked) return pyd_forked_raise();
  if (!rt->rt || rt->closing) {
    PyErr_SetString(PyExc_ValueError, "dmem runtime is closed");
    return -1;
  }
  return 0;
}

int pyd_buffer_check(pyd_buffer_t *b) {
  if (b->rt->forked) return pyd_forked_raise();
  if (b->freed) {
    pyd_raise(DMEM_ERR_STALE_HANDLE, "buffer was freed");
    return -1;
  }
  if (!b->rt->rt || b->rt->closing) {
    pyd_raise(DMEM_ERR_STALE_HANDLE, "the buffer's runtime is closed");
    return -1;
  }
  return 0;
}

/* ---- numbers ----------------------------------------------------------------- */

int pyd_address_arg(PyObject *o, const char *what, void **out) {
  PyObject *idx = PyNumber_Index(o);
  if (!idx) return -1;
  unsigned long long v = PyLong_AsUnsignedLongLong(idx);
  Py_DECREF(idx);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s must be a non-negative 64-bit integer", what);
    return -1;
  }
  *out = (void *)(uintptr_t)v;
  return 0;
}

int pyd_handle_int_arg(PyObject *o, dmem_handle_t *out) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "handle must be a non-negative 64-bit integer");
    return -1;
  }
  *out = (dmem_handle_t)v;
  return 0;
}

int pyd_size_arg(PyObject *o, const char *what, size_t *bytes, double *fraction) {
  if (o == Py_None) return 0;
  if (PyBool_Check(o)) goto type_error;
  if (PyIndex_Check(o)) {
    PyObject *idx = PyNumber_Index(o);
    if (!idx) return -1;
    size_t v = PyLong_AsSize_t(idx);
    Py_DECREF(idx);
    if (v == (size_t)-1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "%s must be a non-negative number of bytes", what);
      return -1;
    }
    *bytes = v;
    if (fraction) *fraction = 0.0;
    return 0;
  }
  if (PyUnicode_Check(o)) {
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(o, &len);
    if (!s) return -1;
    /* A bad value of an argument: ValueError before the runtime is made,
     * with the parser's own explanation. */
    if (strlen(s) != (size_t)len) { /* the C parser would not see the rest */
      PyErr_Format(PyExc_ValueError, "%s: malformed size %R (embedded NUL character)", what, o);
      return -1;
    }
    size_t b = 0;
    double f = 0.0;
    if (dmem_size_parse(s, &b, fraction ? &f : NULL) != DMEM_OK) {
      PyErr_Format(PyExc_ValueError, "%s: malformed size %R (%s)", what, o,
                   dmem_last_error_detail());
      return -1;
    }
    *bytes = b;
    if (fraction) *fraction = f;
    return 0;
  }
type_error:
  PyErr_Format(PyExc_TypeError, "%s must be an int or a str, not %.100s", what,
               Py_TYPE(o)->tp_name);
  return -1;
}

int pyd_priority_arg(PyObject *o, int *out) {
  if (!PyLong_Check(o) || PyBool_Check(o)) {
    PyErr_Format(PyExc_TypeError, "priority must be an int, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
  }
  int ovf = 0;
  long p = PyLong_AsLongAndOverflow(o, &ovf);
  if (ovf || p < -2147483647L - 1 || p > 2147483647L) {
    PyErr_SetString(PyExc_ValueError, "priority out of the range of a C int");
    return -1;
  }
  *out = (int)p;
  return 0;
}

int pyd_offset_int_arg(PyObject *o, const char *what, Py_ssize_t *out) {
  if (!PyIndex_Check(o)) {
    PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(o)->tp_name);
    return -1;
  }
  PyObject *idx = PyNumber_Index(o);
  if (!idx) return -1;
  Py_ssize_t v = PyLong_AsSsize_t(idx);
  Py_DECREF(idx);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "%s %R is out of range", what, o);
    return -1;
  }
  if (v < 0) {
    PyErr_Format(PyExc_ValueError, "%s must be >= 0", what);
    return -1;
  }
  *out = v;
  return 0;
}

/* ---- tiers and states -------------------------------------------------------- */

int pyd_tier_arg(PyObject *o, dmem_tier_t *out) {
  if (!PyUnicode_Check(o)) {
    PyErr_Format(PyExc_TypeError, "tier must be a str, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
  }
  if (PyUnicode_CompareWithASCIIString(o, "host") == 0) *out = DMEM_TIER_HOST;
  else if (PyUnicode_CompareWithASCIIString(o, "disk") == 0) *out = DMEM_TIER_DISK;
  else if (PyUnicode_CompareWithASCIIString(o, "controller") == 0) *out = DMEM_TIER_CONTROLLER;
  else {
    PyErr_Format(PyExc_ValueError, "tier must be 'host', 'disk' or 'controller', not %R", o);
    return -1;
  }
  return 0;
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
