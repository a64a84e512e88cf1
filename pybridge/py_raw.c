/*
 * pybridge/py_raw.c - raw device memory from Python: dmem.DeviceMemory, the
 * owner of one dmem_device_malloc (or _dedicated) block (what the Numba and
 * CuPy hooks hand out), and the Runtime methods device_malloc, memory_info,
 * ipc_handle and adopt.
 *
 * Runtime.adopt(mem) makes mem's block a spillable Buffer in place
 * (dmem_device_adopt). The buffer comes back locked once, and that lock is
 * mem's: the arrays that point at the block keep mem alive, so the buffer
 * cannot move while any of them lives. When mem is freed or collected it
 * unlocks the buffer (once) instead of freeing the block, after waiting
 * for the work queued on its stream (a lock may only go once the device
 * work that uses its address is done; the arrays worked on that stream).
 *
 * A DeviceMemory holds a strong reference to its Runtime, so the runtime
 * outlives it; freeing (free() or collection) after Runtime.close() does
 * nothing (the block went with the runtime), never a crash. The default
 * runtimes are never closed.
 *
 * GIL: raw allocations and frees are the hot path of allocator hooks. When
 * the runtime has never had a Python controller, no callback of the runtime
 * can need the GIL, so the calls keep it (no hand-over to another Python
 * thread in the middle of an allocation); otherwise they release it as every
 * other call that may spill does (pyd_enter / pyd_leave).
 */
#include "pydmem.h"

/* ---- out of memory: how the limit is used --------------------------------------- */

/* "1.50 GiB", "512.00 KiB", "12 B" */
static const char *pyd_fmt_size(size_t b, char *out, size_t n) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  if (u == 0) snprintf(out, n, "%zu B", b);
  else snprintf(out, n, "%.2f %s", v, unit[u]);
  return out;
}

void pyd_oom_detail(dmem_runtime_t *rt, size_t size, const char *why, char *out, size_t n) {
  dmem_stats_t s;
  if (dmem_stats(rt, &s) != DMEM_OK) {
    snprintf(out, n, "%s", why ? why : "");
    return;
  }
  size_t fixed = s.raw_used + s.device_locked + s.device_pinned;
  size_t spillable = s.device_used > fixed ? s.device_used - fixed : 0;
  size_t free_b = s.device_limit > s.device_used ? s.device_limit - s.device_used : 0;
  char a[7][32];
  snprintf(out, n,
           "%s%sdmem could not make room for %zu bytes (%s) under its device limit of %s: "
           "raw %s (Numba, CuPy and PyTorch arrays: never spilled), locked %s, pinned %s, "
           "spillable %s, free %s",
           why ? why : "", why && *why ? "; " : "", size, pyd_fmt_size(size, a[0], 32),
           pyd_fmt_size(s.device_limit, a[1], 32), pyd_fmt_size(s.raw_used, a[2], 32),
           pyd_fmt_size(s.device_locked, a[3], 32), pyd_fmt_size(s.device_pinned, a[4], 32),
           pyd_fmt_size(spillable, a[5], 32), pyd_fmt_size(free_b, a[6], 32));
}

/* The exception of a failed raw allocation: for DMEM_ERR_OUT_OF_MEMORY the
 * detail says how the limit is used. */
static PyObject *pyd_devmem_raise(pyd_runtime_t *rt, size_t size, dmem_status_t st) {
  if (st != DMEM_ERR_OUT_OF_MEMORY) return pyd_raise(st, NULL);
  char why[512], detail[1024];
  snprintf(why, sizeof why, "%s", dmem_last_error_detail());
  pyd_oom_detail(rt->rt, size, why, detail, sizeof detail);
  return pyd_raise(st, detail);
}

/* ---- alloc and free ------------------------------------------------------------ */

