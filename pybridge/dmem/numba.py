"""dmem as Numba's device allocator: an External Memory Management (EMM)
plugin (NBEP 7) for numba-cuda.

    import dmem.numba
    dmem.numba.use_dmem_for_numba()        # before Numba's first CUDA use

or, without touching the program::

    NUMBA_CUDA_MEMORY_MANAGER=dmem.numba python program.py

Every device array Numba allocates is then a raw allocation of the
process-wide dmem runtime of its device (``dmem.default_runtime(device)``):
never spilled, counted against the same device limit as dmem's spillable
buffers (which spill to make room for it), and given back to dmem when
Numba drops it. Host allocations (pinned, mapped, managed) stay Numba's own
(``HostOnlyCUDAMemoryManager``).

Each array is a *dedicated block* (``dmem_device_malloc_dedicated``): a
whole cudaMalloc of its own, as with Numba's own manager, because Numba asks
the driver about allocations: ``driver.device_memory_size`` and
``device_extents`` call ``cuMemGetAddressRange``, and a CUDA IPC handle sent
as bare bytes (``open_ipc_array(handle.reserved, ...)``) opens at offset 0.
A range of a shared pool slab would answer those with the slab. Freed blocks
are cached by size, in stream order, so only the first allocation of a size
pays for a cudaMalloc. Set ``DMEM_NUMBA_DEDICATED=0`` to suballocate from
dmem's pool instead (denser for many small arrays of varied sizes; then
``cuMemGetAddressRange`` sees the pool slab, and IPC handles need their
``offset``).

Behaviour, method by method:

- ``memalloc(size)``: a ``MemoryPointer`` whose pointer is a
  ``cuda.bindings.driver.CUdeviceptr`` (what numba-cuda 0.30 expects), over
  memory allocated for Numba's default stream (the legacy one, or the
  per-thread one under ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1``). Its
  finalizer frees it on that stream: the block is reusable at once in that
  stream's order, by other streams after an event, never after a host wait.
  Out of memory (after spilling whatever can be spilled) raises
  ``dmem.OutOfMemoryError`` (a ``MemoryError``).
  ``DMEM_NUMBA_POINTER=del`` returns ``DmemMemoryPointer`` instead, a
  ``MemoryPointer`` subclass freed by ``__del__`` (no ``weakref.finalize``
  per allocation: about half the cost of a ``memalloc``); pointers still
  alive when the interpreter exits are not given back (the process's end
  frees them). It is off by default until numba-cuda's suite has run under
  it on a GPU (docs/integrations.md).
- ``get_memory_info()``: dmem's ``(free, total)``: total is the runtime's
  device limit; free counts the bytes of spillable buffers as obtainable.
- ``get_ipc_handle(memory)``: an ``IpcHandle`` built from the CUDA IPC
  handle of the block (or pool slab) that holds the pointer, with the
  pointer's offset in it (0 for an array's own block), so another process
  opens it like any Numba IPC handle.
- ``initialize()`` also makes dmem the allocator of numba-cuda's device
  copies of host arrays passed to kernels: numba-cuda 0.25 and later
  allocates them through the cuda.core Device behind the context
  (``Device.allocate``), not through ``memalloc``; its
  ``memory_resource`` becomes a ``dmem.cuda_core.MemoryResource`` (raw
  allocations of the same runtime, freed when numba-cuda drops the copy).
  Without cuda.core, or with an older numba-cuda (whose copies go through
  ``memalloc`` already), it does nothing: ``kernel_arg_copies()`` says,
  per device, ``"dmem"`` or why not.
- ``initialize()`` and ``reset()`` call ``super()``. ``reset()`` frees the
  raw allocations this context made (pointers Numba still holds become
  invalid, as with Numba's own reset) and never touches spillable buffers.
- ``defer_cleanup()``: while it is active (it nests),
  frees of Numba's device arrays are kept pending: their memory stays
  allocated, and no block is reused, until the outermost block ends, which
  then frees them all. Host-side cleanup is deferred by ``super()`` as
  usual. Use it around code that must not see memory reused (e.g. while a
  kernel still reads an array whose last Python reference is gone); outside
  it, frees cost one return to the pool each, so there is nothing to batch.
- ``interface_version`` is 1.

Importing this module imports neither Numba nor CUDA; the names below that
need Numba (``DmemNumbaManager``, ``_numba_memory_manager``) are made on
first access and raise ImportError naming numba-cuda when it is missing.
"""

