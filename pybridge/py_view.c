/*
 * pybridge/py_view.c - dmem.View: the only way to get a buffer's address.
 *
 *   with buf.lock(stream) as view:
 *       view.ptr, view.size
 *       view.__cuda_array_interface__   (CUDA backend; v3, with "stream")
 *       view.__array_interface__        (host backend; v3)
 *       memoryview(view), numpy.asarray(view) (host backend: buffer protocol)
 *       view.__dlpack__(), view.__dlpack_device__()
 *
 * __enter__ locks the buffer on `stream` (under the host backend it also
 * synchronises the stream, so the bytes are readable by the CPU at once).
 * Every attribute that hands out the address raises NotLockedError before
 * __enter__ and after __exit__.
 *
 * Exports. What the view hands out keeps the buffer locked for as long as it
 * lives, so that an array which outlives the block never sees its memory
 * spilled and reused:
 *  - the buffer protocol: each Py_buffer (a memoryview, the memoryview under
 *    numpy.asarray's array) is one export, dropped by bf_releasebuffer;
 *  - the array interfaces: arrays built from __array_interface__ or
 *    __cuda_array_interface__ (NumPy, CuPy, Numba, PyTorch) keep the View
 *    itself as their base/owner, so the first access makes the View one
 *    export, dropped when the View is collected (its `as` name included);
 *  - DLPack: each capsule is one export, dropped by its DLPack deleter (when
 *    an unconsumed capsule dies, or when the consumer's tensor does).
 * __exit__ ends only the block's own claim (synchronising the stream under
 * CUDA, as always). The view's one dmem lock is given back (stream
 * synchronised under CUDA, then dmem_buffer_unlock) when the block has ended and the
 * last export has died. While any export lives the view is linked in its
 * runtime's `exposed` list: Buffer.exposed, rt.stats()["exposed"] and the
 * BusyError of spill() and Runtime.close() read it.
 *
 * This file sits below py_buffer.c: it reads a Buffer's fields and checks it
 * with pyd_buffer_check (py_args.c), and Buffer.lock() calls pyd_view_new.
 */
#include "pydmem.h"

#include "dlpack.h"

PyObject *pyd_view_new(pyd_buffer_t *buf, PyObject *stream_o) {
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(buf->rt, stream_o, &s, &keep) < 0) return NULL;
  pyd_view_t *v = PyObject_GC_New(pyd_view_t, &pyd_view_type);
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
  v->held = 0;
  for (int k = 0; k < PYD_EXPORT_KINDS; k++) v->exports[k] = 0;
  v->exp_prev = v->exp_next = NULL;
  PyObject_GC_Track(v);
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
  dmem_status_t st = dmem_buffer_lock(rt->rt, self->h, self->stream, &ptr);
  if (st == DMEM_OK && host) {
    /* The retrieve (if any) was queued on the stream: let the CPU see it. */
    st = dmem_stream_synchronize(rt->rt, self->stream);
    if (st != DMEM_OK) dmem_buffer_unlock(rt->rt, self->h);
  }
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) {
    if (st == DMEM_OK) { /* a callback raised but the lock was taken: undo it */
      pyd_ctx_t c2;
      pyd_enter(&c2, rt, 0);
      dmem_buffer_unlock(rt->rt, self->h);
      pyd_leave(&c2);
    }
    return NULL;
  }
  self->ptr = ptr;
  self->state = PYD_VIEW_LOCKED;
  self->held = 1;
  if (so) so->views++;
  Py_INCREF(self);
  return (PyObject *)self;
}

/* Give the view's dmem lock back (sync the stream first under CUDA). accept:
 * 1 from __exit__ (errors raise), 0 from a collection or a DLPack deleter. */
static dmem_status_t pyd_view_unlock(pyd_view_t *self, pyd_ctx_t *ctx, int accept) {
  pyd_runtime_t *rt = self->buf->rt;
  pyd_stream_t *so = pyd_view_dmem_stream(self);
  self->held = 0;
  self->ptr = NULL;
  if (so) so->views--;
  if (!rt->rt || rt->closing) return DMEM_OK; /* the runtime freed everything */
  int cuda = rt->backend == DMEM_BACKEND_CUDA;
  pyd_enter(ctx, rt, accept);
  dmem_status_t st = DMEM_OK;
  if (cuda) st = dmem_stream_synchronize(rt->rt, self->stream);
  dmem_status_t st2 = dmem_buffer_unlock(rt->rt, self->h);
  pyd_leave(ctx);
  return st != DMEM_OK ? st : st2;
}