PyObject *pyd_devmem_alloc(pyd_runtime_t *rt, size_t size, dmem_stream_t s, PyObject *keep,
                           int dedicated) {
  if (pyd_runtime_check(rt) < 0) return NULL;
  void *p = NULL;
  dmem_status_t st;
  if (!rt->bindings) {
    st = dedicated ? dmem_device_malloc_dedicated(rt->rt, size, s, &p)
                   : dmem_device_malloc(rt->rt, size, s, &p);
    if (st != DMEM_OK) return pyd_devmem_raise(rt, size, st);
  } else {
    pyd_ctx_t ctx;
    pyd_enter(&ctx, rt, 1);
    st = dedicated ? dmem_device_malloc_dedicated(rt->rt, size, s, &p)
                   : dmem_device_malloc(rt->rt, size, s, &p);
    pyd_leave(&ctx);
    if (!ctx.exc && st == DMEM_ERR_OUT_OF_MEMORY) return pyd_devmem_raise(rt, size, st);
    if (pyd_finish(&ctx, st) < 0) {
      if (st == DMEM_OK) dmem_device_free(rt->rt, p, s);
      return NULL;
    }
  }
  pyd_devmem_t *m = PyObject_New(pyd_devmem_t, &pyd_devmem_type);
  if (!m) {
    dmem_device_free(rt->rt, p, s);
    return NULL;
  }
  Py_INCREF(rt);
  m->rt = rt;
  m->ptr = p;
  m->size = size;
  m->stream = s;
  Py_XINCREF(keep);
  m->stream_keep = keep;
  m->owner_stream = NULL;
  m->h = 0;
  m->adopted = 0;
  return (PyObject *)m;
}

/* The stream the block is used and freed on now. */
static dmem_stream_t pyd_devmem_stream(pyd_devmem_t *m) {
  if (m->owner_stream && !((pyd_stream_t *)m->owner_stream)->s)
    return NULL; /* its dmem.Stream was closed (destroy waited for its work) */
  return m->stream;
}

/* An adopted block: drop mem's lock on its buffer once the work queued on
 * its stream is done (a buffer freed meanwhile is reclaimed by this
 * unlock). The unlock happens even if the wait failed: a broken device
 * must not keep the buffer locked for good. */
static dmem_status_t pyd_devmem_unlock(pyd_devmem_t *m, dmem_stream_t s) {
  pyd_runtime_t *rt = m->rt;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, rt, 0);
  dmem_status_t st = dmem_stream_synchronize(rt->rt, s);
  dmem_status_t st2 = dmem_buffer_unlock(rt->rt, m->h);
  if (m->stream_keep) dmem_stream_forget(rt->rt, m->stream);
  pyd_leave(&ctx);
  Py_XDECREF(ctx.exc); /* nobody to raise it to */
  return st != DMEM_OK ? st : st2;
}

/* Free the block (or, adopted, unlock its buffer) once (idempotent).
 * Returns the status of the free. */
static dmem_status_t pyd_devmem_release(pyd_devmem_t *m) {
  void *p = m->ptr;
  if (!p) return DMEM_OK;
  m->ptr = NULL;
  pyd_runtime_t *rt = m->rt;
  /* closing: destroy may be running without the GIL; the block goes with it */
  if (!rt->rt || rt->closing) return DMEM_OK;
  dmem_stream_t s = pyd_devmem_stream(m);
  if (m->adopted) return pyd_devmem_unlock(m, s);
  dmem_status_t st;
  if (!rt->bindings) {
    st = dmem_device_free(rt->rt, p, s);
    /* A foreign stream may be destroyed once we drop it: the pool must not
     * name it as a block's last user any more. */
    if (m->stream_keep) dmem_stream_forget(rt->rt, m->stream);
  } else {
    pyd_ctx_t ctx;
    pyd_enter(&ctx, rt, 0);
    st = dmem_device_free(rt->rt, p, s);
    if (m->stream_keep) dmem_stream_forget(rt->rt, m->stream);
    pyd_leave(&ctx);
    Py_XDECREF(ctx.exc); /* free delivers no callback; nothing to raise */
  }
  return st;
}

static PyObject *pyd_devmem_free(pyd_devmem_t *self, PyObject *unused) {
  dmem_status_t st = pyd_devmem_release(self);
  Py_CLEAR(self->stream_keep);
  Py_CLEAR(self->owner_stream);
  if (st != DMEM_OK) return pyd_raise(st, NULL);
  Py_RETURN_NONE;
}

static void pyd_devmem_dealloc(pyd_devmem_t *self) {
  dmem_status_t st = self->ptr ? pyd_devmem_release(self) : DMEM_OK;
  if (st != DMEM_OK) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    pyd_raise(st, NULL);
    PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(et, ev, etb);
  }
  Py_XDECREF(self->stream_keep);
  Py_XDECREF(self->owner_stream);
  Py_DECREF(self->rt);
  PyObject_Free(self);
}

/* ---- the type ------------------------------------------------------------------ */

