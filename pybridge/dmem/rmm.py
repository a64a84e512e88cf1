"""dmem as RMM's device memory resource (RMM >= 26.06, CCCL's ``cuda::mr``).

    import dmem.rmm
    dmem.rmm.use_dmem_for_rmm()       # the current device; or device=N

Every allocation RMM makes for that device then comes from the process-wide
dmem runtime of the device (``dmem.default_runtime(device)``): in Python
``rmm.DeviceBuffer``, CuPy through ``rmm.allocators.cupy.rmm_cupy_allocator``,
every adaptor built over ``rmm.mr.get_current_device_resource()``; in C++
(cuDF, cuML, rapidsmpf...) ``rmm::mr::get_current_device_resource_ref()``,
since ``rmm.mr.set_per_device_resource`` sets both. Each allocation is a raw
allocation of the runtime (never spilled, counted against its device limit,
spillable buffers spilled to make room), made for the caller's stream and
freed in that stream's order. No Python runs per allocation: the resource
is the C++ ``dmem::rmm_resource`` (``include/dmem/rmm.hpp``), attached to a
Python ``rmm.mr.DeviceMemoryResource`` by the native module ``dmem._rmm``.

Out of memory (after spilling whatever can be spilled) raises what RMM
raises for its own resources: ``MemoryError`` in Python
(``rmm::out_of_memory`` in C++), with dmem's detail in the message.

Needs the CUDA backend, RMM importable, and a dmem built with RMM's headers
(``dmem._rmm``; ``cmake/DmemRmm.cmake`` finds them through DMEM_RMM_ROOT or
the librmm wheel of the Python it builds for) at the same RMM major and
minor version; otherwise ``use_dmem_for_rmm`` raises ImportError (RMM or
``dmem._rmm`` missing), RuntimeError (another RMM version) or ValueError
(the host backend). Importing this module imports neither RMM nor CUDA.
"""

import threading

__all__ = ["DmemMemoryResource", "forget_stream", "use_dmem_for_rmm"]

_cls = None
_mu = threading.Lock()


def _import_rmm():
    try:
        import rmm
        import rmm.mr
    except ImportError as e:
        raise ImportError(f"dmem.rmm needs RMM (the package 'rmm-cu13' or 'rmm-cu12'): {e}") from e
    return rmm


def _native():
    try:
        from . import _rmm
    except ImportError as e:
        raise ImportError(
            "dmem.rmm: this dmem was built without RMM's headers (dmem._rmm is missing); "
            "rebuild it with -DDMEM_RMM_ROOT=<folder of the unzipped librmm and "
            f"rapids-logger wheels> or with the librmm wheel installed: {e}") from e
    return _rmm


def _check_version(rmm, native):
    have = str(getattr(rmm, "__version__", "?"))
    parts = have.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        major = minor = None
    if (major, minor) != (native.RMM_VERSION_MAJOR, native.RMM_VERSION_MINOR):
        raise RuntimeError(f"dmem.rmm was built against RMM {native.RMM_VERSION}; the RMM "
                           f"imported is {have}: rebuild dmem against its headers")


def _device_arg(device):
    if device is None:
        from rmm._cuda.gpu import getDevice

        return int(getDevice())
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int or None, not {type(device).__name__}")
    if device < 0:
        raise ValueError(f"device must be >= 0, not {device}")
    return device


def _resource_class():
    """DmemMemoryResource, made on first use (it subclasses RMM's class)."""
    global _cls
    with _mu:
        if _cls is not None:
            return _cls
        rmm = _import_rmm()
        native = _native()
        _check_version(rmm, native)
        import dmem

        base = rmm.mr.DeviceMemoryResource

        class DmemMemoryResource(base):
            """An ``rmm.mr.DeviceMemoryResource`` whose allocations are raw
            allocations of ``dmem.default_runtime(device)`` (device None:
            RMM's current device). All instances of a device share one C++
            resource, which lives until the process exits. Use it like any
            RMM resource: ``rmm.mr.set_current_device_resource(mr)``, as
            the upstream of an adaptor, ``rmm.DeviceBuffer(size=n, mr=mr)``,
            ``mr.allocate(n)``."""

            def __init__(self, device=None):
                d = _device_arg(device)
                dmem.default_runtime(d)  # made from dmem.configure() or DMEM_*
                native.attach(self, base, d)
                self._dmem_device = d

            @property
            def device(self):
                """The CUDA ordinal whose default runtime allocations come from."""
                return self._dmem_device

            @property
            def runtime(self):
                """``dmem.default_runtime(self.device)``."""
                return dmem.default_runtime(self._dmem_device)

            def __repr__(self):
                return f"dmem.rmm.DmemMemoryResource(device={self._dmem_device})"

        DmemMemoryResource.__module__ = __name__
        _cls = DmemMemoryResource
        return _cls


def use_dmem_for_rmm(device=None):
    """Make a DmemMemoryResource RMM's resource of device (None: RMM's current
    device), through ``rmm.mr.set_per_device_resource`` (RMM's Python and
    C++ both), and return it. When the device's resource is one already,
    it stays and is returned. Resources made before (adaptors over RMM's
    earlier resource, DeviceBuffers) keep theirs."""
    cls = _resource_class()
    import rmm.mr

    d = _device_arg(device)
    cur = rmm.mr.get_per_device_resource(d)
    if isinstance(cur, cls):
        return cur
    mr = cls(d)
    rmm.mr.set_per_device_resource(d, mr)
    return mr


def _stream_handle(stream):
    """The cudaStream_t of an int, an object with __cuda_stream__ (RMM's and
    cuda.core's streams), .ptr (CuPy) or .cuda_stream (PyTorch)."""
    if isinstance(stream, bool):
        raise TypeError("stream must be a stream or an int cudaStream_t, not bool")
    if isinstance(stream, int):
        h = stream
    elif hasattr(stream, "__cuda_stream__"):
        h = int(stream.__cuda_stream__()[1])
    elif hasattr(stream, "ptr"):
        h = int(stream.ptr)
    elif hasattr(stream, "cuda_stream"):
        h = int(stream.cuda_stream)
    else:
        raise TypeError(f"stream must be a stream or an int cudaStream_t, not "
                        f"{type(stream).__name__}")
    if h < 0:
        raise ValueError(f"stream handle must be >= 0, not {h}")
    return h


def forget_stream(stream, device=None):
    """Before destroying a stream that RMM allocations through dmem were made
    or freed on: dmem's pool may otherwise, later, record an event on it
    (when another stream wants a block last freed there), and when that
    record fails, the blocks stay unused (quarantined) until the process
    ends. Streams that live as long as the process (the default ones, RMM's
    and CuPy's stream pools) need nothing. No other call may pass the
    stream while this runs. stream: an rmm or cuda.core Stream, a CuPy or
    PyTorch stream, or an int cudaStream_t; device None: RMM's current
    device. Does nothing when RMM never used dmem on that device."""
    h = _stream_handle(stream)
    native = _native()
    if device is None:
        d = _device_arg(None)
    else:
        d = _device_arg(device)
    native.forget_stream(d, h)


def __getattr__(name):
    if name == "DmemMemoryResource":
        return _resource_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
