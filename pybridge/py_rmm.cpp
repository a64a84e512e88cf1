/*
 * pybridge/py_rmm.cpp - dmem._rmm, built only when RMM's headers are found
 * (cmake/DmemRmm.cmake): gives a Python rmm.mr.DeviceMemoryResource the
 * C++ resource dmem::rmm_resource (include/dmem/rmm.hpp) over a default
 * runtime, so that RMM's Python (DeviceBuffer, rmm_cupy_allocator, every
 * adaptor built over it) and, once set as a device's resource, RMM's C++
 * users allocate from dmem with no Python call per allocation.
 *
 * How RMM's Python finds a resource: every DeviceMemoryResource is a
 * Cython object whose C field `c_ref` (std::optional of a wrapper around
 * rmm::device_async_resource_ref, declared in RMM's
 * rmm/librmm/memory_resource.pxd) is the C++ resource; DeviceBuffer and
 * set_per_device_resource read that field (get_mr()). Its subclasses fill
 * it in __cinit__ from a C++ object they own. dmem cannot cimport RMM (no
 * Cython at build time), so `attach` fills the field of an instance of a
 * Python subclass with a ref to a per-device dmem::rmm_resource that lives
 * until the process exits, after checking that the object's layout is the
 * one compiled here: the type's size equals this mirror's, and the field
 * before c_ref is the class's Cython vtable. The Python side (dmem/rmm.py)
 * also refuses an RMM whose version differs from the headers' in major or
 * minor number (CCCL's resource_ref may change between them).
 *
 * Thread safety: the module's functions hold the GIL, which guards the
 * per-device table; the resources themselves are called from any thread.
 */
#include <Python.h>

#include <new>
#include <optional>

#include <rmm/resource_ref.hpp>
#include <rmm/version_config.hpp>

#include "dmem/device.h"
#include "dmem/rmm.hpp"
#include "dmem/runtime.h"

