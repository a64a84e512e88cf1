/*
 * pybridge/pydmem.h - internal declarations shared by the files of the
 * CPython extension dmem._dmem (Python C API only): the objects, then what
 * each file exports, one section per file in layer order.
 *
 * Layers, bottom up (a file calls only functions of its own and of the files
 * before it in this list; see README.md):
 *   errors -> args -> stream -> view -> buffer -> controller -> launch
 *   -> raw -> runtime -> hooks -> module
 *
 * Threading model
 *  - Every C call that may spill, copy, synchronise or wait runs with the GIL
 *    released, between pyd_enter() and pyd_leave(). While it runs, the
 *    runtime's `active` counter is raised so that Runtime.close() waits for it
 *    instead of destroying the runtime under it.
 *  - Callbacks (controller trampolines, launch functions, DLPack deleters)
 *    take the GIL with PyGILState_Ensure; they may come from any thread.
 *  - A controller callback that raises stores its exception in the calling
 *    thread's innermost pyd_ctx_t (the Python call that is waiting in C on
 *    this thread), which then raises CallbackError from it. With no such
 *    call (a runtime thread, a Buffer being collected) the exception goes to
 *    sys.unraisablehook.
 *  - All fields of the objects below are read and written with the GIL held.
 */
#ifndef PYDMEM_H
#define PYDMEM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "dmem/dmem.h"

/* ---- objects --------------------------------------------------------------- */

typedef struct pyd_binding pyd_binding_t;
typedef struct pyd_view pyd_view_t;

/* What a lock view hands out that keeps its buffer locked (py_view.c): the
 * buffer protocol (memoryview, numpy.asarray on the host backend), the array
 * interfaces (__array_interface__ / __cuda_array_interface__: the arrays
 * made from them keep the View itself alive) and DLPack capsules. */
enum { PYD_EXPORT_BUFFER = 0, PYD_EXPORT_IFACE = 1, PYD_EXPORT_DLPACK = 2, PYD_EXPORT_KINDS = 3 };

typedef struct pyd_runtime {
  PyObject_HEAD
  dmem_runtime_t *rt;          /* NULL once closed */
  dmem_backend_t backend;      /* DMEM_BACKEND_CUDA or DMEM_BACKEND_HOST */
  int device;                  /* device ordinal (DLPack device_id) */
  int closing;                 /* close() has started: refuse new calls */
  int forked;                  /* inherited by a forked child: calls raise ForkedError */
  int is_default;              /* dmem_runtime_default's: never closed */
  Py_ssize_t active;           /* calls in flight with the GIL released */
  pyd_binding_t *bindings;     /* controller bindings, current first; freed at close */
  PyObject *weakreflist;
  struct pyd_runtime *live_prev, *live_next; /* list of open runtimes (atexit) */
  pyd_view_t *exposed;         /* views with live exports (py_view.c's list) */
  Py_ssize_t exports[PYD_EXPORT_KINDS]; /* live exports of all its views, by kind */
  char backend_reason[384];    /* dmem_runtime_info's, kept after close */
} pyd_runtime_t;

/* One installed controller. Bindings are never freed before the C runtime is
 * destroyed, because a callback of a replaced controller may still be running
 * on another thread with `user` pointing here. */
struct pyd_binding {
  pyd_runtime_t *owner;        /* borrowed: outlives every callback */
  PyObject *obj;               /* strong; NULL once replaced or cleared */
  unsigned mask;               /* PYD_CB_* methods the controller overrides */
  int closing;                 /* runtime being destroyed: FREE events only */
  pyd_binding_t *next;
};

enum {
  PYD_CB_ON_ALLOC = 1u << 0,
  PYD_CB_ON_FREE = 1u << 1,
  PYD_CB_ON_SPILL = 1u << 2,
  PYD_CB_ON_UNSPILL = 1u << 3,
  PYD_CB_ON_PRESSURE = 1u << 4,
  PYD_CB_SELECT_VICTIMS = 1u << 5,
  PYD_CB_STORE = 1u << 6,
  PYD_CB_RETRIEVE = 1u << 7,
  PYD_CB_EVENTS = 0x1f,
  /* on_unspill is a plain function of (self, buf): the signature before the
   * tier was passed; it is called without it */
  PYD_CB_UNSPILL_NO_TIER = 1u << 8
};

