/*
 * pybridge/py_hooks.c - what the allocator hooks of the package need in C:
 *
 *  - dmem._dmem.CupyAllocator, the callable behind dmem.cupy.allocator
 *    (cupy.cuda.set_allocator). One call: CuPy's current device and stream
 *    (through CuPy's exported C functions when it has them), a raw
 *    allocation of that device's default runtime on that stream (py_raw.c), and
 *    cupy.cuda.memory.MemoryPointer(UnownedMemory(ptr, size, owner, device),
 *    0) whose owner, a DeviceMemory, frees the block on the same stream when
 *    CuPy drops it. No Python frame runs on the way, and the two classes are
 *    called as type.__call__ calls them (tp_new, tp_init) with argument
 *    tuples kept between calls (pyd_construct): about a sixth of the call
 *    was building and freeing those tuples.
 *  - dmem._dmem._library_path(): the file of the libdmem loaded in this
 *    process, for torch.cuda.memory.CUDAPluggableAllocator, so that PyTorch
 *    allocates from the very runtime that dmem.default_runtime() returns.
 */
#define _GNU_SOURCE /* dladdr */
#include "pydmem.h"

#include <dlfcn.h>

/* ---- CupyAllocator ------------------------------------------------------------- */

/* Cython's exported C signatures (a module's __pyx_capi__ capsules). */
#define PYD_CAPI_DEVICE "int (int __pyx_skip_dispatch)"
#define PYD_CAPI_STREAM "intptr_t (void)"

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject *unowned;        /* cupy.cuda.memory.UnownedMemory */
  PyObject *pointer;        /* cupy.cuda.memory.MemoryPointer */
  PyObject *device_fn;      /* get_device() -> int, when not a capsule */
  PyObject *stream_fn;      /* get_stream_ptr() -> int, when not a capsule */
  PyObject *stream_obj_fn;  /* get_stream() -> the stream object (non-default streams) */
  int (*device_c)(int);     /* from capsules, or NULL */
  intptr_t (*stream_c)(void);
  pyd_runtime_t *fixed;     /* strong: every allocation from it; NULL: default runtimes */
  pyd_runtime_t *rts[64];   /* strong: default runtime by device, made on first use */
  PyObject *capsules;       /* strong: keeps the capsules' modules' functions alive */
  PyObject *unowned_args;   /* strong: a 4-tuple kept for the next UnownedMemory, or NULL */
  PyObject *pointer_args;   /* strong: a 2-tuple kept for the next MemoryPointer, or NULL */
} pyd_cupy_alloc_t;

static int pyd_cupy_device(pyd_cupy_alloc_t *a, int *out) {
  int d;
  if (a->device_c) {
    d = a->device_c(1);
    if (d == -1 && PyErr_Occurred()) return -1;
  } else {
    PyObject *r = PyObject_CallNoArgs(a->device_fn);
    if (!r) return -1;
    long v = PyLong_AsLong(r);
    Py_DECREF(r);
    if (v == -1 && PyErr_Occurred()) return -1;
    d = (int)v;
  }
  if (d < 0 || d >= 64) {
    PyErr_Format(PyExc_ValueError, "dmem.cupy.allocator: device %d not in 0..63", d);
    return -1;
  }
  *out = d;
  return 0;
}

static int pyd_cupy_stream(pyd_cupy_alloc_t *a, intptr_t *out) {
  if (a->stream_c) {
    intptr_t s = a->stream_c();
    if (s == -1 && PyErr_Occurred()) return -1;
    *out = s;
    return 0;
  }
  PyObject *r = PyObject_CallNoArgs(a->stream_fn);
  if (!r) return -1;
  void *p = NULL;
  int rc = r == Py_None ? 0 : pyd_address_arg(r, "stream", &p);
  Py_DECREF(r);
  *out = (intptr_t)p;
  return rc;
}

/* cls(*argv) (n arguments). When cls is a class whose metaclass calls it
 * the way `type` does and that has no vectorcall of its own (CuPy's Cython
 * classes: the call would go through _PyObject_MakeTpCall), this is what
 * type.__call__ does, tp_new then tp_init of the result's type when it is
 * an instance of cls, but with an argument tuple kept in *cache between
 * calls instead of one built and freed per call. The tuple leaves *cache
 * while in use (a reentrant call, from an __init__ or a dealloc, makes its
 * own) and goes back only if nothing else holds it, emptied (its items
 * NULL: no other code can see it then). Otherwise PyObject_Vectorcall. */