import atexit
import contextlib
import ctypes
import functools
import os
import sys

__all__ = ["DmemNumbaManager", "kernel_arg_copies", "use_dmem_for_numba"]

_manager_class = None


def _import_numba():
    try:
        from numba import cuda  # noqa: F401  (numba-cuda provides numba.cuda)
        from numba.cuda import HostOnlyCUDAMemoryManager, IpcHandle, MemoryPointer
        from numba.cuda.cudadrv import driver
    except ImportError as e:
        raise ImportError(
            "dmem.numba needs numba-cuda (the package 'numba-cuda', which provides "
            f"numba.cuda): {e}"
        ) from e
    return HostOnlyCUDAMemoryManager, IpcHandle, MemoryPointer, driver


def _device_ordinal(context):
    """The CUDA ordinal of a Numba context's device, or None (no context).
    Numba's own Device has .id; a context attached to a primary context that
    another library made (numba-cuda's test_context_stack) carries the
    driver's CUdevice instead, whose int() is the ordinal."""
    if context is None:
        return None
    dev = context.device
    ordinal = getattr(dev, "id", None)
    return int(dev) if ordinal is None else int(ordinal)


def _ipc_mem_handle(binding, raw):
    """A driver CUipcMemHandle holding the 64 bytes `raw`."""
    h = binding.CUipcMemHandle()
    try:
        h.reserved = raw
    except (TypeError, ValueError):  # older bindings take signed chars
        h.reserved = [b - 256 if b > 127 else b for b in raw]
    return h


