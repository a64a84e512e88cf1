/*
 * pybridge/py_buffer.c - dmem.Buffer: a spillable buffer behind a handle.
 *
 * A Buffer made by Runtime.alloc owns its handle and frees it when collected
 * or by free(). Buffers passed to controller callbacks are wrappers that do
 * not own the handle (they compare equal to the owning Buffer). Every Buffer
 * holds a strong reference to its Runtime; after Runtime.close() every use
 * raises StaleHandleError and collection does nothing.
 *
 * buf.lock() hands out a View (py_view.c, the layer below: a View reads a
 * Buffer's fields but calls none of this file's functions).
 */
#include "pydmem.h"

PyObject *pyd_buffer_new(pyd_runtime_t *rt, dmem_handle_t h, size_t size, int owning) {
  pyd_buffer_t *b = PyObject_GC_New(pyd_buffer_t, &pyd_buffer_type);
  if (!b) return NULL;
  Py_INCREF(rt);
  b->rt = rt;
  b->h = h;
  b->size = size;
  b->owning = (unsigned char)(owning != 0);
  b->freed = 0;
  b->weakreflist = NULL;
  PyObject_GC_Track(b);
  return (PyObject *)b;
}

static void pyd_buffer_dealloc(pyd_buffer_t *self) {
  PyObject_GC_UnTrack(self);
  if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
  pyd_runtime_t *rt = self->rt;
  if (self->owning && !self->freed && rt->rt && !rt->closing) {
    /* Nobody can raise from here: callback errors go to sys.unraisablehook.
     * A stale handle (freed through a wrapper) is fine. */
    pyd_ctx_t ctx;
    pyd_enter(&ctx, rt, 0);
    dmem_buffer_free(rt->rt, self->h);
    pyd_leave(&ctx);
  }
  PyObject_GC_Del(self);
  Py_DECREF(rt);
}

static int pyd_buffer_traverse(pyd_buffer_t *self, visitproc visit, void *arg) {
  Py_VISIT(self->rt);
  return 0;
}

static int pyd_buffer_info(pyd_buffer_t *b, dmem_buffer_info_t *info) {
  if (pyd_buffer_check(b) < 0) return -1;
  /* No waiting and no callbacks: keep the GIL. */
  dmem_status_t st = dmem_buffer_info(b->rt->rt, b->h, info);
  if (st != DMEM_OK) {
    pyd_raise(st, NULL);
    return -1;
  }
  return 0;
}

/* ---- handle arguments --------------------------------------------------------- */

/* Here rather than in py_args.c: it needs the Buffer type. */
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
  if (allow_int && PyLong_Check(o) && !PyBool_Check(o)) return pyd_handle_int_arg(o, out);
  PyErr_Format(PyExc_TypeError, "expected a dmem.Buffer%s, not %.100s",
               allow_int ? " or an int handle" : "", Py_TYPE(o)->tp_name);
  return -1;
}

/* ---- methods ------------------------------------------------------------------ */