/* ---- exports ---------------------------------------------------------------------- */

static Py_ssize_t pyd_view_export_total(const pyd_view_t *v) {
  Py_ssize_t n = 0;
  for (int k = 0; k < PYD_EXPORT_KINDS; k++) n += v->exports[k];
  return n;
}

/* One more export of `kind`; the view must be held. */
static void pyd_view_export_add(pyd_view_t *self, int kind) {
  pyd_runtime_t *rt = self->buf->rt;
  if (pyd_view_export_total(self) == 0) { /* link at the head of rt->exposed */
    self->exp_prev = NULL;
    self->exp_next = rt->exposed;
    if (rt->exposed) rt->exposed->exp_prev = self;
    rt->exposed = self;
  }
  self->exports[kind]++;
  rt->exports[kind]++;
}

static void pyd_view_exposed_unlink(pyd_view_t *self) {
  pyd_runtime_t *rt = self->buf->rt;
  if (self->exp_prev) self->exp_prev->exp_next = self->exp_next;
  else if (rt->exposed == self) rt->exposed = self->exp_next;
  if (self->exp_next) self->exp_next->exp_prev = self->exp_prev;
  self->exp_prev = self->exp_next = NULL;
}

/* One export of `kind` died. The last export of a view whose block has ended
 * gives the lock back. Called with the GIL from a collection, a buffer
 * release or a DLPack deleter: nobody can raise from there, so callback
 * errors go to sys.unraisablehook and a failing unlock is dropped (the
 * pending exception, if any, is kept). */
static void pyd_view_export_drop(pyd_view_t *self, int kind) {
  pyd_runtime_t *rt = self->buf->rt;
  self->exports[kind]--;
  rt->exports[kind]--;
  if (pyd_view_export_total(self) > 0) return;
  pyd_view_exposed_unlink(self);
  if (self->state != PYD_VIEW_LOCKED && self->held) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    pyd_ctx_t ctx = {0};
    pyd_view_unlock(self, &ctx, 0);
    Py_CLEAR(ctx.exc);
    PyErr_Restore(et, ev, etb);
  }
}

Py_ssize_t pyd_view_exposure(pyd_runtime_t *rt, dmem_handle_t h, Py_ssize_t *counts) {
  Py_ssize_t views = 0;
  for (pyd_view_t *v = rt->exposed; v; v = v->exp_next) {
    if (h && v->h != h) continue;
    views++;
    if (counts)
      for (int k = 0; k < PYD_EXPORT_KINDS; k++) counts[k] += v->exports[k];
  }
  return views;
}

Py_ssize_t pyd_view_exposed_buffers(pyd_runtime_t *rt) {
  if (!rt->exposed) return 0;
  PyObject *set = PySet_New(NULL);
  if (!set) return -1;
  for (pyd_view_t *v = rt->exposed; v; v = v->exp_next) {
    PyObject *k = PyLong_FromUnsignedLongLong(v->h);
    if (!k || PySet_Add(set, k) < 0) {
      Py_XDECREF(k);
      Py_DECREF(set);
      return -1;
    }
    Py_DECREF(k);
  }
  Py_ssize_t n = PySet_GET_SIZE(set);
  Py_DECREF(set);
  return n;
}

PyObject *pyd_view_raise_exposed(pyd_runtime_t *rt, dmem_handle_t h, const char *what) {
  static const char *const kinds[PYD_EXPORT_KINDS][2] = {
      {"numpy/buffer-protocol export", "memoryview, numpy.asarray"},
      {"array-interface export", "a View whose __array_interface__ or __cuda_array_interface__ "
                                 "was taken; arrays made from it keep it alive"},
      {"DLPack export", "a capsule from __dlpack__, or the tensor made from it"}};
  Py_ssize_t counts[PYD_EXPORT_KINDS] = {0};
  pyd_view_exposure(rt, h, counts);
  char text[640];
  size_t len = (size_t)snprintf(text, sizeof text, "%s refused: the %s still held by ", what,
                                h ? "buffer is" : "runtime's buffers are");
  int first = 1;
  for (int k = 0; k < PYD_EXPORT_KINDS && len < sizeof text; k++) {
    if (!counts[k]) continue;
    len += (size_t)snprintf(text + len, sizeof text - len, "%s%zd %s%s (%s)", first ? "" : ", ",
                            counts[k], kinds[k][0], counts[k] > 1 ? "s" : "", kinds[k][1]);
    first = 0;
  }
  if (len < sizeof text)
    snprintf(text + len, sizeof text - len,
             "; the lock ends when the last of them is collected (del them)");
  return pyd_raise(DMEM_ERR_BUSY, text);
}