namespace {

/* The C layout of rmm.pylibrmm.memory_resource.DeviceMemoryResource (RMM
 * 26.x): PyObject_HEAD, the Cython vtable pointer (it has cdef methods),
 * then `optional[device_async_resource_ref] c_ref`, whose element is the
 * pxd's struct cython_device_async_resource_ref (one member, the optional
 * ref). */
struct mirror_ref {
  std::optional<rmm::device_async_resource_ref> ref;
};
struct mirror_resource {
  PyObject_HEAD
  void *vtab;
  std::optional<mirror_ref> c_ref;
};

constexpr int max_devices = 64; /* dmem_runtime_default's range */

/* One resource per device, made on first use and never freed: RMM (and
 * every adaptor built over it) may keep refs to it until the process ends,
 * as dmem's default runtimes live until then. Guarded by the GIL. */
dmem::rmm_resource *resources[max_devices];

PyObject *raise_status(PyObject *type, const char *what, dmem_status_t st) {
  PyErr_Format(type, "%s: %s: %s", what, dmem_status_name(st), dmem_last_error_detail());
  return nullptr;
}

/* Why `base` (RMM's DeviceMemoryResource) does not have the layout compiled
 * here, or nullptr. */
const char *layout_mismatch(PyTypeObject *base, PyObject *obj) {
  if (base->tp_basicsize != (Py_ssize_t)sizeof(mirror_resource))
    return "its C size differs from the one dmem was built for";
  PyObject *cap = PyObject_GetAttrString((PyObject *)base, "__pyx_vtable__");
  if (!cap) {
    PyErr_Clear();
    return "it has no Cython vtable (__pyx_vtable__)";
  }
  void *vtab = PyCapsule_CheckExact(cap) ? PyCapsule_GetPointer(cap, nullptr) : nullptr;
  Py_DECREF(cap);
  if (!vtab) {
    PyErr_Clear();
    return "its __pyx_vtable__ is not a capsule";
  }
  /* A subclass's instance points at its own class's vtable, which begins
   * with the base's; RMM's Python subclasses (and ours) share the base's. */
  if (reinterpret_cast<mirror_resource *>(obj)->vtab != vtab)
    return "the field before c_ref is not its Cython vtable";
  return nullptr;
}

PyObject *mod_attach(PyObject *, PyObject *args) {
  PyObject *obj, *base_o;
  int device;
  if (!PyArg_ParseTuple(args, "OOi:attach", &obj, &base_o, &device)) return nullptr;
  if (!PyType_Check(base_o)) {
    PyErr_Format(PyExc_TypeError, "attach: base must be rmm.mr.DeviceMemoryResource, not %.100s",
                 Py_TYPE(base_o)->tp_name);
    return nullptr;
  }
  PyTypeObject *base = (PyTypeObject *)base_o;
  if (!PyObject_TypeCheck(obj, base)) {
    PyErr_Format(PyExc_TypeError, "attach: the resource must be an instance of %.100s, not %.100s",
                 base->tp_name, Py_TYPE(obj)->tp_name);
    return nullptr;
  }
  if (const char *why = layout_mismatch(base, obj)) {
    PyErr_Format(PyExc_RuntimeError,
                 "dmem.rmm: %.100s is not the RMM this dmem was built for (RMM %s): %s; "
                 "rebuild dmem against the installed RMM's headers",
                 base->tp_name, RMM_VERSION, why);
    return nullptr;
  }
  if (device < 0 || device >= max_devices) {
    PyErr_Format(PyExc_ValueError, "attach: device %d not in 0..%d", device, max_devices - 1);
    return nullptr;
  }
  auto *m = reinterpret_cast<mirror_resource *>(obj);
  if (m->c_ref.has_value()) {
    PyErr_SetString(PyExc_ValueError, "attach: this resource already has a C++ resource");
    return nullptr;
  }
  dmem::rmm_resource *r = resources[device];
  if (!r) {
    dmem_runtime_t *rt = nullptr;
    dmem_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = dmem_runtime_default(device, &rt);
    Py_END_ALLOW_THREADS
    if (st != DMEM_OK) return raise_status(PyExc_RuntimeError, "dmem_runtime_default", st);
    if (dmem_runtime_backend(rt) != DMEM_BACKEND_CUDA) {
      PyErr_SetString(PyExc_ValueError,
                      "dmem.rmm: the default runtime uses the host backend; RMM passes CUDA "
                      "streams, which only the cuda backend takes");
      return nullptr;
    }
    if (resources[device]) { /* made by another thread while the GIL was released */
      r = resources[device];
    } else {
      r = new (std::nothrow) dmem::rmm_resource(rt);
      if (!r) return PyErr_NoMemory();
      resources[device] = r;
    }
  }
  m->c_ref.emplace(mirror_ref{rmm::device_async_resource_ref{*r}});
  Py_RETURN_NONE;
}

PyObject *mod_forget_stream(PyObject *, PyObject *args) {
  int device;
  PyObject *handle_o;
  if (!PyArg_ParseTuple(args, "iO!:forget_stream", &device, &PyLong_Type, &handle_o))
    return nullptr;
  unsigned long long handle = PyLong_AsUnsignedLongLong(handle_o); /* OverflowError if < 0 */
  if (handle == (unsigned long long)-1 && PyErr_Occurred()) return nullptr;
  if (device < 0 || device >= max_devices) {
    PyErr_Format(PyExc_ValueError, "forget_stream: device %d not in 0..%d", device,
                 max_devices - 1);
    return nullptr;
  }
  dmem::rmm_resource *r = resources[device];
  if (!r || handle <= 2) Py_RETURN_NONE; /* never used by RMM here / a default stream */
  dmem_status_t st;
  Py_BEGIN_ALLOW_THREADS
  st = dmem_stream_forget(r->runtime(), reinterpret_cast<dmem_stream_t>(handle));
  Py_END_ALLOW_THREADS
  if (st != DMEM_OK) return raise_status(PyExc_RuntimeError, "dmem_stream_forget", st);
  Py_RETURN_NONE;
}

PyObject *mod_layout_ok(PyObject *, PyObject *args) {
  PyObject *obj, *base_o;
  if (!PyArg_ParseTuple(args, "OO:layout_ok", &obj, &base_o)) return nullptr;
  if (!PyType_Check(base_o) || !PyObject_TypeCheck(obj, (PyTypeObject *)base_o)) {
    PyErr_SetString(PyExc_TypeError, "layout_ok(obj, base): obj must be an instance of base");
    return nullptr;
  }
  const char *why = layout_mismatch((PyTypeObject *)base_o, obj);
  if (!why) Py_RETURN_TRUE;
  return PyUnicode_FromString(why);
}

PyMethodDef methods[] = {
    {"attach", mod_attach, METH_VARARGS,
     "attach(resource, DeviceMemoryResource, device): make resource (an instance of a Python\n"
     "subclass of rmm.mr.DeviceMemoryResource, whose C++ resource is still unset) allocate\n"
     "from dmem's default runtime of device. TypeError for other objects, RuntimeError\n"
     "when RMM's layout is not the one dmem was built for, ValueError for a device outside\n"
     "0..63, a resource attached already, or a default runtime on the host backend."},
    {"forget_stream", mod_forget_stream, METH_VARARGS,
     "forget_stream(device, handle): dmem_stream_forget of the cudaStream_t `handle` in the\n"
     "runtime behind RMM's resource of device (nothing when none was made, or for the\n"
     "default streams 0, 1, 2). ValueError for a device outside 0..63."},
    {"layout_ok", mod_layout_ok, METH_VARARGS,
     "layout_ok(obj, base) -> True, or a string saying why base's C layout is not the one\n"
     "dmem was built for."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT,
                      "_rmm",
                      "dmem._rmm: dmem as RMM's device memory resource (use dmem.rmm).",
                      -1,
                      methods,
                      nullptr,
                      nullptr,
                      nullptr,
                      nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__rmm(void) {
  PyObject *m = PyModule_Create(&module);
  if (!m) return nullptr;
  if (PyModule_AddStringConstant(m, "RMM_VERSION", RMM_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "RMM_VERSION_MAJOR", RMM_VERSION_MAJOR) < 0 ||
      PyModule_AddIntConstant(m, "RMM_VERSION_MINOR", RMM_VERSION_MINOR) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