static PyObject *pyd_devmem_get_ptr(pyd_devmem_t *self, void *closure) {
  return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *pyd_devmem_get_size(pyd_devmem_t *self, void *closure) {
  return PyLong_FromSize_t(self->size);
}

static PyObject *pyd_devmem_get_stream(pyd_devmem_t *self, void *closure) {
  return PyLong_FromVoidPtr(self->stream);
}

static PyObject *pyd_devmem_get_freed(pyd_devmem_t *self, void *closure) {
  return PyBool_FromLong(self->ptr == NULL || !self->rt->rt);
}

static PyObject *pyd_devmem_get_adopted(pyd_devmem_t *self, void *closure) {
  return PyBool_FromLong(self->adopted);
}

static PyObject *pyd_devmem_get_runtime(pyd_devmem_t *self, void *closure) {
  Py_INCREF(self->rt);
  return (PyObject *)self->rt;
}

static PyObject *pyd_devmem_int(pyd_devmem_t *self) {
  return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *pyd_devmem_repr(pyd_devmem_t *self) {
  if (!self->ptr) return PyUnicode_FromFormat("<dmem.DeviceMemory freed, %zu bytes>", self->size);
  return PyUnicode_FromFormat("<dmem.DeviceMemory %p, %zu bytes%s>", self->ptr, self->size,
                              self->adopted ? ", adopted" : "");
}

static PyMethodDef pyd_devmem_methods[] = {
    {"free", (PyCFunction)pyd_devmem_free, METH_NOARGS,
     "free(): give the block back now, in the order of its stream (again: no-op).\n"
     "Adopted (Runtime.adopt): wait for the work on its stream, then unlock the buffer\n"
     "it became instead (the Buffer frees the memory)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pyd_devmem_getset[] = {
    {"ptr", (getter)pyd_devmem_get_ptr, NULL, "device address (0 once freed)", NULL},
    {"size", (getter)pyd_devmem_get_size, NULL, "bytes asked for", NULL},
    {"stream", (getter)pyd_devmem_get_stream, NULL,
     "the stream it was allocated for and is freed on (0: the default stream)", NULL},
    {"freed", (getter)pyd_devmem_get_freed, NULL,
     "True once freed (or once its runtime was closed)", NULL},
    {"runtime", (getter)pyd_devmem_get_runtime, NULL, "the Runtime it came from", NULL},
    {"adopted", (getter)pyd_devmem_get_adopted, NULL,
     "True once Runtime.adopt made the block a Buffer (this object then holds one lock\n"
     "on it until it is freed or collected)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyNumberMethods pyd_devmem_as_number = {
    .nb_int = (unaryfunc)pyd_devmem_int,
    .nb_index = (unaryfunc)pyd_devmem_int,
};

PyTypeObject pyd_devmem_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem.DeviceMemory",
    .tp_basicsize = sizeof(pyd_devmem_t),
    .tp_dealloc = (destructor)pyd_devmem_dealloc,
    .tp_repr = (reprfunc)pyd_devmem_repr,
    .tp_as_number = &pyd_devmem_as_number,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Raw device memory of a runtime (Runtime.device_malloc): never spilled, counted\n"
              "against the device limit. Freed in its stream's order when collected or by\n"
              "free(); int(m) is its address. It keeps its Runtime alive; after\n"
              "Runtime.close() the address is invalid and free() does nothing. Runtime.adopt\n"
              "makes the block a Buffer that this object keeps locked while it lives.",
    .tp_methods = pyd_devmem_methods,
    .tp_getset = pyd_devmem_getset,
};

/* ---- Runtime methods ------------------------------------------------------------ */

PyObject *pyd_runtime_device_malloc(pyd_runtime_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"nbytes", "stream", "dedicated", NULL};
  PyObject *size_o, *stream_o = Py_None;
  int dedicated = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O$p:device_malloc", kwlist, &size_o, &stream_o,
                                   &dedicated))
    return NULL;
  if (!PyLong_Check(size_o) || PyBool_Check(size_o)) {
    PyErr_Format(PyExc_TypeError, "nbytes must be an int, not %.100s", Py_TYPE(size_o)->tp_name);
    return NULL;
  }
  size_t size = PyLong_AsSize_t(size_o);
  if (size == (size_t)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "nbytes must be a non-negative int that fits size_t");
    return NULL;
  }
  if (size == 0) {
    PyErr_SetString(PyExc_ValueError, "nbytes must be positive");
    return NULL;
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  dmem_stream_t s = NULL;
  PyObject *keep = NULL;
  if (pyd_stream_arg(self, stream_o, &s, &keep) < 0) return NULL;
  /* A dmem.Stream forgets itself when destroyed: it is only kept alive (in
   * `owner_stream`), not forgotten at each free. */
  int own = keep && Py_IS_TYPE(keep, &pyd_stream_type);
  PyObject *r = pyd_devmem_alloc(self, size, s, own ? NULL : keep, dedicated);
  if (r && own) {
    ((pyd_devmem_t *)r)->owner_stream = keep;
    keep = NULL;
  }
  Py_XDECREF(keep);
  return r;
}

