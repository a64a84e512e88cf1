/*
 * pybridge/view.c - dmem.View: the only way to get a buffer's address.
 *
 *   with buf.lock(stream) as view:
 *       view.ptr, view.size
 *       view.__cuda_array_interface__   (CUDA backend; v3, with "stream")
 *       view.__array_interface__        (host backend; v3)
 *       view.__dlpack__(), view.__dlpack_device__()
 *
 * __enter__ locks the buffer on `stream` (under the host backend it also
 * synchronises the stream, so the bytes are readable by the CPU at once).
 * __exit__ synchronises the stream under CUDA, then unlocks. Every attribute
 * that hands out the address raises NotLockedError before __enter__ and after
 * __exit__. Arrays made from a view (numpy, CuPy, DLPack consumers) must not
 * be used after the block: the buffer may be spilled and its memory reused.
 *
 * This file sits below buffer.c: it reads a Buffer's fields and checks it
 * with pyd_buffer_check (args.c), and Buffer.lock() calls pyd_view_new.
 */
#include "pydmem.h"

#include "dlpack.h"

PyObject *pyd_view_new(pyd_buffer_t *buf, PyObject *stream_o) {
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(buf->rt, stream_o, &s, &keep) < 0) return NULL;
  pyd_view_t *v = PyObject_New(pyd_view_t, &pyd_view_type);
  if (!v) {
    Py_XDECREF(keep);
    return NULL;
  }
  Py_INCREF(buf);
  v->buf = buf;
  v->stream_obj = keep;
  v->stream = s;
  v->h = buf->h;
  v->ptr = NULL;
  v->state = PYD_VIEW_NEW;
  return (PyObject *)v;
}

static int pyd_view_locked(pyd_view_t *v) {
  if (v->buf->rt->forked) return pyd_runtime_check(v->buf->rt); /* ForkedError */
  if (v->state != PYD_VIEW_LOCKED || !v->buf->rt->rt || v->buf->rt->closing) {
    pyd_raise(DMEM_ERR_NOT_LOCKED, v->state == PYD_VIEW_NEW
                                       ? "view used before its `with` block"
                                       : "view used outside its `with` block");
    return -1;
  }
  return 0;
}

static pyd_stream_t *pyd_view_dmem_stream(pyd_view_t *v) {
  if (v->stream_obj && Py_IS_TYPE(v->stream_obj, &pyd_stream_type))
    return (pyd_stream_t *)v->stream_obj;
  return NULL;
}

static PyObject *pyd_view_enter(pyd_view_t *self, PyObject *unused) {
  if (self->state != PYD_VIEW_NEW) {
    PyErr_SetString(PyExc_ValueError, "a lock view can be entered only once; call buf.lock() again");
    return NULL;
  }
  pyd_buffer_t *b = self->buf;
  if (pyd_buffer_check(b) < 0) return NULL;
  pyd_stream_t *so = pyd_view_dmem_stream(self);
  if (so && !so->s) {
    PyErr_SetString(PyExc_ValueError, "stream is closed");
    return NULL;
  }
  pyd_runtime_t *rt = b->rt;
  int host = rt->backend != DMEM_BACKEND_CUDA;
  void *ptr = NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, rt, 1);
  dmem_status_t st = dmem_lock(rt->rt, self->h, self->stream, &ptr);
  if (st == DMEM_OK && host) {
    /* The retrieve (if any) was queued on the stream: let the CPU see it. */
    st = dmem_stream_synchronize(rt->rt, self->stream);
    if (st != DMEM_OK) dmem_unlock(rt->rt, self->h);
  }
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) {
    if (st == DMEM_OK) { /* a callback raised but the lock was taken: undo it */
      pyd_ctx_t c2;
      pyd_enter(&c2, rt, 0);
      dmem_unlock(rt->rt, self->h);
      pyd_leave(&c2);
    }
    return NULL;
  }
  self->ptr = ptr;
  self->state = PYD_VIEW_LOCKED;
  if (so) so->views++;
  Py_INCREF(self);
  return (PyObject *)self;
}

/* Release the lock (sync the stream first under CUDA). accept: 1 from
 * __exit__ (errors raise), 0 from dealloc. */
static dmem_status_t pyd_view_release(pyd_view_t *self, pyd_ctx_t *ctx, int accept) {
  pyd_runtime_t *rt = self->buf->rt;
  pyd_stream_t *so = pyd_view_dmem_stream(self);
  self->state = PYD_VIEW_DONE;
  self->ptr = NULL;
  if (so) so->views--;
  if (!rt->rt || rt->closing) return DMEM_OK; /* the runtime freed everything */
  int cuda = rt->backend == DMEM_BACKEND_CUDA;
  pyd_enter(ctx, rt, accept);
  dmem_status_t st = DMEM_OK;
  if (cuda) st = dmem_stream_synchronize(rt->rt, self->stream);
  dmem_status_t st2 = dmem_unlock(rt->rt, self->h);
  pyd_leave(ctx);
  return st != DMEM_OK ? st : st2;
}

