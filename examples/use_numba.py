"""examples/use_numba.py - dmem as Numba's CUDA memory manager (EMM plugin).

    PYTHONPATH=build/default/python python3 examples/use_numba.py

Needs numba-cuda and a GPU: exit 77 without them (scripts/gpu-test runs it).
"""
import sys

try:
    import numpy as np
    from numba import cuda
    if not cuda.is_available():
        raise ImportError("no CUDA device for Numba")
except ImportError as e:
    print(f"use_numba: skipped: {e}")
    sys.exit(77)

import dmem

# [example]
import dmem.numba
dmem.numba.use_dmem_for_numba()          # before Numba's first CUDA use
# [example]

a = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
raw = dmem.default_runtime().stats()["raw_used"]
assert raw >= a.nbytes, raw
assert (a.copy_to_host() == np.arange(1 << 20, dtype=np.float32)).all()
print(f"use_numba: OK, dmem raw_used {raw} B")
