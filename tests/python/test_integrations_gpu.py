"""dmem behind Numba, CuPy and PyTorch on a GPU (skipped without one, and
per library when it does not import):

- one process runs a Numba kernel, a CuPy computation and 20 PyTorch MLP
  training steps through dmem, and the results equal those of the same job
  with the libraries' own allocators (integrations_gpu_job.py, which also
  checks the imports make no CUDA context, the accounting, and spillable
  buffers spilled to make room for the three under one device limit);
- IPC: a Numba array exported with DmemNumbaManager.get_ipc_handle (a pool
  slab's handle and the array's offset in it) is opened in a child process
  and read correctly;
- the CuPy allocator takes the C path (CuPy's exported C functions), allocates
  on CuPy's current stream, and survives the stream's destruction;
- NUMBA_CUDA_MEMORY_MANAGER=dmem.numba makes Numba use the plugin;
- issue 24: RMM with dmem as its current resource (rmm.DeviceBuffer, an
  adaptor, CuPy through rmm_cupy_allocator, out of memory, spillable
  buffers spilled for an RMM allocation and read back intact), cuda.core's
  MemoryResource, numba-cuda's kernel-argument copies of host arrays, and
  dmem.torch.mempool (OOM, CUDA graph capture).

Run on the GPU machine: scripts/gpu-test (step python-integrations), or
PYTHONPATH=build/gpu/python python3 -m pytest -v tests/python/test_integrations_gpu.py
"""

import os
import subprocess
import sys
import tempfile

import pytest

import dmem
from conftest import gpu_env, run_python

HERE = os.path.dirname(os.path.abspath(__file__))


def _cuda_ok():
    r = run_python("""
        import dmem
        rt = dmem.Runtime(backend="cuda", device_limit=1 << 20)
        assert rt.backend == "cuda"
    """, env_extra={"DMEM_BACKEND": ""})
    return r.returncode == 0, r.stderr.strip().splitlines()[-1:] or [""]


_ok, _why = _cuda_ok()
pytestmark = pytest.mark.skipif(not _ok, reason=f"no CUDA device for dmem: {_why[0]}")


def _has(mod):
    r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True)
    return r.returncode == 0


env = gpu_env


def job(mode, out):
    r = subprocess.run([sys.executable, os.path.join(HERE, "integrations_gpu_job.py"), mode, out],
                       capture_output=True, text=True, timeout=300, env=env())
    print(f"---- {mode} ----\n{r.stdout}{r.stderr[-3000:]}")
    assert r.returncode == 0, f"{mode} job failed:\n{r.stdout}\n{r.stderr[-5000:]}"
    return r.stdout


def test_three_libraries_through_dmem_match_their_own_allocators():
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        ref, got = os.path.join(d, "default.npz"), os.path.join(d, "dmem.npz")
        job("default", ref)
        out = job("dmem", got)
        assert "imports: no CUDA context" in out or "context check skipped" in out
        assert "buffers read back intact" in out
        a, b = np.load(ref), np.load(got)
        assert sorted(a.files) == sorted(b.files) and a.files, (a.files, b.files)
        for k in a.files:
            if a[k].dtype.kind in "iu" or k == "numba_axpb":
                assert np.array_equal(a[k], b[k]), k
            elif k.startswith("torch"):  # 20 SGD steps: atomics in backward may reorder sums
                np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
            else:  # same GPU, same kernels: equal up to reduction order at most
                np.testing.assert_allclose(b[k], a[k], rtol=1e-9, atol=1e-12, err_msg=k)


