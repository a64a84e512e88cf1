/*
 * pybridge/py_stream.c - dmem.Stream (a stream of a runtime, from
 * Runtime.stream()) and the conversion of every stream argument the module
 * accepts: None, a dmem.Stream, and under CUDA an int cudaStream_t or a
 * CuPy, PyTorch, Numba or __cuda_stream__ stream object.
 *
 * A Stream holds a strong reference to its Runtime. It counts the lock views
 * that hold their lock on it (py_view.c: the block, then any live export) so
 * that close() refuses while one does.
 */
#include "pydmem.h"

/* ---- the Stream type ------------------------------------------------------- */

PyObject *pyd_stream_new(pyd_runtime_t *rt) {
  pyd_stream_t *so = PyObject_New(pyd_stream_t, &pyd_stream_type);
  if (!so) return NULL;
  so->rt = NULL;
  so->s = NULL;
  so->views = 0;
  pyd_ctx_t ctx;
  dmem_stream_t s = NULL;
  pyd_enter(&ctx, rt, 1);
  dmem_status_t st = dmem_stream_create(rt->rt, &s);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) {
    Py_DECREF(so);
    return NULL;
  }
  Py_INCREF(rt);
  so->rt = rt;
  so->s = s;
  return (PyObject *)so;
}

static int pyd_stream_check(pyd_stream_t *self) {
  if (!self->s || !self->rt) {
    PyErr_SetString(PyExc_ValueError, "stream is closed");
    return -1;
  }
  return pyd_runtime_check(self->rt);
}

static PyObject *pyd_stream_synchronize(pyd_stream_t *self, PyObject *unused) {
  if (pyd_stream_check(self) < 0) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st = dmem_stream_synchronize(self->rt->rt, self->s);
  pyd_leave(&ctx);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *pyd_stream_close(pyd_stream_t *self, PyObject *unused) {
  if (!self->s) Py_RETURN_NONE;
  if (!self->rt->rt) { /* the runtime destroyed it */
    self->s = NULL;
    Py_RETURN_NONE;
  }
  if (pyd_runtime_check(self->rt) < 0) return NULL;
  if (self->views > 0)
    return pyd_raise(DMEM_ERR_BUSY, "stream has open lock views (or live exports of them)");
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self->rt, 1);
  dmem_status_t st = dmem_stream_destroy(self->rt->rt, self->s);
  pyd_leave(&ctx);
  if (st == DMEM_OK) self->s = NULL;
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

static void pyd_stream_dealloc(pyd_stream_t *self) {
  if (self->rt) {
    if (self->s && self->rt->rt && !self->rt->closing) {
      pyd_ctx_t ctx;
      pyd_enter(&ctx, self->rt, 0);
      dmem_status_t st = dmem_stream_destroy(self->rt->rt, self->s);
      if (st == DMEM_ERR_BUSY) { /* launch_async without a sync: finish it */
        dmem_sync_and_unlock(self->rt->rt, self->s);
        dmem_stream_destroy(self->rt->rt, self->s);
      }
      pyd_leave(&ctx);
    }
    Py_DECREF(self->rt);
  }
  PyObject_Free(self);
}

static PyObject *pyd_stream_int(pyd_stream_t *self) {
  if (!self->s) {
    PyErr_SetString(PyExc_ValueError, "stream is closed");
    return NULL;
  }
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->s);
}

static PyObject *pyd_stream_enter(pyd_stream_t *self, PyObject *unused) {
  if (pyd_stream_check(self) < 0) return NULL;
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *pyd_stream_exit(pyd_stream_t *self, PyObject *args) {
  PyObject *et, *ev, *tb;
  if (!PyArg_UnpackTuple(args, "__exit__", 3, 3, &et, &ev, &tb)) return NULL;
  PyObject *r = pyd_stream_close(self, NULL);
  if (!r) return NULL;
  Py_DECREF(r);
  Py_RETURN_FALSE;
}

static PyObject *pyd_stream_cuda_stream(pyd_stream_t *self, PyObject *unused) {
  if (!self->s) {
    PyErr_SetString(PyExc_ValueError, "stream is closed");
    return NULL;
  }
  return Py_BuildValue("(iK)", 0, (unsigned long long)(uintptr_t)self->s);
}

static PyObject *pyd_stream_get_closed(pyd_stream_t *self, void *closure) {
  return PyBool_FromLong(!self->s || !self->rt || !self->rt->rt);
}

static PyObject *pyd_stream_repr(pyd_stream_t *self) {
  if (!self->s) return PyUnicode_FromString("<dmem.Stream closed>");
  return PyUnicode_FromFormat("<dmem.Stream %p>", self->s);
}

static PyMethodDef pyd_stream_methods[] = {
    {"synchronize", (PyCFunction)pyd_stream_synchronize, METH_NOARGS,
     "Block until the work queued on this stream has completed."},
    {"close", (PyCFunction)pyd_stream_close, METH_NOARGS,
     "Destroy the stream (BusyError while buffers are registered on it or views use it)."},
    {"__enter__", (PyCFunction)pyd_stream_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)pyd_stream_exit, METH_VARARGS, NULL},
    {"__cuda_stream__", (PyCFunction)pyd_stream_cuda_stream, METH_NOARGS,
     "CUDA stream protocol: (0, address)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef pyd_stream_getset[] = {
    {"closed", (getter)pyd_stream_get_closed, NULL, "True after close()", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyNumberMethods pyd_stream_as_number = {
    .nb_int = (unaryfunc)pyd_stream_int,
    .nb_index = (unaryfunc)pyd_stream_int,
};

PyTypeObject pyd_stream_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem.Stream",
    .tp_basicsize = sizeof(pyd_stream_t),
    .tp_dealloc = (destructor)pyd_stream_dealloc,
    .tp_repr = (reprfunc)pyd_stream_repr,
    .tp_as_number = &pyd_stream_as_number,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A stream of a dmem runtime (from Runtime.stream()). int(stream) is its address\n"
              "(the cudaStream_t under CUDA).",
    .tp_methods = pyd_stream_methods,
    .tp_getset = pyd_stream_getset,
};

/* ---- stream arguments -------------------------------------------------------- */

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
  if (PyIndex_Check(o) && !PyBool_Check(o)) return pyd_address_arg(o, "stream address", out);
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
    rc = pyd_address_arg(v, "stream address", out);
  }
  Py_DECREF(v);
  if (rc == 0) {
    Py_INCREF(o); /* keep the foreign stream object alive as long as we use it */
    *keep = o;
  }
  return rc;
}
