"""dmem as a ``cuda.core`` memory resource (cuda.core 1.x).

    from cuda.core import Device
    import dmem.cuda_core
    dev = Device(0)
    dev.set_current()
    mr = dmem.cuda_core.MemoryResource(0)
    buf = mr.allocate(1 << 20, stream=dev.default_stream)   # a cuda.core Buffer
    dev.memory_resource = mr        # Device.allocate (and numba-cuda) use it

``MemoryResource(device=None)`` subclasses ``cuda.core.MemoryResource``;
each Buffer it returns is a raw allocation of ``dmem.default_runtime(device)``
(device None: cuda.core's current device, 0 when none is current):
never spilled, counted against the device limit, spillable buffers spilled
to make room, made for the stream given and freed in that stream's order
when the Buffer is closed or collected (``deallocate``). Out of memory
raises ``dmem.OutOfMemoryError`` (a ``MemoryError``).

``dmem.numba.use_dmem_for_numba()`` sets it as the memory resource of every
device numba-cuda uses, which is where numba-cuda (0.25 and later) puts the
device copies of host arrays passed to a kernel.

cuda.core's interface is Python, so each allocation costs a Python call
(docs/integrations.md has the figure). Importing this module imports
neither cuda.core nor CUDA; ``MemoryResource`` is made on first access and
raises ImportError naming cuda.core when it is missing.
"""

import threading

__all__ = ["MemoryResource"]

_cls = None
_mu = threading.Lock()


def _import_cuda_core():
    try:
        from cuda.core import Buffer, MemoryResource
    except ImportError as e:
        raise ImportError(f"dmem.cuda_core needs cuda.core (the package 'cuda-core'): {e}") from e
    return Buffer, MemoryResource


def _stream_obj(stream):
    """What dmem's device_malloc takes for a cuda.core stream argument: None
    (the default stream), or the object itself (a cuda.core Stream, any
    object with __cuda_stream__, an int cudaStream_t). A GraphBuilder
    allocates on the stream it captures."""
    if stream is None or (isinstance(stream, int) and not isinstance(stream, bool) and
                          stream == 0):
        return None
    inner = getattr(stream, "stream", None)  # cuda.core GraphBuilder
    if inner is not None and not hasattr(stream, "__cuda_stream__"):
        return inner
    return stream


def _core_streams():
    """cuda.core's stream classes (Stream, GraphBuilder)."""
    import cuda.core as cc

    return tuple(c for c in (getattr(cc, "Stream", None), getattr(cc, "GraphBuilder", None))
                 if isinstance(c, type))


def _same_stream(a, b):
    def handle(s):
        if s is None:
            return 0
        if isinstance(s, int):
            return s
        proto = getattr(s, "__cuda_stream__", None)
        if proto is not None:
            return int(proto()[1])
        return int(getattr(s, "handle", 0) or 0)

    try:
        return handle(a) == handle(b)
    except (TypeError, ValueError):
        return False


def _build():
    Buffer, Base = _import_cuda_core()
    import dmem

    class DmemMemoryResource(Base):
        """cuda.core MemoryResource over dmem.default_runtime(device)."""

        def __init__(self, device=None):
            if device is None:
                device = _current_device()
            if isinstance(device, bool) or not isinstance(device, int):
                d = getattr(device, "device_id", None)  # a cuda.core Device
                if not isinstance(d, int):
                    raise TypeError(f"device must be an int, a cuda.core Device or None, not "
                                    f"{type(device).__name__}")
                device = d
            if device < 0:
                raise ValueError(f"device must be >= 0, not {device}")
            self._device = device
            self._rt = dmem.default_runtime(device)
            self._live = {}  # address -> dmem.DeviceMemory
            self._mu = threading.Lock()

        def allocate(self, size, stream=None):
            """A Buffer of size bytes for use on stream (None or 0: the
            default stream; a cuda.core Stream or GraphBuilder, a numba-cuda
            stream, any object with __cuda_stream__, an int cudaStream_t),
            given back through deallocate when closed or collected.
            cuda.core passes the stream by keyword, Device.allocate by
            position: both are taken."""
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"size must be an int, not {type(size).__name__}")
            if size < 0:
                raise ValueError(f"size must be >= 0, not {size}")
            # Buffer.from_handle takes cuda.core's own streams only (else it
            # orders the deallocation on the default stream)
            owner_stream = stream if isinstance(stream, _core_streams()) else None
            if size == 0:
                return Buffer.from_handle(0, 0, mr=self, stream=owner_stream)
            mem = self._rt.device_malloc(size, _stream_obj(stream))
            with self._mu:
                self._live[mem.ptr] = mem
            return Buffer.from_handle(mem.ptr, size, mr=self, stream=owner_stream)

        def deallocate(self, ptr, size, stream=None):
            """Give ptr back to dmem. Its last use must be enqueued on stream
            or on the stream it was allocated for: freed in that stream's
            order (another stream is waited for first; if that wait fails,
            the error is raised and the buffer stays allocated). 0 does
            nothing; a pointer this resource did not give raises ValueError."""
            addr = int(ptr)
            if addr == 0:
                return
            with self._mu:
                mem = self._live.pop(addr, None)
            if mem is None:
                raise ValueError(f"deallocate: {addr:#x} is not a live allocation of this "
                                 "resource")
            if stream is not None and not _same_stream(_stream_obj(stream), mem.stream):
                # dmem frees in the order of the allocation's stream: let
                # that order include the work on this one
                try:
                    self._rt.synchronize(_stream_obj(stream))
                except BaseException:
                    with self._mu:
                        self._live[addr] = mem  # still allocated: the caller may retry
                    raise
            mem.free()

        @property
        def is_device_accessible(self):
            return True

        @property
        def is_host_accessible(self):
            return False

        @property
        def is_managed(self):
            return False

        @property
        def device_id(self):
            return self._device

        @property
        def runtime(self):
            """The dmem runtime allocations come from."""
            return self._rt

        def __repr__(self):
            return f"dmem.cuda_core.MemoryResource(device={self._device})"

    DmemMemoryResource.__name__ = DmemMemoryResource.__qualname__ = "MemoryResource"
    DmemMemoryResource.__module__ = __name__
    return DmemMemoryResource


def _current_device():
    """cuda.core's current device (device 0 when no context is current)."""
    from cuda.core import Device

    return Device().device_id


def _resource_class():
    global _cls
    with _mu:
        if _cls is None:
            _cls = _build()
        return _cls


def __getattr__(name):
    if name == "MemoryResource":
        return _resource_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
