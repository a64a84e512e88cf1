/*
 * pybridge/py_module.c - the top layer: the module dmem._dmem itself.
 * PyInit__dmem readies the types and registers them, the exception classes
 * (made here from py_errors.c's status table) and the status constants; the
 * module functions are the package's hooks: closing every runtime at exit,
 * disowning them in a forked child, registering dmem.Controller.
 *
 * The other files, bottom up: py_errors.c, py_args.c, py_stream.c, py_view.c, py_buffer.c,
 * py_controller.c, py_launch.c, py_raw.c, py_runtime.c, py_hooks.c (see pydmem.h).
 */
#include "pydmem.h"

#include <string.h>

/* ---- module functions ------------------------------------------------------ */

static PyObject *pyd_mod_shutdown(PyObject *mod, PyObject *unused) {
  /* Close every open runtime (atexit), so that spill directories are removed
   * even for runtimes that are never collected. Runtimes with calls still in
   * flight on daemon threads after 2 s, and runtimes whose views still have
   * live exports (close would free memory under them), are left alone. */
  for (;;) {
    pyd_runtime_t *r = pyd_live_runtimes;
    while (r && (r->closing || !r->rt)) r = r->live_next;
    if (!r) break;
    Py_INCREF(r);
    int rc = pyd_runtime_close_impl(r, 2.0);
    if (rc < 0) {
      PyErr_Clear();
      r->closing = 1; /* give up on it; do not loop forever */
    }
    Py_DECREF(r);
  }
  Py_RETURN_NONE;
}

static PyObject *pyd_mod_after_fork_child(PyObject *mod, PyObject *unused) {
  /* The child has none of the runtime's threads (host-backend streams, copy
   * engine) and no usable CUDA context: destroying a runtime there could wait
   * forever. Disown every runtime: its objects raise ForkedError (close()
   * does nothing), and its memory is left to the process's exit. */
  pyd_runtime_t *r = pyd_live_runtimes;
  pyd_live_runtimes = NULL;
  while (r) {
    pyd_runtime_t *next = r->live_next;
    r->live_prev = r->live_next = NULL;
    r->rt = NULL;
    r->active = 0;
    r->closing = 1;
    r->forked = 1;
    pyd_bindings_mark_closing(r);
    r = next;
  }
  pyd_runtime_defaults_after_fork(); /* the child's first use makes new ones */
  Py_RETURN_NONE;
}

static PyObject *pyd_mod_set_controller_base(PyObject *mod, PyObject *cls) {
  if (!PyType_Check(cls)) {
    PyErr_SetString(PyExc_TypeError, "expected a class");
    return NULL;
  }
  Py_INCREF(cls);
  Py_XSETREF(pyd_controller_base, cls);
  Py_RETURN_NONE;
}

static PyObject *pyd_mod_status_name(PyObject *mod, PyObject *arg) {
  int ovf = 0;
  long v = PyLong_AsLongAndOverflow(arg, &ovf);
  if (v == -1 && PyErr_Occurred()) return NULL;
  /* No status lies outside a C int: such a value is as unknown as any
   * other value outside the table (not truncated into one inside it). */
  if (ovf || v < INT_MIN || v > INT_MAX) v = 1; /* 1: in no row of the table */
  return PyUnicode_FromString(dmem_status_name((dmem_status_t)v));
}

static PyMethodDef pyd_mod_methods[] = {
    {"_shutdown", pyd_mod_shutdown, METH_NOARGS, "Close every open runtime (atexit hook)."},
    {"_after_fork_child", pyd_mod_after_fork_child, METH_NOARGS,
     "Disown every runtime in a forked child (os.register_at_fork hook)."},
    {"_set_controller_base", pyd_mod_set_controller_base, METH_O,
     "Register dmem.Controller, the class controllers must derive from."},
    {"status_name", pyd_mod_status_name, METH_O, "Name of a dmem status code."},
    {"default_runtime", (PyCFunction)(void (*)(void))pyd_mod_default_runtime,
     METH_VARARGS | METH_KEYWORDS,
     "default_runtime(device=None) -> Runtime\n\n"
     "The process-wide runtime of a device (dmem_runtime_default), shared with the\n"
     "Numba, CuPy and PyTorch hooks and the C symbols dmem_torch_alloc/free. Created on\n"
     "first use from configure(...) or the DMEM_* environment. device None: the one\n"
     "given to configure(device=...), else DMEM_DEVICE, else 0. Never closed."},
    {"_default_runtimes", pyd_mod_default_runtimes, METH_NOARGS,
     "The default runtimes this process has made through dmem (a list; none are made)."},
    {"configure", (PyCFunction)(void (*)(void))pyd_mod_configure, METH_VARARGS | METH_KEYWORDS,
     /* the signature comes first, from the table: PyInit__dmem */
     "Configuration of the default runtimes, before their first use (BusyError after it).\n"
     "Arguments as for Runtime(...), by keyword only; those left None come from the DMEM_*\n"
     "environment."},
    {"_config_options", pyd_mod_config_options, METH_NOARGS,
     "_config_options() -> list of dict: the options of Runtime(...) and configure(...) and\n"
     "the DMEM_* variables, one dict per row of the C library's table\n"
     "(DMEM_CONFIG_OPTIONS): field, kind, env, keyword, choices, doc."},
    {"_library_path", pyd_mod_library_path, METH_NOARGS,
     "Path of the libdmem shared library loaded in this process."},
    {NULL, NULL, 0, NULL}};

static int pyd_mod_traverse(PyObject *m, visitproc visit, void *arg) {
  Py_VISIT(pyd_controller_base);
  return 0;
}