typedef struct pyd_buffer {
  PyObject_HEAD
  pyd_runtime_t *rt;           /* strong */
  dmem_handle_t h;
  size_t size;
  unsigned char owning;        /* frees the handle when collected */
  unsigned char freed;         /* free() was called on this object */
  PyObject *weakreflist;
} pyd_buffer_t;

typedef struct pyd_stream {
  PyObject_HEAD
  pyd_runtime_t *rt;           /* strong */
  dmem_stream_t s;             /* NULL once closed */
  Py_ssize_t views;            /* lock views open on this stream */
} pyd_stream_t;

/* A lock view. Its one dmem lock (taken by __enter__) is held while the
 * `with` block runs and while any export lives: `held` drops to 0 when the
 * block has ended and the last export died (py_view.c). */
struct pyd_view {
  PyObject_HEAD
  pyd_buffer_t *buf;           /* strong */
  PyObject *stream_obj;        /* strong ref to what `stream` came from, or NULL */
  dmem_stream_t stream;
  dmem_handle_t h;
  void *ptr;                   /* the locked address while held, else NULL */
  int state;                   /* PYD_VIEW_*: where the with block is */
  int held;                    /* holds its dmem lock */
  Py_ssize_t exports[PYD_EXPORT_KINDS]; /* live exports by kind (IFACE: 0 or 1) */
  pyd_view_t *exp_prev, *exp_next;      /* in buf->rt->exposed while any export lives */
};

enum { PYD_VIEW_NEW = 0, PYD_VIEW_LOCKED = 1, PYD_VIEW_DONE = 2 };

/* A raw allocation (dmem_device_malloc): the owner object that allocator
 * hooks hand to Numba and CuPy; freed on `stream` when collected or by
 * free(). Once adopted (Runtime.adopt: the block became buffer `h`, locked
 * once for this object) it unlocks `h` there instead of freeing. */
typedef struct pyd_devmem {
  PyObject_HEAD
  pyd_runtime_t *rt;           /* strong */
  void *ptr;                   /* NULL once freed */
  size_t size;
  dmem_stream_t stream;        /* allocated for, freed on */
  PyObject *stream_keep;       /* strong: a foreign stream object kept alive
                                  until the free (then forgotten), or NULL */
  PyObject *owner_stream;      /* strong: the dmem.Stream it is on, or NULL */
  dmem_handle_t h;             /* the buffer it was adopted as, or 0 */
  int adopted;                 /* Runtime.adopt succeeded (stays set) */
} pyd_devmem_t;

/* ---- py_errors.c: exceptions, the call context, callback errors ------------- */

/* The call context of a Python call waiting in C with the GIL released. */
typedef struct pyd_ctx {
  struct pyd_ctx *prev;
  pyd_runtime_t *rt;
  PyObject *exc;               /* first exception raised by a controller callback */
  PyThreadState *ts;
  int accept;                  /* 0: nobody will raise exc (collection): unraisable */
} pyd_ctx_t;

extern _Thread_local pyd_ctx_t *pyd_tls_ctx;

/* Start a call on rt: push the context, count it, release the GIL.
 * DMEM_PY_HOLD_GIL (the CMake option of that name; to test the tests only,
 * never in a build anyone uses): keep the GIL, as an extension that never
 * released it would. tests/python/test_threads.py's GIL test must fail
 * against such a build. */
static inline void pyd_enter(pyd_ctx_t *c, pyd_runtime_t *rt, int accept) {
  c->prev = pyd_tls_ctx;
  c->rt = rt;
  c->exc = NULL;
  c->accept = accept;
  pyd_tls_ctx = c;
  rt->active++;
#ifdef DMEM_PY_HOLD_GIL
  c->ts = NULL;
#else
  c->ts = PyEval_SaveThread();
#endif
}

/* End it: take the GIL back, uncount, pop the context. */
static inline void pyd_leave(pyd_ctx_t *c) {
#ifndef DMEM_PY_HOLD_GIL
  PyEval_RestoreThread(c->ts);
#endif
  c->rt->active--;
  pyd_tls_ctx = c->prev;
}