PyObject *pyd_runtime_oom_message(pyd_runtime_t *self, PyObject *arg) {
  if (!PyLong_Check(arg) || PyBool_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "nbytes must be an int, not %.100s", Py_TYPE(arg)->tp_name);
    return NULL;
  }
  size_t size = PyLong_AsSize_t(arg);
  if (size == (size_t)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "nbytes must be a non-negative int that fits size_t");
    return NULL;
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  char detail[1024];
  pyd_oom_detail(self->rt, size, NULL, detail, sizeof detail);
  return PyUnicode_FromString(detail);
}

PyObject *pyd_runtime_memory_info(pyd_runtime_t *self, PyObject *unused) {
  if (pyd_runtime_check(self) < 0) return NULL;
  size_t free_b = 0, total_b = 0;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_device_memory_info(self->rt, &free_b, &total_b);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  return Py_BuildValue("(nn)", (Py_ssize_t)free_b, (Py_ssize_t)total_b);
}

PyObject *pyd_runtime_ipc_handle(pyd_runtime_t *self, PyObject *ptr_o) {
  void *p = NULL;
  if (Py_IS_TYPE(ptr_o, &pyd_devmem_type)) {
    p = ((pyd_devmem_t *)ptr_o)->ptr;
    if (!p) return pyd_raise(DMEM_ERR_INVALID_ARGUMENT, "ipc_handle: the DeviceMemory was freed");
  } else {
    if (!PyIndex_Check(ptr_o) || PyBool_Check(ptr_o)) {
      PyErr_Format(PyExc_TypeError, "ptr must be an int or a DeviceMemory, not %.100s",
                   Py_TYPE(ptr_o)->tp_name);
      return NULL;
    }
    if (pyd_address_arg(ptr_o, "ptr", &p) < 0) return NULL;
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  unsigned char handle[DMEM_IPC_HANDLE_SIZE];
  size_t offset = 0;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_device_ipc_handle(self->rt, p, handle, &offset);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  return Py_BuildValue("(y#n)", (const char *)handle, (Py_ssize_t)sizeof handle,
                       (Py_ssize_t)offset);
}

PyObject *pyd_runtime_adopt(pyd_runtime_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"mem", "stream", NULL};
  PyObject *mem_o, *stream_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:adopt", kwlist, &mem_o, &stream_o))
    return NULL;
  if (!Py_IS_TYPE(mem_o, &pyd_devmem_type)) {
    PyErr_Format(PyExc_TypeError, "mem must be a dmem.DeviceMemory, not %.100s",
                 Py_TYPE(mem_o)->tp_name);
    return NULL;
  }
  pyd_devmem_t *m = (pyd_devmem_t *)mem_o;
  if (pyd_runtime_check(self) < 0) return NULL;
  if (m->rt != self)
    return pyd_raise(DMEM_ERR_INVALID_ARGUMENT, "adopt: the DeviceMemory is another runtime's");
  if (m->adopted) return pyd_raise(DMEM_ERR_INVALID_ARGUMENT, "adopt: adopted already");
  if (!m->ptr) return pyd_raise(DMEM_ERR_INVALID_ARGUMENT, "adopt: the DeviceMemory was freed");
  dmem_stream_t s = NULL;
  PyObject *keep = NULL;
  if (stream_o == Py_None) s = pyd_devmem_stream(m);
  else if (pyd_stream_arg(self, stream_o, &s, &keep) < 0) return NULL;
  /* While the GIL is released the block is neither m's to free nor yet a
   * buffer: m reads as freed (a free() meanwhile does nothing) until the
   * call has decided. */
  void *p = m->ptr;
  m->ptr = NULL;
  dmem_handle_t h = 0;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_device_adopt(self->rt, p, s, &h);
  pyd_leave(&ctx);
  Py_XDECREF(keep);
  m->ptr = p;
  if (st == DMEM_OK) {
    m->adopted = 1;
    m->h = h;
  }
  PyObject *buf = NULL;
  if (pyd_finish(&ctx, st) == 0) buf = pyd_buffer_new(self, h, m->size, 1);
  if (!buf && st == DMEM_OK) {
    /* a controller callback raised, or no memory for the Buffer: nobody
     * owns the handle, so free it now (reclaimed at m's unlock) */
    pyd_enter(&ctx, self, 0);
    dmem_buffer_free(self->rt, h);
    pyd_leave(&ctx);
    Py_XDECREF(ctx.exc);
  }
  return buf;
}