/* ---- the with block --------------------------------------------------------------- */

static PyObject *pyd_view_exit(pyd_view_t *self, PyObject *args) {
  PyObject *et, *ev, *tb;
  if (!PyArg_UnpackTuple(args, "__exit__", 3, 3, &et, &ev, &tb)) return NULL;
  if (self->state != PYD_VIEW_LOCKED)
    return pyd_raise(DMEM_ERR_NOT_LOCKED, "view.__exit__ without a matching __enter__");
  self->state = PYD_VIEW_DONE; /* the block's claim ends here */
  pyd_ctx_t ctx = {0};
  dmem_status_t st = DMEM_OK;
  pyd_runtime_t *rt = self->buf->rt;
  if (pyd_view_export_total(self) == 0) {
    st = pyd_view_unlock(self, &ctx, 1);
  } else if (rt->backend == DMEM_BACKEND_CUDA && rt->rt && !rt->closing) {
    /* Exports keep the lock; the block still ends with its stream's work done. */
    pyd_enter(&ctx, rt, 1);
    st = dmem_stream_synchronize(rt->rt, self->stream);
    pyd_leave(&ctx);
  }
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_FALSE;
}

static int pyd_view_traverse(pyd_view_t *self, visitproc visit, void *arg) {
  Py_VISIT(self->buf);
  Py_VISIT(self->stream_obj);
  return 0;
}

static void pyd_view_dealloc(pyd_view_t *self) {
  PyObject_GC_UnTrack(self);
  /* Only the array-interface export can still live here: buffer-protocol
   * and DLPack exports hold references to the view. */
  self->state = PYD_VIEW_DONE; /* a block entered and never exited ends too */
  if (self->exports[PYD_EXPORT_IFACE]) pyd_view_export_drop(self, PYD_EXPORT_IFACE);
  if (pyd_view_export_total(self) > 0) { /* cannot happen; never leave a dangling link */
    pyd_runtime_t *rt = self->buf->rt;
    for (int k = 0; k < PYD_EXPORT_KINDS; k++) {
      rt->exports[k] -= self->exports[k];
      self->exports[k] = 0;
    }
    pyd_view_exposed_unlink(self);
  }
  if (self->held) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    pyd_ctx_t ctx = {0};
    pyd_view_unlock(self, &ctx, 0);
    Py_CLEAR(ctx.exc);
    PyErr_Restore(et, ev, etb);
  }
  Py_XDECREF(self->stream_obj);
  Py_DECREF(self->buf);
  PyObject_GC_Del(self);
}

/* ---- the buffer protocol (host backend) -------------------------------------------- */

static int pyd_view_getbuffer(pyd_view_t *self, Py_buffer *view, int flags) {
  if (self->buf->rt->backend == DMEM_BACKEND_CUDA) {
    PyErr_SetString(PyExc_BufferError,
                    "a CUDA view is device memory: use __cuda_array_interface__ or __dlpack__");
    return -1;
  }
  if (pyd_view_locked(self) < 0) return -1;
  if (PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, (Py_ssize_t)self->buf->size, 0,
                        flags) < 0)
    return -1;
  pyd_view_export_add(self, PYD_EXPORT_BUFFER);
  return 0;
}

static void pyd_view_releasebuffer(pyd_view_t *self, Py_buffer *view) {
  (void)view;
  pyd_view_export_drop(self, PYD_EXPORT_BUFFER);
}

static PyBufferProcs pyd_view_as_buffer = {
    .bf_getbuffer = (getbufferproc)pyd_view_getbuffer,
    .bf_releasebuffer = (releasebufferproc)pyd_view_releasebuffer,
};

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
  /* The consumer keeps this View as the array's owner: it is the export. */
  if (!self->exports[PYD_EXPORT_IFACE]) pyd_view_export_add(self, PYD_EXPORT_IFACE);
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
  /* The consumer keeps this View as the array's base: it is the export. */
  if (!self->exports[PYD_EXPORT_IFACE]) pyd_view_export_add(self, PYD_EXPORT_IFACE);
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

/* Deleters may be called from any thread, with or without the GIL: drop the
 * capsule's export (the last one of an ended block unlocks), then the view. */