/* After pyd_leave: raise CallbackError (from a stored callback exception) or
 * the exception of `st`. Returns 0 when nothing was raised, -1 otherwise. */
int pyd_finish(pyd_ctx_t *c, dmem_status_t st);

/* The status -> exception class table. py_errors.c maps statuses through it;
 * py_module.c creates the classes from it at import and stores them in
 * pyd_dmem_error and pyd_exc_types (same order as pyd_exc_defs). */
enum { PYD_EXC_VALUE = 1, PYD_EXC_MEMORY = 2, PYD_EXC_OS = 3, PYD_EXC_DEVICE = 4 };

typedef struct pyd_exc_def {
  dmem_status_t status;
  const char *name;            /* class name in the module */
  int extra;                   /* PYD_EXC_*: base besides DmemError (0: none) */
  const char *doc;
} pyd_exc_def_t;

extern const pyd_exc_def_t pyd_exc_defs[];
extern const size_t pyd_exc_ndefs;
extern PyObject *pyd_dmem_error;   /* dmem.DmemError */
extern PyObject *pyd_exc_types[];  /* its subclasses, by pyd_exc_defs row */

/* Raise the exception class of `st` with dmem_last_error_detail() (or
 * `detail` if not NULL). Returns NULL. */
PyObject *pyd_raise(dmem_status_t st, const char *detail);
/* Raise CallbackError with __cause__ = cause (reference stolen). */
PyObject *pyd_raise_callback(dmem_status_t st, PyObject *cause);
/* Fetch the current exception, normalised, with its traceback attached. */
PyObject *pyd_fetch_exception(void);
/* A callback failed (exception set): store it for the waiting call or report
 * it through sys.unraisablehook. Clears the error indicator. */
void pyd_callback_failed(PyObject *where);
/* Non-zero while the interpreter is shutting down (no Python callbacks). */
int pyd_finalizing(void);

/* ---- py_args.c: argument converters and checks --------------------------------- */

/* 0 if rt is open; else ValueError("runtime is closed") and -1. */
int pyd_runtime_check(pyd_runtime_t *rt);
/* 0 if the Buffer may be used (not freed, runtime open); else StaleHandleError. */
int pyd_buffer_check(pyd_buffer_t *b);
/* An address from an int-like object; ValueError "<what> must be a
 * non-negative 64-bit integer" when it does not fit. -1 on error. */
int pyd_address_arg(PyObject *o, const char *what, void **out);
/* A handle given as an int (o must be an int). -1 with ValueError on error. */
int pyd_handle_int_arg(PyObject *o, dmem_handle_t *out);
/* A size of Runtime(...): a non-negative int, or a str in the syntax of the
 * DMEM_* variables, parsed by the C library's dmem_size_parse ("4096",
 * "8GB" = 8e9, "8GiB" = 2^33; "80%" only when fraction != NULL). On success *bytes is
 * the byte count (0 for a percentage) and *fraction, when given, the
 * fraction (0 for a byte count); None leaves both alone. -1 on error:
 * TypeError, or ValueError carrying dmem_last_error_detail(). */
int pyd_size_arg(PyObject *o, const char *what, size_t *bytes, double *fraction);
/* A priority class (an int that fits a C int). -1 on error. */
int pyd_priority_arg(PyObject *o, int *out);
/* A non-negative offset or length: TypeError unless an int (or __index__),
 * ValueError when negative or past Py_ssize_t (never OverflowError). */
int pyd_offset_int_arg(PyObject *o, const char *what, Py_ssize_t *out);
/* A spill tier: 'host', 'disk' or 'controller'. -1 on error. */
int pyd_tier_arg(PyObject *o, dmem_tier_t *out);

/* ---- py_options.c: the keywords of DMEM_CONFIG_OPTIONS ------------------------------ */

/* The log levels' names, by value. */
extern const char *pyd_log_names[5];
/* A log level: 'off', 'error', 'warn' ('warning'), 'info', 'debug' or 0..4;
 * -1 with TypeError or ValueError otherwise. */