static PyObject *pyd_construct(PyObject *cls, PyObject **cache, PyObject *const *argv,
                               Py_ssize_t n) {
  PyTypeObject *t = (PyTypeObject *)cls;
  if (!PyType_Check(cls) || Py_TYPE(cls)->tp_call != PyType_Type.tp_call || !t->tp_new ||
      t->tp_vectorcall)
    return PyObject_Vectorcall(cls, argv, (size_t)n, NULL);
  PyObject *args = *cache;
  *cache = NULL;
  if (!args && !(args = PyTuple_New(n))) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    Py_INCREF(argv[i]);
    PyTuple_SET_ITEM(args, i, argv[i]);
  }
  PyObject *obj = t->tp_new(t, args, NULL);
  if (obj && PyObject_TypeCheck(obj, t)) {
    initproc init = Py_TYPE(obj)->tp_init;
    if (init && init(obj, args, NULL) < 0) Py_CLEAR(obj);
  }
  if (!obj && !PyErr_Occurred())
    PyErr_Format(PyExc_SystemError, "%.100s() returned NULL without an exception", t->tp_name);
  if (Py_REFCNT(args) == 1) {
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *x = PyTuple_GET_ITEM(args, i);
      PyTuple_SET_ITEM(args, i, NULL);
      Py_DECREF(x); /* may run code: args is out of *cache meanwhile */
    }
    if (!*cache) {
      *cache = args;
      args = NULL;
    }
  }
  Py_XDECREF(args);
  return obj;
}

static PyObject *pyd_cupy_alloc_call(pyd_cupy_alloc_t *a, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
    PyErr_SetString(PyExc_TypeError, "dmem.cupy.allocator(nbytes) takes one positional argument");
    return NULL;
  }
  PyObject *size_o = args[0];
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
  int dev;
  if (pyd_cupy_device(a, &dev) < 0) return NULL;
  PyObject *owner = NULL, *ptr_o = NULL;
  if (size == 0) { /* CuPy's own pool gives a null pointer too */
    owner = Py_None;
    Py_INCREF(owner);
    ptr_o = PyLong_FromLong(0);
  } else {
    intptr_t sp;
    if (pyd_cupy_stream(a, &sp) < 0) return NULL;
    pyd_runtime_t *rt = a->fixed;
    if (!rt) {
      rt = a->rts[dev];
      if (!rt) rt = a->rts[dev] = pyd_runtime_default(dev);
      if (!rt) return NULL;
    }
    PyObject *keep = NULL;
    /* 0 legacy, 1 legacy, 2 per-thread: default streams, never destroyed */
    if ((uintptr_t)sp > 2) {
      if (rt->backend != DMEM_BACKEND_CUDA) {
        PyErr_SetString(PyExc_ValueError,
                        "dmem.cupy.allocator: the host backend has no foreign streams");
        return NULL;
      }
      /* Keep the stream object alive until the free (the pool then forgets
       * it): CuPy may destroy the stream while the array lives on. */
      keep = PyObject_CallNoArgs(a->stream_obj_fn);
      if (!keep) return NULL;
    }
    owner = pyd_devmem_alloc(rt, size, (dmem_stream_t)sp, keep, 0);
    Py_XDECREF(keep);
    if (!owner) return NULL;
    ptr_o = PyLong_FromVoidPtr(((pyd_devmem_t *)owner)->ptr);
  }
  PyObject *dev_o = PyLong_FromLong(dev);
  PyObject *mem = NULL, *mp = NULL;
  if (ptr_o && dev_o) {
    PyObject *margs[4] = {ptr_o, size_o, owner, dev_o};
    mem = pyd_construct(a->unowned, &a->unowned_args, margs, 4);
  }
  Py_XDECREF(ptr_o);
  Py_XDECREF(dev_o);
  Py_DECREF(owner); /* the UnownedMemory holds it now (or the error frees it) */
  if (!mem) return NULL;
  PyObject *zero = PyLong_FromLong(0);
  if (zero) {
    PyObject *pargs[2] = {mem, zero};
    mp = pyd_construct(a->pointer, &a->pointer_args, pargs, 2);
    Py_DECREF(zero);
  }
  Py_DECREF(mem);
  return mp;
}