static PyObject *pyd_buffer_free(pyd_buffer_t *self, PyObject *unused) {
  if (pyd_buffer_check(self) < 0) return NULL;
  self->freed = 1;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st = dmem_buffer_free(self->rt->rt, self->h);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

/* Lock on the default stream, copy, synchronise, unlock - all without the
 * GIL. to_device: host -> buffer, else buffer -> host. */
static dmem_status_t pyd_buffer_copy(dmem_runtime_t *rt, dmem_handle_t h, size_t offset,
                                     void *host, size_t n, int to_device) {
  void *dev = NULL;
  dmem_status_t st = dmem_buffer_lock(rt, h, NULL, &dev);
  if (st != DMEM_OK) return st;
  char *d = (char *)dev + offset;
  st = to_device ? dmem_stream_copy(rt, d, host, n, NULL) : dmem_stream_copy(rt, host, d, n, NULL);
  dmem_status_t st2 = dmem_stream_synchronize(rt, NULL);
  if (st == DMEM_OK) st = st2;
  st2 = dmem_buffer_unlock(rt, h);
  if (st == DMEM_OK) st = st2;
  return st;
}

static int pyd_offset_arg(Py_ssize_t offset, Py_ssize_t n, size_t size) {
  if (offset < 0) {
    PyErr_SetString(PyExc_ValueError, "offset must be >= 0");
    return -1;
  }
  if (n < 0) {
    PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
    return -1;
  }
  if ((size_t)offset > size || (size_t)n > size - (size_t)offset) {
    PyErr_Format(PyExc_ValueError, "range [%zd, %zd) is outside the buffer of %zu bytes", offset,
                 offset + n, size);
    return -1;
  }
  return 0;
}

static PyObject *pyd_buffer_write(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"data", "offset", NULL};
  Py_buffer view;
  Py_ssize_t offset = 0;
  PyObject *offset_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|O:write", kwlist, &view, &offset_o)) return NULL;
  PyObject *ret = NULL;
  if (offset_o && pyd_offset_int_arg(offset_o, "offset", &offset) < 0) goto out;
  if (pyd_offset_arg(offset, view.len, self->size) < 0 || pyd_buffer_check(self) < 0) goto out;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st =
      pyd_buffer_copy(self->rt->rt, self->h, (size_t)offset, view.buf, (size_t)view.len, 1);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) goto out;
  ret = Py_None;
  Py_INCREF(ret);
out:
  PyBuffer_Release(&view);
  return ret;
}

/* read() and peek()'s (nbytes=None, offset=0): the range, checked against
 * the buffer's size. */
static int pyd_range_args(pyd_buffer_t *self, PyObject *n_o, PyObject *offset_o,
                          Py_ssize_t *offset_out, Py_ssize_t *n_out) {
  Py_ssize_t n, offset = 0;
  if (offset_o && pyd_offset_int_arg(offset_o, "offset", &offset) < 0) return -1;
  if (n_o == Py_None) {
    if ((size_t)offset > self->size) {
      PyErr_Format(PyExc_ValueError, "offset %zd is outside the buffer of %zu bytes", offset,
                   self->size);
      return -1;
    }
    n = (Py_ssize_t)(self->size - (size_t)offset);
  } else {
    if (!PyLong_Check(n_o) || PyBool_Check(n_o)) {
      PyErr_Format(PyExc_TypeError, "nbytes must be an int or None, not %.100s",
                   Py_TYPE(n_o)->tp_name);
      return -1;
    }
    n = PyLong_AsSsize_t(n_o);
    if (n == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "nbytes out of range");
      return -1;
    }
  }
  if (pyd_offset_arg(offset, n, self->size) < 0) return -1;
  *offset_out = offset;
  *n_out = n;
  return 0;
}

/* read (lock, copy, unlock: the buffer comes back to the device) or peek
 * (dmem_buffer_read: copied from where it is) into a new bytes object. */
static PyObject *pyd_buffer_copy_out(pyd_buffer_t *self, PyObject *args, PyObject *kwds,
                                     int in_place) {
  static char *kwlist[] = {"nbytes", "offset", NULL};
  PyObject *n_o = Py_None, *offset_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, in_place ? "|OO:peek" : "|OO:read", kwlist, &n_o,
                                   &offset_o))
    return NULL;
  Py_ssize_t offset, n;
  if (pyd_range_args(self, n_o, offset_o, &offset, &n) < 0 || pyd_buffer_check(self) < 0)
    return NULL;
  PyObject *out = PyBytes_FromStringAndSize(NULL, n);
  if (!out) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st =
      in_place ? dmem_buffer_read(self->rt->rt, self->h, (size_t)offset, PyBytes_AS_STRING(out),
                                  (size_t)n)
               : pyd_buffer_copy(self->rt->rt, self->h, (size_t)offset, PyBytes_AS_STRING(out),
                                 (size_t)n, 0);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) {
    Py_DECREF(out);
    return NULL;
  }
  return out;
}

static PyObject *pyd_buffer_read(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  return pyd_buffer_copy_out(self, args, kwds, 0);
}

