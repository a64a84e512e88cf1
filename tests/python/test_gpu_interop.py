"""GPU interop: CuPy, Numba and PyTorch consuming dmem views (CUDA array
interface v3, DLPack) and running real kernels on the locked bytes, then
spill / unspill and a byte-exact check with buf.read().

What a view hands out keeps the buffer locked while it lives (issue 12):
an array built from __cuda_array_interface__ keeps the View as its owner, so
the tests drop the array *and* the view before spilling; a DLPack tensor
holds the buffer until its deleter runs.

Skipped unless the CUDA backend starts (and per library, unless it is
installed)."""

import gc

import pytest

import dmem

N = 1 << 20  # bytes per buffer


@pytest.fixture(scope="module")
def rt():
    try:
        r = dmem.Runtime(backend="cuda", device_limit=256 << 20)
    except (dmem.NoDeviceError, dmem.DeviceError) as e:
        pytest.skip(f"CUDA backend unavailable: {e}")
    if r.backend != "cuda":
        r.close()
        pytest.skip("not the CUDA backend")
    yield r
    r.close()


def pattern(n=N):
    return bytes(i & 0xFF for i in range(n))


def plus(data, k):
    return bytes((b + k) & 0xFF for b in data)


def spill_roundtrip(rt, buf, expected):
    for tier in ("host", "disk"):
        buf.spill(tier)
        assert buf.state == "deferred_" + tier
        buf.unspill()
        rt.synchronize()
        assert buf.read() == expected
    buf.spill("host")
    assert buf.read() == expected  # read retrieves on its own


# ---- the interfaces themselves --------------------------------------------------

def test_cuda_array_interface_fields(rt):
    b = rt.alloc(N)
    s = rt.stream()
    with b.lock() as v:
        cai = v.__cuda_array_interface__
        assert cai["version"] == 3
        assert cai["shape"] == (N,)
        assert cai["typestr"] == "|u1"
        assert cai["data"] == (v.ptr, False)
        assert cai["strides"] is None
        assert cai["stream"] == 1  # legacy default stream
        assert v.__dlpack_device__() == (2, rt.device)  # kDLCUDA
        assert not hasattr(v, "__array_interface__")
        with pytest.raises(BufferError):
            memoryview(v)  # device memory: no buffer protocol under CUDA
    with b.lock(s) as v:
        assert v.__cuda_array_interface__["stream"] == int(s)
    with pytest.raises(dmem.NotLockedError):
        v.__cuda_array_interface__
    assert b.exposed  # the interface was taken: v is an export until it dies
    with pytest.raises(dmem.BusyError):
        s.close()
    del v
    assert not b.exposed and b.lock_count == 0
    s.close()


def test_read_write_spill_cuda(rt):
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    spill_roundtrip(rt, b, data)


# ---- CuPy ---------------------------------------------------------------------------

def test_cupy_asarray_kernel_spill(rt):
    cupy = pytest.importorskip("cupy")
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("disk")  # the lock retrieves it on the CuPy stream
    cs = cupy.cuda.Stream(non_blocking=True)
    with cs:
        with b.lock(cs) as view:
            a = cupy.asarray(view)
            assert a.dtype == cupy.uint8 and a.shape == (N,)
            assert a.data.ptr == view.ptr
            a += 1  # elementwise kernel on cs
            del a
    del view  # the array's owner: the buffer stays locked while it lives
    gc.collect()
    assert not b.exposed
    expected = plus(data, 1)
    assert b.read() == expected
    spill_roundtrip(rt, b, expected)


def test_cupy_from_dlpack(rt):
    cupy = pytest.importorskip("cupy")
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("host")
    with b.lock() as view:  # default stream; CuPy's current stream is the null stream
        a = cupy.from_dlpack(view)
        assert a.data.ptr == view.ptr
        a *= 2
        del a
    expected = bytes((x * 2) & 0xFF for x in data)
    assert b.read() == expected
    spill_roundtrip(rt, b, expected)