IPC_PARENT = r"""
import multiprocessing as mp, os, sys
import numpy as np
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
import dmem, dmem.numba
from numba import cuda
dmem.numba.use_dmem_for_numba()
DEDICATED = os.environ.get("DMEM_NUMBA_DEDICATED", "1") != "0"

def child(q, out):
    import numpy as np
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack
    from numba import cuda
    kind, h, n = q.get()
    if kind == "bytes":  # the bare handle, opened at offset 0 (numba's own test)
        with cuda.open_ipc_array(h, shape=n, dtype=np.int32) as arr:
            out.put(arr.copy_to_host().tobytes())
    else:
        with h as arr:
            out.put(arr.copy_to_host().tobytes())

if __name__ == "__main__":
    mm = cuda.current_context().memory_manager
    assert type(mm).__name__ == "DmemNumbaManager"
    data = np.arange(1 << 16, dtype=np.int32) * 3
    xs = [cuda.to_device(data) for _ in range(3)]
    raws = [mm.get_ipc_handle(x.gpu_data) for x in xs]
    from numba.cuda.cudadrv import driver
    if DEDICATED:
        # each array is its own allocation: offset 0, and the driver's extent
        # of the pointer is the array's block, not a shared slab
        assert [r.offset for r in raws] == [0, 0, 0], [r.offset for r in raws]
        for x in xs:
            s, e = driver.device_extents(x)
            assert s == x.device_ctypes_pointer.value and x.nbytes <= e - s <= x.nbytes * 5 // 4 + 256
        k = 1
        msg = (("bytes", raws[k].handle.reserved, data.size), ("handle", xs[k].get_ipc_handle(), 0))
    else:
        # three arrays from one pool slab: at most one of them starts it
        k = max(range(3), key=lambda i: raws[i].offset)
        assert raws[k].offset > 0, [r.offset for r in raws]   # the pool offset is carried
        msg = (("handle", xs[k].get_ipc_handle(), 0),)
    assert raws[k].size == xs[k].nbytes
    ctx = mp.get_context("spawn")
    for m in msg:
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, out))
        p.start()
        q.put(m)
        got = out.get(timeout=120)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        assert got == data.tobytes(), m[0]
    print("ipc ok, offset", raws[k].offset)
"""


@pytest.mark.skipif(not _has("numba.cuda"), reason="numba-cuda not installed")
@pytest.mark.parametrize("dedicated", ["1", "0"])
def test_numba_ipc_handle_opened_in_child_process(dedicated):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ipc_job.py")
        with open(path, "w") as f:
            f.write(IPC_PARENT)
        e = env()
        e["DMEM_NUMBA_DEDICATED"] = dedicated
        r = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300,
                           env=e, cwd=d)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    assert "ipc ok" in r.stdout


@pytest.mark.skipif(not _has("numba.cuda"), reason="numba-cuda not installed")
def test_numba_memory_manager_environment_variable():
    e = env()
    e["NUMBA_CUDA_MEMORY_MANAGER"] = "dmem.numba"
    r = subprocess.run([sys.executable, "-c", """
import numpy as np
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
from numba import cuda
import dmem
a = cuda.to_device(np.ones(4096, dtype=np.float64))
mm = cuda.current_context().memory_manager
assert type(mm).__name__ == "DmemNumbaManager", type(mm)
assert mm.interface_version == 1
assert dmem.default_runtime(0).stats()["raw_used"] >= a.nbytes
with cuda.defer_cleanup():
    b = cuda.device_array(1 << 20)
    used = dmem.default_runtime(0).stats()["raw_used"]
    del b
    assert dmem.default_runtime(0).stats()["raw_used"] == used   # held back
assert dmem.default_runtime(0).stats()["raw_used"] == used - 8 * (1 << 20)
cuda.current_context().reset()                                    # frees this context's arrays
assert dmem.default_runtime(0).stats()["raw_used"] == 0
print("env ok")
"""], capture_output=True, text=True, timeout=300, env=e)
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]


@pytest.mark.skipif(not _has("cupy"), reason="CuPy not installed")
def test_cupy_allocator_c_path_and_streams():
    r = subprocess.run([sys.executable, "-c", """
import cupy as cp, dmem, dmem.cupy, gc
assert dmem.cupy.allocator.uses_c_api, "CuPy's C functions were not found"
dmem.cupy.use_dmem_for_cupy()
rt = dmem.default_runtime(0)
for _ in range(3):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.arange(1 << 20, dtype=cp.float32)
        owner = a.data.mem._owner
        assert owner.stream == s.ptr, (owner.stream, s.ptr)   # CuPy's current stream
        b = (a * 2).sum()
    s.synchronize()
    assert float(b) == float((1 << 20) * ((1 << 20) - 1)), float(b)
    del s, owner        # the stream object lives until `a` is freed
    gc.collect()
    del a, b
    gc.collect()
assert rt.stats()["raw_used"] == 0, rt.stats()["raw_used"]
x = cp.zeros(0)
assert x.data.ptr == 0
print("cupy ok")
"""], capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]


