/*
 * pybridge/py_launch.c - the entry points of dmem.Runtime that run Python code
 * with buffers locked (lock_and_launch, launch_async) and the calls that end
 * what launch_async started (sync_and_unlock, stream_release) or wait on a
 * stream (synchronize). py_runtime.c puts them in the Runtime's method table.
 *
 * The launch function runs on the thread of the call, with the GIL taken
 * again by the trampoline; an exception it raises is kept and re-raised
 * unchanged by the call (the C launch function returns DMEM_ERR_CALLBACK).
 */
#include "pydmem.h"

/* ---- launches ---------------------------------------------------------------- */

typedef struct pyd_launch {
  PyObject *fn;
  PyObject *result; /* fn's return value */
  PyObject *exc;    /* exception raised by fn */
} pyd_launch_t;

static dmem_status_t pyd_launch_trampoline(void *user, dmem_stream_t stream,
                                           void *const *ptrs, size_t n) {
  pyd_launch_t *L = user;
  if (pyd_finalizing()) return DMEM_ERR_CALLBACK;
  PyGILState_STATE g = PyGILState_Ensure();
  dmem_status_t st = DMEM_ERR_CALLBACK;
  PyObject *lst = PyList_New((Py_ssize_t)n), *s = NULL, *r = NULL;
  if (!lst) goto fail;
  for (size_t i = 0; i < n; i++) {
    PyObject *p = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ptrs[i]);
    if (!p) goto fail;
    PyList_SET_ITEM(lst, (Py_ssize_t)i, p);
  }
  if (stream) {
    s = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)stream);
    if (!s) goto fail;
  } else {
    s = Py_None;
    Py_INCREF(s);
  }
  r = PyObject_CallFunctionObjArgs(L->fn, s, lst, NULL);
  if (!r) goto fail;
  Py_XSETREF(L->result, r);
  st = DMEM_OK;
  goto done;
fail:
  if (!L->exc) L->exc = pyd_fetch_exception();
  else PyErr_WriteUnraisable(L->fn);
done:
  Py_XDECREF(lst);
  Py_XDECREF(s);
  PyGILState_Release(g);
  return st;
}

/* Handles of a sequence of Buffers; *seq_out keeps them alive. */
static int pyd_handles_arg(pyd_runtime_t *rt, PyObject *buffers, PyObject **seq_out,
                           dmem_handle_t **hs_out, size_t *n_out) {
  if (PyUnicode_Check(buffers) || PyBytes_Check(buffers) ||
      PyObject_TypeCheck(buffers, &pyd_buffer_type)) {
    PyErr_SetString(PyExc_TypeError, "buffers must be a sequence of dmem.Buffer");
    return -1;
  }
  PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence of dmem.Buffer");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  dmem_handle_t *hs = PyMem_Malloc(sizeof *hs * (size_t)(n ? n : 1));
  if (!hs) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    if (pyd_handle_arg(rt, PySequence_Fast_GET_ITEM(seq, i), 0, &hs[i]) < 0) {
      PyMem_Free(hs);
      Py_DECREF(seq);
      return -1;
    }
  }
  *seq_out = seq;
  *hs_out = hs;
  *n_out = (size_t)n;
  return 0;
}

static PyObject *pyd_launch_finish(pyd_ctx_t *ctx, pyd_launch_t *L, dmem_status_t st) {
  if (L->exc) {
    /* fn raised: re-raise the original exception. */
    if (ctx->exc) {
      /* a controller callback raised too: attach it as context */
      PyObject *old = ctx->exc;
      ctx->exc = NULL;
      if (PyExceptionInstance_Check(L->exc)) PyException_SetContext(L->exc, old);
      else Py_DECREF(old);
    }
    PyObject *e = L->exc;
    L->exc = NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(e), e);
    Py_DECREF(e);
    Py_CLEAR(L->result);
    return NULL;
  }
  if (pyd_finish(ctx, st) < 0) {
    Py_CLEAR(L->result);
    return NULL;
  }
  if (!L->result) Py_RETURN_NONE;
  return L->result;
}