static PyObject *pyd_view_exit(pyd_view_t *self, PyObject *args) {
  PyObject *et, *ev, *tb;
  if (!PyArg_UnpackTuple(args, "__exit__", 3, 3, &et, &ev, &tb)) return NULL;
  if (self->state != PYD_VIEW_LOCKED)
    return pyd_raise(DMEM_ERR_NOT_LOCKED, "view.__exit__ without a matching __enter__");
  pyd_ctx_t ctx = {0};
  dmem_status_t st = pyd_view_release(self, &ctx, 1);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_FALSE;
}

static void pyd_view_dealloc(pyd_view_t *self) {
  if (self->state == PYD_VIEW_LOCKED) { /* __enter__ without __exit__ */
    pyd_ctx_t ctx = {0};
    pyd_view_release(self, &ctx, 0);
    Py_CLEAR(ctx.exc);
  }
  Py_XDECREF(self->stream_obj);
  Py_DECREF(self->buf);
  PyObject_Free(self);
}

/* ---- address and interfaces --------------------------------------------------- */

static PyObject *pyd_view_get_ptr(pyd_view_t *self, void *c) {
  if (pyd_view_locked(self) < 0) return NULL;
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->ptr);
}

static PyObject *pyd_view_get_size(pyd_view_t *self, void *c) {
  if (pyd_view_locked(self) < 0) return NULL;
  return PyLong_FromSize_t(self->buf->size);
}

static PyObject *pyd_view_get_locked(pyd_view_t *self, void *c) {
  return PyBool_FromLong(self->state == PYD_VIEW_LOCKED && self->buf->rt->rt &&
                         !self->buf->rt->closing);
}

static PyObject *pyd_view_get_buffer(pyd_view_t *self, void *c) {
  Py_INCREF(self->buf);
  return (PyObject *)self->buf;
}

static PyObject *pyd_view_get_stream(pyd_view_t *self, void *c) {
  if (!self->stream) Py_RETURN_NONE;
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->stream);
}

static PyObject *pyd_view_get_cai(pyd_view_t *self, void *c) {
  if (self->buf->rt->backend != DMEM_BACKEND_CUDA) {
    PyErr_SetString(PyExc_AttributeError,
                    "__cuda_array_interface__ is only available on the CUDA backend");
    return NULL;
  }
  if (pyd_view_locked(self) < 0) return NULL;
  /* CAI v3 "stream": 1 is the legacy default stream; 0 is disallowed. */
  unsigned long long s = self->stream ? (unsigned long long)(uintptr_t)self->stream : 1ull;
  return Py_BuildValue("{s:(n),s:s,s:(KO),s:i,s:O,s:K}", "shape", (Py_ssize_t)self->buf->size,
                       "typestr", "|u1", "data",
                       (unsigned long long)(uintptr_t)self->ptr, Py_False, "version", 3,
                       "strides", Py_None, "stream", s);
}

static PyObject *pyd_view_get_ai(pyd_view_t *self, void *c) {
  if (self->buf->rt->backend == DMEM_BACKEND_CUDA) {
    PyErr_SetString(PyExc_AttributeError,
                    "__array_interface__ is only available on the host backend "
                    "(use __cuda_array_interface__ or __dlpack__)");
    return NULL;
  }
  if (pyd_view_locked(self) < 0) return NULL;
  return Py_BuildValue("{s:(n),s:s,s:(KO),s:i,s:O}", "shape", (Py_ssize_t)self->buf->size,
                       "typestr", "|u1", "data", (unsigned long long)(uintptr_t)self->ptr,
                       Py_False, "version", 3, "strides", Py_None);
}

static void pyd_view_dl_device(pyd_view_t *self, int32_t *type, int32_t *id) {
  if (self->buf->rt->backend == DMEM_BACKEND_CUDA) {
    *type = kDLCUDA;
    *id = self->buf->rt->device;
  } else {
    *type = kDLCPU;
    *id = 0;
  }
}

static PyObject *pyd_view_dlpack_device(pyd_view_t *self, PyObject *unused) {
  if (pyd_view_locked(self) < 0) return NULL;
  int32_t t, id;
  pyd_view_dl_device(self, &t, &id);
  return Py_BuildValue("(ii)", (int)t, (int)id);
}