@pytest.mark.skipif(not _has("torch"), reason="PyTorch not installed")
def test_torch_allocator_accounting():
    r = subprocess.run([sys.executable, "-c", """
import torch, dmem, dmem.torch
dmem.torch.use_dmem_for_torch()
rt = dmem.default_runtime(0)
a = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
assert rt.stats()["raw_used"] >= 4 << 20, rt.stats()
assert torch.cuda.memory_allocated() >= 4 << 20  # PyTorch's own accounting covers it
ptr = a.data_ptr()
del a
torch.cuda.synchronize()
# PyTorch keeps the freed segment in its pool; empty_cache gives it to dmem
assert dmem.torch.empty_cache() == [0]
torch.cuda.synchronize()
assert rt.stats()["raw_used"] < 4 << 20, rt.stats()
b = torch.ones(1 << 20, device="cuda")  # the new pool serves as the old one did
assert rt.stats()["raw_used"] >= 4 << 20 and float(b.sum()) == 1 << 20
# PyTorch's own empty_cache aborts the process while allocations are routed
# to a pool: dmem.torch makes torch.cuda.empty_cache its own, which is safe
del b
torch.cuda.empty_cache()
torch.cuda.synchronize()
assert rt.stats()["raw_used"] < 4 << 20, rt.stats()
c = torch.ones(1 << 20, device="cuda")
assert float(c.sum()) == 1 << 20
print("torch ok")
"""], capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]


_OOM_WORDS = ("raw", "locked", "spillable", "free", "device limit")


@pytest.mark.skipif(not _has("torch"), reason="PyTorch not installed")
def test_torch_out_of_memory_raises_and_the_process_goes_on():
    """Past dmem's limit PyTorch raises torch.OutOfMemoryError (not a tensor
    at address 0), saying how the limit is used; the next smaller allocation
    works, spillable buffers are spilled to make room for it, and allocations
    from autograd's threads go through dmem too."""
    r = subprocess.run([sys.executable, "-c", """
import threading
import torch, dmem, dmem.torch
dmem.configure(device_limit="2GiB")
dmem.torch.use_dmem_for_torch()
rt = dmem.default_runtime(0)
try:
    x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
    raise SystemExit(f"no error: data_ptr {x.data_ptr():#x}")
except torch.OutOfMemoryError as e:
    msg = str(e)
for w in %r:
    assert w in msg, (w, msg)
print("oom:", msg[:400])
# the process goes on: a smaller allocation works and is usable
b = torch.ones(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
assert b.data_ptr() != 0 and float(b.sum()) == float(1 << 28)
# a spillable buffer makes room for a tensor
buf = rt.alloc(768 << 20)
with buf.lock():
    pass
c = torch.zeros(768 << 20, dtype=torch.uint8, device="cuda")
assert buf.state != "resident", buf.state
assert int(c.max()) == 0   # uint8: sum() would promote to an int64 copy (6 GiB)
del b, c
# twice in a row, from another thread too
errs = []
def grab():
    try:
        torch.empty(5 << 30, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        errs.append(e)
t = threading.Thread(target=grab); t.start(); t.join()
assert len(errs) == 1 and "spillable" in str(errs[0]), errs
# autograd's backward threads allocate through dmem (raw_used grows past the cache)
dmem.torch.empty_cache()
before = rt.stats()["raw_used"]
m = torch.nn.Linear(4096, 4096).cuda()
y = m(torch.randn(2048, 4096, device="cuda")).sum()
y.backward()
torch.cuda.synchronize()
assert m.weight.grad is not None and rt.stats()["raw_used"] > before, rt.stats()
print("torch oom ok")
""" % (_OOM_WORDS,)], capture_output=True, text=True, timeout=300, env=env())
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0 and "torch oom ok" in r.stdout, r.stdout + r.stderr[-5000:]


