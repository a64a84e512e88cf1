/*
 * pybridge/py_controller.c - a Python object as the runtime's controller
 * (dmem_controller_set): C trampolines that take the GIL and call its
 * methods.
 *
 *   on_alloc(buf), on_free(handle), on_spill(buf, tier),
 *   on_unspill(buf, tier), on_pressure(nbytes)
 *                                notifications (from dmem_event_t); on_free
 *                                also for each buffer alive at close;
 *                                on_unspill's tier is where the bytes came
 *                                from (an override taking (self, buf) only
 *                                is called without it)
 *   select_victims(nbytes)       None (default policy) or an iterable of
 *                                Buffers / int handles
 *   store(buf, data)             data: read-only memoryview, valid during the
 *                                call only (copy it, e.g. bytes(data)); what
 *                                it returns is dropped (returning data is
 *                                fine)
 *   retrieve(buf, out)           out: writable memoryview to fill
 *
 * Only the methods a subclass overrides are installed (a controller that
 * overrides no on_* method costs nothing per allocation). `buf` arguments are
 * Buffer wrappers that do not own the handle and compare equal to the owning
 * Buffer. An exception in a callback is stored for the Python call waiting on
 * this thread, which raises CallbackError from it; with no such call it goes
 * to sys.unraisablehook. A failing select_victims/store/retrieve returns
 * DMEM_ERR_CALLBACK to the runtime (the buffer stays where it was).
 */
#include "pydmem.h"

#include <string.h>

/* dmem.Controller, registered by the package (py_module.c's
 * _set_controller_base): a subclass overrides the methods it installs. */
PyObject *pyd_controller_base = NULL;

static const char *const pyd_cb_names[] = {"on_alloc",   "on_free",        "on_spill",
                                           "on_unspill", "on_pressure",    "select_victims",
                                           "store",      "retrieve"};
#define PYD_NCB (sizeof pyd_cb_names / sizeof pyd_cb_names[0])

/* Save and restore the error indicator around a callback: the thread may be
 * in the middle of raising (e.g. a Buffer collected during unwinding). */
typedef struct {
  PyGILState_STATE g;
  PyObject *et, *ev, *etb;
} pyd_gil_t;

static void pyd_gil_take(pyd_gil_t *s) {
  s->g = PyGILState_Ensure();
  PyErr_Fetch(&s->et, &s->ev, &s->etb);
}

static void pyd_gil_drop(pyd_gil_t *s) {
  PyErr_Restore(s->et, s->ev, s->etb);
  PyGILState_Release(s->g);
}

static void pyd_tramp_event(void *user, const dmem_event_t *ev) {
  pyd_binding_t *b = user;
  if (pyd_finalizing()) return;
  pyd_gil_t gs;
  pyd_gil_take(&gs);
  unsigned bit = 0;
  switch (ev->kind) {
    case DMEM_EVENT_ALLOC: bit = PYD_CB_ON_ALLOC; break;
    case DMEM_EVENT_FREE: bit = PYD_CB_ON_FREE; break;
    case DMEM_EVENT_SPILL: bit = PYD_CB_ON_SPILL; break;
    case DMEM_EVENT_UNSPILL: bit = PYD_CB_ON_UNSPILL; break;
    case DMEM_EVENT_PRESSURE: bit = PYD_CB_ON_PRESSURE; break;
  }
  PyObject *obj = b->obj;
  if (!obj || !(b->mask & bit) || (b->closing && ev->kind != DMEM_EVENT_FREE)) goto out;
  Py_INCREF(obj);
  PyObject *r = NULL, *buf = NULL;
  switch (ev->kind) {
    case DMEM_EVENT_ALLOC:
      buf = pyd_buffer_new(b->owner, ev->handle, ev->size, 0);
      if (buf) r = PyObject_CallMethod(obj, "on_alloc", "O", buf);
      break;
    case DMEM_EVENT_FREE:
      r = PyObject_CallMethod(obj, "on_free", "K", (unsigned long long)ev->handle);
      break;
    case DMEM_EVENT_SPILL:
      buf = pyd_buffer_new(b->owner, ev->handle, ev->size, 0);
      if (buf) r = PyObject_CallMethod(obj, "on_spill", "Os", buf, pyd_tier_name(ev->tier));
      break;
    case DMEM_EVENT_UNSPILL:
      buf = pyd_buffer_new(b->owner, ev->handle, ev->size, 0);
      if (buf && (b->mask & PYD_CB_UNSPILL_NO_TIER))
        r = PyObject_CallMethod(obj, "on_unspill", "O", buf);
      else if (buf)
        r = PyObject_CallMethod(obj, "on_unspill", "Os", buf, pyd_tier_name(ev->tier));
      break;
    case DMEM_EVENT_PRESSURE:
      r = PyObject_CallMethod(obj, "on_pressure", "n", (Py_ssize_t)ev->bytes_needed);
      break;
  }
  if (r) Py_DECREF(r);
  else pyd_callback_failed(obj);
  Py_XDECREF(buf);
  Py_DECREF(obj);
out:
  pyd_gil_drop(&gs);
}

