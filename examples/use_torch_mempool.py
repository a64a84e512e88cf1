"""examples/use_torch_mempool.py - a torch.cuda.MemPool over dmem.

    PYTHONPATH=build/gpu/python python3 examples/use_torch_mempool.py

Needs PyTorch (2.8 or later) with CUDA and a GPU: exit 77 without them
(scripts/gpu-test runs it).
"""
import sys

try:
    import torch
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "MemPool"):
        raise ImportError("torch without CUDA, a device or torch.cuda.MemPool")
except ImportError as e:
    print(f"use_torch_mempool: skipped: {e}")
    sys.exit(77)

n = 1 << 20
# [example]
import torch, dmem.torch
pool = dmem.torch.mempool(0)                 # a torch.cuda.MemPool over dmem
with torch.cuda.use_mem_pool(pool):
    x = torch.empty(n, device="cuda:0")      # from dmem
y = torch.empty(n, device="cuda:0")          # PyTorch's own
# [example]

import dmem

raw = dmem.default_runtime(0).stats()["raw_used"]
assert raw >= x.numel() * 4, raw
print(f"use_torch_mempool: OK, dmem raw_used {raw} B")
