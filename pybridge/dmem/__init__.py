"""dmem: spillable GPU memory.

    import dmem
    with dmem.Runtime(backend="host", host_capacity=64 << 20) as rt:
        buf = rt.alloc(1 << 20)
        buf.write(b"hello")
        buf.spill("host")
        assert buf.read(5) == b"hello"
        with buf.lock() as view:
            ...  # view.ptr, view.__dlpack__(), __cuda_array_interface__ (CUDA)

One runtime per device is shared by the whole process:
``dmem.default_runtime(device=None)`` (the runtime behind the C symbols
dmem_runtime_default, dmem_torch_alloc and dmem_torch_free, and behind the
allocator hooks ``dmem.numba``, ``dmem.cupy`` and ``dmem.torch``), created on
first use from ``dmem.configure(...)`` or the DMEM_* environment.

Errors are dmem.DmemError subclasses carrying ``.status``, ``.name`` and
``.detail``. Using a view outside its ``with`` block raises NotLockedError;
using a freed Buffer (or one whose runtime was closed) raises StaleHandleError;
methods of a closed Runtime or Stream raise ValueError. An exception raised by a
launch function (``lock_and_launch``/``launch_async``) propagates unchanged; one
raised by a controller callback surfaces as CallbackError (``__cause__`` is the
original).

In a child made by ``os.fork()`` the runtimes inherited from the parent are
unusable (their threads and device context are not in the child): every call
on them and their objects raises ForkedError, and close() does nothing. The
child may create runtimes of its own; ``dmem.default_runtime()`` gives it a
new one.
"""

import atexit as _atexit
import os as _os

from . import _dmem
from ._dmem import (
    Buffer,
    BusyError,
    CallbackError,
    ConfigError,
    DeviceError,
    DeviceMemory,
    DeviceFatalError,
    DmemError,
    ForkedError,
    HostOutOfMemoryError,
    InvalidArgumentError,
    NoDeviceError,
    NotLockedError,
    OutOfMemoryError,
    Runtime,
    SpillIOError,
    StaleHandleError,
    Stream,
    View,
    configure,
    default_runtime,
    status_name,
)
from .controller import Controller
from ._report import report

_dmem._set_controller_base(Controller)
# Close runtimes still open at exit (removes their spill directories).
_atexit.register(_dmem._shutdown)
# A forked child has none of the runtime's threads: its runtimes are disowned
# (every call on them, their Buffers, Streams and views raises ForkedError
# there; close() does nothing) instead of destroyed.
if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_dmem._after_fork_child)

__version__ = "%d.%d.%d" % (_dmem.VERSION_MAJOR, _dmem.VERSION_MINOR, _dmem.VERSION_PATCH)

__all__ = [
    "Buffer",
    "BusyError",
    "CallbackError",
    "ConfigError",
    "Controller",
    "DeviceError",
    "DeviceMemory",
    "DeviceFatalError",
    "DmemError",
    "ForkedError",
    "HostOutOfMemoryError",
    "InvalidArgumentError",
    "NoDeviceError",
    "NotLockedError",
    "OutOfMemoryError",
    "Runtime",
    "SpillIOError",
    "StaleHandleError",
    "Stream",
    "View",
    "configure",
    "default_runtime",
    "report",
    "status_name",
]
