"""examples/use_cupy.py - dmem as CuPy's allocator.

    PYTHONPATH=build/default/python python3 examples/use_cupy.py

Needs CuPy and a GPU: exit 77 without them (scripts/gpu-test runs it).
"""
import sys

try:
    import cupy
    cupy.cuda.runtime.getDeviceCount()
except Exception as e:  # ImportError, or CuPy without a device
    print(f"use_cupy: skipped: {type(e).__name__}: {e}")
    sys.exit(77)

# [example]
import cupy, dmem.cupy
cupy.cuda.set_allocator(dmem.cupy.allocator)     # or dmem.cupy.use_dmem_for_cupy()
# [example]

import dmem

a = cupy.arange(1 << 20, dtype=cupy.float32)
raw = dmem.default_runtime().stats()["raw_used"]
assert raw >= a.nbytes, raw
assert float((a * 2).sum()) == float(2 * cupy.arange(1 << 20, dtype=cupy.float64).sum())
print(f"use_cupy: OK, dmem raw_used {raw} B")