@pytest.mark.skipif(not _has("cupy") or not _has("numba"), reason="CuPy or Numba not installed")
def test_cupy_and_numba_out_of_memory_say_how_the_limit_is_used():
    r = subprocess.run([sys.executable, "-c", """
import dmem, dmem.cupy, dmem.numba
dmem.configure(device_limit="1GiB")
dmem.numba.use_dmem_for_numba()
dmem.cupy.use_dmem_for_cupy()
import cupy as cp
from numba import cuda
keep = cp.ones(256 << 20, dtype=cp.uint8)
for what, grab in (("cupy", lambda: cp.empty(2 << 30, dtype=cp.uint8)),
                   ("numba", lambda: cuda.device_array(2 << 30, dtype="u1"))):
    try:
        grab()
        raise SystemExit(what + ": no error")
    except MemoryError as e:
        msg = str(e)
    for w in %r:
        assert w in msg, (what, w, msg)
    assert "raw 256.00 MiB" in msg, (what, msg)
    print(what, "oom:", msg[:300])
small = cp.zeros(1 << 20, dtype=cp.uint8)  # and the next one works
assert int(small.sum()) == 0
print("cupy numba oom ok")
""" % (_OOM_WORDS,)], capture_output=True, text=True, timeout=300, env=env())
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0 and "cupy numba oom ok" in r.stdout, r.stdout + r.stderr[-5000:]


# ---- issue 24: RMM, cuda.core, numba-cuda's kernel-argument copies, PyTorch's MemPool ----------

def _has_dmem_rmm():
    r = subprocess.run([sys.executable, "-c", "import rmm, dmem._rmm"], capture_output=True,
                       env=env())
    return r.returncode == 0


def _run(code, marker, timeout=300):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, env=env())
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0 and marker in r.stdout, r.stdout + r.stderr[-5000:]
    return r.stdout


@pytest.mark.skipif(not _has_dmem_rmm(), reason="RMM, or dmem._rmm (RMM's headers at build), missing")
def test_rmm_device_buffer_and_cupy_through_dmem():
    """rmm.DeviceBuffer, RMM's adaptors and CuPy through rmm_cupy_allocator
    allocate from dmem once use_dmem_for_rmm made it the current resource;
    out of memory is RMM's MemoryError with dmem's detail."""
    _run("""
import gc
import rmm, rmm.mr, dmem, dmem.rmm
dmem.configure(device_limit="1GiB")
mr = dmem.rmm.use_dmem_for_rmm()
assert rmm.mr.get_current_device_resource() is mr, rmm.mr.get_current_device_resource()
assert dmem.rmm.use_dmem_for_rmm() is mr                  # again: the same one
assert isinstance(mr, rmm.mr.DeviceMemoryResource) and mr.device == 0
rt = dmem.default_runtime(0)
assert mr.runtime is rt
b = rmm.DeviceBuffer(size=8 << 20)
assert rt.stats()["raw_used"] >= 8 << 20, rt.stats()["raw_used"]
data = bytes(range(256)) * 4096
c = rmm.DeviceBuffer.to_device(data)
assert c.tobytes() == data
del b, c
gc.collect()
from rmm.pylibrmm.stream import DEFAULT_STREAM
DEFAULT_STREAM.synchronize()
assert rt.stats()["raw_used"] == 0, rt.stats()["raw_used"]
p = mr.allocate(4096)                                      # the Python methods go to C++
assert p % 256 == 0 and rt.stats()["raw_used"] == 4096
mr.deallocate(p, 4096)
assert rt.stats()["raw_used"] == 0
# an adaptor over dmem: RMM counts, dmem holds the bytes
st = rmm.mr.StatisticsResourceAdaptor(mr)
d = rmm.DeviceBuffer(size=3 << 20, mr=st)
assert st.allocation_counts.current_bytes == 3 << 20 and rt.stats()["raw_used"] >= 3 << 20
del d
gc.collect()
# out of memory past dmem's limit: MemoryError with dmem's detail; then it goes on
try:
    rmm.DeviceBuffer(size=2 << 30)
    raise SystemExit("no error")
except MemoryError as e:
    assert "DMEM_ERR_OUT_OF_MEMORY" in str(e), str(e)
e = rmm.DeviceBuffer(size=1 << 20)
assert rt.stats()["raw_used"] >= 1 << 20
del e
# a stream of its own, forgotten by dmem before it is destroyed
from rmm.pylibrmm.stream import Stream
s = Stream()
f = rmm.DeviceBuffer(size=1 << 20, stream=s)
del f
dmem.rmm.forget_stream(s)
s.synchronize()
del s
gc.collect()
try:
    import cupy as cp
except ImportError:
    print("cupy not installed: rmm_cupy_allocator not run")
else:
    from rmm.allocators.cupy import rmm_cupy_allocator
    cp.cuda.set_allocator(rmm_cupy_allocator)
    gc.collect()
    before = rt.stats()["raw_used"]
    a = cp.arange(1 << 21, dtype=cp.float64)               # 16 MiB, an exact sum
    assert rt.stats()["raw_used"] >= before + (16 << 20), rt.stats()["raw_used"]
    assert float(a.sum()) == float((1 << 21) * ((1 << 21) - 1) // 2), float(a.sum())
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones(1 << 20, dtype=cp.float64)
        assert float(x.sum()) == 1 << 20
    s.synchronize()
    del a, x
    gc.collect()
    cp.cuda.Device().synchronize()
    assert rt.stats()["raw_used"] == before, (rt.stats()["raw_used"], before)
    print("rmm_cupy_allocator ok")
print("rmm ok")
""", "rmm ok")