static dmem_status_t pyd_tramp_select(void *user, size_t bytes_needed, dmem_handle_t *victims,
                                      size_t capacity, size_t *n_out) {
  pyd_binding_t *b = user;
  if (pyd_finalizing()) {
    *n_out = DMEM_VICTIMS_DEFAULT;
    return DMEM_OK;
  }
  pyd_gil_t gs;
  pyd_gil_take(&gs);
  dmem_status_t st = DMEM_OK;
  PyObject *obj = b->obj;
  if (!obj || b->closing) {
    *n_out = DMEM_VICTIMS_DEFAULT;
    goto out;
  }
  Py_INCREF(obj);
  PyObject *r = PyObject_CallMethod(obj, "select_victims", "n", (Py_ssize_t)bytes_needed);
  PyObject *it = NULL, *item = NULL;
  if (!r) goto fail;
  if (r == Py_None) {
    *n_out = DMEM_VICTIMS_DEFAULT;
    goto done;
  }
  it = PyObject_GetIter(r);
  if (!it) goto fail;
  size_t n = 0;
  while ((item = PyIter_Next(it))) {
    dmem_handle_t h;
    if (PyObject_TypeCheck(item, &pyd_buffer_type)) {
      pyd_buffer_t *vb = (pyd_buffer_t *)item;
      if (vb->rt != b->owner) {
        PyErr_SetString(PyExc_ValueError, "select_victims: buffer of another runtime");
        goto fail;
      }
      h = vb->h; /* a freed one is stale: the runtime skips it */
    } else if (pyd_handle_arg(b->owner, item, 1, &h) < 0) {
      goto fail;
    }
    if (n < capacity) victims[n++] = h;
    Py_CLEAR(item);
  }
  if (PyErr_Occurred()) goto fail;
  *n_out = n;
  goto done;
fail:
  Py_XDECREF(item);
  st = DMEM_ERR_CALLBACK;
  pyd_callback_failed(obj);
done:
  Py_XDECREF(it);
  Py_XDECREF(r);
  Py_DECREF(obj);
out:
  pyd_gil_drop(&gs);
  return st;
}

/* The exporter behind the memoryviews given to store/retrieve: it counts the
 * buffer exports still alive, so that a controller that kept a view (or an
 * array made from one) instead of copying is caught when the call returns. */
typedef struct {
  PyObject_HEAD
  void *ptr;
  Py_ssize_t len;
  int readonly;
  Py_ssize_t exports;
} pyd_span_t;

static int pyd_span_getbuffer(pyd_span_t *self, Py_buffer *view, int flags) {
  if (!self->ptr) {
    PyErr_SetString(PyExc_BufferError, "dmem: this memory was valid during the callback only");
    return -1;
  }
  if (PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->len, self->readonly, flags) < 0)
    return -1;
  self->exports++;
  return 0;
}

static void pyd_span_releasebuffer(pyd_span_t *self, Py_buffer *view) { self->exports--; }

static PyBufferProcs pyd_span_as_buffer = {
    .bf_getbuffer = (getbufferproc)pyd_span_getbuffer,
    .bf_releasebuffer = (releasebufferproc)pyd_span_releasebuffer,
};

static PyTypeObject pyd_span_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem._CallbackMemory",
    .tp_basicsize = sizeof(pyd_span_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_buffer = &pyd_span_as_buffer,
    .tp_doc = "memory lent to a controller callback for the duration of the call",
};

int pyd_controller_types_ready(void) { return PyType_Ready(&pyd_span_type); }