static PyObject *pyd_buffer_peek(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  return pyd_buffer_copy_out(self, args, kwds, 1);
}

/* readinto(out, offset=0): len(out) bytes from offset, read where they are,
 * straight into a writable C-contiguous buffer; the GIL is released while
 * they are copied (the view keeps `out` from being resized meanwhile). */
static PyObject *pyd_buffer_readinto(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"out", "offset", NULL};
  Py_buffer view;
  Py_ssize_t offset = 0;
  PyObject *offset_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*|O:readinto", kwlist, &view, &offset_o))
    return NULL;
  PyObject *ret = NULL;
  if (offset_o && pyd_offset_int_arg(offset_o, "offset", &offset) < 0) goto out;
  if (pyd_offset_arg(offset, view.len, self->size) < 0 || pyd_buffer_check(self) < 0) goto out;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st =
      dmem_buffer_read(self->rt->rt, self->h, (size_t)offset, view.buf, (size_t)view.len);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) goto out;
  ret = PyLong_FromSsize_t(view.len);
out:
  PyBuffer_Release(&view);
  return ret;
}

static PyObject *pyd_buffer_spill(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"tier", NULL};
  PyObject *tier_o = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:spill", kwlist, &tier_o)) return NULL;
  dmem_tier_t tier = DMEM_TIER_HOST;
  if (tier_o && pyd_tier_arg(tier_o, &tier) < 0) return NULL;
  if (pyd_buffer_check(self) < 0) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st = dmem_buffer_spill(self->rt->rt, self->h, tier);
  pyd_leave(&ctx);
  if (st == DMEM_ERR_BUSY && !ctx.exc && pyd_view_exposure(self->rt, self->h, NULL) > 0)
    return pyd_view_raise_exposed(self->rt, self->h, "spill");
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *pyd_buffer_unspill(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"stream", NULL};
  PyObject *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:unspill", kwlist, &stream_o)) return NULL;
  if (pyd_buffer_check(self) < 0) return NULL;
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(self->rt, stream_o, &s, &keep) < 0) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st = dmem_buffer_unspill(self->rt->rt, self->h, s);
  pyd_leave(&ctx);
  Py_XDECREF(keep);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *pyd_buffer_prefetch(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"stream", NULL};
  PyObject *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:prefetch", kwlist, &stream_o)) return NULL;
  if (pyd_buffer_check(self) < 0) return NULL;
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(self->rt, stream_o, &s, &keep) < 0) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st = dmem_buffer_prefetch(self->rt->rt, &self->h, 1, s);
  pyd_leave(&ctx);
  Py_XDECREF(keep);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *pyd_buffer_lock(pyd_buffer_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"stream", NULL};
  PyObject *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:lock", kwlist, &stream_o)) return NULL;
  if (pyd_buffer_check(self) < 0) return NULL;
  return pyd_view_new(self, stream_o);
}

/* ---- properties ----------------------------------------------------------------- */

static PyObject *pyd_buffer_get_handle(pyd_buffer_t *self, void *c) {
  return PyLong_FromUnsignedLongLong(self->h);
}

static PyObject *pyd_buffer_get_size(pyd_buffer_t *self, void *c) {
  return PyLong_FromSize_t(self->size);
}

static PyObject *pyd_buffer_get_runtime(pyd_buffer_t *self, void *c) {
  Py_INCREF(self->rt);
  return (PyObject *)self->rt;
}

static PyObject *pyd_buffer_get_state(pyd_buffer_t *self, void *c) {
  dmem_buffer_info_t info;
  if (pyd_buffer_info(self, &info) < 0) return NULL;
  return PyUnicode_FromString(pyd_state_name(info.state));
}

static PyObject *pyd_buffer_get_lock_count(pyd_buffer_t *self, void *c) {
  dmem_buffer_info_t info;
  if (pyd_buffer_info(self, &info) < 0) return NULL;
  return PyLong_FromUnsignedLong(info.lock_count);
}

static PyObject *pyd_buffer_get_spill_count(pyd_buffer_t *self, void *c) {
  dmem_buffer_info_t info;
  if (pyd_buffer_info(self, &info) < 0) return NULL;
  return PyLong_FromUnsignedLongLong(info.spill_count);
}

