"""examples/use_cuda_core.py - dmem as a cuda.core memory resource.

    PYTHONPATH=build/gpu/python python3 examples/use_cuda_core.py

Needs cuda.core and a GPU: exit 77 without them (scripts/gpu-test runs it).
"""
import sys

try:
    from cuda.core import Device

    Device(0)
except Exception as e:  # noqa: BLE001 - cuda.core, its bindings or the device missing
    print(f"use_cuda_core: skipped: {type(e).__name__}: {e}")
    sys.exit(77)

n = 1 << 20
# [example]
from cuda.core import Device
import dmem.cuda_core
dev = Device(0)
dev.set_current()
mr = dmem.cuda_core.MemoryResource(0)
buf = mr.allocate(n, stream=dev.default_stream)      # a cuda.core Buffer
dev.memory_resource = mr                             # Device.allocate uses it
# [example]

import dmem

raw = dmem.default_runtime().stats()["raw_used"]
assert raw >= n, raw
buf.close(dev.default_stream)
print(f"use_cuda_core: OK, dmem raw_used was {raw} B")
