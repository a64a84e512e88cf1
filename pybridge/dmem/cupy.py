"""dmem as CuPy's device allocator.

    import cupy, dmem.cupy
    cupy.cuda.set_allocator(dmem.cupy.allocator)    # or dmem.cupy.use_dmem_for_cupy()

Every CuPy array is then a raw allocation of the process-wide dmem runtime of
CuPy's current device (``dmem.default_runtime(device)``): never spilled,
counted against the same device limit as dmem's spillable buffers (which
spill to make room for it).

Stream order: memory is allocated for CuPy's current stream (the one
``cupy.cuda.get_current_stream()`` returns at the allocation) and freed on
that same stream when CuPy drops it: the block is reused at once in that
stream's order and by other streams only after an event, never after a host
wait. On a stream other than the default ones (legacy, per-thread) the
allocation keeps CuPy's Stream object alive until it is freed, and the free
then makes dmem's pool forget the stream (one event record), so destroying
the stream afterwards is safe.

Speed: ``allocator`` is a C callable (``dmem._dmem.CupyAllocator``): it reads
CuPy's current device and stream through the C functions CuPy exports (Cython
C API) and builds ``MemoryPointer(UnownedMemory(ptr, size, owner, device),
0)`` without a Python frame; the owner frees the block when CuPy lets go.

Recognising dmem's memory: ``device_memory(mem)`` / ``device_memory_of(array)``
give the ``dmem.DeviceMemory`` behind CuPy memory that this allocator made
(the ``owner`` of its ``UnownedMemory``), by type, or None for any other
memory (``dmem.arrays.adopt`` uses it to take such an array without a copy).

Importing this module imports neither CuPy nor CUDA; ``allocator`` is made on
first access and raises ImportError naming CuPy when it is missing.
"""

from . import _dmem

__all__ = ["allocator", "make_allocator", "use_dmem_for_cupy", "device_memory",
           "device_memory_of"]

_default = None

_CAPI_DEVICE = "int (int __pyx_skip_dispatch)"
_CAPI_STREAM = "intptr_t (void)"


def _import_cupy():
    try:
        import cupy  # noqa: F401
        from cupy.cuda import device, memory, stream
    except ImportError as e:
        raise ImportError(
            f"dmem.cupy needs CuPy (a 'cupy-cuda12x' / 'cupy-cuda13x' package): {e}"
        ) from e
    return device, memory, stream


def _capsule(module, name):
    return getattr(module, "__pyx_capi__", {}).get(name)


def make_allocator(runtime=None):
    """A CuPy allocator over `runtime` (a dmem.Runtime), or over the default
    runtime of CuPy's current device when None (what ``allocator`` is)."""
    if runtime is not None and not isinstance(runtime, _dmem.Runtime):
        raise TypeError(f"runtime must be a dmem.Runtime or None, not {type(runtime).__name__}")
    device, memory, stream = _import_cupy()

    def stream_ptr():
        return stream.get_current_stream().ptr

    slow = (device.get_device_id, stream_ptr)
    fast = (_capsule(device, "get_device_id"), _capsule(stream, "get_current_stream_ptr"))
    for get_device, get_stream_ptr in (fast, slow):
        if get_device is None or get_stream_ptr is None:
            continue
        try:
            return _dmem.CupyAllocator(memory.UnownedMemory, memory.MemoryPointer, get_device,
                                       get_stream_ptr, stream.get_current_stream, runtime)
        except TypeError:  # CuPy exports another C signature: use the Python functions
            if get_device is slow[0]:
                raise
    raise AssertionError("unreachable")


def device_memory(mem):
    """The ``dmem.DeviceMemory`` that owns the CuPy memory object `mem` (what
    ``array.data.mem`` is: a ``cupy.cuda.UnownedMemory``) when dmem's
    allocator made it, else None (CuPy's own pool, another allocator, None,
    any other object). Recognised by type: the owner must be a
    ``dmem.DeviceMemory`` of this extension; an object of another class is
    never taken for one, whatever its class is called. Needs no CuPy; never
    raises; thread-safe."""
    try:
        owner = getattr(mem, "_owner", None)  # CuPy's UnownedMemory keeps its owner there
    except Exception:
        return None
    return owner if isinstance(owner, _dmem.DeviceMemory) else None


def device_memory_of(array):
    """``device_memory(array.data.mem)`` for a CuPy array (``array.data`` is
    its ``MemoryPointer``), or None when the array's memory is not dmem's or
    the object has no such attributes. Never raises; thread-safe."""
    try:
        mem = getattr(getattr(array, "data", None), "mem", None)
    except Exception:
        return None
    return device_memory(mem)


def use_dmem_for_cupy():
    """cupy.cuda.set_allocator(dmem.cupy.allocator)."""
    alloc = _allocator()
    import cupy

    cupy.cuda.set_allocator(alloc)


def _allocator():
    global _default
    if _default is None:
        _default = make_allocator()
    return _default


def __getattr__(name):
    if name == "allocator":
        return _allocator()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