static PyObject *pyd_span_memoryview(void *ptr, size_t len, int readonly, pyd_span_t **span_out) {
  pyd_span_t *sp = PyObject_New(pyd_span_t, &pyd_span_type);
  if (!sp) return NULL;
  sp->ptr = ptr;
  sp->len = (Py_ssize_t)len;
  sp->readonly = readonly;
  sp->exports = 0;
  PyObject *mv = PyMemoryView_FromObject((PyObject *)sp);
  if (!mv) {
    Py_DECREF(sp);
    return NULL;
  }
  *span_out = sp;
  return mv;
}

/* store/retrieve: call method(buf, memoryview), then release the memoryview
 * so that a controller that kept it (instead of copying) cannot reach the
 * runtime's memory after the call. */
static dmem_status_t pyd_tramp_move(pyd_binding_t *b, const char *method, dmem_handle_t h,
                                    void *data, size_t size, int readonly) {
  if (pyd_finalizing()) return DMEM_ERR_CALLBACK;
  pyd_gil_t gs;
  pyd_gil_take(&gs);
  dmem_status_t st = DMEM_ERR_CALLBACK;
  PyObject *obj = b->obj;
  if (!obj || b->closing) goto out;
  Py_INCREF(obj);
  PyObject *buf = pyd_buffer_new(b->owner, h, size, 0);
  pyd_span_t *sp = NULL;
  PyObject *mv = buf ? pyd_span_memoryview(data, size, readonly, &sp) : NULL;
  PyObject *r = mv ? PyObject_CallMethod(obj, method, "OO", buf, mv) : NULL;
  /* What the callback returns is dropped first: returning `data` (or a view
   * of it) is not keeping it. */
  int ok = r != NULL;
  Py_CLEAR(r);
  if (ok) {
    Py_INCREF(Py_None);
    r = Py_None;
  }
  if (mv) {
    /* A controller that kept `data`/`out`, a view of it or an array made
     * from it (instead of copying) would reach the runtime's memory after the
     * call: refuse the move. Release with no exception pending, keeping the
     * callback's own error if it raised. */
    PyObject *err = r ? NULL : pyd_fetch_exception();
    int kept = Py_REFCNT(mv) > 1;
    PyObject *rel = PyObject_CallMethod(mv, "release", NULL);
    if (rel) Py_DECREF(rel);
    else PyErr_Clear();
    kept = kept || sp->exports > 0;
    sp->ptr = NULL; /* no new exports from here on */
    sp->len = 0;
    if (kept && r) {
      PyErr_Format(PyExc_BufferError,
                   "%s() kept a reference to the memory it was given, which is valid during "
                   "the call only: copy it (e.g. bytes(data)) instead",
                   method);
      err = pyd_fetch_exception();
      Py_CLEAR(r);
    }
    if (err) {
      PyErr_SetObject((PyObject *)Py_TYPE(err), err);
      Py_DECREF(err);
    }
  }
  if (r) {
    st = DMEM_OK;
    Py_DECREF(r);
  } else {
    pyd_callback_failed(obj);
  }
  Py_XDECREF(mv);
  Py_XDECREF(sp);
  Py_XDECREF(buf);
  Py_DECREF(obj);
out:
  pyd_gil_drop(&gs);
  return st;
}

static dmem_status_t pyd_tramp_store(void *user, dmem_handle_t h, const void *data, size_t size) {
  return pyd_tramp_move(user, "store", h, (void *)data, size, 1);
}

static dmem_status_t pyd_tramp_retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  return pyd_tramp_move(user, "retrieve", h, out, size, 0);
}

/* Whether m is a plain Python function of exactly one argument after self
 * (an on_unspill written before the tier was passed). Anything else (other
 * callables, *args, more parameters) gets the tier. */
static int pyd_takes_one_arg(PyObject *m) {
  PyObject *code = PyObject_GetAttrString(m, "__code__");
  if (!code) {
    PyErr_Clear();
    return 0;
  }
  int one = 0;
  PyObject *argc = PyObject_GetAttrString(code, "co_argcount");
  PyObject *flags = PyObject_GetAttrString(code, "co_flags");
  if (argc && flags) {
    long n = PyLong_AsLong(argc), f = PyLong_AsLong(flags);
    one = n == 2 && !(f & CO_VARARGS);
  }
  PyErr_Clear();
  Py_XDECREF(argc);
  Py_XDECREF(flags);
  Py_DECREF(code);
  return one;
}