static struct PyModuleDef pyd_module = {
    PyModuleDef_HEAD_INIT, "_dmem",
    "dmem._dmem: CPython bindings of the dmem runtime (use the package `dmem`).", -1,
    pyd_mod_methods, NULL, pyd_mod_traverse, NULL, NULL};

/* The exception classes of py_errors.c's table, stored back there. */
static int pyd_add_exceptions(PyObject *m) {
  PyObject *dict = Py_BuildValue("{s:O,s:O,s:s}", "status", Py_None, "name", Py_None, "detail", "");
  if (!dict) return -1;
  pyd_dmem_error = PyErr_NewExceptionWithDoc(
      "dmem.DmemError",
      "Base class of dmem errors: .status (int), .name (e.g. 'DMEM_ERR_BUSY'), "
      ".detail (dmem_last_error_detail() at the failure).",
      PyExc_Exception, dict);
  Py_DECREF(dict);
  if (!pyd_dmem_error || PyModule_AddObjectRef(m, "DmemError", pyd_dmem_error) < 0) return -1;
  PyObject *device_error = NULL;
  for (size_t i = 0; i < pyd_exc_ndefs; i++) {
    PyObject *bases;
    switch (pyd_exc_defs[i].extra) {
      case PYD_EXC_VALUE: bases = PyTuple_Pack(2, pyd_dmem_error, PyExc_ValueError); break;
      case PYD_EXC_MEMORY: bases = PyTuple_Pack(2, pyd_dmem_error, PyExc_MemoryError); break;
      case PYD_EXC_OS: bases = PyTuple_Pack(2, pyd_dmem_error, PyExc_OSError); break;
      case PYD_EXC_DEVICE: bases = PyTuple_Pack(1, device_error); break;
      default: bases = PyTuple_Pack(1, pyd_dmem_error); break;
    }
    if (!bases) return -1;
    char qual[96];
    snprintf(qual, sizeof qual, "dmem.%s", pyd_exc_defs[i].name);
    dict = Py_BuildValue("{s:i,s:s}", "status", (int)pyd_exc_defs[i].status, "name",
                         dmem_status_name(pyd_exc_defs[i].status));
    if (!dict) {
      Py_DECREF(bases);
      return -1;
    }
    pyd_exc_types[i] = PyErr_NewExceptionWithDoc(qual, pyd_exc_defs[i].doc, bases, dict);
    Py_DECREF(bases);
    Py_DECREF(dict);
    if (!pyd_exc_types[i] || PyModule_AddObjectRef(m, pyd_exc_defs[i].name, pyd_exc_types[i]) < 0)
      return -1;
    if (pyd_exc_defs[i].status == DMEM_ERR_DEVICE) device_error = pyd_exc_types[i];
  }
  /* Status codes as module constants. */
#define PYD_ADD_STATUS_(name, value, msg) \
  if (PyModule_AddIntConstant(m, "DMEM_" #name, value) < 0) return -1;
  DMEM_STATUS_MAP(PYD_ADD_STATUS_)
#undef PYD_ADD_STATUS_
  return 0;
}

PyMODINIT_FUNC PyInit__dmem(void) {
  /* Runtime's and configure's signatures: the keywords of the C library's
   * table of options (DMEM_CONFIG_OPTIONS), so that a new option shows */
  static int docs_done = 0;
  if (!docs_done) {
    const char *d = pyd_config_doc("Runtime", 0, pyd_runtime_type.tp_doc);
    if (d) pyd_runtime_type.tp_doc = d;
    for (PyMethodDef *md = pyd_mod_methods; md->ml_name; md++)
      if (strcmp(md->ml_name, "configure") == 0 && (d = pyd_config_doc("configure", 1, md->ml_doc)))
        md->ml_doc = d;
    docs_done = 1;
  }
  if (PyType_Ready(&pyd_runtime_type) < 0 || PyType_Ready(&pyd_buffer_type) < 0 ||
      PyType_Ready(&pyd_stream_type) < 0 || pyd_view_type_ready() < 0 ||
      pyd_controller_types_ready() < 0 || PyType_Ready(&pyd_devmem_type) < 0 ||
      PyType_Ready(&pyd_cupy_alloc_type) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&pyd_module);
  if (!m) return NULL;
  if (pyd_add_exceptions(m) < 0 ||
      PyModule_AddObjectRef(m, "Runtime", (PyObject *)&pyd_runtime_type) < 0 ||
      PyModule_AddObjectRef(m, "Buffer", (PyObject *)&pyd_buffer_type) < 0 ||
      PyModule_AddObjectRef(m, "Stream", (PyObject *)&pyd_stream_type) < 0 ||
      PyModule_AddObjectRef(m, "View", (PyObject *)&pyd_view_type) < 0 ||
      PyModule_AddObjectRef(m, "DeviceMemory", (PyObject *)&pyd_devmem_type) < 0 ||
      PyModule_AddObjectRef(m, "CupyAllocator", (PyObject *)&pyd_cupy_alloc_type) < 0 ||
      PyModule_AddIntConstant(m, "IPC_HANDLE_SIZE", DMEM_IPC_HANDLE_SIZE) < 0 ||
      PyModule_AddIntConstant(m, "VERSION_MAJOR", DMEM_VERSION_MAJOR) < 0 ||
      PyModule_AddIntConstant(m, "VERSION_MINOR", DMEM_VERSION_MINOR) < 0 ||
      PyModule_AddIntConstant(m, "VERSION_PATCH", DMEM_VERSION_PATCH) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
