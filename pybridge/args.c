/*
 * pybridge/args.c - converters from Python arguments to the C API's values
 * (sizes, priorities, handles given as ints, addresses, tiers) and the
 * checks every method makes first (runtime open, buffer usable).
 *
 * Nothing here calls the runtime. Converters that need an object
 * type of a higher layer (a dmem.Stream, a dmem.Buffer) live with that type:
 * pyd_stream_arg in stream.c, pyd_handle_arg in buffer.c.
 */
#include "pydmem.h"

#include <errno.h>
#include <string.h>

/* ---- checks ------------------------------------------------------------------ */

int pyd_runtime_check(pyd_runtime_t *rt) {
  if (!rt->rt || rt->closing) {
    PyErr_SetString(PyExc_ValueError, "dmem runtime is closed");
    return -1;
  }
  return 0;
}

int pyd_buffer_check(pyd_buffer_t *b) {
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
    return 0;
  }
  if (PyUnicode_Check(o)) {
    const char *s = PyUnicode_AsUTF8(o);
    if (!s) return -1;
    while (*s == ' ') s++;
    char *end = NULL;
    errno = 0;
    if (fraction && strchr(s, '%')) {
      double p = strtod(s, &end);
      while (end && *end == ' ') end++;
      if (end == s || !end || *end != '%' || end[1] != '\0' || !(p > 0.0 && p <= 100.0) ||
          errno)
        goto value_error;
      *fraction = p / 100.0;
      return 0;
    }
    if (*s < '0' || *s > '9') goto value_error;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) goto value_error;
    while (*end == ' ') end++;
    unsigned shift = 0;
    switch (*end) {
      case 'k': case 'K': shift = 10; end++; break;
      case 'm': case 'M': shift = 20; end++; break;
      case 'g': case 'G': shift = 30; end++; break;
      case 't': case 'T': shift = 40; end++; break;
      default: break;
    }
    if (shift && (*end == 'i' || *end == 'I')) end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end != '\0') goto value_error;
    if (shift && v > (~0ull >> shift)) goto value_error;
    *bytes = (size_t)(v << shift);
    return 0;
  value_error:
    PyErr_Format(PyExc_ValueError, "%s: malformed size %R (expected bytes, e.g. 1048576, '512M'%s)",
                 what, o, fraction ? " or '80%'" : "");
    return -1;
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