/* Which callbacks the controller's class overrides. */
static int pyd_controller_mask(PyObject *obj, unsigned *mask_out) {
  unsigned mask = 0;
  PyObject *type = (PyObject *)Py_TYPE(obj);
  for (size_t i = 0; i < PYD_NCB; i++) {
    PyObject *m = PyObject_GetAttrString(type, pyd_cb_names[i]);
    if (!m) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
      PyErr_Clear();
      continue;
    }
    int overridden = 1;
    if (pyd_controller_base) {
      PyObject *bm = PyObject_GetAttrString(pyd_controller_base, pyd_cb_names[i]);
      if (!bm) PyErr_Clear();
      overridden = bm != m;
      Py_XDECREF(bm);
    }
    if (overridden && strcmp(pyd_cb_names[i], "on_unspill") == 0 && pyd_takes_one_arg(m))
      mask |= PYD_CB_UNSPILL_NO_TIER;
    Py_DECREF(m);
    if (overridden) mask |= 1u << i;
  }
  *mask_out = mask;
  return 0;
}

PyObject *pyd_runtime_set_controller(pyd_runtime_t *self, PyObject *obj) {
  if (pyd_runtime_check(self) < 0) return NULL;
  pyd_binding_t *b = NULL;
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  if (obj != Py_None) {
    if (pyd_controller_base) {
      int ok = PyObject_IsInstance(obj, pyd_controller_base);
      if (ok < 0) return NULL;
      if (!ok) {
        PyErr_Format(PyExc_TypeError, "controller must be a dmem.Controller or None, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
      }
    }
    unsigned mask;
    if (pyd_controller_mask(obj, &mask) < 0) return NULL;
    b = PyMem_RawCalloc(1, sizeof *b);
    if (!b) return PyErr_NoMemory();
    b->owner = self;
    Py_INCREF(obj);
    b->obj = obj;
    b->mask = mask;
    c.user = b;
    if (mask & PYD_CB_EVENTS) c.on_event = pyd_tramp_event;
    if (mask & PYD_CB_SELECT_VICTIMS) c.select_victims = pyd_tramp_select;
    if (mask & PYD_CB_STORE) c.store = pyd_tramp_store;
    if (mask & PYD_CB_RETRIEVE) c.retrieve = pyd_tramp_retrieve;
  }
  pyd_ctx_t ctx;
  pyd_enter(&ctx, self, 1);
  dmem_status_t st = dmem_controller_set(self->rt, b ? &c : NULL);
  pyd_leave(&ctx);
  if (st != DMEM_OK) {
    if (b) {
      Py_CLEAR(b->obj);
      PyMem_RawFree(b);
    }
    pyd_finish(&ctx, st);
    return NULL;
  }
  /* The old controllers are out; their bindings stay allocated until the
   * runtime is destroyed (a callback may still be running with them). */
  for (pyd_binding_t *o = self->bindings; o; o = o->next) Py_CLEAR(o->obj);
  if (b) {
    b->next = self->bindings;
    self->bindings = b;
  }
  if (pyd_finish(&ctx, DMEM_OK) < 0) return NULL;
  Py_RETURN_NONE;
}

PyObject *pyd_runtime_get_controller(pyd_runtime_t *self, void *closure) {
  PyObject *o = self->bindings && self->rt ? self->bindings->obj : NULL;
  if (!o) Py_RETURN_NONE;
  Py_INCREF(o);
  return o;
}

void pyd_bindings_mark_closing(pyd_runtime_t *self) {
  for (pyd_binding_t *b = self->bindings; b; b = b->next) b->closing = 1;
}

void pyd_bindings_free(pyd_runtime_t *self) {
  pyd_binding_t *b = self->bindings;
  self->bindings = NULL;
  while (b) {
    pyd_binding_t *next = b->next;
    Py_CLEAR(b->obj);
    PyMem_RawFree(b);
    b = next;
  }
}

int pyd_bindings_traverse(pyd_runtime_t *self, visitproc visit, void *arg) {
  for (pyd_binding_t *b = self->bindings; b; b = b->next) Py_VISIT(b->obj);
  return 0;
}

void pyd_bindings_clear(pyd_runtime_t *self) {
  for (pyd_binding_t *b = self->bindings; b; b = b->next) Py_CLEAR(b->obj);
}