def _build():
    HostOnlyCUDAMemoryManager, IpcHandle, MemoryPointer, driver = _import_numba()
    import dmem

    binding = getattr(driver, "binding", None)
    if binding is not None and getattr(driver, "USE_NV_BINDING", True):
        make_ptr = binding.CUdeviceptr
    else:  # numba-cuda's ctypes binding (before 0.2x)
        make_ptr = ctypes.c_uint64
    MemoryInfo = driver.MemoryInfo
    config = getattr(driver, "config", None)
    # Set by an atexit hook registered after Numba's own (so it runs first):
    # from then on a collected pointer gives nothing back (the process is
    # ending; Numba may have torn its contexts down, and a CUDA call then
    # could wait forever).
    exiting = [False]
    atexit.register(exiting.__setitem__, 0, True)

    class DmemMemoryPointer(MemoryPointer):
        """What memalloc returns under DMEM_NUMBA_POINTER=del: numba-cuda's
        MemoryPointer with its attributes and behaviour, over a dmem raw
        allocation given back to the manager when the pointer is freed
        (free(), or its last view dropping the count) or collected. A
        __del__ does what MemoryPointer's weakref.finalize would, for less
        than creating a finalizer costs."""

        def __init__(self, context, pointer, size, manager, mem):
            # MemoryPointer.__init__ (numba-cuda 0.30) without the finalizer
            self.context = context
            self.device_pointer = pointer
            self.size = size
            self._cuda_memsize_ = size
            self.is_managed = True
            self.refct = 1
            self.handle = pointer
            self._owner = None
            self._manager = manager
            self._mem = mem

        def free(self):
            mem = self._mem
            if mem is None:
                raise RuntimeError("Freeing dead memory")
            self._mem = None
            self._manager._release(mem)

        def __del__(self):
            mem = self._mem
            if mem is None or exiting[0] or sys.is_finalizing():
                return
            self._mem = None
            try:
                self._manager._release(mem)
            except Exception:  # noqa: BLE001 - a runtime already closed: nothing to give back
                pass

    DmemMemoryPointer.__module__ = __name__
    use_del = os.environ.get("DMEM_NUMBA_POINTER", "finalize") == "del"

    class DmemNumbaManager(HostOnlyCUDAMemoryManager):
        """Numba EMM plugin over dmem's default runtime (see the module's
        documentation for each method's behaviour)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._rt = None
            self._live = {}  # DeviceMemory -> None: this context's raw allocations
            self._pending = []  # frees held back by defer_cleanup
            self._defer_depth = 0
            # Numba's default stream: 2 is CU_STREAM_PER_THREAD, None the legacy one
            per_thread = bool(config and getattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0))
            self._stream = 2 if per_thread else None
            self._dedicated = os.environ.get("DMEM_NUMBA_DEDICATED", "1") != "0"

        def _runtime(self):
            rt = self._rt
            if rt is None:
                rt = self._rt = dmem.default_runtime(_device_ordinal(self.context))
            return rt

        def initialize(self):
            super().initialize()
            self._runtime()
            _route_kernel_args(self.context)

        def memalloc(self, size):
            rt = self._rt or self._runtime()
            if size == 0:
                return MemoryPointer(self.context, make_ptr(0), 0)
            mem = rt.device_malloc(size, self._stream, dedicated=self._dedicated)
            self._live[mem] = None
            if use_del:
                return DmemMemoryPointer(self.context, make_ptr(mem.ptr), size, self, mem)
            return MemoryPointer(
                self.context,
                make_ptr(mem.ptr),
                size,
                finalizer=functools.partial(self._release, mem),
            )

        def _release(self, mem):
            if self._live.pop(mem, 0) is None:  # 0: reset already freed it
                if self._defer_depth:
                    self._pending.append(mem)
                else:
                    mem.free()

        def get_memory_info(self):
            free, total = self._runtime().memory_info()
            return MemoryInfo(free=free, total=total)

        def get_ipc_handle(self, memory):
            ptr = memory.device_pointer_value or 0  # a view's pointer works too
            raw, offset = self._runtime().ipc_handle(ptr)
            handle = _ipc_mem_handle(binding, raw) if binding is not None else (
                (ctypes.c_byte * 64).from_buffer_copy(raw))
            source_info = self.context.device.get_device_identity()
            return IpcHandle(memory, handle, memory.size, source_info, offset=offset)

        def reset(self):
            super().reset()
            live, self._live = self._live, {}
            for mem in live:
                mem.free()
            while self._pending:
                self._pending.pop().free()

        @contextlib.contextmanager
        def defer_cleanup(self):
            with super().defer_cleanup():
                self._defer_depth += 1
                try:
                    yield
                finally:
                    self._defer_depth -= 1
                    if not self._defer_depth:
                        while self._pending:
                            self._pending.pop().free()

        @property
        def interface_version(self):
            return 1

    DmemNumbaManager.__module__ = __name__
    return DmemNumbaManager


# device ordinal -> "dmem" or why numba-cuda's kernel-argument copies of
# that device do not go through dmem (kernel_arg_copies())
_kernel_args = {}


def _route_kernel_args(context):
    """Make the cuda.core Device behind a Numba context allocate from dmem
    (dmem.cuda_core.MemoryResource): numba-cuda 0.25 and later puts the
    device copies of host arrays passed to a kernel there
    (``ctx.device._dev.allocate``), not through the EMM plugin. Numba keeps
    one cuda.core Device per device for every thread, so this covers them
    all. Without cuda.core, or with a numba-cuda whose devices have no
    cuda.core Device (older ones copy kernel arguments through memalloc,
    which is dmem already), nothing is done and kernel_arg_copies() says
    why."""
    dev = getattr(context, "device", None)
    ordinal = _device_ordinal(context)
    core_dev = getattr(dev, "_dev", None)
    if core_dev is None or not hasattr(core_dev, "memory_resource"):
        _kernel_args[ordinal] = ("not routed: this numba-cuda copies kernel arguments "
                                 "through the memory manager (memalloc), which is dmem")
        return
    try:
        from . import cuda_core

        mr_cls = cuda_core.MemoryResource
    except ImportError as e:
        _kernel_args[ordinal] = f"not routed: {e}"
        return
    core_dev.memory_resource = mr_cls(ordinal)
    _kernel_args[ordinal] = "dmem"


def kernel_arg_copies():
    """{device ordinal: "dmem", or why not} for each device whose Numba
    context this manager initialised: whether numba-cuda's device copies of
    host arrays passed to kernels (cuda.core's Device.allocate, numba-cuda
    0.25 and later) come from dmem."""
    return dict(_kernel_args)


def _manager():
    global _manager_class
    if _manager_class is None:
        _manager_class = _build()
    return _manager_class


def use_dmem_for_numba():
    """Make dmem Numba's device memory manager (numba.cuda.set_memory_manager).
    Call it before Numba's first CUDA use (with NUMBA_CUDA_MEMORY_MANAGER set,
    Numba ignores it with a warning)."""
    cls = _manager()
    from numba.cuda import set_memory_manager

    set_memory_manager(cls)


def __getattr__(name):
    # `_numba_memory_manager` is what NUMBA_CUDA_MEMORY_MANAGER=dmem.numba reads.
    if name in ("DmemNumbaManager", "_numba_memory_manager"):
        return _manager()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