int pyd_log_level_arg(PyObject *o);
/* The arguments of func(...) (Runtime: positional too, in the table's
 * order; configure: keyword_only) into cfg (from dmem_config_init): one
 * keyword per row of DMEM_CONFIG_OPTIONS that has one; None leaves a field
 * alone. *keep receives what cfg's strings point into (the caller drops it
 * after creating the runtime); *device_given (may be NULL) is set when
 * device was given. -1 with TypeError or ValueError on error (*keep NULL). */
int pyd_config_parse(PyObject *args, PyObject *kwds, const char *func, int keyword_only,
                     dmem_config_t *cfg, PyObject **keep, int *device_given);
/* "func(kw=None, ...)" with every keyword of the table (keyword_only: "*,"
 * first), a blank line, then body: the docstring of Runtime and configure,
 * built once at import; NULL when out of memory. */
const char *pyd_config_doc(const char *func, int keyword_only, const char *body);
/* dmem._dmem._config_options(): a list of one dict per row of the table:
 * field, kind, env, keyword, choices (None where a row has none), doc. */
PyObject *pyd_mod_config_options(PyObject *mod, PyObject *unused);
/* Names of states and tiers, as the Python API spells them. */
const char *pyd_state_name(dmem_state_t s);
const char *pyd_tier_name(dmem_tier_t t);

/* ---- py_stream.c: dmem.Stream and stream arguments ------------------------------ */

extern PyTypeObject pyd_stream_type;
/* New Stream of rt (Runtime.stream()); rt must be open. */
PyObject *pyd_stream_new(pyd_runtime_t *rt);
/* Convert a stream argument (None, dmem.Stream, or under CUDA an int address
 * or a CuPy/PyTorch/Numba/__cuda_stream__ stream object) into *out; *keep
 * receives a new reference to the object to keep alive while the stream is in
 * use (a Stream or a foreign stream object; NULL for None and ints). -1 with
 * an exception on error. */
int pyd_stream_arg(pyd_runtime_t *rt, PyObject *o, dmem_stream_t *out, PyObject **keep);

/* ---- py_view.c: dmem.View (lock views, CUDA array interface, DLPack) ------------ */

extern PyTypeObject pyd_view_type;
int pyd_view_type_ready(void);
/* View of a buffer on a stream argument (Buffer.lock()). */
PyObject *pyd_view_new(pyd_buffer_t *buf, PyObject *stream_o);
/* Live exports of the views of handle h of rt (h == 0: of every buffer),
 * added into counts[PYD_EXPORT_KINDS] when counts is not NULL. Returns the
 * number of exposed views counted. */
Py_ssize_t pyd_view_exposure(pyd_runtime_t *rt, dmem_handle_t h, Py_ssize_t *counts);
/* Number of distinct buffers of rt with live exports; -1 with an exception. */
Py_ssize_t pyd_view_exposed_buffers(pyd_runtime_t *rt);
/* Raise BusyError saying that `what` is refused because exports (of handle
 * h, or of any buffer when h == 0) still hold the buffer, naming their
 * kinds. Returns NULL. */
PyObject *pyd_view_raise_exposed(pyd_runtime_t *rt, dmem_handle_t h, const char *what);

/* ---- py_buffer.c: dmem.Buffer ---------------------------------------------------- */

extern PyTypeObject pyd_buffer_type;
/* New Buffer object. owning = 0 gives a wrapper that does not free. */
PyObject *pyd_buffer_new(pyd_runtime_t *rt, dmem_handle_t h, size_t size, int owning);
/* Handle of a Buffer of rt (or an int handle if allow_int). -1 on error. */
int pyd_handle_arg(pyd_runtime_t *rt, PyObject *o, int allow_int, dmem_handle_t *out);

/* ---- py_controller.c: controller bindings and trampolines ----------------------- */

extern PyObject *pyd_controller_base; /* dmem.Controller, registered by the package */
int pyd_controller_types_ready(void);
PyObject *pyd_runtime_set_controller(pyd_runtime_t *self, PyObject *obj);
PyObject *pyd_runtime_get_controller(pyd_runtime_t *self, void *closure);
void pyd_bindings_mark_closing(pyd_runtime_t *self);
void pyd_bindings_free(pyd_runtime_t *self);
int pyd_bindings_traverse(pyd_runtime_t *self, visitproc visit, void *arg);
void pyd_bindings_clear(pyd_runtime_t *self);