typedef struct {
  DLManagedTensor mt;
  int64_t shape[1];
  int64_t strides[1];
} pyd_dl_legacy_t;

typedef struct {
  DLManagedTensorVersioned mt;
  int64_t shape[1];
  int64_t strides[1];
} pyd_dl_versioned_t;

/* Deleters may be called from any thread, with or without the GIL. */
static void pyd_dl_release_owner(void *owner) {
  if (!owner || pyd_finalizing()) return; /* leak at shutdown rather than crash */
  PyGILState_STATE g = PyGILState_Ensure();
  Py_DECREF((PyObject *)owner);
  PyGILState_Release(g);
}

static void pyd_dl_legacy_deleter(DLManagedTensor *self) {
  pyd_dl_release_owner(self->manager_ctx);
  PyMem_RawFree(self);
}

static void pyd_dl_versioned_deleter(DLManagedTensorVersioned *self) {
  pyd_dl_release_owner(self->manager_ctx);
  PyMem_RawFree(self);
}

static void pyd_dl_capsule_destructor(PyObject *cap) {
  /* Called when the capsule dies; a consumer that took the tensor renamed it. */
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
    if (mt && mt->deleter) mt->deleter(mt);
  } else if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    DLManagedTensorVersioned *mt = PyCapsule_GetPointer(cap, "dltensor_versioned");
    if (mt && mt->deleter) mt->deleter(mt);
  }
}

static void pyd_dl_fill(DLTensor *t, pyd_view_t *self, int64_t *shape, int64_t *strides) {
  shape[0] = (int64_t)self->buf->size;
  strides[0] = 1;
  t->data = self->ptr;
  int32_t type, id;
  pyd_view_dl_device(self, &type, &id);
  t->device.device_type = (DLDeviceType)type;
  t->device.device_id = id;
  t->ndim = 1;
  t->dtype.code = kDLUInt;
  t->dtype.bits = 8;
  t->dtype.lanes = 1;
  t->shape = shape;
  t->strides = strides;
  t->byte_offset = 0;
}

static PyObject *pyd_view_dlpack(pyd_view_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
  PyObject *stream_o = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$OOO:__dlpack__", kwlist, &stream_o,
                                   &max_version, &dl_device, &copy))
    return NULL;
  if (pyd_view_locked(self) < 0) return NULL;
  int32_t type, id;
  pyd_view_dl_device(self, &type, &id);
  if (dl_device != Py_None) {
    int rt_type, rt_id;
    if (!PyTuple_Check(dl_device)) {
      PyErr_SetString(PyExc_TypeError, "dl_device must be a (device_type, device_id) tuple");
      return NULL;
    }
    if (!PyArg_ParseTuple(dl_device, "ii;dl_device must be a (device_type, device_id) tuple",
                          &rt_type, &rt_id))
      return NULL;
    if (rt_type != type || rt_id != id) {
      PyErr_SetString(PyExc_BufferError, "dmem views cannot be exported to another device");
      return NULL;
    }
  }
  if (copy != Py_None) {
    int t = PyObject_IsTrue(copy);
    if (t < 0) return NULL;
    if (t) {
      PyErr_SetString(PyExc_BufferError, "dmem views are exported without copying (copy=True)");
      return NULL;
    }
  }
  int versioned = 0;
  if (max_version != Py_None) {
    unsigned int major = 0, minor = 0;
    if (!PyTuple_Check(max_version)) {
      PyErr_SetString(PyExc_TypeError, "max_version must be a (major, minor) tuple");
      return NULL;
    }
    if (!PyArg_ParseTuple(max_version, "II;max_version must be a (major, minor) tuple", &major,
                          &minor))
      return NULL;
    versioned = major >= 1;
  }
  /* Stream order (CUDA): the consumer's stream must see the retrieve queued
   * on the lock stream. Same stream: nothing to do; -1: consumer opts out;
   * otherwise synchronise the lock stream (simple and always correct). */
  long long req = 1; /* None: the legacy default stream */
  if (stream_o != Py_None) { /* an int or None on every device (DLPack) */
    if (!PyLong_Check(stream_o)) {
      PyErr_Format(PyExc_TypeError, "stream must be an int or None, not %.100s",
                   Py_TYPE(stream_o)->tp_name);
      return NULL;
    }
    int ovf = 0;
    req = PyLong_AsLongLongAndOverflow(stream_o, &ovf);
    if (req == -1 && PyErr_Occurred()) return NULL;
    if (ovf) {
      PyErr_Format(PyExc_ValueError, "stream %R is out of range", stream_o);
      return NULL;
    }
  }
  if (type == kDLCUDA) {
    unsigned long long mine = self->stream ? (unsigned long long)(uintptr_t)self->stream : 1ull;
    int same = (unsigned long long)req == mine || (!self->stream && req == 0);
    if (req != -1 && !same) {
      pyd_runtime_t *rt = self->buf->rt;
      pyd_ctx_t ctx;
      pyd_enter(&ctx, rt, 1);
      dmem_status_t st = dmem_stream_synchronize(rt->rt, self->stream);
      pyd_leave(&ctx);
      if (pyd_finish(&ctx, st) < 0) return NULL;
    }
  }
  PyObject *cap;
  if (versioned) {
    pyd_dl_versioned_t *m = PyMem_RawCalloc(1, sizeof *m);
    if (!m) return PyErr_NoMemory();
    m->mt.version.major = DLPACK_MAJOR_VERSION;
    m->mt.version.minor = DLPACK_MINOR_VERSION;
    m->mt.manager_ctx = self;
    m->mt.deleter = pyd_dl_versioned_deleter;
    m->mt.flags = 0;
    pyd_dl_fill(&m->mt.dl_tensor, self, m->shape, m->strides);
    Py_INCREF(self);
    cap = PyCapsule_New(&m->mt, "dltensor_versioned", pyd_dl_capsule_destructor);
    if (!cap) m->mt.deleter(&m->mt);
  } else {
    pyd_dl_legacy_t *m = PyMem_RawCalloc(1, sizeof *m);
    if (!m) return PyErr_NoMemory();
    m->mt.manager_ctx = self;
    m->mt.deleter = pyd_dl_legacy_deleter;
    pyd_dl_fill(&m->mt.dl_tensor, self, m->shape, m->strides);
    Py_INCREF(self);
    cap = PyCapsule_New(&m->mt, "dltensor", pyd_dl_capsule_destructor);
    if (!cap) m->mt.deleter(&m->mt);
  }
  return cap;
}

