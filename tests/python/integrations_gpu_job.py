#!/usr/bin/env python3
"""One process, three libraries: a Numba kernel, a CuPy computation and a
PyTorch computation (an MLP's training steps), through dmem or through their
own allocators. Run by tests/python/test_integrations_gpu.py:

    python3 integrations_gpu_job.py default OUT.npz    # the libraries' own allocators
    python3 integrations_gpu_job.py dmem OUT.npz       # all three through dmem

Results go to OUT.npz for the test to compare. In `dmem` mode the job also
checks, and fails (exit 1) with a message when one does not hold:
 - importing dmem, dmem.numba, dmem.cupy, dmem.torch (and the libraries)
   creates no CUDA context;
 - dmem's statistics and Numba's get_memory_info agree with what was
   allocated (raw_used counts every live array; total is the device limit);
 - spillable dmem buffers filling the device limit are spilled to make room
   for Numba, CuPy and PyTorch allocations, and read back intact.
Libraries that do not import are left out (the npz says which ran).
"""

import sys

MODE = sys.argv[1]
OUT = sys.argv[2]
LIMIT = 1 << 30  # the one device limit of the dmem run

import numpy as np  # noqa: E402

if not hasattr(np, "row_stack"):  # numba-cuda 0.30 with numpy 2.5 (anchors.md)
    np.row_stack = np.vstack

if MODE == "dmem":
    import dmem
    import dmem.cupy
    import dmem.numba
    import dmem.torch

libs = {}
for name in ("numba.cuda", "cupy", "torch"):
    try:
        libs[name] = __import__(name, fromlist=["_"])
    except Exception as e:  # noqa: BLE001 - absent or broken: left out
        print(f"{name}: not used ({type(e).__name__}: {e})")


