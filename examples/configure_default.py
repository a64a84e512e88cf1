"""examples/configure_default.py - configure the process-wide runtime that
Numba, CuPy, PyTorch and Dask share, before its first use.

    PYTHONPATH=build/default/python python3 examples/configure_default.py

Runs on either backend (DMEM_BACKEND=host without a GPU).
"""
import os
import tempfile

import dmem

scratch = tempfile.mkdtemp()  # stands for a fast local disk, such as /scratch
try:
    # [example]
    dmem.configure(device_limit="90%", host_limit="8G", spill_dir=scratch)
    # [example]
    rt = dmem.default_runtime()
    s = rt.stats()
    assert 0 < s["device_limit"] <= s["device_capacity"], s
    print(f"configure_default: OK, {rt.backend} backend, device limit {s['device_limit']} B")
finally:
    os.rmdir(scratch)