/* A capsule of the expected signature becomes *fn; a callable stays *obj. */
static int pyd_cupy_fn_arg(PyObject *o, const char *sig, const char *what, void **fn,
                           PyObject **obj) {
  if (PyCapsule_CheckExact(o)) {
    if (!PyCapsule_IsValid(o, sig)) {
      PyErr_Format(PyExc_TypeError, "%s: a capsule must carry the C signature \"%s\"", what, sig);
      return -1;
    }
    *fn = PyCapsule_GetPointer(o, sig);
    return *fn ? 0 : -1;
  }
  if (!PyCallable_Check(o)) {
    PyErr_Format(PyExc_TypeError, "%s must be callable or a capsule, not %.100s", what,
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  Py_INCREF(o);
  *obj = o;
  return 0;
}

static PyObject *pyd_cupy_alloc_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"unowned_memory", "memory_pointer", "get_device", "get_stream_ptr",
                           "get_stream", "runtime", NULL};
  PyObject *unowned, *pointer, *dev_o, *sptr_o, *sobj_o, *rt_o = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|O:CupyAllocator", kwlist, &unowned, &pointer,
                                   &dev_o, &sptr_o, &sobj_o, &rt_o))
    return NULL;
  if (!PyCallable_Check(unowned) || !PyCallable_Check(pointer) || !PyCallable_Check(sobj_o)) {
    PyErr_SetString(PyExc_TypeError,
                    "unowned_memory, memory_pointer and get_stream must be callable");
    return NULL;
  }
  if (rt_o != Py_None && !Py_IS_TYPE(rt_o, &pyd_runtime_type)) {
    PyErr_Format(PyExc_TypeError, "runtime must be a dmem.Runtime or None, not %.100s",
                 Py_TYPE(rt_o)->tp_name);
    return NULL;
  }
  pyd_cupy_alloc_t *a = (pyd_cupy_alloc_t *)type->tp_alloc(type, 0);
  if (!a) return NULL;
  a->vectorcall = (vectorcallfunc)pyd_cupy_alloc_call;
  void *fn = NULL;
  if (pyd_cupy_fn_arg(dev_o, PYD_CAPI_DEVICE, "get_device", &fn, &a->device_fn) < 0) goto fail;
  a->device_c = (int (*)(int))fn;
  fn = NULL;
  if (pyd_cupy_fn_arg(sptr_o, PYD_CAPI_STREAM, "get_stream_ptr", &fn, &a->stream_fn) < 0)
    goto fail;
  a->stream_c = (intptr_t(*)(void))fn;
  a->capsules = PyTuple_Pack(2, dev_o, sptr_o);
  if (!a->capsules) goto fail;
  Py_INCREF(unowned);
  a->unowned = unowned;
  Py_INCREF(pointer);
  a->pointer = pointer;
  Py_INCREF(sobj_o);
  a->stream_obj_fn = sobj_o;
  if (rt_o != Py_None) {
    Py_INCREF(rt_o);
    a->fixed = (pyd_runtime_t *)rt_o;
  }
  return (PyObject *)a;
fail:
  Py_DECREF(a);
  return NULL;
}

static int pyd_cupy_alloc_traverse(pyd_cupy_alloc_t *a, visitproc visit, void *arg) {
  Py_VISIT(a->unowned);
  Py_VISIT(a->pointer);
  Py_VISIT(a->device_fn);
  Py_VISIT(a->stream_fn);
  Py_VISIT(a->stream_obj_fn);
  Py_VISIT(a->capsules);
  Py_VISIT(a->unowned_args);
  Py_VISIT(a->pointer_args);
  Py_VISIT(a->fixed);
  for (int i = 0; i < 64; i++) Py_VISIT(a->rts[i]);
  return 0;
}

static int pyd_cupy_alloc_clear(pyd_cupy_alloc_t *a) {
  Py_CLEAR(a->unowned);
  Py_CLEAR(a->pointer);
  Py_CLEAR(a->device_fn);
  Py_CLEAR(a->stream_fn);
  Py_CLEAR(a->stream_obj_fn);
  Py_CLEAR(a->capsules);
  Py_CLEAR(a->unowned_args);
  Py_CLEAR(a->pointer_args);
  a->device_c = NULL;
  a->stream_c = NULL;
  Py_CLEAR(a->fixed);
  for (int i = 0; i < 64; i++) Py_CLEAR(a->rts[i]);
  return 0;
}

static void pyd_cupy_alloc_dealloc(pyd_cupy_alloc_t *a) {
  PyObject_GC_UnTrack(a);
  pyd_cupy_alloc_clear(a);
  Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *pyd_cupy_alloc_get_fast(pyd_cupy_alloc_t *a, void *closure) {
  return PyBool_FromLong(a->device_c && a->stream_c);
}

static PyGetSetDef pyd_cupy_alloc_getset[] = {
    {"uses_c_api", (getter)pyd_cupy_alloc_get_fast, NULL,
     "True when CuPy's current device and stream are read through its exported C functions",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject pyd_cupy_alloc_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dmem.CupyAllocator",
    .tp_basicsize = sizeof(pyd_cupy_alloc_t),
    .tp_dealloc = (destructor)pyd_cupy_alloc_dealloc,
    .tp_vectorcall_offset = offsetof(pyd_cupy_alloc_t, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CupyAllocator(unowned_memory, memory_pointer, get_device, get_stream_ptr,\n"
              "              get_stream, runtime=None)\n\n"
              "The callable behind dmem.cupy.allocator (made there from CuPy's classes and\n"
              "functions). get_device / get_stream_ptr: Cython C-API capsules of CuPy, or\n"
              "callables. runtime None: the default runtime of CuPy's current device.",
    .tp_traverse = (traverseproc)pyd_cupy_alloc_traverse,
    .tp_clear = (inquiry)pyd_cupy_alloc_clear,
    .tp_getset = pyd_cupy_alloc_getset,
    .tp_new = pyd_cupy_alloc_new,
};

/* ---- the library's path ---------------------------------------------------------- */

PyObject *pyd_mod_library_path(PyObject *mod, PyObject *unused) {
  Dl_info info;
  if (!dladdr((void *)&dmem_runtime_default, &info) || !info.dli_fname) {
    PyErr_SetString(PyExc_OSError, "dladdr found no file for dmem_runtime_default");
    return NULL;
  }
  return PyUnicode_DecodeFSDefault(info.dli_fname);
}
