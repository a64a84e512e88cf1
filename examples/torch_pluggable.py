"""dmem as PyTorch's CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator).

    python3 examples/torch_pluggable.py path/to/libdmem.so

Every tensor's memory then comes from the process-wide dmem runtime of the
device (dmem_runtime_default: DMEM_DEVICE_LIMIT and the other DMEM_*
variables apply). Runs a few matmuls, checks them against the CPU, and prints
dmem's accounting, read through the C API with ctypes. Exit 0 on success.
"""
import ctypes
import sys

import torch


class Stats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "device_capacity", "device_limit", "device_used", "device_locked", "device_pinned",
        "host_used", "disk_used", "controller_used", "buffer_count")] + [
        (n, ctypes.c_uint64) for n in ("spill_count", "unspill_count", "bytes_spilled",
                                      "bytes_unspilled")] + [
        ("seconds_spilling", ctypes.c_double), ("seconds_unspilling", ctypes.c_double),
        ("oom_evictions", ctypes.c_uint64), ("cancelled_spills", ctypes.c_uint64),
        ("device_reserved", ctypes.c_size_t), ("raw_used", ctypes.c_size_t),
        ("pool_hits", ctypes.c_uint64), ("pool_misses", ctypes.c_uint64)]


def main():
    lib_path = sys.argv[1] if len(sys.argv) > 1 else "libdmem.so"
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "dmem_torch_alloc",
                                                      "dmem_torch_free")
    torch.cuda.memory.change_current_allocator(alloc)
    lib = ctypes.CDLL(lib_path)
    rt = ctypes.c_void_p()
    stats = Stats()

    def dmem_stats():
        if lib.dmem_runtime_default(0, ctypes.byref(rt)) != 0:
            raise RuntimeError("dmem_runtime_default failed")
        if lib.dmem_stats(rt, ctypes.byref(stats)) != 0:
            raise RuntimeError("dmem_stats failed")
        return stats

    torch.manual_seed(0)
    a_cpu, b_cpu = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a, b = a_cpu.cuda(), b_cpu.cuda()
    s = dmem_stats()
    assert s.raw_used >= 2 * 1024 * 1024 * 4, s.raw_used
    for _ in range(5):
        c = a @ b
    torch.cuda.synchronize()
    err = (c.cpu() - a_cpu @ b_cpu).abs().max().item()
    assert err < 1e-2, err
    s = dmem_stats()
    print(f"torch_pluggable: matmul max error {err:.2e}; dmem raw_used {s.raw_used} B, "
          f"reserved {s.device_reserved} B, pool hits {s.pool_hits}, misses {s.pool_misses}")
    del a, b, c
    torch.cuda.synchronize()
    print("torch_pluggable: OK")


if __name__ == "__main__":
    main()