static PyObject *pyd_view_repr(pyd_view_t *self) {
  const char *st = self->state == PYD_VIEW_NEW ? "not entered"
                   : self->state == PYD_VIEW_LOCKED ? "locked"
                                                    : "released";
  char text[96];
  snprintf(text, sizeof text, "<dmem.View of handle 0x%llx, %s>", (unsigned long long)self->h, st);
  return PyUnicode_FromString(text);
}

static PyMethodDef pyd_view_methods[] = {
    {"__enter__", (PyCFunction)pyd_view_enter, METH_NOARGS, "Lock the buffer."},
    {"__exit__", (PyCFunction)pyd_view_exit, METH_VARARGS,
     "Synchronise the stream (CUDA) and unlock."},
    {"__dlpack__", (PyCFunction)(void (*)(void))pyd_view_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None)\n\n"
     "DLPack capsule of a 1-D uint8 tensor over the locked bytes ('dltensor', or\n"
     "'dltensor_versioned' when max_version >= (1, 0)). The tensor keeps the view alive but\n"
     "not the lock: do not use it after the block."},
    {"__dlpack_device__", (PyCFunction)pyd_view_dlpack_device, METH_NOARGS,
     "(kDLCUDA=2, device) under CUDA, (kDLCPU=1, 0) under the host backend."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pyd_view_getset[] = {
    {"ptr", (getter)pyd_view_get_ptr, NULL, "device address (int); NotLockedError outside", NULL},
    {"size", (getter)pyd_view_get_size, NULL, "size in bytes; NotLockedError outside", NULL},
    {"locked", (getter)pyd_view_get_locked, NULL, "True inside the with block", NULL},
    {"buffer", (getter)pyd_view_get_buffer, NULL, "the Buffer", NULL},
    {"stream", (getter)pyd_view_get_stream, NULL, "the lock stream as an int, or None", NULL},
    {"__cuda_array_interface__", (getter)pyd_view_get_cai, NULL,
     "CUDA Array Interface v3 (CUDA backend only)", NULL},
    {"__array_interface__", (getter)pyd_view_get_ai, NULL,
     "NumPy array interface v3 (host backend only)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject pyd_view_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem.View",
    .tp_basicsize = sizeof(pyd_view_t),
    .tp_dealloc = (destructor)pyd_view_dealloc,
    .tp_repr = (reprfunc)pyd_view_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A locked view of a Buffer (from Buffer.lock); usable only inside its with block.",
    .tp_methods = pyd_view_methods,
    .tp_getset = pyd_view_getset,
};

int pyd_view_type_ready(void) { return PyType_Ready(&pyd_view_type); }
