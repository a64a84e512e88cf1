"""examples/use_torch.py - dmem as PyTorch's CUDA allocator.

    PYTHONPATH=build/default/python python3 examples/use_torch.py

Needs PyTorch with CUDA and a GPU: exit 77 without them (scripts/gpu-test
runs it). examples/torch_pluggable.py does the same through the C symbols
with ctypes only.
"""
import sys

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("torch without CUDA or without a device")
except ImportError as e:
    print(f"use_torch: skipped: {e}")
    sys.exit(77)

# [example]
import torch, dmem.torch
dmem.torch.use_dmem_for_torch()          # every device; or use_dmem_for_torch(device)
# [example]

import dmem

a = torch.ones(1 << 20, device="cuda")
raw = dmem.default_runtime().stats()["raw_used"]
assert raw >= a.numel() * 4, raw
assert float(a.sum()) == float(1 << 20)
print(f"use_torch: OK, dmem raw_used {raw} B")