PyObject *pyd_runtime_lock_and_launch(pyd_runtime_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"buffers", "fn", NULL};
  PyObject *buffers, *fn;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:lock_and_launch", kwlist, &buffers, &fn))
    return NULL;
  if (!PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "fn must be callable, not %.100s", Py_TYPE(fn)->tp_name);
    return NULL;
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  PyObject *seq;
  dmem_handle_t *hs;
  size_t n;
  if (pyd_handles_arg(self, buffers, &seq, &hs, &n) < 0) return NULL;
  pyd_launch_t L = {fn, NULL, NULL};
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_lock_and_launch(self->rt, hs, n, pyd_launch_trampoline, &L);
  pyd_leave(&ctx);
  PyMem_Free(hs);
  Py_DECREF(seq);
  return pyd_launch_finish(&ctx, &L, st);
}

PyObject *pyd_runtime_launch_async(pyd_runtime_t *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"stream", "buffers", "fn", NULL};
  PyObject *stream_o, *buffers, *fn;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:launch_async", kwlist, &stream_o, &buffers,
                                   &fn))
    return NULL;
  if (!PyCallable_Check(fn)) {
    PyErr_Format(PyExc_TypeError, "fn must be callable, not %.100s", Py_TYPE(fn)->tp_name);
    return NULL;
  }
  if (pyd_runtime_check(self) < 0) return NULL;
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(self, stream_o, &s, &keep) < 0) return NULL;
  PyObject *seq;
  dmem_handle_t *hs;
  size_t n;
  if (pyd_handles_arg(self, buffers, &seq, &hs, &n) < 0) {
    Py_XDECREF(keep);
    return NULL;
  }
  pyd_launch_t L = {fn, NULL, NULL};
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_launch_async(self->rt, s, hs, n, pyd_launch_trampoline, &L);
  pyd_leave(&ctx);
  PyMem_Free(hs);
  Py_DECREF(seq);
  Py_XDECREF(keep);
  return pyd_launch_finish(&ctx, &L, st);
}

/* ---- stream-ordered calls ---------------------------------------------------- */

typedef dmem_status_t (*pyd_stream_op_t)(dmem_runtime_t *, dmem_stream_t);

static PyObject *pyd_runtime_stream_op(pyd_runtime_t *self, PyObject *stream_o,
                                       pyd_stream_op_t op) {
  if (pyd_runtime_check(self) < 0) return NULL;
  dmem_stream_t s;
  PyObject *keep;
  if (pyd_stream_arg(self, stream_o, &s, &keep) < 0) return NULL;
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = op(self->rt, s);
  pyd_leave(&ctx);
  Py_XDECREF(keep);
  if (pyd_finish(&ctx, st) < 0) return NULL;
  Py_RETURN_NONE;
}

PyObject *pyd_runtime_sync_and_unlock(pyd_runtime_t *self, PyObject *const *args,
                                      Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "sync_and_unlock() takes at most 1 argument (stream)");
    return NULL;
  }
  return pyd_runtime_stream_op(self, nargs ? args[0] : Py_None, dmem_sync_and_unlock);
}

PyObject *pyd_runtime_stream_release(pyd_runtime_t *self, PyObject *const *args,
                                     Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "stream_release() takes at most 1 argument (stream)");
    return NULL;
  }
  return pyd_runtime_stream_op(self, nargs ? args[0] : Py_None, dmem_stream_release);
}

PyObject *pyd_runtime_synchronize(pyd_runtime_t *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs > 1) {
    PyErr_SetString(PyExc_TypeError, "synchronize() takes at most 1 argument (stream)");
    return NULL;
  }
  return pyd_runtime_stream_op(self, nargs ? args[0] : Py_None, dmem_stream_synchronize);
}