def primary_context_active():
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, flags, active = cu.cuDevicePrimaryCtxGetState(0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return bool(active)


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


results = {}
if MODE == "dmem":
    try:
        if primary_context_active():
            fail("importing dmem and its hooks (and the libraries) made a CUDA context")
        print("imports: no CUDA context")
    except ImportError:
        print("imports: cuda.bindings absent, context check skipped")
    dmem.configure(device_limit=LIMIT)
    if "numba.cuda" in libs:
        dmem.numba.use_dmem_for_numba()
    if "cupy" in libs:
        dmem.cupy.use_dmem_for_cupy()
    if "torch" in libs:
        dmem.torch.use_dmem_for_torch()
    rt = dmem.default_runtime(0)
    assert rt.backend == "cuda", rt


def raw_used():
    return rt.stats()["raw_used"]


# ---- Numba ----------------------------------------------------------------------------
if "numba.cuda" in libs:
    cuda = libs["numba.cuda"]

    @cuda.jit
    def axpb(out, x, a, b):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = a * x[i] + b

    x = np.arange(1 << 20, dtype=np.float32) % 977
    dx = cuda.to_device(x)
    dout = cuda.device_array_like(dx)
    axpb[(x.size + 255) // 256, 256](dout, dx, np.float32(3.0), np.float32(0.5))
    results["numba_axpb"] = dout.copy_to_host()
    if MODE == "dmem":
        mm = cuda.current_context().memory_manager
        if type(mm).__name__ != "DmemNumbaManager":
            fail(f"Numba's memory manager is {type(mm).__name__}")
        used = raw_used()
        if used < dx.nbytes + dout.nbytes:
            fail(f"raw_used {used} < the Numba arrays' {dx.nbytes + dout.nbytes} bytes")
        free, total = cuda.current_context().get_memory_info()
        if total != LIMIT or free > LIMIT - used:
            fail(f"Numba get_memory_info {free, total} vs limit {LIMIT}, raw_used {used}")
        if (free, total) != rt.memory_info():
            print("note: memory_info moved between the two reads")
        before = raw_used()
        del dx
        if raw_used() != before - x.nbytes:
            fail(f"freeing a Numba array: raw_used {before} -> {raw_used()}")
        print(f"numba: kernel ran; raw_used {used}; memory info {free, total}")

# ---- CuPy -------------------------------------------------------------------------------
if "cupy" in libs:
    cp = libs["cupy"]
    rs = np.random.RandomState(1)
    a_h = rs.standard_normal((512, 512)).astype(np.float64)
    a = cp.asarray(a_h)
    s = cp.cuda.Stream(non_blocking=True)
    with s:  # a non-default stream: allocations and frees in its order
        b = a @ a.T + 1.0
        c = cp.cumsum(cp.arange(1 << 16, dtype=cp.int64) % 7)
        tmp = cp.empty(1 << 20, dtype=cp.uint8)
        del tmp
    s.synchronize()
    results["cupy_gemm"] = cp.asnumpy(b)
    results["cupy_cumsum"] = cp.asnumpy(c)
    del s  # the stream goes while `b` and `c` live on
    if MODE == "dmem":
        if cp.cuda.get_allocator() is not dmem.cupy.allocator:
            fail(f"CuPy's allocator is {cp.cuda.get_allocator()!r}")
        owner = b.data.mem._owner if hasattr(b.data.mem, "_owner") else None
        if not isinstance(owner, dmem.DeviceMemory):
            fail(f"a CuPy array's memory is not dmem's: {b.data.mem!r}")
        print(f"cupy: gemm and cumsum ran; raw_used {raw_used()}")
    del b, c

# ---- PyTorch: a small MLP, 20 training steps ---------------------------------------------
if "torch" in libs:
    torch = libs["torch"]
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(20, 128, 256, generator=g).cuda()
    ys = torch.randint(0, 10, (20, 128), generator=g).cuda()
    for i in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    results["torch_loss"] = np.array([loss.item()])
    results["torch_weight"] = model[0].weight.detach().cpu().numpy()
    if MODE == "dmem":
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        if raw_used() < params + xs.nbytes + ys.nbytes:
            fail(f"raw_used {raw_used()} does not cover the tensors")
        print(f"torch: 20 steps, loss {loss.item():.6f}; raw_used {raw_used()}")

# ---- one device limit: spillable buffers make room for the three --------------------------
if MODE == "dmem":
    pattern = bytes(range(256)) * (64 << 10)  # 16 MiB
    bufs = []
    while (rt.stats()["device_used"] + len(pattern) <= LIMIT
           and len(bufs) < LIMIT // len(pattern)):
        b = rt.alloc(len(pattern))
        b.write(pattern)
        bufs.append(b)
    spilled0 = rt.stats()["spill_count"]
    grabbed = {}
    if "numba.cuda" in libs:
        grabbed["numba"] = libs["numba.cuda"].device_array(64 << 20, dtype=np.uint8)
    if "cupy" in libs:
        grabbed["cupy"] = libs["cupy"].ones(64 << 20, dtype=libs["cupy"].uint8)
    if "torch" in libs:
        grabbed["torch"] = libs["torch"].ones(64 << 20, dtype=libs["torch"].uint8, device="cuda")
    st = rt.stats()
    if grabbed and st["spill_count"] <= spilled0:
        fail(f"no buffer spilled to make room: {st}")
    if st["device_used"] > LIMIT:
        fail(f"device_used {st['device_used']} passed the limit {LIMIT}")
    for b in bufs:
        if b.read() != pattern:
            fail("a spilled buffer came back wrong")
    if "cupy" in grabbed and int(grabbed["cupy"].sum()) != 64 << 20:
        fail("the CuPy array allocated under pressure is wrong")
    if "torch" in grabbed and int(grabbed["torch"].sum().item()) != 64 << 20:
        fail("the PyTorch tensor allocated under pressure is wrong")
    print(f"one limit: {len(bufs)} buffers of 16 MiB, {st['spill_count'] - spilled0} spills "
          f"for {len(grabbed)} raw allocations of 64 MiB; device_used {st['device_used']}, "
          f"raw_used {st['raw_used']}; buffers read back intact")
    del grabbed, bufs

np.savez(OUT, **results)
print(f"{MODE}: ran {sorted(results)}")