static void pyd_dl_release_owner(void *owner) {
  if (!owner || pyd_finalizing()) return; /* leak at shutdown rather than crash */
  PyGILState_STATE g = PyGILState_Ensure();
  pyd_view_export_drop((pyd_view_t *)owner, PYD_EXPORT_DLPACK);
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
    pyd_view_export_add(self, PYD_EXPORT_DLPACK); /* both dropped by the deleter */
    Py_INCREF(self);
    cap = PyCapsule_New(&m->mt, "dltensor_versioned", pyd_dl_capsule_destructor);
    if (!cap) m->mt.deleter(&m->mt);
  } else {
    pyd_dl_legacy_t *m = PyMem_RawCalloc(1, sizeof *m);
    if (!m) return PyErr_NoMemory();
    m->mt.manager_ctx = self;
    m->mt.deleter = pyd_dl_legacy_deleter;
    pyd_dl_fill(&m->mt.dl_tensor, self, m->shape, m->strides);
    pyd_view_export_add(self, PYD_EXPORT_DLPACK); /* both dropped by the deleter */
    Py_INCREF(self);
    cap = PyCapsule_New(&m->mt, "dltensor", pyd_dl_capsule_destructor);
    if (!cap) m->mt.deleter(&m->mt);
  }
  return cap;
}

static PyObject *pyd_view_repr(pyd_view_t *self) {
  const char *st = self->state == PYD_VIEW_NEW      ? "not entered"
                   : self->state == PYD_VIEW_LOCKED ? "locked"
                   : self->held                     ? "block ended, held by its exports"
                                                    : "released";
  char text[128];
  snprintf(text, sizeof text, "<dmem.View of handle 0x%llx, %s>", (unsigned long long)self->h, st);
  return PyUnicode_FromString(text);
}

static PyObject *pyd_view_get_exports(pyd_view_t *self, void *c) {
  return Py_BuildValue("{s:n,s:n,s:n}", "buffer", self->exports[PYD_EXPORT_BUFFER],
                       "array_interface", self->exports[PYD_EXPORT_IFACE], "dlpack",
                       self->exports[PYD_EXPORT_DLPACK]);
}

static PyMethodDef pyd_view_methods[] = {
    {"__enter__", (PyCFunction)pyd_view_enter, METH_NOARGS, "Lock the buffer."},
    {"__exit__", (PyCFunction)pyd_view_exit, METH_VARARGS,
     "End the block: synchronise the stream (CUDA) and unlock, unless exports still hold\n"
     "the buffer (then the last of them unlocks when it is collected)."},
    {"__dlpack__", (PyCFunction)(void (*)(void))pyd_view_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None)\n\n"
     "DLPack capsule of a 1-D uint8 tensor over the locked bytes ('dltensor', or\n"
     "'dltensor_versioned' when max_version >= (1, 0)). The capsule, and the tensor a consumer\n"
     "makes from it, keep the buffer locked until its DLPack deleter runs."},
    {"__dlpack_device__", (PyCFunction)pyd_view_dlpack_device, METH_NOARGS,
     "(kDLCUDA=2, device) under CUDA, (kDLCPU=1, 0) under the host backend."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pyd_view_getset[] = {
    {"ptr", (getter)pyd_view_get_ptr, NULL, "device address (int); NotLockedError outside", NULL},
    {"size", (getter)pyd_view_get_size, NULL, "size in bytes; NotLockedError outside", NULL},
    {"locked", (getter)pyd_view_get_locked, NULL, "True inside the with block", NULL},
    {"buffer", (getter)pyd_view_get_buffer, NULL, "the Buffer", NULL},
    {"stream", (getter)pyd_view_get_stream, NULL, "the lock stream as an int, or None", NULL},
    {"exports", (getter)pyd_view_get_exports, NULL,
     "live exports by kind: {'buffer': n, 'array_interface': 0 or 1, 'dlpack': n}", NULL},
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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A locked view of a Buffer (from Buffer.lock); its address is handed out only\n"
              "inside its with block. What it hands out (buffer protocol, array interfaces,\n"
              "DLPack) keeps the buffer locked for as long as it lives.",
    .tp_traverse = (traverseproc)pyd_view_traverse,
    .tp_as_buffer = &pyd_view_as_buffer,
    .tp_methods = pyd_view_methods,
    .tp_getset = pyd_view_getset,
};

int pyd_view_type_ready(void) { return PyType_Ready(&pyd_view_type); }