/* ---- py_launch.c: the Runtime's launch entry points and stream calls ------------ */

/* Methods of dmem.Runtime (its method table is in py_runtime.c). */
PyObject *pyd_runtime_lock_and_launch(pyd_runtime_t *self, PyObject *args, PyObject *kwds);
PyObject *pyd_runtime_launch_async(pyd_runtime_t *self, PyObject *args, PyObject *kwds);
PyObject *pyd_runtime_sync_and_unlock(pyd_runtime_t *self, PyObject *const *args,
                                      Py_ssize_t nargs);
PyObject *pyd_runtime_stream_release(pyd_runtime_t *self, PyObject *const *args,
                                     Py_ssize_t nargs);
PyObject *pyd_runtime_synchronize(pyd_runtime_t *self, PyObject *const *args, Py_ssize_t nargs);

/* ---- py_raw.c: raw device memory (dmem.DeviceMemory) ------------------------------ */

extern PyTypeObject pyd_devmem_type;
/* Allocate `size` bytes for use on stream s (NULL: the default stream).
 * keep: a foreign stream object (new reference taken) held until the free,
 * which then also makes the pool forget s; NULL for the default stream, a
 * dmem.Stream or an int. Holds the GIL throughout when the runtime has never
 * had a Python controller (nothing can call back into Python then), else
 * releases it. Returns a new DeviceMemory, or NULL with an exception. */
PyObject *pyd_devmem_alloc(pyd_runtime_t *rt, size_t size, dmem_stream_t s, PyObject *keep,
                           int dedicated);
/* Methods of dmem.Runtime (its method table is in py_runtime.c). */
PyObject *pyd_runtime_device_malloc(pyd_runtime_t *self, PyObject *args, PyObject *kwds);
PyObject *pyd_runtime_memory_info(pyd_runtime_t *self, PyObject *unused);
/* The detail of an out-of-memory error of a raw allocation of size bytes:
 * `why` (may be NULL), then how the device limit is used: raw, locked,
 * pinned, spillable and free bytes (dmem_stats). Writes at most n bytes. */
void pyd_oom_detail(dmem_runtime_t *rt, size_t size, const char *why, char *out, size_t n);
PyObject *pyd_runtime_oom_message(pyd_runtime_t *self, PyObject *arg);
PyObject *pyd_runtime_ipc_handle(pyd_runtime_t *self, PyObject *ptr);
PyObject *pyd_runtime_adopt(pyd_runtime_t *self, PyObject *args, PyObject *kwds);

/* ---- py_runtime.c: dmem.Runtime ------------------------------------------------- */

extern PyTypeObject pyd_runtime_type;
/* The open runtimes (for atexit and fork), and close with a timeout (< 0:
 * wait for calls in flight as long as needed). */
extern pyd_runtime_t *pyd_live_runtimes;
int pyd_runtime_close_impl(pyd_runtime_t *self, double timeout_s);
/* The default runtime of `device` (dmem_runtime_default) as a Runtime; a
 * new reference, or NULL with an exception. device < 0: the configured
 * device (configure(device=...), else DMEM_DEVICE, else 0). */
pyd_runtime_t *pyd_runtime_default(int device);
/* dmem.default_runtime(device=None) and dmem.configure(**kwargs). */
PyObject *pyd_mod_default_runtime(PyObject *mod, PyObject *args, PyObject *kwds);
PyObject *pyd_mod_configure(PyObject *mod, PyObject *args, PyObject *kwds);
PyObject *pyd_mod_default_runtimes(PyObject *mod, PyObject *unused);
/* In a forked child: forget the default runtimes (py_module.c's fork hook). */
void pyd_runtime_defaults_after_fork(void);

/* ---- py_hooks.c: allocator hooks (CuPy's fast path, the library's path) -------- */

extern PyTypeObject pyd_cupy_alloc_type;
/* dmem._dmem._library_path(): the file of the loaded libdmem (dladdr). */
PyObject *pyd_mod_library_path(PyObject *mod, PyObject *unused);

#endif /* PYDMEM_H */