static PyObject *pyd_buffer_get_pinned(pyd_buffer_t *self, void *c) {
  dmem_buffer_info_t info;
  if (pyd_buffer_info(self, &info) < 0) return NULL;
  return PyBool_FromLong(info.pinned);
}

static PyObject *pyd_buffer_get_exposed(pyd_buffer_t *self, void *c) {
  return PyBool_FromLong(pyd_view_exposure(self->rt, self->h, NULL) > 0);
}

static PyObject *pyd_buffer_get_priority(pyd_buffer_t *self, void *c) {
  dmem_buffer_info_t info;
  if (pyd_buffer_info(self, &info) < 0) return NULL;
  return PyLong_FromLong(info.priority);
}

static int pyd_buffer_set_priority(pyd_buffer_t *self, PyObject *v, void *c) {
  if (!v) {
    PyErr_SetString(PyExc_AttributeError, "cannot delete priority");
    return -1;
  }
  int p;
  if (pyd_priority_arg(v, &p) < 0) return -1;
  if (pyd_buffer_check(self) < 0) return -1;
  dmem_status_t st = dmem_buffer_set_priority(self->rt->rt, self->h, p);
  if (st != DMEM_OK) {
    pyd_raise(st, NULL);
    return -1;
  }
  return 0;
}

static PyObject *pyd_buffer_repr(pyd_buffer_t *self) {
  const char *state = "freed";
  if (!self->freed && self->rt->rt && !self->rt->closing) {
    dmem_buffer_info_t info;
    if (dmem_buffer_info(self->rt->rt, self->h, &info) == DMEM_OK) state = pyd_state_name(info.state);
    else state = "stale";
  } else if (!self->freed) {
    state = "runtime closed";
  }
  char text[160];
  snprintf(text, sizeof text, "<dmem.Buffer handle=0x%llx size=%zu %s%s>",
           (unsigned long long)self->h, self->size, state, self->owning ? "" : " (borrowed)");
  return PyUnicode_FromString(text);
}

static PyObject *pyd_buffer_richcompare(PyObject *a, PyObject *b, int op) {
  if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(a, &pyd_buffer_type) ||
      !PyObject_TypeCheck(b, &pyd_buffer_type))
    Py_RETURN_NOTIMPLEMENTED;
  pyd_buffer_t *x = (pyd_buffer_t *)a, *y = (pyd_buffer_t *)b;
  int eq = x->rt == y->rt && x->h == y->h;
  return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static Py_hash_t pyd_buffer_hash(pyd_buffer_t *self) {
  uint64_t x = self->h * 0x9E3779B97F4A7C15ull;
  Py_hash_t h = (Py_hash_t)(x >> 1);
  return h == -1 ? -2 : h;
}