def test_cupy_raw_kernel_in_lock_and_launch(rt):
    cupy = pytest.importorskip("cupy")
    inc = cupy.RawKernel(r'''
    extern "C" __global__ void inc(unsigned char *p, unsigned long long n) {
        unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
        if (i < n) p[i] += 3;
    }''', "inc")
    a, c = rt.alloc(N), rt.alloc(N)
    data = pattern()
    a.write(data)
    c.write(data)
    a.spill("disk")

    def launch(stream, ptrs):
        assert stream is None
        for p in ptrs:
            inc(((N + 255) // 256,), (256,), (cupy.uintp(p), cupy.uint64(N)))

    rt.lock_and_launch([a, c], launch)  # synchronises before unlocking
    for b in (a, c):
        assert b.read() == plus(data, 3)
    spill_roundtrip(rt, a, plus(data, 3))


def test_cupy_launch_async_on_stream(rt):
    cupy = pytest.importorskip("cupy")
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("host")
    s = rt.stream()
    cs = (cupy.cuda.Stream.from_external(s) if hasattr(cupy.cuda.Stream, "from_external")
          else cupy.cuda.ExternalStream(int(s)))

    def launch(stream, ptrs):
        mem = cupy.cuda.UnownedMemory(ptrs[0], N, None)
        arr = cupy.ndarray((N,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        with cs:
            arr += 5

    rt.launch_async(s, [b], launch)
    rt.stream_release(s)  # unlock once the kernel is done, no host stall
    s.synchronize()
    rt.poll()
    assert b.lock_count == 0
    assert b.read() == plus(data, 5)
    spill_roundtrip(rt, b, plus(data, 5))
    s.close()


def test_cupy_asarray_keeps_buffer_locked(rt):
    cupy = pytest.importorskip("cupy")
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("disk")
    base = rt.stats()["exposed"]  # the runtime is shared by the module's tests
    with b.lock() as view:  # default stream; CuPy's current stream is the null stream
        a = cupy.asarray(view)
        assert a.data.ptr == view.ptr
    del view  # a keeps the view as its memory's owner
    assert b.exposed and b.lock_count == 1 and b.state == "resident"
    assert rt.stats()["exposed"] == base + 1
    with pytest.raises(dmem.BusyError) as ei:
        b.spill("host")  # refused: a still uses the device memory
    assert "array-interface" in str(ei.value)
    assert b.state == "resident"
    a += 2  # after the block: still the buffer's memory
    cupy.cuda.runtime.deviceSynchronize()
    del a
    gc.collect()
    assert not b.exposed and b.lock_count == 0
    assert rt.stats()["exposed"] == base
    b.spill("host")
    assert b.state == "deferred_host"
    b.unspill()
    rt.synchronize()
    assert b.read() == plus(data, 2)


# ---- Numba --------------------------------------------------------------------------

# The kernels refer to numba.cuda as a module global: Numba compiles no
# import statement inside a kernel.
try:
    from numba import cuda as nc
except Exception:  # noqa: BLE001 - numba absent or broken: the tests skip
    nc = None

def numba_cuda_or_skip():
    numba_cuda = pytest.importorskip("numba.cuda")
    if not numba_cuda.is_available():
        pytest.skip("numba.cuda not available")
    return numba_cuda


def numba_jit_or_skip(numba_cuda, pyfunc, *example_args):
    """Compile a kernel; skip (with the reason) if Numba's own JIT is broken in
    this environment (e.g. numba-cuda older than the installed NumPy)."""
    try:
        kernel = numba_cuda.jit(pyfunc)
        kernel[1, 1](*example_args)
        numba_cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the environment, not dmem
        pytest.skip(f"numba.cuda.jit unusable here: {type(e).__name__}: {e}")
    return kernel


def _inc7(a):
    i = nc.grid(1)
    if i < a.size:
        a[i] += 7


def _fill(a, v):
    i = nc.grid(1)
    if i < a.size:
        a[i] = v


def test_numba_as_cuda_array_kernel_spill(rt):
    numba_cuda = numba_cuda_or_skip()
    np = pytest.importorskip("numpy")
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("disk")
    s = rt.stream()
    ns = numba_cuda.external_stream(int(s))
    with b.lock(s) as view:  # the retrieve is queued on s
        arr = numba_cuda.as_cuda_array(view)
        assert arr.shape == (N,) and arr.dtype == np.uint8
        assert arr.__cuda_array_interface__["data"][0] == view.ptr
        host = arr.copy_to_host(stream=ns)  # ordered after the retrieve
        ns.synchronize()
        assert host.tobytes() == data
        del arr
    del view  # the array's owner (as_cuda_array keeps it)
    gc.collect()
    assert not b.exposed
    inc = numba_jit_or_skip(numba_cuda, _inc7, numba_cuda.device_array(1, dtype=np.uint8))
    b.spill("host")
    with b.lock(s) as view:
        arr = numba_cuda.as_cuda_array(view)
        inc[(N + 255) // 256, 256, ns](arr)
        del arr
    del view
    gc.collect()
    assert not b.exposed
    expected = plus(data, 7)
    assert b.read() == expected
    spill_roundtrip(rt, b, expected)
    s.close()


def test_numba_stream_object_accepted(rt):
    numba_cuda = numba_cuda_or_skip()
    np = pytest.importorskip("numpy")
    b = rt.alloc(N)
    b.write(b"\x02" * N)
    b.spill("disk")
    ns = numba_cuda.stream()
    with b.lock(ns) as view:  # a Numba stream object as the lock stream
        assert view.stream == int(ns.handle.value if hasattr(ns.handle, "value") else ns.handle)
        arr = numba_cuda.as_cuda_array(view)
        host = arr.copy_to_host(stream=ns)
        ns.synchronize()
        assert host.tobytes() == b"\x02" * N
        del arr
    del view
    gc.collect()
    fill = numba_jit_or_skip(numba_cuda, _fill, numba_cuda.device_array(1, dtype=np.uint8), 0)
    with b.lock(ns) as view:
        arr = numba_cuda.as_cuda_array(view)
        fill[(N + 255) // 256, 256, ns](arr, 9)
        del arr
    del view
    gc.collect()
    assert not b.exposed
    assert b.read() == b"\x09" * N
    spill_roundtrip(rt, b, b"\x09" * N)


# ---- PyTorch -------------------------------------------------------------------------

def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def test_torch_from_dlpack_default_stream(rt):
    torch = torch_cuda()
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("host")
    with b.lock() as view:
        t = torch.from_dlpack(view)
        assert t.is_cuda and t.dtype == torch.uint8 and t.shape == (N,)
        assert t.data_ptr() == view.ptr
        t.add_(11)
        del t
    expected = plus(data, 11)
    assert b.read() == expected
    spill_roundtrip(rt, b, expected)


def test_torch_from_dlpack_own_stream(rt):
    torch = torch_cuda()
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("disk")
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        with b.lock(ts) as view:  # the retrieve is ordered on the torch stream
            t = torch.from_dlpack(view)
            t.sub_(1)
            del t
    expected = plus(data, -1)
    assert b.read() == expected
    spill_roundtrip(rt, b, expected)


def test_torch_consumer_on_other_stream_is_synchronised(rt):
    torch = torch_cuda()
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("disk")
    s = rt.stream()  # lock stream differs from torch's current stream
    with b.lock(s) as view:
        t = torch.from_dlpack(view)  # __dlpack__ synchronises s for torch's stream
        assert bytes(t[:256].cpu().numpy()) == data[:256]
        del t
    s.close()


def test_torch_from_dlpack_tensor_keeps_buffer_locked(rt):
    torch = torch_cuda()
    b = rt.alloc(N)
    data = pattern()
    b.write(data)
    b.spill("host")
    with b.lock() as view:
        t = torch.from_dlpack(view)
        assert t.data_ptr() == view.ptr
    assert view.exports["dlpack"] == 1
    del view  # the capsule's tensor holds the buffer, not the name
    assert b.exposed and b.lock_count == 1
    with pytest.raises(dmem.BusyError) as ei:
        b.spill("disk")
    assert "DLPack" in str(ei.value)
    t.add_(5)  # after the block: still the buffer's memory
    u = t[100:200]  # shares the storage: holds the buffer too
    torch.cuda.synchronize()
    del t
    gc.collect()
    assert b.exposed
    del u  # the storage dies: torch calls the DLPack deleter
    gc.collect()
    assert not b.exposed and b.lock_count == 0
    b.spill("disk")
    assert b.state == "deferred_disk"
    b.unspill()
    rt.synchronize()
    assert b.read() == plus(data, 5)