@pytest.mark.skipif(not _has_dmem_rmm(), reason="RMM, or dmem._rmm (RMM's headers at build), missing")
def test_rmm_allocation_spills_dmem_buffers_whose_bytes_survive():
    _run("""
import numpy as np
import rmm, dmem, dmem.rmm
dmem.configure(device_limit="512MiB")
dmem.rmm.use_dmem_for_rmm()
rt = dmem.default_runtime(0)
bufs, pats = [], []
for i in range(6):                                         # 384 MiB of spillable buffers
    pat = (np.arange(64 << 20, dtype=np.uint64) * (i + 3)).astype(np.uint8).tobytes()
    b = rt.alloc(64 << 20)
    b.write(pat)
    bufs.append(b)
    pats.append(pat)
spilled = rt.stats()["spill_count"]
big = rmm.DeviceBuffer(size=256 << 20)                     # needs room: dmem spills
s = rt.stats()
assert s["spill_count"] >= spilled + 2, (s["spill_count"], spilled)
assert sum(b.state != "resident" for b in bufs) >= 2, [b.state for b in bufs]
assert s["device_used"] <= 512 << 20 and s["raw_used"] >= 256 << 20, s
for b, pat in zip(bufs, pats):                              # back, byte for byte
    assert b.read() == pat
del big
print("rmm spill ok")
""", "rmm spill ok")


@pytest.mark.skipif(not _has("cuda.core"), reason="cuda.core not installed")
def test_cuda_core_memory_resource_allocates_from_dmem():
    _run("""
import gc
from cuda.core import Device
import dmem, dmem.cuda_core
dev = Device(0)
dev.set_current()
mr = dmem.cuda_core.MemoryResource(0)
assert mr.device_id == 0 and mr.is_device_accessible and not mr.is_host_accessible
rt = dmem.default_runtime(0)
s = dev.create_stream()
b = mr.allocate(1 << 20, stream=s)
assert int(b.handle) % 256 == 0 and b.size == 1 << 20
assert rt.stats()["raw_used"] == 1 << 20, rt.stats()["raw_used"]
b.close(s)
assert rt.stats()["raw_used"] == 0
# as the device's resource: Device.allocate (what numba-cuda calls) uses it
dev.memory_resource = mr
c = dev.allocate(3 << 20, stream=s)
assert rt.stats()["raw_used"] == 3 << 20
del c
gc.collect()
s.sync()
assert rt.stats()["raw_used"] == 0, rt.stats()["raw_used"]
try:
    mr.allocate(1 << 50, stream=s)
    raise SystemExit("no error")
except dmem.OutOfMemoryError:
    pass
print("cuda.core ok")
""", "cuda.core ok")


@pytest.mark.skipif(not _has("numba.cuda") or not _has("cuda.core"),
                    reason="numba-cuda or cuda.core not installed")
