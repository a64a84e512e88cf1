"""examples/use_rmm.py - dmem as RMM's current device resource.

    PYTHONPATH=build/gpu/python python3 examples/use_rmm.py

Needs RMM, a dmem built with RMM's headers (dmem._rmm) and a GPU: exit 77
without them (scripts/gpu-test runs it).
"""
import sys

try:
    import rmm
    import dmem._rmm  # noqa: F401  (built only with RMM's headers)
    from rmm._cuda.gpu import getDeviceCount

    if getDeviceCount() < 1:
        raise ImportError("no CUDA device")
except Exception as e:  # noqa: BLE001 - RMM, its CUDA bindings or the device missing
    print(f"use_rmm: skipped: {type(e).__name__}: {e}")
    sys.exit(77)

# [example]
import dmem.rmm
dmem.rmm.use_dmem_for_rmm()                  # RMM's current device; or device=N
# [example]

import dmem

b = rmm.DeviceBuffer(size=1 << 20)
raw = dmem.default_runtime().stats()["raw_used"]
assert raw >= b.size, raw
print(f"use_rmm: OK, dmem raw_used {raw} B")
