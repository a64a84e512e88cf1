"""examples/python_buffers.py - the README's Python example: a spillable
buffer, written, spilled, locked for an array library, read where it lies.

    PYTHONPATH=build/default/python python3 examples/python_buffers.py

Runs on either backend: on the host backend (no GPU; DMEM_BACKEND=host) the
locked view is host memory and NumPy reads it; on the CUDA backend it is
device memory and CuPy does (exit 77 when CuPy is missing there). Exit 0 when
every check passes.
"""
import sys

import dmem

try:
    with dmem.Runtime(device_limit="64M") as probe:
        backend = probe.backend
    xp = __import__("cupy" if backend == "cuda" else "numpy")
except ImportError as e:
    print(f"python_buffers: skipped: {e}")
    sys.exit(77)

# [example]
with dmem.Runtime(device_limit="64M") as rt:  # cupy on the CUDA backend, numpy on the host one
    buf = rt.alloc(1 << 20)
    buf.write(b"\x01" * (1 << 20))
    buf.spill("host")                 # or "disk", or "controller"
    with buf.lock() as view:          # the only way to get a pointer
        arr = xp.asarray(view)        # __cuda_array_interface__ / buffer protocol / __dlpack__
        arr += 1
    assert buf.read(4) == b"\x02" * 4
    assert buf.exposed                # arr (and view, its owner) keep it locked
    del arr, view                     # ... until they are collected
    buf.spill("disk")
    assert buf.peek(4) == b"\x02" * 4  # read where it is: stays on disk
# [example]
    assert not buf.exposed
    print(f"python_buffers: OK on the {rt.backend} backend ({xp.__name__})")