static PyMethodDef pyd_buffer_methods[] = {
    {"free", (PyCFunction)pyd_buffer_free, METH_NOARGS,
     "free(): free the buffer now; every later use raises StaleHandleError. Memory that\n"
     "exports (arrays, DLPack tensors) still use is reclaimed when the last of them dies."},
    {"write", (PyCFunction)(void (*)(void))pyd_buffer_write, METH_VARARGS | METH_KEYWORDS,
     "write(data, offset=0): copy a bytes-like object into the buffer at offset."},
    {"read", (PyCFunction)(void (*)(void))pyd_buffer_read, METH_VARARGS | METH_KEYWORDS,
     "read(nbytes=None, offset=0) -> bytes: copy bytes out of the buffer (locks it:\n"
     "a spilled buffer comes back to the device)."},
    {"peek", (PyCFunction)(void (*)(void))pyd_buffer_peek, METH_VARARGS | METH_KEYWORDS,
     "peek(nbytes=None, offset=0) -> bytes: copy bytes out of the buffer from where\n"
     "they are (device, host or disk), without moving it (dmem_buffer_read).\n"
     "Raises BusyError for a buffer held by the controller."},
    {"readinto", (PyCFunction)(void (*)(void))pyd_buffer_readinto, METH_VARARGS | METH_KEYWORDS,
     "readinto(out, offset=0) -> int: fill the writable, C-contiguous buffer `out`\n"
     "(bytearray, memoryview, numpy array ...) with len(out) bytes from offset,\n"
     "read where they are as peek() does; returns the number of bytes."},
    {"spill", (PyCFunction)(void (*)(void))pyd_buffer_spill, METH_VARARGS | METH_KEYWORDS,
     "spill(tier='host'): move to 'host', 'disk' or 'controller' and wait for the move.\n"
     "BusyError if the buffer is locked or pinned; for an exposed buffer its message names\n"
     "the kinds of exports that still hold it."},
    {"unspill", (PyCFunction)(void (*)(void))pyd_buffer_unspill, METH_VARARGS | METH_KEYWORDS,
     "unspill(stream=None): bring the bytes back to the device, ordered on stream."},
    {"prefetch", (PyCFunction)(void (*)(void))pyd_buffer_prefetch, METH_VARARGS | METH_KEYWORDS,
     "prefetch(stream=None): start bringing the bytes back without locking; work on stream\n"
     "after this call sees them (dmem_buffer_prefetch of this buffer)."},
    {"lock", (PyCFunction)(void (*)(void))pyd_buffer_lock, METH_VARARGS | METH_KEYWORDS,
     "lock(stream=None) -> View, for `with buf.lock(stream) as view:`.\n"
     "The buffer is locked (resident) inside the block; view.ptr, __cuda_array_interface__\n"
     "(CUDA), __array_interface__ and the buffer protocol (host backend) and __dlpack__ are\n"
     "handed out there only. At the end of the block the stream is synchronised (CUDA) and the\n"
     "block's claim ends; what the view handed out (arrays, capsules, tensors) keeps the\n"
     "buffer locked until it is collected (see Buffer.exposed)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pyd_buffer_getset[] = {
    {"handle", (getter)pyd_buffer_get_handle, NULL, "the 64-bit dmem handle", NULL},
    {"size", (getter)pyd_buffer_get_size, NULL, "size in bytes", NULL},
    {"runtime", (getter)pyd_buffer_get_runtime, NULL, "the Runtime this buffer belongs to", NULL},
    {"state", (getter)pyd_buffer_get_state, NULL,
     "'resident', 'spilling', 'deferred_host', 'deferred_disk', 'deferred_controller' or "
     "'unspilling'",
     NULL},
    {"lock_count", (getter)pyd_buffer_get_lock_count, NULL, "current number of locks", NULL},
    {"spill_count", (getter)pyd_buffer_get_spill_count, NULL, "completed spills", NULL},
    {"pinned", (getter)pyd_buffer_get_pinned, NULL, "allocated with pinned=True", NULL},
    {"exposed", (getter)pyd_buffer_get_exposed, NULL,
     "True while something a lock view handed out (memoryview / numpy array, a View whose\n"
     "array interface was taken, a DLPack capsule or tensor) is alive and keeps it locked",
     NULL},
    {"priority", (getter)pyd_buffer_get_priority, (setter)pyd_buffer_set_priority,
     "priority class (higher stays on the device longer)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject pyd_buffer_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem.Buffer",
    .tp_basicsize = sizeof(pyd_buffer_t),
    .tp_dealloc = (destructor)pyd_buffer_dealloc,
    .tp_repr = (reprfunc)pyd_buffer_repr,
    .tp_hash = (hashfunc)pyd_buffer_hash,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A spillable dmem buffer (from Runtime.alloc). Freed when collected or by\n"
              "free(). Buffers compare equal when they name the same handle of the same\n"
              "runtime.",
    .tp_traverse = (traverseproc)pyd_buffer_traverse,
    .tp_richcompare = pyd_buffer_richcompare,
    .tp_weaklistoffset = offsetof(pyd_buffer_t, weakreflist),
    .tp_methods = pyd_buffer_methods,
    .tp_getset = pyd_buffer_getset,
};