def test_numba_kernel_with_host_arrays_copies_them_through_dmem():
    """numba-cuda >= 0.25 copies host arrays passed to a kernel into memory
    of cuda.core's device resource, not through the EMM plugin:
    use_dmem_for_numba routes those too, so dmem's raw bytes rise during
    the call (and come back after)."""
    _run("""
import gc
import numpy as np
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
import dmem, dmem.numba
dmem.configure(device_limit="1GiB")
dmem.numba.use_dmem_for_numba()
from numba import cuda

@cuda.jit
def twice(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = x[i] * 2

n = 1 << 22                                                # 16 MiB each
x = np.arange(n, dtype=np.float32)
out = np.zeros_like(x)
cuda.current_context()                                     # the plugin's initialize
routes = dmem.numba.kernel_arg_copies()
print("kernel_arg_copies:", routes)
rt = dmem.default_runtime(0)
twice[(n + 255) // 256, 256](x[:256], out[:256])           # compile first
cuda.synchronize()
gc.collect()
s0 = rt.stats(reset_peaks=True)
twice[(n + 255) // 256, 256](x, out)
cuda.synchronize()
gc.collect()
s1 = rt.stats()
assert np.array_equal(out, x * 2)
allocs = (s1["pool_hits"] + s1["pool_misses"]) - (s0["pool_hits"] + s0["pool_misses"])
print("allocations", allocs, "raw peak", s1["raw_used_peak"], "raw now", s1["raw_used"])
assert routes.get(0) == "dmem", routes
assert allocs >= 2, allocs                                 # x and out
assert s1["raw_used_peak"] >= s0["raw_used"] + 2 * x.nbytes, (s1["raw_used_peak"], s0["raw_used"])
assert s1["raw_used"] <= s0["raw_used"], (s1["raw_used"], s0["raw_used"])
print("numba kernel args ok")
""", "numba kernel args ok")


@pytest.mark.skipif(not _has("torch"), reason="PyTorch not installed")
def test_torch_mempool_allocates_from_dmem_raises_oom_and_captures_graphs():
    """dmem.torch.mempool: tensors made under torch.cuda.use_mem_pool come from
    dmem, those outside from PyTorch; past dmem's limit torch.OutOfMemoryError;
    then CUDA graph capture into the pool (pool=pool.id) and its replay. If
    PyTorch refuses a pluggable pool for capture, the refusal must be a clean
    Python exception, after which allocation still works; the output says
    which happened."""
    out = _run("""
import torch, dmem, dmem.torch
dmem.configure(device_limit="2GiB")
rt = dmem.default_runtime(0)
pool = dmem.torch.mempool(0)
assert isinstance(pool, torch.cuda.MemPool)
with torch.cuda.use_mem_pool(pool):
    a = torch.ones(1 << 20, device="cuda")                  # 4 MiB from dmem
assert rt.stats()["raw_used"] >= 4 << 20, rt.stats()["raw_used"]
raw = rt.stats()["raw_used"]
b = torch.ones(1 << 20, device="cuda")                      # PyTorch's own
assert rt.stats()["raw_used"] == raw
assert float(a.sum()) == float(b.sum()) == 1 << 20
try:
    with torch.cuda.use_mem_pool(pool):
        torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
    raise SystemExit("no error")
except torch.OutOfMemoryError as e:
    print("oom:", str(e)[:200])
with torch.cuda.use_mem_pool(pool):
    c = torch.zeros(1 << 20, device="cuda")                 # and the next one works
assert float(c.sum()) == 0
# CUDA graph capture into dmem's pool: first with segments the pool holds
# already, then with one PyTorch must ask dmem for while the stream captures
del a, c
torch.cuda.synchronize()
static_in = torch.ones(1 << 16, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):                                     # warm up on the side stream
        y = static_in * 3
torch.cuda.current_stream().wait_stream(s)

def capture(what, body, check):
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, pool=pool.id):
            out = body()
    except Exception as e:  # noqa: BLE001
        print(f"graph capture ({what}): refused:", type(e).__name__, str(e)[:300])
        torch.cuda.synchronize()
        with torch.cuda.use_mem_pool(pool):
            d = torch.ones(1 << 20, device="cuda")         # the process goes on
        assert float(d.sum()) == 1 << 20
        print(f"graph capture ({what}): refused cleanly")
        return
    static_in.fill_(2)
    g.replay()
    torch.cuda.synchronize()
    check(out)
    print(f"graph capture ({what}): captured and replayed")

def check_small(out):
    assert float(out[0]) == 7.0 and float(out.sum()) == 7.0 * (1 << 16)

def check_big(out):
    assert float(out) == 2.0 * (32 << 20), float(out)

raw = rt.stats()["raw_used"]
capture("segments in the pool", lambda: static_in * 3 + 1, check_small)
capture("a new dmem segment", lambda: (static_in[:1].expand(32 << 20) * 1.0).sum(), check_big)
print("raw_used before / after the captures:", raw, rt.stats()["raw_used"])
print("torch mempool ok")
""", "torch mempool ok")
    assert out.count("graph capture (") == 2
